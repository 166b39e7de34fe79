//! The clients of one kernel: a queue per client session, routing of replies to the
//! session that asked, and the replay buffer for sessions that went away.
//!
//! Policy: lifecycle messages (status, errors, replies, input requests) are never dropped.
//! Output messages (streams, displays, results) share a byte budget per session; when a
//! session is over it, the oldest output is dropped and the session is told how many
//! messages it lost, in a stderr stream message, before the next messages it receives.

use crate::metrics::{self, DropReason};
use kernelgate_protocol::{Channel, Header, Message, RawJson};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// One message on its way to a client, shared between all clients that get it.
#[derive(Debug)]
pub struct Outbound {
    pub channel: Channel,
    pub message: Message,
    size: usize,
}

impl Outbound {
    pub fn new(channel: Channel, message: Message) -> Arc<Self> {
        let size = 256 + super::wire_size(&message);
        Arc::new(Outbound {
            channel,
            message,
            size,
        })
    }

    /// Output may be dropped for a client that cannot keep up; anything else may not.
    fn is_output(&self) -> bool {
        self.channel == Channel::IoPub
            && matches!(
                self.message.msg_type(),
                "stream"
                    | "display_data"
                    | "update_display_data"
                    | "execute_result"
                    | "clear_output"
            )
    }
}

/// How many replies' origins are remembered; the oldest are forgotten past this.
const MAX_PENDING: usize = 16_384;

/// Disconnected sessions kept per kernel for replay; past this the longest-gone is
/// forgotten, so clients that never come back cannot pile up buffers.
const MAX_AWAY: usize = 16;

/// Limits that apply to the messages of a kernel and of every client session of it.
#[derive(Debug, Clone, Copy)]
pub struct ClientLimits {
    /// Largest message accepted from the kernel: refused while it is received (the
    /// gateway never buffers more), so a kernel cannot make the gateway allocate more.
    pub kernel_message_bytes: usize,
    /// Bytes of output queued per session before the oldest output is dropped.
    pub buffer_bytes: usize,
    /// Output bytes one execution may produce; past this its output is cut
    /// ([`super::executions`]).
    pub output_bytes: usize,
    /// How long a disconnected session's messages are kept for it to come back.
    pub replay_for: Duration,
}

#[derive(Debug)]
struct Queue {
    items: VecDeque<Arc<Outbound>>,
    bytes: usize,
    dropped: u64,
    dropped_parent: Option<Header>,
    /// Bumped when a new connection takes the session over.
    generation: u64,
    notify: Arc<Notify>,
    connected: bool,
    left_at: Option<Instant>,
    /// Internal sessions (agent API calls) are not counted as connections and are not
    /// kept after they leave.
    internal: bool,
}

/// What a connection holds to read its session's queue.
#[derive(Debug, Clone)]
pub struct Ticket {
    pub session: String,
    pub generation: u64,
    pub notify: Arc<Notify>,
}

/// The result of taking a session's queued messages.
#[derive(Debug)]
pub enum Take {
    Messages(Vec<Arc<Outbound>>),
    /// Another connection took this session over; this one should close.
    Superseded,
}

/// All client sessions of one kernel. Not thread-safe by itself: the kernel keeps it
/// behind a mutex and never holds that across an await.
#[derive(Debug)]
pub struct Clients {
    limits: ClientLimits,
    sessions: HashMap<String, Queue>,
    origins: HashMap<String, String>,
    origin_order: VecDeque<String>,
    next_generation: u64,
    /// Sessions of connections still open when [`Self::close_all`] ended them, with what
    /// was queued for them then (the answer of a cell the kernel's deletion cut short):
    /// their next take gets it, the one after learns they are closed.
    closed: HashMap<String, Queue>,
}

impl Clients {
    pub fn new(limits: ClientLimits) -> Self {
        Clients {
            limits,
            sessions: HashMap::new(),
            origins: HashMap::new(),
            origin_order: VecDeque::new(),
            next_generation: 1,
            closed: HashMap::new(),
        }
    }

