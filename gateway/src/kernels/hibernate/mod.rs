//! Hibernation: an idle kernel's state goes to disk and its container away; the first
//! request that needs the kernel brings it back under the same id (docs/hibernation.md).
//!
//! Saving: the kernel's own `kernelgate_state` helper (in the image) pickles every user
//! variable to a file in its home and refuses, naming them, when some cannot be saved.
//! The gateway then takes the home (working directory and saved state) out of the
//! container as a tar, keeps only directories and regular files with relative paths, and
//! commits it with a description into `--hibernate-dir/<id>` (written to a temporary
//! directory, synced, renamed). Only then is the container removed: a gateway killed at
//! any point finds either the running container or the committed state. The gateway never
//! reads what the variables hold; the state is only ever loaded into a sandboxed kernel.
//!
//! Resuming: a warm kernel from the pool (or a cold start) gets the tar unpacked into its
//! home, and a load of the state is put in front of whatever clients sent meanwhile, so
//! the first cell after the wake sees the old variables. The kernel's clients stay
//! attached throughout.

use super::{Kernels, LiveKernel, Removal};
use crate::audit::Record;
use crate::metrics;
use crate::relay::lifecycle::Event;
use crate::relay::GATEWAY_KEY;
use crate::silent::{self, Unanswered};
use chrono::{DateTime, Utc};
use kernelgate_protocol::content::ExecutionState;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tracing::Instrument;

const STATE_OUT: &str = include_str!("../../../assets/state_out.py");
const STATE_IN: &str = include_str!("../../../assets/state_in.py");

/// Where the kernel's helper writes its state, inside the kernel's home.
const STATE_DIR: &str = "/home/kernel/.kernelgate-state";
/// Its description of the saved variables, as the home's tar names it.
const MANIFEST: &str = ".kernelgate-state/manifest.json";
/// The kernel's Python, which runs the helper scripts: `-P` and the directory `/` (the
/// backend's) keep the kernel's own files (a `tarfile.py` in its home) from shadowing
/// what they import; `-I` would also drop the `PYTHONPATH` the packages shim needs.
const PYTHON: &str = "/opt/kernel/venv/bin/python";
/// How long loading a state may take inside the kernel.
const KERNEL_TIMEOUT: Duration = Duration::from_secs(300);
/// How long an interrupted save has to answer before the gateway stops waiting.
const INTERRUPT_WAIT: Duration = Duration::from_secs(10);
/// Idle kernels hibernating at once (each streams through one [`STREAM_CHUNKS`] buffer).
pub const CONCURRENT_HIBERNATIONS: usize = 4;
/// Chunks of a state in flight between the kernel's container and the file on disk, per
/// hibernation or resume; a chunk is at most what one Docker stream frame carries.
pub const STREAM_CHUNKS: usize = 8;
/// The longest a kernel whose hibernation failed waits before the next automatic try.
const MAX_BACKOFF: Duration = Duration::from_secs(3600);
/// The files of a committed state.
pub(in crate::kernels) const TAR: &str = "state.tar";
/// The directory of a whole kernel's checkpoint (its engine's image).
pub(in crate::kernels) const MEMORY: &str = "memory";
const META: &str = "kernel.json";

/// What governs hibernation, from the configuration.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Hibernate kernels with no execution for this long; `None` never.
    pub after: Option<Duration>,
    pub dir: PathBuf,
    pub max_bytes: u64,
    pub max_hibernated: usize,
    /// Delete hibernated kernels after this long; `None` keeps them.
    pub retention: Option<Duration>,
    pub lossy: bool,
    /// How long pickling the variables may take inside the kernel before it is
    /// interrupted (`--hibernate-save-timeout`).
    pub save_timeout: Duration,
    /// How long a command the gateway runs in a kernel's sandbox may take
    /// (`--sandbox-command-timeout`): taking a state out, putting it back, the files API.
    pub command_timeout: Duration,
    /// Kernels one key may keep hibernated, unless its keys-file entry says otherwise.
    pub per_key: usize,
    /// Bytes of state one key's hibernated kernels may take together.
    pub key_max_bytes: u64,
    /// The gateway's runtime directory: a state names it, and a gateway lists again only
    /// the hibernated kernels of its own runtime directory (as it re-adopts containers).
    pub runtime_dir: String,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            after: None,
            dir: std::env::temp_dir().join("kernelgate-hibernated"),
            max_bytes: 512 << 20,
            max_hibernated: 256,
            retention: None,
            lossy: false,
            save_timeout: Duration::from_secs(60),
            command_timeout: Duration::from_secs(120),
            per_key: 64,
            key_max_bytes: 4 << 30,
            runtime_dir: String::new(),
        }
    }
}

