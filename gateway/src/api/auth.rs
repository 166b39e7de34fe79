//! Token authentication, as Jupyter Server does it: `Authorization: token T`,
//! `Authorization: Bearer T`, or `?token=T`. Compared in constant time.

use super::error::ApiError;
use super::AppState;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};

/// The token clients must show, or none when auth was switched off explicitly.
#[derive(Clone)]
pub struct Auth {
    token_digest: Option<[u8; 32]>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("required", &self.token_digest.is_some())
            .finish()
    }
}

impl Auth {
    pub fn token(token: &str) -> Self {
        Auth {
            token_digest: Some(Sha256::digest(token.as_bytes()).into()),
        }
    }

    pub fn disabled() -> Self {
        Auth { token_digest: None }
    }

    /// Comparing fixed-size digests byte by byte with no early exit takes the same time
    /// whatever the guess, and hides the token's length.
    pub fn accepts(&self, presented: Option<&str>) -> bool {
        let Some(expected) = &self.token_digest else {
            return true;
        };
        let Some(presented) = presented else {
            return false;
        };
        let got: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        got.iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// The token a request carries, from the header or the query string.
pub fn presented_token(req: &Request) -> Option<String> {
    if let Some(value) = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        let value = value.trim();
        for scheme in ["token ", "Token ", "Bearer ", "bearer "] {
            if let Some(t) = value.strip_prefix(scheme) {
                return Some(t.trim().to_owned());
            }
        }
    }
    req.uri().query().and_then(|q| {
        q.split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == "token")
            .map(|(_, v)| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = match bytes.get(i..i + 3) {
            Some([b'%', h, l]) => hex(*h).zip(hex(*l)).map(|(h, l)| (h * 16 + l) as u8),
            _ => None,
        };
        match (escaped, bytes[i]) {
            (Some(b), _) => {
                out.push(b);
                i += 3;
                continue;
            }
            (None, b'+') => out.push(b' '),
            (None, b) => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Middleware: refuses requests without the right token.
pub async fn require_token(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if state.auth.accepts(presented_token(&req).as_deref()) {
        Ok(next.run(req).await)
    } else {
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "Missing or wrong token: send `Authorization: token <token>` or add `?token=<token>` \
             (the token is printed when the gateway starts, or set with --token / KERNELGATE_TOKEN)",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    fn req(uri: &str, auth: Option<&str>) -> Request {
        let mut b = axum::http::Request::builder().uri(uri);
        if let Some(a) = auth {
            b = b.header(header::AUTHORIZATION, a);
        }
        b.body(Body::empty()).expect("request")
    }

    #[test]
    fn accepts_all_jupyter_forms() {
        let auth = Auth::token("s3cret");
        for r in [
            req("/api/kernels", Some("token s3cret")),
            req("/api/kernels", Some("Bearer s3cret")),
            req("/api/kernels?token=s3cret", None),
            req("/api/kernels?x=1&token=s3cr%65t", None),
        ] {
            assert!(
                auth.accepts(presented_token(&r).as_deref()),
                "{:?}",
                r.uri()
            );
        }
        for r in [
            req("/api/kernels", None),
            req("/api/kernels", Some("token ")),
            req("/api/kernels", Some("token s3cre")),
            req("/api/kernels?token=", None),
        ] {
            assert!(
                !auth.accepts(presented_token(&r).as_deref()),
                "{:?}",
                r.uri()
            );
        }
        assert!(Auth::disabled().accepts(None));
    }
}
