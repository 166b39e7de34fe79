//! The table of live kernels: creating them (from the warm pool or cold), interrupting,
//! deleting, and the kernel limit. The only place where a container ([`crate::backend`])
//! and its sockets ([`crate::relay`]) meet.
//!
//! What acts on the table's kernels are types of their own, each holding the table and
//! reached through it: the warm pool ([`Pool`]), supervision: restarts, the death watch
//! and culling ([`Supervisor`]), hibernation ([`Hibernation`]) and package installs
//! ([`Installs`]).

use crate::backend::{BackendError, KernelBackend};
use crate::kernelspecs::KernelSpecs;
use crate::metrics::TableSnapshot;
use crate::relay::clients::ClientLimits;

mod adopt;
mod create;
pub mod files;
pub mod hibernate;
pub mod ledger;
pub mod packages;
mod pool;
pub mod runner;
mod slot;
pub mod snapshots;
mod supervise;
mod template;
use crate::audit::{Audit, Record};
use crate::relay::lifecycle::Event;
use crate::relay::{Attachment, KernelError, Relay};
use crate::tenants::TOKEN_KEY;
pub use create::kernel_env;
pub use hibernate::Hibernation;
use kernelgate_protocol::content::ExecutionState;
use kernelgate_protocol::{Channel, ConnectionInfo, Message, RawJson};
pub use packages::Installs;
pub use pool::Pool;
pub use snapshots::Snapshots;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;
pub use supervise::{HeartbeatCheck, Supervisor};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("no kernel spec named {name:?}; this gateway offers {offered}")]
    NoSuchSpec { name: String, offered: String },
    #[error("{max} kernels are running, the most this gateway allows; shut one down first")]
    TooMany { max: usize },
    #[error("key {key:?} may run at most {max} kernels (max_kernels in the keys file); shut one of yours down first")]
    TooManyForKey { key: String, max: usize },
    #[error("environment variable {name}: {reason}")]
    BadEnv { name: String, reason: &'static str },
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("the gateway is shutting down")]
    ShuttingDown,
    #[error("the kernel started but did not answer: {0}")]
    Kernel(#[from] KernelError),
    /// The cluster registry did not take the kernel: it was removed again.
    #[error("the kernel could not be registered in the cluster: {0}")]
    Unregistered(String),
    /// A hibernated kernel's state could not be put into a fresh process; it stays on disk.
    #[error("the hibernated kernel's state could not be loaded: {0}")]
    Resume(String),
    /// Its saved variables did not load into the new process; the state is kept and the
    /// kernel hibernates again.
    #[error("the kernel's saved state could not be loaded ({why}); the state is kept: try again, or discard the saved variables and keep the files with POST /api/kernels/{id}/discard-state (docs/hibernation.md)")]
    StateNotLoaded { id: String, why: String },
    /// A snapshot cannot start a kernel as asked (another spec, a new environment for a
    /// whole kernel).
    #[error("{0}")]
    SnapshotRefused(String),
    /// The kernel started from a snapshot could not be given its state; it was removed.
    #[error("{0}; the snapshot is kept: try again")]
    FromSnapshot(String),
}

impl From<ledger::ClaimRefused> for CreateError {
    fn from(refused: ledger::ClaimRefused) -> Self {
        match refused {
            ledger::ClaimRefused::Quota { key, max } => CreateError::TooManyForKey { key, max },
            ledger::ClaimRefused::Unavailable(why) => CreateError::Unregistered(why),
        }
    }
}

/// What governs kernels, taken from the configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    pub max_kernels: usize,
    pub startup_timeout: Duration,
    pub autorestart: bool,
    pub cull_idle_timeout: Option<Duration>,
    pub heartbeat: HeartbeatCheck,
    /// The kernel specs, with their images and pool sizes.
    pub specs: Arc<KernelSpecs>,
    pub limits: ClientLimits,
    pub audit: Audit,
    /// The execution policy (`--policy`), shared by every kernel.
    pub guard: Option<Arc<crate::policy::Guard>>,
    /// Where the table's own kernels are recorded beyond this process (cluster mode).
    pub ledger: Option<Arc<dyn ledger::Ledger>>,
    /// When kernels hibernate, and where their state goes.
    pub hibernate: hibernate::Policy,
    /// The package allowlists and wheelhouse (`--packages`, `--wheelhouse`).
    pub packages: Option<Arc<crate::packages::Packages>>,
    /// Start kernels from a checkpoint of a preloaded one, where the engine can
    /// (`--kernel-templates`).
    pub templates: bool,
    /// The snapshots' budgets and retention.
    pub snapshots: snapshots::Policy,
}