/// What a hibernation keeps: the whole kernel (`memory`: a checkpoint of its sandbox, under
/// an engine that can, docs/engines.md) or its namespace and files (`namespace`: what the
/// kernel's helper can pickle).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Memory,
    #[default]
    Namespace,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Memory => "memory",
            Kind::Namespace => "namespace",
        }
    }
}

/// A kernel's hibernation, as its model shows it.
#[derive(Debug, Default)]
pub(super) struct Sleep {
    /// What its committed state keeps, while it is there.
    kind: Option<Kind>,
    /// When its state was committed to disk, and its bytes, while the state is there
    /// (whether it hibernates is its phase: `LiveKernel::hibernated`).
    since: Option<(DateTime<Utc>, u64)>,
    /// Why it cannot hibernate, until its next execution.
    blocked: Option<String>,
    /// The client messages sent when the block was found: an automatic try waits for
    /// new work.
    blocked_at: Option<u64>,
    /// An automatic hibernation of it is under way.
    trying: bool,
    /// Failed automatic tries in a row, and when the next may start.
    failures: u32,
    retry_at: Option<Instant>,
}

/// Why a kernel did not hibernate.
#[derive(Debug, thiserror::Error)]
pub enum HibernateError {
    /// Something runs, or work came in while it saved.
    #[error("the kernel is busy: {0}")]
    Busy(String),
    /// Its state cannot be kept (variables, links, the budget); it keeps running.
    #[error("{0}")]
    Blocked(String),
    #[error("{0}")]
    Full(String),
    #[error("cannot hibernate the kernel: {0}")]
    Failed(String),
}

/// What is kept beside a hibernated kernel's state: enough to list it and bring it back.
#[derive(Debug, Serialize, Deserialize)]
struct Meta {
    id: String,
    runtime_dir: String,
    spec: String,
    owner: String,
    env: BTreeMap<String, String>,
    memory_mb: Option<u64>,
    cpus: Option<f64>,
    #[serde(default)]
    max_hibernated: Option<usize>,
    hibernated_at: DateTime<Utc>,
    last_activity: DateTime<Utc>,
    bytes: u64,
    #[serde(default)]
    kind: Kind,
}

impl LiveKernel {
    /// Whether the kernel hibernates: its state saved (or being committed), no process
    /// serving it; its messages wait for the next one. The table, the kernel's model and
    /// the cluster registry read this one answer, the relay's phase.
    pub fn hibernated(&self) -> bool {
        self.relay.phase().is_hibernated()
    }

    /// Whether the hibernation is complete: state on disk, container removed. What the
    /// kernel's model shows as `hibernated` (a kernel still saving is not yet).
    pub fn at_rest(&self) -> bool {
        self.relay.phase().is_at_rest()
    }

    /// What a hibernation of the kernel keeps: its committed state's kind while it
    /// hibernates, else what the engine can do for its process.
    pub fn hibernation_kind(&self) -> Kind {
        if let Some(kind) = self.sleep().kind.filter(|_| self.at_rest()) {
            return kind;
        }
        if self.lossless.load(Ordering::SeqCst) {
            Kind::Memory
        } else {
            Kind::Namespace
        }
    }

    /// Why the kernel could not hibernate last time it tried, until its next execution.
    pub fn hibernate_blocked(&self) -> Option<String> {
        let sleep = self.sleep();
        match (&sleep.blocked, sleep.blocked_at) {
            (Some(why), Some(at)) if at == self.relay.activity().client_sends => Some(why.clone()),
            _ => None,
        }
    }

