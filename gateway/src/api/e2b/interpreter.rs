//! The code interpreter (port 49999): `POST /execute` streams a run's outputs as E2B's
//! NDJSON lines while it runs; `/contexts` creates, lists, restarts and deletes code
//! contexts.
//!
//! A run is the agent API's run ([`runner::submit`]): queued per kernel, under the policy,
//! the output cap and the audit trail; a caller that hangs up has it interrupted.
//!
//! A context other than the default one is a namespace of its own in the same kernel
//! process: its code runs with IPython's user namespace swapped for the context's module
//! (kept on the shell object), so contexts share the process, its files, its memory limit
//! and its working directory, and never each other's variables. Per-run `env_vars` are set
//! around the run and put back after it. Both are done by [`WRAPPER`], in the same cell as
//! the code, so no other run can come in between.

use super::super::error::ApiError;
use super::super::extract::json_body;
use super::super::AppState;
use super::plane::SandboxCall;
use crate::kernels::runner::{self, Job, Progress};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{SecondsFormat, Utc};
use kernelgate_protocol::e2b::{self as wire, HOME};
use kernelgate_protocol::execution::Event;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Duration;

/// The id of the context a run without `context_id` uses.
pub const DEFAULT_CONTEXT: &str = "default";
/// A run ends (interrupted) after this long at most; the SDK's own deadline is usually
/// shorter, and its hanging up interrupts the run sooner.
const RUN_TIMEOUT: Duration = Duration::from_secs(3600);

/// Runs `CODE` in context `CONTEXT` (None: the default namespace) with `ENV` set, then puts
/// everything back. Its names live in a dictionary of their own, never in a namespace.
/// `RAN`: an earlier run made this context's namespace; if the kernel no longer has it (a
/// hibernation keeps the default namespace only; a kernel restart keeps none), the run
/// first says so on stderr rather than leaving a bare `NameError` to explain it.
const WRAPPER: &str = r#"
import builtins, os, sys, types
from IPython import get_ipython
shell = get_ipython()
saved_env = {k: os.environ.get(k) for k in ENV}
os.environ.update(ENV)
swapped = None
if CONTEXT is not None:
    spaces = shell.__dict__.setdefault("_kernelgate_e2b_contexts", {})
    module = spaces.get(CONTEXT)
    if module is None:
        if RAN:
            print(EMPTIED, file=sys.stderr)
        module = types.ModuleType("__main__")
        history, outputs = [], {}
        module.__dict__.update({"__builtins__": builtins, "get_ipython": get_ipython,
            "In": history, "_ih": history, "Out": outputs, "_oh": outputs, "_dh": []})
        spaces[CONTEXT] = module
    swapped = (shell.user_module, shell.user_ns)
    shell.user_module, shell.user_ns = module, module.__dict__
try:
    shell.run_cell(CODE, store_history=False)
finally:
    if swapped is not None:
        shell.user_module, shell.user_ns = swapped
    for k, v in saved_env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
"#;

/// A code context, as the SDK reads it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Context {
    pub id: String,
    pub language: String,
    pub cwd: String,
}

impl Context {
    fn default_one() -> Context {
        Context {
            id: DEFAULT_CONTEXT.into(),
            language: "python".into(),
            cwd: HOME.into(),
        }
    }
}

/// A Python string (or dict of strings) literal: JSON's escapes are Python's.
fn literal<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| "None".into())
}

/// Code that sets `env` in the kernel's process (the create's `envVars`).
pub fn set_environment(env: &BTreeMap<String, String>) -> String {
    format!(
        "import os as _kg_os\n_kg_os.environ.update({})\ndel _kg_os",
        literal(env)
    )
}

/// What a run in a context whose namespace the kernel lost prints first (on stderr).
fn emptied(context: &str) -> String {
    format!(
        "Kernelgate: code context {context} starts empty again: its variables are gone \
         because the sandbox's kernel was hibernated and resumed (a hibernation keeps the \
         default context's variables and the files, not other contexts' variables) or \
         restarted. See docs/e2b.md, \"Code contexts\"."
    )
}

/// A context to run in: its id, and whether an earlier run made its namespace.
#[derive(Debug, Clone, Copy)]
struct InContext<'a> {
    id: &'a str,
    ran: bool,
}

