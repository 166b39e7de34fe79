//! The benchmark's client: one thin connection to one kernel, either a Jupyter WebSocket
//! (`/api/kernels/{id}/channels`, legacy JSON encoding, spoken by Kernelgate and Jupyter
//! Kernel Gateway alike) or ZeroMQ straight to the kernel's sockets (shell DEALER and
//! IOPub SUB, signed with `kernelgate_protocol::wire`).
//!
//! Both kinds do the same client-side work per message: a reader task decodes it into a
//! [`Message`] (content left as raw JSON) and the gateway's own tracker
//! ([`Execution`]) follows each request, so the difference between targets is what sits
//! between the client and the kernel.

use anyhow::{anyhow, bail, Context, Result};
use futures::stream::SplitSink;
use futures::{SinkExt, StreamExt};
use kernelgate_client::Channels;
use kernelgate_protocol::execution::{Event, Status};
use kernelgate_protocol::websocket::{self, Encoding, Frame};
use kernelgate_protocol::{
    wire, Channel, ConnectionInfo, Execution, Header, Message, Outcome, RawJson, SigningKey,
};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message as WsMessage;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use zeromq::util::PeerIdentity;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// A received message and the channel it came on.
type Incoming = (Channel, Message);

type WsSink = SplitSink<WebSocketStream<MaybeTlsStream<TcpStream>>, WsMessage>;

enum Writer {
    Ws(WsSink),
    Zmq {
        shell: Box<dyn SocketSend + Send>,
        key: SigningKey,
    },
}

/// What one execute request produced.
#[derive(Debug, Default)]
pub struct Run {
    pub elapsed: Duration,
    pub stdout: String,
    pub stream_messages: usize,
    pub png: Option<String>,
}

/// One client connection to one kernel.
pub struct Conn {
    writer: Writer,
    rx: mpsc::UnboundedReceiver<Result<Incoming>>,
    readers: Vec<JoinHandle<()>>,
    session: String,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("session", &self.session)
            .finish()
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        for r in &self.readers {
            r.abort();
        }
    }
}

impl Conn {
    /// Opens `/api/kernels/{id}/channels` on a gateway (legacy JSON encoding, Nagle off).
    pub async fn websocket(base: &str, token: &str, kernel_id: &str) -> Result<Conn> {
        let session = uuid::Uuid::new_v4().to_string();
        let gateway = kernelgate_client::Gateway::new(base, Some(token.to_owned()));
        // The 20 MiB stream may come as one message: no client-side size limits.
        let config = WebSocketConfig::default()
            .max_message_size(None)
            .max_frame_size(None);
        let channels = Channels::connect_with(&gateway, kernel_id, &session, None, Some(config))
            .await
            .with_context(|| format!("WebSocket to kernel {kernel_id}"))?;
        let (sink, mut stream) = channels.into_inner().split();
        let (tx, rx) = mpsc::unbounded_channel();
        let reader = tokio::spawn(async move {
            while let Some(frame) = stream.next().await {
                let decoded = match frame {
                    Ok(WsMessage::Text(t)) => decode_ws(Frame::Text(t.as_str().to_owned())),
                    Ok(WsMessage::Binary(b)) => decode_ws(Frame::Binary(b)),
                    Ok(WsMessage::Close(_)) => Err(anyhow!("WebSocket closed by the server")),
                    Ok(_) => continue,
                    Err(e) => Err(anyhow!("WebSocket failed: {e}")),
                };
                let stop = decoded.is_err();
                if tx.send(decoded).is_err() || stop {
                    return;
                }
            }
            let _ = tx.send(Err(anyhow!("WebSocket ended")));
        });
        Ok(Conn {
            writer: Writer::Ws(sink),
            rx,
            readers: vec![reader],
            session,
        })
    }

    /// Connects a shell DEALER and an IOPub SUB straight to a kernel's sockets, waiting
    /// up to `timeout` for them to exist.
    pub async fn zmq(info: &ConnectionInfo, timeout: Duration) -> Result<Conn> {
        let key = info.signing_key();
        let mut options = SocketOptions::default();
        options.connect_timeout(timeout);
        options.peer_identity(
            PeerIdentity::try_from(uuid::Uuid::new_v4().as_bytes().to_vec())
                .map_err(|e| anyhow!("{e}"))?,
        );
        let mut shell = DealerSocket::with_options(options);
        let mut sub_options = SocketOptions::default();
        sub_options.connect_timeout(timeout);
        let mut iopub = SubSocket::with_options(sub_options);
        iopub.subscribe("").await?;
        let (shell_at, iopub_at) = (info.endpoint(Channel::Shell), info.endpoint(Channel::IoPub));
        let (a, b) = tokio::join!(shell.connect(&shell_at), iopub.connect(&iopub_at));
        a.context("connect shell")?;
        b.context("connect iopub")?;
        let (shell_tx, shell_rx) = shell.split();
        let (tx, rx) = mpsc::unbounded_channel();
        let spawn = |channel: Channel, mut socket: Box<dyn SocketRecv + Send>| {
            let (tx, key) = (tx.clone(), key.clone());
            tokio::spawn(async move {
                loop {
                    let decoded = match socket.recv().await {
                        Ok(m) => decode_zmq(channel, m, &key),
                        Err(e) => Err(anyhow!("{channel} socket failed: {e}")),
                    };
                    let stop = decoded.is_err();
                    if tx.send(decoded).is_err() || stop {
                        return;
                    }
                }
            })
        };
        let readers = vec![
            spawn(Channel::Shell, Box::new(shell_rx)),
            spawn(Channel::IoPub, Box::new(iopub)),
        ];
        Ok(Conn {
            writer: Writer::Zmq {
                shell: Box::new(shell_tx),
                key,
            },
            rx,
            readers,
            session: uuid::Uuid::new_v4().to_string(),
        })
    }

