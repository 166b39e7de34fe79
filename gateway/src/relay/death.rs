//! A kernel whose process is gone: the executions it owed an answer are answered in its
//! place with the cause, and a kernel that could not be brought back says so to every
//! later request.

use super::*;

impl Relay {
    /// The kernel's process is gone (`cause` says how, e.g. "the kernel ran out of memory
    /// (limit 1024 MiB)"): every execution sent to it and not answered is answered in its
    /// place, as a failed cell whose error names the cause, with an `execution_finished`
    /// audit record. Call before clients are told `restarting` or `dead`: JupyterLab
    /// forgets a cell's request when it sees either.
    ///
    /// In the same step the link to the gone process is dropped and the state becomes
    /// `restarting` without telling clients, so a message that comes in from now on waits
    /// for the next process (or for the refusal of a kernel that stays dead) instead of
    /// being written to a socket nobody reads, where its execution would never be answered.
    pub async fn lost_executions(&self, ename: &'static str, cause: &str) {
        self.answer_lost_then(ename, cause, None).await;
    }

    /// The kernel's process died and a restart follows: the executions it owed are answered
    /// as [`Self::lost_executions`] does, and clients are told `restarting` right after
    /// those answers, in the same step. A request sent once its answer arrived (an agent
    /// retrying at once) then waits for the next process without seeing that status, which
    /// would tell it that its own code was lost.
    pub async fn lost_to_death(&self, cause: &str) {
        self.answer_lost_then("KernelDied", cause, Some(ExecutionState::Restarting))
            .await;
    }

    /// Answers the lost executions, closes the gone process's link and, when `announce`
    /// is given, tells clients that state right after the answers.
    async fn answer_lost_then(
        &self,
        ename: &'static str,
        cause: &str,
        announce: Option<ExecutionState>,
    ) {
        let (mut fx, link) = self.answer_lost(ename, cause);
        if let Some(state) = announce {
            fx.to_clients.push(self.status_message(state));
        }
        if let Some(link) = link {
            link.close();
        }
        // Nothing goes to the kernel: this cannot fail.
        let _ = self.carry_out(fx).await;
    }

    /// The answers to the executions the process owed, and its link, taken under the lock.
    fn answer_lost(&self, ename: &'static str, cause: &str) -> (Effects, Option<Arc<Link>>) {
        let mut fx = Effects::default();
        let mut st = self.lock();
        let link = st.link.take();
        if st.execution_state != ExecutionState::Dead {
            st.execution_state = ExecutionState::Restarting;
        }
        let lost: Vec<Header> = st.in_flight.drain(..).collect();
        for (i, header) in lost.iter().enumerate() {
            let evalue = if i == 0 {
                format!("{cause} while running this code; its variables are lost")
            } else {
                format!("{cause} before this code ran; its variables are lost")
            };
            let why = Refusal { ename, evalue };
            let finished = st.executions.replied(&header.msg_id);
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
            fx.audit(self.audit.record(&Record::ExecutionFinished {
                key,
                kernel: self.id.clone(),
                msg_id: Some(header.msg_id.clone()),
                session: Some(header.session.clone()),
                code_sha256: (!sha.is_empty()).then_some(sha),
                status: "error".into(),
                ename: Some(ename.to_string()),
                reason: Some(why.evalue.clone()),
                duration_ms: took,
                output_bytes: bytes,
                output: preview,
                truncated,
                ran: Some(i == 0),
            }));
            fx.to_clients
                .extend(gate::refusal(header, &self.session, &why));
        }
        (fx, link)
    }

    /// Whether the kernel is dead for good (until a restart brings it back).
    pub fn is_dead(&self) -> bool {
        self.lock().dead.is_some()
    }

    /// The kernel is dead for good; `why` says why and what brings it back. Clients are told
    /// `dead`, execute requests held for the restart are answered with `why`, and so is
    /// every later one, until a restart brings the kernel back.
    pub async fn set_dead(&self, why: String) {
        let mut fx = Effects::default();
        let link = {
            let mut st = self.lock();
            let refusal = Refusal {
                ename: "KernelUnavailable",
                evalue: why.clone(),
            };
            self.refuse_backlog(&mut st, &mut fx, &refusal);
            st.dead = Some(why);
            st.link.take()
        };
        if let Some(link) = link {
            link.close();
        }
        let _ = self.carry_out(fx).await;
        self.set_state(ExecutionState::Dead, true);
    }
}
