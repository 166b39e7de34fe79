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
use crate::kernels::run::{self, End, Progress, Run};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kernelgate_protocol::content::ErrorContent;
use kernelgate_protocol::execution::{Display, Event, Status};
use kernelgate_protocol::Outcome;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::sync::mpsc;

/// Used when a call gives no timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

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

fn end_json(end: &End) -> Value {
    json!({"type": "end", "status": end.status.as_str(), "execution_count": end.execution_count, "duration_ms": end.duration_ms, "truncated": end.truncated})
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
    let rx = run::start(
        &state.tracker,
        state.kernels.clone(),
        live,
        Run {
            code: body.code,
            timeout,
            key: caller.0.name.clone(),
            agent_id: body.agent_id,
        },
    )
    .await;

    let streaming = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/x-ndjson"));
    if streaming {
        let lines = futures::stream::unfold(rx, |mut rx| async move {
            loop {
                let line = match rx.recv().await? {
                    Progress::Event(e) => event_line(&e),
                    Progress::End(end) => Some(end_json(&end)),
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
