//! Kernels in gVisor sandboxes run by `runsc` directly: no Docker daemon. Each sandbox is
//! an OCI bundle under `<runtime-dir>/gvisor/bundles/<handle>` ([`bundle`]: its
//! `config.json`, written from the engine-neutral spec by [`oci`], `meta.json`, the labels
//! and records that [`KernelBackend::list`] finds kernels by, the kernel's output and
//! runsc's boot log); one runsc state directory (`<runtime-dir>/gvisor/root`) per runtime
//! directory; runsc is driven by [`runsc`]; sandboxes are created, watched and removed in
//! [`lifecycle`], and commands run in them in [`exec`]. Images come from a resolver
//! ([`ImageResolver`]): the image store, which keeps each image's root filesystem
//! unpacked. The engine needs root (namespaces, chroot, cgroups).

mod bundle;
pub mod cgroup_parent;
pub mod checkpoint;
mod exec;
pub mod images;
mod lifecycle;
pub mod oci;
pub mod runsc;

use super::docker::socket_dir::{self, Ids, Ownership};
use super::docker::spec::{self as labels_spec, LABEL_KERNEL_ID};
use super::sandbox::{Isolation, RunOnce, RunOutput, SandboxSpec};
use super::{
    BackendError, Capabilities, ExecOutput, ExecRequest, Exit, Found, ImageFacts, Interactive,
    InteractiveRequest, KernelBackend, Labelled, LaunchRequest, Launched, Signal, TarStream,
};
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use kernelgate_protocol::ConnectionInfo;
pub use oci::{Cgroups, ResolvedImage};
use runsc::Runsc;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// Finds an image by reference: its root filesystem and config.
pub type ImageResolver = Arc<dyn Fn(&str) -> Result<ResolvedImage, BackendError> + Send + Sync>;

/// What the engine's sandboxes are made from and may use.
#[derive(Debug, Clone)]
pub struct GvisorSettings {
    /// The runsc binary.
    pub runsc: PathBuf,
    pub image: String,
    /// Host directory holding one socket directory per kernel, and `gvisor/`.
    pub runtime_dir: PathBuf,
    pub memory_mb: u64,
    pub cpus: f64,
    pub pids: i64,
    pub disk_mb: u64,
    /// The wheelhouse and installer kernels mount (`--wheelhouse`), as under Docker; none
    /// without.
    pub packages: Option<crate::packages::Mounts>,
}

/// Where `make gvisor` unpacks runsc, and the usual system path.
pub fn default_runsc() -> PathBuf {
    let unpacked = Path::new("/usr/local/lib/kernelgate/runsc");
    if let Ok(entries) = std::fs::read_dir(unpacked) {
        let mut found: Vec<PathBuf> = entries
            .filter_map(|e| Some(e.ok()?.path().join("usr/bin/runsc")))
            .filter(|p| p.is_file())
            .collect();
        found.sort();
        if let Some(newest) = found.pop() {
            return newest;
        }
    }
    PathBuf::from("/usr/bin/runsc")
}

/// Why the engine cannot run as this user, if it cannot.
pub fn refuse_unprivileged(euid: u32) -> Result<(), String> {
    if euid == 0 {
        return Ok(());
    }
    Err(
        "the gvisor engine needs root: runsc creates namespaces, chroots into each \
         sandbox's root filesystem and places sandboxes in cgroups; run the gateway as \
         root, or use `--engine docker`, which needs only membership of the docker group"
            .to_owned(),
    )
}

/// Refuses to run the engine as anyone but root ([`refuse_unprivileged`]).
pub fn check_privileges() -> Result<(), String> {
    let ids = Ids::current().map_err(|e| format!("cannot read /proc/self/status: {e}"))?;
    refuse_unprivileged(ids.uid)
}

/// Runs each kernel in its own gVisor sandbox with runsc.
pub struct GvisorEngine {
    settings: GvisorSettings,
    runsc: Runsc,
    resolve: ImageResolver,
    ownership: Ownership,
    cgroups: Cgroups,
    /// How each sandbox this process started ended, once it did.
    exits: Mutex<HashMap<String, watch::Receiver<Option<Exit>>>>,
    /// Held while the engine's directories are made or, once it has no sandbox left,
    /// removed (so that the runtime directory holds only socket directories then).
    layout: Mutex<()>,
}

impl std::fmt::Debug for GvisorEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GvisorEngine")
            .field("settings", &self.settings)
            .finish()
    }
}

