//! Whole kernels saved and brought back (lossless hibernation, docs/engines.md): a kernel
//! whose image runs the relay launcher (`org.kernelgate.relay=1`) binds its sockets on the
//! sandbox's own tmpfs, and relay threads bridge them to the host's socket directory. To
//! checkpoint, the relays close their host sockets (SIGUSR1 to the launcher), the gateway
//! checks that nothing of the sandbox is bound on the host any more (runsc cannot save a
//! bound host socket, and a sandbox it fails to save is dead), and `runsc checkpoint`
//! writes the image and stops the sandbox. A restore makes a new socket directory with a
//! new key, restores a sandbox of the same spec from the image and tells the launcher
//! (SIGUSR2) to take the new key and bind again.

use super::bundle::{self, Written};
use super::GvisorEngine;
use crate::backend::docker::socket_dir;
use crate::backend::{BackendError, ExecRequest, LaunchRequest, Launched};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::{Duration, Instant};

/// The image label saying its launcher has the relays.
pub const RELAY_LABEL: &str = "org.kernelgate.relay";
/// The environment that turns them on.
pub const RELAY_ENV: &str = "KERNELGATE_RELAY";
/// The file, in the socket directory, where the launcher writes its pid (in the sandbox).
const RELAY_PID_FILE: &str = "relay.pid";
/// What the engine records beside a checkpoint's image.
pub const CHECKPOINT_FILE: &str = "checkpoint.json";
/// How long the relays may take to close or open their host sockets after a signal, and
/// how many signals they get.
const SIGNAL_WAIT: Duration = Duration::from_secs(2);
const SIGNAL_TRIES: u32 = 4;
/// The host sockets of a kernel's relays: shell, iopub, stdin, control, heartbeat.
const RELAY_SOCKETS: usize = 5;
/// How long `runsc checkpoint` and `runsc restore` may take.
const CHECKPOINT_TIMEOUT: Duration = Duration::from_secs(300);
const RESTORE_TIMEOUT: Duration = Duration::from_secs(120);
/// How long reading the sandbox's listening sockets may take.
const LISTENERS_TIMEOUT: Duration = Duration::from_secs(30);

/// A checkpoint's record: what restores it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Checkpointed {
    /// `runsc --version` of the binary that wrote it.
    pub runsc: String,
    pub image: String,
    pub image_id: String,
    /// The launcher's pid inside the sandbox (the same after a restore).
    pub relay_pid: u32,
}

/// The socket files left in a kernel's socket directory: each is bound, or was, on the
/// host.
fn sockets_in(dir: &Path) -> Vec<String> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    found.sort();
    found
}

/// The local ports of the sockets in state LISTEN (`0A`) of `/proc/net/tcp` text.
fn listening_ports(text: &str) -> Vec<u16> {
    let mut ports: Vec<u16> = text
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (local, state) = (fields.get(1)?, fields.get(3)?);
            if *state != "0A" {
                return None;
            }
            u16::from_str_radix(local.rsplit(':').next()?, 16).ok()
        })
        .collect();
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// Whether `name` is one of the relays' own sockets (`kernel-<port>`).
fn is_relay_socket(name: &str) -> bool {
    name.strip_prefix(socket_dir::SOCKET_PREFIX)
        .and_then(|rest| rest.strip_prefix('-'))
        .is_some_and(|port| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()))
}

/// Why a kernel holding `sockets` on the host cannot be checkpointed.
fn held_sockets(sockets: &[String]) -> String {
    let names = sockets
        .iter()
        .map(|n| format!("{}/{n}", socket_dir::CONTAINER_DIR))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "the kernel holds a Unix socket on the host ({names}: a process of the kernel bound it in its socket directory); a whole-kernel checkpoint cannot keep it, and runsc would stop the kernel trying. Close it and delete the file, then hibernate again"
    )
}

/// Whether the kernel of socket directory `dir` runs the relays (its launcher wrote its
/// pid there).
pub fn relays_serve(dir: &Path) -> bool {
    dir.join(RELAY_PID_FILE).is_file()
}

/// The relay launcher's pid as it wrote it into `dir`.
fn relay_pid(dir: &Path) -> Result<u32, BackendError> {
    let text = std::fs::read_to_string(dir.join(RELAY_PID_FILE)).map_err(|e| {
        BackendError::NotSupported {
            what: "memory checkpoints of a kernel whose launcher runs no relays",
            engine: if e.kind() == std::io::ErrorKind::NotFound {
                "gvisor"
            } else {
                "gvisor (its relay.pid is unreadable)"
            },
        }
    })?;
    text.trim()
        .parse::<u32>()
        .ok()
        .filter(|pid| *pid > 1)
        .ok_or_else(|| BackendError::Runtime(format!("{RELAY_PID_FILE} holds no pid")))
}

