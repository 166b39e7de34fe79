//! The five kernel channels and their names on the WebSocket.

use std::fmt;
use std::str::FromStr;

/// One of a kernel's sockets. Spec: "Introduction" of the messaging doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    Shell,
    IoPub,
    Stdin,
    Control,
    Heartbeat,
}

impl Channel {
    pub const ALL: [Channel; 5] = [
        Channel::Shell,
        Channel::IoPub,
        Channel::Stdin,
        Channel::Control,
        Channel::Heartbeat,
    ];

    /// The name used in the `channel` field of WebSocket messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Channel::Shell => "shell",
            Channel::IoPub => "iopub",
            Channel::Stdin => "stdin",
            Channel::Control => "control",
            Channel::Heartbeat => "hb",
        }
    }
}

impl fmt::Display for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A channel name that is not one of the five.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown channel {0:?}: expected shell, iopub, stdin, control or hb")]
pub struct UnknownChannel(pub String);

impl FromStr for Channel {
    type Err = UnknownChannel;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Channel::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| UnknownChannel(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for c in Channel::ALL {
            assert_eq!(c.as_str().parse::<Channel>(), Ok(c));
        }
        assert_eq!(
            "bogus".parse::<Channel>(),
            Err(UnknownChannel("bogus".into()))
        );
    }
}
