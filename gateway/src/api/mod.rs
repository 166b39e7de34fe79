//! HTTP and WebSockets: Jupyter Server's kernel REST API, the channels WebSocket, and
//! token authentication. Handlers stay thin; the work is in [`crate::kernels`].

pub mod auth;
pub mod channels;
pub mod error;
pub mod execute;
pub mod files;
pub mod kernels;
pub mod kernelspecs;
pub mod ui;

use crate::kernels::Kernels;
use auth::Auth;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::{middleware, Json, Router};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What every handler can reach.
#[derive(Debug, Clone)]
pub struct AppState {
    pub kernels: Arc<Kernels>,
    pub auth: Auth,
    pub max_message_bytes: usize,
    /// Cancelled at shutdown: open WebSockets close.
    pub cancel: CancellationToken,
    /// Owns the tasks handlers start (agent API runs).
    pub tracker: TaskTracker,
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
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ));
    Router::new()
        .route("/", get(ui::index))
        .route("/ui/{file}", get(ui::file))
        .route("/api", get(version))
        .merge(protected)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(state.max_message_bytes))
        .with_state(state)
}

async fn version() -> Json<serde_json::Value> {
    Json(serde_json::json!({"version": env!("CARGO_PKG_VERSION"), "kernelgate": true}))
}

async fn not_found(uri: axum::http::Uri) -> error::ApiError {
    error::ApiError::new(
        axum::http::StatusCode::NOT_FOUND,
        format!("No such endpoint: {}", uri.path()),
    )
}
