//! The audit trail's unit tests: the file, its rotation, the writer thread (order, group
//! commit, a log that takes no writes), the documented events.
use super::*;
use std::time::Duration;

#[tokio::test]
async fn records_are_json_lines_in_a_private_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("sub/audit.log");
    for fsync in [false, true] {
        let audit = Audit::open(&path, fsync).expect("open");
        let _earlier = audit.record(&Record::KernelCreated {
            kernel: "k1".into(),
            key: "alice".into(),
            spec: "python3".into(),
            source: Source::Pool,
            snapshot: None,
        });
        // Waiting for the later record covers the earlier one.
        audit
            .record(&Record::AuthRefused {
                client: Some("127.0.0.1".into()),
                path: "/api/kernels".into(),
            })
            .await;
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
    audit.reopen().await.expect("reopen");
    audit
        .record(&Record::KernelCulled {
            kernel: "after-rotation".into(),
        })
        .await;
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
                    audit
                        .record(&Record::KernelCulled {
                            kernel: format!("{t}-{i}"),
                        })
                        .wait_blocking();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("join");
    }
    let text = std::fs::read_to_string(&path).expect("read");
    assert_eq!(text.lines().count(), 400);
    // Each thread's records are in the order it made them.
    for t in 0..8 {
        let mine: Vec<String> = text
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).expect("json"))
            .filter_map(|r| r["kernel"].as_str().map(str::to_owned))
            .filter(|k| k.starts_with(&format!("{t}-")))
            .collect();
        let expected: Vec<String> = (0..50).map(|i| format!("{t}-{i}")).collect();
        assert_eq!(mine, expected);
    }
    let inner = audit.inner.as_ref().expect("enabled");
    assert_eq!(*inner.done.borrow(), 400);
}

#[tokio::test]
async fn making_a_record_does_not_wait_for_the_disk() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("audit.log");
    let audit = Audit::open(&path, true).expect("open");
    let made: Vec<Written> = (0..1000)
        .map(|i| {
            audit.record(&Record::KernelCulled {
                kernel: format!("k{i}"),
            })
        })
        .collect();
    let last = made.into_iter().fold(Written::default(), Written::and);
    last.await;
    let text = std::fs::read_to_string(&path).expect("read");
    assert_eq!(text.lines().count(), 1000);
    assert!(text.lines().last().is_some_and(|l| l.contains("\"k999\"")));
    assert!(!Audit::disabled()
        .record(&Record::KernelCulled { kernel: "x".into() })
        .is_pending());
}

#[tokio::test]
async fn a_log_that_takes_no_writes_blocks_no_one_who_makes_records() {
    use std::io::Read;
    let dir = tempfile::tempdir().expect("tempdir");
    let fifo = dir.path().join("audit.fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    assert!(made.expect("mkfifo").success());
    let (go, wait) = std::sync::mpsc::channel::<()>();
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            let mut pipe = std::fs::File::open(&fifo).expect("open the fifo");
            wait.recv().expect("go");
            let mut text = String::new();
            let mut buf = vec![0; 1 << 16];
            while text.lines().count() < 2000 {
                let n = pipe.read(&mut buf).expect("read");
                assert!(n > 0, "the writer closed early");
                text.push_str(std::str::from_utf8(&buf[..n]).expect("utf-8"));
            }
            text
        })
    };
    let audit = Audit::open(&fifo, false).expect("open");
    // About 500 KB: far more than a pipe holds, so the writer is stuck until it is read.
    let last = (0..2000)
        .map(|i| {
            audit.record(&Record::KernelCulled {
                kernel: format!("{i:04}-{}", "x".repeat(200)),
            })
        })
        .fold(Written::default(), Written::and);
    assert!(last.is_pending());
    let early = tokio::time::timeout(Duration::from_millis(300), last.clone()).await;
    assert!(early.is_err(), "written before anyone read the pipe");
    go.send(()).expect("go");
    last.await;
    let text = reader.join().expect("reader");
    let order: Vec<&str> = text
        .lines()
        .map(|l| &l[l.find("\"kernel\":\"").expect("kernel") + 10..][..4])
        .collect();
    let expected: Vec<String> = (0..2000).map(|i| format!("{i:04}")).collect();
    assert_eq!(order, expected);
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

