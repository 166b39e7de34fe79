//! The warm pool: kernels started ahead of time, with the common libraries imported, and
//! handed out by create. A pooled kernel is given the create's `KERNEL_*` environment
//! before anyone can attach to it, so it sees what a kernel started for the request would.

use super::{Kernels, Limits, LiveKernel};
use crate::metrics;
use kernelgate_protocol::content::{ExecuteRequest, ExecutionState};
use kernelgate_protocol::{Channel, Execution, RawJson};
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

impl Kernels {
    /// A kernel from the pool with `env` set in it, if the pool has one and the
    /// environment can be given to it (only the gateway hints can be: other variables may
    /// be read while Python starts, so their kernels start cold).
    pub(super) async fn take_pooled(
        self: &Arc<Self>,
        spec: &str,
        env: &BTreeMap<String, String>,
    ) -> Option<Arc<LiveKernel>> {
        if !warm_can_take(env) {
            return None;
        }
        let pooled = self.lock().pool.get_mut(spec).and_then(VecDeque::pop_front);
        self.pool_wanted.notify_waiters();
        let live = pooled?;
        if live.relay.execution_state() != ExecutionState::Dead {
            match self.set_env(&live, env).await {
                Ok(()) => {
                    live.relay.touch();
                    return Some(live);
                }
                Err(why) => {
                    tracing::warn!(kernel = %live.id(), %why, "pooled kernel did not take its environment")
                }
            }
        }
        if let Err(e) = self.discard(&live).await {
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
        let mut request = ExecuteRequest::new(&format!(
            "__import__('os').environ.update(__import__('json').loads({literal}))"
        ));
        request.silent = true;
        request.store_history = false;
        request.allow_stdin = false;
        let me = live.relay.attach(
            &format!("kernelgate-env-{}", uuid::Uuid::new_v4()),
            true,
            crate::relay::GATEWAY_KEY,
        );
        let message = live
            .relay
            .request("execute_request", RawJson::from_value(&request));
        let mut execution = Execution::new(message.msg_id());
        me.send(Channel::Shell, message)
            .await
            .map_err(|e| e.to_string())?;
        let deadline = tokio::time::Instant::now() + SET_ENV_TIMEOUT;
        while !execution.is_done() {
            let batch = tokio::time::timeout_at(deadline, me.recv())
                .await
                .map_err(|_| format!("no answer within {SET_ENV_TIMEOUT:?}"))?
                .ok_or("session closed")?;
            for out in batch {
                execution.feed(out.channel, &out.message);
            }
        }
        match execution.reply() {
            Some(r) if r.status == "ok" => Ok(()),
            Some(r) => Err(format!("{}: {}", r.ename, r.evalue)),
            None => Err("the kernel went away".into()),
        }
    }

    /// Adds a warm kernel to the spec's pool, unless shutdown began (false): checked under
    /// the lock that shutdown's final sweep takes after the cancellation, so the kernel is
    /// either swept or never pooled.
    pub(super) fn pool_add(&self, spec: &str, live: &Arc<LiveKernel>) -> bool {
        let mut t = self.lock();
        if self.cancel.is_cancelled() {
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
    pub(super) async fn fill_pool(self: Arc<Self>, spec: String, size: usize) {
        let mut failures = 0u32;
        loop {
            // Registered before the count is read, so a take in between is not missed.
            let wanted = self.pool_wanted.notified();
            tokio::pin!(wanted);
            wanted.as_mut().enable();
            let ready = self.lock().pool.get(&spec).map_or(0, VecDeque::len);
            if ready >= size {
                tokio::select! {
                    _ = self.cancel.cancelled() => return,
                    _ = wanted => continue,
                }
            }
            // Not raced against shutdown: `launch` cleans up after itself when cancelled,
            // where dropping it halfway would leave a container behind.
            match self
                .launch(&spec, BTreeMap::new(), true, None, Limits::default())
                .await
            {
                Ok(live) => {
                    if !self.pool_add(&spec, &live) {
                        if let Err(e) = self.discard(&live).await {
                            tracing::warn!(kernel = %live.id(), error = %e, "cannot remove pooled kernel at shutdown");
                        }
                        return;
                    }
                    failures = 0;
                    metrics::pool_refilled();
                }
                Err(_) if self.cancel.is_cancelled() => return,
                Err(e) => {
                    failures += 1;
                    let wait = Duration::from_secs(5 * u64::from(failures.min(12)));
                    tracing::warn!(%spec, error = %e, retry_in = ?wait, "cannot fill the warm pool");
                    tokio::select! {
                        _ = self.cancel.cancelled() => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }
}
