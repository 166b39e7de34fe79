//! What the audit trail and the execution policy cost an execute round trip: the same
//! release build with the audit log off, written (one `write` per record), written with
//! `--audit-fsync`, and off with an execution policy (each cell parsed and matched),
//! measured round by round side by side.

use crate::conn::Conn;
use crate::procs::{Paths, Server};
use crate::stats::{median, ms, percentile};
use crate::{log, stop_and_check, Opts, Results};
use anyhow::{Context, Result};
use serde_json::json;
use std::time::Duration;

/// The modes compared, in table order.
pub const MODES: [&str; 4] = ["off", "write", "fsync", "policy"];

/// The policy of the `policy` mode: the tests' (docs/policy.md's example), none of it
/// matching `1+1`.
const POLICY: &str = include_str!("../../../fixtures/policy.toml");

pub async fn compare(opts: &Opts, paths: &Paths, results: &mut Results) -> Result<()> {
    let long = Duration::from_secs(120);
    let log_file = paths.work.join("bench-audit.log");
    let log_path = log_file.display().to_string();
    let policy_file = paths.work.join("bench-policy.toml");
    std::fs::write(&policy_file, POLICY).context("writing the bench's policy file")?;
    let policy_path = policy_file.display().to_string();
    let mut servers = Vec::new();
    for mode in MODES {
        let mut extra = vec!["--runtime", "runc", "--audit-log"];
        match mode {
            "off" => extra.push("off"),
            "write" => extra.push(&log_path),
            "fsync" => extra.extend([log_path.as_str(), "--audit-fsync"]),
            _ => extra.extend(["off", "--policy", policy_path.as_str()]),
        }
        servers.push(Server::kernelgate(paths, 0, &extra).await?);
    }
    let mut conns = Vec::new();
    for server in &servers {
        let id = server.create_kernel(None).await?;
        let mut c = Conn::websocket(&server.base, &server.token, &id).await?;
        c.kernel_info(long).await?;
        c.wait_iopub(long).await?;
        conns.push(c);
    }
    let mut rt: [Vec<f64>; 4] = Default::default();
    for round in 0..opts.rounds {
        for (m, c) in conns.iter_mut().enumerate() {
            for _ in 0..20 {
                c.execute("1+1", long).await?;
            }
            let mut samples = Vec::with_capacity(opts.rt_runs);
            for _ in 0..opts.rt_runs {
                samples.push(ms(c.execute("1+1", long).await?.elapsed));
            }
            let p50 = percentile(&samples, 50.0);
            rt[m].push(p50);
            log(format!(
                "audit {} round {round}: 1+1 p50 {p50:.3} ms",
                MODES[m]
            ));
        }
    }
    for c in conns {
        c.close().await;
    }
    for s in servers {
        stop_and_check(s).await?;
    }
    let records = std::fs::read_to_string(&log_file)
        .map(|t| t.lines().count())
        .context("the audit log the bench wrote")?;
    let _ = std::fs::remove_file(&log_file);
    let _ = std::fs::remove_file(&policy_file);
    for (m, mode) in MODES.iter().enumerate() {
        results.set(
            "audit_execute_rt_ms",
            mode,
            json!({"p50": median(&rt[m]), "rounds": rt[m], "runs_per_round": opts.rt_runs}),
        );
    }
    results.set("audit_records", "written", json!(records));
    Ok(())
}
