//! End to end: the real `kernelgate` binary, real Docker, the real kernel image.
//! What a user of Jupyter's kernel API checks: REST, channels, sandboxing, lifecycle.

use anyhow::Result;
use kernelgate_tests::{decode_png, Gateway};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn id_of(model: &Value) -> String {
    model["id"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_api_matches_jupyter_server() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let http = reqwest::Client::new();

    // Public as in jupyter_server: the version only. What kernels run under and whether a
    // policy is in force are for key holders.
    let api: Value = http.get(gw.url("/api")).send().await?.json().await?;
    assert!(api["version"].is_string());
    assert_eq!(api.as_object().map(|o| o.len()), Some(1), "{api}");
    let wrong: Value = http
        .get(gw.url("/api"))
        .header("Authorization", "token wrong")
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(wrong.as_object().map(|o| o.len()), Some(1), "{wrong}");
    let (_, api) = gw.get_json("/api").await?;
    assert!(api["kernelgate"]["runtime"].is_string(), "{api}");
    assert_eq!(api["kernelgate"]["policy"], false);

    // The token is required, and the refusal says how to pass it.
    let r = http.get(gw.url("/api/kernels")).send().await?;
    assert_eq!(r.status().as_u16(), 403);
    let body: Value = r.json().await?;
    assert!(body["message"]
        .as_str()
        .unwrap_or_default()
        .contains("token"));
    let r = http
        .get(gw.url(&format!("/api/kernels?token={}", gw.token)))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 200);
    let r = http
        .get(gw.url("/api/kernels"))
        .header("Authorization", format!("Bearer {}", gw.token))
        .send()
        .await?;
    assert_eq!(r.json::<Value>().await?, json!([]));

    let (status, specs) = gw.get_json("/api/kernelspecs").await?;
    assert_eq!(status, 200);
    assert_eq!(specs["default"], "python3");
    let spec = &specs["kernelspecs"]["python3"];
    assert_eq!(spec["spec"]["language"], "python");
    let logo = spec["resources"]["logo-64x64"].as_str().unwrap_or_default();
    assert!(logo.contains("/kernelspecs/python3/"), "{logo}");
    let png = gw.request(reqwest::Method::GET, logo).send().await?;
    assert_eq!(png.headers()["content-type"], "image/png");
    assert!(png.bytes().await?.starts_with(b"\x89PNG"));
    assert_eq!(gw.get_json("/api/kernelspecs/nope").await?.0, 404);

    let (status, err) = gw
        .get_json(&format!("/api/kernels/{}", uuid::Uuid::new_v4()))
        .await?;
    assert_eq!(status, 404);
    assert_eq!(err["reason"], "Not Found");
    let (status, _) = gw
        .post_json("/api/kernels", json!({"name": "julia"}))
        .await?;
    assert_eq!(status, 404);

    // Create as JupyterLab does, with its KERNEL_* hints and a junk variable.
    let r = gw
        .request(reqwest::Method::POST, "/api/kernels")
        .json(
            &json!({"name": "python3", "env": {"KERNEL_LAUNCH_TIMEOUT": "40",
            "KERNEL_WORKING_DIR": "/Users/someone/notebooks", "PATH": "/evil"}}),
        )
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 201);
    let location = r.headers()["location"].to_str()?.to_owned();
    let model: Value = r.json().await?;
    let id = id_of(&model);
    assert!(uuid::Uuid::parse_str(&id).is_ok(), "{id}");
    assert_eq!(location, format!("/api/kernels/{id}"));
    assert_eq!(model["name"], "python3");
    assert_eq!(model["execution_state"], "idle");
    assert_eq!(model["connections"], 0);
    let stamp = regex::Regex::new(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")?;
    assert!(
        stamp.is_match(model["last_activity"].as_str().unwrap_or_default()),
        "{model}"
    );

    let (_, list) = gw.get_json("/api/kernels").await?;
    assert_eq!(list.as_array().map(|a| a.len()), Some(1));
    let client = gw.channels(&id, "s1").await?;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        gw.get_json(&format!("/api/kernels/{id}")).await?.1["connections"],
        1
    );
    client.close().await?;

    assert_eq!(gw.delete_kernel(&id).await?, 204);
    assert_eq!(gw.get_json(&format!("/api/kernels/{id}")).await?.0, 404);
    assert_eq!(gw.delete_kernel(&id).await?, 404);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notebook_session_runs_code_and_keeps_state() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = id_of(&gw.create_kernel().await?);
    let mut c = gw.channels(&id, "nb-session").await?;

    let info = c.kernel_info().await?;
    assert!(info["protocol_version"]
        .as_str()
        .unwrap_or_default()
        .starts_with('5'));
    assert_eq!(info["language_info"]["name"], "python");

    assert_eq!(c.execute("x = 41").await?.status, "ok");
    let r = c.execute("x + 1").await?;
    assert_eq!(r.result_text().as_deref(), Some("42"));
    assert!(r.execution_count.is_some_and(|n| n >= 2));

    let r = c
        .execute("import sys\nprint('to out')\nprint('to err', file=sys.stderr)")
        .await?;
    assert_eq!(r.stdout, "to out\n");
    assert_eq!(r.stderr, "to err\n");

    let r = c
        .execute(
            "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('chart')\nplt.show()",
        )
        .await?;
    let (w, h) = decode_png(r.png()?)?;
    assert!(w > 100 && h > 100, "{w}x{h}");

    let r = c.execute("1/0").await?;
    assert_eq!(r.status, "error");
    assert_eq!(r.ename().as_deref(), Some("ZeroDivisionError"));
    let tb = r
        .error
        .as_ref()
        .map(|e| e["traceback"].to_string())
        .unwrap_or_default();
    assert!(
        tb.contains("1/0") || tb.contains("ZeroDivisionError"),
        "{tb}"
    );

    // input() goes out on stdin and the answer comes back.
    let req = c
        .start_execute("name = input('name? ')\nprint('hello', name)")
        .await?;
    let ask = c
        .wait_for(Duration::from_secs(30), |m| {
            m["msg_type"] == "input_request"
        })
        .await?;
    assert_eq!(ask["content"]["prompt"], "name? ");
    assert_eq!(ask["channel"], "stdin");
    c.send("stdin", "input_reply", json!({"value": "agent"}))
        .await?;
    let r = c.collect(&req, Duration::from_secs(30)).await?;
    assert_eq!(r.stdout, "hello agent\n");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupt_keeps_state_and_restart_clears_it() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = id_of(&gw.create_kernel().await?);
    let mut c = gw.channels(&id, "s").await?;
    c.execute("x = 41").await?;

    let req = c.start_execute("import time\ntime.sleep(60)").await?;
    c.wait_for(Duration::from_secs(10), |m| {
        m["msg_type"] == "status"
            && m["content"]["execution_state"] == "busy"
            && m["parent_header"]["msg_id"] == req.as_str()
    })
    .await?;
    let (_, model) = gw.get_json(&format!("/api/kernels/{id}")).await?;
    assert_eq!(model["execution_state"], "busy");
    let started = Instant::now();
    let (status, _) = gw
        .post_json(&format!("/api/kernels/{id}/interrupt"), json!({}))
        .await?;
    assert_eq!(status, 204);
    let r = c.collect(&req, Duration::from_secs(20)).await?;
    assert_eq!(r.ename().as_deref(), Some("KeyboardInterrupt"));
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(
        c.execute("x + 1").await?.result_text().as_deref(),
        Some("42")
    );

    let (status, model) = gw
        .post_json(&format!("/api/kernels/{id}/restart"), json!({}))
        .await?;
    assert_eq!(status, 200, "{model}");
    assert_eq!(model["id"], id.as_str());
    // A restart the user asked for is not announced as `restarting`: JupyterLab would
    // report the kernel as died.
    assert!(!c
        .seen
        .iter()
        .any(|m| m["content"]["execution_state"] == "restarting"));
    let r = c.execute("x").await?;
    assert_eq!(r.ename().as_deref(), Some("NameError"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernels_are_sandboxed_and_isolated() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let a = id_of(&gw.create_kernel().await?);
    let b = id_of(&gw.create_kernel().await?);
    let mut ca = gw.channels(&a, "a").await?;
    let mut cb = gw.channels(&b, "b").await?;

    ca.execute("secret = 'kernel-a'\nopen('/tmp/a.txt', 'w').write('a')\nopen('a-home.txt', 'w').write('a')")
        .await?;
    let r = cb
        .execute("import os\nprint('secret' in globals(), os.path.exists('/tmp/a.txt'), os.path.exists('a-home.txt'))")
        .await?;
    assert_eq!(r.stdout, "False False False\n");

    let probe = r#"
import ctypes, os, json, resource, socket
def writable(p):
    try:
        open(p, 'w').close(); return True
    except OSError:
        return False
caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith(('CapEff', 'CapPrm', 'CapBnd'))]
print(json.dumps({
    'uid': os.getuid(),
    'caps': caps,
    # The kernel's own answer, as `ip link` asks it (the 2024 runsc has no /sys/class/net
    # with --network=none), and its routing table.
    'nets': sorted(name for _, name in socket.if_nameindex()),
    'routes': open('/proc/net/route').read().splitlines()[1:],
    'root_writable': writable('/kernelgate-probe') or writable('/usr/lib/probe'),
    'docker_sock': os.path.exists('/var/run/docker.sock') or os.path.exists('/run/docker.sock'),
    'env': dict(os.environ),
    # prctl(PR_GET_NO_NEW_PRIVS): gVisor's /proc/self/status has no NoNewPrivs line.
    'nnp': ctypes.CDLL(None).prctl(39, 0, 0, 0, 0),
    'core': resource.getrlimit(resource.RLIMIT_CORE),
    'nofile': resource.getrlimit(resource.RLIMIT_NOFILE),
    'cgroup': open('/proc/self/cgroup').read(),
}))
"#;
    let r = ca.execute(probe).await?;
    let facts: Value = serde_json::from_str(r.stdout.trim())?;
    assert_ne!(facts["uid"], 0);
    assert_eq!(
        facts["caps"],
        json!(["0000000000000000", "0000000000000000", "0000000000000000"])
    );
    assert_eq!(facts["nets"], json!(["lo"]));
    assert_eq!(facts["routes"], json!([]), "no route anywhere");
    assert_eq!(facts["root_writable"], false);
    assert_eq!(facts["docker_sock"], false);
    assert_eq!(facts["nnp"], 1, "no_new_privs is set");
    assert_eq!(facts["core"], json!([0, 0]), "no core dumps");
    assert_eq!(facts["nofile"], json!([4096, 4096]));
    // A private cgroup namespace: the kernel sees itself at the root, not the host's paths.
    // gVisor has no cgroup namespaces: the 2024 runsc shows its own cgroupfs, kept in its
    // Sentry, with the container at `/<container id>` (controllers such as `job` that no
    // host has); Debian's 2022 runsc shows none.
    let cgroup = facts["cgroup"].as_str().unwrap_or_default();
    let own = if kernelgate_tests::gvisor() {
        format!(":/{}", gw.sandbox(&a)?.id)
    } else {
        ":/".to_owned()
    };
    assert!(
        !cgroup.contains("docker")
            && cgroup
                .lines()
                .all(|l| l.ends_with(":/") || l.ends_with(&own)),
        "{cgroup}"
    );
    let env = facts["env"].to_string();
    assert!(
        !env.contains(&gw.token),
        "gateway token visible in kernel env"
    );
    assert!(!env.contains("KERNELGATE_TOKEN"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_with_same_session_gets_missed_output() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = id_of(&gw.create_kernel().await?);
    let mut c = gw.channels(&id, "laptop").await?;
    let req = c
        .start_execute("import time\ntime.sleep(1.5)\nprint('produced while away')\n'result'")
        .await?;
    c.close().await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut again = gw.channels(&id, "laptop").await?;
    let r = again.collect(&req, Duration::from_secs(20)).await?;
    assert_eq!(r.stdout, "produced while away\n");
    assert_eq!(r.result_text().as_deref(), Some("'result'"));
    assert_eq!(r.status, "ok");

    // A newer socket with the same session takes over from an older one that is still open.
    let mut newer = gw.channels(&id, "laptop").await?;
    let closed = again.recv(Duration::from_secs(5)).await;
    assert!(
        closed.is_err(),
        "old socket should be closed, got {closed:?}"
    );
    assert_eq!(
        newer.execute("6*7").await?.result_text().as_deref(),
        Some("42")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_subprotocol_is_selected_and_works() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = id_of(&gw.create_kernel().await?);
    let mut c = gw
        .channels_with(
            &id,
            "v1",
            Some(kernelgate_protocol::websocket::V1_SUBPROTOCOL),
        )
        .await?;
    assert!(c.v1, "gateway did not select the v1 subprotocol");
    let r = c.execute("print('v1 ok')\n40 + 2").await?;
    assert_eq!(r.stdout, "v1 ok\n");
    assert_eq!(r.result_text().as_deref(), Some("42"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_kernel_is_reported_and_others_keep_working() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let victim = id_of(&gw.create_kernel().await?);
    let other = id_of(&gw.create_kernel().await?);
    let mut cv = gw.channels(&victim, "v").await?;
    let mut co = gw.channels(&other, "o").await?;
    co.execute("y = 7").await?;

    cv.start_execute("import os\nos._exit(1)").await?;
    let started = Instant::now();
    let status = cv
        .wait_for(Duration::from_secs(10), |m| {
            m["msg_type"] == "status"
                && matches!(
                    m["content"]["execution_state"].as_str(),
                    Some("restarting" | "dead")
                )
        })
        .await?;
    // Noticed when the kernel exits (the engine's exit watch), with room for a 2-core
    // machine running two suites beside this one (the gVisor engine's sandbox teardown
    // took 2.07 s once under that load).
    let noticed = started.elapsed();
    assert!(
        noticed < Duration::from_secs(5),
        "death noticed after {noticed:?}: {status}"
    );
    assert_eq!(
        co.execute("y * 6").await?.result_text().as_deref(),
        Some("42")
    );
    // Autorestart is on by default: the victim comes back, empty.
    let r = cv.execute_for("'back'", Duration::from_secs(60)).await?;
    assert_eq!(r.result_text().as_deref(), Some("'back'"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_limit_holds_under_concurrent_creates() -> Result<()> {
    let gw = Gateway::start(&["--max-kernels", "5"]).await?;
    let creates = (0..20).map(|_| {
        gw.request(reqwest::Method::POST, "/api/kernels")
            .json(&json!({"name": "python3"}))
            .send()
    });
    let results = futures::future::join_all(creates).await;
    let mut codes: Vec<u16> = Vec::new();
    for r in results {
        let r = r?;
        let code = r.status().as_u16();
        if code == 403 {
            let body: Value = r.json().await?;
            assert!(
                body["message"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("5 kernels"),
                "{body}"
            );
        }
        codes.push(code);
    }
    assert_eq!(codes.iter().filter(|c| **c == 201).count(), 5, "{codes:?}");
    assert_eq!(codes.iter().filter(|c| **c == 403).count(), 15, "{codes:?}");
    let (_, list) = gw.get_json("/api/kernels").await?;
    assert_eq!(list.as_array().map(|a| a.len()), Some(5));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_client_input_never_breaks_the_session() -> Result<()> {
    use tokio_tungstenite::tungstenite::Message as WsMessage;
    let gw = Gateway::start(&["--max-message-mb", "1"]).await?;
    let id = id_of(&gw.create_kernel().await?);
    let mut c = gw.channels(&id, "fuzzy").await?;
    for junk in [
        WsMessage::Text("{not json".into()),
        WsMessage::Text(r#"{"channel":"nowhere","header":{"msg_type":"x"}}"#.into()),
        WsMessage::Text(r#"{"header":{"msg_type":"kernel_info_request"}}"#.into()),
        WsMessage::Text(
            r#"{"channel":"iopub","header":{"msg_type":"stream"},"content":{}}"#.into(),
        ),
        WsMessage::Binary(vec![0xff; 64].into()),
        WsMessage::Binary(vec![0, 0, 0, 2, 0, 0, 0, 12, 0, 0, 0, 200].into()),
    ] {
        c.send_raw(junk).await?;
    }
    assert_eq!(
        c.execute("1 + 1").await?.result_text().as_deref(),
        Some("2")
    );

    // Past the size limit the socket is closed; the gateway and the kernel stay up.
    let huge = format!(
        r#"{{"channel":"shell","header":{{"msg_type":"execute_request"}},"content":{{"code":"'{}'"}}}}"#,
        "x".repeat(2 << 20)
    );
    // The gateway may close while the frame is still being written: the send can fail too.
    let sent = c.send_raw(WsMessage::Text(huge.into())).await;
    assert!(sent.is_err() || c.recv(Duration::from_secs(10)).await.is_err());
    let mut again = gw.channels(&id, "fuzzy").await?;
    assert_eq!(
        again.execute("2 + 2").await?.result_text().as_deref(),
        Some("4")
    );

    let (status, body) = gw
        .post_json(
            "/api/kernels",
            json!({"name": "python3", "env": {"KERNEL_BAD NAME": "1"}}),
        )
        .await?;
    assert_eq!(status, 400, "{body}");
    let r = gw
        .request(reqwest::Method::POST, "/api/kernels")
        .body("{oops")
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 400);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_kernels_are_culled_and_shutdown_removes_containers() -> Result<()> {
    let gw = Gateway::start(&["--cull-idle-timeout", "2"]).await?;
    let id = id_of(&gw.create_kernel().await?);
    let deadline = Instant::now() + Duration::from_secs(20);
    while gw.get_json(&format!("/api/kernels/{id}")).await?.0 == 200 {
        assert!(Instant::now() < deadline, "idle kernel was not culled");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let gw2 = Gateway::start(&[]).await?;
    let id2 = id_of(&gw2.create_kernel().await?);
    let dir = gw2.runtime_dir.clone();
    assert!(has_sandbox(&dir, &id2));
    let status = gw2.stop().await?;
    assert!(status.success(), "{status}");
    assert!(
        !has_sandbox(&dir, &id2),
        "the sandbox of kernel {id2} left behind after SIGTERM"
    );
    Ok(())
}

/// Whether the gateway on `runtime_dir` has a sandbox (a container, or one of the gVisor
/// engine's) for kernel `id`.
fn has_sandbox(runtime_dir: &std::path::Path, id: &str) -> bool {
    kernelgate_tests::sandbox::sandbox_of(runtime_dir, id).is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_image_fails_with_a_fix() -> Result<()> {
    let out = tokio::process::Command::new(kernelgate_tests::binary())
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{}", kernelgate_tests::free_port()?),
        ])
        .args(["--image", "kernelgate-kernel:no-such-tag", "--token", "t"])
        .output()
        .await?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("make image"), "{err}");

    let out = tokio::process::Command::new(kernelgate_tests::binary())
        .args(["serve", "--listen", "0.0.0.0:0", "--no-auth"])
        .output()
        .await?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("refused"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_gateway_readopts_its_kernels() -> Result<()> {
    let dir = format!("/run/kg-readopt-{}", std::process::id());
    let gw = Gateway::start(&["--runtime-dir", &dir]).await?;
    let id = id_of(&gw.create_kernel().await?);
    let mut c = gw.channels(&id, "before").await?;
    c.execute("x = 41").await?;
    let crashed = gw.crash().await?;

    let gw = crashed.restart(&[]).await?;
    let (status, model) = gw.get_json(&format!("/api/kernels/{id}")).await?;
    assert_eq!(status, 200, "{model}");
    let mut c = gw.channels(&id, "after").await?;
    assert_eq!(
        c.execute("x + 1").await?.result_text().as_deref(),
        Some("42")
    );
    let dir = gw.runtime_dir.clone();
    assert_eq!(gw.stop().await?.code(), Some(0));
    assert!(!has_sandbox(&dir, &id));
    Ok(())
}

/// Every flag is checked and the address bound before any container starts: a gateway
/// whose port is taken stops with the reason and leaves no warm kernel behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_port_stops_the_gateway_before_any_container_starts() -> Result<()> {
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let listen = taken.local_addr()?.to_string();
    let dir = format!("/run/kg-taken-{}", std::process::id());
    let out = tokio::process::Command::new(kernelgate_tests::binary())
        .args(["serve", "--listen", &listen, "--token", "t"])
        .args(["--image", &kernelgate_tests::image()])
        .args(["--runtime", &kernelgate_tests::runtime()])
        .args(kernelgate_tests::engine::engine_flags(&[])?)
        .args([
            "--runtime-dir",
            &dir,
            "--pool-size",
            "2",
            "--audit-log",
            "off",
        ])
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot listen on {listen}")),
        "{stderr}"
    );
    // Give a pool filler, had one started, the time to create its containers.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let left = kernelgate_tests::sandbox::sandboxes(std::path::Path::new(&dir), None, false);
    kernelgate_tests::remove_leftovers(std::path::Path::new(&dir));
    assert_eq!(
        left?,
        Vec::<String>::new(),
        "sandboxes started before the bind failed"
    );
    Ok(())
}
