//! `GET /api/kernelspecs`, `GET /api/kernelspecs/{name}` and the logo files under
//! `/kernelspecs/{name}/{file}`, from the gateway's [`crate::kernelspecs`].

use super::error::ApiError;
use super::AppState;
use crate::kernelspecs::{KernelSpec, DEFAULT_SPEC};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

fn spec_model(spec: &KernelSpec) -> Value {
    let name = &spec.name;
    json!({
        "name": name,
        "spec": {
            "argv": spec.argv,
            "display_name": spec.display_name,
            "language": "python",
            "interrupt_mode": "signal",
            "env": {},
            "metadata": {"kernelgate": {
                "isolation": "docker", "network": "none", "image": spec.image,
                "image_present": spec.image_present, "pool_size": spec.pool_size,
            }},
        },
        "resources": {
            "logo-64x64": format!("/kernelspecs/{name}/logo-64x64.png"),
            "logo-svg": format!("/kernelspecs/{name}/logo-svg.svg"),
        },
    })
}

fn find<'a>(state: &'a AppState, name: &str) -> Result<&'a KernelSpec, ApiError> {
    let specs = state.kernels.specs();
    specs.get(name).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "Kernel spec {name} not found; this gateway offers {}",
                specs.names()
            ),
        )
    })
}

pub async fn list(State(state): State<AppState>) -> Json<Value> {
    let specs: serde_json::Map<String, Value> = state
        .kernels
        .specs()
        .iter()
        .map(|s| (s.name.clone(), spec_model(s)))
        .collect();
    Json(json!({"default": DEFAULT_SPEC, "kernelspecs": specs}))
}

pub async fn get(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(spec_model(find(&state, &name)?)))
}

pub async fn resource(
    State(state): State<AppState>,
    Path((name, file)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let spec = find(&state, &name)?;
    let (bytes, mime) = match file.as_str() {
        "logo-64x64.png" => (spec.logo_png.clone(), "image/png"),
        "logo-svg.svg" => (spec.logo_svg.clone(), "image/svg+xml"),
        _ => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("Kernel spec {name} has no resource {file}"),
            ))
        }
    };
    Ok((
        [
            (header::CONTENT_TYPE, mime),
            (header::CACHE_CONTROL, "max-age=3600"),
            // An SVG from an image label must not run script in the gateway's origin.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; style-src 'unsafe-inline'; sandbox",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        bytes,
    )
        .into_response())
}
