//! E2B's control plane (snapshots and forks are in [`super::snapshots`]): `POST /v2/sandboxes`, `GET /v2/sandboxes`, `GET`/`DELETE
//! /sandboxes/{id}`, `POST /sandboxes/{id}/timeout`, `POST /v2/sandboxes/{id}/connect`,
//! `GET /sandboxes/{id}/metrics`. The caller is the Kernelgate key in `X-API-KEY`,
//! checked as every key is ([`authenticate`]); another key's sandbox does not exist for it
//! (404), as with kernels.

use super::super::auth::{self, Caller};
use super::super::error::ApiError;
use super::super::extract::json_body;
use super::super::AppState;
use super::{interpreter, watch_expiry, Sandbox, ENVD_VERSION};
use crate::kernels::{CreateError, Removal};
use crate::tenants::Tenant;
use crate::text::form_decode;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, SecondsFormat, Utc};
use kernelgate_protocol::e2b::{
    E2bErrorBody, ListedSandbox, NewSandbox, SandboxConnect, SandboxCreated, SandboxDetail,
    SandboxTimeout,
};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use utoipa::IntoParams;

/// A sandbox lives this long when the create names no timeout (the SDK's default too).
const DEFAULT_TIMEOUT_SECS: u64 = 300;
/// The longest timeout a create or `set_timeout` may ask for (a day).
const MAX_TIMEOUT_SECS: u64 = 86_400;
/// Templates the SDKs name by default; both are the gateway's default kernel spec.
const DEFAULT_TEMPLATES: [&str; 2] = ["code-interpreter-v1", "base"];

const NO_NETWORK: &str = "Kernelgate sandboxes have no network by design (the kernel's \
container runs with network mode none); packages come from the gateway's allowlist \
(`%pip install` in code, or GET /api/kernelgate/packages), files through `sandbox.files`";

/// An answer of the control plane that is not a success: the gateway's error body with
/// the `code` (the status) E2B's SDK reads beside the `message`.
#[derive(Debug)]
pub struct E2bError(pub ApiError);

impl<E: Into<ApiError>> From<E> for E2bError {
    fn from(e: E) -> Self {
        E2bError(e.into())
    }
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let status = self.0.status;
        let body = E2bErrorBody {
            code: Some(status.as_u16()),
            reason: status.canonical_reason().unwrap_or("Error").to_owned(),
            message: self.0.message,
        };
        (status, Json(body)).into_response()
    }
}

/// Whether a `templateID` is E2B's default template (the default kernel spec here).
pub fn is_default_template(template: &str) -> bool {
    template.is_empty() || DEFAULT_TEMPLATES.contains(&template)
}

/// The key in `X-API-KEY`.
#[derive(Debug, Clone)]
pub struct ApiKey(pub Arc<Tenant>);

impl FromRequestParts<AppState> for ApiKey {
    type Rejection = E2bError;

    async fn from_request_parts(parts: &mut Parts, _: &AppState) -> Result<Self, E2bError> {
        // Set by [`authenticate`] in front of the router.
        match parts.extensions.get::<Caller>() {
            Some(caller) => Ok(ApiKey(caller.0.clone())),
            None => Err(ApiError::new(StatusCode::UNAUTHORIZED, WRONG_KEY).into()),
        }
    }
}

const WRONG_KEY: &str = "Missing or wrong X-API-KEY: set E2B_API_KEY to a Kernelgate key (the \
gateway's --token, or a key of --keys)";

/// Whether `path` is one of the control plane's.
fn is_control_path(path: &str) -> bool {
    path == "/v2/sandboxes"
        || path.starts_with("/v2/sandboxes/")
        || path.starts_with("/sandboxes/")
        || path == "/snapshots"
        || path.starts_with("/templates/")
}

