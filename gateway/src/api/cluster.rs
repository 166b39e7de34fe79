//! Cluster mode in front of the handlers: the I/O of the decisions `cluster::route` makes
//! from each route's declared rule. A request about a kernel another node owns is
//! forwarded to it; a create goes to the node with the most free room; the kernel list and
//! the approvals are the cluster's, and an approval is answered by the node that holds it.
//! A call another node forwarded here is served here, as sent, unless this node has lost
//! its lease while the entry node holds its own (503 until it is registered again).
//! Single-node mode (no `--etcd`) passes every request straight through.

use super::auth::Caller;
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
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

/// How long the list waits for another node's kernels before it shows their registry rows.
const LIST_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a create's answer waits for the new kernel to reach this node's view.
const SEEN_TIMEOUT: Duration = Duration::from_secs(1);
/// Seconds a client is told to wait when a node is not there now.
const RETRY_AFTER: u32 = 3;
/// The largest create body kept to retry on the next node.
const MAX_CREATE_BODY: usize = 1 << 20;

/// Each protected path's rule, as `surface` declares it.
static RULES: LazyLock<HashMap<String, Rule>> =
    LazyLock::new(|| super::surface().protected.rules().iter().cloned().collect());

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
    let Some(caller) = req.extensions().get::<Caller>().cloned() else {
        return next.run(req).await;
    };
    let rule = req
        .extensions()
        .get::<MatchedPath>()
        .and_then(|p| RULES.get(p.as_str()))
        .copied()
        .unwrap_or(Rule::Local);
    let method = req.method().clone();
    let mut req = req;
    let mut kernel = None;
    let mut session = None;
    match rule {
        Rule::Kernel => kernel = kernel_of(req.uri().path()).map(str::to_owned),
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
    let view = cluster.membership.view();
    let owner = owner_of(&state, &cluster, &view, kernel.as_deref());
    let ask = Ask {
        method,
        kernel: owner,
        mcp_session: session.as_deref().map(|id| state.mcp.holds(id)),
        registered: cluster.membership.registered(),
    };
    let id = kernel.as_deref().unwrap_or_default();
    match route::decide(rule, &ask) {
        Decision::Serve => next.run(req).await,
        Decision::Forward(node) => match view.nodes.get(&node) {
            Some(record) => to_owner(&cluster, &caller, &node, record, req).await,
            None => unavailable(not_in_cluster(id, &node)),
        },
        Decision::Unavailable(Unavailable::OwnerAway(node)) => unavailable(format!(
            "the node that runs kernel {id} ({node}) is restarting; try again shortly"
        )),
        Decision::Unavailable(Unavailable::OwnerGone(node)) => {
            unavailable(not_in_cluster(id, &node))
        }
        Decision::Unavailable(Unavailable::CutOff) => unavailable(
            "this node is cut off from the cluster registry and cannot place kernels now; try again shortly".into(),
        ),
        Decision::Place => place(&cluster, &caller, req, next).await,
        Decision::FanOut(Fan::Kernels) => list(&cluster, &caller, req, next).await,
        Decision::FanOut(Fan::Approvals) => approvals(&cluster, &caller, req, next).await,
        Decision::HereThenOthers => answer(&cluster, &caller, req, next).await,
        Decision::OthersThenHere => {
            let session = session.unwrap_or_default();
            mcp_elsewhere(&cluster, &caller, &session, state.max_message_bytes, req, next).await
        }
    }
}

fn not_in_cluster(id: &str, node: &str) -> String {
    format!("the node that runs kernel {id} ({node}) is not in the cluster now; try again shortly")
}

