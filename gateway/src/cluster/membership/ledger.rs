//! The kernel table's side of the membership: its creates, deletes and hibernations, and
//! the snapshots it keeps, recorded in the registry.

use super::{ClaimError, Membership, Quota, Registered, PENDING};
use crate::cluster::registry::Registry;
use crate::kernels::ledger::{ClaimRefused, Ledger, Reservation};
use futures::future::BoxFuture;
use kernelgate_protocol::rest::SnapshotModel;

/// The kernel table's records go to the registry: a create is refused unless its kernel is
/// claimed, and the node's load follows its kernels.
impl<R: Registry + Clone + std::fmt::Debug> Ledger for Membership<R> {
    fn reserve<'a>(
        &'a self,
        owner: &'a str,
        max_kernels: Option<usize>,
    ) -> BoxFuture<'a, Result<Reservation, ClaimRefused>> {
        Box::pin(async move {
            let unavailable = |e: ClaimError| ClaimRefused::Unavailable(e.to_string());
            let Some(max) = max_kernels else {
                // No slot to hold; a node cut off refuses here all the same, before a
                // kernel is taken or started for nothing.
                if self.own().lease.is_none() {
                    return Err(unavailable(ClaimError::CutOff));
                }
                return Ok(Reservation {
                    holder: None,
                    quota: None,
                });
            };
            let holder = format!(
                "{PENDING}{}:{}",
                self.node_id,
                uuid::Uuid::new_v4().simple()
            );
            if !self
                .reserve_slot(owner, max, &holder)
                .await
                .map_err(unavailable)?
            {
                return Err(ClaimRefused::Quota {
                    key: owner.to_owned(),
                    max,
                });
            }
            Ok(Reservation {
                holder: Some(holder),
                quota: Some((owner.to_owned(), max)),
            })
        })
    }

    fn claim<'a>(
        &'a self,
        id: &'a str,
        owner: &'a str,
        spec: &'a str,
        reservation: Reservation,
    ) -> BoxFuture<'a, Result<(), ClaimRefused>> {
        Box::pin(async move {
            let unavailable = |e: ClaimError| ClaimRefused::Unavailable(e.to_string());
            let record = self.record_of(owner, spec);
            let refused = match self.claim_with(id, &record, &reservation).await {
                Ok(Registered::Held { .. }) => {
                    self.publish_load().await;
                    return Ok(());
                }
                Ok(Registered::Taken) => unavailable(ClaimError::Taken(id.to_owned())),
                Ok(Registered::OverQuota { key, max }) => ClaimRefused::Quota { key, max },
                Err(e) => unavailable(e),
            };
            self.cancel_reservation(reservation).await;
            Err(refused)
        })
    }

    fn cancel(&self, reservation: Reservation) -> BoxFuture<'_, ()> {
        Box::pin(self.cancel_reservation(reservation))
    }

    fn adopt(&self, id: &str, owner: &str, spec: &str, running: bool) {
        let record = self.record_of(owner, spec);
        Membership::adopt(self, id, &record);
        let max = if running { self.quota_of(owner) } else { None };
        let mut own = self.own();
        if let Some(max) = max {
            own.quotas.insert(
                id.to_owned(),
                Quota {
                    tenant: owner.to_owned(),
                    max,
                    slot: None,
                },
            );
        }
        own.node.load = u32::try_from(own.kernels.len()).unwrap_or(u32::MAX);
    }

    fn release<'a>(&'a self, id: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Err(e) = Membership::release(self, id).await {
                // Its lease takes it when this node stops; until then others may still
                // route to it and get this node's 404.
                tracing::warn!(kernel = %id, error = %e, "cannot remove the kernel's record from the cluster registry");
            }
            self.publish_load().await;
        })
    }

    fn hibernated<'a>(&'a self, id: &'a str, hibernated: bool) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Err(e) = self.set_hibernated(id, hibernated).await {
                tracing::warn!(kernel = %id, error = %e, "cannot mark the kernel's record hibernated in the cluster registry");
            }
        })
    }

    fn snapshot_kept<'a>(&'a self, owner: &'a str, model: &'a SnapshotModel) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Err(e) = self.keep_snapshot(owner, model).await {
                // Kept in this node's records all the same: the next registration puts it.
                tracing::warn!(snapshot = %model.id, error = %e, "cannot record the snapshot in the cluster registry");
            }
        })
    }

    fn snapshot_gone<'a>(&'a self, id: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Err(e) = self.forget_snapshot(id).await {
                tracing::warn!(snapshot = %id, error = %e, "cannot remove the snapshot's record from the cluster registry");
            }
        })
    }

    fn snapshots_elsewhere(&self, owner: &str) -> (usize, u64) {
        let view = self.view.lock().unwrap_or_else(|e| e.into_inner());
        view.snapshots
            .values()
            .filter(|r| r.owner == owner && r.node != self.node_id)
            .fold((0, 0), |(n, b), r| (n + 1, b + r.model.size))
    }
}
