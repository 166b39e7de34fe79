//! The engines' tables: Docker+runc, Docker+gVisor and the gVisor engine (kernels started
//! from its template, and booted), in the same rounds; hibernation, snapshots and forks by
//! engine.

use super::{fmt, num, ratio_cell};
use serde_json::Value;

/// (label, metric, decimals): each row of the table.
const ROWS: [(&str, &str, usize); 5] = [
    ("cold create (ms)", "create_ms", 0),
    (
        "first `import numpy, pandas, matplotlib.pyplot` (ms)",
        "imports_ms",
        0,
    ),
    ("`1+1` round trip, p50 (ms)", "rt_ms", 2),
    ("20 MiB stream (MiB/s)", "stream_mib_s", 1),
    ("memory charged per idle kernel (MiB)", "idle_mib", 1),
];

const SIDES: [&str; 4] = [
    "docker-runc",
    "docker-runsc",
    "engine-gvisor",
    "engine-boot",
];

pub(super) fn table(m: &Value) -> String {
    let e = &m["engines"];
    if e["skipped"].is_string() {
        return "\nEngines: gVisor is not set up (`make gvisor`), so they were not compared.\n"
            .to_owned();
    }
    if e["engine-boot"].is_null() {
        return three_sides(e);
    }
    let mut out = String::from(
        "\n| engines (median of rounds) | Docker+runc | Docker+gVisor | gVisor engine, template starts | gVisor engine, booted | \
         Docker+runc / Docker+gVisor | engine, template / Docker+gVisor | engine, booted / Docker+gVisor |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (label, key, decimals) in ROWS {
        let cell = |side: &str| fmt(num(&e[side][key]["median"]), decimals);
        out.push_str(&format!(
            "| {label} | {} | {} | {} | {} | {} | {} | {} |\n",
            cell(SIDES[0]),
            cell(SIDES[1]),
            cell(SIDES[2]),
            cell(SIDES[3]),
            ratio_cell(&e[SIDES[0]][key]["ratio"]),
            ratio_cell(&e[SIDES[2]][key]["ratio"]),
            ratio_cell(&e[SIDES[3]][key]["ratio"]),
        ));
    }
    let s = &e["settings"];
    out.push_str(&format!(
        "\nFour release gateways, measured one after the other in each of {} rounds; ratios are \
         taken within a round (median, min-max). Template starts restore a checkpoint of a \
         preloaded kernel, so the scientific stack is imported already. Round trip: p50 of {} \
         runs; memory: the median of the {} idle kernels' cgroups (`memory.usage_in_bytes`: the \
         kernel, and gVisor's sentry and gofer) with a {} MiB limit each.\n",
        s["rounds"], s["rt_runs"], s["idle_kernels"], s["kernel_memory_mb"],
    ));
    out.push_str(&checkpoint_table(&e["checkpoint"]));
    out.push_str(&snapshot_table(&e["snapshots"]));
    out
}

/// The table of samples from before template starts: three sides, the engine's kernels
/// booted.
fn three_sides(e: &Value) -> String {
    let mut out = String::from(
        "\n| engines (median of rounds) | Docker+runc | Docker+gVisor | gVisor engine | \
         Docker+runc / Docker+gVisor | gVisor engine / Docker+gVisor |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    for (label, key, decimals) in ROWS {
        let cell = |side: &str| fmt(num(&e[side][key]["median"]), decimals);
        out.push_str(&format!(
            "| {label} | {} | {} | {} | {} | {} |\n",
            cell(SIDES[0]),
            cell(SIDES[1]),
            cell(SIDES[2]),
            ratio_cell(&e[SIDES[0]][key]["ratio"]),
            ratio_cell(&e[SIDES[2]][key]["ratio"]),
        ));
    }
    let s = &e["settings"];
    out.push_str(&format!(
        "\nThree release gateways, one per engine, measured one after the other in each of {} \
         rounds; ratios are taken within a round (median, min-max). Round trip: p50 of {} runs; \
         memory: the median of the {} idle kernels' cgroups (`memory.usage_in_bytes`: the kernel, \
         and gVisor's sentry and gofer) with a {} MiB limit each.\n",
        s["rounds"], s["rt_runs"], s["idle_kernels"], s["kernel_memory_mb"],
    ));
    out
}

