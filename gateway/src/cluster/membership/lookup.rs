//! What a request reads on demand instead of watching: a kernel's owner (kept in a cache),
//! a key's kernels (its index), and a few nodes' loads (for placement).

use super::{Membership, View, OWNERS_KEPT};
use crate::cluster::registry::{Registry, RegistryError};
use crate::cluster::{kernel_key, KernelRecord};
use std::collections::HashMap;

impl<R: Registry + Clone> Membership<R> {
    fn owners(&self) -> std::sync::MutexGuard<'_, HashMap<String, KernelRecord>> {
        self.owners.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A copy of the view with kernel `kernel`'s record, when the cache holds it: the
    /// nodes, the snapshots and the placements. What a request routes by, at a cost that
    /// does not grow with the number of kernels.
    pub fn view_for(&self, kernel: Option<&str>) -> View {
        let mut view = self.view.lock().unwrap_or_else(|e| e.into_inner()).copy();
        if let Some(id) = kernel {
            if let Some(record) = self.owners().get(id) {
                view.kernels.insert(id.to_owned(), record.clone());
            }
        }
        view
    }

    /// [`Membership::view_for`] kernel `id`, its record read from the registry when the
    /// cache does not hold it, or names a node that has left the view since (its kernels
    /// went with its lease, unless it came back under the same id).
    pub async fn view_finding(&self, id: &str) -> View {
        let mut view = self.view_for(Some(id));
        if view
            .kernels
            .get(id)
            .is_some_and(|r| view.nodes.contains_key(&r.node))
        {
            return view;
        }
        view.kernels.remove(id);
        match self.read_owner(id).await {
            Ok(Some(record)) => {
                view.kernels.insert(id.to_owned(), record);
            }
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(kernel = %id, error = %e, "cannot look the kernel's owner up in the cluster registry");
                view.unreadable = true;
            }
        }
        view
    }

    /// Reads kernel `id`'s record and keeps it in the cache: `None` when there is none (or
    /// it cannot be parsed).
    async fn read_owner(&self, id: &str) -> Result<Option<KernelRecord>, RegistryError> {
        let key = kernel_key(id);
        let Some(entry) = self.entry(&key).await? else {
            self.owners().remove(id);
            return Ok(None);
        };
        let Ok(record) = serde_json::from_slice::<KernelRecord>(&entry.value) else {
            return Ok(None);
        };
        let mut owners = self.owners();
        if owners.len() >= OWNERS_KEPT {
            if let Some(any) = owners.keys().next().cloned() {
                owners.remove(&any);
            }
        }
        owners.insert(id.to_owned(), record.clone());
        Ok(Some(record))
    }

    /// Whether the registry names kernel `id` (a create another node answered): read once,
    /// and kept in the cache, so that the next request for it goes straight to its owner.
    pub async fn knows_kernel(&self, id: &str) -> bool {
        self.read_owner(id).await.is_ok_and(|r| r.is_some())
    }

    /// Drops kernel `id`'s owner from the cache: a forward to it failed, or the kernel is
    /// gone; the next request reads its record again.
    pub fn forget_owner(&self, id: &str) {
        self.owners().remove(id);
    }

    /// The kernels of `tenant` (of every tenant: `None`), by its index: kernel ids and
    /// records. Only nodes that index their kernels ([`NodeRecord::indexed`]) are in it.
    pub async fn kernels_of(
        &self,
        tenant: Option<&str>,
    ) -> Result<Vec<(String, KernelRecord)>, RegistryError> {
        let prefix = crate::cluster::tenants_prefix(tenant);
        let listing = self.registry.list(&prefix).await?;
        Ok(listing
            .entries
            .into_iter()
            .filter_map(|e| {
                let id = e.key.strip_prefix(&prefix)?.rsplit('/').next()?.to_owned();
                Some((id, serde_json::from_slice(&e.value).ok()?))
            })
            .collect())
    }

    /// Counts a create this node placed on `node`, until its load is next read.
    pub fn note_placed(&self, node: &str) {
        self.update_view(|view| *view.placed.entry(node.to_owned()).or_default() += 1);
    }

    /// The loads of `nodes` as they put them last (one key each, read side by side), and
    /// their records updated with them in the view (the placements counted since, cleared):
    /// a node missing from the answer could not be read.
    pub async fn read_loads(&self, nodes: &[String]) -> HashMap<String, u32> {
        let reads = nodes.iter().map(|node| async move {
            let key = crate::cluster::load_key(node);
            let entry = self.entry(&key).await.ok()??;
            let load = std::str::from_utf8(&entry.value).ok()?.parse().ok()?;
            Some((node.clone(), load))
        });
        let loads: HashMap<String, u32> = futures::future::join_all(reads)
            .await
            .into_iter()
            .flatten()
            .collect();
        self.update_view(|view| {
            for (node, load) in &loads {
                if let Some(record) = view.nodes.get_mut(node) {
                    record.load = *load;
                }
                view.placed.remove(node);
            }
        });
        loads
    }
}
