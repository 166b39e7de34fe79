//! E2B's pause and resume, onto hibernation (docs/hibernation.md): `POST
//! /sandboxes/{id}/pause` hibernates the sandbox's kernel (the whole kernel under the gVisor
//! engine, its variables and files under Docker), and a connect resumes it
//! ([`super::control::connect`]), with its state or, on the SDK's `on_resume="reboot"`, as
//! a fresh kernel with its files. A paused sandbox lists as `paused`.

use super::super::error::ApiError;
use super::super::extract::json_body;
use super::super::AppState;
use super::control::{owned, ApiKey, E2bError, SandboxPath};
use crate::kernels::hibernate::HibernateError;
use crate::kernels::{CreateError, LiveKernel};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use kernelgate_protocol::e2b::{E2bErrorBody, SandboxPause};
use std::sync::Arc;

/// Pauses an E2B sandbox: its kernel hibernates (E2B's `pause`).
///
/// Under the gVisor engine the whole kernel is kept (a running generator, a thread);
/// under Docker its variables and files, and what cannot be saved is refused by name. A
/// connect resumes it; its timeout still ends it.
#[utoipa::path(
    post, path = "/sandboxes/{id}/pause", tag = "e2b", operation_id = "e2b_pause_sandbox",
    security(("e2b_api_key" = [])),
    params(SandboxPath),
    request_body(content = Option<SandboxPause>, content_type = "application/json"),
    responses(
        (status = 204, description = "Paused: its kernel hibernated"),
        (status = 400, description = "It cannot be paused as it is: it runs code, or its state cannot be kept (the message names the variables or files, or the budget it passes), or a filesystem-only pause was asked; it runs on", body = E2bErrorBody),
        (status = 404, description = "No such sandbox (or another key's)", body = E2bErrorBody),
        (status = 409, description = "It is paused already", body = E2bErrorBody),
        (status = 503, description = "Saving failed (the message says why); it runs on", body = E2bErrorBody),
    ),
)]
pub async fn pause(
    State(state): State<AppState>,
    key: ApiKey,
    Path(SandboxPath { id }): Path<SandboxPath>,
    body: Bytes,
) -> Result<StatusCode, E2bError> {
    let body: SandboxPause = match body.as_ref() {
        [] => SandboxPause::default(),
        bytes => json_body(bytes, r#"{"memory": true}"#)?,
    };
    owned(&state, &key, &id)?;
    if body.memory == Some(false) {
        return Err(ApiError::bad_request(
            "a filesystem-only pause is not offered: a pause keeps all the engine can keep; \
             connect with on_resume=\"reboot\" to start again fresh with the files"
                .to_owned(),
        )
        .into());
    }
    let live = state
        .kernels
        .get(&id)
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found")))?;
    if live.hibernated() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is paused already"),
        )
        .into());
    }
    match state.kernels.hibernation().hibernate(&live).await {
        Ok(()) => Ok(StatusCode::NO_CONTENT),
        // Not 409: the SDK reads that as "paused already" and says nothing.
        Err(
            e @ (HibernateError::Busy(_) | HibernateError::Blocked(_) | HibernateError::Full(_)),
        ) => Err(ApiError::bad_request(format!("sandbox {id} runs on, not paused: {e}")).into()),
        Err(e) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("sandbox {id} runs on, not paused: {e}"),
        )
        .into()),
    }
}

/// Resumes a paused sandbox's kernel (nothing for a running one): with its state, or
/// (`memory` false) as a fresh kernel with its files. Whether it was paused.
pub(super) async fn resume(
    state: &AppState,
    live: &Arc<LiveKernel>,
    key: &ApiKey,
    memory: bool,
) -> Result<bool, E2bError> {
    if !live.hibernated() {
        return Ok(false);
    }
    let hibernation = state.kernels.hibernation();
    let resumed = match memory {
        true => hibernation.resume(live).await,
        false => hibernation.discard_state(live, &key.0.name).await.map(drop),
    };
    match resumed {
        Ok(()) => Ok(true),
        Err(CreateError::StateNotLoaded { why, .. }) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "sandbox {}'s saved state did not load ({why}); it stays paused with its state: connect again, or with on_resume=\"reboot\" for a fresh kernel with its files",
                live.id()
            ),
        )
        .into()),
        Err(e) => Err(e.into()),
    }
}
