//! The executions a kernel is running, as the relay sees them: when each started (for the
//! metrics), how much output it produced, against `--max-output-mb`, and which ones the
//! current process owes an answer (answered in its place if it dies).
//!
//! Output counted: the text of `stream` messages, and the `data` (plus binary buffers) of
//! `display_data`, `update_display_data` and `execute_result`, whose parent is the
//! execution. The first `--max-output-mb` of an execution's output reaches every client:
//! a `stream` message that crosses the cap is cut there (on a UTF-8 boundary) and relayed,
//! while a display or result that crosses it is dropped whole, since half an image or
//! half a JSON document is no use. Every later output message of that execution is
//! dropped, and clients get one stderr `stream` message that says so. The execution itself
//! goes on and its reply, status and errors pass.

use super::clients::Outbound;
use kernelgate_protocol::{Channel, Header, Message, MsgKind, RawJson};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most executions tracked at once; requests never answered are forgotten past this.
const MAX_RUNNING: usize = 4096;
/// Finished executions still tracked: output a background thread prints later still carries
/// their parent header and still counts.
const KEEP_FINISHED: usize = 64;

/// What to do with one IOPub message.
#[derive(Debug)]
pub enum Verdict {
    Relay,
    /// Over the cap: drop it.
    Drop,
    /// It crossed the cap: relay what fits of it (`kept`, the part of a stream message
    /// under the cap), then this notice.
    Truncate {
        kept: Option<Box<Message>>,
        notice: Arc<Outbound>,
    },
}

#[derive(Debug)]
struct Running {
    /// `None` once replied.
    started: Option<Instant>,
    request: Header,
    output: usize,
    truncated: bool,
    /// Who asked, and what: for the audit record of its end.
    key: String,
    code_sha256: String,
    preview: String,
    /// Output bytes when the reply came (and its audit record was written).
    at_reply: Option<usize>,
}

/// Output of an execution that came after its reply (IOPub and shell are separate
/// sockets): the total, for an audit record of its own.
#[derive(Debug)]
pub struct LateOutput {
    pub msg_id: String,
    pub key: String,
    pub output_bytes: usize,
    pub output_preview: String,
    pub truncated: bool,
}

/// An execution that replied: what its audit record and the metrics need.
#[derive(Debug)]
pub struct Finished {
    pub took: Duration,
    pub key: String,
    pub code_sha256: String,
    pub output_bytes: usize,
    pub output_preview: String,
    pub truncated: bool,
}

#[derive(Debug)]
pub struct Executions {
    running: HashMap<String, Running>,
    finished: VecDeque<String>,
    cap: usize,
    late: Vec<LateOutput>,
    /// Execute requests sent to the current process and not replied to, oldest first (the
    /// one running, then those queued behind it): answered by the gateway if it dies.
    in_flight: VecDeque<Header>,
}

/// Most execute requests followed for an answer in the kernel's place.
const MAX_IN_FLIGHT: usize = 1024;

#[derive(Deserialize)]
struct StreamText<'a> {
    #[serde(default, borrow)]
    text: std::borrow::Cow<'a, str>,
}

#[derive(Deserialize)]
struct DisplayData<'a> {
    #[serde(default, borrow)]
    data: Option<HashMap<std::borrow::Cow<'a, str>, &'a RawValue>>,
}

impl Executions {
    /// `cap`: output bytes allowed per execution.
    pub fn new(cap: usize) -> Self {
        Executions {
            running: HashMap::new(),
            finished: VecDeque::new(),
            cap,
            late: Vec::new(),
            in_flight: VecDeque::new(),
        }
    }

    /// An `execute_request` is on its way to the kernel.
    pub fn started(&mut self, request: &Header, key: &str, code_sha256: String) {
        if self.running.len() >= MAX_RUNNING {
            self.running.clear();
            self.finished.clear();
        }
        self.running.insert(
            request.msg_id.clone(),
            Running {
                started: Some(Instant::now()),
                request: request.clone(),
                output: 0,
                truncated: false,
                key: key.to_owned(),
                code_sha256,
                preview: String::new(),
                at_reply: None,
            },
        );
    }

    /// The request went to the kernel's process: it owes an answer from now on.
    pub fn sent(&mut self, request: &Header) {
        if self.in_flight.len() >= MAX_IN_FLIGHT {
            self.in_flight.pop_front();
        }
        self.in_flight.push_back(request.clone());
    }

    /// Whether the current process owes an answer.
    pub fn in_flight(&self) -> bool {
        !self.in_flight.is_empty()
    }

