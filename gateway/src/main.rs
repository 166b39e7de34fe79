//! `kernelgate serve`: parses the configuration, connects to Docker, and serves the API
//! until SIGTERM or Ctrl-C, then removes every kernel container it started.

use anyhow::{bail, Context};
use axum::serve::ListenerExt;
use clap::Parser;
use kernelgate::api::ops::{MetricsAccess, Readiness};
use kernelgate::api::origin::OriginPolicy;
use kernelgate::api::{self, auth::Auth, AppState};
use kernelgate::backend::docker::{DockerBackend, DockerSettings};
use kernelgate::backend::KernelBackend;
use kernelgate::config::{Cli, Command, Config, LogFormat};
use kernelgate::kernel::clients::ClientLimits;
use kernelgate::kernels::{HeartbeatCheck, Kernels, Settings};
use kernelgate::kernelspecs::KernelSpecs;
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
        Command::Run(_) => LogFormat::Text,
    };
    init_logging(format);
    match cli.command {
        Command::Serve(config) => serve(*config).await,
        Command::Run(args) => Ok(kernelgate::notebook::run(*args).await?),
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

async fn serve(config: Config) -> anyhow::Result<()> {
    let (auth, generated) = auth_from(&config)?;
    if !(config.kernel_cpus.is_finite() && config.kernel_cpus > 0.0) {
        bail!("--kernel-cpus must be a number above 0 (e.g. 0.5 or 2)");
    }
    let mut specs = KernelSpecs::parse(&config.image, &config.kernelspecs, &config.pool_size)
        .map_err(anyhow::Error::msg)?;
    let backend = DockerBackend::connect(DockerSettings::from(&config))
        .await
        .context("cannot start kernels")?;
    backend.check().await.context("cannot start kernels")?;
    let runtime = backend.runtime().name();
    specs.describe(&backend).await;
    let backend: Arc<dyn KernelBackend> = Arc::new(backend);

    let tracker = TaskTracker::new();
    let cancel = CancellationToken::new();
    let settings = Settings {
        max_kernels: config.max_kernels,
        startup_timeout: Duration::from_secs(config.startup_timeout),
        autorestart: config.autorestart,
        cull_idle_timeout: (config.cull_idle_timeout > 0)
            .then(|| Duration::from_secs(config.cull_idle_timeout)),
        heartbeat: HeartbeatCheck::default(),
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

    let state = AppState {
        kernels: kernels.clone(),
        auth,
        max_message_bytes: config.max_message_mb * 1024 * 1024,
        cancel: cancel.clone(),
        tracker: tracker.clone(),
        metrics_access: metrics_access(&config)?,
        readiness: Arc::new(Readiness::default()),
        origins: Arc::new(OriginPolicy {
            allowed: config.allow_origin.clone(),
            loopback_hosts_only: config.no_auth,
        }),
        runtime,
    };
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?
        .tap_io(|tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "cannot set TCP_NODELAY");
            }
        });
    let url = format!("http://{}/", config.listen);
    match generated {
        Some(token) => println!("Kernelgate is serving at {url}?token={token}"),
        None => println!("Kernelgate is serving at {url}"),
    }
    match runtime {
        "runsc" => println!("Kernels run in Docker under gVisor (runtime runsc)"),
        _ => println!("Kernels run in Docker under runc (no gVisor: see `make gvisor`)"),
    }
    tracing::info!(listen = %config.listen, image = %config.image, runtime, "ready");

    let shutdown = cancel.clone();
    axum::serve(listener, api::router(state))
        .with_graceful_shutdown(async move {
            stop_signal().await;
            tracing::info!("shutting down: removing kernels");
            shutdown.cancel();
        })
        .await?;
    kernels.shutdown().await;
    tracker.close();
    if tokio::time::timeout(Duration::from_secs(10), tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("some tasks did not stop within 10 s");
    }
    Ok(())
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
fn auth_from(config: &Config) -> anyhow::Result<(Auth, Option<String>)> {
    if config.no_auth {
        if config.token.is_some() {
            bail!("--no-auth and --token contradict each other; pass one");
        }
        if !config.listen.ip().is_loopback() {
            bail!(
                "--no-auth is refused on {}: anyone who can reach it could run code. \
                 Listen on 127.0.0.1 or use a token",
                config.listen
            );
        }
        tracing::warn!("authentication is OFF: any local process can run code in kernels");
        return Ok((Auth::disabled(), None));
    }
    match &config.token {
        Some(t) if t.is_empty() => bail!("--token is empty; give a token or pass --no-auth"),
        Some(t) => Ok((Auth::token(t), None)),
        None => {
            let token = kernelgate_protocol::SigningKey::generate_hex();
            Ok((Auth::token(&token), Some(token)))
        }
    }
}

async fn stop_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
