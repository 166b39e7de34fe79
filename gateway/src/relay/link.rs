//! The ZeroMQ sockets to one running kernel: shell, stdin and control DEALERs, the IOPub
//! SUB, each drained by its own task into a [`Dispatch`], and writer tasks that sign
//! outgoing messages with the kernel's key.
//!
//! zeromq-rs differs from libzmq: `connect()` waits for the peer, a DEALER without a peer
//! errors instead of queueing, and only SUB reconnects. A `Link` is therefore made once
//! per kernel process and replaced when the process restarts.

use super::clients::Outbound;
use super::KernelError;
use crate::audit::Written;
use crate::metrics::{self, DropReason};
use bytes::Bytes;
use kernelgate_protocol::{wire, Channel, ConnectionInfo, Message, SigningKey};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use zeromq::util::PeerIdentity;
use zeromq::{
    CodecError, DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqError,
    ZmqMessage,
};

/// Where a link delivers what the kernel sends. Called from the socket reader tasks: it
/// must never wait on a client.
pub trait Dispatch: Send + Sync + 'static {
    /// Takes one message. A message that may reach clients only after an audit record is
    /// in the file comes back as [`Deferred`]: the reader waits for the record, hands it to
    /// [`Dispatch::forward`], and only then reads the socket's next message, so the
    /// socket's order holds.
    fn dispatch(&self, channel: Channel, message: Message) -> Option<Deferred>;
    /// Routes a deferred message to its clients.
    fn forward(&self, message: Arc<Outbound>);
    /// A reader stopped (the kernel closed the socket or the process went away).
    fn link_lost(&self, channel: Channel);
}

/// A message from the kernel held back until its audit record is written.
#[derive(Debug)]
pub struct Deferred {
    pub written: Written,
    pub message: Arc<Outbound>,
}

/// Messages waiting to be written per channel; the sender waits (backpressure to the
/// client) when a kernel does not read its shell socket.
const WRITE_QUEUE: usize = 1024;

/// The live sockets of one kernel process.
#[derive(Debug)]
pub struct Link {
    shell: mpsc::Sender<Message>,
    stdin: mpsc::Sender<Message>,
    control: mpsc::Sender<Message>,
    cancel: CancellationToken,
}

impl Link {
    /// Connects all sockets and starts their tasks. Waits at most `timeout` for the
    /// kernel's socket files to accept connections.
    pub async fn connect(
        info: &ConnectionInfo,
        sink: Arc<dyn Dispatch>,
        tracker: &TaskTracker,
        cancel: CancellationToken,
        timeout: Duration,
        max_message_bytes: usize,
    ) -> Result<Link, KernelError> {
        let key = info.signing_key();
        // Shell and stdin share one routing id: ipykernel sends input_request to the
        // identity the execute_request came from (docs/architecture.md, "ZeroMQ notes").
        let identity = PeerIdentity::try_from(uuid::Uuid::new_v4().as_bytes().to_vec())
            .map_err(|e| KernelError::Connect(e.to_string()))?;
        let options = |id: Option<PeerIdentity>| {
            let mut o = SocketOptions::default();
            o.connect_timeout(timeout);
            // Refused from its frame headers, before its body is read (vendor/README.md).
            o.max_message_size(max_message_bytes);
            if let Some(id) = id {
                o.peer_identity(id);
            }
            o
        };
        let connect = |mut s: DealerSocket, channel: Channel| {
            let endpoint = info.endpoint(channel);
            async move {
                s.connect(&endpoint)
                    .await
                    .map_err(|e| KernelError::Connect(format!("{channel} at {endpoint}: {e}")))?;
                Ok::<_, KernelError>(s)
            }
        };
        let mut iopub = SubSocket::with_options(options(None));
        iopub
            .subscribe("")
            .await
            .map_err(|e| KernelError::Connect(e.to_string()))?;
        let iopub_endpoint = info.endpoint(Channel::IoPub);
        let (shell, stdin, control, iopub_result) = tokio::join!(
            connect(
                DealerSocket::with_options(options(Some(identity.clone()))),
                Channel::Shell
            ),
            connect(
                DealerSocket::with_options(options(Some(identity))),
                Channel::Stdin
            ),
            connect(DealerSocket::with_options(options(None)), Channel::Control),
            iopub.connect(&iopub_endpoint),
        );
        iopub_result
            .map_err(|e| KernelError::Connect(format!("iopub at {iopub_endpoint}: {e}")))?;
        let (shell, stdin, control) = (shell?, stdin?, control?);

        let spawn_reader = |channel: Channel, socket: Box<dyn SocketRecv + Send>| {
            let (sink, key, cancel) = (sink.clone(), key.clone(), cancel.clone());
            tracker.spawn(tracing::Instrument::in_current_span(read_socket(
                channel, socket, sink, key, cancel,
            )));
        };
        let spawn_writer = |channel: Channel, mut socket: Box<dyn SocketSend + Send>| {
            let (key, cancel) = (key.clone(), cancel.clone());
            let (tx, mut rx) = mpsc::channel::<Message>(WRITE_QUEUE);
            tracker.spawn(tracing::Instrument::in_current_span(async move {
                loop {
                    let message = tokio::select! {
                        _ = cancel.cancelled() => return,
                        m = rx.recv() => match m { Some(m) => m, None => return },
                    };
                    let frames = wire::encode(&[], &message, &key);
                    let Ok(zmq) = ZmqMessage::try_from(frames) else {
                        continue;
                    };
                    if let Err(e) = socket.send(zmq).await {
                        tracing::warn!(%channel, error = %e, "cannot write to kernel");
                        return;
                    }
                }
            }));
            tx
        };

        let (shell_tx, shell_rx) = shell.split();
        let (stdin_tx, stdin_rx) = stdin.split();
        let (control_tx, control_rx) = control.split();
        spawn_reader(Channel::Shell, Box::new(shell_rx));
        spawn_reader(Channel::Stdin, Box::new(stdin_rx));
        spawn_reader(Channel::Control, Box::new(control_rx));
        spawn_reader(Channel::IoPub, Box::new(iopub));
        Ok(Link {
            shell: spawn_writer(Channel::Shell, Box::new(shell_tx)),
            stdin: spawn_writer(Channel::Stdin, Box::new(stdin_tx)),
            control: spawn_writer(Channel::Control, Box::new(control_tx)),
            cancel,
        })
    }

