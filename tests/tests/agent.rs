//! The agent API (`POST /api/kernels/{id}/execute`) and the files API, against
//! the real gateway, Docker and kernel image.

use anyhow::Result;
use futures::StreamExt;
use kernelgate_tests::{decode_png, Gateway};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

async fn execute(gw: &Gateway, id: &str, code: &str, timeout: Option<f64>) -> Result<Value> {
    let mut body = json!({"code": code});
    if let Some(t) = timeout {
        body["timeout"] = json!(t);
    }
    let (status, v) = gw
        .post_json(&format!("/api/kernels/{id}/execute"), body)
        .await?;
    anyhow::ensure!(status == 200, "execute: {status} {v}");
    Ok(v)
}

async fn kernel(gw: &Gateway) -> Result<String> {
    Ok(gw.create_kernel().await?["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_step_analysis_keeps_state_and_returns_everything() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = kernel(&gw).await?;
    let r = execute(&gw, &id, "import pandas as pd\ndf = pd.DataFrame({'m': [1, 2, 3], 'sales': [100.0, 150.0, 120.0]})\nprint(len(df))", None).await?;
    assert_eq!(r["status"], "ok");
    assert_eq!(r["stdout"], "3\n");
    let r = execute(
        &gw,
        &id,
        "df['growth'] = df['sales'].pct_change() * 100\nfloat(round(df['growth'].iloc[1], 1))",
        None,
    )
    .await?;
    assert_eq!(r["results"][0]["data"]["text/plain"], "50.0");
    assert_eq!(r["results"][0]["is_main_result"], true);
    let r = execute(&gw, &id, "df", None).await?;
    let data = &r["results"][0]["data"];
    assert!(
        data["text/html"]
            .as_str()
            .unwrap_or_default()
            .contains("<table"),
        "{data}"
    );
    assert!(data["text/plain"]
        .as_str()
        .unwrap_or_default()
        .contains("growth"));

    let r = execute(&gw, &id, "import sys\nimport matplotlib.pyplot as plt\nplt.plot(df['m'], df['sales'])\nplt.show()\nprint('warn', file=sys.stderr)", None).await?;
    let png = r["results"][0]["data"]["image/png"]
        .as_str()
        .unwrap_or_default();
    let (w, h) = decode_png(png)?;
    assert!(w > 100 && h > 100);
    assert_eq!(r["results"][0]["is_main_result"], false);
    assert_eq!(r["stderr"], "warn\n");

    let r = execute(&gw, &id, "from IPython.display import SVG, JSON, display\ndisplay(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"4\" height=\"4\"/>'))\ndisplay(JSON({'a': 1}))", None).await?;
    assert!(r["results"][0]["data"]["image/svg+xml"].is_string(), "{r}");
    assert_eq!(r["results"][1]["data"]["application/json"], json!({"a": 1}));

    let r = execute(&gw, &id, "1/0", None).await?;
    assert_eq!(r["status"], "error");
    assert_eq!(r["error"]["ename"], "ZeroDivisionError");
    assert_eq!(r["error"]["evalue"], "division by zero");
    assert!(r["error"]["traceback"]
        .as_array()
        .is_some_and(|t| !t.is_empty()));
    assert!(r["execution_count"].as_i64().is_some_and(|n| n >= 5));
    assert!(r["duration_ms"].is_u64());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_interrupts_and_state_survives() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = kernel(&gw).await?;
    execute(&gw, &id, "x = 41", None).await?;
    let started = Instant::now();
    let r = execute(
        &gw,
        &id,
        "print('before', flush=True)\nwhile True: pass",
        Some(2.0),
    )
    .await?;
    let took = started.elapsed();
    assert_eq!(r["status"], "timeout", "{r}");
    assert_eq!(r["stdout"], "before\n");
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(8),
        "{took:?}"
    );
    let r = execute(&gw, &id, "x + 1", None).await?;
    assert_eq!(r["status"], "ok");
    assert_eq!(r["results"][0]["data"]["text/plain"], "42");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_ndjson_and_abandoned_runs() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = kernel(&gw).await?;
    let started = Instant::now();
    let resp = gw
        .request(reqwest::Method::POST, &format!("/api/kernels/{id}/execute"))
        .header("Accept", "application/x-ndjson")
        .json(&json!({"code": "import time\nprint('first', flush=True)\ntime.sleep(1.5)\nprint('second')\n7 * 6"}))
        .send()
        .await?;
    assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
    let mut body = resp.bytes_stream();
    let mut buf = Vec::new();
    let mut lines: Vec<(Duration, Value)> = Vec::new();
    while let Some(chunk) = body.next().await {
        buf.extend_from_slice(&chunk?);
        while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=pos).collect();
            lines.push((started.elapsed(), serde_json::from_slice(&line)?));
        }
    }
    let kinds: Vec<&str> = lines
        .iter()
        .map(|(_, v)| v["type"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(kinds, ["stdout", "stdout", "result", "end"]);
    assert_eq!(lines[0].1["text"], "first\n");
    assert_eq!(lines[2].1["data"]["text/plain"], "42");
    assert_eq!(lines[3].1["status"], "ok");
    // The first line came while the code was still running.
    assert!(
        lines[3].0 - lines[0].0 >= Duration::from_secs(1),
        "{:?}",
        lines.iter().map(|l| l.0).collect::<Vec<_>>()
    );

    // A caller that goes away mid-run gets its run interrupted, not left busy.
    execute(&gw, &id, "y = 'kept'", None).await?;
    let abandoned = gw
        .request(reqwest::Method::POST, &format!("/api/kernels/{id}/execute"))
        .header("Accept", "application/x-ndjson")
        .json(&json!({"code": "import time\nprint('started', flush=True)\ntime.sleep(120)"}))
        .send()
        .await?;
    let mut stream = abandoned.bytes_stream();
    let _first = stream.next().await;
    drop(stream);
    let started = Instant::now();
    let r = execute(&gw, &id, "y", None).await?;
    assert_eq!(r["results"][0]["data"]["text/plain"], "'kept'");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "run was not interrupted: {:?}",
        started.elapsed()
    );
    Ok(())
}

