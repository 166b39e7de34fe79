//! Kernels in local Docker containers (bollard). One container per kernel, named
//! `kernelgate-<kernel_id>` and labelled so that a restarted gateway finds it again; its
//! sockets live in a host directory bind-mounted at `/run/kernel` ([`socket_dir`]); the
//! engine-neutral sandbox spec (its hardening from `backend/sandbox.rs`) becomes a
//! container in [`spec`]; the other sandbox calls (one-shot runs, interactive commands,
//! files, sandboxes by label) are in [`sandboxes`], the gateway's commands in a container
//! in [`exec`], what a restarted gateway finds in [`found`]; out-of-memory events of every
//! kernel come from one shared subscription ([`events`]).

mod errors;
mod events;
mod exec;
mod found;
pub mod lock;
mod runtime;
pub(crate) mod sandboxes;
pub(crate) mod socket_dir;
pub(crate) mod spec;

use errors::{force, gone, map_handle_error, runtime, status, unavailable};
pub(crate) use exec::EXEC_TAG;
use found::{kernel_file, owner_file, write_record};
pub use runtime::{Runtime, RUNSC_RUNTIME};
pub use sandboxes::{isolation_of, one_shot_body};
pub use spec::LAUNCHER_EXEC;

use super::sandbox::{Isolation, Mount, RunOnce, RunOutput, SandboxSpec};
use super::{
    BackendError, Capabilities, ExecOutput, ExecRequest, Exit, Found, ImageFacts, Interactive,
    InteractiveRequest, KernelBackend, Labelled, LaunchRequest, Launched, Signal, TarStream,
};
use crate::config::{Config, RuntimeChoice};
use crate::metrics;
use bollard::errors::Error as DockerError;

use bollard::query_parameters::{
    CreateContainerOptionsBuilder, EventsOptionsBuilder, InspectContainerOptions,
    KillContainerOptionsBuilder, ListContainersOptionsBuilder, RenameContainerOptions,
    RestartContainerOptionsBuilder, WaitContainerOptionsBuilder,
};
use bollard::Docker;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};
use kernelgate_protocol::ConnectionInfo;
use socket_dir::{Ids, Ownership};
use spec::{ContainerSpec, LABEL_KERNEL_ID, LABEL_RUNTIME_DIR};
use std::collections::{BTreeMap, HashMap};
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

