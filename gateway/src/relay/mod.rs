//! One kernel as the gateway sees it: its ZeroMQ [`link::Link`], its client sessions
//! ([`clients::Clients`]), and the state the REST API reports (execution state, last
//! activity, connections). Knows nothing about containers or HTTP.

pub mod clients;
mod comms;
mod death;
mod dispatch;
pub mod executions;
pub mod gate;
pub mod heartbeat;
mod hold_queue;
mod holding;
mod installs;
pub mod link;
mod requests;
mod sleep;

use crate::audit::{Audit, Record, Sender, Written};
use crate::metrics::{self, Direction, DropReason};
use crate::policy::{Answer, Guard, Holder};
use chrono::{DateTime, Utc};
use clients::{ClientLimits, Clients, Outbound, Take, Ticket};
use executions::{Executions, Verdict};
use gate::{Gate, Held, Refusal};
use hold_queue::HoldQueue;
use kernelgate_policy::Decision;
use kernelgate_protocol::content::{ExecutionState, KernelInfoReply};
use kernelgate_protocol::{Channel, ConnectionInfo, Execution, Header, Message, MsgKind, RawJson};
use link::{Deferred, Dispatch, Link};
use requests::CodeRequest;
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
    holds: HoldQueue,
    /// Execute requests sent to the current process and not replied to, oldest first (the
    /// one running, then those queued behind it): answered by the gateway if it dies.
    in_flight: VecDeque<Header>,
    /// Installs the current process reported from inside (`%pip install`).
    installs: Option<installs::Reports>,
    /// Why the kernel is dead for good and what brings it back: set when it could not be
    /// restarted. Execute requests are answered with it in the kernel's place.
    dead: Option<String>,
    /// The kernel hibernates: its state is on disk, its process gone or going. Client
    /// messages wait in the backlog and wake it.
    hibernated: bool,
    /// A resumed kernel's state is loading into its new process: client messages wait in
    /// the backlog (without waking anything) until the load answers.
    loading: bool,
    /// Messages clients (not the gateway itself) sent so far.
    client_sends: u64,
    /// Comms open on the current process: closed for clients when it is replaced.
    comms: comms::Comms,
}

/// Most client messages held while a kernel restarts; past this, sends fail.
const MAX_BACKLOG: usize = 1024;
/// Most execute requests followed for an answer in the kernel's place.
const MAX_IN_FLIGHT: usize = 1024;

/// A kernel's messaging side.
#[derive(Debug)]
pub struct Relay {
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
    /// Told when a client message reaches a hibernated kernel.
    wake: tokio::sync::Notify,
}

