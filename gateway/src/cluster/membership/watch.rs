//! The node's view of everyone's records, kept current by a watch that resumes from its
//! revision (and lists again when etcd compacted it), and the reconcile that repairs this
//! node's own records and slots against the registry.

use super::{Membership, Reconciled, Registered, View, PENDING};
use crate::cluster::registry::{Change, Compare, Event, Lease, Registry, RegistryError, Revision};
use crate::cluster::{kernel_key, Key, PREFIX};
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

impl<R: Registry + Clone> Membership<R> {
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
        let slots: Vec<&crate::cluster::Entry> = listing
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
        let listing = self.registry.list(key).await?;
        match listing.entries.iter().find(|e| e.key == key) {
            Some(held) if !ours(&held.value) => Ok(false),
            _ => {
                self.registry.put(key, value, lease).await?;
                Ok(true)
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
                        self.update_view(|current| *current = view);
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
                        let mut revision = 0;
                        self.update_view(|view| {
                            for event in &events {
                                view.apply(event);
                            }
                            revision = view.revision;
                        });
                        from = Some(revision + 1);
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
