//! A node's membership against the in-memory registry: views, one owner per kernel,
//! outages, a restarted node's records, the reconcile.
use super::*;
use crate::cluster::memory::Memory;
use crate::cluster::{quota_key, Event, PREFIX};
use crate::kernels::ledger::{ClaimRefused, Ledger};
use tokio_util::sync::CancellationToken;

fn node(address: &str) -> NodeRecord {
    NodeRecord {
        address: address.into(),
        cluster_address: None,
        incarnation: "i1".into(),
        capacity: 2,
        load: 0,
        version: "0".into(),
        specs: vec!["python3".into()],
        warm: Default::default(),
        away: false,
        indexed: true,
    }
}

fn kernel(node: &str) -> KernelRecord {
    KernelRecord {
        node: node.into(),
        incarnation: "i1".into(),
        tenant: "admin".into(),
        spec: "python3".into(),
        created: "2026-01-01T00:00:00.000000Z".into(),
        hibernated: false,
    }
}

/// Nodes "a" and "b" on `store`, TTL 3 s, keeping their leases and following the
/// registry until `cancel`.
fn two_nodes(
    store: &Memory,
    cancel: &CancellationToken,
) -> (Arc<Membership<Memory>>, Arc<Membership<Memory>>) {
    let ttl = Duration::from_secs(3);
    let a = Membership::new(store.clone(), "a", node("http://a"), ttl);
    let b = Membership::new(store.clone(), "b", node("http://b"), ttl);
    for m in [&a, &b] {
        tokio::spawn(m.clone().keep(cancel.clone(), |_| {}));
        tokio::spawn(m.clone().follow(cancel.clone()));
    }
    (a, b)
}

