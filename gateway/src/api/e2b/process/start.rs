//! `Start`: a command checked (its user, the policy's shell rules, the sandbox's count),
//! audited, run through the engine and registered; then its output carried to its
//! listeners until it ends.

use super::*;

/// `Start`: checks, runs and registers the command, and answers its stream.
pub(super) async fn start(
    state: &AppState,
    call: &SandboxCall,
    headers: &HeaderMap,
    request: Value,
) -> Result<Response, ConnectError> {
    only_the_kernels_user(headers)?;
    let config = &request["process"];
    let cmd = config["cmd"].as_str().unwrap_or_default().to_owned();
    if cmd.is_empty() {
        return Err(ConnectError::new(
            "invalid_argument",
            "process.cmd is empty: give the program to run",
        ));
    }
    let args: Vec<String> = config["args"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let envs: Vec<(String, String)> = config["envs"]
        .as_object()
        .map(|o| {
            o.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default();
    if let Some((bad, _)) = envs
        .iter()
        .find(|(k, _)| k.is_empty() || k.contains('=') || k.chars().any(char::is_control))
    {
        return Err(ConnectError::new(
            "invalid_argument",
            format!("environment variable name {bad:?} is not valid"),
        ));
    }
    let cwd = config["cwd"].as_str();
    let dir = workdir(cwd)?;
    let tty = tty_size(&request["pty"]);
    let tag = request["tag"]
        .as_str()
        .filter(|t| !t.is_empty())
        .map(str::to_owned);
    let stdin = request["stdin"].as_bool().unwrap_or(false) || tty.is_some();
    let line = command_line(&cmd, &args);

    if let Some(guard) = &state.guard {
        let refusal = match guard.check_command(&line) {
            Decision::Allow => None,
            Decision::Deny(v) => Some(("deny", v, "refused by the execution policy")),
            Decision::Ask(v) => Some((
                "ask",
                v,
                "held for approval by the execution policy, which a command cannot wait for: \
                 run it from code (`!command` in run_code), where approvals apply",
            )),
        };
        if let Some((decision, verdict, what)) = refusal {
            state
                .kernels
                .audit()
                .record(&Record::PolicyDecision {
                    sender: Sender {
                        key: call.key.clone(),
                        username: "user".into(),
                        agent_id: None,
                        kernel: call.id.clone(),
                        session: String::new(),
                        msg_id: String::new(),
                    },
                    msg_type: "command".into(),
                    decision: decision.into(),
                    rule: Some(verdict.rule),
                    reason: Some(verdict.reason.clone()),
                    matched: Some(verdict.matched.clone()),
                    approval_id: None,
                    by: None,
                })
                .await;
            return Err(ConnectError::new(
                "permission_denied",
                format!(
                    "the command was {what} (rule {}: {}; matched {})",
                    verdict.rule, verdict.reason, verdict.matched
                ),
            ));
        }
    }
    if state.e2b.processes.of(&call.id).len() >= MAX_PROCESSES {
        return Err(ConnectError::new(
            "resource_exhausted",
            format!(
                "sandbox {} runs {MAX_PROCESSES} commands already: wait for one to end, or kill one",
                call.id
            ),
        ));
    }
    // A paused sandbox's files and processes are in its saved state: bring it back first.
    let live = match state.kernels.get(&call.id).filter(|l| l.hibernated()) {
        Some(live) => {
            state
                .kernels
                .hibernation()
                .resume(&live)
                .await
                .map_err(|e| {
                    ConnectError::new(
                        "unavailable",
                        format!("the paused sandbox could not be resumed: {e}"),
                    )
                })?;
            live
        }
        None => call.live.clone(),
    };

    let pid = state.e2b.processes.next_pid.fetch_add(1, Ordering::Relaxed);
    let shown_cwd = dir
        .clone()
        .unwrap_or_else(|| crate::backend::sandbox::KERNEL_HOME.to_owned());
    state
        .kernels
        .audit()
        .record(&Record::CommandStarted {
            key: call.key.clone(),
            kernel: call.id.clone(),
            pid,
            command: line.clone(),
            command_sha256: sha256(&line),
            cwd: shown_cwd,
            terminal: tty.is_some(),
        })
        .await;
    let started = Instant::now();
    let request = InteractiveRequest {
        argv: std::iter::once(cmd.clone())
            .chain(args.iter().cloned())
            .collect(),
        env: envs.clone(),
        workdir: dir,
        tty,
    };
    let running = match state
        .kernels
        .backend()
        .exec_interactive(&live.handle(), request)
        .await
    {
        Ok(running) => running,
        Err(e) => {
            state
                .kernels
                .audit()
                .record(&Record::CommandFinished {
                    key: call.key.clone(),
                    kernel: call.id.clone(),
                    pid,
                    exit_code: None,
                    duration_ms: 0,
                    output_bytes: 0,
                    output: String::new(),
                    truncated: false,
                })
                .await;
            return Err(ConnectError::new(
                "unavailable",
                format!("the command could not be started in the sandbox: {e}"),
            ));
        }
    };
    let mut input = Some(running.stdin);
    if !stdin {
        if let Some(mut closed) = input.take() {
            let _ = closed.shutdown().await;
        }
    }
    let mut shown_config =
        json!({"cmd": cmd, "args": args, "envs": envs.into_iter().collect::<BTreeMap<_, _>>()});
    if let Some(cwd) = cwd {
        shown_config["cwd"] = json!(cwd);
    }
    let process = Arc::new(Process {
        pid,
        tag,
        config: shown_config,
        terminal: tty.is_some(),
        stdin: tokio::sync::Mutex::new(input),
        control: running.control,
        listeners: Mutex::default(),
        ended: tokio::sync::watch::channel(false).0,
    });
    let events = process.listen();
    state
        .e2b
        .processes
        .lock()
        .entry(call.id.clone())
        .or_default()
        .insert(pid, process.clone());
    let pump = Pump {
        state: state.clone(),
        sandbox: call.id.clone(),
        key: call.key.clone(),
        process: process.clone(),
        started,
    };
    state.tracker.spawn(pump.run(running.output));
    Ok(answer_stream(process, events, Timing::of(headers), true))
}

/// Carries a process's output to its listeners until it ends, then its end.
struct Pump {
    state: AppState,
    sandbox: String,
    key: String,
    process: Arc<Process>,
    started: Instant,
}

impl Pump {
    async fn run(
        self,
        mut output: futures::stream::BoxStream<
            'static,
            Result<Output, crate::backend::BackendError>,
        >,
    ) {
        let mut preview = String::new();
        let mut output_bytes = 0usize;
        let mut failure = None;
        loop {
            let piece = tokio::select! {
                piece = output.next() => piece,
                () = self.state.cancel.cancelled() => break,
            };
            let (kind, bytes) = match piece {
                None => break,
                Some(Err(e)) => {
                    failure = Some(e.to_string());
                    break;
                }
                Some(Ok(Output::Stdout(bytes))) if self.process.terminal => ("pty", bytes),
                Some(Ok(Output::Stdout(bytes))) => ("stdout", bytes),
                Some(Ok(Output::Stderr(bytes))) => ("stderr", bytes),
            };
            output_bytes += bytes.len();
            if preview.chars().count() < OUTPUT_PREVIEW_CHARS {
                extend_preview(&mut preview, &String::from_utf8_lossy(&bytes));
            }
            self.process
                .tell(json!({"data": {kind: encoded(&bytes)}}))
                .await;
        }
        let exit_code = match failure {
            Some(_) => None,
            None => tokio::time::timeout(WAIT_FOR_EXIT, self.process.control.wait())
                .await
                .ok()
                .and_then(Result::ok),
        };
        let end = match (exit_code, &failure) {
            (Some(code), _) => json!({"end": {
                "exitCode": code,
                "exited": true,
                "status": format!("exit status {code}"),
            }}),
            (None, why) => json!({"end": {
                "exitCode": -1,
                "exited": false,
                "status": "unknown",
                "error": why.clone().unwrap_or_else(|| "its exit code could not be read".into()),
            }}),
        };
        self.state
            .e2b
            .processes
            .remove(&self.sandbox, self.process.pid);
        self.process.ended.send_replace(true);
        self.process.tell(end).await;
        self.state
            .kernels
            .audit()
            .record(&Record::CommandFinished {
                key: self.key,
                kernel: self.sandbox,
                pid: self.process.pid,
                exit_code,
                duration_ms: u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX),
                output_bytes,
                truncated: output_bytes > preview.len(),
                output: preview,
            })
            .await;
    }
}
