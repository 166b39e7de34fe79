//! Where kernels run. A [`KernelBackend`] is one engine of sandboxes: it starts a kernel
//! process somewhere isolated, hands back the host-side connection info for its sockets,
//! and stops, interrupts and watches it; it creates sandboxes from an engine-neutral
//! [`sandbox::SandboxSpec`] (whose hardening is written once, in [`sandbox`]), runs
//! commands in them (bounded, or interactive), runs one-shot commands in throwaway ones,
//! and says which optional capabilities it has ([`Capabilities`]). Implementations:
//! [`docker::DockerBackend`] and, for tests, [`fake::FakeBackend`]; [`contract`] is the
//! set of tests every implementation passes.

#[cfg(test)]
mod contract;
pub mod docker;
#[cfg(test)]
pub(crate) mod fake;
pub mod files;
pub mod gvisor;
pub mod sandbox;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use kernelgate_protocol::ConnectionInfo;
use std::collections::BTreeMap;

/// What to start.
#[derive(Debug, Clone)]
pub struct LaunchRequest {
    /// The gateway's kernel id (a UUID), used for labels and the socket directory.
    pub kernel_id: String,
    /// The kernel spec name (`python3`).
    pub kernel_name: String,
    /// The image the spec's kernels run in.
    pub image: String,
    /// Extra environment for the kernel process: already filtered to `KERNEL_*` names.
    pub env: BTreeMap<String, String>,
    /// Import the common libraries before the kernel reports ready (warm pool).
    pub preload: bool,
    /// The tenant it is for (warm pool kernels have none until handed out).
    pub owner: Option<String>,
    /// Tighter limits than the configured ones, for a tenant whose key has them.
    pub memory_mb: Option<u64>,
    pub cpus: Option<f64>,
}

impl LaunchRequest {
    /// The memory (MiB) and CPUs the kernel gets: the request's own where it asks for
    /// less than the gateway's `memory_mb` and `cpus`, never more.
    pub fn limits_within(&self, memory_mb: u64, cpus: f64) -> (u64, f64) {
        (
            self.memory_mb.map_or(memory_mb, |m| m.min(memory_mb)),
            self.cpus.map_or(cpus, |c| c.min(cpus)),
        )
    }
}

/// What an image says about itself.
#[derive(Debug, Clone, Default)]
pub struct ImageFacts {
    pub labels: std::collections::HashMap<String, String>,
    /// The command a container of it runs (its `CMD`).
    pub cmd: Vec<String>,
    /// The image's id (`sha256:...`): the wheelhouse keeps one tree per image.
    pub id: String,
    /// What runs its command (`tini -g --`).
    pub entrypoint: Vec<String>,
}

/// A started kernel.
#[derive(Debug, Clone)]
pub struct Launched {
    /// The backend's handle (a container id).
    pub handle: String,
    /// How the gateway reaches the kernel's sockets, with host paths and the key.
    pub connection: ConnectionInfo,
}

/// A kernel that a backend still runs, found at start-up (for re-adoption or removal).
#[derive(Debug, Clone)]
pub struct Found {
    pub handle: String,
    /// The kernel it serves: the one it was started for, or the one a restart moved into
    /// it (see [`KernelBackend::set_kernel_id`]).
    pub kernel_id: String,
    /// A restart moved `kernel_id` into this container: another container still labelled
    /// with that id is the kernel's old one.
    pub moved: bool,
    /// Started for the warm pool and never handed out: no client knows it.
    pub pooled: bool,
    /// Made with what this backend would use for a warm kernel now (image, limits,
    /// runtime).
    pub current: bool,
    /// The image it was created from, as named then.
    pub image: String,
    pub kernel_name: String,
    pub running: bool,
    /// The tenant that owns it, as recorded by the gateway.
    pub owner: Option<String>,
    /// Host-side connection info, when the kernel's connection file is still readable:
    /// what a restarted gateway needs to re-adopt the kernel.
    pub connection: Option<ConnectionInfo>,
}

