//! Packages on demand, end to end under the runtime of the run: `kernelgate packages sync`
//! fills a wheelhouse from fixture wheels this test builds offline, and kernels install
//! allowlisted packages with `%pip`, `!pip`, `python -m pip`, the agent API and MCP, import
//! them in the same kernel at once, are refused anything else with a message that says what
//! to do (a refused `%pip install` fails its cell with the refusal), and every install is in
//! the audit trail. Installs survive hibernation, go with a
//! restart, hold when the home is full, and `%pip install` of allowed packages passes a
//! policy that denies shell commands while `!pip` does not. A wheel whose bytes changed at
//! its source under the same version is refused by the next sync and by kernels.

use anyhow::{ensure, Context, Result};
use kernelgate_client::mcp::McpCalls;
use kernelgate_tests::{Gateway, Outcome};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The host Python whose pip sync uses: the test venv's (`make test-tools`).
fn host_python() -> PathBuf {
    std::env::var_os("KERNELGATE_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-tests/bin/python"))
}

/// A wheelhouse synced from the fixture wheels for the kernel image.
struct Wheelhouse {
    dir: tempfile::TempDir,
    allowlist: PathBuf,
    wheelhouse: PathBuf,
    /// Whether the native-extension fixture could be built here.
    native: bool,
}

const ALLOWED: &str =
    "# fixtures\nkgfix-hello\nkgfix-app\nkgfix-usesnumpy\nkgfix-pth\nkgfix-oldnumpy\n";

