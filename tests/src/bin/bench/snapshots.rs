//! Snapshots and forks by engine, on the engines comparison's gateways: Python-level under
//! Docker+runc and Docker+gVisor (the variables pickled and the home taken out; fresh
//! kernels given them), the whole kernel under the gVisor engine (checkpointed while it
//! runs on; restored into new sandboxes). Each round, side after side, on a kernel holding
//! a 100 MiB array and a 1M-row DataFrame: a snapshot (`POST .../snapshots`, timed), a
//! kernel started from it until it answers the cell that reads the state (timed), a fork
//! of 3 until each fork answered that cell (timed), and the baseline: a fresh create that
//! rebuilds the state by running the cells again, until the same cell answers (timed).

use crate::hibernate::{run, LARGE};
use crate::log;
use crate::procs::Server;
use crate::stats::{median, ms};
use crate::walls::spread;
use anyhow::{bail, Context, Result};
use reqwest::Method;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The sides measured, by index into the engines' sides.
pub const SIDES: [usize; 3] = [0, 1, 2];
const FORKS: usize = 3;
const LONG: Duration = Duration::from_secs(300);

/// Per round and side: snapshot, create from it, fork of 3, rebuild (ms); size (MiB).
type Round = [[f64; 5]; 3];

/// `POST` of `body` to `path` on `server`, its JSON answer; fails unless `status`.
async fn post(server: &Server, path: &str, body: Value, status: u16) -> Result<Value> {
    let client = server.client();
    let request = client.request(Method::POST, path).json(&body).timeout(LONG);
    let r = client.send_any(request).await?;
    let got = r.status().as_u16();
    let answer: Value = r.json().await.unwrap_or(Value::Null);
    if got != status {
        bail!("POST {path} answered {got}: {answer}");
    }
    Ok(answer)
}

async fn one_round(server: &Server) -> Result<[f64; 5]> {
    let source = server.create_kernel(None).await?;
    run(server, &source, LARGE.setup, "").await?;
    run(server, &source, LARGE.check, LARGE.prints).await?;

    let t0 = Instant::now();
    let snap = post(
        server,
        &format!("/api/kernels/{source}/snapshots"),
        json!({}),
        201,
    )
    .await?;
    let snapshot_ms = ms(t0.elapsed());
    let id = snap["id"].as_str().context("a snapshot id")?.to_owned();
    let size = snap["size"].as_f64().unwrap_or_default() / (1 << 20) as f64;

    let t1 = Instant::now();
    let started = post(server, "/api/kernels", json!({"snapshot": id}), 201).await?;
    let restored = started["id"].as_str().context("a kernel id")?.to_owned();
    run(server, &restored, LARGE.check, LARGE.prints).await?;
    let restore_ms = ms(t1.elapsed());

    let t2 = Instant::now();
    let forked = post(
        server,
        &format!("/api/kernels/{source}/fork"),
        json!({"count": FORKS}),
        200,
    )
    .await?;
    let forks: Vec<String> = forked["forks"]
        .as_array()
        .context("forks")?
        .iter()
        .map(|f| {
            f["kernel"]["id"]
                .as_str()
                .map(str::to_owned)
                .with_context(|| format!("a fork failed: {f}"))
        })
        .collect::<Result<_>>()?;
    let checks = forks
        .iter()
        .map(|f| run(server, f, LARGE.check, LARGE.prints));
    for checked in futures::future::join_all(checks).await {
        checked?;
    }
    let fork_ms = ms(t2.elapsed());

    let t3 = Instant::now();
    let fresh = server.create_kernel(None).await?;
    run(server, &fresh, LARGE.setup, "").await?;
    run(server, &fresh, LARGE.check, LARGE.prints).await?;
    let rebuild_ms = ms(t3.elapsed());

    for kernel in [&source, &restored, &fresh].into_iter().chain(&forks) {
        server.delete_kernel(kernel).await?;
    }
    let delete = server
        .client()
        .request(Method::DELETE, &format!("/api/kernelgate/snapshots/{id}"));
    server.client().send(delete).await?;
    Ok([snapshot_ms, restore_ms, fork_ms, rebuild_ms, size])
}

pub async fn measure(servers: &[Server], names: &[&str], rounds: usize) -> Result<Value> {
    let mut per_round: Vec<Round> = Vec::new();
    for round in 0..rounds {
        let mut r: Round = [[0.0; 5]; 3];
        for (k, &s) in SIDES.iter().enumerate() {
            r[k] = one_round(&servers[s]).await?;
            let [snap, restore, fork, rebuild, size] = r[k];
            log(format!(
                "snapshots round {round} {}: snapshot {snap:.0} ms ({size:.1} MiB), create from it {restore:.0} ms, fork of {FORKS} {fork:.0} ms, rebuild {rebuild:.0} ms",
                names[s]
            ));
        }
        per_round.push(r);
    }
    let mut out = serde_json::Map::new();
    for (k, &s) in SIDES.iter().enumerate() {
        // Each time against the same side's rebuild in the same round.
        let metric = |i: usize| {
            let values: Vec<f64> = per_round.iter().map(|r| r[k][i]).collect();
            let ratios: Vec<f64> = per_round.iter().map(|r| r[k][i] / r[k][3]).collect();
            json!({"median": median(&values), "rounds": values, "ratio": spread(&ratios),
                   "against": "rebuild"})
        };
        let sizes: Vec<f64> = per_round.iter().map(|r| r[k][4]).collect();
        out.insert(
            names[s].to_owned(),
            json!({"snapshot_ms": metric(0), "create_ms": metric(1), "fork3_ms": metric(2),
                   "rebuild_ms": metric(3), "size_mib": median(&sizes)}),
        );
    }
    out.insert(
        "settings".to_owned(),
        json!({"rounds": rounds, "forks": FORKS, "case": LARGE.setup, "check": LARGE.check}),
    );
    Ok(Value::Object(out))
}
