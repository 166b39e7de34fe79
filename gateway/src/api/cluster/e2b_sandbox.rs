//! E2B's sandboxes in cluster mode. A sandbox lives on the node that runs its kernel (its
//! record, its commands, its watchers are there), so a call about one goes there from any
//! node: a control-plane call by its key (as a kernel's call), a sandbox-plane call, which
//! carries no key but the sandbox's access token, on behalf of the key that owns the
//! sandbox. The token is checked where the sandbox is: every node derives the same tokens
//! from the cluster's secret.

use super::super::auth::Caller;
use super::super::e2b::plane::{Original, FORWARDED_USER};
use super::super::AppState;
use super::{forwarded, not_in_cluster, owner_of, to_owner, unavailable, unreadable};
use crate::cluster::node::ClusterNode;
use crate::cluster::route::{self, Ask, Decision, Rule, Unavailable};
use crate::cluster::signing::Forwarded;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use kernelgate_protocol::rest::headers::{E2B_SANDBOX_ID, E2B_SANDBOX_PORT};

const ROLE: &str = "runs sandbox";

/// The sandbox a path is about: the control plane's `/sandboxes/{id}...` (and `/v2/`), or
/// the sandbox plane's internal `/.e2b/<port>/<id>/...`.
pub(super) fn sandbox_of(path: &str) -> Option<&str> {
    let id = match path.strip_prefix(super::super::e2b::plane::PREFIX) {
        Some(rest) => rest.split('/').nth(2),
        None => {
            let rest = path.strip_prefix("/v2").unwrap_or(path);
            rest.strip_prefix("/sandboxes/")?.split('/').next()
        }
    };
    id.filter(|id| !id.is_empty())
}

/// A sandbox-plane call that arrived here: served here, or sent to the sandbox's node as
/// the client sent it.
pub(super) async fn route(
    state: &AppState,
    cluster: &std::sync::Arc<ClusterNode>,
    req: Request,
    next: Next,
) -> Response {
    let path = req.uri().path().to_owned();
    let Some(id) = sandbox_of(&path) else {
        return next.run(req).await;
    };
    let view = match state.kernels.get(id) {
        Some(_) => cluster.membership.view_for(Some(id)),
        None => cluster.membership.view_finding(id).await,
    };
    if view.unreadable {
        return unavailable(unreadable(ROLE, id));
    }
    let ask = Ask {
        method: req.method().clone(),
        kernel: owner_of(state, cluster, Some(&view), Some(id)),
        mcp_session: None,
        registered: cluster.membership.registered(),
    };
    match route::decide(Rule::Sandbox, &ask) {
        Decision::Forward(node) => {
            let Some(record) = view.nodes.get(&node) else {
                return unavailable(not_in_cluster(ROLE, id, &node));
            };
            let owner = view
                .kernels
                .get(id)
                .and_then(|k| state.keys.tenant_named(&k.tenant));
            let Some(owner) = owner else {
                return unavailable(format!(
                    "sandbox {id} belongs to a key this node does not have: every node must \
                     load the same keys file"
                ));
            };
            let port = path.split('/').nth(2).unwrap_or_default().to_owned();
            let req = as_sent(req, id, &port);
            let response = to_owner(cluster, &Caller(owner), &node, record, req).await;
            // The cached owner is read again next time when it may be wrong now.
            if response.status() == StatusCode::NOT_FOUND || response.status().is_server_error() {
                cluster.membership.forget_owner(id);
            }
            response
        }
        Decision::Unavailable(Unavailable::OwnerAway(node)) => unavailable(format!(
            "the node that {ROLE} {id} ({node}) is restarting; try again shortly"
        )),
        Decision::Unavailable(Unavailable::OwnerGone(node)) => {
            unavailable(not_in_cluster(ROLE, id, &node))
        }
        _ => next.run(req).await,
    }
}

/// The request as the client sent it, naming its sandbox by headers (a host name of the
/// sandbox's does not survive forwarding), with envd's user kept.
fn as_sent(mut req: Request, id: &str, port: &str) -> Request {
    if let Some(Original(uri)) = req.extensions_mut().remove::<Original>() {
        *req.uri_mut() = uri;
    }
    let headers = req.headers_mut();
    if let Ok(value) = HeaderValue::from_str(id) {
        headers.insert(E2B_SANDBOX_ID, value);
    }
    if let Ok(value) = HeaderValue::from_str(port) {
        headers.insert(E2B_SANDBOX_PORT, value);
    }
    if let Some(user) = headers.remove(header::AUTHORIZATION) {
        headers.insert(FORWARDED_USER, user);
    }
    req
}

/// A sandbox-plane call another node forwarded here: its signature is checked against the
/// URI it was sent with, then it is served here (its token is checked by its handler).
pub(super) async fn forwarded(
    state: &AppState,
    cluster: &ClusterNode,
    mut req: Request,
    next: Next,
) -> Response {
    let rewritten = req.uri().clone();
    if let Some(Original(uri)) = req.extensions().get::<Original>() {
        *req.uri_mut() = uri.clone();
    }
    let mut req = match forwarded::checked_call(state, cluster, req).await {
        Ok(req) => req,
        Err(refused) => return refused,
    };
    if let Some(who) = req.extensions().get::<Forwarded>() {
        if !route::serves_forwarded(who.entry_registered, cluster.membership.registered()) {
            return unavailable(
                "this node is cut off from the cluster registry and takes no forwarded work now; try again shortly"
                    .into(),
            );
        }
    }
    *req.uri_mut() = rewritten;
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_planes_name_their_sandbox() {
        assert_eq!(sandbox_of("/sandboxes/abc-1"), Some("abc-1"));
        assert_eq!(sandbox_of("/sandboxes/abc-1/timeout"), Some("abc-1"));
        assert_eq!(sandbox_of("/v2/sandboxes/abc-1/connect"), Some("abc-1"));
        assert_eq!(sandbox_of("/.e2b/49983/abc-1/files"), Some("abc-1"));
        assert_eq!(sandbox_of("/.e2b/49999/abc-1/execute"), Some("abc-1"));
        assert_eq!(sandbox_of("/v2/sandboxes"), None);
        assert_eq!(sandbox_of("/sandboxes/"), None);
    }
}
