//! `make bench`: the same workload against Kernelgate, Jupyter Kernel Gateway 3 and a
//! client speaking ZeroMQ straight to an ipykernel, in one run on one machine; prints a
//! markdown table and writes it, with every sample, to JSON and markdown files.
//!
//! Usage: bench [--out FILE.json] [--md FILE.md] [--venv DIR] [--rounds N] [--pool-size N]
//!              [--idle-kernels N] [--quick] [--only SECTION] [--baseline-bin PATH]
//!              [--registry-nodes N,..] [--registry-kernels K,..] [--registry-window SECONDS]
//!
//! `--only` runs one section alone (its table, its samples): mcp, stages, walls, restart,
//! cluster, hibernate, packages, versions (with `--baseline-bin`), e2b, engines, registry.
//!
//! Kernelgate runs each kernel in a Docker container under runc (ipc sockets
//! bind-mounted), then, in a table of its own, under runc and both gVisor runtimes beside
//! the direct baseline (walls.rs); JKG and the direct baseline run local kernel processes. All three run the kernel image's own
//! launcher (kernel-image/launch.py) with the same ipykernel and matplotlib versions.

mod checkpoint;
mod cluster;
mod conn;
mod e2b;
mod engines;
mod hibernate;
mod mcp;
mod packages;
mod procs;
mod registry;
mod report;
mod restart;
mod snapshots;
mod stages;
mod stats;
mod versions;
mod walls;

use anyhow::{bail, Context, Result};
use conn::Conn;
use futures::StreamExt;
use kernelgate_tests::bench_report::Section;
use procs::{DirectKernel, Paths, Server};
use serde_json::{json, Map, Value};
use stats::{median, ms, percentile};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The three targets, in table order.
pub const SIDES: [&str; 3] = ["kernelgate", "jkg", "direct"];

#[derive(Debug, Clone)]
struct Opts {
    out: PathBuf,
    md: PathBuf,
    venv: PathBuf,
    rounds: usize,
    pool_size: usize,
    idle_kernels: usize,
    creates: usize,
    rt_runs: usize,
    stream_mib: usize,
    png_runs: usize,
    parallel_kernels: usize,
    parallel_for: Duration,
    /// Profiling aid: only stream through Kernelgate for this long, then stop.
    soak: Option<Duration>,
    /// One section of the bench alone (`--only NAME`).
    only: Option<Section>,
    baseline_bin: Option<PathBuf>,
    /// Hibernate-resume rounds of the kernel holding only `x = 1` (and warm creates).
    hibernate_rounds: usize,
    /// Hibernate-resume rounds of the kernel holding 100 MiB.
    hibernate_large_rounds: usize,
    /// Measure nothing: print the tables of this earlier run's samples.
    render: Option<PathBuf>,
    /// The registry's scale points (registry.rs).
    registry: registry::Points,
}

