//! End to end under `--engine gvisor`: the gateway runs kernels in runsc sandboxes itself,
//! from the image store, with no container of Docker's. Needs root and runsc (`make
//! gvisor`); the image is saved from Docker once and imported with `kernelgate image import`.

use anyhow::{bail, ensure, Context, Result};
use kernelgate_tests::{image, Gateway};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The engine's suite runs once, beside the Docker suite under gVisor (`make e2e-gvisor`):
/// the engine does not take Docker's runtime.
fn skipped() -> bool {
    if kernelgate_tests::runtime() != "runsc" {
        eprintln!("skipped: the gVisor engine's suite runs with the suite under gVisor");
        return true;
    }
    false
}

/// The image store holding `image` (filled from Docker by the harness).
fn image_store(image: &str) -> Result<PathBuf> {
    kernelgate_tests::engine::image_store(&[image])
}

/// The sandboxes runsc knows under the gateway's root.
fn runsc_sandboxes(runtime_dir: &Path) -> Result<Vec<String>> {
    Ok(kernelgate_tests::engine::runsc_sandboxes(runtime_dir)?
        .into_iter()
        .map(|(id, _)| id)
        .collect())
}

/// A gateway on the engine, with `image` in the tests' image store, plus `extra` flags.
async fn on_engine(image: &str, extra: &[&str]) -> Result<Gateway> {
    let images = image_store(image)?;
    let images = images.display().to_string();
    let mut flags = vec!["--engine", "gvisor", "--image-store", images.as_str()];
    flags.extend_from_slice(extra);
    Gateway::start(&flags).await
}

/// Stops the gateway (its kernels go) and removes its runtime directory.
async fn stop_and_clean(gw: Gateway) -> Result<()> {
    let runtime_dir = gw.runtime_dir.clone();
    gw.stop().await?;
    let _ = std::fs::remove_dir_all(&runtime_dir);
    Ok(())
}

/// Runs `setup` in kernel `id`, then asks it to hibernate: refused (409), naming `names`.
async fn hibernation_refused(gw: &Gateway, id: &str, setup: &str, names: &str) -> Result<()> {
    gw.execute(id, setup).await?;
    let (status, refused) = gw
        .post_json(
            &format!("/api/kernels/{id}/hibernate"),
            serde_json::json!({}),
        )
        .await?;
    assert_eq!(status, 409, "{refused}");
    let message = refused["message"].as_str().unwrap_or_default();
    ensure!(message.contains(names), "names {names:?}: {refused}");
    Ok(())
}