/// The kernel process a [`LiveKernel`] runs in now: a restart may move it into a warm
/// kernel's container.
#[derive(Debug, Clone)]
struct Process {
    /// The backend's handle (container id).
    handle: String,
    connection: ConnectionInfo,
}

/// One kernel of the table.
#[derive(Debug)]
pub struct LiveKernel {
    pub relay: Arc<Relay>,
    pub name: String,
    process: Mutex<Process>,
    /// Serializes restarts with the death watcher.
    ops: tokio::sync::Mutex<()>,
    /// Bumped by every intentional restart, so the watcher ignores the exit it causes.
    epoch: AtomicU64,
    /// Wakes the watcher when the kernel moved into another process.
    rearm: Notify,
    /// Queues the jobs of [`runner`] (agent API, MCP) so concurrent calls go one at a time,
    /// in the order they were made (tokio's mutex is fair).
    pub runs: Arc<tokio::sync::Mutex<()>>,
    cancel: CancellationToken,
    /// The tenant it belongs to; set once, when it is registered (warm kernels have none).
    owner: OnceLock<String>,
    /// The environment a warm kernel must be given to take this kernel's place at a
    /// restart; unset when none can (limits of its own, variables only a fresh process
    /// reads, or unknown for a kernel re-adopted from an earlier run).
    warm_env: OnceLock<BTreeMap<String, String>>,
    /// What a fresh process for it starts with: its create's environment and limits.
    origin: OnceLock<(BTreeMap<String, String>, Limits)>,
    /// Its key's `max_hibernated`, as the keys file said at its create.
    max_hibernated: OnceLock<usize>,
    /// Its hibernation.
    sleep: Mutex<hibernate::Sleep>,
    /// Its process can be saved whole (a checkpoint, under an engine that can).
    lossless: AtomicBool,
}

impl LiveKernel {
    fn new(relay: Arc<Relay>, name: &str, process: Process, cancel: CancellationToken) -> Self {
        LiveKernel {
            relay,
            name: name.to_owned(),
            process: Mutex::new(process),
            ops: tokio::sync::Mutex::new(()),
            epoch: AtomicU64::new(0),
            rearm: Notify::new(),
            runs: Arc::default(),
            cancel,
            owner: OnceLock::new(),
            warm_env: OnceLock::new(),
            origin: OnceLock::new(),
            max_hibernated: OnceLock::new(),
            lossless: AtomicBool::new(false),
            sleep: Mutex::default(),
        }
    }

    pub fn id(&self) -> &str {
        self.relay.id()
    }

    /// The tenant that owns it (empty for a warm kernel nobody took yet).
    pub fn owner(&self) -> &str {
        self.owner.get().map_or("", String::as_str)
    }

    /// The backend's handle (container id) of its process now.
    pub fn handle(&self) -> String {
        self.process().handle
    }

    fn process(&self) -> Process {
        // Plain data: a panic elsewhere cannot leave it inconsistent.
        self.process
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn set_process(&self, process: Process) {
        *self.process.lock().unwrap_or_else(|e| e.into_inner()) = process;
    }
}

/// The gateway's own code reaches a kernel through an attachment of its relay (internal,
/// with the gateway's key, so no client sees its messages).
impl crate::silent::Session for Attachment {
    fn request(&self, msg_type: &str, content: RawJson) -> Message {
        self.relay().request(msg_type, content)
    }

    async fn send(&self, channel: Channel, message: Message) -> Result<(), String> {
        Attachment::send(self, channel, message)
            .await
            .map_err(|e| e.to_string())
    }

