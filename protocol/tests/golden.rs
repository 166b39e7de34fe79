//! Golden vectors made by Python's jupyter_client and jupyter_server
//! (`tests/golden/generate.py`; how to regenerate is in its docstring).
//!
//! What "matches" means here, per encoding:
//! - Frames jupyter_client produced decode and verify here, to the values it sent.
//! - Over the same four JSON byte strings, our HMAC equals jupyter_client's.
//! - Re-encoding: metadata, content, buffers, identities, delimiter and offsets-free parts
//!   are byte-identical to Python's. Header and parent header are compared as parsed JSON
//!   when jupyter_client wrote them with its own spacing or key order (stdlib `json` puts a
//!   space after `:` and `,`, `msg_header` orders keys differently from our struct). The
//!   vectors marked `byte_identical` were packed compactly in our field order, and for
//!   those every frame, signature and WebSocket byte must be identical.

use bytes::Bytes;
use kernelgate_protocol::connection::ConnectionInfo;
use kernelgate_protocol::message::Message;
use kernelgate_protocol::signature::SignatureError;
use kernelgate_protocol::websocket::{self, Encoding, Frame};
use kernelgate_protocol::wire::{self, WireError, DELIMITER};
use kernelgate_protocol::{Channel, SigningKey};
use serde_json::Value;
use std::path::Path;

fn load(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

fn items<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key} array"))
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("no {key} string in {v}"))
}

fn unhex(v: &Value) -> Vec<u8> {
    hex::decode(v.as_str().unwrap_or_else(|| panic!("{v} is not a string")))
        .unwrap_or_else(|e| panic!("{v} is not hex: {e}"))
}

fn hex_list(v: &Value) -> Vec<Bytes> {
    v.as_array()
        .unwrap_or_else(|| panic!("{v} is not an array"))
        .iter()
        .map(|x| Bytes::from(unhex(x)))
        .collect()
}

fn json_of(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("not JSON ({e}): {bytes:?}"))
}

fn key_of(v: &Value) -> SigningKey {
    SigningKey::new(str_of(v, "key").as_bytes())
}

/// Checks a decoded message against the values the generator put in.
fn assert_values(name: &str, message: &Message, expect: &Value) {
    let header = serde_json::to_value(&message.header).expect("header serializes");
    assert_eq!(header, expect["header"], "{name}: header");
    let parent = message
        .parent_header
        .as_ref()
        .map(|p| serde_json::to_value(p).expect("parent serializes"))
        .unwrap_or(Value::Null);
    assert_eq!(parent, expect["parent_header"], "{name}: parent_header");
    assert_eq!(
        json_of(message.metadata.as_bytes()),
        expect["metadata"],
        "{name}: metadata"
    );
    assert_eq!(
        json_of(message.content.as_bytes()),
        expect["content"],
        "{name}: content"
    );
    assert_eq!(
        message.buffers,
        hex_list(&expect["buffers"]),
        "{name}: buffers"
    );
}

/// Index of the signature frame (the one after the delimiter).
fn signature_index(frames: &[Bytes]) -> usize {
    frames
        .iter()
        .position(|f| f.as_ref() == DELIMITER)
        .expect("vector has a delimiter")
        + 1
}

#[test]
fn jupyter_client_frames_verify_and_decode_to_the_values_it_sent() {
    let vectors = load("wire.json");
    for v in items(&vectors, "messages") {
        let name = str_of(v, "name");
        let frames = hex_list(&v["frames"]);
        let decoded = wire::decode(&frames, &key_of(v)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            decoded.identities,
            hex_list(&v["identities"]),
            "{name}: identities"
        );
        assert_values(name, &decoded.message, &v["expect"]);
        // Relayed verbatim: the raw parts keep jupyter_client's exact bytes.
        let sig = signature_index(&frames);
        assert_eq!(decoded.message.metadata.as_bytes(), &frames[sig + 3][..]);
        assert_eq!(decoded.message.content.as_bytes(), &frames[sig + 4][..]);
    }
}

