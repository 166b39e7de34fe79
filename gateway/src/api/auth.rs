//! Token authentication, as Jupyter Server does it: `Authorization: token T`,
//! `Authorization: Bearer T`, or `?token=T`. Compared in constant time. The token names a
//! tenant ([`crate::tenants`]); handlers take it as [`Caller`].
//!
//! Failed attempts are counted per client address: past [`FAILURES_PER_MINUTE`] in a minute,
//! further failures answer 429 with `Retry-After` at once (and the burst is logged once). A
//! valid token is never slowed down or refused by this. A request with internal
//! `x-kernelgate-*` headers that is not a node-to-node call that checks out counts as a
//! failure too, and is audited once per address and minute (docs/audit.md).

use super::error::ApiError;
use super::AppState;
use crate::audit::Record;
use crate::cluster::signing::HEADER_PREFIX;
use crate::tenants::Tenant;
use axum::extract::{ConnectInfo, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Failed attempts one address may make in a minute before it is answered 429.
pub const FAILURES_PER_MINUTE: u32 = 10;
const WINDOW: Duration = Duration::from_secs(60);
/// Addresses remembered at most; the oldest windows are forgotten first.
const MAX_TRACKED: usize = 10_000;

/// The tenant a request was authenticated as.
#[derive(Debug, Clone)]
pub struct Caller(pub Arc<Tenant>);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Caller>()
            .cloned()
            .ok_or_else(|| ApiError::new(StatusCode::FORBIDDEN, "not authenticated"))
    }
}

#[derive(Debug)]
struct Window {
    started: Instant,
    failures: u32,
    logged: bool,
    /// Refused requests with internal headers in this window.
    internal: u32,
    /// Such refusals of earlier windows that no audit record counted yet.
    unrecorded: u32,
}

impl Window {
    fn new(now: Instant) -> Window {
        Window {
            started: now,
            failures: 0,
            logged: false,
            internal: 0,
            unrecorded: 0,
        }
    }
}

/// A refused request with internal headers, as [`Failures::internal`] counts it.
#[derive(Debug, PartialEq, Eq)]
struct InternalRefusal {
    /// Seconds to wait, once the address is over the limit.
    wait: Option<u64>,
    /// `Some(earlier refusals that got no record)` when this one is to be recorded.
    record: Option<u32>,
}

/// Failed authentications by client address.
#[derive(Debug, Default)]
pub struct Failures {
    windows: Mutex<HashMap<IpAddr, Window>>,
}

impl Failures {
    /// Counts a failure; `Some(seconds to wait)` once the address is over the limit.
    fn fail(&self, addr: IpAddr) -> Option<u64> {
        self.count(addr, false).wait
    }

    /// Counts a refused request with internal headers as a failure; the first of the
    /// address's window is to be recorded, with the count of those before it that were not.
    fn internal(&self, addr: IpAddr) -> InternalRefusal {
        self.count(addr, true)
    }

    fn count(&self, addr: IpAddr, internal: bool) -> InternalRefusal {
        let mut windows = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if windows.len() >= MAX_TRACKED {
            windows.retain(|_, w| now.duration_since(w.started) < WINDOW);
            if windows.len() >= MAX_TRACKED {
                windows.clear();
            }
        }
        let w = windows.entry(addr).or_insert_with(|| Window::new(now));
        if now.duration_since(w.started) >= WINDOW {
            let unrecorded = match w.internal {
                0 => w.unrecorded,
                n => n - 1,
            };
            *w = Window {
                unrecorded,
                ..Window::new(now)
            };
        }
        w.failures += 1;
        let record = internal.then(|| {
            w.internal += 1;
            (w.internal == 1).then(|| std::mem::take(&mut w.unrecorded))
        });
        InternalRefusal {
            wait: Self::over(w, addr, now),
            record: record.flatten(),
        }
    }

    fn over(w: &mut Window, addr: IpAddr, now: Instant) -> Option<u64> {
        if w.failures <= FAILURES_PER_MINUTE {
            return None;
        }
        if !w.logged {
            w.logged = true;
            tracing::warn!(client = %addr, "more than {FAILURES_PER_MINUTE} failed authentications in a minute; answering 429 until the minute is over");
        }
        let left = WINDOW.saturating_sub(now.duration_since(w.started));
        Some(left.as_secs().max(1))
    }
}

/// A 429 telling the client to wait `wait` seconds.
fn too_many(wait: u64) -> Response {
    let mut response = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        format!("Too many failed authentications from this address; try again in {wait} s with the right token"),
    )
    .into_response();
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(wait));
    response
}

