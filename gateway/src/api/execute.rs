//! `POST /api/kernels/{id}/execute`: the agent API. One call runs code and returns
//! everything it produced (or streams it as NDJSON with `Accept: application/x-ndjson`).
//!
//! Calls on one kernel run one at a time, in arrival order. A timeout interrupts the
//! kernel and returns what was produced with status `timeout`; a client that goes away
//! mid-run gets its run interrupted too. The kernel's state survives both.
//!
//! With `"plain": true` text comes as a terminal shows it
//! ([`kernelgate_protocol::terminal`]): no escape sequences, each `\r`-redrawn line in its
//! final state. Streamed, each stream keeps its terminal state across chunks, so a line
//! is sent once it is finished (or at the end), never frame by frame.

use super::auth::Caller;
use super::error::{body_refused, ApiError, ErrorBody};
use super::extract::{json_body, Path};
use super::kernels::{find, KernelPath};
use super::AppState;
use crate::kernels::runner::{self, End, Job, Progress};
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kernelgate_protocol::content::ErrorContent;
use kernelgate_protocol::execution::{Event, Status};
use kernelgate_protocol::terminal::{plain_text, Terminal};
use kernelgate_protocol::Outcome;
use serde_json::{Map, Value};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Used when a call gives no timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// The longest timeout a call may ask for, in seconds (a day).
const MAX_TIMEOUT_SECS: f64 = 86_400.0;

/// The body, the answer and the streamed lines: the agent API's wire types, shared with
/// its clients.
pub use kernelgate_protocol::agent::{
    End as EndLine, ErrorOutput, ExecuteBody, ExecuteResult, Line, ResultOutput,
};

/// The NDJSON lines of a run with `plain`: each stream through a terminal of its own.
#[derive(Debug, Default)]
struct PlainLines {
    stdout: Terminal,
    stderr: Terminal,
}

impl PlainLines {
    /// The lines for one piece of progress: a stream chunk's finished lines (none while
    /// it only redraws), other outputs in plain text, and before `end` what each stream
    /// still had on its unfinished line.
    fn lines(&mut self, progress: Progress) -> Vec<Line> {
        match progress {
            Progress::Event(Event::Stream { name, text }) => {
                let stderr = name == "stderr";
                let terminal = if stderr {
                    &mut self.stderr
                } else {
                    &mut self.stdout
                };
                let text = terminal.push(&text);
                stream_line(stderr, text).into_iter().collect()
            }
            Progress::Event(Event::Display(mut d)) => {
                plain_result(&mut d.data);
                vec![Line::Result(d.into())]
            }
            Progress::Event(Event::Error(e)) => vec![Line::Error(plain_error(e))],
            Progress::Event(_) => Vec::new(),
            Progress::End(end) => {
                let stdout = stream_line(false, self.stdout.finish());
                let stderr = stream_line(true, self.stderr.finish());
                stdout
                    .into_iter()
                    .chain(stderr)
                    .chain([Line::End(end)])
                    .collect()
            }
        }
    }
}

fn stream_line(stderr: bool, text: String) -> Option<Line> {
    match (text.is_empty(), stderr) {
        (true, _) => None,
        (false, true) => Some(Line::Stderr { text }),
        (false, false) => Some(Line::Stdout { text }),
    }
}

/// A result's `text/plain` without escape sequences (a string or a list of lines).
fn plain_result(data: &mut Map<String, Value>) {
    match data.get_mut("text/plain") {
        Some(Value::String(text)) => *text = plain_text(text),
        Some(Value::Array(lines)) => {
            let text: String = lines.iter().filter_map(Value::as_str).collect();
            *lines = vec![Value::String(plain_text(&text))];
        }
        _ => {}
    }
}

fn plain_error(e: ErrorContent) -> ErrorOutput {
    ErrorOutput {
        ename: e.ename,
        evalue: e.evalue,
        traceback: e.traceback.iter().map(|line| plain_text(line)).collect(),
    }
}