    /// A connection for `session`. If the session exists, the new connection takes it
    /// over with whatever was queued while it was away; the old connection is woken and
    /// told it was superseded.
    pub fn attach(&mut self, session: &str, internal: bool) -> Ticket {
        let generation = self.next_generation;
        self.next_generation += 1;
        self.closed.remove(session);
        let notify = Arc::new(Notify::new());
        let queue = self
            .sessions
            .entry(session.to_owned())
            .or_insert_with(|| Queue {
                items: VecDeque::new(),
                bytes: 0,
                dropped: 0,
                dropped_parent: None,
                generation,
                notify: notify.clone(),
                connected: true,
                left_at: None,
                internal,
            });
        let old = std::mem::replace(&mut queue.notify, notify.clone());
        queue.generation = generation;
        queue.connected = true;
        queue.left_at = None;
        old.notify_one();
        if !queue.items.is_empty() || queue.dropped > 0 {
            notify.notify_one();
        }
        Ticket {
            session: session.to_owned(),
            generation,
            notify,
        }
    }

    /// The connection holding `ticket` went away. Its session's messages are kept for
    /// `replay_for` unless it was internal or already taken over.
    pub fn detach(&mut self, ticket: &Ticket) {
        self.closed.remove(&ticket.session);
        let Some(queue) = self.sessions.get_mut(&ticket.session) else {
            return;
        };
        if queue.generation != ticket.generation {
            return;
        }
        if queue.internal {
            self.sessions.remove(&ticket.session);
        } else {
            queue.connected = false;
            queue.left_at = Some(Instant::now());
        }
    }

    /// Takes everything queued for the holder of `ticket`.
    pub fn take(&mut self, ticket: &Ticket) -> Take {
        let Some(queue) = self.sessions.get_mut(&ticket.session) else {
            return match self.closed.remove(&ticket.session) {
                Some(last) if last.generation == ticket.generation && !last.items.is_empty() => {
                    Take::Messages(last.items.into())
                }
                _ => Take::Superseded,
            };
        };
        if queue.generation != ticket.generation {
            return Take::Superseded;
        }
        let mut out = Vec::with_capacity(queue.items.len() + 1);
        if queue.dropped > 0 {
            out.push(overflow_notice(
                queue.dropped,
                queue.dropped_parent.take(),
                self.limits.buffer_bytes,
            ));
            queue.dropped = 0;
        }
        out.extend(queue.items.drain(..));
        queue.bytes = 0;
        Take::Messages(out)
    }

    /// Remembers which session sent a request, so its replies go back there.
    pub fn note_request(&mut self, msg_id: &str, session: &str) {
        if msg_id.is_empty() {
            return;
        }
        if self.origin_order.len() >= MAX_PENDING {
            if let Some(old) = self.origin_order.pop_front() {
                self.origins.remove(&old);
            }
        }
        self.origins.insert(msg_id.to_owned(), session.to_owned());
        self.origin_order.push_back(msg_id.to_owned());
    }

    /// Routes one message from the kernel: IOPub to every session, the rest to the
    /// session whose request it answers.
    pub fn route(&mut self, out: Arc<Outbound>) {
        self.expire();
        if out.channel == Channel::IoPub {
            self.broadcast(out);
            return;
        }
        let Some(parent) = out.message.parent_msg_id() else {
            tracing::debug!(
                msg_type = out.message.msg_type(),
                "reply without parent; dropped"
            );
            metrics::dropped(DropReason::NoRecipient, 1);
            return;
        };
        let Some(session) = self.origins.get(parent).cloned() else {
            tracing::debug!(
                msg_type = out.message.msg_type(),
                "reply to an unknown request; dropped"
            );
            metrics::dropped(DropReason::NoRecipient, 1);
            return;
        };
        if out.message.msg_type().ends_with("_reply") && out.channel != Channel::Stdin {
            self.origins.remove(parent);
        }
        self.push(&session, out);
    }

    /// Sends a message to every session (IOPub, and status changes the gateway itself
    /// announces).
    pub fn broadcast(&mut self, out: Arc<Outbound>) {
        let names: Vec<String> = self.sessions.keys().cloned().collect();
        for name in names {
            self.push(&name, out.clone());
        }
    }

