//! The host's pip, driven for the image's interpreter: the target and source options,
//! the constraints and stand-in wheels for what the image has, and pip's report and
//! refusals read back.

use crate::packages::allowlist::normalize;
use crate::packages::lock::PythonTarget;
use anyhow::{anyhow, bail, Context};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Output;
use tokio::process::Command;

/// The oldest pip with `install --dry-run --report`.
pub(super) const MIN_PIP: (u32, u32) = (22, 2);
/// Longest refusal reason kept (pip can be verbose).
pub(super) const MAX_REASON: usize = 400;

/// The host's pip, set up for the image's interpreter.
pub(super) struct Pip {
    pub(super) python: PathBuf,
    /// `--python-version ... --platform ...`.
    pub(super) target: Vec<String>,
    /// `--find-links` / `--no-index`.
    pub(super) source: Vec<String>,
    pub(super) scratch: PathBuf,
}

/// A resolution pip refused: what it printed.
#[derive(Debug)]
pub(super) struct ResolveFailure {
    pub(super) stdout: String,
    pub(super) stderr: String,
    pub(super) status: Option<i32>,
}

impl ResolveFailure {
    pub(super) fn reason(&self, image: &BTreeMap<String, (String, String)>) -> String {
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
    pub(super) async fn resolve(
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
    pub(super) async fn download(
        &self,
        item: &Resolved,
        dir: &Path,
    ) -> anyhow::Result<Result<(), String>> {
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
pub(super) fn common_args() -> [&'static str; 3] {
    [
        "--only-binary=:all:",
        "--no-input",
        "--disable-pip-version-check",
    ]
}

pub(super) async fn run(mut command: Command, python: &Path) -> anyhow::Result<Output> {
    command
        .output()
        .await
        .with_context(|| format!("cannot run {}", python.display()))
}

/// Fails unless `python -m pip` works and is new enough for `--dry-run --report`.
pub(super) async fn check_pip(python: &Path) -> anyhow::Result<()> {
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
pub(super) fn pip_version(text: &str) -> Option<(u32, u32)> {
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

/// `--python-version`, `--implementation`, `--abi` and `--platform` options for `target`.
pub(super) fn target_args(target: &PythonTarget) -> Vec<String> {
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
pub(super) fn source_args(find_links: &[PathBuf], stubs: &Path) -> Vec<String> {
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
pub(super) fn constraints(pinned: &BTreeMap<&str, &str>) -> String {
    let mut text = String::from(
        "# The kernel image's distributions and what earlier allowlist entries locked.\n",
    );
    for (name, version) in pinned {
        text.push_str(&format!("{name}=={version}\n"));
    }
    text
}

/// A version simple enough to pin and to put in a wheel file name (PEP 440 characters).
pub(super) fn is_plain_version(version: &str) -> bool {
    version.starts_with(|c: char| c.is_ascii_digit())
        && version
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '!' | '+'))
}

/// A metadata-only wheel standing in for a distribution the image has, so pip can resolve
/// against it without the index having it (and without downloading it).
pub(super) fn write_stub_wheel(dir: &Path, name: &str, version: &str) -> std::io::Result<()> {
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
pub(super) struct Resolved {
    /// Display name.
    pub(super) name: String,
    /// Normalized name.
    pub(super) key: String,
    pub(super) version: String,
    pub(super) url: String,
    pub(super) sha256: Option<String>,
    pub(super) summary: Option<String>,
    /// Named by the requirement itself (not pulled in).
    pub(super) requested: bool,
}

/// The `install` items of a pip installation report (format version 1).
pub(super) fn parse_report(text: &str) -> Result<Vec<Resolved>, String> {
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
pub(super) fn resolution_failure(
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
    Some(crate::text::cut(
        &crate::text::one_line(&reason),
        MAX_REASON,
    ))
}

pub(super) fn last_error(stderr: &str) -> Option<&str> {
    stderr
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("ERROR: "))
        .or_else(|| last_line(stderr))
}

pub(super) fn last_line(text: &str) -> Option<&str> {
    text.lines().map(str::trim).rfind(|l| !l.is_empty())
}
