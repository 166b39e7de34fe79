//! The cluster registry on a real etcd (Debian's etcd-server, on loopback): what cluster
//! mode relies on, as etcd really does it. Leases expire with their keys, a kernel can be
//! claimed once, a record is removed only by whoever holds its exact value, a watch resumes
//! from a revision and reports compaction, and an outage is an error the caller can tell.
//! etcd run with deploy/'s compaction flags keeps its history bounded under churn, and a
//! member that hangs for less than the TTL costs no node its lease.

use anyhow::{bail, ensure, Context, Result};
use futures::StreamExt;
use kernelgate::cluster::etcd::Etcd;
use kernelgate::cluster::membership::Membership;
use kernelgate::cluster::{kernel_key, Event, KernelRecord, NodeRecord, Registry, RegistryError};
use kernelgate_tests::etcd::EtcdServer;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn client(server: &EtcdServer) -> Result<Etcd> {
    Ok(Etcd::new(vec![server.url()], reqwest::Client::builder())?)
}

/// A node's record, advertising `address`.
fn node_record(address: &str) -> NodeRecord {
    NodeRecord {
        address: address.into(),
        cluster_address: None,
        incarnation: uuid::Uuid::new_v4().to_string(),
        capacity: 2,
        load: 0,
        version: "test".into(),
        specs: vec!["python3".into()],
        warm: Default::default(),
        away: false,
        indexed: true,
    }
}

/// The owner of kernel `id` as node `m` finds it to route a request (its cache, or a
/// read of the record).
async fn owner_seen(m: &Membership<Etcd>, id: &str) -> Option<String> {
    m.view_finding(id)
        .await
        .kernels
        .get(id)
        .map(|k| k.node.clone())
}

/// A kernel's record, owned by node `node`.
/// Node `id`'s membership on `server`, with a lease of `ttl` (not yet kept or followed).
fn member(server: &EtcdServer, id: &str, ttl: Duration) -> Result<Arc<Membership<Etcd>>> {
    let address = format!("http://198.18.0.{}:8888", u32::from(id.as_bytes()[0]) - 96);
    Ok(Membership::new(
        client(server)?,
        id,
        node_record(&address),
        ttl,
    ))
}

