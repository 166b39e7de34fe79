//! Installs asked for from inside a kernel (`%pip install`, `!pip install`): the kernel's
//! installer appends one JSON line per install to a file in its socket directory, and the
//! relay writes each new line to the audit trail as the kernel's report, just before the
//! record of the execution it happened in. The kernel writes that file, so nothing in it
//! is trusted: it is opened without following links, read in bounded pieces, and only
//! its own fields are kept.

use crate::audit::{PackageRefusal, PackageVersion};
use serde::Deserialize;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Bytes read from the file per execution, at most; the rest waits for the next one.
const MAX_READ: u64 = 64 << 10;
/// Entries kept from one line, at most.
const MAX_ITEMS: usize = 64;

/// One install the kernel reported.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Reported {
    pub argv: Vec<String>,
    pub requested: Vec<String>,
    pub installed: Vec<PackageVersion>,
    pub refused: Vec<PackageRefusal>,
}

/// The report file of the kernel's current process, and how far it was read.
#[derive(Debug)]
pub struct Reports {
    path: PathBuf,
    offset: u64,
}

impl Reports {
    /// The reports in `socket_dir`, from its current end on: what an earlier process of the
    /// same kernel wrote was read then.
    pub fn at(socket_dir: &Path) -> Reports {
        let path = socket_dir.join(crate::packages::REPORT_FILE);
        let offset = std::fs::symlink_metadata(&path)
            .map(|m| m.len())
            .unwrap_or(0);
        Reports { path, offset }
    }

    /// The complete lines added since the last call (none when the file is missing or is
    /// not a regular file).
    pub fn take_new(&mut self) -> Vec<Reported> {
        let Ok(meta) = std::fs::symlink_metadata(&self.path) else {
            return Vec::new();
        };
        if !meta.is_file() || meta.len() <= self.offset {
            // Truncated (or replaced by something else): start over at its end.
            self.offset = self.offset.min(meta.len());
            return Vec::new();
        }
        let mut bytes = Vec::new();
        let read = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc_flags())
            .open(&self.path)
            .and_then(|mut f| {
                if !f.metadata()?.is_file() {
                    return Ok(());
                }
                f.seek(SeekFrom::Start(self.offset))?;
                f.take(MAX_READ).read_to_end(&mut bytes).map(|_| ())
            });
        if read.is_err() {
            return Vec::new();
        }
        let Some(end) = bytes.iter().rposition(|&b| b == b'\n') else {
            if bytes.len() as u64 >= MAX_READ {
                // One line longer than a read: skip it.
                self.offset += bytes.len() as u64;
            }
            return Vec::new();
        };
        self.offset += end as u64 + 1;
        bytes[..end]
            .split(|&b| b == b'\n')
            .filter_map(|line| serde_json::from_slice::<Reported>(line).ok())
            .map(|mut r| {
                r.argv.truncate(MAX_ITEMS);
                r.requested.truncate(MAX_ITEMS);
                r.installed.truncate(MAX_ITEMS);
                r.refused.truncate(MAX_ITEMS);
                r
            })
            .collect()
    }
}

/// `O_NOFOLLOW | O_NONBLOCK`: a link or a FIFO the kernel planted is neither followed nor
/// waited on.
fn libc_flags() -> i32 {
    const O_NONBLOCK: i32 = 0o4000;
    const O_NOFOLLOW: i32 = 0o400000;
    O_NONBLOCK | O_NOFOLLOW
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn new_complete_lines_are_read_once_and_links_are_not_followed() {
        let dir = tempfile::tempdir().expect("test file");
        let file = dir.path().join(crate::packages::REPORT_FILE);
        std::fs::write(&file, "{\"requested\":[\"old\"]}\n").expect("test file");
        let mut reports = Reports::at(dir.path());
        assert!(
            reports.take_new().is_empty(),
            "what was there before is not read"
        );
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&file)
            .expect("test file");
        f.write_all(b"{\"argv\":[\"pip\",\"install\",\"a\"],\"requested\":[\"a\"],\"installed\":[{\"name\":\"a\",\"version\":\"1.0\"}]}\nnot json\n{\"requested\":[\"b\"],\"refused\":[{\"requirement\":\"b\",\"reason\":\"not allowed\"}]}\n{\"requested\":[\"half").expect("test file");
        let got = reports.take_new();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].installed[0].version, "1.0");
        assert_eq!(got[1].refused[0].reason, "not allowed");
        assert!(reports.take_new().is_empty());
        f.write_all(b"\"]}\n").expect("test file");
        assert_eq!(reports.take_new()[0].requested, ["half"]);

        std::fs::remove_file(&file).expect("test file");
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "{\"requested\":[\"x\"]}\n".repeat(3)).expect("test file");
        std::os::unix::fs::symlink(&secret, &file).expect("test file");
        let mut fresh = Reports {
            path: file,
            offset: 0,
        };
        assert!(fresh.take_new().is_empty(), "a link is not followed");
    }
}
