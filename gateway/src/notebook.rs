//! `kernelgate run NOTEBOOK.ipynb`: executes a notebook through a gateway, the way nbclient
//! does through a local kernel, and writes it back with its outputs as nbformat 4.
//!
//! The runner is an ordinary client of the gateway: it creates a kernel with the REST API,
//! speaks the channels WebSocket (legacy JSON encoding), sends one `execute_request` per
//! code cell and turns the IOPub messages of that request into nbformat outputs
//! (<https://nbformat.readthedocs.io/en/latest/format_description.html#code-cell-outputs>).
//! Without `--url` it starts a gateway of its own (this same binary, `serve`) on a free
//! loopback port and stops it afterwards.
//!
//! The notebook stays a `serde_json::Value` throughout, so fields this module does not know
//! (cell ids, metadata of other tools, attachments) are written back untouched.

use crate::config::RunArgs;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Map, Value};
use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
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
/// How long a local gateway may take to listen.
const GATEWAY_START_TIMEOUT: Duration = Duration::from_secs(60);

/// Why `kernelgate run` failed. The messages are meant for the person who ran it.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    NotJson {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path} is not an nbformat 4 notebook: {reason}")]
    NotNotebook { path: PathBuf, reason: String },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid --url {0:?}: give the gateway's base URL, like http://127.0.0.1:8888")]
    BadUrl(String),
    #[error("cannot start a local gateway: {0}")]
    LocalGateway(String),
    #[error("cannot reach the gateway at {url}: {source}")]
    Unreachable { url: String, source: reqwest::Error },
    #[error("the gateway refused to {action}: HTTP {status}: {message}")]
    Refused {
        action: &'static str,
        status: u16,
        message: String,
    },
    #[error("channels WebSocket: {0}")]
    WebSocket(String),
    #[error("the kernel did not answer within {0:?}")]
    KernelNotReady(Duration),
    #[error("the kernel died ({0}) while running cell {1}")]
    KernelDied(String, usize),
    #[error("cell {cell} failed: {ename}: {evalue}")]
    CellFailed {
        cell: usize,
        ename: String,
        evalue: String,
    },
    #[error("stopped by a signal")]
    Interrupted,
}

/// Runs `kernelgate run`. The executed notebook is written even when a cell fails, so the
/// error can be read in context; the returned error then makes the process exit non-zero.
pub async fn run(args: RunArgs) -> Result<(), RunError> {
    let bytes = std::fs::read(&args.notebook).map_err(|source| RunError::Read {
        path: args.notebook.clone(),
        source,
    })?;
    let mut nb = parse(&args.notebook, &bytes)?;
    let output = args
        .output
        .clone()
        .unwrap_or_else(|| default_output(&args.notebook));
    let kernel_name = args
        .kernel_name
        .clone()
        .or_else(|| {
            nb["metadata"]["kernelspec"]["name"]
                .as_str()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "python3".to_owned());

    // Ctrl-C or SIGTERM: stop at the next await, but still delete the kernel and stop the
    // local gateway (it is in its own process group, so the signal does not reach it).
    let stop = CancellationToken::new();
    let on_signal = stop.clone();
    let watcher = tokio::spawn(async move {
        stop_signal().await;
        on_signal.cancel();
    });
    let result = run_with(&args, &mut nb, &kernel_name, &stop).await;
    watcher.abort();
    let executed = result?;
    write(&output, &nb)?;
    eprintln!(
        "kernelgate run: wrote {} ({} cells run, {} with errors, {:.1} s)",
        output.display(),
        executed.cells_run,
        executed.errors,
        executed.took.as_secs_f64()
    );
    match executed.failed {
        Some(failure) => Err(failure),
        None => Ok(()),
    }
}

/// Finds or starts the gateway and runs the notebook on it. An error here means there is
/// nothing worth writing (no kernel, a dead kernel, a signal).
async fn run_with(
    args: &RunArgs,
    nb: &mut Value,
    kernel_name: &str,
    stop: &CancellationToken,
) -> Result<Report, RunError> {
    let (local, endpoint) = match &args.url {
        Some(url) => (None, Endpoint::parse(url, args.token.as_deref())?),
        None => {
            let local = tokio::select! {
                local = LocalGateway::start(&args.image) => local?,
                _ = stop.cancelled() => return Err(RunError::Interrupted),
            };
            let endpoint = local.endpoint();
            (Some(local), endpoint)
        }
    };
    eprintln!(
        "kernelgate run: {} ({} code cells) on {}",
        args.notebook.display(),
        code_cells(nb).len(),
        endpoint.base
    );

    let started = Instant::now();
    let outcome = execute_notebook(&endpoint, kernel_name, nb, args, stop).await;
    if let Some(local) = local {
        local.stop().await;
    }
    outcome.map(|report| Report {
        took: started.elapsed(),
        ..report
    })
}

/// `analysis.ipynb` -> `analysis.executed.ipynb`, next to it.
fn default_output(input: &Path) -> PathBuf {
    let stem = input
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "notebook".to_owned());
    input.with_file_name(format!("{stem}.executed.ipynb"))
}

