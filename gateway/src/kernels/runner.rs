//! Running one piece of code on a kernel of the table for a caller that wants its outputs:
//! the agent API and MCP's `run_python` both go through [`submit`].
//!
//! Runs on one kernel go one at a time, in arrival order (the kernel's `runs` queue). A run
//! whose caller stops listening (drops the receiver) before its turn leaves the queue and
//! never reaches the kernel; after its turn came, the kernel is interrupted. A timeout
//! interrupts the kernel too. The kernel's state survives both. The messages go through the
//! kernel's client send path, so the execution policy, the output cap and the audit trail
//! apply as for any client.

use super::{Kernels, LiveKernel};
use crate::relay::executions::TRUNCATED_METADATA;
use kernelgate_protocol::content::{ErrorContent, ExecuteRequest};
use kernelgate_protocol::execution::{Event, Interruption, Phase};
use kernelgate_protocol::{Channel, Execution, MsgKind, RawJson};
use serde_json::Map;
use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, OwnedMutexGuard};
use tokio_util::task::TaskTracker;
use tracing::Instrument;

/// How long an interrupted run may take to report back before the run gives up on it.
const INTERRUPT_GRACE: Duration = Duration::from_secs(10);
/// After the reply, how long the run's final IOPub `idle` may lag. A kernel's IOPub drops
/// messages when its send queue is full (a flood of output), so `idle` can be lost: the run
/// then ends with what arrived instead of waiting for its timeout.
const IOPUB_GRACE: Duration = Duration::from_secs(10);

/// What to run, for whom.
#[derive(Debug)]
pub struct Job {
    pub code: String,
    pub timeout: Duration,
    /// The key that runs it.
    pub key: String,
    /// The agent it says it is (the header's `agent_id`, for the audit trail and policy).
    pub agent_id: Option<String>,
}

/// What a run sends (each event as it happens, then how it ended): the agent API's types,
/// which its NDJSON lines carry.
pub use kernelgate_protocol::agent::{End, Progress};

/// Queues the run on `live` and returns its progress. Dropping the receiver abandons the
/// run: taken out of the queue if it is still waiting, the kernel interrupted if it runs.
pub async fn submit(
    tracker: &TaskTracker,
    kernels: Arc<Kernels>,
    live: Arc<LiveKernel>,
    run: Job,
) -> mpsc::Receiver<Progress> {
    let (tx, rx) = mpsc::channel(256);
    // The place in the queue is taken here, by the caller, not by the task: tasks spawned
    // back to back may start in either order.
    let mut turn = Box::pin(live.runs.clone().lock_owned());
    let now = futures::poll!(turn.as_mut());
    tracker.spawn(execute(kernels, live, run, tx, turn, now).in_current_span());
    rx
}

