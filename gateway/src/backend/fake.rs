//! The second engine, for unit tests: runs no container but an in-process mock kernel per
//! launch, and passes the backend's contract tests ([`super::contract`]). The mock binds the five ZeroMQ sockets (ipc, in a temporary
//! directory) and answers like ipykernel does for what the table needs: `kernel_info` and
//! `execute` requests, each wrapped in `busy`/`idle` status messages, and heartbeat
//! echoes. Tests kill, hang, count and inspect kernels through [`FakeBackend`].
//! Launching, restarting and removing take [`RUNTIME_LATENCY`], as a container runtime's
//! calls take time: a caller that goes away can leave them half done.
//! Commands (one-shot and interactive) are make-believe: `echo` prints its arguments,
//! `cat` copies its input, `false` fails, anything else succeeds silently; each one-shot
//! run is recorded ([`FakeBackend::runs`]). It has no labels of its own: it keeps them.

use super::sandbox::{RunOnce, RunOutput, SandboxSpec, KERNEL_HOME};
use super::{
    BackendError, Capabilities, ExecOutput, Exit, Found, ImageFacts, Interactive,
    InteractiveControl, InteractiveRequest, KernelBackend, Labelled, LaunchRequest, Launched,
    Output, Signal, TarStream, TtySize,
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
    /// The spec it was created from ([`KernelBackend::create`]), not a launch.
    pub spec: Option<SandboxSpec>,
    /// Its labels, kept by the fake (a launch has none).
    pub labels: BTreeMap<String, String>,
    /// Signals sent to its main process, stops included (as SIGTERM).
    pub signals: Vec<Signal>,
    /// Trees put into it: where, and the tar.
    pub trees: Vec<(String, Bytes)>,
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

/// The fake engine's running kernels, by handle.
#[derive(Default)]
struct Processes(Mutex<HashMap<String, Running>>);

impl Processes {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Running>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub struct FakeBackend {
    kernels: Arc<Processes>,
    dir: PathBuf,
    /// This many of the next processes started run out of memory before they answer.
    doomed: AtomicU32,
    /// Every one-shot run asked for, in order.
    runs: Mutex<Vec<RunOnce>>,
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
            runs: Mutex::default(),
        })
    }

    /// The one-shot runs asked for so far.
    pub fn runs(&self) -> Vec<RunOnce> {
        self.runs.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A new sandbox entry, its process not started.
    fn add(&self, record: Record) -> (String, ConnectionInfo) {
        let handle = format!("fake-{}", uuid::Uuid::new_v4().simple());
        let prefix = self.dir.join(&handle[5..17]);
        let connection = ConnectionInfo::ipc(
            &prefix.display().to_string(),
            SigningKey::generate_hex(),
            &record.kernel_name,
        );
        let running = Running {
            record,
            connection: connection.clone(),
            stop: CancellationToken::new(),
            exit: watch::channel(None).0,
            ooms: watch::channel(0).0,
            process: None,
        };
        self.kernels.lock().insert(handle.clone(), running);
        (handle, connection)
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
            let (handle, connection) = self.add(Record {
                kernel_id: req.kernel_id.clone(),
                kernel_name: req.kernel_name.clone(),
                image: req.image.clone(),
                preload: req.preload,
                env: req.env.clone(),
                ..Record::default()
            });
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
        _request: super::ExecRequest,
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

    fn engine(&self) -> &'static str {
        "fake"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            sandboxes: true,
            engine_labels: false,
            interactive_exec: true,
            run_once: true,
            files: true,
            checkpoint: false,
            restore: false,
            clone: false,
        }
    }

    fn create<'a>(&'a self, spec: &'a SandboxSpec) -> BoxFuture<'a, Result<String, BackendError>> {
        Box::pin(async move {
            tokio::time::sleep(RUNTIME_LATENCY).await;
            let (handle, _) = self.add(Record {
                kernel_id: spec.name.clone().unwrap_or_default(),
                kernel_name: "python3".to_owned(),
                image: spec.image.clone(),
                env: spec.env.iter().cloned().collect(),
                labels: spec.labels.clone(),
                spec: Some(spec.clone()),
                ..Record::default()
            });
            Ok(handle)
        })
    }

    fn start<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            tokio::time::sleep(RUNTIME_LATENCY).await;
            self.update(handle, |_| {})?;
            self.start_process(handle).await
        })
    }

    fn signal<'a>(
        &'a self,
        handle: &'a str,
        signal: Signal,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            self.update(handle, |r| {
                r.record.signals.push(signal);
                if signal == Signal::Interrupt {
                    r.record.interrupts += 1;
                }
            })?;
            if signal != Signal::Interrupt {
                self.end(handle, exited(128 + i64::from(signal.number())));
            }
            Ok(())
        })
    }

    fn stop<'a>(
        &'a self,
        handle: &'a str,
        _grace: Duration,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            tokio::time::sleep(RUNTIME_LATENCY).await;
            self.update(handle, |r| r.record.signals.push(Signal::Terminate))?;
            let running = self
                .kernels
                .lock()
                .get(handle)
                .is_some_and(|r| r.exit.borrow().is_none());
            if running {
                self.end(handle, exited(128 + 15));
            }
            Ok(())
        })
    }

    fn list_labelled<'a>(
        &'a self,
        labels: &'a BTreeMap<String, String>,
    ) -> BoxFuture<'a, Result<Vec<Labelled>, BackendError>> {
        Box::pin(async move {
            Ok(self
                .kernels
                .lock()
                .iter()
                .filter(|(_, r)| !r.record.removed)
                .filter(|(_, r)| {
                    labels
                        .iter()
                        .all(|(k, v)| r.record.labels.get(k) == Some(v))
                })
                .map(|(handle, r)| Labelled {
                    handle: handle.clone(),
                    labels: r.record.labels.clone(),
                    running: r.process.is_some() && r.exit.borrow().is_none(),
                })
                .collect())
        })
    }

    fn exec_interactive<'a>(
        &'a self,
        handle: &'a str,
        request: InteractiveRequest,
    ) -> BoxFuture<'a, Result<Interactive, BackendError>> {
        Box::pin(async move {
            self.update(handle, |_| {})?;
            Ok(interactive(request))
        })
    }

    fn run_once(&self, request: RunOnce) -> BoxFuture<'_, Result<RunOutput, BackendError>> {
        Box::pin(async move {
            tokio::time::sleep(RUNTIME_LATENCY).await;
            self.runs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(request.clone());
            let (code, stdout) = pretend(&request.argv, b"");
            Ok(RunOutput {
                exit_code: code,
                stdout,
                stderr: Vec::new(),
            })
        })
    }

    fn read_home<'a>(&'a self, handle: &'a str) -> BoxFuture<'a, Result<TarStream, BackendError>> {
        Box::pin(async move {
            let mut home = None;
            self.update(handle, |r| {
                home = r
                    .record
                    .trees
                    .iter()
                    .rev()
                    .find(|(dest, _)| dest == KERNEL_HOME)
                    .map(|(_, tar)| tar.clone());
            })?;
            // An empty archive: two zero blocks.
            let tar = home.unwrap_or_else(|| Bytes::from(vec![0u8; 1024]));
            let stream: TarStream = Box::pin(futures::stream::iter([Ok(tar)]));
            Ok(stream)
        })
    }

    fn put_tree<'a>(
        &'a self,
        handle: &'a str,
        dest: &'a str,
        tree: Bytes,
    ) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(
            async move { self.update(handle, |r| r.record.trees.push((dest.to_owned(), tree))) },
        )
    }
}