#[test]
fn signatures_equal_jupyter_client_session_sign() {
    let vectors = load("wire.json");
    for v in items(&vectors, "messages") {
        let name = str_of(v, "name");
        let frames = hex_list(&v["frames"]);
        let sig = signature_index(&frames);
        let parts = [
            &frames[sig + 1][..],
            &frames[sig + 2][..],
            &frames[sig + 3][..],
            &frames[sig + 4][..],
        ];
        let ours = key_of(v).sign(parts);
        assert_eq!(ours, str_of(v, "signature"), "{name}");
        assert_eq!(ours.as_bytes(), &frames[sig][..], "{name}: signature frame");
    }
    let signs = items(&vectors, "signatures");
    assert!(signs.len() >= 5);
    for v in signs {
        let key = SigningKey::new(&unhex(&v["key"]));
        let parts = hex_list(&v["parts"]);
        let parts = [&parts[0][..], &parts[1][..], &parts[2][..], &parts[3][..]];
        let expected = str_of(v, "signature");
        assert_eq!(key.sign(parts), expected, "key {}", v["key"]);
        assert_eq!(key.verify(expected.as_bytes(), parts), Ok(()));
    }
}

#[test]
fn reencoded_frames_match_jupyter_client() {
    let vectors = load("wire.json");
    let mut identical = 0;
    for v in items(&vectors, "messages") {
        let name = str_of(v, "name");
        let key = key_of(v);
        let theirs = hex_list(&v["frames"]);
        let decoded = wire::decode(&theirs, &key).unwrap_or_else(|e| panic!("{name}: {e}"));
        let ours = wire::encode(&decoded.identities, &decoded.message, &key);
        if v["byte_identical"] == Value::Bool(true) {
            // Same JSON bytes in, so jupyter_client's Session.deserialize (which accepted
            // these exact frames in the generator) accepts ours.
            assert_eq!(ours, theirs, "{name}: every frame");
            identical += 1;
            continue;
        }
        assert_eq!(ours.len(), theirs.len(), "{name}: frame count");
        let sig = signature_index(&theirs);
        for i in (0..ours.len()).filter(|&i| i != sig && i != sig + 1 && i != sig + 2) {
            assert_eq!(ours[i], theirs[i], "{name}: frame {i}");
        }
        assert_eq!(json_of(&ours[sig + 1]), json_of(&theirs[sig + 1]), "{name}");
        assert_eq!(json_of(&ours[sig + 2]), json_of(&theirs[sig + 2]), "{name}");
        // Our different header bytes carry our own valid signature.
        let again = wire::decode(&ours, &key).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(again, decoded, "{name}");
    }
    assert!(
        identical >= 2,
        "too few byte-identical vectors: {identical}"
    );
}

#[test]
fn frames_jupyter_client_refuses_are_refused() {
    let vectors = load("wire.json");
    let refused = items(&vectors, "refused");
    assert!(refused.len() >= 4);
    for v in refused {
        let name = str_of(v, "name");
        let result = wire::decode(&hex_list(&v["frames"]), &key_of(v));
        let expected = match str_of(v, "error") {
            "SignatureMismatch" => SignatureError::SignatureMismatch,
            "Unsigned" => SignatureError::Unsigned,
            other => panic!("{name}: unknown expected error {other}"),
        };
        match result {
            Err(WireError::Signature(e)) => assert_eq!(e, expected, "{name}"),
            other => panic!("{name}: expected {expected:?}, got {other:?}"),
        }
    }
}

/// Splits a v1 frame into its parts (channel, header, parent, metadata, content, buffers).
fn v1_parts(frame: &[u8]) -> Vec<&[u8]> {
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&frame[8 * i..8 * i + 8]);
        usize::try_from(u64::from_le_bytes(w)).expect("fits")
    };
    let offsets: Vec<usize> = (1..=word(0)).map(word).collect();
    offsets.windows(2).map(|w| &frame[w[0]..w[1]]).collect()
}

/// Splits a legacy binary frame into its JSON and buffers.
fn legacy_parts(frame: &[u8]) -> Vec<&[u8]> {
    let word = |i: usize| {
        u32::from_be_bytes(frame[4 * i..4 * i + 4].try_into().expect("4 bytes")) as usize
    };
    let mut offsets: Vec<usize> = (1..=word(0)).map(word).collect();
    offsets.push(frame.len());
    offsets.windows(2).map(|w| &frame[w[0]..w[1]]).collect()
}

fn channel_of(v: &Value) -> Channel {
    str_of(v, "channel").parse().expect("channel name")
}

#[test]
fn jupyter_server_websocket_frames_decode() {
    let vectors = load("websocket.json");
    for v in items(&vectors, "messages") {
        let name = str_of(v, "name");
        let v1 = Frame::Binary(Bytes::from(unhex(&v["v1"])));
        let (channel, message) =
            websocket::decode(Encoding::V1, &v1).unwrap_or_else(|e| panic!("{name} v1: {e}"));
        assert_eq!(channel, channel_of(v), "{name}");
        assert_values(name, &message, &v["expect"]);

        let legacy = unhex(&v["legacy"]);
        let legacy = match str_of(v, "legacy_kind") {
            "text" => Frame::Text(String::from_utf8(legacy).expect("text frame is UTF-8")),
            _ => Frame::Binary(Bytes::from(legacy)),
        };
        let (channel, message) = websocket::decode(Encoding::Legacy, &legacy)
            .unwrap_or_else(|e| panic!("{name} legacy: {e}"));
        assert_eq!(channel, channel_of(v), "{name}");
        assert_values(name, &message, &v["expect"]);
    }
}