async fn execute<F>(
    kernels: Arc<Kernels>,
    live: Arc<LiveKernel>,
    run: Job,
    tx: mpsc::Sender<Progress>,
    turn: std::pin::Pin<Box<F>>,
    now: Poll<OwnedMutexGuard<()>>,
) where
    F: Future<Output = OwnedMutexGuard<()>>,
{
    let _turn = match now {
        Poll::Ready(guard) => guard,
        Poll::Pending => tokio::select! {
            guard = turn => guard,
            _ = tx.closed() => {
                tracing::debug!(kernel = %live.id(), "a queued run was abandoned before its turn");
                return;
            }
        },
    };
    let started = Instant::now();
    let me = live.relay.attach(
        &format!("kernelgate-execute-{}", uuid::Uuid::new_v4()),
        true,
        &run.key,
    );
    let mut request = ExecuteRequest::new(&run.code);
    // Nobody could answer input(): make it fail fast instead of hanging the run.
    request.allow_stdin = false;
    let mut message = live
        .relay
        .request("execute_request", RawJson::from_value(&request));
    if let Some(agent) = run.agent_id {
        message.header.extra.insert("agent_id".into(), agent.into());
    }
    let mut execution = Execution::new(message.msg_id());
    let mut truncated = false;
    let end = |execution: &Execution, truncated: bool| {
        Progress::End(End {
            status: execution.status(),
            execution_count: execution.reply().and_then(|r| r.execution_count),
            duration_ms: started.elapsed().as_millis() as u64,
            truncated,
        })
    };
    if let Err(e) = me.send(Channel::Shell, message).await {
        let unavailable = ErrorContent {
            ename: "KernelUnavailable".into(),
            evalue: e.to_string(),
            traceback: Vec::new(),
            extra: Map::new(),
        };
        let _ = tx.send(Progress::Event(Event::Error(unavailable))).await;
        let _ = tx.send(end(&execution, false)).await;
        return;
    }

    let mut deadline = tokio::time::Instant::now() + run.timeout;
    let mut idle_due: Option<tokio::time::Instant> = None;
    while !execution.is_done() {
        if idle_due.is_none() && execution.phase() == Phase::AwaitingIdle {
            idle_due = Some(tokio::time::Instant::now() + IOPUB_GRACE);
        }
        let batch = tokio::select! {
            b = me.recv() => b,
            _ = tokio::time::sleep_until(idle_due.unwrap_or(deadline).min(deadline)) => {
                if execution.phase() == Phase::AwaitingIdle {
                    tracing::warn!(kernel = %live.id(), "the kernel replied but its idle status never came (IOPub dropped it?); ending the run with what arrived");
                    break;
                }
                if execution.interruption().is_some() {
                    break; // the interrupt did not end it either: give up waiting
                }
                execution.interrupted(Interruption::Timeout);
                interrupt(&kernels, &live).await;
                deadline = tokio::time::Instant::now() + INTERRUPT_GRACE;
                continue;
            }
            _ = tx.closed(), if execution.interruption().is_none() => {
                tracing::info!(kernel = %live.id(), "the caller of a run went away; interrupting it");
                execution.interrupted(Interruption::Abandoned);
                interrupt(&kernels, &live).await;
                deadline = tokio::time::Instant::now() + INTERRUPT_GRACE;
                continue;
            }
        };
        let Some(batch) = batch else {
            // The kernel's sessions were closed before its answer came (the answer of a
            // deleted kernel's execution comes first): never an error without a reason.
            let closed = ErrorContent {
                ename: "KernelUnavailable".into(),
                evalue: "the kernel's connection was closed before this code finished (the \
                         kernel was deleted or the gateway is stopping); its variables are lost"
                    .into(),
                traceback: Vec::new(),
                extra: Map::new(),
            };
            let _ = tx.send(Progress::Event(Event::Error(closed))).await;
            break;
        };
        for out in batch {
            let Some(event) = execution.feed(out.channel, &out.message) else {
                continue;
            };
            truncated |= is_truncation_notice(&out.message);
            if let Event::KernelLost(state) = event {
                let died = ErrorContent {
                    ename: "KernelDied".into(),
                    evalue: format!(
                        "the kernel died while running this code (now {}); its variables are lost",
                        state.as_str()
                    ),
                    traceback: Vec::new(),
                    extra: Map::new(),
                };
                let _ = tx.send(Progress::Event(Event::Error(died))).await;
                break;
            }
            // A closed receiver is handled by the select above.
            let _ = tx.send(Progress::Event(event)).await;
        }
    }
    let _ = tx.send(end(&execution, truncated)).await;
}

/// The gateway's own notice that an execution's output was cut.
fn is_truncation_notice(message: &kernelgate_protocol::Message) -> bool {
    message.kind() == MsgKind::Stream && message.metadata.get().contains(TRUNCATED_METADATA)
}

async fn interrupt(kernels: &Kernels, live: &LiveKernel) {
    if let Err(e) = kernels.interrupt(live).await {
        tracing::warn!(kernel = %live.id(), error = %e, "cannot interrupt kernel");
    }
}