async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn nodes_see_each_other_and_a_kernel_has_one_owner() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let (a, b) = two_nodes(&store, &cancel);
    settle().await;
    assert!(a.registered() && b.registered());
    a.claim("k1", &kernel("a")).await.expect("a claims k1");
    assert!(matches!(
        b.claim("k1", &kernel("b")).await,
        Err(ClaimError::Taken(_))
    ));
    tokio::time::sleep(Duration::from_millis(600)).await;
    let view = b.view();
    assert_eq!(view.nodes.len(), 2);
    // Kernel records are not watched: b reads k1's when asked, and finds it in the index.
    assert!(view.kernels.is_empty(), "{view:?}");
    assert_eq!(b.view_finding("k1").await.kernels["k1"].node, "a");
    let indexed = b.kernels_of(Some("admin")).await.expect("index");
    assert_eq!(indexed, vec![("k1".to_owned(), kernel("a"))]);
    a.release("k1").await.expect("release");
    // b's cache still names a, whose answer would be 404; once forgotten, it reads again.
    b.forget_owner("k1");
    assert!(b.view_finding("k1").await.kernels.is_empty());
    assert!(b.kernels_of(None).await.expect("index").is_empty());
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn an_outage_longer_than_the_ttl_cuts_the_node_off_until_it_registers_again() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let ttl = Duration::from_secs(3);
    let a = Membership::new(store.clone(), "a", node("http://a"), ttl);
    tokio::spawn(a.clone().keep(cancel.clone(), |_| {}));
    settle().await;
    a.claim("k1", &kernel("a")).await.expect("claim");
    store.set_down(true);
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(!a.registered(), "no renewal for a whole TTL: cut off");
    assert!(matches!(
        a.claim("k2", &kernel("a")).await,
        Err(ClaimError::CutOff) | Err(ClaimError::Registry(_))
    ));
    // Meanwhile etcd expired the lease: the records are gone from the store.
    store.set_down(false);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(a.registered(), "registered again");
    assert!(a.reregistrations() >= 1);
    let listing = store.list(PREFIX).await.expect("list");
    let keys: Vec<&str> = listing.entries.iter().map(|e| e.key.as_str()).collect();
    let index = crate::cluster::tenant_key("admin", "k1");
    let load = crate::cluster::load_key("a");
    assert_eq!(
        keys,
        vec![kernel_key("k1"), load, node_key("a"), index],
        "{keys:?}"
    );
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_kernel_claimed_by_another_node_meanwhile_stays_theirs() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let ttl = Duration::from_secs(3);
    let a = Membership::new(store.clone(), "a", node("http://a"), ttl);
    // a's record of k1 is adopted, but b registered k1 first.
    a.adopt("k1", &kernel("a"));
    let lease = store.grant(Duration::from_secs(60)).await.expect("grant");
    let theirs = serde_json::to_vec(&kernel("b")).expect("json");
    assert!(store
        .create(&kernel_key("k1"), &theirs, lease)
        .await
        .expect("create"));
    let lost = Arc::new(Mutex::new(Vec::new()));
    let heard = lost.clone();
    tokio::spawn(a.clone().keep(cancel.clone(), move |lost| {
        heard.lock().expect("lock").extend(lost.taken)
    }));
    settle().await;
    assert_eq!(*lost.lock().expect("lock"), vec!["k1".to_owned()]);
    let listing = store.list(&kernel_key("k1")).await.expect("list");
    assert_eq!(listing.entries[0].value, theirs, "never two owners");
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_node_back_before_its_old_lease_ran_out_takes_its_records_back() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let ttl = Duration::from_secs(3);
    // Its previous run holds k1 under a lease that has not run out.
    let old_lease = store.grant(Duration::from_secs(60)).await.expect("grant");
    let before = serde_json::to_vec(&kernel("a")).expect("json");
    assert!(store
        .create(&kernel_key("k1"), &before, old_lease)
        .await
        .expect("create"));
    let mut again = node("http://a");
    again.incarnation = "i2".into();
    let a = Membership::new(store.clone(), "a", again, ttl);
    let mut adopted = kernel("a");
    adopted.incarnation = "i2".into();
    a.adopt("k1", &adopted);
    let lost = Arc::new(Mutex::new(Vec::new()));
    let heard = lost.clone();
    tokio::spawn(a.clone().keep(cancel.clone(), move |lost| {
        heard.lock().expect("lock").extend(lost.taken)
    }));
    settle().await;
    assert!(a.registered());
    assert!(lost.lock().expect("lock").is_empty(), "k1 is still a's");
    // The record is the new run's, under its lease: the old lease's end leaves it.
    store.revoke(old_lease).await.expect("revoke");
    let listing = store.list(&kernel_key("k1")).await.expect("list");
    let held: KernelRecord = serde_json::from_slice(&listing.entries[0].value).expect("json");
    assert_eq!((held.node.as_str(), held.incarnation.as_str()), ("a", "i2"));
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn the_reconcile_removes_stale_records_and_registers_what_is_missing() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let (a, b) = two_nodes(&store, &cancel);
    settle().await;
    a.claim("gone", &kernel("a")).await.expect("claim");
    b.claim("bs", &kernel("b")).await.expect("claim");
    // a runs "running" and "bs" is b's: a's view of its own kernels is what it runs.
    let local = [(
        "running".to_owned(),
        "admin".to_owned(),
        "python3".to_owned(),
    )];
    settle().await;
    let fixed = a.reconcile(&local).await.expect("reconcile");
    assert_eq!(
        fixed,
        Reconciled {
            stale_records: 1,
            unregistered_kernels: 1,
            ..Reconciled::default()
        }
    );
    let keys: Vec<String> = store
        .list(&format!("{PREFIX}kernels/"))
        .await
        .expect("list")
        .entries
        .into_iter()
        .map(|e| e.key)
        .collect();
    assert_eq!(
        keys,
        [kernel_key("bs"), kernel_key("running")],
        "b's record stays"
    );
    settle().await;
    let again = a.reconcile(&local).await.expect("reconcile");
    assert_eq!(again, Reconciled::default(), "nothing left to fix");
    // A claim after the reconcile registered the kernel is still this node's.
    a.claim("running", &kernel("a")).await.expect("claim");
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_node_that_steps_away_keeps_its_kernels_registered_past_its_ttl() {
    let store = Memory::new();
    let (cancel, a_stops) = (CancellationToken::new(), CancellationToken::new());
    let ttl = Duration::from_secs(3);
    let a = Membership::new(store.clone(), "a", node("http://a"), ttl);
    let b = Membership::new(store.clone(), "b", node("http://b"), ttl);
    tokio::spawn(a.clone().keep(a_stops.clone(), |_| {}));
    tokio::spawn(b.clone().keep(cancel.clone(), |_| {}));
    tokio::spawn(b.clone().follow(cancel.clone()));
    settle().await;
    a.claim("k1", &kernel("a")).await.expect("a claims k1");
    // SIGTERM: its loops stop, and it steps away for 60 s.
    a_stops.cancel();
    a.step_away(Duration::from_secs(60))
        .await
        .expect("stepped away");
    // Well past the 3 s TTL, b still sees k1 as a's, and a as away.
    tokio::time::sleep(Duration::from_secs(20)).await;
    settle().await;
    let view = b.view_finding("k1").await;
    assert_eq!(view.kernels.get("k1").map(|k| k.node.as_str()), Some("a"));
    assert!(view.nodes.get("a").is_some_and(|n| n.away), "{view:?}");
    // Past the away lease, nothing of a's is left.
    tokio::time::sleep(Duration::from_secs(60)).await;
    settle().await;
    // The cache named a; a has left the view, so the record is read again: gone.
    let view = b.view_finding("k1").await;
    assert!(
        view.kernels.is_empty() && !view.nodes.contains_key("a"),
        "{view:?}"
    );
    cancel.cancel();
}

