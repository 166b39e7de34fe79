//! Following one shell request to its end, without I/O.
//!
//! A kernel answers a request (`execute_request`, `kernel_info_request`, ...) with a reply
//! on shell and, on IOPub, a `busy` status, the outputs, and an `idle` status, all naming
//! the request as their parent. The request is over only when both the reply and `idle`
//! came, in whichever order the two sockets deliver them. [`Execution`] is fed every
//! message a client receives; it picks out those of its request, turns them into
//! [`Event`]s and knows when the request is over and how it ended. [`Outcome`] folds the
//! events into one result for callers that want everything at once.
//!
//! Time is the caller's: it decides how long to wait, when to interrupt (and says so with
//! [`Execution::interrupted`]) and when to give up on a missing `idle`.
//!
//! Spec: "Request-Reply" and "Kernel status" of the messaging doc.

use crate::content::{ErrorContent, ExecutionState};
use crate::{Channel, Message, RawJson};
use serde::Deserialize;
use serde_json::{Map, Value};

/// Where a request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// No reply yet.
    AwaitingReply,
    /// Replied; its `idle` status (after which no more outputs come) is still due.
    AwaitingIdle,
    /// Replied and idle, or the kernel went away.
    Done,
}

/// Why the caller interrupted the kernel during the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interruption {
    /// It ran past the caller's time limit.
    Timeout,
    /// Nobody waits for its result any more.
    Abandoned,
}

/// How a request ended, from the caller's side; written `ok`, `error`, `timeout` (an
/// unknown word reads as `error`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    /// The reply said `error` or `aborted`, no reply came, or the kernel died.
    Error,
    /// Interrupted because it ran too long.
    Timeout,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Error => "error",
            Status::Timeout => "timeout",
        }
    }
}

impl serde::Serialize for Status {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Status {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match String::deserialize(d)?.as_str() {
            "ok" => Status::Ok,
            "timeout" => Status::Timeout,
            _ => Status::Error,
        })
    }
}

/// One thing that happened to the request, in the order the kernel reported it.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// IOPub `status: busy`: the kernel started on it.
    Busy,
    /// IOPub `execute_input`: the code as run, with its execution count.
    Input {
        execution_count: Option<i64>,
    },
    Stream {
        name: String,
        text: String,
    },
    /// `display_data`, or `execute_result` when [`Display::is_result`].
    Display(Display),
    /// `update_display_data`: replaces every output shown with the same display id.
    UpdateDisplay(Display),
    ClearOutput {
        wait: bool,
    },
    Error(ErrorContent),
    /// The reply on shell.
    Reply(Reply),
    /// IOPub `status: idle`: nothing more will come for this request.
    Idle,
    /// The kernel died or is restarting under the request (the gateway's own status, sent
    /// with no parent): its reply will never come.
    KernelLost(ExecutionState),
    /// Another message of this request (`comm_msg`, `input_request`, ...).
    Other {
        channel: Channel,
        msg_type: String,
    },
}

/// A rich output: a mime bundle with its metadata.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Display {
    pub data: Map<String, Value>,
    pub metadata: Map<String, Value>,
    /// `transient.display_id`: later updates of this output name it.
    pub display_id: Option<String>,
    /// `execute_result` (the value of the last expression) rather than `display_data`.
    pub is_result: bool,
    pub execution_count: Option<i64>,
}

/// The reply to the request.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub msg_type: String,
    /// `ok`, `error` or `aborted`.
    pub status: String,
    pub execution_count: Option<i64>,
    pub ename: String,
    pub evalue: String,
    /// The whole content, for replies with more (`kernel_info_reply`).
    pub content: RawJson,
}

/// Tracks one request, identified by the `msg_id` of its header.
#[derive(Debug, Clone)]
pub struct Execution {
    msg_id: String,
    reply: Option<Reply>,
    idle: bool,
    lost: Option<ExecutionState>,
    interrupted: Option<Interruption>,
}

