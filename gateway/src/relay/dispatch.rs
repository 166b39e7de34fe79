//! Messages from the kernel: the execution state and activity they show, the audit record
//! of a finished execution (written before its reply is forwarded), the output cap, and
//! routing to the client sessions.

use super::clients::Outbound;
use super::executions::Verdict;
use super::lifecycle::Event;
use super::link::{Deferred, Dispatch};
use super::{wire_size, Relay};
use crate::audit::{Record, Written};
use crate::metrics::{self, Direction, DropReason};
use chrono::Utc;
use kernelgate_protocol::{Channel, Message, MsgKind};
use std::sync::Arc;

impl Dispatch for Relay {
    fn dispatch(&self, channel: Channel, message: Message) -> Option<Deferred> {
        let mut st = self.lock();
        let mut finished_record = Written::default();
        st.last_activity = Utc::now();
        if channel == Channel::IoPub {
            st.comms.observe(&message);
        }
        if channel == Channel::IoPub && message.kind() == MsgKind::Status {
            if let Ok(s) = message.content_as::<kernelgate_protocol::content::Status>() {
                let work = st.work();
                // Reported states change the phase alone: nothing to carry out.
                let _ = st.life.on(Event::Reported(s.execution_state), work);
            }
        }
        if channel == Channel::Shell && message.kind() == MsgKind::ExecuteReply {
            let finished = message
                .parent_msg_id()
                .and_then(|id| st.executions.replied(id));
            let reply = message.content_as::<ReplyStatus>().unwrap_or_default();
            if let Some(f) = finished {
                metrics::execution_ended(&reply.status, f.took);
                for reported in st
                    .installs
                    .as_mut()
                    .map(|r| r.take_new())
                    .unwrap_or_default()
                {
                    let _ = self.trail.audit.record(&Record::PackagesReported {
                        key: f.key.clone(),
                        kernel: self.id.clone(),
                        msg_id: message.parent_msg_id().map(str::to_owned),
                        argv: reported.argv,
                        requested: reported.requested,
                        installed: reported.installed,
                        refused: reported.refused,
                        trusted: false,
                    });
                }
                // In the file before the reply is forwarded.
                finished_record = self.trail.audit.record(&Record::ExecutionFinished {
                    key: f.key,
                    kernel: self.id.clone(),
                    msg_id: message.parent_msg_id().map(str::to_owned),
                    session: message.parent_header.as_ref().map(|h| h.session.clone()),
                    code_sha256: Some(f.code_sha256),
                    status: reply.status,
                    ename: reply.ename,
                    reason: None,
                    duration_ms: f.took.as_millis() as u64,
                    output_bytes: f.output_bytes,
                    output: f.output_preview,
                    truncated: f.truncated,
                    ran: None,
                });
            }
        }
        metrics::relayed(Direction::KernelToClient, wire_size(&message));
        if channel == Channel::IoPub {
            let verdict = st.executions.output(&message);
            for late in st.executions.take_late_output() {
                // Nothing waits for it: the output was forwarded as it came.
                let _ = self.trail.audit.record(&Record::ExecutionOutput {
                    key: late.key,
                    kernel: self.id.clone(),
                    msg_id: late.msg_id,
                    output_bytes: late.output_bytes,
                    output: late.output_preview,
                    truncated: late.truncated,
                });
            }
            match verdict {
                Verdict::Relay => {}
                Verdict::Drop => {
                    metrics::dropped(DropReason::OutputLimit, 1);
                    return None;
                }
                Verdict::Truncate { kept, notice } => {
                    tracing::info!(kernel = %self.id, "execution output over --max-output-mb; the rest of it is dropped");
                    match kept {
                        Some(head) => st.clients.route(Outbound::new(channel, *head)),
                        None => metrics::dropped(DropReason::OutputLimit, 1),
                    }
                    st.clients.route(notice);
                    return None;
                }
            }
        }
        let out = Outbound::new(channel, message);
        if finished_record.is_pending() {
            return Some(Deferred {
                written: finished_record,
                message: out,
            });
        }
        st.clients.route(out);
        None
    }

    fn forward(&self, message: Arc<Outbound>) {
        self.lock().clients.route(message);
    }

    fn link_lost(&self, channel: Channel) {
        tracing::debug!(kernel = %self.id, %channel, "kernel link lost");
    }
}

/// The `status` and `ename` of a reply, without parsing the rest (a traceback may be long).
#[derive(Default, serde::Deserialize)]
struct ReplyStatus {
    #[serde(default)]
    status: String,
    #[serde(default)]
    ename: Option<String>,
}
