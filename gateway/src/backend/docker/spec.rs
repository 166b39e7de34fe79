//! What a container is created with: an engine-neutral [`SandboxSpec`] (its hardening
//! written once in `backend/sandbox.rs`, docs/security.md "The model") translated into a
//! `ContainerCreateBody`, and a kernel's spec ([`ContainerSpec`]). Pure, so the hardening
//! is asserted by unit tests.

use super::socket_dir::{CONTAINER_DIR, KERNEL_GID, KERNEL_UID};
use crate::backend::sandbox::{
    Command, Hardening, Isolation, Limits, Mount, SandboxSpec, Tmpfs, NOFILE,
};
use bollard::models::{
    ContainerCreateBody, HostConfig, HostConfigCgroupnsModeEnum, HostConfigLogConfig,
    ResourcesUlimits,
};
use std::collections::{BTreeMap, HashMap};

/// The user kernels run as (and exec runs as).
pub fn kernel_user() -> String {
    format!("{KERNEL_UID}:{KERNEL_GID}")
}

/// The kernel's home and working directory inside the container (a tmpfs).
pub use crate::backend::sandbox::KERNEL_HOME;

pub const LABEL_KERNEL_ID: &str = "org.kernelgate.kernel_id";
pub const LABEL_KERNEL_NAME: &str = "org.kernelgate.kernel_name";
pub const LABEL_CREATED: &str = "org.kernelgate.created";
pub const LABEL_MANAGED: &str = "org.kernelgate.managed";
/// The gateway's runtime directory: kernels of another gateway on the same Docker engine
/// (another runtime directory) are neither adopted nor removed as orphans.
pub const LABEL_RUNTIME_DIR: &str = "org.kernelgate.runtime_dir";
/// The OCI runtime the kernel runs under: `runc` or `runsc`.
pub const LABEL_RUNTIME: &str = "org.kernelgate.runtime";
/// The tenant a kernel was started for (warm kernels get theirs when handed out, recorded
/// beside their socket directory: labels cannot change).
pub const LABEL_OWNER: &str = "org.kernelgate.owner";
/// Started for the warm pool: `true`. Whether it was handed out since is recorded beside
/// its socket directory (its owner), as labels cannot change.
pub const LABEL_POOL: &str = "org.kernelgate.pool";
/// The limits it runs with ([`limits_label`]), so a restarted gateway can tell whether a
/// warm kernel left by an earlier run still fits its configuration.
pub const LABEL_LIMITS: &str = "org.kernelgate.limits";

/// The value of [`LABEL_LIMITS`].
pub fn limits_label(memory_mb: u64, cpus: f64, pids: i64, disk_mb: u64) -> String {
    format!("memory_mb={memory_mb},cpus={cpus},pids={pids},disk_mb={disk_mb}")
}

/// Container name of a kernel.
pub fn container_name(kernel_id: &str) -> String {
    format!("kernelgate-{kernel_id}")
}

/// Everything that goes into one kernel container.
#[derive(Debug, Clone)]
pub struct ContainerSpec<'a> {
    pub image: &'a str,
    pub kernel_id: &'a str,
    pub kernel_name: &'a str,
    /// RFC 3339 creation time, for the label.
    pub created: &'a str,
    /// The gateway's runtime directory (for the label).
    pub runtime_dir: &'a str,
    /// Host path of the socket directory.
    pub socket_dir: &'a str,
    pub memory_mb: u64,
    pub cpus: f64,
    pub pids: i64,
    pub disk_mb: u64,
    /// Supplementary group for the kernel user (see `socket_dir::Ownership`).
    pub group_add: Option<u32>,
    pub env: &'a BTreeMap<String, String>,
    pub preload: bool,
    /// The engine's name of the OCI runtime (`runc`, `kernelgate-runsc`).
    pub runtime: &'a str,
    /// The isolation that runtime gives.
    pub isolation: Isolation,
    /// The same as users know it (`runc`, `runsc`), for the label.
    pub runtime_label: &'a str,
    /// The tenant it is started for, if any (for the label).
    pub owner: Option<&'a str>,
    /// Read-only mounts beyond the socket directory: the wheelhouse tree and the package
    /// installer (docs/packages.md).
    pub extra_binds: &'a [Mount],
    /// Environment the gateway sets beyond the client's.
    pub extra_env: &'a [(String, String)],
}

