//! E2B's wire shapes, for the gateway's E2B-compatible surface: the code interpreter's
//! NDJSON lines, sandbox access tokens, the sandbox-plane address forms and the mapping of
//! `/home/user/...` paths onto a kernel's working directory. No I/O: the caller brings the
//! clock (timestamps) and the secret.

use crate::content::ErrorContent;
use crate::execution::Display;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use sha2::Sha256;
use std::collections::BTreeMap;
#[cfg(feature = "openapi")]
use utoipa::ToSchema;

/// The port of envd (files, health, filesystem RPC) in the SDK's sandbox addresses.
pub const ENVD_PORT: u16 = 49983;
/// The port of the code interpreter (`/execute`, `/contexts`).
pub const INTERPRETER_PORT: u16 = 49999;
/// The home every E2B path is written against; it is the kernel's working directory.
pub const HOME: &str = "/home/user";

/// The body of `POST /v2/sandboxes`: every field E2B's SDK sends. Those a Kernelgate
/// sandbox cannot honour (a network, MCP servers, volumes) are refused by name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    /// `code-interpreter-v1` and `base` are the gateway's default kernel spec; a snapshot's
    /// id (or name among the key's snapshots) starts the sandbox with its state; another
    /// name is a kernel spec's (404 when there is none).
    #[serde(rename = "templateID")]
    #[cfg_attr(feature = "openapi", schema(example = "code-interpreter-v1"))]
    pub template_id: String,
    /// Seconds until the sandbox ends (1 to 86400; default 300).
    #[cfg_attr(feature = "openapi", schema(example = 300))]
    pub timeout: Option<u64>,
    /// Kept with the sandbox, shown in listings and matched by the list's `metadata` filter.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Set in the kernel's process (`os.environ`).
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    /// `true` (`lifecycle` `on_timeout: pause`): the timeout pauses the sandbox (its kernel
    /// hibernates) instead of ending it; a connect resumes it.
    pub auto_pause: Option<bool>,
    /// `{"enabled": false}` is refused: a paused sandbox resumes on its next request.
    pub auto_resume: Option<Value>,
    /// `false` (a files-only pause) is refused: a pause keeps all the engine can keep.
    pub auto_pause_memory: Option<Value>,
    /// Absent or `false` only: the sandbox has no network by design.
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    /// Refused unless empty: the sandbox has no network by design.
    pub network: Option<Value>,
    /// Refused unless empty: the sandbox starts no MCP servers.
    pub mcp: Option<Value>,
    /// Refused unless empty: the sandbox holds no cloud credentials.
    pub iam: Option<Value>,
    /// Refused unless empty: a sandbox sees only its own home.
    pub volume_mounts: Option<Vec<Value>>,
}

/// The answer to a create or a connect: what the SDK needs to reach the sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SandboxCreated {
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// The sandbox's id: its kernel's id (`/api/kernels/{id}` shows it too).
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    /// Always `kernelgate`.
    #[serde(rename = "clientID")]
    pub client_id: String,
    /// The envd protocol variants the gateway serves.
    pub envd_version: String,
    /// The sandbox plane's `X-Access-Token`: HMAC-SHA256 of the sandbox id under the
    /// gateway's (or the cluster's) token key.
    pub envd_access_token: String,
    /// The same token, which the code interpreter sends as `E2B-Traffic-Access-Token`.
    pub traffic_access_token: String,
}

/// A sandbox as `GET /v2/sandboxes` lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ListedSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    /// RFC 3339, UTC.
    pub started_at: String,
    /// When it ends unless its timeout is moved; RFC 3339, UTC.
    pub end_at: String,
    /// The key's CPU limit, rounded up (1 without one).
    pub cpu_count: u64,
    /// The key's memory limit (0: the gateway's).
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    /// Always 0: the home is a size-limited tmpfs of the gateway's settings.
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    /// Always `running`.
    pub state: String,
    pub envd_version: String,
    pub metadata: BTreeMap<String, String>,
}

/// One sandbox, as `GET /sandboxes/{id}` answers: its listing, and its tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    #[serde(flatten)]
    pub listed: ListedSandbox,
    pub envd_access_token: String,
    pub traffic_access_token: String,
    /// Always `false`.
    pub allow_internet_access: bool,
}

/// The body of `POST /sandboxes/{id}/timeout`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SandboxTimeout {
    /// Seconds from now until the sandbox ends (1 to 86400).
    #[cfg_attr(feature = "openapi", schema(example = 600))]
    pub timeout: u64,
}

