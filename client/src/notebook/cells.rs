//! Running the cells through a gateway, as an ordinary client: a kernel created with the
//! REST API, one `execute_request` per code cell on the channels WebSocket (legacy JSON
//! encoding), each followed to its end by an [`Execution`].

use super::model::{code_cells, has_tag, source_text, Outputs};
use super::{Report, RunArgs, RunError};
use crate::{Channels, Gateway};
use kernelgate_protocol::execution::{Event, Interruption, Phase, Status};
use kernelgate_protocol::Execution;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The `username` of the messages `kernelgate run` sends.
const USERNAME: &str = "kernelgate-run";

/// How long a new kernel may take to answer `kernel_info_request`.
const KERNEL_READY_TIMEOUT: Duration = Duration::from_secs(90);
/// After a cell's `execute_reply`, how long its final IOPub `idle` may lag (nbclient: 4 s).
const IOPUB_GRACE: Duration = Duration::from_secs(10);
/// After interrupting a cell that ran past `--timeout`, how long to wait for its reply.
const INTERRUPT_GRACE: Duration = Duration::from_secs(30);

/// Creates a kernel, runs every code cell in order, deletes the kernel.
pub(crate) async fn execute_notebook(
    endpoint: &Gateway,
    kernel_name: &str,
    nb: &mut Value,
    args: &RunArgs,
    stop: &CancellationToken,
) -> Result<Report, RunError> {
    let kernel_id = tokio::select! {
        id = endpoint.create_kernel(Some(kernel_name)) => id.map_err(|e| RunError::refused("create a kernel", e))?,
        _ = stop.cancelled() => return Err(RunError::Interrupted),
    };
    eprintln!(
        "kernelgate run: kernel {} ({kernel_name}) created",
        short(&kernel_id)
    );
    let result = tokio::select! {
        r = async {
            let mut channels = Channels::connect(endpoint, &kernel_id).await?;
            let info = kernel_info(&mut channels).await?;
            if let Some(language_info) = info.get("language_info") {
                nb["metadata"]["language_info"] = language_info.clone();
            }
            run_cells(&mut channels, endpoint, &kernel_id, nb, args).await
        } => r,
        _ = stop.cancelled() => Err(RunError::Interrupted),
    };
    if let Err(e) = endpoint
        .delete_kernel(&kernel_id)
        .await
        .map_err(|e| RunError::refused("delete the kernel", e))
    {
        eprintln!(
            "kernelgate run: could not delete kernel {}: {e}",
            short(&kernel_id)
        );
    }
    result
}

async fn run_cells(
    channels: &mut Channels,
    endpoint: &Gateway,
    kernel_id: &str,
    nb: &mut Value,
    args: &RunArgs,
) -> Result<Report, RunError> {
    let indices = code_cells(nb);
    let total = indices.len();
    let Some(cells) = nb["cells"].as_array_mut() else {
        return Ok(Report::default());
    };
    let mut outputs = Outputs::default();
    let mut report = Report::default();
    for (k, &i) in indices.iter().enumerate() {
        let code = source_text(cells[i].get("source")).unwrap_or_default();
        let label = format!("[{}/{total}] cell {}", k + 1, i + 1);
        // nbclient skips blank cells: they have no execution count.
        if code.trim().is_empty() {
            continue;
        }
        let allows_error = args.allow_errors || has_tag(&cells[i], "raises-exception");
        let started = Instant::now();
        let execution = execute(
            channels,
            &code,
            !allows_error,
            (args.timeout > 0).then(|| Duration::from_secs(args.timeout)),
            endpoint,
            kernel_id,
            cells,
            i,
            &mut outputs,
        )
        .await
        .map_err(|e| match e {
            RunError::KernelDied(why, _) => RunError::KernelDied(why, i + 1),
            e => e,
        })?;
        report.cells_run += 1;
        let took = started.elapsed().as_secs_f64();
        let reply = execution.reply();
        if let Some(n) = reply.and_then(|r| r.execution_count) {
            cells[i]["execution_count"] = json!(n);
        }
        let status = execution.status();
        if status != Status::Ok {
            let (ename, evalue) = match (status, reply) {
                (Status::Timeout, _) => (
                    "TimeoutError".to_owned(),
                    format!(
                        "the cell ran longer than {} s and was interrupted",
                        args.timeout
                    ),
                ),
                (_, Some(r)) => (r.ename.clone(), r.evalue.clone()),
                (_, None) => ("NoReply".to_owned(), "the kernel sent no reply".to_owned()),
            };
            eprintln!(
                "{label} {} ... error after {took:.1} s: {ename}: {evalue}",
                preview(&code)
            );
            report.errors += 1;
            if !allows_error {
                report.failed = Some(RunError::CellFailed {
                    cell: i + 1,
                    ename,
                    evalue,
                });
                break;
            }
        } else {
            eprintln!("{label} {} ... ok ({took:.1} s)", preview(&code));
        }
    }
    Ok(report)
}

