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

use super::signing::{Forwarded, Signer, HEADER_PREFIX};
use super::tls::ClusterTls;
use super::NodeRecord;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Response};
use futures::future::{BoxFuture, Shared};
use futures::{FutureExt, StreamExt, TryStreamExt};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
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

mod splice;

#[cfg(test)]
mod tests;
