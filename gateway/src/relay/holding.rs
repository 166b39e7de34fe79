//! The execution policy's side of the relay: which client messages are screened, how an
//! execution an `ask` rule holds waits for its answer while the shell order is kept, and
//! how held, refused or cancelled executions are answered in the kernel's place.

use super::*;

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
        st: &mut State,
        key: &str,
        message: &Message,
        decision: Decision,
    ) -> Gate {
        match (decision, &self.guard) {
            (Decision::Deny(verdict), _) => {
                self.audit_decision(key, message, "deny", Some(&verdict), None, None);
                Gate::Refuse(Refusal::policy(describe(&verdict)))
            }
            (Decision::Ask(verdict), Some(guard)) => {
                let request: CodeRequest = message.content.parse().unwrap_or_default();
                let approval = guard.hold(self.clone(), key, &request.code, &verdict.reason);
                self.audit_decision(key, message, "ask", Some(&verdict), Some(&approval), None);
                let reason = describe(&verdict);
                let text = format!(
                    "[kernelgate] This code waits for an administrator's approval: {reason}. \
                     Approval id {approval}; it is denied if nobody answers within {} s. \
                     Interrupt the kernel to cancel it.\n",
                    guard.approval_timeout().as_secs()
                );
                for out in gate::awaiting(&message.header, &self.session, text) {
                    st.clients.route(out);
                }
                Gate::Waiting { approval, reason }
            }
            _ => Gate::Pass,
        }
    }

    /// Answers a refused execution in the kernel's place (its audit record first).
    pub(super) fn refuse(&self, st: &mut State, held: &Held, why: &Refusal) {
        let sha = held.code_sha256.clone();
        self.answer_in_place(st, &held.message.header, &held.key, sha, why);
    }

    /// Answers an execution that never reaches the kernel, as a failed cell.
    pub(super) fn answer_in_place(
        &self,
        st: &mut State,
        h: &Header,
        key: &str,
        code_sha256: Option<String>,
        why: &Refusal,
    ) {
        self.audit.record(&Record::ExecutionFinished {
            key: key.to_owned(),
            kernel: self.id.clone(),
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
        });
        for out in gate::refusal(h, &self.session, why) {
            st.clients.route(out);
        }
    }

    /// An administrator answered (or the timeout did) the approval `approval`; false if
    /// this kernel holds no such execution any more.
    pub(super) fn decide_held(self: &Arc<Self>, approval: &str, answer: Answer) -> bool {
        let timeout = self
            .guard
            .as_ref()
            .map_or(0, |g| g.approval_timeout().as_secs());
        let mut st = self.lock();
        let Some(held) = st
            .held
            .iter_mut()
            .find(|h| matches!(&h.gate, Gate::Waiting { approval: id, .. } if id == approval))
        else {
            return false;
        };
        let reason = match &held.gate {
            Gate::Waiting { reason, .. } => reason.clone(),
            _ => String::new(),
        };
        let (word, by) = match &answer {
            Answer::Approved { by } => {
                held.gate = Gate::Pass;
                ("approved", Some(by.as_str()))
            }
            Answer::Denied { by } => {
                held.gate = Gate::Refuse(Refusal::policy(format!(
                    "{reason}; an administrator ({by}) denied running it"
                )));
                ("denied", Some(by.as_str()))
            }
            Answer::TimedOut => {
                held.gate = Gate::Refuse(Refusal::policy(format!(
                    "{reason}; nobody approved it within {timeout} s"
                )));
                ("timed_out", None)
            }
        };
        self.audit_decision(&held.key, &held.message, word, None, Some(approval), by);
        self.start_release(&mut st);
        true
    }

    /// An interrupt cancels the executions waiting for approval: they never run.
    pub fn cancel_waiting(self: &Arc<Self>) {
        let Some(guard) = &self.guard else {
            return;
        };
        let mut st = self.lock();
        let mut cancelled = false;
        for held in st.held.iter_mut() {
            if let Gate::Waiting { approval, .. } = &held.gate {
                guard.forget(approval);
                self.audit_decision(
                    &held.key,
                    &held.message,
                    "cancelled",
                    None,
                    Some(approval),
                    None,
                );
                held.gate = Gate::Refuse(Refusal {
                    ename: "KeyboardInterrupt",
                    evalue: "interrupted while waiting for approval; the code never ran".into(),
                });
                cancelled = true;
            }
        }
        if cancelled {
            self.start_release(&mut st);
        }
    }

    pub(super) fn start_release(self: &Arc<Self>, st: &mut State) {
        if let (false, Some(guard)) = (st.releasing, &self.guard) {
            st.releasing = true;
            guard.tracker().spawn(self.clone().release());
        }
    }

    /// Sends (or answers) the held messages in order, until none is left or the next one
    /// still waits for approval.
    pub(super) async fn release(self: Arc<Self>) {
        loop {
            let (link, message) = {
                let mut st = self.lock();
                let ready = st
                    .held
                    .front()
                    .is_some_and(|h| !matches!(h.gate, Gate::Waiting { .. }));
                let next = if ready { st.held.pop_front() } else { None };
                let Some(held) = next else {
                    st.releasing = false;
                    return;
                };
                if let Gate::Refuse(why) = &held.gate {
                    self.refuse(&mut st, &held, why);
                    continue;
                }
                match self.route_to_kernel(
                    &mut st,
                    Channel::Shell,
                    held.message,
                    &held.key,
                    held.code_sha256,
                ) {
                    Ok(Some(sending)) => sending,
                    Ok(None) => continue,
                    Err(e) => {
                        tracing::warn!(kernel = %self.id, error = %e, "a held message was not sent");
                        continue;
                    }
                }
            };
            if let Err(e) = link.send(Channel::Shell, message).await {
                tracing::warn!(kernel = %self.id, error = %e, "a held message was not sent");
            }
        }
    }

    /// A `policy_decision` audit record.
    pub(super) fn audit_decision(
        &self,
        key: &str,
        message: &Message,
        decision: &str,
        verdict: Option<&kernelgate_policy::Verdict>,
        approval: Option<&str>,
        by: Option<&str>,
    ) {
        self.audit.record(&Record::PolicyDecision {
            sender: self.sender(key, message),
            msg_type: message.msg_type().to_owned(),
            decision: decision.to_owned(),
            rule: verdict.map(|v| v.rule),
            reason: verdict.map(|v| v.reason.clone()),
            matched: verdict.map(|v| v.matched.clone()),
            approval_id: approval.map(str::to_owned),
            by: by.map(str::to_owned),
        });
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

    fn decide(self: Arc<Self>, approval: &str, answer: Answer) -> bool {
        self.decide_held(approval, answer)
    }
}
