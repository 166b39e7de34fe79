//! A create in a cluster: placed on the node with the most free room that offers the spec,
//! and answered once this node's view holds the new kernel.

use super::*;
use kernelgate_protocol::rest::{CreateKernel, KernelModel};

/// What a create asks for, read from its body by the API it came through.
struct Wanted {
    /// The snapshot it starts from (an id, or a name among the caller's).
    snapshot: Option<String>,
    spec: String,
    /// A retry of the same create must reach the node the first try reached (the one
    /// that knows its idempotency key): this seed picks that node first, whatever the room.
    sticky: Option<String>,
}

/// A create through the kernel API (see [`place_somewhere`]), answered once this node's
/// view holds the new kernel: the next create through this node counts it, and a list
/// through this node shows it.
pub(super) async fn place(
    cluster: &ClusterNode,
    caller: &Caller,
    req: Request,
    next: Next,
) -> Response {
    let wanted = |bytes: &[u8], _: &View| {
        let body = serde_json::from_slice::<CreateKernel>(bytes).ok();
        Wanted {
            snapshot: body.as_ref().and_then(|b| b.snapshot.clone()),
            spec: body
                .and_then(|body| body.name)
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| crate::kernelspecs::DEFAULT_SPEC.to_owned()),
            sticky: None,
        }
    };
    let response = place_somewhere(cluster, caller, req, next, wanted).await;
    settle_created(cluster, response, |bytes| {
        serde_json::from_slice::<KernelModel>(bytes)
            .ok()
            .map(|m| m.id)
    })
    .await
}

/// An E2B create (`POST /v2/sandboxes`), placed as a kernel's: its `templateID` is a
/// snapshot of the caller's, E2B's default template (the default spec) or a spec's name.
/// The sandbox lives where it is made: its record, commands and watches are that node's.
pub(super) async fn place_sandbox(
    cluster: &ClusterNode,
    caller: &Caller,
    req: Request,
    next: Next,
) -> Response {
    let sticky = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(|k| format!("{}\n{k}", caller.0.name));
    let wanted = |bytes: &[u8], view: &View| {
        let template = serde_json::from_slice::<Value>(bytes)
            .ok()
            .and_then(|b| b["templateID"].as_str().map(str::to_owned))
            .unwrap_or_default();
        let default = crate::api::e2b::control::is_default_template(&template);
        Wanted {
            snapshot: (!default && super::kept_by(view, caller, &template).is_some())
                .then(|| template.clone()),
            spec: match default {
                true => crate::kernelspecs::DEFAULT_SPEC.to_owned(),
                false => template,
            },
            sticky: sticky.clone(),
        }
    };
    let response = place_somewhere(cluster, caller, req, next, wanted).await;
    settle_created(cluster, response, |bytes| {
        serde_json::from_slice::<Value>(bytes)
            .ok()
            .and_then(|v| v["sandboxID"].as_str().map(str::to_owned))
    })
    .await
}

