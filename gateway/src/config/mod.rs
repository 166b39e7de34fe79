//! One `Config`, from command-line flags and `KERNELGATE_*` environment variables.

use clap::{Args, Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;

mod commands;
pub use commands::{
    default_audit_log, AuditArgs, ImageAction, ImageArgs, KeysAction, KeysArgs, McpArgs,
    PackagesAction, PackagesArgs, RunArgs,
};

#[derive(Debug, Parser)]
#[command(
    name = "kernelgate",
    version,
    about = "A Jupyter kernel gateway: every kernel in its own locked-down Docker container."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start the gateway (Jupyter Server's kernel REST API and WebSocket channels).
    Serve(Box<Config>),
    /// Execute a notebook through a gateway and write it with its outputs.
    Run(Box<RunArgs>),
    /// Manage the keys file (`--keys`): one key per tenant.
    Keys(KeysArgs),
    /// Read the audit log back as a table (or JSON lines).
    Audit(AuditArgs),
    /// Manage the package allowlist (`--packages`) and fill the wheelhouse kernels
    /// install from (docs/packages.md).
    Packages(PackagesArgs),
    /// Manage the image store kernels are run from without Docker (docs/image-store.md).
    Image(ImageArgs),
    /// Serve MCP (Model Context Protocol) over stdin/stdout, for hosts that launch a
    /// command: kernels run on the local Docker engine (every `serve` flag that applies
    /// works here), or on a running gateway with `--url` (and its token).
    Mcp(Box<McpArgs>),
}

/// How log lines are written (to stderr).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Which engine runs kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineChoice {
    /// Containers through the local Docker daemon (`--runtime` picks runc or gVisor).
    Docker,
    /// gVisor sandboxes run by runsc directly, from OCI bundles the gateway writes.
    Gvisor,
}

/// Which OCI runtime runs kernel containers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RuntimeChoice {
    /// gVisor when the Docker engine has `kernelgate-runsc` registered, else runc (with a
    /// warning).
    Auto,
    /// Docker's runc: namespaces, cgroups and seccomp on the host's Linux kernel.
    Runc,
    /// gVisor (`kernelgate-runsc`, set up by `make gvisor`): a user-space kernel between
    /// the kernel's code and the host's.
    Runsc,
    /// gVisor on Debian's own runsc and the ptrace platform (`kernelgate-runsc-ptrace`, also
    /// registered by `make gvisor`): slower; for comparison, or a host where the newer runsc
    /// misbehaves.
    RunscPtrace,
}

/// Everything `kernelgate serve` can be told. Each flag is also an environment variable.
#[derive(Debug, Clone, Args)]
pub struct Config {
    /// Address to listen on.
    #[arg(long, env = "KERNELGATE_LISTEN", default_value = "127.0.0.1:8888")]
    pub listen: SocketAddr,

    /// Token clients must present (`Authorization: token T`, `Bearer T` or `?token=T`).
    /// When not given, a random one is generated and printed once.
    #[arg(long, env = "KERNELGATE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// Keys file (TOML): one key per tenant, with its SHA-256 and limits; re-read on SIGHUP.
    /// Works alone or beside `--token` (then one more admin key, named `admin`).
    #[arg(long, env = "KERNELGATE_KEYS")]
    pub keys: Option<PathBuf>,

    /// Audit log: one JSON line per event (kernels, executions with their code, files,
    /// refused logins); `-` for stdout, `off` for none. Default: /var/log/kernelgate/audit.log as root,
    /// else ~/.local/state/kernelgate/audit.log. Created mode 0600: code can hold secrets.
    #[arg(long, env = "KERNELGATE_AUDIT_LOG")]
    pub audit_log: Option<PathBuf>,

    /// Also wait for each audit record to reach the disk (fdatasync, shared by concurrent
    /// writers), for power-loss durability.
    #[arg(long, env = "KERNELGATE_AUDIT_FSYNC", default_value_t = false)]
    pub audit_fsync: bool,

    /// Execution policy (TOML, docs/policy.md): rules that deny code, or hold it until an
    /// admin approves, by the modules it imports, the functions it calls and shell escapes.
    /// A guardrail, not a wall: the container is the wall.
    #[arg(long, env = "KERNELGATE_POLICY")]
    pub policy: Option<PathBuf>,

