//! Properties of every encoding, over random messages, keys and bytes: what is encoded
//! decodes to the same thing, a changed byte in a signed frame is refused, and no input
//! makes a decoder panic.

use bytes::Bytes;
use kernelgate_protocol::connection::{ConnectionError, MAX_IPC_PATH};
use kernelgate_protocol::signature::SignatureError;
use kernelgate_protocol::terminal::{plain_text, Terminal};
use kernelgate_protocol::websocket::{self, Encoding, Frame};
use kernelgate_protocol::wire::{self, WireError, DELIMITER};
use kernelgate_protocol::{Channel, ConnectionInfo, Header, Message, RawJson, SigningKey};
use proptest::prelude::*;
use serde_json::{Map, Number, Value};

const HEADER_FIELDS: [&str; 6] = [
    "msg_id", "session", "username", "date", "msg_type", "version",
];

/// Any string, weighted towards the awkward: control characters, quotes, backslashes,
/// non-BMP characters.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[a-z0-9_-]{0,12}",
        prop::collection::vec(
            prop_oneof![
                Just('"'),
                Just('\\'),
                Just('\u{0}'),
                Just('\n'),
                Just('\u{7f}'),
                Just('\u{2028}'),
                Just('é'),
                Just('😀'),
                any::<char>(),
            ],
            0..8
        )
        .prop_map(|cs| cs.into_iter().collect()),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter_map("finite", Number::from_f64)
            .prop_map(Value::Number),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((text(), inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Verbatim JSON as a kernel might send it: compact or pretty.
fn raw_json() -> impl Strategy<Value = RawJson> {
    (json_value(), any::<bool>()).prop_map(|(v, pretty)| {
        let text = if pretty {
            serde_json::to_string_pretty(&v)
        } else {
            serde_json::to_string(&v)
        };
        RawJson::from_string(text.expect("a Value serializes")).expect("valid JSON")
    })
}

fn header() -> impl Strategy<Value = Header> {
    (
        (text(), text(), text(), text(), text(), text()),
        prop::collection::vec((text(), json_value()), 0..3),
    )
        .prop_map(
            |((msg_id, session, username, date, msg_type, version), extra)| Header {
                msg_id,
                session,
                username,
                date,
                msg_type,
                version,
                // Known names would be read back as the typed fields.
                extra: extra
                    .into_iter()
                    .filter(|(k, _)| !HEADER_FIELDS.contains(&k.as_str()))
                    .collect(),
            },
        )
}

fn buffers(max: usize) -> impl Strategy<Value = Vec<Bytes>> {
    prop::collection::vec(
        prop::collection::vec(any::<u8>(), 0..32).prop_map(Bytes::from),
        0..max,
    )
}

fn message() -> impl Strategy<Value = Message> {
    (
        header(),
        prop::option::of(header()),
        raw_json(),
        raw_json(),
        buffers(4),
    )
        .prop_map(|(header, parent_header, metadata, content, buffers)| {
            Message::from_parts(header, parent_header, metadata, content, buffers)
        })
}

fn identities() -> impl Strategy<Value = Vec<Bytes>> {
    prop::collection::vec(
        prop::collection::vec(any::<u8>(), 0..12)
            .prop_filter("not the delimiter", |id| id != DELIMITER)
            .prop_map(Bytes::from),
        0..3,
    )
}

/// Keys as bytes, including empty (unsigned) and longer than the HMAC block.
fn key_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(Vec::new()),
        prop::collection::vec(any::<u8>(), 1..16),
        prop::collection::vec(any::<u8>(), 60..100),
    ]
}

fn channel() -> impl Strategy<Value = Channel> {
    prop::sample::select(Channel::ALL.to_vec())
}

