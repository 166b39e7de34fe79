//! lock.json: what `kernelgate packages sync` resolved for one image, and where in the
//! wheelhouse it lives (docs/packages.md). Written by sync; read by the gateway and by the
//! in-kernel shim, which is why unknown fields are ignored rather than refused.

use super::allowlist::normalize;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The lock format this code writes and reads.
pub const FORMAT: u32 = 1;
/// The lock's file name inside an image's directory.
pub const LOCK_FILE: &str = "lock.json";
/// The wheelhouse directory holding downloaded wheels, shared between images.
pub const WHEELS_DIR: &str = "wheels";

/// The lock of one image: which allowlist entries synced, into which packages, and which
/// were refused and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lock {
    pub format: u32,
    /// The image as the operator named it (`kernelgate-kernel:latest`).
    pub image: String,
    /// `sha256:<64 hex>`: the image the lock was resolved for.
    pub image_id: String,
    pub python: PythonTarget,
    /// RFC 3339, UTC.
    pub synced_at: String,
    /// Key: the normalized name of an allowlist entry that synced.
    #[serde(default)]
    pub requirements: BTreeMap<String, LockedRequirement>,
    #[serde(default)]
    pub refused: Vec<Refused>,
    /// Key: a normalized package name.
    #[serde(default)]
    pub packages: BTreeMap<String, LockedPackage>,
}

/// The interpreter the wheels were chosen for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PythonTarget {
    /// `3.11.2`.
    pub version: String,
    /// `cp`.
    pub implementation: String,
    /// `cp311`.
    pub abi: String,
    /// Platform tags the interpreter accepts, most preferred first.
    #[serde(default)]
    pub platforms: Vec<String>,
}

/// One allowlist entry that synced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockedRequirement {
    /// The allowlist line (`seaborn>=0.13`).
    pub requirement: String,
    /// Normalized names of what installing it brings, itself first, without the packages
    /// the image already has.
    #[serde(default)]
    pub packages: Vec<String>,
}

/// One package: an unpacked wheel, or (`in_image`) one the image already has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockedPackage {
    /// The project's display name from its metadata.
    pub name: String,
    pub version: String,
    #[serde(default)]
    pub in_image: bool,
    /// The wheel's file name under `wheels/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wheel: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// The unpacked tree, relative to the image's directory (`seaborn-0.13.2`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<String>,
}

/// An allowlist entry that did not sync.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refused {
    pub requirement: String,
    /// One line.
    pub reason: String,
}

impl Lock {
    /// Reads a lock; `None` when there is no file (nothing synced for that image yet).
    pub fn read(path: &Path) -> Result<Option<Lock>, String> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
        };
        let lock: Lock = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not a valid package lock: {e}", path.display()))?;
        if lock.format != FORMAT {
            return Err(format!(
                "{} has lock format {}, this kernelgate reads format {FORMAT}: run `kernelgate packages sync` again",
                path.display(),
                lock.format
            ));
        }
        Ok(Some(lock))
    }

    /// Writes the lock to a temporary file beside `path` and renames it into place, so a
    /// reader sees the old lock or the new one, never half of one.
    pub fn write(&self, path: &Path) -> Result<(), String> {
        let mut text = serde_json::to_string_pretty(self)
            .map_err(|e| format!("cannot encode the package lock: {e}"))?;
        text.push('\n');
        write_atomically(path, text.as_bytes())
    }

    /// The packages installing an allowlist entry brings (itself first, in-image ones
    /// left out), or `None` when the entry is not in the lock or the lock does not list
    /// one of them.
    pub fn closure(&self, name: &str) -> Option<Vec<&LockedPackage>> {
        let requirement = self.requirements.get(&normalize(name))?;
        requirement
            .packages
            .iter()
            .map(|package| self.packages.get(package))
            .collect()
    }
}

/// `path`'s new contents, via a temporary file in the same directory and a rename.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{file_name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write {}: {e}", path.display())
    })
}

/// An image's key in the wheelhouse: the first 12 hex digits of its id (`sha256:...`).
pub fn image_key(image_id: &str) -> String {
    let hex = image_id.strip_prefix("sha256:").unwrap_or(image_id);
    hex.chars()
        .take_while(char::is_ascii_hexdigit)
        .take(12)
        .collect::<String>()
        .to_ascii_lowercase()
}

/// The directory holding an image's lock and unpacked wheels.
pub fn image_dir(wheelhouse: &Path, image_id: &str) -> PathBuf {
    wheelhouse.join(image_key(image_id))
}