    /// A new process: whatever the previous one was asked is answered or lost by now.
    pub fn forget_sent(&mut self) {
        self.in_flight.clear();
    }

    /// The process is gone: the requests it owed an answer, oldest first, each with what
    /// it did before (for its record), forgotten.
    pub fn lost(&mut self) -> Vec<(Header, Option<Finished>)> {
        let lost: Vec<Header> = self.in_flight.drain(..).collect();
        lost.into_iter()
            .map(|header| {
                let finished = self.replied(&header.msg_id);
                (header, finished)
            })
            .collect()
    }

    /// Its `execute_reply` came: how long it took and what it produced, once.
    pub fn replied(&mut self, parent: &str) -> Option<Finished> {
        self.in_flight.retain(|h| h.msg_id != parent);
        let run = self.running.get_mut(parent)?;
        let took = run.started.take()?.elapsed();
        run.at_reply = Some(run.output);
        Some(Finished {
            took,
            key: run.key.clone(),
            code_sha256: run.code_sha256.clone(),
            output_bytes: run.output,
            output_preview: run.preview.clone(),
            truncated: run.truncated,
        })
    }

    /// Weighs one IOPub message against its execution's cap.
    pub fn output(&mut self, message: &Message) -> Verdict {
        let Some(parent) = message.parent_msg_id() else {
            return Verdict::Relay;
        };
        if message.kind() == MsgKind::Status {
            self.maybe_finished(parent, message);
            return Verdict::Relay;
        }
        let Some(run) = self.running.get_mut(parent) else {
            return Verdict::Relay;
        };
        if run.truncated {
            return match weight(message) {
                Some(_) => Verdict::Drop,
                None => Verdict::Relay,
            };
        }
        let Some(bytes) = weight(message) else {
            return Verdict::Relay;
        };
        if run.preview.len() < crate::audit::OUTPUT_PREVIEW_CHARS * 4 {
            crate::audit::extend_preview(&mut run.preview, &preview_text(message));
        }
        let room = self.cap.saturating_sub(run.output);
        run.output = run.output.saturating_add(bytes);
        if run.output <= self.cap {
            return Verdict::Relay;
        }
        run.truncated = true;
        Verdict::Truncate {
            kept: stream_head(message, room),
            notice: truncation_notice(&run.request, self.cap),
        }
    }

    /// Executions whose output went on after their reply, once each, at their `idle`.
    pub fn take_late_output(&mut self) -> Vec<LateOutput> {
        std::mem::take(&mut self.late)
    }

    /// Whether an execution's output was cut (kept while it is tracked).
    #[cfg(test)]
    fn truncated(&self, msg_id: &str) -> bool {
        self.running.get(msg_id).is_some_and(|r| r.truncated)
    }

    fn maybe_finished(&mut self, parent: &str, message: &Message) {
        #[derive(Deserialize)]
        struct State<'a> {
            #[serde(default, borrow)]
            execution_state: &'a str,
        }
        let idle = serde_json::from_str::<State>(message.content.get())
            .map(|s| s.execution_state == "idle")
            .unwrap_or(false);
        if !idle || !self.running.contains_key(parent) || self.finished.iter().any(|f| f == parent)
        {
            return;
        }
        if let Some(run) = self.running.get(parent) {
            if run.at_reply.is_some_and(|n| run.output > n) {
                self.late.push(LateOutput {
                    msg_id: parent.to_owned(),
                    key: run.key.clone(),
                    output_bytes: run.output,
                    output_preview: run.preview.clone(),
                    truncated: run.truncated,
                });
            }
        }
        self.finished.push_back(parent.to_owned());
        if self.finished.len() > KEEP_FINISHED {
            if let Some(old) = self.finished.pop_front() {
                self.running.remove(&old);
            }
        }
    }
}

/// The output bytes a message carries, or `None` when it is not output (status, errors,
/// execute_input, clear_output, comms).
fn weight(message: &Message) -> Option<usize> {
    let buffers: usize = message.buffers.iter().map(|b| b.len()).sum();
    match message.kind() {
        MsgKind::Stream => Some(
            serde_json::from_str::<StreamText>(message.content.get())
                .map(|s| s.text.len())
                .unwrap_or_else(|_| message.content.get().len()),
        ),
        MsgKind::DisplayData | MsgKind::UpdateDisplayData | MsgKind::ExecuteResult => {
            let data = match serde_json::from_str::<DisplayData>(message.content.get()) {
                Ok(d) => d
                    .data
                    .map(|d| d.values().map(|v| v.get().len()).sum())
                    .unwrap_or(0),
                Err(_) => message.content.get().len(),
            };
            Some(data + buffers)
        }
        _ => None,
    }
}

