//! Where kernels run. A [`KernelBackend`] starts a kernel process somewhere isolated,
//! hands back the host-side connection info for its sockets, and stops, interrupts and
//! watches it. The only implementation today is [`docker::DockerBackend`].

pub mod docker;

use futures::future::BoxFuture;
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
    pub kernel_id: String,
    pub kernel_name: String,
    pub running: bool,
    /// The tenant that owns it, as recorded by the gateway.
    pub owner: Option<String>,
    /// Host-side connection info, when the kernel's connection file is still readable:
    /// what a restarted gateway needs to re-adopt the kernel.
    pub connection: Option<ConnectionInfo>,
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

    /// Resolves when the kernel's process exits, with its exit code.
    fn wait_exit<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<i64, BackendError>>;

    /// Runs `argv` inside the kernel's sandbox as the kernel's user, in its working
    /// directory, with `stdin` as input; keeps at most `max_stdout` bytes of output.
    fn exec<'a>(
        &'a self,
        handle: &'a str,
        argv: Vec<String>,
        stdin: bytes::Bytes,
        max_stdout: usize,
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
}

impl std::fmt::Debug for dyn KernelBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KernelBackend")
    }
}
