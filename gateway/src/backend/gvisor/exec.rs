//! Commands in a running sandbox, by `runsc exec`: bounded ones (the gateway's own, as the
//! kernel's user from `/`), interactive ones through the image's launcher and its syscall
//! filter (plain pipes, or a pseudo-terminal whose replica is runsc's stdio, so the
//! sandbox's process gets a terminal), and the kernel's files read out and put in.

use super::GvisorEngine;
use crate::backend::docker::sandboxes::SIGNAL_SCRIPT;
use crate::backend::docker::spec::{self as labels_spec, kernel_user, LAUNCHER_EXEC};
use crate::backend::docker::EXEC_TAG;
use crate::backend::sandbox::KERNEL_HOME;
use crate::backend::{
    files, BackendError, ExecOutput, ExecRequest, Interactive, InteractiveControl,
    InteractiveRequest, Output, Signal, TarStream, TtySize,
};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use std::os::fd::OwnedFd;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// Error text is for people; more than this is noise.
const MAX_STDERR: usize = 16 * 1024;
/// How long the gateway waits past a command's own timeout before it kills it itself.
const GRACE: Duration = Duration::from_secs(5);

impl GvisorEngine {
    pub(super) async fn exec_inner(
        &self,
        handle: &str,
        request: ExecRequest,
    ) -> Result<ExecOutput, BackendError> {
        self.existing_bundle(handle)?;
        let ExecRequest {
            argv,
            stdin,
            stdout: sink,
            max_stdout,
            timeout,
        } = request;
        let what = argv.join(" ");
        let seconds = timeout.as_secs().max(1).to_string();
        let mut child = self
            .runsc
            .command()
            .args(["exec", "--user", &kernel_user(), "--cwd", "/"])
            .arg("--env")
            .arg(format!("KERNELGATE_WORKDIR={}", labels_spec::KERNEL_HOME))
            .arg(handle)
            .args(["timeout", "-s", "KILL", &seconds])
            .args(&argv)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| self.runsc.spawn_error(e))?;
        let input = child.stdin.take().expect("piped");
        let mut output = child.stdout.take().expect("piped");
        let mut errors = child.stderr.take().expect("piped");
        let feed = crate::backend::files::feed(stdin, input);
        let drain = async {
            let mut out = ExecOutput::default();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = output.read(&mut buf).await.unwrap_or(0);
                if n == 0 {
                    break;
                }
                let room = max_stdout.saturating_sub(out.stdout.len());
                let kept = &buf[..n.min(room)];
                match &sink {
                    Some(sink) => {
                        if !kept.is_empty()
                            && sink
                                .send(bytes::Bytes::copy_from_slice(kept))
                                .await
                                .is_err()
                        {
                            out.truncated = true;
                            break;
                        }
                    }
                    None => out.stdout.extend_from_slice(kept),
                }
                if n > room {
                    out.truncated = true;
                    break;
                }
            }
            let mut err = Vec::new();
            let _ = (&mut errors)
                .take(MAX_STDERR as u64)
                .read_to_end(&mut err)
                .await;
            out.stderr = String::from_utf8_lossy(&err).into_owned();
            out
        };
        let bounded =
            tokio::time::timeout(timeout + GRACE, async { tokio::join!(feed, drain).1 }).await;
        let Ok(mut out) = bounded else {
            let _ = child.kill().await;
            return Err(BackendError::TimedOut {
                what,
                after: timeout,
            });
        };
        if out.truncated {
            let _ = child.kill().await;
            return Ok(out);
        }
        let status = child
            .wait()
            .await
            .map_err(|e| BackendError::Runtime(e.to_string()))?;
        out.exit_code = status.code().map_or(-1, i64::from);
        if out.exit_code == 124 || out.exit_code == 137 {
            return Err(BackendError::TimedOut {
                what,
                after: timeout,
            });
        }
        Ok(out)
    }

    /// The image's command the sandbox was made with: its launcher.
    fn launcher(&self, handle: &str) -> Result<Vec<String>, BackendError> {
        let meta = self.read_meta(handle)?;
        let launcher = if meta.launcher.is_empty() {
            // A bundle written before the launcher was recorded: the image's, now.
            (self.resolve)(&meta.image)?.cmd
        } else {
            meta.launcher
        };
        if launcher.is_empty() {
            return Err(BackendError::Runtime(format!(
                "sandbox {handle} has no command (its launcher) to run commands through"
            )));
        }
        Ok(launcher)
    }

    pub(super) async fn exec_interactive_inner(
        &self,
        handle: &str,
        request: InteractiveRequest,
    ) -> Result<Interactive, BackendError> {
        if !self.running(handle).await? {
            return Err(BackendError::Gone {
                handle: handle.to_owned(),
            });
        }
        let launcher = self.launcher(handle)?;
        let tag = uuid::Uuid::new_v4().simple().to_string();
        let workdir = request.workdir.unwrap_or_else(|| KERNEL_HOME.to_owned());
        let mut args: Vec<String> = ["exec", "--user", &kernel_user(), "--cwd", &workdir]
            .map(str::to_owned)
            .to_vec();
        let env = request.env.iter().map(|(k, v)| format!("{k}={v}")).chain([
            format!("KERNELGATE_WORKDIR={KERNEL_HOME}"),
            format!("{EXEC_TAG}={tag}"),
        ]);
        for pair in env {
            args.push("--env".to_owned());
            args.push(pair);
        }
        args.push(handle.to_owned());
        args.extend(launcher);
        args.push(LAUNCHER_EXEC.to_owned());
        args.extend(request.argv);
        let control = |child, terminal| ExecControl {
            engine: self.runsc.clone(),
            sandbox: handle.to_owned(),
            tag: tag.clone(),
            child: tokio::sync::Mutex::new(child),
            terminal,
        };
        match request.tty {
            None => {
                let mut child = self
                    .runsc
                    .command()
                    .args(&args)
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .map_err(|e| self.runsc.spawn_error(e))?;
                let stdin = child.stdin.take().expect("piped");
                let stdout = tokio_util::io::ReaderStream::new(child.stdout.take().expect("piped"))
                    .map(|r| r.map(Output::Stdout));
                let stderr = tokio_util::io::ReaderStream::new(child.stderr.take().expect("piped"))
                    .map(|r| r.map(Output::Stderr));
                let output = futures::stream::select(stdout, stderr)
                    .map(|r| {
                        r.map_err(|e| BackendError::Runtime(format!("interactive command: {e}")))
                    })
                    .boxed();
                Ok(Interactive {
                    stdin: Box::pin(Input {
                        pipe: Some(stdin),
                        end: None,
                    }),
                    output,
                    control: Box::new(control(child, None)),
                })
            }
            Some(size) => {
                let terminal = Terminal::open(size)?;
                // runsc exec leads its own session with the replica as its controlling
                // terminal: the sandbox's process gets a terminal, and a resize reaches it
                // (SIGWINCH, which runsc forwards).
                let runsc = self.runsc.command();
                let mut command = tokio::process::Command::new("setsid");
                command
                    .args(["--ctty", "--wait"])
                    .arg(runsc.as_std().get_program())
                    .args(runsc.as_std().get_args())
                    .args(&args)
                    .stdin(Stdio::from(terminal.replica()?))
                    .stdout(Stdio::from(terminal.replica()?))
                    .stderr(Stdio::from(terminal.replica()?))
                    .kill_on_drop(true);
                let child = command.spawn().map_err(|e| {
                    BackendError::Runtime(format!("cannot run setsid for a terminal: {e}"))
                })?;
                let reader = tokio::fs::File::from_std(std::fs::File::from(terminal.primary()?));
                let writer = tokio::fs::File::from_std(std::fs::File::from(terminal.primary()?));
                // The primary side reads EIO once the last replica is closed: the end.
                let output = tokio_util::io::ReaderStream::new(reader)
                    .take_while(|r| futures::future::ready(r.is_ok()))
                    .map(|r| {
                        r.map(Output::Stdout)
                            .map_err(|e| BackendError::Runtime(e.to_string()))
                    })
                    .boxed();
                Ok(Interactive {
                    stdin: Box::pin(Input {
                        pipe: Some(writer),
                        end: Some(EOT),
                    }),
                    output,
                    control: Box::new(control(child, Some(terminal))),
                })
            }
        }
    }

    pub(super) async fn read_home_inner(&self, handle: &str) -> Result<TarStream, BackendError> {
        files::read_home(
            |request| self.exec_inner(handle, request),
            files::home_cap(self.settings.disk_mb),
        )
        .await
    }

    pub(super) async fn put_tree_inner(
        &self,
        handle: &str,
        dest: &str,
        tree: bytes::Bytes,
    ) -> Result<(), BackendError> {
        files::put_tree(|request| self.exec_inner(handle, request), dest, tree).await
    }
}