/// The body of `POST /v2/sandboxes/{id}/connect` (it may be empty).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SandboxConnect {
    /// Seconds from now: moves the sandbox's end later, never earlier (1 to 86400).
    pub timeout: Option<u64>,
    /// `false` (the SDK's `on_resume="reboot"`): a paused sandbox resumes as a fresh kernel
    /// with its files; absent or `true`, with its state.
    pub memory: Option<bool>,
}

/// The body of `POST /sandboxes/{id}/pause` (it may be empty).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SandboxPause {
    /// `false` (a filesystem-only pause) is refused: a pause keeps all the engine can keep;
    /// a connect with `on_resume="reboot"` then starts fresh with the files.
    pub memory: Option<bool>,
    /// Accepted: a kernel that does not answer is not paused in any case.
    pub require_healthy_guest: Option<bool>,
}

/// The body of `POST /sandboxes/{id}/snapshots` (it may be empty).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SandboxSnapshotRequest {
    /// Unique among the key's snapshots: a new one of the same name replaces the older.
    pub name: Option<String>,
    /// `false`: the home's files only (a `filesystem` snapshot); absent or `true`: all the
    /// engine can keep (the whole kernel under the gVisor engine, its variables and files
    /// under Docker).
    pub memory: Option<bool>,
}

/// A snapshot, as E2B's snapshot calls answer it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SnapshotInfo {
    /// The snapshot's id: a create with it as `templateID` starts a sandbox with its state.
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    /// Its name, when it has one.
    pub names: Vec<String>,
}

/// The body of `POST /sandboxes/{id}/fork`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SandboxForkRequest {
    /// Seconds until each fork ends (1 to 86400; default 300).
    pub timeout: Option<u64>,
    /// How many sandboxes (1 to 20; default 1).
    pub count: Option<usize>,
}

/// One fork: its sandbox, or why it did not start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SandboxForkResult {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<SandboxCreated>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<E2bErrorBody>,
}

/// An error answer of E2B's control plane: the gateway's error body, plus the status as
/// `code` (which E2B's SDK reads) on the answers of the control plane's own handlers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct E2bErrorBody {
    /// The HTTP status; absent on what the layers in front of every route answer (an
    /// undecodable path, an oversized request), which carry `reason` and `message` only.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(example = 404))]
    pub code: Option<u16>,
    #[cfg_attr(feature = "openapi", schema(example = "Not Found"))]
    pub reason: String,
    #[cfg_attr(
        feature = "openapi",
        schema(example = "sandbox 2f0c8a1e-8d2b-4c11-9d3e-5b6f7a8b9c0d not found")
    )]
    pub message: String,
}

/// MIME types and the result field the SDK reads them from.
const MIME_FIELDS: [(&str, &str); 10] = [
    ("text/plain", "text"),
    ("text/html", "html"),
    ("text/markdown", "markdown"),
    ("image/svg+xml", "svg"),
    ("image/png", "png"),
    ("image/jpeg", "jpeg"),
    ("application/pdf", "pdf"),
    ("text/latex", "latex"),
    ("application/json", "json"),
    ("application/javascript", "javascript"),
];

/// A `stdout` or `stderr` line.
pub fn stream_line(stderr: bool, text: &str, timestamp: &str) -> Value {
    json!({
        "type": if stderr { "stderr" } else { "stdout" },
        "text": text,
        "timestamp": timestamp,
    })
}

/// A `result` line: each MIME type the SDK knows in its field, the others under `extra`.
pub fn result_line(display: &Display) -> Value {
    let mut line = Map::new();
    line.insert("type".into(), "result".into());
    let mut extra = Map::new();
    for (mime, value) in &display.data {
        match MIME_FIELDS.iter().find(|(m, _)| m == mime) {
            Some((_, field)) => {
                line.insert((*field).into(), joined(value));
            }
            None => {
                extra.insert(mime.clone(), value.clone());
            }
        }
    }
    line.insert("is_main_result".into(), display.is_result.into());
    if !extra.is_empty() {
        line.insert("extra".into(), Value::Object(extra));
    }
    Value::Object(line)
}

