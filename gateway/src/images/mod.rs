//! The image store: kernel images kept without Docker, for engines that run kernels from a
//! root filesystem directory (docs/image-store.md).
//!
//! Layout under the store's root:
//! - `<id-hex>/rootfs`: the image's root filesystem, unpacked once per image id (its layers
//!   applied in order, whiteouts included), with no write bit for group or others;
//! - `<id-hex>/config.json`: the image's config as the archive carried it (its sha256 is the
//!   id), from which [`ImageConfig`] is read;
//! - `tags.json`: `name:tag` -> image id, replaced atomically.
//!
//! An import unpacks into a `.tmp-*` directory beside the images and renames it into place,
//! so a crash never leaves a half-made image under an id.

mod archive;
pub mod cli;
mod layers;

use archive::{is_sha256_hex, normalise_reference, Archive, ArchiveImage};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Where `kernelgate image` keeps images unless `--image-store` says.
pub const DEFAULT_IMAGE_STORE: &str = "/var/lib/kernelgate/images";

const TAGS_FILE: &str = "tags.json";
/// Taken while `tags.json` is read, changed and written back.
const TAGS_LOCK: &str = "tags.lock";
const CONFIG_FILE: &str = "config.json";
const ROOTFS_DIR: &str = "rootfs";
const TEMP_PREFIX: &str = ".tmp-";

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("could not {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "no image {reference:?} in the image store {}: {}; bring it in with \
         `kernelgate image import FILE` (FILE from `docker save IMAGE -o FILE`, or \
         `make image-archive`)",
        store.display(),
        have(available)
    )]
    NotFound {
        reference: String,
        store: PathBuf,
        /// Tags (or short ids of untagged images) the store has.
        available: Vec<String>,
    },
    #[error(
        "{reference:?} matches several images in the image store: {}; give more of the id \
         or a tag",
        candidates.join(", ")
    )]
    Ambiguous {
        reference: String,
        candidates: Vec<String>,
    },
    #[error(
        "{} is not an image archive as `docker save` or an OCI image layout writes it: {reason}",
        path.display()
    )]
    NotAnArchive { path: PathBuf, reason: String },
    #[error(
        "the archive {} lacks {member}, which its manifest names: it is truncated or was not \
         written by `docker save`; save the image again",
        archive.display()
    )]
    MissingMember { archive: PathBuf, member: String },
    #[error(
        "{what} does not match its digest (expected {expected}, got {actual}): the archive is \
         damaged; save the image again"
    )]
    DigestMismatch {
        what: String,
        expected: String,
        actual: String,
    },
    #[error(
        "layer {layer} is compressed with {compression}, which the image store cannot read; \
         save the image with `docker save` (uncompressed or gzip layers)"
    )]
    UnsupportedCompression {
        layer: String,
        compression: &'static str,
    },
    #[error("layer {layer} is not a readable tar: {reason}")]
    BadLayer { layer: String, reason: String },
    #[error(
        "refusing to import: layer {layer} writes {}, which is unsafe ({reason}); only import \
         archives from a source you trust",
        path.display()
    )]
    UnsafePath {
        layer: String,
        path: PathBuf,
        reason: String,
    },
    #[error("the image config {what} is not valid JSON: {source}")]
    BadConfig {
        what: String,
        #[source]
        source: serde_json::Error,
    },
}

fn have(available: &[String]) -> String {
    if available.is_empty() {
        "the store is empty".to_owned()
    } else {
        format!("it has {}", available.join(", "))
    }
}

/// An image in the store.
#[derive(Debug, Clone)]
pub struct StoredImage {
    /// `sha256:<hex>`: the digest of the image's config.
    pub id: String,
    /// `name:tag`, sorted.
    pub tags: Vec<String>,
    /// The unpacked root filesystem (mount it read-only: sandboxes share it).
    pub rootfs: PathBuf,
    pub config: ImageConfig,
}

