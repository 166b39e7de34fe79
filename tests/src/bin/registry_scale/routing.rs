//! How a simulated node finds a kernel's owner, as this tree's gateway does to route a
//! request: the owner cache, or one read of the kernel's record. Nodes watch only the
//! nodes' and the snapshots' records. (The baseline's is in
//! `tests/registry-baseline/routing.rs`.)

use crate::timed::Timed;
use kernelgate::cluster::membership::Membership;
use std::sync::Arc;
use std::time::Duration;

/// The node that owns kernel `id`, as `node` finds it to route a request.
pub(crate) async fn owner(node: &Arc<Membership<Timed>>, id: &str) -> Option<String> {
    let view = node.view_finding(id).await;
    view.kernels.get(id).map(|r| r.node.clone())
}

/// Waits, at most `limit`, until `node` could route requests: its watch has listed the
/// nodes (`newest`, a kernel preloaded last, is found by a read when asked).
pub(crate) async fn ready(node: &Membership<Timed>, _newest: &str, limit: Duration) -> bool {
    let start = tokio::time::Instant::now();
    while node.view().nodes.is_empty() {
        if start.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// What placing a create costs the entry node `node` before it is sent: the loads of a
/// few candidates, read (the view holds no loads).
pub(crate) async fn place(node: &Arc<Membership<Timed>>) {
    let candidates: Vec<String> = node.view().nodes.into_keys().collect();
    let sampled = kernelgate::cluster::placement::sample(&candidates);
    node.read_loads(&sampled).await;
}