impl Relay {
    pub fn new(
        id: &str,
        limits: ClientLimits,
        audit: Audit,
        guard: Option<Arc<Guard>>,
    ) -> Arc<Self> {
        Arc::new(Relay {
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
                holds: HoldQueue::default(),
                in_flight: VecDeque::new(),
                dead: None,
                installs: None,
                hibernated: false,
                loading: false,
                client_sends: 0,
                comms: comms::Comms::default(),
            }),
            wake: tokio::sync::Notify::new(),
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

    /// The state clients are told; a hibernated kernel is `idle`.
    pub fn execution_state(&self) -> ExecutionState {
        let st = self.lock();
        if st.hibernated {
            ExecutionState::Idle
        } else {
            st.execution_state
        }
    }

    pub fn last_activity(&self) -> DateTime<Utc> {
        self.lock().last_activity
    }

    /// Sets the last activity (a hibernated kernel listed again after a gateway restart).
    pub fn set_last_activity(&self, at: DateTime<Utc>) {
        self.lock().last_activity = at;
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
            st.hibernated = false;
            st.installs = std::path::Path::new(&info.ip)
                .parent()
                .map(installs::Reports::at);
            // Whatever the previous process was asked is answered or lost by now.
            st.in_flight.clear();
            // Its comms ended with it: clients (a widget manager) are told, as the kernel
            // would have, before anything of the new process.
            for comm_id in st.comms.take() {
                let content =
                    RawJson::from_value(&serde_json::json!({"comm_id": comm_id, "data": {}}));
                let close = Message::new(self.header("comm_close"), None, content);
                st.clients.broadcast(Outbound::new(Channel::IoPub, close));
            }
            if st.loading {
                // The backlog waits for the state to load (`Relay::loaded`).
                Vec::new()
            } else {
                take_backlog(&mut st)
            }
        };
        self.send_backlog(&link, backlog).await?;
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
            st.clients.broadcast(self.status_message(state));
        }
    }

    /// The gateway's own IOPub `status` for clients, with no parent.
    fn status_message(&self, state: ExecutionState) -> Arc<Outbound> {
        let content = RawJson::from_value(&serde_json::json!({"execution_state": state.as_str()}));
        Outbound::new(
            Channel::IoPub,
            Message::new(self.header("status"), None, content),
        )
    }

    /// Marks the kernel as just used (a pooled kernel handed to a client).
    pub fn touch(&self) {
        self.lock().last_activity = Utc::now();
    }

    /// Ends every client session: their connections see the kernel go away.
    pub fn close_clients(&self) {
        let mut st = self.lock();
        st.clients.close_all();
        let open = st.holds.clear();
        if let Some(guard) = &self.guard {
            for approval in open {
                guard.forget(&approval);
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
            relay: self.clone(),
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
        let kind = message.kind();
        let effects = {
            let mut st = self.lock();
            let mut fx = Effects::default();
            if channel == Channel::Control && kind == MsgKind::InterruptRequest {
                self.cancel_waiting(&mut st, &mut fx);
            }
            if matches!(channel, Channel::Shell | Channel::Control) {
                st.clients.note_request(message.msg_id(), session);
            }
            if channel == Channel::Shell {
                st.comms.observe(&message);
            }
            // In the file before the code can reach the kernel.
            let (code_sha256, requested) = self.audit_request(key, &message);
            fx.audit(requested.clone());
            metrics::relayed(Direction::ClientToKernel, wire_size(&message));
            st.last_activity = Utc::now();
            if key != GATEWAY_KEY {
                st.client_sends += 1;
            }
            // Behind a held message, or held itself: the policy keeps shell order.
            let hold = channel == Channel::Shell
                && st.holds.must_hold(matches!(decision, Decision::Ask(_)));
            if kind == MsgKind::DebugRequest && self.guard.is_some() {
                fx.audit(self.audit_decision(key, &message, "deny", None, None, None));
                fx.to_clients
                    .push(gate::debug_refused(&message, &self.session));
            } else if hold || matches!(decision, Decision::Deny(_)) {
                let gate = self.gate(&mut fx, key, &message, decision);
                let held = Held {
                    message,
                    key: key.to_owned(),
                    code_sha256,
                    gate,
                    written: fx.written.clone().and(requested),
                };
                if hold {
                    st.holds.push(held);
                } else if let Gate::Refuse(why) = &held.gate {
                    self.refuse(&mut fx, &held, why);
                }
            } else {
                self.route_to_kernel(&mut st, &mut fx, channel, message, key, code_sha256)?;
            }
            fx
        };
        self.carry_out(effects).await
    }

    /// Carries out what was decided under the lock, once it is released: first the audit
    /// records are awaited (in the file, and synced with `--audit-fsync`), then clients
    /// get their messages, then the kernel its one.
    async fn carry_out(&self, fx: Effects) -> Result<(), KernelError> {
        if fx.wake {
            self.wake.notify_one();
        }
        if fx.written.is_pending() {
            fx.written.await;
        }
        if !fx.to_clients.is_empty() {
            let mut st = self.lock();
            for out in fx.to_clients {
                st.clients.route(out);
            }
        }
        match fx.to_kernel {
            Some((link, channel, message)) => link.send(channel, message).await,
            None => Ok(()),
        }
    }

    /// Decides where a client message goes: to the kernel's link, queued for a kernel that
    /// is (re)starting, or, for a dead kernel, answered in its place.
    fn route_to_kernel(
        &self,
        st: &mut State,
        fx: &mut Effects,
        channel: Channel,
        message: Message,
        key: &str,
        code_sha256: Option<String>,
    ) -> Result<(), KernelError> {
        let execute = message.kind() == MsgKind::ExecuteRequest;
        // A hibernated kernel queues everything (and wakes); a (re)starting one what comes
        // before its process answers.
        let starting = st.link.is_none()
            && matches!(
                st.execution_state,
                ExecutionState::Starting | ExecutionState::Restarting
            );
        // While a resumed kernel's state loads, only the gateway's own messages pass.
        let waits = st.hibernated || (st.loading && key != GATEWAY_KEY);
        let queue = (waits || starting) && st.backlog.len() < MAX_BACKLOG;
        fx.wake |= st.hibernated && queue;
        if (st.link.is_none() || waits) && !queue {
            return match st.dead.clone() {
                // A cell sent to a dead kernel fails at once, saying what brings it back.
                Some(why) if execute => {
                    let refusal = Refusal {
                        ename: "KernelUnavailable",
                        evalue: why,
                    };
                    self.answer_in_place(fx, &message.header, key, code_sha256, &refusal);
                    Ok(())
                }
                Some(why) => Err(KernelError::Dead(why)),
                None => Err(KernelError::KernelGone),
            };
        }
        if execute {
            st.executions
                .started(&message.header, key, code_sha256.unwrap_or_default());
        }
        match st.link.clone().filter(|_| !waits) {
            Some(link) => {
                if execute {
                    track(&mut st.in_flight, &message.header);
                }
                fx.to_kernel = Some((link, channel, message));
            }
            None => st.backlog.push((channel, message)),
        }
        Ok(())
    }
}

/// What a step of the relay decided while holding the kernel's lock, carried out after it
/// is released ([`Relay::carry_out`]): no write, sync or send happens under the lock.
#[derive(Debug, Default)]
struct Effects {
    /// The last audit record made; waiting for it covers the earlier ones.
    written: Written,
    to_clients: Vec<Arc<Outbound>>,
    to_kernel: Option<(Arc<Link>, Channel, Message)>,
    /// A client message reached a hibernated kernel.
    wake: bool,
}

impl Effects {
    fn audit(&mut self, record: Written) {
        self.written = std::mem::take(&mut self.written).and(record);
    }
}

/// What waited in the backlog, for the process it goes to now: its execute requests are
/// followed from here on.
fn take_backlog(st: &mut State) -> Vec<(Channel, Message)> {
    let backlog = std::mem::take(&mut st.backlog);
    for (_, message) in &backlog {
        if message.kind() == MsgKind::ExecuteRequest {
            track(&mut st.in_flight, &message.header);
        }
    }
    backlog
}

impl Relay {
    /// Sends what [`take_backlog`] took to `link`, in order; their audit records are in
    /// the file before the kernel sees them.
    async fn send_backlog(
        &self,
        link: &Link,
        backlog: Vec<(Channel, Message)>,
    ) -> Result<(), KernelError> {
        self.audit.made_so_far().await;
        for (channel, message) in backlog {
            link.send(channel, message).await?;
        }
        Ok(())
    }

    /// Answers every execute request waiting in the backlog in the kernel's place with
    /// `refusal`, and empties it.
    fn refuse_backlog(&self, st: &mut State, fx: &mut Effects, refusal: &Refusal) {
        for (channel, message) in std::mem::take(&mut st.backlog) {
            if channel == Channel::Shell && message.kind() == MsgKind::ExecuteRequest {
                self.answer_in_place(fx, &message.header, "", None, refusal);
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
    relay: Arc<Relay>,
    ticket: Ticket,
    key: String,
}

impl Attachment {
    /// The next messages for this client; `None` when another connection took the
    /// session over.
    pub async fn recv(&self) -> Option<Vec<Arc<Outbound>>> {
        loop {
            match self.relay.lock().clients.take(&self.ticket) {
                Take::Superseded => return None,
                Take::Messages(m) if !m.is_empty() => return Some(m),
                Take::Messages(_) => {}
            }
            self.ticket.notify.notified().await;
        }
    }

    /// Sends a client message to the kernel; replies come back through [`Self::recv`].
    pub async fn send(&self, channel: Channel, message: Message) -> Result<(), KernelError> {
        self.relay
            .send(&self.ticket.session, &self.key, channel, message)
            .await
    }

    pub fn relay(&self) -> &Arc<Relay> {
        &self.relay
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        self.relay.lock().clients.detach(&self.ticket);
    }
}
