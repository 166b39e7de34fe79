//! One session on a kernel's channels WebSocket (`/api/kernels/{id}/channels`), in the
//! encoding the gateway picked: Jupyter's `v1.kernel.websocket.jupyter.org` when it was
//! offered and accepted, else the legacy JSON one.

use crate::Gateway;
use futures::{SinkExt, StreamExt};
use kernelgate_protocol::websocket::{self, Encoding, Frame};
use kernelgate_protocol::{Channel, Header, Message, RawJson};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message as WsMessage;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// What went wrong on the WebSocket; the text says where.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ChannelsError(pub String);

/// One session on a kernel's channels WebSocket.
#[derive(Debug)]
pub struct Channels {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    session: String,
    encoding: Encoding,
}

impl Channels {
    /// Opens the kernel's channels as a new session (a random session id), legacy encoding.
    pub async fn connect(gateway: &Gateway, kernel_id: &str) -> Result<Channels, ChannelsError> {
        let session = uuid::Uuid::new_v4().to_string();
        Self::connect_as(gateway, kernel_id, &session, None).await
    }

    /// Opens the kernel's channels as session `session`, offering `subprotocol`.
    pub async fn connect_as(
        gateway: &Gateway,
        kernel_id: &str,
        session: &str,
        subprotocol: Option<&str>,
    ) -> Result<Channels, ChannelsError> {
        Self::connect_with(gateway, kernel_id, session, subprotocol, None).await
    }

    /// [`Channels::connect_as`] with WebSocket limits of its own (`config`); with a config,
    /// Nagle's algorithm is off too (a benchmark's client).
    pub async fn connect_with(
        gateway: &Gateway,
        kernel_id: &str,
        session: &str,
        subprotocol: Option<&str>,
        config: Option<WebSocketConfig>,
    ) -> Result<Channels, ChannelsError> {
        let url = format!(
            "{}/api/kernels/{kernel_id}/channels?session_id={session}",
            gateway.ws_base()
        );
        let ws_err = |e: &dyn std::fmt::Display| ChannelsError(format!("{url}: {e}"));
        let mut req = url.as_str().into_client_request().map_err(|e| ws_err(&e))?;
        if let Some(t) = gateway.token() {
            let value = format!("token {t}").parse().map_err(|e| ws_err(&e))?;
            req.headers_mut().insert("Authorization", value);
        }
        if let Some(p) = subprotocol {
            let value = p.parse().map_err(|e| ws_err(&e))?;
            req.headers_mut().insert("Sec-WebSocket-Protocol", value);
        }
        let nodelay = config.is_some();
        let (ws, response) = tokio_tungstenite::connect_async_with_config(req, config, nodelay)
            .await
            .map_err(|e| ws_err(&e))?;
        let v1 = response
            .headers()
            .get("Sec-WebSocket-Protocol")
            .is_some_and(|v| v.as_bytes() == websocket::V1_SUBPROTOCOL.as_bytes());
        Ok(Channels {
            ws,
            session: session.to_owned(),
            encoding: if v1 { Encoding::V1 } else { Encoding::Legacy },
        })
    }

    /// The WebSocket itself, for a caller that reads and writes frames on its own.
    pub fn into_inner(self) -> WebSocketStream<MaybeTlsStream<TcpStream>> {
        self.ws
    }

    /// The encoding the gateway picked.
    pub fn encoding(&self) -> Encoding {
        self.encoding
    }

    /// This session's id.
    pub fn session(&self) -> &str {
        &self.session
    }

    /// Sends a request of this session from `username` on `channel`; its `msg_id`.
    pub async fn request(
        &mut self,
        channel: Channel,
        msg_type: &str,
        content: &Value,
        username: &str,
        date: &str,
    ) -> Result<String, ChannelsError> {
        let header = Header::new(msg_type, &self.session, username, date);
        let msg_id = header.msg_id.clone();
        let message = Message::new(header, None, RawJson::from_value(content));
        self.send_message(channel, &message).await?;
        Ok(msg_id)
    }

    /// Sends a shell request from `username`, dated now; its `msg_id`.
    pub async fn send(
        &mut self,
        msg_type: &str,
        content: Value,
        username: &str,
    ) -> Result<String, ChannelsError> {
        let date = kernelgate_protocol::time::now_iso();
        self.request(Channel::Shell, msg_type, &content, username, &date)
            .await
    }

    /// Sends a message in the session's encoding.
    pub async fn send_message(
        &mut self,
        channel: Channel,
        message: &Message,
    ) -> Result<(), ChannelsError> {
        let frame = match websocket::encode(self.encoding, channel, message) {
            Frame::Text(t) => WsMessage::Text(t.into()),
            Frame::Binary(b) => WsMessage::Binary(b),
        };
        self.send_frame(frame).await
    }

    /// Sends a WebSocket frame as it is.
    pub async fn send_frame(&mut self, frame: WsMessage) -> Result<(), ChannelsError> {
        self.ws
            .send(frame)
            .await
            .map_err(|e| ChannelsError(e.to_string()))
    }

    /// The next text or binary frame, or `None` at the deadline.
    pub async fn recv_frame_until(
        &mut self,
        deadline: tokio::time::Instant,
    ) -> Result<Option<Frame>, ChannelsError> {
        let closed = || ChannelsError("the gateway closed it".into());
        loop {
            let frame = match tokio::time::timeout_at(deadline, self.ws.next()).await {
                Err(_) => return Ok(None),
                Ok(None) => return Err(closed()),
                Ok(Some(Err(e))) => return Err(ChannelsError(e.to_string())),
                Ok(Some(Ok(frame))) => frame,
            };
            return Ok(Some(match frame {
                WsMessage::Text(t) => Frame::Text(t.as_str().to_owned()),
                WsMessage::Binary(b) => Frame::Binary(b),
                WsMessage::Close(Some(close)) => {
                    return Err(ChannelsError(format!(
                        "the gateway closed it ({}: {})",
                        u16::from(close.code),
                        close.reason
                    )))
                }
                WsMessage::Close(None) => return Err(closed()),
                // Pings are answered by tungstenite.
                _ => continue,
            }));
        }
    }

    /// The next message, or `None` at the deadline.
    pub async fn recv_until(
        &mut self,
        deadline: tokio::time::Instant,
    ) -> Result<Option<(Channel, Message)>, ChannelsError> {
        let Some(frame) = self.recv_frame_until(deadline).await? else {
            return Ok(None);
        };
        websocket::decode(self.encoding, &frame)
            .map(Some)
            .map_err(|e| ChannelsError(format!("a message cannot be read: {e}")))
    }

    /// Closes the WebSocket.
    pub async fn close(mut self) -> Result<(), ChannelsError> {
        self.ws
            .close(None)
            .await
            .map_err(|e| ChannelsError(e.to_string()))
    }
}
