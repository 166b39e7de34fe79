//! The audit trail: one JSON object per line for every event that matters (kernels created,
//! restarted, deleted, died or culled; executions requested and finished; files written,
//! read or deleted; authentication refused).
//!
//! Records go to one writer thread, in the order they are made, and reach the file opened
//! with `O_APPEND` with one `write(2)` for all those waiting. Whoever must not go on before a
//! record is in the file awaits its [`Written`]: an execution's `requested` record is in the
//! file before its code is sent to the kernel, its `finished` record before its reply is
//! forwarded, so a `kill -9` of the gateway loses nothing a client saw. Nobody writes or syncs
//! while holding a kernel's lock, and no runtime worker blocks on the disk. With
//! `--audit-fsync` the writer also syncs (`fdatasync`) once per write before waking the
//! waiters (group commit), for power-loss durability.

use serde::Serialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tokio::sync::{oneshot, watch};

/// Characters of output kept in an execution's `finished` record.
pub const OUTPUT_PREVIEW_CHARS: usize = 500;

/// Who sent a client message: the start of every record about one.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
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
#[derive(Debug, Clone, Copy, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Handed out from the warm pool.
    Pool,
    /// Started for this create.
    Cold,
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
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Record {
    /// A kernel was created for a key.
    KernelCreated {
        kernel: String,
        key: String,
        spec: String,
        source: Source,
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
        #[serde(skip_serializing_if = "Vec::is_empty")]
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
        #[serde(skip_serializing_if = "Vec::is_empty")]
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

/// What a kernel's installer said it did: the kernel's word.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct KernelReportedInstall {
    pub installed: Vec<PackageVersion>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub already: Vec<PackageVersion>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<PackageRefusal>,
    pub exit_code: i64,
}

/// A package and the version a kernel got.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct PackageVersion {
    pub name: String,
    pub version: String,
}

/// A requirement that was not installed, and why.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct PackageRefusal {
    pub requirement: String,
    pub reason: String,
}

/// Who touched which file of a kernel's working directory.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
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

#[derive(Debug)]
enum Sink {
    File(std::fs::File),
    Stdout,
}

impl Sink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        match self {
            Sink::File(f) => f.write_all(bytes),
            Sink::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(bytes).and_then(|_| out.flush())
            }
        }
    }

    fn sync(&self) -> std::io::Result<()> {
        match self {
            Sink::File(f) => f.sync_data(),
            Sink::Stdout => Ok(()),
        }
    }
}

/// What the writer thread is asked to do, in the order records were made.
enum Command {
    /// One record's line, newline included.
    Line(String),
    /// Open the file again at its path; the lines before go to the old file.
    Reopen(oneshot::Sender<std::io::Result<()>>),
}

/// Where audit records go; cheap to share.
///
/// Records are handed to one writer thread, in order, without blocking: callers hold
/// locks while they make records, and no runtime worker waits for a disk. What must be in
/// the file before the gateway goes on (an execution's record before its code is sent) is
/// awaited through the [`Written`] each record returns.
#[derive(Debug, Clone)]
pub struct Audit {
    inner: Option<Arc<Inner>>,
}

#[derive(Debug)]
struct Inner {
    /// The writer's queue and the number of the last record put in it (both under one
    /// lock, so that numbers follow the queue's order).
    queue: Mutex<Queue>,
    /// How many records are in the file (and synced, with `--audit-fsync`).
    done: watch::Receiver<u64>,
}

#[derive(Debug)]
struct Queue {
    tx: std::sync::mpsc::Sender<Command>,
    made: u64,
}

/// A record handed to the writer: await it to know the record is in the file (and synced,
/// with `--audit-fsync`). Records are written in the order they were made, so waiting for
/// one also waits for every record made before it.
#[must_use = "await it before anything that must come after the record"]
#[derive(Debug, Clone, Default)]
pub struct Written {
    seq: u64,
    done: Option<watch::Receiver<u64>>,
}

impl Written {
    /// The later of two records (waiting for it covers both).
    pub fn and(self, other: Written) -> Written {
        if other.seq >= self.seq {
            other
        } else {
            self
        }
    }

    /// Whether there is anything to wait for.
    pub fn is_pending(&self) -> bool {
        self.done.as_ref().is_some_and(|d| *d.borrow() < self.seq)
    }

