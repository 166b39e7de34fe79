//! The cluster's lists (kernels, approvals waiting) made of every node's, and the requests
//! the node that holds them answers, asked in turn: an approval's answer, an MCP session.

use super::*;
use kernelgate_protocol::rest::{Approval, KernelModel, STATE_UNKNOWN};
use serde::de::DeserializeOwned;

/// How long the list waits for another node's kernels before it shows their registry rows.
const LIST_TIMEOUT: Duration = Duration::from_secs(1);

/// The cluster's kernels: this node's own, and each other node's as it reports them
/// (asked in parallel, a short timeout each). A node that does not answer in time shows
/// its kernels as the registry knows them, with `execution_state` `unknown`.
pub(super) async fn list(
    cluster: &Arc<ClusterNode>,
    caller: &Caller,
    req: Request,
    next: Next,
) -> Response {
    let (asked, mut rows) = match local_rows::<KernelModel>(req, next).await {
        Ok(local) => local,
        Err(answer) => return answer,
    };
    // Only the nodes that hold a kernel the caller may see, by the tenant index (one
    // small range), and the nodes that do not index theirs. An admin may see every
    // kernel: every node is asked, and the index read only when one does not answer.
    let view = cluster.membership.view_for(None);
    let mut others = other_nodes(cluster, &view);
    let tenant = (!caller.0.admin).then_some(caller.0.name.as_str());
    let mut index = match tenant {
        Some(tenant) => cluster.membership.kernels_of(Some(tenant)).await.ok(),
        None => None,
    };
    if let Some(index) = &index {
        let holding: std::collections::HashSet<&str> =
            index.iter().map(|(_, k)| k.node.as_str()).collect();
        others.retain(|to| {
            holding.contains(to.node.as_str())
                || view.nodes.get(&to.node).is_none_or(|n| !n.indexed)
        });
    }
    let asks = ask_others(cluster, caller, &asked, &others).await;
    let silent: Vec<String> = asks
        .into_iter()
        .filter_map(|(node, answer)| match answer {
            Some(theirs) => {
                rows.extend(theirs);
                None
            }
            None => Some(node),
        })
        .collect();
    if !silent.is_empty() {
        if index.is_none() {
            index = cluster.membership.kernels_of(tenant).await.ok();
        }
        // The silent nodes' kernels as the registry knows them.
        rows.extend(
            index
                .unwrap_or_default()
                .into_iter()
                .filter(|(_, k)| silent.contains(&k.node) && caller.0.may_use(&k.tenant))
                .map(|(id, k)| KernelModel {
                    id,
                    name: k.spec,
                    last_activity: k.created,
                    execution_state: STATE_UNKNOWN.to_owned(),
                    connections: 0,
                    hibernated: false,
                    hibernate_blocked: None,
                    hibernation: None,
                }),
        );
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
async fn local_rows<T: DeserializeOwned>(
    req: Request,
    next: Next,
) -> Result<(Asked, Vec<T>), Response> {
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
    match serde_json::from_slice(&bytes) {
        Ok(rows) => Ok((asked, rows)),
        Err(e) => {
            tracing::error!(error = %e, "this node's own list is not its rows");
            Err(unavailable("cannot read this node's own list".into()))
        }
    }
}

/// Asks each of `others` the same `GET`, in parallel, [`LIST_TIMEOUT`] each: their JSON
/// arrays, `None` for a node that did not answer one in time.
async fn ask_others<T: DeserializeOwned>(
    cluster: &ClusterNode,
    caller: &Caller,
    asked: &Asked,
    others: &[Destination],
) -> Vec<(String, Option<Vec<T>>)> {
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
                serde_json::from_slice::<Vec<T>>(&body).ok()
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
pub(super) async fn approvals(
    cluster: &ClusterNode,
    caller: &Caller,
    req: Request,
    next: Next,
) -> Response {
    let (asked, mut rows) = match local_rows::<Approval>(req, next).await {
        Ok(local) => local,
        Err(answer) => return answer,
    };
    let others = other_nodes(cluster, &cluster.membership.view_for(None));
    for (_, theirs) in ask_others(cluster, caller, &asked, &others).await {
        rows.extend(theirs.unwrap_or_default());
    }
    rows.sort_by(|a, b| a.requested_at.cmp(&b.requested_at));
    axum::Json(rows).into_response()
}

/// An answer to an approval: the node that holds it takes it. This node first, then each
/// other; the first that knows the approval answers.
pub(super) async fn answer(
    cluster: &ClusterNode,
    caller: &Caller,
    req: Request,
    next: Next,
) -> Response {
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
    for to in other_nodes(cluster, &cluster.membership.view_for(None)) {
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
pub(super) async fn mcp_elsewhere(
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
    let mut order = other_nodes(cluster, &cluster.membership.view_for(None));
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
