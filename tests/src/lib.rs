//! Helpers for the end-to-end tests: start the real `kernelgate` binary on a free loopback
//! port, call its REST API, and speak the Jupyter WebSocket protocol to it. Every test
//! talks to real Docker and a real ipykernel in the real image.

pub mod bench_report;
pub mod cluster;
pub mod engine;
pub mod etcd;
pub mod netns;
pub mod sandbox;

pub use engine::{gvisor_engine, skipped_under_the_engine};
pub use sandbox::Sandbox;

use anyhow::{anyhow, bail, Context, Result};
use kernelgate_client::serve::{LocalGateway, Output, Serve};
use kernelgate_client::Channels;
use kernelgate_protocol::websocket::{self, Encoding, Frame};
use kernelgate_protocol::{Channel, Execution, Message, RawJson};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message as WsMessage;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// The container of kernel `id`, inspected by Docker (Docker's engine only: tests that
/// run under either engine look through [`Gateway::sandbox`]).
pub fn inspect(id: &str) -> Result<Value> {
    let out = std::process::Command::new("docker")
        .args(["inspect", &format!("kernelgate-{id}")])
        .output()?;
    if !out.status.success() {
        bail!("docker inspect: {}", String::from_utf8_lossy(&out.stderr));
    }
    let all: Value = serde_json::from_slice(&out.stdout)?;
    Ok(all[0].clone())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

/// A file of a container's cgroup, read on the host: `v1` is (controller, file) under
/// cgroup v1, `v2` the file's name under cgroup v2.
pub fn cgroup_read(
    container_id: &str,
    v1: (&str, &str),
    v2: &str,
) -> Result<(CgroupVersion, String)> {
    let (controller, file) = v1;
    let path = format!("/sys/fs/cgroup/{controller}/docker/{container_id}/{file}");
    if let Ok(text) = std::fs::read_to_string(path) {
        return Ok((CgroupVersion::V1, text));
    }
    for dir in [
        format!("/sys/fs/cgroup/system.slice/docker-{container_id}.scope"),
        format!("/sys/fs/cgroup/docker/{container_id}"),
    ] {
        if let Ok(text) = std::fs::read_to_string(format!("{dir}/{v2}")) {
            return Ok((CgroupVersion::V2, text));
        }
    }
    bail!("no cgroup file {file} or {v2} found for container {container_id}")
}

/// The image the tests run kernels in (`make image` tags it).
pub fn image() -> String {
    std::env::var("KERNELGATE_IMAGE").unwrap_or_else(|_| "kernelgate-kernel:latest".to_owned())
}

/// The OCI runtime the tests run kernels under: `KERNELGATE_RUNTIME` (`runc`, the
/// default, `runsc` or `runsc-ptrace`); `make test` runs the suite under runc and runsc.
pub fn runtime() -> String {
    match std::env::var("KERNELGATE_RUNTIME") {
        Ok(r) if !r.is_empty() && r != "auto" => r,
        _ => "runc".to_owned(),
    }
}

/// Whether the kernels of this run are under gVisor.
pub fn gvisor() -> bool {
    runtime().starts_with("runsc")
}

/// The runtime the gateway reports (`GET /api`, its start line): the engine's name under
/// the gVisor engine, else the runtime of this run.
pub fn reported_runtime() -> String {
    if gvisor_engine() {
        "gvisor".to_owned()
    } else {
        runtime()
    }
}

/// The Docker engine's name of the runtime of this run (`make gvisor` registers the two
/// gVisor ones).
pub fn engine_runtime() -> String {
    match runtime().as_str() {
        "runc" => "runc".to_owned(),
        gvisor => format!("kernelgate-{gvisor}"),
    }
}

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_default()
}

/// The gateway binary: `KERNELGATE_BIN`, or the one `cargo build` left in target/.
pub fn binary() -> PathBuf {
    if let Ok(p) = std::env::var("KERNELGATE_BIN") {
        return PathBuf::from(p);
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| workspace_root().join("target"));
    for profile in ["debug", "release"] {
        let p = target.join(profile).join("kernelgate");
        if p.exists() {
            return p;
        }
    }
    target.join("debug").join("kernelgate")
}

