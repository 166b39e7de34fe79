//! The gateway image under `--engine gvisor` (deploy/image/Dockerfile.gvisor) run as
//! deploy/kubernetes/kernelgate-gvisor.yaml runs it: a privileged container in the host's
//! PID namespace with no Docker socket, the runtime directory (shared mounts both ways) and
//! the image store on host paths, the sandboxes' cgroups beside the container's. It serves
//! a kernel, keeps the kernel's memory out of its own container's cgroup, and a gateway
//! container killed and started again finds the kernel with its state.
//!
//! Runs once, with the suite under gVisor (`make e2e-gvisor`), as the engine's own suite.

use anyhow::{bail, ensure, Context, Result};
use kernelgate_tests::engine::IMAGES;
use kernelgate_tests::{binary, free_port, image, remove_leftovers};
use reqwest::Method;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The gateway image this test builds from the debug binary (kept: a rebuild reuses its layers).
const GATEWAY_IMAGE: &str = "kernelgate-gateway-gvisor:test";

fn skipped() -> bool {
    if kernelgate_tests::runtime() != "runsc" {
        eprintln!("skipped: the gVisor engine's container runs with the suite under gVisor");
        return true;
    }
    if !Path::new("/sys/fs/cgroup/memory").is_dir() {
        eprintln!("skipped: the gateway's container places kernels beside it under cgroup v1 only");
        return true;
    }
    false
}

/// The id of `image`, in the image store the engine's tests fill (imported from a `docker
/// save` archive unless the store has it already).
fn stored_image(image: &str) -> Result<String> {
    kernelgate_tests::engine::image_store(&[image])?;
    kernelgate_tests::command_output(
        Command::new("docker").args(["image", "inspect", "--format", "{{.Id}}", image]),
    )
}

/// Linux's capabilities by number, as Docker names them.
const CAPABILITIES: [&str; 41] = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

/// `docker run`'s flags for a privileged container. `--privileged` grants every capability
/// the kernel knows, and runc cannot grant one missing from the host's own bounding set (a
/// VM may withhold CAP_SYS_RESOURCE): there the container gets what `--privileged` gives
/// (no seccomp filter, no AppArmor profile, unmasked /proc, every device) with every
/// capability the host has.
fn privileged() -> Result<Vec<String>> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let bounding = status
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .context("CapBnd")?;
    let bounding = u64::from_str_radix(bounding.trim(), 16)?;
    let last: usize = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")?
        .trim()
        .parse()?;
    let missing: Vec<&str> = CAPABILITIES
        .iter()
        .enumerate()
        .filter(|(n, _)| *n <= last && bounding & (1 << n) == 0)
        .map(|(_, name)| *name)
        .collect();
    if missing.is_empty() {
        return Ok(vec!["--privileged".to_owned()]);
    }
    eprintln!(
        "the host's bounding set lacks {missing:?}: every other capability instead of --privileged"
    );
    let mut flags: Vec<String> = [
        "--cap-add=ALL",
        "--security-opt=seccomp=unconfined",
        "--security-opt=apparmor=unconfined",
        "--security-opt=systempaths=unconfined",
        "--device-cgroup-rule=a *:* rwm",
    ]
    .map(str::to_owned)
    .into();
    flags.extend(missing.iter().map(|c| format!("--cap-drop={c}")));
    Ok(flags)
}

/// The memory cgroup of process `pid` (its path in the hierarchy).
fn memory_cgroup(pid: &str) -> Result<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let path = |wanted: &dyn Fn(&str) -> bool| {
        text.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
            wanted(controllers).then(|| path.to_owned())
        })
    };
    // cgroup v1's memory controller, else v2's unified hierarchy.
    path(&|c| c.split(',').any(|c| c == "memory"))
        .or_else(|| path(&str::is_empty))
        .context("a memory cgroup")
}

/// The gateway's container and what it left on the host, removed when dropped: the
/// container, runsc's sandboxes under the runtime directory, the mounts and directories.
struct Deployment {
    name: String,
    runtime_dir: PathBuf,
    hibernate_dir: PathBuf,
    runsc: PathBuf,
    /// The sandboxes' parent cgroup, once known: removed when empty.
    sandboxes_cgroup: Option<String>,
}

impl Deployment {
    fn runsc_root(&self) -> PathBuf {
        self.runtime_dir.join("gvisor").join("root")
    }