/// What `view` says of kernel `id`, seen from this node.
fn owner_of<'a>(
    state: &AppState,
    cluster: &ClusterNode,
    view: &'a View,
    id: Option<&str>,
) -> Owner<'a> {
    let Some(id) = id else {
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
/// 2026-07-28; `start_kernel` starts its kernel where it arrives).
fn mcp_kernel(body: &[u8]) -> Option<String> {
    let message = serde_json::from_slice::<Value>(body).ok()?;
    (message["method"] == "tools/call")
        .then(|| message["params"]["arguments"]["kernel_id"].as_str())
        .flatten()
        .map(str::to_owned)
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

/// A create (see [`place_somewhere`]), answered once this node's view holds the new kernel:
/// the next create through this node counts it, and a list through this node shows it.
async fn place(cluster: &ClusterNode, caller: &Caller, req: Request, next: Next) -> Response {
    let response = place_somewhere(cluster, caller, req, next).await;
    if response.status() != StatusCode::CREATED {
        return response;
    }
    let (parts, body) = response.into_parts();
    let Ok(bytes) = to_bytes(body, MAX_CREATE_BODY).await else {
        return ApiError::new(StatusCode::BAD_GATEWAY, "a create's answer was cut short")
            .into_response();
    };
    if let Some(id) = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v.get("id").and_then(Value::as_str).map(str::to_owned))
    {
        cluster
            .membership
            .until_kernel_known(&id, SEEN_TIMEOUT)
            .await;
    }
    Response::from_parts(parts, Body::from(bytes))
}

/// A create: on the node with the most free room that offers the spec, the next one when
/// that one is full or cannot be reached. Refused while this node is cut off from the
/// registry: a guess could place a kernel where the cluster does not know it.
async fn place_somewhere(
    cluster: &ClusterNode,
    caller: &Caller,
    req: Request,
    next: Next,
) -> Response {
    if !cluster.membership.registered() {
        return unavailable(
            "this node is cut off from the cluster registry and cannot place kernels now; try again shortly".into(),
        );
    }
    let (parts, body) = req.into_parts();
    let Ok(bytes) = to_bytes(body, MAX_CREATE_BODY).await else {
        return ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("a create body is at most {MAX_CREATE_BODY} bytes"),
        )
        .into_response();
    };
    let spec = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v.get("name").and_then(Value::as_str).map(str::to_owned))
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| crate::kernelspecs::DEFAULT_SPEC.to_owned());
    let view = cluster.membership.view();
    let candidates = placement::candidates(&view, &spec);
    let mut local = Some(parts);
    let mut last = None;
    for node in &candidates {
        if *node == cluster.node_id {
            if let Some(parts) = local.take() {
                let response = next
                    .run(Request::from_parts(parts, Body::from(bytes)))
                    .await;
                return response;
            }
            continue;
        }
        let Some(record) = view.nodes.get(node) else {
            continue;
        };
        let Some(parts) = local.as_ref() else { break };
        let req = again(&parts.method, &parts.uri, &parts.headers, &bytes);
        let to = destination(node, record);
        let response = forward(
            cluster,
            &to,
            "the node chosen for this kernel",
            caller,
            req,
            never_left(),
        )
        .await;
        // Full since the view was made, or gone: the next node. A key at its quota is
        // refused alike by every node: answered at once.
        let status = response.status();
        if status == StatusCode::FORBIDDEN {
            let (head, body) = response.into_parts();
            let body = to_bytes(body, MAX_CREATE_BODY).await.unwrap_or_default();
            if is_quota_refusal(&body) {
                return Response::from_parts(head, Body::from(body));
            }
            last = Some(Response::from_parts(head, Body::from(body)));
            continue;
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            last = Some(response);
            continue;
        }
        return response;
    }
    match (local, last) {
        // No other node took it: this node answers (a full node's answer, or its own
        // refusal of a spec it does not offer).
        (Some(parts), _) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        (None, Some(response)) => response,
        (None, None) => unavailable("no node of the cluster can take a kernel now".into()),
    }
}

/// Whether a create's 403 is its key's quota (`max_kernels`, counted across the cluster)
/// rather than a full node.
fn is_quota_refusal(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body).is_ok_and(|v| {
        v["message"]
            .as_str()
            .is_some_and(|m| m.contains("(max_kernels in the keys file)"))
    })
}

