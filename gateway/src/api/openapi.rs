//! The OpenAPI 3.1 document of the HTTP API, served at `GET /api/openapi.json`.
//!
//! Nothing here is written by hand twice: each operation comes from its handler's
//! `#[utoipa::path]` and the types the handler reads and writes, and the router is built
//! from the same [`Routes`] (see `surface` in the parent module). A route goes in either as
//! an annotated operation or, when OpenAPI cannot describe it (a WebSocket), with a
//! paragraph for the document's description: there is no third way to add one. What the
//! layers around the handlers answer (token refused, too many failures, a foreign Origin,
//! an oversized body) is added here, to the operations those layers guard.

use super::error::ErrorBody;
use super::AppState;
use crate::cluster::route::Rule;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::MethodRouter;
use axum::Router;
use std::sync::LazyLock;
use utoipa::openapi::path::{Operation, PathItem, PathsMap};
use utoipa::openapi::security::{
    ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
};
use utoipa::openapi::tag::TagBuilder;
use utoipa::openapi::{
    ContentBuilder, HeaderBuilder, InfoBuilder, LicenseBuilder, OpenApi, OpenApiBuilder, Ref,
    RefOr, ResponseBuilder,
};
use utoipa::PartialSchema;
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouter};

/// The security schemes of the routes behind a token: any one of them will do.
pub const TOKEN_SCHEMES: [&str; 3] = ["token", "bearer", "token_query"];

/// A route the document describes in its prose only.
#[derive(Debug, Clone, Copy)]
pub struct Prose {
    pub path: &'static str,
    pub text: &'static str,
}

/// Routes of one access level, each an annotated operation or a route told in prose, each
/// with its rule in a cluster.
pub struct Routes {
    router: OpenApiRouter<AppState>,
    prose: Vec<Prose>,
    rules: Vec<(String, Rule)>,
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes")
            .field("prose", &self.prose)
            .finish()
    }
}

impl Default for Routes {
    fn default() -> Self {
        Routes {
            router: OpenApiRouter::new(),
            prose: Vec::new(),
            rules: Vec::new(),
        }
    }
}

impl Routes {
    /// The handlers of one path (`utoipa_axum::routes!`), described by their
    /// `#[utoipa::path]`, served in a cluster as `rule` says.
    pub fn operations(mut self, rule: Rule, handlers: UtoipaMethodRouter<AppState>) -> Self {
        self.rules
            .extend(handlers.1.paths.keys().map(|path| (path.clone(), rule)));
        self.router = self.router.routes(handlers);
        self
    }

    /// A route OpenAPI cannot describe, served in a cluster as `rule` says; `text` becomes
    /// a paragraph of the document's description.
    pub fn prose(
        mut self,
        rule: Rule,
        path: &'static str,
        handlers: MethodRouter<AppState>,
        text: &'static str,
    ) -> Self {
        self.router = self.router.route(path, handlers);
        self.prose.push(Prose { path, text });
        self.rules.push((path.to_owned(), rule));
        self
    }

    /// Each path's rule in a cluster.
    pub fn rules(&self) -> &[(String, Rule)] {
        &self.rules
    }

    pub fn split(self) -> (Router<AppState>, OpenApi, Vec<Prose>) {
        let (router, doc) = self.router.split_for_parts();
        (router, doc, self.prose)
    }
}

const DESCRIPTION: &str = "\
Kernelgate gives each client a long-lived IPython kernel in its own locked-down container, and \
speaks Jupyter Server's kernel REST API and WebSocket channels, plus an agent API that runs \
code in one call and a files API for the kernel's working directory.

**Authentication.** Every operation that lists a security requirement wants the gateway's \
token or a tenant's key, as `Authorization: token T`, `Authorization: Bearer T`, or the query \
parameter `?token=T` (compared in constant time). A missing or wrong token answers 403; past \
10 failures in a minute from one address, 429 with `Retry-After`. Another key's kernels do \
not exist for a key that is not an admin (404).

