//! The markdown tables of a benchmark run, from its `bench-results.json` alone: `make bench`
//! prints them, and the docs test renders them again from the committed
//! docs/bench-results.json to check that the README and docs/performance.md quote them as
//! they are.

use serde_json::Value;

mod engines;
mod registry;

fn num(v: &Value) -> Option<f64> {
    v.as_f64().filter(|x| x.is_finite())
}

fn fmt(v: Option<f64>, decimals: usize) -> String {
    v.map(|x| format!("{x:.decimals$}"))
        .unwrap_or_else(|| "—".to_owned())
}

/// One row: how to read each side's value, how many decimals, the target.
struct Row {
    label: &'static str,
    metric: &'static str,
    field: &'static str,
    decimals: usize,
    target: &'static str,
    /// Whether Kernelgate met the target, from (kernelgate, direct).
    check: fn(f64, Option<f64>) -> Option<bool>,
}

fn none(_: f64, _: Option<f64>) -> Option<bool> {
    None
}

const ROWS: &[Row] = &[
    Row {
        label: "create, cold: POST /api/kernels to first kernel_info reply (ms, median)",
        metric: "create_cold_ms",
        field: "median",
        decimals: 0,
        target: "≤ 2x direct (local ipykernel start)",
        check: |k, d| d.map(|d| k <= 2.0 * d),
    },
    Row {
        label: "create, from the warm pool (ms, median)",
        metric: "create_warm_ms",
        field: "median",
        decimals: 1,
        target: "< 50 ms",
        check: |k, _| Some(k < 50.0),
    },
    Row {
        label: "execute `1+1` round trip p50 (ms)",
        metric: "execute_rt_ms",
        field: "p50",
        decimals: 3,
        target: "≤ 1.15x direct",
        check: |k, d| d.map(|d| k <= 1.15 * d),
    },
    Row {
        label: "execute `1+1` round trip p90 (ms)",
        metric: "execute_rt_ms",
        field: "p90",
        decimals: 3,
        target: "",
        check: none,
    },
    Row {
        label: "execute `1+1` round trip p99 (ms)",
        metric: "execute_rt_ms",
        field: "p99",
        decimals: 3,
        target: "",
        check: none,
    },
    Row {
        label: "stream: print 20 MiB (MiB/s)",
        metric: "stream_mib_s",
        field: "median",
        decimals: 1,
        target: "≥ 0.9x direct",
        check: |k, d| d.map(|d| k >= 0.9 * d),
    },
    Row {
        label: "matplotlib PNG round trip (ms, median)",
        metric: "png_rt_ms",
        field: "median",
        decimals: 1,
        target: "",
        check: none,
    },
    Row {
        label: "10 kernels executing `1+1` in parallel, 10 s (executes/s)",
        metric: "parallel_exec_s",
        field: "rate",
        decimals: 0,
        target: "",
        check: none,
    },
    Row {
        label: "gateway RSS, 0 kernels (MiB)",
        metric: "rss",
        field: "base_mib",
        decimals: 1,
        target: "",
        check: none,
    },
    Row {
        label: "gateway RSS, 50 idle kernels (MiB)",
        metric: "rss",
        field: "loaded_mib",
        decimals: 1,
        target: "",
        check: none,
    },
    Row {
        label: "gateway RSS per idle kernel (MiB)",
        metric: "rss",
        field: "per_kernel_mib",
        decimals: 3,
        target: "< 0.5 MiB",
        check: |k, _| Some(k < 0.5),
    },
];

/// The results table plus the run's settings and machine, as markdown.
/// The stages of one execute the bench times, in the order a cell meets them, then the way
/// back (`bench --stages-only`, and the README's share of the round trip).
pub const STAGES: [&str; 8] = [
    "ws_decode",
    "auth_tenant",
    "policy",
    "audit",
    "routing",
    "signing",
    "zmq_hop",
    "back",
];

/// A section of the bench run alone (`bench --only NAME`): its own workload and table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    Mcp,
    Stages,
    Walls,
    Restart,
    Cluster,
    Hibernate,
    Packages,
    Versions,
    E2b,
    Engines,
    Registry,
}

impl Section {
    pub const ALL: [Section; 11] = [
        Section::Mcp,
        Section::Stages,
        Section::Walls,
        Section::Restart,
        Section::Cluster,
        Section::Hibernate,
        Section::Packages,
        Section::Versions,
        Section::E2b,
        Section::Engines,
        Section::Registry,
    ];

    /// Its name on the command line and in the samples' `settings.only`.
    pub fn name(self) -> &'static str {
        match self {
            Section::Mcp => "mcp",
            Section::Stages => "stages",
            Section::Walls => "walls",
            Section::Restart => "restart",
            Section::Cluster => "cluster",
            Section::Hibernate => "hibernate",
            Section::Packages => "packages",
            Section::Versions => "versions",
            Section::E2b => "e2b",
            Section::Engines => "engines",
            Section::Registry => "registry",
        }
    }

    /// The section a run's settings name: `only`, or the `<name>_only` flag samples
    /// written before `--only` carry.
    pub fn of(settings: &Value) -> Option<Section> {
        let named = settings["only"].as_str();
        Section::ALL.into_iter().find(|s| {
            named == Some(s.name()) || settings[format!("{}_only", s.name())] == Value::Bool(true)
        })
    }
}

