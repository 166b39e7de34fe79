//! Where the engine's sandboxes get their cgroups (`--cgroup-parent`): `/kernelgate` of
//! each hierarchy by default, any other absolute path, or `sibling`: beside the gateway's
//! own cgroup (read from `/proc/self/cgroup`), so that a gateway in a container (a
//! Kubernetes pod) keeps its kernels out of its container's cgroup. There a surge of the
//! kernels' memory is not charged to the gateway's container, whose limit would otherwise
//! make the gateway a candidate for the out-of-memory killer, and stopping the container
//! (which kills every process of its cgroup when it shares the host's PID namespace) leaves
//! the kernels running for the next gateway.
//!
//! runsc always places a sandbox under `/sys/fs/cgroup/<controller>/<path>`, so `sibling`
//! needs each controller's whole hierarchy mounted there: a container runtime mounts only
//! the container's own cgroup, which the gateway image's entrypoint replaces
//! (`deploy/image/gvisor-entrypoint.sh`). The choice is the process's: one gateway, one
//! parent, set once at start before any sandbox is made.

use super::oci::Cgroups;
use std::sync::OnceLock;

/// The parent when none is chosen.
pub const DEFAULT: &str = "/kernelgate";

/// The name of the cgroup `sibling` makes beside the gateway's own.
pub const SIBLING_NAME: &str = "kernelgate";

static CHOSEN: OnceLock<String> = OnceLock::new();

/// The parent cgroup of every sandbox (absolute, without a trailing `/`).
pub fn get() -> &'static str {
    CHOSEN.get().map_or(DEFAULT, String::as_str)
}

/// Sets the parent `--cgroup-parent` names (`sibling` or an absolute path), reading this
/// process's cgroup and mounts for `sibling`. Once per process, before any sandbox.
pub fn choose(choice: &str, cgroups: Cgroups) -> Result<&'static str, String> {
    let parent = if choice == "sibling" {
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
        let parent = sibling(&own, cgroups)?;
        whole_hierarchy(&mounts, cgroups)?;
        parent
    } else {
        checked(choice)?
    };
    let chosen = CHOSEN.get_or_init(|| parent.clone());
    if *chosen != parent {
        return Err(format!(
            "the sandboxes' cgroup parent is {chosen} already; cannot make it {parent}"
        ));
    }
    Ok(chosen.as_str())
}

/// An absolute cgroup path of plain names, without `.`/`..` or a trailing `/`.
pub fn checked(path: &str) -> Result<String, String> {
    let names: Vec<&str> = path.split('/').skip(1).collect();
    let plain = |n: &&str| !n.is_empty() && *n != "." && *n != ".." && !n.contains('\0');
    if !path.starts_with('/') || names.is_empty() || !names.iter().all(plain) {
        return Err(format!(
            "--cgroup-parent {path:?}: give `sibling` or an absolute cgroup path such as /kernelgate"
        ));
    }
    Ok(path.to_owned())
}

