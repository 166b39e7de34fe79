//! `POST /api/kernels/{id}/execute`: the agent API. One call runs code and returns
//! everything it produced (or streams it as NDJSON with `Accept: application/x-ndjson`).
//!
//! Calls on one kernel run one at a time, in arrival order. A timeout interrupts the
//! kernel and returns what was produced with status `timeout`; a client that goes away
//! mid-run gets its run interrupted too. The kernel's state survives both.

use super::auth::Caller;
use super::error::{body_refused, ApiError, ErrorBody};
use super::extract::{json_body, Path};
use super::kernels::{find, KernelPath};
use super::AppState;
use crate::kernels::run::{self, End, Progress, Run};
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kernelgate_protocol::content::ErrorContent;
use kernelgate_protocol::execution::{Display, Event, Status};
use kernelgate_protocol::Outcome;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;

/// Used when a call gives no timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// The longest timeout a call may ask for, in seconds (a day).
const MAX_TIMEOUT_SECS: f64 = 86_400.0;

/// The body of `POST /api/kernels/{id}/execute`. A field it does not have is refused (400,
/// naming it) rather than ignored: a misspelt `timeout` would otherwise run for 300 s.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecuteBody {
    /// The cell's code (IPython syntax).
    #[schema(example = "x = 41\nx + 1")]
    code: String,
    /// Seconds, fractions allowed, above 0 and at most 86400 (default 300). When it passes,
    /// the kernel is interrupted and the answer has status `timeout`.
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 86400.0, example = 30)]
    timeout: Option<f64>,
    /// Which agent runs this, for the audit trail.
    #[serde(default)]
    agent_id: Option<String>,
}

fn status_schema() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(["ok", "error", "timeout"]))
        .build()
}

/// A display (`plt.show()`, `display(...)`) or the cell's value, with every MIME type the
/// kernel sent (`image/png` as base64).
#[derive(Debug, Serialize, ToSchema)]
pub struct ResultOutput {
    /// MIME type to data: `text/plain`, `text/html`, `image/png`, `application/json`, ...
    #[schema(value_type = HashMap<String, Value>)]
    data: Map<String, Value>,
    #[schema(value_type = HashMap<String, Value>)]
    metadata: Map<String, Value>,
    /// The cell's value (`execute_result`), as opposed to a display.
    is_main_result: bool,
}

impl From<Display> for ResultOutput {
    fn from(d: Display) -> Self {
        ResultOutput {
            data: d.data,
            metadata: d.metadata,
            is_main_result: d.is_result,
        }
    }
}

/// The exception that ended the run (`KernelDied` when the kernel died under it).
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorOutput {
    #[schema(example = "ZeroDivisionError")]
    ename: String,
    #[schema(example = "division by zero")]
    evalue: String,
    /// Lines with ANSI colour codes, as IPython prints them.
    traceback: Vec<String>,
}

impl From<ErrorContent> for ErrorOutput {
    fn from(e: ErrorContent) -> Self {
        ErrorOutput {
            ename: e.ename,
            evalue: e.evalue,
            traceback: e.traceback,
        }
    }
}

/// The answer of a run, once it is done.
#[derive(Debug, Serialize, ToSchema)]
pub struct ExecuteResult {
    #[schema(schema_with = status_schema)]
    status: &'static str,
    execution_count: Option<i64>,
    stdout: String,
    stderr: String,
    results: Vec<ResultOutput>,
    /// Set when `status` is `error`.
    error: Option<ErrorOutput>,
    duration_ms: u64,
    /// Output past `--max-output-mb` was dropped.
    truncated: bool,
}

/// One line of a streamed run (`Accept: application/x-ndjson`): each output as it arrives,
/// and last the `end` line.
#[derive(Debug, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Line {
    Stdout { text: String },
    Stderr { text: String },
    Result(ResultOutput),
    Error(ErrorOutput),
    End(EndLine),
}

/// One NDJSON line of a streamed run: an output, or the `end` line with the status.
fn event_line(event: Event) -> Option<Line> {
    Some(match event {
        Event::Stream { name, text } if name == "stderr" => Line::Stderr { text },
        Event::Stream { text, .. } => Line::Stdout { text },
        Event::Display(d) => Line::Result(d.into()),
        Event::Error(e) => Line::Error(e.into()),
        _ => return None,
    })
}

/// How a run ended: the last line of a streamed run.
#[derive(Debug, Serialize, ToSchema)]
pub struct EndLine {
    #[schema(schema_with = status_schema)]
    status: &'static str,
    execution_count: Option<i64>,
    duration_ms: u64,
    /// Output past `--max-output-mb` was dropped.
    truncated: bool,
}

impl From<End> for EndLine {
    fn from(end: End) -> Self {
        EndLine {
            status: end.status.as_str(),
            execution_count: end.execution_count,
            duration_ms: end.duration_ms,
            truncated: end.truncated,
        }
    }
}

