//! Cluster mode in front of the handlers: the I/O of the decisions `cluster::route` makes
//! from each route's declared rule. A request about a kernel another node owns is
//! forwarded to it; a create goes to the node with the most free room; the kernel list and
//! the approvals are the cluster's, and an approval is answered by the node that holds it.
//! A call another node forwarded here is served here, as sent, unless this node has lost
//! its lease while the entry node holds its own (503 until it is registered again).
//! Single-node mode (no `--etcd`) passes every request straight through.

use super::auth::{is_forwarded, Caller};
use super::e2b;
use super::error::ApiError;
use super::AppState;
use crate::cluster::forward::{never_left, Destination, ForwardError, Left};
use crate::cluster::membership::View;
use crate::cluster::node::ClusterNode;
use crate::cluster::placement;
use crate::cluster::route::{self, Ask, Decision, Fan, Owner, Rule, Unavailable};
use crate::cluster::signing::Forwarded;
use crate::cluster::NodeRecord;
use axum::body::{to_bytes, Body};
use axum::extract::{MatchedPath, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::FutureExt;
use kernelgate_protocol::rest::{Forks, SnapshotModel};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

mod e2b_sandbox;
mod fan;
mod forwarded;
mod place;
#[cfg(test)]
mod tests;

pub(super) use forwarded::forwarded_call;
use std::time::Duration;

/// Seconds a client is told to wait when a node is not there now.
const RETRY_AFTER: u32 = 3;
/// The largest create body (or approval answer) kept to send again to the next node.
const MAX_CREATE_BODY: usize = 1 << 20;
/// How long an answer waits for what it made on another node to reach this node's view.
const SEEN_TIMEOUT: Duration = Duration::from_secs(1);

/// Each protected path's rule, as `surface` declares it.
static RULES: LazyLock<HashMap<String, Rule>> = LazyLock::new(|| {
    let surface = super::surface();
    let public = surface.public.rules().iter();
    public.chain(surface.protected.rules()).cloned().collect()
});

/// Middleware behind authentication: the route's rule and the registry decide
/// ([`route::decide`]); this carries the decision out.
pub async fn route(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(cluster) = state.cluster.clone() else {
        return next.run(req).await;
    };
    if let Some(who) = req.extensions().get::<Forwarded>() {
        if !route::serves_forwarded(who.entry_registered, cluster.membership.registered()) {
            return unavailable(
                "this node is cut off from the cluster registry and takes no forwarded work now; try again shortly"
                    .into(),
            );
        }
        return next.run(req).await;
    }
    let rule = match req.extensions().get::<MatchedPath>() {
        Some(p) if p.as_str().starts_with(e2b::plane::PREFIX) => Rule::Sandbox,
        Some(p) => RULES.get(p.as_str()).copied().unwrap_or(Rule::Local),
        None => Rule::Local,
    };
    if rule == Rule::Sandbox && is_forwarded(&req) {
        // A sandbox-plane call another node forwarded: nothing in front of the router
        // checked it (the sandbox's token is checked by its handler, here).
        return e2b_sandbox::forwarded(&state, &cluster, req, next).await;
    }
    let caller = match req.extensions().get::<Caller>().cloned() {
        Some(caller) => caller,
        None if rule == Rule::Sandbox => {
            return e2b_sandbox::route(&state, &cluster, req, next).await
        }
        None => return next.run(req).await,
    };
    let method = req.method().clone();
    let mut req = req;
    let mut kernel = None;
    let mut session = None;
    match rule {
        Rule::Kernel => kernel = kernel_of(req.uri().path()).map(str::to_owned),
        Rule::Snapshot => kernel = snapshot_of(req.uri().path()).map(str::to_owned),
        Rule::Sandbox => kernel = e2b_sandbox::sandbox_of(req.uri().path()).map(str::to_owned),
        Rule::Mcp => {
            session = req
                .headers()
                .get(crate::mcp::SESSION_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            if session.is_none() && method == Method::POST {
                let (parts, bytes) = match buffered(req, state.max_message_bytes).await {
                    Ok(read) => read,
                    Err(refused) => return refused,
                };
                kernel = mcp_kernel(&bytes);
                req = Request::from_parts(parts, Body::from(bytes));
            }
        }
        _ => {}
    }
    // The registry's view is copied only for a request that names a kernel, with that
    // kernel's record alone.
    let view = match kernel.as_deref() {
        Some(id) if rule != Rule::Snapshot && state.kernels.get(id).is_none() => {
            Some(cluster.membership.view_finding(id).await)
        }
        Some(id) => Some(cluster.membership.view_for(Some(id))),
        None => None,
    };
    let owner = match rule {
        Rule::Snapshot => keeper_of(&state, &cluster, &caller, view.as_ref(), kernel.as_deref()),
        _ => owner_of(&state, &cluster, view.as_ref(), kernel.as_deref()),
    };
    // What the node that serves it does, for the messages.
    let role = match rule {
        Rule::Snapshot => "keeps snapshot",
        Rule::Sandbox => "runs sandbox",
        _ => "runs kernel",
    };
    let ask = Ask {
        method,
        kernel: owner,
        mcp_session: session.as_deref().map(|id| state.mcp.holds(id)),
        registered: cluster.membership.registered(),
    };
    let id = kernel.as_deref().unwrap_or_default();
    if view.as_ref().is_some_and(|v| v.unreadable) {
        return unavailable(unreadable(role, id));
    }
    match route::decide(rule, &ask) {
        Decision::Serve => next.run(req).await,
        Decision::Forward(node) => match view.as_ref().and_then(|v| v.nodes.get(&node)) {
            Some(record) => {
                let made = made_by(req.method(), req.uri().path());
                let deleting = req.method() == Method::DELETE;
                let response = to_owner(&cluster, &caller, &node, record, req).await;
                // The cached owner is read again next time when it may be wrong now.
                let status = response.status();
                if rule != Rule::Snapshot
                    && (deleting || status == StatusCode::NOT_FOUND || status.is_server_error())
                {
                    cluster.membership.forget_owner(id);
                }
                match made {
                    Some(made) => settle(&cluster, made, response).await,
                    None => response,
                }
            }
            None => unavailable(not_in_cluster(role, id, &node)),
        },
        Decision::Unavailable(Unavailable::OwnerAway(node)) => unavailable(format!(
            "the node that {role} {id} ({node}) is restarting; try again shortly"
        )),
        Decision::Unavailable(Unavailable::OwnerGone(node)) => {
            unavailable(not_in_cluster(role, id, &node))
        }
        Decision::Unavailable(Unavailable::CutOff) => unavailable(
            "this node is cut off from the cluster registry and cannot place kernels now; try again shortly".into(),
        ),
        Decision::Place if rule == Rule::Sandboxes => {
            place::place_sandbox(&cluster, &caller, req, next).await
        }
        Decision::Place => place::place(&cluster, &caller, req, next).await,
        Decision::FanOut(Fan::Kernels) => fan::list(&cluster, &caller, req, next).await,
        Decision::FanOut(Fan::Approvals) => fan::approvals(&cluster, &caller, req, next).await,
        Decision::HereThenOthers => fan::answer(&cluster, &caller, req, next).await,
        Decision::OthersThenHere => {
            let session = session.unwrap_or_default();
            fan::mcp_elsewhere(&cluster, &caller, &session, state.max_message_bytes, req, next).await
        }
    }
}

/// Why a request for a kernel no cached owner names waits: the registry that says where it
/// runs cannot be read (not that it runs nowhere).
fn unreadable(role: &str, id: &str) -> String {
    format!(
        "cannot reach the cluster registry to find the node that {role} {id}; try again shortly"
    )
}

fn not_in_cluster(role: &str, id: &str, node: &str) -> String {
    format!("the node that {role} {id} ({node}) is not in the cluster now; try again shortly")
}

/// What `view` says of the node that keeps snapshot `id` (an id, or a name among the
/// caller's snapshots), seen from this node.
fn keeper_of<'a>(
    state: &AppState,
    cluster: &ClusterNode,
    caller: &Caller,
    view: Option<&'a View>,
    id: Option<&str>,
) -> Owner<'a> {
    let (Some(id), Some(view)) = (id, view) else {
        return Owner::Unknown;
    };
    if super::snapshots::find_snapshot(state, caller, id).is_ok() {
        return Owner::Here;
    }
    let Some(node) = kept_by(view, caller, id).filter(|n| *n != cluster.node_id) else {
        return Owner::Unknown;
    };
    match view.nodes.get(node) {
        None => Owner::Gone(node),
        Some(record) if record.away => Owner::Away(node),
        Some(_) => Owner::Elsewhere(node),
    }
}

