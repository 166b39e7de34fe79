//! A kernel's lifecycle as a state machine without I/O: the [`Phase`] it is in, and for
//! every [`Event`] (a process linked or lost, a restart, a hibernation's steps, a death
//! for good) the [`Action`]s to carry out. The relay holds one [`Lifecycle`] under its
//! lock and carries out what it answers: answers in the kernel's place, status messages,
//! sends of what waited, links closed. Whether a message may reach the kernel now is
//! [`Lifecycle::route`], one `match` on the phase.
//!
//! `L` is the link to a process (the relay's `Arc<Link>`; `()` in the tests). A phase
//! that has a process linked holds its link, and only those do: the link is taken out
//! of the lifecycle, to be closed, when the phase ends.

use kernelgate_protocol::content::ExecutionState;

/// Where a kernel is in its life. Phases with a process linked: [`Phase::Running`],
/// [`Phase::Hibernating`], [`Phase::Loading`].
///
/// Room for what comes next: a checkpoint (`Checkpointing`: linked, messages wait as in
/// [`Phase::Hibernating`], back to [`Phase::Running`] when written, or on to
/// [`Phase::Hibernated`]), a restore (`Restoring`: as [`Phase::Waking`], the process comes
/// back with its memory) and a fork (`Forking`: [`Phase::Running`] while a copy is
/// made) are phases here, with their events and rows in [`Lifecycle::on`] and
/// [`Lifecycle::route`], and need no field elsewhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// A new kernel whose first process is not linked yet: messages wait for it.
    Starting,
    /// A process is linked: messages go to it. The state is what it last reported
    /// (`starting` or `restarting` until it answers `kernel_info`, then `idle`/`busy`).
    Running(ExecutionState),
    /// The process is gone and the next one comes (a death, a restart): messages wait.
    Restarting,
    /// The state is saved and the kernel sealed while the hibernation commits it; the
    /// process is still linked (calling it off resumes it) but messages wait, and wake it.
    Hibernating,
    /// The state is on disk, no process: messages wait, and wake it.
    Hibernated,
    /// A hibernated kernel's new process starts, its saved variables to load once it
    /// runs: messages wait (without waking anything again).
    Waking,
    /// The new process of a waking kernel is linked and its variables load: the
    /// gateway's own messages go to it, clients' wait until the load answered.
    Loading(ExecutionState),
    /// Dead: with why and what brings it back when it could not be brought back (a
    /// restart can), or `None` when it was deleted or let go of.
    Dead(Option<String>),
}

impl Phase {
    /// The state clients are told (REST model, metrics); a hibernated kernel is `idle`.
    pub fn execution_state(&self) -> ExecutionState {
        match self {
            Phase::Starting => ExecutionState::Starting,
            Phase::Running(state) | Phase::Loading(state) => *state,
            Phase::Restarting => ExecutionState::Restarting,
            Phase::Hibernating | Phase::Hibernated | Phase::Waking => ExecutionState::Idle,
            Phase::Dead(_) => ExecutionState::Dead,
        }
    }

    /// Whether the kernel hibernates: its state saved (or being committed), no process
    /// serving it. The one answer the table, its model and the registry read.
    pub fn is_hibernated(&self) -> bool {
        matches!(self, Phase::Hibernating | Phase::Hibernated | Phase::Waking)
    }

    /// Whether its hibernation is complete: the state committed and the process gone
    /// (or a new one coming up). What the kernel's model calls `hibernated`; a kernel
    /// still sealing its state is not yet.
    pub fn is_at_rest(&self) -> bool {
        matches!(self, Phase::Hibernated | Phase::Waking)
    }

    /// Whether it is dead for good (until a restart brings it back).
    pub fn is_dead(&self) -> bool {
        matches!(self, Phase::Dead(Some(_)))
    }

    /// Whether a process is linked in this phase.
    fn linked(&self) -> bool {
        matches!(
            self,
            Phase::Running(_) | Phase::Hibernating | Phase::Loading(_)
        )
    }
}