/// The first line of a cell's code, shortened, for progress lines.
fn preview(code: &str) -> String {
    let line = code
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    let mut s: String = line.chars().take(48).collect();
    if line.chars().count() > 48 {
        s.push('…');
    }
    s
}

fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

/// `kernel_info_request`, answered once the kernel is up; returns the reply content.
async fn kernel_info(channels: &mut Channels) -> Result<Value, RunError> {
    let id = channels
        .send("kernel_info_request", json!({}), USERNAME)
        .await?;
    let mut info = Execution::new(&id);
    let deadline = tokio::time::Instant::now() + KERNEL_READY_TIMEOUT;
    loop {
        let Some((channel, m)) = channels.recv_until(deadline).await? else {
            return Err(RunError::KernelNotReady(KERNEL_READY_TIMEOUT));
        };
        if let Some(Event::Reply(reply)) = info.feed(channel, &m) {
            return Ok(reply.content.parse().unwrap_or(Value::Null));
        }
    }
}

/// Runs one cell: sends `execute_request`, turns its IOPub messages into outputs of
/// `cells[cell]` and returns once both its `execute_reply` and the `idle` status came.
/// Past `timeout` the kernel is interrupted; the cell then counts as failed.
#[allow(clippy::too_many_arguments)]
async fn execute(
    channels: &mut Channels,
    code: &str,
    stop_on_error: bool,
    timeout: Option<Duration>,
    endpoint: &Gateway,
    kernel_id: &str,
    cells: &mut [Value],
    cell: usize,
    outputs: &mut Outputs,
) -> Result<Execution, RunError> {
    let id = channels
        .send(
            "execute_request",
            json!({
                "code": code, "silent": false, "store_history": true,
                "user_expressions": {}, "allow_stdin": false, "stop_on_error": stop_on_error,
            }),
            USERNAME,
        )
        .await?;
    let mut execution = Execution::new(&id);
    // nbclient's record_timing: when the kernel got busy, saw the input, replied, idled.
    cells[cell]["metadata"]["execution"] = json!({});
    let far = tokio::time::Instant::now() + Duration::from_secs(365 * 24 * 3600);
    let mut deadline = timeout.map_or(far, |t| tokio::time::Instant::now() + t);
    while !execution.is_done() {
        let Some((channel, m)) = channels.recv_until(deadline).await? else {
            if execution.phase() == Phase::AwaitingIdle {
                // The reply came but IOPub's idle did not: keep what arrived.
                break;
            }
            if execution.interruption().is_some() {
                return Err(RunError::KernelDied(
                    "no answer after an interrupt".into(),
                    cell + 1,
                ));
            }
            execution.interrupted(Interruption::Timeout);
            endpoint
                .interrupt_kernel(kernel_id)
                .await
                .map_err(|e| RunError::refused("interrupt the kernel", e))?;
            deadline = tokio::time::Instant::now() + INTERRUPT_GRACE;
            continue;
        };
        let Some(event) = execution.feed(channel, &m) else {
            continue;
        };
        let date = json!(m.header.date);
        let timing = &mut cells[cell]["metadata"]["execution"];
        match &event {
            Event::KernelLost(state) => {
                return Err(RunError::KernelDied(state.as_str().to_owned(), cell + 1))
            }
            Event::Reply(_) => {
                timing["shell.execute_reply"] = date;
                if execution.phase() == Phase::AwaitingIdle {
                    deadline = tokio::time::Instant::now() + IOPUB_GRACE;
                }
            }
            Event::Busy => timing["iopub.status.busy"] = date,
            Event::Idle => timing["iopub.status.idle"] = date,
            Event::Input { execution_count } => {
                timing["iopub.execute_input"] = date;
                if let Some(n) = execution_count {
                    cells[cell]["execution_count"] = json!(n);
                }
            }
            event => outputs.apply(cells, cell, event),
        }
    }
    Ok(execution)
}
