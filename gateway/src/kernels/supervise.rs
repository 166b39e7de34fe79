//! Supervision of running kernels: restarts (asked for, or automatic after a death),
//! the death watch (process exit, or a heartbeat that stops answering), and culling of
//! idle kernels.

use super::{CreateError, Kernels, LiveKernel};
use crate::kernel::heartbeat;
use chrono::Utc;
use kernelgate_protocol::content::ExecutionState;
use kernelgate_protocol::ConnectionInfo;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// Heartbeat probing, for a kernel that hangs without exiting: one that misses `misses`
/// probes in a row is restarted (or declared dead). Death by exit is noticed at once
/// through the backend instead.
#[derive(Debug, Clone, Copy)]
pub struct HeartbeatCheck {
    pub every: Duration,
    pub timeout: Duration,
    pub misses: u32,
}

impl Default for HeartbeatCheck {
    fn default() -> Self {
        HeartbeatCheck {
            every: Duration::from_secs(3),
            timeout: Duration::from_secs(2),
            misses: 5,
        }
    }
}

impl Kernels {
    /// Restarts a kernel's process: state is cleared, the id and connections stay.
    /// Finishes even when the caller goes away.
    pub async fn restart(self: &Arc<Self>, live: &Arc<LiveKernel>) -> Result<(), CreateError> {
        let (me, live) = (self.clone(), live.clone());
        let restart = self.tracker.spawn(
            async move {
                let _ops = live.ops.lock().await;
                live.epoch.fetch_add(1, Ordering::SeqCst);
                me.restart_locked(&live, false).await
            }
            .in_current_span(),
        );
        restart.await.unwrap_or(Err(CreateError::ShuttingDown))
    }

    /// `announce`: tell clients `restarting`. Jupyter Server sends that status only for
    /// restarts it does on its own (a kernel died); JupyterLab shows "the kernel appears to
    /// have died" when it sees one after a restart the user asked for.
    async fn restart_locked(&self, live: &LiveKernel, announce: bool) -> Result<(), CreateError> {
        live.kernel.set_state(ExecutionState::Restarting, announce);
        live.kernel.disconnect();
        let result = async {
            self.backend.restart(&live.handle).await?;
            live.kernel
                .connect(
                    &live.connection,
                    &self.tracker,
                    live.cancel.child_token(),
                    self.settings.startup_timeout,
                )
                .await?;
            Ok::<_, CreateError>(())
        }
        .await;
        match &result {
            Ok(()) => tracing::info!(kernel = %live.id(), "kernel restarted"),
            Err(_) => live.kernel.set_state(ExecutionState::Dead, true),
        }
        result
    }

    /// Watches one kernel for death: process exit (noticed at once) or a heartbeat that
    /// stops answering. A dead kernel is restarted when autorestart is on.
    pub(super) fn watch(self: &Arc<Self>, live: &Arc<LiveKernel>) {
        let me = self.clone();
        let live = live.clone();
        let id = live.id().to_owned();
        self.tracker.spawn(
            async move {
                let cancel = live.cancel.clone();
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = me.watch_loop(&live) => {}
                }
            }
            .instrument(tracing::info_span!("kernel", kernel = %id)),
        );
    }

    async fn watch_loop(&self, live: &LiveKernel) {
        loop {
            let epoch = live.epoch.load(Ordering::SeqCst);
            let why = tokio::select! {
                exit = self.backend.wait_exit(&live.handle) => match exit {
                    Ok(code) => format!("exited with code {code}"),
                    Err(e) => format!("cannot be watched: {e}"),
                },
                () = self.heartbeat_lost(&live.connection) => "stopped answering its heartbeat".to_owned(),
            };
            let _ops = live.ops.lock().await;
            if live.epoch.load(Ordering::SeqCst) != epoch {
                continue; // the exit of an intentional restart
            }
            tracing::warn!(kernel = %live.id(), "kernel {why}");
            self.settings.audit.record(
                "kernel_died",
                serde_json::json!({"kernel": live.id(), "owner": live.owner(), "why": why,
                                   "restarting": self.settings.autorestart}),
            );
            if !self.settings.autorestart {
                live.kernel.set_state(ExecutionState::Dead, true);
                live.kernel.disconnect();
                return;
            }
            live.epoch.fetch_add(1, Ordering::SeqCst);
            if let Err(e) = self.restart_locked(live, true).await {
                tracing::warn!(kernel = %live.id(), error = %e, "automatic restart failed; kernel is dead");
                return;
            }
        }
    }

    async fn heartbeat_lost(&self, connection: &ConnectionInfo) {
        let check = self.settings.heartbeat;
        let mut misses = 0;
        while misses < check.misses {
            tokio::time::sleep(check.every).await;
            if heartbeat::probe(connection, check.timeout).await {
                misses = 0;
            } else {
                misses += 1;
            }
        }
    }

    /// Shuts down kernels with no connection that were not busy for `idle`.
    pub(super) async fn cull(self: Arc<Self>, idle: Duration) {
        let every = (idle / 4).clamp(Duration::from_secs(1), Duration::from_secs(30));
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let now = Utc::now();
            let idle_ids: Vec<String> = self
                .list()
                .into_iter()
                .filter(|l| {
                    let k = &l.kernel;
                    let quiet = (now - k.last_activity()).to_std().unwrap_or_default();
                    k.connections() == 0
                        && k.execution_state() != ExecutionState::Busy
                        && quiet >= idle
                })
                .map(|l| l.id().to_owned())
                .collect();
            for id in idle_ids {
                tracing::info!(kernel = %id, "culling idle kernel");
                self.settings
                    .audit
                    .record("kernel_culled", serde_json::json!({"kernel": id}));
                if let Some(Err(e)) = self.delete(&id).await {
                    tracing::warn!(kernel = %id, error = %e, "cannot remove culled kernel");
                }
            }
        }
    }
}
