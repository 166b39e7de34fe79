//! What a restart (`POST /api/kernels/{id}/restart`) costs: with a warm kernel ready, the
//! kernel moves into it; without one (here: a kernel whose `KERNEL_*` variables a warm
//! kernel cannot be given) its own container is restarted. Under each runtime, the two
//! ways interleaved sample by sample, each time with the pool full and quiet.

use crate::conn::Conn;
use crate::procs::{self, Paths, Server};
use crate::stats::{median, ms};
use crate::walls::{gvisor_registered, RUNTIMES};
use crate::{log, stop_and_check, Opts, Results};
use anyhow::{bail, Result};
use serde_json::json;
use std::time::{Duration, Instant};

/// The ways compared, in table order.
pub const WAYS: [&str; 2] = ["warm", "container"];

/// Restart p50 by way, under each runtime: `restart_ms[runtime][way]`.
pub async fn compare(opts: &Opts, paths: &Paths, results: &mut Results) -> Result<()> {
    let long = Duration::from_secs(180);
    let runtimes: &[&str] = if gvisor_registered() {
        &RUNTIMES
    } else {
        &RUNTIMES[..1]
    };
    for runtime in runtimes {
        let server = Server::kernelgate(paths, 1, &["--runtime", runtime]).await?;
        let warm = server.create_kernel(None).await?;
        let cold = server
            .create_kernel(Some(json!({"KERNEL_BENCH": "container restart"})))
            .await?;
        let mut samples: [Vec<f64>; 2] = Default::default();
        for i in 0..opts.creates {
            for (w, id) in [&warm, &cold].into_iter().enumerate() {
                // Two kernels and one warm one, all quiet.
                if let Err(e) = procs::settle(&server, 3, long).await {
                    log(format!("{e:#}"));
                }
                let t0 = Instant::now();
                let status = server.restart_kernel(id).await?;
                if status != 200 {
                    bail!("restart answered {status}");
                }
                let mut c = Conn::websocket(&server.base, &server.token, id).await?;
                c.kernel_info(long).await?;
                let took = ms(t0.elapsed());
                c.close().await;
                samples[w].push(took);
                log(format!("restart {runtime} {} {i}: {took:.0} ms", WAYS[w]));
            }
        }
        stop_and_check(server).await?;
        for (w, way) in WAYS.iter().enumerate() {
            results.set(
                "restart_ms",
                &format!("{runtime}_{way}"),
                json!({"median": median(&samples[w]), "samples": samples[w]}),
            );
        }
    }
    Ok(())
}
