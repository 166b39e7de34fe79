//! The MCP (Model Context Protocol) server: the tools of [`tools`] over the same kernel
//! table as the REST API, served by the official SDK (`rmcp`) over Streamable HTTP
//! ([`http`], mounted at `/mcp`) and over stdio ([`stdio`], `kernelgate mcp`).
//!
//! State: a protocol session (the `initialize` handshake, one `Mcp-Session-Id` over HTTP;
//! a whole stdio process) gets a kernel of its own, created on its first tool call and
//! deleted when the session ends (HTTP DELETE or expiry, stdio EOF). Without a session (protocol
//! 2026-07-28 over HTTP) `start_kernel` hands out a kernel id that the other tools take as
//! `kernel_id`; such a kernel is deleted after `--mcp-idle-timeout` without use. A key sees
//! only its own sessions and kernels.
//!
//! Executions go through [`crate::kernels::run`], like the agent API's: one at a time per
//! kernel, the timeout interrupts, the kernel relay applies the policy, the output cap and
//! the audit trail, with the MCP session id as the agent id.
//!
//! What a model is sent: text as a terminal shows it, one MIME type per output
//! ([`tools`]), and every result and progress notification within `--mcp-max-result-kb`
//! ([`budget`]).

pub mod budget;
pub mod http;
pub mod local;
pub mod remote;
pub mod stdio;
pub mod tools;

use crate::kernels::files::{FileError, FileOp};
use crate::kernels::run::{Progress, Run};
use crate::kernels::Kernels;
use crate::tenants::Tenant;
use budget::Budget;
use futures::future::BoxFuture;
use kernelgate_protocol::execution::Event;
use kernelgate_protocol::terminal::{plain_text, Terminal};
use kernelgate_protocol::Outcome;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ProgressNotificationParam, ServerCapabilities,
    ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::json;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tools::ToolError;

/// The header that names an HTTP session.
const SESSION_HEADER: &str = "mcp-session-id";

