//! End to end: snapshots and forks, under Docker (Python-level: what the kernel's helper can
//! pickle, and the home's files) and under the gVisor engine (the whole kernel, generators
//! and threads included). A kernel forks into three that each see its state and stay apart;
//! a snapshot outlives its kernel and the gateway, belongs to its key, and is held to the
//! key's budgets; a snapshot that cannot be taken leaves its kernel running.

use anyhow::{ensure, Context, Result};
use kernelgate_tests::Gateway;
use reqwest::Method;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

/// Whether the gateways run on the gVisor engine (whole-kernel snapshots).
fn engine() -> bool {
    kernelgate_tests::engine::gvisor_engine()
}

/// The kind a `full` snapshot is under the engine the suite runs on.
fn full_kind() -> &'static str {
    if engine() {
        "memory"
    } else {
        "namespace"
    }
}

async fn create(gw: &Gateway, body: Value) -> Result<(u16, Value)> {
    gw.post_json("/api/kernels", body).await
}

async fn stdout(gw: &Gateway, id: &str, code: &str) -> Result<String> {
    let answer = gw.execute(id, code).await?;
    ensure!(answer["status"] == "ok", "{code}: {answer}");
    Ok(answer["stdout"]
        .as_str()
        .unwrap_or_default()
        .trim()
        .to_owned())
}

/// The ids of the kernels a fork answer started; fails on any fork that did not start.
fn fork_ids(answer: &Value, count: usize) -> Result<Vec<String>> {
    let forks = answer["forks"].as_array().context("forks")?;
    ensure!(forks.len() == count, "{count} forks asked: {answer}");
    forks
        .iter()
        .map(|f| {
            f["kernel"]["id"]
                .as_str()
                .map(str::to_owned)
                .with_context(|| format!("a fork did not start: {f}"))
        })
        .collect()
}

