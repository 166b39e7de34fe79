//! Taking a snapshot of a running kernel: the whole kernel under an engine that
//! checkpoints (its relays quiesce while the engine writes it, then serve again under the
//! same key), else the variables its helper can pickle and its home's files, or the files
//! alone. The kernel runs on in every case, or, when the engine killed it trying, is
//! reported dead by its watcher: never lost silently.

use super::{
    check_labels, snapshot_wording, Held, KeyBudget, Mode, Snapshot, SnapshotError, SnapshotKind,
    Snapshots, RECORD,
};
use crate::audit::Record;
use crate::backend::BackendError;
use crate::kernels::hibernate::{self, commit_named, Kept, Partial};
use crate::kernels::LiveKernel;
use crate::metrics;
use crate::relay::lifecycle::Event;
use chrono::Utc;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tracing::Instrument;

/// What a caller asks of a snapshot.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TakeRequest {
    pub name: Option<String>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    #[serde(default)]
    pub mode: Mode,
    /// Under a Python-level snapshot, leave out (and name) what cannot be saved instead of
    /// refusing.
    #[serde(default)]
    pub accept_loss: bool,
}

/// The budget a snapshot of `owner` is held to: its count and bytes, and where each limit
/// comes from.
struct Budget {
    max_count: usize,
    count_from: &'static str,
    max_bytes: u64,
    bytes_from: &'static str,
}

impl Snapshots {
    /// Takes a snapshot of `live` for the key `key` (its keys-file budget `budget`); the
    /// kernel runs on. A hibernated kernel is woken first.
    pub async fn take(
        &self,
        live: &Arc<LiveKernel>,
        req: TakeRequest,
        key: &str,
        budget: KeyBudget,
    ) -> Result<Snapshot, SnapshotError> {
        self.take_held(live, req, key, budget, false)
            .await
            .map(|held| held.record.clone())
    }

    /// The same, kept in the store; a `hidden` one (a fork's) is neither listed nor
    /// counted against the key's budget.
    pub(super) async fn take_held(
        &self,
        live: &Arc<LiveKernel>,
        req: TakeRequest,
        key: &str,
        budget: KeyBudget,
        hidden: bool,
    ) -> Result<Arc<Held>, SnapshotError> {
        check_labels(req.name.as_deref(), &req.metadata)?;
        if live.hibernated() {
            self.kernels.hibernation().resume(live).await.map_err(|e| {
                SnapshotError::Failed(format!(
                    "the kernel hibernates and could not be woken for it: {e}"
                ))
            })?;
        }
        // On a task of its own: a caller that hangs up does not cut a checkpoint short.
        let (me, live, key) = (self.clone(), live.clone(), key.to_owned());
        let task = self.kernels.tracker.spawn(
            async move {
                let started = Instant::now();
                let taken = me.take_now(&live, &req, &key, budget, hidden).await;
                let outcome = match &taken {
                    Ok(held) => held.record.kind.as_str(),
                    Err(SnapshotError::Busy(_)) => "busy",
                    Err(SnapshotError::Refused(_) | SnapshotError::Invalid(_)) => "refused",
                    Err(_) => "failed",
                };
                metrics::snapshot_taken(outcome, started.elapsed());
                if let Err(e) = &taken {
                    tracing::info!(kernel = %live.id(), reason = %e, "no snapshot taken; the kernel runs on");
                }
                taken
            }
            .in_current_span(),
        );
        task.await
            .unwrap_or_else(|e| Err(SnapshotError::Failed(e.to_string())))
    }

    fn budget_of(&self, budget: KeyBudget) -> Budget {
        let policy = &self.kernels.settings.snapshots;
        let (max_count, count_from) = match budget.max_snapshots {
            Some(max) => (max, "max_snapshots in the keys file"),
            None => (policy.per_key, "--snapshots-per-key"),
        };
        let (max_bytes, bytes_from) = match budget.max_bytes {
            Some(max) => (max, "snapshot_max_mb in the keys file"),
            None => (policy.key_max_bytes, "--snapshot-key-max-mb"),
        };
        Budget {
            max_count,
            count_from,
            max_bytes,
            bytes_from,
        }
    }

