//! One kernel as the gateway sees it: its ZeroMQ [`link::Link`], its client sessions
//! ([`clients::Clients`]), where it is in its life ([`lifecycle::Phase`], moved on by
//! [`Relay::step`]), and what the REST API reports of it (execution state, last activity,
//! connections). Knows nothing about containers or HTTP.

pub mod clients;
mod comms;
mod dispatch;
pub mod executions;
pub mod gate;
pub mod heartbeat;
mod hold_queue;
mod holding;
mod installs;
pub mod lifecycle;
pub mod link;
mod requests;
mod steps;

use crate::audit::{Audit, Written};
use crate::metrics::{self, Direction};
use crate::policy::Guard;
use chrono::{DateTime, Utc};
use clients::{ClientLimits, Clients, Outbound, Take, Ticket};
use executions::Executions;
use gate::{Gate, Held, Refusal};
use hold_queue::HoldQueue;
use kernelgate_policy::Decision;
use kernelgate_protocol::content::{ExecutionState, KernelInfoReply};
use kernelgate_protocol::{Channel, ConnectionInfo, Execution, Header, Message, MsgKind, RawJson};
use lifecycle::{Event, Failure, Lifecycle, Phase, Route};
use link::{Dispatch, Link};
use requests::Trail;
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
    /// Something runs or waits in the kernel, or clients sent work (a hibernation is
    /// not sealed).
    #[error("the kernel runs or holds work")]
    Busy,
}

pub use crate::time::{iso, now_iso};

#[derive(Debug)]
struct State {
    clients: Clients,
    /// Where the kernel is in its life, with the link to its process when one serves it.
    life: Lifecycle<Arc<Link>>,
    last_activity: DateTime<Utc>,
    /// Client messages that wait for a process (one that restarts, wakes or loads its
    /// state), delivered in order once it is there (as libzmq would queue them), so a
    /// cell run meanwhile is not lost.
    backlog: Waiting,
    /// Executions in flight: their start (for the metrics), output (for the cap), and
    /// those the current process owes an answer.
    executions: Executions,
    /// Shell messages held by the execution policy, in the order clients sent them.
    holds: HoldQueue,
    /// Installs the current process reported from inside (`%pip install`).
    installs: Option<installs::Reports>,
    /// Messages clients (not the gateway itself) sent so far.
    client_sends: u64,
    /// Comms open on the current process: closed for clients when it is replaced.
    comms: comms::Comms,
}

/// Messages waiting for a process, in the order they were sent.
type Waiting = Vec<(Channel, Message)>;

/// Most client messages held while a kernel restarts; past this, sends fail.
const MAX_BACKLOG: usize = 1024;

/// A kernel's messaging side.
#[derive(Debug)]
pub struct Relay {
    id: String,
    /// The session id on messages the gateway itself creates.
    session: String,
    /// Largest message accepted from the kernel.
    max_message_bytes: usize,
    /// The audit trail, with this kernel's id on its records.
    trail: Trail,
    /// The execution policy, when one is set.
    guard: Option<Arc<Guard>>,
    /// The aliases this kernel's cells bound, as the policy resolves names.
    scope: Arc<Mutex<kernelgate_policy::Scope>>,
    state: Mutex<State>,
    /// Told when a client message reaches a hibernated kernel.
    wake: tokio::sync::Notify,
}

/// How much a kernel is used, as the table and its model read it.
#[derive(Debug, Clone, Copy)]
pub struct Activity {
    pub last_activity: DateTime<Utc>,
    /// Connected client sessions (the REST model's `connections`).
    pub connections: usize,
    /// Bytes queued for the client sessions.
    pub buffered_bytes: usize,
    /// Messages clients have sent so far: a hibernation compares the count before and
    /// after saving, so work sent meanwhile calls it off.
    pub client_sends: u64,
    /// Nothing runs or waits: idle, no execution in flight, held or queued.
    pub quiet: bool,
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
            trail: Trail::new(audit, id),
            guard,
            scope: Arc::default(),
            state: Mutex::new(State {
                clients: Clients::new(limits),
                life: Lifecycle::default(),
                last_activity: Utc::now(),
                backlog: Vec::new(),
                executions: Executions::new(limits.output_bytes),
                holds: HoldQueue::default(),
                installs: None,
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

    /// Where the kernel is in its life (docs/architecture.md, "Kernel lifecycle").
    pub fn phase(&self) -> Phase {
        self.lock().life.phase().clone()
    }

    /// The state clients are told; a hibernated kernel is `idle`.
    pub fn execution_state(&self) -> ExecutionState {
        self.lock().life.phase().execution_state()
    }

    /// Sets the last activity: now (a pooled kernel handed to a client), or when it was
    /// (a hibernated kernel listed again after a gateway restart).
    pub fn touch(&self, at: DateTime<Utc>) {
        self.lock().last_activity = at;
    }

    pub fn activity(&self) -> Activity {
        let st = self.lock();
        Activity {
            last_activity: st.last_activity,
            connections: st.clients.connections(),
            buffered_bytes: st.clients.buffered_bytes(),
            client_sends: st.client_sends,
            quiet: !st.work().pending && *st.life.phase() == Phase::Running(ExecutionState::Idle),
        }
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
        let deadline = Instant::now() + timeout;
        let sink: Arc<dyn Dispatch> = self.clone();
        let link = tokio::time::timeout(
            timeout,
            Link::connect(info, sink, tracker, cancel, timeout, self.max_message_bytes)
                .instrument(tracing::info_span!("kernel", kernel = %self.id)),
        )
        .await
        .map_err(|_| KernelError::NotReady(timeout))??;
        let fx = {
            let mut st = self.lock();
            st.installs = std::path::Path::new(&info.ip)
                .parent()
                .map(installs::Reports::at);
            // Whatever the previous process was asked is answered or lost by now.
            st.executions.forget_sent();
            // Its comms ended with it: clients (a widget manager) are told, as the kernel
            // would have, before anything of the new process.
            for comm_id in st.comms.take() {
                let content =
                    RawJson::from_value(&serde_json::json!({"comm_id": comm_id, "data": {}}));
                let close = Outbound::new(Channel::IoPub, self.request("comm_close", content));
                st.clients.broadcast(close);
            }
            let actions = st.life.connected(Arc::new(link));
            st.apply(actions, self)
        };
        self.carry_out(fx).await?;
        let reply = self.wait_ready(deadline, timeout).await?;
        // Nothing to carry out: the phase alone changes.
        let _ = self.step(Event::Ready).await;
        self.lock().last_activity = Utc::now();
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
        let header = Header::new(msg_type, &self.session, "kernelgate", &now_iso());
        Message::new(header, None, content)
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

    /// Resolves when a client message reached the hibernated kernel (at once if one did
    /// since the wake was last spent).
    pub async fn woken(&self) {
        self.wake.notified().await;
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
            let (code_sha256, requested) = self.trail.request(key, &message);
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
                fx.audit(self.trail.decision(key, &message, "deny", None, None, None));
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
                    fx.refuse(
                        self,
                        &held.message.header,
                        &held.key,
                        held.code_sha256.clone(),
                        why,
                    );
                }
            } else {
                self.route_to_kernel(&mut st, &mut fx, channel, message, key, code_sha256)?;
            }
            fx
        };
        self.carry_out(effects).await
    }