/// The node that keeps snapshot `id_or_name` as the registry lists it: by id among those
/// the caller may use, else by name, the caller's own key's first (as a node finds its own).
pub(super) fn kept_by<'a>(view: &'a View, caller: &Caller, id_or_name: &str) -> Option<&'a str> {
    let tenant = &caller.0;
    if let Some(r) = view
        .snapshots
        .get(id_or_name)
        .filter(|r| tenant.may_use(&r.owner))
    {
        return Some(&r.node);
    }
    let named = |owner_ok: &dyn Fn(&str) -> bool| {
        view.snapshots
            .values()
            .filter(|r| r.model.name.as_deref() == Some(id_or_name) && owner_ok(&r.owner))
            .max_by(|a, b| a.model.created.cmp(&b.model.created))
            .map(|r| r.node.as_str())
    };
    named(&|owner| owner == tenant.name).or_else(|| named(&|owner| tenant.may_use(owner)))
}

/// What a forwarded request makes that this node's view should hold before the caller
/// hears of it.
#[derive(Debug, Clone, Copy)]
enum Made {
    Snapshot,
    Forks,
}

fn made_by(method: &Method, path: &str) -> Option<Made> {
    if *method != Method::POST || kernel_of(path).is_none() {
        return None;
    }
    if path.ends_with("/snapshots") {
        Some(Made::Snapshot)
    } else if path.ends_with("/fork") {
        Some(Made::Forks)
    } else {
        None
    }
}

