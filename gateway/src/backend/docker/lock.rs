//! One process per runtime directory: a process that starts on a runtime directory adopts
//! or removes the kernel containers labelled with it, so two processes sharing one would
//! take each other's kernels away. An exclusive `flock` on `<runtime dir>/kernelgate.lock`,
//! held for the life of the process (the kernel drops it when the process dies), keeps a
//! second one out.

use std::fs::{DirBuilder, File, OpenOptions, TryLockError};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

const LOCK_FILE: &str = "kernelgate.lock";

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("another kernelgate process uses the runtime directory {0}; give this one its own --runtime-dir")]
    InUse(PathBuf),
    #[error("cannot lock the runtime directory {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Held while the process uses the directory; the lock file is removed when dropped.
#[derive(Debug)]
pub struct RuntimeDirLock {
    _file: File,
    path: PathBuf,
}

impl RuntimeDirLock {
    /// Creates the directory if needed (mode 0711, as the socket directories expect) and
    /// takes its lock, or says who has it.
    pub fn acquire(runtime_dir: &Path) -> Result<Self, LockError> {
        let io = |source| LockError::Io {
            path: runtime_dir.to_owned(),
            source,
        };
        if !runtime_dir.is_dir() {
            DirBuilder::new()
                .recursive(true)
                .mode(0o711)
                .create(runtime_dir)
                .map_err(io)?;
        }
        let path = runtime_dir.join(LOCK_FILE);
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => Ok(RuntimeDirLock { _file: file, path }),
            Err(TryLockError::WouldBlock) => Err(LockError::InUse(runtime_dir.to_owned())),
            Err(TryLockError::Error(e)) => Err(io(e)),
        }
    }
}

impl Drop for RuntimeDirLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_until_the_first_lets_go() {
        let base = tempfile::tempdir().expect("tempdir");
        let dir = base.path().join("rt");
        let first = RuntimeDirLock::acquire(&dir).expect("first lock");
        assert!(matches!(
            RuntimeDirLock::acquire(&dir),
            Err(LockError::InUse(_))
        ));
        drop(first);
        assert!(!dir.join(LOCK_FILE).exists());
        RuntimeDirLock::acquire(&dir).expect("free again");
    }
}
