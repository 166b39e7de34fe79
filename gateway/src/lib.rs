//! Kernelgate: a Jupyter kernel gateway whose kernels each run in their own locked-down
//! container.
//!
//! - [`relay`] owns ZeroMQ: the sockets to one kernel, heartbeat, and the per-kernel
//!   session state that routes messages to clients.
//! - [`backend`] owns containers: where kernels run.
//! - [`api`] owns HTTP and WebSockets: Jupyter Server's kernel REST API and channels.
//! - [`images`] keeps kernel images without Docker: unpacked root filesystems and configs.
//! - [`kernels`] ties them together: the table of live kernels, their lifecycle and limits.

pub mod api;
pub mod audit;
pub mod backend;
pub mod cluster;
pub mod config;
#[cfg(test)]
mod generated_docs;
pub mod images;
pub mod kernels;
pub mod kernelspecs;
pub mod mcp;
pub mod metrics;
pub mod packages;
pub mod policy;
pub mod relay;
pub mod silent;
pub mod tenants;
pub mod text;
pub use kernelgate_protocol::time;
