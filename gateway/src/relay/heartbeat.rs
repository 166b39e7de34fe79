//! The heartbeat: a REQ socket that sends bytes and expects them echoed. Spec: "Heartbeat
//! for kernels" in the messaging doc. A fresh socket per probe, because a REQ that missed
//! its reply is stuck in the wrong state (and zeromq-rs does not reconnect it).

use kernelgate_protocol::{Channel, ConnectionInfo};
use std::time::Duration;
use zeromq::{ReqSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

/// True when the kernel echoed within `timeout`.
pub async fn probe(info: &ConnectionInfo, timeout: Duration) -> bool {
    let endpoint = info.endpoint(Channel::Heartbeat);
    let mut options = SocketOptions::default();
    options.connect_timeout(timeout);
    let mut req = ReqSocket::with_options(options);
    let payload = uuid::Uuid::new_v4().simple().to_string();
    let round_trip = async {
        req.connect(&endpoint).await.ok()?;
        req.send(ZmqMessage::from(payload.clone())).await.ok()?;
        let reply = req.recv().await.ok()?;
        Some(reply.get(0).map(|b| b.as_ref()) == Some(payload.as_bytes()))
    };
    matches!(
        tokio::time::timeout(timeout, round_trip).await,
        Ok(Some(true))
    )
}
