//! Every error a client meets is JSON `{"reason", "message"}` whose message says what to
//! do: axum's own answers (unknown route, wrong method), bad bodies, the URL and header
//! limits, and the MCP transport's errors at `/mcp`. One gateway, no kernel needed.

use anyhow::Result;
use kernelgate_tests::Gateway;
use reqwest::{Method, StatusCode};
use serde_json::Value;

/// The status and the error body of an answer, checked to be `{"reason", "message"}` JSON
/// with the status's reason phrase.
async fn error_of(
    response: reqwest::Response,
) -> Result<(StatusCode, String, reqwest::header::HeaderMap)> {
    let status = response.status();
    let headers = response.headers().clone();
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = response.text().await?;
    assert_eq!(content_type, "application/json", "{status}: {text}");
    let body: Value = serde_json::from_str(&text)?;
    let object = body.as_object().expect("an object");
    assert_eq!(object.len(), 2, "{body}");
    assert_eq!(
        body["reason"].as_str(),
        status.canonical_reason(),
        "{status}: {body}"
    );
    let message = body["message"].as_str().expect("a message").to_owned();
    assert!(!message.is_empty());
    Ok((status, message, headers))
}

const MCP_ACCEPT: &str = "application/json, text/event-stream";

#[tokio::test]
async fn every_error_is_json_that_says_what_to_do() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let kernel = uuid::Uuid::new_v4();
    let execute = format!("/api/kernels/{kernel}/execute");

    // An unknown route.
    let (status, message, _) = error_of(gw.request(Method::GET, "/api/nope").send().await?).await?;
    assert_eq!(status, 404);
    assert!(
        message.contains("/api/nope") && message.contains("/api/openapi.json"),
        "{message}"
    );

    // A method the route does not take: the allowed ones named, `Allow` kept.
    let (status, message, headers) =
        error_of(gw.request(Method::PUT, "/api/kernels").send().await?).await?;
    assert_eq!(status, 405);
    assert_eq!(headers["allow"], "GET,HEAD,POST");
    assert_eq!(
        message,
        "PUT is not allowed on /api/kernels; use GET, HEAD or POST (see GET /api/openapi.json)"
    );

    // A body that is not JSON, sent as something else.
    let (status, message, _) = error_of(
        gw.request(Method::POST, &execute)
            .header("content-type", "text/plain")
            .body("print(1)")
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, 400);
    assert!(
        message.starts_with("the body is not valid JSON (expected value at line 1, column 1)")
            && message.contains("Content-Type: application/json"),
        "{message}"
    );

    // A misspelt field is named, not ignored (it would have meant a 300 s timeout).
    let (status, message, _) = error_of(
        gw.request(Method::POST, &execute)
            .json(&serde_json::json!({"code": "1", "timout": 5}))
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, 400);
    assert!(
        message.starts_with(
            "unknown field `timout` in the body: the fields are `code`, `timeout`, `agent_id`, `plain`"
        ),
        "{message}"
    );

    // A value of the wrong type names its field.
    let (status, message, _) = error_of(
        gw.request(Method::POST, &execute)
            .json(&serde_json::json!({"code": "1", "timeout": "5"}))
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, 400);
    assert!(
        message.starts_with("`timeout`: a number expected, got a string"),
        "{message}"
    );

    // A timeout out of range reads as the rule it breaks.
    for timeout in [0.0, -1.0, 86_400.5] {
        let (status, message, _) = error_of(
            gw.request(Method::POST, &execute)
                .json(&serde_json::json!({"code": "1", "timeout": timeout}))
                .send()
                .await?,
        )
        .await?;
        assert_eq!(status, 400);
        assert!(
            message.starts_with(&format!(
                "timeout must be more than 0 and at most 86400 seconds, not {timeout}"
            )),
            "{message}"
        );
    }

    // Names are shown as written, not in Rust's quoted form.
    let (status, message, _) = error_of(
        gw.request(Method::POST, "/api/kernels")
            .json(&serde_json::json!({"name": "nope"}))
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, 404);
    assert_eq!(
        message,
        "no kernel spec named `nope`; this gateway offers python3"
    );

    // The channels WebSocket, asked without an upgrade.
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let (status, message, _) = error_of(
        gw.request(Method::GET, &format!("/api/kernels/{id}/channels"))
            .send()
            .await?,
    )
    .await?;
    assert!(status.is_client_error(), "{status}");
    assert!(
        message.contains("open it with a WebSocket client"),
        "{message}"
    );
    // A file path with a control character is shown as it was written in the URL.
    let (status, message, _) = error_of(
        gw.request(Method::GET, &format!("/api/kernels/{id}/files/a%00b"))
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, 400);
    assert!(message.starts_with("a%00b: "), "{message}");
    gw.delete_kernel(&id).await?;

    // A URL over 16 KiB (hyper's own limit is 64 KiB), headers over 64 KiB together.
    let long = format!("/api/kernels?x={}", "a".repeat(17 * 1024));
    let (status, message, _) = error_of(gw.request(Method::GET, &long).send().await?).await?;
    assert_eq!(status, 414);
    assert!(message.contains("at most 16384"), "{message}");
    let (status, message, _) = error_of(
        gw.request(Method::GET, "/api/kernels")
            .header("cookie", "c".repeat(65 * 1024))
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, 431);
    assert!(
        message.contains("the largest is cookie") && message.contains("at most 65536"),
        "{message}"
    );

    // /mcp: a body that is not JSON is a 400 (rmcp's 415 means a wrong Content-Type).
    let mcp = |body: &'static str| {
        gw.request(Method::POST, "/mcp")
            .header("accept", MCP_ACCEPT)
            .header("content-type", "application/json")
            .body(body)
    };
    let (status, message, _) = error_of(mcp("{not json").send().await?).await?;
    assert_eq!(status, 400);
    assert!(
        message.starts_with("the body is not a JSON-RPC message (key must be a string"),
        "{message}"
    );
    let (status, message, _) = error_of(mcp("{}").send().await?).await?;
    assert_eq!(status, 400);
    assert!(
        message.starts_with("the body is not a JSON-RPC message"),
        "{message}"
    );
    // A wrong Content-Type, a wrong Accept, an unknown session, a wrong method.
    let (status, message, _) = error_of(
        gw.request(Method::POST, "/mcp")
            .header("accept", MCP_ACCEPT)
            .header("content-type", "text/plain")
            .body("{}")
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, 415);
    assert!(
        message.contains("Content-Type: application/json"),
        "{message}"
    );
    let ping = r#"{"jsonrpc": "2.0", "id": 1, "method": "ping"}"#;
    let (status, message, _) = error_of(
        gw.request(Method::POST, "/mcp")
            .header("accept", "application/json")
            .header("content-type", "application/json")
            .body(ping)
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, 406);
    assert!(
        message.contains("Accept: application/json, text/event-stream"),
        "{message}"
    );
    let (status, message, _) = error_of(
        mcp(ping)
            .header("mcp-session-id", "no-such-session")
            .header("mcp-protocol-version", "2025-11-25")
            .send()
            .await?,
    )
    .await?;
    assert_eq!(status, 404);
    assert!(
        message.contains("start a new one with `initialize`"),
        "{message}"
    );
    let (status, message, headers) =
        error_of(gw.request(Method::PUT, "/mcp").send().await?).await?;
    assert_eq!(status, 405);
    assert_eq!(headers["allow"], "GET, POST, DELETE");
    assert_eq!(
        message,
        "PUT is not allowed on /mcp; use GET, POST or DELETE"
    );

    // A JSON-RPC answer passes untouched, error or not.
    let initialize = r#"{"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "errors", "version": "1"}}}"#;
    let opened = mcp(initialize).send().await?;
    assert_eq!(opened.status(), 200);
    assert!(opened.headers()["content-type"]
        .to_str()?
        .starts_with("text/event-stream"));
    let session = opened.headers()["mcp-session-id"].to_str()?.to_owned();
    let events = opened.text().await?;
    assert!(
        events.contains(r#""protocolVersion":"2025-11-25""#),
        "{events}"
    );
    let closed = gw
        .request(Method::DELETE, "/mcp")
        .header("mcp-session-id", &session)
        .header("mcp-protocol-version", "2025-11-25")
        .send()
        .await?;
    assert_eq!(closed.status(), 204);
    Ok(())
}

/// SIGTERM while an agent API call runs: the call answers at once with a
/// `GatewayShutdown` error (not after its timeout: the shutdown waits for open requests),
/// and the gateway removes the kernel and exits.
#[tokio::test]
async fn a_run_in_flight_at_shutdown_says_so_and_the_kernel_is_removed() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let id = gw.create_kernel().await?["id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let call = gw
        .request(Method::POST, &format!("/api/kernels/{id}/execute"))
        .json(&serde_json::json!({"code": "import time\nprint('started', flush=True)\ntime.sleep(120)"}))
        .send();
    let call = tokio::spawn(call);
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let started = std::time::Instant::now();
    let exit = gw.stop().await?;
    assert!(exit.success(), "{exit}");
    assert!(started.elapsed().as_secs() < 20, "{:?}", started.elapsed());
    let answer: Value = call.await??.json().await?;
    assert_eq!(answer["status"], "error", "{answer}");
    assert_eq!(answer["error"]["ename"], "GatewayShutdown", "{answer}");
    assert_eq!(answer["stdout"], "started\n", "{answer}");
    assert!(
        kernelgate_tests::inspect(&id).is_err(),
        "the kernel's container is removed at shutdown"
    );
    Ok(())
}