/// The token clients must show, or none when auth was switched off explicitly.
#[derive(Clone)]
pub struct Auth {
    token_digest: Option<[u8; 32]>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("required", &self.token_digest.is_some())
            .finish()
    }
}

impl Auth {
    pub fn token(token: &str) -> Self {
        Auth {
            token_digest: Some(Sha256::digest(token.as_bytes()).into()),
        }
    }

    pub fn disabled() -> Self {
        Auth { token_digest: None }
    }

    /// Comparing fixed-size digests byte by byte with no early exit takes the same time
    /// whatever the guess, and hides the token's length.
    pub fn accepts(&self, presented: Option<&str>) -> bool {
        let Some(expected) = &self.token_digest else {
            return true;
        };
        let Some(presented) = presented else {
            return false;
        };
        let got: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        got.iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// The token a request carries, from the header or the query string.
pub fn presented_token(req: &Request) -> Option<String> {
    if let Some(value) = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let value = value.trim();
        for scheme in ["token ", "Token ", "Bearer ", "bearer "] {
            if let Some(t) = value.strip_prefix(scheme) {
                return Some(t.trim().to_owned());
            }
        }
    }
    req.uri().query().and_then(|q| {
        q.split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == "token")
            .map(|(_, v)| crate::text::form_decode(v))
    })
}

/// Whether a request to a public endpoint carries a valid key, for the details only keys
/// may see. A wrong token counts as a failed authentication, so a public endpoint is no way
/// around the throttle.
pub fn carries_valid_key(state: &AppState, req: &Request) -> bool {
    let presented = presented_token(req);
    if state.keys.authenticate(presented.as_deref()).is_some() {
        return true;
    }
    let addr = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    if let (Some(_), Some(addr)) = (presented, addr) {
        let _ = state.failures.fail(addr);
    }
    false
}

/// Middleware: refuses requests without a valid key and tells handlers whose it is.
pub async fn require_token(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, Response> {
    if is_forwarded(&req) {
        return match &state.cluster {
            Some(cluster) => super::cluster::forwarded_call(&state, cluster, req, next).await,
            None => Err(refuse_internal(
                &state,
                &req,
                "x-kernelgate-* headers are for calls between a cluster's nodes, and this gateway is not one: leave them out".to_owned(),
            )
            .await),
        };
    }
    if let Some(tenant) = state.keys.authenticate(presented_token(&req).as_deref()) {
        // The bare tenant too, for handlers outside this module (MCP's).
        req.extensions_mut().insert(tenant.clone());
        req.extensions_mut().insert(Caller(tenant));
        return Ok(next.run(req).await);
    }
    let addr = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let path = req.uri().path().to_owned();
    drain(req).await;
    if let Some(wait) = addr.and_then(|a| state.failures.fail(a)) {
        return Err(too_many(wait));
    }
    tracing::info!(client = ?addr, "authentication refused");
    state
        .kernels
        .audit()
        .record(&Record::AuthRefused {
            client: addr.map(|a| a.to_string()),
            path,
        })
        .await;
    Err(ApiError::new(
        StatusCode::FORBIDDEN,
        "Missing or wrong token: send `Authorization: token <token>` or add `?token=<token>` \
         (the token is printed when the gateway starts, or set with --token / KERNELGATE_TOKEN, \
         or is a key of --keys)",
    )
    .into_response())
}

/// The most of a refused request's body read before the answer, and how long that may take.
const DRAIN_BYTES: usize = 64 << 10;
const DRAIN_WAIT: Duration = Duration::from_secs(2);

/// Reads what is left of a refused request's body (a bounded amount, for a bounded time)
/// before it is answered: a connection closed with unread bytes in it is reset, and a reset
/// can reach the client before it has read the answer (it then sees a broken connection,
/// not the 403 that tells it what to do).
async fn drain(req: Request) {
    let body = req.into_body();
    let _ = tokio::time::timeout(DRAIN_WAIT, axum::body::to_bytes(body, DRAIN_BYTES)).await;
}

/// A wrong or missing credential on a route that checks its own (the E2B sandbox plane's
/// access tokens): counted for the per-address throttle, logged and audited as any refused
/// token is, and answered `refusal`, or 429 once the address is over the limit.
pub(super) async fn refused_credential(
    state: &AppState,
    parts: &Parts,
    refusal: ApiError,
) -> Response {
    let addr = parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    if let Some(wait) = addr.and_then(|a| state.failures.fail(a)) {
        return too_many(wait);
    }
    tracing::info!(client = ?addr, path = %parts.uri.path(), "credential refused");
    state
        .kernels
        .audit()
        .record(&Record::AuthRefused {
            client: addr.map(|a| a.to_string()),
            path: parts.uri.path().to_owned(),
        })
        .await;
    refusal.into_response()
}

/// Whether a request says it was forwarded by another node (carries an internal header).
pub(super) fn is_forwarded(req: &Request) -> bool {
    req.headers()
        .keys()
        .any(|name| name.as_str().starts_with(HEADER_PREFIX))
}

/// The address a request came from.
pub(super) fn client_addr(req: &Request) -> Option<SocketAddr> {
    req.extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0)
}

