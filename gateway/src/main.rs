//! `kernelgate serve`: parses the configuration, connects to Docker, and serves the API
//! until SIGTERM or Ctrl-C, then removes every kernel container it started.

use anyhow::{bail, Context};
use clap::Parser;
use kernelgate::api::ops::{MetricsAccess, Readiness};
use kernelgate::api::origin::OriginPolicy;
use kernelgate::api::{self, auth::Auth, AppState};
use kernelgate::audit::Audit;
use kernelgate::backend::docker::lock::{LockError, RuntimeDirLock};
use kernelgate::backend::docker::{DockerBackend, DockerSettings};
use kernelgate::backend::gvisor::{GvisorEngine, GvisorSettings, ImageResolver};
use kernelgate::backend::KernelBackend;
use kernelgate::cluster::node::{ClusterNode, Offer, AWAY_FOR};
use kernelgate::config::{Cli, Command, Config, EngineChoice, LogFormat, McpArgs};
use kernelgate::kernels::{HeartbeatCheck, Kernels, Settings};
use kernelgate::kernelspecs::KernelSpecs;
use kernelgate::packages::Packages;
use kernelgate::relay::clients::ClientLimits;
use kernelgate::tenants::{generate_token, Keys, Tenant, TOKEN_KEY};
use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let format = match &cli.command {
        Command::Serve(config) => config.log_format,
        Command::Mcp(args) => args.config.log_format,
        Command::Run(_)
        | Command::Keys(_)
        | Command::Audit(_)
        | Command::Packages(_)
        | Command::Image(_) => LogFormat::Text,
    };
    init_logging(format);
    match cli.command {
        Command::Serve(config) => serve(*config).await,
        Command::Mcp(args) => mcp_stdio(*args).await,
        Command::Run(args) => Ok(kernelgate_client::notebook::run(args.into_client()).await?),
        Command::Keys(args) => kernelgate::tenants::keys_command(args),
        Command::Audit(args) => kernelgate::audit::read_back(&args),
        Command::Packages(args) => kernelgate::packages::cli::run(args).await,
        Command::Image(args) => kernelgate::images::cli::run(args),
    }
}

/// Logs go to stderr, filtered by `KERNELGATE_LOG` (default: info for the gateway). JSON
/// lines carry the same fields as text ones: the event's own at the top level, and the
/// request and kernel they happen in under `span`/`spans`.
fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KERNELGATE_LOG")
        .unwrap_or_else(|_| "kernelgate=info,warn".into());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .init(),
    }
}

/// What a configuration asks for, checked before anything starts: the kernel specs, the
/// audit log (opened), the execution policy (parsed).
struct Prepared {
    specs: KernelSpecs,
    audit: Audit,
    audit_path: std::path::PathBuf,
    guard: Option<Arc<kernelgate::policy::Guard>>,
    cluster: Option<Arc<ClusterNode>>,
    packages: Option<Arc<Packages>>,
}

