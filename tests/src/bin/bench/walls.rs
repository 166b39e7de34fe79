//! The walls side by side, in the same alternating rounds: a client speaking ZeroMQ straight
//! to a local ipykernel (direct, no wall), and Kernelgate with its kernels under runc, under
//! gVisor on Debian's runsc and the ptrace platform (`kernelgate-runsc-ptrace`), and under
//! gVisor as `make gvisor` chose it (`kernelgate-runsc`: the newer runsc, systrap where it
//! works). Every round measures every wall once, one after the other, so load on the
//! machine hits them alike; each ratio is taken within a round and reported as the median
//! of the rounds with its min-max.

use crate::conn::Conn;
use crate::procs::{DirectKernel, Paths, Server};
use crate::stats::{median, ms, percentile};
use crate::{log, stop_and_check, stream_code, Opts, Results};
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The walls, in table order: `direct`, then each `--runtime` the gateway takes.
pub const WALLS: [&str; 4] = ["direct", "runc", "runsc-ptrace", "runsc"];

/// The Kernelgate runtimes restarts and creates are compared under.
pub const RUNTIMES: [&str; 2] = ["runc", "runsc"];

/// At least this many rounds, whatever `--rounds` says: fewer give no spread worth reading.
const MIN_ROUNDS: usize = 5;

const IMPORTS: &str = "import numpy, pandas, matplotlib.pyplot";

/// Whether the Docker engine has both gVisor runtimes registered (`make gvisor`).
pub fn gvisor_registered() -> bool {
    let registered = registered_runtimes();
    ["kernelgate-runsc", "kernelgate-runsc-ptrace"]
        .iter()
        .all(|name| registered.get(name).is_some())
}

/// What `make gvisor` registered, as the engine reports it: path and arguments per runtime.
fn registered_runtimes() -> Value {
    std::process::Command::new("docker")
        .args(["info", "--format", "{{json .Runtimes}}"])
        .output()
        .ok()
        .and_then(|o| serde_json::from_slice(&o.stdout).ok())
        .unwrap_or(Value::Null)
}

/// One wall's kernels: a gateway (none for direct) and the connections of its kernels.
struct Wall {
    name: &'static str,
    server: Option<Server>,
    conns: Vec<Conn>,
    direct: Vec<DirectKernel>,
}

impl Wall {
    /// Starts one kernel and connects to it; for direct, a local ipykernel numbered `n`.
    /// Also returns the gateway's kernel id.
    async fn start_kernel(
        &mut self,
        paths: &Paths,
        n: usize,
        long: Duration,
    ) -> Result<(Conn, Option<String>)> {
        match &self.server {
            Some(server) => {
                let id = server.create_kernel(None).await?;
                let mut c = Conn::websocket(&server.base, &server.token, &id).await?;
                c.kernel_info(long).await?;
                Ok((c, Some(id)))
            }
            None => {
                let k = DirectKernel::spawn(paths, n)?;
                let mut c = Conn::zmq(&k.info, long).await?;
                c.kernel_info(long).await?;
                self.direct.push(k);
                Ok((c, None))
            }
        }
    }

    /// Ends a kernel `start_kernel` made for one round.
    async fn drop_kernel(&mut self, c: Conn, id: Option<String>) -> Result<()> {
        c.close().await;
        match (&self.server, id) {
            (Some(server), Some(id)) => server.delete_kernel(&id).await,
            _ => {
                self.direct.pop();
                Ok(())
            }
        }
    }
}

/// Per round and wall: cold create, first import of the scientific stack, `1+1` p50,
/// stream rate, parallel executes per second.
#[derive(Default, Clone, Copy)]
struct Round {
    create_ms: f64,
    imports_ms: f64,
    rt_ms: f64,
    stream_mib_s: f64,
    parallel_s: f64,
}

pub async fn compare(opts: &Opts, paths: &Paths, results: &mut Results) -> Result<()> {
    if !gvisor_registered() {
        log("gVisor is not set up (`make gvisor`): no comparison of the walls");
        results.set("walls", "skipped", json!("gVisor is not registered"));
        return Ok(());
    }
    let long = Duration::from_secs(180);
    let rounds = opts.rounds.max(MIN_ROUNDS);
    let mut walls = Vec::new();
    for name in WALLS {
        let server = match name {
            "direct" => None,
            runtime => Some(
                Server::kernelgate(paths, 0, &["--runtime", runtime, "--max-kernels", "64"])
                    .await?,
            ),
        };
        walls.push(Wall {
            name,
            server,
            conns: vec![],
            direct: vec![],
        });
    }
    let measured = measure(opts, paths, &mut walls, rounds, long).await;
    for mut wall in walls {
        for c in wall.conns.drain(..) {
            c.close().await;
        }
        wall.direct.clear();
        if let Some(s) = wall.server.take() {
            if let Err(e) = stop_and_check(s).await {
                log(format!("stopping {}: {e:#}", wall.name));
            }
        }
    }
    let per_round = measured?;
    store(opts, results, &per_round, rounds);
    Ok(())
}

