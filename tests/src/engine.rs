//! Which engine the harness's gateways run kernels on: Docker (the default) or, with
//! `KERNELGATE_ENGINE=gvisor`, the gVisor engine (`--engine gvisor`: runsc sandboxes the
//! gateway runs itself from OCI bundles under `<runtime-dir>/gvisor/`, images from an image
//! store, no Docker). What the engine needs that Docker has on its own is here: the image
//! store the tests fill, the runsc binary, and runsc's view of a gateway's sandboxes.

use anyhow::{ensure, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The engine every gateway the harness starts runs kernels on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Docker,
    Gvisor,
}

/// `KERNELGATE_ENGINE`: `gvisor` for the gVisor engine, else Docker.
pub fn engine() -> Engine {
    match std::env::var("KERNELGATE_ENGINE").as_deref() {
        Ok("gvisor") => Engine::Gvisor,
        _ => Engine::Docker,
    }
}

/// Whether this run's kernels are sandboxes of the gVisor engine (no Docker container).
pub fn gvisor_engine() -> bool {
    engine() == Engine::Gvisor
}

/// For a test that cannot run under the gVisor engine: true (and says why on stderr)
/// when this run is under it.
pub fn skipped_under_the_engine(why: &str) -> bool {
    if gvisor_engine() {
        eprintln!("skipped under --engine gvisor: {why}");
        return true;
    }
    false
}

/// The flags that put a `kernelgate` command (`packages sync`, ...) on this run's engine,
/// with `images` in the store under the gVisor engine; none under Docker.
pub fn command_flags(images: &[&str]) -> Result<Vec<String>> {
    if !gvisor_engine() {
        return Ok(Vec::new());
    }
    let store = image_store(images)?;
    Ok(vec![
        "--engine".into(),
        "gvisor".into(),
        "--image-store".into(),
        store.display().to_string(),
    ])
}

/// The image store the tests fill, kept between runs.
pub const IMAGES: &str = "/var/tmp/kernelgate-gvisor-images";

/// The image store holding each of `images`: each saved from Docker with `docker save` and
/// brought in with `kernelgate image import` unless the store has that image id already
/// (what an operator does on a host without Docker, with the archive copied over). Test
/// processes filling it at once take turns (a lock file beside it).
pub fn image_store(images: &[&str]) -> Result<PathBuf> {
    let store = PathBuf::from(IMAGES);
    std::fs::create_dir_all("/var/tmp")?;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(format!("{IMAGES}.lock"))?;
    lock.lock()?;
    for image in images {
        import(&store, image)?;
    }
    Ok(store)
}

fn import(store: &Path, image: &str) -> Result<()> {
    let inspect = Command::new("docker")
        .args(["image", "inspect", "--format", "{{.Id}}", image])
        .output()?;
    ensure!(
        inspect.status.success(),
        "the image {image} is not in Docker"
    );
    let id = String::from_utf8(inspect.stdout)?.trim().to_owned();
    let listed = Command::new(crate::binary())
        .arg("image")
        .arg("--image-store")
        .arg(store)
        .arg("list")
        .output()?;
    let short = id
        .trim_start_matches("sha256:")
        .get(..12)
        .context("an image id")?;
    let text = String::from_utf8_lossy(&listed.stdout);
    // The id and this reference on one line: the store has the image under this name.
    if text.lines().any(|l| l.contains(short) && l.contains(image)) {
        return Ok(());
    }
    let archive = tempfile::NamedTempFile::new_in("/var/tmp")?;
    let saved = Command::new("docker")
        .args(["save", "-o"])
        .arg(archive.path())
        .arg(image)
        .status()?;
    ensure!(saved.success(), "docker save {image}");
    let imported = Command::new(crate::binary())
        .arg("image")
        .arg("--image-store")
        .arg(store)
        .arg("import")
        .arg(archive.path())
        .output()?;
    ensure!(
        imported.status.success(),
        "kernelgate image import: {imported:?}"
    );
    Ok(())
}

/// The flags that put a gateway started with `extra` on this run's engine: none under
/// Docker; `--engine gvisor` and the image store (filled with the kernel image and the
/// images `extra` names with `--image` and `--kernelspec`) under the gVisor engine, unless
/// `extra` says otherwise.
pub fn engine_flags(extra: &[&str]) -> Result<Vec<String>> {
    if !gvisor_engine() || extra.contains(&"--engine") {
        return Ok(Vec::new());
    }
    let mut flags = vec!["--engine".to_owned(), "gvisor".to_owned()];
    if !extra.contains(&"--image-store") {
        let default = crate::image();
        let mut images = vec![default.as_str()];
        for (flag, value) in extra.iter().zip(extra.iter().skip(1)) {
            match *flag {
                "--image" => images.push(value),
                // `--kernelspec NAME=IMAGE`: a derived image's kernels.
                "--kernelspec" => images.extend(value.split_once('=').map(|(_, i)| i)),
                _ => {}
            }
        }
        let store = image_store(&images)?;
        flags.extend(["--image-store".to_owned(), store.display().to_string()]);
    }
    Ok(flags)
}

