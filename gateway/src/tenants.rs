//! Keys and the tenants they stand for: who may use the gateway, what they own, how much.
//!
//! A keys file (TOML) holds one `[[key]]` table per tenant with the SHA-256 of its token,
//! never the token itself. `--token` adds one admin key of its own (named `admin`). Keys are
//! read at start and again on SIGHUP ([`Keys::reload`]): a key that is gone, or whose token
//! changed, is revoked at once: its token is refused, its WebSockets close (its
//! [`Tenant::revoked`] is cancelled) and the caller removes its kernels.

use crate::config::{KeysAction, KeysArgs};
use anyhow::bail;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use tokio_util::sync::CancellationToken;

/// Name of the admin key `--token` gives, and of the caller when auth is off.
pub const TOKEN_KEY: &str = "admin";

/// One tenant, as a request authenticated with its key sees it.
#[derive(Debug)]
pub struct Tenant {
    pub name: String,
    /// Sees and manages every tenant's kernels.
    pub admin: bool,
    pub max_kernels: Option<usize>,
    /// Kernels hibernated at once, at most (docs/hibernation.md).
    pub max_hibernated: Option<usize>,
    /// Per kernel, at most.
    pub max_memory_mb: Option<u64>,
    /// Per kernel, at most.
    pub max_cpus: Option<f64>,
    /// Snapshots it may keep (docs/snapshots.md).
    pub max_snapshots: Option<usize>,
    /// MiB its snapshots may take together.
    pub snapshot_max_mb: Option<u64>,
    /// Cancelled when the key is revoked.
    pub revoked: CancellationToken,
}

impl Tenant {
    /// An admin with no limits of its own.
    pub fn admin(name: &str) -> Arc<Tenant> {
        Arc::new(Tenant {
            name: name.to_owned(),
            admin: true,
            max_kernels: None,
            max_hibernated: None,
            max_memory_mb: None,
            max_cpus: None,
            max_snapshots: None,
            snapshot_max_mb: None,
            revoked: CancellationToken::new(),
        })
    }

    /// Whether this tenant may see and use a kernel owned by `owner`.
    pub fn may_use(&self, owner: &str) -> bool {
        self.admin || self.name == owner
    }
}

/// One `[[key]]` table of the keys file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyEntry {
    pub name: String,
    pub token_sha256: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub admin: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_kernels: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_hibernated: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_memory_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cpus: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_snapshots: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_max_mb: Option<u64>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeysFile {
    #[serde(default)]
    pub key: Vec<KeyEntry>,
}

impl KeysFile {
    /// Reads and checks a keys file; a missing file is an empty one.
    pub fn read(path: &Path) -> Result<KeysFile, String> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(format!("cannot read keys file {}: {e}", path.display())),
        };
        let file: KeysFile = toml::from_str(&text)
            .map_err(|e| format!("keys file {} is not valid: {e}", path.display()))?;
        let mut seen = std::collections::HashSet::new();
        for k in &file.key {
            if !valid_name(&k.name) {
                return Err(format!(
                    "keys file {}: key name {:?} must be 1-64 letters, digits, '-', '_' or '.'",
                    path.display(),
                    k.name
                ));
            }
            if !seen.insert(k.name.as_str()) {
                return Err(format!(
                    "keys file {}: the name {:?} is used twice",
                    path.display(),
                    k.name
                ));
            }
            if digest_from_hex(&k.token_sha256).is_none() {
                return Err(format!(
                    "keys file {}: key {:?}: token_sha256 must be 64 hex digits (the SHA-256 of the token)",
                    path.display(),
                    k.name
                ));
            }
            if k.max_cpus.is_some_and(|c| !(c.is_finite() && c > 0.0)) {
                return Err(format!(
                    "keys file {}: key {:?}: max_cpus must be above 0",
                    path.display(),
                    k.name
                ));
            }
            if k.max_memory_mb == Some(0)
                || k.max_kernels == Some(0)
                || k.snapshot_max_mb == Some(0)
            {
                return Err(format!(
                    "keys file {}: key {:?}: limits must be above 0 (leave a limit out for none)",
                    path.display(),
                    k.name
                ));
            }
        }
        Ok(file)
    }

    /// Writes the file atomically, readable by its owner only.
    pub fn write(&self, path: &Path) -> Result<(), String> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let text = toml::to_string(self).map_err(|e| e.to_string())?;
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
        f.write_all(text.as_bytes())
            .and_then(|_| f.sync_all())
            .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, path).map_err(|e| format!("cannot write {}: {e}", path.display()))
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

