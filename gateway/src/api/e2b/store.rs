//! What the E2B surface keeps in the gateway's runtime directory so that a gateway killed
//! and started again on the same directory (which re-adopts its kernels) still serves its
//! sandboxes: the key their access tokens are made with ([`token_key`]) and their records
//! ([`Records`]: template, metadata, end of life, contexts).

use super::Sandbox;
use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The token key's file in the runtime directory.
pub const TOKEN_KEY_FILE: &str = "e2b-token-key";
/// The sandboxes' records in the runtime directory.
pub const RECORDS_FILE: &str = "e2b-sandboxes.json";

/// Why the E2B surface's state cannot be read or kept.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot read or write {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} holds {len} bytes, not the 32 of an E2B token key: remove it (the live sandboxes' access tokens then change)")]
    BadKey { path: PathBuf, len: usize },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_owned(),
        source,
    }
}

/// A file written whole under a name of its own (mode 0600), to be moved into place.
fn written(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf, StoreError> {
    let tmp = dir.join(format!(".{name}.{}", uuid::Uuid::new_v4().simple()));
    let result = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()
    })();
    match result {
        Ok(()) => Ok(tmp),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(io(&tmp)(e))
        }
    }
}

/// Removes the token key and the records: the gateway removed its kernels on its way out,
/// so no sandbox is left for them to serve.
pub fn forget(runtime_dir: &Path) {
    for name in [TOKEN_KEY_FILE, RECORDS_FILE] {
        let _ = std::fs::remove_file(runtime_dir.join(name));
    }
}

/// The key of this gateway's sandbox access tokens, without a cluster: 32 random bytes in
/// the runtime directory, made on the first start and read on every later one. It is made
/// whole under another name and linked into place, so two starts never see half a key and
/// never disagree on it (the link fails when one is there already; that one wins).
pub fn token_key(runtime_dir: &Path) -> Result<[u8; 32], StoreError> {
    let path = runtime_dir.join(TOKEN_KEY_FILE);
    if !path.exists() {
        let key: [u8; 32] = rand::random();
        let tmp = written(runtime_dir, TOKEN_KEY_FILE, &key)?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => return Ok(key),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(&path)(e)),
        }
    }
    let bytes = std::fs::read(&path).map_err(io(&path))?;
    <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| StoreError::BadKey {
        len: bytes.len(),
        path,
    })
}

/// The sandboxes' records, rewritten whole (atomically, 0600) at every change.
#[derive(Debug)]
pub struct Records {
    path: PathBuf,
}

impl Records {
    pub fn in_dir(runtime_dir: &Path) -> Records {
        Records {
            path: runtime_dir.join(RECORDS_FILE),
        }
    }

    /// The records an earlier run kept; none when there is no file. A file that does not
    /// parse is set aside (named in the log) rather than stopping the start.
    pub fn load(&self) -> Result<HashMap<String, Sandbox>, StoreError> {
        let bytes = match std::fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
            Err(e) => return Err(io(&self.path)(e)),
        };
        match serde_json::from_slice(&bytes) {
            Ok(records) => Ok(records),
            Err(e) => {
                let aside = self.path.with_extension("json.unreadable");
                tracing::warn!(path = %self.path.display(), moved_to = %aside.display(), error = %e,
                    "the E2B sandboxes' records do not parse: their sandboxes are no longer served as sandboxes");
                std::fs::rename(&self.path, &aside).map_err(io(&self.path))?;
                Ok(HashMap::new())
            }
        }
    }

    pub fn save(&self, records: &HashMap<String, Sandbox>) -> Result<(), StoreError> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        let bytes = serde_json::to_vec(records).unwrap_or_default();
        let tmp = written(dir, RECORDS_FILE, &bytes)?;
        std::fs::rename(&tmp, &self.path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io(&self.path)(e)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use std::os::unix::fs::PermissionsExt;

    fn dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kg-e2b-store-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        dir
    }

    #[test]
    fn the_token_key_is_made_once_private_and_then_reused() {
        let dir = dir();
        let first = token_key(&dir).unwrap_or_else(|e| panic!("{e}"));
        let mode = std::fs::metadata(dir.join(TOKEN_KEY_FILE))
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap_or_default();
        assert_eq!(mode, 0o600);
        // A later start (a restart after kill -9) gets the same key, hence the same tokens.
        assert_eq!(token_key(&dir).ok(), Some(first));
        // Another runtime directory: another gateway, another key.
        let other = dir.join("other");
        std::fs::create_dir(&other).unwrap_or_else(|e| panic!("{e}"));
        assert_ne!(token_key(&other).ok(), Some(first));
        // Nothing half-written is left behind.
        let names: Vec<String> = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        std::fs::write(dir.join(TOKEN_KEY_FILE), b"short").unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            token_key(&dir),
            Err(StoreError::BadKey { len: 5, .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn records_come_back_as_they_were_saved() {
        let dir = dir();
        let records = Records::in_dir(&dir);
        assert!(records.load().map(|r| r.is_empty()).unwrap_or(false));
        let now = Utc::now();
        let sandbox = Sandbox {
            template_id: "base".into(),
            metadata: [("run".to_owned(), "7".to_owned())].into(),
            started_at: now,
            end_at: now,
            contexts: Default::default(),
            contexts_run: ["c1".to_owned()].into(),
            pause_on_timeout: true,
        };
        let saved = HashMap::from([("k1".to_owned(), sandbox)]);
        records.save(&saved).unwrap_or_else(|e| panic!("{e}"));
        let loaded = records.load().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(loaded["k1"].metadata, saved["k1"].metadata);
        assert_eq!(loaded["k1"].end_at, now);
        assert_eq!(loaded["k1"].contexts_run, saved["k1"].contexts_run);
        assert!(loaded["k1"].pause_on_timeout);
        std::fs::write(dir.join(RECORDS_FILE), b"{not json").unwrap_or_else(|e| panic!("{e}"));
        assert!(records.load().map(|r| r.is_empty()).unwrap_or(false));
        assert!(dir.join("e2b-sandboxes.json.unreadable").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
