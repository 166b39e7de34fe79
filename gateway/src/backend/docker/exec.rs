//! Commands in a kernel's container (`docker exec`): the gateway's own, bounded by a
//! timeout inside and a kill of their whole process group past it, and attached ones.

use super::errors::{map_handle_error, runtime};
use super::{spec, DockerBackend};
use crate::backend::{BackendError, ExecOutput, ExecRequest};
use bollard::container::LogOutput;
use bollard::errors::Error as DockerError;
use bollard::exec::{CreateExecOptions, StartExecResults};
use futures::StreamExt;

/// An exec attached to its stdin and output, with its id.
type AttachedExec = (
    String,
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<LogOutput, DockerError>> + Send>>,
    std::pin::Pin<Box<dyn tokio::io::AsyncWrite + Send>>,
);

impl DockerBackend {
    pub(super) async fn exec_inner(
        &self,
        handle: &str,
        request: ExecRequest,
    ) -> Result<ExecOutput, BackendError> {
        use bollard::container::LogOutput;
        /// Error text is for people; more than this is noise.
        const MAX_STDERR: usize = 16 * 1024;

        let ExecRequest {
            argv,
            stdin,
            stdout: sink,
            max_stdout,
            timeout,
        } = request;
        let what = describe_argv(&argv);
        // Killed inside the sandbox: Docker has no call that stops an exec.
        let seconds = timeout.as_secs().max(1);
        let tag = uuid::Uuid::new_v4().simple().to_string();
        let cmd = ["timeout", "-s", "KILL", &seconds.to_string()]
            .into_iter()
            .map(str::to_owned)
            .chain(argv)
            .collect();
        let config = CreateExecOptions {
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            cmd: Some(cmd),
            env: Some(vec![
                format!("KERNELGATE_WORKDIR={}", spec::KERNEL_HOME),
                format!("{EXEC_TAG}={tag}"),
            ]),
            user: Some(spec::kernel_user()),
            // Never the kernel's home: nothing there can shadow what the command imports.
            working_dir: Some("/".to_owned()),
            ..Default::default()
        };
        let started_at = tokio::time::Instant::now();
        let (exec_id, mut output, input) = self.start_attached(handle, config).await?;
        let feed = crate::backend::files::feed(stdin, input);
        let drain = async {
            let mut out = ExecOutput::default();
            let mut seen = 0usize;
            let mut stop = false;
            while let Some(item) = output.next().await {
                match item.map_err(|e| runtime(handle, e))? {
                    LogOutput::StdOut { message } => {
                        let room = max_stdout.saturating_sub(seen);
                        if message.len() > room {
                            // Reading stops at the cap; the command is stopped below.
                            out.truncated = true;
                            stop = true;
                        }
                        let kept = message.slice(..message.len().min(room));
                        seen += kept.len();
                        match &sink {
                            Some(sink) if !kept.is_empty() => {
                                if sink.send(kept).await.is_err() {
                                    // The reader gave up (its own error, which it reports):
                                    // stop too.
                                    stop = true;
                                }
                            }
                            Some(_) => {}
                            None => out.stdout.extend_from_slice(&kept),
                        }
                        if stop {
                            break;
                        }
                    }
                    LogOutput::StdErr { message } if out.stderr.len() < MAX_STDERR => {
                        out.stderr.push_str(&String::from_utf8_lossy(&message));
                    }
                    _ => {}
                }
            }
            Ok::<_, BackendError>((out, stop))
        };
        // The sandbox's own timeout ends the command; the gateway waits a little longer
        // and then stops reading and kills the command's process group itself.
        let bounded =
            tokio::time::timeout(timeout + EXEC_GRACE, async { tokio::join!(feed, drain).1 }).await;
        drop(sink);
        let (mut out, stopped) = match bounded {
            Ok(Ok(drained)) => drained,
            Ok(Err(e)) => {
                self.kill_exec(handle, &tag).await;
                return Err(e);
            }
            Err(_) => {
                self.kill_exec(handle, &tag).await;
                return Err(BackendError::TimedOut {
                    what,
                    after: timeout,
                });
            }
        };
        if stopped {
            self.kill_exec(handle, &tag).await;
            out.exit_code = 0;
            return Ok(out);
        }
        let inspected = self
            .docker
            .inspect_exec(&exec_id)
            .await
            .map_err(|e| map_handle_error(handle, e))?;
        out.exit_code = inspected.exit_code.unwrap_or(-1);
        // `timeout` answers 124, or 137 when its KILL reached it too.
        if matches!(out.exit_code, 124 | 137) && started_at.elapsed() + EXEC_GRACE / 4 >= timeout {
            return Err(BackendError::TimedOut {
                what,
                after: timeout,
            });
        }
        Ok(out)
    }