/// Runs code and answers with everything it produced.
///
/// The answer comes when the run is done; with `Accept: application/x-ndjson`, one JSON
/// object per line streams as output arrives instead. Calls on one kernel run one at a
/// time in arrival order; a caller that hangs up has its run interrupted. `input()` is
/// refused.
#[utoipa::path(
    post, path = "/api/kernels/{id}/execute", tag = "agent", operation_id = "execute",
    params(KernelPath),
    request_body = ExecuteBody,
    responses(
        (status = 200, description = "The run is done (`application/json`, the default), or its \
            outputs stream as they come (`application/x-ndjson`, when the `Accept` header names \
            it: one `Line` object per line, the last of type `end`)",
         content((ExecuteResult = "application/json"), (Line = "application/x-ndjson"))),
        (status = 400, description = "The body is not JSON of this shape (a field it does not have is named), or the timeout is out of range", body = ErrorBody),
        (status = 404, description = "No such kernel", body = ErrorBody),
    ),
)]
pub async fn execute(
    State(state): State<AppState>,
    caller: Caller,
    Path(KernelPath { id }): Path<KernelPath>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = match body {
        Ok(body) => body,
        Err(e) => return Ok(body_refused(e, state.max_message_bytes)),
    };
    let body: ExecuteBody = json_body(&body, r#"{"code": "1+1", "timeout": 30}"#)?;
    let timeout = match body.timeout {
        None => DEFAULT_TIMEOUT,
        Some(t) if t.is_finite() && t > 0.0 && t <= MAX_TIMEOUT_SECS => Duration::from_secs_f64(t),
        Some(t) => {
            return Err(ApiError::bad_request(format!(
                "timeout must be more than 0 and at most {MAX_TIMEOUT_SECS} seconds, not {t}; \
                 leave it out for {} seconds",
                DEFAULT_TIMEOUT.as_secs()
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
    let mut feed = Feed {
        rx,
        cancel: state.cancel.clone(),
        started: Instant::now(),
        end: None,
        stopped: false,
    };

    let streaming = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("application/x-ndjson"));
    if streaming {
        let lines = futures::stream::unfold(feed, |mut feed| async move {
            loop {
                let line = match feed.next().await? {
                    Progress::Event(e) => event_line(e),
                    Progress::End(end) => Some(Line::End(end.into())),
                };
                // Serializing plain strings and maps cannot fail; a line that did is skipped.
                if let Some(Ok(mut line)) = line.map(|l| serde_json::to_string(&l)) {
                    line.push('\n');
                    return Some((Ok::<_, std::convert::Infallible>(line), feed));
                }
            }
        });
        return Ok((
            [(header::CONTENT_TYPE, "application/x-ndjson")],
            Body::from_stream(lines),
        )
            .into_response());
    }
    Ok(Json(collect(&mut feed).await).into_response())
}

/// A run's progress, cut short when the gateway shuts down: the kernel's sockets close
/// then, so the run could only end by its timeout, and the shutdown (which waits for open
/// requests) would wait that long. The caller gets what was produced, a `GatewayShutdown`
/// error and the end.
struct Feed {
    rx: mpsc::Receiver<Progress>,
    cancel: CancellationToken,
    started: Instant,
    /// The end to send after the shutdown's error.
    end: Option<End>,
    stopped: bool,
}

impl Feed {
    async fn next(&mut self) -> Option<Progress> {
        if self.stopped {
            return self.end.take().map(Progress::End);
        }
        tokio::select! {
            biased;
            progress = self.rx.recv() => progress,
            () = self.cancel.cancelled() => {
                self.stopped = true;
                self.end = Some(End {
                    status: Status::Error,
                    execution_count: None,
                    duration_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
                    truncated: false,
                });
                Some(Progress::Event(Event::Error(ErrorContent {
                    ename: "GatewayShutdown".into(),
                    evalue: "the gateway is shutting down (SIGTERM or Ctrl-C) and removes its \
                             kernels; run the code again on a kernel of a running gateway"
                        .into(),
                    traceback: Vec::new(),
                    extra: Map::new(),
                })))
            }
        }
    }
}

/// Folds a run's events into the single JSON answer.
async fn collect(feed: &mut Feed) -> ExecuteResult {
    let mut outcome = Outcome::default();
    let mut end = EndLine {
        status: Status::Error.as_str(),
        execution_count: None,
        duration_ms: 0,
        truncated: false,
    };
    while let Some(progress) = feed.next().await {
        match progress {
            Progress::Event(e) => outcome.apply(&e),
            Progress::End(e) => end = e.into(),
        }
    }
    ExecuteResult {
        status: end.status,
        execution_count: end.execution_count,
        stdout: outcome.stdout,
        stderr: outcome.stderr,
        results: outcome.displays.into_iter().map(Into::into).collect(),
        error: outcome.error.map(Into::into),
        duration_ms: end.duration_ms,
        truncated: end.truncated,
    }
}
