//! What the audit log holds: one record per event, a JSON object per line (docs/audit.md).

pub use kernelgate_protocol::rest::{KernelReportedInstall, PackageRefusal, PackageVersion};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Characters of output kept in an execution's `finished` record.
pub const OUTPUT_PREVIEW_CHARS: usize = 500;

/// Who sent a client message: the start of every record about one.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Sender {
    /// The name of the key that sent it.
    pub key: String,
    /// The message header's `username`.
    pub username: String,
    /// The header's `agent_id` (the agent API sets it from its `agent_id` field).
    pub agent_id: Option<Value>,
    pub kernel: String,
    pub session: String,
    pub msg_id: String,
}

/// How a created kernel came to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Handed out from the warm pool.
    Pool,
    /// Started for this create.
    Cold,
    /// Started from a snapshot (its id is in the record).
    Snapshot,
}

/// What happened to a file of a kernel's working directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileEvent {
    Listed,
    Read,
    Written,
    Deleted,
}

/// One audit record: every event the trail knows, with its fields, written here once. A
/// record is one JSON object per line: `time`, `event` (the variant's name in snake case),
/// then the fields; optional fields are left out when empty. `docs/audit.md` lists them and
/// a unit test keeps it in step with this enum.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Record {
    /// A kernel was created for a key.
    KernelCreated {
        kernel: String,
        key: String,
        spec: String,
        source: Source,
        /// The snapshot whose state it started with.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        snapshot: Option<String>,
    },
    /// A kernel was deleted: asked for by `key`, or by the gateway for `reason` (a revoked
    /// key, an ended MCP session).
    KernelDeleted {
        kernel: String,
        owner: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        key: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// A kernel was restarted as `key` asked (REST, MCP).
    KernelRestarted {
        kernel: String,
        owner: String,
        key: String,
    },
    /// A restart gave up after its tries; `why` is the last try's failure.
    KernelRestartFailed {
        kernel: String,
        owner: String,
        tries: u32,
        why: String,
    },
    /// A kernel's process ended on its own: `why` names the cause (out of memory and the
    /// limit, a signal, an exit code, a silent heartbeat).
    KernelDied {
        kernel: String,
        owner: String,
        why: String,
        restarting: bool,
    },
    /// An idle kernel was removed (`--cull-idle-timeout`).
    KernelCulled { kernel: String },
    /// A kernel hibernated: its state (`bytes` on disk) was saved and its container
    /// removed; `dropped` names what could not be kept (`--hibernate-lossy`).
    KernelHibernated {
        kernel: String,
        owner: String,
        bytes: u64,
        took_ms: u64,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        dropped: Vec<String>,
    },
    /// A hibernated kernel runs again, its saved state confirmed loaded into a fresh process.
    KernelResumed {
        kernel: String,
        owner: String,
        took_ms: u64,
    },
    /// A hibernated kernel's saved state did not load into its new process (`reason` says
    /// why): the state is kept and the kernel hibernates again.
    KernelResumeFailed {
        kernel: String,
        owner: String,
        reason: String,
    },
    /// A key discarded a hibernated kernel's saved variables: it runs again as a fresh
    /// process with its saved files.
    KernelStateDiscarded {
        kernel: String,
        owner: String,
        key: String,
    },
    /// A key took a snapshot of a kernel (`kind`: memory, namespace or filesystem; `bytes`
    /// on disk); `dropped` names what a lossy one left out.
    SnapshotTaken {
        snapshot: String,
        kernel: String,
        key: String,
        kind: String,
        bytes: u64,
        took_ms: u64,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        dropped: Vec<String>,
    },
    /// A snapshot was deleted: asked for by `key`, or by the gateway for `reason` (its
    /// retention, a newer snapshot of the same name).
    SnapshotDeleted {
        snapshot: String,
        owner: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        key: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// A key forked a kernel: one snapshot (`kind`), the kernels `forks` started from it,
    /// `failed` that did not start.
    KernelForked {
        kernel: String,
        key: String,
        kind: String,
        forks: Vec<String>,
        failed: usize,
    },
    /// Code is on its way to the kernel (written before it is sent).
    ExecutionRequested {
        #[serde(flatten)]
        sender: Sender,
        code: String,
        code_sha256: String,
        user_expressions: Map<String, Value>,
        silent: bool,
    },
    /// An execution ended: its reply (written before it is forwarded), or the gateway's
    /// answer in its place (`ran` false: refused, or its kernel died or gave up first;
    /// `reason` says why).
    ExecutionFinished {
        key: String,
        kernel: String,
        msg_id: Option<String>,
        session: Option<String>,
        code_sha256: Option<String>,
        status: String,
        ename: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        duration_ms: u64,
        output_bytes: usize,
        output: String,
        truncated: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        ran: Option<bool>,
    },
    /// Output an execution produced after its reply, in total, at its `idle`.
    ExecutionOutput {
        key: String,
        kernel: String,
        msg_id: String,
        output_bytes: usize,
        output: String,
        truncated: bool,
    },
    /// A shell command was started in a sandbox (E2B's `commands.run`, a terminal):
    /// written before it runs. `pid` is the gateway's number for it.
    CommandStarted {
        key: String,
        kernel: String,
        pid: u32,
        command: String,
        command_sha256: String,
        cwd: String,
        terminal: bool,
    },
    /// A sandbox's command ended: its exit code (none when it could not be told), and its
    /// output as an execution's.
    CommandFinished {
        key: String,
        kernel: String,
        pid: u32,
        exit_code: Option<i64>,
        duration_ms: u64,
        output_bytes: usize,
        output: String,
        truncated: bool,
    },
    /// A `debug_request` (control channel) went to the kernel.
    DebugRequest {
        #[serde(flatten)]
        sender: Sender,
        request: Value,
    },
    /// A comm message went to the kernel (its data only as a hash).
    Comm {
        #[serde(flatten)]
        sender: Sender,
        msg_type: String,
        comm_id: Option<Value>,
        target_name: Option<Value>,
        data_sha256: String,
    },
    /// The execution policy decided on a message: `deny` or `ask` (with the rule), then for
    /// an asked one `approved`, `denied` (`by` whom), `timed_out` or `cancelled`.
    PolicyDecision {
        #[serde(flatten)]
        sender: Sender,
        msg_type: String,
        decision: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        rule: Option<usize>,
        #[serde(skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        matched: Option<String>,
        approval_id: Option<String>,
        by: Option<String>,
    },
    /// The gateway ran an install in a kernel (`install_packages`, `POST
    /// /api/kernels/{id}/packages`). It vouches for what was asked for and the allowlist's
    /// lines that let it through (`allowed`); `kernel_reported` is the kernel's installer's
    /// own word (`installed`, `already`, `refused`, `exit_code`), not checked by the gateway.
    PackagesInstalled {
        key: String,
        kernel: String,
        requested: Vec<String>,
        allowed: Vec<String>,
        kernel_reported: KernelReportedInstall,
    },
    /// The kernel reported an install asked for from inside it (`%pip`, `!pip`), written
    /// just before the record of the cell it ran in. The kernel's own word: `trusted` is
    /// always false.
    PackagesReported {
        key: String,
        kernel: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        msg_id: Option<String>,
        argv: Vec<String>,
        requested: Vec<String>,
        installed: Vec<PackageVersion>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        refused: Vec<PackageRefusal>,
        trusted: bool,
    },
    /// The working directory was listed.
    FileListed(FileAccess),
    /// A file was read (`offset` and `length` for a part).
    FileRead(FileAccess),
    /// A file was written.
    FileWritten(FileAccess),
    /// A file was deleted.
    FileDeleted(FileAccess),
    /// A request without a valid key was refused.
    AuthRefused {
        client: Option<String>,
        path: String,
    },
    /// A request with internal `x-kernelgate-*` headers was refused: a node-to-node call
    /// that does not check out (forged, replayed, for another node or body) or a client's.
    /// One record per client address and minute: `unrecorded` counts the address's earlier
    /// refusals that got none (the log has each).
    InternalHeadersRefused {
        client: Option<String>,
        path: String,
        reason: String,
        unrecorded: u32,
    },
    /// Cluster mode: the owner accepted a call another node forwarded, for the client's key
    /// `key` that reached node `entry`; the records the call then makes name the same key.
    ForwardedCall {
        key: String,
        entry: String,
        request_id: String,
        method: String,
        path: String,
    },
}

/// A line of the log: when, and the record. `kernelgate audit` and the tests read the log
/// back as these.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    /// ISO 8601, UTC, microseconds (`crate::time::iso`).
    pub time: String,
    #[serde(flatten)]
    pub record: Record,
}

