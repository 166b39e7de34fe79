//! Packages on demand with no network: the operator's allowlist, the wheelhouse that
//! `kernelgate packages sync` fills on the host, and what kernels see of it
//! (docs/packages.md).
//!
//! A kernel never resolves or downloads anything. Its container gets two read-only
//! directories: the unpacked wheels synced for its image ([`TREE_IN_CONTAINER`]) and the
//! in-kernel installer with this gateway's allowlist ([`SHIM_IN_CONTAINER`]). Installing
//! records the chosen packages in the kernel's home, and an import hook puts their
//! directories on `sys.path`.

pub mod allowlist;
pub mod cli;
pub mod lock;
pub mod sync;

use crate::backend::sandbox::Mount;
use allowlist::Entry;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

/// Where a kernel sees the unpacked wheels synced for its image.
pub const TREE_IN_CONTAINER: &str = "/opt/kernelgate/packages";
/// Where a kernel sees the installer (a `pip` that installs from the tree) and the allowlist.
pub const SHIM_IN_CONTAINER: &str = "/opt/kernelgate/python";
/// Where the in-kernel installer reports what was asked for, inside the socket directory.
pub const REPORT_FILE: &str = "installs.jsonl";

/// What an operator is told to do to allow a package (shown by refusals in the kernel).
pub const HOW_TO_ADD: &str =
    "an operator allows it with `kernelgate packages add NAME --packages FILE`, \
fills the wheelhouse with `kernelgate packages sync --packages FILE --wheelhouse DIR`, then sends \
SIGHUP to the gateway";

/// The installer's files, written into the directory kernels see at [`SHIM_IN_CONTAINER`].
const SHIM: &[(&str, &str)] = &[
    (
        "kernelgate_packages.py",
        include_str!("../../assets/packages/kernelgate_packages.py"),
    ),
    (
        "kernelgate_pip.py",
        include_str!("../../assets/packages/kernelgate_pip.py"),
    ),
    (
        "sitecustomize.py",
        include_str!("../../assets/packages/sitecustomize.py"),
    ),
    (
        "pip/__init__.py",
        include_str!("../../assets/packages/pip/__init__.py"),
    ),
    (
        "pip/__main__.py",
        include_str!("../../assets/packages/pip/__main__.py"),
    ),
    (
        "pip/_internal/__init__.py",
        include_str!("../../assets/packages/pip/_internal/__init__.py"),
    ),
    (
        "pip/_internal/cli/__init__.py",
        include_str!("../../assets/packages/pip/_internal/cli/__init__.py"),
    ),
    (
        "pip/_internal/cli/main.py",
        include_str!("../../assets/packages/pip/_internal/cli/main.py"),
    ),
];

/// The host paths a kernel container mounts (see [`Packages::binds`]).
#[derive(Debug, Clone)]
pub struct Mounts {
    pub wheelhouse: PathBuf,
    pub shim_dir: PathBuf,
}

/// Environment variables, as `(name, value)`.
pub type Env = Vec<(String, String)>;

impl Mounts {
    /// The read-only mounts and environment of a kernel of `kernel_name` running
    /// `image_id`. The image's directory in the wheelhouse is created when missing, so a
    /// sync after the kernel started is seen at once.
    pub fn for_kernel(
        &self,
        image_id: &str,
        kernel_name: &str,
    ) -> std::io::Result<(Vec<Mount>, Env)> {
        let tree = lock::image_dir(&self.wheelhouse, image_id);
        std::fs::create_dir_all(&tree)?;
        let mounts = vec![
            Mount::read_only(tree, TREE_IN_CONTAINER),
            Mount::read_only(&self.shim_dir, SHIM_IN_CONTAINER),
        ];
        let env = vec![
            ("PYTHONPATH".to_owned(), SHIM_IN_CONTAINER.to_owned()),
            (
                "KERNELGATE_PACKAGES_ALLOWED".to_owned(),
                format!("{SHIM_IN_CONTAINER}/allowed/{kernel_name}.json"),
            ),
        ];
        Ok((mounts, env))
    }
}

