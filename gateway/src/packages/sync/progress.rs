//! What a sync reports as it goes: typed events, which `kernelgate packages sync` prints as
//! lines (their `Display`).

use super::super::lock::PythonTarget;
use std::fmt;
use std::path::Path;

/// One step of a sync.
#[derive(Debug)]
pub enum Progress<'a> {
    /// The image's Python, as the sync targets it.
    Image {
        image: &'a str,
        key: &'a str,
        interpreter: &'a str,
        target: &'a PythonTarget,
    },
    /// An allowlist entry is being resolved.
    Resolving { requirement: &'a str },
    /// An entry is locked: the packages it brings (name and version), none when the image
    /// has it all.
    Locked {
        requirement: &'a str,
        brings: Vec<String>,
    },
    /// An entry cannot be synced.
    Refused {
        requirement: &'a str,
        reason: &'a str,
    },
    /// The unpacked packages were compiled to bytecode for the image's Python.
    Compiled { packages: usize },
    /// They could not be: they import, more slowly.
    NotCompiled { error: String },
    /// What was downloaded, reused, and left to the image.
    Fetched {
        wheels: usize,
        bytes: u64,
        reused: usize,
        in_image: Vec<&'a str>,
    },
    /// The lock is written.
    Wrote {
        lock: &'a Path,
        synced: usize,
        entries: usize,
        refused: usize,
        unpacked: usize,
    },
}

impl fmt::Display for Progress<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Progress::Image {
                image,
                key,
                interpreter,
                target,
            } => write!(
                f,
                "Image {image} ({key}): Python {} ({interpreter}, {}-{}, platforms {})",
                target.version,
                target.implementation,
                target.abi,
                summarize(&target.platforms, 3),
            ),
            Progress::Resolving { requirement } => write!(f, "Resolving {requirement}"),
            Progress::Locked {
                requirement,
                brings,
            } if brings.is_empty() => write!(f, "Locked {requirement}: already in the image"),
            Progress::Locked {
                requirement,
                brings,
            } => write!(f, "Locked {requirement}: {}", summarize(brings, 8)),
            Progress::Refused {
                requirement,
                reason,
            } => write!(f, "Refused {requirement}: {reason}"),
            Progress::Compiled { packages } => write!(
                f,
                "Compiled {packages} unpacked package{} to bytecode for the image's Python",
                plural(*packages)
            ),
            Progress::NotCompiled { error } => write!(
                f,
                "Warning: could not compile the unpacked packages to bytecode ({error}); they \
                 import, more slowly"
            ),
            Progress::Fetched {
                wheels,
                bytes,
                reused,
                in_image,
            } => {
                write!(
                    f,
                    "Fetched {wheels} wheel{} ({}), reused {reused}, skipped {} already in the image",
                    plural(*wheels),
                    size(*bytes),
                    in_image.len(),
                )?;
                if !in_image.is_empty() {
                    write!(f, ": {}", summarize(in_image, 12))?;
                }
                Ok(())
            }
            Progress::Wrote {
                lock,
                synced,
                entries,
                refused,
                unpacked,
            } => write!(
                f,
                "Wrote {} ({synced} of {entries} allowlist entries synced, {refused} refused, \
                 {unpacked} unpacked now)",
                lock.display()
            ),
        }
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// `1.3 MiB`, or `12 KiB` below a MiB.
pub(super) fn size(bytes: u64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if bytes < 1024 * 1024 {
        format!("{} KiB", bytes.div_ceil(1024))
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB)
    }
}

/// Up to `max` items joined, then how many more.
pub(super) fn summarize<S: AsRef<str>>(items: &[S], max: usize) -> String {
    let shown: Vec<&str> = items.iter().take(max).map(AsRef::as_ref).collect();
    let mut text = shown.join(", ");
    if items.len() > max {
        text.push_str(&format!(" and {} more", items.len() - max));
    }
    text
}
