//! What a sandbox is made of, in words no engine owns: the image, what runs, mounts,
//! environment, and the hardening every sandbox of the gateway gets (docs/security.md,
//! "The model"). Written once here; each engine translates it (Docker:
//! `docker/spec.rs`), so a kernel, a one-shot run for `packages sync` and whatever a
//! later engine starts are locked down alike.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// The uid and gid kernels (and the gateway's commands in their sandboxes) run as.
pub const KERNEL_UID: u32 = 1000;
pub const KERNEL_GID: u32 = 1000;

/// The kernel's home and working directory inside the sandbox (a size-limited tmpfs).
pub const KERNEL_HOME: &str = "/home/kernel";

/// The isolation a sandbox wants, whichever engine provides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    /// Namespaces, cgroups and seccomp on the host's Linux kernel (runc and the like).
    RuncLike,
    /// gVisor: a user-space kernel between the sandbox and the host's.
    Gvisor,
}

/// Resources a sandbox may use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Memory, and memory plus swap (no swap beyond it).
    pub memory_mb: u64,
    pub cpus: f64,
    /// Processes and threads.
    pub pids: i64,
    /// Open files per process.
    pub nofile: i64,
}

/// Open files per kernel process: ample for analyses, bounded for everything else.
pub const NOFILE: i64 = 4096;

/// A size-limited in-memory filesystem (never executable, no set-uid, no devices).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tmpfs {
    pub path: String,
    pub size_mb: u64,
    /// Owner `(uid, gid)` of its root; `None`: root's.
    pub owner: Option<(u32, u32)>,
    pub mode: u32,
}

/// The locked-down shape of every sandbox: built only by [`Hardening::new`], which sets
/// what is never negotiable (no capabilities, no new privileges, read-only root, no
/// network, the launcher's syscall filter, no core files); callers choose only the user,
/// the limits and the scratch space.
#[derive(Debug, Clone, PartialEq)]
pub struct Hardening {
    pub isolation: Isolation,
    /// `(uid, gid)`; never root unless a caller asks for a host directory's owner.
    pub user: (u32, u32),
    /// One more group, e.g. the gateway's, for its socket directory.
    pub group_add: Option<u32>,
    pub limits: Limits,
    pub tmpfs: Vec<Tmpfs>,
    /// Every capability dropped.
    pub drop_all_capabilities: bool,
    /// `no_new_privileges`: set-uid binaries and file capabilities grant nothing.
    pub no_new_privileges: bool,
    pub read_only_root: bool,
    /// No network interface beyond loopback.
    pub no_network: bool,
    /// The engine's default syscall profile stays under the launcher's own filter.
    pub engine_seccomp: bool,
    /// What runs is started by the image's launcher, which installs its syscall filter
    /// first (the kernel, and commands in the launcher's exec mode).
    pub launcher_filter: bool,
    /// Core files: none (a crash must not write one the size of its memory).
    pub core_files: bool,
}

impl Hardening {
    /// The hardening of every sandbox: the kernel's user, the given limits, a 64 MiB
    /// `/tmp`.
    pub fn new(isolation: Isolation, limits: Limits) -> Self {
        Hardening {
            isolation,
            user: (KERNEL_UID, KERNEL_GID),
            group_add: None,
            limits,
            tmpfs: vec![Tmpfs {
                path: "/tmp".to_owned(),
                size_mb: 64,
                owner: None,
                mode: 0o1777,
            }],
            drop_all_capabilities: true,
            no_new_privileges: true,
            read_only_root: true,
            no_network: true,
            engine_seccomp: true,
            launcher_filter: true,
            core_files: false,
        }
    }

    /// A kernel's: its home is a tmpfs of `disk_mb` owned by the kernel's user.
    pub fn kernel(isolation: Isolation, limits: Limits, disk_mb: u64) -> Self {
        let mut hardening = Hardening::new(isolation, limits);
        hardening.tmpfs.push(Tmpfs {
            path: KERNEL_HOME.to_owned(),
            size_mb: disk_mb,
            owner: Some((KERNEL_UID, KERNEL_GID)),
            mode: 0o700,
        });
        hardening
    }

    /// Runs as `(uid, gid)` instead of the kernel's user (a host directory's owner).
    pub fn with_user(mut self, user: (u32, u32)) -> Self {
        self.user = user;
        self
    }

    /// The user as engines write it: `uid:gid`.
    pub fn user_spec(&self) -> String {
        format!("{}:{}", self.user.0, self.user.1)
    }
}

/// A host directory in the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub host: PathBuf,
    pub sandbox: String,
    pub writable: bool,
}

impl Mount {
    pub fn read_only(host: impl Into<PathBuf>, sandbox: &str) -> Self {
        Mount {
            host: host.into(),
            sandbox: sandbox.to_owned(),
            writable: false,
        }
    }