/// Where an image's lock is.
pub fn lock_path(wheelhouse: &Path, image_id: &str) -> PathBuf {
    image_dir(wheelhouse, image_id).join(LOCK_FILE)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "sha256:2f7e5ed238560f4e4a7cb2a7d6b0b5e0b2b4f5b5a3b1d0e9c8f7a6b5c4d3e2f1";

    fn sample() -> Lock {
        let package = |name: &str, version: &str| LockedPackage {
            name: name.to_owned(),
            version: version.to_owned(),
            in_image: false,
            wheel: Some(format!("{name}-{version}-py3-none-any.whl")),
            sha256: Some("ab".repeat(32)),
            summary: Some("A fixture".to_owned()),
            dir: Some(format!("{}-{version}", normalize(name))),
        };
        Lock {
            format: FORMAT,
            image: "kernelgate-kernel:latest".to_owned(),
            image_id: ID.to_owned(),
            python: PythonTarget {
                version: "3.11.2".to_owned(),
                implementation: "cp".to_owned(),
                abi: "cp311".to_owned(),
                platforms: vec![
                    "manylinux_2_36_x86_64".to_owned(),
                    "linux_x86_64".to_owned(),
                ],
            },
            synced_at: "2026-11-27T09:00:00Z".to_owned(),
            requirements: BTreeMap::from([(
                "kgfix-app".to_owned(),
                LockedRequirement {
                    requirement: "kgfix_app>=1".to_owned(),
                    packages: vec!["kgfix-app".to_owned(), "kgfix-dep".to_owned()],
                },
            )]),
            refused: vec![Refused {
                requirement: "kgfix-needs-numpy1".to_owned(),
                reason: "kgfix-needs-numpy1 1.0 depends on numpy<2; the image has numpy 2.4.6"
                    .to_owned(),
            }],
            packages: BTreeMap::from([
                ("kgfix-app".to_owned(), package("kgfix_app", "1.0")),
                ("kgfix-dep".to_owned(), package("kgfix-dep", "0.1")),
                (
                    "numpy".to_owned(),
                    LockedPackage {
                        name: "numpy".to_owned(),
                        version: "2.4.6".to_owned(),
                        in_image: true,
                        wheel: None,
                        sha256: None,
                        summary: None,
                        dir: None,
                    },
                ),
            ]),
        }
    }

    #[test]
    fn image_keys_are_the_first_twelve_hex_digits_of_the_id() {
        assert_eq!(image_key(ID), "2f7e5ed23856");
        assert_eq!(image_key("2F7E5ED238560F4E"), "2f7e5ed23856");
        // Nothing but hex digits ever reaches a path.
        assert_eq!(image_key("sha256:../../etc"), "");
        assert_eq!(
            image_dir(Path::new("/srv/wheelhouse"), ID),
            Path::new("/srv/wheelhouse/2f7e5ed23856")
        );
        assert_eq!(
            lock_path(Path::new("/w"), ID),
            Path::new("/w/2f7e5ed23856/lock.json")
        );
    }

    #[test]
    fn a_lock_written_is_read_back_the_same_and_missing_is_none() {
        let dir = tempfile::tempdir().expect("works");
        let path = dir.path().join(LOCK_FILE);
        assert_eq!(Lock::read(&path).expect("works"), None);
        let lock = sample();
        lock.write(&path).expect("works");
        assert_eq!(Lock::read(&path).expect("works"), Some(lock));
        // No temporary file is left beside it.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("works")
            .map(|e| e.expect("works").file_name())
            .collect();
        assert_eq!(names, [LOCK_FILE]);
    }

    #[test]
    fn in_image_packages_are_written_with_only_name_and_version() {
        let value = serde_json::to_value(sample()).expect("works");
        assert_eq!(
            value["packages"]["numpy"],
            serde_json::json!({"name": "numpy", "version": "2.4.6", "in_image": true})
        );
        assert_eq!(value["packages"]["kgfix-app"]["dir"], "kgfix-app-1.0");
        assert_eq!(value["format"], 1);
    }

    #[test]
    fn the_spec_example_reads_and_unknown_fields_are_ignored() {
        let text = r#"{
          "format": 1, "image": "kernelgate-kernel:latest", "image_id": "sha256:abc",
          "python": {"version": "3.11.2", "implementation": "cp", "abi": "cp311",
                     "platforms": ["manylinux_2_36_x86_64", "linux_x86_64"], "gil": true},
          "synced_at": "2026-11-27T09:00:00Z",
          "requirements": {"seaborn": {"requirement": "seaborn>=0.13", "packages": ["seaborn"]}},
          "refused": [{"requirement": "kgfix-needs-numpy1", "reason": "conflict", "hint": "x"}],
          "packages": {
            "seaborn": {"name": "seaborn", "version": "0.13.2", "in_image": false,
                        "wheel": "seaborn-0.13.2-py3-none-any.whl", "sha256": "00",
                        "summary": "Statistical data visualization", "dir": "seaborn-0.13.2",
                        "size": 294912},
            "numpy": {"name": "numpy", "version": "2.4.6", "in_image": true}
          },
          "future": {"anything": [1, 2]}
        }"#;
        let lock: Lock = serde_json::from_str(text).expect("works");
        let seaborn = lock.closure("Seaborn").expect("works");
        assert_eq!(seaborn.len(), 1);
        assert_eq!(seaborn[0].dir.as_deref(), Some("seaborn-0.13.2"));
        assert!(lock.packages["numpy"].in_image);
        assert_eq!(lock.refused[0].reason, "conflict");
    }

    #[test]
    fn a_closure_lists_the_entry_first_and_is_none_when_incomplete() {
        let mut lock = sample();
        let closure = lock.closure("KGFix_App").expect("works");
        let versions: Vec<_> = closure
            .iter()
            .map(|p| format!("{} {}", p.name, p.version))
            .collect();
        assert_eq!(versions, ["kgfix_app 1.0", "kgfix-dep 0.1"]);
        assert!(lock.closure("kgfix-needs-numpy1").is_none());
        lock.packages.remove("kgfix-dep");
        assert!(lock.closure("kgfix-app").is_none());
    }

    #[test]
    fn a_damaged_or_newer_lock_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().expect("works");
        let path = dir.path().join(LOCK_FILE);
        std::fs::write(&path, "{\"format\": 1").expect("works");
        let err = Lock::read(&path).expect_err("fails");
        assert!(err.contains("not a valid package lock"), "{err}");
        let mut newer = serde_json::to_value(sample()).expect("works");
        newer["format"] = 2.into();
        std::fs::write(&path, newer.to_string()).expect("works");
        let err = Lock::read(&path).expect_err("fails");
        assert!(
            err.contains("format 2") && err.contains(&*path.to_string_lossy()),
            "{err}"
        );
    }
}
