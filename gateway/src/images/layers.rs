//! Applying layer tars, lowest first, to a root filesystem directory: files, directories,
//! symlinks and hard links with their modes, owners and times; OCI whiteouts (`.wh.NAME`
//! deletes NAME from the layers below, `.wh..wh..opq` empties its directory of them).
//! Device nodes and FIFOs are skipped: kernels never need them from the image.
//!
//! Every path is resolved inside the root: absolute names and `..` in a member's name are
//! refused, and so is a symlink on the way whose target climbs out of the root. An absolute
//! symlink target means the image's own root, as it does inside the container.

use super::ImageError;
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::ffi::OsString;
use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";
/// Symlinks followed while resolving one path before giving up (Linux's own limit).
const MAX_HOPS: usize = 40;

/// Directory times from the layers, set once every layer is applied (writing into a
/// directory changes its time).
pub(super) type DirTimes = BTreeMap<PathBuf, u64>;

/// Applies one layer to `root`. `label` names the layer in errors; `chown` keeps the owners
/// from the tar (needs root).
pub(super) fn apply(
    root: &Path,
    layer: impl Read,
    label: &str,
    chown: bool,
    dir_times: &mut DirTimes,
) -> Result<(), ImageError> {
    let mut archive = tar::Archive::new(layer);
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(chown);
    archive.set_preserve_mtime(true);
    archive.set_unpack_xattrs(false);
    archive.set_overwrite(true);
    let mut layer = Layer {
        root,
        label,
        created: HashSet::new(),
        dir_times,
    };
    let entries = archive.entries().map_err(|e| layer.bad(e))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| layer.bad(e))?;
        let name = entry.path().map_err(|e| layer.bad(e))?.into_owned();
        layer.entry(&mut entry, &name)?;
    }
    // The tar's end marker may be followed by padding: read it all, so that a caller that
    // hashes the stream sees every byte.
    io::copy(&mut archive.into_inner(), &mut io::sink()).map_err(|e| layer.bad(e))?;
    Ok(())
}

struct Layer<'a> {
    root: &'a Path,
    label: &'a str,
    /// What this layer wrote (real paths): its own whiteouts never delete these.
    created: HashSet<PathBuf>,
    dir_times: &'a mut DirTimes,
}

