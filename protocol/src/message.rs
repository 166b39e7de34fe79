//! The message envelope: a typed [`Header`] (unknown fields kept) and raw JSON for the
//! rest, so relaying never re-serializes content the gateway does not inspect.
//!
//! Spec: "General Message Format" of the messaging doc.

use bytes::Bytes;
use serde::de::{DeserializeOwned, Deserializer};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::fmt;

/// The messaging protocol version this crate speaks and stamps on messages it creates.
pub const PROTOCOL_VERSION: &str = "5.3";

/// A JSON value kept exactly as it arrived (same bytes, same key order).
#[derive(Clone)]
pub struct RawJson(Box<RawValue>);

/// Byte-for-byte equality: two encodings of the same value with different spacing differ.
impl PartialEq for RawJson {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl Eq for RawJson {}

impl RawJson {
    /// Checks that `bytes` hold one JSON value and keeps them verbatim.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice::<Box<RawValue>>(bytes).map(RawJson)
    }

    /// Checks that `text` holds one JSON value and keeps it verbatim.
    pub fn from_string(text: String) -> Result<Self, serde_json::Error> {
        RawValue::from_string(text).map(RawJson)
    }

    /// Serializes a value (for messages the gateway creates itself).
    pub fn from_value<T: Serialize + ?Sized>(value: &T) -> Self {
        // Serializing a `Serialize` type into a string only fails for maps with
        // non-string keys, which no protocol type has; fall back to `{}` rather than panic.
        RawJson(serde_json::value::to_raw_value(value).unwrap_or_else(|_| Self::empty_box()))
    }

    /// `{}`: the empty metadata, content or parent header.
    pub fn empty_object() -> Self {
        RawJson(Self::empty_box())
    }

    fn empty_box() -> Box<RawValue> {
        RawValue::from_string("{}".to_owned()).unwrap_or_else(|_| unreachable!("`{{}}` is JSON"))
    }

    pub fn get(&self) -> &str {
        self.0.get()
    }

    pub fn as_bytes(&self) -> &[u8] {
        self.0.get().as_bytes()
    }

    pub fn as_raw(&self) -> &RawValue {
        &self.0
    }

    /// Parses into a typed view.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_str(self.0.get())
    }

    /// True for `{}` (with any whitespace), the encoding of "no parent".
    pub fn is_empty_object(&self) -> bool {
        let s = self.0.get().trim();
        s.starts_with('{') && s.ends_with('}') && s[1..s.len() - 1].trim().is_empty()
    }
}

impl fmt::Debug for RawJson {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.get())
    }
}

impl Serialize for RawJson {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for RawJson {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Box::<RawValue>::deserialize(d).map(RawJson)
    }
}

/// A message header. Known fields are typed; anything else (`subshell_id`, vendor
/// fields) is kept in `extra` and written back out.
///
/// A known field of the wrong type (a `date` sent as a number, a `msg_id` as an integer)
/// reads as empty instead of failing the whole message, so [`Header::fill_missing`] can
/// give it a proper value: clients' headers are normalised, never dropped.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Header {
    #[serde(default, deserialize_with = "string_or_empty")]
    pub msg_id: String,
    #[serde(default, deserialize_with = "string_or_empty")]
    pub session: String,
    #[serde(default, deserialize_with = "string_or_empty")]
    pub username: String,
    /// ISO 8601, kept as the sender wrote it.
    #[serde(default, deserialize_with = "string_or_empty")]
    pub date: String,
    #[serde(default, deserialize_with = "string_or_empty")]
    pub msg_type: String,
    #[serde(default, deserialize_with = "string_or_empty")]
    pub version: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// A string as itself; any other JSON value (number, null, object, ...) as `""`.
pub(crate) fn string_or_empty<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    d.deserialize_any(StringOrEmpty)
}

struct StringOrEmpty;