/// What happens to a kernel (from outside the relay, and from its own link).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The process answered `kernel_info`: it is ready.
    Ready,
    /// The process reported its state on IOPub.
    Reported(ExecutionState),
    /// The process is gone (`ename` and `cause` say how, e.g. "the kernel ran out of
    /// memory"): what it owed is answered in its place. With `announce`, clients are told
    /// `restarting` right after those answers (a death that a restart follows).
    Lost {
        ename: &'static str,
        cause: String,
        announce: bool,
    },
    /// A restart begins: the link goes, messages wait for the next process. Clients are
    /// not told (a restart asked for; a death announced it with [`Event::Lost`]).
    Restart,
    /// It could not be brought back: dead for good with `why`; what waited is answered
    /// with it, and so is every later execution.
    GaveUp(String),
    /// It is deleted (or the gateway shuts down): dead, clients told, what waited dropped.
    Deleted,
    /// The link to the current process is dropped without an answer for anyone: a connect
    /// cut short, a process let go of. The phase steps back to the one before the link.
    Unlinked,
    /// A hibernation saved the state: sealed, if clients sent nothing since `since` (the
    /// count of their messages then) and nothing runs or waits.
    Seal { since: u64 },
    /// The hibernation is called off: what waited goes to the still-running process.
    Unseal,
    /// The state is committed and the process removed (or a kernel found on disk at
    /// start, or one whose wake failed).
    Hibernated,
    /// A wake begins whose process gets the saved variables to load.
    Wake,
    /// The variables loaded: what clients sent meanwhile goes to the kernel.
    Loaded,
    /// They did not load (`why`): it hibernates again, what waited is answered with why.
    LoadFailed(String),
    /// A wake failed before a process ran (`why`): what waited is answered; the phase
    /// stays.
    WakeFailed(String),
}

impl Event {
    /// [`Event::Lost`]: the process is gone, `cause` says how.
    pub fn lost(ename: &'static str, cause: &str, announce: bool) -> Event {
        Event::Lost {
            ename,
            cause: cause.to_owned(),
            announce,
        }
    }
}

/// What the relay knows of the work around the phase, as far as an event depends on it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Work {
    /// Messages clients (not the gateway) sent so far.
    pub client_sends: u64,
    /// Executions in flight, held by the policy, or waiting for a process.
    pub pending: bool,
}

/// One thing to carry out, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action<L> {
    /// Close this link: its process is gone or no longer served.
    Close(L),
    /// Answer the executions the gone process owed, in its place (`ename`, `cause`).
    AnswerLost { ename: &'static str, cause: String },
    /// Answer the executions that wait for a process with `KernelUnavailable: why`
    /// (they never run), and empty the queue.
    RefuseWaiting(String),
    /// Empty the queue of waiting messages, unanswered.
    DropWaiting,
    /// Send what waits to this link, in order.
    SendWaiting(L),
    /// Tell every client this state (IOPub `status`, which the kernel cannot send).
    Announce(ExecutionState),
    /// Forget that a waiting message asked to wake the kernel: it is awake, or what
    /// waited was answered.
    SpendWake,
    /// The event does not apply in this phase; the caller hears this.
    Fail(Failure),
}

/// Why an event did not apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Something runs or waits, or clients sent work: it cannot be sealed.
    Busy,
    /// No process is linked to hand what waited to.
    Gone,
}

/// Where a message for the kernel goes now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route<L> {
    /// To the linked process.
    Send(L),
    /// Into the queue for the next process; `wake` when it wakes a hibernated kernel.
    Queue { wake: bool },
    /// Nowhere: the kernel is dead (with why, when it died for good) or the queue full.
    Refuse(Option<String>),
}

/// A kernel's phase, and the link of the process serving it when one is linked.
#[derive(Debug)]
pub struct Lifecycle<L> {
    phase: Phase,
    link: Option<L>,
}