    /// Queues a message for the kernel; it is signed when written.
    pub async fn send(&self, channel: Channel, message: Message) -> Result<(), KernelError> {
        let tx = match channel {
            Channel::Shell => &self.shell,
            Channel::Stdin => &self.stdin,
            Channel::Control => &self.control,
            Channel::IoPub | Channel::Heartbeat => {
                return Err(KernelError::NotWritable(channel));
            }
        };
        tx.send(message).await.map_err(|_| KernelError::KernelGone)
    }

    /// Stops this link's tasks (the kernel process is being replaced or removed).
    pub fn close(&self) {
        self.cancel.cancel();
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Drains one kernel socket into `sink` until the socket closes or `cancel` fires.
async fn read_socket(
    channel: Channel,
    mut socket: Box<dyn SocketRecv + Send>,
    sink: Arc<dyn Dispatch>,
    key: SigningKey,
    cancel: CancellationToken,
) {
    let mut complaints = Complaints::default();
    loop {
        let received = tokio::select! {
            _ = cancel.cancelled() => return,
            r = socket.recv() => r,
        };
        // Messages already in the socket's read buffer come without touching the socket,
        // so without this a kernel flooding small messages would keep this task running
        // and other kernels' tasks waiting: each message counts against the task's turn.
        tokio::task::consume_budget().await;
        match received {
            Ok(frames) => {
                if let Some(d) = deliver(&*sink, &key, channel, frames, &mut complaints) {
                    d.written.await;
                    sink.forward(d.message);
                }
            }
            // IOPub's SUB reconnects by itself and goes on with the next message; a
            // DEALER does not, and its kernel counts as lost.
            Err(e @ ZmqError::Codec(CodecError::MessageTooLarge { .. })) => {
                metrics::dropped(DropReason::TooLargeFromKernel, 1);
                complaints.note(channel, &e);
                if channel != Channel::IoPub {
                    sink.link_lost(channel);
                    return;
                }
            }
            Err(e) => {
                tracing::debug!(%channel, error = %e, "kernel socket closed");
                sink.link_lost(channel);
                return;
            }
        }
    }
}

fn deliver(
    sink: &dyn Dispatch,
    key: &SigningKey,
    channel: Channel,
    frames: ZmqMessage,
    complaints: &mut Complaints,
) -> Option<Deferred> {
    let frames: Vec<Bytes> = frames.into_vec();
    match wire::decode(&frames, key) {
        Ok(w) => sink.dispatch(channel, w.message),
        // A bad signature means someone other than the kernel wrote to the socket, or a
        // corrupted message: drop it, never relay it.
        Err(e) => {
            metrics::dropped(DropReason::FromKernel, 1);
            complaints.note(channel, &e);
            None
        }
    }
}

/// Logs of messages dropped from a kernel, bounded: a hostile kernel sending garbage as
/// fast as it can must not fill the host's disk through the gateway's log.
#[derive(Debug)]
struct Complaints {
    window: std::time::Instant,
    logged: u32,
    suppressed: u64,
}

/// At most this many dropped messages are logged per socket and minute; the rest are
/// counted and summed up in one line.
const COMPLAINTS_PER_MINUTE: u32 = 5;

impl Default for Complaints {
    fn default() -> Self {
        Complaints {
            window: std::time::Instant::now(),
            logged: 0,
            suppressed: 0,
        }
    }
}

impl Complaints {
    fn note(&mut self, channel: Channel, error: &dyn std::fmt::Display) {
        if self.window.elapsed() >= Duration::from_secs(60) {
            if self.suppressed > 0 {
                tracing::warn!(%channel, count = self.suppressed, "more messages from the kernel dropped in the last minute without a log line each");
            }
            *self = Complaints::default();
        }
        if self.logged < COMPLAINTS_PER_MINUTE {
            self.logged += 1;
            tracing::warn!(%channel, %error, "dropping message from kernel");
        } else {
            self.suppressed += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zeromq::PubSocket;

    /// A PUB bound to an IPC endpoint in a fresh directory named after `name`: the
    /// directory (to remove), the endpoint and the socket.
    async fn bound_publisher(name: &str) -> (std::path::PathBuf, String, PubSocket) {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let endpoint = format!("ipc://{}/iopub", dir.display());
        let mut publisher = PubSocket::new();
        publisher.bind(&endpoint).await.expect("bind");
        (dir, endpoint, publisher)
    }

    /// The size limit of the patched zeromq, with real sockets: a message over it is
    /// refused (never delivered), and the SUB reconnects and receives the next one.
    #[tokio::test]
    async fn an_oversized_message_is_refused_and_the_next_one_arrives() {
        let (dir, endpoint, mut publisher) = bound_publisher("kg-limit").await;
        let mut options = SocketOptions::default();
        options.max_message_size(1 << 20);
        let mut sub = SubSocket::with_options(options);
        sub.subscribe("").await.expect("subscribe");
        sub.connect(&endpoint).await.expect("connect");

        let (subscribed_tx, mut subscribed) = tokio::sync::watch::channel(false);
        let receiver = tokio::spawn(async move {
            let mut refused = 0;
            loop {
                match sub.recv().await {
                    Ok(m) => {
                        let frames = m.into_vec();
                        match frames[0].as_ref() {
                            b"hello" => {
                                let _ = subscribed_tx.send(true);
                            }
                            b"after" => return refused,
                            _ => panic!("an oversized message was delivered: {frames:?}"),
                        }
                    }
                    Err(ZmqError::Codec(CodecError::MessageTooLarge { limit })) => {
                        assert_eq!(limit, 1 << 20);
                        refused += 1;
                    }
                    Err(e) => panic!("unexpected error: {e}"),
                }
            }
        });
        // PUB drops messages until the subscription arrives: greet until it has.
        while !*subscribed.borrow() {
            publisher
                .send(ZmqMessage::from("hello"))
                .await
                .expect("send");
            let _ = tokio::time::timeout(Duration::from_millis(50), subscribed.changed()).await;
        }
        // Two frames of 600 KiB: each fits, together they do not.
        let big = Bytes::from(vec![b'x'; 600 << 10]);
        let mut m = ZmqMessage::from(big.clone());
        m.push_back(big);
        publisher.send(m).await.expect("send big");
        for _ in 0..200 {
            if receiver.is_finished() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            publisher
                .send(ZmqMessage::from("after"))
                .await
                .expect("send");
        }
        let refused = tokio::time::timeout(Duration::from_secs(10), receiver)
            .await
            .expect("the SUB went on after the refusal")
            .expect("receiver");
        assert_eq!(refused, 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Counts what a reader delivers.
    #[derive(Default)]
    struct Counting(std::sync::atomic::AtomicUsize);

    impl Counting {
        fn seen(&self) -> usize {
            self.0.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    impl Dispatch for Counting {
        fn dispatch(&self, _: Channel, _: Message) -> Option<Deferred> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            None
        }
        fn forward(&self, _: Arc<Outbound>) {}
        fn link_lost(&self, _: Channel) {}
    }

    /// A kernel flooding small messages does not hold the runtime: with hundreds of its
    /// messages already waiting in the socket, its reader hands the thread over after a
    /// bounded share of them, so other kernels' tasks (here one that only looks) get turns.
    #[tokio::test]
    async fn a_flooding_kernel_takes_turns_with_other_tasks() {
        const WAITING: usize = 400;
        let (dir, endpoint, mut publisher) = bound_publisher("kg-turns").await;
        let mut sub = SubSocket::new();
        sub.subscribe("").await.expect("subscribe");
        sub.connect(&endpoint).await.expect("connect");
        // PUB drops messages until the subscription arrives: greet until one gets through.
        loop {
            publisher
                .send(ZmqMessage::from("hello"))
                .await
                .expect("send");
            if tokio::time::timeout(Duration::from_millis(50), sub.recv())
                .await
                .is_ok()
            {
                break;
            }
        }
        let key = SigningKey::new(b"turns");
        let stream = Message::new(
            kernelgate_protocol::Header::new("stream", "s", "kernel", "2026-01-01T00:00:00Z"),
            None,
            kernelgate_protocol::RawJson::from_value(
                &serde_json::json!({"name": "stdout", "text": "x"}),
            ),
        );
        let frames = wire::encode(&[], &stream, &key);
        for _ in 0..WAITING {
            let m = ZmqMessage::try_from(frames.clone()).expect("frames");
            publisher.send(m).await.expect("send");
        }
        // Until they all wait in the socket, unread.
        tokio::time::sleep(Duration::from_millis(300)).await;

        let sink = Arc::new(Counting::default());
        let cancel = CancellationToken::new();
        let reader = tokio::spawn(read_socket(
            Channel::IoPub,
            Box::new(sub),
            sink.clone(),
            key,
            cancel.clone(),
        ));
        // On this one-thread runtime the reader runs first; the onlooker runs when the
        // reader gives the thread up.
        let onlooker = tokio::spawn({
            let sink = sink.clone();
            async move { sink.seen() }
        });
        let seen_by_then = onlooker.await.expect("onlooker");
        for _ in 0..100 {
            if sink.seen() == WAITING {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(sink.seen(), WAITING, "every message was read");
        assert!(
            seen_by_then > 0 && seen_by_then <= 128,
            "the reader took {seen_by_then} of the {WAITING} waiting messages before another task ran"
        );
        cancel.cancel();
        reader.await.expect("reader");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A kernel that answers the handshake with a command frame announcing 2^60 bytes is
    /// refused from the frame's header. Without the limit on command frames the reader
    /// reserved the announced size, and the failed allocation aborted the whole gateway.
    #[tokio::test]
    async fn a_giant_command_frame_is_refused_not_allocated() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = std::env::temp_dir().join(format!("kg-command-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("iopub");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        let hostile = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("accept");
            // A ZMTP 3.0 greeting offering NULL, then a long command frame's header.
            let mut greeting = [0u8; 64];
            greeting[0] = 0xff;
            greeting[9] = 0x7f;
            greeting[10] = 3;
            greeting[12..16].copy_from_slice(b"NULL");
            let mut frame = vec![0x06];
            frame.extend_from_slice(&(1u64 << 60).to_be_bytes());
            let _ = stream.write_all(&greeting).await;
            let _ = stream.write_all(&frame).await;
            let mut sink = [0u8; 4096];
            while let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_secs(5), stream.read(&mut sink)).await
            {
                if n == 0 {
                    break;
                }
            }
        });
        let mut options = SocketOptions::default();
        options.max_message_size(1 << 20);
        let mut sub = SubSocket::with_options(options);
        let endpoint = format!("ipc://{}", path.display());
        let connected = tokio::time::timeout(Duration::from_secs(5), sub.connect(&endpoint)).await;
        assert!(
            !matches!(connected, Ok(Ok(()))),
            "a handshake with a 2^60-byte command frame succeeded"
        );
        hostile.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