impl Entry {
    /// One line of the log; `None` for a blank line, an error for one that is not a record
    /// this version knows.
    pub fn parse(line: &str) -> Option<serde_json::Result<Entry>> {
        let line = line.trim();
        (!line.is_empty()).then(|| serde_json::from_str(line))
    }
}

/// Who touched which file of a kernel's working directory.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct FileAccess {
    pub key: String,
    pub kernel: String,
    pub path: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub length: Option<usize>,
}

impl Record {
    /// Its `event` name, as the log writes it (`kernel_created`).
    pub fn event(&self) -> String {
        match serde_json::to_value(self) {
            Ok(Value::Object(o)) => o
                .get("event")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            _ => String::new(),
        }
    }

    /// The kernel it is about, if one.
    pub fn kernel(&self) -> Option<&str> {
        use Record::*;
        match self {
            KernelCreated { kernel, .. }
            | KernelDeleted { kernel, .. }
            | KernelRestarted { kernel, .. }
            | KernelRestartFailed { kernel, .. }
            | KernelDied { kernel, .. }
            | KernelCulled { kernel }
            | KernelHibernated { kernel, .. }
            | KernelResumed { kernel, .. }
            | KernelResumeFailed { kernel, .. }
            | KernelStateDiscarded { kernel, .. }
            | SnapshotTaken { kernel, .. }
            | KernelForked { kernel, .. }
            | ExecutionFinished { kernel, .. }
            | ExecutionOutput { kernel, .. }
            | CommandStarted { kernel, .. }
            | CommandFinished { kernel, .. }
            | PackagesInstalled { kernel, .. }
            | PackagesReported { kernel, .. } => Some(kernel),
            ExecutionRequested { sender, .. }
            | DebugRequest { sender, .. }
            | Comm { sender, .. }
            | PolicyDecision { sender, .. } => Some(&sender.kernel),
            FileListed(a) | FileRead(a) | FileWritten(a) | FileDeleted(a) => Some(&a.kernel),
            SnapshotDeleted { .. }
            | AuthRefused { .. }
            | InternalHeadersRefused { .. }
            | ForwardedCall { .. } => None,
        }
    }