impl std::str::FromStr for Section {
    type Err = anyhow::Error;

    fn from_str(name: &str) -> anyhow::Result<Section> {
        Section::ALL
            .into_iter()
            .find(|s| s.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Section::ALL.iter().map(|s| s.name()).collect();
                anyhow::anyhow!("no bench section {name:?}: one of {}", names.join(", "))
            })
    }
}

pub fn markdown(doc: &Value) -> String {
    let m = &doc["metrics"];
    match Section::of(&doc["settings"]) {
        Some(Section::Mcp) => return tool_call_table(m),
        Some(Section::Stages) => return stages_table(m),
        Some(Section::Walls) => return walls_table(m),
        Some(Section::Restart) => return restart_table(m),
        Some(Section::Cluster) => return cluster_table(m),
        Some(Section::Hibernate) => return hibernate_table(m),
        Some(Section::Packages) => return packages_table(m),
        Some(Section::Versions) => return versions_table(m),
        Some(Section::E2b) => return e2b_table(m),
        Some(Section::Engines) => return engines::table(m),
        Some(Section::Registry) => return registry::table(m),
        None => {}
    }
    let mut out = String::new();
    out.push_str("| metric | Kernelgate | JKG | direct ZMQ | ratio vs direct | target | met? |\n");
    out.push_str("|---|---:|---:|---:|---:|---|---|\n");
    for row in ROWS {
        let get = |side: &str| num(&m[row.metric][side][row.field]);
        let (k, j, d) = (get("kernelgate"), get("jkg"), get("direct"));
        let ratio = match (k, d) {
            (Some(k), Some(d)) if d > 0.0 => format!("{:.2}x", k / d),
            _ => "—".to_owned(),
        };
        let met = match k.and_then(|k| (row.check)(k, d)) {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "",
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {ratio} | {} | {met} |\n",
            row.label,
            fmt(k, row.decimals),
            fmt(j, row.decimals),
            fmt(d, row.decimals),
            row.target,
        ));
    }
    let intact = |side: &str| match m["stream_mib_s"][side]["intact"].as_bool() {
        Some(true) => "yes",
        Some(false) => "**no**",
        None => "—",
    };
    let all_intact = m["stream_mib_s"]["kernelgate"]["intact"].as_bool() == Some(true);
    out.push_str(&format!(
        "| stream: every byte arrived intact | {} | {} | {} | | yes | {} |\n",
        intact("kernelgate"),
        intact("jkg"),
        intact("direct"),
        if all_intact { "yes" } else { "**no**" }
    ));
    let s = &doc["settings"];
    let mach = &doc["machine"];
    out.push_str(&format!(
        "\nKernelgate: each kernel in a Docker container (ipc sockets bind-mounted), release \
         build, WebSocket client. JKG: Jupyter Kernel Gateway, kernels as local processes (tcp), \
         same WebSocket client. direct ZMQ: the same Rust client speaking ZeroMQ (ipc) straight \
         to a local ipykernel; its create column is the local ipykernel start. All kernels run \
         kernel-image/launch.py with the same ipykernel/matplotlib versions.\n\
         Round trip: {} rounds of {} runs, the median of the rounds' percentiles; stream, PNG and \
         create: medians over {} rounds / {} creates; warm pool size {}; memory with {} idle \
         kernels.\n\
         Machine: {} ({} cores), {} GiB RAM, {}, Linux {}, Docker {}; load before {}, after {}; \
         {}. Kernel side: {}. The run took {:.0} s.\n",
        s["rounds"],
        s["rt_runs"],
        s["rounds"],
        s["creates"],
        s["pool_size"],
        s["idle_kernels"],
        mach["cpu"].as_str().unwrap_or_default(),
        mach["cores"],
        mach["memory_gib"],
        mach["os"].as_str().unwrap_or_default(),
        mach["kernel"].as_str().unwrap_or_default(),
        mach["docker"].as_str().unwrap_or_default(),
        mach["load_before"].as_str().unwrap_or_default(),
        doc["load_after"].as_str().unwrap_or_default(),
        mach["kernelgate"].as_str().unwrap_or_default(),
        mach["local_kernels"].as_str().unwrap_or_default(),
        doc["duration_s"].as_f64().unwrap_or_default(),
    ));
    out.push_str(&stages_table(m));
    out.push_str(&tool_call_table(m));
    out.push_str(&walls_table(m));
    out.push_str(&restart_table(m));
    out.push_str(&cluster_table(m));
    out.push_str(&hibernate_table(m));
    out.push_str(&packages_table(m));
    if m["e2b"].is_object() {
        out.push_str(&e2b_table(m));
    }
    if m["registry"].is_object() {
        out.push_str(&registry::table(m));
    }
    out.push_str(&readme_markdown(doc));
    out
}

