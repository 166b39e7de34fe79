//! Supervision of running kernels: restarts (asked for, or automatic after a death),
//! the death watch (process exit, an out-of-memory kill that leaves the process stuck, or
//! a heartbeat that stops answering; a kernel brought back after it was declared dead is
//! watched again), and culling of idle kernels.
//!
//! A restart moves the kernel into a warm kernel of its spec's pool when one fits (the
//! configured limits, an environment a warm kernel can be given): same id, same clients,
//! a fresh process in a fresh container, in milliseconds; the old container is removed.
//! Otherwise the kernel's own container is restarted. Either way the new process is
//! watched while it starts, so one that dies is seen at once; a restart is tried
//! [`RESTART_TRIES`] times with back-off before the kernel is declared dead, with why and
//! what brings it back.

use super::{CreateError, Kernels, LiveKernel, Process, Removal};
use crate::audit::Record;
use crate::backend::BackendError;
use crate::relay::heartbeat;
use chrono::Utc;
use kernelgate_protocol::content::ExecutionState;
use kernelgate_protocol::ConnectionInfo;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

/// After an out-of-memory kill in a kernel's container, heartbeat probes that must all go
/// unanswered before the kernel counts as dead of it: under 2 s in all.
const OOM_PROBES: u32 = 3;
const OOM_PROBE_GAP: Duration = Duration::from_millis(100);
const OOM_PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// Tries of one restart before the kernel is declared dead.
pub(super) const RESTART_TRIES: u32 = 3;

/// What [`Kernels::connect_watched`] adds to the cause of a process that exited while it
/// started.
pub(super) const WHILE_STARTING: &str = " while it started";

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

/// The wait after failed try `n` (from 1) of a restart: 1 s, 3 s, 9 s, never more than 10 s.
pub(super) fn backoff(n: u32) -> Duration {
    Duration::from_secs(3u64.saturating_pow(n.saturating_sub(1)).min(10))
}

/// Whether another try may succeed where `e` failed. A kernel that did not answer within
/// the startup timeout already had its time.
fn retryable(e: &CreateError) -> bool {
    !matches!(
        e,
        CreateError::ShuttingDown | CreateError::Kernel(crate::relay::KernelError::NotReady(_))
    )
}

/// What happened to a process a failed try started, as the executions sent to it are told.
fn cause_of(e: &CreateError) -> String {
    match e {
        CreateError::Backend(BackendError::Died(text)) => {
            text.strip_suffix(WHILE_STARTING).unwrap_or(text).to_owned()
        }
        e => format!("the kernel did not come back ({e})"),
    }
}

impl Kernels {
    /// Restarts a kernel as key `key` asked: a fresh process (variables and files gone), the
    /// id and connections stay; audited. Finishes even when the caller goes away.
    pub async fn restart(
        self: &Arc<Self>,
        live: &Arc<LiveKernel>,
        key: &str,
    ) -> Result<(), CreateError> {
        self.settings
            .audit
            .record(&Record::KernelRestarted {
                kernel: live.id().to_owned(),
                owner: live.owner().to_owned(),
                key: key.to_owned(),
            })
            .await;
        let (me, live) = (self.clone(), live.clone());
        let restart = self.tracker.spawn(
            async move {
                let _ops = live.ops.lock().await;
                if live.is_hibernated() {
                    // Fresh, as any restart: the saved state goes.
                    me.forget_state(live.id()).await;
                    live.relay
                        .refuse_waiting("the kernel was restarted".into())
                        .await;
                    return me.wake_fresh(&live).await;
                }
                live.epoch.fetch_add(1, Ordering::SeqCst);
                live.relay
                    .lost_executions("KernelRestarted", "the kernel was restarted")
                    .await;
                me.restart_locked(&live).await
            }
            .in_current_span(),
        );
        restart.await.unwrap_or(Err(CreateError::ShuttingDown))
    }