    /// Seconds an execution held by an `ask` rule waits for an answer before it is denied.
    #[arg(long, env = "KERNELGATE_APPROVAL_TIMEOUT", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    pub approval_timeout: u64,

    /// Serve without any token. Refused unless listening on a loopback address.
    #[arg(long, env = "KERNELGATE_NO_AUTH", default_value_t = false)]
    pub no_auth: bool,

    /// Kernel container image.
    #[arg(
        long,
        env = "KERNELGATE_IMAGE",
        default_value = "kernelgate-kernel:latest"
    )]
    pub image: String,

    /// What runs kernels: `docker` (containers through the Docker daemon; membership of
    /// the docker group suffices) or `gvisor` (runsc sandboxes directly, no Docker; needs
    /// root).
    #[arg(long, env = "KERNELGATE_ENGINE", value_enum, default_value = "docker")]
    pub engine: EngineChoice,

    /// The runsc binary of `--engine gvisor` (default: the one `make gvisor` unpacked,
    /// else /usr/bin/runsc).
    #[arg(long, env = "KERNELGATE_RUNSC")]
    pub runsc: Option<PathBuf>,

    /// Where `--engine gvisor` finds images: the image store `kernelgate image import`
    /// fills (docs/image-store.md).
    #[arg(
        long,
        env = "KERNELGATE_IMAGE_STORE",
        value_name = "DIR",
        default_value = crate::images::DEFAULT_IMAGE_STORE
    )]
    pub image_store: PathBuf,

    /// The cgroup `--engine gvisor` places its sandboxes under: an absolute path of each
    /// hierarchy, or `sibling`: beside the gateway's own cgroup (`/proc/self/cgroup`), for
    /// a gateway in a container (docs/engines.md, "Kubernetes without Docker").
    #[arg(
        long,
        env = "KERNELGATE_CGROUP_PARENT",
        value_name = "PATH|sibling",
        default_value = "/kernelgate"
    )]
    pub cgroup_parent: String,

    /// Container runtime of kernels: `runsc` (gVisor, a second wall; `make gvisor` sets it
    /// up), `runc`, or `auto` (gVisor when set up).
    #[arg(long, env = "KERNELGATE_RUNTIME", value_enum, default_value = "auto")]
    pub runtime: RuntimeChoice,

    /// Host directory holding one socket directory per kernel (paths must stay short:
    /// Unix sockets allow 107 bytes).
    #[arg(
        long,
        env = "KERNELGATE_RUNTIME_DIR",
        default_value = "/run/kernelgate"
    )]
    pub runtime_dir: PathBuf,

    /// Most kernels alive at once; creating one more answers 403.
    #[arg(long, env = "KERNELGATE_MAX_KERNELS", default_value_t = 32, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_kernels: usize,

    /// Kernels idle (no connection, not busy) for this many seconds are shut down; 0 never.
    #[arg(long, env = "KERNELGATE_CULL_IDLE_TIMEOUT", default_value_t = 3600)]
    pub cull_idle_timeout: u64,

    /// Kernels with no execution for this many seconds hibernate: their variables, files
    /// and history go to --hibernate-dir and their container is removed; the next request
    /// brings them back (docs/hibernation.md). 0 never.
    #[arg(long, env = "KERNELGATE_HIBERNATE_AFTER", default_value_t = 600)]
    pub hibernate_after: u64,

    /// Where hibernated kernels' state is kept, on disk (one gateway per directory).
    #[arg(
        long,
        env = "KERNELGATE_HIBERNATE_DIR",
        default_value = "/var/lib/kernelgate/hibernated"
    )]
    pub hibernate_dir: PathBuf,

    /// Most MiB of state (variables and files) one kernel may hibernate with; a larger
    /// state keeps the kernel running.
    #[arg(long, env = "KERNELGATE_HIBERNATE_MAX_MB", default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    pub hibernate_max_mb: u64,

    /// Most kernels hibernated at once; past it idle kernels keep running.
    #[arg(long, env = "KERNELGATE_MAX_HIBERNATED", default_value_t = 256, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..))]
    pub max_hibernated: usize,

    /// Most kernels one key may keep hibernated (a key's `max_hibernated` in the keys file
    /// overrides it); 0 is a quarter of --max-hibernated.
    #[arg(long, env = "KERNELGATE_MAX_HIBERNATED_PER_KEY", default_value_t = 0)]
    pub max_hibernated_per_key: usize,

    /// Most MiB of state one key's hibernated kernels may take on disk together.
    #[arg(long, env = "KERNELGATE_HIBERNATE_KEY_MAX_MB", default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
    pub hibernate_key_max_mb: u64,

    /// Seconds pickling a kernel's variables may take before the save is interrupted and
    /// the kernel keeps running, blocked from hibernating until its next execution.
    #[arg(long, env = "KERNELGATE_HIBERNATE_SAVE_TIMEOUT", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    pub hibernate_save_timeout: u64,

    /// Seconds a command the gateway runs in a kernel's sandbox may take (taking a state
    /// out or putting it back, the files API) before it is killed.
    #[arg(long, env = "KERNELGATE_SANDBOX_COMMAND_TIMEOUT", default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    pub sandbox_command_timeout: u64,

    /// Seconds a hibernated kernel is kept before it is deleted with its state; 0 forever.
    #[arg(long, env = "KERNELGATE_HIBERNATE_RETENTION", default_value_t = 7 * 24 * 3600)]
    pub hibernate_retention: u64,

    /// Most snapshots one key may keep (a key's `max_snapshots` in the keys file overrides
    /// it); a fork's own snapshot does not count.
    #[arg(long, env = "KERNELGATE_SNAPSHOTS_PER_KEY", default_value_t = 32)]
    pub snapshots_per_key: usize,

    /// Most MiB one key's snapshots may take on disk together (a key's `snapshot_max_mb`
    /// overrides it).
    #[arg(long, env = "KERNELGATE_SNAPSHOT_KEY_MAX_MB", default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..))]
    pub snapshot_key_max_mb: u64,

    /// Seconds a snapshot is kept before it is deleted; 0 (the default) keeps it until it
    /// is deleted.
    #[arg(long, env = "KERNELGATE_SNAPSHOT_RETENTION", default_value_t = 0)]
    pub snapshot_retention: u64,

    /// Under `--engine gvisor`: start kernels by restoring a checkpoint of a preloaded
    /// kernel of their image (made once per image and runsc, in `--hibernate-dir`), not by
    /// booting one. Kernels created with environment variables boot as before.
    #[arg(long, env = "KERNELGATE_KERNEL_TEMPLATES", default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub kernel_templates: bool,

    /// Hibernate even when some variables cannot be saved (generators, connections): they
    /// are dropped, and the first output after the resume names them.
    #[arg(long, env = "KERNELGATE_HIBERNATE_LOSSY", default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub hibernate_lossy: bool,

    /// Kernels started ahead of time and handed out by `POST /api/kernels`: `N` for
    /// python3, `NAME=N` for another spec (repeatable or comma-separated; specs added
    /// with --kernelspec keep none unless given).
    #[arg(
        long,
        env = "KERNELGATE_POOL_SIZE",
        value_delimiter = ',',
        default_value = "2"
    )]
    pub pool_size: Vec<String>,

    /// More kernel specs: `NAME=IMAGE` (repeatable or comma-separated), each running
    /// its kernels in its own image (e.g. one derived as docs/custom-images.md shows).
    /// `python3` is --image.
    #[arg(
        long = "kernelspec",
        env = "KERNELGATE_KERNELSPEC",
        value_delimiter = ','
    )]
    pub kernelspecs: Vec<String>,

    /// Package allowlist: a file of requirement specifiers, one a line (`seaborn`,
    /// `scikit-learn==1.5.2`), that kernels may install offline from --wheelhouse. `FILE`
    /// for python3, `NAME=FILE` for another kernel spec (repeatable or comma-separated);
    /// re-read on SIGHUP (docs/packages.md).
    #[arg(
        long = "packages",
        env = "KERNELGATE_PACKAGES",
        value_delimiter = ',',
        value_name = "[NAME=]FILE"
    )]
    pub packages: Vec<String>,

    /// The wheelhouse `kernelgate packages sync` fills: kernels see the wheels synced for
    /// their image, read-only.
    #[arg(long, env = "KERNELGATE_WHEELHOUSE", value_name = "DIR")]
    pub wheelhouse: Option<PathBuf>,

    /// Memory limit per kernel in MiB (swap is not allowed beyond it).
    #[arg(long, env = "KERNELGATE_KERNEL_MEMORY_MB", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(64..))]
    pub kernel_memory_mb: u64,

    /// CPU limit per kernel, in cores.
    #[arg(long, env = "KERNELGATE_KERNEL_CPUS", default_value_t = 1.0)]
    pub kernel_cpus: f64,

    /// Most processes/threads per kernel container.
    #[arg(long, env = "KERNELGATE_KERNEL_PIDS", default_value_t = 256, value_parser = clap::value_parser!(i64).range(16..))]
    pub kernel_pids: i64,

    /// Size of the kernel's writable home and working directory (tmpfs), in MiB.
    #[arg(long, env = "KERNELGATE_KERNEL_DISK_MB", default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    pub kernel_disk_mb: u64,

    /// Seconds to wait for a new kernel to answer before giving up.
    #[arg(long, env = "KERNELGATE_STARTUP_TIMEOUT", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub startup_timeout: u64,

    /// Restart a kernel automatically when its process dies (clients see `restarting`).
    #[arg(long, env = "KERNELGATE_AUTORESTART", default_value_t = true, action = clap::ArgAction::Set)]
    pub autorestart: bool,

    /// Bytes of messages kept per client session while it is away or slow; past this the
    /// oldest output messages are dropped and the client is told how many.
    #[arg(long, env = "KERNELGATE_CLIENT_BUFFER_MB", default_value_t = 64, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub client_buffer_mb: usize,

    /// Origins (`https://lab.example.org`) whose web pages may use this gateway from a
    /// browser; `*` allows any. Repeatable or comma-separated. The gateway's own origin
    /// and clients that send no Origin (programs) need nothing.
    #[arg(long, env = "KERNELGATE_ALLOW_ORIGIN", value_delimiter = ',')]
    pub allow_origin: Vec<String>,

    /// Serve `/metrics` to anyone who can reach the gateway, without a token.
    #[arg(long, env = "KERNELGATE_METRICS_PUBLIC", default_value_t = false)]
    pub metrics_public: bool,

    /// A token that may read `/metrics` and nothing else (for a Prometheus scraper); the
    /// gateway's token works too.
    #[arg(long, env = "KERNELGATE_METRICS_TOKEN", hide_env_values = true)]
    pub metrics_token: Option<String>,

    /// Log lines as `text` (for people) or `json` (one object per line, for collectors).
    #[arg(
        long,
        env = "KERNELGATE_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,

    /// Output one execution may produce (stream text, display and result data), in MiB;
    /// past it the rest of that execution's output is dropped and clients are told once.
    #[arg(long, env = "KERNELGATE_MAX_OUTPUT_MB", default_value_t = 32, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_output_mb: usize,

    /// Largest WebSocket message or HTTP body accepted from a client, in MiB.
    #[arg(long, env = "KERNELGATE_MAX_MESSAGE_MB", default_value_t = 64, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_message_mb: usize,

    /// Seconds an MCP session, or a kernel MCP's start_kernel handed out, may stay unused
    /// before it ends and its kernel is deleted.
    #[arg(long, env = "KERNELGATE_MCP_IDLE_TIMEOUT", default_value_t = 1800, value_parser = clap::value_parser!(u64).range(1..))]
    pub mcp_idle_timeout: u64,

    /// Largest MCP tool result or progress notification, in KiB of serialized JSON-RPC
    /// (escaping and base64 counted). Longer text keeps its head and tail around a note;
    /// images that do not fit are replaced by notes. Clients refuse messages over 1 MiB.
    #[arg(long, env = "KERNELGATE_MCP_MAX_RESULT_KB", default_value_t = 256, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(16..=65536))]
    pub mcp_max_result_kb: usize,

    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// Cluster mode: this gateway is one node of several that clients see as one