/// How a kernel's process ended, as the backend saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exit {
    pub code: i64,
    /// Stopped by its memory limit (the OOM killer).
    pub oom_killed: bool,
    /// Its memory limit, when known.
    pub memory_mb: Option<u64>,
}

impl Exit {
    /// Why it ended, as people read it: "the kernel ran out of memory (limit 1024 MiB)".
    pub fn cause(&self) -> String {
        if self.oom_killed {
            return match self.memory_mb {
                Some(mb) => format!("the kernel ran out of memory (limit {mb} MiB)"),
                None => "the kernel ran out of memory".to_owned(),
            };
        }
        // A process killed by signal N exits (through tini) with 128 + N.
        match self.code - 128 {
            n @ 1..=64 => match signal_name(n) {
                Some(name) => format!("the kernel was killed by signal {n} ({name})"),
                None => format!("the kernel was killed by signal {n}"),
            },
            _ => format!("the kernel exited with code {}", self.code),
        }
    }
}

fn signal_name(n: i64) -> Option<&'static str> {
    const NAMES: [&str; 15] = [
        "SIGHUP", "SIGINT", "SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE",
        "SIGKILL", "SIGUSR1", "SIGSEGV", "SIGUSR2", "SIGPIPE", "SIGALRM", "SIGTERM",
    ];
    usize::try_from(n - 1)
        .ok()
        .and_then(|i| NAMES.get(i))
        .copied()
}

/// A command the gateway runs inside a kernel's sandbox (hibernation, resume, the files
/// API, package installs). Every one is bounded: killed inside the sandbox past `timeout`
/// (`timeout -s KILL`, and its process group by a second command should that not end
/// it), and read only up to `max_stdout` bytes.
#[derive(Debug)]
pub struct ExecRequest {
    pub argv: Vec<String>,
    pub stdin: ExecStdin,
    /// Where stdout goes as it arrives; `None` keeps it in [`ExecOutput::stdout`].
    pub stdout: Option<tokio::sync::mpsc::Sender<bytes::Bytes>>,
    pub max_stdout: usize,
    pub timeout: std::time::Duration,
}

impl ExecRequest {
    /// `argv` with `stdin`, its output kept (at most `max_stdout` bytes), killed past
    /// `timeout`.
    pub fn new(
        argv: Vec<String>,
        stdin: bytes::Bytes,
        max_stdout: usize,
        timeout: std::time::Duration,
    ) -> Self {
        ExecRequest {
            argv,
            stdin: ExecStdin::Bytes(stdin),
            stdout: None,
            max_stdout,
            timeout,
        }
    }
}

/// What a command reads on stdin.
#[derive(Debug)]
pub enum ExecStdin {
    Bytes(bytes::Bytes),
    /// A host file, streamed (a hibernated kernel's state).
    File(std::path::PathBuf),
}

/// What a command run inside a kernel's sandbox printed, and how it ended.
#[derive(Debug, Clone, Default)]
pub struct ExecOutput {
    pub exit_code: i64,
    pub stdout: Vec<u8>,
    pub stderr: String,
    /// Stdout went past the caller's limit; what is kept is cut there.
    pub truncated: bool,
}

