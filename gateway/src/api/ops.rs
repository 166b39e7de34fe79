//! For operators: `GET /healthz` (the process answers), `GET /readyz` (kernels can be
//! started: Docker reachable, image present, warm pool filled or filling), both without
//! a token and cheap, and `GET /metrics` (Prometheus), behind the admin token unless the
//! operator made it public.

use super::auth::{presented_token, Auth};
use super::error::{ApiError, ErrorBody};
use super::AppState;
use crate::backend::BackendError;
use crate::metrics;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use utoipa::ToSchema;

/// Docker is asked at most this often; readiness probes in between get the last answer.
const CHECK_EVERY: Duration = Duration::from_secs(2);

/// Who may read `/metrics`.
#[derive(Debug, Clone)]
pub enum MetricsAccess {
    /// Anyone who can reach the gateway (`--metrics-public`).
    Public,
    /// The gateway's token, or a token only for metrics (`--metrics-token`).
    Tokens { scrape: Option<Auth> },
}

/// The last Docker check, shared by readiness probes.
#[derive(Debug, Default)]
pub struct Readiness {
    last: Mutex<Option<Checked>>,
}

#[derive(Debug, Clone)]
struct Checked {
    at: Instant,
    result: Result<(), String>,
    image_missing: bool,
}

/// The process serves (a liveness probe).
#[utoipa::path(
    get, path = "/healthz", tag = "operations", operation_id = "healthz",
    responses((status = 200, description = "`ok`", body = String, content_type = "text/plain")),
)]
pub async fn healthz() -> &'static str {
    "ok\n"
}

/// What `GET /readyz` answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct Ready {
    /// Kernels can be started.
    ready: bool,
    /// `ok`, or why Docker cannot be used and what to do.
    docker: String,
    /// `ok`, why the kernel image is missing and how to build it, or `unknown` while Docker
    /// cannot be asked.
    image: String,
    pool: PoolFill,
}

/// The warm pool.
#[derive(Debug, Serialize, ToSchema)]
pub struct PoolFill {
    #[schema(schema_with = pool_state_schema)]
    state: &'static str,
    /// Warm kernels ready now.
    ready: usize,
    /// Warm kernels wanted.
    target: usize,
}

fn pool_state_schema() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(["filled", "filling", "off"]))
        .build()
}

/// Kernels can be started (a readiness probe).
///
/// Docker answers and the image is there; Docker is asked at most every 2 s.
#[utoipa::path(
    get, path = "/readyz", tag = "operations", operation_id = "readyz",
    responses(
        (status = 200, description = "Ready", body = Ready),
        (status = 503, description = "Not ready: the failing check says why and what to do", body = Ready),
    ),
)]
pub async fn readyz(State(state): State<AppState>) -> Response {
    let cached = state
        .readiness
        .last
        .lock()
        .ok()
        .and_then(|l| l.clone())
        .filter(|c| c.at.elapsed() < CHECK_EVERY);
    let Checked {
        result: docker,
        image_missing,
        ..
    } = match cached {
        Some(c) => c,
        None => {
            let checked = state.kernels.backend().check().await;
            let fresh = Checked {
                at: Instant::now(),
                image_missing: matches!(checked, Err(BackendError::ImageMissing { .. })),
                result: checked.map_err(|e| e.to_string()),
            };
            if let Ok(mut last) = state.readiness.last.lock() {
                *last = Some(fresh.clone());
            }
            fresh
        }
    };
    let (pooled, target) = state.kernels.pool().fill();
    let pool = match (target, pooled >= target) {
        (0, _) => "off",
        (_, true) => "filled",
        (_, false) => "filling",
    };
    let (docker_state, image_state) = match (&docker, image_missing) {
        (Ok(()), _) => ("ok".to_owned(), "ok".to_owned()),
        (Err(e), true) => ("ok".to_owned(), e.clone()),
        (Err(e), false) => (e.clone(), "unknown".to_owned()),
    };
    let body = Ready {
        ready: docker.is_ok(),
        docker: docker_state,
        image: image_state,
        pool: PoolFill {
            state: pool,
            ready: pooled,
            target,
        },
    };
    let status = if docker.is_ok() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

/// Prometheus metrics (OpenMetrics text).
///
/// An admin key or the `--metrics-token`, unless the gateway runs with `--metrics-public`.
#[utoipa::path(
    get, path = "/metrics", tag = "operations", operation_id = "metrics",
    security(("token" = []), ("bearer" = []), ("token_query" = []), ()),
    responses(
        (status = 200, description = "The series, all prefixed `kernelgate_`", body = String,
         content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8"),
        (status = 403, description = "Neither an admin key nor the metrics token, and `/metrics` is not public", body = ErrorBody),
    ),
)]
pub async fn metrics(State(state): State<AppState>, req: Request) -> Result<Response, ApiError> {
    if let MetricsAccess::Tokens { scrape } = &state.metrics_access {
        let token = presented_token(&req);
        let admin = state
            .keys
            .authenticate(token.as_deref())
            .is_some_and(|t| t.admin);
        let allowed = admin || scrape.as_ref().is_some_and(|s| s.accepts(token.as_deref()));
        if !allowed {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "/metrics needs the gateway's token or the --metrics-token \
                 (Authorization: Bearer TOKEN), or start the gateway with --metrics-public",
            ));
        }
    }
    let text = metrics::render(&state.kernels.snapshot());
    Ok(([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response())
}