/// What a make-believe command does with `input`: its exit code and output.
fn pretend(argv: &[String], input: &[u8]) -> (i64, Vec<u8>) {
    match argv.first().map(String::as_str) {
        Some("echo") => (0, format!("{}\n", argv[1..].join(" ")).into_bytes()),
        Some("cat") => (0, input.to_vec()),
        Some("false") => (1, Vec::new()),
        _ => (0, Vec::new()),
    }
}

/// A make-believe interactive command: reads its input to the end, then answers as
/// [`pretend`] says; a signal ends it at once with 128 + the signal's number.
fn interactive(request: InteractiveRequest) -> Interactive {
    use tokio::io::AsyncReadExt;
    let (stdin, mut reader) = tokio::io::duplex(64 * 1024);
    let (out_tx, out_rx) = tokio::sync::mpsc::channel(16);
    let exit = Arc::new(watch::channel(None::<i64>).0);
    let signalled = CancellationToken::new();
    let ended = exit.clone();
    let stop = signalled.clone();
    tokio::spawn(async move {
        let mut input = Vec::new();
        let code = tokio::select! {
            _ = reader.read_to_end(&mut input) => {
                let (code, out) = pretend(&request.argv, &input);
                if !out.is_empty() {
                    let _ = out_tx.send(Ok(Output::Stdout(Bytes::from(out)))).await;
                }
                code
            }
            () = stop.cancelled() => return,
        };
        ended.send_replace(Some(code));
    });
    Interactive {
        stdin: Box::pin(stdin),
        output: Box::pin(tokio_stream_of(out_rx)),
        control: Box::new(FakeControl { exit, signalled }),
    }
}

fn tokio_stream_of<T: Send + 'static>(
    rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures::Stream<Item = T> + Send {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) })
}

struct FakeControl {
    exit: Arc<watch::Sender<Option<i64>>>,
    signalled: CancellationToken,
}

impl InteractiveControl for FakeControl {
    fn signal(&self, signal: Signal) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async move {
            if self.exit.borrow().is_none() {
                self.signalled.cancel();
                self.exit
                    .send_replace(Some(128 + i64::from(signal.number())));
            }
            Ok(())
        })
    }

    fn resize(&self, _size: TtySize) -> BoxFuture<'_, Result<(), BackendError>> {
        Box::pin(async { Ok(()) })
    }

    fn wait(&self) -> BoxFuture<'_, Result<i64, BackendError>> {
        Box::pin(async move {
            let mut rx = self.exit.subscribe();
            let code = rx
                .wait_for(Option::is_some)
                .await
                .map_err(|_| BackendError::Runtime("the command vanished".to_owned()))?;
            Ok(code.unwrap_or(-1))
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
    kernels: Arc<Processes>,
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
