//! What cluster mode costs: two nodes on loopback and a real etcd (Debian's etcd-server),
//! lease TTL 3 s. The kernel lives on the node "owner" (warm pool 1); the node "entry" has
//! room for one kernel, so a create through it is placed on the owner. Measured: `1+1`
//! round trips and a stream through the entry against the same straight to the owner,
//! interleaved on one kernel; a create through the entry served from the owner's warm pool;
//! a node's idle cost (etcd requests, RSS, CPU); how long both nodes take to register again
//! after an etcd outage; how long the entry takes to answer 404 for the owner's kernel after
//! a `kill -9` of the owner. A partition's detection is measured by the cluster tests (in
//! network namespaces), not here.

use crate::conn::Conn;
use crate::procs::{self, Paths, Server};
use crate::stats::{median, ms, percentile};
use crate::{log, stop_and_check, stream_code, Opts, Results};
use anyhow::{bail, Context, Result};
use kernelgate_tests::etcd::EtcdServer;
use reqwest::Method;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The lease TTL of the nodes, in seconds.
const TTL: u64 = 3;
/// How long the idle cost is sampled.
const IDLE_FOR: Duration = Duration::from_secs(10);

pub async fn compare(opts: &Opts, paths: &Paths, results: &mut Results) -> Result<()> {
    let mut etcd = EtcdServer::start().await?;
    let secret = paths.work.join("cluster.secret");
    std::fs::write(
        &secret,
        format!("{}\n", uuid::Uuid::new_v4().simple().to_string().repeat(2)),
    )?;
    let node = |id: &str, room: &str| -> Vec<String> {
        [
            "--etcd",
            &etcd.url(),
            "--node-id",
            id,
            "--advertise",
            "http://127.0.0.1:{port}",
            "--cluster-secret-file",
            &secret.display().to_string(),
            "--lease-ttl",
            &TTL.to_string(),
            "--max-kernels",
            room,
            "--runtime",
            "runc",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let args = node("owner", "16");
    let owner = Server::kernelgate(
        paths,
        1,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await?;
    let args = node("entry", "1");
    let entry = Server::kernelgate(
        paths,
        0,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await?;
    until(
        "both nodes see each other",
        Duration::from_secs(20),
        || async {
            Ok(
                cluster_of(&owner).await?["nodes"].as_array().map(Vec::len) == Some(2)
                    && cluster_of(&entry).await?["nodes"].as_array().map(Vec::len) == Some(2),
            )
        },
    )
    .await?;
    let long = Duration::from_secs(120);
    let id = entry.create_kernel(None).await?;
    let mut through = Conn::websocket(&entry.base, &entry.token, &id).await?;
    let mut straight = Conn::websocket(&owner.base, &owner.token, &id).await?;
    through.kernel_info(long).await?;
    straight.kernel_info(long).await?;

    // Round trips, interleaved.
    let mut rt: [Vec<f64>; 2] = Default::default();
    for _ in 0..opts.rt_runs {
        for (w, conn) in [&mut through, &mut straight].into_iter().enumerate() {
            rt[w].push(ms(conn.execute("1+1", long).await?.elapsed));
        }
    }
    let [p_through, p_straight] = [percentile(&rt[0], 50.0), percentile(&rt[1], 50.0)];
    log(format!(
        "cluster: 1+1 p50 through the entry {p_through:.2} ms, straight to the owner {p_straight:.2} ms"
    ));
    results.set(
        "cluster",
        "rt_p50_ms",
        json!({"through": p_through, "straight": p_straight,
               "p99_through": percentile(&rt[0], 99.0), "p99_straight": percentile(&rt[1], 99.0)}),
    );

    // A stream, interleaved.
    let code = stream_code(opts.stream_mib * 16);
    let mut rates: [Vec<f64>; 2] = Default::default();
    for _ in 0..opts.rounds {
        for (w, conn) in [&mut through, &mut straight].into_iter().enumerate() {
            let run = conn.execute(&code, long).await?;
            rates[w].push(opts.stream_mib as f64 / run.elapsed.as_secs_f64());
        }
    }
    let [r_through, r_straight] = [median(&rates[0]), median(&rates[1])];
    log(format!(
        "cluster: {} MiB stream through the entry {r_through:.1} MiB/s, straight {r_straight:.1} MiB/s",
        opts.stream_mib
    ));
    results.set(
        "cluster",
        "stream_mib_s",
        json!({"through": r_through, "straight": r_straight, "mib": opts.stream_mib}),
    );
    through.close().await;
    straight.close().await;

    // Creates through the entry, from the owner's warm pool (full and quiet each time).
    let mut creates = Vec::new();
    for i in 0..opts.creates {
        if let Err(e) = procs::settle(&owner, 2, long).await {
            log(format!("{e:#}"));
        }
        let t0 = Instant::now();
        let made = entry.create_kernel(None).await?;
        let took = ms(t0.elapsed());
        creates.push(took);
        log(format!(
            "cluster: warm create through the entry {i}: {took:.1} ms"
        ));
        entry.delete_kernel(&made).await?;
    }
    results.set(
        "cluster",
        "remote_warm_create_ms",
        json!({"median": median(&creates), "samples": creates}),
    );

    // A node at rest: etcd requests, RSS, CPU.
    if let Err(e) = procs::settle(&owner, 2, long).await {
        log(format!("{e:#}"));
    }
    let before = (
        etcd_requests(&etcd).await?,
        cpu_ticks(owner.pid)?,
        cpu_ticks(entry.pid)?,
    );
    tokio::time::sleep(IDLE_FOR).await;
    let after = (
        etcd_requests(&etcd).await?,
        cpu_ticks(owner.pid)?,
        cpu_ticks(entry.pid)?,
    );
    let seconds = IDLE_FOR.as_secs_f64();
    let per_node = (after.0 - before.0) / seconds / 2.0;
    // Clock ticks are 1/100 s.
    let cpu = |b: u64, a: u64| (a - b) as f64 / 100.0 / seconds * 100.0;
    let idle = json!({
        "etcd_requests_per_s": per_node,
        "owner_cpu_percent": cpu(before.1, after.1), "entry_cpu_percent": cpu(before.2, after.2),
        "owner_rss_mib": owner.rss_kib()? as f64 / 1024.0,
        "entry_rss_mib": entry.rss_kib()? as f64 / 1024.0,
    });
    log(format!("cluster: idle {idle}"));
    results.set("cluster", "idle", idle);

    // etcd away for longer than the TTL: how long until both nodes are registered again.
    etcd.kill()?;
    tokio::time::sleep(Duration::from_secs(TTL + 1)).await;
    etcd.resume().await?;
    let back = Instant::now();
    until(
        "both nodes register again",
        Duration::from_secs(30),
        || async {
            Ok(cluster_of(&owner).await?["registered"] == true
                && cluster_of(&entry).await?["registered"] == true)
        },
    )
    .await?;
    let reregister = back.elapsed().as_secs_f64();
    log(format!(
        "cluster: registered again {reregister:.2} s after etcd returned"
    ));

    // kill -9 of the owner: how long until the entry answers 404 for its kernel.
    let owner_dir = owner
        .runtime_dir
        .clone()
        .context("the owner's runtime directory")?;
    std::process::Command::new("kill")
        .args(["-KILL", &owner.pid.to_string()])
        .status()?;
    let killed = Instant::now();
    until(
        "the entry answers 404 for the owner's kernel",
        Duration::from_secs(30),
        || async {
            let r = entry
                .client()
                .request(Method::GET, &format!("/api/kernels/{id}"))
                .send()
                .await?;
            Ok(r.status() == 404)
        },
    )
    .await?;
    let detected = killed.elapsed().as_secs_f64();
    log(format!(
        "cluster: kill -9 of the owner seen as 404 after {detected:.2} s (TTL {TTL} s)"
    ));
    results.set(
        "cluster",
        "failure_s",
        json!({"kill_9_to_404": detected, "reregister_after_etcd": reregister, "ttl": TTL}),
    );
    drop(owner);
    kernelgate_tests::remove_leftovers(&owner_dir);
    stop_and_check(entry).await
}

/// The `cluster` part of a node's `GET /api`.
async fn cluster_of(server: &Server) -> Result<Value> {
    let r = server.client().request(Method::GET, "/api").send().await?;
    let api: Value = r.json().await?;
    Ok(api["kernelgate"]["cluster"].clone())
}

/// Polls `done` every 50 ms until it holds, at most `timeout`.
async fn until<F, Fut>(what: &str, timeout: Duration, done: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if done().await.unwrap_or(false) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("not within {timeout:?}: {what}")
}

/// Requests etcd has served (its gRPC calls, the JSON gateway's included), from its metrics.
async fn etcd_requests(etcd: &EtcdServer) -> Result<f64> {
    let text = reqwest::get(format!("{}/metrics", etcd.url()))
        .await?
        .text()
        .await?;
    Ok(text
        .lines()
        .filter(|l| l.starts_with("grpc_server_started_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}

/// User and system CPU time of process `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .context("a /proc stat line")?
        .split_whitespace()
        .collect();
    // After the command: state is field 3, utime 14 and stime 15 (1-based, man 5 proc).
    let tick =
        |n: usize| -> Result<u64> { Ok(fields.get(n - 3).context("a /proc stat field")?.parse()?) };
    Ok(tick(14)? + tick(15)?)
}
