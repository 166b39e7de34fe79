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
//!
//! The records themselves are in [`record`], `kernelgate audit` in [`cli`]; the writer is here.

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tokio::sync::{oneshot, watch};

mod cli;
mod record;
pub use cli::read_back;
pub use record::{
    Entry, FileAccess, FileEvent, KernelReportedInstall, PackageRefusal, PackageVersion, Record,
    Sender, Source, OUTPUT_PREVIEW_CHARS,
};

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
            tracing::error!(event = %record.event(), "the audit writer has stopped; record lost");
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

/// Hex SHA-256 of some code.
pub fn sha256(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// The first [`OUTPUT_PREVIEW_CHARS`] characters of `text`, added to `preview`.
pub fn extend_preview(preview: &mut String, text: &str) {
    let room = OUTPUT_PREVIEW_CHARS.saturating_sub(preview.chars().count());
    preview.extend(text.chars().take(room));
}

#[cfg(test)]
mod tests;
