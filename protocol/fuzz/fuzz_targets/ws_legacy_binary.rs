//! The legacy WebSocket binary frame (u32-BE offsets, JSON, buffers), via
//! `websocket::decode`.
#![no_main]

use bytes::Bytes;
use kernelgate_protocol::websocket::{self, Encoding, Frame};
use kernelgate_protocol_fuzz::assert_ws_fixed_point;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let frame = Frame::Binary(Bytes::copy_from_slice(data));
    if let Ok((channel, message)) = websocket::decode(Encoding::Legacy, &frame) {
        assert_ws_fixed_point(Encoding::Legacy, channel, &message);
    }
});