/// Middleware in front of the router: a control-plane request is authenticated as every
/// other request is ([`auth::require_token`]: the failure throttle, the audit record of a
/// refusal), with the key of its `X-API-KEY` header; a refusal is answered in E2B's shape
/// (401, or 429 past the throttle).
pub async fn authenticate(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    if !is_control_path(req.uri().path()) {
        return next.run(req).await;
    }
    let key = req
        .headers_mut()
        .remove(kernelgate_protocol::rest::headers::E2B_API_KEY);
    req.headers_mut().remove(header::AUTHORIZATION);
    if let Some(value) = key
        .as_ref()
        .and_then(|k| k.to_str().ok())
        .and_then(|k| HeaderValue::from_str(&format!("token {k}")).ok())
    {
        req.headers_mut().insert(header::AUTHORIZATION, value);
    }
    match auth::require_token(State(state), req, next).await {
        Ok(response) => response,
        Err(refusal) => {
            let status = match refusal.status() {
                StatusCode::TOO_MANY_REQUESTS => StatusCode::TOO_MANY_REQUESTS,
                _ => StatusCode::UNAUTHORIZED,
            };
            let retry = refusal.headers().get(header::RETRY_AFTER).cloned();
            let message = match status {
                StatusCode::TOO_MANY_REQUESTS => {
                    "Too many failed authentications from this address; try again later with the right X-API-KEY"
                }
                _ => WRONG_KEY,
            };
            let mut response = E2bError(ApiError::new(status, message)).into_response();
            if let Some(retry) = retry {
                response.headers_mut().insert(header::RETRY_AFTER, retry);
            }
            response
        }
    }
}

/// The `{id}` of the routes about one sandbox.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct SandboxPath {
    /// The sandbox's id (its kernel's), as the create answered it.
    pub id: String,
}

/// The query of `GET /v2/sandboxes`. Lenient, as E2B's is: a value that does not parse is
/// ignored.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    /// Only sandboxes with all these metadata pairs, URL-encoded `k=v&k2=v2`.
    pub metadata: Option<String>,
    /// Comma-separated states; every sandbox is `running`, so one without `running` lists none.
    pub state: Option<String>,
    /// At most this many per page (a positive number).
    pub limit: Option<String>,
    /// Where the page starts: the `x-next-token` of the page before.
    pub next_token: Option<String>,
    /// `desc` lists the newest first.
    pub order: Option<String>,
}

/// The sandbox `id` if the key may see it and its kernel is still there.
pub fn owned(state: &AppState, key: &ApiKey, id: &str) -> Result<Sandbox, ApiError> {
    let gone = || ApiError::new(StatusCode::NOT_FOUND, format!("sandbox {id} not found"));
    let live = state.kernels.get(id).filter(|l| key.0.may_use(l.owner()));
    let Some(_) = live else {
        if state.kernels.get(id).is_none() {
            state.e2b.remove(id);
        }
        return Err(gone());
    };
    state.e2b.get(id).ok_or_else(gone)
}

