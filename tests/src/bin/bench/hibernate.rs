//! What hibernation (docs/hibernation.md) costs and gives back, on one gateway with a warm
//! pool of 1, so every resume takes the warm kernel. Two kernels: one holding only `x = 1`,
//! one holding 100 MiB of NumPy array and a 1M-row DataFrame with a string column. Each
//! round, with the pool filled and quiet: `POST /api/kernels/{id}/hibernate` timed, then the
//! resume, timed as the `POST /api/kernels/{id}/execute` that wakes it, its output checked.
//! Per round also the state's size on disk and the memory of the kernel's container before
//! it hibernated and after. Baselines from the same gateway: the same execute on the
//! running kernel, and a create from the warm pool.

use crate::procs::{self, containers, Paths, Server};
use crate::stats::{median, ms, percentile};
use crate::{log, stop_and_check, Opts, Results};
use anyhow::{bail, Context, Result};
use kernelgate_protocol::agent::ExecuteBody;
use kernelgate_protocol::execution::Status;
use reqwest::Method;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// One kernel's workload: what it holds, and the cell that wakes it and what it prints.
pub(crate) struct Case {
    pub(crate) name: &'static str,
    pub(crate) setup: &'static str,
    pub(crate) check: &'static str,
    pub(crate) prints: &'static str,
}

const IDLE: Case = Case {
    name: "idle",
    setup: "x = 1",
    check: "print(x)",
    prints: "1\n",
};

pub(crate) const LARGE: Case = Case {
    name: "large",
    setup: "import numpy as np, pandas as pd\n\
            a = np.ones(100 * 2**20 // 8)\n\
            df = pd.DataFrame({\"i\": range(1_000_000), \"s\": [\"row\"] * 1_000_000})\n",
    check: "print(a.sum(), len(df))",
    prints: "13107200.0 1000000\n",
};

/// Executes on the running kernel for the baseline, after as many warm-ups.
const RUNNING_SAMPLES: usize = 20;

pub async fn compare(opts: &Opts, paths: &Paths, results: &mut Results) -> Result<()> {
    let long = Duration::from_secs(180);
    let hibernate_dir = paths.work.join("hibernated");
    let audit_log = paths.work.join("hibernate-audit.log");
    let server = Server::kernelgate(
        paths,
        1,
        &[
            "--runtime",
            "runc",
            "--hibernate-dir",
            &hibernate_dir.display().to_string(),
            "--audit-log",
            &audit_log.display().to_string(),
            // Only the bench hibernates kernels.
            "--hibernate-after",
            "0",
        ],
    )
    .await?;
    let measured = measure(opts, &server, &hibernate_dir, &audit_log, long, results).await;
    stop_and_check(server).await?;
    let _ = std::fs::remove_file(&audit_log);
    measured
}

async fn measure(
    opts: &Opts,
    server: &Server,
    hibernate_dir: &Path,
    audit_log: &Path,
    long: Duration,
    results: &mut Results,
) -> Result<()> {
    // Creates from the warm pool, each then running its first cell.
    let mut creates = Vec::new();
    let mut first_runs = Vec::new();
    for i in 0..opts.hibernate_rounds {
        pool_ready(server, 1, long).await?;
        let t0 = Instant::now();
        let id = server.create_kernel(None).await?;
        let created = ms(t0.elapsed());
        let t1 = Instant::now();
        run(server, &id, "print(1)", "1\n").await?;
        let first = ms(t1.elapsed());
        log(format!(
            "hibernate: warm create {i}: {created:.1} ms, its first execute {first:.1} ms"
        ));
        creates.push(created);
        first_runs.push(first);
        server.delete_kernel(&id).await?;
    }
    results.set(
        "hibernate",
        "warm_create",
        json!({"create_p50_ms": median(&creates), "create_samples": creates,
               "first_execute_p50_ms": median(&first_runs), "first_execute_samples": first_runs}),
    );
    for (case, rounds) in [
        (&IDLE, opts.hibernate_rounds),
        (&LARGE, opts.hibernate_large_rounds),
    ] {
        let value = measure_case(server, case, rounds, hibernate_dir, audit_log, long).await?;
        results.set("hibernate", case.name, value);
    }
    Ok(())
}

