//! The snapshot store against the fake backend: names, listing, paging, ownership, and
//! what survives a restart of the table.

use super::*;
use crate::kernels::tests::{settings, table};

fn record(id: &str, owner: &str, name: Option<&str>, minutes_ago: i64) -> Snapshot {
    Snapshot {
        id: id.to_owned(),
        name: name.map(str::to_owned),
        metadata: [("team".to_owned(), format!("t-{owner}"))].into(),
        owner: owner.to_owned(),
        kernel: "k".to_owned(),
        spec: "python3".to_owned(),
        kind: SnapshotKind::Namespace,
        bytes: 1 << 20,
        created: Utc::now() - chrono::Duration::minutes(minutes_ago),
        env: BTreeMap::new(),
        dropped: Vec::new(),
        hidden: false,
    }
}

/// Writes `record` as a committed snapshot under `root` and returns its directory.
fn write(root: &Path, record: &Snapshot) -> PathBuf {
    let dir = root.join(SNAPSHOTS).join(&record.id);
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join(RECORD), serde_json::to_vec(record).expect("json")).expect("record");
    std::fs::write(dir.join("state.tar"), b"tar").expect("tar");
    dir
}

async fn store_with(records: &[Snapshot]) -> (Arc<Kernels>, tempfile::TempDir) {
    let root = tempfile::tempdir().expect("tempdir");
    for r in records {
        write(root.path(), r);
    }
    let mut s = settings();
    s.hibernate.dir = root.path().to_owned();
    let (kernels, _fake) = table(s).await;
    (kernels, root)
}

#[test]
fn names_and_metadata_are_checked() {
    let none = BTreeMap::new();
    assert!(check_labels(Some("cleaned-v2"), &none).is_ok());
    assert!(check_labels(None, &none).is_ok());
    for bad in ["", "a b", "x;rm", &"n".repeat(MAX_NAME + 1)] {
        let e = check_labels(Some(bad), &none).expect_err(bad);
        assert!(e.to_string().contains("letters, digits"), "{e}");
    }
    let many: BTreeMap<String, String> = (0..=MAX_METADATA)
        .map(|i| (i.to_string(), String::new()))
        .collect();
    assert!(check_labels(None, &many).is_err());
    let long: BTreeMap<String, String> =
        [("k".to_owned(), "v".repeat(MAX_METADATA_TEXT + 1))].into();
    assert!(check_labels(None, &long).is_err());
}

#[test]
fn refusals_point_at_accept_loss_not_the_hibernation_flag() {
    let why = snapshot_wording(
        "cannot be saved: gen (generator); delete them or hibernate with --hibernate-lossy",
    );
    assert!(why.contains("gen (generator)"), "{why}");
    assert!(why.contains("accept_loss"), "{why}");
    assert!(!why.contains("--hibernate-lossy"), "{why}");
}

#[tokio::test]
async fn snapshots_of_an_earlier_run_are_listed_again_and_a_forks_own_is_deleted() {
    let mut hidden = record("h1", "alice", None, 1);
    hidden.hidden = true;
    let (kernels, root) = store_with(&[record("s1", "alice", Some("clean"), 3), hidden]).await;
    let snapshots = kernels.snapshots();
    let page = snapshots.list(
        &Filter {
            limit: 10,
            ..Filter::default()
        },
        |_| true,
    );
    let ids: Vec<&str> = page.snapshots.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["s1"]);
    assert!(
        !root.path().join(SNAPSHOTS).join("h1").exists(),
        "a fork's own snapshot was kept"
    );
    assert_eq!(snapshots.totals(), (1, 1 << 20));
}

#[tokio::test]
async fn a_key_sees_its_own_snapshots_newest_first_in_pages() {
    let (kernels, _root) = store_with(&[
        record("a-old", "alice", Some("one"), 30),
        record("a-mid", "alice", None, 20),
        record("a-new", "alice", Some("two"), 10),
        record("b-1", "bob", Some("one"), 5),
    ])
    .await;
    let snapshots = kernels.snapshots();
    let alice = |owner: &str| owner == "alice";
    let first = snapshots.list(
        &Filter {
            limit: 2,
            ..Filter::default()
        },
        alice,
    );
    let ids: Vec<&str> = first.snapshots.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["a-new", "a-mid"]);
    let next = first.next.clone().expect("a second page");
    let second = snapshots.list(
        &Filter {
            limit: 2,
            after: Some(next),
            ..Filter::default()
        },
        alice,
    );
    let ids: Vec<&str> = second.snapshots.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["a-old"]);
    assert_eq!(second.next, None);
    let named = snapshots.list(
        &Filter {
            name: Some("one".into()),
            limit: 10,
            ..Filter::default()
        },
        alice,
    );
    assert_eq!(named.snapshots.len(), 1);
    assert_eq!(named.snapshots[0].id, "a-old");
    let by_metadata = snapshots.list(
        &Filter {
            metadata: [("team".to_owned(), "t-bob".to_owned())].into(),
            limit: 10,
            ..Filter::default()
        },
        |_| true,
    );
    assert_eq!(by_metadata.snapshots.len(), 1);
    assert_eq!(by_metadata.snapshots[0].id, "b-1");
    // Another key's snapshot does not exist for alice, by id or by name.
    assert!(matches!(
        snapshots.find("b-1", "alice", alice),
        Err(SnapshotError::NotFound(_))
    ));
    assert_eq!(
        snapshots
            .find("one", "alice", alice)
            .expect("by name")
            .record
            .id,
        "a-old"
    );
    // An admin naming a snapshot gets its own key's first, then anyone's.
    assert_eq!(
        snapshots
            .find("one", "bob", |_| true)
            .expect("by name")
            .record
            .id,
        "b-1"
    );
    assert_eq!(snapshots.used_by("alice", None), (3, 3 << 20));
    assert_eq!(snapshots.used_by("alice", Some("one")), (2, 2 << 20));
}

#[tokio::test]
async fn a_deleted_snapshot_in_use_keeps_its_files_until_let_go() {
    let (kernels, root) = store_with(&[record("s1", "alice", None, 1)]).await;
    let snapshots = kernels.snapshots();
    let dir = root.path().join(SNAPSHOTS).join("s1");
    let held = snapshots.find("s1", "alice", |_| true).expect("found");
    snapshots.delete(&held, Some("alice"), None).await;
    assert!(matches!(
        snapshots.find("s1", "alice", |_| true),
        Err(SnapshotError::NotFound(_))
    ));
    assert!(dir.exists(), "deleted while a create still reads it");
    drop(held);
    let gone = async {
        while dir.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), gone)
        .await
        .expect("its files go once nobody holds it");
}
