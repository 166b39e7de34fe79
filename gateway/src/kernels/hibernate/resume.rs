//! Bringing a hibernated kernel back: on the first client message, a fresh process with
//! the saved files unpacked and the variables loaded before anything clients sent; and
//! the hibernated kernels an earlier run left, listed again at start.

use super::store::{forget, forget_if_stale};
use super::{
    py_str, Hibernation, Meta, KERNEL_TIMEOUT, MEMORY, META, PYTHON, STATE_DIR, STATE_IN, TAR,
};
use crate::audit::Record;
use crate::backend::{ExecRequest, ExecStdin};
use crate::kernels::supervise::record_serving;
use crate::kernels::{CreateError, Limits, LiveKernel, Process};
use crate::metrics;
use crate::relay::lifecycle::Event;
use crate::relay::GATEWAY_KEY;
use crate::silent::{self, Unanswered};
use kernelgate_protocol::ConnectionInfo;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

/// What of a hibernated kernel's state a new process gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::kernels) enum Wake {
    /// Files and variables (a resume).
    Everything,
    /// Files only: the saved variables are discarded.
    FilesOnly,
    /// Nothing (a restart).
    Fresh,
}

impl Hibernation {
    /// Starts the task that resumes `live` on the first client message.
    pub(super) fn wake_on_request(&self, live: &Arc<LiveKernel>) {
        let (me, live) = (self.clone(), live.clone());
        let id = live.id().to_owned();
        self.kernels.tracker.spawn(
            async move {
                loop {
                    tokio::select! {
                        _ = live.cancel.cancelled() => return,
                        _ = live.relay.woken() => {}
                    }
                    match me.resume(&live).await {
                        Ok(()) => return,
                        // Its waiting executions were answered already, saying so.
                        Err(CreateError::StateNotLoaded { .. }) => {}
                        // Deleted while it woke, or the gateway stops.
                        Err(CreateError::ShuttingDown) => return,
                        Err(e) => {
                            let why = format!("the hibernated kernel could not be resumed ({e}); try again, or delete it");
                            tracing::warn!(kernel = %live.id(), "{why}");
                            let _ = live.relay.step(Event::WakeFailed(why)).await;
                        }
                    }
                    if !live.hibernated() {
                        return;
                    }
                }
            }
            .instrument(tracing::info_span!("kernel", kernel = %id)),
        );
    }

    /// Brings a hibernated kernel back (nothing happens for one that runs): a fresh process
    /// with its state loaded, under its id, its clients still attached.
    pub async fn resume(&self, live: &Arc<LiveKernel>) -> Result<(), CreateError> {
        let (me, live) = (self.clone(), live.clone());
        let task = self.kernels.tracker.spawn(
            async move {
                let _ops = live.ops.lock().await;
                if !live.hibernated() {
                    return Ok(());
                }
                me.wake(&live, Wake::Everything).await
            }
            .in_current_span(),
        );
        task.await.unwrap_or(Err(CreateError::ShuttingDown))
    }

    /// Discards a hibernated kernel's saved variables (for a state that does not load):
    /// it wakes as a fresh process with its saved files, for the key `key`. `Ok(false)`
    /// when it does not hibernate.
    pub async fn discard_state(
        &self,
        live: &Arc<LiveKernel>,
        key: &str,
    ) -> Result<bool, CreateError> {
        let (me, live, key) = (self.clone(), live.clone(), key.to_owned());
        let task = self.kernels.tracker.spawn(
            async move {
                let _ops = live.ops.lock().await;
                if !live.hibernated() {
                    return Ok(false);
                }
                me.kernels
                    .settings
                    .audit
                    .record(&Record::KernelStateDiscarded {
                        kernel: live.id().to_owned(),
                        owner: live.owner().to_owned(),
                        key,
                    })
                    .await;
                me.wake(&live, Wake::FilesOnly).await.map(|()| true)
            }
            .in_current_span(),
        );
        task.await.unwrap_or(Err(CreateError::ShuttingDown))
    }

    /// Restarting a hibernated kernel starts it fresh: its state is deleted.
    pub(in crate::kernels) async fn wake_fresh(
        &self,
        live: &Arc<LiveKernel>,
    ) -> Result<(), CreateError> {
        self.wake(live, Wake::Fresh).await
    }

