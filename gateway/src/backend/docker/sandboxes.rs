//! The engine-neutral sandbox interface on Docker: sandboxes from a [`SandboxSpec`]
//! (translated by [`spec::to_body`]), one-shot runs, interactive commands, a home read out
//! and a tree put in, sandboxes found by label.

use super::errors::{force, map_handle_error, runtime, status};
use super::{spec, DockerBackend, Runtime, EXEC_TAG};
use crate::backend::sandbox::{Command, Isolation, RunOnce, RunOutput, SandboxSpec, KERNEL_HOME};
use crate::backend::{
    files, BackendError, Interactive, InteractiveControl, InteractiveRequest, Labelled, Output,
    Signal, TarStream, TtySize,
};
use bollard::container::LogOutput;
use bollard::errors::Error as DockerError;
use bollard::exec::{CreateExecOptions, ResizeExecOptions, StartExecResults};
use bollard::models::{ContainerCreateBody, ContainerSummaryStateEnum};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, InspectContainerOptions, KillContainerOptionsBuilder,
    LogsOptionsBuilder, StopContainerOptionsBuilder, WaitContainerOptionsBuilder,
};
use bollard::Docker;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use std::collections::BTreeMap;
use std::time::Duration;

/// The container of a one-shot run under `runtime` (the kernels' runtime): the kernels'
/// hardening, through the image's launcher (`launcher`, the image's command) and its
/// syscall filter. Pure, so what `packages sync` starts is asserted by unit tests.
pub fn one_shot_body(
    request: &RunOnce,
    runtime: Runtime,
    launcher: &[String],
) -> Result<ContainerCreateBody, BackendError> {
    let sandbox = request.sandbox(isolation_of(runtime));
    body_of(&sandbox, runtime, launcher)
}

/// The isolation a runtime gives.
pub fn isolation_of(runtime: Runtime) -> Isolation {
    match runtime {
        Runtime::Runc => Isolation::RuncLike,
        Runtime::Runsc | Runtime::RunscPtrace => Isolation::Gvisor,
    }
}

/// The engine's runtime for `isolation`, given the one kernels run under.
fn docker_runtime(runtime: Runtime, isolation: Isolation) -> &'static str {
    match (isolation, runtime) {
        (Isolation::RuncLike, _) => Runtime::Runc.docker_name(),
        // gVisor wanted but kernels run under runc: the engine says it has no such runtime.
        (Isolation::Gvisor, Runtime::Runc) => Runtime::Runsc.docker_name(),
        (Isolation::Gvisor, gvisor) => gvisor.docker_name(),
    }
}

fn body_of(
    sandbox: &SandboxSpec,
    runtime: Runtime,
    launcher: &[String],
) -> Result<ContainerCreateBody, BackendError> {
    spec::to_body(
        sandbox,
        docker_runtime(runtime, sandbox.hardening.isolation),
        launcher,
    )
    .map_err(BackendError::Runtime)
}

/// How often the end of an interactive command is looked for.
const INTERACTIVE_POLL: Duration = Duration::from_millis(50);

impl DockerBackend {
    /// The image's command: its launcher, which [`Command::Filtered`] runs go through.
    async fn launcher_of(&self, image: &str) -> Result<Vec<String>, BackendError> {
        match self.docker.inspect_image(image).await {
            Ok(inspect) => Ok(inspect.config.and_then(|c| c.cmd).unwrap_or_default()),
            Err(e) if status(&e) == Some(404) => Err(self.image_missing(image)),
            Err(e) => Err(runtime("inspect image", e)),
        }
    }

    async fn body_for(&self, sandbox: &SandboxSpec) -> Result<ContainerCreateBody, BackendError> {
        let launcher = match sandbox.command {
            Command::Image => Vec::new(),
            Command::Filtered(_) => self.launcher_of(&sandbox.image).await?,
        };
        body_of(sandbox, self.runtime, &launcher)
    }

    pub(super) async fn create_sandbox(
        &self,
        sandbox: &SandboxSpec,
    ) -> Result<String, BackendError> {
        let body = self.body_for(sandbox).await?;
        let mut options = CreateContainerOptionsBuilder::default();
        if let Some(name) = &sandbox.name {
            options = options.name(name);
        }
        self.docker
            .create_container(Some(options.build()), body)
            .await
            .map(|created| created.id)
            .map_err(|e| self.create_error(&sandbox.image, e))
    }

    pub(super) async fn start_sandbox(&self, handle: &str) -> Result<(), BackendError> {
        self.docker
            .start_container(handle, None)
            .await
            .map_err(|e| map_handle_error(handle, e))
    }

