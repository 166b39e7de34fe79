//! The kernel table against [`fake::FakeBackend`]: mock kernels in-process, so the pool,
//! the limit, deaths, culling and restarts are checked in seconds.

use super::fake::FakeBackend;
use super::*;
use crate::kernelspecs::DEFAULT_SPEC;
use crate::tenants::Tenant;
use futures::FutureExt;
use std::future::Future;

pub(super) fn specs(extra: &[&str], pools: &[&str]) -> Arc<KernelSpecs> {
    let strings = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    Arc::new(KernelSpecs::parse("kernel:1", &strings(extra), &strings(pools)).expect("valid"))
}

pub(super) fn admin() -> Arc<Tenant> {
    Tenant::admin("admin")
}

pub(super) fn settings() -> Settings {
    Settings {
        max_kernels: 4,
        startup_timeout: Duration::from_secs(10),
        autorestart: true,
        cull_idle_timeout: None,
        hibernate: Default::default(),
        heartbeat: HeartbeatCheck::default(),
        specs: specs(&[], &["0"]),
        audit: crate::audit::Audit::disabled(),
        guard: None,
        ledger: None,
        limits: ClientLimits {
            kernel_message_bytes: 1 << 20,
            buffer_bytes: 1 << 20,
            output_bytes: 1 << 30,
            replay_for: Duration::from_secs(60),
        },
        packages: None,
        templates: false,
        snapshots: Default::default(),
    }
}

pub(super) async fn table(settings: Settings) -> (Arc<Kernels>, Arc<FakeBackend>) {
    let fake = FakeBackend::new();
    let kernels = Kernels::new(
        fake.clone(),
        settings,
        TaskTracker::new(),
        CancellationToken::new(),
    );
    kernels.start().await;
    (kernels, fake)
}

