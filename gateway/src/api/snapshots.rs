//! Snapshots and forks (docs/snapshots.md): `POST /api/kernels/{id}/snapshots` and
//! `POST /api/kernels/{id}/fork`, and the key's snapshots under
//! `/api/kernelgate/snapshots`. A kernel starts from one with `POST /api/kernels`
//! (`{"snapshot": ...}`, in [`super::kernels::create`]).

use super::auth::Caller;
use super::error::{body_refused, ApiError, ErrorBody};
use super::extract::{json_body, Path};
use super::kernels::{find, model_of, KernelPath};
use super::AppState;
use crate::kernels::snapshots::{Filter, Held, KeyBudget, Mode, SnapshotError, TakeRequest};
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kernelgate_protocol::rest::{
    CreateSnapshot, ForkError, ForkKernel, ForkResult, Forks, SnapshotModel, SnapshotPage,
};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::Arc;
use utoipa::IntoParams;

/// Snapshots a page holds unless `limit` says otherwise, and at most.
const PAGE: usize = 100;
const MAX_PAGE: usize = 1000;

impl From<SnapshotError> for ApiError {
    fn from(e: SnapshotError) -> Self {
        let status = match &e {
            SnapshotError::Invalid(_) => StatusCode::BAD_REQUEST,
            SnapshotError::NotFound(_) => StatusCode::NOT_FOUND,
            SnapshotError::Refused(_) | SnapshotError::Busy(_) => StatusCode::CONFLICT,
            SnapshotError::Failed(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        ApiError::new(status, e.to_string())
    }
}

/// The snapshot `id` (or name) as the caller may use it.
pub fn find_snapshot(state: &AppState, caller: &Caller, id: &str) -> Result<Arc<Held>, ApiError> {
    let tenant = caller.0.clone();
    Ok(state
        .kernels
        .snapshots()
        .find(id, &tenant.name, |owner| tenant.may_use(owner))?)
}

/// Takes a snapshot of the kernel, which runs on.
///
/// Under the gVisor engine a `full` snapshot is the whole kernel (`memory`): its relays
/// pause while the checkpoint is written, and what clients send meanwhile waits. Under
/// Docker it is Python-level (`namespace`): variables that cannot be pickled are refused by
/// name unless `accept_loss`. `filesystem` keeps the home's files only.
#[utoipa::path(
    post, path = "/api/kernels/{id}/snapshots", tag = "snapshots", operation_id = "snapshot_kernel",
    params(KernelPath),
    request_body(content = Option<CreateSnapshot>, content_type = "application/json"),
    responses(
        (status = 201, description = "Taken; the kernel runs on", body = SnapshotModel,
         headers(("Location" = String, description = "`/api/kernelgate/snapshots/{id}`"))),
        (status = 400, description = "The body is not JSON of this shape, or a name or metadata is refused", body = ErrorBody),
        (status = 404, description = "No such kernel", body = ErrorBody),
        (status = 409, description = "The kernel is busy, or its state cannot be kept as asked \
            (the message names the variables, or the budget and what is used); it runs on", body = ErrorBody),
        (status = 503, description = "Taking it failed; the message says what became of the kernel", body = ErrorBody),
    ),
)]
pub async fn take(
    State(state): State<AppState>,
    caller: Caller,
    Path(KernelPath { id }): Path<KernelPath>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = match body {
        Ok(body) => body,
        Err(e) => return Ok(body_refused(e, state.max_message_bytes)),
    };
    let body: CreateSnapshot = match body.as_ref() {
        [] => CreateSnapshot::default(),
        bytes => {
            json_body::<Option<CreateSnapshot>>(bytes, r#"{"name": "cleaned", "mode": "full"}"#)?
                .unwrap_or_default()
        }
    };
    let mode = Mode::parse(body.mode.as_deref())?;
    let live = find(&state, &caller, &id)?;
    let req = TakeRequest {
        name: body.name,
        metadata: body.metadata,
        mode,
        accept_loss: body.accept_loss,
    };
    let taken = state
        .kernels
        .snapshots()
        .take(&live, req, &caller.0.name, KeyBudget::of(&caller.0))
        .await?;
    if let Some(name) = &taken.name {
        super::cluster::replace_named(&state, &caller, name, &taken.id).await;
    }
    let location = format!("/api/kernelgate/snapshots/{}", taken.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(taken.model()),
    )
        .into_response())
}