fn iso(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

pub(super) fn timeout_of(seconds: Option<u64>) -> Result<Duration, ApiError> {
    match seconds.unwrap_or(DEFAULT_TIMEOUT_SECS) {
        s @ 1..=MAX_TIMEOUT_SECS => Ok(Duration::from_secs(s)),
        s => Err(ApiError::bad_request(format!(
            "timeout must be 1 to {MAX_TIMEOUT_SECS} seconds, not {s}"
        ))),
    }
}

/// What a create asks that cannot be honoured, refused by name rather than ignored.
fn refusal(body: &NewSandbox) -> Option<String> {
    if let Some(name) = body.env_vars.keys().find(|k| !env_name_ok(k)) {
        return Some(format!(
            "envVars {name:?} is refused: an environment variable's name is not empty \
                 and has no '=' and no NUL"
        ));
    }
    if let Some((name, _)) = body.env_vars.iter().find(|(_, v)| v.contains('\0')) {
        return Some(format!(
            "envVars {name:?} is refused: an environment variable's value has no NUL"
        ));
    }
    if body.allow_internet_access == Some(true) {
        return Some(format!(
            "allow_internet_access=True is refused: {NO_NETWORK}"
        ));
    }
    if body.network.as_ref().is_some_and(|n| !is_empty(n)) {
        return Some(format!("network rules are refused: {NO_NETWORK}"));
    }
    if body.mcp.as_ref().is_some_and(|m| !is_empty(m)) {
        return Some(
            "mcp is refused: the sandbox starts no MCP servers (the gateway serves MCP \
                 itself at /mcp)"
                .into(),
        );
    }
    if body.iam.as_ref().is_some_and(|i| !is_empty(i)) {
        return Some("iam is refused: the sandbox holds no cloud credentials".into());
    }
    if body.volume_mounts.as_ref().is_some_and(|v| !v.is_empty()) {
        return Some(
            "volumeMounts are refused: a sandbox sees only its own home; copy files in \
                 with sandbox.files.write"
                .into(),
        );
    }
    let pausing = body.auto_pause == Some(true);
    if pausing && body.auto_pause_memory == Some(Value::Bool(false)) {
        return Some(
            "lifecycle on_timeout mode=filesystem is refused: a timeout pauses all the \
                 engine can keep; connect with on_resume=\"reboot\" to start again fresh with \
                 the files"
                .into(),
        );
    }
    if body
        .auto_resume
        .as_ref()
        .is_some_and(|v| v["enabled"] == false)
    {
        return Some(
            "lifecycle auto_resume=False is refused: a paused sandbox resumes on its next \
                 request (or a connect)"
                .into(),
        );
    }
    if !pausing
        && body
            .auto_resume
            .as_ref()
            .is_some_and(|v| v["enabled"] == true)
    {
        return Some("lifecycle auto_resume=True needs on_timeout=pause".into());
    }
    None
}

/// A name `os.environ` takes.
fn env_name_ok(name: &str) -> bool {
    !name.is_empty() && !name.contains(['=', '\0'])
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Object(o) => o.values().all(is_empty),
        Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// What the SDK reads after a create or connect.
pub(super) fn created(state: &AppState, id: &str, sandbox: &Sandbox) -> SandboxCreated {
    SandboxCreated {
        template_id: sandbox.template_id.clone(),
        sandbox_id: id.to_owned(),
        client_id: "kernelgate".into(),
        envd_version: ENVD_VERSION.into(),
        envd_access_token: state.e2b.token(id),
        // The code interpreter sends this one (as E2B-Traffic-Access-Token) on its context
        // calls, where it sends no X-Access-Token: the same token, so those are checked too.
        traffic_access_token: state.e2b.token(id),
    }
}

fn listed(state: &AppState, id: &str, sandbox: &Sandbox, key: &Tenant) -> ListedSandbox {
    let paused = state.kernels.get(id).is_some_and(|l| l.hibernated());
    ListedSandbox {
        template_id: sandbox.template_id.clone(),
        sandbox_id: id.to_owned(),
        client_id: "kernelgate".into(),
        started_at: iso(sandbox.started_at),
        end_at: iso(sandbox.end_at),
        cpu_count: key.max_cpus.map_or(1, |c| c.ceil() as u64),
        memory_mb: key.max_memory_mb.unwrap_or(0),
        disk_size_mb: 0,
        state: if paused { "paused" } else { "running" }.into(),
        envd_version: ENVD_VERSION.into(),
        metadata: sandbox.metadata.clone(),
    }
}

/// Creates an E2B sandbox (E2B's `Sandbox.create`).
///
/// A sandbox is a kernel of the default spec (or the spec the template names), from the
/// warm pool when one is ready; its id is the kernel's.
#[utoipa::path(
    post, path = "/v2/sandboxes", tag = "e2b", operation_id = "e2b_create_sandbox",
    security(("e2b_api_key" = [])),
    params(("Idempotency-Key" = Option<String>, Header,
            description = "A retried create with the same key (up to 256 bytes) answers the same sandbox")),
    request_body(content = NewSandbox, content_type = "application/json"),
    responses(
        (status = 201, description = "The sandbox runs: a kernel of the spec the template names, from the warm pool when one is ready. Its `envdAccessToken` is the sandbox plane's `X-Access-Token` (requests with `E2b-Sandbox-Id` and `E2b-Sandbox-Port` headers, or to a host `<port>-<id>.<domain>`: envd's `/health`, `/files`, `filesystem.Filesystem` on 49983, the code interpreter's `/execute` and `/contexts` on 49999; a wrong token 401, a sandbox not running 502; docs/e2b.md)", body = SandboxCreated),
        (status = 400, description = "The body is not JSON of this shape, the timeout is out of range, an env variable is refused, or an option the sandbox cannot honour (a network, MCP, IAM, volumes, a files-only pause on timeout, no resume on traffic) is refused by name", body = E2bErrorBody),
        (status = 403, description = "Past `--max-kernels`, or past the key's `max_kernels`", body = E2bErrorBody),
        (status = 404, description = "No kernel spec of the template's name", body = E2bErrorBody),
        (status = 503, description = "Docker cannot be reached, the spec's image is missing, or the gateway is shutting down", body = E2bErrorBody),
        (status = 504, description = "The kernel did not answer within `--startup-timeout`", body = E2bErrorBody),
    ),
)]
pub async fn create(
    State(state): State<AppState>,
    key: ApiKey,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, E2bError> {
    let body: NewSandbox = json_body(&body, r#"{"templateID": "code-interpreter-v1"}"#)?;
    if let Some(refusal) = refusal(&body) {
        return Err(ApiError::bad_request(refusal).into());
    }
    let timeout = timeout_of(body.timeout)?;
    let idempotency = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty() && k.len() <= 256);
    let slot = idempotency.map(|k| state.e2b.create_slot(&key.0.name, k));
    let mut done = match &slot {
        Some(slot) => Some(slot.clone().lock_owned().await),
        None => None,
    };
    if let Some(id) = done.as_ref().and_then(|d| (**d).clone()) {
        if let Ok(sandbox) = owned(&state, &key, &id) {
            return Ok((StatusCode::CREATED, Json(created(&state, &id, &sandbox))).into_response());
        }
    }
    let spec = Some(body.template_id.as_str()).filter(|t| !is_default_template(t));
    // A snapshot's id (or name) as the template: a sandbox with its state.
    let snapshot = spec.and_then(|t| super::snapshots::of_key(&state, &key, t));
    let live = match snapshot {
        Some(held) => {
            state
                .kernels
                .create_from(held, None, &BTreeMap::new(), &key.0)
                .await?
        }
        None => match state.kernels.create(spec, &BTreeMap::new(), &key.0).await {
            Ok(live) => live,
            Err(CreateError::NoSuchSpec { name, offered }) => {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!("no template {name:?}: no kernel spec of that name (this gateway offers {offered}) and no snapshot of this key (GET /snapshots lists them)"),
                )
                .into())
            }
            Err(e) => return Err(e.into()),
        },
    };
    let id = live.id().to_owned();
    if !body.env_vars.is_empty() {
        // The kernel's process is running already (warm): the variables are set in it.
        let code = interpreter::set_environment(&body.env_vars);
        if let Err(e) = interpreter::run_quietly(&state, live.clone(), &key.0.name, code).await {
            let _ = state
                .kernels
                .delete(&id, Removal::Because("its E2B create failed".into()))
                .await;
            return Err(ApiError::new(
                e.status,
                format!("setting the sandbox's envVars failed: {}", e.message),
            )
            .into());
        }
    }
    let now = Utc::now();
    let sandbox = Sandbox {
        template_id: body.template_id,
        metadata: body.metadata,
        started_at: now,
        end_at: now + timeout,
        contexts: BTreeMap::new(),
        contexts_run: Default::default(),
        pause_on_timeout: body.auto_pause == Some(true),
    };
    state.e2b.insert(&id, sandbox.clone());
    watch_expiry(&state, id.clone());
    if let Some(done) = done.as_mut() {
        **done = Some(id.clone());
    }
    Ok((StatusCode::CREATED, Json(created(&state, &id, &sandbox))).into_response())
}

