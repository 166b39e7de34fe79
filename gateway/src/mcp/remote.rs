//! The kernels of a running gateway, over its HTTP API, for `kernelgate mcp --url`: the
//! kernel REST API, the agent API (streamed as NDJSON, turned back into the run's events)
//! and the files API. The gateway applies its own limits, policy and audit.

use crate::kernels::files::FileError;
use crate::kernels::run::{End, Progress};
use kernelgate_protocol::content::ErrorContent;
use kernelgate_protocol::execution::{Display, Event, Status};
use reqwest::StatusCode;
use serde_json::{json, Map, Value};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;

#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("cannot reach the gateway at {url}: {detail}")]
    Unreachable { url: String, detail: String },
    #[error("the gateway answered {status}: {message}")]
    Refused { status: StatusCode, message: String },
    #[error("cannot read the token file {path} (--token-file): {detail}")]
    TokenFile { path: String, detail: String },
}

/// The token in the file `--token-file` names: its text without the trailing newline.
pub fn read_token_file(path: &std::path::Path) -> Result<String, RemoteError> {
    let failed = |detail: String| RemoteError::TokenFile {
        path: path.display().to_string(),
        detail,
    };
    let text = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
    let token = text.trim_end_matches(['\n', '\r']);
    if token.is_empty() {
        return Err(failed(
            "it is empty; write the gateway's token into it (the one `kernelgate serve` \
             printed, set with --token, or a key of `kernelgate keys add`)"
                .into(),
        ));
    }
    Ok(token.to_owned())
}

/// A gateway's base URL and token.
#[derive(Debug, Clone)]
pub struct Remote {
    http: reqwest::Client,
    url: String,
    token: Option<String>,
}

