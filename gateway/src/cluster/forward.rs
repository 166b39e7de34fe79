//! The forwarding layer: a request for a kernel another node owns goes to that node as the
//! client sent it (method, path, query, headers, body streamed both ways), less the
//! client's credentials and any internal header a client tried to send, plus the identity
//! the entry node vouches for, signed with the cluster secret ([`super::signing`]). A
//! WebSocket is forwarded as the HTTP Upgrade itself: the owner checks the request,
//! negotiates the subprotocol and answers `101`, then the bytes are spliced both ways and
//! no frame is ever decoded or re-encoded here. With the cluster's TLS on
//! ([`super::tls`]), both go to the owner's cluster listener, over TLS with this node's
//! certificate, and only to a server whose certificate names the owner.

use super::signing::{Forwarded, Signer, HEADER_PREFIX};
use super::tls::ClusterTls;
use super::NodeRecord;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Response};
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt, TryStreamExt};
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long connecting to the owner may take before it counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The most an owner's answer to an upgrade may hold before its body.
const MAX_HEAD: usize = 64 * 1024;

/// Headers that describe one hop, not the request (RFC 9110 §7.6.1), the client's
/// credentials, which stay at the entry node, and its `Origin`, checked there against the
/// entry node's own host (the owner's host differs, and would refuse a browser's request).
const NOT_FORWARDED: [&str; 11] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "authorization",
    "origin",
];

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// The owner did not answer: the client should try again shortly.
    #[error("the node that runs this kernel ({node}) cannot be reached: {reason}")]
    Unreachable { node: String, reason: String },
    /// The owner answered something that is not HTTP.
    #[error("the node that runs this kernel ({node}) answered something that is not HTTP")]
    BadAnswer { node: String },
    /// The owner left the cluster (its lease ended) before it answered.
    #[error("the node that runs this kernel ({node}) left the cluster")]
    OwnerLeft { node: String },
}

/// Resolves when the owner a call went to has left the cluster: the call, a streamed answer
/// or a spliced WebSocket ends then rather than wait on a node that may never answer (one
/// partitioned away sends no reset).
pub type Left = Shared<BoxFuture<'static, ()>>;

/// A [`Left`] for calls that watch no owner.
pub fn never_left() -> Left {
    futures::future::pending().boxed().shared()
}

/// Sends requests on to the nodes that own their kernels.
#[derive(Debug)]
pub struct Forwarder {
    http: reqwest::Client,
    /// With the cluster's TLS on: one client per peer node, each accepting only a server
    /// certificate that names that node.
    tls: Option<Arc<ClusterTls>>,
    peers: Mutex<HashMap<String, reqwest::Client>>,
    signer: Arc<Signer>,
    /// This node's id, named as the entry in forwarded calls.
    node_id: String,
    /// Owns the splice of every forwarded WebSocket.
    tracker: TaskTracker,
    cancel: CancellationToken,
}

/// The path and query as forwarded: without a `token` parameter (credentials stay here).
fn forwarded_path(req: &Request) -> String {
    let path = req.uri().path();
    match req.uri().query() {
        None => path.to_owned(),
        Some(q) => {
            let kept: Vec<&str> = q
                .split('&')
                .filter(|kv| !kv.is_empty() && kv.split('=').next() != Some("token"))
                .collect();
            if kept.is_empty() {
                path.to_owned()
            } else {
                format!("{path}?{}", kept.join("&"))
            }
        }
    }
}

/// The client's headers that go on to the owner.
fn forwarded_headers(headers: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| {
            let n = name.as_str();
            !NOT_FORWARDED.contains(&n) && !n.starts_with(HEADER_PREFIX)
        })
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect()
}

/// Whether a request asks to become a WebSocket.
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    let has = |name: header::HeaderName, token: &str| {
        headers.get_all(name).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    has(header::CONNECTION, "upgrade") && has(header::UPGRADE, "websocket")
}

