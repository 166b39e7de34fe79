//! End to end: a cell that prints without end. The gateway cuts its output at
//! `--max-output-mb` for every client and says so once; the kernel's own output queues stay
//! bounded (the printing thread waits for IOPub), so the kernel is neither OOM-killed nor
//! deaf to an interrupt, and keeps its variables; other kernels keep answering meanwhile.

use anyhow::{Context, Result};
use kernelgate_tests::{Gateway, Sandbox};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const CAP_MB: usize = 4;
const RUNAWAY: &str = "while True:\n    print('x' * 10000)";
const GIGABYTE: &str =
    "for _ in range(100_000):\n    print('x' * 10_000)\nprint('done', file=__import__('sys').stderr)";

/// The highest memory use the sandbox's cgroup recorded, on the host.
fn peak_memory(sandbox: &Sandbox) -> Result<u64> {
    let (_, text) = sandbox.cgroup_read(("memory", "memory.max_usage_in_bytes"), "memory.peak")?;
    Ok(text.trim().parse()?)
}

/// The agent API's streamed answer to `code`, each NDJSON line as it came on the wire.
async fn ndjson_lines(gw: &Gateway, id: &str, code: &str) -> Result<Vec<Value>> {
    Ok(gw
        .request(reqwest::Method::POST, &format!("/api/kernels/{id}/execute"))
        .header("Accept", "application/x-ndjson")
        .json(&json!({ "code": code }))
        .send()
        .await?
        .text()
        .await?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?)
}