proptest! {
    #[test]
    fn wire_round_trips(ids in identities(), m in message(), key in key_bytes()) {
        let key = SigningKey::new(&key);
        let frames = wire::encode(&ids, &m, &key);
        let back = wire::decode(&frames, &key).expect("own frames decode");
        prop_assert_eq!(back.identities, ids);
        prop_assert_eq!(back.message, m);
    }

    /// Any one changed byte in the signature or the four signed JSON frames is refused,
    /// before the JSON is parsed.
    #[test]
    fn any_changed_byte_in_a_signed_frame_is_refused(
        ids in identities(),
        m in message(),
        key in prop::collection::vec(any::<u8>(), 1..80),
        frame in 0usize..5,
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
    ) {
        let key = SigningKey::new(&key);
        let mut frames = wire::encode(&ids, &m, &key);
        let target = ids.len() + 1 + frame;
        let mut bytes = frames[target].to_vec();
        let i = at.index(bytes.len());
        bytes[i] ^= flip;
        frames[target] = Bytes::from(bytes);
        prop_assert!(matches!(
            wire::decode(&frames, &key),
            Err(WireError::Signature(SignatureError::SignatureMismatch))
        ));
    }

    #[test]
    fn legacy_text_round_trips(c in channel(), mut m in message()) {
        m.buffers.clear();
        let frame = websocket::encode(Encoding::Legacy, c, &m);
        prop_assert!(matches!(frame, Frame::Text(_)));
        prop_assert_eq!(websocket::decode(Encoding::Legacy, &frame).expect("decodes"), (c, m));
    }

    #[test]
    fn legacy_binary_round_trips(c in channel(), m in message()) {
        // Also with no buffers: the binary form is valid then too.
        let frame = Frame::Binary(websocket::encode_legacy_binary(c, &m));
        prop_assert_eq!(websocket::decode(Encoding::Legacy, &frame).expect("decodes"), (c, m));
    }

    #[test]
    fn v1_round_trips(c in channel(), m in message()) {
        let frame = websocket::encode(Encoding::V1, c, &m);
        prop_assert_eq!(websocket::decode(Encoding::V1, &frame).expect("decodes"), (c, m));
    }

    #[test]
    fn tcp_connection_file_round_trips(
        ip in text(),
        ports in prop::array::uniform5(1u16..),
        key in text(),
        kernel_name in text(),
        extra in prop::collection::vec((text(), json_value()), 0..3),
    ) {
        let info = connection(ip, ports, key, kernel_name, extra);
        let back = ConnectionInfo::from_json(&info.to_json()).expect("valid");
        prop_assert_eq!(&back, &info);
        prop_assert_eq!(
            back.endpoint(Channel::Shell),
            format!("tcp://{}:{}", info.ip, ports[0])
        );
    }

    #[test]
    fn ipc_connection_file_round_trips(
        path in "/[a-z0-9/._-]{0,80}",
        ports in prop::array::uniform5(1u16..),
        key in text(),
        extra in prop::collection::vec((text(), json_value()), 0..3),
    ) {
        let mut info = connection(path.clone(), ports, key, "python3".into(), extra);
        info.transport = kernelgate_protocol::Transport::Ipc;
        let back = ConnectionInfo::from_json(&info.to_json());
        let longest = Channel::ALL
            .iter()
            .map(|&c| format!("{path}-{}", info.port(c)).len())
            .max()
            .unwrap_or_default();
        if longest <= MAX_IPC_PATH {
            let back = back.expect("valid");
            prop_assert_eq!(&back, &info);
            prop_assert_eq!(
                back.endpoint(Channel::Heartbeat),
                format!("ipc://{path}-{}", ports[4])
            );
        } else {
            let refused = matches!(back, Err(ConnectionError::IpcPathTooLong { .. }));
            prop_assert!(refused);
        }
    }

    #[test]
    fn random_bytes_never_panic_a_decoder(
        bytes in prop::collection::vec(any::<u8>(), 0..256),
        frames in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..64), 0..9),
        delimiter_at in any::<prop::sample::Index>(),
        signed in any::<bool>(),
    ) {
        decode_everything(&bytes);
        let mut frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
        frames.insert(delimiter_at.index(frames.len() + 1), Bytes::from_static(DELIMITER));
        let key = if signed { SigningKey::new(b"k") } else { SigningKey::unsigned() };
        let _ = wire::decode(&frames, &key);
    }

    /// Random bytes rarely get past the first check; changed valid encodings do.
    #[test]
    fn changed_encodings_never_panic_a_decoder(
        c in channel(),
        m in message(),
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let edit = |mut bytes: Vec<u8>| {
            for (at, b) in &edits {
                if !bytes.is_empty() {
                    let i = at.index(bytes.len());
                    bytes[i] = *b;
                }
            }
            bytes
        };
        for encoded in [
            websocket::encode_v1(c, &m).to_vec(),
            websocket::encode_legacy_binary(c, &m).to_vec(),
            websocket::encode_legacy_json(c, &m).into_bytes(),
        ] {
            let changed = edit(encoded.clone());
            decode_everything(&changed);
            decode_everything(&encoded[..cut.index(encoded.len() + 1)]);
        }
        let key = SigningKey::unsigned();
        let frames: Vec<Bytes> = wire::encode(&[], &m, &key)
            .into_iter()
            .map(|f| Bytes::from(edit(f.to_vec())))
            .collect();
        let _ = wire::decode(&frames, &key);
    }
}