impl ContainerSpec<'_> {
    /// The kernel's sandbox, engine-neutral.
    pub fn sandbox(&self) -> SandboxSpec {
        let mut labels = BTreeMap::from([
            (LABEL_KERNEL_ID.to_owned(), self.kernel_id.to_owned()),
            (LABEL_KERNEL_NAME.to_owned(), self.kernel_name.to_owned()),
            (LABEL_CREATED.to_owned(), self.created.to_owned()),
            (LABEL_MANAGED.to_owned(), "true".to_owned()),
            (LABEL_RUNTIME_DIR.to_owned(), self.runtime_dir.to_owned()),
            (LABEL_RUNTIME.to_owned(), self.runtime_label.to_owned()),
            (
                LABEL_LIMITS.to_owned(),
                limits_label(self.memory_mb, self.cpus, self.pids, self.disk_mb),
            ),
        ]);
        if self.preload {
            labels.insert(LABEL_POOL.to_owned(), "true".to_owned());
        }
        if let Some(owner) = self.owner {
            labels.insert(LABEL_OWNER.to_owned(), owner.to_owned());
        }
        let mut env: Vec<(String, String)> = self
            .env
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if self.preload {
            env.push(("KERNELGATE_PRELOAD".to_owned(), "1".to_owned()));
        }
        env.extend(self.extra_env.iter().cloned());
        let limits = Limits {
            memory_mb: self.memory_mb,
            cpus: self.cpus,
            pids: self.pids,
            nofile: NOFILE,
        };
        let mut hardening = Hardening::kernel(self.isolation, limits, self.disk_mb);
        hardening.group_add = self.group_add;
        let mut sandbox = SandboxSpec::new(self.image, Command::Image, hardening);
        sandbox.name = Some(container_name(self.kernel_id));
        sandbox.labels = labels;
        sandbox.env = env;
        sandbox.hostname = Some("kernel".to_owned());
        sandbox.mounts = std::iter::once(Mount::writable(self.socket_dir, CONTAINER_DIR))
            .chain(self.extra_binds.iter().cloned())
            .collect();
        sandbox
    }

    pub fn to_body(&self) -> ContainerCreateBody {
        // The image's CMD runs the launcher, which reads /run/kernel/kernel.json.
        to_body(&self.sandbox(), self.runtime, &[]).expect("a kernel runs the image's own command")
    }
}

