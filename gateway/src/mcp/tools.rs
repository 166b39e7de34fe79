//! The tools as a model sees them: names, descriptions and input schemas, and their
//! arguments checked into typed values (a wrong argument is a tool error that says what to
//! fix). What a tool answers, as MCP content, is built in [`super::content`]. No I/O here.

pub use super::content::{display_summary, file_part, listing, run_result, Ending};
use rmcp::model::{CallToolResult, ContentBlock, JsonObject, Tool};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// Used when `run_python` gives no timeout (the agent API's default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);
/// Largest file `write_file` accepts.
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
             (matplotlib figures come back as PNG images: call plt.show()). Each rich output \
             comes as the first of: a PNG, JPEG, GIF or WebP image; an SVG as its XML text; \
             Markdown as text; text/plain (a DataFrame as its text table); HTML, LaTeX or \
             JSON as text. Text is as a terminal shows it (no colour codes; a line redrawn \
             with \\r, like a progress bar, only in its last state). A result is limited in \
             size: long output keeps its head and tail with a note, and images that do not \
             fit are replaced by a note (write big output to a file and read it with \
             read_file). An exception comes back as an error result with its name, value and \
             traceback; the kernel keeps its state. The kernel has no network access. \
             IPython magics (%timeit) work. Packages the image lacks cannot be downloaded: \
             install_packages (or %pip install) adds those on the gateway's allowlist.",
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
            "Read a file from the kernel's working directory: text comes back as text, a \
             PNG, JPEG, GIF or WebP image as an image, other files as an embedded base64 \
             blob. A result is limited in size: a larger file comes in parts, each saying \
             which bytes it holds and the offset to ask for next.",
            schema(json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "File path relative to the working directory, e.g. results/summary.csv."},
                    "offset": {"type": "integer", "minimum": 0, "description": "Byte to start at; default 0. A part's note names the offset of the next one."},
                    "length": {"type": "integer", "minimum": 1, "description": "Most bytes to return; default: as many as fit in one result."},
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
            "install_packages",
            "Install Python packages into the kernel so run_python's code can import them at \
             once (no restart). The kernel has no network: only packages on this gateway's \
             allowlist can be installed, offline, with what they need; anything else is \
             refused with a message naming it (and, when it is one, the allowed names). All or \
             nothing: when one package is refused, none is installed. Packages stay until \
             restart_kernel.",
            schema(json!({
                "type": "object",
                "properties": {
                    "packages": {"type": "array", "minItems": 1, "maxItems": 64,
                                 "items": {"type": "string"},
                                 "description": "Package names, each optionally with a version specifier: [\"seaborn\", \"scikit-learn==1.5.2\"]."},
                    "kernel_id": {"type": "string", "description": KERNEL_ID},
                },
                "required": ["packages"],
            })),
        ),
        Tool::new(
            "restart_kernel",
            "Restart the kernel: it starts afresh in a new sandbox, so every variable and \
             import is lost and every file in the working directory is removed (write_file \
             or recreate what you still need). Use it when the kernel is stuck or its state \
             is broken.",
            schema(json!({
                "type": "object",
                "properties": {"kernel_id": {"type": "string", "description": KERNEL_ID}},
            })),
        ),
        Tool::new(
            "start_kernel",
            "Start a new kernel and return its kernel_id; pass it to the other tools to use \
             that kernel. It is shut down after a while without use. With a snapshot (the \
             snapshot_id or name snapshot_kernel returned), it starts with that snapshot's \
             variables and files.",
            schema(json!({
                "type": "object",
                "properties": {
                    "snapshot": {"type": "string", "description": "A snapshot's id or name (snapshot_kernel) to start from; leave it out for an empty kernel."},
                },
            })),
        ),
        Tool::new(
            "snapshot_kernel",
            "Save the kernel's current state as a snapshot, to start new kernels from it \
             later (start_kernel's snapshot) or to go back to it after a step that went \
             wrong. The kernel keeps running. A name you reuse replaces the older snapshot \
             of that name. Depending on the gateway, everything is kept (threads and \
             generators too) or only what can be pickled plus the files; what cannot be kept \
             is refused by name.",
            schema(json!({
                "type": "object",
                "properties": {
                    "name": {"type": "string", "description": "A name to find it by: letters, digits, '-', '_', '.', ':' or '/'."},
                    "mode": {"type": "string", "enum": ["full", "filesystem"], "description": "full (default): variables and files; filesystem: the working directory's files only."},
                    "kernel_id": {"type": "string", "description": KERNEL_ID},
                },
            })),
        ),
        Tool::new(
            "fork_kernel",
            "Copy the kernel into several new kernels with the same variables and files, to \
             try different things from the same point side by side (three models on the same \
             cleaned data, say). Returns one kernel_id per copy; pass each to run_python. The \
             copies are independent of each other and of this kernel, and are shut down after \
             a while without use.",
            schema(json!({
                "type": "object",
                "properties": {
                    "count": {"type": "integer", "minimum": 1, "maximum": 20, "description": "How many copies, 1 to 20."},
                    "kernel_id": {"type": "string", "description": KERNEL_ID},
                },
                "required": ["count"],
            })),
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InstallPackages {
    pub packages: Vec<String>,
    #[serde(default)]
    pub kernel_id: Option<String>,
}

impl InstallPackages {
    pub const EXAMPLE: &'static str = r#"{"packages": ["seaborn"]}"#;
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartKernel {
    #[serde(default)]
    pub snapshot: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotKernel {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub mode: Option<String>,
    #[serde(default)]
    pub kernel_id: Option<String>,
}

impl SnapshotKernel {
    pub const EXAMPLE: &'static str = r#"{"name": "cleaned"}"#;
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkKernel {
    pub count: usize,
    #[serde(default)]
    pub kernel_id: Option<String>,
}

impl ForkKernel {
    pub const EXAMPLE: &'static str = r#"{"count": 3}"#;
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
    pub offset: u64,
    #[serde(default)]
    pub length: Option<u64>,
    #[serde(default)]
    pub kernel_id: Option<String>,
}

impl ReadFile {
    pub const EXAMPLE: &'static str = r#"{"path": "results.csv", "offset": 0, "length": 65536}"#;

    /// Bytes to read: what was asked, at most what one result of `room` bytes can hold.
    pub fn window(&self, room: usize) -> Result<usize, ToolError> {
        let most = room.saturating_sub(PART_NOTE_ROOM);
        match self.length {
            Some(0) => Err(error(
                "length 0 reads nothing: give at least 1, or leave it out to read as much as fits",
            )),
            Some(n) => Ok(usize::try_from(n).unwrap_or(usize::MAX).min(most)),
            None => Ok(most),
        }
    }
}

/// Room kept in a `read_file` result for the note about the part it holds.
pub(super) const PART_NOTE_ROOM: usize = 1024;

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

#[cfg(test)]
mod tests {
    use super::super::content::*;
    use super::*;
    use kernelgate_protocol::content::ErrorContent;
    use kernelgate_protocol::execution::Display;
    use kernelgate_protocol::execution::Status;
    use kernelgate_protocol::Outcome;
    use rmcp::model::ResourceContents;
    use serde_json::Map;

    fn texts(result: &CallToolResult) -> Vec<String> {
        result
            .content
            .iter()
            .filter_map(|c| c.as_text().map(|t| t.text.clone()))
            .collect()
    }

    fn bundle(pairs: &[(&str, Value)]) -> Map<String, Value> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect()
    }

    #[test]
    fn streams_are_text_as_a_terminal_shows_it() {
        let outcome = Outcome {
            stdout: "\r 10%|#   |\r 50%|##  |\r100%|####|\ndone\n".into(),
            stderr: "\u{1b}[33mwarning\u{1b}[0m\n".into(),
            ..Outcome::default()
        };
        let ending = Ending {
            status: Status::Ok,
            timeout: DEFAULT_TIMEOUT,
            truncated: false,
        };
        assert_eq!(
            texts(&run_result(&outcome, ending)),
            ["100%|####|\ndone\n", "[stderr]\nwarning\n"]
        );
    }

    #[test]
    fn each_display_comes_as_the_type_a_model_reads_best() {
        let frame = bundle(&[
            ("text/plain", json!("   a\n0  1")),
            ("text/html", json!("<style>…</style><table>")),
        ]);
        assert_eq!(
            display(&frame).as_text().map(|t| t.text.as_str()),
            Some("   a\n0  1")
        );
        let markdown = bundle(&[
            (
                "text/plain",
                json!("<IPython.core.display.Markdown object>"),
            ),
            ("text/markdown", json!("# Title")),
        ]);
        assert_eq!(
            display(&markdown).as_text().map(|t| t.text.as_str()),
            Some("# Title")
        );
        let html = bundle(&[
            ("text/plain", json!("<IPython.core.display.HTML object>")),
            ("text/html", json!("<b>bold</b>")),
        ]);
        assert_eq!(
            display(&html).as_text().map(|t| t.text.as_str()),
            Some("<b>bold</b>")
        );
        let svg = bundle(&[
            ("text/plain", json!("<Figure size 640x480 with 1 Axes>")),
            ("image/svg+xml", json!("<svg/>")),
        ]);
        assert_eq!(
            display(&svg).as_text().map(|t| t.text.as_str()),
            Some("[SVG image, as its XML source]\n<svg/>")
        );
        let jpeg = bundle(&[
            ("image/jpeg", json!("/9j/\n4AAQ")),
            ("text/plain", json!("<PIL.Image>")),
        ]);
        let image = display(&jpeg);
        let image = image.as_image().expect("an image");
        assert_eq!(
            (image.data.as_str(), image.mime_type.as_str()),
            ("/9j/4AAQ", "image/jpeg")
        );
        let json_only = bundle(&[
            ("text/plain", json!("<IPython.core.display.JSON object>")),
            ("application/json", json!({"a": 1})),
        ]);
        assert_eq!(
            display(&json_only).as_text().map(|t| t.text.as_str()),
            Some(r#"{"a":1}"#)
        );
        let coloured = bundle(&[("text/plain", json!("\u{1b}[1mbold\u{1b}[0m"))]);
        assert_eq!(
            display(&coloured).as_text().map(|t| t.text.as_str()),
            Some("bold")
        );
        let widget = bundle(&[
            (
                "application/vnd.jupyter.widget-view+json",
                json!({"model_id": "m1"}),
            ),
            ("text/plain", json!("IntSlider(value=5)")),
        ]);
        assert!(display(&widget).as_text().is_some_and(|t| t
            .text
            .contains("interactive widget IntSlider(value=5) — interactive in JupyterLab")));
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
    fn a_whole_small_file_is_its_content_alone() {
        let text = file_part("a.txt", 0, b"hi".to_vec(), 2, 4096).expect("read");
        assert_eq!(text.len(), 1);
        assert_eq!(text[0].as_text().map(|t| t.text.as_str()), Some("hi"));
        let blob = file_part("a.bin", 0, vec![0xff, 0], 2, 4096).expect("read");
        assert!(blob[0].as_resource().is_some());
        let png = b"\x89PNG\r\n\x1a\nrest".to_vec();
        let image = file_part("a.png", 0, png, 12, 4096).expect("read");
        assert_eq!(
            image[0].as_image().map(|i| i.mime_type.as_str()),
            Some("image/png")
        );
    }

    #[test]
    fn a_part_says_which_bytes_it_holds_and_where_the_next_starts() {
        let room = 4096;
        let part =
            file_part("log.txt", 100, "x".repeat(5000).into_bytes(), 10_000, room).expect("read");
        let text = &part[0].as_text().expect("text").text;
        assert_eq!(text.len(), room - PART_NOTE_ROOM);
        let next = 100 + text.len();
        assert_eq!(
            part[1].as_text().map(|t| t.text.clone()),
            Some(format!(
                "[log.txt: bytes 100-{} of 10000; {} more bytes follow: call read_file with offset={next} for the next part]",
                next - 1,
                10_000 - next
            ))
        );
        // A character cut by the end of the window starts the next part.
        let part = file_part("u.txt", 0, "aé".as_bytes()[..2].to_vec(), 3, room).expect("read");
        assert_eq!(part[0].as_text().map(|t| t.text.as_str()), Some("a"));
        assert!(part[1]
            .as_text()
            .is_some_and(|t| t.text.contains("offset=1 ")));
        let last = file_part("log.txt", 9_000, vec![b'y'; 1000], 10_000, room).expect("read");
        assert!(last[1]
            .as_text()
            .is_some_and(|t| t.text.ends_with("up to the end of the file]")));
        let binary = file_part("b.bin", 0, vec![0xff; 5000], 5000, room).expect("read");
        let ResourceContents::BlobResourceContents { blob, .. } =
            &binary[0].as_resource().expect("a blob").resource
        else {
            panic!("a blob");
        };
        assert!(blob.len() <= room - PART_NOTE_ROOM);
        let past = file_part("log.txt", 10_000, Vec::new(), 10_000, room);
        assert!(past.is_err_and(|e| e.0.contains("past the end")));
        let empty = file_part("e.txt", 0, Vec::new(), 0, room).expect("read");
        assert_eq!(empty.len(), 1);
    }
}
