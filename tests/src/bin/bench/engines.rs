//! The engines side by side: Kernelgate with its kernels as Docker containers under runc,
//! as Docker containers under gVisor (`--runtime runsc`), and as runsc sandboxes it runs
//! itself (`--engine gvisor`, images from the image store, no Docker), once with kernels
//! started from the engine's template (the default) and once booted
//! (`--kernel-templates false`), in the same alternating rounds: cold create, the first
//! `import numpy, pandas, matplotlib.pyplot` in that kernel, `1+1` p50 and a 20 MiB
//! stream. Then, side after side in each round, the memory ten idle kernels are charged
//! on the host (their cgroups' `memory.usage_in_bytes`, which holds gVisor's sentry and
//! gofer as well as the kernel). Ratios are taken within a round against Docker+gVisor,
//! the engine's goal being no worse on every row. Hibernation by engine follows, on the
//! same gateways (checkpoint.rs), then snapshots and forks (snapshots.rs).

use crate::conn::Conn;
use crate::procs::{Paths, Server};
use crate::stats::{median, ms, percentile};
use crate::walls::{gvisor_registered, spread};
use crate::{checkpoint, snapshots};
use crate::{log, stop_and_check, stream_code, Opts, Results};
use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The sides, in table order; the ratios are against `docker-runsc`. `engine-gvisor`
/// starts kernels from its template (the default), `engine-boot` boots each.
pub const SIDES: [&str; 4] = [
    "docker-runc",
    "docker-runsc",
    "engine-gvisor",
    "engine-boot",
];
const N: usize = SIDES.len();
const BASE: usize = 1;

/// Rounds at least, whatever `--rounds` says.
const MIN_ROUNDS: usize = 5;
/// Idle kernels whose memory is measured, per side and round.
const IDLE: usize = 10;
const STREAM_MIB: usize = 20;
const IMPORTS: &str = "import numpy, pandas, matplotlib.pyplot";

/// Per round and side.
#[derive(Default, Clone, Copy)]
struct Round {
    create_ms: f64,
    imports_ms: f64,
    rt_ms: f64,
    stream_mib_s: f64,
    idle_mib: f64,
}

pub async fn compare(opts: &Opts, paths: &Paths, results: &mut Results) -> Result<()> {
    if !gvisor_registered() {
        log("gVisor is not set up (`make gvisor`): no comparison of the engines");
        results.set("engines", "skipped", json!("gVisor is not set up"));
        return Ok(());
    }
    let store = fill_store(paths)?;
    let store_arg = store.display().to_string();
    let long = Duration::from_secs(300);
    let rounds = opts.rounds.max(MIN_ROUNDS);
    let max = (IDLE + 4).to_string();
    let mut servers = Vec::new();
    let mut hibernate_dirs = Vec::new();
    for side in SIDES {
        let flags: Vec<&str> = match side {
            "docker-runc" => vec!["--runtime", "runc"],
            "docker-runsc" => vec!["--runtime", "runsc"],
            "engine-gvisor" => vec!["--engine", "gvisor", "--image-store", &store_arg],
            _ => vec![
                "--engine",
                "gvisor",
                "--image-store",
                &store_arg,
                "--kernel-templates",
                "false",
            ],
        };
        let dir = paths.work.join(format!("hibernated-{side}"));
        let dir_arg = dir.display().to_string();
        let mut flags = flags;
        flags.extend(["--max-kernels", &max, "--kernel-memory-mb", "1024"]);
        flags.extend(["--hibernate-dir", &dir_arg, "--hibernate-after", "0"]);
        servers.push(Server::kernelgate(paths, 0, &flags).await?);
        hibernate_dirs.push(dir);
    }
    let measured = async {
        template_made(&hibernate_dirs[2], long).await?;
        let per_round = measure(opts, &servers, rounds, long).await?;
        let checkpoints = checkpoint::measure(&servers, &SIDES, &hibernate_dirs, rounds).await?;
        let snapshots = snapshots::measure(&servers, &SIDES, rounds).await?;
        anyhow::Ok((per_round, checkpoints, snapshots))
    }
    .await;
    for (server, side) in servers.into_iter().zip(SIDES) {
        if let Err(e) = stop_and_check(server).await {
            log(format!("stopping {side}: {e:#}"));
        }
    }
    for dir in &hibernate_dirs {
        let _ = std::fs::remove_dir_all(dir);
    }
    let (per_round, checkpoints, snapshots) = measured?;
    store_results(results, &per_round, rounds, opts);
    results.set("engines", "checkpoint", checkpoints);
    results.set("engines", "snapshots", snapshots);
    Ok(())
}

