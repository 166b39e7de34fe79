//! envd's `process.Process` service (port 49983, Connect RPC with the JSON codec): shell
//! commands and terminals in a sandbox, as E2B's `commands.run` and `pty.create` use them.
//!
//! - `Start` (server stream): runs a command through the engine's interactive exec, so it
//!   runs as the kernel's user in the kernel's container, under the launcher's syscall
//!   filter, with the sandbox's limits and no network. The stream gives its number, its
//!   output as it comes, and its end. A `connect-timeout-ms` deadline kills it when it
//!   passes (as envd does); a client that goes away leaves it running (a background
//!   command), and `Connect` reattaches to its output from then on.
//! - `List`, `SendInput`, `StreamInput` (client stream), `SendSignal`, `CloseStdin`,
//!   `Update` (a terminal's size).
//!
//! Each command is audited (`command_started`, `command_finished`) and meets the policy's
//! shell rules first. A process's number (`pid`) is the gateway's, per gateway, not the
//! container's: it names the process in these calls.

use super::super::AppState;
use super::connect::{self, ConnectError, Envelopes, RpcPath};
use super::plane::SandboxCall;
use crate::audit::{extend_preview, sha256, Record, Sender, OUTPUT_PREVIEW_CHARS};
use crate::backend::{InteractiveControl, InteractiveRequest, Output, Signal, TtySize};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use futures::StreamExt;
use kernelgate_policy::Decision;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// Processes one sandbox may run at once.
const MAX_PROCESSES: usize = 64;
/// The first process number: clear of the small numbers a reader takes for real pids.
const FIRST_PID: u32 = 1000;
/// Output events a listener may lag behind before the process waits for it (a pipe's
/// back-pressure; a listener that went away is dropped, not waited for).
const LISTENER_BACKLOG: usize = 256;
/// Keep-alive events when the client asks for none.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(50);
/// How often a kill is sent before it is given up on, and how long each waits for the end.
const KILL_TRIES: u32 = 5;
const KILL_CHECK: Duration = Duration::from_secs(1);
/// How long a process's end waits for its exit code once its output ended.
const WAIT_FOR_EXIT: Duration = Duration::from_secs(30);

/// The running processes of every sandbox.
pub struct Processes {
    by_sandbox: Mutex<HashMap<String, BTreeMap<u32, Arc<Process>>>>,
    next_pid: AtomicU32,
}

impl Default for Processes {
    fn default() -> Self {
        Processes {
            by_sandbox: Mutex::default(),
            next_pid: AtomicU32::new(FIRST_PID),
        }
    }
}

impl std::fmt::Debug for Processes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let running: usize = self.lock().values().map(BTreeMap::len).sum();
        f.debug_struct("Processes")
            .field("running", &running)
            .finish()
    }
}

impl Processes {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, BTreeMap<u32, Arc<Process>>>> {
        self.by_sandbox.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn of(&self, sandbox: &str) -> Vec<Arc<Process>> {
        self.lock()
            .get(sandbox)
            .map(|p| p.values().cloned().collect())
            .unwrap_or_default()
    }

    fn find(&self, sandbox: &str, selector: &Selector) -> Result<Arc<Process>, ConnectError> {
        let found = self
            .lock()
            .get(sandbox)
            .and_then(|processes| match selector {
                Selector::Pid(pid) => processes.get(pid).cloned(),
                Selector::Tag(tag) => processes
                    .values()
                    .find(|p| p.tag.as_deref() == Some(tag))
                    .cloned(),
            });
        found.ok_or_else(|| {
            ConnectError::new(
                "not_found",
                format!("process with {selector} not found (it ended, or never ran here)"),
            )
        })
    }