/// A terminal's end of file: what Ctrl-D sends.
const EOT: u8 = 0x04;

/// An interactive command's stdin: shutting it down is end of file (the pipe closed, or
/// Ctrl-D sent on a terminal).
struct Input<W> {
    pipe: Option<W>,
    /// Written at shutdown before closing (a terminal's end of file).
    end: Option<u8>,
}

impl<W: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Input<W> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.pipe.as_mut() {
            Some(pipe) => std::pin::Pin::new(pipe).poll_write(cx, buf),
            None => std::task::Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
        }
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.pipe.as_mut() {
            Some(pipe) => std::pin::Pin::new(pipe).poll_flush(cx),
            None => std::task::Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::{ready, Poll};
        let this = &mut *self;
        let Some(pipe) = this.pipe.as_mut() else {
            return Poll::Ready(Ok(()));
        };
        if let Some(end) = this.end {
            let written = ready!(std::pin::Pin::new(&mut *pipe).poll_write(cx, &[end]))?;
            if written == 1 {
                this.end = None;
            }
        }
        ready!(std::pin::Pin::new(pipe).poll_flush(cx))?;
        // Closing the pipe is end of file; a terminal's primary side stays open elsewhere
        // (for the output), so only this copy of it goes.
        this.pipe = None;
        Poll::Ready(Ok(()))
    }
}

