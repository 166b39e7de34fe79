//! `GET /api/kernelspecs`, `GET /api/kernelspecs/{name}` and the logo files under
//! `/kernelspecs/{name}/{file}`.

use super::error::ApiError;
use crate::kernels::KERNEL_NAME;
use axum::extract::Path;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

const LOGO_PNG: &[u8] = include_bytes!("../../assets/logo-64x64.png");
const LOGO_SVG: &[u8] = include_bytes!("../../assets/logo-svg.svg");

fn spec_model(name: &str) -> Value {
    json!({
        "name": name,
        "spec": {
            "argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (sandboxed)",
            "language": "python",
            "interrupt_mode": "signal",
            "env": {},
            "metadata": {"kernelgate": {"isolation": "docker", "network": "none"}},
        },
        "resources": {
            "logo-64x64": format!("/kernelspecs/{name}/logo-64x64.png"),
            "logo-svg": format!("/kernelspecs/{name}/logo-svg.svg"),
        },
    })
}

fn no_spec(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("Kernel spec {name} not found; this gateway offers {KERNEL_NAME}"),
    )
}

pub async fn list() -> Json<Value> {
    Json(json!({
        "default": KERNEL_NAME,
        "kernelspecs": { KERNEL_NAME: spec_model(KERNEL_NAME) },
    }))
}

pub async fn get(Path(name): Path<String>) -> Result<Json<Value>, ApiError> {
    if name != KERNEL_NAME {
        return Err(no_spec(&name));
    }
    Ok(Json(spec_model(&name)))
}

pub async fn resource(Path((name, file)): Path<(String, String)>) -> Result<Response, ApiError> {
    if name != KERNEL_NAME {
        return Err(no_spec(&name));
    }
    let (bytes, mime) = match file.as_str() {
        "logo-64x64.png" => (LOGO_PNG, "image/png"),
        "logo-svg.svg" => (LOGO_SVG, "image/svg+xml"),
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
        ],
        bytes,
    )
        .into_response())
}
