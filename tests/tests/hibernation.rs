//! Hibernation end to end, under the runtime of the run: a kernel's variables, files,
//! environment and execution count survive hibernate and resume into a fresh process; its
//! container is gone meanwhile; what cannot be saved keeps the kernel running and says
//! why; a hibernated kernel survives a gateway killed with SIGKILL; requests that come
//! together wake it once, into the warm kernel; a hostile home (a 10 TB sparse file, a pipe,
//! modules named like the helpers', a variable that pickles forever) stalls neither the
//! gateway nor other kernels' hibernation; a state that does not load is kept, and can be
//! discarded for a fresh kernel with the files; concurrent hibernations and resumes of
//! 512 MiB homes keep the gateway within its memory budget.

use anyhow::{Context, Result};
use kernelgate_tests::{hibernate_dir, Gateway};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Containers of the gateway on `runtime_dir` (running or not).
fn containers(gw: &Gateway) -> Result<usize> {
    let filter = format!(
        "label=org.kernelgate.runtime_dir={}",
        gw.runtime_dir.display()
    );
    let out = std::process::Command::new("docker")
        .args(["ps", "-aq", "--filter", &filter])
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .count())
}

/// The ids of the containers of the gateway (running or not).
fn gateway_containers(gw: &Gateway) -> Result<Vec<String>> {
    let filter = format!(
        "label=org.kernelgate.runtime_dir={}",
        gw.runtime_dir.display()
    );
    let out = std::process::Command::new("docker")
        .args(["ps", "-aq", "--no-trunc", "--filter", &filter])
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect())
}

/// The kernel model of `id`.
async fn model(gw: &Gateway, id: &str) -> Result<Value> {
    let (status, model) = gw.get_json(&format!("/api/kernels/{id}")).await?;
    anyhow::ensure!(status == 200, "GET kernel answered {status}: {model}");
    Ok(model)
}

async fn hibernate(gw: &Gateway, id: &str) -> Result<(u16, Value)> {
    gw.post_json(&format!("/api/kernels/{id}/hibernate"), json!({}))
        .await
}