/// Forks the kernel: one snapshot, `count` kernels started from it.
///
/// Each fork has its own id, key and session, and reseeded random state; forks are
/// independent of each other and of the source. Each succeeds or fails on its own; the
/// fork's snapshot is not listed and is removed once they run.
#[utoipa::path(
    post, path = "/api/kernels/{id}/fork", tag = "snapshots", operation_id = "fork_kernel",
    params(KernelPath),
    request_body(content = ForkKernel, content_type = "application/json"),
    responses(
        (status = 200, description = "The snapshot was taken; one result per fork", body = Forks),
        (status = 400, description = "`count` is not 1-20, or the body is not JSON of this shape", body = ErrorBody),
        (status = 404, description = "No such kernel", body = ErrorBody),
        (status = 409, description = "The kernel is busy, or its state cannot be kept (the message names what); it runs on", body = ErrorBody),
        (status = 503, description = "The snapshot failed; the message says what became of the kernel", body = ErrorBody),
    ),
)]
pub async fn fork(
    State(state): State<AppState>,
    caller: Caller,
    Path(KernelPath { id }): Path<KernelPath>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = match body {
        Ok(body) => body,
        Err(e) => return Ok(body_refused(e, state.max_message_bytes)),
    };
    let body: ForkKernel = json_body(&body, r#"{"count": 3}"#)?;
    let live = find(&state, &caller, &id)?;
    let forked = state
        .kernels
        .snapshots()
        .fork(&live, body.count, body.accept_loss, &caller.0)
        .await?;
    let forks = forked
        .forks
        .into_iter()
        .map(|fork| match fork {
            Ok(live) => ForkResult {
                kernel: Some(model_of(&live)),
                error: None,
            },
            Err(e) => {
                let e = ApiError::from(e);
                ForkResult {
                    kernel: None,
                    error: Some(ForkError {
                        status: e.status.as_u16(),
                        message: e.message,
                    }),
                }
            }
        })
        .collect();
    Ok(Json(Forks {
        kind: forked.kind.as_str().to_owned(),
        dropped: forked.dropped,
        forks,
    })
    .into_response())
}

/// What `GET /api/kernelgate/snapshots` filters and pages by.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Only the snapshot of this name.
    name: Option<String>,
    /// Only snapshots whose metadata holds each `key=value` pair of this query string
    /// (`metadata=team%3Dml%26stage%3Dclean`, as E2B's SDK sends it).
    metadata: Option<String>,
    /// Snapshots per page: 1 to 1000, default 100.
    limit: Option<usize>,
    /// The `next` of the previous page.
    next: Option<String>,
}

/// The caller's snapshots (every key's, for an admin key), newest first, paged.
#[utoipa::path(
    get, path = "/api/kernelgate/snapshots", tag = "snapshots", operation_id = "list_snapshots",
    params(ListQuery),
    responses(
        (status = 200, description = "A page of snapshots", body = SnapshotPage),
        (status = 400, description = "A query parameter is refused", body = ErrorBody),
    ),
)]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<SnapshotPage>, ApiError> {
    let Query(query) = query.map_err(|e| {
        ApiError::bad_request(format!("{}; e.g. ?name=cleaned&limit=50", e.body_text()))
    })?;
    let limit = query.limit.unwrap_or(PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "limit {limit}: 1 to {MAX_PAGE} snapshots per page"
        )));
    }
    let metadata: BTreeMap<String, String> = match &query.metadata {
        Some(pairs) => form_urlencoded::parse(pairs.as_bytes())
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect(),
        None => BTreeMap::new(),
    };
    let filter = Filter {
        name: query.name,
        metadata,
        limit,
        after: query.next,
    };
    let tenant = caller.0.clone();
    // In a cluster, other nodes' snapshots too, as the registry lists them.
    let elsewhere = state.cluster.as_ref().map_or_else(Vec::new, |cluster| {
        let view = cluster.membership.view_for(None);
        view.snapshots
            .into_values()
            .filter(|r| r.node != cluster.node_id)
            .map(|r| (r.owner, r.model))
            .collect()
    });
    let page =
        state
            .kernels
            .snapshots()
            .list_with(&filter, |owner| tenant.may_use(owner), elsewhere);
    Ok(Json(SnapshotPage {
        snapshots: page.snapshots,
        next: page.next,
    }))
}

/// The `{id}` of a snapshot.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct SnapshotPath {
    /// The snapshot's id, or its name among the caller's snapshots.
    id: String,
}

/// One snapshot.
#[utoipa::path(
    get, path = "/api/kernelgate/snapshots/{id}", tag = "snapshots", operation_id = "get_snapshot",
    params(SnapshotPath),
    responses(
        (status = 200, description = "The snapshot", body = SnapshotModel),
        (status = 404, description = "No such snapshot (or another key's)", body = ErrorBody),
    ),
)]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(SnapshotPath { id }): Path<SnapshotPath>,
) -> Result<Json<SnapshotModel>, ApiError> {
    let held = find_snapshot(&state, &caller, &id)?;
    Ok(Json(held.record.model()))
}

/// Deletes a snapshot; a kernel being started from it finishes first.
#[utoipa::path(
    delete, path = "/api/kernelgate/snapshots/{id}", tag = "snapshots", operation_id = "delete_snapshot",
    params(SnapshotPath),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such snapshot (or another key's)", body = ErrorBody),
    ),
)]
pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path(SnapshotPath { id }): Path<SnapshotPath>,
) -> Result<StatusCode, ApiError> {
    let held = find_snapshot(&state, &caller, &id)?;
    state
        .kernels
        .snapshots()
        .delete(&held, Some(&caller.0.name), None)
        .await;
    Ok(StatusCode::NO_CONTENT)
}
