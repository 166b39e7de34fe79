//! The MCP (Model Context Protocol) server: the tools of [`tools`] over the same kernel
//! table as the REST API, served by the official SDK (`rmcp`) over Streamable HTTP
//! (`api::mcp`, mounted at `/mcp`) and over stdio ([`stdio`], `kernelgate mcp`).
//!
//! State: a protocol session (the `initialize` handshake, one `Mcp-Session-Id` over HTTP;
//! a whole stdio process) gets a kernel of its own, created on its first tool call and
//! deleted when the session ends (HTTP DELETE or expiry, stdio EOF). Without a session (protocol
//! 2026-07-28 over HTTP) `start_kernel` hands out a kernel id that the other tools take as
//! `kernel_id`; such a kernel is deleted after `--mcp-idle-timeout` without use. A key sees
//! only its own sessions and kernels.
//!
//! Executions go through [`crate::kernels::runner`], like the agent API's: one at a time per
//! kernel, the timeout interrupts, the kernel relay applies the policy, the output cap and
//! the audit trail, with the MCP session id as the agent id.
//!
//! What a model is sent: text as a terminal shows it, one MIME type per output
//! ([`tools`]), and every result and progress notification within `--mcp-max-result-kb`
//! ([`budget`]).

pub mod budget;
mod content;
pub mod local;
pub mod remote;
mod session;
pub mod stdio;
pub mod tools;

use crate::kernels::files::{FileError, FileOp};
use crate::kernels::runner::{Job, Progress};
use crate::kernels::Kernels;
use crate::tenants::Tenant;
use budget::Budget;
use futures::future::BoxFuture;
use kernelgate_protocol::rest::{CreateSnapshot, SnapshotModel};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tools::ToolError;

pub use session::Session;

/// The header that names an HTTP session.
pub use kernelgate_protocol::rest::headers::MCP_SESSION as SESSION_HEADER;

const INSTRUCTIONS: &str = "Kernelgate runs Python for you in a persistent, sandboxed IPython \
    kernel (no network). Use run_python for code; variables persist between calls. Use \
    write_file/read_file/list_files to move data in and out of the kernel's working \
    directory, restart_kernel to start over (it removes the files too). The kernel cannot \
    download packages: install_packages adds those the operator allowed (offline, in about a \
    second), and %pip install in run_python does the same. Results are limited \
    in size: write large output to a file and read it in parts with read_file's offset and \
    length. Without a session, call start_kernel first and pass its kernel_id to every other \
    tool. To try several things from the same state, fork_kernel copies the kernel; \
    snapshot_kernel saves a state to start new kernels from (start_kernel's snapshot).";

/// A kernel handed out by `start_kernel`.
#[derive(Debug)]
struct Handle {
    last_used: Instant,
}

/// Where the kernels are: this process's table ([`local::Local`]) or a running gateway
/// ([`remote::Remote`], `kernelgate mcp --url`). Errors are messages for the model.
pub trait Place: std::fmt::Debug + Send + Sync + 'static {
    /// A new kernel owned by `tenant`.
    fn create<'a>(&'a self, tenant: &'a Tenant) -> BoxFuture<'a, Result<KernelRef, String>>;
    /// The kernel `id`, if it exists and `tenant` may use it.
    fn find<'a>(
        &'a self,
        tenant: &'a Tenant,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<KernelRef>, String>>;
    /// Whether the kernel is still there (it may have been culled or deleted).
    fn alive<'a>(&'a self, id: &'a str) -> BoxFuture<'a, bool>;
    /// What is known of the kernel without asking anyone (`None`: nothing).
    fn seen(&self, _id: &str) -> Option<Seen> {
        None
    }
    fn delete<'a>(&'a self, kernel: &'a KernelRef, reason: &'a str) -> BoxFuture<'a, ()>;
    fn restart<'a>(
        &'a self,
        kernel: &'a KernelRef,
        tenant: &'a Tenant,
    ) -> BoxFuture<'a, Result<(), String>>;
    /// Runs code; dropping the receiver abandons the run.
    fn execute<'a>(
        &'a self,
        tracker: &'a TaskTracker,
        kernel: &'a KernelRef,
        job: Job,
    ) -> BoxFuture<'a, mpsc::Receiver<Progress>>;
    /// A file operation in the kernel's working directory, answers up to `max_bytes`.
    #[allow(clippy::too_many_arguments)]
    fn file<'a>(
        &'a self,
        kernel: &'a KernelRef,
        key: &'a str,
        op: FileOp,
        path: &'a str,
        body: Vec<u8>,
        max_bytes: usize,
    ) -> BoxFuture<'a, Result<Vec<u8>, FileError>>;
    /// Installs packages from the allowlist into the kernel for `key`.
    fn install<'a>(
        &'a self,
        kernel: &'a KernelRef,
        key: &'a str,
        packages: &'a [String],
    ) -> BoxFuture<'a, Result<crate::kernels::packages::Installed, String>>;
    /// A snapshot of the kernel for `tenant`, which runs on.
    fn snapshot<'a>(
        &'a self,
        kernel: &'a KernelRef,
        tenant: &'a Tenant,
        body: CreateSnapshot,
    ) -> BoxFuture<'a, Result<SnapshotModel, String>>;
    /// `count` kernels with the kernel's state, for `tenant`: what the fork kept, and per
    /// fork its kernel or why it did not start.
    fn fork<'a>(
        &'a self,
        kernel: &'a KernelRef,
        tenant: &'a Tenant,
        count: usize,
    ) -> BoxFuture<'a, Result<Forked, String>>;
    /// A new kernel owned by `tenant` with the state of `snapshot` (an id or a name).
    fn create_from<'a>(
        &'a self,
        tenant: &'a Tenant,
        snapshot: &'a str,
    ) -> BoxFuture<'a, Result<KernelRef, String>>;
    /// At most `length` bytes of a file from `offset`, and the file's size.
    fn read_part<'a>(
        &'a self,
        kernel: &'a KernelRef,
        key: &'a str,
        path: &'a str,
        offset: u64,
        length: usize,
    ) -> BoxFuture<'a, Result<(Vec<u8>, u64), FileError>>;
}