/// A snapshot or forks made on another node, answered once this node's view holds them:
/// the caller's next list or create through this node finds them.
async fn settle(cluster: &ClusterNode, made: Made, response: Response) -> Response {
    if !response.status().is_success() {
        return response;
    }
    let (parts, body) = response.into_parts();
    let Ok(bytes) = to_bytes(body, MAX_CREATE_BODY).await else {
        return ApiError::new(StatusCode::BAD_GATEWAY, "an answer was cut short").into_response();
    };
    let membership = &cluster.membership;
    match made {
        Made::Snapshot => {
            if let Ok(model) = serde_json::from_slice::<SnapshotModel>(&bytes) {
                membership
                    .until_snapshot_known(&model.id, SEEN_TIMEOUT)
                    .await;
            }
        }
        Made::Forks => {
            if let Ok(forks) = serde_json::from_slice::<Forks>(&bytes) {
                for kernel in forks.forks.iter().filter_map(|f| f.kernel.as_ref()) {
                    membership.knows_kernel(&kernel.id).await;
                }
            }
        }
    }
    Response::from_parts(parts, Body::from(bytes))
}

/// Deletes the caller's snapshots named `name` that other nodes keep, but snapshot `id`
/// taken here: a new snapshot replaces one of the same name, wherever it is kept. One on a
/// node that is away stays until deleted (a list shows the newest of a name first).
pub(super) async fn replace_named(state: &AppState, caller: &Caller, name: &str, id: &str) {
    let Some(cluster) = &state.cluster else {
        return;
    };
    let view = cluster.membership.view_for(None);
    let older = view.snapshots.iter().filter(|(other, r)| {
        *other != id
            && r.owner == caller.0.name
            && r.node != cluster.node_id
            && r.model.name.as_deref() == Some(name)
    });
    for (other, record) in older {
        let Some(node) = view.nodes.get(&record.node).filter(|n| !n.away) else {
            tracing::warn!(snapshot = %other, node = %record.node, "a snapshot of the same name stays: its node is away");
            continue;
        };
        let mut req = Request::new(Body::empty());
        *req.method_mut() = Method::DELETE;
        match format!("/api/kernelgate/snapshots/{other}").parse() {
            Ok(uri) => *req.uri_mut() = uri,
            Err(_) => continue,
        }
        let to = destination(&record.node, node);
        let role = "the node that keeps the snapshot this one replaces";
        let response = forward(cluster, &to, role, caller, req, never_left()).await;
        if !response.status().is_success() && response.status() != StatusCode::NOT_FOUND {
            tracing::warn!(snapshot = %other, node = %record.node, status = %response.status(), "a snapshot of the same name on another node could not be deleted");
        }
    }
}

/// The snapshot id (or name) of a path about one snapshot.
fn snapshot_of(path: &str) -> Option<&str> {
    path.strip_prefix("/api/kernelgate/snapshots/")
        .filter(|id| !id.is_empty())
}

/// What `view` says of kernel `id`, seen from this node.
fn owner_of<'a>(
    state: &AppState,
    cluster: &ClusterNode,
    view: Option<&'a View>,
    id: Option<&str>,
) -> Owner<'a> {
    let (Some(id), Some(view)) = (id, view) else {
        return Owner::Unknown;
    };
    if state.kernels.get(id).is_some() {
        return Owner::Here;
    }
    // This node's own and not in its table: the handler's 404.
    let Some(record) = view.kernels.get(id).filter(|k| k.node != cluster.node_id) else {
        return Owner::Unknown;
    };
    match view.nodes.get(&record.node) {
        None => Owner::Gone(&record.node),
        Some(node) if node.away => Owner::Away(&record.node),
        Some(_) => Owner::Elsewhere(&record.node),
    }
}