    /// Ends all sessions; their connections read [`Take::Superseded`] and close.
    pub fn close_all(&mut self) {
        for (session, q) in self.sessions.drain() {
            q.notify.notify_one();
            if q.connected && !q.items.is_empty() {
                self.closed.insert(session, q);
            }
        }
        self.origins.clear();
        self.origin_order.clear();
    }

    /// Bytes queued across all sessions.
    pub fn buffered_bytes(&self) -> usize {
        self.sessions.values().map(|q| q.bytes).sum()
    }

    /// Connected, non-internal sessions: the `connections` of the REST model.
    pub fn connections(&self) -> usize {
        self.sessions
            .values()
            .filter(|q| q.connected && !q.internal)
            .count()
    }

    fn push(&mut self, session: &str, out: Arc<Outbound>) {
        let budget = self.limits.buffer_bytes;
        let Some(queue) = self.sessions.get_mut(session) else {
            return;
        };
        queue.bytes += out.size;
        queue.items.push_back(out);
        if queue.bytes > budget {
            shed_output(queue, budget);
        }
        queue.notify.notify_one();
    }

    fn expire(&mut self) {
        let keep = self.limits.replay_for;
        self.sessions
            .retain(|_, q| q.connected || q.left_at.is_none_or(|t| t.elapsed() < keep));
        let mut away: Vec<(Instant, String)> = self
            .sessions
            .iter()
            .filter_map(|(name, q)| {
                q.left_at
                    .filter(|_| !q.connected)
                    .map(|t| (t, name.clone()))
            })
            .collect();
        if away.len() > MAX_AWAY {
            away.sort();
            for (_, name) in &away[..away.len() - MAX_AWAY] {
                self.sessions.remove(name);
            }
        }
    }
}

/// Drops the oldest output messages until the queue fits its budget again.
fn shed_output(queue: &mut Queue, budget: usize) {
    let before = queue.dropped;
    let mut kept = VecDeque::with_capacity(queue.items.len());
    while let Some(item) = queue.items.pop_front() {
        if queue.bytes > budget && item.is_output() {
            queue.bytes -= item.size;
            queue.dropped += 1;
            if queue.dropped_parent.is_none() {
                queue.dropped_parent = item.message.parent_header.clone();
            }
        } else {
            kept.push_back(item);
        }
    }
    queue.items = kept;
    metrics::dropped(DropReason::ClientBehind, queue.dropped - before);
}