/// Jupyter allows a text MIME value as a list of lines; the SDK wants one string. JSON
/// values stay as they are.
fn joined(value: &Value) -> Value {
    match value {
        Value::Array(lines) if lines.iter().all(Value::is_string) => {
            Value::String(lines.iter().filter_map(Value::as_str).collect())
        }
        other => other.clone(),
    }
}

/// An `error` line: the traceback as one text, as the SDK keeps it.
pub fn error_line(error: &ErrorContent) -> Value {
    json!({
        "type": "error",
        "name": error.ename,
        "value": error.evalue,
        "traceback": error.traceback.join("\n"),
    })
}

/// The last line: the kernel's execution count.
pub fn count_line(execution_count: Option<i64>) -> Value {
    json!({"type": "number_of_executions", "execution_count": execution_count.unwrap_or(0)})
}

/// A sandbox's access token: HMAC-SHA256 of its id under the gateway's secret, hex. Any
/// node that holds the secret can check it; nothing needs to be stored.
pub fn access_token(secret: &[u8], sandbox_id: &str) -> String {
    hex::encode(mac(secret, sandbox_id).finalize().into_bytes())
}

/// Whether `token` is `sandbox_id`'s access token (compared in constant time).
pub fn token_matches(secret: &[u8], sandbox_id: &str, token: &str) -> bool {
    match hex::decode(token) {
        Ok(bytes) => mac(secret, sandbox_id).verify_slice(&bytes).is_ok(),
        Err(_) => false,
    }
}

/// What a cluster's token key is derived under: the token key is HMAC-SHA256 of this label
/// under the cluster secret, so every node holding the secret agrees on it, and neither a
/// token nor the key gives the cluster secret away (nor is the key ever the secret itself).
pub const CLUSTER_TOKEN_KEY_LABEL: &[u8] = b"kernelgate e2b sandbox tokens v1";

/// The key sandbox access tokens are made with on a node of the cluster with
/// `cluster_secret`.
pub fn token_key_of_cluster(cluster_secret: &[u8]) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(cluster_secret)
        .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    mac.update(CLUSTER_TOKEN_KEY_LABEL);
    mac.finalize().into_bytes().into()
}

fn mac(secret: &[u8], sandbox_id: &str) -> Hmac<Sha256> {
    // HMAC takes keys of any length.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    mac.update(b"e2b-sandbox:");
    mac.update(sandbox_id.as_bytes());
    mac
}

/// The port and sandbox id of a host of the form `<port>-<id>.<domain>` (a port is the
/// digits before the first `-`; the id runs to the first `.`).
pub fn host_address(host: &str) -> Option<(u16, &str)> {
    let host = host.split(':').next()?;
    let (port, rest) = host.split_once('-')?;
    let (id, domain) = rest.split_once('.')?;
    let port: u16 = port.parse().ok()?;
    (!id.is_empty() && !domain.is_empty()).then_some((port, id))
}

/// Why a path cannot be mapped into the working directory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: only paths under {HOME} (the sandbox's home, the kernel's working directory) are reachable")]
pub struct OutsideHome {
    pub path: String,
}

/// An E2B path as a path relative to the kernel's working directory: `/home/user/a/b` and
/// `a/b` are `a/b`, the home itself is `""`. Everything else absolute is refused; `..` is
/// left for the files layer to refuse.
pub fn relative_path(path: &str) -> Result<String, OutsideHome> {
    let rest = if let Some(rest) = path.strip_prefix(HOME) {
        if !(rest.is_empty() || rest.starts_with('/')) {
            return Err(OutsideHome { path: path.into() });
        }
        rest
    } else if path.starts_with('/')
        || path.starts_with('~') && path != "~" && !path.starts_with("~/")
    {
        return Err(OutsideHome { path: path.into() });
    } else {
        path.strip_prefix('~').unwrap_or(path)
    };
    Ok(rest
        .trim_start_matches('/')
        .trim_end_matches('/')
        .to_owned())
}

