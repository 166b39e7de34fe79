//! A create in a cluster: placed on the node with the most free room that offers the spec,
//! and answered once this node's view holds the new kernel.

use super::*;
use kernelgate_protocol::rest::{CreateKernel, KernelModel};

/// A create (see [`place_somewhere`]), answered once this node's view holds the new kernel:
/// the next create through this node counts it, and a list through this node shows it.
pub(super) async fn place(
    cluster: &ClusterNode,
    caller: &Caller,
    req: Request,
    next: Next,
) -> Response {
    let response = place_somewhere(cluster, caller, req, next).await;
    if response.status() != StatusCode::CREATED {
        return response;
    }
    let (parts, body) = response.into_parts();
    let Ok(bytes) = to_bytes(body, MAX_CREATE_BODY).await else {
        return ApiError::new(StatusCode::BAD_GATEWAY, "a create's answer was cut short")
            .into_response();
    };
    if let Ok(KernelModel { id, .. }) = serde_json::from_slice(&bytes) {
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
    let body = serde_json::from_slice::<CreateKernel>(&bytes).ok();
    let view = cluster.membership.view();
    if let Some(snapshot) = body.as_ref().and_then(|b| b.snapshot.as_deref()) {
        return from_snapshot(cluster, caller, &view, snapshot, parts, bytes, next).await;
    }
    let spec = body
        .and_then(|body| body.name)
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| crate::kernelspecs::DEFAULT_SPEC.to_owned());
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

/// A create from a snapshot: on the node that keeps it, the only one that can start it.
/// When that node is full, restarting or gone, 503 saying so; a snapshot this node keeps,
/// or one the registry does not list, is this node's to start (or to answer 404 for).
async fn from_snapshot(
    cluster: &ClusterNode,
    caller: &Caller,
    view: &View,
    snapshot: &str,
    parts: axum::http::request::Parts,
    bytes: axum::body::Bytes,
    next: Next,
) -> Response {
    let node = match super::kept_by(view, caller, snapshot) {
        Some(node) if node != cluster.node_id => node.to_owned(),
        _ => {
            return next
                .run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
    };
    let refused = |why: &str| {
        unavailable(format!(
            "snapshot {snapshot} is kept on node {node}, which {why}: a kernel starts from it only there"
        ))
    };
    let Some(record) = view.nodes.get(&node) else {
        return refused("is not in the cluster now; try again shortly");
    };
    if record.away {
        return refused("is restarting; try again shortly");
    }
    let req = again(&parts.method, &parts.uri, &parts.headers, &bytes);
    let to = destination(&node, record);
    let role = "the node that keeps this snapshot";
    let response = forward(cluster, &to, role, caller, req, never_left()).await;
    if response.status() != StatusCode::FORBIDDEN {
        return response;
    }
    let (head, body) = response.into_parts();
    let body = to_bytes(body, MAX_CREATE_BODY).await.unwrap_or_default();
    match full_refusal(&body) {
        Some(message) => refused(&format!(
            "is full ({message}); try again when one of its kernels ends"
        )),
        // The key's quota, a policy: refused alike anywhere.
        None => Response::from_parts(head, Body::from(body)),
    }
}

/// The message of a create's 403 that says the node is full (`--max-kernels`), not that the
/// key may not.
fn full_refusal(body: &[u8]) -> Option<String> {
    let value = serde_json::from_slice::<Value>(body).ok()?;
    let message = value["message"].as_str()?;
    message
        .contains("the most this gateway allows")
        .then(|| message.to_owned())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::CreateError;

    #[tokio::test]
    async fn a_quota_refusal_is_told_from_a_full_node_and_back() {
        let body = |e: CreateError| async move {
            let response = ApiError::from(e).into_response();
            to_bytes(response.into_body(), 1 << 16).await.expect("body")
        };
        let quota = CreateError::TooManyForKey {
            key: "alice".into(),
            max: 3,
        };
        let quota = body(quota).await;
        let full = body(CreateError::TooMany { max: 2 }).await;
        assert!(is_quota_refusal(&quota));
        assert!(!is_quota_refusal(&full));
        assert_eq!(full_refusal(&quota), None);
        assert!(full_refusal(&full).is_some_and(|m| m.starts_with("2 kernels are running")));
    }
}
