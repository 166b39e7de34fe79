use thiserror::Error;

/// Represents an error when encoding/decoding raw byte buffers and frames
#[non_exhaustive]
#[derive(Error, Debug)]
pub enum CodecError {
    #[error("{0}")]
    Command(&'static str),
    #[error("{0}")]
    Greeting(&'static str),
    #[error("{0}")]
    Mechanism(&'static str),
    #[error("{0}")]
    Decode(&'static str),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Other(&'static str),
    /// A peer sent a message larger than `SocketOptions::max_message_size`; it was refused
    /// from its frame headers, before its body was read, and the peer disconnected.
    #[error("inbound message exceeds the maximum message size of {limit} bytes")]
    MessageTooLarge { limit: usize },
}

pub(crate) type CodecResult<T> = Result<T, CodecError>;
