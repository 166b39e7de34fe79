//! End to end: a kernel image derived from ours with the fixture package
//! (tests/fixtures/kg_fixture), built by the documented command (`make fixture-image` runs
//! kernel-image/derive.sh), offered as its own kernel spec with its own warm pool, next to
//! python3 and a spec whose image is missing.

use anyhow::{Context, Result};
use kernelgate_tests::Gateway;
use serde_json::json;

/// The image's command, as the kernelspec should advertise it.
fn image_cmd(image: &str) -> Result<Vec<String>> {
    let out = std::process::Command::new("docker")
        .args([
            "image",
            "inspect",
            "--format",
            "{{json .Config.Cmd}}",
            image,
        ])
        .output()?;
    let cmd: Vec<String> = serde_json::from_slice(&out.stdout).context("image Cmd")?;
    Ok(cmd
        .into_iter()
        .map(|a| {
            if a == "/run/kernel/kernel.json" {
                "{connection_file}".to_owned()
            } else {
                a
            }
        })
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_derived_image_serves_its_own_kernelspec_and_pool() -> Result<()> {
    let fixture = kernelgate_tests::fixture_image()?;
    let spec = format!("fixture={fixture}");
    let gw = Gateway::start(&[
        "--kernelspec",
        &spec,
        "--kernelspec",
        "ghost=kernelgate-missing:none",
        "--pool-size",
        "0,fixture=1",
    ])
    .await?;

    // The listing: all three, with what launchers show and the command containers run.
    let (status, specs) = gw.get_json("/api/kernelspecs").await?;
    assert_eq!(status, 200);
    assert_eq!(specs["default"], "python3");
    let fx = &specs["kernelspecs"]["fixture"];
    assert_eq!(fx["spec"]["display_name"], "Python 3 + kg_fixture", "{fx}");
    assert_eq!(fx["spec"]["argv"], json!(image_cmd(&fixture)?));
    let py = &specs["kernelspecs"]["python3"];
    assert_eq!(
        py["spec"]["argv"],
        json!(image_cmd(&kernelgate_tests::image())?)
    );
    assert_eq!(
        specs["kernelspecs"]["ghost"]["spec"]["metadata"]["kernelgate"]["image_present"],
        false
    );
    let logo = gw
        .request(reqwest::Method::GET, "/kernelspecs/fixture/logo-64x64.png")
        .send()
        .await?;
    // A logo comes from an image label: it may not run script in the gateway's origin.
    let csp = logo.headers()["content-security-policy"]
        .to_str()?
        .to_owned();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("sandbox"),
        "{csp}"
    );
    assert_eq!(logo.headers()["x-content-type-options"], "nosniff");
    let logo = logo.bytes().await?;
    let expected = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/kg_fixture/logo-64x64.png"),
    )?;
    assert_eq!(
        logo.as_ref(),
        expected.as_slice(),
        "the logo from the image's label"
    );

    // Its own pool: the only pooled create of this gateway is the fixture kernel.
    gw.wait_pool("filled").await?;
    let (status, model) = gw
        .post_json("/api/kernels", json!({"name": "fixture"}))
        .await?;
    assert_eq!(status, 201, "{model}");
    assert_eq!(model["name"], "fixture");
    let id = model["id"].as_str().unwrap_or_default().to_owned();
    let metrics = gw.metrics().await?;
    assert!(
        metrics.contains("kernelgate_kernel_creates_total{source=\"pool\"} 1"),
        "{metrics}"
    );
    let r = gw
        .execute(&id, "import kg_fixture\nprint(kg_fixture.greet('agent'))")
        .await?;
    assert_eq!(r["stdout"], "hello agent from kg_fixture 1.2.3\n", "{r}");

    // python3 kernels run the base image: no fixture there.
    let py = gw.create_kernel().await?;
    let py_id = py["id"].as_str().unwrap_or_default();
    let r = gw.execute(py_id, "import kg_fixture").await?;
    assert_eq!(r["error"]["ename"], "ModuleNotFoundError", "{r}");

    // A spec whose image is missing: 503 with how to build it; unknown specs: 404.
    let (status, body) = gw
        .post_json("/api/kernels", json!({"name": "ghost"}))
        .await?;
    assert_eq!(status, 503, "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("derive.sh")),
        "{body}"
    );
    let (status, body) = gw
        .post_json("/api/kernels", json!({"name": "nope"}))
        .await?;
    assert_eq!(status, 404, "{body}");
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("fixture")),
        "{body}"
    );
    Ok(())
}