#[test]
fn v1_encoding_matches_jupyter_server() {
    let vectors = load("websocket.json");
    let mut identical = 0;
    for v in items(&vectors, "messages") {
        let name = str_of(v, "name");
        let theirs = unhex(&v["v1"]);
        let (channel, message) =
            websocket::decode(Encoding::V1, &Frame::Binary(Bytes::from(theirs.clone())))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        let ours = websocket::encode_v1(channel, &message);
        if v["byte_identical"] == Value::Bool(true) {
            assert_eq!(&ours[..], &theirs[..], "{name}: whole frame");
            identical += 1;
            continue;
        }
        // Offsets depend on the header's length, so compare part by part.
        let (ours, theirs) = (v1_parts(&ours), v1_parts(&theirs));
        assert_eq!(ours.len(), theirs.len(), "{name}: part count");
        assert_eq!(json_of(ours[1]), json_of(theirs[1]), "{name}: header");
        assert_eq!(json_of(ours[2]), json_of(theirs[2]), "{name}: parent");
        for i in [0].into_iter().chain(3..ours.len()) {
            assert_eq!(ours[i], theirs[i], "{name}: part {i}");
        }
    }
    assert!(
        identical >= 2,
        "too few byte-identical vectors: {identical}"
    );
}

#[test]
fn legacy_encoding_matches_jupyter_server() {
    let vectors = load("websocket.json");
    for v in items(&vectors, "messages") {
        let name = str_of(v, "name");
        let channel = channel_of(v);
        let theirs = unhex(&v["legacy"]);
        let frame = if str_of(v, "legacy_kind") == "text" {
            Frame::Text(String::from_utf8(theirs.clone()).expect("UTF-8"))
        } else {
            Frame::Binary(Bytes::from(theirs.clone()))
        };
        let (_, message) =
            websocket::decode(Encoding::Legacy, &frame).unwrap_or_else(|e| panic!("{name}: {e}"));
        // jupyter_server writes this JSON with Python's default `json.dumps` (spaces,
        // `\u` escapes), so the JSON is compared as values; buffers as bytes.
        match websocket::encode(Encoding::Legacy, channel, &message) {
            Frame::Text(ours) => {
                assert_eq!(str_of(v, "legacy_kind"), "text", "{name}");
                assert_eq!(json_of(ours.as_bytes()), json_of(&theirs), "{name}");
            }
            Frame::Binary(ours) => {
                assert_eq!(str_of(v, "legacy_kind"), "binary", "{name}");
                let (ours, theirs) = (legacy_parts(&ours), legacy_parts(&theirs));
                assert_eq!(ours.len(), theirs.len(), "{name}: part count");
                assert_eq!(ours[1..], theirs[1..], "{name}: buffers");
                // jupyter_server pops "buffers" out of the JSON part; we write
                // `"buffers": []` there (clients replace it with the binary parts).
                let mut ours_json = json_of(ours[0]);
                let removed = ours_json.as_object_mut().and_then(|o| o.remove("buffers"));
                assert_eq!(removed, Some(Value::Array(vec![])), "{name}");
                assert_eq!(ours_json, json_of(theirs[0]), "{name}: JSON part");
            }
        }
    }
}

#[test]
fn jupyter_client_connection_files_parse() {
    let vectors = load("connection.json");
    let files = items(&vectors, "files");
    assert!(files.len() >= 4);
    for v in files {
        let name = str_of(v, "name");
        let info = ConnectionInfo::from_json(str_of(v, "file").as_bytes())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let fields = serde_json::to_value(&info).expect("serializes");
        assert_eq!(fields, v["expect"], "{name}: every field, extras kept");
        for channel in Channel::ALL {
            assert_eq!(
                info.endpoint(channel),
                str_of(&v["endpoints"], channel.as_str()),
                "{name}: {channel} endpoint as jupyter_client's _make_url"
            );
        }
        assert_eq!(
            info.signing_key().is_signing(),
            !info.key.is_empty(),
            "{name}"
        );
        assert_eq!(json_of(&info.to_json()), v["expect"], "{name}: to_json");
    }
}
