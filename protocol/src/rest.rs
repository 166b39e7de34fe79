//! The gateway's REST wire types beyond the agent API ([`crate::agent`]): Jupyter Server's
//! kernel model and create body, the approvals waiting, and packages (what an install did,
//! what a kernel reported). The gateway serializes them, and its client crate, its cluster
//! nodes (which merge each other's lists) and its audit trail read them back with the same
//! types. The OpenAPI schemas come from these types too (feature `openapi`).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

#[cfg(feature = "openapi")]
use utoipa::ToSchema;

/// The kernel model of Jupyter Server's REST API. The three activity fields are truthful:
/// JupyterLab's idle culler acts on them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct KernelModel {
    #[cfg_attr(feature = "openapi", schema(format = "uuid"))]
    pub id: String,
    /// The kernel spec it runs.
    #[cfg_attr(feature = "openapi", schema(example = "python3"))]
    pub name: String,
    /// ISO 8601, microseconds, UTC (`Z`).
    #[cfg_attr(feature = "openapi", schema(example = "2026-11-22T07:00:00.123456Z"))]
    pub last_activity: String,
    #[cfg_attr(feature = "openapi", schema(schema_with = execution_state_schema))]
    pub execution_state: String,
    /// WebSockets connected to it.
    pub connections: usize,
    /// Its state is on disk and it has no process; the next request that needs it brings
    /// it back (`execution_state` is `idle`).
    #[serde(default)]
    pub hibernated: bool,
    /// Why it could not hibernate last time it tried (variables that cannot be saved, the
    /// budget), until its next execution; `null` otherwise.
    #[serde(default)]
    pub hibernate_blocked: Option<String>,
    /// What a hibernation keeps: `memory` (the whole kernel, under an engine that
    /// checkpoints) or `namespace` (the variables its helper can save, and its files); for
    /// a hibernated kernel, what its state kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(example = "namespace"))]
    pub hibernation: Option<String>,
}

/// `execution_state` of a kernel another node did not describe in time: the cluster's
/// list shows the registry's row with this state.
pub const STATE_UNKNOWN: &str = "unknown";

#[cfg(feature = "openapi")]
fn execution_state_schema() -> utoipa::openapi::Object {
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::Type::String)
        .enum_values(Some(["starting", "idle", "busy", "restarting", "dead"]))
        .build()
}

/// The body of `POST /api/kernels`; no body (or `null`) is the default spec with no variables.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct CreateKernel {
    /// The kernel spec (`GET /api/kernelspecs`); the default spec when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(example = "python3"))]
    pub name: Option<String>,
    /// Environment variables for the kernel: only `KERNEL_*` names are kept (and checked);
    /// numbers and booleans are passed as their JSON text.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[cfg_attr(feature = "openapi", schema(value_type = HashMap<String, Value>))]
    pub env: BTreeMap<String, Value>,
    /// Start with the state of this snapshot (its id, or its name among the caller's):
    /// its own id, key and session, reseeded random state. A `memory` snapshot takes no
    /// `env`; `name`, if given, must be the snapshot's spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
}

/// A snapshot of a kernel's state (docs/snapshots.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SnapshotModel {
    #[cfg_attr(feature = "openapi", schema(format = "uuid"))]
    pub id: String,
    /// Unique among the key's snapshots: a new one of the same name replaces it.
    pub name: Option<String>,
    pub metadata: BTreeMap<String, String>,
    /// The kernel it was taken of (which may be gone).
    #[cfg_attr(feature = "openapi", schema(format = "uuid"))]
    pub kernel_id: String,
    /// The kernel spec a kernel started from it runs.
    #[cfg_attr(feature = "openapi", schema(example = "python3"))]
    pub kernelspec: String,
    /// `memory` (the whole kernel), `namespace` (the variables its helper could save, and
    /// the home's files) or `filesystem` (the files only).
    #[cfg_attr(feature = "openapi", schema(example = "memory"))]
    pub kind: String,
    /// Bytes on disk.
    pub size: u64,
    /// ISO 8601, UTC.
    pub created: String,
    /// What a lossy (`accept_loss`) snapshot left out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dropped: Vec<String>,
}

/// The body of `POST /api/kernels/{id}/snapshots`; no body takes a `full` one, unnamed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// `full` (default: everything the engine can keep) or `filesystem` (the home's files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(example = "full"))]
    pub mode: Option<String>,
    /// Under a Python-level snapshot, leave out (and name) the variables that cannot be
    /// saved instead of refusing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub accept_loss: bool,
}

/// A page of `GET /api/kernelgate/snapshots`, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct SnapshotPage {
    pub snapshots: Vec<SnapshotModel>,
    /// Pass as `next` for the following page; `null` on the last.
    pub next: Option<String>,
}

/// The body of `POST /api/kernels/{id}/fork`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ForkKernel {
    /// Kernels to start, 1 to 20.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 20, example = 3))]
    pub count: usize,
    /// As for a snapshot: under a Python-level one, leave out what cannot be saved.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub accept_loss: bool,
}

/// One fork: its kernel, or why it did not start (HTTP status and message).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ForkResult {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<KernelModel>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ForkError>,
}

