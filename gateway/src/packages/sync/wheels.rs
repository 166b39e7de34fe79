//! Wheels: where they come from (URLs, hashes), what they may unpack to (checked before
//! anything is written) and unpacking them into the trees kernels mount.

use crate::packages::lock::Lock;
use anyhow::Context;
use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashMap};
use std::io::Read;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

/// The wheel file name at the end of a URL, if it is a plain one.
pub(super) fn wheel_file_name(url: &str) -> Option<String> {
    let path = url.split(['#', '?']).next()?;
    let name = crate::text::percent_decode(path.rsplit('/').next()?)?;
    let plain =
        name.ends_with(".whl") && !name.starts_with('.') && !name.contains(['/', '\\', '\0']);
    plain.then_some(name)
}

/// The local path of a `file://` URL.
pub(super) fn file_url_path(url: &str) -> Option<PathBuf> {
    let rest = url.strip_prefix("file://")?;
    let path = rest.split(['#', '?']).next()?;
    // `file://localhost/x` and `file:///x` both name `/x`.
    let path = path.strip_prefix("localhost").unwrap_or(path);
    path.starts_with('/')
        .then(|| crate::text::percent_decode(path).map(PathBuf::from))
        .flatten()
}

pub(super) async fn file_sha256(path: PathBuf) -> anyhow::Result<String> {
    tokio::task::spawn_blocking(move || sha256_of(&path))
        .await
        .context("hashing a wheel")?
        .map_err(Into::into)
}

pub(super) fn sha256_of(path: &Path) -> std::io::Result<String> {
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
pub(super) fn install_path(entry: &str) -> Result<Option<String>, String> {
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
pub(super) fn is_root_pth(path: &str) -> bool {
    !path.contains('/') && path.to_ascii_lowercase().ends_with(".pth")
}

/// Most bytes one wheel may unpack to: past it (as it declares, or as it turns out while
/// unpacking) it is refused.
pub(super) const MAX_UNPACKED: u64 = 2 << 30;

/// What unpacking a wheel writes: (zip index, path in the tree, is a directory,
/// executable, bytes it declares), checked before anything is written.
pub(super) type Plan = Vec<(usize, String, bool, bool, u64)>;

/// Checks what a wheel would unpack to before anything is written.
pub(super) fn plan_unpack<R: Read + std::io::Seek>(
    archive: &mut zip::ZipArchive<R>,
) -> Result<Plan, String> {
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
pub(super) const UNPACKED_FROM: &str = ".kernelgate-wheel-sha256";

/// A version's bytes never change under it: when `dest` already holds this version
/// unpacked from other wheel bytes (its `UNPACKED_FROM` file, else `previous`: the last
/// lock's trees),
/// the new bytes are refused and the tree kernels install stays as it was. The reason
/// says how to take the new bytes on purpose.
pub(super) fn same_bytes_as_unpacked(
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
pub(super) fn previous_trees(path: &Path) -> HashMap<String, String> {
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
pub(super) fn install_wheel(wheel: &Path, sha256: &str, dest: &Path) -> Result<bool, String> {
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

pub(super) fn unpack<R: Read + std::io::Seek>(
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

pub(super) fn create_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(e),
    }
}