impl GvisorEngine {
    /// The engine, with images from `resolve`. Refuses a missing runsc.
    pub fn new(settings: GvisorSettings, resolve: ImageResolver) -> Result<Self, BackendError> {
        if !settings.runsc.is_file() {
            return Err(BackendError::Runtime(format!(
                "runsc not found at {}; install it with `make gvisor` or name it with `--runsc PATH`",
                settings.runsc.display()
            )));
        }
        let ids = Ids::current().map_err(|source| BackendError::SocketDir {
            path: "/proc/self/status".to_owned(),
            source,
        })?;
        let base = settings.runtime_dir.join("gvisor");
        Ok(GvisorEngine {
            runsc: Runsc {
                path: settings.runsc.clone(),
                root: base.join("root"),
            },
            settings,
            resolve,
            ownership: Ownership::for_gateway(ids),
            cgroups: Cgroups::detect(),
            exits: Mutex::default(),
            layout: Mutex::default(),
        })
    }
}

fn signal_arg(signal: Signal) -> &'static str {
    match signal {
        Signal::Interrupt => "INT",
        Signal::Terminate => "TERM",
        Signal::Kill => "KILL",
        Signal::Hangup => "HUP",
    }
}

impl KernelBackend for GvisorEngine {
    fn engine(&self) -> &'static str {
        "gvisor"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            sandboxes: true,
            engine_labels: false,
            interactive_exec: true,
            run_once: true,
            files: true,
            checkpoint: true,
            restore: true,
            ..Capabilities::default()
        }
    }

    fn isolation(&self) -> Isolation {
        Isolation::Gvisor
    }

    fn check(&self) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move {
            self.runsc.run(&["--version"]).await?;
            (self.resolve)(&self.settings.image).map(drop)
        })
    }

    fn describe_image<'a>(
        &'a self,
        image: &'a str,
    ) -> BoxFuture<'a, Result<ImageFacts, BackendError>> {
        Box::pin(async move {
            let resolved = (self.resolve)(image)?;
            Ok(ImageFacts {
                labels: resolved.labels.into_iter().collect(),
                cmd: resolved.cmd,
                id: resolved.id,
                entrypoint: resolved.entrypoint,
            })
        })
    }

    fn launch<'a>(
        &'a self,
        req: &'a LaunchRequest,
    ) -> BoxFuture<'a, Result<Launched, BackendError>> {
        Box::pin(self.launch_inner(req))
    }

    fn restart<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(self.restart_inner(handle))
    }

    fn interrupt<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        self.signal(handle, Signal::Interrupt)
    }

    fn signal<'a>(
        &'a self,
        handle: &'a str,
        signal: Signal,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            self.existing_bundle(handle)?;
            self.runsc.kill(handle, signal_arg(signal), false).await
        })
    }

    fn remove<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            self.remove_inner(handle).await?;
            self.exits.lock().expect("exits lock").remove(handle);
            Ok(())
        })
    }

    fn wait_exit<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<Exit, BackendError>> {
        Box::pin(self.wait_exit_inner(handle))
    }

    fn out_of_memory<'a>(&'a self, handle: &'a str) -> BoxStream<'a, Exit> {
        self.oom_stream(handle)
    }

    fn exec<'a>(
        &'a self,
        handle: &'a str,
        request: ExecRequest,
    ) -> BoxFuture<'a, Result<ExecOutput, BackendError>> {
        Box::pin(self.exec_inner(handle, request))
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<Found>, BackendError>> {
        Box::pin(async move {
            let states: HashMap<String, String> = self.runsc.list().await?.into_iter().collect();
            let limits = labels_spec::limits_label(
                self.settings.memory_mb,
                self.settings.cpus,
                self.settings.pids,
                self.settings.disk_mb,
            );
            let runtime_dir = self.runtime_dir_label();
            let mut found = Vec::new();
            for (handle, meta) in self.bundles() {
                let mut labels = meta.labels.clone();
                if labels.get(labels_spec::LABEL_MANAGED).map(String::as_str) != Some("true")
                    || labels.get(labels_spec::LABEL_RUNTIME_DIR) != Some(&runtime_dir)
                {
                    continue;
                }
                let Some(label_id) = labels.remove(LABEL_KERNEL_ID) else {
                    continue;
                };
                let connection = meta.socket_dir.as_deref().and_then(|dir| {
                    let text = socket_dir::read_connection(dir).ok()?;
                    let inside = ConnectionInfo::from_json(&text).ok()?;
                    Some(inside.with_ip(&format!(
                        "{}/{}",
                        dir.to_str()?,
                        socket_dir::SOCKET_PREFIX
                    )))
                });
                let owner = labels.remove(labels_spec::LABEL_OWNER).or(meta.owner);
                let current = labels.get(labels_spec::LABEL_LIMITS) == Some(&limits)
                    && (self.resolve)(&meta.image).is_ok_and(|i| i.id == meta.image_id);
                found.push(Found {
                    pooled: labels.contains_key(labels_spec::LABEL_POOL)
                        && owner.is_none()
                        && meta.serves.is_none(),
                    current,
                    image: meta.image,
                    owner,
                    kernel_name: labels
                        .remove(labels_spec::LABEL_KERNEL_NAME)
                        .unwrap_or_default(),
                    moved: meta.serves.is_some(),
                    kernel_id: meta.serves.unwrap_or(label_id),
                    running: states.get(&handle).map(String::as_str) == Some("running"),
                    handle,
                    connection,
                });
            }
            Ok(found)
        })
    }

    fn set_owner<'a>(
        &'a self,
        kernel_id: &'a str,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            // The sandbox started for `kernel_id` (a warm one handed out, even once it
            // serves another kernel), and the one a restart moved that kernel into.
            for (handle, mut meta) in self.bundles() {
                if meta.labels.get(LABEL_KERNEL_ID).map(String::as_str) == Some(kernel_id)
                    || meta.serves.as_deref() == Some(kernel_id)
                {
                    meta.owner = Some(owner.to_owned());
                    self.write_meta(&handle, &meta)?;
                }
            }
            Ok(())
        })
    }

    fn set_kernel_id<'a>(
        &'a self,
        container_id: &'a str,
        kernel_id: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        // `container_id` is the kernel the sandbox was started for (its label), as the
        // Docker engine names it, not the sandbox's handle.
        Box::pin(async move {
            let started_for = |meta: &bundle::Meta| {
                meta.labels.get(LABEL_KERNEL_ID).map(String::as_str) == Some(container_id)
            };
            let mut found = false;
            for (handle, mut meta) in self.bundles() {
                if started_for(&meta) {
                    meta.serves = Some(kernel_id.to_owned());
                    self.write_meta(&handle, &meta)?;
                    found = true;
                }
            }
            if found {
                Ok(())
            } else {
                Err(BackendError::Gone {
                    handle: container_id.to_owned(),
                })
            }
        })
    }

    fn run_once(&self, request: RunOnce) -> BoxFuture<'_, Result<RunOutput, BackendError>> {
        Box::pin(self.run_once_inner(request))
    }

    fn exec_interactive<'a>(
        &'a self,
        handle: &'a str,
        request: InteractiveRequest,
    ) -> BoxFuture<'a, Result<Interactive, BackendError>> {
        Box::pin(self.exec_interactive_inner(handle, request))
    }

    fn read_home<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<TarStream, BackendError>> {
        Box::pin(self.read_home_inner(handle))
    }

    fn put_tree<'a>(
        &'a self,
        handle: &'a str,
        dest: &'a str,
        tree: bytes::Bytes,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(self.put_tree_inner(handle, dest, tree))
    }

    fn can_checkpoint(&self, handle: &str) -> bool {
        self.read_meta(handle)
            .ok()
            .and_then(|m| m.socket_dir)
            .is_some_and(|dir| checkpoint::relays_serve(&dir))
    }

    fn checkpoint<'a>(
        &'a self,
        handle: &'a str,
        dir: &'a Path,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(self.checkpoint_inner(handle, dir, false))
    }

    fn snapshot<'a>(
        &'a self,
        handle: &'a str,
        dir: &'a Path,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(self.checkpoint_inner(handle, dir, true))
    }

    fn restore_kernel<'a>(
        &'a self,
        req: &'a LaunchRequest,
        dir: &'a Path,
    ) -> BoxFuture<'a, Result<Launched, BackendError>> {
        Box::pin(self.restore_inner(req, dir))
    }

    fn create<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFuture<'a, Result<String, BackendError>> {
        Box::pin(self.create_sandbox(spec, None))
    }

    fn start<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(self.start_sandbox(handle))
    }

    fn stop<'a>(
        &'a self,
        handle: &'a str,
        grace: std::time::Duration,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(self.stop_inner(handle, grace))
    }

    fn list_labelled<'a>(
        &'a self,
        labels: &'a BTreeMap<String, String>,
    ) -> BoxFuture<'a, Result<Vec<Labelled>, BackendError>> {
        Box::pin(async move {
            let states: HashMap<String, String> = self.runsc.list().await?.into_iter().collect();
            Ok(self
                .bundles()
                .into_iter()
                .filter(|(_, meta)| labels.iter().all(|(k, v)| meta.labels.get(k) == Some(v)))
                .map(|(handle, meta)| Labelled {
                    running: states.get(&handle).map(String::as_str) == Some("running"),
                    handle,
                    labels: meta.labels,
                })
                .collect())
        })
    }
}

#[cfg(test)]
pub(crate) mod tests;
