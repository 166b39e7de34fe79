//! The cluster suite's harness: test hosts in network namespaces (a switch with a client,
//! etcd and three nodes), a real etcd member, three gateway nodes started with the cluster's
//! flags (over mutual TLS between nodes, or plain), and what the tests ask of them: waits
//! until the cluster agrees, each node's view, records in etcd read and planted.

use crate::etcd::EtcdServer;
use crate::netns::{Host, Net};
use crate::{runtime, Gateway};
use anyhow::{Context, Result};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use kernelgate::audit::Record;
use kernelgate::cluster::signing::{Forwarded, Signer};
use reqwest::Method;
use serde_json::json;
use std::time::{Duration, Instant};

/// The test hosts of one cluster: a switch with the client, etcd and three nodes.
pub struct Testbed {
    pub net: Net,
    pub client: Host,
    pub etcd: Host,
    pub nodes: Vec<Host>,
}

impl std::fmt::Debug for Testbed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Testbed").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("ips", &self.ips)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

impl Testbed {
    /// `subnet` keeps the names of parallel tests' namespaces apart.
    pub fn new(subnet: u8) -> Result<Testbed> {
        let mut net = Net::new(subnet)?;
        let client = net.add_host("client", 100)?;
        let etcd = net.add_host("etcd", 2)?;
        let nodes = (0..3)
            .map(|n| net.add_host(&format!("node{n}"), 11 + n))
            .collect::<Result<_>>()?;
        Ok(Testbed {
            net,
            client,
            etcd,
            nodes,
        })
    }
}

/// Whether this run is the one that runs the cluster suite.
pub fn skipped() -> bool {
    if runtime() != "runc" {
        eprintln!("the cluster suite runs once, under runc");
        return true;
    }
    false
}

pub struct Cluster {
    pub nodes: Vec<Gateway>,
    pub etcd: EtcdServer,
    /// The flags every node is started with (its id and address come on top).
    pub flags: Vec<String>,
    /// Every node's runtime directory: a node the test stopped and has not started again
    /// is not in `nodes`, and its kernels are removed too.
    pub runtime_dirs: Vec<std::path::PathBuf>,
    /// Each node's address on the switch.
    pub ips: Vec<String>,
    /// Whether the nodes call each other over mutual TLS (their cluster listeners).
    pub tls: bool,
    pub _dir: tempfile::TempDir,
}

/// In cluster mode a stopped node leaves its kernels running for its return: the test
/// removes them once its nodes are stopped.
impl Drop for Cluster {
    fn drop(&mut self) {
        self.nodes.clear();
        for dir in &self.runtime_dirs {
            crate::remove_leftovers(dir);
        }
    }
}

/// The port of every node's cluster listener (each node has an address of its own).
pub const CLUSTER_PORT: u16 = 9443;

/// The flags of node `n` beyond the shared ones: with the cluster's TLS on (the CA among
/// the shared flags), its cluster listener and its own certificate, from the CA's directory.
pub fn node_flags(flags: &[String], n: usize) -> Vec<String> {
    let mut all = flags.to_vec();
    all.extend([
        "--node-id".into(),
        format!("node-{n}"),
        "--advertise".into(),
        "http://{host}:{port}".into(),
    ]);
    let ca = flags
        .iter()
        .position(|f| f == "--cluster-ca-file")
        .and_then(|i| flags.get(i + 1));
    if let Some(dir) = ca.and_then(|ca| std::path::Path::new(ca).parent()) {
        all.extend([
            "--cluster-listen".into(),
            format!("{{host}}:{CLUSTER_PORT}"),
            "--cluster-cert-file".into(),
            dir.join(format!("node-{n}.pem")).display().to_string(),
            "--cluster-key-file".into(),
            dir.join(format!("node-{n}.key")).display().to_string(),
        ]);
    }
    all
}

