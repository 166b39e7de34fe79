//! The agent API's wire types: the body of `POST /api/kernels/{id}/execute`, its JSON
//! answer, the NDJSON lines of a streamed run, and the files API's operations and entries.
//!
//! The gateway serializes them and clients (`kernelgate-client`) deserialize them with the
//! same types, so the two sides cannot drift apart. The OpenAPI schemas come from these
//! types too (feature `openapi`).

use crate::content::ErrorContent;
use crate::execution::{Display, Event, Status};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

#[cfg(feature = "openapi")]
use utoipa::ToSchema;

/// The body of `POST /api/kernels/{id}/execute`. A field it does not have is refused (400,
/// naming it) rather than ignored: a misspelt `timeout` would otherwise run for 300 s.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExecuteBody {
    /// The cell's code (IPython syntax).
    #[cfg_attr(feature = "openapi", schema(example = "x = 41\nx + 1"))]
    pub code: String,
    /// Seconds, fractions allowed, above 0 and at most 86400 (default 300). When it passes,
    /// the kernel is interrupted and the answer has status `timeout`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(exclusive_minimum = 0.0, maximum = 86400.0, example = 30)
    )]
    pub timeout: Option<f64>,
    /// Which agent runs this, for the audit trail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    /// Text as a terminal shows it, for readers that are not terminals (a language model):
    /// ANSI escape sequences removed from stdout, stderr, tracebacks and `text/plain`
    /// results, and each line redrawn with `\r` (a progress bar) only in its final state.
    /// Streamed, a line comes once it is finished (`\n`), or at the end of the run.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    #[cfg_attr(feature = "openapi", schema(example = true))]
    pub plain: bool,
}

/// A string schema of these values only.
#[cfg(feature = "openapi")]
fn one_of(values: &[&str]) -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(values.iter().copied()))
        .build()
}

#[cfg(feature = "openapi")]
fn status_schema() -> utoipa::openapi::Object {
    one_of(&["ok", "error", "timeout"])
}

/// A display (`plt.show()`, `display(...)`) or the cell's value, with every MIME type the
/// kernel sent (`image/png` as base64).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ResultOutput {
    /// MIME type to data: `text/plain`, `text/html`, `image/png`, `application/json`, ...
    #[cfg_attr(feature = "openapi", schema(value_type = HashMap<String, Value>))]
    pub data: Map<String, Value>,
    #[cfg_attr(feature = "openapi", schema(value_type = HashMap<String, Value>))]
    pub metadata: Map<String, Value>,
    /// The cell's value (`execute_result`), as opposed to a display.
    pub is_main_result: bool,
}

/// A widget display's `text/plain` becomes its text form ([`crate::widget::describe`]):
/// what the widget is, its value, and that it is interactive in JupyterLab.
impl From<Display> for ResultOutput {
    fn from(mut d: Display) -> Self {
        if let Some(text) = crate::widget::describe(&d.data) {
            d.data.insert("text/plain".into(), Value::String(text));
        }
        ResultOutput {
            data: d.data,
            metadata: d.metadata,
            is_main_result: d.is_result,
        }
    }
}

impl From<ResultOutput> for Display {
    fn from(r: ResultOutput) -> Self {
        Display {
            data: r.data,
            metadata: r.metadata,
            is_result: r.is_main_result,
            ..Display::default()
        }
    }
}

/// The exception that ended the run (`KernelDied` when the kernel died under it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ErrorOutput {
    #[cfg_attr(feature = "openapi", schema(example = "ZeroDivisionError"))]
    pub ename: String,
    #[cfg_attr(feature = "openapi", schema(example = "division by zero"))]
    pub evalue: String,
    /// Lines with ANSI colour codes, as IPython prints them (without, with `plain`).
    pub traceback: Vec<String>,
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

impl From<ErrorOutput> for ErrorContent {
    fn from(e: ErrorOutput) -> Self {
        ErrorContent {
            ename: e.ename,
            evalue: e.evalue,
            traceback: e.traceback,
            extra: Map::new(),
        }
    }
}

/// The answer of a run, once it is done.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ExecuteResult {
    #[cfg_attr(feature = "openapi", schema(schema_with = status_schema))]
    pub status: Status,
    pub execution_count: Option<i64>,
    pub stdout: String,
    pub stderr: String,
    pub results: Vec<ResultOutput>,
    /// Set when `status` is `error`.
    pub error: Option<ErrorOutput>,
    pub duration_ms: u64,
    /// Output past `--max-output-mb` was dropped.
    pub truncated: bool,
}

/// How a run ended: the last line of a streamed run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = EndLine))]
pub struct End {
    #[cfg_attr(feature = "openapi", schema(schema_with = status_schema))]
    pub status: Status,
    pub execution_count: Option<i64>,
    pub duration_ms: u64,
    /// Output past `--max-output-mb` was dropped.
    pub truncated: bool,
}

/// One line of a streamed run (`Accept: application/x-ndjson`): each output as it arrives,
/// and last the `end` line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Line {
    Stdout { text: String },
    Stderr { text: String },
    Result(ResultOutput),
    Error(ErrorOutput),
    End(End),
}

impl Line {
    /// The line of an output event; `None` for the events a run does not stream.
    pub fn of_event(event: Event) -> Option<Line> {
        Some(match event {
            Event::Stream { name, text } if name == "stderr" => Line::Stderr { text },
            Event::Stream { text, .. } => Line::Stdout { text },
            Event::Display(d) => Line::Result(d.into()),
            Event::Error(e) => Line::Error(e.into()),
            _ => return None,
        })
    }

    /// The line of one piece of a run's progress.
    pub fn of_progress(progress: Progress) -> Option<Line> {
        match progress {
            Progress::Event(e) => Line::of_event(e),
            Progress::End(end) => Some(Line::End(end)),
        }
    }