impl Opts {
    fn parse() -> Result<Opts> {
        let mut o = Opts {
            out: "bench-results.json".into(),
            md: "bench-results.md".into(),
            venv: ".venv-bench".into(),
            rounds: 3,
            pool_size: 2,
            idle_kernels: 50,
            creates: 10,
            rt_runs: 500,
            stream_mib: 20,
            png_runs: 5,
            parallel_kernels: 10,
            parallel_for: Duration::from_secs(10),
            soak: None,
            only: None,
            baseline_bin: None,
            hibernate_rounds: 10,
            hibernate_large_rounds: 5,
            render: None,
            registry: registry::Points::default(),
        };
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            let mut val = || args.next().with_context(|| format!("{a} needs a value"));
            match a.as_str() {
                "--out" => o.out = val()?.into(),
                "--md" => o.md = val()?.into(),
                "--venv" => o.venv = val()?.into(),
                "--rounds" => o.rounds = val()?.parse()?,
                "--pool-size" => o.pool_size = val()?.parse()?,
                "--idle-kernels" => o.idle_kernels = val()?.parse()?,
                "--soak" => o.soak = Some(Duration::from_secs(val()?.parse()?)),
                "--only" => o.only = Some(val()?.parse()?),
                "--baseline-bin" => o.baseline_bin = Some(val()?.into()),
                "--render" => o.render = Some(val()?.into()),
                "--registry-nodes" => o.registry.nodes = registry::Points::list(&val()?)?,
                "--registry-kernels" => o.registry.kernels = registry::Points::list(&val()?)?,
                "--registry-window" => o.registry.window = Duration::from_secs_f64(val()?.parse()?),
                "--quick" => {
                    // For trying the bench out, not for numbers.
                    o.rounds = 1;
                    o.creates = 3;
                    o.rt_runs = 100;
                    o.stream_mib = 4;
                    o.png_runs = 2;
                    o.parallel_kernels = 3;
                    o.parallel_for = Duration::from_secs(3);
                    o.idle_kernels = 5;
                    o.hibernate_rounds = 3;
                    o.hibernate_large_rounds = 2;
                    o.registry = registry::Points::quick();
                }
                "-h" | "--help" => {
                    println!("{}", USAGE);
                    std::process::exit(0);
                }
                other => bail!("unknown argument {other:?}\n{USAGE}"),
            }
        }
        if o.only == Some(Section::Versions) && o.baseline_bin.is_none() {
            bail!("--only versions needs --baseline-bin PATH (`make bench-versions` builds one)");
        }
        if o.pool_size == 0 || o.rounds == 0 || o.creates == 0 {
            bail!("--pool-size and --rounds must be at least 1");
        }
        Ok(o)
    }
}

const USAGE: &str = "usage: bench [--out FILE.json] [--md FILE.md] [--venv DIR] [--rounds N] \
                     [--pool-size N] [--idle-kernels N] [--quick] [--only SECTION] \
                     [--baseline-bin PATH (with --only versions)] [--render BENCH-RESULTS.json] \
                     [--registry-nodes N,..] [--registry-kernels K,..] [--registry-window SECONDS]\n\
                     sections: mcp stages walls restart cluster hibernate packages versions e2b engines \
                     registry";

/// One target's kernels and client connections during the run.
#[derive(Debug)]
struct Side {
    name: &'static str,
    server: Option<Server>,
    conns: Vec<Conn>,
    direct: Vec<DirectKernel>,
}

/// Everything measured, keyed by metric, then by side.
#[derive(Debug, Default)]
struct Results {
    metrics: Map<String, Value>,
}

impl Results {
    fn set(&mut self, metric: &str, side: &str, value: Value) {
        let entry = self
            .metrics
            .entry(metric.to_owned())
            .or_insert_with(|| json!({}));
        entry[side] = value;
    }
}

fn log(msg: impl AsRef<str>) {
    eprintln!("[bench] {}", msg.as_ref());
}

