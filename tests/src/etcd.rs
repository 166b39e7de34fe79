//! A real etcd (Debian's `etcd-server`) for the tests of cluster mode: one member on
//! loopback ports of its own (or in a test host of its own), a temporary data directory,
//! stopped and removed on drop. Optionally serving TLS with client certificates, signed by
//! a CA made for the test, or with command-line flags of the caller's (the deployed ones).
//! It can be killed and resumed (an outage), or paused and continued (a member that hangs).

use crate::netns::Host;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
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
    /// Certificates for an etcd serving TLS that asks clients for theirs.
    tls: Option<Tls>,
    /// Flags added to its command line, at every start.
    args: Vec<String>,
}

/// A test CA, etcd's server certificate and a client certificate, all signed by that CA,
/// written as PEM files into etcd's data directory.
#[derive(Debug, Clone)]
pub struct Tls {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl Tls {
    fn write(dir: &Path) -> Result<Tls> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
        };
        let ca_key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "kernelgate test CA");
        let ca = params.self_signed(&ca_key)?;
        // etcd 3.4's JSON gateway dials etcd's own gRPC port with the server certificate as
        // its client certificate: it serves both purposes.
        let leaf =
            |name: &str, purposes: Vec<ExtendedKeyUsagePurpose>| -> Result<(String, String)> {
                let key = KeyPair::generate()?;
                let mut params =
                    CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])?;
                params.distinguished_name.push(DnType::CommonName, name);
                params.extended_key_usages = purposes;
                let cert = params.signed_by(&key, &ca, &ca_key)?;
                Ok((cert.pem(), key.serialize_pem()))
            };
        let (server_cert, server_key) = leaf(
            "etcd",
            vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ],
        )?;
        let (client_cert, client_key) =
            leaf("kernelgate-node", vec![ExtendedKeyUsagePurpose::ClientAuth])?;
        let tls = Tls {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
        };
        std::fs::write(&tls.ca, ca.pem())?;
        std::fs::write(&tls.server_cert, server_cert)?;
        std::fs::write(&tls.server_key, server_key)?;
        std::fs::write(&tls.client_cert, &client_cert)?;
        std::fs::write(&tls.client_key, &client_key)?;
        Ok(tls)
    }

    /// An HTTP client that trusts the test CA and shows the client certificate.
    pub fn client(&self) -> Result<reqwest::Client> {
        let mut identity = std::fs::read(&self.client_cert)?;
        identity.extend(std::fs::read(&self.client_key)?);
        Ok(reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(&std::fs::read(&self.ca)?)?)
            .identity(reqwest::Identity::from_pem(&identity)?)
            .build()?)
    }
}

impl EtcdServer {
    /// Starts etcd on free loopback ports and waits until it answers.
    pub async fn start() -> Result<EtcdServer> {
        Self::on_loopback(false, &[]).await
    }

    /// Starts etcd on free loopback ports with `args` added to its command line (again at
    /// each [`EtcdServer::resume`]), e.g. the compaction flags of deploy/.
    pub async fn start_with(args: &[String]) -> Result<EtcdServer> {
        Self::on_loopback(false, args).await
    }

    /// Starts etcd on free loopback ports serving TLS only, and only to clients that show a
    /// certificate signed by its test CA ([`EtcdServer::tls`]).
    pub async fn start_tls() -> Result<EtcdServer> {
        Self::on_loopback(true, &[]).await
    }

    async fn on_loopback(tls: bool, args: &[String]) -> Result<EtcdServer> {
        let data = tempfile::Builder::new().prefix("kg-etcd-").tempdir()?;
        let tls = if tls {
            Some(Tls::write(data.path())?)
        } else {
            None
        };
        let mut server = EtcdServer {
            child: None,
            data,
            host: None,
            client_port: crate::free_port()?,
            peer_port: crate::free_port()?,
            tls,
            args: args.to_vec(),
        };
        server.spawn().await?;
        Ok(server)
    }

    /// The certificates of an etcd started with [`EtcdServer::start_tls`].
    pub fn tls(&self) -> Option<&Tls> {
        self.tls.as_ref()
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
            tls: None,
            args: Vec::new(),
        };
        server.spawn().await?;
        Ok(server)
    }

    fn address(&self) -> &str {
        self.host.as_ref().map_or("127.0.0.1", |h| h.ip.as_str())
    }

    /// The client URL (`http://ADDRESS:PORT`, `https://` with TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}:{}", self.address(), self.client_port)
    }

    /// Kills the member with SIGKILL: an outage. Its data stays for [`EtcdServer::resume`].
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Starts the member again on the same ports, data and flags (the end of an outage).
    pub async fn resume(&mut self) -> Result<()> {
        self.spawn().await
    }

    /// The member's process id (in a test host too: `nsenter` execs etcd); `None` while
    /// killed.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops the member with SIGSTOP: it keeps its connections and answers nothing, as a
    /// member stuck on its disk or starved of CPU does, until [`EtcdServer::unpause`].
    pub fn pause(&self) -> Result<()> {
        self.signal("STOP")
    }

    /// Lets a paused member run on with SIGCONT.
    pub fn unpause(&self) -> Result<()> {
        self.signal("CONT")
    }

    fn signal(&self, name: &str) -> Result<()> {
        let pid = self.pid().context("etcd is not running")?;
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(pid.to_string())
            .status()
            .context("cannot run kill")?;
        if !status.success() {
            bail!("kill -{name} {pid}: {status}");
        }
        Ok(())
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
        if let Some(tls) = &self.tls {
            command
                .arg("--cert-file")
                .arg(&tls.server_cert)
                .arg("--key-file")
                .arg(&tls.server_key)
                .arg("--trusted-ca-file")
                .arg(&tls.ca)
                .arg("--client-cert-auth");
        }
        let child = command
            .args(["--name", "kg-test"])
            .arg("--data-dir")
            .arg(self.data.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("kg-test={peer}")])
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("cannot start etcd: install Debian's etcd-server (make test-tools does)")?;
        self.child = Some(child);
        let http = match &self.tls {
            Some(tls) => tls.client()?,
            None => reqwest::Client::new(),
        };
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
