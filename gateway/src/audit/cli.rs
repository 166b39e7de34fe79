//! `kernelgate audit`: the log read back, filtered and printed.

use serde_json::Value;
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
pub(super) fn one_line(text: &str, max: usize) -> String {
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
