//! What the fuzz targets share: how one fuzz input becomes wire frames, and the checks
//! every target makes on what a decoder accepted.

use bytes::Bytes;
use kernelgate_protocol::websocket::{self, Encoding, Frame};
use kernelgate_protocol::{Channel, Message, SigningKey};

/// Separates frames in a `wire_decode` input; `tests/golden/generate.py` writes its seeds
/// with the same bytes.
pub const FRAME_SEPARATOR: &[u8] = b"\n--frame--\n";

/// The key of the golden vectors, so seeds signed by jupyter_client verify.
pub const GOLDEN_KEY: &[u8] = b"5f0c2a3e-9b1d-4c7e-8f60-golden-key";

/// A `wire_decode` input: the first byte picks the key (even: the golden key, odd:
/// unsigned, so mutated JSON gets past the signature to the parsers), the rest is frames.
pub fn wire_input(data: &[u8]) -> (SigningKey, Vec<Bytes>) {
    let Some((&selector, rest)) = data.split_first() else {
        return (SigningKey::unsigned(), Vec::new());
    };
    let key = if selector % 2 == 0 {
        SigningKey::new(GOLDEN_KEY)
    } else {
        SigningKey::unsigned()
    };
    let mut frames = Vec::new();
    let mut rest = rest;
    while let Some(at) = find(rest, FRAME_SEPARATOR) {
        frames.push(Bytes::copy_from_slice(&rest[..at]));
        rest = &rest[at + FRAME_SEPARATOR.len()..];
    }
    frames.push(Bytes::copy_from_slice(rest));
    (key, frames)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Whatever a WebSocket decoder accepted, encoding it again in the same encoding and
/// decoding that gives the same channel and message.
pub fn assert_ws_fixed_point(encoding: Encoding, channel: Channel, message: &Message) {
    let frame = match encoding {
        Encoding::V1 => Frame::Binary(websocket::encode_v1(channel, message)),
        Encoding::Legacy if message.buffers.is_empty() => {
            Frame::Text(websocket::encode_legacy_json(channel, message))
        }
        Encoding::Legacy => Frame::Binary(websocket::encode_legacy_binary(channel, message)),
    };
    match websocket::decode(encoding, &frame) {
        Ok((c, m)) => {
            assert_eq!(c, channel);
            assert_eq!(&m, message);
        }
        Err(e) => panic!("our own {encoding:?} encoding of an accepted message fails: {e}"),
    }
}

/// A ZMTP 3.0 greeting offering the NULL mechanism, as ipykernel's libzmq sends it.
pub const ZMTP_GREETING: [u8; 64] = {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12] = b'N';
    g[13] = b'U';
    g[14] = b'L';
    g[15] = b'L';
    g
};

/// A `zmq_stream` input: the first byte picks the start (even: a valid greeting comes
/// first, so mutations reach the commands and frames; odd: the bytes as they are).
pub fn zmq_input(data: &[u8]) -> Vec<u8> {
    match data.split_first() {
        Some((&selector, rest)) if selector % 2 == 0 => [&ZMTP_GREETING[..], rest].concat(),
        Some((_, rest)) => rest.to_vec(),
        None => Vec::new(),
    }
}
