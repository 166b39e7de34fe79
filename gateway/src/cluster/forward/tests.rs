//! Forwarding between nodes, against real listeners on loopback: signed calls and
//! WebSockets reach the owner, refusals and departures are answered as they happen.

use super::*;
use crate::cluster::signing::{body_digest, CHALLENGE_HEADER, KEY_HEADER, SIGNATURE_HEADER};
use axum::extract::ws::{Message as WsFrame, WebSocketUpgrade};
use axum::routing::{any, get, post};
use axum::Router;
use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message as ClientFrame;

const SUBPROTOCOL: &str = "v1.kernel.websocket.jupyter.org";
const OWNER: &str = "owner-1";
const RUN: &str = "run-1";
const MAX_BODY: usize = 4 << 20;

/// A signer of the cluster with `secret`, as the owner has it.
fn signer_of(secret: &[u8]) -> Arc<Signer> {
    Arc::new(Signer::new(secret, OWNER, RUN))
}

async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router).await });
    format!("http://{addr}")
}

/// An owner that echoes what it got: headers, a streamed body, WebSocket frames (only
/// with a signature, choosing the v1 subprotocol when offered, as the gateway does).
async fn owner(signer: Arc<Signer>) -> String {
    let headers = get(|h: HeaderMap| async move {
        let mut names: Vec<String> = h.keys().map(|k| k.to_string()).collect();
        names.sort();
        axum::Json(serde_json::json!({
            "names": names, "key": h.get(KEY_HEADER).and_then(|v| v.to_str().ok()),
        }))
    });
    let stream = post(|body: Body| async move {
        let lines = body.into_data_stream().map_ok(|chunk| {
            let mut line = chunk.to_vec();
            line.push(b'\n');
            bytes::Bytes::from(line)
        });
        Body::from_stream(lines)
    });
    let checked = signer.clone();
    let digest = post(move |h: HeaderMap, req: Request| {
        let signer = checked.clone();
        async move {
            let path = req.uri().path().to_owned();
            let body = axum::body::to_bytes(req.into_body(), usize::MAX)
                .await
                .unwrap_or_default();
            let now = chrono::Utc::now().timestamp();
            let taken = signer
                .verify("POST", &path, &h, now)
                .and_then(|c| signer.accept(c, &body_digest(&body), now));
            match taken {
                Ok(_) => (axum::http::StatusCode::OK, body.len().to_string()).into_response(),
                Err(e) => (axum::http::StatusCode::FORBIDDEN, e.to_string()).into_response(),
            }
        }
    });
    let ws = any(move |h: HeaderMap, req: Request| {
        let signer = signer.clone();
        async move {
            let path = req.uri().path().to_owned();
            let now = chrono::Utc::now().timestamp();
            let Ok(who) = signer
                .verify("GET", &path, &h, now)
                .and_then(|c| signer.accept(c, &body_digest(b""), now))
            else {
                return axum::http::StatusCode::FORBIDDEN.into_response();
            };
            let challenge = Signer::challenge();
            let (mut parts, _) = req.into_parts();
            let Ok(upgrade) = WebSocketUpgrade::from_request_parts(&mut parts, &()).await else {
                return axum::http::StatusCode::BAD_REQUEST.into_response();
            };
            let answered = challenge.clone();
            let mut response =
                upgrade
                    .protocols([SUBPROTOCOL])
                    .on_upgrade(move |mut socket| async move {
                        // Served only once the entry node answers the challenge.
                        let proved = match socket.recv().await {
                            Some(Ok(WsFrame::Text(t))) => {
                                signer.proves(&who.nonce, &answered, t.as_str())
                            }
                            _ => false,
                        };
                        if !proved {
                            return;
                        }
                        while let Some(Ok(frame)) = socket.recv().await {
                            if matches!(frame, WsFrame::Close(_))
                                || socket.send(frame).await.is_err()
                            {
                                break;
                            }
                        }
                    });
            response.headers_mut().insert(
                CHALLENGE_HEADER,
                HeaderValue::from_str(&challenge).expect("hex"),
            );
            response
        }
    });
    serve(
        Router::new()
            .route("/headers", headers)
            .route("/stream", stream)
            .route("/digest", digest)
            .route("/ws", ws),
    )
    .await
}

use axum::extract::FromRequestParts;
use axum::response::IntoResponse;

/// An entry node that forwards everything to `owner` as key `alice`.
async fn entry(signer: Arc<Signer>, owner: String) -> String {
    entry_watching(signer, owner, never_left()).await
}

