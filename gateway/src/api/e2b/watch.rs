//! envd's directory watching: `filesystem.Filesystem/WatchDir` (a Connect server stream of
//! events, the async SDK's) and the polling watchers of the sync SDK (`CreateWatcher`,
//! `GetWatcherEvents`, `RemoveWatcher`).
//!
//! A watch is a small program in the sandbox (`assets/watch.py`), run through the engine's
//! interactive exec as the kernel's user under its syscall filter: it scans the directory
//! every [`INTERVAL`], compares each scan with the one before and prints a JSON line per
//! change. Polling rather than inotify, so that it works alike under every engine (Docker
//! with runc or runsc, the gVisor engine) and the gateway never looks at host paths. Its
//! first scan is the baseline (what is there already is no event), and it answers whether
//! the path can be watched before the call is answered, so a refusal is the call's error.
//!
//! The program is killed when its watch ends (the client went away, `RemoveWatcher`, the
//! deadline); it ends itself with the sandbox, and when the gateway goes away (its standard
//! input closes). A pause ends a sandbox's watches too. A sandbox runs at most
//! [`MAX_WATCHES`] watches of both kinds.

use super::super::AppState;
use super::connect::{self, ConnectError};
use super::plane::SandboxCall;
use crate::audit::{FileAccess, FileEvent, Record};
use crate::backend::{InteractiveControl, InteractiveRequest, Output, Signal};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use chrono::{DateTime, SecondsFormat};
use futures::stream::BoxStream;
use futures::StreamExt;
use kernelgate_protocol::e2b::{absolute_path, relative_path};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const SCRIPT: &str = include_str!("../../../assets/watch.py");

/// How often the program scans (a large tree less often: it spends at most a third of its
/// time scanning).
const INTERVAL: Duration = Duration::from_millis(150);
/// Watches a sandbox may run at once, streamed and polled together.
pub const MAX_WATCHES: usize = 16;
/// Events a polling watcher keeps until they are asked for; past it, new ones are dropped.
const MAX_EVENTS: usize = 4096;
/// The longest line taken from the program (a longer one is dropped).
const MAX_LINE: usize = 64 << 10;
/// How much of the program's standard error is kept, for the message when it fails.
const STDERR_TAIL: usize = 2048;
/// A keepalive on a stream this often unless the client asks otherwise
/// (`Keepalive-Ping-Interval`, seconds).
const KEEPALIVE: Duration = Duration::from_secs(30);
/// Messages of a stream waiting for a slow client (then the program waits).
const STREAM_QUEUE: usize = 64;

/// What a watch looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    /// Relative to the kernel's working directory (`""`: the home).
    rel: String,
    recursive: bool,
    /// Each event carries the entry's `EntryInfo` (not those of removes and renames).
    include_entry: bool,
}

/// A request's field by its protobuf name or its JSON name (Connect's JSON codec takes both).
fn field<'a>(
    request: &'a HashMap<String, Value>,
    name: &str,
    json_name: &str,
) -> Option<&'a Value> {
    request.get(json_name).or_else(|| request.get(name))
}

fn flag(request: &HashMap<String, Value>, name: &str, json_name: &str) -> bool {
    field(request, name, json_name)
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

impl Target {
    fn of(request: &HashMap<String, Value>) -> Result<Target, ConnectError> {
        let path = field(request, "path", "path")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let rel = relative_path(path)
            .map_err(|e| ConnectError::new("invalid_argument", e.to_string()))?;
        Ok(Target {
            rel,
            recursive: flag(request, "recursive", "recursive"),
            include_entry: flag(request, "include_entry", "includeEntry"),
        })
    }

    /// The E2B path of `name`, an event's name (relative to the watched directory).
    fn path_of(&self, name: &str) -> String {
        match self.rel.as_str() {
            "" => absolute_path(name),
            dir => absolute_path(&format!("{dir}/{name}")),
        }
    }
}

/// A change the program saw.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
struct Change {
    event: String,
    /// Relative to the watched directory.
    name: String,
    kind: String,
    size: u64,
    mode: u32,
    mtime_ns: i64,
}

/// A line of the program.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Line {
    /// The baseline is taken: changes from now on are events.
    Ready,
    /// The path cannot be watched (a Connect code and why), or no longer.
    Refused {
        code: &'static str,
        message: String,
    },
    Change(Change),
    /// Nothing: it only proves the program's output is still read.
    Heartbeat,
}

