//! Kernels in local Docker containers (bollard). One container per kernel, named
//! `kernelgate-<kernel_id>` and labelled so that a restarted gateway finds it again; its
//! sockets live in a host directory bind-mounted at `/run/kernel` ([`socket_dir`]); the
//! container's isolation is built in [`spec`].

mod errors;
pub mod lock;
mod runtime;
mod socket_dir;
mod spec;

use errors::{force, gone, map_handle_error, runtime, status, unavailable};
pub use runtime::{Runtime, RUNSC_RUNTIME};

use super::{
    BackendError, ExecOutput, Exit, Found, ImageFacts, KernelBackend, LaunchRequest, Launched,
};
use crate::config::{Config, RuntimeChoice};
use crate::metrics;
use bollard::errors::Error as DockerError;
use bollard::models::ContainerSummaryStateEnum;
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, EventsOptionsBuilder, InspectContainerOptions,
    KillContainerOptionsBuilder, ListContainersOptionsBuilder, RenameContainerOptions,
    RestartContainerOptionsBuilder, WaitContainerOptionsBuilder,
};
use bollard::Docker;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use kernelgate_protocol::{ConnectionInfo, SigningKey};
use socket_dir::{Ids, Ownership};
use spec::{ContainerSpec, LABEL_KERNEL_ID, LABEL_MANAGED, LABEL_RUNTIME_DIR};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

/// What kernel containers are made from and may use.
#[derive(Debug, Clone)]
pub struct DockerSettings {
    pub image: String,
    /// Host directory holding one socket directory per kernel.
    pub runtime_dir: PathBuf,
    pub memory_mb: u64,
    pub cpus: f64,
    pub pids: i64,
    pub disk_mb: u64,
    pub runtime: RuntimeChoice,
    /// The wheelhouse and installer kernels mount (`--wheelhouse`); none without.
    pub packages: Option<crate::packages::Mounts>,
}

impl From<&Config> for DockerSettings {
    fn from(config: &Config) -> Self {
        DockerSettings {
            image: config.image.clone(),
            runtime_dir: config.runtime_dir.clone(),
            memory_mb: config.kernel_memory_mb,
            cpus: config.kernel_cpus,
            pids: config.kernel_pids,
            disk_mb: config.kernel_disk_mb,
            runtime: config.runtime,
            packages: None,
        }
    }
}

/// Runs each kernel in its own locked-down container on the local Docker engine.
#[derive(Debug)]
pub struct DockerBackend {
    docker: Docker,
    settings: DockerSettings,
    /// Who owns socket directories; fixed by the gateway's own uid/gid.
    ownership: Ownership,
    /// Socket directories of the containers this process launched: the fallback for a
    /// container removed behind our back (its label is gone with it). Containers found by
    /// `list()` after a gateway restart are resolved through their label instead.
    dirs: Mutex<HashMap<String, PathBuf>>,
    runtime: Runtime,
}

impl DockerBackend {
    /// Connects to the local Docker engine (`DOCKER_HOST` or the Unix socket) and agrees on
    /// an API version it speaks (the engine may be older than bollard's default).
    pub async fn connect(settings: DockerSettings) -> Result<Self, BackendError> {
        let docker = Docker::connect_with_local_defaults()
            .map_err(unavailable)?
            .negotiate_version()
            .await
            .map_err(unavailable)?;
        let ids = Ids::current().map_err(|source| BackendError::SocketDir {
            path: "/proc/self/status".to_owned(),
            source,
        })?;
        let info = docker.info().await.map_err(unavailable)?;
        let registered = info.runtimes.unwrap_or_default();
        let runtime = Runtime::resolve(settings.runtime, registered.keys().map(String::as_str))?;
        Ok(DockerBackend {
            docker,
            settings,
            ownership: Ownership::for_gateway(ids),
            dirs: Mutex::default(),
            runtime,
        })
    }

    /// The runtime kernel containers run under.
    pub fn runtime(&self) -> Runtime {
        self.runtime
    }