    async fn next(&self, each: &mut (dyn FnMut(Channel, &Message) + Send)) -> bool {
        let Some(batch) = self.recv().await else {
            return false;
        };
        for out in batch {
            each(out.channel, &out.message);
        }
        true
    }
}

#[derive(Debug, Default)]
struct Table {
    live: HashMap<String, Arc<LiveKernel>>,
    /// Creates under way, counted against the limit so concurrent creates cannot pass it.
    reserved: usize,
    /// The same, by tenant, for the per-key limits.
    reserved_by: HashMap<String, usize>,
    /// Warm kernels by spec name.
    pool: HashMap<String, VecDeque<Arc<LiveKernel>>>,
}

impl Table {
    fn release(&mut self, owner: &str) {
        self.reserved -= 1;
        if let Some(n) = self.reserved_by.get_mut(owner) {
            *n -= 1;
            if *n == 0 {
                self.reserved_by.remove(owner);
            }
        }
    }

    /// Kernels that run (hibernated ones count against no limit), and creates under way.
    fn running(&self) -> usize {
        self.live.values().filter(|l| !l.hibernated()).count() + self.reserved
    }

    fn owned_by(&self, owner: &str) -> usize {
        self.live
            .values()
            .filter(|l| l.owner() == owner && !l.hibernated())
            .count()
            + self.reserved_by.get(owner).copied().unwrap_or(0)
    }
}

/// Per-kernel limits tighter than the configured ones (a key's).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Limits {
    memory_mb: Option<u64>,
    cpus: Option<f64>,
}

/// Why a kernel is removed, as its audit record says.
#[derive(Debug, Clone)]
pub enum Removal {
    /// The key named asked for it.
    AskedBy(String),
    /// The gateway removes it for this reason (a revoked key, an ended MCP session).
    Because(String),
    /// It was idle past `--cull-idle-timeout`.
    Culled,
}

impl Removal {
    /// What the executions a removed kernel owed are answered with.
    fn cause(&self) -> String {
        match self {
            Removal::AskedBy(key) if key == TOKEN_KEY => {
                "the kernel was deleted by the admin (the gateway's token)".to_owned()
            }
            Removal::AskedBy(key) => format!("the kernel was deleted by key {key:?}"),
            Removal::Because(reason) => format!("the kernel was deleted ({reason})"),
            Removal::Culled => "the kernel was shut down as idle (--cull-idle-timeout)".to_owned(),
        }
    }
}

/// All kernels of this gateway.
#[derive(Debug)]
pub struct Kernels {
    backend: Arc<dyn KernelBackend>,
    settings: Settings,
    table: Mutex<Table>,
    pool_wanted: Notify,
    tracker: TaskTracker,
    cancel: CancellationToken,
    templates: template::Templates,
    snapshots: snapshots::Store,
}

