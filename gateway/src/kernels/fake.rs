//! For unit tests of the kernel table: a backend that runs no container but an in-process
//! mock kernel per launch. The mock binds the five ZeroMQ sockets (ipc, in a temporary
//! directory) and answers like ipykernel does for what the table needs: `kernel_info` and
//! `execute` requests, each wrapped in `busy`/`idle` status messages, and heartbeat
//! echoes. Tests kill, hang, count and inspect kernels through [`FakeBackend`].
//! Launching, restarting and removing take [`RUNTIME_LATENCY`], as a container runtime's
//! calls take time: a caller that goes away can leave them half done.

use crate::backend::{
    BackendError, ExecOutput, Exit, Found, ImageFacts, KernelBackend, LaunchRequest, Launched,
};
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use kernelgate_protocol::{wire, Channel, ConnectionInfo, Header, Message, RawJson, SigningKey};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RepSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// How long each call that changes a container takes.
pub const RUNTIME_LATENCY: Duration = Duration::from_millis(20);

/// What the tests can see of one launched kernel.
#[derive(Debug, Default, Clone)]
pub struct Record {
    pub kernel_id: String,
    pub kernel_name: String,
    pub image: String,
    pub preload: bool,
    pub env: BTreeMap<String, String>,
    /// The code of every execute_request, in order.
    pub executed: Vec<String>,
    pub restarts: u32,
    pub interrupts: u32,
    pub removed: bool,
    /// The kernel a restart moved into this one (a warm kernel), as recorded.
    pub serves: Option<String>,
    pub owner: Option<String>,
    pub renamed_to: Option<String>,
}

/// The memory limit the fake reports for its kernels.
pub const MEMORY_MB: u64 = 64;

struct Running {
    record: Record,
    connection: ConnectionInfo,
    /// Stops the current mock process.
    stop: CancellationToken,
    /// `Some(exit)` once the current process exited.
    exit: watch::Sender<Option<Exit>>,
    /// Out-of-memory kills in the container so far.
    ooms: watch::Sender<u32>,
    process: Option<tokio::task::JoinHandle<()>>,
}

#[derive(Default)]
struct Kernels(Mutex<HashMap<String, Running>>);