/// `--packages` values: `FILE` (the default kernel spec's) or `NAME=FILE`.
pub fn parse_sources(
    values: &[String],
    default_spec: &str,
    known: &[String],
) -> Result<BTreeMap<String, PathBuf>, String> {
    let mut sources = BTreeMap::new();
    for value in values {
        let (spec, file) = match value.split_once('=') {
            Some((spec, file)) => (spec.trim(), file.trim()),
            None => (default_spec, value.trim()),
        };
        if file.is_empty() {
            return Err(format!("--packages {value:?}: the file is missing"));
        }
        if !known.iter().any(|k| k == spec) {
            return Err(format!(
                "--packages {value:?}: no kernel spec named {spec:?} (known: {})",
                known.join(", ")
            ));
        }
        if sources
            .insert(spec.to_owned(), PathBuf::from(file))
            .is_some()
        {
            return Err(format!(
                "--packages: two allowlists for the kernel spec {spec:?}; give one file each"
            ));
        }
    }
    Ok(sources)
}

/// The allowlists in force and the wheelhouse they are synced into.
#[derive(Debug)]
pub struct Packages {
    mounts: Mounts,
    /// Allowlist file of each kernel spec that has one.
    sources: BTreeMap<String, PathBuf>,
    /// Every kernel spec's name.
    specs: Vec<String>,
    allowed: RwLock<BTreeMap<String, Vec<Entry>>>,
}

/// One allowed package as `GET /api/kernelgate/packages` shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Available {
    /// The project name, normalized (`scikit-learn`).
    pub name: String,
    /// The allowlist's line for it (`scikit-learn==1.5.2`).
    pub requirement: String,
    /// The version the wheelhouse holds for this kernel spec's image; empty until synced.
    pub versions: Vec<String>,
    /// The package's one-line summary, from its metadata.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// Synced for this kernel spec's image: it installs at once.
    pub synced: bool,
    /// What installing it brings, itself first (packages the image has are not listed).
    pub brings: Vec<String>,
}

/// What kernels of one kernel spec may install.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Listing {
    pub kernel_name: String,
    pub image: String,
    /// When the wheelhouse was last synced for this image (RFC 3339); none if never.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub synced_at: Option<String>,
    pub packages: Vec<Available>,
    /// How a kernel installs them.
    pub how_to_install: String,
}

impl Packages {
    /// Reads the allowlists (`--packages`) and writes the installer and the allowlists
    /// where kernels see them. `None` when packages are not configured.
    pub fn start(
        values: &[String],
        wheelhouse: Option<&Path>,
        runtime_dir: &Path,
        default_spec: &str,
        known: &[String],
    ) -> Result<Option<Self>, String> {
        let sources = parse_sources(values, default_spec, known)?;
        let Some(wheelhouse) = wheelhouse else {
            if sources.is_empty() {
                return Ok(None);
            }
            return Err(
                "--packages needs --wheelhouse DIR: the directory `kernelgate packages sync` fills"
                    .to_owned(),
            );
        };
        let packages = Packages {
            mounts: Mounts {
                wheelhouse: wheelhouse.to_owned(),
                shim_dir: runtime_dir.join("packages"),
            },
            sources,
            specs: known.to_vec(),
            allowed: RwLock::default(),
        };
        packages.read_allowlists()?;
        packages.write_shim().map_err(|e| {
            format!(
                "cannot write the package installer into {}: {e}",
                packages.mounts.shim_dir.display()
            )
        })?;
        packages
            .write_allowed()
            .map_err(|e| format!("cannot write the allowlists for kernels: {e}"))?;
        Ok(Some(packages))
    }

    pub fn mounts(&self) -> &Mounts {
        &self.mounts
    }

    /// Reads every allowlist file again (SIGHUP) and shows kernels the new lists; on an
    /// error the lists in force stay.
    pub fn reload(&self) -> Result<usize, String> {
        self.read_allowlists()?;
        self.write_allowed()
            .map_err(|e| format!("cannot write the allowlists for kernels: {e}"))?;
        Ok(self
            .allowed
            .read()
            .expect("allowlists")
            .values()
            .map(Vec::len)
            .sum())
    }

