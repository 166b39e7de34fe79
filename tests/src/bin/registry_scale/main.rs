//! `registry_scale`: how the cluster registry holds up as the cluster grows. Many gateway
//! nodes simulated in this one process, each a real `Membership` over its own `Etcd`
//! client, against a real etcd (Debian's etcd-server): each node's lease loop, its watch,
//! a reconcile of its kernels every 30 s, churn spread over the nodes (creates, deletes)
//! and owner look-ups through a node's view. Per point (nodes × kernels, a fresh etcd
//! each): etcd's CPU and memory, the registry calls by kind and how long they took, leases
//! lost, the look-up time, and how long a node joining at the end takes until it could
//! route to a kernel. The nodes share the machine with etcd: their CPU is given too.
//!
//! Only the registry API the cluster code has had from the start is used (records built
//! from JSON), so that these files compile in an earlier tree too: `make bench` builds
//! them there and runs both builds (the bench's `registry` section). How a node finds a
//! kernel's owner is the one thing that differs: `routing.rs` is this tree's, and
//! `tests/registry-baseline/routing.rs` the baseline's (it watched every record).
//!
//! Usage: registry_scale [--nodes N,..] [--kernels K,..] [--window S] [--ttl S]
//!        [--creates PER_S] [--deletes PER_S] [--lookups PER_S] [--reconcile S] [--quick]
//!        [--out FILE.json]

mod routing;
mod timed;

use timed::{Calls, Kind, Timed};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use kernelgate::cluster::etcd::Etcd;
use kernelgate::cluster::membership::Membership;
use kernelgate::cluster::{NodeRecord, RegistryError};
use kernelgate::kernels::ledger::{ClaimRefused, Ledger};
use kernelgate_tests::etcd::EtcdServer;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

/// The key every simulated kernel belongs to (no quota).
const TENANT: &str = "bench";

/// Creates, deletes and look-ups under way at once, each; a tick that finds them all busy
/// is skipped (and counted), so that a stalled registry does not pile work up.
const IN_FLIGHT: usize = 256;
/// How long a joining node may take to route before it counts as failed.
const JOIN_LIMIT: Duration = Duration::from_secs(120);
/// Nodes whose watch makes its first listing at the same time, before the window.
const LISTING_AT_ONCE: usize = 4;
/// Cut a point short when the machine has less memory available than this.
const MIN_AVAILABLE_MIB: u64 = 1536;

/// Preloading claims under way at once; the longest a preload or the first listings take.
const PRELOAD_AT_ONCE: usize = 64;
const SETUP_LIMIT: Duration = Duration::from_secs(240);

#[derive(Debug, Clone)]
struct Args {
    nodes: Vec<usize>,
    kernels: Vec<usize>,
    window: Duration,
    ttl: Duration,
    creates: f64,
    deletes: f64,
    lookups: f64,
    reconcile: Duration,
    out: Option<PathBuf>,
}

impl Args {
    fn parse() -> Result<Args> {
        let mut flags: HashMap<String, String> = HashMap::new();
        let mut args = std::env::args().skip(1);
        while let Some(flag) = args.next() {
            let value = match flag.as_str() {
                "--quick" => String::new(),
                f if f.starts_with("--") => args.next().context("a flag without its value")?,
                _ => bail!("unknown argument {flag:?}\n{USAGE}"),
            };
            flags.insert(flag.trim_start_matches('-').to_owned(), value);
        }
        let quick = flags.remove("quick").is_some();
        let mut take = |name: &str, default: &str| flags.remove(name).unwrap_or(default.into());
        let list = |v: String| -> Result<Vec<usize>> {
            v.split(',')
                .map(|n| Ok(n.trim().replace('_', "").parse()?))
                .collect()
        };
        let secs = |v: String| -> Result<Duration> { Ok(Duration::from_secs_f64(v.parse()?)) };
        let (nodes, kernels, window) = match quick {
            true => ("20", "2000", "10"),
            false => ("100,300,1000", "10000,100000", "60"),
        };
        let a = Args {
            nodes: list(take("nodes", nodes))?,
            kernels: list(take("kernels", kernels))?,
            window: secs(take("window", window))?,
            ttl: secs(take("ttl", "10"))?,
            creates: take("creates", "20").parse()?,
            deletes: take("deletes", "20").parse()?,
            lookups: take("lookups", "20").parse()?,
            reconcile: secs(take("reconcile", "30"))?,
            out: flags.remove("out").map(PathBuf::from),
        };
        if let Some(flag) = flags.keys().next() {
            bail!("unknown flag --{flag}\n{USAGE}");
        }
        if a.nodes.contains(&0) || a.ttl < Duration::from_secs(2) {
            bail!("--nodes must be at least 1, --ttl at least 2 s");
        }
        Ok(a)
    }
}

