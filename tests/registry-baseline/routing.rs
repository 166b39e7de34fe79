//! The baseline's way for a simulated node to find a kernel's owner: every node watched
//! every kernel record, and looked the owner up in its view. `make bench-registry` copies
//! this over `tests/src/bin/registry_scale/routing.rs` in the baseline's tree (the
//! cluster code before the registry's scale work), which has neither an owner cache nor
//! point reads.

use crate::timed::Timed;
use kernelgate::cluster::membership::Membership;
use std::sync::Arc;
use std::time::Duration;

/// The node that owns kernel `id`, as `node`'s view names it. The look-up copies the view:
/// on a thread of its own, as each real node has its own cores, not on the runtime every
/// simulated node shares.
pub(crate) async fn owner(node: &Arc<Membership<Timed>>, id: &str) -> Option<String> {
    let (node, id) = (node.clone(), id.to_owned());
    let copy = move || node.view().kernels.get(&id).map(|r| r.node.clone());
    tokio::task::spawn_blocking(copy).await.ok().flatten()
}

/// Waits, at most `limit`, until `node`'s view holds kernel `newest` (preloaded last): its
/// watch's first listing is in.
pub(crate) async fn ready(node: &Membership<Timed>, newest: &str, limit: Duration) -> bool {
    node.until_kernel_known(newest, limit).await
}

/// What placing a create cost the entry node `node` before it was sent: nothing of the
/// registry's (it ordered the nodes by the loads its view held).
pub(crate) async fn place(node: &Arc<Membership<Timed>>) {
    let _ = node;
}
