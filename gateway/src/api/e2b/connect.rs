//! Connect RPC (the protocol envd's services speak) with the JSON codec: its errors, and
//! the enveloped messages of its streams (a flags byte, a big-endian length, the message;
//! the last one, flagged end of stream, carries the error if any). docs/e2b.md says which
//! services and calls are served.

use super::super::error::ApiError;
use crate::kernels::files::FileError;
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::Stream;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::time::Instant;

/// The flag of the message that ends a stream.
const END_STREAM: u8 = 0b10;
/// The flag of a compressed message (never sent: the SDK asks for none).
const COMPRESSED: u8 = 0b01;
/// The largest message a client stream may send.
const MAX_MESSAGE: usize = 4 << 20;

/// A Connect error: its code's HTTP status and `{"code", "message"}`.
#[derive(Debug)]
pub struct ConnectError {
    pub code: &'static str,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        ConnectError {
            code,
            message: message.into(),
        }
    }
}

impl From<ApiError> for ConnectError {
    fn from(e: ApiError) -> Self {
        let code = match e.status {
            StatusCode::BAD_REQUEST => "invalid_argument",
            StatusCode::UNAUTHORIZED => "unauthenticated",
            StatusCode::FORBIDDEN => "permission_denied",
            StatusCode::NOT_FOUND => "not_found",
            StatusCode::CONFLICT => "failed_precondition",
            StatusCode::PAYLOAD_TOO_LARGE => "resource_exhausted",
            StatusCode::INSUFFICIENT_STORAGE => "resource_exhausted",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable",
            _ => "internal",
        };
        ConnectError::new(code, e.message)
    }
}

impl From<FileError> for ConnectError {
    fn from(e: FileError) -> Self {
        ApiError::from(e).into()
    }
}

impl IntoResponse for ConnectError {
    fn into_response(self) -> Response {
        // The Connect protocol's code-to-HTTP mapping.
        let status = match self.code {
            "invalid_argument" | "failed_precondition" => StatusCode::BAD_REQUEST,
            "unauthenticated" => StatusCode::UNAUTHORIZED,
            "permission_denied" => StatusCode::FORBIDDEN,
            "not_found" => StatusCode::NOT_FOUND,
            "already_exists" => StatusCode::CONFLICT,
            "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
            "unimplemented" => StatusCode::NOT_IMPLEMENTED,
            "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (
            status,
            Json(json!({"code": self.code, "message": self.message})),
        )
            .into_response()
    }
}

impl ConnectError {
    /// The end of a stream that failed.
    pub fn end_of_stream(&self) -> Bytes {
        envelope(
            END_STREAM,
            &json!({"error": {"code": self.code, "message": self.message}}),
        )
    }
}

/// One message of a stream.
pub fn message(value: &Value) -> Bytes {
    envelope(0, value)
}

/// The end of a stream that went well.
pub fn end_ok() -> Bytes {
    envelope(END_STREAM, &json!({}))
}