/// The program's Connect codes, as `'static` strings.
fn known_code(code: &str) -> &'static str {
    match code {
        "not_found" => "not_found",
        "invalid_argument" => "invalid_argument",
        "resource_exhausted" => "resource_exhausted",
        "permission_denied" => "permission_denied",
        _ => "internal",
    }
}

/// A line of the program's output; `None` when it is none of its lines.
fn parse_line(line: &[u8]) -> Option<Line> {
    let value: Value = serde_json::from_slice(line).ok()?;
    let object = value.as_object()?;
    if object.is_empty() {
        return Some(Line::Heartbeat);
    }
    if object.get("ready").and_then(Value::as_bool) == Some(true) {
        return Some(Line::Ready);
    }
    if let Some(code) = object.get("error").and_then(Value::as_str) {
        let message = object
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("the watch failed");
        return Some(Line::Refused {
            code: known_code(code),
            message: message.to_owned(),
        });
    }
    serde_json::from_value(value).ok().map(Line::Change)
}

/// A change as `filesystem.FilesystemEvent` in protobuf's JSON mapping; `None` for a kind
/// of change E2B has no event type for.
fn filesystem_event(change: &Change, target: &Target) -> Option<Value> {
    let kind = match change.event.as_str() {
        "create" => "EVENT_TYPE_CREATE",
        "write" => "EVENT_TYPE_WRITE",
        "remove" => "EVENT_TYPE_REMOVE",
        "rename" => "EVENT_TYPE_RENAME",
        "chmod" => "EVENT_TYPE_CHMOD",
        _ => return None,
    };
    let mut event = json!({"name": change.name, "type": kind});
    // A removed or renamed entry is no longer at its path: no entry, as envd does.
    if target.include_entry && !matches!(change.event.as_str(), "remove" | "rename") {
        event["entry"] = entry_info(change, target);
    }
    Some(event)
}

/// The entry of a change as `filesystem.EntryInfo`.
fn entry_info(change: &Change, target: &Target) -> Value {
    let (file_type, letter) = match change.kind.as_str() {
        "directory" => ("FILE_TYPE_DIRECTORY", 'd'),
        "file" => ("FILE_TYPE_FILE", '-'),
        "symlink" => ("FILE_TYPE_SYMLINK", 'L'),
        _ => ("FILE_TYPE_UNSPECIFIED", '?'),
    };
    let modified =
        DateTime::from_timestamp_nanos(change.mtime_ns).to_rfc3339_opts(SecondsFormat::Nanos, true);
    json!({
        "name": change.name.rsplit('/').next().unwrap_or_default(),
        "type": file_type,
        "path": target.path_of(&change.name),
        // int64 is a string in protobuf's JSON mapping.
        "size": change.size.to_string(),
        "mode": change.mode,
        "permissions": permissions(letter, change.mode),
        "owner": "user",
        "group": "user",
        "modifiedTime": modified,
    })
}

/// `mode` as `ls -l` shows it (and Go's `FileMode.String`, envd's): `-rw-r--r--`.
fn permissions(kind: char, mode: u32) -> String {
    std::iter::once(kind)
        .chain((0..9).map(|i| {
            let on = mode & (0o400 >> i) != 0;
            match (on, i % 3) {
                (false, _) => '-',
                (true, 0) => 'r',
                (true, 1) => 'w',
                (true, _) => 'x',
            }
        }))
        .collect()
}

