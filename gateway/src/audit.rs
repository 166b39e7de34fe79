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

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};

/// Characters of output kept in an execution's `finished` record.
pub const OUTPUT_PREVIEW_CHARS: usize = 500;

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

    /// Writes one record: `event` plus the fields given, and the time. Returns once the
    /// line is in the file (and synced, with `--audit-fsync`). A failed write is logged;
    /// the gateway keeps serving.
    pub fn record(&self, event: &str, fields: Value) {
        let Some(inner) = &self.inner else { return };
        let mut record = Map::new();
        record.insert("time".into(), Value::String(crate::time::now_iso()));
        record.insert("event".into(), Value::String(event.to_owned()));
        if let Value::Object(fields) = fields {
            record.extend(fields);
        }
        let mut line = Value::Object(record).to_string();
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
                tracing::error!(error = %e, %event, "cannot write the audit record");
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
            audit.record(
                "kernel_created",
                serde_json::json!({"kernel": "k1", "key": "alice"}),
            );
            audit.record("auth_refused", serde_json::json!({"client": "127.0.0.1"}));
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
        assert!(lines[0]["time"].as_str().is_some_and(|t| t.ends_with('Z')));
        assert_eq!(lines[3]["event"], "auth_refused");

        // Rotation: the file is moved away, the log reopened at its path.
        let audit = Audit::open(&path, false).expect("open");
        let rotated = dir.path().join("audit.log.1");
        std::fs::rename(&path, &rotated).expect("rename");
        audit.reopen().expect("reopen");
        audit.record("after_rotation", serde_json::json!({}));
        let fresh = std::fs::read_to_string(&path).expect("read");
        assert!(fresh.contains("after_rotation") && fresh.lines().count() == 1);
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
                        audit.record("x", serde_json::json!({"t": t, "i": i}));
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

    #[test]
    fn previews_stop_at_500_characters() {
        let mut p = String::new();
        extend_preview(&mut p, &"é".repeat(300));
        extend_preview(&mut p, &"x".repeat(300));
        assert_eq!(p.chars().count(), OUTPUT_PREVIEW_CHARS);
        assert!(p.ends_with('x') && p.starts_with('é'));
    }
}
