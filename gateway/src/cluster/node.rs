//! This gateway as a node of a cluster: its flags checked, its membership in the registry
//! (which is also the kernel table's [`Ledger`](crate::kernels::ledger::Ledger)), the
//! signer of node-to-node calls and the forwarder. Made before the kernel table, started
//! once the listener is bound.

use super::etcd::Etcd;
use super::forward::Forwarder;
use super::membership::{Membership, Reconciled};
use super::signing::Signer;
use super::tls::ClusterTls;
use super::NodeRecord;
use crate::config::ClusterArgs;
use crate::kernels::{Kernels, Removal};
use anyhow::{bail, Context};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How often the registry is compared with the kernel table.
const RECONCILE_EVERY: Duration = Duration::from_secs(30);

/// How long a stopped node's kernels stay registered for its return (SIGTERM in cluster
/// mode): 503 with Retry-After for them meanwhile, 404 after.
pub const AWAY_FOR: Duration = Duration::from_secs(120);

/// The shortest cluster secret accepted.
const MIN_SECRET_BYTES: usize = 32;

/// One node of the cluster.
#[derive(Debug)]
pub struct ClusterNode {
    pub node_id: String,
    pub membership: Arc<Membership<Etcd>>,
    pub signer: Arc<Signer>,
    pub forwarder: Forwarder,
    /// Mutual TLS between nodes (`--cluster-listen`): forwarded calls then come only on the
    /// cluster listener.
    pub tls: Option<Arc<ClusterTls>>,
    /// MCP sessions found on other nodes: session id to node id.
    pub mcp_sessions: std::sync::Mutex<std::collections::HashMap<String, String>>,
}

/// What the node's own record says of it at start.
#[derive(Debug)]
pub struct Offer {
    pub capacity: usize,
    pub specs: Vec<String>,
    /// The largest body a call may carry (`--max-message-mb`): forwarded ones too.
    pub max_body: usize,
}