impl Kernels {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Running>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub struct FakeBackend {
    kernels: Arc<Kernels>,
    dir: PathBuf,
    /// This many of the next processes started run out of memory before they answer.
    doomed: AtomicU32,
}

impl Drop for FakeBackend {
    fn drop(&mut self) {
        for r in self.kernels.lock().values() {
            r.stop.cancel();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl FakeBackend {
    pub fn new() -> Arc<Self> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let dir = std::env::temp_dir().join(format!("kgf-{}", &id[..12]));
        let _ = std::fs::create_dir_all(&dir);
        Arc::new(FakeBackend {
            kernels: Arc::default(),
            dir,
            doomed: AtomicU32::new(0),
        })
    }

    /// Every kernel ever launched, by handle.
    pub fn records(&self) -> HashMap<String, Record> {
        self.kernels
            .lock()
            .iter()
            .map(|(h, r)| (h.clone(), r.record.clone()))
            .collect()
    }

    /// How many launched kernels were not removed.
    pub fn running(&self) -> usize {
        self.kernels
            .lock()
            .values()
            .filter(|r| !r.record.removed)
            .count()
    }

    pub fn record_of(&self, kernel_id: &str) -> Option<(String, Record)> {
        self.kernels
            .lock()
            .iter()
            .find(|(_, r)| r.record.kernel_id == kernel_id)
            .map(|(h, r)| (h.clone(), r.record.clone()))
    }

    /// The kernel's process dies with exit code 1, as a crash would.
    pub fn kill(&self, handle: &str) {
        self.end(handle, exited(1));
    }

    /// The kernel's process is killed by its memory limit.
    pub fn oom(&self, handle: &str) {
        self.end(handle, out_of_memory());
    }

    /// The container runs out of memory and the kernel's process is left stuck, neither
    /// answering nor exiting, as under gVisor when the host kills the stub process its
    /// memory was mapped in.
    pub fn oom_stuck(&self, handle: &str) {
        if let Some(r) = self.kernels.lock().get(handle) {
            r.stop.cancel();
            r.ooms.send_modify(|n| *n += 1);
        }
    }

    /// The container runs out of memory but the killer takes a process the kernel
    /// started: the kernel answers on.
    pub fn oom_of_a_child(&self, handle: &str) {
        if let Some(r) = self.kernels.lock().get(handle) {
            r.ooms.send_modify(|n| *n += 1);
        }
    }

    /// The next `n` processes started (by a launch or a restart) run out of memory before
    /// they answer.
    pub fn doom_next_starts(&self, n: u32) {
        self.doomed.store(n, Ordering::SeqCst);
    }

    fn end(&self, handle: &str, exit: Exit) {
        if let Some(r) = self.kernels.lock().get(handle) {
            r.stop.cancel();
            r.exit.send_replace(Some(exit));
        }
    }

    /// The kernel's process stops answering on every socket, heartbeat included, but
    /// does not exit, as a hung process would.
    pub fn hang(&self, handle: &str) {
        if let Some(r) = self.kernels.lock().get(handle) {
            r.stop.cancel();
        }
    }

    /// (Re)starts the mock process of `handle`, once the previous one has let go of
    /// its sockets (as a container restart does).
    async fn start_process(&self, handle: &str) -> Result<(), BackendError> {
        let gone = || BackendError::Gone {
            handle: handle.to_owned(),
        };
        let previous = {
            let mut kernels = self.kernels.lock();
            let r = kernels.get_mut(handle).ok_or_else(gone)?;
            r.stop.cancel();
            r.process.take()
        };
        if let Some(previous) = previous {
            let _ = previous.await;
        }
        // A socket file left by the dead process would refuse connections until the new
        // process binds; a real restart starts from a fresh socket directory state too.
        if let Some(r) = self.kernels.lock().get(handle) {
            for channel in Channel::ALL {
                let endpoint = r.connection.endpoint(channel);
                let _ = std::fs::remove_file(endpoint.trim_start_matches("ipc://"));
            }
        }
        let doomed = self
            .doomed
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let mut kernels = self.kernels.lock();
        let r = kernels.get_mut(handle).ok_or_else(gone)?;
        r.stop = CancellationToken::new();
        if doomed {
            // Never binds its sockets: dies while it starts.
            r.exit.send_replace(Some(out_of_memory()));
            return Ok(());
        }
        r.exit.send_replace(None);
        let mock = Mock {
            kernels: self.kernels.clone(),
            handle: handle.to_owned(),
            key: r.connection.signing_key(),
            session: uuid::Uuid::new_v4().to_string(),
        };
        r.process = Some(tokio::spawn(
            mock.serve(r.connection.clone(), r.stop.clone()),
        ));
        Ok(())
    }

    fn update(&self, handle: &str, f: impl FnOnce(&mut Running)) -> Result<(), BackendError> {
        match self.kernels.lock().get_mut(handle) {
            Some(r) if !r.record.removed => {
                f(r);
                Ok(())
            }
            _ => Err(BackendError::Gone {
                handle: handle.to_owned(),
            }),
        }
    }
}

impl KernelBackend for FakeBackend {
    fn check(&self) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    fn describe_image<'a>(
        &'a self,
        _image: &'a str,
    ) -> BoxFuture<'a, Result<ImageFacts, BackendError>> {
        Box::pin(async { Ok(ImageFacts::default()) })
    }

