//! envd (port 49983): `GET /health`, `GET`/`POST /files` (download, upload as
//! octet-stream or multipart) and the `filesystem.Filesystem` Connect RPC with the JSON
//! codec: `Stat`, `ListDir`, `MakeDir`, `Move`, `Remove` (and the watchers of
//! [`super::watch`]).
//!
//! Every operation goes through the traversal-proof files layer
//! ([`crate::kernels::files`]), inside the kernel's container as its user: `/home/user/...`
//! paths (and relative ones) are the kernel's working directory, anything else absolute is
//! refused. The layer knows list, get, put and delete; the rest is made of those (a stat
//! lists the parent, a directory is made by writing and removing a marker file in it, a
//! move of a file is a copy and a delete, a remove of a directory removes its entries
//! first).

use super::super::error::ApiError;
use super::super::AppState;
use super::connect::{self, ConnectError, RpcPath};
use super::plane::SandboxCall;
use crate::kernels::files::{self, FileError, FileOp};
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, SecondsFormat};
use kernelgate_protocol::agent::FileEntry;
use kernelgate_protocol::e2b::{absolute_path, relative_path};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;

/// How deep `ListDir` goes at most, whatever the depth asked.
const MAX_DEPTH: u32 = 8;
/// The marker file `MakeDir` writes and removes.
const MARKER: &str = ".kernelgate-make-dir";

/// `GET /health`: the sandbox answers.
pub async fn health(_call: SandboxCall) -> StatusCode {
    StatusCode::NO_CONTENT
}

/// A files-layer refusal, as the files API words it (status and message).
fn refused(e: FileError) -> ApiError {
    ApiError::from(e)
}

fn only_the_kernels_user(username: Option<&str>) -> Result<(), ApiError> {
    match username {
        None | Some("") | Some("user") => Ok(()),
        Some(other) => Err(ApiError::bad_request(format!(
            "user {other:?} is refused: everything in a sandbox runs as its kernel's user \
             (the SDK's default, \"user\")"
        ))),
    }
}

fn mapped(path: &str) -> Result<String, ApiError> {
    relative_path(path).map_err(|e| ApiError::bad_request(e.to_string()))
}

async fn op(
    state: &AppState,
    call: &SandboxCall,
    op: FileOp,
    rel: &str,
    body: Bytes,
) -> Result<Vec<u8>, FileError> {
    files::perform(
        &state.kernels,
        &call.live,
        &call.key,
        op,
        rel,
        body,
        state.max_message_bytes,
    )
    .await
}

#[derive(Debug, Deserialize)]
pub struct FileQuery {
    path: Option<String>,
    username: Option<String>,
}

/// `GET /files?path=`: a file's bytes.
pub async fn download(
    State(state): State<AppState>,
    call: SandboxCall,
    Query(query): Query<FileQuery>,
) -> Result<Response, ApiError> {
    only_the_kernels_user(query.username.as_deref())?;
    let path = query
        .path
        .ok_or_else(|| ApiError::bad_request("the path query parameter is missing"))?;
    let rel = mapped(&path)?;
    let bytes = op(&state, &call, FileOp::Get, &rel, Bytes::new())
        .await
        .map_err(refused)?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
}

/// `POST /files`: one file as the body (`application/octet-stream`, `?path=`), or several
/// as `multipart/form-data` parts named `file` whose file name is the path.
pub async fn upload(
    State(state): State<AppState>,
    call: SandboxCall,
    Query(query): Query<FileQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Vec<Value>>, ApiError> {
    only_the_kernels_user(query.username.as_deref())?;
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let uploads: Vec<(String, Bytes)> = match boundary(content_type) {
        Some(boundary) => multipart_files(&body, &boundary)
            .ok_or_else(|| ApiError::bad_request("the multipart body could not be read"))?
            .into_iter()
            .map(|(name, data)| {
                (
                    query
                        .path
                        .clone()
                        .filter(|_| name.is_empty())
                        .unwrap_or(name),
                    data,
                )
            })
            .collect(),
        None => {
            let path = query
                .path
                .clone()
                .ok_or_else(|| ApiError::bad_request("the path query parameter is missing"))?;
            vec![(path, body)]
        }
    };
    let mut written = Vec::with_capacity(uploads.len());
    for (path, data) in uploads {
        let rel = mapped(&path)?;
        op(&state, &call, FileOp::Put, &rel, data)
            .await
            .map_err(refused)?;
        written.push(json!({
            "name": rel.rsplit('/').next().unwrap_or_default(),
            "type": "file",
            "path": absolute_path(&rel),
        }));
    }
    Ok(Json(written))
}

/// The boundary of a `multipart/form-data` content type.
fn boundary(content_type: &str) -> Option<String> {
    let (kind, params) = content_type.split_once(';')?;
    if !kind.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    params.split(';').find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        k.eq_ignore_ascii_case("boundary")
            .then(|| v.trim_matches('"').to_owned())
    })
}

