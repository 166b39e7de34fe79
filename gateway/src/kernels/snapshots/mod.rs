//! Snapshots: a kernel's state kept under an id (and a name, unique per key), for new
//! kernels to start from, and forks: one snapshot, N kernels started from it
//! (docs/snapshots.md).
//!
//! A snapshot is what hibernation keeps, taken while the kernel runs on: under an engine
//! that checkpoints, the whole kernel (`memory`: generators, threads and all); otherwise
//! what the kernel's helper can pickle (`namespace`), or only the home's files
//! (`filesystem`). Each lives in `--hibernate-dir/snapshots/<id>`, committed as a
//! hibernated state is (written to a private temporary directory, synced, renamed), with
//! its record in `snapshot.json`, so it outlives its source kernel and the gateway. A
//! snapshot being used (a create from it) is deleted from disk only when the create is
//! done with it.

use super::hibernate::{forget, forget_if_stale, HibernateError, Kind};
use super::Kernels;
use crate::audit::Record;
use chrono::{DateTime, Utc};
use kernelgate_protocol::rest::SnapshotModel;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

mod start;
mod take;
pub use start::{ForkOutcome, Forked};
pub use take::TakeRequest;

/// The directory, under `--hibernate-dir`, of every snapshot.
pub(in crate::kernels) const SNAPSHOTS: &str = "snapshots";
/// A snapshot's record, in its directory.
const RECORD: &str = "snapshot.json";
/// The most forks one request may start.
pub const MAX_FORKS: usize = 20;
/// Names: what a key calls a snapshot.
const MAX_NAME: usize = 128;
/// Metadata: at most this many entries, each key and value at most this long.
const MAX_METADATA: usize = 32;
const MAX_METADATA_TEXT: usize = 256;

/// What a snapshot keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotKind {
    /// The whole kernel, as the engine's checkpoint holds it.
    Memory,
    /// The variables the kernel's helper could pickle, and the home's files.
    Namespace,
    /// The home's files only.
    Filesystem,
}

impl SnapshotKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotKind::Memory => "memory",
            SnapshotKind::Namespace => "namespace",
            SnapshotKind::Filesystem => "filesystem",
        }
    }
}

impl From<Kind> for SnapshotKind {
    fn from(kind: Kind) -> Self {
        match kind {
            Kind::Memory => SnapshotKind::Memory,
            Kind::Namespace => SnapshotKind::Namespace,
        }
    }
}

/// What a caller asks a snapshot to keep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Everything the engine can keep: the whole kernel, or its namespace and files.
    #[default]
    Full,
    /// The home's files only.
    Filesystem,
}

/// A snapshot, as its record on disk and the API show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub id: String,
    pub name: Option<String>,
    pub metadata: BTreeMap<String, String>,
    /// The key that took it.
    pub owner: String,
    /// The kernel it was taken of (which may be gone).
    pub kernel: String,
    /// That kernel's spec: what a kernel started from it runs.
    pub spec: String,
    pub kind: SnapshotKind,
    pub bytes: u64,
    pub created: DateTime<Utc>,
    /// The source's environment, which a kernel restored from a `memory` snapshot has.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Variables or files a lossy snapshot left out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dropped: Vec<String>,
    /// A fork's own: not listed, not counted, removed once its forks run.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hidden: bool,
}

impl Snapshot {
    /// Its model, as the API and MCP show it.
    pub fn model(&self) -> SnapshotModel {
        SnapshotModel {
            id: self.id.clone(),
            name: self.name.clone(),
            metadata: self.metadata.clone(),
            kernel_id: self.kernel.clone(),
            kernelspec: self.spec.clone(),
            kind: self.kind.as_str().to_owned(),
            size: self.bytes,
            created: self
                .created
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            dropped: self.dropped.clone(),
        }
    }
}

impl Mode {
    /// The mode a caller names: `full` (or none) or `filesystem`.
    pub fn parse(name: Option<&str>) -> Result<Mode, SnapshotError> {
        match name {
            None | Some("full") => Ok(Mode::Full),
            Some("filesystem") => Ok(Mode::Filesystem),
            Some(other) => Err(SnapshotError::Invalid(format!(
                "mode {other:?}: `full` (everything the engine can keep) or `filesystem` (the home's files)"
            ))),
        }
    }
}