    pub fn writable(host: impl Into<PathBuf>, sandbox: &str) -> Self {
        Mount {
            host: host.into(),
            sandbox: sandbox.to_owned(),
            writable: true,
        }
    }
}

/// What runs in a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// The image's own command: the launcher, which starts the kernel under its filter.
    Image,
    /// `argv`, started by the image's launcher in its exec mode: the filter is installed,
    /// then `argv` replaces the launcher (kernel-image/launch.py `--exec`).
    Filtered(Vec<String>),
}

/// Everything one sandbox is created with.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxSpec {
    /// A name operators find it by, when the engine has names.
    pub name: Option<String>,
    pub image: String,
    pub command: Command,
    pub hardening: Hardening,
    pub mounts: Vec<Mount>,
    pub env: Vec<(String, String)>,
    /// What finds it again (an engine without labels keeps them in its own record).
    pub labels: BTreeMap<String, String>,
    pub hostname: Option<String>,
    /// Working directory of what runs; `None`: the image's.
    pub workdir: Option<String>,
}

impl SandboxSpec {
    pub fn new(image: &str, command: Command, hardening: Hardening) -> Self {
        SandboxSpec {
            name: None,
            image: image.to_owned(),
            command,
            hardening,
            mounts: Vec::new(),
            env: Vec::new(),
            labels: BTreeMap::new(),
            hostname: None,
            workdir: None,
        }
    }
}

/// A command run once in a throwaway sandbox of an image, with host directories bound in
/// (`packages sync` probes the image's Python and compiles what it unpacked). The
/// sandbox has the kernels' hardening and isolation; it is removed whatever happens.
#[derive(Debug, Clone, PartialEq)]
pub struct RunOnce {
    pub image: String,
    pub argv: Vec<String>,
    /// Runs as this `(uid, gid)` instead of the kernel's user.
    pub user: Option<(u32, u32)>,
    pub mounts: Vec<Mount>,
    pub limits: Limits,
    pub timeout: std::time::Duration,
    /// Output kept at most, per stream.
    pub max_output: usize,
}

impl RunOnce {
    /// Limits of a one-shot run: enough for pip's and compileall's work.
    pub const LIMITS: Limits = Limits {
        memory_mb: 512,
        cpus: 1.0,
        pids: 64,
        nofile: NOFILE,
    };

    /// The sandbox it runs in, under `isolation`: the kernels' hardening, the image's
    /// launcher filter, working directory `/`, no labels.
    pub fn sandbox(&self, isolation: Isolation) -> SandboxSpec {
        let mut hardening = Hardening::new(isolation, self.limits);
        if let Some(user) = self.user {
            hardening = hardening.with_user(user);
        }
        let mut spec =
            SandboxSpec::new(&self.image, Command::Filtered(self.argv.clone()), hardening);
        spec.mounts = self.mounts.clone();
        spec.workdir = Some("/".to_owned());
        spec
    }
}

/// What a one-shot run printed and how it ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunOutput {
    pub exit_code: i64,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sandbox_is_hardened_whatever_the_caller_chooses() {
        let limits = RunOnce::LIMITS;
        for h in [
            Hardening::new(Isolation::Gvisor, limits),
            Hardening::kernel(Isolation::RuncLike, limits, 512),
            Hardening::new(Isolation::RuncLike, limits).with_user((0, 0)),
        ] {
            assert!(h.drop_all_capabilities && h.no_new_privileges && h.read_only_root);
            assert!(h.no_network && h.engine_seccomp && h.launcher_filter);
            assert!(!h.core_files);
        }
        let kernel = Hardening::kernel(Isolation::RuncLike, limits, 512);
        assert_eq!(kernel.user_spec(), "1000:1000");
        assert_eq!(kernel.tmpfs[1].path, KERNEL_HOME);
        assert_eq!(kernel.tmpfs[1].size_mb, 512);
    }

    #[test]
    fn a_one_shot_run_goes_through_the_launchers_filter_from_the_root() {
        let run = RunOnce {
            image: "img".to_owned(),
            argv: vec!["python3".to_owned(), "-c".to_owned(), "pass".to_owned()],
            user: Some((7, 8)),
            mounts: vec![Mount::writable("/srv/w", "/wheelhouse")],
            limits: RunOnce::LIMITS,
            timeout: std::time::Duration::from_secs(1),
            max_output: 1024,
        };
        let spec = run.sandbox(Isolation::Gvisor);
        assert_eq!(spec.command, Command::Filtered(run.argv.clone()));
        assert_eq!(spec.hardening.user, (7, 8));
        assert_eq!(spec.hardening.isolation, Isolation::Gvisor);
        assert_eq!(spec.workdir.as_deref(), Some("/"));
        assert!(spec.labels.is_empty());
    }
}