/// Runs code and answers with everything it produced.
///
/// The answer comes when the run is done; with `Accept: application/x-ndjson`, one JSON
/// object per line streams as output arrives instead. Calls on one kernel run one at a
/// time in arrival order; a caller that hangs up has its run interrupted. `input()` is
/// refused. The kernel has no network: packages it lacks come only from the gateway's
/// allowlist (`GET /api/kernelgate/packages`), installed with `POST
/// /api/kernels/{id}/packages` or `%pip install` in the code.
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
    let rx = runner::submit(
        &state.tracker,
        state.kernels.clone(),
        live,
        Job {
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
        let plain = body.plain.then(PlainLines::default);
        let state = (feed, plain, std::collections::VecDeque::new());
        let lines = futures::stream::unfold(state, |(mut feed, mut plain, mut ready)| async move {
            loop {
                if let Some(line) = ready.pop_front() {
                    // Serializing strings and maps cannot fail; a line that did is skipped.
                    if let Ok(mut line) = serde_json::to_string(&line) {
                        line.push('\n');
                        let out = Ok::<_, std::convert::Infallible>(line);
                        return Some((out, (feed, plain, ready)));
                    }
                    continue;
                }
                let progress = feed.next().await?;
                match plain.as_mut() {
                    Some(plain) => ready.extend(plain.lines(progress)),
                    None => ready.extend(Line::of_progress(progress)),
                }
            }
        });
        return Ok((
            [(header::CONTENT_TYPE, "application/x-ndjson")],
            Body::from_stream(lines),
        )
            .into_response());
    }
    Ok(Json(collect(&mut feed, body.plain).await).into_response())
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
async fn collect(feed: &mut Feed, plain: bool) -> ExecuteResult {
    let mut outcome = Outcome::default();
    let mut end = End {
        status: Status::Error,
        execution_count: None,
        duration_ms: 0,
        truncated: false,
    };
    while let Some(progress) = feed.next().await {
        match progress {
            Progress::Event(e) => outcome.apply(&e),
            Progress::End(e) => end = e,
        }
    }
    if plain {
        outcome.stdout = plain_text(&outcome.stdout);
        outcome.stderr = plain_text(&outcome.stderr);
        for d in &mut outcome.displays {
            plain_result(&mut d.data);
        }
    }
    ExecuteResult {
        status: end.status,
        execution_count: end.execution_count,
        stdout: outcome.stdout,
        stderr: outcome.stderr,
        results: outcome.displays.into_iter().map(Into::into).collect(),
        error: outcome.error.map(|e| match plain {
            true => plain_error(e),
            false => e.into(),
        }),
        duration_ms: end.duration_ms,
        truncated: end.truncated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(name: &str, text: &str) -> Progress {
        Progress::Event(Event::Stream {
            name: name.into(),
            text: text.into(),
        })
    }

    fn texts(lines: &[Line]) -> Vec<String> {
        lines
            .iter()
            .map(|l| match l {
                Line::Stdout { text } => format!("stdout {text:?}"),
                Line::Stderr { text } => format!("stderr {text:?}"),
                Line::Result(_) => "result".into(),
                Line::Error(e) => format!("error {:?}", e.traceback),
                Line::End(_) => "end".into(),
            })
            .collect()
    }

    #[test]
    fn plain_lines_keep_each_streams_redrawn_line_until_it_is_done() {
        let mut plain = PlainLines::default();
        let mut out = Vec::new();
        for p in [
            stream("stderr", "\r  0%|"),
            stream("stdout", "start\n"),
            stream("stderr", "\r 50%|#"),
            stream("stderr", "\r100%|##\n\u{1b}[31mred"),
            stream("stdout", "tail"),
            Progress::Event(Event::Error(ErrorContent {
                ename: "E".into(),
                evalue: "v".into(),
                traceback: vec!["\u{1b}[0;31mE\u{1b}[0m: v".into()],
                extra: Map::new(),
            })),
            Progress::End(End {
                status: Status::Error,
                execution_count: Some(1),
                duration_ms: 1,
                truncated: false,
            }),
        ] {
            out.extend(plain.lines(p));
        }
        assert_eq!(
            texts(&out),
            [
                r#"stdout "start\n""#,
                r#"stderr "100%|##\n""#,
                r#"error ["E: v"]"#,
                r#"stdout "tail""#,
                r#"stderr "red""#,
                "end"
            ]
        );
    }
}