impl<'de> serde::de::Visitor<'de> for StringOrEmpty {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_owned())
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<String, E> {
        Ok(v)
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<String, E> {
        Ok(String::new())
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<String, E> {
        Ok(String::new())
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<String, E> {
        Ok(String::new())
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<String, E> {
        Ok(String::new())
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<String, E> {
        Ok(String::new())
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<String, E> {
        Ok(String::new())
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<String, A::Error> {
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(String::new())
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<String, A::Error> {
        while map
            .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
            .is_some()
        {}
        Ok(String::new())
    }
}

impl Header {
    /// A header for a message created by the gateway itself.
    pub fn new(msg_type: &str, session: &str, username: &str, date: &str) -> Self {
        Header {
            msg_id: new_msg_id(),
            session: session.to_owned(),
            username: username.to_owned(),
            date: date.to_owned(),
            msg_type: msg_type.to_owned(),
            version: PROTOCOL_VERSION.to_owned(),
            extra: Map::new(),
        }
    }

    /// Fills what a WebSocket client left out or sent with the wrong type (see the type's
    /// doc). Clients send unsigned, often sparse headers; the kernel expects all of these.
    pub fn fill_missing(&mut self, session: &str, username: &str, date: &str) {
        if self.msg_id.is_empty() {
            self.msg_id = new_msg_id();
        }
        for (field, value) in [
            (&mut self.session, session),
            (&mut self.username, username),
            (&mut self.date, date),
            (&mut self.version, PROTOCOL_VERSION),
        ] {
            if field.is_empty() {
                *field = value.to_owned();
            }
        }
    }
}

/// A fresh message id (a UUID, as jupyter_client uses).
pub fn new_msg_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// The message types the gateway acts on, read once from a message's `msg_type` when the
/// message is made or decoded ([`Message::kind`]); every other type is [`MsgKind::Other`]
/// and is relayed untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgKind {
    ExecuteRequest,
    ExecuteReply,
    InterruptRequest,
    DebugRequest,
    /// `comm_open`, `comm_msg` or `comm_close`.
    Comm,
    Status,
    Stream,
    DisplayData,
    UpdateDisplayData,
    ExecuteResult,
    Other,
}

impl MsgKind {
    pub fn of(msg_type: &str) -> MsgKind {
        match msg_type {
            "execute_request" => MsgKind::ExecuteRequest,
            "execute_reply" => MsgKind::ExecuteReply,
            "interrupt_request" => MsgKind::InterruptRequest,
            "debug_request" => MsgKind::DebugRequest,
            "comm_open" | "comm_msg" | "comm_close" => MsgKind::Comm,
            "status" => MsgKind::Status,
            "stream" => MsgKind::Stream,
            "display_data" => MsgKind::DisplayData,
            "update_display_data" => MsgKind::UpdateDisplayData,
            "execute_result" => MsgKind::ExecuteResult,
            _ => MsgKind::Other,
        }
    }
}

/// One Jupyter message, independent of how it travels.
///
/// Its kind is read from `header.msg_type` when it is made; a message whose type changes
/// is made anew ([`Message::from_parts`]).
#[derive(Debug, Clone)]
pub struct Message {
    pub header: Header,
    /// `None` is sent as `{}`.
    pub parent_header: Option<Header>,
    pub metadata: RawJson,
    pub content: RawJson,
    pub buffers: Vec<Bytes>,
    kind: MsgKind,
}

/// Equal when their five parts are (the kind is read from the header).
impl PartialEq for Message {
    fn eq(&self, other: &Self) -> bool {
        self.header == other.header
            && self.parent_header == other.parent_header
            && self.metadata == other.metadata
            && self.content == other.content
            && self.buffers == other.buffers
    }
}

impl Message {
    /// A new message with empty metadata and no buffers.
    pub fn new(header: Header, parent_header: Option<Header>, content: RawJson) -> Self {
        Message::from_parts(
            header,
            parent_header,
            RawJson::empty_object(),
            content,
            Vec::new(),
        )
    }

    /// A message from its five parts, as decoded from a wire or WebSocket frame.
    pub fn from_parts(
        header: Header,
        parent_header: Option<Header>,
        metadata: RawJson,
        content: RawJson,
        buffers: Vec<Bytes>,
    ) -> Self {
        Message {
            kind: MsgKind::of(&header.msg_type),
            header,
            parent_header,
            metadata,
            content,
            buffers,
        }
    }

    pub fn msg_type(&self) -> &str {
        &self.header.msg_type
    }

    /// The type as the gateway acts on it, read when the message was made.
    pub fn kind(&self) -> MsgKind {
        self.kind
    }

    pub fn msg_id(&self) -> &str {
        &self.header.msg_id
    }

    /// The `msg_id` of the request this message answers, if any.
    pub fn parent_msg_id(&self) -> Option<&str> {
        self.parent_header
            .as_ref()
            .map(|p| p.msg_id.as_str())
            .filter(|id| !id.is_empty())
    }

    /// The content as a typed view.
    pub fn content_as<T: DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        self.content.parse()
    }
}

/// Parses a parent header: `{}` (or `null`) means none.
pub(crate) fn parse_parent(raw: &RawJson) -> Result<Option<Header>, serde_json::Error> {
    if raw.is_empty_object() || raw.get().trim() == "null" {
        return Ok(None);
    }
    raw.parse().map(Some)
}

/// Serializes a parent header as the wire and WebSocket encodings want it.
pub(crate) fn parent_json(parent: &Option<Header>) -> Vec<u8> {
    match parent {
        Some(h) => header_json(h),
        None => b"{}".to_vec(),
    }
}

pub(crate) fn header_json(header: &Header) -> Vec<u8> {
    // A Header holds only strings and JSON values: serialization cannot fail.
    serde_json::to_vec(header).unwrap_or_else(|_| b"{}".to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_keeps_unknown_fields() {
        let raw = r#"{"msg_id":"a","session":"s","username":"u","date":"2026-01-01T00:00:00.000000Z","msg_type":"execute_request","version":"5.3","subshell_id":null,"x-vendor":{"k":[1,2]}}"#;
        let h: Header = serde_json::from_str(raw).expect("header parses");
        assert_eq!(h.msg_type, "execute_request");
        assert_eq!(
            h.extra.get("x-vendor"),
            Some(&serde_json::json!({"k": [1, 2]}))
        );
        let back: Value = serde_json::from_slice(&header_json(&h)).expect("json");
        assert_eq!(back, serde_json::from_str::<Value>(raw).expect("json"));
    }

    #[test]
    fn fill_missing_keeps_what_client_sent() {
        let mut h: Header =
            serde_json::from_str(r#"{"msg_type":"kernel_info_request","session":"mine"}"#)
                .expect("header parses");
        h.fill_missing("gw", "user", "2026-01-01T00:00:00Z");
        assert_eq!(h.session, "mine");
        assert_eq!(h.username, "user");
        assert_eq!(h.version, PROTOCOL_VERSION);
        assert_eq!(h.msg_id.len(), 32);
    }

    #[test]
    fn wrong_types_are_normalised_not_rejected() {
        let mut h: Header = serde_json::from_str(
            r#"{"msg_id":7,"session":null,"username":["u"],"date":1700000000.5,"msg_type":"execute_request","version":{"v":5}}"#,
        )
        .expect("a header with odd field types still parses");
        assert_eq!(h.msg_type, "execute_request");
        h.fill_missing("gw", "user", "2026-01-01T00:00:00Z");
        assert_eq!(h.msg_id.len(), 32, "a fresh id replaces the number");
        assert_eq!((h.session.as_str(), h.username.as_str()), ("gw", "user"));
        assert_eq!(h.date, "2026-01-01T00:00:00Z");
        assert_eq!(h.version, PROTOCOL_VERSION);
        assert!(
            h.extra.is_empty(),
            "known fields are not duplicated into extra"
        );
    }

    #[test]
    fn raw_json_is_verbatim() {
        let raw = RawJson::from_slice(br#"{ "b": 1, "a": [ 2 ] }"#).expect("json");
        assert_eq!(raw.get(), r#"{ "b": 1, "a": [ 2 ] }"#);
        assert!(RawJson::from_slice(b"{ }").expect("json").is_empty_object());
        assert!(!raw.is_empty_object());
        assert!(RawJson::from_slice(b"{\"a\":").is_err());
    }

    #[test]
    fn empty_parent_is_none() {
        assert_eq!(
            parse_parent(&RawJson::empty_object()).expect("parses"),
            None
        );
        let p = parse_parent(&RawJson::from_slice(br#"{"msg_id":"p1"}"#).expect("json"))
            .expect("parses");
        assert_eq!(p.map(|h| h.msg_id), Some("p1".to_owned()));
    }
}
