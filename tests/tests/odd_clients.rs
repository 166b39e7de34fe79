//! End to end: clients whose messages jupyter_server accepts although they are sparse or
//! loosely typed get the same result here, over both WebSocket encodings: a message that
//! names no channel goes to shell, and header fields of the wrong type are normalised
//! (never dropped).

use anyhow::{bail, Result};
use futures::future::BoxFuture;
use kernelgate_tests::{Client, Gateway};
use serde_json::{json, Value};
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message as WsMessage;

/// A v1 frame (`v1.kernel.websocket.jupyter.org`) built by hand, so its parts can hold
/// what a typed encoder would never write.
fn v1_frame(channel: &str, header: &Value, content: &Value) -> Vec<u8> {
    let parts: Vec<Vec<u8>> = vec![
        channel.as_bytes().to_vec(),
        header.to_string().into_bytes(),
        b"{}".to_vec(),
        b"{}".to_vec(),
        content.to_string().into_bytes(),
    ];
    let count = parts.len() + 1;
    let mut offset = 8 * (count + 1);
    let mut frame = (count as u64).to_le_bytes().to_vec();
    frame.extend_from_slice(&(offset as u64).to_le_bytes());
    for p in &parts {
        offset += p.len();
        frame.extend_from_slice(&(offset as u64).to_le_bytes());
    }
    frame.extend(parts.concat());
    frame
}

/// Sends an execute_request with this header and no channel (legacy: no `channel` field;
/// v1: an empty channel part).
async fn send_without_channel(c: &mut Client, header: Value, code: &str) -> Result<()> {
    let content = json!({"code": code, "silent": false, "store_history": true,
                         "user_expressions": {}, "allow_stdin": false, "stop_on_error": true});
    let frame = if c.v1 {
        WsMessage::Binary(v1_frame("", &header, &content).into())
    } else {
        let m = json!({"header": header, "parent_header": {}, "metadata": {}, "content": content});
        WsMessage::Text(m.to_string().into())
    };
    c.send_raw(frame).await
}

/// The execute_reply answering the request whose code printed `marker`, found by its
/// output (the client may not know the id the gateway gave it).
async fn reply_after(c: &mut Client, marker: &str) -> Result<Value> {
    let out = c
        .wait_for(Duration::from_secs(30), |m| {
            m["msg_type"] == "stream" && m["content"]["text"].as_str() == Some(marker)
        })
        .await?;
    let parent = out["parent_header"]["msg_id"].clone();
    let reply = c
        .wait_for(Duration::from_secs(30), |m| {
            m["msg_type"] == "execute_reply" && m["parent_header"]["msg_id"] == parent
        })
        .await?;
    if reply["channel"] != "shell" {
        bail!("reply on {}: {reply}", reply["channel"]);
    }
    Ok(reply)
}

/// Runs `check` on a fresh kernel once per encoding.
async fn on_both_encodings(check: impl Fn(Client) -> BoxFuture<'static, Result<()>>) -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let kernel = gw.create_kernel().await?;
    let id = kernel["id"].as_str().unwrap_or_default();
    for (session, subprotocol) in [
        ("legacy", None),
        ("v1", Some(kernelgate_protocol::websocket::V1_SUBPROTOCOL)),
    ] {
        let c = gw.channels_with(id, session, subprotocol).await?;
        assert_eq!(c.v1, subprotocol.is_some());
        check(c).await.map_err(|e| e.context(session))?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_channel_goes_to_shell() -> Result<()> {
    on_both_encodings(|mut c| {
        Box::pin(async move {
            let header = json!({"msg_id": uuid::Uuid::new_v4().to_string(),
                "msg_type": "execute_request", "session": c.session, "username": "odd",
                "date": "2026-01-01T00:00:00Z", "version": "5.3"});
            let marker = format!("no channel ({})\n", c.session);
            send_without_channel(
                &mut c,
                header.clone(),
                &format!("print({marker:?}, end='')"),
            )
            .await?;
            let reply = reply_after(&mut c, &marker).await?;
            assert_eq!(reply["content"]["status"], "ok", "{reply}");
            assert_eq!(reply["parent_header"]["msg_id"], header["msg_id"]);
            Ok(())
        })
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_fields_of_the_wrong_type_are_normalised() -> Result<()> {
    on_both_encodings(|mut c| {
        Box::pin(async move {
            // What a careless client might send: numbers, null, a list, no msg_id.
            let header = json!({"msg_type": "execute_request", "date": 1767225600,
                "session": null, "username": ["odd"], "version": 5});
            let marker = format!("normalised ({})\n", c.session);
            send_without_channel(&mut c, header, &format!("print({marker:?}, end='')")).await?;
            let reply = reply_after(&mut c, &marker).await?;
            assert_eq!(reply["content"]["status"], "ok", "{reply}");
            let parent = &reply["parent_header"];
            let msg_id = parent["msg_id"].as_str().unwrap_or_default();
            assert_eq!(msg_id.len(), 32, "a fresh id: {parent}");
            assert!(msg_id.bytes().all(|b| b.is_ascii_hexdigit()), "{parent}");
            let date = parent["date"].as_str().unwrap_or_default();
            assert!(
                chrono_like(date),
                "the date is the current time as ISO 8601: {parent}"
            );
            assert_eq!(parent["session"], c.session.as_str(), "{parent}");
            assert!(parent["username"].is_string(), "{parent}");
            assert_eq!(parent["version"], "5.3", "{parent}");

            // Numbers as msg_id and date in a header with a channel, too.
            let header = json!({"msg_id": 42, "msg_type": "kernel_info_request",
                "session": c.session, "username": "odd", "date": 0, "version": "5.3"});
            let frame = if c.v1 {
                WsMessage::Binary(v1_frame("shell", &header, &json!({})).into())
            } else {
                let m = json!({"channel": "shell", "header": header, "parent_header": {},
                               "metadata": {}, "content": {}});
                WsMessage::Text(m.to_string().into())
            };
            c.send_raw(frame).await?;
            let info = c
                .wait_for(Duration::from_secs(30), |m| {
                    m["msg_type"] == "kernel_info_reply"
                })
                .await?;
            assert_eq!(info["content"]["status"], "ok", "{info}");
            assert_eq!(
                info["parent_header"]["msg_id"].as_str().map(str::len),
                Some(32)
            );
            Ok(())
        })
    })
    .await
}

/// `2026-11-24T13:45:01.123456Z`-like: a current ISO 8601 time, not a number.
fn chrono_like(date: &str) -> bool {
    let year = date.get(..4).and_then(|y| y.parse::<u32>().ok());
    year.is_some_and(|y| y >= 2025) && date.get(4..5) == Some("-") && date.contains('T')
}