**Errors** are JSON `{\"reason\", \"message\"}` (`ErrorBody`): the HTTP reason phrase and a \
message that says what to do. So are the answers to an unknown path (404) and to a method a \
path does not take (405, with `Allow`). JSON bodies of this API's own operations (not Jupyter's) \
refuse fields they do not have (400, naming the field). A URL over 16 KiB answers 414, headers \
over 64 KiB together 431; a request the HTTP parser itself refuses (a URL over 64 KiB, more than \
100 headers) gets its bare status with no body.";

/// The document, built once.
static DOCUMENT: LazyLock<String> = LazyLock::new(|| {
    // Serializing the document's own types cannot fail; an empty object would show it did.
    serde_json::to_string(&document()).unwrap_or_else(|_| "{}".to_owned())
});

/// This document (OpenAPI 3.1).
///
/// Served without a token, like `GET /api`: it holds no secret, and clients read it before
/// they have one.
#[utoipa::path(
    get, path = "/api/openapi.json", tag = "meta", operation_id = "openapi",
    responses((status = 200, description = "The OpenAPI 3.1 document of this gateway",
               body = Object, content_type = "application/json")),
)]
pub async fn serve() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        DOCUMENT.as_str(),
    )
        .into_response()
}

/// The OpenAPI document of every route of [`super::router`].
pub fn document() -> OpenApi {
    let super::Surface { public, protected } = super::surface();
    let (_, mut doc, mut prose) = public.split();
    let (_, mut guarded, more) = protected.split();
    prose.extend(more);
    for (_, op) in paths_operations(&mut guarded) {
        op.security = Some(
            TOKEN_SCHEMES
                .iter()
                .map(|s| SecurityRequirement::new(*s, Vec::<String>::new()))
                .collect(),
        );
        refuse(op, "403", "Missing or wrong token");
        refuse(
            op,
            "429",
            "More than 10 failed authentications from this address in a minute; \
             `Retry-After` says when to try again",
        );
        if let Some(RefOr::T(r)) = op.responses.responses.get_mut("429") {
            r.headers.insert(
                "Retry-After".to_owned(),
                HeaderBuilder::new()
                    .schema(u64::schema())
                    .description(Some("Seconds"))
                    .build(),
            );
        }
    }
    doc.merge(guarded);
    for (method, op) in paths_operations(&mut doc) {
        // e2b::control::authenticate, in front of E2B's control plane.
        if op.tags.iter().flatten().any(|t| t == "e2b") {
            refuse_e2b(op, "401", "Missing or wrong `X-API-KEY`");
            refuse_e2b(
                op,
                "429",
                "More than 10 failed authentications from this address in a minute; \
                 `Retry-After` says when to try again",
            );
        }
        // origin::guard, around every route.
        if !matches!(method, "get" | "head" | "options") {
            refuse(
                op,
                "403",
                "A browser page of another origin sent it (`Origin` not the gateway's own \
                 nor listed in `--allow-origin`)",
            );
        }
        refuse(
            op,
            "403",
            "With `--no-auth`, the `Host` is not a loopback name (a guard against DNS rebinding)",
        );
        // extract::Path, for every path parameter.
        let path_parameters = op
            .parameters
            .iter()
            .flatten()
            .any(|p| matches!(p.parameter_in, utoipa::openapi::path::ParameterIn::Path));
        if path_parameters {
            refuse(
                op,
                "400",
                "A path parameter is not UTF-8 once percent-decoded",
            );
        }
        // DefaultBodyLimit, around every route.
        if op.request_body.is_some() {
            refuse(op, "413", "The body is larger than `--max-message-mb`");
        }
        // limits::guard, around every route.
        refuse(op, "414", "The URL is longer than 16 KiB");
        refuse(
            op,
            "431",
            "The request's headers are larger than 64 KiB together",
        );
    }
    // axum's catch-all `{*path}` is OpenAPI's `{path}` (its values may hold `/`).
    doc.paths.paths = std::mem::take(&mut doc.paths.paths)
        .into_iter()
        .map(|(path, item)| (path.replace("{*", "{"), item))
        .collect::<PathsMap<_, _>>();

    let mut description = DESCRIPTION.to_owned();
    for p in &prose {
        description.push_str(&format!(
            "\n\n**`{}`** (not an operation here). {}",
            p.path, p.text
        ));
    }
    let info = InfoBuilder::new()
        .title("Kernelgate")
        .version(env!("CARGO_PKG_VERSION"))
        .description(Some(description))
        .license(Some(
            LicenseBuilder::new()
                .name(env!("CARGO_PKG_LICENSE"))
                .identifier(Some(env!("CARGO_PKG_LICENSE")))
                .build(),
        ))
        .build();
    let components = doc.components.get_or_insert_with(Default::default);
    components
        .schemas
        .insert("ErrorBody".to_owned(), ErrorBody::schema());
    components.schemas.insert(
        "E2bErrorBody".to_owned(),
        kernelgate_protocol::e2b::E2bErrorBody::schema(),
    );
    let schemes = [
        (
            "token",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "Authorization",
                "`token T`: the gateway's token (`--token`) or a key of `--keys`",
            ))),
        ),
        (
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("`Bearer T`: the same token"))
                    .build(),
            ),
        ),
        (
            "e2b_api_key",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "X-API-KEY",
                "E2B's control plane (`/v2/sandboxes`, `/sandboxes/...`): a Kernelgate key, as E2B's SDKs send `E2B_API_KEY`",
            ))),
        ),
        (
            "token_query",
            SecurityScheme::ApiKey(ApiKey::Query(ApiKeyValue::with_description(
                "token",
                "`?token=T`: the same token, for clients that cannot set headers (a browser's WebSocket)",
            ))),
        ),
    ];
    for (name, scheme) in schemes {
        components.security_schemes.insert(name.to_owned(), scheme);
    }
    let tag = |name: &str, text: &str| TagBuilder::new().name(name).description(Some(text)).build();
    OpenApiBuilder::from(doc)
        .info(info)
        .tags(Some([
            tag("kernels", "Jupyter Server's kernel REST API (what JupyterLab's gateway client uses)"),
            tag("kernelspecs", "Jupyter Server's kernel spec API"),
            tag("agent", "Run code in one call, with everything it produced"),
            tag("files", "Files in a kernel's working directory, read and written inside its container"),
            tag("snapshots", "A kernel's state kept under an id and a name, new kernels started from it, forks (docs/snapshots.md)"),
            tag("approvals", "Executions an `ask` rule of the execution policy holds for an admin (admin keys only)"),
            tag("operations", "Probes and metrics for operators"),
            tag("e2b", "E2B's control plane, for E2B's unmodified SDKs (docs/e2b.md): create, list, inspect, end and extend sandboxes. The sandbox plane (files, code, contexts) is addressed by headers or host, not by path: see the create's answer"),
            tag("console", "The web console (public: the page holds no secret)"),
            tag("meta", "What this gateway is and speaks"),
        ]))
        .build()
}