/// A running gateway process, stopped (SIGTERM, then kill) when dropped.
#[derive(Debug)]
pub struct Gateway {
    process: LocalGateway,
    pub base: String,
    pub token: String,
    pub runtime_dir: PathBuf,
    /// Where this gateway writes its audit trail.
    pub audit_log: PathBuf,
    /// The harness chose the audit log (beside the runtime directory): it removes it.
    owns_audit_log: bool,
    /// Killed by [`Gateway::crash`]: what it left is the [`Crashed`] guard's.
    crashed: bool,
    /// The test host it runs in (`None`: on loopback).
    host: Option<netns::Host>,
    client: kernelgate_client::Gateway,
    /// Every line the gateway wrote to stderr so far.
    pub logs: Arc<Mutex<Vec<String>>>,
}

impl Gateway {
    /// Starts a gateway with a fresh token, no warm pool and its own runtime directory,
    /// plus `extra` flags (`{port}` in one stands for the port it listens on); returns once
    /// it serves HTTP.
    pub async fn start(extra: &[&str]) -> Result<Gateway> {
        Self::launch(extra, true, None, &[]).await
    }

    /// A gateway started inside test host `host`, listening on its address (`{host}` in
    /// a flag stands for that address). Its clients must run in a namespace on the same
    /// switch ([`netns::run_in`]).
    pub async fn start_on(host: &netns::Host, extra: &[&str]) -> Result<Gateway> {
        Self::launch(extra, true, Some(host), &[]).await
    }

    /// A gateway started with `--no-auth` (loopback only).
    pub async fn start_without_token() -> Result<Gateway> {
        Self::launch(&["--no-auth"], false, None, &[]).await
    }

    /// A gateway started through `launcher` (a program and its arguments that end by
    /// `exec`ing the rest of the line: the gateway), otherwise as [`Gateway::start`].
    pub async fn start_through(launcher: &[&str], extra: &[&str]) -> Result<Gateway> {
        let launcher: Vec<String> = launcher.iter().map(|s| (*s).to_owned()).collect();
        Self::launch(extra, true, None, &launcher).await
    }

    /// Starts a gateway; when the port it was given turns out to answer as something else
    /// (another test process took it between its choice and the bind), on another port.
    async fn launch(
        extra: &[&str],
        with_token: bool,
        host: Option<&netns::Host>,
        launcher: &[String],
    ) -> Result<Gateway> {
        for _ in 0..2 {
            let gw = Self::launch_once(extra, with_token, host, launcher).await?;
            let api = gw.get_json("/api").await;
            // A gateway answers 200, or 403 to a token a test's flags made invalid.
            if matches!(&api, Ok((200 | 403, _))) {
                return Ok(gw);
            }
            eprintln!(
                "{} answered {api:?}, not as this gateway; another port",
                gw.base
            );
        }
        Self::launch_once(extra, with_token, host, launcher).await
    }

