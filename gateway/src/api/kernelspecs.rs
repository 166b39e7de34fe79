//! `GET /api/kernelspecs`, `GET /api/kernelspecs/{name}` and the logo files under
//! `/kernelspecs/{name}/{file}`, from the gateway's [`crate::kernelspecs`].

use super::error::{ApiError, ErrorBody};
use super::extract::Path;
use super::AppState;
use crate::kernelspecs::{KernelSpec, DEFAULT_SPEC};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use utoipa::{IntoParams, ToSchema};

/// A kernel spec as Jupyter Server's `/api/kernelspecs` describes it.
#[derive(Debug, Serialize, ToSchema)]
pub struct KernelSpecModel {
    #[schema(example = "python3")]
    name: String,
    spec: KernelSpecFile,
    resources: Resources,
}

/// The `kernel.json` part of a spec model.
#[derive(Debug, Serialize, ToSchema)]
struct KernelSpecFile {
    /// The command the kernel's container runs, with `{connection_file}`.
    argv: Vec<String>,
    display_name: String,
    #[schema(example = "python")]
    language: &'static str,
    #[schema(example = "signal")]
    interrupt_mode: &'static str,
    /// Always empty: a kernel's environment comes from `POST /api/kernels`.
    #[schema(value_type = HashMap<String, String>)]
    env: BTreeMap<String, String>,
    metadata: SpecMetadata,
}

#[derive(Debug, Serialize, ToSchema)]
struct SpecMetadata {
    kernelgate: Isolation,
}

/// How this spec's kernels run.
#[derive(Debug, Serialize, ToSchema)]
struct Isolation {
    #[schema(example = "docker")]
    isolation: &'static str,
    #[schema(example = "none")]
    network: &'static str,
    image: String,
    /// The image was found when the gateway started.
    image_present: bool,
    /// Warm kernels kept started.
    pool_size: usize,
}

/// URLs of the spec's logos.
#[derive(Debug, Serialize, ToSchema)]
struct Resources {
    #[serde(rename = "logo-64x64")]
    #[schema(example = "/kernelspecs/python3/logo-64x64.png")]
    logo_png: String,
    #[serde(rename = "logo-svg")]
    #[schema(example = "/kernelspecs/python3/logo-svg.svg")]
    logo_svg: String,
}

impl KernelSpecModel {
    fn of(spec: &KernelSpec) -> KernelSpecModel {
        let name = &spec.name;
        KernelSpecModel {
            name: name.clone(),
            spec: KernelSpecFile {
                argv: spec.argv.clone(),
                display_name: spec.display_name.clone(),
                language: "python",
                interrupt_mode: "signal",
                env: BTreeMap::new(),
                metadata: SpecMetadata {
                    kernelgate: Isolation {
                        isolation: "docker",
                        network: "none",
                        image: spec.image.clone(),
                        image_present: spec.image_present,
                        pool_size: spec.pool_size,
                    },
                },
            },
            resources: Resources {
                logo_png: format!("/kernelspecs/{name}/logo-64x64.png"),
                logo_svg: format!("/kernelspecs/{name}/logo-svg.svg"),
            },
        }
    }
}

/// Every spec of the gateway, by name (in the gateway's order).
#[derive(Debug, Serialize, ToSchema)]
pub struct KernelSpecs {
    #[schema(example = "python3")]
    default: &'static str,
    #[serde(serialize_with = "by_name")]
    #[schema(value_type = HashMap<String, KernelSpecModel>)]
    kernelspecs: Vec<KernelSpecModel>,
}

fn by_name<S: serde::Serializer>(specs: &[KernelSpecModel], s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(specs.iter().map(|m| (&m.name, m)))
}

/// The `{name}` of a spec's routes.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct SpecPath {
    /// The kernel spec's name.
    #[param(example = "python3")]
    name: String,
}

/// The `{name}/{file}` of a spec's logo files.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct ResourcePath {
    /// The kernel spec's name.
    #[param(example = "python3")]
    name: String,
    /// One of the logos; any other name answers 404.
    #[param(
        pattern = r"^(logo-64x64\.png|logo-svg\.svg)$",
        example = "logo-svg.svg"
    )]
    file: String,
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

/// The gateway's kernel specs.
#[utoipa::path(
    get, path = "/api/kernelspecs", tag = "kernelspecs", operation_id = "list_kernelspecs",
    responses((status = 200, description = "Every spec, by name", body = KernelSpecs)),
)]
pub async fn list(State(state): State<AppState>) -> Json<KernelSpecs> {
    Json(KernelSpecs {
        default: DEFAULT_SPEC,
        kernelspecs: state
            .kernels
            .specs()
            .iter()
            .map(KernelSpecModel::of)
            .collect(),
    })
}

/// One kernel spec.
#[utoipa::path(
    get, path = "/api/kernelspecs/{name}", tag = "kernelspecs", operation_id = "get_kernelspec",
    params(SpecPath),
    responses(
        (status = 200, description = "The spec", body = KernelSpecModel),
        (status = 404, description = "No spec of that name", body = ErrorBody),
    ),
)]
pub async fn get(
    State(state): State<AppState>,
    Path(SpecPath { name }): Path<SpecPath>,
) -> Result<Json<KernelSpecModel>, ApiError> {
    Ok(Json(KernelSpecModel::of(find(&state, &name)?)))
}

/// A spec's logo, as its model's `resources` name it.
#[utoipa::path(
    get, path = "/kernelspecs/{name}/{file}", tag = "kernelspecs", operation_id = "get_kernelspec_resource",
    params(ResourcePath),
    responses(
        (status = 200, description = "The logo's bytes",
         content(("image/png"), ("image/svg+xml"))),
        (status = 404, description = "No spec of that name, or no such file", body = ErrorBody),
    ),
)]
pub async fn resource(
    State(state): State<AppState>,
    Path(ResourcePath { name, file }): Path<ResourcePath>,
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
