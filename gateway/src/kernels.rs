//! The table of live kernels: creating them (from the warm pool or cold), restarting,
//! interrupting, deleting, watching for death, culling idle ones, and the kernel limit.
//! The only place where a container ([`crate::backend`]) and its sockets
//! ([`crate::kernel`]) meet.

use crate::backend::{BackendError, Found, KernelBackend, LaunchRequest, Launched};
use crate::kernel::clients::ClientLimits;
use crate::kernel::{heartbeat, Kernel, KernelError};
use chrono::Utc;
use kernelgate_protocol::content::ExecutionState;
use kernelgate_protocol::ConnectionInfo;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The kernel spec every kernel is started from.
pub const KERNEL_NAME: &str = "python3";

/// `KERNEL_*` variables that are hints for a gateway (sent by JupyterLab), not settings
/// for the kernel; a request carrying only these can be served from the warm pool.
const GATEWAY_HINTS: [&str; 3] = [
    "KERNEL_LAUNCH_TIMEOUT",
    "KERNEL_WORKING_DIR",
    "KERNEL_USERNAME",
];

/// Heartbeat probing: a kernel missing this many probes in a row is restarted (or
/// declared dead). Death by exit is noticed at once through the backend instead.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(3);
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);
const HEARTBEAT_MISSES: u32 = 5;

#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("no kernel spec named {0:?}; this gateway offers \"python3\"")]
    NoSuchSpec(String),
    #[error("{max} kernels are running, the most this gateway allows; shut one down first")]
    TooMany { max: usize },
    #[error("environment variable {name}: {reason}")]
    BadEnv { name: String, reason: &'static str },
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("the gateway is shutting down")]
    ShuttingDown,
    #[error("the kernel started but did not answer: {0}")]
    Kernel(#[from] KernelError),
}

/// What governs kernels, taken from the configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    pub max_kernels: usize,
    pub startup_timeout: Duration,
    pub autorestart: bool,
    pub cull_idle_timeout: Option<Duration>,
    pub pool_size: usize,
    pub limits: ClientLimits,
}

/// One kernel of the table.
#[derive(Debug)]
pub struct LiveKernel {
    pub kernel: Arc<Kernel>,
    pub name: String,
    handle: String,
    connection: ConnectionInfo,
    /// Serializes restarts with the death watcher.
    ops: tokio::sync::Mutex<()>,
    /// Bumped by every intentional restart, so the watcher ignores the exit it causes.
    epoch: AtomicU64,
    /// Queues agent-API executions so concurrent calls run in order, never interleaved.
    pub runs: tokio::sync::Mutex<()>,
    cancel: CancellationToken,
}

impl LiveKernel {
    pub fn id(&self) -> &str {
        self.kernel.id()
    }

    /// The backend's handle (container id).
    pub fn handle(&self) -> &str {
        &self.handle
    }
}

