//! The encodings Jupyter Server uses on `/api/kernels/{id}/channels`.
//!
//! - Legacy (no subprotocol): one JSON text frame per message, with `channel` and, for
//!   jupyter_server's own clients, top-level `msg_id` and `msg_type`. A message with
//!   buffers goes as a binary frame: u32-BE part count, u32-BE offsets, the JSON, buffers.
//! - `v1.kernel.websocket.jupyter.org`: binary frames of a u64-LE offset count, u64-LE
//!   offsets, then channel, header, parent_header, metadata, content and buffers.
//!
//! Reference: jupyter_server `services/kernels/connection/base.py`.

use crate::channel::{Channel, UnknownChannel};
use crate::message::{header_json, parent_json, parse_parent, Header, Message, RawJson};
use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// The subprotocol name a client offers for the v1 binary encoding.
pub const V1_SUBPROTOCOL: &str = "v1.kernel.websocket.jupyter.org";

/// Offsets beyond this many are refused before any allocation: a frame cannot hold more
/// parts than it has 8-byte words, and no Jupyter message has anywhere near this many.
const MAX_PARTS: usize = 4096;

/// Which encoding a WebSocket connection speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Legacy,
    V1,
}

impl Encoding {
    /// Picks v1 when the client offers it among its subprotocols, legacy otherwise.
    pub fn negotiate<'a>(offered: impl IntoIterator<Item = &'a str>) -> Self {
        if offered.into_iter().any(|p| p.trim() == V1_SUBPROTOCOL) {
            Encoding::V1
        } else {
            Encoding::Legacy
        }
    }
}

/// One WebSocket frame's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Text(String),
    Binary(Bytes),
}

#[derive(Debug, thiserror::Error)]
pub enum WsError {
    #[error("message is not valid JSON: {0}")]
    InvalidJson(#[from] serde_json::Error),
    #[error(transparent)]
    UnknownChannel(#[from] UnknownChannel),
    #[error("binary frame is malformed: {0}")]
    BadFrame(&'static str),
    #[error("binary frame has {0} parts; a message needs channel and 4 JSON parts")]
    TooFewParts(usize),
    #[error("{0} part is not UTF-8")]
    NotUtf8(&'static str),
}

/// Encodes a message for a client in the given encoding.
pub fn encode(encoding: Encoding, channel: Channel, message: &Message) -> Frame {
    match encoding {
        Encoding::V1 => Frame::Binary(encode_v1(channel, message)),
        Encoding::Legacy if message.buffers.is_empty() => {
            Frame::Text(encode_legacy_json(channel, message))
        }
        Encoding::Legacy => Frame::Binary(encode_legacy_binary(channel, message)),
    }
}

/// Decodes a frame from a client in the given encoding.
pub fn decode(encoding: Encoding, frame: &Frame) -> Result<(Channel, Message), WsError> {
    match (encoding, frame) {
        (Encoding::V1, Frame::Binary(b)) => decode_v1(b),
        (Encoding::V1, Frame::Text(t)) => decode_legacy_json(t.as_bytes(), Vec::new()),
        (Encoding::Legacy, Frame::Text(t)) => decode_legacy_json(t.as_bytes(), Vec::new()),
        (Encoding::Legacy, Frame::Binary(b)) => decode_legacy_binary(b),
    }
}

#[derive(Serialize)]
struct LegacyOut<'a> {
    header: &'a Header,
    parent_header: ParentOut<'a>,
    metadata: &'a RawJson,
    content: &'a RawJson,
    buffers: [(); 0],
    channel: &'static str,
    msg_id: &'a str,
    msg_type: &'a str,
}

struct ParentOut<'a>(&'a Option<Header>);

impl Serialize for ParentOut<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Some(h) => h.serialize(s),
            None => serde_json::Map::new().serialize(s),
        }
    }
}

fn legacy_out<'a>(channel: Channel, message: &'a Message) -> LegacyOut<'a> {
    LegacyOut {
        header: &message.header,
        parent_header: ParentOut(&message.parent_header),
        metadata: &message.metadata,
        content: &message.content,
        buffers: [],
        channel: channel.as_str(),
        msg_id: &message.header.msg_id,
        msg_type: &message.header.msg_type,
    }
}

