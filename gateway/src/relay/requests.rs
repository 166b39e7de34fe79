//! What the audit trail records of client requests that run code or reach kernel-side
//! objects (execute requests, debug requests, comm messages), before they are sent.

use super::*;

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

impl Relay {
    /// Who sent a message, as every audit record about it starts.
    pub(super) fn sender(&self, key: &str, message: &Message) -> Sender {
        let h = &message.header;
        Sender {
            key: key.to_owned(),
            username: h.username.clone(),
            agent_id: h.extra.get("agent_id").cloned(),
            kernel: self.id.clone(),
            session: h.session.clone(),
            msg_id: h.msg_id.clone(),
        }
    }

    /// Audits a client request that runs code or talks to kernel-side objects: execute
    /// requests (code and user expressions), debug requests and comm messages. Returns the
    /// code's SHA-256 for an execute request, and the record to wait for.
    pub(super) fn audit_request(&self, key: &str, message: &Message) -> (Option<String>, Written) {
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
}
