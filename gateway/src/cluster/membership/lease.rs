//! The node's lease: registered with every record under it, renewed, registered again
//! when found lost, given up for a while (a rolling restart) or for good.

use super::{Lost, Membership, Registered};
use crate::cluster::registry::{Registry, RegistryError};
use crate::cluster::{node_key, snapshot_key};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

impl<R: Registry + Clone> Membership<R> {
    /// Gets a lease and registers the node and its kernels under it. What it could not
    /// keep (a kernel another node claimed meanwhile, one whose key is at its quota by now)
    /// is dropped from this node's records and returned, for the caller to deal with.
    pub(super) async fn register(&self) -> Result<Lost, RegistryError> {
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

    /// Registers everything of this node's under a new lease of `ttl`: the node record, the
    /// records of the snapshots it keeps, each kernel's record with its quota slot (taken
    /// back from an earlier run, or a free one), and the slots of creates under way.
    pub(super) async fn register_for(&self, ttl: Duration) -> Result<Lost, RegistryError> {
        let lease = self.registry.grant(ttl).await?;
        let (node, kernels, quotas, snapshots) = {
            let own = self.own();
            (
                serde_json::to_vec(&own.node).unwrap_or_default(),
                own.kernels.clone(),
                own.quotas.clone(),
                own.snapshots.clone(),
            )
        };
        self.registry
            .put(&node_key(&self.node_id), &node, lease)
            .await?;
        for (id, bytes) in &snapshots {
            self.registry.put(&snapshot_key(id), bytes, lease).await?;
        }
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
}