/// Why a snapshot could not be taken, found or used.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The request is not one a snapshot can be taken or used for.
    #[error("{0}")]
    Invalid(String),
    /// No snapshot of that id or name for the caller.
    #[error("no snapshot {0:?}; GET /api/kernelgate/snapshots lists yours")]
    NotFound(String),
    /// Its state cannot be kept as asked (variables by name, a budget); the source runs on.
    #[error("{0}")]
    Refused(String),
    /// The kernel is busy (or sealed for another snapshot).
    #[error("the kernel is busy: {0}; take the snapshot when its cell has ended")]
    Busy(String),
    /// Taking it failed; the message says what became of the source.
    #[error("the snapshot failed: {0}")]
    Failed(String),
}

impl From<HibernateError> for SnapshotError {
    fn from(e: HibernateError) -> Self {
        match e {
            HibernateError::Busy(why) => SnapshotError::Busy(why),
            HibernateError::Blocked(why) | HibernateError::Full(why) => {
                SnapshotError::Refused(snapshot_wording(&why))
            }
            HibernateError::Failed(why) => SnapshotError::Failed(why),
        }
    }
}

/// The kernel's helper and the home's filter word their refusals for hibernation; a
/// snapshot's way around them is `accept_loss`.
fn snapshot_wording(why: &str) -> String {
    why.replace(
        "delete them or hibernate with --hibernate-lossy",
        "delete them, or take the snapshot with \"accept_loss\": true (what cannot be saved is left out)",
    )
}

/// What governs snapshots, from the configuration.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Snapshots one key may keep, unless its keys-file entry says otherwise
    /// (`--snapshots-per-key`).
    pub per_key: usize,
    /// Bytes one key's snapshots may take together (`--snapshot-key-max-mb`).
    pub key_max_bytes: u64,
    /// Delete snapshots older than this; `None` keeps them until deleted.
    pub retention: Option<Duration>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            per_key: 32,
            key_max_bytes: 8 << 30,
            retention: None,
        }
    }
}

/// A key's own budget, from the keys file.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KeyBudget {
    pub max_snapshots: Option<usize>,
    pub max_bytes: Option<u64>,
}

impl KeyBudget {
    /// What the keys file sets for `tenant`.
    pub fn of(tenant: &crate::tenants::Tenant) -> Self {
        KeyBudget {
            max_snapshots: tenant.max_snapshots,
            max_bytes: tenant.snapshot_max_mb.map(|mb| mb << 20),
        }
    }
}

/// One snapshot in the store: its record and directory. Deleted from disk when the last
/// holder lets go of it after [`Self::delete`] (a create restoring it finishes first).
#[derive(Debug)]
pub struct Held {
    pub record: Snapshot,
    dir: PathBuf,
    deleted: AtomicBool,
}

impl Held {
    /// Its directory: `state.tar` or `memory/`.
    pub(in crate::kernels) fn dir(&self) -> &Path {
        &self.dir
    }

    fn delete(&self) {
        self.deleted.store(true, Ordering::SeqCst);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.deleted.load(Ordering::SeqCst) {
            let dir = self.dir.clone();
            // A checkpoint is hundreds of MiB: not on the runtime's thread.
            std::thread::spawn(move || {
                if let Err(e) = std::fs::remove_dir_all(&dir) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!(dir = %dir.display(), error = %e, "cannot delete a snapshot's files");
                    }
                }
            });
        }
    }
}

/// The snapshots on disk, by id.
#[derive(Debug, Default)]
pub(super) struct Store {
    held: Mutex<HashMap<String, Arc<Held>>>,
}

impl Store {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Held>>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A page of a key's snapshots, newest first.
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    pub snapshots: Vec<SnapshotModel>,
    /// Where the next page starts, when there is one.
    pub next: Option<String>,
}

/// What a listing keeps.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub name: Option<String>,
    /// Every entry must be in the snapshot's metadata.
    pub metadata: BTreeMap<String, String>,
    pub limit: usize,
    /// The `next` of the previous page.
    pub after: Option<String>,
}

