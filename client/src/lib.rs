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

/// Now, as Jupyter writes it in message headers: ISO 8601, UTC, microseconds, `Z`.
pub fn now_iso() -> String {
    chrono::Utc::now()
        .format("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string()
}