fn digest_from_hex(hex_digest: &str) -> Option<[u8; 32]> {
    let bytes = hex::decode(hex_digest.trim()).ok()?;
    bytes.try_into().ok()
}

pub fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Constant time for equal-length inputs: no early exit.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The keys in force.
#[derive(Debug)]
pub struct Keys {
    file: Option<PathBuf>,
    /// `--token`'s key, kept across reloads.
    token: Option<([u8; 32], Arc<Tenant>)>,
    /// Auth switched off: every caller is this admin.
    anonymous: Option<Arc<Tenant>>,
    from_file: RwLock<Vec<([u8; 32], Arc<Tenant>)>>,
}

impl Keys {
    /// No authentication (`--no-auth`).
    pub fn disabled() -> Keys {
        Keys {
            file: None,
            token: None,
            anonymous: Some(Tenant::admin("anonymous")),
            from_file: RwLock::new(Vec::new()),
        }
    }

    /// `--token` and/or `--keys`.
    pub fn new(token: Option<&str>, file: Option<PathBuf>) -> Result<Keys, String> {
        let keys = Keys {
            token: token.map(|t| (token_digest(t), Tenant::admin(TOKEN_KEY))),
            file,
            anonymous: None,
            from_file: RwLock::new(Vec::new()),
        };
        keys.reload()?;
        Ok(keys)
    }

    pub fn required(&self) -> bool {
        self.anonymous.is_none()
    }

    /// The tenant a token belongs to. Every key is compared, in constant time each.
    pub fn authenticate(&self, presented: Option<&str>) -> Option<Arc<Tenant>> {
        if let Some(anon) = &self.anonymous {
            return Some(anon.clone());
        }
        let got = token_digest(presented?);
        let mut found = None;
        if let Some((digest, tenant)) = &self.token {
            if same(&got, digest) {
                found = Some(tenant.clone());
            }
        }
        let keys = self.from_file.read().unwrap_or_else(|e| e.into_inner());
        for (digest, tenant) in keys.iter() {
            if same(&got, digest) && found.is_none() {
                found = Some(tenant.clone());
            }
        }
        found
    }

    /// Reads the keys file again. Returns the tenants whose keys were revoked (gone, or
    /// their token changed); their `revoked` tokens are already cancelled. A file that
    /// does not parse keeps the keys in force.
    pub fn reload(&self) -> Result<Vec<Arc<Tenant>>, String> {
        let Some(path) = &self.file else {
            return Ok(Vec::new());
        };
        let file = KeysFile::read(path)?;
        if let Some(clash) = file.key.iter().find(|k| k.name == TOKEN_KEY) {
            if self.token.is_some() {
                return Err(format!(
                    "keys file {}: the name {:?} is taken by --token's key",
                    path.display(),
                    clash.name
                ));
            }
        }
        let mut keys = self.from_file.write().unwrap_or_else(|e| e.into_inner());
        let old: HashMap<String, ([u8; 32], Arc<Tenant>)> = keys
            .drain(..)
            .map(|(d, t)| (t.name.clone(), (d, t)))
            .collect();
        let mut revoked: Vec<Arc<Tenant>> = Vec::new();
        let mut kept_names = std::collections::HashSet::new();
        for entry in &file.key {
            let digest = digest_from_hex(&entry.token_sha256).unwrap_or_default();
            // A kept key keeps its revocation token (its WebSockets stay open) unless
            // its token changed.
            let revoked_token = match old.get(&entry.name) {
                Some((d, t)) if same(d, &digest) => {
                    kept_names.insert(entry.name.clone());
                    t.revoked.clone()
                }
                _ => CancellationToken::new(),
            };
            keys.push((
                digest,
                Arc::new(Tenant {
                    name: entry.name.clone(),
                    admin: entry.admin,
                    max_kernels: entry.max_kernels,
                    max_hibernated: entry.max_hibernated,
                    max_memory_mb: entry.max_memory_mb,
                    max_cpus: entry.max_cpus,
                    max_snapshots: entry.max_snapshots,
                    snapshot_max_mb: entry.snapshot_max_mb,
                    revoked: revoked_token,
                }),
            ));
        }
        for (name, (_, tenant)) in old {
            if !kept_names.contains(&name) {
                tenant.revoked.cancel();
                revoked.push(tenant);
            }
        }
        Ok(revoked)
    }