/// The E2B path of a path relative to the working directory.
pub fn absolute_path(relative: &str) -> String {
    match relative.trim_matches('/') {
        "" | "." => HOME.to_owned(),
        rel => format!("{HOME}/{rel}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn display(data: Value, is_result: bool) -> Display {
        Display {
            data: data.as_object().cloned().unwrap_or_default(),
            metadata: Map::new(),
            display_id: None,
            is_result,
            execution_count: Some(3),
        }
    }

    #[test]
    fn results_carry_each_mime_type_in_its_field_and_the_rest_as_extra() {
        let line = result_line(&display(
            json!({"text/plain": ["a", "b"], "image/png": "iVBOR", "application/vnd.x": {"k": 1}}),
            true,
        ));
        assert_eq!(
            line,
            json!({"type": "result", "text": "ab", "png": "iVBOR", "is_main_result": true,
                   "extra": {"application/vnd.x": {"k": 1}}})
        );
        let line = result_line(&display(json!({"application/json": {"a": [1]}}), false));
        assert_eq!(line["json"], json!({"a": [1]}));
        assert_eq!(line["is_main_result"], false);
    }

    #[test]
    fn errors_join_their_traceback() {
        let e = ErrorContent {
            ename: "ZeroDivisionError".into(),
            evalue: "division by zero".into(),
            traceback: vec!["one".into(), "two".into()],
            extra: Map::new(),
        };
        assert_eq!(
            error_line(&e),
            json!({"type": "error", "name": "ZeroDivisionError", "value": "division by zero",
                   "traceback": "one\ntwo"})
        );
        assert_eq!(
            count_line(Some(4)),
            json!({"type": "number_of_executions", "execution_count": 4})
        );
        assert_eq!(
            stream_line(true, "x\n", "t"),
            json!({"type": "stderr", "text": "x\n", "timestamp": "t"})
        );
    }

    #[test]
    fn tokens_check_out_only_for_their_sandbox_and_secret() {
        let token = access_token(b"secret", "abc");
        assert_eq!(token.len(), 64);
        assert!(token_matches(b"secret", "abc", &token));
        assert!(!token_matches(b"secret", "abd", &token));
        assert!(!token_matches(b"other", "abc", &token));
        assert!(!token_matches(b"secret", "abc", "not hex"));
        assert!(!token_matches(b"secret", "abc", ""));
    }

    #[test]
    fn a_cluster_secret_gives_every_node_the_same_token_key_and_never_itself() {
        let cluster_secret = [7u8; 32];
        let key = token_key_of_cluster(&cluster_secret);
        // Same secret, same key and the same tokens, on any node and after any restart.
        assert_eq!(key, token_key_of_cluster(&cluster_secret));
        let token = access_token(&key, "abc");
        assert_eq!(
            token,
            access_token(&token_key_of_cluster(&cluster_secret), "abc")
        );
        assert!(token_matches(
            &token_key_of_cluster(&cluster_secret),
            "abc",
            &token
        ));
        // Another cluster's secret: another key, and its tokens do not check out here.
        let other = token_key_of_cluster(&[8u8; 32]);
        assert_ne!(key, other);
        assert!(!token_matches(&other, "abc", &token));
        // The key is not the cluster secret, and tokens under the raw secret are not valid.
        assert_ne!(key, cluster_secret);
        assert!(!token_matches(
            &key,
            "abc",
            &access_token(&cluster_secret, "abc")
        ));
        assert!(!token_matches(&cluster_secret, "abc", &token));
    }

    #[test]
    fn hosts_name_a_port_and_a_sandbox() {
        assert_eq!(
            host_address("49999-1b4e28ba-2fa1-11d2-883f-0016d3cca427.sandbox.test:8888"),
            Some((49999, "1b4e28ba-2fa1-11d2-883f-0016d3cca427"))
        );
        assert_eq!(host_address("49983-abc.localhost"), Some((49983, "abc")));
        assert_eq!(host_address("127.0.0.1:8888"), None);
        assert_eq!(host_address("localhost"), None);
        assert_eq!(host_address("x-abc.localhost"), None);
        assert_eq!(host_address("49983-abc"), None);
    }

    #[test]
    fn paths_map_into_the_home_or_are_refused() {
        assert_eq!(
            relative_path("/home/user/a/b.txt").as_deref(),
            Ok("a/b.txt")
        );
        assert_eq!(relative_path("/home/user").as_deref(), Ok(""));
        assert_eq!(relative_path("/home/user/").as_deref(), Ok(""));
        assert_eq!(relative_path("a/b").as_deref(), Ok("a/b"));
        assert_eq!(relative_path("~/a").as_deref(), Ok("a"));
        assert!(relative_path("/etc/passwd").is_err());
        assert!(relative_path("/home/username/x").is_err());
        assert!(relative_path("/home").is_err());
        assert_eq!(absolute_path("a/b"), "/home/user/a/b");
        assert_eq!(absolute_path(""), "/home/user");
    }
}