    async fn launch_once(
        extra: &[&str],
        with_token: bool,
        host: Option<&netns::Host>,
        launcher: &[String],
    ) -> Result<Gateway> {
        let mut serve = Serve::new(binary())?;
        if !launcher.is_empty() {
            serve = serve.launcher(launcher);
        }
        let port = serve.port();
        let address = host.map_or("127.0.0.1", |h| h.ip.as_str());
        if let Some(host) = host {
            serve = serve
                .host(host.ip.parse().context("a test host's address")?)
                .launcher(host.launcher());
        }
        let token = if with_token {
            format!("test-{}", uuid::Uuid::new_v4().simple())
        } else {
            String::new()
        };
        let given_dir = extra
            .iter()
            .position(|a| *a == "--runtime-dir")
            .and_then(|i| extra.get(i + 1));
        let runtime_dir = given_dir
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(format!("/run/kg-test-{port}")));
        let mut args: Vec<String> = Vec::new();
        if with_token {
            args.extend(["--token".into(), token.clone()]);
        }
        if !extra.contains(&"--image") {
            args.extend(["--image".into(), image()]);
        }
        if !extra.contains(&"--runtime") {
            args.extend(["--runtime".into(), runtime()]);
        }
        if given_dir.is_none() {
            args.extend(["--runtime-dir".into(), runtime_dir.display().to_string()]);
        }
        if !extra.contains(&"--hibernate-dir") {
            args.extend([
                "--hibernate-dir".into(),
                hibernate_dir(&runtime_dir).display().to_string(),
            ]);
        }
        if !extra.contains(&"--pool-size") {
            args.extend(["--pool-size".into(), "0".into()]);
        }
        // A template is made at start under the gVisor engine: a sandbox more for a few
        // seconds, which tests that count sandboxes would see. The tests of templates
        // turn them on.
        if !extra.contains(&"--kernel-templates") {
            args.extend(["--kernel-templates".into(), "false".into()]);
        }
        args.extend(engine::engine_flags(extra)?);
        // Each gateway its own audit log, beside its runtime directory.
        let given_log = extra.iter().position(|a| *a == "--audit-log");
        let audit_log = match given_log {
            Some(i) => PathBuf::from(extra.get(i + 1).copied().unwrap_or_default()),
            None => {
                let log = PathBuf::from(format!("{}.audit.log", runtime_dir.display()));
                args.extend(["--audit-log".into(), log.display().to_string()]);
                log
            }
        };
        args.extend(extra.iter().map(|s| {
            s.replace("{port}", &port.to_string())
                .replace("{host}", address)
        }));
        let logs = Arc::new(Mutex::new(Vec::new()));
        let kept = logs.clone();
        let process = serve
            .args(&args)
            .env("KERNELGATE_LOG", "kernelgate=debug,warn")
            .listen_timeout(Duration::from_secs(30))
            .start(move |output, line| match output {
                Output::Stdout => eprintln!("[gw {port} out] {line}"),
                Output::Stderr => {
                    eprintln!("[gw {port}] {line}");
                    if let Ok(mut kept) = kept.lock() {
                        kept.push(line.to_owned());
                    }
                }
            })
            .await
            .with_context(|| format!("cannot start {} on port {port}", binary().display()))?;
        let base = process.base();
        let client = kernelgate_client::Gateway::new(&base, with_token.then(|| token.clone()));
        Ok(Gateway {
            process,
            base,
            token,
            runtime_dir,
            audit_log,
            owns_audit_log: given_log.is_none(),
            crashed: false,
            host: host.cloned(),
            client,
            logs,
        })
    }

    /// The sandbox of kernel `kernel_id`, whichever engine runs it.
    pub fn sandbox(&self, kernel_id: &str) -> Result<Sandbox> {
        sandbox::sandbox_of(&self.runtime_dir, kernel_id)
    }

    /// The gateway's own client (its token).
    pub fn client(&self) -> &kernelgate_client::Gateway {
        &self.client
    }

    /// The gateway's resident memory in bytes (VmRSS), while it runs.
    pub fn rss_bytes(&self) -> Result<u64> {
        let pid = self.process.pid().context("the gateway is not running")?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        let kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .context("VmRSS in /proc/PID/status")?;
        Ok(kib * 1024)
    }

    pub fn url(&self, path: &str) -> String {
        self.client.url(path)
    }

    /// A request with the token header.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        // The harness sends its token even when the gateway has none (`--no-auth`).
        self.client
            .with_token(Some(&self.token))
            .request(method, path)
    }

    /// Sends a request; its status and JSON body (`null` when it has none).
    async fn status_json(&self, request: reqwest::RequestBuilder) -> Result<(u16, Value)> {
        let r = self.client.send_any(request).await?;
        let status = r.status().as_u16();
        Ok((status, r.json().await.unwrap_or(Value::Null)))
    }

    /// `POST /api/kernels`; returns the kernel model.
    pub async fn create_kernel(&self) -> Result<Value> {
        let r = self
            .request(reqwest::Method::POST, "/api/kernels")
            .json(&json!({"name": "python3"}))
            .send()
            .await?;
        let status = r.status();
        let body: Value = r.json().await?;
        if status.as_u16() != 201 {
            bail!("create kernel: {status} {body}");
        }
        Ok(body)
    }

    pub async fn delete_kernel(&self, id: &str) -> Result<u16> {
        let r = self
            .request(reqwest::Method::DELETE, &format!("/api/kernels/{id}"))
            .send()
            .await?;
        Ok(r.status().as_u16())
    }

    pub async fn get_json(&self, path: &str) -> Result<(u16, Value)> {
        self.status_json(self.request(reqwest::Method::GET, path))
            .await
    }

    pub async fn post_json(&self, path: &str, body: Value) -> Result<(u16, Value)> {
        self.status_json(self.request(reqwest::Method::POST, path).json(&body))
            .await
    }

    /// A request as the holder of `token` (another tenant's key): status and JSON body.
    pub async fn call_as(
        &self,
        token: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<(u16, Value)> {
        let mut req = self.client.with_token(Some(token)).request(method, path);
        if let Some(b) = body {
            req = req.json(&b);
        }
        self.status_json(req).await
    }

    /// Runs code through the agent API (`POST /api/kernels/{id}/execute`); its JSON answer.
    pub async fn execute(&self, id: &str, code: &str) -> Result<Value> {
        let (status, body) = self
            .post_json(&format!("/api/kernels/{id}/execute"), json!({"code": code}))
            .await?;
        if status != 200 {
            bail!("execute answered {status}: {body}");
        }
        Ok(body)
    }

    /// What `code` printed (stdout), run through the agent API; fails unless it ran to the
    /// end without an error.
    pub async fn run(&self, id: &str, code: &str) -> Result<String> {
        let answer = self.execute(id, code).await?;
        anyhow::ensure!(answer["status"] == "ok", "{code}: {answer}");
        Ok(answer["stdout"].as_str().unwrap_or_default().to_owned())
    }

    /// The agent API's answer for `code`, asked as the holder of `token`.
    pub async fn execute_as(&self, token: &str, id: &str, code: &str) -> Result<Value> {
        let path = format!("/api/kernels/{id}/execute");
        let (status, body) = self
            .call_as(
                token,
                reqwest::Method::POST,
                &path,
                Some(json!({"code": code})),
            )
            .await?;
        if status != 200 {
            bail!("execute answered {status}: {body}");
        }
        Ok(body)
    }

    /// The records of this gateway's audit log whose `event` is `event`, in order (read as
    /// [`audit_values`] reads them).
    pub fn audited(&self, event: &str) -> Result<Vec<Value>> {
        Ok(audit_values(&self.audit_log)?
            .into_iter()
            .filter(|r| r["event"] == event)
            .collect())
    }

    /// The `/metrics` text, read with the gateway's token.
    pub async fn metrics(&self) -> Result<String> {
        Ok(self
            .request(reqwest::Method::GET, "/metrics")
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?)
    }

    /// Polls `/readyz` (up to 60 s) until its warm pools are in `state` (`filled`,
    /// `filling`, `off`); returns the answer.
    pub async fn wait_pool(&self, state: &str) -> Result<Value> {
        let mut last = Value::Null;
        for _ in 0..120 {
            let r = self
                .client
                .send_any(
                    self.client
                        .with_token(None)
                        .request(reqwest::Method::GET, "/readyz"),
                )
                .await?;
            let status = r.status().as_u16();
            last = r.json().await?;
            if status == 200 && last["pool"]["state"] == state {
                return Ok(last);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        bail!("/readyz never reported the pools {state}: {last}")
    }

    /// Opens the channels WebSocket of a kernel.
    pub async fn channels(&self, kernel_id: &str, session_id: &str) -> Result<Client> {
        self.channels_with(kernel_id, session_id, None).await
    }

    pub async fn channels_with(
        &self,
        kernel_id: &str,
        session_id: &str,
        subprotocol: Option<&str>,
    ) -> Result<Client> {
        let gateway = self.client.with_token(Some(&self.token));
        let channels = Channels::connect_as(&gateway, kernel_id, session_id, subprotocol).await?;
        Ok(Client {
            v1: channels.encoding() == Encoding::V1,
            channels,
            session: session_id.to_owned(),
            seen: Vec::new(),
        })
    }

    /// The gateway's process id.
    pub fn pid(&self) -> Option<u32> {
        self.process.pid()
    }

    /// Kills the gateway with SIGKILL, as a crash would: its containers, runtime directory
    /// and audit log stay, for [`Crashed::restart`] (or the guard's drop) to take over.
    pub async fn crash(mut self) -> Result<Crashed> {
        if self.process.is_stopped() {
            bail!("already stopped");
        }
        self.process.kill().await?;
        self.crashed = true;
        Ok(Crashed {
            runtime_dir: self.runtime_dir.clone(),
            host: self.host.clone(),
            audit_log: self.owns_audit_log.then(|| self.audit_log.clone()),
            armed: true,
        })
    }

    /// Stops the gateway with SIGTERM and waits for it (it removes its containers).
    pub async fn stop(mut self) -> Result<std::process::ExitStatus> {
        if self.process.is_stopped() {
            bail!("already stopped");
        }
        Ok(self.process.stop(Duration::from_secs(30)).await?)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        // Give it the chance to remove its kernels: as long as `stop` gives it (under the
        // gVisor engine a sandbox's kill, exit and delete take seconds each on a loaded
        // machine; 10 s once cut a shutdown short and left its runtime directory behind).
        self.process.stop_blocking(Duration::from_secs(30));
        if self.crashed {
            return;
        }
        // Empty once the gateway removed its kernels; else kept to look at.
        let _ = std::fs::remove_dir(&self.runtime_dir);
        let _ = std::fs::remove_dir_all(hibernate_dir(&self.runtime_dir));
        if self.owns_audit_log {
            let _ = std::fs::remove_file(&self.audit_log);
        }
    }
}

/// What a gateway killed by [`Gateway::crash`] left: its containers, its runtime directory
/// (with the kernels' socket directories, mounted when it ran as root) and its audit log.
/// [`Crashed::restart`] hands them to a new gateway on the same directory, as after a real
/// crash; dropped without that, the guard removes them, so no test leaves work behind.
#[derive(Debug)]
#[must_use = "restart the gateway, or drop the guard to remove what the crashed one left"]
pub struct Crashed {
    runtime_dir: PathBuf,
    host: Option<netns::Host>,
    audit_log: Option<PathBuf>,
    armed: bool,
}

impl Crashed {
    /// Starts a gateway on the crashed one's runtime directory, plus `extra` flags.
    pub async fn restart(mut self, extra: &[&str]) -> Result<Gateway> {
        self.armed = false;
        let dir = self.runtime_dir.display().to_string();
        let mut args = extra.to_vec();
        if !args.contains(&"--runtime-dir") {
            args.extend(["--runtime-dir", &dir]);
        }
        Gateway::launch(&args, true, self.host.as_ref(), &[]).await
    }
}

impl Drop for Crashed {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        remove_leftovers(&self.runtime_dir);
        if let Some(log) = &self.audit_log {
            let _ = std::fs::remove_file(log);
        }
    }
}

/// Where the harness's gateway on `runtime_dir` keeps hibernated kernels (unless the test
/// gives `--hibernate-dir`): beside the runtime directory, so a restarted gateway on the
/// same directory finds them.
pub fn hibernate_dir(runtime_dir: &std::path::Path) -> PathBuf {
    PathBuf::from(format!("{}.hibernated", runtime_dir.display()))
}

/// Removes what a gateway on `runtime_dir` created, as the gateway itself would at its
/// shutdown: the containers labelled with the directory, the gVisor engine's sandboxes
/// under it (their bundles go with the directory), the mounts below it, the directory.
pub fn remove_leftovers(runtime_dir: &std::path::Path) {
    let _ = std::fs::remove_dir_all(hibernate_dir(runtime_dir));
    engine::remove_sandboxes(runtime_dir);
    let filter = format!("label=org.kernelgate.runtime_dir={}", runtime_dir.display());
    let listed = std::process::Command::new("docker")
        .args(["ps", "-aq", "--filter", &filter])
        .output();
    if let Ok(out) = listed {
        let ids: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        if !ids.is_empty() {
            let _ = std::process::Command::new("docker")
                .args(["rm", "-f"])
                .args(&ids)
                .stdout(Stdio::null())
                .status();
        }
    }
    let below = format!("{}/", runtime_dir.display());
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    for point in mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|p| p.starts_with(&below))
    {
        let _ = std::process::Command::new("umount").arg(point).status();
    }
    let _ = std::fs::remove_dir_all(runtime_dir);
}