    /// Carries out what was decided under the lock, once it is released: links of gone
    /// processes are closed, then the audit records are awaited (in the file, and synced
    /// with `--audit-fsync`), then clients get their messages, then the kernel what
    /// waited for it (in order) and its one.
    async fn carry_out(&self, fx: Effects) -> Result<(), KernelError> {
        for link in &fx.close {
            link.close();
        }
        if fx.spend_wake {
            spend(&self.wake);
        }
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
        if let Some((link, waiting)) = fx.waiting {
            // Their audit records are in the file before the kernel sees them.
            self.trail.audit.made_so_far().await;
            for (channel, message) in waiting {
                link.send(channel, message).await?;
            }
        }
        match (fx.failed, fx.to_kernel) {
            (Some(Failure::Busy), _) => Err(KernelError::Busy),
            (Some(Failure::Gone), _) => Err(KernelError::KernelGone),
            (None, Some((link, channel, message))) => link.send(channel, message).await,
            (None, None) => Ok(()),
        }
    }

    /// Decides where a client message goes: to the kernel's link, queued for a process
    /// to come, or, for a dead kernel, answered in its place.
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
        let route = st
            .life
            .route(key == GATEWAY_KEY, st.backlog.len() >= MAX_BACKLOG);
        let queued = match route {
            Route::Send(link) => {
                if execute {
                    st.executions
                        .started(&message.header, key, code_sha256.unwrap_or_default());
                    st.executions.sent(&message.header);
                }
                fx.to_kernel = Some((link, channel, message));
                return Ok(());
            }
            Route::Queue { wake } => {
                fx.wake |= wake;
                (channel, message)
            }
            // A cell sent to a dead kernel fails at once, saying what brings it back.
            Route::Refuse(Some(why)) if execute => {
                let refusal = Refusal {
                    ename: "KernelUnavailable",
                    evalue: why,
                };
                fx.refuse(self, &message.header, key, code_sha256, &refusal);
                return Ok(());
            }
            Route::Refuse(Some(why)) => return Err(KernelError::Dead(why)),
            Route::Refuse(None) => return Err(KernelError::KernelGone),
        };
        if execute {
            st.executions
                .started(&queued.1.header, key, code_sha256.unwrap_or_default());
        }
        st.backlog.push(queued);
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
    /// What waited for a process, to send to it first.
    waiting: Option<(Arc<Link>, Waiting)>,
    /// Links of processes gone or no longer served.
    close: Vec<Arc<Link>>,
    /// A client message reached a hibernated kernel.
    wake: bool,
    /// The kernel is awake, or what waited to wake it was answered.
    spend_wake: bool,
    /// A lifecycle event did not apply.
    failed: Option<Failure>,
}

impl Effects {
    fn audit(&mut self, record: Written) {
        self.written = std::mem::take(&mut self.written).and(record);
    }

    /// Answers an execution that never reaches the kernel, as a failed cell: its
    /// `execution_finished` record, then the messages of a failed cell.
    fn refuse(
        &mut self,
        relay: &Relay,
        h: &Header,
        key: &str,
        code_sha256: Option<String>,
        why: &Refusal,
    ) {
        self.audit(relay.trail.never_ran(h, key, code_sha256, why));
        self.to_clients
            .extend(gate::refusal(h, &relay.session, why));
    }
}

/// Spends a wake a queued message left: a stored permit would resolve the next
/// [`Relay::woken`] at once.
fn spend(wake: &tokio::sync::Notify) {
    use std::future::Future;
    let spent = wake.notified();
    tokio::pin!(spent);
    let waker = futures::task::noop_waker();
    let _ = spent
        .as_mut()
        .poll(&mut std::task::Context::from_waker(&waker));
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