/// What a fork made: the kind of its snapshot, and per fork its kernel or why not.
#[derive(Debug)]
pub struct Forked {
    pub kind: String,
    pub forks: Vec<Result<KernelRef, String>>,
}

/// A kernel's state as its place sees it at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    Gone,
    Busy,
    Idle,
}

/// A kernel a call works on.
#[derive(Debug, Clone)]
pub struct KernelRef {
    id: String,
}

impl KernelRef {
    fn id(&self) -> &str {
        &self.id
    }
}

/// What every MCP session shares: where kernels run and the kernels MCP handed out.
#[derive(Debug)]
pub struct Mcp {
    place: Box<dyn Place>,
    tracker: TaskTracker,
    cancel: CancellationToken,
    idle_timeout: Duration,
    /// The largest message a client is sent.
    budget: Budget,
    /// `start_kernel` kernels by id.
    handles: Mutex<HashMap<String, Handle>>,
}

impl Mcp {
    /// MCP over this process's kernel table. Also starts the task that deletes
    /// `start_kernel` kernels left idle for `idle_timeout`.
    pub fn new(
        kernels: Arc<Kernels>,
        tracker: TaskTracker,
        cancel: CancellationToken,
        idle_timeout: Duration,
        budget: Budget,
    ) -> Arc<Self> {
        Self::start(
            Box::new(local::Local(kernels)),
            tracker,
            cancel,
            idle_timeout,
            budget,
        )
    }

    /// MCP over the kernels of a running gateway.
    pub fn remote(
        gateway: remote::Remote,
        tracker: TaskTracker,
        cancel: CancellationToken,
        idle_timeout: Duration,
        budget: Budget,
    ) -> Arc<Self> {
        Self::start(Box::new(gateway), tracker, cancel, idle_timeout, budget)
    }

    fn start(
        place: Box<dyn Place>,
        tracker: TaskTracker,
        cancel: CancellationToken,
        idle_timeout: Duration,
        budget: Budget,
    ) -> Arc<Self> {
        let mcp = Arc::new(Mcp {
            place,
            tracker: tracker.clone(),
            cancel,
            idle_timeout,
            budget,
            handles: Mutex::default(),
        });
        tracker.spawn(mcp.clone().reap_idle_handles());
        mcp
    }

    /// Ends when the gateway stops: the HTTP transport's sessions end with it.
    pub fn cancel_token(&self) -> &CancellationToken {
        &self.cancel
    }

    /// How long an unused session or `start_kernel` kernel lives.
    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    fn handles(&self) -> MutexGuard<'_, HashMap<String, Handle>> {
        self.handles.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn touch(&self, id: &str) {
        if let Some(h) = self.handles().get_mut(id) {
            h.last_used = Instant::now();
        }
    }