async fn measure(
    opts: &Opts,
    paths: &Paths,
    walls: &mut [Wall],
    rounds: usize,
    long: Duration,
) -> Result<Vec<[Round; 4]>> {
    // The kernels that stay: the first for the round trip and the stream, all of them for
    // the parallel executes. Started wall by wall, kernel by kernel, alternating.
    for i in 0..opts.parallel_kernels {
        for wall in walls.iter_mut() {
            let (mut c, _) = wall.start_kernel(paths, 2000 + i, long).await?;
            c.wait_iopub(long).await?;
            c.execute("1+1", long).await?;
            wall.conns.push(c);
        }
    }
    let code = stream_code(opts.stream_mib * 16);
    let mut per_round = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let mut r = [Round::default(); 4];
        // Cold create, then the first import of the scientific stack in that new kernel.
        for (w, wall) in walls.iter_mut().enumerate() {
            let t0 = Instant::now();
            let (mut c, id) = wall.start_kernel(paths, 3000 + round, long).await?;
            r[w].create_ms = ms(t0.elapsed());
            c.wait_iopub(long).await?;
            r[w].imports_ms = ms(c.execute(IMPORTS, long).await?.elapsed);
            wall.drop_kernel(c, id).await?;
        }
        for (w, wall) in walls.iter_mut().enumerate() {
            let c = wall.conns.first_mut().context("a kernel")?;
            for _ in 0..20 {
                c.execute("1+1", long).await?;
            }
            let mut samples = Vec::with_capacity(opts.rt_runs);
            for _ in 0..opts.rt_runs {
                samples.push(ms(c.execute("1+1", long).await?.elapsed));
            }
            r[w].rt_ms = percentile(&samples, 50.0);
        }
        for (w, wall) in walls.iter_mut().enumerate() {
            let c = wall.conns.first_mut().context("a kernel")?;
            let run = c.execute(&code, long).await?;
            r[w].stream_mib_s = opts.stream_mib as f64 / run.elapsed.as_secs_f64();
        }
        for (w, wall) in walls.iter_mut().enumerate() {
            let (executes, secs) = parallel(&mut wall.conns, opts.parallel_for, long).await?;
            r[w].parallel_s = executes as f64 / secs;
        }
        for (w, wall) in walls.iter().enumerate() {
            log(format!(
                "walls round {round} {}: create {:.0} ms, imports {:.0} ms, 1+1 p50 {:.3} ms, \
                 stream {:.1} MiB/s, parallel {:.0}/s",
                wall.name,
                r[w].create_ms,
                r[w].imports_ms,
                r[w].rt_ms,
                r[w].stream_mib_s,
                r[w].parallel_s
            ));
        }
        per_round.push(r);
    }
    Ok(per_round)
}

/// Every connection runs `1+1` in a loop for `span`: the executes done and the seconds
/// they took.
pub async fn parallel(conns: &mut [Conn], span: Duration, long: Duration) -> Result<(u64, f64)> {
    let t0 = Instant::now();
    let deadline = t0 + span;
    let counts = futures::future::join_all(conns.iter_mut().map(|c| async move {
        let mut n = 0u64;
        while Instant::now() < deadline {
            c.execute("1+1", long).await?;
            n += 1;
        }
        Ok::<_, anyhow::Error>(n)
    }))
    .await;
    let mut total = 0;
    for c in counts {
        total += c?;
    }
    Ok((total, t0.elapsed().as_secs_f64()))
}

/// The median and min-max of per-round ratios.
pub fn spread(ratios: &[f64]) -> Value {
    let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let max = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    json!({"median": median(ratios), "min": min, "max": max, "rounds": ratios})
}

/// A measure's name, how to read it from a round, and the wall its ratios are against.
type Metric = (&'static str, fn(&Round) -> f64, usize);

fn store(opts: &Opts, results: &mut Results, per_round: &[[Round; 4]], rounds: usize) {
    let field = |w: usize, f: fn(&Round) -> f64| -> Vec<f64> {
        per_round.iter().map(|r| f(&r[w])).collect()
    };
    let ratio = |w: usize, base: usize, f: fn(&Round) -> f64| -> Vec<f64> {
        per_round.iter().map(|r| f(&r[w]) / f(&r[base])).collect()
    };
    let metrics: [Metric; 5] = [
        ("create_ms", |r| r.create_ms, 1),
        ("imports_ms", |r| r.imports_ms, 1),
        ("rt_ms", |r| r.rt_ms, 0),
        ("stream_mib_s", |r| r.stream_mib_s, 0),
        ("parallel_s", |r| r.parallel_s, 0),
    ];
    for (w, wall) in WALLS.iter().enumerate() {
        let mut entry = serde_json::Map::new();
        for (name, f, base) in metrics {
            entry.insert(
                name.to_owned(),
                json!({
                    "median": median(&field(w, f)),
                    "rounds": field(w, f),
                    "ratio": spread(&ratio(w, base, f)),
                    "against": WALLS[base],
                }),
            );
        }
        results.set("walls", wall, Value::Object(entry));
    }
    results.set(
        "walls",
        "settings",
        json!({"rounds": rounds, "rt_runs": opts.rt_runs, "stream_mib": opts.stream_mib,
               "parallel_kernels": opts.parallel_kernels,
               "parallel_seconds": opts.parallel_for.as_secs_f64(),
               "engine": registered_runtimes()}),
    );
}