/// Installing allowlisted packages: `%pip install` and the agent API's install, and the
/// first import, against an execute and an interpreter start in the same kernels.
fn packages_table(m: &Value) -> String {
    let p = &m["packages"];
    let mut out = String::from(
        "\n| packages (p50, ms) | `%pip install` | agent API install | first import | \
         `print(1)` execute | `!python -c pass` | target | met? |\n|---|---:|---:|---:|---:|---:|---|---|\n",
    );
    for (case, label) in [
        ("pure", "a synced pure-Python package (kgfix-hello)"),
        (
            "with_dependency",
            "one that brings a dependency (kgfix-app)",
        ),
        (
            "scikit_learn",
            "scikit-learn (brings scipy, joblib, threadpoolctl)",
        ),
    ] {
        let c = &p[case];
        if c.is_null() {
            continue;
        }
        let get = |k: &str| num(&c[k]["p50"]);
        let pip = get("pip_install_ms");
        let (target, met) = if case == "pure" {
            (
                "%pip install < 2000 ms",
                if pip.is_some_and(|v| v < 2000.0) {
                    "yes"
                } else {
                    "no"
                },
            )
        } else {
            ("", "")
        };
        out.push_str(&format!(
            "| {label} | {} | {} | {} | {} | {} | {target} | {met} |\n",
            fmt(pip, 0),
            fmt(get("api_install_ms"), 0),
            fmt(get("import_ms"), 0),
            fmt(get("execute_print_ms"), 1),
            fmt(get("python_start_ms"), 0),
        ));
    }
    out.push_str(&format!(
        "\nOne gateway (release build, runc, no warm pool), a wheelhouse synced by `kernelgate \
         packages sync` (fixtures from `--find-links`: {} ms; scikit-learn from the package \
         index: {} ms). Each round a fresh kernel: `%pip install -q NAME` and then the import, \
         each timed as the agent API's execute of the cell; the agent API install \
         (`POST /api/kernels/{{id}}/packages`) in another fresh kernel.\n",
        fmt(num(&p["sync"]["fixture_ms"]), 0),
        fmt(num(&p["sync"]["scikit_learn_ms"]), 0),
    ));
    out
}

/// A row of the hibernation table: label, the idle and the 100 MiB kernel's values,
/// decimals, target, met.
type CaseRow = (
    &'static str,
    Option<f64>,
    Option<f64>,
    usize,
    &'static str,
    &'static str,
);

/// Hibernate and resume of an idle kernel and of one holding 100 MiB, against a create
/// from the warm pool.
fn hibernate_table(m: &Value) -> String {
    let h = &m["hibernate"];
    let get = |case: &str, path: &[&str]| {
        let mut v = &h[case];
        for p in path {
            v = &v[*p];
        }
        num(v)
    };
    let mib = |v: Option<f64>| v.map(|b| b / (1024.0 * 1024.0));
    let met = |ok: Option<bool>| match ok {
        Some(true) => "yes",
        Some(false) => "**no**",
        None => "",
    };
    let create = get("warm_create", &["create_p50_ms"]);
    let ratio = |case: &str| {
        get(case, &["resume_ms", "p50"])
            .zip(create)
            .filter(|(_, c)| *c > 0.0)
            .map(|(r, c)| r / c)
    };
    let resume = get("large", &["resume_ms", "p50"]);
    let after = get("large", &["memory_bytes", "after"]);
    let rows: [CaseRow; 9] = [
        (
            "hibernate: `POST /api/kernels/{id}/hibernate` p50 (ms)",
            get("idle", &["hibernate_ms", "p50"]),
            get("large", &["hibernate_ms", "p50"]),
            0,
            "",
            "",
        ),
        (
            "hibernate p90 (ms)",
            get("idle", &["hibernate_ms", "p90"]),
            get("large", &["hibernate_ms", "p90"]),
            0,
            "",
            "",
        ),
        (
            "resume: the `POST /api/kernels/{id}/execute` that wakes it, p50 (ms)",
            get("idle", &["resume_ms", "p50"]),
            resume,
            0,
            "under 1 s (100 MiB)",
            met(resume.map(|r| r < 1000.0)),
        ),
        (
            "resume p90 (ms)",
            get("idle", &["resume_ms", "p90"]),
            get("large", &["resume_ms", "p90"]),
            0,
            "",
            "",
        ),
        (
            "resume p50 / warm create p50 (x)",
            ratio("idle"),
            ratio("large"),
            1,
            "",
            "",
        ),
        (
            "the same execute on the running kernel, p50 (ms)",
            get("idle", &["running_ms", "p50"]),
            get("large", &["running_ms", "p50"]),
            1,
            "",
            "",
        ),
        (
            "state on disk (MiB)",
            mib(get("idle", &["state_bytes", "median"])),
            mib(get("large", &["state_bytes", "median"])),
            3,
            "",
            "",
        ),
        (
            "kernel container's memory before hibernating (MiB)",
            mib(get("idle", &["memory_bytes", "before"])),
            mib(get("large", &["memory_bytes", "before"])),
            1,
            "",
            "",
        ),
        (
            "its memory after: the container is gone (MiB)",
            mib(get("idle", &["memory_bytes", "after"])),
            mib(after),
            1,
            "all of it returned",
            met(after.map(|a| a == 0.0)),
        ),
    ];
    let mut out = String::from(
        "\n| hibernation | `x = 1` | 100 MiB array + 1M-row DataFrame | target | met? |\n\
         |---|---:|---:|---|---|\n",
    );
    for (label, idle, large, decimals, target, met) in rows {
        out.push_str(&format!(
            "| {label} | {} | {} | {target} | {met} |\n",
            fmt(idle, decimals),
            fmt(large, decimals),
        ));
    }
    out.push_str(&format!(
        "\nOne gateway (release build, runc, warm pool of 1): a create from the warm pool \
         (`POST /api/kernels`) takes {} ms (p50), its first execute {} ms. Each round, with the \
         pool filled (`GET /readyz`) and quiet: hibernate, then the execute that resumes the \
         kernel in the warm kernel, its output checked; {} and {} rounds, {} and {} of the \
         resumes in the warm kernel. The 100 MiB kernel: `a = np.ones(100 * 2**20 // 8)` and \
         `df = pd.DataFrame({{\"i\": range(1_000_000), \"s\": [\"row\"] * 1_000_000}})`, \
         woken by `print(a.sum(), len(df))`. Memory: the container's cgroup (page cache and \
         its home's tmpfs included; {} MiB of it anonymous), read just before the \
         hibernation; state: the `bytes` of its `kernel_hibernated` audit record.\n",
        fmt(create, 1),
        fmt(get("warm_create", &["first_execute_p50_ms"]), 1),
        h["idle"]["rounds"],
        h["large"]["rounds"],
        h["idle"]["from_pool"],
        h["large"]["from_pool"],
        fmt(mib(get("large", &["memory_bytes", "before_anon"])), 1),
    ));
    out
}