const USAGE: &str = "usage: registry_scale [--nodes N,..] [--kernels K,..] [--window S] \
                     [--ttl S] [--creates PER_S] [--deletes PER_S] [--lookups PER_S] \
                     [--reconcile S] [--quick] [--out FILE.json]";

fn log(msg: impl AsRef<str>) {
    eprintln!("[registry] {}", msg.as_ref());
}

/// One simulated gateway node.
struct Node {
    id: String,
    membership: Arc<Membership<Timed>>,
    /// The kernels it runs: what it reconciles against.
    local: Mutex<HashSet<String>>,
}

impl Node {
    /// Records are built from JSON, so that fields a later layout adds take their defaults.
    fn new(id: &str, url: &str, calls: &Arc<Calls>, ttl: Duration) -> Result<Node> {
        let incarnation = uuid::Uuid::new_v4().simple().to_string();
        let record: NodeRecord = serde_json::from_value(json!({
            "address": format!("http://127.0.0.1:9/{id}"), "incarnation": incarnation,
            "capacity": 1_000_000, "load": 0, "version": "registry_scale", "specs": ["python3"],
        }))?;
        // Plain HTTP to loopback: no TLS roots to load for each of a thousand clients.
        let http = reqwest::Client::builder().tls_built_in_root_certs(false);
        let etcd = Etcd::new(vec![url.to_owned()], http)?;
        let registry = Timed {
            etcd,
            calls: calls.clone(),
        };
        Ok(Node {
            id: id.to_owned(),
            membership: Membership::new(registry, id, record, ttl),
            local: Mutex::new(HashSet::new()),
        })
    }
}

/// Every live kernel and its node, for picking one at random.
#[derive(Default)]
struct Live(Vec<(String, usize)>);

impl Live {
    fn pick(&self) -> Option<(String, usize)> {
        (!self.0.is_empty()).then(|| self.0[random() as usize % self.0.len()].clone())
    }

    fn take(&mut self) -> Option<(String, usize)> {
        (!self.0.is_empty()).then(|| self.0.swap_remove(random() as usize % self.0.len()))
    }
}

/// One point's simulated cluster.
struct Sim {
    nodes: Vec<Arc<Node>>,
    live: Mutex<Live>,
    calls: Arc<Calls>,
    /// What the churn, the look-ups and the reconciles took, by operation (in the window).
    ops: Calls,
    /// Look-ups whose node's view did not name the kernel's owner; ticks skipped because
    /// [`IN_FLIGHT`] operations were under way; records the reconciles fixed (churn racing
    /// a reconcile).
    missed: AtomicU64,
    skipped: AtomicU64,
    fixed: AtomicU64,
    in_flight: Arc<Semaphore>,
}

