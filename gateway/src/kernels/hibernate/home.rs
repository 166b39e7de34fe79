//! A kernel's home taken out of its sandbox, for a hibernation or a snapshot: streamed as a
//! tar through the filter that keeps only directories and regular files, into a state
//! being written; and the code that has the kernel's helper save its variables there first.

use super::store::{keep_files, ChunkReader, Kept, Partial};
use super::{py_str, HibernateError, Hibernation, PYTHON, STATE_DIR, STATE_OUT, STREAM_CHUNKS};
use crate::backend::{BackendError, ExecRequest, ExecStdin};
use crate::kernels::LiveKernel;

impl Hibernation {
    /// Streams `live`'s home (its files, and the state its helper saved there) out of its
    /// sandbox into `partial`'s tar, keeping only directories and regular files (links and
    /// special files refused by name unless `lossy`). `None` when it passes `max` bytes.
    pub(in crate::kernels) async fn home_out(
        &self,
        live: &LiveKernel,
        partial: &Partial,
        lossy: bool,
        max: u64,
    ) -> Result<Option<Kept>, HibernateError> {
        let max = usize::try_from(max).unwrap_or(usize::MAX);
        // The home streams through the filter into a file: the gateway holds a few chunks
        // of it at a time, never the whole state.
        let (chunks, received) = tokio::sync::mpsc::channel(STREAM_CHUNKS);
        let filter = {
            let file = partial.file();
            tokio::task::spawn_blocking(move || {
                let file = file.map_err(|e| {
                    HibernateError::Failed(format!("writing the kernel's files: {e}"))
                })?;
                let mut out = std::io::BufWriter::with_capacity(64 << 10, file);
                let mut reader = ChunkReader::new(received);
                let kept = keep_files(&mut reader, &mut out, lossy)?;
                // What follows the archive's end (tar's record padding) is read too, so
                // the command is never cut short.
                std::io::copy(&mut reader, &mut std::io::sink()).map_err(|e| {
                    HibernateError::Failed(format!("reading the kernel's files: {e}"))
                })?;
                let file = out.into_inner().map_err(|e| {
                    HibernateError::Failed(format!("writing the kernel's files: {e}"))
                })?;
                file.sync_all().map_err(|e| {
                    HibernateError::Failed(format!("writing the kernel's files: {e}"))
                })?;
                Ok(kept)
            })
        };
        let request = ExecRequest {
            argv: [PYTHON, "-P", "-c", STATE_OUT].map(str::to_owned).to_vec(),
            stdin: ExecStdin::Bytes(bytes::Bytes::new()),
            stdout: Some(chunks),
            max_stdout: max,
            timeout: self.kernels.settings.hibernate.command_timeout,
        };
        let out = self.kernels.backend.exec(&live.handle(), request).await;
        let kept = filter
            .await
            .map_err(|e| HibernateError::Failed(e.to_string()))
            .and_then(|r| r);
        let out = out.map_err(|e| match e {
            e @ BackendError::TimedOut { .. } => {
                HibernateError::Blocked(format!("taking the kernel's files out: {e}"))
            }
            e => HibernateError::Failed(format!("taking the state out: {e}")),
        })?;
        // Cut at the cap, the archive ends early: the cap is the reason.
        if out.truncated {
            return Ok(None);
        }
        let kept = kept?;
        if out.exit_code != 0 {
            return Err(HibernateError::Failed(format!(
                "taking the state out: {}",
                out.stderr.trim()
            )));
        }
        Ok(Some(kept))
    }
}

/// The code that has the kernel's helper save its variables into [`STATE_DIR`].
pub(in crate::kernels) fn save_code(lossy: bool, max_bytes: u64) -> String {
    format!(
        "__import__('kernelgate_state').save({}, lossy={}, max_bytes={max_bytes})",
        py_str(STATE_DIR),
        if lossy { "True" } else { "False" },
    )
}

/// The code that removes what the helper saved, from a kernel that runs on.
pub(in crate::kernels) fn forget_code() -> String {
    format!(
        "__import__('shutil').rmtree({}, ignore_errors=True)",
        py_str(STATE_DIR)
    )
}