    /// The tenant of this name, if it holds a key now (a call another node forwarded names
    /// its key; this node checks it against its own file).
    pub fn tenant_named(&self, name: &str) -> Option<Arc<Tenant>> {
        if let Some(anon) = &self.anonymous {
            return Some(anon.clone());
        }
        if let Some((_, t)) = self.token.as_ref().filter(|(_, t)| t.name == name) {
            return Some(t.clone());
        }
        let keys = self.from_file.read().unwrap_or_else(|e| e.into_inner());
        keys.iter()
            .find(|(_, t)| t.name == name)
            .map(|(_, t)| t.clone())
    }

    /// Whether a tenant of this name holds a key now (a kernel's owner that is not is
    /// an orphan of a revoked key).
    pub fn knows(&self, name: &str) -> bool {
        if self.anonymous.is_some() || self.token.as_ref().is_some_and(|(_, t)| t.name == name) {
            return true;
        }
        let keys = self.from_file.read().unwrap_or_else(|e| e.into_inner());
        keys.iter().any(|(_, t)| t.name == name)
    }
}

/// A new random token: 256 bits, hex.
pub fn generate_token() -> String {
    kernelgate_protocol::SigningKey::generate_hex()
}

/// `kernelgate keys add|list|remove`.
pub fn keys_command(args: KeysArgs) -> anyhow::Result<()> {
    let mut file = KeysFile::read(&args.file).map_err(anyhow::Error::msg)?;
    match args.action {
        KeysAction::Add {
            name,
            admin,
            max_kernels,
            max_hibernated,
            max_memory_mb,
            max_cpus,
            max_snapshots,
            snapshot_max_mb,
        } => {
            if file.key.iter().any(|k| k.name == name) {
                bail!(
                    "a key named {name:?} exists already in {}; remove it first",
                    args.file.display()
                );
            }
            let token = generate_token();
            file.key.push(KeyEntry {
                name,
                token_sha256: hex::encode(token_digest(&token)),
                admin,
                max_kernels,
                max_hibernated,
                max_memory_mb,
                max_cpus,
                max_snapshots,
                snapshot_max_mb,
            });
            file.write(&args.file).map_err(anyhow::Error::msg)?;
            // Checks the new entry as the gateway will.
            KeysFile::read(&args.file).map_err(anyhow::Error::msg)?;
            println!("{token}");
        }
        KeysAction::List => {
            let limit = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
            println!(
                "{:<24} {:<6} {:>11} {:>13} {:>8}",
                "NAME", "ADMIN", "MAX_KERNELS", "MAX_MEMORY_MB", "MAX_CPUS"
            );
            for k in &file.key {
                println!(
                    "{:<24} {:<6} {:>11} {:>13} {:>8}",
                    k.name,
                    if k.admin { "yes" } else { "no" },
                    limit(k.max_kernels.map(|v| v.to_string())),
                    limit(k.max_memory_mb.map(|v| v.to_string())),
                    limit(k.max_cpus.map(|v| v.to_string())),
                );
            }
        }
        KeysAction::Remove { name } => {
            let before = file.key.len();
            file.key.retain(|k| k.name != name);
            if file.key.len() == before {
                bail!("no key named {name:?} in {}", args.file.display());
            }
            file.write(&args.file).map_err(anyhow::Error::msg)?;
            eprintln!("removed {name:?}; send SIGHUP to a running gateway to revoke it");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, token: &str) -> KeyEntry {
        KeyEntry {
            name: name.into(),
            token_sha256: hex::encode(token_digest(token)),
            admin: false,
            max_kernels: Some(2),
            max_hibernated: None,
            max_memory_mb: None,
            max_cpus: None,
            max_snapshots: None,
            snapshot_max_mb: None,
        }
    }

    fn file_with(entries: Vec<KeyEntry>) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("keys.toml");
        KeysFile { key: entries }.write(&path).expect("write");
        (dir, path)
    }

    #[test]
    fn tokens_map_to_their_tenants_and_the_file_holds_no_token() {
        let (_dir, path) = file_with(vec![entry("alice", "a-token"), entry("bob", "b-token")]);
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(!text.contains("a-token"));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let keys = Keys::new(Some("root-token"), Some(path)).expect("keys");
        let alice = keys.authenticate(Some("a-token")).expect("alice");
        assert_eq!(alice.name, "alice");
        assert!(!alice.admin);
        assert_eq!(alice.max_kernels, Some(2));
        assert_eq!(keys.authenticate(Some("b-token")).expect("bob").name, "bob");
        let admin = keys.authenticate(Some("root-token")).expect("admin");
        assert!(admin.admin && admin.name == TOKEN_KEY);
        assert!(keys.authenticate(Some("nope")).is_none());
        assert!(keys.authenticate(None).is_none());
        assert!(alice.may_use("alice") && !alice.may_use("bob") && admin.may_use("bob"));
    }

    #[test]
    fn reload_revokes_removed_and_changed_keys_only() {
        let (_dir, path) = file_with(vec![
            entry("alice", "a"),
            entry("bob", "b"),
            entry("carol", "c"),
        ]);
        let keys = Keys::new(None, Some(path.clone())).expect("keys");
        let alice = keys.authenticate(Some("a")).expect("alice");
        let bob = keys.authenticate(Some("b")).expect("bob");
        let carol = keys.authenticate(Some("c")).expect("carol");
        KeysFile {
            key: vec![entry("alice", "a"), entry("carol", "c2")],
        }
        .write(&path)
        .expect("write");
        let mut revoked: Vec<String> = keys
            .reload()
            .expect("reload")
            .iter()
            .map(|t| t.name.clone())
            .collect();
        revoked.sort();
        assert_eq!(revoked, ["bob", "carol"]);
        assert!(bob.revoked.is_cancelled() && carol.revoked.is_cancelled());
        assert!(!alice.revoked.is_cancelled());
        assert!(keys.authenticate(Some("b")).is_none());
        assert!(keys.authenticate(Some("c")).is_none());
        assert_eq!(keys.authenticate(Some("c2")).expect("carol").name, "carol");
        assert!(keys.knows("alice") && !keys.knows("bob"));
        // A broken file keeps the keys in force.
        std::fs::write(&path, "[[key]]\nname = 'x'\n").expect("write");
        assert!(keys.reload().is_err());
        assert!(keys.authenticate(Some("a")).is_some());
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("k.toml");
        for (text, says) in [
            ("[[key]]\nname = 'a'\ntoken_sha256 = 'zz'\n", "64 hex digits"),
            ("[[key]]\nname = 'a b'\ntoken_sha256 = '00'\n", "letters, digits"),
            ("[[key]]\nname = 'a'\ntoken_sha256 = '00'\ncolour = 1\n", "unknown field"),
            (
                &format!(
                    "[[key]]\nname = 'a'\ntoken_sha256 = '{0}'\n[[key]]\nname = 'a'\ntoken_sha256 = '{0}'\n",
                    "0".repeat(64)
                ),
                "used twice",
            ),
            (
                &format!("[[key]]\nname = 'a'\ntoken_sha256 = '{}'\nmax_cpus = 0.0\n", "0".repeat(64)),
                "above 0",
            ),
        ] {
            std::fs::write(&path, text).expect("write");
            let err = KeysFile::read(&path).expect_err(text);
            assert!(err.contains(says), "{err} should say {says}");
        }
    }
}
