//! The E2B-compatible surface (docs/e2b.md): E2B's SDKs, unmodified, pointed at the gateway
//! with `E2B_API_URL` and `E2B_SANDBOX_URL` (or a wildcard host `<port>-<id>.<domain>`).
//!
//! A sandbox is a kernel of the table (its id is the kernel's id); this module keeps only
//! what E2B adds to it ([`Sandboxes`]: template, metadata, end of life, code contexts) and
//! maps E2B's calls onto the gateway's own paths: creates through [`crate::kernels::Kernels`],
//! runs through [`crate::kernels::runner`], files through [`crate::kernels::files`].
//!
//! - [`control`]: the control plane (`X-API-KEY`): create, list, info, kill, timeout.
//! - [`snapshots`]: snapshots and forks of sandboxes, onto the gateway's own.
//! - [`pause`]: pause and resume, onto hibernation.
//! - [`plane`]: finds the sandbox a sandbox-plane request is for, and its access token.
//! - [`interpreter`]: the code interpreter's `/execute` and `/contexts` (port 49999).
//! - [`envd`]: envd's `/health`, `/files` and the `filesystem.Filesystem` RPC (port 49983).
//! - [`process`]: envd's `process.Process` RPC: commands and terminals.
//! - [`connect`]: Connect RPC's errors and stream framing.
//! - [`watch`]: envd's directory watching (`WatchDir`, the polling watchers).
//! - [`store`]: the token key and the sandboxes' records in the runtime directory.

pub mod connect;
pub mod control;
pub mod envd;
pub mod interpreter;
pub mod pause;
pub mod plane;
pub mod process;
pub mod snapshots;
pub mod store;
pub mod watch;

use super::AppState;
use crate::kernels::hibernate::HibernateError;
use crate::kernels::Removal;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The envd version the gateway's answers claim: the newest protocol variants the SDK
/// knows (octet-stream uploads, default user, file metadata), which are the ones served.
pub const ENVD_VERSION: &str = "0.6.4";

/// How soon a sandbox whose timeout pauses it is tried again when it ran code, and when its
/// state could not be saved.
const PAUSE_RETRY_BUSY: Duration = Duration::from_secs(5);
const PAUSE_RETRY: Duration = Duration::from_secs(60);

/// What E2B adds to a kernel that is a sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sandbox {
    pub template_id: String,
    pub metadata: BTreeMap<String, String>,
    pub started_at: DateTime<Utc>,
    /// When it ends unless `set_timeout` moves it.
    pub end_at: DateTime<Utc>,
    /// Code contexts besides the default one, by id.
    pub contexts: BTreeMap<String, interpreter::Context>,
    /// The contexts whose namespace a run has made in the kernel: one of these that the
    /// kernel no longer has was emptied (a hibernation, a kernel restart), and its next run
    /// says so.
    #[serde(default)]
    pub contexts_run: BTreeSet<String>,
    /// Its timeout pauses it rather than ending it (`lifecycle` `on_timeout: pause`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pause_on_timeout: bool,
}

/// A create by idempotency key: locked while it runs, then the sandbox it made.
type CreateSlot = Arc<tokio::sync::Mutex<Option<String>>>;

/// The sandboxes of this gateway, and the key their access tokens are made with.
#[derive(Debug)]
pub struct Sandboxes {
    token_key: [u8; 32],
    /// By kernel id. An entry whose kernel is gone (deleted through another API) is
    /// dropped when next seen.
    live: Mutex<HashMap<String, Sandbox>>,
    /// Where `live` is kept across a restart of the gateway; none: in memory only.
    records: Option<store::Records>,
    /// Creates by (key, `Idempotency-Key`): the SDK retries a create that failed in
    /// transit, and the retry must get the same sandbox.
    creates: Mutex<HashMap<(String, String), CreateSlot>>,
    /// Wakes the expiry watchers when a timeout was moved.
    moved: tokio::sync::Notify,
    /// The commands running in them.
    pub processes: process::Processes,
    /// The directories watched in them.
    pub watchers: Arc<watch::Watchers>,
}

impl Default for Sandboxes {
    /// In memory, with a random token key: for a gateway with no runtime directory of its
    /// own to keep them in (the OpenAPI document's, tests').
    fn default() -> Self {
        Sandboxes::with(rand::random(), None, HashMap::new())
    }
}

impl Sandboxes {
    fn with(
        token_key: [u8; 32],
        records: Option<store::Records>,
        live: HashMap<String, Sandbox>,
    ) -> Sandboxes {
        Sandboxes {
            token_key,
            live: Mutex::new(live),
            records,
            creates: Mutex::default(),
            moved: tokio::sync::Notify::new(),
            processes: process::Processes::default(),
            watchers: Arc::default(),
        }
    }

    /// The sandboxes kept in `runtime_dir` by an earlier run (their kernels re-adopted or
    /// not: [`watch_all`] drops those without one), with tokens under `token_key`: derived
    /// from the cluster secret on a node of a cluster, else [`store::token_key`]'s.
    pub fn open(
        token_key: [u8; 32],
        runtime_dir: &std::path::Path,
    ) -> Result<Sandboxes, store::StoreError> {
        let records = store::Records::in_dir(runtime_dir);
        let live = records.load()?;
        Ok(Sandboxes::with(token_key, Some(records), live))
    }

    /// The access token of sandbox `id`.
    pub fn token(&self, id: &str) -> String {
        kernelgate_protocol::e2b::access_token(&self.token_key, id)
    }

