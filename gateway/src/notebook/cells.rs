//! Running the cells through a gateway, as an ordinary client: a kernel created with the
//! REST API, one `execute_request` per code cell on the channels WebSocket (legacy JSON
//! encoding), each followed to its end by an [`Execution`].

use super::model::{code_cells, has_tag, source_text, Outputs};
use super::{Report, RunError};
use crate::config::RunArgs;
use futures::{SinkExt, StreamExt};
use kernelgate_protocol::execution::{Event, Interruption, Phase, Status};
use kernelgate_protocol::websocket::{self, Encoding, Frame};
use kernelgate_protocol::{Channel, Execution, Message};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message as WsMessage;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use tokio_util::sync::CancellationToken;

/// How long a new kernel may take to answer `kernel_info_request`.
const KERNEL_READY_TIMEOUT: Duration = Duration::from_secs(90);
/// After a cell's `execute_reply`, how long its final IOPub `idle` may lag (nbclient: 4 s).
const IOPUB_GRACE: Duration = Duration::from_secs(10);
/// After interrupting a cell that ran past `--timeout`, how long to wait for its reply.
const INTERRUPT_GRACE: Duration = Duration::from_secs(30);

/// Creates a kernel, runs every code cell in order, deletes the kernel.
pub(crate) async fn execute_notebook(
    endpoint: &Endpoint,
    kernel_name: &str,
    nb: &mut Value,
    args: &RunArgs,
    stop: &CancellationToken,
) -> Result<Report, RunError> {
    let kernel_id = tokio::select! {
        id = endpoint.create_kernel(kernel_name) => id?,
        _ = stop.cancelled() => return Err(RunError::Interrupted),
    };
    eprintln!(
        "kernelgate run: kernel {} ({kernel_name}) created",
        short(&kernel_id)
    );
    let result = tokio::select! {
        r = async {
            let mut channels = Channels::connect(endpoint, &kernel_id).await?;
            let info = channels.kernel_info().await?;
            if let Some(language_info) = info.get("language_info") {
                nb["metadata"]["language_info"] = language_info.clone();
            }
            run_cells(&mut channels, endpoint, &kernel_id, nb, args).await
        } => r,
        _ = stop.cancelled() => Err(RunError::Interrupted),
    };
    if let Err(e) = endpoint.delete_kernel(&kernel_id).await {
        eprintln!(
            "kernelgate run: could not delete kernel {}: {e}",
            short(&kernel_id)
        );
    }
    result
}

async fn run_cells(
    channels: &mut Channels,
    endpoint: &Endpoint,
    kernel_id: &str,
    nb: &mut Value,
    args: &RunArgs,
) -> Result<Report, RunError> {
    let indices = code_cells(nb);
    let total = indices.len();
    let Some(cells) = nb["cells"].as_array_mut() else {
        return Ok(Report::default());
    };
    let mut outputs = Outputs::default();
    let mut report = Report::default();
    for (k, &i) in indices.iter().enumerate() {
        let code = source_text(cells[i].get("source")).unwrap_or_default();
        let label = format!("[{}/{total}] cell {}", k + 1, i + 1);
        // nbclient skips blank cells: they have no execution count.
        if code.trim().is_empty() {
            continue;
        }
        let allows_error = args.allow_errors || has_tag(&cells[i], "raises-exception");
        let started = Instant::now();
        let execution = channels
            .execute(
                &code,
                !allows_error,
                (args.timeout > 0).then(|| Duration::from_secs(args.timeout)),
                endpoint,
                kernel_id,
                cells,
                i,
                &mut outputs,
            )
            .await
            .map_err(|e| match e {
                RunError::KernelDied(why, _) => RunError::KernelDied(why, i + 1),
                e => e,
            })?;
        report.cells_run += 1;
        let took = started.elapsed().as_secs_f64();
        let reply = execution.reply();
        if let Some(n) = reply.and_then(|r| r.execution_count) {
            cells[i]["execution_count"] = json!(n);
        }
        let status = execution.status();
        if status != Status::Ok {
            let (ename, evalue) = match (status, reply) {
                (Status::Timeout, _) => (
                    "TimeoutError".to_owned(),
                    format!(
                        "the cell ran longer than {} s and was interrupted",
                        args.timeout
                    ),
                ),
                (_, Some(r)) => (r.ename.clone(), r.evalue.clone()),
                (_, None) => ("NoReply".to_owned(), "the kernel sent no reply".to_owned()),
            };
            eprintln!(
                "{label} {} ... error after {took:.1} s: {ename}: {evalue}",
                preview(&code)
            );
            report.errors += 1;
            if !allows_error {
                report.failed = Some(RunError::CellFailed {
                    cell: i + 1,
                    ename,
                    evalue,
                });
                break;
            }
        } else {
            eprintln!("{label} {} ... ok ({took:.1} s)", preview(&code));
        }
    }
    Ok(report)
}

