//! The cluster listener (`--cluster-listen`): the API as the other nodes call it, over
//! mutual TLS ([`crate::cluster::tls`]). A connection gets as far as HTTP only with a
//! client certificate signed by the cluster's CA; each request must be a forwarded call
//! whose entry node is the node that certificate names. Behind that, the same routes as
//! `--listen`, and the same checks of a forwarded call ([`crate::cluster::signing`]: its
//! signature for this node and run, its body's digest, no replay). With the cluster
//! listener on, `--listen` is for clients only: it refuses any request that says it was
//! forwarded.

use super::error::ApiError;
use super::AppState;
use crate::cluster::signing::{ENTRY_HEADER, HEADER_PREFIX};
use crate::cluster::tls;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::serve::ListenerExt;
use rustls::pki_types::CertificateDer;
use rustls::ServerConfig;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long a peer may take over its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Who is at the other end of a cluster listener's connection.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    /// Its certificate (the handshake checked that the cluster's CA signed it).
    cert: Option<Arc<CertificateDer<'static>>>,
}

/// Connections whose handshake went through, as the HTTP server takes them.
struct Handshaken {
    accepted: mpsc::Receiver<(TlsStream<TcpStream>, Peer)>,
    local: SocketAddr,
}

impl axum::serve::Listener for Handshaken {
    type Io = TlsStream<TcpStream>;
    type Addr = Peer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(accepted) => accepted,
            // The handshakes have stopped (shutdown): nothing more comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(Peer {
            addr: self.local,
            cert: None,
        })
    }
}

/// Accepts TCP connections and hands each to its own TLS handshake (a slow peer holds up
/// no other) until `cancel`.
async fn handshakes(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    accepted: mpsc::Sender<(TlsStream<TcpStream>, Peer)>,
    tracker: TaskTracker,
    cancel: CancellationToken,
) {
    loop {
        let (tcp, addr) = tokio::select! {
            _ = cancel.cancelled() => return,
            next = listener.accept() => match next {
                Ok(next) => next,
                Err(e) => {
                    tracing::debug!(error = %e, "cluster listener: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        let (acceptor, accepted) = (acceptor.clone(), accepted.clone());
        tracker.spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => {
                    let cert = stream
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|chain| chain.first())
                        .map(|cert| Arc::new(cert.clone().into_owned()));
                    let _ = accepted.send((stream, Peer { addr, cert })).await;
                }
                Ok(Err(e)) => {
                    tracing::warn!(peer = %addr, error = %e, "cluster listener: TLS handshake refused (a client certificate signed by the cluster's CA is needed)")
                }
                Err(_) => tracing::warn!(peer = %addr, "cluster listener: TLS handshake timed out"),
            }
        });
    }
}

/// Serves the calls other nodes forward on `listener`, over TLS with `config`, until
/// `state.cancel`; then lets open requests finish.
pub async fn serve(
    listener: TcpListener,
    config: Arc<ServerConfig>,
    state: AppState,
) -> std::io::Result<()> {
    let local = listener.local_addr()?;
    let (tx, rx) = mpsc::channel(64);
    let cancel = state.cancel.clone();
    state.tracker.spawn(handshakes(
        listener,
        TlsAcceptor::from(config),
        tx,
        state.tracker.clone(),
        cancel.clone(),
    ));
    let app = super::router(state)
        .layer(middleware::from_fn(only_nodes))
        .into_make_service_with_connect_info::<Peer>();
    let listener = Handshaken {
        accepted: rx,
        local,
    }
    .tap_io(|_| {});
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { cancel.cancelled().await })
        .await
}

fn refused(message: String) -> Response {
    ApiError::new(StatusCode::FORBIDDEN, message).into_response()
}

/// On the cluster listener: only forwarded calls, each from the node its client
/// certificate names.
async fn only_nodes(mut req: Request, next: Next) -> Response {
    let Some(ConnectInfo(peer)) = req.extensions().get::<ConnectInfo<Peer>>().cloned() else {
        return refused("a call without its TLS peer".into());
    };
    // The rest of the API knows callers by their socket address.
    req.extensions_mut().insert(ConnectInfo(peer.addr));
    let Some(entry) = req
        .headers()
        .get(ENTRY_HEADER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    else {
        return refused(
            "this is the cluster listener (--cluster-listen), for calls between the cluster's \
             nodes; clients use the gateway's --listen address"
                .into(),
        );
    };
    if !peer.cert.is_some_and(|cert| tls::names(&cert, &entry)) {
        tracing::warn!(peer = %peer.addr, entry = %entry, "cluster listener: a forwarded call whose client certificate does not name its entry node");
        return refused(format!(
            "the client certificate does not name node {entry:?}, the node this call says it \
             comes from: each node calls with its own certificate"
        ));
    }
    next.run(req).await
}

/// On `--listen` while the cluster listener is on: no request that says it was forwarded
/// (forwarded calls come only over TLS, from a node that proved who it is). Refused as any
/// client's internal headers are: counted against the address's failed authentications and
/// audited once a minute (docs/audit.md).
pub async fn no_forwarded_calls(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    if req
        .headers()
        .keys()
        .any(|name| name.as_str().starts_with(HEADER_PREFIX))
    {
        return super::auth::refuse_internal(
            &state,
            &req,
            "calls between the cluster's nodes come on the cluster listener (--cluster-listen), \
             over TLS; this address is for clients, whose requests carry no x-kernelgate-* header"
                .into(),
        )
        .await;
    }
    next.run(req).await
}
