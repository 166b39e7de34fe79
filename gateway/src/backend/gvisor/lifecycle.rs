//! A sandbox's life under runsc: created from its bundle, started and watched until it
//! ends (how it ended: `runsc wait`, else runsc's boot log; out-of-memory kills from its
//! cgroup), restarted, stopped and removed; a kernel launched with its socket directory
//! and package mounts; one-shot runs.

use super::bundle::{self, io_error, Written};
use super::{checkpoint, oci, runsc, GvisorEngine};
use crate::backend::docker::socket_dir;
use crate::backend::docker::spec::ContainerSpec;
use crate::backend::sandbox::{Isolation, Mount, RunOnce, RunOutput, SandboxSpec};
use crate::backend::{BackendError, Exit, LaunchRequest, Launched};
use futures::stream::BoxStream;
use futures::StreamExt;
use std::path::Path;
use std::time::Duration;
use tokio::sync::watch;

/// How often a sandbox's memory cgroup is read for new out-of-memory kills.
const OOM_POLL: Duration = Duration::from_millis(250);
/// How often a kernel's output file is checked against its cap.
const LOG_CHECK: Duration = Duration::from_secs(1);

/// The out-of-memory kills counted by sandbox `handle`'s memory cgroup.
pub(super) fn oom_kills(cgroups: oci::Cgroups, handle: &str) -> Option<u64> {
    let path = oci::cgroups_path(handle);
    let (file, key) = match cgroups {
        oci::Cgroups::V1 => (
            format!("/sys/fs/cgroup/memory{path}/memory.oom_control"),
            "oom_kill",
        ),
        oci::Cgroups::V2 => (format!("/sys/fs/cgroup{path}/memory.events"), "oom_kill"),
    };
    let text = std::fs::read_to_string(file).ok()?;
    parse_counter(&text, key)
}

