//! The node's view of everyone's records, kept current by a watch that resumes from its
//! revision (and lists again when etcd compacted it), and the reconcile that repairs this
//! node's own records and slots against the registry.

use super::{backoff, quota_prefix, Membership, Reconciled, Registered, View, PENDING};
use crate::cluster::registry::{
    Change, Compare, Entry, Event, Lease, Registry, RegistryError, Revision,
};
use crate::cluster::{kernel_key, nodes_prefix, snapshots_prefix, tenants_prefix, KernelRecord};

/// The lease `membership` holds now, or an error when it was lost meanwhile.
fn lease_now<R: Registry + Clone>(membership: &Membership<R>) -> Result<Lease, RegistryError> {
    membership.own().lease.ok_or_else(|| {
        RegistryError::Refused("this node's cluster lease was lost during a reconcile".into())
    })
}
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

impl<R: Registry + Clone> Membership<R> {
    /// Compares the registry with `local`, the kernels this node runs now (id, owner,
    /// spec), both ways, and returns how many of each it fixed:
    ///
    /// - a record of this node's whose kernel is gone is removed, with its index entry and
    ///   its quota slot (so that the node's next create is not refused for a kernel it no
    ///   longer runs, and so that no request is routed to it);
    /// - a kernel the registry does not name is registered (so that it can be routed to),
    ///   and a kernel of a key with a quota that holds no slot is given one (so that the key
    ///   cannot start more than its `max_kernels`), or reported when the key has none free;
    /// - a slot of one of this node's keys that names a kernel no node has is freed (a
    ///   release that failed half-way), as is a slot of a create of this node's that ended.
    ///
    /// It reads no full listing and no watched record of other nodes' kernels: this node's
    /// records are the ones it registered, and it reads the slots and the tenant index only
    /// of the keys it runs kernels of (or failed to free a slot of), one small range each.
    /// Records and slots of other nodes are theirs to fix, and go with their leases.
    pub async fn reconcile(
        &self,
        local: &[(String, String, String)],
    ) -> Result<Reconciled, RegistryError> {
        if self.own().lease.is_none() {
            return Ok(Reconciled::default());
        }
        let mine: Vec<(String, Vec<u8>)> = self
            .own()
            .kernels
            .iter()
            .map(|(id, bytes)| (id.clone(), bytes.clone()))
            .collect();
        let mut fixed = Reconciled::default();
        let is_local = |id: &str| local.iter().any(|(l, _, _)| l == id);
        let unfreed: Vec<String> = self.own().unfreed.iter().cloned().collect();
        let mut keys: std::collections::BTreeSet<String> = unfreed.iter().cloned().collect();
        for (id, bytes) in &mine {
            if is_local(id) {
                continue;
            }
            // Removed only if it is still this record: a take-over since is not undone.
            if self.remove_record(id, bytes).await? {
                fixed.stale_records += 1;
            }
            let mut own = self.own();
            own.kernels.remove(id);
            own.quotas.remove(id);
            drop(own);
            self.forget_owner(id);
            // Its slot, if its key has a quota, is freed below.
            if let Ok(record) = serde_json::from_slice::<KernelRecord>(bytes) {
                keys.insert(record.tenant);
            }
        }
        let quotas: Vec<(String, Option<super::Quota>)> = local
            .iter()
            .map(|(id, _, _)| (id.clone(), self.own().quotas.get(id).cloned()))
            .collect();
        keys.extend(
            quotas
                .iter()
                .filter_map(|(_, q)| q.as_ref().map(|q| q.tenant.clone())),
        );
        keys.extend(self.own().quotas.values().map(|q| q.tenant.clone()));
        // The slots first, then the index: a slot's record is put in the same transaction
        // as the slot, so a slot listed whose kernel the later index does not name has
        // none (or lost it since).
        let mut slots: Vec<Entry> = Vec::new();
        for tenant in &keys {
            slots.extend(self.registry.list(&quota_prefix(tenant)).await?.entries);
        }
        let mut indexed: std::collections::HashSet<String> = std::collections::HashSet::new();
        for tenant in &keys {
            let prefix = tenants_prefix(Some(tenant));
            for entry in self.registry.list(&prefix).await?.entries {
                if let Some(id) = entry.key.strip_prefix(&prefix) {
                    indexed.insert(id.to_owned());
                }
            }
        }
        let mut registered: std::collections::HashSet<String> = std::collections::HashSet::new();
        for ((id, owner, spec), (_, quota)) in local.iter().zip(&quotas) {
            let has_slot = quota.is_none() || slots.iter().any(|e| e.value == id.as_bytes());
            let mut known = self.own().kernels.contains_key(id);
            if !known {
                // Not registered by this node: perhaps another node's, or registered
                // before a restart; one key's read tells.
                match self.entry(&kernel_key(id)).await? {
                    Some(e) if !self.is_ours(&e.value) => continue,
                    Some(_) => known = true,
                    None => {}
                }
            }
            if known && has_slot {
                registered.insert(id.clone());
                continue;
            }
            let known_bytes = self.own().kernels.get(id).cloned();
            let bytes = known_bytes.unwrap_or_else(|| {
                serde_json::to_vec(&self.record_of(owner, spec)).unwrap_or_default()
            });
            match self
                .register_kernel(id, &bytes, lease_now(self)?, quota.as_ref(), id)
                .await?
            {
                Registered::Held { slot } => {
                    let mut own = self.own();
                    own.kernels.insert(id.clone(), bytes);
                    if let Some(q) = own.quotas.get_mut(id) {
                        q.slot = slot;
                    }
                    registered.insert(id.clone());
                    fixed.unregistered_kernels += u64::from(!known);
                    fixed.missing_slots += u64::from(!has_slot);
                }
                Registered::Taken => {}
                Registered::OverQuota { key, max } => {
                    tracing::warn!(kernel = %id, %key, max, "a kernel of this node holds no quota slot and its key has none free: the key runs more kernels than its max_kernels until one ends");
                    fixed.over_quota += 1;
                }
            }
        }
        let pending = format!("{PENDING}{}:", self.node_id);
        for slot in slots {
            let holder = String::from_utf8_lossy(&slot.value).into_owned();
            let stale = match holder.strip_prefix(PENDING) {
                // A create of this node's that ended without giving its slot back; other
                // nodes' creates go with their leases.
                Some(_) => holder.starts_with(&pending) && !self.own().quotas.contains_key(&holder),
                // No record names its kernel: not in the index (read after the slots), and
                // not in the record's own key either (a node that does not index).
                None => {
                    !registered.contains(&holder)
                        && !is_local(&holder)
                        && !indexed.contains(&holder)
                        && !self.names(&holder).await?
                }
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
        let mut own = self.own();
        for tenant in &unfreed {
            own.unfreed.remove(tenant);
        }
        Ok(fixed)
    }

    /// Whether the registry holds a record of kernel `id`.
    async fn names(&self, id: &str) -> Result<bool, RegistryError> {
        Ok(self.entry(&kernel_key(id)).await?.is_some())
    }

    /// Puts `key` under `lease` if it is free, or if what holds it is `ours` (this node's
    /// own record from before a restart, under its old lease); false if another node's.
    pub(super) async fn take(
        &self,
        key: &str,
        value: &[u8],
        lease: Lease,
        ours: impl Fn(&[u8]) -> bool,
    ) -> Result<bool, RegistryError> {
        if self.registry.create(key, value, lease).await? {
            return Ok(true);
        }
        match self.entry(key).await? {
            Some(held) if !ours(&held.value) => Ok(false),
            _ => {
                self.registry.put(key, value, lease).await?;
                Ok(true)
            }
        }
    }

    /// The watch loops, until `cancel`: one over the nodes' records, one over the
    /// snapshots'. Kernel records are not watched (a node would otherwise receive every
    /// create and delete of the whole cluster).
    pub async fn follow(self: Arc<Self>, cancel: CancellationToken) {
        let nodes = self
            .clone()
            .follow_part(nodes_prefix(), cancel.clone(), |view, listed| {
                view.nodes = listed.nodes;
                view.placed.clear();
            });
        let snapshots = self.follow_part(snapshots_prefix(), cancel, |view, listed| {
            view.snapshots = listed.snapshots;
        });
        tokio::join!(nodes, snapshots);
    }

    /// One watch loop: lists `prefix`, puts what it found in the view with `relist`, then
    /// follows changes from the listing's revision; resumes after a lost connection,
    /// lists again after compaction. A failed listing or watch is tried again after a
    /// backoff with jitter (up to 5 s), so that a slow etcd is not met with every node's
    /// retries at once.
    async fn follow_part(
        self: Arc<Self>,
        prefix: String,
        cancel: CancellationToken,
        relist: impl Fn(&mut View, View),
    ) {
        let mut from: Option<Revision> = None;
        let mut failures = 0u32;
        let most = Duration::from_secs(5);
        loop {
            if cancel.is_cancelled() {
                return;
            }
            let start = match from {
                Some(r) => r,
                None => match self.registry.list(&prefix).await {
                    Ok(listing) => {
                        let mut listed = View::default();
                        for entry in listing.entries {
                            listed.apply(&Event::Put(entry));
                        }
                        self.update_view(|current| {
                            relist(current, listed);
                            current.revision = current.revision.max(listing.revision);
                        });
                        failures = 0;
                        listing.revision + 1
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "cannot list the cluster registry; retrying");
                        failures += 1;
                        tokio::select! {
                            _ = cancel.cancelled() => return,
                            _ = tokio::time::sleep(backoff(failures, most)) => continue,
                        }
                    }
                },
            };
            from = Some(start);
            let mut stream = match self.registry.watch(&prefix, start).await {
                Ok(s) => s,
                Err(RegistryError::Compacted { .. }) => {
                    from = None;
                    continue;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot watch the cluster registry; retrying");
                    failures += 1;
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(backoff(failures, most)) => continue,
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
                        let mut revision = 0;
                        self.update_view(|view| {
                            for event in &events {
                                view.apply(event);
                            }
                            revision = view.revision;
                        });
                        from = Some(revision + 1);
                        failures = 0;
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
            failures += 1;
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(backoff(failures, most)) => {}
            }
        }
    }
}