fn prepare(
    config: &Config,
    tracker: &TaskTracker,
    cancel: &CancellationToken,
) -> anyhow::Result<Prepared> {
    if !(config.kernel_cpus.is_finite() && config.kernel_cpus > 0.0) {
        bail!("--kernel-cpus must be a number above 0 (e.g. 0.5 or 2)");
    }
    let specs = KernelSpecs::parse(&config.image, &config.kernelspecs, &config.pool_size)
        .map_err(anyhow::Error::msg)?;
    let audit_path = config
        .audit_log
        .clone()
        .unwrap_or_else(kernelgate::config::default_audit_log);
    let audit = if audit_path == std::path::Path::new("off") {
        tracing::warn!("the audit trail is OFF (--audit-log off)");
        Audit::disabled()
    } else {
        Audit::open(&audit_path, config.audit_fsync).with_context(|| {
            format!(
                "cannot open the audit log {} (choose another with --audit-log, or `off`)",
                audit_path.display()
            )
        })?
    };
    let packages = Packages::start(
        &config.packages,
        config.wheelhouse.as_deref(),
        &config.runtime_dir,
        kernelgate::kernelspecs::DEFAULT_SPEC,
        &specs.names_list(),
    )
    .map_err(anyhow::Error::msg)?
    .map(Arc::new);
    if let Some(p) = &packages {
        tracing::info!(wheelhouse = %p.mounts().wheelhouse.display(), "package allowlists in force");
    }
    let guard = match &config.policy {
        None => None,
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the policy file {}", path.display()))?;
            let policy = kernelgate_policy::Policy::from_toml(&text).map_err(|e| {
                anyhow::anyhow!("policy file {}: {e} (see docs/policy.md)", path.display())
            })?;
            tracing::info!(policy = %path.display(), rules = policy.rules(), "execution policy in force");
            let policy = match &packages {
                Some(p) => {
                    let p = p.clone();
                    policy.with_installable(kernelgate_policy::Installable(Arc::new(
                        move |name: &str| p.allows(name),
                    )))
                }
                None => policy,
            };
            Some(kernelgate::policy::Guard::new(
                policy,
                Duration::from_secs(config.approval_timeout),
                tracker.clone(),
                cancel.clone(),
            ))
        }
    };
    let cluster = ClusterNode::from_args(
        &config.cluster,
        Offer {
            capacity: config.max_kernels,
            specs: specs.names_list(),
            max_body: config.max_message_mb * 1024 * 1024,
        },
        tracker,
        cancel,
    )?;
    Ok(Prepared {
        specs,
        audit,
        audit_path,
        guard,
        cluster,
        packages,
    })
}

/// The gVisor engine `config` asks for: refused unless root, or without runsc.
fn gvisor_engine(config: &Config, packages: Option<&Packages>) -> anyhow::Result<GvisorEngine> {
    kernelgate::backend::gvisor::check_privileges().map_err(anyhow::Error::msg)?;
    kernelgate::backend::gvisor::cgroup_parent::choose(
        &config.cgroup_parent,
        kernelgate::backend::gvisor::Cgroups::detect(),
    )
    .map_err(anyhow::Error::msg)?;
    let settings = GvisorSettings {
        runsc: config
            .runsc
            .clone()
            .unwrap_or_else(kernelgate::backend::gvisor::default_runsc),
        image: config.image.clone(),
        runtime_dir: config.runtime_dir.clone(),
        memory_mb: config.kernel_memory_mb,
        cpus: config.kernel_cpus,
        pids: config.kernel_pids,
        disk_mb: config.kernel_disk_mb,
        packages: packages.map(|p| p.mounts().clone()),
    };
    let store = kernelgate::images::ImageStore::open(config.image_store.clone())
        .context("cannot open the image store (--image-store)")?;
    let resolve: ImageResolver =
        Arc::new(move |r| kernelgate::backend::gvisor::images::resolve(&store, r));
    GvisorEngine::new(settings, resolve).context("cannot start kernels")
}

/// The kernel table a configuration asks for, on the engine it names.
struct Table {
    kernels: Arc<Kernels>,
    runtime: &'static str,
    guard: Option<Arc<kernelgate::policy::Guard>>,
    audit_path: std::path::PathBuf,
    cluster: Option<Arc<ClusterNode>>,
}

