//! End to end: a kernel whose code writes garbage on its own sockets. The gateway relays
//! none of it, keeps serving the kernel, and logs it at a bounded rate (so a kernel cannot
//! fill the host's disk through the gateway's log); the metrics count every message.

use anyhow::{Context, Result};
use kernelgate_tests::Gateway;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_kernel_messages_are_dropped_and_logged_sparingly() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let model = gw.create_kernel().await?;
    let id = model["id"].as_str().unwrap_or_default();
    let mut watcher = gw.channels(id, "watcher").await?;
    watcher.kernel_info().await?;
    // 2000 multipart messages with a made-up signature, straight onto the kernel's IOPub.
    let forge = r#"
k = get_ipython().kernel
for i in range(2000):
    k.iopub_socket.send_multipart([b'stream', b'<IDS|MSG>', b'0' * 64,
        b'{"msg_id": "forged-%d", "msg_type": "stream", "session": "s", "username": "u", "date": "", "version": "5.3"}' % i,
        b'{}', b'{}', b'{"name": "stdout", "text": "FORGED\\n"}'])
print('sent')
"#;
    let r = gw.execute(id, forge).await?;
    assert_eq!(r["stdout"], "sent\n", "{r}");
    let r = gw.execute(id, "1 + 1").await?;
    assert_eq!(
        r["results"][0]["data"]["text/plain"], "2",
        "the kernel still answers: {r}"
    );

    let metrics = gw.metrics().await?;
    let dropped: f64 = metrics
        .lines()
        .find(|l| l.starts_with("kernelgate_dropped_messages_total{reason=\"bad_from_kernel\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(dropped >= 1000.0, "dropped {dropped}:\n{metrics}");
    let logs = gw.logs.lock().map(|l| l.clone()).unwrap_or_default();
    let lines = logs
        .iter()
        .filter(|l| l.contains("dropping message from kernel"))
        .count();
    assert!(
        (1..=5).contains(&lines),
        "{lines} log lines for {dropped} dropped messages"
    );
    // Nothing forged reached a client (the code that forged them did, as execute_input).
    let after = watcher.execute("print('after')").await?;
    assert_eq!(after.stdout, "after\n");
    let forged =
        |m: &serde_json::Value| m["msg_type"] == "stream" && m["content"]["text"] == "FORGED\n";
    assert!(
        !watcher.seen.iter().any(forged),
        "a forged message was relayed"
    );
    watcher.close().await?;
    Ok(())
}

/// Calls each syscall an attacker would want with harmless arguments, from inside a kernel:
/// every one fails with EPERM, and the ones an analysis uses still work.
const SYSCALL_PROBE: &str = r#"
import ctypes, json, os, platform
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {
    'x86_64': dict(ptrace=101, process_vm_readv=310, process_vm_writev=311, userfaultfd=323,
                   io_uring_setup=425, io_uring_enter=426, io_uring_register=427, add_key=248,
                   request_key=249, keyctl=250, bpf=321, perf_event_open=298, personality=135),
    'aarch64': dict(ptrace=117, process_vm_readv=270, process_vm_writev=271, userfaultfd=282,
                    io_uring_setup=425, io_uring_enter=426, io_uring_register=427, add_key=217,
                    request_key=218, keyctl=219, bpf=280, perf_event_open=241, personality=92),
}[platform.machine()]
buf = ctypes.create_string_buffer(256)
def call(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(NR[name]), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return [r, ctypes.get_errno()]
out = {
    'ptrace': call('ptrace', 0x4206, 1, 0, 0),                     # PTRACE_SEIZE tini
    'process_vm_readv': call('process_vm_readv', os.getpid(), 0, 0, 0, 0, 0),
    'process_vm_writev': call('process_vm_writev', os.getpid(), 0, 0, 0, 0, 0),
    'userfaultfd': call('userfaultfd', 0),
    'io_uring_setup': call('io_uring_setup', 1, buf),
    'io_uring_enter': call('io_uring_enter', -1, 0, 0, 0, 0, 0),
    'io_uring_register': call('io_uring_register', -1, 0, 0, 0),
    'add_key': call('add_key', b'user', b'k', b'v', 1, -2),
    'request_key': call('request_key', b'user', b'k', 0, -2),
    'keyctl': call('keyctl', 0, -3, 0),
    'bpf': call('bpf', 5, buf, 128),
    'perf_event_open': call('perf_event_open', buf, 0, -1, -1, 0),
    'personality_exec': call('personality', 0x0400000),            # READ_IMPLIES_EXEC
}
allowed = {'personality_query': call('personality', 0xffffffff), 'getpid': [os.getpid(), 0]}
if platform.machine() == 'x86_64':
    out['x32_getpid'] = [libc.syscall(ctypes.c_long(0x40000000 + 39)), ctypes.get_errno()]
print(json.dumps({'denied': out, 'allowed': allowed}))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dangerous_syscalls_fail_with_eperm() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let model = gw.create_kernel().await?;
    let id = model["id"].as_str().unwrap_or_default();
    let r = gw.execute(id, SYSCALL_PROBE).await?;
    assert_eq!(r["status"], "ok", "{r}");
    let facts: serde_json::Value = serde_json::from_str(r["stdout"].as_str().unwrap_or("").trim())?;
    let denied = facts["denied"].as_object().cloned().unwrap_or_default();
    assert!(denied.len() >= 13, "{facts}");
    for (name, result) in &denied {
        assert_eq!(
            result,
            &serde_json::json!([-1, 1]),
            "{name} must fail with EPERM: {facts}"
        );
    }
    let query = &facts["allowed"]["personality_query"];
    if kernelgate_tests::gvisor() {
        // gVisor implements no personality(2) at all and answers EINVAL itself: the filter
        // let the call through (it would have answered EPERM).
        assert_eq!(
            query,
            &serde_json::json!([-1, 22]),
            "personality query reaches gVisor: {facts}"
        );
    } else {
        assert!(
            query[0].as_i64().is_some_and(|v| v >= 0),
            "personality query still works: {facts}"
        );
    }
    // The filter does not get in an analysis' way.
    let r = gw
        .execute(id, "import numpy, pandas, threading, subprocess\nt = threading.Thread(target=lambda: None); t.start(); t.join()\nprint(subprocess.run(['echo', 'ok'], capture_output=True, text=True).stdout, pandas.DataFrame({'a': numpy.arange(3)}).a.sum())")
        .await?;
    assert_eq!(r["stdout"], "ok\n 3\n", "{r}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_socket_directory_holds_one_mib_and_no_more() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let model = gw.create_kernel().await?;
    let id = model["id"].as_str().unwrap_or_default().to_owned();
    let fill = r#"
import errno, json, os
def fill(path, size):
    written = 0
    try:
        with open(path, 'wb') as f:
            while written < size:
                f.write(b'x' * 65536); f.flush(); written += 65536
    except OSError as e:
        return [written, errno.errorcode[e.errno]]
    return [written, None]
big = fill('/run/kernel/big', 64 << 20)
os.remove('/run/kernel/big')
files = 0
try:
    while files < 10000:
        open('/run/kernel/f%d' % files, 'w').close(); files += 1
except OSError as e:
    files = [files, errno.errorcode[e.errno]]
for name in os.listdir('/run/kernel'):
    if name.startswith('f'):
        os.remove('/run/kernel/' + name)
print(json.dumps({'big': big, 'files': files}))
"#;
    let r = gw.execute(&id, fill).await?;
    let out = r["stdout"].as_str().unwrap_or_default().to_owned();
    let facts: serde_json::Value = serde_json::from_str(out.trim())?;
    let (big, files) = (&facts["big"], &facts["files"]);
    assert_eq!(big[1], "ENOSPC", "{out}");
    assert!(big[0].as_u64().is_some_and(|b| b <= 1 << 20), "{out}");
    assert_eq!(files[1], "ENOSPC", "{out}");
    assert!(files[0].as_u64().is_some_and(|n| n < 64), "{out}");
    // The kernel still works, and its directory and mount go with it.
    assert_eq!(
        gw.execute(&id, "6 * 7").await?["results"][0]["data"]["text/plain"],
        "42"
    );
    let dir = gw.runtime_dir.join(&id);
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    assert!(
        mounts.contains(&*dir.to_string_lossy()),
        "a tmpfs of its own: {mounts}"
    );
    gw.delete_kernel(&id).await?;
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    assert!(
        !mounts.contains(&*dir.to_string_lossy()),
        "unmounted at delete"
    );
    assert!(!dir.exists());
    Ok(())
}

/// A kernel that swaps its connection file for a FIFO and plants symlinks to host sockets,
/// then waits for the gateway to come back after a crash: the new gateway starts, neither
/// blocks on the FIFO nor follows a link, and removes the kernel instead of adopting it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_booby_trapped_socket_directory_is_not_trusted() -> Result<()> {
    let dir = format!("/run/kg-trap-{}", std::process::id());
    let gw = Gateway::start(&["--runtime-dir", &dir]).await?;
    let model = gw.create_kernel().await?;
    let id = model["id"].as_str().unwrap_or_default().to_owned();
    let trap = r#"
import os
os.remove('/run/kernel/kernel.json')
os.mkfifo('/run/kernel/kernel.json')
os.symlink('/var/run/docker.sock', '/run/kernel/kernel-9')
print(sorted(os.listdir('/run/kernel')))
"#;
    let r = gw.execute(&id, trap).await?;
    assert!(
        r["stdout"]
            .as_str()
            .is_some_and(|s| s.contains("kernel.json")),
        "{r}"
    );
    // With nosymfollow on the directory's own mount, the link leads nowhere from the host.
    let planted = std::path::Path::new(&dir).join(&id).join("kernel-9");
    assert!(std::fs::symlink_metadata(&planted)?
        .file_type()
        .is_symlink());
    assert!(std::os::unix::net::UnixStream::connect(&planted).is_err());
    let crashed = gw.crash().await?;

    let started = std::time::Instant::now();
    let gw = crashed.restart(&[]).await?;
    assert!(started.elapsed() < std::time::Duration::from_secs(20));
    let (status, kernels) = gw.get_json("/api/kernels").await?;
    assert_eq!(status, 200);
    assert_eq!(
        kernels,
        serde_json::json!([]),
        "the trapped kernel is not adopted"
    );
    assert!(
        !std::path::Path::new(&dir).join(&id).exists(),
        "its directory is removed"
    );
    let fresh = gw.create_kernel().await?;
    let fresh_id = fresh["id"].as_str().unwrap_or_default();
    assert_eq!(
        gw.execute(fresh_id, "1 + 1").await?["results"][0]["data"]["text/plain"],
        "2"
    );
    assert_eq!(gw.stop().await?.code(), Some(0));
    let _ = std::fs::remove_dir(&dir);
    Ok(())
}

/// Four kernels flood IOPub with 1 MiB messages as fast as they can, every twentieth of
/// them 40 MiB (over the 16 MiB limit), with no client attached; a fifth keeps answering.
/// The gateway's memory stays within its budget (docs/security.md, "Memory budget") and
/// returns to its baseline afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flooding_kernels_cannot_exhaust_the_gateway() -> Result<()> {
    const MAX_MESSAGE_MB: u64 = 16;
    const FLOODERS: u64 = 4;
    let _alone = kernelgate_tests::machine_to_myself()?;
    let gw = Gateway::start(&["--max-message-mb", "16", "--kernel-memory-mb", "1536"]).await?;
    let mut ids = Vec::new();
    for _ in 0..=FLOODERS {
        let model = gw.create_kernel().await?;
        ids.push(model["id"].as_str().unwrap_or_default().to_owned());
    }
    for id in &ids {
        assert_eq!(
            gw.execute(id, "1 + 1").await?["results"][0]["data"]["text/plain"],
            "2"
        );
    }
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let baseline = gw.rss_bytes()?;
    let before = gw.metrics().await?;
    // In the kernel's IOPub thread, straight on its PUB socket: as fast as ZeroMQ goes,
    // with its high-water mark dropping what the gateway cannot take (no queue grows).
    // It goes on until the test clears `flooding` (or, should the test die, for 3 minutes).
    let flood = r#"
import time
k = get_ipython().kernel
io = k.iopub_thread
# The kernel's own memory must hold out while the gateway refuses and reconnects: queued
# messages share the two buffers (zero-copy), and a short send queue once the gateway
# reconnects.
io.socket.sndhwm = 16
def signed(text):
    return k.session.serialize(k.session.msg('stream', {'name': 'stdout', 'text': text}))
small, big = signed('x' * (1 << 20)), signed('y' * (40 << 20))
flooding, deadline, sent = [True], time.monotonic() + 180, [0]
def burst():
    pause = time.monotonic() + 0.05
    while time.monotonic() < pause:
        io.socket.send_multipart(big if sent[0] % 20 == 0 else small, copy=False)
        sent[0] += 1
    if flooding[0] and time.monotonic() < deadline:
        io.schedule(burst)
io.schedule(burst)
print('flooding')
"#;
    let received_bytes = |m: &str| {
        sample(
            m,
            r#"kernelgate_relayed_bytes_total{direction="kernel_to_client"}"#,
        )
    };
    let refused_messages = |m: &str| {
        sample(
            m,
            r#"kernelgate_dropped_messages_total{reason="too_large_from_kernel"}"#,
        )
    };
    // The flood lasts at least 15 s, and longer (up to 90 s) until 64 MiB and an oversized
    // message per flooder went through the gateway and the calm kernel answered 10 times:
    // on a machine busy with other sandboxes the kernels may get little CPU for a while,
    // and a flood that never flowed proves nothing. Meanwhile the calm kernel is asked
    // `1 + 1` again and again, and the gateway's memory is sampled after every answer.
    let flooders = &ids[..FLOODERS as usize];
    let started = std::time::Instant::now();
    let floods = futures::future::join_all(flooders.iter().map(|id| gw.execute(id, flood)));
    let calm = &ids[FLOODERS as usize];
    let answering = async {
        let (mut peak, mut answered, mut longest) = (baseline, 0u32, std::time::Duration::ZERO);
        loop {
            let asked = std::time::Instant::now();
            let r = gw.execute(calm, "1 + 1").await?;
            assert_eq!(
                r["status"], "ok",
                "the calm kernel failed during the flood: {r}"
            );
            assert_eq!(r["results"][0]["data"]["text/plain"], "2", "{r}");
            answered += 1;
            longest = longest.max(asked.elapsed());
            peak = peak.max(gw.rss_bytes()?);
            let elapsed = started.elapsed();
            if elapsed >= std::time::Duration::from_secs(90) {
                return Ok::<_, anyhow::Error>((peak, answered, longest, elapsed));
            }
            if elapsed >= std::time::Duration::from_secs(15) && answered >= 10 {
                let now = gw.metrics().await?;
                if received_bytes(&now) - received_bytes(&before) >= f64::from(64 << 20)
                    && refused_messages(&now) - refused_messages(&before) >= FLOODERS as f64
                {
                    return Ok((peak, answered, longest, elapsed));
                }
            }
        }
    };
    let (flooded, calm_result) = tokio::join!(floods, answering);
    let (peak, answered, longest, flood_time) = calm_result?;
    for r in flooded {
        // Its own output competes with the flood and may be dropped: the reply counts.
        let r = r?;
        assert_eq!(r["status"], "ok", "{r}");
    }
    for r in futures::future::join_all(
        flooders
            .iter()
            .map(|id| gw.execute(id, "flooding[0] = False")),
    )
    .await
    {
        let r = r?;
        assert_eq!(r["status"], "ok", "the flood is stopped: {r}");
    }
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    let after = gw.metrics().await?;
    let received = received_bytes(&after) - received_bytes(&before);
    let refused = refused_messages(&after) - refused_messages(&before);
    let budget = baseline + FLOODERS * 2 * MAX_MESSAGE_MB * (1 << 20) + (64 << 20);
    let mut settled = gw.rss_bytes()?;
    let calm_down = std::time::Instant::now();
    while settled > baseline + (32 << 20)
        && calm_down.elapsed() < std::time::Duration::from_secs(30)
    {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        settled = gw.rss_bytes()?;
    }
    let summary = format!(
        "flood of {:.1} s: gateway RSS baseline {:.1} MiB, peak {:.1} MiB (budget {:.1} MiB), settled {:.1} MiB after {:.1} s; {:.0} MiB received from the flooders, {refused} oversized messages refused; calm kernel answered {answered} times, its longest answer took {:.1} s",
        flood_time.as_secs_f64(), mib(baseline), mib(peak), mib(budget), mib(settled),
        calm_down.elapsed().as_secs_f64(), received / f64::from(1 << 20), longest.as_secs_f64()
    );
    println!("{summary}");
    assert!(
        received >= f64::from(64 << 20),
        "the flood did flow (the debug build checks signatures slowly, but not that slowly): {summary}"
    );
    assert!(
        refused >= FLOODERS as f64,
        "every flooder's oversized messages were refused: {summary}"
    );
    assert!(answered >= 10, "the calm kernel kept answering: {summary}");
    assert!(peak <= budget, "peak over the budget: {summary}");
    assert!(
        settled <= baseline + (32 << 20),
        "RSS not within 32 MiB of the baseline 30 s after the flood: {summary}"
    );
    // The flooders are still kernels that work, and the oversized messages were counted.
    // Its IOPub may still be draining a last burst, and output sent while the gateway
    // reconnects after a refusal is lost (the kernel's own doing): ask until it answers.
    let mut answer = None;
    for _ in 0..10 {
        let r = gw.execute(&ids[0], "sent[0]").await?;
        assert_eq!(r["status"], "ok", "{r}");
        answer = r["results"][0]["data"]["text/plain"]
            .as_str()
            .and_then(|v| v.parse::<u64>().ok());
        if answer.is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    }
    let sent = answer.context("the flooder still answers")?;
    assert!(sent > 100, "{sent}");
    Ok(())
}

/// The value of one series in a Prometheus text exposition (0 when absent).
fn sample(exposition: &str, series: &str) -> f64 {
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0.0)
}