    pub(super) async fn stop_sandbox(
        &self,
        handle: &str,
        grace: Duration,
    ) -> Result<(), BackendError> {
        let seconds = i32::try_from(grace.as_secs()).unwrap_or(i32::MAX);
        let options = StopContainerOptionsBuilder::default().t(seconds).build();
        match self.docker.stop_container(handle, Some(options)).await {
            // Not running: stopped already.
            Err(e) if status(&e) == Some(304) => Ok(()),
            other => other.map_err(|e| map_handle_error(handle, e)),
        }
    }

    pub(super) async fn signal_sandbox(
        &self,
        handle: &str,
        signal: Signal,
    ) -> Result<(), BackendError> {
        let options = KillContainerOptionsBuilder::default()
            .signal(signal.name())
            .build();
        self.docker
            .kill_container(handle, Some(options))
            .await
            .map_err(|e| map_handle_error(handle, e))
    }

    pub(super) async fn list_labelled_inner(
        &self,
        labels: &BTreeMap<String, String>,
    ) -> Result<Vec<Labelled>, BackendError> {
        let containers = self
            .containers_labelled(labels.iter().map(|(k, v)| format!("{k}={v}")))
            .await?;
        Ok(containers
            .into_iter()
            .filter_map(|c| {
                Some(Labelled {
                    handle: c.id?,
                    labels: c.labels.unwrap_or_default().into_iter().collect(),
                    running: c.state == Some(ContainerSummaryStateEnum::RUNNING),
                })
            })
            .collect())
    }

    /// A one-shot run: created, started, waited for (killed past its timeout), its output
    /// read, and removed whatever happens.
    pub(super) async fn run_once_inner(&self, request: RunOnce) -> Result<RunOutput, BackendError> {
        let mut sandbox = request.sandbox(isolation_of(self.runtime));
        sandbox.name = Some(format!("kernelgate-run-{}", uuid::Uuid::new_v4().simple()));
        let what = format!(
            "{} in a one-shot sandbox of {}",
            request
                .argv
                .first()
                .map(String::as_str)
                .unwrap_or("a command"),
            request.image
        );
        let id = self.create_sandbox(&sandbox).await?;
        let result = tokio::time::timeout(
            request.timeout,
            run_to_end(&self.docker, &id, request.max_output),
        )
        .await;
        if let Err(e) = self.docker.remove_container(&id, Some(force())).await {
            tracing::warn!(container = %id, error = %e, "cannot remove a one-shot sandbox");
        }
        match result {
            Ok(result) => result,
            Err(_) => Err(BackendError::TimedOut {
                what,
                after: request.timeout,
            }),
        }
    }

    pub(super) async fn exec_interactive_inner(
        &self,
        handle: &str,
        request: InteractiveRequest,
    ) -> Result<Interactive, BackendError> {
        // The container's command is the image's launcher: the command goes through it
        // and gets the kernel's syscall filter.
        let launcher = self
            .docker
            .inspect_container(handle, None::<InspectContainerOptions>)
            .await
            .map_err(|e| map_handle_error(handle, e))?
            .config
            .and_then(|c| c.cmd)
            .unwrap_or_default();
        if launcher.is_empty() {
            return Err(BackendError::Runtime(format!(
                "container {handle} has no command (its launcher) to run commands through"
            )));
        }
        let tag = uuid::Uuid::new_v4().simple().to_string();
        let cmd: Vec<String> = launcher
            .into_iter()
            .chain(std::iter::once(spec::LAUNCHER_EXEC.to_owned()))
            .chain(request.argv)
            .collect();
        let env = request
            .env
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .chain([
                format!("KERNELGATE_WORKDIR={KERNEL_HOME}"),
                format!("{EXEC_TAG}={tag}"),
            ])
            .collect();
        let config = CreateExecOptions {
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            tty: Some(request.tty.is_some()),
            cmd: Some(cmd),
            env: Some(env),
            user: Some(spec::kernel_user()),
            working_dir: Some(request.workdir.unwrap_or_else(|| KERNEL_HOME.to_owned())),
            ..Default::default()
        };
        let (exec_id, output, input) = self.start_attached(handle, config).await?;
        let control = ExecControl {
            docker: self.docker.clone(),
            container: handle.to_owned(),
            exec_id,
            tag,
        };
        if let Some(size) = request.tty {
            control.resize_inner(size).await?;
        }
        let container = handle.to_owned();
        let output = output
            .filter_map(move |item| {
                let container = container.clone();
                async move {
                    match item {
                        Ok(LogOutput::StdOut { message } | LogOutput::Console { message }) => {
                            Some(Ok(Output::Stdout(message)))
                        }
                        Ok(LogOutput::StdErr { message }) => Some(Ok(Output::Stderr(message))),
                        Ok(LogOutput::StdIn { .. }) => None,
                        Err(e) => Some(Err(runtime(&container, e))),
                    }
                }
            })
            .boxed();
        Ok(Interactive {
            stdin: input,
            output,
            control: Box::new(control),
        })
    }