    async fn launch_inner(&self, req: &LaunchRequest) -> Result<Launched, BackendError> {
        let dir =
            socket_dir::path(&self.settings.runtime_dir, &req.kernel_id).ok_or_else(|| {
                BackendError::Runtime(format!("kernel id {:?} is not a plain name", req.kernel_id))
            })?;
        let dir_str = dir.to_str().ok_or_else(|| BackendError::SocketDir {
            path: dir.display().to_string(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "path is not UTF-8"),
        })?;

        let runtime_dir_str = self.runtime_dir_label();
        let key = SigningKey::generate_hex();
        let inside = ConnectionInfo::ipc(
            &format!(
                "{}/{}",
                socket_dir::CONTAINER_DIR,
                socket_dir::SOCKET_PREFIX
            ),
            key,
            &req.kernel_name,
        );
        let outside = inside.with_ip(&format!("{dir_str}/{}", socket_dir::SOCKET_PREFIX));
        // Before anything exists: a too-long runtime_dir would make zmq connect to nothing.
        outside.validate().map_err(|e| BackendError::SocketDir {
            path: dir_str.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{e}; choose a shorter --runtime-dir"),
            ),
        })?;

        socket_dir::create(
            &self.settings.runtime_dir,
            &dir,
            &self.ownership,
            &inside.to_json(),
        )
        .map_err(|source| BackendError::SocketDir {
            path: dir_str.to_owned(),
            source,
        })?;

