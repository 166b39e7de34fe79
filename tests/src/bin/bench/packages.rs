//! What installing an allowlisted package costs (docs/packages.md), on one gateway (runc, no
//! warm pool) with a wheelhouse synced by `kernelgate packages sync`: from the tests' fixture
//! wheels (a pure-Python package, and one that brings a dependency), and, when a package
//! index is reachable, a real package with dependencies (scikit-learn: scipy, joblib,
//! threadpoolctl). Each round, in a fresh kernel: `%pip install` timed as the agent API's
//! execute of that cell, then the first `import` of it. Baselines in the same kernel: an
//! execute of `print(1)`, and `!python -c pass` (the interpreter start that `%pip` pays),
//! and the same install through `POST /api/kernels/{id}/packages`.

use crate::procs::{Paths, Server};
use crate::stats::{median, ms, percentile};
use crate::{log, stop_and_check, Opts, Results};
use anyhow::{bail, Context, Result};
use kernelgate_protocol::agent::ExecuteBody;
use kernelgate_protocol::execution::Status;
use reqwest::Method;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// Rounds per case (each a fresh kernel).
const ROUNDS: usize = 5;

/// One thing to install: the requirement, and the cell that imports it.
struct Case {
    name: &'static str,
    requirement: &'static str,
    import: &'static str,
}

const PURE: Case = Case {
    name: "pure",
    requirement: "kgfix-hello",
    import: "import kgfix_hello",
};

const WITH_DEP: Case = Case {
    name: "with_dependency",
    requirement: "kgfix-app",
    import: "import kgfix_app",
};

const REAL: Case = Case {
    name: "scikit_learn",
    requirement: "scikit-learn",
    import: "import sklearn.linear_model",
};

pub async fn compare(_opts: &Opts, paths: &Paths, results: &mut Results) -> Result<()> {
    let dir = paths.work.join("packages");
    let wheels = dir.join("fixture-wheels");
    let python = paths.venv.join("bin/python");
    let built = std::process::Command::new(&python)
        .arg(paths.root.join("tests/packages/make_wheels.py"))
        .arg(&wheels)
        .output()?;
    if !built.status.success() {
        bail!("make_wheels.py: {}", String::from_utf8_lossy(&built.stderr));
    }
    // Two wheelhouses: one synced from the fixtures alone, one from the package index.
    let fixtures = dir.join("fixtures.txt");
    std::fs::write(&fixtures, "kgfix-hello\nkgfix-app\n")?;
    let t0 = Instant::now();
    sync(
        paths,
        &fixtures,
        &dir.join("wheelhouse-fixtures"),
        Some(&wheels),
        &python,
    )?;
    let fixture_sync = ms(t0.elapsed());
    log(format!("packages: fixture sync {fixture_sync:.0} ms"));
    measure_with(
        paths,
        &fixtures,
        &dir.join("wheelhouse-fixtures"),
        &[&PURE, &WITH_DEP],
        results,
    )
    .await?;
    let real = dir.join("real.txt");
    std::fs::write(&real, format!("{}\n", REAL.requirement))?;
    let t1 = Instant::now();
    let real_sync = match sync(paths, &real, &dir.join("wheelhouse-index"), None, &python) {
        Ok(()) => Some(ms(t1.elapsed())),
        Err(e) => {
            log(format!(
                "packages: no real package measured (no package index?): {e:#}"
            ));
            None
        }
    };
    if real_sync.is_some() {
        measure_with(
            paths,
            &real,
            &dir.join("wheelhouse-index"),
            &[&REAL],
            results,
        )
        .await?;
    }
    results.set(
        "packages",
        "sync",
        json!({"fixture_ms": fixture_sync, "scikit_learn_ms": real_sync}),
    );
    Ok(())
}

/// A gateway serving `list` from `wheelhouse`, and `cases` measured on it.
async fn measure_with(
    paths: &Paths,
    list: &Path,
    wheelhouse: &Path,
    cases: &[&Case],
    results: &mut Results,
) -> Result<()> {
    let server = Server::kernelgate(
        paths,
        0,
        &[
            "--runtime",
            "runc",
            "--packages",
            &list.display().to_string(),
            "--wheelhouse",
            &wheelhouse.display().to_string(),
        ],
    )
    .await?;
    let measured = measure(&server, cases, results).await;
    stop_and_check(server).await?;
    measured
}