impl Sim {
    /// A new kernel claimed through node `n`: in its local set first, so that a reconcile
    /// racing the claim registers it rather than removing it.
    async fn create(&self, n: usize) -> Option<String> {
        let node = &self.nodes[n];
        // Placed through a random entry node, as a client's create is.
        let entry = &self.nodes[random() as usize % self.nodes.len()];
        self.ops
            .time("place", async {
                routing::place(&entry.membership).await;
                Ok(())
            })
            .await
            .ok();
        let id = uuid::Uuid::new_v4().to_string();
        lock(&node.local).insert(id.clone());
        // As the kernel table claims: through the ledger, which also puts the node's load.
        let claimed = self.ops.time("claim", async {
            let ledger = &*node.membership;
            let refused = |e: ClaimRefused| RegistryError::Refused(e.to_string());
            let reservation = Ledger::reserve(ledger, TENANT, None)
                .await
                .map_err(refused)?;
            let claimed = Ledger::claim(ledger, &id, TENANT, "python3", reservation).await;
            claimed.map_err(refused)
        });
        if claimed.await.is_err() {
            lock(&node.local).remove(&id);
            return None;
        }
        lock(&self.live).0.push((id.clone(), n));
        Some(id)
    }

    /// A random kernel deleted by its node: out of its local set first, as a stopped
    /// kernel leaves the node's table before its record goes.
    async fn delete(&self) {
        let Some((id, n)) = lock(&self.live).take() else {
            return;
        };
        let node = &self.nodes[n];
        lock(&node.local).remove(&id);
        let release = async {
            Ledger::release(&*node.membership, &id).await;
            Ok(())
        };
        let _ = self.ops.time("release", release).await;
    }

    /// A random node finds the owner of a random kernel, as it would to route a request.
    async fn lookup(&self) {
        let Some((id, owner)) = lock(&self.live).pick() else {
            return;
        };
        let node = &self.nodes[random() as usize % self.nodes.len()];
        let start = Instant::now();
        let found = routing::owner(&node.membership, &id).await;
        let found = found.as_ref();
        if self.ops.measuring.load(Relaxed) {
            let mut ops = lock(&self.ops.by_kind);
            ops.entry("lookup")
                .or_default()
                .took
                .push(ms(start.elapsed()));
            let missed = found != Some(&self.nodes[owner].id);
            self.missed.fetch_add(u64::from(missed), Relaxed);
        }
    }

    /// Node `n`'s reconcile, every `every` from a random phase, until `cancel`.
    async fn reconciles(self: Arc<Self>, n: usize, every: Duration, cancel: CancellationToken) {
        let phase = every.mul_f64((random() % 1000) as f64 / 1000.0);
        let node = self.nodes[n].clone();
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + phase, every);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let local: Vec<(String, String, String)> = lock(&node.local)
                .iter()
                .map(|id| (id.clone(), "bench".to_owned(), "python3".to_owned()))
                .collect();
            let done = self
                .ops
                .time("reconcile", node.membership.reconcile(&local));
            if let Ok(fixed) = done.await {
                let n = fixed.stale_records + fixed.unregistered_kernels;
                self.fixed.fetch_add(n, Relaxed);
            }
        }
    }

    /// Runs `op` `per_s` times a second, each in a task of its own, until `cancel`.
    async fn steady<F, Fut>(self: Arc<Self>, per_s: f64, cancel: CancellationToken, op: F)
    where
        F: Fn(Arc<Sim>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        if per_s <= 0.0 {
            return;
        }
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_s));
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let Ok(permit) = self.in_flight.clone().try_acquire_owned() else {
                self.skipped.fetch_add(1, Relaxed);
                continue;
            };
            let work = op(self.clone());
            tokio::spawn(async move {
                work.await;
                drop(permit);
            });
        }
    }
}

/// Why a point stopped before its end.
struct Cut(String);

impl<E: std::fmt::Display> From<E> for Cut {
    fn from(e: E) -> Cut {
        Cut(format!("error: {e}"))
    }
}