impl ClusterNode {
    /// The node the flags ask for, or `None` without `--etcd` (a single node). Checks
    /// every cluster flag; contacts nothing yet.
    pub fn from_args(
        args: &ClusterArgs,
        offer: Offer,
        tracker: &TaskTracker,
        cancel: &CancellationToken,
    ) -> anyhow::Result<Option<Arc<ClusterNode>>> {
        if args.etcd.is_empty() {
            if args.any() {
                bail!(
                    "--node-id, --advertise, --cluster-secret-file, --cluster-listen and the \
                     --etcd-* and --cluster-*-file options belong to cluster mode: give --etcd too, or leave them out for a single gateway"
                );
            }
            return Ok(None);
        }
        for url in &args.etcd {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                bail!("--etcd {url:?}: give etcd's client URL, like http://etcd:2379 or https://etcd:2379");
            }
        }
        let tls = args.etcd_ca_file.is_some() || args.etcd_cert_file.is_some();
        if tls && args.etcd.iter().any(|url| url.starts_with("http://")) {
            bail!("--etcd-ca-file and --etcd-cert-file are for an etcd that serves TLS: give its https:// URLs in --etcd");
        }
        let Some(advertise) = args.advertise.clone() else {
            bail!("--etcd needs --advertise: the URL other nodes reach this one at (http://host:port)");
        };
        if !advertise.starts_with("http://") {
            bail!("--advertise {advertise:?}: give http://host:port");
        }
        let Some(secret_file) = &args.cluster_secret_file else {
            bail!("--etcd needs --cluster-secret-file: a file with the secret every node shares (at least {MIN_SECRET_BYTES} bytes)");
        };
        let secret = std::fs::read(secret_file)
            .with_context(|| format!("cannot read the cluster secret {}", secret_file.display()))?;
        let secret = secret.strip_suffix(b"\n").unwrap_or(&secret).to_vec();
        if secret.len() < MIN_SECRET_BYTES {
            bail!(
                "the cluster secret in {} has {} bytes; give at least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)",
                secret_file.display(),
                secret.len()
            );
        }
        let node_id = match &args.node_id {
            Some(id) => id.clone(),
            None => hostname()?,
        };
        if node_id.is_empty() || node_id.contains('/') || node_id.len() > 128 {
            bail!("--node-id {node_id:?}: give a name without '/' of at most 128 characters");
        }
        let (tls, cluster_address) = cluster_tls(args, &node_id, &advertise)?;
        let mut registry = Etcd::new(args.etcd.clone(), etcd_tls(args)?)
            .map_err(|e| anyhow::anyhow!("--etcd: {e}"))?;
        match (&args.etcd_user, &args.etcd_password_file) {
            (Some(user), Some(file)) => {
                let password = std::fs::read_to_string(file).with_context(|| {
                    format!("cannot read the etcd password file {}", file.display())
                })?;
                let password = password.strip_suffix('\n').unwrap_or(&password);
                registry = registry.with_user(user, password);
            }
            (None, None) => {}
            _ => bail!("--etcd-user and --etcd-password-file go together: give both, or neither for an etcd without authentication"),
        }
        let record = NodeRecord {
            address: advertise.trim_end_matches('/').to_owned(),
            cluster_address,
            incarnation: uuid::Uuid::new_v4().simple().to_string(),
            capacity: u32::try_from(offer.capacity).unwrap_or(u32::MAX),
            load: 0,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            specs: offer.specs,
            warm: Default::default(),
            away: false,
            indexed: true,
        };
        let ttl = Duration::from_secs(args.lease_ttl);
        let signer = Arc::new(Signer::new(&secret, &node_id, &record.incarnation));
        let membership = Membership::new(registry, &node_id, record, ttl);
        let forwarder = Forwarder::new(signer.clone(), &node_id, tracker.clone(), cancel.clone())
            .context("cannot set up node-to-node calls")?
            .bounded(offer.max_body)
            .with_tls(tls.clone());
        Ok(Some(Arc::new(ClusterNode {
            node_id,
            membership,
            signer,
            forwarder,
            tls,
            mcp_sessions: Default::default(),
        })))
    }

    /// Keeps the lease, follows the registry and reconciles it with `kernels` until
    /// `cancel`. A kernel re-adopted at start whose key is at its `max_kernels` by the time
    /// it is registered (the node was away past its lease, and the key's owner created
    /// another meanwhile) is removed: the cluster had already counted it gone.
    pub fn start(&self, kernels: &Arc<Kernels>, tracker: &TaskTracker, cancel: &CancellationToken) {
        let (table, tasks) = (kernels.clone(), tracker.clone());
        tracker.spawn(self.membership.clone().keep(cancel.clone(), move |lost| {
            if !lost.taken.is_empty() {
                tracing::error!(kernels = ?lost.taken, "kernels of this node were claimed by another node while it was cut off; they stay here but unregistered");
            }
            for (id, key) in lost.over_quota {
                tracing::warn!(kernel = %id, %key, "a kernel taken back at start is refused: its key is at its max_kernels across the cluster (it created another while this node was away); the kernel is removed");
                let table = table.clone();
                tasks.spawn(async move {
                    let why = format!("key {key:?} was at its max_kernels when this node took the kernel back");
                    if let Some(Err(e)) = table.delete(&id, Removal::Because(why)).await {
                        tracing::warn!(kernel = %id, error = %e, "cannot remove a kernel refused by its key's quota");
                    }
                });
            }
        }));
        tracker.spawn(self.membership.clone().follow(cancel.clone()));
        tracker.spawn(reconcile(
            self.membership.clone(),
            kernels.clone(),
            cancel.clone(),
        ));
    }
}

/// Every [`RECONCILE_EVERY`], the registry against the kernel table, both ways (see
/// [`Membership::reconcile`]); what it fixes is logged and counted in the metrics.
async fn reconcile(
    membership: Arc<Membership<Etcd>>,
    kernels: Arc<Kernels>,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(RECONCILE_EVERY) => {}
        }
        let local: Vec<(String, String, String)> = kernels
            .list()
            .iter()
            .map(|k| (k.id().to_owned(), k.owner().to_owned(), k.name.clone()))
            .collect();
        match membership.reconcile(&local).await {
            Ok(fixed) => {
                if fixed != Reconciled::default() {
                    tracing::warn!(
                        ?fixed,
                        "the cluster registry differed from this node's kernels; fixed what it could"
                    );
                }
                crate::metrics::reconciled("stale_record", fixed.stale_records);
                crate::metrics::reconciled("unregistered_kernel", fixed.unregistered_kernels);
                crate::metrics::reconciled("missing_slot", fixed.missing_slots);
                crate::metrics::reconciled("stale_slot", fixed.stale_slots);
                crate::metrics::reconciled("over_quota", fixed.over_quota);
            }
            Err(e) => tracing::debug!(error = %e, "cannot reconcile with the cluster registry now"),
        }
    }
}

