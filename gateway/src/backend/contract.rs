//! The contract of [`KernelBackend`]: one set of checks any engine passes, run against the
//! fake engine here and against Docker (ignored by default: it needs the engine and the
//! kernel image; `cargo test -p kernelgate --lib -- --ignored docker_engine_passes`).
//! A capability an engine lacks must answer [`BackendError::NotSupported`].

use super::sandbox::{Command, Hardening, RunOnce, SandboxSpec, KERNEL_HOME};
use super::{BackendError, InteractiveRequest, KernelBackend, LaunchRequest, Output, Signal};
use futures::StreamExt;
use std::collections::BTreeMap;
use std::time::Duration;

/// How long any one step may take, even on a loaded machine under gVisor.
const STEP: Duration = Duration::from_secs(60);

async fn within<T>(what: &str, work: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(STEP, work)
        .await
        .unwrap_or_else(|_| panic!("{what} took longer than {} s", STEP.as_secs()))
}

/// Every check, in turn, against `backend`, with kernels of `image`.
pub async fn check_all(backend: &dyn KernelBackend, image: &str) {
    a_kernel_is_launched_found_restarted_and_removed(backend, image).await;
    missing_capabilities_say_so(backend, image).await;
    sandboxes_are_made_from_a_spec_found_by_label_signalled_and_stopped(backend, image).await;
    a_one_shot_run_answers_with_its_output(backend, image).await;
    an_interactive_command_streams_and_is_waited_for(backend, image).await;
    a_tree_put_into_the_home_is_read_back(backend, image).await;
}

fn launch_request(image: &str) -> LaunchRequest {
    LaunchRequest {
        kernel_id: uuid::Uuid::new_v4().to_string(),
        kernel_name: "python3".to_owned(),
        image: image.to_owned(),
        env: BTreeMap::new(),
        preload: false,
        owner: None,
        memory_mb: None,
        cpus: None,
    }
}

/// A kernel launched, for a check that needs one; removed by the caller.
async fn launched(backend: &dyn KernelBackend, image: &str) -> String {
    within("launch", backend.launch(&launch_request(image)))
        .await
        .expect("launch")
        .handle
}

pub async fn a_kernel_is_launched_found_restarted_and_removed(
    backend: &dyn KernelBackend,
    image: &str,
) {
    let request = launch_request(image);
    let launched = within("launch", backend.launch(&request))
        .await
        .expect("launch");
    launched
        .connection
        .validate()
        .expect("usable connection info");
    let found = within("list", backend.list()).await.expect("list");
    let mine = found
        .iter()
        .find(|f| f.handle == launched.handle)
        .expect("a launched kernel is listed");
    assert_eq!(mine.kernel_id, request.kernel_id);
    assert!(!mine.moved);
    // A restart moves another kernel into it (as into a warm kernel), named by the kernel
    // it was started for; the move and the kernel's owner are listed from then on.
    within(
        "set_kernel_id",
        backend.set_kernel_id(&request.kernel_id, "moved-in"),
    )
    .await
    .expect("set_kernel_id");
    within(
        "set_owner",
        backend.set_owner(&request.kernel_id, "tenant-a"),
    )
    .await
    .expect("set_owner");
    let found = within("list", backend.list()).await.expect("list");
    let mine = found
        .iter()
        .find(|f| f.handle == launched.handle)
        .expect("a moved kernel is listed");
    assert_eq!(
        (mine.kernel_id.as_str(), mine.moved, mine.owner.as_deref()),
        ("moved-in", true, Some("tenant-a"))
    );
    within("restart", backend.restart(&launched.handle))
        .await
        .expect("restart");
    within("interrupt", backend.interrupt(&launched.handle))
        .await
        .expect("interrupt");
    within("remove", backend.remove(&launched.handle))
        .await
        .expect("remove");
    let found = within("list", backend.list()).await.expect("list");
    assert!(
        found.iter().all(|f| f.handle != launched.handle),
        "a removed kernel is not listed"
    );
    // Dead and gone: the watch says so at once, one way or the other.
    let _ = within("wait_exit", backend.wait_exit(&launched.handle)).await;
    assert!(
        matches!(
            within("interrupt", backend.interrupt(&launched.handle)).await,
            Err(BackendError::Gone { .. })
        ),
        "a removed kernel is gone"
    );
}