/// A free TCP port on loopback.
pub fn free_port() -> Result<u16> {
    Ok(kernelgate_client::serve::free_port()?)
}

/// What one execute request produced, as a notebook user sees it: the fields of the
/// protocol crate's [`kernelgate_protocol::Outcome`] in the shapes the tests compare.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub status: String,
    pub execution_count: Option<i64>,
    pub stdout: String,
    pub stderr: String,
    /// `data` bundles of execute_result and display_data, in order.
    pub displays: Vec<Map<String, Value>>,
    pub error: Option<Value>,
    /// Every message type received for this request, in order.
    pub msg_types: Vec<String>,
}

/// Follows one request with the gateway's own tracker ([`Execution`]) and keeps what a
/// test looks at.
#[derive(Debug)]
pub struct Tracked {
    execution: Execution,
    outcome: kernelgate_protocol::Outcome,
    msg_types: Vec<String>,
}

impl Tracked {
    pub fn new(msg_id: &str) -> Self {
        Tracked {
            execution: Execution::new(msg_id),
            outcome: Default::default(),
            msg_types: Vec::new(),
        }
    }

    /// Feeds one received message; true once the request is over.
    pub fn feed(&mut self, channel: Channel, message: &Message) -> bool {
        self.observe(
            channel,
            message.msg_type(),
            message.parent_msg_id(),
            &message.content,
        )
    }