/// A kernel holding a 100 MiB array, a DataFrame and a file.
const STATE: &str = r#"
import numpy as np, pandas as pd
big = np.arange(100 * 2**20 // 8, dtype=np.int64)
frame = pd.DataFrame({"x": np.arange(100_000), "y": np.arange(100_000) * 2.0})
with open("notes.txt", "w") as f:
    f.write("from the source")
"#;

const SEES: &str = r#"print(big.nbytes, int(big[-1]), frame.shape, float(frame.y.sum()), open("notes.txt").read())"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_forks_into_three_that_see_its_state_and_stay_apart() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let source = gw.create_kernel().await?["id"]
        .as_str()
        .context("id")?
        .to_owned();
    gw.run(&source, STATE).await?;
    let expected = stdout(&gw, &source, SEES).await?;
    ensure!(
        expected.starts_with("104857600 13107199 (100000, 2)"),
        "{expected}"
    );

    // The source answers while it forks: a cell sent meanwhile runs (after the snapshot).
    let fork_path = format!("/api/kernels/{source}/fork");
    let fork = gw.post_json(&fork_path, json!({"count": 3}));
    let during = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        gw.execute(&source, "print(int(big[7]) + 1)").await
    };
    let (forked, during) = tokio::join!(fork, during);
    let (status, forked) = forked?;
    assert_eq!(status, 200, "{forked}");
    assert_eq!(during?["stdout"].as_str().map(str::trim), Some("8"));
    assert_eq!(forked["kind"], full_kind(), "{forked}");
    let forks = fork_ids(&forked, 3)?;
    let mut all = forks.clone();
    all.push(source.clone());
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 4, "each fork has its own id: {forked}");

    for id in &forks {
        assert_eq!(stdout(&gw, id, SEES).await?, expected, "fork {id}");
    }
    // Each fork signs with a key of its own: not the source's, not another fork's.
    let mut keys = Vec::new();
    for id in &all {
        let connection: Value =
            serde_json::from_slice(&std::fs::read(gw.runtime_dir.join(id).join("kernel.json"))?)?;
        keys.push(connection["key"].as_str().context("a key")?.to_owned());
    }
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 4, "the source and its forks share a key");
    // A change in one fork, variables and files, stays in it.
    gw.run(
        &forks[0],
        "big[-1] = -5\nframe['x'] = 0\nopen('notes.txt', 'w').write('fork 0')\nonly_here = 1",
    )
    .await?;
    assert_eq!(
        stdout(
            &gw,
            &forks[0],
            "print(int(big[-1]), int(frame.x.sum()), open('notes.txt').read())"
        )
        .await?,
        "-5 0 fork 0"
    );
    for id in [&forks[1], &forks[2], &source] {
        assert_eq!(
            stdout(&gw, id, SEES).await?,
            expected,
            "kernel {id} saw another's change"
        );
        let answer = gw.execute(id, "only_here").await?;
        assert_eq!(answer["error"]["ename"], "NameError", "{answer}");
    }
    // Each fork draws its own random numbers.
    let mut draws = Vec::new();
    for id in &forks {
        draws.push(stdout(&gw, id, "import random; print(random.random())").await?);
    }
    draws.sort();
    draws.dedup();
    assert_eq!(
        draws.len(),
        3,
        "forks repeat each other's random numbers: {draws:?}"
    );

    // The fork's own snapshot is not listed, and is gone from disk.
    let (_, listed) = gw.get_json("/api/kernelgate/snapshots").await?;
    assert_eq!(listed["snapshots"], json!([]), "{listed}");
    let on_disk =
        std::fs::read_dir(kernelgate_tests::hibernate_dir(&gw.runtime_dir).join("snapshots"))
            .map(|d| d.count())
            .unwrap_or(0);
    assert_eq!(on_disk, 0, "the fork's snapshot was left on disk");
    let forked_records = gw.audited("kernel_forked")?;
    assert_eq!(forked_records.len(), 1, "{forked_records:?}");
    assert_eq!(forked_records[0]["forks"].as_array().map(Vec::len), Some(3));
    let created = gw.audited("kernel_created")?;
    assert_eq!(
        created.iter().filter(|r| r["source"] == "snapshot").count(),
        3,
        "{created:?}"
    );
    // Out of range: refused, nothing started.
    let (status, refused) = gw
        .post_json(&format!("/api/kernels/{source}/fork"), json!({"count": 21}))
        .await?;
    assert_eq!(status, 400, "{refused}");
    gw.stop().await?;
    Ok(())
}

/// A generator mid-iteration and a thread that keeps counting.
const LIVE_OBJECTS: &str = r#"
import threading, time, itertools
gen = (i * i for i in itertools.count())
first = [next(gen) for _ in range(4)]
ticks = [0]
def tick():
    while True:
        ticks[0] += 1
        time.sleep(0.01)