// ---------------------------------------------------------------------------------------
// The notebook file
// ---------------------------------------------------------------------------------------

/// Parses and checks a notebook: nbformat 4, a list of well-formed cells. Old outputs of
/// code cells are cleared here, so what is written later is only this run's.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<Value, RunError> {
    let not_notebook = |reason: String| RunError::NotNotebook {
        path: path.to_owned(),
        reason,
    };
    let mut nb: Value = serde_json::from_slice(bytes).map_err(|source| RunError::NotJson {
        path: path.to_owned(),
        source,
    })?;
    let Some(top) = nb.as_object_mut() else {
        return Err(not_notebook("the top level is not a JSON object".into()));
    };
    match top.get("nbformat").and_then(Value::as_i64) {
        Some(4) => {}
        Some(v) => {
            return Err(not_notebook(format!(
                "it is nbformat {v}; convert it with `jupyter nbconvert --to notebook`"
            )))
        }
        None => return Err(not_notebook("it has no \"nbformat\" number".into())),
    }
    let minor = top
        .get("nbformat_minor")
        .and_then(Value::as_i64)
        .ok_or_else(|| not_notebook("it has no \"nbformat_minor\" number".into()))?;
    if !top.get("metadata").is_some_and(Value::is_object) {
        return Err(not_notebook("it has no \"metadata\" object".into()));
    }
    let Some(cells) = top.get_mut("cells").and_then(Value::as_array_mut) else {
        return Err(not_notebook("it has no \"cells\" list".into()));
    };
    for (i, cell) in cells.iter_mut().enumerate() {
        let n = i + 1;
        let Some(cell) = cell.as_object_mut() else {
            return Err(not_notebook(format!("cell {n} is not an object")));
        };
        let kind = cell
            .get("cell_type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        if !matches!(kind.as_str(), "code" | "markdown" | "raw") {
            return Err(not_notebook(format!(
                "cell {n} has cell_type {:?}; expected code, markdown or raw",
                cell.get("cell_type").unwrap_or(&Value::Null)
            )));
        }
        if source_text(cell.get("source")).is_none() {
            return Err(not_notebook(format!(
                "cell {n} has no \"source\" string or list of strings"
            )));
        }
        if !cell.get("metadata").is_some_and(Value::is_object) {
            cell.insert("metadata".into(), json!({}));
        }
        // nbformat 4.5 made cell ids mandatory; nbformat itself fills in missing ones.
        if minor >= 5 && !cell.get("id").is_some_and(Value::is_string) {
            cell.insert(
                "id".into(),
                json!(uuid::Uuid::new_v4().simple().to_string()),
            );
        }
        if kind == "code" {
            cell.insert("outputs".into(), json!([]));
            cell.insert("execution_count".into(), Value::Null);
        }
    }
    Ok(nb)
}

