//! The ZeroMQ wire format: `[identities..., "<IDS|MSG>", signature, header, parent_header,
//! metadata, content, buffers...]`. Spec: "The Wire Protocol" of the messaging doc.

use crate::message::{header_json, parent_json, parse_parent, Header, Message, RawJson};
use crate::signature::{SignatureError, SigningKey};
use bytes::Bytes;

/// The frame that separates routing identities from the message.
pub const DELIMITER: &[u8] = b"<IDS|MSG>";

/// Why a multipart ZeroMQ message is not a Jupyter message.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("no <IDS|MSG> delimiter frame")]
    MissingDelimiter,
    #[error("{found} frames after the delimiter; a message needs at least 5")]
    TooFewFrames { found: usize },
    #[error(transparent)]
    Signature(#[from] SignatureError),
    #[error("{part} frame is not valid JSON: {source}")]
    InvalidJson {
        part: &'static str,
        source: serde_json::Error,
    },
}

/// A decoded message with the routing identities it came with (ROUTER peers).
#[derive(Debug, Clone, PartialEq)]
pub struct WireMessage {
    pub identities: Vec<Bytes>,
    pub message: Message,
}

const PART_NAMES: [&str; 4] = ["header", "parent_header", "metadata", "content"];

/// Splits, verifies and parses one multipart message. The signature is checked over the
/// exact bytes received before anything is parsed.
pub fn decode(frames: &[Bytes], key: &SigningKey) -> Result<WireMessage, WireError> {
    let delim = frames
        .iter()
        .position(|f| f.as_ref() == DELIMITER)
        .ok_or(WireError::MissingDelimiter)?;
    let rest = &frames[delim + 1..];
    if rest.len() < 5 {
        return Err(WireError::TooFewFrames { found: rest.len() });
    }
    let parts = [
        rest[1].as_ref(),
        rest[2].as_ref(),
        rest[3].as_ref(),
        rest[4].as_ref(),
    ];
    key.verify(&rest[0], parts)?;
    let json = |i: usize| {
        RawJson::from_slice(parts[i]).map_err(|source| WireError::InvalidJson {
            part: PART_NAMES[i],
            source,
        })
    };
    let invalid = |part, source| WireError::InvalidJson { part, source };
    let header: Header = json(0)?.parse().map_err(|e| invalid("header", e))?;
    let parent_header = parse_parent(&json(1)?).map_err(|e| invalid("parent_header", e))?;
    Ok(WireMessage {
        identities: frames[..delim].to_vec(),
        message: Message::from_parts(
            header,
            parent_header,
            json(2)?,
            json(3)?,
            rest[5..].to_vec(),
        ),
    })
}

/// Serializes and signs one message into its frames.
pub fn encode(identities: &[Bytes], message: &Message, key: &SigningKey) -> Vec<Bytes> {
    let header = header_json(&message.header);
    let parent = parent_json(&message.parent_header);
    let signature = key.sign([
        &header,
        &parent,
        message.metadata.as_bytes(),
        message.content.as_bytes(),
    ]);
    let mut frames = Vec::with_capacity(identities.len() + 6 + message.buffers.len());
    frames.extend(identities.iter().cloned());
    frames.push(Bytes::from_static(DELIMITER));
    frames.push(Bytes::from(signature));
    frames.push(Bytes::from(header));
    frames.push(Bytes::from(parent));
    frames.push(Bytes::copy_from_slice(message.metadata.as_bytes()));
    frames.push(Bytes::copy_from_slice(message.content.as_bytes()));
    frames.extend(message.buffers.iter().cloned());
    frames
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Message {
        let mut m = Message::new(
            Header::new("execute_request", "s1", "u", "2026-01-01T00:00:00.000000Z"),
            None,
            RawJson::from_slice(br#"{"code":"1+1","silent":false}"#).expect("json"),
        );
        m.buffers.push(Bytes::from_static(b"\x00\xffbin"));
        m
    }

    #[test]
    fn encode_decode_round_trip() {
        let key = SigningKey::new(b"k");
        let ids = vec![Bytes::from_static(b"id1")];
        let message = sample();
        let frames = encode(&ids, &message, &key);
        let back = decode(&frames, &key).expect("decodes");
        assert_eq!(back.identities, ids);
        assert_eq!(back.message, message);
    }

    #[test]
    fn tampered_content_is_refused() {
        let key = SigningKey::new(b"k");
        let mut frames = encode(&[], &sample(), &key);
        frames[5] = Bytes::from_static(br#"{"code":"import os"}"#);
        assert!(matches!(
            decode(&frames, &key),
            Err(WireError::Signature(SignatureError::SignatureMismatch))
        ));
    }

    #[test]
    fn buffers_are_not_signed() {
        let key = SigningKey::new(b"k");
        let mut frames = encode(&[], &sample(), &key);
        *frames.last_mut().expect("has buffer") = Bytes::from_static(b"other");
        assert!(decode(&frames, &key).is_ok());
    }

    #[test]
    fn short_messages_are_typed_errors() {
        let key = SigningKey::new(b"k");
        assert!(matches!(
            decode(&[], &key),
            Err(WireError::MissingDelimiter)
        ));
        let frames = vec![Bytes::from_static(DELIMITER), Bytes::from_static(b"")];
        assert!(matches!(
            decode(&frames, &key),
            Err(WireError::TooFewFrames { found: 1 })
        ));
    }

    #[test]
    fn bad_json_is_named() {
        let key = SigningKey::unsigned();
        let frames: Vec<Bytes> = [&b"<IDS|MSG>"[..], b"", b"{}", b"{}", b"{}", b"{not json"]
            .into_iter()
            .map(Bytes::copy_from_slice)
            .collect();
        assert!(matches!(
            decode(&frames, &key),
            Err(WireError::InvalidJson {
                part: "content",
                ..
            })
        ));
    }
}