impl Remote {
    pub fn new(url: &str, token: Option<String>) -> Self {
        Remote {
            http: reqwest::Client::new(),
            url: url.trim_end_matches('/').to_owned(),
            token,
        }
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.url));
        match &self.token {
            Some(t) => r.header("Authorization", format!("token {t}")),
            None => r,
        }
    }

    async fn send(
        &self,
        builder: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, RemoteError> {
        let response = builder.send().await.map_err(|e| RemoteError::Unreachable {
            url: self.url.clone(),
            detail: e.to_string(),
        })?;
        if response.status().is_success() {
            return Ok(response);
        }
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        let message = body
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("no message")
            .to_owned();
        Err(RemoteError::Refused { status, message })
    }

    /// Checks the URL and token once, before the host starts talking.
    pub async fn check(&self) -> Result<(), RemoteError> {
        self.send(self.request(reqwest::Method::GET, "/api/kernels"))
            .await
            .map(drop)
    }

    /// Starts a kernel; its id.
    pub async fn create(&self) -> Result<String, RemoteError> {
        let response = self
            .send(
                self.request(reqwest::Method::POST, "/api/kernels")
                    .json(&json!({})),
            )
            .await?;
        let model: Value = response
            .json()
            .await
            .map_err(|e| RemoteError::Unreachable {
                url: self.url.clone(),
                detail: e.to_string(),
            })?;
        model
            .get("id")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| RemoteError::Refused {
                status: StatusCode::BAD_GATEWAY,
                message: "the kernel model has no id".into(),
            })
    }

    /// Whether the kernel exists (for this token).
    pub async fn exists(&self, id: &str) -> Result<bool, RemoteError> {
        match self
            .send(self.request(reqwest::Method::GET, &format!("/api/kernels/{id}")))
            .await
        {
            Ok(_) => Ok(true),
            Err(RemoteError::Refused { status, .. }) if status == StatusCode::NOT_FOUND => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    pub async fn delete(&self, id: &str) -> Result<(), RemoteError> {
        self.send(self.request(reqwest::Method::DELETE, &format!("/api/kernels/{id}")))
            .await
            .map(drop)
    }

    pub async fn restart(&self, id: &str) -> Result<(), RemoteError> {
        self.send(
            self.request(reqwest::Method::POST, &format!("/api/kernels/{id}/restart"))
                .json(&json!({})),
        )
        .await
        .map(drop)
    }

    /// Runs code through the agent API, streamed. Dropping the receiver drops the HTTP
    /// response, and the gateway interrupts (or unqueues) the run.
    pub fn run(
        &self,
        tracker: &TaskTracker,
        id: &str,
        code: String,
        timeout: Duration,
        agent_id: String,
    ) -> mpsc::Receiver<Progress> {
        let (tx, rx) = mpsc::channel(256);
        let request = self
            .request(reqwest::Method::POST, &format!("/api/kernels/{id}/execute"))
            .header("Accept", "application/x-ndjson")
            .json(&json!({"code": code, "timeout": timeout.as_secs_f64(), "agent_id": agent_id}));
        let me = self.clone();
        tracker.spawn(async move {
            tokio::select! {
                _ = me.stream(request, &tx) => {}
                _ = tx.closed() => {}
            }
        });
        rx
    }

    async fn stream(&self, request: reqwest::RequestBuilder, tx: &mpsc::Sender<Progress>) {
        let failed = |evalue: String| {
            Progress::Event(Event::Error(ErrorContent {
                ename: "GatewayUnavailable".into(),
                evalue,
                traceback: Vec::new(),
                extra: Map::new(),
            }))
        };
        let mut response = match self.send(request).await {
            Ok(r) => r,
            Err(e) => {
                let _ = tx.send(failed(e.to_string())).await;
                return;
            }
        };
        let mut pending = Vec::new();
        loop {
            let chunk = match response.chunk().await {
                Ok(Some(chunk)) => chunk,
                Ok(None) => return,
                Err(e) => {
                    let _ = tx.send(failed(e.to_string())).await;
                    return;
                }
            };
            pending.extend_from_slice(&chunk);
            while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = pending.drain(..=end).collect();
                if let Some(progress) = serde_json::from_slice(&line).ok().and_then(progress_of) {
                    if tx.send(progress).await.is_err() {
                        return;
                    }
                }
            }
        }
    }

    /// The files API: a file's bytes, a listing, or an upload.
    pub async fn file(
        &self,
        id: &str,
        op: crate::kernels::files::FileOp,
        path: &str,
        body: Vec<u8>,
        max_bytes: usize,
    ) -> Result<Vec<u8>, FileError> {
        use crate::kernels::files::FileOp;
        if let Some(reason) = refused_path(path) {
            return Err(FileError::BadPath {
                path: path.to_owned(),
                reason: reason.to_owned(),
            });
        }
        let encoded = encode_path(path);
        let url = if encoded.is_empty() {
            format!("/api/kernels/{id}/files")
        } else {
            format!("/api/kernels/{id}/files/{encoded}")
        };
        let request = match op {
            FileOp::Put => self.request(reqwest::Method::PUT, &url).body(body),
            FileOp::Delete => self.request(reqwest::Method::DELETE, &url),
            FileOp::List | FileOp::Get => self.request(reqwest::Method::GET, &url),
        };
        let owned = path.to_owned();
        let response = self
            .send(request)
            .await
            .map_err(|e| file_error(e, path, max_bytes))?;
        let is_listing = response
            .headers()
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
        if op == FileOp::Get && is_listing {
            return Err(FileError::WrongKind {
                path: owned,
                reason: "is a directory".into(),
            });
        }
        if op == FileOp::List && !is_listing {
            return Err(FileError::WrongKind {
                path: owned,
                reason: "is a file".into(),
            });
        }
        let bytes = response.bytes().await.map_err(|e| FileError::Failed {
            path: owned.clone(),
            reason: e.to_string(),
        })?;
        if bytes.len() > max_bytes {
            return Err(FileError::TooLarge {
                path: owned,
                limit_mib: max_bytes >> 20,
            });
        }
        Ok(bytes.to_vec())
    }

    /// At most `length` bytes of a file from `offset`, and the file's size: the files API
    /// with a `Range` header.
    pub async fn read_part(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        length: usize,
    ) -> Result<(Vec<u8>, u64), FileError> {
        if let Some(reason) = refused_path(path) {
            return Err(FileError::BadPath {
                path: path.to_owned(),
                reason: reason.to_owned(),
            });
        }
        let last = offset.saturating_add(length.max(1) as u64 - 1);
        let request = self
            .request(
                reqwest::Method::GET,
                &format!("/api/kernels/{id}/files/{}", encode_path(path)),
            )
            .header("Range", format!("bytes={offset}-{last}"));
        let failed = |detail: String| FileError::Failed {
            path: path.to_owned(),
            reason: detail,
        };
        let response = request
            .send()
            .await
            .map_err(|e| failed(format!("cannot reach the gateway at {}: {e}", self.url)))?;
        let status = response.status();
        // `bytes FIRST-LAST/SIZE` or `bytes */SIZE`.
        let size = response
            .headers()
            .get("content-range")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.rsplit_once('/'))
            .and_then(|(_, size)| size.parse::<u64>().ok());
        let is_listing = response
            .headers()
            .get("content-type")
            .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
        match status {
            StatusCode::RANGE_NOT_SATISFIABLE => {
                return Ok((Vec::new(), size.unwrap_or(offset)));
            }
            StatusCode::PARTIAL_CONTENT | StatusCode::OK if is_listing => {
                return Err(FileError::WrongKind {
                    path: path.to_owned(),
                    reason: "is a directory".into(),
                });
            }
            StatusCode::PARTIAL_CONTENT | StatusCode::OK => {}
            _ => {
                let body: Value = response.json().await.unwrap_or(Value::Null);
                let message = body
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("no message")
                    .to_owned();
                return Err(file_error(
                    RemoteError::Refused { status, message },
                    path,
                    length,
                ));
            }
        }
        let bytes = response.bytes().await.map_err(|e| failed(e.to_string()))?;
        match (status, size) {
            (StatusCode::PARTIAL_CONTENT, Some(size)) => Ok((bytes.to_vec(), size)),
            // A gateway that ignored the range sent the whole file.
            _ => {
                let size = bytes.len() as u64;
                let from = usize::try_from(offset)
                    .unwrap_or(usize::MAX)
                    .min(bytes.len());
                let to = from.saturating_add(length).min(bytes.len());
                Ok((bytes[from..to].to_vec(), size))
            }
        }
    }
}