/// The first `room` bytes of a `stream` message's text (cut back to a character boundary),
/// as a message of its own with every other field kept; `None` for other messages or when
/// nothing fits.
fn stream_head(message: &Message, room: usize) -> Option<Box<Message>> {
    if message.kind() != MsgKind::Stream || room == 0 {
        return None;
    }
    let mut content: serde_json::Map<String, serde_json::Value> = message.content.parse().ok()?;
    let text = content.get("text")?.as_str()?;
    let mut end = room.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    if end == 0 {
        return None;
    }
    let head = text[..end].to_owned();
    content.insert("text".to_owned(), serde_json::Value::String(head));
    let mut kept = Box::new(message.clone());
    kept.content = RawJson::from_value(&content);
    Some(kept)
}

/// What of an output message goes into the audit preview: stream text, or `text/plain`.
fn preview_text(message: &Message) -> String {
    #[derive(Deserialize)]
    struct Plain {
        #[serde(default)]
        text: String,
        #[serde(default)]
        data: Option<HashMap<String, serde_json::Value>>,
    }
    match message.content.parse::<Plain>() {
        Ok(p) if message.kind() == MsgKind::Stream => p.text,
        Ok(p) => p
            .data
            .and_then(|d| {
                d.get("text/plain")
                    .and_then(|v| v.as_str().map(str::to_owned))
            })
            .unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Marks the gateway's notice, so that callers can tell it from the kernel's own output.
pub const TRUNCATED_METADATA: &str = "kernelgate_output_truncated";

fn truncation_notice(request: &Header, cap: usize) -> Arc<Outbound> {
    let text = format!(
        "[output truncated: this execution printed or displayed more than {} MiB \
         (--max-output-mb); the rest of its output is dropped while the code keeps running. \
         Write large results to a file instead.]\n",
        cap / (1024 * 1024)
    );
    let content = RawJson::from_value(&serde_json::json!({"name": "stderr", "text": text}));
    let header = Header::new("stream", &request.session, "kernelgate", &super::now_iso());
    let mut message = Message::new(header, Some(request.clone()), content);
    message.metadata = RawJson::from_value(&serde_json::json!({ TRUNCATED_METADATA: true }));
    Outbound::new(Channel::IoPub, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> Header {
        Header::new("execute_request", "client", "alice", "2026-01-01T00:00:00Z")
    }

    fn iopub(parent: &Header, msg_type: &str, content: serde_json::Value) -> Message {
        let header = Header::new(msg_type, "kernel", "kernel", "2026-01-01T00:00:00Z");
        Message::new(header, Some(parent.clone()), RawJson::from_value(&content))
    }

    fn stream(parent: &Header, text: &str) -> Message {
        iopub(
            parent,
            "stream",
            serde_json::json!({"name": "stdout", "text": text}),
        )
    }

    #[test]
    fn output_past_the_cap_is_replaced_by_one_notice() {
        let mut ex = Executions::new(10);
        let req = request();
        ex.started(&req, "k", String::new());
        assert!(matches!(ex.output(&stream(&req, "12345")), Verdict::Relay));
        assert!(matches!(ex.output(&stream(&req, "67890")), Verdict::Relay));
        let Verdict::Truncate { kept, notice } = ex.output(&stream(&req, "x")) else {
            panic!("the eleventh byte crosses the cap");
        };
        assert!(kept.is_none(), "the cap was full: nothing of it fits");
        let m = &notice.message;
        assert_eq!(m.msg_type(), "stream");
        assert_eq!(m.parent_msg_id(), Some(req.msg_id.as_str()));
        let text: serde_json::Value = m.content.parse().expect("json");
        assert_eq!(text["name"], "stderr");
        assert!(text["text"]
            .as_str()
            .is_some_and(|t| t.starts_with("[output truncated")));
        assert!(m.metadata.get().contains(TRUNCATED_METADATA));
        assert!(ex.truncated(&req.msg_id));
        let png = iopub(
            &req,
            "display_data",
            serde_json::json!({"data": {"image/png": "AAAA"}, "metadata": {}}),
        );
        assert!(matches!(ex.output(&png), Verdict::Drop));
        // What is not output still passes: errors, status, the reply's idle.
        let error = iopub(
            &req,
            "error",
            serde_json::json!({"ename": "E", "evalue": "", "traceback": []}),
        );
        assert!(matches!(ex.output(&error), Verdict::Relay));
        let idle = iopub(
            &req,
            "status",
            serde_json::json!({"execution_state": "idle"}),
        );
        assert!(matches!(ex.output(&idle), Verdict::Relay));
        // A late print from a thread of the finished execution is still cut.
        assert!(matches!(ex.output(&stream(&req, "late")), Verdict::Drop));
    }

    #[test]
    fn each_execution_has_its_own_budget_and_others_pass() {
        let mut ex = Executions::new(4);
        let (a, b) = (request(), request());
        ex.started(&a, "k", String::new());
        ex.started(&b, "k", String::new());
        assert!(matches!(
            ex.output(&stream(&a, "aaaaa")),
            Verdict::Truncate { .. }
        ));
        assert!(matches!(ex.output(&stream(&b, "bbbb")), Verdict::Relay));
        let other = request();
        assert!(
            matches!(ex.output(&stream(&other, "not tracked")), Verdict::Relay),
            "output of an execution the gateway did not see start is not cut"
        );
    }

    fn text_of(m: &Message) -> String {
        let content: serde_json::Value = m.content.parse().expect("json");
        content["text"].as_str().unwrap_or_default().to_owned()
    }

    #[test]
    fn the_stream_message_that_crosses_the_cap_is_cut_there() {
        let mut ex = Executions::new(10);
        let req = request();
        ex.started(&req, "k", String::new());
        assert!(matches!(ex.output(&stream(&req, "1234")), Verdict::Relay));
        let mut big = stream(&req, &"y".repeat(100));
        big.metadata = RawJson::from_value(&serde_json::json!({"kept": true}));
        let Verdict::Truncate { kept, notice } = ex.output(&big) else {
            panic!("100 bytes cross a cap of 10");
        };
        let kept = kept.expect("the first 6 bytes fit");
        assert_eq!(text_of(&kept), "yyyyyy");
        assert_eq!(kept.header, big.header, "still the kernel's message");
        assert_eq!(kept.metadata.get(), big.metadata.get());
        let content: serde_json::Value = kept.content.parse().expect("json");
        assert_eq!(content["name"], "stdout");
        assert!(text_of(&notice.message).starts_with("[output truncated"));
        assert!(matches!(ex.output(&stream(&req, "z")), Verdict::Drop));
    }

    #[test]
    fn a_cut_never_splits_a_character() {
        let mut ex = Executions::new(5);
        let req = request();
        ex.started(&req, "k", String::new());
        // "é" is two bytes: five bytes end inside the third one.
        let Verdict::Truncate { kept, .. } = ex.output(&stream(&req, "ééé")) else {
            panic!("six bytes cross a cap of 5");
        };
        assert_eq!(text_of(&kept.expect("two characters fit")), "éé");
    }

    #[test]
    fn a_display_that_crosses_the_cap_is_dropped_whole() {
        let mut ex = Executions::new(10);
        let req = request();
        ex.started(&req, "k", String::new());
        let png = iopub(
            &req,
            "display_data",
            serde_json::json!({"data": {"image/png": "A".repeat(50)}, "metadata": {}}),
        );
        let Verdict::Truncate { kept, .. } = ex.output(&png) else {
            panic!("a 52-byte display crosses a cap of 10");
        };
        assert!(kept.is_none());
    }

    #[test]
    fn display_data_counts_its_data_and_buffers() {
        let req = request();
        let mut m = iopub(
            &req,
            "display_data",
            serde_json::json!({"data": {"text/plain": "abc"}, "metadata": {"big": "x".repeat(100)}}),
        );
        assert_eq!(weight(&m), Some("\"abc\"".len()));
        m.buffers.push(bytes::Bytes::from(vec![0u8; 7]));
        assert_eq!(weight(&m), Some("\"abc\"".len() + 7));
        assert_eq!(weight(&stream(&req, "héllo")), Some("héllo".len()));
    }

    #[test]
    fn replied_reports_the_duration_once_and_finished_runs_are_forgotten() {
        let mut ex = Executions::new(1 << 20);
        let first = request();
        ex.started(&first, "k", String::new());
        assert!(ex.replied(&first.msg_id).is_some());
        assert!(ex.replied(&first.msg_id).is_none());
        let idle = |h: &Header| iopub(h, "status", serde_json::json!({"execution_state": "idle"}));
        ex.output(&idle(&first));
        for _ in 0..KEEP_FINISHED {
            let r = request();
            ex.started(&r, "k", String::new());
            ex.output(&idle(&r));
        }
        assert!(!ex.running.contains_key(&first.msg_id));
        assert_eq!(ex.running.len(), KEEP_FINISHED);
    }
}