    /// The kernel's home as a tar stream, read by `tar` inside the sandbox (the home is a
    /// tmpfs the engine's archive calls cannot see).
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

/// Starts a created container, waits for its end and reads its output (each stream cut
/// at `max_output` bytes).
async fn run_to_end(
    docker: &Docker,
    id: &str,
    max_output: usize,
) -> Result<RunOutput, BackendError> {
    docker
        .start_container(id, None)
        .await
        .map_err(|e| runtime("start a one-shot sandbox", e))?;
    let wait = WaitContainerOptionsBuilder::default().build();
    let exit_code = match docker.wait_container(id, Some(wait)).next().await {
        Some(Ok(exit)) => exit.status_code,
        // bollard reports a non-zero exit code as an error.
        Some(Err(DockerError::DockerContainerWaitError { code, .. })) => code,
        Some(Err(e)) => return Err(runtime("wait for a one-shot sandbox", e)),
        None => {
            return Err(BackendError::Runtime(
                "waiting for a one-shot sandbox ended without an exit code".to_owned(),
            ))
        }
    };
    let logs = LogsOptionsBuilder::default()
        .stdout(true)
        .stderr(true)
        .tail("all")
        .build();
    let mut stream = docker.logs(id, Some(logs));
    let mut out = RunOutput {
        exit_code,
        ..RunOutput::default()
    };
    let keep = |into: &mut Vec<u8>, message: &[u8]| {
        let room = max_output.saturating_sub(into.len());
        into.extend_from_slice(&message[..message.len().min(room)]);
    };
    while let Some(item) = stream.next().await {
        match item.map_err(|e| runtime("read a one-shot sandbox's output", e))? {
            LogOutput::StdOut { message } => keep(&mut out.stdout, &message),
            LogOutput::StdErr { message } => keep(&mut out.stderr, &message),
            _ => {}
        }
    }
    Ok(out)
}

/// Signals, resizes and waits for one interactive command in a container.
struct ExecControl {
    docker: Docker,
    container: String,
    exec_id: String,
    /// The `KERNELGATE_EXEC` value its processes carry.
    tag: String,
}

impl ExecControl {
    async fn resize_inner(&self, size: TtySize) -> Result<(), BackendError> {
        self.docker
            .resize_exec(
                &self.exec_id,
                ResizeExecOptions {
                    height: size.rows,
                    width: size.cols,
                },
            )
            .await
            .map_err(|e| map_handle_error(&self.container, e))
    }
}

impl InteractiveControl for ExecControl {
    /// Docker has no call that signals an exec: a second command inside the sandbox
    /// signals every process carrying the command's tag.
    fn signal(&self, signal: Signal) -> BoxFuture<'_, Result<(), BackendError>> {
        async move {
            let config = CreateExecOptions {
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                cmd: Some(vec![
                    "timeout".to_owned(),
                    "-s".to_owned(),
                    "KILL".to_owned(),
                    "10".to_owned(),
                    "python3".to_owned(),
                    "-P".to_owned(),
                    "-c".to_owned(),
                    SIGNAL_SCRIPT.to_owned(),
                    self.tag.clone(),
                    signal.number().to_string(),
                ]),
                user: Some(spec::kernel_user()),
                working_dir: Some("/".to_owned()),
                ..Default::default()
            };
            let created = self
                .docker
                .create_exec(&self.container, config)
                .await
                .map_err(|e| map_handle_error(&self.container, e))?;
            if let StartExecResults::Attached { mut output, .. } = self
                .docker
                .start_exec(&created.id, None)
                .await
                .map_err(|e| map_handle_error(&self.container, e))?
            {
                while output.next().await.is_some() {}
            }
            Ok(())
        }
        .boxed()
    }

    fn resize(&self, size: TtySize) -> BoxFuture<'_, Result<(), BackendError>> {
        self.resize_inner(size).boxed()
    }

    fn wait(&self) -> BoxFuture<'_, Result<i64, BackendError>> {
        async move {
            loop {
                let inspected = self
                    .docker
                    .inspect_exec(&self.exec_id)
                    .await
                    .map_err(|e| map_handle_error(&self.container, e))?;
                if inspected.running != Some(true) {
                    return Ok(inspected.exit_code.unwrap_or(-1));
                }
                tokio::time::sleep(INTERACTIVE_POLL).await;
            }
        }
        .boxed()
    }
}

/// Sends signal `argv[2]` to every process whose environment carries
/// `KERNELGATE_EXEC=<argv[1]>`. Run with `python3 -P` from `/`.
pub(crate) const SIGNAL_SCRIPT: &str = r#"
import os, sys
tag = ("KERNELGATE_EXEC=" + sys.argv[1]).encode()
sig = int(sys.argv[2])
for pid in os.listdir("/proc"):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    try:
        with open("/proc/%s/environ" % pid, "rb") as f:
            if tag not in f.read().split(b"\0"):
                continue
        os.kill(int(pid), sig)
    except OSError:
        pass
"#;
