//! Reading an image archive as `docker save` writes it (`manifest.json`, one config JSON per
//! image, layer tars) or as an OCI image layout (`oci-layout`, `index.json`,
//! `blobs/sha256/...`); Docker 25 and later write both at once, and `manifest.json` wins then
//! because it carries the short tags. Nothing is extracted here: members are read in place
//! from their offsets in the archive.

use super::ImageError;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// One image found in an archive: its config (raw bytes, whose sha256 is the image id) and
/// its layers, lowest first.
#[derive(Debug, Clone)]
pub(super) struct ArchiveImage {
    pub config: Vec<u8>,
    /// `sha256:<hex>`, as the archive names the config (checked against the bytes).
    pub declared_id: Option<String>,
    pub tags: Vec<String>,
    pub layers: Vec<String>,
}

#[derive(Debug, Clone)]
enum Member {
    File { offset: u64, size: u64 },
    Link(String),
}

/// An opened archive: where each member sits.
#[derive(Debug)]
pub(super) struct Archive {
    path: PathBuf,
    members: HashMap<String, Member>,
}

/// Lexical normalisation of a member name: no leading `./` or `/`, no `.` components; `None`
/// if `..` climbs out of the archive.
fn normalise(name: &str) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    for part in name.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            p => parts.push(p),
        }
    }
    Some(parts.join("/"))
}