/// `kernelgate packages sync` of `list` (from `find_links` alone when given).
fn sync(
    paths: &Paths,
    list: &Path,
    wheelhouse: &Path,
    find_links: Option<&Path>,
    python: &Path,
) -> Result<()> {
    let mut cmd = std::process::Command::new(&paths.kernelgate);
    cmd.args(["packages", "sync", "--packages"])
        .arg(list)
        .arg("--wheelhouse")
        .arg(wheelhouse)
        .args(["--image", &paths.image, "--python"])
        .arg(python)
        .env("PIP_RETRIES", "0")
        .env("PIP_DEFAULT_TIMEOUT", "30");
    if let Some(dir) = find_links {
        cmd.arg("--find-links").arg(dir);
    }
    let out = cmd.output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || stdout.contains("refused") {
        bail!(
            "sync of {} failed: {stdout}{}",
            list.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

async fn measure(server: &Server, cases: &[&Case], results: &mut Results) -> Result<()> {
    for case in cases {
        let (mut pip, mut imports, mut api, mut rt, mut python_start) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for i in 0..ROUNDS {
            let id = server.create_kernel(None).await?;
            // Warm the kernel up: its first cells pay one-time costs.
            run(server, &id, "print(1)").await?;
            rt.push(ms(run(server, &id, "print(1)").await?));
            python_start.push(ms(run(server, &id, "!python -c pass").await?));
            let installed = run(
                server,
                &id,
                &format!("%pip install -q {}", case.requirement),
            )
            .await?;
            let imported = run(server, &id, case.import).await?;
            pip.push(ms(installed));
            imports.push(ms(imported));
            server.delete_kernel(&id).await?;
            // The same install through the agent API, in another fresh kernel.
            let id = server.create_kernel(None).await?;
            run(server, &id, "print(1)").await?;
            let t0 = Instant::now();
            install(server, &id, case.requirement).await?;
            api.push(ms(t0.elapsed()));
            server.delete_kernel(&id).await?;
            log(format!(
                "packages {} {i}: %pip install {:.0} ms, import {:.0} ms, agent API install {:.0} ms; \
                 print(1) {:.1} ms, !python -c pass {:.0} ms",
                case.name,
                pip[i],
                imports[i],
                api[i],
                rt[i],
                python_start[i]
            ));
        }
        let stats = |v: &[f64]| json!({"p50": median(v), "p90": percentile(v, 90.0), "samples": v});
        results.set(
            "packages",
            case.name,
            json!({
                "requirement": case.requirement,
                "pip_install_ms": stats(&pip),
                "import_ms": stats(&imports),
                "api_install_ms": stats(&api),
                "execute_print_ms": stats(&rt),
                "python_start_ms": stats(&python_start),
            }),
        );
    }
    Ok(())
}

/// Runs `code` through the agent API; its duration, failing unless it ran cleanly.
async fn run(server: &Server, id: &str, code: &str) -> Result<Duration> {
    let body = ExecuteBody {
        code: code.into(),
        ..ExecuteBody::default()
    };
    let t0 = Instant::now();
    let answer = server.client().execute(id, &body).await?;
    let took = t0.elapsed();
    if answer.status != Status::Ok || answer.stdout.contains("ERROR") {
        bail!("{code:?} answered {answer:?}");
    }
    Ok(took)
}

/// `POST /api/kernels/{id}/packages`.
async fn install(server: &Server, id: &str, requirement: &str) -> Result<()> {
    let request = server
        .client()
        .request(Method::POST, &format!("/api/kernels/{id}/packages"))
        .json(&json!({"packages": [requirement]}))
        .timeout(Duration::from_secs(120));
    let r = server.client().send_any(request).await?;
    let status = r.status();
    let body: Value = r.json().await.unwrap_or(Value::Null);
    if status != 200 {
        bail!("install of {requirement} answered {status}: {body}");
    }
    body["installed"]
        .as_array()
        .filter(|a| !a.is_empty())
        .context("nothing installed")?;
    Ok(())
}
