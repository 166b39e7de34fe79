//! `kernelgate run NOTEBOOK.ipynb`: executes a notebook through a gateway, the way nbclient
//! does through a local kernel, and writes it back with its outputs as nbformat 4.
//!
//! The runner is an ordinary client of the gateway: it creates a kernel with the REST API,
//! speaks the channels WebSocket (legacy JSON encoding), sends one `execute_request` per
//! code cell and turns the IOPub messages of that request into nbformat outputs
//! (<https://nbformat.readthedocs.io/en/latest/format_description.html#code-cell-outputs>).
//! Without `--url` it starts a gateway of its own (this same binary, `serve`) on a free
//! loopback port and stops it afterwards.
//!
//! By concern: [`model`] reads, checks and writes the notebook and turns a cell's events
//! into nbformat outputs; `cells` runs the cells through a gateway's REST API and channels
//! WebSocket ([`crate::Gateway`], [`crate::Channels`]); the gateway of our own is a
//! [`crate::Serve`].
//!
//! The notebook stays a `serde_json::Value` throughout, so fields this module does not know
//! (cell ids, metadata of other tools, attachments) are written back untouched.

mod cells;
pub mod model;

use crate::serve::{LocalGateway, Serve};
use crate::Gateway;
use cells::execute_notebook;
use model::{code_cells, parse, write};
use serde_json::Value;
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How long a local gateway may take to listen.
const GATEWAY_START_TIMEOUT: Duration = Duration::from_secs(60);

/// What `kernelgate run` was asked to do (its command line).
#[derive(Debug, Clone)]
pub struct RunArgs {
    /// The notebook to execute (nbformat 4 JSON).
    pub notebook: PathBuf,
    /// Where to write the executed notebook; default: NOTEBOOK with `.executed.ipynb`.
    pub output: Option<PathBuf>,
    /// Base URL of a running gateway; without it a local gateway is started for the run.
    pub url: Option<String>,
    /// Token of the gateway given with `url`.
    pub token: Option<String>,
    /// Keep running after a cell fails, and exit 0.
    pub allow_errors: bool,
    /// Seconds one cell may run before it is interrupted and counted as failed; 0 never.
    pub timeout: u64,
    /// Kernel spec to start; default: the notebook's `metadata.kernelspec.name`, else python3.
    pub kernel_name: Option<String>,
    /// Kernel container image of the local gateway (ignored with `url`).
    pub image: String,
}

/// Why `kernelgate run` failed. The messages are meant for the person who ran it.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    NotJson {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path} is not an nbformat 4 notebook: {reason}")]
    NotNotebook { path: PathBuf, reason: String },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid --url {0:?}: give the gateway's base URL, like http://127.0.0.1:8888")]
    BadUrl(String),
    #[error("cannot start a local gateway: {0}")]
    LocalGateway(String),
    #[error("{0}")]
    Gateway(crate::gateway::Error),
    #[error("the gateway refused to {action}: HTTP {status}: {message}")]
    Refused {
        action: &'static str,
        status: u16,
        message: String,
    },
    #[error("channels WebSocket: {0}")]
    WebSocket(String),
    #[error("the kernel did not answer within {0:?}")]
    KernelNotReady(Duration),
    #[error("the kernel died ({0}) while running cell {1}")]
    KernelDied(String, usize),
    #[error("cell {cell} failed: {ename}: {evalue}")]
    CellFailed {
        cell: usize,
        ename: String,
        evalue: String,
    },
    #[error("stopped by a signal")]
    Interrupted,
}

impl RunError {
    /// A failed call to the gateway, while trying to `action`.
    fn refused(action: &'static str, e: crate::gateway::Error) -> RunError {
        match e {
            crate::gateway::Error::Refused { status, body } => RunError::Refused {
                action,
                status: status.as_u16(),
                message: body
                    .message
                    .or(body.reason)
                    .unwrap_or_else(|| "no details".to_owned()),
            },
            crate::gateway::Error::NoKernelId(body) => RunError::Refused {
                action,
                status: 201,
                message: format!("the answer has no kernel id: {body}"),
            },
            e => RunError::Gateway(e),
        }
    }
}

impl From<crate::channels::ChannelsError> for RunError {
    fn from(e: crate::channels::ChannelsError) -> Self {
        RunError::WebSocket(e.0)
    }
}