    /// Sends a shell request; returns its msg_id.
    pub async fn send(&mut self, msg_type: &str, content: Value) -> Result<String> {
        match &mut self.writer {
            Writer::Ws(sink) => {
                let msg_id = uuid::Uuid::new_v4().to_string();
                let frame = json!({
                    "header": {"msg_id": msg_id, "msg_type": msg_type, "session": self.session,
                               "username": "bench", "date": kernelgate::relay::now_iso(),
                               "version": "5.3"},
                    "parent_header": {}, "metadata": {}, "content": content, "buffers": [],
                    "channel": "shell",
                });
                sink.send(WsMessage::Text(frame.to_string().into())).await?;
                Ok(msg_id)
            }
            Writer::Zmq { shell, key } => {
                let header = Header::new(
                    msg_type,
                    &self.session,
                    "bench",
                    &kernelgate::relay::now_iso(),
                );
                let msg_id = header.msg_id.clone();
                let message = Message::new(header, None, RawJson::from_value(&content));
                let frames = wire::encode(&[], &message, key);
                let zmq = ZmqMessage::try_from(frames).map_err(|e| anyhow!("{e:?}"))?;
                shell.send(zmq).await?;
                Ok(msg_id)
            }
        }
    }

    async fn next(&mut self, deadline: Instant) -> Result<Incoming> {
        let left = deadline.saturating_duration_since(Instant::now());
        tokio::time::timeout(left, self.rx.recv())
            .await
            .map_err(|_| anyhow!("timed out waiting for the kernel"))?
            .ok_or_else(|| anyhow!("connection closed"))?
    }

    /// `kernel_info_request` until its reply; returns how long that took.
    pub async fn kernel_info(&mut self, timeout: Duration) -> Result<Duration> {
        let start = Instant::now();
        let deadline = start + timeout;
        let id = self.send("kernel_info_request", json!({})).await?;
        let mut info = Execution::new(&id);
        loop {
            let (channel, m) = self.next(deadline).await?;
            if let Some(Event::Reply(_)) = info.feed(channel, &m) {
                return Ok(start.elapsed());
            }
        }
    }

    /// Waits until IOPub delivers (a SUB subscription takes effect asynchronously):
    /// `kernel_info_request` until a status message arrives for one of them.
    pub async fn wait_iopub(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let id = self.send("kernel_info_request", json!({})).await?;
            let mut info = Execution::new(&id);
            let round = (Instant::now() + Duration::from_millis(500)).min(deadline);
            while let Ok((channel, m)) = self.next(round).await {
                if let Some(Event::Busy | Event::Idle) = info.feed(channel, &m) {
                    return Ok(());
                }
            }
        }
        bail!("IOPub delivered nothing within {timeout:?}")
    }

    /// Runs `code` and collects its stdout and PNG output until both the execute_reply
    /// and the idle status arrived; `elapsed` spans send to the later of the two.
    pub async fn execute(&mut self, code: &str, timeout: Duration) -> Result<Run> {
        let start = Instant::now();
        let deadline = start + timeout;
        let id = self
            .send(
                "execute_request",
                json!({"code": code, "silent": false, "store_history": true,
                       "user_expressions": {}, "allow_stdin": false, "stop_on_error": true}),
            )
            .await?;
        let mut execution = Execution::new(&id);
        let mut outcome = Outcome::default();
        let mut stream_messages = 0;
        while !execution.is_done() {
            let (channel, m) = self.next(deadline).await?;
            if let Some(event) = execution.feed(channel, &m) {
                stream_messages +=
                    usize::from(matches!(&event, Event::Stream { name, .. } if name == "stdout"));
                outcome.apply(&event);
            }
        }
        if execution.status() != Status::Ok {
            bail!(
                "execute of {code:?} ended with status {:?}",
                execution.status()
            );
        }
        Ok(Run {
            elapsed: start.elapsed(),
            png: outcome.displays.iter().find_map(|d| {
                d.data
                    .get("image/png")
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            }),
            stdout: outcome.stdout,
            stream_messages,
        })
    }

    /// Closes a WebSocket cleanly (a ZeroMQ connection just drops its sockets).
    pub async fn close(mut self) {
        if let Writer::Ws(sink) = &mut self.writer {
            let _ = sink.close().await;
        }
    }
}

fn decode_ws(frame: Frame) -> Result<Incoming> {
    websocket::decode(Encoding::Legacy, &frame).context("WebSocket frame is not a message")
}

fn decode_zmq(channel: Channel, frames: ZmqMessage, key: &SigningKey) -> Result<Incoming> {
    let frames = frames.into_vec();
    Ok((channel, wire::decode(&frames, key)?.message))
}
