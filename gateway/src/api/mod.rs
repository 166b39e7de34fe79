//! HTTP and WebSockets: Jupyter Server's kernel REST API, the channels WebSocket, and
//! token authentication. Handlers stay thin; the work is in [`crate::kernels`].

pub mod approvals;
pub mod auth;
pub mod channels;
pub mod error;
pub mod execute;
pub mod files;
pub mod kernels;
pub mod kernelspecs;
pub mod mcp;
pub mod ops;
pub mod origin;
pub mod ui;

use crate::kernels::Kernels;
use crate::tenants::Keys;
use axum::extract::DefaultBodyLimit;
use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{any, get, post};
use axum::{middleware, Json, Router};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

/// What every handler can reach.
#[derive(Debug, Clone)]
pub struct AppState {
    pub kernels: Arc<Kernels>,
    pub keys: Arc<Keys>,
    /// Failed authentications by client address.
    pub failures: Arc<auth::Failures>,
    pub max_message_bytes: usize,
    /// Cancelled at shutdown: open WebSockets close.
    pub cancel: CancellationToken,
    /// Owns the tasks handlers start (agent API runs).
    pub tracker: TaskTracker,
    pub metrics_access: ops::MetricsAccess,
    pub readiness: Arc<ops::Readiness>,
    pub origins: Arc<origin::OriginPolicy>,
    /// The OCI runtime kernels run under (`runc` or `runsc`), for `GET /api`.
    pub runtime: &'static str,
    /// The execution policy, when `--policy` set one.
    pub guard: Option<Arc<crate::policy::Guard>>,
    /// The MCP server at `/mcp`.
    pub mcp: Arc<crate::mcp::http::Endpoint>,
}

/// The whole HTTP surface.
pub fn router(state: AppState) -> Router {
    let protected = Router::new()
        .route("/api/kernelspecs", get(kernelspecs::list))
        .route("/api/kernelspecs/{name}", get(kernelspecs::get))
        .route("/kernelspecs/{name}/{file}", get(kernelspecs::resource))
        .route("/api/kernels", get(kernels::list).post(kernels::create))
        .route(
            "/api/kernels/{id}",
            get(kernels::get).delete(kernels::delete),
        )
        .route("/api/kernels/{id}/interrupt", post(kernels::interrupt))
        .route("/api/kernels/{id}/restart", post(kernels::restart))
        .route("/api/kernels/{id}/channels", get(channels::connect))
        .route("/api/kernels/{id}/execute", post(execute::execute))
        .route("/api/kernels/{id}/files", get(files::list_root))
        .route(
            "/api/kernels/{id}/files/{*path}",
            get(files::get).put(files::put).delete(files::delete),
        )
        .route("/mcp", any(mcp::serve))
        .route("/api/kernelgate/approvals", get(approvals::list))
        .route("/api/kernelgate/approvals/{id}", post(approvals::answer))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ));
    Router::new()
        .route("/", get(ui::index))
        .route("/ui/{file}", get(ui::file))
        .route("/api", get(version))
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .merge(protected)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(state.max_message_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), origin::guard))
        .layer(middleware::from_fn(request_span))
        .with_state(state)
}

/// Every request runs in a span with its id, so each log line about it carries the id;
/// the id is sent back as `X-Request-Id` (a client's own, when it sent a sane one).
async fn request_span(req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= 64
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
        .map(str::to_owned)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    let span = tracing::info_span!(
        "request",
        request_id = %id,
        method = %req.method(),
        path = %req.uri().path(),
        kernel = tracing::field::Empty,
    );
    // Requests about one kernel name it as a field of their own.
    if let Some(kernel) = req
        .uri()
        .path()
        .strip_prefix("/api/kernels/")
        .and_then(|rest| rest.split('/').next())
        .filter(|k| !k.is_empty())
    {
        span.record("kernel", kernel);
    }
    let mut response = next.run(req).instrument(span.clone()).await;
    span.in_scope(|| tracing::debug!(status = response.status().as_u16(), "answered"));
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

/// Jupyter Server's `GET /api` (`version`), and ours beside it: what kernels run under.
async fn version(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "kernelgate": {
            "version": env!("CARGO_PKG_VERSION"), "runtime": state.runtime,
            "policy": state.guard.is_some(),
        },
    }))
}

async fn not_found(uri: axum::http::Uri) -> error::ApiError {
    error::ApiError::new(
        axum::http::StatusCode::NOT_FOUND,
        format!("No such endpoint: {}", uri.path()),
    )
}