/// `rounds` of hibernate and resume of one kernel set up with `case`.
async fn measure_case(
    server: &Server,
    case: &Case,
    rounds: usize,
    hibernate_dir: &Path,
    audit_log: &Path,
    long: Duration,
) -> Result<Value> {
    let runtime_dir = server.runtime_dir.clone().context("not a Kernelgate")?;
    pool_ready(server, 1, long).await?;
    let id = server.create_kernel(None).await?;
    let t0 = Instant::now();
    run(server, &id, case.setup, "").await?;
    log(format!(
        "hibernate {}: set up in {:.0} ms",
        case.name,
        ms(t0.elapsed())
    ));
    let mut running = Vec::new();
    for i in 0..2 * RUNNING_SAMPLES {
        let took = run(server, &id, case.check, case.prints).await?;
        if i >= RUNNING_SAMPLES {
            running.push(ms(took));
        }
    }
    let (mut hibernates, mut resumes) = (Vec::new(), Vec::new());
    let (mut tar_bytes, mut before, mut before_anon, mut after) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut from_pool = 0;
    for i in 0..rounds {
        // The kernel and one warm kernel, quiet.
        pool_ready(server, 2, long).await?;
        let mine = container_of(&id)?.context("the running kernel has no container")?;
        let warm: Vec<String> = containers(&runtime_dir)?
            .into_iter()
            .filter(|c| *c != mine)
            .collect();
        let (used, anon) = memory(&mine)?;
        let t0 = Instant::now();
        hibernate(server, &id).await?;
        let hibernated = ms(t0.elapsed());
        let tar = std::fs::metadata(hibernate_dir.join(&id).join("state.tar"))
            .map(|m| m.len())
            .context("state.tar after the hibernation")?;
        // The container is gone: none of its memory is left to read.
        let left = match container_of(&id)? {
            None => 0,
            Some(c) => memory(&c)?.0,
        };
        let t1 = Instant::now();
        run(server, &id, case.check, case.prints).await?;
        let resumed = ms(t1.elapsed());
        let pooled = renamed(&id).await?.is_some_and(|c| warm.contains(&c));
        from_pool += usize::from(pooled);
        log(format!(
            "hibernate {} {i}: hibernate {hibernated:.0} ms, resume {resumed:.0} ms{}; \
             state {:.1} MiB; container {:.1} MiB before (anon {:.1} MiB), {:.1} MiB after",
            case.name,
            if pooled { "" } else { " (not from the pool)" },
            mib(tar),
            mib(used),
            mib(anon),
            mib(left),
        ));
        hibernates.push(hibernated);
        resumes.push(resumed);
        tar_bytes.push(tar);
        before.push(used);
        before_anon.push(anon);
        after.push(left);
    }
    server.delete_kernel(&id).await?;
    let audited = |event: &str, field: &str| -> Result<Vec<u64>> {
        Ok(audit_records(audit_log, event, &id)?
            .iter()
            .filter_map(|r| r[field].as_u64())
            .collect())
    };
    let bytes = audited("kernel_hibernated", "bytes")?;
    let median_u64 = |v: &[u64]| median(&v.iter().map(|&b| b as f64).collect::<Vec<_>>());
    Ok(json!({
        "rounds": rounds,
        "from_pool": from_pool,
        "hibernate_ms": {"p50": percentile(&hibernates, 50.0),
                         "p90": percentile(&hibernates, 90.0), "samples": hibernates},
        "resume_ms": {"p50": percentile(&resumes, 50.0),
                      "p90": percentile(&resumes, 90.0), "samples": resumes},
        "running_ms": {"p50": percentile(&running, 50.0), "samples": running},
        "state_bytes": {"median": median_u64(&bytes), "audited": bytes,
                        "state_tar": tar_bytes},
        "memory_bytes": {"before": median_u64(&before), "after": median_u64(&after),
                         "before_anon": median_u64(&before_anon),
                         "before_samples": before, "after_samples": after},
        "gateway_ms": {"hibernate": audited("kernel_hibernated", "took_ms")?,
                       "resume": audited("kernel_resumed", "took_ms")?},
    }))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Waits until the warm pool is filled (`GET /readyz`) and the gateway's `containers` are
/// quiet, so what comes next takes a warm kernel that finished importing.
async fn pool_ready(server: &Server, containers: usize, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let r = server
            .client()
            .send_any(server.client().request(Method::GET, "/readyz"))
            .await?;
        let ready: Value = r.json().await.unwrap_or(Value::Null);
        if ready["pool"]["state"] == "filled" {
            break;
        }
        if Instant::now() > deadline {
            bail!("the warm pool was not filled within {timeout:?}: {ready}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if let Err(e) = procs::settle(server, containers, timeout).await {
        log(format!("{e:#}"));
    }
    Ok(())
}

/// Runs `code` through the agent API; how long the answer took. Fails unless it ran and
/// printed `prints` (anything, when empty).
pub(crate) async fn run(server: &Server, id: &str, code: &str, prints: &str) -> Result<Duration> {
    let body = ExecuteBody {
        code: code.into(),
        ..ExecuteBody::default()
    };
    let t0 = Instant::now();
    let answer = server.client().execute(id, &body).await?;
    let took = t0.elapsed();
    if answer.status != Status::Ok || (!prints.is_empty() && answer.stdout != prints) {
        bail!("{code:?} answered {answer:?}");
    }
    Ok(took)
}

/// `POST /api/kernels/{id}/hibernate`; fails unless the kernel hibernated.
pub(crate) async fn hibernate(server: &Server, id: &str) -> Result<()> {
    let request = server
        .client()
        .request(Method::POST, &format!("/api/kernels/{id}/hibernate"))
        .timeout(Duration::from_secs(180));
    let r = server.client().send_any(request).await?;
    let status = r.status();
    let model: Value = r.json().await.unwrap_or(Value::Null);
    if status != 200 || model["hibernated"] != true {
        bail!("hibernate answered {status}: {model}");
    }
    Ok(())
}

/// The container (full id) that runs kernel `id` now: the gateway names it after the
/// kernel, a warm one once it is handed out. `None` when there is none.
fn container_of(id: &str) -> Result<Option<String>> {
    let out = std::process::Command::new("docker")
        .args(["ps", "-q", "--no-trunc", "--filter"])
        .arg(format!("name=^kernelgate-{id}$"))
        .output()?;
    if !out.status.success() {
        bail!("docker ps: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .map(str::to_owned))
}

/// The container of kernel `id` once the gateway renamed the one it resumed into after it
/// (the answer to the execute that woke it can come first); `None` after 5 s.
async fn renamed(id: &str) -> Result<Option<String>> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let found = container_of(id)?;
        if found.is_some() || Instant::now() > deadline {
            return Ok(found);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A container's memory use in bytes, from its cgroup: everything charged to it (cgroup
/// v1 `memory.usage_in_bytes`, v2 `memory.current`, page cache and tmpfs included) and its
/// anonymous memory alone (`memory.stat`).
fn memory(container: &str) -> Result<(u64, u64)> {
    let (_, used) = kernelgate_tests::cgroup_read(
        container,
        ("memory", "memory.usage_in_bytes"),
        "memory.current",
    )?;
    let (version, stat) =
        kernelgate_tests::cgroup_read(container, ("memory", "memory.stat"), "memory.stat")?;
    let key = match version {
        kernelgate_tests::CgroupVersion::V1 => "total_rss",
        kernelgate_tests::CgroupVersion::V2 => "anon",
    };
    let anon = stat
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
        .with_context(|| format!("{key} in the cgroup's memory.stat"))?;
    Ok((
        used.trim().parse().context("the cgroup's memory use")?,
        anon,
    ))
}

/// The audit records `event` of kernel `id`.
fn audit_records(audit_log: &Path, event: &str, id: &str) -> Result<Vec<Value>> {
    Ok(kernelgate_tests::audit_values(audit_log)
        .with_context(|| format!("reading {}", audit_log.display()))?
        .into_iter()
        .filter(|r| r["event"] == event && r["kernel"] == id)
        .collect())
}
