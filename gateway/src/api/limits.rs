//! Size limits of a request's head, below hyper's own: hyper answers a URL over 64 KiB, more
//! than 100 headers or a head over about 400 KiB itself, with a bare status and no body.
//! Below those, this middleware answers 414 and 431 as JSON errors that say what to send
//! instead.
//!
//! The limits are generous for Jupyter clients: JupyterLab puts the token in the
//! `Authorization` header (in `?token=` only on WebSockets, 48 hex digits), and Jupyter
//! Server itself (Tornado) accepts a request head of 64 KiB in all.

use super::error::ApiError;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The longest request target (path and query) answered: 16 KiB.
pub const MAX_URI_BYTES: usize = 16 * 1024;
/// The most header bytes (names, values and separators, as on the wire) answered: 64 KiB.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

pub async fn guard(req: Request, next: Next) -> Response {
    let uri = req.uri();
    let uri_bytes = match uri.authority() {
        // Absolute form (`GET http://host/path`), as proxies send it.
        Some(_) => uri.to_string().len(),
        None => uri.path_and_query().map_or(0, |p| p.as_str().len()),
    };
    if uri_bytes > MAX_URI_BYTES {
        return ApiError::new(
            StatusCode::URI_TOO_LONG,
            format!(
                "the URL is {uri_bytes} bytes; this gateway reads at most {MAX_URI_BYTES} \
                 (16 KiB): send data in the request body, and the token in the \
                 Authorization header rather than ?token="
            ),
        )
        .into_response();
    }
    // As on the wire: "name: value\r\n".
    let size = |(name, value): (&axum::http::HeaderName, &axum::http::HeaderValue)| {
        name.as_str().len() + value.len() + 4
    };
    let header_bytes: usize = req.headers().iter().map(size).sum();
    if header_bytes > MAX_HEADER_BYTES {
        let largest = req
            .headers()
            .iter()
            .max_by_key(|h| size(*h))
            .map(|(name, value)| format!(" (the largest is {name}, {} bytes)", value.len()))
            .unwrap_or_default();
        return ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!(
                "the request's headers are {header_bytes} bytes together{largest}; this \
                 gateway reads at most {MAX_HEADER_BYTES} (64 KiB): send fewer or smaller \
                 headers (clear this site's cookies if they are what grew)"
            ),
        )
        .into_response();
    }
    next.run(req).await
}
