//! End to end: the audit trail. 200 executions across 4 kernels, some failing, then the
//! gateway is killed with SIGKILL: every execution a client got a reply for is in the log,
//! requested and finished, with the right fields; `kernelgate audit` reads it back.

use anyhow::{Context, Result};
use kernelgate_tests::{binary, Gateway};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::HashMap;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replied_execution_survives_a_kill_9() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let mut kernels = Vec::new();
    for _ in 0..4 {
        kernels.push(
            gw.create_kernel().await?["id"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
    }
    // 50 executions per kernel, the kernels side by side; every tenth one fails.
    let runs = kernels.iter().map(|id| {
        let gw = &gw;
        async move {
            let mut seen = Vec::new();
            for i in 0..50 {
                let code = if i % 10 == 9 {
                    format!("1 / 0  # {id} {i}")
                } else {
                    format!("print({i} * 2)  # {id}")
                };
                let (status, r) = gw
                    .post_json(
                        &format!("/api/kernels/{id}/execute"),
                        json!({"code": code, "agent_id": "agent-7"}),
                    )
                    .await?;
                anyhow::ensure!(status == 200, "{r}");
                seen.push((id.clone(), code, r));
            }
            Ok::<_, anyhow::Error>(seen)
        }
    });
    let mut replied = Vec::new();
    for r in futures::future::join_all(runs).await {
        replied.extend(r?);
    }
    assert_eq!(replied.len(), 200);
    let path = gw.audit_log.clone();
    // What the killed gateway left (its kernels among it) goes when the guard does.
    let _crashed = gw.crash().await?;

    let records = kernelgate_tests::audit_values(&path)?;
    let mut requested: HashMap<String, &Value> = HashMap::new();
    let mut finished: HashMap<String, &Value> = HashMap::new();
    // Output that came after the reply is in a record of its own, written at idle.
    let mut late: HashMap<String, &Value> = HashMap::new();
    for r in &records {
        let id = r["msg_id"].as_str().unwrap_or_default().to_owned();
        match r["event"].as_str() {
            Some("execution_requested") => {
                requested.insert(id, r);
            }
            Some("execution_finished") => {
                finished.insert(id, r);
            }
            Some("execution_output") => {
                late.insert(id, r);
            }
            _ => {}
        }
    }
    for (kernel, code, reply) in &replied {
        let sha = hex::encode(Sha256::digest(code.as_bytes()));
        let req = requested
            .values()
            .find(|r| r["code"] == code.as_str())
            .with_context(|| format!("no requested record for {code}"))?;
        assert_eq!(req["code_sha256"], sha.as_str());
        assert_eq!(req["kernel"], kernel.as_str());
        assert_eq!(req["key"], "admin");
        assert_eq!(req["agent_id"], "agent-7");
        let msg_id = req["msg_id"].as_str().unwrap_or_default();
        let fin = finished
            .get(msg_id)
            .with_context(|| format!("no finished record for {code}"))?;
        assert_eq!(fin["code_sha256"], sha.as_str());
        assert_eq!(fin["kernel"], kernel.as_str());
        assert_eq!(fin["status"], reply["status"], "{fin} vs {reply}");
        if reply["status"] == "error" {
            assert_eq!(fin["ename"], "ZeroDivisionError");
        } else {
            let out = reply["stdout"].as_str().unwrap_or_default();
            let total = late.get(msg_id).copied().unwrap_or(fin);
            assert_eq!(total["output"], out, "the output's first characters");
            assert_eq!(total["output_bytes"], out.len());
        }
        assert!(fin["duration_ms"].is_u64());
        assert!(fin["time"].as_str().is_some_and(|t| t.ends_with('Z')));
    }
    let created = records
        .iter()
        .filter(|r| r["event"] == "kernel_created")
        .count();
    assert_eq!(created, 4);

    // Read back: a table, and JSON lines filtered by kernel.
    let table = std::process::Command::new(binary())
        .args(["audit", "--file"])
        .arg(&path)
        .output()?;
    assert!(table.status.success());
    let table = String::from_utf8(table.stdout)?;
    assert!(table.starts_with("TIME"), "{table:.300}");
    assert!(table.contains("execution_finished") && table.contains("ZeroDivisionError"));
    let one = std::process::Command::new(binary())
        .args([
            "audit",
            "--json",
            "--kernel",
            &kernels[0],
            "--key",
            "admin",
            "--file",
        ])
        .arg(&path)
        .output()?;
    let lines: Vec<Value> = String::from_utf8(one.stdout)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert!(lines.iter().all(|l| l["kernel"] == kernels[0].as_str()));
    assert_eq!(
        lines
            .iter()
            .filter(|l| l["event"] == "execution_finished")
            .count(),
        50
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&path)?.permissions().mode() & 0o777,
        0o600
    );
    let _ = std::fs::remove_file(&path);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_and_refused_logins_are_audited() -> Result<()> {
    let gw = Gateway::start(&["--audit-fsync"]).await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let put = gw
        .request(
            reqwest::Method::PUT,
            &format!("/api/kernels/{id}/files/data.csv"),
        )
        .body("a,b\n1,2\n")
        .send()
        .await?;
    assert_eq!(put.status().as_u16(), 201);
    let get = gw
        .request(
            reqwest::Method::GET,
            &format!("/api/kernels/{id}/files/data.csv"),
        )
        .send()
        .await?;
    assert_eq!(get.status().as_u16(), 200);
    let refused = reqwest::Client::new()
        .get(gw.url("/api/kernels"))
        .header("Authorization", "token wrong")
        .send()
        .await?;
    assert_eq!(refused.status().as_u16(), 403);
    assert_eq!(gw.delete_kernel(&id).await?, 204);
    let records = kernelgate_tests::audit_values(&gw.audit_log)?;
    let events: Vec<&str> = records.iter().filter_map(|r| r["event"].as_str()).collect();
    for e in [
        "kernel_created",
        "file_written",
        "file_read",
        "auth_refused",
        "kernel_deleted",
    ] {
        assert!(events.contains(&e), "{e} in {events:?}");
    }
    let written = records
        .iter()
        .find(|r| r["event"] == "file_written")
        .context("file_written")?;
    assert_eq!(written["path"], "data.csv");
    assert_eq!(written["bytes"], 8);
    assert_eq!(written["key"], "admin");
    Ok(())
}