/// Hibernation by engine: Python-level under Docker, the whole kernel under the engine.
fn checkpoint_table(c: &Value) -> String {
    if c.is_null() {
        return String::new();
    }
    let sides = ["docker-runc", "docker-runsc", "engine-gvisor"];
    let mut out = String::from(
        "\n| hibernation (median of rounds) | Docker+runc, Python-level | Docker+gVisor, Python-level | gVisor engine, whole kernel | engine / Docker+gVisor |\n\
         |---|---:|---:|---:|---:|\n",
    );
    let rows: [(&str, &str, usize); 3] = [
        (
            "hibernate, 100 MiB array + 1M-row DataFrame (ms)",
            "hibernate_ms",
            0,
        ),
        ("resume, the execute that wakes it (ms)", "resume_ms", 0),
        ("its state on disk (MiB)", "state_mib", 1),
    ];
    for (label, key, decimals) in rows {
        let cell = |side: &str| fmt(num(&c[side][key]["median"]), decimals);
        out.push_str(&format!(
            "| {label} | {} | {} | {} | {} |\n",
            cell(sides[0]),
            cell(sides[1]),
            cell(sides[2]),
            ratio_cell(&c[sides[2]][key]["ratio"]),
        ));
    }
    let idle: [(&str, &str); 3] = [
        (
            "memory charged per idle kernel, running (MiB)",
            "running_mib",
        ),
        (
            "memory charged per idle kernel, hibernated (MiB)",
            "hibernated_mib",
        ),
        ("an idle kernel's state on disk (MiB)", "disk_mib"),
    ];
    for (label, key) in idle {
        let cell = |side: &str| fmt(num(&c[side]["idle"][key]), 1);
        out.push_str(&format!(
            "| {label} | {} | {} | {} | |\n",
            cell(sides[0]),
            cell(sides[1]),
            cell(sides[2]),
        ));
    }
    out.push_str(&format!(
        "\nOn the same gateways, one kernel per side and round ({} rounds), side after side: \
         hibernated with `POST /api/kernels/{{id}}/hibernate` and woken by the execute that \
         reads its array and frame back. Then {} idle kernels per side, running and hibernated \
         (their cgroups' memory; none is left once they hibernate).\n",
        c["settings"]["rounds"], c["settings"]["idle_kernels"],
    ));
    out
}

/// Snapshots and forks by engine, each against rebuilding the state in a fresh kernel.
fn snapshot_table(c: &Value) -> String {
    if c.is_null() {
        return String::new();
    }
    let sides = ["docker-runc", "docker-runsc", "engine-gvisor"];
    let mut out = String::from(
        "\n| snapshots (median of rounds; vs a rebuild on the same side) | Docker+runc, Python-level | Docker+gVisor, Python-level | gVisor engine, whole kernel |\n\
         |---|---:|---:|---:|\n",
    );
    let rows: [(&str, &str); 4] = [
        ("snapshot, the kernel running on (ms)", "snapshot_ms"),
        (
            "a kernel from the snapshot, until its first cell answered (ms)",
            "create_ms",
        ),
        (
            "fork of 3, until each fork's first cell answered (ms)",
            "fork3_ms",
        ),
        (
            "rebuild: a fresh create that runs the cells again (ms)",
            "rebuild_ms",
        ),
    ];
    for (label, key) in rows {
        let cell = |side: &str| {
            let m = &c[side][key];
            if key == "rebuild_ms" {
                fmt(num(&m["median"]), 0)
            } else {
                format!("{}, {}", fmt(num(&m["median"]), 0), ratio_cell(&m["ratio"]))
            }
        };
        out.push_str(&format!(
            "| {label} | {} | {} | {} |\n",
            cell(sides[0]),
            cell(sides[1]),
            cell(sides[2]),
        ));
    }
    let size = |side: &str| fmt(num(&c[side]["size_mib"]), 1);
    out.push_str(&format!(
        "| the snapshot on disk (MiB) | {} | {} | {} |\n",
        size(sides[0]),
        size(sides[1]),
        size(sides[2]),
    ));
    out.push_str(&format!(
        "\nOn the same gateways, side after side in each of {} rounds, a kernel holding a 100 MiB \
         array and a 1M-row DataFrame: `POST /api/kernels/{{id}}/snapshots`, `POST /api/kernels` \
         with the snapshot until `{}` answered, `POST /api/kernels/{{id}}/fork` with `count` {} \
         until each fork answered it, and a fresh create running the cells again until it \
         answered. After each time, its ratio to that round's rebuild of one kernel on the same \
         side (median, min-max): a fork of 3 is set against one rebuild, not three.\n",
        c["settings"]["rounds"],
        c["settings"]["check"].as_str().unwrap_or_default(),
        c["settings"]["forks"],
    ));
    out
}
