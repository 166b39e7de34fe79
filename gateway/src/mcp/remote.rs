//! The kernels of a running gateway, over its HTTP API, for `kernelgate mcp --url`: the
//! kernel REST API, the agent API (streamed as NDJSON, read back as the run's events) and
//! the files API, all through [`kernelgate_client::Gateway`]. The gateway applies its own
//! limits, policy and audit.

use super::{Forked, KernelRef, Place};
use crate::kernels::files::{FileError, FileOp};
use crate::kernels::runner::{Job, Progress};
use crate::tenants::Tenant;
use futures::future::BoxFuture;
use kernelgate_client::gateway::Error;
use kernelgate_client::Gateway;
use kernelgate_protocol::agent::ExecuteBody;
use kernelgate_protocol::rest::{CreateSnapshot, SnapshotModel};
use reqwest::StatusCode;
use tokio::sync::mpsc;
use tokio_util::task::TaskTracker;

/// Why the gateway given with `--url` cannot be used.
pub type RemoteError = Error;

/// Why the token file (`--token-file`) cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the token file {path} (--token-file): {detail}")]
pub struct TokenFileError {
    path: String,
    detail: String,
}

/// The token in the file `--token-file` names: its text without the trailing newline.
pub fn read_token_file(path: &std::path::Path) -> Result<String, TokenFileError> {
    let failed = |detail: String| TokenFileError {
        path: path.display().to_string(),
        detail,
    };
    let text = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
    let token = text.trim_end_matches(['\n', '\r']);
    if token.is_empty() {
        return Err(failed(
            "it is empty; write the gateway's token into it (the one `kernelgate serve` \
             printed, set with --token, or a key of `kernelgate keys add`)"
                .into(),
        ));
    }
    Ok(token.to_owned())
}

/// A running gateway: its base URL and token.
#[derive(Debug, Clone)]
pub struct Remote {
    gateway: Gateway,
}

impl Remote {
    /// `url` as `kernelgate serve` prints it (`?token=` included) or a plain base URL;
    /// `token`, when given, wins over the URL's.
    pub fn new(url: &str, token: Option<String>) -> Self {
        let gateway = Gateway::parse(url, token.as_deref())
            // Not http(s): the check's request says what is wrong with it.
            .unwrap_or_else(|_| Gateway::new(url, token));
        Remote { gateway }
    }

    /// Checks the URL and token once, before the host starts talking.
    pub async fn check(&self) -> Result<(), RemoteError> {
        self.gateway.kernels().await.map(drop)
    }
}

impl Place for Remote {
    fn create<'a>(&'a self, _tenant: &'a Tenant) -> BoxFuture<'a, Result<KernelRef, String>> {
        Box::pin(async move {
            let id = self
                .gateway
                .create_kernel(None)
                .await
                .map_err(|e| e.to_string())?;
            Ok(KernelRef { id })
        })
    }

