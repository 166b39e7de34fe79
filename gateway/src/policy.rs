//! The execution policy in force (`--policy`, docs/policy.md): the rules (scanned by
//! `kernelgate-policy`) and the executions held until an administrator answers.
//!
//! The kernel's relay ([`crate::relay`]) asks [`Guard::check`] about each client
//! `execute_request` and holds the ones a rule says to `ask` about; this module keeps the
//! list of those (`GET /api/kernelgate/approvals`), takes the answers (`POST
//! /api/kernelgate/approvals/{id}`, the web console's buttons) and denies what nobody
//! answered within `--approval-timeout`.

use kernelgate_policy::{Decision, Policy, Scope, STACK_BYTES};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use kernelgate_protocol::rest::Approval;

/// What holds an execution for approval (a kernel's relay), told the answer when it comes.
pub trait Holder: Send + Sync + std::fmt::Debug {
    /// The kernel's id, for the approvals list.
    fn kernel_id(&self) -> &str;
    /// Applies the answer; false if it holds no such execution any more.
    fn decide(self: Arc<Self>, approval: &str, answer: Answer) -> bool;
}

/// How a held execution was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Approved {
        by: String,
    },
    Denied {
        by: String,
    },
    /// Nobody answered within `--approval-timeout`.
    TimedOut,
}

#[derive(Debug)]
struct Pending {
    approval: Approval,
    kernel: Weak<dyn Holder>,
    /// Ends the task that denies it at the timeout.
    timer: CancellationToken,
}

/// The policy and its pending approvals; shared by every kernel.
#[derive(Debug)]
pub struct Guard {
    policy: Policy,
    approval_timeout: Duration,
    pending: Mutex<HashMap<String, Pending>>,
    /// Owns the timeout tasks and the relays' release tasks.
    tracker: TaskTracker,
    /// The scanner threads' queue. Two threads with the stack the scanner asks for, started
    /// once: one per core is enough, and bounds the stack memory a flood of deeply nested
    /// cells can commit.
    scanners: Mutex<std::sync::mpsc::Sender<Scan>>,
    cancel: CancellationToken,
}

impl Guard {
    pub fn new(
        policy: Policy,
        approval_timeout: Duration,
        tracker: TaskTracker,
        cancel: CancellationToken,
    ) -> Arc<Guard> {
        Arc::new(Guard {
            policy,
            approval_timeout,
            pending: Mutex::new(HashMap::new()),
            tracker,
            scanners: Mutex::new(scanner_threads(2)),
            cancel,
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Pending>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn approval_timeout(&self) -> Duration {
        self.approval_timeout
    }

    pub fn tracker(&self) -> &TaskTracker {
        &self.tracker
    }

    /// The decision for a sandbox's shell command (no parsing: the shell rules decide).
    pub fn check_command(&self, command: &str) -> Decision {
        self.policy.check_command(command)
    }

    /// The decision for an execute request; `scope` is the kernel's (aliases its earlier
    /// cells bound). Parsing untrusted code takes time and stack: it runs on a thread of
    /// its own with the stack the scanner asks for, a bounded number at once.
    pub async fn check(
        self: &Arc<Self>,
        scope: Arc<Mutex<Scope>>,
        code: String,
        user_expressions: Vec<String>,
    ) -> Decision {
        let failed = |why: &str| {
            // The scanner is fuzzed, so this is a bug; failing closed keeps the promise.
            tracing::error!(error = why, "policy scan failed; the code is denied");
            Decision::Deny(kernelgate_policy::Verdict {
                rule: 0,
                reason: "the code could not be checked".into(),
                matched: "scanner failure".into(),
            })
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let me = self.clone();
        let scan: Scan = Box::new(move || {
            let mut scope = scope.lock().unwrap_or_else(|e| e.into_inner());
            let decision = me.policy.check_in(
                &mut scope,
                &code,
                user_expressions.iter().map(String::as_str),
            );
            let _ = tx.send(decision);
        });
        let queued = self
            .scanners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(scan);
        if queued.is_err() {
            return failed("no scanner thread is running");
        }
        match rx.await {
            Ok(decision) => decision,
            Err(_) => failed("the scanner thread panicked"),
        }
    }

    /// Holds an execution of `kernel` for an administrator; returns the approval's id.
    /// Unanswered, it is denied after the approval timeout.
    pub fn hold(
        self: &Arc<Self>,
        kernel: Arc<dyn Holder>,
        key: &str,
        code: &str,
        reason: &str,
    ) -> String {
        let id = uuid::Uuid::new_v4().to_string();
        let timer = self.cancel.child_token();
        self.lock().insert(
            id.clone(),
            Pending {
                approval: Approval {
                    id: id.clone(),
                    kernel_id: kernel.kernel_id().to_owned(),
                    key: key.to_owned(),
                    code: code.to_owned(),
                    reason: reason.to_owned(),
                    requested_at: crate::time::now_iso(),
                },
                kernel: Arc::downgrade(&kernel),
                timer: timer.clone(),
            },
        );
        let me = self.clone();
        let approval = id.clone();
        let timeout = self.approval_timeout;
        self.tracker.spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(timeout) => { me.answer(&approval, Answer::TimedOut); }
                _ = timer.cancelled() => {}
            }
        });
        id
    }

    /// The executions waiting, oldest first (those of kernels since removed are dropped).
    pub fn list(&self) -> Vec<Approval> {
        let mut pending = self.lock();
        pending.retain(|_, p| p.kernel.strong_count() > 0);
        let mut all: Vec<Approval> = pending.values().map(|p| p.approval.clone()).collect();
        all.sort_by(|a, b| a.requested_at.cmp(&b.requested_at));
        all
    }

    /// Answers a held execution; false if there is no such approval (answered already,
    /// timed out, cancelled, or its kernel is gone).
    pub fn answer(&self, id: &str, answer: Answer) -> bool {
        let Some(pending) = self.lock().remove(id) else {
            return false;
        };
        pending.timer.cancel();
        match pending.kernel.upgrade() {
            Some(kernel) => kernel.decide(id, answer),
            None => false,
        }
    }

    /// Drops an approval without answering it (its execution was cancelled or its kernel
    /// removed).
    pub fn forget(&self, id: &str) {
        if let Some(p) = self.lock().remove(id) {
            p.timer.cancel();
        }
    }
}

/// One scan, run on a scanner thread.
type Scan = Box<dyn FnOnce() + Send>;

/// Starts `n` scanner threads taking scans from one queue; they end when the queue's sender
/// is dropped. A thread that cannot start is logged: scans then wait for the others, and
/// with none at all every check fails closed.
fn scanner_threads(n: usize) -> std::sync::mpsc::Sender<Scan> {
    let (tx, rx) = std::sync::mpsc::channel::<Scan>();
    let rx = Arc::new(Mutex::new(rx));
    for i in 0..n {
        let rx = rx.clone();
        let started = std::thread::Builder::new()
            .name(format!("policy-scan-{i}"))
            .stack_size(STACK_BYTES)
            .spawn(move || loop {
                let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                let Ok(scan) = next else { return };
                // A panic in the scanner (a bug: it is fuzzed) drops the answer's sender, so
                // that check fails closed; the thread goes on with the next scan.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(scan));
            });
        if let Err(e) = started {
            tracing::error!(error = %e, "cannot start a policy scanner thread");
        }
    }
    tx
}
