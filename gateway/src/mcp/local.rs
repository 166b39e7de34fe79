//! This process's kernel table as the place of MCP's kernels (`/mcp`, `kernelgate mcp`):
//! runs go through [`crate::kernels::runner`], files through [`crate::kernels::files`], and
//! deletions and restarts are recorded in the audit trail.

use super::{Forked, KernelRef, Place, Seen};
use crate::kernels::files::{self, FileError, FileOp};
use crate::kernels::runner::{self, End, Job, Progress};
use crate::kernels::snapshots::{KeyBudget, Mode, TakeRequest};
use crate::kernels::{Kernels, LiveKernel, Removal};
use crate::tenants::Tenant;
use futures::future::BoxFuture;
use kernelgate_protocol::content::ErrorContent;
use kernelgate_protocol::content::ExecutionState;
use kernelgate_protocol::execution::{Event, Status};
use kernelgate_protocol::rest::{CreateSnapshot, SnapshotModel};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;

/// The kernel table MCP shares with the REST API.
#[derive(Debug)]
pub struct Local(pub Arc<Kernels>);

impl Local {
    /// The kernel, or the error a call on a kernel that went away gets.
    fn live(&self, kernel: &KernelRef, path: &str) -> Result<Arc<LiveKernel>, FileError> {
        self.0.get(&kernel.id).ok_or_else(|| FileError::NotFound {
            path: path.to_owned(),
            reason: format!("the kernel {} is gone", kernel.id),
        })
    }
}

fn reference(live: &LiveKernel) -> KernelRef {
    KernelRef {
        id: live.id().to_owned(),
    }
}

impl Place for Local {
    fn create<'a>(&'a self, tenant: &'a Tenant) -> BoxFuture<'a, Result<KernelRef, String>> {
        Box::pin(async move {
            let live = self
                .0
                .create(None, &BTreeMap::new(), tenant)
                .await
                .map_err(|e| e.to_string())?;
            Ok(reference(&live))
        })
    }