/// (docs/cluster.md). Without `--etcd` the gateway is a single node and none of these apply.
#[derive(Debug, Clone, Default, Args)]
pub struct ClusterArgs {
    /// The cluster registry: etcd's client URLs (`http://host:2379`, or `https://` for an
    /// etcd that serves TLS), comma-separated.
    #[arg(
        long,
        env = "KERNELGATE_ETCD",
        value_delimiter = ',',
        value_name = "URL[,URL]"
    )]
    pub etcd: Vec<String>,

    /// This node's name in the cluster; default: the host name.
    #[arg(long, env = "KERNELGATE_NODE_ID")]
    pub node_id: Option<String>,

    /// How the other nodes reach this one (`http://host:port`).
    #[arg(long, env = "KERNELGATE_ADVERTISE", value_name = "URL")]
    pub advertise: Option<String>,

    /// A file holding the secret every node signs and checks node-to-node calls with (the
    /// same on every node, at least 32 bytes; a trailing newline is ignored).
    #[arg(long, env = "KERNELGATE_CLUSTER_SECRET_FILE", value_name = "PATH")]
    pub cluster_secret_file: Option<PathBuf>,

    /// Seconds a node's records outlive it in the registry: how soon the others see a node
    /// gone, against how long an etcd hiccup may last before a node counts as cut off.
    #[arg(long, env = "KERNELGATE_LEASE_TTL", default_value_t = 10, value_parser = clap::value_parser!(u64).range(2..=3600))]
    pub lease_ttl: u64,

    /// The etcd user this node authenticates as, when etcd has authentication on (give
    /// --etcd-password-file too).
    #[arg(long, env = "KERNELGATE_ETCD_USER", value_name = "NAME")]
    pub etcd_user: Option<String>,

    /// A file holding that etcd user's password (a trailing newline is ignored).
    #[arg(long, env = "KERNELGATE_ETCD_PASSWORD_FILE", value_name = "PATH")]
    pub etcd_password_file: Option<PathBuf>,

    /// PEM file of the CA that signed etcd's server certificate (`https://` endpoints);
    /// without it the system's trusted roots are used.
    #[arg(long, env = "KERNELGATE_ETCD_CA_FILE", value_name = "PATH")]
    pub etcd_ca_file: Option<PathBuf>,

    /// PEM client certificate this node shows etcd, for an etcd started with
    /// `--client-cert-auth` (give --etcd-key-file too).
    #[arg(long, env = "KERNELGATE_ETCD_CERT_FILE", value_name = "PATH")]
    pub etcd_cert_file: Option<PathBuf>,

    /// PEM private key of that client certificate.
    #[arg(long, env = "KERNELGATE_ETCD_KEY_FILE", value_name = "PATH")]
    pub etcd_key_file: Option<PathBuf>,

    /// Where this node serves the calls other nodes forward to it, over mutual TLS
    /// (host:port; give the three --cluster-*-file flags too). Clients keep using --listen,
    /// which then refuses forwarded calls.
    #[arg(long, env = "KERNELGATE_CLUSTER_LISTEN", value_name = "ADDR")]
    pub cluster_listen: Option<SocketAddr>,

    /// PEM file of the cluster's CA: the only issuer of node certificates this node trusts.
    #[arg(long, env = "KERNELGATE_CLUSTER_CA_FILE", value_name = "PATH")]
    pub cluster_ca_file: Option<PathBuf>,

    /// PEM certificate of this node, signed by the cluster's CA, whose subject alternative
    /// name is the node id (DNS:<node id>), for both server and client authentication.
    #[arg(long, env = "KERNELGATE_CLUSTER_CERT_FILE", value_name = "PATH")]
    pub cluster_cert_file: Option<PathBuf>,

    /// PEM private key of that certificate.
    #[arg(long, env = "KERNELGATE_CLUSTER_KEY_FILE", value_name = "PATH")]
    pub cluster_key_file: Option<PathBuf>,
}

impl ClusterArgs {
    /// Whether any cluster flag was given (`kernelgate mcp` refuses them all).
    pub fn any(&self) -> bool {
        !self.etcd.is_empty()
            || self.node_id.is_some()
            || self.advertise.is_some()
            || self.cluster_secret_file.is_some()
            || self.etcd_user.is_some()
            || self.etcd_password_file.is_some()
            || self.etcd_ca_file.is_some()
            || self.etcd_cert_file.is_some()
            || self.etcd_key_file.is_some()
            || self.cluster_listen.is_some()
            || self.cluster_ca_file.is_some()
            || self.cluster_cert_file.is_some()
            || self.cluster_key_file.is_some()
    }
}
