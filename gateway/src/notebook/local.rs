//! The gateway `kernelgate run` starts for itself when it is given no `--url`.

use super::cells::Endpoint;
use super::RunError;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// How long a local gateway may take to listen.
const GATEWAY_START_TIMEOUT: Duration = Duration::from_secs(60);

/// `kernelgate serve` started by `kernelgate run` for one run: this binary, a free loopback
/// port, a random token, its own runtime directory and no warm pool.
#[derive(Debug)]
pub(crate) struct LocalGateway {
    child: Child,
    port: u16,
    token: String,
    runtime_dir: PathBuf,
}

impl LocalGateway {
    pub async fn start(image: &str) -> Result<LocalGateway, RunError> {
        let fail = |m: String| RunError::LocalGateway(m);
        let exe = std::env::current_exe().map_err(|e| fail(format!("cannot find myself: {e}")))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| fail(format!("no free port: {e}")))?
            .port();
        let token = kernelgate_protocol::SigningKey::generate_hex();
        // Short on purpose: kernel socket paths live under it (Unix sockets: 107 bytes).
        let runtime_dir = std::env::temp_dir().join(format!("kgrun-{port}"));
        let mut child = Command::new(&exe)
            .arg("serve")
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--image", image])
            .arg("--runtime-dir")
            .arg(&runtime_dir)
            .args(["--pool-size", "0", "--cull-idle-timeout", "0"])
            // The token goes by environment: other users can read a command line in `ps`.
            .env("KERNELGATE_TOKEN", &token)
            .env_remove("KERNELGATE_NO_AUTH")
            // Its own process group: Ctrl-C reaches `run`, which then stops it in order.
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| fail(format!("cannot run {}: {e}", exe.display())))?;
        let log = keep_log(&mut child);
        let gateway = LocalGateway {
            child,
            port,
            token,
            runtime_dir,
        };
        match gateway.wait_listening().await {
            Ok(()) => {
                eprintln!(
                    "kernelgate run: started a local gateway on 127.0.0.1:{port} (image {image})"
                );
                Ok(gateway)
            }
            Err(why) => {
                gateway.stop().await;
                let tail: Vec<String> = log
                    .lock()
                    .map(|l| l.iter().cloned().collect())
                    .unwrap_or_default();
                Err(fail(format!("{why}\n{}", tail.join("\n"))))
            }
        }
    }

    async fn wait_listening(&self) -> Result<(), String> {
        let deadline = Instant::now() + GATEWAY_START_TIMEOUT;
        let pid = self.child.id();
        while Instant::now() < deadline {
            if pid.is_some_and(|p| !alive(p)) {
                return Err("it exited; its log:".into());
            }
            if TcpStream::connect(("127.0.0.1", self.port)).await.is_ok() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!(
            "it did not listen within {GATEWAY_START_TIMEOUT:?}; its log:"
        ))
    }

    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            base: format!("http://127.0.0.1:{}", self.port),
            token: Some(self.token.clone()),
            http: reqwest::Client::new(),
        }
    }

    /// SIGTERM, so it removes its kernel containers; SIGKILL if it hangs.
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        if tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .is_err()
        {
            eprintln!("kernelgate run: the local gateway did not stop within 30 s; killing it");
            let _ = self.child.kill().await;
        }
        let _ = std::fs::remove_dir(&self.runtime_dir);
    }
}

fn alive(pid: u32) -> bool {
    std::process::Command::new("kill")
        .args(["-0", &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Keeps the last lines the local gateway printed, to show them if it fails to start.
fn keep_log(child: &mut Child) -> Arc<Mutex<VecDeque<String>>> {
    let log = Arc::new(Mutex::new(VecDeque::new()));
    let readers: [Option<Box<dyn tokio::io::AsyncRead + Send + Unpin>>; 2] = [
        child.stdout.take().map(|s| Box::new(s) as _),
        child.stderr.take().map(|s| Box::new(s) as _),
    ];
    for reader in readers.into_iter().flatten() {
        let log = log.clone();
        // Ends when the child closes its output, at the latest when it exits.
        tokio::spawn(async move {
            let mut lines = BufReader::new(reader).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(mut log) = log.lock() {
                    if log.len() == 40 {
                        log.pop_front();
                    }
                    log.push_back(line);
                }
            }
        });
    }
    log
}