async fn stdout_of(gw: &Gateway, id: &str, code: &str) -> Result<String> {
    let answer = gw.execute(id, code).await?;
    match answer["stdout"].as_str() {
        Some(out) => Ok(out.to_owned()),
        None => bail!("no stdout for {code:?}: {answer}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_runs_in_a_runsc_sandbox_without_docker() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let images = image_store(&image())?;
    let images = images.display().to_string();
    // The gateway runs in a mount namespace of its own in which /run is an empty tmpfs: no
    // Docker socket exists there, so nothing it does can go through Docker. Its runtime
    // directory is outside /run, for the test to look into.
    let runtime_dir = std::env::temp_dir().join(format!(
        "kg-engine-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    let runtime_flag = runtime_dir.display().to_string();
    let gw = Gateway::start_through(
        &[
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs -o size=1m kernelgate-no-docker /run && exec \"$@\"",
            "sh",
        ],
        &[
            "--engine",
            "gvisor",
            "--image-store",
            &images,
            "--kernel-disk-mb",
            "256",
            "--runtime-dir",
            &runtime_flag,
        ],
    )
    .await?;
    let pid = gw.pid().context("the gateway's pid")?;
    // (/var/run is a link to /run, which a path through /proc/PID/root would follow on
    // this side.)
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    assert!(Path::new("/run/docker.sock").exists(), "Docker serves here");
    assert!(
        !root.join("run/docker.sock").exists(),
        "the Docker socket exists in the gateway's mount namespace"
    );
    assert_eq!(
        std::fs::read_link(root.join("var/run"))?,
        Path::new("/run"),
        "/var/run leads to the hidden /run"
    );
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("kernel id")?.to_owned();
    // Docker holds no container of this gateway's.
    let containers = Command::new("docker")
        .args(["ps", "-aq", "--filter"])
        .arg(format!("label=org.kernelgate.runtime_dir={runtime_flag}"))
        .output()?;
    assert_eq!(String::from_utf8_lossy(&containers.stdout).trim(), "");

    gw.execute(&id, "x = 1").await?;
    assert_eq!(stdout_of(&gw, &id, "print(x + 1)").await?, "2\n");
    assert_eq!(
        stdout_of(&gw, &id, "import os; print(os.getuid(), os.getgid())").await?,
        "1000 1000\n",
        "the kernel's user"
    );
    assert_eq!(
        stdout_of(&gw, &id, "print(os.statvfs('/').f_flag & os.ST_RDONLY)").await?,
        "1\n",
        "a read-only root"
    );
    let interfaces = stdout_of(
        &gw,
        &id,
        "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))",
    )
    .await?;
    assert_eq!(interfaces, "['lo']\n", "only loopback");
    let status = stdout_of(
        &gw,
        &id,
        "print(*[l.split(':')[1].strip() for l in open('/proc/self/status') \
           if l.split(':')[0] in ('CapEff', 'CapBnd', 'CapPrm', 'Seccomp')], \
           __import__('ctypes').CDLL(None).prctl(39, 0, 0, 0, 0))",
    )
    .await?;
    assert_eq!(
        status, "0000000000000000 0000000000000000 0000000000000000 2 1\n",
        "no capabilities, no new privileges, the launcher's syscall filter"
    );
    let sizes = stdout_of(
        &gw,
        &id,
        "print(*[os.statvfs(p).f_blocks * os.statvfs(p).f_frsize >> 20 for p in ('/tmp', '.')])",
    )
    .await?;
    assert_eq!(sizes, "64 256\n", "bounded /tmp and home");
    assert_eq!(
        runsc_sandboxes(&gw.runtime_dir)?.len(),
        1,
        "one sandbox, under the gateway's runsc root"
    );

    assert_eq!(gw.delete_kernel(&id).await?, 204);
    assert_eq!(
        runsc_sandboxes(&gw.runtime_dir)?,
        Vec::<String>::new(),
        "no sandbox left behind"
    );
    let engine_dir = gw.runtime_dir.join("gvisor");
    assert!(
        !engine_dir.exists(),
        "no bundle left, nor the engine's directories"
    );
    stop_and_clean(gw).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_hold_from_the_host_cgroup_and_an_out_of_memory_death_is_named() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let images = image_store(&image())?;
    let images = images.display().to_string();
    let gw = Gateway::start(&[
        "--engine",
        "gvisor",
        "--image-store",
        &images,
        "--kernel-memory-mb",
        "256",
        "--kernel-cpus",
        "0.5",
    ])
    .await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("kernel id")?.to_owned();
    gw.execute(&id, "x = 1").await?;
    let sandboxes = runsc_sandboxes(&gw.runtime_dir)?;
    let [sandbox] = sandboxes.as_slice() else {
        bail!("one sandbox: {sandboxes:?}")
    };
    let read = |controller: &str, file: &str| -> Result<String> {
        let path = format!("/sys/fs/cgroup/{controller}/kernelgate/{sandbox}/{file}");
        Ok(std::fs::read_to_string(&path)
            .with_context(|| path.clone())?
            .trim()
            .to_owned())
    };
    assert_eq!(
        read("memory", "memory.limit_in_bytes")?,
        (256u64 << 20).to_string()
    );
    assert_eq!(read("cpu", "cpu.cfs_quota_us")?, "50000");
    assert_eq!(read("cpu", "cpu.cfs_period_us")?, "100000");
    assert_eq!(read("pids", "pids.max")?, "256");

    let answer = gw
        .execute(
            &id,
            "import time\nblob = bytearray(512 << 20)\ntime.sleep(30)",
        )
        .await?;
    assert_eq!(answer["status"], "error", "{answer}");
    assert_eq!(answer["error"]["ename"], "KernelDied", "{answer}");
    assert!(
        answer["error"]["evalue"]
            .as_str()
            .is_some_and(|e| e.contains("ran out of memory (limit 256 MiB)")),
        "{answer}"
    );
    assert_eq!(gw.delete_kernel(&id).await?, 204);
    let runtime_dir = gw.runtime_dir.clone();
    gw.stop().await?;
    assert_eq!(runsc_sandboxes(&runtime_dir)?, Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&runtime_dir);
    Ok(())
}

/// `kernelgate serve --engine gvisor` with `extra`, as `setpriv` args say: what it printed
/// on stderr, once it exited (it must, at once).
fn refused(setpriv: &[&str], extra: &[&str]) -> Result<String> {
    let binary = kernelgate_tests::binary();
    let mut cmd = if setpriv.is_empty() {
        Command::new(&binary)
    } else {
        let mut c = Command::new("setpriv");
        c.args(setpriv).arg(&binary);
        c
    };
    let out = cmd
        .args([
            "serve",
            "--engine",
            "gvisor",
            "--token",
            "t",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(extra)
        .env("RUST_BACKTRACE", "0")
        .output()?;
    ensure!(!out.status.success(), "it refused to start: {out:?}");
    Ok(String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn the_engine_refuses_to_start_without_root_or_runsc_and_names_the_fix() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let as_nobody = ["--reuid", "65534", "--regid", "65534", "--clear-groups"];
    let text = refused(&as_nobody, &["--runtime-dir", "/tmp/kg-gvisor-nobody"])?;
    assert!(text.contains("needs root"), "{text}");
    assert!(
        text.contains("namespaces") && text.contains("cgroups"),
        "{text}"
    );
    assert!(text.contains("--engine docker"), "{text}");
    let dir = format!("/run/kg-gvisor-norunsc-{}", std::process::id());
    let text = refused(
        &[],
        &["--runtime-dir", &dir, "--runsc", "/nonexistent/runsc"],
    )?;
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        text.contains("runsc not found at /nonexistent/runsc"),
        "{text}"
    );
    assert!(
        text.contains("make gvisor") && text.contains("--runsc PATH"),
        "{text}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_and_restarted_re_adopts_its_sandboxes_with_their_state() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let images = image_store(&image())?;
    let images = images.display().to_string();
    let flags = ["--engine", "gvisor", "--image-store", images.as_str()];
    let gw = Gateway::start(&flags).await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("kernel id")?.to_owned();
    gw.execute(&id, "x = 41").await?;
    let runtime_dir = gw.runtime_dir.clone();
    let crashed = gw.crash().await?;
    assert_eq!(
        runsc_sandboxes(&runtime_dir)?.len(),
        1,
        "the sandbox outlives the gateway"
    );
    let gw = crashed.restart(&flags).await?;
    assert_eq!(stdout_of(&gw, &id, "print(x + 1)").await?, "42\n");
    assert_eq!(gw.delete_kernel(&id).await?, 204);
    gw.stop().await?;
    assert_eq!(runsc_sandboxes(&runtime_dir)?, Vec::<String>::new());
    let _ = std::fs::remove_dir_all(&runtime_dir);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kernel_hibernates_and_resumes_with_its_variables_and_files() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let gw = on_engine(&image(), &[]).await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("kernel id")?.to_owned();
    gw.execute(&id, "x = 41\nopen('notes.txt', 'w').write('kept\\n')")
        .await?;
    let (status, hibernated) = gw
        .post_json(
            &format!("/api/kernels/{id}/hibernate"),
            serde_json::json!({}),
        )
        .await?;
    assert_eq!(status, 200, "{hibernated}");
    assert_eq!(hibernated["hibernated"], true, "{hibernated}");
    assert_eq!(
        runsc_sandboxes(&gw.runtime_dir)?,
        Vec::<String>::new(),
        "the sandbox is gone while the kernel hibernates"
    );
    assert_eq!(
        stdout_of(&gw, &id, "print(x + 1, open('notes.txt').read().strip())").await?,
        "42 kept\n",
        "state and files came back"
    );
    assert_eq!(gw.delete_kernel(&id).await?, 204);
    stop_and_clean(gw).await
}

/// A kernel holding what Python-level hibernation cannot keep: a 100 MiB array, a
/// 1M-row DataFrame, a generator mid-iteration, a file open at an offset, a running thread,
/// a child process and an in-memory sqlite database.
const EVERYTHING: &str = "\
import numpy as np, pandas as pd, sqlite3, subprocess, threading, time
arr = np.ones(100 * 2**20 // 8)
df = pd.DataFrame({'a': np.arange(1_000_000), 'b': np.arange(1_000_000) * 2.0})
gen = (i * i for i in range(10)); next(gen); next(gen)
f = open('data.txt', 'w+'); f.write('line1\\nline2\\n'); f.flush(); f.seek(6)
ticks = []
def tick():
    while True:
        ticks.append(1); time.sleep(0.05)
t = threading.Thread(target=tick, daemon=True); t.start()
child = subprocess.Popen(['sleep', '100000'])
db = sqlite3.connect(':memory:'); db.execute('create table t(x)'); db.execute('insert into t values (7)')
";

/// What [`EVERYTHING`] left, read back: the next square, the rest of the file, the array's
/// MiB, the frame's rows, the database's row, whether the child and the thread run.
const READ_BACK: &str = "\
n = len(ticks); time.sleep(0.3)
print(next(gen), f.read().strip(), arr.nbytes >> 20, len(df), db.execute('select x from t').fetchone()[0], child.poll() is None, t.is_alive() and len(ticks) > n)
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_kernel_hibernates_and_comes_back_with_everything_in_it_even_after_a_crash(
) -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let images = image_store(&image())?;
    let images = images.display().to_string();
    let flags = ["--engine", "gvisor", "--image-store", images.as_str()];
    let gw = Gateway::start(&flags).await?;
    let kernel = gw.create_kernel().await?;
    assert_eq!(kernel["hibernation"], "memory", "{kernel}");
    let id = kernel["id"].as_str().context("kernel id")?.to_owned();
    let answer = gw.execute(&id, EVERYTHING).await?;
    ensure!(answer["status"] == "ok", "{answer}");
    let running = gw.create_kernel().await?;
    let running_id = running["id"].as_str().context("kernel id")?.to_owned();
    gw.execute(&running_id, "y = 'still here'").await?;
    let (status, hibernated) = gw
        .post_json(
            &format!("/api/kernels/{id}/hibernate"),
            serde_json::json!({}),
        )
        .await?;
    assert_eq!(status, 200, "{hibernated}");
    assert_eq!(hibernated["hibernated"], true, "{hibernated}");
    assert_eq!(hibernated["hibernation"], "memory", "{hibernated}");
    assert_eq!(
        runsc_sandboxes(&gw.runtime_dir)?.len(),
        1,
        "only the running kernel's sandbox is left: the hibernated one's memory is freed"
    );
    let state = kernelgate_tests::hibernate_dir(&gw.runtime_dir).join(&id);
    ensure!(
        state.join("memory").is_dir(),
        "the checkpoint is on disk, in {}",
        state.display()
    );

    // kill -9 of the gateway: the running kernel's sandbox stays, the checkpoint too.
    let runtime_dir = gw.runtime_dir.clone();
    let gw = gw.crash().await?.restart(&flags).await?;
    let (_, model) = gw.get_json(&format!("/api/kernels/{id}")).await?;
    assert_eq!(model["hibernated"], true, "{model}");
    assert_eq!(model["hibernation"], "memory", "{model}");

    // Four requests at once: one restore answers them all.
    let (a, b, c, d) = tokio::join!(
        stdout_of(&gw, &id, READ_BACK),
        stdout_of(&gw, &id, "print(next(gen))"),
        stdout_of(&gw, &id, "print(next(gen))"),
        stdout_of(&gw, &id, "print(next(gen))"),
    );
    // The four run one after the other, in whatever order they arrived.
    let a = a?;
    let (square, rest) = a.split_once(' ').context("the read-back line")?;
    assert_eq!(
        rest, "line2 100 1000000 7 True True\n",
        "everything came back"
    );
    let mut squares: Vec<u32> = [square.to_owned(), b?, c?, d?]
        .iter()
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    squares.sort_unstable();
    assert_eq!(
        squares,
        [4, 9, 16, 25],
        "one generator, advanced once per request"
    );
    assert_eq!(
        runsc_sandboxes(&runtime_dir)?.len(),
        2,
        "one restore for the four requests, beside the running kernel"
    );
    ensure!(
        !state.exists(),
        "the checkpoint goes once the kernel runs again"
    );
    assert_eq!(
        stdout_of(&gw, &running_id, "print(y)").await?,
        "still here\n"
    );
    assert_eq!(gw.delete_kernel(&id).await?, 204);
    assert_eq!(gw.delete_kernel(&running_id).await?, 204);
    gw.stop().await?;
    let _ = std::fs::remove_dir_all(&runtime_dir);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_socket_refuses_a_checkpoint_by_name_and_a_failed_restore_keeps_it() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let gw = on_engine(&image(), &[]).await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("kernel id")?.to_owned();
    let hibernate = format!("/api/kernels/{id}/hibernate");
    hibernation_refused(
        &gw,
        &id,
        "import socket\ns = socket.socket(socket.AF_UNIX)\ns.bind('/run/kernel/mine.sock')\nx = 1",
        "/run/kernel/mine.sock",
    )
    .await?;
    assert_eq!(
        stdout_of(&gw, &id, "print(x + 1)").await?,
        "2\n",
        "it keeps running"
    );

    hibernation_refused(
        &gw,
        &id,
        "s.close()\nimport os\nos.unlink('/run/kernel/mine.sock')\nt = socket.socket()\nt.bind(('127.0.0.1', 8765))\nt.listen()",
        "TCP port 8765",
    )
    .await?;
    assert_eq!(
        stdout_of(&gw, &id, "print(x + 2)").await?,
        "3\n",
        "it keeps running"
    );
    gw.execute(&id, "t.close()\ng = iter(range(5)); next(g)")
        .await?;
    let (status, hibernated) = gw.post_json(&hibernate, serde_json::json!({})).await?;
    assert_eq!(status, 200, "{hibernated}");
    // A checkpoint another runsc wrote: the restore is refused, and the checkpoint kept.
    let record = kernelgate_tests::hibernate_dir(&gw.runtime_dir)
        .join(&id)
        .join("memory/checkpoint.json");
    let written = std::fs::read_to_string(&record)?;
    let mut other: serde_json::Value = serde_json::from_str(&written)?;
    other["runsc"] = "runsc version 0.0~20200101.0".into();
    std::fs::write(&record, other.to_string())?;
    let failed = gw.execute(&id, "print(next(g))").await?;
    let said = failed.to_string();
    ensure!(
        said.contains("20200101") && said.contains("checkpoint is kept"),
        "the failure says why and that the checkpoint is kept: {said}"
    );
    ensure!(record.is_file(), "the checkpoint is still there");
    let (_, model) = gw.get_json(&format!("/api/kernels/{id}")).await?;
    assert_eq!(model["hibernated"], true, "{model}");
    std::fs::write(&record, written)?;
    assert_eq!(
        stdout_of(&gw, &id, "print(next(g), x)").await?,
        "1 1\n",
        "a retry restores it"
    );
    assert_eq!(gw.delete_kernel(&id).await?, 204);
    stop_and_clean(gw).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_past_the_budget_is_refused_and_the_kernel_runs_on() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let gw = on_engine(&image(), &["--hibernate-max-mb", "8"]).await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("kernel id")?.to_owned();
    gw.execute(&id, "g = iter(range(5)); next(g)").await?;
    let (status, refused) = gw
        .post_json(
            &format!("/api/kernels/{id}/hibernate"),
            serde_json::json!({}),
        )
        .await?;
    assert_eq!(status, 409, "{refused}");
    let message = refused["message"].as_str().unwrap_or_default();
    ensure!(
        message.contains("--hibernate-max-mb") && message.contains("8 MiB"),
        "names the budget: {refused}"
    );
    assert_eq!(
        stdout_of(&gw, &id, "print(next(g))").await?,
        "1\n",
        "it runs on, state and all"
    );
    let (_, model) = gw.get_json(&format!("/api/kernels/{id}")).await?;
    assert_eq!(model["hibernated"], false, "{model}");
    assert_eq!(gw.delete_kernel(&id).await?, 204);
    stop_and_clean(gw).await
}

/// Whether kernel `id` answers a `kernel_info_request` signed with `key`, sent straight to
/// its shell socket by jupyter_client: `answered` or `silent` (3 s).
fn answers(gw: &Gateway, id: &str, key: &str) -> Result<String> {
    let dir = gw.runtime_dir.join(id);
    let script = "\
import json, sys
from jupyter_client import BlockingKernelClient
info = json.load(open(sys.argv[1] + '/kernel.json'))
info.update(ip=sys.argv[1] + '/kernel', key=sys.argv[2])
c = BlockingKernelClient()
c.load_connection_info(info)
c.start_channels()
c.kernel_info()
try:
    c.get_shell_msg(timeout=3)
    print('answered')
except Exception:
    print('silent')
c.stop_channels()
";
    let out = Command::new(host_python())
        .args(["-c", script])
        .arg(&dir)
        .arg(key)
        .output()?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_restore_from_the_template_each_with_its_own_key_random_state_and_home(
) -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let gw = on_engine(&image(), &["--kernel-templates", "true"]).await?;
    let templates = kernelgate_tests::hibernate_dir(&gw.runtime_dir).join("templates");
    let made = async {
        loop {
            // The template itself, not the hidden directory it is written into first (and
            // that is renamed into place once whole).
            let found = std::fs::read_dir(&templates).ok().and_then(|d| {
                d.flatten()
                    .find(|e| !e.file_name().to_string_lossy().starts_with('.'))
            });
            if let Some(entry) = found {
                if entry.path().join("memory/checkpoint.json").is_file() {
                    return entry.path();
                }
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    };
    let template = tokio::time::timeout(std::time::Duration::from_secs(180), made)
        .await
        .context("the template was made at start")?;
    let mut seen = Vec::new();
    for _ in 0..3 {
        let kernel = gw.create_kernel().await?;
        let id = kernel["id"].as_str().context("kernel id")?.to_owned();
        let connection: serde_json::Value = serde_json::from_slice(&std::fs::read(
            gw.runtime_dir.join(&id).join("kernel.json"),
        )?)?;
        let out = stdout_of(
            &gw,
            &id,
            "import os, random, sys\nprint('numpy' in sys.modules, sorted(os.listdir(os.path.expanduser('~'))), random.random(), get_ipython().kernel.session.session)",
        )
        .await?;
        let fields: Vec<String> = out.split_whitespace().map(str::to_owned).collect();
        ensure!(fields.len() == 4, "one line of four fields: {out:?}");
        assert_eq!(
            fields[0], "True",
            "restored from the preloaded template, not booted"
        );
        assert_eq!(fields[1], "[]", "an empty home");
        seen.push((
            connection["key"].to_string(),
            fields[2].clone(),
            fields[3].clone(),
            id,
        ));
    }
    for i in 0..seen.len() {
        for j in i + 1..seen.len() {
            ensure!(seen[i].0 != seen[j].0, "each kernel its own key: {seen:?}");
            ensure!(
                seen[i].1 != seen[j].1,
                "each its own random state: {seen:?}"
            );
            ensure!(seen[i].2 != seen[j].2, "each its own session: {seen:?}");
        }
    }
    ensure!(
        template.join("memory").is_dir(),
        "the template stays for the next create"
    );
    // A clone answers its own key only: not the template's, which every clone began with.
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(template.join("template.json"))?)?;
    let template_key = record["key"].as_str().context("the template's key")?;
    let clone = &seen[0].3;
    let own_key = seen[0].0.trim_matches('"').to_owned();
    assert_eq!(answers(&gw, clone, &own_key)?, "answered");
    assert_eq!(
        answers(&gw, clone, template_key)?,
        "silent",
        "the template's key is refused"
    );
    for (_, _, _, id) in &seen {
        assert_eq!(gw.delete_kernel(id).await?, 204);
    }
    stop_and_clean(gw).await
}

/// The kernel image with its relay label turned off, as an image from before the relays
/// would be: built from ours by Docker, offline.
fn image_without_relays() -> Result<String> {
    let base = image();
    let tag = base.rsplit(':').next().unwrap_or("latest");
    let name = format!("kernelgate-norelay:{tag}");
    let mut build = Command::new("docker")
        .args(["build", "-q", "-t", &name, "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()?;
    std::io::Write::write_all(
        build.stdin.as_mut().context("docker build's stdin")?,
        format!("FROM {base}\nLABEL org.kernelgate.relay=0\n").as_bytes(),
    )?;
    drop(build.stdin.take());
    ensure!(build.wait()?.success(), "docker build of {name}");
    Ok(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_without_the_relays_hibernates_at_python_level_and_says_so() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let older = image_without_relays()?;
    let gw = on_engine(&older, &["--image", older.as_str()]).await?;
    let kernel = gw.create_kernel().await?;
    assert_eq!(kernel["hibernation"], "namespace", "{kernel}");
    let id = kernel["id"].as_str().context("kernel id")?.to_owned();
    let hibernate = format!("/api/kernels/{id}/hibernate");
    gw.execute(&id, "x = 41\ng = (i for i in range(3))").await?;
    let (status, refused) = gw.post_json(&hibernate, serde_json::json!({})).await?;
    assert_eq!(
        status, 409,
        "Python-level hibernation refuses a generator: {refused}"
    );
    ensure!(
        refused["message"]
            .as_str()
            .unwrap_or_default()
            .contains("generator"),
        "{refused}"
    );
    gw.execute(&id, "del g").await?;
    let (status, hibernated) = gw.post_json(&hibernate, serde_json::json!({})).await?;
    assert_eq!(status, 200, "{hibernated}");
    assert_eq!(hibernated["hibernation"], "namespace", "{hibernated}");
    assert_eq!(stdout_of(&gw, &id, "print(x + 1)").await?, "42\n");
    assert_eq!(gw.delete_kernel(&id).await?, 204);
    stop_and_clean(gw).await
}

/// The host Python whose pip `packages sync` uses: the test venv's (`make test-tools`).
fn host_python() -> PathBuf {
    std::env::var_os("KERNELGATE_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv-tests/bin/python"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowed_package_installs_from_the_wheelhouse_in_a_sandbox() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let images = image_store(&image())?;
    let images = images.display().to_string();
    // A wheelhouse synced for the image through the engine: its throwaway sandboxes are
    // runsc's, from the store, with Docker out of reach (DOCKER_HOST names no daemon).
    let dir = tempfile::Builder::new().prefix("kg-wheelhouse").tempdir()?;
    let wheels = dir.path().join("fixture-wheels");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("packages/make_wheels.py");
    let built = Command::new(host_python())
        .arg(&script)
        .arg(&wheels)
        .output()
        .context("run make_wheels.py with the test venv's Python")?;
    ensure!(built.status.success(), "make_wheels.py: {built:?}");
    let allowlist = dir.path().join("allowed.txt");
    std::fs::write(&allowlist, "kgfix-hello\n")?;
    let wheelhouse = dir.path().join("wheelhouse");
    let synced = Command::new(kernelgate_tests::binary())
        .args(["packages", "sync", "--packages"])
        .arg(&allowlist)
        .arg("--wheelhouse")
        .arg(&wheelhouse)
        .arg("--find-links")
        .arg(&wheels)
        .args(["--image", &image(), "--python"])
        .arg(host_python())
        .args(["--engine", "gvisor", "--image-store", &images])
        .env("DOCKER_HOST", "unix:///nonexistent/docker.sock")
        .output()?;
    ensure!(synced.status.success(), "packages sync: {synced:?}");
    let stdout = String::from_utf8_lossy(&synced.stdout);
    assert!(
        stdout.contains("synced 1 of 1 allowed packages"),
        "{stdout}"
    );
    let allowlist = allowlist.display().to_string();
    let wheelhouse = wheelhouse.display().to_string();
    let gw = Gateway::start(&[
        "--engine",
        "gvisor",
        "--image-store",
        &images,
        "--packages",
        &allowlist,
        "--wheelhouse",
        &wheelhouse,
    ])
    .await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().context("kernel id")?.to_owned();
    let installed = stdout_of(&gw, &id, "%pip install kgfix-hello").await?;
    assert!(
        installed.contains("Successfully installed kgfix-hello-1.0"),
        "{installed}"
    );
    assert_eq!(
        stdout_of(&gw, &id, "import kgfix_hello\nprint(kgfix_hello.greet())").await?,
        "hello from the wheelhouse\n"
    );
    assert_eq!(gw.delete_kernel(&id).await?, 204);
    stop_and_clean(gw).await
}
