//! A client of a Kernelgate gateway, from outside: everything that talks to a gateway over
//! the network and depends on the wire formats alone (`kernelgate-protocol`), never on the
//! gateway's own code.
//!
//! By concern: [`gateway`] is the HTTP API (the token, the kernels REST API, the agent
//! API's execute in JSON and streamed as NDJSON, the files API); [`channels`] is one
//! session on a kernel's channels WebSocket; [`mcp`] is a minimal MCP session at `/mcp`;
//! [`serve`] starts a `kernelgate serve` of our
//! own on a free loopback port and waits until it listens; [`notebook`] is `kernelgate
//! run`, a notebook executed through a gateway.

pub mod channels;
pub mod gateway;
pub mod mcp;
pub mod notebook;
pub mod serve;

pub use channels::Channels;
pub use gateway::{Error, Gateway};
pub use serve::{LocalGateway, Output, Serve};

/// Resolves on Ctrl-C or SIGTERM: how `kernelgate serve` and `kernelgate run` are told to
/// stop.
pub async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            },
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}
