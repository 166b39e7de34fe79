//! `POST /api/kernels/{id}/execute`: the agent API. One call runs code and returns
//! everything it produced (or streams it as NDJSON with `Accept: application/x-ndjson`).
//!
//! Calls on one kernel run one at a time, in arrival order. A timeout interrupts the
//! kernel and returns what was produced with status `timeout`; a client that goes away
//! mid-run gets its run interrupted too. The kernel's state survives both.

use super::auth::Caller;
use super::error::ApiError;
use super::kernels::find;
use super::AppState;
use crate::kernel::executions::TRUNCATED_METADATA;
use crate::kernels::{Kernels, LiveKernel};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kernelgate_protocol::content::{ErrorContent, ExecuteRequest};
use kernelgate_protocol::execution::{Display, Event, Interruption, Phase, Status};
use kernelgate_protocol::{Channel, Execution, Outcome, RawJson};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::Instrument;

/// Used when a call gives no timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long an interrupted run may take to report back before the call gives up on it.
const INTERRUPT_GRACE: Duration = Duration::from_secs(10);
/// After the reply, how long the run's final IOPub `idle` may lag. A kernel's IOPub drops
/// messages when its send queue is full (a flood of output), so `idle` can be lost: the run
/// then ends with what arrived instead of waiting for its timeout.
const IOPUB_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, Deserialize)]
pub struct ExecuteBody {
    code: String,
    /// Seconds; fractional values are allowed.
    #[serde(default)]
    timeout: Option<f64>,
    /// Which agent runs this, for the audit trail.
    #[serde(default)]
    agent_id: Option<String>,
}

/// One NDJSON line of a streamed run: an output, or the `end` line with the status.
fn event_line(event: &Event) -> Option<Value> {
    Some(match event {
        Event::Stream { name, text } => json!({"type": name, "text": text}),
        Event::Display(d) => result_json(d),
        Event::Error(e) => error_json(e),
        _ => return None,
    })
}

fn result_json(d: &Display) -> Value {
    json!({"type": "result", "data": d.data, "metadata": d.metadata, "is_main_result": d.is_result})
}

fn error_json(e: &ErrorContent) -> Value {
    json!({"type": "error", "ename": e.ename, "evalue": e.evalue, "traceback": e.traceback})
}

/// What [`run`] sends: each event as it happens, then how the run ended.
#[derive(Debug)]
enum Progress {
    Event(Event),
    End(End),
}

#[derive(Debug)]
struct End {
    status: Status,
    execution_count: Option<i64>,
    duration_ms: u64,
    /// Output past `--max-output-mb` was dropped.
    truncated: bool,
}

impl End {
    fn to_json(&self) -> Value {
        json!({"type": "end", "status": self.status.as_str(), "execution_count": self.execution_count, "duration_ms": self.duration_ms, "truncated": self.truncated})
    }
}

pub async fn execute(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body: ExecuteBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(format!(
            "body must be JSON like {{\"code\": \"1+1\", \"timeout\": 30}}: {e}"
        ))
    })?;
    let timeout = match body.timeout {
        None => DEFAULT_TIMEOUT,
        Some(t) if t.is_finite() && t > 0.0 && t <= 86_400.0 => Duration::from_secs_f64(t),
        Some(t) => {
            return Err(ApiError::bad_request(format!(
                "timeout {t} must be between 0 and 86400 seconds"
            )))
        }
    };
    let live = find(&state, &caller, &id)?;
    let (tx, rx) = mpsc::channel::<Progress>(256);
    let kernels = state.kernels.clone();
    let code = body.code;
    let runner = Runner {
        key: caller.0.name.clone(),
        agent_id: body.agent_id,
    };
    state
        .tracker
        .spawn(run(kernels, live, code, timeout, runner, tx).in_current_span());

    let streaming = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/x-ndjson"));
    if streaming {
        let lines = futures::stream::unfold(rx, |mut rx| async move {
            loop {
                let line = match rx.recv().await? {
                    Progress::Event(e) => event_line(&e),
                    Progress::End(end) => Some(end.to_json()),
                };
                if let Some(line) = line {
                    let mut line = line.to_string();
                    line.push('\n');
                    return Some((Ok::<_, std::convert::Infallible>(line), rx));
                }
            }
        });
        return Ok((
            [(header::CONTENT_TYPE, "application/x-ndjson")],
            Body::from_stream(lines),
        )
            .into_response());
    }
    Ok(Json(collect(rx).await).into_response())
}

/// Folds a run's events into the single JSON answer.
async fn collect(mut rx: mpsc::Receiver<Progress>) -> Value {
    let mut outcome = Outcome::default();
    let mut end = End {
        status: Status::Error,
        execution_count: None,
        duration_ms: 0,
        truncated: false,
    };
    while let Some(progress) = rx.recv().await {
        match progress {
            Progress::Event(e) => outcome.apply(&e),
            Progress::End(e) => end = e,
        }
    }
    // The same objects as the streamed lines, without their `type`.
    let untyped = |mut v: Value| {
        if let Some(o) = v.as_object_mut() {
            o.remove("type");
        }
        v
    };
    let results: Vec<Value> = outcome
        .displays
        .iter()
        .map(|d| untyped(result_json(d)))
        .collect();
    let error = outcome
        .error
        .as_ref()
        .map_or(Value::Null, |e| untyped(error_json(e)));
    json!({
        "status": end.status.as_str(), "execution_count": end.execution_count,
        "stdout": outcome.stdout, "stderr": outcome.stderr, "results": results, "error": error,
        "duration_ms": end.duration_ms, "truncated": end.truncated,
    })
}

