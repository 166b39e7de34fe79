//! HTTP and WebSockets: Jupyter Server's kernel REST API, the channels WebSocket, and
//! token authentication, all described by the OpenAPI document of [`openapi`]. Handlers
//! stay thin; the work is in [`crate::kernels`].

pub mod approvals;
pub mod auth;
pub mod channels;
pub mod cluster;
pub mod e2b;
pub mod error;
pub mod execute;
pub mod extract;
pub mod files;
pub mod kernels;
pub mod kernelspecs;
pub mod limits;
pub mod mcp;
pub mod openapi;
pub mod ops;
pub mod origin;
pub mod packages;
pub mod peers;
pub mod snapshots;
pub mod ui;

use crate::cluster::route::Rule;
use crate::kernels::Kernels;
use crate::tenants::Keys;
use axum::extract::DefaultBodyLimit;
use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{any, get, post};
use axum::{middleware, Json, Router};
use openapi::Routes;
use serde::Serialize;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;
use utoipa::ToSchema;
use utoipa_axum::routes;

/// What every handler can reach.
#[derive(Debug, Clone)]
pub struct AppState {
    pub kernels: Arc<Kernels>,
    pub keys: Arc<Keys>,
    /// Failed authentications by client address.
    pub failures: Arc<auth::Failures>,
    pub max_message_bytes: usize,
    /// Cancelled at shutdown: open WebSockets close.
    pub cancel: CancellationToken,
    /// Owns the tasks handlers start (agent API runs).
    pub tracker: TaskTracker,
    pub metrics_access: ops::MetricsAccess,
    pub readiness: Arc<ops::Readiness>,
    pub origins: Arc<origin::OriginPolicy>,
    /// The OCI runtime kernels run under (`runc` or `runsc`), for `GET /api`.
    pub runtime: &'static str,
    /// The execution policy, when `--policy` set one.
    pub guard: Option<Arc<crate::policy::Guard>>,
    /// The MCP server at `/mcp`.
    pub mcp: Arc<crate::api::mcp::Endpoint>,
    /// This gateway as a node of a cluster (`--etcd`); none for a single gateway.
    pub cluster: Option<Arc<crate::cluster::node::ClusterNode>>,
    /// The E2B-compatible surface's sandboxes and token secret.
    pub e2b: Arc<e2b::Sandboxes>,
}

/// Every route, public or behind a token. The router and the OpenAPI document
/// ([`openapi::document`]) are both made from this.
#[derive(Debug)]
pub struct Surface {
    pub public: Routes,
    pub protected: Routes,
}

const CHANNELS: &str = "The WebSocket of Jupyter Server's kernel API (`GET` with \
`Upgrade: websocket`, optional `?session_id=S`; token as for the other kernel routes, \
`?token=T` from browsers): all five channels of the kernel. Without a subprotocol, one JSON \
text frame per message (`header`, `parent_header`, `metadata`, `content`, `buffers`, \
`channel`, `msg_id`, `msg_type`); with `v1.kernel.websocket.jupyter.org` offered, its binary \
frames. Clients send unsigned messages: the gateway signs them and fills missing header \
fields. A new socket with the same `session_id` takes over and first receives what was \
produced while none was connected. 404 for an unknown kernel.";

const MCP: &str = "The Model Context Protocol server (Streamable HTTP transport: `POST` \
JSON-RPC, `GET` for the server's stream, `DELETE` to end a session; token as for the other \
routes). Tools: `run_python`, `list_files`, `read_file`, `write_file`, `install_packages`, \
`restart_kernel`, `start_kernel`, `snapshot_kernel`, `fork_kernel`. With the classic `initialize` handshake (protocol 2025-11-25 and earlier) \
each `Mcp-Session-Id` gets its own kernel, deleted with the session; with 2026-07-28 (no \
sessions) `start_kernel` returns a `kernel_id` handle that the other tools take. Sessions and \
handles belong to the key that made them: 404 for any other key.";