    /// With `live.ops` held: a process for `live`, with what `mode` says of its state.
    async fn wake(&self, live: &Arc<LiveKernel>, mode: Wake) -> Result<(), CreateError> {
        let started = Instant::now();
        self.make_room_for(live).await?;
        let (env, limits) = live.origin.get().cloned().unwrap_or_default();
        let dir = self.state_dir(live.id());
        let whole = dir.join(MEMORY).is_dir();
        if whole && mode == Wake::Everything {
            self.wake_whole(live, &dir).await?;
            self.woke(live, &dir, started, mode).await;
            return Ok(());
        }
        // A whole kernel's files apart from its checkpoint are in the tar (when they could
        // be kept): discarding its memory keeps them; without the tar it starts fresh.
        let tar = dir.join(TAR);
        let mode = if whole && !tar.is_file() {
            Wake::Fresh
        } else {
            mode
        };
        if mode != Wake::Fresh {
            if let Err(e) = tokio::fs::metadata(&tar).await {
                return Err(CreateError::Resume(format!(
                    "cannot read {}: {e}",
                    tar.display()
                )));
            }
        }
        let (warm, _) = self
            .kernels
            .obtain(&live.name, env, live.owner(), limits)
            .await?;
        // The fresh kernel's own watcher and link go; its process serves `live` now.
        warm.cancel.cancel();
        let _ = warm.relay.step(Event::Unlinked).await;
        let new = warm.process();
        if live.cancel.is_cancelled() {
            // Deleted (or the gateway stops) meanwhile.
            self.drop_process(&new.handle).await;
            return Err(CreateError::ShuttingDown);
        }
        if mode != Wake::Fresh {
            if let Err(e) = self.unpack(live, &new.handle, &tar, mode).await {
                self.drop_process(&new.handle).await;
                return Err(e);
            }
        }
        let loading = mode == Wake::Everything;
        if loading {
            // What clients sent waits until the variables are back (or are known not to be).
            let _ = live.relay.step(Event::Wake).await;
        }
        // It runs from here: what clients sent meanwhile may be answered before the
        // connect returns (after the load, when there is one).
        let slept = live.sleep().since.take();
        let connected = self.kernels.supervisor().connect_into(live, &new).await;
        if let Err(e) = connected {
            // What the failed process was sent is answered; the state stays on disk.
            let why = format!("the hibernated kernel could not be resumed ({e}); its state is kept: run the cell again to retry");
            live.sleep().since = slept;
            if loading {
                let _ = live.relay.step(Event::LoadFailed(why)).await;
            } else {
                let _ = live
                    .relay
                    .step(Event::lost("KernelUnavailable", &why, false))
                    .await;
                let _ = live.relay.step(Event::Hibernated).await;
            }
            self.drop_process(&new.handle).await;
            return Err(e);
        }
        live.rearm.notify_one();
        if loading {
            if let Err(why) = self.load(live, &new.handle).await {
                tracing::warn!(kernel = %live.id(), reason = %why, "the kernel's saved state did not load; it is kept");
                let failed = CreateError::StateNotLoaded {
                    id: live.id().to_owned(),
                    why: why.clone(),
                };
                // In the audit trail before the waiting cells hear it.
                self.kernels
                    .settings
                    .audit
                    .record(&Record::KernelResumeFailed {
                        kernel: live.id().to_owned(),
                        owner: live.owner().to_owned(),
                        reason: why.clone(),
                    })
                    .await;
                // The exit this causes is not a death.
                live.epoch.fetch_add(1, Ordering::SeqCst);
                live.sleep().since = slept;
                let _ = live.relay.step(Event::LoadFailed(failed.to_string())).await;
                self.drop_process(&new.handle).await;
                return Err(failed);
            }
            if let Err(e) = live.relay.step(Event::Loaded).await {
                tracing::warn!(kernel = %live.id(), error = %e, "cannot hand waiting messages to the resumed kernel");
            }
        }
        let recorded = async {
            record_serving(&self.kernels, warm.id(), live).await?;
            self.kernels.backend.rename(&new.handle, live.id()).await
        };
        if let Err(e) = recorded.await {
            tracing::warn!(kernel = %live.id(), error = %e, "cannot record the kernel's new container");
        }
        self.woke(live, &dir, started, mode).await;
        Ok(())
    }

