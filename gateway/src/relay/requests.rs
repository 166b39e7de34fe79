//! The audit trail as one kernel's relay writes to it ([`Trail`]): client requests that run
//! code or reach kernel-side objects (execute requests, debug requests, comm messages),
//! before they are sent; the policy's decisions; executions answered in the kernel's place.

use super::executions::Finished;
use super::gate::Refusal;
use crate::audit::{Audit, Record, Sender, Written};
use kernelgate_protocol::{Header, Message, MsgKind};

/// What of a request that makes the kernel run code the audit trail keeps.
#[derive(Default, serde::Deserialize)]
pub(super) struct CodeRequest {
    #[serde(default)]
    pub(super) code: String,
    #[serde(default)]
    pub(super) user_expressions: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    pub(super) silent: bool,
}

/// The audit trail as one kernel writes to it: every record names the kernel.
#[derive(Debug)]
pub(super) struct Trail {
    pub(super) audit: Audit,
    kernel: String,
}

impl Trail {
    pub(super) fn new(audit: Audit, kernel: &str) -> Trail {
        Trail {
            audit,
            kernel: kernel.to_owned(),
        }
    }

    /// Who sent a message, as every audit record about it starts.
    fn sender(&self, key: &str, message: &Message) -> Sender {
        let h = &message.header;
        Sender {
            key: key.to_owned(),
            username: h.username.clone(),
            agent_id: h.extra.get("agent_id").cloned(),
            kernel: self.kernel.clone(),
            session: h.session.clone(),
            msg_id: h.msg_id.clone(),
        }
    }

    /// Audits a client request that runs code or talks to kernel-side objects: execute
    /// requests (code and user expressions), debug requests and comm messages. Returns the
    /// code's SHA-256 for an execute request, and the record to wait for.
    pub(super) fn request(&self, key: &str, message: &Message) -> (Option<String>, Written) {
        if !self.audit.enabled() {
            return (None, Written::default());
        }
        let sender = self.sender(key, message);
        match message.kind() {
            MsgKind::ExecuteRequest => {
                let req: CodeRequest = message.content.parse().unwrap_or_default();
                let sha = crate::audit::sha256(&req.code);
                let written = self.audit.record(&Record::ExecutionRequested {
                    sender,
                    code_sha256: sha.clone(),
                    code: req.code,
                    user_expressions: req.user_expressions,
                    silent: req.silent,
                });
                (Some(sha), written)
            }
            MsgKind::DebugRequest => {
                let content: serde_json::Value = message.content.parse().unwrap_or_default();
                let written = self.audit.record(&Record::DebugRequest {
                    sender,
                    request: content,
                });
                (None, written)
            }
            MsgKind::Comm => {
                let content: serde_json::Value = message.content.parse().unwrap_or_default();
                let data = content
                    .get("data")
                    .map(|d| d.to_string())
                    .unwrap_or_default();
                let written = self.audit.record(&Record::Comm {
                    sender,
                    msg_type: message.msg_type().to_owned(),
                    comm_id: content.get("comm_id").cloned(),
                    target_name: content.get("target_name").cloned(),
                    data_sha256: crate::audit::sha256(&data),
                });
                (None, written)
            }
            _ => (None, Written::default()),
        }
    }

    /// A `policy_decision` record.
    pub(super) fn decision(
        &self,
        key: &str,
        message: &Message,
        decision: &str,
        verdict: Option<&kernelgate_policy::Verdict>,
        approval: Option<&str>,
        by: Option<&str>,
    ) -> Written {
        self.audit.record(&Record::PolicyDecision {
            sender: self.sender(key, message),
            msg_type: message.msg_type().to_owned(),
            decision: decision.to_owned(),
            rule: verdict.map(|v| v.rule),
            reason: verdict.map(|v| v.reason.clone()),
            matched: verdict.map(|v| v.matched.clone()),
            approval_id: approval.map(str::to_owned),
            by: by.map(str::to_owned),
        })
    }

    /// The `execution_finished` record of an execution answered in the kernel's place
    /// that never reached it.
    pub(super) fn never_ran(
        &self,
        h: &Header,
        key: &str,
        code_sha256: Option<String>,
        why: &Refusal,
    ) -> Written {
        self.audit.record(&Record::ExecutionFinished {
            key: key.to_owned(),
            kernel: self.kernel.clone(),
            msg_id: Some(h.msg_id.clone()),
            session: Some(h.session.clone()),
            code_sha256,
            status: "error".into(),
            ename: Some(why.ename.to_string()),
            reason: None,
            duration_ms: 0,
            output_bytes: 0,
            output: String::new(),
            truncated: false,
            ran: Some(false),
        })
    }

    /// The `execution_finished` record of an execution a gone process owed (`ran`: it
    /// was the one running), with what it did before.
    pub(super) fn lost(
        &self,
        h: &Header,
        finished: Option<Finished>,
        why: &Refusal,
        ran: bool,
    ) -> Written {
        let (key, sha, took, bytes, preview, truncated) = match finished {
            Some(f) => (
                f.key,
                f.code_sha256,
                f.took.as_millis() as u64,
                f.output_bytes,
                f.output_preview,
                f.truncated,
            ),
            None => Default::default(),
        };
        self.audit.record(&Record::ExecutionFinished {
            key,
            kernel: self.kernel.clone(),
            msg_id: Some(h.msg_id.clone()),
            session: Some(h.session.clone()),
            code_sha256: (!sha.is_empty()).then_some(sha),
            status: "error".into(),
            ename: Some(why.ename.to_string()),
            reason: Some(why.evalue.clone()),
            duration_ms: took,
            output_bytes: bytes,
            output: preview,
            truncated,
            ran: Some(ran),
        })
    }
}