/// Reads a WebSocket client's messages until the stream goes quiet; counts what a
/// JupyterLab user would have seen of the runaway cell.
async fn watch(mut client: kernelgate_tests::Client, quiet: Duration) -> (usize, usize, usize) {
    let (mut notices, mut stdout_bytes, mut after_notice) = (0, 0, 0);
    while let Ok(m) = client.recv(quiet).await {
        if m["msg_type"] != "stream" || m["channel"] != "iopub" {
            continue;
        }
        let text = m["content"]["text"].as_str().unwrap_or_default();
        if m["content"]["name"] == "stderr" && text.starts_with("[output truncated") {
            notices += 1;
        } else if m["content"]["name"] == "stdout" {
            stdout_bytes += text.len();
            if notices > 0 {
                after_notice += text.len();
            }
        }
    }
    (notices, stdout_bytes, after_notice)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runaway_print_loop_is_cut_bounded_and_interruptible() -> Result<()> {
    let gw = Gateway::start(&["--max-output-mb", &CAP_MB.to_string()]).await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let other = gw.create_kernel().await?["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let sandbox = gw.sandbox(&id)?;
    assert_eq!(gw.execute(&id, "x = 41").await?["status"], "ok");
    let mut watcher = gw.channels(&id, "watcher").await?;
    watcher.kernel_info().await?;
    let before = gw.metrics().await?;

    // The agent API runs the loop; its timeout interrupts it after 12 s. Meanwhile a
    // WebSocket client watches, and another kernel is asked `1 + 1` again and again.
    let started = Instant::now();
    let watching = tokio::spawn(watch(watcher, Duration::from_secs(10)));
    let path = format!("/api/kernels/{id}/execute");
    let looped = gw.post_json(&path, json!({"code": RUNAWAY, "timeout": 12}));
    let calm = async {
        let mut answered = 0u32;
        while started.elapsed() < Duration::from_secs(12) {
            let r = gw.execute(&other, "1 + 1").await?;
            assert_eq!(r["results"][0]["data"]["text/plain"], "2", "{r}");
            answered += 1;
        }
        Ok::<_, anyhow::Error>(answered)
    };
    let (looped, answered) = tokio::join!(looped, calm);
    let (status, r) = looped?;
    let answered = answered?;
    assert_eq!(status, 200, "{r}");
    println!(
        "runaway cell: status {}, {} bytes of stdout, truncated {}, {:?}; the other kernel answered {answered} times",
        r["status"],
        r["stdout"].as_str().map_or(0, str::len),
        r["truncated"],
        started.elapsed()
    );
    assert_eq!(
        r["status"], "timeout",
        "interrupted at its timeout: {r:.300}"
    );
    assert_eq!(r["truncated"], true);
    let stdout = r["stdout"].as_str().unwrap_or_default();
    assert!(
        stdout.len() <= CAP_MB << 20 && stdout.len() > 1 << 20,
        "between 1 MiB and the cap: {}",
        stdout.len()
    );
    let stderr = r["stderr"].as_str().unwrap_or_default();
    assert_eq!(
        stderr.matches("[output truncated").count(),
        1,
        "one notice: {stderr:.500}"
    );
    assert!(answered >= 5, "the other kernel kept answering: {answered}");

    // The kernel lived through it with its state, and answers at once.
    let r = gw.execute(&id, "x + 1").await?;
    assert_eq!(r["results"][0]["data"]["text/plain"], "42", "{r}");
    let peak = peak_memory(&sandbox)?;
    println!("kernel container peak memory: {} MiB", peak >> 20);
    assert!(
        peak < 400 << 20,
        "the kernel's memory stayed bounded: peak {} MiB",
        peak >> 20
    );

    let (notices, seen, after) = watching.await?;
    assert_eq!(notices, 1, "the WebSocket client was told once");
    assert!(seen <= CAP_MB << 20, "{seen} bytes of stdout reached it");
    assert_eq!(after, 0, "nothing of the cell after the notice");

    let after_metrics = gw.metrics().await?;
    let dropped = |m: &str| -> f64 {
        m.lines()
            .find(|l| l.starts_with(r#"kernelgate_dropped_messages_total{reason="output_limit"}"#))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    assert!(
        dropped(&after_metrics) > dropped(&before),
        "counted as dropped"
    );
    Ok(())
}

/// A cell that prints 1 GB (100,000 lines of 10,000 characters) with the default 32 MiB cap:
/// it runs to its end, its output is cut, and the gateway's memory stays near its baseline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gigabyte_of_output_leaves_the_gateway_small() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert_eq!(gw.execute(&id, "1 + 1").await?["status"], "ok");
    let baseline = gw.rss_bytes()?;
    // Streamed (NDJSON), as an agent following its output would: the gateway keeps none of
    // it, so what it holds is the relay's own working set.
    let mut response = gw
        .request(reqwest::Method::POST, &format!("/api/kernels/{id}/execute"))
        .header("Accept", "application/x-ndjson")
        .json(&json!({"code": GIGABYTE, "timeout": 600}))
        .send()
        .await?;
    assert_eq!(response.status(), 200);
    let (mut peak, mut body, mut samples) = (baseline, Vec::new(), Instant::now());
    while let Some(chunk) = response.chunk().await? {
        body.extend_from_slice(&chunk);
        if samples.elapsed() > Duration::from_millis(200) {
            peak = peak.max(gw.rss_bytes()?);
            samples = Instant::now();
        }
    }
    peak = peak.max(gw.rss_bytes()?);
    let lines: Vec<Value> = String::from_utf8(body)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let end = lines.last().context("an end line")?;
    let text = |kind: &str| -> String {
        lines
            .iter()
            .filter(|l| l["type"] == kind)
            .filter_map(|l| l["text"].as_str())
            .collect()
    };
    let mib = |b: u64| b >> 20;
    println!(
        "1 GB print: {end}, gateway RSS baseline {} MiB, peak {} MiB",
        mib(baseline),
        mib(peak)
    );
    assert_eq!(end["status"], "ok", "the cell ran to its end: {end}");
    assert_eq!(end["truncated"], true);
    assert!(text("stdout").len() <= 32 << 20);
    let stderr = text("stderr");
    assert!(stderr.starts_with("[output truncated"), "{stderr:.300}");
    assert!(
        !stderr.contains("done"),
        "what the cell printed after the cap is dropped too"
    );
    assert!(
        peak <= baseline + (64 << 20),
        "gateway RSS peak {} MiB, baseline {} MiB",
        mib(peak),
        mib(baseline)
    );
    Ok(())
}

/// Output under the cap is untouched, and the agent API says nothing was cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_under_the_cap_arrives_whole() -> Result<()> {
    let gw = Gateway::start(&["--max-output-mb", "1"]).await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let r = gw
        .execute(&id, "for i in range(1000):\n    print('y' * 999)")
        .await?;
    assert_eq!(r["status"], "ok", "{r:.300}");
    assert_eq!(r["stdout"].as_str().map(str::len), Some(1000 * 1000));
    assert_eq!(r["truncated"], false);
    assert_eq!(r["stderr"], "");
    let lines = ndjson_lines(&gw, &id, "print('z' * (2 << 20))").await?;
    let end = lines.last().context("an end line")?;
    assert_eq!(end["type"], "end");
    assert_eq!(end["truncated"], true, "a single 2 MiB print crosses 1 MiB");
    assert!(lines.iter().any(|l| l["type"] == "stderr"
        && l["text"]
            .as_str()
            .is_some_and(|t| t.starts_with("[output truncated"))));
    Ok(())
}

/// ipykernel sends a long print as a few large `stream` messages; the cap keeps the first
/// `--max-output-mb` of them, cutting the message that crosses it, for every client: the
/// agent API (whole and streamed) and a WebSocket client see exactly the first MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_mebibyte_of_a_large_print_reaches_every_client() -> Result<()> {
    const CAP: usize = 1 << 20;
    const FIVE_MB: &str = "for i in range(5000):\n    print('x' * 999)";
    let gw = Gateway::start(&["--max-output-mb", "1"]).await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();

    let r = gw.execute(&id, FIVE_MB).await?;
    assert_eq!(r["status"], "ok", "{r:.300}");
    assert_eq!(r["truncated"], true);
    let stdout = r["stdout"].as_str().unwrap_or_default();
    assert_eq!(stdout.len(), CAP, "the agent API got the first MiB");
    assert!(stdout.starts_with(&format!("{}\n", "x".repeat(999))));
    assert!(r["stderr"]
        .as_str()
        .is_some_and(|t| t.starts_with("[output truncated")));

    let lines = ndjson_lines(&gw, &id, FIVE_MB).await?;
    let streamed: usize = lines
        .iter()
        .filter(|l| l["type"] == "stdout")
        .filter_map(|l| l["text"].as_str())
        .map(str::len)
        .sum();
    assert_eq!(streamed, CAP, "the NDJSON stream got the first MiB");
    assert_eq!(
        lines.last().map(|l| l["truncated"].clone()),
        Some(json!(true))
    );

    let mut client = gw.channels(&id, "reader").await?;
    client.kernel_info().await?;
    let msg_id = client.start_execute(FIVE_MB).await?;
    let (mut seen, mut notices, mut idle) = (0, 0, false);
    while !idle {
        let m = client.recv(Duration::from_secs(60)).await?;
        if m["parent_header"]["msg_id"] != msg_id.as_str() {
            continue;
        }
        match (m["msg_type"].as_str(), m["content"]["name"].as_str()) {
            (Some("stream"), Some("stdout")) => {
                assert_eq!(notices, 0, "nothing after the notice");
                seen += m["content"]["text"].as_str().map_or(0, str::len);
            }
            (Some("stream"), Some("stderr")) => notices += 1,
            (Some("status"), _) => idle = m["content"]["execution_state"] == "idle",
            _ => {}
        }
    }
    assert_eq!(seen, CAP, "the WebSocket client got the first MiB");
    assert_eq!(notices, 1);
    Ok(())
}
