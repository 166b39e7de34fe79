//! The cluster registry at scale, old against new: the `registry_scale` binary
//! (tests/src/bin/registry_scale/: many simulated nodes in one process, each a real
//! `Membership` over its own `Etcd` client, against a real etcd) built twice, from a
//! baseline's cluster code (`make bench` builds it from `git archive REGISTRY_BASELINE` with
//! that folder copied in, and the baseline's way to find an owner) and from this tree's, and run point by point, baseline first.
//! A build whose point was cut short (its nodes lost their leases en masse, or the machine
//! ran out of memory) skips the larger points. Without a baseline build the section runs
//! this tree's alone and says so. Samples of a run alone: docs/bench-registry.json.

use crate::{log, Opts, Results};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The two builds, in table order.
pub const BUILDS: [&str; 2] = ["baseline", "current"];

/// The points, the window and the churn: `--registry-nodes`, `--registry-kernels`,
/// `--registry-window` (and `--quick`).
#[derive(Debug, Clone)]
pub struct Points {
    pub nodes: Vec<usize>,
    pub kernels: Vec<usize>,
    pub window: Duration,
}

impl Default for Points {
    fn default() -> Points {
        Points {
            nodes: vec![100, 300, 1000],
            kernels: vec![10_000, 100_000],
            window: Duration::from_secs(60),
        }
    }
}

impl Points {
    pub fn quick() -> Points {
        Points {
            nodes: vec![20, 50],
            kernels: vec![2000],
            window: Duration::from_secs(10),
        }
    }

    /// `N,N,...`
    pub fn list(value: &str) -> Result<Vec<usize>> {
        value
            .split(',')
            .map(|n| Ok(n.trim().replace('_', "").parse()?))
            .collect()
    }
}

pub async fn compare(opts: &Opts, work: &Path, results: &mut Results) -> Result<()> {
    let points = &opts.registry;
    let current = std::env::current_exe()?.with_file_name("registry_scale");
    if !current.exists() {
        bail!(
            "{} is missing: `cargo build --release -p kernelgate-tests` builds it",
            current.display()
        );
    }
    let baseline = std::env::var_os("REGISTRY_BASELINE_BIN")
        .map(PathBuf::from)
        .filter(|p| p.exists());
    let rev = |var: &str| std::env::var(var).unwrap_or_default();
    let builds = json!({
        "baseline": match &baseline {
            Some(_) => json!(rev("BENCH_REGISTRY_BASELINE_REV")),
            None => {
                log("registry: no baseline build (REGISTRY_BASELINE_BIN): this tree's alone");
                Value::Null
            }
        },
        "current": rev("BENCH_CURRENT_REV"),
    });
    let bins: Vec<(&str, PathBuf)> = BUILDS
        .into_iter()
        .zip([baseline, Some(current)])
        .filter_map(|(build, bin)| Some((build, bin?)))
        .collect();
    let mut rows = Vec::new();
    let mut settings = Value::Null;
    // Per build, the points it collapsed at: larger ones are not run.
    let mut collapsed: Vec<(&str, usize, usize)> = Vec::new();
    for &kernels in &points.kernels {
        for &nodes in &points.nodes {
            let mut row = json!({"nodes": nodes, "kernels": kernels});
            for (build, bin) in &bins {
                let beyond = collapsed
                    .iter()
                    .find(|(b, n, k)| b == build && nodes >= *n && kernels >= *k);
                if let Some((_, n, k)) = beyond {
                    row[*build] =
                        json!({"skipped": format!("collapsed at {n} nodes × {k} kernels")});
                    continue;
                }
                log(format!(
                    "registry: {build}, {nodes} nodes × {kernels} kernels"
                ));
                let point = match run(bin, nodes, kernels, points.window, work).await {
                    Ok(doc) => {
                        settings = doc["settings"].clone();
                        let mut point = doc["points"][0].clone();
                        point["cores"] = doc["cores"].clone();
                        point
                    }
                    Err(e) => json!({"error": format!("{e:#}")}),
                };
                if point["cut_short"].is_string() || point["error"].is_string() {
                    collapsed.push((build, nodes, kernels));
                }
                row[*build] = point;
            }
            rows.push(row);
        }
    }
    results.set("registry", "points", json!(rows));
    results.set("registry", "builds", builds);
    results.set("registry", "settings", settings);
    Ok(())
}

/// One point of one build: the binary's output (its settings, the point), or why it gave
/// none.
async fn run(
    bin: &Path,
    nodes: usize,
    kernels: usize,
    window: Duration,
    work: &Path,
) -> Result<Value> {
    let out = work.join(format!("registry-{nodes}-{kernels}.json"));
    let _ = std::fs::remove_file(&out);
    let mut child = tokio::process::Command::new(bin)
        .args([
            "--nodes",
            &nodes.to_string(),
            "--kernels",
            &kernels.to_string(),
        ])
        .args(["--window", &window.as_secs_f64().to_string()])
        .arg("--out")
        .arg(&out)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    // Two setup limits (preload, listings), the window, the join, and the teardown.
    let limit = window + Duration::from_secs(2 * 240 + 120 + 60);
    let status = match tokio::time::timeout(limit, child.wait()).await {
        Ok(status) => status?,
        Err(_) => {
            // SIGTERM first: it stops its etcd on the way out.
            if let Some(pid) = child.id() {
                let _ = std::process::Command::new("kill")
                    .arg(pid.to_string())
                    .status();
            }
            if tokio::time::timeout(Duration::from_secs(20), child.wait())
                .await
                .is_err()
            {
                child.kill().await?;
            }
            bail!("{} ran over {limit:?}", bin.display());
        }
    };
    anyhow::ensure!(status.success(), "{} failed: {status}", bin.display());
    Ok(serde_json::from_str(&std::fs::read_to_string(&out)?)?)
}
