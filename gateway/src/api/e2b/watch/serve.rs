//! The watch calls themselves: the stream (`WatchDir`) and the polling watchers, over the
//! watcher program and buffers of the parent module.

use super::*;

fn deadline_exceeded() -> ConnectError {
    ConnectError::new(
        "deadline_exceeded",
        "the watch's deadline (its timeout) passed",
    )
}

/// `POST /filesystem.Filesystem/WatchDir`: the events of a directory as a Connect server
/// stream: `start`, then `filesystem` events and `keepalive`s, until the client goes
/// away, the sandbox ends or the deadline passes.
pub async fn watch_dir(
    State(state): State<AppState>,
    call: SandboxCall,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConnectError> {
    let request: HashMap<String, Value> = serde_json::from_value(connect::single(&body)?)
        .map_err(|_| ConnectError::new("invalid_argument", "the request is not a JSON object"))?;
    let target = Target::of(&request)?;
    let deadline = connect::deadline(&headers);
    let every = connect::keepalive(&headers, KEEPALIVE);
    let slot = state.e2b.watchers.claim(&call.id)?;
    let start = Program::start(&state, &call, &target);
    let program = match deadline {
        Some(at) => tokio::time::timeout_at(at, start)
            .await
            .map_err(|_| deadline_exceeded())??,
        None => start.await?,
    };
    let (tx, rx) = mpsc::channel(STREAM_QUEUE);
    // Room for it: the channel is new.
    let _ = tx.try_send(connect::message(&json!({"start": {}})));
    let cancel = state.cancel.clone();
    state.tracker.spawn(async move {
        let end = stream(program, &target, &tx, deadline, every, cancel).await;
        drop(slot);
        if let Some(end) = end {
            let _ = tx.send(end).await;
        }
    });
    let messages = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|message| (message, rx))
    });
    Ok(connect::streaming(messages))
}

/// Relays `program`'s events to `tx` until the watch ends; answers the stream's last
/// message (none when the client went away).
async fn stream(
    mut program: Program,
    target: &Target,
    tx: &mpsc::Sender<Bytes>,
    deadline: Option<Instant>,
    every: Duration,
    cancel: CancellationToken,
) -> Option<Bytes> {
    // Far enough to never come: a stream without a deadline.
    let deadline = deadline.unwrap_or_else(|| Instant::now() + Duration::from_secs(1 << 30));
    let mut keepalive = tokio::time::interval_at(Instant::now() + every, every);
    keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let end = loop {
        let message = tokio::select! {
            line = program.next() => match line {
                Some(Line::Change(change)) => match filesystem_event(&change, target) {
                    Some(event) => connect::message(&json!({"filesystem": event})),
                    None => continue,
                },
                Some(Line::Refused { code, message }) => {
                    let path = absolute_path(&target.rel);
                    break Some(ConnectError::new(code, format!("{path}: {message}")));
                }
                Some(Line::Ready | Line::Heartbeat) => continue,
                None => break Some(ConnectError::new("unavailable", program.why_it_ended())),
            },
            _ = keepalive.tick() => connect::message(&json!({"keepalive": {}})),
            () = tokio::time::sleep_until(deadline) => break Some(deadline_exceeded()),
            () = tx.closed() => break None,
            () = cancel.cancelled() => {
                break Some(ConnectError::new("unavailable", "the gateway is shutting down"))
            }
        };
        // A client that stops reading holds the program back, until its deadline.
        match tokio::time::timeout_at(deadline, tx.send(message)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => break None,
            Err(_) => break Some(deadline_exceeded()),
        }
    };
    program.stop().await;
    end.map(|e| e.end_of_stream())
}

/// `CreateWatcher`, `GetWatcherEvents` and `RemoveWatcher` of `filesystem.Filesystem`
/// (unary calls): the sync SDK's watchers, whose events wait in the gateway until asked for.
pub async fn polled(
    state: &AppState,
    call: &SandboxCall,
    method: &str,
    request: &HashMap<String, Value>,
) -> Result<Value, ConnectError> {
    let watchers = &state.e2b.watchers;
    let watcher_id = || {
        field(request, "watcher_id", "watcherId")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let unknown = |id: &str| {
        ConnectError::new(
            "not_found",
            format!("watcher {id:?} not found (it was stopped, or is another sandbox's)"),
        )
    };
    match method {
        "CreateWatcher" => {
            let target = Target::of(request)?;
            watchers.forget_ended(|id| state.kernels.get(id).is_some());
            let slot = watchers.claim(&call.id)?;
            let program = Program::start(state, call, &target).await?;
            let id = uuid::Uuid::new_v4().to_string();
            let polled = Arc::new(Polled {
                path: absolute_path(&target.rel),
                buffer: Mutex::default(),
                stop: state.cancel.child_token(),
            });
            watchers.insert(&call.id, &id, polled.clone());
            let (state, sandbox, watcher) = (state.clone(), call.id.clone(), id.clone());
            state.tracker.clone().spawn(async move {
                let ended = poll(program, &target, &polled).await;
                drop(slot);
                match ended {
                    // Its sandbox is gone: so is the watcher.
                    Some(_) if state.kernels.get(&sandbox).is_none() => {
                        state.e2b.watchers.remove(&sandbox, &watcher);
                    }
                    Some(why) => polled.buffer().ended = Some(why),
                    None => {}
                }
            });
            Ok(json!({"watcherId": id}))
        }
        "GetWatcherEvents" => {
            let id = watcher_id();
            let polled = watchers.polled(&call.id, &id).ok_or_else(|| unknown(&id))?;
            let (events, dropped, ended) = {
                let mut buffer = polled.buffer();
                let (events, dropped) = buffer.take();
                (events, dropped, buffer.ended.clone())
            };
            if dropped > 0 {
                // The SDK's answer has no place to say so.
                tracing::warn!(kernel = %call.id, watcher = %id, path = %polled.path, dropped, "a directory watcher's events were not asked for in time: {dropped} were dropped (at most {MAX_EVENTS} are kept)");
            }
            match ended {
                Some(why) if events.is_empty() => {
                    watchers.remove(&call.id, &id);
                    Err(ConnectError::new(
                        "failed_precondition",
                        format!("the watch of {} ended: {why}", polled.path),
                    ))
                }
                _ => Ok(json!({"events": events})),
            }
        }
        "RemoveWatcher" => {
            let id = watcher_id();
            let polled = watchers.remove(&call.id, &id).ok_or_else(|| unknown(&id))?;
            polled.stop.cancel();
            Ok(json!({}))
        }
        other => Err(ConnectError::new(
            "unimplemented",
            format!("filesystem.Filesystem/{other} is not a watcher call"),
        )),
    }
}

/// Keeps `program`'s events in `polled` until it is stopped (`None`) or the watch ends
/// (why).
async fn poll(mut program: Program, target: &Target, polled: &Polled) -> Option<String> {
    let ended = loop {
        tokio::select! {
            line = program.next() => match line {
                Some(Line::Change(change)) => {
                    if let Some(event) = filesystem_event(&change, target) {
                        polled.buffer().push(event);
                    }
                }
                Some(Line::Refused { message, .. }) => break Some(message),
                Some(Line::Ready | Line::Heartbeat) => {}
                None => break Some(program.why_it_ended()),
            },
            () = polled.stop.cancelled() => break None,
        }
    };
    program.stop().await;
    ended
}
