//! Files in a kernel's working directory: `GET/PUT/DELETE /api/kernels/{id}/files/{path}`
//! and `GET /api/kernels/{id}/files` (a listing).
//!
//! The work (inside the kernel's container, traversal-proof) is [`crate::kernels::files`].
//! A file's GET takes a `Range: bytes=FIRST-LAST` header (RFC 9110 §14) to read a part of
//! it: files larger than `--max-message-mb` are read that way.

use super::auth::Caller;
use super::error::{body_refused, ApiError, ErrorBody};
use super::extract::Path;
use super::kernels::{find, KernelPath};
use super::AppState;
use crate::kernels::files::{self, FileError, FileOp};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::IntoParams;

// A file or directory as the script writes it: listings are arrays of these.
use kernelgate_protocol::agent::FileEntry;

/// The `{id}` and `{path}` of a file route.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct FilePath {
    /// The kernel's id.
    id: String,
    /// Relative to the kernel's working directory; may hold `/`. Absolute paths, `..`,
    /// control characters and symlinks leading out are refused (400).
    #[param(example = "data/sales.csv")]
    path: String,
}

async fn operate(
    state: &AppState,
    caller: &Caller,
    id: &str,
    op: FileOp,
    path: &str,
    body: Bytes,
) -> Result<Vec<u8>, ApiError> {
    let live = find(state, caller, id)?;
    if path.chars().any(char::is_control) {
        return Err(ApiError::bad_request(format!(
            "{}: file paths may not contain NUL or other control characters",
            as_written(path)
        )));
    }
    Ok(files::perform(
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

/// A path as it was written in the URL: control characters percent-encoded again.
fn as_written(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for c in path.chars() {
        if c.is_control() {
            let mut buf = [0; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn json(bytes: Vec<u8>) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], bytes).into_response()
}

/// The working directory's listing.
#[utoipa::path(
    get, path = "/api/kernels/{id}/files", tag = "files", operation_id = "list_files",
    params(KernelPath),
    responses(
        (status = 200, description = "The entries of the kernel's working directory", body = [FileEntry]),
        (status = 404, description = "No such kernel", body = ErrorBody),
        (status = 413, description = "The listing is larger than `--max-message-mb`", body = ErrorBody),
        (status = 500, description = "The operation failed inside the container in a way it does not foresee (the message carries its error output)", body = ErrorBody),
        (status = 503, description = "Docker could not run the operation in the kernel's container", body = ErrorBody),
    ),
)]
pub async fn list_root(
    State(state): State<AppState>,
    caller: Caller,
    Path(KernelPath { id }): Path<KernelPath>,
) -> Result<Response, ApiError> {
    Ok(json(
        operate(&state, &caller, &id, FileOp::List, "", Bytes::new()).await?,
    ))
}

/// A file's bytes, or a directory's listing.
///
/// With `Range: bytes=FIRST-LAST` (or `bytes=FIRST-`), only those bytes of a file: 206 with
/// `Content-Range: bytes FIRST-END/SIZE`, at most `--max-message-mb` of them (END says where
/// they stop). Other range forms are ignored (200, the whole file).
#[utoipa::path(
    get, path = "/api/kernels/{id}/files/{*path}", tag = "files", operation_id = "get_file",
    params(FilePath, ("Range" = Option<String>, Header, description = "`bytes=FIRST-LAST` or `bytes=FIRST-`: read only that part of a file", example = "bytes=0-65535")),
    responses(
        (status = 200, description = "A file's bytes (`application/octet-stream`), or a directory's entries (`application/json`)",
         content(("application/octet-stream"), ([FileEntry] = "application/json"))),
        (status = 206, description = "The part of the file a `Range` header asked for, with `Content-Range: bytes FIRST-END/SIZE`",
         content(("application/octet-stream"))),
        (status = 416, description = "The `Range` starts at or past the end of the file (`Content-Range: bytes */SIZE` gives its size)", body = ErrorBody),
        (status = 400, description = "The path is absolute, holds `..` or control characters, or leads out through a symlink", body = ErrorBody),
        (status = 403, description = "The kernel's user may not read it", body = ErrorBody),
        (status = 404, description = "No such kernel, or no such file", body = ErrorBody),
        (status = 409, description = "A part of the path is a file, not a directory", body = ErrorBody),
        (status = 413, description = "The file is larger than `--max-message-mb`", body = ErrorBody),
        (status = 500, description = "The operation failed inside the container in a way it does not foresee (the message carries its error output)", body = ErrorBody),
        (status = 503, description = "Docker could not run the operation in the kernel's container", body = ErrorBody),
    ),
)]
pub async fn get(
    State(state): State<AppState>,
    caller: Caller,
    Path(FilePath { id, path }): Path<FilePath>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    if let Some((first, count)) = byte_range(&headers) {
        let live = find(&state, &caller, &id)?;
        let most = state.max_message_bytes;
        let length = count.map_or(most, |n| usize::try_from(n).unwrap_or(most).min(most));
        let part = files::read_part(&state.kernels, &live, &caller.0.name, &path, first, length);
        return match part.await {
            Ok((_, size)) if first >= size => {
                let message = format!("{path} has {size} bytes: a range must start below that");
                let mut response =
                    ApiError::new(StatusCode::RANGE_NOT_SATISFIABLE, message).into_response();
                if let Ok(value) = format!("bytes */{size}").parse() {
                    response.headers_mut().insert(header::CONTENT_RANGE, value);
                }
                Ok(response)
            }
            Ok((bytes, size)) => {
                let last = first + bytes.len().max(1) as u64 - 1;
                Ok((
                    StatusCode::PARTIAL_CONTENT,
                    [
                        (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
                        (
                            header::CONTENT_RANGE,
                            format!("bytes {first}-{last}/{size}"),
                        ),
                    ],
                    bytes,
                )
                    .into_response())
            }
            Err(FileError::WrongKind { .. }) => Ok(json(
                operate(&state, &caller, &id, FileOp::List, &path, Bytes::new()).await?,
            )),
            Err(e) => Err(e.into()),
        };
    }
    match operate(&state, &caller, &id, FileOp::Get, &path, Bytes::new()).await {
        Ok(bytes) => {
            Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
        }
        Err(e) if e.status == StatusCode::CONFLICT => Ok(json(
            operate(&state, &caller, &id, FileOp::List, &path, Bytes::new()).await?,
        )),
        Err(e) => Err(e),
    }
}

/// A `Range: bytes=FIRST-LAST` or `bytes=FIRST-` header: the first byte and, with LAST, how
/// many bytes. Other forms (suffixes, several ranges) are `None`, and ignored.
fn byte_range(headers: &HeaderMap) -> Option<(u64, Option<u64>)> {
    let spec = headers.get(header::RANGE)?.to_str().ok()?.trim();
    let (first, last) = spec.strip_prefix("bytes=")?.split_once('-')?;
    let first: u64 = first.trim().parse().ok()?;
    match last.trim() {
        "" => Some((first, None)),
        last => {
            let last: u64 = last.parse().ok()?;
            (last >= first).then(|| (first, Some(last - first + 1)))
        }
    }
}

/// Uploads the body as the file, creating parent directories; replaces a file of that name.
#[utoipa::path(
    put, path = "/api/kernels/{id}/files/{*path}", tag = "files", operation_id = "put_file",
    params(FilePath),
    request_body(content(("application/octet-stream")), description = "The file's bytes"),
    responses(
        (status = 201, description = "Written", body = FileEntry),
        (status = 400, description = "The path is absolute, holds `..` or control characters, names the working directory, or leads out through a symlink", body = ErrorBody),
        (status = 403, description = "The kernel's user may not write there", body = ErrorBody),
        (status = 404, description = "No such kernel", body = ErrorBody),
        (status = 409, description = "A directory has that name, or a part of the path is a file", body = ErrorBody),
        (status = 500, description = "The operation failed inside the container in a way it does not foresee (the message carries its error output)", body = ErrorBody),
        (status = 503, description = "Docker could not run the operation in the kernel's container", body = ErrorBody),
        (status = 507, description = "The kernel's working directory (`--kernel-disk-mb`) is full", body = ErrorBody),
    ),
)]
pub async fn put(
    State(state): State<AppState>,
    caller: Caller,
    Path(FilePath { id, path }): Path<FilePath>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = match body {
        Ok(body) => body,
        Err(e) => return Ok(body_refused(e, state.max_message_bytes)),
    };
    let entry = operate(&state, &caller, &id, FileOp::Put, &path, body).await?;
    Ok((StatusCode::CREATED, json(entry)).into_response())
}

