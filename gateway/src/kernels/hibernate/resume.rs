//! Bringing a hibernated kernel back: on the first client message, a fresh process with
//! the saved files unpacked and the variables loaded before anything clients sent; and
//! the hibernated kernels an earlier run left, listed again at start.

use super::*;

impl Kernels {
    /// Starts the task that resumes `live` on the first client message.
    pub(super) fn wake_on_request(self: &Arc<Self>, live: &Arc<LiveKernel>) {
        let (me, live) = (self.clone(), live.clone());
        let id = live.id().to_owned();
        self.tracker.spawn(
            async move {
                loop {
                    tokio::select! {
                        _ = live.cancel.cancelled() => return,
                        _ = live.relay.woken() => {}
                    }
                    match me.resume(&live).await {
                        Ok(()) => return,
                        Err(e) => {
                            let why = format!("the hibernated kernel could not be resumed ({e}); try again, or delete it");
                            tracing::warn!(kernel = %live.id(), "{why}");
                            live.relay.refuse_waiting(why).await;
                        }
                    }
                    if !live.is_hibernated() {
                        return;
                    }
                }
            }
            .instrument(tracing::info_span!("kernel", kernel = %id)),
        );
    }

    /// Brings a hibernated kernel back (nothing happens for one that runs): a fresh process
    /// with its state loaded, under its id, its clients still attached.
    pub async fn resume(self: &Arc<Self>, live: &Arc<LiveKernel>) -> Result<(), CreateError> {
        let (me, live) = (self.clone(), live.clone());
        let task = self.tracker.spawn(
            async move {
                let _ops = live.ops.lock().await;
                if !live.is_hibernated() {
                    return Ok(());
                }
                me.wake(&live, true).await
            }
            .in_current_span(),
        );
        task.await.unwrap_or(Err(CreateError::ShuttingDown))
    }

    /// Restarting a hibernated kernel starts it fresh: its state is deleted.
    pub(in crate::kernels) async fn wake_fresh(
        self: &Arc<Self>,
        live: &Arc<LiveKernel>,
    ) -> Result<(), CreateError> {
        self.wake(live, false).await
    }

    /// With `live.ops` held: a process for `live`, with its state (`with_state`) or fresh.
    async fn wake(
        self: &Arc<Self>,
        live: &Arc<LiveKernel>,
        with_state: bool,
    ) -> Result<(), CreateError> {
        let started = Instant::now();
        self.make_room_for(live).await?;
        let (env, limits) = live.origin.get().cloned().unwrap_or_default();
        let dir = self.state_dir(live.id());
        let tar =
            if with_state {
                let path = dir.join(TAR);
                Some(tokio::fs::read(&path).await.map_err(|e| {
                    CreateError::Resume(format!("cannot read {}: {e}", path.display()))
                })?)
            } else {
                None
            };
        let (warm, _) = self.obtain(&live.name, env, live.owner(), limits).await?;
        // The fresh kernel's own watcher and link go; its process serves `live` now.
        warm.cancel.cancel();
        warm.relay.disconnect();
        let new = warm.process();
        if live.cancel.is_cancelled() {
            // Deleted (or the gateway stops) meanwhile.
            self.drop_process(&new.handle).await;
            return Err(CreateError::ShuttingDown);
        }
        let loaded = match tar {
            Some(tar) => Some(self.unpack(live, &new.handle, tar).await),
            None => None,
        };
        let load = match loaded {
            Some(Err(e)) => {
                self.drop_process(&new.handle).await;
                return Err(e);
            }
            Some(Ok(())) => {
                let session = format!("kernelgate-state-{}", uuid::Uuid::new_v4());
                let me = live.relay.attach(&session, true, GATEWAY_KEY);
                let code = format!("__import__('kernelgate_state').load({})", py_str(STATE_DIR));
                let message = live
                    .relay
                    .request("execute_request", RawJson::from_value(&silent(&code)));
                let execution = Execution::new(message.msg_id());
                live.relay.send_first(&session, Channel::Shell, message);
                Some((me, execution))
            }
            None => None,
        };
        // It runs from here: what clients sent meanwhile may be answered before the
        // connect returns.
        let slept = live.sleep().since.take();
        let connected = self.connect_into(live, &new).await;
        if let Err(e) = connected {
            // What the failed process was sent is answered; the state stays on disk.
            live.relay
                .lost_executions(
                    "KernelUnavailable",
                    "the hibernated kernel could not be resumed",
                )
                .await;
            live.relay.set_hibernated();
            live.sleep().since = slept;
            self.drop_process(&new.handle).await;
            return Err(e);
        }
        let recorded = async {
            self.backend.set_kernel_id(warm.id(), live.id()).await?;
            self.backend.set_owner(warm.id(), live.owner()).await?;
            self.backend.rename(&new.handle, live.id()).await
        };
        if let Err(e) = recorded.await {
            tracing::warn!(kernel = %live.id(), error = %e, "cannot record the kernel's new container");
        }
        live.rearm.notify_one();
        if let Some(ledger) = &self.settings.ledger {
            ledger.hibernated(live.id(), false).await;
        }
        if let Some((me, mut execution)) = load {
            match collect(&me, &mut execution).await {
                Ok(None) => {}
                Ok(Some((ename, evalue))) => {
                    tracing::warn!(kernel = %live.id(), %ename, %evalue, "the kernel's saved state did not load")
                }
                Err(e) => {
                    tracing::warn!(kernel = %live.id(), error = %e, "the kernel's saved state did not load")
                }
            }
        }
        forget(&dir).await;
        let took = started.elapsed();
        if with_state {
            metrics::resumed(took);
            self.settings
                .audit
                .record(&Record::KernelResumed {
                    kernel: live.id().to_owned(),
                    owner: live.owner().to_owned(),
                    took_ms: took.as_millis() as u64,
                })
                .await;
        }
        tracing::info!(kernel = %live.id(), ?took, with_state, "hibernated kernel runs again");
        Ok(())
    }

