//! `ConnectionInfo::from_json` on arbitrary bytes; whatever it accepts survives
//! `to_json` and gives an endpoint for every channel.
#![no_main]

use kernelgate_protocol::{Channel, ConnectionInfo};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(info) = ConnectionInfo::from_json(data) {
        for channel in Channel::ALL {
            let _ = info.endpoint(channel);
        }
        match ConnectionInfo::from_json(&info.to_json()) {
            Ok(back) => assert_eq!(back, info),
            Err(e) => panic!("to_json of an accepted file is refused: {e}"),
        }
    }
});