/// The cluster's certificates, made in `dir`: `ca.pem`, and for each of three nodes
/// `node-<n>.pem` and `.key`, whose subject alternative name is its id; and a stranger's:
/// `stranger.pem` and `.key`, naming node-0 but signed by another CA, with `both-cas.pem`
/// (the cluster's CA and the stranger's), for a client that trusts the cluster's nodes.
pub fn write_certificates(dir: &std::path::Path) -> Result<()> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    };
    let ca = |name: &str| -> Result<(rcgen::Certificate, KeyPair)> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Ok((params.self_signed(&key)?, key))
    };
    let leaf = |node: &str, ca: &(rcgen::Certificate, KeyPair), file: &str| -> Result<()> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec![node.to_owned()])?;
        params.distinguished_name.push(DnType::CommonName, node);
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &ca.0, &ca.1)?;
        std::fs::write(dir.join(format!("{file}.pem")), cert.pem())?;
        std::fs::write(dir.join(format!("{file}.key")), key.serialize_pem())?;
        Ok(())
    };
    let cluster_ca = ca("kernelgate test cluster CA")?;
    let stranger_ca = ca("a stranger's CA")?;
    std::fs::write(dir.join("ca.pem"), cluster_ca.0.pem())?;
    std::fs::write(
        dir.join("both-cas.pem"),
        format!("{}{}", cluster_ca.0.pem(), stranger_ca.0.pem()),
    )?;
    for n in 0..3 {
        leaf(&format!("node-{n}"), &cluster_ca, &format!("node-{n}"))?;
    }
    leaf("node-0", &stranger_ca, "stranger")
}

/// Three nodes of at most two kernels each, with a 3 s lease, sharing `keys` (a keys file),
/// on `bed`'s hosts, calling each other over mutual TLS. Call it from the client's host.
pub async fn cluster(bed: &Testbed, keys: &str) -> Result<Cluster> {
    cluster_with(bed, keys, &[]).await
}

/// The same, every node with `extra` flags too.
pub async fn cluster_with(bed: &Testbed, keys: &str, extra: &[&str]) -> Result<Cluster> {
    start_cluster(bed, keys, true, extra).await
}

/// [`cluster`], its nodes calling each other over plain HTTP on their `--listen` address.
pub async fn plain_cluster(bed: &Testbed, keys: &str) -> Result<Cluster> {
    start_cluster(bed, keys, false, &[]).await
}