impl Wheelhouse {
    fn new() -> Result<Wheelhouse> {
        let dir = tempfile::Builder::new().prefix("kg-wheelhouse").tempdir()?;
        let wheels = dir.path().join("fixture-wheels");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("packages/make_wheels.py");
        let built = std::process::Command::new(host_python())
            .arg(&script)
            .arg(&wheels)
            .output()
            .context("run make_wheels.py with the test venv's Python")?;
        ensure!(
            built.status.success(),
            "make_wheels.py: {}",
            String::from_utf8_lossy(&built.stderr)
        );
        let native = wheels
            .join("kgfix_native-1.0-cp311-cp311-linux_x86_64.whl")
            .exists();
        if !native {
            eprintln!("{}", String::from_utf8_lossy(&built.stdout).trim());
        }
        let allowlist = dir.path().join("allowed.txt");
        let mut text = ALLOWED.to_owned();
        if native {
            text.push_str("kgfix-native\n");
        }
        std::fs::write(&allowlist, text)?;
        let wheelhouse = dir.path().join("wheelhouse");
        let me = Wheelhouse {
            dir,
            allowlist,
            wheelhouse,
            native,
        };
        let out = me.sync(&kernelgate_tests::image())?;
        ensure!(
            out.status.success(),
            "sync failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(me)
    }

    /// `kernelgate packages sync` for `image` from the fixture wheels alone.
    fn sync(&self, image: &str) -> Result<std::process::Output> {
        Ok(std::process::Command::new(kernelgate_tests::binary())
            .args(["packages", "sync", "--packages"])
            .arg(&self.allowlist)
            .arg("--wheelhouse")
            .arg(&self.wheelhouse)
            .arg("--find-links")
            .arg(self.dir.path().join("fixture-wheels"))
            .args(["--image", image, "--python"])
            .arg(host_python())
            .args(kernelgate_tests::engine::command_flags(&[image])?)
            .output()?)
    }

    fn flags(&self) -> Vec<String> {
        vec![
            "--packages".into(),
            self.allowlist.display().to_string(),
            "--wheelhouse".into(),
            self.wheelhouse.display().to_string(),
        ]
    }

    /// The lock of the kernel image.
    fn lock(&self) -> Result<Value> {
        let text = std::fs::read_to_string(
            self.wheelhouse
                .join(kernelgate_tests::image_key()?)
                .join("lock.json"),
        )?;
        Ok(serde_json::from_str(&text)?)
    }
}

async fn gateway(w: &Wheelhouse, extra: &[&str]) -> Result<Gateway> {
    let mut flags: Vec<String> = w.flags();
    flags.extend(extra.iter().map(|s| s.to_string()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    Gateway::start(&flags).await
}

/// How long a cell that runs pip may take: a pip process starts in seconds alone, but far
/// slower in a gVisor sandbox on a machine running other suites beside this one.
const PIP: Duration = Duration::from_secs(180);

/// What a cell printed on stdout and stderr together.
fn printed(o: &Outcome) -> String {
    format!("{}{}", o.stdout, o.stderr)
}

#[tokio::test]
async fn allowed_packages_install_offline_and_import_in_the_same_kernel() -> Result<()> {
    let w = Wheelhouse::new()?;
    // A warm kernel: pooled kernels get the wheelhouse too.
    let gw = gateway(&w, &["--pool-size", "1"]).await?;
    gw.wait_pool("filled").await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("id")?;
    let mut ws = gw.channels(id, "packages").await?;

    // %pip: the package and what it needs, importable at once.
    let out = ws.execute_for("%pip install kgfix-app", PIP).await?;
    ensure!(out.status == "ok", "{out:?}");
    let text = printed(&out);
    assert!(
        text.contains("Successfully installed kgfix-app-2.0 kgfix-dep-0.3"),
        "{text}"
    );
    let out = ws
        .execute("import kgfix_app\nprint(kgfix_app.VALUE)")
        .await?;
    assert_eq!(out.stdout.trim(), "42", "{out:?}");

    // !pip, and python -m pip in a subprocess.
    let out = ws.execute_for("!pip install kgfix-hello", PIP).await?;
    assert!(
        printed(&out).contains("Successfully installed kgfix-hello-1.0"),
        "{out:?}"
    );
    let out = ws
        .execute("import kgfix_hello, importlib.metadata as m\nprint(kgfix_hello.greet(), m.version('kgfix-hello'))")
        .await?;
    assert_eq!(
        out.stdout.trim(),
        "hello from the wheelhouse 1.0",
        "{out:?}"
    );
    let out = ws
        .execute_for("import subprocess, sys\nr = subprocess.run([sys.executable, '-m', 'pip', 'install', 'kgfix-hello'], capture_output=True, text=True)\nprint(r.returncode, r.stdout)", PIP)
        .await?;
    assert!(out.stdout.starts_with("0 "), "{out:?}");
    assert!(
        out.stdout
            .contains("Requirement already satisfied: kgfix-hello"),
        "{out:?}"
    );
    // A later subprocess imports it too.
    let out = ws
        .execute("r = subprocess.run([sys.executable, '-c', 'import kgfix_app; print(kgfix_app.VALUE)'], capture_output=True, text=True)\nprint(r.stdout.strip(), r.stderr[-300:])")
        .await?;
    assert_eq!(out.stdout.trim(), "42", "{out:?}");

    // A dependency the image has is used from the image: nothing of numpy in the wheelhouse.
    let out = ws.execute_for("%pip install kgfix-usesnumpy", PIP).await?;
    assert!(
        printed(&out).contains("Successfully installed kgfix-usesnumpy-1.0"),
        "{out:?}"
    );
    let out = ws
        .execute("import kgfix_usesnumpy, numpy\nprint(kgfix_usesnumpy.TOTAL, numpy.__file__.startswith('/opt/kernel/venv'))")
        .await?;
    assert_eq!(out.stdout.trim(), "10 True", "{out:?}");
    let lock = w.lock()?;
    assert_eq!(
        lock["requirements"]["kgfix-usesnumpy"]["packages"],
        json!(["kgfix-usesnumpy"])
    );
    assert_eq!(lock["packages"]["numpy"]["in_image"], true, "{lock}");
    assert!(!std::fs::read_dir(w.wheelhouse.join("wheels"))?
        .any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with("numpy"))));

    // A compiled extension loads from the read-only tree (the home is noexec).
    if w.native {
        let out = ws
            .execute(
                "%pip install -q kgfix-native\nimport kgfix_native\nprint(kgfix_native.add(40, 2))",
            )
            .await?;
        assert!(out.stdout.trim().ends_with("42"), "{out:?}");
    }

    // Refusals: at once, naming the package and what an operator does.
    for (cell, name) in [
        ("%pip install kgfix-denied", "kgfix-denied"),
        ("!pip install requests", "requests"),
        ("%pip install kgfix-hello kgfix-denied", "kgfix-denied"),
    ] {
        let out = ws.execute_for(cell, Duration::from_secs(30)).await?;
        let text = printed(&out);
        assert!(
            text.contains(&format!(
                "'{name}' is not in this gateway's package allowlist"
            )),
            "{cell}: {text}"
        );
        assert!(text.contains("kernelgate packages add"), "{cell}: {text}");
        if cell.starts_with('%') {
            // The cell fails, so an agent reading its status sees it.
            assert_eq!(out.status, "error", "{cell}: {out:?}");
            let error = out.error.clone().unwrap_or_default();
            assert_eq!(error["ename"], "PipInstallRefused", "{cell}: {out:?}");
            assert!(
                error["evalue"]
                    .as_str()
                    .is_some_and(|e| e.contains(&format!(
                        "'{name}' is not in this gateway's package allowlist"
                    ))),
                "{cell}: {out:?}"
            );
        }
    }
    let out = ws.execute_for("%pip install kgfix-app==1.0", PIP).await?;
    assert!(printed(&out).contains("kgfix-app 2.0"), "{out:?}");
    // Wheels only: no source build, no URL.
    let out = ws.execute_for("!pip install ./local-dir", PIP).await?;
    assert!(
        printed(&out).contains("only allowlisted packages by name"),
        "{out:?}"
    );
    ws.close().await?;

    // What one kernel installed is its own: another kernel of the same gateway, with the same
    // wheelhouse mounted, cannot import it until it installs it itself.
    let other = gw.create_kernel().await?;
    let other_id = other["id"].as_str().context("id")?;
    let mut other_ws = gw.channels(other_id, "packages-other").await?;
    let out = other_ws.execute("import kgfix_app").await?;
    assert_eq!(out.status, "error", "{out:?}");
    assert_eq!(
        out.error.clone().unwrap_or_default()["ename"],
        "ModuleNotFoundError",
        "{out:?}"
    );
    other_ws.close().await?;

    // The audit trail: each install the kernel reported, before its cell's record, untrusted.
    let log = kernelgate_tests::audit_values(&gw.audit_log)?;
    let reported: Vec<&Value> = log
        .iter()
        .filter(|r| r["event"] == "packages_reported")
        .collect();
    let first = reported.first().context("no packages_reported record")?;
    assert_eq!(first["trusted"], false);
    assert_eq!(first["kernel"], id);
    assert_eq!(first["requested"], json!(["kgfix-app"]));
    assert_eq!(
        first["installed"],
        json!([{"name": "kgfix-dep", "version": "0.3"}, {"name": "kgfix-app", "version": "2.0"}])
    );
    let at = |r: &Value| log.iter().position(|x| x == r).unwrap_or_default();
    let finished = log
        .iter()
        .position(|r| r["event"] == "execution_finished" && r["msg_id"] == first["msg_id"])
        .context("the cell's record")?;
    assert!(
        at(first) < finished,
        "the report comes before its cell's record"
    );
    assert!(reported
        .iter()
        .any(|r| r["refused"][0]["requirement"] == "kgfix-denied"));
    gw.stop().await?;
    Ok(())
}

#[tokio::test]
async fn agents_list_and_install_packages_through_the_agent_api_and_mcp() -> Result<()> {
    let w = Wheelhouse::new()?;
    let gw = gateway(&w, &[]).await?;
    let (status, listing) = gw.get_json("/api/kernelgate/packages").await?;
    assert_eq!(status, 200, "{listing}");
    let hello = listing["packages"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["name"] == "kgfix-hello"))
        .context("kgfix-hello listed")?;
    assert_eq!(hello["versions"], json!(["1.0"]));
    assert_eq!(hello["summary"], "Says hello");
    assert_eq!(hello["synced"], true);
    let app = listing["packages"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["name"] == "kgfix-app"))
        .context("kgfix-app listed")?;
    assert_eq!(app["brings"], json!(["kgfix-app", "kgfix-dep"]));
    let pth = listing["packages"]
        .as_array()
        .and_then(|p| p.iter().find(|p| p["name"] == "kgfix-pth"))
        .context("kgfix-pth listed")?;
    assert_eq!(
        pth["synced"], false,
        "a wheel with a .pth file is refused at sync"
    );
    let (status, _) = gw
        .get_json("/api/kernelgate/packages?kernel_name=nope")
        .await?;
    assert_eq!(status, 404);

    // The agent API.
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("id")?;
    let path = format!("/api/kernels/{id}/packages");
    let (status, done) = gw
        .post_json(&path, json!({"packages": ["kgfix-app"]}))
        .await?;
    assert_eq!(status, 200, "{done}");
    assert_eq!(
        done["installed"],
        json!([{"name": "kgfix-dep", "version": "0.3"}, {"name": "kgfix-app", "version": "2.0"}])
    );
    let answer = gw
        .execute(id, "import kgfix_app\nprint(kgfix_app.VALUE)")
        .await?;
    assert_eq!(answer["stdout"], "42\n", "{answer}");
    let (status, again) = gw
        .post_json(&path, json!({"packages": ["kgfix-app", "numpy"]}))
        .await?;
    assert_eq!(status, 200, "{again}");
    assert!(
        again["installed"].as_array().is_some_and(Vec::is_empty),
        "{again}"
    );
    let already: Vec<&str> = again["already"]
        .as_array()
        .map(|a| a.iter().filter_map(|p| p["name"].as_str()).collect())
        .unwrap_or_default();
    assert!(
        already.contains(&"kgfix-app") && already.contains(&"numpy"),
        "{again}"
    );
    let (status, refused) = gw
        .post_json(&path, json!({"packages": ["kgfix-hello", "kgfix-denied"]}))
        .await?;
    assert_eq!(status, 422, "{refused}");
    assert!(
        refused["message"]
            .as_str()
            .unwrap_or_default()
            .contains("kgfix-denied"),
        "{refused}"
    );
    assert_eq!(refused["refused"][0]["requirement"], "kgfix-denied");
    let answer = gw.execute(id, "import kgfix_hello").await?;
    assert_eq!(answer["status"], "error", "all or nothing: {answer}");
    let (status, bad) = gw
        .post_json(&path, json!({"packages": ["--index-url=http://x"]}))
        .await?;
    assert_eq!(status, 400, "{bad}");

    // MCP.
    let mut mcp = McpCalls::new(gw.client());
    let kernel_id = mcp.start_kernel().await?;
    let result = mcp
        .call_tool(
            "install_packages",
            json!({"packages": ["kgfix-hello"], "kernel_id": kernel_id}),
        )
        .await?;
    assert_ne!(result["isError"], true, "{result}");
    assert!(
        result["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .contains("kgfix-hello 1.0"),
        "{result}"
    );
    assert_eq!(
        result["structuredContent"]["installed"][0]["name"],
        "kgfix-hello"
    );
    assert_eq!(
        mcp.run_python(&kernel_id, "import kgfix_hello\nkgfix_hello.greet()")
            .await?,
        "'hello from the wheelhouse'"
    );
    let result = mcp
        .call_tool(
            "install_packages",
            json!({"packages": ["kgfix-denied"], "kernel_id": kernel_id}),
        )
        .await?;
    assert_eq!(result["isError"], true, "{result}");
    assert!(
        result["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .contains("not in this gateway's package allowlist"),
        "{result}"
    );

    let installed = gw.audited("packages_installed")?;
    assert_eq!(installed.len(), 5, "{installed:?}");
    assert_eq!(installed[0]["kernel"], id);
    assert_eq!(installed[0]["requested"], json!(["kgfix-app"]));
    // The gateway vouches for the request and the allowlist line that let it through; what
    // was installed is the kernel's word, and filed as such.
    assert_eq!(
        installed[0]["allowed"],
        json!(["kgfix-app"]),
        "{installed:?}"
    );
    assert_eq!(installed[0].get("installed"), None, "{installed:?}");
    let reported = &installed[0]["kernel_reported"];
    assert_eq!(
        reported["installed"][1],
        json!({"name": "kgfix-app", "version": "2.0"})
    );
    assert_eq!(reported["exit_code"], 0);
    assert!(installed[0]["key"].is_string());
    assert_eq!(
        installed[1]["kernel_reported"]["already"][2]["name"],
        "numpy"
    );
    assert_eq!(
        installed[2]["allowed"],
        json!(["kgfix-hello"]),
        "{installed:?}"
    );
    assert_eq!(installed[4]["allowed"], json!([]), "{installed:?}");
    assert_eq!(
        installed[2]["kernel_reported"]["refused"][0]["requirement"],
        "kgfix-denied"
    );
    assert_eq!(installed[3]["kernel"], kernel_id);
    assert_eq!(
        installed[4]["kernel_reported"]["refused"][0]["requirement"],
        "kgfix-denied"
    );
    gw.stop().await?;
    Ok(())
}

#[tokio::test]
async fn sync_refuses_what_kernels_must_not_get_and_says_why() -> Result<()> {
    let w = Wheelhouse::new()?;
    let lock = w.lock()?;
    let refused = lock["refused"].as_array().context("refused")?;
    let reason = |name: &str| {
        refused
            .iter()
            .find(|r| r["requirement"] == name)
            .and_then(|r| r["reason"].as_str())
            .map(str::to_owned)
    };
    assert!(
        reason("kgfix-pth").is_some_and(|r| r.contains(".pth")),
        "{lock}"
    );
    assert!(
        reason("kgfix-oldnumpy").is_some_and(|r| r.contains("numpy")),
        "{lock}"
    );
    assert!(lock["requirements"].get("kgfix-pth").is_none());
    // Every synced wheel is unpacked and checked against its hash.
    for (name, p) in lock["packages"].as_object().context("packages")? {
        if p["in_image"] == true {
            continue;
        }
        let wheel = w
            .wheelhouse
            .join("wheels")
            .join(p["wheel"].as_str().context("wheel")?);
        let digest = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(std::fs::read(
            &wheel,
        )?));
        assert_eq!(p["sha256"], digest, "{name}");
        let id = lock["image_id"]
            .as_str()
            .context("image_id")?
            .trim_start_matches("sha256:");
        assert!(w
            .wheelhouse
            .join(&id[..12])
            .join(p["dir"].as_str().context("dir")?)
            .is_dir());
    }
    // Compiled for the image's Python: kernels never compile from source.
    let id = lock["image_id"]
        .as_str()
        .context("image_id")?
        .trim_start_matches("sha256:");
    assert!(w
        .wheelhouse
        .join(&id[..12])
        .join("kgfix-hello-1.0/kgfix_hello/__pycache__/__init__.cpython-311.pyc")
        .is_file());
    // A second sync fetches nothing and keeps the lock's packages.
    let again = w.sync(&kernelgate_tests::image())?;
    assert!(again.status.success());
    assert_eq!(w.lock()?["packages"], lock["packages"]);

    // A kernel meets the refusals as pip users expect.
    let gw = gateway(&w, &[]).await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("id")?;
    let mut ws = gw.channels(id, "refusals").await?;
    let out = ws.execute("%pip install kgfix-pth").await?;
    assert!(printed(&out).contains("not synced"), "{out:?}");

    // Allowed after a SIGHUP but not synced yet: it says so.
    let mut text = std::fs::read_to_string(&w.allowlist)?;
    text.push_str("kgfix-denied\n");
    std::fs::write(&w.allowlist, text)?;
    let pid = gw.pid().context("pid")?;
    let sent = std::process::Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()?;
    assert!(sent.success());
    let mut said = String::new();
    for _ in 0..50 {
        said = printed(&ws.execute("%pip install kgfix-denied").await?);
        if said.contains("not synced") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(said.contains("allowed but not synced"), "{said}");

    // A full home: a clear message, nothing half-done, the kernel alive.
    let out = ws
        .execute_for(
            "import os\nf = open('filler', 'wb')\ntry:\n    while True:\n        f.write(b'x' * (1 << 20))\nexcept OSError as e:\n    print('full', e.errno)\nf.close()",
            Duration::from_secs(120),
        )
        .await?;
    assert!(out.stdout.contains("full 28"), "{out:?}");
    let out = ws.execute("%pip install kgfix-hello").await?;
    assert!(
        printed(&out).contains("No space left in the kernel's home"),
        "{out:?}"
    );
    let out = ws
        .execute("import os\nos.remove('filler')\nimport kgfix_hello")
        .await?;
    assert_eq!(out.status, "error", "nothing was installed: {out:?}");
    let out = ws
        .execute("%pip install kgfix-hello\nimport kgfix_hello\nprint(kgfix_hello.greet())")
        .await?;
    assert!(
        out.stdout.trim().ends_with("hello from the wheelhouse"),
        "{out:?}"
    );
    ws.close().await?;
    gw.stop().await?;
    Ok(())
}

/// The sha256 of a file, as the lock writes it.
fn sha256_file(path: &Path) -> Result<String> {
    Ok(hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
        std::fs::read(path).with_context(|| path.display().to_string())?,
    )))
}

