//! End to end: `kernelgate run` executes every notebook in notebooks/ through the real
//! gateway, real Docker and the real kernel image, and the written notebooks hold the values
//! and figures an analyst would look at.

use anyhow::{bail, Context, Result};
use kernelgate_tests::{binary, decode_png, image, Gateway};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What one example notebook must show once executed.
struct Expected {
    file: &'static str,
    /// Substrings of the cells' stdout, each in this order across the notebook.
    printed: &'static [&'static str],
    /// Substrings of the text/plain of execute_result outputs.
    results: &'static [&'static str],
    /// Substrings of text/html outputs (pandas tables).
    html: &'static [&'static str],
    /// image/png outputs the notebook draws.
    figures: usize,
}

const NOTEBOOKS: &[Expected] = &[
    Expected {
        file: "monthly_sales.ipynb",
        printed: &[
            "5840 order lines from 2024-01-01 to 2024-12-31",
            "Total revenue 2024: 137,925.60",
            "Best month: 2024-12 (18,455.10)",
            "Largest month-over-month growth: 2024-12 (+48.2%)",
            "Largest month-over-month drop: 2024-06 (-9.6%)",
        ],
        results: &[
            "'months': 12",
            "'total_revenue': 137925.6",
            "'best_month': '2024-12'",
            "'top_product': 'lamp'",
        ],
        html: &["mom_growth_pct", "2024-12", "share_pct"],
        figures: 1,
    },
    Expected {
        file: "data_cleaning_report.ipynb",
        printed: &[
            "wrote orders_raw.csv: 415 rows",
            "shape: (415, 6)",
            "duplicates removed: 15",
            "rows with bad dates dropped: 6",
            "clean rows: 394",
            "regions: ['East', 'North', 'South', 'West']",
            "Top region: North with 29,196.73 revenue",
            "Total clean revenue: 94,285.54",
            "orders_clean.csv: 394 rows, round trip ok",
        ],
        results: &["unit_price", "29196.73"],
        html: &["share_pct", "Kitchen", "Q4"],
        figures: 0,
    },
    Expected {
        file: "statistics_figures.ipynb",
        printed: &[
            "heights  n=2000 mean=170.179 std=8.092",
            "share within one standard deviation: 0.689",
            "slope=1.796 intercept=25.578 r2=0.950",
            "mean wait 4.080, 95% bootstrap CI [3.910, 4.258]",
            "final positions: [16, 18, -42, -24, 8]",
            "corr(spend, sales) = 0.975",
        ],
        results: &[],
        html: &[],
        figures: 4,
    },
];

fn notebooks_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../notebooks")
}

