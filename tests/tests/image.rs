//! The kernel image, started with the hardened settings of docs/architecture.md by the
//! gateway's Docker backend, reached over its ipc sockets with `kernelgate-protocol`
//! (through the gateway's kernel module), without the HTTP layer in between.

use anyhow::{anyhow, Result};
use clap::ValueEnum;
use kernelgate::backend::docker::{DockerBackend, DockerSettings};
use kernelgate::backend::{KernelBackend, LaunchRequest};
use kernelgate::config::RuntimeChoice;
use kernelgate::relay::clients::ClientLimits;
use kernelgate::relay::lifecycle::Event;
use kernelgate::relay::{Attachment, Relay};
use kernelgate_protocol::content::ExecuteRequest;
use kernelgate_protocol::{Channel, RawJson};
use kernelgate_tests::{decode_png, Outcome, Tracked};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

async fn run(kernel: &Relay, me: &Attachment, code: &str) -> Result<Outcome> {
    let request = kernel.request(
        "execute_request",
        RawJson::from_value(&ExecuteRequest::new(code)),
    );
    let mut tracked = Tracked::new(request.msg_id());
    me.send(Channel::Shell, request).await?;
    loop {
        let batch = tokio::time::timeout(Duration::from_secs(120), me.recv())
            .await?
            .ok_or_else(|| anyhow!("session closed"))?;
        for o in batch {
            if tracked.feed(o.channel, &o.message) {
                return Ok(tracked.finish());
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardened_container_runs_a_real_kernel() -> Result<()> {
    let runtime_dir = PathBuf::from(format!("/run/kg-image-{}", std::process::id()));
    let result = launch_and_exercise(&runtime_dir).await;
    // What this test made (its container, its runtime directory) goes, whatever happened.
    kernelgate_tests::remove_leftovers(&runtime_dir);
    result
}

async fn launch_and_exercise(runtime_dir: &std::path::Path) -> Result<()> {
    let settings = DockerSettings {
        image: kernelgate_tests::image(),
        runtime_dir: runtime_dir.to_path_buf(),
        memory_mb: 1024,
        cpus: 1.0,
        pids: 256,
        disk_mb: 256,
        runtime: RuntimeChoice::from_str(&kernelgate_tests::runtime(), false)
            .map_err(|e| anyhow!("KERNELGATE_RUNTIME: {e}"))?,
        packages: Some(kernelgate::packages::Mounts {
            wheelhouse: runtime_dir.join("wheelhouse"),
            shim_dir: runtime_dir.join("packages"),
        }),
    };
    let backend = DockerBackend::connect(settings).await?;
    backend.check().await?;
    let kernel_id = uuid::Uuid::new_v4().to_string();
    let launched = backend
        .launch(&LaunchRequest {
            kernel_id: kernel_id.clone(),
            kernel_name: "python3".into(),
            image: kernelgate_tests::image(),
            env: BTreeMap::new(),
            preload: false,
            owner: None,
            memory_mb: None,
            cpus: None,
        })
        .await?;
    let result = exercise(&launched.handle, &launched.connection, runtime_dir).await;
    backend.remove(&launched.handle).await?;
    result
}

async fn exercise(
    handle: &str,
    connection: &kernelgate_protocol::ConnectionInfo,
    runtime_dir: &std::path::Path,
) -> Result<()> {
    // The container has exactly the hardening docs/architecture.md lists.
    let inspect = std::process::Command::new("docker")
        .args(["inspect", handle])
        .output()?;
    let inspect: Value = serde_json::from_slice(&inspect.stdout)?;
    let host = &inspect[0]["HostConfig"];
    assert_eq!(host["NetworkMode"], "none");
    assert_eq!(host["ReadonlyRootfs"], true);
    assert_eq!(host["CapDrop"], serde_json::json!(["ALL"]));
    assert!(host["SecurityOpt"]
        .to_string()
        .contains("no-new-privileges"));
    assert_eq!(host["PidsLimit"], 256);
    assert_eq!(host["Memory"], 1024 * 1024 * 1024);
    assert_eq!(host["Memory"], host["MemorySwap"]);
    assert_eq!(host["Privileged"], false);
    // The socket directory, and read-only: the wheelhouse's tree for this image and the
    // package installer. Nothing else of the host.
    let image_id = kernelgate_tests::image_key()?;
    let socket_dir = inspect[0]["Mounts"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["Destination"] == "/run/kernel"))
        .and_then(|m| m["Source"].as_str())
        .unwrap_or_default()
        .to_owned();
    assert_eq!(
        host["Binds"],
        serde_json::json!([
            format!("{socket_dir}:/run/kernel:rw"),
            format!(
                "{}:/opt/kernelgate/packages:ro",
                runtime_dir.join("wheelhouse").join(image_id).display()
            ),
            format!(
                "{}:/opt/kernelgate/python:ro",
                runtime_dir.join("packages").display()
            ),
        ])
    );
    assert!(host["Tmpfs"]["/tmp"].is_string());
    assert_eq!(inspect[0]["Config"]["User"], "1000:1000");

    let tracker = TaskTracker::new();
    let kernel = Relay::new(
        "image-test",
        ClientLimits {
            kernel_message_bytes: 64 << 20,
            buffer_bytes: 1 << 30,
            output_bytes: 1 << 30,
            replay_for: Duration::from_secs(60),
        },
        kernelgate::audit::Audit::disabled(),
        None,
    );
    let info = kernel
        .connect(
            connection,
            &tracker,
            CancellationToken::new(),
            Duration::from_secs(60),
        )
        .await?;
    assert_eq!(info.status, "ok");
    assert!(info.protocol_version.starts_with('5'));
    assert_eq!(info.language_info["name"], "python");

    let me = kernel.attach("image-test-client", true, "image-test");
    assert_eq!(run(&kernel, &me, "x = 41").await?.status, "ok");
    assert_eq!(
        run(&kernel, &me, "x + 1").await?.result_text().as_deref(),
        Some("42")
    );

    let r = run(
        &kernel,
        &me,
        "import matplotlib.pyplot as plt\nplt.plot([3, 1, 2])\nplt.show()",
    )
    .await?;
    let (w, h) = decode_png(r.png()?)?;
    assert!(w > 100 && h > 100);

    let r = run(&kernel, &me, "1/0").await?;
    assert_eq!(r.ename().as_deref(), Some("ZeroDivisionError"));
    assert!(r
        .error
        .as_ref()
        .is_some_and(|e| e["traceback"].as_array().is_some_and(|t| !t.is_empty())));

    // 100,000 small prints, every line present and in order.
    let r = run(&kernel, &me, "for i in range(100000):\n    print(i)").await?;
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(
        lines.len(),
        100_000,
        "lost {} lines",
        100_000 - lines.len() as i64
    );
    assert!(lines.iter().enumerate().all(|(i, l)| *l == i.to_string()));
    let _ = kernel.step(Event::Unlinked).await;
    Ok(())
}