/// Deletes a file or an empty directory.
#[utoipa::path(
    delete, path = "/api/kernels/{id}/files/{*path}", tag = "files", operation_id = "delete_file",
    params(FilePath),
    responses(
        (status = 204, description = "Deleted"),
        (status = 400, description = "The path is absolute, holds `..` or control characters, names the working directory, or leads out through a symlink", body = ErrorBody),
        (status = 403, description = "The kernel's user may not delete it", body = ErrorBody),
        (status = 404, description = "No such kernel, or no such file", body = ErrorBody),
        (status = 409, description = "The directory is not empty", body = ErrorBody),
        (status = 500, description = "The operation failed inside the container in a way it does not foresee (the message carries its error output)", body = ErrorBody),
        (status = 503, description = "Docker could not run the operation in the kernel's container", body = ErrorBody),
    ),
)]
pub async fn delete(
    State(state): State<AppState>,
    caller: Caller,
    Path(FilePath { id, path }): Path<FilePath>,
) -> Result<StatusCode, ApiError> {
    operate(&state, &caller, &id, FileOp::Delete, &path, Bytes::new()).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    #[test]
    fn paths_are_shown_as_written_in_the_url() {
        assert_eq!(super::as_written("a\0b\n.csv"), "a%00b%0A.csv");
        assert_eq!(super::as_written("data/é x.csv"), "data/é x.csv");
    }
}
