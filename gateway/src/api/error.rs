//! The one API error type: it picks the status code and a message that is safe to show
//! (no stack traces, no secrets), as Jupyter Server does: `{"reason", "message"}`.

use crate::backend::BackendError;
use crate::kernel::KernelError;
use crate::kernels::files::FileError;
use crate::kernels::CreateError;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

/// The body of every error answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// The HTTP reason phrase of the status (`Not Found`).
    #[schema(example = "Not Found")]
    pub reason: String,
    /// What went wrong, and often what to do about it; safe to show to a user.
    #[schema(example = "Kernel does not exist: 2f0c8a1e-8d2b-4c11-9d3e-5b6f7a8b9c0d")]
    pub message: String,
}

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }

    pub fn no_kernel(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            format!("Kernel does not exist: {id}"),
        )
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            reason: self.status.canonical_reason().unwrap_or("Error").to_owned(),
            message: self.message,
        };
        (self.status, Json(body)).into_response()
    }
}

/// The answer to a request body that could not be read: over `--max-message-mb` (413), or
/// cut short. The rest of the body is not read, so the connection cannot be reused; saying
/// so keeps clients from sending their next request on it.
pub fn body_refused(e: BytesRejection, limit_bytes: usize) -> Response {
    let error = ApiError::new(
        e.status(),
        format!(
            "request body refused: {} (the limit is {} MiB)",
            e.body_text(),
            limit_bytes >> 20
        ),
    );
    ([(axum::http::header::CONNECTION, "close")], error).into_response()
}

impl From<BackendError> for ApiError {
    fn from(e: BackendError) -> Self {
        let status = match e {
            BackendError::Gone { .. } => StatusCode::NOT_FOUND,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
        tracing::warn!(error = %e, "backend error");
        ApiError::new(status, e.to_string())
    }
}

impl From<KernelError> for ApiError {
    fn from(e: KernelError) -> Self {
        let status = match e {
            KernelError::NotWritable(_) => StatusCode::BAD_REQUEST,
            KernelError::NotReady(_) => StatusCode::GATEWAY_TIMEOUT,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
        ApiError::new(status, e.to_string())
    }
}

impl From<CreateError> for ApiError {
    fn from(e: CreateError) -> Self {
        match e {
            CreateError::NoSuchSpec { .. } => ApiError::new(StatusCode::NOT_FOUND, e.to_string()),
            CreateError::TooMany { .. } | CreateError::TooManyForKey { .. } => {
                ApiError::new(StatusCode::FORBIDDEN, e.to_string())
            }
            CreateError::BadEnv { .. } => ApiError::bad_request(e.to_string()),
            CreateError::ShuttingDown => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }
            CreateError::Backend(b) => b.into(),
            CreateError::Kernel(k) => k.into(),
        }
    }
}

impl From<FileError> for ApiError {
    fn from(e: FileError) -> Self {
        let status = match e {
            FileError::NotFound { .. } => StatusCode::NOT_FOUND,
            FileError::BadPath { .. } => StatusCode::BAD_REQUEST,
            FileError::WrongKind { .. } => StatusCode::CONFLICT,
            FileError::Forbidden { .. } => StatusCode::FORBIDDEN,
            FileError::NoSpace { .. } => StatusCode::INSUFFICIENT_STORAGE,
            FileError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            FileError::Failed { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            FileError::Backend(b) => return b.into(),
        };
        ApiError::new(status, e.to_string())
    }
}