#[tokio::main]
async fn main() -> Result<()> {
    let opts = Opts::parse()?;
    if let Some(samples) = &opts.render {
        let doc: Value = serde_json::from_str(
            &std::fs::read_to_string(samples)
                .with_context(|| format!("reading {}", samples.display()))?,
        )
        .with_context(|| format!("{} is not a bench-results.json", samples.display()))?;
        println!("{}", report::markdown(&doc));
        return Ok(());
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .context("workspace root")?;
    let kernelgate = std::env::var("KERNELGATE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root.join("target/release/kernelgate"));
    if !kernelgate.exists() {
        bail!(
            "{} is missing: `cargo build --release -p kernelgate` first",
            kernelgate.display()
        );
    }
    let venv = if opts.venv.is_absolute() {
        opts.venv.clone()
    } else {
        std::env::current_dir()?.join(&opts.venv)
    };
    if opts.only.is_none() && !venv.join("bin/jupyter-kernelgateway").exists() {
        bail!(
            "{} has no jupyter-kernelgateway: `make bench` creates it",
            venv.display()
        );
    }
    let work = PathBuf::from(format!("/tmp/kgbench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let paths = Paths {
        root,
        venv,
        kernelgate,
        image: kernelgate_tests::image(),
        work: work.clone(),
    };
    let machine = report::machine(&paths).await;
    let started = Instant::now();
    let mut results = Results::default();
    let outcome = measure_all(&opts, &paths, &mut results).await;
    let elapsed = started.elapsed();
    let _ = std::fs::remove_dir_all(&work);
    outcome?;

    let doc = json!({
        "command": std::env::var("BENCH_COMMAND").unwrap_or_else(|_| "make bench".into()),
        "machine": machine,
        "load_after": report::loadavg(),
        "duration_s": elapsed.as_secs_f64(),
        "settings": {
            "rounds": opts.rounds, "pool_size": opts.pool_size, "creates": opts.creates,
            "rt_runs": opts.rt_runs, "stream_mib": opts.stream_mib, "png_runs": opts.png_runs,
            "parallel_kernels": opts.parallel_kernels,
            "parallel_seconds": opts.parallel_for.as_secs_f64(),
            "idle_kernels": opts.idle_kernels,
            "only": opts.only.map(Section::name),
            "hibernate_rounds": opts.hibernate_rounds,
            "hibernate_large_rounds": opts.hibernate_large_rounds,
        },
        "metrics": results.metrics,
    });
    let table = report::markdown(&doc);
    std::fs::write(&opts.out, serde_json::to_string_pretty(&doc)?)?;
    std::fs::write(&opts.md, &table)?;
    println!("{table}");
    log(format!(
        "wrote {} and {} in {:.0} s",
        opts.out.display(),
        opts.md.display(),
        elapsed.as_secs_f64()
    ));
    Ok(())
}

async fn measure_all(opts: &Opts, paths: &Paths, results: &mut Results) -> Result<()> {
    match (opts.only, &opts.baseline_bin) {
        (Some(Section::Mcp), _) => return mcp::compare(opts, paths, results).await,
        (Some(Section::Stages), _) => return stages::compare(opts, paths, results).await,
        (Some(Section::Walls), _) => return walls::compare(opts, paths, results).await,
        (Some(Section::Restart), _) => return restart::compare(opts, paths, results).await,
        (Some(Section::Cluster), _) => return cluster::compare(opts, paths, results).await,
        (Some(Section::Hibernate), _) => return hibernate::compare(opts, paths, results).await,
        (Some(Section::Packages), _) => return packages::compare(opts, paths, results).await,
        (Some(Section::Versions), Some(baseline)) => {
            return versions::compare(opts, paths, baseline, results).await
        }
        (Some(Section::Versions), None) => bail!("--only versions needs --baseline-bin PATH"),
        (Some(Section::E2b), _) => return e2b::compare(opts, paths, results).await,
        (Some(Section::Engines), _) => return engines::compare(opts, paths, results).await,
        (Some(Section::Registry), _) => return registry::compare(opts, &paths.work, results).await,
        (None, _) => {}
    }
    log(format!(
        "starting Kernelgate (warm pool {}) and JKG",
        opts.pool_size
    ));
    let kg = Server::kernelgate(
        paths,
        opts.pool_size,
        &["--max-kernels", "64", "--runtime", "runc"],
    )
    .await?;
    let jkg = Server::jkg(paths).await?;
    let mut sides = vec![
        Side {
            name: "kernelgate",
            server: Some(kg),
            conns: vec![],
            direct: vec![],
        },
        Side {
            name: "jkg",
            server: Some(jkg),
            conns: vec![],
            direct: vec![],
        },
        Side {
            name: "direct",
            server: None,
            conns: vec![],
            direct: vec![],
        },
    ];
    let measured = measure(opts, paths, &mut sides, results).await;
    for side in &mut sides {
        for c in side.conns.drain(..) {
            c.close().await;
        }
        side.direct.clear();
        if let Some(s) = side.server.take() {
            if let Err(e) = stop_and_check(s).await {
                log(format!("stopping {}: {e:#}", side.name));
            }
        }
    }
    measured?;
    memory(opts, paths, results).await?;
    stages::compare(opts, paths, results).await?;
    mcp::compare(opts, paths, results).await?;
    walls::compare(opts, paths, results).await?;
    restart::compare(opts, paths, results).await?;
    cluster::compare(opts, paths, results).await?;
    hibernate::compare(opts, paths, results).await?;
    packages::compare(opts, paths, results).await?;
    e2b::compare(opts, paths, results).await?;
    registry::compare(opts, &paths.work, results).await
}

async fn measure(
    opts: &Opts,
    paths: &Paths,
    sides: &mut [Side],
    results: &mut Results,
) -> Result<()> {
    let long = Duration::from_secs(120);

    // Create from the warm pool (Kernelgate only): each time the pool is full and quiet.
    {
        let kg = sides[0].server.as_ref().context("kernelgate")?;
        let mut samples = vec![];
        let mut unsettled = 0;
        for i in 0..opts.creates {
            if let Err(e) = procs::settle(kg, opts.pool_size, long).await {
                log(format!("{e:#}"));
                unsettled += 1;
            }
            let t0 = Instant::now();
            let id = kg.create_kernel(None).await?;
            let mut c = Conn::websocket(&kg.base, &kg.token, &id).await?;
            c.kernel_info(long).await?;
            let took = t0.elapsed();
            samples.push(ms(took));
            log(format!("warm create {i}: {:.1} ms", ms(took)));
            c.close().await;
            kg.delete_kernel(&id).await?;
        }
        results.set(
            "create_warm_ms",
            "kernelgate",
            json!({"median": median(&samples), "samples": samples, "unsettled": unsettled}),
        );
    }

    // Cold create, interleaved; the kernels stay for the measurements below.
    let cold_env = json!({"KERNEL_BENCH": "cold"});
    let mut cold: [Vec<f64>; 3] = Default::default();
    let n_kernels = opts.creates.max(opts.parallel_kernels);
    for i in 0..n_kernels {
        for (s, side) in sides.iter_mut().enumerate() {
            let t0 = Instant::now();
            let conn = match &side.server {
                Some(server) => {
                    let env = (side.name == "kernelgate").then(|| cold_env.clone());
                    let id = server.create_kernel(env).await?;
                    let mut c = Conn::websocket(&server.base, &server.token, &id).await?;
                    c.kernel_info(long).await?;
                    c
                }
                None => {
                    let k = DirectKernel::spawn(paths, i)?;
                    let mut c = Conn::zmq(&k.info, long).await?;
                    c.kernel_info(long).await?;
                    side.direct.push(k);
                    c
                }
            };
            let took = t0.elapsed();
            if i < opts.creates {
                cold[s].push(ms(took));
            }
            log(format!("cold create {i} {}: {:.0} ms", side.name, ms(took)));
            side.conns.push(conn);
        }
    }
    for (s, side) in sides.iter().enumerate() {
        results.set(
            "create_cold_ms",
            side.name,
            json!({"median": median(&cold[s]), "samples": cold[s]}),
        );
    }

    // Every connection delivers IOPub and has executed once; the first one is warm.
    for side in sides.iter_mut() {
        for c in side.conns.iter_mut() {
            c.wait_iopub(long).await?;
            c.execute("1+1", long).await?;
        }
        for _ in 0..20 {
            side.conns[0].execute("1+1", long).await?;
        }
    }

    // Execute round trip of `1+1`, rounds interleaved between the sides.
    let mut rt: [Vec<[f64; 3]>; 3] = Default::default();
    for r in 0..opts.rounds {
        for (s, side) in sides.iter_mut().enumerate() {
            let mut samples = Vec::with_capacity(opts.rt_runs);
            for _ in 0..opts.rt_runs {
                let run = side.conns[0].execute("1+1", long).await?;
                samples.push(ms(run.elapsed));
            }
            let p = [
                percentile(&samples, 50.0),
                percentile(&samples, 90.0),
                percentile(&samples, 99.0),
            ];
            log(format!(
                "round trip round {r} {}: p50 {:.3} p90 {:.3} p99 {:.3} ms",
                side.name, p[0], p[1], p[2]
            ));
            rt[s].push(p);
        }
    }
    for (s, side) in sides.iter().enumerate() {
        let col = |i: usize| rt[s].iter().map(|p| p[i]).collect::<Vec<_>>();
        results.set(
            "execute_rt_ms",
            side.name,
            json!({"p50": median(&col(0)), "p90": median(&col(1)), "p99": median(&col(2)),
                   "rounds": rt[s], "runs_per_round": opts.rt_runs}),
        );
    }

    if let Some(soak) = opts.soak {
        // For `perf record -p <gateway pid>`: Kernelgate relays streams for a while.
        log(format!(
            "soak: streaming through Kernelgate (pid {}) for {soak:?}",
            sides[0].server.as_ref().map_or(0, |s| s.pid)
        ));
        let code = stream_code(opts.stream_mib * 16);
        let end = Instant::now() + soak;
        while Instant::now() < end {
            let run = sides[0].conns[0].execute(&code, long).await?;
            log(format!(
                "soak: {:.1} MiB/s in {} stream messages",
                opts.stream_mib as f64 / run.elapsed.as_secs_f64(),
                run.stream_messages
            ));
        }
        bail!("soak finished (no results are written in this mode)");
    }

    // Stream throughput: the kernel prints stream_mib MiB in 64 KiB lines.
    let lines = opts.stream_mib * 16;
    let code = stream_code(lines);
    let expected: String = (0..lines)
        .map(|i| format!("{i:07}{}\n", "x".repeat(65528)))
        .collect();
    let mut stream: [Vec<(f64, bool)>; 3] = Default::default();
    for r in 0..opts.rounds {
        for (s, side) in sides.iter_mut().enumerate() {
            let run = side.conns[0].execute(&code, long).await?;
            let intact = run.stdout == expected;
            let mib_s = opts.stream_mib as f64 / run.elapsed.as_secs_f64();
            log(format!(
                "stream round {r} {}: {mib_s:.1} MiB/s, {} of {} bytes in {} messages, intact {intact}",
                side.name,
                run.stdout.len(),
                expected.len(),
                run.stream_messages,
            ));
            stream[s].push((mib_s, intact));
        }
    }
    for (s, side) in sides.iter().enumerate() {
        let rates: Vec<f64> = stream[s].iter().map(|x| x.0).collect();
        results.set(
            "stream_mib_s",
            side.name,
            json!({"median": median(&rates), "rounds": rates,
                   "intact": stream[s].iter().all(|x| x.1), "mib": opts.stream_mib}),
        );
    }

    // matplotlib PNG round trip (after one warm-up that imports pyplot).
    let png_code = "import matplotlib.pyplot as plt\nfig, ax = plt.subplots(figsize=(6, 4))\n\
                    ax.plot(range(100), [i * i for i in range(100)])\nplt.show()\n";
    let mut png: [Vec<f64>; 3] = Default::default();
    let mut png_bytes = [0usize; 3];
    for side in sides.iter_mut() {
        side.conns[0].execute(png_code, long).await?;
    }
    for _ in 0..opts.rounds {
        for (s, side) in sides.iter_mut().enumerate() {
            for _ in 0..opts.png_runs {
                let run = side.conns[0].execute(png_code, long).await?;
                let b64 = run.png.context("no image/png in the output")?;
                kernelgate_tests::decode_png(&b64)?;
                png_bytes[s] = b64.len();
                png[s].push(ms(run.elapsed));
            }
        }
    }
    for (s, side) in sides.iter().enumerate() {
        log(format!(
            "png {}: median {:.1} ms",
            side.name,
            median(&png[s])
        ));
        results.set(
            "png_rt_ms",
            side.name,
            json!({"median": median(&png[s]), "samples": png[s], "base64_bytes": png_bytes[s]}),
        );
    }

    // Parallel: every kernel of a side executes `1+1` in a loop for parallel_for.
    for side in sides.iter_mut() {
        let conns = &mut side.conns[..opts.parallel_kernels];
        let (total, secs) = walls::parallel(conns, opts.parallel_for, long).await?;
        let rate = total as f64 / secs;
        log(format!("parallel {}: {rate:.0} executes/s", side.name));
        results.set(
            "parallel_exec_s",
            side.name,
            json!({"rate": rate, "executes": total, "seconds": secs, "kernels": conns.len()}),
        );
    }
    Ok(())
}

/// Python that prints `lines` lines of 64 KiB (a 7-digit line number, then `x`s).
fn stream_code(lines: usize) -> String {
    format!(
        "import sys\n_p = 'x' * 65528\nfor _i in range({lines}):\n    sys.stdout.write(f'{{_i:07d}}{{_p}}\\n')\nsys.stdout.flush()\n"
    )
}

/// Gateway RSS with no kernels and with `idle_kernels` idle ones, each gateway fresh.
async fn memory(opts: &Opts, paths: &Paths, results: &mut Results) -> Result<()> {
    let n = opts.idle_kernels;
    for name in ["kernelgate", "jkg"] {
        let server = if name == "kernelgate" {
            let max = (n + 8).to_string();
            Server::kernelgate(
                paths,
                0,
                &[
                    "--max-kernels",
                    &max,
                    "--kernel-memory-mb",
                    "256",
                    "--runtime",
                    "runc",
                ],
            )
            .await?
        } else {
            Server::jkg(paths).await?
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        let base = server.rss_kib()?;
        let t0 = Instant::now();
        let created: Vec<Result<String>> = futures::stream::iter(0..n)
            .map(|_| server.create_kernel(None))
            // JKG 3.0 fails concurrent creates (a list_kernels during a start raises
            // AttributeError: no last_activity), so it gets them one at a time.
            .buffer_unordered(if name == "jkg" { 1 } else { 3 })
            .collect()
            .await;
        let ok = created.iter().filter(|r| r.is_ok()).count();
        if let Some(Err(e)) = created.iter().find(|r| r.is_err()) {
            log(format!("{name}: a create failed: {e:#}"));
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        let loaded = server.rss_kib()?;
        log(format!(
            "memory {name}: {:.1} MiB with 0 kernels, {:.1} MiB with {ok} idle kernels (created in {:.0} s)",
            base as f64 / 1024.0,
            loaded as f64 / 1024.0,
            t0.elapsed().as_secs_f64()
        ));
        stop_and_check(server).await?;
        if ok != n {
            bail!("{name}: only {ok} of {n} kernels started");
        }
        results.set(
            "rss",
            name,
            json!({"base_mib": base as f64 / 1024.0, "loaded_mib": loaded as f64 / 1024.0,
                   "kernels": ok,
                   "per_kernel_mib": (loaded as f64 - base as f64) / 1024.0 / ok.max(1) as f64}),
        );
    }
    Ok(())
}

/// Stops a server and warns when it left kernel containers behind.
async fn stop_and_check(server: procs::Server) -> Result<()> {
    let runtime_dir = server.runtime_dir.clone();
    server.stop().await?;
    if let Some(dir) = runtime_dir {
        let left = procs::leftover_containers(&dir);
        if left > 0 {
            log(format!(
                "warning: {left} containers of {} left",
                dir.display()
            ));
        }
    }
    Ok(())
}
