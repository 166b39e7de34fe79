//! The relay's side of the lifecycle ([`super::lifecycle`]): an event is decided under
//! the kernel's lock and what it answers is carried out: executions a gone process owed
//! answered in its place with the cause, those waiting for a process refused or sent to
//! it, statuses announced, links closed, a pending wake spent.

use super::clients::Outbound;
use super::gate::{self, Refusal};
use super::lifecycle::{Action, Event, Work};
use super::link::Link;
use super::{Effects, KernelError, Relay, State};
use kernelgate_protocol::content::ExecutionState;
use kernelgate_protocol::{Channel, Message, MsgKind, RawJson};
use std::future::Future;
use std::sync::Arc;

impl Relay {
    /// Moves the kernel on by `event` (docs/architecture.md, "Kernel lifecycle"). What the
    /// event changes is done when this is called: the phase, links closed, what waits
    /// taken. The future carries out the rest (answers once their audit records are in the
    /// file, what waited sent to the process) and says whether the event applied; a caller
    /// that cannot wait (nothing to answer or send) may drop it.
    ///
    /// A process that is gone ([`Event::Lost`]) had its unanswered executions answered in
    /// its place, as failed cells whose error names the cause, each with an
    /// `execution_finished` record. Announce `restarting` or `dead` only after those
    /// answers: JupyterLab forgets a cell's request when it sees either.
    pub fn step(&self, event: Event) -> impl Future<Output = Result<(), KernelError>> + '_ {
        let mut fx = {
            let mut st = self.lock();
            let work = st.work();
            let actions = st.life.on(event, work);
            st.apply(actions, self)
        };
        for link in std::mem::take(&mut fx.close) {
            link.close();
        }
        self.carry_out(fx)
    }
}

impl State {
    /// The work around the phase that an event depends on.
    pub(super) fn work(&self) -> Work {
        Work {
            client_sends: self.client_sends,
            pending: self.executions.in_flight()
                || self.holds.must_hold(false)
                || !self.backlog.is_empty(),
        }
    }

    /// Turns what the lifecycle answered into what [`Relay::carry_out`] does.
    pub(super) fn apply(&mut self, actions: Vec<Action<Arc<Link>>>, relay: &Relay) -> Effects {
        let mut fx = Effects::default();
        for action in actions {
            match action {
                Action::Close(link) => fx.close.push(link),
                Action::AnswerLost { ename, cause } => {
                    self.answer_lost(&mut fx, relay, ename, &cause)
                }
                Action::RefuseWaiting(why) => {
                    let refusal = Refusal {
                        ename: "KernelUnavailable",
                        evalue: why,
                    };
                    for (channel, message) in std::mem::take(&mut self.backlog) {
                        if channel == Channel::Shell && message.kind() == MsgKind::ExecuteRequest {
                            fx.refuse(relay, &message.header, "", None, &refusal);
                        }
                    }
                }
                Action::DropWaiting => self.backlog.clear(),
                Action::SendWaiting(link) => {
                    // Their execute requests are followed from here on.
                    let waiting = std::mem::take(&mut self.backlog);
                    for (_, message) in &waiting {
                        if message.kind() == MsgKind::ExecuteRequest {
                            self.executions.sent(&message.header);
                        }
                    }
                    fx.waiting = Some((link, waiting));
                }
                Action::Announce(state) => fx.to_clients.push(status(relay, state)),
                Action::SpendWake => fx.spend_wake = true,
                Action::Fail(failure) => fx.failed = Some(failure),
            }
        }
        fx
    }

    /// Answers every execution the gone process owed: the one running lost its variables
    /// while running, those queued behind it before they ran.
    fn answer_lost(&mut self, fx: &mut Effects, relay: &Relay, ename: &'static str, cause: &str) {
        for (i, (header, finished)) in self.executions.lost().into_iter().enumerate() {
            let evalue = if i == 0 {
                format!("{cause} while running this code; its variables are lost")
            } else {
                format!("{cause} before this code ran; its variables are lost")
            };
            let why = Refusal { ename, evalue };
            fx.audit(relay.trail.lost(&header, finished, &why, i == 0));
            fx.to_clients
                .extend(gate::refusal(&header, &relay.session, &why));
        }
    }
}

/// The gateway's own IOPub `status` for clients, with no parent.
fn status(relay: &Relay, state: ExecutionState) -> Arc<Outbound> {
    let content = RawJson::from_value(&serde_json::json!({"execution_state": state.as_str()}));
    let message: Message = relay.request("status", content);
    Outbound::new(Channel::IoPub, message)
}