/// A kernel of `tenant` claimed by `m` the way a create claims it: its slot reserved
/// first, then the record and the slot together.
async fn create_for(
    m: &Membership<Memory>,
    id: &str,
    tenant: &str,
    max: usize,
) -> Result<(), ClaimRefused> {
    let reservation = Ledger::reserve(m, tenant, Some(max)).await?;
    Ledger::claim(m, id, tenant, "python3", reservation).await
}

/// The kernel ids `tenant`'s quota slots name, by slot.
async fn slots_of(store: &Memory, tenant: &str) -> Vec<(String, String)> {
    store
        .list(&format!("{PREFIX}quota/{tenant}/"))
        .await
        .expect("list")
        .entries
        .into_iter()
        .map(|e| (e.key, String::from_utf8_lossy(&e.value).into_owned()))
        .collect()
}

/// The kernels a node's registration refused for their key's quota, with the key.
type Refused = Arc<Mutex<Vec<(String, String)>>>;

/// Node "a" run again on the same runtime directory: a new incarnation that re-adopts
/// `kernels` (running, alice may hold `max`), and keeps its lease; what it lost.
fn restarted(
    store: &Memory,
    kernels: &[&str],
    max: Option<usize>,
    cancel: &CancellationToken,
) -> (Arc<Membership<Memory>>, Refused) {
    let mut again = node("http://a");
    again.incarnation = "i2".into();
    let a = Membership::new(store.clone(), "a", again, Duration::from_secs(3));
    a.set_quotas(Box::new(move |name| {
        (name == "alice").then_some(max).flatten()
    }));
    for id in kernels {
        Ledger::adopt(&*a, id, "alice", "python3", true);
    }
    let refused = Arc::new(Mutex::new(Vec::new()));
    let heard = refused.clone();
    tokio::spawn(a.clone().keep(cancel.clone(), move |lost| {
        heard.lock().expect("lock").extend(lost.over_quota)
    }));
    (a, refused)
}