/// Polls `done` every 20 ms for up to 10 s.
pub(super) async fn eventually<F: Future<Output = bool>>(what: &str, mut done: impl FnMut() -> F) {
    for _ in 0..500 {
        if done().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("not within 10 s: {what}");
}

/// A python3 kernel and its handle in the fake backend.
async fn one_kernel(kernels: &Arc<Kernels>, fake: &FakeBackend) -> (Arc<LiveKernel>, String) {
    let live = kernels
        .create(None, &BTreeMap::new(), &admin())
        .await
        .expect("created");
    let (handle, _) = fake.record_of(live.id()).expect("launched");
    (live, handle)
}

fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Warm kernels ready in the table's pools.
pub(super) fn pooled(kernels: &Kernels) -> usize {
    kernels.lock().pool.values().map(VecDeque::len).sum()
}

/// Slots of the limit held by creates under way.
fn reserved(kernels: &Kernels) -> usize {
    kernels.lock().reserved
}

#[tokio::test]
async fn the_pool_hands_out_kernels_with_their_environment_and_refills() {
    let (kernels, fake) = table(Settings {
        specs: specs(&["extra=extra:2"], &["2"]),
        ..settings()
    })
    .await;
    eventually("the pool filled", || async { pooled(&kernels) == 2 }).await;
    let live = kernels
        .create(None, &env(&[("KERNEL_USERNAME", "alice")]), &admin())
        .await
        .expect("created");
    let (_, record) = fake.record_of(live.id()).expect("launched by the fake");
    assert!(record.preload, "served from the pool");
    assert!(
        record
            .executed
            .iter()
            .any(|c| c.contains("environ.update") && c.contains("alice")),
        "{record:?}"
    );
    eventually("the pool refilled", || async { pooled(&kernels) == 2 }).await;
    assert_eq!(fake.records().len(), 3);

    // Other KERNEL_* variables cannot be set after start: such kernels start cold.
    let cold = kernels
        .create(None, &env(&[("KERNEL_LANG", "de")]), &admin())
        .await
        .expect("created");
    let (_, record) = fake.record_of(cold.id()).expect("launched");
    assert!(!record.preload);
    assert_eq!(
        record.env.get("KERNEL_LANG").map(String::as_str),
        Some("de")
    );
    assert_eq!(pooled(&kernels), 2, "the pool was not touched");

    // Another spec: its own image, no pool unless asked for.
    let extra = kernels
        .create(Some("extra"), &BTreeMap::new(), &admin())
        .await
        .expect("created");
    let (_, record) = fake.record_of(extra.id()).expect("launched");
    assert_eq!((record.image.as_str(), record.preload), ("extra:2", false));
    assert_eq!(extra.name, "extra");
    assert!(matches!(
        kernels
            .create(Some("nope"), &BTreeMap::new(), &admin())
            .await,
        Err(CreateError::NoSuchSpec { .. })
    ));
}

#[tokio::test]
async fn each_spec_keeps_its_own_pool() {
    let (kernels, fake) = table(Settings {
        specs: specs(&["extra=extra:2"], &["0", "extra=1"]),
        ..settings()
    })
    .await;
    eventually("the extra pool filled", || async { pooled(&kernels) == 1 }).await;
    let live = kernels
        .create(Some("extra"), &BTreeMap::new(), &admin())
        .await
        .expect("created");
    let (_, record) = fake.record_of(live.id()).expect("launched");
    assert_eq!((record.image.as_str(), record.preload), ("extra:2", true));
    let py = kernels
        .create(None, &BTreeMap::new(), &admin())
        .await
        .expect("created");
    let (_, record) = fake.record_of(py.id()).expect("launched");
    assert_eq!((record.image.as_str(), record.preload), ("kernel:1", false));
    eventually("the extra pool refilled", || async {
        pooled(&kernels) == 1
    })
    .await;
}

#[tokio::test]
async fn the_limit_holds_and_abandoned_creates_give_their_slot_back() {
    let (kernels, fake) = table(Settings {
        max_kernels: 2,
        ..settings()
    })
    .await;
    let none = BTreeMap::new();
    let a = kernels.create(None, &none, &admin()).await.expect("first");
    kernels.create(None, &none, &admin()).await.expect("second");
    assert!(matches!(
        kernels.create(None, &none, &admin()).await,
        Err(CreateError::TooMany { max: 2 })
    ));
    kernels
        .delete(a.id(), Removal::AskedBy("alice".into()))
        .await
        .expect("listed")
        .expect("removed");

    // Callers that give up at once: the kernels started for them are removed.
    for _ in 0..5 {
        let _ = tokio::time::timeout(
            Duration::from_millis(1),
            kernels.create(None, &none, &admin()),
        )
        .await;
    }
    eventually("abandoned creates rolled back", || async {
        reserved(&kernels) == 0 && fake.running() == kernels.list().len()
    })
    .await;
    assert_eq!(kernels.list().len(), 1);
    kernels
        .create(None, &none, &admin())
        .await
        .expect("the freed slot");
    assert_eq!(fake.running(), 2);
}

#[tokio::test]
async fn a_dead_kernel_is_restarted_or_reported_dead() {
    // A process that exits is noticed through the backend; one that hangs, through its
    // heartbeat.
    for hangs in [false, true] {
        for autorestart in [true, false] {
            let (kernels, fake) = table(Settings {
                autorestart,
                heartbeat: HeartbeatCheck {
                    every: Duration::from_millis(50),
                    timeout: Duration::from_millis(100),
                    misses: 3,
                },
                ..settings()
            })
            .await;
            let (live, handle) = one_kernel(&kernels, &fake).await;
            if hangs {
                fake.hang(&handle);
            } else {
                fake.kill(&handle);
            }
            let case = format!("hangs {hangs}, autorestart {autorestart}");
            if autorestart {
                eventually(&format!("restarted ({case})"), || async {
                    fake.records()[&handle].restarts == 1
                        && live.relay.execution_state() == ExecutionState::Idle
                })
                .await;
            } else {
                eventually(&format!("reported dead ({case})"), || async {
                    live.relay.execution_state() == ExecutionState::Dead
                })
                .await;
                assert_eq!(fake.records()[&handle].restarts, 0, "{case}");
            }
            assert!(kernels.get(live.id()).is_some(), "still listed ({case})");
        }
    }
}

#[tokio::test]
async fn idle_kernels_without_connections_are_culled() {
    let (kernels, fake) = table(Settings {
        cull_idle_timeout: Some(Duration::from_millis(300)),
        hibernate: Default::default(),
        ..settings()
    })
    .await;
    let (_, handle) = one_kernel(&kernels, &fake).await;
    eventually("culled", || async {
        kernels.list().is_empty() && fake.records()[&handle].removed
    })
    .await;
}

#[tokio::test]
async fn restart_keeps_the_id_and_answers_again() {
    let (kernels, fake) = table(settings()).await;
    let live = kernels
        .create(None, &BTreeMap::new(), &admin())
        .await
        .expect("created");
    kernels
        .supervisor()
        .restart(&live, "alice")
        .await
        .expect("restarted");
    let (_, record) = fake.record_of(live.id()).expect("launched");
    assert_eq!(record.restarts, 1);
    assert_eq!(live.relay.execution_state(), ExecutionState::Idle);
    assert_eq!(kernels.list().len(), 1);
    kernels.shutdown().await;
    assert_eq!(fake.running(), 0);
}

#[tokio::test]
async fn abandoned_deletes_and_restarts_complete() {
    let (kernels, fake) = table(settings()).await;
    let (deleted, deleted_handle) = one_kernel(&kernels, &fake).await;
    let (restarted, restarted_handle) = one_kernel(&kernels, &fake).await;
    // Callers that go away right after asking: the backend has not answered yet.
    // Polled once, then dropped.
    assert!(kernels
        .delete(deleted.id(), Removal::AskedBy("alice".into()))
        .now_or_never()
        .is_none());
    assert!(kernels
        .supervisor()
        .restart(&restarted, "alice")
        .now_or_never()
        .is_none());
    assert!(
        kernels.get(deleted.id()).is_none(),
        "gone from the table at once"
    );
    eventually("the delete and the restart completed", || async {
        let records = fake.records();
        records[&deleted_handle].removed
            && records[&restarted_handle].restarts == 1
            && restarted.relay.execution_state() == ExecutionState::Idle
    })
    .await;
    assert_eq!(deleted.relay.execution_state(), ExecutionState::Dead);
    assert_eq!(fake.running(), 1);
}

#[tokio::test]
async fn kernels_ready_after_shutdown_began_are_not_kept() {
    let (kernels, fake) = table(settings()).await;
    let late = kernels
        .launch(
            DEFAULT_SPEC,
            BTreeMap::new(),
            false,
            None,
            Limits::default(),
        )
        .await
        .expect("started");
    let slot = kernels.reserve(&admin()).expect("a free slot");
    kernels.cancel.cancel();
    kernels.shutdown().await;
    // Shutdown's sweep is over: registering now would leave the kernel running.
    assert!(!slot.fill(&late), "not registered");
    assert!(!kernels.pool().add(DEFAULT_SPEC, &late), "not pooled");
    assert_eq!((kernels.list().len(), pooled(&kernels)), (0, 0));
    assert_eq!(reserved(&kernels), 0, "the slot was given back");
    kernels.discard(&late).await.expect("removed");
    assert_eq!(fake.running(), 0);
}

#[test]
fn env_keeps_only_kernel_vars() {
    let env: BTreeMap<String, String> = [
        ("KERNEL_WORKING_DIR", "/home/me"),
        ("PATH", "/evil"),
        ("LD_PRELOAD", "x.so"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let kept = kernel_env(&env).expect("valid");
    assert_eq!(kept.keys().collect::<Vec<_>>(), ["KERNEL_WORKING_DIR"]);
    let bad: BTreeMap<String, String> = [("KERNEL_x;rm".to_owned(), "1".to_owned())].into();
    assert!(matches!(kernel_env(&bad), Err(CreateError::BadEnv { .. })));
}

pub(super) fn tenant(name: &str, max_kernels: Option<usize>) -> Arc<Tenant> {
    Arc::new(Tenant {
        name: name.into(),
        admin: false,
        max_kernels,
        max_hibernated: None,
        max_memory_mb: None,
        max_cpus: None,
        max_snapshots: None,
        snapshot_max_mb: None,
        revoked: CancellationToken::new(),
    })
}

#[tokio::test]
async fn a_key_limit_holds_under_concurrent_creates_and_owners_are_kept() {
    let (kernels, fake) = table(Settings {
        max_kernels: 10,
        ..settings()
    })
    .await;
    let (alice, bob) = (tenant("alice", Some(2)), tenant("bob", None));
    let none = BTreeMap::new();
    let results =
        futures::future::join_all((0..8).map(|_| kernels.create(None, &none, &alice))).await;
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 2);
    for refused in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(
            matches!(refused, CreateError::TooManyForKey { max: 2, key } if key == "alice"),
            "{refused}"
        );
        assert!(refused.to_string().contains("max_kernels"));
    }
    let b = kernels
        .create(None, &none, &bob)
        .await
        .expect("bob has a count of his own");
    assert_eq!(b.owner(), "bob");
    let owners = |name: &str| kernels.list().iter().filter(|l| l.owner() == name).count();
    assert_eq!(owners("alice"), 2);
    assert_eq!(kernels.remove_owned_by("alice").await.len(), 2);
    assert_eq!((owners("alice"), owners("bob")), (0, 1));
    assert_eq!(fake.running(), 1);
    kernels
        .create(None, &none, &alice)
        .await
        .expect("room for alice again");
}

/// Runs `code` on the kernel as a client would; the reply's status, ename and evalue.
async fn run_code(live: &LiveKernel, code: &str) -> (String, String, String) {
    use kernelgate_protocol::content::ExecuteRequest;
    use kernelgate_protocol::{Channel, Execution, RawJson};
    let me = live.relay.attach("test-client", true, "admin");
    let message = live.relay.request(
        "execute_request",
        RawJson::from_value(&ExecuteRequest::new(code)),
    );
    let mut execution = Execution::new(message.msg_id());
    me.send(Channel::Shell, message).await.expect("sent");
    while !execution.is_done() {
        let batch = tokio::time::timeout(Duration::from_secs(10), me.recv())
            .await
            .expect("an answer within 10 s")
            .expect("session open");
        for out in batch {
            execution.feed(out.channel, &out.message);
        }
    }
    let reply = execution.reply().expect("a reply");
    (
        reply.status.clone(),
        reply.ename.clone(),
        reply.evalue.clone(),
    )
}

#[test]
fn restarts_back_off_boundedly() {
    let waits: Vec<u64> = (1..=4).map(|n| supervise::backoff(n).as_secs()).collect();
    assert_eq!(waits, [1, 3, 9, 10]);
    assert_eq!(supervise::RESTART_TRIES, 3);
}

#[tokio::test]
async fn a_kernel_that_dies_again_while_it_restarts_is_tried_again() {
    let (kernels, fake) = table(settings()).await;
    let (live, handle) = one_kernel(&kernels, &fake).await;
    let started = std::time::Instant::now();
    // Out of memory, then again while its restart starts.
    fake.doom_next_starts(1);
    fake.oom(&handle);
    eventually("back after a second try", || async {
        fake.records()[&handle].restarts == 2
            && live.relay.execution_state() == ExecutionState::Idle
    })
    .await;
    let took = started.elapsed();
    assert!(
        took >= supervise::backoff(1) && took < Duration::from_secs(5),
        "one back-off, not the startup timeout: {took:?}"
    );
    assert_eq!(run_code(&live, "1").await.0, "ok");
}

#[tokio::test]
async fn a_cell_sent_between_a_death_and_the_restart_runs_on_the_next_process() {
    let (kernels, fake) = table(settings()).await;
    let (live, handle) = one_kernel(&kernels, &fake).await;
    // The process stops answering and its death has been dealt with; the restart has not
    // begun. A cell sent now must wait for the next process, not go to the dead one's
    // sockets, where nothing would ever answer it.
    fake.hang(&handle);
    let lost = Event::lost("KernelDied", "the kernel ran out of memory", false);
    let _ = live.relay.step(lost).await;
    let cell = tokio::spawn({
        let live = live.clone();
        async move { run_code(&live, "1").await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!cell.is_finished(), "held for the next process");
    kernels
        .supervisor()
        .restart(&live, "admin")
        .await
        .expect("restarted");
    let (status, ename, _) = cell.await.expect("the cell's task");
    assert_eq!((status.as_str(), ename.as_str()), ("ok", ""));
}

#[tokio::test]
async fn a_restart_that_keeps_failing_gives_up_fast_and_says_what_to_do() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("audit.log");
    let (kernels, fake) = table(Settings {
        audit: crate::audit::Audit::open(&log, false).expect("audit log"),
        ..settings()
    })
    .await;
    let (live, handle) = one_kernel(&kernels, &fake).await;
    let started = std::time::Instant::now();
    fake.doom_next_starts(supervise::RESTART_TRIES);
    fake.oom(&handle);
    eventually("declared dead", || async {
        live.relay.execution_state() == ExecutionState::Dead
    })
    .await;
    let took = started.elapsed();
    let backoffs = supervise::backoff(1) + supervise::backoff(2);
    assert!(
        took >= backoffs && took < Duration::from_secs(8),
        "{} tries with back-off, well under the 10 s startup timeout: {took:?}",
        supervise::RESTART_TRIES
    );
    assert_eq!(fake.records()[&handle].restarts, 3);

    // Later calls fail at once, saying why and what brings the kernel back.
    let (status, ename, evalue) = run_code(&live, "1").await;
    assert_eq!(
        (status.as_str(), ename.as_str()),
        ("error", "KernelUnavailable")
    );
    assert!(
        evalue.contains("ran out of memory (limit 64 MiB)")
            && evalue.contains(&format!("POST /api/kernels/{}/restart", live.id()))
            && evalue.contains("delete it"),
        "{evalue}"
    );
    let trail = std::fs::read_to_string(&log).expect("audit");
    let failed: Vec<serde_json::Value> = trail
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|r: &serde_json::Value| r["event"] == "kernel_restart_failed")
        .collect();
    assert_eq!(failed.len(), 1, "{trail}");
    assert_eq!(failed[0]["kernel"], live.id());
    assert_eq!(failed[0]["tries"], 3);
    assert!(failed[0]["why"]
        .as_str()
        .is_some_and(|w| w.contains("ran out of memory")));

    // What the message says works, and the kernel is watched again: its next death is
    // seen and it comes back.
    kernels
        .supervisor()
        .restart(&live, "alice")
        .await
        .expect("restarted by hand");
    assert_eq!(run_code(&live, "1").await.0, "ok");
    fake.oom(&handle);
    eventually("restarted after its next death", || async {
        fake.records()[&handle].restarts == 5
            && live.relay.execution_state() == ExecutionState::Idle
    })
    .await;
}

#[tokio::test]
async fn a_kernel_left_stuck_by_running_out_of_memory_is_named_so_before_its_heartbeat() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("audit.log");
    let (kernels, fake) = table(Settings {
        audit: crate::audit::Audit::open(&log, false).expect("audit log"),
        ..settings()
    })
    .await;
    let (live, handle) = one_kernel(&kernels, &fake).await;
    // A process the kernel started is the one killed: the kernel answers on, left alone.
    fake.oom_of_a_child(&handle);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(fake.records()[&handle].restarts, 0);
    assert_eq!(run_code(&live, "1").await.0, "ok");

    // The kernel itself is stuck (gVisor): named as out of memory, with the limit, within
    // `eventually`'s 10 s, where the heartbeat would take 15 s.
    fake.oom_stuck(&handle);
    eventually("restarted", || async {
        fake.records()[&handle].restarts == 1
            && live.relay.execution_state() == ExecutionState::Idle
    })
    .await;
    let trail = std::fs::read_to_string(&log).expect("audit");
    let died: Vec<serde_json::Value> = trail
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|r: &serde_json::Value| r["event"] == "kernel_died")
        .collect();
    assert_eq!(died.len(), 1, "{trail}");
    assert_eq!(
        died[0]["why"],
        format!(
            "the kernel ran out of memory (limit {} MiB)",
            fake::MEMORY_MB
        )
    );
}

