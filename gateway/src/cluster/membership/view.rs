//! Everyone's records as this node last saw them, kept by the watch, with each node's
//! count of kernel records kept alongside.

use crate::cluster::registry::{Event, Revision};
use crate::cluster::{KernelRecord, Key, NodeRecord, SnapshotRecord};
use std::collections::HashMap;

/// Everyone's records, as this node last saw them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    pub nodes: HashMap<String, NodeRecord>,
    pub kernels: HashMap<String, KernelRecord>,
    /// The revision of each kernel record's last change, by kernel id: the reconcile
    /// removes a stale record only if it is still that change.
    pub kernel_revisions: HashMap<String, Revision>,
    pub snapshots: HashMap<String, SnapshotRecord>,
    /// How many kernel records each node holds, kept as records come and go (placement
    /// reads it for every create; counting the records each time grows with the cluster).
    pub kernels_on: HashMap<String, u32>,
    /// The registry revision this view reflects.
    pub revision: Revision,
}

impl View {
    /// One change the watch saw (or one entry of a listing, as a put).
    pub fn apply(&mut self, event: &Event) {
        match event {
            Event::Put(entry) => match Key::parse(&entry.key) {
                Some(Key::Node(id)) => {
                    if let Ok(r) = serde_json::from_slice(&entry.value) {
                        self.nodes.insert(id.to_owned(), r);
                    }
                }
                Some(Key::Kernel(id)) => {
                    if let Ok(r) = serde_json::from_slice::<KernelRecord>(&entry.value) {
                        *self.kernels_on.entry(r.node.clone()).or_default() += 1;
                        if let Some(old) = self.kernels.insert(id.to_owned(), r) {
                            self.uncount(&old.node);
                        }
                        self.kernel_revisions.insert(id.to_owned(), entry.revision);
                    }
                }
                Some(Key::Snapshot(id)) => {
                    if let Ok(r) = serde_json::from_slice(&entry.value) {
                        self.snapshots.insert(id.to_owned(), r);
                    }
                }
                None => {}
            },
            Event::Delete { key, .. } => match Key::parse(key) {
                Some(Key::Node(id)) => {
                    self.nodes.remove(id);
                }
                Some(Key::Kernel(id)) => {
                    if let Some(old) = self.kernels.remove(id) {
                        self.uncount(&old.node);
                    }
                    self.kernel_revisions.remove(id);
                }
                Some(Key::Snapshot(id)) => {
                    self.snapshots.remove(id);
                }
                None => {}
            },
        }
        self.revision = self.revision.max(event.revision());
    }

    fn uncount(&mut self, node: &str) {
        if let Some(n) = self.kernels_on.get_mut(node) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.kernels_on.remove(node);
            }
        }
    }

    /// A copy of the nodes, the snapshots and the counts, with only kernel `kernel`'s
    /// record (if named and known): what a request needs, without copying every record.
    pub(super) fn for_kernel(&self, kernel: Option<&str>) -> View {
        let one = |map_id: Option<&str>| {
            map_id
                .and_then(|id| self.kernels.get_key_value(id))
                .map(|(id, r)| (id.clone(), r.clone()))
        };
        View {
            nodes: self.nodes.clone(),
            kernels: one(kernel).into_iter().collect(),
            kernel_revisions: kernel
                .and_then(|id| self.kernel_revisions.get_key_value(id))
                .map(|(id, r)| (id.clone(), *r))
                .into_iter()
                .collect(),
            snapshots: self.snapshots.clone(),
            kernels_on: self.kernels_on.clone(),
            revision: self.revision,
        }
    }
}