    /// Clients are not told `restarting` here: Jupyter Server sends that status only for
    /// restarts it does on its own (a kernel died, see `Relay::lost_to_death`); JupyterLab
    /// shows "the kernel appears to have died" when it sees one after a restart the user
    /// asked for.
    async fn restart_locked(self: &Arc<Self>, live: &Arc<LiveKernel>) -> Result<(), CreateError> {
        live.relay.set_state(ExecutionState::Restarting, false);
        live.relay.disconnect();
        let started = Instant::now();
        let mut tries = 0;
        let failure = loop {
            tries += 1;
            match self.restart_once(live).await {
                Ok(way) => {
                    tracing::info!(kernel = %live.id(), way, tries, took = ?started.elapsed(), "kernel restarted");
                    // A watcher waiting for a kernel that was dead watches it again.
                    live.rearm.notify_one();
                    return Ok(());
                }
                Err(e) => {
                    // What was sent to the process that failed (held during the restart)
                    // went down with it.
                    live.relay
                        .lost_executions("KernelDied", &cause_of(&e))
                        .await;
                    // The failed process may have reported a state of its own: messages
                    // sent from now on wait for the next try.
                    live.relay.set_state(ExecutionState::Restarting, false);
                    tracing::warn!(kernel = %live.id(), tries, error = %e, "a restart try failed");
                    if tries >= RESTART_TRIES || !retryable(&e) {
                        break e;
                    }
                    tokio::select! {
                        _ = self.cancel.cancelled() => break CreateError::ShuttingDown,
                        _ = tokio::time::sleep(backoff(tries)) => {}
                    }
                }
            }
        };
        if matches!(failure, CreateError::ShuttingDown) {
            live.relay.set_state(ExecutionState::Dead, true);
            return Err(failure);
        }
        let why = format!(
            "the kernel could not be restarted ({failure}; {tries} tries); restart it with \
             POST /api/kernels/{}/restart or delete it",
            live.id()
        );
        tracing::warn!(kernel = %live.id(), "{why}");
        self.settings
            .audit
            .record(&Record::KernelRestartFailed {
                kernel: live.id().to_owned(),
                owner: live.owner().to_owned(),
                tries,
                why: failure.to_string(),
            })
            .await;
        live.relay.set_dead(why.clone()).await;
        match failure {
            // Its own status (504) for one that did not answer in time.
            e @ CreateError::Kernel(crate::relay::KernelError::NotReady(_)) => Err(e),
            _ => Err(CreateError::Backend(BackendError::Died(why))),
        }
    }

