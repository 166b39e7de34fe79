//! A gateway's HTTP API: the base URL and token, the kernels REST API, the agent API's
//! execute (one JSON answer, or NDJSON lines as they come) and the files API.

use kernelgate_protocol::agent::{
    encode_path, refused_path, ExecuteBody, ExecuteResult, FileOp, Line, Progress, Refusal,
};
use kernelgate_protocol::content::ErrorContent;
use kernelgate_protocol::execution::Event;
use kernelgate_protocol::rest::{
    CreateKernel, CreateSnapshot, ForkKernel, Forks, Installed, KernelModel, SnapshotModel,
    SnapshotPage,
};
use reqwest::{Method, RequestBuilder, Response, StatusCode};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;

/// Why a call to the gateway failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid URL {0:?}: give the gateway's base URL, like http://127.0.0.1:8888")]
    BadUrl(String),
    #[error("cannot reach the gateway at {url}: {source}")]
    Unreachable { url: String, source: reqwest::Error },
    #[error("the gateway answered {status}: {}", .body.message.as_deref().unwrap_or("no message"))]
    Refused { status: StatusCode, body: Refusal },
    #[error("the answer has no kernel id: {0}")]
    NoKernelId(Value),
    #[error("the answer is not a list of kernel models: {0}")]
    NotAKernelList(Value),
    #[error("the answer is not an install's report (installed, already, refused): {0}")]
    NotAnInstall(Value),
    /// The answer is not the model the route gives (a snapshot, a page, a fork's).
    #[error("the answer is not {what}: {answer}")]
    Unexpected { what: &'static str, answer: Value },
    /// Refused here, before the request: the gateway would not see the path as given.
    #[error("{path}: {reason}")]
    BadPath { path: String, reason: &'static str },
    /// A directory where a file was wanted, or the other way round.
    #[error("{path}: {reason}")]
    WrongKind { path: String, reason: &'static str },
    /// The answer broke off or is not what it says it is.
    #[error("{0}")]
    Read(reqwest::Error),
}

impl Error {
    /// The HTTP status of a refusal.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Error::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// `answer` as the type a route gives, or [`Error::Unexpected`].
fn typed<T: serde::de::DeserializeOwned>(answer: Value, what: &'static str) -> Result<T, Error> {
    serde_json::from_value(answer.clone()).map_err(|_| Error::Unexpected { what, answer })
}

/// A gateway's base URL and token.
#[derive(Debug, Clone)]
pub struct Gateway {
    /// `http://host:port` (with any base path), no trailing slash.
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Gateway {
    /// The gateway at `base` (`http://host:port`), authenticating with `token`.
    pub fn new(base: &str, token: Option<String>) -> Gateway {
        Gateway {
            base: base.trim_end_matches('/').to_owned(),
            token,
            http: reqwest::Client::new(),
        }
    }

    /// Accepts the URL `kernelgate serve` prints, `http://127.0.0.1:8888/?token=T`, too;
    /// `token`, when given, wins over the URL's.
    pub fn parse(url: &str, token: Option<&str>) -> Result<Gateway, Error> {
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let base = base.trim_end_matches('/');
        let host = base
            .strip_prefix("http://")
            .or_else(|| base.strip_prefix("https://"))
            .ok_or_else(|| Error::BadUrl(url.to_owned()))?;
        if host.is_empty() {
            return Err(Error::BadUrl(url.to_owned()));
        }
        let from_query = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("token="))
            .map(str::to_owned);
        Ok(Gateway::new(base, token.map(str::to_owned).or(from_query)))
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// The same gateway through another HTTP client (its own timeouts, Nagle off, ...).
    pub fn with_http(self, http: reqwest::Client) -> Gateway {
        Gateway { http, ..self }
    }

    /// The same gateway with another token (or none).
    pub fn with_token(&self, token: Option<&str>) -> Gateway {
        Gateway {
            token: token.map(str::to_owned),
            ..self.clone()
        }
    }

    /// `path` (from `/`) on this gateway.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The channels WebSocket's URL base: `ws://host:port` (`wss://` for https).
    pub fn ws_base(&self) -> String {
        match self.base.strip_prefix("https://") {
            Some(rest) => format!("wss://{rest}"),
            None => format!("ws://{}", self.base.trim_start_matches("http://")),
        }
    }

    /// A request with the token in the `Authorization` header.
    pub fn request(&self, method: Method, path: &str) -> RequestBuilder {
        let r = self.http.request(method, self.url(path));
        match &self.token {
            Some(t) => r.header("Authorization", format!("token {t}")),
            None => r,
        }
    }

    /// Sends a request; an answer that is not a success is an [`Error::Refused`] with what
    /// its body says.
    pub async fn send(&self, request: RequestBuilder) -> Result<Response, Error> {
        let response = self.send_any(request).await?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let body = response.json().await.unwrap_or_default();
        Err(Error::Refused { status, body })
    }

    /// Sends a request; any answer is returned as it is.
    pub async fn send_any(&self, request: RequestBuilder) -> Result<Response, Error> {
        request.send().await.map_err(|source| Error::Unreachable {
            url: self.base.clone(),
            source,
        })
    }

    /// Sends a request and reads its JSON answer (`null` for an empty one).
    async fn json(&self, request: RequestBuilder) -> Result<Value, Error> {
        let response = self.send(request).await?;
        Ok(response.json().await.unwrap_or(Value::Null))
    }

    /// `GET /api/kernels`: the kernels this token sees.
    pub async fn kernels(&self) -> Result<Vec<KernelModel>, Error> {
        let list = self.json(self.request(Method::GET, "/api/kernels")).await?;
        serde_json::from_value(list.clone()).map_err(|_| Error::NotAKernelList(list))
    }

    /// Starts a kernel (of the kernel spec `name`, or the default); its id.
    pub async fn create_kernel(&self, name: Option<&str>) -> Result<String, Error> {
        self.create_with(&CreateKernel {
            name: name.map(str::to_owned),
            ..CreateKernel::default()
        })
        .await
    }

    /// `POST /api/kernels` with `body`; the new kernel's id.
    pub async fn create_with(&self, body: &CreateKernel) -> Result<String, Error> {
        let model = self
            .json(self.request(Method::POST, "/api/kernels").json(body))
            .await?;
        match serde_json::from_value::<KernelModel>(model.clone()) {
            Ok(kernel) => Ok(kernel.id),
            Err(_) => Err(Error::NoKernelId(model)),
        }
    }

    /// Whether the kernel exists (for this token).
    pub async fn kernel_exists(&self, id: &str) -> Result<bool, Error> {
        match self
            .send(self.request(Method::GET, &format!("/api/kernels/{id}")))
            .await
        {
            Ok(_) => Ok(true),
            Err(Error::Refused { status, .. }) if status == StatusCode::NOT_FOUND => Ok(false),
            Err(e) => Err(e),
        }
    }

    pub async fn delete_kernel(&self, id: &str) -> Result<(), Error> {
        self.send(self.request(Method::DELETE, &format!("/api/kernels/{id}")))
            .await
            .map(drop)
    }

    pub async fn restart_kernel(&self, id: &str) -> Result<(), Error> {
        let r = self.request(Method::POST, &format!("/api/kernels/{id}/restart"));
        self.send(r.json(&json!({}))).await.map(drop)
    }

    pub async fn interrupt_kernel(&self, id: &str) -> Result<(), Error> {
        let r = self.request(Method::POST, &format!("/api/kernels/{id}/interrupt"));
        self.send(r).await.map(drop)
    }

    /// Starts a kernel with the state of a snapshot (its id, or its name among this key's);
    /// the new kernel's id.
    pub async fn create_from_snapshot(&self, snapshot: &str) -> Result<String, Error> {
        self.create_with(&CreateKernel {
            snapshot: Some(snapshot.to_owned()),
            ..CreateKernel::default()
        })
        .await
    }

    /// Takes a snapshot of the kernel, which runs on.
    pub async fn snapshot(&self, id: &str, body: &CreateSnapshot) -> Result<SnapshotModel, Error> {
        let r = self.request(Method::POST, &format!("/api/kernels/{id}/snapshots"));
        let answer = self.json(r.json(body)).await?;
        typed(answer, "a snapshot's model")
    }

    /// Forks the kernel into `count` kernels: one result per fork.
    pub async fn fork(&self, id: &str, count: usize) -> Result<Forks, Error> {
        let r = self.request(Method::POST, &format!("/api/kernels/{id}/fork"));
        let body = ForkKernel {
            count,
            accept_loss: false,
        };
        let answer = self.json(r.json(&body)).await?;
        typed(answer, "a fork's answer")
    }

    /// A page of this key's snapshots, newest first (`next` from the previous page).
    pub async fn snapshots(&self, next: Option<&str>) -> Result<SnapshotPage, Error> {
        let mut r = self.request(Method::GET, "/api/kernelgate/snapshots");
        if let Some(next) = next {
            r = r.query(&[("next", next)]);
        }
        typed(self.json(r).await?, "a page of snapshots")
    }

    pub async fn delete_snapshot(&self, id: &str) -> Result<(), Error> {
        let path = format!("/api/kernelgate/snapshots/{id}");
        self.send(self.request(Method::DELETE, &path))
            .await
            .map(drop)
    }

    /// Installs packages from the gateway's allowlist into the kernel: the gateway's
    /// answer (`installed`, `already`), or [`Error::Refused`] saying why none was.
    pub async fn install_packages(
        &self,
        id: &str,
        packages: &[String],
    ) -> Result<Installed, Error> {
        let r = self.request(Method::POST, &format!("/api/kernels/{id}/packages"));
        let answer = self.json(r.json(&json!({ "packages": packages }))).await?;
        serde_json::from_value(answer.clone()).map_err(|_| Error::NotAnInstall(answer))
    }

    /// The agent API: runs code and waits for the whole answer.
    pub async fn execute(&self, id: &str, body: &ExecuteBody) -> Result<ExecuteResult, Error> {
        let r = self.request(Method::POST, &format!("/api/kernels/{id}/execute"));
        self.send(r.json(body))
            .await?
            .json()
            .await
            .map_err(Error::Read)
    }

    /// The agent API, streamed: the NDJSON lines as they come.
    pub async fn execute_lines(&self, id: &str, body: &ExecuteBody) -> Result<Lines, Error> {
        let r = self
            .request(Method::POST, &format!("/api/kernels/{id}/execute"))
            .header("Accept", "application/x-ndjson")
            .json(body);
        Ok(Lines::new(self.send(r).await?))
    }

    /// The agent API, streamed, as the run's progress on a channel. A gateway that cannot be
    /// reached or breaks off the answer is an `error` event named `GatewayUnavailable`.
    /// Dropping the receiver drops the HTTP response, and the gateway interrupts (or
    /// unqueues) the run.
    pub fn execute_stream(
        &self,
        tracker: &TaskTracker,
        id: &str,
        body: ExecuteBody,
    ) -> mpsc::Receiver<Progress> {
        let (tx, rx) = mpsc::channel(256);
        let me = self.clone();
        let id = id.to_owned();
        tracker.spawn(async move {
            tokio::select! {
                _ = me.stream(&id, &body, &tx) => {}
                _ = tx.closed() => {}
            }
        });
        rx
    }

    async fn stream(&self, id: &str, body: &ExecuteBody, tx: &mpsc::Sender<Progress>) {
        let failed = |evalue: String| {
            Progress::Event(Event::Error(ErrorContent {
                ename: "GatewayUnavailable".into(),
                evalue,
                traceback: Vec::new(),
                extra: Map::new(),
            }))
        };
        let mut lines = match self.execute_lines(id, body).await {
            Ok(lines) => lines,
            Err(e) => {
                let _ = tx.send(failed(e.to_string())).await;
                return;
            }
        };
        loop {
            match lines.next().await {
                Ok(Some(line)) => {
                    if tx.send(line.into_progress()).await.is_err() {
                        return;
                    }
                }
                Ok(None) => return,
                Err(e) => {
                    let _ = tx.send(failed(e.to_string())).await;
                    return;
                }
            }
        }
    }

    /// The files API route of `path` in the kernel's working directory.
    fn file_route(id: &str, path: &str) -> Result<String, Error> {
        if let Some(reason) = refused_path(path) {
            return Err(Error::BadPath {
                path: path.to_owned(),
                reason,
            });
        }
        let encoded = encode_path(path);
        Ok(if encoded.is_empty() {
            format!("/api/kernels/{id}/files")
        } else {
            format!("/api/kernels/{id}/files/{encoded}")
        })
    }

    /// The files API: a file's bytes, a listing (JSON), an upload's new entry (JSON), or
    /// nothing for a deletion.
    pub async fn file(
        &self,
        id: &str,
        op: FileOp,
        path: &str,
        body: Vec<u8>,
    ) -> Result<Vec<u8>, Error> {
        let route = Self::file_route(id, path)?;
        let request = match op {
            FileOp::Put => self.request(Method::PUT, &route).body(body),
            FileOp::Delete => self.request(Method::DELETE, &route),
            FileOp::List | FileOp::Get => self.request(Method::GET, &route),
        };
        let response = self.send(request).await?;
        let is_listing = is_json(&response);
        let wrong = |reason| {
            Err(Error::WrongKind {
                path: path.to_owned(),
                reason,
            })
        };
        if op == FileOp::Get && is_listing {
            return wrong("is a directory");
        }
        if op == FileOp::List && !is_listing {
            return wrong("is a file");
        }
        Ok(response.bytes().await.map_err(Error::Read)?.to_vec())
    }

    /// At most `length` bytes of a file from `offset`, and the file's size: the files API
    /// with a `Range` header.
    pub async fn read_part(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        length: usize,
    ) -> Result<(Vec<u8>, u64), Error> {
        let route = Self::file_route(id, path)?;
        let last = offset.saturating_add(length.max(1) as u64 - 1);
        let request = self
            .request(Method::GET, &route)
            .header("Range", format!("bytes={offset}-{last}"));
        let response = self.send_any(request).await?;
        let status = response.status();
        // `bytes FIRST-LAST/SIZE` or `bytes */SIZE`.
        let size = response
            .headers()
            .get("content-range")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.rsplit_once('/'))
            .and_then(|(_, size)| size.parse::<u64>().ok());
        match status {
            StatusCode::RANGE_NOT_SATISFIABLE => return Ok((Vec::new(), size.unwrap_or(offset))),
            StatusCode::PARTIAL_CONTENT | StatusCode::OK if is_json(&response) => {
                return Err(Error::WrongKind {
                    path: path.to_owned(),
                    reason: "is a directory",
                });
            }
            StatusCode::PARTIAL_CONTENT | StatusCode::OK => {}
            _ => {
                let body = response.json().await.unwrap_or_default();
                return Err(Error::Refused { status, body });
            }
        }
        let bytes = response.bytes().await.map_err(Error::Read)?;
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

fn is_json(response: &Response) -> bool {
    response
        .headers()
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"))
}

/// The NDJSON lines of a streamed run, read as they come. Lines of a kind this client does
/// not know are skipped.
#[derive(Debug)]
pub struct Lines {
    response: Response,
    pending: Pending,
}

impl Lines {
    pub fn new(response: Response) -> Lines {
        Lines {
            response,
            pending: Pending::default(),
        }
    }

    /// The next line; `None` once the answer ends.
    pub async fn next(&mut self) -> Result<Option<Line>, reqwest::Error> {
        loop {
            if let Some(line) = self.pending.next_line() {
                return Ok(Some(line));
            }
            match self.response.chunk().await? {
                Some(chunk) => self.pending.push(&chunk),
                None => return Ok(None),
            }
        }
    }
}

/// Bytes received and not yet read as lines: chunks end anywhere, lines at `\n`.
#[derive(Debug, Default)]
struct Pending(Vec<u8>);

impl Pending {
    fn push(&mut self, chunk: &[u8]) {
        self.0.extend_from_slice(chunk);
    }

    /// The next complete line that is one of ours.
    fn next_line(&mut self) -> Option<Line> {
        while let Some(end) = self.0.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.0.drain(..=end).collect();
            if let Some(line) = Line::parse(&line) {
                return Some(line);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_with_the_printed_token_work() {
        let g = Gateway::parse("http://127.0.0.1:8888/?token=abc", None).expect("url");
        assert_eq!(g.base(), "http://127.0.0.1:8888");
        assert_eq!(g.token(), Some("abc"));
        let g = Gateway::parse("http://h:1/", Some("t")).expect("url");
        assert_eq!(g.token(), Some("t"));
        assert_eq!(g.ws_base(), "ws://h:1");
        assert!(Gateway::parse("127.0.0.1:8888", None).is_err());
    }

    #[test]
    fn lines_split_anywhere_come_out_whole_and_unknown_kinds_are_skipped() {
        let mut pending = Pending::default();
        pending.push(br#"{"type":"stdout","te"#);
        assert_eq!(pending.next_line(), None);
        pending.push(b"xt\":\"a\"}\n{\"type\":\"progress\"}\n{\"type\":\"stderr\",\"text\":\"b\"}");
        assert_eq!(pending.next_line(), Some(Line::Stdout { text: "a".into() }));
        assert_eq!(pending.next_line(), None);
        pending.push(b"\n");
        assert_eq!(pending.next_line(), Some(Line::Stderr { text: "b".into() }));
    }
}