    fn launch<'a>(
        &'a self,
        req: &'a LaunchRequest,
    ) -> BoxFuture<'a, Result<Launched, BackendError>> {
        Box::pin(async move {
            tokio::time::sleep(RUNTIME_LATENCY).await;
            let handle = format!("fake-{}", uuid::Uuid::new_v4().simple());
            let prefix = self.dir.join(&handle[5..17]);
            let connection = ConnectionInfo::ipc(
                &prefix.display().to_string(),
                SigningKey::generate_hex(),
                &req.kernel_name,
            );
            let running = Running {
                record: Record {
                    kernel_id: req.kernel_id.clone(),
                    kernel_name: req.kernel_name.clone(),
                    image: req.image.clone(),
                    preload: req.preload,
                    env: req.env.clone(),
                    ..Record::default()
                },
                connection: connection.clone(),
                stop: CancellationToken::new(),
                exit: watch::channel(None).0,
                ooms: watch::channel(0).0,
                process: None,
            };
            self.kernels.lock().insert(handle.clone(), running);
            self.start_process(&handle).await?;
            Ok(Launched { handle, connection })
        })
    }

    fn restart<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            tokio::time::sleep(RUNTIME_LATENCY).await;
            self.update(handle, |r| r.record.restarts += 1)?;
            self.start_process(handle).await
        })
    }

    fn interrupt<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move { self.update(handle, |r| r.record.interrupts += 1) })
    }

    fn remove<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            tokio::time::sleep(RUNTIME_LATENCY).await;
            self.update(handle, |r| {
                r.record.removed = true;
                r.stop.cancel();
                r.exit.send_replace(Some(exited(137)));
            })
        })
    }

    fn wait_exit<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<Exit, BackendError>> {
        Box::pin(async move {
            let mut exit = self
                .kernels
                .lock()
                .get(handle)
                .map(|r| r.exit.subscribe())
                .ok_or_else(|| BackendError::Gone {
                    handle: handle.to_owned(),
                })?;
            let exit = exit
                .wait_for(Option::is_some)
                .await
                .map_err(|_| BackendError::Gone {
                    handle: handle.to_owned(),
                })?;
            Ok(exit.clone().unwrap_or_default())
        })
    }

    fn out_of_memory<'a>(&'a self, handle: &'a str) -> BoxStream<'a, Exit> {
        let Some(mut ooms) = self.kernels.lock().get(handle).map(|r| r.ooms.subscribe()) else {
            return Box::pin(futures::stream::empty());
        };
        ooms.mark_unchanged();
        Box::pin(futures::stream::unfold(ooms, |mut ooms| async move {
            ooms.changed().await.ok()?;
            Some((out_of_memory(), ooms))
        }))
    }

    fn exec<'a>(
        &'a self,
        _handle: &'a str,
        _request: crate::backend::ExecRequest,
    ) -> BoxFuture<'a, Result<ExecOutput, BackendError>> {
        Box::pin(async {
            Err(BackendError::Runtime(
                "the fake backend runs no commands".into(),
            ))
        })
    }

    /// What a restarted gateway on the same backend finds: every kernel not removed, as
    /// the Docker backend reports them (its owner and the kernel it serves as recorded;
    /// warm kernels always fit the configuration).
    fn list(&self) -> BoxFuture<'_, Result<Vec<Found>, BackendError>> {
        Box::pin(async move {
            Ok(self
                .kernels
                .lock()
                .iter()
                .filter(|(_, r)| !r.record.removed)
                .map(|(handle, r)| Found {
                    handle: handle.clone(),
                    kernel_id: r
                        .record
                        .serves
                        .clone()
                        .unwrap_or(r.record.kernel_id.clone()),
                    moved: r.record.serves.is_some(),
                    pooled: r.record.preload && r.record.owner.is_none(),
                    current: true,
                    image: r.record.image.clone(),
                    kernel_name: r.record.kernel_name.clone(),
                    running: r.exit.borrow().is_none(),
                    owner: r.record.owner.clone(),
                    connection: Some(r.connection.clone()),
                })
                .collect())
        })
    }

    fn set_owner<'a>(
        &'a self,
        kernel_id: &'a str,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            for r in self.kernels.lock().values_mut() {
                if r.record.kernel_id == kernel_id {
                    r.record.owner = Some(owner.to_owned());
                }
            }
            Ok(())
        })
    }

    fn set_kernel_id<'a>(
        &'a self,
        container_id: &'a str,
        kernel_id: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            for r in self.kernels.lock().values_mut() {
                if r.record.kernel_id == container_id {
                    r.record.serves = Some(kernel_id.to_owned());
                }
            }
            Ok(())
        })
    }

    fn rename<'a>(
        &'a self,
        handle: &'a str,
        kernel_id: &'a str,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            self.update(handle, |r| r.record.renamed_to = Some(kernel_id.to_owned()))
        })
    }
}

fn exited(code: i64) -> Exit {
    Exit {
        code,
        oom_killed: false,
        memory_mb: Some(MEMORY_MB),
    }
}

