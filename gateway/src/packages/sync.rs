//! `kernelgate packages sync`: resolves the allowlist for one kernel image on the host with
//! the host's pip, fetches the wheels the image lacks into the wheelhouse, unpacks them and
//! writes the image's lock (docs/packages.md).
//!
//! The image's own Python says what it is (version, ABI, platform tags, installed
//! distributions) from a one-shot run of the kernel backend: a throwaway sandbox with the
//! kernels' hardening, runtime and syscall filter. pip then resolves for that
//! target (`--python-version`, `--abi`, `--platform`) with the image's distributions pinned
//! by a constraints file and offered as metadata-only stand-in wheels, so what the image
//! has is never downloaded and works offline with `--find-links` too. Each entry resolves
//! on its own, pinned to what the earlier entries locked; one that cannot resolve, or whose
//! wheels fail a check, is refused with a reason and the others go on.

use super::allowlist::{self, normalize};
use super::lock::{self, Lock, LockedPackage, LockedRequirement, PythonTarget, Refused};
use crate::backend::sandbox::{Mount, RunOnce};
use crate::backend::{BackendError, KernelBackend};
use anyhow::{anyhow, bail, Context};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::process::Output;
use std::time::Duration;
use tokio::process::Command;

/// What to sync, and for which image.
#[derive(Debug, Clone)]
pub struct SyncOptions {
    /// The allowlist, in the order written.
    pub entries: Vec<allowlist::Entry>,
    pub wheelhouse: PathBuf,
    /// Directories of wheels to resolve from instead of the package index.
    pub find_links: Vec<PathBuf>,
    /// The kernel image as named (`kernelgate-kernel:latest`).
    pub image: String,
    /// The host interpreter whose pip resolves and downloads.
    pub python: PathBuf,
}

/// What a sync did.
#[derive(Debug, Clone, Default)]
pub struct SyncReport {
    pub lock_path: PathBuf,
    pub image_id: String,
    /// Allowlist entries that synced, as written.
    pub synced: Vec<String>,
    /// Wheel files fetched into `wheels/` by this sync.
    pub fetched: Vec<String>,
    pub fetched_bytes: u64,
    /// Wheel files already in `wheels/` with the expected hash.
    pub reused: Vec<String>,
    /// `name version` of resolved packages the image already has (not fetched).
    pub in_image: Vec<String>,
    /// Directories unpacked by this sync (relative to the image's directory).
    pub unpacked: Vec<String>,
    pub refused: Vec<Refused>,
}

/// The oldest pip with `install --dry-run --report`.
const MIN_PIP: (u32, u32) = (22, 2);
/// How long the image's Python may take to describe itself.
const PROBE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long compiling the newly unpacked packages may take.
const COMPILE_TIMEOUT: Duration = Duration::from_secs(600);
/// Longest refusal reason kept (pip can be verbose).
const MAX_REASON: usize = 400;

/// Resolves `opts.entries` for `opts.image`, fills the wheelhouse and writes the image's
/// lock. Entries that cannot be synced are refused in the lock (and the report); errors
/// are for what stops the whole sync (no image, no pip, an unwritable wheelhouse).
pub async fn sync(
    backend: &dyn KernelBackend,
    opts: &SyncOptions,
    progress: &mut (dyn FnMut(&str) + Send),
) -> anyhow::Result<SyncReport> {
    check_pip(&opts.python).await?;
    let facts = match backend.describe_image(&opts.image).await {
        Ok(facts) => facts,
        Err(BackendError::ImageMissing { .. }) => bail!(
            "the kernel image {} does not exist: build it with `make image`, or name another with --image",
            opts.image
        ),
        Err(e) => return Err(e).context(format!("cannot inspect the image {}", opts.image)),
    };
    let image_id = facts.id.clone();
    if image_id.is_empty() {
        bail!("the engine gave no id for the image {}", opts.image);
    }
    let key = lock::image_key(&image_id);
    if key.len() != 12 {
        bail!("unexpected image id {image_id:?} for {}", opts.image);
    }
    let image_dir = lock::image_dir(&opts.wheelhouse, &image_id);
    let wheels_dir = opts.wheelhouse.join(lock::WHEELS_DIR);
    for dir in [&wheels_dir, &image_dir] {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the wheelhouse directory {}", dir.display()))?;
    }
    let interpreter = image_interpreter(&facts.entrypoint, &facts.cmd);
    let facts = probe_python(backend, &image_id, &interpreter)
        .await
        .with_context(|| format!("cannot read the Python facts of the image {}", opts.image))?;
    let target = facts.target();
    progress(&format!(
        "Image {} ({key}): Python {} ({}, {}-{}, platforms {})",
        opts.image,
        target.version,
        interpreter,
        target.implementation,
        target.abi,
        summarize(&target.platforms, 3),
    ));

    let scratch = Scratch::create(&opts.wheelhouse)?;
    let stubs = scratch.path.join("in-image");
    std::fs::create_dir_all(&stubs)?;
    let image_pins = facts.pins();
    for (name, version) in image_pins.values() {
        write_stub_wheel(&stubs, name, version)
            .with_context(|| format!("cannot write a stand-in wheel for {name} {version}"))?;
    }

    let pip = Pip {
        python: opts.python.clone(),
        target: target_args(&target),
        source: source_args(&opts.find_links, &stubs),
        scratch: scratch.path.clone(),
    };
    let mut run = Run {
        pip: &pip,
        image_pins: &image_pins,
        image_dir: &image_dir,
        wheels_dir: &wheels_dir,
        locked: BTreeMap::new(),
        previous: previous_trees(&image_dir.join(lock::LOCK_FILE)),
        outcomes: HashMap::new(),
        report: SyncReport {
            lock_path: image_dir.join(lock::LOCK_FILE),
            image_id: image_id.clone(),
            ..SyncReport::default()
        },
        downloads: 0,
    };
    let mut requirements = BTreeMap::new();
    for entry in &opts.entries {
        progress(&format!("Resolving {}", entry.requirement));
        match run.entry(entry).await? {
            Ok(packages) => {
                let brings: Vec<String> = packages
                    .iter()
                    .filter_map(|key| run.locked.get(key))
                    .map(|p| format!("{} {}", p.name, p.version))
                    .collect();
                progress(&format!(
                    "Locked {}: {}",
                    entry.requirement,
                    if brings.is_empty() {
                        "already in the image".to_owned()
                    } else {
                        summarize(&brings, 8)
                    }
                ));
                run.report.synced.push(entry.requirement.clone());
                requirements.insert(
                    entry.name.clone(),
                    LockedRequirement {
                        requirement: entry.requirement.clone(),
                        packages,
                    },
                );
            }
            Err(reason) => {
                progress(&format!("Refused {}: {reason}", entry.requirement));
                run.report.refused.push(Refused {
                    requirement: entry.requirement.clone(),
                    reason,
                });
            }
        }
    }

    let report = run.report;
    if !report.unpacked.is_empty() {
        match compile(
            backend,
            &image_id,
            &interpreter,
            &image_dir,
            &report.unpacked,
        )
        .await
        {
            Ok(()) => progress(&format!(
                "Compiled {} unpacked package{} to bytecode for the image's Python",
                report.unpacked.len(),
                if report.unpacked.len() == 1 { "" } else { "s" }
            )),
            Err(e) => progress(&format!(
                "Warning: could not compile the unpacked packages to bytecode ({e:#}); they \
                 import, more slowly"
            )),
        }
    }
    let mut in_image: Vec<&str> = report
        .in_image
        .iter()
        .filter_map(|p| p.split(' ').next())
        .collect();
    in_image.sort_by_key(|name| normalize(name));
    let mut line = format!(
        "Fetched {} wheel{} ({}), reused {}, skipped {} already in the image",
        report.fetched.len(),
        if report.fetched.len() == 1 { "" } else { "s" },
        size(report.fetched_bytes),
        report.reused.len(),
        in_image.len(),
    );
    if !in_image.is_empty() {
        line.push_str(": ");
        line.push_str(&summarize(&in_image, 12));
    }
    progress(&line);

    let lock = Lock {
        format: lock::FORMAT,
        image: opts.image.clone(),
        image_id,
        python: target,
        synced_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        requirements,
        refused: report.refused.clone(),
        packages: run.locked,
    };
    lock.write(&report.lock_path).map_err(|e| anyhow!(e))?;
    progress(&format!(
        "Wrote {} ({} of {} allowlist entries synced, {} refused, {} unpacked now)",
        report.lock_path.display(),
        report.synced.len(),
        opts.entries.len(),
        report.refused.len(),
        report.unpacked.len(),
    ));
    Ok(report)
}

