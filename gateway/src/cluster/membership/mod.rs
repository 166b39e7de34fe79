//! One node's place in the cluster: its lease and the records under it, kept alive and
//! re-registered when lost, and the node's view of the nodes' and the snapshots' records,
//! kept current by a watch that resumes from its revision and lists again when etcd has
//! compacted it. Kernel records are read one at a time, when a request names a kernel
//! this node does not run, and their owners kept in a cache.
//!
//! The lease: renewed every TTL/3. A renewal that finds the lease gone (it expired during a
//! partition or an etcd outage longer than the TTL), or no successful renewal for a whole
//! TTL, makes the node *cut off*: it must assume its records are gone and that other nodes
//! think its kernels are gone, so it refuses forwarded work and creates until it holds a
//! new lease with every record registered again. A kernel record is claimed with
//! create-if-absent, so re-registering never takes a kernel another node claimed meanwhile.

use super::registry::{Change, Compare, Lease, Registry, RegistryError};
use super::{
    kernel_key, node_key, snapshot_key, tenant_key, KernelRecord, NodeRecord, SnapshotRecord,
};
use crate::kernels::ledger::Reservation;
use kernelgate_protocol::rest::SnapshotModel;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// How often a transaction that found the keys changed under it is tried again.
const ATTEMPTS: usize = 4;

/// A node's load, when it changed, is put at most this often: every put of the node's
/// record reaches every node's watch, and a node creating and deleting kernels at a steady
/// rate would otherwise put it with each.
const LOAD_EVERY: Duration = Duration::from_secs(1);

/// How many kernels' owners the cache keeps: enough for every kernel of a large cluster
/// (a record is about 200 bytes), and a bound on a stream of made-up ids.
const OWNERS_KEPT: usize = 100_000;

/// A random duration from zero to `most`.
fn jitter(most: Duration) -> Duration {
    most.mul_f64(rand::random::<f64>())
}

/// How long to wait after the `failures`-th failure in a row: from a quarter second,
/// doubling, to at most `cap`, with full jitter (a random part of it), so that nodes that
/// failed together do not try again together.
fn backoff(failures: u32, cap: Duration) -> Duration {
    let step = Duration::from_millis(250).saturating_mul(1 << failures.min(16));
    let most = step.min(cap).max(Duration::from_millis(50));
    Duration::from_millis(50) + jitter(most)
}

/// What one reconcile fixed, or found and could not fix.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reconciled {
    /// Records of this node's whose kernel is gone, removed.
    pub stale_records: u64,
    /// Kernels of this node's the registry did not name, registered.
    pub unregistered_kernels: u64,
    /// Kernels of a key with `max_kernels` that held no quota slot, given one.
    pub missing_slots: u64,
    /// Quota slots held for a kernel no node has (or a create of this node's that ended),
    /// freed.
    pub stale_slots: u64,
    /// Kernels that hold no quota slot and find none free: their key holds more kernels
    /// than it may (reported, not removed).
    pub over_quota: u64,
}

/// What a registration could not keep of this node's kernels.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Lost {
    /// Kernels another node claimed meanwhile: they stay that node's.
    pub taken: Vec<String>,
    /// Kernels whose key was at its `max_kernels` by then, with the key: refused.
    pub over_quota: Vec<(String, String)>,
}

impl Lost {
    pub fn is_empty(&self) -> bool {
        self.taken.is_empty() && self.over_quota.is_empty()
    }
}

/// How one kernel's registration went.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Registered {
    /// Its record is this node's, with the quota slot `slot` when its key has a quota.
    Held { slot: Option<String> },
    /// Another node holds its record.
    Taken,
    /// Its key's slots are all held by other kernels.
    OverQuota { key: String, max: usize },
}

/// A key's quota that a kernel (or a create under way) counts against.
#[derive(Debug, Clone)]
struct Quota {
    tenant: String,
    max: usize,
    /// The slot held now; `None` until one is taken (a kernel adopted at start).
    slot: Option<String>,
}

/// Where the membership reads each key's `max_kernels` (the keys file in force).
struct Quotas(Mutex<Option<QuotaOf>>);

impl std::fmt::Debug for Quotas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Quotas")
    }
}

/// Why a kernel could not be claimed.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("kernel {0} is already registered to another node")]
    Taken(String),
    /// This node holds no lease right now (cut off from the registry).
    #[error("this node is cut off from the cluster registry; try again shortly")]
    CutOff,
    #[error(transparent)]
    Registry(#[from] RegistryError),
}