fn envelope(flags: u8, value: &Value) -> Bytes {
    let data = serde_json::to_vec(value).unwrap_or_default();
    let mut out = Vec::with_capacity(5 + data.len());
    out.push(flags);
    out.extend_from_slice(&u32::try_from(data.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&data);
    Bytes::from(out)
}

/// A streaming answer: its messages as they come (the stream ends itself with
/// [`end_ok`] or [`ConnectError::end_of_stream`]).
pub fn streaming(messages: impl Stream<Item = Bytes> + Send + 'static) -> Response {
    use futures::StreamExt;
    let body = Body::from_stream(messages.map(Ok::<_, std::convert::Infallible>));
    ([(header::CONTENT_TYPE, "application/connect+json")], body).into_response()
}

/// Reads enveloped messages from a client's stream as its bytes come.
#[derive(Debug, Default)]
pub struct Envelopes {
    buffer: Vec<u8>,
}

impl Envelopes {
    /// Takes `chunk`; answers the whole messages it completed (JSON), and whether the
    /// client ended its stream.
    pub fn push(&mut self, chunk: &[u8]) -> Result<(Vec<Value>, bool), ConnectError> {
        self.buffer.extend_from_slice(chunk);
        let mut out = Vec::new();
        let mut ended = false;
        while self.buffer.len() >= 5 {
            let flags = self.buffer[0];
            let len = u32::from_be_bytes([
                self.buffer[1],
                self.buffer[2],
                self.buffer[3],
                self.buffer[4],
            ]) as usize;
            if len > MAX_MESSAGE {
                return Err(ConnectError::new(
                    "resource_exhausted",
                    format!("a message of {len} bytes; at most {MAX_MESSAGE} are taken"),
                ));
            }
            if self.buffer.len() < 5 + len {
                break;
            }
            let data: Vec<u8> = self.buffer.drain(..5 + len).skip(5).collect();
            if flags & COMPRESSED != 0 {
                return Err(ConnectError::new(
                    "unimplemented",
                    "compressed messages are not taken: send them uncompressed",
                ));
            }
            if flags & END_STREAM != 0 {
                ended = true;
                break;
            }
            let value = match data.as_slice() {
                [] => json!({}),
                bytes => serde_json::from_slice(bytes).map_err(|e| {
                    ConnectError::new("invalid_argument", format!("a message is not JSON: {e}"))
                })?,
            };
            out.push(value);
        }
        Ok((out, ended))
    }
}

/// The path of an RPC: `/<service>/{method}` under a sandbox's internal prefix.
#[derive(Debug, Deserialize)]
pub struct RpcPath {
    #[allow(dead_code)]
    sandbox: String,
    pub method: String,
}

/// A unary call's request (JSON; an empty body is an empty message).
pub fn unary(body: &[u8]) -> Result<Value, ConnectError> {
    match body {
        [] => Ok(json!({})),
        bytes => serde_json::from_slice(bytes).map_err(|e| {
            ConnectError::new("invalid_argument", format!("the request is not JSON: {e}"))
        }),
    }
}

/// A stream's deadline, from the client's `Connect-Timeout-Ms` (none, or 0: none).
pub fn deadline(headers: &HeaderMap) -> Option<Instant> {
    header_number(headers, "connect-timeout-ms")
        .filter(|ms| *ms > 0)
        .map(|ms| Instant::now() + Duration::from_millis(ms))
}

/// How often a stream sends a keep-alive: the client's `Keepalive-Ping-Interval` (seconds),
/// else `default`.
pub fn keepalive(headers: &HeaderMap, default: Duration) -> Duration {
    header_number(headers, "keepalive-ping-interval")
        .filter(|s| *s > 0)
        .map_or(default, |s| Duration::from_secs(s.min(600)))
}

fn header_number(headers: &HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.trim().parse().ok()
}

/// The one message of a server-stream call's request body.
pub fn single(body: &[u8]) -> Result<Value, ConnectError> {
    let mut reader = Envelopes::default();
    let (mut messages, _) = reader.push(body)?;
    if messages.len() != 1 || !reader.buffer.is_empty() {
        return Err(ConnectError::new(
            "invalid_argument",
            "a streaming call's request is one enveloped JSON message (content type \
             application/connect+json)",
        ));
    }
    Ok(messages.remove(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_headers_set_the_deadline_and_keepalive() {
        use axum::http::HeaderValue;
        let default = Duration::from_secs(30);
        let mut headers = HeaderMap::new();
        assert_eq!(deadline(&headers), None);
        assert_eq!(keepalive(&headers, default), default);
        headers.insert("connect-timeout-ms", HeaderValue::from_static("60000"));
        headers.insert("keepalive-ping-interval", HeaderValue::from_static("50"));
        let left = deadline(&headers).map(|at| at - Instant::now());
        assert!(left.is_some_and(|d| d > Duration::from_secs(59) && d <= Duration::from_secs(60)));
        assert_eq!(keepalive(&headers, default), Duration::from_secs(50));
        headers.insert("connect-timeout-ms", HeaderValue::from_static("0"));
        assert_eq!(deadline(&headers), None, "0 is no deadline");
    }

    #[test]
    fn envelopes_are_read_back_across_chunks() {
        let mut wire = message(&json!({"a": 1})).to_vec();
        wire.extend_from_slice(&message(&json!({"b": "x"})));
        wire.extend_from_slice(&end_ok());
        let mut reader = Envelopes::default();
        let (first, ended) = reader.push(&wire[..7]).expect("part");
        assert!(first.is_empty() && !ended);
        let (rest, ended) = reader.push(&wire[7..]).expect("rest");
        assert_eq!(rest, vec![json!({"a": 1}), json!({"b": "x"})]);
        assert!(ended);
        assert_eq!(
            single(&message(&json!({"p": 2}))).expect("one"),
            json!({"p": 2})
        );
        assert!(single(b"{}").is_err(), "an unenveloped body is refused");
        let failed = ConnectError::new("not_found", "no such process").end_of_stream();
        assert_eq!(failed[0], END_STREAM);
        assert_eq!(
            serde_json::from_slice::<Value>(&failed[5..]).expect("json"),
            json!({"error": {"code": "not_found", "message": "no such process"}})
        );
    }
}