#[tokio::test(start_paused = true)]
async fn a_kernel_taken_back_after_a_crash_takes_its_quota_slot_back_in_the_same_step() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let a_dies = CancellationToken::new();
    let ttl = Duration::from_secs(3);
    let a = Membership::new(store.clone(), "a", node("http://a"), ttl);
    let b = Membership::new(store.clone(), "b", node("http://b"), ttl);
    tokio::spawn(a.clone().keep(a_dies.clone(), |_| {}));
    tokio::spawn(b.clone().keep(cancel.clone(), |_| {}));
    settle().await;
    create_for(&a, "k1", "alice", 2).await.expect("k1");
    create_for(&a, "k2", "alice", 2).await.expect("k2");
    // kill -9 of a, back before its lease ran out: its kernels and their slots are its own.
    a_dies.cancel();
    let (a2, refused) = restarted(&store, &["k1", "k2"], Some(2), &cancel);
    settle().await;
    assert!(a2.registered());
    assert!(refused.lock().expect("lock").is_empty());
    let held = |store: Memory| async move {
        let mut ids: Vec<String> = slots_of(&store, "alice")
            .await
            .into_iter()
            .map(|(_, id)| id)
            .collect();
        ids.sort();
        ids
    };
    assert_eq!(held(store.clone()).await, ["k1", "k2"]);
    // The quota is exact: a third create through the other node is refused.
    assert!(matches!(
        create_for(&b, "k3", "alice", 2).await,
        Err(ClaimRefused::Quota { max: 2, .. })
    ));
    // The old run's lease ends: the records and slots are the new run's, and stay.
    tokio::time::sleep(Duration::from_secs(5)).await;
    settle().await;
    assert_eq!(held(store.clone()).await, ["k1", "k2"]);
    assert_eq!(
        store
            .list(&format!("{PREFIX}kernels/"))
            .await
            .expect("list")
            .entries
            .len(),
        2
    );
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_kernel_taken_back_after_its_slot_was_taken_is_refused_naming_the_key() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let a_dies = CancellationToken::new();
    let ttl = Duration::from_secs(3);
    let a = Membership::new(store.clone(), "a", node("http://a"), ttl);
    let b = Membership::new(store.clone(), "b", node("http://b"), ttl);
    tokio::spawn(a.clone().keep(a_dies.clone(), |_| {}));
    tokio::spawn(b.clone().keep(cancel.clone(), |_| {}));
    settle().await;
    create_for(&a, "k1", "alice", 1).await.expect("k1");
    // kill -9 of a: its lease runs out, and with it k1's record and slot; alice creates
    // another kernel through b meanwhile.
    a_dies.cancel();
    tokio::time::sleep(Duration::from_secs(5)).await;
    settle().await;
    assert!(
        slots_of(&store, "alice").await.is_empty(),
        "gone with a's lease"
    );
    create_for(&b, "k2", "alice", 1).await.expect("k2");
    // a is back with k1: the key is at its limit, k1 is refused, naming the key.
    let (a2, refused) = restarted(&store, &["k1"], Some(1), &cancel);
    settle().await;
    assert!(a2.registered());
    assert_eq!(
        *refused.lock().expect("lock"),
        vec![("k1".to_owned(), "alice".to_owned())]
    );
    assert!(store
        .list(&kernel_key("k1"))
        .await
        .expect("list")
        .entries
        .is_empty());
    assert_eq!(
        slots_of(&store, "alice").await,
        [(quota_key("alice", 0), "k2".to_owned())]
    );
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_delete_after_a_stop_and_restart_frees_the_slot_at_once() {
    for knows_the_quota in [true, false] {
        let store = Memory::new();
        let cancel = CancellationToken::new();
        let (a_stops, b) = (
            CancellationToken::new(),
            Membership::new(store.clone(), "b", node("http://b"), Duration::from_secs(3)),
        );
        let a = Membership::new(store.clone(), "a", node("http://a"), Duration::from_secs(3));
        tokio::spawn(a.clone().keep(a_stops.clone(), |_| {}));
        tokio::spawn(b.clone().keep(cancel.clone(), |_| {}));
        settle().await;
        create_for(&a, "k1", "alice", 1).await.expect("k1");
        // SIGTERM: a steps away for 120 s with k1 and its slot, and comes back.
        a_stops.cancel();
        a.step_away(Duration::from_secs(120)).await.expect("away");
        let max = knows_the_quota.then_some(1);
        let (a2, _) = restarted(&store, &["k1"], max, &cancel);
        settle().await;
        assert!(a2.registered());
        Membership::release(&a2, "k1").await.expect("released");
        assert!(
            slots_of(&store, "alice").await.is_empty(),
            "the slot is free at once (the quota known: {knows_the_quota})"
        );
        create_for(&b, "k2", "alice", 1)
            .await
            .expect("a slot is free");
        cancel.cancel();
    }
}