#[derive(Debug)]
struct Own {
    lease: Option<Lease>,
    /// When the lease was last known alive.
    renewed: Option<Instant>,
    node: NodeRecord,
    /// This node's kernel records, serialized once: removal compares these exact bytes.
    kernels: HashMap<String, Vec<u8>>,
    /// The quota each of its kernels of a key with `max_kernels` counts against, by kernel
    /// id, and each create under way that holds a slot, by what it put in the slot.
    quotas: HashMap<String, Quota>,
    /// The records of the snapshots this node keeps, by snapshot id, serialized once.
    snapshots: HashMap<String, Vec<u8>>,
    /// Times the lease was found lost and the records registered again.
    reregistrations: u64,
    /// The load last put in the node's record, and when.
    published: Option<(u32, Instant)>,
    /// Quota keys (tenants) with a slot this node failed to free: the reconcile looks at
    /// their slots until it has.
    unfreed: std::collections::HashSet<String>,
}

/// A node's membership: see the module's documentation.
#[derive(Debug)]
pub struct Membership<R> {
    registry: R,
    node_id: String,
    ttl: Duration,
    own: Mutex<Own>,
    view: Mutex<View>,
    /// Kernel records read on demand, by kernel id: a kernel's owner never changes, and an
    /// entry is read again when its node leaves the view or a forward to it fails.
    owners: Mutex<HashMap<String, KernelRecord>>,
    /// Counts the view's changes: waiters wake on each.
    changes: tokio::sync::watch::Sender<u64>,
    quotas: Quotas,
}

impl<R: Registry + Clone> Membership<R> {
    pub fn new(registry: R, node_id: &str, node: NodeRecord, ttl: Duration) -> Arc<Self> {
        Arc::new(Membership {
            registry,
            node_id: node_id.to_owned(),
            ttl,
            own: Mutex::new(Own {
                lease: None,
                renewed: None,
                node,
                kernels: HashMap::new(),
                quotas: HashMap::new(),
                snapshots: HashMap::new(),
                reregistrations: 0,
                published: None,
                unfreed: Default::default(),
            }),
            view: Mutex::new(View::default()),
            owners: Mutex::new(HashMap::new()),
            changes: tokio::sync::watch::Sender::new(0),
            quotas: Quotas(Mutex::new(None)),
        })
    }

    /// Whether a kernel record is this node's (of this run or an earlier one).
    fn is_ours(&self, record: &[u8]) -> bool {
        serde_json::from_slice::<KernelRecord>(record).is_ok_and(|r| r.node == self.node_id)
    }