/// A pseudo-terminal: the primary side stays with the gateway, the replica becomes the
/// command's stdio.
#[derive(Debug)]
struct Terminal {
    primary: OwnedFd,
    replica_path: std::ffi::CString,
}

fn tty_error(e: impl std::fmt::Display) -> BackendError {
    BackendError::Runtime(format!("cannot open a terminal for the command: {e}"))
}

impl Terminal {
    fn open(size: TtySize) -> Result<Self, BackendError> {
        use rustix::pty::{grantpt, openpt, ptsname, unlockpt, OpenptFlags};
        let primary = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)
            .map_err(tty_error)?;
        grantpt(&primary).map_err(tty_error)?;
        unlockpt(&primary).map_err(tty_error)?;
        let replica_path = ptsname(&primary, Vec::new()).map_err(tty_error)?;
        let terminal = Terminal {
            primary,
            replica_path,
        };
        terminal.resize(size)?;
        Ok(terminal)
    }

    fn replica(&self) -> Result<OwnedFd, BackendError> {
        use rustix::fs::{open, Mode, OFlags};
        open(
            self.replica_path.as_c_str(),
            OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(tty_error)
    }

    fn primary(&self) -> Result<OwnedFd, BackendError> {
        self.primary.try_clone().map_err(tty_error)
    }

    fn resize(&self, size: TtySize) -> Result<(), BackendError> {
        let winsize = rustix::termios::Winsize {
            ws_row: size.rows,
            ws_col: size.cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        rustix::termios::tcsetwinsize(&self.primary, winsize).map_err(tty_error)
    }
}

/// Signals, resizes and waits for one interactive command in a sandbox.
#[derive(Debug)]
struct ExecControl {
    engine: super::runsc::Runsc,
    sandbox: String,
    /// The `KERNELGATE_EXEC` value its processes carry.
    tag: String,
    child: tokio::sync::Mutex<tokio::process::Child>,
    terminal: Option<Terminal>,
}

impl InteractiveControl for ExecControl {
    /// As under Docker: a second command inside the sandbox signals every process
    /// carrying the command's tag (runsc's own signal reaches one process only).
    fn signal(&self, signal: Signal) -> BoxFuture<'_, Result<(), BackendError>> {
        async move {
            let out = self
                .engine
                .command()
                .args(["exec", "--user", &kernel_user(), "--cwd", "/"])
                .arg(&self.sandbox)
                .args(["timeout", "-s", "KILL", "10", "python3", "-P", "-c"])
                .arg(SIGNAL_SCRIPT)
                .arg(&self.tag)
                .arg(signal.number().to_string())
                .output()
                .await
                .map_err(|e| self.engine.spawn_error(e))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(BackendError::Runtime(format!(
                    "signalling a command in sandbox {}: {}",
                    self.sandbox,
                    String::from_utf8_lossy(&out.stderr).trim()
                )))
            }
        }
        .boxed()
    }

    fn resize(&self, size: TtySize) -> BoxFuture<'_, Result<(), BackendError>> {
        async move {
            match &self.terminal {
                Some(terminal) => terminal.resize(size),
                None => Ok(()),
            }
        }
        .boxed()
    }

    fn wait(&self) -> BoxFuture<'_, Result<i64, BackendError>> {
        async move {
            let status = self
                .child
                .lock()
                .await
                .wait()
                .await
                .map_err(|e| BackendError::Runtime(e.to_string()))?;
            Ok(super::runsc::run_exit_code(status))
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[tokio::test]
    async fn ending_the_input_closes_a_pipe_and_sends_ctrl_d_to_a_terminal() {
        for (end, expected) in [(None, &b"hello\n"[..]), (Some(EOT), &b"hello\n\x04"[..])] {
            let (writer, mut reader) = tokio::io::duplex(64);
            let mut input = Input {
                pipe: Some(writer),
                end,
            };
            input.write_all(b"hello\n").await.expect("write");
            input.shutdown().await.expect("end of input");
            assert!(input.pipe.is_none(), "its copy of the pipe is closed");
            let mut seen = Vec::new();
            reader.read_to_end(&mut seen).await.expect("read");
            assert_eq!(seen, expected);
        }
    }
}