pub async fn start_cluster(
    bed: &Testbed,
    keys: &str,
    tls: bool,
    extra: &[&str],
) -> Result<Cluster> {
    let etcd = EtcdServer::start_on(&bed.etcd).await?;
    let dir = tempfile::tempdir()?;
    let secret = dir.path().join("cluster.secret");
    std::fs::write(
        &secret,
        format!("{}\n", uuid::Uuid::new_v4().simple().to_string().repeat(2)),
    )?;
    let keys_file = dir.path().join("keys.toml");
    std::fs::write(&keys_file, keys)?;
    let policy = dir.path().join("policy.toml");
    std::fs::write(&policy, include_str!("../fixtures/policy.toml"))?;
    let flags: Vec<String> = [
        "--etcd",
        &etcd.url(),
        "--cluster-secret-file",
        &secret.display().to_string(),
        "--keys",
        &keys_file.display().to_string(),
        "--policy",
        &policy.display().to_string(),
        "--lease-ttl",
        "3",
        "--max-kernels",
        "2",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect();
    let mut flags = flags;
    if tls {
        write_certificates(dir.path())?;
        flags.extend([
            "--cluster-ca-file".to_owned(),
            dir.path().join("ca.pem").display().to_string(),
        ]);
    }
    let mut nodes = Vec::new();
    for n in 0..3 {
        let args = node_flags(&flags, n);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        nodes.push(Gateway::start_on(&bed.nodes[n], &args).await?);
    }
    let c = Cluster {
        runtime_dirs: nodes.iter().map(|n| n.runtime_dir.clone()).collect(),
        ips: bed.nodes.iter().map(|h| h.ip.clone()).collect(),
        tls,
        nodes,
        etcd,
        flags,
        _dir: dir,
    };
    c.settle("every node sees the three", |c| async move {
        for node in &c.nodes {
            let (_, api) = node.get_json("/api").await?;
            if api["kernelgate"]["cluster"]["nodes"]
                .as_array()
                .map(Vec::len)
                != Some(3)
            {
                return Ok(false);
            }
        }
        Ok(true)
    })
    .await?;
    Ok(c)
}

impl Cluster {
    /// Polls `done` every 50 ms for up to 10 s.
    pub async fn settle<'a, F, Fut>(&'a self, what: &str, done: F) -> Result<Duration>
    where
        F: Fn(&'a Cluster) -> Fut,
        Fut: std::future::Future<Output = Result<bool>>,
    {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if done(self).await? {
                return Ok(start.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        anyhow::bail!("not within 10 s: {what}")
    }

    /// Waits until every node lists exactly `expected` (sorted ids); how long it took.
    pub async fn all_list(&self, expected: &[String], what: &str) -> Result<Duration> {
        self.settle(what, |c| async move {
            Ok(c.lists().await?.iter().all(|l| l == expected))
        })
        .await
    }

    /// Whether node `n` answers 200 for kernel `id`.
    pub async fn answers(&self, n: usize, id: &str) -> Result<bool> {
        Ok(self.nodes[n]
            .get_json(&format!("/api/kernels/{id}"))
            .await?
            .0
            == 200)
    }

    /// The kernel ids each node lists, sorted.
    pub async fn lists(&self) -> Result<Vec<Vec<String>>> {
        let mut all = Vec::new();
        for node in &self.nodes {
            let (status, list) = node.get_json("/api/kernels").await?;
            anyhow::ensure!(status == 200, "list answered {status}: {list}");
            let mut ids: Vec<String> = list
                .as_array()
                .context("a list")?
                .iter()
                .filter_map(|k| k["id"].as_str().map(str::to_owned))
                .collect();
            ids.sort();
            all.push(ids);
        }
        Ok(all)
    }

    /// Three kernels created through node-0: one on each node.
    pub async fn one_kernel_each(&self) -> Result<Vec<String>> {
        let mut ids = Vec::new();
        for _ in 0..3 {
            ids.push(
                self.nodes[0].create_kernel().await?["id"]
                    .as_str()
                    .context("id")?
                    .to_owned(),
            );
        }
        Ok(ids)
    }

    /// Three kernels of the key of `token` created through node-0: one on each node.
    pub async fn one_kernel_each_as(&self, token: &str) -> Result<Vec<String>> {
        let mut ids = Vec::new();
        for _ in 0..3 {
            let (status, made) = self.nodes[0]
                .call_as(token, Method::POST, "/api/kernels", Some(json!({})))
                .await?;
            anyhow::ensure!(status == 201, "create answered {status}: {made}");
            ids.push(made["id"].as_str().context("id")?.to_owned());
        }
        Ok(ids)
    }

    /// Every node's containers started as warm kernels (those handed out since included),
    /// once every node's pool is full.
    pub async fn warm_containers(&self) -> Result<Vec<Vec<String>>> {
        let mut all = Vec::new();
        for node in &self.nodes {
            node.wait_pool("filled").await?;
            let out = std::process::Command::new("docker")
                .args(["ps", "-aq", "--no-trunc", "--filter"])
                .arg(format!(
                    "label=org.kernelgate.runtime_dir={}",
                    node.runtime_dir.display()
                ))
                .args(["--filter", "label=org.kernelgate.pool"])
                .output()?;
            let mut ids: Vec<String> = String::from_utf8(out.stdout)?
                .split_whitespace()
                .map(str::to_owned)
                .collect();
            ids.sort();
            all.push(ids);
        }
        Ok(all)
    }

    /// The kernel of `ids` that node `n` owns.
    pub fn kernel_of(&self, ids: &[String], n: usize) -> Result<String> {
        ids.iter()
            .find(|id| self.owner_of(id).ok() == Some(n))
            .cloned()
            .with_context(|| format!("a kernel of node-{n}"))
    }

    /// Whether node `n` says it is `registered` (holds a live lease).
    /// Kernel `id`'s record in etcd.
    pub async fn kernel_record(&self, id: &str) -> Result<serde_json::Value> {
        kernel_record(&reqwest::Client::new(), &self.etcd.url(), id).await
    }

    pub async fn registered(&self, n: usize, registered: bool) -> Result<bool> {
        let (_, api) = self.nodes[n].get_json("/api").await?;
        Ok(api["kernelgate"]["cluster"]["registered"] == registered)
    }

    /// Waits until node-0 and node-1 answer 404 for `id`, at most the lease's TTL (3 s) and
    /// 2 s more after `since`; how long it took.
    pub async fn gone_for_others(&self, id: &str, since: Instant) -> Result<Duration> {
        loop {
            let mut gone = true;
            for n in [0, 1] {
                gone &= self.nodes[n]
                    .get_json(&format!("/api/kernels/{id}"))
                    .await?
                    .0
                    == 404;
            }
            if gone {
                return Ok(since.elapsed());
            }
            anyhow::ensure!(
                since.elapsed() < Duration::from_secs(5),
                "kernel {id} still there for the others after {:?}",
                since.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A call to node `n` (its incarnation `incarnation`) as node-0 forwards it: signed with
    /// the cluster secret for key `key`, without a body, to its cluster listener with
    /// node-0's certificate when the cluster has TLS on.
    pub fn signed_as(
        &self,
        key: &str,
        method: Method,
        path: &str,
        n: usize,
        incarnation: &str,
    ) -> Result<reqwest::RequestBuilder> {
        let who = Forwarded::new(key, "node-0", true, &format!("node-{n}"), incarnation);
        if self.tls {
            let client = self.node_client("ca.pem", "node-0", n)?;
            return self.signed_with(&client, &self.cluster_url(n, path), &who, method, path);
        }
        self.signed_with(
            &reqwest::Client::new(),
            &self.nodes[n].url(path),
            &who,
            method,
            path,
        )
    }

    /// Node `n`'s incarnation, as its record in etcd says.
    pub async fn incarnation(&self, n: usize) -> Result<String> {
        Ok(self.node_record(n).await?.0["incarnation"]
            .as_str()
            .context("an incarnation")?
            .to_owned())
    }

    /// Node `n`'s cluster listener's URL for `path`.
    pub fn cluster_url(&self, n: usize, path: &str) -> String {
        format!("https://{}:{CLUSTER_PORT}{path}", self.ips[n])
    }

    /// A client as a node calls node `n`'s cluster listener: with certificate `cert`
    /// (`node-1`: `node-1.pem` and `.key`), trusting the CAs of `cas`.
    pub fn node_client(&self, cas: &str, cert: &str, n: usize) -> Result<reqwest::Client> {
        use kernelgate::cluster::tls::ClusterTls;
        let dir = self._dir.path();
        // The name the certificate carries: a stranger's names node-0.
        let named = if cert == "stranger" { "node-0" } else { cert };
        let tls = ClusterTls::load(
            &dir.join(cas),
            &dir.join(format!("{cert}.pem")),
            &dir.join(format!("{cert}.key")),
            named,
        )?;
        let config = tls
            .client_config(&format!("node-{n}"))
            .map_err(anyhow::Error::msg)?;
        Ok(reqwest::Client::builder()
            .use_preconfigured_tls((*config).clone())
            .build()?)
    }

    /// A call to `url` (its path: `path`) as node-0 forwards it: `who`, signed with the
    /// cluster secret.
    pub fn signed_with(
        &self,
        client: &reqwest::Client,
        url: &str,
        who: &Forwarded,
        method: Method,
        path: &str,
    ) -> Result<reqwest::RequestBuilder> {
        let secret = std::fs::read_to_string(self._dir.path().join("cluster.secret"))?;
        let mut request = client.request(method.clone(), url);
        let signer = Signer::new(secret.trim_end().as_bytes(), "node-0", "any");
        for (name, value) in signer.sign(method.as_str(), path, who) {
            request = request.header(name, value);
        }
        Ok(request)
    }

    /// Node `n`'s record in etcd, and the lease it is under.
    pub async fn node_record(&self, n: usize) -> Result<(serde_json::Value, String)> {
        let range: serde_json::Value = reqwest::Client::new()
            .post(format!("{}/v3/kv/range", self.etcd.url()))
            .json(&json!({"key": B64.encode(format!("/kernelgate/v1/nodes/node-{n}"))}))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let kv = &range["kvs"][0];
        let value = B64.decode(kv["value"].as_str().context("no such node record")?)?;
        let lease = kv["lease"].as_str().context("a lease")?.to_owned();
        Ok((serde_json::from_slice(&value)?, lease))
    }

    /// Writes node `n`'s record, under `lease`, as someone with write access to etcd can.
    pub async fn put_node_record(
        &self,
        n: usize,
        record: &serde_json::Value,
        lease: &str,
    ) -> Result<()> {
        reqwest::Client::new()
            .post(format!("{}/v3/kv/put", self.etcd.url()))
            .json(&json!({
                "key": B64.encode(format!("/kernelgate/v1/nodes/node-{n}")),
                "value": B64.encode(serde_json::to_vec(record)?),
                "lease": lease,
            }))
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }

    /// Every node the registry's history names as the owner of each kernel key (the
    /// tests' etcd is never compacted).
    pub async fn owners_in_history(
        &self,
    ) -> Result<std::collections::BTreeMap<String, std::collections::BTreeSet<String>>> {
        use futures::StreamExt;
        use kernelgate::cluster::{etcd::Etcd, Event, KernelRecord, Registry, PREFIX};
        let registry = Etcd::new(vec![self.etcd.url()], reqwest::Client::builder())?;
        let mut history = registry.watch(&format!("{PREFIX}kernels/"), 1).await?;
        let mut owners: std::collections::BTreeMap<_, std::collections::BTreeSet<_>> =
            Default::default();
        while let Ok(Some(batch)) =
            tokio::time::timeout(Duration::from_secs(1), history.next()).await
        {
            for event in batch? {
                if let Event::Put(entry) = event {
                    let record: KernelRecord = serde_json::from_slice(&entry.value)?;
                    owners.entry(entry.key).or_default().insert(record.node);
                }
            }
        }
        Ok(owners)
    }

    /// The node whose audit trail says it created `id`.
    pub fn owner_of(&self, id: &str) -> Result<usize> {
        let owners: Vec<usize> = (0..self.nodes.len())
            .filter(|&n| {
                crate::audit_log(&self.nodes[n].audit_log).is_ok_and(|log| {
                    log.iter().any(|e| {
                        matches!(&e.record, Record::KernelCreated { kernel, .. } if kernel == id)
                    })
                })
            })
            .collect();
        anyhow::ensure!(owners.len() == 1, "kernel {id} created by nodes {owners:?}");
        Ok(owners[0])
    }
}

impl Cluster {
    /// Sets node `n`'s cluster address in etcd to `url`, under its lease, as one with write
    /// access to etcd could; its record as it was, and that lease.
    pub async fn plant_cluster_address(
        &self,
        n: usize,
        url: &str,
    ) -> Result<(serde_json::Value, String)> {
        let (record, lease) = self.node_record(n).await?;
        let mut planted = record.clone();
        planted["cluster_address"] = json!(url);
        self.put_node_record(n, &planted, &lease).await?;
        Ok((record, lease))
    }
}

/// Kernel `id`'s record, read from the etcd at `url` with `http`.
pub async fn kernel_record(
    http: &reqwest::Client,
    url: &str,
    id: &str,
) -> Result<serde_json::Value> {
    let range: serde_json::Value = http
        .post(format!("{url}/v3/kv/range"))
        .json(&json!({"key": B64.encode(format!("/kernelgate/v1/kernels/{id}"))}))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let value = B64.decode(
        range["kvs"][0]["value"]
            .as_str()
            .context("no such record")?,
    )?;
    Ok(serde_json::from_slice(&value)?)
}