impl<L> Default for Lifecycle<L> {
    fn default() -> Self {
        Lifecycle {
            phase: Phase::Starting,
            link: None,
        }
    }
}

impl<L: Clone> Lifecycle<L> {
    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// Where a message goes: `gateway` when the gateway itself sends it (readiness
    /// checks, a state's load), `full` when the queue holds all it may.
    pub fn route(&self, gateway: bool, full: bool) -> Route<L> {
        let wake = match (&self.phase, &self.link) {
            (Phase::Running(_), Some(link)) => return Route::Send(link.clone()),
            (Phase::Loading(_), Some(link)) if gateway => return Route::Send(link.clone()),
            (Phase::Dead(why), _) => return Route::Refuse(why.clone()),
            (Phase::Hibernating | Phase::Hibernated, _) => true,
            (
                Phase::Starting
                | Phase::Restarting
                | Phase::Waking
                | Phase::Loading(_)
                | Phase::Running(_),
                _,
            ) => false,
        };
        if full {
            return Route::Refuse(None);
        }
        Route::Queue { wake }
    }

    /// A new process is linked (`link`); a previous link is closed. What waited goes to
    /// it, unless the kernel's saved variables load first.
    pub fn connected(&mut self, link: L) -> Vec<Action<L>> {
        let mut actions: Vec<Action<L>> = self.link.take().map(Action::Close).into_iter().collect();
        let (next, woke) = match &self.phase {
            Phase::Starting => (Phase::Running(ExecutionState::Starting), false),
            Phase::Running(state) => (Phase::Running(*state), false),
            Phase::Loading(state) => (Phase::Loading(*state), false),
            Phase::Waking => (Phase::Loading(ExecutionState::Restarting), true),
            Phase::Hibernating | Phase::Hibernated => {
                (Phase::Running(ExecutionState::Restarting), true)
            }
            Phase::Restarting | Phase::Dead(_) => {
                (Phase::Running(ExecutionState::Restarting), false)
            }
        };
        if woke {
            actions.push(Action::SpendWake);
        }
        if matches!(next, Phase::Running(_)) {
            actions.push(Action::SendWaiting(link.clone()));
        }
        self.phase = next;
        self.link = Some(link);
        actions
    }

    /// Answers `event` with what to carry out; `work` is what the relay holds besides.
    pub fn on(&mut self, event: Event, work: Work) -> Vec<Action<L>> {
        use Phase::*;
        let mut actions = Vec::new();
        let next = match (event, &self.phase) {
            (Event::Ready, Running(_)) => Running(ExecutionState::Idle),
            (Event::Ready, Loading(_)) => Loading(ExecutionState::Idle),
            (Event::Reported(state), Running(_)) => Running(state),
            (Event::Reported(state), Loading(_)) => Loading(state),
            (Event::Ready | Event::Reported(_), _) => return actions,
            (
                Event::Lost {
                    ename,
                    cause,
                    announce,
                },
                phase,
            ) => {
                actions.push(Action::AnswerLost { ename, cause });
                if announce {
                    actions.push(Action::Announce(ExecutionState::Restarting));
                }
                match phase {
                    Dead(why) => Dead(why.clone()),
                    Hibernating | Hibernated => Hibernated,
                    Waking | Loading(_) => Waking,
                    Starting | Running(_) | Restarting => Restarting,
                }
            }
            (Event::Restart, _) => Restarting,
            (Event::GaveUp(why), _) => {
                actions.push(Action::RefuseWaiting(why.clone()));
                actions.push(Action::Announce(ExecutionState::Dead));
                Dead(Some(why))
            }
            (Event::Deleted, _) => {
                actions.push(Action::DropWaiting);
                actions.push(Action::Announce(ExecutionState::Dead));
                Dead(None)
            }
            (Event::Unlinked, phase) => match phase {
                Running(ExecutionState::Starting) => Starting,
                Running(_) => Restarting,
                Loading(_) => Waking,
                Hibernating => Hibernated,
                other => other.clone(),
            },
            (Event::Seal { since }, Running(_)) if work.client_sends == since && !work.pending => {
                // The link stays, for an unseal.
                self.phase = Hibernating;
                return actions;
            }
            (Event::Seal { .. }, _) => return vec![Action::Fail(Failure::Busy)],
            (Event::Unseal, Hibernating) => {
                self.phase = Running(ExecutionState::Idle);
                return self.send_waiting_or_fail(vec![Action::SpendWake]);
            }
            (Event::Loaded, Loading(state)) => {
                self.phase = Running(*state);
                return self.send_waiting_or_fail(actions);
            }
            (Event::Unseal | Event::Loaded, _) => return vec![Action::Fail(Failure::Gone)],
            (Event::Hibernated, Dead(why)) => Dead(why.clone()),
            (Event::Hibernated, _) => Hibernated,
            (Event::Wake, Hibernating | Hibernated) => Waking,
            (Event::Wake, _) => return actions,
            (Event::LoadFailed(why), phase) => {
                actions.push(Action::RefuseWaiting(why));
                actions.push(Action::SpendWake);
                match phase {
                    Dead(why) => Dead(why.clone()),
                    _ => Hibernated,
                }
            }
            (Event::WakeFailed(why), _) => {
                return vec![Action::RefuseWaiting(why), Action::SpendWake];
            }
        };
        if !next.linked() {
            if let Some(link) = self.link.take() {
                actions.insert(0, Action::Close(link));
            }
        }
        self.phase = next;
        actions
    }

