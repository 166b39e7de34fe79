//! One MCP session's handler (rmcp's `ServerHandler`): who calls, which kernel a call
//! works on, and each tool call run through the session's place, its output streamed as
//! progress and answered within the result budget.

use super::tools::{self, ToolError};
use super::{KernelRef, Mcp, INSTRUCTIONS, SESSION_HEADER};
use crate::kernels::files::{FileError, FileOp};
use crate::kernels::runner::{Job, Progress};
use crate::tenants::Tenant;
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
use std::sync::Arc;

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
            .execute(
                &kernel,
                Job {
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
            "install_packages" => {
                let a: tools::InstallPackages =
                    tools::parse("install_packages", tools::InstallPackages::EXAMPLE, args)?;
                let (kernel, _) = self.kernel(&caller, a.kernel_id.as_deref()).await?;
                let mcp = &self.state.mcp;
                let done = mcp.install(&kernel, &caller.tenant.name, &a.packages).await;
                mcp.touch(kernel.id());
                let done = done?;
                let shown = |list: &[crate::audit::PackageVersion]| {
                    list.iter()
                        .map(|p| format!("{} {}", p.name, p.version))
                        .collect::<Vec<_>>()
                        .join(", ")
                };
                let mut text = if done.installed.is_empty() {
                    "Nothing new to install.".to_owned()
                } else {
                    format!(
                        "Installed {}. Import them in run_python now.",
                        shown(&done.installed)
                    )
                };
                if !done.already.is_empty() {
                    text.push_str(&format!(" Already there: {}.", shown(&done.already)));
                }
                let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
                result.structured_content = serde_json::to_value(&done).ok();
                Ok(result)
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
            "snapshot_kernel" => {
                let a: tools::SnapshotKernel =
                    tools::parse("snapshot_kernel", tools::SnapshotKernel::EXAMPLE, args)?;
                let (kernel, _) = self.kernel(&caller, a.kernel_id.as_deref()).await?;
                let body = kernelgate_protocol::rest::CreateSnapshot {
                    name: a.name,
                    mode: a.mode,
                    ..Default::default()
                };
                let mcp = &self.state.mcp;
                let taken = mcp.snapshot(&kernel, &caller.tenant, body).await;
                mcp.touch(kernel.id());
                let taken = taken?;
                let kept = match taken.kind.as_str() {
                    "memory" => "everything: variables (threads and generators too) and files",
                    "namespace" => "the variables and the files",
                    _ => "the files",
                };
                let mut result = CallToolResult::success(vec![ContentBlock::text(format!(
                    "snapshot_id: {}{}\nIt keeps {kept} ({} MiB). Start a kernel from it with \
                     start_kernel's snapshot.",
                    taken.id,
                    taken
                        .name
                        .as_ref()
                        .map(|n| format!(" (name: {n})"))
                        .unwrap_or_default(),
                    taken.size.div_ceil(1 << 20),
                ))]);
                result.structured_content = serde_json::to_value(&taken).ok();
                Ok(result)
            }
            "fork_kernel" => {
                let a: tools::ForkKernel =
                    tools::parse("fork_kernel", tools::ForkKernel::EXAMPLE, args)?;
                let (kernel, _) = self.kernel(&caller, a.kernel_id.as_deref()).await?;
                let mcp = &self.state.mcp;
                let forked = mcp.fork(&kernel, &caller.tenant, a.count).await;
                mcp.touch(kernel.id());
                let forked = forked?;
                let mut lines = Vec::new();
                let mut ids = Vec::new();
                for (n, fork) in forked.forks.iter().enumerate() {
                    match fork {
                        Ok(k) => {
                            lines.push(format!("copy {}: kernel_id {}", n + 1, k.id()));
                            ids.push(k.id().to_owned());
                        }
                        Err(e) => lines.push(format!("copy {}: did not start: {e}", n + 1)),
                    }
                }
                lines.push(
                    "Pass a kernel_id to run_python to work in that copy; each is independent."
                        .to_owned(),
                );
                let mut result =
                    CallToolResult::success(vec![ContentBlock::text(lines.join("\n"))]);
                result.structured_content = Some(json!({"kernel_ids": ids, "kind": forked.kind}));
                Ok(result)
            }
            "start_kernel" => {
                let a: tools::StartKernel = tools::parse("start_kernel", "{}", args)?;
                let kernel = match a.snapshot.as_deref() {
                    Some(snapshot) => self.state.mcp.create_from(&caller.tenant, snapshot).await?,
                    None => self.state.mcp.create_kernel(&caller.tenant, true).await?,
                };
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
                 read_file, write_file, install_packages, restart_kernel, start_kernel, \
                 snapshot_kernel and fork_kernel"
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