impl Archive {
    /// Indexes the tar at `path` (uncompressed; see [`super::ImageStore::import`] for gzip).
    pub fn open(path: &Path) -> Result<Self, ImageError> {
        let io_err = |source| ImageError::Io {
            action: "read the archive",
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        let mut archive = tar::Archive::new(file);
        let mut members = HashMap::new();
        let entries = archive
            .entries_with_seek()
            .map_err(|e| not_an_archive(path, format!("not a tar file ({e})")))?;
        for entry in entries {
            let entry = entry.map_err(|e| not_an_archive(path, format!("bad tar entry ({e})")))?;
            let name = entry
                .path()
                .map_err(|e| not_an_archive(path, format!("bad member name ({e})")))?
                .to_string_lossy()
                .into_owned();
            let Some(name) = normalise(&name) else {
                continue;
            };
            let kind = entry.header().entry_type();
            let member = if kind.is_symlink() || kind.is_hard_link() {
                let target = entry
                    .link_name()
                    .map_err(|e| not_an_archive(path, format!("bad link in {name} ({e})")))?
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned();
                // A symlink is relative to its own directory, a hard link to the archive root.
                if kind.is_symlink() && !target.starts_with('/') {
                    let dir = name.rsplit_once('/').map_or("", |(d, _)| d);
                    Member::Link(format!("{dir}/{target}"))
                } else {
                    Member::Link(target)
                }
            } else if kind.is_file() {
                Member::File {
                    offset: entry.raw_file_position(),
                    size: entry.size(),
                }
            } else {
                continue;
            };
            members.insert(name, member);
        }
        if members.is_empty() {
            return Err(not_an_archive(path, "the tar file is empty".to_owned()));
        }
        Ok(Self {
            path: path.to_path_buf(),
            members,
        })
    }

    fn locate(&self, name: &str) -> Result<(u64, u64), ImageError> {
        let mut current = normalise(name).ok_or_else(|| self.missing(name))?;
        for _ in 0..16 {
            match self.members.get(&current) {
                Some(Member::File { offset, size }) => return Ok((*offset, *size)),
                Some(Member::Link(target)) => {
                    current = normalise(target).ok_or_else(|| self.missing(name))?;
                }
                None => break,
            }
        }
        Err(self.missing(name))
    }

    fn missing(&self, name: &str) -> ImageError {
        ImageError::MissingMember {
            archive: self.path.clone(),
            member: name.to_owned(),
        }
    }

    pub fn has(&self, name: &str) -> bool {
        self.locate(name).is_ok()
    }

    /// A member's bytes as a stream.
    pub fn open_member(&self, name: &str) -> Result<io::Take<File>, ImageError> {
        let (offset, size) = self.locate(name)?;
        let io_err = |source| ImageError::Io {
            action: "read the archive",
            path: self.path.clone(),
            source,
        };
        let mut file = File::open(&self.path).map_err(io_err)?;
        file.seek(SeekFrom::Start(offset)).map_err(io_err)?;
        Ok(file.take(size))
    }

    /// A small member (a manifest, a config) read whole.
    pub fn read_member(&self, name: &str) -> Result<Vec<u8>, ImageError> {
        let (_, size) = self.locate(name)?;
        if size > 64 << 20 {
            return Err(not_an_archive(
                &self.path,
                format!("{name} is {size} bytes, too big for a manifest or config"),
            ));
        }
        let mut bytes = Vec::new();
        self.open_member(name)?
            .read_to_end(&mut bytes)
            .map_err(|source| ImageError::Io {
                action: "read the archive",
                path: self.path.clone(),
                source,
            })?;
        Ok(bytes)
    }

    /// Every image the archive holds, from `manifest.json` if present, else from the OCI
    /// layout's `index.json`.
    pub fn images(&self) -> Result<Vec<ArchiveImage>, ImageError> {
        if self.has("manifest.json") {
            self.docker_images()
        } else if self.has("index.json") {
            self.oci_images()
        } else {
            Err(not_an_archive(
                &self.path,
                "it has neither manifest.json (docker save) nor index.json (OCI layout)".to_owned(),
            ))
        }
    }

    fn json<T: for<'de> Deserialize<'de>>(&self, name: &str) -> Result<T, ImageError> {
        let bytes = self.read_member(name)?;
        serde_json::from_slice(&bytes).map_err(|e| {
            not_an_archive(&self.path, format!("{name} is not what it should be: {e}"))
        })
    }

    fn docker_images(&self) -> Result<Vec<ArchiveImage>, ImageError> {
        #[derive(Deserialize)]
        #[serde(rename_all = "PascalCase")]
        struct Entry {
            config: String,
            #[serde(default)]
            repo_tags: Option<Vec<String>>,
            layers: Vec<String>,
        }
        let entries: Vec<Entry> = self.json("manifest.json")?;
        entries
            .into_iter()
            .map(|e| {
                let config = self.read_member(&e.config)?;
                // `<hex>.json` (before Docker 25) or `blobs/sha256/<hex>` (since).
                let file = e.config.rsplit('/').next().unwrap_or_default();
                let hex = file.strip_suffix(".json").unwrap_or(file);
                let declared_id = is_sha256_hex(hex).then(|| format!("sha256:{hex}"));
                Ok(ArchiveImage {
                    config,
                    declared_id,
                    tags: e
                        .repo_tags
                        .unwrap_or_default()
                        .iter()
                        .map(|t| normalise_reference(t))
                        .collect(),
                    layers: e.layers,
                })
            })
            .collect()
    }

    fn oci_images(&self) -> Result<Vec<ArchiveImage>, ImageError> {
        let index: Index = self.json("index.json")?;
        let mut images = Vec::new();
        for descriptor in &index.manifests {
            let tags = descriptor_tags(descriptor);
            self.oci_descriptor(descriptor, tags, &mut images, 0)?;
        }
        Ok(images)
    }

    fn oci_descriptor(
        &self,
        descriptor: &Descriptor,
        tags: Vec<String>,
        images: &mut Vec<ArchiveImage>,
        depth: usize,
    ) -> Result<(), ImageError> {
        if depth > 4 {
            return Err(not_an_archive(
                &self.path,
                "image indexes nest too deep".to_owned(),
            ));
        }
        let blob = blob_path(&descriptor.digest).ok_or_else(|| {
            not_an_archive(&self.path, format!("bad digest {}", descriptor.digest))
        })?;
        let value: serde_json::Value = self.json(&blob)?;
        if value.get("manifests").is_some() {
            // An index (several platforms, attestations): the manifest for this machine.
            let index: Index = serde_json::from_value(value)
                .map_err(|e| not_an_archive(&self.path, format!("{blob}: {e}")))?;
            let arch = oci_architecture();
            let chosen = index.manifests.iter().find(|m| {
                m.platform
                    .as_ref()
                    .is_some_and(|p| p.os == "linux" && p.architecture == arch)
            });
            let chosen = match chosen {
                Some(c) => c,
                None if index.manifests.len() == 1 => &index.manifests[0],
                None => {
                    return Err(not_an_archive(
                        &self.path,
                        format!("the image index {blob} has no manifest for linux/{arch}"),
                    ))
                }
            };
            return self.oci_descriptor(chosen, tags, images, depth + 1);
        }
        let manifest: Manifest = serde_json::from_value(value)
            .map_err(|e| not_an_archive(&self.path, format!("{blob}: {e}")))?;
        let config_blob = blob_path(&manifest.config.digest).ok_or_else(|| {
            not_an_archive(&self.path, format!("bad digest {}", manifest.config.digest))
        })?;
        let layers = manifest
            .layers
            .iter()
            .map(|l| {
                blob_path(&l.digest)
                    .ok_or_else(|| not_an_archive(&self.path, format!("bad digest {}", l.digest)))
            })
            .collect::<Result<_, _>>()?;
        images.push(ArchiveImage {
            config: self.read_member(&config_blob)?,
            declared_id: Some(manifest.config.digest.clone()),
            tags,
            layers,
        });
        Ok(())
    }
}

#[derive(Deserialize)]
struct Index {
    #[serde(default)]
    manifests: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct Descriptor {
    digest: String,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Deserialize)]
struct Platform {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
}

#[derive(Deserialize)]
struct Manifest {
    config: Descriptor,
    #[serde(default)]
    layers: Vec<Descriptor>,
}

/// The tag an OCI index entry carries: containerd's full name if present, else the OCI ref
/// name (which some tools fill with a whole reference, others with just a tag).
fn descriptor_tags(d: &Descriptor) -> Vec<String> {
    d.annotations
        .get("io.containerd.image.name")
        .or_else(|| d.annotations.get("org.opencontainers.image.ref.name"))
        .map(|r| vec![normalise_reference(r)])
        .unwrap_or_default()
}

/// `name` -> `name:latest`; `<registry>/library/name:tag` (the default registry's official
/// images, as containerd spells them) -> `name:tag`; digests (`@sha256:...`) kept as they are.
pub(super) fn normalise_reference(reference: &str) -> String {
    let mut r = reference.trim();
    if let Some((first, rest)) = r.split_once('/') {
        if (first.contains('.') || first.contains(':')) && rest.starts_with("library/") {
            r = &rest["library/".len()..];
        }
    }
    if r.contains('@') {
        return r.to_owned();
    }
    let last = r.rsplit('/').next().unwrap_or(r);
    if last.contains(':') {
        r.to_owned()
    } else {
        format!("{r}:latest")
    }
}

fn blob_path(digest: &str) -> Option<String> {
    let hex = digest.strip_prefix("sha256:")?;
    is_sha256_hex(hex).then(|| format!("blobs/sha256/{hex}"))
}

pub(super) fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// This machine's architecture as OCI names it.
fn oci_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

fn not_an_archive(path: &Path, reason: String) -> ImageError {
    ImageError::NotAnArchive {
        path: path.to_path_buf(),
        reason,
    }
}

/// A layer's bytes decompressed: gzip is recognised by its magic bytes, zstd is refused.
pub(super) fn decompressed<R: Read + 'static>(
    reader: R,
    layer: &str,
) -> Result<Box<dyn Read>, ImageError> {
    let mut reader = BufReader::with_capacity(1 << 16, reader);
    let head = reader.fill_buf().map_err(|source| ImageError::Io {
        action: "read the layer",
        path: PathBuf::from(layer),
        source,
    })?;
    if head.starts_with(&[0x1f, 0x8b]) {
        Ok(Box::new(flate2::read::MultiGzDecoder::new(reader)))
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Err(ImageError::UnsupportedCompression {
            layer: layer.to_owned(),
            compression: "zstd",
        })
    } else {
        Ok(Box::new(reader))
    }
}
