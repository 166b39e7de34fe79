//! Cluster mode's shared state: the registry in etcd where every gateway node records
//! itself and the kernels it owns, under leases that vanish with a node that stops
//! renewing them. Single-node mode (no `--etcd`) never touches any of this.
//!
//! Key layout (versioned, so that a later layout can live beside this one):
//!
//! | key | value | lease |
//! |---|---|---|
//! | `/kernelgate/v1/nodes/<node id>` | [`NodeRecord`] | the node's |
//! | `/kernelgate/v1/kernels/<kernel id>` | [`KernelRecord`] | its owner's |
//! | `/kernelgate/v1/tenants/<tenant>/<kernel id>` | the same [`KernelRecord`] | its owner's |
//! | `/kernelgate/v1/loads/<node id>` | the kernels it runs now, in decimal | the node's |
//! | `/kernelgate/v1/quota/<tenant>/<n>` | the id of the kernel holding slot `n` | its owner's |
//! | `/kernelgate/v1/snapshots/<snapshot id>` | [`SnapshotRecord`] | the node's that keeps it |
//!
//! Every node watches only the nodes' and the snapshots' records; a kernel's record is read
//! when a request names a kernel this node does not run (and kept in a cache). The tenant
//! index, put and removed in the same transaction as the record, makes a tenant's kernels
//! one small range (docs/cluster.md, "Key layout"). It was added to this layout rather
//! than starting a new one: nodes of an earlier version ignore its keys, and nodes that do
//! not write it say so in their record ([`NodeRecord::indexed`]).
//!
//! A kernel's key is claimed with a create-if-absent transaction and removed only by a
//! transaction that compares the whole record, so that no kernel ever has two owners and no
//! node removes a record another node holds.

pub mod etcd;
pub mod forward;
pub mod membership;
pub mod memory;
pub mod node;
pub mod placement;
pub mod registry;
pub mod route;
pub mod signing;
pub mod tls;

pub use registry::{
    Change, Compare, Entry, Event, Lease, Listing, Registry, RegistryError, Revision,
};

use serde::{Deserialize, Serialize};

/// Where every key of this layout starts.
pub const PREFIX: &str = "/kernelgate/v1/";

/// The key of node `id`'s record.
pub fn node_key(id: &str) -> String {
    format!("{PREFIX}nodes/{id}")
}

/// The key of kernel `id`'s record.
pub fn kernel_key(id: &str) -> String {
    format!("{PREFIX}kernels/{id}")
}

/// Where the node records are: every node watches them.
pub fn nodes_prefix() -> String {
    format!("{PREFIX}nodes/")
}

/// Where the snapshot records are: every node watches them.
pub fn snapshots_prefix() -> String {
    format!("{PREFIX}snapshots/")
}

/// The key of node `id`'s load: read by placement when it samples the node, and not
/// watched (a node's load changes with each of its creates and deletes).
pub fn load_key(id: &str) -> String {
    format!("{PREFIX}loads/{id}")
}

/// The key of kernel `id`'s entry in `tenant`'s index.
pub fn tenant_key(tenant: &str, id: &str) -> String {
    format!("{PREFIX}tenants/{tenant}/{id}")
}

/// The prefix of `tenant`'s index (every tenant's: `None`).
pub fn tenants_prefix(tenant: Option<&str>) -> String {
    match tenant {
        Some(tenant) => format!("{PREFIX}tenants/{tenant}/"),
        None => format!("{PREFIX}tenants/"),
    }
}

/// The key of `tenant`'s quota slot `n` (0 to its `max_kernels` - 1); its value is the id
/// of the kernel that holds it.
pub fn quota_key(tenant: &str, n: usize) -> String {
    format!("{PREFIX}quota/{tenant}/{n}")
}

/// The key of snapshot `id`'s record.
pub fn snapshot_key(id: &str) -> String {
    format!("{PREFIX}snapshots/{id}")
}

/// What a key of this layout names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Key<'a> {
    Node(&'a str),
    Kernel(&'a str),
    Snapshot(&'a str),
}

impl<'a> Key<'a> {
    /// `None` for keys outside the layout (another version's, or garbage).
    pub fn parse(key: &'a str) -> Option<Key<'a>> {
        let rest = key.strip_prefix(PREFIX)?;
        let (kind, id) = rest.split_once('/')?;
        if id.is_empty() || id.contains('/') {
            return None;
        }
        match kind {
            "nodes" => Some(Key::Node(id)),
            "kernels" => Some(Key::Kernel(id)),
            "snapshots" => Some(Key::Snapshot(id)),
            _ => None,
        }
    }
}

/// A gateway node, as the others see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    /// How other nodes reach it (`--advertise`).
    pub address: String,
    /// Where other nodes reach its cluster listener over mutual TLS (`https://host:port`:
    /// `--advertise`'s host, `--cluster-listen`'s port); absent without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_address: Option<String>,
    /// A new random value each time the node starts: tells a restarted node from the old one.
    pub incarnation: String,
    /// Kernels it may run (`--max-kernels`).
    pub capacity: u32,
    /// Kernels it runs now.
    pub load: u32,
    /// Its Kernelgate version.
    pub version: String,
    /// Kernel specs it can start.
    #[serde(default)]
    pub specs: Vec<String>,
    /// Warm kernels ready to hand out, by spec.
    #[serde(default)]
    pub warm: std::collections::BTreeMap<String, u32>,
    /// Stopped and coming back (SIGTERM in cluster mode): its kernels answer 503 with
    /// Retry-After, not 404, and it takes no creates.
    #[serde(default)]
    pub away: bool,
    /// It indexes its kernels by tenant (`tenants/`): a list needs to ask only the nodes the
    /// index names, and every node that does not index.
    #[serde(default)]
    pub indexed: bool,
}

/// A kernel, as the registry knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelRecord {
    /// The node id of its owner.
    pub node: String,
    /// The owner's incarnation when it claimed the kernel.
    pub incarnation: String,
    /// The key (tenant) that owns it.
    pub tenant: String,
    pub spec: String,
    /// When it was created, as Jupyter writes times.
    pub created: String,
    /// It hibernates: its state is on its owner's disk, it wakes on the next request.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hibernated: bool,
}

/// A snapshot, as the registry knows it: its files are on `node`'s disk, and only that node
/// starts a kernel from it (docs/snapshots.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// The node id of the node that keeps it.
    pub node: String,
    /// The key (tenant) that took it.
    pub owner: String,
    /// What the API shows of it.
    pub model: kernelgate_protocol::rest::SnapshotModel,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_garbage_is_ignored() {
        assert_eq!(Key::parse(&node_key("n1")), Some(Key::Node("n1")));
        assert_eq!(Key::parse(&kernel_key("k-1")), Some(Key::Kernel("k-1")));
        assert_eq!(Key::parse(&snapshot_key("s-1")), Some(Key::Snapshot("s-1")));
        for garbage in [
            "/kernelgate/v2/nodes/n1",
            "/kernelgate/v1/nodes/",
            "/kernelgate/v1/nodes/a/b",
            "/kernelgate/v1/other/x",
            "nodes/n1",
        ] {
            assert_eq!(Key::parse(garbage), None, "{garbage}");
        }
    }
}
