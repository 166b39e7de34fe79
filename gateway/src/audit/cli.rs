//! `kernelgate audit`: the log read back, filtered and printed.

use super::{Entry, Record};
use std::io::Write;

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
    let unknown = print(args, &text, since, &mut std::io::stdout().lock())?;
    if unknown > 0 {
        eprintln!(
            "{unknown} line(s) of {} are not records this version of kernelgate knows \
             (another version's, or damaged); `--json` does not show them either",
            path.display()
        );
    }
    Ok(())
}

/// The records of `text` (a log) that `args` asks for, as a table or JSON lines; how many
/// lines were not records.
pub(super) fn print(
    args: &crate::config::AuditArgs,
    text: &str,
    since: Option<chrono::DateTime<chrono::Utc>>,
    out: &mut impl Write,
) -> std::io::Result<usize> {
    if !args.json {
        writeln!(
            out,
            "{:<27} {:<20} {:<12} {:<36} {:<8} DETAIL",
            "TIME", "EVENT", "KEY", "KERNEL", "STATUS"
        )?;
    }
    let mut unknown = 0;
    for line in text.lines() {
        let entry = match Entry::parse(line) {
            None => continue,
            Some(Ok(entry)) => entry,
            Some(Err(_)) => {
                unknown += 1;
                continue;
            }
        };
        let r = &entry.record;
        if args.kernel.as_ref().is_some_and(|k| r.kernel() != Some(k))
            || args.key.as_ref().is_some_and(|k| !r.names_key(k))
        {
            continue;
        }
        if let Some(since) = since {
            let at = chrono::DateTime::parse_from_rfc3339(&entry.time)
                .map(|t| t.with_timezone(&chrono::Utc));
            if at.map_or(true, |t| t < since) {
                continue;
            }
        }
        if args.json {
            writeln!(out, "{}", line.trim())?;
            continue;
        }
        let status = match r {
            Record::ExecutionFinished { status, .. } => status.as_str(),
            _ => "",
        };
        writeln!(
            out,
            "{:<27} {:<20} {:<12} {:<36} {:<8} {}",
            entry.time,
            r.event(),
            r.key().unwrap_or_default(),
            r.kernel().unwrap_or_default(),
            status,
            detail(r)
        )?;
    }
    Ok(unknown)
}

/// The table's last column: what the record says in a few words.
fn detail(r: &Record) -> String {
    match r {
        Record::ExecutionRequested { code, .. } => crate::text::cut(&code.replace('\n', "⏎"), 60),
        Record::ExecutionFinished {
            duration_ms,
            output_bytes,
            ename,
            truncated,
            ..
        } => format!(
            "{duration_ms} ms, {output_bytes} bytes out{}{}",
            ename.as_ref().map(|e| format!(", {e}")).unwrap_or_default(),
            if *truncated { ", truncated" } else { "" }
        ),
        Record::FileListed(a)
        | Record::FileRead(a)
        | Record::FileWritten(a)
        | Record::FileDeleted(a) => a.path.clone(),
        Record::AuthRefused { client, path } => {
            format!("{} {path}", client.as_deref().unwrap_or_default())
        }
        Record::InternalHeadersRefused {
            client,
            path,
            unrecorded,
            ..
        } => format!(
            "{} {path} ({unrecorded} unrecorded before)",
            client.as_deref().unwrap_or_default()
        ),
        Record::KernelDied { why, .. } => why.clone(),
        _ => String::new(),
    }
}