/// The HTTP client for etcd with the TLS the flags ask for: etcd's CA (else the system's
/// roots) and this node's client certificate for an etcd with `--client-cert-auth`.
fn etcd_tls(args: &ClusterArgs) -> anyhow::Result<reqwest::ClientBuilder> {
    let mut http = reqwest::Client::builder().use_rustls_tls();
    if let Some(ca) = &args.etcd_ca_file {
        let pem = std::fs::read(ca)
            .with_context(|| format!("cannot read the etcd CA file {}", ca.display()))?;
        let roots = reqwest::Certificate::from_pem_bundle(&pem)
            .with_context(|| format!("--etcd-ca-file {}: give PEM certificates", ca.display()))?;
        if roots.is_empty() {
            bail!("--etcd-ca-file {}: no PEM certificate in it", ca.display());
        }
        http = http.tls_built_in_root_certs(false);
        for root in roots {
            http = http.add_root_certificate(root);
        }
    }
    match (&args.etcd_cert_file, &args.etcd_key_file) {
        (Some(cert), Some(key)) => {
            let mut pem = std::fs::read(cert)
                .with_context(|| format!("cannot read the etcd client certificate {}", cert.display()))?;
            pem.push(b'\n');
            pem.extend(
                std::fs::read(key)
                    .with_context(|| format!("cannot read the etcd client key {}", key.display()))?,
            );
            let identity = reqwest::Identity::from_pem(&pem).with_context(|| {
                format!(
                    "--etcd-cert-file {} with --etcd-key-file {}: give a PEM certificate and its PEM private key",
                    cert.display(),
                    key.display()
                )
            })?;
            http = http.identity(identity);
        }
        (None, None) => {}
        _ => bail!("--etcd-cert-file and --etcd-key-file go together: give both, or neither for an etcd that does not ask for client certificates"),
    }
    Ok(http)
}

/// The cluster's TLS the flags ask for, with the address this node's cluster listener is
/// advertised at: `--advertise`'s host with `--cluster-listen`'s port, over `https://`.
fn cluster_tls(
    args: &ClusterArgs,
    node_id: &str,
    advertise: &str,
) -> anyhow::Result<(Option<Arc<ClusterTls>>, Option<String>)> {
    let files = (
        &args.cluster_ca_file,
        &args.cluster_cert_file,
        &args.cluster_key_file,
    );
    let Some(listen) = args.cluster_listen else {
        if files.0.is_some() || files.1.is_some() || files.2.is_some() {
            bail!("--cluster-ca-file, --cluster-cert-file and --cluster-key-file are for the cluster listener: give --cluster-listen too");
        }
        return Ok((None, None));
    };
    let (Some(ca), Some(cert), Some(key)) = files else {
        bail!("--cluster-listen needs --cluster-ca-file, --cluster-cert-file and --cluster-key-file: the cluster's CA, and this node's certificate (naming {node_id:?}) and key (docs/cluster.md says how to make them)");
    };
    if listen.port() == 0 {
        bail!("--cluster-listen {listen}: give the port the other nodes reach it at");
    }
    let host = advertise
        .trim_end_matches('/')
        .strip_prefix("http://")
        .and_then(|a| a.rsplit_once(':'))
        .map(|(host, _)| host)
        .filter(|host| !host.is_empty())
        .with_context(|| format!("--advertise {advertise:?}: give http://host:port"))?;
    let tls = ClusterTls::load(ca, cert, key, node_id)?;
    Ok((
        Some(Arc::new(tls)),
        Some(format!("https://{host}:{}", listen.port())),
    ))
}

fn hostname() -> anyhow::Result<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .context("cannot read the host name; give --node-id")?;
    Ok(name.trim().to_owned())
}