/// The first line of a cell's code, shortened, for progress lines.
fn preview(code: &str) -> String {
    let line = code
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    let mut s: String = line.chars().take(48).collect();
    if line.chars().count() > 48 {
        s.push('…');
    }
    s
}

fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

/// Where the gateway is and how to authenticate to it.
#[derive(Debug, Clone)]
pub(crate) struct Endpoint {
    /// `http://host:port` (with any base path), no trailing slash.
    pub base: String,
    pub token: Option<String>,
    pub http: reqwest::Client,
}

impl Endpoint {
    /// Accepts the URL `kernelgate serve` prints, `http://127.0.0.1:8888/?token=T`, too.
    pub fn parse(url: &str, token: Option<&str>) -> Result<Endpoint, RunError> {
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let base = base.trim_end_matches('/');
        let host = base
            .strip_prefix("http://")
            .or_else(|| base.strip_prefix("https://"))
            .ok_or_else(|| RunError::BadUrl(url.to_owned()))?;
        if host.is_empty() {
            return Err(RunError::BadUrl(url.to_owned()));
        }
        let from_query = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("token="))
            .map(str::to_owned);
        Ok(Endpoint {
            base: base.to_owned(),
            token: token.map(str::to_owned).or(from_query),
            http: reqwest::Client::new(),
        })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => r.header("Authorization", format!("token {t}")),
            None => r,
        }
    }

    async fn send(
        &self,
        action: &'static str,
        r: reqwest::RequestBuilder,
    ) -> Result<Value, RunError> {
        let resp = r.send().await.map_err(|source| RunError::Unreachable {
            url: self.base.clone(),
            source,
        })?;
        let status = resp.status();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            let message = body["message"]
                .as_str()
                .or(body["reason"].as_str())
                .unwrap_or("no details")
                .to_owned();
            return Err(RunError::Refused {
                action,
                status: status.as_u16(),
                message,
            });
        }
        Ok(body)
    }

    async fn create_kernel(&self, name: &str) -> Result<String, RunError> {
        let r = self
            .request(reqwest::Method::POST, "/api/kernels")
            .json(&json!({"name": name}));
        let body = self.send("create a kernel", r).await?;
        body["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| RunError::Refused {
                action: "create a kernel",
                status: 201,
                message: format!("the answer has no kernel id: {body}"),
            })
    }

    async fn delete_kernel(&self, id: &str) -> Result<(), RunError> {
        let r = self.request(reqwest::Method::DELETE, &format!("/api/kernels/{id}"));
        self.send("delete the kernel", r).await.map(|_| ())
    }

    async fn interrupt(&self, id: &str) -> Result<(), RunError> {
        let r = self.request(
            reqwest::Method::POST,
            &format!("/api/kernels/{id}/interrupt"),
        );
        self.send("interrupt the kernel", r).await.map(|_| ())
    }
}

/// One session on a kernel's channels WebSocket, legacy JSON encoding.
#[derive(Debug)]
struct Channels {
    ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    session: String,
}

impl Channels {
    async fn connect(endpoint: &Endpoint, kernel_id: &str) -> Result<Channels, RunError> {
        let session = uuid::Uuid::new_v4().to_string();
        let ws_base = if let Some(rest) = endpoint.base.strip_prefix("https://") {
            format!("wss://{rest}")
        } else {
            format!("ws://{}", endpoint.base.trim_start_matches("http://"))
        };
        let url = format!("{ws_base}/api/kernels/{kernel_id}/channels?session_id={session}");
        let ws_err = |e: &dyn std::fmt::Display| RunError::WebSocket(format!("{url}: {e}"));
        let mut req = url.as_str().into_client_request().map_err(|e| ws_err(&e))?;
        if let Some(t) = &endpoint.token {
            let value = format!("token {t}").parse().map_err(|e| ws_err(&e))?;
            req.headers_mut().insert("Authorization", value);
        }
        let (ws, _) = tokio_tungstenite::connect_async(req)
            .await
            .map_err(|e| ws_err(&e))?;
        Ok(Channels { ws, session })
    }

    async fn send(&mut self, msg_type: &str, content: Value) -> Result<String, RunError> {
        let msg_id = uuid::Uuid::new_v4().to_string();
        let date = crate::time::now_iso();
        let frame = json!({
            "header": {
                "msg_id": msg_id, "msg_type": msg_type, "session": self.session,
                "username": "kernelgate-run", "date": date, "version": "5.3",
            },
            "parent_header": {}, "metadata": {}, "content": content,
            "buffers": [], "channel": "shell",
        });
        self.ws
            .send(WsMessage::Text(frame.to_string().into()))
            .await
            .map_err(|e| RunError::WebSocket(e.to_string()))?;
        Ok(msg_id)
    }