/// The cluster's kernels: this node's own, and each other node's as it reports them
/// (asked in parallel, a short timeout each). A node that does not answer in time shows
/// its kernels as the registry knows them, with `execution_state` `unknown`.
async fn list(cluster: &Arc<ClusterNode>, caller: &Caller, req: Request, next: Next) -> Response {
    let view = cluster.membership.view();
    let (asked, mut rows) = match local_rows(req, next).await {
        Ok(local) => local,
        Err(answer) => return answer,
    };
    // Only the nodes that hold a kernel the caller may see.
    let mut others = other_nodes(cluster, &view);
    others.retain(|to| {
        view.kernels
            .values()
            .any(|k| k.node == to.node && caller.0.may_use(&k.tenant))
    });
    let asks = ask_others(cluster, caller, &asked, &others).await;
    for (node, answer) in asks {
        match answer {
            Some(theirs) => rows.extend(theirs),
            None => rows.extend(
                view.kernels
                    .iter()
                    .filter(|(_, k)| k.node == node && caller.0.may_use(&k.tenant))
                    .map(|(id, k)| {
                        serde_json::json!({
                            "id": id, "name": k.spec, "last_activity": k.created,
                            "execution_state": "unknown", "connections": 0,
                        })
                    }),
            ),
        }
    }
    axum::Json(rows).into_response()
}

/// The request a list was asked with, to ask the other nodes alike.
struct Asked {
    method: Method,
    uri: axum::http::Uri,
    headers: axum::http::HeaderMap,
}

/// This node's own answer to a list request, as its rows, with the request to ask the
/// others; a refusal as it is.
async fn local_rows(req: Request, next: Next) -> Result<(Asked, Vec<Value>), Response> {
    let asked = Asked {
        method: req.method().clone(),
        uri: req.uri().clone(),
        headers: req.headers().clone(),
    };
    let local = next.run(req).await;
    if !local.status().is_success() {
        return Err(local);
    }
    let Ok(bytes) = to_bytes(local.into_body(), usize::MAX).await else {
        return Err(unavailable("cannot read this node's own list".into()));
    };
    Ok((asked, serde_json::from_slice(&bytes).unwrap_or_default()))
}

/// Asks each of `others` the same `GET`, in parallel, [`LIST_TIMEOUT`] each: their JSON
/// arrays, `None` for a node that did not answer one in time.
async fn ask_others(
    cluster: &ClusterNode,
    caller: &Caller,
    asked: &Asked,
    others: &[Destination],
) -> Vec<(String, Option<Vec<Value>>)> {
    let asks = others.iter().map(|to| {
        let req = again(
            &asked.method,
            &asked.uri,
            &asked.headers,
            &axum::body::Bytes::new(),
        );
        async move {
            let answer = tokio::time::timeout(LIST_TIMEOUT, async {
                let response = forward(
                    cluster,
                    to,
                    "a node of the cluster",
                    caller,
                    req,
                    never_left(),
                )
                .await;
                if !response.status().is_success() {
                    return None;
                }
                let body = to_bytes(response.into_body(), usize::MAX).await.ok()?;
                serde_json::from_slice::<Vec<Value>>(&body).ok()
            })
            .await
            .ok()
            .flatten();
            (to.node.clone(), answer)
        }
    });
    futures::future::join_all(asks).await
}

/// Every other node of `view`, by id.
fn other_nodes(cluster: &ClusterNode, view: &View) -> Vec<Destination> {
    let mut others: Vec<Destination> = view
        .nodes
        .iter()
        .filter(|(id, _)| **id != cluster.node_id)
        .map(|(id, n)| destination(id, n))
        .collect();
    others.sort_by(|a, b| a.node.cmp(&b.node));
    others
}