    /// A resume at the running limit hibernates another idle kernel of the same owner
    /// first, when one can; otherwise it fails as a create at its limit does.
    async fn make_room_for(self: &Arc<Self>, live: &Arc<LiveKernel>) -> Result<(), CreateError> {
        let (running, other) = {
            let t = self.lock();
            let running = t.live.values().filter(|l| !l.is_hibernated()).count() + t.reserved;
            let mut idle: Vec<_> = t
                .live
                .values()
                .filter(|l| l.owner() == live.owner() && l.id() != live.id() && !l.is_hibernated())
                .cloned()
                .collect();
            idle.sort_by_key(|l| l.relay.last_activity());
            (running, idle)
        };
        if running < self.settings.max_kernels {
            return Ok(());
        }
        for candidate in other {
            if self.hibernate(&candidate).await.is_ok() {
                return Ok(());
            }
        }
        Err(CreateError::TooMany {
            max: self.settings.max_kernels,
        })
    }

    /// Unpacks a hibernated kernel's files into the home of the process `handle`.
    async fn unpack(
        &self,
        live: &LiveKernel,
        handle: &str,
        tar: Vec<u8>,
    ) -> Result<(), CreateError> {
        let argv = [PYTHON, "-c", STATE_IN].map(str::to_owned).to_vec();
        let out = self.backend.exec(handle, argv, tar.into(), 4096).await?;
        if out.exit_code != 0 {
            return Err(CreateError::Resume(format!(
                "cannot put the state of kernel {} into its new process: {}",
                live.id(),
                out.stderr.trim()
            )));
        }
        Ok(())
    }

    async fn drop_process(&self, handle: &str) {
        if let Err(e) = self.backend.remove(handle).await {
            tracing::warn!(container = %handle, error = %e, "cannot remove a kernel process that failed to resume");
        }
    }

    /// Hibernated kernels an earlier run of this gateway left in `--hibernate-dir` are
    /// listed again; a state whose kernel still runs (the earlier run died between commit
    /// and removal) is dropped, the container has it all.
    pub(in crate::kernels) async fn restore_hibernated(self: &Arc<Self>) {
        let root = self.settings.hibernate.dir.clone();
        let Ok(mut entries) = tokio::fs::read_dir(&root).await else {
            return;
        };
        while let Ok(Some(entry)) = entries.next_entry().await {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if name.starts_with('.') {
                // A commit a gateway did not finish (its kernel kept running); one under way
                // now, of another gateway sharing the directory, is younger.
                let age = entry
                    .metadata()
                    .await
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok());
                if age.is_some_and(|a| a > Duration::from_secs(600)) {
                    forget(&path).await;
                }
                continue;
            }
            let meta = match tokio::fs::read(path.join(META))
                .await
                .ok()
                .and_then(|b| serde_json::from_slice::<Meta>(&b).ok())
            {
                Some(meta)
                    if meta.id == name
                        && meta.runtime_dir == self.settings.hibernate.runtime_dir =>
                {
                    meta
                }
                Some(meta) if meta.id == name => {
                    tracing::debug!(kernel = %meta.id, runtime_dir = %meta.runtime_dir, "a hibernated kernel of another gateway; left alone");
                    continue;
                }
                _ => {
                    tracing::warn!(dir = %path.display(), "not a hibernated kernel's state; left alone");
                    continue;
                }
            };
            if self.get(&meta.id).is_some() {
                tracing::info!(kernel = %meta.id, "the kernel still runs; its saved state is dropped");
                forget(&path).await;
                continue;
            }
            let live = self.hibernated_kernel(&meta);
            self.lock().live.insert(meta.id.clone(), live.clone());
            if let Some(ledger) = &self.settings.ledger {
                ledger.adopt(&meta.id, &meta.owner, &meta.spec, false);
                ledger.hibernated(&meta.id, true).await;
            }
            tracing::info!(kernel = %meta.id, "hibernated kernel of an earlier run listed again");
            self.wake_on_request(&live);
        }
    }

    /// A table entry for a hibernated kernel with no process.
    fn hibernated_kernel(self: &Arc<Self>, meta: &Meta) -> Arc<LiveKernel> {
        let relay = crate::relay::Relay::new(
            &meta.id,
            self.settings.limits,
            self.settings.audit.clone(),
            self.settings.guard.clone(),
        );
        relay.set_hibernated();
        relay.set_last_activity(meta.last_activity);
        let live = Arc::new(LiveKernel::new(
            relay,
            &meta.spec,
            Process {
                handle: String::new(),
                connection: ConnectionInfo::ipc(
                    "/nonexistent/hibernated",
                    String::new(),
                    &meta.spec,
                ),
            },
            self.cancel.child_token(),
        ));
        let _ = live.owner.set(meta.owner.clone());
        let _ = live.origin.set((
            meta.env.clone(),
            Limits {
                memory_mb: meta.memory_mb,
                cpus: meta.cpus,
            },
        ));
        if let Some(max) = meta.max_hibernated {
            let _ = live.max_hibernated.set(max);
        }
        live.sleep().since = Some((meta.hibernated_at, meta.bytes));
        self.watch(&live);
        live
    }
}