#[derive(Debug, Default)]
struct Table {
    live: HashMap<String, Arc<LiveKernel>>,
    /// Creates under way, counted against the limit so concurrent creates cannot pass it.
    reserved: usize,
    pool: VecDeque<Arc<LiveKernel>>,
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
        })
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn backend(&self) -> &Arc<dyn KernelBackend> {
        &self.backend
    }

    pub fn get(&self, id: &str) -> Option<Arc<LiveKernel>> {
        self.lock().live.get(id).cloned()
    }

    pub fn list(&self) -> Vec<Arc<LiveKernel>> {
        let mut all: Vec<_> = self.lock().live.values().cloned().collect();
        all.sort_by(|a, b| a.id().cmp(b.id()));
        all
    }

    /// Starts the background work: warm pool, culling, and removal of containers left
    /// behind by an earlier run of the gateway.
    pub async fn start(self: &Arc<Self>) {
        self.remove_leftovers().await;
        let me = self.clone();
        self.tracker.spawn(async move { me.fill_pool().await });
        if let Some(idle) = self.settings.cull_idle_timeout {
            let me = self.clone();
            self.tracker.spawn(async move { me.cull(idle).await });
        }
    }

    /// Kernels of an earlier run of this gateway (same runtime directory) that still run
    /// are adopted again with their state; the rest are removed.
    async fn remove_leftovers(self: &Arc<Self>) {
        let found = match self.backend.list().await {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list kernel containers");
                return;
            }
        };
        for f in found {
            if let (true, Some(connection)) = (f.running, f.connection.clone()) {
                match self.adopt(&f, connection).await {
                    Ok(()) => {
                        tracing::info!(kernel = %f.kernel_id, "re-adopted kernel left by an earlier run");
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(kernel = %f.kernel_id, error = %e, "cannot re-adopt kernel")
                    }
                }
            }
            tracing::info!(kernel = %f.kernel_id, "removing kernel container left by an earlier run");
            if let Err(e) = self.backend.remove(&f.handle).await {
                tracing::warn!(kernel = %f.kernel_id, error = %e, "cannot remove leftover container");
            }
        }
    }

    async fn adopt(
        self: &Arc<Self>,
        found: &Found,
        connection: ConnectionInfo,
    ) -> Result<(), CreateError> {
        if self.lock().live.len() >= self.settings.max_kernels {
            return Err(CreateError::TooMany {
                max: self.settings.max_kernels,
            });
        }
        let name = if found.kernel_name.is_empty() {
            KERNEL_NAME
        } else {
            &found.kernel_name
        };
        let live = self
            .connect_kernel(
                &found.kernel_id,
                name,
                found.handle.clone(),
                connection,
                Duration::from_secs(10),
            )
            .await?;
        self.lock().live.insert(live.id().to_owned(), live);
        Ok(())
    }

    /// Creates a kernel: checks the spec, environment and limit, then takes one from the
    /// warm pool or starts one, and waits until it answers.
    pub async fn create(
        self: &Arc<Self>,
        name: Option<&str>,
        env: &BTreeMap<String, String>,
    ) -> Result<Arc<LiveKernel>, CreateError> {
        let name = name.filter(|n| !n.is_empty()).unwrap_or(KERNEL_NAME);
        if name != KERNEL_NAME {
            return Err(CreateError::NoSuchSpec(name.to_owned()));
        }
        let env = kernel_env(env)?;
        {
            let mut t = self.lock();
            if t.live.len() + t.reserved >= self.settings.max_kernels {
                return Err(CreateError::TooMany {
                    max: self.settings.max_kernels,
                });
            }
            t.reserved += 1;
        }
        let result = self.obtain(name, env).await;
        let mut t = self.lock();
        t.reserved -= 1;
        let live = result?;
        t.live.insert(live.id().to_owned(), live.clone());
        Ok(live)
    }

    async fn obtain(
        self: &Arc<Self>,
        name: &str,
        env: BTreeMap<String, String>,
    ) -> Result<Arc<LiveKernel>, CreateError> {
        let poolable = env.keys().all(|k| GATEWAY_HINTS.contains(&k.as_str()));
        if poolable {
            let pooled = self.lock().pool.pop_front();
            self.pool_wanted.notify_one();
            if let Some(live) = pooled {
                if live.kernel.execution_state() != ExecutionState::Dead {
                    live.kernel.touch();
                    return Ok(live);
                }
                if let Err(e) = self.discard(&live).await {
                    tracing::warn!(kernel = %live.id(), error = %e, "cannot remove dead pooled kernel");
                }
            }
        }
        self.launch(name, env, false).await
    }

    /// Starts a kernel, waits until it answers, and starts watching it.
    async fn launch(
        self: &Arc<Self>,
        name: &str,
        env: BTreeMap<String, String>,
        preload: bool,
    ) -> Result<Arc<LiveKernel>, CreateError> {
        let id = uuid::Uuid::new_v4().to_string();
        let req = LaunchRequest {
            kernel_id: id.clone(),
            kernel_name: name.to_owned(),
            env,
            preload,
        };
        let Launched { handle, connection } = self.backend.launch(&req).await?;
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
    async fn connect_kernel(
        self: &Arc<Self>,
        id: &str,
        name: &str,
        handle: String,
        connection: ConnectionInfo,
        timeout: Duration,
    ) -> Result<Arc<LiveKernel>, CreateError> {
        let kernel = Kernel::new(id, self.settings.limits);
        let cancel = self.cancel.child_token();
        // Shutdown may come while this kernel starts: it must not outlive the gateway.
        let connected = tokio::select! {
            // A child token: closing this process's link must not cancel the watcher.
            r = kernel.connect(&connection, &self.tracker, cancel.child_token(), timeout) => {
                r.map_err(CreateError::from)
            }
            _ = self.cancel.cancelled() => Err(CreateError::ShuttingDown),
        };
        if let Err(e) = connected {
            cancel.cancel();
            kernel.disconnect();
            return Err(e);
        }
        let live = Arc::new(LiveKernel {
            kernel,
            name: name.to_owned(),
            handle,
            connection,
            ops: tokio::sync::Mutex::new(()),
            epoch: AtomicU64::new(0),
            runs: tokio::sync::Mutex::new(()),
            cancel,
        });
        self.watch(&live);
        Ok(live)
    }

    /// Keeps `pool_size` kernels started, with libraries imported, ready to hand out.
    async fn fill_pool(self: Arc<Self>) {
        let mut failures = 0u32;
        loop {
            let missing = self
                .settings
                .pool_size
                .saturating_sub(self.lock().pool.len());
            if missing == 0 {
                tokio::select! {
                    _ = self.cancel.cancelled() => return,
                    _ = self.pool_wanted.notified() => continue,
                }
            }
            // Not raced against shutdown: `launch` cleans up after itself when cancelled,
            // where dropping it halfway would leave a container behind.
            let launched = self.launch(KERNEL_NAME, BTreeMap::new(), true).await;
            if self.cancel.is_cancelled() {
                if let Ok(live) = launched {
                    if let Err(e) = self.discard(&live).await {
                        tracing::warn!(kernel = %live.id(), error = %e, "cannot remove pooled kernel at shutdown");
                    }
                }
                return;
            }
            match launched {
                Ok(live) => {
                    failures = 0;
                    self.lock().pool.push_back(live);
                }
                Err(e) => {
                    failures += 1;
                    let wait = Duration::from_secs(5 * u64::from(failures.min(12)));
                    tracing::warn!(error = %e, retry_in = ?wait, "cannot fill the warm pool");
                    tokio::select! {
                        _ = self.cancel.cancelled() => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }

    /// Restarts a kernel's process: state is cleared, the id and connections stay.
    pub async fn restart(&self, live: &LiveKernel) -> Result<(), CreateError> {
        let _ops = live.ops.lock().await;
        live.epoch.fetch_add(1, Ordering::SeqCst);
        self.restart_locked(live, false).await
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

    pub async fn interrupt(&self, live: &LiveKernel) -> Result<(), BackendError> {
        self.backend.interrupt(&live.handle).await
    }

    /// Shuts a kernel down: gone from the table at once, clients told `dead` and
    /// disconnected, container and sockets removed.
    pub async fn delete(&self, id: &str) -> Option<Result<(), BackendError>> {
        let live = self.lock().live.remove(id)?;
        self.pool_wanted.notify_one();
        Some(self.discard(&live).await)
    }

    async fn discard(&self, live: &LiveKernel) -> Result<(), BackendError> {
        live.cancel.cancel();
        live.kernel.set_state(ExecutionState::Dead, true);
        live.kernel.disconnect();
        live.kernel.close_clients();
        self.backend.remove(&live.handle).await
    }

    /// Removes every kernel, pooled ones included (graceful shutdown).
    pub async fn shutdown(&self) {
        let all: Vec<Arc<LiveKernel>> = {
            let mut t = self.lock();
            let mut all: Vec<_> = t.live.drain().map(|(_, v)| v).collect();
            all.extend(t.pool.drain(..));
            all
        };
        let removals = all.iter().map(|live| self.discard(live));
        for (live, result) in all.iter().zip(futures::future::join_all(removals).await) {
            if let Err(e) = result {
                tracing::warn!(kernel = %live.id(), error = %e, "cannot remove kernel at shutdown");
            }
        }
    }

    /// Watches one kernel for death: process exit (noticed at once) or a heartbeat that
    /// stops answering. A dead kernel is restarted when autorestart is on.
    fn watch(self: &Arc<Self>, live: &Arc<LiveKernel>) {
        let me = self.clone();
        let live = live.clone();
        self.tracker.spawn(async move {
            let cancel = live.cancel.clone();
            tokio::select! {
                _ = cancel.cancelled() => {}
                _ = me.watch_loop(&live) => {}
            }
        });
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
        let mut misses = 0;
        while misses < HEARTBEAT_MISSES {
            tokio::time::sleep(HEARTBEAT_EVERY).await;
            if heartbeat::probe(connection, HEARTBEAT_TIMEOUT).await {
                misses = 0;
            } else {
                misses += 1;
            }
        }
    }

    /// Shuts down kernels with no connection that were not busy for `idle`.
    async fn cull(self: Arc<Self>, idle: Duration) {
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
                if let Some(Err(e)) = self.delete(&id).await {
                    tracing::warn!(kernel = %id, error = %e, "cannot remove culled kernel");
                }
            }
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_keeps_only_kernel_vars() {
        let env: BTreeMap<String, String> = [
            ("KERNEL_WORKING_DIR", "/home/me"),
            ("PATH", "/evil"),
            ("LD_PRELOAD", "x.so"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let kept = kernel_env(&env).expect("valid");
        assert_eq!(kept.keys().collect::<Vec<_>>(), ["KERNEL_WORKING_DIR"]);
        let bad: BTreeMap<String, String> = [("KERNEL_x;rm".to_owned(), "1".to_owned())].into();
        assert!(matches!(kernel_env(&bad), Err(CreateError::BadEnv { .. })));
    }
}