    /// Waits on a thread that is not a runtime worker (tests, `kernelgate` subcommands).
    #[cfg(test)]
    fn wait_blocking(self) {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
            .block_on(std::future::IntoFuture::into_future(self));
    }
}

impl std::future::IntoFuture for Written {
    type Output = ();
    type IntoFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            if let Some(mut done) = self.done {
                // The writer is gone only when every Audit is: nothing is left to wait for.
                let _ = done.wait_for(|&n| n >= self.seq).await;
            }
        })
    }
}

impl Audit {
    /// No audit trail (unit tests, `kernelgate run`'s local gateway).
    pub fn disabled() -> Audit {
        Audit { inner: None }
    }

    /// Appends to `path` (created mode 0600), or writes to stdout for `-`, from a writer
    /// thread of its own.
    pub fn open(path: &Path, fsync: bool) -> std::io::Result<Audit> {
        let stdout = path == Path::new("-");
        let sink = if stdout {
            Sink::Stdout
        } else {
            Sink::File(open_log(path)?)
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done) = watch::channel(0);
        let path = (!stdout).then(|| path.to_owned());
        std::thread::Builder::new()
            .name("kernelgate-audit".into())
            .spawn(move || write_records(rx, sink, path, fsync, done_tx))?;
        Ok(Audit {
            inner: Some(Arc::new(Inner {
                queue: Mutex::new(Queue { tx, made: 0 }),
                done,
            })),
        })
    }

    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Opens the file again at its path (after logrotate moved it away; on SIGHUP). The
    /// records made before go to the old file, those after to the new one.
    pub async fn reopen(&self) -> std::io::Result<()> {
        let Some(inner) = &self.inner else {
            return Ok(());
        };
        let (reply, answer) = oneshot::channel();
        let sent = inner.lock().tx.send(Command::Reopen(reply));
        if sent.is_err() {
            return Err(std::io::Error::other("the audit writer has stopped"));
        }
        answer
            .await
            .unwrap_or_else(|_| Err(std::io::Error::other("the audit writer has stopped")))
    }

    /// Hands one record, with the time, to the writer; never blocks. Await the answer to
    /// know it is in the file. A failed write is logged; the gateway keeps serving.
    pub fn record(&self, record: &Record) -> Written {
        let Some(inner) = &self.inner else {
            return Written::default();
        };
        let mut line = line(record);
        line.push('\n');
        let mut queue = inner.lock();
        if queue.tx.send(Command::Line(line)).is_err() {
            tracing::error!(event = %event_name(record), "the audit writer has stopped; record lost");
            return Written::default();
        }
        queue.made += 1;
        Written {
            seq: queue.made,
            done: Some(inner.done.clone()),
        }
    }
}

impl Audit {
    /// The last record made so far: waiting for it waits for every record made before.
    pub fn made_so_far(&self) -> Written {
        let Some(inner) = &self.inner else {
            return Written::default();
        };
        Written {
            seq: inner.lock().made,
            done: Some(inner.done.clone()),
        }
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Most bytes written with one `write(2)`.
const BATCH_BYTES: usize = 1 << 20;

/// The writer thread: takes every record waiting, writes them with one `write(2)` on the
/// file opened with `O_APPEND`, syncs once for all of them with `--audit-fsync` (group
/// commit), then tells their waiters. Ends when every [`Audit`] is gone.
fn write_records(
    rx: std::sync::mpsc::Receiver<Command>,
    mut sink: Sink,
    path: Option<std::path::PathBuf>,
    fsync: bool,
    done: watch::Sender<u64>,
) {
    let mut written = 0u64;
    while let Ok(first) = rx.recv() {
        let mut batch = String::new();
        let mut lines = 0u64;
        let mut reopen = None;
        let mut next = Some(first);
        while let Some(command) = next.take() {
            match command {
                Command::Line(line) => {
                    batch.push_str(&line);
                    lines += 1;
                }
                Command::Reopen(reply) => {
                    reopen = Some(reply);
                    break;
                }
            }
            if batch.len() < BATCH_BYTES {
                next = rx.try_recv().ok();
            }
        }
        if !batch.is_empty() {
            if let Err(e) = sink.write(batch.as_bytes()) {
                tracing::error!(error = %e, records = lines, "cannot write to the audit log");
            }
            if fsync {
                if let Err(e) = sink.sync() {
                    tracing::error!(error = %e, "cannot sync the audit log");
                }
            }
        }
        written += lines;
        done.send_replace(written);
        if let Some(reply) = reopen {
            let reopened = match &path {
                Some(path) => open_log(path).map(|f| sink = Sink::File(f)),
                None => Ok(()),
            };
            let _ = reply.send(reopened);
        }
    }
}

fn open_log(path: &Path) -> std::io::Result<std::fs::File> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)
}

