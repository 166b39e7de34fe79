//! End to end: tenants. Keys made with `kernelgate keys add`; two tenants without admin
//! rights and one admin. A tenant's kernels do not exist for another (404 on every route,
//! nothing changes); per-key limits hold exactly under concurrent creates; a key removed
//! from the file and revoked with SIGHUP is refused at once, its WebSockets close and its
//! kernels go; owners survive a restart of the gateway; failed logins are throttled, valid
//! tokens never.

use anyhow::{bail, Context, Result};
use kernelgate_tests::{keys, Gateway};
use reqwest::Method;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

struct Tenants {
    _dir: tempfile::TempDir,
    file: PathBuf,
    alice: String,
    bob: String,
    root: String,
}

fn tenants(alice_max: &str) -> Result<Tenants> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("keys.toml");
    let alice = keys(&file, &["add", "alice", "--max-kernels", alice_max])?;
    let bob = keys(&file, &["add", "bob", "--max-kernels", "2"])?;
    let root = keys(&file, &["add", "root", "--admin"])?;
    let (alice, bob, root) = (
        alice.trim().to_owned(),
        bob.trim().to_owned(),
        root.trim().to_owned(),
    );
    for t in [&alice, &bob, &root] {
        assert_eq!(
            t.len(),
            64,
            "keys add prints the token and nothing else: {t:?}"
        );
    }
    Ok(Tenants {
        _dir: dir,
        file,
        alice,
        bob,
        root,
    })
}

async fn create(gw: &Gateway, token: &str) -> Result<String> {
    let (status, model) = gw
        .call_as(
            token,
            Method::POST,
            "/api/kernels",
            Some(json!({"name": "python3"})),
        )
        .await?;
    if status != 201 {
        bail!("create: {status} {model}");
    }
    Ok(model["id"].as_str().unwrap_or_default().to_owned())
}

