//! E2B's snapshots and forks, onto the gateway's own (docs/snapshots.md):
//! `POST /sandboxes/{id}/snapshots` takes one, `GET /snapshots` lists the key's, `DELETE
//! /templates/{id}` deletes one (as the SDK's `delete_snapshot` does), a create whose
//! `templateID` names one starts from it ([`super::control::create`]), and `POST
//! /sandboxes/{id}/fork` starts `count` sandboxes from one snapshot, each answered on its
//! own.

use super::super::error::ApiError;
use super::super::extract::json_body;
use super::super::AppState;
use super::control::{created, owned, paged, timeout_of, ApiKey, E2bError, SandboxPath};
use super::{watch_expiry, Sandbox};
use crate::kernels::snapshots::{Filter, Held, KeyBudget, Mode, TakeRequest};
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::Utc;
use kernelgate_protocol::e2b::{
    E2bErrorBody, SandboxForkRequest, SandboxForkResult, SandboxSnapshotRequest, SnapshotInfo,
};
use kernelgate_protocol::rest::SnapshotModel;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use utoipa::IntoParams;

/// Forks a fork request makes when it names no count (E2B's default).
const DEFAULT_FORKS: usize = 1;

fn info(model: &SnapshotModel) -> SnapshotInfo {
    SnapshotInfo {
        snapshot_id: model.id.clone(),
        names: model.name.iter().cloned().collect(),
    }
}

/// The snapshot `id` (or name) of the key, as a create's `templateID` may name it.
pub fn of_key(state: &AppState, key: &ApiKey, id: &str) -> Option<Arc<Held>> {
    let tenant = &key.0;
    state
        .kernels
        .snapshots()
        .find(id, &tenant.name, |owner| tenant.may_use(owner))
        .ok()
}

/// Takes a snapshot of an E2B sandbox, which runs on (E2B's `create_snapshot`).
///
/// `memory: false` keeps the home's files only; otherwise all the engine can keep: the
/// whole kernel under the gVisor engine, its variables and files under Docker (where what
/// cannot be saved is refused by name).
#[utoipa::path(
    post, path = "/sandboxes/{id}/snapshots", tag = "e2b", operation_id = "e2b_snapshot_sandbox",
    security(("e2b_api_key" = [])),
    params(SandboxPath),
    request_body(content = Option<SandboxSnapshotRequest>, content_type = "application/json"),
    responses(
        (status = 201, description = "Taken; the sandbox runs on. Its `snapshotID` is a create's `templateID`", body = SnapshotInfo),
        (status = 400, description = "The body is not JSON of this shape, or the name is refused", body = E2bErrorBody),
        (status = 404, description = "No such sandbox (or another key's)", body = E2bErrorBody),
        (status = 409, description = "The sandbox runs code, or its state cannot be kept (the message names the variables, or the budget and what is used); it runs on", body = E2bErrorBody),
        (status = 503, description = "Taking it failed; the message says what became of the sandbox", body = E2bErrorBody),
    ),
)]
pub async fn take(
    State(state): State<AppState>,
    key: ApiKey,
    Path(SandboxPath { id }): Path<SandboxPath>,
    body: Bytes,
) -> Result<Response, E2bError> {
    let body: SandboxSnapshotRequest = match body.as_ref() {
        [] => SandboxSnapshotRequest::default(),
        bytes => json_body(bytes, r#"{"name": "cleaned"}"#)?,
    };
    owned(&state, &key, &id)?;
    let live = state.kernels.get(&id).ok_or_else(|| not_found(&id))?;
    let req = TakeRequest {
        name: body.name,
        metadata: BTreeMap::new(),
        mode: match body.memory {
            Some(false) => Mode::Filesystem,
            _ => Mode::Full,
        },
        accept_loss: false,
    };
    let taken = state
        .kernels
        .snapshots()
        .take(&live, req, &key.0.name, KeyBudget::of(&key.0))
        .await?;
    Ok((StatusCode::CREATED, Json(info(&taken.model()))).into_response())
}

fn not_found(id: &str) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found"))
}

/// The query of `GET /snapshots`. Lenient, as E2B's is: a value that does not parse is
/// ignored.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct SnapshotQuery {
    /// Only the snapshots of this sandbox.
    #[serde(rename = "sandboxID")]
    pub sandbox_id: Option<String>,
    /// Only the snapshot of this name or id.
    pub name: Option<String>,
    /// At most this many per page (a positive number).
    pub limit: Option<String>,
    /// Where the page starts: the `x-next-token` of the page before.
    #[serde(rename = "nextToken")]
    pub next_token: Option<String>,
}