/// More runtime threads than cores: a simulated node busy on the CPU (a reconcile going
/// through a listing) holds up fewer of the others' timers and calls.
#[tokio::main(worker_threads = 8)]
async fn main() -> Result<()> {
    let args = Args::parse()?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // Stopped, the points under way are dropped, and with them their etcd.
    tokio::select! {
        done = points(&args) => done,
        _ = tokio::signal::ctrl_c() => bail!("interrupted"),
        _ = term.recv() => bail!("terminated"),
    }
}

async fn points(args: &Args) -> Result<()> {
    let mut points = Vec::new();
    for &kernels in &args.kernels {
        for &nodes in &args.nodes {
            points.push(point(args, nodes, kernels).await?);
        }
    }
    let doc = json!({
        "settings": {
            "ttl_s": args.ttl.as_secs_f64(), "window_s": args.window.as_secs_f64(),
            "creates_per_s": args.creates, "deletes_per_s": args.deletes,
            "lookups_per_s": args.lookups, "reconcile_s": args.reconcile.as_secs_f64(),
        },
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "points": points,
    });
    let text = serde_json::to_string_pretty(&doc)?;
    match &args.out {
        Some(path) => std::fs::write(path, text)?,
        None => println!("{text}"),
    }
    Ok(())
}

/// One point on a fresh etcd: nodes up, kernels preloaded, views listed, then the window
/// under steady load, then a node joins.
async fn point(args: &Args, nodes: usize, kernels: usize) -> Result<Value> {
    log(format!("{nodes} nodes × {kernels} kernels: starting etcd"));
    let etcd = EtcdServer::start().await?;
    let pid = etcd_pid(&etcd.url())?;
    let calls = Arc::new(Calls::default());
    let sim = Arc::new(Sim {
        nodes: (0..nodes)
            .map(|i| {
                Node::new(&format!("node-{i:04}"), &etcd.url(), &calls, args.ttl).map(Arc::new)
            })
            .collect::<Result<_>>()?,
        live: Mutex::new(Live::default()),
        calls,
        ops: Calls::default(),
        missed: AtomicU64::new(0),
        skipped: AtomicU64::new(0),
        fixed: AtomicU64::new(0),
        in_flight: Arc::new(Semaphore::new(IN_FLIGHT)),
    });
    let cancel = CancellationToken::new();
    let mut out = json!({"nodes": nodes, "kernels": kernels, "ttl_s": args.ttl.as_secs_f64()});
    let started = Instant::now();
    let ran = run(args, &sim, &etcd, pid, &cancel, &mut out).await;
    if let Err(Cut(why)) = ran {
        log(format!(
            "{nodes} nodes × {kernels} kernels cut short: {why}"
        ));
        out["cut_short"] = json!(why);
    }
    cancel.cancel();
    // Operations under way end with their calls (each has the client's timeout).
    let _ = tokio::time::timeout(
        Duration::from_secs(20),
        sim.in_flight.acquire_many(IN_FLIGHT as u32),
    )
    .await;
    out["total_s"] = json!(started.elapsed().as_secs_f64());
    drop(etcd);
    Ok(out)
}

