//! End to end, as an operator sees the gateway: a real Prometheus (Debian's package)
//! scraping `/metrics` on loopback and answering PromQL about what happened, the health
//! endpoints, and JSON logs that parse line by line.

use anyhow::{bail, Context, Result};
use kernelgate_tests::{free_port, Gateway};
use serde_json::{json, Value};
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};

/// `prometheus` started for one test, removed with its data when dropped.
struct Prometheus {
    child: Child,
    port: u16,
    dir: std::path::PathBuf,
    http: reqwest::Client,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Prometheus {
    /// Scrapes the gateway every second with `token` as bearer credentials.
    async fn scraping(gw: &Gateway, token: &str) -> Result<Prometheus> {
        let port = free_port()?;
        let dir = std::env::temp_dir().join(format!("kg-prom-{port}"));
        std::fs::create_dir_all(&dir)?;
        let target = gw.base.trim_start_matches("http://");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
             scrape_configs:\n  - job_name: kernelgate\n    metrics_path: /metrics\n\
             \x20   authorization:\n      type: Bearer\n      credentials: {token}\n\
             \x20   static_configs:\n      - targets: ['{target}']\n"
        );
        std::fs::write(dir.join("prometheus.yml"), config)?;
        let child = Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context(
                "cannot run prometheus: install Debian's `prometheus` package (make test does)",
            )?;
        Ok(Prometheus {
            child,
            port,
            dir,
            http: reqwest::Client::new(),
        })
    }

    /// The value of an instant PromQL query that returns one sample, if it has one.
    async fn value(&self, query: &str) -> Result<Option<f64>> {
        let answer: Value = self
            .http
            .get(format!("http://127.0.0.1:{}/api/v1/query", self.port))
            .query(&[("query", query)])
            .send()
            .await?
            .json()
            .await?;
        if answer["status"] != "success" {
            bail!("query {query}: {answer}");
        }
        Ok(answer["data"]["result"][0]["value"][1]
            .as_str()
            .and_then(|v| v.parse().ok()))
    }

