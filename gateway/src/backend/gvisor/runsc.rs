//! The runsc command driver: every call is one `runsc` process (tokio::process), with the
//! engine's root and the flags Docker's `kernelgate-runsc` runtime registration passes.

use crate::backend::BackendError;
use std::path::{Path, PathBuf};
use std::process::Stdio;

/// The flags every runsc call carries (as `make gvisor` registers runsc with Docker).
pub const FLAGS: [&str; 3] = ["--network=none", "--host-uds=create", "--platform=systrap"];

/// One runsc binary and its state directory.
#[derive(Debug, Clone)]
pub struct Runsc {
    pub path: PathBuf,
    pub root: PathBuf,
}

/// A sandbox's state as `runsc state` says it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    /// `created`, `running`, `stopped`.
    pub status: String,
    pub pid: Option<i64>,
}

/// How long a signal may take to reach a sandbox's processes through its kernel.
pub const KILL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl Runsc {
    pub fn command(&self) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.path);
        cmd.arg("--root").arg(&self.root).args(FLAGS);
        cmd.stdin(Stdio::null()).kill_on_drop(true);
        cmd
    }

    /// Runs `args`; its stdout on success, an error with its stderr otherwise.
    pub async fn run(&self, args: &[&str]) -> Result<Vec<u8>, BackendError> {
        let out = self
            .command()
            .args(args)
            .output()
            .await
            .map_err(|e| self.spawn_error(e))?;
        if out.status.success() {
            Ok(out.stdout)
        } else {
            Err(BackendError::Runtime(format!(
                "runsc {}: {}",
                args.first().copied().unwrap_or_default(),
                String::from_utf8_lossy(&out.stderr).trim()
            )))
        }
    }

    pub fn spawn_error(&self, e: std::io::Error) -> BackendError {
        BackendError::Runtime(format!(
            "cannot run runsc at {} ({e}); install it with `make gvisor` or name it with `--runsc PATH`",
            self.path.display()
        ))
    }

    /// Creates sandbox `id` from `bundle`. Its stdout and stderr are appended to the files
    /// `output` (a kernel's both to one, kept bounded by the engine). runsc's log of the
    /// sandbox process goes to `boot_log`: its last line names the process's exit status,
    /// which `runsc wait` cannot give once the sandbox has ended.
    pub async fn create(
        &self,
        id: &str,
        bundle: &Path,
        output: (&Path, &Path),
        boot_log: &Path,
    ) -> Result<(), BackendError> {
        // The sandbox keeps these as its stdout and stderr: files, never pipes the
        // gateway would have to drain (the sandbox outlives the gateway).
        let (out, err) = (
            Stdio::from(append(output.0)?),
            Stdio::from(append(output.1)?),
        );
        let _ = std::fs::remove_file(boot_log);
        let status = self
            .command()
            .arg(format!("--debug-log={}", boot_log.display()))
            .arg("--debug-command=boot")
            .arg("create")
            .arg("--bundle")
            .arg(bundle)
            .arg(id)
            .stdout(out)
            .stderr(err)
            .status()
            .await
            .map_err(|e| self.spawn_error(e))?;
        if status.success() {
            return Ok(());
        }
        let said = last_lines(output.1);
        Err(BackendError::Runtime(format!(
            "runsc create of {id} failed ({status}){}{said}",
            if said.is_empty() { "" } else { ": " }
        )))
    }

    /// `runsc run` of the bundle: created, started and waited for by the child, whose
    /// exit status is the sandbox process's; its output into `output` (else dropped).
    pub fn spawn_run(
        &self,
        id: &str,
        bundle: &Path,
        output: Option<(&Path, &Path)>,
    ) -> Result<tokio::process::Child, BackendError> {
        let (out, err) = match output {
            Some((out, err)) => (Stdio::from(append(out)?), Stdio::from(append(err)?)),
            None => (Stdio::null(), Stdio::null()),
        };
        self.command()
            .arg("run")
            .arg("--bundle")
            .arg(bundle)
            .arg(id)
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| self.spawn_error(e))
    }

    /// The sandbox's state; `None` when runsc does not know it.
    pub async fn state(&self, id: &str) -> Result<Option<State>, BackendError> {
        let out = self
            .command()
            .args(["state", id])
            .output()
            .await
            .map_err(|e| self.spawn_error(e))?;
        if !out.status.success() {
            return Ok(None);
        }
        Ok(parse_state(&out.stdout))
    }

    /// Ids of the sandboxes under this root.
    pub async fn list(&self) -> Result<Vec<(String, String)>, BackendError> {
        let out = self.run(&["list", "-format=json"]).await?;
        Ok(parse_list(&out))
    }

    /// Signals the sandbox's first process, or every process with `all` (what a removal
    /// or a restart does). The signal goes through the sandbox's own kernel, which may not
    /// answer (a sandbox stuck at its memory limit): with `all`, past [`KILL_TIMEOUT`] this
    /// gives up (and the runsc it ran is killed); [`Self::delete`] ends such a sandbox from
    /// outside.
    pub async fn kill(&self, id: &str, signal: &str, all: bool) -> Result<(), BackendError> {
        if !all {
            return self.run(&["kill", id, signal]).await.map(drop);
        }
        let args = ["kill", "--all", id, signal];
        match tokio::time::timeout(KILL_TIMEOUT, self.run(&args)).await {
            Ok(done) => done.map(drop),
            Err(_) => Err(BackendError::Runtime(format!(
                "runsc kill {id} {signal}: the sandbox did not answer within {} s",
                KILL_TIMEOUT.as_secs()
            ))),
        }
    }

    /// Sends `signal` to one process of the sandbox, by its pid inside the sandbox.
    pub async fn kill_pid(&self, id: &str, pid: u32, signal: &str) -> Result<(), BackendError> {
        let pid = pid.to_string();
        let args = ["kill", "--pid", &pid, id, signal];
        match tokio::time::timeout(KILL_TIMEOUT, self.run(&args)).await {
            Ok(done) => done.map(drop),
            Err(_) => Err(BackendError::Runtime(format!(
                "runsc kill --pid {pid} {id} {signal}: the sandbox did not answer within {} s",
                KILL_TIMEOUT.as_secs()
            ))),
        }
    }

    /// `runsc --version`'s first line (`runsc version 0.0~20240729.0`): what a checkpoint
    /// records of the binary that wrote it.
    pub async fn version(&self) -> Result<String, BackendError> {
        let out = self.run(&["--version"]).await?;
        Ok(String::from_utf8_lossy(&out)
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned())
    }

    /// Saves the whole sandbox into `image` (uncompressed: restores read it faster) and
    /// stops it, or with `leave_running` lets it go on; killed past `timeout`.
    pub async fn checkpoint(
        &self,
        id: &str,
        image: &Path,
        leave_running: bool,
        timeout: std::time::Duration,
    ) -> Result<(), BackendError> {
        let image = format!("--image-path={}", image.display());
        let mut args = vec!["checkpoint", "--compression=none", &image];
        if leave_running {
            args.push("--leave-running");
        }
        args.push(id);
        match tokio::time::timeout(timeout, self.run(&args)).await {
            Ok(done) => done.map(drop),
            Err(_) => Err(BackendError::TimedOut {
                what: format!("the checkpoint of sandbox {id}"),
                after: timeout,
            }),
        }
    }

    /// Restores sandbox `id` of `bundle` from the checkpoint in `image`, running (detached),
    /// with its output and boot log as [`Self::create`] sets them; killed past `timeout`.
    pub async fn restore(
        &self,
        id: &str,
        bundle: &Path,
        image: &Path,
        output: (&Path, &Path),
        boot_log: &Path,
        timeout: std::time::Duration,
    ) -> Result<(), BackendError> {
        let (out, err) = (
            Stdio::from(append(output.0)?),
            Stdio::from(append(output.1)?),
        );
        let _ = std::fs::remove_file(boot_log);
        let restored = self
            .command()
            .arg(format!("--debug-log={}", boot_log.display()))
            .arg("--debug-command=boot")
            .arg("restore")
            .arg("--detach")
            .arg(format!("--image-path={}", image.display()))
            .arg("--bundle")
            .arg(bundle)
            .arg(id)
            .stdout(out)
            .stderr(err)
            .status();
        let status = match tokio::time::timeout(timeout, restored).await {
            Ok(status) => status.map_err(|e| self.spawn_error(e))?,
            Err(_) => {
                return Err(BackendError::TimedOut {
                    what: format!("the restore of sandbox {id}"),
                    after: timeout,
                })
            }
        };
        if status.success() {
            return Ok(());
        }
        Err(BackendError::Runtime(format!(
            "runsc restore of {id} failed ({status}): {}",
            last_lines(output.1)
        )))
    }

    /// Deletes the sandbox; one already deleted (by a second caller) is no error.
    pub async fn delete(&self, id: &str) -> Result<(), BackendError> {
        match self.run(&["delete", "--force", id]).await {
            Err(_) if self.state(id).await?.is_none() => Ok(()),
            other => other.map(drop),
        }
    }
}

