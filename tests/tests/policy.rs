//! End to end: the execution policy (`--policy`). Denied code never reaches the kernel and
//! fails like a cell (WebSocket and agent API), through aliases, `__import__`, importlib,
//! shell escapes and user expressions; `ask` holds code (and what comes after it, in
//! order) until an admin approves or denies it through the approvals API, the timeout
//! denies it, or an interrupt cancels it; debug requests are refused; every decision is in
//! the audit trail.

use anyhow::{bail, Context, Result};
use kernelgate_tests::{binary, Gateway};
use reqwest::Method;
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// The tests' policy: subprocesses denied, sockets asked for.
const POLICY: &str = include_str!("../fixtures/policy.toml");

fn write_policy(dir: &Path, text: &str) -> Result<String> {
    let path = dir.join("policy.toml");
    std::fs::write(&path, text)?;
    Ok(path.display().to_string())
}

/// A non-admin key added with `kernelgate keys add`; its token.
fn add_key(file: &Path, name: &str) -> Result<String> {
    let out = std::process::Command::new(binary())
        .args(["keys", "add", name, "--file"])
        .arg(file)
        .output()?;
    if !out.status.success() {
        bail!("keys add: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// Polls the approvals list (admin) until `n` executions wait; returns them.
async fn pending(gw: &Gateway, n: usize) -> Result<Vec<Value>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, list) = gw.get_json("/api/kernelgate/approvals").await?;
        assert_eq!(status, 200, "{list}");
        let list = list.as_array().cloned().unwrap_or_default();
        if list.len() == n {
            return Ok(list);
        }
        if Instant::now() > deadline {
            bail!("expected {n} approvals, have {list:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn answer(gw: &Gateway, id: &str, approve: bool) -> Result<u16> {
    let r = gw
        .request(Method::POST, &format!("/api/kernelgate/approvals/{id}"))
        .json(&json!({ "approve": approve }))
        .send()
        .await?;
    Ok(r.status().as_u16())
}

fn audit_records(gw: &Gateway) -> Result<Vec<Value>> {
    kernelgate_tests::audit_values(&gw.audit_log)
}

fn evalue(o: &kernelgate_tests::Outcome) -> String {
    o.error
        .as_ref()
        .and_then(|e| e["evalue"].as_str())
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_code_never_reaches_the_kernel() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let policy = write_policy(dir.path(), POLICY)?;
    let gw = Gateway::start(&["--policy", &policy]).await?;
    let (_, api) = gw.get_json("/api").await?;
    assert_eq!(api["kernelgate"]["policy"], true);
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let mut ws = gw.channels(&id, "policy-deny").await?;
    assert_eq!(ws.execute("x = 1").await?.status, "ok");

    // Each form is caught; the assignment after the forbidden part never happens.
    let forms = [
        "import subprocess\nx = 2",
        "import subprocess.run as r\nx = 2",
        "from subprocess import Popen\nx = 2",
        "import os as o\no.system('true')\nx = 2",
        "from os import system as s\ns('true')\nx = 2",
        "sp = __import__('subprocess')\nx = 2",
        "import importlib as il\nil.import_module('subprocess')\nx = 2",
        "def f():\n    import os\n    return os.popen('id')\nx = 2",
        "!ls /\nx = 2",
        "files = !ls\nx = 2",
        "%%bash\nls /",
        "%system ls",
    ];
    for code in forms {
        let o = ws.execute(code).await?;
        assert_eq!(o.status, "error", "{code:?} was not denied: {o:?}");
        assert_eq!(o.ename().as_deref(), Some("PolicyViolation"), "{code:?}");
        assert!(
            evalue(&o).contains("no subprocesses in analyses"),
            "{code:?}: {}",
            evalue(&o)
        );
        // It never ran: no execution count (the cell shows `[ ]`, not a stale number).
        assert_eq!(o.execution_count, None, "{code:?}");
        // Looks like a failed cell: busy, the error, the reply, idle.
        assert_eq!(
            o.msg_types,
            ["status", "error", "execute_reply", "status"],
            "{code:?}"
        );
    }
    let o = ws.execute("print(x)").await?;
    assert_eq!(o.stdout, "1\n", "denied code ran after all");

    // Mentions that are not imports or calls pass; so does code that does not parse
    // (the kernel reports the syntax error itself).
    let o = ws
        .execute("s = 'import subprocess'  # os.system('x')\nprint(len(s))")
        .await?;
    assert_eq!(o.stdout, "17\n", "{o:?}");
    let o = ws.execute("def (:").await?;
    assert_eq!(o.ename().as_deref(), Some("SyntaxError"), "{o:?}");

    // User expressions run code too.
    let msg = ws
        .send(
            "shell",
            "execute_request",
            json!({"code": "1", "silent": false, "user_expressions": {"a": "__import__('subprocess').run('id')"}, "allow_stdin": false}),
        )
        .await?;
    let o = ws.collect(&msg, Duration::from_secs(30)).await?;
    assert_eq!(o.ename().as_deref(), Some("PolicyViolation"), "{o:?}");

    // Debugging would evaluate code the policy cannot see: refused.
    let dbg = ws
        .send(
            "control",
            "debug_request",
            json!({"seq": 1, "type": "request", "command": "evaluate", "arguments": {"expression": "__import__('subprocess')"}}),
        )
        .await?;
    let reply = ws
        .wait_for(Duration::from_secs(30), |m| {
            m["parent_header"]["msg_id"] == dbg.as_str() && m["msg_type"] == "debug_reply"
        })
        .await?;
    assert_eq!(reply["content"]["success"], false, "{reply}");
    assert!(reply["content"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("--policy")));

    // The agent API shows a denial as a failed run.
    let r = gw.execute(&id, "import os\nos.system('id')").await?;
    assert_eq!(r["status"], "error", "{r}");
    assert_eq!(r["error"]["ename"], "PolicyViolation");
    assert_eq!(r["stdout"], "");
    assert_eq!(r["execution_count"], Value::Null, "{r}");

    let records = audit_records(&gw)?;
    let denials: Vec<&Value> = records
        .iter()
        .filter(|r| r["event"] == "policy_decision" && r["decision"] == "deny")
        .collect();
    // Twelve forms, the user expression, the debug request and the agent API run.
    assert_eq!(denials.len(), forms.len() + 3, "{denials:#?}");
    let first = denials[0];
    assert_eq!(first["rule"], 1);
    assert_eq!(first["matched"], "import subprocess");
    assert_eq!(first["key"], "admin");
    assert_eq!(first["kernel"], id.as_str());
    // A denied execution still has its requested and finished records.
    let msg_id = first["msg_id"].as_str().unwrap_or_default();
    let finished = records
        .iter()
        .find(|r| r["event"] == "execution_finished" && r["msg_id"] == msg_id)
        .context("finished record of a denied execution")?;
    assert_eq!(finished["ename"], "PolicyViolation");
    assert_eq!(finished["ran"], false);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parse_errors_can_be_denied() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let policy = write_policy(
        dir.path(),
        "on_parse_error = \"deny\"\n[[rule]]\naction = \"deny\"\nreason = \"r\"\nimports = [\"subprocess\"]\n",
    )?;
    let gw = Gateway::start(&["--policy", &policy]).await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let r = gw.execute(&id, "def (:").await?;
    assert_eq!(r["error"]["ename"], "PolicyViolation", "{r}");
    assert_eq!(gw.execute(&id, "print(6 * 7)").await?["stdout"], "42\n");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_policy_file_stops_the_gateway_with_the_reason() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let policy = write_policy(
        dir.path(),
        "[[rule]]\naction = \"deny\"\nreason = \"r\"\nimport = [\"subprocess\"]\n",
    )?;
    let out = tokio::process::Command::new(binary())
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--policy",
            &policy,
            "--audit-log",
            "off",
        ])
        .output()
        .await?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("policy file") && err.contains("import"),
        "{err}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ask_holds_code_until_an_admin_answers() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let policy = write_policy(dir.path(), POLICY)?;
    let keys = dir.path().join("keys.toml");
    let alice = add_key(&keys, "alice")?;
    let gw = Gateway::start(&[
        "--policy",
        &policy,
        "--keys",
        &keys.display().to_string(),
        "--approval-timeout",
        "4",
    ])
    .await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let mut ws = gw.channels(&id, "policy-ask").await?;

    // Held, and what comes after it waits behind it.
    let held = ws.start_execute("import socket\ny = 5").await?;
    let after = ws.start_execute("z = y + 2").await?;
    let notice = ws
        .wait_for(Duration::from_secs(30), |m| {
            m["parent_header"]["msg_id"] == held.as_str() && m["msg_type"] == "stream"
        })
        .await?;
    let text = notice["content"]["text"].as_str().unwrap_or_default();
    assert!(
        text.contains("waits for an administrator's approval"),
        "{text}"
    );
    assert!(
        text.contains("network access needs a person's OK"),
        "{text}"
    );

    let list = pending(&gw, 1).await?;
    let a = &list[0];
    assert_eq!(a["kernel_id"], id.as_str());
    assert_eq!(a["key"], "admin");
    assert_eq!(a["code"], "import socket\ny = 5");
    assert_eq!(a["reason"], "network access needs a person's OK");
    assert!(a["requested_at"].as_str().is_some_and(|t| t.ends_with('Z')));
    let approval = a["id"].as_str().unwrap_or_default().to_owned();
    assert!(text.contains(&approval));

    // Only admins see or answer approvals.
    let (status, _) = gw
        .call_as(&alice, Method::GET, "/api/kernelgate/approvals", None)
        .await?;
    assert_eq!(status, 403);
    let (status, _) = gw
        .call_as(
            &alice,
            Method::POST,
            &format!("/api/kernelgate/approvals/{approval}"),
            Some(json!({"approve": true})),
        )
        .await?;
    assert_eq!(status, 403);
    // Nothing ran yet: no reply for either.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !ws.seen.iter().any(|m| m["msg_type"] == "execute_reply"),
        "{:?}",
        ws.seen
    );

    assert_eq!(answer(&gw, &approval, true).await?, 204);
    let first = ws.collect(&held, Duration::from_secs(30)).await?;
    assert_eq!(first.status, "ok", "{first:?}");
    let second = ws.collect(&after, Duration::from_secs(30)).await?;
    assert_eq!(second.status, "ok", "{second:?}");
    assert_eq!(ws.execute("print(y, z)").await?.stdout, "5 7\n");
    assert_eq!(answer(&gw, &approval, true).await?, 404, "answered twice");
    assert_eq!(answer(&gw, "no-such-approval", false).await?, 404);

    // Denied by the admin: an error, and the code never ran.
    let held = ws.start_execute("import socket\nw = 1").await?;
    let a = pending(&gw, 1).await?;
    assert_eq!(
        answer(&gw, a[0]["id"].as_str().unwrap_or_default(), false).await?,
        204
    );
    let o = ws.collect(&held, Duration::from_secs(30)).await?;
    assert_eq!(o.ename().as_deref(), Some("PolicyViolation"), "{o:?}");
    assert!(evalue(&o).contains("denied"), "{}", evalue(&o));
    let o = ws.execute("print('w' in dir())").await?;
    assert_eq!(o.stdout, "False\n");

    // Nobody answers: denied at the timeout.
    let started = Instant::now();
    let held = ws.start_execute("import socket").await?;
    let o = ws.collect(&held, Duration::from_secs(30)).await?;
    assert_eq!(o.ename().as_deref(), Some("PolicyViolation"), "{o:?}");
    assert!(evalue(&o).contains("nobody approved"), "{}", evalue(&o));
    assert!(started.elapsed() >= Duration::from_secs(4));
    assert!(pending(&gw, 0).await?.is_empty());

    // An interrupt cancels a waiting execution.
    let held = ws.start_execute("import socket\nv = 1").await?;
    pending(&gw, 1).await?;
    let (status, _) = gw
        .post_json(&format!("/api/kernels/{id}/interrupt"), json!({}))
        .await?;
    assert_eq!(status, 204);
    let o = ws.collect(&held, Duration::from_secs(30)).await?;
    assert_eq!(o.ename().as_deref(), Some("KeyboardInterrupt"), "{o:?}");
    assert!(pending(&gw, 0).await?.is_empty());

    // The agent API: approved while the call waits; and a wait longer than the call's
    // timeout ends it with status timeout.
    let agent = {
        let (base, token, id) = (gw.base.clone(), gw.token.clone(), id.clone());
        tokio::spawn(async move {
            let r = reqwest::Client::new()
                .post(format!("{base}/api/kernels/{id}/execute"))
                .header("Authorization", format!("token {token}"))
                .json(&json!({"code": "import socket\nprint('approved run')"}))
                .send()
                .await?;
            r.json::<Value>().await.map_err(anyhow::Error::from)
        })
    };
    let a = pending(&gw, 1).await?;
    assert_eq!(
        answer(&gw, a[0]["id"].as_str().unwrap_or_default(), true).await?,
        204
    );
    let r = agent.await??;
    assert_eq!(r["status"], "ok", "{r}");
    assert!(
        r["stdout"]
            .as_str()
            .is_some_and(|s| s.ends_with("approved run\n")),
        "{r}"
    );

    let started = Instant::now();
    let (status, r) = gw
        .post_json(
            &format!("/api/kernels/{id}/execute"),
            json!({"code": "import socket", "timeout": 1}),
        )
        .await?;
    assert_eq!(status, 200);
    assert_eq!(r["status"], "timeout", "{r}");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the wait counts against the call's timeout"
    );
    assert!(pending(&gw, 0).await?.is_empty());

    let records = audit_records(&gw)?;
    let decisions: Vec<&str> = records
        .iter()
        .filter(|r| r["event"] == "policy_decision")
        .filter_map(|r| r["decision"].as_str())
        .collect();
    for d in ["ask", "approved", "denied", "timed_out", "cancelled"] {
        assert!(decisions.contains(&d), "no {d} in {decisions:?}");
    }
    let approved = records
        .iter()
        .find(|r| r["event"] == "policy_decision" && r["decision"] == "approved")
        .context("approved record")?;
    assert_eq!(approved["by"], "admin");
    assert_eq!(approved["approval_id"], approval.as_str());
    Ok(())
}