/// The legacy text frame (the message must have no buffers to be complete).
pub fn encode_legacy_json(channel: Channel, message: &Message) -> String {
    // Serde writes JSON as UTF-8, so the check cannot fail; it is a fast pass next to the
    // copy, which happens once into a buffer sized up front (output can be megabytes).
    String::from_utf8(legacy_json(channel, message)).unwrap_or_default()
}

fn legacy_json(channel: Channel, message: &Message) -> Vec<u8> {
    let mut buf = Vec::with_capacity(
        512 + message.content.get().len()
            + message.metadata.get().len()
            + message.header.extra.len() * 64,
    );
    // Only strings and already-valid JSON: serialization cannot fail.
    if serde_json::to_writer(&mut buf, &legacy_out(channel, message)).is_err() {
        buf.clear();
    }
    buf
}

/// The legacy binary frame, for messages with buffers.
pub fn encode_legacy_binary(channel: Channel, message: &Message) -> Bytes {
    let json = legacy_json(channel, message);
    let parts: Vec<&[u8]> = std::iter::once(json.as_slice())
        .chain(message.buffers.iter().map(|b| b.as_ref()))
        .collect();
    let n = parts.len();
    let mut out = Vec::with_capacity(4 * (n + 1) + parts.iter().map(|p| p.len()).sum::<usize>());
    out.extend_from_slice(&(n as u32).to_be_bytes());
    let mut offset = 4 * (n + 1);
    for p in &parts {
        out.extend_from_slice(&(offset as u32).to_be_bytes());
        offset += p.len();
    }
    for p in parts {
        out.extend_from_slice(p);
    }
    Bytes::from(out)
}

#[derive(Deserialize)]
struct LegacyIn {
    #[serde(default)]
    header: Option<Header>,
    #[serde(default)]
    parent_header: Option<RawJson>,
    #[serde(default, deserialize_with = "present")]
    metadata: Option<RawJson>,
    #[serde(default, deserialize_with = "present")]
    content: Option<RawJson>,
    #[serde(default)]
    channel: Option<String>,
    /// Some clients put these only at the top level.
    #[serde(default, deserialize_with = "crate::message::string_or_empty")]
    msg_id: String,
    #[serde(default, deserialize_with = "crate::message::string_or_empty")]
    msg_type: String,
}

/// `Some` whenever the field is there, even as `null`: a plain `Option` would read `null`
/// as absent and relay `{}` in its place.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<RawJson>, D::Error> {
    RawJson::deserialize(d).map(Some)
}

fn decode_legacy_json(json: &[u8], buffers: Vec<Bytes>) -> Result<(Channel, Message), WsError> {
    let m: LegacyIn = serde_json::from_slice(json)?;
    // A message that names no channel is a shell request, as jupyter_server reads it.
    let channel: Channel = match m.channel {
        Some(name) => name.parse()?,
        None => Channel::Shell,
    };
    let mut header = m.header.unwrap_or_default();
    if header.msg_id.is_empty() {
        header.msg_id = m.msg_id;
    }
    if header.msg_type.is_empty() {
        header.msg_type = m.msg_type;
    }
    let parent_header = match m.parent_header {
        Some(raw) => parse_parent(&raw)?,
        None => None,
    };
    let message = Message::from_parts(
        header,
        parent_header,
        m.metadata.unwrap_or_else(RawJson::empty_object),
        m.content.unwrap_or_else(RawJson::empty_object),
        buffers,
    );
    Ok((channel, message))
}

fn decode_legacy_binary(frame: &[u8]) -> Result<(Channel, Message), WsError> {
    let word = |i: usize| -> Result<usize, WsError> {
        frame
            .get(4 * i..4 * i + 4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or(WsError::BadFrame("truncated offset table"))
    };
    let n = word(0)?;
    if n == 0 || n > MAX_PARTS {
        return Err(WsError::BadFrame("part count out of range"));
    }
    let offsets = (1..=n).map(word).collect::<Result<Vec<_>, _>>()?;
    let parts = slice_parts(frame, &offsets, 4 * (n + 1))?;
    let buffers = parts[1..]
        .iter()
        .map(|p| Bytes::copy_from_slice(p))
        .collect();
    decode_legacy_json(parts[0], buffers)
}

/// Cuts `frame` at `offsets` (each a start; the last part runs to the end), checking
/// that they are in order and inside the frame.
fn slice_parts<'a>(
    frame: &'a [u8],
    offsets: &[usize],
    table_end: usize,
) -> Result<Vec<&'a [u8]>, WsError> {
    let mut parts = Vec::with_capacity(offsets.len());
    for (i, &start) in offsets.iter().enumerate() {
        let end = offsets.get(i + 1).copied().unwrap_or(frame.len());
        if start < table_end || start > end || end > frame.len() {
            return Err(WsError::BadFrame("offsets out of order or out of bounds"));
        }
        parts.push(&frame[start..end]);
    }
    Ok(parts)
}

