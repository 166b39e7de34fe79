//! `GET /api/kernels/{id}/channels?session_id=S`: the WebSocket that carries all five
//! channels, in the legacy JSON encoding or `v1.kernel.websocket.jupyter.org` when offered.
//!
//! A new socket with the same session id takes the session over and first receives what
//! was queued while no socket was connected (see [`crate::relay::clients`]).
//!
//! In cluster mode, a socket another node forwarded is served only once that node's first
//! frame answers the challenge this node's `101` carried ([`crate::cluster::signing`]):
//! upgrade headers captured and sent again open nothing.

use super::auth::Caller;
use super::error::ApiError;
use super::extract::Path;
use super::kernels::find;
use super::AppState;
use crate::cluster::signing::{Forwarded, Signer, CHALLENGE_HEADER};
use crate::metrics::{self, DropReason};
use crate::relay::{now_iso, Attachment};
use axum::extract::rejection::QueryRejection;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message as WsMessage, WebSocket, WebSocketUpgrade};
use axum::extract::{Extension, Query, State};
use axum::http::HeaderValue;
use axum::response::Response;
use futures::{Sink, SinkExt, Stream, StreamExt};
use kernelgate_protocol::websocket::{self, Encoding, Frame, V1_SUBPROTOCOL};
use kernelgate_protocol::Channel;
use serde::Deserialize;
use std::time::Duration;

/// Clients are pinged this often, so dead connections are noticed and proxies keep the
/// connection open.
const PING_EVERY: Duration = Duration::from_secs(30);
/// How long a forwarded socket's first frame (the answer to its challenge) may take.
const PROOF_WAIT: Duration = Duration::from_secs(10);
/// The close code for a forwarded socket whose first frame does not answer its challenge.
const POLICY_VIOLATION: u16 = 1008;

#[derive(Debug, Deserialize)]
pub struct ChannelsQuery {
    #[serde(default)]
    session_id: Option<String>,
}

