//! Hibernation of the whole kernel, under an engine that checkpoints (docs/engines.md):
//! the sandbox's memory image goes to `--hibernate-dir/<id>/memory` and the sandbox away;
//! a resume restores it with a new key, everything in it as it was (generators, threads,
//! open files, child processes). Nothing is pickled, nothing is loaded.

use super::{HibernateError, Hibernation, Kind, Partial, MEMORY};
use crate::backend::{BackendError, LaunchRequest};
use crate::kernels::{CreateError, LiveKernel, Process};
use crate::relay::lifecycle::Event;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

/// The bytes of the files under `dir`.
pub(in crate::kernels) fn size_of(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => size_of(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

impl Hibernation {
    /// Hibernates `live` whole: sealed, checkpointed, committed, its sandbox removed. A
    /// kernel the engine refuses (a host socket) keeps running and the error says why;
    /// one the checkpoint stopped is reported dead by its watcher, never lost silently.
    pub(super) async fn checkpoint(
        &self,
        live: &Arc<LiveKernel>,
        since: u64,
        started: Instant,
    ) -> Result<(), HibernateError> {
        let policy = &self.kernels.settings.hibernate;
        let owner = live.owner().to_owned();
        let keys_bytes = self.keys_bytes(live);
        if keys_bytes >= policy.key_max_bytes {
            return Err(HibernateError::Full(format!(
                "key {owner:?} has {} MiB of hibernated state, all a key may keep (--hibernate-key-max-mb); the kernel keeps running",
                keys_bytes >> 20
            )));
        }
        let partial = Partial::new(&policy.dir, live.id())
            .map_err(|e| HibernateError::Failed(format!("writing into --hibernate-dir: {e}")))?;
        if live.relay.step(Event::Seal { since }).await.is_err() {
            return Err(HibernateError::Busy(
                "work came in before its checkpoint".into(),
            ));
        }
        // The home's files apart as well, sealed (no cell runs): a resume that discards the
        // kernel's memory (E2B's `on_resume="reboot"`, `discard-state`) keeps them. Best
        // effort: without them such a resume starts with an empty home, as it says.
        match self.home_out(live, &partial, true, policy.max_bytes).await {
            Ok(Some(_)) => {}
            Ok(None) => {
                tracing::info!(kernel = %live.id(), "the kernel's files pass --hibernate-max-mb: only its checkpoint keeps them")
            }
            Err(e) => {
                tracing::warn!(kernel = %live.id(), error = %e, "cannot keep the kernel's files apart from its checkpoint")
            }
        }
        let handle = live.handle();
        let image = partial.path().join(MEMORY);
        match self.kernels.backend.checkpoint(&handle, &image).await {
            Ok(()) => {}
            Err(BackendError::Refused(why)) => {
                let _ = live.relay.step(Event::Unseal).await;
                return Err(HibernateError::Blocked(why));
            }
            Err(e @ BackendError::Died(_)) => {
                // Its watcher reports the death (the epoch is unchanged) once this ends.
                let _ = live.relay.step(Event::Unseal).await;
                return Err(HibernateError::Failed(e.to_string()));
            }
            Err(e) => {
                // The relays closed and opened again: the link goes to the kernel anew,
                // and a heartbeat missed meanwhile is no death.
                live.epoch.fetch_add(1, Ordering::SeqCst);
                let process = live.process();
                if let Err(re) = self.kernels.supervisor().connect_into(live, &process).await {
                    tracing::warn!(kernel = %live.id(), error = %re, "cannot reach a kernel whose checkpoint failed");
                }
                let _ = live.relay.step(Event::Unseal).await;
                return Err(HibernateError::Failed(e.to_string()));
            }
        }
        let bytes = tokio::task::spawn_blocking({
            let image = image.clone();
            move || size_of(&image)
        })
        .await
        .unwrap_or_default();
        let over = if bytes > policy.max_bytes {
            Some(format!(
                "the kernel's checkpoint takes {} MiB, more than the {} MiB a hibernated kernel may (--hibernate-max-mb); the kernel runs on: free memory, or raise it",
                bytes.div_ceil(1 << 20),
                policy.max_bytes >> 20
            ))
        } else if keys_bytes + bytes > policy.key_max_bytes {
            Some(format!(
                "key {owner:?} has {} MiB of hibernated state; this kernel's {} MiB checkpoint would pass the {} MiB a key may keep (--hibernate-key-max-mb); the kernel runs on",
                keys_bytes >> 20,
                bytes.div_ceil(1 << 20),
                policy.key_max_bytes >> 20
            ))
        } else {
            None
        };
        if let Some(why) = over {
            // Past a budget: the kernel comes straight back from what was just written.
            live.epoch.fetch_add(1, Ordering::SeqCst);
            if let Err(e) = self.kernels.backend.remove(&handle).await {
                tracing::warn!(kernel = %live.id(), error = %e, "cannot remove a checkpointed sandbox");
            }
            return match self.wake_whole(live, partial.path()).await {
                Ok(()) => {
                    let _ = live.relay.step(Event::Unseal).await;
                    Err(HibernateError::Full(why))
                }
                Err(e) => {
                    // Not lost: it hibernates past the budget, and says so.
                    tracing::warn!(kernel = %live.id(), error = %e, "a kernel past the hibernation budget could not be brought back; it hibernates");
                    let meta = self.meta_of(live, bytes, Kind::Memory);
                    self.finish(live, meta, partial, Vec::new(), started)
                        .await?;
                    Err(HibernateError::Failed(format!(
                        "{why}; but it could not be brought back ({e}), so it hibernates with its checkpoint"
                    )))
                }
            };
        }
        let meta = self.meta_of(live, bytes, Kind::Memory);
        self.finish(live, meta, partial, Vec::new(), started).await
    }

    /// With `live.ops` held: `live` restored from its checkpoint in `dir`, connected with
    /// its new key. A restore that fails keeps the checkpoint and says so.
    pub(super) async fn wake_whole(
        &self,
        live: &Arc<LiveKernel>,
        dir: &Path,
    ) -> Result<(), CreateError> {
        let (env, limits) = live.origin.get().cloned().unwrap_or_default();
        let image = match self.kernels.settings.specs.get(&live.name) {
            Some(spec) => spec.image.clone(),
            None => {
                return Err(CreateError::NoSuchSpec {
                    name: live.name.clone(),
                    offered: self.kernels.settings.specs.names(),
                })
            }
        };
        let req = LaunchRequest {
            kernel_id: live.id().to_owned(),
            kernel_name: live.name.clone(),
            image,
            env,
            preload: false,
            owner: Some(live.owner().to_owned()),
            memory_mb: limits.memory_mb,
            cpus: limits.cpus,
        };
        let launched = self
            .kernels
            .backend
            .restore_kernel(&req, &dir.join(MEMORY))
            .await
            .map_err(|e| {
                CreateError::Resume(format!(
                    "cannot restore the kernel's checkpoint ({e}); the checkpoint is kept"
                ))
            })?;
        let new = Process {
            handle: launched.handle,
            connection: launched.connection,
        };
        if live.cancel.is_cancelled() {
            self.drop_process(&new.handle).await;
            return Err(CreateError::ShuttingDown);
        }
        let slept = live.sleep().since.take();
        // Answered with its new key, or it is no resume.
        if let Err(e) = self.kernels.supervisor().connect_into(live, &new).await {
            if live.cancel.is_cancelled() {
                // Deleted (or the gateway stops) while it woke: nothing to keep.
                self.drop_process(&new.handle).await;
                return Err(CreateError::ShuttingDown);
            }
            live.sleep().since = slept;
            let why = format!("the hibernated kernel's checkpoint was restored but the kernel did not answer ({e}); the checkpoint is kept: run the cell again to retry");
            let _ = live
                .relay
                .step(Event::lost("KernelUnavailable", &why, false))
                .await;
            let _ = live.relay.step(Event::Hibernated).await;
            self.drop_process(&new.handle).await;
            return Err(CreateError::Resume(why));
        }
        live.sleep().kind = None;
        live.rearm.notify_one();
        Ok(())
    }
}