/// [`entry`], with calls that end when `left` resolves.
async fn entry_watching(signer: Arc<Signer>, owner: String, left: Left) -> String {
    let forwarder = Arc::new(
        Forwarder::new(
            signer,
            "entry-1",
            TaskTracker::new(),
            CancellationToken::new(),
        )
        .expect("forwarder")
        .bounded(MAX_BODY),
    );
    let to = Destination {
        node: OWNER.into(),
        incarnation: RUN.into(),
        address: owner,
        cluster_address: None,
    };
    let router = Router::new().fallback(move |mut req: Request| {
        let (forwarder, to, left) = (forwarder.clone(), to.clone(), left.clone());
        async move {
            strip_internal(req.headers_mut());
            match forwarder.forward(&to, "alice", true, req, left).await {
                Ok(r) => r.into_response(),
                Err(e @ ForwardError::TooLarge { .. }) => {
                    (axum::http::StatusCode::PAYLOAD_TOO_LARGE, e.to_string()).into_response()
                }
                Err(e) => {
                    (axum::http::StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response()
                }
            }
        }
    });
    serve(router).await
}

#[tokio::test]
async fn requests_and_websockets_reach_the_owner_signed_and_without_credentials() {
    let signer = signer_of(b"secret");
    let owner_url = owner(signer.clone()).await;
    let entry_url = entry(signer.clone(), owner_url).await;
    let http = reqwest::Client::new();

    // Credentials and forged internal headers stay at the entry; the signed ones arrive.
    let seen: serde_json::Value = http
        .get(format!("{entry_url}/headers?token=t0ken&x=1"))
        .header("Authorization", "token t0ken")
        .header(KEY_HEADER, "admin")
        .header(SIGNATURE_HEADER, "forged")
        .send()
        .await
        .expect("forwarded")
        .json()
        .await
        .expect("json");
    assert_eq!(seen["key"], "alice", "{seen}");
    let names = seen["names"].to_string();
    assert!(!names.contains("authorization"), "{names}");
    assert!(names.contains("x-kernelgate-signature"), "{names}");

    // A streamed body goes through in both directions.
    let body = http
        .post(format!("{entry_url}/stream"))
        .body("line one")
        .send()
        .await
        .expect("forwarded")
        .text()
        .await
        .expect("text");
    assert_eq!(body, "line one\n");

    // Bodies signed with their digest: a small one from memory, one past IN_MEMORY from
    // its temporary file; one past the bound is refused at the entry.
    for len in [10, IN_MEMORY + 12_345] {
        let body: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let answer = http
            .post(format!("{entry_url}/digest"))
            .body(body)
            .send()
            .await
            .expect("forwarded");
        assert_eq!(answer.status().as_u16(), 200, "{len} bytes");
        assert_eq!(answer.text().await.expect("text"), len.to_string());
    }
    let answer = http
        .post(format!("{entry_url}/digest"))
        .body(vec![0u8; MAX_BODY + 1])
        .send()
        .await
        .expect("answered");
    assert_eq!(answer.status().as_u16(), 413);

    // A WebSocket: the owner's 101 with its subprotocol; text and binary frames intact.
    let (mut ws, response) = websocket_through(&entry_url).await;
    assert_eq!(
        response
            .headers()
            .get("sec-websocket-protocol")
            .map(|v| v.as_bytes()),
        Some(SUBPROTOCOL.as_bytes())
    );
    let binary = vec![0u8, 159, 146, 150, 255];
    ws.send(ClientFrame::text("héllo")).await.expect("send");
    ws.send(ClientFrame::binary(binary.clone()))
        .await
        .expect("send");
    let first = ws.next().await.expect("echo").expect("frame");
    let second = ws.next().await.expect("echo").expect("frame");
    assert_eq!(first, ClientFrame::text("héllo"));
    assert_eq!(second, ClientFrame::binary(binary));
}

#[tokio::test]
async fn an_owner_that_refuses_the_upgrade_is_answered_as_it_is_and_a_dead_one_is_unreachable() {
    let signer = signer_of(b"secret");
    let owner_url = owner(signer_of(b"another secret")).await;
    let entry_url = entry(signer, owner_url).await;
    let request = format!("{}/ws", entry_url.replace("http://", "ws://"))
        .into_client_request()
        .expect("request");
    match tokio_tungstenite::connect_async(request).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => {
            assert_eq!(r.status().as_u16(), 403, "the owner's refusal")
        }
        other => panic!("expected the owner's 403, got {other:?}"),
    }
    // Nothing listens on the owner's address any more.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let entry_url = entry(signer_of(b"s"), format!("http://127.0.0.1:{port}")).await;
    let r = reqwest::get(format!("{entry_url}/headers"))
        .await
        .expect("answer");
    assert_eq!(r.status().as_u16(), 503);
}

/// A WebSocket to the owner's `/ws`, through the entry node at `entry_url`, asking for
/// the Jupyter subprotocol.
async fn websocket_through(
    entry_url: &str,
) -> (
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
    tokio_tungstenite::tungstenite::handshake::client::Response,
) {
    let mut request = format!("{}/ws", entry_url.replace("http://", "ws://"))
        .into_client_request()
        .expect("request");
    request.headers_mut().insert(
        "sec-websocket-protocol",
        HeaderValue::from_static(SUBPROTOCOL),
    );
    tokio_tungstenite::connect_async(request)
        .await
        .expect("the upgrade goes through")
}