/// The kernel a sessionless MCP message names: a tool call's `kernel_id` (protocol
/// 2026-07-28; `start_kernel` starts its kernel where it arrives). Only the fields routing
/// reads: the message goes on whole, as sent.
fn mcp_kernel(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Message {
        method: Option<String>,
        params: Option<Params>,
    }
    #[derive(serde::Deserialize)]
    struct Params {
        arguments: Option<Arguments>,
    }
    #[derive(serde::Deserialize)]
    struct Arguments {
        kernel_id: Option<String>,
    }
    let message: Message = serde_json::from_slice(body).ok()?;
    if message.method.as_deref() != Some("tools/call") {
        return None;
    }
    message.params?.arguments?.kernel_id
}

/// Resolves once node `owner` is no longer in the registry (its lease ended). A kernel
/// that leaves the registry does not count: a delete releases its record before it answers.
async fn until_left(cluster: Arc<ClusterNode>, owner: String) {
    cluster.membership.until_node_gone(&owner).await;
}

/// The kernel id of a path about one kernel (`/api/kernels/{id}` and below).
fn kernel_of(path: &str) -> Option<&str> {
    path.strip_prefix("/api/kernels/")
        .and_then(|rest| rest.split('/').next())
        .filter(|id| !id.is_empty())
}

fn unavailable(message: String) -> Response {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
        .retry_after(RETRY_AFTER)
        .into_response()
}

/// Node `id` as a call's destination.
fn destination(id: &str, record: &NodeRecord) -> Destination {
    Destination::of(id, record)
}

/// Sends `req` on to `to`: its answer, or what went wrong, with the detail (address, the
/// HTTP library's words) in the log only. `role` names the node for the client ("the node
/// that runs this kernel").
async fn forward(
    cluster: &ClusterNode,
    to: &Destination,
    role: &str,
    caller: &Caller,
    req: Request,
    left: Left,
) -> Response {
    match cluster
        .forwarder
        .forward(
            to,
            &caller.0.name,
            cluster.membership.registered(),
            req,
            left,
        )
        .await
    {
        Ok(response) => response,
        Err(e @ ForwardError::OwnerLeft { .. }) => ApiError::new(
            StatusCode::NOT_FOUND,
            format!("Kernel not found: {e} while this request waited for it; the kernel comes back if that node returns with it"),
        )
        .into_response(),
        Err(ForwardError::Unreachable { node, address, reason }) => {
            tracing::warn!(%node, %address, %reason, "another node of the cluster cannot be reached");
            unavailable(format!("{role} ({node}) is unreachable; try again shortly"))
        }
        Err(ForwardError::BadAnswer { node, address }) => {
            tracing::warn!(%node, %address, "another node of the cluster answered something that is not HTTP");
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                format!("{role} ({node}) answered something that is not HTTP; try again shortly"),
            )
            .into_response()
        }
        Err(e @ ForwardError::TooLarge { .. }) => {
            ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, e.to_string()).into_response()
        }
        Err(ForwardError::Body(reason)) => {
            tracing::info!(%reason, "a forwarded request's body could not be read");
            ApiError::bad_request(
                "the request's body could not be read whole; send it again".to_owned(),
            )
            .into_response()
        }
    }
}

/// A request made anew from its parts, for one more try.
fn again(
    method: &Method,
    uri: &axum::http::Uri,
    headers: &axum::http::HeaderMap,
    body: &axum::body::Bytes,
) -> Request {
    let mut req = Request::new(Body::from(body.clone()));
    *req.method_mut() = method.clone();
    *req.uri_mut() = uri.clone();
    *req.headers_mut() = headers.clone();
    req
}

/// Forwards `req`, about a kernel of node `owner` (whose record is `node`), to it. An owner
/// cut off or partitioned away may never answer: once its lease ends and it leaves the
/// view, the call (or its WebSocket) ends instead of waiting.
async fn to_owner(
    cluster: &Arc<ClusterNode>,
    caller: &Caller,
    owner: &str,
    node: &NodeRecord,
    req: Request,
) -> Response {
    let left = until_left(cluster.clone(), owner.to_owned())
        .boxed()
        .shared();
    let to = destination(owner, node);
    forward(
        cluster,
        &to,
        "the node that runs this kernel",
        caller,
        req,
        left,
    )
    .await
}

/// An MCP request read whole, to look into and to send again: 413 past `max_body`.
async fn buffered(
    req: Request,
    max_body: usize,
) -> Result<(axum::http::request::Parts, axum::body::Bytes), Response> {
    let (parts, body) = req.into_parts();
    match to_bytes(body, max_body).await {
        Ok(bytes) => Ok((parts, bytes)),
        Err(_) => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("an MCP message is at most {max_body} bytes (--max-message-mb)"),
        )
        .into_response()),
    }
}
