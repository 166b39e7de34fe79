//! The cluster registry on a real etcd (Debian's etcd-server, on loopback): what cluster
//! mode relies on, as etcd really does it. Leases expire with their keys, a kernel can be
//! claimed once, a record is removed only by whoever holds its exact value, a watch resumes
//! from a revision and reports compaction, and an outage is an error the caller can tell.

use anyhow::Result;
use futures::StreamExt;
use kernelgate::cluster::etcd::Etcd;
use kernelgate::cluster::{kernel_key, Event, Registry, RegistryError};
use kernelgate_tests::etcd::EtcdServer;
use std::time::{Duration, Instant};

fn client(server: &EtcdServer) -> Result<Etcd> {
    Ok(Etcd::new(vec![server.url()], reqwest::Client::builder())?)
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
    use kernelgate::cluster::membership::Membership;
    use kernelgate::cluster::{KernelRecord, NodeRecord};
    use tokio_util::sync::CancellationToken;

    let server = EtcdServer::start().await?;
    let ttl = Duration::from_secs(3);
    let record = |address: &str| NodeRecord {
        address: address.into(),
        cluster_address: None,
        incarnation: uuid::Uuid::new_v4().to_string(),
        capacity: 2,
        load: 0,
        version: "test".into(),
        specs: vec!["python3".into()],
        warm: Default::default(),
        away: false,
    };
    let a = Membership::new(client(&server)?, "a", record("http://198.18.0.1:8888"), ttl);
    let b = Membership::new(client(&server)?, "b", record("http://198.18.0.2:8888"), ttl);
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
    let kernel = KernelRecord {
        node: "a".into(),
        incarnation: "i".into(),
        tenant: "admin".into(),
        spec: "python3".into(),
        created: "2026-01-01T00:00:00.000000Z".into(),
        hibernated: false,
    };
    a.claim("k1", &kernel).await?;
    let seen = Instant::now();
    while !b.view().kernels.contains_key("k1") {
        assert!(
            seen.elapsed() < Duration::from_secs(1),
            "b sees k1 within 1 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(b.view().kernels["k1"].node, "a");

    // a stops renewing, as a killed node does.
    a_stops.cancel();
    a_keep.await?;
    let stopped = Instant::now();
    while b.view().kernels.contains_key("k1") {
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
