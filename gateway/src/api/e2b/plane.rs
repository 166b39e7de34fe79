//! The sandbox plane's addressing: a request for a sandbox names it with the headers
//! `E2b-Sandbox-Id` and `E2b-Sandbox-Port` (the SDK's `E2B_SANDBOX_URL` mode) or with its
//! host, `<port>-<id>.<domain>`. [`address`] rewrites such a request to the internal path
//! `/.e2b/<port>/<id>/<path>` before routing, and marks it so: the internal paths answer
//! only marked requests. [`SandboxCall`] then checks the sandbox's access token.

use super::super::auth::refused_credential;
use super::super::error::ApiError;
use super::super::AppState;
use crate::kernels::LiveKernel;
use axum::extract::{FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// The prefix of the internal paths.
pub const PREFIX: &str = "/.e2b";

/// Marks a request [`address`] rewrote.
#[derive(Debug, Clone, Copy)]
struct Addressed;

/// The URI a request [`address`] rewrote came with: what a node forwards, and what the
/// node it reaches checks the forwarded call's signature against.
#[derive(Debug, Clone)]
pub struct Original(pub Uri);

/// A forwarded sandbox-plane request's `Authorization` (envd's `Basic <user>:`, which names
/// a user and holds no secret): node-to-node calls drop `Authorization`, which elsewhere
/// carries a client's key.
pub const FORWARDED_USER: &str = "e2b-forwarded-authorization";

/// The sandbox and port a request names, by its headers or its host.
fn target(req: &Request) -> Option<(u16, String)> {
    use kernelgate_protocol::rest::headers::{E2B_SANDBOX_ID, E2B_SANDBOX_PORT};
    let headers = req.headers();
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(id) = header(E2B_SANDBOX_ID) {
        let port = header(E2B_SANDBOX_PORT)
            .and_then(|p| p.parse().ok())
            .unwrap_or(kernelgate_protocol::e2b::ENVD_PORT);
        return Some((port, id.to_owned()));
    }
    let host = header("host")?;
    kernelgate_protocol::e2b::host_address(host).map(|(port, id)| (port, id.to_owned()))
}

/// Middleware in front of the router: a sandbox-plane request goes to the internal path of
/// its sandbox and port; other requests pass as they are, and a request for an internal
/// path that was not rewritten finds nothing there.
pub async fn address(mut req: Request, next: Next) -> Response {
    if req.uri().path().starts_with(PREFIX) {
        req.extensions_mut().remove::<Addressed>();
        return ApiError::new(
            StatusCode::NOT_FOUND,
            format!("No such endpoint: {}", req.uri().path()),
        )
        .into_response();
    }
    let Some((port, id)) = target(&req) else {
        return next.run(req).await;
    };
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
        return ApiError::new(StatusCode::NOT_FOUND, format!("sandbox {id:?} not found"))
            .into_response();
    }
    let path_and_query = match req.uri().query() {
        Some(q) => format!("{PREFIX}/{port}/{id}{}?{q}", req.uri().path()),
        None => format!("{PREFIX}/{port}/{id}{}", req.uri().path()),
    };
    match path_and_query.parse::<Uri>() {
        Ok(uri) => {
            let original = std::mem::replace(req.uri_mut(), uri);
            req.extensions_mut().insert(Original(original));
        }
        Err(_) => {
            return ApiError::bad_request("a sandbox-plane path that is not a valid URI")
                .into_response()
        }
    }
    req.extensions_mut().insert(Addressed);
    next.run(req).await
}

/// A sandbox-plane call that checked out: its sandbox's kernel and the key that owns it.
#[derive(Debug, Clone)]
pub struct SandboxCall {
    pub id: String,
    pub live: Arc<LiveKernel>,
    /// The owner of the sandbox, as whom files and runs are audited.
    pub key: String,
}