/// Cluster mode: through a node that does not own the kernel against straight to its owner.
fn cluster_table(m: &Value) -> String {
    let c = &m["cluster"];
    let get = |path: &[&str]| {
        let mut v = c;
        for p in path {
            v = &v[*p];
        }
        num(v)
    };
    let (through, straight) = (
        get(&["rt_p50_ms", "through"]),
        get(&["rt_p50_ms", "straight"]),
    );
    let (r_through, r_straight) = (
        get(&["stream_mib_s", "through"]),
        get(&["stream_mib_s", "straight"]),
    );
    let create = get(&["remote_warm_create_ms", "median"]);
    let met = |ok: Option<bool>| match ok {
        Some(true) => "yes",
        Some(false) => "**no**",
        None => "",
    };
    let delta = through.zip(straight).map(|(t, s)| t - s);
    let ratio = r_through.zip(r_straight).map(|(t, s)| t / s);
    let mut out = String::from(
        "\n| cluster | through another node | straight to the owner | difference | target | met? |\n|---|---:|---:|---:|---|---|\n",
    );
    out.push_str(&format!(
        "| execute `1+1` round trip p50 (ms) | {} | {} | {} ms | within +1 ms | {} |\n",
        fmt(through, 2),
        fmt(straight, 2),
        fmt(delta, 2),
        met(delta.map(|d| d <= 1.0)),
    ));
    out.push_str(&format!(
        "| {} MiB stream (MiB/s, median) | {} | {} | {}x | at least 0.85x | {} |\n",
        c["stream_mib_s"]["mib"],
        fmt(r_through, 1),
        fmt(r_straight, 1),
        fmt(ratio, 2),
        met(ratio.map(|r| r >= 0.85)),
    ));
    out.push_str(&format!(
        "| create from the owner's warm pool through the entry (ms, median) | {} | | | under 50 ms | {} |\n",
        fmt(create, 1),
        met(create.map(|c| c < 50.0)),
    ));
    out.push_str(&format!(
        "\nFailures (lease TTL {} s): a `kill -9` of the owner seen as 404 through the entry after {} s; \
         both nodes registered again {} s after an etcd outage longer than the TTL ended. At rest, per \
         node: {} etcd requests/s; the owner (one kernel, one warm) {} MiB RSS and {} % CPU, the \
         entry {} MiB and {} %.\n\nTwo nodes and one etcd member on loopback (release build, \
         runc); both WebSockets on the same kernel, runs interleaved.\n",
        c["failure_s"]["ttl"],
        fmt(get(&["failure_s", "kill_9_to_404"]), 1),
        fmt(get(&["failure_s", "reregister_after_etcd"]), 2),
        fmt(get(&["idle", "etcd_requests_per_s"]), 2),
        fmt(get(&["idle", "owner_rss_mib"]), 1),
        fmt(get(&["idle", "owner_cpu_percent"]), 2),
        fmt(get(&["idle", "entry_rss_mib"]), 1),
        fmt(get(&["idle", "entry_cpu_percent"]), 2),
    ));
    out
}

/// Restarts with a warm kernel ready and without (the container restarted), by runtime.
fn restart_table(m: &Value) -> String {
    let get =
        |runtime: &str, way: &str| num(&m["restart_ms"][format!("{runtime}_{way}")]["median"]);
    let mut out = String::from(
        "\n| restart, to the kernel answering (ms, median) | runc | runsc (gVisor) |\n|---|---:|---:|\n",
    );
    for (way, label) in [
        ("warm", "a warm kernel ready: the kernel moves into it"),
        ("container", "no warm kernel fits: its container restarts"),
    ] {
        out.push_str(&format!(
            "| {label} | {} | {} |\n",
            fmt(get("runc", way), 0),
            fmt(get("runsc", way), 0)
        ));
    }
    out.push_str(
        "\nOne gateway per runtime (release build, pool of 1); `POST /api/kernels/{id}/restart` \
         then a WebSocket's `kernel_info` answered, each time with the pool full and quiet; \
         the container restart is measured on a kernel created with a `KERNEL_*` variable, \
         which a warm kernel cannot be given.\n",
    );
    out
}

