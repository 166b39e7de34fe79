//! An OCI runtime `config.json` from an engine-neutral [`SandboxSpec`] and the image it
//! runs: the same hardening as the Docker engine's containers (`docker/spec.rs`), written
//! for runsc. Pure, so the hardening is asserted by unit tests.

use crate::backend::docker::spec::gvisor_tasks;
use crate::backend::docker::LAUNCHER_EXEC;
use crate::backend::sandbox::{Command, Hardening, Isolation, SandboxSpec, Tmpfs};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// An image as the engine runs it: its root filesystem unpacked in a host directory and
/// what its config says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolvedImage {
    /// The image's id (`sha256:...`).
    pub id: String,
    pub rootfs: PathBuf,
    pub env: Vec<String>,
    pub user: Option<String>,
    pub working_dir: Option<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub labels: BTreeMap<String, String>,
}

/// Which cgroup hierarchy the host has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cgroups {
    V1,
    V2,
}

impl Cgroups {
    /// The host's: v2 when `/sys/fs/cgroup` is the unified hierarchy.
    pub fn detect() -> Self {
        if std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            Cgroups::V2
        } else {
            Cgroups::V1
        }
    }
}

/// The cgroup path of sandbox `id` (relative to each hierarchy's root), under the parent
/// `--cgroup-parent` chose ([`super::cgroup_parent`]).
pub fn cgroups_path(id: &str) -> String {
    format!("{}/{id}", super::cgroup_parent::get())
}

/// The CFS period the CPU quota is given in (Docker's).
pub const CPU_PERIOD_US: u64 = 100_000;

/// What runs: the image's entrypoint and command (its launcher), with the launcher's exec
/// mode and `argv` for a [`Command::Filtered`] run.
pub fn args(spec: &SandboxSpec, image: &ResolvedImage) -> Result<Vec<String>, String> {
    let mut args = image.entrypoint.clone();
    match &spec.command {
        Command::Image => args.extend(image.cmd.iter().cloned()),
        Command::Filtered(argv) => {
            if image.cmd.is_empty() {
                return Err(format!(
                    "the image {} has no command (its launcher) to install the syscall filter",
                    spec.image
                ));
            }
            args.extend(image.cmd.iter().cloned());
            args.push(LAUNCHER_EXEC.to_owned());
            args.extend(argv.iter().cloned());
        }
    }
    if args.is_empty() {
        return Err(format!("the image {} has no command", spec.image));
    }
    Ok(args)
}

/// The image's environment with the spec's on top (a name set twice takes the spec's).
fn env(spec: &SandboxSpec, image: &ResolvedImage) -> Vec<String> {
    let mut out: Vec<(String, String)> = Vec::new();
    let pairs = image
        .env
        .iter()
        .map(|e| match e.split_once('=') {
            Some((k, v)) => (k.to_owned(), v.to_owned()),
            None => (e.clone(), String::new()),
        })
        .chain(spec.env.iter().cloned());
    for (k, v) in pairs {
        match out.iter_mut().find(|(name, _)| *name == k) {
            Some(slot) => slot.1 = v,
            None => out.push((k, v)),
        }
    }
    if let Some(host) = &spec.hostname {
        if !out.iter().any(|(k, _)| k == "HOSTNAME") {
            out.push(("HOSTNAME".to_owned(), host.clone()));
        }
    }
    out.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
}

fn tmpfs_mount(t: &Tmpfs) -> Value {
    // As Docker mounts it: never executable, no set-uid, no devices, bounded.
    let mut options = vec![
        "nosuid".to_owned(),
        "nodev".to_owned(),
        "noexec".to_owned(),
        format!("size={}m", t.size_mb),
        format!("mode={:04o}", t.mode),
    ];
    if let Some((uid, gid)) = t.owner {
        options.push(format!("uid={uid}"));
        options.push(format!("gid={gid}"));
    }
    json!({"destination": t.path, "type": "tmpfs", "source": "tmpfs", "options": options})
}