impl SandboxCall {
    fn of(parts: &Parts, state: &AppState) -> Result<SandboxCall, Refused> {
        if parts.extensions.get::<Addressed>().is_none() {
            return Err(Refused::Plain(ApiError::new(
                StatusCode::NOT_FOUND,
                "No such endpoint",
            )));
        }
        // /.e2b/<port>/<id>/...
        let id = parts
            .uri
            .path()
            .split('/')
            .nth(3)
            .unwrap_or_default()
            .to_owned();
        // E2B's proxy answers 502 for a sandbox that is not running: the SDK reads it so.
        let gone = || {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                format!("sandbox {id} is not running (it ended, was killed, or never existed)"),
            )
        };
        // envd calls carry X-Access-Token; the code interpreter's context calls only
        // E2B-Traffic-Access-Token (the create answers both with the same token).
        let token = ["x-access-token", "e2b-traffic-access-token"]
            .iter()
            .find_map(|name| parts.headers.get(*name))
            .and_then(|v| v.to_str().ok());
        match token {
            Some(token) if state.e2b.token_matches(&id, token) => {}
            Some(_) => {
                tracing::info!(kernel = %id, "E2B sandbox access token refused");
                return Err(Refused::Credential(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "wrong access token for this sandbox (the envdAccessToken of its create)",
                )));
            }
            None => {
                return Err(Refused::Credential(ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "missing X-Access-Token: send the envdAccessToken of the sandbox's create",
                )))
            }
        }
        state.e2b.get(&id).ok_or_else(|| Refused::Plain(gone()))?;
        let live = state.kernels.get(&id).ok_or_else(|| {
            state.e2b.remove(&id);
            Refused::Plain(gone())
        })?;
        let key = live.owner().to_owned();
        Ok(SandboxCall { id, live, key })
    }
}

/// Why a sandbox-plane call was refused: a wrong or missing token counts against the
/// caller's address as any refused credential does.
enum Refused {
    Plain(ApiError),
    Credential(ApiError),
}

impl FromRequestParts<AppState> for SandboxCall {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Response> {
        match SandboxCall::of(parts, state) {
            Ok(call) => Ok(call),
            Err(Refused::Plain(e)) => Err(e.into_response()),
            Err(Refused::Credential(e)) => Err(refused_credential(state, parts, e).await),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::routing::any;
    use axum::Router;
    use tower::ServiceExt;

    /// What the router saw: the path it routed, and whether the request was marked.
    async fn routed(req: Request) -> (StatusCode, String) {
        let app = Router::new()
            .fallback(any(|req: Request| async move {
                let marked = req.extensions().get::<Addressed>().is_some();
                format!("{} {marked}", req.uri())
            }))
            .layer(axum::middleware::from_fn(address));
        let Ok(response) = app.oneshot(req).await;
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap_or_default();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    fn request(uri: &str, headers: &[(&str, &str)]) -> Request {
        let mut builder = Request::builder().uri(uri);
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        builder.body(Body::empty()).unwrap_or_default()
    }

    #[tokio::test]
    async fn sandbox_requests_go_to_their_internal_path_and_others_pass() {
        let headers = [("e2b-sandbox-id", "abc-1"), ("e2b-sandbox-port", "49999")];
        assert_eq!(
            routed(request("/execute", &headers)).await,
            (StatusCode::OK, "/.e2b/49999/abc-1/execute true".into())
        );
        let host = [("host", "49983-abc-1.sandbox.test:8888")];
        assert_eq!(
            routed(request("/files?path=%2Fhome%2Fuser%2Fa", &host)).await,
            (
                StatusCode::OK,
                "/.e2b/49983/abc-1/files?path=%2Fhome%2Fuser%2Fa true".into()
            )
        );
        assert_eq!(
            routed(request("/api/kernels", &[("host", "127.0.0.1:8888")])).await,
            (StatusCode::OK, "/api/kernels false".into())
        );
        // The internal paths are not reachable from outside, nor odd sandbox ids.
        assert_eq!(
            routed(request("/.e2b/49999/abc-1/execute", &[])).await.0,
            StatusCode::NOT_FOUND
        );
        let odd = [("e2b-sandbox-id", "../x")];
        assert_eq!(
            routed(request("/execute", &odd)).await.0,
            StatusCode::NOT_FOUND
        );
    }
}