/// The NDJSON lines of a streamed run.
async fn stream_lines(gw: &Gateway, id: &str, body: Value) -> Result<Vec<Value>> {
    let resp = gw
        .request(reqwest::Method::POST, &format!("/api/kernels/{id}/execute"))
        .header("Accept", "application/x-ndjson")
        .json(&body)
        .send()
        .await?;
    let body = resp.text().await?;
    body.lines()
        .map(|l| Ok(serde_json::from_str(l)?))
        .collect::<Result<_>>()
}

/// `"plain": true` gives text as a terminal shows it, for a model: a progress line redrawn
/// with `\r` (across several stream messages) comes once in its last state, colours go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_text_for_a_model_in_json_and_streamed() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = kernel(&gw).await?;
    let code = "import sys, time\n\
        for i in range(0, 101, 25):\n    print(f'\\r{i:3d}%', end='', flush=True)\n    time.sleep(0.2)\n\
        print(' done')\n\
        print('\\033[31mred\\033[0m', file=sys.stderr)\n\
        print('50%', end='\\r', flush=True)\n\
        time.sleep(0.2)\n\
        print('last', end='')\n\
        1/0";

    let raw = stream_lines(&gw, &id, json!({"code": code})).await?;
    let frames = raw.iter().filter(|l| l["type"] == "stdout").count();
    assert!(frames >= 5, "the frames came in separate messages: {raw:?}");

    let lines = stream_lines(&gw, &id, json!({"code": code, "plain": true})).await?;
    let shown: Vec<(&str, &str)> = lines
        .iter()
        .filter(|l| l["type"] != "end")
        .map(|l| {
            let t = l["type"].as_str().unwrap_or_default();
            (
                t,
                l["text"]
                    .as_str()
                    .unwrap_or_else(|| l["ename"].as_str().unwrap_or_default()),
            )
        })
        .collect();
    assert_eq!(
        shown,
        [
            ("stdout", "100% done\n"),
            ("stderr", "red\n"),
            ("error", "ZeroDivisionError"),
            ("stdout", "last"),
        ],
        "{lines:?}"
    );
    let traceback = lines[2]["traceback"].to_string();
    assert!(
        !traceback.contains("\\u001b") && traceback.contains("1/0"),
        "{traceback}"
    );
    assert_eq!(lines.last().map(|l| l["type"].clone()), Some(json!("end")));

    let (status, r) = gw
        .post_json(
            &format!("/api/kernels/{id}/execute"),
            json!({"code": code, "plain": true}),
        )
        .await?;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["stdout"], "100% done\nlast");
    assert_eq!(r["stderr"], "red\n");
    assert!(
        !r["error"]["traceback"].to_string().contains("\\u001b"),
        "{r}"
    );
    // Without it, the text is as the kernel sent it.
    let r = execute(&gw, &id, code, None).await?;
    assert!(
        r["stdout"]
            .as_str()
            .is_some_and(|s| s.starts_with("\r  0%\r 25%")),
        "{r}"
    );
    assert!(
        r["stderr"]
            .as_str()
            .is_some_and(|s| s.contains("\u{1b}[31m")),
        "{r}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_run_in_order() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = kernel(&gw).await?;
    execute(&gw, &id, "import time\nlog = []", None).await?;
    let call = |n: u32| {
        let code = format!(
            "log.append(('start', {n}))\ntime.sleep(0.4)\nlog.append(('end', {n}))\nprint({n})"
        );
        execute(&gw, &id, Box::leak(code.into_boxed_str()), None)
    };
    let results = futures::future::join_all((0..4).map(call)).await;
    for r in &results {
        assert_eq!(
            r.as_ref().map(|v| v["status"].clone()).ok(),
            Some(json!("ok"))
        );
    }
    let r = execute(&gw, &id, "print(all(log[i][0] == 'start' and log[i + 1] == ('end', log[i][1]) for i in range(0, len(log), 2)), len(log))", None).await?;
    assert_eq!(r["stdout"], "True 8\n", "runs interleaved");
    Ok(())
}