/// Records of every shape (flattened senders, a newtype variant, left-out empty fields,
/// nested package records), as the writer writes them.
fn samples() -> Vec<Record> {
    let sender = Sender {
        key: "alice".into(),
        username: "u".into(),
        agent_id: Some(Value::String("agent-7".into())),
        kernel: "k1".into(),
        session: "s".into(),
        msg_id: "m1".into(),
    };
    vec![
        Record::KernelCreated {
            kernel: "k1".into(),
            key: "alice".into(),
            spec: "python3".into(),
            source: Source::Cold,
            snapshot: None,
        },
        Record::ExecutionRequested {
            sender: sender.clone(),
            code: "x = 1\nprint(x)".into(),
            code_sha256: sha256("x = 1\nprint(x)"),
            user_expressions: Map::new(),
            silent: false,
        },
        Record::ExecutionFinished {
            key: "alice".into(),
            kernel: "k1".into(),
            msg_id: Some("m1".into()),
            session: None,
            code_sha256: None,
            status: "error".into(),
            ename: Some("ZeroDivisionError".into()),
            reason: None,
            duration_ms: 12,
            output_bytes: 3,
            output: "1\n".into(),
            truncated: true,
            ran: None,
        },
        Record::FileRead(FileAccess {
            key: "bob".into(),
            kernel: "k2".into(),
            path: "data.csv".into(),
            bytes: Some(10),
            offset: None,
            length: None,
        }),
        Record::KernelHibernated {
            kernel: "k2".into(),
            owner: "bob".into(),
            bytes: 4096,
            took_ms: 80,
            dropped: Vec::new(),
        },
        Record::KernelDeleted {
            kernel: "k2".into(),
            owner: "bob".into(),
            key: None,
            reason: Some("the key was revoked".into()),
        },
        Record::PackagesInstalled {
            key: "alice".into(),
            kernel: "k1".into(),
            requested: vec!["six".into()],
            allowed: vec!["six".into()],
            kernel_reported: KernelReportedInstall {
                installed: vec![PackageVersion {
                    name: "six".into(),
                    version: "1.16.0".into(),
                }],
                already: Vec::new(),
                refused: vec![PackageRefusal {
                    requirement: "evil".into(),
                    reason: "not allowed".into(),
                }],
                exit_code: 0,
            },
        },
        Record::PolicyDecision {
            sender,
            msg_type: "execute_request".into(),
            decision: "deny".into(),
            rule: Some(2),
            reason: None,
            matched: Some("os.system".into()),
            approval_id: None,
            by: None,
        },
        Record::AuthRefused {
            client: Some("127.0.0.1".into()),
            path: "/api/kernels".into(),
        },
    ]
}

#[tokio::test]
async fn every_record_reads_back_as_the_one_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("audit.log");
    let audit = Audit::open(&path, false).expect("open");
    let written = samples();
    for r in &written {
        audit.record(r).await;
    }
    let text = std::fs::read_to_string(&path).expect("read");
    let read: Vec<Entry> = text
        .lines()
        .map(|l| Entry::parse(l).expect("not blank").expect("a record"))
        .collect();
    assert_eq!(read.len(), written.len());
    for (entry, record) in read.iter().zip(&written) {
        assert_eq!(
            serde_json::to_value(&entry.record).expect("json"),
            serde_json::to_value(record).expect("json"),
        );
        assert!(entry.time.ends_with('Z'), "{}", entry.time);
    }
    assert_eq!(read[1].record.kernel(), Some("k1"));
    assert_eq!(read[1].record.key(), Some("alice"));
    assert_eq!(read[3].record.event(), "file_read");
    assert_eq!(
        read[5].record.key(),
        Some("bob"),
        "the owner when no key acted"
    );
    assert_eq!(read[8].record.kernel(), None);
}

#[tokio::test]
async fn kernelgate_audit_filters_typed_records_and_counts_unknown_lines() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("audit.log");
    let audit = Audit::open(&path, false).expect("open");
    for r in &samples() {
        audit.record(r).await;
    }
    let mut text = std::fs::read_to_string(&path).expect("read");
    text.push_str("{\"time\":\"2026-01-01T00:00:00Z\",\"event\":\"from_the_future\"}\n\n");
    let table = |kernel: Option<&str>, key: Option<&str>, json: bool| {
        let args = crate::config::AuditArgs {
            file: None,
            kernel: kernel.map(Into::into),
            key: key.map(Into::into),
            since: None,
            json,
        };
        let mut out = Vec::new();
        let unknown = cli::print(&args, &text, None, &mut out).expect("print");
        (String::from_utf8(out).expect("utf-8"), unknown)
    };
    let (all, unknown) = table(None, None, false);
    assert_eq!(unknown, 1, "the unknown event is counted, not shown");
    assert_eq!(all.lines().count(), 1 + samples().len(), "{all}");
    assert!(all.lines().next().is_some_and(|h| h.starts_with("TIME")));
    assert!(all.contains("x = 1⏎print(x)"), "{all}");
    assert!(
        all.contains("12 ms, 3 bytes out, ZeroDivisionError, truncated"),
        "{all}"
    );
    let (bobs, _) = table(None, Some("bob"), false);
    let events: Vec<&str> = bobs
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    assert_eq!(events, ["file_read", "kernel_hibernated", "kernel_deleted"]);
    let (k1, _) = table(Some("k1"), None, true);
    let k1: Vec<Value> = k1
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(k1.len(), 5, "{k1:?}");
    assert!(k1.iter().all(|r| r["kernel"] == "k1"), "{k1:?}");
}
