//! A hibernating kernel's messaging side: sealed once its state is saved (client messages
//! wait in the backlog from then on and wake it), unsealed when the hibernation is called
//! off, and woken by the first client message.

use super::*;
use std::future::Future;

impl Relay {
    /// Messages clients have sent so far: a hibernation compares the count before and
    /// after saving, so work sent meanwhile calls it off.
    pub fn client_sends(&self) -> u64 {
        self.lock().client_sends
    }

    /// Whether nothing runs or waits: no execution in flight, none held by the policy.
    pub fn quiet(&self) -> bool {
        let st = self.lock();
        st.in_flight.is_empty()
            && !st.holds.must_hold(false)
            && st.backlog.is_empty()
            && st.execution_state == ExecutionState::Idle
    }

    /// Seals the kernel for hibernation if clients sent nothing since `since` and nothing
    /// runs: from now on their messages wait in the backlog (and wake it). The link stays
    /// until [`Relay::disconnect`], for [`Relay::unseal`].
    pub fn seal(&self, since: u64) -> bool {
        let mut st = self.lock();
        let quiet = st.client_sends == since
            && st.in_flight.is_empty()
            && !st.holds.must_hold(false)
            && st.backlog.is_empty();
        if quiet {
            st.hibernated = true;
            st.execution_state = ExecutionState::Restarting;
        }
        quiet
    }

    /// Calls a hibernation off: messages that waited meanwhile go to the still-running
    /// process, in order.
    pub async fn unseal(&self) -> Result<(), KernelError> {
        let (link, backlog) = {
            let mut st = self.lock();
            st.hibernated = false;
            st.execution_state = ExecutionState::Idle;
            (st.link.clone(), take_backlog(&mut st))
        };
        // The permit a waiting message left is spent: the kernel is awake.
        self.wake_consumed();
        let Some(link) = link else {
            return Err(KernelError::KernelGone);
        };
        self.send_backlog(&link, backlog).await
    }

    /// Marks a kernel with no process as hibernated (one found on disk at start).
    pub fn set_hibernated(&self) {
        let mut st = self.lock();
        st.hibernated = true;
        st.execution_state = ExecutionState::Restarting;
    }

    pub fn is_hibernated(&self) -> bool {
        self.lock().hibernated
    }

    /// Resolves when a client message reached the hibernated kernel (at once if one did
    /// since the last call).
    pub async fn woken(&self) {
        self.wake.notified().await;
    }

    fn wake_consumed(&self) {
        // A stored permit resolves the next `notified` at once; spend it.
        let spent = self.wake.notified();
        tokio::pin!(spent);
        let waker = futures::task::noop_waker();
        let _ = spent
            .as_mut()
            .poll(&mut std::task::Context::from_waker(&waker));
    }

    /// Puts a message of the gateway's own (`session`, attached with [`Relay::attach`])
    /// in front of the backlog: the first thing the next process gets, before what
    /// clients sent meanwhile.
    pub fn send_first(&self, session: &str, channel: Channel, message: Message) {
        let mut st = self.lock();
        st.clients.note_request(message.msg_id(), session);
        st.backlog.insert(0, (channel, message));
    }

    /// A resumed kernel's state is about to load: from the next connect until
    /// [`Relay::loaded`] or [`Relay::load_failed`], client messages wait in the backlog.
    pub fn hold_for_load(&self) {
        self.lock().loading = true;
    }

    /// The state loaded: what clients sent meanwhile goes to the kernel, in order.
    pub async fn loaded(&self) -> Result<(), KernelError> {
        let (link, backlog) = {
            let mut st = self.lock();
            st.loading = false;
            (st.link.clone(), take_backlog(&mut st))
        };
        match link {
            Some(link) => self.send_backlog(&link, backlog).await,
            None => Err(KernelError::KernelGone),
        }
    }

    /// The state did not load: the kernel hibernates again (its state kept) and the
    /// executions that waited are answered with `why`.
    pub async fn load_failed(&self, why: String) {
        {
            let mut st = self.lock();
            st.loading = false;
            st.hibernated = true;
            st.execution_state = ExecutionState::Restarting;
        }
        self.disconnect();
        self.refuse_waiting(why).await;
    }

    /// A resume failed: executions that waited for it are answered in the kernel's
    /// place with `why`; the kernel stays hibernated for the next try.
    pub async fn refuse_waiting(&self, why: String) {
        let mut fx = Effects::default();
        {
            let refusal = Refusal {
                ename: "KernelUnavailable",
                evalue: why,
            };
            self.refuse_backlog(&mut self.lock(), &mut fx, &refusal);
        }
        self.wake_consumed();
        let _ = self.carry_out(fx).await;
    }
}