#[tokio::test(start_paused = true)]
async fn a_create_the_quota_refuses_holds_nothing_and_a_cancelled_one_gives_its_slot_back() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let (a, b) = two_nodes(&store, &cancel);
    settle().await;
    let held = Ledger::reserve(&*a, "alice", Some(1))
        .await
        .expect("reserved");
    assert!(matches!(
        Ledger::reserve(&*b, "alice", Some(1)).await,
        Err(ClaimRefused::Quota { max: 1, .. })
    ));
    Ledger::cancel(&*a, held).await;
    assert!(slots_of(&store, "alice").await.is_empty());
    create_for(&b, "k1", "alice", 1)
        .await
        .expect("the slot is free again");
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn the_reconcile_repairs_quota_slots_both_ways() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let (a, b) = two_nodes(&store, &cancel);
    settle().await;
    create_for(&a, "k1", "alice", 2).await.expect("k1");
    let local = |ids: &[&str]| -> Vec<(String, String, String)> {
        ids.iter()
            .map(|id| (id.to_string(), "alice".to_owned(), "python3".to_owned()))
            .collect()
    };
    // k1's slot lost; a slot naming a kernel no node has.
    assert!(store
        .delete_if(&quota_key("alice", 0), b"k1")
        .await
        .expect("delete"));
    let lease = store.grant(Duration::from_secs(60)).await.expect("grant");
    assert!(store
        .create(&quota_key("alice", 1), b"ghost", lease)
        .await
        .expect("create"));
    settle().await;
    let fixed = a.reconcile(&local(&["k1"])).await.expect("reconcile");
    assert_eq!(
        fixed,
        Reconciled {
            missing_slots: 1,
            stale_slots: 1,
            ..Reconciled::default()
        }
    );
    assert_eq!(
        slots_of(&store, "alice")
            .await
            .into_iter()
            .map(|(_, id)| id)
            .collect::<Vec<_>>(),
        ["k1"]
    );
    settle().await;
    assert_eq!(
        a.reconcile(&local(&["k1"])).await.expect("again"),
        Reconciled::default()
    );
    // Both slots held by b's kernels when a's k1 lost its own: reported, not removed.
    create_for(&b, "k2", "alice", 2).await.expect("k2");
    assert!(store
        .delete_if(&quota_key("alice", 0), b"k1")
        .await
        .expect("delete"));
    create_for(&b, "k3", "alice", 2).await.expect("k3");
    settle().await;
    let fixed = a.reconcile(&local(&["k1"])).await.expect("reconcile");
    assert_eq!(
        fixed,
        Reconciled {
            over_quota: 1,
            ..Reconciled::default()
        }
    );
    // A kernel gone from a's table: its record and its slot go.
    Membership::release(&b, "k3").await.expect("released");
    settle().await;
    a.reconcile(&local(&["k1"])).await.expect("slot back");
    settle().await;
    let fixed = a.reconcile(&local(&[])).await.expect("reconcile");
    assert_eq!(fixed.stale_records, 1);
    assert_eq!(
        slots_of(&store, "alice")
            .await
            .into_iter()
            .map(|(_, id)| id)
            .collect::<Vec<_>>(),
        ["k2"]
    );
    cancel.cancel();
}

fn snapshot(id: &str, name: &str, size: u64) -> SnapshotModel {
    SnapshotModel {
        id: id.into(),
        name: Some(name.into()),
        metadata: Default::default(),
        kernel_id: "k1".into(),
        kernelspec: "python3".into(),
        kind: "memory".into(),
        size,
        created: "2026-01-01T00:00:00.000000Z".into(),
        dropped: Vec::new(),
    }
}

#[tokio::test(start_paused = true)]
async fn a_nodes_snapshots_are_everyones_to_see_and_come_back_with_its_lease() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let (a, b) = two_nodes(&store, &cancel);
    settle().await;
    a.snapshot_kept("alice", &snapshot("s1", "clean", 5 << 20))
        .await;
    a.snapshot_kept("bob", &snapshot("s2", "clean", 7 << 20))
        .await;
    assert!(b.until_snapshot_known("s1", Duration::from_secs(1)).await);
    let seen = b.view().snapshots["s1"].clone();
    assert_eq!((seen.node.as_str(), seen.owner.as_str()), ("a", "alice"));
    assert_eq!(seen.model, snapshot("s1", "clean", 5 << 20));
    // Budgets count what other nodes keep of a key, not a node's own.
    assert_eq!(b.snapshots_elsewhere("alice"), (1, 5 << 20));
    assert_eq!(a.snapshots_elsewhere("alice"), (0, 0));

    // A lost lease takes the records with it; the registration puts them back.
    store.set_down(true);
    tokio::time::sleep(Duration::from_secs(4)).await;
    store.set_down(false);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(a.registered());
    let listing = store
        .list(&format!("{PREFIX}snapshots/"))
        .await
        .expect("list");
    assert_eq!(listing.entries.len(), 2, "{listing:?}");

    a.snapshot_gone("s1").await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        b.view().snapshots.keys().collect::<Vec<_>>(),
        vec!["s2"],
        "a deleted snapshot leaves every view"
    );
    cancel.cancel();
}

