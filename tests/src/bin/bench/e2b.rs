//! E2B's unmodified SDK next to the gateway's own API on one gateway (release, runc, warm
//! pool of 2): `Sandbox.create` against `POST /api/kernels` (both from the full pool) and
//! `run_code("1+1")` against the agent API's execute, round by round side by side. The SDK
//! runs in the test venv (`make python-venv` installs the pinned `e2b-code-interpreter`)
//! through tests/python/bench_e2b.py, which prints every sample.

use crate::procs::{Paths, Server};
use crate::stats::median;
use crate::walls::spread;
use crate::{log, stop_and_check, Opts, Results};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

/// Each SDK figure with the API figure it is compared with.
const PAIRS: [(&str, &str, &str); 2] = [
    ("create", "sdk_create_ms", "api_create_ms"),
    ("run_code", "sdk_run_code_ms", "api_execute_ms"),
];

pub async fn compare(opts: &Opts, paths: &Paths, results: &mut Results) -> Result<()> {
    let python = paths.root.join(".venv-tests/bin/python");
    if !python.exists() {
        log("no test venv (`make python-venv`): no E2B SDK comparison");
        results.set(
            "e2b",
            "skipped",
            json!("the test venv with the E2B SDK is missing"),
        );
        return Ok(());
    }
    let server = Server::kernelgate(paths, 2, &["--runtime", "runc"]).await?;
    let rounds = opts.rounds.max(3);
    let runs = (opts.rt_runs / 10).max(10);
    let script = paths.root.join("tests/python/bench_e2b.py");
    let out = tokio::process::Command::new(&python)
        .arg(&script)
        .args([&server.base, &server.token])
        .args([rounds.to_string(), runs.to_string()])
        .output()
        .await;
    stop_and_check(server).await?;
    let out = out.context("running bench_e2b.py")?;
    if !out.status.success() {
        bail!(
            "bench_e2b.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let samples: Value = serde_json::from_slice(&out.stdout).context("bench_e2b.py's JSON")?;
    let series = |name: &str| -> Vec<f64> {
        samples[name]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_f64)
            .collect()
    };
    for (what, sdk, api) in PAIRS {
        let (s, a) = (series(sdk), series(api));
        if s.is_empty() || s.len() != a.len() {
            bail!(
                "bench_e2b.py gave {} and {} samples for {what}",
                s.len(),
                a.len()
            );
        }
        // Taken side by side, pair by pair: the ratio of each pair.
        let ratios: Vec<f64> = s.iter().zip(&a).map(|(s, a)| s / a).collect();
        log(format!(
            "e2b {what}: SDK {:.1} ms, API {:.1} ms (median)",
            median(&s),
            median(&a)
        ));
        results.set(
            "e2b",
            what,
            json!({"sdk_ms": median(&s), "api_ms": median(&a), "ratio": spread(&ratios),
                   "sdk_samples": s, "api_samples": a}),
        );
    }
    results.set(
        "e2b",
        "settings",
        json!({"rounds": rounds, "runs_per_round": runs, "runtime": "runc", "pool_size": 2}),
    );
    Ok(())
}