/// `1+1` through the agent API and through MCP's `run_python`, from the same run.
fn tool_call_table(m: &Value) -> String {
    let get = |way: &str, field: &str| num(&m["tool_call_rt_ms"][way][field]);
    let mut out = String::from(
        "\n| `1+1` round trip (ms) | p50 | p90 | p99 | vs agent API (p50) | target | met? |\n\
         |---|---:|---:|---:|---:|---|---|\n",
    );
    let agent = get("agent_api", "p50");
    for (way, label) in [
        ("agent_api", "agent API: `POST /api/kernels/{id}/execute`"),
        ("mcp", "MCP: `tools/call` run_python, session at `/mcp`"),
    ] {
        let p50 = get(way, "p50");
        let (ratio, target, met) = match (way, agent, p50) {
            ("mcp", Some(a), Some(b)) if a > 0.0 => (
                format!("{:.2}x", b / a),
                "≤ 1.2x",
                if b / a <= 1.2 { "yes" } else { "**no**" },
            ),
            _ => ("—".to_owned(), "", ""),
        };
        out.push_str(&format!(
            "| {label} | {} | {} | {} | {ratio} | {target} | {met} |\n",
            fmt(p50, 2),
            fmt(get(way, "p90"), 2),
            fmt(get(way, "p99"), 2),
        ));
    }
    out.push_str(
        "\nOne gateway (release build, runc, audit off), one kernel for each way, measured \
         round by round side by side; the MCP client is a bare Streamable HTTP one (POST, read \
         the SSE answer), so both columns are the server's cost.\n",
    );
    out
}

/// A ratio with its spread over rounds: `0.95x (0.90-1.02)`.
fn ratio_cell(v: &Value) -> String {
    match (num(&v["median"]), num(&v["min"]), num(&v["max"])) {
        (Some(m), Some(lo), Some(hi)) => format!("{m:.2}x ({lo:.2}-{hi:.2})"),
        _ => "—".to_owned(),
    }
}

/// Where the time of one execute goes, stage by stage, and what each optional feature
/// costs the whole round trip.
fn stages_table(m: &Value) -> String {
    let stages: [(&str, &str); 8] = [
        ("ws_decode", "WebSocket decode: a v1 binary frame into a message, header completed"),
        ("auth_tenant", "authentication and tenant lookup: a token against `--token` and 100 keys (per request on the REST and MCP APIs, once per WebSocket)"),
        ("policy", "policy check (`--policy`, docs/policy.md's example): the cell parsed and matched"),
        ("audit", "audit record, built and written, awaited until it is in the file (default on)"),
        ("routing", "routing: the request noted for its session, the reply queued to it and taken"),
        ("signing", "signing: the request serialized and HMAC-SHA256 signed for the kernel"),
        ("zmq_hop", "the ZeroMQ hop: a DEALER-ROUTER round trip over an ipc socket"),
        ("back", "and back: the reply's signature checked, decoded and encoded for the WebSocket"),
    ];
    // Each stage as a share of the whole round trip with every optional feature off.
    let round_trip_us = num(&m["features_rt_ms"]["bare"]["p50"]).map(|ms| ms * 1000.0);
    let share = |us: Option<f64>| match (us, round_trip_us) {
        (Some(us), Some(rt)) if rt > 0.0 => format!("{:.2} %", us / rt * 100.0),
        _ => "—".to_owned(),
    };
    let mut out = String::from(
        "\n| stage of one execute | µs (median) | min-max over batches | of the round trip |\n|---|---:|---:|---:|\n",
    );
    let mut total = 0.0;
    for (stage, label) in stages {
        let v = &m["stages_us"][stage];
        let median = num(&v["median"]);
        total += median.unwrap_or_default();
        out.push_str(&format!(
            "| {label} | {} | {}-{} | {} |\n",
            fmt(median, 2),
            fmt(num(&v["min"]), 2),
            fmt(num(&v["max"]), 2),
            share(median)
        ));
    }
    out.push_str(&format!(
        "| all stages together | {total:.2} | | {} |\n",
        share(Some(total))
    ));
    out.push_str(
        "\nEach stage is the gateway's own code (its library), run in the bench's process on \
         the messages of a `1+1` execute, 30 batches of 500 with the stages' batches \
         alternating; the share is of the `1+1` round trip with every optional feature off, \
         below.\n",
    );
    out.push_str(
        "\n| configuration (runc, one kernel each) | `1+1` round trip p50 (ms) | vs every optional feature off |\n|---|---:|---:|\n",
    );
    for (mode, label) in [
        ("bare", "every optional feature off (`--audit-log off`)"),
        ("audit", "audit trail written (the default)"),
        ("audit_fsync", "audit trail written + `--audit-fsync`"),
        ("policy", "`--policy` on, audit off"),
        ("keys", "`--keys` with 100 tenants, audit off"),
        ("all", "audit written, `--policy` and `--keys` on"),
    ] {
        let v = &m["features_rt_ms"][mode];
        out.push_str(&format!(
            "| {label} | {} | {} |\n",
            fmt(num(&v["p50"]), 3),
            ratio_cell(&v["vs_bare"])
        ));
    }
    out.push_str(
        "\nOne gateway per configuration (release build), measured round by round side by \
         side; each ratio is taken within a round, then the median and min-max of the rounds.\n",
    );
    out
}

