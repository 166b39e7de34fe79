//! Jupyter Server's kernel REST API: list, create, get, delete, interrupt, restart.

use super::auth::Caller;
use super::error::{body_refused, ApiError, ErrorBody};
use super::extract::{json_body, Path};
use super::AppState;
use crate::kernels::LiveKernel;
use crate::kernels::Removal;
use crate::relay::iso;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use utoipa::IntoParams;

pub use kernelgate_protocol::rest::{CreateKernel, KernelModel};

/// The model of a live kernel.
pub fn model_of(live: &LiveKernel) -> KernelModel {
    let k = &live.relay;
    let activity = k.activity();
    KernelModel {
        id: live.id().to_owned(),
        name: live.name.clone(),
        last_activity: iso(activity.last_activity),
        execution_state: k.execution_state().as_str().to_owned(),
        connections: activity.connections,
        hibernated: live.at_rest(),
        hibernate_blocked: live.hibernate_blocked(),
        hibernation: Some(live.hibernation_kind().as_str().to_owned()),
    }
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

/// The `{id}` of the routes about one kernel.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct KernelPath {
    /// The kernel's id, a UUID, as `POST /api/kernels` answered it.
    pub id: String,
}

/// The caller's kernels (every kernel, for an admin key).
#[utoipa::path(
    get, path = "/api/kernels", tag = "kernels", operation_id = "list_kernels",
    responses((status = 200, description = "The kernels the caller may use", body = [KernelModel])),
)]
pub async fn list(State(state): State<AppState>, caller: Caller) -> Json<Vec<KernelModel>> {
    Json(
        state
            .kernels
            .list()
            .iter()
            .filter(|l| caller.0.may_use(l.owner()))
            .map(|l| model_of(l))
            .collect(),
    )
}

/// Starts a kernel.
///
/// From the warm pool when one is ready. A client that hangs up while it starts has it
/// rolled back.
#[utoipa::path(
    post, path = "/api/kernels", tag = "kernels", operation_id = "create_kernel",
    request_body(content = Option<CreateKernel>, content_type = "application/json"),
    responses(
        (status = 201, description = "The kernel runs", body = KernelModel,
         headers(("Location" = String, description = "`/api/kernels/{id}`"))),
        (status = 400, description = "The body is not JSON of this shape, an env variable is refused, \
            or a snapshot cannot start the kernel asked for (another spec; `env` for a `memory` snapshot)", body = ErrorBody),
        (status = 403, description = "Past `--max-kernels`, or past the key's `max_kernels`", body = ErrorBody),
        (status = 404, description = "No kernel spec of that name, or no such snapshot (or another key's)", body = ErrorBody),
        (status = 503, description = "Docker cannot be reached, the spec's image is missing (the message says how to build it), or the gateway is shutting down", body = ErrorBody),
        (status = 504, description = "The kernel did not answer within `--startup-timeout`", body = ErrorBody),
    ),
)]
pub async fn create(
    State(state): State<AppState>,
    caller: Caller,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = match body {
        Ok(body) => body,
        Err(e) => return Ok(body_refused(e, state.max_message_bytes)),
    };
    // No body, or `null`: the default spec.
    let body: CreateKernel = match body.as_ref() {
        [] => CreateKernel::default(),
        bytes => {
            json_body::<Option<CreateKernel>>(bytes, r#"{"name": "python3"}"#)?.unwrap_or_default()
        }
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
    let live = match &body.snapshot {
        Some(snapshot) => {
            let held = super::snapshots::find_snapshot(&state, &caller, snapshot)?;
            state
                .kernels
                .create_from(held, body.name.as_deref(), &env, &caller.0)
                .await?
        }
        None => {
            state
                .kernels
                .create(body.name.as_deref(), &env, &caller.0)
                .await?
        }
    };
    let location = format!("/api/kernels/{}", live.id());
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(model_of(&live)),
    )
        .into_response())
}

/// One kernel.
#[utoipa::path(
    get, path = "/api/kernels/{id}", tag = "kernels", operation_id = "get_kernel",
    params(KernelPath),
    responses(
        (status = 200, description = "The kernel", body = KernelModel),
        (status = 404, description = "No such kernel (or another key's): it is gone", body = ErrorBody),
    ),
)]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(KernelPath { id }): Path<KernelPath>,
) -> Result<Json<KernelModel>, ApiError> {
    let live = find(&state, &caller, &id)?;
    Ok(Json(model_of(&live)))
}

/// Shuts a kernel down and removes its container; completes even if the client hangs up.
#[utoipa::path(
    delete, path = "/api/kernels/{id}", tag = "kernels", operation_id = "delete_kernel",
    params(KernelPath),
    responses(
        (status = 204, description = "The kernel is gone"),
        (status = 404, description = "No such kernel", body = ErrorBody),
        (status = 503, description = "The kernel is gone from the gateway, but removing its container failed", body = ErrorBody),
    ),
)]
pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path(KernelPath { id }): Path<KernelPath>,
) -> Result<StatusCode, ApiError> {
    find(&state, &caller, &id)?;
    match state
        .kernels
        .delete(&id, Removal::AskedBy(caller.0.name.clone()))
        .await
    {
        None => Err(ApiError::no_kernel(&id)),
        Some(Ok(())) => Ok(StatusCode::NO_CONTENT),
        // The kernel is gone from the table either way; say what went wrong with cleanup.
        Some(Err(e)) => Err(e.into()),
    }
}