    /// [`Self::feed`] for a message as [`Client::recv`] returns it.
    pub fn feed_json(&mut self, m: &Value) -> Result<bool> {
        let channel: Channel = m["channel"].as_str().unwrap_or_default().parse()?;
        let msg_type = m["msg_type"]
            .as_str()
            .or(m["header"]["msg_type"].as_str())
            .unwrap_or_default();
        Ok(self.observe(
            channel,
            msg_type,
            m["parent_header"]["msg_id"].as_str(),
            &RawJson::from_value(&m["content"]),
        ))
    }

    fn observe(
        &mut self,
        channel: Channel,
        msg_type: &str,
        parent: Option<&str>,
        content: &RawJson,
    ) -> bool {
        if let Some(event) = self.execution.observe(channel, msg_type, parent, content) {
            self.msg_types.push(msg_type.to_owned());
            self.outcome.apply(&event);
        }
        self.execution.is_done()
    }

    pub fn finish(self) -> Outcome {
        let o = self.outcome;
        Outcome {
            status: o
                .reply
                .as_ref()
                .map(|r| r.status.clone())
                .unwrap_or_default(),
            execution_count: o.execution_count(),
            stdout: o.stdout,
            stderr: o.stderr,
            displays: o.displays.into_iter().map(|d| d.data).collect(),
            error: o
                .error
                .map(|e| json!({"ename": e.ename, "evalue": e.evalue, "traceback": e.traceback})),
            msg_types: self.msg_types,
        }
    }
}