pub(super) fn parse_counter(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// The exit status of a sandbox that has ended, from runsc's boot log in `bundle`
/// (written as the sandbox process exits: waited for a little).
async fn ended_with(bundle: &Path) -> Option<i64> {
    for _ in 0..20 {
        let text = bundle::tail(&bundle::boot_log(bundle)).unwrap_or_default();
        if let Some(code) = bundle::exit_status_of(&text) {
            return Some(code);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

impl GvisorEngine {
    /// Creates the sandbox of a written bundle (not started).
    async fn create_written(&self, handle: &str, bundle: &Path) -> Result<(), BackendError> {
        let kernel = self.read_meta(handle)?.socket_dir.is_some();
        let (out, err) = bundle::output(bundle, kernel);
        self.runsc
            .create(handle, bundle, (&out, &err), &bundle::boot_log(bundle))
            .await
    }

    /// Writes the bundle of `spec` and creates the sandbox (not started).
    pub(super) async fn create_sandbox(
        &self,
        spec: &SandboxSpec,
        socket_dir: Option<std::path::PathBuf>,
    ) -> Result<String, BackendError> {
        let Written { handle, bundle } = self.write_bundle(spec, socket_dir)?;
        if let Err(e) = self.create_written(&handle, &bundle).await {
            let _ = self.runsc.delete(&handle).await;
            let _ = std::fs::remove_dir_all(&bundle);
            return Err(e);
        }
        Ok(handle)
    }

    /// Starts a created sandbox and watches for its end.
    pub(super) async fn start_sandbox(&self, handle: &str) -> Result<(), BackendError> {
        self.existing_bundle(handle)?;
        self.runsc.run(&["start", handle]).await?;
        self.watch(handle);
        Ok(())
    }

    /// Watches the sandbox until it ends: `runsc wait`, whose status runsc keeps only
    /// while the sandbox lives; for one that ended before (within milliseconds of its
    /// start, or while no gateway ran), the status runsc's boot log recorded. The
    /// out-of-memory kills of its cgroup are read before anything removes it, and a
    /// kernel's output file is kept under its cap meanwhile.
    pub(super) fn watch(&self, handle: &str) {
        let (tx, rx) = watch::channel(None);
        self.exits
            .lock()
            .expect("exits lock")
            .insert(handle.to_owned(), rx);
        let runsc = self.runsc.clone();
        let handle = handle.to_owned();
        let cgroups = self.cgroups;
        let memory_mb = self.read_meta(&handle).ok().map(|m| m.memory_mb);
        let Some(bundle) = self.bundle(&handle) else {
            return;
        };
        tokio::spawn(async move {
            let ooms_before = oom_kills(cgroups, &handle);
            let wait = runsc.command().args(["wait", &handle]).output();
            tokio::pin!(wait);
            let mut check = tokio::time::interval(LOG_CHECK);
            let out = loop {
                tokio::select! {
                    out = &mut wait => break out,
                    _ = check.tick() => {
                        if let Err(e) = bundle::trim_log(&bundle) {
                            tracing::warn!(sandbox = %handle, error = %e, "cannot keep the kernel's output file under its cap");
                        }
                    }
                }
            };
            let waited = out
                .ok()
                .filter(|o| o.status.success())
                .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
                .and_then(|v| v.get("exitStatus").and_then(|s| s.as_i64()))
                .map(|s| if s > 255 { runsc::exit_code(s) } else { s });
            let code = match waited {
                Some(code) => code,
                None => ended_with(&bundle).await.unwrap_or(-1),
            };
            let oom_killed = oom_kills(cgroups, &handle).unwrap_or(0) > ooms_before.unwrap_or(0);
            let _ = tx.send(Some(Exit {
                code,
                oom_killed,
                memory_mb: memory_mb.filter(|m| *m > 0),
            }));
        });
    }

    /// How a sandbox this process does not watch ended, if it did: the status from the
    /// boot log (`None` while it runs).
    pub(super) async fn wait_exit_inner(&self, handle: &str) -> Result<Exit, BackendError> {
        let rx = self.exits.lock().expect("exits lock").get(handle).cloned();
        let Some(mut rx) = rx else {
            let bundle = self.existing_bundle(handle)?;
            if !self.running(handle).await? {
                let code = ended_with(&bundle).await.unwrap_or(-1);
                return Ok(Exit {
                    code,
                    ..Exit::default()
                });
            }
            self.watch(handle);
            return Box::pin(self.wait_exit_inner(handle)).await;
        };
        let exit = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| BackendError::Gone {
                handle: handle.to_owned(),
            })?
            .clone();
        Ok(exit.unwrap_or_default())
    }

    /// The wheelhouse tree of the kernel's image and the installer, when packages are
    /// configured, as the Docker engine mounts them. A failure to prepare them is logged
    /// and the kernel starts without: installs then say the wheelhouse is missing.
    fn package_mounts(&self, req: &LaunchRequest) -> (Vec<Mount>, crate::packages::Env) {
        let Some(mounts) = &self.settings.packages else {
            return (Vec::new(), Vec::new());
        };
        let Ok(image) = (self.resolve)(&req.image) else {
            // Writing the bundle says what is wrong with the image.
            return (Vec::new(), Vec::new());
        };
        match mounts.for_kernel(&image.id, &req.kernel_name) {
            Ok(both) => both,
            Err(e) => {
                tracing::error!(image = %req.image, wheelhouse = %mounts.wheelhouse.display(), error = %e, "cannot prepare the wheelhouse for this image; the kernel starts without packages");
                (Vec::new(), Vec::new())
            }
        }
    }

    /// A kernel's socket directory (with a fresh key) and the spec of its sandbox. Kernels
    /// of an image with the relay launcher get the relays (what a checkpoint needs).
    pub(super) fn kernel_spec(
        &self,
        req: &LaunchRequest,
    ) -> Result<(socket_dir::Prepared, SandboxSpec), BackendError> {
        let prepared = socket_dir::prepare(
            &self.settings.runtime_dir,
            &req.kernel_id,
            &req.kernel_name,
            &self.ownership,
        )?;
        let (package_binds, mut extra_env) = self.package_mounts(req);
        if self.relays_for(&req.image) {
            extra_env.push((checkpoint::RELAY_ENV.to_owned(), "1".to_owned()));
        }
        let (memory_mb, cpus) = req.limits_within(self.settings.memory_mb, self.settings.cpus);
        let created = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let runtime_dir = self.runtime_dir_label();
        let spec = ContainerSpec {
            extra_binds: &package_binds,
            extra_env: &extra_env,
            image: &req.image,
            kernel_id: &req.kernel_id,
            kernel_name: &req.kernel_name,
            created: &created,
            runtime_dir: &runtime_dir,
            socket_dir: &prepared.dir_str,
            memory_mb,
            cpus,
            owner: req.owner.as_deref(),
            pids: self.settings.pids,
            disk_mb: self.settings.disk_mb,
            group_add: self.ownership.group_add,
            env: &req.env,
            preload: req.preload,
            runtime: "runsc",
            isolation: Isolation::Gvisor,
            runtime_label: "runsc",
        }
        .sandbox();
        Ok((prepared, spec))
    }

    pub(super) async fn launch_inner(&self, req: &LaunchRequest) -> Result<Launched, BackendError> {
        let (socket_dir::Prepared { dir, outside, .. }, spec) = self.kernel_spec(req)?;
        let handle = match self.create_sandbox(&spec, Some(dir.clone())).await {
            Ok(handle) => handle,
            Err(e) => {
                let _ = socket_dir::remove(&dir);
                return Err(e);
            }
        };
        if let Err(e) = self.start_sandbox(&handle).await {
            let _ = self.remove_inner(&handle).await;
            return Err(e);
        }
        tracing::debug!(kernel = %req.kernel_id, sandbox = %handle, "kernel sandbox started");
        Ok(Launched {
            handle,
            connection: outside,
        })
    }

    /// Kills the sandbox's processes and waits (at most `patience`) for its watcher to
    /// see the end, then deletes the sandbox from runsc.
    async fn end(&self, handle: &str, patience: Duration) -> Result<(), BackendError> {
        let killed = self.runsc.kill(handle, "KILL", true).await.is_ok();
        // Give the watcher the exit (and the cgroup's out-of-memory count) first; a sandbox
        // that did not take the signal is ended by the delete below.
        let rx = self.exits.lock().expect("exits lock").get(handle).cloned();
        if let Some(mut rx) = rx.filter(|_| killed) {
            let _ = tokio::time::timeout(patience, rx.wait_for(Option::is_some)).await;
        }
        if self.runsc.state(handle).await?.is_some() {
            self.runsc.delete(handle).await?;
        }
        Ok(())
    }

    /// Kills and deletes the sandbox and removes its bundle and socket directory.
    pub(super) async fn remove_inner(&self, handle: &str) -> Result<(), BackendError> {
        let Some(bundle) = self.bundle(handle).filter(|b| b.is_dir()) else {
            return Ok(());
        };
        let meta = self.read_meta(handle).ok();
        self.end(handle, Duration::from_secs(5)).await?;
        match std::fs::remove_dir_all(&bundle) {
            // Removed meanwhile by another caller (a delete racing a resume that gave up).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            other => other.map_err(|e| io_error(&bundle, e))?,
        }
        self.tidy();
        if let Some(dir) = meta.and_then(|m| m.socket_dir) {
            socket_dir::remove(&dir).map_err(|source| BackendError::SocketDir {
                path: dir.display().to_string(),
                source,
            })?;
        }
        Ok(())
    }

    /// A fresh sandbox from the same bundle: same handle, socket directory and key.
    pub(super) async fn restart_inner(&self, handle: &str) -> Result<(), BackendError> {
        let bundle = self.existing_bundle(handle)?;
        let meta = self.read_meta(handle)?;
        self.end(handle, Duration::from_secs(10)).await?;
        if let Some(dir) = &meta.socket_dir {
            let _ = socket_dir::remove_sockets(dir);
        }
        self.create_written(handle, &bundle).await?;
        self.start_sandbox(handle).await
    }

    pub(super) async fn stop_inner(
        &self,
        handle: &str,
        grace: Duration,
    ) -> Result<(), BackendError> {
        self.existing_bundle(handle)?;
        if !self.running(handle).await? {
            return Ok(());
        }
        let _ = self.runsc.kill(handle, "TERM", false).await;
        let ended = tokio::time::timeout(grace, self.wait_exit_inner(handle)).await;
        if ended.is_err() {
            let _ = self.runsc.kill(handle, "KILL", true).await;
            let _ = self.wait_exit_inner(handle).await;
        }
        Ok(())
    }

    pub(super) async fn running(&self, handle: &str) -> Result<bool, BackendError> {
        Ok(self
            .runsc
            .state(handle)
            .await?
            .is_some_and(|s| s.status == "running"))
    }

    /// Each new out-of-memory kill the sandbox's memory cgroup counts, polled while its
    /// bundle exists.
    pub(super) fn oom_stream<'a>(&'a self, handle: &'a str) -> BoxStream<'a, Exit> {
        let memory_mb = self
            .read_meta(handle)
            .ok()
            .map(|m| m.memory_mb)
            .filter(|m| *m > 0);
        let seen = oom_kills(self.cgroups, handle).unwrap_or(0);
        futures::stream::unfold(seen, move |mut seen| async move {
            loop {
                tokio::time::sleep(OOM_POLL).await;
                self.existing_bundle(handle).ok()?;
                let now = oom_kills(self.cgroups, handle).unwrap_or(seen);
                if now > seen {
                    seen = now;
                    let exit = Exit {
                        code: 128 + 9,
                        oom_killed: true,
                        memory_mb,
                    };
                    return Some((exit, seen));
                }
            }
        })
        .boxed()
    }

    pub(super) async fn run_once_inner(&self, request: RunOnce) -> Result<RunOutput, BackendError> {
        let spec = request.sandbox(Isolation::Gvisor);
        let Written { handle, bundle } = self.write_bundle(&spec, None)?;
        let (out, err) = bundle::output(&bundle, false);
        // `runsc run` creates, starts and waits in one: its exit status is the process's.
        let ran = match self.runsc.spawn_run(&handle, &bundle, Some((&out, &err))) {
            Ok(mut child) => match tokio::time::timeout(request.timeout, child.wait()).await {
                Ok(Ok(status)) => Ok(runsc::run_exit_code(status)),
                Ok(Err(e)) => Err(self.runsc.spawn_error(e)),
                Err(_) => {
                    let _ = self.runsc.kill(&handle, "KILL", true).await;
                    let _ = child.wait().await;
                    Err(BackendError::TimedOut {
                        what: request.argv.join(" "),
                        after: request.timeout,
                    })
                }
            },
            Err(e) => Err(e),
        };
        let read = |path: &Path| {
            let mut bytes = std::fs::read(path).unwrap_or_default();
            bytes.truncate(request.max_output);
            bytes
        };
        let (stdout, stderr) = (read(&out), read(&err));
        self.remove_inner(&handle).await?;
        self.exits.lock().expect("exits lock").remove(&handle);
        Ok(RunOutput {
            exit_code: ran?,
            stdout,
            stderr,
        })
    }
}