    async fn reap_idle_handles(self: Arc<Self>) {
        let every = (self.idle_timeout / 4).clamp(Duration::from_secs(1), Duration::from_secs(30));
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let due: Vec<String> = {
                let mut handles = self.handles();
                handles.retain(|id, _| self.place.seen(id) != Some(Seen::Gone));
                for (id, h) in handles.iter_mut() {
                    // A kernel still running a call is in use.
                    if self.place.seen(id) == Some(Seen::Busy) {
                        h.last_used = Instant::now();
                    }
                }
                handles
                    .iter()
                    .filter(|(_, h)| h.last_used.elapsed() >= self.idle_timeout)
                    .map(|(id, _)| id.clone())
                    .collect()
            };
            for id in due {
                self.handles().remove(&id);
                self.delete_kernel(&id, "idle MCP kernel").await;
            }
        }
    }

    /// Deletes every `start_kernel` kernel still handed out (a `kernelgate mcp --url`
    /// process that ends; a local table is shut down whole instead).
    pub async fn release_handles(&self) {
        let ids: Vec<String> = self.handles().drain().map(|(id, _)| id).collect();
        for id in ids {
            self.delete_kernel(&id, "MCP process ended").await;
        }
    }

    async fn delete_kernel(&self, id: &str, reason: &str) {
        let kernel = KernelRef { id: id.to_owned() };
        self.place.delete(&kernel, reason).await;
    }

    /// A new kernel for `tenant`; `start_kernel`'s ones are remembered as handles.
    async fn create_kernel(&self, tenant: &Tenant, handle: bool) -> Result<KernelRef, ToolError> {
        let kernel = self
            .place
            .create(tenant)
            .await
            .map_err(|e| tools::error(format!("cannot start a kernel: {e}")))?;
        if handle {
            self.hand_out(&kernel);
        }
        Ok(kernel)
    }

    /// Remembers `kernel` as a handle, deleted after the idle timeout.
    fn hand_out(&self, kernel: &KernelRef) {
        self.handles().insert(
            kernel.id().to_owned(),
            Handle {
                last_used: Instant::now(),
            },
        );
    }

    /// A new kernel for `tenant` from `snapshot`, handed out as `start_kernel`'s are.
    async fn create_from(&self, tenant: &Tenant, snapshot: &str) -> Result<KernelRef, ToolError> {
        let kernel = self
            .place
            .create_from(tenant, snapshot)
            .await
            .map_err(|e| tools::error(format!("cannot start a kernel from {snapshot:?}: {e}")))?;
        self.hand_out(&kernel);
        Ok(kernel)
    }

    async fn snapshot(
        &self,
        kernel: &KernelRef,
        tenant: &Tenant,
        body: CreateSnapshot,
    ) -> Result<SnapshotModel, ToolError> {
        self.place
            .snapshot(kernel, tenant, body)
            .await
            .map_err(|e| tools::error(format!("no snapshot was taken: {e}")))
    }

    /// Forks `kernel`; the forks that started are handed out.
    async fn fork(
        &self,
        kernel: &KernelRef,
        tenant: &Tenant,
        count: usize,
    ) -> Result<Forked, ToolError> {
        let forked = self
            .place
            .fork(kernel, tenant, count)
            .await
            .map_err(|e| tools::error(format!("the kernel was not forked: {e}")))?;
        for started in forked.forks.iter().flatten() {
            self.hand_out(started);
        }
        Ok(forked)
    }

    /// The kernel `id`, if `tenant` may use it.
    async fn find(&self, tenant: &Tenant, id: &str) -> Result<Option<KernelRef>, ToolError> {
        self.place.find(tenant, id).await.map_err(tools::error)
    }

    async fn execute(&self, kernel: &KernelRef, job: Job) -> mpsc::Receiver<Progress> {
        self.place.execute(&self.tracker, kernel, job).await
    }

    async fn file(
        &self,
        kernel: &KernelRef,
        key: &str,
        op: FileOp,
        path: &str,
        body: Vec<u8>,
    ) -> Result<Vec<u8>, FileError> {
        let limit = tools::MAX_FILE_BYTES;
        self.place.file(kernel, key, op, path, body, limit).await
    }

    async fn read_part(
        &self,
        kernel: &KernelRef,
        key: &str,
        path: &str,
        offset: u64,
        length: usize,
    ) -> Result<(Vec<u8>, u64), FileError> {
        self.place
            .read_part(kernel, key, path, offset, length)
            .await
    }

    async fn install(
        &self,
        kernel: &KernelRef,
        key: &str,
        packages: &[String],
    ) -> Result<crate::kernels::packages::Installed, ToolError> {
        self.place
            .install(kernel, key, packages)
            .await
            .map_err(tools::error)
    }

    async fn restart(&self, kernel: &KernelRef, tenant: &Tenant) -> Result<(), ToolError> {
        self.place
            .restart(kernel, tenant)
            .await
            .map_err(|e| tools::error(format!("the restart failed: {e}")))
    }

    /// Whether the kernel is still there (it may have been culled or deleted).
    async fn alive(&self, kernel: &KernelRef) -> bool {
        self.place.alive(kernel.id()).await
    }
}