/// One sync in progress: what is locked so far and what became of each package.
struct Run<'a> {
    pip: &'a Pip,
    /// Normalized name -> (display name, version) of what the image has.
    image_pins: &'a BTreeMap<String, (String, String)>,
    image_dir: &'a Path,
    wheels_dir: &'a Path,
    /// The lock's `packages` so far.
    locked: BTreeMap<String, LockedPackage>,
    /// Tree directory -> the wheel sha256 the previous lock says it was unpacked from (for
    /// trees unpacked before they carried their own `UNPACKED_FROM` file).
    previous: HashMap<String, String>,
    /// `name==version` -> the package ready in the wheelhouse, or why it cannot be.
    outcomes: HashMap<String, Result<LockedPackage, String>>,
    report: SyncReport,
    downloads: usize,
}

impl Run<'_> {
    /// Resolves, fetches and unpacks one entry: the normalized names it brings, or why it
    /// is refused. The outer error stops the sync.
    async fn entry(
        &mut self,
        entry: &allowlist::Entry,
    ) -> anyhow::Result<Result<Vec<String>, String>> {
        let pinned: BTreeMap<&str, &str> = self
            .image_pins
            .iter()
            .map(|(key, (_, version))| (key.as_str(), version.as_str()))
            .chain(
                self.locked
                    .iter()
                    .filter(|(_, p)| !p.in_image)
                    .map(|(key, p)| (key.as_str(), p.version.as_str())),
            )
            .collect();
        let items = match self
            .pip
            .resolve(&entry.requirement, &constraints(&pinned))
            .await?
        {
            Ok(items) => items,
            Err(failure) => return Ok(Err(failure.reason(self.image_pins))),
        };
        let mut brings = Vec::new();
        let mut ready = Vec::new();
        let mut image_has = Vec::new();
        // The entry itself first, then what it pulls in, in pip's order.
        let (mut first, rest): (Vec<_>, Vec<_>) = items
            .into_iter()
            .partition(|item| item.requested || item.key == entry.name);
        first.extend(rest);
        for item in first {
            if let Some((name, version)) = self.image_pins.get(&item.key) {
                image_has.push(LockedPackage {
                    name: name.clone(),
                    version: version.clone(),
                    in_image: true,
                    wheel: None,
                    sha256: None,
                    summary: None,
                    dir: None,
                });
                continue;
            }
            let id = format!("{}=={}", item.key, item.version);
            if !self.outcomes.contains_key(&id) {
                let outcome = self.prepare(&item).await?;
                self.outcomes.insert(id.clone(), outcome);
            }
            match &self.outcomes[&id] {
                Ok(package) => {
                    brings.push(item.key.clone());
                    ready.push((item.key.clone(), package.clone()));
                }
                Err(reason) => return Ok(Err(reason.clone())),
            }
        }
        for package in image_has {
            let said = format!("{} {}", package.name, package.version);
            if !self.report.in_image.contains(&said) {
                self.report.in_image.push(said);
            }
            self.locked
                .entry(normalize(&package.name))
                .or_insert(package);
        }
        self.locked.extend(ready);
        Ok(Ok(brings))
    }

    /// Puts one resolved package's wheel into `wheels/` (unless it is there) and its tree
    /// into the image's directory (unless it is there).
    async fn prepare(&mut self, item: &Resolved) -> anyhow::Result<Result<LockedPackage, String>> {
        let what = format!("{} {}", item.name, item.version);
        let Some(file_name) = wheel_file_name(&item.url) else {
            return Ok(Err(format!("{what}: {} is not a wheel", item.url)));
        };
        let wheel = self.wheels_dir.join(&file_name);
        let dir = format!("{}-{}", item.key, item.version);
        let dest = self.image_dir.join(&dir);
        let have = match &item.sha256 {
            Some(expected) => file_sha256(wheel.clone())
                .await
                .is_ok_and(|actual| &actual == expected),
            None => false,
        };
        let sha256 = if have {
            let sha256 = item.sha256.clone().unwrap_or_default();
            if let Err(reason) = same_bytes_as_unpacked(&dest, &sha256, &self.previous) {
                return Ok(Err(format!("{what}: {reason}")));
            }
            self.report.reused.push(file_name.clone());
            sha256
        } else {
            let fetched = match self.fetch(item, &file_name).await? {
                Ok(path) => path,
                Err(reason) => return Ok(Err(format!("{what}: {reason}"))),
            };
            let actual = file_sha256(fetched.clone()).await?;
            if let Some(expected) = &item.sha256 {
                if &actual != expected {
                    return Ok(Err(format!(
                        "{what}: {file_name} has sha256 {actual}, but the resolver said {expected}"
                    )));
                }
            }
            // Checked before the wheel replaces the one in `wheels/`: a refused wheel
            // leaves the wheelhouse as it was.
            if let Err(reason) = same_bytes_as_unpacked(&dest, &actual, &self.previous) {
                return Ok(Err(format!("{what}: {reason}")));
            }
            let size = std::fs::metadata(&fetched)?.len();
            std::fs::rename(&fetched, &wheel).with_context(|| {
                format!("cannot move {file_name} into {}", self.wheels_dir.display())
            })?;
            self.report.fetched.push(file_name.clone());
            self.report.fetched_bytes += size;
            actual
        };
        let (expected, target) = (sha256.clone(), dest.clone());
        let unpacked =
            tokio::task::spawn_blocking(move || install_wheel(&wheel, &expected, &target))
                .await
                .context("unpacking a wheel")?;
        match unpacked {
            Ok(true) => self.report.unpacked.push(dir.clone()),
            Ok(false) => {}
            Err(reason) => return Ok(Err(format!("{what}: {reason}"))),
        }
        Ok(Ok(LockedPackage {
            name: item.name.clone(),
            version: item.version.clone(),
            in_image: false,
            wheel: Some(file_name),
            sha256: Some(sha256),
            summary: item.summary.clone(),
            dir: Some(dir),
        }))
    }

    /// Brings a wheel into a scratch directory: a copy of a local file, or pip's download
    /// (pinned to the resolver's hash when it gave one).
    async fn fetch(
        &mut self,
        item: &Resolved,
        file_name: &str,
    ) -> anyhow::Result<Result<PathBuf, String>> {
        self.downloads += 1;
        let staging = self
            .pip
            .scratch
            .join(format!("download-{}", self.downloads));
        std::fs::create_dir_all(&staging)?;
        if let Some(source) = file_url_path(&item.url) {
            let copy = staging.join(file_name);
            return Ok(match std::fs::copy(&source, &copy) {
                Ok(_) => Ok(copy),
                Err(e) => Err(format!("cannot copy {}: {e}", source.display())),
            });
        }
        self.pip.download(item, &staging).await.map(|done| {
            done.and_then(|()| {
                let expected = staging.join(file_name);
                if expected.is_file() {
                    return Ok(expected);
                }
                // pip names the file after the link; fall back to the only wheel there.
                let mut wheels = std::fs::read_dir(&staging)
                    .map_err(|e| e.to_string())?
                    .filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "whl"));
                match (wheels.next(), wheels.next()) {
                    (Some(only), None) => Ok(only),
                    _ => Err(format!("pip did not download {file_name}")),
                }
            })
        })
    }
}

/// The host's pip, set up for the image's interpreter.
struct Pip {
    python: PathBuf,
    /// `--python-version ... --platform ...`.
    target: Vec<String>,
    /// `--find-links` / `--no-index`.
    source: Vec<String>,
    scratch: PathBuf,
}

/// A resolution pip refused: what it printed.
#[derive(Debug)]
struct ResolveFailure {
    stdout: String,
    stderr: String,
    status: Option<i32>,
}

impl ResolveFailure {
    fn reason(&self, image: &BTreeMap<String, (String, String)>) -> String {
        resolution_failure(&self.stdout, &self.stderr, image).unwrap_or_else(|| match self.status {
            Some(code) => format!("pip could not resolve it (exit status {code})"),
            None => "pip could not resolve it (killed by a signal)".to_owned(),
        })
    }
}

impl Pip {
    fn command(&self) -> Command {
        let mut command = Command::new(&self.python);
        command
            .args(["-m", "pip"])
            .env("PYTHONIOENCODING", "utf-8")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        command
    }

