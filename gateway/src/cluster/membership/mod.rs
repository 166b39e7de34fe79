//! One node's place in the cluster: its lease and the records under it, kept alive and
//! re-registered when lost, and the node's view of everyone's records, kept current by a
//! watch that resumes from its revision and lists again when etcd has compacted it.
//!
//! The lease: renewed every TTL/3. A renewal that finds the lease gone (it expired during a
//! partition or an etcd outage longer than the TTL), or no successful renewal for a whole
//! TTL, makes the node *cut off*: it must assume its records are gone and that other nodes
//! think its kernels are gone, so it refuses forwarded work and creates until it holds a
//! new lease with every record registered again. A kernel record is claimed with
//! create-if-absent, so re-registering never takes a kernel another node claimed meanwhile.

use super::registry::{Change, Compare, Event, Lease, Registry, RegistryError, Revision};
use super::{kernel_key, node_key, quota_key, KernelRecord, Key, NodeRecord, PREFIX};
use crate::kernels::ledger::{ClaimRefused, Ledger, Reservation};
use futures::future::BoxFuture;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How a quota slot reserved by a create under way starts (then this node's id, a colon
/// and a random token): never a kernel id.
const PENDING: &str = "creating:";

/// How often a transaction that found the keys changed under it is tried again.
const ATTEMPTS: usize = 4;

/// The kernel table's records go to the registry: a create is refused unless its kernel is
/// claimed, and the node's load follows its kernels.
impl<R: Registry + Clone + std::fmt::Debug> Ledger for Membership<R> {
    fn reserve<'a>(
        &'a self,
        owner: &'a str,
        max_kernels: Option<usize>,
    ) -> BoxFuture<'a, Result<Reservation, ClaimRefused>> {
        Box::pin(async move {
            let unavailable = |e: ClaimError| ClaimRefused::Unavailable(e.to_string());
            let Some(max) = max_kernels else {
                // No slot to hold; a node cut off refuses here all the same, before a
                // kernel is taken or started for nothing.
                if self.own().lease.is_none() {
                    return Err(unavailable(ClaimError::CutOff));
                }
                return Ok(Reservation {
                    holder: None,
                    quota: None,
                });
            };
            let holder = format!(
                "{PENDING}{}:{}",
                self.node_id,
                uuid::Uuid::new_v4().simple()
            );
            if !self
                .reserve_slot(owner, max, &holder)
                .await
                .map_err(unavailable)?
            {
                return Err(ClaimRefused::Quota {
                    key: owner.to_owned(),
                    max,
                });
            }
            Ok(Reservation {
                holder: Some(holder),
                quota: Some((owner.to_owned(), max)),
            })
        })
    }

    fn claim<'a>(
        &'a self,
        id: &'a str,
        owner: &'a str,
        spec: &'a str,
        reservation: Reservation,
    ) -> BoxFuture<'a, Result<(), ClaimRefused>> {
        Box::pin(async move {
            let unavailable = |e: ClaimError| ClaimRefused::Unavailable(e.to_string());
            let record = self.record_of(owner, spec);
            let refused = match self.claim_with(id, &record, &reservation).await {
                Ok(Registered::Held { .. }) => {
                    self.publish_load().await;
                    return Ok(());
                }
                Ok(Registered::Taken) => unavailable(ClaimError::Taken(id.to_owned())),
                Ok(Registered::OverQuota { key, max }) => ClaimRefused::Quota { key, max },
                Err(e) => unavailable(e),
            };
            self.cancel_reservation(reservation).await;
            Err(refused)
        })
    }

    fn cancel(&self, reservation: Reservation) -> BoxFuture<'_, ()> {
        Box::pin(self.cancel_reservation(reservation))
    }

    fn adopt(&self, id: &str, owner: &str, spec: &str, running: bool) {
        let record = self.record_of(owner, spec);
        Membership::adopt(self, id, &record);
        let max = if running { self.quota_of(owner) } else { None };
        let mut own = self.own();
        if let Some(max) = max {
            own.quotas.insert(
                id.to_owned(),
                Quota {
                    tenant: owner.to_owned(),
                    max,
                    slot: None,
                },
            );
        }
        own.node.load = u32::try_from(own.kernels.len()).unwrap_or(u32::MAX);
    }

    fn release<'a>(&'a self, id: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Err(e) = Membership::release(self, id).await {
                // Its lease takes it when this node stops; until then others may still
                // route to it and get this node's 404.
                tracing::warn!(kernel = %id, error = %e, "cannot remove the kernel's record from the cluster registry");
            }
            self.publish_load().await;
        })
    }

    fn hibernated<'a>(&'a self, id: &'a str, hibernated: bool) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Err(e) = self.set_hibernated(id, hibernated).await {
                tracing::warn!(kernel = %id, error = %e, "cannot mark the kernel's record hibernated in the cluster registry");
            }
        })
    }
}