/// Runs one execution to its end, sending events as they come. Stops the kernel's work
/// (interrupt) when the timeout passes or the caller stops listening.
/// Who runs the code: the key, and the agent it said it was.
#[derive(Debug)]
struct Runner {
    key: String,
    agent_id: Option<String>,
}

async fn run(
    kernels: Arc<Kernels>,
    live: Arc<LiveKernel>,
    code: String,
    timeout: Duration,
    runner: Runner,
    tx: mpsc::Sender<Progress>,
) {
    let _turn = live.runs.lock().await;
    let started = Instant::now();
    let me = live.kernel.attach(
        &format!("kernelgate-execute-{}", uuid::Uuid::new_v4()),
        true,
        &runner.key,
    );
    let mut request = ExecuteRequest::new(&code);
    // Nobody could answer input(): make it fail fast instead of hanging the run.
    request.allow_stdin = false;
    let mut message = live
        .kernel
        .request("execute_request", RawJson::from_value(&request));
    if let Some(agent) = runner.agent_id {
        message.header.extra.insert("agent_id".into(), agent.into());
    }
    let mut execution = Execution::new(message.msg_id());
    let mut truncated = false;
    let end = |execution: &Execution, truncated: bool| {
        Progress::End(End {
            status: execution.status(),
            execution_count: execution.reply().and_then(|r| r.execution_count),
            duration_ms: started.elapsed().as_millis() as u64,
            truncated,
        })
    };
    if let Err(e) = me.send(Channel::Shell, message).await {
        let unavailable = ErrorContent {
            ename: "KernelUnavailable".into(),
            evalue: e.to_string(),
            traceback: Vec::new(),
            extra: Map::new(),
        };
        let _ = tx.send(Progress::Event(Event::Error(unavailable))).await;
        let _ = tx.send(end(&execution, false)).await;
        return;
    }

    let mut deadline = tokio::time::Instant::now() + timeout;
    let mut idle_due: Option<tokio::time::Instant> = None;
    while !execution.is_done() {
        if idle_due.is_none() && execution.phase() == Phase::AwaitingIdle {
            idle_due = Some(tokio::time::Instant::now() + IOPUB_GRACE);
        }
        let batch = tokio::select! {
            b = me.recv() => b,
            _ = tokio::time::sleep_until(idle_due.unwrap_or(deadline).min(deadline)) => {
                if execution.phase() == Phase::AwaitingIdle {
                    tracing::warn!(kernel = %live.id(), "the kernel replied but its idle status never came (IOPub dropped it?); ending the run with what arrived");
                    break;
                }
                if execution.interruption().is_some() {
                    break; // the interrupt did not end it either: give up waiting
                }
                execution.interrupted(Interruption::Timeout);
                interrupt(&kernels, &live).await;
                deadline = tokio::time::Instant::now() + INTERRUPT_GRACE;
                continue;
            }
            _ = tx.closed(), if execution.interruption().is_none() => {
                tracing::info!(kernel = %live.id(), "execute caller went away; interrupting its run");
                execution.interrupted(Interruption::Abandoned);
                interrupt(&kernels, &live).await;
                deadline = tokio::time::Instant::now() + INTERRUPT_GRACE;
                continue;
            }
        };
        let Some(batch) = batch else { break };
        for out in batch {
            let Some(event) = execution.feed(out.channel, &out.message) else {
                continue;
            };
            truncated |= is_truncation_notice(&out.message);
            if let Event::KernelLost(state) = event {
                let died = ErrorContent {
                    ename: "KernelDied".into(),
                    evalue: format!(
                        "the kernel died while running this code (now {}); its variables are lost",
                        state.as_str()
                    ),
                    traceback: Vec::new(),
                    extra: Map::new(),
                };
                let _ = tx.send(Progress::Event(Event::Error(died))).await;
                break;
            }
            // A closed receiver is handled by the select above.
            let _ = tx.send(Progress::Event(event)).await;
        }
    }
    let _ = tx.send(end(&execution, truncated)).await;
}

/// The gateway's own notice that an execution's output was cut.
fn is_truncation_notice(message: &kernelgate_protocol::Message) -> bool {
    message.msg_type() == "stream" && message.metadata.get().contains(TRUNCATED_METADATA)
}

async fn interrupt(kernels: &Kernels, live: &LiveKernel) {
    if let Err(e) = kernels.interrupt(live).await {
        tracing::warn!(kernel = %live.id(), error = %e, "cannot interrupt kernel");
    }
}