/// Adds an error answer in E2B's shape (`E2bErrorBody`) to an operation of E2B's control
/// plane.
fn refuse_e2b(op: &mut Operation, status: &str, reason: &str) {
    let body = ContentBuilder::new()
        .schema(Some(Ref::from_schema_name("E2bErrorBody")))
        .build();
    op.responses.responses.insert(
        status.to_owned(),
        RefOr::T(
            ResponseBuilder::new()
                .description(reason)
                .content("application/json", body)
                .build(),
        ),
    );
}

/// Adds an error answer to an operation, or the reason to the one it has.
fn refuse(op: &mut Operation, status: &str, reason: &str) {
    match op.responses.responses.get_mut(status) {
        Some(RefOr::T(response)) => {
            response.description = format!("{}. Or: {reason}", response.description);
        }
        Some(RefOr::Ref(_)) => {}
        None => {
            let body = ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ErrorBody")))
                .build();
            op.responses.responses.insert(
                status.to_owned(),
                RefOr::T(
                    ResponseBuilder::new()
                        .description(reason)
                        .content("application/json", body)
                        .build(),
                ),
            );
        }
    }
}

/// Every operation of a document, with its method in lower case.
fn paths_operations(doc: &mut OpenApi) -> impl Iterator<Item = (&'static str, &mut Operation)> {
    doc.paths.paths.values_mut().flat_map(item_operations)
}