/// The parts of a multipart body (RFC 7578) as (file name, bytes); `None` when malformed.
fn multipart_files(body: &[u8], boundary: &str) -> Option<Vec<(String, Bytes)>> {
    let delimiter = format!("--{boundary}");
    let mut parts = Vec::new();
    let mut rest = &body[find(body, delimiter.as_bytes())? + delimiter.len()..];
    loop {
        if rest.starts_with(b"--") {
            return Some(parts);
        }
        rest = rest.strip_prefix(b"\r\n")?;
        let head_end = find(rest, b"\r\n\r\n")?;
        let head = String::from_utf8_lossy(&rest[..head_end]).into_owned();
        let content = &rest[head_end + 4..];
        let closing = format!("\r\n{delimiter}");
        let end = find(content, closing.as_bytes())?;
        let name = head
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("content-disposition"))
            .and_then(|l| disposition_param(l, "filename"))
            .unwrap_or_default();
        parts.push((name, Bytes::copy_from_slice(&content[..end])));
        rest = &content[end + closing.len()..];
    }
}

fn disposition_param(line: &str, name: &str) -> Option<String> {
    line.split(';').find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        (k.trim() == name).then(|| v.trim().trim_matches('"').replace("\\\"", "\""))
    })
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// An entry as `filesystem.EntryInfo` in protobuf's JSON mapping.
fn entry_info(entry: &FileEntry) -> Value {
    let kind = match entry.kind.as_str() {
        "directory" => "FILE_TYPE_DIRECTORY",
        "file" => "FILE_TYPE_FILE",
        _ => "FILE_TYPE_UNSPECIFIED",
    };
    let modified = DateTime::from_timestamp(
        entry.modified.trunc() as i64,
        (entry.modified.fract() * 1e9) as u32,
    )
    .unwrap_or_default()
    .to_rfc3339_opts(SecondsFormat::Nanos, true);
    json!({
        "name": entry.name,
        "type": kind,
        "path": absolute_path(&entry.path),
        // int64 is a string in protobuf's JSON mapping.
        "size": entry.size.to_string(),
        "owner": "user",
        "group": "user",
        "modifiedTime": modified,
    })
}

fn home_entry() -> Value {
    json!({"name": "user", "type": "FILE_TYPE_DIRECTORY", "path": absolute_path(""),
           "size": "0", "owner": "user", "group": "user"})
}

async fn list(
    state: &AppState,
    call: &SandboxCall,
    rel: &str,
) -> Result<Vec<FileEntry>, ConnectError> {
    let bytes = op(state, call, FileOp::List, rel, Bytes::new()).await?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ConnectError::new("internal", format!("the files layer's listing: {e}")))
}

/// The entry at `rel`, found in its parent's listing.
async fn stat(state: &AppState, call: &SandboxCall, rel: &str) -> Result<Value, ConnectError> {
    if rel.is_empty() {
        return Ok(home_entry());
    }
    let (parent, name) = rel.rsplit_once('/').unwrap_or(("", rel));
    let not_found = || {
        ConnectError::new(
            "not_found",
            format!("{}: no such file or directory", absolute_path(rel)),
        )
    };
    let entries = match list(state, call, parent).await {
        Err(e) if e.code == "not_found" || e.code == "failed_precondition" => {
            return Err(not_found())
        }
        other => other?,
    };
    entries
        .iter()
        .find(|e| e.name == name)
        .map(entry_info)
        .ok_or_else(not_found)
}

