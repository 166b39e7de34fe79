//! Files in a kernel's working directory, for the files API and MCP's file tools.
//!
//! Every operation runs inside the kernel's own container as the kernel's user (a small
//! script through the backend's `exec`), never on host paths: the container is the
//! boundary, and a symlink the kernel made can only point into its own sandbox. The script
//! still refuses absolute paths, `..` and symlinks leading out of the working directory,
//! so callers get a clear error rather than a surprise.

use super::{Kernels, LiveKernel};
use crate::audit::{FileAccess, FileEvent, Record};
use crate::backend::{BackendError, ExecRequest};
use bytes::Bytes;

const SCRIPT: &str = include_str!("../../assets/files.py");

// Exit codes of the script (see its header).
const NOT_FOUND: i64 = 10;
const BAD_PATH: i64 = 11;
const IS_DIR: i64 = 12;
const NOT_DIR: i64 = 13;
const EXISTS_DIR: i64 = 14;
const FORBIDDEN: i64 = 15;
const NO_SPACE: i64 = 16;

/// What to do with a path: the files API's operations.
pub use kernelgate_protocol::agent::FileOp;

/// The script's word for the operation.
fn script_arg(op: FileOp) -> &'static str {
    match op {
        FileOp::List => "list",
        FileOp::Get => "get",
        FileOp::Put => "put",
        FileOp::Delete => "delete",
    }
}

fn audit_event(op: FileOp) -> FileEvent {
    match op {
        FileOp::List => FileEvent::Listed,
        FileOp::Get => FileEvent::Read,
        FileOp::Put => FileEvent::Written,
        FileOp::Delete => FileEvent::Deleted,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{path}: {reason}")]
    NotFound { path: String, reason: String },
    /// Absolute, `..`, control characters, or out of the working directory.
    #[error("{path}: {reason}")]
    BadPath { path: String, reason: String },
    /// A directory where a file was wanted, or the other way round.
    #[error("{path}: {reason}")]
    WrongKind { path: String, reason: String },
    /// The kernel's filesystem refused it (permissions, a read-only place).
    #[error("{path}: {reason}")]
    Forbidden { path: String, reason: String },
    /// The kernel's working directory is full.
    #[error("{path}: {reason}")]
    NoSpace { path: String, reason: String },
    #[error("{path} is larger than the {limit_mib} MiB limit")]
    TooLarge { path: String, limit_mib: usize },
    #[error("{path}: {reason}")]
    Failed { path: String, reason: String },
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Runs `op` on `path` in `live`'s working directory for the key `key` (audited).
/// Output larger than `max_bytes` is refused with [`FileError::TooLarge`].
pub async fn perform(
    kernels: &std::sync::Arc<Kernels>,
    live: &LiveKernel,
    key: &str,
    op: FileOp,
    path: &str,
    body: Bytes,
    max_bytes: usize,
) -> Result<Vec<u8>, FileError> {
    kernels
        .audit()
        .record(&Record::file(
            audit_event(op),
            FileAccess {
                key: key.to_owned(),
                kernel: live.id().to_owned(),
                path: path.to_owned(),
                bytes: Some(body.len()),
                offset: None,
                length: None,
            },
        ))
        .await;
    script(kernels, live, &[script_arg(op), path], body, max_bytes).await
}

/// Reads at most `length` bytes of the file at `path` from `offset` (none past its end),
/// for the key `key` (audited as a read); also the file's size.
pub async fn read_part(
    kernels: &std::sync::Arc<Kernels>,
    live: &LiveKernel,
    key: &str,
    path: &str,
    offset: u64,
    length: usize,
) -> Result<(Vec<u8>, u64), FileError> {
    kernels
        .audit()
        .record(&Record::file(
            audit_event(FileOp::Get),
            FileAccess {
                key: key.to_owned(),
                kernel: live.id().to_owned(),
                path: path.to_owned(),
                bytes: None,
                offset: Some(offset),
                length: Some(length),
            },
        ))
        .await;
    let (offset_arg, length_arg) = (offset.to_string(), length.to_string());
    let args = ["read", path, &offset_arg, &length_arg];
    // The size line comes first: at most 20 digits and a newline.
    let out = script(kernels, live, &args, Bytes::new(), length + 21).await?;
    let size = out
        .iter()
        .position(|&b| b == b'\n')
        .and_then(|nl| Some((std::str::from_utf8(&out[..nl]).ok()?.parse().ok()?, nl)));
    let Some((size, nl)) = size else {
        return Err(FileError::Failed {
            path: path.to_owned(),
            reason: "the file script answered without the file's size".into(),
        });
    };
    Ok((out[nl + 1..].to_vec(), size))
}

/// Runs the files script with `args` in the kernel's container.
async fn script(
    kernels: &std::sync::Arc<Kernels>,
    live: &LiveKernel,
    args: &[&str],
    body: Bytes,
    max_bytes: usize,
) -> Result<Vec<u8>, FileError> {
    let path = args.get(1).copied().unwrap_or_default();
    if path.chars().any(char::is_control) {
        return Err(FileError::BadPath {
            path: path.escape_default().to_string(),
            reason: "file paths may not contain NUL or other control characters".into(),
        });
    }
    // Its files are in its saved state while it hibernates: bring it back first.
    if let Some(live) = kernels.get(live.id()).filter(|l| l.hibernated()) {
        kernels
            .hibernation()
            .resume(&live)
            .await
            .map_err(|e| FileError::Failed {
                path: path.to_owned(),
                reason: format!("the hibernated kernel could not be resumed: {e}"),
            })?;
    }
    // `-P`: nothing in the kernel's home (a `json.py`) shadows what the script imports.
    let argv = ["python3", "-P", "-c", SCRIPT]
        .into_iter()
        .chain(args.iter().copied())
        .map(str::to_owned)
        .collect();
    let request = ExecRequest::new(argv, body, max_bytes, kernels.command_timeout());
    let out = kernels.backend().exec(&live.handle(), request).await?;
    let reason = match out.stderr.trim() {
        "" => "file operation failed".to_owned(),
        message => message.to_owned(),
    };
    let path = path.to_owned();
    Err(match out.exit_code {
        0 if out.truncated => FileError::TooLarge {
            path,
            limit_mib: max_bytes >> 20,
        },
        0 => return Ok(out.stdout),
        NOT_FOUND => FileError::NotFound { path, reason },
        BAD_PATH => FileError::BadPath { path, reason },
        IS_DIR | NOT_DIR | EXISTS_DIR => FileError::WrongKind { path, reason },
        FORBIDDEN => FileError::Forbidden { path, reason },
        NO_SPACE => FileError::NoSpace { path, reason },
        _ => FileError::Failed { path, reason },
    })
}