#[tokio::test]
async fn a_wheel_whose_bytes_changed_under_its_version_is_refused_end_to_end() -> Result<()> {
    let w = Wheelhouse::new()?;
    let before = w.lock()?;
    let hello = &before["packages"]["kgfix-hello"];
    let hello_sha = hello["sha256"].as_str().context("sha256")?.to_owned();
    let hello_wheel = w
        .wheelhouse
        .join("wheels")
        .join(hello["wheel"].as_str().context("wheel")?);
    let tree = w
        .wheelhouse
        .join(kernelgate_tests::image_key()?)
        .join(hello["dir"].as_str().context("dir")?);
    // The source replaces kgfix-hello 1.0 with other bytes under the same name and version.
    let source = w
        .dir
        .path()
        .join("fixture-wheels")
        .join("kgfix_hello-1.0-py3-none-any.whl");
    let swapped = std::process::Command::new(host_python())
        .args([
            "-c",
            r#"
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    files = {i.filename: z.read(i) for i in z.infolist()}
files["kgfix_hello/__init__.py"] = b"def greet():\n    return 'swapped'\n"
with zipfile.ZipFile(sys.argv[1], "w") as z:
    for name, data in files.items():
        z.writestr(name, data)
"#,
        ])
        .arg(&source)
        .output()?;
    ensure!(
        swapped.status.success(),
        "{}",
        String::from_utf8_lossy(&swapped.stderr)
    );
    let new_sha = sha256_file(&source)?;
    assert_ne!(new_sha, hello_sha);
    // And the wheelhouse's own copy of kgfix-app's wheel is damaged.
    let app = &before["packages"]["kgfix-app"];
    let app_wheel = w
        .wheelhouse
        .join("wheels")
        .join(app["wheel"].as_str().context("wheel")?);
    let mut damaged = std::fs::read(&app_wheel)?;
    damaged.extend_from_slice(b"damage");
    std::fs::write(&app_wheel, damaged)?;

    let out = w.sync(&kernelgate_tests::image())?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let after = w.lock()?;
    let reason = after["refused"]
        .as_array()
        .context("refused")?
        .iter()
        .find(|r| r["requirement"] == "kgfix-hello")
        .and_then(|r| r["reason"].as_str())
        .map(str::to_owned)
        .with_context(|| format!("kgfix-hello is not refused: {after}"))?;
    assert!(
        reason.contains(&new_sha) && reason.contains(&hello_sha) && reason.contains("delete"),
        "{reason}"
    );
    assert!(stdout.contains("refused kgfix-hello:"), "{stdout}");
    assert!(
        after["requirements"].get("kgfix-hello").is_none(),
        "{after}"
    );
    // Nothing of the new bytes entered the wheelhouse; the tree is the one of the old bytes.
    assert_eq!(sha256_file(&hello_wheel)?, hello_sha);
    let module = std::fs::read_to_string(tree.join("kgfix_hello/__init__.py"))?;
    assert!(module.contains("hello from the wheelhouse"), "{module}");
    // The damaged copy is not used: fetched again from its source, as locked before.
    assert_eq!(
        sha256_file(&app_wheel)?,
        app["sha256"].as_str().context("sha256")?
    );
    assert_eq!(after["packages"]["kgfix-app"], *app);

    // A kernel cannot install it, and its cell says why.
    let gw = gateway(&w, &[]).await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("id")?;
    let mut ws = gw.channels(id, "swapped").await?;
    let out = ws
        .execute_for("%pip install kgfix-hello", Duration::from_secs(30))
        .await?;
    assert_eq!(out.status, "error", "{out:?}");
    let error = out.error.clone().unwrap_or_default();
    assert_eq!(error["ename"], "PipInstallRefused", "{out:?}");
    assert!(
        error["evalue"]
            .as_str()
            .is_some_and(|e| e.contains("sha256")),
        "{out:?}"
    );
    let out = ws.execute("import kgfix_hello").await?;
    assert_eq!(out.status, "error", "nothing was installed: {out:?}");
    ws.close().await?;
    gw.stop().await?;

    // Taking the new bytes on purpose: delete the tree, as the reason says, and sync again.
    std::fs::remove_dir_all(&tree)?;
    let out = w.sync(&kernelgate_tests::image())?;
    assert!(out.status.success());
    let taken = w.lock()?;
    assert_eq!(
        taken["packages"]["kgfix-hello"]["sha256"],
        new_sha.as_str(),
        "{taken}"
    );
    assert!(
        taken["requirements"].get("kgfix-hello").is_some(),
        "{taken}"
    );
    let module = std::fs::read_to_string(tree.join("kgfix_hello/__init__.py"))?;
    assert!(module.contains("swapped"), "{module}");
    Ok(())
}