/// Cuts the program's output into lines.
#[derive(Debug, Default)]
struct Lines {
    partial: Vec<u8>,
    /// The current line went past [`MAX_LINE`]: it is dropped up to its end.
    overlong: bool,
}

impl Lines {
    /// Takes `chunk`; answers the lines it completed (without their newline).
    fn push(&mut self, chunk: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut rest = chunk;
        while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
            if !self.overlong && self.partial.len() + nl <= MAX_LINE {
                self.partial.extend_from_slice(&rest[..nl]);
                out.push(std::mem::take(&mut self.partial));
            } else {
                tracing::warn!(
                    "a line of a directory watch's program past {MAX_LINE} bytes was dropped"
                );
            }
            self.partial.clear();
            self.overlong = false;
            rest = &rest[nl + 1..];
        }
        if self.partial.len() + rest.len() > MAX_LINE {
            self.partial.clear();
            self.overlong = true;
        } else if !self.overlong {
            self.partial.extend_from_slice(rest);
        }
        out
    }
}

/// The watch program running in a sandbox.
struct Program {
    output: BoxStream<'static, Result<Output, crate::backend::BackendError>>,
    control: Box<dyn InteractiveControl>,
    /// Held open: the program ends when it closes.
    _stdin: std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
    lines: Lines,
    pending: VecDeque<Vec<u8>>,
    stderr: Vec<u8>,
    sandbox: String,
}

impl std::fmt::Debug for Program {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Program")
            .field("sandbox", &self.sandbox)
            .finish_non_exhaustive()
    }
}

impl Program {
    /// Starts watching `target` in the call's sandbox (audited as a listing of it); answers
    /// once the baseline is taken, or why the path cannot be watched.
    async fn start(
        state: &AppState,
        call: &SandboxCall,
        target: &Target,
    ) -> Result<Program, ConnectError> {
        let kernels = &state.kernels;
        kernels
            .audit()
            .record(&Record::file(
                FileEvent::Listed,
                FileAccess {
                    key: call.key.clone(),
                    kernel: call.id.clone(),
                    path: target.rel.clone(),
                    bytes: None,
                    offset: None,
                    length: None,
                },
            ))
            .await;
        // A paused sandbox wakes for it, as for its files.
        let mut live = call.live.clone();
        if live.hibernated() {
            kernels.hibernation().resume(&live).await.map_err(|e| {
                ConnectError::new(
                    "unavailable",
                    format!("the paused sandbox could not be resumed: {e}"),
                )
            })?;
            live = kernels.get(&call.id).ok_or_else(|| {
                ConnectError::new("unavailable", "the sandbox ended while it was resumed")
            })?;
        }
        // `-P`: nothing in the kernel's home (a `json.py`) shadows what the program imports.
        let argv = [
            "python3",
            "-P",
            "-c",
            SCRIPT,
            &target.rel,
            if target.recursive { "1" } else { "0" },
            &INTERVAL.as_millis().to_string(),
        ]
        .map(str::to_owned)
        .to_vec();
        let request = InteractiveRequest {
            argv,
            env: Vec::new(),
            workdir: None,
            tty: None,
        };
        let interactive = kernels
            .backend()
            .exec_interactive(&live.handle(), request)
            .await
            .map_err(|e| {
                ConnectError::new(
                    "unavailable",
                    format!("cannot start watching in the sandbox: {e}"),
                )
            })?;
        let mut program = Program {
            output: interactive.output,
            control: interactive.control,
            _stdin: interactive.stdin,
            lines: Lines::default(),
            pending: VecDeque::new(),
            stderr: Vec::new(),
            sandbox: call.id.clone(),
        };
        let path = absolute_path(&target.rel);
        let first = tokio::time::timeout(kernels.command_timeout(), program.next()).await;
        let refusal = match first {
            Ok(Some(Line::Ready)) => return Ok(program),
            Ok(Some(Line::Refused { code, message })) => {
                ConnectError::new(code, format!("{path}: {message}"))
            }
            Ok(Some(other)) => ConnectError::new(
                "internal",
                format!("the watch program began with {other:?}, not its baseline"),
            ),
            Ok(None) => ConnectError::new(
                "internal",
                format!("cannot watch {path}: {}", program.why_it_ended()),
            ),
            Err(_) => ConnectError::new(
                "deadline_exceeded",
                format!(
                    "{path}: its first scan took longer than {} s: watch a smaller directory",
                    kernels.command_timeout().as_secs()
                ),
            ),
        };
        program.stop().await;
        Err(refusal)
    }