/// Lists the key's E2B sandboxes (E2B's `Sandbox.list`).
///
/// Filtered by `metadata` (URL-encoded `k=v&k2=v2`) and `state`, paged by `limit` and
/// `nextToken` (`x-next-token`).
#[utoipa::path(
    get, path = "/v2/sandboxes", tag = "e2b", operation_id = "e2b_list_sandboxes",
    security(("e2b_api_key" = [])),
    params(ListQuery),
    responses(
        (status = 200, description = "The key's sandboxes (every one, for an admin key), oldest first; when more follow, the next page's `nextToken` is the `x-next-token` header", body = [ListedSandbox],
         headers(("x-next-token" = String, description = "The `nextToken` of the next page"))),
    ),
)]
pub async fn list(
    State(state): State<AppState>,
    key: ApiKey,
    Query(query): Query<ListQuery>,
) -> Result<Response, E2bError> {
    let wanted: Vec<(String, String)> = query
        .metadata
        .as_deref()
        .map(form_pairs)
        .unwrap_or_default();
    let states: Option<Vec<&str>> = query
        .state
        .as_deref()
        .map(|s| s.split(',').map(str::trim).collect());
    let state_wanted = |id: &str| {
        let paused = state.kernels.get(id).is_some_and(|l| l.hibernated());
        let this = if paused { "paused" } else { "running" };
        states.as_ref().is_none_or(|s| s.contains(&this))
    };
    let mut all: Vec<(String, Sandbox)> = state
        .e2b
        .ids()
        .into_iter()
        .filter_map(|id| owned(&state, &key, &id).ok().map(|s| (id, s)))
        .filter(|(_, s)| {
            wanted
                .iter()
                .all(|(k, v)| s.metadata.get(k).is_some_and(|have| have == v))
        })
        .filter(|(id, _)| state_wanted(id))
        .collect();
    all.sort_by(|a, b| (a.1.started_at, &a.0).cmp(&(b.1.started_at, &b.0)));
    if query.order.as_deref() == Some("desc") {
        all.reverse();
    }
    let listed: Vec<ListedSandbox> = all
        .iter()
        .map(|(id, s)| listed(&state, id, s, &key.0))
        .collect();
    Ok(paged(
        listed,
        query.limit.as_deref(),
        query.next_token.as_deref(),
    ))
}