/// SIGINT to the kernel: a running cell ends with `KeyboardInterrupt`, state is kept.
#[utoipa::path(
    post, path = "/api/kernels/{id}/interrupt", tag = "kernels", operation_id = "interrupt_kernel",
    params(KernelPath),
    responses(
        (status = 204, description = "Interrupted"),
        (status = 404, description = "No such kernel, or its container is gone", body = ErrorBody),
        (status = 503, description = "Docker could not signal the kernel", body = ErrorBody),
    ),
)]
pub async fn interrupt(
    State(state): State<AppState>,
    caller: Caller,
    Path(KernelPath { id }): Path<KernelPath>,
) -> Result<StatusCode, ApiError> {
    let live = find(&state, &caller, &id)?;
    state.kernels.interrupt(&live).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A fresh kernel process under the same id: variables and files are gone.
#[utoipa::path(
    post, path = "/api/kernels/{id}/restart", tag = "kernels", operation_id = "restart_kernel",
    params(KernelPath),
    responses(
        (status = 200, description = "Restarted", body = KernelModel),
        (status = 404, description = "No such kernel", body = ErrorBody),
        (status = 503, description = "It could not be restarted in 3 tries (Docker refused, its \
            container is gone, or each new process died while it started: the message says why \
            and what to do), or the gateway is shutting down", body = ErrorBody),
        (status = 504, description = "The restarted kernel did not answer within `--startup-timeout`", body = ErrorBody),
    ),
)]
pub async fn restart(
    State(state): State<AppState>,
    caller: Caller,
    Path(KernelPath { id }): Path<KernelPath>,
) -> Result<Json<KernelModel>, ApiError> {
    let live = find(&state, &caller, &id)?;
    state
        .kernels
        .supervisor()
        .restart(&live, &caller.0.name)
        .await?;
    Ok(Json(model_of(&live)))
}

/// Hibernates the kernel now: its variables, files and history go to disk and its
/// container is removed; the next request that needs it brings it back (docs/hibernation.md).
#[utoipa::path(
    post, path = "/api/kernels/{id}/hibernate", tag = "kernels", operation_id = "hibernate_kernel",
    params(KernelPath),
    responses(
        (status = 200, description = "Hibernated (or it was already)", body = KernelModel),
        (status = 404, description = "No such kernel", body = ErrorBody),
        (status = 409, description = "It keeps running: it is busy, or its state cannot be kept \
            (the message names the variables or files, or the budget it passes)", body = ErrorBody),
        (status = 503, description = "Saving failed (the message says why); it keeps running", body = ErrorBody),
    ),
)]
pub async fn hibernate(
    State(state): State<AppState>,
    caller: Caller,
    Path(KernelPath { id }): Path<KernelPath>,
) -> Result<Json<KernelModel>, ApiError> {
    use crate::kernels::hibernate::HibernateError;
    let live = find(&state, &caller, &id)?;
    match state.kernels.hibernation().hibernate(&live).await {
        Ok(()) => Ok(Json(model_of(&live))),
        Err(
            e @ (HibernateError::Busy(_) | HibernateError::Blocked(_) | HibernateError::Full(_)),
        ) => Err(ApiError::new(StatusCode::CONFLICT, e.to_string())),
        Err(e) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            e.to_string(),
        )),
    }
}

/// Discards a hibernated kernel's saved variables: it wakes as a fresh process with its saved files.
/// For a state that does not load (docs/hibernation.md); the kernel keeps its id and clients.
#[utoipa::path(
    post, path = "/api/kernels/{id}/discard-state", tag = "kernels", operation_id = "discard_kernel_state",
    params(KernelPath),
    responses(
        (status = 200, description = "It runs again, fresh, with its saved files", body = KernelModel),
        (status = 404, description = "No such kernel", body = ErrorBody),
        (status = 409, description = "It does not hibernate: there is no saved state to discard", body = ErrorBody),
        (status = 503, description = "It could not be started (the message says why); its state is kept", body = ErrorBody),
    ),
)]
pub async fn discard_state(
    State(state): State<AppState>,
    caller: Caller,
    Path(KernelPath { id }): Path<KernelPath>,
) -> Result<Json<KernelModel>, ApiError> {
    let live = find(&state, &caller, &id)?;
    match state
        .kernels
        .hibernation()
        .discard_state(&live, &caller.0.name)
        .await?
    {
        true => Ok(Json(model_of(&live))),
        false => Err(ApiError::new(
            StatusCode::CONFLICT,
            "the kernel does not hibernate: it has no saved state to discard".to_owned(),
        )),
    }
}