impl Outcome {
    /// The first PNG among the outputs (base64), or an error naming what came instead.
    pub fn png(&self) -> Result<&str> {
        self.displays
            .iter()
            .find_map(|d| d.get("image/png").and_then(|v| v.as_str()))
            .ok_or_else(|| anyhow!("no image/png in {:?}", self.msg_types))
    }

    /// The text/plain of the execute_result, if any.
    pub fn result_text(&self) -> Option<String> {
        self.displays.iter().rev().find_map(|d| {
            d.get("text/plain")
                .and_then(|v| v.as_str())
                .map(str::to_owned)
        })
    }

    pub fn ename(&self) -> Option<String> {
        self.error
            .as_ref()
            .and_then(|e| e["ename"].as_str().map(str::to_owned))
    }
}

/// A raw WebSocket to the gateway.
pub type WsStream = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// A Jupyter WebSocket client (legacy JSON or v1 encoding) that speaks JSON values: a thin
/// layer over the client crate's [`Channels`].
#[derive(Debug)]
pub struct Client {
    channels: Channels,
    pub session: String,
    pub v1: bool,
    /// Messages received that no call consumed yet.
    pub seen: Vec<Value>,
}

impl Client {
    /// Sends a message; returns its msg_id.
    pub async fn send(&mut self, channel: &str, msg_type: &str, content: Value) -> Result<String> {
        let channel: Channel = channel.parse()?;
        Ok(self
            .channels
            .request(
                channel,
                msg_type,
                &content,
                "test",
                "2026-01-01T00:00:00.000000Z",
            )
            .await?)
    }