/// The executions waiting for approval on every node: this node's and the others' (a
/// node that does not answer in time is left out), oldest first.
async fn approvals(cluster: &ClusterNode, caller: &Caller, req: Request, next: Next) -> Response {
    let (asked, mut rows) = match local_rows(req, next).await {
        Ok(local) => local,
        Err(answer) => return answer,
    };
    let others = other_nodes(cluster, &cluster.membership.view());
    for (_, theirs) in ask_others(cluster, caller, &asked, &others).await {
        rows.extend(theirs.unwrap_or_default());
    }
    rows.sort_by(|a, b| {
        let at = |v: &Value| v["requested_at"].as_str().unwrap_or_default().to_owned();
        at(a).cmp(&at(b))
    });
    axum::Json(rows).into_response()
}

/// An answer to an approval: the node that holds it takes it. This node first, then each
/// other; the first that knows the approval answers.
async fn answer(cluster: &ClusterNode, caller: &Caller, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(bytes) = to_bytes(body, MAX_CREATE_BODY).await else {
        return ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "an answer is `{\"approve\": true|false}`",
        )
        .into_response();
    };
    let (method, uri, headers) = (
        parts.method.clone(),
        parts.uri.clone(),
        parts.headers.clone(),
    );
    let local = next
        .run(Request::from_parts(parts, Body::from(bytes.clone())))
        .await;
    if local.status() != StatusCode::NOT_FOUND {
        return local;
    }
    for to in other_nodes(cluster, &cluster.membership.view()) {
        let response = forward(
            cluster,
            &to,
            "a node of the cluster",
            caller,
            again(&method, &uri, &headers, &bytes),
            never_left(),
        )
        .await;
        if response.status() != StatusCode::NOT_FOUND
            && response.status() != StatusCode::SERVICE_UNAVAILABLE
        {
            return response;
        }
    }
    local
}

/// Most MCP sessions of other nodes remembered; past this the memory starts afresh.
const MAX_REMEMBERED_SESSIONS: usize = 10_000;

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

/// A request for an MCP session this node does not hold: the node that holds it answers
/// (remembered once found; every other node is asked otherwise). A session no node holds
/// gets this node's own answer (404, start a new one).
async fn mcp_elsewhere(
    cluster: &ClusterNode,
    caller: &Caller,
    session: &str,
    max_body: usize,
    req: Request,
    next: Next,
) -> Response {
    let (parts, bytes) = match buffered(req, max_body).await {
        Ok(read) => read,
        Err(refused) => return refused,
    };
    let remembered = cluster
        .mcp_sessions
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(session)
        .cloned();
    // The node remembered first, then the others.
    let mut order = other_nodes(cluster, &cluster.membership.view());
    if let Some(node) = &remembered {
        order.sort_by_key(|to| to.node != *node);
    }
    for to in order {
        let req = again(&parts.method, &parts.uri, &parts.headers, &bytes);
        let response = forward(
            cluster,
            &to,
            "the node that holds this MCP session",
            caller,
            req,
            never_left(),
        )
        .await;
        let status = response.status();
        if status != StatusCode::NOT_FOUND && status != StatusCode::SERVICE_UNAVAILABLE {
            let mut known = cluster
                .mcp_sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if known.len() >= MAX_REMEMBERED_SESSIONS {
                known.clear();
            }
            if parts.method == Method::DELETE {
                known.remove(session);
            } else {
                known.insert(session.to_owned(), to.node);
            }
            return response;
        }
    }
    cluster
        .mcp_sessions
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(session);
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::CreateError;

    #[tokio::test]
    async fn a_quota_refusal_is_told_from_a_full_node() {
        let body = |e: CreateError| async move {
            let response = ApiError::from(e).into_response();
            to_bytes(response.into_body(), 1 << 16).await.expect("body")
        };
        let quota = CreateError::TooManyForKey {
            key: "alice".into(),
            max: 3,
        };
        assert!(is_quota_refusal(&body(quota).await));
        assert!(!is_quota_refusal(
            &body(CreateError::TooMany { max: 2 }).await
        ));
    }
}

/// Every route of the API against the owners a kernel can have: where each goes.
#[cfg(test)]
mod routing_table {
    use super::*;
    use axum::http::Method;