/// `POST /filesystem.Filesystem/{method}`: a unary Connect call with the JSON codec.
pub async fn filesystem(
    State(state): State<AppState>,
    call: SandboxCall,
    Path(path): Path<RpcPath>,
    body: Bytes,
) -> Result<Json<Value>, ConnectError> {
    let request: HashMap<String, Value> = serde_json::from_value(connect::unary(&body)?)
        .map_err(|_| ConnectError::new("invalid_argument", "the request is not a JSON object"))?;
    let text = |name: &str| -> Result<String, ConnectError> {
        let value = request
            .get(name)
            .and_then(Value::as_str)
            .unwrap_or_default();
        Ok(mapped(value)?)
    };
    let answer = match path.method.as_str() {
        "Stat" => json!({"entry": stat(&state, &call, &text("path")?).await?}),
        "ListDir" => {
            let depth = request
                .get("depth")
                .and_then(|d| d.as_u64().or_else(|| d.as_str()?.parse().ok()))
                .unwrap_or(1)
                .clamp(1, u64::from(MAX_DEPTH)) as u32;
            let rel = text("path")?;
            let mut entries = Vec::new();
            let mut pending = vec![(rel, 1)];
            while let Some((dir, level)) = pending.pop() {
                for entry in list(&state, &call, &dir).await? {
                    if entry.kind == "directory" && level < depth {
                        pending.push((entry.path.clone(), level + 1));
                    }
                    entries.push(entry_info(&entry));
                }
            }
            json!({"entries": entries})
        }
        "MakeDir" => {
            let rel = text("path")?;
            if stat(&state, &call, &rel).await.is_ok() {
                return Err(ConnectError::new(
                    "already_exists",
                    format!("{}: already exists", absolute_path(&rel)),
                ));
            }
            let marker = format!("{rel}/{MARKER}");
            op(&state, &call, FileOp::Put, &marker, Bytes::new()).await?;
            op(&state, &call, FileOp::Delete, &marker, Bytes::new()).await?;
            json!({"entry": stat(&state, &call, &rel).await?})
        }
        "Move" => {
            let (from, to) = (text("source")?, text("destination")?);
            let entry = stat(&state, &call, &from).await?;
            if entry["type"] != "FILE_TYPE_FILE" {
                return Err(ConnectError::new(
                    "failed_precondition",
                    format!(
                        "{}: only files can be renamed (a directory is moved by writing its \
                         files anew)",
                        absolute_path(&from)
                    ),
                ));
            }
            let bytes = op(&state, &call, FileOp::Get, &from, Bytes::new()).await?;
            op(&state, &call, FileOp::Put, &to, Bytes::from(bytes)).await?;
            op(&state, &call, FileOp::Delete, &from, Bytes::new()).await?;
            json!({"entry": stat(&state, &call, &to).await?})
        }
        "Remove" => {
            remove(&state, &call, &text("path")?).await?;
            json!({})
        }
        "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher" => {
            super::watch::polled(&state, &call, &path.method, &request).await?
        }
        other => {
            return Err(ConnectError::new(
                "unimplemented",
                format!("filesystem.Filesystem/{other} is not offered"),
            ))
        }
    };
    Ok(Json(answer))
}

/// Removes a file, or a directory with everything in it.
async fn remove(state: &AppState, call: &SandboxCall, rel: &str) -> Result<(), ConnectError> {
    if rel.is_empty() {
        return Err(ConnectError::new(
            "invalid_argument",
            "the home itself cannot be removed",
        ));
    }
    // Depth first, the directories after their entries.
    let mut pending = vec![(rel.to_owned(), false)];
    while let Some((path, expanded)) = pending.pop() {
        match op(state, call, FileOp::Delete, &path, Bytes::new()).await {
            Ok(_) => {}
            Err(FileError::WrongKind { .. }) if !expanded => {
                pending.push((path.clone(), true));
                for entry in list(state, call, &path).await? {
                    pending.push((entry.path, false));
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multipart_bodies_give_each_file_with_its_name() {
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/home/user/a.txt\"\r\nContent-Type: application/octet-stream\r\n\r\nhello\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b/c.bin\"\r\n\r\n\x00\r\n\x01\r\n--XyZ--\r\n";
        let content_type = "multipart/form-data; boundary=XyZ";
        let boundary = boundary(content_type).unwrap_or_default();
        assert_eq!(boundary, "XyZ");
        let parts = multipart_files(body, &boundary).unwrap_or_default();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].0, "/home/user/a.txt");
        assert_eq!(&parts[0].1[..], b"hello");
        assert_eq!(parts[1].0, "b/c.bin");
        assert_eq!(&parts[1].1[..], b"\x00\r\n\x01");
        assert!(multipart_files(b"--XyZ\r\nbroken", "XyZ").is_none());
        assert_eq!(super::boundary("application/octet-stream"), None);
    }

    #[test]
    fn entries_follow_protobufs_json_mapping() {
        let entry = FileEntry {
            name: "a.txt".into(),
            path: "d/a.txt".into(),
            kind: "file".into(),
            size: 5,
            modified: 1_700_000_000.5,
        };
        let info = entry_info(&entry);
        assert_eq!(info["type"], "FILE_TYPE_FILE");
        assert_eq!(info["path"], "/home/user/d/a.txt");
        assert_eq!(info["size"], "5");
        assert_eq!(info["modifiedTime"], "2023-11-14T22:13:20.500000000Z");
    }
}
