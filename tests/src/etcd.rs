//! A real etcd (Debian's `etcd-server`) for the tests of cluster mode: one member on
//! loopback ports of its own, a temporary data directory, stopped and removed on drop.

use anyhow::{bail, Context, Result};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running etcd member.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    data: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
}

impl EtcdServer {
    /// Starts etcd on free loopback ports and waits until it answers.
    pub async fn start() -> Result<EtcdServer> {
        let data = tempfile::Builder::new().prefix("kg-etcd-").tempdir()?;
        let mut server = EtcdServer {
            child: None,
            data,
            client_port: crate::free_port()?,
            peer_port: crate::free_port()?,
        };
        server.spawn().await?;
        Ok(server)
    }

    /// The client URL (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Kills the member with SIGKILL: an outage. Its data stays for [`EtcdServer::resume`].
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Starts the member again on the same ports and data (the end of an outage).
    pub async fn resume(&mut self) -> Result<()> {
        self.spawn().await
    }

    async fn spawn(&mut self) -> Result<()> {
        let client = self.url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.data.path().join("etcd.log"))?;
        let child = Command::new("etcd")
            .args(["--name", "kg-test"])
            .arg("--data-dir")
            .arg(self.data.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("kg-test={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("cannot start etcd: install Debian's etcd-server (make test-tools does)")?;
        self.child = Some(child);
        let http = reqwest::Client::new();
        for _ in 0..100 {
            let ok = http
                .get(format!("{client}/health"))
                .timeout(Duration::from_millis(500))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let log = std::fs::read_to_string(self.data.path().join("etcd.log")).unwrap_or_default();
        bail!("etcd did not become healthy within 10 s:\n{log:.2000}")
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}
