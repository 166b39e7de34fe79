//! A real etcd (Debian's `etcd-server`) for the tests of cluster mode: one member on
//! loopback ports of its own (or in a test host of its own), a temporary data directory,
//! stopped and removed on drop.

use crate::netns::Host;
use anyhow::{bail, Context, Result};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running etcd member.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    data: tempfile::TempDir,
    /// The test host it runs in (`None`: on loopback).
    host: Option<Host>,
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
            host: None,
            client_port: crate::free_port()?,
            peer_port: crate::free_port()?,
        };
        server.spawn().await?;
        Ok(server)
    }

    /// Starts etcd inside test host `host`, on its address and etcd's usual ports; the
    /// caller must run in a namespace on the same switch.
    pub async fn start_on(host: &Host) -> Result<EtcdServer> {
        let data = tempfile::Builder::new().prefix("kg-etcd-").tempdir()?;
        let mut server = EtcdServer {
            child: None,
            data,
            host: Some(host.clone()),
            client_port: 2379,
            peer_port: 2380,
        };
        server.spawn().await?;
        Ok(server)
    }

    fn address(&self) -> &str {
        self.host.as_ref().map_or("127.0.0.1", |h| h.ip.as_str())
    }

    /// The client URL (`http://ADDRESS:PORT`).
    pub fn url(&self) -> String {
        format!("http://{}:{}", self.address(), self.client_port)
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
        let peer = format!("http://{}:{}", self.address(), self.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.data.path().join("etcd.log"))?;
        let mut command = match &self.host {
            Some(host) => {
                let [launcher, net] = host.launcher();
                let mut c = Command::new(launcher);
                c.args([net.as_str(), "etcd"]);
                c
            }
            None => Command::new("etcd"),
        };
        let child = command
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
