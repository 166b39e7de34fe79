//! Extractors whose rejections are API errors (`{"reason", "message"}`), not axum's plain
//! text.

use super::error::ApiError;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

/// [`axum::extract::Path`]: a parameter that is not UTF-8 once percent-decoded
/// (`/api/kernels/%FF`) answers 400 with an error body.
#[derive(Debug)]
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(Path(value)),
            Err(e) => Err(ApiError::new(e.status(), e.body_text())),
        }
    }
}