/// What a sandbox needs from the image's config (`config` of the OCI image config).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    pub env: Vec<String>,
    pub user: Option<String>,
    pub working_dir: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub labels: BTreeMap<String, String>,
}

impl ImageConfig {
    /// Reads the `config` object of an OCI / Docker image config JSON (absent or null
    /// fields are empty; an empty `User` or `WorkingDir` is none).
    pub fn from_image_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        #[derive(Deserialize, Default)]
        #[serde(rename_all = "PascalCase")]
        struct Raw {
            env: Option<Vec<String>>,
            user: Option<String>,
            working_dir: Option<String>,
            entrypoint: Option<Vec<String>>,
            cmd: Option<Vec<String>>,
            labels: Option<BTreeMap<String, String>>,
        }
        #[derive(Deserialize)]
        struct Outer {
            config: Option<Raw>,
        }
        let raw = serde_json::from_slice::<Outer>(bytes)?
            .config
            .unwrap_or_default();
        Ok(Self {
            env: raw.env.unwrap_or_default(),
            user: raw.user.filter(|u| !u.is_empty()),
            working_dir: raw.working_dir.filter(|w| !w.is_empty()),
            entrypoint: raw.entrypoint.unwrap_or_default(),
            cmd: raw.cmd.unwrap_or_default(),
            labels: raw.labels.unwrap_or_default(),
        })
    }
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct TagsFile {
    tags: BTreeMap<String, String>,
}