    /// Its next line; `None` once it ended. Cancel-safe: nothing read is lost.
    async fn next(&mut self) -> Option<Line> {
        loop {
            while let Some(line) = self.pending.pop_front() {
                match parse_line(&line) {
                    Some(line) => return Some(line),
                    None => {
                        tracing::warn!(kernel = %self.sandbox, line = %String::from_utf8_lossy(&line), "a directory watch's program printed something that is none of its lines")
                    }
                }
            }
            match self.output.next().await? {
                Ok(Output::Stdout(bytes)) => self.pending.extend(self.lines.push(&bytes)),
                Ok(Output::Stderr(bytes)) => {
                    self.stderr.extend_from_slice(&bytes);
                    let excess = self.stderr.len().saturating_sub(STDERR_TAIL);
                    self.stderr.drain(..excess);
                }
                Err(e) => {
                    tracing::debug!(kernel = %self.sandbox, error = %e, "a directory watch's output ended");
                    return None;
                }
            }
        }
    }

    /// Why it ended, for a message.
    fn why_it_ended(&self) -> String {
        match String::from_utf8_lossy(&self.stderr).trim() {
            "" => "the watch program in the sandbox ended (the sandbox ended or was paused)".into(),
            stderr => format!("the watch program in the sandbox failed: {stderr}"),
        }
    }

    async fn stop(self) {
        if let Err(e) = self.control.signal(Signal::Kill).await {
            tracing::debug!(kernel = %self.sandbox, error = %e, "cannot kill a directory watch's program (it ended already?)");
        }
    }
}

/// The events of a polling watcher since they were last asked for.
#[derive(Debug, Default)]
struct Buffer {
    events: VecDeque<Value>,
    /// Events dropped since, the buffer being full.
    dropped: u64,
    /// Why the watch ended, if it did.
    ended: Option<String>,
}

impl Buffer {
    /// Keeps `event`; drops it when [`MAX_EVENTS`] wait already (the older ones are kept:
    /// what is answered stays in order).
    fn push(&mut self, event: Value) {
        if self.events.len() >= MAX_EVENTS {
            self.dropped += 1;
        } else {
            self.events.push_back(event);
        }
    }

    /// The events kept, and how many were dropped since the last take.
    fn take(&mut self) -> (Vec<Value>, u64) {
        (
            self.events.drain(..).collect(),
            std::mem::take(&mut self.dropped),
        )
    }
}

/// A polling watcher (`CreateWatcher`).
#[derive(Debug)]
struct Polled {
    path: String,
    buffer: Mutex<Buffer>,
    /// Cancelled by `RemoveWatcher` (and at shutdown): its program is killed.
    stop: CancellationToken,
}

