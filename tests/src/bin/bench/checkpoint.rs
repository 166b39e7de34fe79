//! Hibernation by engine, on the engines comparison's gateways: Python-level under
//! Docker+runc and Docker+gVisor (the kernel's variables pickled, its home taken out, a warm
//! or new container on resume), the whole kernel checkpointed and restored under the gVisor
//! engine. Each round, side after side: a kernel holding a 100 MiB array and a 1M-row
//! DataFrame is hibernated (`POST .../hibernate`, timed), its state's size on disk read,
//! and resumed by the execute that reads it back (timed, output checked). Then, once per
//! side, ten idle kernels: the memory their cgroups are charged running, and hibernated
//! (their sandboxes gone: nothing), and their states' size on disk.

use crate::engines::{container_memory, sandbox_memory};
use crate::hibernate::{hibernate, run, LARGE};
use crate::log;
use crate::procs::Server;
use crate::stats::{median, ms};
use crate::walls::spread;
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::path::Path;
use std::time::Instant;

/// The sides measured, by index into the engines' sides, and what each hibernation keeps.
pub const SIDES: [(usize, &str); 3] = [(0, "namespace"), (1, "namespace"), (2, "memory")];
/// The side the ratios are against: Docker+gVisor.
const BASE: usize = 1;
const IDLE: usize = 10;

/// The bytes of the files under `dir`.
fn size_of(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => size_of(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

/// The memory (bytes) charged to every kernel of `server` now.
fn charged(server: &Server, engine: bool) -> Result<f64> {
    let runtime_dir = server.runtime_dir.clone().context("a Kernelgate")?;
    let each = if engine {
        sandbox_memory(&runtime_dir)?
    } else {
        container_memory(&runtime_dir)?
    };
    Ok(each.iter().sum())
}

const MIB: f64 = (1 << 20) as f64;

/// Per round and side: hibernate (ms), resume (ms), state (MiB).
type Round = [(f64, f64, f64); 3];

pub async fn measure(
    servers: &[Server],
    names: &[&str],
    hibernate_dirs: &[std::path::PathBuf],
    rounds: usize,
) -> Result<Value> {
    let mut per_round: Vec<Round> = Vec::new();
    for round in 0..rounds {
        let mut r: Round = [(0.0, 0.0, 0.0); 3];
        for (k, &(s, _)) in SIDES.iter().enumerate() {
            let server = &servers[s];
            let id = server.create_kernel(None).await?;
            run(server, &id, LARGE.setup, "").await?;
            run(server, &id, LARGE.check, LARGE.prints).await?;
            let t0 = Instant::now();
            hibernate(server, &id).await?;
            let hibernated = ms(t0.elapsed());
            let state = size_of(&hibernate_dirs[s].join(&id)) as f64 / MIB;
            let t1 = Instant::now();
            run(server, &id, LARGE.check, LARGE.prints).await?;
            let resumed = ms(t1.elapsed());
            server.delete_kernel(&id).await?;
            log(format!(
                "checkpoint round {round} {}: hibernate {hibernated:.0} ms, resume {resumed:.0} ms, state {state:.1} MiB",
                names[s]
            ));
            r[k] = (hibernated, resumed, state);
        }
        per_round.push(r);
    }
    let mut out = serde_json::Map::new();
    for (k, &(s, kind)) in SIDES.iter().enumerate() {
        let metric = |f: fn(&(f64, f64, f64)) -> f64| {
            let values: Vec<f64> = per_round.iter().map(|r| f(&r[k])).collect();
            let ratios: Vec<f64> = per_round.iter().map(|r| f(&r[k]) / f(&r[BASE])).collect();
            json!({"median": median(&values), "rounds": values, "ratio": spread(&ratios),
                   "against": names[SIDES[BASE].0]})
        };
        let idle = idle_kernels(&servers[s], names[s], s == 2, &hibernate_dirs[s]).await?;
        out.insert(
            names[s].to_owned(),
            json!({"kind": kind, "hibernate_ms": metric(|r| r.0), "resume_ms": metric(|r| r.1),
                   "state_mib": metric(|r| r.2), "idle": idle}),
        );
    }
    out.insert(
        "settings".to_owned(),
        json!({"rounds": rounds, "idle_kernels": IDLE, "case": LARGE.setup}),
    );
    Ok(Value::Object(out))
}

/// Ten idle kernels of `server`: the memory charged per kernel while they run and once
/// they hibernate, and their states' size on disk (MiB per kernel).
async fn idle_kernels(server: &Server, side: &str, engine: bool, dir: &Path) -> Result<Value> {
    let before = charged(server, engine)?;
    let mut ids = Vec::new();
    for _ in 0..IDLE {
        let id = server.create_kernel(None).await?;
        run(server, &id, "x = 1", "").await?;
        ids.push(id);
    }
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    let running = (charged(server, engine)? - before) / IDLE as f64 / MIB;
    for id in &ids {
        hibernate(server, id).await?;
    }
    let hibernated = ((charged(server, engine)? - before) / IDLE as f64 / MIB).max(0.0);
    let disk: u64 = ids.iter().map(|id| size_of(&dir.join(id))).sum();
    let disk = disk as f64 / IDLE as f64 / MIB;
    log(format!(
        "checkpoint {side}: {IDLE} idle kernels, {running:.1} MiB each running, {hibernated:.1} MiB hibernated, {disk:.1} MiB on disk each"
    ));
    for id in &ids {
        server.delete_kernel(id).await?;
    }
    Ok(json!({"running_mib": running, "hibernated_mib": hibernated, "disk_mib": disk}))
}