        let (package_binds, package_env) = self.package_mounts(req).await;
        let created = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let body = ContainerSpec {
            extra_binds: &package_binds,
            extra_env: &package_env,
            image: &req.image,
            kernel_id: &req.kernel_id,
            kernel_name: &req.kernel_name,
            created: &created,
            runtime_dir: &runtime_dir_str,
            socket_dir: dir_str,
            memory_mb: req
                .memory_mb
                .map_or(self.settings.memory_mb, |m| m.min(self.settings.memory_mb)),
            cpus: req
                .cpus
                .map_or(self.settings.cpus, |c| c.min(self.settings.cpus)),
            owner: req.owner.as_deref(),
            pids: self.settings.pids,
            disk_mb: self.settings.disk_mb,
            group_add: self.ownership.group_add,
            env: &req.env,
            preload: req.preload,
            runtime: self.runtime.docker_name(),
            runtime_label: self.runtime.name(),
        }
        .to_body();
        let name = spec::container_name(&req.kernel_id);
        let options = CreateContainerOptionsBuilder::default().name(&name).build();
        let id = match self.docker.create_container(Some(options), body).await {
            Ok(created) => created.id,
            Err(e) => {
                let _ = socket_dir::remove(&dir);
                return Err(self.create_error(&req.image, e));
            }
        };
        if let Err(e) = self.docker.start_container(&id, None).await {
            let _ = self.docker.remove_container(&id, Some(force())).await;
            let _ = socket_dir::remove(&dir);
            return Err(self.create_error(&req.image, e));
        }
        tracing::debug!(kernel = %req.kernel_id, container = %id, "kernel container started");
        self.known_dirs().insert(id.clone(), dir);
        Ok(Launched {
            handle: id,
            connection: outside,
        })
    }

    async fn exec_inner(
        &self,
        handle: &str,
        argv: Vec<String>,
        stdin: bytes::Bytes,
        max_stdout: usize,
    ) -> Result<ExecOutput, BackendError> {
        use bollard::container::LogOutput;
        use bollard::exec::{CreateExecOptions, StartExecResults};
        use tokio::io::AsyncWriteExt;
        /// Error text is for people; more than this is noise.
        const MAX_STDERR: usize = 16 * 1024;

        let config = CreateExecOptions {
            attach_stdin: Some(true),
            attach_stdout: Some(true),
            attach_stderr: Some(true),
            cmd: Some(argv),
            user: Some(spec::kernel_user()),
            working_dir: Some(spec::KERNEL_HOME.to_owned()),
            ..Default::default()
        };
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
        let StartExecResults::Attached {
            mut output,
            mut input,
        } = started
        else {
            return Err(BackendError::Runtime("exec started detached".to_owned()));
        };
        let feed = async move {
            // A command that stops reading early (an error) closes its stdin: not our error.
            let _ = input.write_all(&stdin).await;
            let _ = input.shutdown().await;
        };
        let drain = async {
            let mut out = ExecOutput::default();
            while let Some(item) = output.next().await {
                match item.map_err(|e| runtime(handle, e))? {
                    LogOutput::StdOut { message } => {
                        let room = (max_stdout + 1).saturating_sub(out.stdout.len());
                        out.stdout
                            .extend_from_slice(&message[..message.len().min(room)]);
                    }
                    LogOutput::StdErr { message } if out.stderr.len() < MAX_STDERR => {
                        out.stderr.push_str(&String::from_utf8_lossy(&message));
                    }
                    _ => {}
                }
            }
            Ok::<_, BackendError>(out)
        };
        let ((), drained) = tokio::join!(feed, drain);
        let mut out = drained?;
        if out.stdout.len() > max_stdout {
            out.stdout.truncate(max_stdout);
            out.truncated = true;
        }
        let inspected = self
            .docker
            .inspect_exec(&created.id)
            .await
            .map_err(|e| map_handle_error(handle, e))?;
        out.exit_code = inspected.exit_code.unwrap_or(-1);
        Ok(out)
    }

    /// The connection file of a kernel this gateway's runtime directory holds, rewritten
    /// with host paths.
    fn host_connection(&self, kernel_id: &str) -> Option<ConnectionInfo> {
        let dir = socket_dir::path(&self.settings.runtime_dir, kernel_id)?;
        let text = match socket_dir::read_connection(&dir) {
            Ok(text) => text,
            Err(e) => {
                tracing::warn!(kernel = %kernel_id, error = %e, "cannot read the connection file back");
                return None;
            }
        };
        let inside = ConnectionInfo::from_json(&text).ok()?;
        let info = inside.with_ip(&format!("{}/{}", dir.to_str()?, socket_dir::SOCKET_PREFIX));
        info.validate().ok().map(|()| info)
    }

    fn known_dirs(&self) -> std::sync::MutexGuard<'_, HashMap<String, PathBuf>> {
        // The map holds plain paths: a panic elsewhere cannot leave it inconsistent.
        self.dirs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The socket directory of a container, from its kernel-id label (or, for a container
    /// that is already gone, from what this process launched). `Ok(None)` when unknown.
    async fn dir_of(&self, handle: &str) -> Result<Option<PathBuf>, BackendError> {
        let labelled = match self
            .docker
            .inspect_container(handle, None::<InspectContainerOptions>)
            .await
        {
            Ok(info) => info
                .config
                .and_then(|c| c.labels)
                .and_then(|labels| self.own_socket_dir(&labels)),
            Err(e) if status(&e) == Some(404) => None,
            Err(e) => return Err(runtime(handle, e)),
        };
        Ok(labelled.or_else(|| self.known_dirs().get(handle).cloned()))
    }

    /// The wheelhouse tree of the kernel's image and the installer, when packages are
    /// configured. A failure to prepare them is logged and the kernel starts without:
    /// installs then say the wheelhouse is missing.
    async fn package_mounts(&self, req: &LaunchRequest) -> (Vec<String>, Vec<String>) {
        let Some(mounts) = &self.settings.packages else {
            return (Vec::new(), Vec::new());
        };
        let id = match self.docker.inspect_image(&req.image).await {
            Ok(inspect) => inspect.id.unwrap_or_default(),
            // Creating the container says what is wrong with the image.
            Err(_) => return (Vec::new(), Vec::new()),
        };
        match mounts.for_kernel(&id, &req.kernel_name) {
            Ok(both) => both,
            Err(e) => {
                tracing::error!(image = %req.image, wheelhouse = %mounts.wheelhouse.display(), error = %e, "cannot prepare the wheelhouse for this image; the kernel starts without packages");
                (Vec::new(), Vec::new())
            }
        }
    }

    /// Whether the engine logged an `oom` event for the container since `since` (its
    /// start, RFC 3339), waiting [`OOM_EVENT_GRACE`] for one still on its way.
    async fn oom_event_since(&self, handle: &str, since: &str) -> bool {
        let Ok(since) = chrono::DateTime::parse_from_rfc3339(since) else {
            return false;
        };
        let until = chrono::Utc::now() + OOM_EVENT_GRACE;
        let stamp = |t: i64, nanos: u32| format!("{t}.{nanos:09}");
        let filters = HashMap::from([
            ("type", vec!["container".to_owned()]),
            ("container", vec![handle.to_owned()]),
            ("event", vec!["oom".to_owned()]),
        ]);
        let options = EventsOptionsBuilder::default()
            .since(&stamp(since.timestamp(), since.timestamp_subsec_nanos()))
            .until(&stamp(until.timestamp(), until.timestamp_subsec_nanos()))
            .filters(&filters)
            .build();
        let mut events = self.docker.events(Some(options));
        let first = tokio::time::timeout(OOM_EVENT_GRACE * 4, events.next()).await;
        matches!(first, Ok(Some(Ok(_))))
    }

    fn runtime_dir_label(&self) -> String {
        self.settings.runtime_dir.to_string_lossy().into_owned()
    }

    /// The socket directory named by a container's labels, if the container is one of this
    /// gateway's (same runtime directory) and its kernel id is a plain name.
    fn own_socket_dir(&self, labels: &HashMap<String, String>) -> Option<PathBuf> {
        if labels.get(LABEL_RUNTIME_DIR) != Some(&self.runtime_dir_label()) {
            return None;
        }
        socket_dir::path(&self.settings.runtime_dir, labels.get(LABEL_KERNEL_ID)?)
    }

    fn create_error(&self, image: &str, e: DockerError) -> BackendError {
        match &e {
            DockerError::DockerResponseServerError {
                status_code: 404,
                message,
            } if message.contains("No such image") => self.image_missing(image),
            _ => runtime("create", e),
        }
    }

    /// The error for a missing image, with how to build it: ours with `make image`, a
    /// derived one as docs/custom-images.md shows.
    fn image_missing(&self, image: &str) -> BackendError {
        let fix = if image == self.settings.image {
            "build it with `make image`"
        } else {
            "build it with kernel-image/derive.sh (see docs/custom-images.md) or fix its --kernelspec"
        };
        BackendError::ImageMissing {
            image: image.to_owned(),
            fix,
        }
    }
}