/// Why a backend could not do what was asked. Messages are shown to API clients, so they
/// say what to do and never include secrets.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("cannot reach the Docker daemon ({detail}); start Docker (e.g. `systemctl start docker`) and check that this user may use /var/run/docker.sock")]
    DockerUnavailable { detail: String },
    #[error("kernel image {image:?} not found; {fix}")]
    ImageMissing { image: String, fix: &'static str },
    #[error("kernel container {handle} is gone")]
    Gone { handle: String },
    #[error("container runtime error: {0}")]
    Runtime(String),
    /// The kernel's process stopped while it started, or could not be brought back; the
    /// text says why and what to do.
    #[error("{0}")]
    Died(String),
    /// A command in the kernel's sandbox ran past its time and was killed.
    #[error("{what} did not finish within {} s and was stopped; the kernel's files may hold something that cannot be read (a pipe, a huge sparse file)", .after.as_secs())]
    TimedOut {
        what: String,
        after: std::time::Duration,
    },
    #[error("cannot prepare the kernel's socket directory {path}: {source}")]
    SocketDir {
        path: String,
        source: std::io::Error,
    },
    /// The engine will not do it for this kernel (the kernel is unharmed); the text says
    /// why and what to do.
    #[error("{0}")]
    Refused(String),
    /// An optional capability ([`Capabilities`]) this engine lacks.
    #[error("{what} is not supported by this engine ({engine})")]
    NotSupported {
        what: &'static str,
        engine: &'static str,
    },
}

/// The optional capabilities of an engine. Asking for one it lacks answers
/// [`BackendError::NotSupported`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// [`KernelBackend::create`], [`KernelBackend::start`], [`KernelBackend::stop`] and
    /// [`KernelBackend::signal`] of sandboxes made from a [`sandbox::SandboxSpec`].
    pub sandboxes: bool,
    /// [`KernelBackend::list_labelled`] finds sandboxes by the engine's own labels; an
    /// engine without labels answers from a record it keeps itself.
    pub engine_labels: bool,
    pub interactive_exec: bool,
    pub run_once: bool,
    /// [`KernelBackend::read_home`] and [`KernelBackend::put_tree`].
    pub files: bool,
    /// A kernel's whole sandbox saved ([`KernelBackend::checkpoint`]) and brought back
    /// ([`KernelBackend::restore_kernel`]): lossless hibernation and template starts.
    pub checkpoint: bool,
    pub restore: bool,
    /// A running sandbox copied into a second one (fork).
    pub clone: bool,
}

/// A signal for a sandbox's main process, or an interactive command's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Interrupt,
    Terminate,
    Kill,
    Hangup,
}

impl Signal {
    pub fn name(self) -> &'static str {
        match self {
            Signal::Interrupt => "SIGINT",
            Signal::Terminate => "SIGTERM",
            Signal::Kill => "SIGKILL",
            Signal::Hangup => "SIGHUP",
        }
    }

    pub fn number(self) -> i32 {
        match self {
            Signal::Interrupt => 2,
            Signal::Terminate => 15,
            Signal::Kill => 9,
            Signal::Hangup => 1,
        }
    }
}

/// A sandbox found by its labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Labelled {
    pub handle: String,
    pub labels: BTreeMap<String, String>,
    pub running: bool,
}

/// The size of an interactive command's terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtySize {
    pub rows: u16,
    pub cols: u16,
}

/// A command to run interactively in a sandbox (a shell command of an agent): its input
/// written as it comes, its output read as it comes, signalled, waited for. It runs as the
/// kernel's user, under the launcher's syscall filter like the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InteractiveRequest {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    /// `None`: the kernel's home.
    pub workdir: Option<String>,
    /// A pseudo-terminal of this size; `None`: plain pipes (stdout and stderr apart).
    pub tty: Option<TtySize>,
}

/// A piece of an interactive command's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    Stdout(bytes::Bytes),
    /// Never with a terminal, where both streams are one.
    Stderr(bytes::Bytes),
}

/// Signals, resizes and waits for an interactive command.
pub trait InteractiveControl: Send + Sync {
    fn signal(&self, signal: Signal) -> BoxFuture<'_, Result<(), BackendError>>;
    fn resize(&self, size: TtySize) -> BoxFuture<'_, Result<(), BackendError>>;
    /// Resolves with its exit code once it ended.
    fn wait(&self) -> BoxFuture<'_, Result<i64, BackendError>>;
}