/// A record as its JSON line (without the newline): the time first, then the event.
fn line(record: &Record) -> String {
    let mut object = Map::new();
    object.insert("time".into(), Value::String(crate::time::now_iso()));
    if let Ok(Value::Object(fields)) = serde_json::to_value(record) {
        object.extend(fields);
    }
    Value::Object(object).to_string()
}

/// A record's `event` name.
fn event_name(record: &Record) -> String {
    match serde_json::to_value(record) {
        Ok(Value::Object(o)) => o
            .get("event")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

/// Hex SHA-256 of some code.
pub fn sha256(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// The first [`OUTPUT_PREVIEW_CHARS`] characters of `text`, added to `preview`.
pub fn extend_preview(preview: &mut String, text: &str) {
    let room = OUTPUT_PREVIEW_CHARS.saturating_sub(preview.chars().count());
    preview.extend(text.chars().take(room));
}

/// `kernelgate audit`: the log's records, filtered, as a table or JSON lines.
pub fn read_back(args: &crate::config::AuditArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    let path = args
        .file
        .clone()
        .unwrap_or_else(crate::config::default_audit_log);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read the audit log {} (pass --file)", path.display()))?;
    let since = match &args.since {
        Some(s) => Some(
            chrono::DateTime::parse_from_rfc3339(s)
                .with_context(|| format!("--since {s:?}: use RFC 3339, like 2026-11-25T10:00:00Z"))?
                .with_timezone(&chrono::Utc),
        ),
        None => None,
    };
    let mut out = std::io::stdout().lock();
    if !args.json {
        writeln!(
            out,
            "{:<27} {:<20} {:<12} {:<36} {:<8} DETAIL",
            "TIME", "EVENT", "KEY", "KERNEL", "STATUS"
        )?;
    }
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let Ok(r) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let field = |name: &str| r[name].as_str().unwrap_or_default().to_owned();
        if args.kernel.as_ref().is_some_and(|k| field("kernel") != *k)
            || args
                .key
                .as_ref()
                .is_some_and(|k| field("key") != *k && field("owner") != *k)
        {
            continue;
        }
        if let Some(since) = since {
            let at = chrono::DateTime::parse_from_rfc3339(&field("time"))
                .map(|t| t.with_timezone(&chrono::Utc));
            if at.map_or(true, |t| t < since) {
                continue;
            }
        }
        if args.json {
            writeln!(out, "{line}")?;
            continue;
        }
        let detail = match field("event").as_str() {
            "execution_requested" => one_line(&field("code"), 60),
            "execution_finished" => format!(
                "{} ms, {} bytes out{}{}",
                r["duration_ms"],
                r["output_bytes"],
                if field("ename").is_empty() {
                    String::new()
                } else {
                    format!(", {}", field("ename"))
                },
                if r["truncated"] == true {
                    ", truncated"
                } else {
                    ""
                }
            ),
            e if e.starts_with("file_") => field("path"),
            "auth_refused" => format!("{} {}", field("client"), field("path")),
            "internal_headers_refused" => format!(
                "{} {} ({} unrecorded before)",
                field("client"),
                field("path"),
                r["unrecorded"]
            ),
            "kernel_died" => field("why"),
            _ => String::new(),
        };
        let key = if field("key").is_empty() {
            field("owner")
        } else {
            field("key")
        };
        writeln!(
            out,
            "{:<27} {:<20} {:<12} {:<36} {:<8} {}",
            field("time"),
            field("event"),
            key,
            field("kernel"),
            field("status"),
            detail
        )?;
    }
    Ok(())
}

/// `text` on one line, cut to `max` characters.
fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c == '\n' { '⏎' } else { c })
        .collect();
    if flat.chars().count() > max {
        format!("{}…", flat.chars().take(max).collect::<String>())
    } else {
        flat
    }
}

#[cfg(test)]
mod tests;
