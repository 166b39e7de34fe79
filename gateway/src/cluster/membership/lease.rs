//! The node's lease: registered with every record under it, renewed, registered again
//! when found lost, given up for a while (a rolling restart) or for good.

use super::{backoff, jitter, Lost, Membership, Registered, LOAD_EVERY};
use crate::cluster::registry::{Lease, Registry, RegistryError};
use crate::cluster::{node_key, snapshot_key};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The least time a renewal is given, even when the lease has less left: etcd may still
/// hold it (its clock started when it received the last renewal, not when it was sent).
const MIN_RENEWAL: Duration = Duration::from_millis(500);

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
        let earlier = self.earlier_run_lease().await;
        let (load, node, kernels, quotas, snapshots) = {
            let own = self.own();
            (
                own.node.load,
                serde_json::to_vec(&own.node).unwrap_or_default(),
                own.kernels.clone(),
                own.quotas.clone(),
                own.snapshots.clone(),
            )
        };
        self.registry
            .put(&node_key(&self.node_id), &node, lease)
            .await?;
        let load_key = crate::cluster::load_key(&self.node_id);
        self.registry
            .put(&load_key, load.to_string().as_bytes(), lease)
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
        if let Some(old) = earlier.filter(|old| *old != lease) {
            // Everything of the earlier run's that this run took back is under the new
            // lease now; what is left (kernels that did not survive the restart, slots of
            // creates that ended with it) goes at once, not when the away lease runs out.
            match self.registry.revoke(old).await {
                Ok(()) => {
                    tracing::info!(node = %self.node_id, "the earlier run's lease ended with what this run did not take back")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot end the earlier run's lease; what this run did not take back goes when it runs out")
                }
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
        own.published = Some((load, Instant::now()));
        Ok(lost)
    }

    /// The lease of this node's earlier run, when that run stepped away (SIGTERM) and this
    /// one starts in its place (a new incarnation): it holds what this run does not take
    /// back. `None` otherwise: no earlier record, a run that did not step away (its lease
    /// ends within a TTL), or this run's own record.
    async fn earlier_run_lease(&self) -> Option<Lease> {
        let key = node_key(&self.node_id);
        let entry = self.entry(&key).await.ok()??;
        let record: crate::cluster::NodeRecord = serde_json::from_slice(&entry.value).ok()?;
        if !record.away || record.incarnation == self.own().node.incarnation {
            return None;
        }
        self.registry.lease_of(&key).await.ok().flatten()
    }

    /// The lease loop, until `cancel`: registers, renews every TTL/3, registers again when
    /// the lease is lost. `on_lost` hears of kernels it could not register: claimed by
    /// another node while this one was cut off, or (re-adopted at start) refused by their
    /// key's quota. Does not revoke the lease when cancelled (a stopping node's kernels stay
    /// registered until it returns or its lease runs out).
    ///
    /// A slow etcd costs no lease: each renewal may take all the time left on the lease,
    /// a failed one is tried again soon (backing off, with jitter, so that many nodes do not
    /// retry in step), and the lease counts as lost only when etcd says it is gone or when
    /// no renewal sent within the last TTL succeeded. Meanwhile the node's load, when it
    /// changed, is put at most once a second.
    pub async fn keep(self: Arc<Self>, cancel: CancellationToken, on_lost: impl Fn(Lost) + Send) {
        let period = self.ttl / 3;
        let mut wait = Duration::ZERO;
        let mut failures = 0u32;
        // Beside the renewals, never in their way: a put etcd is slow to answer must not
        // hold a renewal back.
        tokio::spawn(self.clone().publish_loads(cancel.clone()));
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            let lease = self.own().lease;
            let ok = match lease {
                None => match self.register().await {
                    Ok(lost) => {
                        tracing::info!(node = %self.node_id, "registered in the cluster registry");
                        if !lost.is_empty() {
                            on_lost(lost);
                        }
                        true
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot register in the cluster registry; retrying");
                        false
                    }
                },
                Some(lease) => self.renew(lease).await,
            };
            failures = if ok { 0 } else { failures + 1 };
            wait = if self.own().lease.is_none() && ok {
                // Lost just now: register again at once, after a moment's jitter.
                jitter(Duration::from_millis(200))
            } else if ok {
                period
            } else {
                backoff(failures, period / 2)
            };
        }
    }

    /// Puts the node's load, when it changed, every [`LOAD_EVERY`] until `cancel`.
    async fn publish_loads(self: Arc<Self>, cancel: CancellationToken) {
        let mut tick = tokio::time::interval(LOAD_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => self.publish_load_if_changed().await,
            }
        }
    }

    /// One renewal of `lease`, given the time left on it; whether it went through. A lease
    /// etcd says is gone, or that no renewal kept for a whole TTL, is dropped: the caller
    /// registers again.
    async fn renew(&self, lease: Lease) -> bool {
        let sent = Instant::now();
        let left = self
            .own()
            .renewed
            .map_or(self.ttl, |t| self.ttl.saturating_sub(t.elapsed()));
        let answer = tokio::time::timeout(left.max(MIN_RENEWAL), self.registry.keep_alive(lease))
            .await
            .unwrap_or_else(|_| {
                Err(RegistryError::Unreachable {
                    endpoint: "etcd".into(),
                    reason: format!("no answer to a lease renewal within {left:?}"),
                })
            });
        match answer {
            Ok(true) => {
                // etcd renewed it no earlier than it was sent.
                self.own().renewed = Some(sent);
                true
            }
            Ok(false) => {
                tracing::warn!(node = %self.node_id, "cluster lease lost; registering again");
                let mut own = self.own();
                own.lease = None;
                own.reregistrations += 1;
                true
            }
            Err(e) => {
                let stale = self.own().renewed.is_none_or(|t| t.elapsed() >= self.ttl);
                tracing::warn!(error = %e, stale, "cannot renew the cluster lease");
                if stale {
                    let mut own = self.own();
                    own.lease = None;
                    own.reregistrations += 1;
                }
                false
            }
        }
    }
}
