//! The image's own Python, asked in a throwaway sandbox with the kernels' hardening: what
//! it is (version, ABI, platform tags, installed distributions), and compiling what a
//! sync unpacked with it.

use super::pip::{is_plain_version, last_line};
use crate::backend::sandbox::{Mount, RunOnce};
use crate::backend::{BackendError, KernelBackend};
use crate::packages::allowlist::{self, normalize};
use crate::packages::lock::PythonTarget;
use anyhow::{bail, Context};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// How long the image's Python may take to describe itself.
const PROBE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long compiling the newly unpacked packages may take.
const COMPILE_TIMEOUT: Duration = Duration::from_secs(600);

/// The interpreter the image's kernel runs: the first `python*` of its entrypoint and
/// command (`/opt/kernel/venv/bin/python`), else `python3` from the image's PATH.
pub(super) fn image_interpreter(entrypoint: &[String], cmd: &[String]) -> String {
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
pub(super) const PROBE: &str = r#"
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
pub(super) struct ImagePython {
    pub(super) version: String,
    pub(super) implementation: String,
    pub(super) abi: String,
    pub(super) platforms: Vec<String>,
    /// (display name, version) of every installed distribution.
    pub(super) installed: Vec<(String, String)>,
}

impl ImagePython {
    pub(super) fn target(&self) -> PythonTarget {
        PythonTarget {
            version: self.version.clone(),
            implementation: self.implementation.clone(),
            abi: self.abi.clone(),
            platforms: self.platforms.clone(),
        }
    }

    /// Normalized name -> (display name, version) of the installed distributions whose
    /// version pip can pin (a malformed one would make the constraints file unreadable).
    pub(super) fn pins(&self) -> BTreeMap<String, (String, String)> {
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
pub(super) const MAX_RUN_OUTPUT: usize = 16 << 20;

/// Runs `request` once through the backend (a throwaway sandbox with the kernels'
/// hardening and syscall filter): its standard output, once it exited with 0.
pub(super) async fn oneshot(
    backend: &dyn KernelBackend,
    request: RunOnce,
) -> anyhow::Result<String> {
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
pub(super) fn probe_request(image_id: &str, interpreter: &str) -> RunOnce {
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
pub(super) async fn probe_python(
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
pub(super) fn compile_request(
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
pub(super) async fn compile(
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