impl KernelBackend for DockerBackend {
    fn check(&self) -> BoxFuture<'_, Result<(), BackendError>> {
        counted("check", async move {
            self.docker.ping().await.map_err(unavailable)?;
            match self.docker.inspect_image(&self.settings.image).await {
                Ok(_) => Ok(()),
                Err(e) if status(&e) == Some(404) => Err(self.image_missing(&self.settings.image)),
                Err(e) => Err(runtime("inspect image", e)),
            }
        })
    }

    fn describe_image<'a>(
        &'a self,
        image: &'a str,
    ) -> BoxFuture<'a, Result<ImageFacts, BackendError>> {
        counted("describe_image", async move {
            match self.docker.inspect_image(image).await {
                Ok(inspect) => {
                    let config = inspect.config.unwrap_or_default();
                    Ok(ImageFacts {
                        labels: config.labels.unwrap_or_default(),
                        cmd: config.cmd.unwrap_or_default(),
                        id: inspect.id.unwrap_or_default(),
                    })
                }
                Err(e) if status(&e) == Some(404) => Err(self.image_missing(image)),
                Err(e) => Err(runtime("inspect image", e)),
            }
        })
    }

    fn launch<'a>(
        &'a self,
        req: &'a LaunchRequest,
    ) -> BoxFuture<'a, Result<Launched, BackendError>> {
        counted("launch", self.launch_inner(req))
    }

    fn restart<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        counted("restart", async move {
            let dir = self.dir_of(handle).await?.ok_or_else(|| gone(handle))?;
            // Sockets of the old process must not be found by the next connect; kernel.json
            // stays (same key and paths after the restart).
            if let Err(e) = socket_dir::remove_sockets(&dir) {
                tracing::warn!(container = handle, error = %e, "cannot remove old sockets");
            }
            // tini forwards SIGTERM; tmpfs mounts come back empty, so files and state go.
            let options = RestartContainerOptionsBuilder::default().t(1).build();
            self.docker
                .restart_container(handle, Some(options))
                .await
                .map_err(|e| map_handle_error(handle, e))
        })
    }

    fn interrupt<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        counted("interrupt", async move {
            let options = KillContainerOptionsBuilder::default()
                .signal("SIGINT")
                .build();
            self.docker
                .kill_container(handle, Some(options))
                .await
                .map_err(|e| map_handle_error(handle, e))
        })
    }

    fn remove<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        counted("remove", async move {
            // Look the directory up first: after the container is gone its label is too.
            let dir = self.dir_of(handle).await?;
            match self.docker.remove_container(handle, Some(force())).await {
                Ok(()) => {}
                // Already being removed (e.g. twice at once): the directory still goes.
                Err(e) if status(&e) == Some(409) => {}
                Err(e) if status(&e) == Some(404) => {}
                Err(e) => return Err(runtime(handle, e)),
            }
            if let Some(dir) = dir {
                let _ = std::fs::remove_file(owner_file(&dir));
                let _ = std::fs::remove_file(kernel_file(&dir));
                socket_dir::remove(&dir).map_err(|source| BackendError::SocketDir {
                    path: dir.display().to_string(),
                    source,
                })?;
            }
            self.known_dirs().remove(handle);
            Ok(())
        })
    }

    fn wait_exit<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<Exit, BackendError>> {
        counted("wait_exit", async move {
            let options = WaitContainerOptionsBuilder::default()
                .condition("not-running")
                .build();
            let mut waits = self.docker.wait_container(handle, Some(options));
            let code = match waits.next().await {
                Some(Ok(exit)) => exit.status_code,
                // bollard reports a non-zero exit code as an error.
                Some(Err(DockerError::DockerContainerWaitError { code, .. })) => code,
                Some(Err(e)) => return Err(map_handle_error(handle, e)),
                None => {
                    return Err(BackendError::Runtime(format!(
                        "waiting for container {handle} ended without an exit code"
                    )))
                }
            };
            // Why it ended: the engine knows whether the memory limit did it.
            let mut exit = Exit {
                code,
                ..Exit::default()
            };
            if let Ok(info) = self
                .docker
                .inspect_container(handle, None::<InspectContainerOptions>)
                .await
            {
                let state = info.state.unwrap_or_default();
                exit.oom_killed = state.oom_killed.unwrap_or(false);
                exit.code = state.exit_code.unwrap_or(code);
                exit.memory_mb = memory_mb(info.host_config.as_ref());
                // The engine learns of the kill and of the exit on two paths, and sets
                // `OOMKilled` only when the kill came first: a SIGKILL may still be the
                // memory limit's, as its `oom` event says.
                if !exit.oom_killed && exit.code == 128 + 9 {
                    if let Some(since) = state.started_at.as_deref() {
                        exit.oom_killed = self.oom_event_since(handle, since).await;
                    }
                }
            }
            Ok(exit)
        })
    }

    fn out_of_memory<'a>(&'a self, handle: &'a str) -> BoxStream<'a, Exit> {
        let filters = HashMap::from([
            ("type", vec!["container".to_owned()]),
            ("container", vec![handle.to_owned()]),
            ("event", vec!["oom".to_owned()]),
        ]);
        let options = EventsOptionsBuilder::default().filters(&filters).build();
        self.docker
            .events(Some(options))
            .take_while(|event| futures::future::ready(event.is_ok()))
            .then(move |_| async move {
                let info = self
                    .docker
                    .inspect_container(handle, None::<InspectContainerOptions>)
                    .await
                    .ok();
                Exit {
                    code: 128 + 9,
                    oom_killed: true,
                    memory_mb: info.and_then(|i| memory_mb(i.host_config.as_ref())),
                }
            })
            .boxed()
    }

    fn exec<'a>(
        &'a self,
        handle: &'a str,
        argv: Vec<String>,
        stdin: bytes::Bytes,
        max_stdout: usize,
    ) -> BoxFuture<'a, Result<ExecOutput, BackendError>> {
        counted("exec", self.exec_inner(handle, argv, stdin, max_stdout))
    }

    fn set_owner<'a>(
        &'a self,
        kernel_id: &'a str,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            match socket_dir::path(&self.settings.runtime_dir, kernel_id) {
                Some(dir) => write_record(&owner_file(&dir), owner),
                None => Ok(()),
            }
        })
    }

    fn set_kernel_id<'a>(
        &'a self,
        container_id: &'a str,
        kernel_id: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            match socket_dir::path(&self.settings.runtime_dir, container_id) {
                Some(dir) => write_record(&kernel_file(&dir), kernel_id),
                None => Ok(()),
            }
        })
    }

    fn rename<'a>(
        &'a self,
        handle: &'a str,
        kernel_id: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        counted("rename", async move {
            let options = RenameContainerOptions {
                name: spec::container_name(kernel_id),
            };
            self.docker
                .rename_container(handle, options)
                .await
                .map_err(|e| map_handle_error(handle, e))
        })
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<Found>, BackendError>> {
        counted("list", async move {
            // Several label filters must all match.
            let filters = HashMap::from([(
                "label",
                vec![
                    format!("{LABEL_MANAGED}=true"),
                    format!("{LABEL_RUNTIME_DIR}={}", self.runtime_dir_label()),
                ],
            )]);
            let options = ListContainersOptionsBuilder::default()
                .all(true)
                .filters(&filters)
                .build();
            let containers = self
                .docker
                .list_containers(Some(options))
                .await
                .map_err(|e| runtime("list", e))?;
            // What the images are now: a warm kernel of a tag rebuilt since is stale.
            let mut image_ids = HashMap::new();
            for c in &containers {
                if let Some(image) = c.image.as_deref() {
                    if !image_ids.contains_key(image) {
                        let id = self
                            .docker
                            .inspect_image(image)
                            .await
                            .ok()
                            .and_then(|i| i.id);
                        image_ids.insert(image.to_owned(), id);
                    }
                }
            }
            let limits = spec::limits_label(
                self.settings.memory_mb,
                self.settings.cpus,
                self.settings.pids,
                self.settings.disk_mb,
            );
            let record = |kernel_id: &str, file: fn(&std::path::Path) -> PathBuf| {
                let dir = socket_dir::path(&self.settings.runtime_dir, kernel_id)?;
                let text = std::fs::read_to_string(file(&dir)).ok()?;
                Some(text.trim().to_owned()).filter(|t| !t.is_empty())
            };
            let found: Vec<Found> = containers
                .into_iter()
                .filter_map(|c| {
                    let handle = c.id?;
                    let mut labels = c.labels.unwrap_or_default();
                    let Some(label_id) = labels.remove(LABEL_KERNEL_ID) else {
                        tracing::warn!(container = %handle, "managed container without a kernel id label");
                        return None;
                    };
                    // Its sockets live under the id it was started for, whatever it serves.
                    let connection = self.host_connection(&label_id);
                    let owner = labels
                        .remove(spec::LABEL_OWNER)
                        .or_else(|| record(&label_id, owner_file));
                    let served = record(&label_id, kernel_file)
                        .filter(|id| socket_dir::path(&self.settings.runtime_dir, id).is_some());
                    let image = c.image.unwrap_or_default();
                    let current = labels.get(spec::LABEL_LIMITS) == Some(&limits)
                        && labels.get(spec::LABEL_RUNTIME).map(String::as_str)
                            == Some(self.runtime.name())
                        && c.image_id.is_some()
                        && image_ids.get(&image).cloned().flatten() == c.image_id;
                    Some(Found {
                        handle,
                        pooled: labels.contains_key(spec::LABEL_POOL)
                            && owner.is_none()
                            && served.is_none(),
                        current,
                        image,
                        owner,
                        kernel_name: labels.remove(spec::LABEL_KERNEL_NAME).unwrap_or_default(),
                        moved: served.is_some(),
                        kernel_id: served.unwrap_or(label_id),
                        running: c.state == Some(ContainerSummaryStateEnum::RUNNING),
                        connection,
                    })
                })
                .collect();
            Ok(found)
        })
    }
}