/// Direct, runc, gVisor on ptrace and gVisor as `make gvisor` chose it, from the same
/// alternating rounds: ratios only, each the median of the rounds with its min-max.
fn walls_table(m: &Value) -> String {
    let w = &m["walls"];
    if w["skipped"].is_string() {
        return "\nWalls: gVisor is not set up (`make gvisor`), so only runc was measured.\n"
            .to_owned();
    }
    let platform = |runtime: &str| {
        w["settings"]["engine"][runtime]["runtimeArgs"]
            .as_array()
            .and_then(|args| {
                args.iter()
                    .filter_map(Value::as_str)
                    .find_map(|a| a.strip_prefix("--platform="))
            })
            .unwrap_or("?")
            .to_owned()
    };
    let rows: [(&str, &str, &str); 5] = [
        (
            "`1+1` round trip p50, vs direct (lower is better)",
            "rt_ms",
            "runc ≤ 1.0x, gVisor ≤ 1.5x",
        ),
        (
            "20 MiB stream, vs direct (higher is better)",
            "stream_mib_s",
            "runc ≥ 1.0x, gVisor ≥ 0.6x",
        ),
        (
            "10 kernels executing `1+1` in parallel, vs direct (higher is better)",
            "parallel_s",
            "runc ≥ 1.0x",
        ),
        ("cold create, vs runc", "create_ms", ""),
        (
            "first `import numpy, pandas, matplotlib.pyplot`, vs runc",
            "imports_ms",
            "",
        ),
    ];
    let mut out = format!(
        "\n| walls, ratio (median, min-max over rounds) | runc | gVisor: Debian's runsc, {} | gVisor: `make gvisor`'s runsc, {} | target |\n|---|---:|---:|---:|---|\n",
        platform("kernelgate-runsc-ptrace"),
        platform("kernelgate-runsc"),
    );
    for (label, metric, target) in rows {
        out.push_str(&format!(
            "| {label} | {} | {} | {} | {target} |\n",
            ratio_cell(&w["runc"][metric]["ratio"]),
            ratio_cell(&w["runsc-ptrace"][metric]["ratio"]),
            ratio_cell(&w["runsc"][metric]["ratio"]),
        ));
    }
    let s = &w["settings"];
    out.push_str(&format!(
        "\nDirect: the bench's client speaking ZeroMQ straight to a local ipykernel. The others: \
         one Kernelgate release build per runtime (default configuration, audit trail written). \
         {} rounds; each round creates one kernel per wall (then imports the scientific stack \
         in it), runs {} `1+1` round trips and one {} MiB stream on one kernel, and {} kernels \
         in parallel for {} s, every wall in turn.\n",
        s["rounds"], s["rt_runs"], s["stream_mib"], s["parallel_kernels"], s["parallel_seconds"],
    ));
    out
}

/// Two builds of the gateway, ratio of this one over the baseline per round.
fn versions_table(m: &Value) -> String {
    let v = &m["versions"];
    let rows: [(&str, &str); 4] = [
        (
            "create from the warm pool, to `kernel_info` answered (lower is better)",
            "warm_create_ms",
        ),
        (
            "cold create, to `kernel_info` answered (lower is better)",
            "cold_create_ms",
        ),
        ("`1+1` round trip p50 (lower is better)", "rt_ms"),
        ("20 MiB stream (higher is better)", "stream_mib_s"),
    ];
    let mut out = String::from(
        "\n| two builds, median of the rounds | baseline | current | current / baseline (median, min-max) |\n|---|---:|---:|---:|\n",
    );
    for (label, metric) in rows {
        out.push_str(&format!(
            "| {label} | {} | {} | {} |\n",
            fmt(num(&v["baseline"][metric]["median"]), 2),
            fmt(num(&v["current"][metric]["median"]), 2),
            ratio_cell(&v["current"][metric]["ratio"]),
        ));
    }
    let s = &v["settings"];
    out.push_str(&format!(
        "\nBaseline: {}; current: {}. One release gateway each, {} (warm pool of {}), the same \
         flags; {} rounds, each round both builds in turn: a create from the full pool, a cold \
         create (a `KERNEL_*` variable no warm kernel has), {} `1+1` round trips and one {} \
         MiB stream on a kernel that stays. Times in ms, the stream in MiB/s.\n",
        v["baseline"]["version"].as_str().unwrap_or("?"),
        v["current"]["version"].as_str().unwrap_or("?"),
        s["runtime"].as_str().unwrap_or("runc"),
        s["pool_size"],
        s["rounds"],
        s["rt_runs"],
        s["stream_mib"],
    ));
    out
}

