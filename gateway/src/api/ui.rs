//! The browser page at `/`: a small console that is itself a client of the kernel REST API
//! and the channels WebSocket. Its files are compiled into the binary; it loads nothing from
//! anywhere else, and the Content-Security-Policy says so.
//!
//! These routes are public: the page holds no secret. It asks for the token and sends it
//! with each API call (and as `?token=` on the WebSocket, where browsers cannot set headers).

use axum::extract::Path;
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

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

/// `GET /`
pub async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML.as_bytes())
}

/// `GET /ui/{file}`
pub async fn file(Path(file): Path<String>) -> Response {
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
