//! Docker's errors as the backend's: a daemon that cannot be reached, a container that is
//! gone, a refusal with what Docker said.

use super::BackendError;
use bollard::errors::Error as DockerError;
use bollard::query_parameters::RemoveContainerOptionsBuilder;

pub(super) fn force() -> bollard::query_parameters::RemoveContainerOptions {
    RemoveContainerOptionsBuilder::default().force(true).build()
}

pub(super) fn status(e: &DockerError) -> Option<u16> {
    match e {
        DockerError::DockerResponseServerError { status_code, .. } => Some(*status_code),
        _ => None,
    }
}

/// Errors that mean the daemon could not be reached at all, as opposed to a refusal.
pub(super) fn is_connection_error(e: &DockerError) -> bool {
    matches!(
        e,
        DockerError::SocketNotFoundError(_)
            | DockerError::HyperLegacyError { .. }
            | DockerError::HyperResponseError { .. }
            | DockerError::IOError { .. }
            | DockerError::RequestTimeoutError
    )
}

pub(super) fn unavailable(e: DockerError) -> BackendError {
    BackendError::DockerUnavailable {
        detail: e.to_string(),
    }
}

pub(super) fn gone(handle: &str) -> BackendError {
    BackendError::Gone {
        handle: handle.to_owned(),
    }
}

pub(super) fn runtime(what: &str, e: DockerError) -> BackendError {
    if is_connection_error(&e) {
        return unavailable(e);
    }
    BackendError::Runtime(format!("{what}: {e}"))
}

/// For calls on one container: 404 means the kernel's container no longer exists.
pub(super) fn map_handle_error(handle: &str, e: DockerError) -> BackendError {
    if status(&e) == Some(404) {
        gone(handle)
    } else {
        runtime(handle, e)
    }
}
