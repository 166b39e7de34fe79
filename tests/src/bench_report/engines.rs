//! The engines' table: Docker+runc, Docker+gVisor and the gVisor engine, in the same rounds.

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

const SIDES: [&str; 3] = ["docker-runc", "docker-runsc", "engine-gvisor"];

pub(super) fn table(m: &Value) -> String {
    let e = &m["engines"];
    if e["skipped"].is_string() {
        return "\nEngines: gVisor is not set up (`make gvisor`), so they were not compared.\n"
            .to_owned();
    }
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