    pub fn token_matches(&self, id: &str, token: &str) -> bool {
        kernelgate_protocol::e2b::token_matches(&self.token_key, id, token)
    }

    /// Changes the sandboxes with `f`, then keeps them (under the lock, so the file never
    /// goes back to an older state). A failed write is logged: the sandboxes still work,
    /// they do not outlive a restart of the gateway.
    fn change<T>(&self, f: impl FnOnce(&mut HashMap<String, Sandbox>) -> T) -> T {
        let mut live = self.lock();
        let out = f(&mut live);
        if let Some(records) = &self.records {
            if let Err(e) = records.save(&live) {
                tracing::warn!(error = %e, "cannot keep the E2B sandboxes' records: they will not outlive a restart of the gateway");
            }
        }
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Sandbox>> {
        self.live.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn insert(&self, id: &str, sandbox: Sandbox) {
        self.change(|live| live.insert(id.to_owned(), sandbox));
    }

    pub fn get(&self, id: &str) -> Option<Sandbox> {
        self.lock().get(id).cloned()
    }

    pub fn remove(&self, id: &str) -> Option<Sandbox> {
        if !self.lock().contains_key(id) {
            return None;
        }
        self.change(|live| live.remove(id))
    }

    pub fn ids(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Changes sandbox `id` with `f`; `None` when it is not a sandbox.
    pub fn update<T>(&self, id: &str, f: impl FnOnce(&mut Sandbox) -> T) -> Option<T> {
        if !self.lock().contains_key(id) {
            return None;
        }
        self.change(|live| live.get_mut(id).map(f))
    }

    /// Moves sandbox `id`'s end to `end_at`.
    pub fn set_end(&self, id: &str, end_at: DateTime<Utc>) -> bool {
        let found = self.update(id, |s| s.end_at = end_at).is_some();
        self.moved.notify_waiters();
        found
    }

    /// The slot of a create with this idempotency key (held while the create runs).
    fn create_slot(&self, key: &str, idempotency: &str) -> CreateSlot {
        let mut creates = self.creates.lock().unwrap_or_else(|e| e.into_inner());
        // Forget keys whose sandbox is gone: the map does not grow without bound.
        let live = self.lock();
        creates.retain(|_, slot| match slot.try_lock() {
            Ok(done) => done.as_ref().is_some_and(|id| live.contains_key(id)),
            Err(_) => true,
        });
        drop(live);
        creates
            .entry((key.to_owned(), idempotency.to_owned()))
            .or_default()
            .clone()
    }
}

/// Watches every sandbox's end: at start, for those an earlier run kept (a sandbox whose
/// kernel did not come back is dropped).
pub fn watch_all(state: &AppState) {
    for id in state.e2b.ids() {
        watch_expiry(state, id);
    }
}

/// Ends sandbox `id` when its time is up, however often `set_timeout` moves that time, or
/// pauses it when its `lifecycle` says so (a paused one is kept until a connect resumes it);
/// done when the sandbox is gone or the gateway stops.
fn watch_expiry(state: &AppState, id: String) {
    let state = state.clone();
    let cancel = state.cancel.clone();
    state.tracker.clone().spawn(async move {
        loop {
            // Made before the end is read: a move after the read still wakes it.
            let moved = state.e2b.moved.notified();
            let Some((end_at, pause_on_timeout)) = state
                .e2b
                .get(&id)
                .map(|s| (s.end_at, s.pause_on_timeout))
            else {
                return;
            };
            if state.kernels.get(&id).is_none() {
                state.e2b.remove(&id);
                return;
            }
            let left = (end_at - Utc::now()).to_std().unwrap_or(Duration::ZERO);
            let paused = state.kernels.get(&id).is_some_and(|l| l.hibernated());
            if left.is_zero() && paused {
                // A paused sandbox is kept until a connect resumes it (and moves its end)
                // or it is killed, as E2B keeps one.
                tokio::select! {
                    () = moved => {}
                    () = cancel.cancelled() => return,
                }
                continue;
            }
            if left.is_zero() && pause_on_timeout {
                let Some(live) = state.kernels.get(&id) else {
                    continue;
                };
                // Kept running until it can be paused: its state is never dropped.
                let retry = match state.kernels.hibernation().hibernate(&live).await {
                    Ok(()) => {
                        tracing::info!(kernel = %id, "the E2B sandbox's timeout passed; paused it");
                        continue;
                    }
                    Err(HibernateError::Busy(why)) => {
                        tracing::info!(kernel = %id, %why, "the E2B sandbox's timeout passed while it runs code; pausing it once it is idle");
                        PAUSE_RETRY_BUSY
                    }
                    Err(e) => {
                        tracing::warn!(kernel = %id, error = %e, "the E2B sandbox's timeout passed but it cannot be paused; it runs on, and pausing is tried again");
                        PAUSE_RETRY
                    }
                };
                tokio::select! {
                    () = tokio::time::sleep(retry) => {}
                    () = moved => {}
                    () = cancel.cancelled() => return,
                }
                continue;
            }
            if left.is_zero() {
                tracing::info!(kernel = %id, "the E2B sandbox's timeout passed; ending it");
                state.e2b.remove(&id);
                let why = Removal::Because("its E2B sandbox timeout passed".into());
                if let Some(Err(e)) = state.kernels.delete(&id, why).await {
                    tracing::warn!(kernel = %id, error = %e, "cannot remove an expired sandbox's container");
                }
                return;
            }
            tokio::select! {
                () = tokio::time::sleep(left) => {}
                () = moved => {}
                () = cancel.cancelled() => return,
            }
        }
    });
}