/// Waits until the engine's template is on disk: kernels start from it from then on.
async fn template_made(hibernate_dir: &Path, long: Duration) -> Result<()> {
    let templates = hibernate_dir.join("templates");
    let deadline = Instant::now() + long;
    loop {
        let made = std::fs::read_dir(&templates).ok().is_some_and(|entries| {
            entries
                .filter_map(|e| e.ok())
                .any(|e| e.path().join("memory/checkpoint.json").is_file())
        });
        if made {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the engine made no kernel template within {long:?} (in {})",
            templates.display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn measure(
    opts: &Opts,
    servers: &[Server],
    rounds: usize,
    long: Duration,
) -> Result<Vec<[Round; N]>> {
    let mut kept = Vec::new();
    for server in servers {
        let id = server.create_kernel(None).await?;
        let mut c = Conn::websocket(&server.base, &server.token, &id).await?;
        c.kernel_info(long).await?;
        c.wait_iopub(long).await?;
        c.execute("1+1", long).await?;
        kept.push(c);
    }
    let code = stream_code(STREAM_MIB * 16);
    let mut per_round = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let mut r = [Round::default(); N];
        for (s, server) in servers.iter().enumerate() {
            let t0 = Instant::now();
            let id = server.create_kernel(None).await?;
            let mut c = Conn::websocket(&server.base, &server.token, &id).await?;
            c.kernel_info(long).await?;
            r[s].create_ms = ms(t0.elapsed());
            c.wait_iopub(long).await?;
            r[s].imports_ms = ms(c.execute(IMPORTS, long).await?.elapsed);
            c.close().await;
            server.delete_kernel(&id).await?;
        }
        for (s, c) in kept.iter_mut().enumerate() {
            for _ in 0..20 {
                c.execute("1+1", long).await?;
            }
            let mut samples = Vec::with_capacity(opts.rt_runs);
            for _ in 0..opts.rt_runs {
                samples.push(ms(c.execute("1+1", long).await?.elapsed));
            }
            r[s].rt_ms = percentile(&samples, 50.0);
        }
        for (s, c) in kept.iter_mut().enumerate() {
            let run = c.execute(&code, long).await?;
            r[s].stream_mib_s = STREAM_MIB as f64 / run.elapsed.as_secs_f64();
        }
        for (s, server) in servers.iter().enumerate() {
            r[s].idle_mib = idle_memory(server, SIDES[s]).await?;
        }
        for (s, side) in SIDES.iter().enumerate() {
            log(format!(
                "engines round {round} {side}: create {:.0} ms, imports {:.0} ms, 1+1 p50 {:.3} ms, \
                 stream {:.1} MiB/s, idle kernel {:.1} MiB",
                r[s].create_ms, r[s].imports_ms, r[s].rt_ms, r[s].stream_mib_s, r[s].idle_mib
            ));
        }
        per_round.push(r);
    }
    for c in kept {
        c.close().await;
    }
    Ok(per_round)
}

/// Starts `IDLE` kernels on `server`, lets them settle, and returns the memory their
/// cgroups are charged per kernel (MiB, median), then deletes them.
async fn idle_memory(server: &Server, side: &str) -> Result<f64> {
    let mut ids = Vec::new();
    for _ in 0..IDLE {
        ids.push(server.create_kernel(None).await?);
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let runtime_dir = server.runtime_dir.clone().context("a Kernelgate")?;
    let charged = if side.starts_with("engine") {
        sandbox_memory(&runtime_dir)?
    } else {
        container_memory(&runtime_dir)?
    };
    for id in &ids {
        server.delete_kernel(id).await?;
    }
    // The kernel kept for the round trips is among them: IDLE + 1 in all.
    ensure!(
        charged.len() == IDLE + 1,
        "{side}: {} cgroups for {} kernels",
        charged.len(),
        IDLE + 1
    );
    Ok(median(&charged) / f64::from(1 << 20))
}

/// The memory charged to each Docker container of the gateway on `runtime_dir`, in bytes.
pub(crate) fn container_memory(runtime_dir: &Path) -> Result<Vec<f64>> {
    let filter = format!("label=org.kernelgate.runtime_dir={}", runtime_dir.display());
    let out = Command::new("docker")
        .args(["ps", "-q", "--no-trunc", "--filter", &filter])
        .output()?;
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(|id| charged(&cgroup_dir(id)?))
        .collect()
}

/// The memory charged to each runsc sandbox of the gateway on `runtime_dir`, in bytes.
pub(crate) fn sandbox_memory(runtime_dir: &Path) -> Result<Vec<f64>> {
    let out = Command::new(kernelgate_tests::engine::runsc())
        .arg("--root")
        .arg(runtime_dir.join("gvisor/root"))
        .args(["list", "-format=json"])
        .output()?;
    let listed: Value = serde_json::from_slice(&out.stdout).context("runsc list")?;
    listed
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["id"].as_str())
        .map(|id| charged(&cgroup_dir(id)?))
        .collect()
}

/// The memory cgroup (v1) named `id`, wherever its engine placed it.
fn cgroup_dir(id: &str) -> Result<PathBuf> {
    fn find(dir: &Path, name: &str, depth: usize) -> Option<PathBuf> {
        let entries = std::fs::read_dir(dir).ok()?;
        let subdirs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
            .map(|e| e.path())
            .collect();
        if let Some(hit) = subdirs
            .iter()
            .find(|p| p.file_name().is_some_and(|n| n == name))
        {
            return Some(hit.clone());
        }
        if depth == 0 {
            return None;
        }
        subdirs.iter().find_map(|p| find(p, name, depth - 1))
    }
    find(Path::new("/sys/fs/cgroup/memory"), id, 3)
        .with_context(|| format!("no memory cgroup named {id} (cgroup v1 is what this measures)"))
}

fn charged(dir: &Path) -> Result<f64> {
    let text = std::fs::read_to_string(dir.join("memory.usage_in_bytes"))?;
    Ok(text.trim().parse::<f64>()?)
}

/// An image store under the scratch directory holding the kernel image: saved from Docker
/// and brought in with `kernelgate image import`, as an operator fills a Docker-less host.
fn fill_store(paths: &Paths) -> Result<PathBuf> {
    let store = paths.work.join("images");
    let archive = paths.work.join("kernel-image.tar");
    let saved = Command::new("docker")
        .args(["save", "-o"])
        .arg(&archive)
        .arg(&paths.image)
        .status()?;
    ensure!(saved.success(), "docker save {}", paths.image);
    let imported = Command::new(&paths.kernelgate)
        .arg("image")
        .arg("--image-store")
        .arg(&store)
        .arg("import")
        .arg(&archive)
        .output()?;
    ensure!(
        imported.status.success(),
        "kernelgate image import: {}",
        String::from_utf8_lossy(&imported.stderr)
    );
    std::fs::remove_file(&archive)?;
    Ok(store)
}

type Metric = (&'static str, fn(&Round) -> f64);

fn store_results(results: &mut Results, per_round: &[[Round; N]], rounds: usize, opts: &Opts) {
    let metrics: [Metric; 5] = [
        ("create_ms", |r| r.create_ms),
        ("imports_ms", |r| r.imports_ms),
        ("rt_ms", |r| r.rt_ms),
        ("stream_mib_s", |r| r.stream_mib_s),
        ("idle_mib", |r| r.idle_mib),
    ];
    for (s, side) in SIDES.iter().enumerate() {
        let mut entry = serde_json::Map::new();
        for (name, f) in metrics {
            let values: Vec<f64> = per_round.iter().map(|r| f(&r[s])).collect();
            let ratios: Vec<f64> = per_round.iter().map(|r| f(&r[s]) / f(&r[BASE])).collect();
            entry.insert(
                name.to_owned(),
                json!({"median": median(&values), "rounds": values,
                       "ratio": spread(&ratios), "against": SIDES[BASE]}),
            );
        }
        results.set("engines", side, Value::Object(entry));
    }
    results.set(
        "engines",
        "settings",
        json!({"rounds": rounds, "rt_runs": opts.rt_runs, "stream_mib": STREAM_MIB,
               "idle_kernels": IDLE, "kernel_memory_mb": 1024}),
    );
}