fn scratch_dir(name: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("kg-nbtest-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Runs `kernelgate run ARGS`; returns whether it succeeded and what it printed on stderr.
async fn kernelgate_run(args: &[&str]) -> Result<(bool, String)> {
    let started = Instant::now();
    let out = tokio::time::timeout(
        Duration::from_secs(300),
        tokio::process::Command::new(binary())
            .arg("run")
            .args(args)
            .env_remove("KERNELGATE_URL")
            .env_remove("KERNELGATE_TOKEN")
            .env("KERNELGATE_IMAGE", image())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("kernelgate run took more than 300 s")??;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!(
        "kernelgate run {args:?}: {} in {:.1} s\n{stderr}",
        out.status,
        started.elapsed().as_secs_f64()
    );
    Ok((out.status.success(), stderr))
}

fn read_notebook(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// nbformat writes multi-line strings as lists of lines.
fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(lines) => lines.iter().filter_map(Value::as_str).collect(),
        _ => String::new(),
    }
}

fn code_cells(nb: &Value) -> Vec<&Value> {
    nb["cells"]
        .as_array()
        .map(|c| c.iter().filter(|c| c["cell_type"] == "code").collect())
        .unwrap_or_default()
}

fn outputs(nb: &Value) -> Vec<&Value> {
    code_cells(nb)
        .into_iter()
        .flat_map(|c| c["outputs"].as_array().into_iter().flatten())
        .collect()
}

/// Checks an executed example notebook against what it must show.
fn check_executed(nb: &Value, source: &Value, want: &Expected) -> Result<()> {
    let file = want.file;
    assert_eq!(nb["nbformat"], 4, "{file}");
    // Same cells, same ids and sources as the input: only outputs were added.
    let (cells, src_cells) = (
        nb["cells"].as_array().context("cells")?,
        source["cells"].as_array().context("cells")?,
    );
    assert_eq!(cells.len(), src_cells.len(), "{file}");
    for (c, s) in cells.iter().zip(src_cells) {
        assert_eq!(c["id"], s["id"], "{file}");
        assert_eq!(text(&c["source"]), text(&s["source"]), "{file}");
    }
    assert_eq!(
        nb["metadata"]["language_info"]["name"], "python",
        "{file}: language_info from the kernel"
    );
    // Every code cell ran once, in order, without error.
    for (i, cell) in code_cells(nb).iter().enumerate() {
        assert_eq!(
            cell["execution_count"],
            json!(i + 1),
            "{file}: code cell {i}"
        );
        for out in cell["outputs"].as_array().context("outputs")? {
            assert_ne!(out["output_type"], "error", "{file}: {out}");
            if out["output_type"] == "execute_result" {
                assert_eq!(out["execution_count"], json!(i + 1), "{file}");
            }
        }
    }
    let outs = outputs(nb);
    let stdout: String = outs
        .iter()
        .filter(|o| o["output_type"] == "stream" && o["name"] == "stdout")
        .map(|o| text(&o["text"]))
        .collect();
    let mut at = 0;
    for line in want.printed {
        let Some(found) = stdout[at..].find(line) else {
            bail!("{file}: stdout lacks {line:?} (after byte {at}):\n{stdout}");
        };
        at += found + line.len();
    }
    let results: Vec<String> = outs
        .iter()
        .filter(|o| o["output_type"] == "execute_result")
        .map(|o| text(&o["data"]["text/plain"]))
        .collect();
    for want_text in want.results {
        assert!(
            results.iter().any(|r| r.contains(want_text)),
            "{file}: no execute_result shows {want_text:?}: {results:#?}"
        );
    }
    let html: String = outs.iter().map(|o| text(&o["data"]["text/html"])).collect();
    for want_html in want.html {
        assert!(
            html.contains(want_html),
            "{file}: no HTML table shows {want_html:?}"
        );
    }
    let figures: Vec<(u32, u32)> = outs
        .iter()
        .filter_map(|o| o["data"]["image/png"].as_str())
        .map(decode_png)
        .collect::<Result<_>>()
        .with_context(|| format!("{file}: a figure is not a PNG"))?;
    assert_eq!(figures.len(), want.figures, "{file}: figures {figures:?}");
    for (w, h) in &figures {
        assert!(*w >= 300 && *h >= 200, "{file}: figure of {w}x{h} px");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_example_notebook_runs_through_a_gateway() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let dir = scratch_dir("all")?;
    let mut files: Vec<String> = std::fs::read_dir(notebooks_dir())?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".ipynb"))
        .collect();
    files.sort();
    let mut expected: Vec<&str> = NOTEBOOKS.iter().map(|n| n.file).collect();
    expected.sort();
    assert_eq!(
        files, expected,
        "every notebook in notebooks/ has expectations here"
    );

    for want in NOTEBOOKS {
        let input = notebooks_dir().join(want.file);
        let source = read_notebook(&input)?;
        assert!(
            outputs(&source).is_empty(),
            "{} is committed without outputs",
            want.file
        );
        let out = dir.join(want.file);
        let (ok, stderr) = kernelgate_run(&[
            &input.display().to_string(),
            "-o",
            &out.display().to_string(),
            "--url",
            &gw.base,
            "--token",
            &gw.token,
        ])
        .await?;
        assert!(ok, "{}: {stderr}", want.file);
        assert!(stderr.contains("ok ("), "progress per cell: {stderr}");
        check_executed(&read_notebook(&out)?, &source, want)?;
        // The kernel it created is gone.
        let (status, kernels) = gw.get_json("/api/kernels").await?;
        assert_eq!((status, kernels), (200, json!([])), "{}", want.file);
    }
    let _ = std::fs::remove_dir_all(&dir);
    gw.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_url_it_starts_and_stops_its_own_gateway() -> Result<()> {
    let dir = scratch_dir("own")?;
    let want = &NOTEBOOKS[0];
    let input = notebooks_dir().join(want.file);
    let out = dir.join("executed.ipynb");
    let (ok, stderr) = kernelgate_run(&[
        &input.display().to_string(),
        "-o",
        &out.display().to_string(),
    ])
    .await?;
    assert!(ok, "{stderr}");
    check_executed(&read_notebook(&out)?, &read_notebook(&input)?, want)?;

    // The gateway it started is stopped and its kernel container removed.
    let port: u16 = regex::Regex::new(r"local gateway on 127\.0\.0\.1:(\d+)")?
        .captures(&stderr)
        .and_then(|c| c[1].parse().ok())
        .context("it says where it started the gateway")?;
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err(),
        "the local gateway still listens on {port}"
    );
    let runtime_dir = std::env::temp_dir().join(format!("kgrun-{port}"));
    let docker = bollard::Docker::connect_with_local_defaults()?;
    let left = docker
        .list_containers(Some(bollard::query_parameters::ListContainersOptions {
            all: true,
            filters: Some(std::collections::HashMap::from([(
                "label".to_owned(),
                vec![format!(
                    "org.kernelgate.runtime_dir={}",
                    runtime_dir.display()
                )],
            )])),
            ..Default::default()
        }))
        .await?;
    assert!(left.is_empty(), "containers left behind: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_cell_fails_the_run_unless_errors_are_allowed() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let dir = scratch_dir("fail")?;
    let input = dir.join("fails.ipynb");
    let cell = |id: &str, src: &str| {
        json!({"cell_type": "code", "id": id, "metadata": {}, "source": src,
               "execution_count": null, "outputs": []})
    };
    let nb = json!({
        "nbformat": 4, "nbformat_minor": 5, "metadata": {},
        "cells": [
            cell("a", "rate = 0"),
            cell("b", "print('before')\n1 / rate"),
            cell("c", "print('after')"),
        ],
    });
    std::fs::write(&input, nb.to_string())?;
    let out = dir.join("out.ipynb");
    let base = [
        input.display().to_string(),
        "-o".into(),
        out.display().to_string(),
        "--url".into(),
        gw.base.clone(),
        "--token".into(),
        gw.token.clone(),
    ];
    let args: Vec<&str> = base.iter().map(String::as_str).collect();

    let (ok, stderr) = kernelgate_run(&args).await?;
    assert!(!ok, "a cell error must fail the run: {stderr}");
    assert!(
        stderr.contains("ZeroDivisionError: division by zero"),
        "{stderr}"
    );
    // The notebook is still written, with the error where it happened; nothing ran after it.
    let written = read_notebook(&out)?;
    let cells = code_cells(&written);
    assert_eq!(text(&cells[1]["outputs"][0]["text"]), "before\n");
    let error = &cells[1]["outputs"][1];
    assert_eq!(error["output_type"], "error");
    assert_eq!(error["ename"], "ZeroDivisionError");
    assert!(error["traceback"].as_array().is_some_and(|t| !t.is_empty()));
    assert_eq!(cells[2]["execution_count"], Value::Null);
    assert_eq!(cells[2]["outputs"], json!([]));

    let mut allowed = args.clone();
    allowed.push("--allow-errors");
    let (ok, stderr) = kernelgate_run(&allowed).await?;
    assert!(ok, "--allow-errors: {stderr}");
    let written = read_notebook(&out)?;
    let cells = code_cells(&written);
    assert_eq!(cells[1]["outputs"][1]["ename"], "ZeroDivisionError");
    assert_eq!(cells[2]["execution_count"], 3);
    assert_eq!(text(&cells[2]["outputs"][0]["text"]), "after\n");

    let _ = std::fs::remove_dir_all(&dir);
    gw.stop().await?;
    Ok(())
}

#[tokio::test]
async fn a_file_that_is_not_a_notebook_is_refused_clearly() -> Result<()> {
    let dir = scratch_dir("bad")?;
    let cases = [
        ("broken.ipynb", "{\"cells\": [", "is not valid JSON"),
        (
            "v3.ipynb",
            r#"{"nbformat": 3, "nbformat_minor": 0, "metadata": {}, "worksheets": []}"#,
            "is not an nbformat 4 notebook: it is nbformat 3",
        ),
    ];
    for (name, content, message) in cases {
        let path = dir.join(name);
        std::fs::write(&path, content)?;
        // An unreachable --url: the file must be refused before any gateway is needed.
        let (ok, stderr) =
            kernelgate_run(&[&path.display().to_string(), "--url", "http://127.0.0.1:9"]).await?;
        assert!(!ok, "{name}");
        assert!(stderr.contains(message), "{name}: {stderr}");
        assert!(!dir.join(name.replace(".ipynb", ".executed.ipynb")).exists());
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