#[tokio::test]
async fn a_restart_moves_the_kernel_into_a_warm_one_when_one_fits() {
    let (kernels, fake) = table(Settings {
        specs: specs(&[], &["1"]),
        ..settings()
    })
    .await;
    eventually("the pool filled", || async { pooled(&kernels) == 1 }).await;
    let live = kernels
        .create(None, &env(&[("KERNEL_USERNAME", "alice")]), &admin())
        .await
        .expect("created");
    eventually("the pool refilled", || async { pooled(&kernels) == 1 }).await;
    let before = live.handle();
    let warm = kernels.lock().pool[DEFAULT_SPEC][0].handle();

    kernels
        .supervisor()
        .restart(&live, "alice")
        .await
        .expect("restarted");
    assert_eq!(live.handle(), warm, "moved into the warm kernel's process");
    assert_eq!(
        kernels.get(live.id()).map(|l| l.handle()),
        Some(warm.clone())
    );
    let records = fake.records();
    assert_eq!(
        records[&before].restarts, 0,
        "its container was not restarted"
    );
    assert_eq!(records[&warm].serves.as_deref(), Some(live.id()));
    assert_eq!(records[&warm].owner.as_deref(), Some("admin"));
    assert!(
        records[&warm].executed.iter().any(|c| c.contains("alice")),
        "the warm kernel got the kernel's environment"
    );
    eventually("the old container removed, the new one renamed", || async {
        let r = fake.records();
        r[&before].removed && r[&warm].renamed_to.as_deref() == Some(live.id())
    })
    .await;
    assert_eq!(run_code(&live, "1").await.0, "ok");
    eventually("the pool refilled", || async { pooled(&kernels) == 1 }).await;

    // Its death is watched in its new process.
    fake.kill(&warm);
    eventually("restarted again", || async {
        live.handle() != warm && live.relay.execution_state() == ExecutionState::Idle
    })
    .await;

    // A kernel with variables a warm kernel cannot be given restarts its own container.
    let cold = kernels
        .create(None, &env(&[("KERNEL_LANG", "de")]), &admin())
        .await
        .expect("created");
    eventually("the pool refilled", || async { pooled(&kernels) == 1 }).await;
    let handle = cold.handle();
    kernels
        .supervisor()
        .restart(&cold, "alice")
        .await
        .expect("restarted");
    assert_eq!(cold.handle(), handle);
    assert_eq!(fake.records()[&handle].restarts, 1);
    assert_eq!(pooled(&kernels), 1, "the pool was not touched");
}