/// A page of `all` as E2B's lists answer: from the offset `next_token` (the page before's
/// `x-next-token`), at most `limit` items; values that do not parse are ignored, as E2B's.
pub(super) fn paged<T: serde::Serialize>(
    all: Vec<T>,
    limit: Option<&str>,
    next_token: Option<&str>,
) -> Response {
    let start: usize = next_token.and_then(|t| t.parse().ok()).unwrap_or(0);
    let limit: usize = limit
        .and_then(|l| l.parse().ok())
        .filter(|&l| l > 0)
        .unwrap_or(usize::MAX);
    let total = all.len();
    let page: Vec<T> = all.into_iter().skip(start).take(limit).collect();
    let mut response = Json(page).into_response();
    let next = start.saturating_add(limit);
    if next < total {
        if let Ok(v) = HeaderValue::from_str(&next.to_string()) {
            response.headers_mut().insert("x-next-token", v);
        }
    }
    response
}

/// One E2B sandbox, with its access tokens (E2B's `get_info`).
#[utoipa::path(
    get, path = "/sandboxes/{id}", tag = "e2b", operation_id = "e2b_get_sandbox",
    security(("e2b_api_key" = [])),
    params(SandboxPath),
    responses(
        (status = 200, description = "The sandbox, with its access tokens", body = SandboxDetail),
        (status = 404, description = "No such sandbox (or another key's)", body = E2bErrorBody),
    ),
)]
pub async fn get(
    State(state): State<AppState>,
    key: ApiKey,
    Path(SandboxPath { id }): Path<SandboxPath>,
) -> Result<Json<SandboxDetail>, E2bError> {
    let sandbox = owned(&state, &key, &id)?;
    Ok(Json(SandboxDetail {
        listed: listed(&state, &id, &sandbox, &key.0),
        envd_access_token: state.e2b.token(&id),
        traffic_access_token: state.e2b.token(&id),
        allow_internet_access: false,
    }))
}