worker = threading.Thread(target=tick, daemon=True)
worker.start()
open("kept.txt", "w").write("a file")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_full_snapshot_keeps_depends_on_the_engine_and_filesystem_keeps_files() -> Result<()>
{
    let gw = Gateway::start(&[]).await?;
    let source = gw.create_kernel().await?["id"]
        .as_str()
        .context("id")?
        .to_owned();
    gw.run(&source, LIVE_OBJECTS).await?;
    let path = format!("/api/kernels/{source}/snapshots");
    if engine() {
        let (status, forked) = gw
            .post_json(&format!("/api/kernels/{source}/fork"), json!({"count": 2}))
            .await?;
        assert_eq!(status, 200, "{forked}");
        for id in fork_ids(&forked, 2)? {
            // The generator goes on where it was; the thread runs and counts on.
            assert_eq!(
                stdout(&gw, &id, "print(next(gen), next(gen))").await?,
                "16 25"
            );
            let counted = stdout(
                &gw,
                &id,
                "a = ticks[0]; time.sleep(0.3); print(worker.is_alive(), ticks[0] > a)",
            )
            .await?;
            assert_eq!(counted, "True True", "fork {id}");
        }
        assert_eq!(stdout(&gw, &source, "print(next(gen))").await?, "16");
    } else {
        // Python-level: refused by name, the kernel runs on.
        let (status, refused) = gw.post_json(&path, json!({"name": "live"})).await?;
        assert_eq!(status, 409, "{refused}");
        let message = refused["message"].as_str().unwrap_or_default();
        ensure!(
            message.contains("gen (generator)") && message.contains("accept_loss"),
            "names the generator and the way around: {refused}"
        );
        assert_eq!(stdout(&gw, &source, "print(next(gen))").await?, "16");
        // With the loss accepted: what could be saved, and what was not named.
        let (status, lossy) = gw
            .post_json(&path, json!({"name": "lossy", "accept_loss": true}))
            .await?;
        assert_eq!(status, 201, "{lossy}");
        assert_eq!(lossy["kind"], "namespace");
        let dropped = lossy["dropped"].to_string();
        ensure!(
            dropped.contains("gen") && dropped.contains("worker"),
            "{lossy}"
        );
        let (status, started) = create(&gw, json!({"snapshot": "lossy"})).await?;
        assert_eq!(status, 201, "{started}");
        let id = started["id"].as_str().context("id")?;
        assert_eq!(stdout(&gw, id, "print(first)").await?, "[0, 1, 4, 9]");
    }
    // `filesystem` keeps the files and nothing else, under every engine.
    let (status, files) = gw
        .post_json(
            &path,
            json!({"name": "files", "mode": "filesystem", "metadata": {"stage": "raw"}}),
        )
        .await?;
    assert_eq!(status, 201, "{files}");
    assert_eq!(files["kind"], "filesystem");
    assert_eq!(files["metadata"]["stage"], "raw");
    // A filesystem snapshot takes a new environment.
    let (status, started) = create(
        &gw,
        json!({"snapshot": files["id"], "env": {"KERNEL_STAGE": "two"}}),
    )
    .await?;
    assert_eq!(status, 201, "{started}");
    let id = started["id"].as_str().context("id")?;
    assert_eq!(
        stdout(
            &gw,
            id,
            "import os; print(open('kept.txt').read(), os.environ['KERNEL_STAGE'])"
        )
        .await?,
        "a file two"
    );
    let answer = gw.execute(id, "first").await?;
    assert_eq!(answer["error"]["ename"], "NameError", "{answer}");
    gw.stop().await?;
    Ok(())
}

