//! The kernel table as a node of a cluster: two tables on one in-memory registry, with the
//! registry membership as their ledger.

use super::fake::FakeBackend;
use super::tests::{admin, eventually, settings, specs, table, tenant};
use super::*;
use crate::kernelspecs::DEFAULT_SPEC;

type Member = Arc<crate::cluster::membership::Membership<crate::cluster::memory::Memory>>;

/// A node of a cluster: its table with the registry as its ledger, over `store`.
async fn cluster_node(
    store: &crate::cluster::memory::Memory,
    id: &str,
    cancel: &CancellationToken,
) -> (Arc<Kernels>, Member) {
    let (kernels, membership, _) = cluster_node_with(store, id, cancel, settings()).await;
    (kernels, membership)
}

/// The same, with `settings` (its ledger set here), and its fake backend.
async fn cluster_node_with(
    store: &crate::cluster::memory::Memory,
    id: &str,
    cancel: &CancellationToken,
    settings: Settings,
) -> (Arc<Kernels>, Member, Arc<FakeBackend>) {
    use crate::cluster::membership::Membership;
    let node = crate::cluster::NodeRecord {
        address: format!("http://{id}"),
        cluster_address: None,
        incarnation: format!("{id}-1"),
        capacity: 4,
        load: 0,
        version: "0".into(),
        specs: vec!["python3".into()],
        warm: Default::default(),
        away: false,
        indexed: true,
    };
    let membership = Membership::new(store.clone(), id, node, Duration::from_secs(3));
    tokio::spawn(membership.clone().keep(cancel.clone(), |_| {}));
    tokio::spawn(membership.clone().follow(cancel.clone()));
    let (kernels, fake) = table(Settings {
        ledger: Some(membership.clone()),
        ..settings
    })
    .await;
    (kernels, membership, fake)
}

#[tokio::test]
async fn in_a_cluster_the_table_registers_its_kernels_and_removes_their_records() {
    let store = crate::cluster::memory::Memory::new();
    let cancel = CancellationToken::new();
    let (a, a_member) = cluster_node(&store, "a", &cancel).await;
    let (_b, b_member) = cluster_node(&store, "b", &cancel).await;
    eventually("both registered", || async {
        a_member.registered() && b_member.registered()
    })
    .await;
    let alice = tenant("alice", None);
    let live = a
        .create(None, &BTreeMap::new(), &alice)
        .await
        .expect("created");
    let id = live.id().to_owned();
    // The record is registered before the create answers: the other node reads it.
    let view = b_member.view_finding(&id).await;
    let record = &view.kernels[&id];
    let indexed = b_member.kernels_of(Some("alice")).await.expect("index");
    assert_eq!(indexed, vec![(id.clone(), record.clone())]);
    assert_eq!(
        (record.node.as_str(), record.incarnation.as_str()),
        ("a", "a-1")
    );
    assert_eq!(
        (record.tenant.as_str(), record.spec.as_str()),
        ("alice", "python3")
    );
    let load = |m: Member| async move { m.read_loads(&["a".to_owned()]).await.get("a").copied() };
    eventually("a's load is 1", || async {
        load(b_member.clone()).await == Some(1)
    })
    .await;

    a.delete(&id, Removal::AskedBy("alice".into()))
        .await
        .expect("was there")
        .expect("removed");
    b_member.forget_owner(&id);
    assert!(b_member.view_finding(&id).await.kernels.is_empty());
    assert!(b_member
        .kernels_of(Some("alice"))
        .await
        .expect("index")
        .is_empty());
    eventually("a's load is 0", || async {
        load(b_member.clone()).await == Some(0)
    })
    .await;
    cancel.cancel();
}

#[tokio::test]
async fn a_node_cut_off_from_the_registry_refuses_creates_and_runs_nothing() {
    let store = crate::cluster::memory::Memory::new();
    let cancel = CancellationToken::new();
    // Never registered: the registry is down from the start.
    store.set_down(true);
    let (a, a_member) = cluster_node(&store, "a", &cancel).await;
    let refused = a.create(None, &BTreeMap::new(), &admin()).await;
    let Err(e @ CreateError::Unregistered(_)) = refused else {
        panic!("created while cut off: {refused:?}");
    };
    assert!(e.to_string().contains("cut off"), "{e}");
    assert!(!a_member.registered());
    assert_eq!(a.list().len(), 0, "the kernel was removed again");
    store.set_down(false);
    eventually("registered once the registry is back", || async {
        a_member.registered()
    })
    .await;
    let live = a
        .create(None, &BTreeMap::new(), &admin())
        .await
        .expect("created once registered");
    assert!(store_has(&store, live.id()).await);
    cancel.cancel();
}

