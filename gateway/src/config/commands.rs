//! The arguments of the subcommands other than `serve`: `mcp`, `audit`, `packages`, `image`,
//! `keys` and the one-shot `run`.

use super::{Config, EngineChoice, RuntimeChoice};
use clap::{Args, Subcommand};
use std::path::PathBuf;

/// `kernelgate mcp`. Without `--url` it manages kernels itself, in a runtime directory of
/// its own: the first free `<--runtime-dir>/<n>` (each locked by one process).
#[derive(Debug, Clone, Args)]
#[command(mut_arg("runtime_dir", |a| a.default_value("/run/kernelgate-mcp")))]
#[command(mut_arg("pool_size", |a| a.default_value("1")))]
#[command(mut_arg("hibernate_after", |a| a.default_value("0")))]
#[command(mut_arg("hibernate_dir", |a| a.default_value("/var/lib/kernelgate-mcp/hibernated")))]
// HTTP-only flags: nothing listens here.
#[command(mut_arg("listen", |a| a.hide(true)))]
#[command(mut_arg("token", |a| a.help("Token of the gateway given with --url; a flag shows in the process list: prefer --token-file, or KERNELGATE_TOKEN")))]
#[command(mut_arg("keys", |a| a.hide(true)))]
#[command(mut_arg("no_auth", |a| a.hide(true)))]
#[command(mut_arg("allow_origin", |a| a.hide(true)))]
#[command(mut_arg("metrics_public", |a| a.hide(true)))]
#[command(mut_arg("metrics_token", |a| a.hide(true)))]
pub struct McpArgs {
    /// Base URL of a running gateway (`http://host:port`) whose kernels to use instead of
    /// the local Docker engine, with its token in `--token-file` or `KERNELGATE_TOKEN`.
    #[arg(long, env = "KERNELGATE_URL")]
    pub url: Option<String>,

    /// A file holding the token of the gateway given with `--url` (a trailing newline is
    /// ignored): unlike `--token`, it stays out of the process list and the host's config.
    /// Not with `--token` or `KERNELGATE_TOKEN`.
    #[arg(
        long,
        env = "KERNELGATE_TOKEN_FILE",
        value_name = "PATH",
        conflicts_with = "token",
        requires = "url"
    )]
    pub token_file: Option<PathBuf>,

    #[command(flatten)]
    pub config: Config,
}

#[derive(Debug, Clone, Args)]
pub struct AuditArgs {
    /// The audit log; default: the gateway's default.
    #[arg(long, env = "KERNELGATE_AUDIT_LOG")]
    pub file: Option<PathBuf>,
    /// Only events about this kernel.
    #[arg(long)]
    pub kernel: Option<String>,
    /// Only events of this key.
    #[arg(long)]
    pub key: Option<String>,
    /// Only events at or after this time (RFC 3339, e.g. 2026-11-25T10:00:00Z).
    #[arg(long)]
    pub since: Option<String>,
    /// Print the matching records as JSON lines.
    #[arg(long)]
    pub json: bool,
}

/// Where the audit log goes unless `--audit-log` says: a persistent place (not /run).
pub fn default_audit_log() -> PathBuf {
    let root = std::env::var("USER").is_ok_and(|u| u == "root")
        || std::fs::metadata("/proc/self")
            .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
            .unwrap_or(false);
    if root {
        return PathBuf::from("/var/log/kernelgate/audit.log");
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".local/state/kernelgate/audit.log")
}