#[tokio::test]
async fn installs_survive_hibernation_and_go_with_a_restart() -> Result<()> {
    let w = Wheelhouse::new()?;
    let hibernated = format!("{}", tempfile::tempdir()?.keep().display());
    let gw = gateway(&w, &["--hibernate-dir", &hibernated]).await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("id")?;
    let (status, done) = gw
        .post_json(
            &format!("/api/kernels/{id}/packages"),
            json!({"packages": ["kgfix-app"]}),
        )
        .await?;
    assert_eq!(status, 200, "{done}");
    let answer = gw
        .execute(id, "import kgfix_app\nv = kgfix_app.VALUE")
        .await?;
    assert_eq!(answer["status"], "ok", "{answer}");
    let (status, model) = gw
        .post_json(&format!("/api/kernels/{id}/hibernate"), json!({}))
        .await?;
    assert_eq!(status, 200, "{model}");
    let answer = gw
        .execute(id, "import kgfix_dep\nprint(v, kgfix_dep.BASE)")
        .await?;
    assert_eq!(answer["stdout"], "42 21\n", "{answer}");

    // A restart starts afresh: files and installs are gone, and installing works again.
    let (status, _) = gw
        .post_json(&format!("/api/kernels/{id}/restart"), json!({}))
        .await?;
    assert_eq!(status, 200);
    let answer = gw.execute(id, "import kgfix_app").await?;
    assert_eq!(answer["status"], "error", "{answer}");
    assert!(
        answer.to_string().contains("ModuleNotFoundError"),
        "{answer}"
    );
    let mut ws = gw.channels(id, "after-restart").await?;
    let out = ws
        .execute("%pip install kgfix-app\nimport kgfix_app\nprint(kgfix_app.VALUE)")
        .await?;
    assert!(out.stdout.trim().ends_with("42"), "{out:?}");
    ws.close().await?;
    gw.stop().await?;
    let _ = std::fs::remove_dir_all(&hibernated);
    Ok(())
}