    fn find<'a>(
        &'a self,
        tenant: &'a Tenant,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<KernelRef>, String>> {
        let found = self
            .0
            .get(id)
            .filter(|l| tenant.may_use(l.owner()))
            .map(|l| reference(&l));
        Box::pin(async move { Ok(found) })
    }

    fn alive<'a>(&'a self, id: &'a str) -> BoxFuture<'a, bool> {
        let alive = self.0.get(id).is_some();
        Box::pin(async move { alive })
    }

    fn seen(&self, id: &str) -> Option<Seen> {
        Some(match self.0.get(id) {
            None => Seen::Gone,
            Some(l) if l.relay.execution_state() == ExecutionState::Busy => Seen::Busy,
            Some(_) => Seen::Idle,
        })
    }

    fn delete<'a>(&'a self, kernel: &'a KernelRef, reason: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let id = &kernel.id;
            if let Some(Err(e)) = self.0.delete(id, Removal::Because(reason.into())).await {
                tracing::warn!(kernel = %id, error = %e, "cannot remove an MCP kernel");
            }
        })
    }

    fn restart<'a>(
        &'a self,
        kernel: &'a KernelRef,
        tenant: &'a Tenant,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let live = self.live(kernel, "").map_err(|e| e.to_string())?;
            self.0
                .supervisor()
                .restart(&live, &tenant.name)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn install<'a>(
        &'a self,
        kernel: &'a KernelRef,
        key: &'a str,
        packages: &'a [String],
    ) -> BoxFuture<'a, Result<crate::kernels::packages::Installed, String>> {
        Box::pin(async move {
            let live = self.live(kernel, "").map_err(|e| e.to_string())?;
            self.0
                .installs()
                .install(&live, key, packages)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn execute<'a>(
        &'a self,
        tracker: &'a TaskTracker,
        kernel: &'a KernelRef,
        job: Job,
    ) -> BoxFuture<'a, mpsc::Receiver<Progress>> {
        Box::pin(async move {
            match self.0.get(&kernel.id) {
                Some(live) => runner::submit(tracker, self.0.clone(), live, job).await,
                // Gone since it was found: the run cannot reach it.
                None => gone(&kernel.id).await,
            }
        })
    }

    fn file<'a>(
        &'a self,
        kernel: &'a KernelRef,
        key: &'a str,
        op: FileOp,
        path: &'a str,
        body: Vec<u8>,
        max_bytes: usize,
    ) -> BoxFuture<'a, Result<Vec<u8>, FileError>> {
        Box::pin(async move {
            let live = self.live(kernel, path)?;
            files::perform(&self.0, &live, key, op, path, body.into(), max_bytes).await
        })
    }

    fn snapshot<'a>(
        &'a self,
        kernel: &'a KernelRef,
        tenant: &'a Tenant,
        body: CreateSnapshot,
    ) -> BoxFuture<'a, Result<SnapshotModel, String>> {
        Box::pin(async move {
            let live = self.live(kernel, "").map_err(|e| e.to_string())?;
            let req = TakeRequest {
                name: body.name,
                metadata: body.metadata,
                mode: Mode::parse(body.mode.as_deref()).map_err(|e| e.to_string())?,
                accept_loss: body.accept_loss,
            };
            let taken = self
                .0
                .snapshots()
                .take(&live, req, &tenant.name, KeyBudget::of(tenant))
                .await
                .map_err(|e| e.to_string())?;
            Ok(taken.model())
        })
    }

    fn fork<'a>(
        &'a self,
        kernel: &'a KernelRef,
        tenant: &'a Tenant,
        count: usize,
    ) -> BoxFuture<'a, Result<Forked, String>> {
        Box::pin(async move {
            let live = self.live(kernel, "").map_err(|e| e.to_string())?;
            let forked = self
                .0
                .snapshots()
                .fork(&live, count, false, tenant)
                .await
                .map_err(|e| e.to_string())?;
            Ok(Forked {
                kind: forked.kind.as_str().to_owned(),
                forks: forked
                    .forks
                    .into_iter()
                    .map(|f| f.map(|l| reference(&l)).map_err(|e| e.to_string()))
                    .collect(),
            })
        })
    }

    fn create_from<'a>(
        &'a self,
        tenant: &'a Tenant,
        snapshot: &'a str,
    ) -> BoxFuture<'a, Result<KernelRef, String>> {
        Box::pin(async move {
            let held = self
                .0
                .snapshots()
                .find(snapshot, &tenant.name, |owner| tenant.may_use(owner))
                .map_err(|e| e.to_string())?;
            let live = self
                .0
                .create_from(held, None, &BTreeMap::new(), tenant)
                .await
                .map_err(|e| e.to_string())?;
            Ok(reference(&live))
        })
    }

    fn read_part<'a>(
        &'a self,
        kernel: &'a KernelRef,
        key: &'a str,
        path: &'a str,
        offset: u64,
        length: usize,
    ) -> BoxFuture<'a, Result<(Vec<u8>, u64), FileError>> {
        Box::pin(async move {
            let live = self.live(kernel, path)?;
            files::read_part(&self.0, &live, key, path, offset, length).await
        })
    }
}

/// The progress of a run on a kernel that left the table: an error, then the end.
async fn gone(id: &str) -> mpsc::Receiver<Progress> {
    let (tx, rx) = mpsc::channel(2);
    let error = ErrorContent {
        ename: "KernelUnavailable".into(),
        evalue: format!("the kernel {id} is gone"),
        traceback: Vec::new(),
        extra: serde_json::Map::new(),
    };
    let _ = tx.send(Progress::Event(Event::Error(error))).await;
    let end = End {
        status: Status::Error,
        execution_count: None,
        duration_ms: 0,
        truncated: false,
    };
    let _ = tx.send(Progress::End(end)).await;
    rx
}