/// A key made with `kernelgate keys add`: its token.
fn key(file: &Path, args: &[&str]) -> Result<String> {
    Ok(kernelgate_tests::keys(file, args)?.trim().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_outlives_its_kernel_and_the_gateway_and_is_its_keys_alone() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("keys.toml");
    let alice = key(&file, &["add", "alice", "--max-snapshots", "2"])?;
    let bob = key(&file, &["add", "bob"])?;
    let carol = key(&file, &["add", "carol", "--snapshot-max-mb", "8"])?;
    let file = file.display().to_string();
    let runtime_dir = format!("/run/kg-snap-{}", std::process::id());
    let gw = Gateway::start(&["--keys", &file, "--runtime-dir", &runtime_dir]).await?;
    let as_alice = |method: Method, path: &str, body: Option<Value>| {
        let path = path.to_owned();
        let gw = &gw;
        let alice = alice.clone();
        async move { gw.call_as(&alice, method, &path, body).await }
    };
    let (status, kernel) = as_alice(Method::POST, "/api/kernels", Some(json!({}))).await?;
    assert_eq!(status, 201, "{kernel}");
    let source = kernel["id"].as_str().context("id")?.to_owned();
    let run = |code: &'static str| {
        let (gw, alice, source) = (&gw, alice.clone(), source.clone());
        async move { gw.execute_as(&alice, &source, code).await }
    };
    run("x = 41\nopen('data.csv', 'w').write('a,b\\n1,2\\n')").await?;
    let snap = format!("/api/kernels/{source}/snapshots");
    let (status, first) = as_alice(Method::POST, &snap, Some(json!({"name": "base"}))).await?;
    assert_eq!(status, 201, "{first}");
    assert_eq!(first["kind"], full_kind());
    assert_eq!(first["kernel_id"], source.as_str());

    // Budgets: a third snapshot passes alice's count; the kernel runs on.
    let (status, second) = as_alice(Method::POST, &snap, Some(json!({"name": "second"}))).await?;
    assert_eq!(status, 201, "{second}");
    let (status, refused) = as_alice(Method::POST, &snap, Some(json!({"name": "third"}))).await?;
    assert_eq!(status, 409, "{refused}");
    let message = refused["message"].as_str().unwrap_or_default();
    ensure!(
        message.contains("keeps 2 snapshots") && message.contains("max_snapshots in the keys file"),
        "{refused}"
    );
    assert_eq!(run("print(x + 1)").await?["stdout"], "42\n");
    // The same name replaces: the count stays.
    let (status, again) = as_alice(Method::POST, &snap, Some(json!({"name": "second"}))).await?;
    assert_eq!(status, 201, "{again}");
    let (status, gone) = as_alice(
        Method::GET,
        &format!(
            "/api/kernelgate/snapshots/{}",
            second["id"].as_str().unwrap_or_default()
        ),
        None,
    )
    .await?;
    assert_eq!(
        status, 404,
        "the older snapshot of the name is gone: {gone}"
    );
    let (status, _) = as_alice(Method::DELETE, "/api/kernelgate/snapshots/second", None).await?;
    assert_eq!(status, 204);
    // Carol may keep 8 MiB of snapshots: 12 MiB of files pass it; her kernel runs on.
    let (status, kernel) = gw
        .call_as(&carol, Method::POST, "/api/kernels", Some(json!({})))
        .await?;
    assert_eq!(status, 201, "{kernel}");
    let hers = kernel["id"].as_str().context("id")?.to_owned();
    gw.execute_as(
        &carol,
        &hers,
        "import os\nwith open('big.bin', 'wb') as f: f.write(os.urandom(12 << 20))",
    )
    .await?;
    let (status, refused) = gw
        .call_as(
            &carol,
            Method::POST,
            &format!("/api/kernels/{hers}/snapshots"),
            Some(json!({"mode": "filesystem"})),
        )
        .await?;
    assert_eq!(status, 409, "{refused}");
    let message = refused["message"].as_str().unwrap_or_default();
    ensure!(
        message.contains("8 MiB") && message.contains("snapshot_max_mb in the keys file"),
        "{refused}"
    );
    assert_eq!(
        gw.execute_as(&carol, &hers, "print(os.path.getsize('big.bin') >> 20)")
            .await?["stdout"],
        "12\n"
    );

    // Another key: no list, no get, no use, no delete.
    let (status, listed) = gw
        .call_as(&bob, Method::GET, "/api/kernelgate/snapshots", None)
        .await?;
    assert_eq!(status, 200);
    assert_eq!(listed["snapshots"], json!([]), "{listed}");
    let id = first["id"].as_str().context("id")?;
    for (method, path, body) in [
        (Method::GET, format!("/api/kernelgate/snapshots/{id}"), None),
        (
            Method::DELETE,
            format!("/api/kernelgate/snapshots/{id}"),
            None,
        ),
        (
            Method::POST,
            "/api/kernels".to_owned(),
            Some(json!({"snapshot": id})),
        ),
        (
            Method::POST,
            "/api/kernels".to_owned(),
            Some(json!({"snapshot": "base"})),
        ),
    ] {
        let (status, answer) = gw.call_as(&bob, method.clone(), &path, body).await?;
        assert_eq!(status, 404, "{method} {path} as another key: {answer}");
    }

    // The source goes, then the gateway: the snapshot stays.
    let (status, _) = as_alice(Method::DELETE, &format!("/api/kernels/{source}"), None).await?;
    assert_eq!(status, 204);
    let gw = gw.crash().await?.restart(&["--keys", &file]).await?;
    let (_, listed) = gw
        .call_as(
            &alice,
            Method::GET,
            "/api/kernelgate/snapshots?name=base",
            None,
        )
        .await?;
    assert_eq!(listed["snapshots"][0]["id"], id, "{listed}");
    let (status, started) = gw
        .call_as(
            &alice,
            Method::POST,
            "/api/kernels",
            Some(json!({"snapshot": "base"})),
        )
        .await?;
    assert_eq!(status, 201, "{started}");
    let new = started["id"].as_str().context("id")?;
    let answer = gw
        .execute_as(
            &alice,
            new,
            "print(x + 1, open('data.csv').read().splitlines()[1])",
        )
        .await?;
    assert_eq!(answer["stdout"], "42 1,2\n", "{answer}");
    if engine() {
        // A whole kernel takes no new environment.
        let (status, refused) = gw
            .call_as(
                &alice,
                Method::POST,
                "/api/kernels",
                Some(json!({"snapshot": "base", "env": {"KERNEL_X": "1"}})),
            )
            .await?;
        assert_eq!(status, 400, "{refused}");
        ensure!(
            refused["message"]
                .as_str()
                .unwrap_or_default()
                .contains("KERNEL_X"),
            "{refused}"
        );
    }
    let taken = gw.audited("snapshot_taken")?;
    ensure!(
        taken
            .iter()
            .any(|r| r["snapshot"] == id && r["key"] == "alice"),
        "{taken:?}"
    );
    let deleted = gw.audited("snapshot_deleted")?;
    ensure!(
        deleted.iter().any(|r| r["reason"]
            .as_str()
            .is_some_and(|r| r.contains("same name")))
            && deleted.iter().any(|r| r["key"] == "alice"),
        "{deleted:?}"
    );
    let metrics = gw.metrics().await?;
    ensure!(
        metrics.contains("kernelgate_snapshots 1"),
        "one snapshot kept:\n{metrics}"
    );
    gw.stop().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_that_cannot_be_taken_leaves_its_kernel_running() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .context("id")?
        .to_owned();
    gw.run(&id, "y = 7").await?;
    let path = format!("/api/kernels/{id}/snapshots");
    // What the engine cannot keep (a listening socket), or Python cannot (a lock).
    let blocker = if engine() {
        "import socket\nserver = socket.socket()\nserver.bind(('127.0.0.1', 0))\nserver.listen()"
    } else {
        "import threading\nlock = threading.Lock()"
    };
    gw.run(&id, blocker).await?;
    let (status, refused) = gw.post_json(&path, json!({})).await?;
    assert_eq!(status, 409, "{refused}");
    let message = refused["message"].as_str().unwrap_or_default();
    let named = if engine() {
        "listens on TCP port"
    } else {
        "lock"
    };
    ensure!(message.contains(named), "{refused}");
    assert_eq!(stdout(&gw, &id, "print(y * 6)").await?, "42");
    let (status, model) = gw.get_json(&format!("/api/kernels/{id}")).await?;
    assert_eq!(status, 200);
    assert_eq!(model["execution_state"], "idle", "{model}");
    // A name of the wrong shape, a mode of none: refused before anything is taken.
    for body in [json!({"name": "a b"}), json!({"mode": "everything"})] {
        let (status, refused) = gw.post_json(&path, body.clone()).await?;
        assert_eq!(status, 400, "{body}: {refused}");
    }
    let (status, missing) = gw
        .post_json("/api/kernels", json!({"snapshot": "nothing-here"}))
        .await?;
    assert_eq!(status, 404, "{missing}");
    gw.stop().await?;
    Ok(())
}