impl Polled {
    fn buffer(&self) -> std::sync::MutexGuard<'_, Buffer> {
        self.buffer.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A sandbox's watches.
#[derive(Debug, Default)]
struct Watches {
    /// Programs running, streamed and polled.
    running: usize,
    polled: HashMap<String, Arc<Polled>>,
}

/// The watches of every sandbox: how many run (at most [`MAX_WATCHES`] each), and the
/// polling watchers' events.
#[derive(Debug, Default)]
pub struct Watchers {
    by_sandbox: Mutex<HashMap<String, Watches>>,
}

/// A watch's place among its sandbox's [`MAX_WATCHES`], given back when dropped.
#[derive(Debug)]
struct Slot {
    watchers: Arc<Watchers>,
    sandbox: String,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut all = self.watchers.lock();
        if let Some(watches) = all.get_mut(&self.sandbox) {
            watches.running = watches.running.saturating_sub(1);
            if watches.running == 0 && watches.polled.is_empty() {
                all.remove(&self.sandbox);
            }
        }
    }
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Watches>> {
        self.by_sandbox.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place for one more watch of `sandbox`, if it has fewer than [`MAX_WATCHES`].
    fn claim(self: &Arc<Self>, sandbox: &str) -> Result<Slot, ConnectError> {
        let mut all = self.lock();
        let watches = all.entry(sandbox.to_owned()).or_default();
        if watches.running >= MAX_WATCHES {
            return Err(ConnectError::new(
                "resource_exhausted",
                format!(
                    "this sandbox watches {MAX_WATCHES} directories already, the most it may: \
                     stop one first (WatchHandle.stop())"
                ),
            ));
        }
        watches.running += 1;
        Ok(Slot {
            watchers: self.clone(),
            sandbox: sandbox.to_owned(),
        })
    }

    fn polled(&self, sandbox: &str, id: &str) -> Option<Arc<Polled>> {
        self.lock().get(sandbox)?.polled.get(id).cloned()
    }

    fn insert(&self, sandbox: &str, id: &str, polled: Arc<Polled>) {
        self.lock()
            .entry(sandbox.to_owned())
            .or_default()
            .polled
            .insert(id.to_owned(), polled);
    }

    fn remove(&self, sandbox: &str, id: &str) -> Option<Arc<Polled>> {
        let mut all = self.lock();
        let watches = all.get_mut(sandbox)?;
        let polled = watches.polled.remove(id);
        if watches.running == 0 && watches.polled.is_empty() {
            all.remove(sandbox);
        }
        polled
    }

    /// Forgets the watchers of sandboxes that ended (their programs ended with them).
    fn forget_ended(&self, alive: impl Fn(&str) -> bool) {
        self.lock().retain(|id, w| w.running > 0 || alive(id));
    }
}

mod serve;
pub use serve::{polled, watch_dir};

#[cfg(test)]
mod tests {
    use super::*;

    fn change(event: &str, name: &str, kind: &str) -> Change {
        Change {
            event: event.into(),
            name: name.into(),
            kind: kind.into(),
            size: 3,
            mode: 0o644,
            mtime_ns: 1_700_000_000_500_000_000,
        }
    }

    fn target(rel: &str, include_entry: bool) -> Target {
        Target {
            rel: rel.into(),
            recursive: true,
            include_entry,
        }
    }

