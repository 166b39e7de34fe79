//! How a node tells another whose request it forwards. The entry node authenticates the
//! client; the call it forwards carries, in `x-kernelgate-*` headers, the client's key name,
//! the entry node's id, a request id the entry node mints for this one call, a random nonce,
//! a timestamp, whether the entry node held its lease, the node the call is for (its id and
//! incarnation, as the registry names them) and the SHA-256 of the body. An HMAC-SHA256 over
//! all of these, the method and the path, keyed with the cluster secret
//! (`--cluster-secret-file`), signs them; the secret itself never travels.
//!
//! The owner accepts a signature once, for itself only (its node id and the incarnation it
//! started with), within [`WINDOW`] of its timestamp and not from before its own start, and
//! for the body that came with it. So a captured call cannot be replayed to another node, to
//! the same node after a restart, with another body, or twice. A WebSocket upgrade has no
//! body to bind: its `101` carries a fresh challenge, and the owner serves the socket only
//! once the entry node's first frame answers it with [`Signer::upgrade_proof`], which takes
//! the secret; captured upgrade headers sent again get their `101` and a close. What the
//! MAC does not cover: the bodies and answers themselves travel in the clear over plain
//! HTTP (readable by whoever reads the node network), and so do a WebSocket's frames after
//! its upgrade (docs/security.md). Client requests never carry these headers: a node
//! refuses a client's request that does.

use axum::http::HeaderMap;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

pub use kernelgate_protocol::rest::headers::{
    BODY_HEADER, CHALLENGE_HEADER, DESTINATION_HEADER, ENTRY_HEADER, HEADER_PREFIX,
    INCARNATION_HEADER, KEY_HEADER, NONCE_HEADER, REGISTERED_HEADER, REQUEST_ID_HEADER,
    TIMESTAMP_HEADER,
};
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
    /// The id the entry node minted for this forwarded call (not the client's
    /// `X-Request-Id`, which goes on as an ordinary header).
    pub request_id: String,
    /// Random, new for each call.
    pub nonce: String,
    /// Seconds since the Unix epoch, when the entry node signed the call.
    pub timestamp: i64,
    /// Whether the entry node held its lease when it signed: an owner cut off from the
    /// registry refuses work from a node that is not (the others may have given its
    /// kernels up), and serves it when the registry is down for everyone.
    pub entry_registered: bool,
    /// The node id the call is for.
    pub destination: String,
    /// That node's incarnation (a random id it takes at each start), as the registry
    /// showed the entry node.
    pub incarnation: String,
    /// The SHA-256 of the body, in hex.
    pub body_sha256: String,
}

impl Forwarded {
    /// A call from `entry` for `key`, to node `destination` in its `incarnation`, signed
    /// now with a new request id and nonce; its body is set by [`Forwarded::with_body`].
    pub fn new(
        key: &str,
        entry: &str,
        entry_registered: bool,
        destination: &str,
        incarnation: &str,
    ) -> Forwarded {
        Forwarded {
            key: key.to_owned(),
            entry: entry.to_owned(),
            request_id: uuid::Uuid::new_v4().simple().to_string(),
            nonce: hex::encode(rand::random::<[u8; 16]>()),
            timestamp: chrono::Utc::now().timestamp(),
            entry_registered,
            destination: destination.to_owned(),
            incarnation: incarnation.to_owned(),
            body_sha256: body_digest(b""),
        }
    }

    /// The same call, for a body with this SHA-256 (hex).
    pub fn with_body(mut self, sha256: String) -> Forwarded {
        self.body_sha256 = sha256;
        self
    }
}