/// Refuses a request with internal headers that is not a node-to-node call that checks
/// out: a failed authentication for the throttle (429 past it), logged each time, audited
/// once per address and minute with the count of those not recorded before.
pub(super) fn refuse_internal<'a>(
    state: &'a AppState,
    req: &Request,
    why: String,
) -> impl std::future::Future<Output = Response> + Send + 'a {
    let addr = client_addr(req).map(|a| a.ip());
    let path = req.uri().path().to_owned();
    refuse_internal_from(state, addr, path, why)
}

async fn refuse_internal_from(
    state: &AppState,
    addr: Option<IpAddr>,
    path: String,
    why: String,
) -> Response {
    tracing::warn!(client = ?addr, %why, "request with internal headers refused");
    let refusal = match addr {
        Some(a) => state.failures.internal(a),
        None => InternalRefusal {
            wait: None,
            record: Some(0),
        },
    };
    if let Some(unrecorded) = refusal.record {
        state
            .kernels
            .audit()
            .record(&Record::InternalHeadersRefused {
                client: addr.map(|a| a.to_string()),
                path,
                reason: why.clone(),
                unrecorded,
            })
            .await;
    }
    match refusal.wait {
        Some(wait) => too_many(wait),
        None => ApiError::new(StatusCode::FORBIDDEN, why).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    fn req(uri: &str, auth: Option<&str>) -> Request {
        let mut b = axum::http::Request::builder().uri(uri);
        if let Some(a) = auth {
            b = b.header(header::AUTHORIZATION, a);
        }
        b.body(Body::empty()).expect("request")
    }

    #[test]
    fn accepts_all_jupyter_forms() {
        let auth = Auth::token("s3cret");
        for r in [
            req("/api/kernels", Some("token s3cret")),
            req("/api/kernels", Some("Bearer s3cret")),
            req("/api/kernels?token=s3cret", None),
            req("/api/kernels?x=1&token=s3cr%65t", None),
        ] {
            assert!(
                auth.accepts(presented_token(&r).as_deref()),
                "{:?}",
                r.uri()
            );
        }
        for r in [
            req("/api/kernels", None),
            req("/api/kernels", Some("token ")),
            req("/api/kernels", Some("token s3cre")),
            req("/api/kernels?token=", None),
        ] {
            assert!(
                !auth.accepts(presented_token(&r).as_deref()),
                "{:?}",
                r.uri()
            );
        }
        assert!(Auth::disabled().accepts(None));
    }

    #[test]
    fn failures_past_ten_a_minute_get_a_retry_after() {
        let failures = Failures::default();
        let (a, b): (IpAddr, IpAddr) =
            ("127.0.0.1".parse().expect("ip"), "::1".parse().expect("ip"));
        for _ in 0..FAILURES_PER_MINUTE {
            assert_eq!(failures.fail(a), None);
        }
        let wait = failures.fail(a).expect("the eleventh is refused");
        assert!((1..=60).contains(&wait));
        assert_eq!(failures.fail(b), None, "another address has its own count");
    }

    #[test]
    fn internal_header_refusals_count_as_failures_and_are_recorded_once_a_window() {
        let failures = Failures::default();
        let a: IpAddr = "127.0.0.1".parse().expect("ip");
        assert_eq!(
            failures.internal(a),
            InternalRefusal {
                wait: None,
                record: Some(0)
            }
        );
        for _ in 1..FAILURES_PER_MINUTE {
            assert_eq!(
                failures.internal(a),
                InternalRefusal {
                    wait: None,
                    record: None
                }
            );
        }
        let over = failures.internal(a);
        assert!(over.wait.is_some() && over.record.is_none(), "{over:?}");
        assert!(failures.fail(a).is_some(), "a wrong token too, now");
        // The next window: its first is recorded with the ten that were not.
        {
            let mut windows = failures.windows.lock().expect("lock");
            let w = windows.get_mut(&a).expect("window");
            w.started -= WINDOW;
        }
        assert_eq!(
            failures.internal(a),
            InternalRefusal {
                wait: None,
                record: Some(FAILURES_PER_MINUTE)
            }
        );
    }
}
