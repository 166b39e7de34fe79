//! Web pages are hostile territory: a page the operator happens to visit can make the
//! browser send requests to the gateway. Two checks, before anything else runs:
//!
//! - A WebSocket upgrade or a state-changing request (anything but GET, HEAD, OPTIONS) with
//!   an `Origin` that is not the gateway's own (own: the Origin's host and port are the
//!   `Host` header's) is refused with 403, unless `--allow-origin` lists it (or is `*`).
//!   Requests without `Origin` (programs, not browsers) pass, as with jupyter_server.
//! - With `--no-auth`, a request whose `Host` is not a loopback name is refused: a DNS
//!   rebinding page reaches 127.0.0.1 under its own host name.
//!
//! Every response also gets `frame-ancestors 'none'` (no framing, so no clickjacking) and
//! `nosniff`, unless the handler set its own policy.

use super::error::ApiError;
use super::AppState;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::net::IpAddr;

/// Which foreign origins may use the gateway from a browser.
#[derive(Debug, Clone, Default)]
pub struct OriginPolicy {
    /// Exact origins (`https://lab.example.org:8443`); `*` allows any.
    pub allowed: Vec<String>,
    /// Refuse `Host` headers that are not loopback names (`--no-auth`).
    pub loopback_hosts_only: bool,
}

const API_CSP: &str = "default-src 'none'; frame-ancestors 'none'";

pub async fn guard(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Err(refusal) = state.origins.check(req.method(), req.headers()) {
        return refusal.into_response();
    }
    let mut response = next.run(req).await;
    let headers = response.headers_mut();
    if !headers.contains_key(header::CONTENT_SECURITY_POLICY) {
        headers.insert(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(API_CSP),
        );
    }
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    response
}

impl OriginPolicy {
    fn check(&self, method: &Method, headers: &HeaderMap) -> Result<(), ApiError> {
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        if self.loopback_hosts_only && !is_loopback_host(host) {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                format!(
                    "Host {host:?} is not a loopback name: without a token this gateway only \
                     answers requests to localhost or 127.0.0.1 (a guard against DNS rebinding); \
                     use a token to serve other names"
                ),
            ));
        }
        let upgrade = headers.contains_key(header::UPGRADE);
        let changes_state = !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS);
        if !(upgrade || changes_state) {
            return Ok(());
        }
        let Some(origin) = headers.get(header::ORIGIN) else {
            return Ok(());
        };
        let origin = origin.to_str().unwrap_or("null");
        if same_origin(origin, host) || self.allows(origin) {
            return Ok(());
        }
        tracing::warn!(%origin, %host, %method, "refused a cross-origin request");
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "Origin {origin} may not use this gateway: a page from another site cannot run \
                 code here. If that site is yours, start the gateway with --allow-origin {origin}"
            ),
        ))
    }

    fn allows(&self, origin: &str) -> bool {
        self.allowed
            .iter()
            .any(|a| a == "*" || a.trim_end_matches('/').eq_ignore_ascii_case(origin))
    }
}

/// `http://host:port` against the `Host` header, default ports filled in.
fn same_origin(origin: &str, host: &str) -> bool {
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false;
    };
    let default_port = match scheme.to_ascii_lowercase().as_str() {
        "http" => "80",
        "https" => "443",
        _ => return false,
    };
    let with_port = |a: &str| -> String {
        let a = a.trim_end_matches('/').to_ascii_lowercase();
        // `[::1]:8888`, `[::1]`, `host:8888`, `host`
        let has_port = match a.rfind(']') {
            Some(close) => a[close..].contains(':'),
            None => a.contains(':'),
        };
        if has_port {
            a
        } else {
            format!("{a}:{default_port}")
        }
    };
    !host.is_empty() && with_port(authority) == with_port(host)
}

/// `localhost`, `*.localhost`, 127.0.0.0/8 and `::1`, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                host
            }
        }),
    };
    let name = name.to_ascii_lowercase();
    name == "localhost"
        || name.ends_with(".localhost")
        || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("header"));
        }
        h
    }

    #[test]
    fn foreign_origins_may_not_change_anything() {
        let p = OriginPolicy::default();
        let evil = headers(&[
            ("host", "127.0.0.1:8888"),
            ("origin", "http://evil.example"),
        ]);
        assert!(p.check(&Method::POST, &evil).is_err());
        assert!(p.check(&Method::DELETE, &evil).is_err());
        assert!(
            p.check(&Method::GET, &evil).is_ok(),
            "reads are not state changes"
        );
        let ws = headers(&[
            ("host", "127.0.0.1:8888"),
            ("origin", "http://evil.example"),
            ("upgrade", "websocket"),
        ]);
        assert!(p.check(&Method::GET, &ws).is_err());
        let own = headers(&[
            ("host", "127.0.0.1:8888"),
            ("origin", "http://127.0.0.1:8888"),
        ]);
        assert!(p.check(&Method::POST, &own).is_ok());
        let no_origin = headers(&[("host", "127.0.0.1:8888")]);
        assert!(p.check(&Method::POST, &no_origin).is_ok());
        let null = headers(&[("host", "127.0.0.1:8888"), ("origin", "null")]);
        assert!(p.check(&Method::POST, &null).is_err());
        let other_port = headers(&[
            ("host", "127.0.0.1:8888"),
            ("origin", "http://127.0.0.1:9999"),
        ]);
        assert!(p.check(&Method::POST, &other_port).is_err());
    }

    #[test]
    fn allowed_origins_pass() {
        let p = OriginPolicy {
            allowed: vec!["https://lab.example.org".into()],
            loopback_hosts_only: false,
        };
        let lab = headers(&[("host", "gw:8888"), ("origin", "https://lab.example.org")]);
        assert!(p.check(&Method::POST, &lab).is_ok());
        let other = headers(&[("host", "gw:8888"), ("origin", "https://other.example.org")]);
        assert!(p.check(&Method::POST, &other).is_err());
        let any = OriginPolicy {
            allowed: vec!["*".into()],
            loopback_hosts_only: false,
        };
        assert!(any.check(&Method::POST, &other).is_ok());
    }

    #[test]
    fn default_ports_and_ipv6_compare_as_browsers_do() {
        assert!(same_origin("http://localhost", "localhost:80"));
        assert!(same_origin("https://gw.example", "gw.example"));
        assert!(same_origin("http://[::1]:8888", "[::1]:8888"));
        assert!(!same_origin("http://[::1]:8888", "[::1]"));
        assert!(!same_origin("file://", "localhost"));
    }

    #[test]
    fn without_a_token_only_loopback_names_are_served() {
        for ok in [
            "127.0.0.1:8888",
            "localhost:8888",
            "LOCALHOST",
            "[::1]:8888",
            "127.1.2.3",
            "app.localhost:1",
        ] {
            assert!(is_loopback_host(ok), "{ok}");
        }
        for bad in [
            "evil.example:8888",
            "rebind.example",
            "10.0.0.1:8888",
            "",
            "localhost.evil.example",
        ] {
            assert!(!is_loopback_host(bad), "{bad}");
        }
        let p = OriginPolicy {
            allowed: Vec::new(),
            loopback_hosts_only: true,
        };
        let rebound = headers(&[("host", "attacker.example:8888")]);
        assert!(p.check(&Method::GET, &rebound).is_err());
    }
}
