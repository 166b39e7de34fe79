//! The forwarding layer: a request for a kernel another node owns goes to that node as the
//! client sent it (method, path, query, headers, body), less the client's credentials and
//! any internal header, plus the identity the entry node vouches for, signed with the
//! cluster secret for that one node and that one body ([`super::signing`]). The body is read
//! whole first, to hash it: in memory up to [`IN_MEMORY`], in an unnamed temporary file
//! beyond (a file upload), at most `--max-message-mb` either way; the answer streams back as
//! the owner sends it. A WebSocket is forwarded as the HTTP Upgrade itself: the owner checks
//! the request, negotiates the subprotocol and answers `101` with a challenge; this node's
//! first frame to it answers the challenge (the owner serves the socket only then), and the
//! bytes are spliced both ways; no frame of the client's or the owner's is ever decoded or
//! re-encoded here. With the cluster's TLS on ([`super::tls`]), both go to the owner's
//! cluster listener, over TLS with this node's certificate, and only to a server whose
//! certificate names the owner: the signature still binds each call to that node, its run
//! and its body.

use super::signing::{Forwarded, Signer, CHALLENGE_HEADER, HEADER_PREFIX};
use super::tls::ClusterTls;
use super::NodeRecord;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Response};
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt, TryStreamExt};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncSeekExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long connecting to the owner may take before it counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The most an owner's answer to an upgrade may hold before its body.
const MAX_HEAD: usize = 64 * 1024;
/// A forwarded body larger than this waits in a temporary file, not in memory.
pub const IN_MEMORY: usize = 1 << 20;

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

/// What went wrong with a forwarded call. The messages name the node by its id only: the
/// address called and the HTTP or TLS library's words are in the fields, for the log.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// The owner did not answer: the client should try again shortly.
    #[error("node {node} of the cluster cannot be reached now")]
    Unreachable {
        node: String,
        address: String,
        reason: String,
    },
    /// The owner answered something that is not HTTP.
    #[error("node {node} of the cluster answered something that is not HTTP")]
    BadAnswer { node: String, address: String },
    /// The owner left the cluster (its lease ended) before it answered.
    #[error("node {node} left the cluster")]
    OwnerLeft { node: String },
    /// The client's body is larger than a node takes.
    #[error("the request's body is larger than {limit} bytes (--max-message-mb)")]
    TooLarge { limit: usize },
    /// The client's body could not be read (cut short), or not kept for sending.
    #[error("the request's body could not be read whole: {0}")]
    Body(String),
}

/// The node a call goes to, as the registry names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    /// Its node id.
    pub node: String,
    /// Its incarnation (the random id of its current run).
    pub incarnation: String,
    /// Its address, `http://host:port` (`--advertise`).
    pub address: String,
    /// Its cluster listener, `https://host:port`, when it serves one (`--cluster-listen`).
    pub cluster_address: Option<String>,
}

impl Destination {
    /// Node `node` as its registry record says to reach it.
    pub fn of(node: &str, record: &NodeRecord) -> Destination {
        Destination {
            node: node.to_owned(),
            incarnation: record.incarnation.clone(),
            address: record.address.clone(),
            cluster_address: record.cluster_address.clone(),
        }
    }
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
    /// The largest body forwarded (`--max-message-mb`).
    max_body: usize,
}

/// A request's body, read whole and hashed.
struct Spooled {
    sha256: String,
    len: u64,
    data: Spool,
}

enum Spool {
    Memory(bytes::Bytes),
    /// An unnamed temporary file (gone with its handle), at its start.
    File(tokio::fs::File),
}

