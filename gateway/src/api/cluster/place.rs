//! A create in a cluster: placed on the node with the most free room that offers the spec,
//! and answered once this node's view holds the new kernel.

use super::*;
use kernelgate_protocol::rest::{CreateKernel, KernelModel};

/// How long a create's answer waits for the new kernel to reach this node's view.
const SEEN_TIMEOUT: Duration = Duration::from_secs(1);

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
    let spec = serde_json::from_slice::<CreateKernel>(&bytes)
        .ok()
        .and_then(|body| body.name)
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
