//! The per-kernel socket directory on the host: `<runtime_dir>/<kernel_id>`, bind-mounted at
//! `/run/kernel` in the container. Holds `kernel.json` and the kernel's five Unix sockets.
//!
//! Permissions contract with the kernel image: the kernel runs as uid 1000 / gid 1000 with
//! umask 0007. The directory is setgid and group-owned by the gateway's group, so the sockets
//! the kernel creates (`srwxrwx---`) are connectable by the gateway (zmq hides EACCES: a
//! socket the gateway may not open looks like a kernel that never answers).

use std::fs::{self, DirBuilder, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The uid and gid the kernel process runs as (fixed by the image).
pub const KERNEL_UID: u32 = 1000;
/// The kernel's own group (fixed by the image).
pub const KERNEL_GID: u32 = 1000;
/// Where the socket directory appears inside the container.
pub const CONTAINER_DIR: &str = "/run/kernel";
/// Name of the connection file in the socket directory.
pub const CONNECTION_FILE: &str = "kernel.json";
/// Socket path prefix (`ip` of the connection file) relative to the socket directory:
/// sockets are `kernel-1` .. `kernel-5`.
pub const SOCKET_PREFIX: &str = "kernel";

/// What a kernel may store in its socket directory, in bytes and files: the directory is a
/// tmpfs of this size of its own, so a kernel writing there cannot fill the host's disk or
/// memory (the socket files and `kernel.json` need a few KiB).
pub const BUDGET_BYTES: u64 = 1024 * 1024;
pub const BUDGET_FILES: u64 = 64;

const RUNTIME_DIR_MODE: u32 = 0o711;
const SOCKET_DIR_MODE: u32 = 0o2770;
const CONNECTION_FILE_MODE: u32 = 0o640;

/// The effective user and group of this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ids {
    pub uid: u32,
    pub gid: u32,
}

impl Ids {
    /// Reads the effective ids from `/proc/self/status` (no libc: `unsafe` is forbidden).
    pub fn current() -> io::Result<Ids> {
        parse_proc_status(&fs::read_to_string("/proc/self/status")?).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "no Uid:/Gid: lines in /proc/self/status",
            )
        })
    }
}

/// `Uid:\treal\teffective\tsaved\tfs` (same for `Gid:`): the effective ids.
pub fn parse_proc_status(status: &str) -> Option<Ids> {
    let effective = |key: &str| -> Option<u32> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].split_whitespace().nth(1)?.parse().ok()
    };
    Some(Ids {
        uid: effective("Uid:")?,
        gid: effective("Gid:")?,
    })
}

/// Who owns the socket directory and its connection file, and what the container needs
/// to reach them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ownership {
    /// `chown` the directory and `kernel.json` to this (uid, gid); `None` leaves them owned
    /// by the gateway user.
    pub chown: Option<(u32, u32)>,
    /// Supplementary group for the container's user (`HostConfig.group_add`), so a kernel
    /// that does not own the directory can still write there.
    pub group_add: Option<u32>,
}

impl Ownership {
    /// Root may hand the directory to the kernel user and keep its own group on it; anyone
    /// else keeps ownership and lets the kernel in through the group.
    pub fn for_gateway(ids: Ids) -> Ownership {
        if ids.uid == 0 {
            Ownership {
                chown: Some((KERNEL_UID, ids.gid)),
                group_add: None,
            }
        } else {
            Ownership {
                chown: None,
                group_add: (ids.gid != KERNEL_GID).then_some(ids.gid),
            }
        }
    }
}

/// A kernel id that is safe as one path component (the gateway uses UUIDs; labels of
/// containers found at start-up are checked the same way before anything is deleted).
pub fn is_safe_kernel_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// `<runtime_dir>/<kernel_id>`, or `None` for an id that is not a plain path component.
pub fn path(runtime_dir: &Path, kernel_id: &str) -> Option<PathBuf> {
    is_safe_kernel_id(kernel_id).then(|| runtime_dir.join(kernel_id))
}

/// Creates the runtime directory (0711: others may traverse to their socket but not list)
/// and a fresh socket directory in it, and writes the connection file. On failure nothing
/// of the socket directory is left behind.
pub fn create(
    runtime_dir: &Path,
    dir: &Path,
    owner: &Ownership,
    connection_json: &[u8],
) -> io::Result<()> {
    if !runtime_dir.is_dir() {
        DirBuilder::new()
            .recursive(true)
            .mode(RUNTIME_DIR_MODE)
            .create(runtime_dir)?;
    }
    // Not recursive: an existing directory means a stale or foreign one; refuse it.
    DirBuilder::new().mode(0o700).create(dir)?;
    let filled = budget(dir, owner).and_then(|()| fill(dir, owner, connection_json));
    if filled.is_err() {
        let _ = remove(dir);
    }
    filled
}

