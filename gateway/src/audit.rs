//! The audit trail: one JSON object per line for every event that matters (kernels created,
//! restarted, deleted, died or culled; executions requested and finished; files written,
//! read or deleted; authentication refused).
//!
//! Each record is written with one `write(2)` on a file opened with `O_APPEND`, before the
//! gateway goes on: an execution's `requested` record is in the file before its code is sent
//! to the kernel, its `finished` record before its reply is forwarded. A `kill -9` of the
//! gateway therefore loses nothing a client saw. With `--audit-fsync` a writer also waits
//! until an `fdatasync` covers its record (group commit: one sync serves every writer that
//! came before it), for power-loss durability.

use serde::Serialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};

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

#[derive(Debug, Default)]
struct Progress {
    /// Records written so far, and those an fdatasync covers.
    written: u64,
    synced: u64,
    syncing: bool,
}

/// Where audit records go; cheap to share.
#[derive(Debug, Clone)]
pub struct Audit {
    inner: Option<Arc<Inner>>,
}

#[derive(Debug)]
struct Inner {
    /// The file's path (none for stdout), for [`Audit::reopen`].
    path: Option<std::path::PathBuf>,
    sink: Mutex<Sink>,
    fsync: bool,
    progress: Mutex<Progress>,
    synced: Condvar,
}

impl Audit {
    /// No audit trail (unit tests, `kernelgate run`'s local gateway).
    pub fn disabled() -> Audit {
        Audit { inner: None }
    }

    /// Appends to `path` (created mode 0600), or writes to stdout for `-`.
    pub fn open(path: &Path, fsync: bool) -> std::io::Result<Audit> {
        let stdout = path == Path::new("-");
        let sink = if stdout {
            Sink::Stdout
        } else {
            Sink::File(open_log(path)?)
        };
        Ok(Audit {
            inner: Some(Arc::new(Inner {
                path: (!stdout).then(|| path.to_owned()),
                sink: Mutex::new(sink),
                fsync,
                progress: Mutex::new(Progress::default()),
                synced: Condvar::new(),
            })),
        })
    }

    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Opens the file again at its path (after logrotate moved it away; on SIGHUP).
    pub fn reopen(&self) -> std::io::Result<()> {
        let Some(inner) = &self.inner else {
            return Ok(());
        };
        let Some(path) = &inner.path else {
            return Ok(());
        };
        let file = open_log(path)?;
        *inner.sink.lock().unwrap_or_else(|e| e.into_inner()) = Sink::File(file);
        Ok(())
    }

    /// Writes one record, with the time. Returns once the line is in the file (and synced,
    /// with `--audit-fsync`). A failed write is logged; the gateway keeps serving.
    pub fn record(&self, record: &Record) {
        let Some(inner) = &self.inner else { return };
        let mut line = line(record);
        line.push('\n');
        let seq = {
            let mut sink = inner.sink.lock().unwrap_or_else(|e| e.into_inner());
            let written = match &mut *sink {
                Sink::File(f) => f.write_all(line.as_bytes()),
                Sink::Stdout => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(line.as_bytes()).and_then(|_| out.flush())
                }
            };
            if let Err(e) = written {
                tracing::error!(error = %e, event = %event_name(record), "cannot write the audit record");
                return;
            }
            let mut p = inner.progress.lock().unwrap_or_else(|e| e.into_inner());
            p.written += 1;
            p.written
        };
        if inner.fsync {
            inner.sync_through(seq);
        }
    }
}