    fn remove(&self, sandbox: &str, pid: u32) {
        let mut all = self.lock();
        if let Some(processes) = all.get_mut(sandbox) {
            processes.remove(&pid);
            if processes.is_empty() {
                all.remove(sandbox);
            }
        }
    }
}

/// One running process.
struct Process {
    pid: u32,
    tag: Option<String>,
    /// `cmd`, `args`, `envs`, `cwd` as started, for `List`.
    config: Value,
    terminal: bool,
    /// `None` once closed.
    stdin: tokio::sync::Mutex<Option<Pin<Box<dyn AsyncWrite + Send>>>>,
    control: Box<dyn InteractiveControl>,
    listeners: Mutex<Vec<mpsc::Sender<Value>>>,
    /// True once its output and exit code are in.
    ended: tokio::sync::watch::Sender<bool>,
}

impl Process {
    /// Sends `signal`, and for a kill sends it again until the process has ended: a
    /// command signalled while the launcher still sets it up can miss it (the engine finds
    /// it by its tag, which a process being set up does not show yet).
    async fn signal(&self, signal: Signal) -> Result<(), crate::backend::BackendError> {
        let mut ended = self.ended.subscribe();
        for _ in 0..KILL_TRIES {
            self.control.signal(signal).await?;
            if signal != Signal::Kill {
                return Ok(());
            }
            let gone = tokio::time::timeout(KILL_CHECK, ended.wait_for(|done| *done)).await;
            if gone.is_ok() {
                return Ok(());
            }
        }
        tracing::warn!(
            pid = self.pid,
            "a killed command still runs after {KILL_TRIES} tries"
        );
        Ok(())
    }

    fn listen(&self) -> mpsc::Receiver<Value> {
        let (tx, rx) = mpsc::channel(LISTENER_BACKLOG);
        self.listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(tx);
        rx
    }

    /// Gives `event` to every listener, waiting for those that lag (the process's output
    /// waits as a full pipe does); drops those that went away.
    async fn tell(&self, event: Value) {
        let listeners: Vec<_> = self
            .listeners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut gone = Vec::new();
        for listener in listeners {
            if listener.send(event.clone()).await.is_err() {
                gone.push(listener);
            }
        }
        if !gone.is_empty() {
            self.listeners
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|l| !gone.iter().any(|g| g.same_channel(l)));
        }
    }
}

/// How a call names a process.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Selector {
    Pid(u32),
    Tag(String),
}

impl std::fmt::Display for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Selector::Pid(pid) => write!(f, "pid {pid}"),
            Selector::Tag(tag) => write!(f, "tag {tag:?}"),
        }
    }
}

/// `process` of a request: `{"pid": n}` or `{"tag": "…"}` (a number may come as a
/// string: protobuf's JSON mapping allows both).
fn selector(request: &Value) -> Result<Selector, ConnectError> {
    let process = &request["process"];
    if let Some(pid) = number(&process["pid"]) {
        return u32::try_from(pid).map(Selector::Pid).map_err(|_| {
            ConnectError::new("invalid_argument", format!("pid {pid} is out of range"))
        });
    }
    match process["tag"].as_str() {
        Some(tag) => Ok(Selector::Tag(tag.to_owned())),
        None => Err(ConnectError::new(
            "invalid_argument",
            "name the process: `process` needs a `pid` or a `tag`",
        )),
    }
}

fn number(value: &Value) -> Option<u64> {
    value
        .as_u64()
        .or_else(|| value.as_str().and_then(|s| s.parse().ok()))
}

/// Bytes of a request, base64 as protobuf's JSON mapping has them.
fn bytes_of(value: &Value) -> Result<Vec<u8>, ConnectError> {
    let text = value.as_str().unwrap_or_default();
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .or_else(|_| base64::engine::general_purpose::URL_SAFE.decode(text))
        .map_err(|_| ConnectError::new("invalid_argument", "input bytes are not base64"))
}