/// Mounts the directory's own small tmpfs. Only root can; a gateway running as a member of
/// the `docker` group leaves the directory on the host's filesystem (docs/security.md says so).
fn budget(dir: &Path, owner: &Ownership) -> io::Result<()> {
    if owner.chown.is_none() {
        return Ok(());
    }
    // nosymfollow: a symlink the kernel leaves there leads nowhere, for the gateway too
    // (ZeroMQ reconnects to a socket by its path).
    let options = format!(
        "size={BUDGET_BYTES},nr_inodes={BUDGET_FILES},mode=0700,nosuid,nodev,noexec,nosymfollow"
    );
    let out = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", &options, "kernelgate-sockets"])
        .arg(dir)
        .output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "mount of the socket directory's tmpfs failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// True when `dir` is a mount point (its device differs from its parent's).
fn is_mount_point(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(own), Some(Ok(parent))) = (
        fs::symlink_metadata(dir),
        dir.parent().map(fs::symlink_metadata),
    ) else {
        return false;
    };
    own.is_dir() && own.dev() != parent.dev()
}

fn fill(dir: &Path, owner: &Ownership, connection_json: &[u8]) -> io::Result<()> {
    let file = dir.join(CONNECTION_FILE);
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&file)?;
    f.write_all(connection_json)?;
    f.sync_all()?;
    drop(f);
    if let Some((uid, gid)) = owner.chown {
        std::os::unix::fs::chown(&file, Some(uid), Some(gid))?;
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))?;
    }
    // After chown (which may clear set-id bits) and explicitly (mkdir ignores S_ISGID and
    // the umask may narrow the mode).
    fs::set_permissions(&file, fs::Permissions::from_mode(CONNECTION_FILE_MODE))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(SOCKET_DIR_MODE))?;
    Ok(())
}

/// Largest connection file the gateway reads back.
const MAX_CONNECTION_FILE: u64 = 64 * 1024;
/// `O_NONBLOCK` (the same on every Linux architecture): opening a FIFO the kernel put in
/// place of the file must not block the gateway.
const O_NONBLOCK: i32 = 0o4000;

/// A new kernel's socket directory, made with its connection file in it.
pub struct Prepared {
    pub dir: PathBuf,
    /// `dir` as text (checked to be UTF-8), as the engines' specs name it.
    pub dir_str: String,
    /// The connection as the gateway dials it: the sockets under `dir` on the host.
    pub outside: kernelgate_protocol::ConnectionInfo,
}

/// Makes kernel `kernel_id`'s socket directory under `runtime_dir` with a connection file
/// for the kernel (a fresh key, the sockets under [`CONTAINER_DIR`] as the kernel sees
/// them), after checking that the host's socket paths fit a Unix socket's limit: a
/// too-long runtime directory would make the gateway dial nothing.
pub fn prepare(
    runtime_dir: &Path,
    kernel_id: &str,
    kernel_name: &str,
    ownership: &Ownership,
) -> Result<Prepared, crate::backend::BackendError> {
    use crate::backend::BackendError;
    use kernelgate_protocol::{ConnectionInfo, SigningKey};
    let dir = path(runtime_dir, kernel_id).ok_or_else(|| {
        BackendError::Runtime(format!("kernel id {kernel_id:?} is not a plain name"))
    })?;
    let dir_str = dir
        .to_str()
        .ok_or_else(|| BackendError::SocketDir {
            path: dir.display().to_string(),
            source: io::Error::new(io::ErrorKind::InvalidInput, "path is not UTF-8"),
        })?
        .to_owned();
    let inside = ConnectionInfo::ipc(
        &format!("{CONTAINER_DIR}/{SOCKET_PREFIX}"),
        SigningKey::generate_hex(),
        kernel_name,
    );
    let outside = inside.with_ip(&format!("{dir_str}/{SOCKET_PREFIX}"));
    outside.validate().map_err(|e| BackendError::SocketDir {
        path: dir_str.clone(),
        source: io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{e}; choose a shorter --runtime-dir"),
        ),
    })?;
    create(runtime_dir, &dir, ownership, &inside.to_json()).map_err(|source| {
        BackendError::SocketDir {
            path: dir_str.clone(),
            source,
        }
    })?;
    Ok(Prepared {
        dir,
        dir_str,
        outside,
    })
}