    /// Waits (up to 30 s) until `query` gives a value that `ok` accepts; returns it.
    async fn until(&self, query: &str, ok: impl Fn(f64) -> bool) -> Result<f64> {
        let mut last = None;
        for _ in 0..150 {
            if let Ok(v) = self.value(query).await {
                last = v;
                if let Some(v) = v.filter(|v| ok(*v)) {
                    return Ok(v);
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        bail!("{query} never got an expected value; last: {last:?}")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_what_happened() -> Result<()> {
    let scrape_token = "scrape-only-token";
    let gw = Gateway::start(&["--pool-size", "1", "--metrics-token", scrape_token]).await?;
    // The scrape token reads metrics and nothing else.
    let r = reqwest::Client::new()
        .get(gw.url("/api/kernels"))
        .bearer_auth(scrape_token)
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 403);

    let ready = gw.wait_pool("filled").await?;
    assert_eq!(ready["pool"]["target"], 1, "{ready}");
    let pooled = gw.create_kernel().await?;
    let (status, cold) = gw
        .post_json("/api/kernels", json!({"env": {"KERNEL_LANG": "de"}}))
        .await?;
    assert_eq!(status, 201, "{cold}");
    let id = pooled["id"].as_str().unwrap_or_default();
    assert_eq!(gw.execute(id, "6 * 7").await?["status"], "ok");
    assert_eq!(gw.execute(id, "1/0").await?["status"], "error");
    let mut ws = gw.channels(id, "watcher").await?;
    assert_eq!(ws.execute("print('over the socket')").await?.status, "ok");

    let prom = Prometheus::scraping(&gw, scrape_token).await?;
    prom.until(r#"up{job="kernelgate"}"#, |v| v == 1.0).await?;
    prom.until(r#"kernelgate_kernel_creates_total{source="pool"}"#, |v| {
        v >= 1.0
    })
    .await?;
    prom.until(r#"kernelgate_kernel_creates_total{source="cold"}"#, |v| {
        v >= 1.0
    })
    .await?;
    prom.until(
        r#"kernelgate_kernel_create_seconds_count{source="cold"}"#,
        |v| v >= 1.0,
    )
    .await?;
    prom.until(r#"kernelgate_executions_total{status="ok"}"#, |v| v >= 2.0)
        .await?;
    prom.until(r#"kernelgate_executions_total{status="error"}"#, |v| {
        v >= 1.0
    })
    .await?;
    prom.until("kernelgate_execution_seconds_count", |v| v >= 3.0)
        .await?;
    prom.until(r#"kernelgate_kernels{state="idle"}"#, |v| v == 2.0)
        .await?;
    prom.until("kernelgate_websocket_connections", |v| v == 1.0)
        .await?;
    prom.until(
        r#"kernelgate_relayed_bytes_total{direction="kernel_to_client"}"#,
        |v| v > 0.0,
    )
    .await?;
    prom.until(
        r#"kernelgate_relayed_messages_total{direction="client_to_kernel"}"#,
        |v| v >= 1.0,
    )
    .await?;
    prom.until("kernelgate_pool_refills_total", |v| v >= 1.0)
        .await?;
    prom.until("kernelgate_pool_kernels", |v| v <= 1.0).await?;
    prom.until("kernelgate_replay_buffer_bytes", |v| v >= 0.0)
        .await?;

    // A client message on a channel clients may not write is dropped and counted.
    ws.send("iopub", "status", json!({"execution_state": "busy"}))
        .await?;
    prom.until(
        r#"kernelgate_dropped_messages_total{reason="read_only_channel"}"#,
        |v| v >= 1.0,
    )
    .await?;
    ws.close().await?;
    prom.until("kernelgate_websocket_connections", |v| v == 0.0)
        .await?;
    Ok(())
}

/// Removes an image tag of the test's own, also when the test fails.
struct Untag(String);

impl Drop for Untag {
    fn drop(&mut self) {
        let _ = std::process::Command::new("docker")
            .args(["rmi", &self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_endpoints_and_metrics_access() -> Result<()> {
    // An image tag of our own, so it can be taken away while the gateway runs.
    let tag = format!("kernelgate-readyz-test:{}", std::process::id());
    let tagged = std::process::Command::new("docker")
        .args(["tag", &kernelgate_tests::image(), &tag])
        .status()?;
    assert!(tagged.success());
    let _untag = Untag(tag.clone());
    let gw = Gateway::start(&["--image", &tag]).await?;
    let http = reqwest::Client::new();

    let r = http.get(gw.url("/healthz")).send().await?;
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await?.trim(), "ok");
    let ready = gw.wait_pool("off").await?;
    assert_eq!(
        (ready["docker"].as_str(), ready["image"].as_str()),
        (Some("ok"), Some("ok"))
    );

    let r = http.get(gw.url("/metrics")).send().await?;
    assert_eq!(r.status().as_u16(), 403);
    assert!(r.text().await?.contains("--metrics-public"));
    let r = http
        .get(gw.url("/metrics"))
        .bearer_auth(&gw.token)
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 200);
    let content_type = r.headers()["content-type"].to_str()?.to_owned();
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    assert!(r
        .text()
        .await?
        .contains("kernelgate_kernels{state=\"idle\"}"));

    // The image goes away: not ready, and the answer says how to fix it.
    let removed = std::process::Command::new("docker")
        .args(["rmi", &tag])
        .stdout(Stdio::null())
        .status()?;
    assert!(removed.success());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let r = http.get(gw.url("/readyz")).send().await?;
    assert_eq!(r.status().as_u16(), 503);
    let body: Value = r.json().await?;
    assert_eq!(body["ready"], false, "{body}");
    assert!(
        body["image"]
            .as_str()
            .is_some_and(|m| m.contains("make image")),
        "{body}"
    );
    let r = http.get(gw.url("/healthz")).send().await?;
    assert_eq!(r.status().as_u16(), 200, "alive even when not ready");

    let public = Gateway::start(&["--metrics-public"]).await?;
    let r = http.get(public.url("/metrics")).send().await?;
    assert_eq!(r.status().as_u16(), 200);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_parse_line_by_line_with_kernel_and_request_ids() -> Result<()> {
    let gw = Gateway::start(&["--log-format", "json"]).await?;
    let r = gw
        .request(reqwest::Method::POST, "/api/kernels")
        .header("X-Request-Id", "create-req-1")
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 201);
    assert_eq!(r.headers()["x-request-id"], "create-req-1");
    let id = r.json::<Value>().await?["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    gw.execute(&id, "1 + 1").await?;
    gw.delete_kernel(&id).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let lines = gw.logs.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(lines.len() > 3, "{lines:?}");
    let mut about_kernel = 0;
    let mut in_create = 0;
    for line in &lines {
        let v: Value = serde_json::from_str(line).with_context(|| format!("not JSON: {line}"))?;
        for field in ["timestamp", "level", "message"] {
            assert!(v.get(field).is_some(), "no {field}: {line}");
        }
        if line.contains(&id) {
            about_kernel += 1;
            let names_it = v["kernel"] == id.as_str()
                || v["span"]["kernel"] == id.as_str()
                || v["spans"]
                    .as_array()
                    .is_some_and(|s| s.iter().any(|s| s["kernel"] == id.as_str()));
            assert!(names_it, "the kernel id is a field of its own: {line}");
        }
        let spans = v["spans"].as_array().cloned().unwrap_or_default();
        if spans.iter().any(|s| s["request_id"] == "create-req-1") {
            in_create += 1;
        }
    }
    assert!(about_kernel >= 2, "{lines:?}");
    assert!(
        in_create >= 1,
        "lines about the create carry its request id: {lines:?}"
    );
    Ok(())
}