pub async fn missing_capabilities_say_so(backend: &dyn KernelBackend, image: &str) {
    let caps = backend.capabilities();
    let unsupported = |r: Result<(), BackendError>, has: bool, what: &str| match r {
        Err(BackendError::NotSupported { engine, .. }) => {
            assert!(!has, "{what}: claimed, yet not supported");
            assert_eq!(engine, backend.engine());
        }
        _ => assert!(
            has,
            "{what}: not claimed, yet it did not say it is not supported"
        ),
    };
    let handle = launched(backend, image).await;
    let dir = std::env::temp_dir();
    if !caps.checkpoint {
        let r = backend.checkpoint(&handle, &dir).await;
        unsupported(r, false, "checkpoint");
    }
    let spec = spec_of(image);
    if !caps.restore {
        let r = backend.restore(&spec, &dir).await.map(drop);
        unsupported(r, false, "restore");
    }
    if !caps.clone {
        let r = backend.clone_sandbox(&handle, &spec).await.map(drop);
        unsupported(r, false, "clone");
    }
    let message = BackendError::NotSupported {
        what: "checkpoints",
        engine: backend.engine(),
    }
    .to_string();
    assert!(
        message.contains("not supported by this engine"),
        "{message}"
    );
    within("remove", backend.remove(&handle))
        .await
        .expect("remove");
}

fn spec_of(image: &str) -> SandboxSpec {
    let mut spec = SandboxSpec::new(
        image,
        Command::Filtered(vec!["sleep".to_owned(), "600".to_owned()]),
        Hardening::new(super::sandbox::Isolation::RuncLike, RunOnce::LIMITS),
    );
    spec.labels = BTreeMap::from([(
        "org.kernelgate.contract".to_owned(),
        uuid::Uuid::new_v4().to_string(),
    )]);
    spec
}

pub async fn sandboxes_are_made_from_a_spec_found_by_label_signalled_and_stopped(
    backend: &dyn KernelBackend,
    image: &str,
) {
    if !backend.capabilities().sandboxes {
        return;
    }
    let mut spec = spec_of(image);
    spec.hardening.isolation = backend.isolation();
    let handle = within("create", backend.create(&spec))
        .await
        .expect("create");
    let found = within("list_labelled", backend.list_labelled(&spec.labels))
        .await
        .expect("list by label");
    assert_eq!(found.len(), 1, "exactly the sandbox with these labels");
    assert_eq!(found[0].handle, handle);
    assert!(!found[0].running, "created, not started");
    within("start", backend.start(&handle))
        .await
        .expect("start");
    let found = within("list_labelled", backend.list_labelled(&spec.labels))
        .await
        .expect("list by label");
    assert!(found[0].running, "started");
    within("signal", backend.signal(&handle, Signal::Kill))
        .await
        .expect("signal");
    let exit = within("wait_exit", backend.wait_exit(&handle))
        .await
        .expect("its death");
    assert!(
        exit.cause().contains("signal 9"),
        "the cause names the signal: {}",
        exit.cause()
    );
    within("stop", backend.stop(&handle, Duration::from_secs(1)))
        .await
        .expect("stopping a stopped sandbox is no error");
    within("remove", backend.remove(&handle))
        .await
        .expect("remove");
    let found = within("list_labelled", backend.list_labelled(&spec.labels))
        .await
        .expect("list by label");
    assert!(found.is_empty(), "removed");
}