/// The load a peer places by: node a's, as node b reads it to place a create.
async fn load_seen(b: &Membership<Memory>) -> Option<u32> {
    b.read_loads(&["a".to_owned()]).await.get("a").copied()
}

#[tokio::test(start_paused = true)]
async fn a_burst_of_creates_puts_the_nodes_load_at_most_once_a_second_and_never_its_record() {
    use futures::{FutureExt, StreamExt};
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let (a, b) = two_nodes(&store, &cancel);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let from = store.list(PREFIX).await.expect("list").revision + 1;
    let mut puts = store
        .watch(&crate::cluster::load_key("a"), from)
        .await
        .expect("watch");
    let mut records = store.watch(&node_key("a"), from).await.expect("watch");
    let started = tokio::time::Instant::now();
    for n in 0..10 {
        let reservation = Ledger::reserve(&*a, "admin", None).await.expect("reserve");
        Ledger::claim(&*a, &format!("k{n}"), "admin", "python3", reservation)
            .await
            .expect("claim");
    }
    let burst = started.elapsed();
    tokio::time::sleep(LOAD_EVERY + Duration::from_millis(100)).await;
    settle().await;
    assert_eq!(
        load_seen(&b).await,
        Some(10),
        "the burst's load reached the peer"
    );
    assert_eq!(
        b.view().nodes.get("a").map(|n| n.load),
        Some(10),
        "the read updates the view"
    );
    let count = |puts: &mut futures::stream::BoxStream<'static, _>| {
        let mut n = 0;
        while let Some(Some(Ok::<Vec<Event>, RegistryError>(events))) = puts.next().now_or_never() {
            n += events.len();
        }
        n
    };
    let during = count(&mut puts);
    let most = 1 + (burst + LOAD_EVERY).as_millis() / LOAD_EVERY.as_millis();
    assert!(
        during >= 1 && during as u128 <= most,
        "{during} puts of the node's load for 10 creates in {burst:?}"
    );
    assert_eq!(
        count(&mut records),
        0,
        "the watched record is not put for a load"
    );
    tokio::time::sleep(LOAD_EVERY * 3).await;
    assert_eq!(count(&mut puts), 0, "no put while the load stays");
    cancel.cancel();
}

#[test]
fn retries_back_off_with_jitter_up_to_their_cap() {
    let cap = Duration::from_secs(2);
    for failures in 1..40 {
        let wait = backoff(failures, cap);
        assert!(wait >= Duration::from_millis(50), "{wait:?}");
        assert!(wait <= cap + Duration::from_millis(50), "{wait:?}");
    }
    // Nodes that failed together do not all wait the same.
    let waits: std::collections::HashSet<Duration> = (0..20).map(|_| backoff(5, cap)).collect();
    assert!(waits.len() > 10, "{waits:?}");
}