/// A cell's source: nbformat allows one string or a list of lines.
fn source_text(source: Option<&Value>) -> Option<String> {
    match source? {
        Value::String(s) => Some(s.clone()),
        Value::Array(lines) => lines
            .iter()
            .map(|l| l.as_str())
            .collect::<Option<Vec<_>>>()
            .map(|l| l.concat()),
        _ => None,
    }
}

/// Indices of the code cells.
fn code_cells(nb: &Value) -> Vec<usize> {
    nb["cells"]
        .as_array()
        .map(|cells| {
            cells
                .iter()
                .enumerate()
                .filter(|(_, c)| c["cell_type"] == "code")
                .map(|(i, _)| i)
                .collect()
        })
        .unwrap_or_default()
}

/// The notebook as nbformat writes it: keys sorted, one-space indent, text split into
/// lines, a final newline. Diffs against files saved by Jupyter then stay small.
pub fn to_file_text(nb: &Value) -> String {
    let mut nb = nb.clone();
    split_lines(&mut nb);
    let nb = sorted(nb);
    let mut out = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(b" ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    // Serializing a Value into a Vec cannot fail.
    let _ = serde::Serialize::serialize(&nb, &mut ser);
    let mut text = String::from_utf8_lossy(&out).into_owned();
    text.push('\n');
    text
}

fn write(path: &Path, nb: &Value) -> Result<(), RunError> {
    let err = |source| RunError::Write {
        path: path.to_owned(),
        source,
    };
    // Write next to the target and rename, so a failed run never leaves half a notebook.
    let tmp = path.with_file_name(format!(
        ".{}.kernelgate-tmp",
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    ));
    std::fs::write(&tmp, to_file_text(nb)).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        err(e)
    })
}

