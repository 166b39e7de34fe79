//! Files in a kernel's working directory: `GET/PUT/DELETE /api/kernels/{id}/files/{path}`
//! and `GET /api/kernels/{id}/files` (a listing).
//!
//! The work (inside the kernel's container, traversal-proof) is [`crate::kernels::files`].

use super::auth::Caller;
use super::error::ApiError;
use super::kernels::find;
use super::AppState;
use crate::kernels::files::{self, FileOp};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

async fn run(
    state: &AppState,
    caller: &Caller,
    id: &str,
    op: FileOp,
    path: &str,
    body: Bytes,
) -> Result<Vec<u8>, ApiError> {
    let live = find(state, caller, id)?;
    Ok(files::run(
        &state.kernels,
        &live,
        &caller.0.name,
        op,
        path,
        body,
        state.max_message_bytes,
    )
    .await?)
}

fn json(bytes: Vec<u8>) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], bytes).into_response()
}

/// `GET .../files`: the working directory's listing.
pub async fn list_root(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(json(
        run(&state, &caller, &id, FileOp::List, "", Bytes::new()).await?,
    ))
}

/// `GET .../files/{path}`: a file's bytes, or a directory's listing.
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    match run(&state, &caller, &id, FileOp::Get, &path, Bytes::new()).await {
        Ok(bytes) => {
            Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
        }
        Err(e) if e.status == StatusCode::CONFLICT => Ok(json(
            run(&state, &caller, &id, FileOp::List, &path, Bytes::new()).await?,
        )),
        Err(e) => Err(e),
    }
}

/// `PUT .../files/{path}`: uploads the body, creating parent directories.
pub async fn put(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, path)): Path<(String, String)>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = match body {
        Ok(body) => body,
        Err(e) => {
            let error = ApiError::new(
                e.status(),
                format!(
                    "upload refused: {} (the limit is {} MiB)",
                    e.body_text(),
                    state.max_message_bytes >> 20
                ),
            );
            // The rest of the body is not read: the connection cannot be reused, and saying
            // so keeps clients from sending their next request on it.
            return Ok(([(header::CONNECTION, "close")], error).into_response());
        }
    };
    let entry = run(&state, &caller, &id, FileOp::Put, &path, body).await?;
    Ok((StatusCode::CREATED, json(entry)).into_response())
}

/// `DELETE .../files/{path}`: a file or an empty directory.
pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, path)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    run(&state, &caller, &id, FileOp::Delete, &path, Bytes::new()).await?;
    Ok(StatusCode::NO_CONTENT)
}
