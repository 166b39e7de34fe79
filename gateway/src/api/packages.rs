//! `GET /api/kernelgate/packages` (what kernels may install) and `POST
//! /api/kernels/{id}/packages` (install some into a kernel): packages on demand from the
//! operator's allowlist, offline (docs/packages.md).

use super::auth::Caller;
use super::error::{body_refused, ApiError, ErrorBody};
use super::extract::{json_body, Path};
use super::kernels::{find, KernelPath};
use super::AppState;
use crate::kernels::packages::{InstallError, Installed};
use crate::packages::Listing;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

/// Which kernel spec's packages to list.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// The kernel spec (default `python3`).
    kernel_name: Option<String>,
}

/// The packages to install.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InstallBody {
    /// Names from `GET /api/kernelgate/packages`, each optionally with a version
    /// specifier: `["seaborn", "scikit-learn==1.5.2"]`.
    packages: Vec<String>,
}

/// The answer when some packages were refused: nothing was installed.
#[derive(Debug, Serialize, ToSchema)]
pub struct RefusedBody {
    pub reason: String,
    pub message: String,
    #[serde(flatten)]
    pub report: Installed,
}

/// What kernels of a kernel spec may install: the operator's allowlist.
///
/// Each package comes with the version the wheelhouse holds for the spec's image. Anything
/// else cannot be installed: kernels have no network.
#[utoipa::path(
    get, path = "/api/kernelgate/packages", tag = "agent", operation_id = "list_packages",
    params(ListQuery),
    responses(
        (status = 200, description = "The allowlist of the kernel spec", body = Listing),
        (status = 404, description = "No such kernel spec, or this gateway provides no packages", body = ErrorBody),
    ),
)]
pub async fn list(
    State(state): State<AppState>,
    _caller: Caller,
    Query(query): Query<ListQuery>,
) -> Result<Json<Listing>, ApiError> {
    let packages = state.kernels.packages().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            InstallError::NotConfigured.to_string(),
        )
    })?;
    let name = query
        .kernel_name
        .unwrap_or_else(|| crate::kernelspecs::DEFAULT_SPEC.to_owned());
    let spec = state.kernels.specs().get(&name).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "no kernel spec named {name:?} (known: {})",
                state.kernels.specs().names()
            ),
        )
    })?;
    let id = match state.kernels.backend().describe_image(&spec.image).await {
        Ok(facts) => facts.id,
        Err(e) => {
            tracing::warn!(image = %spec.image, error = %e, "cannot inspect the kernel spec's image");
            String::new()
        }
    };
    Ok(Json(packages.listing(&name, &spec.image, &id)))
}

/// Installs packages from the allowlist into the kernel, offline, with what they need.
///
/// They are importable at once in the running kernel (`import seaborn` in the next
/// execution). All or nothing: when one is refused, none is installed and the answer says
/// why.
#[utoipa::path(
    post, path = "/api/kernels/{id}/packages", tag = "agent", operation_id = "install_packages",
    params(KernelPath),
    request_body = InstallBody,
    responses(
        (status = 200, description = "Installed: what the kernel got, and what it had already", body = Installed),
        (status = 400, description = "The body is not `{\"packages\": [...]}` of names", body = ErrorBody),
        (status = 404, description = "No such kernel, or this gateway provides no packages", body = ErrorBody),
        (status = 422, description = "Nothing was installed: a package is not on the allowlist, \
            not synced for the kernel's image, or no version of it fits (each refusal says which \
            and what to do)", body = RefusedBody),
        (status = 503, description = "The kernel's installer could not run (the message says why)", body = ErrorBody),
    ),
)]
pub async fn install(
    State(state): State<AppState>,
    caller: Caller,
    Path(KernelPath { id }): Path<KernelPath>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = match body {
        Ok(body) => body,
        Err(e) => return Ok(body_refused(e, state.max_message_bytes)),
    };
    let body: InstallBody = json_body(&body, r#"{"packages": ["seaborn"]}"#)?;
    let live = find(&state, &caller, &id)?;
    match state
        .kernels
        .installs()
        .install(&live, &caller.0.name, &body.packages)
        .await
    {
        Ok(done) => Ok(Json(done).into_response()),
        Err(e @ InstallError::NotConfigured) => {
            Err(ApiError::new(StatusCode::NOT_FOUND, e.to_string()))
        }
        Err(e @ InstallError::BadRequest(_)) => Err(ApiError::bad_request(e.to_string())),
        Err(InstallError::Refused(report)) => {
            let message = InstallError::Refused(report.clone()).to_string();
            let status = StatusCode::UNPROCESSABLE_ENTITY;
            let body = RefusedBody {
                reason: status.canonical_reason().unwrap_or_default().to_owned(),
                message,
                report,
            };
            Ok((status, Json(body)).into_response())
        }
        Err(e) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            e.to_string(),
        )),
    }
}