#[tokio::test]
async fn pip_magic_of_allowed_packages_passes_a_policy_that_denies_shell_commands() -> Result<()> {
    let w = Wheelhouse::new()?;
    let policy = w.dir.path().join("policy.toml");
    std::fs::write(
        &policy,
        "[[rule]]\naction = \"deny\"\nshell = true\nreason = \"no shell commands here\"\n",
    )?;
    let gw = gateway(&w, &["--policy", &policy.display().to_string()]).await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("id")?;
    let mut ws = gw.channels(id, "policy").await?;
    let out = ws.execute("%pip install kgfix-hello").await?;
    assert_eq!(out.status, "ok", "{out:?}");
    assert!(
        printed(&out).contains("Successfully installed kgfix-hello-1.0"),
        "{out:?}"
    );
    for cell in [
        "!pip install kgfix-app",
        "%pip install kgfix-denied",
        "%pip install kgfix-app; ls",
    ] {
        let out = ws.execute(cell).await?;
        assert_eq!(out.status, "error", "{cell}: {out:?}");
        let error = out.error.clone().unwrap_or_default();
        assert_eq!(error["ename"], "PolicyViolation", "{cell}: {out:?}");
    }
    // What installed packages are used for is still checked.
    let out = ws
        .execute("import kgfix_hello, os\nos.system('id')")
        .await?;
    assert_eq!(out.status, "ok", "calls are not in this policy: {out:?}");
    ws.close().await?;
    gw.stop().await?;
    Ok(())
}

