//! Installing allowlisted packages into a kernel on a client's behalf (`install_packages`,
//! `POST /api/kernels/{id}/packages`): the kernel's own installer runs in its sandbox, so
//! what the gateway installs and what `%pip install` does in a cell are one and the same
//! (docs/packages.md).

use super::{Kernels, LiveKernel};
use crate::audit::{KernelReportedInstall, PackageRefusal, Record};
use crate::backend::{BackendError, ExecRequest};
use crate::packages::allowlist;
use std::sync::Arc;

/// The installer's output kept, at most.
const MAX_OUTPUT: usize = 256 << 10;
/// How long one install may run in the kernel's sandbox before it is killed.
pub const INSTALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);
/// Requirements one call may name.
pub const MAX_REQUIREMENTS: usize = 64;

pub use kernelgate_protocol::rest::Installed;

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("this gateway provides no packages: an operator starts it with --packages FILE and --wheelhouse DIR (docs/packages.md)")]
    NotConfigured,
    #[error("{0}")]
    BadRequest(String),
    /// Some requirements were refused, so nothing was installed.
    #[error("nothing was installed: {}", refusals(&.0.refused))]
    Refused(Installed),
    #[error("the kernel's installer failed: {0}")]
    Failed(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

fn refusals(refused: &[PackageRefusal]) -> String {
    refused
        .iter()
        .map(|r| r.reason.clone())
        .collect::<Vec<_>>()
        .join("; ")
}

/// Package installs into the table's kernels.
#[derive(Debug, Clone)]
pub struct Installs {
    kernels: Arc<Kernels>,
}

impl Installs {
    pub(super) fn new(kernels: &Arc<Kernels>) -> Self {
        Installs {
            kernels: kernels.clone(),
        }
    }

    /// Installs `requirements` (names from the allowlist, optionally with a version
    /// specifier) into `live` for `key`: all of them and what they bring, or none.
    pub async fn install(
        &self,
        live: &Arc<LiveKernel>,
        key: &str,
        requirements: &[String],
    ) -> Result<Installed, InstallError> {
        let kernels = &self.kernels;
        if kernels.packages().is_none() {
            return Err(InstallError::NotConfigured);
        }
        if requirements.is_empty() {
            return Err(InstallError::BadRequest(
                "name at least one package, e.g. {\"packages\": [\"seaborn\"]}".to_owned(),
            ));
        }
        if requirements.len() > MAX_REQUIREMENTS {
            return Err(InstallError::BadRequest(format!(
                "at most {MAX_REQUIREMENTS} packages at once"
            )));
        }
        for r in requirements {
            allowlist::parse_requirement(r).map_err(InstallError::BadRequest)?;
        }
        // Installs go into its home, which is in its saved state while it hibernates.
        if live.hibernated() {
            kernels.hibernation().resume(live).await.map_err(|e| {
                InstallError::Failed(format!("the hibernated kernel could not be resumed: {e}"))
            })?;
        }
        // `-P` from `/`: a `pip/` in the kernel's home is not the installer that runs.
        let argv = ["python3", "-P", "-m", "pip", "install", "--report", "-"]
            .into_iter()
            .map(str::to_owned)
            .chain(requirements.iter().cloned())
            .collect();
        let request = ExecRequest::new(argv, bytes::Bytes::new(), MAX_OUTPUT, INSTALL_TIMEOUT);
        let out = kernels.backend().exec(&live.handle(), request).await?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let report = stdout
            .lines()
            .rev()
            .find_map(|line| serde_json::from_str::<Installed>(line.trim()).ok());
        let Some(report) = report else {
            let why = match out.stderr.trim() {
                "" => stdout.trim().chars().take(500).collect(),
                e => e.chars().take(500).collect::<String>(),
            };
            return Err(InstallError::Failed(if why.is_empty() {
                format!(
                    "it ended with status {} and no report: is the kernel's image one whose Python has the installer (docs/packages.md)?",
                    out.exit_code
                )
            } else {
                why
            }));
        };
        // What the gateway knows: the allowlist's lines for the names asked for.
        let asked: Vec<String> = requirements
            .iter()
            .filter_map(|r| allowlist::parse_requirement(r).ok())
            .map(|e| e.name)
            .collect();
        let allowed = kernels
            .packages()
            .map(|p| p.allowed(&live.name))
            .unwrap_or_default()
            .into_iter()
            .filter(|e| asked.contains(&e.name))
            .map(|e| e.requirement)
            .collect();
        kernels
            .audit()
            .record(&Record::PackagesInstalled {
                key: key.to_owned(),
                kernel: live.id().to_owned(),
                requested: requirements.to_vec(),
                allowed,
                kernel_reported: KernelReportedInstall {
                    installed: report.installed.clone(),
                    already: report.already.clone(),
                    refused: report.refused.clone(),
                    exit_code: out.exit_code,
                },
            })
            .await;
        if report.refused.is_empty() && out.exit_code == 0 {
            Ok(report)
        } else if !report.refused.is_empty() {
            Err(InstallError::Refused(report))
        } else {
            Err(InstallError::Failed(
                out.stderr.trim().chars().take(500).collect(),
            ))
        }
    }
}