    fn find<'a>(
        &'a self,
        _tenant: &'a Tenant,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Option<KernelRef>, String>> {
        Box::pin(async move {
            match self.gateway.kernel_exists(id).await {
                Ok(true) => Ok(Some(KernelRef { id: id.to_owned() })),
                Ok(false) => Ok(None),
                Err(e) => Err(e.to_string()),
            }
        })
    }

    fn alive<'a>(&'a self, id: &'a str) -> BoxFuture<'a, bool> {
        Box::pin(async move { self.gateway.kernel_exists(id).await.unwrap_or(true) })
    }

    fn delete<'a>(&'a self, kernel: &'a KernelRef, _reason: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            if let Err(e) = self.gateway.delete_kernel(&kernel.id).await {
                tracing::warn!(kernel = %kernel.id, error = %e, "cannot delete an MCP kernel");
            }
        })
    }

    fn restart<'a>(
        &'a self,
        kernel: &'a KernelRef,
        _tenant: &'a Tenant,
    ) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            self.gateway
                .restart_kernel(&kernel.id)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn snapshot<'a>(
        &'a self,
        kernel: &'a KernelRef,
        _tenant: &'a Tenant,
        body: CreateSnapshot,
    ) -> BoxFuture<'a, Result<SnapshotModel, String>> {
        Box::pin(async move {
            self.gateway
                .snapshot(&kernel.id, &body)
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn fork<'a>(
        &'a self,
        kernel: &'a KernelRef,
        _tenant: &'a Tenant,
        count: usize,
    ) -> BoxFuture<'a, Result<Forked, String>> {
        Box::pin(async move {
            let forked = self
                .gateway
                .fork(&kernel.id, count)
                .await
                .map_err(|e| e.to_string())?;
            let forks = forked
                .forks
                .into_iter()
                .map(|f| match (f.kernel, f.error) {
                    (Some(k), _) => Ok(KernelRef { id: k.id }),
                    (None, Some(e)) => Err(e.message),
                    (None, None) => Err("the gateway gave neither a kernel nor an error".into()),
                })
                .collect();
            Ok(Forked {
                kind: forked.kind,
                forks,
            })
        })
    }

    fn create_from<'a>(
        &'a self,
        _tenant: &'a Tenant,
        snapshot: &'a str,
    ) -> BoxFuture<'a, Result<KernelRef, String>> {
        Box::pin(async move {
            let id = self
                .gateway
                .create_from_snapshot(snapshot)
                .await
                .map_err(|e| e.to_string())?;
            Ok(KernelRef { id })
        })
    }

    fn install<'a>(
        &'a self,
        kernel: &'a KernelRef,
        _key: &'a str,
        packages: &'a [String],
    ) -> BoxFuture<'a, Result<crate::kernels::packages::Installed, String>> {
        Box::pin(async move {
            self.gateway
                .install_packages(&kernel.id, packages)
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
        let body = ExecuteBody {
            code: job.code,
            timeout: Some(job.timeout.as_secs_f64()),
            agent_id: Some(job.agent_id.unwrap_or_default()),
            plain: false,
        };
        Box::pin(async move { self.gateway.execute_stream(tracker, &kernel.id, body) })
    }

    fn file<'a>(
        &'a self,
        kernel: &'a KernelRef,
        _key: &'a str,
        op: FileOp,
        path: &'a str,
        body: Vec<u8>,
        max_bytes: usize,
    ) -> BoxFuture<'a, Result<Vec<u8>, FileError>> {
        Box::pin(async move {
            let bytes = self
                .gateway
                .file(&kernel.id, op, path, body)
                .await
                .map_err(|e| file_error(e, path, max_bytes))?;
            if bytes.len() > max_bytes {
                return Err(FileError::TooLarge {
                    path: path.to_owned(),
                    limit_mib: max_bytes >> 20,
                });
            }
            Ok(bytes)
        })
    }

    fn read_part<'a>(
        &'a self,
        kernel: &'a KernelRef,
        _key: &'a str,
        path: &'a str,
        offset: u64,
        length: usize,
    ) -> BoxFuture<'a, Result<(Vec<u8>, u64), FileError>> {
        Box::pin(async move {
            self.gateway
                .read_part(&kernel.id, path, offset, length)
                .await
                .map_err(|e| file_error(e, path, length))
        })
    }
}

/// A failed files API call as the file error it stands for.
fn file_error(e: Error, path: &str, max_bytes: usize) -> FileError {
    let path = path.to_owned();
    match e {
        Error::Refused { status, body } => {
            let reason = body.message.unwrap_or_else(|| "no message".to_owned());
            match status {
                StatusCode::NOT_FOUND => FileError::NotFound { path, reason },
                StatusCode::BAD_REQUEST => FileError::BadPath { path, reason },
                StatusCode::CONFLICT => FileError::WrongKind { path, reason },
                StatusCode::PAYLOAD_TOO_LARGE => FileError::TooLarge {
                    path,
                    limit_mib: max_bytes >> 20,
                },
                _ => FileError::Failed { path, reason },
            }
        }
        Error::BadPath { reason, .. } => FileError::BadPath {
            path,
            reason: reason.to_owned(),
        },
        Error::WrongKind { reason, .. } => FileError::WrongKind {
            path,
            reason: reason.to_owned(),
        },
        other => FileError::Failed {
            path: path.to_owned(),
            reason: other.to_string(),
        },
    }
}