/// A `Left` and the switch that fires it.
fn switch() -> (tokio::sync::oneshot::Sender<()>, Left) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    (
        tx,
        async move {
            let _ = rx.await;
        }
        .boxed()
        .shared(),
    )
}

/// A TLS listener that shows `tls`'s certificate and keeps what it reads after a
/// handshake: (its address, connections, bytes read).
async fn planted(
    tls: &ClusterTls,
) -> (
    std::net::SocketAddr,
    Arc<std::sync::atomic::AtomicUsize>,
    Arc<Mutex<Vec<u8>>>,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config().expect("config"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let read = Arc::new(Mutex::new(Vec::new()));
    let (counted, kept) = (connections.clone(), read.clone());
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let (acceptor, kept) = (acceptor.clone(), kept.clone());
            tokio::spawn(async move {
                let Ok(mut stream) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = stream.read(&mut buf).await {
                    kept.lock().expect("lock").extend_from_slice(&buf[..n]);
                }
            });
        }
    });
    (addr, connections, read)
}

#[tokio::test]
async fn with_tls_a_server_that_is_not_the_owner_gets_no_byte_of_a_call_or_an_upgrade() {
    let ca = crate::cluster::tls::tests::Ca::new();
    let forwarder = Forwarder::new(
        Arc::new(Signer::new(b"secret", "node-1", "i0")),
        "node-1",
        TaskTracker::new(),
        CancellationToken::new(),
    )
    .expect("forwarder")
    .with_tls(Some(Arc::new(ca.tls("node-1"))));
    // The registry says node-2 is there; what answers shows node-3's certificate.
    let (addr, connections, read) = planted(&ca.tls("node-3")).await;
    let record = |cluster_address: Option<String>| NodeRecord {
        address: format!("http://{addr}"),
        cluster_address,
        incarnation: "i1".into(),
        capacity: 1,
        load: 0,
        version: String::new(),
        specs: Vec::new(),
        warm: Default::default(),
        away: false,
        indexed: true,
    };
    let planted = Destination::of("node-2", &record(Some(format!("https://{addr}"))));
    let call = || {
        axum::http::Request::builder()
            .method("POST")
            .uri("/api/kernels/k/execute")
            .body(Body::from("print('pwned')"))
            .expect("request")
    };
    let upgrade = || {
        axum::http::Request::builder()
            .uri("/api/kernels/k/channels")
            .header("connection", "Upgrade")
            .header("upgrade", "websocket")
            .body(Body::empty())
            .expect("request")
    };
    for req in [call(), upgrade()] {
        let answer = forwarder
            .forward(&planted, "alice", true, req, never_left())
            .await;
        match answer {
            Err(ForwardError::Unreachable { node, reason, .. }) => {
                assert_eq!(node, "node-2");
                assert!(reason.contains("certificate"), "{reason}");
            }
            other => panic!("expected node-2 unreachable, got {other:?}"),
        }
    }
    assert_eq!(connections.load(std::sync::atomic::Ordering::SeqCst), 2);
    // A record without a cluster address: not called at all, not even in clear.
    let plain = Destination::of("node-2", &record(None));
    let answer = forwarder
        .forward(&plain, "alice", true, call(), never_left())
        .await;
    assert!(
        matches!(answer, Err(ForwardError::Unreachable { .. })),
        "{answer:?}"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(connections.load(std::sync::atomic::Ordering::SeqCst), 2);
    let read = read.lock().expect("lock");
    assert!(read.is_empty(), "{:?}", String::from_utf8_lossy(&read));
}

#[tokio::test]
async fn calls_and_websockets_end_when_their_owner_leaves_the_cluster() {
    // An owner partitioned away: connections open, nothing ever answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let silent_url = format!("http://{}", silent.local_addr().expect("addr"));
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let signer = signer_of(b"secret");
    let (leave, left) = switch();
    let entry_url = entry_watching(signer.clone(), silent_url, left).await;
    let call = tokio::spawn(reqwest::get(format!("{entry_url}/headers")));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !call.is_finished(),
        "waits while the owner is in the cluster"
    );
    let _ = leave.send(());
    let answer = call.await.expect("task").expect("an answer");
    assert_eq!(answer.status().as_u16(), 503);
    let text = answer.text().await.expect("text");
    assert!(text.contains("left the cluster"), "{text}");

    // A spliced WebSocket whose owner leaves: the client hears 1001, going away.
    let owner_url = owner(signer.clone()).await;
    let (leave, left) = switch();
    let entry_url = entry_watching(signer, owner_url, left).await;
    let (mut ws, _) = websocket_through(&entry_url).await;
    ws.send(ClientFrame::text("still here"))
        .await
        .expect("send");
    assert_eq!(
        ws.next().await.expect("echo").expect("frame"),
        ClientFrame::text("still here")
    );
    let _ = leave.send(());
    match ws.next().await {
        Some(Ok(ClientFrame::Close(Some(close)))) => {
            assert_eq!(u16::from(close.code), 1001)
        }
        other => panic!("expected a close frame with 1001, got {other:?}"),
    }
}
