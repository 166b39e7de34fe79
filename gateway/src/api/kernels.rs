//! Jupyter Server's kernel REST API: list, create, get, delete, interrupt, restart.

use super::auth::Caller;
use super::error::ApiError;
use super::AppState;
use crate::kernel::iso;
use crate::kernels::LiveKernel;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// The kernel model of Jupyter Server's REST API.
pub fn model(live: &LiveKernel) -> Value {
    let k = &live.kernel;
    json!({
        "id": live.id(),
        "name": live.name,
        "last_activity": iso(k.last_activity()),
        "execution_state": k.execution_state().as_str(),
        "connections": k.connections(),
    })
}

/// The kernel `id`, if the caller may see it: another tenant's kernel does not exist for
/// a non-admin key (404, as for an unknown id).
pub fn find(
    state: &AppState,
    caller: &Caller,
    id: &str,
) -> Result<std::sync::Arc<LiveKernel>, ApiError> {
    state
        .kernels
        .get(id)
        .filter(|live| caller.0.may_use(live.owner()))
        .ok_or_else(|| ApiError::no_kernel(id))
}

pub async fn list(State(state): State<AppState>, caller: Caller) -> Json<Vec<Value>> {
    Json(
        state
            .kernels
            .list()
            .iter()
            .filter(|l| caller.0.may_use(l.owner()))
            .map(|l| model(l))
            .collect(),
    )
}

#[derive(Debug, Default, Deserialize)]
pub struct CreateBody {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, Value>,
}

pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let body: CreateBody = match body.as_ref() {
        [] => CreateBody::default(),
        bytes => serde_json::from_slice(bytes).map_err(|e| {
            ApiError::bad_request(format!(
                "body must be JSON like {{\"name\": \"python3\"}}: {e}"
            ))
        })?,
    };
    // Clients send numbers and booleans in env too (KERNEL_LAUNCH_TIMEOUT); keep them as text.
    let env: BTreeMap<String, String> = body
        .env
        .into_iter()
        .map(|(k, v)| match v {
            Value::String(s) => (k, s),
            other => (k, other.to_string()),
        })
        .collect();
    let live = state
        .kernels
        .create(body.name.as_deref(), &env, &caller.0)
        .await?;
    let location = format!("/api/kernels/{}", live.id());
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(model(&live)),
    )
        .into_response())
}

pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let live = find(&state, &caller, &id)?;
    Ok(Json(model(&live)))
}

pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let live = find(&state, &caller, &id)?;
    state.kernels.audit().record(
        "kernel_deleted",
        json!({"kernel": id, "key": caller.0.name, "owner": live.owner()}),
    );
    match state.kernels.delete(&id).await {
        None => Err(ApiError::no_kernel(&id)),
        Some(Ok(())) => Ok(StatusCode::NO_CONTENT),
        // The kernel is gone from the table either way; say what went wrong with cleanup.
        Some(Err(e)) => Err(e.into()),
    }
}

pub async fn interrupt(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let live = find(&state, &caller, &id)?;
    state.kernels.interrupt(&live).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn restart(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let live = find(&state, &caller, &id)?;
    state.kernels.audit().record(
        "kernel_restarted",
        json!({"kernel": id, "key": caller.0.name, "owner": live.owner()}),
    );
    state.kernels.restart(&live).await?;
    Ok(Json(model(&live)))
}
