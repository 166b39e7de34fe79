//! WebSocket upgrades to the owner: the owner's 101 checked, then bytes spliced both ways,
//! frames followed so a node that leaves closes each socket between frames with a proper
//! close frame.

use super::{
    forwarded_headers, Destination, ForwardError, Forwarder, Left, CONNECT_TIMEOUT, MAX_HEAD,
    NOT_FORWARDED,
};
use crate::cluster::signing::{Forwarded, CHALLENGE_HEADER, HEADER_PREFIX};
use axum::body::Body;
use axum::extract::Request;
use axum::http::Response;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// A client-to-server text frame (masked, as RFC 6455 §5.3 wants) of a short `payload`.
pub(super) fn masked_text_frame(payload: &[u8]) -> Vec<u8> {
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
pub(super) const GOING_AWAY: [u8; 4] = [0x88, 0x02, 0x03, 0xE9];

/// Writes `bytes` to `to` and flushes them: over TLS, what is written may wait in the
/// session until flushed.
pub(super) async fn send_now<S: AsyncWrite + Unpin>(
    to: &mut S,
    bytes: &[u8],
) -> std::io::Result<()> {
    to.write_all(bytes).await?;
    to.flush().await
}

/// Copies bytes both ways until either side ends. The owner's bytes are only watched (frame
/// boundaries and opcodes, never changed): when they end without a close frame, between
/// frames, or the owner leaves the cluster, the client gets [`GOING_AWAY`] instead of a bare
/// end of its connection.
pub(super) async fn splice<C, S>(
    client: &mut C,
    owner: S,
    first: &[u8],
    cancel: CancellationToken,
    left: Left,
) where
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
pub(super) struct Frames {
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
pub(super) fn header(head: &[u8]) -> Option<(u8, u64)> {
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

impl Forwarder {
    /// A WebSocket upgrade: the request goes to the owner on a connection of its own; if the
    /// owner answers `101`, that answer goes to the client and the two connections are
    /// spliced; any other answer goes to the client as it is.
    pub(super) async fn upgrade(
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
        let name =
            crate::cluster::tls::node_name(&to.node).map_err(|e| unreachable(e.to_string()))?;
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
    pub(super) async fn upgrade_over<S>(
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
}
