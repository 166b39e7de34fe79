//! End to end: kernels that die recover, and say why. Memory deaths in a row, through a
//! warm kernel and in place, are named out of memory with the limit at once (well before
//! the heartbeat would notice, under gVisor too); a fork loop meets the process limit and
//! the kernel lives on; a run whose kernel is deleted says who deleted it; a kernel re-adopted
//! after a `kill -9` of the gateway has its deaths named as quickly, through the agent API and
//! MCP, and audited. A cell that runs out of memory fails
//! naming the memory limit (agent API and WebSocket); a kernel that dies again while it
//! restarts is tried again, and one that cannot be restarted fails within seconds saying
//! what brings it back; a create whose kernel dies while it starts fails at once; a restart with a warm kernel ready moves the kernel into it (same
//! id, same WebSocket, fresh state); after a `kill -9` of the gateway its warm kernel goes
//! back into the pool, or is removed, and is never listed. An E2B sandbox, its access token
//! and its record outlive a `kill -9` of the gateway too.

use anyhow::{bail, Context, Result};
use kernelgate_tests::{sandbox, Gateway};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Memory limit of the kernels here, and a cell that needs twice as much.
const MEMORY_MB: u64 = 256;
const OOM_CELL: &str = "import time\nblob = bytearray(512 << 20)\ntime.sleep(30)";

fn id_of(model: &Value) -> String {
    model["id"].as_str().unwrap_or_default().to_owned()
}

/// Ids of the running sandboxes (containers, or the gVisor engine's) of a gateway's
/// runtime directory, with `label` too.
fn containers(gw_dir: &std::path::Path, label: Option<&str>) -> Result<Vec<String>> {
    sandbox::sandboxes(gw_dir, label, true)
}

/// The id of the sandbox that runs kernel `kernel_id` now.
fn container_of(gw: &Gateway, kernel_id: &str) -> Result<String> {
    Ok(gw.sandbox(kernel_id)?.id)
}

async fn state_of(gw: &Gateway, id: &str) -> Result<String> {
    let (_, model) = gw.get_json(&format!("/api/kernels/{id}")).await?;
    Ok(model["execution_state"]
        .as_str()
        .unwrap_or_default()
        .to_owned())
}

