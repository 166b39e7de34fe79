//! The comms open on a kernel process (ipywidgets' widgets and its control comm, among
//! others), followed from the `comm_open` and `comm_close` messages both sides send, so
//! that when the process is replaced (a restart, a death, a resume from hibernation) the
//! clients are told each of them ended: the gateway sends the `comm_close` the old process
//! never will (docs/widgets.md).

use kernelgate_protocol::Message;
use std::collections::HashSet;

/// Most comms followed per kernel; past this new ones are not followed (a client then
/// learns of their end from the restart itself, as without the gateway's notice).
const MAX_COMMS: usize = 16_384;

#[derive(Debug, Default)]
pub struct Comms {
    open: HashSet<String>,
}

impl Comms {
    /// Follows one message from either side.
    pub fn observe(&mut self, message: &Message) {
        let msg_type = message.msg_type();
        if msg_type != "comm_open" && msg_type != "comm_close" {
            return;
        }
        let Ok(content) = message.content_as::<CommId>() else {
            return;
        };
        if content.comm_id.is_empty() {
            return;
        }
        if msg_type == "comm_open" {
            if self.open.len() < MAX_COMMS {
                self.open.insert(content.comm_id);
            }
        } else {
            self.open.remove(&content.comm_id);
        }
    }

    /// The comms open so far, forgotten: their process is gone.
    pub fn take(&mut self) -> Vec<String> {
        let mut ids: Vec<String> = self.open.drain().collect();
        ids.sort();
        ids
    }
}

#[derive(serde::Deserialize)]
struct CommId {
    #[serde(default)]
    comm_id: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelgate_protocol::{Header, RawJson};
    use serde_json::json;

    fn msg(msg_type: &str, content: serde_json::Value) -> Message {
        Message::new(
            Header::new(msg_type, "s", "u", "2026-01-01T00:00:00Z"),
            None,
            RawJson::from_value(&content),
        )
    }

    #[test]
    fn open_comms_are_those_opened_and_not_closed() {
        let mut comms = Comms::default();
        comms.observe(&msg(
            "comm_open",
            json!({"comm_id": "b", "target_name": "jupyter.widget"}),
        ));
        comms.observe(&msg(
            "comm_open",
            json!({"comm_id": "a", "target_name": "jupyter.widget.control"}),
        ));
        comms.observe(&msg("comm_open", json!({"comm_id": "c"})));
        comms.observe(&msg("comm_close", json!({"comm_id": "c"})));
        comms.observe(&msg("comm_msg", json!({"comm_id": "d"})));
        comms.observe(&msg("comm_open", json!([1, 2])));
        comms.observe(&msg("comm_open", json!({"comm_id": ""})));
        assert_eq!(comms.take(), vec!["a".to_owned(), "b".to_owned()]);
        assert!(comms.take().is_empty(), "taken once");
    }
}