    /// The sandboxes runsc knows under the runtime directory.
    fn sandboxes(&self) -> Result<Vec<Value>> {
        if !self.runsc_root().exists() {
            return Ok(Vec::new());
        }
        let listed = kernelgate_tests::command_output(
            Command::new(&self.runsc)
                .arg("--root")
                .arg(self.runsc_root())
                .args(["list", "-format=json"]),
        )?;
        Ok(serde_json::from_str::<Value>(&listed)?
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    fn gateway_pid(&self) -> Result<String> {
        kernelgate_tests::command_output(Command::new("docker").args([
            "inspect",
            "--format",
            "{{.State.Pid}}",
            &self.name,
        ]))
    }
}

impl Drop for Deployment {
    fn drop(&mut self) {
        let quiet = |c: &mut Command| {
            let _ = c.stdout(Stdio::null()).stderr(Stdio::null()).status();
        };
        quiet(Command::new("docker").args(["rm", "-f", &self.name]));
        for sandbox in self.sandboxes().unwrap_or_default() {
            if let Some(id) = sandbox["id"].as_str() {
                quiet(
                    Command::new(&self.runsc)
                        .arg("--root")
                        .arg(self.runsc_root())
                        .args(["delete", "--force", id]),
                );
            }
        }
        remove_leftovers(&self.runtime_dir);
        quiet(Command::new("umount").arg(&self.runtime_dir));
        let _ = std::fs::remove_dir_all(&self.runtime_dir);
        let _ = std::fs::remove_dir_all(&self.hibernate_dir);
        if let (Some(cgroup), Ok(controllers)) =
            (&self.sandboxes_cgroup, std::fs::read_dir("/sys/fs/cgroup"))
        {
            for controller in controllers.filter_map(|c| c.ok()) {
                let _ = std::fs::remove_dir(format!("{}{cgroup}", controller.path().display()));
            }
        }
    }
}

/// Waits (bounded) until the gateway in the container answers `GET /api`.
async fn ready(client: &kernelgate_client::Gateway, name: &str) -> Result<()> {
    for _ in 0..120 {
        let answer = client.send(client.request(Method::GET, "/api")).await;
        if answer.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    let logs = Command::new("docker").args(["logs", name]).output()?;
    bail!(
        "the gateway in {name} did not answer: {}",
        String::from_utf8_lossy(&logs.stderr)
    )
}

async fn execute(client: &kernelgate_client::Gateway, id: &str, code: &str) -> Result<Value> {
    let request = client
        .request(Method::POST, &format!("/api/kernels/{id}/execute"))
        .json(&json!({"code": code}));
    Ok(client.send(request).await?.json().await?)
}

fn stdout(answer: &Value) -> &str {
    answer["stdout"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_image_serves_kernels_privileged_without_docker_and_survives_a_restart(
) -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let kernel_image = stored_image(&image())?;
    let runsc = kernelgate_tests::engine::runsc();
    ensure!(
        runsc.is_file(),
        "no runsc at {}: run `make gvisor`",
        runsc.display()
    );
    kernelgate_tests::command_output(
        Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/image/build-gvisor.sh"))
            .arg(binary())
            .arg(&runsc)
            .arg(image())
            .arg(GATEWAY_IMAGE),
    )?;
    let tag = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let mut deployment = Deployment {
        name: format!("kg-gvisor-ctr-{tag}"),
        runtime_dir: PathBuf::from(format!("/run/kg-ctr-{tag}")),
        hibernate_dir: PathBuf::from(format!("/run/kg-ctr-{tag}.hibernated")),
        runsc,
        sandboxes_cgroup: None,
    };
    // The runtime directory is a shared mount on the host, as Bidirectional propagation
    // needs: each kernel's socket directory is a tmpfs the gateway mounts inside the
    // container, which the next gateway container must see.
    let rd = deployment.runtime_dir.display().to_string();
    std::fs::create_dir_all(&deployment.runtime_dir)?;
    std::fs::create_dir_all(&deployment.hibernate_dir)?;
    kernelgate_tests::command_output(Command::new("mount").args(["--bind", &rd, &rd]))?;
    kernelgate_tests::command_output(Command::new("mount").args(["--make-shared", &rd]))?;
    // Without the entrypoint's mounts the gateway sees only its container's part of each
    // cgroup hierarchy: it refuses to start rather than put the sandboxes inside it.
    let refused = Command::new("docker")
        .args(["run", "--rm", "--pid=host"])
        .args(privileged()?)
        .args(["--entrypoint=/usr/local/bin/kernelgate", GATEWAY_IMAGE])
        .args(["serve", "--token=t", "--runtime-dir=/run/kg-refused"])
        .output()?;
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{said}");
    assert!(said.contains("not the whole hierarchy"), "{said}");

    let port = free_port()?;
    let token = format!("test-{}", uuid::Uuid::new_v4().simple());
    let hibernate = deployment.hibernate_dir.display().to_string();
    let mut docker_run = Command::new("docker");
    docker_run
        .args(["run", "-d", "--name", &deployment.name, "--pid=host"])
        .args(privileged()?)
        // What the gateway may use is its container's: a kernel's memory must not count.
        .args(["--memory=384m", "-p", &format!("127.0.0.1:{port}:8888")])
        .args(["-v", &format!("{IMAGES}:/var/lib/kernelgate/images:ro")])
        .args(["-v", &format!("{rd}:{rd}:rshared")])
        .args(["-v", &format!("{hibernate}:{hibernate}")])
        .args([
            GATEWAY_IMAGE,
            "serve",
            "--listen=0.0.0.0:8888",
            "--pool-size=0",
            // No template is made at start: the test counts the sandboxes.
            "--kernel-templates=false",
        ])
        .args([
            format!("--token={token}"),
            format!("--image={kernel_image}"),
        ])
        .args([
            format!("--runtime-dir={rd}"),
            format!("--hibernate-dir={hibernate}"),
        ])
        .arg("--kernel-memory-mb=1024");
    kernelgate_tests::command_output(&mut docker_run)?;
    // Nothing of Docker's in the container: no socket, no client.
    let inside = kernelgate_tests::command_output(Command::new("docker").args([
        "exec",
        &deployment.name,
        "sh",
        "-c",
        "ls /run/docker.sock /var/run/docker.sock 2>/dev/null; command -v docker; true",
    ]))?;
    assert_eq!(
        inside, "",
        "no Docker socket or client in the gateway's container"
    );

    let client = kernelgate_client::Gateway::new(&format!("http://127.0.0.1:{port}"), Some(token));
    ready(&client, &deployment.name).await?;
    let id = client.create_kernel(None).await?;
    let answer = execute(&client, &id, "x = 41\n1 + 1").await?;
    assert_eq!(answer["status"], "ok", "{answer}");
    assert_eq!(answer["results"][0]["data"]["text/plain"], "2", "{answer}");

    // The sandbox's cgroup is beside the gateway's container's, not inside it.
    let sandboxes = deployment.sandboxes()?;
    let [sandbox] = sandboxes.as_slice() else {
        bail!("one sandbox: {sandboxes:?}")
    };
    let handle = sandbox["id"].as_str().context("a sandbox id")?;
    let sandbox_pid = sandbox["pid"]
        .as_i64()
        .context("a sandbox pid")?
        .to_string();
    let gateway_cgroup = memory_cgroup(&deployment.gateway_pid()?)?;
    let (parent, _) = gateway_cgroup
        .rsplit_once('/')
        .context("a container cgroup")?;
    deployment.sandboxes_cgroup = Some(format!("{parent}/kernelgate"));
    assert_eq!(
        memory_cgroup(&sandbox_pid)?,
        format!("{parent}/kernelgate/{handle}"),
        "the sandbox sits beside the container's cgroup {gateway_cgroup}"
    );
    // 600 MiB in the kernel (its limit: 1 GiB) while the container may use 384 MiB.
    let grown = execute(
        &client,
        &id,
        "blob = bytearray(600 << 20)\nfor i in range(0, len(blob), 4096): blob[i] = 1\nprint(len(blob) >> 20)",
    )
    .await?;
    assert_eq!(stdout(&grown), "600\n", "{grown}");
    let read = |cgroup: &str, file: &str| -> Result<u64> {
        let path = format!("/sys/fs/cgroup/memory{cgroup}/{file}");
        Ok(std::fs::read_to_string(&path)
            .context(path)?
            .trim()
            .parse()?)
    };
    if Path::new("/sys/fs/cgroup/memory").is_dir() {
        let kernel_cgroup = format!("{parent}/kernelgate/{handle}");
        // Charged to the kernel's cgroup (limit 1 GiB), not the container's (384 MiB).
        assert!(read(&kernel_cgroup, "memory.max_usage_in_bytes")? > 600 << 20);
        assert_eq!(read(&gateway_cgroup, "memory.limit_in_bytes")?, 384 << 20);
    }
    execute(&client, &id, "del blob").await?;

    // Killed (no SIGTERM, which removes the kernels), the container's processes die; the
    // sandbox, in the host's PID namespace and outside the container's cgroup, does not.
    kernelgate_tests::command_output(Command::new("docker").args(["kill", &deployment.name]))?;
    let left = deployment.sandboxes()?;
    assert_eq!(left.len(), 1, "the sandbox outlives its gateway: {left:?}");
    assert_eq!(left[0]["status"], "running", "{left:?}");
    kernelgate_tests::command_output(Command::new("docker").args(["start", &deployment.name]))?;
    ready(&client, &deployment.name).await?;
    let again = execute(&client, &id, "print(x + 1)").await?;
    assert_eq!(
        stdout(&again),
        "42\n",
        "the kernel and its state are back: {again}"
    );

    client.delete_kernel(&id).await?;
    assert_eq!(
        deployment.sandboxes()?,
        Vec::<Value>::new(),
        "no sandbox left"
    );
    kernelgate_tests::command_output(Command::new("docker").args(["stop", &deployment.name]))?;
    assert!(
        !Path::new(&format!(
            "/sys/fs/cgroup/memory{parent}/kernelgate/{handle}"
        ))
        .exists(),
        "the sandbox's cgroup is gone"
    );
    Ok(())
}
