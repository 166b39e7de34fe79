//! A hibernated kernel's state on the host: the kernel's files as the gateway keeps them,
//! committed atomically, private, deleted when done.

use super::{HibernateError, MANIFEST, META, TAR};
use serde::Deserialize;
use std::path::{Component, Path, PathBuf};

/// What of a kernel's home was kept: the bytes of its tar, rewritten with only directories
/// and regular files under relative paths, and what was left out.
#[derive(Debug)]
pub(in crate::kernels) struct Kept {
    pub(in crate::kernels) bytes: u64,
    pub(in crate::kernels) dropped: Vec<String>,
}

/// A state being written: a private temporary directory in `--hibernate-dir` holding the
/// tar, which [`commit`] completes and renames. Deleted when dropped unless kept.
pub(in crate::kernels) struct Partial {
    dir: PathBuf,
    kept: bool,
}

impl Partial {
    pub(in crate::kernels) fn new(root: &Path, id: &str) -> std::io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(root)?;
        let dir = root.join(format!(".{id}.{}", uuid::Uuid::new_v4().simple()));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        Ok(Partial { dir, kept: false })
    }

    /// The tar's file, created (0600).
    pub(in crate::kernels) fn file(&self) -> std::io::Result<std::fs::File> {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(self.dir.join(TAR))
    }

    /// The directory, where an engine writes a checkpoint's image.
    pub(in crate::kernels) fn path(&self) -> &Path {
        &self.dir
    }

    /// Hands the directory to [`commit`], which deletes it if it fails.
    pub(in crate::kernels) fn keep(mut self) -> PathBuf {
        self.kept = true;
        self.dir.clone()
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.kept {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Reads the chunks a command's stdout sends, from a blocking thread.
pub(in crate::kernels) struct ChunkReader {
    chunks: tokio::sync::mpsc::Receiver<bytes::Bytes>,
    current: bytes::Bytes,
}

impl ChunkReader {
    pub(in crate::kernels) fn new(chunks: tokio::sync::mpsc::Receiver<bytes::Bytes>) -> Self {
        ChunkReader {
            chunks,
            current: bytes::Bytes::new(),
        }
    }
}

impl std::io::Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.chunks.blocking_recv() {
                Some(chunk) => self.current = chunk,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

/// Counts what passes through to `inner`.
struct Counted<W> {
    inner: W,
    bytes: u64,
}

impl<W: std::io::Write> std::io::Write for Counted<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Rewrites the tar the kernel's sandbox produced. Links, devices and pipes are refused
/// (their names given) unless `lossy`, which drops them; absolute paths and `..` are
/// refused always: the sandbox's own script never writes them.
pub(in crate::kernels) fn keep_files(
    raw: impl std::io::Read,
    out: impl std::io::Write,
    lossy: bool,
) -> Result<Kept, HibernateError> {
    let failed =
        |e: std::io::Error| HibernateError::Failed(format!("reading the kernel's files: {e}"));
    let mut archive = tar::Archive::new(raw);
    let mut out = tar::Builder::new(Counted {
        inner: out,
        bytes: 0,
    });
    let mut dropped = Vec::new();
    let mut variables = Vec::new();
    for entry in archive.entries().map_err(failed)? {
        let mut entry = entry.map_err(failed)?;
        let raw = entry.path().map_err(failed)?.into_owned();
        let relative = raw
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
        let path: PathBuf = raw
            .components()
            .filter(|c| !matches!(c, Component::CurDir))
            .collect();
        if path.as_os_str().is_empty() {
            continue;
        }
        if !relative {
            return Err(HibernateError::Failed(format!(
                "the kernel's files hold a path out of its home: {}",
                raw.display()
            )));
        }
        let kind = entry.header().entry_type();
        let mut header = tar::Header::new_gnu();
        header.set_mode(entry.header().mode().map_err(failed)? & 0o777);
        header.set_mtime(entry.header().mtime().unwrap_or(0));
        match kind {
            tar::EntryType::Directory => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_size(0);
                out.append_data(&mut header, &path, std::io::empty())
                    .map_err(failed)?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous if path == Path::new(MANIFEST) => {
                // Read (never run) for the names of the variables a lossy save dropped.
                let mut manifest = Vec::new();
                std::io::Read::read_to_end(&mut entry, &mut manifest).map_err(failed)?;
                variables.extend(dropped_variables(&manifest));
                header.set_entry_type(tar::EntryType::Regular);
                header.set_size(manifest.len() as u64);
                out.append_data(&mut header, &path, &manifest[..])
                    .map_err(failed)?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_size(entry.size());
                out.append_data(&mut header, &path, &mut entry)
                    .map_err(failed)?;
            }
            _ => dropped.push(path.display().to_string()),
        }
    }
    if !dropped.is_empty() && !lossy {
        return Err(HibernateError::Blocked(format!(
            "the working directory holds links or special files, which are not kept: {}; delete them or hibernate with --hibernate-lossy",
            dropped.join(", ")
        )));
    }
    dropped.extend(variables);
    let mut counted = out.into_inner().map_err(failed)?;
    std::io::Write::flush(&mut counted).map_err(failed)?;
    Ok(Kept {
        bytes: counted.bytes,
        dropped,
    })
}

/// The variables a lossy save left out, as the helper's manifest lists them:
/// `name (type)`.
fn dropped_variables(manifest: &[u8]) -> Vec<String> {
    #[derive(Deserialize)]
    struct Manifest {
        #[serde(default)]
        dropped: Vec<Dropped>,
    }
    #[derive(Deserialize)]
    struct Dropped {
        name: String,
        #[serde(default, rename = "type")]
        kind: String,
    }
    serde_json::from_slice::<Manifest>(manifest)
        .map(|m| {
            m.dropped
                .into_iter()
                .map(|d| format!("{} ({})", d.name, d.kind))
                .collect()
        })
        .unwrap_or_default()
}

/// Commits a state: its description written into the temporary directory `temporary`
/// (a [`Partial`], which holds the tar already), synced, renamed to `dir`; directories
/// 0700, files 0600. `temporary` is gone afterwards either way.
pub(in crate::kernels) fn commit(
    root: &Path,
    dir: &Path,
    meta: &[u8],
    temporary: &Path,
) -> Result<(), String> {
    commit_named(root, dir, META, meta, temporary)
}

/// [`commit`] with the description in the file `name`.
pub(in crate::kernels) fn commit_named(
    root: &Path,
    dir: &Path,
    name: &str,
    meta: &[u8],
    temporary: &Path,
) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let fail = |what: &str, e: std::io::Error| format!("{what}: {e}");
    let write = |file: &str, bytes: &[u8]| -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(temporary.join(file))?;
        std::io::Write::write_all(&mut f, bytes)?;
        f.sync_all()
    };
    let written = write(name, meta).and_then(|()| std::fs::File::open(temporary)?.sync_all());
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(temporary);
        return Err(fail("cannot write the state", e));
    }
    if dir.exists() {
        let _ = std::fs::remove_dir_all(dir);
    }
    std::fs::rename(temporary, dir).map_err(|e| {
        let _ = std::fs::remove_dir_all(temporary);
        fail("cannot commit the state", e)
    })?;
    std::fs::File::open(root)
        .and_then(|f| f.sync_all())
        .map_err(|e| fail("cannot sync --hibernate-dir", e))
}

