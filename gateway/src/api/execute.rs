//! `POST /api/kernels/{id}/execute`: the agent API. One call runs code and returns
//! everything it produced (or streams it as NDJSON with `Accept: application/x-ndjson`).
//!
//! Calls on one kernel run one at a time, in arrival order. A timeout interrupts the
//! kernel and returns what was produced with status `timeout`; a client that goes away
//! mid-run gets its run interrupted too. The kernel's state survives both.

use super::error::ApiError;
use super::kernels::find;
use super::AppState;
use crate::kernels::{Kernels, LiveKernel};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kernelgate_protocol::content::ExecuteRequest;
use kernelgate_protocol::{Channel, RawJson};
use serde::Deserialize;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Used when a call gives no timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// How long an interrupted run may take to report back before the call gives up on it.
const INTERRUPT_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, Deserialize)]
pub struct ExecuteBody {
    code: String,
    /// Seconds; fractional values are allowed.
    #[serde(default)]
    timeout: Option<f64>,
}

/// One thing a run produced, in order. Serialized as an NDJSON line.
#[derive(Debug, Clone)]
enum Event {
    Stream {
        name: String,
        text: String,
    },
    Result {
        data: Value,
        metadata: Value,
        is_main_result: bool,
    },
    Error {
        ename: String,
        evalue: String,
        traceback: Value,
    },
    End {
        status: &'static str,
        execution_count: Option<i64>,
        duration_ms: u64,
    },
}

impl Event {
    fn to_json(&self) -> Value {
        match self {
            Event::Stream { name, text } => json!({"type": name, "text": text}),
            Event::Result {
                data,
                metadata,
                is_main_result,
            } => {
                json!({"type": "result", "data": data, "metadata": metadata, "is_main_result": is_main_result})
            }
            Event::Error {
                ename,
                evalue,
                traceback,
            } => {
                json!({"type": "error", "ename": ename, "evalue": evalue, "traceback": traceback})
            }
            Event::End {
                status,
                execution_count,
                duration_ms,
            } => {
                json!({"type": "end", "status": status, "execution_count": execution_count, "duration_ms": duration_ms})
            }
        }
    }
}

