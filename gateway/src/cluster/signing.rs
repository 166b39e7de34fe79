//! How a node tells another whose request it forwards. The entry node authenticates the
//! client; the call it forwards carries the client's key name, the entry node's id and the
//! request id in headers, with an HMAC-SHA256 over those, the method, the path and a
//! timestamp, keyed with the cluster secret (`--cluster-secret-file`). The secret itself
//! never travels, so a node address planted in the registry harvests nothing. The owner
//! accepts a signature once, within [`WINDOW`] of its timestamp: a captured call cannot be
//! replayed. Client requests never carry these headers: the entry node strips them.

use axum::http::HeaderMap;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

/// Every internal header starts with this; the entry node removes them from client requests.
pub const HEADER_PREFIX: &str = "x-kernelgate-";
pub const KEY_HEADER: &str = "x-kernelgate-key";
pub const ENTRY_HEADER: &str = "x-kernelgate-entry";
pub const REQUEST_ID_HEADER: &str = "x-kernelgate-request-id";
pub const TIMESTAMP_HEADER: &str = "x-kernelgate-timestamp";
pub const REGISTERED_HEADER: &str = "x-kernelgate-entry-registered";
pub const SIGNATURE_HEADER: &str = "x-kernelgate-signature";

/// How far a forwarded call's timestamp may be from the owner's clock.
pub const WINDOW: Duration = Duration::from_secs(30);
/// Signatures remembered to refuse replays; past this the oldest are forgotten early.
const MAX_REMEMBERED: usize = 100_000;

/// Who asked, as the owner learns it from a forwarded call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Forwarded {
    /// The name of the client's key (a tenant of the keys file every node loads).
    pub key: String,
    /// The node the client reached.
    pub entry: String,
    pub request_id: String,
    /// Seconds since the Unix epoch, when the entry node signed the call.
    pub timestamp: i64,
    /// Whether the entry node held its lease when it signed: an owner cut off from the
    /// registry refuses work from a node that is not (the others may have given its
    /// kernels up), and serves it when the registry is down for everyone.
    pub entry_registered: bool,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SignatureError {
    #[error("a forwarded call without the {0} header")]
    Missing(&'static str),
    #[error("a forwarded call whose signature does not match")]
    Mismatch,
    #[error("a forwarded call signed {0} s away from this node's clock (more than the window)")]
    Stale(i64),
    #[error("a forwarded call seen before (replayed)")]
    Replayed,
}

/// Signs and checks forwarded calls with the cluster secret.
pub struct Signer {
    secret: Vec<u8>,
    seen: Mutex<Seen>,
}

/// Signatures accepted within the window.
#[derive(Debug, Default)]
struct Seen {
    /// Oldest first, with their timestamps.
    order: VecDeque<(i64, String)>,
    index: HashSet<String>,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer").finish_non_exhaustive()
    }
}

impl Signer {
    pub fn new(secret: &[u8]) -> Signer {
        Signer {
            secret: secret.to_vec(),
            seen: Mutex::new(Seen::default()),
        }
    }