#[derive(Deserialize)]
struct StreamIn {
    #[serde(default)]
    name: String,
    #[serde(default)]
    text: String,
}

#[derive(Deserialize)]
struct DisplayIn {
    #[serde(default)]
    data: Option<Map<String, Value>>,
    #[serde(default)]
    metadata: Option<Map<String, Value>>,
    #[serde(default)]
    transient: Option<Map<String, Value>>,
    #[serde(default)]
    execution_count: Option<i64>,
}

#[derive(Deserialize)]
struct ReplyIn {
    #[serde(default)]
    status: String,
    #[serde(default)]
    execution_count: Option<i64>,
    #[serde(default)]
    ename: Option<String>,
    #[serde(default)]
    evalue: Option<String>,
}

#[derive(Deserialize)]
struct StateIn {
    #[serde(default)]
    execution_state: Option<String>,
}

#[derive(Deserialize)]
struct InputIn {
    #[serde(default)]
    execution_count: Option<i64>,
}

#[derive(Deserialize)]
struct ClearIn {
    #[serde(default)]
    wait: bool,
}

#[derive(Deserialize)]
struct ErrorIn {
    #[serde(default)]
    ename: String,
    #[serde(default)]
    evalue: String,
    #[serde(default)]
    traceback: Vec<Value>,
}

impl Execution {
    pub fn new(msg_id: &str) -> Self {
        Execution {
            msg_id: msg_id.to_owned(),
            reply: None,
            idle: false,
            lost: None,
            interrupted: None,
        }
    }

    pub fn msg_id(&self) -> &str {
        &self.msg_id
    }

    /// Feeds one received message; `None` when it is not about this request.
    pub fn feed(&mut self, channel: Channel, message: &Message) -> Option<Event> {
        self.observe(
            channel,
            message.msg_type(),
            message.parent_msg_id(),
            &message.content,
        )
    }

    /// [`Self::feed`] for a message already taken apart.
    pub fn observe(
        &mut self,
        channel: Channel,
        msg_type: &str,
        parent_msg_id: Option<&str>,
        content: &RawJson,
    ) -> Option<Event> {
        if self.phase() == Phase::Done {
            return None;
        }
        if parent_msg_id.is_none() && channel == Channel::IoPub && msg_type == "status" {
            let state = content.parse::<StateIn>().ok()?.execution_state?;
            let lost = match state.as_str() {
                "dead" => ExecutionState::Dead,
                "restarting" => ExecutionState::Restarting,
                _ => return None,
            };
            self.lost = Some(lost);
            return Some(Event::KernelLost(lost));
        }
        if parent_msg_id != Some(self.msg_id.as_str()) {
            return None;
        }
        Some(match (channel, msg_type) {
            (Channel::Shell | Channel::Control, t) if t.ends_with("_reply") => {
                let r: ReplyIn = content.parse().unwrap_or(ReplyIn {
                    status: String::new(),
                    execution_count: None,
                    ename: None,
                    evalue: None,
                });
                let reply = Reply {
                    msg_type: t.to_owned(),
                    status: r.status,
                    execution_count: r.execution_count,
                    ename: r.ename.unwrap_or_default(),
                    evalue: r.evalue.unwrap_or_default(),
                    content: content.clone(),
                };
                self.reply = Some(reply.clone());
                Event::Reply(reply)
            }
            (Channel::IoPub, "status") => {
                match content
                    .parse::<StateIn>()
                    .ok()
                    .and_then(|s| s.execution_state)
                {
                    Some(s) if s == "idle" => {
                        self.idle = true;
                        Event::Idle
                    }
                    Some(s) if s == "busy" => Event::Busy,
                    _ => other(channel, msg_type),
                }
            }
            (Channel::IoPub, "stream") => match content.parse::<StreamIn>() {
                Ok(s) => Event::Stream {
                    name: s.name,
                    text: s.text,
                },
                Err(_) => other(channel, msg_type),
            },
            (Channel::IoPub, t @ ("display_data" | "execute_result" | "update_display_data")) => {
                match content.parse::<DisplayIn>() {
                    Ok(d) => {
                        let display = Display {
                            data: d.data.unwrap_or_default(),
                            metadata: d.metadata.unwrap_or_default(),
                            display_id: d
                                .transient
                                .as_ref()
                                .and_then(|t| t.get("display_id"))
                                .and_then(Value::as_str)
                                .map(str::to_owned),
                            is_result: t == "execute_result",
                            execution_count: d.execution_count,
                        };
                        if t == "update_display_data" {
                            Event::UpdateDisplay(display)
                        } else {
                            Event::Display(display)
                        }
                    }
                    Err(_) => other(channel, msg_type),
                }
            }
            (Channel::IoPub, "error") => match content.parse::<ErrorIn>() {
                Ok(e) => Event::Error(ErrorContent {
                    ename: e.ename,
                    evalue: e.evalue,
                    traceback: e
                        .traceback
                        .into_iter()
                        .filter_map(|l| match l {
                            Value::String(s) => Some(s),
                            _ => None,
                        })
                        .collect(),
                    extra: Map::new(),
                }),
                Err(_) => other(channel, msg_type),
            },
            (Channel::IoPub, "execute_input") => Event::Input {
                execution_count: content
                    .parse::<InputIn>()
                    .ok()
                    .and_then(|i| i.execution_count),
            },
            (Channel::IoPub, "clear_output") => Event::ClearOutput {
                wait: content.parse::<ClearIn>().is_ok_and(|c| c.wait),
            },
            _ => other(channel, msg_type),
        })
    }