/// Ends an E2B sandbox: its kernel and container go (E2B's `kill`).
#[utoipa::path(
    delete, path = "/sandboxes/{id}", tag = "e2b", operation_id = "e2b_kill_sandbox",
    security(("e2b_api_key" = [])),
    params(SandboxPath),
    responses(
        (status = 204, description = "The sandbox ended: its kernel and container are gone"),
        (status = 404, description = "No such sandbox (or another key's)", body = E2bErrorBody),
        (status = 503, description = "The sandbox is gone from the gateway, but removing its container failed", body = E2bErrorBody),
    ),
)]
pub async fn kill(
    State(state): State<AppState>,
    key: ApiKey,
    Path(SandboxPath { id }): Path<SandboxPath>,
) -> Result<StatusCode, E2bError> {
    owned(&state, &key, &id)?;
    state.e2b.remove(&id);
    if let Some(result) = state
        .kernels
        .delete(&id, Removal::AskedBy(key.0.name.clone()))
        .await
    {
        result?;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Moves an E2B sandbox's end to `timeout` seconds from now (E2B's `set_timeout`).
#[utoipa::path(
    post, path = "/sandboxes/{id}/timeout", tag = "e2b", operation_id = "e2b_set_timeout",
    security(("e2b_api_key" = [])),
    params(SandboxPath),
    request_body(content = SandboxTimeout, content_type = "application/json"),
    responses(
        (status = 204, description = "The sandbox now ends `timeout` seconds from now"),
        (status = 400, description = "The body is not JSON of this shape, or the timeout is out of range", body = E2bErrorBody),
        (status = 404, description = "No such sandbox (or another key's)", body = E2bErrorBody),
    ),
)]
pub async fn set_timeout(
    State(state): State<AppState>,
    key: ApiKey,
    Path(SandboxPath { id }): Path<SandboxPath>,
    body: Bytes,
) -> Result<StatusCode, E2bError> {
    let body: SandboxTimeout = json_body(&body, r#"{"timeout": 60}"#)?;
    let timeout = timeout_of(Some(body.timeout))?;
    owned(&state, &key, &id)?;
    state.e2b.set_end(&id, Utc::now() + timeout);
    Ok(StatusCode::NO_CONTENT)
}

/// Connects to an E2B sandbox, resuming a paused one (E2B's `Sandbox.connect`).
///
/// It answers as at its create; a timeout given moves its end later (never earlier). A
/// paused sandbox resumes with its state, or with `memory: false` (the SDK's
/// `on_resume="reboot"`) as a fresh kernel with its files.
#[utoipa::path(
    post, path = "/v2/sandboxes/{id}/connect", tag = "e2b", operation_id = "e2b_connect_sandbox",
    security(("e2b_api_key" = [])),
    params(SandboxPath),
    request_body(content = Option<SandboxConnect>, content_type = "application/json"),
    responses(
        (status = 200, description = "The running sandbox (resumed, if it was paused), answered as its create was; a `timeout` moved its end later (never earlier)", body = SandboxCreated),
        (status = 503, description = "A paused sandbox could not be started again, or its state did not load (the message says why); it stays paused with its state: connect again, or with `on_resume=\"reboot\"` for a fresh kernel with its files", body = E2bErrorBody),
        (status = 400, description = "The body is not JSON of this shape, or the timeout is out of range", body = E2bErrorBody),
        (status = 404, description = "No such sandbox (or another key's)", body = E2bErrorBody),
    ),
)]
pub async fn connect(
    State(state): State<AppState>,
    key: ApiKey,
    Path(SandboxPath { id }): Path<SandboxPath>,
    body: Bytes,
) -> Result<Response, E2bError> {
    let body: SandboxConnect = match body.as_ref() {
        [] => SandboxConnect::default(),
        bytes => json_body(bytes, r#"{"timeout": 300}"#)?,
    };
    let sandbox = owned(&state, &key, &id)?;
    let mut resumed = false;
    if let Some(live) = state.kernels.get(&id) {
        resumed = super::pause::resume(&state, &live, &key, body.memory != Some(false)).await?;
    }
    // A resumed sandbox runs for the timeout given, or the default, from now at least.
    let seconds = body.timeout.or(resumed.then_some(DEFAULT_TIMEOUT_SECS));
    if let Some(seconds) = seconds {
        let end = Utc::now() + timeout_of(Some(seconds))?;
        if end > sandbox.end_at {
            state.e2b.set_end(&id, end);
        }
    }
    let sandbox = owned(&state, &key, &id)?;
    Ok((StatusCode::OK, Json(created(&state, &id, &sandbox))).into_response())
}

/// An E2B sandbox's metrics: none are kept per sandbox (E2B's `get_metrics`).
///
/// The gateway's own metrics are at `/metrics`.
#[utoipa::path(
    get, path = "/sandboxes/{id}/metrics", tag = "e2b", operation_id = "e2b_sandbox_metrics",
    security(("e2b_api_key" = [])),
    params(SandboxPath),
    responses(
        (status = 200, description = "None are kept per sandbox: always `[]` (the gateway's own metrics are at `/metrics`)", body = [Object]),
        (status = 404, description = "No such sandbox (or another key's)", body = E2bErrorBody),
    ),
)]
pub async fn metrics(
    State(state): State<AppState>,
    key: ApiKey,
    Path(SandboxPath { id }): Path<SandboxPath>,
) -> Result<Json<Vec<Value>>, E2bError> {
    owned(&state, &key, &id)?;
    Ok(Json(Vec::new()))
}

