//! The processes the benchmark starts: the Kernelgate binary, Jupyter Kernel Gateway, and
//! plain local ipykernels for the direct baseline; plus what it reads about them from
//! /proc (resident memory, CPU time of a container's processes).

use anyhow::{bail, Context, Result};
use kernelgate_client::serve::{LocalGateway, Serve, ServeError};
use kernelgate_protocol::{ConnectionInfo, SigningKey};
use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// Where the benchmark finds things and keeps its scratch files.
#[derive(Debug, Clone)]
pub struct Paths {
    /// The workspace root (holds kernel-image/launch.py).
    pub root: PathBuf,
    /// The venv with jupyter_kernel_gateway, ipykernel, matplotlib, numpy.
    pub venv: PathBuf,
    pub kernelgate: PathBuf,
    pub image: String,
    /// Scratch directory, removed at the end.
    pub work: PathBuf,
}

impl Paths {
    fn python(&self) -> PathBuf {
        self.venv.join("bin").join("python")
    }

    /// The image's own launcher, so local kernels behave like the container's (same
    /// ipykernel, XPUB_NODROP on IOPub, inline matplotlib backend).
    fn launcher(&self) -> PathBuf {
        self.root.join("kernel-image").join("launch.py")
    }
}

/// A gateway process (Kernelgate or JKG) on a loopback port.
#[derive(Debug)]
pub struct Server {
    pub name: &'static str,
    process: Option<Process>,
    pub pid: u32,
    pub base: String,
    pub token: String,
    /// Kernelgate's runtime directory (its containers carry it as a label).
    pub runtime_dir: Option<PathBuf>,
    client: kernelgate_client::Gateway,
}

/// How the gateway was started: Kernelgate through the client crate, JKG by hand.
#[derive(Debug)]
enum Process {
    Kernelgate(LocalGateway),
    Jkg(Child),
}

impl Server {
    /// Starts the release `kernelgate` with its own runtime directory.
    pub async fn kernelgate(paths: &Paths, pool_size: usize, extra: &[&str]) -> Result<Server> {
        let serve = Serve::new(&paths.kernelgate)?;
        let port = serve.port();
        let token = format!("bench-{}", uuid::Uuid::new_v4().simple());
        let runtime_dir = PathBuf::from(format!("/run/kg-bench-{port}"));
        let log = std::sync::Mutex::new(std::fs::File::create(
            paths.work.join(format!("kernelgate-{port}.log")),
        )?);
        let process = serve
            .args(["--token", &token, "--image", &paths.image])
            .arg("--runtime-dir")
            .arg(&runtime_dir)
            .args(["--pool-size", &pool_size.to_string()])
            .args(["--cull-idle-timeout", "0"])
            // `{port}` in a flag stands for the port it listens on (a cluster node's address).
            .args(extra.iter().map(|a| a.replace("{port}", &port.to_string())))
            .env("KERNELGATE_LOG", "warn")
            .start(move |_, line| {
                if let Ok(mut log) = log.lock() {
                    let _ = writeln!(log, "{line}");
                }
            })
            .await
            .with_context(|| {
                format!("cannot start kernelgate (log in {})", paths.work.display())
            })?;
        let pid = process.pid().context("no pid")?;
        Ok(Server {
            name: "kernelgate",
            client: Self::http_client(&process.base(), &token)?,
            base: process.base(),
            process: Some(Process::Kernelgate(process)),
            pid,
            token,
            runtime_dir: Some(runtime_dir),
        })
    }

