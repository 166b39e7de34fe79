//! One kernel as the gateway sees it: its ZeroMQ [`link::Link`], its client sessions
//! ([`clients::Clients`]), and the state the REST API reports (execution state, last
//! activity, connections). Knows nothing about containers or HTTP.

pub mod clients;
pub mod executions;
pub mod heartbeat;
pub mod link;

use crate::metrics::{self, Direction, DropReason};
use chrono::{DateTime, Utc};
use clients::{ClientLimits, Clients, Outbound, Take, Ticket};
use executions::{Executions, Verdict};
use kernelgate_protocol::content::{ExecutionState, KernelInfoReply};
use kernelgate_protocol::{Channel, ConnectionInfo, Execution, Header, Message, RawJson};
use link::{Dispatch, Link};
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
}

/// The time as Jupyter writes it: ISO 8601 with microseconds and `Z`.
pub fn now_iso() -> String {
    iso(Utc::now())
}

pub fn iso(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

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
}

/// Most client messages held while a kernel restarts; past this, sends fail.
const MAX_BACKLOG: usize = 1024;

/// A kernel's messaging side.
#[derive(Debug)]
pub struct Kernel {
    id: String,
    /// The session id on messages the gateway itself creates.
    session: String,
    /// Largest message accepted from the kernel.
    max_message_bytes: usize,
    state: Mutex<State>,
}

impl Kernel {
    pub fn new(id: &str, limits: ClientLimits) -> Arc<Self> {
        Arc::new(Kernel {
            id: id.to_owned(),
            session: uuid::Uuid::new_v4().to_string(),
            max_message_bytes: limits.kernel_message_bytes,
            state: Mutex::new(State {
                clients: Clients::new(limits),
                execution_state: ExecutionState::Starting,
                last_activity: Utc::now(),
                link: None,
                backlog: Vec::new(),
                executions: Executions::new(limits.output_bytes),
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
            std::mem::take(&mut st.backlog)
        };
        for (channel, message) in backlog {
            link.send(channel, message).await?;
        }
        let reply = self.wait_ready(deadline, timeout).await?;
        let mut st = self.lock();
        st.execution_state = ExecutionState::Idle;
        st.last_activity = Utc::now();
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
        let me = self.attach(&format!("kernelgate-ready-{}", uuid::Uuid::new_v4()), true);
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

    /// Marks the kernel as just used (a pooled kernel handed to a client).
    pub fn touch(&self) {
        self.lock().last_activity = Utc::now();
    }

    /// Ends every client session: their connections see the kernel go away.
    pub fn close_clients(&self) {
        self.lock().clients.close_all();
    }

    /// A message created by the gateway, in its own session.
    pub fn request(&self, msg_type: &str, content: RawJson) -> Message {
        Message::new(self.header(msg_type), None, content)
    }

    fn header(&self, msg_type: &str) -> Header {
        Header::new(msg_type, &self.session, "kernelgate", &now_iso())
    }

    /// Registers a client connection for `session` (see [`Clients::attach`]).
    pub fn attach(self: &Arc<Self>, session: &str, internal: bool) -> Attachment {
        let ticket = self.lock().clients.attach(session, internal);
        Attachment {
            kernel: self.clone(),
            ticket,
        }
    }

    async fn send(
        &self,
        session: &str,
        channel: Channel,
        message: Message,
    ) -> Result<(), KernelError> {
        let link = {
            let mut st = self.lock();
            if matches!(channel, Channel::Shell | Channel::Control) {
                st.clients.note_request(message.msg_id(), session);
            }
            if message.msg_type() == "execute_request" {
                st.executions.started(&message.header);
            }
            metrics::relayed(Direction::ClientToKernel, wire_size(&message));
            st.last_activity = Utc::now();
            match st.link.clone() {
                Some(link) => link,
                None if matches!(
                    st.execution_state,
                    ExecutionState::Starting | ExecutionState::Restarting
                ) && st.backlog.len() < MAX_BACKLOG =>
                {
                    st.backlog.push((channel, message));
                    return Ok(());
                }
                None => return Err(KernelError::KernelGone),
            }
        };
        link.send(channel, message).await
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
            let took = message
                .parent_msg_id()
                .and_then(|id| st.executions.replied(id));
            if let Some(took) = took {
                let status = message
                    .content_as::<ReplyStatus>()
                    .map(|r| r.status)
                    .unwrap_or_default();
                metrics::execution_ended(&status, took);
            }
        }
        metrics::relayed(Direction::KernelToClient, wire_size(&message));
        if channel == Channel::IoPub {
            match st.executions.output(&message) {
                Verdict::Relay => {}
                Verdict::Drop => {
                    metrics::dropped(DropReason::OutputLimit, 1);
                    return;
                }
                Verdict::Truncate(notice) => {
                    tracing::info!(kernel = %self.id, "execution output over --max-output-mb; the rest of it is dropped");
                    metrics::dropped(DropReason::OutputLimit, 1);
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

/// The `status` of a reply, without parsing the rest (a traceback may be long).
#[derive(serde::Deserialize)]
struct ReplyStatus {
    #[serde(default)]
    status: String,
}

/// Bytes of a message as the metrics count them: content, metadata and buffers.
pub(crate) fn wire_size(message: &Message) -> usize {
    message.content.get().len()
        + message.metadata.get().len()
        + message.buffers.iter().map(|b| b.len()).sum::<usize>()
}

/// A client connection to a kernel: what it sends is routed back to it; dropping it
/// detaches the session (kept for replay unless internal).
#[derive(Debug)]
pub struct Attachment {
    kernel: Arc<Kernel>,
    ticket: Ticket,
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
            .send(&self.ticket.session, channel, message)
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