impl Layer<'_> {
    fn bad(&self, e: io::Error) -> ImageError {
        ImageError::BadLayer {
            layer: self.label.to_owned(),
            reason: e.to_string(),
        }
    }

    fn unsafe_path(&self, path: &Path, reason: &str) -> ImageError {
        ImageError::UnsafePath {
            layer: self.label.to_owned(),
            path: path.to_path_buf(),
            reason: reason.to_owned(),
        }
    }

    fn io(&self, action: &'static str, path: &Path, source: io::Error) -> ImageError {
        ImageError::Io {
            action,
            path: path.to_path_buf(),
            source,
        }
    }

    /// The member name's components; `..` and absolute names refused.
    fn components(&self, name: &Path) -> Result<Vec<OsString>, ImageError> {
        let mut parts = Vec::new();
        for c in name.components() {
            match c {
                Component::Normal(p) => parts.push(p.to_os_string()),
                Component::CurDir => {}
                Component::ParentDir => return Err(self.unsafe_path(name, "it contains '..'")),
                Component::RootDir | Component::Prefix(_) => {
                    return Err(self.unsafe_path(name, "it is an absolute path"))
                }
            }
        }
        Ok(parts)
    }

    fn entry<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        name: &Path,
    ) -> Result<(), ImageError> {
        let mut parts = self.components(name)?;
        let Some(file_name) = parts.pop() else {
            return Ok(()); // the root itself ("./")
        };
        let file_name_str = file_name.to_string_lossy();
        if file_name_str == OPAQUE {
            if let Some(dir) = self.resolve(name, &parts, false)? {
                self.remove_lower(&dir)?;
            }
            return Ok(());
        }
        if let Some(hidden) = file_name_str.strip_prefix(WHITEOUT) {
            if hidden.is_empty() || hidden == "." || hidden == ".." {
                return Err(self.unsafe_path(name, "a whiteout must name a file"));
            }
            if let Some(dir) = self.resolve(name, &parts, false)? {
                let target = dir.join(hidden);
                if !self.created.contains(&target) {
                    remove(&target).map_err(|e| self.io("apply a whiteout to", &target, e))?;
                }
            }
            return Ok(());
        }
        let kind = entry.header().entry_type();
        let supported = kind.is_file()
            || kind.is_dir()
            || kind.is_symlink()
            || kind.is_hard_link()
            || kind == tar::EntryType::Continuous
            || kind == tar::EntryType::GNUSparse;
        if !supported {
            return Ok(()); // device nodes, FIFOs
        }
        let Some(dir) = self.resolve(name, &parts, true)? else {
            return Err(self.unsafe_path(name, "its directory could not be made"));
        };
        let dst = dir.join(&file_name);
        match fs::symlink_metadata(&dst) {
            Ok(m) if m.is_dir() && kind.is_dir() => {}
            Ok(_) => remove(&dst).map_err(|e| self.io("replace", &dst, e))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(self.io("inspect", &dst, e)),
        }
        if kind.is_hard_link() {
            let target = entry
                .link_name()
                .map_err(|e| self.bad(e))?
                .ok_or_else(|| self.unsafe_path(name, "a hard link without a target"))?
                .into_owned();
            let mut target_parts = self.components(&target)?;
            let target_name = target_parts
                .pop()
                .ok_or_else(|| self.unsafe_path(name, "a hard link to the root"))?;
            let src = self
                .resolve(&target, &target_parts, false)?
                .map(|d| d.join(target_name))
                .filter(|p| fs::symlink_metadata(p).is_ok_and(|m| !m.is_dir()))
                .ok_or_else(|| {
                    self.unsafe_path(
                        name,
                        &format!(
                            "a hard link to {}, which is not a file written before it",
                            target.display()
                        ),
                    )
                })?;
            fs::hard_link(&src, &dst).map_err(|e| self.io("make the hard link", &dst, e))?;
        } else {
            entry
                .unpack(&dst)
                .map_err(|e| self.io("write", &dst, io::Error::other(e.to_string())))?;
            if kind.is_dir() {
                if let Ok(mtime) = entry.header().mtime() {
                    self.dir_times.insert(dst.clone(), mtime);
                }
            }
        }
        self.created.insert(dst);
        Ok(())
    }

    /// The real directory for `parts` under the root, following symlinks inside it; `None`
    /// if a component is missing and `create` is false.
    fn resolve(
        &mut self,
        name: &Path,
        parts: &[OsString],
        create: bool,
    ) -> Result<Option<PathBuf>, ImageError> {
        let mut queue: VecDeque<OsString> = parts.iter().cloned().collect();
        let mut stack: Vec<OsString> = Vec::new();
        let mut hops = 0;
        while let Some(part) = queue.pop_front() {
            if part == "." {
                continue;
            }
            if part == ".." {
                if stack.pop().is_none() {
                    return Err(self.unsafe_path(
                        name,
                        "a symlink on its way points outside the image's root",
                    ));
                }
                continue;
            }
            let mut candidate = self.root.to_path_buf();
            candidate.extend(&stack);
            candidate.push(&part);
            match fs::symlink_metadata(&candidate) {
                Ok(m) if m.file_type().is_symlink() => {
                    hops += 1;
                    if hops > MAX_HOPS {
                        return Err(self.unsafe_path(name, "too many symlinks on its way"));
                    }
                    let target = fs::read_link(&candidate)
                        .map_err(|e| self.io("read the symlink", &candidate, e))?;
                    if target.is_absolute() {
                        stack.clear();
                    }
                    for c in target.components().rev() {
                        match c {
                            Component::Normal(p) => queue.push_front(p.to_os_string()),
                            Component::ParentDir => queue.push_front("..".into()),
                            _ => {}
                        }
                    }
                }
                Ok(m) if m.is_dir() => stack.push(part),
                Ok(_) => {
                    return Err(self.unsafe_path(name, "a file stands where a directory should"))
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if !create {
                        return Ok(None);
                    }
                    fs::create_dir(&candidate)
                        .map_err(|e| self.io("create the directory", &candidate, e))?;
                    fs::set_permissions(&candidate, fs::Permissions::from_mode(0o755))
                        .map_err(|e| self.io("set the mode of", &candidate, e))?;
                    self.created.insert(candidate);
                    stack.push(part);
                }
                Err(e) => return Err(self.io("inspect", &candidate, e)),
            }
        }
        let mut dir = self.root.to_path_buf();
        dir.extend(&stack);
        Ok(Some(dir))
    }

    /// Empties `dir` of what the layers below put there (an opaque whiteout), keeping what
    /// this layer wrote.
    fn remove_lower(&self, dir: &Path) -> Result<(), ImageError> {
        let children = fs::read_dir(dir).map_err(|e| self.io("read the directory", dir, e))?;
        for child in children {
            let child = child.map_err(|e| self.io("read the directory", dir, e))?;
            let path = child.path();
            if self.created.contains(&path) {
                let is_dir = child.file_type().is_ok_and(|t| t.is_dir());
                if is_dir {
                    self.remove_lower(&path)?;
                }
            } else {
                remove(&path).map_err(|e| self.io("apply an opaque whiteout to", &path, e))?;
            }
        }
        Ok(())
    }
}