/// The SHA-256 of a body, in hex, as a forwarded call carries it.
pub fn body_digest(body: &[u8]) -> String {
    hex::encode(Sha256::digest(body))
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SignatureError {
    #[error("a forwarded call without the {0} header")]
    Missing(&'static str),
    #[error("a forwarded call whose signature does not match")]
    Mismatch,
    #[error("a forwarded call signed {0} s away from this node's clock (more than the window)")]
    Stale(i64),
    #[error("a forwarded call signed before this node started (replayed from an earlier run)")]
    BeforeStart,
    #[error("a forwarded call signed for node {0:?}, not this one")]
    WrongDestination(String),
    /// Signed for this node's previous run by a node whose view is behind: honest, and
    /// answered with a retry.
    #[error("a forwarded call signed for an earlier start of this node (the forwarding node's view of the registry is behind)")]
    OldIncarnation,
    #[error("a forwarded call whose body is not the one it was signed with")]
    BodyMismatch,
    #[error("a forwarded call seen before (replayed)")]
    Replayed,
}

/// A forwarded call whose headers check out; [`Signer::accept`] takes it once its body is
/// known to match.
#[derive(Debug)]
pub struct Checked {
    pub who: Forwarded,
    signature: String,
}

/// Signs and checks forwarded calls with the cluster secret.
pub struct Signer {
    secret: Vec<u8>,
    /// This node's id and incarnation: the only destination it accepts calls for.
    node_id: String,
    incarnation: String,
    /// When this node started (seconds since the epoch): older signatures are refused.
    started: i64,
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
        f.debug_struct("Signer")
            .field("node_id", &self.node_id)
            .field("incarnation", &self.incarnation)
            .finish_non_exhaustive()
    }
}

impl Signer {
    /// The signer of node `node_id` in its `incarnation`, started now.
    pub fn new(secret: &[u8], node_id: &str, incarnation: &str) -> Signer {
        Signer::started_at(secret, node_id, incarnation, chrono::Utc::now().timestamp())
    }

    /// [`Signer::new`] with the start time given (seconds since the epoch).
    pub fn started_at(secret: &[u8], node_id: &str, incarnation: &str, started: i64) -> Signer {
        Signer {
            secret: secret.to_vec(),
            node_id: node_id.to_owned(),
            incarnation: incarnation.to_owned(),
            started,
            seen: Mutex::new(Seen::default()),
        }
    }

    pub fn incarnation(&self) -> &str {
        &self.incarnation
    }

    /// The key E2B sandbox access tokens are made with, derived from the cluster secret
    /// (never the secret itself): every node of the cluster checks every node's tokens.
    pub fn e2b_token_key(&self) -> [u8; 32] {
        kernelgate_protocol::e2b::token_key_of_cluster(&self.secret)
    }

    fn mac(&self, method: &str, path: &str, who: &Forwarded) -> Hmac<Sha256> {
        // Fields end with a newline and none may contain one (checked by `sign`), so no two
        // different calls sign the same bytes.
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.secret)
            .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
        for field in [
            "kernelgate-forward-v2",
            method,
            path,
            &who.key,
            &who.entry,
            &who.request_id,
            &who.nonce,
            &who.timestamp.to_string(),
            registered(who.entry_registered),
            &who.destination,
            &who.incarnation,
            &who.body_sha256,
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
            nonce: clean(&who.nonce),
            timestamp: who.timestamp,
            entry_registered: who.entry_registered,
            destination: clean(&who.destination),
            incarnation: clean(&who.incarnation),
            body_sha256: clean(&who.body_sha256),
        };
        let signature = hex::encode(self.mac(method, &clean(path), &who).finalize().into_bytes());
        vec![
            (KEY_HEADER, who.key),
            (ENTRY_HEADER, who.entry),
            (REQUEST_ID_HEADER, who.request_id),
            (NONCE_HEADER, who.nonce),
            (TIMESTAMP_HEADER, who.timestamp.to_string()),
            (
                REGISTERED_HEADER,
                registered(who.entry_registered).to_owned(),
            ),
            (DESTINATION_HEADER, who.destination),
            (INCARNATION_HEADER, who.incarnation),
            (BODY_HEADER, who.body_sha256),
            (SIGNATURE_HEADER, signature),
        ]
    }

    /// Checks a forwarded call's headers at time `now` (seconds since the epoch): the
    /// signature, the window, this node's start, that it is for this node. The body and the
    /// replay check follow in [`Signer::accept`].
    pub fn verify(
        &self,
        method: &str,
        path: &str,
        headers: &HeaderMap,
        now: i64,
    ) -> Result<Checked, SignatureError> {
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
            nonce: get(NONCE_HEADER)?.to_owned(),
            timestamp: get(TIMESTAMP_HEADER)?
                .parse()
                .map_err(|_| SignatureError::Mismatch)?,
            entry_registered: get(REGISTERED_HEADER)? == registered(true),
            destination: get(DESTINATION_HEADER)?.to_owned(),
            incarnation: get(INCARNATION_HEADER)?.to_owned(),
            body_sha256: get(BODY_HEADER)?.to_owned(),
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
        if who.timestamp < self.started {
            return Err(SignatureError::BeforeStart);
        }
        if who.destination != self.node_id {
            return Err(SignatureError::WrongDestination(who.destination));
        }
        if who.incarnation != self.incarnation {
            return Err(SignatureError::OldIncarnation);
        }
        Ok(Checked {
            who,
            signature: hex::encode(signature),
        })
    }

    /// A checked call whose body has the SHA-256 `body_sha256` (hex), at time `now`: who
    /// asked, once.
    pub fn accept(
        &self,
        checked: Checked,
        body_sha256: &str,
        now: i64,
    ) -> Result<Forwarded, SignatureError> {
        let Checked { who, signature } = checked;
        if !constant_time_eq(who.body_sha256.as_bytes(), body_sha256.as_bytes()) {
            return Err(SignatureError::BodyMismatch);
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
        if !index.insert(signature.clone()) {
            return Err(SignatureError::Replayed);
        }
        order.push_back((who.timestamp, signature));
        Ok(who)
    }

    /// A new challenge for a forwarded upgrade's `101`.
    pub fn challenge() -> String {
        hex::encode(rand::random::<[u8; 16]>())
    }

    /// What the entry node's first frame on a forwarded WebSocket says: the HMAC of the
    /// call's nonce and the owner's `challenge`, which only a holder of the secret makes.
    pub fn upgrade_proof(&self, nonce: &str, challenge: &str) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.secret)
            .unwrap_or_else(|_| unreachable!("HMAC takes a key of any length"));
        for field in ["kernelgate-upgrade-v1", nonce, challenge] {
            mac.update(field.as_bytes());
            mac.update(b"\n");
        }
        hex::encode(mac.finalize().into_bytes())
    }

    /// Whether `proof` answers `challenge` for the call with `nonce`.
    pub fn proves(&self, nonce: &str, challenge: &str, proof: &str) -> bool {
        constant_time_eq(
            self.upgrade_proof(nonce, challenge).as_bytes(),
            proof.trim().as_bytes(),
        )
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
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

    const NODE: &str = "node-2";
    const RUN: &str = "incarnation-a";
    const PATH: &str = "/api/kernels/k/execute";

    fn owner() -> Signer {
        Signer::started_at(b"cluster secret", NODE, RUN, 900)
    }

    fn who(ts: i64) -> Forwarded {
        Forwarded {
            key: "alice".into(),
            entry: "node-1".into(),
            request_id: "r1".into(),
            nonce: "n1".into(),
            timestamp: ts,
            entry_registered: true,
            destination: NODE.into(),
            incarnation: RUN.into(),
            body_sha256: body_digest(b"{\"code\": \"1\"}"),
        }
    }

    fn lookup(headers: &[(&'static str, String)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.insert(*name, value.parse().expect("a header value"));
        }
        map
    }

    /// Checks and accepts `headers` with the body `{"code": "1"}`.
    fn take(
        s: &Signer,
        method: &str,
        path: &str,
        headers: &HeaderMap,
        now: i64,
    ) -> Result<Forwarded, SignatureError> {
        let checked = s.verify(method, path, headers, now)?;
        s.accept(checked, &body_digest(b"{\"code\": \"1\"}"), now)
    }

    #[test]
    fn a_signed_call_verifies_once() {
        let s = owner();
        let headers = s.sign("POST", PATH, &who(1000));
        assert_eq!(
            take(&s, "POST", PATH, &lookup(&headers), 1005),
            Ok(who(1000))
        );
        assert_eq!(
            take(&s, "POST", PATH, &lookup(&headers), 1006),
            Err(SignatureError::Replayed)
        );
    }

    #[test]
    fn two_calls_alike_in_all_but_their_nonce_and_request_id_are_both_taken() {
        let s = owner();
        let (a, b) = (
            Forwarded::new("alice", "node-1", true, NODE, RUN).with_body(who(0).body_sha256),
            Forwarded::new("alice", "node-1", true, NODE, RUN).with_body(who(0).body_sha256),
        );
        assert_ne!((&a.request_id, &a.nonce), (&b.request_id, &b.nonce));
        let now = chrono::Utc::now().timestamp();
        for call in [a, b] {
            let headers = lookup(&s.sign("POST", PATH, &call));
            assert!(take(&s, "POST", PATH, &headers, now).is_ok());
        }
    }

    /// Every field the MAC binds, changed in the headers after signing: the signature no
    /// longer matches.
    #[test]
    fn every_bound_field_changed_is_a_mismatch() {
        let s = owner();
        let headers = s.sign("POST", PATH, &who(1000));
        for (name, forged) in [
            (KEY_HEADER, "admin"),
            (ENTRY_HEADER, "node-3"),
            (REQUEST_ID_HEADER, "r2"),
            (NONCE_HEADER, "n2"),
            (TIMESTAMP_HEADER, "1001"),
            (REGISTERED_HEADER, "no"),
            (DESTINATION_HEADER, "node-3"),
            (INCARNATION_HEADER, "incarnation-b"),
            (BODY_HEADER, &body_digest(b"print('pwned')")),
        ] {
            let mut map = lookup(&headers);
            map.insert(name, forged.parse().expect("value"));
            assert_eq!(
                s.verify("POST", PATH, &map, 1000).map(|c| c.who),
                Err(SignatureError::Mismatch),
                "{name} changed"
            );
        }
        for (method, path) in [("GET", PATH), ("POST", "/api/kernels/other/execute")] {
            assert_eq!(
                s.verify(method, path, &lookup(&headers), 1000)
                    .map(|c| c.who),
                Err(SignatureError::Mismatch),
                "{method} {path}"
            );
        }
        let other = Signer::started_at(b"another secret", NODE, RUN, 900);
        assert_eq!(
            other
                .verify("POST", PATH, &lookup(&headers), 1000)
                .map(|c| c.who),
            Err(SignatureError::Mismatch)
        );
        for missing in [
            KEY_HEADER,
            NONCE_HEADER,
            DESTINATION_HEADER,
            BODY_HEADER,
            SIGNATURE_HEADER,
        ] {
            let mut map = lookup(&headers);
            map.remove(missing);
            assert_eq!(
                s.verify("POST", PATH, &map, 1000).map(|c| c.who),
                Err(SignatureError::Missing(missing))
            );
        }
    }

    #[test]
    fn a_call_for_another_node_run_or_body_or_out_of_time_is_refused() {
        let s = owner();
        let verify = |signer: &Signer, who: &Forwarded, now: i64| {
            let headers = lookup(&signer.sign("POST", PATH, who));
            signer.verify("POST", PATH, &headers, now).map(|c| c.who)
        };
        assert_eq!(
            verify(&s, &who(1031), 1000),
            Err(SignatureError::Stale(-31))
        );
        assert_eq!(verify(&s, &who(1000), 1031), Err(SignatureError::Stale(31)));
        assert_eq!(verify(&s, &who(899), 900), Err(SignatureError::BeforeStart));
        let mut elsewhere = who(1000);
        elsewhere.destination = "node-3".into();
        assert_eq!(
            verify(&s, &elsewhere, 1000),
            Err(SignatureError::WrongDestination("node-3".into()))
        );
        // The same node restarted: a new incarnation and a later start.
        let restarted = Signer::started_at(b"cluster secret", NODE, "incarnation-b", 1010);
        assert_eq!(
            verify(&restarted, &who(1000), 1012),
            Err(SignatureError::BeforeStart)
        );
        assert_eq!(
            verify(&restarted, &who(1011), 1012),
            Err(SignatureError::OldIncarnation)
        );
        // Another body than the one signed.
        let checked = s
            .verify(
                "POST",
                PATH,
                &lookup(&s.sign("POST", PATH, &who(1000))),
                1000,
            )
            .expect("checks");
        assert_eq!(
            s.accept(checked, &body_digest(b"print('pwned-' + str(6*7))"), 1000),
            Err(SignatureError::BodyMismatch)
        );
    }

    #[test]
    fn every_node_of_a_cluster_makes_the_same_e2b_token_key_and_not_the_secret() {
        let one = Signer::started_at(b"cluster secret", NODE, RUN, 900);
        let restarted_elsewhere = Signer::started_at(b"cluster secret", "node-2", "i9", 1010);
        assert_eq!(one.e2b_token_key(), restarted_elsewhere.e2b_token_key());
        let other = Signer::started_at(b"another secret", NODE, RUN, 900);
        assert_ne!(one.e2b_token_key(), other.e2b_token_key());
        assert!(!one.e2b_token_key().starts_with(b"cluster secret"));
    }

    #[test]
    fn an_upgrade_is_proved_only_with_the_secret_the_nonce_and_the_challenge() {
        let s = owner();
        let challenge = Signer::challenge();
        assert_ne!(challenge, Signer::challenge());
        let proof = s.upgrade_proof("n1", &challenge);
        assert!(s.proves("n1", &challenge, &proof));
        assert!(!s.proves("n2", &challenge, &proof), "another call's nonce");
        assert!(
            !s.proves("n1", &Signer::challenge(), &proof),
            "another challenge"
        );
        let other = Signer::started_at(b"another secret", NODE, RUN, 900);
        assert!(!s.proves("n1", &challenge, &other.upgrade_proof("n1", &challenge)));
        assert!(!s.proves("n1", &challenge, ""));
    }

    #[test]
    fn newlines_cannot_shift_fields() {
        let s = owner();
        let mut a = who(1000);
        a.key = "al\nice".into();
        let headers = s.sign("POST", PATH, &a);
        assert_eq!(headers[0].1, "al ice");
        assert!(take(&s, "POST", PATH, &lookup(&headers), 1000).is_ok());
    }
}