/// Reads `body` whole, hashing it: in memory up to [`IN_MEMORY`], in a temporary file
/// beyond, refused past `max` bytes.
async fn spool(body: Body, max: usize) -> Result<Spooled, ForwardError> {
    let mut stream = body.into_data_stream();
    let mut hash = Sha256::new();
    let mut memory = bytes::BytesMut::new();
    let mut file: Option<tokio::fs::File> = None;
    let mut len: u64 = 0;
    let kept = |e: std::io::Error| ForwardError::Body(format!("cannot keep it to send: {e}"));
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ForwardError::Body(e.to_string()))?;
        len += chunk.len() as u64;
        if len > max as u64 {
            return Err(ForwardError::TooLarge { limit: max });
        }
        hash.update(&chunk);
        if file.is_none() && memory.len() + chunk.len() <= IN_MEMORY {
            memory.extend_from_slice(&chunk);
            continue;
        }
        if file.is_none() {
            let std_file = tokio::task::spawn_blocking(tempfile::tempfile)
                .await
                .map_err(|e| ForwardError::Body(e.to_string()))?
                .map_err(kept)?;
            let mut f = tokio::fs::File::from_std(std_file);
            f.write_all(&memory).await.map_err(kept)?;
            memory.clear();
            file = Some(f);
        }
        if let Some(f) = file.as_mut() {
            f.write_all(&chunk).await.map_err(kept)?;
        }
    }
    let data = match file {
        None => Spool::Memory(memory.freeze()),
        Some(mut f) => {
            f.flush().await.map_err(kept)?;
            f.seek(std::io::SeekFrom::Start(0)).await.map_err(kept)?;
            Spool::File(f)
        }
    };
    Ok(Spooled {
        sha256: hex::encode(hash.finalize()),
        len,
        data,
    })
}

impl Spooled {
    fn into_body(self) -> reqwest::Body {
        match self.data {
            Spool::Memory(bytes) => reqwest::Body::from(bytes),
            Spool::File(file) => {
                let chunks = futures::stream::unfold(file, |mut file| async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    match file.read(&mut buf).await {
                        Ok(0) => None,
                        Ok(n) => {
                            buf.truncate(n);
                            Some((Ok::<_, std::io::Error>(bytes::Bytes::from(buf)), file))
                        }
                        Err(e) => Some((Err(e), file)),
                    }
                });
                reqwest::Body::wrap_stream(chunks)
            }
        }
    }
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

