//! What a tool answers, as MCP content: a run's outputs (streams and results as text, raster
//! images as images, an exception as a tool error), with one MIME type per output for a
//! model; a directory listing; a part of a file. All text as a terminal shows it. No I/O.

use super::budget;
use super::tools::{error, ToolError, PART_NOTE_ROOM};
use kernelgate_protocol::execution::Status;
use kernelgate_protocol::terminal::plain_text;
use kernelgate_protocol::Outcome;
use rmcp::model::{CallToolResult, ContentBlock, ResourceContents};
use serde_json::{Map, Value};
use std::time::Duration;

/// How a run ended, as the tool result sees it.
#[derive(Debug, Clone, Copy)]
pub struct Ending {
    pub status: Status,
    pub timeout: Duration,
    pub truncated: bool,
}

/// A run's outputs as MCP content: text for streams and results, images for raster
/// images, and a tool error carrying the exception when the code failed. All text as a
/// terminal shows it ([`plain_text`]).
pub fn run_result(outcome: &Outcome, ending: Ending) -> CallToolResult {
    let mut content = Vec::new();
    let stdout = plain_text(&outcome.stdout);
    if !stdout.is_empty() {
        content.push(ContentBlock::text(stdout));
    }
    let stderr = plain_text(&outcome.stderr);
    if !stderr.is_empty() {
        content.push(ContentBlock::text(format!("[stderr]\n{stderr}")));
    }
    content.extend(outcome.displays.iter().map(|d| display(&d.data)));
    let mut failed = false;
    if let Some(e) = &outcome.error {
        failed = true;
        let traceback: Vec<String> = e.traceback.iter().map(|line| plain_text(line)).collect();
        let mut text = format!("{}: {}", plain_text(&e.ename), plain_text(&e.evalue));
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

/// Raster image types, which models take as images.
const RASTER: [&str; 4] = ["image/png", "image/jpeg", "image/gif", "image/webp"];

/// The one MIME type of a display a model gets, in this order: a widget's text form
/// (docs/widgets.md); a raster image; SVG as its
/// XML text (model APIs take raster images only, so an SVG image block would be refused
/// or dropped by the host); Markdown; `text/plain` unless it is only an object's default
/// repr (`<IPython.core.display.HTML object>`); HTML, LaTeX, JSON as text; else the
/// `text/plain` anyway, or a note naming the type.
pub fn display(data: &Map<String, Value>) -> ContentBlock {
    if let Some(widget) = kernelgate_protocol::widget::describe(data) {
        return ContentBlock::text(widget);
    }
    for mime in RASTER {
        if let Some(b64) = data.get(mime).and_then(text_of) {
            let b64: String = b64.chars().filter(|c| !c.is_whitespace()).collect();
            return ContentBlock::image(b64, mime);
        }
    }
    if let Some(svg) = data.get("image/svg+xml").and_then(text_of) {
        return ContentBlock::text(format!("[SVG image, as its XML source]\n{svg}"));
    }
    if let Some(markdown) = data.get("text/markdown").and_then(text_of) {
        return ContentBlock::text(markdown);
    }
    let plain = data
        .get("text/plain")
        .and_then(text_of)
        .map(|p| plain_text(&p));
    if let Some(plain) = plain.as_ref().filter(|p| !is_default_repr(p)) {
        return ContentBlock::text(plain.clone());
    }
    for mime in ["text/html", "text/latex"] {
        if let Some(text) = data.get(mime).and_then(text_of) {
            return ContentBlock::text(text);
        }
    }
    if let Some(value) = data.get("application/json") {
        return ContentBlock::text(value.to_string());
    }
    match (plain, data.keys().next()) {
        (Some(plain), _) => ContentBlock::text(plain),
        (None, Some(kind)) => ContentBlock::text(format!("[an output of type {kind}]")),
        (None, None) => ContentBlock::text("[an empty output]"),
    }
}

/// `<module.Class object>`, `<module.Class object at 0x…>` or IPython's
/// `<module.Class at 0x…>`: the repr of an object that has no better one.
fn is_default_repr(text: &str) -> bool {
    let text = text.trim();
    text.starts_with('<')
        && text.ends_with('>')
        && !text.contains('\n')
        && (text.ends_with(" object>") || text.contains(" at 0x"))
}

/// What a progress notification says about a display: its text, or what it is.
pub fn display_summary(data: &Map<String, Value>) -> String {
    match display(data) {
        ContentBlock::Text(t) => t.text,
        ContentBlock::Image(i) => format!("[{} image]", i.mime_type),
        _ => "[an output]".to_owned(),
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

/// A part of a file as content, `bytes` read from `offset` of a file of `size` bytes,
/// within `room` bytes of JSON: text when it is UTF-8, a whole raster image as an image,
/// anything else as an embedded base64 blob. A note follows when the part is not the
/// whole file: which bytes these are and what offset comes next.
pub fn file_part(
    path: &str,
    offset: u64,
    bytes: Vec<u8>,
    size: u64,
    room: usize,
) -> Result<Vec<ContentBlock>, ToolError> {
    if offset > size || (offset == size && size > 0) {
        return Err(error(format!(
            "offset {offset} is past the end of {path} ({size} bytes): give an offset below {size}"
        )));
    }
    let room = room.saturating_sub(PART_NOTE_ROOM);
    let uri = format!("file:///{}", path.trim_start_matches('/'));
    let whole_file = offset == 0 && bytes.len() as u64 == size;
    let text = match std::str::from_utf8(&bytes) {
        Ok(text) => Some(text),
        // A multi-byte character cut by the end of the part: it starts the next part.
        Err(e) if e.error_len().is_none() && e.valid_up_to() > 0 => {
            std::str::from_utf8(&bytes[..e.valid_up_to()]).ok()
        }
        Err(_) => None,
    };
    let (block, taken) = match text {
        Some(text) => {
            let mut end = 0;
            let mut json = 0;
            for (i, c) in text.char_indices() {
                json += budget::char_json_len(c);
                if json > room {
                    break;
                }
                end = i + c.len_utf8();
            }
            (ContentBlock::text(&text[..end]), end)
        }
        None => {
            use base64::Engine as _;
            let b64 = base64::engine::general_purpose::STANDARD;
            let image = whole_file
                .then(|| image_type(&bytes))
                .flatten()
                .filter(|_| bytes.len().div_ceil(3) * 4 <= room);
            match image {
                Some(mime) => (ContentBlock::image(b64.encode(&bytes), mime), bytes.len()),
                None => {
                    let n = bytes
                        .len()
                        .min(room.saturating_sub(uri.len() + 128) / 4 * 3);
                    let blob = b64.encode(&bytes[..n]);
                    let block = ContentBlock::resource(
                        ResourceContents::blob(blob, uri)
                            .with_mime_type("application/octet-stream"),
                    );
                    (block, n)
                }
            }
        }
    };
    let end = offset + taken as u64;
    let mut content = vec![block];
    if offset > 0 || end < size {
        let last = end.saturating_sub(1).max(offset);
        content.push(ContentBlock::text(if end < size {
            format!(
                "[{path}: bytes {offset}-{last} of {size}; {} more bytes follow: call read_file \
                 with offset={end} for the next part]",
                size - end
            )
        } else {
            format!("[{path}: bytes {offset}-{last} of {size}, up to the end of the file]")
        }));
    }
    Ok(content)
}

/// The image type of a file's bytes, by their magic numbers.
fn image_type(bytes: &[u8]) -> Option<&'static str> {
    match bytes {
        [0x89, b'P', b'N', b'G', b'\r', b'\n', 0x1a, b'\n', ..] => Some("image/png"),
        [0xff, 0xd8, 0xff, ..] => Some("image/jpeg"),
        [b'G', b'I', b'F', b'8', ..] => Some("image/gif"),
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'E', b'B', b'P', ..] => Some("image/webp"),
        _ => None,
    }
}
