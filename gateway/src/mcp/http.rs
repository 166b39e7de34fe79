//! MCP's Streamable HTTP transport at `/mcp`, through rmcp's service.
//!
//! The API's middleware runs first: the gateway's own Host and Origin checks (so rmcp's,
//! which accept loopback names only, are off) and the token, whose tenant rides along in
//! the request's extensions. Sessions belong to the key that opened them: any other key
//! gets 404 for a session id, as for one that does not exist.

use super::{Mcp, Session};
use crate::tenants::Tenant;
use axum::body::Body;
use axum::http::{Method, Request, Response, StatusCode};
use rmcp::transport::streamable_http_server::session::local::{LocalSessionManager, SessionConfig};
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Serves `/mcp`.
pub struct Endpoint {
    service: StreamableHttpService<Session, LocalSessionManager>,
    sessions: Arc<LocalSessionManager>,
    /// Session id to the name of the key that opened it.
    owners: Mutex<HashMap<String, String>>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint").finish_non_exhaustive()
    }
}

impl Endpoint {
    /// `max_body` bounds one POSTed message.
    pub fn new(mcp: Arc<Mcp>, max_body: usize) -> Self {
        let mut sessions = LocalSessionManager::default();
        let mut session_config = SessionConfig::default();
        // A session unused this long ends, and its kernel with it.
        session_config.keep_alive = Some(mcp.idle_timeout());
        sessions.session_config = session_config;
        let config = StreamableHttpServerConfig::default()
            .disable_allowed_hosts()
            .with_cancellation_token(mcp.cancel.child_token())
            .with_max_request_body_bytes(max_body);
        let sessions = Arc::new(sessions);
        let factory_mcp = mcp.clone();
        let service = StreamableHttpService::new(
            move || Ok(Session::http(factory_mcp.clone())),
            sessions.clone(),
            config,
        );
        Endpoint {
            service,
            sessions,
            owners: Mutex::default(),
        }
    }

    fn owners(&self) -> MutexGuard<'_, HashMap<String, String>> {
        self.owners.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Handles one request of `tenant` (who is also in its extensions).
    pub async fn serve(&self, tenant: &Tenant, req: Request<Body>) -> Response<Body> {
        let session = req
            .headers()
            .get(super::SESSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if let Some(id) = &session {
            let owner = self.owners().get(id).cloned();
            if owner.is_some_and(|o| o != tenant.name) {
                return not_found();
            }
        }
        let closing = req.method() == Method::DELETE;
        let response = self.service.handle(req).await;
        let (mut parts, body) = response.into_parts();
        let opened = parts
            .headers
            .get(super::SESSION_HEADER)
            .and_then(|v| v.to_str().ok());
        if let (None, Some(id)) = (&session, opened) {
            // Sessions that expired since are forgotten here.
            let live = self.sessions.sessions.read().await;
            let mut owners = self.owners();
            owners.retain(|id, _| live.contains_key(id.as_str()));
            owners.insert(id.to_owned(), tenant.name.clone());
        }
        if let (true, Some(id)) = (closing && parts.status.is_success(), &session) {
            self.owners().remove(id);
            // rmcp answers 202; the Python client takes only 200 or 204 as a clean close.
            parts.status = StatusCode::NO_CONTENT;
        }
        if parts.status == StatusCode::NOT_FOUND {
            if let Some(id) = &session {
                self.owners().remove(id); // expired
            }
        }
        Response::from_parts(parts, Body::new(body))
    }
}

fn not_found() -> Response<Body> {
    let mut response = Response::new(Body::from("Not Found: Session not found"));
    *response.status_mut() = StatusCode::NOT_FOUND;
    response
}
