//! The execution policy's side of the relay: which client messages are screened, how an
//! execution an `ask` rule holds waits for its answer while the shell order is kept, and
//! how held, refused or cancelled executions are answered in the kernel's place.

use super::gate::{self, Gate, Refusal};
use super::requests::CodeRequest;
use super::{Effects, Relay, State, GATEWAY_KEY};
use crate::policy::{Answer, Holder};
use kernelgate_policy::Decision;
use kernelgate_protocol::{Channel, Message, MsgKind};
use std::sync::Arc;

/// The execution policy's side of the relay: what is checked, held, refused and released.
impl Relay {
    /// The policy's decision on a client message: only execute requests are checked, and
    /// never the gateway's own (warm-kernel set-up).
    pub(super) async fn screen(&self, key: &str, channel: Channel, message: &Message) -> Decision {
        let Some(guard) = &self.guard else {
            return Decision::Allow;
        };
        if channel != Channel::Shell
            || message.kind() != MsgKind::ExecuteRequest
            || key == GATEWAY_KEY
        {
            return Decision::Allow;
        }
        let request: CodeRequest = message.content.parse().unwrap_or_default();
        let expressions = request
            .user_expressions
            .values()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect();
        guard
            .check(self.scope.clone(), request.code, expressions)
            .await
    }

    /// What becomes of a message the policy decided on: for `ask`, an approval is opened
    /// and clients are told the execution waits.
    pub(super) fn gate(
        self: &Arc<Self>,
        fx: &mut Effects,
        key: &str,
        message: &Message,
        decision: Decision,
    ) -> Gate {
        match (decision, &self.guard) {
            (Decision::Deny(verdict), _) => {
                fx.audit(
                    self.trail
                        .decision(key, message, "deny", Some(&verdict), None, None),
                );
                Gate::Refuse(Refusal::policy(describe(&verdict)))
            }
            (Decision::Ask(verdict), Some(guard)) => {
                let request: CodeRequest = message.content.parse().unwrap_or_default();
                let approval = guard.hold(self.clone(), key, &request.code, &verdict.reason);
                fx.audit(self.trail.decision(
                    key,
                    message,
                    "ask",
                    Some(&verdict),
                    Some(&approval),
                    None,
                ));
                let reason = describe(&verdict);
                let text = format!(
                    "[kernelgate] This code waits for an administrator's approval: {reason}. \
                     Approval id {approval}; it is denied if nobody answers within {} s. \
                     Interrupt the kernel to cancel it.\n",
                    guard.approval_timeout().as_secs()
                );
                fx.to_clients
                    .extend(gate::awaiting(&message.header, &self.session, text));
                Gate::Waiting { approval, reason }
            }
            _ => Gate::Pass,
        }
    }

    /// An interrupt through the REST API: the executions waiting for approval are
    /// cancelled, their clients told (the kernel itself is signalled by the caller).
    pub async fn interrupted(self: &Arc<Self>) {
        let fx = {
            let mut st = self.lock();
            let mut fx = Effects::default();
            self.cancel_waiting(&mut st, &mut fx);
            fx
        };
        // Nothing goes to the kernel: this cannot fail.
        let _ = self.carry_out(fx).await;
    }

    /// An interrupt cancels the executions waiting for approval: they never run.
    pub(super) fn cancel_waiting(self: &Arc<Self>, st: &mut State, fx: &mut Effects) {
        let Some(guard) = &self.guard else {
            return;
        };
        let cancelled = st.holds.cancel_waiting(|| Refusal {
            ename: "KeyboardInterrupt",
            evalue: "interrupted while waiting for approval; the code never ran".into(),
        });
        if cancelled.is_empty() {
            return;
        }
        for (approval, held) in cancelled {
            guard.forget(&approval);
            let record = self.trail.decision(
                &held.key,
                &held.message,
                "cancelled",
                None,
                Some(&approval),
                None,
            );
            held.written = std::mem::take(&mut held.written).and(record.clone());
            fx.audit(record);
        }
        self.start_release(st);
    }

    pub(super) fn start_release(self: &Arc<Self>, st: &mut State) {
        if let Some(guard) = &self.guard {
            if st.holds.begin_release() {
                guard.tracker().spawn(self.clone().release());
            }
        }
    }

    /// Sends (or answers) the held messages in order, until none is left or the next one
    /// still waits for approval.
    pub(super) async fn release(self: Arc<Self>) {
        loop {
            let fx = {
                let mut st = self.lock();
                let Some(held) = st.holds.next_ready() else {
                    return;
                };
                let mut fx = Effects::default();
                fx.audit(held.written.clone());
                if let Gate::Refuse(why) = &held.gate {
                    fx.refuse(
                        &self,
                        &held.message.header,
                        &held.key,
                        held.code_sha256.clone(),
                        why,
                    );
                } else if let Err(e) = self.route_to_kernel(
                    &mut st,
                    &mut fx,
                    Channel::Shell,
                    held.message,
                    &held.key,
                    held.code_sha256,
                ) {
                    tracing::warn!(kernel = %self.id, error = %e, "a held message was not sent");
                }
                fx
            };
            if let Err(e) = self.carry_out(fx).await {
                tracing::warn!(kernel = %self.id, error = %e, "a held message was not sent");
            }
        }
    }
}

/// A verdict as people read it: the rule's reason and what matched.
pub(super) fn describe(verdict: &kernelgate_policy::Verdict) -> String {
    if verdict.rule == 0 {
        return verdict.reason.clone();
    }
    format!(
        "{} (rule {}: {})",
        verdict.reason, verdict.rule, verdict.matched
    )
}

impl Holder for Relay {
    fn kernel_id(&self) -> &str {
        &self.id
    }

    /// An administrator answered (or the timeout did) the approval `approval`; false if
    /// this kernel holds no such execution any more.
    fn decide(self: Arc<Self>, approval: &str, answer: Answer) -> bool {
        let timeout = self
            .guard
            .as_ref()
            .map_or(0, |g| g.approval_timeout().as_secs());
        let (word, by) = match &answer {
            Answer::Approved { by } => ("approved", Some(by.as_str())),
            Answer::Denied { by } => ("denied", Some(by.as_str())),
            Answer::TimedOut => ("timed_out", None),
        };
        let mut st = self.lock();
        let settled = st.holds.settle(approval, |reason| match &answer {
            Answer::Approved { .. } => Gate::Pass,
            Answer::Denied { by } => Gate::Refuse(Refusal::policy(format!(
                "{reason}; an administrator ({by}) denied running it"
            ))),
            Answer::TimedOut => Gate::Refuse(Refusal::policy(format!(
                "{reason}; nobody approved it within {timeout} s"
            ))),
        });
        let Some(held) = settled else {
            return false;
        };
        let decided = self
            .trail
            .decision(&held.key, &held.message, word, None, Some(approval), by);
        held.written = std::mem::take(&mut held.written).and(decided);
        self.start_release(&mut st);
        true
    }
}
