//! The warm pool: kernels started ahead of time, with the common libraries imported, and
//! handed out by create. A pooled kernel is given the create's `KERNEL_*` environment
//! before anyone can attach to it, so it sees what a kernel started for the request would.

use super::{Kernels, Limits, LiveKernel};
use crate::backend::Found;
use crate::metrics;
use crate::relay::lifecycle::Event;
use crate::silent::{self, Unanswered};
use kernelgate_protocol::content::ExecutionState;
use kernelgate_protocol::ConnectionInfo;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

/// `KERNEL_*` variables that are hints for a gateway (sent by JupyterLab), not settings
/// for the kernel; a request carrying only these can be served from the warm pool.
pub(super) const GATEWAY_HINTS: [&str; 3] = [
    "KERNEL_LAUNCH_TIMEOUT",
    "KERNEL_WORKING_DIR",
    "KERNEL_USERNAME",
];

/// Whether a warm kernel can be given `env` (only the gateway hints can be: other
/// variables may be read while Python starts, so their kernels start cold).
pub(super) fn warm_can_take(env: &BTreeMap<String, String>) -> bool {
    env.keys().all(|k| GATEWAY_HINTS.contains(&k.as_str()))
}

/// How long a pooled kernel may take to set its environment.
const SET_ENV_TIMEOUT: Duration = Duration::from_secs(10);

/// The warm pools of the table, one per spec with a pool size.
#[derive(Debug, Clone)]
pub struct Pool {
    kernels: Arc<Kernels>,
}

impl Pool {
    pub(super) fn new(kernels: &Arc<Kernels>) -> Self {
        Pool {
            kernels: kernels.clone(),
        }
    }

    /// A kernel from the pool with `env` set in it, if the pool has one and the
    /// environment can be given to it (only the gateway hints can be: other variables may
    /// be read while Python starts, so their kernels start cold).
    pub(super) async fn take(
        &self,
        spec: &str,
        env: &BTreeMap<String, String>,
    ) -> Option<Arc<LiveKernel>> {
        if !warm_can_take(env) {
            return None;
        }
        let pooled = self
            .kernels
            .lock()
            .pool
            .get_mut(spec)
            .and_then(VecDeque::pop_front);
        self.kernels.pool_wanted.notify_waiters();
        let live = pooled?;
        if live.relay.execution_state() != ExecutionState::Dead {
            match self.set_env(&live, env).await {
                Ok(()) => {
                    live.relay.touch(chrono::Utc::now());
                    return Some(live);
                }
                Err(why) => {
                    tracing::warn!(kernel = %live.id(), %why, "pooled kernel did not take its environment")
                }
            }
        }
        if let Err(e) = self.kernels.discard(&live).await {
            tracing::warn!(kernel = %live.id(), error = %e, "cannot remove pooled kernel");
        }
        None
    }

    /// Sets `env` in the kernel's `os.environ` with a silent execute: no execution count
    /// is used and, as no client is attached yet, nobody sees its messages.
    async fn set_env(
        &self,
        live: &LiveKernel,
        env: &BTreeMap<String, String>,
    ) -> Result<(), String> {
        if env.is_empty() {
            return Ok(());
        }
        let json = serde_json::to_string(env).map_err(|e| e.to_string())?;
        // A JSON string literal is a Python string literal too (serde_json escapes no `/`).
        let literal = serde_json::to_string(&json).map_err(|e| e.to_string())?;
        let code = format!("__import__('os').environ.update(__import__('json').loads({literal}))");
        let session = live.relay.attach(
            &format!("kernelgate-env-{}", uuid::Uuid::new_v4()),
            true,
            crate::relay::GATEWAY_KEY,
        );
        match silent::execute(&session, &code, SET_ENV_TIMEOUT).await {
            Ok(answer) => match silent::raised(&answer) {
                None => Ok(()),
                Some((ename, evalue)) => Err(format!("{ename}: {evalue}")),
            },
            Err(Unanswered::NotSent(e)) => Err(e),
            Err(Unanswered::TimedOut(_)) => Err(format!("no answer within {SET_ENV_TIMEOUT:?}")),
            Err(Unanswered::Gone) => Err("the kernel went away".into()),
        }
    }

