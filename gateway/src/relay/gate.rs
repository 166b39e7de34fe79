//! Shell messages held by the execution policy: an execution waiting for an administrator,
//! and everything sent on shell after it (held too, so the kernel sees shell messages in
//! the order clients sent them). Also the messages the gateway answers in the kernel's
//! place for an execution that never reaches it.
//!
//! A refused execution looks to clients like a cell that failed: IOPub `busy`, an `error`,
//! the `execute_reply` with status `error`, then `idle`, all with the request as parent
//! (messaging doc, "Request-Reply" and "Kernel status"), so JupyterLab, the web console and
//! the agent API show it as a failed cell.

use super::clients::Outbound;
use crate::audit::Written;
use kernelgate_protocol::{Channel, Header, Message, RawJson};
use serde_json::json;
use std::sync::Arc;

/// What happens to a held shell message when its turn comes.
#[derive(Debug)]
pub enum Gate {
    /// Sent to the kernel.
    Pass,
    /// Waits for the approval `approval`; `reason` is the rule's, as clients read it.
    Waiting { approval: String, reason: String },
    /// Answered by the gateway with this error; the kernel never sees it.
    Refuse(Refusal),
}

/// Why an execution was not run, as its error shows it.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub ename: &'static str,
    pub evalue: String,
}

impl Refusal {
    /// A policy rule (or an administrator, or the approval timeout) refused it.
    pub fn policy(evalue: String) -> Refusal {
        Refusal {
            ename: "PolicyViolation",
            evalue,
        }
    }
}

/// A client's shell message the kernel has not been sent yet.
#[derive(Debug)]
pub struct Held {
    pub message: Message,
    /// The key that sent it (audit).
    pub key: String,
    pub code_sha256: Option<String>,
    pub gate: Gate,
    /// The audit records about it so far: in the file before it leaves the queue.
    pub written: Written,
}

impl Held {
    /// Whether it waits for the approval `approval`.
    pub fn waits_for(&self, approval: &str) -> bool {
        matches!(&self.gate, Gate::Waiting { approval: id, .. } if id == approval)
    }
}

/// The messages that answer a refused `execute_request` in the kernel's place. The cell
/// never ran, so its `execution_count` is null (notebooks show `[ ]`, as for a cell that was
/// never run), and the kernel's own count does not advance.
pub fn refusal(request: &Header, session: &str, why: &Refusal) -> Vec<Arc<Outbound>> {
    let traceback = vec![format!("{}: {}", why.ename, why.evalue)];
    vec![
        status(request, session, "busy"),
        reply_to(
            Channel::IoPub,
            "error",
            request,
            session,
            json!({"ename": why.ename, "evalue": why.evalue, "traceback": traceback}),
        ),
        reply_to(
            Channel::Shell,
            "execute_reply",
            request,
            session,
            json!({
                "status": "error", "execution_count": null, "ename": why.ename,
                "evalue": why.evalue, "traceback": traceback, "user_expressions": {},
                "payload": [],
            }),
        ),
        status(request, session, "idle"),
    ]
}

/// What clients see while an execution waits for approval: the kernel busy with it, and a
/// line on stderr saying why and for how long.
pub fn awaiting(request: &Header, session: &str, text: String) -> Vec<Arc<Outbound>> {
    vec![
        status(request, session, "busy"),
        reply_to(
            Channel::IoPub,
            "stream",
            request,
            session,
            json!({"name": "stderr", "text": text}),
        ),
    ]
}

/// The answer to a `debug_request` while a policy is set: debugging evaluates code the
/// policy cannot see, so it is refused (Debug Adapter Protocol response, `success: false`).
pub fn debug_refused(request: &Message, session: &str) -> Arc<Outbound> {
    #[derive(serde::Deserialize, Default)]
    struct DebugRequest {
        #[serde(default)]
        seq: i64,
        #[serde(default)]
        command: String,
    }
    let asked: DebugRequest = request.content.parse().unwrap_or_default();
    reply_to(
        Channel::Control,
        "debug_reply",
        &request.header,
        session,
        json!({
            "type": "response", "request_seq": asked.seq, "success": false,
            "command": asked.command, "seq": 0,
            "message": "debugging is refused while an execution policy is set (--policy): it would run code the policy cannot check",
            "body": {},
        }),
    )
}

fn status(request: &Header, session: &str, state: &str) -> Arc<Outbound> {
    reply_to(
        Channel::IoPub,
        "status",
        request,
        session,
        json!({"execution_state": state}),
    )
}

fn reply_to(
    channel: Channel,
    msg_type: &str,
    request: &Header,
    session: &str,
    content: serde_json::Value,
) -> Arc<Outbound> {
    let header = Header::new(msg_type, session, "kernelgate", &super::now_iso());
    Outbound::new(
        channel,
        Message::new(header, Some(request.clone()), RawJson::from_value(&content)),
    )
}