/// A running interactive command.
pub struct Interactive {
    /// Its standard input; shutting it down is end of file.
    pub stdin: std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
    /// Its output, until it ended.
    pub output: BoxStream<'static, Result<Output, BackendError>>,
    pub control: Box<dyn InteractiveControl>,
}

impl std::fmt::Debug for Interactive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Interactive")
    }
}

/// A tar stream of a sandbox's files.
pub type TarStream = BoxStream<'static, Result<bytes::Bytes, BackendError>>;

fn unsupported<'a, T: Send + 'a>(
    what: &'static str,
    engine: &'static str,
) -> BoxFuture<'a, Result<T, BackendError>> {
    Box::pin(async move { Err(BackendError::NotSupported { what, engine }) })
}

/// Starts and controls isolated kernels: one engine. The methods up to [`Self::set_kernel_id`]
/// are what every engine has and the kernel table uses; those after it are the sandbox
/// interface a second engine implements too, each optional one answering
/// [`BackendError::NotSupported`] unless [`Self::capabilities`] says otherwise.
pub trait KernelBackend: Send + Sync + 'static {
    /// Checks that kernels can be started at all (daemon reachable, image present).
    fn check(&self) -> BoxFuture<'_, Result<(), BackendError>>;

    /// The labels and command of an image, or [`BackendError::ImageMissing`].
    fn describe_image<'a>(
        &'a self,
        image: &'a str,
    ) -> BoxFuture<'a, Result<ImageFacts, BackendError>>;

    /// Starts one kernel and returns once its process was started (not yet answering).
    fn launch<'a>(
        &'a self,
        req: &'a LaunchRequest,
    ) -> BoxFuture<'a, Result<Launched, BackendError>>;

    /// Restarts the kernel's process with fresh state; the connection info stays valid.
    fn restart<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>>;

    /// Sends SIGINT to the kernel (a `KeyboardInterrupt` in Python).
    fn interrupt<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>>;

    /// Stops the kernel and removes everything it had (container, socket directory).
    fn remove<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>>;

    /// Resolves when the kernel's process exits (at once if it is not running), with how
    /// it ended.
    fn wait_exit<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<Exit, BackendError>>;

    /// One item each time the kernel's container hits its memory limit and something in
    /// it is killed for it, as [`Exit::cause`] names it (with the limit). The kernel's
    /// process may have survived (a process it started was killed) or, under gVisor, be
    /// left stuck in a sandbox that does not exit (the host killed the stub process its
    /// memory was mapped in): the caller tells them apart. Ends when the container cannot
    /// be watched.
    fn out_of_memory<'a>(&'a self, handle: &'a str) -> BoxStream<'a, Exit> {
        let _ = handle;
        Box::pin(futures::stream::empty())
    }

    /// Runs `request.argv` inside the kernel's sandbox as the kernel's user, from the
    /// directory `/` (so that nothing in the kernel's home shadows what it imports; the
    /// home is in `KERNELGATE_WORKDIR`), bounded as [`ExecRequest`] says.
    fn exec<'a>(
        &'a self,
        handle: &'a str,
        request: ExecRequest,
    ) -> BoxFuture<'a, Result<ExecOutput, BackendError>>;

    /// Kernels this gateway's backend started earlier (by label).
    fn list(&self) -> BoxFuture<'_, Result<Vec<Found>, BackendError>>;

    /// Records which tenant owns a kernel, so that [`Self::list`] reports it after a
    /// restart of the gateway (a warm kernel gets its owner when it is handed out).
    fn set_owner<'a>(
        &'a self,
        kernel_id: &'a str,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        let _ = (kernel_id, owner);
        Box::pin(async { Ok(()) })
    }

    /// Gives `handle` the container name of kernel `kernel_id`, once the kernel's earlier
    /// container is gone (a restart moved the kernel into a warm one). Cosmetic: operators
    /// find a kernel's container by its name.
    fn rename<'a>(
        &'a self,
        handle: &'a str,
        kernel_id: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        let _ = (handle, kernel_id);
        Box::pin(async { Ok(()) })
    }

    /// Records that the container started for `container_id` (a warm one) now serves
    /// kernel `kernel_id`: a restart moved the kernel there. Labels cannot change, so this
    /// is what makes [`Self::list`] report it under that id after a restart of the gateway.
    fn set_kernel_id<'a>(
        &'a self,
        container_id: &'a str,
        kernel_id: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        let _ = (container_id, kernel_id);
        Box::pin(async { Ok(()) })
    }

    /// The engine's name, for messages (`docker`).
    fn engine(&self) -> &'static str {
        "this engine"
    }

    /// What it can do beyond launching, watching and removing kernels.
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    /// The isolation its kernels get.
    fn isolation(&self) -> sandbox::Isolation {
        sandbox::Isolation::RuncLike
    }

    /// Creates a sandbox from `spec`, not started yet; its handle.
    fn create<'a>(
        &'a self,
        spec: &'a sandbox::SandboxSpec,
    ) -> BoxFuture<'a, Result<String, BackendError>> {
        let _ = spec;
        unsupported("creating a sandbox from a spec", self.engine())
    }

    /// Starts a created (or stopped) sandbox.
    fn start<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        let _ = handle;
        unsupported("starting a sandbox", self.engine())
    }

    /// Sends `signal` to the sandbox's main process ([`Signal::Interrupt`]: as
    /// [`Self::interrupt`]).
    fn signal<'a>(
        &'a self,
        handle: &'a str,
        signal: Signal,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        match signal {
            Signal::Interrupt => self.interrupt(handle),
            _ => unsupported("signalling a sandbox", self.engine()),
        }
    }

    /// Stops the sandbox's processes (SIGTERM, then SIGKILL past `grace`); the sandbox
    /// stays until [`Self::remove`].
    fn stop<'a>(
        &'a self,
        handle: &'a str,
        grace: std::time::Duration,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        let _ = (handle, grace);
        unsupported("stopping a sandbox", self.engine())
    }

    /// The sandboxes of this engine carrying every one of `labels` (kernels and those
    /// made by [`Self::create`]).
    fn list_labelled<'a>(
        &'a self,
        labels: &'a BTreeMap<String, String>,
    ) -> BoxFuture<'a, Result<Vec<Labelled>, BackendError>> {
        let _ = labels;
        unsupported("listing sandboxes by label", self.engine())
    }

    /// Starts `request` in the sandbox, interactively.
    fn exec_interactive<'a>(
        &'a self,
        handle: &'a str,
        request: InteractiveRequest,
    ) -> BoxFuture<'a, Result<Interactive, BackendError>> {
        let _ = (handle, request);
        unsupported("interactive commands", self.engine())
    }

    /// Runs a command once in a throwaway sandbox (see [`sandbox::RunOnce`]): what it
    /// printed and how it ended. Past its timeout it is killed and this answers
    /// [`BackendError::TimedOut`].
    fn run_once(
        &self,
        request: sandbox::RunOnce,
    ) -> BoxFuture<'_, Result<sandbox::RunOutput, BackendError>> {
        let _ = request;
        unsupported("one-shot runs", self.engine())
    }

    /// The kernel's home as a tar stream (paths relative to it), read as the kernel's
    /// user.
    fn read_home<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<TarStream, BackendError>> {
        let _ = handle;
        unsupported("reading a sandbox's files", self.engine())
    }

    /// Unpacks the tar `tree` at `dest` in the sandbox, as the kernel's user.
    fn put_tree<'a>(
        &'a self,
        handle: &'a str,
        dest: &'a str,
        tree: bytes::Bytes,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        let _ = (handle, dest, tree);
        unsupported("writing files into a sandbox", self.engine())
    }

    /// Whether kernel `handle` can be saved whole by [`Self::checkpoint`] (its engine can,
    /// and its launcher runs what that needs).
    fn can_checkpoint(&self, handle: &str) -> bool {
        let _ = handle;
        false
    }

    /// A kernel for `req` from the checkpoint in `dir` (written by [`Self::checkpoint`]),
    /// running, with a new key: its handle and connection.
    fn restore_kernel<'a>(
        &'a self,
        req: &'a LaunchRequest,
        dir: &'a std::path::Path,
    ) -> BoxFuture<'a, Result<Launched, BackendError>> {
        let _ = (req, dir);
        unsupported("restoring a kernel's checkpoint", self.engine())
    }

    /// Saves the sandbox's whole state (memory included) into the host directory `dir`
    /// and stops it.
    fn checkpoint<'a>(
        &'a self,
        handle: &'a str,
        dir: &'a std::path::Path,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        let _ = (handle, dir);
        unsupported("checkpoints", self.engine())
    }

    /// Saves the sandbox's whole state into the host directory `dir`, as
    /// [`Self::checkpoint`] does, and lets it run on (a snapshot): its clients reconnect to
    /// the same sockets, with the same key.
    fn snapshot<'a>(
        &'a self,
        handle: &'a str,
        dir: &'a std::path::Path,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        let _ = (handle, dir);
        unsupported("snapshots of a running kernel's memory", self.engine())
    }

    /// A new sandbox of `spec` from the checkpoint in `dir`, running; its handle.
    fn restore<'a>(
        &'a self,
        spec: &'a sandbox::SandboxSpec,
        dir: &'a std::path::Path,
    ) -> BoxFuture<'a, Result<String, BackendError>> {
        let _ = (spec, dir);
        unsupported("restoring a checkpoint", self.engine())
    }

    /// A running copy of the sandbox, as `spec` says; its handle.
    fn clone_sandbox<'a>(
        &'a self,
        handle: &'a str,
        spec: &'a sandbox::SandboxSpec,
    ) -> BoxFuture<'a, Result<String, BackendError>> {
        let _ = (handle, spec);
        unsupported("cloning a sandbox", self.engine())
    }
}