/// Every route of the gateway. A new one goes here: as an operation (`routes!` of handlers
/// annotated with `#[utoipa::path]`), or as prose when OpenAPI cannot describe it.
pub fn surface() -> Surface {
    let public = Routes::default()
        .operations(Rule::Local, routes!(ui::index))
        .operations(Rule::Local, routes!(ui::file))
        .operations(Rule::Local, routes!(version))
        .operations(Rule::Local, routes!(openapi::serve))
        .operations(Rule::Local, routes!(ops::healthz))
        .operations(Rule::Local, routes!(ops::readyz))
        // Its own rules: an admin key or the metrics token, or nothing with --metrics-public.
        .operations(Rule::Local, routes!(ops::metrics))
        // E2B's control plane (docs/e2b.md): its own key header, X-API-KEY, checked by
        // e2b::control::authenticate in front of the router.
        .operations(
            Rule::Sandboxes,
            routes!(e2b::control::create, e2b::control::list),
        )
        .operations(
            Rule::Sandbox,
            routes!(e2b::control::get, e2b::control::kill),
        )
        .operations(Rule::Sandbox, routes!(e2b::control::set_timeout))
        .operations(Rule::Sandbox, routes!(e2b::control::connect))
        .operations(Rule::Sandbox, routes!(e2b::control::metrics))
        .operations(Rule::Sandbox, routes!(e2b::control::update_network))
        .operations(Rule::Sandbox, routes!(e2b::snapshots::take))
        .operations(Rule::Local, routes!(e2b::snapshots::list))
        .operations(Rule::Local, routes!(e2b::snapshots::delete))
        .operations(Rule::Sandbox, routes!(e2b::snapshots::fork))
        .operations(Rule::Sandbox, routes!(e2b::pause::pause));
    let protected = Routes::default()
        .operations(Rule::Local, routes!(kernelspecs::list))
        .operations(Rule::Local, routes!(kernelspecs::get))
        .operations(Rule::Local, routes!(kernelspecs::resource))
        .operations(Rule::Kernels, routes!(kernels::list, kernels::create))
        .operations(Rule::Kernel, routes!(kernels::get, kernels::delete))
        .operations(Rule::Kernel, routes!(kernels::interrupt))
        .operations(Rule::Kernel, routes!(kernels::restart))
        .operations(Rule::Kernel, routes!(kernels::hibernate))
        .operations(Rule::Kernel, routes!(kernels::discard_state))
        .operations(Rule::Kernel, routes!(snapshots::take))
        .operations(Rule::Kernel, routes!(snapshots::fork))
        .operations(Rule::Local, routes!(snapshots::list))
        .operations(Rule::Snapshot, routes!(snapshots::get, snapshots::delete))
        .prose(
            Rule::Kernel,
            "/api/kernels/{id}/channels",
            get(channels::connect),
            CHANNELS,
        )
        .operations(Rule::Kernel, routes!(execute::execute))
        .operations(Rule::Kernel, routes!(packages::install))
        .operations(Rule::Kernel, routes!(files::list_root))
        .operations(Rule::Kernel, routes!(files::get, files::put, files::delete))
        .operations(Rule::Approvals, routes!(approvals::list))
        .operations(Rule::Approval, routes!(approvals::answer))
        .operations(Rule::Local, routes!(packages::list))
        .prose(Rule::Mcp, "/mcp", any(mcp::serve), MCP);
    Surface { public, protected }
}

/// The whole HTTP surface.
pub fn router(state: AppState) -> Router {
    let Surface { public, protected } = surface();
    let (public, _, _) = public.split();
    let (protected, _, _) = protected.split();
    // Authentication first, then (in cluster mode) the node that serves it.
    let protected = protected
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            cluster::route,
        ))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ));
    // E2B's control plane authenticates in front of the router; the sandbox plane checks
    // each sandbox's token in its handlers: in cluster mode both go to the sandbox's node.
    let public = public.route_layer(middleware::from_fn_with_state(
        state.clone(),
        cluster::route,
    ));
    let sandbox_plane = e2b_routes().route_layer(middleware::from_fn_with_state(
        state.clone(),
        cluster::route,
    ));
    let api = public
        .merge(protected)
        .merge(sandbox_plane)
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            e2b::control::authenticate,
        ))
        .layer(DefaultBodyLimit::max(state.max_message_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), origin::guard))
        .with_state(state);
    // axum adds `Allow` to a 405 on the way out of the router that routed it: the JSON
    // net sees it from outside only.
    Router::new()
        .fallback_service(api)
        .layer(middleware::from_fn(e2b::plane::address))
        .layer(middleware::from_fn(limits::guard))
        .layer(middleware::from_fn(error::json_errors))
        .layer(middleware::from_fn(request_span))
}

/// The E2B-compatible surface's sandbox plane (docs/e2b.md): the internal paths
/// [`e2b::plane::address`] rewrites sandbox requests to, each checking the sandbox's access
/// token. Its control plane is in [`surface`].
fn e2b_routes() -> Router<AppState> {
    use axum::routing::delete;
    use e2b::{envd, interpreter};
    Router::new()
        .route("/.e2b/49999/{sandbox}/execute", post(interpreter::execute))
        .route(
            "/.e2b/49999/{sandbox}/contexts",
            post(interpreter::create_context).get(interpreter::list_contexts),
        )
        .route(
            "/.e2b/49999/{sandbox}/contexts/{context}",
            delete(interpreter::delete_context),
        )
        .route(
            "/.e2b/49999/{sandbox}/contexts/{context}/restart",
            post(interpreter::restart_context),
        )
        .route("/.e2b/49999/{sandbox}/health", get(envd::health))
        .route("/.e2b/49983/{sandbox}/health", get(envd::health))
        .route(
            "/.e2b/49983/{sandbox}/files",
            get(envd::download).post(envd::upload),
        )
        .route(
            "/.e2b/49983/{sandbox}/filesystem.Filesystem/{method}",
            post(envd::filesystem),
        )
        .route(
            "/.e2b/49983/{sandbox}/filesystem.Filesystem/WatchDir",
            post(e2b::watch::watch_dir),
        )
        .route(
            "/.e2b/49983/{sandbox}/process.Process/{method}",
            post(e2b::process::rpc),
        )
}

