//! An in-memory [`Registry`] for unit tests of the layers above it: the same semantics as
//! etcd's (revisions, leases that expire, create-if-absent, compare-and-delete, watches
//! from a revision, compaction), in one process, with tokio's clock.

use super::registry::{
    prefix_end, Change, Compare, Entry, Event, Lease, Listing, Registry, RegistryError, Revision,
};
use futures::stream::BoxStream;
use futures::StreamExt;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::broadcast;
use tokio::time::Instant;

#[derive(Debug)]
struct Value {
    bytes: Vec<u8>,
    lease: Lease,
    revision: Revision,
}

#[derive(Debug, Default)]
struct State {
    revision: Revision,
    keys: BTreeMap<String, Value>,
    /// Each lease's expiry.
    leases: HashMap<Lease, Instant>,
    ttls: HashMap<Lease, Duration>,
    next_lease: i64,
    /// Every change since `compacted`, for watches that start in the past.
    history: Vec<Event>,
    compacted: Revision,
    /// Answers every call with `Unreachable` while set (an outage).
    down: bool,
}

/// The in-memory store; clones share it.
#[derive(Debug, Clone)]
pub struct Memory {
    state: Arc<Mutex<State>>,
    changes: broadcast::Sender<Event>,
}

impl Default for Memory {
    fn default() -> Self {
        Memory::new()
    }
}

impl Memory {
    pub fn new() -> Memory {
        let (changes, _) = broadcast::channel(1024);
        Memory {
            state: Arc::new(Mutex::new(State::default())),
            changes,
        }
    }

    /// Makes the store unreachable (`true`) or reachable again, as an outage would.
    pub fn set_down(&self, down: bool) {
        self.lock().down = down;
    }

    /// Forgets the history up to `revision`: watches from before it get `Compacted`.
    pub fn compact(&self, revision: Revision) {
        let mut st = self.lock();
        st.history.retain(|e| e.revision() > revision);
        st.compacted = st.compacted.max(revision);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks the store is up and removes the keys of expired leases (as etcd's lessor).
    fn begin(&self) -> Result<std::sync::MutexGuard<'_, State>, RegistryError> {
        let mut st = self.lock();
        if st.down {
            return Err(RegistryError::Unreachable {
                endpoint: "memory".into(),
                reason: "the store is down".into(),
            });
        }
        let now = Instant::now();
        let expired: Vec<Lease> = st
            .leases
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(l, _)| *l)
            .collect();
        for lease in expired {
            self.end_lease(&mut st, lease);
        }
        Ok(st)
    }

    fn end_lease(&self, st: &mut State, lease: Lease) {
        st.leases.remove(&lease);
        st.ttls.remove(&lease);
        let keys: Vec<String> = st
            .keys
            .iter()
            .filter(|(_, v)| v.lease == lease)
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            self.delete(st, &key);
        }
    }

    fn delete(&self, st: &mut State, key: &str) {
        if st.keys.contains_key(key) {
            st.revision += 1;
            let revision = st.revision;
            self.delete_at(st, key, revision);
        }
    }

    /// Deletes `key` at `revision` (the revision of the change or transaction).
    fn delete_at(&self, st: &mut State, key: &str, revision: Revision) {
        if st.keys.remove(key).is_some() {
            let event = Event::Delete {
                key: key.to_owned(),
                revision,
            };
            st.history.push(event.clone());
            let _ = self.changes.send(event);
        }
    }

    fn set(&self, st: &mut State, key: &str, value: &[u8], lease: Lease) -> Revision {
        st.revision += 1;
        let revision = st.revision;
        self.set_at(st, key, value, lease, revision);
        revision
    }

    /// Puts `key` at `revision` (the revision of the change or transaction).
    fn set_at(&self, st: &mut State, key: &str, value: &[u8], lease: Lease, revision: Revision) {
        st.keys.insert(
            key.to_owned(),
            Value {
                bytes: value.to_vec(),
                lease,
                revision,
            },
        );
        let event = Event::Put(Entry {
            key: key.to_owned(),
            value: value.to_vec(),
            revision,
        });
        st.history.push(event.clone());
        let _ = self.changes.send(event);
    }

    fn check_lease(st: &State, lease: Lease) -> Result<(), RegistryError> {
        if st.leases.contains_key(&lease) {
            Ok(())
        } else {
            Err(RegistryError::Refused("requested lease not found".into()))
        }
    }
}

fn in_range(key: &str, prefix: &str) -> bool {
    key.as_bytes() >= prefix.as_bytes() && key.as_bytes() < prefix_end(prefix).as_slice()
}

fn key_of(event: &Event) -> &str {
    match event {
        Event::Put(e) => &e.key,
        Event::Delete { key, .. } => key,
    }
}