    /// Removes the installer's directory from the runtime directory, once no kernel mounts
    /// it (the gateway removed its kernels at shutdown).
    pub fn remove_installer(&self) {
        if let Err(e) = std::fs::remove_dir_all(&self.mounts.shim_dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %self.mounts.shim_dir.display(), error = %e, "cannot remove the package installer's directory");
            }
        }
    }

    /// The allowlist of a kernel spec (empty when it has none).
    pub fn allowed(&self, kernel_name: &str) -> Vec<Entry> {
        self.allowed
            .read()
            .expect("allowlists")
            .get(kernel_name)
            .cloned()
            .unwrap_or_default()
    }

    /// Whether any kernel spec's allowlist has the package (normalized name): installing it
    /// with `%pip` is then no shell command for the execution policy.
    pub fn allows(&self, name: &str) -> bool {
        self.allowed
            .read()
            .expect("allowlists")
            .values()
            .any(|list| list.iter().any(|e| e.name == name))
    }

    /// What kernels of `kernel_name` (running `image`, whose id is `image_id`) may install.
    pub fn listing(&self, kernel_name: &str, image: &str, image_id: &str) -> Listing {
        let lock =
            lock::Lock::read(&lock::image_dir(&self.mounts.wheelhouse, image_id).join("lock.json"))
                .unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "wheelhouse lock unreadable");
                    None
                });
        let packages = self
            .allowed(kernel_name)
            .into_iter()
            .map(|entry| {
                let locked = lock.as_ref().and_then(|l| l.requirements.get(&entry.name));
                let own = lock.as_ref().and_then(|l| l.packages.get(&entry.name));
                Available {
                    versions: own.map(|p| vec![p.version.clone()]).unwrap_or_default(),
                    summary: own.and_then(|p| p.summary.clone()),
                    synced: locked.is_some(),
                    brings: locked.map(|r| r.packages.clone()).unwrap_or_default(),
                    name: entry.name,
                    requirement: entry.requirement,
                }
            })
            .collect();
        Listing {
            kernel_name: kernel_name.to_owned(),
            image: image.to_owned(),
            synced_at: lock.map(|l| l.synced_at),
            packages,
            how_to_install: "`%pip install NAME` in a cell, or the install_packages tool \
(MCP) / POST /api/kernels/{id}/packages: only these names, offline, in about a second"
                .to_owned(),
        }
    }

    fn read_allowlists(&self) -> Result<(), String> {
        let mut lists = BTreeMap::new();
        for (spec, file) in &self.sources {
            lists.insert(spec.clone(), allowlist::read(file)?);
        }
        *self.allowed.write().expect("allowlists") = lists;
        Ok(())
    }

    fn write_shim(&self) -> std::io::Result<()> {
        for (name, text) in SHIM {
            write_public(&self.mounts.shim_dir.join(name), text.as_bytes())?;
        }
        Ok(())
    }

    /// `allowed/<kernel spec>.json` for every kernel spec, in the installer's directory.
    fn write_allowed(&self) -> std::io::Result<()> {
        let lists = self.allowed.read().expect("allowlists").clone();
        // Specs without an allowlist get an empty one: everything is refused, clearly.
        for spec in &self.specs {
            let entries = lists.get(spec).map(Vec::as_slice).unwrap_or_default();
            let body = serde_json::json!({
                "kernel_name": spec,
                "entries": entries
                    .iter()
                    .map(|e| serde_json::json!({"name": e.name, "requirement": e.requirement}))
                    .collect::<Vec<_>>(),
                "how_to_add": HOW_TO_ADD,
            });
            let bytes = serde_json::to_vec_pretty(&body).map_err(std::io::Error::other)?;
            write_public(
                &self
                    .mounts
                    .shim_dir
                    .join("allowed")
                    .join(format!("{spec}.json")),
                &bytes,
            )?;
        }
        Ok(())
    }
}

/// Writes a file kernels read (mode 0644, directories 0755), replacing it atomically.
fn write_public(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let parent = path.parent().expect("a file in a directory");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(parent)?;
    let tmp = parent.join(format!(
        ".{}.tmp",
        path.file_name().expect("file name").to_string_lossy()
    ));
    std::fs::write(&tmp, bytes)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))?;
    std::fs::rename(&tmp, path)
}