    /// What follows a wake that worked: the registry told, the state deleted, the resume
    /// counted and audited.
    async fn woke(&self, live: &Arc<LiveKernel>, dir: &Path, started: Instant, mode: Wake) {
        if let Some(ledger) = &self.kernels.settings.ledger {
            ledger.hibernated(live.id(), live.hibernated()).await;
        }
        forget(dir).await;
        let took = started.elapsed();
        if mode == Wake::Everything {
            metrics::resumed(took);
            self.kernels
                .settings
                .audit
                .record(&Record::KernelResumed {
                    kernel: live.id().to_owned(),
                    owner: live.owner().to_owned(),
                    took_ms: took.as_millis() as u64,
                })
                .await;
        }
        tracing::info!(kernel = %live.id(), ?took, ?mode, "hibernated kernel runs again");
    }

    /// Loads the saved variables into the kernel's new process `handle` (its files are
    /// there already): `Err` says why they did not load.
    pub(in crate::kernels) async fn load(
        &self,
        live: &Arc<LiveKernel>,
        handle: &str,
    ) -> Result<(), String> {
        let session = live.relay.attach(
            &format!("kernelgate-state-{}", uuid::Uuid::new_v4()),
            true,
            GATEWAY_KEY,
        );
        let code = format!("__import__('kernelgate_state').load({})", py_str(STATE_DIR));
        tokio::select! {
            answer = silent::execute(&session, &code, KERNEL_TIMEOUT) => match answer {
                Ok(answer) => match silent::raised(&answer) {
                    None => Ok(()),
                    Some((ename, evalue)) => Err(format!("{ename}: {evalue}")),
                },
                Err(Unanswered::NotSent(e)) => Err(format!("the new process took no request: {e}")),
                Err(Unanswered::TimedOut(_)) => Err(format!("no answer within {} s", KERNEL_TIMEOUT.as_secs())),
                Err(Unanswered::Gone) => Err("the new process went away".to_owned()),
            },
            exit = self.kernels.backend.wait_exit(handle) => Err(match exit {
                Ok(exit) => format!("the new process stopped while loading it: {}", exit.cause()),
                Err(e) => format!("the new process stopped while loading it: {e}"),
            }),
        }
    }

    /// A resume at the running limit hibernates another idle kernel of the same owner
    /// first, when one can; otherwise it fails as a create at its limit does.
    async fn make_room_for(&self, live: &Arc<LiveKernel>) -> Result<(), CreateError> {
        let (running, other) = {
            let t = self.kernels.lock();
            let running = t.live.values().filter(|l| !l.hibernated()).count() + t.reserved;
            let mut idle: Vec<_> = t
                .live
                .values()
                .filter(|l| l.owner() == live.owner() && l.id() != live.id() && !l.hibernated())
                .cloned()
                .collect();
            idle.sort_by_key(|l| l.relay.activity().last_activity);
            (running, idle)
        };
        if running < self.kernels.settings.max_kernels {
            return Ok(());
        }
        for candidate in other {
            if self.hibernate(&candidate).await.is_ok() {
                return Ok(());
            }
        }
        Err(CreateError::TooMany {
            max: self.kernels.settings.max_kernels,
        })
    }

    /// Unpacks a hibernated kernel's files (and, unless `mode` is [`Wake::FilesOnly`], its
    /// saved variables) from `tar` into the home of the process `handle`, streamed.
    pub(in crate::kernels) async fn unpack(
        &self,
        live: &LiveKernel,
        handle: &str,
        tar: &Path,
        mode: Wake,
    ) -> Result<(), CreateError> {
        let mut argv: Vec<String> = [PYTHON, "-P", "-c", STATE_IN].map(str::to_owned).to_vec();
        if mode == Wake::FilesOnly {
            argv.push("--files-only".to_owned());
        }
        let request = ExecRequest {
            argv,
            stdin: ExecStdin::File(tar.to_owned()),
            stdout: None,
            max_stdout: 4096,
            timeout: self.kernels.settings.hibernate.command_timeout,
        };
        let out = self.kernels.backend.exec(handle, request).await?;
        if out.exit_code != 0 {
            return Err(CreateError::Resume(format!(
                "cannot put the state of kernel {} into its new process: {}",
                live.id(),
                out.stderr.trim()
            )));
        }
        Ok(())
    }

