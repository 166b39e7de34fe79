//! The benchmark's client: one thin connection to one kernel, either a Jupyter WebSocket
//! (`/api/kernels/{id}/channels`, legacy JSON encoding, spoken by Kernelgate and Jupyter
//! Kernel Gateway alike) or ZeroMQ straight to the kernel's sockets (shell DEALER and
//! IOPub SUB, signed with `kernelgate_protocol::wire`).
//!
//! Both kinds do the same client-side work per message: a reader task decodes it into an
//! [`Incoming`] (header type, parent id, and only the content fields the workload needs),
//! so the difference between targets is what sits between the client and the kernel.

use anyhow::{anyhow, bail, Context, Result};
use futures::stream::SplitSink;
use futures::{SinkExt, StreamExt};
use kernelgate_protocol::{wire, Channel, ConnectionInfo, Header, Message, RawJson, SigningKey};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message as WsMessage;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use zeromq::util::PeerIdentity;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// The parts of a received message the workload looks at.
#[derive(Debug)]
pub struct Incoming {
    pub channel: Channel,
    pub msg_type: String,
    pub parent_id: String,
    pub payload: Payload,
}

#[derive(Debug)]
pub enum Payload {
    Stream {
        name: String,
        text: String,
    },
    /// `display_data` / `execute_result` with an `image/png` entry (base64).
    Png(String),
    Status(String),
    Reply {
        status: String,
    },
    Other,
}

#[derive(Deserialize)]
struct StreamContent {
    name: String,
    text: String,
}

#[derive(Deserialize)]
struct DisplayContent<'a> {
    #[serde(borrow)]
    data: std::collections::HashMap<&'a str, &'a RawValue>,
}

#[derive(Deserialize)]
struct StatusContent {
    execution_state: String,
}

#[derive(Deserialize)]
struct ReplyContent {
    #[serde(default)]
    status: String,
}

fn payload(msg_type: &str, content: &str) -> Payload {
    let parsed = match msg_type {
        "stream" => serde_json::from_str::<StreamContent>(content)
            .map(|c| Payload::Stream {
                name: c.name,
                text: c.text,
            })
            .ok(),
        "display_data" | "execute_result" => serde_json::from_str::<DisplayContent>(content)
            .ok()
            .and_then(|c| {
                c.data
                    .get("image/png")
                    .and_then(|v| serde_json::from_str::<String>(v.get()).ok())
            })
            .map(Payload::Png),
        "status" => serde_json::from_str::<StatusContent>(content)
            .map(|c| Payload::Status(c.execution_state))
            .ok(),
        t if t.ends_with("_reply") => serde_json::from_str::<ReplyContent>(content)
            .map(|c| Payload::Reply { status: c.status })
            .ok(),
        _ => None,
    };
    parsed.unwrap_or(Payload::Other)
}

/// A legacy JSON WebSocket frame, borrowed; unknown fields are skipped.
#[derive(Deserialize)]
struct WsFrame<'a> {
    #[serde(borrow)]
    channel: &'a str,
    header: FrameHeader,
    #[serde(default)]
    parent_header: FrameParent,
    #[serde(borrow)]
    content: &'a RawValue,
}

#[derive(Deserialize)]
struct FrameHeader {
    msg_type: String,
}

#[derive(Deserialize, Default)]
struct FrameParent {
    #[serde(default)]
    msg_id: String,
}

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
    pub status: String,
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
        let url = format!(
            "ws://{}/api/kernels/{kernel_id}/channels?session_id={session}",
            base.trim_start_matches("http://")
        );
        let mut req = url.into_client_request()?;
        req.headers_mut()
            .insert("Authorization", format!("token {token}").parse()?);
        // The 20 MiB stream may come as one message: no client-side size limits.
        let config = WebSocketConfig::default()
            .max_message_size(None)
            .max_frame_size(None);
        let (ws, _) = tokio_tungstenite::connect_async_with_config(req, Some(config), true)
            .await
            .with_context(|| format!("WebSocket to kernel {kernel_id}"))?;
        let (sink, mut stream) = ws.split();
        let (tx, rx) = mpsc::unbounded_channel();
        let reader = tokio::spawn(async move {
            while let Some(frame) = stream.next().await {
                let decoded = match frame {
                    Ok(WsMessage::Text(t)) => decode_ws(t.as_str()),
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
                               "username": "bench", "date": kernelgate::kernel::now_iso(),
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
                    &kernelgate::kernel::now_iso(),
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
        loop {
            let m = self.next(deadline).await?;
            if m.channel == Channel::Shell && m.parent_id == id {
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
            let round = (Instant::now() + Duration::from_millis(500)).min(deadline);
            loop {
                match self.next(round).await {
                    Ok(m) if m.channel == Channel::IoPub && m.parent_id == id => return Ok(()),
                    Ok(_) => {}
                    Err(_) => break,
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
        let mut run = Run::default();
        let (mut replied, mut idle) = (false, false);
        while !(replied && idle) {
            let m = self.next(deadline).await?;
            if m.parent_id != id {
                continue;
            }
            match m.payload {
                Payload::Stream { name, text } if name == "stdout" => {
                    run.stdout.push_str(&text);
                    run.stream_messages += 1;
                }
                Payload::Png(png) => run.png = Some(png),
                Payload::Status(s) if s == "idle" => idle = true,
                Payload::Reply { status } if m.msg_type == "execute_reply" => {
                    run.status = status;
                    replied = true;
                }
                _ => {}
            }
        }
        run.elapsed = start.elapsed();
        if run.status != "ok" {
            bail!("execute of {code:?} ended with status {:?}", run.status);
        }
        Ok(run)
    }

    /// Closes a WebSocket cleanly (a ZeroMQ connection just drops its sockets).
    pub async fn close(mut self) {
        if let Writer::Ws(sink) = &mut self.writer {
            let _ = sink.close().await;
        }
    }
}

fn decode_ws(text: &str) -> Result<Incoming> {
    let f: WsFrame = serde_json::from_str(text).context("WebSocket frame is not a message")?;
    Ok(Incoming {
        channel: f.channel.parse()?,
        payload: payload(&f.header.msg_type, f.content.get()),
        msg_type: f.header.msg_type,
        parent_id: f.parent_header.msg_id,
    })
}

fn decode_zmq(channel: Channel, frames: ZmqMessage, key: &SigningKey) -> Result<Incoming> {
    let frames = frames.into_vec();
    let w = wire::decode(&frames, key)?;
    let m = w.message;
    Ok(Incoming {
        channel,
        payload: payload(m.msg_type(), m.content.get()),
        parent_id: m.parent_msg_id().unwrap_or_default().to_owned(),
        msg_type: m.header.msg_type,
    })
}