    /// Sends raw text (for malformed-input tests).
    pub async fn send_raw(&mut self, msg: WsMessage) -> Result<()> {
        Ok(self.channels.send_frame(msg).await?)
    }

    /// The next message from the gateway, as JSON with a `channel` field.
    pub async fn recv(&mut self, timeout: Duration) -> Result<Value> {
        let deadline = tokio::time::Instant::now() + timeout;
        let frame = self
            .channels
            .recv_frame_until(deadline)
            .await
            .map_err(|e| anyhow!("WebSocket: {e}"))?
            .context("timed out waiting for a message")?;
        match frame {
            Frame::Text(t) => Ok(serde_json::from_str(&t)?),
            Frame::Binary(b) => {
                let (channel, m) = websocket::decode(self.channels.encoding(), &Frame::Binary(b))?;
                let mut v = json!({
                    "header": m.header, "parent_header": m.parent_header.map(serde_json::to_value).transpose()?.unwrap_or(json!({})),
                    "metadata": serde_json::from_str::<Value>(m.metadata.get())?,
                    "content": serde_json::from_str::<Value>(m.content.get())?,
                    "channel": channel.as_str(),
                });
                v["msg_type"] = v["header"]["msg_type"].clone();
                v["buffers_len"] = json!(m.buffers.len());
                Ok(v)
            }
        }
    }

    /// Waits for a message matching `pred`, keeping others in `seen`.
    pub async fn wait_for(
        &mut self,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Result<Value> {
        if let Some(i) = self.seen.iter().position(&pred) {
            return Ok(self.seen.remove(i));
        }
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let m = self.recv(left).await?;
            if pred(&m) {
                return Ok(m);
            }
            self.seen.push(m);
        }
    }

    /// `kernel_info_request` and its reply content.
    pub async fn kernel_info(&mut self) -> Result<Value> {
        let id = self.send("shell", "kernel_info_request", json!({})).await?;
        let reply = self
            .wait_for(Duration::from_secs(30), |m| {
                m["parent_header"]["msg_id"] == id.as_str() && m["msg_type"] == "kernel_info_reply"
            })
            .await?;
        Ok(reply["content"].clone())
    }

    /// Runs code and collects everything it produced until the kernel is idle again.
    pub async fn execute(&mut self, code: &str) -> Result<Outcome> {
        self.execute_for(code, Duration::from_secs(60)).await
    }

    pub async fn execute_for(&mut self, code: &str, timeout: Duration) -> Result<Outcome> {
        let id = self.start_execute(code).await?;
        self.collect(&id, timeout).await
    }

    pub async fn start_execute(&mut self, code: &str) -> Result<String> {
        self.send(
            "shell",
            "execute_request",
            json!({"code": code, "silent": false, "store_history": true,
                   "user_expressions": {}, "allow_stdin": true, "stop_on_error": true}),
        )
        .await
    }

    /// Collects the outputs of request `id` until both its reply and idle status came.
    pub async fn collect(&mut self, id: &str, timeout: Duration) -> Result<Outcome> {
        let mut tracked = Tracked::new(id);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let m = self
                .wait_for(left, |m| m["parent_header"]["msg_id"] == id)
                .await
                .with_context(|| format!("collecting outputs so far: {tracked:?}"))?;
            if tracked.feed_json(&m)? {
                return Ok(tracked.finish());
            }
        }
    }

    pub async fn close(self) -> Result<()> {
        Ok(self.channels.close().await?)
    }
}

