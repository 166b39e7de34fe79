//! The Jupyter messaging protocol (v5.3), with no I/O at all.
//!
//! Bytes in, checked messages out: the ZeroMQ wire format with its HMAC signature
//! ([`wire`]), connection files ([`connection`]), the WebSocket encodings that Jupyter
//! Server speaks to browsers and gateway clients ([`websocket`]), and typed views of the
//! few messages a gateway acts on ([`content`]). Everything else is relayed as raw JSON,
//! so fields this crate does not know about are never dropped or reordered. Outputs are
//! followed to a request's end ([`execution`]) and turned into plain text for readers that
//! are not terminals ([`terminal`]); widget displays become text ([`widget`]).
//!
//! The agent API's request, answer and NDJSON lines are typed once for the gateway and
//! its clients ([`agent`]).
//!
//! Spec: <https://jupyter-client.readthedocs.io/en/stable/messaging.html>

pub mod agent;
pub mod channel;
pub mod connection;
pub mod content;
pub mod e2b;
pub mod execution;
pub mod message;
pub mod rest;
pub mod signature;
pub mod terminal;
pub mod time;
pub mod websocket;
pub mod widget;
pub mod wire;

pub use channel::Channel;
pub use connection::{ConnectionInfo, Transport};
pub use execution::{Execution, Outcome};
pub use message::{Header, Message, MsgKind, RawJson, PROTOCOL_VERSION};
pub use signature::SigningKey;
