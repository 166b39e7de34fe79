//! The image store filled without the gateway touching Docker: the real kernel image, saved
//! with `docker save`, brought in with `kernelgate image import`, holds what Docker says the
//! image holds.

use anyhow::{ensure, Context, Result};
use kernelgate::images::ImageStore;
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn kernelgate(store: &Path, args: &[&str]) -> Result<String> {
    kernelgate_tests::command_output(
        Command::new(kernelgate_tests::binary())
            .arg("image")
            .args(args)
            .arg("--image-store")
            .arg(store),
    )
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn the_kernel_image_saved_by_docker_imports_into_the_image_store() -> Result<()> {
    if kernelgate_tests::gvisor() {
        // No kernel starts here: the run under runc covers it.
        eprintln!("skipped under gVisor: the image store does not depend on the runtime");
        return Ok(());
    }
    let image = kernelgate_tests::image();
    let inspect: Value = serde_json::from_str(&kernelgate_tests::command_output(
        Command::new("docker").args(["image", "inspect", &image]),
    )?)?;
    let inspect = &inspect[0];
    let id = inspect["Id"]
        .as_str()
        .context("docker image inspect: no Id")?;

    let scratch = tempfile::Builder::new()
        .prefix("kernelgate-image-store-")
        .tempdir_in("/var/tmp")?;
    let archive = scratch.path().join("kernel.tar");
    let store = scratch.path().join("store");
    kernelgate_tests::command_output(
        Command::new("docker")
            .args(["save", "-o"])
            .arg(&archive)
            .arg(&image),
    )?;

    let imported = kernelgate(&store, &["import", archive.to_str().context("path")?])?;
    ensure!(
        imported.starts_with(&format!("imported {id} ")),
        "import said: {imported}"
    );
    ensure!(imported.contains(&image), "import said: {imported}");
    let again = kernelgate(&store, &["import", archive.to_str().context("path")?])?;
    ensure!(
        again.starts_with(&format!("already stored {id} ")),
        "second import said: {again}"
    );
    let listed = kernelgate(&store, &["list"])?;
    ensure!(
        listed.contains(&id["sha256:".len().."sha256:".len() + 12]) && listed.contains(&image),
        "list said: {listed}"
    );

    let stored = ImageStore::open(store.clone())?.find(&image)?;
    ensure!(stored.id == id, "stored as {}, Docker says {id}", stored.id);
    let launch = stored.rootfs.join("opt/kernel/launch.py");
    ensure!(launch.is_file(), "{} is missing", launch.display());
    ensure!(
        stored.rootfs.join("usr/bin/tini").is_file(),
        "no /usr/bin/tini in the root filesystem"
    );

    let config = &inspect["Config"];
    let user = config["User"].as_str().filter(|u| !u.is_empty());
    ensure!(
        stored.config.user.as_deref() == user,
        "User: {:?} vs Docker's {user:?}",
        stored.config.user
    );
    ensure!(
        stored.config.env == strings(&config["Env"]),
        "Env: {:?}",
        stored.config.env
    );
    ensure!(
        stored.config.cmd == strings(&config["Cmd"]),
        "Cmd: {:?}",
        stored.config.cmd
    );
    ensure!(
        stored.config.entrypoint == strings(&config["Entrypoint"]),
        "Entrypoint: {:?}",
        stored.config.entrypoint
    );
    let labels: std::collections::BTreeMap<String, String> =
        serde_json::from_value(config["Labels"].clone()).unwrap_or_default();
    ensure!(
        stored.config.labels == labels,
        "Labels: {:?}",
        stored.config.labels
    );
    Ok(())
}