    fn mac(&self, method: &str, path: &str, who: &Forwarded) -> Hmac<Sha256> {
        // Fields end with a newline and none may contain one (checked by `sign`), so no two
        // different calls sign the same bytes.
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.secret)
            .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
        for field in [
            "kernelgate-forward-v1",
            method,
            path,
            &who.key,
            &who.entry,
            &who.request_id,
            &who.timestamp.to_string(),
            registered(who.entry_registered),
        ] {
            mac.update(field.as_bytes());
            mac.update(b"\n");
        }
        mac
    }

    /// The headers of a forwarded call: `path` is the path and query as sent to the owner.
    pub fn sign(&self, method: &str, path: &str, who: &Forwarded) -> Vec<(&'static str, String)> {
        let clean = |s: &str| s.replace(['\n', '\r'], " ");
        let who = Forwarded {
            key: clean(&who.key),
            entry: clean(&who.entry),
            request_id: clean(&who.request_id),
            timestamp: who.timestamp,
            entry_registered: who.entry_registered,
        };
        let signature = hex::encode(self.mac(method, &clean(path), &who).finalize().into_bytes());
        vec![
            (KEY_HEADER, who.key),
            (ENTRY_HEADER, who.entry),
            (REQUEST_ID_HEADER, who.request_id),
            (TIMESTAMP_HEADER, who.timestamp.to_string()),
            (
                REGISTERED_HEADER,
                registered(who.entry_registered).to_owned(),
            ),
            (SIGNATURE_HEADER, signature),
        ]
    }

    /// Checks a forwarded call's headers at time `now` (seconds since the epoch): who
    /// asked, once.
    pub fn verify(
        &self,
        method: &str,
        path: &str,
        headers: &HeaderMap,
        now: i64,
    ) -> Result<Forwarded, SignatureError> {
        let get = |name: &'static str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .ok_or(SignatureError::Missing(name))
        };
        let who = Forwarded {
            key: get(KEY_HEADER)?.to_owned(),
            entry: get(ENTRY_HEADER)?.to_owned(),
            request_id: get(REQUEST_ID_HEADER)?.to_owned(),
            timestamp: get(TIMESTAMP_HEADER)?
                .parse()
                .map_err(|_| SignatureError::Mismatch)?,
            entry_registered: get(REGISTERED_HEADER)? == registered(true),
        };
        let signature =
            hex::decode(get(SIGNATURE_HEADER)?).map_err(|_| SignatureError::Mismatch)?;
        self.mac(method, path, &who)
            .verify_slice(&signature)
            .map_err(|_| SignatureError::Mismatch)?;
        let skew = now - who.timestamp;
        if skew.unsigned_abs() > WINDOW.as_secs() {
            return Err(SignatureError::Stale(skew));
        }
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let Seen { order, index } = &mut *seen;
        let horizon = now - WINDOW.as_secs() as i64;
        while order
            .front()
            .is_some_and(|(t, _)| *t < horizon || order.len() >= MAX_REMEMBERED)
        {
            if let Some((_, sig)) = order.pop_front() {
                index.remove(&sig);
            }
        }
        let key = hex::encode(&signature);
        if !index.insert(key.clone()) {
            return Err(SignatureError::Replayed);
        }
        order.push_back((who.timestamp, key));
        Ok(who)
    }
}

/// How the entry node's lease is written in a forwarded call.
fn registered(yes: bool) -> &'static str {
    if yes {
        "yes"
    } else {
        "no"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(ts: i64) -> Forwarded {
        Forwarded {
            key: "alice".into(),
            entry: "node-1".into(),
            request_id: "r1".into(),
            timestamp: ts,
            entry_registered: true,
        }
    }

    fn lookup(headers: &[(&'static str, String)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.insert(*name, value.parse().expect("a header value"));
        }
        map
    }

    #[test]
    fn a_signed_call_verifies_once() {
        let s = Signer::new(b"cluster secret");
        let headers = s.sign("POST", "/api/kernels/k/execute", &who(1000));
        let got = s.verify("POST", "/api/kernels/k/execute", &lookup(&headers), 1005);
        assert_eq!(got, Ok(who(1000)));
        assert_eq!(
            s.verify("POST", "/api/kernels/k/execute", &lookup(&headers), 1006),
            Err(SignatureError::Replayed)
        );
    }

    #[test]
    fn anything_changed_or_late_is_refused() {
        let s = Signer::new(b"cluster secret");
        let headers = s.sign("POST", "/api/kernels/k/execute", &who(1000));
        for (method, path) in [
            ("GET", "/api/kernels/k/execute"),
            ("POST", "/api/kernels/other/execute"),
        ] {
            assert_eq!(
                s.verify(method, path, &lookup(&headers), 1000),
                Err(SignatureError::Mismatch)
            );
        }
        let mut forged = headers.clone();
        forged[0].1 = "admin".into();
        assert_eq!(
            s.verify("POST", "/api/kernels/k/execute", &lookup(&forged), 1000),
            Err(SignatureError::Mismatch),
            "another key name"
        );
        let mut forged = headers.clone();
        forged[4].1 = registered(false).into();
        assert_eq!(
            s.verify("POST", "/api/kernels/k/execute", &lookup(&forged), 1000),
            Err(SignatureError::Mismatch),
            "another lease state"
        );
        let other = Signer::new(b"another secret");
        assert_eq!(
            other.verify("POST", "/api/kernels/k/execute", &lookup(&headers), 1000),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            s.verify("POST", "/api/kernels/k/execute", &lookup(&headers), 1031),
            Err(SignatureError::Stale(31))
        );
        assert_eq!(
            s.verify("POST", "/x", &HeaderMap::new(), 1000),
            Err(SignatureError::Missing(KEY_HEADER))
        );
    }

    #[test]
    fn newlines_cannot_shift_fields() {
        let s = Signer::new(b"k");
        let mut a = who(1);
        a.key = "al\nice".into();
        let headers = s.sign("GET", "/p", &a);
        assert_eq!(headers[0].1, "al ice");
        assert!(s.verify("GET", "/p", &lookup(&headers), 1).is_ok());
    }
}