/// The `kernel_resumed` records, once the latest resume wrote its own: the gateway writes
/// it when the load is confirmed, which the waking cell's answer may overtake.
async fn resumes(gw: &Gateway) -> Result<usize> {
    let since = Instant::now();
    loop {
        let n = gw.audited("kernel_resumed")?.len();
        if n > 0 || since.elapsed() > Duration::from_secs(10) {
            return Ok(n);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

const NAMESPACE: &str = r#"
import os, hashlib
import numpy as np
import pandas as pd
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
count = 42
name = "Ada"
settings = {"depth": 3, "tags": ["a", "b"]}
arr = np.random.default_rng(7).random(10 * 2**20 // 8)
checksum = hashlib.sha256(arr.tobytes()).hexdigest()
df = pd.DataFrame({"city": ["Oslo", "Lima", "Pune"], "temp": [4.5, 19.0, 31.2]})
def area(r):
    return 3 * r * r
class Counter:
    def __init__(self, start):
        self.n = start
    def bump(self):
        self.n += 1
        return self.n
double = lambda x: 2 * x
fig, ax = plt.subplots()
ax.plot([1, 2, 3], [3, 1, 2])
ax.set_title("kept")
with open("notes.txt", "w") as f:
    f.write("written before hibernation\n")
os.makedirs("data", exist_ok=True)
with open("data/rows.csv", "w") as f:
    f.write("a,b\n1,2\n")
os.environ["KG_CHOICE"] = "blue"
print("ready")
"#;

const CHECK: &str = r#"
import json, hashlib, os
print(json.dumps({
    "count": count, "name": name, "settings": settings,
    "checksum": hashlib.sha256(arr.tobytes()).hexdigest() == checksum,
    "arr_mib": arr.nbytes / 2**20,
    "df": df.to_dict(orient="list"),
    "area": area(2), "counter": Counter(9).bump(), "double": double(21),
    "title": fig.axes[0].get_title(),
    "notes": open("notes.txt").read(),
    "rows": open("data/rows.csv").read(),
    "env": os.environ.get("KG_CHOICE"),
    "np": np.__name__,
}))
"#;

#[tokio::test]
async fn a_hibernated_kernel_resumes_with_its_variables_files_and_count() -> Result<()> {
    // No warm pool: the resume starts a kernel cold.
    let gw = Gateway::start(&[]).await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .context("id")?
        .to_owned();
    assert_eq!(gw.run(&id, NAMESPACE).await?.trim(), "ready");
    assert_eq!(containers(&gw)?, 1);

    let (status, hibernated) = hibernate(&gw, &id).await?;
    assert_eq!(status, 200, "{hibernated}");
    assert_eq!(hibernated["hibernated"], true);
    assert_eq!(hibernated["execution_state"], "idle");
    assert_eq!(
        containers(&gw)?,
        0,
        "the container outlived the hibernation"
    );
    let state = hibernate_dir(&gw.runtime_dir).join(&id);
    assert!(
        state.join("state.tar").is_file(),
        "no state in {}",
        state.display()
    );
    let (_, listed) = gw.get_json("/api/kernels").await?;
    assert_eq!(listed[0]["hibernated"], true, "{listed}");
    assert_eq!(
        model(&gw, &id).await?["hibernated"],
        true,
        "listing woke it"
    );

    let answer = gw.execute(&id, CHECK).await?;
    assert_eq!(answer["status"], "ok", "{answer}");
    // The namespace cell was the first; this is the second.
    assert_eq!(answer["execution_count"], 2, "{answer}");
    let seen: Value = serde_json::from_str(answer["stdout"].as_str().context("stdout")?.trim())?;
    assert_eq!(
        seen,
        json!({
            "count": 42, "name": "Ada", "settings": {"depth": 3, "tags": ["a", "b"]},
            "checksum": true, "arr_mib": 10.0,
            "df": {"city": ["Oslo", "Lima", "Pune"], "temp": [4.5, 19.0, 31.2]},
            "area": 12, "counter": 10, "double": 42, "title": "kept",
            "notes": "written before hibernation\n", "rows": "a,b\n1,2\n",
            "env": "blue", "np": "numpy",
        })
    );
    let awake = model(&gw, &id).await?;
    assert_eq!(awake["hibernated"], false, "{awake}");
    // Deleted once the load is confirmed, which the cell's answer may overtake.
    let since = Instant::now();
    while state.exists() {
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "the state outlived the resume"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(containers(&gw)?, 1);
    // The inputs before the hibernation are still the kernel's history.
    let history = gw.run(&id, "print(In[1].strip().splitlines()[0])").await?;
    assert_eq!(history.trim(), "import os, hashlib");

    let hibernations = gw.audited("kernel_hibernated")?;
    assert_eq!(hibernations.len(), 1);
    assert_eq!(hibernations[0]["kernel"], id.as_str());
    assert!(hibernations[0]["bytes"].as_u64().unwrap_or(0) > 10 << 20);
    assert_eq!(resumes(&gw).await?, 1);
    let metrics = gw.metrics().await?;
    assert!(
        metrics.contains("kernelgate_hibernated_kernels 0"),
        "{metrics}"
    );
    assert!(metrics.contains(r#"kernelgate_hibernations_total{outcome="hibernated"} 1"#));
    assert!(metrics.contains("kernelgate_resume_seconds_count 1"));
    assert_eq!(gw.delete_kernel(&id).await?, 204);
    Ok(())
}

#[tokio::test]
async fn what_cannot_be_saved_keeps_the_kernel_running_and_says_why() -> Result<()> {
    let gw = Gateway::start(&["--hibernate-max-mb", "8"]).await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .context("id")?
        .to_owned();
    let refused = |code: &'static str, names: &'static str| {
        let (gw, id) = (&gw, id.clone());
        async move {
            gw.run(&id, code).await?;
            let (status, body) = hibernate(gw, &id).await?;
            assert_eq!(status, 409, "{code}: {body}");
            let message = body["message"].as_str().unwrap_or_default().to_owned();
            assert!(message.contains(names), "{code}: {message}");
            let model = model(gw, &id).await?;
            assert_eq!(model["hibernated"], false);
            let blocked = model["hibernate_blocked"].as_str().unwrap_or_default();
            assert!(blocked.contains(names), "{code}: {model}");
            assert_eq!(containers(gw)?, 1, "{code}: the container went");
            anyhow::Ok(())
        }
    };
    gw.run(&id, "kept = 7").await?;
    refused("gen = (i for i in range(3))", "gen (generator)").await?;
    refused(
        "del gen\nimport sqlite3\nconn = sqlite3.connect(':memory:')",
        "conn (sqlite3.Connection)",
    )
    .await?;
    // An image without the save helper: the import fails as it would there.
    refused(
        "conn.close(); del conn\nimport sys; sys.modules['kernelgate_state'] = None",
        "has no kernelgate_state helper",
    )
    .await?;
    refused(
        "del sys.modules['kernelgate_state']\nimport os\nos.symlink('/etc/shadow', 'escape')",
        "escape",
    )
    .await?;
    refused(
        "os.remove('escape')\nwith open('big.bin', 'wb') as f: f.write(os.urandom(12 << 20))",
        "--hibernate-max-mb",
    )
    .await?;
    // The kernel ran on throughout, with its state, and what it saved for the refused
    // hibernations is gone from its home.
    assert_eq!(gw.run(&id, "print(kept)").await?.trim(), "7");
    let leftover = gw
        .run(&id, "print(os.path.exists('.kernelgate-state'))")
        .await?;
    assert_eq!(leftover.trim(), "False");
    // Nothing of a refused state is left on the host.
    let dir = hibernate_dir(&gw.runtime_dir);
    let left = std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
    assert_eq!(left, 0, "{} holds state", dir.display());
    let metrics = gw.metrics().await?;
    assert!(
        metrics.contains(r#"kernelgate_hibernations_total{outcome="blocked"} 5"#),
        "{metrics}"
    );
    Ok(())
}

#[tokio::test]
async fn lossy_hibernation_names_what_it_dropped_on_the_next_output() -> Result<()> {
    let gw = Gateway::start(&["--hibernate-lossy"]).await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .context("id")?
        .to_owned();
    gw.run(&id, "x = 5\ngen = (i for i in range(3))").await?;
    let (status, body) = hibernate(&gw, &id).await?;
    assert_eq!(status, 200, "{body}");
    let answer = gw.execute(&id, "print(x)").await?;
    assert_eq!(answer["stdout"], "5\n", "{answer}");
    let stderr = answer["stderr"].as_str().unwrap_or_default();
    assert!(stderr.contains("gen (generator)"), "{answer}");
    // Said once.
    let again = gw.execute(&id, "print(x + 1)").await?;
    assert_eq!(again["stderr"], "", "{again}");
    let record = &gw.audited("kernel_hibernated")?[0];
    assert!(record["dropped"].to_string().contains("gen"), "{record}");
    Ok(())
}

#[tokio::test]
async fn requests_that_come_together_wake_a_kernel_once_from_the_pool() -> Result<()> {
    let gw = Gateway::start(&["--pool-size", "1"]).await?;
    gw.wait_pool("filled").await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .context("id")?
        .to_owned();
    gw.run(&id, "seen = []").await?;
    gw.wait_pool("filled").await?;
    let (status, body) = hibernate(&gw, &id).await?;
    assert_eq!(status, 200, "{body}");
    // The one container left is the warm kernel the resume is to take.
    let warm = gateway_containers(&gw)?;
    assert_eq!(warm.len(), 1, "{warm:?}");
    // A first request starts the resume; four more are released at once while it runs.
    let first = gw.execute(&id, "seen.append('first'); print(len(seen))");
    let barrier = tokio::sync::Barrier::new(4);
    let runs = (0..4).map(|n| {
        let (gw, id, barrier) = (&gw, id.clone(), &barrier);
        async move {
            barrier.wait().await;
            gw.execute(&id, &format!("seen.append({n}); print(len(seen))"))
                .await
        }
    });
    let (first, answers) = tokio::join!(first, async {
        // Released once the resume has its new process and connects to it or loads the
        // state into it (the model stops reading as hibernated then).
        let _ = wait_model(&gw, &id, Duration::from_secs(5), |m| {
            m["hibernated"] == false
        })
        .await;
        futures::future::try_join_all(runs).await
    });
    let first = first?;
    assert_eq!(first["status"], "ok", "{first}");
    for answer in &answers? {
        assert_eq!(answer["status"], "ok", "{answer}");
    }
    let seen = gw.run(&id, "print(sorted(map(str, seen)))").await?;
    assert_eq!(seen.trim(), "['0', '1', '2', '3', 'first']");
    assert_eq!(resumes(&gw).await?, 1);
    // The kernel runs in the container that was warm.
    let name = std::process::Command::new("docker")
        .args(["inspect", "-f", "{{.Name}}", &warm[0]])
        .output()?;
    let name = String::from_utf8_lossy(&name.stdout);
    assert_eq!(
        name.trim(),
        format!("/kernelgate-{id}"),
        "not resumed into the warm kernel"
    );
    // Files come back with the kernel: reading one wakes it too.
    gw.run(&id, "open('kept.txt', 'w').write('still here')")
        .await?;
    let (status, body) = hibernate(&gw, &id).await?;
    assert_eq!(status, 200, "{body}");
    let file = gw
        .request(
            reqwest::Method::GET,
            &format!("/api/kernels/{id}/files/kept.txt"),
        )
        .send()
        .await?;
    assert_eq!(file.status(), 200);
    assert_eq!(file.text().await?, "still here");
    assert_eq!(model(&gw, &id).await?["hibernated"], false);
    // And an MCP tool call.
    let (status, body) = hibernate(&gw, &id).await?;
    assert_eq!(status, 200, "{body}");
    let mut mcp = kernelgate_client::mcp::McpCalls::new(gw.client());
    let text = mcp.run_python(&id, "print(len(seen))").await?;
    assert_eq!(text.trim(), "5", "{text}");
    assert_eq!(model(&gw, &id).await?["hibernated"], false);
    Ok(())
}

#[tokio::test]
async fn hibernated_kernels_outlive_a_gateway_killed_with_sigkill() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .context("id")?
        .to_owned();
    gw.run(&id, "answer = 41 + 1").await?;
    let (status, body) = hibernate(&gw, &id).await?;
    assert_eq!(status, 200, "{body}");
    let gw = gw.crash().await?.restart(&[]).await?;
    let listed = model(&gw, &id).await?;
    assert_eq!(listed["hibernated"], true, "{listed}");
    assert_eq!(gw.run(&id, "print(answer)").await?.trim(), "42");
    // A hibernated kernel restarted starts fresh; interrupting one does nothing.
    let (status, _) = hibernate(&gw, &id).await?;
    assert_eq!(status, 200);
    let interrupted = gw
        .request(
            reqwest::Method::POST,
            &format!("/api/kernels/{id}/interrupt"),
        )
        .send()
        .await?;
    assert_eq!(interrupted.status(), 204);
    assert_eq!(model(&gw, &id).await?["hibernated"], true);
    let state = hibernate_dir(&gw.runtime_dir).join(&id);
    assert!(state.exists());
    let (status, body) = gw
        .post_json(&format!("/api/kernels/{id}/restart"), json!({}))
        .await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["hibernated"], false, "{body}");
    assert!(!state.exists(), "a restart kept the saved state");
    let fresh = gw.execute(&id, "answer").await?;
    assert_eq!(fresh["error"]["ename"], "NameError", "{fresh}");
    // Deleting a hibernated kernel deletes its state.
    let (status, _) = hibernate(&gw, &id).await?;
    assert_eq!(status, 200);
    assert!(state.exists());
    assert_eq!(gw.delete_kernel(&id).await?, 204);
    assert!(!state.exists(), "the state outlived the kernel");
    Ok(())
}

#[tokio::test]
async fn an_idle_kernel_hibernates_and_its_open_websocket_wakes_it() -> Result<()> {
    let gw = Gateway::start(&["--hibernate-after", "2"]).await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .context("id")?
        .to_owned();
    let mut ws = gw.channels(&id, "tab-1").await?;
    let set = ws.execute("total = sum(range(10))").await?;
    assert_eq!(set.status, "ok");
    let since = Instant::now();
    // Hibernated, and its container removed (which takes a moment more under gVisor).
    while model(&gw, &id).await?["hibernated"] != true || containers(&gw)? != 0 {
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "it never hibernated"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The tab's WebSocket stayed open; its next cell wakes the kernel.
    let next = ws.execute("print(total)").await?;
    assert_eq!(next.stdout, "45\n", "{:?}", next.msg_types);
    assert_eq!(next.execution_count, Some(2));
    Ok(())
}

/// `kernelgate keys ARGS --file FILE`: the token it printed.
fn add_key(file: &std::path::Path, args: &[&str]) -> Result<String> {
    let out = std::process::Command::new(kernelgate_tests::binary())
        .arg("keys")
        .args(args)
        .arg("--file")
        .arg(file)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

#[tokio::test]
async fn hibernated_kernels_count_against_their_own_caps_and_go_with_their_key() -> Result<()> {
    use reqwest::Method;
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("keys.toml");
    let alice = add_key(&file, &["add", "alice", "--max-hibernated", "2"])?;
    let root = add_key(&file, &["add", "root", "--admin"])?;
    let gw = Gateway::start(&["--keys", &file.display().to_string(), "--max-kernels", "1"]).await?;
    let call = |method: Method, path: String, body: Option<Value>| {
        let (gw, alice) = (&gw, alice.clone());
        async move { gw.call_as(&alice, method, &path, body).await }
    };
    let create = || async {
        let (status, body) = call(Method::POST, "/api/kernels".into(), Some(json!({}))).await?;
        anyhow::Ok((status, body["id"].as_str().unwrap_or_default().to_owned()))
    };
    let execute = |id: String, code: &'static str| {
        call(
            Method::POST,
            format!("/api/kernels/{id}/execute"),
            Some(json!({"code": code})),
        )
    };
    let hibernate = |id: String| {
        call(
            Method::POST,
            format!("/api/kernels/{id}/hibernate"),
            Some(json!({})),
        )
    };

    let (status, k1) = create().await?;
    assert_eq!(status, 201);
    execute(k1.clone(), "a = 1").await?;
    assert_eq!(hibernate(k1.clone()).await?.0, 200);
    // A hibernated kernel does not count against --max-kernels 1.
    let (status, k2) = create().await?;
    assert_eq!(status, 201);
    execute(k2.clone(), "b = 2").await?;
    // Waking k1 at the limit hibernates alice's other idle kernel first.
    let (status, woken) = execute(k1.clone(), "print(a)").await?;
    assert_eq!(
        (status, woken["stdout"].as_str()),
        (200, Some("1\n")),
        "{woken}"
    );
    let (_, k2_model) = gw
        .call_as(&root, Method::GET, &format!("/api/kernels/{k2}"), None)
        .await?;
    assert_eq!(k2_model["hibernated"], true, "{k2_model}");
    assert_eq!(create().await?.0, 403, "past --max-kernels");
    assert_eq!(hibernate(k1.clone()).await?.0, 200);
    let (status, k3) = create().await?;
    assert_eq!(status, 201);
    // Two hibernated already: alice's max_hibernated.
    let (status, body) = hibernate(k3.clone()).await?;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or_default()
            .contains("max_hibernated"),
        "{body}"
    );

    // Revoking alice's key deletes her kernels, hibernated ones with their state.
    let states = hibernate_dir(&gw.runtime_dir);
    assert_eq!(std::fs::read_dir(&states)?.count(), 2);
    add_key(&file, &["remove", "alice"])?;
    let pid = gw.pid().context("gateway pid")?;
    assert!(std::process::Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()?
        .success());
    // The table lets go of each kernel before its state and container are removed: wait
    // for all three, then say which one is missing.
    let since = Instant::now();
    loop {
        let listed = gw.get_json("/api/kernels").await?.1;
        let (states_left, containers_left) =
            (std::fs::read_dir(&states)?.count(), containers(&gw)?);
        let gone = listed.as_array().is_some_and(Vec::is_empty)
            && states_left == 0
            && containers_left == 0;
        if gone || since.elapsed() > Duration::from_secs(20) {
            assert_eq!(listed, json!([]), "alice's kernels outlived her key");
            assert_eq!(states_left, 0, "hibernated state outlived the key");
            assert_eq!(containers_left, 0, "a container outlived the key");
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Waits until `check` holds for the model of `id`, up to `limit`; the last model.
async fn wait_model(
    gw: &Gateway,
    id: &str,
    limit: Duration,
    check: impl Fn(&Value) -> bool,
) -> Result<Value> {
    let since = Instant::now();
    loop {
        let model = model(gw, id).await?;
        if check(&model) || since.elapsed() > limit {
            return Ok(model);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A home no helper of the gateway may trust: a 10 TB sparse file, a pipe, modules named
/// like those the helpers import (each would hang if imported), and a variable whose
/// pickling never ends.
const HOSTILE: &str = r#"
import os, time
with open("sparse.bin", "wb") as f:
    f.truncate(10 * 2**40)
os.mkfifo("pipe")
hang = "import time\ntime.sleep(3600)\n"
for module in ["tarfile.py", "json.py"]:
    open(module, "w").write(hang)
os.makedirs("pip", exist_ok=True)
open("pip/__init__.py", "w").write(hang)
open("pip/__main__.py", "w").write(hang)
class Slow:
    def __reduce__(self):
        time.sleep(3600)
slow = Slow()
kept = 11
print(os.stat("sparse.bin").st_size)
"#;

#[tokio::test]
async fn a_hostile_home_stalls_neither_the_gateway_nor_other_kernels() -> Result<()> {
    // One gateway hibernates idle kernels on its own; the other is driven by hand.
    let (auto, by_hand) = tokio::join!(
        Gateway::start(&["--hibernate-after", "3", "--hibernate-save-timeout", "20",]),
        Gateway::start(&[
            "--hibernate-max-mb",
            "32",
            "--sandbox-command-timeout",
            "20"
        ])
    );
    let (auto, gw) = (auto?, by_hand?);
    let (hostile, quiet, manual) = (
        auto.client().create_kernel(None).await?,
        auto.client().create_kernel(None).await?,
        gw.client().create_kernel(None).await?,
    );
    assert_eq!(auto.run(&hostile, HOSTILE).await?.trim(), "10995116277760");
    auto.run(&quiet, "x = 1").await?;

    // The quiet kernel hibernates on schedule while the hostile one's save hangs.
    let slept = wait_model(&auto, &quiet, Duration::from_secs(60), |m| {
        m["hibernated"] == true
    })
    .await?;
    assert_eq!(slept["hibernated"], true, "{slept}");
    let saving = model(&auto, &hostile).await?;
    assert_eq!(saving["hibernate_blocked"], Value::Null, "{saving}");
    // The save is interrupted past --hibernate-save-timeout, and the variable named.
    let blocked = wait_model(&auto, &hostile, Duration::from_secs(90), |m| {
        m["hibernate_blocked"].is_string()
    })
    .await?;
    let why = blocked["hibernate_blocked"].as_str().unwrap_or_default();
    assert!(
        why.contains("slow (")
            && why.contains("interrupted")
            && why.contains("--hibernate-save-timeout"),
        "{blocked}"
    );
    assert_eq!(blocked["hibernated"], false, "{blocked}");
    // The kernel runs on with its variables.
    assert_eq!(auto.run(&hostile, "print(kept)").await?.trim(), "11");

    // The files API: the listing works, a pipe and a huge file fail at once, with reasons.
    assert_eq!(gw.run(&manual, HOSTILE).await?.trim(), "10995116277760");
    let get = |path: &'static str| {
        let (gw, id) = (&gw, manual.clone());
        async move {
            let response = gw
                .request(
                    reqwest::Method::GET,
                    &format!("/api/kernels/{id}/files{path}"),
                )
                .send()
                .await?;
            anyhow::Ok((response.status().as_u16(), response.text().await?))
        }
    };
    let listing = get("").await?;
    assert_eq!(listing.0, 200, "{listing:?}");
    assert!(
        listing.1.contains("tarfile.py") && listing.1.contains("pipe"),
        "{listing:?}"
    );
    let (status, body) = get("/pipe").await?;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not a regular file"), "{body}");
    let (status, body) = get("/sparse.bin").await?;
    assert_eq!(status, 413, "{body}");
    let (status, body) = get("/json.py").await?;
    assert_eq!((status, body.contains("time.sleep")), (200, true), "{body}");

    // Hibernating it: each obstacle is named in turn, and the gateway answers.
    gw.run(&manual, "del slow").await?;
    let (status, body) = hibernate(&gw, &manual).await?;
    assert_eq!(status, 409, "{body}");
    assert!(body.to_string().contains("--hibernate-max-mb"), "{body}");
    gw.run(&manual, "os.remove('sparse.bin')").await?;
    let (status, body) = hibernate(&gw, &manual).await?;
    assert_eq!(status, 409, "{body}");
    assert!(body.to_string().contains("pipe"), "{body}");
    // Without them it hibernates, shadowing modules and all, and comes back.
    gw.run(&manual, "os.remove('pipe')").await?;
    let (status, body) = hibernate(&gw, &manual).await?;
    assert_eq!(status, 200, "{body}");
    let back = gw
        .run(
            &manual,
            "print(kept, open('json.py').read().count('sleep'))",
        )
        .await?;
    assert_eq!(back.trim(), "11 1");
    Ok(())
}

#[tokio::test]
async fn a_state_that_does_not_load_is_kept_and_can_be_discarded_keeping_the_files() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = gw.client().create_kernel(None).await?;
    // Loading this variable ends the process that loads it.
    let cell =
        "import os\nclass Fatal:\n    def __reduce__(self):\n        return (os._exit, (3,))\n\
                fatal = Fatal()\nx = 1\nopen('kept.txt', 'w').write('still here')";
    gw.run(&id, cell).await?;
    let (status, body) = hibernate(&gw, &id).await?;
    assert_eq!(status, 200, "{body}");

    // The cell that wakes it is told, with what to do; the state stays and so does the sleep.
    let answer = gw.execute(&id, "print(x)").await?;
    assert_eq!(answer["status"], "error", "{answer}");
    let error = answer["error"].to_string();
    assert!(
        error.contains("could not be loaded")
            && error.contains("the state is kept")
            && error.contains(&format!("/api/kernels/{id}/discard-state")),
        "{answer}"
    );
    assert_eq!(model(&gw, &id).await?["hibernated"], true);
    let state = hibernate_dir(&gw.runtime_dir).join(&id);
    assert!(state.join("state.tar").is_file(), "the state went");
    let failed = gw.audited("kernel_resume_failed")?;
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0]["kernel"], id.as_str());
    assert!(
        gw.audited("kernel_resumed")?.is_empty(),
        "a failed load was audited as a resume"
    );

    // Discarding the variables gives a fresh kernel with the files.
    let (status, body) = gw
        .post_json(&format!("/api/kernels/{id}/discard-state"), json!({}))
        .await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["hibernated"], false, "{body}");
    let fresh = gw
        .run(&id, "print(open('kept.txt').read(), 'x' in globals())")
        .await?;
    assert_eq!(fresh.trim(), "still here False");
    assert!(!state.exists(), "the discarded state is still on disk");
    assert_eq!(gw.audited("kernel_state_discarded")?.len(), 1);
    let (status, body) = gw
        .post_json(&format!("/api/kernels/{id}/discard-state"), json!({}))
        .await?;
    assert_eq!(status, 409, "{body}");
    Ok(())
}

/// The gateway's memory while `work` runs: its resident size before, and the most seen.
async fn peak_rss<T>(
    gw: &Gateway,
    work: impl std::future::Future<Output = T>,
) -> Result<(u64, u64, T)> {
    let before = gw.rss_bytes()?;
    let done = std::sync::atomic::AtomicBool::new(false);
    let sample = async {
        let mut peak = before;
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            peak = peak.max(gw.rss_bytes()?);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        anyhow::Ok(peak)
    };
    let run = async {
        let out = work.await;
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        out
    };
    let (peak, out) = tokio::join!(sample, run);
    Ok((before, peak?, out))
}

#[tokio::test]
async fn concurrent_hibernations_and_resumes_of_large_homes_stream_within_the_memory_budget(
) -> Result<()> {
    // The budget docs/security.md gives: per hibernation or resume in flight, at most this
    // much of the gateway's memory, and a fixed allowance for the requests themselves.
    const PER_STREAM: u64 = 4 << 20;
    const FIXED: u64 = 32 << 20;
    const K: usize = 3;
    const HOME: &str = "chunk = os.urandom(1 << 20)\nwith open('big.bin', 'wb') as f:\n    \
                        for _ in range(512): f.write(chunk)\nprint(os.path.getsize('big.bin') >> 20)";
    let gw = Gateway::start(&[
        "--kernel-disk-mb",
        "600",
        "--kernel-memory-mb",
        "1024",
        "--hibernate-max-mb",
        "600",
    ])
    .await?;
    let mut ids = Vec::new();
    for _ in 0..K {
        let id = gw.client().create_kernel(None).await?;
        assert_eq!(
            gw.run(&id, &format!("import os\n{HOME}")).await?.trim(),
            "512"
        );
        ids.push(id);
    }
    let (before, peak, slept) = peak_rss(
        &gw,
        futures::future::join_all(ids.iter().map(|id| hibernate(&gw, id))),
    )
    .await?;
    for answer in slept {
        let (status, body) = answer?;
        assert_eq!(status, 200, "{body}");
    }
    let budget = FIXED + K as u64 * PER_STREAM;
    eprintln!(
        "hibernations: RSS {} MiB before, {} MiB at most",
        before >> 20,
        peak >> 20
    );
    assert!(
        peak.saturating_sub(before) <= budget,
        "{K} hibernations of 512 MiB homes took the gateway from {before} to {peak} bytes, past {budget}"
    );
    let (before, peak, woke) = peak_rss(
        &gw,
        futures::future::join_all(
            ids.iter()
                .map(|id| gw.run(id, "print(os.path.getsize('big.bin') >> 20)")),
        ),
    )
    .await?;
    for answer in woke {
        assert_eq!(answer?.trim(), "512");
    }
    eprintln!(
        "resumes: RSS {} MiB before, {} MiB at most",
        before >> 20,
        peak >> 20
    );
    assert!(
        peak.saturating_sub(before) <= budget,
        "{K} resumes of 512 MiB homes took the gateway from {before} to {peak} bytes, past {budget}"
    );
    Ok(())
}
