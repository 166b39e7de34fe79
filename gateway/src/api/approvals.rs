//! `GET /api/kernelgate/approvals` and `POST /api/kernelgate/approvals/{id}`: the
//! executions an `ask` rule of the execution policy holds, and an admin's answer to one.
//! Admin keys only: approving code is the policy's escape hatch.

use super::auth::Caller;
use super::error::{body_refused, ApiError, ErrorBody};
use super::extract::{json_body, Path};
use super::AppState;
use crate::policy::{Answer, Approval};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use utoipa::{IntoParams, ToSchema};

/// An administrator's answer to a held execution.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct AnswerBody {
    /// `true` runs the code, `false` denies it (the cell fails with `PolicyViolation`).
    approve: bool,
}

/// The `{id}` of an approval.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct ApprovalPath {
    /// The approval's id, from the list.
    id: String,
}

fn admin_only(caller: &Caller) -> Result<(), ApiError> {
    if caller.0.admin {
        return Ok(());
    }
    Err(ApiError::new(
        StatusCode::FORBIDDEN,
        format!(
            "key '{}' is not an admin key: only admins see and answer approvals",
            caller.0.name
        ),
    ))
}

/// The executions waiting for approval, oldest first (none when no policy is set).
#[utoipa::path(
    get, path = "/api/kernelgate/approvals", tag = "approvals", operation_id = "list_approvals",
    responses(
        (status = 200, description = "The held executions, oldest first", body = [Approval]),
        (status = 403, description = "The key is not an admin key", body = ErrorBody),
    ),
)]
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<Vec<Approval>>, ApiError> {
    admin_only(&caller)?;
    Ok(Json(state.guard.map(|g| g.list()).unwrap_or_default()))
}

/// Approves or denies one held execution: 204, or 404 when it is no longer waiting.
#[utoipa::path(
    post, path = "/api/kernelgate/approvals/{id}", tag = "approvals", operation_id = "answer_approval",
    params(ApprovalPath),
    request_body = AnswerBody,
    responses(
        (status = 204, description = "Answered: the execution runs, or fails as denied"),
        (status = 400, description = "The body is not `{\"approve\": true|false}`", body = ErrorBody),
        (status = 403, description = "The key is not an admin key", body = ErrorBody),
        (status = 404, description = "No execution waits for this approval (answered, timed out, cancelled, its kernel gone, or no policy is set)", body = ErrorBody),
    ),
)]
pub async fn answer(
    State(state): State<AppState>,
    caller: Caller,
    Path(ApprovalPath { id }): Path<ApprovalPath>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    admin_only(&caller)?;
    let body = match body {
        Ok(body) => body,
        Err(e) => return Ok(body_refused(e, state.max_message_bytes)),
    };
    let body: AnswerBody = json_body(&body, r#"{"approve": true} or {"approve": false}"#)?;
    let by = caller.0.name.clone();
    let answer = if body.approve {
        Answer::Approved { by }
    } else {
        Answer::Denied { by }
    };
    let answered = state.guard.is_some_and(|g| g.answer(&id, answer));
    if !answered {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no execution waits for approval {id} (answered, timed out, cancelled, or its kernel is gone)"),
        ));
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}
