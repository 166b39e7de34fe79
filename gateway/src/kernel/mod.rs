//! One kernel as the gateway sees it: its ZeroMQ [`link::Link`], its client sessions
//! ([`clients::Clients`]), and the state the REST API reports (execution state, last
//! activity, connections). Knows nothing about containers or HTTP.

pub mod clients;
pub mod executions;
pub mod gate;
pub mod heartbeat;
pub mod link;

use crate::audit::{Audit, Record, Sender};
use crate::metrics::{self, Direction, DropReason};
use crate::policy::{Answer, Guard, Holder};
use chrono::{DateTime, Utc};
use clients::{ClientLimits, Clients, Outbound, Take, Ticket};
use executions::{Executions, Verdict};
use gate::{Gate, Held, Refusal};
use kernelgate_policy::Decision;
use kernelgate_protocol::content::{ExecutionState, KernelInfoReply};
use kernelgate_protocol::{Channel, ConnectionInfo, Execution, Header, Message, RawJson};
use link::{Dispatch, Link};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("cannot connect to the kernel's sockets: {0}")]
    Connect(String),
    #[error("the {0} channel cannot be written to by clients")]
    NotWritable(Channel),
    #[error("the kernel is not running (it died, restarts, or was shut down)")]
    KernelGone,
    #[error("the kernel did not answer kernel_info within {0:?}")]
    NotReady(Duration),
    /// Dead for good: the text says why and what brings it back.
    #[error("{0}")]
    Dead(String),
}

pub use crate::time::{iso, now_iso};

#[derive(Debug)]
struct State {
    clients: Clients,
    execution_state: ExecutionState,
    last_activity: DateTime<Utc>,
    link: Option<Arc<Link>>,
    /// Client messages sent while the kernel process restarts, delivered in order once it
    /// is back (as libzmq would queue them), so a cell run during a restart is not lost.
    backlog: Vec<(Channel, Message)>,
    /// Executions in flight: their start (for the metrics) and output (for the cap).
    executions: Executions,
    /// Shell messages held by the execution policy, in the order clients sent them.
    held: VecDeque<Held>,
    /// A task is sending the held messages whose turn came ([`Kernel::release`]).
    releasing: bool,
    /// Execute requests sent to the current process and not replied to, oldest first (the
    /// one running, then those queued behind it): answered by the gateway if it dies.
    in_flight: VecDeque<Header>,
    /// Why the kernel is dead for good and what brings it back: set when it could not be
    /// restarted. Execute requests are answered with it in the kernel's place.
    dead: Option<String>,
}

/// Most client messages held while a kernel restarts; past this, sends fail.
const MAX_BACKLOG: usize = 1024;
/// Most execute requests followed for an answer in the kernel's place.
const MAX_IN_FLIGHT: usize = 1024;

/// A kernel's messaging side.
#[derive(Debug)]
pub struct Kernel {
    id: String,
    /// The session id on messages the gateway itself creates.
    session: String,
    /// Largest message accepted from the kernel.
    max_message_bytes: usize,
    audit: Audit,
    /// The execution policy, when one is set.
    guard: Option<Arc<Guard>>,
    /// The aliases this kernel's cells bound, as the policy resolves names.
    scope: Arc<Mutex<kernelgate_policy::Scope>>,
    state: Mutex<State>,
}

