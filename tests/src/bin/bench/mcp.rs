//! The agent API's round trip next to MCP's: `1+1` through `POST /api/kernels/{id}/execute`
//! and through an MCP `tools/call` of `run_python` in a session at `/mcp`, on one gateway,
//! each on a kernel of its own, measured round by round side by side.
//!
//! The MCP client (the client crate's `mcp`) is the least that Streamable HTTP asks (POST
//! a JSON-RPC message, read the SSE answer), so the numbers are the server's, not a client
//! library's.

use crate::procs::{Paths, Server};
use crate::stats::{median, ms, percentile};
use crate::{log, stop_and_check, Opts, Results};
use anyhow::{bail, Result};
use kernelgate_client::mcp::McpSession;
use kernelgate_protocol::agent::ExecuteBody;
use serde_json::json;
use std::time::{Duration, Instant};

/// The two ways compared, in table order.
pub const WAYS: [&str; 2] = ["agent_api", "mcp"];

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
    let text = session.run_python("1+1").await?;
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
    let mut session = McpSession::open(&server.client().clone().with_http(http.clone())).await?;
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
    session.close().await?;
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