#[derive(Debug, Clone, Args)]
pub struct PackagesArgs {
    /// The allowlist file: requirement specifiers, one a line (`NAME=FILE` is taken as
    /// FILE, so the gateway's KERNELGATE_PACKAGES works here).
    #[arg(long, global = true, env = "KERNELGATE_PACKAGES", value_name = "FILE")]
    pub packages: Option<String>,
    /// What runs the sync's throwaway sandboxes and reads the image: `docker` or `gvisor`
    /// (runsc directly, images from --image-store; no Docker), as `serve --engine`.
    #[arg(
        long,
        global = true,
        env = "KERNELGATE_ENGINE",
        value_enum,
        default_value = "docker"
    )]
    pub engine: EngineChoice,
    /// The image store of `--engine gvisor`.
    #[arg(
        long,
        global = true,
        env = "KERNELGATE_IMAGE_STORE",
        value_name = "DIR",
        default_value = crate::images::DEFAULT_IMAGE_STORE
    )]
    pub image_store: PathBuf,
    /// The runsc binary of `--engine gvisor`.
    #[arg(long, global = true, env = "KERNELGATE_RUNSC")]
    pub runsc: Option<PathBuf>,
    #[command(subcommand)]
    pub action: PackagesAction,
}

#[derive(Debug, Clone, Subcommand)]
pub enum PackagesAction {
    /// Allows packages: adds requirement specifiers (`seaborn`, `scikit-learn==1.5.2`) to
    /// the file, creating it if needed. Then sync, and send SIGHUP to a running gateway.
    Add {
        #[arg(required = true, value_name = "REQUIREMENT")]
        requirements: Vec<String>,
    },
    /// Removes packages from the file (kernels that installed them keep them until their
    /// restart). Send SIGHUP to a running gateway.
    Remove {
        #[arg(required = true, value_name = "NAME")]
        names: Vec<String>,
    },
    /// Lists the allowed packages and, with --wheelhouse, the version synced for the image.
    List {
        #[arg(long, env = "KERNELGATE_WHEELHOUSE", value_name = "DIR")]
        wheelhouse: Option<PathBuf>,
        /// The image whose sync to show (default: the gateway's default image).
        #[arg(
            long,
            env = "KERNELGATE_IMAGE",
            default_value = "kernelgate-kernel:latest"
        )]
        image: String,
    },
    /// Resolves the allowlist with pip on this host for the image's own Python (version,
    /// ABI, platform, installed packages), downloads the wheels it lacks and unpacks them
    /// into the wheelhouse with a lock file. The only step that needs a package index
    /// (or --find-links).
    Sync {
        #[arg(long, env = "KERNELGATE_WHEELHOUSE", value_name = "DIR")]
        wheelhouse: PathBuf,
        /// A directory of wheels to use instead of a package index (air-gapped sites);
        /// repeatable.
        #[arg(long = "find-links", value_name = "DIR")]
        find_links: Vec<PathBuf>,
        /// The kernel image to sync for (default: the gateway's default image).
        #[arg(
            long,
            env = "KERNELGATE_IMAGE",
            default_value = "kernelgate-kernel:latest"
        )]
        image: String,
        /// A host Python that has pip (`python3 -m pip` must work).
        #[arg(long, default_value = "python3", value_name = "PATH")]
        python: PathBuf,
        /// Container runtime of the sync's throwaway containers (the image's Python
        /// facts, compiling what was unpacked), as `serve --runtime`: `runsc`, `runc`, or
        /// `auto` (gVisor when set up).
        #[arg(long, env = "KERNELGATE_RUNTIME", value_enum, default_value = "auto")]
        runtime: RuntimeChoice,
    },
}

impl PackagesArgs {
    /// The allowlist file, or a message saying how to name it.
    pub fn file(&self) -> Result<PathBuf, String> {
        let value = self
            .packages
            .as_deref()
            .ok_or("name the allowlist file with --packages FILE (or KERNELGATE_PACKAGES)")?;
        let file = value.rsplit_once('=').map_or(value, |(_, f)| f).trim();
        if file.is_empty() {
            return Err("--packages: the file is missing".to_owned());
        }
        Ok(PathBuf::from(file))
    }
}

#[derive(Debug, Clone, Args)]
pub struct ImageArgs {
    /// The image store: one unpacked root filesystem per image id, and the tags.
    #[arg(
        long,
        global = true,
        env = "KERNELGATE_IMAGE_STORE",
        value_name = "DIR",
        default_value = crate::images::DEFAULT_IMAGE_STORE
    )]
    pub image_store: PathBuf,
    #[command(subcommand)]
    pub action: ImageAction,
}