    /// What waited goes to the link, or the caller hears there is none.
    fn send_waiting_or_fail(&self, mut actions: Vec<Action<L>>) -> Vec<Action<L>> {
        match &self.link {
            Some(link) => actions.push(Action::SendWaiting(link.clone())),
            None => actions.push(Action::Fail(Failure::Gone)),
        }
        actions
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ExecutionState::{Busy, Idle};

    /// A link the tests can tell apart: the process it was made for.
    type Link = u32;

    /// Every phase, each with its link when it has one (link 7).
    fn phases() -> Vec<Phase> {
        vec![
            Phase::Starting,
            Phase::Running(ExecutionState::Starting),
            Phase::Running(Idle),
            Phase::Running(Busy),
            Phase::Restarting,
            Phase::Hibernating,
            Phase::Hibernated,
            Phase::Waking,
            Phase::Loading(Idle),
            Phase::Dead(None),
            Phase::Dead(Some("gone".into())),
        ]
    }

    fn at(phase: &Phase) -> Lifecycle<Link> {
        Lifecycle {
            phase: phase.clone(),
            link: phase.linked().then_some(7),
        }
    }

    fn lost(announce: bool) -> Event {
        Event::Lost {
            ename: "KernelDied",
            cause: "oom".into(),
            announce,
        }
    }

    fn events() -> Vec<Event> {
        vec![
            Event::Ready,
            Event::Reported(Busy),
            lost(false),
            lost(true),
            Event::Restart,
            Event::GaveUp("why".into()),
            Event::Deleted,
            Event::Unlinked,
            Event::Seal { since: 3 },
            Event::Unseal,
            Event::Hibernated,
            Event::Wake,
            Event::Loaded,
            Event::LoadFailed("no load".into()),
            Event::WakeFailed("no wake".into()),
        ]
    }

    /// The phase each event leads to from each phase, and what it asks to carry out.
    fn expected(phase: &Phase, event: &Event) -> (Phase, Vec<Action<Link>>) {
        use Action::*;
        use Phase::*;
        let same = phase.clone();
        let close = || phase.linked().then_some(Close(7)).into_iter();
        let dead_or = |p: Phase| match phase {
            Dead(why) => Dead(why.clone()),
            _ => p,
        };
        match event {
            Event::Ready => match phase {
                Running(_) => (Running(Idle), vec![]),
                Loading(_) => (Loading(Idle), vec![]),
                _ => (same, vec![]),
            },
            Event::Reported(s) => match phase {
                Running(_) => (Running(*s), vec![]),
                Loading(_) => (Loading(*s), vec![]),
                _ => (same, vec![]),
            },
            Event::Lost { announce, .. } => {
                let mut actions: Vec<_> = close().collect();
                actions.push(AnswerLost {
                    ename: "KernelDied",
                    cause: "oom".into(),
                });
                if *announce {
                    actions.push(Announce(ExecutionState::Restarting));
                }
                let next = match phase {
                    Hibernating | Hibernated => Hibernated,
                    Waking | Loading(_) => Waking,
                    _ => dead_or(Restarting),
                };
                (next, actions)
            }
            Event::Restart => (Restarting, close().collect()),
            Event::GaveUp(why) => (
                Dead(Some(why.clone())),
                close()
                    .chain([RefuseWaiting(why.clone()), Announce(ExecutionState::Dead)])
                    .collect(),
            ),
            Event::Deleted => (
                Dead(None),
                close()
                    .chain([DropWaiting, Announce(ExecutionState::Dead)])
                    .collect(),
            ),
            Event::Unlinked => {
                let next = match phase {
                    Running(ExecutionState::Starting) => Starting,
                    Running(_) => Restarting,
                    Loading(_) => Waking,
                    Hibernating => Hibernated,
                    other => other.clone(),
                };
                (next, close().collect())
            }
            Event::Seal { .. } => match phase {
                // The work given: nothing pending, 3 client messages (as sealed with).
                Running(_) => (Hibernating, vec![]),
                _ => (same, vec![Fail(Failure::Busy)]),
            },
            Event::Unseal => match phase {
                Hibernating => (Running(Idle), vec![SpendWake, SendWaiting(7)]),
                _ => (same, vec![Fail(Failure::Gone)]),
            },
            Event::Hibernated => (dead_or(Hibernated), close().collect()),
            Event::Wake => match phase {
                Hibernating => (Waking, vec![Close(7)]),
                Hibernated => (Waking, vec![]),
                _ => (same, vec![]),
            },
            Event::Loaded => match phase {
                Loading(s) => (Running(*s), vec![SendWaiting(7)]),
                _ => (same, vec![Fail(Failure::Gone)]),
            },
            Event::LoadFailed(why) => (
                dead_or(Hibernated),
                close()
                    .chain([RefuseWaiting(why.clone()), SpendWake])
                    .collect(),
            ),
            Event::WakeFailed(why) => (same, vec![RefuseWaiting(why.clone()), SpendWake]),
        }
    }

    #[test]
    fn every_phase_answers_every_event() {
        let work = Work {
            client_sends: 3,
            pending: false,
        };
        for phase in phases() {
            for event in events() {
                let mut life = at(&phase);
                let actions = life.on(event.clone(), work);
                let (next, want) = expected(&phase, &event);
                assert_eq!(
                    (life.phase(), &actions),
                    (&next, &want),
                    "{phase:?} on {event:?}"
                );
                assert_eq!(
                    life.link.is_some(),
                    next.linked(),
                    "{phase:?} on {event:?}: a link exactly in the linked phases"
                );
            }
        }
    }

    #[test]
    fn a_hibernation_is_sealed_only_when_nothing_came_in_or_waits() {
        let running = || at(&Phase::Running(Idle));
        let busy = vec![Action::Fail(Failure::Busy)];
        let sent_since = Work {
            client_sends: 4,
            pending: false,
        };
        assert_eq!(running().on(Event::Seal { since: 3 }, sent_since), busy);
        let pending = Work {
            client_sends: 3,
            pending: true,
        };
        assert_eq!(running().on(Event::Seal { since: 3 }, pending), busy);
    }

    #[test]
    fn a_new_link_takes_what_waited_unless_variables_load_first() {
        use Action::*;
        use Phase::*;
        for (phase, next, actions) in [
            (
                Starting,
                Running(ExecutionState::Starting),
                vec![SendWaiting(8)],
            ),
            (Running(Busy), Running(Busy), vec![Close(7), SendWaiting(8)]),
            (
                Restarting,
                Running(ExecutionState::Restarting),
                vec![SendWaiting(8)],
            ),
            (
                Hibernating,
                Running(ExecutionState::Restarting),
                vec![Close(7), SpendWake, SendWaiting(8)],
            ),
            (
                Hibernated,
                Running(ExecutionState::Restarting),
                vec![SpendWake, SendWaiting(8)],
            ),
            (Waking, Loading(ExecutionState::Restarting), vec![SpendWake]),
            (Loading(Busy), Loading(Busy), vec![Close(7)]),
            (
                Dead(Some("x".into())),
                Running(ExecutionState::Restarting),
                vec![SendWaiting(8)],
            ),
        ] {
            let mut life = at(&phase);
            assert_eq!(life.connected(8), actions, "{phase:?}");
            assert_eq!(life.phase(), &next, "{phase:?}");
            assert_eq!(life.link, Some(8));
        }
    }

    /// Whether a message may reach the kernel now: the whole table.
    #[test]
    fn messages_go_to_the_process_wait_or_are_refused_by_phase() {
        use Route::*;
        for phase in phases() {
            let life = at(&phase);
            for gateway in [false, true] {
                let want = match &phase {
                    Phase::Running(_) => Send(7),
                    Phase::Loading(_) if gateway => Send(7),
                    Phase::Dead(why) => Refuse(why.clone()),
                    Phase::Hibernating | Phase::Hibernated => Queue { wake: true },
                    _ => Queue { wake: false },
                };
                assert_eq!(life.route(gateway, false), want, "{phase:?} {gateway}");
                let full = match want {
                    Queue { .. } => Refuse(None),
                    other => other,
                };
                assert_eq!(life.route(gateway, true), full, "{phase:?} {gateway} full");
            }
        }
    }

    #[test]
    fn clients_see_idle_while_it_hibernates_and_the_process_state_while_it_runs() {
        use ExecutionState as S;
        let seen: Vec<(Phase, S, bool)> = phases()
            .into_iter()
            .map(|p| (p.clone(), p.execution_state(), p.is_hibernated()))
            .collect();
        let want = [
            (S::Starting, false),
            (S::Starting, false),
            (S::Idle, false),
            (S::Busy, false),
            (S::Restarting, false),
            (S::Idle, true),
            (S::Idle, true),
            (S::Idle, true),
            (S::Idle, false),
            (S::Dead, false),
            (S::Dead, false),
        ];
        for ((phase, state, hibernated), (s, h)) in seen.iter().zip(want) {
            assert_eq!((*state, *hibernated), (s, h), "{phase:?}");
        }
        assert!(Phase::Dead(Some("x".into())).is_dead() && !Phase::Dead(None).is_dead());
    }

    /// A hibernation and a wake from start to end, as the relay drives them.
    #[test]
    fn a_kernel_hibernates_and_wakes_with_its_variables() {
        let mut life = Lifecycle::<Link>::default();
        life.connected(1);
        life.on(Event::Ready, Work::default());
        assert!(life
            .on(Event::Seal { since: 0 }, Work::default())
            .is_empty());
        assert_eq!(life.route(false, false), Route::Queue { wake: true });
        assert_eq!(
            life.on(Event::Hibernated, Work::default()),
            vec![Action::Close(1)]
        );
        life.on(Event::Wake, Work::default());
        assert_eq!(life.route(false, false), Route::Queue { wake: false });
        assert_eq!(life.connected(2), vec![Action::SpendWake]);
        life.on(Event::Ready, Work::default());
        assert_eq!(life.route(true, false), Route::Send(2));
        assert_eq!(life.route(false, false), Route::Queue { wake: false });
        assert_eq!(
            life.on(Event::Loaded, Work::default()),
            vec![Action::SendWaiting(2)]
        );
        assert_eq!(life.phase(), &Phase::Running(Idle));
    }
}
