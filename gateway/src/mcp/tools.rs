//! The tools as a model sees them: names, descriptions and input schemas; their arguments
//! checked into typed values (a wrong argument is a tool error that says what to fix); and
//! a run's outputs turned into MCP content. No I/O here.

use kernelgate_protocol::execution::Status;
use kernelgate_protocol::Outcome;
use rmcp::model::{CallToolResult, ContentBlock, JsonObject, ResourceContents, Tool};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// Used when `run_python` gives no timeout (the agent API's default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Largest file `read_file` returns and `write_file` accepts.
pub const MAX_FILE_BYTES: usize = 10 * 1024 * 1024;

const KERNEL_ID: &str = "The kernel to use, as start_kernel returned it. Leave it out to use \
     this session's own kernel (sessions exist over stdio and with the MCP handshake; without \
     a session, call start_kernel first).";

fn schema(value: Value) -> Arc<JsonObject> {
    match value {
        Value::Object(map) => Arc::new(map),
        _ => Arc::new(JsonObject::new()),
    }
}

/// Every tool this server offers.
pub fn all() -> Vec<Tool> {
    vec![
        Tool::new(
            "run_python",
            "Run Python code in a persistent IPython kernel (a sandboxed container with numpy, \
             pandas and matplotlib). Variables, imports and files persist between calls. \
             Returns stdout, stderr, the value of the last expression, and every chart \
             (matplotlib figures come back as PNG images: call plt.show()). An exception comes \
             back as an error result with its name, value and traceback; the kernel keeps its \
             state. The kernel has no network access. IPython magics (%timeit) work.",
            schema(json!({
                "type": "object",
                "properties": {
                    "code": {"type": "string", "description": "Python source to run, one or more lines."},
                    "timeout": {"type": "number", "exclusiveMinimum": 0, "maximum": 86400,
                                "description": "Seconds the code may run before it is interrupted (KeyboardInterrupt; variables are kept). Default 300."},
                    "kernel_id": {"type": "string", "description": KERNEL_ID},
                },
                "required": ["code"],
            })),
        ),
        Tool::new(
            "list_files",
            "List a directory of the kernel's working directory (where run_python's code \
             reads and writes relative paths): one line per entry with its type and size.",
            schema(json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "Directory relative to the working directory; default: the working directory itself."},
                    "kernel_id": {"type": "string", "description": KERNEL_ID},
                },
            })),
        ),
        Tool::new(
            "read_file",
            "Read a file from the kernel's working directory: text comes back as text, other \
             files as an embedded base64 blob. Files over 10 MiB are refused.",
            schema(json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "File path relative to the working directory, e.g. results/summary.csv."},
                    "kernel_id": {"type": "string", "description": KERNEL_ID},
                },
                "required": ["path"],
            })),
        ),
        Tool::new(
            "write_file",
            "Write a file into the kernel's working directory (parent directories are created), \
             so that run_python's code can open it. At most 10 MiB.",
            schema(json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "File path relative to the working directory, e.g. data/input.csv."},
                    "content": {"type": "string", "description": "The file's content: text, or base64 when encoding is base64."},
                    "encoding": {"type": "string", "enum": ["utf-8", "base64"], "description": "How content is encoded; default utf-8."},
                    "kernel_id": {"type": "string", "description": KERNEL_ID},
                },
                "required": ["path", "content"],
            })),
        ),
        Tool::new(
            "restart_kernel",
            "Restart the kernel: every variable and import is lost, files in the working \
             directory stay. Use it when the kernel is stuck or its state is broken.",
            schema(json!({
                "type": "object",
                "properties": {"kernel_id": {"type": "string", "description": KERNEL_ID}},
            })),
        ),
        Tool::new(
            "start_kernel",
            "Start a new kernel and return its kernel_id; pass it to the other tools to use \
             that kernel. It is shut down after a while without use.",
            schema(json!({"type": "object", "properties": {}})),
        ),
    ]
}

/// A call that failed in a way the model can act on (shown to it as a tool error result,
/// not as a protocol error, which clients hide).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ToolError(pub String);

