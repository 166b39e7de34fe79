//! A sandbox's bundle on the host: `<runtime-dir>/gvisor/bundles/<handle>` holds its OCI
//! `config.json` (from [`oci`](super::oci)), the engine's record `meta.json` (labels,
//! owner, the kernel a restart moved in: what [`KernelBackend::list`] reports), the
//! sandbox's own output (`kernel.log`, bounded by [`trim_log`]), and runsc's boot log,
//! where the sandbox's exit status is read back ([`exit_status_of`]).
//!
//! [`KernelBackend::list`]: crate::backend::KernelBackend::list

use super::{oci, GvisorEngine};
use crate::backend::docker::socket_dir;
use crate::backend::sandbox::SandboxSpec;
use crate::backend::BackendError;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// What the engine keeps beside a bundle: what `list` reports.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub(super) struct Meta {
    pub image: String,
    pub image_id: String,
    pub labels: BTreeMap<String, String>,
    pub memory_mb: u64,
    /// The kernel's socket directory, for a kernel.
    pub socket_dir: Option<PathBuf>,
    /// The tenant that owns it, once handed out.
    pub owner: Option<String>,
    /// The kernel a restart moved into it.
    pub serves: Option<String>,
    /// The image's command (its launcher), which commands run in the sandbox go through.
    #[serde(default)]
    pub launcher: Vec<String>,
}

/// A bundle written for a sandbox not created yet.
pub(super) struct Written {
    pub handle: String,
    pub bundle: PathBuf,
}

/// The most a sandbox's output file holds before it is moved aside (one older file is
/// kept, as Docker's `json-file` log with `max-size` keeps its own).
pub const LOG_MAX_BYTES: u64 = 10 << 20;

/// Where a kernel's stdout and stderr go (one file: what it wrote outside ipykernel's
/// capture, and runsc's own errors), and the file it is moved to past [`LOG_MAX_BYTES`].
pub fn kernel_log(bundle: &Path) -> PathBuf {
    bundle.join("kernel.log")
}

fn older_log(bundle: &Path) -> PathBuf {
    bundle.join("kernel.log.1")
}

/// runsc's log of the sandbox process (`runsc boot`): its last line names the exit status.
pub fn boot_log(bundle: &Path) -> PathBuf {
    bundle.join("runsc-boot.log")
}

/// Where a sandbox's stdout and stderr go: two files for a sandbox made from a spec (a
/// one-shot run reads them apart), one [`kernel_log`] for a kernel.
pub fn output(bundle: &Path, kernel: bool) -> (PathBuf, PathBuf) {
    if kernel {
        (kernel_log(bundle), kernel_log(bundle))
    } else {
        (bundle.join("stdout"), bundle.join("stderr"))
    }
}

/// Keeps a kernel's output file bounded: past [`LOG_MAX_BYTES`] it is copied to
/// `kernel.log.1` (replacing the older copy) and emptied. The sandbox appends (`O_APPEND`),
/// so it goes on writing at the new end.
pub fn trim_log(bundle: &Path) -> std::io::Result<bool> {
    let log = kernel_log(bundle);
    let Ok(meta) = std::fs::metadata(&log) else {
        return Ok(false);
    };
    if meta.len() <= LOG_MAX_BYTES {
        return Ok(false);
    }
    std::fs::copy(&log, older_log(bundle))?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&log)?
        .set_len(0)?;
    Ok(true)
}

/// The exit status runsc's boot log gives for the sandbox's process (`Exiting with
/// status: N`, a wait status), as a shell reports it; `None` while it has not ended.
pub fn exit_status_of(boot_log: &str) -> Option<i64> {
    boot_log.lines().rev().find_map(|line| {
        let (_, status) = line.split_once("Exiting with status: ")?;
        status
            .trim()
            .parse::<i64>()
            .ok()
            .map(super::runsc::exit_code)
    })
}

/// The end of a file (its last 64 KiB), as text: where a log's last lines are.
pub fn tail(path: &Path) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    const TAIL: u64 = 64 << 10;
    let mut file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(TAIL)))?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

pub(super) fn io_error(path: &Path, e: std::io::Error) -> BackendError {
    BackendError::Runtime(format!("{}: {e}", path.display()))
}

impl GvisorEngine {
    pub(super) fn bundle(&self, handle: &str) -> Option<PathBuf> {
        socket_dir::is_safe_kernel_id(handle).then(|| {
            self.settings
                .runtime_dir
                .join("gvisor")
                .join("bundles")
                .join(handle)
        })
    }

    pub(super) fn existing_bundle(&self, handle: &str) -> Result<PathBuf, BackendError> {
        self.bundle(handle)
            .filter(|b| b.join("meta.json").is_file())
            .ok_or_else(|| BackendError::Gone {
                handle: handle.to_owned(),
            })
    }