impl DockerSettings {
    /// For one-shot runs only (`packages` commands), under `runtime`: no kernels, so no
    /// runtime directory of the gateway's and no kernel limits.
    pub fn for_one_shot_runs(image: &str, runtime: RuntimeChoice) -> Self {
        DockerSettings {
            image: image.to_owned(),
            runtime_dir: std::env::temp_dir(),
            memory_mb: 512,
            cpus: 1.0,
            pids: 64,
            disk_mb: 64,
            runtime,
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
    /// Out-of-memory events of this gateway's containers, from one shared subscription.
    ooms: std::sync::Arc<events::OomBoard>,
    /// Ends that subscription with the backend.
    _events: tokio_util::sync::DropGuard,
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
        let ooms = std::sync::Arc::new(events::OomBoard::default());
        let stop = tokio_util::sync::CancellationToken::new();
        tokio::spawn(events::subscribe(
            docker.clone(),
            settings.runtime_dir.to_string_lossy().into_owned(),
            ooms.clone(),
            stop.clone(),
        ));
        Ok(DockerBackend {
            docker,
            settings,
            ownership: Ownership::for_gateway(ids),
            dirs: Mutex::default(),
            runtime,
            ooms,
            _events: stop.drop_guard(),
        })
    }

    /// The runtime kernel containers run under.
    pub fn runtime(&self) -> Runtime {
        self.runtime
    }

    async fn launch_inner(&self, req: &LaunchRequest) -> Result<Launched, BackendError> {
        let runtime_dir_str = self.runtime_dir_label();
        let socket_dir::Prepared {
            dir,
            dir_str,
            outside,
        } = socket_dir::prepare(
            &self.settings.runtime_dir,
            &req.kernel_id,
            &req.kernel_name,
            &self.ownership,
        )?;

        let (package_binds, package_env) = self.package_mounts(req).await;
        let (memory_mb, cpus) = req.limits_within(self.settings.memory_mb, self.settings.cpus);
        let created = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let body = ContainerSpec {
            extra_binds: &package_binds,
            extra_env: &package_env,
            image: &req.image,
            kernel_id: &req.kernel_id,
            kernel_name: &req.kernel_name,
            created: &created,
            runtime_dir: &runtime_dir_str,
            socket_dir: &dir_str,
            memory_mb,
            cpus,
            owner: req.owner.as_deref(),
            pids: self.settings.pids,
            disk_mb: self.settings.disk_mb,
            group_add: self.ownership.group_add,
            env: &req.env,
            preload: req.preload,
            runtime: self.runtime.docker_name(),
            isolation: isolation_of(self.runtime),
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

    /// Every container (running or not) that carries all of `labels` (`key=value`).
    async fn containers_labelled(
        &self,
        labels: impl IntoIterator<Item = String>,
    ) -> Result<Vec<bollard::models::ContainerSummary>, BackendError> {
        // Several label filters must all match.
        let filters = HashMap::from([("label", labels.into_iter().collect::<Vec<_>>())]);
        let options = ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build();
        self.docker
            .list_containers(Some(options))
            .await
            .map_err(|e| runtime("list", e))
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
    async fn package_mounts(&self, req: &LaunchRequest) -> (Vec<Mount>, crate::packages::Env) {
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
    /// start, RFC 3339), waiting [`OOM_EVENT_GRACE`] for one still on its way. Answered
    /// from the shared subscription; only a time it did not cover (a container started
    /// before this gateway, or while the subscription was broken) asks the engine's log.
    async fn oom_event_since(&self, handle: &str, since: &str) -> bool {
        let Ok(since) = chrono::DateTime::parse_from_rfc3339(since) else {
            return false;
        };
        let Some(since_ns) = since.timestamp_nanos_opt() else {
            return false;
        };
        if let Some(seen) = self
            .ooms
            .wait_seen_since(handle, since_ns, OOM_EVENT_GRACE)
            .await
        {
            return seen;
        }
        let until = chrono::Utc::now().timestamp_nanos_opt().unwrap_or(i64::MAX);
        let filters = HashMap::from([
            ("type", vec!["container".to_owned()]),
            ("container", vec![handle.to_owned()]),
            ("event", vec!["oom".to_owned()]),
        ]);
        let options = EventsOptionsBuilder::default()
            .since(&events::stamp(since_ns))
            .until(&events::stamp(until))
            .filters(&filters)
            .build();
        let mut log = self.docker.events(Some(options));
        let first = tokio::time::timeout(OOM_EVENT_GRACE * 4, log.next()).await;
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
    fn engine(&self) -> &'static str {
        "docker"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            sandboxes: true,
            engine_labels: true,
            interactive_exec: true,
            run_once: true,
            files: true,
            // No memory-image checkpoint through Docker here (docs/hibernation.md).
            checkpoint: false,
            restore: false,
            clone: false,
        }
    }

    fn isolation(&self) -> Isolation {
        isolation_of(self.runtime)
    }

    fn create<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFuture<'a, Result<String, BackendError>> {
        counted("create", self.create_sandbox(spec))
    }

    fn start<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        counted("start", self.start_sandbox(handle))
    }

    fn signal<'a>(
        &'a self,
        handle: &'a str,
        signal: Signal,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        counted("signal", self.signal_sandbox(handle, signal))
    }

    fn stop<'a>(
        &'a self,
        handle: &'a str,
        grace: std::time::Duration,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        counted("stop", self.stop_sandbox(handle, grace))
    }

    fn list_labelled<'a>(
        &'a self,
        labels: &'a BTreeMap<String, String>,
    ) -> BoxFuture<'a, Result<Vec<Labelled>, BackendError>> {
        counted("list_labelled", self.list_labelled_inner(labels))
    }

    fn exec_interactive<'a>(
        &'a self,
        handle: &'a str,
        request: InteractiveRequest,
    ) -> BoxFuture<'a, Result<Interactive, BackendError>> {
        counted(
            "exec_interactive",
            self.exec_interactive_inner(handle, request),
        )
    }

    fn run_once(&self, request: RunOnce) -> BoxFuture<'_, Result<RunOutput, BackendError>> {
        counted("run_once", self.run_once_inner(request))
    }

    fn read_home<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<TarStream, BackendError>> {
        counted("read_home", self.read_home_inner(handle))
    }

    fn put_tree<'a>(
        &'a self,
        handle: &'a str,
        dest: &'a str,
        tree: bytes::Bytes,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        counted("put_tree", self.put_tree_inner(handle, dest, tree))
    }

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
                        entrypoint: config.entrypoint.unwrap_or_default(),
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
            self.ooms.forget(handle);
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
        // A watcher of the shared subscription, not a connection of its own.
        let count = self.ooms.watch(handle);
        futures::stream::unfold(count, |mut count| async move {
            count.changed().await.ok()?;
            Some(((), count))
        })
        .then(move |()| async move {
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
        request: ExecRequest,
    ) -> BoxFuture<'a, Result<ExecOutput, BackendError>> {
        counted("exec", self.exec_inner(handle, request))
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
        counted("list", self.found())
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
