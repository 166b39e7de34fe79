//! Two builds of the gateway side by side (`--versions-only --baseline-bin PATH`): a
//! baseline (an earlier commit's release build, `make bench-versions` builds it) and this
//! tree's, both under runc with the same flags, measured in the same alternating rounds as
//! the walls. Each round measures a create from the warm pool, a cold create, the `1+1`
//! round trip and a 20 MiB stream on both, one after the other; each ratio (this build over
//! the baseline) is taken within its round and reported as the median of the rounds with
//! its min-max. A restructuring that claims to change no behaviour shows here that it
//! changes no speed either.

use crate::conn::Conn;
use crate::procs::{Paths, Server};
use crate::stats::{median, ms, percentile};
use crate::walls::spread;
use crate::{log, stop_and_check, stream_code, Opts, Results};
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// The two builds, in table order.
pub const BUILDS: [&str; 2] = ["baseline", "current"];

/// At least this many rounds, whatever `--rounds` says.
const MIN_ROUNDS: usize = 5;

/// Per round and build.
#[derive(Default, Clone, Copy)]
struct Round {
    warm_create_ms: f64,
    cold_create_ms: f64,
    rt_ms: f64,
    stream_mib_s: f64,
}

/// A measure's name, how to read it from a round, and which way is better.
type Metric = (&'static str, fn(&Round) -> f64);

const METRICS: [Metric; 4] = [
    ("warm_create_ms", |r| r.warm_create_ms),
    ("cold_create_ms", |r| r.cold_create_ms),
    ("rt_ms", |r| r.rt_ms),
    ("stream_mib_s", |r| r.stream_mib_s),
];

pub async fn compare(
    opts: &Opts,
    paths: &Paths,
    baseline: &Path,
    results: &mut Results,
) -> Result<()> {
    let long = Duration::from_secs(180);
    let rounds = opts.rounds.max(MIN_ROUNDS);
    let flags = ["--runtime", "runc", "--max-kernels", "64"];
    let mut base_paths = paths.clone();
    base_paths.kernelgate = baseline.to_path_buf();
    let mut servers = Vec::new();
    for p in [&base_paths, paths] {
        servers.push(Server::kernelgate(p, 1, &flags).await?);
    }
    // `make bench-versions` names the commits; else what the binaries say of themselves.
    let versions: Vec<String> = [
        ("BENCH_BASELINE_REV", &base_paths),
        ("BENCH_CURRENT_REV", paths),
    ]
    .iter()
    .map(|(var, p)| std::env::var(var).unwrap_or_else(|_| version_of(&p.kernelgate)))
    .collect();
    let measured = measure(opts, &servers, rounds, long).await;
    for s in servers {
        if let Err(e) = stop_and_check(s).await {
            log(format!("stopping a gateway: {e:#}"));
        }
    }
    let per_round = measured?;
    for (b, build) in BUILDS.iter().enumerate() {
        let mut entry = serde_json::Map::new();
        for (name, f) in METRICS {
            let field: Vec<f64> = per_round.iter().map(|r| f(&r[b])).collect();
            let ratio: Vec<f64> = per_round.iter().map(|r| f(&r[b]) / f(&r[0])).collect();
            entry.insert(
                name.to_owned(),
                json!({"median": median(&field), "rounds": field, "ratio": spread(&ratio)}),
            );
        }
        entry.insert("version".to_owned(), json!(versions[b]));
        results.set("versions", build, Value::Object(entry));
    }
    results.set(
        "versions",
        "settings",
        json!({"rounds": rounds, "rt_runs": opts.rt_runs, "stream_mib": opts.stream_mib,
               "runtime": "runc", "pool_size": 1}),
    );
    Ok(())
}

async fn measure(
    opts: &Opts,
    servers: &[Server],
    rounds: usize,
    long: Duration,
) -> Result<Vec<[Round; 2]>> {
    // The kernel that stays, for the round trip and the stream.
    let mut conns = Vec::new();
    for s in servers {
        let id = s.create_kernel(None).await?;
        let mut c = Conn::websocket(&s.base, &s.token, &id).await?;
        c.kernel_info(long).await?;
        c.wait_iopub(long).await?;
        c.execute("1+1", long).await?;
        conns.push(c);
    }
    let code = stream_code(opts.stream_mib * 16);
    let mut per_round = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let mut r = [Round::default(); 2];
        for (b, s) in servers.iter().enumerate() {
            // The kernel that stays and a full pool of one, quiet.
            if let Err(e) = crate::procs::settle(s, 2, long).await {
                log(format!("versions round {round}: {e:#}"));
            }
            r[b].warm_create_ms = ms(timed_create(s, None, long).await?);
        }
        for (b, s) in servers.iter().enumerate() {
            // A `KERNEL_*` variable no warm kernel was given: a container of its own.
            let env = json!({"KERNEL_ROUND": round.to_string()});
            r[b].cold_create_ms = ms(timed_create(s, Some(env), long).await?);
        }
        for (b, c) in conns.iter_mut().enumerate() {
            for _ in 0..20 {
                c.execute("1+1", long).await?;
            }
            let mut samples = Vec::with_capacity(opts.rt_runs);
            for _ in 0..opts.rt_runs {
                samples.push(ms(c.execute("1+1", long).await?.elapsed));
            }
            r[b].rt_ms = percentile(&samples, 50.0);
        }
        for (b, c) in conns.iter_mut().enumerate() {
            let run = c.execute(&code, long).await?;
            r[b].stream_mib_s = opts.stream_mib as f64 / run.elapsed.as_secs_f64();
        }
        for (b, build) in BUILDS.iter().enumerate() {
            log(format!(
                "versions round {round} {build}: warm create {:.1} ms, cold create {:.0} ms, \
                 1+1 p50 {:.3} ms, stream {:.1} MiB/s",
                r[b].warm_create_ms, r[b].cold_create_ms, r[b].rt_ms, r[b].stream_mib_s
            ));
        }
        per_round.push(r);
    }
    for c in conns {
        c.close().await;
    }
    Ok(per_round)
}

/// Creates a kernel, waits until it answers `kernel_info`, deletes it: the time to the
/// answer.
async fn timed_create(s: &Server, env: Option<Value>, long: Duration) -> Result<Duration> {
    let t0 = Instant::now();
    let id = s.create_kernel(env).await?;
    let mut c = Conn::websocket(&s.base, &s.token, &id).await?;
    c.kernel_info(long).await?;
    let took = t0.elapsed();
    c.close().await;
    s.delete_kernel(&id).await.context("deleting a kernel")?;
    Ok(took)
}

/// What `kernelgate --version` says of a build.
fn version_of(bin: &Path) -> String {
    std::process::Command::new(bin)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}