    pub(super) fn read_meta(&self, handle: &str) -> Result<Meta, BackendError> {
        let path = self.existing_bundle(handle)?.join("meta.json");
        let text = std::fs::read(&path).map_err(|e| io_error(&path, e))?;
        serde_json::from_slice(&text)
            .map_err(|e| BackendError::Runtime(format!("{}: {e}", path.display())))
    }

    pub(super) fn write_meta(&self, handle: &str, meta: &Meta) -> Result<(), BackendError> {
        let bundle = self.bundle(handle).ok_or_else(|| BackendError::Gone {
            handle: handle.to_owned(),
        })?;
        let path = bundle.join("meta.json");
        let tmp = bundle.join("meta.json.new");
        let text = serde_json::to_vec_pretty(meta).expect("meta serialises");
        std::fs::write(&tmp, text).map_err(|e| io_error(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io_error(&path, e))
    }

    pub(super) fn runtime_dir_label(&self) -> String {
        self.settings.runtime_dir.to_string_lossy().into_owned()
    }

    /// Writes the bundle of `spec`: its OCI config and the engine's own record.
    pub(super) fn write_bundle(
        &self,
        spec: &SandboxSpec,
        socket_dir: Option<PathBuf>,
    ) -> Result<Written, BackendError> {
        let image = (self.resolve)(&spec.image)?;
        let handle = format!("kg{}", uuid::Uuid::new_v4().simple());
        let bundle = self.bundle(&handle).expect("a safe handle");
        let config =
            oci::config(&handle, spec, &image, self.cgroups).map_err(BackendError::Runtime)?;
        {
            let _layout = self.layout.lock().expect("layout lock");
            std::fs::create_dir_all(&self.runsc.root).map_err(|e| io_error(&self.runsc.root, e))?;
            let bundles = bundle.parent().expect("under bundles/");
            std::fs::create_dir_all(bundles).map_err(|e| io_error(bundles, e))?;
            // Only root reads a sandbox's config, output and logs, as Docker keeps its own.
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&bundle)
                .map_err(|e| io_error(&bundle, e))?;
            let path = bundle.join("config.json");
            std::fs::write(&path, serde_json::to_vec_pretty(&config).expect("json"))
                .map_err(|e| io_error(&path, e))?;
        }
        let meta = Meta {
            image: spec.image.clone(),
            image_id: image.id.clone(),
            labels: spec.labels.clone(),
            memory_mb: spec.hardening.limits.memory_mb,
            socket_dir,
            owner: None,
            serves: None,
            launcher: image.cmd.clone(),
        };
        self.write_meta(&handle, &meta)?;
        Ok(Written { handle, bundle })
    }

    /// Every bundle with a readable record.
    pub(super) fn bundles(&self) -> Vec<(String, Meta)> {
        let dir = self.settings.runtime_dir.join("gvisor").join("bundles");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Vec::new();
        };
        entries
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                let meta = self.read_meta(&name).ok()?;
                Some((name, meta))
            })
            .collect()
    }

    /// Removes the engine's directories once no sandbox is left in them (a directory
    /// still in use is not empty and stays).
    pub(super) fn tidy(&self) {
        let _layout = self.layout.lock().expect("layout lock");
        let base = self.settings.runtime_dir.join("gvisor");
        for dir in [base.join("bundles"), self.runsc.root.clone(), base] {
            if std::fs::remove_dir(&dir).is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exit_status_is_read_from_runscs_boot_log() {
        let log =
            "I1128 12:02:30.978797    4760 boot.go:534] application exiting with exit status 3\n\
                   I1128 12:02:30.978998    4760 main.go:222] Exiting with status: 768\n";
        assert_eq!(exit_status_of(log), Some(3));
        let killed = "I1128 boot.go:534] application exiting with killed by signal 9\n\
                      I1128 main.go:222] Exiting with status: 9\n";
        assert_eq!(exit_status_of(killed), Some(137));
        assert_eq!(
            exit_status_of("I1128 boot.go:100] Starting sandbox\n"),
            None
        );
    }

    #[test]
    fn a_kernels_output_is_kept_bounded_with_one_older_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = kernel_log(dir.path());
        std::fs::write(&log, b"short\n").expect("write");
        assert!(!trim_log(dir.path()).expect("trim"), "under the cap: kept");
        let big = vec![b'x'; usize::try_from(LOG_MAX_BYTES).expect("fits") + 1];
        std::fs::write(&log, &big).expect("write");
        assert!(trim_log(dir.path()).expect("trim"));
        assert_eq!(std::fs::metadata(&log).expect("log").len(), 0);
        assert_eq!(
            std::fs::metadata(older_log(dir.path()))
                .expect("older")
                .len(),
            LOG_MAX_BYTES + 1
        );
    }
}