impl Kernel {
    pub fn new(
        id: &str,
        limits: ClientLimits,
        audit: Audit,
        guard: Option<Arc<Guard>>,
    ) -> Arc<Self> {
        Arc::new(Kernel {
            id: id.to_owned(),
            session: uuid::Uuid::new_v4().to_string(),
            max_message_bytes: limits.kernel_message_bytes,
            audit,
            guard,
            scope: Arc::default(),
            state: Mutex::new(State {
                clients: Clients::new(limits),
                execution_state: ExecutionState::Starting,
                last_activity: Utc::now(),
                link: None,
                backlog: Vec::new(),
                executions: Executions::new(limits.output_bytes),
                held: VecDeque::new(),
                releasing: false,
                in_flight: VecDeque::new(),
                dead: None,
            }),
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock would be a bug in this module; the state is
        // still consistent enough to keep serving, so recover instead of poisoning
        // every later request.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn execution_state(&self) -> ExecutionState {
        self.lock().execution_state
    }

    pub fn last_activity(&self) -> DateTime<Utc> {
        self.lock().last_activity
    }

    pub fn connections(&self) -> usize {
        self.lock().clients.connections()
    }

    /// Bytes queued for this kernel's client sessions.
    pub fn buffered_bytes(&self) -> usize {
        self.lock().clients.buffered_bytes()
    }

    /// Connects to a freshly started kernel process and waits until it answers
    /// `kernel_info` and IOPub delivers. Replaces any previous link.
    pub async fn connect(
        self: &Arc<Self>,
        info: &ConnectionInfo,
        tracker: &TaskTracker,
        cancel: CancellationToken,
        timeout: Duration,
    ) -> Result<KernelInfoReply, KernelError> {
        self.disconnect();
        let deadline = Instant::now() + timeout;
        let sink: Arc<dyn Dispatch> = self.clone();
        let link = tokio::time::timeout(
            timeout,
            Link::connect(info, sink, tracker, cancel, timeout, self.max_message_bytes)
                .instrument(tracing::info_span!("kernel", kernel = %self.id)),
        )
        .await
        .map_err(|_| KernelError::NotReady(timeout))??;
        let link = Arc::new(link);
        let backlog = {
            let mut st = self.lock();
            st.link = Some(link.clone());
            // Whatever the previous process was asked is answered or lost by now.
            st.in_flight.clear();
            let backlog = std::mem::take(&mut st.backlog);
            for (_, message) in &backlog {
                if message.msg_type() == "execute_request" {
                    track(&mut st.in_flight, &message.header);
                }
            }
            backlog
        };
        for (channel, message) in backlog {
            link.send(channel, message).await?;
        }
        let reply = self.wait_ready(deadline, timeout).await?;
        let mut st = self.lock();
        st.execution_state = ExecutionState::Idle;
        st.last_activity = Utc::now();
        st.dead = None;
        Ok(reply)
    }

    /// Sends `kernel_info_request` until one is answered on shell and followed by its
    /// `idle` on IOPub: IOPub subscriptions take effect asynchronously, so the status
    /// messages of the first requests may be missed.
    async fn wait_ready(
        self: &Arc<Self>,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<KernelInfoReply, KernelError> {
        let me = self.attach(
            &format!("kernelgate-ready-{}", uuid::Uuid::new_v4()),
            true,
            GATEWAY_KEY,
        );
        while Instant::now() < deadline {
            let request = self.request("kernel_info_request", RawJson::empty_object());
            let mut info = Execution::new(request.msg_id());
            // Right after start the writer may race the kernel's bind; retry until the deadline.
            if me.send(Channel::Shell, request).await.is_err() {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            let round = Instant::now() + Duration::from_millis(1000);
            while !info.is_done() {
                let Ok(Some(batch)) = tokio::time::timeout_at(round.min(deadline), me.recv()).await
                else {
                    break;
                };
                for out in batch {
                    info.feed(out.channel, &out.message);
                }
            }
            if let (true, Some(reply)) = (info.is_done(), info.reply()) {
                return Ok(reply.content.parse().unwrap_or_default());
            }
        }
        Err(KernelError::NotReady(timeout))
    }

    /// Drops the link to the current process (it is being restarted or removed).
    pub fn disconnect(&self) {
        if let Some(link) = self.lock().link.take() {
            link.close();
        }
    }

    /// Sets the state the REST API reports and, when `announce`, tells every client with
    /// an IOPub `status` message (used for `restarting` and `dead`, which the kernel
    /// itself cannot send).
    pub fn set_state(&self, state: ExecutionState, announce: bool) {
        let mut st = self.lock();
        st.execution_state = state;
        if state == ExecutionState::Dead {
            st.backlog.clear();
        }
        if announce {
            let content =
                RawJson::from_value(&serde_json::json!({"execution_state": state.as_str()}));
            let message = Message::new(self.header("status"), None, content);
            st.clients.broadcast(Outbound::new(Channel::IoPub, message));
        }
    }

    /// The kernel's process is gone (`cause` says how, e.g. "the kernel ran out of memory
    /// (limit 1024 MiB)"): every execution sent to it and not answered is answered in its
    /// place, as a failed cell whose error names the cause, with an `execution_finished`
    /// audit record. Call before clients are told `restarting` or `dead`: JupyterLab
    /// forgets a cell's request when it sees either.
    pub fn lost_executions(&self, ename: &'static str, cause: &str) {
        let mut st = self.lock();
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
            self.audit.record(&Record::ExecutionFinished {
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
            });
            for out in gate::refusal(header, &self.session, &why) {
                st.clients.route(out);
            }
        }
    }

    /// The kernel is dead for good; `why` says why and what brings it back. Clients are told
    /// `dead`, execute requests held for the restart are answered with `why`, and so is
    /// every later one, until a restart brings the kernel back.
    pub fn set_dead(&self, why: String) {
        let link = {
            let mut st = self.lock();
            let refusal = Refusal {
                ename: "KernelUnavailable",
                evalue: why.clone(),
            };
            for (channel, message) in std::mem::take(&mut st.backlog) {
                if channel == Channel::Shell && message.msg_type() == "execute_request" {
                    self.answer_in_place(&mut st, &message.header, "", None, &refusal);
                }
            }
            st.dead = Some(why);
            st.link.take()
        };
        if let Some(link) = link {
            link.close();
        }
        self.set_state(ExecutionState::Dead, true);
    }

    /// Marks the kernel as just used (a pooled kernel handed to a client).
    pub fn touch(&self) {
        self.lock().last_activity = Utc::now();
    }

    /// Ends every client session: their connections see the kernel go away.
    pub fn close_clients(&self) {
        let mut st = self.lock();
        st.clients.close_all();
        for held in st.held.drain(..) {
            if let (Gate::Waiting { approval, .. }, Some(guard)) = (&held.gate, &self.guard) {
                guard.forget(approval);
            }
        }
    }

    /// A message created by the gateway, in its own session.
    pub fn request(&self, msg_type: &str, content: RawJson) -> Message {
        Message::new(self.header(msg_type), None, content)
    }

    fn header(&self, msg_type: &str) -> Header {
        Header::new(msg_type, &self.session, "kernelgate", &now_iso())
    }

    /// Registers a client connection for `session` (see [`Clients::attach`]), made with
    /// the key named `key` (for the audit trail).
    pub fn attach(self: &Arc<Self>, session: &str, internal: bool, key: &str) -> Attachment {
        let ticket = self.lock().clients.attach(session, internal);
        Attachment {
            kernel: self.clone(),
            ticket,
            key: key.to_owned(),
        }
    }

    async fn send(
        self: &Arc<Self>,
        session: &str,
        key: &str,
        channel: Channel,
        message: Message,
    ) -> Result<(), KernelError> {
        let decision = self.screen(key, channel, &message).await;
        if channel == Channel::Control && message.msg_type() == "interrupt_request" {
            self.cancel_waiting();
        }
        let (link, message) = {
            let mut st = self.lock();
            if matches!(channel, Channel::Shell | Channel::Control) {
                st.clients.note_request(message.msg_id(), session);
            }
            // Written before the code can reach the kernel.
            let code_sha256 = self.audit_request(key, &message);
            metrics::relayed(Direction::ClientToKernel, wire_size(&message));
            st.last_activity = Utc::now();
            if message.msg_type() == "debug_request" && self.guard.is_some() {
                self.audit_decision(key, &message, "deny", None, None, None);
                st.clients
                    .route(gate::debug_refused(&message, &self.session));
                return Ok(());
            }
            // Behind a held message, or held itself: the policy keeps shell order.
            let hold = channel == Channel::Shell
                && (!st.held.is_empty() || st.releasing || matches!(decision, Decision::Ask(_)));
            if hold || matches!(decision, Decision::Deny(_)) {
                let gate = self.gate(&mut st, key, &message, decision);
                let held = Held {
                    message,
                    key: key.to_owned(),
                    code_sha256,
                    gate,
                };
                if hold {
                    st.held.push_back(held);
                } else if let Gate::Refuse(why) = &held.gate {
                    self.refuse(&mut st, &held, why);
                }
                return Ok(());
            }
            match self.route_to_kernel(&mut st, channel, message, key, code_sha256)? {
                Some(sending) => sending,
                None => return Ok(()),
            }
        };
        link.send(channel, message).await
    }

    /// The link to send a client message on, or `None` when it was queued for a kernel
    /// that is (re)starting.
    fn route_to_kernel(
        &self,
        st: &mut State,
        channel: Channel,
        message: Message,
        key: &str,
        code_sha256: Option<String>,
    ) -> Result<Option<(Arc<Link>, Message)>, KernelError> {
        let execute = message.msg_type() == "execute_request";
        let queue = st.link.is_none()
            && matches!(
                st.execution_state,
                ExecutionState::Starting | ExecutionState::Restarting
            )
            && st.backlog.len() < MAX_BACKLOG;
        if st.link.is_none() && !queue {
            return match st.dead.clone() {
                // A cell sent to a dead kernel fails at once, saying what brings it back.
                Some(why) if execute => {
                    let refusal = Refusal {
                        ename: "KernelUnavailable",
                        evalue: why,
                    };
                    self.answer_in_place(st, &message.header, key, code_sha256, &refusal);
                    Ok(None)
                }
                Some(why) => Err(KernelError::Dead(why)),
                None => Err(KernelError::KernelGone),
            };
        }
        if execute {
            st.executions
                .started(&message.header, key, code_sha256.unwrap_or_default());
        }
        match st.link.clone() {
            Some(link) => {
                if execute {
                    track(&mut st.in_flight, &message.header);
                }
                Ok(Some((link, message)))
            }
            None => {
                st.backlog.push((channel, message));
                Ok(None)
            }
        }
    }
}

/// Follows an execute request sent to the kernel until its reply.
fn track(in_flight: &mut VecDeque<Header>, request: &Header) {
    if in_flight.len() >= MAX_IN_FLIGHT {
        in_flight.pop_front();
    }
    in_flight.push_back(request.clone());
}

/// The execution policy's side of the relay: what is checked, held, refused and released.
impl Kernel {
    /// The policy's decision on a client message: only execute requests are checked, and
    /// never the gateway's own (warm-kernel set-up).
    async fn screen(&self, key: &str, channel: Channel, message: &Message) -> Decision {
        let Some(guard) = &self.guard else {
            return Decision::Allow;
        };
        if channel != Channel::Shell
            || message.msg_type() != "execute_request"
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
    fn gate(
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
    fn refuse(&self, st: &mut State, held: &Held, why: &Refusal) {
        let sha = held.code_sha256.clone();
        self.answer_in_place(st, &held.message.header, &held.key, sha, why);
    }

    /// Answers an execution that never reaches the kernel, as a failed cell.
    fn answer_in_place(
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
    fn decide_held(self: &Arc<Self>, approval: &str, answer: Answer) -> bool {
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

    fn start_release(self: &Arc<Self>, st: &mut State) {
        if let (false, Some(guard)) = (st.releasing, &self.guard) {
            st.releasing = true;
            guard.tracker().spawn(self.clone().release());
        }
    }

    /// Sends (or answers) the held messages in order, until none is left or the next one
    /// still waits for approval.
    async fn release(self: Arc<Self>) {
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
    fn audit_decision(
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
fn describe(verdict: &kernelgate_policy::Verdict) -> String {
    if verdict.rule == 0 {
        return verdict.reason.clone();
    }
    format!(
        "{} (rule {}: {})",
        verdict.reason, verdict.rule, verdict.matched
    )
}

impl Holder for Kernel {
    fn kernel_id(&self) -> &str {
        &self.id
    }

    fn decide(self: Arc<Self>, approval: &str, answer: Answer) -> bool {
        self.decide_held(approval, answer)
    }
}

impl Dispatch for Kernel {
    fn dispatch(&self, channel: Channel, message: Message) {
        let mut st = self.lock();
        st.last_activity = Utc::now();
        if channel == Channel::IoPub && message.msg_type() == "status" {
            if let Ok(s) = message.content_as::<kernelgate_protocol::content::Status>() {
                st.execution_state = s.execution_state;
            }
        }
        if channel == Channel::Shell && message.msg_type() == "execute_reply" {
            if let Some(id) = message.parent_msg_id() {
                st.in_flight.retain(|h| h.msg_id != id);
            }
            let finished = message
                .parent_msg_id()
                .and_then(|id| st.executions.replied(id));
            let reply = message.content_as::<ReplyStatus>().unwrap_or_default();
            if let Some(f) = finished {
                metrics::execution_ended(&reply.status, f.took);
                // Written before the reply is forwarded.
                self.audit.record(&Record::ExecutionFinished {
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
                self.audit.record(&Record::ExecutionOutput {
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
                    return;
                }
                Verdict::Truncate { kept, notice } => {
                    tracing::info!(kernel = %self.id, "execution output over --max-output-mb; the rest of it is dropped");
                    match kept {
                        Some(head) => st.clients.route(Outbound::new(channel, *head)),
                        None => metrics::dropped(DropReason::OutputLimit, 1),
                    }
                    st.clients.route(notice);
                    return;
                }
            }
        }
        st.clients.route(Outbound::new(channel, message));
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

/// What of a request that makes the kernel run code the audit trail keeps.
#[derive(Default, serde::Deserialize)]
struct CodeRequest {
    #[serde(default)]
    code: String,
    #[serde(default)]
    user_expressions: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    silent: bool,
}

impl Kernel {
    /// Audits a client request that runs code or talks to kernel-side objects: execute
    /// requests (code and user expressions), debug requests and comm messages. Returns the
    /// code's SHA-256 for an execute request.
    /// Who sent a message, as every audit record about it starts.
    fn sender(&self, key: &str, message: &Message) -> Sender {
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

    fn audit_request(&self, key: &str, message: &Message) -> Option<String> {
        if !self.audit.enabled() {
            return None;
        }
        let sender = self.sender(key, message);
        match message.msg_type() {
            "execute_request" => {
                let req: CodeRequest = message.content.parse().unwrap_or_default();
                let sha = crate::audit::sha256(&req.code);
                self.audit.record(&Record::ExecutionRequested {
                    sender,
                    code_sha256: sha.clone(),
                    code: req.code,
                    user_expressions: req.user_expressions,
                    silent: req.silent,
                });
                Some(sha)
            }
            "debug_request" => {
                let content: serde_json::Value = message.content.parse().unwrap_or_default();
                self.audit.record(&Record::DebugRequest {
                    sender,
                    request: content,
                });
                None
            }
            t if t.starts_with("comm_") => {
                let content: serde_json::Value = message.content.parse().unwrap_or_default();
                let data = content
                    .get("data")
                    .map(|d| d.to_string())
                    .unwrap_or_default();
                self.audit.record(&Record::Comm {
                    sender,
                    msg_type: t.to_owned(),
                    comm_id: content.get("comm_id").cloned(),
                    target_name: content.get("target_name").cloned(),
                    data_sha256: crate::audit::sha256(&data),
                });
                None
            }
            _ => None,
        }
    }
}

/// Bytes of a message as the metrics count them: content, metadata and buffers.
pub(crate) fn wire_size(message: &Message) -> usize {
    message.content.get().len()
        + message.metadata.get().len()
        + message.buffers.iter().map(|b| b.len()).sum::<usize>()
}

/// The key name on what the gateway itself sends (readiness checks, warm-kernel set-up).
pub const GATEWAY_KEY: &str = "kernelgate";

/// A client connection to a kernel: what it sends is routed back to it; dropping it
/// detaches the session (kept for replay unless internal).
#[derive(Debug)]
pub struct Attachment {
    kernel: Arc<Kernel>,
    ticket: Ticket,
    key: String,
}

impl Attachment {
    /// The next messages for this client; `None` when another connection took the
    /// session over.
    pub async fn recv(&self) -> Option<Vec<Arc<Outbound>>> {
        loop {
            match self.kernel.lock().clients.take(&self.ticket) {
                Take::Superseded => return None,
                Take::Messages(m) if !m.is_empty() => return Some(m),
                Take::Messages(_) => {}
            }
            self.ticket.notify.notified().await;
        }
    }

    /// Sends a client message to the kernel; replies come back through [`Self::recv`].
    pub async fn send(&self, channel: Channel, message: Message) -> Result<(), KernelError> {
        self.kernel
            .send(&self.ticket.session, &self.key, channel, message)
            .await
    }

    pub fn kernel(&self) -> &Arc<Kernel> {
        &self.kernel
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        self.kernel.lock().clients.detach(&self.ticket);
    }
}