/// E2B's SDK next to the gateway's own API on one gateway.
fn e2b_table(m: &Value) -> String {
    let e = &m["e2b"];
    if e["skipped"].is_string() {
        return "\nE2B: the test venv with the SDK is missing (`make python-venv`), so it was \
                not measured.\n"
            .to_owned();
    }
    let rows: [(&str, &str); 2] = [
        (
            "create, from the warm pool: `Sandbox.create` / `POST /api/kernels`",
            "create",
        ),
        (
            "`1+1`: `run_code` / `POST /api/kernels/{id}/execute`",
            "run_code",
        ),
    ];
    let mut out = String::from(
        "\n| E2B SDK against the gateway's API (ms, median) | SDK | API | SDK / API (median, min-max) |\n|---|---:|---:|---:|\n",
    );
    for (label, key) in rows {
        out.push_str(&format!(
            "| {label} | {} | {} | {} |\n",
            fmt(num(&e[key]["sdk_ms"]), 1),
            fmt(num(&e[key]["api_ms"]), 1),
            ratio_cell(&e[key]["ratio"]),
        ));
    }
    let s = &e["settings"];
    out.push_str(&format!(
        "\nOne release gateway, {} (warm pool of {}); {} rounds, each a create both ways and {} \
         `1+1` runs both ways, one after the other; the SDK is E2B's unmodified \
         `e2b-code-interpreter` (tests/python/bench_e2b.py), the API calls plain HTTP from the \
         same script.\n",
        s["runtime"].as_str().unwrap_or("runc"),
        s["pool_size"],
        s["rounds"],
        s["runs_per_round"],
    ));
    out
}

/// The README's figures, rendered from a full run: its two tables and every sentence of it
/// that quotes a figure. `None` when the run lacks a part the README quotes.
#[derive(Debug, Clone, PartialEq)]
pub struct Readme {
    /// Whole markdown tables, one string each, header included.
    pub tables: Vec<String>,
    /// Phrases of the README's prose, each with its figure in it.
    pub phrases: Vec<String>,
}

/// A ratio as the README quotes it: two decimals, none from 10x up.
fn times(x: f64) -> String {
    if x >= 10.0 {
        format!("{x:.0}x")
    } else {
        format!("{x:.2}x")
    }
}