    fn sleep(&self) -> std::sync::MutexGuard<'_, Sleep> {
        self.sleep.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn block(&self, why: &str) {
        let mut sleep = self.sleep();
        sleep.blocked = Some(why.to_owned());
        sleep.blocked_at = Some(self.relay.activity().client_sends);
    }
}

/// Hibernation of the table's kernels: putting them to disk and bringing them back.
#[derive(Debug, Clone)]
pub struct Hibernation {
    kernels: Arc<Kernels>,
}

impl Hibernation {
    pub(in crate::kernels) fn new(kernels: &Arc<Kernels>) -> Self {
        Hibernation {
            kernels: kernels.clone(),
        }
    }

    fn state_dir(&self, id: &str) -> PathBuf {
        self.kernels.settings.hibernate.dir.join(id)
    }

    /// Hibernates `live` now: its state saved, its container removed. A kernel that is
    /// busy, or whose state cannot be kept, keeps running and the error says why.
    pub async fn hibernate(&self, live: &Arc<LiveKernel>) -> Result<(), HibernateError> {
        let (me, live) = (self.clone(), live.clone());
        let task = self.kernels.tracker.spawn(
            async move {
                let started = Instant::now();
                let result = me.hibernate_now(&live).await;
                let outcome = match &result {
                    Ok(()) => "hibernated",
                    Err(HibernateError::Blocked(_) | HibernateError::Full(_)) => "blocked",
                    Err(HibernateError::Busy(_)) => "busy",
                    Err(HibernateError::Failed(_)) => "failed",
                };
                metrics::hibernation(outcome, started.elapsed());
                match &result {
                    Ok(()) => {
                        let mut sleep = live.sleep();
                        sleep.failures = 0;
                        sleep.retry_at = None;
                    }
                    Err(e @ (HibernateError::Blocked(_) | HibernateError::Full(_))) => {
                        tracing::info!(kernel = %live.id(), reason = %e, "the kernel cannot hibernate; it keeps running");
                        live.block(&e.to_string());
                    }
                    Err(e @ HibernateError::Failed(_)) => {
                        // Tried again later, less often each time, not on every pass.
                        let mut sleep = live.sleep();
                        sleep.failures = sleep.failures.saturating_add(1);
                        let wait = Duration::from_secs(30)
                            .saturating_mul(1 << sleep.failures.min(7))
                            .min(MAX_BACKOFF);
                        sleep.retry_at = Some(Instant::now() + wait);
                        tracing::info!(kernel = %live.id(), reason = %e, ?wait, "the kernel did not hibernate; tried again later");
                    }
                    Err(e) => tracing::info!(kernel = %live.id(), reason = %e, "the kernel did not hibernate"),
                }
                result
            }
            .in_current_span(),
        );
        task.await
            .unwrap_or_else(|e| Err(HibernateError::Failed(e.to_string())))
    }

