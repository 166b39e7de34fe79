//! The two container runtimes side by side: the same Kernelgate release build, once with
//! kernels under runc and once under gVisor (`--runtime runsc`), interleaved sample by
//! sample so that load on the machine hits both alike.

use crate::conn::Conn;
use crate::procs::{self, Paths, Server};
use crate::stats::{median, ms, percentile};
use crate::{log, stop_and_check, stream_code, Opts, Results};
use anyhow::{Context, Result};
use serde_json::json;
use std::time::{Duration, Instant};

/// The runtimes compared, in table order, as `--runtime` takes them.
pub const RUNTIMES: [&str; 2] = ["runc", "runsc"];

const IMPORTS: &str = "import numpy, pandas, matplotlib.pyplot";

/// Whether the Docker engine has gVisor registered (`make gvisor`).
pub fn gvisor_registered() -> bool {
    std::process::Command::new("docker")
        .args(["info", "--format", "{{json .Runtimes}}"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("\"kernelgate-runsc\""))
        .unwrap_or(false)
}

/// Measures cold create, pool create, the `1+1` round trip, a stream and the scientific
/// imports under each runtime; stores them as `runtime_*` metrics keyed by runtime.
pub async fn compare(opts: &Opts, paths: &Paths, results: &mut Results) -> Result<()> {
    if !gvisor_registered() {
        log("gVisor is not set up (`make gvisor`): no runtime comparison");
        results.set("runtimes", "skipped", json!("gVisor is not registered"));
        return Ok(());
    }
    let long = Duration::from_secs(180);

    // Cold creates: no pool, each kernel started on request. Each new kernel then times
    // its first import of the scientific stack (cold kernels do not preload it).
    let mut servers = Vec::new();
    for runtime in RUNTIMES {
        servers.push(Server::kernelgate(paths, 0, &["--runtime", runtime]).await?);
    }
    let mut cold: [Vec<f64>; 2] = Default::default();
    let mut imports: [Vec<f64>; 2] = Default::default();
    let mut conns: Vec<Option<Conn>> = vec![None, None];
    for i in 0..opts.creates {
        for (r, server) in servers.iter().enumerate() {
            let t0 = Instant::now();
            let id = server.create_kernel(None).await?;
            let mut c = Conn::websocket(&server.base, &server.token, &id).await?;
            c.kernel_info(long).await?;
            cold[r].push(ms(t0.elapsed()));
            c.wait_iopub(long).await?;
            let run = c.execute(IMPORTS, long).await?;
            imports[r].push(ms(run.elapsed));
            log(format!(
                "runtime {} cold create {i}: {:.0} ms, imports {:.0} ms",
                RUNTIMES[r],
                cold[r][i],
                ms(run.elapsed)
            ));
            // The last kernel stays for the round trip and the stream.
            if i + 1 == opts.creates {
                conns[r] = Some(c);
            } else {
                c.close().await;
                server.delete_kernel(&id).await?;
            }
        }
    }

    let mut rt: [Vec<f64>; 2] = Default::default();
    let mut stream: [Vec<f64>; 2] = Default::default();
    let code = stream_code(opts.stream_mib * 16);
    for round in 0..opts.rounds {
        for (r, conn) in conns.iter_mut().enumerate() {
            let c = conn.as_mut().context("kernel")?;
            for _ in 0..20 {
                c.execute("1+1", long).await?;
            }
            let mut samples = Vec::with_capacity(opts.rt_runs);
            for _ in 0..opts.rt_runs {
                samples.push(ms(c.execute("1+1", long).await?.elapsed));
            }
            rt[r].push(percentile(&samples, 50.0));
            let run = c.execute(&code, long).await?;
            let rate = opts.stream_mib as f64 / run.elapsed.as_secs_f64();
            stream[r].push(rate);
            log(format!(
                "runtime {} round {round}: 1+1 p50 {:.2} ms, stream {rate:.1} MiB/s",
                RUNTIMES[r],
                percentile(&samples, 50.0)
            ));
        }
    }
    for c in conns.into_iter().flatten() {
        c.close().await;
    }
    for s in servers {
        stop_and_check(s).await?;
    }

    // Creates from a full, quiet warm pool.
    let mut servers = Vec::new();
    for runtime in RUNTIMES {
        servers.push(Server::kernelgate(paths, opts.pool_size, &["--runtime", runtime]).await?);
    }
    let mut warm: [Vec<f64>; 2] = Default::default();
    for i in 0..opts.creates {
        for (r, server) in servers.iter().enumerate() {
            if let Err(e) = procs::settle(server, opts.pool_size, long).await {
                log(format!("{e:#}"));
            }
            let t0 = Instant::now();
            let id = server.create_kernel(None).await?;
            let mut c = Conn::websocket(&server.base, &server.token, &id).await?;
            c.kernel_info(long).await?;
            warm[r].push(ms(t0.elapsed()));
            log(format!(
                "runtime {} pool create {i}: {:.1} ms",
                RUNTIMES[r], warm[r][i]
            ));
            c.close().await;
            server.delete_kernel(&id).await?;
        }
    }
    for s in servers {
        stop_and_check(s).await?;
    }

    for (r, runtime) in RUNTIMES.iter().enumerate() {
        results.set(
            "runtime_create_cold_ms",
            runtime,
            json!({"median": median(&cold[r]), "samples": cold[r]}),
        );
        results.set(
            "runtime_create_warm_ms",
            runtime,
            json!({"median": median(&warm[r]), "samples": warm[r]}),
        );
        results.set(
            "runtime_execute_rt_ms",
            runtime,
            json!({"p50": median(&rt[r]), "rounds": rt[r], "runs_per_round": opts.rt_runs}),
        );
        results.set(
            "runtime_stream_mib_s",
            runtime,
            json!({"median": median(&stream[r]), "rounds": stream[r], "mib": opts.stream_mib}),
        );
        results.set(
            "runtime_imports_ms",
            runtime,
            json!({"median": median(&imports[r]), "samples": imports[r], "code": IMPORTS}),
        );
    }
    Ok(())
}