/// Checks what a caller names and describes a snapshot with.
pub fn check_labels(
    name: Option<&str>,
    metadata: &BTreeMap<String, String>,
) -> Result<(), SnapshotError> {
    if let Some(name) = name {
        let ok = !name.is_empty()
            && name.len() <= MAX_NAME
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:/".contains(&b));
        if !ok {
            return Err(SnapshotError::Invalid(format!(
                "snapshot name {name:?}: 1-{MAX_NAME} letters, digits, '-', '_', '.', ':' or '/'"
            )));
        }
    }
    if metadata.len() > MAX_METADATA {
        return Err(SnapshotError::Invalid(format!(
            "a snapshot's metadata holds at most {MAX_METADATA} entries"
        )));
    }
    if let Some((k, _)) = metadata
        .iter()
        .find(|(k, v)| k.is_empty() || k.len() > MAX_METADATA_TEXT || v.len() > MAX_METADATA_TEXT)
    {
        return Err(SnapshotError::Invalid(format!(
            "metadata entry {k:?}: keys of 1-{MAX_METADATA_TEXT} bytes, values of at most {MAX_METADATA_TEXT}"
        )));
    }
    Ok(())
}

/// Snapshots of the table's kernels: taking, listing, deleting, and kernels started from
/// them.
#[derive(Debug, Clone)]
pub struct Snapshots {
    kernels: Arc<Kernels>,
}

impl Snapshots {
    pub(in crate::kernels) fn new(kernels: &Arc<Kernels>) -> Self {
        Snapshots {
            kernels: kernels.clone(),
        }
    }

    fn root(&self) -> PathBuf {
        self.kernels.settings.hibernate.dir.join(SNAPSHOTS)
    }