    /// Each route and method, then where it goes when the kernel it names is here /
    /// elsewhere (node-2) / away / gone / unknown: S served here, F forwarded to node-2,
    /// A 503 (owner restarting), G 503 (owner not in the cluster), P placed, K every node's
    /// kernels, V every node's approvals, T here then the others, O the others then here.
    /// MCP rows without a session header; its session rows are in `mcp_sessions`.
    const TABLE: &[(&str, &str, &str)] = &[
        ("GET", "/", "SSSSS"),
        ("GET", "/ui/{file}", "SSSSS"),
        ("GET", "/api", "SSSSS"),
        ("GET", "/api/openapi.json", "SSSSS"),
        ("GET", "/healthz", "SSSSS"),
        ("GET", "/readyz", "SSSSS"),
        ("GET", "/metrics", "SSSSS"),
        ("POST", "/v2/sandboxes", "SSSSS"),
        ("GET", "/v2/sandboxes", "SSSSS"),
        ("GET", "/sandboxes/{id}", "SSSSS"),
        ("DELETE", "/sandboxes/{id}", "SSSSS"),
        ("POST", "/sandboxes/{id}/timeout", "SSSSS"),
        ("POST", "/v2/sandboxes/{id}/connect", "SSSSS"),
        ("GET", "/sandboxes/{id}/metrics", "SSSSS"),
        ("PUT", "/sandboxes/{id}/network", "SSSSS"),
        ("GET", "/api/kernelspecs", "SSSSS"),
        ("GET", "/api/kernelspecs/{name}", "SSSSS"),
        ("GET", "/kernelspecs/{name}/{file}", "SSSSS"),
        ("GET", "/api/kernels", "KKKKK"),
        ("POST", "/api/kernels", "PPPPP"),
        ("GET", "/api/kernels/{id}", "SFAGS"),
        ("DELETE", "/api/kernels/{id}", "SFAGS"),
        ("POST", "/api/kernels/{id}/interrupt", "SFAGS"),
        ("POST", "/api/kernels/{id}/restart", "SFAGS"),
        ("POST", "/api/kernels/{id}/hibernate", "SFAGS"),
        ("POST", "/api/kernels/{id}/discard-state", "SFAGS"),
        ("GET", "/api/kernels/{id}/channels", "SFAGS"),
        ("POST", "/api/kernels/{id}/execute", "SFAGS"),
        ("POST", "/api/kernels/{id}/packages", "SFAGS"),
        ("GET", "/api/kernels/{id}/files", "SFAGS"),
        ("GET", "/api/kernels/{id}/files/{*path}", "SFAGS"),
        ("PUT", "/api/kernels/{id}/files/{*path}", "SFAGS"),
        ("DELETE", "/api/kernels/{id}/files/{*path}", "SFAGS"),
        ("GET", "/api/kernelgate/approvals", "VVVVV"),
        ("POST", "/api/kernelgate/approvals/{id}", "TTTTT"),
        ("GET", "/api/kernelgate/packages", "SSSSS"),
        ("POST", "/mcp", "SFAGS"),
        ("GET", "/mcp", "SSSSS"),
        ("DELETE", "/mcp", "SSSSS"),
    ];

    const OWNERS: [Owner<'static>; 5] = [
        Owner::Here,
        Owner::Elsewhere("node-2"),
        Owner::Away("node-2"),
        Owner::Gone("node-2"),
        Owner::Unknown,
    ];

    fn code(decision: &Decision) -> char {
        match decision {
            Decision::Serve => 'S',
            Decision::Forward(node) if node == "node-2" => 'F',
            Decision::Forward(_) => '?',
            Decision::Unavailable(Unavailable::OwnerAway(_)) => 'A',
            Decision::Unavailable(Unavailable::OwnerGone(_)) => 'G',
            Decision::Unavailable(Unavailable::CutOff) => 'C',
            Decision::Place => 'P',
            Decision::FanOut(Fan::Kernels) => 'K',
            Decision::FanOut(Fan::Approvals) => 'V',
            Decision::HereThenOthers => 'T',
            Decision::OthersThenHere => 'O',
        }
    }

