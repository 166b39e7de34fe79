//! Hibernation end to end, under the runtime of the run: a kernel's variables, files,
//! environment and execution count survive hibernate and resume into a fresh process; its
//! container is gone meanwhile; what cannot be saved keeps the kernel running and says
//! why; a hibernated kernel survives a gateway killed with SIGKILL; requests that come
//! together wake it once.

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

/// Runs `code` and returns what it printed, failing on an error.
async fn run(gw: &Gateway, id: &str, code: &str) -> Result<String> {
    let answer = gw.execute(id, code).await?;
    anyhow::ensure!(answer["status"] == "ok", "{code}: {answer}");
    Ok(answer["stdout"].as_str().unwrap_or_default().to_owned())
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
    assert_eq!(run(&gw, &id, NAMESPACE).await?.trim(), "ready");
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
    let history = run(&gw, &id, "print(In[1].strip().splitlines()[0])").await?;
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
            run(gw, &id, code).await?;
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
    run(&gw, &id, "kept = 7").await?;
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
    assert_eq!(run(&gw, &id, "print(kept)").await?.trim(), "7");
    let leftover = run(&gw, &id, "print(os.path.exists('.kernelgate-state'))").await?;
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
    run(&gw, &id, "x = 5\ngen = (i for i in range(3))").await?;
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
    run(&gw, &id, "seen = []").await?;
    gw.wait_pool("filled").await?;
    let (status, body) = hibernate(&gw, &id).await?;
    assert_eq!(status, 200, "{body}");
    let runs = (0..4).map(|n| {
        let (gw, id) = (&gw, id.clone());
        async move {
            // In the order they were sent.
            tokio::time::sleep(Duration::from_millis(50 * n)).await;
            gw.execute(&id, &format!("seen.append({n}); print(len(seen))"))
                .await
        }
    });
    let answers = futures::future::try_join_all(runs).await?;
    for answer in &answers {
        assert_eq!(answer["status"], "ok", "{answer}");
    }
    assert_eq!(run(&gw, &id, "print(seen)").await?.trim(), "[0, 1, 2, 3]");
    assert_eq!(resumes(&gw).await?, 1);
    // Files come back with the kernel: reading one wakes it too.
    run(&gw, &id, "open('kept.txt', 'w').write('still here')").await?;
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
    assert_eq!(text.trim(), "4", "{text}");
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
    run(&gw, &id, "answer = 41 + 1").await?;
    let (status, body) = hibernate(&gw, &id).await?;
    assert_eq!(status, 200, "{body}");
    let gw = gw.crash().await?.restart(&[]).await?;
    let listed = model(&gw, &id).await?;
    assert_eq!(listed["hibernated"], true, "{listed}");
    assert_eq!(run(&gw, &id, "print(answer)").await?.trim(), "42");
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