    fn store(&self) -> MutexGuard<'_, HashMap<String, Arc<Held>>> {
        self.kernels.snapshots.lock()
    }

    /// The snapshot `id_or_name` of a caller who may use `may_use`'s owners (its own key,
    /// or every key for an admin); by name, the caller's own (`key`) first.
    pub fn find(
        &self,
        id_or_name: &str,
        key: &str,
        may_use: impl Fn(&str) -> bool,
    ) -> Result<Arc<Held>, SnapshotError> {
        let store = self.store();
        if let Some(held) = store
            .get(id_or_name)
            .filter(|h| !h.record.hidden && may_use(&h.record.owner))
        {
            return Ok(held.clone());
        }
        let named = |owner_ok: &dyn Fn(&str) -> bool| {
            store
                .values()
                .filter(|h| !h.record.hidden && h.record.name.as_deref() == Some(id_or_name))
                .find(|h| owner_ok(&h.record.owner))
                .cloned()
        };
        named(&|owner| owner == key)
            .or_else(|| named(&|owner| may_use(owner)))
            .ok_or_else(|| SnapshotError::NotFound(id_or_name.to_owned()))
    }

    /// A page of the snapshots `may_use` allows, newest first, as `filter` says.
    pub fn list(&self, filter: &Filter, may_use: impl Fn(&str) -> bool) -> Page {
        self.list_with(filter, may_use, Vec::new())
    }

    /// A page of the snapshots `may_use` allows of this node's and of `elsewhere` (other
    /// nodes' snapshots, with their keys, as the cluster registry lists them), newest first.
    pub fn list_with(
        &self,
        filter: &Filter,
        may_use: impl Fn(&str) -> bool,
        elsewhere: Vec<(String, SnapshotModel)>,
    ) -> Page {
        let here: Vec<(String, SnapshotModel)> = self
            .store()
            .values()
            .filter(|h| !h.record.hidden)
            .map(|h| (h.record.owner.clone(), h.record.model()))
            .collect();
        let mut seen = std::collections::HashSet::new();
        let mut all: Vec<SnapshotModel> = here
            .into_iter()
            .chain(elsewhere)
            .filter(|(owner, _)| may_use(owner))
            .map(|(_, model)| model)
            .filter(|s| seen.insert(s.id.clone()))
            .filter(|s| {
                filter
                    .name
                    .as_ref()
                    .is_none_or(|n| s.name.as_ref() == Some(n))
            })
            .filter(|s| {
                filter
                    .metadata
                    .iter()
                    .all(|(k, v)| s.metadata.get(k) == Some(v))
            })
            .collect();
        // `created` is RFC 3339 in UTC with microseconds: its text sorts as its time.
        all.sort_by(|a, b| b.created.cmp(&a.created).then_with(|| a.id.cmp(&b.id)));
        let start = match &filter.after {
            Some(after) => all
                .iter()
                .position(|s| &s.id == after)
                .map_or(all.len(), |i| i + 1),
            None => 0,
        };
        let limit = filter.limit.max(1);
        let snapshots: Vec<SnapshotModel> = all.iter().skip(start).take(limit).cloned().collect();
        let next = (start + limit < all.len())
            .then(|| snapshots.last().map(|s| s.id.clone()))
            .flatten();
        Page { snapshots, next }
    }

    /// Deletes a snapshot (asked by `key`, or for `reason`); its files go once no create
    /// uses them.
    pub async fn delete(&self, held: &Arc<Held>, key: Option<&str>, reason: Option<&str>) {
        let removed = self.store().remove(&held.record.id);
        let Some(removed) = removed else {
            return;
        };
        removed.delete();
        if !removed.record.hidden {
            if let Some(ledger) = &self.kernels.settings.ledger {
                ledger.snapshot_gone(&removed.record.id).await;
            }
            self.kernels
                .settings
                .audit
                .record(&Record::SnapshotDeleted {
                    snapshot: removed.record.id.clone(),
                    owner: removed.record.owner.clone(),
                    key: key.map(str::to_owned),
                    reason: reason.map(str::to_owned),
                })
                .await;
        }
        tracing::info!(snapshot = %removed.record.id, "snapshot deleted");
    }

    /// The count and bytes of `owner`'s listed snapshots, leaving out one named `except`
    /// (which a new snapshot of that name replaces); in a cluster, those other nodes keep
    /// too.
    fn used_by(&self, owner: &str, except: Option<&str>) -> (usize, u64) {
        let (n, b) = self
            .store()
            .values()
            .filter(|h| h.record.owner == owner && !h.record.hidden)
            .filter(|h| except.is_none() || h.record.name.as_deref() != except)
            .fold((0, 0), |(n, b), h| (n + 1, b + h.record.bytes));
        let (others, other_bytes) = self
            .kernels
            .settings
            .ledger
            .as_ref()
            .map_or((0, 0), |l| l.snapshots_elsewhere(owner));
        (n + others, b + other_bytes)
    }

    /// Snapshots kept, and their bytes, for the metrics (a fork's own included: it is on
    /// disk).
    pub fn totals(&self) -> (i64, i64) {
        self.store()
            .values()
            .fold((0, 0), |(n, b), h| (n + 1, b + h.record.bytes as i64))
    }

    /// Lists again the snapshots an earlier run left in `--hibernate-dir/snapshots`; a
    /// commit that was never finished, or a fork's own snapshot, is deleted.
    pub(in crate::kernels) async fn load(&self) {
        let root = self.root();
        let Ok(mut entries) = tokio::fs::read_dir(&root).await else {
            return;
        };
        while let Ok(Some(entry)) = entries.next_entry().await {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if name.starts_with('.') {
                forget_if_stale(&entry).await;
                continue;
            }
            let record = tokio::fs::read(path.join(RECORD))
                .await
                .ok()
                .and_then(|b| serde_json::from_slice::<Snapshot>(&b).ok());
            match record {
                Some(record) if record.id == name && record.hidden => forget(&path).await,
                Some(record) if record.id == name => {
                    if let Some(ledger) = &self.kernels.settings.ledger {
                        ledger.snapshot_kept(&record.owner, &record.model()).await;
                    }
                    let held = Arc::new(Held {
                        record,
                        dir: path,
                        deleted: AtomicBool::new(false),
                    });
                    self.store().insert(name, held);
                }
                _ => {
                    tracing::warn!(dir = %path.display(), "not a snapshot; left alone");
                }
            }
        }
        let n = self.store().len();
        if n > 0 {
            tracing::info!(snapshots = n, "snapshots of an earlier run listed again");
        }
    }

    /// Deletes snapshots kept past `--snapshot-retention`, every so often.
    pub(in crate::kernels) async fn expire(self, retention: Duration) {
        let every = (retention / 4).clamp(Duration::from_secs(1), Duration::from_secs(60));
        loop {
            tokio::select! {
                _ = self.kernels.cancel.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let now = Utc::now();
            let old: Vec<Arc<Held>> = self
                .store()
                .values()
                .filter(|h| !h.record.hidden)
                .filter(|h| {
                    (now - h.record.created)
                        .to_std()
                        .is_ok_and(|age| age >= retention)
                })
                .cloned()
                .collect();
            for held in old {
                self.delete(&held, None, Some("kept longer than --snapshot-retention"))
                    .await;
            }
        }
    }
}

#[cfg(test)]
mod tests;