/// The runsc the engine runs: `KERNELGATE_RUNSC`, else the newest `make gvisor` unpacked,
/// else /usr/bin/runsc (the gateway's own default).
pub fn runsc() -> PathBuf {
    if let Ok(path) = std::env::var("KERNELGATE_RUNSC") {
        return PathBuf::from(path);
    }
    let unpacked = Path::new("/usr/local/lib/kernelgate/runsc");
    let mut found: Vec<PathBuf> = std::fs::read_dir(unpacked)
        .map(|d| {
            d.filter_map(|e| Some(e.ok()?.path().join("usr/bin/runsc")))
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
        .pop()
        .unwrap_or_else(|| PathBuf::from("/usr/bin/runsc"))
}

/// runsc's state directory of the gateway on `runtime_dir`.
pub fn runsc_root(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join("gvisor").join("root")
}

/// Where the engine of the gateway on `runtime_dir` keeps its sandboxes' OCI bundles.
pub fn bundles_dir(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join("gvisor").join("bundles")
}

/// runsc on the gateway's state directory.
fn runsc_on(runtime_dir: &Path) -> Command {
    let mut cmd = Command::new(runsc());
    cmd.arg("--root").arg(runsc_root(runtime_dir));
    cmd
}

/// The sandboxes runsc knows under the gateway's root, with their status (`running`,
/// `stopped`, `created`).
pub fn runsc_sandboxes(runtime_dir: &Path) -> Result<Vec<(String, String)>> {
    if !runsc_root(runtime_dir).exists() {
        return Ok(Vec::new());
    }
    let out = runsc_on(runtime_dir)
        .args(["list", "-format=json"])
        .output()?;
    ensure!(out.status.success(), "runsc list: {out:?}");
    let listed: Value = serde_json::from_slice(&out.stdout)?;
    Ok(listed
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| {
            Some((
                s["id"].as_str()?.to_owned(),
                s["status"].as_str().unwrap_or_default().to_owned(),
            ))
        })
        .collect())
}

/// `runsc state` of one sandbox (its pid, status, bundle), as runsc prints it.
pub fn runsc_state(runtime_dir: &Path, handle: &str) -> Result<Value> {
    let out = runsc_on(runtime_dir).args(["state", handle]).output()?;
    ensure!(out.status.success(), "runsc state {handle}: {out:?}");
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Sends `signal` (`KILL`, `TERM`...) to every process of sandbox `handle`.
pub fn runsc_kill(runtime_dir: &Path, handle: &str, signal: &str) -> Result<()> {
    let out = runsc_on(runtime_dir)
        .args(["kill", "--all", handle, signal])
        .output()?;
    ensure!(out.status.success(), "runsc kill {handle}: {out:?}");
    Ok(())
}

/// Kills and deletes every sandbox runsc knows under the gateway's root (what a gateway
/// killed before it could do so left). `delete -force` kills a sandbox from outside, so
/// one whose kernel no longer answers signals goes too.
pub fn remove_sandboxes(runtime_dir: &Path) {
    for (handle, _) in runsc_sandboxes(runtime_dir).unwrap_or_default() {
        let _ = runsc_on(runtime_dir)
            .args(["delete", "-force", &handle])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// One sandbox's bundle as the engine wrote it: its handle, its OCI `config.json` and the
/// engine's `meta.json` (labels, the kernel a restart moved into it).
#[derive(Debug, Clone)]
pub struct Bundle {
    pub handle: String,
    pub config: Value,
    pub meta: Value,
}

impl Bundle {
    /// The kernel it serves: the one a restart moved into it, else its label's.
    pub fn kernel_id(&self) -> Option<&str> {
        self.meta["serves"]
            .as_str()
            .or_else(|| self.meta["labels"]["org.kernelgate.kernel_id"].as_str())
    }

    /// Whether it carries label `key=value` (or just `key`).
    pub fn has_label(&self, label: &str) -> bool {
        let (key, value) = label.split_once('=').unwrap_or((label, ""));
        match self.meta["labels"][key].as_str() {
            Some(v) => value.is_empty() || v == value,
            None => false,
        }
    }
}

/// The bundles of the gateway on `runtime_dir`.
pub fn bundles(runtime_dir: &Path) -> Vec<Bundle> {
    let Ok(entries) = std::fs::read_dir(bundles_dir(runtime_dir)) else {
        return Vec::new();
    };
    let read = |path: PathBuf| -> Option<Value> {
        serde_json::from_slice(&std::fs::read(path).ok()?).ok()
    };
    let mut found: Vec<Bundle> = entries
        .filter_map(|e| {
            let e = e.ok()?;
            Some(Bundle {
                handle: e.file_name().into_string().ok()?,
                config: read(e.path().join("config.json"))?,
                meta: read(e.path().join("meta.json"))?,
            })
        })
        .collect();
    found.sort_by(|a, b| a.handle.cmp(&b.handle));
    found
}
