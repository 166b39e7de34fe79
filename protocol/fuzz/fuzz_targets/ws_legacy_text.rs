//! The legacy WebSocket JSON text frame, via `websocket::decode`.
#![no_main]

use kernelgate_protocol::websocket::{self, Encoding, Frame};
use kernelgate_protocol_fuzz::assert_ws_fixed_point;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok((channel, message)) = websocket::decode(Encoding::Legacy, &Frame::Text(text.into())) {
        assert_ws_fixed_point(Encoding::Legacy, channel, &message);
    }
});