#[tokio::test(start_paused = true)]
async fn a_kernel_the_view_does_not_hold_yet_is_found_in_the_registry() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let ttl = Duration::from_secs(3);
    let a = Membership::new(store.clone(), "a", node("http://a"), ttl);
    // b keeps its lease but has no view yet (its first listing still coming in).
    let b = Membership::new(store.clone(), "b", node("http://b"), ttl);
    for m in [&a, &b] {
        tokio::spawn(m.clone().keep(cancel.clone(), |_| {}));
    }
    settle().await;
    a.claim("k1", &kernel("a")).await.expect("claim");
    assert!(b.view().kernels.is_empty());
    let found = b.view_finding("k1").await;
    assert_eq!(found.kernels.get("k1").map(|k| k.node.as_str()), Some("a"));
    assert!(
        b.view_finding("k2").await.kernels.is_empty(),
        "no such kernel"
    );
    assert!(
        b.view().kernels.is_empty(),
        "the view itself waits for the watch"
    );
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_removal_that_failed_is_finished_by_the_reconcile_with_its_index_entry() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let ttl = Duration::from_secs(30);
    let a = Membership::new(store.clone(), "a", node("http://a"), ttl);
    tokio::spawn(a.clone().keep(cancel.clone(), |_| {}));
    settle().await;
    a.claim("k1", &kernel("a")).await.expect("claim");
    store.set_down(true);
    assert!(a.release("k1").await.is_err(), "etcd is down");
    store.set_down(false);
    let kernels = |prefix: String| {
        let store = store.clone();
        async move { store.list(&prefix).await.expect("list").entries.len() }
    };
    assert_eq!(kernels(format!("{PREFIX}kernels/")).await, 1, "still there");
    let fixed = a.reconcile(&[]).await.expect("reconcile");
    assert_eq!(fixed.stale_records, 1);
    assert_eq!(kernels(format!("{PREFIX}kernels/")).await, 0);
    assert_eq!(kernels(crate::cluster::tenants_prefix(None)).await, 0);
    assert_eq!(
        a.reconcile(&[]).await.expect("reconcile"),
        Reconciled::default()
    );
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_run_after_a_step_away_ends_what_the_earlier_run_held_and_it_did_not_take_back() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let a_stops = CancellationToken::new();
    let a = Membership::new(store.clone(), "a", node("http://a"), Duration::from_secs(3));
    tokio::spawn(a.clone().keep(a_stops.clone(), |_| {}));
    settle().await;
    create_for(&a, "k1", "alice", 2).await.expect("k1");
    create_for(&a, "k2", "alice", 2).await.expect("k2");
    // SIGTERM: a steps away for 120 s; k2 does not survive the restart.
    a_stops.cancel();
    a.step_away(Duration::from_secs(120))
        .await
        .expect("stepped away");
    let (a2, refused) = restarted(&store, &["k1"], Some(2), &cancel);
    settle().await;
    assert!(a2.registered());
    assert!(refused.lock().expect("lock").is_empty());
    // At once, not 120 s later: k2's record, index entry and slot are gone; k1's stay.
    let ids = |prefix: String| {
        let store = store.clone();
        async move {
            let listing = store.list(&prefix).await.expect("list");
            let ids: Vec<String> = listing
                .entries
                .into_iter()
                .map(|e| e.key.rsplit('/').next().unwrap_or_default().to_owned())
                .collect();
            ids
        }
    };
    assert_eq!(ids(format!("{PREFIX}kernels/")).await, ["k1"]);
    assert_eq!(ids(crate::cluster::tenants_prefix(None)).await, ["k1"]);
    let slots: Vec<String> = slots_of(&store, "alice")
        .await
        .into_iter()
        .map(|(_, id)| id)
        .collect();
    assert_eq!(slots, ["k1"], "alice may create again");
    assert!(ids(format!("{PREFIX}nodes/")).await == ["a"]);
    cancel.cancel();
}

#[tokio::test(start_paused = true)]
async fn an_owner_that_cannot_be_read_is_unknown_for_now_not_absent() {
    let store = Memory::new();
    let cancel = CancellationToken::new();
    let (a, b) = two_nodes(&store, &cancel);
    settle().await;
    a.claim("k1", &kernel("a")).await.expect("claim");
    store.set_down(true);
    let view = b.view_finding("k1").await;
    assert!(view.unreadable && view.kernels.is_empty(), "{view:?}");
    store.set_down(false);
    let view = b.view_finding("k1").await;
    assert!(!view.unreadable);
    assert_eq!(view.kernels.get("k1").map(|k| k.node.as_str()), Some("a"));
    // Known now: served from the cache while the registry is down again.
    store.set_down(true);
    let view = b.view_finding("k1").await;
    assert!(!view.unreadable);
    assert_eq!(view.kernels.get("k1").map(|k| k.node.as_str()), Some("a"));
    store.set_down(false);
    let absent = b.view_finding("k2").await;
    assert!(
        !absent.unreadable && absent.kernels.is_empty(),
        "no such kernel"
    );
    cancel.cancel();
}