impl Registry for Memory {
    async fn grant(&self, ttl: Duration) -> Result<Lease, RegistryError> {
        let mut st = self.begin()?;
        st.next_lease += 1;
        let lease = Lease(st.next_lease);
        st.leases.insert(lease, Instant::now() + ttl);
        st.ttls.insert(lease, ttl);
        Ok(lease)
    }

    async fn keep_alive(&self, lease: Lease) -> Result<bool, RegistryError> {
        let mut st = self.begin()?;
        let Some(ttl) = st.ttls.get(&lease).copied() else {
            return Ok(false);
        };
        st.leases.insert(lease, Instant::now() + ttl);
        Ok(true)
    }

    async fn lease_of(&self, key: &str) -> Result<Option<Lease>, RegistryError> {
        let st = self.begin()?;
        Ok(st.keys.get(key).map(|v| v.lease))
    }

    async fn revoke(&self, lease: Lease) -> Result<(), RegistryError> {
        let mut st = self.begin()?;
        self.end_lease(&mut st, lease);
        Ok(())
    }

    async fn put(&self, key: &str, value: &[u8], lease: Lease) -> Result<Revision, RegistryError> {
        let mut st = self.begin()?;
        Self::check_lease(&st, lease)?;
        Ok(self.set(&mut st, key, value, lease))
    }

    async fn create(&self, key: &str, value: &[u8], lease: Lease) -> Result<bool, RegistryError> {
        let mut st = self.begin()?;
        Self::check_lease(&st, lease)?;
        if st.keys.contains_key(key) {
            return Ok(false);
        }
        self.set(&mut st, key, value, lease);
        Ok(true)
    }

    async fn delete_if(&self, key: &str, expected: &[u8]) -> Result<bool, RegistryError> {
        let mut st = self.begin()?;
        if st.keys.get(key).is_none_or(|v| v.bytes != expected) {
            return Ok(false);
        }
        self.delete(&mut st, key);
        Ok(true)
    }

    async fn txn(&self, compare: &[Compare], changes: &[Change]) -> Result<bool, RegistryError> {
        let mut st = self.begin()?;
        for change in changes {
            if let Change::Put { lease, .. } = change {
                Self::check_lease(&st, *lease)?;
            }
        }
        let holds = compare.iter().all(|c| match c {
            Compare::Absent(key) => !st.keys.contains_key(key),
            Compare::Unchanged(key, revision) => {
                st.keys.get(key).is_some_and(|v| v.revision == *revision)
            }
            Compare::Holds(key, value) => st.keys.get(key).is_some_and(|v| v.bytes == *value),
        });
        if !holds {
            return Ok(false);
        }
        // One revision for the whole transaction, as etcd gives it.
        st.revision += 1;
        let revision = st.revision;
        for change in changes {
            match change {
                Change::Put { key, value, lease } => {
                    self.set_at(&mut st, key, value, *lease, revision)
                }
                Change::Delete(key) => self.delete_at(&mut st, key, revision),
            }
        }
        Ok(true)
    }

    async fn list(&self, prefix: &str) -> Result<Listing, RegistryError> {
        let st = self.begin()?;
        Ok(Listing {
            entries: st
                .keys
                .iter()
                .filter(|(k, _)| in_range(k, prefix))
                .map(|(k, v)| Entry {
                    key: k.clone(),
                    value: v.bytes.clone(),
                    revision: v.revision,
                })
                .collect(),
            revision: st.revision,
        })
    }

    async fn watch(
        &self,
        prefix: &str,
        from: Revision,
    ) -> Result<BoxStream<'static, Result<Vec<Event>, RegistryError>>, RegistryError> {
        let st = self.begin()?;
        if from <= st.compacted {
            return Err(RegistryError::Compacted {
                requested: from,
                compacted: st.compacted,
            });
        }
        let prefix = prefix.to_owned();
        let past: Vec<Event> = st
            .history
            .iter()
            .filter(|e| e.revision() >= from && in_range(key_of(e), &prefix))
            .cloned()
            .collect();
        let last = st.revision;
        let live = tokio_stream_of(self.changes.subscribe());
        drop(st);
        let past = futures::stream::iter((!past.is_empty()).then_some(Ok(past)));
        let live = live.filter_map(move |event| {
            let keep = match &event {
                Ok(e) => e.revision() > last && in_range(key_of(e), &prefix),
                Err(_) => true,
            };
            async move { keep.then(|| event.map(|e| vec![e])) }
        });
        Ok(past.chain(live).boxed())
    }
}