    fn own(&self) -> std::sync::MutexGuard<'_, Own> {
        self.own.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of the current view.
    pub fn view(&self) -> View {
        self.view.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// `read` of the view in place, without copying it.
    pub fn with_view<T>(&self, read: impl FnOnce(&View) -> T) -> T {
        read(&self.view.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Replaces the view (a listing), or applies changes to it (the watch), and wakes who
    /// waits on it.
    fn update_view(&self, change: impl FnOnce(&mut View)) {
        change(&mut self.view.lock().unwrap_or_else(|e| e.into_inner()));
        self.changes.send_modify(|n| *n += 1);
    }

    /// Resolves once `done` holds of the view, tested now and after each change.
    async fn until(&self, done: impl Fn(&View) -> bool) {
        let mut changes = self.changes.subscribe();
        loop {
            if done(&self.view.lock().unwrap_or_else(|e| e.into_inner())) {
                return;
            }
            if changes.changed().await.is_err() {
                // Never: the sender lives as long as self.
                return std::future::pending().await;
            }
        }
    }

    /// Waits, at most `timeout`, until snapshot `id` is in the view; whether it is.
    pub async fn until_snapshot_known(&self, id: &str, timeout: Duration) -> bool {
        tokio::time::timeout(timeout, self.until(|v| v.snapshots.contains_key(id)))
            .await
            .is_ok()
    }

    /// Resolves once node `id` is not in the view (its lease ended).
    pub async fn until_node_gone(&self, id: &str) {
        self.until(|v| !v.nodes.contains_key(id)).await
    }

    /// Whether this node holds a lease renewed within the TTL, with its records registered.
    pub fn registered(&self) -> bool {
        let own = self.own();
        own.lease.is_some() && own.renewed.is_some_and(|t| t.elapsed() < self.ttl)
    }

    /// How often the lease was lost and everything registered again.
    pub fn reregistrations(&self) -> u64 {
        self.own().reregistrations
    }

    /// Registers kernel `id` as this node's. Fails if another node holds it or this node is
    /// cut off; the record is kept (and registered again after a lost lease) until
    /// [`Membership::release`].
    pub async fn claim(&self, id: &str, record: &KernelRecord) -> Result<(), ClaimError> {
        let none = Reservation {
            holder: None,
            quota: None,
        };
        match self.claim_with(id, record, &none).await? {
            Registered::Held { .. } => Ok(()),
            _ => Err(ClaimError::Taken(id.to_owned())),
        }
    }

    /// Registers kernel `id` with `record`, and with the quota slot `reservation` holds
    /// (or another free one of its key), in one transaction; the kernel is this node's
    /// from then on when it answers [`Registered::Held`].
    async fn claim_with(
        &self,
        id: &str,
        record: &KernelRecord,
        reservation: &Reservation,
    ) -> Result<Registered, ClaimError> {
        let bytes = serde_json::to_vec(record).map_err(|e| {
            ClaimError::Registry(RegistryError::Malformed(format!("a kernel record: {e}")))
        })?;
        let lease = self.own().lease.ok_or(ClaimError::CutOff)?;
        let quota = reservation.quota.as_ref().map(|(tenant, max)| Quota {
            tenant: tenant.clone(),
            max: *max,
            slot: reservation
                .holder
                .as_ref()
                .and_then(|h| self.own().quotas.get(h).and_then(|q| q.slot.clone())),
        });
        let holder = reservation.holder.as_deref().unwrap_or(id);
        let registered = self
            .register_kernel(id, &bytes, lease, quota.as_ref(), holder)
            .await?;
        if let Registered::Held { slot } = &registered {
            let mut own = self.own();
            own.kernels.insert(id.to_owned(), bytes);
            if let Some(holder) = &reservation.holder {
                own.quotas.remove(holder);
            }
            if let Some(mut quota) = quota {
                quota.slot = slot.clone();
                own.quotas.insert(id.to_owned(), quota);
            }
        }
        Ok(registered)
    }

    /// Puts kernel `id`'s record (`bytes`) under `lease` where it is free or this node's,
    /// and, for a key with a quota, the slot `holder` holds (a create's reservation, or the
    /// kernel itself from before a restart), else a free one, set to the kernel's id: both
    /// in one transaction, so that no kernel is registered without its slot.
    async fn register_kernel(
        &self,
        id: &str,
        bytes: &[u8],
        lease: Lease,
        quota: Option<&Quota>,
        holder: &str,
    ) -> Result<Registered, RegistryError> {
        let key = kernel_key(id);
        let put = |key: &str, value: &[u8]| Change::Put {
            key: key.to_owned(),
            value: value.to_vec(),
            lease,
        };
        // The tenant's index entry goes with the record, in the same transaction.
        let index = index_key(id, bytes);
        let with_index = |changes: &mut Vec<Change>| {
            if let Some(index) = &index {
                changes.push(put(index, bytes));
            }
        };
        // The usual case first, without reading: a new record, the slot already held.
        let known_slot = quota.and_then(|q| q.slot.clone());
        if quota.is_none() || known_slot.is_some() {
            let mut compare = vec![Compare::Absent(key.clone())];
            let mut changes = vec![put(&key, bytes)];
            with_index(&mut changes);
            if let Some(slot) = &known_slot {
                compare.push(Compare::Holds(slot.clone(), holder.as_bytes().to_vec()));
                changes.push(put(slot, id.as_bytes()));
            }
            if self.registry.txn(&compare, &changes).await? {
                return Ok(Registered::Held { slot: known_slot });
            }
        }
        for _ in 0..ATTEMPTS {
            let mut compare = Vec::new();
            match self.entry(&key).await? {
                None => compare.push(Compare::Absent(key.clone())),
                Some(e) if self.is_ours(&e.value) => {
                    compare.push(Compare::Unchanged(key.clone(), e.revision))
                }
                Some(_) => return Ok(Registered::Taken),
            }
            let mut changes = vec![put(&key, bytes)];
            with_index(&mut changes);
            let mut slot = None;
            if let Some(q) = quota {
                let listing = self.registry.list(&quota_prefix(&q.tenant)).await?;
                let mine = listing
                    .entries
                    .iter()
                    .find(|e| e.value == holder.as_bytes() || e.value == id.as_bytes());
                let taken = match mine {
                    Some(e) => {
                        compare.push(Compare::Unchanged(e.key.clone(), e.revision));
                        e.key.clone()
                    }
                    None => match free_slots(&listing, &q.tenant, q.max).next() {
                        Some(free) => {
                            compare.push(Compare::Absent(free.clone()));
                            free
                        }
                        None => {
                            return Ok(Registered::OverQuota {
                                key: q.tenant.clone(),
                                max: q.max,
                            })
                        }
                    },
                };
                changes.push(put(&taken, id.as_bytes()));
                slot = Some(taken);
            }
            if self.registry.txn(&compare, &changes).await? {
                return Ok(Registered::Held { slot });
            }
        }
        Err(RegistryError::Refused(format!(
            "kernel {id}'s record or quota slot changed under each of {ATTEMPTS} tries"
        )))
    }

    /// Keeps kernel `id`'s record without registering it now (re-adoption at start: the
    /// lease loop registers it with the rest).
    pub fn adopt(&self, id: &str, record: &KernelRecord) {
        if let Ok(bytes) = serde_json::to_vec(record) {
            self.own().kernels.insert(id.to_owned(), bytes);
        }
    }

    /// Removes kernel `id`'s record and frees its quota slot: the one it is known to hold,
    /// else any slot of its key that names it (one taken over from an earlier run).
    pub async fn release(&self, id: &str) -> Result<(), RegistryError> {
        let (quota, bytes) = {
            let mut own = self.own();
            (own.quotas.remove(id), own.kernels.remove(id))
        };
        let tenant = quota.as_ref().map(|q| q.tenant.clone()).or_else(|| {
            bytes
                .as_deref()
                .and_then(|b| serde_json::from_slice::<KernelRecord>(b).ok())
                .map(|r| r.tenant)
        });
        if let Some(tenant) = &tenant {
            if let Err(e) = self.free_slot(id, quota.and_then(|q| q.slot), tenant).await {
                // The reconcile looks at this key's slots until it is freed, and removes
                // the record (its kernel is not running).
                let mut own = self.own();
                own.unfreed.insert(tenant.clone());
                if let Some(bytes) = bytes {
                    own.kernels.insert(id.to_owned(), bytes);
                }
                return Err(e);
            }
        }
        let Some(bytes) = bytes else {
            return Ok(());
        };
        if let Err(e) = self.remove_record(id, &bytes).await {
            // Kept as this node's: the reconcile removes it (its kernel is not running).
            self.own().kernels.insert(id.to_owned(), bytes);
            return Err(e);
        }
        self.forget_owner(id);
        Ok(())
    }

    /// Removes kernel `id`'s record, if it still holds `bytes`, with its tenant's index
    /// entry: whether it did.
    async fn remove_record(&self, id: &str, bytes: &[u8]) -> Result<bool, RegistryError> {
        let key = kernel_key(id);
        let mut changes = vec![Change::Delete(key.clone())];
        changes.extend(index_key(id, bytes).map(Change::Delete));
        self.registry
            .txn(&[Compare::Holds(key, bytes.to_vec())], &changes)
            .await
    }

    /// Frees the quota slot kernel `id` of key `tenant` holds: `slot` when it is known,
    /// else any slot of the key that names it.
    async fn free_slot(
        &self,
        id: &str,
        slot: Option<String>,
        tenant: &str,
    ) -> Result<(), RegistryError> {
        if let Some(slot) = slot {
            self.registry.delete_if(&slot, id.as_bytes()).await?;
            return Ok(());
        }
        let listing = self.registry.list(&quota_prefix(tenant)).await?;
        for e in listing.entries.iter().filter(|e| e.value == id.as_bytes()) {
            self.registry.delete_if(&e.key, id.as_bytes()).await?;
        }
        Ok(())
    }

    /// Marks kernel `id`'s record hibernated (or awake again), if it is this node's.
    pub async fn set_hibernated(&self, id: &str, hibernated: bool) -> Result<(), RegistryError> {
        let (lease, bytes) = {
            let mut own = self.own();
            let lease = own.lease;
            let Some(bytes) = own.kernels.get_mut(id) else {
                return Ok(());
            };
            let Ok(mut record) = serde_json::from_slice::<KernelRecord>(bytes) else {
                return Ok(());
            };
            record.hibernated = hibernated;
            *bytes = serde_json::to_vec(&record).unwrap_or_default();
            (lease, bytes.clone())
        };
        let Some(lease) = lease else {
            // Registered as it is now when the lease comes back.
            return Ok(());
        };
        let put = |key: String| Change::Put {
            key,
            value: bytes.clone(),
            lease,
        };
        let mut changes = vec![put(kernel_key(id))];
        changes.extend(index_key(id, &bytes).map(put));
        self.registry.txn(&[], &changes).await.map(drop)
    }

    /// Records snapshot `model` of key `owner` as kept on this node: put now when the node
    /// holds its lease, and again with every registration.
    pub async fn keep_snapshot(
        &self,
        owner: &str,
        model: &SnapshotModel,
    ) -> Result<(), RegistryError> {
        let record = SnapshotRecord {
            node: self.node_id.clone(),
            owner: owner.to_owned(),
            model: model.clone(),
        };
        let bytes = serde_json::to_vec(&record)
            .map_err(|e| RegistryError::Malformed(format!("a snapshot record: {e}")))?;
        let lease = {
            let mut own = self.own();
            own.snapshots.insert(model.id.clone(), bytes.clone());
            own.lease
        };
        match lease {
            Some(lease) => self
                .registry
                .put(&snapshot_key(&model.id), &bytes, lease)
                .await
                .map(drop),
            None => Ok(()),
        }
    }

    /// Removes snapshot `id`'s record, if this node keeps it.
    pub async fn forget_snapshot(&self, id: &str) -> Result<(), RegistryError> {
        let Some(bytes) = self.own().snapshots.remove(id) else {
            return Ok(());
        };
        self.registry.delete_if(&snapshot_key(id), &bytes).await?;
        Ok(())
    }

    /// A record of kernel `id`, owned by this node's incarnation.
    fn record_of(&self, owner: &str, spec: &str) -> KernelRecord {
        KernelRecord {
            node: self.node_id.clone(),
            incarnation: self.own().node.incarnation.clone(),
            tenant: owner.to_owned(),
            spec: spec.to_owned(),
            created: crate::time::now_iso(),
            hibernated: false,
        }
    }

    /// Brings this node's load up to date: the kernels it holds now. Put at once when the
    /// last put is [`LOAD_EVERY`] old, else by the lease loop's next tick.
    async fn publish_load(&self) {
        let due = {
            let mut own = self.own();
            own.node.load = u32::try_from(own.kernels.len()).unwrap_or(u32::MAX);
            own.published
                .is_none_or(|(_, at)| at.elapsed() >= LOAD_EVERY)
        };
        if due {
            self.publish_load_if_changed().await;
        }
    }

    /// Puts this node's load key when its load differs from the one last put. Not its
    /// record: every node watches the records, and each put would reach them all.
    async fn publish_load_if_changed(&self) {
        let (lease, load) = {
            let own = self.own();
            if own.published.is_some_and(|(load, _)| load == own.node.load) {
                return;
            }
            (own.lease, own.node.load)
        };
        if let Some(lease) = lease {
            let key = super::load_key(&self.node_id);
            match self
                .registry
                .put(&key, load.to_string().as_bytes(), lease)
                .await
            {
                Ok(_) => self.own().published = Some((load, Instant::now())),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot update this node's load in the cluster registry")
                }
            }
        }
    }

    /// Updates this node's own record (its load, say) in the registry.
    pub async fn update_node(
        &self,
        update: impl FnOnce(&mut NodeRecord),
    ) -> Result<(), RegistryError> {
        let (lease, bytes) = {
            let mut own = self.own();
            update(&mut own.node);
            (own.lease, serde_json::to_vec(&own.node).unwrap_or_default())
        };
        if let Some(lease) = lease {
            self.registry
                .put(&node_key(&self.node_id), &bytes, lease)
                .await?;
            let mut own = self.own();
            own.published = Some((own.node.load, Instant::now()));
        }
        Ok(())
    }
}

impl<R: Registry + Clone> Membership<R> {
    /// Key `key` itself, if it exists: a listing of it, without the longer keys it is a
    /// prefix of.
    async fn entry(&self, key: &str) -> Result<Option<super::Entry>, RegistryError> {
        let listing = self.registry.list(key).await?;
        Ok(listing.entries.into_iter().find(|e| e.key == key))
    }
}

/// The key of kernel `id`'s entry in its tenant's index, from its record `bytes`.
fn index_key(id: &str, bytes: &[u8]) -> Option<String> {
    let record = serde_json::from_slice::<KernelRecord>(bytes).ok()?;
    Some(tenant_key(&record.tenant, id))
}

mod lease;
mod ledger;
mod lookup;
mod quota;
mod view;
mod watch;
pub use quota::QuotaOf;
use quota::{free_slots, quota_prefix, PENDING};
pub use view::View;

#[cfg(test)]
mod tests;
