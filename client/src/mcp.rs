//! A minimal MCP client of a gateway's `/mcp` (Streamable HTTP, with sessions or, protocol
//! 2026-07-28, without): POST a JSON-RPC message, read the answer from the SSE stream. It is the least the transport asks, so what
//! it measures is the server; the bench and the cluster tests use it.

use crate::gateway::{Error, Gateway};
use reqwest::{Method, Response};
use serde_json::{json, Value};

/// The protocol version this client asks for in `initialize`.
pub const PROTOCOL: &str = "2025-11-25";
/// The protocol version of calls without a session.
pub const SESSIONLESS_PROTOCOL: &str = "2026-07-28";

/// One MCP session over Streamable HTTP.
#[derive(Debug, Clone)]
pub struct McpSession {
    gateway: Gateway,
    session: String,
    next_id: u64,
}

/// What went wrong in an MCP exchange.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    #[error(transparent)]
    Http(#[from] Error),
    #[error("initialize answered without an Mcp-Session-Id")]
    NoSession,
    #[error("the SSE stream ended without an answer")]
    NoAnswer,
    #[error("{0}")]
    Failed(String),
}

impl McpSession {
    /// `initialize` and `notifications/initialized` on `gateway`'s `/mcp`.
    pub async fn open(gateway: &Gateway) -> Result<McpSession, McpError> {
        let mut s = McpSession {
            gateway: gateway.clone(),
            session: String::new(),
            next_id: 0,
        };
        let init = json!({"protocolVersion": PROTOCOL, "capabilities": {},
                          "clientInfo": {"name": "kernelgate-client", "version": "1"}});
        let initialize = s.message("initialize", init);
        let response = s.post(&initialize, None).await?;
        s.session = response
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .ok_or(McpError::NoSession)?
            .to_owned();
        read_answer(response).await?;
        let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        let session = s.session.clone();
        s.post(&initialized, Some(&session)).await?;
        Ok(s)
    }

    /// The session's id (`Mcp-Session-Id`).
    pub fn id(&self) -> &str {
        &self.session
    }

    /// The same session, reached through another gateway (another node of a cluster).
    pub fn through(&self, gateway: &Gateway) -> McpSession {
        McpSession {
            gateway: gateway.clone(),
            ..self.clone()
        }
    }

    fn message(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        json!({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
    }

    async fn post(&self, body: &Value, session: Option<&str>) -> Result<Response, Error> {
        let mut r = self
            .gateway
            .request(Method::POST, "/mcp")
            .header("Accept", "application/json, text/event-stream")
            .header("MCP-Protocol-Version", PROTOCOL)
            .json(body);
        if let Some(id) = session {
            r = r.header("Mcp-Session-Id", id);
        }
        self.gateway.send(r).await
    }

    /// `tools/call` of `run_python`: the text of its last content (the result: IPython may
    /// warn before it).
    pub async fn run_python(&mut self, code: &str) -> Result<String, McpError> {
        let call = self.message(
            "tools/call",
            json!({"name": "run_python", "arguments": {"code": code}}),
        );
        let session = self.session.clone();
        let answer = read_answer(self.post(&call, Some(&session)).await?).await?;
        last_text(&answer["result"], "run_python")
    }

    /// Ends the session (`DELETE /mcp`); its kernel goes with it.
    pub async fn close(self) -> Result<(), Error> {
        let r = self
            .gateway
            .request(Method::DELETE, "/mcp")
            .header("Mcp-Session-Id", &self.session)
            .header("MCP-Protocol-Version", PROTOCOL);
        self.gateway.send(r).await.map(|_| ())
    }
}

/// The text of a tool result's last content (the result: IPython may warn before it).
fn last_text(result: &Value, tool: &str) -> Result<String, McpError> {
    if result["isError"] == json!(true) {
        return Err(McpError::Failed(format!("{tool} failed: {result}")));
    }
    let last = result["content"].as_array().and_then(|c| c.last());
    Ok(last
        .and_then(|c| c["text"].as_str())
        .unwrap_or_default()
        .to_owned())
}

/// MCP without a session (protocol 2026-07-28): each call stands alone, and a kernel from
/// `start_kernel` is named by its `kernel_id` in the calls after.
#[derive(Debug, Clone)]
pub struct McpCalls {
    gateway: Gateway,
    next_id: u64,
}

impl McpCalls {
    pub fn new(gateway: &Gateway) -> McpCalls {
        McpCalls {
            gateway: gateway.clone(),
            next_id: 0,
        }
    }

    /// The same client, calling another gateway (another node of a cluster).
    pub fn through(&self, gateway: &Gateway) -> McpCalls {
        McpCalls {
            gateway: gateway.clone(),
            next_id: self.next_id,
        }
    }

    /// `tools/call` of `tool`; its result (a tool error is a result with `isError`).
    pub async fn call_tool(&mut self, tool: &str, arguments: Value) -> Result<Value, McpError> {
        self.call(tool, arguments).await
    }

    /// `tools/call` of `tool`; its result.
    async fn call(&mut self, tool: &str, arguments: Value) -> Result<Value, McpError> {
        self.next_id += 1;
        let meta = json!({
            "io.modelcontextprotocol/protocolVersion": SESSIONLESS_PROTOCOL,
            "io.modelcontextprotocol/clientCapabilities": {},
        });
        let body = json!({"jsonrpc": "2.0", "id": self.next_id, "method": "tools/call",
                          "params": {"name": tool, "arguments": arguments, "_meta": meta}});
        let r = self
            .gateway
            .request(Method::POST, "/mcp")
            .header("Accept", "application/json, text/event-stream")
            .header("MCP-Protocol-Version", SESSIONLESS_PROTOCOL)
            .header("Mcp-Method", "tools/call")
            .header("Mcp-Name", tool)
            .json(&body);
        let answer = read_answer(self.gateway.send(r).await?).await?;
        if let Some(error) = answer.get("error") {
            return Err(McpError::Failed(format!("{tool}: {error}")));
        }
        Ok(answer["result"].clone())
    }

    /// `start_kernel`: the new kernel's id.
    pub async fn start_kernel(&mut self) -> Result<String, McpError> {
        let result = self.call("start_kernel", json!({})).await?;
        result["structuredContent"]["kernel_id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| McpError::Failed(format!("start_kernel answered {result}")))
    }

    /// `run_python` on kernel `kernel_id`: the text of its result.
    pub async fn run_python(&mut self, kernel_id: &str, code: &str) -> Result<String, McpError> {
        let result = self
            .call("run_python", json!({"code": code, "kernel_id": kernel_id}))
            .await?;
        last_text(&result, "run_python")
    }
}

/// The JSON-RPC answer in an SSE response (the first `data:` event that has an id).
async fn read_answer(mut response: Response) -> Result<Value, McpError> {
    let mut pending = String::new();
    while let Some(chunk) = response.chunk().await.map_err(Error::Read)? {
        pending.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = pending.find('\n') {
            let line: String = pending.drain(..=end).collect();
            if let Some(data) = line.trim_end().strip_prefix("data:") {
                if let Ok(message) = serde_json::from_str::<Value>(data.trim()) {
                    if message.get("id").is_some() {
                        return Ok(message);
                    }
                }
            }
        }
    }
    Err(McpError::NoAnswer)
}