    async fn hibernate_now(&self, live: &Arc<LiveKernel>) -> Result<(), HibernateError> {
        let _ops = live.ops.lock().await;
        if live.hibernated() {
            return Ok(());
        }
        let policy = &self.kernels.settings.hibernate;
        let hibernated = self
            .kernels
            .lock()
            .live
            .values()
            .filter(|l| l.hibernated())
            .count();
        if hibernated >= policy.max_hibernated {
            return Err(HibernateError::Full(format!(
                "{hibernated} kernels hibernate, the most --max-hibernated allows; the kernel keeps running"
            )));
        }
        {
            let (max, whence) = match live.max_hibernated.get() {
                Some(&max) => (max, "max_hibernated in the keys file"),
                None => (policy.per_key, "--max-hibernated-per-key"),
            };
            let owner = live.owner();
            let theirs = self
                .kernels
                .lock()
                .live
                .values()
                .filter(|l| l.owner() == owner && l.hibernated())
                .count();
            if theirs >= max {
                return Err(HibernateError::Full(format!(
                    "key {owner:?} may keep at most {max} kernels hibernated ({whence}); the kernel keeps running"
                )));
            }
        }
        let activity = live.relay.activity();
        if !activity.quiet {
            return Err(HibernateError::Busy("it runs or holds code".into()));
        }
        let started = Instant::now();
        let since = activity.client_sends;
        if self.kernels.backend.can_checkpoint(&live.handle()) {
            return self.checkpoint(live, since, started).await;
        }
        let code = save_code(policy.lossy, policy.max_bytes);
        match self.run_silently(live, &code, policy.save_timeout).await? {
            None => {}
            Some((ename, evalue)) if ename == "HibernateBlocked" => {
                return Err(HibernateError::Blocked(evalue))
            }
            Some((ename, _)) if ename == "ModuleNotFoundError" => {
                return Err(HibernateError::Blocked(format!(
                    "the kernel's image {:?} has no kernelgate_state helper, so its state cannot be saved; build images from kernel-image/ or derive them from kernelgate-kernel (docs/custom-images.md)",
                    self.kernels.settings.specs.get(&live.name).map(|s| s.image.clone()).unwrap_or_default()
                )))
            }
            Some((ename, evalue)) => {
                return Err(HibernateError::Failed(format!("saving the state: {ename}: {evalue}")))
            }
        }
        let put_away = self.put_away(live, since, started).await;
        if put_away.is_err() && !live.hibernated() {
            // The kernel runs on: the state it wrote into its home goes.
            if let Err(e) = self
                .run_silently(live, &forget_code(), policy.save_timeout)
                .await
            {
                tracing::debug!(kernel = %live.id(), error = %e, "cannot remove the state a kernel saved");
            }
        }
        // Work that came in meanwhile changed the home under the copy (a cell writing a
        // file the copy then found too large, say): what stopped this try says nothing
        // of the kernel as it is now, so it is not its reason not to hibernate.
        match put_away {
            Err(HibernateError::Blocked(_) | HibernateError::Failed(_))
                if live.relay.activity().client_sends != since =>
            {
                Err(HibernateError::Busy(
                    "work came in while its state was saved".into(),
                ))
            }
            other => other,
        }
    }

    /// Takes the state the kernel saved out of its container, seals the kernel (unless
    /// clients sent work since `since`), commits the state and removes the container.
    async fn put_away(
        &self,
        live: &Arc<LiveKernel>,
        since: u64,
        started: Instant,
    ) -> Result<(), HibernateError> {
        let policy = &self.kernels.settings.hibernate;
        let partial = Partial::new(&policy.dir, live.id())
            .map_err(|e| HibernateError::Failed(format!("writing into --hibernate-dir: {e}")))?;
        let Some(kept) = self
            .home_out(live, &partial, policy.lossy, policy.max_bytes)
            .await?
        else {
            return Err(HibernateError::Blocked(format!(
                "the kernel's variables and files pass the {} MiB allowed (--hibernate-max-mb); delete some, or raise it",
                policy.max_bytes >> 20
            )));
        };
        let owner = live.owner();
        let keys_bytes = self.keys_bytes(live);
        if keys_bytes + kept.bytes > policy.key_max_bytes {
            return Err(HibernateError::Full(format!(
                "key {owner:?} has {} MiB of hibernated state; this kernel's {} MiB would pass the {} MiB a key may keep (--hibernate-key-max-mb); the kernel keeps running",
                keys_bytes >> 20,
                kept.bytes.div_ceil(1 << 20),
                policy.key_max_bytes >> 20
            )));
        }
        let meta = self.meta_of(live, kept.bytes, Kind::Namespace);
        if live.relay.step(Event::Seal { since }).await.is_err() {
            return Err(HibernateError::Busy(
                "work came in while its state was saved".into(),
            ));
        }
        self.finish(live, meta, partial, kept.dropped, started)
            .await
    }

    /// What is kept beside `live`'s state of `bytes`.
    fn meta_of(&self, live: &LiveKernel, bytes: u64, kind: Kind) -> Meta {
        let limits = live.origin.get().cloned().unwrap_or_default();
        Meta {
            id: live.id().to_owned(),
            runtime_dir: self.kernels.settings.hibernate.runtime_dir.clone(),
            spec: live.name.clone(),
            owner: live.owner().to_owned(),
            env: limits.0,
            memory_mb: limits.1.memory_mb,
            cpus: limits.1.cpus,
            max_hibernated: live.max_hibernated.get().copied(),
            hibernated_at: Utc::now(),
            last_activity: live.relay.activity().last_activity,
            bytes,
            kind,
        }
    }