impl ToolError {
    pub fn into_result(self) -> CallToolResult {
        CallToolResult::error(vec![ContentBlock::text(self.0)])
    }
}

pub fn error(message: impl Into<String>) -> ToolError {
    ToolError(message.into())
}

/// Reads a tool's arguments, or says what to send instead.
pub fn parse<T: DeserializeOwned>(
    tool: &str,
    example: &str,
    arguments: Option<JsonObject>,
) -> Result<T, ToolError> {
    let value = Value::Object(arguments.unwrap_or_default());
    serde_json::from_value(value).map_err(|e| {
        error(format!(
            "invalid arguments for {tool}: {e}. Send them like {example}"
        ))
    })
}

/// `kernel_id`, which every tool takes.
#[derive(Debug, Default, Deserialize)]
pub struct Target {
    #[serde(default)]
    pub kernel_id: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct RunPython {
    pub code: String,
    #[serde(default)]
    pub timeout: Option<f64>,
    #[serde(default)]
    pub kernel_id: Option<String>,
}

impl RunPython {
    pub const EXAMPLE: &'static str = r#"{"code": "print(1 + 1)", "timeout": 60}"#;

    pub fn timeout(&self) -> Result<Duration, ToolError> {
        match self.timeout {
            None => Ok(DEFAULT_TIMEOUT),
            Some(t) if t.is_finite() && t > 0.0 && t <= 86_400.0 => Ok(Duration::from_secs_f64(t)),
            Some(t) => Err(error(format!(
                "timeout {t} is out of range: give seconds above 0 and at most 86400"
            ))),
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct ListFiles {
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub kernel_id: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ReadFile {
    pub path: String,
    #[serde(default)]
    pub kernel_id: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct WriteFile {
    pub path: String,
    pub content: String,
    #[serde(default)]
    pub encoding: Option<String>,
    #[serde(default)]
    pub kernel_id: Option<String>,
}

impl WriteFile {
    pub const EXAMPLE: &'static str =
        r#"{"path": "data/input.csv", "content": "a,b\n1,2\n", "encoding": "utf-8"}"#;

    /// The bytes to write, within [`MAX_FILE_BYTES`].
    pub fn bytes(&self) -> Result<Vec<u8>, ToolError> {
        use base64::Engine as _;
        let bytes = match self.encoding.as_deref().unwrap_or("utf-8") {
            "utf-8" | "utf8" | "text" => self.content.as_bytes().to_vec(),
            "base64" => {
                let compact: String = self
                    .content
                    .chars()
                    .filter(|c| !c.is_whitespace())
                    .collect();
                base64::engine::general_purpose::STANDARD
                    .decode(compact)
                    .map_err(|e| error(format!("content is not valid base64 ({e}); send base64 text, or set encoding to utf-8 for plain text")))?
            }
            other => {
                return Err(error(format!(
                    "encoding {other:?} is not known: use \"utf-8\" or \"base64\""
                )))
            }
        };
        if bytes.len() > MAX_FILE_BYTES {
            return Err(error(format!(
                "{} is {} bytes, over the {} MiB limit of write_file: write it in parts from run_python, or make it smaller",
                self.path,
                bytes.len(),
                MAX_FILE_BYTES >> 20
            )));
        }
        Ok(bytes)
    }
}

/// Drops ANSI escape sequences (IPython colours its tracebacks).
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            out.push(c);
            continue;
        }
        match chars.peek() {
            // CSI: parameters and intermediates, then one final byte in @..~
            Some('[') => {
                chars.next();
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            // A two-character escape.
            Some(_) => {
                chars.next();
            }
            None => {}
        }
    }
    out
}

/// How a run ended, as the tool result sees it.
#[derive(Debug, Clone, Copy)]
pub struct Ending {
    pub status: Status,
    pub timeout: Duration,
    pub truncated: bool,
}

/// A run's outputs as MCP content: text for streams, results and HTML, images for PNGs, and
/// a tool error carrying the exception when the code failed.
pub fn run_result(outcome: &Outcome, ending: Ending) -> CallToolResult {
    let mut content = Vec::new();
    if !outcome.stdout.is_empty() {
        content.push(ContentBlock::text(outcome.stdout.clone()));
    }
    if !outcome.stderr.is_empty() {
        content.push(ContentBlock::text(format!(
            "[stderr]\n{}",
            strip_ansi(&outcome.stderr)
        )));
    }
    for display in &outcome.displays {
        let data = &display.data;
        if let Some(png) = data.get("image/png").and_then(Value::as_str) {
            let png: String = png.chars().filter(|c| !c.is_whitespace()).collect();
            content.push(ContentBlock::image(png, "image/png"));
        } else if let Some(html) = data.get("text/html").and_then(text_of) {
            content.push(ContentBlock::text(html));
        } else if let Some(plain) = data.get("text/plain").and_then(text_of) {
            content.push(ContentBlock::text(strip_ansi(&plain)));
        } else if let Some(kind) = data.keys().next() {
            content.push(ContentBlock::text(format!("[an output of type {kind}]")));
        }
    }
    let mut failed = false;
    if let Some(e) = &outcome.error {
        failed = true;
        let traceback: Vec<String> = e.traceback.iter().map(|line| strip_ansi(line)).collect();
        let mut text = format!("{}: {}", e.ename, e.evalue);
        if !traceback.is_empty() {
            text = format!("{text}\n\n{}", traceback.join("\n"));
        }
        content.push(ContentBlock::text(text));
    }
    if ending.status == Status::Timeout {
        failed = true;
        content.push(ContentBlock::text(format!(
            "Timed out after {} s: the code was interrupted (KeyboardInterrupt). Variables \
             defined before that are kept; run shorter steps or pass a larger timeout.",
            ending.timeout.as_secs_f64()
        )));
    } else if ending.status == Status::Error && outcome.error.is_none() {
        failed = true;
        content.push(ContentBlock::text(
            "The kernel did not finish the run (it was interrupted, restarted or died).",
        ));
    }
    if ending.truncated {
        content.push(ContentBlock::text(
            "[output past the gateway's output limit was dropped; print less, or write it to a file and read parts of it]",
        ));
    }
    if content.is_empty() {
        content.push(ContentBlock::text("(no output)"));
    }
    if failed {
        CallToolResult::error(content)
    } else {
        CallToolResult::success(content)
    }
}

/// Jupyter's multiline strings come as a string or a list of lines.
fn text_of(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Array(lines) => Some(lines.iter().filter_map(Value::as_str).collect()),
        _ => None,
    }
}

/// The listing the files script prints, as lines a model reads easily.
pub fn listing(path: &str, json_listing: &[u8]) -> String {
    let entries: Vec<Value> = serde_json::from_slice(json_listing).unwrap_or_default();
    let shown = if path.is_empty() { "." } else { path };
    if entries.is_empty() {
        return format!("{shown} is empty");
    }
    let mut out = format!("{shown}:\n");
    for e in entries {
        let name = e.get("path").and_then(Value::as_str).unwrap_or("?");
        match e.get("type").and_then(Value::as_str) {
            Some("directory") => out.push_str(&format!("{name}/  (directory)\n")),
            kind => out.push_str(&format!(
                "{name}  ({}, {} bytes)\n",
                kind.unwrap_or("file"),
                e.get("size").and_then(Value::as_u64).unwrap_or(0)
            )),
        }
    }
    out
}

/// A file's bytes as content: text when it is UTF-8, else an embedded blob.
pub fn file_content(path: &str, bytes: Vec<u8>) -> ContentBlock {
    let uri = format!("file:///{}", path.trim_start_matches('/'));
    match String::from_utf8(bytes) {
        Ok(text) => ContentBlock::text(text),
        Err(e) => {
            use base64::Engine as _;
            let blob = base64::engine::general_purpose::STANDARD.encode(e.into_bytes());
            ContentBlock::resource(
                ResourceContents::blob(blob, uri).with_mime_type("application/octet-stream"),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelgate_protocol::content::ErrorContent;
    use kernelgate_protocol::execution::Display;
    use serde_json::Map;

    fn texts(result: &CallToolResult) -> Vec<String> {
        result
            .content
            .iter()
            .filter_map(|c| c.as_text().map(|t| t.text.clone()))
            .collect()
    }

    #[test]
    fn ansi_colours_are_stripped() {
        assert_eq!(
            strip_ansi("\u{1b}[0;31mZeroDivisionError\u{1b}[0m: division by zero"),
            "ZeroDivisionError: division by zero"
        );
        assert_eq!(strip_ansi("plain"), "plain");
        assert_eq!(strip_ansi("cut \u{1b}"), "cut ");
    }

    #[test]
    fn an_exception_is_a_tool_error_with_name_value_and_traceback() {
        let outcome = Outcome {
            error: Some(ErrorContent {
                ename: "ZeroDivisionError".into(),
                evalue: "division by zero".into(),
                traceback: vec!["\u{1b}[31m----> 1\u{1b}[0m 1/0".into()],
                extra: Map::new(),
            }),
            ..Outcome::default()
        };
        let result = run_result(
            &outcome,
            Ending {
                status: Status::Error,
                timeout: DEFAULT_TIMEOUT,
                truncated: false,
            },
        );
        assert_eq!(result.is_error, Some(true));
        assert_eq!(
            texts(&result),
            ["ZeroDivisionError: division by zero\n\n----> 1 1/0"]
        );
    }

    #[test]
    fn pngs_are_images_and_results_are_text() {
        let mut png = Map::new();
        png.insert("image/png".into(), "iVBO\nRw0K".into());
        png.insert("text/plain".into(), "<Figure>".into());
        let mut result = Map::new();
        result.insert("text/plain".into(), "42".into());
        let outcome = Outcome {
            stdout: "hello\n".into(),
            displays: vec![
                Display {
                    data: png,
                    ..Display::default()
                },
                Display {
                    data: result,
                    is_result: true,
                    ..Display::default()
                },
            ],
            ..Outcome::default()
        };
        let ending = Ending {
            status: Status::Ok,
            timeout: DEFAULT_TIMEOUT,
            truncated: false,
        };
        let out = run_result(&outcome, ending);
        assert_eq!(out.is_error, Some(false));
        assert_eq!(texts(&out), ["hello\n", "42"]);
        let image = out.content[1].as_image().expect("an image");
        assert_eq!(
            (image.data.as_str(), image.mime_type.as_str()),
            ("iVBORw0K", "image/png")
        );
    }

    #[test]
    fn bad_arguments_say_what_to_send() {
        let Err(e) = parse::<RunPython>("run_python", RunPython::EXAMPLE, None) else {
            panic!("accepted no code");
        };
        assert!(e.0.contains("missing field `code`"), "{e}");
        let mut args = JsonObject::new();
        args.insert("code".into(), json!(1));
        let Err(e) = parse::<RunPython>("run_python", RunPython::EXAMPLE, Some(args)) else {
            panic!("accepted a number as code");
        };
        assert!(e.0.contains("invalid type"), "{e}");
        let too_long = RunPython {
            code: String::new(),
            timeout: Some(-1.0),
            kernel_id: None,
        };
        assert!(too_long.timeout().is_err());
    }

    #[test]
    fn write_file_decodes_base64_and_refuses_big_files() {
        let w = WriteFile {
            path: "a.bin".into(),
            content: "AAEC\n".into(),
            encoding: Some("base64".into()),
            kernel_id: None,
        };
        assert_eq!(w.bytes().ok(), Some(vec![0, 1, 2]));
        let big = WriteFile {
            path: "big.txt".into(),
            content: "x".repeat(MAX_FILE_BYTES + 1),
            encoding: None,
            kernel_id: None,
        };
        assert!(big.bytes().is_err());
    }

    #[test]
    fn binary_files_are_blobs() {
        assert!(file_content("a.txt", b"hi".to_vec()).as_text().is_some());
        assert!(file_content("a.bin", vec![0xff, 0]).as_text().is_none());
    }
}
