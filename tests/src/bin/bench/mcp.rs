//! The agent API's round trip next to MCP's: `1+1` through `POST /api/kernels/{id}/execute`
//! and through an MCP `tools/call` of `run_python` in a session at `/mcp`, on one gateway,
//! each on a kernel of its own, measured round by round side by side.
//!
//! The MCP client here is the least that Streamable HTTP asks (POST a JSON-RPC message,
//! read the SSE answer), so the numbers are the server's, not a client library's.

use crate::procs::{Paths, Server};
use crate::stats::{median, ms, percentile};
use crate::{log, stop_and_check, Opts, Results};
use anyhow::{bail, Context, Result};
use kernelgate_protocol::agent::ExecuteBody;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The two ways compared, in table order.
pub const WAYS: [&str; 2] = ["agent_api", "mcp"];

/// One MCP session over Streamable HTTP.
struct McpSession {
    http: reqwest::Client,
    url: String,
    token: String,
    session: String,
    next_id: u64,
}

const PROTOCOL: &str = "2025-11-25";

impl McpSession {
    async fn open(http: reqwest::Client, base: &str, token: &str) -> Result<McpSession> {
        let mut s = McpSession {
            http,
            url: format!("{base}/mcp"),
            token: token.to_owned(),
            session: String::new(),
            next_id: 0,
        };
        let init = json!({"protocolVersion": PROTOCOL, "capabilities": {},
                          "clientInfo": {"name": "kernelgate-bench", "version": "1"}});
        let initialize = s.message("initialize", init);
        let response = s.post(&initialize, None).await?;
        s.session = response
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .context("initialize answered without a session id")?
            .to_owned();
        read_answer(response).await?;
        let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        let session = s.session.clone();
        s.post(&initialized, Some(&session)).await?;
        Ok(s)
    }

    fn message(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        json!({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
    }

    async fn post(&self, body: &Value, session: Option<&str>) -> Result<reqwest::Response> {
        let mut r = self
            .http
            .post(&self.url)
            .header("Authorization", format!("token {}", self.token))
            .header("Accept", "application/json, text/event-stream")
            .header("MCP-Protocol-Version", PROTOCOL)
            .json(body);
        if let Some(id) = session {
            r = r.header("Mcp-Session-Id", id);
        }
        let response = r.send().await?;
        if !response.status().is_success() {
            bail!("/mcp answered {}", response.status());
        }
        Ok(response)
    }

    /// `run_python`; the text of its last content (the result: IPython may warn before it).
    async fn run(&mut self, code: &str) -> Result<String> {
        let call = self.message(
            "tools/call",
            json!({"name": "run_python", "arguments": {"code": code}}),
        );
        let session = self.session.clone();
        let answer = read_answer(self.post(&call, Some(&session)).await?).await?;
        let result = &answer["result"];
        if result["isError"] == json!(true) {
            bail!("run_python failed: {result}");
        }
        let last = result["content"].as_array().and_then(|c| c.last());
        Ok(last
            .and_then(|c| c["text"].as_str())
            .unwrap_or_default()
            .to_owned())
    }

    async fn close(self) {
        let _ = self
            .http
            .delete(&self.url)
            .header("Authorization", format!("token {}", self.token))
            .header("Mcp-Session-Id", &self.session)
            .header("MCP-Protocol-Version", PROTOCOL)
            .send()
            .await;
    }
}

/// The JSON-RPC answer in an SSE response (the first `data:` event that has an id).
async fn read_answer(mut response: reqwest::Response) -> Result<Value> {
    let mut pending = String::new();
    while let Some(chunk) = response.chunk().await? {
        pending.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = pending.find('\n') {
            let line: String = pending.drain(..=end).collect();
            if let Some(data) = line.trim_end().strip_prefix("data:") {
                if let Ok(message) = serde_json::from_str::<Value>(data.trim()) {
                    if message.get("id").is_some() {
                        return Ok(message);
                    }
                }
            }
        }
    }
    bail!("the SSE stream ended without an answer")
}

async fn agent_api(server: &Server, id: &str) -> Result<Duration> {
    let started = Instant::now();
    let body = ExecuteBody {
        code: "1+1".into(),
        ..ExecuteBody::default()
    };
    let answer = server.client().execute(id, &body).await?;
    let elapsed = started.elapsed();
    let value = answer
        .results
        .first()
        .and_then(|r| r.data.get("text/plain"));
    if value != Some(&json!("2")) {
        bail!("the agent API answered {answer:?}");
    }
    Ok(elapsed)
}

async fn mcp_call(session: &mut McpSession) -> Result<Duration> {
    let started = Instant::now();
    let text = session.run("1+1").await?;
    let elapsed = started.elapsed();
    if text != "2" {
        bail!("run_python answered {text:?}");
    }
    Ok(elapsed)
}

pub async fn compare(opts: &Opts, paths: &Paths, results: &mut Results) -> Result<()> {
    let server = Server::kernelgate(paths, 2, &["--runtime", "runc", "--audit-log", "off"]).await?;
    let http = reqwest::Client::builder().tcp_nodelay(true).build()?;
    let kernel = server.create_kernel(None).await?;
    let mut session = McpSession::open(http.clone(), &server.base, &server.token).await?;
    let mut rt: [Vec<f64>; 2] = Default::default();
    let mut all: [Vec<f64>; 2] = Default::default();
    for round in 0..opts.rounds {
        for (w, way) in WAYS.iter().enumerate() {
            let mut samples = Vec::with_capacity(opts.rt_runs);
            for i in 0..opts.rt_runs + 20 {
                let took = match w {
                    0 => agent_api(&server, &kernel).await?,
                    _ => mcp_call(&mut session).await?,
                };
                if i >= 20 {
                    samples.push(ms(took));
                }
            }
            let p50 = percentile(&samples, 50.0);
            log(format!("{way} round {round}: 1+1 p50 {p50:.3} ms"));
            rt[w].push(p50);
            all[w].extend(samples);
        }
    }
    session.close().await;
    stop_and_check(server).await?;
    for (w, way) in WAYS.iter().enumerate() {
        results.set(
            "tool_call_rt_ms",
            way,
            json!({"p50": median(&rt[w]), "p90": percentile(&all[w], 90.0),
                   "p99": percentile(&all[w], 99.0), "rounds": rt[w], "runs_per_round": opts.rt_runs}),
        );
    }
    Ok(())
}