/// Decodes base64 PNG data and checks it is a real PNG; returns (width, height).
pub fn decode_png(b64: &str) -> Result<(u32, u32)> {
    use base64::Engine;
    let clean: String = b64.chars().filter(|c| !c.is_whitespace()).collect();
    let bytes = base64::engine::general_purpose::STANDARD.decode(clean)?;
    if bytes.len() < 24 || &bytes[..8] != b"\x89PNG\r\n\x1a\n" || &bytes[12..16] != b"IHDR" {
        bail!("not a PNG");
    }
    let w = u32::from_be_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]);
    let h = u32::from_be_bytes([bytes[20], bytes[21], bytes[22], bytes[23]]);
    // A PNG must end with IEND.
    if !bytes.ends_with(&[0x49, 0x45, 0x4e, 0x44, 0xae, 0x42, 0x60, 0x82]) {
        bail!("PNG is truncated");
    }
    Ok((w, h))
}

/// The derived image: from `make e2e`, or built now through the same make target.
pub fn fixture_image() -> Result<String> {
    if let Ok(image) = std::env::var("KERNELGATE_FIXTURE_IMAGE") {
        if !image.is_empty() {
            return Ok(image);
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let make = |args: &[&str]| {
        std::process::Command::new("make")
            .current_dir(&root)
            .args(["--no-print-directory", "-s"])
            .args(args)
            .output()
    };
    let built = make(&["fixture-image"])?;
    if !built.status.success() {
        bail!(
            "make fixture-image: {}",
            String::from_utf8_lossy(&built.stderr)
        );
    }
    let name = make(&[
        "-f",
        "mk/image.mk",
        "--eval",
        "print:\n\t@echo $(FIXTURE_IMAGE)",
        "print",
    ])?;
    Ok(String::from_utf8(name.stdout)?.trim().to_owned())
}

/// The wheelhouse's name for the kernel image: the first 12 hex digits of its id.
pub fn image_key() -> Result<String> {
    let out = std::process::Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", &image()])
        .output()?;
    let id = String::from_utf8_lossy(&out.stdout);
    let id = id.trim().trim_start_matches("sha256:");
    anyhow::ensure!(id.len() >= 12, "no id for the image {}: {id:?}", image());
    Ok(id[..12].to_owned())
}

/// Every record of an audit log, read as the gateway's own type (`kernelgate audit` reads
/// them so too): a whole line that is not a record fails. A last line without its newline
/// is one the gateway is still writing, and is left out.
pub fn audit_log(path: &Path) -> Result<Vec<kernelgate::audit::Entry>> {
    let text = std::fs::read_to_string(path)?;
    let whole = match text.rfind('\n') {
        Some(end) => &text[..end],
        None => "",
    };
    whole
        .lines()
        .filter_map(kernelgate::audit::Entry::parse)
        .map(|entry| entry.with_context(|| format!("a record of {}", path.display())))
        .collect()
}

/// [`audit_log`]'s records as the JSON objects they are written as (`time`, `event`, the
/// fields), for assertions on their fields.
pub fn audit_values(path: &Path) -> Result<Vec<Value>> {
    audit_log(path)?
        .iter()
        .map(|entry| Ok(serde_json::to_value(entry)?))
        .collect()
}

/// Runs a command to its end: its standard output, trimmed; an error naming the command,
/// with what it wrote, when it fails.
pub fn command_output(command: &mut std::process::Command) -> Result<String> {
    let out = command
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("running {command:?}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// Held while a test loads the machine on purpose (kernels flooding the gateway, a kernel
/// spinning on its CPU quota): any other such test, of this suite or of one that runs beside
/// it (`make test` runs two at a time), waits until it is dropped, so that each measures the
/// gateway under its own load and not two loads fighting for the machine's cores.
pub fn machine_to_myself() -> Result<std::fs::File> {
    let path = std::env::temp_dir().join("kernelgate-tests-load.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    file.lock()
        .with_context(|| format!("locking {}", path.display()))?;
    Ok(file)
}

/// `kernelgate keys ARGS --file FILE` (keys made as an operator makes them); its stdout.
pub fn keys(file: &Path, args: &[&str]) -> Result<String> {
    let out = std::process::Command::new(binary())
        .arg("keys")
        .args(args)
        .arg("--file")
        .arg(file)
        .output()?;
    if !out.status.success() {
        bail!(
            "kernelgate keys {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8(out.stdout)?)
}