/// Removes every internal header from a client's request (the entry node does this first,
/// so that a client cannot pass for a forwarding node).
pub fn strip_internal(headers: &mut HeaderMap) {
    let internal: Vec<HeaderName> = headers
        .keys()
        .filter(|n| n.as_str().starts_with(HEADER_PREFIX))
        .cloned()
        .collect();
    for name in internal {
        headers.remove(&name);
    }
}

impl Forwarder {
    pub fn new(
        signer: Arc<Signer>,
        node_id: &str,
        tracker: TaskTracker,
        cancel: CancellationToken,
    ) -> Result<Forwarder, reqwest::Error> {
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Forwarder {
            http,
            tls: None,
            peers: Mutex::default(),
            signer,
            node_id: node_id.to_owned(),
            tracker,
            cancel,
        })
    }

    /// Calls to other nodes over mutual TLS, to their cluster listeners.
    pub fn with_tls(mut self, tls: Option<Arc<ClusterTls>>) -> Forwarder {
        self.tls = tls;
        self
    }

    /// Where calls to node `node` go: its cluster listener with TLS on, else its address.
    fn base_of(&self, node: &str, record: &NodeRecord) -> Result<String, ForwardError> {
        if self.tls.is_none() {
            return Ok(record.address.clone());
        }
        match &record.cluster_address {
            Some(url) if url.starts_with("https://") => Ok(url.clone()),
            _ => Err(ForwardError::Unreachable {
                node: node.to_owned(),
                reason: "it serves no TLS cluster listener (--cluster-listen), and this node calls no other way".into(),
            }),
        }
    }

    /// The HTTP client for calls to node `node`.
    fn client_for(&self, node: &str) -> Result<reqwest::Client, ForwardError> {
        let Some(tls) = &self.tls else {
            return Ok(self.http.clone());
        };
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = peers.get(node) {
            return Ok(client.clone());
        }
        let unreachable = |reason: String| ForwardError::Unreachable {
            node: node.to_owned(),
            reason,
        };
        let config = tls.client_config(node).map_err(unreachable)?;
        let client = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .https_only(true)
            .use_preconfigured_tls((*config).clone())
            .build()
            .map_err(|e| unreachable(e.to_string()))?;
        peers.insert(node.to_owned(), client.clone());
        Ok(client)
    }

    /// Sends `req` to node `node` (as `record`, its registry record, says to reach it), on
    /// behalf of the client key `key`; the owner's answer, streamed.
    #[allow(clippy::too_many_arguments)]
    pub async fn forward(
        &self,
        node: &str,
        record: &NodeRecord,
        key: &str,
        request_id: &str,
        registered: bool,
        req: Request,
        left: Left,
    ) -> Result<Response<Body>, ForwardError> {
        let path = forwarded_path(&req);
        let gone = || ForwardError::OwnerLeft {
            node: node.to_owned(),
        };
        let base = &self.base_of(node, record)?;
        let who = Forwarded {
            key: key.to_owned(),
            entry: self.node_id.clone(),
            request_id: request_id.to_owned(),
            timestamp: chrono::Utc::now().timestamp(),
            entry_registered: registered,
        };
        let signed = self.signer.sign(req.method().as_str(), &path, &who);
        if is_upgrade(req.headers()) {
            return tokio::select! {
                biased;
                answer = self.upgrade(node, base, &path, signed, req, left.clone()) => answer,
                () = left => Err(gone()),
            };
        }
        let unreachable = |e: reqwest::Error| ForwardError::Unreachable {
            node: node.to_owned(),
            // The TLS error that refused the owner's certificate is in the source chain.
            reason: error_chain(&e),
        };
        let method = reqwest::Method::from_bytes(req.method().as_str().as_bytes())
            .unwrap_or(reqwest::Method::GET);
        let mut request = self
            .client_for(node)?
            .request(method, format!("{base}{path}"));
        for (name, value) in forwarded_headers(req.headers()) {
            request = request.header(name.as_str(), value.as_bytes());
        }
        for (name, value) in signed {
            request = request.header(name, value);
        }
        let body = req.into_body().into_data_stream();
        let sent = request.body(reqwest::Body::wrap_stream(body)).send();
        let response = tokio::select! {
            biased;
            response = sent => response.map_err(unreachable)?,
            () = left.clone() => return Err(gone()),
        };
        let mut answer = Response::builder().status(response.status().as_u16());
        for (name, value) in response.headers() {
            if !NOT_FORWARDED.contains(&name.as_str()) {
                answer = answer.header(name.as_str(), value.as_bytes());
            }
        }
        // Streamed as it comes (NDJSON runs); dropping it, as a client that hangs up does,
        // drops the connection to the owner, who sees its caller gone.
        let body = Body::from_stream(
            response
                .bytes_stream()
                .map_err(std::io::Error::other)
                .take_until(left),
        );
        answer.body(body).map_err(|_| ForwardError::BadAnswer {
            node: node.to_owned(),
        })
    }

    /// A WebSocket upgrade: the request goes to the owner on a connection of its own; if the
    /// owner answers `101`, that answer goes to the client and the two connections are
    /// spliced; any other answer goes to the client as it is.
    async fn upgrade(
        &self,
        node: &str,
        base: &str,
        path: &str,
        signed: Vec<(&'static str, String)>,
        req: Request,
        left: Left,
    ) -> Result<Response<Body>, ForwardError> {
        let unreachable = |reason: String| ForwardError::Unreachable {
            node: node.to_owned(),
            reason,
        };
        let scheme = if self.tls.is_some() {
            "https://"
        } else {
            "http://"
        };
        let authority = base
            .strip_prefix(scheme)
            .ok_or_else(|| {
                unreachable(format!(
                    "only {scheme} node addresses can carry a WebSocket"
                ))
            })?
            .trim_end_matches('/');
        let owner = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(authority))
            .await
            .map_err(|_| unreachable("connect timed out".into()))?
            .map_err(|e| unreachable(e.to_string()))?;
        let Some(tls) = &self.tls else {
            return self
                .upgrade_over(owner, node, authority, path, signed, req, left)
                .await;
        };
        // The handshake checks the owner's certificate before a byte of the request goes.
        let config = tls.client_config(node).map_err(unreachable)?;
        let name = super::tls::node_name(node).map_err(|e| unreachable(e.to_string()))?;
        let owner = tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio_rustls::TlsConnector::from(config).connect(name, owner),
        )
        .await
        .map_err(|_| unreachable("TLS handshake timed out".into()))?
        .map_err(|e| unreachable(format!("TLS handshake failed: {e}")))?;
        self.upgrade_over(owner, node, authority, path, signed, req, left)
            .await
    }

    /// [`Forwarder::upgrade`] on a connection to the owner.
    #[allow(clippy::too_many_arguments)]
    async fn upgrade_over<S>(
        &self,
        mut owner: S,
        node: &str,
        authority: &str,
        path: &str,
        signed: Vec<(&'static str, String)>,
        mut req: Request,
        left: Left,
    ) -> Result<Response<Body>, ForwardError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let unreachable = |reason: String| ForwardError::Unreachable {
            node: node.to_owned(),
            reason,
        };
        let mut head = format!("{} {path} HTTP/1.1\r\nhost: {authority}\r\n", req.method());
        head.push_str("connection: Upgrade\r\nupgrade: websocket\r\n");
        for (name, value) in forwarded_headers(req.headers()) {
            if let Ok(v) = value.to_str() {
                head.push_str(&format!("{name}: {v}\r\n"));
            }
        }
        for (name, value) in signed {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        owner
            .write_all(head.as_bytes())
            .await
            .map_err(|e| unreachable(e.to_string()))?;

        // The owner's answer head, and whatever came after it in the same reads.
        let mut buf = Vec::with_capacity(4096);
        let (status, headers, head_len) = loop {
            let mut chunk = [0u8; 4096];
            let n = owner
                .read(&mut chunk)
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            if n == 0 {
                return Err(unreachable("closed before answering".into()));
            }
            buf.extend_from_slice(&chunk[..n]);
            let mut parsed = [httparse::EMPTY_HEADER; 64];
            let mut answer = httparse::Response::new(&mut parsed);
            match answer.parse(&buf) {
                Ok(httparse::Status::Complete(len)) => {
                    let headers: Vec<(String, Vec<u8>)> = answer
                        .headers
                        .iter()
                        .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
                        .collect();
                    break (answer.code.unwrap_or(502), headers, len);
                }
                Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => continue,
                _ => {
                    return Err(ForwardError::BadAnswer {
                        node: node.to_owned(),
                    })
                }
            }
        };
        let rest = buf.split_off(head_len);
        let mut answer = Response::builder().status(status);
        for (name, value) in &headers {
            let hop = NOT_FORWARDED.contains(&name.as_str()) && status != 101;
            if !hop && name != "content-length" {
                answer = answer.header(name.as_str(), value.as_slice());
            }
        }
        if status != 101 {
            // A refusal (404, 403, ...): its body, as far as its length says.
            let length = headers
                .iter()
                .find(|(n, _)| n == "content-length")
                .and_then(|(_, v)| std::str::from_utf8(v).ok()?.trim().parse::<usize>().ok())
                .unwrap_or(0)
                .min(MAX_HEAD);
            let mut body = rest;
            while body.len() < length {
                let mut chunk = [0u8; 4096];
                match owner.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => body.extend_from_slice(&chunk[..n]),
                }
            }
            body.truncate(length);
            return answer
                .body(Body::from(body))
                .map_err(|_| ForwardError::BadAnswer {
                    node: node.to_owned(),
                });
        }
        let Some(on_upgrade) = req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>() else {
            return Err(ForwardError::BadAnswer {
                node: node.to_owned(),
            });
        };
        let cancel = self.cancel.clone();
        self.tracker.spawn(async move {
            let Ok(upgraded) = on_upgrade.await else {
                return;
            };
            let mut client = TokioIo::new(upgraded);
            splice(&mut client, owner, &rest, cancel, left).await;
        });
        answer
            .body(Body::empty())
            .map_err(|_| ForwardError::BadAnswer {
                node: node.to_owned(),
            })
    }
}

