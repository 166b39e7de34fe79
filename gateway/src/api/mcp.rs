//! `/mcp`: the MCP server ([`crate::mcp`]) over MCP's Streamable HTTP transport, through
//! rmcp's service, behind the same token and Origin checks as the rest of the API.
//!
//!
//! The API's middleware runs first: the gateway's own Host and Origin checks (so rmcp's,
//! which accept loopback names only, are off) and the token, whose tenant rides along in
//! the request's extensions. Sessions belong to the key that opened them: any other key
//! gets 404 for a session id, as for one that does not exist.
//!
//! rmcp answers transport errors in plain text (or with no body); they become the API's
//! `{"reason", "message"}` with the same status, saying what to send instead. JSON-RPC
//! bodies (errors included) and event streams pass untouched. A body that is not a JSON-RPC
//! message is a 400 (rmcp says 415, which means a wrong `Content-Type`).

use super::auth::Caller;
use super::error::{allowed_methods, is_json, rewrap, ApiError};
use super::AppState;
use crate::mcp::{Mcp, Session, SESSION_HEADER};
use crate::tenants::Tenant;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Method, Request, Response, StatusCode};
use axum::response::IntoResponse;
use rmcp::transport::streamable_http_server::session::local::{LocalSessionManager, SessionConfig};
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

pub async fn serve(
    State(state): State<AppState>,
    caller: Caller,
    req: Request<Body>,
) -> Response<Body> {
    state.mcp.serve(&caller.0, req).await
}

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
            .with_cancellation_token(mcp.cancel_token().child_token())
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

    /// Whether the session `id` lives here (cluster mode: another node's is forwarded).
    pub fn holds(&self, id: &str) -> bool {
        self.owners().contains_key(id)
    }

    /// Handles one request of `tenant` (who is also in its extensions).
    pub async fn serve(&self, tenant: &Tenant, req: Request<Body>) -> Response<Body> {
        let session = req
            .headers()
            .get(SESSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if let Some(id) = &session {
            let owner = self.owners().get(id).cloned();
            if owner.is_some_and(|o| o != tenant.name) {
                return not_found();
            }
        }
        let closing = req.method() == Method::DELETE;
        let method = req.method().clone();
        let sent_json = is_json(req.headers());
        let response = self.service.handle(req).await;
        let (mut parts, body) = response.into_parts();
        let opened = parts
            .headers
            .get(SESSION_HEADER)
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
        let failed = parts.status.is_client_error() || parts.status.is_server_error();
        if !failed || is_json(&parts.headers) {
            return Response::from_parts(parts, Body::new(body));
        }
        // rmcp's error answers are one line of text.
        let text = axum::body::to_bytes(Body::new(body), 4096)
            .await
            .unwrap_or_default();
        let text = String::from_utf8_lossy(&text);
        let (status, message) = explain(parts.status, &method, sent_json, &parts, text.trim());
        parts.status = status;
        rewrap(parts, message)
    }
}

/// What an MCP client sent wrong, from rmcp's status and text: the status to answer (415
/// for a body that is not JSON-RPC is a 400) and what to do.
fn explain(
    status: StatusCode,
    method: &Method,
    sent_json: bool,
    parts: &axum::http::response::Parts,
    text: &str,
) -> (StatusCode, String) {
    // rmcp writes "Reason Phrase: detail".
    let detail = text.split_once(": ").map_or(text, |(_, d)| d);
    let message = match status {
        StatusCode::UNSUPPORTED_MEDIA_TYPE if sent_json => {
            let detail = text
                .strip_prefix("fail to deserialize request body ")
                .unwrap_or(text);
            return (
                StatusCode::BAD_REQUEST,
                format!(
                    "the body is not a JSON-RPC message ({detail}); POST one JSON-RPC 2.0 \
                     request, notification or response, like \
                     {{\"jsonrpc\": \"2.0\", \"id\": 1, \"method\": \"ping\"}}"
                ),
            );
        }
        StatusCode::UNSUPPORTED_MEDIA_TYPE => {
            "send the JSON-RPC message with Content-Type: application/json".to_owned()
        }
        StatusCode::NOT_ACCEPTABLE if method == Method::GET => {
            "the server's stream is Server-Sent Events: send Accept: text/event-stream".to_owned()
        }
        StatusCode::NOT_ACCEPTABLE => "MCP's Streamable HTTP transport answers JSON or an \
             event stream: send Accept: application/json, text/event-stream"
            .to_owned(),
        StatusCode::NOT_FOUND => SESSION_GONE.to_owned(),
        StatusCode::METHOD_NOT_ALLOWED => format!(
            "{method} is not allowed on /mcp; use {}",
            allowed_methods(&parts.headers)
        ),
        StatusCode::BAD_REQUEST if detail.contains("Session ID is required") => format!(
            "{method} /mcp needs the Mcp-Session-Id header of a session (the answer to \
             `initialize` carries it); a client without sessions only POSTs"
        ),
        StatusCode::BAD_REQUEST if detail.contains("MCP-Protocol-Version") => format!(
            "{detail}; send a version this server answered in `initialize`, or leave the \
             MCP-Protocol-Version header out"
        ),
        StatusCode::PAYLOAD_TOO_LARGE => format!(
            "{detail}: the largest MCP message is --max-message-mb; send large data as files \
             (write_file, or the files API) in parts"
        ),
        _ if detail.is_empty() => status.canonical_reason().unwrap_or("error").to_owned(),
        _ => detail.to_owned(),
    };
    (status, message)
}

const SESSION_GONE: &str = "no such MCP session: it ended (DELETE, or --mcp-idle-timeout \
    without use, or a gateway restart) or another key opened it; start a new one with \
    `initialize` and no Mcp-Session-Id header";

fn not_found() -> Response<Body> {
    ApiError::new(StatusCode::NOT_FOUND, SESSION_GONE).into_response()
}