/// Everyone's records, as this node last saw them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    pub nodes: HashMap<String, NodeRecord>,
    pub kernels: HashMap<String, KernelRecord>,
    /// The registry revision this view reflects.
    pub revision: Revision,
}

impl View {
    fn apply(&mut self, event: &Event) {
        match event {
            Event::Put(entry) => match Key::parse(&entry.key) {
                Some(Key::Node(id)) => {
                    if let Ok(r) = serde_json::from_slice(&entry.value) {
                        self.nodes.insert(id.to_owned(), r);
                    }
                }
                Some(Key::Kernel(id)) => {
                    if let Ok(r) = serde_json::from_slice(&entry.value) {
                        self.kernels.insert(id.to_owned(), r);
                    }
                }
                None => {}
            },
            Event::Delete { key, .. } => match Key::parse(key) {
                Some(Key::Node(id)) => {
                    self.nodes.remove(id);
                }
                Some(Key::Kernel(id)) => {
                    self.kernels.remove(id);
                }
                None => {}
            },
        }
        self.revision = self.revision.max(event.revision());
    }
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

/// The `max_kernels` of a key, from the keys in force.
pub type QuotaOf = Box<dyn Fn(&str) -> Option<usize> + Send + Sync>;

/// Where the membership reads each key's `max_kernels` (the keys file in force).
struct Quotas(Mutex<Option<QuotaOf>>);

impl std::fmt::Debug for Quotas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Quotas")
    }
}

/// The prefix of `tenant`'s quota slots.
fn quota_prefix(tenant: &str) -> String {
    format!("{PREFIX}quota/{tenant}/")
}

/// The slots of `tenant` below `max` that `listing` (of its prefix) shows free.
fn free_slots<'a>(
    listing: &'a super::Listing,
    tenant: &'a str,
    max: usize,
) -> impl Iterator<Item = String> + 'a {
    (0..max)
        .map(move |n| quota_key(tenant, n))
        .filter(move |key| !listing.entries.iter().any(|e| e.key == *key))
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
    /// Times the lease was found lost and the records registered again.
    reregistrations: u64,
}