/// A directory of unpacked images.
#[derive(Debug)]
pub struct ImageStore {
    root: PathBuf,
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl ImageStore {
    /// Opens the store at `root`, creating the directory (mode 0755) if it is missing, and
    /// removes what imports of processes that are gone left half done.
    pub fn open(root: PathBuf) -> Result<Self, ImageError> {
        fs::create_dir_all(&root).map_err(|source| ImageError::Io {
            action: "create the image store",
            path: root.clone(),
            source,
        })?;
        let store = Self { root };
        store.remove_abandoned();
        Ok(store)
    }

    /// `.tmp-<what>-<pid>-<n>` entries whose process no longer runs.
    fn remove_abandoned(&self) {
        let Ok(entries) = fs::read_dir(&self.root) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(TEMP_PREFIX) else {
                continue;
            };
            let pid = rest.rsplit('-').nth(1).and_then(|p| p.parse::<u32>().ok());
            let Some(pid) = pid else { continue };
            if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
                let path = entry.path();
                let removed = if path.is_dir() {
                    fs::remove_dir_all(&path)
                } else {
                    fs::remove_file(&path)
                };
                if let Err(e) = removed {
                    tracing::warn!(path = %path.display(), error = %e, "could not remove an abandoned import");
                }
            }
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Imports every image of `archive` (`docker save` output or an OCI layout tar, itself
    /// possibly gzip'd). An image whose id is already stored is not unpacked again: only its
    /// tags are added. A tag that named another image moves to this one.
    pub fn import(&self, archive: &Path) -> Result<Vec<StoredImage>, ImageError> {
        let gunzipped = self.gunzip_if_needed(archive)?;
        let opened = Archive::open(gunzipped.as_ref().map_or(archive, |(_, file)| file))?;
        let mut found = opened.images()?;
        if found.is_empty() {
            return Err(ImageError::NotAnArchive {
                path: archive.to_path_buf(),
                reason: "its manifest lists no image".to_owned(),
            });
        }
        // One entry per id (an OCI index lists an image once per tag).
        let mut by_id: BTreeMap<String, ArchiveImage> = BTreeMap::new();
        for image in found.drain(..) {
            let id = format!("sha256:{}", hex::encode(Sha256::digest(&image.config)));
            if let Some(declared) = &image.declared_id {
                if *declared != id {
                    return Err(ImageError::DigestMismatch {
                        what: format!("the image config of {}", archive.display()),
                        expected: declared.clone(),
                        actual: id,
                    });
                }
            }
            match by_id.get_mut(&id) {
                Some(seen) => seen.tags.extend(image.tags),
                None => {
                    by_id.insert(id, image);
                }
            }
        }
        for (id, image) in &by_id {
            self.unpack(&opened, id, image)?;
        }
        // Read, changed and written under the store's lock: concurrent imports keep each
        // other's tags.
        let _held = self.lock_tags()?;
        let mut tags = self.read_tags()?;
        for (id, image) in &by_id {
            for tag in &image.tags {
                tags.tags.insert(tag.clone(), id.clone());
            }
        }
        self.write_tags(&tags)?;
        by_id.keys().map(|id| self.load(id, &tags)).collect()
    }

    /// The image `reference` names: `name:tag`, `name` (= `name:latest`), `sha256:<hex>`,
    /// or a unique prefix of the id's hex (with or without `sha256:`).
    pub fn find(&self, reference: &str) -> Result<StoredImage, ImageError> {
        let tags = self.read_tags()?;
        let reference = reference.trim();
        let by_tag = tags
            .tags
            .get(reference)
            .or_else(|| tags.tags.get(&normalise_reference(reference)));
        if let Some(id) = by_tag {
            if self.image_dir(id).join(CONFIG_FILE).is_file() {
                return self.load(id, &tags);
            }
        }
        let hex = reference.strip_prefix("sha256:").unwrap_or(reference);
        if !hex.is_empty() && hex.len() <= 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            let hex = hex.to_ascii_lowercase();
            let matches: Vec<String> = self
                .ids()?
                .into_iter()
                .filter(|id| id["sha256:".len()..].starts_with(&hex))
                .collect();
            match matches.as_slice() {
                [id] => return self.load(id, &tags),
                [] => {}
                several => {
                    return Err(ImageError::Ambiguous {
                        reference: reference.to_owned(),
                        candidates: several.to_vec(),
                    })
                }
            }
        }
        let mut available = Vec::new();
        for image in self.list()? {
            if image.tags.is_empty() {
                available.push(short_id(&image.id).to_owned());
            } else {
                available.extend(image.tags);
            }
        }
        Err(ImageError::NotFound {
            reference: reference.to_owned(),
            store: self.root.clone(),
            available,
        })
    }

    /// Every stored image, ordered by id.
    pub fn list(&self) -> Result<Vec<StoredImage>, ImageError> {
        let tags = self.read_tags()?;
        self.ids()?.iter().map(|id| self.load(id, &tags)).collect()
    }

    /// Bytes the image's root filesystem takes (hard links counted once).
    pub fn size(&self, image: &StoredImage) -> Result<u64, ImageError> {
        layers::disk_usage(&image.rootfs).map_err(|source| ImageError::Io {
            action: "measure",
            path: image.rootfs.clone(),
            source,
        })
    }

    fn image_dir(&self, id: &str) -> PathBuf {
        self.root.join(id.strip_prefix("sha256:").unwrap_or(id))
    }

    fn ids(&self) -> Result<Vec<String>, ImageError> {
        let entries = fs::read_dir(&self.root).map_err(|source| ImageError::Io {
            action: "read the image store",
            path: self.root.clone(),
            source,
        })?;
        let mut ids = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if is_sha256_hex(&name) && entry.path().join(CONFIG_FILE).is_file() {
                ids.push(format!("sha256:{name}"));
            }
        }
        ids.sort();
        Ok(ids)
    }

    fn load(&self, id: &str, tags: &TagsFile) -> Result<StoredImage, ImageError> {
        let dir = self.image_dir(id);
        let config_path = dir.join(CONFIG_FILE);
        let bytes = fs::read(&config_path).map_err(|source| ImageError::Io {
            action: "read",
            path: config_path.clone(),
            source,
        })?;
        let config =
            ImageConfig::from_image_json(&bytes).map_err(|source| ImageError::BadConfig {
                what: config_path.display().to_string(),
                source,
            })?;
        Ok(StoredImage {
            id: id.to_owned(),
            tags: tags
                .tags
                .iter()
                .filter(|(_, v)| *v == id)
                .map(|(k, _)| k.clone())
                .collect(),
            rootfs: dir.join(ROOTFS_DIR),
            config,
        })
    }