fn ids(list: &Value) -> Vec<String> {
    list.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|k| k["id"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// A WebSocket to a kernel's channels with `token`: the HTTP status of a refused upgrade.
async fn websocket(
    gw: &Gateway,
    token: &str,
    id: &str,
) -> Result<std::result::Result<kernelgate_tests::WsStream, u16>> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let url = format!(
        "ws://{}/api/kernels/{id}/channels?session_id=s-{}",
        gw.base.trim_start_matches("http://"),
        uuid::Uuid::new_v4().simple()
    );
    let mut req = url.into_client_request()?;
    req.headers_mut()
        .insert("Authorization", format!("token {token}").parse()?);
    match tokio_tungstenite::connect_async(req).await {
        Ok((ws, _)) => Ok(Ok(ws)),
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => Ok(Err(r.status().as_u16())),
        Err(e) => Err(e.into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_see_or_touch_another_tenants_kernels() -> Result<()> {
    let t = tenants("3")?;
    let gw = Gateway::start(&["--keys", &t.file.display().to_string()]).await?;
    let a = create(&gw, &t.alice).await?;
    let r = gw
        .execute_as(
            &t.alice,
            &a,
            "secret = 'alice'\nopen('mine.txt', 'w').write('hers')",
        )
        .await?;
    assert_eq!(r["status"], "ok", "{r}");

    let (status, list) = gw
        .call_as(&t.bob, Method::GET, "/api/kernels", None)
        .await?;
    assert_eq!(status, 200);
    assert!(
        !ids(&list).contains(&a),
        "bob does not see alice's kernel: {list}"
    );
    let k = format!("/api/kernels/{a}");
    for (method, path, body) in [
        (Method::GET, k.clone(), None),
        (Method::POST, format!("{k}/interrupt"), None),
        (Method::POST, format!("{k}/restart"), None),
        (
            Method::POST,
            format!("{k}/execute"),
            Some(json!({"code": "secret = 'bob'"})),
        ),
        (Method::GET, format!("{k}/files"), None),
        (Method::GET, format!("{k}/files/mine.txt"), None),
        (
            Method::PUT,
            format!("{k}/files/mine.txt"),
            Some(json!("bob's")),
        ),
        (Method::DELETE, format!("{k}/files/mine.txt"), None),
        (Method::DELETE, k.clone(), None),
    ] {
        let (status, body) = gw.call_as(&t.bob, method.clone(), &path, body).await?;
        assert_eq!(status, 404, "{method} {path} as bob: {body}");
    }
    match websocket(&gw, &t.bob, &a).await? {
        Err(status) => assert_eq!(status, 404),
        Ok(_) => bail!("bob opened alice's channels"),
    }
    // Nothing changed for alice: same variables (no restart, no execution), same file.
    let r = gw
        .execute_as(&t.alice, &a, "print(secret, open('mine.txt').read())")
        .await?;
    assert_eq!(r["stdout"], "alice hers\n", "{r}");
    assert!(websocket(&gw, &t.alice, &a).await?.is_ok());

    // The admin sees and uses every kernel; bob's own kernel is his.
    let b = create(&gw, &t.bob).await?;
    let (_, list) = gw
        .call_as(&t.root, Method::GET, "/api/kernels", None)
        .await?;
    let all = ids(&list);
    assert!(all.contains(&a) && all.contains(&b), "{list}");
    assert_eq!(
        gw.execute_as(&t.root, &a, "secret").await?["results"][0]["data"]["text/plain"],
        "'alice'"
    );
    let (_, mine) = gw
        .call_as(&t.alice, Method::GET, "/api/kernels", None)
        .await?;
    assert_eq!(ids(&mine), vec![a.clone()]);

    // `keys list` shows names and limits, never tokens.
    let listed = keys(&t.file, &["list"])?;
    assert!(
        listed.contains("alice") && listed.contains("root"),
        "{listed}"
    );
    assert!(!listed.contains(&t.alice));
    let stored = std::fs::read_to_string(&t.file)?;
    assert!(!stored.contains(&t.alice) && !stored.contains(&t.root));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_limits_hold_under_concurrent_creates() -> Result<()> {
    let t = tenants("3")?;
    let gw = Gateway::start(&[
        "--keys",
        &t.file.display().to_string(),
        "--max-kernels",
        "30",
    ])
    .await?;
    let creates = (0..20).map(|_| {
        gw.call_as(
            &t.alice,
            Method::POST,
            "/api/kernels",
            Some(json!({"name": "python3"})),
        )
    });
    let results = futures::future::join_all(creates).await;
    let mut created = 0;
    for r in results {
        let (status, body) = r?;
        match status {
            201 => created += 1,
            403 => {
                let message = body["message"].as_str().unwrap_or_default();
                assert!(
                    message.contains("max_kernels") && message.contains("alice"),
                    "{body}"
                );
            }
            other => bail!("unexpected {other}: {body}"),
        }
    }
    assert_eq!(created, 3, "exactly alice's limit");
    let (_, list) = gw
        .call_as(&t.root, Method::GET, "/api/kernels", None)
        .await?;
    assert_eq!(ids(&list).len(), 3);
    // Bob's count is his own.
    create(&gw, &t.bob).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_key_is_refused_and_loses_its_sockets_and_kernels() -> Result<()> {
    let t = tenants("3")?;
    let gw = Gateway::start(&["--keys", &t.file.display().to_string()]).await?;
    let a = create(&gw, &t.alice).await?;
    let b = create(&gw, &t.bob).await?;
    let mut socket = match websocket(&gw, &t.bob, &b).await? {
        Ok(ws) => ws,
        Err(status) => bail!("bob's WebSocket refused: {status}"),
    };
    keys(&t.file, &["remove", "bob"])?;
    let pid = gw.pid().context("gateway pid")?;
    let sent = std::process::Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()?;
    assert!(sent.success());

    // Refused at once (the reload is asynchronous: give it a moment).
    let mut refused = false;
    for _ in 0..50 {
        if gw
            .call_as(&t.bob, Method::GET, "/api/kernels", None)
            .await?
            .0
            == 403
        {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(refused, "bob's key is refused after SIGHUP");
    // The WebSocket closes.
    use futures::StreamExt;
    let closed = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(m) = socket.next().await {
            if m.is_err() || m.is_ok_and(|m| m.is_close()) {
                return;
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "bob's WebSocket was closed");
    // His kernel is gone, container and all; alice's is not.
    let container_exists = || {
        std::process::Command::new("docker")
            .args(["inspect", &format!("kernelgate-{b}")])
            .output()
            .map(|o| o.status.success())
    };
    let mut gone = false;
    for _ in 0..100 {
        let (_, list) = gw
            .call_as(&t.root, Method::GET, "/api/kernels", None)
            .await?;
        if !ids(&list).contains(&b) && !container_exists()? {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(gone, "bob's kernel was shut down, its container removed");
    assert_eq!(
        gw.execute_as(&t.alice, &a, "1 + 1").await?["results"][0]["data"]["text/plain"],
        "2"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_survive_a_restart_of_the_gateway() -> Result<()> {
    let t = tenants("3")?;
    let dir = format!("/run/kg-owners-{}", std::process::id());
    let file = t.file.display().to_string();
    let gw = Gateway::start(&["--keys", &file, "--runtime-dir", &dir, "--pool-size", "1"]).await?;
    gw.wait_pool("filled").await?;
    // The first from the warm pool (owner recorded at hand-out), the second started cold.
    let pooled = create(&gw, &t.alice).await?;
    let cold = create(&gw, &t.alice).await?;
    let crashed = gw.crash().await?;

    let gw = crashed
        .restart(&["--keys", &file, "--pool-size", "0"])
        .await?;
    let (_, mine) = gw
        .call_as(&t.alice, Method::GET, "/api/kernels", None)
        .await?;
    let mut mine = ids(&mine);
    mine.sort();
    let mut expected = vec![pooled.clone(), cold.clone()];
    expected.sort();
    assert_eq!(mine, expected, "alice's kernels are hers again");
    let (_, bobs) = gw
        .call_as(&t.bob, Method::GET, "/api/kernels", None)
        .await?;
    assert_eq!(ids(&bobs), Vec::<String>::new());
    assert_eq!(
        gw.call_as(&t.bob, Method::GET, &format!("/api/kernels/{pooled}"), None)
            .await?
            .0,
        404
    );
    assert_eq!(gw.stop().await?.code(), Some(0));
    let _ = std::fs::remove_dir(&dir);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_logins_are_throttled_and_valid_tokens_never() -> Result<()> {
    let t = tenants("3")?;
    let gw = Gateway::start(&["--keys", &t.file.display().to_string()]).await?;
    for i in 0..10 {
        let (status, _) = gw
            .call_as(&format!("wrong-{i}"), Method::GET, "/api/kernels", None)
            .await?;
        assert_eq!(status, 403);
    }
    let r = reqwest::Client::new()
        .get(gw.url("/api/kernels"))
        .header("Authorization", "token wrong-again")
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 429);
    let wait: u64 = r
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .context("Retry-After")?;
    assert!((1..=60).contains(&wait), "{wait}");
    // From the same address, a valid key still passes at once.
    assert_eq!(
        gw.call_as(&t.alice, Method::GET, "/api/kernels", None)
            .await?
            .0,
        200
    );
    let logged = gw
        .logs
        .lock()
        .map(|l| {
            l.iter()
                .filter(|l| l.contains("failed authentications in a minute"))
                .count()
        })
        .unwrap_or(0);
    assert_eq!(logged, 1, "the burst is logged once");
    Ok(())
}

/// A client whose body reaches the gateway after its refusal (headers and body in two
/// writes, as HTTP clients send a POST) keeps its connection: every request on it gets its
/// own 403, none a reset or a closed connection (a client reusing its pooled connection
/// would otherwise see a network error instead of the answer that says what to do).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_leaves_its_connection_usable() -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let gw = Gateway::start(&[]).await?;
    let addr = gw.base.trim_start_matches("http://").to_owned();
    let mut conn = tokio::net::TcpStream::connect(&addr).await?;
    conn.set_nodelay(true)?;
    let body = br#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#;
    for round in 0..3 {
        let head = format!(
            "POST /mcp HTTP/1.1\r\nHost: {addr}\r\nAuthorization: token wrong\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        conn.write_all(head.as_bytes()).await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
        conn.write_all(body).await?;
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        // One response: its head, then the Content-Length bytes of its body.
        let complete = loop {
            let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut buf))
                .await
                .context("no answer within 10 s")??;
            if n == 0 {
                break false;
            }
            answer.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&answer);
            if let Some((head, rest)) = text.split_once("\r\n\r\n") {
                let length: usize = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().to_owned())
                    })
                    .context("a Content-Length")?
                    .parse()?;
                if rest.len() >= length {
                    break true;
                }
            }
        };
        let text = String::from_utf8_lossy(&answer);
        assert!(complete, "round {round}: the connection closed: {text:?}");
        assert!(text.starts_with("HTTP/1.1 403"), "round {round}: {text}");
        assert!(
            text.contains("Missing or wrong token"),
            "round {round}: {text}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_memory_and_cpu_limits_hold_with_a_warm_pool() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("keys.toml");
    let small = keys(
        &file,
        &[
            "add",
            "small",
            "--max-memory-mb",
            "256",
            "--max-cpus",
            "0.5",
        ],
    )?;
    let plain = keys(&file, &["add", "plain"])?;
    let gw = Gateway::start(&[
        "--keys",
        &file.display().to_string(),
        "--pool-size",
        "1",
        "--kernel-memory-mb",
        "1024",
    ])
    .await?;
    gw.wait_pool("filled").await?;
    let limits = |id: &str| -> Result<(i64, i64)> {
        let c = kernelgate_tests::inspect(id)?;
        Ok((
            c["HostConfig"]["Memory"].as_i64().unwrap_or_default(),
            c["HostConfig"]["NanoCpus"].as_i64().unwrap_or_default(),
        ))
    };
    // The warm kernel runs with the configured limits: the small key gets one of its own.
    let id = create(&gw, small.trim()).await?;
    assert_eq!(limits(&id)?, (256 << 20, 500_000_000));
    assert_eq!(
        gw.execute_as(small.trim(), &id, "1 + 1").await?["status"],
        "ok"
    );
    let id = create(&gw, plain.trim()).await?;
    assert_eq!(limits(&id)?, (1024 << 20, 1_000_000_000));
    Ok(())
}