fn connection(
    ip: String,
    ports: [u16; 5],
    key: String,
    kernel_name: String,
    extra: Vec<(String, Value)>,
) -> ConnectionInfo {
    const KNOWN: [&str; 10] = [
        "transport",
        "ip",
        "shell_port",
        "iopub_port",
        "stdin_port",
        "control_port",
        "hb_port",
        "key",
        "signature_scheme",
        "kernel_name",
    ];
    ConnectionInfo {
        transport: kernelgate_protocol::Transport::Tcp,
        ip,
        shell_port: ports[0],
        iopub_port: ports[1],
        stdin_port: ports[2],
        control_port: ports[3],
        hb_port: ports[4],
        key,
        signature_scheme: "hmac-sha256".into(),
        kernel_name,
        extra: extra
            .into_iter()
            .filter(|(k, _)| !KNOWN.contains(&k.as_str()))
            .collect::<Map<_, _>>(),
    }
}

/// Feeds `bytes` to every byte-level decoder; only panics matter.
fn decode_everything(bytes: &[u8]) {
    let _ = ConnectionInfo::from_json(bytes);
    let binary = Frame::Binary(Bytes::copy_from_slice(bytes));
    let _ = websocket::decode(Encoding::V1, &binary);
    let _ = websocket::decode(Encoding::Legacy, &binary);
    let text = Frame::Text(String::from_utf8_lossy(bytes).into_owned());
    let _ = websocket::decode(Encoding::Legacy, &text);
    let _ = websocket::decode(Encoding::V1, &text);
}

/// Found by the `connection_file` fuzz target: serde_json's default float parser is not
/// always correctly rounded, so a number in a header or connection-file extra changed when
/// re-serialized. `float_roundtrip` (protocol/Cargo.toml) fixes it; this walks many f64
/// bit patterns through a header extra and back.
#[test]
fn floats_in_extras_survive_re_serialization() {
    let mut bits: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..20_000 {
        bits = bits
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let Some(n) = Number::from_f64(f64::from_bits(bits)) else {
            continue;
        };
        let mut header = Header::default();
        header.extra.insert("x".into(), Value::Number(n.clone()));
        let text = serde_json::to_string(&header).expect("serializes");
        let back: Header = serde_json::from_str(&text).expect("parses");
        assert_eq!(back.extra["x"], Value::Number(n), "{text}");
    }
}

/// Output text as programs write it: words, newlines, carriage returns, backspaces and
/// pieces of escape sequences, in any order.
fn terminal_text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            "[a-z ]{0,6}",
            Just("\n".to_owned()),
            Just("\r".to_owned()),
            Just("\r\n".to_owned()),
            Just("\u{8}".to_owned()),
            Just("\t".to_owned()),
            Just("\u{1b}".to_owned()),
            Just("\u{1b}[".to_owned()),
            Just("\u{1b}]".to_owned()),
            Just("\u{1b}\\".to_owned()),
            Just("\u{7}".to_owned()),
            Just("\u{9b}".to_owned()),
            "[0-9;?]{0,3}[mKGCDHJ]",
            any::<char>().prop_map(String::from),
        ],
        0..40,
    )
    .prop_map(|parts| parts.concat())
}

proptest! {
    /// Chunks cut anywhere (stream messages end where they end) give the text the whole
    /// gives, and what comes out has no control character but newlines and tabs.
    #[test]
    fn terminal_text_does_not_depend_on_chunks(text in terminal_text(), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..4)) {
        let whole = plain_text(&text);
        let chars: Vec<char> = text.chars().collect();
        let mut at: Vec<usize> = cuts.iter().map(|i| i.index(chars.len() + 1)).collect();
        at.sort_unstable();
        let mut terminal = Terminal::new();
        let mut out = String::new();
        let mut from = 0;
        for to in at.into_iter().chain([chars.len()]) {
            out += &terminal.push(&chars[from..to].iter().collect::<String>());
            from = to;
        }
        out += &terminal.finish();
        prop_assert_eq!(&out, &whole);
        prop_assert!(!whole.chars().any(|c| c.is_control() && c != '\n' && c != '\t'), "{:?}", whole);
        prop_assert!(plain_text(&whole) == whole, "plain text is a fixed point: {:?}", whole);
    }
}
