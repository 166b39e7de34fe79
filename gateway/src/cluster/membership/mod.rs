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

use super::registry::{Event, Lease, Registry, RegistryError, Revision};
use super::{kernel_key, node_key, quota_key, KernelRecord, Key, NodeRecord, PREFIX};
use crate::kernels::ledger::{ClaimRefused, Ledger};
use futures::future::BoxFuture;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The kernel table's records go to the registry: a create is refused unless its kernel is
/// claimed, and the node's load follows its kernels.
impl<R: Registry + Clone + std::fmt::Debug> Ledger for Membership<R> {
    fn claim<'a>(
        &'a self,
        id: &'a str,
        owner: &'a str,
        spec: &'a str,
        max_kernels: Option<usize>,
    ) -> BoxFuture<'a, Result<(), ClaimRefused>> {
        Box::pin(async move {
            let unavailable = |e: ClaimError| ClaimRefused::Unavailable(e.to_string());
            if let Some(max) = max_kernels {
                if !self.claim_slot(owner, id, max).await.map_err(unavailable)? {
                    return Err(ClaimRefused::Quota {
                        key: owner.to_owned(),
                        max,
                    });
                }
            }
            let record = self.record_of(owner, spec);
            if let Err(e) = Membership::claim(self, id, &record).await {
                if let Err(e) = self.release_slot(id).await {
                    tracing::warn!(kernel = %id, error = %e, "cannot give a quota slot back; it goes with this node's lease");
                }
                return Err(unavailable(e));
            }
            self.publish_load().await;
            Ok(())
        })
    }

    fn adopt(&self, id: &str, owner: &str, spec: &str) {
        let record = self.record_of(owner, spec);
        Membership::adopt(self, id, &record);
        let mut own = self.own();
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

/// What one reconcile fixed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reconciled {
    pub stale_records: u64,
    pub unregistered_kernels: u64,
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
    /// The quota slot each of its kernels holds, by kernel id (tenants with `max_kernels`).
    slots: HashMap<String, String>,
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
                slots: HashMap::new(),
                reregistrations: 0,
            }),
            view: Mutex::new(View::default()),
        })
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
        let bytes = serde_json::to_vec(record).map_err(|e| {
            ClaimError::Registry(RegistryError::Malformed(format!("a kernel record: {e}")))
        })?;
        let lease = self.own().lease.ok_or(ClaimError::CutOff)?;
        // This node's own record may be there already (the reconcile found the kernel
        // first): it is overwritten; another node's never is.
        let ours = |held: &[u8]| {
            serde_json::from_slice::<KernelRecord>(held).is_ok_and(|r| r.node == self.node_id)
        };
        if !self.take(&kernel_key(id), &bytes, lease, ours).await? {
            return Err(ClaimError::Taken(id.to_owned()));
        }
        self.own().kernels.insert(id.to_owned(), bytes);
        Ok(())
    }

    /// Takes one of `tenant`'s `max` quota slots for kernel `id`: a key per slot, claimed
    /// with create-if-absent, so that creates through different nodes at the same moment
    /// never hold more kernels than the key may have. `Ok(false)` when every slot is taken.
    pub async fn claim_slot(&self, tenant: &str, id: &str, max: usize) -> Result<bool, ClaimError> {
        let lease = self.own().lease.ok_or(ClaimError::CutOff)?;
        for n in 0..max {
            let key = quota_key(tenant, n);
            if self.registry.create(&key, id.as_bytes(), lease).await? {
                self.own().slots.insert(id.to_owned(), key);
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Gives kernel `id`'s quota slot back, if it holds one.
    async fn release_slot(&self, id: &str) -> Result<(), RegistryError> {
        let Some(key) = self.own().slots.remove(id) else {
            return Ok(());
        };
        self.registry.delete_if(&key, id.as_bytes()).await?;
        Ok(())
    }

    /// Keeps kernel `id`'s record without registering it now (re-adoption at start: the
    /// lease loop registers it with the rest).
    pub fn adopt(&self, id: &str, record: &KernelRecord) {
        if let Ok(bytes) = serde_json::to_vec(record) {
            self.own().kernels.insert(id.to_owned(), bytes);
        }
    }

    /// Removes kernel `id`'s record (and its quota slot), if it is still this node's.
    pub async fn release(&self, id: &str) -> Result<(), RegistryError> {
        self.release_slot(id).await?;
        let Some(bytes) = self.own().kernels.remove(id) else {
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

    /// Gets a lease and registers the node and its kernels under it. A kernel another node
    /// claimed meanwhile stays that node's: it is dropped from this node's records and
    /// returned, for the caller to deal with.
    async fn register(&self) -> Result<Vec<String>, RegistryError> {
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
            tracing::warn!(kernels = ?lost, "kernels claimed by another node; not kept for this node's return");
        }
        Ok(())
    }

    /// Registers everything of this node's under a new lease of `ttl`; the kernels another
    /// node holds now.
    async fn register_for(&self, ttl: Duration) -> Result<Vec<String>, RegistryError> {
        let lease = self.registry.grant(ttl).await?;
        let (node, kernels, slots) = {
            let own = self.own();
            (
                serde_json::to_vec(&own.node).unwrap_or_default(),
                own.kernels.clone(),
                own.slots.clone(),
            )
        };
        self.registry
            .put(&node_key(&self.node_id), &node, lease)
            .await?;
        let mut lost = Vec::new();
        for (id, bytes) in &kernels {
            // Held by this node's previous run (its lease not yet expired): this node's.
            let ours = |held: &[u8]| {
                serde_json::from_slice::<KernelRecord>(held).is_ok_and(|r| r.node == self.node_id)
            };
            if !self.take(&kernel_key(id), bytes, lease, ours).await? {
                lost.push(id.clone());
            }
        }
        for (id, key) in &slots {
            let ours = |held: &[u8]| held == id.as_bytes();
            if !self.take(key, id.as_bytes(), lease, ours).await? {
                tracing::warn!(kernel = %id, slot = %key, "a quota slot was taken while this node was cut off: its key may hold one kernel too many until one ends");
            }
        }
        let mut own = self.own();
        for id in &lost {
            own.kernels.remove(id);
            own.slots.remove(id);
        }
        own.lease = Some(lease);
        own.renewed = Some(Instant::now());
        Ok(lost)
    }

    /// Compares the registry with `local`, the kernels this node runs now (id, owner,
    /// spec), both ways: a record of this node's whose kernel is gone is removed, a kernel
    /// the registry does not name is registered. Returns how many of each it fixed.
    pub async fn reconcile(
        &self,
        local: &[(String, String, String)],
    ) -> Result<Reconciled, RegistryError> {
        let Some(lease) = self.own().lease else {
            return Ok(Reconciled::default());
        };
        let mut fixed = Reconciled::default();
        let listing = self.registry.list(&format!("{PREFIX}kernels/")).await?;
        for entry in &listing.entries {
            let Some(Key::Kernel(id)) = Key::parse(&entry.key) else {
                continue;
            };
            let mine = serde_json::from_slice::<KernelRecord>(&entry.value)
                .is_ok_and(|r| r.node == self.node_id);
            let gone = mine && !local.iter().any(|(l, _, _)| l == id);
            if gone && self.registry.delete_if(&entry.key, &entry.value).await? {
                self.own().kernels.remove(id);
                fixed.stale_records += 1;
            }
        }
        for (id, owner, spec) in local {
            let named = listing.entries.iter().any(|e| e.key == kernel_key(id));
            if named {
                continue;
            }
            let record = self.record_of(owner, spec);
            let bytes = serde_json::to_vec(&record).unwrap_or_default();
            let ours = |held: &[u8]| {
                serde_json::from_slice::<KernelRecord>(held).is_ok_and(|r| r.node == self.node_id)
            };
            if self.take(&kernel_key(id), &bytes, lease, ours).await? {
                self.own().kernels.insert(id.clone(), bytes);
                fixed.unregistered_kernels += 1;
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
    /// the lease is lost. `on_lost` hears of kernels another node claimed while this one was
    /// cut off. Does not revoke the lease when cancelled (a stopping node's kernels stay
    /// registered until it returns or its lease runs out).
    pub async fn keep(
        self: Arc<Self>,
        cancel: CancellationToken,
        on_lost: impl Fn(Vec<String>) + Send,
    ) {
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
                            tracing::warn!(kernels = ?lost, "kernels claimed by another node while this one was cut off");
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