/// Connects to Docker and starts the table: containers of an earlier run are re-adopted
/// and warm pools begin to fill.
async fn kernel_table(
    config: &Config,
    prepared: Prepared,
    tracker: &TaskTracker,
    cancel: &CancellationToken,
) -> anyhow::Result<Table> {
    let Prepared {
        mut specs,
        audit,
        audit_path,
        guard,
        cluster,
        packages,
    } = prepared;
    let (backend, runtime): (Arc<dyn KernelBackend>, &'static str) = match config.engine {
        EngineChoice::Docker => {
            let mut docker_settings = DockerSettings::from(config);
            docker_settings.packages = packages.as_ref().map(|p| p.mounts().clone());
            let backend = DockerBackend::connect(docker_settings)
                .await
                .context("cannot start kernels")?;
            let runtime = backend.runtime().name();
            (Arc::new(backend), runtime)
        }
        EngineChoice::Gvisor => (
            Arc::new(gvisor_engine(config, packages.as_deref())?),
            "gvisor",
        ),
    };
    backend.check().await.context("cannot start kernels")?;
    specs.describe(backend.as_ref()).await;
    let settings = Settings {
        audit,
        guard: guard.clone(),
        ledger: cluster
            .as_ref()
            .map(|c| c.membership.clone() as Arc<dyn kernelgate::kernels::ledger::Ledger>),
        max_kernels: config.max_kernels,
        startup_timeout: Duration::from_secs(config.startup_timeout),
        autorestart: config.autorestart,
        cull_idle_timeout: (config.cull_idle_timeout > 0)
            .then(|| Duration::from_secs(config.cull_idle_timeout)),
        heartbeat: HeartbeatCheck::default(),
        hibernate: kernelgate::kernels::hibernate::Policy {
            after: (config.hibernate_after > 0)
                .then(|| Duration::from_secs(config.hibernate_after)),
            dir: config.hibernate_dir.clone(),
            max_bytes: config.hibernate_max_mb << 20,
            max_hibernated: config.max_hibernated,
            retention: (config.hibernate_retention > 0)
                .then(|| Duration::from_secs(config.hibernate_retention)),
            lossy: config.hibernate_lossy,
            save_timeout: Duration::from_secs(config.hibernate_save_timeout),
            command_timeout: Duration::from_secs(config.sandbox_command_timeout),
            per_key: match config.max_hibernated_per_key {
                0 => config.max_hibernated.div_ceil(4).max(1),
                n => n,
            },
            key_max_bytes: config.hibernate_key_max_mb << 20,
            runtime_dir: config.runtime_dir.display().to_string(),
        },
        snapshots: kernelgate::kernels::snapshots::Policy {
            per_key: config.snapshots_per_key,
            key_max_bytes: config.snapshot_key_max_mb << 20,
            retention: (config.snapshot_retention > 0)
                .then(|| Duration::from_secs(config.snapshot_retention)),
        },
        packages,
        templates: config.kernel_templates,
        specs: Arc::new(specs),
        limits: ClientLimits {
            kernel_message_bytes: config.max_message_mb * 1024 * 1024,
            buffer_bytes: config.client_buffer_mb * 1024 * 1024,
            output_bytes: config.max_output_mb * 1024 * 1024,
            replay_for: Duration::from_secs(600),
        },
    };
    let kernels = Kernels::new(backend, settings, tracker.clone(), cancel.clone());
    kernels.start().await;
    Ok(Table {
        kernels,
        runtime,
        guard,
        audit_path,
        cluster,
    })
}