    /// Adds a warm kernel to the spec's pool, unless shutdown began (false): checked under
    /// the lock that shutdown's final sweep takes after the cancellation, so the kernel is
    /// either swept or never pooled.
    pub(super) fn add(&self, spec: &str, live: &Arc<LiveKernel>) -> bool {
        let mut t = self.kernels.lock();
        if self.kernels.cancel.is_cancelled() {
            return false;
        }
        t.pool
            .entry(spec.to_owned())
            .or_default()
            .push_back(live.clone());
        true
    }

    /// Keeps the spec's pool size of kernels started, with libraries imported, ready to
    /// hand out. One such task runs per spec with a pool.
    pub(super) async fn keep_filled(self, spec: String, size: usize) {
        let mut failures = 0u32;
        loop {
            // Registered before the count is read, so a take in between is not missed.
            let wanted = self.kernels.pool_wanted.notified();
            tokio::pin!(wanted);
            wanted.as_mut().enable();
            let ready = self.kernels.lock().pool.get(&spec).map_or(0, VecDeque::len);
            if ready >= size {
                tokio::select! {
                    _ = self.kernels.cancel.cancelled() => return,
                    _ = wanted => continue,
                }
            }
            // Not raced against shutdown: `launch` cleans up after itself when cancelled,
            // where dropping it halfway would leave a container behind.
            match self
                .kernels
                .launch(&spec, BTreeMap::new(), true, None, Limits::default())
                .await
            {
                Ok(live) => {
                    if !self.add(&spec, &live) {
                        if let Err(e) = self.kernels.discard(&live).await {
                            tracing::warn!(kernel = %live.id(), error = %e, "cannot remove pooled kernel at shutdown");
                        }
                        return;
                    }
                    failures = 0;
                    metrics::pool_refilled();
                }
                Err(_) if self.kernels.cancel.is_cancelled() => return,
                Err(e) => {
                    failures += 1;
                    let wait = Duration::from_secs(5 * u64::from(failures.min(12)));
                    tracing::warn!(%spec, error = %e, retry_in = ?wait, "cannot fill the warm pool");
                    tokio::select! {
                        _ = self.kernels.cancel.cancelled() => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }

    /// Warm kernels ready in all pools, and how many they should hold.
    pub fn fill(&self) -> (usize, usize) {
        let ready = self.kernels.lock().pool.values().map(VecDeque::len).sum();
        (ready, self.kernels.settings.specs.pool_target())
    }

    /// Removes the warm kernels of every pool (a cluster node that stops: they are
    /// nobody's, and a node that does not return would leave them running).
    pub async fn remove_warm(&self) {
        let warm: Vec<_> = self
            .kernels
            .lock()
            .pool
            .drain()
            .flat_map(|(_, p)| p)
            .collect();
        let removals = warm.iter().map(|live| self.kernels.discard(live));
        for (live, result) in warm.iter().zip(futures::future::join_all(removals).await) {
            if let Err(e) = result {
                tracing::warn!(kernel = %live.id(), error = %e, "cannot remove a warm kernel at shutdown");
            }
        }
    }

    /// Puts a warm kernel of an earlier run back into its pool, if it fits: its spec still
    /// has a pool with room, runs the same image, and the kernel was made with the limits
    /// in force.
    pub(super) async fn repool(&self, found: &Found, connection: ConnectionInfo) -> bool {
        let spec = match self.kernels.settings.specs.get(&found.kernel_name) {
            Some(spec) if spec.pool_size > 0 => spec,
            _ => return false,
        };
        let room = self
            .kernels
            .lock()
            .pool
            .get(&spec.name)
            .map_or(0, VecDeque::len)
            < spec.pool_size;
        if !(room && found.current && found.image == spec.image) {
            tracing::info!(kernel = %found.kernel_id, "a warm kernel of an earlier run does not fit the configuration");
            return false;
        }
        let name = spec.name.clone();
        match self
            .kernels
            .connect_kernel(
                &found.kernel_id,
                &name,
                found.handle.clone(),
                connection,
                Duration::from_secs(10),
            )
            .await
        {
            Ok(live) if self.add(&name, &live) => {
                tracing::info!(kernel = %found.kernel_id, "a warm kernel of an earlier run is back in the pool");
                true
            }
            Ok(live) => {
                live.cancel.cancel();
                let _ = live.relay.step(Event::Unlinked).await;
                false
            }
            Err(e) => {
                tracing::warn!(kernel = %found.kernel_id, error = %e, "cannot take back a warm kernel");
                false
            }
        }
    }
}