/// Refuses E2B's `update_network`: sandboxes have no network.
#[utoipa::path(
    put, path = "/sandboxes/{id}/network", tag = "e2b", operation_id = "e2b_update_network",
    security(("e2b_api_key" = [])),
    params(SandboxPath),
    responses(
        (status = 400, description = "Refused: sandboxes have no network by design", body = E2bErrorBody),
        (status = 404, description = "No such sandbox (or another key's)", body = E2bErrorBody),
    ),
)]
pub async fn update_network(
    State(state): State<AppState>,
    key: ApiKey,
    Path(SandboxPath { id }): Path<SandboxPath>,
) -> Result<StatusCode, E2bError> {
    owned(&state, &key, &id)?;
    Err(ApiError::bad_request(format!("update_network is refused: {NO_NETWORK}")).into())
}

/// `k=v&k2=v2` into its pairs, `+` and `%XX` decoded.
fn form_pairs(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (form_decode(k), form_decode(v))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn metadata_filters_decode_as_the_sdk_encodes_them() {
        // The SDK quotes each key and value, then URL-encodes the pairs.
        assert_eq!(
            form_pairs("run%3Dabc%26who%3Da%2520b"),
            vec![("run=abc&who=a%20b".to_owned(), String::new())]
        );
        let inner = form_decode("run%3Dabc%26who%3Da%2520b");
        assert_eq!(
            form_pairs(&inner)
                .into_iter()
                .map(|(k, v)| (form_decode(&k), form_decode(&v)))
                .collect::<Vec<_>>(),
            vec![
                ("run".to_owned(), "abc".to_owned()),
                ("who".to_owned(), "a b".to_owned())
            ]
        );
    }

    #[test]
    fn options_without_a_network_are_refused_by_name() {
        let body = |v: Value| serde_json::from_value::<NewSandbox>(v).map(|b| refusal(&b));
        let ok = body(json!({"templateID": "base", "allow_internet_access": false,
                             "network": null, "envVars": {}, "metadata": {}}));
        assert!(matches!(ok, Ok(None)));
        let refused = body(json!({"templateID": "base", "allow_internet_access": true}));
        assert!(matches!(refused, Ok(Some(m)) if m.contains("allow_internet_access")));
        let refused = body(json!({"templateID": "base", "network": {"denyOut": ["0.0.0.0/0"]}}));
        assert!(matches!(refused, Ok(Some(m)) if m.contains("network rules")));
        let refused = body(json!({"templateID": "base", "envVars": {"A=B": "x"}}));
        assert!(matches!(refused, Ok(Some(m)) if m.contains("\"A=B\" is refused")));
        let refused = body(json!({"templateID": "base", "envVars": {"A": "x\0"}}));
        assert!(matches!(refused, Ok(Some(m)) if m.contains("value has no NUL")));
    }
}