/// What the kernel's own filesystem refuses is the caller's problem, said as such: a file
/// where a directory should be (409), no permission (403), a full working directory (507,
/// with no half upload left behind). Never a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_errors_say_what_the_filesystem_refused() -> Result<()> {
    let gw = Gateway::start(&["--kernel-disk-mb", "4"]).await?;
    let id = kernel(&gw).await?;
    let call = |method: reqwest::Method, path: &str, body: Vec<u8>| {
        gw.request(method, &format!("/api/kernels/{id}/files/{path}"))
            .body(body)
            .send()
    };
    let answer = |r: reqwest::Response| async move {
        let status = r.status().as_u16();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        (
            status,
            body["message"].as_str().unwrap_or_default().to_owned(),
        )
    };

    assert_eq!(
        call(reqwest::Method::PUT, "a", b"x".to_vec())
            .await?
            .status(),
        201
    );
    let (status, message) = answer(call(reqwest::Method::PUT, "a/b", b"x".to_vec()).await?).await;
    assert_eq!((status, message.as_str()), (409, "a/b: File exists"));

    let r = execute(
        &gw,
        &id,
        "import os\nos.makedirs('locked')\nopen('locked/f', 'w').write('1')\nos.chmod('locked/f', 0)\nos.chmod('locked', 0o500)",
        None,
    )
    .await?;
    assert_eq!(r["status"], "ok", "{r}");
    for (method, path) in [
        (reqwest::Method::GET, "locked/f"),
        (reqwest::Method::PUT, "locked/g"),
        (reqwest::Method::DELETE, "locked/f"),
    ] {
        let (status, message) = answer(call(method.clone(), path, b"x".to_vec()).await?).await;
        assert_eq!(status, 403, "{method} {path}: {message}");
        assert!(message.contains("Permission denied"), "{message}");
    }

    let (status, message) =
        answer(call(reqwest::Method::PUT, "big", vec![7u8; 5 << 20]).await?).await;
    assert_eq!(status, 507, "{message}");
    assert!(message.contains("No space left"), "{message}");
    let (_, listing) = gw.get_json(&format!("/api/kernels/{id}/files")).await?;
    let names: Vec<&str> = listing
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert_eq!(names, ["a", "locked"], "no half upload stays");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_go_in_and_out_and_stay_confined() -> Result<()> {
    let gw = Gateway::start(&["--max-message-mb", "1"]).await?;
    let id = kernel(&gw).await?;
    let put = |path: &str, body: Vec<u8>| {
        gw.request(
            reqwest::Method::PUT,
            &format!("/api/kernels/{id}/files/{path}"),
        )
        .body(body)
        .send()
    };

    let csv = b"city,temp\nOslo,4\nLima,19\nCairo,28\n".to_vec();
    let r = put("data/weather.csv", csv).await?;
    assert_eq!(r.status().as_u16(), 201);
    let r = execute(
        &gw,
        &id,
        "import pandas as pd\nw = pd.read_csv('data/weather.csv')\nprint(w['temp'].mean())",
        None,
    )
    .await?;
    assert_eq!(r["stdout"], "17.0\n");

    let r = execute(
        &gw,
        &id,
        "open('out.bin', 'wb').write(bytes(range(256)) * 1000)",
        None,
    )
    .await?;
    assert_eq!(r["status"], "ok");
    let got = gw
        .request(
            reqwest::Method::GET,
            &format!("/api/kernels/{id}/files/out.bin"),
        )
        .send()
        .await?;
    assert_eq!(got.status().as_u16(), 200);
    let bytes = got.bytes().await?;
    let expected: Vec<u8> = (0..1000).flat_map(|_| 0..=255u8).collect();
    assert_eq!(bytes.as_ref(), expected.as_slice());
    // A part of it, with a Range header; a range past the end says the size.
    let ranged = |range: &'static str| {
        gw.request(
            reqwest::Method::GET,
            &format!("/api/kernels/{id}/files/out.bin"),
        )
        .header("Range", range)
        .send()
    };
    let part = ranged("bytes=300-555").await?;
    assert_eq!(part.status().as_u16(), 206);
    assert_eq!(part.headers()["content-range"], "bytes 300-555/256000");
    assert_eq!(part.bytes().await?.as_ref(), &expected[300..556]);
    let tail = ranged("bytes=255990-").await?;
    assert_eq!(
        tail.headers()["content-range"],
        "bytes 255990-255999/256000"
    );
    assert_eq!(tail.bytes().await?.as_ref(), &expected[255_990..]);
    let past = ranged("bytes=256000-").await?;
    assert_eq!(past.status().as_u16(), 416);
    assert_eq!(past.headers()["content-range"], "bytes */256000");

    let (status, listing) = gw.get_json(&format!("/api/kernels/{id}/files")).await?;
    assert_eq!(status, 200);
    let names: Vec<&str> = listing
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert!(
        names.contains(&"out.bin") && names.contains(&"data"),
        "{names:?}"
    );
    let (_, sub) = gw
        .get_json(&format!("/api/kernels/{id}/files/data"))
        .await?;
    assert_eq!(sub[0]["name"], "weather.csv");
    assert_eq!(sub[0]["size"], 34);

    // Everything that would leave the working directory is refused with a clear error.
    execute(&gw, &id, "import os\nos.symlink('/etc', 'etc-link')", None).await?;
    for path in [
        "../etc/passwd",
        "data/../../etc/passwd",
        "%2e%2e/etc/passwd",
        "/etc/passwd",
        "etc-link/passwd",
        "a%00b",
        "line%0Abreak",
    ] {
        let r = gw
            .request(
                reqwest::Method::GET,
                &format!("/api/kernels/{id}/files/{path}"),
            )
            .send()
            .await?;
        let status = r.status().as_u16();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        assert!(status == 400 || status == 404, "{path}: {status} {body}");
        if path.contains('%') && !path.starts_with("%2e") {
            assert_eq!(status, 400, "{path}: {body}");
        }
        assert!(body["message"].is_string(), "{path}: {body}");
        let r = put(path, b"x".to_vec()).await?;
        assert!(
            matches!(r.status().as_u16(), 400 | 404),
            "upload to {path}: {}",
            r.status()
        );
    }
    let r = execute(
        &gw,
        &id,
        "import os\nprint(os.path.exists('/etc/passwd-x'))",
        None,
    )
    .await?;
    assert_eq!(r["stdout"], "False\n");

    let r = put("big.bin", vec![0u8; 2 << 20]).await?;
    assert_eq!(r.status().as_u16(), 413);
    let body: Value = r.json().await?;
    assert!(
        body["message"]
            .as_str()
            .unwrap_or_default()
            .contains("limit"),
        "{body}"
    );

    let r = gw
        .request(
            reqwest::Method::DELETE,
            &format!("/api/kernels/{id}/files/out.bin"),
        )
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 204);
    let r = gw
        .request(
            reqwest::Method::GET,
            &format!("/api/kernels/{id}/files/out.bin"),
        )
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 404);
    let r = gw
        .request(
            reqwest::Method::GET,
            &format!("/api/kernels/{}/files/x", uuid::Uuid::new_v4()),
        )
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 404);
    Ok(())
}