/// The cell that runs `code` in `context` with `env` set for the run.
fn wrapped(code: &str, context: Option<InContext<'_>>, env: &BTreeMap<String, String>) -> String {
    format!(
        "exec(compile({}, '<kernelgate-e2b>', 'exec'), {{'__name__': '__kernelgate_e2b__', \
         'CODE': {}, 'CONTEXT': {}, 'RAN': {}, 'EMPTIED': {}, 'ENV': {}}})",
        literal(&WRAPPER),
        literal(&code),
        context.map_or_else(|| "None".to_owned(), |c| literal(&c.id)),
        if context.is_some_and(|c| c.ran) {
            "True"
        } else {
            "False"
        },
        literal(&context.map(|c| emptied(c.id)).unwrap_or_default()),
        literal(env),
    )
}

fn python_only(language: Option<&str>) -> Result<(), ApiError> {
    match language.map(str::trim) {
        None | Some("") | Some("python") | Some("python3") => Ok(()),
        Some(other) => Err(ApiError::bad_request(format!(
            "language {other:?} is refused: Kernelgate sandboxes run Python (an IPython kernel) only"
        ))),
    }
}

#[derive(Debug, Deserialize)]
struct ExecuteBody {
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<BTreeMap<String, String>>,
}

/// `POST /execute`.
pub async fn execute(
    State(state): State<AppState>,
    call: SandboxCall,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body: ExecuteBody = json_body(&body, r#"{"code": "1+1"}"#)?;
    python_only(body.language.as_deref())?;
    let context = match body.context_id.as_deref() {
        None | Some(DEFAULT_CONTEXT) => None,
        Some(id) => {
            // Whether it is known, and whether a run made its namespace before this one
            // (recorded once: the records are written at every change).
            let Some(ran) = state.e2b.get(&call.id).and_then(|s| {
                s.contexts
                    .contains_key(id)
                    .then(|| s.contexts_run.contains(id))
            }) else {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!("context {id} not found"),
                ));
            };
            if !ran {
                state
                    .e2b
                    .update(&call.id, |s| s.contexts_run.insert(id.to_owned()));
            }
            Some(InContext { id, ran })
        }
    };
    let env = body.env_vars.unwrap_or_default();
    let code = match (context, env.is_empty()) {
        (None, true) => body.code,
        (context, _) => wrapped(&body.code, context, &env),
    };
    let rx = runner::submit(
        &state.tracker,
        state.kernels.clone(),
        call.live.clone(),
        Job {
            code,
            timeout: RUN_TIMEOUT,
            key: call.key.clone(),
            agent_id: None,
        },
    )
    .await;
    let lines = futures::stream::unfold(rx, |mut rx| async move {
        loop {
            let line = match rx.recv().await? {
                Progress::Event(event) => match line_of(&event) {
                    Some(line) => line,
                    None => continue,
                },
                Progress::End(end) => wire::count_line(end.execution_count),
            };
            let mut text = line.to_string();
            text.push('\n');
            return Some((Ok::<_, std::convert::Infallible>(text), rx));
        }
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response())
}

/// The NDJSON line of an event, for those the SDK shows.
fn line_of(event: &Event) -> Option<Value> {
    let now = Utc::now().to_rfc3339_opts(SecondsFormat::Micros, true);
    match event {
        Event::Stream { name, text } => Some(wire::stream_line(name == "stderr", text, &now)),
        Event::Display(display) => Some(wire::result_line(display)),
        Event::Error(error) => Some(wire::error_line(error)),
        _ => None,
    }
}

#[derive(Debug, Default, Deserialize)]
struct NewContext {
    language: Option<String>,
    cwd: Option<String>,
}

