//! Where kernels run. A [`KernelBackend`] starts a kernel process somewhere isolated,
//! hands back the host-side connection info for its sockets, and stops, interrupts and
//! watches it. The only implementation today is [`docker::DockerBackend`].

pub mod docker;

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

/// What an image says about itself.
#[derive(Debug, Clone, Default)]
pub struct ImageFacts {
    pub labels: std::collections::HashMap<String, String>,
    /// The command a container of it runs (its `CMD`).
    pub cmd: Vec<String>,
    /// The image's id (`sha256:...`): the wheelhouse keeps one tree per image.
    pub id: String,
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
}

/// Starts and controls isolated kernels.
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
}

impl std::fmt::Debug for dyn KernelBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KernelBackend")
    }
}

#[cfg(test)]
mod tests {
    use super::Exit;

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