async fn run(
    args: &Args,
    sim: &Arc<Sim>,
    etcd: &EtcdServer,
    pid: u32,
    cancel: &CancellationToken,
    out: &mut Value,
) -> Result<(), Cut> {
    let nodes = sim.nodes.len();
    let kernels = out["kernels"].as_u64().unwrap_or(0) as usize;
    // Lease loops, their renewals spread over one period as nodes started at random would be.
    let period = args.ttl / 3;
    let start = Instant::now();
    for (i, node) in sim.nodes.iter().enumerate() {
        let (m, c) = (node.membership.clone(), cancel.clone());
        let delay = period.mul_f64(i as f64 / nodes as f64);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            m.keep(c, |_| {}).await
        });
    }
    until("every node registered", SETUP_LIMIT, || {
        sim.nodes.iter().all(|n| n.membership.registered())
    })
    .await?;
    out["registered_s"] = json!(start.elapsed().as_secs_f64());

    log(format!("preloading {kernels} kernels"));
    let start = Instant::now();
    let preload = futures::stream::iter(0..kernels)
        .map(|i| sim.create(i % nodes))
        .buffer_unordered(PRELOAD_AT_ONCE)
        .filter_map(|id| async move { id })
        .fold(None, |_, id| async move { Some(id) });
    let last = tokio::time::timeout(SETUP_LIMIT, preload)
        .await
        .map_err(|_| Cut(format!("the preload took over {:?}", SETUP_LIMIT)))?;
    let took = start.elapsed().as_secs_f64();
    let held = lock(&sim.live).0.len();
    out["preload"] = json!({"seconds": took, "claims_per_s": held as f64 / took,
                            "failed": kernels - held});
    log(format!("preloaded {held} kernels in {took:.1} s"));

    // The watches, as in a rolling start: each lists everything first, and only
    // LISTING_AT_ONCE nodes list at a time (all at once is an outage's end, not the
    // steady state measured here).
    let start = Instant::now();
    let known = Arc::new(AtomicU64::new(0));
    let listing = Arc::new(Semaphore::new(LISTING_AT_ONCE));
    for node in &sim.nodes {
        let (m, c, known) = (node.membership.clone(), cancel.clone(), known.clone());
        let (listing, last, limit) = (listing.clone(), last.clone(), SETUP_LIMIT);
        tokio::spawn(async move {
            let Ok(_turn) = listing.acquire_owned().await else {
                return;
            };
            tokio::spawn(m.clone().follow(c));
            let listed = match &last {
                Some(id) => routing::ready(&m, id, limit).await,
                None => true,
            };
            known.fetch_add(u64::from(listed), Relaxed);
        });
    }
    let what = "every node's view holds the preloaded kernels";
    until(what, SETUP_LIMIT, || known.load(Relaxed) == nodes as u64)
        .await
        .map_err(|Cut(why)| Cut(format!("{why} ({} of {nodes})", known.load(Relaxed))))?;
    out["views_s"] = json!(start.elapsed().as_secs_f64());
    log(format!(
        "views listed in {:.1} s",
        start.elapsed().as_secs_f64()
    ));

    for n in 0..nodes {
        tokio::spawn(sim.clone().reconciles(n, args.reconcile, cancel.clone()));
    }
    let c = cancel.clone();
    tokio::spawn(sim.clone().steady(args.creates, c, |sim| async move {
        sim.create(random() as usize % sim.nodes.len()).await;
    }));
    let c = cancel.clone();
    tokio::spawn(sim.clone().steady(args.deletes, c, |sim| async move {
        sim.delete().await;
    }));
    let c = cancel.clone();
    tokio::spawn(sim.clone().steady(args.lookups, c, |sim| async move {
        sim.lookup().await;
    }));
    measure_window(args, sim, pid, out).await?;
    Ok(join(args, sim, etcd, out).await?)
}