/// How long a kernel killed by SIGKILL waits for the engine's `oom` event that says the
/// memory limit did it (the event and the exit travel separately).
const OOM_EVENT_GRACE: std::time::Duration = std::time::Duration::from_millis(400);

/// A container's memory limit in MiB, when it has one.
fn memory_mb(host: Option<&bollard::models::HostConfig>) -> Option<u64> {
    host.and_then(|h| h.memory)
        .and_then(|m| u64::try_from(m).ok())
        .filter(|m| *m > 0)
        .map(|m| m >> 20)
}

/// Writes a small record beside a socket directory, in the gateway's runtime directory,
/// out of the kernel's reach.
fn write_record(path: &std::path::Path, text: &str) -> Result<(), BackendError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()));
    written.map_err(|source| BackendError::SocketDir {
        path: path.display().to_string(),
        source,
    })
}

/// Which kernel a container started for the warm pool serves since a restart moved one
/// into it, beside its socket directory.
fn kernel_file(socket_dir: &std::path::Path) -> PathBuf {
    socket_dir.with_extension("kernel")
}

/// Where the owner of a kernel handed out from the warm pool is recorded: beside its socket
/// directory, in the gateway's runtime directory, out of the kernel's reach.
fn owner_file(socket_dir: &std::path::Path) -> PathBuf {
    socket_dir.with_extension("owner")
}

/// Counts a failed Docker call in the metrics.
fn counted<'a, T: Send + 'a>(
    call: &'static str,
    work: impl std::future::Future<Output = Result<T, BackendError>> + Send + 'a,
) -> BoxFuture<'a, Result<T, BackendError>> {
    async move {
        let result = work.await;
        if result.is_err() {
            metrics::docker_error(call);
        }
        result
    }
    .boxed()
}