impl std::fmt::Debug for dyn KernelBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KernelBackend")
    }
}

#[cfg(test)]
mod tests {
    use super::{Exit, LaunchRequest};

    #[test]
    fn a_request_gets_tighter_limits_never_looser_ones() {
        let mut req = LaunchRequest {
            kernel_id: "k".into(),
            kernel_name: "python3".into(),
            image: "i".into(),
            env: Default::default(),
            preload: false,
            owner: None,
            memory_mb: None,
            cpus: None,
        };
        assert_eq!(req.limits_within(512, 1.0), (512, 1.0));
        (req.memory_mb, req.cpus) = (Some(256), Some(0.5));
        assert_eq!(req.limits_within(512, 1.0), (256, 0.5));
        (req.memory_mb, req.cpus) = (Some(4096), Some(8.0));
        assert_eq!(req.limits_within(512, 1.0), (512, 1.0));
    }

    #[test]
    fn an_exit_names_its_cause() {
        let exit = |code, oom_killed, memory_mb| Exit {
            code,
            oom_killed,
            memory_mb,
        };
        assert_eq!(
            exit(137, true, Some(1024)).cause(),
            "the kernel ran out of memory (limit 1024 MiB)"
        );
        assert_eq!(
            exit(137, true, None).cause(),
            "the kernel ran out of memory"
        );
        assert_eq!(
            exit(137, false, Some(1024)).cause(),
            "the kernel was killed by signal 9 (SIGKILL)"
        );
        assert_eq!(
            exit(139, false, None).cause(),
            "the kernel was killed by signal 11 (SIGSEGV)"
        );
        assert_eq!(
            exit(1, false, None).cause(),
            "the kernel exited with code 1"
        );
        assert_eq!(
            exit(0, false, None).cause(),
            "the kernel exited with code 0"
        );
    }
}