fn overflow_notice(dropped: u64, parent: Option<Header>, budget: usize) -> Arc<Outbound> {
    let session = parent
        .as_ref()
        .map(|p| p.session.clone())
        .unwrap_or_default();
    let text = format!(
        "[kernelgate] {dropped} output message(s) were dropped because this client fell \
         behind (buffer limit {} MiB per session). Output before this point is incomplete.\n",
        budget / (1024 * 1024)
    );
    let content = RawJson::from_value(&serde_json::json!({"name": "stderr", "text": text}));
    let header = Header::new("stream", &session, "kernelgate", &super::now_iso());
    Outbound::new(Channel::IoPub, Message::new(header, parent, content))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(buffer_bytes: usize) -> ClientLimits {
        ClientLimits {
            kernel_message_bytes: 1 << 20,
            buffer_bytes,
            output_bytes: 1 << 30,
            replay_for: Duration::from_secs(60),
        }
    }

    fn msg(channel: Channel, msg_type: &str, parent: Option<&str>, text: &str) -> Arc<Outbound> {
        let parent = parent.map(|id| Header {
            msg_id: id.to_owned(),
            ..Header::default()
        });
        let content = RawJson::from_value(&serde_json::json!({"name": "stdout", "text": text}));
        Outbound::new(
            channel,
            Message::new(Header::new(msg_type, "k", "u", "d"), parent, content),
        )
    }

    fn types(take: Take) -> Vec<String> {
        match take {
            Take::Messages(m) => m.iter().map(|o| o.message.msg_type().to_owned()).collect(),
            Take::Superseded => vec!["superseded".into()],
        }
    }

    #[test]
    fn replies_go_to_the_asking_session_iopub_to_all() {
        let mut c = Clients::new(limits(1 << 20));
        let a = c.attach("a", false);
        let b = c.attach("b", false);
        c.note_request("req1", "a");
        c.route(msg(Channel::Shell, "execute_reply", Some("req1"), ""));
        c.route(msg(Channel::IoPub, "status", Some("req1"), ""));
        assert_eq!(types(c.take(&a)), ["execute_reply", "status"]);
        assert_eq!(types(c.take(&b)), ["status"]);
        assert_eq!(c.connections(), 2);
    }

    #[test]
    fn closing_all_sessions_hands_what_was_queued_to_their_next_take() {
        let mut c = Clients::new(limits(1 << 20));
        let open = c.attach("open", true);
        let away = c.attach("away", false);
        c.detach(&away);
        c.note_request("req1", "open");
        c.route(msg(Channel::IoPub, "error", Some("req1"), ""));
        c.route(msg(Channel::Shell, "execute_reply", Some("req1"), ""));
        c.close_all();
        // The answer of a cell cut short reaches the connection that waits for it, once.
        assert_eq!(types(c.take(&open)), ["error", "execute_reply"]);
        assert_eq!(types(c.take(&open)), ["superseded"]);
        assert_eq!(types(c.take(&away)), ["superseded"]);
        assert_eq!(c.connections(), 0);
    }

    #[test]
    fn reconnect_takes_over_and_replays() {
        let mut c = Clients::new(limits(1 << 20));
        let first = c.attach("s", false);
        c.detach(&first);
        assert_eq!(c.connections(), 0);
        c.route(msg(Channel::IoPub, "stream", None, "while away"));
        let second = c.attach("s", false);
        assert_eq!(types(c.take(&second)), ["stream"]);
        assert_eq!(types(c.take(&first)), ["superseded"]);
        // A late detach of the old connection must not disconnect the new one.
        c.detach(&first);
        assert_eq!(c.connections(), 1);
    }

    #[test]
    fn overflow_drops_output_only_and_says_so() {
        let mut c = Clients::new(limits(4000));
        let t = c.attach("s", false);
        c.route(msg(Channel::IoPub, "status", None, ""));
        for _ in 0..50 {
            c.route(msg(Channel::IoPub, "stream", Some("p"), &"x".repeat(100)));
        }
        c.route(msg(Channel::IoPub, "error", Some("p"), ""));
        let Take::Messages(got) = c.take(&t) else {
            panic!("superseded");
        };
        let kinds: Vec<&str> = got.iter().map(|o| o.message.msg_type()).collect();
        assert_eq!(kinds.first(), Some(&"stream"), "notice first");
        assert!(got[0].message.content.get().contains("were dropped"));
        assert_eq!(got[0].message.parent_msg_id(), Some("p"));
        assert!(kinds.contains(&"status") && kinds.contains(&"error"));
        let streams = kinds.iter().filter(|k| **k == "stream").count() - 1;
        assert!(streams < 50 && streams > 0, "kept {streams}");
    }

    #[test]
    fn only_the_newest_away_sessions_are_kept() {
        let mut c = Clients::new(limits(1 << 20));
        for i in 0..(MAX_AWAY + 4) {
            let t = c.attach(&format!("s{i}"), false);
            c.detach(&t);
        }
        c.route(msg(Channel::IoPub, "stream", None, "x"));
        assert_eq!(c.sessions.len(), MAX_AWAY);
        assert!(!c.sessions.contains_key("s0"));
        assert!(c.sessions.contains_key(&format!("s{}", MAX_AWAY + 3)));
    }

    #[test]
    fn internal_sessions_vanish_on_detach() {
        let mut c = Clients::new(limits(1 << 20));
        let t = c.attach("agent-1", true);
        assert_eq!(c.connections(), 0);
        c.detach(&t);
        c.route(msg(Channel::IoPub, "stream", None, "x"));
        assert_eq!(types(c.take(&t)), ["superseded"]);
    }
}