#[tokio::test]
async fn a_restarted_gateway_finds_moved_kernels_and_pools_warm_ones_again() {
    let settings = || Settings {
        specs: specs(&[], &["1"]),
        ..settings()
    };
    let (first, fake) = table(settings()).await;
    eventually("the pool filled", || async { pooled(&first) == 1 }).await;
    let live = first
        .create(None, &BTreeMap::new(), &admin())
        .await
        .expect("created");
    eventually("the pool refilled", || async { pooled(&first) == 1 }).await;
    first
        .supervisor()
        .restart(&live, "alice")
        .await
        .expect("restarted into the warm kernel");
    let moved_to = live.handle();
    eventually("the pool refilled again", || async {
        pooled(&first) == 1 && fake.records().values().filter(|r| r.removed).count() == 1
    })
    .await;
    let warm = first.lock().pool[DEFAULT_SPEC][0].handle();
    let launched = fake.records().len();
    // A crash: the gateway's tasks stop, its kernels stay.
    first.cancel.cancel();

    let second = Kernels::new(
        fake.clone(),
        settings(),
        TaskTracker::new(),
        CancellationToken::new(),
    );
    second.start().await;
    let listed: Vec<(String, String)> = second
        .list()
        .iter()
        .map(|l| (l.id().to_owned(), l.handle()))
        .collect();
    assert_eq!(
        listed,
        [(live.id().to_owned(), moved_to)],
        "the kernel, in the container it moved into; the warm kernel is not listed"
    );
    assert_eq!(second.list()[0].owner(), "admin");
    assert_eq!(pooled(&second), 1);
    assert_eq!(second.lock().pool[DEFAULT_SPEC][0].handle(), warm);
    assert_eq!(fake.records().len(), launched, "nothing new started");
    second.cancel.cancel();

    // Without a pool the warm kernel is removed.
    let third = Kernels::new(
        fake.clone(),
        Settings {
            specs: specs(&[], &["0"]),
            ..settings()
        },
        TaskTracker::new(),
        CancellationToken::new(),
    );
    third.start().await;
    assert_eq!(third.list().len(), 1);
    assert_eq!(pooled(&third), 0);
    assert!(fake.records()[&warm].removed);
    third.shutdown().await;
    assert_eq!(fake.running(), 0);
}

#[tokio::test]
async fn a_kernel_that_dies_while_it_starts_fails_its_create_at_once() {
    let (kernels, fake) = table(settings()).await;
    fake.doom_next_starts(1);
    let started = std::time::Instant::now();
    let refused = kernels
        .create(None, &BTreeMap::new(), &admin())
        .await
        .expect_err("died while it started");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "not the 10 s startup timeout"
    );
    assert_eq!(
        refused.to_string(),
        "the kernel ran out of memory (limit 64 MiB) while it started"
    );
    eventually("its container removed and its slot given back", || async {
        fake.running() == 0 && reserved(&kernels) == 0
    })
    .await;
    assert!(kernels.list().is_empty());
}