async fn store_has(store: &crate::cluster::memory::Memory, id: &str) -> bool {
    use crate::cluster::Registry;
    let listing = store
        .list(&crate::cluster::kernel_key(id))
        .await
        .expect("list");
    !listing.entries.is_empty()
}

#[tokio::test]
async fn a_keys_quota_holds_across_nodes_under_concurrent_creates() {
    let store = crate::cluster::memory::Memory::new();
    let cancel = CancellationToken::new();
    let (a, a_member) = cluster_node(&store, "a", &cancel).await;
    let (b, b_member) = cluster_node(&store, "b", &cancel).await;
    eventually("both registered", || async {
        a_member.registered() && b_member.registered()
    })
    .await;
    let carol = tenant("carol", Some(2));
    let no_env = BTreeMap::new();
    let creates = [&a, &a, &b, &b].map(|node| node.create(None, &no_env, &carol));
    let results = futures::future::join_all(creates).await;
    let made: Vec<&Arc<LiveKernel>> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert_eq!(made.len(), 2, "{results:?}");
    for refused in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(
            matches!(refused, CreateError::TooManyForKey { max: 2, .. }),
            "{refused:?}"
        );
    }
    assert_eq!(
        a.list().len() + b.list().len(),
        2,
        "the refused kernels were removed"
    );

    // A kernel gone gives its slot back.
    let first = made[0].id().to_owned();
    let owner = if a.get(&first).is_some() { &a } else { &b };
    owner
        .delete(&first, Removal::AskedBy("carol".into()))
        .await
        .expect("was there")
        .expect("removed");
    a.create(None, &BTreeMap::new(), &carol)
        .await
        .expect("a slot is free again");
    cancel.cancel();
}

#[tokio::test]
async fn a_create_refused_for_its_keys_quota_or_a_full_node_takes_no_warm_kernel() {
    let store = crate::cluster::memory::Memory::new();
    let cancel = CancellationToken::new();
    // One kernel per node, one warm kernel each.
    let pooled = || Settings {
        specs: specs(&[], &["1"]),
        max_kernels: 1,
        ..settings()
    };
    let (a, a_member, a_fake) = cluster_node_with(&store, "a", &cancel, pooled()).await;
    let (b, b_member, b_fake) = cluster_node_with(&store, "b", &cancel, pooled()).await;
    eventually("both registered", || async {
        a_member.registered() && b_member.registered()
    })
    .await;
    let carol = tenant("carol", Some(1));
    let no_env = BTreeMap::new();
    a.create(None, &no_env, &carol).await.expect("created");
    eventually("both pools full", || async {
        super::tests::pooled(&a) == 1 && super::tests::pooled(&b) == 1
    })
    .await;
    let warm = |k: &Kernels| k.lock().pool[DEFAULT_SPEC][0].handle();
    let before = (warm(&a), warm(&b), a_fake.records(), b_fake.records());
    // b has room but carol's key does not; a is full, for anyone.
    let refused = b.create(None, &no_env, &carol).await;
    assert!(
        matches!(refused, Err(CreateError::TooManyForKey { max: 1, .. })),
        "{refused:?}"
    );
    for who in [&carol, &admin()] {
        let refused = a.create(None, &no_env, who).await;
        assert!(
            matches!(refused, Err(CreateError::TooMany { max: 1 })),
            "{refused:?}"
        );
    }
    let after = (warm(&a), warm(&b), a_fake.records(), b_fake.records());
    assert_eq!(
        (&after.0, &after.1),
        (&before.0, &before.1),
        "the same warm kernels"
    );
    assert_eq!(
        (after.2.len(), after.3.len()),
        (before.2.len(), before.3.len()),
        "no kernel started"
    );
    let removed = |r: &std::collections::HashMap<String, super::fake::Record>| {
        r.values().filter(|r| r.removed).count()
    };
    assert_eq!(
        (removed(&after.2), removed(&after.3)),
        (0, 0),
        "no kernel removed"
    );
    cancel.cancel();
}