/// The measured window: etcd's and this process's CPU and memory, the calls, leases
/// lost; cut short when most nodes are cut off for a while or memory runs low.
async fn measure_window(args: &Args, sim: &Arc<Sim>, pid: u32, out: &mut Value) -> Result<(), Cut> {
    let (nodes, me) = (sim.nodes.len(), std::process::id());
    let cut_off = || {
        sim.nodes
            .iter()
            .filter(|n| !n.membership.registered())
            .count()
    };
    let lost = || -> u64 {
        sim.nodes
            .iter()
            .map(|n| n.membership.reregistrations())
            .sum()
    };
    let (lost_before, load_before) = (lost(), loadavg());
    sim.calls.measure(true);
    sim.ops.measure(true);
    let start = Instant::now();
    let (etcd_cpu, own_cpu) = (cpu_ticks(pid)?, cpu_ticks(me)?);
    let (mut etcd_rss, mut own_rss, mut cut_off_for, mut cut) = (0, 0, 0, None);
    while start.elapsed() < args.window && cut.is_none() {
        tokio::time::sleep(Duration::from_secs(1)).await;
        etcd_rss = etcd_rss.max(status_kib(&format!("/proc/{pid}/status"), "VmRSS:")?);
        own_rss = own_rss.max(status_kib("/proc/self/status", "VmRSS:")?);
        let now = cut_off();
        cut_off_for = if now * 2 > nodes { cut_off_for + 1 } else { 0 };
        if cut_off_for >= 5 {
            cut = Some(format!("{now} of {nodes} nodes cut off for 5 s"));
        } else if available_mib() < MIN_AVAILABLE_MIB {
            cut = Some(format!("under {MIN_AVAILABLE_MIB} MiB of memory left"));
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let cores =
        |from: u64, pid: u32| (cpu_ticks(pid).unwrap_or(from) - from) as f64 / 100.0 / seconds;
    let (etcd_cores, own_cores) = (cores(etcd_cpu, pid), cores(own_cpu, me));
    sim.calls.measure(false);
    sim.ops.measure(false);
    let calls = std::mem::take(&mut *lock(&sim.calls.by_kind));
    let ops = std::mem::take(&mut *lock(&sim.ops.by_kind));
    let per_kind = |k: &Kind| {
        json!({"calls": k.took.len(), "errors": k.errors,
                                     "per_s": k.took.len() as f64 / seconds})
    };
    let counts: BTreeMap<_, _> = calls.iter().map(|(n, k)| (*n, per_kind(k))).collect();
    let took = |of: &BTreeMap<&str, Kind>, kind: &str| {
        let k = of.get(kind);
        let mut t = spread(k.map_or(&[][..], |k| &k.took));
        t["failed"] = json!(k.map_or(0, |k| k.errors));
        t
    };
    let w = json!({
        "seconds": seconds,
        "etcd": {"cpu_cores": etcd_cores, "rss_max_mib": etcd_rss as f64 / 1024.0},
        "simulator": {"cpu_cores": own_cores, "rss_max_mib": own_rss as f64 / 1024.0},
        "load": [load_before, loadavg()],
        "keep_alive_ms": took(&calls, "keep_alive"),
        "list_ms": took(&calls, "list"),
        "txn_ms": took(&calls, "txn"),
        "leases_lost": lost() - lost_before,
        "cut_off_at_end": cut_off(),
        "lookup_ms": took(&ops, "lookup"),
        "lookup_missed": sim.missed.swap(0, Relaxed),
        "claim_ms": took(&ops, "claim"),
        "release_ms": took(&ops, "release"),
        "reconcile_ms": took(&ops, "reconcile"),
        "reconcile_fixed": sim.fixed.swap(0, Relaxed),
        "skipped_ticks": sim.skipped.swap(0, Relaxed),
        "calls": counts,
        "watch_events_per_s": sim.calls.events.load(Relaxed) as f64 / seconds,
        "listed_entries_per_s": sim.calls.listed.load(Relaxed) as f64 / seconds,
    });
    let p99 = |what: &str| w[what]["p99"].as_f64().unwrap_or(f64::NAN);
    log(format!(
        "window {seconds:.0} s: etcd {etcd_cores:.2} cores, this process {own_cores:.2}; \
         keep-alive p99 {:.1} ms, look-up p99 {:.1} ms, leases lost {}",
        p99("keep_alive_ms"),
        p99("lookup_ms"),
        w["leases_lost"],
    ));
    out["window"] = w;
    cut.map_or(Ok(()), |why| Err(Cut(why)))
}

/// A new node joins under the load still running: how long until it holds its lease, and
/// until its view names the owner of a given kernel (it could route a request for it).
async fn join(args: &Args, sim: &Arc<Sim>, etcd: &EtcdServer, out: &mut Value) -> Result<()> {
    let Some((id, _)) = lock(&sim.live).pick() else {
        return Ok(());
    };
    let joiner = Node::new("node-joining", &etcd.url(), &Arc::default(), args.ttl)?.membership;
    let cancel = CancellationToken::new();
    let start = Instant::now();
    tokio::spawn(joiner.clone().keep(cancel.clone(), |_| {}));
    tokio::spawn(joiner.clone().follow(cancel.clone()));
    let (mut registered, mut routes) = (None, None);
    // Until it has done both: it may find the owner before it holds its lease.
    while start.elapsed() < JOIN_LIMIT && (routes.is_none() || registered.is_none()) {
        let now = Some(start.elapsed().as_secs_f64());
        registered = registered.or(now.filter(|_| joiner.registered()));
        // Timed when the owner is known: the read it may take counts.
        if routes.is_none() && routing::owner(&joiner, &id).await.is_some() {
            routes = Some(start.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cancel.cancel();
    out["join"] = json!({"registered_s": registered, "routes_s": routes});
    log(format!(
        "a new node registered after {registered:.2?} s, routes after {routes:.2?} s"
    ));
    Ok(())
}

/// Waits until `done`, checked every 100 ms, at most `limit`; cut short when memory runs low.
async fn until(what: &str, limit: Duration, done: impl Fn() -> bool) -> Result<(), Cut> {
    let start = Instant::now();
    loop {
        if done() {
            return Ok(());
        }
        if start.elapsed() > limit {
            return Err(Cut(format!("not {what} within {limit:?}")));
        }
        if available_mib() < MIN_AVAILABLE_MIB {
            return Err(Cut(format!(
                "under {MIN_AVAILABLE_MIB} MiB of memory left before {what}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The pid of the etcd serving `url` (the test helper keeps its child to itself).
fn etcd_pid(url: &str) -> Result<u32> {
    for entry in std::fs::read_dir("/proc")?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse().ok()) else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_etcd = args.first().is_some_and(|a| a.ends_with(b"etcd"));
        if is_etcd
            && args
                .windows(2)
                .any(|w| w == [b"--listen-client-urls", url.as_bytes()])
        {
            return Ok(pid);
        }
    }
    bail!("no etcd process serves {url}")
}

/// User and system CPU time of process `pid`, in clock ticks (100 a second).
fn cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after = stat.rsplit_once(')').context("a /proc stat line")?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // After the command: state is field 3, utime 14 and stime 15 (1-based, man 5 proc).
    let field = |n: usize| -> Result<u64> { Ok(fields.get(n - 3).context("a field")?.parse()?) };
    Ok(field(14)? + field(15)?)
}

fn available_mib() -> u64 {
    status_kib("/proc/meminfo", "MemAvailable:").map_or(u64::MAX, |k| k / 1024)
}

fn status_kib(path: &str, field: &str) -> Result<u64> {
    let text = std::fs::read_to_string(path)?;
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .context("no such field")?;
    Ok(line.trim().trim_end_matches("kB").trim().parse()?)
}

fn loadavg() -> String {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Count, p50, p99 and max of samples (nearest rank); nulls when there are none.
fn spread(samples: &[f64]) -> Value {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let at = |p: f64| {
        let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
        s.get(rank.clamp(1, s.len().max(1)) - 1).copied()
    };
    json!({"n": s.len(), "p50": at(50.0), "p99": at(99.0), "max": s.last()})
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A random number (splitmix64 over a shared counter seeded from the clock).
fn random() -> u64 {
    static STATE: AtomicU64 = AtomicU64::new(0);
    static SEEDED: std::sync::Once = std::sync::Once::new();
    SEEDED.call_once(|| {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        STATE.store(seed, Relaxed);
    });
    let mut z = STATE.fetch_add(0x9e37_79b9_7f4a_7c15, Relaxed);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