/// `kernelgate serve`: every flag is checked and the address bound before any container
/// starts, so a mistake costs nothing; then the table starts and the API serves until
/// SIGTERM or Ctrl-C, after which every kernel is removed.
async fn serve(config: Config) -> anyhow::Result<()> {
    if config.engine == EngineChoice::Gvisor {
        // Before anything of the gateway's is created.
        kernelgate::backend::gvisor::check_privileges().map_err(anyhow::Error::msg)?;
    }
    let (keys, generated) = auth_from(&config)?;
    let keys = Arc::new(keys);
    let metrics_access = metrics_access(&config)?;
    let _lock = RuntimeDirLock::acquire(&config.runtime_dir)?;
    let tracker = TaskTracker::new();
    let cancel = CancellationToken::new();
    let prepared = prepare(&config, &tracker, &cancel)?;
    if let Some(node) = &prepared.cluster {
        // Kernels re-adopted at start take back their keys' quota slots by these.
        let keys = keys.clone();
        node.membership.set_quotas(Box::new(move |name| {
            keys.tenant_named(name).and_then(|t| t.max_kernels)
        }));
        if !kernelgate::metrics::set_node(&node.node_id) {
            tracing::warn!(
                "metrics were recorded before the node was known: they carry no node label"
            );
        }
    }
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let cluster_listener = cluster_listener(&config, prepared.cluster.as_deref()).await?;
    let Table {
        kernels,
        runtime,
        guard,
        audit_path,
        cluster,
    } = kernel_table(&config, prepared, &tracker, &cancel).await?;
    let node = cluster.clone();
    // Sandbox access tokens: the same on every node of a cluster (derived from its secret),
    // else this gateway's own key in its runtime directory; either way the same after a
    // restart, with the sandboxes' records kept there too.
    let e2b_token_key = match &cluster {
        Some(node) => node.signer.e2b_token_key(),
        None => api::e2b::store::token_key(&config.runtime_dir)?,
    };
    let e2b = Arc::new(api::e2b::Sandboxes::open(
        e2b_token_key,
        &config.runtime_dir,
    )?);
    if let Some(node) = &cluster {
        node.start(&kernels, &tracker, &cancel);
        tracing::info!(node = %node.node_id, etcd = ?config.cluster.etcd, "cluster mode");
    }
    let mcp = kernelgate::mcp::Mcp::new(
        kernels.clone(),
        tracker.clone(),
        cancel.clone(),
        Duration::from_secs(config.mcp_idle_timeout),
        kernelgate::mcp::budget::Budget::from_kib(config.mcp_max_result_kb),
    );
    let state = AppState {
        kernels: kernels.clone(),
        keys: keys.clone(),
        failures: Arc::default(),
        max_message_bytes: config.max_message_mb * 1024 * 1024,
        cancel: cancel.clone(),
        tracker: tracker.clone(),
        metrics_access,
        readiness: Arc::new(Readiness::default()),
        origins: Arc::new(OriginPolicy {
            allowed: config.allow_origin.clone(),
            loopback_hosts_only: config.no_auth,
        }),
        runtime,
        guard,
        mcp: Arc::new(kernelgate::api::mcp::Endpoint::new(
            mcp,
            config.max_message_mb * 1024 * 1024,
        )),
        cluster,
        e2b,
    };
    api::e2b::watch_all(&state);
    if let Some((listener, tls)) = cluster_listener {
        let state = state.clone();
        tracker.spawn(async move {
            if let Err(e) = api::peers::serve(listener, tls, state).await {
                tracing::error!(error = %e, "the cluster listener stopped");
            }
        });
    }
    let url = format!("http://{}/", config.listen);
    match generated {
        Some(token) => println!("Kernelgate is serving at {url}?token={token}"),
        None => println!("Kernelgate is serving at {url}"),
    }
    match runtime {
        "gvisor" => println!("Kernels run in gVisor sandboxes under runsc (no Docker)"),
        "runsc" | "runsc-ptrace" => {
            println!("Kernels run in Docker under gVisor (runtime {runtime})")
        }
        _ => println!("Kernels run in Docker under runc (no gVisor: see `make gvisor`)"),
    }
    tracing::info!(listen = %config.listen, image = %config.image, runtime, audit_log = %audit_path.display(), "ready");

    tracker.spawn(reload_on_sighup(
        kernels.audit().clone(),
        keys.clone(),
        kernels.clone(),
        cancel.clone(),
    ));
    api::serve(listener, state, async {
        kernelgate_client::stop_signal().await;
        tracing::info!("shutting down");
    })
    .await?;
    if let Some(node) = node {
        // Warm kernels are nobody's: removed, whether the node returns or not.
        kernels.pool().remove_warm().await;
        if kernels.list().is_empty() {
            // Nothing to come back for (a node being retired): it leaves the cluster now.
            if let Err(e) = node.membership.leave().await {
                tracing::warn!(error = %e, "cannot leave the cluster registry now: this node's record goes when its lease ends");
            }
            tracing::info!("cluster mode: no kernel left on this node; it left the cluster");
        } else {
            // Another node may be asked for them meanwhile (503 until this one is back);
            // this node re-adopts them when it starts again on the same runtime directory.
            if let Err(e) = node.membership.step_away(AWAY_FOR).await {
                tracing::warn!(error = %e, "cannot mark this node away in the cluster registry: its kernels answer 404 once its lease ends, until it is back");
            }
            kernels.leave();
            tracing::info!(away_for = ?AWAY_FOR, "cluster mode: the kernels keep running for this node's return");
        }
    } else {
        kernels.shutdown().await;
        if kernels.list().is_empty() {
            api::e2b::store::forget(&config.runtime_dir);
        }
        // No container mounts the installer any more (a cluster node's keep running).
        if let Some(packages) = kernels.packages() {
            packages.remove_installer();
        }
    }
    drain(&tracker).await;
    Ok(())
}

