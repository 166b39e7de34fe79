//! Connection files: where a kernel's five sockets are and how messages are signed.
//! Spec: "Connection files" in the jupyter_client docs (kernels.html).

use crate::channel::Channel;
use crate::signature::SigningKey;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// How the kernel's sockets are reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    Tcp,
    /// Unix domain sockets; the endpoint is `ipc://<ip>-<port>`.
    Ipc,
}

/// The longest Unix socket path Linux accepts (`sun_path` is 108 bytes with the NUL).
pub const MAX_IPC_PATH: usize = 107;

#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error("connection file is not valid: {0}")]
    Invalid(#[from] serde_json::Error),
    #[error("signature scheme {0:?} is not supported; use hmac-sha256")]
    UnsupportedScheme(String),
    #[error("{channel} port is 0; every port must be set")]
    MissingPort { channel: Channel },
    #[error("ipc socket path {path:?} is {len} bytes; Unix sockets allow {MAX_IPC_PATH}")]
    IpcPathTooLong { path: String, len: usize },
}

/// The contents of a kernel connection file. Unknown fields are kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConnectionInfo {
    pub transport: Transport,
    pub ip: String,
    pub shell_port: u16,
    pub iopub_port: u16,
    pub stdin_port: u16,
    pub control_port: u16,
    pub hb_port: u16,
    pub key: String,
    pub signature_scheme: String,
    #[serde(default)]
    pub kernel_name: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ConnectionInfo {
    /// An ipc connection whose sockets are `<path_prefix>-1` .. `<path_prefix>-5`.
    pub fn ipc(path_prefix: &str, key: String, kernel_name: &str) -> Self {
        ConnectionInfo {
            transport: Transport::Ipc,
            ip: path_prefix.to_owned(),
            shell_port: 1,
            iopub_port: 2,
            stdin_port: 3,
            control_port: 4,
            hb_port: 5,
            key,
            signature_scheme: "hmac-sha256".to_owned(),
            kernel_name: kernel_name.to_owned(),
            extra: Map::new(),
        }
    }

    /// Parses and checks a connection file.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ConnectionError> {
        let info: ConnectionInfo = serde_json::from_slice(bytes)?;
        info.validate()?;
        Ok(info)
    }

    pub fn to_json(&self) -> Vec<u8> {
        // Strings, integers and JSON values only: serialization cannot fail.
        serde_json::to_vec_pretty(self).unwrap_or_default()
    }

    /// Checks what would otherwise fail later and silently (a too-long ipc path makes
    /// zmq connect to nothing).
    pub fn validate(&self) -> Result<(), ConnectionError> {
        if self.signature_scheme != "hmac-sha256" {
            return Err(ConnectionError::UnsupportedScheme(
                self.signature_scheme.clone(),
            ));
        }
        for channel in Channel::ALL {
            if self.port(channel) == 0 {
                return Err(ConnectionError::MissingPort { channel });
            }
            if self.transport == Transport::Ipc {
                let path = self.ipc_path(channel);
                if path.len() > MAX_IPC_PATH {
                    let len = path.len();
                    return Err(ConnectionError::IpcPathTooLong { path, len });
                }
            }
        }
        Ok(())
    }

    pub fn port(&self, channel: Channel) -> u16 {
        match channel {
            Channel::Shell => self.shell_port,
            Channel::IoPub => self.iopub_port,
            Channel::Stdin => self.stdin_port,
            Channel::Control => self.control_port,
            Channel::Heartbeat => self.hb_port,
        }
    }

    fn ipc_path(&self, channel: Channel) -> String {
        format!("{}-{}", self.ip, self.port(channel))
    }

    /// The ZeroMQ endpoint of one channel, e.g. `tcp://127.0.0.1:5555` or
    /// `ipc:///run/kernel/kernel-1`.
    pub fn endpoint(&self, channel: Channel) -> String {
        match self.transport {
            Transport::Tcp => format!("tcp://{}:{}", self.ip, self.port(channel)),
            Transport::Ipc => format!("ipc://{}", self.ipc_path(channel)),
        }
    }

    pub fn signing_key(&self) -> SigningKey {
        SigningKey::new(self.key.as_bytes())
    }

    /// The same kernel seen from another mount point (host vs. container path).
    pub fn with_ip(&self, ip: &str) -> Self {
        ConnectionInfo {
            ip: ip.to_owned(),
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_jupyter_client_tcp_file() {
        let text = br#"{"shell_port": 53794, "iopub_port": 53795, "stdin_port": 53796,
            "control_port": 53797, "hb_port": 53798, "ip": "127.0.0.1",
            "key": "a0436f6c-1916d0a1d2f2b3c0", "transport": "tcp",
            "signature_scheme": "hmac-sha256", "kernel_name": "python3",
            "jupyter_session": "x"}"#;
        let info = ConnectionInfo::from_json(text).expect("valid");
        assert_eq!(info.endpoint(Channel::IoPub), "tcp://127.0.0.1:53795");
        assert_eq!(info.extra.get("jupyter_session"), Some(&Value::from("x")));
        let again = ConnectionInfo::from_json(&info.to_json()).expect("valid");
        assert_eq!(again, info);
    }

    #[test]
    fn ipc_endpoints_and_limits() {
        let info = ConnectionInfo::ipc("/run/kernel/kernel", "k".into(), "python3");
        assert_eq!(info.endpoint(Channel::Shell), "ipc:///run/kernel/kernel-1");
        assert_eq!(
            info.endpoint(Channel::Heartbeat),
            "ipc:///run/kernel/kernel-5"
        );
        let long = info.with_ip(&format!("/{}", "d".repeat(110)));
        assert!(matches!(
            long.validate(),
            Err(ConnectionError::IpcPathTooLong { .. })
        ));
    }

    #[test]
    fn rejects_other_schemes_and_zero_ports() {
        let mut info = ConnectionInfo::ipc("/k", "k".into(), "python3");
        info.signature_scheme = "hmac-md5".into();
        assert!(matches!(
            info.validate(),
            Err(ConnectionError::UnsupportedScheme(_))
        ));
        let mut info = ConnectionInfo::ipc("/k", "k".into(), "python3");
        info.hb_port = 0;
        assert!(matches!(
            info.validate(),
            Err(ConnectionError::MissingPort {
                channel: Channel::Heartbeat
            })
        ));
        assert!(ConnectionInfo::from_json(b"{\"transport\":\"udp\"}").is_err());
    }
}