    /// The next message, or `None` at the deadline.
    async fn recv_until(
        &mut self,
        deadline: tokio::time::Instant,
    ) -> Result<Option<(Channel, Message)>, RunError> {
        loop {
            let frame = match tokio::time::timeout_at(deadline, self.ws.next()).await {
                Err(_) => return Ok(None),
                Ok(None) => return Err(RunError::WebSocket("the gateway closed it".into())),
                Ok(Some(Err(e))) => return Err(RunError::WebSocket(e.to_string())),
                Ok(Some(Ok(frame))) => frame,
            };
            let frame = match frame {
                WsMessage::Text(t) => Frame::Text(t.as_str().to_owned()),
                WsMessage::Binary(b) => Frame::Binary(b),
                WsMessage::Close(_) => {
                    return Err(RunError::WebSocket("the gateway closed it".into()))
                }
                // Pings are answered by tungstenite.
                _ => continue,
            };
            return websocket::decode(Encoding::Legacy, &frame)
                .map(Some)
                .map_err(|e| RunError::WebSocket(format!("a message cannot be read: {e}")));
        }
    }

    /// `kernel_info_request`, answered once the kernel is up; returns the reply content.
    async fn kernel_info(&mut self) -> Result<Value, RunError> {
        let id = self.send("kernel_info_request", json!({})).await?;
        let mut info = Execution::new(&id);
        let deadline = tokio::time::Instant::now() + KERNEL_READY_TIMEOUT;
        loop {
            let Some((channel, m)) = self.recv_until(deadline).await? else {
                return Err(RunError::KernelNotReady(KERNEL_READY_TIMEOUT));
            };
            if let Some(Event::Reply(reply)) = info.feed(channel, &m) {
                return Ok(reply.content.parse().unwrap_or(Value::Null));
            }
        }
    }

    /// Runs one cell: sends `execute_request`, turns its IOPub messages into outputs of
    /// `cells[cell]` and returns once both its `execute_reply` and the `idle` status came.
    /// Past `timeout` the kernel is interrupted; the cell then counts as failed.
    #[allow(clippy::too_many_arguments)]
    async fn execute(
        &mut self,
        code: &str,
        stop_on_error: bool,
        timeout: Option<Duration>,
        endpoint: &Endpoint,
        kernel_id: &str,
        cells: &mut [Value],
        cell: usize,
        outputs: &mut Outputs,
    ) -> Result<Execution, RunError> {
        let id = self
            .send(
                "execute_request",
                json!({
                    "code": code, "silent": false, "store_history": true,
                    "user_expressions": {}, "allow_stdin": false, "stop_on_error": stop_on_error,
                }),
            )
            .await?;
        let mut execution = Execution::new(&id);
        // nbclient's record_timing: when the kernel got busy, saw the input, replied, idled.
        cells[cell]["metadata"]["execution"] = json!({});
        let far = tokio::time::Instant::now() + Duration::from_secs(365 * 24 * 3600);
        let mut deadline = timeout.map_or(far, |t| tokio::time::Instant::now() + t);
        while !execution.is_done() {
            let Some((channel, m)) = self.recv_until(deadline).await? else {
                if execution.phase() == Phase::AwaitingIdle {
                    // The reply came but IOPub's idle did not: keep what arrived.
                    break;
                }
                if execution.interruption().is_some() {
                    return Err(RunError::KernelDied(
                        "no answer after an interrupt".into(),
                        cell + 1,
                    ));
                }
                execution.interrupted(Interruption::Timeout);
                endpoint.interrupt(kernel_id).await?;
                deadline = tokio::time::Instant::now() + INTERRUPT_GRACE;
                continue;
            };
            let Some(event) = execution.feed(channel, &m) else {
                continue;
            };
            let date = json!(m.header.date);
            let timing = &mut cells[cell]["metadata"]["execution"];
            match &event {
                Event::KernelLost(state) => {
                    return Err(RunError::KernelDied(state.as_str().to_owned(), cell + 1))
                }
                Event::Reply(_) => {
                    timing["shell.execute_reply"] = date;
                    if execution.phase() == Phase::AwaitingIdle {
                        deadline = tokio::time::Instant::now() + IOPUB_GRACE;
                    }
                }
                Event::Busy => timing["iopub.status.busy"] = date,
                Event::Idle => timing["iopub.status.idle"] = date,
                Event::Input { execution_count } => {
                    timing["iopub.execute_input"] = date;
                    if let Some(n) = execution_count {
                        cells[cell]["execution_count"] = json!(n);
                    }
                }
                event => outputs.apply(cells, cell, event),
            }
        }
        Ok(execution)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_with_the_printed_token_work() {
        let e = Endpoint::parse("http://127.0.0.1:8888/?token=abc", None).expect("url");
        assert_eq!(e.base, "http://127.0.0.1:8888");
        assert_eq!(e.token.as_deref(), Some("abc"));
        let e = Endpoint::parse("http://h:1/", Some("t")).expect("url");
        assert_eq!(e.token.as_deref(), Some("t"));
        assert!(Endpoint::parse("127.0.0.1:8888", None).is_err());
    }
}