/// A refusal of the files API as the file error it stands for.
fn file_error(e: RemoteError, path: &str, max_bytes: usize) -> FileError {
    match e {
        RemoteError::Refused { status, message } => {
            // The gateway's message names the path already; FileError names it again.
            let message = message
                .strip_prefix(&format!("{path}: "))
                .map_or(message.clone(), str::to_owned);
            refused_file(status, message, path.to_owned(), max_bytes)
        }
        other => FileError::Failed {
            path: path.to_owned(),
            reason: other.to_string(),
        },
    }
}

/// A files API refusal as the file error it stands for.
fn refused_file(status: StatusCode, message: String, path: String, max_bytes: usize) -> FileError {
    match status {
        StatusCode::NOT_FOUND => FileError::NotFound {
            path,
            reason: message,
        },
        StatusCode::BAD_REQUEST => FileError::BadPath {
            path,
            reason: message,
        },
        StatusCode::CONFLICT => FileError::WrongKind {
            path,
            reason: message,
        },
        StatusCode::PAYLOAD_TOO_LARGE => FileError::TooLarge {
            path,
            limit_mib: max_bytes >> 20,
        },
        _ => FileError::Failed {
            path,
            reason: message,
        },
    }
}

/// A relative path, percent-encoded for the files API's URL.
fn encode_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for b in path.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// URLs lose `..` segments and leading slashes on the way (normalization), so the gateway
/// could not refuse them: refused here with the gateway's words.
fn refused_path(path: &str) -> Option<&'static str> {
    if path.starts_with('/') {
        return Some("paths must be relative to the working directory");
    }
    path.split('/')
        .any(|part| part == "..")
        .then_some("'..' is not allowed in paths")
}

