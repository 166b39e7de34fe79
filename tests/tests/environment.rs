//! End to end: the environment a client asks for reaches its kernel whether the kernel
//! comes from the warm pool or starts cold, invisibly; and `make run` leaves every
//! `KERNELGATE_*` variable in charge.

use anyhow::{bail, Result};
use kernelgate_tests::Gateway;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_env_reaches_pooled_and_cold_kernels_alike() -> Result<()> {
    for pool in ["1", "0"] {
        let gw = Gateway::start(&["--pool-size", pool]).await?;
        if pool == "1" {
            gw.wait_pool("filled").await?;
        }
        let (status, model) = gw
            .post_json(
                "/api/kernels",
                json!({"name": "python3", "env": {
                    "KERNEL_USERNAME": "alice", "KERNEL_WORKING_DIR": "/home/kernel",
                    "KERNEL_LAUNCH_TIMEOUT": 40}}),
            )
            .await?;
        assert_eq!(status, 201, "{model}");
        let id = model["id"].as_str().unwrap_or_default();
        // A client watching from the start sees nothing of the gateway's own set-up.
        let mut watcher = gw.channels(id, "watcher").await?;
        let (status, run) = gw
            .post_json(
                &format!("/api/kernels/{id}/execute"),
                json!({"code": "import os\nprint(os.environ.get('KERNEL_USERNAME'), os.environ.get('KERNEL_LAUNCH_TIMEOUT'))"}),
            )
            .await?;
        assert_eq!(status, 200, "{run}");
        assert_eq!(run["stdout"], "alice 40\n", "pool {pool}: {run}");
        assert_eq!(
            run["execution_count"], 1,
            "pool {pool}: no count used: {run}"
        );
        let first = watcher
            .wait_for(Duration::from_secs(10), |m| {
                m["msg_type"] == "execute_input"
            })
            .await?;
        assert_eq!(first["content"]["execution_count"], 1, "{first}");
        assert!(
            !watcher.seen.iter().any(|m| m["content"]["code"]
                .as_str()
                .is_some_and(|c| c.contains("environ.update"))),
            "{:?}",
            watcher.seen
        );
    }
    Ok(())
}

#[test]
fn make_run_honours_kernelgate_variables() -> Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let serve_line = |envs: &[(&str, &str)], args: &[&str]| -> Result<String> {
        let mut make = std::process::Command::new("make");
        for (name, _) in std::env::vars().filter(|(n, _)| n.starts_with("KERNELGATE_")) {
            make.env_remove(name);
        }
        let out = make
            .current_dir(&root)
            .args(["-n", "--no-print-directory", "run"])
            .args(args)
            .envs(envs.iter().copied())
            .env_remove("LISTEN")
            .output()?;
        let text = String::from_utf8(out.stdout)?;
        match text.lines().find(|l| l.contains("kernelgate serve")) {
            Some(l) => Ok(l.to_owned()),
            None => bail!("no serve line in:\n{text}"),
        }
    };
    let with_env = serve_line(
        &[
            ("KERNELGATE_LISTEN", "127.0.0.1:9999"),
            ("KERNELGATE_IMAGE", "mine:1"),
        ],
        &[],
    )?;
    assert!(!with_env.contains("--listen"), "{with_env}");
    assert!(!with_env.contains("--image"), "{with_env}");
    let plain = serve_line(&[], &[])?;
    assert!(plain.contains("--image kernelgate-kernel:"), "{plain}");
    assert!(
        !plain.contains("--listen"),
        "the gateway's default applies: {plain}"
    );
    let flag = serve_line(&[], &["LISTEN=127.0.0.1:7777"])?;
    assert!(flag.contains("--listen 127.0.0.1:7777"), "{flag}");
    Ok(())
}