/// Gives the directories the layers made their times back: those a later layer removed, or
/// put under a symlink, are skipped.
pub(super) fn set_dir_times(root: &Path, dir_times: &DirTimes) -> io::Result<()> {
    for (dir, mtime) in dir_times {
        let time = std::time::UNIX_EPOCH + std::time::Duration::from_secs(*mtime);
        let Ok(relative) = dir.strip_prefix(root) else {
            continue;
        };
        let mut at = root.to_path_buf();
        let mut plain = true;
        for part in relative.components() {
            at.push(part);
            plain &= fs::symlink_metadata(&at).is_ok_and(|m| m.is_dir());
        }
        match fs::symlink_metadata(dir) {
            Ok(m) if plain && m.is_dir() => {
                fs::File::open(dir)?
                    .set_times(fs::FileTimes::new().set_modified(time).set_accessed(time))?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Removes a file, symlink or directory tree; missing is fine.
fn remove(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Takes the group's and others' write bits off everything under `root` (symlinks have no
/// mode of their own): the unpacked image is shared by every sandbox that runs it.
pub(super) fn seal(root: &Path) -> io::Result<()> {
    let meta = fs::symlink_metadata(root)?;
    if meta.file_type().is_symlink() {
        return Ok(());
    }
    let mode = meta.permissions().mode();
    if mode & 0o022 != 0 {
        fs::set_permissions(root, fs::Permissions::from_mode(mode & !0o022 & 0o7777))?;
    }
    if meta.is_dir() {
        for child in fs::read_dir(root)? {
            seal(&child?.path())?;
        }
    }
    Ok(())
}

/// Bytes of the files under `root`, each hard-linked file counted once.
pub(super) fn disk_usage(root: &Path) -> io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    fn walk(path: &Path, seen: &mut HashSet<(u64, u64)>) -> io::Result<u64> {
        let meta = fs::symlink_metadata(path)?;
        if meta.is_dir() {
            let mut total = 0;
            for child in fs::read_dir(path)? {
                total += walk(&child?.path(), seen)?;
            }
            Ok(total)
        } else if meta.is_file() && (meta.nlink() == 1 || seen.insert((meta.dev(), meta.ino()))) {
            Ok(meta.len())
        } else {
            Ok(0)
        }
    }
    walk(root, &mut HashSet::new())
}