    /// Starts Jupyter Kernel Gateway from the venv; its `python3` kernel spec runs the
    /// same launcher as the kernel image, as a local process.
    pub async fn jkg(paths: &Paths) -> Result<Server> {
        let port = kernelgate_tests::free_port()?;
        let token = format!("bench-{}", uuid::Uuid::new_v4().simple());
        let home = paths.work.join(format!("jkg-{port}"));
        let spec_dir = home.join("data").join("kernels").join("python3");
        std::fs::create_dir_all(&spec_dir)?;
        let spec = json!({
            "argv": [paths.python(), paths.launcher(), "{connection_file}"],
            "display_name": "Python 3 (ipykernel)",
            "language": "python",
            "env": {
                "IPYTHONDIR": home.join("ipython"),
                "MPLCONFIGDIR": home.join("matplotlib"),
            },
        });
        std::fs::write(spec_dir.join("kernel.json"), spec.to_string())?;
        let mut cmd = Command::new(paths.venv.join("bin").join("jupyter-kernelgateway"));
        cmd.arg("--KernelGatewayApp.ip=127.0.0.1")
            .arg(format!("--KernelGatewayApp.port={port}"))
            .arg(format!("--KernelGatewayApp.auth_token={token}"))
            .arg("--KernelGatewayApp.max_kernels=200")
            .arg("--KernelGatewayApp.log_level=WARN")
            // Out of the box jupyter_server drops IOPub output past 1 MB/s (a notice
            // replaces it): off, so the stream test measures throughput, not the limit.
            .arg("--ZMQChannelsWebsocketConnection.limit_rate=False")
            .env("JUPYTER_PATH", home.join("data"))
            .env("JUPYTER_CONFIG_DIR", home.join("config"))
            .env("JUPYTER_RUNTIME_DIR", home.join("runtime"))
            .env("JUPYTER_DATA_DIR", home.join("data"));
        let name = "jkg";
        let log = std::fs::File::create(paths.work.join(format!("{name}-{port}.log")))?;
        let child = cmd
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        let pid = child.id().context("no pid")?;
        let base = format!("http://127.0.0.1:{port}");
        let server = Server {
            name,
            process: Some(Process::Jkg(child)),
            pid,
            client: Self::http_client(&base, &token)?,
            base,
            token,
            runtime_dir: None,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(r) = server.request(reqwest::Method::GET, "/api").send().await {
                if r.status().is_success() {
                    return Ok(server);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        bail!(
            "{name} did not serve /api within 60 s (log in {})",
            paths.work.display()
        )
    }

    /// The gateway's HTTP client, Nagle off.
    fn http_client(base: &str, token: &str) -> Result<kernelgate_client::Gateway> {
        let http = reqwest::Client::builder().tcp_nodelay(true).build()?;
        Ok(kernelgate_client::Gateway::new(base, Some(token.to_owned())).with_http(http))
    }

    /// The gateway's HTTP client, with its token.
    pub fn client(&self) -> &kernelgate_client::Gateway {
        &self.client
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client.request(method, path)
    }

    /// `POST /api/kernels`; returns the kernel id. `env` (KERNEL_* variables) makes
    /// Kernelgate start a fresh container instead of handing out a pooled one.
    pub async fn create_kernel(&self, env: Option<Value>) -> Result<String> {
        let mut body = json!({"name": "python3"});
        if let Some(env) = env {
            body["env"] = env;
        }
        let r = self
            .request(reqwest::Method::POST, "/api/kernels")
            .json(&body)
            .timeout(Duration::from_secs(120))
            .send()
            .await?;
        let status = r.status();
        let model: Value = r.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            bail!(
                "{}: POST /api/kernels answered {status}: {model}",
                self.name
            );
        }
        model["id"]
            .as_str()
            .map(str::to_owned)
            .context("kernel model without id")
    }

    /// `POST /api/kernels/{id}/restart`; returns the status once it answered.
    pub async fn restart_kernel(&self, id: &str) -> Result<u16> {
        let r = self
            .request(reqwest::Method::POST, &format!("/api/kernels/{id}/restart"))
            .timeout(Duration::from_secs(120))
            .send()
            .await?;
        Ok(r.status().as_u16())
    }

    pub async fn delete_kernel(&self, id: &str) -> Result<()> {
        let r = self
            .request(reqwest::Method::DELETE, &format!("/api/kernels/{id}"))
            .timeout(Duration::from_secs(60))
            .send()
            .await?;
        if !r.status().is_success() {
            bail!("{}: DELETE kernel answered {}", self.name, r.status());
        }
        Ok(())
    }

    /// Resident memory of the gateway process alone, in KiB.
    pub fn rss_kib(&self) -> Result<u64> {
        rss_kib(self.pid)
    }

    /// SIGTERM, then waits: Kernelgate removes its containers, JKG shuts its kernels down.
    pub async fn stop(mut self) -> Result<()> {
        let grace = Duration::from_secs(120);
        let mut child = match self.process.take() {
            None => return Ok(()),
            Some(Process::Kernelgate(mut process)) => {
                return match process.stop(grace).await {
                    Ok(_) => Ok(()),
                    Err(ServeError::NotStopped(_)) => {
                        bail!("{} did not stop within 120 s of SIGTERM", self.name)
                    }
                    Err(e) => Err(e.into()),
                };
            }
            Some(Process::Jkg(child)) => child,
        };
        signal(self.pid, "TERM");
        match tokio::time::timeout(grace, child.wait()).await {
            Ok(status) => {
                status?;
                Ok(())
            }
            Err(_) => {
                child.kill().await?;
                bail!("{} did not stop within 120 s of SIGTERM", self.name)
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.process.is_some() {
            // An error path: still give it the chance to remove its kernels.
            signal(self.pid, "TERM");
            for _ in 0..600 {
                if !Path::new(&format!("/proc/{}", self.pid)).exists() || zombie(self.pid) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        // Empty once the gateway removed its kernels (else kept, to look at).
        if let Some(dir) = &self.runtime_dir {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

/// `VmRSS` of one process, in KiB.
pub fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS")
}

/// A local ipykernel (the image's launcher from the venv) on ipc sockets, for the direct
/// baseline. Killed and its directory removed when dropped.
#[derive(Debug)]
pub struct DirectKernel {
    child: Child,
    pub info: ConnectionInfo,
    dir: PathBuf,
}

impl DirectKernel {
    pub fn spawn(paths: &Paths, n: usize) -> Result<DirectKernel> {
        let dir = paths.work.join(format!("d{n}"));
        std::fs::create_dir_all(&dir)?;
        let prefix = dir.join("k").display().to_string();
        let info = ConnectionInfo::ipc(&prefix, SigningKey::generate_hex(), "python3");
        info.validate()?;
        let file = dir.join("kernel.json");
        std::fs::write(&file, info.to_json())?;
        let child = Command::new(paths.python())
            .arg(paths.launcher())
            .arg(&file)
            .env("IPYTHONDIR", dir.join("ipython"))
            .env("MPLCONFIGDIR", dir.join("matplotlib"))
            .env("JUPYTER_RUNTIME_DIR", dir.join("runtime"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .context("cannot start a local ipykernel")?;
        Ok(DirectKernel { child, info, dir })
    }
}

impl Drop for DirectKernel {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The running containers of a Kernelgate runtime directory (full ids), via the Docker CLI.
pub fn containers(runtime_dir: &Path) -> Result<Vec<String>> {
    let out = std::process::Command::new("docker")
        .args(["ps", "-q", "--no-trunc", "--filter"])
        .arg(format!(
            "label=org.kernelgate.runtime_dir={}",
            runtime_dir.display()
        ))
        .output()?;
    if !out.status.success() {
        bail!("docker ps: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect())
}

/// CPU time (clock ticks) of every process in the given containers, found through
/// /proc/<pid>/cgroup.
fn container_cpu_ticks(ids: &[String]) -> u64 {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut total = 0;
    for p in procs.flatten() {
        let name = p.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(cgroup) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
            continue;
        };
        if !ids.iter().any(|id| cgroup.contains(id.as_str())) {
            continue;
        }
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            let fields: Vec<&str> = stat
                .rsplit(')')
                .next()
                .unwrap_or_default()
                .split_whitespace()
                .collect();
            // After the comm: state is field 3, utime 14, stime 15 (1-based).
            let tick = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok());
            total += tick(11).unwrap_or(0) + tick(12).unwrap_or(0);
        }
    }
    total
}

/// Waits until a Kernelgate has `expected` containers and they have been quiet (no CPU
/// used) for a while: the warm pool is full and its kernels finished importing.
pub async fn settle(server: &Server, expected: usize, timeout: Duration) -> Result<()> {
    let runtime_dir = server
        .runtime_dir
        .clone()
        .context("not a Kernelgate server")?;
    let deadline = Instant::now() + timeout;
    let mut last: Option<u64> = None;
    let mut quiet = 0;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let ids = containers(&runtime_dir)?;
        if ids.len() != expected {
            last = None;
            quiet = 0;
            continue;
        }
        let ticks = container_cpu_ticks(&ids);
        if last.is_some_and(|l| ticks <= l + 1) {
            quiet += 1;
            if quiet >= 2 {
                return Ok(());
            }
        } else {
            quiet = 0;
        }
        last = Some(ticks);
    }
    bail!("the warm pool did not settle at {expected} quiet containers within {timeout:?}")
}

/// Whether any container of this runtime directory is still there.
pub fn leftover_containers(runtime_dir: &Path) -> usize {
    containers(runtime_dir).map(|c| c.len()).unwrap_or(0)
}