/// An error with its sources, `: `-joined (reqwest's own text leaves out why a connection
/// failed).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The close frame the entry node sends when the owner's side ends without one (the owner
/// died, or this node stops): 1001, going away, so that clients reconnect.
const GOING_AWAY: [u8; 4] = [0x88, 0x02, 0x03, 0xE9];

/// Copies bytes both ways until either side ends. The owner's bytes are only watched (frame
/// boundaries and opcodes, never changed): when they end without a close frame, between
/// frames, or the owner leaves the cluster, the client gets [`GOING_AWAY`] instead of a bare
/// end of its connection.
async fn splice<C, S>(client: &mut C, owner: S, first: &[u8], cancel: CancellationToken, left: Left)
where
    C: AsyncRead + AsyncWrite + Unpin,
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mut from_owner, mut to_owner) = tokio::io::split(owner);
    let (mut from_client, mut to_client) = tokio::io::split(client);
    let mut frames = Frames::default();
    let down = async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut chunk: &[u8] = first;
        loop {
            if !chunk.is_empty() {
                frames.watch(chunk);
                if to_client.write_all(chunk).await.is_err() {
                    return false;
                }
            }
            match from_owner.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(n) => chunk = &buf[..n],
            }
        }
    };
    let up = tokio::io::copy(&mut from_client, &mut to_owner);
    let owner_ended = tokio::select! {
        _ = cancel.cancelled() => true,
        () = left => true,
        ended = down => ended,
        _ = up => false,
    };
    if owner_ended && frames.between() && !frames.closed {
        let _ = to_client.write_all(&GOING_AWAY).await;
    }
    let _ = to_client.shutdown().await;
}

