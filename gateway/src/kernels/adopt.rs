//! Containers found at start, labelled with this gateway's runtime directory: kernels
//! re-adopted under their ids (also those a restart moved into a warm container), warm
//! kernels put back into their pool when they still fit, everything else removed.

use super::*;

impl Kernels {
    /// Kernels of an earlier run of this gateway (same runtime directory) that still run
    /// are adopted again with their state; warm kernels nobody took go back into their
    /// pool while they fit the configuration (same spec, image and limits, room in the
    /// pool); the rest are removed. Warm kernels are never listed.
    pub(super) async fn remove_leftovers(self: &Arc<Self>) {
        let mut found = match self.backend.list().await {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list kernel containers");
                return;
            }
        };
        // A container a restart moved a kernel into wins over the kernel's old one.
        found.sort_by_key(|f| !f.moved);
        let mut seen = std::collections::HashSet::new();
        for f in found {
            let first = seen.insert(f.kernel_id.clone());
            let kept = match (first, f.running, f.connection.clone()) {
                (true, true, Some(connection)) if f.pooled => self.repool(&f, connection).await,
                (true, true, Some(connection)) => match self.adopt(&f, connection).await {
                    Ok(()) => {
                        tracing::info!(kernel = %f.kernel_id, "re-adopted kernel left by an earlier run");
                        true
                    }
                    Err(e) => {
                        tracing::warn!(kernel = %f.kernel_id, error = %e, "cannot re-adopt kernel");
                        false
                    }
                },
                _ => false,
            };
            if kept {
                continue;
            }
            tracing::info!(kernel = %f.kernel_id, container = %f.handle, "removing kernel container left by an earlier run");
            if let Err(e) = self.backend.remove(&f.handle).await {
                tracing::warn!(kernel = %f.kernel_id, error = %e, "cannot remove leftover container");
            }
        }
    }

    /// Puts a warm kernel of an earlier run back into its pool, if it fits: its spec still
    /// has a pool with room, runs the same image, and the kernel was made with the limits
    /// in force.
    async fn repool(self: &Arc<Self>, found: &Found, connection: ConnectionInfo) -> bool {
        let spec = match self.settings.specs.get(&found.kernel_name) {
            Some(spec) if spec.pool_size > 0 => spec,
            _ => return false,
        };
        let room = self.lock().pool.get(&spec.name).map_or(0, VecDeque::len) < spec.pool_size;
        if !(room && found.current && found.image == spec.image) {
            tracing::info!(kernel = %found.kernel_id, "a warm kernel of an earlier run does not fit the configuration");
            return false;
        }
        let name = spec.name.clone();
        match self
            .connect_kernel(
                &found.kernel_id,
                &name,
                found.handle.clone(),
                connection,
                Duration::from_secs(10),
            )
            .await
        {
            Ok(live) if self.pool_add(&name, &live) => {
                tracing::info!(kernel = %found.kernel_id, "a warm kernel of an earlier run is back in the pool");
                true
            }
            Ok(live) => {
                live.cancel.cancel();
                live.relay.disconnect();
                false
            }
            Err(e) => {
                tracing::warn!(kernel = %found.kernel_id, error = %e, "cannot take back a warm kernel");
                false
            }
        }
    }

    async fn adopt(
        self: &Arc<Self>,
        found: &Found,
        connection: ConnectionInfo,
    ) -> Result<(), CreateError> {
        if self.lock().live.len() >= self.settings.max_kernels {
            return Err(CreateError::TooMany {
                max: self.settings.max_kernels,
            });
        }
        let name = if found.kernel_name.is_empty() {
            DEFAULT_SPEC
        } else {
            &found.kernel_name
        };
        let live = self
            .connect_kernel(
                &found.kernel_id,
                name,
                found.handle.clone(),
                connection,
                Duration::from_secs(10),
            )
            .await?;
        // Kernels from before tenants were recorded belong to the admin.
        let owner = found.owner.clone().unwrap_or_else(|| TOKEN_KEY.to_owned());
        if let Some(ledger) = &self.settings.ledger {
            ledger.adopt(live.id(), &owner, name, true);
        }
        let _ = live.owner.set(owner);
        self.lock().live.insert(live.id().to_owned(), live);
        Ok(())
    }
}