    pub fn phase(&self) -> Phase {
        match (&self.reply, self.idle) {
            _ if self.lost.is_some() => Phase::Done,
            (Some(_), true) => Phase::Done,
            (Some(_), false) => Phase::AwaitingIdle,
            (None, _) => Phase::AwaitingReply,
        }
    }

    pub fn is_done(&self) -> bool {
        self.phase() == Phase::Done
    }

    /// Notes that the caller interrupted the kernel; the first reason counts.
    pub fn interrupted(&mut self, why: Interruption) {
        self.interrupted.get_or_insert(why);
    }

    pub fn interruption(&self) -> Option<Interruption> {
        self.interrupted
    }

    pub fn reply(&self) -> Option<&Reply> {
        self.reply.as_ref()
    }

    /// The state the kernel went into when it was lost under the request.
    pub fn lost(&self) -> Option<ExecutionState> {
        self.lost
    }

    /// How the request ended (or stands, if asked before it ended).
    pub fn status(&self) -> Status {
        match (self.interrupted, &self.reply) {
            (Some(Interruption::Timeout), _) => Status::Timeout,
            (_, Some(r)) if r.status == "ok" && self.lost.is_none() => Status::Ok,
            _ => Status::Error,
        }
    }
}

fn other(channel: Channel, msg_type: &str) -> Event {
    Event::Other {
        channel,
        msg_type: msg_type.to_owned(),
    }
}

/// Everything a request produced, folded from its events.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    pub stdout: String,
    pub stderr: String,
    /// `display_data` and `execute_result` outputs, in order (updates applied).
    pub displays: Vec<Display>,
    /// The last error output.
    pub error: Option<ErrorContent>,
    pub reply: Option<Reply>,
    /// Set when the kernel was lost under the request.
    pub lost: Option<ExecutionState>,
}

impl Outcome {
    pub fn apply(&mut self, event: &Event) {
        match event {
            Event::Stream { name, text } if name == "stderr" => self.stderr += text,
            Event::Stream { text, .. } => self.stdout += text,
            Event::Display(d) => self.displays.push(d.clone()),
            Event::UpdateDisplay(u) => {
                for d in &mut self.displays {
                    if u.display_id.is_some() && d.display_id == u.display_id {
                        d.data = u.data.clone();
                        d.metadata = u.metadata.clone();
                    }
                }
            }
            Event::Error(e) => self.error = Some(e.clone()),
            Event::Reply(r) => self.reply = Some(r.clone()),
            Event::KernelLost(s) => self.lost = Some(*s),
            Event::Busy
            | Event::Input { .. }
            | Event::ClearOutput { .. }
            | Event::Idle
            | Event::Other { .. } => {}
        }
    }