    /// Bytes of hibernated state the other kernels of `live`'s key keep.
    fn keys_bytes(&self, live: &LiveKernel) -> u64 {
        let owner = live.owner();
        self.kernels
            .lock()
            .live
            .values()
            .filter(|l| l.owner() == owner && l.id() != live.id())
            .filter_map(|l| l.sleep().since.map(|(_, bytes)| bytes))
            .sum()
    }

    /// With the kernel sealed: commits its state (`partial`, described by `meta`), removes
    /// its process and says it hibernates.
    async fn finish(
        &self,
        live: &Arc<LiveKernel>,
        meta: Meta,
        partial: Partial,
        dropped: Vec<String>,
        started: Instant,
    ) -> Result<(), HibernateError> {
        let policy = &self.kernels.settings.hibernate;
        let dir = self.state_dir(live.id());
        let committed = {
            let (root, meta_ref, tar) = (policy.dir.clone(), &meta, partial.keep());
            let dir = dir.clone();
            let meta = serde_json::to_vec_pretty(meta_ref).map_err(|e| e.to_string());
            tokio::task::spawn_blocking(move || commit(&root, &dir, &meta?, &tar))
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r)
        };
        if let Err(e) = committed {
            if let Err(re) = live.relay.step(Event::Unseal).await {
                tracing::warn!(kernel = %live.id(), error = %re, "cannot hand waiting messages to the kernel");
            }
            return Err(HibernateError::Failed(format!(
                "writing {}: {e}",
                dir.display()
            )));
        }
        // The exit this causes is not a death. The container goes before the phase says
        // hibernated, so a client that reads `hibernated` finds no process left.
        live.epoch.fetch_add(1, Ordering::SeqCst);
        let handle = live.handle();
        if let Err(e) = self.kernels.backend.remove(&handle).await {
            tracing::warn!(kernel = %live.id(), error = %e, "cannot remove a hibernated kernel's container");
        }
        let _ = live.relay.step(Event::Hibernated).await;
        {
            let mut sleep = live.sleep();
            sleep.since = Some((meta.hibernated_at, meta.bytes));
            sleep.kind = Some(meta.kind);
            sleep.blocked = None;
        }
        if let Some(ledger) = &self.kernels.settings.ledger {
            ledger.hibernated(live.id(), live.hibernated()).await;
        }
        let took = started.elapsed();
        self.kernels
            .settings
            .audit
            .record(&Record::KernelHibernated {
                kernel: live.id().to_owned(),
                owner: live.owner().to_owned(),
                bytes: meta.bytes,
                took_ms: took.as_millis() as u64,
                dropped,
            })
            .await;
        tracing::info!(kernel = %live.id(), bytes = meta.bytes, kind = meta.kind.as_str(), ?took, "kernel hibernated");
        self.kernels.pool_wanted.notify_waiters();
        self.wake_on_request(live);
        Ok(())
    }

    /// Runs `code` in the kernel as the gateway (silent: no execution count, no history);
    /// `Some((ename, evalue))` when it raised. Past `timeout` the kernel is interrupted
    /// and the save counts as blocked: a variable that pickles forever (a slow
    /// `__reduce__`) must not hold the kernel, nor the gateway.
    pub(in crate::kernels) async fn run_silently(
        &self,
        live: &LiveKernel,
        code: &str,
        timeout: Duration,
    ) -> Result<Option<(String, String)>, HibernateError> {
        let session = live.relay.attach(
            &format!("kernelgate-state-{}", uuid::Uuid::new_v4()),
            true,
            GATEWAY_KEY,
        );
        let pending = match silent::execute(&session, code, timeout).await {
            Ok(answer) => return Ok(silent::raised(&answer)),
            Err(Unanswered::NotSent(e)) => return Err(HibernateError::Failed(e)),
            Err(Unanswered::Gone) => {
                return Err(HibernateError::Failed("the kernel went away".into()))
            }
            Err(Unanswered::TimedOut(pending)) => pending,
        };
        if let Err(e) = self.kernels.backend.interrupt(&live.handle()).await {
            tracing::warn!(kernel = %live.id(), error = %e, "cannot interrupt a save that took too long");
        }
        let flag = "--hibernate-save-timeout";
        let secs = timeout.as_secs();
        match pending.wait(INTERRUPT_WAIT).await.map(|answer| silent::raised(&answer)) {
            Ok(Some((ename, evalue))) if ename == "HibernateBlocked" => Err(HibernateError::Blocked(
                format!("{evalue} (after {secs} s, {flag})"),
            )),
            Ok(_) => Err(HibernateError::Blocked(format!(
                "saving the kernel's variables took longer than {secs} s ({flag}) and was interrupted; the kernel keeps running"
            ))),
            Err(_) => Err(HibernateError::Blocked(format!(
                "saving the kernel's variables took longer than {secs} s ({flag}) and did not stop when interrupted; the kernel keeps running, busy"
            ))),
        }
    }

    /// Deletes a hibernated kernel's state (the kernel is deleted, or restarted fresh).
    pub(in crate::kernels) async fn forget_state(&self, id: &str) {
        forget(&self.state_dir(id)).await;
    }

    /// Hibernates kernels with no execution for `after`, and deletes hibernated ones
    /// kept past the retention.
    pub(in crate::kernels) async fn hibernate_idle(self) {
        let policy = self.kernels.settings.hibernate.clone();
        let shortest = [policy.after, policy.retention]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(Duration::from_secs(60));
        let every = (shortest / 4).clamp(Duration::from_secs(1), Duration::from_secs(30));
        // Each kernel hibernates on its own task: one whose save or files hang until their
        // timeouts delays no other.
        let slots = Arc::new(tokio::sync::Semaphore::new(CONCURRENT_HIBERNATIONS));
        loop {
            tokio::select! {
                _ = self.kernels.cancel.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let now = Utc::now();
            for live in self.kernels.list() {
                let quiet = (now - live.relay.activity().last_activity)
                    .to_std()
                    .unwrap_or_default();
                if live.hibernated() {
                    let since = live.sleep().since.map(|(at, _)| at).unwrap_or(now);
                    let kept = (now - since).to_std().unwrap_or_default();
                    if policy.retention.is_some_and(|r| kept >= r) {
                        tracing::info!(kernel = %live.id(), "deleting a kernel hibernated past --hibernate-retention");
                        let why =
                            Removal::Because("hibernated longer than --hibernate-retention".into());
                        if let Some(Err(e)) = self.kernels.delete(live.id(), why).await {
                            tracing::warn!(kernel = %live.id(), error = %e, "cannot delete an expired hibernated kernel");
                        }
                    }
                    continue;
                }
                let idle = live.relay.execution_state() == ExecutionState::Idle;
                if !(policy.after.is_some_and(|a| quiet >= a) && idle) {
                    continue;
                }
                {
                    let mut sleep = live.sleep();
                    let blocked = sleep.blocked_at == Some(live.relay.activity().client_sends);
                    let waiting = sleep.retry_at.is_some_and(|at| Instant::now() < at);
                    if sleep.trying || blocked || waiting {
                        continue;
                    }
                    sleep.trying = true;
                }
                let (me, slots) = (self.clone(), slots.clone());
                self.kernels.tracker.spawn(
                    async move {
                        if let Ok(_slot) = slots.acquire_owned().await {
                            let _ = me.hibernate(&live).await;
                        }
                        live.sleep().trying = false;
                    }
                    .in_current_span(),
                );
            }
        }
    }

    /// Hibernated kernels and the bytes of their state, for the metrics.
    pub(in crate::kernels) fn hibernated_totals(&self) -> (i64, i64) {
        let t = self.kernels.lock();
        t.live
            .values()
            .filter_map(|l| l.sleep().since.map(|(_, bytes)| bytes))
            .fold((0, 0), |(n, b), bytes| (n + 1, b + bytes as i64))
    }
}

/// A Python string literal for `s` (a JSON string is one).
fn py_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

mod home;
mod memory;
mod resume;
mod store;
pub(in crate::kernels) use home::{forget_code, save_code};
pub(in crate::kernels) use memory::size_of;
pub(in crate::kernels) use resume::Wake;
pub(in crate::kernels) use store::{commit, commit_named, forget, forget_if_stale, Kept, Partial};