    /// `pip install --dry-run --report` for one requirement under `constraints`.
    async fn resolve(
        &self,
        requirement: &str,
        constraints: &str,
    ) -> anyhow::Result<Result<Vec<Resolved>, ResolveFailure>> {
        let constraints_file = self.scratch.join("constraints.txt");
        let report_file = self.scratch.join("report.json");
        std::fs::write(&constraints_file, constraints)?;
        let _ = std::fs::remove_file(&report_file);
        let mut command = self.command();
        command
            .args(["install", "--dry-run", "--ignore-installed", "--report"])
            .arg(&report_file)
            .args(common_args())
            .args(&self.target)
            .arg("--target")
            .arg(self.scratch.join("target"))
            .args(&self.source)
            .arg("-c")
            .arg(&constraints_file)
            .arg(requirement);
        let output = run(command, &self.python).await?;
        if !output.status.success() {
            return Ok(Err(ResolveFailure {
                stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
                status: output.status.code(),
            }));
        }
        let text = std::fs::read_to_string(&report_file)
            .with_context(|| format!("pip wrote no report to {}", report_file.display()))?;
        parse_report(&text)
            .map(Ok)
            .map_err(|e| anyhow!("pip's report: {e}"))
    }

    /// `pip download` of exactly one resolved wheel into `dir`.
    async fn download(&self, item: &Resolved, dir: &Path) -> anyhow::Result<Result<(), String>> {
        let mut command = self.command();
        command
            .args(["download", "--no-deps", "--progress-bar", "off"])
            .args(common_args())
            .args(&self.target)
            .args(&self.source)
            .arg("-d")
            .arg(dir);
        match &item.sha256 {
            Some(sha256) => {
                // With a hash pip takes only the file the resolver chose, and checks it.
                let requirements = dir.join("requirement.txt");
                std::fs::write(
                    &requirements,
                    format!("{}=={} --hash=sha256:{sha256}\n", item.key, item.version),
                )?;
                command.arg("--require-hashes").arg("-r").arg(requirements);
            }
            None => {
                command.arg(format!("{}=={}", item.key, item.version));
            }
        }
        let output = run(command, &self.python).await?;
        if output.status.success() {
            return Ok(Ok(()));
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        Ok(Err(format!(
            "pip download failed: {}",
            last_error(&stderr).unwrap_or("no message")
        )))
    }
}

/// Options every pip call gets: wheels only, no prompts, no version nagging.
fn common_args() -> [&'static str; 3] {
    [
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
    ]
}

async fn run(mut command: Command, python: &Path) -> anyhow::Result<Output> {
    command
        .output()
        .await
        .with_context(|| format!("cannot run {}", python.display()))
}

/// Fails unless `python -m pip` works and is new enough for `--dry-run --report`.
async fn check_pip(python: &Path) -> anyhow::Result<()> {
    let advice =
        "install python3-pip, or pass --python with the python of a virtualenv that has pip";
    let output = Command::new(python)
        .args(["-m", "pip", "--version"])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output()
        .await;
    let output = match output {
        Ok(output) => output,
        Err(e) => bail!(
            "cannot run {} ({e}): pass --python with a Python that has pip",
            python.display()
        ),
    };
    if !output.status.success() {
        bail!("{} has no pip: {advice}", python.display());
    }
    let text = String::from_utf8_lossy(&output.stdout);
    if let Some(version) = pip_version(&text) {
        if version < MIN_PIP {
            bail!(
                "{} has pip {}.{}; resolving needs pip {}.{} or newer (`install --dry-run --report`): upgrade it, or pass --python with a virtualenv that has a newer pip",
                python.display(),
                version.0,
                version.1,
                MIN_PIP.0,
                MIN_PIP.1
            );
        }
    }
    Ok(())
}

/// `(major, minor)` from `pip 23.2.1 from ... (python 3.11)`.
fn pip_version(text: &str) -> Option<(u32, u32)> {
    let version = text.strip_prefix("pip ")?.split_whitespace().next()?;
    let mut parts = version.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts
        .next()
        .map(|m| {
            m.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
        })
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    Some((major, minor))
}

/// The interpreter the image's kernel runs: the first `python*` of its entrypoint and
/// command (`/opt/kernel/venv/bin/python`), else `python3` from the image's PATH.
fn image_interpreter(entrypoint: &[String], cmd: &[String]) -> String {
    entrypoint
        .iter()
        .chain(cmd)
        .find(|arg| {
            let base = arg.rsplit('/').next().unwrap_or_default();
            base.starts_with("python") && base[6..].chars().all(|c| c.is_ascii_digit() || c == '.')
        })
        .cloned()
        .unwrap_or_else(|| "python3".to_owned())
}

/// Run by the image's interpreter: prints what pip needs to resolve for it. It must work
/// without `packaging` (pip's vendored copy, then sysconfig, stand in).
const PROBE: &str = r#"
import json, re, sys, sysconfig, platform
def norm(n): return re.sub(r"[-_.]+", "-", n).lower()
impl = {"cpython": "cp", "pypy": "pp"}.get(sys.implementation.name, sys.implementation.name)
out = {"version": platform.python_version(), "implementation": impl, "abi": None, "platforms": []}
try:
    from packaging import tags
except Exception:
    try:
        from pip._vendor.packaging import tags
    except Exception:
        tags = None
if tags is not None:
    try:
        interp = tags.interpreter_name() + tags.interpreter_version()
        out["implementation"] = tags.interpreter_name()
        for t in tags.sys_tags():
            if out["abi"] is None and t.interpreter == interp and t.abi not in ("abi3", "none"):
                out["abi"] = t.abi
            if t.platform != "any" and t.platform not in out["platforms"]:
                out["platforms"].append(t.platform)
    except Exception:
        pass
if not out["abi"]:
    m = re.match(r"cpython-(\d+)(t?)", sysconfig.get_config_var("SOABI") or "")
    out["abi"] = "cp" + m.group(1) + m.group(2) if m else impl + "%d%d" % sys.version_info[:2]
if not out["platforms"]:
    out["platforms"] = [re.sub(r"[-.]", "_", sysconfig.get_platform())]
import importlib.metadata as md
seen = {}
for d in md.distributions():
    name = d.metadata["Name"]
    if name and norm(name) not in seen:
        seen[norm(name)] = [name, d.version]
out["installed"] = sorted(seen.values(), key=lambda nv: norm(nv[0]))
sys.stdout.write(json.dumps(out) + "\n")
"#;

/// What the image's Python said about itself.
#[derive(Debug, Clone, Deserialize)]
struct ImagePython {
    version: String,
    implementation: String,
    abi: String,
    platforms: Vec<String>,
    /// (display name, version) of every installed distribution.
    installed: Vec<(String, String)>,
}

impl ImagePython {
    fn target(&self) -> PythonTarget {
        PythonTarget {
            version: self.version.clone(),
            implementation: self.implementation.clone(),
            abi: self.abi.clone(),
            platforms: self.platforms.clone(),
        }
    }