    /// Every (method, path) the router serves, with the rule its declaration gives it.
    fn declared() -> Vec<(String, String, Rule)> {
        let super::super::Surface { public, protected } = super::super::surface();
        let mut rules: HashMap<String, Rule> = public.rules().iter().cloned().collect();
        rules.extend(protected.rules().iter().cloned());
        let mut routes = Vec::new();
        for part in [public, protected] {
            let (_, doc, prose) = part.split();
            for (path, item) in &doc.paths.paths {
                let methods = [
                    ("GET", item.get.is_some()),
                    ("PUT", item.put.is_some()),
                    ("POST", item.post.is_some()),
                    ("DELETE", item.delete.is_some()),
                    ("PATCH", item.patch.is_some()),
                ];
                for (method, _) in methods.iter().filter(|(_, has)| *has) {
                    routes.push((method.to_string(), path.clone(), rules[path]));
                }
            }
            for p in prose {
                let methods: &[&str] = match p.path {
                    "/mcp" => &["POST", "GET", "DELETE"],
                    _ => &["GET"],
                };
                for method in methods {
                    routes.push((method.to_string(), p.path.to_owned(), rules[p.path]));
                }
            }
        }
        routes
    }

    #[test]
    fn every_route_goes_where_its_kernel_is() {
        let declared = declared();
        let mut rows: Vec<(&str, &str)> = TABLE.iter().map(|(m, p, _)| (*m, *p)).collect();
        let mut routes: Vec<(&str, &str)> = declared
            .iter()
            .map(|(m, p, _)| (m.as_str(), p.as_str()))
            .collect();
        rows.sort();
        routes.sort();
        assert_eq!(
            rows, routes,
            "the table names every route the router serves"
        );
        for (method, path, rule) in &declared {
            let expected = TABLE
                .iter()
                .find(|(m, p, _)| m == method && p == path)
                .map(|(_, _, e)| *e)
                .unwrap_or_default();
            let got: String = OWNERS
                .iter()
                .map(|owner| {
                    let ask = Ask {
                        method: method.parse::<Method>().expect("a method"),
                        kernel: *owner,
                        mcp_session: None,
                        registered: true,
                    };
                    code(&route::decide(*rule, &ask))
                })
                .collect();
            assert_eq!(got, expected, "{method} {path} ({rule:?})");
        }
    }

    #[test]
    fn a_node_cut_off_from_the_registry_places_nothing_and_serves_the_rest_as_usual() {
        for (method, path, rule) in declared() {
            for owner in OWNERS {
                let ask = |registered| Ask {
                    method: method.parse::<Method>().expect("a method"),
                    kernel: owner,
                    mcp_session: None,
                    registered,
                };
                let (on, off) = (
                    route::decide(rule, &ask(true)),
                    route::decide(rule, &ask(false)),
                );
                if method == "POST" && path == "/api/kernels" {
                    assert_eq!(off, Decision::Unavailable(Unavailable::CutOff));
                } else {
                    assert_eq!(on, off, "{method} {path} {owner:?}");
                }
            }
        }
    }

    #[test]
    fn mcp_sessions_are_served_where_they_are_held() {
        for method in [Method::POST, Method::GET, Method::DELETE] {
            for owner in OWNERS {
                let ask = |held| Ask {
                    method: method.clone(),
                    kernel: owner,
                    mcp_session: Some(held),
                    registered: true,
                };
                assert_eq!(route::decide(Rule::Mcp, &ask(true)), Decision::Serve);
                assert_eq!(
                    route::decide(Rule::Mcp, &ask(false)),
                    Decision::OthersThenHere
                );
            }
        }
        assert_eq!(RULES.get("/mcp"), Some(&Rule::Mcp));
    }
}