/// The container of `spec` under the engine's OCI runtime `runtime` (the one that gives
/// `spec.hardening.isolation`). `launcher` is the image's command (its launcher), which a
/// [`Command::Filtered`] run goes through; an image without one cannot run it.
pub fn to_body(
    spec: &SandboxSpec,
    runtime: &str,
    launcher: &[String],
) -> Result<ContainerCreateBody, String> {
    let h = &spec.hardening;
    let cmd = match &spec.command {
        Command::Image => None,
        Command::Filtered(argv) => {
            if launcher.is_empty() {
                return Err(format!(
                    "the image {} has no command (its launcher) to install the syscall filter",
                    spec.image
                ));
            }
            Some(
                launcher
                    .iter()
                    .cloned()
                    .chain(std::iter::once(LAUNCHER_EXEC.to_owned()))
                    .chain(argv.iter().cloned())
                    .collect(),
            )
        }
    };
    // Docker adds noexec,nosuid,nodev to every tmpfs; the options here only add to them.
    let tmpfs = h
        .tmpfs
        .iter()
        .map(|t| (t.path.clone(), tmpfs_options(t)))
        .collect();
    let memory = i64::try_from(h.limits.memory_mb.saturating_mul(1024 * 1024)).unwrap_or(i64::MAX);
    let mut security_opt = Vec::new();
    if h.no_new_privileges {
        security_opt.push("no-new-privileges".to_owned());
    }
    // Docker's default seccomp profile stays: no `seccomp=` entry unless asked away.
    if !h.engine_seccomp {
        security_opt.push("seccomp=unconfined".to_owned());
    }
    let host_config = HostConfig {
        runtime: Some(runtime.to_owned()),
        network_mode: h.no_network.then(|| "none".to_owned()),
        readonly_rootfs: Some(h.read_only_root),
        tmpfs: Some(tmpfs),
        cap_drop: h.drop_all_capabilities.then(|| vec!["ALL".to_owned()]),
        security_opt: Some(security_opt),
        pids_limit: Some(h.limits.pids),
        memory: Some(memory),
        memory_swap: Some(memory),
        nano_cpus: Some((h.limits.cpus.max(0.0) * 1e9).round() as i64),
        binds: (!spec.mounts.is_empty()).then(|| spec.mounts.iter().map(bind).collect()),
        ipc_mode: Some("private".to_owned()),
        // Its own view of the cgroup tree, not the host's paths.
        cgroupns_mode: Some(HostConfigCgroupnsModeEnum::PRIVATE),
        ulimits: Some(ulimits(h)),
        // The image's entrypoint is tini.
        init: Some(false),
        auto_remove: Some(false),
        group_add: h.group_add.map(|gid| vec![gid.to_string()]),
        // Whatever the sandbox writes to fd 1/2 outside ipykernel's capture (a subprocess,
        // `os.write(1, ...)`) lands in the container log on the host's disk: cap it.
        log_config: Some(HostConfigLogConfig {
            typ: Some("json-file".to_owned()),
            config: Some(HashMap::from([
                ("max-size".to_owned(), "10m".to_owned()),
                ("max-file".to_owned(), "1".to_owned()),
            ])),
        }),
        ..Default::default()
    };
    Ok(ContainerCreateBody {
        image: Some(spec.image.clone()),
        user: Some(h.user_spec()),
        hostname: spec.hostname.clone(),
        env: Some(spec.env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
        labels: Some(spec.labels.clone().into_iter().collect()),
        host_config: Some(host_config),
        cmd,
        working_dir: spec.workdir.clone(),
        ..Default::default()
    })
}

/// The launcher's mode that installs its syscall filter and then runs the rest of its
/// arguments (kernel-image/launch.py).
pub const LAUNCHER_EXEC: &str = "--exec";

fn bind(m: &Mount) -> String {
    let mode = if m.writable { "rw" } else { "ro" };
    format!("{}:{}:{mode}", m.host.display(), m.sandbox)
}

fn tmpfs_options(t: &Tmpfs) -> String {
    let owner = t
        .owner
        .map(|(uid, gid)| format!(",uid={uid},gid={gid}"))
        .unwrap_or_default();
    format!(
        "rw,nosuid,nodev,size={}m{owner},mode={:04o}",
        t.size_mb, t.mode
    )
}

fn ulimits(h: &Hardening) -> Vec<ResourcesUlimits> {
    let mut limits = Vec::new();
    if !h.core_files {
        // A crash must not write a core file the size of its memory.
        limits.push(limit("core", 0));
    }
    limits.push(limit("nofile", h.limits.nofile));
    if h.isolation == Isolation::Gvisor {
        limits.push(limit("nproc", gvisor_tasks(h.limits.pids)));
    }
    limits
}

/// The processes and threads a kernel may have under gVisor, where the pids limit counts
/// the sandbox's own host processes and threads (the Sentry's, a stub per address space)
/// rather than the kernel's: a fork loop that reached it would kill the Sentry (exit 2)
/// and with it the kernel. gVisor enforces RLIMIT_NPROC per sandbox (threads included),
/// so that is the kernel's limit there: a quarter of the pids limit, which the sandbox's
/// host side always fits in (measured with runsc 2024, systrap: 96 tasks fit 256 pids,
/// 128 did not). Never under runc, where RLIMIT_NPROC counts every process of the
/// kernel's uid on the host, other kernels' too.
pub fn gvisor_tasks(pids: i64) -> i64 {
    (pids / 4).max(16)
}

fn limit(name: &str, value: i64) -> ResourcesUlimits {
    ResourcesUlimits {
        name: Some(name.to_owned()),
        soft: Some(value),
        hard: Some(value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec<'a>(env: &'a BTreeMap<String, String>, group_add: Option<u32>) -> ContainerSpec<'a> {
        ContainerSpec {
            image: "kernelgate-kernel:latest",
            kernel_id: "k1",
            kernel_name: "python3",
            created: "2025-01-02T03:04:05Z",
            runtime_dir: "/run/kernelgate",
            socket_dir: "/run/kernelgate/k1",
            memory_mb: 1024,
            cpus: 1.5,
            pids: 256,
            disk_mb: 512,
            group_add,
            env,
            preload: true,
            runtime: "kernelgate-runsc",
            isolation: Isolation::Gvisor,
            runtime_label: "runsc",
            owner: Some("alice"),
            extra_binds: &[],
            extra_env: &[],
        }
    }

    #[test]
    fn the_container_is_locked_down() {
        let env = BTreeMap::new();
        let body = spec(&env, None).to_body();
        let host = body.host_config.expect("host config");
        assert_eq!(host.runtime.as_deref(), Some("kernelgate-runsc"));
        assert_eq!(host.network_mode.as_deref(), Some("none"));
        assert_eq!(host.readonly_rootfs, Some(true));
        assert_eq!(host.cap_drop, Some(vec!["ALL".to_owned()]));
        assert_eq!(host.cap_add, None);
        assert_eq!(host.privileged, None);
        assert_eq!(
            host.security_opt,
            Some(vec!["no-new-privileges".to_owned()])
        );
        assert_eq!(host.pids_limit, Some(256));
        assert_eq!(host.memory, Some(1024 * 1024 * 1024));
        assert_eq!(
            host.memory_swap, host.memory,
            "no swap beyond the memory limit"
        );
        assert_eq!(host.nano_cpus, Some(1_500_000_000));
        assert_eq!(host.ipc_mode.as_deref(), Some("private"));
        assert_eq!(
            host.cgroupns_mode,
            Some(HostConfigCgroupnsModeEnum::PRIVATE)
        );
        let ulimits = host.ulimits.clone().expect("ulimits");
        // Under gVisor the kernel's tasks are bounded by RLIMIT_NPROC, below what the
        // sandbox's host side needs of the pids limit; never under runc.
        assert_eq!(
            ulimits,
            vec![
                limit("core", 0),
                limit("nofile", NOFILE),
                limit("nproc", 64)
            ]
        );
        let runc = ContainerSpec {
            runtime: "runc",
            isolation: Isolation::RuncLike,
            runtime_label: "runc",
            ..spec(&env, None)
        };
        let runc_limits = runc.to_body().host_config.and_then(|h| h.ulimits);
        assert_eq!(
            runc_limits,
            Some(vec![limit("core", 0), limit("nofile", NOFILE)])
        );
        assert_eq!(host.init, Some(false));
        assert_eq!(host.auto_remove, Some(false));
        assert_eq!(host.group_add, None);
        // Its own socket directory and nothing else from the host.
        assert_eq!(
            host.binds,
            Some(vec!["/run/kernelgate/k1:/run/kernel:rw".to_owned()])
        );
        assert_eq!(host.mounts, None);
        assert_eq!(host.volumes_from, None);
        assert_eq!(host.devices, None);
        assert_eq!(host.pid_mode, None);
        assert_eq!(host.userns_mode, None);
        let tmpfs = host.tmpfs.expect("tmpfs");
        assert_eq!(tmpfs.len(), 2);
        assert_eq!(tmpfs["/tmp"], "rw,nosuid,nodev,size=64m,mode=1777");
        assert_eq!(
            tmpfs["/home/kernel"],
            "rw,nosuid,nodev,size=512m,uid=1000,gid=1000,mode=0700"
        );
        let log = host.log_config.expect("log config");
        assert_eq!(log.config.expect("log options")["max-size"], "10m");
    }

    #[test]
    fn the_kernel_runs_unprivileged_with_the_images_command() {
        let env = BTreeMap::new();
        let body = spec(&env, Some(998)).to_body();
        assert_eq!(body.user.as_deref(), Some("1000:1000"));
        assert_eq!(body.hostname.as_deref(), Some("kernel"));
        assert_eq!(body.image.as_deref(), Some("kernelgate-kernel:latest"));
        assert_eq!(body.cmd, None);
        assert_eq!(body.entrypoint, None);
        assert_eq!(
            body.host_config.expect("host config").group_add,
            Some(vec!["998".to_owned()])
        );
    }

    #[test]
    fn labels_let_a_restarted_gateway_find_its_kernels() {
        let env = BTreeMap::new();
        let labels = spec(&env, None).to_body().labels.expect("labels");
        assert_eq!(labels[LABEL_KERNEL_ID], "k1");
        assert_eq!(labels[LABEL_KERNEL_NAME], "python3");
        assert_eq!(labels[LABEL_OWNER], "alice");
        assert_eq!(labels[LABEL_CREATED], "2025-01-02T03:04:05Z");
        assert_eq!(labels[LABEL_MANAGED], "true");
        assert_eq!(labels[LABEL_RUNTIME_DIR], "/run/kernelgate");
        assert_eq!(labels[LABEL_RUNTIME], "runsc");
        assert_eq!(labels[LABEL_POOL], "true", "started for the warm pool");
        assert_eq!(
            labels[LABEL_LIMITS],
            "memory_mb=1024,cpus=1.5,pids=256,disk_mb=512"
        );
        assert_eq!(container_name("k1"), "kernelgate-k1");
    }

    #[test]
    fn env_is_the_request_plus_preload() {
        let env = BTreeMap::from([("KERNEL_A".to_owned(), "x=y".to_owned())]);
        let mut s = spec(&env, None);
        assert_eq!(
            s.to_body().env,
            Some(vec![
                "KERNEL_A=x=y".to_owned(),
                "KERNELGATE_PRELOAD=1".to_owned()
            ])
        );
        s.preload = false;
        assert_eq!(s.to_body().env, Some(vec!["KERNEL_A=x=y".to_owned()]));
    }
}