impl Inner {
    /// Group commit: the first writer to find no sync under way syncs everything written
    /// so far; the others wait for a sync that covers their record.
    fn sync_through(&self, seq: u64) {
        let mut p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if p.synced >= seq {
                return;
            }
            if !p.syncing {
                p.syncing = true;
                let target = p.written;
                drop(p);
                let result = match &*self.sink.lock().unwrap_or_else(|e| e.into_inner()) {
                    Sink::File(f) => f.sync_data(),
                    Sink::Stdout => Ok(()),
                };
                if let Err(e) = result {
                    tracing::error!(error = %e, "cannot sync the audit log");
                }
                p = self.progress.lock().unwrap_or_else(|e| e.into_inner());
                p.syncing = false;
                p.synced = p.synced.max(target);
                self.synced.notify_all();
                continue;
            }
            p = self.synced.wait(p).unwrap_or_else(|e| e.into_inner());
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
mod tests {
    use super::*;

    #[test]
    fn records_are_json_lines_in_a_private_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub/audit.log");
        for fsync in [false, true] {
            let audit = Audit::open(&path, fsync).expect("open");
            audit.record(&Record::KernelCreated {
                kernel: "k1".into(),
                key: "alice".into(),
                spec: "python3".into(),
                source: Source::Pool,
            });
            audit.record(&Record::AuthRefused {
                client: Some("127.0.0.1".into()),
                path: "/api/kernels".into(),
            });
        }
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let lines: Vec<Value> = std::fs::read_to_string(&path)
            .expect("read")
            .lines()
            .map(|l| serde_json::from_str(l).expect("json"))
            .collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(lines[0]["event"], "kernel_created");
        assert_eq!(lines[0]["key"], "alice");
        assert_eq!(lines[0]["source"], "pool");
        let first = lines[0].as_object().expect("an object");
        let keys: Vec<&str> = first.keys().map(String::as_str).collect();
        assert_eq!(keys[..2], ["time", "event"], "time and event first");
        assert!(lines[0]["time"].as_str().is_some_and(|t| t.ends_with('Z')));
        assert_eq!(lines[3]["event"], "auth_refused");

        // Rotation: the file is moved away, the log reopened at its path.
        let audit = Audit::open(&path, false).expect("open");
        let rotated = dir.path().join("audit.log.1");
        std::fs::rename(&path, &rotated).expect("rename");
        audit.reopen().expect("reopen");
        audit.record(&Record::KernelCulled {
            kernel: "after-rotation".into(),
        });
        let fresh = std::fs::read_to_string(&path).expect("read");
        assert!(fresh.contains("after-rotation") && fresh.lines().count() == 1);
    }

    #[test]
    fn group_commit_serves_concurrent_writers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("audit.log");
        let audit = Audit::open(&path, true).expect("open");
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let audit = audit.clone();
                std::thread::spawn(move || {
                    for i in 0..50 {
                        audit.record(&Record::KernelCulled {
                            kernel: format!("{t}-{i}"),
                        });
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("join");
        }
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(text.lines().count(), 400);
        let inner = audit.inner.as_ref().expect("enabled");
        let p = inner.progress.lock().expect("lock");
        assert_eq!((p.written, p.synced), (400, 400));
    }

    /// The table of events and fields in docs/audit.md, rendered from [`Record`]'s schema
    /// (its variants, fields and doc comments).
    fn reference() -> String {
        use utoipa::OpenApi;
        #[derive(utoipa::OpenApi)]
        #[openapi(components(schemas(Record)))]
        struct Doc;
        let doc = serde_json::to_value(Doc::openapi()).expect("the schema as JSON");
        let schemas = &doc["components"]["schemas"];
        // A part of a variant: its properties and which of them are required.
        fn fields(part: &Value, schemas: &Value, out: &mut Vec<String>) {
            if let Some(r) = part["$ref"].as_str() {
                let name = r.rsplit('/').next().unwrap_or_default();
                return fields(&schemas[name], schemas, out);
            }
            for p in part["allOf"].as_array().into_iter().flatten() {
                fields(p, schemas, out);
            }
            let required: Vec<&str> = part["required"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            for name in part["properties"]
                .as_object()
                .into_iter()
                .flat_map(|o| o.keys())
            {
                if name != "event" {
                    let optional = if required.contains(&name.as_str()) {
                        ""
                    } else {
                        " (optional)"
                    };
                    out.push(format!("`{name}`{optional}"));
                }
            }
        }
        let mut table =
            String::from("| event | when | fields (after `time` and `event`) |\n|---|---|---|\n");
        for variant in schemas["Record"]["oneOf"].as_array().into_iter().flatten() {
            let parts: Vec<&Value> = match variant["allOf"].as_array() {
                Some(all) => all.iter().collect(),
                None => vec![variant],
            };
            let event = parts
                .iter()
                .find_map(|p| p["properties"]["event"]["enum"][0].as_str())
                .expect("every variant names its event");
            let mut names = Vec::new();
            fields(variant, schemas, &mut names);
            let when = variant["description"]
                .as_str()
                .unwrap_or_default()
                .replace('\n', " ");
            table.push_str(&format!("| `{event}` | {when} | {} |\n", names.join(", ")));
        }
        table
    }

    /// docs/audit.md holds the table [`reference`] renders.
    #[test]
    fn the_documented_events_are_the_records() {
        crate::generated_docs::check("audit.md", "records", &reference(), "the_documented_events");
    }

    #[test]
    fn previews_stop_at_500_characters() {
        let mut p = String::new();
        extend_preview(&mut p, &"é".repeat(300));
        extend_preview(&mut p, &"x".repeat(300));
        assert_eq!(p.chars().count(), OUTPUT_PREVIEW_CHARS);
        assert!(p.ends_with('x') && p.starts_with('é'));
    }
}