/// The v1 binary frame.
pub fn encode_v1(channel: Channel, message: &Message) -> Bytes {
    let header = header_json(&message.header);
    let parent = parent_json(&message.parent_header);
    let mut parts: Vec<&[u8]> = vec![
        channel.as_str().as_bytes(),
        &header,
        &parent,
        message.metadata.as_bytes(),
        message.content.as_bytes(),
    ];
    parts.extend(message.buffers.iter().map(|b| b.as_ref()));
    // Offsets: one start per part plus the end of the last part.
    let count = parts.len() + 1;
    let table = 8 * (count + 1);
    let mut out = Vec::with_capacity(table + parts.iter().map(|p| p.len()).sum::<usize>());
    out.extend_from_slice(&(count as u64).to_le_bytes());
    let mut offset = table;
    out.extend_from_slice(&(offset as u64).to_le_bytes());
    for p in &parts {
        offset += p.len();
        out.extend_from_slice(&(offset as u64).to_le_bytes());
    }
    for p in parts {
        out.extend_from_slice(p);
    }
    Bytes::from(out)
}

fn decode_v1(frame: &[u8]) -> Result<(Channel, Message), WsError> {
    let word = |i: usize| -> Result<usize, WsError> {
        let b = frame
            .get(8 * i..8 * i + 8)
            .ok_or(WsError::BadFrame("truncated offset table"))?;
        let mut w = [0u8; 8];
        w.copy_from_slice(b);
        usize::try_from(u64::from_le_bytes(w)).map_err(|_| WsError::BadFrame("offset too large"))
    };
    let count = word(0)?;
    if !(2..=MAX_PARTS).contains(&count) {
        return Err(WsError::BadFrame("offset count out of range"));
    }
    let offsets = (1..=count).map(word).collect::<Result<Vec<_>, _>>()?;
    let table = 8 * (count + 1);
    // The last offset is the end of the data, not the start of a part.
    let (starts, end) = offsets.split_at(count - 1);
    if end[0] != frame.len() {
        return Err(WsError::BadFrame("last offset is not the end of the frame"));
    }
    let parts = slice_parts(frame, starts, table)?;
    if parts.len() < 5 {
        return Err(WsError::TooFewParts(parts.len()));
    }
    let channel = match std::str::from_utf8(parts[0]).map_err(|_| WsError::NotUtf8("channel"))? {
        // No channel named: shell, as for the legacy encoding.
        "" => Channel::Shell,
        name => name.parse()?,
    };
    let header: Header = serde_json::from_slice(parts[1])?;
    let parent_header = parse_parent(&RawJson::from_slice(parts[2])?)?;
    let message = Message::from_parts(
        header,
        parent_header,
        RawJson::from_slice(parts[3])?,
        RawJson::from_slice(parts[4])?,
        parts[5..]
            .iter()
            .map(|p| Bytes::copy_from_slice(p))
            .collect(),
    );
    Ok((channel, message))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn sample(buffers: usize) -> Message {
        let mut m = Message::new(
            Header::new("stream", "s", "u", "2026-01-01T00:00:00.000000Z"),
            Some(Header::new(
                "execute_request",
                "c",
                "u",
                "2026-01-01T00:00:00.000000Z",
            )),
            RawJson::from_slice(br#"{"name":"stdout","text":"hi\n"}"#).expect("json"),
        );
        m.buffers = (0..buffers)
            .map(|i| Bytes::from(vec![i as u8; i + 1]))
            .collect();
        m
    }

    #[test]
    fn legacy_text_has_channel_and_top_level_ids() {
        let m = sample(0);
        let Frame::Text(t) = encode(Encoding::Legacy, Channel::IoPub, &m) else {
            panic!("expected text");
        };
        let v: Value = serde_json::from_str(&t).expect("json");
        assert_eq!(v["channel"], "iopub");
        assert_eq!(v["msg_type"], "stream");
        assert_eq!(v["msg_id"], Value::from(m.header.msg_id.clone()));
        assert_eq!(v["content"]["text"], "hi\n");
        assert_eq!(v["parent_header"]["msg_type"], "execute_request");
    }

    #[test]
    fn every_encoding_round_trips() {
        for buffers in [0, 1, 3] {
            let m = sample(buffers);
            for enc in [Encoding::Legacy, Encoding::V1] {
                let f = encode(enc, Channel::Shell, &m);
                let (c, back) = decode(enc, &f).expect("decodes");
                assert_eq!(c, Channel::Shell);
                assert_eq!(back, m, "{enc:?} with {buffers} buffers");
            }
        }
    }

    fn legacy(text: &str) -> (Channel, Message) {
        decode(Encoding::Legacy, &Frame::Text(text.into())).expect("decodes")
    }

    #[test]
    fn sparse_client_message_is_accepted() {
        let (c, m) = legacy(
            r#"{"channel":"shell","header":{"msg_type":"kernel_info_request","msg_id":"m1"},"content":{}}"#,
        );
        assert_eq!(c, Channel::Shell);
        assert_eq!(m.header.msg_id, "m1");
        assert_eq!(m.parent_header, None);
        assert!(m.metadata.is_empty_object());
    }

    #[test]
    fn a_message_without_channel_goes_to_shell() {
        let (c, m) = legacy(r#"{"header":{"msg_id":"m1"},"content":{}}"#);
        assert_eq!((c, m.header.msg_id.as_str()), (Channel::Shell, "m1"));
        let mut v1 = sample(0);
        v1.header.msg_type = "kernel_info_request".into();
        let mut frame = encode_v1(Channel::Control, &v1).to_vec();
        // Rewrite the channel part ("control") as an empty one: shift the offsets.
        let count = u64::from_le_bytes(frame[..8].try_into().expect("8 bytes")) as usize;
        let table = 8 * (count + 1);
        frame.drain(table..table + "control".len());
        for i in 2..=count {
            let at = 8 * i;
            let w = u64::from_le_bytes(frame[at..at + 8].try_into().expect("8 bytes"));
            frame[at..at + 8].copy_from_slice(&(w - "control".len() as u64).to_le_bytes());
        }
        let (c, m) = decode(Encoding::V1, &Frame::Binary(Bytes::from(frame))).expect("decodes");
        assert_eq!((c, m), (Channel::Shell, v1));
    }

    #[test]
    fn top_level_ids_of_the_wrong_type_do_not_reject_the_message() {
        let odd = r#"{"channel":"control","msg_id":12,"msg_type":"x","header":{"date":5}}"#;
        let (c, m) = legacy(odd);
        assert_eq!((c, m.header.msg_type.as_str()), (Channel::Control, "x"));
        assert_eq!((m.header.msg_id.as_str(), m.header.date.as_str()), ("", ""));
    }

    #[test]
    fn bad_frames_are_errors() {
        let text = |s: &str| decode(Encoding::Legacy, &Frame::Text(s.into()));
        assert!(matches!(text("{"), Err(WsError::InvalidJson(_))));
        assert!(matches!(
            text(r#"{"channel":"nope"}"#),
            Err(WsError::UnknownChannel(_))
        ));
        let bin = |b: &[u8]| decode(Encoding::V1, &Frame::Binary(Bytes::copy_from_slice(b)));
        assert!(bin(&[]).is_err());
        assert!(bin(&[255; 16]).is_err());
        assert!(decode(
            Encoding::Legacy,
            &Frame::Binary(Bytes::from_static(&[0, 0, 0, 9]))
        )
        .is_err());
    }

    #[test]
    fn negotiation_picks_v1_only_when_offered() {
        assert_eq!(Encoding::negotiate(["foo", V1_SUBPROTOCOL]), Encoding::V1);
        assert_eq!(Encoding::negotiate(["foo"]), Encoding::Legacy);
        assert_eq!(Encoding::negotiate([]), Encoding::Legacy);
    }
}
