//! End to end, under the runtime of the run (`KERNELGATE_RUNTIME`, runc or runsc) or the
//! gVisor engine (`KERNELGATE_ENGINE=gvisor`): the gateway says which runtime its kernels
//! run under, the sandboxes are made with it and say so on their labels, and the limits a
//! kernel is given bind under either runtime, read from the host's cgroup of the sandbox.

use anyhow::{Context, Result};
use kernelgate_tests::{reported_runtime, runtime, CgroupVersion, Gateway, Sandbox};
use std::process::Command;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernels_run_under_the_chosen_runtime() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let (status, api) = gw.get_json("/api").await?;
    assert_eq!(status, 200);
    assert_eq!(api["kernelgate"]["runtime"], reported_runtime(), "{api}");
    assert!(api["version"].is_string(), "Jupyter's field stays: {api}");
    let said = format!("runtime=\"{}\"", reported_runtime());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let logs = gw.logs.lock().map(|l| l.join("\n")).unwrap_or_default();
        if logs.contains(&said) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no {said} in the start lines: {logs}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let model = gw.create_kernel().await?;
    let id = model["id"].as_str().unwrap_or_default();
    let sandbox = gw.sandbox(id)?;
    let expected = if kernelgate_tests::gvisor_engine() {
        "runsc".to_owned()
    } else {
        kernelgate_tests::engine_runtime()
    };
    assert_eq!(sandbox.runtime, expected);
    assert_eq!(
        sandbox.labels.get("org.kernelgate.runtime"),
        Some(&runtime())
    );
    // Which Linux kernel answers the kernel's system calls: the host's under runc, gVisor's
    // own under runsc.
    let r = gw
        .execute(id, "import os\nprint(os.uname().release)")
        .await?;
    let inside = r["stdout"].as_str().unwrap_or_default().trim().to_owned();
    let host = String::from_utf8(Command::new("uname").arg("-r").output()?.stdout)?;
    if kernelgate_tests::gvisor() {
        assert_ne!(inside, host.trim(), "gVisor answers, not the host's kernel");
    } else {
        assert_eq!(inside, host.trim());
    }
    Ok(())
}

/// CPU time the sandbox's cgroup used so far, read on the host (cgroup v1 or v2).
fn cgroup_cpu_seconds(sandbox: &Sandbox) -> Result<f64> {
    match sandbox.cgroup_read(("cpuacct", "cpuacct.usage"), "cpu.stat")? {
        (CgroupVersion::V1, ns) => Ok(ns.trim().parse::<f64>()? / 1e9),
        (CgroupVersion::V2, stat) => {
            let usec = stat
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .context("usage_usec in cpu.stat")?;
            Ok(usec.trim().parse::<f64>()? / 1e6)
        }
    }
}

/// Two processes spin in a kernel limited to one CPU; the host's own accounting of the
/// sandbox says how much they got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cpu_quota_binds() -> Result<()> {
    let _alone = kernelgate_tests::machine_to_myself()?;
    let gw = Gateway::start(&["--kernel-cpus", "1"]).await?;
    let model = gw.create_kernel().await?;
    let id = model["id"].as_str().unwrap_or_default();
    let sandbox = gw.sandbox(id)?;
    assert_eq!(sandbox.cpus, 1.0, "{sandbox:?}");
    let spin = r#"
import multiprocessing as mp, time
def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
procs = [mp.Process(target=spin, args=(4,)) for _ in range(2)]
[p.start() for p in procs]
[p.join() for p in procs]
print('done')
"#;
    let before = cgroup_cpu_seconds(&sandbox)?;
    let started = Instant::now();
    let r = gw.execute(id, spin).await?;
    let wall = started.elapsed().as_secs_f64();
    let used = cgroup_cpu_seconds(&sandbox)? - before;
    assert_eq!(r["stdout"], "done\n", "{r}");
    let cpus = used / wall;
    println!("runtime {}: {cpus:.2} CPUs used by two busy processes under a 1-CPU limit ({used:.2} s CPU in {wall:.2} s)", runtime());
    assert!(
        wall >= Duration::from_secs(4).as_secs_f64(),
        "the spin ran its course"
    );
    assert!(
        cpus <= 1.15,
        "limited to 1 CPU, the kernel used {cpus:.2} under {}",
        runtime()
    );
    // The reading is this sandbox's: the spin shows in it. (How much CPU the kernel gets
    // under the limit depends on what else the host runs, so no lower bound on the rate.)
    assert!(
        used >= 0.5,
        "the busy processes' CPU time shows in the kernel's cgroup: {used:.2} s"
    );
    Ok(())
}
