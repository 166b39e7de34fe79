//! The OCI runtime kernel containers run under: gVisor (`kernelgate-runsc`, or
//! `kernelgate-runsc-ptrace`) or runc, chosen once at start from `--runtime` and what the
//! engine has registered.

use super::BackendError;
use crate::config::RuntimeChoice;

/// The OCI runtime kernel containers run under, once resolved against the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    Runc,
    Runsc,
    RunscPtrace,
}

/// The name `make gvisor` registers gVisor under (mk/gvisor-setup.py): the newest runsc
/// it found, on the fastest platform that works here.
pub const RUNSC_RUNTIME: &str = "kernelgate-runsc";

/// Debian's own runsc on the ptrace platform, registered beside it by `make gvisor`.
pub const RUNSC_PTRACE_RUNTIME: &str = "kernelgate-runsc-ptrace";

impl Runtime {
    /// As shown to users: `runc`, `runsc` or `runsc-ptrace`.
    pub fn name(self) -> &'static str {
        match self {
            Runtime::Runc => "runc",
            Runtime::Runsc => "runsc",
            Runtime::RunscPtrace => "runsc-ptrace",
        }
    }

    /// The engine's name for it (`HostConfig.Runtime`). runc is named, not left to the
    /// engine's default, which an operator may have changed.
    pub(super) fn docker_name(self) -> &'static str {
        match self {
            Runtime::Runc => "runc",
            Runtime::Runsc => RUNSC_RUNTIME,
            Runtime::RunscPtrace => RUNSC_PTRACE_RUNTIME,
        }
    }

    /// Picks the runtime for `choice` given the engine's registered runtime names.
    pub fn resolve<'a>(
        choice: RuntimeChoice,
        registered: impl IntoIterator<Item = &'a str>,
    ) -> Result<Runtime, BackendError> {
        let registered: Vec<&str> = registered.into_iter().collect();
        let has_runsc = registered.contains(&RUNSC_RUNTIME);
        match (choice, has_runsc) {
            (RuntimeChoice::Runc, _) => Ok(Runtime::Runc),
            (RuntimeChoice::RunscPtrace, _) if registered.contains(&RUNSC_PTRACE_RUNTIME) => {
                Ok(Runtime::RunscPtrace)
            }
            (RuntimeChoice::RunscPtrace, _) => Err(BackendError::Runtime(format!(
                "--runtime runsc-ptrace: the Docker engine has no runtime \
                 {RUNSC_PTRACE_RUNTIME:?}; run `sudo make gvisor` in the kernelgate checkout (it \
                 registers both gVisor runtimes), or choose --runtime runsc"
            ))),
            (RuntimeChoice::Auto | RuntimeChoice::Runsc, true) => Ok(Runtime::Runsc),
            (RuntimeChoice::Auto, false) => {
                tracing::warn!(
                    "gVisor is not set up: kernels run under runc, one wall (the host's Linux \
                     kernel) from the host; run `sudo make gvisor` in the kernelgate checkout \
                     for a second"
                );
                Ok(Runtime::Runc)
            }
            (RuntimeChoice::Runsc, false) => Err(BackendError::Runtime(format!(
                "--runtime runsc: the Docker engine has no runtime {RUNSC_RUNTIME:?}; run \
                 `sudo make gvisor` in the kernelgate checkout (it installs runsc and registers \
                 it), or choose --runtime runc"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_prefers_gvisor_when_registered() {
        let with = ["runc", RUNSC_RUNTIME];
        let without = ["runc", "io.containerd.runc.v2"];
        let pick = |choice, names: &[&str]| Runtime::resolve(choice, names.iter().copied());
        assert_eq!(pick(RuntimeChoice::Auto, &with).ok(), Some(Runtime::Runsc));
        assert_eq!(
            pick(RuntimeChoice::Auto, &without).ok(),
            Some(Runtime::Runc)
        );
        assert_eq!(pick(RuntimeChoice::Runc, &with).ok(), Some(Runtime::Runc));
        assert_eq!(pick(RuntimeChoice::Runsc, &with).ok(), Some(Runtime::Runsc));
        let refused = pick(RuntimeChoice::Runsc, &without).expect_err("runsc is not registered");
        assert!(refused.to_string().contains("make gvisor"), "{refused}");
        assert_eq!(Runtime::Runsc.docker_name(), RUNSC_RUNTIME);
        assert_eq!(Runtime::Runc.docker_name(), "runc");
    }

    #[test]
    fn the_ptrace_runtime_is_only_taken_when_asked_for_and_registered() {
        let both = ["runc", RUNSC_RUNTIME, RUNSC_PTRACE_RUNTIME];
        let pick = |choice, names: &[&str]| Runtime::resolve(choice, names.iter().copied());
        assert_eq!(pick(RuntimeChoice::Auto, &both).ok(), Some(Runtime::Runsc));
        assert_eq!(
            pick(RuntimeChoice::RunscPtrace, &both).ok(),
            Some(Runtime::RunscPtrace)
        );
        let refused = pick(RuntimeChoice::RunscPtrace, &["runc", RUNSC_RUNTIME])
            .expect_err("the ptrace runtime is not registered");
        assert!(refused.to_string().contains("make gvisor"), "{refused}");
        assert_eq!(Runtime::RunscPtrace.docker_name(), RUNSC_PTRACE_RUNTIME);
        assert_eq!(Runtime::RunscPtrace.name(), "runsc-ptrace");
    }
}