/// One NDJSON line of the agent API as the run's progress.
fn progress_of(line: Value) -> Option<Progress> {
    let text = |key: &str| {
        line.get(key)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    let object = |key: &str| {
        line.get(key)
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default()
    };
    Some(match line.get("type")?.as_str()? {
        name @ ("stdout" | "stderr") => Progress::Event(Event::Stream {
            name: name.to_owned(),
            text: text("text"),
        }),
        "result" => Progress::Event(Event::Display(Display {
            data: object("data"),
            metadata: object("metadata"),
            is_result: line
                .get("is_main_result")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            ..Display::default()
        })),
        "error" => Progress::Event(Event::Error(ErrorContent {
            ename: text("ename"),
            evalue: text("evalue"),
            traceback: line
                .get("traceback")
                .and_then(Value::as_array)
                .map(|lines| {
                    lines
                        .iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
            extra: Map::new(),
        })),
        "end" => Progress::End(End {
            status: match line.get("status").and_then(Value::as_str) {
                Some("ok") => Status::Ok,
                Some("timeout") => Status::Timeout,
                _ => Status::Error,
            },
            execution_count: line.get("execution_count").and_then(Value::as_i64),
            duration_ms: line.get("duration_ms").and_then(Value::as_u64).unwrap_or(0),
            truncated: line
                .get("truncated")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        }),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_reach_the_gateway_as_given() {
        assert_eq!(encode_path("data/in put.csv"), "data/in%20put.csv");
        assert_eq!(encode_path(""), "");
        assert!(refused_path("../../etc/passwd").is_some());
        assert!(refused_path("/etc/x").is_some());
        assert_eq!(refused_path("a/..b/c"), None);
    }

    #[test]
    fn token_files_lose_their_trailing_newline_and_may_not_be_empty() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let file = dir.path().join("token");
        std::fs::write(&file, "s3cret\n").expect("written");
        assert_eq!(read_token_file(&file).expect("read"), "s3cret");
        std::fs::write(&file, "\r\n").expect("written");
        let empty = read_token_file(&file).expect_err("empty").to_string();
        assert!(empty.contains("it is empty"), "{empty}");
        let missing = read_token_file(&dir.path().join("nope"))
            .expect_err("missing")
            .to_string();
        assert!(
            missing.starts_with(&format!(
                "cannot read the token file {}/nope (--token-file): No such file",
                dir.path().display()
            )),
            "{missing}"
        );
    }

    #[test]
    fn agent_api_lines_become_the_run_events() {
        let lines = [
            json!({"type": "stdout", "text": "hi\n"}),
            json!({"type": "result", "data": {"text/plain": "42"}, "metadata": {}, "is_main_result": true}),
            json!({"type": "error", "ename": "E", "evalue": "v", "traceback": ["t"]}),
            json!({"type": "end", "status": "timeout", "execution_count": 3, "duration_ms": 7, "truncated": true}),
        ];
        let got: Vec<Progress> = lines.into_iter().filter_map(progress_of).collect();
        assert!(
            matches!(&got[0], Progress::Event(Event::Stream { name, text }) if name == "stdout" && text == "hi\n")
        );
        assert!(
            matches!(&got[1], Progress::Event(Event::Display(d)) if d.is_result && d.data["text/plain"] == "42")
        );
        assert!(
            matches!(&got[2], Progress::Event(Event::Error(e)) if e.ename == "E" && e.traceback == ["t"])
        );
        assert!(matches!(
            &got[3],
            Progress::End(End {
                status: Status::Timeout,
                execution_count: Some(3),
                truncated: true,
                ..
            })
        ));
    }
}
