//! `kernelgate mcp`: the MCP server over stdin/stdout, for hosts that launch a command.
//! The process is one session, whatever protocol version the host speaks: its kernel is
//! created on the first tool call and deleted at EOF.

use super::{Mcp, Session};
use crate::tenants::Tenant;
use rmcp::ServiceExt;
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum StdioError {
    #[error("the MCP host did not complete the handshake: {0}")]
    Handshake(Box<rmcp::service::ServerInitializeError>),
    #[error("the MCP session failed: {0}")]
    Session(#[from] tokio::task::JoinError),
}

/// Serves one session on stdin/stdout as `tenant` until the host closes stdin.
pub async fn serve(mcp: Arc<Mcp>, tenant: Arc<Tenant>) -> Result<(), StdioError> {
    let session = Session::stdio(mcp, tenant);
    let running = session
        .serve(rmcp::transport::stdio_pipes())
        .await
        .map_err(|e| StdioError::Handshake(Box::new(e)))?;
    let reason = running.waiting().await?;
    tracing::info!(?reason, "MCP host closed the session");
    Ok(())
}
