//! Cluster mode in front of the handlers: a request about a kernel another node owns is
//! forwarded to it; a create goes to the node with the most free room; the kernel list and
//! the approvals are the cluster's, and an approval is answered by the node that holds it.
//! A call another node forwarded here is served here, as sent, unless this node has lost
//! its lease while the entry node holds its own (503 until it is registered again). Single-node mode (no `--etcd`) passes
//! every request straight through.

use super::auth::Caller;
use super::error::ApiError;
use super::AppState;
use crate::cluster::forward::{never_left, Destination, ForwardError, Left};
use crate::cluster::membership::View;
use crate::cluster::node::ClusterNode;
use crate::cluster::placement;
use crate::cluster::signing::Forwarded;
use crate::cluster::NodeRecord;
use axum::body::{to_bytes, Body};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::FutureExt;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

/// How long the list waits for another node's kernels before it shows their registry rows.
const LIST_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a create's answer waits for the new kernel to reach this node's view.
const SEEN_TIMEOUT: Duration = Duration::from_secs(1);
/// How often a forwarded call checks that its kernel's owner is still in the cluster.
const OWNER_CHECK: Duration = Duration::from_millis(200);
/// Seconds a client is told to wait when a node is not there now.
const RETRY_AFTER: u32 = 3;
/// The largest create body kept to retry on the next node.
const MAX_CREATE_BODY: usize = 1 << 20;

/// Middleware behind authentication: see the module's documentation.
pub async fn route(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(cluster) = state.cluster.clone() else {
        return next.run(req).await;
    };
    if let Some(who) = req.extensions().get::<Forwarded>() {
        // Cut off from the registry while the entry node is not, this node may hold a
        // kernel the others think gone: no work from them until it is registered again.
        // With the registry down for everyone, the last view still serves.
        if who.entry_registered && !cluster.membership.registered() {
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
    let path = req.uri().path().to_owned();
    if path == "/mcp" {
        let session = req
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        return match session {
            Some(id) if !state.mcp.holds(&id) => {
                mcp_elsewhere(&cluster, &caller, &id, state.max_message_bytes, req, next).await
            }
            None if req.method() == Method::POST => {
                mcp_by_kernel(&cluster, &caller, state.max_message_bytes, req, next).await
            }
            _ => next.run(req).await,
        };
    }
    if let Some(id) = kernel_of(&path) {
        if state.kernels.get(id).is_some() {
            return next.run(req).await;
        }
        return match owner_elsewhere(&cluster, id) {
            Some(owner) => to_owner(&cluster, &caller, id, &owner, req).await,
            // Unknown, or this node's own and not in its table: the handler's 404.
            None => next.run(req).await,
        };
    }
    if path == "/api/kernels" && req.method() == Method::POST {
        return place(&cluster, &caller, req, next).await;
    }
    if path == "/api/kernels" && req.method() == Method::GET {
        return list(&cluster, &caller, req, next).await;
    }
    if path == "/api/kernelgate/approvals" && req.method() == Method::GET {
        return approvals(&cluster, &caller, req, next).await;
    }
    if path.starts_with("/api/kernelgate/approvals/") && req.method() == Method::POST {
        return answer(&cluster, &caller, req, next).await;
    }
    next.run(req).await
}

/// Resolves once node `owner` is no longer in the registry (its lease ended). A kernel
/// that leaves the registry does not count: a delete releases its record before it answers.
async fn until_left(cluster: Arc<ClusterNode>, owner: String) {
    loop {
        tokio::time::sleep(OWNER_CHECK).await;
        if !cluster.membership.has_node(&owner) {
            return;
        }
    }
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
        let deadline = tokio::time::Instant::now() + SEEN_TIMEOUT;
        while !cluster.membership.knows_kernel(&id) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
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

/// A request for an MCP session this node does not hold: the node that holds it answers
/// (remembered once found; every other node is asked otherwise). A session no node holds
/// gets this node's own answer (404, start a new one).
/// The node that owns kernel `id`, when the registry names one other than this node.
fn owner_elsewhere(cluster: &ClusterNode, id: &str) -> Option<String> {
    cluster
        .membership
        .view()
        .kernels
        .get(id)
        .filter(|k| k.node != cluster.node_id)
        .map(|k| k.node.clone())
}

/// Forwards `req`, about kernel `id`, to its owner `owner`: 503 with Retry-After while that
/// node is not there or restarting.
async fn to_owner(
    cluster: &Arc<ClusterNode>,
    caller: &Caller,
    id: &str,
    owner: &str,
    req: Request,
) -> Response {
    let node = cluster.membership.view().nodes.get(owner).cloned();
    let Some(node) = node else {
        return unavailable(format!(
            "the node that runs kernel {id} ({owner}) is not in the cluster now; try again shortly"
        ));
    };
    if node.away {
        return unavailable(format!(
            "the node that runs kernel {id} ({owner}) is restarting; try again shortly"
        ));
    }
    // An owner cut off or partitioned away may never answer: once its lease ends and it
    // leaves the view, the call (or its WebSocket) ends instead of waiting.
    let left = until_left(cluster.clone(), owner.to_owned())
        .boxed()
        .shared();
    let to = destination(owner, &node);
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

/// A sessionless MCP call (protocol 2026-07-28): a tool call whose `kernel_id` names a
/// kernel another node owns goes to that node whole (it is self-contained); anything else
/// is served here (`start_kernel` starts its kernel on this node).
async fn mcp_by_kernel(
    cluster: &Arc<ClusterNode>,
    caller: &Caller,
    max_body: usize,
    req: Request,
    next: Next,
) -> Response {
    let (parts, bytes) = match buffered(req, max_body).await {
        Ok(read) => read,
        Err(refused) => return refused,
    };
    let kernel = serde_json::from_slice::<Value>(&bytes).ok().and_then(|m| {
        (m["method"] == "tools/call")
            .then(|| {
                m["params"]["arguments"]["kernel_id"]
                    .as_str()
                    .map(str::to_owned)
            })
            .flatten()
    });
    let elsewhere = kernel
        .as_deref()
        .and_then(|id| Some((id, owner_elsewhere(cluster, id)?)));
    match elsewhere {
        Some((id, owner)) => {
            let req = again(&parts.method, &parts.uri, &parts.headers, &bytes);
            to_owner(cluster, caller, id, &owner, req).await
        }
        None => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
    }
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