pub async fn a_one_shot_run_answers_with_its_output(backend: &dyn KernelBackend, image: &str) {
    let request = RunOnce {
        image: image.to_owned(),
        argv: vec!["echo".to_owned(), "one".to_owned(), "shot".to_owned()],
        user: None,
        mounts: Vec::new(),
        limits: RunOnce::LIMITS,
        timeout: STEP,
        max_output: 1024,
    };
    if !backend.capabilities().run_once {
        assert!(matches!(
            backend.run_once(request).await,
            Err(BackendError::NotSupported { .. })
        ));
        return;
    }
    let out = within("run_once", backend.run_once(request.clone()))
        .await
        .expect("run once");
    assert_eq!(out.exit_code, 0, "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "one shot\n");
    let failing = RunOnce {
        argv: vec!["false".to_owned()],
        ..request
    };
    let out = within("run_once", backend.run_once(failing))
        .await
        .expect("run once");
    assert_eq!(out.exit_code, 1, "a failure is an exit code, not an error");
}

pub async fn an_interactive_command_streams_and_is_waited_for(
    backend: &dyn KernelBackend,
    image: &str,
) {
    use tokio::io::AsyncWriteExt;
    if !backend.capabilities().interactive_exec {
        return;
    }
    let handle = launched(backend, image).await;
    let request = InteractiveRequest {
        argv: vec!["cat".to_owned()],
        env: Vec::new(),
        workdir: None,
        tty: None,
    };
    let mut cat = within(
        "exec_interactive",
        backend.exec_interactive(&handle, request.clone()),
    )
    .await
    .expect("interactive exec");
    cat.stdin.write_all(b"hello\n").await.expect("write");
    cat.stdin.shutdown().await.expect("end of input");
    let mut out = Vec::new();
    while let Some(piece) = within("output", cat.output.next()).await {
        if let Output::Stdout(bytes) = piece.expect("output") {
            out.extend_from_slice(&bytes);
        }
    }
    assert_eq!(String::from_utf8_lossy(&out), "hello\n");
    assert_eq!(within("wait", cat.control.wait()).await.expect("wait"), 0);
    // A command that waits for input ends with the signal sent to it.
    let waiting = within(
        "exec_interactive",
        backend.exec_interactive(&handle, request),
    )
    .await
    .expect("interactive exec");
    // Give a real engine a moment to start it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    within("signal", waiting.control.signal(Signal::Terminate))
        .await
        .expect("signal");
    let code = within("wait", waiting.control.wait()).await.expect("wait");
    assert_ne!(code, 0, "ended by the signal");
    within("remove", backend.remove(&handle))
        .await
        .expect("remove");
}

pub async fn a_tree_put_into_the_home_is_read_back(backend: &dyn KernelBackend, image: &str) {
    if !backend.capabilities().files {
        return;
    }
    let handle = launched(backend, image).await;
    let mut tree = tar::Builder::new(Vec::new());
    let text = b"kept\n";
    let mut header = tar::Header::new_gnu();
    header.set_size(text.len() as u64);
    header.set_mode(0o600);
    header.set_cksum();
    tree.append_data(&mut header, "note.txt", &text[..])
        .expect("tar");
    let tree = tree.into_inner().expect("tar");
    within(
        "put_tree",
        backend.put_tree(&handle, KERNEL_HOME, tree.into()),
    )
    .await
    .expect("put a tree");
    let mut stream = within("read_home", backend.read_home(&handle))
        .await
        .expect("read the home");
    let mut bytes = Vec::new();
    while let Some(piece) = stream.next().await {
        bytes.extend_from_slice(&piece.expect("home stream"));
    }
    let mut archive = tar::Archive::new(&bytes[..]);
    let names: Vec<String> = archive
        .entries()
        .expect("a tar")
        .filter_map(|e| e.ok()?.path().ok().map(|p| p.display().to_string()))
        .collect();
    assert!(
        names
            .iter()
            .any(|n| n.trim_start_matches("./") == "note.txt"),
        "the home holds the file put there: {names:?}"
    );
    within("remove", backend.remove(&handle))
        .await
        .expect("remove");
}

#[tokio::test]
async fn the_fake_engine_passes_the_contract() {
    let fake = super::fake::FakeBackend::new();
    check_all(fake.as_ref(), "kernelgate-kernel:latest").await;
    assert_eq!(fake.runs().len(), 2, "each one-shot run is recorded");
}

/// Against the local Docker engine and `KERNELGATE_IMAGE` (default
/// `kernelgate-kernel:latest`), under `KERNELGATE_RUNTIME` (default runc).
#[tokio::test]
#[ignore = "needs Docker and the kernel image"]
async fn docker_engine_passes_the_contract() {
    use crate::config::RuntimeChoice;
    let image =
        std::env::var("KERNELGATE_IMAGE").unwrap_or_else(|_| "kernelgate-kernel:latest".into());
    let runtime = match std::env::var("KERNELGATE_RUNTIME").as_deref() {
        Ok("runsc") => RuntimeChoice::Runsc,
        _ => RuntimeChoice::Runc,
    };
    let dir = std::path::PathBuf::from(format!(
        "/run/kg-contract-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    std::fs::create_dir_all(&dir).expect("runtime directory");
    let settings = super::docker::DockerSettings {
        image: image.clone(),
        runtime_dir: dir.clone(),
        memory_mb: 512,
        cpus: 1.0,
        pids: 256,
        disk_mb: 256,
        runtime,
        packages: None,
    };
    let backend = super::docker::DockerBackend::connect(settings)
        .await
        .expect("Docker");
    check_all(&backend, &image).await;
    // Beyond the contract: one-shot runs and interactive commands run under the
    // launcher's syscall filter, which refuses ptrace (Docker's default profile allows
    // PTRACE_TRACEME; gVisor implements it).
    let ptrace = "import ctypes; libc = ctypes.CDLL(None, use_errno=True); \
                  print(libc.ptrace(0, 0, 0, 0), ctypes.get_errno())";
    let out = backend
        .run_once(RunOnce {
            image: image.clone(),
            argv: vec!["python3".to_owned(), "-c".to_owned(), ptrace.to_owned()],
            user: None,
            mounts: Vec::new(),
            limits: RunOnce::LIMITS,
            timeout: STEP,
            max_output: 1024,
        })
        .await
        .expect("run once");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "-1 1\n", "{out:?}");
    let handle = launched(&backend, &image).await;
    let mut probe = backend
        .exec_interactive(
            &handle,
            InteractiveRequest {
                argv: vec!["python3".to_owned(), "-c".to_owned(), ptrace.to_owned()],
                env: Vec::new(),
                workdir: None,
                tty: None,
            },
        )
        .await
        .expect("interactive exec");
    let mut printed = Vec::new();
    while let Some(piece) = probe.output.next().await {
        if let Output::Stdout(bytes) = piece.expect("output") {
            printed.extend_from_slice(&bytes);
        }
    }
    assert_eq!(String::from_utf8_lossy(&printed), "-1 1\n");
    backend.remove(&handle).await.expect("remove");
    drop(backend);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_fake_engine_records_what_it_was_asked_to_create() {
    let fake = super::fake::FakeBackend::new();
    let spec = spec_of("img");
    let handle = fake.create(&spec).await.expect("create");
    let record = fake.records().remove(&handle).expect("recorded");
    assert_eq!(record.spec.as_ref(), Some(&spec));
    assert_eq!(record.labels, spec.labels);
}

/// Against the gVisor engine (runsc directly, as root) and `KERNELGATE_IMAGE`, brought into
/// an image store from Docker once for the test.
#[tokio::test]
#[ignore = "needs root, runsc and the kernel image"]
async fn gvisor_engine_passes_the_contract() {
    use super::gvisor::{default_runsc, images, GvisorEngine, GvisorSettings, ImageResolver};
    let image =
        std::env::var("KERNELGATE_IMAGE").unwrap_or_else(|_| "kernelgate-kernel:latest".into());
    let store = std::path::Path::new("/var/tmp/kernelgate-gvisor-images");
    let store = super::gvisor::tests::store_from_docker(store, &image);
    let dir = std::path::PathBuf::from(format!(
        "/run/kg-contract-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    std::fs::create_dir_all(&dir).expect("runtime directory");
    let settings = GvisorSettings {
        runsc: default_runsc(),
        image: image.clone(),
        runtime_dir: dir.clone(),
        memory_mb: 512,
        cpus: 1.0,
        pids: 256,
        disk_mb: 256,
        packages: None,
    };
    let resolve: ImageResolver = std::sync::Arc::new(move |r| images::resolve(&store, r));
    let backend = GvisorEngine::new(settings.clone(), resolve.clone()).expect("the engine");
    check_all(&backend, &image).await;
    // Beyond the contract: a process that ends within milliseconds of its start is
    // reported with its own exit status (runsc keeps none once its sandbox has gone).
    let mut spec = spec_of(&image);
    spec.hardening.isolation = backend.isolation();
    spec.command = Command::Filtered(vec!["sh".into(), "-c".into(), "exit 3".into()]);
    let handle = backend.create(&spec).await.expect("create");
    backend.start(&handle).await.expect("start");
    let exit = within("wait_exit", backend.wait_exit(&handle))
        .await
        .expect("its end");
    assert_eq!(exit.code, 3, "{}", exit.cause());
    // So does a gateway started later on the same runtime directory, which never watched it.
    let later = GvisorEngine::new(settings.clone(), resolve.clone()).expect("the engine");
    let exit = within("wait_exit", later.wait_exit(&handle))
        .await
        .expect("its end");
    assert_eq!(exit.code, 3, "{}", exit.cause());
    drop(later);
    backend.remove(&handle).await.expect("remove");
    // An interactive command with a terminal sees one, of the size asked for.
    let handle = launched(&backend, &image).await;
    let mut stty = backend
        .exec_interactive(
            &handle,
            InteractiveRequest {
                argv: vec!["stty".to_owned(), "size".to_owned()],
                env: Vec::new(),
                workdir: None,
                tty: Some(super::TtySize {
                    rows: 33,
                    cols: 101,
                }),
            },
        )
        .await
        .expect("interactive exec");
    let mut printed = Vec::new();
    while let Some(piece) = within("output", stty.output.next()).await {
        if let Output::Stdout(bytes) = piece.expect("output") {
            printed.extend_from_slice(&bytes);
        }
    }
    assert_eq!(String::from_utf8_lossy(&printed).trim(), "33 101");
    assert_eq!(within("wait", stty.control.wait()).await.expect("wait"), 0);
    // What the kernel's process writes to its stdout and stderr (outside ipykernel's
    // capture) is kept on the host, in the sandbox's bundle, as Docker keeps a
    // container's log.
    let written = backend
        .exec(
            &handle,
            super::ExecRequest::new(
                vec![
                    "sh".to_owned(),
                    "-c".to_owned(),
                    "echo kept-in-the-log > /proc/1/fd/1".to_owned(),
                ],
                bytes::Bytes::new(),
                1024,
                STEP,
            ),
        )
        .await
        .expect("exec");
    assert_eq!(written.exit_code, 0, "{written:?}");
    let log = dir
        .join("gvisor")
        .join("bundles")
        .join(&handle)
        .join("kernel.log");
    let text = std::fs::read_to_string(&log).expect("the kernel's log");
    assert!(text.contains("kept-in-the-log"), "{text}");
    backend.remove(&handle).await.expect("remove");
    // Nothing of runsc's is left.
    let root = dir.join("gvisor").join("root");
    let left: Vec<_> = std::fs::read_dir(&root)
        .map(|d| d.filter_map(Result::ok).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        left.iter().all(|n| !n.to_string_lossy().starts_with("kg")),
        "{left:?}"
    );
    drop(backend);
    let _ = std::fs::remove_dir_all(&dir);
}