    /// Normalized name -> (display name, version) of the installed distributions whose
    /// version pip can pin (a malformed one would make the constraints file unreadable).
    fn pins(&self) -> BTreeMap<String, (String, String)> {
        self.installed
            .iter()
            .filter(|(name, version)| {
                allowlist::parse_requirement(name).is_ok() && is_plain_version(version)
            })
            .map(|(name, version)| (normalize(name), (name.clone(), version.clone())))
            .collect()
    }
}

/// Output a one-shot run keeps, per stream: the probe's facts fit many times over.
const MAX_RUN_OUTPUT: usize = 16 << 20;

/// Runs `request` once through the backend (a throwaway sandbox with the kernels'
/// hardening and syscall filter): its standard output, once it exited with 0.
async fn oneshot(backend: &dyn KernelBackend, request: RunOnce) -> anyhow::Result<String> {
    let what = request.argv.first().cloned().unwrap_or_default();
    let timeout = request.timeout;
    let out = match backend.run_once(request).await {
        Ok(out) => out,
        Err(BackendError::TimedOut { .. }) => bail!(
            "{what} in the image did not finish within {} s",
            timeout.as_secs()
        ),
        Err(e) => return Err(e).context("cannot run a sandbox of the image"),
    };
    if out.exit_code != 0 {
        let stderr = String::from_utf8_lossy(&out.stderr);
        bail!(
            "{what} exited with status {}: {}",
            out.exit_code,
            last_line(&stderr).unwrap_or("no message")
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The run that reads the image's Python facts: its interpreter as the kernel's user.
fn probe_request(image_id: &str, interpreter: &str) -> RunOnce {
    RunOnce {
        image: image_id.to_owned(),
        argv: vec![interpreter.to_owned(), "-c".to_owned(), PROBE.to_owned()],
        user: None,
        mounts: Vec::new(),
        limits: RunOnce::LIMITS,
        timeout: PROBE_TIMEOUT,
        max_output: MAX_RUN_OUTPUT,
    }
}

/// The image's Python: version, tags and installed distributions, read by its own
/// interpreter in a throwaway sandbox as the kernel's user.
async fn probe_python(
    backend: &dyn KernelBackend,
    image_id: &str,
    interpreter: &str,
) -> anyhow::Result<ImagePython> {
    let stdout = oneshot(backend, probe_request(image_id, interpreter)).await?;
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_default();
    serde_json::from_str(line).with_context(|| format!("{interpreter} printed no facts"))
}

/// The run that compiles `dirs` of the image's directory in the wheelhouse (mounted at
/// `/wheelhouse`, writable), as `owner`, the directory's owner.
fn compile_request(
    image_id: &str,
    interpreter: &str,
    image_dir: &Path,
    owner: (u32, u32),
    dirs: &[String],
) -> RunOnce {
    let mut argv: Vec<String> = [
        interpreter,
        "-m",
        "compileall",
        "-q",
        "-j",
        "0",
        "--invalidation-mode",
        "unchecked-hash",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    argv.extend(dirs.iter().map(|d| format!("/wheelhouse/{d}")));
    RunOnce {
        image: image_id.to_owned(),
        argv,
        user: Some(owner),
        mounts: vec![Mount::writable(image_dir, "/wheelhouse")],
        limits: RunOnce::LIMITS,
        timeout: COMPILE_TIMEOUT,
        max_output: MAX_RUN_OUTPUT,
    }
}

/// Compiles the newly unpacked packages to bytecode with the image's own interpreter, as
/// the image's own packages are (`unchecked-hash`: kernels mount the tree read-only and
/// could never cache it; without this, every import compiles from source). Runs as the
/// owner of the image's directory, with only that directory writable.
async fn compile(
    backend: &dyn KernelBackend,
    image_id: &str,
    interpreter: &str,
    image_dir: &Path,
    dirs: &[String],
) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(image_dir)?;
    let request = compile_request(
        image_id,
        interpreter,
        image_dir,
        (meta.uid(), meta.gid()),
        dirs,
    );
    oneshot(backend, request).await?;
    Ok(())
}

/// `--python-version`, `--implementation`, `--abi` and `--platform` options for `target`.
fn target_args(target: &PythonTarget) -> Vec<String> {
    // pip takes at most major.minor.micro, digits only (`3.13.0rc1` -> `3.13.0`).
    let mut version: Vec<&str> = Vec::new();
    for part in target.version.split('.').take(3) {
        let digits = part.len() - part.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        if digits > 0 {
            version.push(&part[..digits]);
        }
        if digits == 0 || digits < part.len() {
            break;
        }
    }
    let mut args = vec![
        "--python-version".to_owned(),
        version.join("."),
        "--implementation".to_owned(),
        target.implementation.clone(),
    ];
    let mut abis = vec![target.abi.as_str(), "abi3", "none"];
    abis.dedup();
    for abi in abis {
        args.extend(["--abi".to_owned(), abi.to_owned()]);
    }
    for platform in &target.platforms {
        args.extend(["--platform".to_owned(), platform.clone()]);
    }
    args
}

/// Where wheels come from: the package index (with the operator's pip configuration), or
/// only the given directories (pip's configuration ignored, so nothing else leaks in). The
/// image's stand-in wheels are offered either way.
fn source_args(find_links: &[PathBuf], stubs: &Path) -> Vec<String> {
    let mut args = Vec::new();
    if !find_links.is_empty() {
        args.extend(["--isolated".to_owned(), "--no-index".to_owned()]);
        for dir in find_links {
            args.extend(["--find-links".to_owned(), dir.display().to_string()]);
        }
    }
    args.extend(["--find-links".to_owned(), stubs.display().to_string()]);
    args
}

/// The constraints file: every pinned name at its version, sorted.
fn constraints(pinned: &BTreeMap<&str, &str>) -> String {
    let mut text = String::from(
        "# The kernel image's distributions and what earlier allowlist entries locked.\n",
    );
    for (name, version) in pinned {
        text.push_str(&format!("{name}=={version}\n"));
    }
    text
}

/// A version simple enough to pin and to put in a wheel file name (PEP 440 characters).
fn is_plain_version(version: &str) -> bool {
    version.starts_with(|c: char| c.is_ascii_digit())
        && version
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '!' | '+'))
}

/// A metadata-only wheel standing in for a distribution the image has, so pip can resolve
/// against it without the index having it (and without downloading it).
fn write_stub_wheel(dir: &Path, name: &str, version: &str) -> std::io::Result<()> {
    use zip::write::SimpleFileOptions;
    let dist = normalize(name).replace('-', "_");
    let info = format!("{dist}-{version}.dist-info");
    let file = std::fs::File::create(dir.join(format!("{dist}-{version}-py3-none-any.whl")))?;
    let mut zip = zip::ZipWriter::new(file);
    let options = SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (path, text) in [
        (
            "METADATA",
            format!("Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: in the kernel image\n"),
        ),
        (
            "WHEEL",
            "Wheel-Version: 1.0\nGenerator: kernelgate\nRoot-Is-Purelib: true\nTag: py3-none-any\n".to_owned(),
        ),
        ("RECORD", String::new()),
    ] {
        zip.start_file(format!("{info}/{path}"), options)
            .map_err(std::io::Error::other)?;
        zip.write_all(text.as_bytes())?;
    }
    zip.finish().map_err(std::io::Error::other)?;
    Ok(())
}

/// One package of a resolution, from pip's report.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Resolved {
    /// Display name.
    name: String,
    /// Normalized name.
    key: String,
    version: String,
    url: String,
    sha256: Option<String>,
    summary: Option<String>,
    /// Named by the requirement itself (not pulled in).
    requested: bool,
}

/// The `install` items of a pip installation report (format version 1).
fn parse_report(text: &str) -> Result<Vec<Resolved>, String> {
    #[derive(Deserialize)]
    struct Report {
        version: String,
        #[serde(default)]
        install: Vec<Item>,
    }
    #[derive(Deserialize)]
    struct Item {
        download_info: DownloadInfo,
        #[serde(default)]
        requested: bool,
        metadata: Metadata,
    }
    #[derive(Deserialize)]
    struct DownloadInfo {
        url: String,
        archive_info: Option<ArchiveInfo>,
    }
    #[derive(Deserialize)]
    struct ArchiveInfo {
        hash: Option<String>,
        #[serde(default)]
        hashes: BTreeMap<String, String>,
    }
    #[derive(Deserialize)]
    struct Metadata {
        name: String,
        version: String,
        summary: Option<String>,
    }
    let report: Report = serde_json::from_str(text).map_err(|e| e.to_string())?;
    if report.version != "1" {
        return Err(format!("unknown report version {:?}", report.version));
    }
    Ok(report
        .install
        .into_iter()
        .map(|item| {
            let sha256 = item.download_info.archive_info.and_then(|info| {
                info.hashes.get("sha256").cloned().or_else(|| {
                    info.hash
                        .and_then(|h| h.strip_prefix("sha256=").map(str::to_owned))
                })
            });
            Resolved {
                key: normalize(&item.metadata.name),
                name: item.metadata.name,
                version: item.metadata.version,
                url: item.download_info.url,
                sha256: sha256.map(|s| s.to_ascii_lowercase()),
                summary: item.metadata.summary.filter(|s| !s.is_empty()),
                requested: item.requested,
            }
        })
        .collect())
}

/// One line saying why pip could not resolve: the conflict's causes when pip names them
/// (with the image's pins said as such), else its most telling error line.
fn resolution_failure(
    stdout: &str,
    stderr: &str,
    image: &BTreeMap<String, (String, String)>,
) -> Option<String> {
    let causes: Vec<String> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("The conflict is caused by"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .map(|l| {
            let cause = l.trim();
            let pin = cause.strip_prefix("The user requested (constraint) ");
            match pin.and_then(|p| p.split_once("==")) {
                Some((name, version)) if image.contains_key(&normalize(name)) => {
                    format!("the image has {} {version}", image[&normalize(name)].0)
                }
                Some((name, version)) => {
                    format!("{name} {version} is locked for an earlier allowlist entry")
                }
                None => match cause.strip_prefix("The user requested ") {
                    Some(asked) => format!("the allowlist entry asks for {asked}"),
                    None => cause.to_owned(),
                },
            }
        })
        .collect();
    let reason = if causes.is_empty() {
        let errors: Vec<&str> = stderr
            .lines()
            .filter_map(|l| l.trim().strip_prefix("ERROR: "))
            .filter(|l| !l.starts_with("ResolutionImpossible"))
            .collect();
        errors
            .iter()
            .find(|l| l.starts_with("Could not find a version"))
            .or(errors.first())
            .map(|l| (*l).to_owned())
            .or_else(|| last_line(stderr).map(str::to_owned))?
    } else {
        format!("conflicting dependencies: {}", causes.join("; "))
    };
    Some(one_line(&reason))
}

fn last_error(stderr: &str) -> Option<&str> {
    stderr
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("ERROR: "))
        .or_else(|| last_line(stderr))
}

fn last_line(text: &str) -> Option<&str> {
    text.lines().map(str::trim).rfind(|l| !l.is_empty())
}

fn one_line(text: &str) -> String {
    let line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    match line.char_indices().nth(MAX_REASON) {
        Some((cut, _)) => format!("{}...", &line[..cut]),
        None => line,
    }
}

/// `1.3 MiB`, or `12 KiB` below a MiB.
fn size(bytes: u64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if bytes < 1024 * 1024 {
        format!("{} KiB", bytes.div_ceil(1024))
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB)
    }
}

