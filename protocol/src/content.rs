//! Typed views of the messages the gateway acts on. Each keeps unknown fields in `extra`,
//! so parsing and writing one back loses nothing. Spec: "Messages on the shell (ROUTER/DEALER)
//! channel", "Messages on the IOPub (PUB/SUB) channel", "Messages on the stdin channel".

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

type Extra = Map<String, Value>;

fn yes() -> bool {
    true
}

/// `execution_state` of a `status` message, and of a kernel as the REST API reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExecutionState {
    Starting,
    Idle,
    Busy,
    Restarting,
    Dead,
}

impl ExecutionState {
    pub fn as_str(self) -> &'static str {
        match self {
            ExecutionState::Starting => "starting",
            ExecutionState::Idle => "idle",
            ExecutionState::Busy => "busy",
            ExecutionState::Restarting => "restarting",
            ExecutionState::Dead => "dead",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub execution_state: ExecutionState,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KernelInfoReply {
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub protocol_version: String,
    #[serde(default)]
    pub implementation: String,
    #[serde(default)]
    pub implementation_version: String,
    #[serde(default)]
    pub language_info: Value,
    #[serde(default)]
    pub banner: String,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecuteRequest {
    pub code: String,
    #[serde(default)]
    pub silent: bool,
    #[serde(default = "yes")]
    pub store_history: bool,
    #[serde(default)]
    pub user_expressions: Map<String, Value>,
    #[serde(default = "yes")]
    pub allow_stdin: bool,
    #[serde(default = "yes")]
    pub stop_on_error: bool,
    #[serde(flatten)]
    pub extra: Extra,
}

impl ExecuteRequest {
    /// A plain request, as a notebook cell sends it.
    pub fn new(code: &str) -> Self {
        ExecuteRequest {
            code: code.to_owned(),
            silent: false,
            store_history: true,
            user_expressions: Map::new(),
            allow_stdin: true,
            stop_on_error: true,
            extra: Map::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecuteReply {
    pub status: String,
    #[serde(default)]
    pub execution_count: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ename: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evalue: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceback: Option<Vec<String>>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stream {
    /// `stdout` or `stderr`.
    pub name: String,
    pub text: String,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DisplayData {
    /// MIME type to value; `image/png` is base64 text.
    pub data: Map<String, Value>,
    #[serde(default)]
    pub metadata: Map<String, Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transient: Option<Value>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecuteResult {
    #[serde(default)]
    pub execution_count: Option<i64>,
    pub data: Map<String, Value>,
    #[serde(default)]
    pub metadata: Map<String, Value>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// The content of an iopub `error` message (and of error replies).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorContent {
    pub ename: String,
    pub evalue: String,
    #[serde(default)]
    pub traceback: Vec<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputRequest {
    #[serde(default)]
    pub prompt: String,
    #[serde(default)]
    pub password: bool,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputReply {
    pub value: String,
    #[serde(flatten)]
    pub extra: Extra,
}

/// `interrupt_request` has empty content; the reply carries a status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InterruptReply {
    #[serde(default)]
    pub status: String,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShutdownRequest {
    #[serde(default)]
    pub restart: bool,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShutdownReply {
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub restart: bool,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CommInfoRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_name: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommInfoReply {
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub comms: Map<String, Value>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn round_trip<T: Serialize + for<'de> Deserialize<'de>>(v: Value) {
        let typed: T = serde_json::from_value(v.clone()).expect("parses");
        assert_eq!(serde_json::to_value(&typed).expect("serializes"), v);
    }

    #[test]
    fn views_keep_unknown_fields() {
        round_trip::<Status>(json!({"execution_state": "busy", "x": 1}));
        round_trip::<Stream>(json!({"name": "stdout", "text": "hi\n", "x": [1]}));
        round_trip::<ErrorContent>(
            json!({"ename": "ZeroDivisionError", "evalue": "division by zero", "traceback": ["a"], "x": 1}),
        );
        round_trip::<ExecuteRequest>(json!({"code": "1", "silent": false, "store_history": true,
            "user_expressions": {}, "allow_stdin": false, "stop_on_error": true, "cell_id": "c1"}));
        round_trip::<DisplayData>(
            json!({"data": {"image/png": "iVBO"}, "metadata": {}, "transient": {"display_id": "d"}}),
        );
        round_trip::<InputRequest>(json!({"prompt": "name? ", "password": false}));
        round_trip::<ShutdownRequest>(json!({"restart": true}));
    }

    #[test]
    fn execute_request_defaults_follow_the_spec() {
        let r: ExecuteRequest = serde_json::from_value(json!({"code": "x"})).expect("parses");
        assert!(r.store_history && r.allow_stdin && r.stop_on_error && !r.silent);
    }

    #[test]
    fn unknown_states_are_errors_not_panics() {
        assert!(serde_json::from_value::<Status>(json!({"execution_state": "napping"})).is_err());
    }
}