#[tokio::test]
async fn a_kernel_container_mounts_the_wheelhouse_and_the_installer_read_only() -> Result<()> {
    let w = Wheelhouse::new()?;
    let gw = gateway(&w, &[]).await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("id")?;
    let binds: Vec<String> = gw
        .sandbox(id)?
        .binds
        .iter()
        .map(|b| {
            let mode = if b.read_only { "ro" } else { "rw" };
            format!("{}:{}:{mode}", b.host, b.sandbox)
        })
        .collect();
    let image_id = kernelgate_tests::image_key()?;
    assert_eq!(binds.len(), 3, "{binds:?}");
    assert!(
        binds[0].starts_with(&format!("{}/", gw.runtime_dir.display()))
            && binds[0].ends_with(":/run/kernel:rw"),
        "{binds:?}"
    );
    assert_eq!(
        binds[1..],
        [
            format!(
                "{}:/opt/kernelgate/packages:ro",
                w.wheelhouse.join(image_id).display()
            ),
            format!(
                "{}/packages:/opt/kernelgate/python:ro",
                gw.runtime_dir.display()
            ),
        ]
    );
    // The kernel can read them but not change them.
    let answer = gw
        .execute(id, "import errno, os\nfor p in ('/opt/kernelgate/packages/x', '/opt/kernelgate/python/allowed/x'):\n    try:\n        open(p, 'w')\n    except OSError as e:\n        print(e.errno in (errno.EROFS, errno.EACCES))")
        .await?;
    // runc says EROFS, gVisor EACCES.
    assert_eq!(answer["stdout"], "True\nTrue\n", "{answer}");
    gw.stop().await?;
    Ok(())
}