    pub(super) async fn drop_process(&self, handle: &str) {
        if let Err(e) = self.kernels.backend.remove(handle).await {
            tracing::warn!(container = %handle, error = %e, "cannot remove a kernel process that failed to resume");
        }
    }

    /// Hibernated kernels an earlier run of this gateway left in `--hibernate-dir` are
    /// listed again; a state whose kernel still runs (the earlier run died between commit
    /// and removal) is dropped, the container has it all.
    pub(in crate::kernels) async fn restore_hibernated(&self) {
        let root = self.kernels.settings.hibernate.dir.clone();
        let Ok(mut entries) = tokio::fs::read_dir(&root).await else {
            return;
        };
        while let Ok(Some(entry)) = entries.next_entry().await {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if name == crate::kernels::template::TEMPLATES
                || name == crate::kernels::snapshots::SNAPSHOTS
            {
                continue;
            }
            if name.starts_with('.') {
                // A commit a gateway did not finish (its kernel kept running).
                forget_if_stale(&entry).await;
                continue;
            }
            let meta = match tokio::fs::read(path.join(META))
                .await
                .ok()
                .and_then(|b| serde_json::from_slice::<Meta>(&b).ok())
            {
                Some(meta)
                    if meta.id == name
                        && meta.runtime_dir == self.kernels.settings.hibernate.runtime_dir =>
                {
                    meta
                }
                Some(meta) if meta.id == name => {
                    tracing::debug!(kernel = %meta.id, runtime_dir = %meta.runtime_dir, "a hibernated kernel of another gateway; left alone");
                    continue;
                }
                _ => {
                    tracing::warn!(dir = %path.display(), "not a hibernated kernel's state; left alone");
                    continue;
                }
            };
            if self.kernels.get(&meta.id).is_some() {
                tracing::info!(kernel = %meta.id, "the kernel still runs; its saved state is dropped");
                forget(&path).await;
                continue;
            }
            let live = self.hibernated_kernel(&meta).await;
            self.kernels
                .lock()
                .live
                .insert(meta.id.clone(), live.clone());
            if let Some(ledger) = &self.kernels.settings.ledger {
                ledger.adopt(&meta.id, &meta.owner, &meta.spec, false);
                ledger.hibernated(&meta.id, live.hibernated()).await;
            }
            tracing::info!(kernel = %meta.id, "hibernated kernel of an earlier run listed again");
            self.wake_on_request(&live);
        }
    }

    /// A table entry for a hibernated kernel with no process.
    async fn hibernated_kernel(&self, meta: &Meta) -> Arc<LiveKernel> {
        let relay = crate::relay::Relay::new(
            &meta.id,
            self.kernels.settings.limits,
            self.kernels.settings.audit.clone(),
            self.kernels.settings.guard.clone(),
        );
        let _ = relay.step(Event::Hibernated).await;
        relay.touch(meta.last_activity);
        let live = Arc::new(LiveKernel::new(
            relay,
            &meta.spec,
            Process {
                handle: String::new(),
                connection: ConnectionInfo::ipc(
                    "/nonexistent/hibernated",
                    String::new(),
                    &meta.spec,
                ),
            },
            self.kernels.cancel.child_token(),
        ));
        let _ = live.owner.set(meta.owner.clone());
        let _ = live.origin.set((
            meta.env.clone(),
            Limits {
                memory_mb: meta.memory_mb,
                cpus: meta.cpus,
            },
        ));
        if let Some(max) = meta.max_hibernated {
            let _ = live.max_hibernated.set(max);
        }
        {
            let mut sleep = live.sleep();
            sleep.since = Some((meta.hibernated_at, meta.bytes));
            sleep.kind = Some(meta.kind);
        }
        self.kernels.supervisor().watch(&live);
        live
    }
}
