//! The one API error type: it picks the status code and a message that is safe to show
//! (no stack traces, no secrets), as Jupyter Server does: `{"reason", "message"}`.

use crate::backend::BackendError;
use crate::kernels::files::FileError;
use crate::kernels::CreateError;
use crate::relay::KernelError;
use axum::extract::rejection::BytesRejection;
use axum::extract::Request;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
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
    /// Seconds to wait before trying again (`Retry-After`), for a condition that passes.
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            retry_after: None,
        }
    }

    /// The answer says when to try again.
    pub fn retry_after(mut self, seconds: u32) -> Self {
        self.retry_after = Some(seconds);
        self
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
        let mut response = (self.status, Json(body)).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, seconds.into());
        }
        response
    }
}

/// Whether an answer's body is JSON already (ours, or a JSON-RPC message of `/mcp`).
pub fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|essence| {
            let essence = essence.trim();
            essence.eq_ignore_ascii_case("application/json") || essence.ends_with("+json")
        })
}

/// Middleware: an error answer that is not JSON (axum's own: 405 with an empty body, an
/// extractor's plain-text rejection) becomes `{"reason", "message"}` with the same status
/// and headers (`Allow` stays). Handlers answer with [`ApiError`]; this is the net under
/// what they do not see.
pub async fn json_errors(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let response = next.run(req).await;
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) || is_json(response.headers()) {
        return response;
    }
    let (parts, body) = response.into_parts();
    // Such answers are a line of text; a longer one is cut.
    let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let message = explain(status, &parts.headers, &method, &path, text.trim());
    rewrap(parts, message)
}

/// The JSON answer of `message`, keeping the status and headers of `parts` but for the
/// body's own.
pub fn rewrap(mut parts: axum::http::response::Parts, message: String) -> Response {
    parts.headers.remove(header::CONTENT_TYPE);
    parts.headers.remove(header::CONTENT_LENGTH);
    let mut response = ApiError::new(parts.status, message).into_response();
    for (name, value) in &parts.headers {
        response.headers_mut().append(name, value.clone());
    }
    response
}

/// The message of an answer axum made, saying what to do.
fn explain(
    status: StatusCode,
    headers: &HeaderMap,
    method: &Method,
    path: &str,
    text: &str,
) -> String {
    match status {
        StatusCode::METHOD_NOT_ALLOWED => {
            let allowed = allowed_methods(headers);
            format!("{method} is not allowed on {path}; use {allowed} (see GET /api/openapi.json)")
        }
        _ if text.is_empty() => format!(
            "{method} {path}: {}",
            status.canonical_reason().unwrap_or("error")
        ),
        _ => text.to_owned(),
    }
}

/// The `Allow` header's methods, as `GET, HEAD or POST`.
pub fn allowed_methods(headers: &HeaderMap) -> String {
    let methods: Vec<&str> = headers
        .get_all(header::ALLOW)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .collect();
    match methods.as_slice() {
        [] => "another method".to_owned(),
        [one] => (*one).to_owned(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
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
        // Names as the user wrote them, not in Rust's quoted form (`\"x\"` once in JSON).
        let message = match &e {
            BackendError::ImageMissing { image, fix } => {
                format!("kernel image `{image}` not found; {fix}")
            }
            _ => e.to_string(),
        };
        ApiError::new(status, message)
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
            CreateError::NoSuchSpec { name, offered } => ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no kernel spec named `{name}`; this gateway offers {offered}"),
            ),
            CreateError::TooManyForKey { key, max } => ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "key `{key}` may run at most {max} kernels (max_kernels in the keys file); \
                     shut one of yours down first"
                ),
            ),
            CreateError::TooMany { .. } => ApiError::new(StatusCode::FORBIDDEN, e.to_string()),
            CreateError::BadEnv { .. } => ApiError::bad_request(e.to_string()),
            CreateError::ShuttingDown => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the gateway is shutting down; start the kernel once it (or another) runs",
            ),
            CreateError::Backend(b) => b.into(),
            CreateError::Kernel(k) => k.into(),
            CreateError::Unregistered(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("{e}; try again shortly"),
            )
            .retry_after(5),
            CreateError::Resume(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("{e}; try again, or delete the kernel"),
            ),
            CreateError::StateNotLoaded { .. } | CreateError::FromSnapshot(_) => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }
            CreateError::SnapshotRefused(_) => ApiError::bad_request(e.to_string()),
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