fn encoded(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The user a call runs as, from its `Authorization: Basic <user:>`: only the kernel's
/// user (the SDK's default, `user`) is taken.
fn only_the_kernels_user(headers: &HeaderMap) -> Result<(), ConnectError> {
    let Some(value) = headers
        .get(header::AUTHORIZATION)
        .or_else(|| headers.get(super::plane::FORWARDED_USER))
        .and_then(|v| v.to_str().ok())
    else {
        return Ok(());
    };
    let user = value
        .strip_prefix("Basic ")
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .map(|raw| String::from_utf8_lossy(&raw).into_owned())
        .unwrap_or_default();
    let user = user.split(':').next().unwrap_or_default();
    match user {
        "" | "user" => Ok(()),
        other => Err(ConnectError::new(
            "permission_denied",
            format!(
                "user {other:?} is refused: commands run as the sandbox's kernel user (the \
                 SDK's default, \"user\"), never as root"
            ),
        )),
    }
}

/// The shell line a command runs, as the policy and the audit trail read it: what the
/// SDK passes to `bash -l -c`, else the argv joined.
fn command_line(cmd: &str, args: &[String]) -> String {
    match (cmd, args) {
        ("/bin/bash" | "bash" | "/bin/sh" | "sh", [.., flag, line]) if flag == "-c" => line.clone(),
        _ => std::iter::once(cmd)
            .chain(args.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" "),
    }
}

/// A command's working directory in the container: E2B's `/home/user/...` is the kernel's
/// home; another absolute path is taken as it is (the root is read-only, the user
/// unprivileged); a relative one is under the home.
fn workdir(cwd: Option<&str>) -> Result<Option<String>, ConnectError> {
    use crate::backend::sandbox::KERNEL_HOME;
    let Some(cwd) = cwd.filter(|c| !c.is_empty()) else {
        return Ok(None);
    };
    if cwd.chars().any(char::is_control) {
        return Err(ConnectError::new(
            "invalid_argument",
            "cwd may not contain control characters",
        ));
    }
    match kernelgate_protocol::e2b::relative_path(cwd) {
        Ok(rel) if rel.is_empty() => Ok(Some(KERNEL_HOME.to_owned())),
        Ok(rel) => Ok(Some(format!("{KERNEL_HOME}/{rel}"))),
        Err(_) => Ok(Some(cwd.to_owned())),
    }
}

/// `POST /process.Process/{method}`.
pub async fn rpc(
    State(state): State<AppState>,
    call: SandboxCall,
    Path(path): Path<RpcPath>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = match path.method.as_str() {
        "StreamInput" => return stream_input(&state, &call, body).await,
        method => match axum::body::to_bytes(body, state.max_message_bytes).await {
            Ok(bytes) => serve(&state, &call, method, &headers, &bytes).await,
            Err(_) => Err(ConnectError::new(
                "resource_exhausted",
                format!(
                    "the request is larger than the gateway takes ({} bytes)",
                    state.max_message_bytes
                ),
            )),
        },
    };
    result.unwrap_or_else(IntoResponse::into_response)
}

async fn serve(
    state: &AppState,
    call: &SandboxCall,
    method: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ConnectError> {
    let processes = &state.e2b.processes;
    match method {
        "Start" => start(state, call, headers, connect::single(body)?).await,
        "Connect" => {
            let process = processes.find(&call.id, &selector(&connect::single(body)?)?)?;
            let events = process.listen();
            Ok(answer_stream(process, events, Timing::of(headers), false))
        }
        "List" => {
            let listed: Vec<Value> = processes
                .of(&call.id)
                .iter()
                .map(|p| {
                    let mut info = json!({"pid": p.pid, "config": p.config});
                    if let Some(tag) = &p.tag {
                        info["tag"] = json!(tag);
                    }
                    info
                })
                .collect();
            Ok(Json(json!({"processes": listed})).into_response())
        }
        "SendInput" => {
            let request = connect::unary(body)?;
            let process = processes.find(&call.id, &selector(&request)?)?;
            write_input(&process, &request["input"]).await?;
            Ok(Json(json!({})).into_response())
        }
        "SendSignal" => {
            let request = connect::unary(body)?;
            let process = processes.find(&call.id, &selector(&request)?)?;
            let signal = match &request["signal"] {
                Value::String(s) if s == "SIGNAL_SIGKILL" => Signal::Kill,
                Value::Number(n) if n.as_u64() == Some(9) => Signal::Kill,
                Value::String(s) if s == "SIGNAL_SIGTERM" => Signal::Terminate,
                Value::Number(n) if n.as_u64() == Some(15) => Signal::Terminate,
                other => {
                    return Err(ConnectError::new(
                        "invalid_argument",
                        format!("signal {other} is not offered: SIGNAL_SIGTERM or SIGNAL_SIGKILL"),
                    ))
                }
            };
            process
                .signal(signal)
                .await
                .map_err(|e| ConnectError::new("internal", e.to_string()))?;
            Ok(Json(json!({})).into_response())
        }
        "CloseStdin" => {
            let request = connect::unary(body)?;
            let process = processes.find(&call.id, &selector(&request)?)?;
            if process.terminal {
                return Err(ConnectError::new(
                    "failed_precondition",
                    "a terminal's input is not closed: send Ctrl-D (0x04) to end it",
                ));
            }
            if let Some(mut stdin) = process.stdin.lock().await.take() {
                // The process may have gone: its input is closed either way.
                let _ = stdin.shutdown().await;
            }
            Ok(Json(json!({})).into_response())
        }
        "Update" => {
            let request = connect::unary(body)?;
            let process = processes.find(&call.id, &selector(&request)?)?;
            let size = tty_size(&request["pty"]).ok_or_else(|| {
                ConnectError::new("invalid_argument", "give the terminal's size: pty.size")
            })?;
            if !process.terminal {
                return Err(ConnectError::new(
                    "failed_precondition",
                    format!("process {} has no terminal to resize", process.pid),
                ));
            }
            process
                .control
                .resize(size)
                .await
                .map_err(|e| ConnectError::new("internal", e.to_string()))?;
            Ok(Json(json!({})).into_response())
        }
        other => Err(ConnectError::new(
            "unimplemented",
            format!("process.Process/{other} is not a call of envd's process service"),
        )),
    }
}

fn tty_size(pty: &Value) -> Option<TtySize> {
    let size = pty.get("size")?;
    let rows = number(&size["rows"]).unwrap_or(24);
    let cols = number(&size["cols"]).unwrap_or(80);
    Some(TtySize {
        rows: u16::try_from(rows.clamp(1, 1000)).unwrap_or(24),
        cols: u16::try_from(cols.clamp(1, 1000)).unwrap_or(80),
    })
}

/// Writes `input` (`{"stdin": b64}` or `{"pty": b64}`) to the process.
async fn write_input(process: &Process, input: &Value) -> Result<(), ConnectError> {
    let data = match (input.get("stdin"), input.get("pty")) {
        (Some(data), _) | (None, Some(data)) => bytes_of(data)?,
        (None, None) => {
            return Err(ConnectError::new(
                "invalid_argument",
                "input needs `stdin` or `pty` bytes",
            ))
        }
    };
    let mut stdin = process.stdin.lock().await;
    let Some(writer) = stdin.as_mut() else {
        return Err(ConnectError::new(
            "failed_precondition",
            format!(
                "the input of process {} is closed (it was started without stdin, or it \
                 was closed)",
                process.pid
            ),
        ));
    };
    let written = async {
        writer.write_all(&data).await?;
        writer.flush().await
    };
    written.await.map_err(|e| {
        ConnectError::new(
            "failed_precondition",
            format!("process {} takes no more input: {e}", process.pid),
        )
    })
}

/// `StreamInput`: a client stream that names a process, then sends its input in order.
async fn stream_input(state: &AppState, call: &SandboxCall, body: Body) -> Response {
    let mut reader = Envelopes::default();
    let mut process: Option<Arc<Process>> = None;
    let mut chunks = body.into_data_stream();
    let failed = loop {
        let Some(chunk) = chunks.next().await else {
            break None;
        };
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(e) => {
                break Some(ConnectError::new(
                    "canceled",
                    format!("the stream broke: {e}"),
                ))
            }
        };
        let (messages, ended) = match reader.push(&chunk) {
            Ok(read) => read,
            Err(e) => break Some(e),
        };
        let mut failure = None;
        for message in messages {
            if let Some(start) = message.get("start") {
                match selector(start).and_then(|s| state.e2b.processes.find(&call.id, &s)) {
                    Ok(found) => process = Some(found),
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            } else if let Some(data) = message.get("data") {
                let Some(target) = &process else {
                    failure = Some(ConnectError::new(
                        "invalid_argument",
                        "the stream's first message names the process (`start`)",
                    ));
                    break;
                };
                if let Err(e) = write_input(target, &data["input"]).await {
                    failure = Some(e);
                    break;
                }
            }
        }
        if failure.is_some() {
            break failure;
        }
        if ended {
            break None;
        }
    };
    let mut out = Vec::new();
    match failed {
        Some(e) => out.extend_from_slice(&e.end_of_stream()),
        None => {
            out.extend_from_slice(&connect::message(&json!({})));
            out.extend_from_slice(&connect::end_ok());
        }
    }
    (
        [(header::CONTENT_TYPE, "application/connect+json")],
        Bytes::from(out),
    )
        .into_response()
}

/// A stream's deadline and keep-alives, from the request's headers.
#[derive(Debug, Clone, Copy)]
struct Timing {
    deadline: Option<tokio::time::Instant>,
    keepalive: Duration,
}

impl Timing {
    fn of(headers: &HeaderMap) -> Timing {
        Timing {
            deadline: connect::deadline(headers),
            keepalive: connect::keepalive(headers, DEFAULT_KEEPALIVE),
        }
    }
}

/// The answer of `Start` and `Connect`: the process's number, then its events until its
/// end. `kill_at_deadline`: the stream started it, and its deadline ends it.
fn answer_stream(
    process: Arc<Process>,
    mut events: mpsc::Receiver<Value>,
    timing: Timing,
    kill_at_deadline: bool,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    tokio::spawn(async move {
        let start = connect::message(&json!({"event": {"start": {"pid": process.pid}}}));
        if tx.send(start).await.is_err() {
            return;
        }
        let deadline = async {
            match timing.deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(deadline);
        let mut keepalive = tokio::time::interval(timing.keepalive);
        keepalive.tick().await;
        loop {
            let out = tokio::select! {
                event = events.recv() => match event {
                    Some(event) => {
                        let end = event.get("end").is_some();
                        let message = connect::message(&json!({"event": event}));
                        if tx.send(message).await.is_err() {
                            return;
                        }
                        if end {
                            connect::end_ok()
                        } else {
                            continue;
                        }
                    }
                    None => ConnectError::new(
                        "unavailable",
                        format!("process {} ended without an exit code (its sandbox ended?)", process.pid),
                    )
                    .end_of_stream(),
                },
                () = &mut deadline => {
                    if kill_at_deadline {
                        if let Err(e) = process.signal(Signal::Kill).await {
                            tracing::warn!(pid = process.pid, error = %e, "cannot kill a command past its timeout");
                        }
                    }
                    ConnectError::new(
                        "deadline_exceeded",
                        format!(
                            "process {} ran past the call's timeout{}",
                            process.pid,
                            if kill_at_deadline { " and was killed" } else { "" }
                        ),
                    )
                    .end_of_stream()
                }
                _ = keepalive.tick() => {
                    if tx.send(connect::message(&json!({"event": {"keepalive": {}}}))).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let _ = tx.send(out).await;
            return;
        }
    });
    connect::streaming(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|bytes| (bytes, rx))
    }))
}

mod start;
use start::start;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sdks_shell_line_is_what_the_policy_reads() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            command_line("/bin/bash", &args(&["-l", "-c", "ls -la | wc -l"])),
            "ls -la | wc -l"
        );
        assert_eq!(
            command_line("/bin/bash", &args(&["-i", "-l"])),
            "/bin/bash -i -l"
        );
        assert_eq!(command_line("python3", &args(&["x.py"])), "python3 x.py");
    }

    #[test]
    fn working_directories_map_the_sdks_home() {
        assert_eq!(workdir(None).ok(), Some(None));
        assert_eq!(
            workdir(Some("/home/user")).ok().flatten().as_deref(),
            Some("/home/kernel")
        );
        assert_eq!(
            workdir(Some("/home/user/data")).ok().flatten().as_deref(),
            Some("/home/kernel/data")
        );
        assert_eq!(
            workdir(Some("data")).ok().flatten().as_deref(),
            Some("/home/kernel/data")
        );
        assert_eq!(
            workdir(Some("/tmp")).ok().flatten().as_deref(),
            Some("/tmp")
        );
        assert!(workdir(Some("/tmp\n")).is_err());
    }

    #[test]
    fn only_the_kernels_user_runs_commands() {
        let with = |user: &str| {
            let mut headers = HeaderMap::new();
            let value = format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:"))
            );
            headers.insert(header::AUTHORIZATION, value.parse().expect("header"));
            only_the_kernels_user(&headers)
        };
        assert!(with("user").is_ok());
        let refused = with("root").expect_err("root is refused");
        assert_eq!(refused.code, "permission_denied");
        assert!(refused.message.contains("\"root\""), "{}", refused.message);
        assert!(only_the_kernels_user(&HeaderMap::new()).is_ok());
    }

    #[test]
    fn processes_are_named_by_pid_or_tag() {
        assert_eq!(
            selector(&json!({"process": {"pid": 1001}})).ok(),
            Some(Selector::Pid(1001))
        );
        assert_eq!(
            selector(&json!({"process": {"pid": "1002"}})).ok(),
            Some(Selector::Pid(1002))
        );
        assert_eq!(
            selector(&json!({"process": {"tag": "server"}})).ok(),
            Some(Selector::Tag("server".into()))
        );
        assert!(selector(&json!({"process": {}})).is_err());
        assert_eq!(
            tty_size(&json!({"size": {"cols": 120, "rows": 40}})),
            Some(TtySize {
                rows: 40,
                cols: 120
            })
        );
        assert_eq!(tty_size(&json!({})), None);
    }
}
