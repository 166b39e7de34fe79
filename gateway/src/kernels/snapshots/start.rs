//! Kernels started from a snapshot, and forks. A `memory` snapshot is restored by the
//! engine as a new sandbox with its own id, socket directory, key and session, its
//! module-level random state reseeded (the relay launcher does that on a new key); a
//! `namespace` or `filesystem` one gives a fresh kernel (warm or cold) its files, and
//! then its variables.

use super::{
    Held, KeyBudget, Mode, SnapshotError, SnapshotKind, Snapshots, TakeRequest, MAX_FORKS,
};
use crate::audit::Record;
use crate::backend::{LaunchRequest, Launched};
use crate::kernels::hibernate::{Wake, MEMORY, TAR};
use crate::kernels::{CreateError, Kernels, Limits, LiveKernel};
use crate::tenants::Tenant;
use std::collections::BTreeMap;
use std::sync::Arc;

/// One fork's outcome: its kernel, or why it did not start (each fork stands alone).
pub type ForkOutcome = Result<Arc<LiveKernel>, CreateError>;

/// What a fork made.
#[derive(Debug)]
pub struct Forked {
    /// What its snapshot kept (a Python-level one under Docker leaves out what `dropped`
    /// names).
    pub kind: SnapshotKind,
    pub dropped: Vec<String>,
    pub forks: Vec<ForkOutcome>,
}

impl Kernels {
    /// A kernel for `owner` with the state of `held`: restored whole (`memory`), or a
    /// fresh one given its files and variables. `Ok((kernel, pooled))`: whether the fresh
    /// kernel came from the warm pool.
    pub(in crate::kernels) async fn obtain_from(
        self: &Arc<Self>,
        held: &Held,
        env: BTreeMap<String, String>,
        owner: &str,
        limits: Limits,
    ) -> Result<(Arc<LiveKernel>, crate::metrics::Source), CreateError> {
        let spec = held.record.spec.clone();
        if held.record.kind == SnapshotKind::Memory {
            let live = self.restore_snapshot(held, owner, limits).await?;
            return Ok((live, crate::metrics::Source::Snapshot));
        }
        let (live, source) = self.obtain(&spec, env, owner, limits).await?;
        if let Err(e) = self.fill_from(&live, held).await {
            self.abandon(&live).await;
            return Err(e);
        }
        Ok((live, source))
    }

    /// A new sandbox restored from `held`'s checkpoint, connected and watched.
    async fn restore_snapshot(
        self: &Arc<Self>,
        held: &Held,
        owner: &str,
        limits: Limits,
    ) -> Result<Arc<LiveKernel>, CreateError> {
        let record = &held.record;
        let image = match self.settings.specs.get(&record.spec) {
            Some(spec) => spec.image.clone(),
            None => {
                return Err(CreateError::NoSuchSpec {
                    name: record.spec.clone(),
                    offered: self.settings.specs.names(),
                })
            }
        };
        let id = uuid::Uuid::new_v4().to_string();
        let req = LaunchRequest {
            kernel_id: id.clone(),
            kernel_name: record.spec.clone(),
            image,
            env: record.env.clone(),
            preload: false,
            owner: Some(owner.to_owned()),
            memory_mb: limits.memory_mb,
            cpus: limits.cpus,
        };
        let Launched { handle, connection } = self
            .backend
            .restore_kernel(&req, &held.dir().join(MEMORY))
            .await
            .map_err(|e| {
                CreateError::FromSnapshot(format!("cannot restore snapshot {} ({e})", record.id))
            })?;
        let startup = self.settings.startup_timeout;
        let connected = self
            .connect_kernel(&id, &record.spec, handle.clone(), connection, startup)
            .await;
        if connected.is_err() {
            if let Err(re) = self.backend.remove(&handle).await {
                tracing::warn!(kernel = %id, error = %re, "cannot remove a kernel restored from a snapshot that did not answer");
            }
        }
        connected
    }