/// The key's snapshots, newest first (E2B's `list_snapshots`).
#[utoipa::path(
    get, path = "/snapshots", tag = "e2b", operation_id = "e2b_list_snapshots",
    security(("e2b_api_key" = [])),
    params(SnapshotQuery),
    responses(
        (status = 200, description = "The key's snapshots (every key's, for an admin key), newest first; when more follow, the next page's `nextToken` is the `x-next-token` header", body = [SnapshotInfo],
         headers(("x-next-token" = String, description = "The `nextToken` of the next page"))),
    ),
)]
pub async fn list(
    State(state): State<AppState>,
    key: ApiKey,
    Query(query): Query<SnapshotQuery>,
) -> Result<Response, E2bError> {
    let tenant = &key.0;
    let all = state.kernels.snapshots().list(
        &Filter {
            limit: usize::MAX,
            ..Filter::default()
        },
        |owner| tenant.may_use(owner),
    );
    let matching: Vec<SnapshotInfo> = all
        .snapshots
        .iter()
        .filter(|s| query.sandbox_id.as_ref().is_none_or(|k| *k == s.kernel_id))
        .filter(|s| {
            query
                .name
                .as_ref()
                .is_none_or(|n| *n == s.id || s.name.as_ref() == Some(n))
        })
        .map(info)
        .collect();
    Ok(paged(
        matching,
        query.limit.as_deref(),
        query.next_token.as_deref(),
    ))
}

/// The `{id}` of `DELETE /templates/{id}`.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct TemplatePath {
    /// A snapshot's id (or its name among the key's snapshots).
    pub id: String,
}

/// Deletes a snapshot (E2B's `delete_snapshot`).
///
/// A sandbox being started from it finishes first. The gateway's kernel specs are not
/// deleted this way.
#[utoipa::path(
    delete, path = "/templates/{id}", tag = "e2b", operation_id = "e2b_delete_snapshot",
    security(("e2b_api_key" = [])),
    params(TemplatePath),
    responses(
        (status = 204, description = "The snapshot is deleted"),
        (status = 404, description = "No snapshot of that id or name (or another key's); kernel specs are not deleted through E2B's API", body = E2bErrorBody),
    ),
)]
pub async fn delete(
    State(state): State<AppState>,
    key: ApiKey,
    Path(TemplatePath { id }): Path<TemplatePath>,
) -> Result<StatusCode, E2bError> {
    let Some(held) = of_key(&state, &key, &id) else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("snapshot {id} not found (kernel specs are not deleted through E2B's API)"),
        )
        .into());
    };
    state
        .kernels
        .snapshots()
        .delete(&held, Some(&key.0.name), None)
        .await;
    Ok(StatusCode::NO_CONTENT)
}

/// Forks an E2B sandbox: one snapshot, `count` sandboxes started from it (E2B's `fork`).
///
/// Each fork has its own id, access token and kernel, the source's template, metadata and
/// code contexts, and its own timeout; forks are independent of each other and of the
/// source, and each succeeds or fails on its own.
#[utoipa::path(
    post, path = "/sandboxes/{id}/fork", tag = "e2b", operation_id = "e2b_fork_sandbox",
    security(("e2b_api_key" = [])),
    params(SandboxPath),
    request_body(content = Option<SandboxForkRequest>, content_type = "application/json"),
    responses(
        (status = 201, description = "The snapshot was taken: one result per fork, its sandbox or its error", body = [SandboxForkResult]),
        (status = 400, description = "`count` is not 1-20, the timeout is out of range, or the body is not JSON of this shape", body = E2bErrorBody),
        (status = 404, description = "No such sandbox (or another key's)", body = E2bErrorBody),
        (status = 409, description = "The sandbox runs code, or its state cannot be kept (the message names what); it runs on", body = E2bErrorBody),
        (status = 503, description = "The snapshot failed; the message says what became of the sandbox", body = E2bErrorBody),
    ),
)]
pub async fn fork(
    State(state): State<AppState>,
    key: ApiKey,
    Path(SandboxPath { id }): Path<SandboxPath>,
    body: Bytes,
) -> Result<Response, E2bError> {
    let body: SandboxForkRequest = match body.as_ref() {
        [] => SandboxForkRequest::default(),
        bytes => json_body(bytes, r#"{"count": 2, "timeout": 300}"#)?,
    };
    let timeout = timeout_of(body.timeout)?;
    let source = owned(&state, &key, &id)?;
    let live = state.kernels.get(&id).ok_or_else(|| not_found(&id))?;
    let forked = state
        .kernels
        .snapshots()
        .fork(&live, body.count.unwrap_or(DEFAULT_FORKS), false, &key.0)
        .await?;
    let results: Vec<SandboxForkResult> = forked
        .forks
        .into_iter()
        .map(|fork| match fork {
            Ok(live) => {
                let now = Utc::now();
                let sandbox = Sandbox {
                    started_at: now,
                    end_at: now + timeout,
                    ..source.clone()
                };
                let fork_id = live.id().to_owned();
                state.e2b.insert(&fork_id, sandbox.clone());
                watch_expiry(&state, fork_id.clone());
                SandboxForkResult {
                    sandbox: Some(created(&state, &fork_id, &sandbox)),
                    error: None,
                }
            }
            Err(e) => {
                let e = ApiError::from(e);
                SandboxForkResult {
                    sandbox: None,
                    error: Some(E2bErrorBody {
                        code: Some(e.status.as_u16()),
                        reason: e.status.canonical_reason().unwrap_or("Error").to_owned(),
                        message: e.message,
                    }),
                }
            }
        })
        .collect();
    Ok((StatusCode::CREATED, Json(results)).into_response())
}