fn rlimits(h: &Hardening) -> Vec<Value> {
    let limit = |name: &str, value: i64| json!({"type": name, "hard": value, "soft": value});
    let mut out = Vec::new();
    if !h.core_files {
        out.push(limit("RLIMIT_CORE", 0));
    }
    out.push(limit("RLIMIT_NOFILE", h.limits.nofile));
    if h.isolation == Isolation::Gvisor {
        out.push(limit("RLIMIT_NPROC", gvisor_tasks(h.limits.pids)));
    }
    out
}

/// Memory, CPU and pids limits, as `linux.resources` for `cgroups`.
pub fn resources(h: &Hardening, cgroups: Cgroups) -> Value {
    let memory = h.limits.memory_mb.saturating_mul(1024 * 1024);
    let quota = (h.limits.cpus.max(0.0) * CPU_PERIOD_US as f64).round() as u64;
    let mut resources = json!({
        // Memory plus swap equals memory: no swap beyond it.
        "memory": {"limit": memory, "swap": memory},
        "cpu": {"quota": quota, "period": CPU_PERIOD_US},
        "pids": {"limit": h.limits.pids},
    });
    if cgroups == Cgroups::V2 {
        // The v2 files themselves, so nothing depends on the runtime's translation of
        // v1 numbers (where `swap` means memory plus swap).
        resources["unified"] = json!({
            "memory.max": memory.to_string(),
            "memory.swap.max": "0",
            "cpu.max": format!("{quota} {CPU_PERIOD_US}"),
            "pids.max": h.limits.pids.to_string(),
        });
    }
    resources
}

