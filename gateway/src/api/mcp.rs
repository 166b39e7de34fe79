//! `/mcp`: the MCP server's Streamable HTTP endpoint ([`crate::mcp::http`]), behind the
//! same token and Origin checks as the rest of the API.

use super::auth::Caller;
use super::AppState;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;

pub async fn serve(State(state): State<AppState>, caller: Caller, req: Request) -> Response<Body> {
    state.mcp.serve(&caller.0, req).await
}