const INSTRUCTIONS: &str = "Kernelgate runs Python for you in a persistent, sandboxed IPython \
    kernel (no network). Use run_python for code; variables persist between calls. Use \
    write_file/read_file/list_files to move data in and out of the kernel's working \
    directory, restart_kernel to start over (it removes the files too). Results are limited \
    in size: write large output to a file and read it in parts with read_file's offset and \
    length. Without a session, call start_kernel first and pass its kernel_id to every other \
    tool.";

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
    fn run<'a>(
        &'a self,
        tracker: &'a TaskTracker,
        kernel: &'a KernelRef,
        run: Run,
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
            self.handles().insert(
                kernel.id().to_owned(),
                Handle {
                    last_used: Instant::now(),
                },
            );
        }
        Ok(kernel)
    }

    /// The kernel `id`, if `tenant` may use it.
    async fn find(&self, tenant: &Tenant, id: &str) -> Result<Option<KernelRef>, ToolError> {
        self.place.find(tenant, id).await.map_err(tools::error)
    }

    async fn run(&self, kernel: &KernelRef, run: Run) -> mpsc::Receiver<Progress> {
        self.place.run(&self.tracker, kernel, run).await
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

/// Who is calling, and in which session.
#[derive(Debug)]
struct Caller {
    tenant: Arc<Tenant>,
    /// The session id (the audit's agent id); `None` without a session.
    session: Option<String>,
}

/// One MCP session's handler: rmcp makes one per HTTP session (and one per sessionless
/// request) and one per stdio process.
#[derive(Debug, Clone)]
pub struct Session {
    state: Arc<SessionState>,
}

#[derive(Debug)]
struct SessionState {
    mcp: Arc<Mcp>,
    /// Over stdio: the process's tenant and session id. Over HTTP both come with requests.
    fixed: Option<(Arc<Tenant>, String)>,
    /// The session's own kernel, created on first use.
    kernel: tokio::sync::Mutex<Option<KernelRef>>,
}

impl Drop for SessionState {
    /// The session ended: its kernel goes (in a task of the gateway's, as this may run
    /// anywhere).
    fn drop(&mut self) {
        let Some(kernel) = self.kernel.get_mut().take() else {
            return;
        };
        if self.mcp.cancel.is_cancelled() {
            return; // shutdown removes every kernel
        }
        let mcp = self.mcp.clone();
        tracing::info!(kernel = %kernel.id(), "MCP session ended; deleting its kernel");
        self.mcp.tracker.spawn(async move {
            mcp.place.delete(&kernel, "MCP session ended").await;
        });
    }
}

impl Session {
    /// A handler for HTTP: tenant and session come with each request.
    pub fn http(mcp: Arc<Mcp>) -> Self {
        Self::new(mcp, None)
    }

    /// The handler of a stdio process: one session, one tenant.
    pub fn stdio(mcp: Arc<Mcp>, tenant: Arc<Tenant>) -> Self {
        let id = format!("mcp-stdio-{}", uuid::Uuid::new_v4());
        Self::new(mcp, Some((tenant, id)))
    }

    fn new(mcp: Arc<Mcp>, fixed: Option<(Arc<Tenant>, String)>) -> Self {
        Session {
            state: Arc::new(SessionState {
                mcp,
                fixed,
                kernel: tokio::sync::Mutex::new(None),
            }),
        }
    }

    fn caller(&self, context: &RequestContext<RoleServer>) -> Option<Caller> {
        if let Some((tenant, id)) = &self.state.fixed {
            return Some(Caller {
                tenant: tenant.clone(),
                session: Some(id.clone()),
            });
        }
        let parts = context.extensions.get::<axum::http::request::Parts>()?;
        let tenant = parts.extensions.get::<Arc<Tenant>>()?.clone();
        let session = parts
            .headers
            .get(SESSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        Some(Caller { tenant, session })
    }

    /// The kernel a call works on: `kernel_id`'s, else the session's own (started now if
    /// it has none yet). The note says when the session's kernel had to be replaced.
    async fn kernel(
        &self,
        caller: &Caller,
        kernel_id: Option<&str>,
    ) -> Result<(KernelRef, Option<&'static str>), ToolError> {
        let mcp = &self.state.mcp;
        if let Some(id) = kernel_id {
            let kernel = mcp.find(&caller.tenant, id).await?.ok_or_else(|| {
                tools::error(format!(
                    "there is no kernel {id:?} (it was shut down after being idle, or the id \
                     is wrong): call start_kernel for a new one"
                ))
            })?;
            mcp.touch(id);
            return Ok((kernel, None));
        }
        if caller.session.is_none() {
            return Err(tools::error(
                "this connection has no MCP session, so there is no default kernel: call \
                 start_kernel and pass the kernel_id it returns",
            ));
        }
        let mut mine = self.state.kernel.lock().await;
        let mut note = None;
        if let Some(kernel) = mine.as_ref() {
            if mcp.alive(kernel).await {
                return Ok((kernel.clone(), None));
            }
            note = Some(
                "[this session's kernel had been shut down (idle or deleted); this ran on a new \
                 kernel: earlier variables are gone]",
            );
        }
        let kernel = mcp.create_kernel(&caller.tenant, false).await?;
        *mine = Some(kernel.clone());
        Ok((kernel, note))
    }

    async fn run_python(
        &self,
        caller: &Caller,
        args: tools::RunPython,
        context: &RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ToolError> {
        let timeout = args.timeout()?;
        let (kernel, note) = self.kernel(caller, args.kernel_id.as_deref()).await?;
        let mcp = &self.state.mcp;
        if context.ct.is_cancelled() {
            // Cancelled while its kernel was being found or started: never queued.
            return Err(tools::error(
                "cancelled by the client before the code started",
            ));
        }
        let mut rx = mcp
            .run(
                &kernel,
                Run {
                    code: args.code,
                    timeout,
                    key: caller.tenant.name.clone(),
                    agent_id: Some(
                        caller
                            .session
                            .clone()
                            .unwrap_or_else(|| format!("mcp-kernel-{}", kernel.id())),
                    ),
                },
            )
            .await;
        let progress = context.meta.get_progress_token();
        let token_len = progress
            .as_ref()
            .map_or(0, |t| serde_json::to_string(t).map_or(0, |s| s.len()));
        let mut sent = 0u32;
        let mut terminals = Streams::default();
        let mut outcome = Outcome::default();
        let mut ending = None;
        loop {
            let item = tokio::select! {
                item = rx.recv() => item,
                _ = context.ct.cancelled() => {
                    // Dropping the receiver abandons the run: out of the queue, or the
                    // kernel interrupted (its state kept).
                    drop(rx);
                    mcp.touch(kernel.id());
                    return Err(tools::error("cancelled by the client; the kernel was interrupted if the code had started, and keeps its variables"));
                }
            };
            let Some(item) = item else { break };
            match item {
                Progress::Event(event) => {
                    let message = progress
                        .as_ref()
                        .and_then(|_| terminals.message(&event))
                        .map(|m| mcp.budget.fit_message(m, token_len));
                    if let (Some(token), Some(message)) = (&progress, message) {
                        sent += 1;
                        let note = ProgressNotificationParam::new(token.clone(), f64::from(sent))
                            .with_message(message);
                        if let Err(e) = context.peer.notify_progress(note).await {
                            tracing::debug!(error = %e, "cannot send an MCP progress notification");
                        }
                    }
                    outcome.apply(&event);
                }
                Progress::End(end) => ending = Some(end),
            }
        }
        mcp.touch(kernel.id());
        let Some(end) = ending else {
            return Err(tools::error(
                "the run ended without a result (the gateway is shutting down?)",
            ));
        };
        let mut result = tools::run_result(
            &outcome,
            tools::Ending {
                status: end.status,
                timeout,
                truncated: end.truncated,
            },
        );
        if let Some(note) = note {
            result.content.insert(0, ContentBlock::text(note));
        }
        Ok(result)
    }

    async fn file_op(
        &self,
        caller: &Caller,
        kernel_id: Option<&str>,
        op: FileOp,
        path: &str,
        body: Vec<u8>,
    ) -> Result<Vec<u8>, ToolError> {
        let (kernel, _) = self.kernel(caller, kernel_id).await?;
        let mcp = &self.state.mcp;
        let result = mcp.file(&kernel, &caller.tenant.name, op, path, body).await;
        mcp.touch(kernel.id());
        result.map_err(|e| file_error(e, op))
    }

    async fn call(
        &self,
        request: CallToolRequestParams,
        context: &RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ToolError> {
        let caller = self
            .caller(context)
            .ok_or_else(|| tools::error("not authenticated"))?;
        let args = request.arguments;
        match request.name.as_ref() {
            "run_python" => {
                let args = tools::parse("run_python", tools::RunPython::EXAMPLE, args)?;
                self.run_python(&caller, args, context).await
            }
            "list_files" => {
                let a: tools::ListFiles = tools::parse("list_files", r#"{"path": "data"}"#, args)?;
                let path = a.path.unwrap_or_default();
                let op = FileOp::List;
                let out = self
                    .file_op(&caller, a.kernel_id.as_deref(), op, &path, Vec::new())
                    .await?;
                Ok(CallToolResult::success(vec![ContentBlock::text(
                    tools::listing(&path, &out),
                )]))
            }
            "read_file" => {
                let a: tools::ReadFile = tools::parse("read_file", tools::ReadFile::EXAMPLE, args)?;
                // What one result holds besides the file's content.
                let room = self
                    .state
                    .mcp
                    .budget
                    .room()
                    .saturating_sub(256 + 2 * a.path.len());
                let window = a.window(room)?;
                let (kernel, _) = self.kernel(&caller, a.kernel_id.as_deref()).await?;
                let mcp = &self.state.mcp;
                let part = mcp
                    .read_part(&kernel, &caller.tenant.name, &a.path, a.offset, window)
                    .await;
                mcp.touch(kernel.id());
                let (bytes, size) = part.map_err(|e| file_error(e, FileOp::Get))?;
                Ok(CallToolResult::success(tools::file_part(
                    &a.path, a.offset, bytes, size, room,
                )?))
            }
            "write_file" => {
                let a: tools::WriteFile =
                    tools::parse("write_file", tools::WriteFile::EXAMPLE, args)?;
                let bytes = a.bytes()?;
                let n = bytes.len();
                self.file_op(&caller, a.kernel_id.as_deref(), FileOp::Put, &a.path, bytes)
                    .await?;
                Ok(CallToolResult::success(vec![ContentBlock::text(format!(
                    "wrote {n} bytes to {}",
                    a.path
                ))]))
            }
            "restart_kernel" => {
                let a: tools::Target = tools::parse("restart_kernel", "{}", args)?;
                let (kernel, _) = self.kernel(&caller, a.kernel_id.as_deref()).await?;
                let mcp = &self.state.mcp;
                mcp.restart(&kernel, &caller.tenant).await?;
                mcp.touch(kernel.id());
                Ok(CallToolResult::success(vec![ContentBlock::text(
                    "The kernel restarted in a new sandbox: all variables and imports are gone, \
                     and the files in its working directory were removed.",
                )]))
            }
            "start_kernel" => {
                let kernel = self.state.mcp.create_kernel(&caller.tenant, true).await?;
                let mut result = CallToolResult::success(vec![ContentBlock::text(format!(
                    "kernel_id: {}\nPass this kernel_id to run_python and the file tools. The \
                     kernel is shut down after {} s without use.",
                    kernel.id(),
                    self.state.mcp.idle_timeout.as_secs()
                ))]);
                result.structured_content = Some(json!({"kernel_id": kernel.id()}));
                Ok(result)
            }
            other => Err(tools::error(format!(
                "there is no tool named {other:?}; the tools are run_python, list_files, \
                 read_file, write_file, restart_kernel and start_kernel"
            ))),
        }
    }
}

/// A file operation's failure as what the model should do about it.
fn file_error(e: FileError, op: FileOp) -> ToolError {
    tools::error(match e {
        FileError::TooLarge { path, limit_mib } if op == FileOp::List => format!(
            "the listing of {path} is larger than the {limit_mib} MiB limit: list its \
             subdirectories one at a time"
        ),
        FileError::TooLarge { path, limit_mib } => format!(
            "{path} is larger than the {limit_mib} MiB limit: read it in parts with \
             read_file's offset and length"
        ),
        FileError::BadPath { path, reason } => {
            format!("{path}: {reason}. Give a path relative to the working directory, without '..'")
        }
        FileError::WrongKind { path, .. } if op == FileOp::Get => {
            format!("{path} is a directory: use list_files with this path to see what it holds")
        }
        FileError::WrongKind { path, .. } if op == FileOp::List => {
            format!("{path} is a file: use read_file to read it")
        }
        other => other.to_string(),
    })
}

/// The terminal state of a run's two streams, for its progress notifications.
#[derive(Debug, Default)]
struct Streams {
    stdout: Terminal,
    stderr: Terminal,
}

impl Streams {
    /// What a progress notification says about one event of a run: the lines a stream
    /// chunk completed, else the line it is drawing (a progress bar in its current
    /// state); a display's text or kind; an exception's name and value.
    fn message(&mut self, event: &Event) -> Option<String> {
        match event {
            Event::Stream { name, text } => {
                let terminal = if name == "stderr" {
                    &mut self.stderr
                } else {
                    &mut self.stdout
                };
                let done = terminal.push(text);
                let message = if done.is_empty() {
                    terminal.pending().to_owned()
                } else {
                    done
                };
                (!message.is_empty()).then_some(message)
            }
            Event::Display(d) => Some(tools::display_summary(&d.data)),
            Event::Error(e) => Some(format!(
                "{}: {}",
                plain_text(&e.ename),
                plain_text(&e.evalue)
            )),
            _ => None,
        }
    }
}

impl ServerHandler for Session {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("kernelgate", env!("CARGO_PKG_VERSION")))
            .with_instructions(INSTRUCTIONS)
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools::all()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        tools::all().into_iter().find(|t| t.name == name)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let result = match self.call(request, &context).await {
            Ok(result) => result,
            Err(e) => e.into_result(),
        };
        Ok(self.state.mcp.budget.fit(result).into())
    }
}
