//! Creating a kernel: its slot under the limits and quotas, a warm kernel from the pool or
//! a new sandbox, its process connected and supervised, its environment checked.

use super::slot::Slot;
use super::snapshots::Held;
use super::{ledger, pool, CreateError, Kernels, Limits, LiveKernel, Process};
use crate::audit::{self, Record};
use crate::backend::{LaunchRequest, Launched};
use crate::kernelspecs::DEFAULT_SPEC;
use crate::metrics::{self, Source};
use crate::relay::lifecycle::Event;
use crate::relay::Relay;
use crate::tenants::Tenant;
use kernelgate_protocol::ConnectionInfo;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tracing::Instrument;

/// Keeps only `KERNEL_*` variables (as Jupyter gateways do) and checks them.
pub fn kernel_env(env: &BTreeMap<String, String>) -> Result<BTreeMap<String, String>, CreateError> {
    let mut out = BTreeMap::new();
    for (name, value) in env {
        if !name.starts_with("KERNEL_") {
            tracing::debug!(%name, "ignoring environment variable that is not KERNEL_*");
            continue;
        }
        let bad = |reason| CreateError::BadEnv {
            name: name.clone(),
            reason,
        };
        if !name
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
        {
            return Err(bad("names may only hold A-Z, 0-9 and _"));
        }
        if value.len() > 4096 || value.contains('\0') {
            return Err(bad("values must be under 4096 bytes without NUL"));
        }
        out.insert(name.clone(), value.clone());
    }
    Ok(out)
}

impl Kernels {
    /// Creates a kernel: checks the spec, environment and limit, holds the key's quota slot
    /// in the ledger (cluster mode), then takes one from the warm pool or starts one, and
    /// waits until it answers.
    ///
    /// Safe to abandon: the work runs in a task of its own, so a caller that goes away
    /// (an HTTP client hanging up drops this future) frees its slot of the limit, and a
    /// kernel started for it is removed instead of registered.
    pub async fn create(
        self: &Arc<Self>,
        name: Option<&str>,
        env: &BTreeMap<String, String>,
        tenant: &Tenant,
    ) -> Result<Arc<LiveKernel>, CreateError> {
        let env = kernel_env(env)?;
        self.create_with(name, env, tenant, None).await
    }