fn item_operations(item: &mut PathItem) -> impl Iterator<Item = (&'static str, &mut Operation)> {
    [
        ("get", &mut item.get),
        ("put", &mut item.put),
        ("post", &mut item.post),
        ("delete", &mut item.delete),
        ("options", &mut item.options),
        ("head", &mut item.head),
        ("patch", &mut item.patch),
        ("trace", &mut item.trace),
    ]
    .into_iter()
    .filter_map(|(method, op)| op.as_mut().map(|op| (method, op)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ops::{MetricsAccess, Readiness};
    use crate::api::origin::OriginPolicy;
    use crate::kernels::fake::FakeBackend;
    use crate::kernels::{HeartbeatCheck, Kernels, Settings};
    use crate::kernelspecs::KernelSpecs;
    use crate::relay::clients::ClientLimits;
    use crate::tenants::Keys;
    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode};
    use std::sync::Arc;
    use std::time::Duration;
    use tokio_util::sync::CancellationToken;
    use tokio_util::task::TaskTracker;
    use tower::ServiceExt;

    const TOKEN: &str = "s3cret";

    /// Every operation as `METHOD path`, in the document's order.
    fn operations(doc: &mut OpenApi) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for (path, item) in doc.paths.paths.iter_mut() {
            for (method, _) in item_operations(item) {
                out.push((method.to_uppercase(), path.clone()));
            }
        }
        out
    }

    fn state() -> AppState {
        let specs = KernelSpecs::parse("kernel:1", &[], &["0".to_owned()]).expect("specs");
        let settings = Settings {
            max_kernels: 2,
            startup_timeout: Duration::from_secs(10),
            autorestart: true,
            cull_idle_timeout: None,
            hibernate: Default::default(),
            heartbeat: HeartbeatCheck::default(),
            specs: Arc::new(specs),
            audit: crate::audit::Audit::disabled(),
            guard: None,
            ledger: None,
            limits: ClientLimits {
                kernel_message_bytes: 1 << 20,
                buffer_bytes: 1 << 20,
                output_bytes: 1 << 20,
                replay_for: Duration::from_secs(60),
            },
            packages: None,
            templates: false,
            snapshots: Default::default(),
        };
        let (tracker, cancel) = (TaskTracker::new(), CancellationToken::new());
        let kernels = Kernels::new(
            FakeBackend::new(),
            settings,
            tracker.clone(),
            cancel.clone(),
        );
        let mcp = crate::mcp::Mcp::new(
            kernels.clone(),
            tracker.clone(),
            cancel.clone(),
            Duration::from_secs(60),
            crate::mcp::budget::Budget::from_kib(256),
        );
        AppState {
            kernels,
            mcp: Arc::new(crate::api::mcp::Endpoint::new(mcp, 1 << 20)),
            keys: Arc::new(Keys::new(Some(TOKEN), None).expect("keys")),
            failures: Arc::default(),
            max_message_bytes: 1 << 20,
            cancel,
            tracker,
            metrics_access: MetricsAccess::Tokens { scrape: None },
            readiness: Arc::new(Readiness::default()),
            origins: Arc::new(OriginPolicy::default()),
            runtime: "runc",
            guard: None,
            cluster: None,
            e2b: Arc::default(),
        }
    }

    /// The operations table of docs/http-api.md: every operation of the document, with its
    /// summary, in the document's order.
    fn operations_table() -> String {
        let mut doc = document();
        let mut table = String::from("| operation | what it does | token |\n|---|---|---|\n");
        for (path, item) in doc.paths.paths.iter_mut() {
            for (method, op) in item_operations(item) {
                let summary = op
                    .summary
                    .clone()
                    .or_else(|| op.description.clone())
                    .unwrap_or_default();
                let summary = summary.lines().next().unwrap_or_default().trim().to_owned();
                let requirements = op.security.clone().unwrap_or_default();
                let e2b = SecurityRequirement::new("e2b_api_key", Vec::<String>::new());
                let token = if requirements.contains(&e2b) {
                    "`X-API-KEY`"
                } else if requirements.contains(&SecurityRequirement::default()) {
                    "as configured"
                } else if requirements.is_empty() {
                    "no"
                } else {
                    "yes"
                };
                table.push_str(&format!(
                    "| `{} {path}` | {summary} | {token} |\n",
                    method.to_uppercase()
                ));
            }
        }
        table
    }

    /// docs/http-api.md lists exactly the document's operations (generated from it, so it
    /// cannot drift).
    #[test]
    fn the_documented_operations_are_the_documents() {
        crate::generated_docs::check(
            "http-api.md",
            "operations",
            &operations_table(),
            "the_documented_operations",
        );
    }

    /// The serve loop `kernelgate serve` runs, in-process: it answers on its listener until
    /// its shutdown future completes, then cancels the state's token (open WebSockets and
    /// runs end) and returns.
    #[tokio::test]
    async fn the_serve_loop_answers_until_shutdown_then_returns() {
        let state = state();
        let cancel = state.cancel.clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(super::super::serve(listener, state, async {
            let _ = stopped.await;
        }));
        let http = reqwest::Client::new();
        let kernels = http
            .get(format!("{base}/api/kernels"))
            .header("authorization", format!("token {TOKEN}"))
            .send()
            .await
            .expect("an answer");
        assert_eq!(kernels.status(), 200);
        assert_eq!(kernels.text().await.expect("body"), "[]");
        assert!(!cancel.is_cancelled());
        stop.send(()).expect("the loop listens for shutdown");
        tokio::time::timeout(Duration::from_secs(10), serving)
            .await
            .expect("serve returns after shutdown")
            .expect("task")
            .expect("no I/O error");
        assert!(cancel.is_cancelled(), "open connections are told to end");
    }

    /// Sends `METHOD path` (path parameters filled with `x`) to the real router; the
    /// status, and the message of an error.
    async fn answer(
        state: &AppState,
        method: &str,
        path: &str,
        token: bool,
    ) -> (StatusCode, String) {
        let uri = path
            .split('/')
            .map(|part| if part.starts_with('{') { "x" } else { part })
            .collect::<Vec<_>>()
            .join("/");
        let mut request = Request::builder()
            .method(Method::from_bytes(method.as_bytes()).expect("method"))
            .uri(uri);
        if token {
            // E2B's control plane takes the key in its own header; the others ignore it.
            request = request
                .header("authorization", format!("token {TOKEN}"))
                .header("x-api-key", TOKEN);
        }
        let response = super::super::router(state.clone())
            .oneshot(request.body(Body::from("not json")).expect("request"))
            .await
            .expect("infallible");
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .expect("body");
        let message = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_owned))
            .unwrap_or_default();
        (status, message)
    }

    #[test]
    fn the_document_lists_every_operation_of_the_api() {
        let mut doc = document();
        let listed: Vec<String> = operations(&mut doc)
            .into_iter()
            .map(|(m, p)| format!("{m} {p}"))
            .collect();
        let expected = [
            "GET /",
            "GET /ui/{file}",
            "GET /api",
            "GET /api/openapi.json",
            "GET /healthz",
            "GET /readyz",
            "GET /metrics",
            "GET /v2/sandboxes",
            "POST /v2/sandboxes",
            "GET /sandboxes/{id}",
            "DELETE /sandboxes/{id}",
            "POST /sandboxes/{id}/timeout",
            "POST /v2/sandboxes/{id}/connect",
            "GET /sandboxes/{id}/metrics",
            "PUT /sandboxes/{id}/network",
            "POST /sandboxes/{id}/snapshots",
            "GET /snapshots",
            "DELETE /templates/{id}",
            "POST /sandboxes/{id}/fork",
            "POST /sandboxes/{id}/pause",
            "GET /api/kernelspecs",
            "GET /api/kernelspecs/{name}",
            "GET /kernelspecs/{name}/{file}",
            "GET /api/kernels",
            "POST /api/kernels",
            "GET /api/kernels/{id}",
            "DELETE /api/kernels/{id}",
            "POST /api/kernels/{id}/interrupt",
            "POST /api/kernels/{id}/restart",
            "POST /api/kernels/{id}/hibernate",
            "POST /api/kernels/{id}/discard-state",
            "POST /api/kernels/{id}/snapshots",
            "POST /api/kernels/{id}/fork",
            "GET /api/kernelgate/snapshots",
            "GET /api/kernelgate/snapshots/{id}",
            "DELETE /api/kernelgate/snapshots/{id}",
            "POST /api/kernels/{id}/execute",
            "POST /api/kernels/{id}/packages",
            "GET /api/kernels/{id}/files",
            "GET /api/kernels/{id}/files/{path}",
            "PUT /api/kernels/{id}/files/{path}",
            "DELETE /api/kernels/{id}/files/{path}",
            "GET /api/kernelgate/approvals",
            "POST /api/kernelgate/approvals/{id}",
            "GET /api/kernelgate/packages",
        ];
        assert_eq!(listed, expected);
        let description = doc.info.description.unwrap_or_default();
        assert!(
            description.contains("**`/api/kernels/{id}/channels`** (not an operation here)"),
            "the channels WebSocket is told in prose: {description}"
        );
        assert_eq!(
            serde_json::to_value(document()).expect("json")["openapi"],
            "3.1.0"
        );
    }

    #[test]
    fn every_operation_has_an_id_and_its_error_bodies() {
        let mut doc = document();
        let mut ids = std::collections::HashSet::new();
        for (method, op) in paths_operations(&mut doc) {
            let id = op.operation_id.clone().expect("operation id");
            assert!(ids.insert(id.clone()), "operation id {id} twice");
            assert!(
                op.description.is_some() || op.summary.is_some(),
                "{id}: no description"
            );
            for (status, response) in &op.responses.responses {
                let RefOr::T(response) = response else {
                    panic!("{id} {status}: a reference")
                };
                if status.starts_with(['4', '5']) && id != "readyz" {
                    let json = response.content.get("application/json");
                    let schema = json.and_then(|c| c.schema.as_ref());
                    assert!(
                        // A refused install also says what was refused: an ErrorBody and more.
                        // E2B's control plane answers in E2B's shape, which an ErrorBody fits.
                        matches!(schema, Some(RefOr::Ref(r)) if r.ref_location.ends_with("/ErrorBody")
                            || (id.starts_with("e2b_") && r.ref_location.ends_with("/E2bErrorBody"))
                            || (id == "install_packages" && status == "422" && r.ref_location.ends_with("/RefusedBody"))),
                        "{method} {id} {status}: not an ErrorBody"
                    );
                }
            }
        }
    }

    /// The document's paths reach their handlers, never the fallback, and the security it
    /// lists is the one the router applies.
    #[tokio::test]
    async fn every_operation_is_served_as_documented() {
        let state = state();
        let mut doc = document();
        let mut secured = Vec::new();
        for (method, op) in paths_operations(&mut doc) {
            let requirements = op.security.clone().unwrap_or_default();
            // An empty alternative (`/metrics`): public or not by configuration.
            let needs_token = match requirements.contains(&SecurityRequirement::default()) {
                true => None,
                false => Some(!requirements.is_empty()),
            };
            secured.push((method, op.operation_id.clone(), needs_token));
        }
        let ops = operations(&mut doc);
        assert_eq!(ops.len(), secured.len());
        for ((method, path), (_, id, needs_token)) in ops.iter().zip(secured) {
            let (status, message) = answer(&state, method, path, true).await;
            assert_ne!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
            assert!(
                !message.starts_with("No such endpoint")
                    && !message.starts_with("Missing or wrong token")
                    && !message.starts_with("Missing or wrong X-API-KEY"),
                "{method} {path} ({id:?}) with a token: {status} {message}"
            );
            let Some(needs_token) = needs_token else {
                continue;
            };
            let (status, message) = answer(&state, method, path, false).await;
            let refused = status == StatusCode::FORBIDDEN
                && (message.starts_with("Missing or wrong token")
                    || message.starts_with("/metrics needs"))
                || status == StatusCode::UNAUTHORIZED
                    && message.starts_with("Missing or wrong X-API-KEY");
            assert_eq!(
                refused, needs_token,
                "{method} {path} without a token: {status} {message}"
            );
        }
        state.cancel.cancel();
    }
}