/// Reads the connection file back (to re-adopt a kernel after a restart of the gateway).
/// The kernel could have replaced it: anything but a small regular file is refused, and
/// neither a symlink nor a FIFO is followed or waited on.
pub fn read_connection(dir: &Path) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let path = dir.join(CONNECTION_FILE);
    let refuse = |what: &str| {
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is {what}, not the connection file the gateway wrote",
                path.display()
            ),
        ))
    };
    if !fs::symlink_metadata(&path)?.file_type().is_file() {
        return refuse("no regular file");
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(O_NONBLOCK)
        .open(&path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return refuse("no regular file");
    }
    if meta.len() > MAX_CONNECTION_FILE {
        return refuse("too large");
    }
    let mut bytes = Vec::new();
    file.take(MAX_CONNECTION_FILE).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Removes the kernel's socket files (`kernel-*`), keeping `kernel.json`, so that after a
/// restart nobody connects to a socket of the dead process.
pub fn remove_sockets(dir: &Path) -> io::Result<usize> {
    let prefix = format!("{SOCKET_PREFIX}-");
    let mut removed = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        if name.to_string_lossy().starts_with(&prefix) && !entry.file_type()?.is_dir() {
            match fs::remove_file(entry.path()) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(removed)
}

/// Removes the socket directory, and its tmpfs; a missing one is fine. Nothing the kernel
/// put there is followed: symlinks are removed as links.
pub fn remove(dir: &Path) -> io::Result<()> {
    if is_mount_point(dir) {
        let out = std::process::Command::new("umount").arg(dir).output()?;
        // Unmounted meanwhile by a second caller is no error.
        if !out.status.success() && is_mount_point(dir) {
            return Err(io::Error::other(format!(
                "umount of the socket directory failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
    }
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    const STATUS: &str = "Name:\tkernelgate\nUmask:\t0022\nState:\tS (sleeping)\n\
        Uid:\t1001\t1002\t1002\t1002\nGid:\t2001\t2002\t2002\t2002\nGroups:\t27 2002\n";

    #[test]
    fn reads_effective_ids_from_proc_status() {
        assert_eq!(
            parse_proc_status(STATUS),
            Some(Ids {
                uid: 1002,
                gid: 2002
            })
        );
        assert_eq!(parse_proc_status("Name:\tx\n"), None);
        assert!(Ids::current().is_ok());
    }

    #[test]
    fn root_hands_the_directory_to_the_kernel_user_and_keeps_its_group() {
        let own = Ownership::for_gateway(Ids { uid: 0, gid: 0 });
        assert_eq!(own.chown, Some((1000, 0)));
        assert_eq!(own.group_add, None);
    }

    #[test]
    fn a_non_root_gateway_lets_the_kernel_in_through_its_group() {
        let own = Ownership::for_gateway(Ids {
            uid: 1234,
            gid: 998,
        });
        assert_eq!(own.chown, None);
        assert_eq!(own.group_add, Some(998));
        // Sharing the kernel's own group: nothing to add.
        let own = Ownership::for_gateway(Ids {
            uid: 1234,
            gid: 1000,
        });
        assert_eq!(own.group_add, None);
    }

    #[test]
    fn kernel_ids_must_be_one_plain_path_component() {
        assert!(is_safe_kernel_id("0b9c1a52-3f8e-4c59-9a8e-0d2f5a7d6c11"));
        for bad in ["", "..", "../etc", "a/b", "a b", ".", "x\0"] {
            assert!(!is_safe_kernel_id(bad), "{bad:?}");
            assert_eq!(path(Path::new("/run/kernelgate"), bad), None);
        }
        assert_eq!(
            path(Path::new("/run/kernelgate"), "k1"),
            Some(PathBuf::from("/run/kernelgate/k1"))
        );
    }

    fn scratch(name: &str) -> PathBuf {
        let base = std::env::temp_dir().join(format!(
            "kernelgate-socket-dir-{name}-{}",
            uuid::Uuid::new_v4().simple()
        ));
        let _ = fs::remove_dir_all(&base);
        base
    }

    #[test]
    fn creates_setgid_directory_and_private_connection_file() {
        let base = scratch("create");
        let runtime = base.join("runtime");
        let dir = runtime.join("k1");
        let ids = Ids::current().expect("ids");
        // Only root may chown; elsewhere check the non-root plan.
        let own = Ownership::for_gateway(ids);
        create(&runtime, &dir, &own, b"{}").expect("create");

        let rmeta = fs::metadata(&runtime).expect("runtime meta");
        assert_eq!(rmeta.mode() & 0o7777, 0o711);
        let dmeta = fs::metadata(&dir).expect("dir meta");
        assert_eq!(dmeta.mode() & 0o7777, 0o2770);
        let fmeta = fs::metadata(dir.join(CONNECTION_FILE)).expect("file meta");
        assert_eq!(fmeta.mode() & 0o7777, 0o640);
        assert_eq!(fs::read(dir.join(CONNECTION_FILE)).expect("read"), b"{}");
        if ids.uid == 0 {
            assert_eq!((dmeta.uid(), dmeta.gid()), (KERNEL_UID, ids.gid));
            assert_eq!((fmeta.uid(), fmeta.gid()), (KERNEL_UID, ids.gid));
        } else {
            assert_eq!((dmeta.uid(), dmeta.gid()), (ids.uid, ids.gid));
        }

        // As root, the directory is a small tmpfs of its own.
        let mounts = fs::read_to_string("/proc/self/mounts").expect("mounts");
        let mounted = mounts
            .lines()
            .find(|l| l.split(' ').nth(1) == Some(&*dir.to_string_lossy()));
        if ids.uid == 0 {
            let line = mounted.expect("a tmpfs on the socket directory");
            assert!(
                line.starts_with("kernelgate-sockets ") && line.contains("size=1024k"),
                "{line}"
            );
            assert!(
                line.contains("nr_inodes=64") && line.contains("noexec"),
                "{line}"
            );
            assert!(line.contains("nosymfollow"), "{line}");
        }

        // A second kernel with the same id is refused, and the first one is left alone.
        assert!(create(&runtime, &dir, &own, b"{}").is_err());
        assert!(dir.join(CONNECTION_FILE).exists());

        remove(&dir).expect("remove");
        assert!(!dir.exists());
        let mounts = fs::read_to_string("/proc/self/mounts").expect("mounts");
        assert!(!mounts.contains(&*dir.to_string_lossy()), "unmounted");
        fs::remove_dir_all(&base).expect("cleanup");
    }

    #[test]
    fn a_replaced_connection_file_is_refused() {
        let base = scratch("read");
        fs::create_dir_all(&base).expect("mkdir");
        fs::write(base.join(CONNECTION_FILE), b"{\"a\": 1}").expect("write");
        assert_eq!(read_connection(&base).expect("read"), b"{\"a\": 1}");
        fs::remove_file(base.join(CONNECTION_FILE)).expect("rm");
        std::os::unix::fs::symlink("/etc/passwd", base.join(CONNECTION_FILE)).expect("ln");
        assert!(read_connection(&base).is_err(), "a symlink is not followed");
        fs::remove_file(base.join(CONNECTION_FILE)).expect("rm");
        let made = std::process::Command::new("mkfifo")
            .arg(base.join(CONNECTION_FILE))
            .status()
            .expect("mkfifo");
        assert!(made.success());
        assert!(
            read_connection(&base).is_err(),
            "a FIFO is refused, not waited on"
        );
        fs::remove_file(base.join(CONNECTION_FILE)).expect("rm");
        fs::write(base.join(CONNECTION_FILE), vec![b' '; 70_000]).expect("write");
        assert!(read_connection(&base).is_err(), "too large");
        fs::remove_dir_all(&base).expect("cleanup");
    }

    #[test]
    fn removes_only_sockets_then_everything() {
        let base = scratch("remove");
        fs::create_dir_all(&base).expect("mkdir");
        for name in ["kernel.json", "kernel-1", "kernel-5", "notes"] {
            fs::write(base.join(name), b"").expect("write");
        }
        assert_eq!(remove_sockets(&base).expect("remove sockets"), 2);
        let mut left: Vec<_> = fs::read_dir(&base)
            .expect("read_dir")
            .map(|e| e.expect("entry").file_name().into_string().expect("utf8"))
            .collect();
        left.sort();
        assert_eq!(left, ["kernel.json", "notes"]);

        remove(&base).expect("remove");
        assert!(!base.exists());
        remove(&base).expect("removing twice is fine");
    }
}
