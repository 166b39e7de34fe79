//! For operators: `GET /healthz` (the process answers), `GET /readyz` (kernels can be
//! started: Docker reachable, image present, warm pool filled or filling), both without
//! a token and cheap, and `GET /metrics` (Prometheus), behind the admin token unless the
//! operator made it public.

use super::auth::{presented_token, Auth};
use super::error::ApiError;
use super::AppState;
use crate::backend::BackendError;
use crate::metrics;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use std::sync::Mutex;
use std::time::{Duration, Instant};

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

pub async fn healthz() -> &'static str {
    "ok\n"
}

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
    let (pooled, target) = state.kernels.pool_fill();
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
    let body = json!({
        "ready": docker.is_ok(),
        "docker": docker_state,
        "image": image_state,
        "pool": {"state": pool, "ready": pooled, "target": target},
    });
    let status = if docker.is_ok() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

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