    /// The key that acted, else the key that owns the kernel, if either.
    pub fn key(&self) -> Option<&str> {
        use Record::*;
        match self {
            KernelCreated { key, .. }
            | KernelRestarted { key, .. }
            | KernelStateDiscarded { key, .. }
            | SnapshotTaken { key, .. }
            | KernelForked { key, .. }
            | ExecutionFinished { key, .. }
            | ExecutionOutput { key, .. }
            | CommandStarted { key, .. }
            | CommandFinished { key, .. }
            | PackagesInstalled { key, .. }
            | PackagesReported { key, .. }
            | ForwardedCall { key, .. } => Some(key),
            KernelDeleted { owner, key, .. } | SnapshotDeleted { owner, key, .. } => {
                Some(key.as_deref().unwrap_or(owner))
            }
            KernelRestartFailed { owner, .. }
            | KernelDied { owner, .. }
            | KernelHibernated { owner, .. }
            | KernelResumed { owner, .. }
            | KernelResumeFailed { owner, .. } => Some(owner),
            ExecutionRequested { sender, .. }
            | DebugRequest { sender, .. }
            | Comm { sender, .. }
            | PolicyDecision { sender, .. } => Some(&sender.key),
            FileListed(a) | FileRead(a) | FileWritten(a) | FileDeleted(a) => Some(&a.key),
            KernelCulled { .. } | AuthRefused { .. } | InternalHeadersRefused { .. } => None,
        }
    }

    /// Whether `name` is its key or its kernel's owner.
    pub fn names_key(&self, name: &str) -> bool {
        use Record::*;
        let owner = match self {
            KernelDeleted { owner, .. }
            | SnapshotDeleted { owner, .. }
            | KernelRestarted { owner, .. }
            | KernelStateDiscarded { owner, .. } => Some(owner.as_str()),
            _ => None,
        };
        self.key() == Some(name) || owner == Some(name)
    }

    /// The record of a file access.
    pub fn file(event: FileEvent, access: FileAccess) -> Record {
        match event {
            FileEvent::Listed => Record::FileListed(access),
            FileEvent::Read => Record::FileRead(access),
            FileEvent::Written => Record::FileWritten(access),
            FileEvent::Deleted => Record::FileDeleted(access),
        }
    }
}