impl Kernels {
    pub fn new(
        backend: Arc<dyn KernelBackend>,
        settings: Settings,
        tracker: TaskTracker,
        cancel: CancellationToken,
    ) -> Arc<Self> {
        Arc::new(Kernels {
            backend,
            settings,
            table: Mutex::new(Table::default()),
            pool_wanted: Notify::new(),
            tracker,
            cancel,
            templates: template::Templates::default(),
            snapshots: snapshots::Store::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn backend(&self) -> &Arc<dyn KernelBackend> {
        &self.backend
    }

    /// The audit trail.
    pub fn audit(&self) -> &Audit {
        &self.settings.audit
    }

    /// How long a command the gateway runs in a kernel's sandbox may take
    /// (`--sandbox-command-timeout`).
    pub fn command_timeout(&self) -> Duration {
        self.settings.hibernate.command_timeout
    }

    /// The package allowlists and wheelhouse, when `--wheelhouse` is set.
    pub fn packages(&self) -> Option<&Arc<crate::packages::Packages>> {
        self.settings.packages.as_ref()
    }

    /// The warm pools.
    pub fn pool(self: &Arc<Self>) -> Pool {
        Pool::new(self)
    }

    /// Restarts, the death watch and culling.
    pub fn supervisor(self: &Arc<Self>) -> Supervisor {
        Supervisor::new(self)
    }

    /// Hibernating kernels and bringing them back.
    pub fn hibernation(self: &Arc<Self>) -> Hibernation {
        Hibernation::new(self)
    }

    /// Snapshots of kernels, and kernels started from them.
    pub fn snapshots(self: &Arc<Self>) -> Snapshots {
        Snapshots::new(self)
    }

    /// Package installs into kernels.
    pub fn installs(self: &Arc<Self>) -> Installs {
        Installs::new(self)
    }

    pub fn get(&self, id: &str) -> Option<Arc<LiveKernel>> {
        self.lock().live.get(id).cloned()
    }

    pub fn list(&self) -> Vec<Arc<LiveKernel>> {
        let mut all: Vec<_> = self.lock().live.values().cloned().collect();
        all.sort_by(|a, b| a.id().cmp(b.id()));
        all
    }

    /// Removes every kernel a tenant owns (its key was revoked); returns their ids.
    pub async fn remove_owned_by(self: &Arc<Self>, owner: &str) -> Vec<String> {
        let ids: Vec<String> = self
            .list()
            .iter()
            .filter(|l| l.owner() == owner)
            .map(|l| l.id().to_owned())
            .collect();
        for id in &ids {
            if let Some(Err(e)) = self
                .delete(id, Removal::Because("key revoked".into()))
                .await
            {
                tracing::warn!(kernel = %id, error = %e, "cannot remove a revoked key's kernel");
            }
        }
        ids
    }

    /// Starts the background work: warm pool, culling, and removal of containers left
    /// behind by an earlier run of the gateway.
    pub async fn start(self: &Arc<Self>) {
        adopt::remove_leftovers(self).await;
        self.prepare_templates();
        for spec in self.settings.specs.iter().filter(|s| s.pool_size > 0) {
            let pool = self.pool();
            let (name, size) = (spec.name.clone(), spec.pool_size);
            self.tracker
                .spawn(async move { pool.keep_filled(name, size).await });
        }
        if let Some(idle) = self.settings.cull_idle_timeout {
            let supervisor = self.supervisor();
            self.tracker
                .spawn(async move { supervisor.cull(idle).await });
        }
        self.hibernation().restore_hibernated().await;
        self.snapshots().load().await;
        if let Some(retention) = self.settings.snapshots.retention {
            self.tracker.spawn(self.snapshots().expire(retention));
        }
        let hibernate = &self.settings.hibernate;
        if hibernate.after.is_some() || hibernate.retention.is_some() {
            self.tracker.spawn(self.hibernation().hibernate_idle());
        }
    }

    /// The table's state for the metrics.
    pub fn snapshot(self: &Arc<Self>) -> TableSnapshot {
        let t = self.lock();
        let mut states: BTreeMap<&'static str, i64> = [
            ExecutionState::Starting,
            ExecutionState::Idle,
            ExecutionState::Busy,
            ExecutionState::Restarting,
            ExecutionState::Dead,
        ]
        .into_iter()
        .map(|s| (s.as_str(), 0))
        .collect();
        let mut buffered = 0;
        for live in t.live.values() {
            *states
                .entry(live.relay.execution_state().as_str())
                .or_default() += 1;
            buffered += live.relay.activity().buffered_bytes;
        }
        let pooled =
            i64::try_from(t.pool.values().map(VecDeque::len).sum::<usize>()).unwrap_or(i64::MAX);
        drop(t);
        let (hibernated, hibernated_bytes) = self.hibernation().hibernated_totals();
        let (snapshots, snapshot_bytes) = self.snapshots().totals();
        TableSnapshot {
            hibernated,
            hibernated_bytes,
            snapshots,
            snapshot_bytes,
            states: states.into_iter().collect(),
            pooled,
            buffered_bytes: i64::try_from(buffered).unwrap_or(i64::MAX),
        }
    }

    pub fn specs(&self) -> &KernelSpecs {
        &self.settings.specs
    }

    /// Interrupts the kernel's process (SIGINT); executions still waiting for approval are
    /// cancelled.
    /// A hibernated kernel runs nothing: interrupting it does nothing.
    pub async fn interrupt(&self, live: &LiveKernel) -> Result<(), BackendError> {
        if live.hibernated() {
            return Ok(());
        }
        live.relay.interrupted().await;
        self.backend.interrupt(&live.handle()).await
    }

    /// Shuts a kernel down: gone from the table at once, clients told `dead` and
    /// disconnected, container and sockets removed; the audit trail says `why`. The removal
    /// finishes even when the caller goes away.
    pub async fn delete(
        self: &Arc<Self>,
        id: &str,
        why: Removal,
    ) -> Option<Result<(), BackendError>> {
        let live = self.lock().live.remove(id)?;
        let owner = live.owner().to_owned();
        if live.hibernated() {
            self.hibernation().forget_state(id).await;
        } else {
            // What it runs and holds is answered with who deleted it, as a restart's is.
            let lost = Event::lost("KernelDeleted", &why.cause(), false);
            let _ = live.relay.step(lost).await;
        }
        if let Some(ledger) = &self.settings.ledger {
            ledger.release(id).await;
        }
        self.settings
            .audit
            .record(&match why {
                Removal::Culled => Record::KernelCulled { kernel: id.into() },
                Removal::AskedBy(key) => Record::KernelDeleted {
                    kernel: id.into(),
                    owner,
                    key: Some(key),
                    reason: None,
                },
                Removal::Because(reason) => Record::KernelDeleted {
                    kernel: id.into(),
                    owner,
                    key: None,
                    reason: Some(reason),
                },
            })
            .await;
        self.pool_wanted.notify_waiters();
        let me = self.clone();
        let removal = self
            .tracker
            .spawn(async move { me.discard(&live).await }.in_current_span());
        Some(
            removal.await.unwrap_or_else(|e| {
                Err(BackendError::Runtime(format!("kernel removal failed: {e}")))
            }),
        )
    }

    async fn discard(&self, live: &LiveKernel) -> Result<(), BackendError> {
        live.cancel.cancel();
        let hibernated = live.hibernated();
        let _ = live.relay.step(Event::Deleted).await;
        live.relay.close_clients();
        if hibernated {
            // Its process is gone already.
            return Ok(());
        }
        self.backend.remove(&live.handle()).await
    }

    /// Every kernel, pooled ones included, taken out of the table.
    fn take_all(&self) -> Vec<Arc<LiveKernel>> {
        let mut t = self.lock();
        let mut all: Vec<_> = t.live.drain().map(|(_, v)| v).collect();
        all.extend(t.pool.drain().flat_map(|(_, p)| p));
        all
    }

    /// Lets go of every kernel without removing it (a cluster node that stops and will
    /// return on the same runtime directory re-adopts them): their watchers and links end,
    /// their clients are disconnected, their containers keep running.
    pub fn leave(&self) {
        for live in self.take_all() {
            live.cancel.cancel();
            // Nothing to carry out: the link closes at once.
            drop(live.relay.step(Event::Unlinked));
            live.relay.close_clients();
        }
    }

    /// Removes every kernel, pooled ones included (graceful shutdown).
    /// Hibernated kernels stay on disk for the next run.
    pub async fn shutdown(&self) {
        let (hibernated, all): (Vec<_>, Vec<_>) = self
            .take_all()
            .into_iter()
            .partition(|live| live.hibernated());
        for live in hibernated {
            live.cancel.cancel();
            live.relay.close_clients();
        }
        let removals = all.iter().map(|live| self.discard(live));
        for (live, result) in all.iter().zip(futures::future::join_all(removals).await) {
            if let Err(e) = result {
                tracing::warn!(kernel = %live.id(), error = %e, "cannot remove kernel at shutdown");
            }
        }
    }
}

#[cfg(test)]
mod cluster_tests;
#[cfg(test)]
pub(crate) use crate::backend::fake;
#[cfg(test)]
mod tests;