/// A create's answer, once this node has read the record of the kernel it made (`id_of`
/// reads its id from the answer).
async fn settle_created(
    cluster: &ClusterNode,
    response: Response,
    id_of: impl Fn(&[u8]) -> Option<String>,
) -> Response {
    if response.status() != StatusCode::CREATED {
        return response;
    }
    let (parts, body) = response.into_parts();
    let Ok(bytes) = to_bytes(body, MAX_CREATE_BODY).await else {
        return ApiError::new(StatusCode::BAD_GATEWAY, "a create's answer was cut short")
            .into_response();
    };
    if let Some(id) = id_of(&bytes) {
        // Read once here, so that the next request for it goes straight to its owner.
        cluster.membership.knows_kernel(&id).await;
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
    wanted: impl Fn(&[u8], &View) -> Wanted,
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
    let view = cluster.membership.view_for(None);
    let Wanted {
        snapshot,
        spec,
        sticky,
    } = wanted(&bytes, &view);
    if let Some(snapshot) = snapshot {
        return from_snapshot(cluster, caller, &view, &snapshot, parts, bytes, next).await;
    }
    let mut candidates = placement::candidates(&view, &spec);
    let sampled = placement::sample(&candidates);
    if !sampled.is_empty() {
        cluster.membership.read_loads(&sampled).await;
        let fresh = cluster.membership.view_for(None);
        candidates = placement::with_sampled(&fresh, &spec, &sampled, candidates);
    }
    if let Some(seed) = sticky {
        // Among every node offering the spec, full or not: a full one that made the first
        // try's sandbox answers with it.
        let offering = view
            .nodes
            .iter()
            .filter(|(_, n)| !n.away && n.specs.contains(&spec))
            .map(|(id, _)| id.clone());
        stick(&mut candidates, &seed, offering);
    }
    // What is sent to another node, made anew for each.
    let sent = parts.clone();
    // This node's handler runs once at most: `local` and `next` go together.
    let mut local = Some((parts, next));
    let mut last = None;
    for node in &candidates {
        if *node == cluster.node_id {
            if let Some((parts, next)) = local.take() {
                let response = next
                    .run(Request::from_parts(parts, Body::from(bytes.clone())))
                    .await;
                // Full (a create's sticky first try may ask a full node): the next one.
                if response.status() != StatusCode::FORBIDDEN {
                    if response.status() == StatusCode::CREATED {
                        cluster.membership.note_placed(node);
                    }
                    return response;
                }
                let (head, body) = response.into_parts();
                let body = to_bytes(body, MAX_CREATE_BODY).await.unwrap_or_default();
                let response = Response::from_parts(head, Body::from(body.clone()));
                if full_refusal(&body).is_none() {
                    return response;
                }
                last = Some(response);
            }
            continue;
        }
        let Some(record) = view.nodes.get(node) else {
            continue;
        };
        let req = again(&sent.method, &sent.uri, &sent.headers, &bytes);
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
        if status == StatusCode::CREATED {
            cluster.membership.note_placed(node);
        }
        return response;
    }
    match (local, last) {
        // No other node took it: this node answers (a full node's answer, or its own
        // refusal of a spec it does not offer).
        (Some((parts, next)), _) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        (None, Some(response)) => response,
        (None, None) => unavailable("no node of the cluster can take a kernel now".into()),
    }
}

/// Puts the node `seed` picks among `offering` (the highest hash of seed and node: the
/// same node for the same seed while it offers the spec) first among the candidates.
fn stick(candidates: &mut Vec<String>, seed: &str, offering: impl Iterator<Item = String>) {
    use sha2::{Digest, Sha256};
    let score = |node: &String| Sha256::digest(format!("{seed}\n{node}").as_bytes());
    if let Some(pick) = offering.max_by_key(score) {
        candidates.retain(|c| *c != pick);
        candidates.insert(0, pick);
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

    #[test]
    fn a_retried_create_goes_first_where_the_first_went() {
        let nodes: Vec<String> = ["a", "b", "c", "d"].map(str::to_owned).to_vec();
        let pick = |candidates: &[&str], seed: &str| {
            let mut c: Vec<String> = candidates.iter().map(|s| s.to_string()).collect();
            stick(&mut c, seed, nodes.iter().cloned());
            c
        };
        let first = pick(&["a", "b", "c", "d"], "alice\nkey-1");
        // The room changed (another order, a node full): the same node comes first.
        assert_eq!(pick(&["d", "b", "a", "c"], "alice\nkey-1")[0], first[0]);
        let without: Vec<&str> = ["a", "b", "c", "d"]
            .into_iter()
            .filter(|n| *n != first[0])
            .collect();
        let full = pick(&without, "alice\nkey-1");
        assert_eq!(full[0], first[0], "a full node is asked first all the same");
        assert_eq!(full.len(), 4, "every other candidate stays, once");
        let picks: std::collections::BTreeSet<String> = (0..32)
            .map(|i| pick(&["a", "b", "c", "d"], &format!("alice\nkey-{i}"))[0].clone())
            .collect();
        assert!(picks.len() > 1, "different keys spread over the nodes");
    }

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
