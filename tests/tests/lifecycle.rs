//! End to end: clients that hang up in the middle of a create, delete or restart leave
//! nothing behind. Afterwards the kernel table, Docker and the runtime directory agree,
//! and the whole kernel limit is usable again.

use anyhow::{bail, Result};
use kernelgate_tests::Gateway;
use serde_json::Value;
use std::collections::BTreeSet;
use std::time::Duration;

const LIMIT: usize = 8;

/// A small deterministic generator: the same abort points on every run.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// Container ids of the kernels of this gateway, by the runtime-dir label it sets.
fn containers(gw: &Gateway) -> Result<BTreeSet<String>> {
    let out = std::process::Command::new("docker")
        .args(["ps", "-a", "-q", "--no-trunc", "--filter"])
        .arg(format!(
            "label=org.kernelgate.runtime_dir={}",
            gw.runtime_dir.display()
        ))
        .output()?;
    if !out.status.success() {
        bail!("docker ps: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?
        .lines()
        .map(str::to_owned)
        .collect())
}

/// Kernel ids that have a socket directory under the runtime directory.
fn socket_dirs(gw: &Gateway) -> Result<BTreeSet<String>> {
    let mut dirs = BTreeSet::new();
    for entry in std::fs::read_dir(&gw.runtime_dir)? {
        let entry = entry?;
        if entry.file_type()?.is_dir() {
            dirs.insert(entry.file_name().to_string_lossy().into_owned());
        }
    }
    Ok(dirs)
}

async fn listed(gw: &Gateway) -> Result<BTreeSet<String>> {
    let (status, list) = gw.get_json("/api/kernels").await?;
    assert_eq!(status, 200);
    Ok(list
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|k| k["id"].as_str().map(str::to_owned))
        .collect())
}

/// Sends a request and drops it after `after`, as a client that hangs up does. Returns
/// the answer when it came first.
async fn abandon(request: reqwest::RequestBuilder, after: Duration) -> Option<(u16, Value)> {
    let sent = async {
        let r = request.send().await.ok()?;
        let status = r.status().as_u16();
        Some((status, r.json().await.unwrap_or(Value::Null)))
    };
    tokio::time::timeout(after, sent).await.ok().flatten()
}

/// Waits until the table lists exactly `expected`, Docker has one container for each and
/// the runtime directory one socket directory for each.
async fn settles_to(gw: &Gateway, expected: &BTreeSet<String>) -> Result<()> {
    // Kernels whose creates were abandoned while they started are removed once they are up:
    // on a loaded machine that takes a while.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (table, docker, dirs) = (listed(gw).await?, containers(gw)?, socket_dirs(gw)?);
        if &table == expected && docker.len() == expected.len() && &dirs == expected {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "after 30 s: table {table:?}, {} containers, socket dirs {dirs:?}; expected {expected:?}",
                docker.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_up_requests_leave_nothing_behind() -> Result<()> {
    let limit = LIMIT.to_string();
    let gw = Gateway::start(&["--max-kernels", &limit]).await?;
    let mut rng = Lcg(0x5eed);

    // 200 creates, 20 at a time, each abandoned at a random point: before the request is
    // read, while its container starts, while the kernel connects, or after it answered.
    let mut answered = Vec::new();
    for _ in 0..10 {
        let wave = (0..20).map(|_| {
            let after = Duration::from_millis(rng.below(1500));
            abandon(gw.request(reqwest::Method::POST, "/api/kernels"), after)
        });
        for (status, body) in futures::future::join_all(wave).await.into_iter().flatten() {
            assert!(matches!(status, 201 | 403), "{status}: {body}");
            if status == 201 {
                answered.push(body["id"].as_str().unwrap_or_default().to_owned());
            }
        }
    }
    // A client that got its kernel owns it: it deletes it, as it would when done.
    for id in &answered {
        gw.delete_kernel(id).await?;
    }
    settles_to(&gw, &BTreeSet::new()).await?;

    // Deletes and restarts abandoned right after they were sent still complete.
    let mut kept = BTreeSet::new();
    for i in 0..4 {
        let (status, model) = gw.post_json("/api/kernels", serde_json::json!({})).await?;
        assert_eq!(status, 201, "{model}");
        let id = model["id"].as_str().unwrap_or_default().to_owned();
        let after = Duration::from_millis(20 + rng.below(200));
        if i % 2 == 0 {
            let path = format!("/api/kernels/{id}");
            abandon(gw.request(reqwest::Method::DELETE, &path), after).await;
        } else {
            let path = format!("/api/kernels/{id}/restart");
            abandon(gw.request(reqwest::Method::POST, &path), after).await;
            kept.insert(id);
        }
    }
    settles_to(&gw, &kept).await?;
    for id in &kept {
        let mut c = gw.channels(id, "after-restart").await?;
        let r = c.execute("21 * 2").await?;
        assert_eq!(r.result_text().as_deref(), Some("42"), "{r:?}");
        gw.delete_kernel(id).await?;
    }
    settles_to(&gw, &BTreeSet::new()).await?;

    // No slot of the limit leaked: exactly LIMIT creates succeed, the next is refused.
    let creates = (0..LIMIT).map(|_| gw.post_json("/api/kernels", serde_json::json!({})));
    for (status, body) in futures::future::join_all(creates)
        .await
        .into_iter()
        .flatten()
    {
        assert_eq!(status, 201, "{body}");
    }
    let (status, body) = gw.post_json("/api/kernels", serde_json::json!({})).await?;
    assert_eq!(status, 403, "{body}");
    assert_eq!(listed(&gw).await?.len(), LIMIT);
    Ok(())
}
