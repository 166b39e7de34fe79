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
use crate::relay::lifecycle::Event;
use crate::relay::{heartbeat, Relay};
use chrono::Utc;
use kernelgate_protocol::content::ExecutionState;
use kernelgate_protocol::ConnectionInfo;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// After an out-of-memory kill in a kernel's container, heartbeat probes that must all go
/// unanswered before the kernel counts as dead of it: under 2 s in all.
const OOM_PROBES: u32 = 3;
const OOM_PROBE_GAP: Duration = Duration::from_millis(100);
const OOM_PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// Tries of one restart before the kernel is declared dead.
pub(super) const RESTART_TRIES: u32 = 3;

/// What [`Supervisor::connect_watched`] adds to the cause of a process that exited while it
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

/// Records that the warm kernel's container `container` now serves `live` (its id and
/// owner): labels cannot change, so this is kept beside the container, for a restarted
/// gateway to find it under the kernel's own id.
pub(super) async fn record_serving(
    kernels: &Kernels,
    container: &str,
    live: &LiveKernel,
) -> Result<(), BackendError> {
    kernels.backend.set_kernel_id(container, live.id()).await?;
    kernels.backend.set_owner(container, live.owner()).await
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

/// Supervision of the table's kernels.
#[derive(Debug, Clone)]
pub struct Supervisor {
    kernels: Arc<Kernels>,
}

impl Supervisor {
    pub(super) fn new(kernels: &Arc<Kernels>) -> Self {
        Supervisor {
            kernels: kernels.clone(),
        }
    }

    /// Restarts a kernel as key `key` asked: a fresh process (variables and files gone), the
    /// id and connections stay; audited. Finishes even when the caller goes away.
    pub async fn restart(&self, live: &Arc<LiveKernel>, key: &str) -> Result<(), CreateError> {
        self.kernels
            .settings
            .audit
            .record(&Record::KernelRestarted {
                kernel: live.id().to_owned(),
                owner: live.owner().to_owned(),
                key: key.to_owned(),
            })
            .await;
        let (me, live) = (self.clone(), live.clone());
        let restart = self.kernels.tracker.spawn(
            async move {
                let _ops = live.ops.lock().await;
                if live.hibernated() {
                    // Fresh, as any restart: the saved state goes.
                    me.kernels.hibernation().forget_state(live.id()).await;
                    let why = "the kernel was restarted".to_owned();
                    let _ = live.relay.step(Event::WakeFailed(why)).await;
                    return me.kernels.hibernation().wake_fresh(&live).await;
                }
                live.epoch.fetch_add(1, Ordering::SeqCst);
                let lost = Event::lost("KernelRestarted", "the kernel was restarted", false);
                let _ = live.relay.step(lost).await;
                me.restart_locked(&live).await
            }
            .in_current_span(),
        );
        restart.await.unwrap_or(Err(CreateError::ShuttingDown))
    }

    /// Clients are not told `restarting` here: Jupyter Server sends that status only for
    /// restarts it does on its own (a kernel died, see `Event::Lost` with `announce`); JupyterLab
    /// shows "the kernel appears to have died" when it sees one after a restart the user
    /// asked for.
    async fn restart_locked(&self, live: &Arc<LiveKernel>) -> Result<(), CreateError> {
        let _ = live.relay.step(Event::Restart).await;
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
                    let lost = Event::lost("KernelDied", &cause_of(&e), false);
                    let _ = live.relay.step(lost).await;
                    tracing::warn!(kernel = %live.id(), tries, error = %e, "a restart try failed");
                    if tries >= RESTART_TRIES || !retryable(&e) {
                        break e;
                    }
                    tokio::select! {
                        _ = self.kernels.cancel.cancelled() => break CreateError::ShuttingDown,
                        _ = tokio::time::sleep(backoff(tries)) => {}
                    }
                }
            }
        };
        if matches!(failure, CreateError::ShuttingDown) {
            let _ = live.relay.step(Event::Deleted).await;
            return Err(failure);
        }
        let why = format!(
            "the kernel could not be restarted ({failure}; {tries} tries); restart it with \
             POST /api/kernels/{}/restart or delete it",
            live.id()
        );
        tracing::warn!(kernel = %live.id(), "{why}");
        self.kernels
            .settings
            .audit
            .record(&Record::KernelRestartFailed {
                kernel: live.id().to_owned(),
                owner: live.owner().to_owned(),
                tries,
                why: failure.to_string(),
            })
            .await;
        let _ = live.relay.step(Event::GaveUp(why.clone())).await;
        match failure {
            // Its own status (504) for one that did not answer in time.
            e @ CreateError::Kernel(crate::relay::KernelError::NotReady(_)) => Err(e),
            _ => Err(CreateError::Backend(BackendError::Died(why))),
        }
    }

    /// One try: into a warm kernel when one fits, else the kernel's container restarted.
    async fn restart_once(&self, live: &Arc<LiveKernel>) -> Result<&'static str, CreateError> {
        if let Some(env) = live.warm_env.get() {
            if let Some(warm) = self.kernels.pool().take(&live.name, env).await {
                self.move_into(live, &warm).await?;
                return Ok("warm kernel from the pool");
            }
        }
        let Process { handle, connection } = live.process();
        self.kernels.backend.restart(&handle).await?;
        self.connect_watched(
            &live.relay,
            &handle,
            &connection,
            live.cancel.child_token(),
            self.kernels.settings.startup_timeout,
        )
        .await?;
        Ok("container restarted")
    }

    /// Moves `live` into the process of `warm`, a kernel taken from the pool: `live`'s
    /// clients stay attached, its old container is removed.
    async fn move_into(
        &self,
        live: &Arc<LiveKernel>,
        warm: &Arc<LiveKernel>,
    ) -> Result<(), CreateError> {
        // The warm kernel's own watcher and link go; its process serves `live` now.
        warm.cancel.cancel();
        let _ = warm.relay.step(Event::Unlinked).await;
        let (old, new) = (live.process(), warm.process());
        let connected = self.connect_into(live, &new).await;
        if let Err(e) = connected {
            live.set_process(old);
            if let Err(re) = self.kernels.backend.remove(&new.handle).await {
                tracing::warn!(kernel = %warm.id(), error = %re, "cannot remove a warm kernel that failed");
            }
            return Err(e);
        }
        if let Err(e) = record_serving(&self.kernels, warm.id(), live).await {
            tracing::warn!(kernel = %live.id(), error = %e, "cannot record the kernel's new container");
        }
        live.rearm.notify_one();
        let (me, id) = (self.clone(), live.id().to_owned());
        self.kernels.tracker.spawn(
            async move {
                match me.kernels.backend.remove(&old.handle).await {
                    Ok(()) => {
                        if let Err(e) = me.kernels.backend.rename(&new.handle, &id).await {
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
        &self,
        live: &Arc<LiveKernel>,
        process: &Process,
    ) -> Result<(), CreateError> {
        live.set_process(process.clone());
        live.lossless.store(
            self.kernels.backend.can_checkpoint(&process.handle),
            Ordering::SeqCst,
        );
        self.connect_watched(
            &live.relay,
            &process.handle,
            &process.connection,
            live.cancel.child_token(),
            self.kernels.settings.startup_timeout,
        )
        .await
    }

    /// Watches one kernel for death: process exit (noticed at once) or a heartbeat that
    /// stops answering. A dead kernel is restarted when autorestart is on.
    pub(super) fn watch(&self, live: &Arc<LiveKernel>) {
        let me = self.clone();
        let live = live.clone();
        let id = live.id().to_owned();
        self.kernels.tracker.spawn(
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

    async fn watch_loop(&self, live: &Arc<LiveKernel>) {
        loop {
            let phase = live.relay.phase();
            if phase.is_hibernated() || phase.is_dead() {
                // No process to watch until it wakes in one, or a restart brings it back.
                live.rearm.notified().await;
                continue;
            }
            let epoch = live.epoch.load(Ordering::SeqCst);
            let Process { handle, connection } = live.process();
            let cause = tokio::select! {
                exit = self.kernels.backend.wait_exit(&handle) => match exit {
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
            if live.epoch.load(Ordering::SeqCst) != epoch || live.relay.phase().is_dead() {
                // The exit of an intentional restart, or of one that gave up (and said so).
                continue;
            }
            tracing::warn!(kernel = %live.id(), "{cause}");
            self.kernels
                .settings
                .audit
                .record(&Record::KernelDied {
                    kernel: live.id().to_owned(),
                    owner: live.owner().to_owned(),
                    why: cause.to_string(),
                    restarting: self.kernels.settings.autorestart,
                })
                .await;
            if !self.kernels.settings.autorestart {
                let _ = live
                    .relay
                    .step(Event::lost("KernelDied", &cause, false))
                    .await;
                let why = format!(
                    "{cause}; restart it with POST /api/kernels/{}/restart or delete it",
                    live.id()
                );
                let _ = live.relay.step(Event::GaveUp(why)).await;
                continue; // watched again once a restart brings it back
            }
            // Told `restarting` with the answers; the restart does not say it again.
            let _ = live
                .relay
                .step(Event::lost("KernelDied", &cause, true))
                .await;
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
        let mut ooms = self.kernels.backend.out_of_memory(handle);
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
        let check = self.kernels.settings.heartbeat;
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
    pub(super) async fn cull(self, idle: Duration) {
        let every = (idle / 4).clamp(Duration::from_secs(1), Duration::from_secs(30));
        loop {
            tokio::select! {
                _ = self.kernels.cancel.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let now = Utc::now();
            let idle_ids: Vec<String> = self
                .kernels
                .list()
                .into_iter()
                .filter(|l| {
                    let k = &l.relay;
                    let a = k.activity();
                    let quiet = (now - a.last_activity).to_std().unwrap_or_default();
                    // A hibernated kernel costs no memory: --hibernate-retention ends it.
                    !l.hibernated()
                        && a.connections == 0
                        && k.execution_state() != ExecutionState::Busy
                        && quiet >= idle
                })
                .map(|l| l.id().to_owned())
                .collect();
            for id in idle_ids {
                tracing::info!(kernel = %id, "culling idle kernel");
                if let Some(Err(e)) = self.kernels.delete(&id, Removal::Culled).await {
                    tracing::warn!(kernel = %id, error = %e, "cannot remove culled kernel");
                }
            }
        }
    }

    /// Connects `kernel` to a process just started (or restarted) and waits until it
    /// answers, while watching the process: one that exits meanwhile fails the connect at
    /// once, saying why, instead of after the whole timeout.
    pub(super) async fn connect_watched(
        &self,
        kernel: &Arc<Relay>,
        handle: &str,
        connection: &ConnectionInfo,
        cancel: CancellationToken,
        timeout: Duration,
    ) -> Result<(), CreateError> {
        let connect = kernel.connect(connection, &self.kernels.tracker, cancel.clone(), timeout);
        tokio::pin!(connect);
        let result = tokio::select! {
            r = &mut connect => r.map(drop).map_err(CreateError::from),
            exit = self.kernels.backend.wait_exit(handle) => match exit {
                Ok(exit) => Err(CreateError::Backend(BackendError::Died(format!(
                    "{}{}",
                    exit.cause(),
                    WHILE_STARTING
                )))),
                // Cannot be watched: the connect alone decides.
                Err(e) => {
                    tracing::debug!(kernel = %kernel.id(), error = %e, "cannot watch a starting kernel");
                    connect.await.map(drop).map_err(CreateError::from)
                }
            },
        };
        if result.is_err() {
            // The link of a connect cut short must not linger.
            cancel.cancel();
            let _ = kernel.step(Event::Unlinked).await;
        }
        result
    }
}