fn sorted(v: Value) -> Value {
    match v {
        Value::Object(map) => {
            let mut entries: Vec<(String, Value)> = map.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        Value::Array(items) => Value::Array(items.into_iter().map(sorted).collect()),
        other => other,
    }
}

/// nbformat's `split_lines`: sources, stream text and textual mime data as line lists.
fn split_lines(nb: &mut Value) {
    fn lines(v: &mut Value) {
        if let Value::String(s) = v {
            *v = Value::Array(
                s.split_inclusive('\n')
                    .map(|l| Value::String(l.to_owned()))
                    .collect(),
            );
        }
    }
    fn bundle(data: &mut Value) {
        if let Some(data) = data.as_object_mut() {
            for (mime, value) in data.iter_mut() {
                if mime.starts_with("text/")
                    || mime == "application/javascript"
                    || mime == "image/svg+xml"
                {
                    lines(value);
                }
            }
        }
    }
    let Some(cells) = nb["cells"].as_array_mut() else {
        return;
    };
    for cell in cells {
        lines(&mut cell["source"]);
        if let Some(attachments) = cell.get_mut("attachments").and_then(Value::as_object_mut) {
            attachments.values_mut().for_each(bundle);
        }
        if let Some(outputs) = cell.get_mut("outputs").and_then(Value::as_array_mut) {
            for out in outputs {
                match out["output_type"].as_str() {
                    Some("execute_result" | "display_data") => bundle(&mut out["data"]),
                    Some("stream") => lines(&mut out["text"]),
                    _ => {}
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// From IOPub messages to nbformat outputs
// ---------------------------------------------------------------------------------------

/// What the outputs of the notebook so far need to remember between messages: where each
/// display id was shown (`update_display_data` changes every copy, in any cell) and whether
/// a `clear_output(wait=True)` is pending.
#[derive(Debug, Default)]
pub struct Outputs {
    displays: HashMap<String, Vec<(usize, usize)>>,
    clear_pending: bool,
}

impl Outputs {
    /// Applies one IOPub message of the request running `cells[cell]`, like nbclient's
    /// `process_message`; messages that are not outputs are ignored.
    pub fn apply(&mut self, cells: &mut [Value], cell: usize, msg_type: &str, content: &Value) {
        let display_id = content["transient"]["display_id"]
            .as_str()
            .map(str::to_owned);
        if let Some(id) = &display_id {
            if matches!(
                msg_type,
                "execute_result" | "display_data" | "update_display_data"
            ) {
                self.update_display(cells, id, content);
            }
        }
        let output = match msg_type {
            "stream" => json!({
                "output_type": "stream",
                "name": content["name"].as_str().unwrap_or("stdout"),
                "text": content["text"].as_str().unwrap_or(""),
            }),
            "display_data" => json!({
                "output_type": "display_data",
                "data": object_or_empty(&content["data"]),
                "metadata": object_or_empty(&content["metadata"]),
            }),
            "execute_result" => json!({
                "output_type": "execute_result",
                "execution_count": content["execution_count"].as_i64(),
                "data": object_or_empty(&content["data"]),
                "metadata": object_or_empty(&content["metadata"]),
            }),
            "error" => json!({
                "output_type": "error",
                "ename": content["ename"].as_str().unwrap_or(""),
                "evalue": content["evalue"].as_str().unwrap_or(""),
                "traceback": content["traceback"].as_array().cloned().unwrap_or_default()
                    .into_iter().filter(Value::is_string).collect::<Vec<_>>(),
            }),
            "clear_output" => {
                if content["wait"].as_bool().unwrap_or(false) {
                    self.clear_pending = true;
                } else {
                    self.clear(cells, cell);
                }
                return;
            }
            _ => return,
        };
        if self.clear_pending {
            self.clear(cells, cell);
        }
        let Some(outs) = cells
            .get_mut(cell)
            .and_then(|c| c.get_mut("outputs"))
            .and_then(Value::as_array_mut)
        else {
            return;
        };
        // Consecutive stream messages of one name are one output, as Jupyter saves them.
        if output["output_type"] == "stream" {
            if let Some(last) = outs.last_mut() {
                if last["output_type"] == "stream" && last["name"] == output["name"] {
                    let mut text = last["text"].as_str().unwrap_or("").to_owned();
                    text.push_str(output["text"].as_str().unwrap_or(""));
                    last["text"] = Value::String(text);
                    return;
                }
            }
        }
        if let Some(id) = display_id {
            self.displays
                .entry(id)
                .or_default()
                .push((cell, outs.len()));
        }
        outs.push(output);
    }

    fn clear(&mut self, cells: &mut [Value], cell: usize) {
        if let Some(outs) = cells
            .get_mut(cell)
            .and_then(|c| c.get_mut("outputs"))
            .and_then(Value::as_array_mut)
        {
            outs.clear();
        }
        for places in self.displays.values_mut() {
            places.retain(|(c, _)| *c != cell);
        }
        self.clear_pending = false;
    }

    fn update_display(&self, cells: &mut [Value], id: &str, content: &Value) {
        for &(cell, index) in self.displays.get(id).into_iter().flatten() {
            if let Some(out) = cells
                .get_mut(cell)
                .and_then(|c| c.get_mut("outputs"))
                .and_then(|o| o.get_mut(index))
            {
                out["data"] = object_or_empty(&content["data"]);
                out["metadata"] = object_or_empty(&content["metadata"]);
            }
        }
    }
}

fn object_or_empty(v: &Value) -> Value {
    match v {
        Value::Object(_) => v.clone(),
        _ => Value::Object(Map::new()),
    }
}

// ---------------------------------------------------------------------------------------
// Running the cells
// ---------------------------------------------------------------------------------------

/// What a run did, for the summary and the exit status.
#[derive(Debug, Default)]
struct Report {
    cells_run: usize,
    /// Cells whose error was allowed (`--allow-errors`, a `raises-exception` tag) count too.
    errors: usize,
    /// The failure that stopped the run.
    failed: Option<RunError>,
    took: Duration,
}

/// Creates a kernel, runs every code cell in order, deletes the kernel.
async fn execute_notebook(
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
        let reply = channels
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
        if let Some(n) = reply.execution_count {
            cells[i]["execution_count"] = json!(n);
        }
        if reply.status == "error" || reply.timed_out {
            let (ename, evalue) = if reply.timed_out {
                (
                    "TimeoutError".to_owned(),
                    format!(
                        "the cell ran longer than {} s and was interrupted",
                        args.timeout
                    ),
                )
            } else {
                (reply.ename, reply.evalue)
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

fn has_tag(cell: &Value, tag: &str) -> bool {
    cell["metadata"]["tags"]
        .as_array()
        .is_some_and(|tags| tags.iter().any(|t| t == tag))
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

/// The end of one `execute_request`.
#[derive(Debug, Default)]
struct Reply {
    status: String,
    execution_count: Option<i64>,
    ename: String,
    evalue: String,
    timed_out: bool,
}

// ---------------------------------------------------------------------------------------
// The gateway's REST API
// ---------------------------------------------------------------------------------------

/// Where the gateway is and how to authenticate to it.
#[derive(Debug, Clone)]
struct Endpoint {
    /// `http://host:port` (with any base path), no trailing slash.
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Endpoint {
    /// Accepts the URL `kernelgate serve` prints, `http://127.0.0.1:8888/?token=T`, too.
    fn parse(url: &str, token: Option<&str>) -> Result<Endpoint, RunError> {
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

// ---------------------------------------------------------------------------------------
// The channels WebSocket
// ---------------------------------------------------------------------------------------

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
        let date = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
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
    ) -> Result<Option<Value>, RunError> {
        loop {
            let frame = match tokio::time::timeout_at(deadline, self.ws.next()).await {
                Err(_) => return Ok(None),
                Ok(None) => return Err(RunError::WebSocket("the gateway closed it".into())),
                Ok(Some(Err(e))) => return Err(RunError::WebSocket(e.to_string())),
                Ok(Some(Ok(frame))) => frame,
            };
            match frame {
                WsMessage::Text(t) => match serde_json::from_str::<Value>(t.as_str()) {
                    Ok(v) => return Ok(Some(v)),
                    Err(e) => return Err(RunError::WebSocket(format!("a frame is not JSON: {e}"))),
                },
                WsMessage::Close(_) => {
                    return Err(RunError::WebSocket("the gateway closed it".into()))
                }
                // The legacy encoding is text only; pings are answered by tungstenite.
                _ => {}
            }
        }
    }

    /// `kernel_info_request`, answered once the kernel is up; returns the reply content.
    async fn kernel_info(&mut self) -> Result<Value, RunError> {
        let id = self.send("kernel_info_request", json!({})).await?;
        let deadline = tokio::time::Instant::now() + KERNEL_READY_TIMEOUT;
        loop {
            let Some(m) = self.recv_until(deadline).await? else {
                return Err(RunError::KernelNotReady(KERNEL_READY_TIMEOUT));
            };
            if m["parent_header"]["msg_id"] == id.as_str() && msg_type(&m) == "kernel_info_reply" {
                return Ok(m["content"].clone());
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
    ) -> Result<Reply, RunError> {
        let id = self
            .send(
                "execute_request",
                json!({
                    "code": code, "silent": false, "store_history": true,
                    "user_expressions": {}, "allow_stdin": false, "stop_on_error": stop_on_error,
                }),
            )
            .await?;
        // nbclient's record_timing: when the kernel got busy, saw the input, replied, idled.
        cells[cell]["metadata"]["execution"] = json!({});
        let far = tokio::time::Instant::now() + Duration::from_secs(365 * 24 * 3600);
        let mut deadline = timeout.map_or(far, |t| tokio::time::Instant::now() + t);
        let mut reply: Option<Reply> = None;
        let mut idle = false;
        let mut timed_out = false;
        while !(idle && reply.is_some()) {
            let Some(m) = self.recv_until(deadline).await? else {
                if reply.is_some() {
                    // The reply came but IOPub's idle did not: keep what arrived.
                    break;
                }
                if timed_out {
                    return Err(RunError::KernelDied(
                        "no answer after an interrupt".into(),
                        cell + 1,
                    ));
                }
                timed_out = true;
                endpoint.interrupt(kernel_id).await?;
                deadline = tokio::time::Instant::now() + INTERRUPT_GRACE;
                continue;
            };
            let t = msg_type(&m);
            let content = &m["content"];
            if t == "status"
                && matches!(
                    content["execution_state"].as_str(),
                    Some("dead" | "restarting")
                )
            {
                let state = content["execution_state"].as_str().unwrap_or_default();
                return Err(RunError::KernelDied(state.to_owned(), cell + 1));
            }
            if m["parent_header"]["msg_id"] != id.as_str() {
                continue;
            }
            let date = m["header"]["date"].clone();
            let timing = &mut cells[cell]["metadata"]["execution"];
            match (m["channel"].as_str(), t) {
                (Some("shell"), "execute_reply") => {
                    timing["shell.execute_reply"] = date;
                    reply = Some(Reply {
                        status: content["status"].as_str().unwrap_or("").to_owned(),
                        execution_count: content["execution_count"].as_i64(),
                        ename: content["ename"].as_str().unwrap_or("").to_owned(),
                        evalue: content["evalue"].as_str().unwrap_or("").to_owned(),
                        timed_out,
                    });
                    if !idle {
                        deadline = tokio::time::Instant::now() + IOPUB_GRACE;
                    }
                }
                (Some("iopub"), "status") => match content["execution_state"].as_str() {
                    Some("busy") => timing["iopub.status.busy"] = date,
                    Some("idle") => {
                        timing["iopub.status.idle"] = date;
                        idle = true;
                    }
                    _ => {}
                },
                (Some("iopub"), "execute_input") => {
                    timing["iopub.execute_input"] = date;
                    if let Some(n) = content["execution_count"].as_i64() {
                        cells[cell]["execution_count"] = json!(n);
                    }
                }
                (Some("iopub"), t) => outputs.apply(cells, cell, t, content),
                _ => {}
            }
        }
        Ok(reply.unwrap_or_default())
    }
}

fn msg_type(m: &Value) -> &str {
    m["msg_type"]
        .as_str()
        .or(m["header"]["msg_type"].as_str())
        .unwrap_or("")
}

// ---------------------------------------------------------------------------------------
// A gateway of our own
// ---------------------------------------------------------------------------------------

/// `kernelgate serve` started by `kernelgate run` for one run: this binary, a free loopback
/// port, a random token, its own runtime directory and no warm pool.
#[derive(Debug)]
struct LocalGateway {
    child: Child,
    port: u16,
    token: String,
    runtime_dir: PathBuf,
}

impl LocalGateway {
    async fn start(image: &str) -> Result<LocalGateway, RunError> {
        let fail = |m: String| RunError::LocalGateway(m);
        let exe = std::env::current_exe().map_err(|e| fail(format!("cannot find myself: {e}")))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| fail(format!("no free port: {e}")))?
            .port();
        let token = kernelgate_protocol::SigningKey::generate_hex();
        // Short on purpose: kernel socket paths live under it (Unix sockets: 107 bytes).
        let runtime_dir = std::env::temp_dir().join(format!("kgrun-{port}"));
        let mut child = Command::new(&exe)
            .arg("serve")
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--image", image])
            .arg("--runtime-dir")
            .arg(&runtime_dir)
            .args(["--pool-size", "0", "--cull-idle-timeout", "0"])
            // The token goes by environment: other users can read a command line in `ps`.
            .env("KERNELGATE_TOKEN", &token)
            .env_remove("KERNELGATE_NO_AUTH")
            // Its own process group: Ctrl-C reaches `run`, which then stops it in order.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| fail(format!("cannot run {}: {e}", exe.display())))?;
        let log = keep_log(&mut child);
        let gateway = LocalGateway {
            child,
            port,
            token,
            runtime_dir,
        };
        match gateway.wait_listening().await {
            Ok(()) => {
                eprintln!(
                    "kernelgate run: started a local gateway on 127.0.0.1:{port} (image {image})"
                );
                Ok(gateway)
            }
            Err(why) => {
                gateway.stop().await;
                let tail: Vec<String> = log
                    .lock()
                    .map(|l| l.iter().cloned().collect())
                    .unwrap_or_default();
                Err(fail(format!("{why}\n{}", tail.join("\n"))))
            }
        }
    }

    async fn wait_listening(&self) -> Result<(), String> {
        let deadline = Instant::now() + GATEWAY_START_TIMEOUT;
        let pid = self.child.id();
        while Instant::now() < deadline {
            if pid.is_some_and(|p| !alive(p)) {
                return Err("it exited; its log:".into());
            }
            if TcpStream::connect(("127.0.0.1", self.port)).await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!(
            "it did not listen within {GATEWAY_START_TIMEOUT:?}; its log:"
        ))
    }

    fn endpoint(&self) -> Endpoint {
        Endpoint {
            base: format!("http://127.0.0.1:{}", self.port),
            token: Some(self.token.clone()),
            http: reqwest::Client::new(),
        }
    }

    /// SIGTERM, so it removes its kernel containers; SIGKILL if it hangs.
    async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        if tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .is_err()
        {
            eprintln!("kernelgate run: the local gateway did not stop within 30 s; killing it");
            let _ = self.child.kill().await;
        }
        let _ = std::fs::remove_dir(&self.runtime_dir);
    }
}

fn alive(pid: u32) -> bool {
    std::process::Command::new("kill")
        .args(["-0", &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Keeps the last lines the local gateway printed, to show them if it fails to start.
fn keep_log(child: &mut Child) -> Arc<Mutex<VecDeque<String>>> {
    let log = Arc::new(Mutex::new(VecDeque::new()));
    let readers: [Option<Box<dyn tokio::io::AsyncRead + Send + Unpin>>; 2] = [
        child.stdout.take().map(|s| Box::new(s) as _),
        child.stderr.take().map(|s| Box::new(s) as _),
    ];
    for reader in readers.into_iter().flatten() {
        let log = log.clone();
        // Ends when the child closes its output, at the latest when it exits.
        tokio::spawn(async move {
            let mut lines = BufReader::new(reader).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(mut log) = log.lock() {
                    if log.len() == 40 {
                        log.pop_front();
                    }
                    log.push_back(line);
                }
            }
        });
    }
    log
}

async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            },
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notebook(cells: Value) -> Vec<u8> {
        json!({"nbformat": 4, "nbformat_minor": 5, "metadata": {"custom": {"keep": 1}}, "cells": cells})
            .to_string()
            .into_bytes()
    }

    #[test]
    fn parse_clears_outputs_and_keeps_unknown_fields() {
        let bytes = notebook(json!([
            {"cell_type": "code", "id": "a", "source": ["x = 1\n", "x"], "metadata": {"tags": ["t"]},
             "outputs": [{"output_type": "stream", "name": "stdout", "text": "old"}],
             "execution_count": 7, "x-extra": true},
            {"cell_type": "markdown", "source": "# Title", "metadata": {}},
        ]));
        let nb = parse(Path::new("n.ipynb"), &bytes).expect("valid");
        let cell = &nb["cells"][0];
        assert_eq!(cell["outputs"], json!([]));
        assert_eq!(cell["execution_count"], Value::Null);
        assert_eq!(cell["x-extra"], json!(true));
        assert_eq!(cell["id"], "a");
        assert!(nb["cells"][1]["id"].is_string(), "4.5 cells get an id");
        assert_eq!(nb["metadata"]["custom"]["keep"], 1);
        assert_eq!(source_text(cell.get("source")).as_deref(), Some("x = 1\nx"));
    }

    #[test]
    fn parse_explains_what_is_wrong() {
        let p = Path::new("n.ipynb");
        let e = parse(p, b"{not json").expect_err("not JSON");
        assert!(e.to_string().contains("not valid JSON"), "{e}");
        let e = parse(
            p,
            br#"{"nbformat": 3, "nbformat_minor": 0, "metadata": {}, "worksheets": []}"#,
        )
        .expect_err("v3");
        assert!(e.to_string().contains("nbformat 3"), "{e}");
        let e = parse(p, &notebook(json!([{"cell_type": "code"}]))).expect_err("no source");
        assert!(e.to_string().contains("cell 1"), "{e}");
    }

    #[test]
    fn outputs_merge_streams_clear_and_update_displays() {
        let mut cells = vec![json!({"outputs": []}), json!({"outputs": []})];
        let mut o = Outputs::default();
        o.apply(
            &mut cells,
            0,
            "stream",
            &json!({"name": "stdout", "text": "a"}),
        );
        o.apply(
            &mut cells,
            0,
            "stream",
            &json!({"name": "stdout", "text": "b\n"}),
        );
        o.apply(
            &mut cells,
            0,
            "stream",
            &json!({"name": "stderr", "text": "w\n"}),
        );
        o.apply(
            &mut cells,
            0,
            "display_data",
            &json!({"data": {"text/plain": "v1"}, "metadata": {}, "transient": {"display_id": "d"}}),
        );
        o.apply(&mut cells, 1, "update_display_data",
            &json!({"data": {"text/plain": "v2"}, "metadata": {}, "transient": {"display_id": "d"}}));
        assert_eq!(cells[0]["outputs"][0]["text"], "ab\n");
        assert_eq!(cells[0]["outputs"][1]["name"], "stderr");
        assert_eq!(cells[0]["outputs"][2]["data"]["text/plain"], "v2");
        assert_eq!(cells[1]["outputs"], json!([]), "an update adds no output");

        o.apply(
            &mut cells,
            1,
            "stream",
            &json!({"name": "stdout", "text": "1"}),
        );
        o.apply(&mut cells, 1, "clear_output", &json!({"wait": true}));
        assert_eq!(
            cells[1]["outputs"].as_array().map(Vec::len),
            Some(1),
            "wait: not yet"
        );
        o.apply(
            &mut cells,
            1,
            "execute_result",
            &json!({"execution_count": 3, "data": {"text/plain": "2"}, "metadata": {}}),
        );
        assert_eq!(
            cells[1]["outputs"],
            json!([{"output_type": "execute_result", "execution_count": 3,
                    "data": {"text/plain": "2"}, "metadata": {}}])
        );
    }

    #[test]
    fn file_text_is_what_nbformat_writes() {
        let nb = json!({"nbformat_minor": 5, "nbformat": 4, "metadata": {}, "cells": [
            {"source": "a\nb", "cell_type": "code", "id": "x", "metadata": {}, "execution_count": 1,
             "outputs": [{"output_type": "display_data", "metadata": {},
                          "data": {"text/plain": "1\n2", "image/png": "iVBO\n", "application/json": {"b": 1, "a": 2}}}]}]});
        let text = to_file_text(&nb);
        let back: Value = serde_json::from_str(&text).expect("JSON");
        assert_eq!(back["cells"][0]["source"], json!(["a\n", "b"]));
        let data = &back["cells"][0]["outputs"][0]["data"];
        assert_eq!(data["text/plain"], json!(["1\n", "2"]));
        assert_eq!(data["image/png"], "iVBO\n");
        assert!(text.starts_with("{\n \"cells\": [\n"), "{text}");
        assert!(text.ends_with("}\n"));
        assert!(
            text.find("\"a\": 2").lt(&text.find("\"b\": 1")),
            "keys sorted"
        );
    }

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