    /// [`Self::create`] with a checked environment, from a snapshot when `from` is one.
    pub(super) async fn create_with(
        self: &Arc<Self>,
        name: Option<&str>,
        env: BTreeMap<String, String>,
        tenant: &Tenant,
        from: Option<Arc<Held>>,
    ) -> Result<Arc<LiveKernel>, CreateError> {
        let name = name.filter(|n| !n.is_empty()).unwrap_or(DEFAULT_SPEC);
        if self.settings.specs.get(name).is_none() {
            return Err(CreateError::NoSuchSpec {
                name: name.to_owned(),
                offered: self.settings.specs.names(),
            });
        }
        let slot = self.reserve(tenant)?;
        let (tx, rx) = oneshot::channel();
        let me = self.clone();
        let name = name.to_owned();
        let limits = Limits {
            memory_mb: tenant.max_memory_mb,
            cpus: tenant.max_cpus,
        };
        let owner = tenant.name.clone();
        let max_kernels = tenant.max_kernels;
        let max_hibernated = tenant.max_hibernated;
        self.tracker.spawn(
            async move {
                // The key's quota slot first: a create the quota refuses takes no warm
                // kernel and starts none, on any node.
                let reservation = match &me.settings.ledger {
                    Some(ledger) => match ledger.reserve(&owner, max_kernels).await {
                        Ok(reservation) => Some(reservation),
                        Err(refused) => {
                            drop(slot);
                            let _ = tx.send(Err(refused.into()));
                            return;
                        }
                    },
                    None => None,
                };
                let give_back = |reservation: Option<ledger::Reservation>| async {
                    if let (Some(ledger), Some(reservation)) = (&me.settings.ledger, reservation) {
                        ledger.cancel(reservation).await;
                    }
                };
                let started = std::time::Instant::now();
                let result = match &from {
                    Some(held) => me.obtain_from(held, env.clone(), &owner, limits).await,
                    None => me.obtain(&name, env.clone(), &owner, limits).await,
                };
                let (live, source) = match result {
                    Ok((live, source)) => {
                        metrics::kernel_created(source, started.elapsed());
                        if source == Source::Pool {
                            // Labels cannot change: the owner of a warm kernel is recorded
                            // beside it, for a restarted gateway.
                            if let Err(e) = me.backend.set_owner(live.id(), &owner).await {
                                tracing::warn!(kernel = %live.id(), error = %e, "cannot record the kernel's owner");
                            }
                        }
                        (live, source)
                    }
                    Err(e) => {
                        drop(slot);
                        give_back(reservation).await;
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let _ = live.origin.set((env.clone(), limits));
                if let Some(max) = max_hibernated {
                    let _ = live.max_hibernated.set(max);
                }
                if limits == Limits::default() && pool::warm_can_take(&env) {
                    let _ = live.warm_env.set(env);
                }
                if tx.is_closed() || !slot.fill(&live) {
                    me.abandon(&live).await;
                    give_back(reservation).await;
                    return;
                }
                if let (Some(ledger), Some(reservation)) = (&me.settings.ledger, reservation) {
                    let claimed = ledger.claim(live.id(), &owner, &name, reservation).await;
                    if let Err(refused) = claimed {
                        let taken = me.lock().live.remove(live.id());
                        if let Some(taken) = taken {
                            me.abandon(&taken).await;
                        }
                        let _ = tx.send(Err(refused.into()));
                        return;
                    }
                }
                me.settings.audit.record(&Record::KernelCreated {
                    kernel: live.id().to_owned(),
                    key: owner.to_string(),
                    spec: name.to_string(),
                    source: match (&from, source) {
                        (Some(_), _) => audit::Source::Snapshot,
                        (None, Source::Pool) => audit::Source::Pool,
                        (None, _) => audit::Source::Cold,
                    },
                    snapshot: from.as_ref().map(|held| held.record.id.clone()),
                }).await;
                if let Err(Ok(live)) = tx.send(Ok(live)) {
                    // Gone between the check and the hand-over.
                    let taken = me.lock().live.remove(live.id());
                    if let Some(taken) = taken {
                        me.abandon(&taken).await;
                    }
                }
            }
            .in_current_span(),
        );
        rx.await.unwrap_or(Err(CreateError::ShuttingDown))
    }

    /// Takes a slot of the kernel limit, held until the kernel is registered or the
    /// create fails.
    pub(super) fn reserve(self: &Arc<Self>, tenant: &Tenant) -> Result<Slot, CreateError> {
        let mut t = self.lock();
        if t.running() >= self.settings.max_kernels {
            return Err(CreateError::TooMany {
                max: self.settings.max_kernels,
            });
        }
        if let Some(max) = tenant.max_kernels {
            if t.owned_by(&tenant.name) >= max {
                return Err(CreateError::TooManyForKey {
                    key: tenant.name.clone(),
                    max,
                });
            }
        }
        t.reserved += 1;
        *t.reserved_by.entry(tenant.name.clone()).or_default() += 1;
        Ok(Slot {
            kernels: self.clone(),
            owner: tenant.name.clone(),
            filled: false,
        })
    }

    /// Removes a kernel nobody takes any more: its caller went away, or the gateway is
    /// shutting down.
    pub(super) async fn abandon(&self, live: &LiveKernel) {
        tracing::info!(kernel = %live.id(), "create abandoned (caller gone or shutdown); removing the kernel");
        if let Err(e) = self.discard(live).await {
            tracing::warn!(kernel = %live.id(), error = %e, "cannot remove abandoned kernel");
        }
    }

    /// A kernel for `owner`: from the warm pool, unless its key has limits of its own
    /// (warm kernels run with the configured ones), else started now.
    pub(super) async fn obtain(
        self: &Arc<Self>,
        name: &str,
        env: BTreeMap<String, String>,
        owner: &str,
        limits: Limits,
    ) -> Result<(Arc<LiveKernel>, Source), CreateError> {
        if limits == Limits::default() {
            if let Some(live) = self.pool().take(name, &env).await {
                return Ok((live, Source::Pool));
            }
        }
        let live = self.launch(name, env, false, Some(owner), limits).await?;
        Ok((live, Source::Cold))
    }

    /// Starts a kernel (from its image's template, when it can), waits until it
    /// answers, and starts watching it.
    pub(super) async fn launch(
        self: &Arc<Self>,
        name: &str,
        env: BTreeMap<String, String>,
        preload: bool,
        owner: Option<&str>,
        limits: Limits,
    ) -> Result<Arc<LiveKernel>, CreateError> {
        self.start_kernel(name, env, preload, owner, limits, true)
            .await
    }

    /// Boots a kernel (never from a template), waits until it answers, and starts
    /// watching it.
    pub(super) async fn launch_booted(
        self: &Arc<Self>,
        name: &str,
        env: BTreeMap<String, String>,
        preload: bool,
        owner: Option<&str>,
        limits: Limits,
    ) -> Result<Arc<LiveKernel>, CreateError> {
        self.start_kernel(name, env, preload, owner, limits, false)
            .await
    }

    async fn start_kernel(
        self: &Arc<Self>,
        name: &str,
        env: BTreeMap<String, String>,
        preload: bool,
        owner: Option<&str>,
        limits: Limits,
        template: bool,
    ) -> Result<Arc<LiveKernel>, CreateError> {
        let id = uuid::Uuid::new_v4().to_string();
        let image = match self.settings.specs.get(name) {
            Some(spec) => spec.image.clone(),
            None => {
                return Err(CreateError::NoSuchSpec {
                    name: name.to_owned(),
                    offered: self.settings.specs.names(),
                })
            }
        };
        let req = LaunchRequest {
            kernel_id: id.clone(),
            kernel_name: name.to_owned(),
            image,
            env,
            preload,
            owner: owner.map(str::to_owned),
            memory_mb: limits.memory_mb,
            cpus: limits.cpus,
        };
        let restored = match template {
            true => self.from_template(&req).await,
            false => None,
        };
        let Launched { handle, connection } = match restored {
            Some(launched) => launched,
            None => self.backend.launch(&req).await?,
        };
        let startup = self.settings.startup_timeout;
        let connected = self
            .connect_kernel(&id, name, handle.clone(), connection, startup)
            .await;
        if connected.is_err() {
            if let Err(re) = self.backend.remove(&handle).await {
                tracing::warn!(kernel = %id, error = %re, "cannot remove a kernel that failed to start");
            }
        }
        connected
    }

    /// Connects to a started kernel process, waits until it answers, and watches it.
    pub(super) async fn connect_kernel(
        self: &Arc<Self>,
        id: &str,
        name: &str,
        handle: String,
        connection: ConnectionInfo,
        timeout: Duration,
    ) -> Result<Arc<LiveKernel>, CreateError> {
        let kernel = Relay::new(
            id,
            self.settings.limits,
            self.settings.audit.clone(),
            self.settings.guard.clone(),
        );
        let cancel = self.cancel.child_token();
        let supervisor = self.supervisor();
        // Shutdown may come while this kernel starts: it must not outlive the gateway.
        let connected = tokio::select! {
            // A child token: closing this process's link must not cancel the watcher.
            r = supervisor.connect_watched(&kernel, &handle, &connection, cancel.child_token(), timeout) => r,
            _ = self.cancel.cancelled() => Err(CreateError::ShuttingDown),
        };
        if let Err(e) = connected {
            cancel.cancel();
            let _ = kernel.step(Event::Unlinked).await;
            return Err(e);
        }
        let lossless = self.backend.can_checkpoint(&handle);
        let live = Arc::new(LiveKernel::new(
            kernel,
            name,
            Process { handle, connection },
            cancel,
        ));
        live.lossless.store(lossless, Ordering::SeqCst);
        self.supervisor().watch(&live);
        Ok(live)
    }
}
