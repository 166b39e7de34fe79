//! The execution policy's hold queue as a state machine without I/O: which shell messages
//! wait, in what order they leave, and what an approval's answer or an interrupt does to
//! them. The relay ([`super::holding`]) carries out what it decides: audit records,
//! messages to clients, sends to the kernel.
//!
//! Shell messages leave in the order clients sent them: once one execution waits for an
//! administrator, every shell message after it waits too, even one the policy allows.

use super::gate::{Gate, Held, Refusal};
use std::collections::VecDeque;

#[derive(Debug, Default)]
pub struct HoldQueue {
    held: VecDeque<Held>,
    /// A task is releasing the messages whose turn came; until it ends, new shell
    /// messages queue behind them.
    releasing: bool,
}

impl HoldQueue {
    /// Whether a shell message must queue: something is held or being released before it,
    /// or it waits for approval itself (`asks`).
    pub fn must_hold(&self, asks: bool) -> bool {
        asks || self.releasing || !self.held.is_empty()
    }

    pub fn push(&mut self, held: Held) {
        self.held.push_back(held);
    }

    /// Settles the execution waiting for `approval` with the gate `settle` makes of the
    /// reason it waited for; `None` when no execution waits for it any more.
    pub fn settle(
        &mut self,
        approval: &str,
        settle: impl FnOnce(&str) -> Gate,
    ) -> Option<&mut Held> {
        let held = self.held.iter_mut().find(|h| h.waits_for(approval))?;
        let reason = match &held.gate {
            Gate::Waiting { reason, .. } => reason.clone(),
            _ => String::new(),
        };
        held.gate = settle(&reason);
        Some(held)
    }

    /// Refuses every execution still waiting for approval with `why` (an interrupt: they
    /// never run). Returns them with the approvals they waited for, in queue order.
    pub fn cancel_waiting(&mut self, why: impl Fn() -> Refusal) -> Vec<(String, &mut Held)> {
        let mut cancelled = Vec::new();
        for held in self.held.iter_mut() {
            if let Gate::Waiting { approval, .. } = &held.gate {
                let approval = approval.clone();
                held.gate = Gate::Refuse(why());
                cancelled.push((approval, held));
            }
        }
        cancelled
    }

    /// Marks a release as started; true when none ran and the caller must start one.
    pub fn begin_release(&mut self) -> bool {
        !std::mem::replace(&mut self.releasing, true)
    }

    /// The next message whose turn came (to send, or to refuse). `None` when the queue is
    /// empty or its front still waits for approval, which also ends the release.
    pub fn next_ready(&mut self) -> Option<Held> {
        let ready = self
            .held
            .front()
            .is_some_and(|h| !matches!(h.gate, Gate::Waiting { .. }));
        if !ready {
            self.releasing = false;
            return None;
        }
        self.held.pop_front()
    }

    /// Empties the queue (the kernel's clients are gone); returns the approvals that were
    /// still open.
    pub fn clear(&mut self) -> Vec<String> {
        self.held
            .drain(..)
            .filter_map(|h| match h.gate {
                Gate::Waiting { approval, .. } => Some(approval),
                _ => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelgate_protocol::{Header, Message, RawJson};

    fn held(id: &str, gate: Gate) -> Held {
        let mut header = Header::new("execute_request", "s", "u", "2026-11-25T00:00:00Z");
        header.msg_id = id.into();
        Held {
            message: Message::new(header, None, RawJson::empty_object()),
            key: "alice".into(),
            code_sha256: None,
            gate,
            written: Default::default(),
        }
    }

    fn waiting(approval: &str) -> Gate {
        Gate::Waiting {
            approval: approval.into(),
            reason: "network access".into(),
        }
    }

    fn drain(q: &mut HoldQueue) -> Vec<String> {
        std::iter::from_fn(|| q.next_ready())
            .map(|h| h.message.msg_id().to_owned())
            .collect()
    }

    #[test]
    fn messages_behind_a_waiting_execution_wait_too_and_leave_in_order() {
        let mut q = HoldQueue::default();
        assert!(!q.must_hold(false));
        assert!(q.must_hold(true));
        q.push(held("a", waiting("ap-1")));
        assert!(
            q.must_hold(false),
            "an allowed message queues behind a held one"
        );
        q.push(held("b", Gate::Pass));
        q.push(held("c", Gate::Pass));
        assert!(q.begin_release());
        assert!(drain(&mut q).is_empty(), "the front still waits");
        assert!(q.must_hold(false), "still held");

        let settled = q.settle("ap-1", |_| Gate::Pass).expect("held");
        assert_eq!(settled.message.msg_id(), "a");
        assert!(q.begin_release());
        assert!(!q.begin_release(), "one release at a time");
        assert_eq!(drain(&mut q), ["a", "b", "c"]);
        assert!(
            !q.must_hold(false),
            "the release ended with the queue empty"
        );
    }

    #[test]
    fn a_denial_refuses_with_the_reason_it_waited_for() {
        let mut q = HoldQueue::default();
        q.push(held("a", waiting("ap-1")));
        let settled = q
            .settle("ap-1", |reason| {
                Gate::Refuse(Refusal::policy(format!("{reason}; denied")))
            })
            .expect("held");
        let Gate::Refuse(why) = &settled.gate else {
            panic!("refused: {:?}", settled.gate);
        };
        assert_eq!(why.evalue, "network access; denied");
        assert!(q.settle("ap-1", |_| Gate::Pass).is_none(), "answered once");
        assert!(q.settle("unknown", |_| Gate::Pass).is_none());
        assert_eq!(drain(&mut q), ["a"]);
    }

    #[test]
    fn an_interrupt_refuses_every_waiting_execution_and_keeps_the_others() {
        let mut q = HoldQueue::default();
        q.push(held("a", waiting("ap-1")));
        q.push(held("b", Gate::Pass));
        q.push(held("c", waiting("ap-2")));
        let cancelled: Vec<String> = q
            .cancel_waiting(|| Refusal {
                ename: "KeyboardInterrupt",
                evalue: "interrupted".into(),
            })
            .into_iter()
            .map(|(approval, _)| approval)
            .collect();
        assert_eq!(cancelled, ["ap-1", "ap-2"]);
        assert!(
            q.settle("ap-1", |_| Gate::Pass).is_none(),
            "no longer waiting"
        );
        let gates: Vec<bool> = std::iter::from_fn(|| q.next_ready())
            .map(|h| matches!(h.gate, Gate::Refuse(_)))
            .collect();
        assert_eq!(gates, [true, false, true]);
    }

    #[test]
    fn clearing_returns_the_open_approvals() {
        let mut q = HoldQueue::default();
        q.push(held("a", waiting("ap-1")));
        q.push(held("b", Gate::Pass));
        assert_eq!(q.clear(), ["ap-1"]);
        assert!(q.next_ready().is_none());
    }
}