fn out_of_memory() -> Exit {
    Exit {
        code: 137,
        oom_killed: true,
        memory_mb: Some(MEMORY_MB),
    }
}

/// One mock kernel process.
struct Mock {
    kernels: Arc<Kernels>,
    handle: String,
    key: SigningKey,
    session: String,
}

impl Mock {
    async fn serve(self, info: ConnectionInfo, stop: CancellationToken) {
        let bind = |channel: Channel| info.endpoint(channel);
        let mut shell = RouterSocket::new();
        let mut control = RouterSocket::new();
        let mut stdin = RouterSocket::new();
        let mut iopub = PubSocket::new();
        let mut hb = RepSocket::new();
        let bound = async {
            shell.bind(&bind(Channel::Shell)).await?;
            control.bind(&bind(Channel::Control)).await?;
            stdin.bind(&bind(Channel::Stdin)).await?;
            iopub.bind(&bind(Channel::IoPub)).await?;
            hb.bind(&bind(Channel::Heartbeat)).await?;
            Ok::<_, zeromq::ZmqError>(())
        };
        if bound.await.is_ok() {
            let mut count = 0i64;
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    m = shell.recv() => match m {
                        Ok(m) => self.answer(m, &mut shell, &mut iopub, &mut count).await,
                        Err(_) => break,
                    },
                    m = control.recv() => match m {
                        Ok(m) => self.answer(m, &mut control, &mut iopub, &mut count).await,
                        Err(_) => break,
                    },
                    m = hb.recv() => match m {
                        Ok(m) => { let _ = hb.send(m).await; }
                        Err(_) => break,
                    },
                }
            }
        }
        // zeromq deletes a bound socket's file from a task of its own after the socket is
        // dropped: wait for that here, or it could delete the next process's socket.
        shell.unbind_all().await;
        control.unbind_all().await;
        stdin.unbind_all().await;
        iopub.unbind_all().await;
        hb.unbind_all().await;
    }

    async fn answer(
        &self,
        frames: ZmqMessage,
        socket: &mut RouterSocket,
        iopub: &mut PubSocket,
        count: &mut i64,
    ) {
        let frames: Vec<Bytes> = frames.into_vec();
        let Ok(request) = wire::decode(&frames, &self.key) else {
            return;
        };
        let parent = request.message.header.clone();
        let reply_content = match parent.msg_type.as_str() {
            "kernel_info_request" => json!({
                "status": "ok", "protocol_version": "5.3", "implementation": "mock",
                "implementation_version": "1", "banner": "",
                "language_info": {"name": "python"},
            }),
            "execute_request" => {
                let content: Value = request.message.content_as().unwrap_or_default();
                let code = content["code"].as_str().unwrap_or_default().to_owned();
                let silent = content["silent"].as_bool().unwrap_or(false);
                if let Some(r) = self.kernels.lock().get_mut(&self.handle) {
                    r.record.executed.push(code);
                }
                if !silent {
                    *count += 1;
                }
                json!({"status": "ok", "execution_count": *count, "user_expressions": {}})
            }
            _ => return,
        };
        let reply_type = parent.msg_type.replace("_request", "_reply");
        self.publish(iopub, &parent, json!({"execution_state": "busy"}))
            .await;
        let reply = self.message(&reply_type, &parent, reply_content);
        let wire = wire::encode(&request.identities, &reply, &self.key);
        if let Ok(m) = ZmqMessage::try_from(wire) {
            let _ = socket.send(m).await;
        }
        self.publish(iopub, &parent, json!({"execution_state": "idle"}))
            .await;
    }

    async fn publish(&self, iopub: &mut PubSocket, parent: &Header, content: Value) {
        let status = self.message("status", parent, content);
        if let Ok(m) = ZmqMessage::try_from(wire::encode(&[], &status, &self.key)) {
            let _ = iopub.send(m).await;
        }
    }

    fn message(&self, msg_type: &str, parent: &Header, content: Value) -> Message {
        Message::new(
            Header::new(msg_type, &self.session, "mock", &crate::relay::now_iso()),
            Some(parent.clone()),
            RawJson::from_value(&content),
        )
    }
}