fn kernel_record(node: &str) -> KernelRecord {
    KernelRecord {
        node: node.into(),
        incarnation: "i".into(),
        tenant: "admin".into(),
        spec: "python3".into(),
        created: "2026-01-01T00:00:00.000000Z".into(),
        hibernated: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_has_one_owner_and_its_record_goes_with_the_owners_lease() -> Result<()> {
    let server = EtcdServer::start().await?;
    let etcd = client(&server)?;
    let a = etcd.grant(Duration::from_secs(2)).await?;
    let b = etcd.grant(Duration::from_secs(30)).await?;
    let key = kernel_key("k1");
    assert!(etcd.create(&key, b"node-a", a).await?);
    assert!(!etcd.create(&key, b"node-b", b).await?, "a second owner");
    assert!(!etcd.delete_if(&key, b"node-b").await?, "not b's to remove");
    let listing = etcd.list("/kernelgate/v1/").await?;
    assert_eq!(listing.entries.len(), 1);
    assert_eq!(listing.entries[0].value, b"node-a");
    assert_eq!(
        etcd.lease_of(&key).await?,
        Some(a),
        "the record is under a's lease"
    );
    assert_eq!(etcd.lease_of(&kernel_key("k2")).await?, None, "no such key");

    // a stops renewing: its record vanishes within etcd's lease granularity.
    let stopped = Instant::now();
    while !etcd.list("/kernelgate/v1/").await?.entries.is_empty() {
        assert!(
            stopped.elapsed() < Duration::from_secs(8),
            "the record outlived its lease"
        );
        assert!(etcd.keep_alive(b).await?, "b renews its own lease");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!etcd.keep_alive(a).await?, "the lapsed lease is gone");
    assert!(etcd.create(&key, b"node-b", b).await?, "b may claim it now");
    etcd.revoke(b).await?;
    assert!(etcd.list("/kernelgate/v1/").await?.entries.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_resumes_from_a_revision_and_says_when_history_is_compacted() -> Result<()> {
    let server = EtcdServer::start().await?;
    let etcd = client(&server)?;
    let lease = etcd.grant(Duration::from_secs(30)).await?;
    let first = etcd.put(&kernel_key("a"), b"1", lease).await?;
    etcd.put("/elsewhere", b"x", lease).await?;
    etcd.put(&kernel_key("b"), b"2", lease).await?;
    let mut watch = etcd.watch("/kernelgate/v1/", first + 1).await?;
    let batch = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await?
        .expect("a batch")?;
    assert!(
        matches!(&batch[..], [Event::Put(e)] if e.key == kernel_key("b")),
        "{batch:?}"
    );
    assert!(etcd.delete_if(&kernel_key("a"), b"1").await?);
    let batch = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await?
        .expect("a batch")?;
    assert!(
        matches!(&batch[..], [Event::Delete { key, .. }] if *key == kernel_key("a")),
        "{batch:?}"
    );

    // Compact past `first`: a watch from there cannot be served; the caller lists again.
    let now = etcd.list("/").await?.revision;
    reqwest::Client::new()
        .post(format!("{}/v3/kv/compaction", server.url()))
        .json(&serde_json::json!({"revision": now.to_string()}))
        .send()
        .await?
        .error_for_status()?;
    let mut stale = etcd.watch("/kernelgate/v1/", first).await?;
    let answer = tokio::time::timeout(Duration::from_secs(5), stale.next())
        .await?
        .expect("an answer");
    assert!(
        matches!(answer, Err(RegistryError::Compacted { .. })),
        "{answer:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_unreachable_and_leases_come_back_with_etcd() -> Result<()> {
    let mut server = EtcdServer::start().await?;
    let etcd = client(&server)?;
    let lease = etcd.grant(Duration::from_secs(10)).await?;
    etcd.put(&kernel_key("k"), b"n", lease).await?;
    server.kill()?;
    let answer = etcd.keep_alive(lease).await;
    assert!(
        matches!(answer, Err(RegistryError::Unreachable { .. })),
        "{answer:?}"
    );
    server.resume().await?;
    // etcd restores leases at their full TTL after a restart.
    assert!(etcd.keep_alive(lease).await?);
    assert_eq!(etcd.list("/kernelgate/v1/").await?.entries.len(), 1);
    Ok(())
}

/// Two nodes' memberships on a real etcd with a 3 s lease: each sees the other's kernel,
/// and when one stops renewing (as a node killed with SIGKILL does), the other's view loses
/// its kernel within the TTL plus etcd's lease granularity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_stops_renewing_loses_its_kernels_in_the_others_view() -> Result<()> {
    use tokio_util::sync::CancellationToken;

    let server = EtcdServer::start().await?;
    let ttl = Duration::from_secs(3);
    let a = member(&server, "a", ttl)?;
    let b = member(&server, "b", ttl)?;
    let a_stops = CancellationToken::new();
    let b_stops = CancellationToken::new();
    let a_keep = tokio::spawn(a.clone().keep(a_stops.clone(), |_| {}));
    tokio::spawn(b.clone().keep(b_stops.clone(), |_| {}));
    tokio::spawn(b.clone().follow(b_stops.clone()));
    let started = Instant::now();
    while !(a.registered() && b.registered()) {
        assert!(started.elapsed() < Duration::from_secs(5), "registration");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    a.claim("k1", &kernel_record("a")).await?;
    // Kernel records are not watched: b reads k1's when a request names it.
    assert_eq!(owner_seen(&b, "k1").await.as_deref(), Some("a"));

    // a stops renewing, as a killed node does.
    a_stops.cancel();
    a_keep.await?;
    let stopped = Instant::now();
    while owner_seen(&b, "k1").await.is_some() {
        assert!(
            stopped.elapsed() < ttl + Duration::from_secs(2),
            "b still sees a's kernel {:?} after a stopped",
            stopped.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "a's kernel left b's view {:?} after a stopped renewing (TTL {ttl:?})",
        stopped.elapsed()
    );
    assert!(!b.view().nodes.contains_key("a"));
    b_stops.cancel();
    Ok(())
}

/// A listing larger than a page (the client reads 1,000 keys a request) comes
/// whole, sorted, at one revision: the keys written while it was read are not in it, and a
/// watch from its revision + 1 sees them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_many_pages_is_whole_and_at_one_revision() -> Result<()> {
    use kernelgate::cluster::Change;
    let server = EtcdServer::start().await?;
    let etcd = client(&server)?;
    let lease = etcd.grant(Duration::from_secs(60)).await?;
    let total = 2 * kernelgate::cluster::etcd::PAGE + 345;
    let ids: Vec<String> = (0..total).map(|n| format!("k{n:05}")).collect();
    for chunk in ids.chunks(100) {
        let puts: Vec<Change> = chunk
            .iter()
            .map(|id| Change::Put {
                key: kernel_key(id),
                value: id.as_bytes().to_vec(),
                lease,
            })
            .collect();
        ensure!(etcd.txn(&[], &puts).await?, "a batch of puts");
    }
    let listing = etcd.list("/kernelgate/v1/kernels/").await?;
    let keys: Vec<String> = listing.entries.iter().map(|e| e.key.clone()).collect();
    let wanted: Vec<String> = ids.iter().map(|id| kernel_key(id)).collect();
    assert_eq!(keys.len(), total);
    assert_eq!(keys, wanted, "every key once, in order");
    assert!(listing
        .entries
        .iter()
        .all(|e| e.value == e.key.rsplit('/').next().unwrap_or("").as_bytes()));

    // Written after the listing: not in it, and the watch from its revision sees it.
    etcd.put(&kernel_key("later"), b"x", lease).await?;
    let mut watch = etcd
        .watch("/kernelgate/v1/kernels/", listing.revision + 1)
        .await?;
    let batch = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await?
        .context("a batch")??;
    assert!(
        matches!(&batch[..], [Event::Put(e)] if e.key == kernel_key("later")),
        "{batch:?}"
    );
    Ok(())
}

/// Turns authentication on in `server`'s etcd with user `root`, password `password`; the
/// steps etcd's documentation gives (`etcdctl role add root`, `user add`, `user grant-role`,
/// `auth enable`), through its JSON gateway.
async fn enable_auth(server: &EtcdServer, password: &str, again: bool) -> Result<()> {
    let http = reqwest::Client::new();
    let steps = [
        ("/v3/auth/role/add", serde_json::json!({"name": "root"})),
        (
            "/v3/auth/user/add",
            serde_json::json!({"name": "root", "password": password}),
        ),
        (
            "/v3/auth/user/grant",
            serde_json::json!({"user": "root", "role": "root"}),
        ),
        ("/v3/auth/enable", serde_json::json!({})),
    ];
    let skip = usize::from(again) * 3; // the user is there already: only `enable`
    for (path, body) in steps.into_iter().skip(skip) {
        let request = http.post(format!("{}{path}", server.url())).json(&body);
        let answer: serde_json::Value = request.send().await?.json().await?;
        anyhow::ensure!(answer.get("error").is_none(), "{path}: {answer}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_authentication_on_only_the_user_gets_in_and_a_stale_token_is_renewed() -> Result<()> {
    let server = EtcdServer::start().await?;
    enable_auth(&server, "s3cret", false).await?;

    let anonymous = client(&server)?;
    match anonymous.list("/kernelgate/v1/").await {
        Err(RegistryError::Refused(why)) => assert!(why.contains("user name"), "{why}"),
        other => panic!("an anonymous list: {other:?}"),
    }
    let wrong = client(&server)?.with_user("root", "guess");
    match wrong.list("/kernelgate/v1/").await {
        Err(RegistryError::Refused(why)) => assert!(why.contains("--etcd-user"), "{why}"),
        other => panic!("a wrong password: {other:?}"),
    }

    let etcd = client(&server)?.with_user("root", "s3cret");
    let lease = etcd.grant(Duration::from_secs(30)).await?;
    let at = etcd.put(&kernel_key("k1"), b"node-a", lease).await?;
    assert_eq!(etcd.list("/kernelgate/v1/").await?.entries.len(), 1);
    let mut watch = etcd.watch("/kernelgate/v1/", at).await?;
    let batch = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await?
        .expect("a batch")?;
    assert!(matches!(&batch[0], Event::Put(e) if e.key == kernel_key("k1")));

    // Authentication switched off and on again: every token etcd handed out is void. The
    // next call takes a new one and goes through.
    let root = reqwest::Client::new()
        .post(format!("{}/v3/auth/authenticate", server.url()))
        .json(&serde_json::json!({"name": "root", "password": "s3cret"}))
        .send()
        .await?
        .json::<serde_json::Value>()
        .await?;
    let token = root["token"].as_str().unwrap_or_default().to_owned();
    let disabled: serde_json::Value = reqwest::Client::new()
        .post(format!("{}/v3/auth/disable", server.url()))
        .header("authorization", &token)
        .json(&serde_json::json!({}))
        .send()
        .await?
        .json()
        .await?;
    assert!(disabled.get("error").is_none(), "{disabled}");
    enable_auth(&server, "s3cret", true).await?;
    assert!(etcd.keep_alive(lease).await?, "renewed with a new token");
    assert_eq!(etcd.list("/kernelgate/v1/").await?.entries.len(), 1);
    Ok(())
}

/// The flags of etcd's command line in deploy/kubernetes/etcd.yaml that bound its history
/// and its file (`--auto-compaction-*`, `--quota-backend-bytes`); deploy/swarm/kernelgate.yml
/// must give the same ones.
fn deployed_etcd_flags() -> Result<Vec<String>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let flags = |file: &str| -> Result<Vec<String>> {
        let text = std::fs::read_to_string(root.join(file)).with_context(|| file.to_owned())?;
        Ok(text
            .lines()
            .filter_map(|line| line.trim().strip_prefix("- "))
            .map(|arg| arg.trim_matches(['"', '\'']))
            .filter(|arg| {
                arg.starts_with("--auto-compaction-") || arg.starts_with("--quota-backend-bytes=")
            })
            .map(str::to_owned)
            .collect())
    };
    let kubernetes = flags("deploy/kubernetes/etcd.yaml")?;
    let swarm = flags("deploy/swarm/kernelgate.yml")?;
    ensure!(
        kubernetes.len() == 3,
        "deploy/kubernetes/etcd.yaml gives etcd {kubernetes:?}"
    );
    ensure!(
        swarm == kubernetes,
        "deploy/swarm/kernelgate.yml gives etcd {swarm:?}, Kubernetes {kubernetes:?}"
    );
    Ok(kubernetes)
}

/// The value of `--name=value` among `flags`.
fn flag<'a>(flags: &'a [String], name: &str) -> Option<&'a str> {
    flags
        .iter()
        .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
}

/// A periodic `--auto-compaction-retention`: a number of `s`, `m` or `h` (hours when bare,
/// as etcd reads it).
fn retention(value: &str) -> Result<Duration> {
    let digits = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    let (n, unit) = value.split_at(digits);
    let n: u64 = n.parse().with_context(|| format!("retention {value:?}"))?;
    Ok(Duration::from_secs(match unit {
        "s" => n,
        "m" => n * 60,
        "h" | "" => n * 3600,
        _ => bail!("retention {value:?}: not a number of s, m or h"),
    }))
}

/// etcd run with deploy/'s flags under steady churn (kernel records created and deleted
/// under a lease, about 40 writes/s, through the project's client) compacts its history:
/// revision 1 is gone, and the revisions it keeps are about a retention's worth of writes,
/// fewer than the writes made. It runs with the quota deploy/ states.
///
/// etcd's periodic compactor compacts, every retention, to the revision it noted a
/// retention before; it takes its first note when the member starts. A new member's first
/// compaction is therefore to revision 1 and drops nothing, and the first one that drops
/// history comes two retentions after the start (etcd 3.4: at 60 s to revision 1, at 120 s
/// to the revision of 66 s before). So the member is restarted after 20 s of churn: its
/// first compaction, a retention later, drops those 20 s, and the test takes about 85 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deployed_compaction_bounds_the_history_under_churn() -> Result<()> {
    use tokio::time::MissedTickBehavior;
    use tokio_util::sync::CancellationToken;

    let flags = deployed_etcd_flags()?;
    assert_eq!(flag(&flags, "--auto-compaction-mode"), Some("periodic"));
    let retention = retention(flag(&flags, "--auto-compaction-retention").context("retention")?)?;
    let quota: u64 = flag(&flags, "--quota-backend-bytes")
        .context("quota")?
        .parse()?;
    ensure!(
        retention <= Duration::from_secs(90),
        "a retention of {retention:?} is longer than this test waits for a compaction"
    );
    let mut server = EtcdServer::start_with(&flags).await?;
    let http = reqwest::Client::new();
    let metrics = http
        .get(format!("{}/metrics", server.url()))
        .send()
        .await?
        .text()
        .await?;
    let running: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("etcd_server_quota_backend_bytes "))
        .context("etcd's metrics name no quota")?
        .trim()
        .parse()?;
    assert_eq!(running, quota as f64, "the quota etcd runs with");

    let etcd = client(&server)?;
    let lease = etcd.grant(Duration::from_secs(60)).await?;
    let writes = Arc::new(AtomicU64::new(0));
    let stop = CancellationToken::new();
    let churn = tokio::spawn({
        let (etcd, writes, stop) = (etcd.clone(), writes.clone(), stop.clone());
        async move {
            let record = serde_json::to_vec(&kernel_record("churn")).unwrap_or_default();
            let mut tick = tokio::time::interval(Duration::from_millis(25));
            tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            for n in 0u64.. {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                // A create, then the delete of what it created: a revision each. A call
                // etcd does not answer (while it restarts) is not counted.
                let key = kernel_key(&format!("churn-{}", n / 2));
                let wrote = if n.is_multiple_of(2) {
                    etcd.put(&key, &record, lease).await.is_ok()
                } else {
                    etcd.delete_if(&key, &record).await.unwrap_or(false)
                };
                if wrote {
                    writes.fetch_add(1, Ordering::Relaxed);
                }
                if n.is_multiple_of(40) {
                    let _ = etcd.keep_alive(lease).await;
                }
            }
        }
    });
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(20)).await;
    server.kill()?;
    server.resume().await?;
    let restarted = Instant::now();
    let before_restart = writes.load(Ordering::Relaxed);

    // Every key (from \0 to the end) as it was at revision 1.
    let at_revision_1 =
        serde_json::json!({"key": "AA==", "range_end": "AA==", "revision": "1", "limit": "1"});
    let mut last = String::from("no compaction yet");
    let (compacted, current, made, bound, seen) = loop {
        ensure!(
            started.elapsed() < Duration::from_secs(150),
            "no compaction bounded the history within 150 s: {last}"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        let answer: serde_json::Value = http
            .post(format!("{}/v3/kv/range", server.url()))
            .json(&at_revision_1)
            .send()
            .await?
            .json()
            .await?;
        if !answer["error"]
            .as_str()
            .is_some_and(|e| e.contains("compacted"))
        {
            continue;
        }
        // How far: a watch from revision 1 names the oldest revision etcd keeps.
        let mut watch = etcd.watch("/kernelgate/v1/", 1).await?;
        let answer = tokio::time::timeout(Duration::from_secs(5), watch.next()).await?;
        let Some(Err(RegistryError::Compacted { compacted, .. })) = answer else {
            bail!("revision 1 is compacted, yet a watch from it answers {answer:?}");
        };
        let current = etcd.list("/kernelgate/v1/").await?.revision;
        let made = writes.load(Ordering::Relaxed);
        // A retention's worth of writes, with the compactor's step (a tenth of the
        // retention) and 5 s of slack.
        let rate = made as f64 / started.elapsed().as_secs_f64();
        let bound = (rate * (retention.as_secs_f64() * 1.1 + 5.0)) as i64;
        if current - compacted <= bound {
            break (compacted, current, made, bound, restarted.elapsed());
        }
        last = format!("compacted at {compacted}, at {current}: {made} writes, bound {bound}");
    };
    stop.cancel();
    churn.await?;
    let elapsed = started.elapsed();
    let kept = current - compacted;
    let status: serde_json::Value = http
        .post(format!("{}/v3/maintenance/status", server.url()))
        .json(&serde_json::json!({}))
        .send()
        .await?
        .json()
        .await?;
    println!(
        "etcd {flags:?}: compaction seen {seen:?} after its restart (test {elapsed:?}), at \
         revision {compacted}; at revision {current} it keeps {kept} revisions of the {made} \
         writes made ({before_restart} before the restart, {:.1}/s); bound {bound}; database \
         {} bytes, {} in use",
        made as f64 / elapsed.as_secs_f64(),
        status["dbSize"].as_str().unwrap_or("?"),
        status["dbSizeInUse"].as_str().unwrap_or("?"),
    );
    assert!(
        kept < i64::try_from(made)?,
        "etcd keeps {kept} revisions of {made} writes"
    );
    assert!(kept <= bound, "etcd keeps {kept} revisions, bound {bound}");
    Ok(())
}

/// Two nodes' memberships on a 3 s lease (renewed every second), each with a kernel. etcd
/// hangs (SIGSTOP) for 1.7 s, from 0.9 s after a renewal: the next renewal is sent into the
/// hang and answered only when etcd runs on, 2.6 s after the last one. That renewal is waited
/// for (the lease has time left), so for two TTLs after neither node counts as cut off or
/// registers again, each kernel's record is in etcd with its owner, and each node still sees
/// the other's kernel. (A renewal given up after a fixed 1.5 s would be tried again only after
/// etcd had expired the lease.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_etcd_shorter_than_the_lease_loses_no_lease() -> Result<()> {
    use tokio_util::sync::CancellationToken;

    let server = EtcdServer::start().await?;
    let ttl = Duration::from_secs(3);
    let a = member(&server, "a", ttl)?;
    let b = member(&server, "b", ttl)?;
    let stop = CancellationToken::new();
    for m in [&a, &b] {
        tokio::spawn(m.clone().keep(stop.clone(), |_| {}));
        tokio::spawn(m.clone().follow(stop.clone()));
    }
    let started = Instant::now();
    while !(a.registered() && b.registered()) {
        assert!(started.elapsed() < Duration::from_secs(5), "registration");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Renewals go out a whole number of seconds after this.
    let registered = Instant::now();
    a.claim("ka", &kernel_record("a")).await?;
    b.claim("kb", &kernel_record("b")).await?;
    let claimed = Instant::now();
    while owner_seen(&a, "kb").await.is_none() || owner_seen(&b, "ka").await.is_none() {
        assert!(
            claimed.elapsed() < Duration::from_secs(2),
            "each node sees the other's kernel"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let renewals_after = registered.elapsed().as_secs() + 1;
    let hang_at = registered + Duration::from_secs(renewals_after) + Duration::from_millis(900);
    tokio::time::sleep_until(hang_at.into()).await;
    server.pause()?;
    let paused = Instant::now();
    tokio::time::sleep(Duration::from_millis(1700)).await;
    server.unpause()?;
    let pause = paused.elapsed();
    println!("etcd was paused (SIGSTOP) for {pause:?}; TTL {ttl:?}");
    assert!(pause < ttl);

    let etcd = client(&server)?;
    let since = Instant::now();
    while since.elapsed() < 2 * ttl {
        let at = since.elapsed();
        for (m, name) in [(&a, "a"), (&b, "b")] {
            assert!(
                m.registered(),
                "{name} counts as cut off {at:?} after etcd ran on"
            );
            assert_eq!(
                m.reregistrations(),
                0,
                "{name} registered again {at:?} after etcd ran on"
            );
        }
        for (id, owner, other) in [("ka", "a", &b), ("kb", "b", &a)] {
            let key = kernel_key(id);
            let owners = etcd
                .list(&key)
                .await?
                .entries
                .iter()
                .filter(|e| e.key == key)
                .map(|e| serde_json::from_slice::<KernelRecord>(&e.value).map(|r| r.node))
                .collect::<Result<Vec<_>, _>>()?;
            assert_eq!(owners, [owner], "{id}'s record {at:?} after etcd ran on");
            assert_eq!(
                owner_seen(other, id).await.as_deref(),
                Some(owner),
                "{id} in the other node's view {at:?} after etcd ran on"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "for {:?} after etcd ran on: both registered, no registration again, both kernels \
         with their owners in etcd and in the other's view",
        since.elapsed()
    );
    stop.cancel();
    Ok(())
}