pub async fn connect(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    query: Result<Query<ChannelsQuery>, QueryRejection>,
    forwarded: Option<Extension<Forwarded>>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, ApiError> {
    let live = find(&state, &caller, &id)?;
    let Query(query) = query.map_err(|e| {
        ApiError::new(
            e.status(),
            format!("{}; the query takes ?session_id=S", e.body_text()),
        )
    })?;
    let ws = ws.map_err(|e| {
        ApiError::new(
            e.status(),
            format!(
                "{}: this is the kernel's WebSocket; open it with a WebSocket client \
                 (GET with Upgrade: websocket), or use the agent API \
                 (POST /api/kernels/{id}/execute) for plain HTTP",
                e.body_text()
            ),
        )
    })?;
    let session = query
        .session_id
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    let ws = ws
        .protocols([V1_SUBPROTOCOL])
        .max_message_size(state.max_message_bytes)
        .max_frame_size(state.max_message_bytes);
    let encoding = match ws.selected_protocol() {
        Some(p) if p.as_bytes() == V1_SUBPROTOCOL.as_bytes() => Encoding::V1,
        _ => Encoding::Legacy,
    };
    let cancel = state.cancel.clone();
    // A revoked key's WebSockets close at once.
    let revoked = caller.0.revoked.clone();
    // Attached before the 101 goes out: a client that has its 101 receives everything the
    // kernel publishes after it (it may run code through the agent API at once), not only
    // what comes once the upgrade task has run.
    let attachment = live.relay.attach(&session, false, &caller.0.name);
    // A forwarded socket: the forwarding node proves it is the one that signed the call.
    let challenge = match (forwarded, &state.cluster) {
        (Some(Extension(who)), Some(cluster)) => {
            Some((who.nonce, Signer::challenge(), cluster.signer.clone()))
        }
        _ => None,
    };
    let header = challenge
        .as_ref()
        .and_then(|(_, c, _)| HeaderValue::from_str(c).ok());
    let mut response = ws.on_upgrade(move |mut socket: WebSocket| async move {
        if let Some((nonce, challenge, signer)) = challenge {
            let first = tokio::time::timeout(PROOF_WAIT, socket.recv()).await;
            let proved = matches!(
                &first,
                Ok(Some(Ok(WsMessage::Text(proof)))) if signer.proves(&nonce, &challenge, proof.as_str())
            );
            if !proved {
                tracing::warn!(kernel = %live.id(), %session, "a forwarded WebSocket did not answer its challenge (forwarded upgrade headers sent again?); closed");
                let _ = socket
                    .send(WsMessage::Close(Some(CloseFrame {
                        code: POLICY_VIOLATION,
                        reason: "a forwarded WebSocket must answer its challenge first".into(),
                    })))
                    .await;
                return;
            }
        }
        tracing::debug!(kernel = %live.id(), %session, ?encoding, "client connected");
        metrics::websocket_opened();
        tokio::select! {
            _ = cancel.cancelled() => {}
            _ = revoked.cancelled() => {
                tracing::info!(kernel = %live.id(), %session, "key revoked; closing its WebSocket");
            }
            _ = serve(socket, &attachment, encoding, &session) => {}
        }
        metrics::websocket_closed();
        tracing::debug!(kernel = %live.id(), %session, "client disconnected");
    });
    if let Some(value) = header {
        response.headers_mut().insert(CHALLENGE_HEADER, value);
    }
    Ok(response)
}

/// Relays between one client socket and its kernel session until either side ends.
pub async fn serve<S, E>(socket: S, attachment: &Attachment, encoding: Encoding, session: &str)
where
    S: Sink<WsMessage> + Stream<Item = Result<WsMessage, E>> + Unpin,
    E: std::fmt::Display,
{
    let (mut sink, mut stream) = socket.split();
    let mut ping = tokio::time::interval(PING_EVERY);
    ping.tick().await;
    loop {
        tokio::select! {
            incoming = stream.next() => match incoming {
                None => return,
                Some(Err(e)) => {
                    let kernel = attachment.relay().id();
                    let error = e.to_string();
                    // The WebSocket layer refuses a message over --max-message-mb this way.
                    if error.contains("too long") {
                        metrics::dropped(DropReason::TooLarge, 1);
                    }
                    tracing::warn!(%kernel, %session, %error, "client WebSocket failed");
                    return;
                }
                Some(Ok(WsMessage::Close(_))) => return,
                Some(Ok(WsMessage::Text(t))) => {
                    from_client(attachment, encoding, Frame::Text(t.as_str().to_owned()), session).await;
                }
                Some(Ok(WsMessage::Binary(b))) => {
                    from_client(attachment, encoding, Frame::Binary(b), session).await;
                }
                Some(Ok(_)) => {} // pings are answered by the WebSocket layer; pongs need nothing
            },
            batch = attachment.recv() => {
                let Some(batch) = batch else {
                    // Another socket took this session over, or the kernel was shut down.
                    let _ = sink
                        .send(WsMessage::Close(Some(CloseFrame {
                            code: 1000,
                            reason: "session taken over by a newer connection or kernel shut down".into(),
                        })))
                        .await;
                    return;
                };
                for out in batch {
                    let frame = match websocket::encode(encoding, out.channel, &out.message) {
                        Frame::Text(t) => WsMessage::Text(t.into()),
                        Frame::Binary(b) => WsMessage::Binary(b),
                    };
                    if sink.feed(frame).await.is_err() {
                        return;
                    }
                }
                if sink.flush().await.is_err() {
                    return;
                }
            },
            _ = ping.tick() => {
                if sink.send(WsMessage::Ping(Default::default())).await.is_err() {
                    return;
                }
            }
        }
    }
}

/// Decodes, completes and forwards one client message. Bad input is logged and skipped;
/// the connection stays open.
async fn from_client(attachment: &Attachment, encoding: Encoding, frame: Frame, session: &str) {
    let kernel = attachment.relay().id();
    let (channel, mut message) = match websocket::decode(encoding, &frame) {
        Ok(decoded) => decoded,
        Err(e) => {
            metrics::dropped(DropReason::Malformed, 1);
            tracing::warn!(%kernel, %session, error = %e, "ignoring malformed message from client");
            return;
        }
    };
    if matches!(channel, Channel::IoPub | Channel::Heartbeat) {
        metrics::dropped(DropReason::ReadOnlyChannel, 1);
        tracing::warn!(%kernel, %session, %channel, "ignoring client message on a channel clients cannot write");
        return;
    }
    message.header.fill_missing(session, "username", &now_iso());
    if let Err(e) = attachment.send(channel, message).await {
        tracing::warn!(%kernel, %session, %channel, error = %e, "cannot forward client message");
    }
}