/// Up to `max` items joined, then how many more.
fn summarize<S: AsRef<str>>(items: &[S], max: usize) -> String {
    let shown: Vec<&str> = items.iter().take(max).map(AsRef::as_ref).collect();
    let mut text = shown.join(", ");
    if items.len() > max {
        text.push_str(&format!(" and {} more", items.len() - max));
    }
    text
}

/// The wheel file name at the end of a URL, if it is a plain one.
fn wheel_file_name(url: &str) -> Option<String> {
    let path = url.split(['#', '?']).next()?;
    let name = percent_decode(path.rsplit('/').next()?)?;
    let plain =
        name.ends_with(".whl") && !name.starts_with('.') && !name.contains(['/', '\\', '\0']);
    plain.then_some(name)
}

/// The local path of a `file://` URL.
fn file_url_path(url: &str) -> Option<PathBuf> {
    let rest = url.strip_prefix("file://")?;
    let path = rest.split(['#', '?']).next()?;
    // `file://localhost/x` and `file:///x` both name `/x`.
    let path = path.strip_prefix("localhost").unwrap_or(path);
    path.starts_with('/')
        .then(|| percent_decode(path).map(PathBuf::from))
        .flatten()
}

fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

async fn file_sha256(path: PathBuf) -> anyhow::Result<String> {
    tokio::task::spawn_blocking(move || sha256_of(&path))
        .await
        .context("hashing a wheel")?
        .map_err(Into::into)
}

fn sha256_of(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0; 256 * 1024];
    loop {
        let n = file.read(&mut buffer)?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
    }
    Ok(hex::encode(hasher.finalize()))
}

/// Where a wheel entry goes in the unpacked tree: `Some(path)` relative to its root, `None`
/// for what a site-packages install leaves out (`.data/scripts`, `headers`, `data`).
/// Absolute paths, `..`, backslashes and NULs are refused.
fn install_path(entry: &str) -> Result<Option<String>, String> {
    if entry.starts_with('/') || entry.contains(['\\', '\0']) {
        return Err(format!("it has an entry with an unsafe path: {entry:?}"));
    }
    let mut parts = Vec::new();
    for part in entry.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err(format!("it has an entry with an unsafe path: {entry:?}")),
            part => parts.push(part),
        }
    }
    if parts.is_empty() {
        return Ok(None);
    }
    // `<name>-<version>.data/<scheme>/...`: purelib and platlib go to the root.
    if parts[0].ends_with(".data") && parts[0].contains('-') {
        return Ok(match parts.get(1) {
            Some(&"purelib") | Some(&"platlib") if parts.len() > 2 => Some(parts[2..].join("/")),
            _ => None,
        });
    }
    Ok(Some(parts.join("/")))
}

/// A `.pth` file at the root of the installed tree: site runs its `import` lines at every
/// interpreter start.
fn is_root_pth(path: &str) -> bool {
    !path.contains('/') && path.to_ascii_lowercase().ends_with(".pth")
}

/// Most bytes one wheel may unpack to: past it (as it declares, or as it turns out while
/// unpacking) it is refused.
const MAX_UNPACKED: u64 = 2 << 30;

/// What unpacking a wheel writes: (zip index, path in the tree, is a directory,
/// executable, bytes it declares), checked before anything is written.
type Plan = Vec<(usize, String, bool, bool, u64)>;

/// Checks what a wheel would unpack to before anything is written.
fn plan_unpack<R: Read + std::io::Seek>(archive: &mut zip::ZipArchive<R>) -> Result<Plan, String> {
    let mut plan = Vec::new();
    let mut seen = BTreeSet::new();
    let mut declared = 0u64;
    for index in 0..archive.len() {
        let file = archive
            .by_index(index)
            .map_err(|e| format!("it is not a readable wheel: {e}"))?;
        let Some(path) = install_path(file.name())? else {
            continue;
        };
        if file.is_symlink() {
            return Err(format!("it has a symbolic link: {:?}", file.name()));
        }
        if is_root_pth(&path) {
            return Err(format!(
                "it has a .pth file ({}), which would run code at every interpreter start",
                file.name()
            ));
        }
        let is_dir = file.is_dir();
        if !is_dir && !seen.insert(path.clone()) {
            return Err(format!("it has two entries for {path}"));
        }
        let executable = file.unix_mode().is_some_and(|mode| mode & 0o111 != 0);
        declared = declared.saturating_add(file.size());
        if declared > MAX_UNPACKED {
            return Err(format!(
                "it unpacks to more than the {} MiB a wheel may take",
                MAX_UNPACKED >> 20
            ));
        }
        plan.push((index, path, is_dir, executable, file.size()));
    }
    Ok(plan)
}

/// The file in an unpacked tree that names the sha256 of the wheel it came from (Python
/// ignores it on `sys.path`).
const UNPACKED_FROM: &str = ".kernelgate-wheel-sha256";

/// A version's bytes never change under it: when `dest` already holds this version
/// unpacked from other wheel bytes (its `UNPACKED_FROM` file, else `previous`: the last
/// lock's trees),
/// the new bytes are refused and the tree kernels install stays as it was. The reason
/// says how to take the new bytes on purpose.
fn same_bytes_as_unpacked(
    dest: &Path,
    sha256: &str,
    previous: &HashMap<String, String>,
) -> Result<(), String> {
    if !dest.is_dir() {
        return Ok(());
    }
    let held = std::fs::read_to_string(dest.join(UNPACKED_FROM))
        .ok()
        .map(|text| text.trim().to_owned())
        .or_else(|| {
            let dir = dest.file_name()?.to_string_lossy().into_owned();
            previous.get(&dir).cloned()
        });
    match held {
        Some(held) if held != sha256 => Err(format!(
            "its wheel now has sha256 {sha256}, but {} was unpacked from a wheel with \
             sha256 {held}: the bytes of a released version must not change, so the new \
             wheel is refused and kernels cannot install it; if the new bytes are \
             trusted, delete {} and sync again",
            dest.display(),
            dest.display()
        )),
        _ => Ok(()),
    }
}

/// Tree directory -> wheel sha256, as the lock at `path` says, if it can be read.
fn previous_trees(path: &Path) -> HashMap<String, String> {
    let Ok(Some(lock)) = Lock::read(path) else {
        return HashMap::new();
    };
    lock.packages
        .into_values()
        .filter_map(|p| Some((p.dir?, p.sha256?)))
        .collect()
}

