//! The vendored ZeroMQ reader on arbitrary bytes from a kernel's end of an ipc socket, with
//! the message size limit the gateway sets: it may refuse them, never panic, and never
//! hands over a message larger than the limit.
#![no_main]

use futures::executor::block_on;
use futures::StreamExt;
use kernelgate_protocol_fuzz::zmq_input;
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;
use zeromq::__bench::{zmq_framed_read_with_options, Message};
use zeromq::SocketOptions;

/// Small, so that the fuzzer reaches the refusal path with small inputs.
const LIMIT: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let mut options = SocketOptions::default();
    options.max_message_size(LIMIT);
    let bytes = zmq_input(data);
    let mut reader = zmq_framed_read_with_options(futures::io::Cursor::new(bytes), Arc::new(options));
    block_on(async {
        while let Some(item) = reader.next().await {
            match item {
                Ok(Message::Message(m)) => {
                    let size: usize = m.iter().map(|f| f.len()).sum();
                    assert!(size <= LIMIT, "a {size}-byte message passed a {LIMIT}-byte limit");
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    });
});
