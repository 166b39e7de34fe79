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
use super::lock::{self, Lock, LockedPackage, LockedRequirement, Refused};
use crate::backend::{BackendError, KernelBackend};
use anyhow::{anyhow, bail, Context};
pub use progress::Progress;
use std::collections::{BTreeMap, HashMap};

use std::path::{Path, PathBuf};

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

/// Resolves `opts.entries` for `opts.image`, fills the wheelhouse and writes the image's
/// lock. Entries that cannot be synced are refused in the lock (and the report); errors
/// are for what stops the whole sync (no image, no pip, an unwritable wheelhouse).
pub async fn sync(
    backend: &dyn KernelBackend,
    opts: &SyncOptions,
    progress: &mut (dyn FnMut(Progress<'_>) + Send),
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
    progress(Progress::Image {
        image: &opts.image,
        key: &key,
        interpreter: &interpreter,
        target: &target,
    });

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
        progress(Progress::Resolving {
            requirement: &entry.requirement,
        });
        match run.entry(entry).await? {
            Ok(packages) => {
                let brings: Vec<String> = packages
                    .iter()
                    .filter_map(|key| run.locked.get(key))
                    .map(|p| format!("{} {}", p.name, p.version))
                    .collect();
                progress(Progress::Locked {
                    requirement: &entry.requirement,
                    brings,
                });
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
                progress(Progress::Refused {
                    requirement: &entry.requirement,
                    reason: &reason,
                });
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
            Ok(()) => progress(Progress::Compiled {
                packages: report.unpacked.len(),
            }),
            Err(e) => progress(Progress::NotCompiled {
                error: format!("{e:#}"),
            }),
        }
    }
    let mut in_image: Vec<&str> = report
        .in_image
        .iter()
        .filter_map(|p| p.split(' ').next())
        .collect();
    in_image.sort_by_key(|name| normalize(name));
    progress(Progress::Fetched {
        wheels: report.fetched.len(),
        bytes: report.fetched_bytes,
        reused: report.reused.len(),
        in_image,
    });

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
    progress(Progress::Wrote {
        lock: &report.lock_path,
        synced: report.synced.len(),
        entries: opts.entries.len(),
        refused: report.refused.len(),
        unpacked: report.unpacked.len(),
    });
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

mod image;
mod pip;
mod progress;
mod wheels;
use image::{compile, image_interpreter, probe_python};
use pip::{check_pip, constraints, source_args, target_args, write_stub_wheel, Pip, Resolved};
use wheels::{
    file_sha256, file_url_path, install_wheel, previous_trees, same_bytes_as_unpacked,
    wheel_file_name,
};

#[cfg(test)]
mod tests;