/// The `config.json` of sandbox `id` of `spec`, running `image`.
pub fn config(
    id: &str,
    spec: &SandboxSpec,
    image: &ResolvedImage,
    cgroups: Cgroups,
) -> Result<Value, String> {
    let h = &spec.hardening;
    let args = args(spec, image)?;
    let caps: Vec<String> = Vec::new();
    let cwd = spec
        .workdir
        .clone()
        .or_else(|| image.working_dir.clone().filter(|w| !w.is_empty()))
        .unwrap_or_else(|| "/".to_owned());
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts",
               "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
               "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
               "options": ["nosuid", "noexec", "nodev", "ro"]}),
    ];
    mounts.extend(h.tmpfs.iter().map(tmpfs_mount));
    for m in &spec.mounts {
        let mode = if m.writable { "rw" } else { "ro" };
        mounts.push(json!({
            "destination": m.sandbox,
            "type": "bind",
            "source": m.host,
            "options": ["rbind", mode, "nosuid", "nodev"],
        }));
    }
    let mut namespaces = vec![
        json!({"type": "pid"}),
        json!({"type": "ipc"}),
        json!({"type": "uts"}),
        json!({"type": "mount"}),
        json!({"type": "cgroup"}),
    ];
    if h.no_network {
        // A namespace of its own; runsc's `--network=none` gives it only `lo`.
        namespaces.push(json!({"type": "network"}));
    }
    let additional: Vec<u32> = h.group_add.into_iter().collect();
    Ok(json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": h.user.0, "gid": h.user.1, "additionalGids": additional},
            "args": args,
            "env": env(spec, image),
            "cwd": cwd,
            "capabilities": if h.drop_all_capabilities {
                json!({"bounding": caps, "effective": caps, "inheritable": caps,
                       "permitted": caps, "ambient": caps})
            } else {
                Value::Null
            },
            "rlimits": rlimits(h),
            "noNewPrivileges": h.no_new_privileges,
        },
        "root": {"path": image.rootfs, "readonly": h.read_only_root},
        "hostname": spec.hostname.clone().unwrap_or_else(|| "sandbox".to_owned()),
        "mounts": mounts,
        "annotations": spec.labels,
        "linux": {
            "namespaces": namespaces,
            "resources": resources(h, cgroups),
            "cgroupsPath": cgroups_path(id),
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list"],
            "readonlyPaths": ["/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"],
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sandbox::{Limits, Mount, KERNEL_HOME, NOFILE};

    fn image() -> ResolvedImage {
        ResolvedImage {
            id: "sha256:abc".to_owned(),
            rootfs: PathBuf::from("/srv/images/abc/rootfs"),
            env: vec!["PATH=/usr/bin".to_owned(), "HOME=/home/kernel".to_owned()],
            user: Some("1000:1000".to_owned()),
            working_dir: Some("/home/kernel".to_owned()),
            entrypoint: vec!["/usr/bin/tini".to_owned(), "-g".to_owned(), "--".to_owned()],
            cmd: vec!["python".to_owned(), "/opt/kernel/launch.py".to_owned()],
            labels: BTreeMap::new(),
        }
    }

    fn kernel_spec() -> SandboxSpec {
        let limits = Limits {
            memory_mb: 1024,
            cpus: 1.5,
            pids: 256,
            nofile: NOFILE,
        };
        let hardening = Hardening::kernel(Isolation::Gvisor, limits, 512);
        let mut spec = SandboxSpec::new("kernelgate-kernel:latest", Command::Image, hardening);
        spec.mounts = vec![Mount::writable("/run/kernelgate/k1", "/run/kernel")];
        spec.env = vec![("KERNEL_A".to_owned(), "x=y".to_owned())];
        spec.labels = BTreeMap::from([("org.kernelgate.kernel_id".to_owned(), "k1".to_owned())]);
        spec.hostname = Some("kernel".to_owned());
        spec
    }

    #[test]
    fn the_sandbox_is_locked_down() {
        let c = config("s1", &kernel_spec(), &image(), Cgroups::V1).expect("config");
        let p = &c["process"];
        assert_eq!(p["user"]["uid"], 1000);
        assert_eq!(p["user"]["gid"], 1000);
        assert_eq!(p["noNewPrivileges"], true);
        for set in [
            "bounding",
            "effective",
            "inheritable",
            "permitted",
            "ambient",
        ] {
            assert_eq!(p["capabilities"][set], json!([]), "{set} is empty");
        }
        assert_eq!(
            p["rlimits"],
            json!([
                {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
                {"type": "RLIMIT_NOFILE", "hard": NOFILE, "soft": NOFILE},
                {"type": "RLIMIT_NPROC", "hard": 64, "soft": 64},
            ])
        );
        assert_eq!(c["root"]["path"], "/srv/images/abc/rootfs");
        assert_eq!(c["root"]["readonly"], true);
        assert_eq!(c["hostname"], "kernel");
        let mounts = c["mounts"].as_array().expect("mounts");
        let binds: Vec<&Value> = mounts.iter().filter(|m| m["type"] == "bind").collect();
        assert_eq!(binds.len(), 1, "only the socket directory from the host");
        assert_eq!(binds[0]["source"], "/run/kernelgate/k1");
        assert_eq!(binds[0]["destination"], "/run/kernel");
        let tmpfs = |path: &str| {
            mounts
                .iter()
                .find(|m| m["destination"] == path)
                .map(|m| m["options"].clone())
                .expect("a tmpfs")
        };
        assert_eq!(
            tmpfs("/tmp"),
            json!(["nosuid", "nodev", "noexec", "size=64m", "mode=1777"])
        );
        assert_eq!(
            tmpfs(KERNEL_HOME),
            json!([
                "nosuid",
                "nodev",
                "noexec",
                "size=512m",
                "mode=0700",
                "uid=1000",
                "gid=1000"
            ])
        );
        let namespaces = c["linux"]["namespaces"].as_array().expect("namespaces");
        assert!(namespaces.contains(&json!({"type": "network"})));
        assert!(namespaces.iter().all(|n| n.get("path").is_none()));
        assert_eq!(c["annotations"]["org.kernelgate.kernel_id"], "k1");
    }

    #[test]
    fn package_mounts_are_read_only_binds_at_the_paths_kernels_expect() {
        use crate::packages::{Mounts, SHIM_IN_CONTAINER, TREE_IN_CONTAINER};
        let dir = tempfile::tempdir().expect("tempdir");
        let mounts = Mounts {
            wheelhouse: dir.path().join("wheelhouse"),
            shim_dir: dir.path().join("shim"),
        };
        let (binds, env) = mounts.for_kernel("sha256:abc", "python3").expect("mounts");
        let mut spec = kernel_spec();
        spec.mounts.extend(binds);
        spec.env.extend(env);
        let c = config("s1", &spec, &image(), Cgroups::V1).expect("config");
        let mounts = c["mounts"].as_array().expect("mounts");
        for path in [TREE_IN_CONTAINER, SHIM_IN_CONTAINER] {
            let bind = mounts
                .iter()
                .find(|m| m["destination"] == path)
                .expect("mounted");
            assert_eq!(bind["type"], "bind");
            assert_eq!(bind["options"], json!(["rbind", "ro", "nosuid", "nodev"]));
        }
        let env = c["process"]["env"].as_array().expect("env");
        assert!(env.contains(&json!(format!("PYTHONPATH={SHIM_IN_CONTAINER}"))));
    }

    #[test]
    fn limits_are_written_for_cgroup_v1_and_v2() {
        let spec = kernel_spec();
        let v1 = config("s1", &spec, &image(), Cgroups::V1).expect("config");
        let r = &v1["linux"]["resources"];
        assert_eq!(r["memory"]["limit"], 1024u64 * 1024 * 1024);
        assert_eq!(r["memory"]["swap"], r["memory"]["limit"], "no swap");
        assert_eq!(r["cpu"]["quota"], 150_000);
        assert_eq!(r["cpu"]["period"], 100_000);
        assert_eq!(r["pids"]["limit"], 256);
        assert!(r.get("unified").is_none());
        assert_eq!(v1["linux"]["cgroupsPath"], "/kernelgate/s1");
        let v2 = config("s1", &spec, &image(), Cgroups::V2).expect("config");
        let u = &v2["linux"]["resources"]["unified"];
        assert_eq!(u["memory.max"], "1073741824");
        assert_eq!(u["memory.swap.max"], "0");
        assert_eq!(u["cpu.max"], "150000 100000");
        assert_eq!(u["pids.max"], "256");
    }

    #[test]
    fn what_runs_is_the_images_launcher_with_the_images_env_and_the_requests() {
        let mut spec = kernel_spec();
        spec.env.push(("HOME".to_owned(), "/elsewhere".to_owned()));
        let c = config("s1", &spec, &image(), Cgroups::V1).expect("config");
        assert_eq!(
            c["process"]["args"],
            json!([
                "/usr/bin/tini",
                "-g",
                "--",
                "python",
                "/opt/kernel/launch.py"
            ])
        );
        assert_eq!(
            c["process"]["env"],
            json!([
                "PATH=/usr/bin",
                "HOME=/elsewhere",
                "KERNEL_A=x=y",
                "HOSTNAME=kernel"
            ])
        );
        assert_eq!(c["process"]["cwd"], "/home/kernel");
        spec.command = Command::Filtered(vec!["echo".to_owned(), "hi".to_owned()]);
        spec.workdir = Some("/".to_owned());
        let c = config("s1", &spec, &image(), Cgroups::V1).expect("config");
        assert_eq!(
            c["process"]["args"],
            json!([
                "/usr/bin/tini",
                "-g",
                "--",
                "python",
                "/opt/kernel/launch.py",
                "--exec",
                "echo",
                "hi"
            ])
        );
        assert_eq!(c["process"]["cwd"], "/");
        let bare = ResolvedImage {
            cmd: Vec::new(),
            ..image()
        };
        assert!(config("s1", &spec, &bare, Cgroups::V1).is_err());
    }
}