    #[test]
    fn the_programs_lines_are_read() {
        assert_eq!(parse_line(br#"{"ready":true}"#), Some(Line::Ready));
        assert_eq!(parse_line(b"{}"), Some(Line::Heartbeat));
        assert_eq!(
            parse_line(br#"{"error":"not_found","message":"no such directory"}"#),
            Some(Line::Refused {
                code: "not_found",
                message: "no such directory".into()
            })
        );
        assert_eq!(
            parse_line(br#"{"error":"odd"}"#),
            Some(Line::Refused {
                code: "internal",
                message: "the watch failed".into()
            })
        );
        let line = br#"{"event":"create","name":"d/a.txt","kind":"file","size":3,"mode":420,"mtime_ns":1700000000500000000}"#;
        assert_eq!(
            parse_line(line),
            Some(Line::Change(change("create", "d/a.txt", "file")))
        );
        assert_eq!(parse_line(b"Traceback (most recent call last):"), None);
        assert_eq!(parse_line(br#"{"event":"create"}"#), None);
    }

    #[test]
    fn changes_are_e2bs_events() {
        let plain = target("", false);
        for (event, kind) in [
            ("create", "EVENT_TYPE_CREATE"),
            ("write", "EVENT_TYPE_WRITE"),
            ("remove", "EVENT_TYPE_REMOVE"),
            ("rename", "EVENT_TYPE_RENAME"),
            ("chmod", "EVENT_TYPE_CHMOD"),
        ] {
            assert_eq!(
                filesystem_event(&change(event, "a.txt", "file"), &plain),
                Some(json!({"name": "a.txt", "type": kind}))
            );
        }
        assert_eq!(
            filesystem_event(&change("moved", "a", "file"), &plain),
            None
        );

        let with_entry = target("work", true);
        let event =
            filesystem_event(&change("write", "d/a.txt", "file"), &with_entry).unwrap_or_default();
        assert_eq!(event["name"], "d/a.txt");
        assert_eq!(event["entry"]["name"], "a.txt");
        assert_eq!(event["entry"]["path"], "/home/user/work/d/a.txt");
        assert_eq!(event["entry"]["type"], "FILE_TYPE_FILE");
        assert_eq!(event["entry"]["size"], "3");
        assert_eq!(event["entry"]["permissions"], "-rw-r--r--");
        assert_eq!(
            event["entry"]["modifiedTime"],
            "2023-11-14T22:13:20.500000000Z"
        );
        let removed =
            filesystem_event(&change("remove", "d", "directory"), &with_entry).unwrap_or_default();
        assert!(removed.get("entry").is_none(), "a removed entry has none");
        assert_eq!(permissions('d', 0o750), "drwxr-x---");
    }

    #[test]
    fn requests_name_the_directory_under_the_home() {
        let request: HashMap<String, Value> = serde_json::from_value(
            json!({"path": "/home/user/w", "recursive": true, "includeEntry": true}),
        )
        .unwrap_or_default();
        assert_eq!(
            Target::of(&request).ok(),
            Some(Target {
                rel: "w".into(),
                recursive: true,
                include_entry: true
            })
        );
        let outside: HashMap<String, Value> =
            serde_json::from_value(json!({"path": "/etc"})).unwrap_or_default();
        assert_eq!(
            Target::of(&outside).err().map(|e| e.code),
            Some("invalid_argument")
        );
    }

    #[test]
    fn output_is_cut_into_lines_and_overlong_ones_dropped() {
        let mut lines = Lines::default();
        assert!(lines.push(b"{\"a\"").is_empty());
        assert_eq!(
            lines.push(b":1}\n{}\n{\"b"),
            vec![b"{\"a\":1}".to_vec(), b"{}".to_vec()]
        );
        let long = vec![b'x'; MAX_LINE + 1];
        assert!(lines.push(&long).is_empty());
        assert!(lines.push(b"yy").is_empty());
        assert_eq!(lines.push(b"\n{}\n"), vec![b"{}".to_vec()]);
    }

    #[test]
    fn a_full_buffer_keeps_the_first_events_and_counts_the_rest() {
        let mut buffer = Buffer::default();
        for i in 0..MAX_EVENTS + 5 {
            buffer.push(json!(i));
        }
        let (events, dropped) = buffer.take();
        assert_eq!(events.len(), MAX_EVENTS);
        assert_eq!(events[0], json!(0));
        assert_eq!(dropped, 5);
        buffer.push(json!("next"));
        assert_eq!(buffer.take(), (vec![json!("next")], 0));
    }

    #[test]
    fn a_sandbox_runs_at_most_its_watches() {
        let watchers = Arc::new(Watchers::default());
        let slots: Vec<Slot> = (0..MAX_WATCHES)
            .filter_map(|_| watchers.claim("s1").ok())
            .collect();
        assert_eq!(slots.len(), MAX_WATCHES);
        assert_eq!(
            watchers.claim("s1").err().map(|e| e.code),
            Some("resource_exhausted")
        );
        assert!(watchers.claim("s2").is_ok(), "another sandbox has its own");
        drop(slots);
        assert!(watchers.claim("s1").is_ok());
        assert!(watchers.lock().is_empty(), "nothing is kept for no watch");
    }
}