/// Checks a wheel (hash, paths, `.pth`) and unpacks it into `dest` unless `dest` exists:
/// `Ok(true)` when it unpacked. The reason is for a refusal.
fn install_wheel(wheel: &Path, sha256: &str, dest: &Path) -> Result<bool, String> {
    let actual = sha256_of(wheel).map_err(|e| format!("cannot read {}: {e}", wheel.display()))?;
    if actual != sha256 {
        return Err(format!(
            "{} has sha256 {actual}, expected {sha256}",
            wheel.display()
        ));
    }
    let file =
        std::fs::File::open(wheel).map_err(|e| format!("cannot open {}: {e}", wheel.display()))?;
    let mut archive =
        zip::ZipArchive::new(file).map_err(|e| format!("it is not a readable wheel: {e}"))?;
    let plan = plan_unpack(&mut archive)?;
    if dest.exists() {
        return Ok(false);
    }
    let parent = dest.parent().unwrap_or(Path::new("."));
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = parent.join(format!(".tmp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let written = unpack(&mut archive, &plan, &tmp)
        .and_then(|()| std::fs::write(tmp.join(UNPACKED_FROM), format!("{sha256}\n")))
        .and_then(|()| {
            std::fs::rename(&tmp, dest).or_else(|e| {
                // Another sync put it there first.
                if dest.is_dir() {
                    Ok(())
                } else {
                    Err(e)
                }
            })
        });
    let _ = std::fs::remove_dir_all(&tmp);
    written.map_err(|e| format!("cannot unpack into {}: {e}", dest.display()))?;
    Ok(true)
}

fn unpack<R: Read + std::io::Seek>(
    archive: &mut zip::ZipArchive<R>,
    plan: &[(usize, String, bool, bool, u64)],
    root: &Path,
) -> std::io::Result<()> {
    let make_dir = |dir: &Path| -> std::io::Result<()> {
        let mut at = root.to_path_buf();
        create_dir(&at)?;
        for part in dir.components() {
            if let Component::Normal(part) = part {
                at.push(part);
                create_dir(&at)?;
            }
        }
        Ok(())
    };
    make_dir(Path::new(""))?;
    for (index, path, is_dir, executable, declared) in plan {
        let path = Path::new(path);
        if *is_dir {
            make_dir(path)?;
            continue;
        }
        make_dir(path.parent().unwrap_or(Path::new("")))?;
        let mode = if *executable { 0o755 } else { 0o644 };
        let target = root.join(path);
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&target)?;
        let entry = archive.by_index(*index).map_err(std::io::Error::other)?;
        // A zip's sizes are its own word: an entry that inflates past its declared size (a
        // zip bomb) is refused, not written out.
        let copied = std::io::copy(&mut entry.take(declared.saturating_add(1)), &mut out)?;
        if copied > *declared {
            return Err(std::io::Error::other(format!(
                "{} unpacks to more than the {declared} bytes it declares",
                path.display()
            )));
        }
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

fn create_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(e),
    }
}

/// The sync's own scratch directory in the wheelhouse (same filesystem, so downloaded
/// wheels are renamed into place), removed when the sync ends.
#[derive(Debug)]
struct Scratch {
    path: PathBuf,
}

impl Scratch {
    fn create(wheelhouse: &Path) -> anyhow::Result<Scratch> {
        let path = wheelhouse.join(format!(".sync-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Scratch { path })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;
    use zip::write::SimpleFileOptions;

    /// A zip of `(name, contents, unix mode)` entries.
    fn zip_of(entries: &[(&str, &str, u32)]) -> Vec<u8> {
        let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
        for (name, text, mode) in entries {
            let options = SimpleFileOptions::default().unix_permissions(*mode);
            if name.ends_with('/') {
                zip.add_directory(*name, options).expect("works");
            } else {
                zip.start_file(*name, options).expect("works");
                zip.write_all(text.as_bytes()).expect("works");
            }
        }
        zip.finish().expect("works").into_inner()
    }

    fn plan_of(bytes: Vec<u8>) -> Result<Vec<String>, String> {
        let mut archive = zip::ZipArchive::new(Cursor::new(bytes)).expect("works");
        plan_unpack(&mut archive).map(|plan| plan.into_iter().map(|(_, path, ..)| path).collect())
    }

    fn image() -> BTreeMap<String, (String, String)> {
        BTreeMap::from([
            ("numpy".to_owned(), ("numpy".to_owned(), "2.4.6".to_owned())),
            (
                "pygments".to_owned(),
                ("Pygments".to_owned(), "2.21.0".to_owned()),
            ),
        ])
    }

    /// As pip 23.2 wrote it for `kgfix-app` from a --find-links directory.
    const REPORT: &str = r#"{
      "version": "1", "pip_version": "23.2.1",
      "install": [
        {"download_info": {"url": "file:///tmp/kgfix/links/kgfix_app-1.0-py3-none-any.whl",
           "archive_info": {"hash": "sha256=BE1E2E2AF673117E14E484DBF5465D2A687E7DC9396C77E840BA1952CFA6AC84",
             "hashes": {"sha256": "BE1E2E2AF673117E14E484DBF5465D2A687E7DC9396C77E840BA1952CFA6AC84"}}},
         "is_direct": false, "requested": true,
         "metadata": {"metadata_version": "2.1", "name": "KGFix_App", "version": "1.0",
           "summary": "App fixture", "requires_dist": ["kgfix-dep>=0.1"]}},
        {"download_info": {"url": "https://files.example/packages/ab/kgfix_dep-0.1%2Bl-py3-none-any.whl#sha256=32",
           "archive_info": {"hash": "sha256=3293e56236d82fcabd6598526486fb8ee5a18e37d4267580e1c38c355b503ea0"}},
         "is_direct": false, "requested": false,
         "metadata": {"metadata_version": "2.1", "name": "kgfix-dep", "version": "0.1+l", "summary": ""}}
      ],
      "environment": {"python_version": "3.11"}
    }"#;

    #[test]
    fn a_pip_report_gives_names_versions_urls_hashes_and_summaries() {
        let items = parse_report(REPORT).expect("works");
        assert_eq!(items.len(), 2);
        assert_eq!(
            items[0],
            Resolved {
                name: "KGFix_App".to_owned(),
                key: "kgfix-app".to_owned(),
                version: "1.0".to_owned(),
                url: "file:///tmp/kgfix/links/kgfix_app-1.0-py3-none-any.whl".to_owned(),
                sha256: Some(
                    "be1e2e2af673117e14e484dbf5465d2a687e7dc9396c77e840ba1952cfa6ac84".to_owned()
                ),
                summary: Some("App fixture".to_owned()),
                requested: true,
            }
        );
        // An older report has only `hash`; an empty summary is none.
        assert_eq!(
            items[1].sha256.as_deref(),
            Some("3293e56236d82fcabd6598526486fb8ee5a18e37d4267580e1c38c355b503ea0")
        );
        assert_eq!(items[1].summary, None);
        assert!(!items[1].requested);
        assert!(parse_report(r#"{"version": "2", "install": []}"#).is_err());
    }

    #[test]
    fn wheel_names_and_local_paths_come_from_urls() {
        assert_eq!(
            wheel_file_name(
                "https://files.example/packages/ab/kgfix_dep-0.1%2Bl-py3-none-any.whl#sha256=32"
            )
            .as_deref(),
            Some("kgfix_dep-0.1+l-py3-none-any.whl")
        );
        assert_eq!(wheel_file_name("https://files.example/x-1.0.tar.gz"), None);
        assert_eq!(wheel_file_name("https://files.example/a%2Fb.whl"), None);
        assert_eq!(
            file_url_path("file:///tmp/my%20links/a-1-py3-none-any.whl"),
            Some(PathBuf::from("/tmp/my links/a-1-py3-none-any.whl"))
        );
        assert_eq!(
            file_url_path("file://localhost/w/a.whl"),
            Some(PathBuf::from("/w/a.whl"))
        );
        assert_eq!(file_url_path("https://files.example/a.whl"), None);
    }

    #[test]
    fn a_conflict_with_the_image_says_what_the_image_has() {
        let stdout = "Looking in links: links\nProcessing ./links/kgfix_needs_numpy1-1.0-py3-none-any.whl\n\nThe conflict is caused by:\n    kgfix-needs-numpy1 1.0 depends on numpy<2\n    The user requested (constraint) numpy==2.4.6\n\nTo fix this you could try to:\n1. loosen the range\n";
        let stderr = "ERROR: Cannot install kgfix-needs-numpy1==1.0 because these package versions have conflicting dependencies.\nERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/#dealing-with-dependency-conflicts\n";
        assert_eq!(
            resolution_failure(stdout, stderr, &image()).expect("works"),
            "conflicting dependencies: kgfix-needs-numpy1 1.0 depends on numpy<2; the image has numpy 2.4.6"
        );
        let stdout = "The conflict is caused by:\n    b 1.0 depends on a==2\n    The user requested (constraint) a==1.0\n";
        assert_eq!(
            resolution_failure(stdout, stderr, &image()).expect("works"),
            "conflicting dependencies: b 1.0 depends on a==2; a 1.0 is locked for an earlier allowlist entry"
        );
        // Without the causes (pip --quiet), the first error line.
        assert_eq!(
            resolution_failure("", stderr, &image()).expect("works"),
            "Cannot install kgfix-needs-numpy1==1.0 because these package versions have conflicting dependencies."
        );
    }

    #[test]
    fn a_missing_package_says_that_none_was_found() {
        let stderr = "ERROR: Ignored the following versions that require a different python version: 2.0 Requires-Python >=3.12\nERROR: Could not find a version that satisfies the requirement nonexistent (from versions: none)\nERROR: No matching distribution found for nonexistent\n";
        assert_eq!(
            resolution_failure("Looking in links: x\n", stderr, &image()).expect("works"),
            "Could not find a version that satisfies the requirement nonexistent (from versions: none)"
        );
        assert_eq!(
            resolution_failure("", "Traceback\n  boom  \n\n", &image()).expect("works"),
            "boom"
        );
        assert_eq!(resolution_failure("", "", &image()), None);
        let long = format!("ERROR: {}\n", "x ".repeat(1000));
        assert!(
            resolution_failure("", &long, &image())
                .expect("works")
                .len()
                <= MAX_REASON + 3
        );
    }

    #[test]
    fn constraints_pin_every_name_once_and_sorted() {
        let pinned = BTreeMap::from([
            ("pygments", "2.21.0"),
            ("kgfix-dep", "0.1"),
            ("numpy", "2.4.6"),
        ]);
        let text = constraints(&pinned);
        let lines: Vec<_> = text.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            lines,
            ["kgfix-dep==0.1", "numpy==2.4.6", "pygments==2.21.0"]
        );
    }

    #[test]
    fn only_pinnable_image_versions_are_pinned() {
        let facts = ImagePython {
            version: "3.11.2".to_owned(),
            implementation: "cp".to_owned(),
            abi: "cp311".to_owned(),
            platforms: vec!["linux_x86_64".to_owned()],
            installed: vec![
                ("Pygments".to_owned(), "2.21.0".to_owned()),
                ("torch".to_owned(), "2.5.0+cpu".to_owned()),
                ("odd".to_owned(), "1.0-beta 2".to_owned()),
                ("-bad".to_owned(), "1".to_owned()),
            ],
        };
        let pins = facts.pins();
        assert_eq!(pins.keys().collect::<Vec<_>>(), ["pygments", "torch"]);
        assert_eq!(
            pins["pygments"],
            ("Pygments".to_owned(), "2.21.0".to_owned())
        );
    }

    #[test]
    fn pip_targets_the_images_interpreter() {
        let target = PythonTarget {
            version: "3.11.2".to_owned(),
            implementation: "cp".to_owned(),
            abi: "cp311".to_owned(),
            platforms: vec![
                "manylinux_2_36_x86_64".to_owned(),
                "linux_x86_64".to_owned(),
            ],
        };
        assert_eq!(
            target_args(&target).join(" "),
            "--python-version 3.11.2 --implementation cp --abi cp311 --abi abi3 --abi none --platform manylinux_2_36_x86_64 --platform linux_x86_64"
        );
        let odd = PythonTarget {
            version: "3.13.0rc1".to_owned(),
            ..target
        };
        assert_eq!(target_args(&odd)[1], "3.13.0");
        let links = source_args(
            &[PathBuf::from("/srv/links")],
            Path::new("/w/.sync-1/in-image"),
        );
        assert_eq!(
            links.join(" "),
            "--isolated --no-index --find-links /srv/links --find-links /w/.sync-1/in-image"
        );
        assert_eq!(
            source_args(&[], Path::new("/s")).join(" "),
            "--find-links /s"
        );
    }

    #[test]
    fn the_interpreter_is_the_one_the_image_runs() {
        let strings = |s: &[&str]| s.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            image_interpreter(
                &strings(&["/usr/bin/tini", "-g", "--"]),
                &strings(&["/opt/kernel/venv/bin/python", "/opt/kernel/launch.py"])
            ),
            "/opt/kernel/venv/bin/python"
        );
        assert_eq!(
            image_interpreter(&[], &strings(&["python3.12", "-m", "x"])),
            "python3.12"
        );
        assert_eq!(
            image_interpreter(&[], &strings(&["/usr/bin/python-config"])),
            "python3"
        );
        assert_eq!(
            image_interpreter(&[], &strings(&["jupyter", "kernel"])),
            "python3"
        );
    }

    #[test]
    fn pip_versions_are_read_from_its_banner() {
        assert_eq!(
            pip_version("pip 23.2.1 from /x/pip (python 3.11)\n"),
            Some((23, 2))
        );
        assert_eq!(pip_version("pip 24.0 from /x"), Some((24, 0)));
        assert_eq!(pip_version("pip 25.1b1 from /x"), Some((25, 1)));
        assert!(pip_version("pip 21.3.1 from /x").expect("works") < MIN_PIP);
        assert_eq!(pip_version("Python 3.11"), None);
    }

    #[test]
    fn entries_go_to_the_root_and_data_schemes_as_site_packages_would() {
        assert_eq!(
            install_path("pkg/__init__.py").expect("works").as_deref(),
            Some("pkg/__init__.py")
        );
        assert_eq!(
            install_path("./pkg//m.py").expect("works").as_deref(),
            Some("pkg/m.py")
        );
        assert_eq!(
            install_path("pkg-1.0.data/purelib/extra/m.py")
                .expect("works")
                .as_deref(),
            Some("extra/m.py")
        );
        assert_eq!(
            install_path("pkg-1.0.data/platlib/_c.so")
                .expect("works")
                .as_deref(),
            Some("_c.so")
        );
        for dropped in [
            "pkg-1.0.data/scripts/run",
            "pkg-1.0.data/headers/a.h",
            "pkg-1.0.data/data/share/x",
            "pkg-1.0.data/purelib/",
        ] {
            assert_eq!(install_path(dropped).expect("works"), None, "{dropped}");
        }
        for unsafe_path in ["/etc/passwd", "pkg/../../x", "..", "pkg\\..\\x", "a\0b"] {
            let err = install_path(unsafe_path).expect_err("fails");
            assert!(err.contains("unsafe path"), "{unsafe_path}: {err}");
        }
    }

    #[test]
    fn pth_files_that_site_would_run_are_refused() {
        let err = plan_of(zip_of(&[
            ("m.py", "", 0o644),
            ("evil.pth", "import os", 0o644),
        ]))
        .expect_err("fails");
        assert!(err.contains(".pth") && err.contains("evil.pth"), "{err}");
        let err = plan_of(zip_of(&[("p-1.data/platlib/Evil.PTH", "import os", 0o644)]))
            .expect_err("fails");
        assert!(err.contains("p-1.data/platlib/Evil.PTH"), "{err}");
        // Deeper in a package, or under a scheme that is dropped, site never reads it.
        let plan = plan_of(zip_of(&[
            ("pkg/data.pth", "", 0o644),
            ("p-1.data/data/x.pth", "", 0o644),
        ]))
        .expect("works");
        assert_eq!(plan, ["pkg/data.pth"]);
    }

    #[test]
    fn unsafe_and_duplicate_entries_are_refused() {
        let err = plan_of(zip_of(&[("../outside.py", "", 0o644)])).expect_err("fails");
        assert!(err.contains("unsafe path"), "{err}");
        let err = plan_of(zip_of(&[
            ("m.py", "a", 0o644),
            ("p-1.data/purelib/m.py", "b", 0o644),
        ]))
        .expect_err("fails");
        assert!(err.contains("two entries for m.py"), "{err}");
    }

    #[test]
    fn a_wheel_unpacks_once_with_site_packages_layout_and_modes() {
        let dir = tempfile::tempdir().expect("works");
        let wheel = dir.path().join("p-1.0-py3-none-any.whl");
        std::fs::write(
            &wheel,
            zip_of(&[
                ("p/", "", 0o755),
                ("p/__init__.py", "X = 1\n", 0o664),
                ("p/tool", "#!/bin/sh\n", 0o775),
                ("p-1.0.data/purelib/p_extra.py", "Y = 2\n", 0o644),
                ("p-1.0.data/scripts/p-run", "#!python\n", 0o755),
                ("p-1.0.dist-info/METADATA", "Name: p\nVersion: 1.0\n", 0o644),
            ]),
        )
        .expect("works");
        let sha = sha256_of(&wheel).expect("works");
        let dest = dir.path().join("image").join("p-1.0");
        std::fs::create_dir(dir.path().join("image")).expect("works");
        assert_eq!(install_wheel(&wheel, &sha, &dest), Ok(true));
        let mode = |p: &str| {
            std::fs::metadata(dest.join(p))
                .expect("works")
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(
            std::fs::read_to_string(dest.join("p/__init__.py")).expect("works"),
            "X = 1\n"
        );
        assert_eq!(
            std::fs::read_to_string(dest.join("p_extra.py")).expect("works"),
            "Y = 2\n"
        );
        assert!(dest.join("p-1.0.dist-info/METADATA").is_file());
        assert!(!dest.join("p-1.0.data").exists() && !dest.join("p-run").exists());
        assert_eq!(
            (mode(""), mode("p"), mode("p/__init__.py"), mode("p/tool")),
            (0o755, 0o755, 0o644, 0o755)
        );
        // Present: left as it is; nothing temporary left beside it.
        assert_eq!(install_wheel(&wheel, &sha, &dest), Ok(false));
        let names: Vec<_> = std::fs::read_dir(dir.path().join("image"))
            .expect("works")
            .map(|e| e.expect("works").file_name())
            .collect();
        assert_eq!(names, ["p-1.0"]);
        // A wheel that is not the one resolved is never unpacked.
        let other = dir.path().join("image").join("p-1.0-again");
        let err = install_wheel(&wheel, &"0".repeat(64), &other).expect_err("fails");
        assert!(err.contains("expected 0000"), "{err}");
        assert!(!other.exists());
    }

    #[test]
    fn a_tree_names_its_wheel_and_other_bytes_of_its_version_are_refused() {
        let dir = tempfile::tempdir().expect("works");
        let wheel = dir.path().join("p-1.0-py3-none-any.whl");
        std::fs::write(&wheel, zip_of(&[("p.py", "X = 1\n", 0o644)])).expect("works");
        let sha = sha256_of(&wheel).expect("works");
        let dest = dir.path().join("p-1.0");
        let none = HashMap::new();
        assert_eq!(
            same_bytes_as_unpacked(&dest, &"1".repeat(64), &none),
            Ok(())
        );
        assert_eq!(install_wheel(&wheel, &sha, &dest), Ok(true));
        assert_eq!(
            std::fs::read_to_string(dest.join(UNPACKED_FROM)).expect("works"),
            format!("{sha}\n")
        );
        assert_eq!(same_bytes_as_unpacked(&dest, &sha, &none), Ok(()));
        let err = same_bytes_as_unpacked(&dest, &"1".repeat(64), &none).expect_err("fails");
        assert!(
            err.contains(&sha) && err.contains("1111") && err.contains("delete"),
            "{err}"
        );
        // A tree unpacked before trees named their wheel: the last lock speaks for it.
        std::fs::remove_file(dest.join(UNPACKED_FROM)).expect("works");
        assert_eq!(
            same_bytes_as_unpacked(&dest, &"1".repeat(64), &none),
            Ok(())
        );
        let previous = HashMap::from([("p-1.0".to_owned(), sha.clone())]);
        assert!(same_bytes_as_unpacked(&dest, &"1".repeat(64), &previous).is_err());
        assert_eq!(same_bytes_as_unpacked(&dest, &sha, &previous), Ok(()));
    }

    #[test]
    fn stand_in_wheels_carry_only_the_images_name_and_version() {
        let dir = tempfile::tempdir().expect("works");
        write_stub_wheel(dir.path(), "Pygments", "2.21.0").expect("works");
        let path = dir.path().join("pygments-2.21.0-py3-none-any.whl");
        let mut archive =
            zip::ZipArchive::new(std::fs::File::open(&path).expect("works")).expect("works");
        let mut metadata = String::new();
        archive
            .by_name("pygments-2.21.0.dist-info/METADATA")
            .expect("works")
            .read_to_string(&mut metadata)
            .expect("works");
        assert!(
            metadata.contains("Name: Pygments\nVersion: 2.21.0\n"),
            "{metadata}"
        );
        assert_eq!(archive.len(), 3);
    }

    #[test]
    fn a_conflict_with_the_entry_itself_names_the_entry() {
        let stdout = "The conflict is caused by:\n    The user requested numpy<2\n    The user requested (constraint) numpy==2.4.6\n\n";
        assert_eq!(
            resolution_failure(stdout, "", &image()).expect("works"),
            "conflicting dependencies: the allowlist entry asks for numpy<2; the image has numpy 2.4.6"
        );
    }

    #[test]
    fn sizes_are_said_in_kib_or_mib() {
        assert_eq!(size(0), "0 KiB");
        assert_eq!(size(5220), "6 KiB");
        assert_eq!(size(1_153_129), "1.1 MiB");
    }

    #[test]
    fn summaries_say_how_many_more() {
        assert_eq!(summarize(&["a", "b", "c"], 2), "a, b and 1 more");
        assert_eq!(summarize(&["a"], 2), "a");
    }

    /// What `packages sync` runs in the image is locked down like a kernel: no
    /// capabilities, read-only root, no network, the kernels' runtime, and the image's
    /// launcher first, which installs the kernels' syscall filter before it runs the
    /// command.
    #[test]
    fn the_syncs_containers_get_the_kernels_hardening() {
        use crate::backend::docker::{one_shot_body, Runtime, LAUNCHER_EXEC};
        let python = "/opt/kernel/venv/bin/python";
        let launcher: Vec<String> = [python, "/opt/kernel/launch.py", "/run/kernel/kernel.json"]
            .map(str::to_owned)
            .to_vec();
        let probe = probe_request("sha256:abc", python);
        let compile = compile_request(
            "sha256:abc",
            python,
            Path::new("/srv/wheelhouse/abc"),
            (0, 0),
            &["pkg".to_owned()],
        );
        for (runtime, engine_name) in [
            (Runtime::Runc, "runc"),
            (Runtime::Runsc, "kernelgate-runsc"),
            (Runtime::RunscPtrace, "kernelgate-runsc-ptrace"),
        ] {
            for request in [&probe, &compile] {
                let body = one_shot_body(request, runtime, &launcher).expect("a body");
                let host = body.host_config.clone().expect("host config");
                assert_eq!(
                    host.runtime.as_deref(),
                    Some(engine_name),
                    "the kernels' runtime"
                );
                assert_eq!(host.cap_drop, Some(vec!["ALL".to_owned()]));
                assert_eq!(host.cap_add, None);
                assert_eq!(host.privileged, None);
                assert_eq!(host.readonly_rootfs, Some(true));
                assert_eq!(host.network_mode.as_deref(), Some("none"));
                assert_eq!(
                    host.security_opt,
                    Some(vec!["no-new-privileges".to_owned()]),
                    "Docker's default seccomp profile stays, no privileges can be gained"
                );
                assert_eq!(host.memory, Some(512 << 20));
                assert_eq!(host.memory_swap, host.memory);
                assert_eq!(host.pids_limit, Some(64));
                let ulimits = host.ulimits.expect("ulimits");
                assert!(
                    ulimits
                        .iter()
                        .any(|u| u.name.as_deref() == Some("core") && u.hard == Some(0)),
                    "no core files"
                );
                // The filter: the image's entrypoint (tini) starts its launcher, which
                // installs the filter and then runs the command.
                assert_eq!(body.entrypoint, None, "the image's entrypoint stays");
                let cmd = body.cmd.expect("a command");
                assert_eq!(cmd[..3], launcher[..]);
                assert_eq!(cmd[3], LAUNCHER_EXEC);
                assert_eq!(cmd[4..], request.argv[..]);
                assert_eq!(body.working_dir.as_deref(), Some("/"));
                assert_eq!(body.image.as_deref(), Some("sha256:abc"));
            }
            let probe_body = one_shot_body(&probe, runtime, &launcher).expect("a body");
            assert_eq!(
                probe_body.user.as_deref(),
                Some("1000:1000"),
                "the kernel's user"
            );
            assert_eq!(probe_body.host_config.expect("host").binds, None);
            // The compile step writes as the wheelhouse's owner, only there.
            let compile_body = one_shot_body(&compile, runtime, &launcher).expect("a body");
            assert_eq!(compile_body.user.as_deref(), Some("0:0"));
            assert_eq!(
                compile_body.host_config.expect("host").binds,
                Some(vec!["/srv/wheelhouse/abc:/wheelhouse:rw".to_owned()])
            );
        }
    }

    /// The sync asks the backend, never an engine of its own: against the fake engine it
    /// makes the same two runs, and reports the probe's failure with what it printed.
    #[tokio::test]
    async fn the_sync_runs_through_the_backend() {
        let fake = crate::backend::fake::FakeBackend::new();
        let err = probe_python(fake.as_ref(), "sha256:abc", "python3")
            .await
            .expect_err("the fake prints no facts");
        assert!(format!("{err:#}").contains("printed no facts"), "{err:#}");
        assert_eq!(fake.runs(), vec![probe_request("sha256:abc", "python3")]);
    }
}
