//! `GET /api/kernelgate/approvals` and `POST /api/kernelgate/approvals/{id}`: the
//! executions an `ask` rule of the execution policy holds, and an admin's answer to one.
//! Admin keys only: approving code is the policy's escape hatch.

use super::auth::Caller;
use super::error::ApiError;
use super::AppState;
use crate::policy::{Answer, Approval};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AnswerBody {
    approve: bool,
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
pub async fn list(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<Json<Vec<Approval>>, ApiError> {
    admin_only(&caller)?;
    Ok(Json(state.guard.map(|g| g.list()).unwrap_or_default()))
}

/// Approves or denies one held execution: 204, or 404 when it is no longer waiting.
pub async fn answer(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    admin_only(&caller)?;
    let body: AnswerBody = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(format!(
            "body must be JSON like {{\"approve\": true}} or {{\"approve\": false}}: {e}"
        ))
    })?;
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
    Ok(StatusCode::NO_CONTENT)
}