/// Serves the API on `listener` until `shutdown` completes, then lets open requests finish;
/// `state.cancel` is cancelled when shutdown begins, so WebSockets and runs in flight end.
/// The gateway's serve loop, for `kernelgate serve` and for tests.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    let cancel = state.cancel.clone();
    let cluster_listener = state.cluster.as_ref().is_some_and(|c| c.tls.is_some());
    let mut app = router(state.clone());
    if cluster_listener {
        app = app.layer(middleware::from_fn_with_state(
            state,
            peers::no_forwarded_calls,
        ));
    }
    let app = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            cancel.cancel();
        })
        .await
}

/// Every request runs in a span with its id, so each log line about it carries the id;
/// the id is sent back as `X-Request-Id` (a client's own, when it sent a sane one).
async fn request_span(req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= 64
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
        .map(str::to_owned)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    let span = tracing::info_span!(
        "request",
        request_id = %id,
        method = %req.method(),
        path = %req.uri().path(),
        kernel = tracing::field::Empty,
    );
    // Requests about one kernel name it as a field of their own.
    if let Some(kernel) = req
        .uri()
        .path()
        .strip_prefix("/api/kernels/")
        .and_then(|rest| rest.split('/').next())
        .filter(|k| !k.is_empty())
    {
        span.record("kernel", kernel);
    }
    let mut response = next.run(req).instrument(span.clone()).await;
    span.in_scope(|| tracing::debug!(status = response.status().as_u16(), "answered"));
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

/// What `GET /api` answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct Version {
    /// The version Jupyter clients check.
    #[schema(example = "0.1.0")]
    version: &'static str,
    /// This gateway's set-up: only for a request with a valid key.
    #[serde(skip_serializing_if = "Option::is_none")]
    kernelgate: Option<GatewayInfo>,
}

/// This gateway.
#[derive(Debug, Serialize, ToSchema)]
pub struct GatewayInfo {
    #[schema(example = "0.1.0")]
    version: &'static str,
    /// The OCI runtime kernels run under: `runsc` (gVisor), `runsc-ptrace` (gVisor on
    /// Debian's runsc and the ptrace platform) or `runc`.
    #[schema(example = "runsc")]
    runtime: &'static str,
    /// An execution policy (`--policy`) is in force.
    policy: bool,
    /// In cluster mode: this node and the nodes it sees.
    #[serde(skip_serializing_if = "Option::is_none")]
    cluster: Option<ClusterInfo>,
}

/// A node of a cluster, as it sees the cluster.
#[derive(Debug, Serialize, ToSchema)]
pub struct ClusterInfo {
    /// This node's id (`--node-id`).
    #[schema(example = "node-1")]
    node: String,
    /// The nodes registered now, this one included, by id.
    nodes: Vec<String>,
    /// Whether this node holds its lease (false: cut off from the registry).
    registered: bool,
}

/// Jupyter Server's version, public as there; with a valid key also the runtime and policy.
///
/// What kernels run under and whether a policy is in force are no business of strangers.
#[utoipa::path(
    get, path = "/api", tag = "meta", operation_id = "version",
    responses((status = 200, description = "The version; with a valid token also what kernels run under", body = Version)),
)]
async fn version(State(state): State<AppState>, req: Request) -> Json<Version> {
    let kernelgate = auth::carries_valid_key(&state, &req).then(|| GatewayInfo {
        version: env!("CARGO_PKG_VERSION"),
        runtime: state.runtime,
        policy: state.guard.is_some(),
        cluster: state.cluster.as_ref().map(|c| ClusterInfo {
            node: c.node_id.clone(),
            nodes: {
                let mut nodes: Vec<String> =
                    c.membership.view_for(None).nodes.into_keys().collect();
                nodes.sort();
                nodes
            },
            registered: c.membership.registered(),
        }),
    });
    Json(Version {
        version: env!("CARGO_PKG_VERSION"),
        kernelgate,
    })
}

async fn not_found(uri: axum::http::Uri) -> error::ApiError {
    error::ApiError::new(
        axum::http::StatusCode::NOT_FOUND,
        format!(
            "No such endpoint: {}; the routes are listed in GET /api/openapi.json",
            uri.path()
        ),
    )
}