/// Why one fork did not start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ForkError {
    pub status: u16,
    pub message: String,
}

/// The answer of `POST /api/kernels/{id}/fork`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Forks {
    /// What the fork's snapshot kept: `memory` or `namespace`.
    pub kind: String,
    /// What a lossy fork left out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dropped: Vec<String>,
    /// One per fork asked for, in no particular order.
    pub forks: Vec<ForkResult>,
}

/// One execution waiting for an administrator, as the approvals API lists it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Approval {
    /// What `POST /api/kernelgate/approvals/{id}` answers.
    #[cfg_attr(feature = "openapi", schema(format = "uuid"))]
    pub id: String,
    #[cfg_attr(feature = "openapi", schema(format = "uuid"))]
    pub kernel_id: String,
    /// The key that asked to run it.
    pub key: String,
    pub code: String,
    /// The matching rule's reason.
    pub reason: String,
    /// ISO 8601, microseconds, UTC.
    #[cfg_attr(feature = "openapi", schema(example = "2026-11-25T10:02:11.532114Z"))]
    pub requested_at: String,
}

/// A package and the version a kernel got.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct PackageVersion {
    pub name: String,
    pub version: String,
}

/// A requirement that was not installed, and why.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct PackageRefusal {
    pub requirement: String,
    pub reason: String,
}

/// What an install did (`POST /api/kernels/{id}/packages`, MCP's `install_packages`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Installed {
    /// Packages the kernel got now (the asked-for ones and what they bring).
    pub installed: Vec<PackageVersion>,
    /// Packages it had already (from the image or an earlier install).
    #[serde(default)]
    pub already: Vec<PackageVersion>,
    /// Requirements that were not installed, and why; when any is, nothing was installed.
    #[serde(default)]
    pub refused: Vec<PackageRefusal>,
}

/// What a kernel's installer said it did: the kernel's word, as the audit trail keeps it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct KernelReportedInstall {
    pub installed: Vec<PackageVersion>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub already: Vec<PackageVersion>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<PackageRefusal>,
    pub exit_code: i64,
}

/// The HTTP headers the gateway reads and writes beyond Jupyter's: its clients', and those
/// of calls between a cluster's nodes (signed, docs/cluster.md).
pub mod headers {
    /// An MCP session over Streamable HTTP (the answer to `initialize` carries it).
    pub const MCP_SESSION: &str = "mcp-session-id";
    /// E2B's sandbox addressing when the host name does not carry it (docs/e2b.md).
    pub const E2B_SANDBOX_ID: &str = "e2b-sandbox-id";
    pub const E2B_SANDBOX_PORT: &str = "e2b-sandbox-port";
    /// E2B's control plane key.
    pub const E2B_API_KEY: &str = "x-api-key";

    /// Every internal header starts with this; the entry node removes them from client requests.
    pub const HEADER_PREFIX: &str = "x-kernelgate-";
    pub const KEY_HEADER: &str = "x-kernelgate-key";
    pub const ENTRY_HEADER: &str = "x-kernelgate-entry";
    pub const REQUEST_ID_HEADER: &str = "x-kernelgate-request-id";
    pub const NONCE_HEADER: &str = "x-kernelgate-nonce";
    pub const TIMESTAMP_HEADER: &str = "x-kernelgate-timestamp";
    pub const REGISTERED_HEADER: &str = "x-kernelgate-entry-registered";
    pub const DESTINATION_HEADER: &str = "x-kernelgate-destination";
    pub const INCARNATION_HEADER: &str = "x-kernelgate-incarnation";
    pub const BODY_HEADER: &str = "x-kernelgate-body-sha256";
    /// In the owner's `101` to a forwarded upgrade: what the entry node's first frame answers.
    pub const CHALLENGE_HEADER: &str = "x-kernelgate-challenge";
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_kernel_model_reads_back_as_jupyter_server_writes_it() {
        // Jupyter Server's own model has neither of our hibernation fields.
        let theirs = json!({
            "id": "6b0f1d4e-1111-4222-8333-444455556666", "name": "python3",
            "last_activity": "2026-11-22T07:00:00.123456Z",
            "execution_state": "idle", "connections": 1,
        });
        let model: KernelModel = serde_json::from_value(theirs).expect("a kernel model");
        assert_eq!(model.execution_state, "idle");
        assert!(!model.hibernated && model.hibernate_blocked.is_none());
        let ours = serde_json::to_value(&model).expect("json");
        assert_eq!(ours["hibernate_blocked"], Value::Null);
        assert_eq!(ours["connections"], 1);
    }

    #[test]
    fn an_empty_create_body_is_the_default_spec() {
        let body: CreateKernel = serde_json::from_value(json!({})).expect("a body");
        assert_eq!(body, CreateKernel::default());
        assert_eq!(serde_json::to_value(&body).expect("json"), json!({}));
        let named: CreateKernel =
            serde_json::from_value(json!({"name": "python3", "env": {"KERNEL_X": 1}}))
                .expect("a body");
        assert_eq!(named.name.as_deref(), Some("python3"));
        assert_eq!(named.env["KERNEL_X"], json!(1));
    }
}