/// The README's figures from a full run's `bench-results.json`.
pub fn readme(doc: &Value) -> Option<Readme> {
    let m = &doc["metrics"];
    let at = |path: &[&str]| {
        let mut v = m;
        for p in path {
            v = &v[*p];
        }
        num(v)
    };
    let side = |metric: &str, side: &str, field: &str| at(&[metric, side, field]);
    let rt = |s: &str| side("execute_rt_ms", s, "p50");
    let stream = |s: &str| side("stream_mib_s", s, "median");
    let parallel = |s: &str| side("parallel_exec_s", s, "rate");
    let (rt_k, rt_j, rt_d) = (rt("kernelgate")?, rt("jkg")?, rt("direct")?);
    let (st_k, st_j, st_d) = (stream("kernelgate")?, stream("jkg")?, stream("direct")?);
    let (pa_k, pa_j, pa_d) = (
        parallel("kernelgate")?,
        parallel("jkg")?,
        parallel("direct")?,
    );
    let warm = side("create_warm_ms", "kernelgate", "median")?;
    let cold = side("create_cold_ms", "kernelgate", "median")?;
    let restart = |way: &str| at(&["restart_ms", way, "median"]);
    let (runc_warm, runc_container) = (restart("runc_warm")?, restart("runc_container")?);
    let (runsc_warm, runsc_container) = (restart("runsc_warm")?, restart("runsc_container")?);
    let per_kernel = |s: &str| side("rss", s, "per_kernel_mib");
    let (mem_k, mem_j) = (per_kernel("kernelgate")?, per_kernel("jkg")?);
    let resume = at(&["hibernate", "large", "resume_ms", "p50"])?;
    let mib = |b: f64| b / (1024.0 * 1024.0);
    let before = mib(at(&["hibernate", "large", "memory_bytes", "before"])?);
    let after = mib(at(&["hibernate", "large", "memory_bytes", "after"])?);
    let returned = if after == 0.0 {
        format!("its container's {before:.0} MiB all returned while it sleeps")
    } else {
        format!(
            "{:.0} of its container's {before:.0} MiB returned",
            before - after
        )
    };
    let pip = at(&["packages", "pure", "pip_install_ms", "p50"])?;
    let python = at(&["packages", "pure", "python_start_ms", "p50"])?;
    let stages: f64 = STAGES
        .iter()
        .map(|s| at(&["stages_us", s, "median"]))
        .sum::<Option<f64>>()?;
    let bare_us = at(&["features_rt_ms", "bare", "p50"])? * 1000.0;
    let mib_printed = doc["settings"]["stream_mib"].as_u64()?;
    let kernels = doc["settings"]["parallel_kernels"].as_u64()?;

    let measured = [
        "| | Kernelgate | Jupyter Kernel Gateway |".to_owned(),
        "|---|---:|---:|".to_owned(),
        format!(
            "| execute `1+1` round trip p50, vs direct | {} | {} |",
            times(rt_k / rt_d),
            times(rt_j / rt_d)
        ),
        format!(
            "| {mib_printed} MiB printed, throughput vs direct | {} | {} |",
            times(st_k / st_d),
            times(st_j / st_d)
        ),
        format!(
            "| {kernels} kernels executing in parallel, throughput vs direct | {} | {} |",
            times(pa_k / pa_d),
            times(pa_j / pa_d)
        ),
        format!(
            "| a new kernel from the warm pool, vs a cold create ({warm:.1} / {cold:.0} ms) | \
             {:.3}x | — |",
            warm / cold
        ),
        format!(
            "| a restart into a warm kernel, vs a container restart (runc {runc_warm:.0} / \
             {runc_container:.0} ms, gVisor {runsc_warm:.0} / {runsc_container:.0} ms) | \
             {:.2}x / {:.2}x | — |",
            runc_warm / runc_container,
            runsc_warm / runsc_container
        ),
        format!(
            "| gateway memory per idle kernel, vs JKG ({mem_k:.2} / {mem_j:.2} MiB) | {} | 1x |",
            times(mem_k / mem_j)
        ),
        format!(
            "| resume of a hibernated kernel holding 100 MiB of arrays and a 1M-row DataFrame, \
             p50, vs a cold create ({returned}) | {} | — |",
            times(resume / cold)
        ),
        format!(
            "| `%pip install` of a synced allowlisted package, p50, vs one `!python -c pass` in \
             the same kernel | {:.1}x | — |",
            pip / python
        ),
        format!(
            "| the gateway's own work in one execute (decode, auth, audit, routing, signing, the \
             ZeroMQ hop and back), share of the round trip | {:.1} % | — |",
            stages / bare_us * 100.0
        ),
    ]
    .join("\n");

    let w = &m["walls"];
    if w["skipped"].is_string() {
        return None;
    }
    let wall = |runtime: &str, metric: &str, field: &str| num(&w[runtime][metric]["ratio"][field]);
    let median = |runtime: &str, metric: &str| wall(runtime, metric, "median");
    let mut walls = vec![
        "| ratio (median, min-max) | runc | gVisor, Debian's runsc on ptrace | gVisor, \
         `make gvisor`'s runsc on systrap |"
            .to_owned(),
        "|---|---:|---:|---:|".to_owned(),
    ];
    let stream_mib = w["settings"]["stream_mib"].as_u64()?;
    let parallel_kernels = w["settings"]["parallel_kernels"].as_u64()?;
    for (label, metric) in [
        (
            "`1+1` round trip, vs direct (lower is better)".to_owned(),
            "rt_ms",
        ),
        (
            format!("{stream_mib} MiB stream, vs direct (higher is better)"),
            "stream_mib_s",
        ),
        (
            format!("{parallel_kernels} kernels in parallel, vs direct (higher is better)"),
            "parallel_s",
        ),
        ("cold create, vs runc".to_owned(), "create_ms"),
        (
            "first import of numpy, pandas and matplotlib, vs runc".to_owned(),
            "imports_ms",
        ),
    ] {
        let runc = if w["runc"][metric]["against"] == "runc" {
            "1x".to_owned()
        } else {
            ratio_cell(&w["runc"][metric]["ratio"])
        };
        walls.push(format!(
            "| {label} | {runc} | {} | {} |",
            ratio_cell(&w["runsc-ptrace"][metric]["ratio"]),
            ratio_cell(&w["runsc"][metric]["ratio"]),
        ));
    }

    let faster = |metric: &str| {
        Some(format!(
            "{:.0} %",
            (1.0 - median("runsc", metric)? / median("runsc-ptrace", metric)?) * 100.0
        ))
    };
    let vs_runc = |metric: &str| Some(median("runsc", metric)? / median("runc", metric)?);
    let phrases = vec![
        format!(
            "({:.2}x, rounds {:.2}-{:.2})",
            median("runc", "rt_ms")?,
            wall("runc", "rt_ms", "min")?,
            wall("runc", "rt_ms", "max")?
        ),
        format!("in {:.1} % of a cold create's time", warm / cold * 100.0),
        format!(
            "{} Jupyter Kernel Gateway's memory per idle kernel",
            times(mem_k / mem_j)
        ),
        format!(
            "under gVisor's systrap, {} the direct round trip",
            times(median("runsc", "rt_ms")?)
        ),
        format!("offline, in {:.2} s (p50)", pip / 1000.0),
        format!(
            "one run of {:.0} minutes",
            doc["duration_s"].as_f64()? / 60.0
        ),
        format!(
            "the round trip is {} faster than on ptrace, a cold create {} and the imports {}",
            faster("rt_ms")?,
            faster("create_ms")?,
            faster("imports_ms")?
        ),
        format!(
            "gVisor still costs {:.1}x runc's round trip for a short cell, {:.1}x runc's \
             throughput for big outputs and {:.1}x for many busy kernels",
            vs_runc("rt_ms")?,
            vs_runc("stream_mib_s")?,
            vs_runc("parallel_s")?
        ),
        format!(
            "A short cell still answers in {:.0} ms",
            num(&w["runsc"]["rt_ms"]["median"])?
        ),
    ];
    Some(Readme {
        tables: vec![measured, walls.join("\n")],
        phrases,
    })
}

/// The README's figures as `make bench` prints them after its tables.
pub fn readme_markdown(doc: &Value) -> String {
    let Some(r) = readme(doc) else {
        return String::new();
    };
    let mut out = String::from("\nThe README's figures from this run:\n");
    for table in &r.tables {
        out.push('\n');
        out.push_str(table);
        out.push('\n');
    }
    out.push('\n');
    for phrase in &r.phrases {
        out.push_str(&format!("- {phrase}\n"));
    }
    out
}
