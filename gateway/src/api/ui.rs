//! The browser page at `/`: a small console that is itself a client of the kernel REST API
//! and the channels WebSocket. Its files are compiled into the binary; it loads nothing from
//! anywhere else, and the Content-Security-Policy says so.
//!
//! These routes are public: the page holds no secret. It asks for the token and sends it
//! with each API call (and as `?token=` on the WebSocket, where browsers cannot set headers).

use super::extract::Path;
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use utoipa::IntoParams;

/// Only this gateway's own files run. Kernel output is untrusted: images are `data:` URLs,
/// HTML goes into sandboxed `srcdoc` frames that inherit this policy, so no script in an
/// output ever runs. `'unsafe-inline'` styles are for those frames (pandas tables carry a
/// `<style>` block); the page itself sets no inline style.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; \
img-src 'self' data:; frame-src 'self'; connect-src 'self' ws: wss:; base-uri 'none'; \
form-action 'none'; frame-ancestors 'none'";

const INDEX_HTML: &str = include_str!("../../assets/ui/index.html");
const APP_JS: &str = include_str!("../../assets/ui/app.js");
const STYLE_CSS: &str = include_str!("../../assets/ui/style.css");
const LOGO_SVG: &[u8] = include_bytes!("../../assets/logo-svg.svg");

/// The web console: a page that is a client of the kernel API and the channels WebSocket.
#[utoipa::path(
    get, path = "/", tag = "console", operation_id = "console",
    responses((status = 200, description = "The page", body = String, content_type = "text/html")),
)]
pub async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML.as_bytes())
}

/// The `{file}` of the console's assets.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct AssetPath {
    /// One of the console's files; any other name answers 404.
    #[param(pattern = r"^(app\.js|style\.css|logo\.svg)$", example = "app.js")]
    file: String,
}

/// The web console's script, style sheet and logo.
#[utoipa::path(
    get, path = "/ui/{file}", tag = "console", operation_id = "console_asset",
    params(AssetPath),
    responses(
        (status = 200, description = "The file",
         content((String = "text/javascript"), (String = "text/css"), ("image/svg+xml"))),
        (status = 404, description = "No such file", body = super::error::ErrorBody),
    ),
)]
pub async fn file(Path(AssetPath { file }): Path<AssetPath>) -> Response {
    match file.as_str() {
        "app.js" => asset("text/javascript; charset=utf-8", APP_JS.as_bytes()),
        "style.css" => asset("text/css; charset=utf-8", STYLE_CSS.as_bytes()),
        "logo.svg" => asset("image/svg+xml", LOGO_SVG),
        _ => {
            super::error::ApiError::new(StatusCode::NOT_FOUND, format!("No such file: /ui/{file}"))
                .into_response()
        }
    }
}

fn asset(content_type: &'static str, body: &'static [u8]) -> Response {
    let headers: [(HeaderName, HeaderValue); 5] = [
        (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CSP),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ),
        // The files change only with the binary; revalidating costs little on loopback.
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
    ];
    (headers, body).into_response()
}