    /// Unpacks `image` under its id unless it is there already.
    fn unpack(&self, archive: &Archive, id: &str, image: &ArchiveImage) -> Result<(), ImageError> {
        let dir = self.image_dir(id);
        if dir.join(CONFIG_FILE).is_file() {
            return Ok(());
        }
        // Parsed only to refuse a bad config before unpacking anything.
        ImageConfig::from_image_json(&image.config).map_err(|source| ImageError::BadConfig {
            what: format!("of image {id}"),
            source,
        })?;
        let diff_ids = diff_ids(&image.config);
        let temp = TempDir::new(&self.root, "image")?;
        let rootfs = temp.path().join(ROOTFS_DIR);
        let io_err = |action, path: &Path| {
            let path = path.to_path_buf();
            move |source| ImageError::Io {
                action,
                path,
                source,
            }
        };
        fs::create_dir(&rootfs).map_err(io_err("create", &rootfs))?;
        fs::set_permissions(&rootfs, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .map_err(io_err("set the mode of", &rootfs))?;
        let chown = running_as_root();
        let mut dir_times = layers::DirTimes::new();
        for (i, layer) in image.layers.iter().enumerate() {
            let stream = archive::decompressed(archive.open_member(layer)?, layer)?;
            let mut hashing = HashingReader::new(stream);
            layers::apply(&rootfs, &mut hashing, layer, chown, &mut dir_times)?;
            let actual = hashing.finish();
            if let Some(expected) = diff_ids.as_ref().and_then(|d| d.get(i)) {
                if *expected != actual {
                    return Err(ImageError::DigestMismatch {
                        what: format!("layer {layer} of image {id}"),
                        expected: expected.clone(),
                        actual,
                    });
                }
            }
        }
        layers::set_dir_times(&rootfs, &dir_times)
            .map_err(io_err("set directory times in", &rootfs))?;
        layers::seal(&rootfs).map_err(io_err("seal", &rootfs))?;
        let config_path = temp.path().join(CONFIG_FILE);
        fs::write(&config_path, &image.config).map_err(io_err("write", &config_path))?;
        fs::set_permissions(
            temp.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .map_err(io_err("set the mode of", temp.path()))?;
        match fs::rename(temp.path(), &dir) {
            Ok(()) => {
                temp.keep();
                Ok(())
            }
            // Another import of the same id finished first: its copy is as good.
            Err(_) if dir.join(CONFIG_FILE).is_file() => Ok(()),
            Err(source) => Err(ImageError::Io {
                action: "move the unpacked image into place at",
                path: dir,
                source,
            }),
        }
    }

    /// A gzip'd archive is decompressed into a temporary file first (members are read in
    /// place by offset, which a gzip stream cannot give).
    fn gunzip_if_needed(&self, archive: &Path) -> Result<Option<(TempDir, PathBuf)>, ImageError> {
        let io_err = |source| ImageError::Io {
            action: "read",
            path: archive.to_path_buf(),
            source,
        };
        let mut file = fs::File::open(archive).map_err(io_err)?;
        let mut magic = [0u8; 2];
        let n = file.read(&mut magic).map_err(io_err)?;
        if n < 2 || magic != [0x1f, 0x8b] {
            return Ok(None);
        }
        let file = fs::File::open(archive).map_err(io_err)?;
        let temp = TempDir::new(&self.root, "archive")?;
        let out_path = temp.path().join("archive.tar");
        let mut out = fs::File::create(&out_path).map_err(|source| ImageError::Io {
            action: "write",
            path: out_path.clone(),
            source,
        })?;
        io::copy(&mut flate2::read::MultiGzDecoder::new(file), &mut out).map_err(|source| {
            ImageError::NotAnArchive {
                path: archive.to_path_buf(),
                reason: format!("it looks gzip'd but does not decompress ({source})"),
            }
        })?;
        Ok(Some((temp, out_path)))
    }

    /// An exclusive lock on `<store>/tags.lock`, held until the file is dropped.
    fn lock_tags(&self) -> Result<fs::File, ImageError> {
        let path = self.root.join(TAGS_LOCK);
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .and_then(|file| file.lock().map(|()| file));
        file.map_err(|source| ImageError::Io {
            action: "lock",
            path,
            source,
        })
    }

    fn read_tags(&self) -> Result<TagsFile, ImageError> {
        let path = self.root.join(TAGS_FILE);
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|source| ImageError::BadConfig {
                what: path.display().to_string(),
                source,
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(TagsFile::default()),
            Err(source) => Err(ImageError::Io {
                action: "read",
                path,
                source,
            }),
        }
    }

    /// Writes the tags through a temporary file renamed over the old one.
    fn write_tags(&self, tags: &TagsFile) -> Result<(), ImageError> {
        let path = self.root.join(TAGS_FILE);
        let temp = self.root.join(format!(
            "{TEMP_PREFIX}tags-{}-{}",
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let io_err = |action, p: &Path| {
            let p = p.to_path_buf();
            move |source| ImageError::Io {
                action,
                path: p,
                source,
            }
        };
        let mut bytes =
            serde_json::to_vec_pretty(tags).map_err(|source| ImageError::BadConfig {
                what: path.display().to_string(),
                source,
            })?;
        bytes.push(b'\n');
        let mut file = fs::File::create(&temp).map_err(io_err("write", &temp))?;
        file.write_all(&bytes)
            .and_then(|()| file.sync_all())
            .map_err(io_err("write", &temp))?;
        fs::rename(&temp, &path).map_err(io_err("replace", &path))
    }
}

/// The first 12 hex digits of an id, as `docker images` shows it.
pub fn short_id(id: &str) -> &str {
    let hex = id.strip_prefix("sha256:").unwrap_or(id);
    &hex[..hex.len().min(12)]
}

/// `rootfs.diff_ids` of an image config: the sha256 of each uncompressed layer tar.
fn diff_ids(config: &[u8]) -> Option<Vec<String>> {
    #[derive(Deserialize)]
    struct Rootfs {
        diff_ids: Vec<String>,
    }
    #[derive(Deserialize)]
    struct Outer {
        rootfs: Rootfs,
    }
    serde_json::from_slice::<Outer>(config)
        .ok()
        .map(|o| o.rootfs.diff_ids)
}

fn running_as_root() -> bool {
    fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// A reader that hashes what passes through it.
struct HashingReader<R> {
    inner: R,
    digest: Sha256,
}

impl<R> HashingReader<R> {
    fn new(inner: R) -> Self {
        Self {
            inner,
            digest: Sha256::new(),
        }
    }

    fn finish(self) -> String {
        format!("sha256:{}", hex::encode(self.digest.finalize()))
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.digest.update(&buf[..n]);
        Ok(n)
    }
}

/// A directory under the store's root that is removed on drop unless kept.
#[derive(Debug)]
struct TempDir {
    path: PathBuf,
    keep: bool,
}

impl TempDir {
    fn new(root: &Path, what: &str) -> Result<Self, ImageError> {
        let path = root.join(format!(
            "{TEMP_PREFIX}{what}-{}-{}",
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir(&path).map_err(|source| ImageError::Io {
            action: "create",
            path: path.clone(),
            source,
        })?;
        fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o700)).map_err(
            |source| ImageError::Io {
                action: "set the mode of",
                path: path.clone(),
                source,
            },
        )?;
        Ok(Self { path, keep: false })
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests;