/// Runs `kernelgate run`. The executed notebook is written even when a cell fails, so the
/// error can be read in context; the returned error then makes the process exit non-zero.
pub async fn run(args: RunArgs) -> Result<(), RunError> {
    let bytes = std::fs::read(&args.notebook).map_err(|source| RunError::Read {
        path: args.notebook.clone(),
        source,
    })?;
    let mut nb = parse(&args.notebook, &bytes)?;
    let output = args
        .output
        .clone()
        .unwrap_or_else(|| default_output(&args.notebook));
    let kernel_name = args
        .kernel_name
        .clone()
        .or_else(|| {
            nb["metadata"]["kernelspec"]["name"]
                .as_str()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "python3".to_owned());

    // Ctrl-C or SIGTERM: stop at the next await, but still delete the kernel and stop the
    // local gateway (it is in its own process group, so the signal does not reach it).
    let stop = CancellationToken::new();
    let on_signal = stop.clone();
    let watcher = tokio::spawn(async move {
        crate::stop_signal().await;
        on_signal.cancel();
    });
    let result = run_with(&args, &mut nb, &kernel_name, &stop).await;
    watcher.abort();
    let executed = result?;
    write(&output, &nb)?;
    eprintln!(
        "kernelgate run: wrote {} ({} cells run, {} with errors, {:.1} s)",
        output.display(),
        executed.cells_run,
        executed.errors,
        executed.took.as_secs_f64()
    );
    match executed.failed {
        Some(failure) => Err(failure),
        None => Ok(()),
    }
}

/// Finds or starts the gateway and runs the notebook on it. An error here means there is
/// nothing worth writing (no kernel, a dead kernel, a signal).
async fn run_with(
    args: &RunArgs,
    nb: &mut Value,
    kernel_name: &str,
    stop: &CancellationToken,
) -> Result<Report, RunError> {
    let (local, endpoint) = match &args.url {
        Some(url) => (
            None,
            Gateway::parse(url, args.token.as_deref())
                .map_err(|_| RunError::BadUrl(url.clone()))?,
        ),
        None => {
            let (local, endpoint) = tokio::select! {
                local = start_local(&args.image) => local?,
                _ = stop.cancelled() => return Err(RunError::Interrupted),
            };
            (Some(local), endpoint)
        }
    };
    eprintln!(
        "kernelgate run: {} ({} code cells) on {}",
        args.notebook.display(),
        code_cells(nb).len(),
        endpoint.base()
    );

    let started = Instant::now();
    let outcome = execute_notebook(&endpoint, kernel_name, nb, args, stop).await;
    if let Some(local) = local {
        stop_local(local).await;
    }
    outcome.map(|report| Report {
        took: started.elapsed(),
        ..report
    })
}

/// `kernelgate serve` started for one run: this binary, a free loopback port, a random
/// token, its own runtime directory and no warm pool.
async fn start_local(image: &str) -> Result<(LocalGateway, Gateway), RunError> {
    let fail = |m: String| RunError::LocalGateway(m);
    let exe = std::env::current_exe().map_err(|e| fail(format!("cannot find myself: {e}")))?;
    let token = kernelgate_protocol::SigningKey::generate_hex();
    let serve = Serve::new(exe).map_err(|e| fail(e.to_string()))?;
    let port = serve.port();
    // Short on purpose: kernel socket paths live under it (Unix sockets: 107 bytes).
    let runtime_dir = std::env::temp_dir().join(format!("kgrun-{port}"));
    // The last lines it printed, to show them if it fails to start.
    let log = Arc::new(Mutex::new(VecDeque::new()));
    let kept = log.clone();
    let started = serve
        .args(["--image", image])
        .arg("--runtime-dir")
        .arg(&runtime_dir)
        .args(["--pool-size", "0", "--cull-idle-timeout", "0"])
        // The token goes by environment: other users can read a command line in `ps`.
        .env("KERNELGATE_TOKEN", &token)
        .env_remove("KERNELGATE_NO_AUTH")
        // Its own process group: Ctrl-C reaches `run`, which then stops it in order.
        .own_process_group()
        .listen_timeout(GATEWAY_START_TIMEOUT)
        .start(move |_, line| {
            if let Ok(mut log) = kept.lock() {
                if log.len() == 40 {
                    log.pop_front();
                }
                log.push_back(line.to_owned());
            }
        })
        .await;
    match started {
        Ok(local) => {
            eprintln!(
                "kernelgate run: started a local gateway on 127.0.0.1:{port} (image {image})"
            );
            let gateway = Gateway::new(&local.base(), Some(token));
            Ok((local, gateway))
        }
        Err(why) => {
            let _ = std::fs::remove_dir(&runtime_dir);
            let tail: Vec<String> = log
                .lock()
                .map(|l| l.iter().cloned().collect())
                .unwrap_or_default();
            Err(fail(format!("{why}; its log:\n{}", tail.join("\n"))))
        }
    }
}

/// SIGTERM, so it removes its kernel containers; SIGKILL if it hangs.
async fn stop_local(mut local: LocalGateway) {
    if let Err(crate::serve::ServeError::NotStopped(_)) = local.stop(Duration::from_secs(30)).await
    {
        eprintln!("kernelgate run: the local gateway did not stop within 30 s; killed it");
    }
    let runtime_dir = std::env::temp_dir().join(format!("kgrun-{}", local.port()));
    let _ = std::fs::remove_dir(runtime_dir);
}

/// `analysis.ipynb` -> `analysis.executed.ipynb`, next to it.
fn default_output(input: &Path) -> PathBuf {
    let stem = input
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "notebook".to_owned());
    input.with_file_name(format!("{stem}.executed.ipynb"))
}

/// What a run did, for the summary and the exit status.
#[derive(Debug, Default)]
pub(crate) struct Report {
    pub cells_run: usize,
    /// Cells whose error was allowed (`--allow-errors`, a `raises-exception` tag) count too.
    pub errors: usize,
    /// The failure that stopped the run.
    pub failed: Option<RunError>,
    pub took: Duration,
}
