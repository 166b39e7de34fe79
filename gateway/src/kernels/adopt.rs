//! Containers found at start, labelled with this gateway's runtime directory: kernels
//! re-adopted under their ids (also those a restart moved into a warm container), warm
//! kernels put back into their pool when they still fit, everything else removed.

use super::{CreateError, Kernels};
use crate::backend::Found;
use crate::kernelspecs::DEFAULT_SPEC;
use crate::tenants::TOKEN_KEY;
use kernelgate_protocol::ConnectionInfo;
use std::sync::Arc;
use std::time::Duration;

/// Kernels of an earlier run of this gateway (same runtime directory) that still run
/// are adopted again with their state; warm kernels nobody took go back into their
/// pool while they fit the configuration (same spec, image and limits, room in the
/// pool); the rest are removed. Warm kernels are never listed.
pub(super) async fn remove_leftovers(kernels: &Arc<Kernels>) {
    let mut found = match kernels.backend.list().await {
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
            (true, true, Some(connection)) if f.pooled => {
                kernels.pool().repool(&f, connection).await
            }
            (true, true, Some(connection)) => match adopt(kernels, &f, connection).await {
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
        if let Err(e) = kernels.backend.remove(&f.handle).await {
            tracing::warn!(kernel = %f.kernel_id, error = %e, "cannot remove leftover container");
        }
    }
}

async fn adopt(
    kernels: &Arc<Kernels>,
    found: &Found,
    connection: ConnectionInfo,
) -> Result<(), CreateError> {
    if kernels.lock().live.len() >= kernels.settings.max_kernels {
        return Err(CreateError::TooMany {
            max: kernels.settings.max_kernels,
        });
    }
    let name = if found.kernel_name.is_empty() {
        DEFAULT_SPEC
    } else {
        &found.kernel_name
    };
    let live = kernels
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
    if let Some(ledger) = &kernels.settings.ledger {
        ledger.adopt(live.id(), &owner, name, true);
    }
    let _ = live.owner.set(owner);
    kernels.lock().live.insert(live.id().to_owned(), live);
    Ok(())
}