/// A node's membership: see the module's documentation.
#[derive(Debug)]
pub struct Membership<R> {
    registry: R,
    node_id: String,
    ttl: Duration,
    own: Mutex<Own>,
    view: Mutex<View>,
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
                reregistrations: 0,
            }),
            view: Mutex::new(View::default()),
            quotas: Quotas(Mutex::new(None)),
        })
    }

    /// Where each key's `max_kernels` is read from: a kernel re-adopted at start takes
    /// back a quota slot of its key by it.
    pub fn set_quotas(&self, quota_of: QuotaOf) {
        *self.quotas.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(quota_of);
    }

    fn quota_of(&self, tenant: &str) -> Option<usize> {
        let quotas = self.quotas.0.lock().unwrap_or_else(|e| e.into_inner());
        quotas.as_ref().and_then(|f| f(tenant))
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

    /// Whether kernel `id` is in the current view.
    pub fn knows_kernel(&self, id: &str) -> bool {
        let view = self.view.lock().unwrap_or_else(|e| e.into_inner());
        view.kernels.contains_key(id)
    }

    /// Whether node `id` is in the current view (holds a lease).
    pub fn has_node(&self, id: &str) -> bool {
        let view = self.view.lock().unwrap_or_else(|e| e.into_inner());
        view.nodes.contains_key(id)
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
        // The usual case first, without reading: a new record, the slot already held.
        let known_slot = quota.and_then(|q| q.slot.clone());
        if quota.is_none() || known_slot.is_some() {
            let mut compare = vec![Compare::Absent(key.clone())];
            let mut changes = vec![put(&key, bytes)];
            if let Some(slot) = &known_slot {
                compare.push(Compare::Holds(slot.clone(), holder.as_bytes().to_vec()));
                changes.push(put(slot, id.as_bytes()));
            }
            if self.registry.txn(&compare, &changes).await? {
                return Ok(Registered::Held { slot: known_slot });
            }
        }
        for _ in 0..ATTEMPTS {
            let held = self.registry.list(&key).await?;
            let mut compare = Vec::new();
            match held.entries.iter().find(|e| e.key == key) {
                None => compare.push(Compare::Absent(key.clone())),
                Some(e) if self.is_ours(&e.value) => {
                    compare.push(Compare::Unchanged(key.clone(), e.revision))
                }
                Some(_) => return Ok(Registered::Taken),
            }
            let mut changes = vec![put(&key, bytes)];
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

    /// Takes one of `tenant`'s `max` quota slots for a create under way, as `holder`: a
    /// key per slot, claimed with create-if-absent, so that creates through different
    /// nodes at the same moment never hold more slots than the key may have. `Ok(false)`
    /// when every slot is taken.
    async fn reserve_slot(
        &self,
        tenant: &str,
        max: usize,
        holder: &str,
    ) -> Result<bool, ClaimError> {
        let lease = self.own().lease.ok_or(ClaimError::CutOff)?;
        // Known before its slot is: a reconcile meanwhile leaves the slot alone.
        self.own().quotas.insert(
            holder.to_owned(),
            Quota {
                tenant: tenant.to_owned(),
                max,
                slot: None,
            },
        );
        let reserved = self.try_reserve(tenant, max, holder, lease).await;
        let mut own = self.own();
        match &reserved {
            Ok(Some(slot)) => {
                if let Some(q) = own.quotas.get_mut(holder) {
                    q.slot = Some(slot.clone());
                }
            }
            _ => {
                own.quotas.remove(holder);
            }
        }
        reserved
            .map(|slot| slot.is_some())
            .map_err(ClaimError::from)
    }

    /// The slot `holder` took, `None` when every slot is held.
    async fn try_reserve(
        &self,
        tenant: &str,
        max: usize,
        holder: &str,
        lease: Lease,
    ) -> Result<Option<String>, RegistryError> {
        for _ in 0..ATTEMPTS {
            let listing = self.registry.list(&quota_prefix(tenant)).await?;
            let mut any = false;
            for slot in free_slots(&listing, tenant, max) {
                any = true;
                if self
                    .registry
                    .create(&slot, holder.as_bytes(), lease)
                    .await?
                {
                    return Ok(Some(slot));
                }
            }
            if !any {
                return Ok(None);
            }
        }
        Ok(None)
    }

    /// Gives back the slot a create held, if it still does.
    async fn cancel_reservation(&self, reservation: Reservation) {
        let Some(holder) = reservation.holder else {
            return;
        };
        let slot = self.own().quotas.remove(&holder).and_then(|q| q.slot);
        if let Some(slot) = slot {
            if let Err(e) = self.registry.delete_if(&slot, holder.as_bytes()).await {
                tracing::warn!(%slot, error = %e, "cannot give a quota slot back; it goes with this node's lease");
            }
        }
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
        match (quota.and_then(|q| q.slot), tenant) {
            (Some(slot), _) => {
                self.registry.delete_if(&slot, id.as_bytes()).await?;
            }
            (None, Some(tenant)) => {
                let listing = self.registry.list(&quota_prefix(&tenant)).await?;
                for e in listing.entries.iter().filter(|e| e.value == id.as_bytes()) {
                    self.registry.delete_if(&e.key, id.as_bytes()).await?;
                }
            }
            (None, None) => {}
        }
        let Some(bytes) = bytes else {
            return Ok(());
        };
        self.registry.delete_if(&kernel_key(id), &bytes).await?;
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
        match lease {
            Some(lease) => self
                .registry
                .put(&kernel_key(id), &bytes, lease)
                .await
                .map(drop),
            // Registered as it is now when the lease comes back.
            None => Ok(()),
        }
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

    /// Puts this node's record again with its load: the kernels it holds now.
    async fn publish_load(&self) {
        let (lease, bytes) = {
            let mut own = self.own();
            own.node.load = u32::try_from(own.kernels.len()).unwrap_or(u32::MAX);
            (own.lease, serde_json::to_vec(&own.node).unwrap_or_default())
        };
        if let Some(lease) = lease {
            let key = node_key(&self.node_id);
            if let Err(e) = self.registry.put(&key, &bytes, lease).await {
                tracing::warn!(error = %e, "cannot update this node's load in the cluster registry");
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
        }
        Ok(())
    }

    /// Gets a lease and registers the node and its kernels under it. What it could not
    /// keep (a kernel another node claimed meanwhile, one whose key is at its quota by now)
    /// is dropped from this node's records and returned, for the caller to deal with.
    async fn register(&self) -> Result<Lost, RegistryError> {
        self.register_for(self.ttl).await
    }

    /// This node stops and will return (SIGTERM in cluster mode): its record, marked away,
    /// and its kernels' records and quota slots move to a lease of `away_for`. Until the
    /// node is back (and takes them over) or that lease ends, the others answer 503 with
    /// Retry-After for its kernels, not 404, and its keys' quotas hold.
    pub async fn step_away(&self, away_for: Duration) -> Result<(), RegistryError> {
        self.own().node.away = true;
        let lost = self.register_for(away_for).await?;
        if !lost.is_empty() {
            tracing::warn!(?lost, "kernels not kept for this node's return");
        }
        Ok(())
    }

    /// This node leaves the cluster for good, now: its lease ends and everything under it
    /// (its record, and those of kernels it still had) with it.
    pub async fn leave(&self) -> Result<(), RegistryError> {
        let lease = self.own().lease.take();
        match lease {
            Some(lease) => self.registry.revoke(lease).await,
            None => Ok(()),
        }
    }

    /// Registers everything of this node's under a new lease of `ttl`: the node record,
    /// each kernel's record with its quota slot (taken back from an earlier run, or a free
    /// one), and the slots of creates under way.
    async fn register_for(&self, ttl: Duration) -> Result<Lost, RegistryError> {
        let lease = self.registry.grant(ttl).await?;
        let (node, kernels, quotas) = {
            let own = self.own();
            (
                serde_json::to_vec(&own.node).unwrap_or_default(),
                own.kernels.clone(),
                own.quotas.clone(),
            )
        };
        self.registry
            .put(&node_key(&self.node_id), &node, lease)
            .await?;
        let mut lost = Lost::default();
        let mut slots = Vec::new();
        for (id, bytes) in &kernels {
            let quota = quotas.get(id);
            match self.register_kernel(id, bytes, lease, quota, id).await? {
                Registered::Held { slot } => slots.push((id.clone(), slot)),
                Registered::Taken => lost.taken.push(id.clone()),
                Registered::OverQuota { key, .. } => lost.over_quota.push((id.clone(), key)),
            }
        }
        for (holder, quota) in quotas.iter().filter(|(h, _)| !kernels.contains_key(*h)) {
            let Some(slot) = &quota.slot else { continue };
            let ours = |held: &[u8]| held == holder.as_bytes();
            if !self.take(slot, holder.as_bytes(), lease, ours).await? {
                tracing::warn!(%slot, "a quota slot a create held was taken while this node was cut off; the create will be refused");
            }
        }
        let mut own = self.own();
        for (id, slot) in slots {
            if let Some(q) = own.quotas.get_mut(&id) {
                q.slot = slot;
            }
        }
        for id in lost
            .taken
            .iter()
            .chain(lost.over_quota.iter().map(|(id, _)| id))
        {
            own.kernels.remove(id);
            own.quotas.remove(id);
        }
        own.lease = Some(lease);
        own.renewed = Some(Instant::now());
        Ok(lost)
    }

    /// Compares the registry with `local`, the kernels this node runs now (id, owner,
    /// spec), both ways: a record of this node's whose kernel is gone is removed, a kernel
    /// the registry does not name is registered; a kernel of a key with a quota that holds
    /// no slot is given one (or reported, when its key has none free), and a slot that
    /// names a kernel no node has is freed. Returns how many of each it fixed.
    pub async fn reconcile(
        &self,
        local: &[(String, String, String)],
    ) -> Result<Reconciled, RegistryError> {
        let Some(lease) = self.own().lease else {
            return Ok(Reconciled::default());
        };
        let mut fixed = Reconciled::default();
        // One listing: records and slots as of one revision.
        let listing = self.registry.list(PREFIX).await?;
        let quota_prefix_all = format!("{PREFIX}quota/");
        let slots: Vec<&super::Entry> = listing
            .entries
            .iter()
            .filter(|e| e.key.starts_with(&quota_prefix_all))
            .collect();
        let is_local = |id: &str| local.iter().any(|(l, _, _)| l == id);
        let mut records = std::collections::HashSet::new();
        for entry in &listing.entries {
            let Some(Key::Kernel(id)) = Key::parse(&entry.key) else {
                continue;
            };
            records.insert(id.to_owned());
            let gone = self.is_ours(&entry.value) && !is_local(id);
            if gone && self.registry.delete_if(&entry.key, &entry.value).await? {
                let mut own = self.own();
                own.kernels.remove(id);
                own.quotas.remove(id);
                drop(own);
                records.remove(id);
                fixed.stale_records += 1;
            }
        }
        for (id, owner, spec) in local {
            let record = listing.entries.iter().find(|e| e.key == kernel_key(id));
            if record.is_some_and(|r| !self.is_ours(&r.value)) {
                // Another node's: not this node's to fix.
                continue;
            }
            let quota = self.own().quotas.get(id).cloned();
            let has_slot = quota.is_none() || slots.iter().any(|e| e.value == id.as_bytes());
            if record.is_some() && has_slot {
                continue;
            }
            let known = self.own().kernels.get(id).cloned();
            let bytes = known.unwrap_or_else(|| {
                serde_json::to_vec(&self.record_of(owner, spec)).unwrap_or_default()
            });
            match self
                .register_kernel(id, &bytes, lease, quota.as_ref(), id)
                .await?
            {
                Registered::Held { slot } => {
                    let mut own = self.own();
                    own.kernels.insert(id.clone(), bytes);
                    if let Some(q) = own.quotas.get_mut(id) {
                        q.slot = slot;
                    }
                    records.insert(id.clone());
                    fixed.unregistered_kernels += u64::from(record.is_none());
                    fixed.missing_slots += u64::from(!has_slot);
                }
                Registered::Taken => {}
                Registered::OverQuota { key, max } => {
                    tracing::warn!(kernel = %id, %key, max, "a kernel of this node holds no quota slot and its key has none free: the key runs more kernels than its max_kernels until one ends");
                    fixed.over_quota += 1;
                }
            }
        }
        let mine = format!("{PENDING}{}:", self.node_id);
        for slot in slots {
            let holder = String::from_utf8_lossy(&slot.value);
            let stale = match holder.strip_prefix(PENDING) {
                // A create of this node's that ended without giving its slot back; other
                // nodes' creates go with their leases.
                Some(_) => holder.starts_with(&mine) && !self.own().quotas.contains_key(&*holder),
                None => !records.contains(&*holder) && !is_local(&holder),
            };
            if !stale {
                continue;
            }
            let unchanged = [Compare::Unchanged(slot.key.clone(), slot.revision)];
            if self
                .registry
                .txn(&unchanged, &[Change::Delete(slot.key.clone())])
                .await?
            {
                fixed.stale_slots += 1;
            }
        }
        Ok(fixed)
    }

    /// Puts `key` under `lease` if it is free, or if what holds it is `ours` (this node's
    /// own record from before a restart, under its old lease); false if another node's.
    async fn take(
        &self,
        key: &str,
        value: &[u8],
        lease: Lease,
        ours: impl Fn(&[u8]) -> bool,
    ) -> Result<bool, RegistryError> {
        if self.registry.create(key, value, lease).await? {
            return Ok(true);
        }
        let listing = self.registry.list(key).await?;
        match listing.entries.iter().find(|e| e.key == key) {
            Some(held) if !ours(&held.value) => Ok(false),
            _ => {
                self.registry.put(key, value, lease).await?;
                Ok(true)
            }
        }
    }

    /// The lease loop, until `cancel`: registers, renews every TTL/3, registers again when
    /// the lease is lost. `on_lost` hears of kernels it could not register: claimed by
    /// another node while this one was cut off, or (re-adopted at start) refused by their
    /// key's quota. Does not revoke the lease when cancelled (a stopping node's kernels stay
    /// registered until it returns or its lease runs out).
    pub async fn keep(self: Arc<Self>, cancel: CancellationToken, on_lost: impl Fn(Lost) + Send) {
        let period = self.ttl / 3;
        let mut first = true;
        loop {
            if !first {
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(period) => {}
                }
            }
            first = false;
            let lease = self.own().lease;
            match lease {
                None => match self.register().await {
                    Ok(lost) => {
                        tracing::info!(node = %self.node_id, "registered in the cluster registry");
                        if !lost.is_empty() {
                            on_lost(lost);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot register in the cluster registry; retrying")
                    }
                },
                Some(lease) => match self.registry.keep_alive(lease).await {
                    Ok(true) => self.own().renewed = Some(Instant::now()),
                    Ok(false) => {
                        tracing::warn!(node = %self.node_id, "cluster lease lost; registering again");
                        let mut own = self.own();
                        own.lease = None;
                        own.reregistrations += 1;
                        drop(own);
                        first = true;
                    }
                    Err(e) => {
                        let stale = self.own().renewed.is_none_or(|t| t.elapsed() >= self.ttl);
                        tracing::warn!(error = %e, stale, "cannot renew the cluster lease");
                        if stale {
                            let mut own = self.own();
                            own.lease = None;
                            own.reregistrations += 1;
                        }
                    }
                },
            }
        }
    }

    /// The watch loop, until `cancel`: lists, then follows changes from the listing's
    /// revision; resumes after a lost connection, lists again after compaction.
    pub async fn follow(self: Arc<Self>, cancel: CancellationToken) {
        let mut from: Option<Revision> = None;
        let retry = Duration::from_millis(500);
        loop {
            if cancel.is_cancelled() {
                return;
            }
            let start = match from {
                Some(r) => r,
                None => match self.registry.list(PREFIX).await {
                    Ok(listing) => {
                        let mut view = View {
                            revision: listing.revision,
                            ..View::default()
                        };
                        for entry in listing.entries {
                            view.apply(&Event::Put(entry));
                        }
                        view.revision = listing.revision;
                        *self.view.lock().unwrap_or_else(|e| e.into_inner()) = view;
                        listing.revision + 1
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot list the cluster registry; retrying");
                        tokio::select! {
                            _ = cancel.cancelled() => return,
                            _ = tokio::time::sleep(retry) => continue,
                        }
                    }
                },
            };
            from = Some(start);
            let mut stream = match self.registry.watch(PREFIX, start).await {
                Ok(s) => s,
                Err(RegistryError::Compacted { .. }) => {
                    from = None;
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot watch the cluster registry; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(retry) => continue,
                    }
                }
            };
            loop {
                let next = tokio::select! {
                    _ = cancel.cancelled() => return,
                    n = stream.next() => n,
                };
                match next {
                    Some(Ok(events)) => {
                        let mut view = self.view.lock().unwrap_or_else(|e| e.into_inner());
                        for event in &events {
                            view.apply(event);
                        }
                        from = Some(view.revision + 1);
                    }
                    Some(Err(RegistryError::Compacted { .. })) => {
                        from = None;
                        break;
                    }
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "cluster watch lost; resuming");
                        break;
                    }
                    None => break,
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(retry) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests;