/// The cluster listener (`--cluster-listen`), bound, with its TLS configuration.
async fn cluster_listener(
    config: &Config,
    node: Option<&ClusterNode>,
) -> anyhow::Result<Option<(tokio::net::TcpListener, Arc<rustls::ServerConfig>)>> {
    let (Some(addr), Some(tls)) = (
        config.cluster.cluster_listen,
        node.and_then(|n| n.tls.as_ref()),
    ) else {
        return Ok(None);
    };
    let server = tls
        .server_config()
        .map_err(|e| anyhow::anyhow!("--cluster-cert-file and --cluster-key-file: {e}"))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on --cluster-listen {addr}"))?;
    tracing::info!(cluster_listen = %addr, "calls between nodes over mutual TLS");
    Ok(Some((listener, server)))
}

/// `kernelgate mcp`: one MCP session over stdin/stdout, its kernels on the local Docker
/// engine, until EOF or a signal; then every kernel it started is removed.
async fn mcp_stdio(args: McpArgs) -> anyhow::Result<()> {
    let mut config = args.config;
    if config.cluster.any() {
        bail!("--etcd, --node-id, --advertise, --cluster-secret-file, --cluster-listen and the --etcd-* and --cluster-*-file options belong to `kernelgate serve`; `kernelgate mcp` runs its own kernels, or uses a gateway's with --url");
    }
    if let Some(url) = &args.url {
        let token = match &args.token_file {
            Some(path) => Some(kernelgate::mcp::remote::read_token_file(path)?),
            None => config.token.clone(),
        };
        return mcp_stdio_remote(url, token, &config).await;
    }
    if config.audit_log.as_deref() == Some(std::path::Path::new("-")) {
        bail!("--audit-log - would write into the MCP stream on stdout; give a file (or `off`)");
    }
    let base = config.runtime_dir.clone();
    // The first runtime directory no other process holds: several hosts may each launch one.
    let mut lock = None;
    for n in 0..64 {
        let dir = base.join(n.to_string());
        match RuntimeDirLock::acquire(&dir) {
            Ok(l) => {
                config.runtime_dir = dir;
                lock = Some(l);
                break;
            }
            Err(LockError::InUse(_)) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    let Some(_lock) = lock else {
        bail!(
            "64 kernelgate mcp processes hold the runtime directories under {}; stop one or pass another --runtime-dir",
            base.display()
        );
    };
    let tracker = TaskTracker::new();
    let cancel = CancellationToken::new();
    let prepared = prepare(&config, &tracker, &cancel)?;
    let table = kernel_table(&config, prepared, &tracker, &cancel).await?;
    tracing::info!(runtime_dir = %config.runtime_dir.display(), runtime = table.runtime, audit_log = %table.audit_path.display(), "serving MCP on stdio");
    let mcp = kernelgate::mcp::Mcp::new(
        table.kernels.clone(),
        tracker.clone(),
        cancel.clone(),
        Duration::from_secs(config.mcp_idle_timeout),
        kernelgate::mcp::budget::Budget::from_kib(config.mcp_max_result_kb),
    );
    let served = tokio::select! {
        served = kernelgate::mcp::stdio::serve(mcp, Tenant::admin(TOKEN_KEY)) => served,
        _ = kernelgate_client::stop_signal() => Ok(()),
    };
    cancel.cancel();
    table.kernels.shutdown().await;
    if let Some(packages) = table.kernels.packages() {
        packages.remove_installer();
    }
    drain(&tracker).await;
    Ok(served?)
}

/// `kernelgate mcp --url`: one MCP session over stdin/stdout whose kernels are a running
/// gateway's, deleted when the session ends.
async fn mcp_stdio_remote(url: &str, token: Option<String>, config: &Config) -> anyhow::Result<()> {
    let gateway = kernelgate::mcp::remote::Remote::new(url, token);
    gateway
        .check()
        .await
        .with_context(|| {
            format!("cannot use the gateway at {url} (check --url, and the token: --token-file or KERNELGATE_TOKEN)")
        })?;
    let tracker = TaskTracker::new();
    let cancel = CancellationToken::new();
    let mcp = kernelgate::mcp::Mcp::remote(
        gateway,
        tracker.clone(),
        cancel.clone(),
        Duration::from_secs(config.mcp_idle_timeout),
        kernelgate::mcp::budget::Budget::from_kib(config.mcp_max_result_kb),
    );
    tracing::info!(%url, "serving MCP on stdio with a remote gateway's kernels");
    // The tenant is the gateway's business: it knows the token.
    let served = tokio::select! {
        served = kernelgate::mcp::stdio::serve(mcp.clone(), Tenant::admin(TOKEN_KEY)) => served,
        _ = kernelgate_client::stop_signal() => Ok(()),
    };
    mcp.release_handles().await;
    // Stops the idle reaper; the deletion of the session's kernel, started when the
    // session ended, runs on and is waited for.
    cancel.cancel();
    drain(&tracker).await;
    Ok(served?)
}

/// Waits for the process's tasks to end (they were told to stop), 10 s at most.
async fn drain(tracker: &TaskTracker) {
    tracker.close();
    if tokio::time::timeout(Duration::from_secs(10), tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("some tasks did not stop within 10 s");
    }
}

/// `/metrics` takes the gateway's token (or a metrics-only one) unless made public.
fn metrics_access(config: &Config) -> anyhow::Result<MetricsAccess> {
    match (&config.metrics_token, config.metrics_public) {
        (Some(_), true) => {
            bail!("--metrics-public and --metrics-token contradict each other; pass one")
        }
        (Some(t), false) if t.is_empty() => {
            bail!("--metrics-token is empty; give a token or leave it out")
        }
        (Some(t), false) => Ok(MetricsAccess::Tokens {
            scrape: Some(Auth::token(t)),
        }),
        (None, true) => Ok(MetricsAccess::Public),
        (None, false) => Ok(MetricsAccess::Tokens { scrape: None }),
    }
}

/// Secure by default: a token unless `--no-auth`, which only loopback may use.
fn auth_from(config: &Config) -> anyhow::Result<(Keys, Option<String>)> {
    if config.no_auth {
        if config.token.is_some() || config.keys.is_some() {
            bail!("--no-auth contradicts --token and --keys; pass one");
        }
        if !config.listen.ip().is_loopback() {
            bail!(
                "--no-auth is refused on {}: anyone who can reach it could run code. \
                 Listen on 127.0.0.1 or use a token",
                config.listen
            );
        }
        tracing::warn!("authentication is OFF: any local process can run code in kernels");
        return Ok((Keys::disabled(), None));
    }
    let (token, generated) = match (&config.token, &config.keys) {
        (Some(t), _) if t.is_empty() => {
            bail!("--token is empty; give a token or pass --no-auth")
        }
        (Some(t), _) => (Some(t.clone()), None),
        // Keys alone: no admin token unless a key is an admin.
        (None, Some(_)) => (None, None),
        (None, None) => {
            let token = generate_token();
            (Some(token.clone()), Some(token))
        }
    };
    let keys = Keys::new(token.as_deref(), config.keys.clone()).map_err(anyhow::Error::msg)?;
    Ok((keys, generated))
}

/// On SIGHUP the audit log is reopened (log rotation), the package allowlists and the keys
/// file read again:
/// revoked keys are refused from then on, their WebSockets close, and their kernels are
/// removed.
async fn reload_on_sighup(
    audit: Audit,
    keys: Arc<Keys>,
    kernels: Arc<Kernels>,
    cancel: CancellationToken,
) {
    let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP: keys are read at start only");
        return;
    };
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            got = hup.recv() => if got.is_none() { return },
        }
        if let Err(e) = audit.reopen().await {
            tracing::error!(error = %e, "cannot reopen the audit log; records go to the old file");
        }
        if let Some(packages) = kernels.packages() {
            match packages.reload() {
                Ok(entries) => tracing::info!(entries, "package allowlists reloaded"),
                Err(e) => {
                    tracing::error!(error = %e, "package allowlists not reloaded; the lists in force stay")
                }
            }
        }
        match keys.reload() {
            Err(e) => tracing::error!(error = %e, "keys file not reloaded; the keys in force stay"),
            Ok(revoked) => {
                tracing::info!(revoked = revoked.len(), "keys file reloaded");
                for tenant in revoked {
                    let removed = kernels.remove_owned_by(&tenant.name).await;
                    tracing::info!(key = %tenant.name, kernels = removed.len(), "key revoked; its kernels were shut down");
                }
            }
        }
    }
}