    /// The reply's execution count.
    pub fn execution_count(&self) -> Option<i64> {
        self.reply.as_ref().and_then(|r| r.execution_count)
    }

    /// The `text/plain` of the last output that has one (the result, usually).
    pub fn result_text(&self) -> Option<&str> {
        self.displays
            .iter()
            .rev()
            .find_map(|d| d.data.get("text/plain").and_then(Value::as_str))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Header;
    use serde_json::json;

    fn msg(msg_type: &str, parent: Option<&str>, content: Value) -> Message {
        let parent = parent.map(|id| {
            let mut h = Header::new("execute_request", "s", "u", "2026-01-01T00:00:00Z");
            h.msg_id = id.to_owned();
            h
        });
        Message::new(
            Header::new(msg_type, "k", "kernel", "2026-01-01T00:00:00Z"),
            parent,
            RawJson::from_value(&content),
        )
    }

    fn run(x: &mut Execution, script: &[(Channel, Message)]) -> Vec<Event> {
        script.iter().filter_map(|(c, m)| x.feed(*c, m)).collect()
    }

    #[test]
    fn a_cell_ends_after_both_reply_and_idle_in_either_order() {
        use Channel::{IoPub, Shell};
        let p = Some("r1");
        for reply_first in [true, false] {
            let mut x = Execution::new("r1");
            let mut script = vec![
                (IoPub, msg("status", p, json!({"execution_state": "busy"}))),
                (
                    IoPub,
                    msg(
                        "execute_input",
                        p,
                        json!({"code": "1", "execution_count": 3}),
                    ),
                ),
                (
                    IoPub,
                    msg("stream", p, json!({"name": "stdout", "text": "hi\n"})),
                ),
                (
                    IoPub,
                    msg(
                        "execute_result",
                        p,
                        json!({"data": {"text/plain": "1"}, "metadata": {}, "execution_count": 3}),
                    ),
                ),
            ];
            let reply = (
                Shell,
                msg(
                    "execute_reply",
                    p,
                    json!({"status": "ok", "execution_count": 3}),
                ),
            );
            let idle = (IoPub, msg("status", p, json!({"execution_state": "idle"})));
            if reply_first {
                script.extend([reply, idle]);
            } else {
                script.extend([idle, reply]);
            }
            let events = run(&mut x, &script[..script.len() - 1]);
            assert_ne!(x.phase(), Phase::Done);
            assert_eq!(events[0], Event::Busy);
            assert_eq!(
                events[1],
                Event::Input {
                    execution_count: Some(3)
                }
            );
            let last = run(&mut x, &script[script.len() - 1..]);
            assert_eq!(last.len(), 1);
            assert!(x.is_done());
            assert_eq!(x.status(), Status::Ok);
            let mut out = Outcome::default();
            for e in events.iter().chain(&last) {
                out.apply(e);
            }
            assert_eq!(out.stdout, "hi\n");
            assert_eq!(out.result_text(), Some("1"));
            assert_eq!(out.execution_count(), Some(3));
        }
    }

    #[test]
    fn other_requests_messages_are_not_ours() {
        let mut x = Execution::new("mine");
        let theirs = msg(
            "stream",
            Some("theirs"),
            json!({"name": "stdout", "text": "x"}),
        );
        assert_eq!(x.feed(Channel::IoPub, &theirs), None);
        let orphan = msg("stream", None, json!({"name": "stdout", "text": "x"}));
        assert_eq!(x.feed(Channel::IoPub, &orphan), None);
        let starting = msg("status", None, json!({"execution_state": "starting"}));
        assert_eq!(x.feed(Channel::IoPub, &starting), None);
        assert_eq!(x.phase(), Phase::AwaitingReply);
    }

    #[test]
    fn a_dead_kernel_ends_the_request_as_an_error() {
        let mut x = Execution::new("r");
        let dead = msg("status", None, json!({"execution_state": "dead"}));
        assert_eq!(
            x.feed(Channel::IoPub, &dead),
            Some(Event::KernelLost(ExecutionState::Dead))
        );
        assert!(x.is_done());
        assert_eq!(x.status(), Status::Error);
        assert_eq!(x.lost(), Some(ExecutionState::Dead));
        // Nothing is taken after the end.
        let late = msg("stream", Some("r"), json!({"name": "stdout", "text": "x"}));
        assert_eq!(x.feed(Channel::IoPub, &late), None);
    }

    #[test]
    fn errors_timeouts_and_aborts_have_their_status() {
        let p = Some("r");
        let mut x = Execution::new("r");
        let err = msg(
            "error",
            p,
            json!({"ename": "ZeroDivisionError", "evalue": "division by zero", "traceback": ["a", 1, "b"]}),
        );
        let Some(Event::Error(e)) = x.feed(Channel::IoPub, &err) else {
            panic!("an error event");
        };
        assert_eq!(e.ename, "ZeroDivisionError");
        assert_eq!(e.traceback, ["a", "b"], "non-string lines are dropped");
        x.feed(
            Channel::Shell,
            &msg("execute_reply", p, json!({"status": "error", "ename": "ZeroDivisionError", "evalue": "division by zero"})),
        );
        assert_eq!(x.status(), Status::Error);
        assert_eq!(
            x.reply().map(|r| r.ename.as_str()),
            Some("ZeroDivisionError")
        );

        let mut t = Execution::new("r");
        t.interrupted(Interruption::Timeout);
        t.interrupted(Interruption::Abandoned);
        t.feed(
            Channel::Shell,
            &msg("execute_reply", p, json!({"status": "ok"})),
        );
        assert_eq!(t.status(), Status::Timeout);
        assert_eq!(t.interruption(), Some(Interruption::Timeout));

        let mut a = Execution::new("r");
        a.feed(
            Channel::Shell,
            &msg("execute_reply", p, json!({"status": "aborted"})),
        );
        assert_eq!(a.status(), Status::Error);
    }

    #[test]
    fn displays_update_and_odd_content_does_not_panic() {
        let p = Some("r");
        let mut x = Execution::new("r");
        let mut out = Outcome::default();
        for m in [
            msg(
                "display_data",
                p,
                json!({"data": {"text/plain": "0%"}, "metadata": {}, "transient": {"display_id": "bar"}}),
            ),
            msg(
                "update_display_data",
                p,
                json!({"data": {"text/plain": "100%"}, "metadata": {}, "transient": {"display_id": "bar"}}),
            ),
            msg("stream", p, json!({"name": 5})),
            msg("display_data", p, json!([1, 2])),
            msg("clear_output", p, json!({"wait": true})),
            msg("comm_msg", p, json!({})),
        ] {
            if let Some(e) = x.feed(Channel::IoPub, &m) {
                out.apply(&e);
            }
        }
        assert_eq!(out.displays.len(), 1);
        assert_eq!(out.result_text(), Some("100%"));
        assert!(out.stdout.is_empty());
    }

    #[test]
    fn any_reply_type_counts_with_its_content() {
        let content = json!({"status": "ok", "protocol_version": "5.3"});
        let mut x = Execution::new("k");
        let Some(Event::Reply(r)) = x.feed(
            Channel::Shell,
            &msg("kernel_info_reply", Some("k"), content),
        ) else {
            panic!("a reply");
        };
        assert_eq!(r.msg_type, "kernel_info_reply");
        assert!(r.content.get().contains("protocol_version"));
        assert_eq!(x.phase(), Phase::AwaitingIdle);
    }
}