impl GvisorEngine {
    /// Whether kernels of `image` get the relays (and so can be checkpointed).
    pub(super) fn relays_for(&self, image: &str) -> bool {
        (self.resolve)(image)
            .is_ok_and(|i| i.labels.get(RELAY_LABEL).map(String::as_str) == Some("1"))
    }

    /// Saves kernel `handle` whole into `image` and stops its sandbox, or with
    /// `leave_running` (a snapshot) lets it go on: its relays serve again under the same key.
    /// Refused, with the kernel left running, when something of it is bound on the host.
    pub(super) async fn checkpoint_inner(
        &self,
        handle: &str,
        image: &Path,
        leave_running: bool,
    ) -> Result<(), BackendError> {
        let meta = self.read_meta(handle)?;
        let dir = meta.socket_dir.clone().ok_or(BackendError::NotSupported {
            what: "memory checkpoints of a sandbox that is no kernel",
            engine: "gvisor",
        })?;
        let pid = relay_pid(&dir)?;
        let runsc_version = self.runsc.version().await?;
        let foreign: Vec<String> = sockets_in(&dir)
            .into_iter()
            .filter(|name| !is_relay_socket(name))
            .collect();
        if !foreign.is_empty() {
            return Err(BackendError::Refused(held_sockets(&foreign)));
        }
        let listening = self.tcp_listeners(handle).await?;
        if !listening.is_empty() {
            let ports: Vec<String> = listening.iter().map(u16::to_string).collect();
            return Err(BackendError::Refused(format!(
                "the kernel listens on TCP port {} (a server started in it); runsc cannot save a listening socket, and would stop the kernel trying. Stop the server, then hibernate again",
                ports.join(", ")
            )));
        }
        let mut left = Vec::new();
        for _ in 0..SIGNAL_TRIES {
            self.runsc.kill_pid(handle, pid, "USR1").await?;
            let deadline = Instant::now() + SIGNAL_WAIT;
            left = sockets_in(&dir);
            while !left.is_empty() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
                left = sockets_in(&dir);
            }
            if left.is_empty() {
                break;
            }
        }
        if !left.is_empty() {
            self.serve_again(handle, pid, &dir).await;
            return Err(BackendError::Runtime(format!(
                "the kernel's relays did not close their host sockets within {} s ({}); the kernel runs on",
                (SIGNAL_WAIT * SIGNAL_TRIES).as_secs(),
                left.join(", ")
            )));
        }
        std::fs::create_dir_all(image).map_err(|e| bundle::io_error(image, e))?;
        if let Err(e) = self
            .runsc
            .checkpoint(handle, image, leave_running, CHECKPOINT_TIMEOUT)
            .await
        {
            if self.running(handle).await.unwrap_or(false) {
                self.serve_again(handle, pid, &dir).await;
                return Err(BackendError::Runtime(format!(
                    "the checkpoint failed and the kernel runs on: {e}"
                )));
            }
            return Err(BackendError::Died(format!(
                "the kernel's checkpoint failed and stopped the kernel: {e}"
            )));
        }
        let record = Checkpointed {
            runsc: runsc_version,
            image: meta.image,
            image_id: meta.image_id,
            relay_pid: pid,
        };
        let path = image.join(CHECKPOINT_FILE);
        let json = serde_json::to_vec_pretty(&record).unwrap_or_default();
        let written = std::fs::write(&path, json).map_err(|e| bundle::io_error(&path, e));
        if leave_running {
            self.relays_up(handle, pid, &dir).await?;
        }
        written
    }

    /// The TCP ports something in the sandbox listens on (its own loopback: it has no
    /// other network), from its `/proc/net/tcp` and `tcp6`.
    async fn tcp_listeners(&self, handle: &str) -> Result<Vec<u16>, BackendError> {
        let argv = ["cat", "/proc/net/tcp", "/proc/net/tcp6"]
            .map(str::to_owned)
            .to_vec();
        let request = ExecRequest::new(argv, bytes::Bytes::new(), 1 << 20, LISTENERS_TIMEOUT);
        let out = self.exec_inner(handle, request).await?;
        Ok(listening_ports(&String::from_utf8_lossy(&out.stdout)))
    }

    /// Tells a restored kernel's relays (launcher `pid`) to take the new connection file
    /// in `dir`, until their five sockets are there (a signal is sent again each
    /// [`SIGNAL_WAIT`]: the launcher answers each once).
    async fn relays_up(&self, handle: &str, pid: u32, dir: &Path) -> Result<(), BackendError> {
        for _ in 0..SIGNAL_TRIES {
            self.runsc.kill_pid(handle, pid, "USR2").await?;
            let deadline = Instant::now() + SIGNAL_WAIT;
            while Instant::now() < deadline {
                let up = sockets_in(dir)
                    .iter()
                    .filter(|n| is_relay_socket(n))
                    .count();
                if up >= RELAY_SOCKETS {
                    return Ok(());
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        Err(BackendError::Runtime(format!(
            "the restored kernel's relays did not bind its sockets within {} s",
            (SIGNAL_WAIT * SIGNAL_TRIES).as_secs()
        )))
    }

    /// The relays bind their host sockets again.
    async fn serve_again(&self, handle: &str, pid: u32, dir: &Path) {
        if let Err(e) = self.relays_up(handle, pid, dir).await {
            tracing::warn!(sandbox = %handle, error = %e, "cannot tell a kernel's relays to serve again");
        }
    }

    /// A kernel for `req` from the checkpoint in `image`: a new socket directory and key,
    /// the sandbox restored, its relays told to take them. Refuses a checkpoint another
    /// runsc or another image wrote.
    pub(super) async fn restore_inner(
        &self,
        req: &LaunchRequest,
        image: &Path,
    ) -> Result<Launched, BackendError> {
        let path = image.join(CHECKPOINT_FILE);
        let record: Checkpointed = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| {
                BackendError::Runtime(format!("{} is missing or unreadable", path.display()))
            })?;
        let runsc_version = self.runsc.version().await?;
        if record.runsc != runsc_version {
            return Err(BackendError::Refused(format!(
                "the kernel was checkpointed by {:?}, and this gateway runs {:?} ({}), which cannot restore it; start the gateway with the runsc that wrote it (--runsc), or delete the kernel",
                record.runsc,
                runsc_version,
                self.settings.runsc.display()
            )));
        }
        let resolved = (self.resolve)(&req.image)?;
        if resolved.id != record.image_id {
            return Err(BackendError::Refused(format!(
                "the kernel was checkpointed in image {} ({}), which is now {}; a checkpoint restores only into the image that wrote it: import that image again, or delete the kernel",
                record.image, record.image_id, resolved.id
            )));
        }
        let (prepared, spec) = self.kernel_spec(req)?;
        let Written { handle, bundle } = match self.write_bundle(&spec, Some(prepared.dir.clone()))
        {
            Ok(written) => written,
            Err(e) => {
                let _ = socket_dir::remove(&prepared.dir);
                return Err(e);
            }
        };
        let (out, err) = bundle::output(&bundle, true);
        let restored = self
            .runsc
            .restore(
                &handle,
                &bundle,
                image,
                (&out, &err),
                &bundle::boot_log(&bundle),
                RESTORE_TIMEOUT,
            )
            .await;
        if let Err(e) = restored {
            let _ = self.remove_inner(&handle).await;
            return Err(e);
        }
        self.watch(&handle);
        if let Err(e) = self
            .relays_up(&handle, record.relay_pid, &prepared.dir)
            .await
        {
            let _ = self.remove_inner(&handle).await;
            return Err(e);
        }
        Ok(Launched {
            handle,
            connection: prepared.outside,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sockets_the_kernel_bound_itself_block_a_checkpoint() {
        assert!(is_relay_socket("kernel-1") && is_relay_socket("kernel-52011"));
        for name in [
            "kernel-",
            "kernel-1x",
            "kernel",
            "x.sock",
            "kernel-1/..",
            "kernel_1",
        ] {
            assert!(!is_relay_socket(name), "{name}");
        }
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue\n\
                   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000\n\
                   1: 0100007F:D431 0100007F:1F90 01 00000000:00000000\n\
                   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A";
        assert_eq!(listening_ports(tcp), [8080], "listeners only, once each");
        let why = held_sockets(&["x.sock".to_owned()]);
        assert!(why.contains("/run/kernel/x.sock"), "{why}");
        assert!(why.contains("delete the file"), "{why}");
    }
}
