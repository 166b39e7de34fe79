//! `wire::decode` on arbitrary frames; whatever it accepts re-encodes to frames that
//! decode to the same message.
#![no_main]

use kernelgate_protocol::wire;
use kernelgate_protocol_fuzz::wire_input;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (key, frames) = wire_input(data);
    if let Ok(decoded) = wire::decode(&frames, &key) {
        let again = wire::encode(&decoded.identities, &decoded.message, &key);
        match wire::decode(&again, &key) {
            Ok(back) => assert_eq!(back, decoded),
            Err(e) => panic!("re-encoded frames fail to decode: {e}"),
        }
    }
});