/// The gateway's own cgroup in the hierarchy that limits memory (v1: the `memory`
/// controller's line of `/proc/self/cgroup`; v2: the unified `0::` line).
pub fn own_cgroup(proc_self_cgroup: &str, cgroups: Cgroups) -> Option<&str> {
    proc_self_cgroup.lines().find_map(|line| {
        let mut fields = line.splitn(3, ':');
        let (id, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        let wanted = match cgroups {
            Cgroups::V1 => controllers.split(',').any(|c| c == "memory"),
            Cgroups::V2 => id == "0" && controllers.is_empty(),
        };
        wanted.then_some(path)
    })
}

/// `<parent of the gateway's cgroup>/kernelgate`: `/docker/<id>` gives `/docker/kernelgate`,
/// a pod's container cgroup gives `<pod cgroup>/kernelgate`.
pub fn sibling(proc_self_cgroup: &str, cgroups: Cgroups) -> Result<String, String> {
    let own = own_cgroup(proc_self_cgroup, cgroups)
        .ok_or("--cgroup-parent sibling: /proc/self/cgroup names no memory cgroup")?;
    let own = own.trim_end_matches('/');
    let Some((parent, _)) = own.rsplit_once('/').filter(|_| !own.is_empty()) else {
        return Err(format!(
            "--cgroup-parent sibling: the gateway's cgroup is the root of its hierarchy \
             ({own:?}, as inside a cgroup namespace): it has no sibling; name a path instead"
        ));
    };
    checked(&format!("{parent}/{SIBLING_NAME}"))
}

/// Refuses `sibling` when `/sys/fs/cgroup` shows only a part of a hierarchy (what a
/// container runtime mounts: the container's own cgroup as the mount's root), where runsc
/// would put the sandboxes inside the gateway's own cgroup instead.
pub fn whole_hierarchy(mountinfo: &str, cgroups: Cgroups) -> Result<(), String> {
    let (point, fs) = match cgroups {
        Cgroups::V1 => ("/sys/fs/cgroup/memory", "cgroup"),
        Cgroups::V2 => ("/sys/fs/cgroup", "cgroup2"),
    };
    // mountinfo: id parent major:minor root mount-point options ... - fstype source ...
    let root = mountinfo.lines().rev().find_map(|line| {
        let (mount, rest) = line.split_once(" - ")?;
        let fields: Vec<&str> = mount.split(' ').collect();
        (fields.get(4) == Some(&point) && rest.split(' ').next() == Some(fs)).then(|| fields[3])
    });
    match root {
        Some("/") => Ok(()),
        Some(root) => Err(format!(
            "--cgroup-parent sibling: {point} shows only the cgroup {root}, not the whole \
             hierarchy, so sandboxes would land inside the gateway's own cgroup; mount the \
             hierarchy there first (the gateway image's entrypoint does: \
             deploy/image/gvisor-entrypoint.sh)"
        )),
        None => Err(format!(
            "--cgroup-parent sibling: no {fs} mount at {point} in /proc/self/mountinfo"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IN_DOCKER: &str = "9:name=systemd:/docker/abc\n4:memory:/docker/abc\n1:cpu,cpuacct:/docker/abc\n0::/docker/abc\n";
    const IN_POD: &str = "5:memory:/kubepods/burstable/pod7f/c0ffee\n0::/\n";

    #[test]
    fn a_sibling_is_beside_the_gateways_own_cgroup() {
        assert_eq!(
            sibling(IN_DOCKER, Cgroups::V1),
            Ok("/docker/kernelgate".into())
        );
        assert_eq!(
            sibling(IN_POD, Cgroups::V1),
            Ok("/kubepods/burstable/pod7f/kernelgate".into())
        );
        assert_eq!(
            sibling(IN_DOCKER, Cgroups::V2),
            Ok("/docker/kernelgate".into())
        );
        assert_eq!(
            sibling("0::/system.slice/kernelgate.service\n", Cgroups::V2),
            Ok("/system.slice/kernelgate".into())
        );
        assert_eq!(
            sibling("4:memory:/top\n", Cgroups::V1),
            Ok("/kernelgate".into())
        );
        let root = sibling(IN_POD, Cgroups::V2).expect_err("a cgroup namespace's root");
        assert!(root.contains("has no sibling"), "{root}");
        let none = sibling("1:cpu:/a\n", Cgroups::V1).expect_err("no memory line");
        assert!(none.contains("no memory cgroup"), "{none}");
    }

    #[test]
    fn only_plain_absolute_paths_are_taken() {
        assert_eq!(checked("/kernelgate"), Ok("/kernelgate".into()));
        assert_eq!(checked("/a/b"), Ok("/a/b".into()));
        for bad in ["kernelgate", "/", "/a/", "/a/../b", "/a//b", "/./a", ""] {
            assert!(checked(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_container_runtimes_partial_cgroup_mount_is_refused() {
        let partial =
            "234 230 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n";
        let err = whole_hierarchy(partial, Cgroups::V1).expect_err("partial");
        assert!(err.contains("shows only the cgroup /docker/abc"), "{err}");
        // The whole hierarchy mounted over it (the later line wins).
        let whole =
            format!("{partial}48 230 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n");
        assert_eq!(whole_hierarchy(&whole, Cgroups::V1), Ok(()));
        let v2 = "30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(whole_hierarchy(v2, Cgroups::V2), Ok(()));
        assert!(whole_hierarchy(v2, Cgroups::V1).is_err());
    }
}