    /// Creates and starts an exec attached to its stdin and output: its id, output and
    /// stdin.
    pub(super) async fn start_attached(
        &self,
        handle: &str,
        config: CreateExecOptions<String>,
    ) -> Result<AttachedExec, BackendError> {
        let created = self
            .docker
            .create_exec(handle, config)
            .await
            .map_err(|e| map_handle_error(handle, e))?;
        let started = self
            .docker
            .start_exec(&created.id, None)
            .await
            .map_err(|e| map_handle_error(handle, e))?;
        let StartExecResults::Attached { output, input } = started else {
            return Err(BackendError::Runtime("exec started detached".to_owned()));
        };
        Ok((created.id, output, input))
    }

    /// Kills, inside the sandbox, every process of the exec tagged `tag` with its process
    /// group: what `timeout` may have left behind (a child in another group).
    pub(super) async fn kill_exec(&self, handle: &str, tag: &str) {
        let config = CreateExecOptions {
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            cmd: Some(
                [
                    "timeout",
                    "-s",
                    "KILL",
                    "10",
                    "python3",
                    "-P",
                    "-c",
                    KILL_SCRIPT,
                    tag,
                ]
                .map(str::to_owned)
                .to_vec(),
            ),
            user: Some(spec::kernel_user()),
            working_dir: Some("/".to_owned()),
            ..Default::default()
        };
        let run = async {
            let created = self.docker.create_exec(handle, config).await?;
            if let StartExecResults::Attached { mut output, .. } =
                self.docker.start_exec(&created.id, None).await?
            {
                while output.next().await.is_some() {}
            }
            Ok::<_, DockerError>(())
        };
        match tokio::time::timeout(EXEC_GRACE * 2, run).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(container = %handle, error = %e, "cannot stop a command in a kernel's sandbox")
            }
            Err(_) => {
                tracing::warn!(container = %handle, "stopping a command in a kernel's sandbox took too long")
            }
        }
    }
}

/// The environment variable that tags the processes of one exec, for [`KILL_SCRIPT`].
pub(crate) const EXEC_TAG: &str = "KERNELGATE_EXEC";
/// How long the gateway waits past a command's own timeout before it kills it itself.
pub(super) const EXEC_GRACE: std::time::Duration = std::time::Duration::from_secs(5);
/// Kills every process whose environment carries `KERNELGATE_EXEC=<argv[1]>`, with its
/// process group. Run with `python3 -P` from `/`: nothing of the kernel's can shadow it.
const KILL_SCRIPT: &str = r#"
import os, signal, sys
tag = ("KERNELGATE_EXEC=" + sys.argv[1]).encode()
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    try:
        with open("/proc/%s/environ" % pid, "rb") as f:
            if tag not in f.read().split(b"\0"):
                continue
        try:
            os.killpg(os.getpgid(int(pid)), signal.SIGKILL)
        finally:
            os.kill(int(pid), signal.SIGKILL)
    except OSError:
        pass
"#;

/// A short name of a command for messages: the program and, for Python, what it runs.
fn describe_argv(argv: &[String]) -> String {
    let program = argv.first().map(String::as_str).unwrap_or("a command");
    let named = argv
        .iter()
        .position(|a| a == "-m")
        .and_then(|i| argv.get(i + 1))
        .map(|m| format!("{program} -m {m}"));
    format!(
        "the gateway's command ({}) in the kernel's sandbox",
        named.unwrap_or_else(|| program.to_owned())
    )
}
