//! A kernel's files through commands in its sandbox, for engines whose archive calls cannot
//! see the home (a tmpfs): the home read out by `tar -c` (spooled through a temporary
//! file) and a tree put in by `tar -x`, both as the kernel's user, bounded like every
//! [`ExecRequest`].

use super::sandbox::KERNEL_HOME;
use super::{BackendError, ExecOutput, ExecRequest, ExecStdin, TarStream};
use futures::StreamExt;
use std::future::Future;
use std::time::Duration;

/// How long reading a home out or putting a tree in may take.
pub const FILES_TIMEOUT: Duration = Duration::from_secs(600);

/// The most a home of `disk_mb` can hold as a tar: its tmpfs, with room for tar's headers.
pub fn home_cap(disk_mb: u64) -> usize {
    usize::try_from((disk_mb + 64) << 20).unwrap_or(usize::MAX)
}

/// The kernel's home as a tar stream, read by `exec` (a command in its sandbox) and at
/// most `cap` bytes.
pub async fn read_home<F, Fut>(exec: F, cap: usize) -> Result<TarStream, BackendError>
where
    F: FnOnce(ExecRequest) -> Fut,
    Fut: Future<Output = Result<ExecOutput, BackendError>>,
{
    let io = |e: std::io::Error| BackendError::Runtime(format!("reading a kernel's home: {e}"));
    let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(16);
    let mut request = ExecRequest::new(
        ["tar", "-c", "-f", "-", "-C", KERNEL_HOME, "."]
            .map(str::to_owned)
            .to_vec(),
        bytes::Bytes::new(),
        cap,
        FILES_TIMEOUT,
    );
    request.stdout = Some(tx);
    let spool = tempfile::tempfile().map_err(io)?;
    let mut file = tokio::fs::File::from_std(spool);
    let copy = async {
        use tokio::io::AsyncWriteExt;
        while let Some(chunk) = rx.recv().await {
            file.write_all(&chunk).await?;
        }
        file.flush().await?;
        Ok::<_, std::io::Error>(())
    };
    let (out, copied) = tokio::join!(exec(request), copy);
    let out = out?;
    copied.map_err(io)?;
    if out.exit_code != 0 || out.truncated {
        return Err(BackendError::Runtime(format!(
            "reading the kernel's home failed (exit {}{}): {}",
            out.exit_code,
            if out.truncated {
                ", past the size cap"
            } else {
                ""
            },
            out.stderr.trim()
        )));
    }
    use tokio::io::AsyncSeekExt;
    file.seek(std::io::SeekFrom::Start(0)).await.map_err(io)?;
    Ok(tokio_util::io::ReaderStream::new(file)
        .map(move |chunk| chunk.map_err(io))
        .boxed())
}

/// Unpacks the tar `tree` at `dest` by `exec` (a command in the sandbox).
pub async fn put_tree<F, Fut>(exec: F, dest: &str, tree: bytes::Bytes) -> Result<(), BackendError>
where
    F: FnOnce(ExecRequest) -> Fut,
    Fut: Future<Output = Result<ExecOutput, BackendError>>,
{
    let request = ExecRequest::new(
        ["tar", "-x", "-f", "-", "--no-same-owner", "-C", dest]
            .map(str::to_owned)
            .to_vec(),
        tree,
        64 * 1024,
        FILES_TIMEOUT,
    );
    let out = exec(request).await?;
    if out.exit_code != 0 {
        return Err(BackendError::Runtime(format!(
            "putting files at {dest} failed (exit {}): {}",
            out.exit_code,
            out.stderr.trim()
        )));
    }
    Ok(())
}

/// Writes a command's stdin into `input` and closes it. A command that stops reading early
/// (an error) closes its stdin: not an error of the write.
pub async fn feed<W: tokio::io::AsyncWrite + Unpin>(stdin: ExecStdin, mut input: W) {
    use tokio::io::AsyncWriteExt;
    match stdin {
        ExecStdin::Bytes(bytes) => {
            let _ = input.write_all(&bytes).await;
        }
        ExecStdin::File(path) => match tokio::fs::File::open(&path).await {
            Ok(mut file) => {
                let _ = tokio::io::copy(&mut file, &mut input).await;
            }
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "cannot read a file a command in a kernel's sandbox needs")
            }
        },
    }
    let _ = input.shutdown().await;
}
