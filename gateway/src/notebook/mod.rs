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
//! WebSocket; `local` starts and stops the gateway of our own.
//!
//! The notebook stays a `serde_json::Value` throughout, so fields this module does not know
//! (cell ids, metadata of other tools, attachments) are written back untouched.

mod cells;
mod local;
pub mod model;

use crate::config::RunArgs;
use cells::{execute_notebook, Endpoint};
use local::LocalGateway;
use model::{code_cells, parse, write};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

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
    #[error("cannot reach the gateway at {url}: {source}")]
    Unreachable { url: String, source: reqwest::Error },
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
        stop_signal().await;
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
        Some(url) => (None, Endpoint::parse(url, args.token.as_deref())?),
        None => {
            let local = tokio::select! {
                local = LocalGateway::start(&args.image) => local?,
                _ = stop.cancelled() => return Err(RunError::Interrupted),
            };
            let endpoint = local.endpoint();
            (Some(local), endpoint)
        }
    };
    eprintln!(
        "kernelgate run: {} ({} code cells) on {}",
        args.notebook.display(),
        code_cells(nb).len(),
        endpoint.base
    );

    let started = Instant::now();
    let outcome = execute_notebook(&endpoint, kernel_name, nb, args, stop).await;
    if let Some(local) = local {
        local.stop().await;
    }
    outcome.map(|report| Report {
        took: started.elapsed(),
        ..report
    })
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

async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            },
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}