#[derive(Debug, Clone, Subcommand)]
pub enum ImageAction {
    /// Imports the images of an archive as `docker save` writes it (`docker save IMAGE -o
    /// FILE`, or `make image-archive`) or an OCI image layout tar; gzip'd is fine. An image
    /// already stored only gets the archive's tags.
    Import {
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// Lists the stored images: id, size, tags.
    List,
}

#[derive(Debug, Clone, Args)]
pub struct KeysArgs {
    /// The keys file.
    #[arg(
        long,
        global = true,
        env = "KERNELGATE_KEYS",
        default_value = "kernelgate-keys.toml"
    )]
    pub file: PathBuf,
    #[command(subcommand)]
    pub action: KeysAction,
}

#[derive(Debug, Clone, Subcommand)]
pub enum KeysAction {
    /// Adds a key and prints its token (only the token, on stdout; the file keeps its
    /// SHA-256). A running gateway picks it up on SIGHUP.
    Add {
        name: String,
        /// Sees and manages every tenant's kernels.
        #[arg(long)]
        admin: bool,
        /// Kernels this key may run at once.
        #[arg(long)]
        max_kernels: Option<usize>,
        /// Kernels this key may keep hibernated at once.
        #[arg(long)]
        max_hibernated: Option<usize>,
        /// Memory limit per kernel, at most (MiB).
        #[arg(long)]
        max_memory_mb: Option<u64>,
        /// CPU quota per kernel, at most.
        #[arg(long)]
        max_cpus: Option<f64>,
        /// Snapshots this key may keep (default: --snapshots-per-key).
        #[arg(long)]
        max_snapshots: Option<usize>,
        /// MiB this key's snapshots may take together (default: --snapshot-key-max-mb).
        #[arg(long)]
        snapshot_max_mb: Option<u64>,
    },
    /// Lists the keys' names and limits.
    List,
    /// Removes a key; a running gateway revokes it on SIGHUP.
    Remove { name: String },
}

/// `kernelgate run NOTEBOOK.ipynb`: runs every code cell in order on a fresh kernel of a
/// gateway (a local one started for the run when no `--url` is given) and writes the
/// notebook with its outputs. Exits non-zero when a cell fails, unless `--allow-errors`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// The notebook to execute (nbformat 4 JSON).
    pub notebook: PathBuf,

    /// Where to write the executed notebook; default: NOTEBOOK with `.executed.ipynb`.
    #[arg(short, long)]
    pub output: Option<PathBuf>,

    /// Base URL of a running gateway (`http://host:port`); without it a local gateway is
    /// started for this run and stopped after it.
    #[arg(long, env = "KERNELGATE_URL")]
    pub url: Option<String>,

    /// Token of the gateway given with `--url`.
    #[arg(long, env = "KERNELGATE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,

    /// Keep running after a cell fails, and exit 0; the error is in the cell's outputs.
    #[arg(long, default_value_t = false)]
    pub allow_errors: bool,

    /// Seconds one cell may run before it is interrupted and counted as failed; 0 never.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,

    /// Kernel spec to start; default: the notebook's `metadata.kernelspec.name`, else python3.
    #[arg(long)]
    pub kernel_name: Option<String>,

    /// Kernel container image of the local gateway (ignored with `--url`).
    #[arg(
        long,
        env = "KERNELGATE_IMAGE",
        default_value = "kernelgate-kernel:latest"
    )]
    pub image: String,
}

impl RunArgs {
    /// The arguments as the runner (`kernelgate_client::notebook`) takes them.
    pub fn into_client(self) -> kernelgate_client::notebook::RunArgs {
        kernelgate_client::notebook::RunArgs {
            notebook: self.notebook,
            output: self.output,
            url: self.url,
            token: self.token,
            allow_errors: self.allow_errors,
            timeout: self.timeout,
            kernel_name: self.kernel_name,
            image: self.image,
        }
    }
}