/// Deletes `entry`, a temporary directory of a commit (`.`-named), when it is older than
/// ten minutes: a gateway that died did not finish it; one under way now, of another
/// gateway sharing the directory, is younger.
pub(in crate::kernels) async fn forget_if_stale(entry: &tokio::fs::DirEntry) {
    let age = entry
        .metadata()
        .await
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok());
    if age.is_some_and(|a| a > std::time::Duration::from_secs(600)) {
        forget(&entry.path()).await;
    }
}

pub(in crate::kernels) async fn forget(dir: &Path) {
    match tokio::fs::remove_dir_all(dir).await {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot delete a hibernated kernel's state")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tar_of(entries: &[(&str, tar::EntryType, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_mode(0o644);
            h.set_size(data.len() as u64);
            if *kind == tar::EntryType::Symlink {
                h.set_size(0);
                b.append_link(&mut h, path, "/etc/shadow").expect("link");
            } else {
                b.append_data(&mut h, path, *data).expect("append");
            }
        }
        b.into_inner().expect("tar")
    }

    #[test]
    fn only_directories_and_regular_files_are_kept() {
        let raw = tar_of(&[
            ("./data", tar::EntryType::Directory, b""),
            ("./data/a.csv", tar::EntryType::Regular, b"x,y\n1,2\n"),
            ("./escape", tar::EntryType::Symlink, b""),
        ]);
        match keep_files(&raw[..], Vec::new(), false) {
            Err(HibernateError::Blocked(why)) => assert!(why.contains("escape"), "{why}"),
            other => panic!("a link was accepted: {:?}", other.map(|k| k.dropped)),
        }
        let mut tar = Vec::new();
        let kept = keep_files(&raw[..], &mut tar, true).expect("lossy keeps the rest");
        assert_eq!(kept.dropped, ["escape"]);
        assert_eq!(kept.bytes, tar.len() as u64);
        let mut archive = tar::Archive::new(&tar[..]);
        let names: Vec<String> = archive
            .entries()
            .expect("entries")
            .map(|e| {
                e.expect("entry")
                    .path()
                    .expect("path")
                    .display()
                    .to_string()
            })
            .collect();
        assert_eq!(names, ["data", "data/a.csv"]);
    }

    #[test]
    fn a_commit_is_private_and_replaces_an_earlier_one() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().expect("tempdir");
        let dir = root.path().join("k1");
        let state = |bytes: &[u8]| {
            let partial = Partial::new(root.path(), "k1").expect("partial");
            std::io::Write::write_all(&mut partial.file().expect("file"), bytes).expect("write");
            partial.keep()
        };
        commit(root.path(), &dir, b"{}", &state(b"one")).expect("commit");
        commit(root.path(), &dir, b"{}", &state(b"two")).expect("commit again");
        let dropped = Partial::new(root.path(), "k2").expect("partial");
        drop(dropped);
        assert_eq!(std::fs::read(dir.join(TAR)).expect("tar"), b"two");
        let mode = std::fs::metadata(&dir).expect("dir").permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let mode = std::fs::metadata(dir.join(TAR))
            .expect("tar")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600);
        let left: Vec<_> = std::fs::read_dir(root.path()).expect("list").collect();
        assert_eq!(left.len(), 1, "a temporary directory was left behind");
    }
}
