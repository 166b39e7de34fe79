//! The registry-at-scale table: per point (nodes × kernels), the baseline's cluster code
//! and this tree's, one row each.

use super::{fmt, num};
use serde_json::Value;

const BUILDS: [&str; 2] = ["baseline", "current"];

pub(super) fn table(m: &Value) -> String {
    let r = &m["registry"];
    let mut out = String::from(
        "\n| registry at scale | build | etcd CPU (cores) | etcd RSS, max (MiB) | keep-alive p99 (ms) | \
         leases lost | look-up p99 (ms) | new node routes after (s) | registry calls/s \
         (keep-alive / list / txn / other) | simulated nodes' CPU (cores) |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut notes = Vec::new();
    for row in r["points"].as_array().into_iter().flatten() {
        let point = format!(
            "{} nodes × {} kernels",
            thousands(&row["nodes"]),
            thousands(&row["kernels"])
        );
        for build in BUILDS {
            let p = &row[build];
            if p.is_null() {
                continue;
            }
            let label = build_label(r, build);
            if let Some(why) = p["skipped"].as_str().or(p["error"].as_str()) {
                out.push_str(&format!("| {point} | {label} | {why} | | | | | | | |\n"));
                continue;
            }
            let w = &p["window"];
            let calls = &w["calls"];
            let per_s = |kind: &str| num(&calls[kind]["per_s"]).unwrap_or(0.0);
            let other: f64 = ["grant", "revoke", "put", "create", "delete_if", "watch"]
                .iter()
                .map(|k| per_s(k))
                .sum();
            let cut = match p["cut_short"].as_str() {
                Some(why) => {
                    notes.push(format!("{point}, {label}: cut short, {why}."));
                    " (cut short)"
                }
                None => "",
            };
            out.push_str(&format!(
                "| {point}{cut} | {label} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                fmt(num(&w["etcd"]["cpu_cores"]), 2),
                fmt(num(&w["etcd"]["rss_max_mib"]), 0),
                fmt(num(&w["keep_alive_ms"]["p99"]), 1),
                fmt(num(&w["leases_lost"]), 0),
                fmt(num(&w["lookup_ms"]["p99"]), 1),
                fmt(num(&p["join"]["routes_s"]), 2),
                if calls.is_object() {
                    format!(
                        "{:.0} / {:.1} / {:.1} / {:.1}",
                        per_s("keep_alive"),
                        per_s("list"),
                        per_s("txn"),
                        other
                    )
                } else {
                    "—".to_owned()
                },
                fmt(num(&w["simulator"]["cpu_cores"]), 2),
            ));
        }
    }
    let s = &r["settings"];
    out.push_str(&format!(
        "\nEach point: a fresh etcd (Debian's etcd-server), the nodes simulated in one process, \
         each a real `Membership` with its own etcd client: its lease loop (TTL {} s), its \
         watches, a reconcile every {} s, {} creates/s and {} deletes/s spread over the nodes, \
         {} owner look-ups/s (a random node finds the owner of a random kernel as it would to \
         route a request: the baseline in its watched view, the current build in its cache \
         or by one read); kernels preloaded through the nodes first. Measured over a {} s \
         window; then a new node joins under the same load (\"routes after\": until it finds \
         a given kernel's owner). etcd and the simulated nodes share the machine's cores (the last column), \
         so a point where they saturate them says more about the machine than about etcd.\n",
        s["ttl_s"],
        s["reconcile_s"],
        s["creates_per_s"],
        s["deletes_per_s"],
        s["lookups_per_s"],
        s["window_s"],
    ));
    for note in notes {
        out.push_str(&format!("{note}\n"));
    }
    out
}

/// "baseline (rev)", or "current (rev)".
fn build_label(r: &Value, build: &str) -> String {
    match r["builds"][build].as_str() {
        Some(rev) if !rev.is_empty() => format!("{build} ({rev})"),
        _ => build.to_owned(),
    }
}

/// `100000` as `100,000`.
fn thousands(v: &Value) -> String {
    let digits = v.as_u64().map(|n| n.to_string()).unwrap_or_default();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