/// `POST /contexts`.
pub async fn create_context(
    State(state): State<AppState>,
    call: SandboxCall,
    body: Bytes,
) -> Result<Json<Context>, ApiError> {
    let body: NewContext = match body.as_ref() {
        [] => NewContext::default(),
        bytes => json_body(bytes, r#"{"language": "python"}"#)?,
    };
    python_only(body.language.as_deref())?;
    if let Some(cwd) = body.cwd.as_deref() {
        let rel = wire::relative_path(cwd).map_err(|e| ApiError::bad_request(e.to_string()))?;
        if !rel.is_empty() {
            return Err(ApiError::bad_request(format!(
                "cwd {cwd:?} is refused: contexts share the kernel's process, whose working \
                 directory is {HOME}; use paths relative to it"
            )));
        }
    }
    let context = Context {
        id: uuid::Uuid::new_v4().simple().to_string(),
        language: "python".into(),
        cwd: HOME.into(),
    };
    let stored = state
        .e2b
        .update(&call.id, |s| {
            s.contexts.insert(context.id.clone(), context.clone());
        })
        .is_some();
    if !stored {
        return Err(ApiError::new(StatusCode::NOT_FOUND, "sandbox not found"));
    }
    Ok(Json(context))
}

/// `GET /contexts`: the default context first.
pub async fn list_contexts(State(state): State<AppState>, call: SandboxCall) -> Json<Vec<Context>> {
    let mut all = vec![Context::default_one()];
    if let Some(sandbox) = state.e2b.get(&call.id) {
        all.extend(sandbox.contexts.into_values());
    }
    Json(all)
}

/// Path of the routes about one context (after the sandbox's port and id).
#[derive(Debug, Deserialize)]
pub struct ContextPath {
    #[allow(dead_code)]
    sandbox: String,
    context: String,
}

/// Runs `code` on the sandbox's kernel, its outputs dropped; an error is answered.
pub(super) async fn run_quietly(
    state: &AppState,
    live: std::sync::Arc<crate::kernels::LiveKernel>,
    key: &str,
    code: String,
) -> Result<(), ApiError> {
    let mut rx = runner::submit(
        &state.tracker,
        state.kernels.clone(),
        live,
        Job {
            code,
            timeout: Duration::from_secs(30),
            key: key.to_owned(),
            agent_id: None,
        },
    )
    .await;
    while let Some(progress) = rx.recv().await {
        if let Progress::Event(Event::Error(e)) = progress {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{}: {}", e.ename, e.evalue),
            ));
        }
    }
    Ok(())
}

/// Forgets context `id`'s namespace (the next run starts it afresh).
fn forget(id: &str) -> String {
    format!(
        "get_ipython().__dict__.get('_kernelgate_e2b_contexts', {{}}).pop({}, None)",
        literal(&id)
    )
}

/// `POST /contexts/{id}/restart`: its variables are gone, the process stays (the default
/// context's namespace is reset as `%reset -f` does).
pub async fn restart_context(
    State(state): State<AppState>,
    call: SandboxCall,
    Path(path): Path<ContextPath>,
) -> Result<StatusCode, ApiError> {
    let code = if path.context == DEFAULT_CONTEXT {
        "get_ipython().run_line_magic('reset', '-f')".to_owned()
    } else {
        known(&state, &call, &path.context)?;
        state
            .e2b
            .update(&call.id, |s| s.contexts_run.remove(&path.context));
        forget(&path.context)
    };
    run_quietly(&state, call.live.clone(), &call.key, code).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `DELETE /contexts/{id}`.
pub async fn delete_context(
    State(state): State<AppState>,
    call: SandboxCall,
    Path(path): Path<ContextPath>,
) -> Result<StatusCode, ApiError> {
    if path.context == DEFAULT_CONTEXT {
        return Err(ApiError::bad_request(
            "the default context cannot be removed (restart it to clear its variables)",
        ));
    }
    known(&state, &call, &path.context)?;
    run_quietly(&state, call.live.clone(), &call.key, forget(&path.context)).await?;
    state.e2b.update(&call.id, |s| {
        s.contexts.remove(&path.context);
        s.contexts_run.remove(&path.context);
    });
    Ok(StatusCode::NO_CONTENT)
}

fn known(state: &AppState, call: &SandboxCall, context: &str) -> Result<(), ApiError> {
    state
        .e2b
        .get(&call.id)
        .filter(|s| s.contexts.contains_key(context))
        .map(|_| ())
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("context {context} not found"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_python_runs() {
        assert!(python_only(None).is_ok());
        assert!(python_only(Some("python")).is_ok());
        let refused = python_only(Some("r")).expect_err("r is not Python");
        assert_eq!(refused.status, StatusCode::BAD_REQUEST);
        assert!(refused.message.contains("\"r\""));
    }

    #[test]
    fn wrapped_code_keeps_the_code_as_a_literal() {
        let env = BTreeMap::from([("A".to_owned(), "1".to_owned())]);
        let context = InContext {
            id: "c1",
            ran: true,
        };
        let cell = wrapped("print('x\\ny')\n\"q\"", Some(context), &env);
        assert!(cell.starts_with("exec(compile("));
        assert!(cell.contains(r#"'CODE': "print('x\\ny')\n\"q\"""#));
        assert!(cell.contains(r#"'CONTEXT': "c1", 'RAN': True"#));
        assert!(cell.contains("code context c1 starts empty again"));
        assert!(cell.contains(r#"'ENV': {"A":"1"}"#));
        assert!(wrapped("1", None, &BTreeMap::new()).contains("'CONTEXT': None"));
    }
}
