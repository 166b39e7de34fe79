//! Files in a kernel's working directory: `GET/PUT/DELETE /api/kernels/{id}/files/{path}`
//! and `GET /api/kernels/{id}/files` (a listing).
//!
//! Every operation runs inside the kernel's own container as the kernel's user (a small
//! script through the backend's `exec`), never on host paths: the container is the
//! boundary, and a symlink the kernel made can only point into its own sandbox. The script
//! still refuses absolute paths, `..` and symlinks leading out of the working directory,
//! so callers get a clear error rather than a surprise.

use super::auth::Caller;
use super::error::ApiError;
use super::kernels::find;
use super::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

const SCRIPT: &str = include_str!("../../assets/files.py");

// Exit codes of the script (see its header).
const NOT_FOUND: i64 = 10;
const BAD_PATH: i64 = 11;
const IS_DIR: i64 = 12;
const NOT_DIR: i64 = 13;
const EXISTS_DIR: i64 = 14;

async fn run(
    state: &AppState,
    caller: &Caller,
    id: &str,
    op: &str,
    path: &str,
    body: Bytes,
) -> Result<Vec<u8>, ApiError> {
    let live = find(state, caller, id)?;
    let event = match op {
        "get" => "file_read",
        "put" => "file_written",
        "delete" => "file_deleted",
        _ => "file_listed",
    };
    state.kernels.audit().record(
        event,
        serde_json::json!({"key": caller.0.name, "kernel": id, "path": path, "bytes": body.len()}),
    );
    if path.chars().any(char::is_control) {
        return Err(ApiError::bad_request(
            "file paths may not contain NUL or other control characters",
        ));
    }
    let argv = ["python3", "-c", SCRIPT, op, path]
        .map(str::to_owned)
        .to_vec();
    let out = state
        .kernels
        .backend()
        .exec(live.handle(), argv, body, state.max_message_bytes)
        .await?;
    let message = out.stderr.trim().to_owned();
    let status = match out.exit_code {
        0 if out.truncated => {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "{path} is larger than the {} MiB download limit",
                    state.max_message_bytes >> 20
                ),
            ))
        }
        0 => return Ok(out.stdout),
        NOT_FOUND => StatusCode::NOT_FOUND,
        BAD_PATH => StatusCode::BAD_REQUEST,
        IS_DIR | NOT_DIR | EXISTS_DIR => StatusCode::CONFLICT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    Err(ApiError::new(
        status,
        format!(
            "{path}: {}",
            if message.is_empty() {
                "file operation failed"
            } else {
                &message
            }
        ),
    ))
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
        run(&state, &caller, &id, "list", "", Bytes::new()).await?,
    ))
}

/// `GET .../files/{path}`: a file's bytes, or a directory's listing.
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, path)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    match run(&state, &caller, &id, "get", &path, Bytes::new()).await {
        Ok(bytes) => {
            Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
        }
        Err(e) if e.status == StatusCode::CONFLICT => Ok(json(
            run(&state, &caller, &id, "list", &path, Bytes::new()).await?,
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
    let entry = run(&state, &caller, &id, "put", &path, body).await?;
    Ok((StatusCode::CREATED, json(entry)).into_response())
}

/// `DELETE .../files/{path}`: a file or an empty directory.
pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path((id, path)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    run(&state, &caller, &id, "delete", &path, Bytes::new()).await?;
    Ok(StatusCode::NO_CONTENT)
}
