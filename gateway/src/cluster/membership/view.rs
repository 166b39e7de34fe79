//! The nodes' and the snapshots' records as this node last saw them, kept by the watch,
//! with the creates this node placed on each node since that node last put its record.
//! Kernel records are not watched: a request reads the one it names (see
//! [`super::Membership::view_finding`]).

use crate::cluster::registry::{Event, Revision};
use crate::cluster::{KernelRecord, Key, NodeRecord, SnapshotRecord};
use std::collections::HashMap;

/// The nodes and the snapshots, as this node last saw them, and the kernel a request
/// names, when it asked for one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    pub nodes: HashMap<String, NodeRecord>,
    /// The record of the kernel asked for ([`super::Membership::view_for`]), when known:
    /// never more than that one.
    pub kernels: HashMap<String, KernelRecord>,
    pub snapshots: HashMap<String, SnapshotRecord>,
    /// Creates this node placed on each node since that node's record last changed: its
    /// load counts them only from its next put (at most a second later), and creates in
    /// quick succession must spread out meanwhile.
    pub placed: HashMap<String, u32>,
    /// The registry revision of the last change this view reflects.
    pub revision: Revision,
    /// The registry could not be read for the kernel asked for: its owner is unknown for
    /// now, which is not the same as no owner (a request answers 503, not 404).
    pub unreadable: bool,
}

impl View {
    /// One change the watch saw (or one entry of a listing, as a put). Keys the view does
    /// not keep (kernel records, an index, another layout's) are passed over.
    pub fn apply(&mut self, event: &Event) {
        match event {
            Event::Put(entry) => match Key::parse(&entry.key) {
                Some(Key::Node(id)) => {
                    if let Ok(r) = serde_json::from_slice(&entry.value) {
                        self.nodes.insert(id.to_owned(), r);
                        self.placed.remove(id);
                    }
                }
                Some(Key::Snapshot(id)) => {
                    if let Ok(r) = serde_json::from_slice(&entry.value) {
                        self.snapshots.insert(id.to_owned(), r);
                    }
                }
                Some(Key::Kernel(_)) | None => {}
            },
            Event::Delete { key, .. } => match Key::parse(key) {
                Some(Key::Node(id)) => {
                    self.nodes.remove(id);
                    self.placed.remove(id);
                }
                Some(Key::Snapshot(id)) => {
                    self.snapshots.remove(id);
                }
                Some(Key::Kernel(_)) | None => {}
            },
        }
        self.revision = self.revision.max(event.revision());
    }

    /// A copy of the nodes, the snapshots and the placements, without a kernel record.
    pub(super) fn copy(&self) -> View {
        View {
            nodes: self.nodes.clone(),
            kernels: HashMap::new(),
            snapshots: self.snapshots.clone(),
            placed: self.placed.clone(),
            revision: self.revision,
            unreadable: false,
        }
    }
}