    async fn take_now(
        &self,
        live: &Arc<LiveKernel>,
        req: &TakeRequest,
        key: &str,
        budget: KeyBudget,
        hidden: bool,
    ) -> Result<Arc<Held>, SnapshotError> {
        let started = Instant::now();
        let budget = self.budget_of(budget);
        let replaces = if hidden { None } else { req.name.as_deref() };
        let (count, used) = self.used_by(key, replaces);
        if !hidden && count >= budget.max_count {
            return Err(SnapshotError::Refused(format!(
                "key {key:?} keeps {count} snapshots, the most it may ({}); delete one (DELETE /api/kernelgate/snapshots/{{id}}), or take this one under the name of one it replaces",
                budget.count_from
            )));
        }
        let room = if hidden {
            u64::MAX
        } else {
            budget.max_bytes.saturating_sub(used)
        };
        let over_budget = |bytes: Option<u64>| {
            let this = match bytes {
                Some(b) => format!("this snapshot's {} MiB", b.div_ceil(1 << 20)),
                None => "this snapshot".to_owned(),
            };
            SnapshotError::Refused(format!(
                "key {key:?} keeps {} MiB of snapshots; {this} would pass the {} MiB it may keep ({}); delete some of its snapshots, or take a `filesystem` one",
                used >> 20,
                budget.max_bytes >> 20,
                budget.bytes_from
            ))
        };
        if room == 0 {
            return Err(over_budget(None));
        }
        let _ops = live.ops.lock().await;
        if live.hibernated() {
            return Err(SnapshotError::Busy("it hibernated meanwhile".into()));
        }
        let activity = live.relay.activity();
        if !activity.quiet {
            return Err(SnapshotError::Busy("it runs or holds code".into()));
        }
        let id = uuid::Uuid::new_v4().to_string();
        let root = self.root();
        let partial = Partial::new(&root, &id)
            .map_err(|e| SnapshotError::Failed(format!("writing into --hibernate-dir: {e}")))?;
        let whole = self.kernels.backend.can_checkpoint(&live.handle());
        let (kind, kept) = match req.mode {
            Mode::Full if whole => {
                self.checkpoint_running(live, &partial, activity.client_sends)
                    .await?;
                let image = partial.path().join(hibernate::MEMORY);
                let bytes = tokio::task::spawn_blocking(move || hibernate::size_of(&image))
                    .await
                    .unwrap_or_default();
                let kept = Kept {
                    bytes,
                    dropped: Vec::new(),
                };
                (SnapshotKind::Memory, kept)
            }
            Mode::Full => {
                let kept = self
                    .namespace(live, &partial, req.accept_loss, room, key, &budget)
                    .await?;
                (
                    SnapshotKind::Namespace,
                    kept.ok_or_else(|| over_budget(None))?,
                )
            }
            Mode::Filesystem => {
                let hibernation = self.kernels.hibernation();
                let kept = hibernation
                    .home_out(live, &partial, req.accept_loss, room)
                    .await?;
                (
                    SnapshotKind::Filesystem,
                    kept.ok_or_else(|| over_budget(None))?,
                )
            }
        };
        if kept.bytes > room {
            return Err(over_budget(Some(kept.bytes)));
        }
        let record = Snapshot {
            id: id.clone(),
            name: req.name.clone().filter(|_| !hidden),
            metadata: req.metadata.clone(),
            owner: key.to_owned(),
            kernel: live.id().to_owned(),
            spec: live.name.clone(),
            kind,
            bytes: kept.bytes,
            created: Utc::now(),
            env: live
                .origin
                .get()
                .map(|(env, _)| env.clone())
                .unwrap_or_default(),
            dropped: kept.dropped,
            hidden,
        };
        let dir = root.join(&id);
        let committed = {
            let json = serde_json::to_vec_pretty(&record).map_err(|e| e.to_string());
            let (root, dir, temporary) = (root.clone(), dir.clone(), partial.keep());
            tokio::task::spawn_blocking(move || {
                commit_named(&root, &dir, RECORD, &json?, &temporary)
            })
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r)
        };
        if let Err(e) = committed {
            return Err(SnapshotError::Failed(format!(
                "writing {}: {e}; the kernel runs on",
                dir.display()
            )));
        }
        let held = Arc::new(Held {
            record,
            dir,
            deleted: AtomicBool::new(false),
        });
        let replaced: Vec<Arc<Held>> = {
            let mut store = self.store();
            store.insert(id.clone(), held.clone());
            match &held.record.name {
                Some(name) => store
                    .values()
                    .filter(|h| {
                        h.record.id != id
                            && h.record.owner == key
                            && h.record.name.as_ref() == Some(name)
                    })
                    .cloned()
                    .collect(),
                None => Vec::new(),
            }
        };
        for older in replaced {
            let why = format!("replaced by snapshot {id} of the same name");
            self.delete(&older, None, Some(&why)).await;
        }
        let took = started.elapsed();
        if !hidden {
            if let Some(ledger) = &self.kernels.settings.ledger {
                ledger.snapshot_kept(key, &held.record.model()).await;
            }
            self.kernels
                .settings
                .audit
                .record(&Record::SnapshotTaken {
                    snapshot: id.clone(),
                    kernel: live.id().to_owned(),
                    key: key.to_owned(),
                    kind: kind.as_str().to_owned(),
                    bytes: held.record.bytes,
                    took_ms: took.as_millis() as u64,
                    dropped: held.record.dropped.clone(),
                })
                .await;
        }
        tracing::info!(kernel = %live.id(), snapshot = %id, kind = kind.as_str(), bytes = held.record.bytes, ?took, "snapshot taken");
        Ok(held)
    }

    /// The whole running kernel into `partial`: sealed (what clients send meanwhile waits),
    /// checkpointed by the engine while it runs on, linked again, unsealed.
    async fn checkpoint_running(
        &self,
        live: &Arc<LiveKernel>,
        partial: &Partial,
        since: u64,
    ) -> Result<(), SnapshotError> {
        if live.relay.step(Event::Seal { since }).await.is_err() {
            return Err(SnapshotError::Busy(
                "work came in before its snapshot".into(),
            ));
        }
        let process = live.process();
        let image = partial.path().join(hibernate::MEMORY);
        let taken = self.kernels.backend.snapshot(&process.handle, &image).await;
        let result = match taken {
            Ok(()) => Ok(()),
            Err(BackendError::Refused(why)) => {
                let _ = live.relay.step(Event::Unseal).await;
                return Err(SnapshotError::Refused(
                    why.replace("then hibernate again", "then take the snapshot again"),
                ));
            }
            Err(e @ BackendError::Died(_)) => {
                // Its watcher reports the death (the epoch is unchanged) once this ends.
                let _ = live.relay.step(Event::Unseal).await;
                return Err(SnapshotError::Failed(format!(
                    "{e}; the kernel is reported dead"
                )));
            }
            Err(e) => Err(SnapshotError::Failed(format!("{e}; the kernel runs on"))),
        };
        // The relays closed and opened again: the link goes to the kernel anew, and a
        // heartbeat missed meanwhile is no death.
        live.epoch.fetch_add(1, Ordering::SeqCst);
        if let Err(e) = self.kernels.supervisor().connect_into(live, &process).await {
            tracing::warn!(kernel = %live.id(), error = %e, "cannot reach a kernel after its snapshot");
        }
        live.rearm.notify_one();
        let _ = live.relay.step(Event::Unseal).await;
        result
    }

    /// The kernel's variables (what its helper can pickle, within `room` bytes) and files
    /// into `partial`; the helper's state is removed from the kernel's home afterwards.
    /// `None` when they pass `room`.
    async fn namespace(
        &self,
        live: &Arc<LiveKernel>,
        partial: &Partial,
        accept_loss: bool,
        room: u64,
        key: &str,
        budget: &Budget,
    ) -> Result<Option<Kept>, SnapshotError> {
        let hibernation = self.kernels.hibernation();
        let timeout = self.kernels.settings.hibernate.save_timeout;
        let code = hibernate::save_code(accept_loss, room);
        match hibernation.run_silently(live, &code, timeout).await? {
            None => {}
            Some((ename, evalue)) if ename == "HibernateBlocked" => {
                let whence = format!("what is left of key {key:?}'s snapshot budget, {}", budget.bytes_from);
                return Err(SnapshotError::Refused(snapshot_wording(
                    &evalue.replace("--hibernate-max-mb", &whence),
                )));
            }
            Some((ename, _)) if ename == "ModuleNotFoundError" => {
                return Err(SnapshotError::Refused(
                    "the kernel's image has no kernelgate_state helper, so its variables cannot be saved; take a `filesystem` snapshot, or build images from kernel-image/ (docs/custom-images.md)".into(),
                ))
            }
            Some((ename, evalue)) => {
                return Err(SnapshotError::Failed(format!(
                    "saving the variables: {ename}: {evalue}; the kernel runs on"
                )))
            }
        }
        let kept = hibernation.home_out(live, partial, accept_loss, room).await;
        // The kernel runs on: the state it wrote into its home goes.
        if let Err(e) = hibernation
            .run_silently(live, &hibernate::forget_code(), timeout)
            .await
        {
            tracing::debug!(kernel = %live.id(), error = %e, "cannot remove the state a kernel saved");
        }
        Ok(kept?)
    }
}