/// Whether pip's failure says no package index could be reached (then the test is skipped).
/// Only connection failures count: "No matching distribution" from an index that answered
/// is a failure of the sync, never a reason to skip.
fn unreachable_index(stderr: &str) -> bool {
    [
        "NewConnectionError",
        "Max retries exceeded",
        "Temporary failure in name resolution",
        "Network is unreachable",
        "Connection refused",
        "ProxyError",
        "timed out",
    ]
    .iter()
    .any(|needle| stderr.contains(needle))
}

#[tokio::test]
async fn sync_fetches_a_real_package_from_the_package_index() -> Result<()> {
    let dir = tempfile::Builder::new().prefix("kg-index").tempdir()?;
    let allowlist = dir.path().join("allowed.txt");
    let wheelhouse = dir.path().join("wheelhouse");
    // On this run's engine, as every command below (the image is read through it).
    let engine = kernelgate_tests::engine::command_flags(&[&kernelgate_tests::image()])?;
    let cli = |args: &[&str]| {
        std::process::Command::new(kernelgate_tests::binary())
            .arg("packages")
            .args(args)
            .arg("--packages")
            .arg(&allowlist)
            .args(&engine)
            .output()
    };
    // The operator's commands edit the allowlist. The package is one the image lacks, so the
    // sync must fetch it.
    assert!(cli(&["add", "six", "kgfix-gone==1"])?.status.success());
    assert!(cli(&["remove", "kgfix-gone"])?.status.success());
    let dup = cli(&["add", "SIX>=1"])?;
    assert!(!dup.status.success());
    assert!(String::from_utf8_lossy(&dup.stderr).contains("allowed already"));
    assert_eq!(std::fs::read_to_string(&allowlist)?, "six\n");

    let out = std::process::Command::new(kernelgate_tests::binary())
        .args(["packages", "sync", "--packages"])
        .arg(&allowlist)
        .arg("--wheelhouse")
        .arg(&wheelhouse)
        .args(["--image", &kernelgate_tests::image(), "--python"])
        .arg(host_python())
        .args(&engine)
        // Fail fast when there is no index instead of retrying for minutes.
        .env("PIP_RETRIES", "0")
        .env("PIP_DEFAULT_TIMEOUT", "20")
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() || String::from_utf8_lossy(&out.stdout).contains("refused six") {
        // The sync keeps only pip's errors; pip's own warnings say whether any index
        // answered: ask it once more, directly.
        let probe = std::process::Command::new(host_python())
            .args(["-m", "pip", "download", "--no-deps", "--dest"])
            .arg(dir.path().join("probe"))
            .arg("six")
            .env("PIP_RETRIES", "0")
            .env("PIP_DEFAULT_TIMEOUT", "20")
            .output()?;
        let probed = String::from_utf8_lossy(&probe.stderr);
        if !probe.status.success() && unreachable_index(&probed) {
            eprintln!("SKIPPED: no package index is reachable from this machine, so the real sync was not checked:\n{stderr}\n{probed}");
            return Ok(());
        }
        anyhow::bail!(
            "sync failed: {}\n{stderr}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    assert!(stderr.contains("Resolving six"), "{stderr}");
    assert!(stderr.contains("Fetched 1 wheel"), "{stderr}");
    let listed = cli(&[
        "list",
        "--wheelhouse",
        &wheelhouse.display().to_string(),
        "--image",
        &kernelgate_tests::image(),
    ])?;
    let listed = String::from_utf8_lossy(&listed.stdout);
    let line = listed
        .lines()
        .find(|l| l.starts_with("six"))
        .context("six listed")?;
    let version = line
        .split_whitespace()
        .nth(1)
        .context("version")?
        .to_owned();
    assert!(version.starts_with('1'), "{listed}");

    let gw = Gateway::start(&[
        "--packages",
        &allowlist.display().to_string(),
        "--wheelhouse",
        &wheelhouse.display().to_string(),
    ])
    .await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("id")?;
    let mut ws = gw.channels(id, "index").await?;
    let out = ws
        .execute("%pip install six\nimport six\nprint(six.__version__)")
        .await?;
    assert!(
        printed(&out).contains(&format!("Successfully installed six-{version}")),
        "{out:?}"
    );
    assert!(out.stdout.trim().ends_with(&version), "{out:?}");
    ws.close().await?;
    gw.stop().await?;
    Ok(())
}

#[tokio::test]
async fn a_derived_image_has_its_own_lock_and_allowlist() -> Result<()> {
    let w = Wheelhouse::new()?;
    let fixture = kernelgate_tests::fixture_image()?;
    let derived_list = w.dir.path().join("derived.txt");
    std::fs::write(&derived_list, "kgfix-hello\n")?;
    let flags = |spec_list: &str| {
        vec![
            "--kernelspec".to_owned(),
            format!("fixture={fixture}"),
            "--packages".to_owned(),
            w.allowlist.display().to_string(),
            "--packages".to_owned(),
            format!("fixture={spec_list}"),
            "--wheelhouse".to_owned(),
            w.wheelhouse.display().to_string(),
        ]
    };
    let list = derived_list.display().to_string();
    let args = flags(&list);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let gw = Gateway::start(&args).await?;
    let (status, model) = gw
        .post_json("/api/kernels", json!({"name": "fixture"}))
        .await?;
    assert_eq!(status, 201, "{model}");
    let id = model["id"].as_str().context("id")?;
    let path = format!("/api/kernels/{id}/packages");
    // Nothing synced for this image yet: its own lock, its own allowlist.
    let (status, refused) = gw
        .post_json(&path, json!({"packages": ["kgfix-hello"]}))
        .await?;
    assert_eq!(status, 422, "{refused}");
    assert!(
        refused["message"]
            .as_str()
            .unwrap_or_default()
            .contains("not synced"),
        "{refused}"
    );
    let (status, refused) = gw
        .post_json(&path, json!({"packages": ["kgfix-app"]}))
        .await?;
    assert_eq!(status, 422, "{refused}");
    assert!(
        refused["message"]
            .as_str()
            .unwrap_or_default()
            .contains("not in this gateway's package allowlist"),
        "{refused}"
    );
    // Synced for the derived image while the kernel runs: it installs at once.
    let out = std::process::Command::new(kernelgate_tests::binary())
        .args(["packages", "sync", "--packages"])
        .arg(&derived_list)
        .arg("--wheelhouse")
        .arg(&w.wheelhouse)
        .arg("--find-links")
        .arg(w.dir.path().join("fixture-wheels"))
        .args(["--image", &fixture, "--python"])
        .arg(host_python())
        .args(kernelgate_tests::engine::command_flags(&[&fixture])?)
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (status, done) = gw
        .post_json(&path, json!({"packages": ["kgfix-hello"]}))
        .await?;
    assert_eq!(status, 200, "{done}");
    let answer = gw
        .execute(id, "import kgfix_hello\nprint(kgfix_hello.greet())")
        .await?;
    assert_eq!(answer["stdout"], "hello from the wheelhouse\n", "{answer}");
    let (status, listing) = gw
        .get_json("/api/kernelgate/packages?kernel_name=fixture")
        .await?;
    assert_eq!(status, 200);
    assert_eq!(listing["image"], fixture.as_str());
    assert_eq!(
        listing["packages"].as_array().map(Vec::len),
        Some(1),
        "{listing}"
    );
    gw.stop().await?;
    Ok(())
}