/// A widget output is text for a model: the agent API (JSON and NDJSON) and MCP name the
/// widget and its value and say it is interactive in JupyterLab; the agent API keeps the
/// widget view's MIME type for clients that render widgets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_widget_is_text_that_names_it_and_its_value() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = kernel(&gw).await?;
    let code = "import ipywidgets as w\ns = w.IntSlider(value=5, description='x')\ns";
    let named = |text: &str| {
        text.contains("IntSlider(value=5, description='x')")
            && text.contains("interactive in JupyterLab")
    };

    let r = execute(&gw, &id, code, None).await?;
    let result = &r["results"][0];
    assert!(
        named(result["data"]["text/plain"].as_str().unwrap_or_default()),
        "{r}"
    );
    assert!(
        result["data"]["application/vnd.jupyter.widget-view+json"]["model_id"].is_string(),
        "{r}"
    );

    let lines = stream_lines(&gw, &id, json!({"code": "s.value = 6\ns", "plain": true})).await?;
    let text = lines
        .iter()
        .find(|l| l["type"] == "result")
        .map(|l| {
            l["data"]["text/plain"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .unwrap_or_default();
    assert!(
        text.contains("IntSlider(value=6, description='x')") && text.contains("JupyterLab"),
        "{lines:?}"
    );

    let mut mcp = kernelgate_client::mcp::McpCalls::new(gw.client());
    let text = mcp
        .run_python(&id, "w.FloatSlider(value=2.5, description='y')")
        .await?;
    assert!(
        text.contains("FloatSlider(value=2.5, description='y')")
            && text.contains("interactive in JupyterLab"),
        "{text}"
    );
    Ok(())
}