    /// The line as the run's progress, the way the gateway had it.
    pub fn into_progress(self) -> Progress {
        match self {
            Line::Stdout { text } => Progress::Event(Event::Stream {
                name: "stdout".into(),
                text,
            }),
            Line::Stderr { text } => Progress::Event(Event::Stream {
                name: "stderr".into(),
                text,
            }),
            Line::Result(r) => Progress::Event(Event::Display(r.into())),
            Line::Error(e) => Progress::Event(Event::Error(e.into())),
            Line::End(end) => Progress::End(end),
        }
    }

    /// One NDJSON line (without its newline); `None` for a line that is not one of ours.
    pub fn parse(line: &[u8]) -> Option<Line> {
        serde_json::from_slice(line).ok()
    }
}

/// What a run sends: each event as it happens, then how it ended.
#[derive(Debug)]
pub enum Progress {
    Event(Event),
    End(End),
}

/// What the files API does with a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileOp {
    /// A directory's entries as JSON (`[{name, path, type, size, modified}]`).
    List,
    /// A file's bytes.
    Get,
    /// Writes the body, creating parent directories; answers the new entry as JSON.
    Put,
    /// Removes a file or an empty directory.
    Delete,
}

/// A file or directory, as the script writes it (listings are arrays of these).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct FileEntry {
    pub name: String,
    /// Relative to the working directory.
    #[cfg_attr(feature = "openapi", schema(example = "data/sales.csv"))]
    pub path: String,
    #[serde(rename = "type")]
    #[cfg_attr(feature = "openapi", schema(schema_with = entry_type_schema))]
    pub kind: String,
    /// Bytes.
    pub size: u64,
    /// Seconds since the Unix epoch.
    pub modified: f64,
}

#[cfg(feature = "openapi")]
fn entry_type_schema() -> utoipa::openapi::Object {
    one_of(&["file", "directory", "other"])
}

/// What a refusal's body says (the gateway's error bodies: `{"message": ..., "reason": ...}`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Refusal {
    #[serde(default)]
    pub message: Option<String>,
    #[serde(default)]
    pub reason: Option<String>,
}

/// A relative path, percent-encoded for the files API's URL.
pub fn encode_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for b in path.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// URLs lose `..` segments and leading slashes on the way (normalization), so the gateway
/// could not refuse them: a client refuses them with the gateway's words.
pub fn refused_path(path: &str) -> Option<&'static str> {
    if path.starts_with('/') {
        return Some("paths must be relative to the working directory");
    }
    path.split('/')
        .any(|part| part == "..")
        .then_some("'..' is not allowed in paths")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn paths_reach_the_gateway_as_given() {
        assert_eq!(encode_path("data/in put.csv"), "data/in%20put.csv");
        assert_eq!(encode_path(""), "");
        assert!(refused_path("../../etc/passwd").is_some());
        assert!(refused_path("/etc/x").is_some());
        assert_eq!(refused_path("a/..b/c"), None);
    }

    #[test]
    fn a_widget_result_says_what_it_is_and_keeps_its_view() {
        let display = Display {
            data: json!({
                "text/plain": "IntSlider(value=5, description='x')",
                "application/vnd.jupyter.widget-view+json": {"model_id": "m1", "version_major": 2},
            })
            .as_object()
            .cloned()
            .unwrap_or_default(),
            ..Display::default()
        };
        let out = ResultOutput::from(display);
        let text = out.data["text/plain"].as_str().unwrap_or_default();
        assert!(
            text.contains("IntSlider(value=5, description='x')"),
            "{text}"
        );
        assert!(text.contains("interactive in JupyterLab"), "{text}");
        assert_eq!(
            out.data["application/vnd.jupyter.widget-view+json"]["model_id"],
            "m1"
        );
    }

    #[test]
    fn lines_read_back_as_the_run_events() {
        let lines = [
            json!({"type": "stdout", "text": "hi\n"}),
            json!({"type": "result", "data": {"text/plain": "42"}, "metadata": {}, "is_main_result": true}),
            json!({"type": "error", "ename": "E", "evalue": "v", "traceback": ["t"]}),
            json!({"type": "end", "status": "timeout", "execution_count": 3, "duration_ms": 7, "truncated": true}),
        ];
        let got: Vec<Progress> = lines
            .iter()
            .filter_map(|l| Line::parse(l.to_string().as_bytes()))
            .map(Line::into_progress)
            .collect();
        assert!(
            matches!(&got[0], Progress::Event(Event::Stream { name, text }) if name == "stdout" && text == "hi\n")
        );
        assert!(
            matches!(&got[1], Progress::Event(Event::Display(d)) if d.is_result && d.data["text/plain"] == "42")
        );
        assert!(
            matches!(&got[2], Progress::Event(Event::Error(e)) if e.ename == "E" && e.traceback == ["t"])
        );
        assert!(matches!(
            &got[3],
            Progress::End(End {
                status: Status::Timeout,
                execution_count: Some(3),
                truncated: true,
                ..
            })
        ));
    }

    #[test]
    fn lines_are_written_as_they_are_read() {
        for line in [
            Line::Stdout { text: "a".into() },
            Line::End(End {
                status: Status::Ok,
                execution_count: Some(1),
                duration_ms: 2,
                truncated: false,
            }),
        ] {
            let text = serde_json::to_string(&line).expect("serializes");
            assert_eq!(Line::parse(text.as_bytes()), Some(line));
        }
        assert_eq!(
            serde_json::to_value(Line::Stderr { text: "x".into() }).expect("serializes"),
            json!({"type": "stderr", "text": "x"})
        );
    }
}