/// The last lines of a sandbox's output file, for an error message.
fn last_lines(path: &Path) -> String {
    std::fs::read_to_string(path)
        .map(|text| {
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(5)..].join("; ")
        })
        .unwrap_or_default()
}

/// `path` opened to append a process's output to, created if missing.
fn append(path: &Path) -> Result<std::fs::File, BackendError> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| BackendError::Runtime(format!("{}: {e}", path.display())))
}

/// The exit code of a sandbox process from `runsc run`'s own status: runsc exits with the
/// process's code, and with 128 + N for a process killed by signal N.
pub fn run_exit_code(status: std::process::ExitStatus) -> i64 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => i64::from(code),
        (None, Some(signal)) => 128 + i64::from(signal),
        (None, None) => -1,
    }
}

pub fn parse_state(json: &[u8]) -> Option<State> {
    let v: serde_json::Value = serde_json::from_slice(json).ok()?;
    Some(State {
        status: v.get("status")?.as_str()?.to_owned(),
        pid: v.get("pid").and_then(|p| p.as_i64()).filter(|p| *p > 0),
    })
}

/// `(id, status)` of each sandbox in `runsc list -format=json` output (`null` when none).
pub fn parse_list(json: &[u8]) -> Vec<(String, String)> {
    let Ok(serde_json::Value::Array(items)) = serde_json::from_slice(json) else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|i| {
            Some((
                i.get("id")?.as_str()?.to_owned(),
                i.get("status")?.as_str()?.to_owned(),
            ))
        })
        .collect()
}

/// The exit code of a wait status as a shell reports it: 128 + N when killed by signal N.
pub fn exit_code(wait_status: i64) -> i64 {
    let signal = wait_status & 0x7f;
    if signal == 0 {
        (wait_status >> 8) & 0xff
    } else {
        128 + signal
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runsc_output_is_read() {
        let state = br#"{"ociVersion":"1.0.2","id":"a","status":"running","pid":42,"bundle":"/b"}"#;
        assert_eq!(
            parse_state(state),
            Some(State {
                status: "running".to_owned(),
                pid: Some(42)
            })
        );
        assert_eq!(parse_list(b"null\n"), Vec::new());
        assert_eq!(
            parse_list(br#"[{"id":"a","status":"stopped","pid":0}]"#),
            vec![("a".to_owned(), "stopped".to_owned())]
        );
        assert_eq!(exit_code(9), 137, "killed by SIGKILL");
        assert_eq!(exit_code(256), 1);
        assert_eq!(exit_code(0), 0);
    }
}
