//! A call another node forwarded, checked before any handler runs: the cluster decides
//! where a request is served (`cluster::route`), and the node it is forwarded to checks that
//! the call is one a node of the cluster signed for it.

use super::super::auth::{client_addr, refuse_internal, Caller};
use super::super::error::ApiError;
use super::super::AppState;
use crate::audit::Record;
use crate::cluster::node::ClusterNode;
use crate::cluster::signing::{body_digest, SignatureError};
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// A call another node forwarded: its headers are checked (the cluster secret, this node
/// as the destination, the window, this node's start), then its body against the digest it
/// was signed with (read whole here, at most `--max-message-mb`, as every handler reads it:
/// no handler runs before it matches, so a mismatched upload writes nothing), then that it
/// was not seen before; the key it names must be a key of this node's own keys file. One
/// that fails is refused ([`refuse_internal`]); one signed for this node's previous run by a
/// node whose view is behind is answered 503, to retry.
pub(in crate::api) async fn forwarded_call(
    state: &AppState,
    cluster: &ClusterNode,
    req: Request,
    next: Next,
) -> Result<Response, Response> {
    let req = checked_call(state, cluster, req).await?;
    Ok(next.run(req).await)
}

/// [`forwarded_call`]'s checks: the request, with whose call it is, or the refusal.
pub(super) async fn checked_call(
    state: &AppState,
    cluster: &ClusterNode,
    req: Request,
) -> Result<Request, Response> {
    const ONLY_NODES: &str = "x-kernelgate-* headers are for calls between the cluster's nodes";
    let path = req
        .uri()
        .path_and_query()
        .map_or_else(|| req.uri().path().to_owned(), |p| p.as_str().to_owned());
    let checked = cluster.signer.verify(
        req.method().as_str(),
        &path,
        req.headers(),
        chrono::Utc::now().timestamp(),
    );
    let checked = match checked {
        Ok(checked) => checked,
        Err(e @ SignatureError::OldIncarnation) => {
            tracing::info!(client = ?client_addr(&req), "{e}; answered with a retry");
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "this node has just restarted and the node that forwarded the request has not seen it yet; try again shortly",
            )
            .retry_after(1)
            .into_response());
        }
        Err(e) => return Err(refuse_internal(state, &req, format!("{e}: {ONLY_NODES}")).await),
    };
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, state.max_message_bytes).await {
        Ok(bytes) => bytes,
        Err(_) => {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "a forwarded body is at most {} bytes (--max-message-mb), or it was cut short",
                    state.max_message_bytes
                ),
            )
            .into_response())
        }
    };
    let req = Request::from_parts(parts, axum::body::Body::from(bytes.clone()));
    let who = match cluster.signer.accept(
        checked,
        &body_digest(&bytes),
        chrono::Utc::now().timestamp(),
    ) {
        Ok(who) => who,
        Err(e) => return Err(refuse_internal(state, &req, format!("{e}: {ONLY_NODES}")).await),
    };
    let Some(tenant) = state.keys.tenant_named(&who.key) else {
        let why = format!(
            "the key {:?} is not in this node's keys file; every node must load the same file",
            who.key
        );
        return Err(refuse_internal(state, &req, why).await);
    };
    let mut req = req;
    state
        .kernels
        .audit()
        .record(&Record::ForwardedCall {
            key: who.key.clone(),
            entry: who.entry.clone(),
            request_id: who.request_id.clone(),
            method: req.method().as_str().to_owned(),
            path: req.uri().path().to_owned(),
        })
        .await;
    req.extensions_mut().insert(tenant.clone());
    req.extensions_mut().insert(Caller(tenant));
    req.extensions_mut().insert(who);
    Ok(req)
}