/// Polls the kernel's model until its state is `state` (within `within`).
async fn until_state(gw: &Gateway, id: &str, state: &str, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let now = state_of(gw, id).await?;
        if now == state {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("kernel {id} is {now}, not {state}, after {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn assert_names_the_limit(error: &Value) {
    let evalue = error["evalue"].as_str().unwrap_or_default();
    assert_eq!(error["ename"], "KernelDied", "{error}");
    assert!(
        evalue.contains(&format!("ran out of memory (limit {MEMORY_MB} MiB)"))
            && evalue.contains("its variables are lost"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_out_of_memory_kernel_says_so_and_survives_a_second_death_while_it_restarts(
) -> Result<()> {
    let memory = MEMORY_MB.to_string();
    let gw = Gateway::start(&["--kernel-memory-mb", &memory]).await?;
    let id = id_of(&gw.create_kernel().await?);

    // Over the WebSocket: the cell fails with an error naming the limit.
    let mut c = gw.channels(&id, "notebook").await?;
    c.execute("x = 41").await?;
    let r = c.execute(OOM_CELL).await?;
    assert_eq!(r.status, "error", "{r:?}");
    let error = r.error.clone().context("an error output")?;
    assert_names_the_limit(&error);
    assert!(
        error["evalue"]
            .as_str()
            .is_some_and(|e| e.contains("while running this code")),
        "{error}"
    );
    until_state(&gw, &id, "idle", Duration::from_secs(60)).await?;
    let r = c.execute("x").await?;
    assert_eq!(r.ename().as_deref(), Some("NameError"), "state is gone");

    // Through the agent API, as an agent retrying at once: the retry reaches the kernel
    // while it restarts and kills it again.
    let started = Instant::now();
    let first = gw.execute(&id, OOM_CELL).await?;
    let retry = gw.execute(&id, OOM_CELL).await?;
    let took = started.elapsed();
    for answer in [&first, &retry] {
        assert_eq!(answer["status"], "error", "{answer}");
        assert_names_the_limit(&answer["error"]);
    }
    let back = gw.execute(&id, "21 * 2").await?;
    assert_eq!(back["status"], "ok", "{back}");
    assert_eq!(back["results"][0]["data"]["text/plain"], "42");
    assert!(
        took < Duration::from_secs(25),
        "both answers well under the 30 s startup timeout: {took:?}"
    );
    let tried = gw
        .logs
        .lock()
        .map(|l| l.iter().any(|l| l.contains("a restart try failed")))
        .unwrap_or(false);
    assert!(tried, "the retry killed the kernel while it restarted");

    // The audit trail says which executions killed their kernel, and why.
    let died: Vec<Value> = gw
        .audited("execution_finished")?
        .into_iter()
        .filter(|r| r["ename"] == "KernelDied")
        .collect();
    assert_eq!(died.len(), 3, "{died:?}");
    for r in &died {
        assert!(
            r["reason"]
                .as_str()
                .is_some_and(|w| w.contains("ran out of memory")),
            "{r}"
        );
        assert_eq!(r["kernel"], id.as_str());
    }
    let deaths = gw.audited("kernel_died")?;
    assert!(
        deaths.iter().all(|r| r["why"]
            .as_str()
            .is_some_and(|w| w.contains(&format!("limit {MEMORY_MB} MiB")))),
        "{deaths:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_that_cannot_be_restarted_fails_fast_and_says_what_to_do() -> Result<()> {
    let memory = MEMORY_MB.to_string();
    let gw = Gateway::start(&["--kernel-memory-mb", &memory]).await?;
    let id = id_of(&gw.create_kernel().await?);
    let first = gw.execute(&id, OOM_CELL).await?;
    assert_names_the_limit(&first["error"]);

    // Every process the restart starts is killed before it answers.
    let started = Instant::now();
    let stop = tokio_util::sync::CancellationToken::new();
    let killer = {
        let (stop, dir, id) = (stop.clone(), gw.runtime_dir.clone(), id.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let (dir, id) = (dir.clone(), id.clone());
                let _ = tokio::task::spawn_blocking(move || {
                    let sandbox = sandbox::sandbox_of(&dir, &id)?;
                    sandbox::kill(&dir, &sandbox.id)
                })
                .await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let dead = until_state(&gw, &id, "dead", Duration::from_secs(25)).await;
    stop.cancel();
    killer.await?;
    dead?;
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "given up well under the 30 s startup timeout: {took:?}"
    );

    // Later calls fail at once and say what brings the kernel back.
    let t0 = Instant::now();
    let later = gw.execute(&id, "1 + 1").await?;
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert_eq!(later["status"], "error", "{later}");
    assert_eq!(later["error"]["ename"], "KernelUnavailable", "{later}");
    let evalue = later["error"]["evalue"].as_str().unwrap_or_default();
    assert!(
        evalue.contains("could not be restarted")
            && evalue.contains(&format!("POST /api/kernels/{id}/restart"))
            && evalue.contains("delete it"),
        "{evalue}"
    );
    let failed = gw.audited("kernel_restart_failed")?;
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0]["kernel"], id.as_str());
    assert_eq!(failed[0]["tries"], 3);

    // And it does.
    let (status, model) = gw
        .post_json(&format!("/api/kernels/{id}/restart"), json!({}))
        .await?;
    assert_eq!(status, 200, "{model}");
    let back = gw.execute(&id, "1 + 1").await?;
    assert_eq!(back["results"][0]["data"]["text/plain"], "2", "{back}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_a_warm_kernel_ready_moves_the_kernel_into_it() -> Result<()> {
    let gw = Gateway::start(&["--pool-size", "1"]).await?;
    gw.wait_pool("filled").await?;
    let id = id_of(&gw.create_kernel().await?);
    gw.wait_pool("filled").await?;
    let before = container_of(&gw, &id)?;
    let warm: Vec<String> = containers(&gw.runtime_dir, None)?
        .into_iter()
        .filter(|c| *c != before)
        .collect();
    assert_eq!(
        warm.len(),
        1,
        "one warm kernel besides the kernel: {warm:?}"
    );

    let mut c = gw.channels(&id, "notebook").await?;
    c.execute("x = 41\nopen('notes.txt', 'w').write('kept?')")
        .await?;
    let t0 = Instant::now();
    let (status, model) = gw
        .post_json(&format!("/api/kernels/{id}/restart"), json!({}))
        .await?;
    let took = t0.elapsed();
    assert_eq!(status, 200, "{model}");
    assert_eq!(model["id"], id.as_str());
    eprintln!("restart with a warm kernel ready: {took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");

    // The same WebSocket, a fresh interpreter and working directory.
    let r = c.execute("x").await?;
    assert_eq!(r.ename().as_deref(), Some("NameError"), "{r:?}");
    let r = c.execute("import os\nos.path.exists('notes.txt')").await?;
    assert_eq!(r.result_text().as_deref(), Some("False"));

    // Served by the warm sandbox, which now carries the kernel's name (Docker renames the
    // container once the old one is gone; the gVisor engine records the move at once and
    // removes the old sandbox after); the old one goes and the pool fills again.
    let deadline = Instant::now() + Duration::from_secs(20);
    while container_of(&gw, &id).ok().as_deref() != Some(warm[0].as_str())
        || containers(&gw.runtime_dir, None)?.contains(&before)
    {
        anyhow::ensure!(
            Instant::now() < deadline,
            "kernel {id} is not in the warm sandbox alone: {:?}",
            containers(&gw.runtime_dir, None)?
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    gw.wait_pool("filled").await?;
    assert_eq!(containers(&gw.runtime_dir, None)?.len(), 2);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_kill_9_the_warm_kernel_is_pooled_again_or_removed_never_listed() -> Result<()> {
    let dir = format!("/run/kg-warm-crash-{}", std::process::id());
    let gw = Gateway::start(&["--runtime-dir", &dir, "--pool-size", "1"]).await?;
    gw.wait_pool("filled").await?;
    let runtime_dir = gw.runtime_dir.clone();
    let warm = containers(&runtime_dir, Some("org.kernelgate.pool=true"))?;
    assert_eq!(warm.len(), 1);
    let crashed = gw.crash().await?;

    // Same directory, same pool: the warm kernel is back in the pool, not a listed kernel,
    // and not counted against --max-kernels.
    let gw = crashed
        .restart(&["--pool-size", "1", "--max-kernels", "1"])
        .await?;
    let (_, listed) = gw.get_json("/api/kernels").await?;
    assert_eq!(listed, json!([]));
    let ready = gw.wait_pool("filled").await?;
    assert_eq!(ready["pool"]["ready"], 1, "{ready}");
    assert_eq!(
        containers(&runtime_dir, None)?,
        warm,
        "reused, not replaced"
    );
    let id = id_of(&gw.create_kernel().await?);
    assert_eq!(container_of(&gw, &id)?, warm[0], "the create took it");
    let (status, body) = gw.post_json("/api/kernels", json!({})).await?;
    assert_eq!(status, 403, "{body}");
    gw.wait_pool("filled").await?;
    let crashed = gw.crash().await?;

    // Without a pool: the kernel handed out is adopted, the new warm kernel removed.
    let gw = crashed.restart(&["--pool-size", "0"]).await?;
    let (_, listed) = gw.get_json("/api/kernels").await?;
    let ids: Vec<String> = listed.as_array().into_iter().flatten().map(id_of).collect();
    assert_eq!(ids, vec![id]);
    assert_eq!(containers(&runtime_dir, None)?, warm);
    assert_eq!(
        containers(&runtime_dir, Some("org.kernelgate.pool=true"))?,
        warm,
        "the only container left is the kernel handed out"
    );
    assert_eq!(gw.stop().await?.code(), Some(0));
    assert_eq!(containers(&runtime_dir, None)?, Vec::<String>::new());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_that_dies_while_it_starts_fails_its_create_at_once() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    // Every container of this gateway is killed as soon as it shows up.
    let stop = tokio_util::sync::CancellationToken::new();
    let killer = {
        let (stop, dir) = (stop.clone(), gw.runtime_dir.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                for id in containers(&dir, None).unwrap_or_default() {
                    let _ = sandbox::kill(&dir, &id);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let started = Instant::now();
    let answer = gw.post_json("/api/kernels", json!({})).await;
    let took = started.elapsed();
    stop.cancel();
    killer.await?;
    let (status, body) = answer?;
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        body["message"],
        "the kernel was killed by signal 9 (SIGKILL) while it started"
    );
    assert!(
        took < Duration::from_secs(10),
        "not the 30 s startup timeout: {took:?}"
    );
    let (_, listed) = gw.get_json("/api/kernels").await?;
    assert_eq!(listed, json!([]));
    assert_eq!(containers(&gw.runtime_dir, None)?, Vec::<String>::new());
    Ok(())
}

/// The memory hogs the deaths below take turns with: a growth loop, one large allocation,
/// a large array.
const HOGS: [&str; 3] = [
    "import numpy as np\nchunks = []\nwhile True:\n    chunks.append(np.ones(25_000_000))",
    "blob = bytearray(2 * 1024**3)",
    "import numpy as np\na = np.ones(200_000_000)",
];

/// The agent API's JSON answer for `code`, which must come within 10 s: a death the gateway
/// only noticed by the heartbeat (15 s and more) fails here.
async fn run_within_10s(gw: &Gateway, id: &str, code: &str) -> Result<Value> {
    run_within(gw, id, code, Duration::from_secs(10)).await
}

/// The agent API's JSON answer for `code`, which must come within `limit`.
async fn run_within(gw: &Gateway, id: &str, code: &str, limit: Duration) -> Result<Value> {
    let answer = gw
        .request(reqwest::Method::POST, &format!("/api/kernels/{id}/execute"))
        .json(&json!({"code": code, "timeout": 60}))
        .timeout(limit)
        .send()
        .await
        .with_context(|| format!("no answer to {code:?} within {} s", limit.as_secs()))?;
    anyhow::ensure!(
        answer.status() == 200,
        "execute answered {}",
        answer.status()
    );
    Ok(answer.json().await?)
}

fn assert_out_of_memory(answer: &Value, limit_mb: u64) {
    let evalue = answer["error"]["evalue"].as_str().unwrap_or_default();
    assert_eq!(answer["status"], "error", "{answer}");
    assert_eq!(answer["error"]["ename"], "KernelDied", "{answer}");
    assert!(
        evalue.contains(&format!(
            "the kernel ran out of memory (limit {limit_mb} MiB)"
        )),
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deaths_in_a_row_fork_loops_and_deletes_are_named_with_their_cause() -> Result<()> {
    const LIMIT_MB: u64 = 512;
    let gw = Gateway::start(&["--pool-size", "1", "--kernel-memory-mb", "512"]).await?;
    gw.wait_pool("filled").await?;
    let id = id_of(&gw.create_kernel().await?);

    // Three memory deaths in a row, each restart into the warm kernel the pool refilled.
    for hog in HOGS {
        gw.wait_pool("filled").await?;
        until_state(&gw, &id, "idle", Duration::from_secs(60)).await?;
        let answer = run_within_10s(&gw, &id, hog).await?;
        assert_out_of_memory(&answer, LIMIT_MB);
    }
    until_state(&gw, &id, "idle", Duration::from_secs(60)).await?;

    // A fork loop meets the process limit, not the memory limit; the kernel lives on with
    // its variables. (Under gVisor the limit is RLIMIT_NPROC, a quarter of the pids limit.)
    let fork_loop = "import os, resource\nx = 41\npids, stopped = [], None\n\
        try:\n    for _ in range(400):\n        pid = os.fork()\n        if pid == 0:\n            \
        os.execv('/bin/sleep', ['sleep', '60'])\n        pids.append(pid)\n\
        except OSError as e:\n    stopped = type(e).__name__\n\
        for p in pids:\n    os.kill(p, 9)\n    os.waitpid(p, 0)\n\
        print(stopped, len(pids), resource.getrlimit(resource.RLIMIT_NPROC)[0])";
    // No death to name here: forking a large process under gVisor on a busy machine may take
    // longer than a death's bound, so the cell gets the whole run's timeout.
    let forked = run_within(&gw, &id, fork_loop, Duration::from_secs(70)).await?;
    assert_eq!(forked["status"], "ok", "{forked}");
    let out = forked["stdout"].as_str().unwrap_or_default().to_owned();
    assert!(out.starts_with("BlockingIOError "), "{forked}");
    if kernelgate_tests::gvisor() {
        assert!(
            out.trim_end().ends_with(" 64"),
            "RLIMIT_NPROC 256 / 4: {out}"
        );
    }
    let after = run_within_10s(&gw, &id, "x + 1").await?;
    assert_eq!(after["results"][0]["data"]["text/plain"], "42", "{after}");

    // No warm kernel can take its place (an environment only a fresh process reads): its
    // restarts are in place, and each death is named as quickly, over the WebSocket too.
    let (status, model) = gw
        .post_json(
            "/api/kernels",
            json!({"name": "python3", "env": {"KERNEL_ROUND": "cold"}}),
        )
        .await?;
    assert_eq!(status, 201, "{model}");
    let cold = id_of(&model);
    let mut c = gw.channels(&cold, "notebook").await?;
    for hog in HOGS {
        until_state(&gw, &cold, "idle", Duration::from_secs(60)).await?;
        let r = tokio::time::timeout(Duration::from_secs(10), c.execute(hog))
            .await
            .context("the death named within 10 s")??;
        assert_eq!(r.status, "error", "{r:?}");
        let error = r.error.clone().context("an error output")?;
        assert_out_of_memory(&json!({"status": "error", "error": error}), LIMIT_MB);
    }
    let deaths = gw.audited("kernel_died")?;
    assert_eq!(deaths.len(), 6, "{deaths:?}");
    for d in &deaths {
        assert_eq!(
            d["why"],
            format!("the kernel ran out of memory (limit {LIMIT_MB} MiB)"),
            "{d}"
        );
    }

    // A kernel deleted under a run: the run ends with who deleted it, in JSON and NDJSON,
    // and the audit trail says so.
    for ndjson in [false, true] {
        let victim = id_of(&gw.create_kernel().await?);
        let mut call = gw
            .request(
                reqwest::Method::POST,
                &format!("/api/kernels/{victim}/execute"),
            )
            .json(&json!({"code": "import time\nprint('started', flush=True)\ntime.sleep(60)"}))
            .timeout(Duration::from_secs(30));
        if ndjson {
            call = call.header("Accept", "application/x-ndjson");
        }
        let pending = tokio::spawn(async move { call.send().await?.text().await });
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(gw.delete_kernel(&victim).await?, 204);
        let text = pending.await??;
        let deleted = "the kernel was deleted by the admin (the gateway's token)";
        if ndjson {
            let lines: Vec<Value> = text
                .lines()
                .map(serde_json::from_str)
                .collect::<Result<_, _>>()?;
            let error = lines
                .iter()
                .find(|l| l["type"] == "error")
                .context(text.clone())?;
            assert_eq!(error["ename"], "KernelDeleted", "{text}");
            assert!(
                error["evalue"]
                    .as_str()
                    .is_some_and(|e| e.contains(deleted)),
                "{text}"
            );
            let end = lines.last().context("an end line")?;
            assert_eq!(
                (&end["type"], &end["status"]),
                (&json!("end"), &json!("error"))
            );
        } else {
            let answer: Value = serde_json::from_str(&text)?;
            assert_eq!(answer["status"], "error", "{answer}");
            assert_eq!(answer["stdout"], "started\n", "{answer}");
            assert_eq!(answer["error"]["ename"], "KernelDeleted", "{answer}");
            assert!(
                answer["error"]["evalue"]
                    .as_str()
                    .is_some_and(|e| e.contains(deleted)),
                "{answer}"
            );
        }
        let finished = gw.audited("execution_finished")?;
        assert!(
            finished
                .iter()
                .any(|r| r["kernel"] == victim.as_str() && r["ename"] == "KernelDeleted"),
            "{finished:?}"
        );
    }
    Ok(())
}

/// A kernel re-adopted after a `kill -9` of the gateway is watched as closely as one it
/// started: its memory death is named at once with the limit, through the agent API and
/// through MCP, and audited with its cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deaths_after_re_adoption_and_through_mcp_are_named_with_their_cause() -> Result<()> {
    const LIMIT_MB: u64 = 512;
    let dir = format!("/run/kg-adopted-deaths-{}", std::process::id());
    let flags = ["--kernel-memory-mb", "512"];
    let gw = Gateway::start(&["--runtime-dir", &dir, flags[0], flags[1]]).await?;
    let id = id_of(&gw.create_kernel().await?);
    let set = run_within_10s(&gw, &id, "x = 41").await?;
    assert_eq!(set["status"], "ok", "{set}");
    let gw = gw.crash().await?.restart(&flags).await?;
    let adopted = run_within_10s(&gw, &id, "x + 1").await?;
    assert_eq!(
        adopted["results"][0]["data"]["text/plain"], "42",
        "{adopted}"
    );

    let answer = run_within_10s(&gw, &id, HOGS[1]).await?;
    assert_out_of_memory(&answer, LIMIT_MB);

    // The restarted kernel, through MCP (an agent's other door).
    until_state(&gw, &id, "idle", Duration::from_secs(60)).await?;
    let mut mcp = kernelgate_client::mcp::McpCalls::new(gw.client());
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        mcp.call_tool("run_python", json!({"code": HOGS[2], "kernel_id": id})),
    )
    .await
    .context("the death named through MCP within 10 s")??;
    let text: String = result["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["text"].as_str())
        .collect();
    assert_eq!(result["isError"], true, "{result}");
    assert!(
        text.contains("KernelDied")
            && text.contains(&format!(
                "the kernel ran out of memory (limit {LIMIT_MB} MiB)"
            )),
        "{result}"
    );

    let deaths = gw.audited("kernel_died")?;
    assert_eq!(deaths.len(), 2, "{deaths:?}");
    for d in &deaths {
        assert_eq!(d["kernel"], id.as_str(), "{d}");
        assert_eq!(
            d["why"],
            format!("the kernel ran out of memory (limit {LIMIT_MB} MiB)"),
            "{d}"
        );
    }
    gw.stop().await?;
    Ok(())
}

/// Runs `code` on an E2B sandbox through the sandbox plane (the code interpreter's
/// `/execute`, as E2B's SDK calls it with `E2B_SANDBOX_URL`): the status, and the NDJSON
/// lines of the run.
async fn e2b_run(gw: &Gateway, id: &str, token: &str, code: &str) -> Result<(u16, Vec<Value>)> {
    let r = reqwest::Client::new()
        .post(format!("{}/execute", gw.base.trim_end_matches('/')))
        .header("E2b-Sandbox-Id", id)
        .header("E2b-Sandbox-Port", "49999")
        .header("X-Access-Token", token)
        .json(&json!({"code": code}))
        .timeout(Duration::from_secs(60))
        .send()
        .await?;
    let status = r.status().as_u16();
    let text = r.text().await?;
    let lines = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    Ok((status, lines))
}

/// The `text` of a run's main result.
fn e2b_result(lines: &[Value]) -> Option<&str> {
    lines
        .iter()
        .find(|l| l["type"] == "result" && l["is_main_result"] == true)
        .and_then(|l| l["text"].as_str())
}

/// An E2B sandbox's access token is the same on the gateway that starts again after a
/// `kill -9` on the same runtime directory: the token its create answered still runs code
/// in the re-adopted sandbox (its variables there), the sandbox is still listed with its
/// metadata, a wrong token is still refused, and it still ends when its timeout passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_e2b_sandbox_and_its_access_token_outlive_a_gateway_killed_with_sigkill() -> Result<()> {
    let dir = format!("/run/kg-e2b-token-{}", std::process::id());
    let gw = Gateway::start(&["--runtime-dir", &dir]).await?;
    let http = reqwest::Client::new();
    let base = gw.base.trim_end_matches('/').to_owned();
    let created: Value = http
        .post(format!("{base}/v2/sandboxes"))
        .header("X-API-KEY", &gw.token)
        .json(&json!({"templateID": "base", "timeout": 600, "metadata": {"run": "kill-9"}}))
        .timeout(Duration::from_secs(120))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let id = created["sandboxID"]
        .as_str()
        .context("sandboxID")?
        .to_owned();
    let token = created["envdAccessToken"]
        .as_str()
        .context("envdAccessToken")?
        .to_owned();
    let (status, lines) = e2b_run(&gw, &id, &token, "x = 41").await?;
    assert_eq!(status, 200, "{lines:?}");
    let mode = std::fs::metadata(gw.runtime_dir.join("e2b-token-key"))
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777)?;
    assert_eq!(mode, 0o600, "the token key is the gateway's alone");

    let gw = gw.crash().await?.restart(&[]).await?;
    let (status, lines) = e2b_run(&gw, &id, &token, "x + 1").await?;
    assert_eq!(status, 200, "{lines:?}");
    assert_eq!(e2b_result(&lines), Some("42"), "{lines:?}");
    let base = gw.base.trim_end_matches('/').to_owned();
    let info: Value = http
        .get(format!("{base}/sandboxes/{id}"))
        .header("X-API-KEY", &gw.token)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    assert_eq!(info["envdAccessToken"], token.as_str(), "{info}");
    assert_eq!(info["metadata"], json!({"run": "kill-9"}), "{info}");

    let mut wrong = token.clone().into_bytes();
    wrong[0] = if wrong[0] == b'0' { b'1' } else { b'0' };
    let wrong = String::from_utf8(wrong)?;
    let (status, _) = e2b_run(&gw, &id, &wrong, "x").await?;
    assert_eq!(
        status, 401,
        "a wrong token is refused after the restart too"
    );

    // Its end is watched again: moved to a second from now, it ends then.
    let moved = http
        .post(format!("{base}/sandboxes/{id}/timeout"))
        .header("X-API-KEY", &gw.token)
        .json(&json!({"timeout": 1}))
        .send()
        .await?;
    assert_eq!(moved.status(), 204);
    let since = Instant::now();
    loop {
        let (status, _) = gw.get_json(&format!("/api/kernels/{id}")).await?;
        if status == 404 {
            break;
        }
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "the re-adopted sandbox did not end when its timeout passed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(gw.stop().await?.code(), Some(0));
    Ok(())
}