    /// Gives the fresh kernel `live` the files of `held`, then (a `namespace` snapshot) its
    /// variables.
    async fn fill_from(
        self: &Arc<Self>,
        live: &Arc<LiveKernel>,
        held: &Held,
    ) -> Result<(), CreateError> {
        let hibernation = self.hibernation();
        let handle = live.handle();
        let tar = held.dir().join(TAR);
        let mode = match held.record.kind {
            SnapshotKind::Namespace => Wake::Everything,
            _ => Wake::FilesOnly,
        };
        hibernation
            .unpack(live, &handle, &tar, mode)
            .await
            .map_err(|e| CreateError::FromSnapshot(format!("snapshot {}: {e}", held.record.id)))?;
        if mode == Wake::Everything {
            hibernation.load(live, &handle).await.map_err(|why| {
                CreateError::FromSnapshot(format!(
                    "the variables of snapshot {} did not load into the new kernel: {why}",
                    held.record.id
                ))
            })?;
        }
        Ok(())
    }

    /// Starts a kernel with the state of snapshot `held` for `tenant`: a `memory` one takes
    /// no new environment (a restored process cannot), the others take `env` as a create
    /// does; `name`, when given, must be the snapshot's spec.
    pub async fn create_from(
        self: &Arc<Self>,
        held: Arc<Held>,
        name: Option<&str>,
        env: &BTreeMap<String, String>,
        tenant: &Tenant,
    ) -> Result<Arc<LiveKernel>, CreateError> {
        let record = &held.record;
        if let Some(name) = name.filter(|n| !n.is_empty() && *n != record.spec) {
            return Err(CreateError::SnapshotRefused(format!(
                "snapshot {} is of a {:?} kernel, not {name:?}: leave `name` out, or give {:?}",
                record.id, record.spec, record.spec
            )));
        }
        let env = super::super::kernel_env(env)?;
        let env = match record.kind {
            SnapshotKind::Memory if !env.is_empty() => {
                return Err(CreateError::SnapshotRefused(format!(
                    "snapshot {} holds a whole running kernel, whose process cannot take new environment variables ({}); create without `env`, or start from a `filesystem` snapshot",
                    record.id,
                    env.keys().cloned().collect::<Vec<_>>().join(", ")
                )))
            }
            SnapshotKind::Memory => record.env.clone(),
            _ => env,
        };
        let spec = record.spec.clone();
        self.create_with(Some(&spec), env, tenant, Some(held)).await
    }
}

impl Snapshots {
    /// Snapshots `live` once and starts `count` kernels from it for `tenant`; the snapshot
    /// goes once they run. Each fork succeeds or fails on its own.
    pub async fn fork(
        &self,
        live: &Arc<LiveKernel>,
        count: usize,
        accept_loss: bool,
        tenant: &Tenant,
    ) -> Result<Forked, SnapshotError> {
        if !(1..=MAX_FORKS).contains(&count) {
            return Err(SnapshotError::Invalid(format!(
                "a fork makes 1 to {MAX_FORKS} kernels, not {count}"
            )));
        }
        let req = TakeRequest {
            mode: Mode::Full,
            accept_loss,
            ..TakeRequest::default()
        };
        let held = self
            .take_held(live, req, &tenant.name, KeyBudget::default(), true)
            .await?;
        let no_env = BTreeMap::new();
        let creates = (0..count).map(|_| {
            self.kernels
                .create_from(held.clone(), None, &no_env, tenant)
        });
        let forks = futures::future::join_all(creates).await;
        let kind = held.record.kind;
        let dropped = held.record.dropped.clone();
        self.delete(&held, None, None).await;
        let started: Vec<String> = forks
            .iter()
            .filter_map(|f| f.as_ref().ok().map(|l| l.id().to_owned()))
            .collect();
        self.kernels
            .settings
            .audit
            .record(&Record::KernelForked {
                kernel: live.id().to_owned(),
                key: tenant.name.clone(),
                kind: kind.as_str().to_owned(),
                forks: started,
                failed: forks.iter().filter(|f| f.is_err()).count(),
            })
            .await;
        Ok(Forked {
            kind,
            dropped,
            forks,
        })
    }
}