    /// One try: into a warm kernel when one fits, else the kernel's container restarted.
    async fn restart_once(
        self: &Arc<Self>,
        live: &Arc<LiveKernel>,
    ) -> Result<&'static str, CreateError> {
        if let Some(env) = live.warm_env.get() {
            if let Some(warm) = self.take_pooled(&live.name, env).await {
                self.move_into(live, &warm).await?;
                return Ok("warm kernel from the pool");
            }
        }
        let Process { handle, connection } = live.process();
        self.backend.restart(&handle).await?;
        self.connect_watched(
            &live.relay,
            &handle,
            &connection,
            live.cancel.child_token(),
            self.settings.startup_timeout,
        )
        .await?;
        Ok("container restarted")
    }

    /// Moves `live` into the process of `warm`, a kernel taken from the pool: `live`'s
    /// clients stay attached, its old container is removed.
    async fn move_into(
        self: &Arc<Self>,
        live: &Arc<LiveKernel>,
        warm: &Arc<LiveKernel>,
    ) -> Result<(), CreateError> {
        // The warm kernel's own watcher and link go; its process serves `live` now.
        warm.cancel.cancel();
        warm.relay.disconnect();
        let (old, new) = (live.process(), warm.process());
        let connected = self.connect_into(live, &new).await;
        if let Err(e) = connected {
            live.set_process(old);
            if let Err(re) = self.backend.remove(&new.handle).await {
                tracing::warn!(kernel = %warm.id(), error = %re, "cannot remove a warm kernel that failed");
            }
            return Err(e);
        }
        // Labels cannot change: what the container serves now is recorded beside it, for
        // a restarted gateway.
        let recorded = async {
            self.backend.set_kernel_id(warm.id(), live.id()).await?;
            self.backend.set_owner(warm.id(), live.owner()).await
        };
        if let Err(e) = recorded.await {
            tracing::warn!(kernel = %live.id(), error = %e, "cannot record the kernel's new container");
        }
        live.rearm.notify_one();
        let (me, id) = (self.clone(), live.id().to_owned());
        self.tracker.spawn(
            async move {
                match me.backend.remove(&old.handle).await {
                    Ok(()) => {
                        if let Err(e) = me.backend.rename(&new.handle, &id).await {
                            tracing::debug!(kernel = %id, error = %e, "cannot rename the kernel's new container");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(kernel = %id, error = %e, "cannot remove the kernel's old container")
                    }
                }
            }
            .in_current_span(),
        );
        Ok(())
    }

    /// Makes `process` the one `live` runs in and connects its relay to it (what the relay
    /// holds for the next process goes to it first).
    pub(super) async fn connect_into(
        self: &Arc<Self>,
        live: &Arc<LiveKernel>,
        process: &Process,
    ) -> Result<(), CreateError> {
        live.set_process(process.clone());
        self.connect_watched(
            &live.relay,
            &process.handle,
            &process.connection,
            live.cancel.child_token(),
            self.settings.startup_timeout,
        )
        .await
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

    async fn watch_loop(self: &Arc<Self>, live: &Arc<LiveKernel>) {
        loop {
            if live.is_hibernated() || live.relay.is_dead() {
                // No process to watch until it wakes in one, or a restart brings it back.
                live.rearm.notified().await;
                continue;
            }
            let epoch = live.epoch.load(Ordering::SeqCst);
            let Process { handle, connection } = live.process();
            let cause = tokio::select! {
                exit = self.backend.wait_exit(&handle) => match exit {
                    Ok(exit) => exit.cause(),
                    Err(BackendError::Gone { .. }) => "the kernel's container was removed".to_owned(),
                    Err(e) => format!("the kernel cannot be watched ({e})"),
                },
                exit = self.stuck_after_oom(&handle, &connection) => exit.cause(),
                () = self.heartbeat_lost(&connection) => "the kernel stopped answering its heartbeat".to_owned(),
                // It moved into another process, or a restart brought it back: watch that.
                () = live.rearm.notified() => continue,
            };
            let _ops = live.ops.lock().await;
            if live.epoch.load(Ordering::SeqCst) != epoch || live.relay.is_dead() {
                // The exit of an intentional restart, or of one that gave up (and said so).
                continue;
            }
            tracing::warn!(kernel = %live.id(), "{cause}");
            self.settings
                .audit
                .record(&Record::KernelDied {
                    kernel: live.id().to_owned(),
                    owner: live.owner().to_owned(),
                    why: cause.to_string(),
                    restarting: self.settings.autorestart,
                })
                .await;
            if !self.settings.autorestart {
                live.relay.lost_executions("KernelDied", &cause).await;
                live.relay
                    .set_dead(format!(
                        "{cause}; restart it with POST /api/kernels/{}/restart or delete it",
                        live.id()
                    ))
                    .await;
                continue; // watched again once a restart brings it back
            }
            // Told `restarting` with the answers; the restart does not say it again.
            live.relay.lost_to_death(&cause).await;
            live.epoch.fetch_add(1, Ordering::SeqCst);
            // A restart that gives up leaves it dead, and clients were told why: the loop
            // waits for one that brings it back.
            let _ = self.restart_locked(live).await;
        }
    }

    /// Resolves when the kernel's container ran out of memory and its process no longer
    /// answers, with the memory limit. Under runc the killed process exits and
    /// [`KernelBackend::wait_exit`](crate::backend::KernelBackend::wait_exit) says so first;
    /// under gVisor the host may kill the stub process the kernel's memory was mapped in,
    /// which leaves the kernel stuck in a sandbox that never exits (seen with runsc 2024,
    /// systrap): only its heartbeat tells. A process the kernel started may be the one
    /// killed: a kernel that still answers is left alone.
    async fn stuck_after_oom(
        &self,
        handle: &str,
        connection: &ConnectionInfo,
    ) -> crate::backend::Exit {
        use futures::StreamExt;
        let mut ooms = self.backend.out_of_memory(handle);
        'events: while let Some(exit) = ooms.next().await {
            for _ in 0..OOM_PROBES {
                tokio::time::sleep(OOM_PROBE_GAP).await;
                if heartbeat::probe(connection, OOM_PROBE_TIMEOUT).await {
                    continue 'events;
                }
            }
            return exit;
        }
        std::future::pending().await
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
                    let k = &l.relay;
                    let quiet = (now - k.last_activity()).to_std().unwrap_or_default();
                    // A hibernated kernel costs no memory: --hibernate-retention ends it.
                    !l.is_hibernated()
                        && k.connections() == 0
                        && k.execution_state() != ExecutionState::Busy
                        && quiet >= idle
                })
                .map(|l| l.id().to_owned())
                .collect();
            for id in idle_ids {
                tracing::info!(kernel = %id, "culling idle kernel");
                if let Some(Err(e)) = self.delete(&id, Removal::Culled).await {
                    tracing::warn!(kernel = %id, error = %e, "cannot remove culled kernel");
                }
            }
        }
    }
}