/// A broadcast receiver as a stream; a receiver that fell behind gets an error (the
/// watcher lists again), as a real watch that lost its connection would.
fn tokio_stream_of(
    rx: broadcast::Receiver<Event>,
) -> impl futures::Stream<Item = Result<Event, RegistryError>> + Send + 'static {
    futures::stream::unfold(Some(rx), |rx| async move {
        let mut rx = rx?;
        match rx.recv().await {
            Ok(event) => Some((Ok(event), Some(rx))),
            Err(broadcast::error::RecvError::Lagged(n)) => Some((
                Err(RegistryError::Unreachable {
                    endpoint: "memory".into(),
                    reason: format!("the watch fell {n} events behind"),
                }),
                None,
            )),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_lease_that_is_not_renewed_takes_its_keys_with_it() {
        let m = Memory::new();
        let lease = m.grant(Duration::from_secs(3)).await.expect("grant");
        assert!(m.create("/k/a", b"1", lease).await.expect("create"));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(m.keep_alive(lease).await.expect("renew"));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(m.list("/k/").await.expect("list").entries.len(), 1);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(m.list("/k/").await.expect("list").entries.is_empty());
        assert!(
            !m.keep_alive(lease).await.expect("renew"),
            "the lease is gone"
        );
    }

    #[tokio::test]
    async fn create_claims_once_and_delete_if_compares() {
        let m = Memory::new();
        let a = m.grant(Duration::from_secs(10)).await.expect("grant");
        let b = m.grant(Duration::from_secs(10)).await.expect("grant");
        assert!(m.create("/k/x", b"a", a).await.expect("create"));
        assert!(
            !m.create("/k/x", b"b", b).await.expect("create"),
            "one owner"
        );
        assert!(!m.delete_if("/k/x", b"b").await.expect("delete"));
        assert!(m.delete_if("/k/x", b"a").await.expect("delete"));
        assert!(m.create("/k/x", b"b", b).await.expect("create"));
    }

    #[tokio::test]
    async fn a_transaction_makes_all_its_changes_or_none() {
        let m = Memory::new();
        let lease = m.grant(Duration::from_secs(10)).await.expect("grant");
        m.put("/k/slot", b"reserved", lease).await.expect("put");
        let put = |key: &str, value: &[u8]| Change::Put {
            key: key.into(),
            value: value.to_vec(),
            lease,
        };
        let both = [put("/k/slot", b"k1"), put("/k/record", b"r")];
        // The slot holds something else: nothing changes.
        let wrong = [Compare::Holds("/k/slot".into(), b"other".to_vec())];
        assert!(!m.txn(&wrong, &both).await.expect("txn"));
        assert_eq!(m.list("/k/").await.expect("list").entries.len(), 1);
        let right = [
            Compare::Holds("/k/slot".into(), b"reserved".to_vec()),
            Compare::Absent("/k/record".into()),
        ];
        assert!(m.txn(&right, &both).await.expect("txn"));
        let listing = m.list("/k/").await.expect("list");
        let revisions: Vec<Revision> = listing.entries.iter().map(|e| e.revision).collect();
        assert_eq!(
            revisions[0], revisions[1],
            "one revision for the whole transaction"
        );
        assert!(
            !m.txn(&right, &both).await.expect("txn"),
            "compared again: changed"
        );
        let unchanged = [Compare::Unchanged("/k/slot".into(), revisions[1])];
        assert!(m
            .txn(&unchanged, &[Change::Delete("/k/slot".into())])
            .await
            .expect("txn"));
        assert_eq!(m.list("/k/").await.expect("list").entries.len(), 1);
    }

    #[tokio::test]
    async fn a_watch_resumes_from_a_revision_and_compaction_says_so() {
        let m = Memory::new();
        let lease = m.grant(Duration::from_secs(10)).await.expect("grant");
        let first = m.put("/k/a", b"1", lease).await.expect("put");
        m.put("/other", b"x", lease).await.expect("put");
        m.put("/k/b", b"2", lease).await.expect("put");
        let mut w = m.watch("/k/", first + 1).await.expect("watch");
        let batch = w.next().await.expect("events").expect("ok");
        assert_eq!(batch.len(), 1, "only /k/b, after the revision asked for");
        assert!(matches!(&batch[0], Event::Put(e) if e.key == "/k/b"));
        m.delete_if("/k/a", b"1").await.expect("delete");
        let batch = w.next().await.expect("events").expect("ok");
        assert!(matches!(&batch[0], Event::Delete { key, .. } if key == "/k/a"));
        m.compact(first + 1);
        assert!(matches!(
            m.watch("/k/", first).await,
            Err(RegistryError::Compacted { .. })
        ));
    }

    #[tokio::test]
    async fn an_outage_answers_unreachable() {
        let m = Memory::new();
        m.set_down(true);
        assert!(matches!(
            m.grant(Duration::from_secs(3)).await,
            Err(RegistryError::Unreachable { .. })
        ));
        m.set_down(false);
        assert!(m.grant(Duration::from_secs(3)).await.is_ok());
    }
}
