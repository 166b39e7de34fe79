//! Quotas across nodes: a key's `max_kernels` held as numbered slots in the registry,
//! reserved by a create before it takes a kernel, passed to the kernel with its record, and
//! freed with it.

use super::{ClaimError, Membership, Quota, ATTEMPTS};
use crate::cluster::registry::{Lease, Registry, RegistryError};
use crate::cluster::{quota_key, PREFIX};
use crate::kernels::ledger::Reservation;

/// How a quota slot reserved by a create under way starts (then this node's id, a colon
/// and a random token): never a kernel id.
pub(super) const PENDING: &str = "creating:";

/// The `max_kernels` of a key, from the keys in force.
pub type QuotaOf = Box<dyn Fn(&str) -> Option<usize> + Send + Sync>;

/// The prefix of `tenant`'s quota slots.
pub(super) fn quota_prefix(tenant: &str) -> String {
    format!("{PREFIX}quota/{tenant}/")
}

/// The slots of `tenant` below `max` that `listing` (of its prefix) shows free.
pub(super) fn free_slots<'a>(
    listing: &'a crate::cluster::Listing,
    tenant: &'a str,
    max: usize,
) -> impl Iterator<Item = String> + 'a {
    (0..max)
        .map(move |n| quota_key(tenant, n))
        .filter(move |key| !listing.entries.iter().any(|e| e.key == *key))
}

impl<R: Registry + Clone> Membership<R> {
    /// Where each key's `max_kernels` is read from: a kernel re-adopted at start takes
    /// back a quota slot of its key by it.
    pub fn set_quotas(&self, quota_of: QuotaOf) {
        *self.quotas.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(quota_of);
    }

    pub(super) fn quota_of(&self, tenant: &str) -> Option<usize> {
        let quotas = self.quotas.0.lock().unwrap_or_else(|e| e.into_inner());
        quotas.as_ref().and_then(|f| f(tenant))
    }

    /// Takes one of `tenant`'s `max` quota slots for a create under way, as `holder`: a
    /// key per slot, claimed with create-if-absent, so that creates through different
    /// nodes at the same moment never hold more slots than the key may have. `Ok(false)`
    /// when every slot is taken.
    pub(super) async fn reserve_slot(
        &self,
        tenant: &str,
        max: usize,
        holder: &str,
    ) -> Result<bool, ClaimError> {
        let lease = self.own().lease.ok_or(ClaimError::CutOff)?;
        // Known before its slot is: a reconcile meanwhile leaves the slot alone.
        self.own().quotas.insert(
            holder.to_owned(),
            Quota {
                tenant: tenant.to_owned(),
                max,
                slot: None,
            },
        );
        let reserved = self.try_reserve(tenant, max, holder, lease).await;
        let mut own = self.own();
        match &reserved {
            Ok(Some(slot)) => {
                if let Some(q) = own.quotas.get_mut(holder) {
                    q.slot = Some(slot.clone());
                }
            }
            _ => {
                own.quotas.remove(holder);
            }
        }
        reserved
            .map(|slot| slot.is_some())
            .map_err(ClaimError::from)
    }

    /// The slot `holder` took, `None` when every slot is held.
    pub(super) async fn try_reserve(
        &self,
        tenant: &str,
        max: usize,
        holder: &str,
        lease: Lease,
    ) -> Result<Option<String>, RegistryError> {
        for _ in 0..ATTEMPTS {
            let listing = self.registry.list(&quota_prefix(tenant)).await?;
            let mut any = false;
            for slot in free_slots(&listing, tenant, max) {
                any = true;
                if self
                    .registry
                    .create(&slot, holder.as_bytes(), lease)
                    .await?
                {
                    return Ok(Some(slot));
                }
            }
            if !any {
                return Ok(None);
            }
        }
        Ok(None)
    }

    /// Gives back the slot a create held, if it still does.
    pub(super) async fn cancel_reservation(&self, reservation: Reservation) {
        let Some(holder) = reservation.holder else {
            return;
        };
        let slot = self.own().quotas.remove(&holder).and_then(|q| q.slot);
        if let Some(slot) = slot {
            if let Err(e) = self.registry.delete_if(&slot, holder.as_bytes()).await {
                tracing::warn!(%slot, error = %e, "cannot give a quota slot back; it goes with this node's lease");
            }
        }
    }
}