/// The client's headers that go on to the owner (its `Content-Length` is the spooled
/// body's, set anew).
fn forwarded_headers(headers: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    headers
        .iter()
        .filter(|(name, _)| {
            let n = name.as_str();
            !NOT_FORWARDED.contains(&n) && !n.starts_with(HEADER_PREFIX) && n != "content-length"
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
            max_body: usize::MAX,
        })
    }

    /// The same, forwarding bodies of at most `max_body` bytes (`--max-message-mb`).
    pub fn bounded(mut self, max_body: usize) -> Forwarder {
        self.max_body = max_body;
        self
    }

    /// Calls to other nodes over mutual TLS, to their cluster listeners.
    pub fn with_tls(mut self, tls: Option<Arc<ClusterTls>>) -> Forwarder {
        self.tls = tls;
        self
    }

    /// Where calls to `to` go: its cluster listener with TLS on, else its address.
    fn base_of<'a>(&self, to: &'a Destination) -> Result<&'a str, ForwardError> {
        if self.tls.is_none() {
            return Ok(&to.address);
        }
        match &to.cluster_address {
            Some(url) if url.starts_with("https://") => Ok(url),
            _ => Err(ForwardError::Unreachable {
                node: to.node.clone(),
                address: to.address.clone(),
                reason: "it serves no TLS cluster listener (--cluster-listen), and this node calls no other way".into(),
            }),
        }
    }

    /// The HTTP client for calls to `to`, at `base`.
    fn client_for(&self, to: &Destination, base: &str) -> Result<reqwest::Client, ForwardError> {
        let Some(tls) = &self.tls else {
            return Ok(self.http.clone());
        };
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = peers.get(&to.node) {
            return Ok(client.clone());
        }
        let unreachable = |reason: String| ForwardError::Unreachable {
            node: to.node.clone(),
            address: base.to_owned(),
            reason,
        };
        let config = tls.client_config(&to.node).map_err(unreachable)?;
        let client = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .https_only(true)
            .use_preconfigured_tls((*config).clone())
            .build()
            .map_err(|e| unreachable(e.to_string()))?;
        peers.insert(to.node.clone(), client.clone());
        Ok(client)
    }

    /// Sends `req` to node `to`, on behalf of the client key `key` (`registered`: whether
    /// this node holds its lease); the owner's answer, streamed. Each call is signed anew,
    /// for `to` alone, and (TLS on) goes only to a server whose certificate names `to`.
    pub async fn forward(
        &self,
        to: &Destination,
        key: &str,
        registered: bool,
        req: Request,
        left: Left,
    ) -> Result<Response<Body>, ForwardError> {
        let path = forwarded_path(&req);
        let gone = || ForwardError::OwnerLeft {
            node: to.node.clone(),
        };
        let base = self.base_of(to)?;
        let who = Forwarded::new(key, &self.node_id, registered, &to.node, &to.incarnation);
        // The owner's audit trail names the call by this id; the client's own (if any) goes
        // on as its `X-Request-Id` header.
        tracing::debug!(to = %to.node, forwarded_as = %who.request_id, "forwarding");
        if is_upgrade(req.headers()) {
            return tokio::select! {
                biased;
                answer = self.upgrade(to, base, &path, who, req, left.clone()) => answer,
                () = left => Err(gone()),
            };
        }
        let unreachable = |e: reqwest::Error| ForwardError::Unreachable {
            node: to.node.clone(),
            address: base.to_owned(),
            // The TLS error that refused the owner's certificate is in the source chain.
            reason: error_chain(&e),
        };
        let method = reqwest::Method::from_bytes(req.method().as_str().as_bytes())
            .unwrap_or(reqwest::Method::GET);
        let (parts, body) = req.into_parts();
        let spooled = tokio::select! {
            biased;
            spooled = spool(body, self.max_body) => spooled?,
            () = left.clone() => return Err(gone()),
        };
        let who = who.with_body(spooled.sha256.clone());
        let signed = self.signer.sign(parts.method.as_str(), &path, &who);
        let mut request = self
            .client_for(to, base)?
            .request(method, format!("{base}{path}"));
        for (name, value) in forwarded_headers(&parts.headers) {
            request = request.header(name.as_str(), value.as_bytes());
        }
        for (name, value) in signed {
            request = request.header(name, value);
        }
        // From memory the length is known to the HTTP client; from a file it is said here.
        if matches!(spooled.data, Spool::File(_)) {
            request = request.header(header::CONTENT_LENGTH.as_str(), spooled.len);
        }
        let sent = request.body(spooled.into_body()).send();
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
            node: to.node.clone(),
            address: base.to_owned(),
        })
    }

    /// A WebSocket upgrade: the request goes to the owner on a connection of its own; if the
    /// owner answers `101`, that answer goes to the client and the two connections are
    /// spliced; any other answer goes to the client as it is.
    async fn upgrade(
        &self,
        to: &Destination,
        base: &str,
        path: &str,
        who: Forwarded,
        req: Request,
        left: Left,
    ) -> Result<Response<Body>, ForwardError> {
        let unreachable = |reason: String| ForwardError::Unreachable {
            node: to.node.clone(),
            address: base.to_owned(),
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
                .upgrade_over(owner, to, base, authority, path, who, req, left)
                .await;
        };
        // The handshake checks the owner's certificate before a byte of the request goes.
        let config = tls.client_config(&to.node).map_err(unreachable)?;
        let name = super::tls::node_name(&to.node).map_err(|e| unreachable(e.to_string()))?;
        let owner = tokio::time::timeout(
            CONNECT_TIMEOUT,
            tokio_rustls::TlsConnector::from(config).connect(name, owner),
        )
        .await
        .map_err(|_| unreachable("TLS handshake timed out".into()))?
        .map_err(|e| unreachable(format!("TLS handshake failed: {e}")))?;
        self.upgrade_over(owner, to, base, authority, path, who, req, left)
            .await
    }

    /// [`Forwarder::upgrade`] on a connection to the owner (`authority` of `base`), plain
    /// or TLS: the signed request, the owner's answer, the proof frame, the splice.
    #[allow(clippy::too_many_arguments)]
    async fn upgrade_over<S>(
        &self,
        mut owner: S,
        to: &Destination,
        base: &str,
        authority: &str,
        path: &str,
        who: Forwarded,
        mut req: Request,
        left: Left,
    ) -> Result<Response<Body>, ForwardError>
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let unreachable = |reason: String| ForwardError::Unreachable {
            node: to.node.clone(),
            address: base.to_owned(),
            reason,
        };
        let bad_answer = || ForwardError::BadAnswer {
            node: to.node.clone(),
            address: base.to_owned(),
        };
        let signed = self.signer.sign(req.method().as_str(), path, &who);
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
        send_now(&mut owner, head.as_bytes())
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
                _ => return Err(bad_answer()),
            }
        };
        let rest = buf.split_off(head_len);
        let mut answer = Response::builder().status(status);
        for (name, value) in &headers {
            let hop = NOT_FORWARDED.contains(&name.as_str()) && status != 101;
            if !hop && name != "content-length" && !name.starts_with(HEADER_PREFIX) {
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
            return answer.body(Body::from(body)).map_err(|_| bad_answer());
        }
        let Some(on_upgrade) = req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>() else {
            return Err(bad_answer());
        };
        // The owner's challenge, answered before any byte of the client's.
        let Some(challenge) = headers
            .iter()
            .find(|(n, _)| n == CHALLENGE_HEADER)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
        else {
            return Err(bad_answer());
        };
        let proof = self.signer.upgrade_proof(&who.nonce, challenge);
        send_now(&mut owner, &masked_text_frame(proof.as_bytes()))
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let cancel = self.cancel.clone();
        self.tracker.spawn(async move {
            let Ok(upgraded) = on_upgrade.await else {
                return;
            };
            let mut client = TokioIo::new(upgraded);
            splice(&mut client, owner, &rest, cancel, left).await;
        });
        answer.body(Body::empty()).map_err(|_| bad_answer())
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

/// A client-to-server text frame (masked, as RFC 6455 §5.3 wants) of a short `payload`.
fn masked_text_frame(payload: &[u8]) -> Vec<u8> {
    let mask: [u8; 4] = rand::random();
    let mut frame = vec![0x81];
    match payload.len() {
        n @ 0..=125 => frame.push(0x80 | n as u8),
        n => {
            frame.push(0x80 | 126);
            frame.extend((n.min(usize::from(u16::MAX)) as u16).to_be_bytes());
        }
    }
    frame.extend(mask);
    frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    frame
}

/// The close frame the entry node sends when the owner's side ends without one (the owner
/// died, or this node stops): 1001, going away, so that clients reconnect.
const GOING_AWAY: [u8; 4] = [0x88, 0x02, 0x03, 0xE9];

/// Writes `bytes` to `to` and flushes them: over TLS, what is written may wait in the
/// session until flushed.
async fn send_now<S: AsyncWrite + Unpin>(to: &mut S, bytes: &[u8]) -> std::io::Result<()> {
    to.write_all(bytes).await?;
    to.flush().await
}

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
    use crate::cluster::signing::{body_digest, KEY_HEADER, SIGNATURE_HEADER};
    use axum::extract::ws::{Message as WsFrame, WebSocketUpgrade};
    use axum::routing::{any, get, post};
    use axum::Router;
    use futures::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message as ClientFrame;

    const SUBPROTOCOL: &str = "v1.kernel.websocket.jupyter.org";
    const OWNER: &str = "owner-1";
    const RUN: &str = "run-1";
    const MAX_BODY: usize = 4 << 20;

    /// A signer of the cluster with `secret`, as the owner has it.
    fn signer_of(secret: &[u8]) -> Arc<Signer> {
        Arc::new(Signer::new(secret, OWNER, RUN))
    }

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
        let checked = signer.clone();
        let digest = post(move |h: HeaderMap, req: Request| {
            let signer = checked.clone();
            async move {
                let path = req.uri().path().to_owned();
                let body = axum::body::to_bytes(req.into_body(), usize::MAX)
                    .await
                    .unwrap_or_default();
                let now = chrono::Utc::now().timestamp();
                let taken = signer
                    .verify("POST", &path, &h, now)
                    .and_then(|c| signer.accept(c, &body_digest(&body), now));
                match taken {
                    Ok(_) => (axum::http::StatusCode::OK, body.len().to_string()).into_response(),
                    Err(e) => (axum::http::StatusCode::FORBIDDEN, e.to_string()).into_response(),
                }
            }
        });
        let ws = any(move |h: HeaderMap, req: Request| {
            let signer = signer.clone();
            async move {
                let path = req.uri().path().to_owned();
                let now = chrono::Utc::now().timestamp();
                let Ok(who) = signer
                    .verify("GET", &path, &h, now)
                    .and_then(|c| signer.accept(c, &body_digest(b""), now))
                else {
                    return axum::http::StatusCode::FORBIDDEN.into_response();
                };
                let challenge = Signer::challenge();
                let (mut parts, _) = req.into_parts();
                let Ok(upgrade) = WebSocketUpgrade::from_request_parts(&mut parts, &()).await
                else {
                    return axum::http::StatusCode::BAD_REQUEST.into_response();
                };
                let answered = challenge.clone();
                let mut response =
                    upgrade
                        .protocols([SUBPROTOCOL])
                        .on_upgrade(move |mut socket| async move {
                            // Served only once the entry node answers the challenge.
                            let proved = match socket.recv().await {
                                Some(Ok(WsFrame::Text(t))) => {
                                    signer.proves(&who.nonce, &answered, t.as_str())
                                }
                                _ => false,
                            };
                            if !proved {
                                return;
                            }
                            while let Some(Ok(frame)) = socket.recv().await {
                                if matches!(frame, WsFrame::Close(_))
                                    || socket.send(frame).await.is_err()
                                {
                                    break;
                                }
                            }
                        });
                response.headers_mut().insert(
                    CHALLENGE_HEADER,
                    HeaderValue::from_str(&challenge).expect("hex"),
                );
                response
            }
        });
        serve(
            Router::new()
                .route("/headers", headers)
                .route("/stream", stream)
                .route("/digest", digest)
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
            .expect("forwarder")
            .bounded(MAX_BODY),
        );
        let to = Destination {
            node: OWNER.into(),
            incarnation: RUN.into(),
            address: owner,
            cluster_address: None,
        };
        let router = Router::new().fallback(move |mut req: Request| {
            let (forwarder, to, left) = (forwarder.clone(), to.clone(), left.clone());
            async move {
                strip_internal(req.headers_mut());
                match forwarder.forward(&to, "alice", true, req, left).await {
                    Ok(r) => r.into_response(),
                    Err(e @ ForwardError::TooLarge { .. }) => {
                        (axum::http::StatusCode::PAYLOAD_TOO_LARGE, e.to_string()).into_response()
                    }
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
        let signer = signer_of(b"secret");
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

        // Bodies signed with their digest: a small one from memory, one past IN_MEMORY from
        // its temporary file; one past the bound is refused at the entry.
        for len in [10, IN_MEMORY + 12_345] {
            let body: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let answer = http
                .post(format!("{entry_url}/digest"))
                .body(body)
                .send()
                .await
                .expect("forwarded");
            assert_eq!(answer.status().as_u16(), 200, "{len} bytes");
            assert_eq!(answer.text().await.expect("text"), len.to_string());
        }
        let answer = http
            .post(format!("{entry_url}/digest"))
            .body(vec![0u8; MAX_BODY + 1])
            .send()
            .await
            .expect("answered");
        assert_eq!(answer.status().as_u16(), 413);

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
        let signer = signer_of(b"secret");
        let owner_url = owner(signer_of(b"another secret")).await;
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
        let entry_url = entry(signer_of(b"s"), format!("http://127.0.0.1:{port}")).await;
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
            Arc::new(Signer::new(b"secret", "node-1", "i0")),
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
        let planted = Destination::of("node-2", &record(Some(format!("https://{addr}"))));
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
                .forward(&planted, "alice", true, req, never_left())
                .await;
            match answer {
                Err(ForwardError::Unreachable { node, reason, .. }) => {
                    assert_eq!(node, "node-2");
                    assert!(reason.contains("certificate"), "{reason}");
                }
                other => panic!("expected node-2 unreachable, got {other:?}"),
            }
        }
        assert_eq!(connections.load(std::sync::atomic::Ordering::SeqCst), 2);
        // A record without a cluster address: not called at all, not even in clear.
        let plain = Destination::of("node-2", &record(None));
        let answer = forwarder
            .forward(&plain, "alice", true, call(), never_left())
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
        let signer = signer_of(b"secret");
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