/// Where the owner's stream of WebSocket frames (unmasked, server to client) stands.
#[derive(Debug, Default)]
struct Frames {
    /// The header bytes of the frame being read, until it is whole.
    head: Vec<u8>,
    /// Payload bytes still to come of the current frame.
    left: u64,
    /// A close frame went by.
    closed: bool,
}

impl Frames {
    fn watch(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.left > 0 {
                let n = usize::try_from(self.left)
                    .unwrap_or(usize::MAX)
                    .min(bytes.len());
                self.left -= n as u64;
                bytes = &bytes[n..];
                continue;
            }
            self.head.push(bytes[0]);
            bytes = &bytes[1..];
            if let Some((opcode, length)) = header(&self.head) {
                self.closed |= opcode == 0x8;
                self.left = length;
                self.head.clear();
            }
        }
    }

    /// Whether the stream stands between two frames.
    fn between(&self) -> bool {
        self.head.is_empty() && self.left == 0
    }
}

/// A complete frame header's opcode and payload length; `None` while it is partial.
fn header(head: &[u8]) -> Option<(u8, u64)> {
    let (first, second) = (*head.first()?, *head.get(1)?);
    let masked = second & 0x80 != 0;
    let (length, at) = match second & 0x7f {
        126 => (
            u64::from(u16::from_be_bytes([*head.get(2)?, *head.get(3)?])),
            4,
        ),
        127 => {
            let bytes: [u8; 8] = head.get(2..10)?.try_into().ok()?;
            (u64::from_be_bytes(bytes), 10)
        }
        n => (u64::from(n), 2),
    };
    let total = at + if masked { 4 } else { 0 };
    (head.len() >= total).then_some((first & 0x0f, length))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_followed_across_any_split_of_the_reads() {
        let mut stream = vec![0x81, 0x03, b'a', b'b', b'c'];
        stream.extend([0x82, 126, 0x01, 0x00]);
        stream.extend([7u8; 256]);
        for split in 0..=stream.len() {
            let mut f = Frames::default();
            f.watch(&stream[..split]);
            let at_boundary = [0, 5, stream.len()].contains(&split);
            assert_eq!(f.between(), at_boundary, "split at {split}");
            f.watch(&stream[split..]);
            assert!(f.between() && !f.closed, "split at {split}");
        }
        let mut f = Frames::default();
        f.watch(&stream);
        f.watch(&[0x88, 0x02, 0x03]);
        assert!(!f.between());
        f.watch(&[0xE8]);
        assert!(f.closed && f.between());
    }
    use crate::cluster::signing::{KEY_HEADER, SIGNATURE_HEADER};
    use axum::extract::ws::{Message as WsFrame, WebSocketUpgrade};
    use axum::routing::{any, get, post};
    use axum::Router;
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message as ClientFrame;

    const SUBPROTOCOL: &str = "v1.kernel.websocket.jupyter.org";

    async fn serve(router: Router) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, router).await });
        format!("http://{addr}")
    }

    /// An owner that echoes what it got: headers, a streamed body, WebSocket frames (only
    /// with a signature, choosing the v1 subprotocol when offered, as the gateway does).
    async fn owner(signer: Arc<Signer>) -> String {
        let headers = get(|h: HeaderMap| async move {
            let mut names: Vec<String> = h.keys().map(|k| k.to_string()).collect();
            names.sort();
            axum::Json(serde_json::json!({
                "names": names, "key": h.get(KEY_HEADER).and_then(|v| v.to_str().ok()),
            }))
        });
        let stream = post(|body: Body| async move {
            let lines = body.into_data_stream().map_ok(|chunk| {
                let mut line = chunk.to_vec();
                line.push(b'\n');
                bytes::Bytes::from(line)
            });
            Body::from_stream(lines)
        });
        let ws = any(move |h: HeaderMap, req: Request| {
            let signer = signer.clone();
            async move {
                let path = req.uri().path().to_owned();
                if signer
                    .verify("GET", &path, &h, chrono::Utc::now().timestamp())
                    .is_err()
                {
                    return axum::http::StatusCode::FORBIDDEN.into_response();
                }
                let (mut parts, _) = req.into_parts();
                let Ok(upgrade) = WebSocketUpgrade::from_request_parts(&mut parts, &()).await
                else {
                    return axum::http::StatusCode::BAD_REQUEST.into_response();
                };
                upgrade
                    .protocols([SUBPROTOCOL])
                    .on_upgrade(|mut socket| async move {
                        while let Some(Ok(frame)) = socket.recv().await {
                            if matches!(frame, WsFrame::Close(_))
                                || socket.send(frame).await.is_err()
                            {
                                break;
                            }
                        }
                    })
            }
        });
        serve(
            Router::new()
                .route("/headers", headers)
                .route("/stream", stream)
                .route("/ws", ws),
        )
        .await
    }

    use axum::extract::FromRequestParts;
    use axum::response::IntoResponse;

    /// An entry node that forwards everything to `owner` as key `alice`.
    async fn entry(signer: Arc<Signer>, owner: String) -> String {
        entry_watching(signer, owner, never_left()).await
    }

    /// [`entry`], with calls that end when `left` resolves.
    async fn entry_watching(signer: Arc<Signer>, owner: String, left: Left) -> String {
        let forwarder = Arc::new(
            Forwarder::new(
                signer,
                "entry-1",
                TaskTracker::new(),
                CancellationToken::new(),
            )
            .expect("forwarder"),
        );
        let router = Router::new().fallback(move |mut req: Request| {
            let (forwarder, owner, left) = (forwarder.clone(), owner.clone(), left.clone());
            async move {
                strip_internal(req.headers_mut());
                let record = NodeRecord {
                    address: owner.clone(),
                    cluster_address: Some(owner.replace("http://", "https://")),
                    incarnation: "i1".into(),
                    capacity: 1,
                    load: 0,
                    version: String::new(),
                    specs: Vec::new(),
                    warm: Default::default(),
                    away: false,
                };
                match forwarder
                    .forward("owner-1", &record, "alice", "req-1", true, req, left)
                    .await
                {
                    Ok(r) => r.into_response(),
                    Err(e) => {
                        (axum::http::StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response()
                    }
                }
            }
        });
        serve(router).await
    }

    #[tokio::test]
    async fn requests_and_websockets_reach_the_owner_signed_and_without_credentials() {
        let signer = Arc::new(Signer::new(b"secret"));
        let owner_url = owner(signer.clone()).await;
        let entry_url = entry(signer.clone(), owner_url).await;
        let http = reqwest::Client::new();

        // Credentials and forged internal headers stay at the entry; the signed ones arrive.
        let seen: serde_json::Value = http
            .get(format!("{entry_url}/headers?token=t0ken&x=1"))
            .header("Authorization", "token t0ken")
            .header(KEY_HEADER, "admin")
            .header(SIGNATURE_HEADER, "forged")
            .send()
            .await
            .expect("forwarded")
            .json()
            .await
            .expect("json");
        assert_eq!(seen["key"], "alice", "{seen}");
        let names = seen["names"].to_string();
        assert!(!names.contains("authorization"), "{names}");
        assert!(names.contains("x-kernelgate-signature"), "{names}");

        // A streamed body goes through in both directions.
        let body = http
            .post(format!("{entry_url}/stream"))
            .body("line one")
            .send()
            .await
            .expect("forwarded")
            .text()
            .await
            .expect("text");
        assert_eq!(body, "line one\n");

        // A WebSocket: the owner's 101 with its subprotocol; text and binary frames intact.
        let (mut ws, response) = websocket_through(&entry_url).await;
        assert_eq!(
            response
                .headers()
                .get("sec-websocket-protocol")
                .map(|v| v.as_bytes()),
            Some(SUBPROTOCOL.as_bytes())
        );
        let binary = vec![0u8, 159, 146, 150, 255];
        ws.send(ClientFrame::text("héllo")).await.expect("send");
        ws.send(ClientFrame::binary(binary.clone()))
            .await
            .expect("send");
        let first = ws.next().await.expect("echo").expect("frame");
        let second = ws.next().await.expect("echo").expect("frame");
        assert_eq!(first, ClientFrame::text("héllo"));
        assert_eq!(second, ClientFrame::binary(binary));
    }

    #[tokio::test]
    async fn an_owner_that_refuses_the_upgrade_is_answered_as_it_is_and_a_dead_one_is_unreachable()
    {
        let signer = Arc::new(Signer::new(b"secret"));
        let owner_url = owner(Arc::new(Signer::new(b"another secret"))).await;
        let entry_url = entry(signer, owner_url).await;
        let request = format!("{}/ws", entry_url.replace("http://", "ws://"))
            .into_client_request()
            .expect("request");
        match tokio_tungstenite::connect_async(request).await {
            Err(tokio_tungstenite::tungstenite::Error::Http(r)) => {
                assert_eq!(r.status().as_u16(), 403, "the owner's refusal")
            }
            other => panic!("expected the owner's 403, got {other:?}"),
        }
        // Nothing listens on the owner's address any more.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let entry_url = entry(
            Arc::new(Signer::new(b"s")),
            format!("http://127.0.0.1:{port}"),
        )
        .await;
        let r = reqwest::get(format!("{entry_url}/headers"))
            .await
            .expect("answer");
        assert_eq!(r.status().as_u16(), 503);
    }

    /// A WebSocket to the owner's `/ws`, through the entry node at `entry_url`, asking for
    /// the Jupyter subprotocol.
    async fn websocket_through(
        entry_url: &str,
    ) -> (
        tokio_tungstenite::WebSocketStream<
            tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
        >,
        tokio_tungstenite::tungstenite::handshake::client::Response,
    ) {
        let mut request = format!("{}/ws", entry_url.replace("http://", "ws://"))
            .into_client_request()
            .expect("request");
        request.headers_mut().insert(
            "sec-websocket-protocol",
            HeaderValue::from_static(SUBPROTOCOL),
        );
        tokio_tungstenite::connect_async(request)
            .await
            .expect("the upgrade goes through")
    }

    /// A `Left` and the switch that fires it.
    fn switch() -> (tokio::sync::oneshot::Sender<()>, Left) {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        (
            tx,
            async move {
                let _ = rx.await;
            }
            .boxed()
            .shared(),
        )
    }

    /// A TLS listener that shows `tls`'s certificate and keeps what it reads after a
    /// handshake: (its address, connections, bytes read).
    async fn planted(
        tls: &ClusterTls,
    ) -> (
        std::net::SocketAddr,
        Arc<std::sync::atomic::AtomicUsize>,
        Arc<Mutex<Vec<u8>>>,
    ) {
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config().expect("config"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let read = Arc::new(Mutex::new(Vec::new()));
        let (counted, kept) = (connections.clone(), read.clone());
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let (acceptor, kept) = (acceptor.clone(), kept.clone());
                tokio::spawn(async move {
                    let Ok(mut stream) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = stream.read(&mut buf).await {
                        kept.lock().expect("lock").extend_from_slice(&buf[..n]);
                    }
                });
            }
        });
        (addr, connections, read)
    }

    #[tokio::test]
    async fn with_tls_a_server_that_is_not_the_owner_gets_no_byte_of_a_call_or_an_upgrade() {
        let ca = crate::cluster::tls::tests::Ca::new();
        let forwarder = Forwarder::new(
            Arc::new(Signer::new(b"secret")),
            "node-1",
            TaskTracker::new(),
            CancellationToken::new(),
        )
        .expect("forwarder")
        .with_tls(Some(Arc::new(ca.tls("node-1"))));
        // The registry says node-2 is there; what answers shows node-3's certificate.
        let (addr, connections, read) = planted(&ca.tls("node-3")).await;
        let record = |cluster_address: Option<String>| NodeRecord {
            address: format!("http://{addr}"),
            cluster_address,
            incarnation: "i1".into(),
            capacity: 1,
            load: 0,
            version: String::new(),
            specs: Vec::new(),
            warm: Default::default(),
            away: false,
        };
        let planted = record(Some(format!("https://{addr}")));
        let call = || {
            axum::http::Request::builder()
                .method("POST")
                .uri("/api/kernels/k/execute")
                .body(Body::from("print('pwned')"))
                .expect("request")
        };
        let upgrade = || {
            axum::http::Request::builder()
                .uri("/api/kernels/k/channels")
                .header("connection", "Upgrade")
                .header("upgrade", "websocket")
                .body(Body::empty())
                .expect("request")
        };
        for req in [call(), upgrade()] {
            let answer = forwarder
                .forward("node-2", &planted, "alice", "r", true, req, never_left())
                .await;
            match answer {
                Err(ForwardError::Unreachable { node, reason }) => {
                    assert_eq!(node, "node-2");
                    assert!(reason.contains("certificate"), "{reason}");
                }
                other => panic!("expected node-2 unreachable, got {other:?}"),
            }
        }
        assert_eq!(connections.load(std::sync::atomic::Ordering::SeqCst), 2);
        // A record without a cluster address: not called at all, not even in clear.
        let plain = record(None);
        let answer = forwarder
            .forward("node-2", &plain, "alice", "r", true, call(), never_left())
            .await;
        assert!(
            matches!(answer, Err(ForwardError::Unreachable { .. })),
            "{answer:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(connections.load(std::sync::atomic::Ordering::SeqCst), 2);
        let read = read.lock().expect("lock");
        assert!(read.is_empty(), "{:?}", String::from_utf8_lossy(&read));
    }

    #[tokio::test]
    async fn calls_and_websockets_end_when_their_owner_leaves_the_cluster() {
        // An owner partitioned away: connections open, nothing ever answers.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let silent_url = format!("http://{}", silent.local_addr().expect("addr"));
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = silent.accept().await {
                held.push(socket);
            }
        });
        let signer = Arc::new(Signer::new(b"secret"));
        let (leave, left) = switch();
        let entry_url = entry_watching(signer.clone(), silent_url, left).await;
        let call = tokio::spawn(reqwest::get(format!("{entry_url}/headers")));
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !call.is_finished(),
            "waits while the owner is in the cluster"
        );
        let _ = leave.send(());
        let answer = call.await.expect("task").expect("an answer");
        assert_eq!(answer.status().as_u16(), 503);
        let text = answer.text().await.expect("text");
        assert!(text.contains("left the cluster"), "{text}");

        // A spliced WebSocket whose owner leaves: the client hears 1001, going away.
        let owner_url = owner(signer.clone()).await;
        let (leave, left) = switch();
        let entry_url = entry_watching(signer, owner_url, left).await;
        let (mut ws, _) = websocket_through(&entry_url).await;
        ws.send(ClientFrame::text("still here"))
            .await
            .expect("send");
        assert_eq!(
            ws.next().await.expect("echo").expect("frame"),
            ClientFrame::text("still here")
        );
        let _ = leave.send(());
        match ws.next().await {
            Some(Ok(ClientFrame::Close(Some(close)))) => {
                assert_eq!(u16::from(close.code), 1001)
            }
            other => panic!("expected a close frame with 1001, got {other:?}"),
        }
    }
}