pub async fn execute(
    State(state): State<AppState>,
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
    let live = find(&state, &id)?;
    let (tx, rx) = mpsc::channel::<Event>(256);
    let kernels = state.kernels.clone();
    let code = body.code;
    state
        .tracker
        .spawn(async move { run(kernels, live, code, timeout, tx).await });

    let streaming = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/x-ndjson"));
    if streaming {
        let lines = futures::stream::unfold(rx, |mut rx| async move {
            let event = rx.recv().await?;
            let mut line = event.to_json().to_string();
            line.push('\n');
            Some((Ok::<_, std::convert::Infallible>(line), rx))
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
async fn collect(mut rx: mpsc::Receiver<Event>) -> Value {
    let (mut stdout, mut stderr) = (String::new(), String::new());
    let mut results = Vec::new();
    let mut error = Value::Null;
    let mut end = json!({"status": "error", "execution_count": null, "duration_ms": 0});
    while let Some(event) = rx.recv().await {
        match event {
            Event::Stream { name, text } if name == "stdout" => stdout += &text,
            Event::Stream { text, .. } => stderr += &text,
            Event::Result {
                data,
                metadata,
                is_main_result,
            } => results.push(
                json!({"data": data, "metadata": metadata, "is_main_result": is_main_result}),
            ),
            Event::Error {
                ename,
                evalue,
                traceback,
            } => error = json!({"ename": ename, "evalue": evalue, "traceback": traceback}),
            e @ Event::End { .. } => end = e.to_json(),
        }
    }
    json!({
        "status": end["status"], "execution_count": end["execution_count"],
        "stdout": stdout, "stderr": stderr, "results": results, "error": error,
        "duration_ms": end["duration_ms"],
    })
}

/// Runs one execution to its end, sending events as they come. Stops the kernel's work
/// (interrupt) when the timeout passes or the caller stops listening.
async fn run(
    kernels: Arc<Kernels>,
    live: Arc<LiveKernel>,
    code: String,
    timeout: Duration,
    tx: mpsc::Sender<Event>,
) {
    let _turn = live.runs.lock().await;
    let started = Instant::now();
    let me = live.kernel.attach(
        &format!("kernelgate-execute-{}", uuid::Uuid::new_v4()),
        true,
    );
    let mut request = ExecuteRequest::new(&code);
    // Nobody could answer input(): make it fail fast instead of hanging the run.
    request.allow_stdin = false;
    let message = live
        .kernel
        .request("execute_request", RawJson::from_value(&request));
    let msg_id = message.msg_id().to_owned();
    let end = |status, execution_count| Event::End {
        status,
        execution_count,
        duration_ms: started.elapsed().as_millis() as u64,
    };
    if let Err(e) = me.send(Channel::Shell, message).await {
        let _ = tx
            .send(Event::Error {
                ename: "KernelUnavailable".into(),
                evalue: e.to_string(),
                traceback: json!([]),
            })
            .await;
        let _ = tx.send(end("error", None)).await;
        return;
    }

    let mut deadline = tokio::time::Instant::now() + timeout;
    let mut interrupted_for: Option<&'static str> = None;
    let (mut reply, mut idle) = (None::<(String, Option<i64>)>, false);
    while reply.is_none() || !idle {
        let batch = tokio::select! {
            b = me.recv() => b,
            _ = tokio::time::sleep_until(deadline) => {
                if interrupted_for.is_some() {
                    break; // the interrupt did not end it either: give up waiting
                }
                interrupted_for = Some("timeout");
                interrupt(&kernels, &live).await;
                deadline = tokio::time::Instant::now() + INTERRUPT_GRACE;
                continue;
            }
            _ = tx.closed(), if interrupted_for.is_none() => {
                tracing::info!(kernel = %live.id(), "execute caller went away; interrupting its run");
                interrupted_for = Some("abandoned");
                interrupt(&kernels, &live).await;
                deadline = tokio::time::Instant::now() + INTERRUPT_GRACE;
                continue;
            }
        };
        let Some(batch) = batch else { break };
        for out in batch {
            let m = &out.message;
            if out.channel == Channel::IoPub
                && m.parent_header.is_none()
                && m.msg_type() == "status"
            {
                // The gateway's own announcement: the kernel died under this run.
                let state = m
                    .content_as::<kernelgate_protocol::content::Status>()
                    .map(|s| s.execution_state);
                if let Ok(
                    s @ (kernelgate_protocol::content::ExecutionState::Dead
                    | kernelgate_protocol::content::ExecutionState::Restarting),
                ) = state
                {
                    let _ = tx
                        .send(Event::Error {
                            ename: "KernelDied".into(),
                            evalue: format!("the kernel died while running this code (now {}); its variables are lost", s.as_str()),
                            traceback: json!([]),
                        })
                        .await;
                    let _ = tx.send(end("error", None)).await;
                    return;
                }
            }
            if m.parent_msg_id() != Some(msg_id.as_str()) {
                continue;
            }
            let Ok(c) = serde_json::from_str::<Map<String, Value>>(m.content.get()) else {
                continue;
            };
            let field = |k: &str| c.get(k).cloned().unwrap_or(Value::Null);
            let text = |k: &str| {
                c.get(k)
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned()
            };
            let event = match (out.channel, m.msg_type()) {
                (Channel::IoPub, "stream") => Some(Event::Stream {
                    name: text("name"),
                    text: text("text"),
                }),
                (Channel::IoPub, t @ ("execute_result" | "display_data")) => Some(Event::Result {
                    data: field("data"),
                    metadata: field("metadata"),
                    is_main_result: t == "execute_result",
                }),
                (Channel::IoPub, "error") => Some(Event::Error {
                    ename: text("ename"),
                    evalue: text("evalue"),
                    traceback: field("traceback"),
                }),
                (Channel::IoPub, "status") => {
                    idle |= c.get("execution_state").and_then(Value::as_str) == Some("idle");
                    None
                }
                (Channel::Shell, "execute_reply") => {
                    reply = Some((
                        text("status"),
                        c.get("execution_count").and_then(Value::as_i64),
                    ));
                    None
                }
                _ => None,
            };
            if let Some(event) = event {
                // A closed receiver is handled by the select above.
                let _ = tx.send(event).await;
            }
        }
    }
    let status = match (interrupted_for, reply.as_ref().map(|r| r.0.as_str())) {
        (Some("timeout"), _) => "timeout",
        (_, Some("ok")) => "ok",
        _ => "error",
    };
    let _ = tx.send(end(status, reply.and_then(|r| r.1))).await;
}

async fn interrupt(kernels: &Kernels, live: &LiveKernel) {
    if let Err(e) = kernels.interrupt(live).await {
        tracing::warn!(kernel = %live.id(), error = %e, "cannot interrupt kernel");
    }
}
