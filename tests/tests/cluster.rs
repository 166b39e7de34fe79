//! Cluster mode end to end: three gateway nodes, one real etcd (Debian's `etcd-server`)
//! and the client, each in a network namespace of its own on one switch (198.18.0.0/15),
//! real kernels. Clients reach any node and get the same answers as from the kernel's
//! owner; an E2B sandbox's access token is the same on every node. Runs under runc only: nodes and kernels are the same under gVisor, and the suite
//! is run once.

use anyhow::{Context, Result};
use kernelgate::audit::Record;
use kernelgate::cluster::signing::Forwarded;
use kernelgate_client::mcp::{McpCalls, McpSession};
use kernelgate_tests::cluster::{
    cluster, cluster_with, kernel_record, node_flags, plain_cluster, skipped, write_certificates,
    Cluster, Testbed,
};
use kernelgate_tests::etcd::EtcdServer;
use kernelgate_tests::netns::run_in;
use kernelgate_tests::{runtime, Gateway};
use reqwest::Method;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const KEYS: &str = r#"
[[key]]
name = "alice"
token_sha256 = "9c220f200955d76c0a38d308225e0ef10c5f971acaf2f8d1d8f732affa5bd1dc"

[[key]]
name = "bob"
token_sha256 = "97dd3707015dcf069cf73022ed7173b1165db6eff24b441cb57fd069a8c4e525"
"#;

#[test]
fn any_node_answers_for_any_kernel_as_its_owner_does() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let bed = Testbed::new(10)?;
    run_in(&bed.client, any_node_answers(&bed))
}

async fn any_node_answers(bed: &Testbed) -> Result<()> {
    let c = cluster(bed, KEYS).await?;
    let entry = &c.nodes[0];

    // Three creates through one node: one kernel on each node.
    let ids = c.one_kernel_each().await?;
    let mut owners: Vec<usize> = ids.iter().map(|id| c.owner_of(id)).collect::<Result<_>>()?;
    owners.sort();
    assert_eq!(owners, [0, 1, 2], "spread over the nodes");

    // Every node lists the same kernels, soon.
    let mut expected = ids.clone();
    expected.sort();
    c.all_list(&expected, "every node lists the three").await?;

    // A kernel another node owns, through the two that do not own it.
    let id = c.kernel_of(&ids, 2)?;
    let (status, model) = c.nodes[0].get_json(&format!("/api/kernels/{id}")).await?;
    assert_eq!((status, model["id"].as_str()), (200, Some(id.as_str())));
    c.nodes[0].execute(&id, "x = 41").await?;
    let answer = c.nodes[1].execute(&id, "print(x + 1)").await?;
    assert_eq!(answer["stdout"], "42\n", "{answer}");
    let owner_view = c.nodes[2].execute(&id, "print(x)").await?;
    assert_eq!(
        owner_view["stdout"], "41\n",
        "the owner sees the same kernel"
    );
    // The owner's audit trail names the entry node and the caller's key of each
    // forwarded call.
    let trail = kernelgate_tests::audit_log(&c.nodes[2].audit_log)?;
    let execute = format!("/api/kernels/{id}/execute");
    let forwarded: Vec<&Record> = trail
        .iter()
        .map(|e| &e.record)
        .filter(|r| matches!(r, Record::ForwardedCall { path, .. } if *path == execute))
        .collect();
    let entries: Vec<&str> = forwarded
        .iter()
        .filter_map(|r| match r {
            Record::ForwardedCall { entry, .. } => Some(entry.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(entries, ["node-0", "node-1"], "{forwarded:?}");
    assert!(
        forwarded
            .iter()
            .all(|r| r.key().is_some_and(|k| !k.is_empty())),
        "{forwarded:?}"
    );
    // Hibernated through a node that does not own it: the owner keeps it, its record says
    // so, and a cell through the other non-owner wakes it with its variables.
    let (status, body) = c.nodes[0]
        .post_json(&format!("/api/kernels/{id}/hibernate"), json!({}))
        .await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["hibernated"], true, "{body}");
    let record = c.kernel_record(&id).await?;
    assert_eq!(
        (record["node"].as_str(), record["hibernated"].as_bool()),
        (Some("node-2"), Some(true)),
        "{record}"
    );
    let woken = c.nodes[1].execute(&id, "print(x)").await?;
    assert_eq!(woken["stdout"], "41\n", "{woken}");
    // The registry learns of the resume once the load is confirmed, which the waking cell's
    // answer may overtake.
    let since = Instant::now();
    while c.kernel_record(&id).await?["hibernated"] == true {
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "still hibernated in the registry"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Its channels WebSocket, through a non-owner: the owner answers the upgrade, in the
    // legacy encoding and in v1 (the subprotocol the owner chose comes back).
    let mut ws = c.nodes[1].channels(&id, "cluster-session").await?;
    let outcome = ws.execute("x * 2").await?;
    assert_eq!(outcome.result_text().as_deref(), Some("82"));
    ws.close().await?;
    let mut v1 = c.nodes[0]
        .channels_with(&id, "cluster-v1", Some("v1.kernel.websocket.jupyter.org"))
        .await?;
    assert!(v1.v1, "the owner chose v1 through node-0");
    let outcome = v1.execute("x * 3").await?;
    assert_eq!(outcome.result_text().as_deref(), Some("123"));
    v1.close().await?;

    // The agent API's NDJSON stream, line by line as the owner sends it.
    let streamed = c.nodes[1]
        .request(Method::POST, &format!("/api/kernels/{id}/execute"))
        .header("Accept", "application/x-ndjson")
        .json(&json!({"code": "print('a', flush=True)\nx"}))
        .send()
        .await?;
    assert_eq!(streamed.headers()["content-type"], "application/x-ndjson");
    let lines: Vec<serde_json::Value> = streamed
        .text()
        .await?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    // The kernel may send one print as more than one stream message ("a", then "\n").
    let mut kinds: Vec<&str> = lines.iter().filter_map(|l| l["type"].as_str()).collect();
    kinds.dedup();
    assert_eq!(kinds, ["stdout", "result", "end"], "{lines:?}");
    let printed: String = lines
        .iter()
        .filter(|l| l["type"] == "stdout")
        .filter_map(|l| l["text"].as_str())
        .collect();
    assert_eq!(printed, "a\n", "{lines:?}");
    let result = lines.iter().find(|l| l["type"] == "result");
    assert_eq!(result.map(|r| &r["data"]["text/plain"]), Some(&json!("41")));

    // A caller that hangs up through an entry node: the owner interrupts the run (a
    // two-minute sleep), and the kernel answers the next call with its state.
    let abandoned = c.nodes[0]
        .request(Method::POST, &format!("/api/kernels/{id}/execute"))
        .header("Accept", "application/x-ndjson")
        .json(&json!({"code": "import time\nprint('started', flush=True)\ntime.sleep(120)"}))
        .send()
        .await?;
    let mut stream = abandoned.bytes_stream();
    let _first = futures::StreamExt::next(&mut stream).await;
    drop(stream);
    let hung_up = Instant::now();
    let answer = c.nodes[1].execute(&id, "print(x)").await?;
    assert_eq!(answer["stdout"], "41\n", "{answer}");
    assert!(
        hung_up.elapsed() < Duration::from_secs(60),
        "the run was not interrupted: {:?}",
        hung_up.elapsed()
    );

    // Files up through one non-owner and down through the other, byte for byte.
    let bytes: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let put = c.nodes[0]
        .request(
            Method::PUT,
            &format!("/api/kernels/{id}/files/data/blob.bin"),
        )
        .body(bytes.clone())
        .send()
        .await?;
    assert_eq!(put.status(), 201);
    let got = c.nodes[1]
        .request(
            Method::GET,
            &format!("/api/kernels/{id}/files/data/blob.bin"),
        )
        .send()
        .await?;
    assert_eq!(got.status(), 200);
    assert_eq!(got.bytes().await?.as_ref(), bytes.as_slice());

    // An MCP session opened through node-0 answers through the other nodes too.
    let mut mcp = McpSession::open(c.nodes[0].client()).await?;
    assert_eq!(mcp.run_python("y = 6 * 7\ny").await?, "42");
    let mut via_1 = mcp.through(c.nodes[1].client());
    assert_eq!(via_1.run_python("y + 1").await?, "43");
    let via_2 = mcp.through(c.nodes[2].client());
    via_2.close().await?;
    let after = mcp.through(c.nodes[1].client()).run_python("y").await;
    assert!(after.is_err(), "the session ended everywhere: {after:?}");

    // Without a session (MCP 2026-07-28): a kernel started through node-0 is found by its
    // kernel_id through the others.
    let mut calls = McpCalls::new(c.nodes[0].client());
    let handle = calls.start_kernel().await?;
    assert_eq!(calls.run_python(&handle, "z = 5\nz").await?, "5");
    for n in [1, 2] {
        let mut via = calls.through(c.nodes[n].client());
        assert_eq!(
            via.run_python(&handle, "z += 1\nz").await?,
            (5 + n).to_string()
        );
    }
    assert_eq!(c.nodes[1].delete_kernel(&handle).await?, 204);

    // The policy's approvals through a third node: code held on node-1's kernel, sent
    // through node-0, listed and approved through node-2.
    let on_1 = c.kernel_of(&ids, 1)?;
    let held = c.nodes[0].execute(&on_1, "import socket\nprint('approved')");
    let approve = async {
        let start = Instant::now();
        let approval = loop {
            let (_, list) = c.nodes[2].get_json("/api/kernelgate/approvals").await?;
            if let Some(id) = list[0]["id"].as_str() {
                break id.to_owned();
            }
            anyhow::ensure!(start.elapsed() < Duration::from_secs(10), "nothing held");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let (status, _) = c.nodes[2]
            .post_json(
                &format!("/api/kernelgate/approvals/{approval}"),
                json!({"approve": true}),
            )
            .await?;
        Ok(status)
    };
    let (ran, approved) = tokio::join!(held, approve);
    assert_eq!(approved?, 204);
    assert_eq!(ran?["stdout"], "approved\n");

    // Interrupt, restart and delete through non-owners.
    let (status, _) = c.nodes[0]
        .post_json(&format!("/api/kernels/{id}/interrupt"), json!({}))
        .await?;
    assert_eq!(status, 204);
    let (status, _) = c.nodes[1]
        .post_json(&format!("/api/kernels/{id}/restart"), json!({}))
        .await?;
    assert_eq!(status, 200);
    assert_eq!(c.nodes[0].delete_kernel(&id).await?, 204);
    let gone = c.nodes[1].get_json(&format!("/api/kernels/{id}")).await?;
    assert_eq!(gone.0, 404, "{}", gone.1);
    expected.retain(|k| *k != id);
    // How soon the lists agree depends on the machine's load, so the settle's own bound
    // is the only clock here.
    c.all_list(&expected, "every node lists the two left")
        .await?;

    // Each node's metrics are its own, labelled with its id.
    for (n, node) in c.nodes.iter().enumerate() {
        let text = node.metrics().await?;
        let label = format!("node=\"node-{n}\"");
        assert!(
            text.lines().any(|l| l.starts_with("kernelgate_kernels")),
            "{text}"
        );
        assert!(
            text.lines()
                .filter(|l| l.starts_with("kernelgate_"))
                .all(|l| l.contains(&label)),
            "{text}"
        );
    }

    // A call that pretends to come from another node is refused.
    let forged = reqwest::Client::new()
        .get(entry.url("/api/kernels"))
        .header("x-kernelgate-key", "admin")
        .header("x-kernelgate-entry", "node-9")
        .header("x-kernelgate-request-id", "r1")
        .header("x-kernelgate-timestamp", now_seconds().to_string())
        .header("x-kernelgate-signature", "00".repeat(32))
        .send()
        .await?;
    assert_eq!(forged.status(), 403);
    tls_between_nodes(&c, &ids, &bed.client.ip).await?;

    // Tenants: bob cannot reach alice's kernel through any node.
    let (status, alices) = entry
        .call_as("alice-token", Method::POST, "/api/kernels", Some(json!({})))
        .await?;
    assert_eq!(status, 201, "{alices}");
    let alices = alices["id"].as_str().context("id")?.to_owned();
    for node in &c.nodes {
        let (status, _) = node
            .call_as(
                "bob-token",
                Method::GET,
                &format!("/api/kernels/{alices}"),
                None,
            )
            .await?;
        assert_eq!(status, 404);
        let (_, listed) = node
            .call_as("bob-token", Method::GET, "/api/kernels", None)
            .await?;
        assert!(!listed.to_string().contains(&alices), "{listed}");
        let (status, _) = node
            .call_as(
                "alice-token",
                Method::GET,
                &format!("/api/kernels/{alices}"),
                None,
            )
            .await?;
        assert_eq!(status, 200);
    }
    e2b_tokens_hold_on_every_node(&c).await?;
    Ok(())
}

/// An E2B sandbox's access token, minted by the node that runs the sandbox, is the one every
/// node makes (the token key comes from the cluster secret): a sandbox-plane call through
/// any node reaches the sandbox's node, which takes the right token and refuses a wrong one
/// (401); a create and a kill work through any node alike.
async fn e2b_tokens_hold_on_every_node(c: &Cluster) -> Result<()> {
    let created = c.nodes[0]
        .request(Method::POST, "/v2/sandboxes")
        .header("X-API-KEY", &c.nodes[0].token)
        .json(&json!({"templateID": "base", "timeout": 300}))
        .send()
        .await?;
    assert_eq!(created.status(), 201);
    let created: serde_json::Value = created.json().await?;
    let id = created["sandboxID"].as_str().context("sandboxID")?;
    let token = created["envdAccessToken"]
        .as_str()
        .context("envdAccessToken")?;
    let health = |n: usize, token: String| {
        c.nodes[n]
            .request(Method::GET, "/health")
            .header("E2b-Sandbox-Id", id)
            .header("E2b-Sandbox-Port", "49983")
            .header("X-Access-Token", token)
            .send()
    };
    assert_eq!(health(0, token.to_owned()).await?.status(), 204);
    for n in [1, 2] {
        let right = health(n, token.to_owned()).await?;
        assert_eq!(right.status(), 204, "node-{n} refused the token: {right:?}");
        let wrong = health(n, "0".repeat(64)).await?;
        assert_eq!(wrong.status(), 401, "node-{n}");
    }
    let killed = c.nodes[2]
        .request(Method::DELETE, &format!("/sandboxes/{id}"))
        .header("X-API-KEY", &c.nodes[2].token)
        .send()
        .await?;
    assert_eq!(killed.status(), 204);
    Ok(())
}

/// With TLS between nodes: who may call a node's cluster listener, and where an address
/// planted in the registry leads (a listener of the test's at `client_ip`, which shows a
/// real certificate of the cluster, node-2's, as a thief of one would). `ids` holds a
/// kernel of node-1.
async fn tls_between_nodes(c: &Cluster, ids: &[String], client_ip: &str) -> Result<()> {
    let on_1 = c.kernel_of(ids, 1)?;
    let path = format!("/api/kernels/{on_1}");
    let to_1 = c.cluster_url(1, &path);
    let incarnation_1 = c.incarnation(1).await?;
    let to_node_1 = || Forwarded::new("admin", "node-0", true, "node-1", &incarnation_1);
    // Node-0's certificate, node-0 as the entry: served (for the harness's own key, whose
    // kernel it is).
    let served = c
        .signed_as("admin", Method::GET, &path, 1, &incarnation_1)?
        .send()
        .await?;
    assert_eq!(served.status(), 200, "{}", served.text().await?);
    // The same kind of call on node-1's --listen: refused, its signature good or not.
    let plain = c
        .signed_with(
            &reqwest::Client::new(),
            &c.nodes[1].url(&path),
            &to_node_1(),
            Method::GET,
            &path,
        )?
        .send()
        .await?;
    assert_eq!(plain.status(), 403, "{}", plain.text().await?);
    // Node-2's certificate on a call that says node-0 sent it: refused.
    let node_2 = c.node_client("ca.pem", "node-2", 1)?;
    let claimed = c
        .signed_with(&node_2, &to_1, &to_node_1(), Method::GET, &path)?
        .send()
        .await?;
    assert_eq!(claimed.status(), 403);
    let refusal: serde_json::Value = claimed.json().await?;
    let text = refusal["message"].as_str().unwrap_or_default();
    assert!(text.contains(r#"does not name node "node-0""#), "{refusal}");
    // A certificate naming node-0, signed by another CA: no answer at all.
    let stranger = c.node_client("both-cas.pem", "stranger", 1)?;
    let refused = c
        .signed_with(&stranger, &to_1, &to_node_1(), Method::GET, &path)?
        .send()
        .await;
    assert!(refused.is_err(), "a stranger got an answer: {refused:?}");

    // node-1's record now names the planted listener as its cluster address.
    let planted = PlantedTls::start(c, client_ip, "node-2").await?;
    let (original, lease) = c.plant_cluster_address(1, &planted.url).await?;
    let start = Instant::now();
    let unreachable = loop {
        let answer = c.nodes[0].request(Method::GET, &path).send().await?;
        if answer.status() != 200 {
            break answer;
        }
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(10),
            "node-0 still reaches node-1 with the planted address in the registry"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(unreachable.status(), 503);
    assert!(unreachable.headers().contains_key("retry-after"));
    let text = unreachable.text().await?;
    assert!(text.contains("the node that runs this kernel"), "{text}");
    let run = c.nodes[0]
        .request(Method::POST, &format!("{path}/execute"))
        .json(&json!({"code": "print('pwned-' + str(6 * 7))"}))
        .send()
        .await?;
    assert_eq!(run.status(), 503);
    let upgrade = c.nodes[0].channels(&on_1, "planted").await;
    assert!(upgrade.is_err(), "a WebSocket through a planted address");
    // The forwarding node tried, and not one byte of a request reached the listener.
    let (handshakes, plaintext) = planted.seen();
    assert!(
        handshakes >= 3,
        "{handshakes} connections to the planted address"
    );
    assert!(
        plaintext.is_empty(),
        "the planted listener read {:?}",
        String::from_utf8_lossy(&plaintext)
    );
    // The record as it was: node-0 reaches node-1 again.
    c.put_node_record(1, &original, &lease).await?;
    c.settle("node-0 reaches node-1 again", |c| {
        let path = path.clone();
        async move { Ok(c.nodes[0].get_json(&path).await?.0 == 200) }
    })
    .await?;
    Ok(())
}

/// A TLS listener at an address planted in the registry: it shows a node's real
/// certificate and keeps whatever a client manages to send it.
struct PlantedTls {
    url: String,
    /// Connections, and every byte read after a handshake.
    seen: Arc<Mutex<(usize, Vec<u8>)>>,
    _task: tokio::task::JoinHandle<()>,
}

impl PlantedTls {
    async fn start(c: &Cluster, ip: &str, cert: &str) -> Result<PlantedTls> {
        use tokio::io::AsyncReadExt;
        let dir = c._dir.path();
        let tls = kernelgate::cluster::tls::ClusterTls::load(
            &dir.join("ca.pem"),
            &dir.join(format!("{cert}.pem")),
            &dir.join(format!("{cert}.key")),
            cert,
        )?;
        let acceptor =
            tokio_rustls::TlsAcceptor::from(tls.server_config().map_err(anyhow::Error::msg)?);
        let listener = tokio::net::TcpListener::bind((ip, 0)).await?;
        let url = format!("https://{}", listener.local_addr()?);
        let seen = Arc::new(Mutex::new((0, Vec::new())));
        let kept = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, kept) = (acceptor.clone(), kept.clone());
                if let Ok(mut seen) = kept.lock() {
                    seen.0 += 1;
                }
                tokio::spawn(async move {
                    let Ok(mut stream) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut buf = [0u8; 4096];
                    while let Ok(n @ 1..) = stream.read(&mut buf).await {
                        if let Ok(mut seen) = kept.lock() {
                            seen.1.extend_from_slice(&buf[..n]);
                        }
                    }
                });
            }
        });
        Ok(PlantedTls {
            url,
            seen,
            _task: task,
        })
    }

    fn seen(&self) -> (usize, Vec<u8>) {
        self.seen
            .lock()
            .map(|s| s.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }
}

impl Drop for PlantedTls {
    fn drop(&mut self) {
        self._task.abort();
    }
}

#[test]
fn a_node_that_dies_or_an_etcd_that_stops_costs_no_kernel() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let bed = Testbed::new(11)?;
    run_in(&bed.client, deaths_and_outages(&bed))
}

async fn deaths_and_outages(bed: &Testbed) -> Result<()> {
    // Over plain HTTP: what a planted node address harvests there, and what the signature
    // still refuses (with TLS on, a planted address gets no byte: `tls_between_nodes`).
    // Alice's key may hold three kernels: her three, one on each node.
    let mut c = plain_cluster(bed, KEYS_WITH_QUOTA).await?;
    let ids = c.one_kernel_each_as("alice-token").await?;
    let on_2 = c.kernel_of(&ids, 2)?;
    c.nodes[0].execute(&on_2, "kept = 'state'").await?;

    // Someone with write access to etcd plants a listener of theirs as node-2's address:
    // node-0 forwards an agent-API execute and a WebSocket upgrade for node-2's kernel to it.
    let execute = format!("/api/kernels/{on_2}/execute");
    let planted = Planted::start(&bed.client.ip).await?;
    let (record, lease) = c.node_record(2).await?;
    let mut planted_record = record.clone();
    planted_record["address"] = json!(planted.url);
    c.put_node_record(2, &planted_record, &lease).await?;
    let since = Instant::now();
    let call = loop {
        let answer = c.nodes[0]
            .request(Method::POST, &execute)
            .json(&json!({"code": "print('honest')"}))
            .send()
            .await?;
        if let Some(call) = planted.got().into_iter().find(|r| r.method == "POST") {
            break call;
        }
        assert_eq!(answer.status(), 200, "node-0 still reaches the real node-2");
        anyhow::ensure!(since.elapsed() < Duration::from_secs(10), "nothing planted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let upgrade = c.nodes[0].channels(&on_2, "harvested").await;
    assert!(upgrade.is_err(), "the planted listener answers no upgrade");
    let harvested_upgrade = planted
        .got()
        .into_iter()
        .find(|r| r.method == "GET")
        .context("an upgrade reached the planted listener")?;
    // With nothing listening there, the client learns which node is away, not its address
    // nor the HTTP library's words.
    drop(planted);
    let since = Instant::now();
    let text = loop {
        let away = c.nodes[0]
            .request(Method::POST, &execute)
            .json(&json!({"code": "print('honest')"}))
            .send()
            .await?;
        assert_eq!(away.status(), 503);
        let text = away.text().await?;
        // The listener's own 503 has no body; it stops listening in a moment.
        if !text.is_empty() || since.elapsed() > Duration::from_secs(5) {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        text.contains("the node that runs this kernel (node-2) is unreachable")
            && !text.contains("http://")
            && !text.contains(&bed.client.ip),
        "{text}"
    );
    c.put_node_record(2, &record, &lease).await?;
    c.settle("node-0 reaches the real node-2 again", |c| {
        let execute = execute.clone();
        async move {
            Ok(c.nodes[0]
                .request(Method::POST, &execute)
                .json(&json!({"code": "1"}))
                .send()
                .await?
                .status()
                == 200)
        }
    })
    .await?;
    // The harvested headers are worth nothing: with another body at node-2; the upgrade's
    // from another connection; the call as it was at another node.
    let pwned = call
        .replay(&c.nodes[2].url(&call.path))
        .body(r#"{"code": "pwned = 'pwned-' + str(6*7); print(pwned)"}"#)
        .send()
        .await?;
    let status = pwned.status();
    let refusal = pwned.text().await?;
    assert_eq!(status, 403, "{refusal}");
    assert!(
        refusal.contains("not the one it was signed with"),
        "{refusal}"
    );
    // The upgrade's headers get their 101 (they check out) and a challenge the attacker
    // cannot answer: the next frame closes the socket with 1008 and nothing else.
    let (status, after) = harvested_upgrade
        .replay_upgrade(&c.nodes[2].url(""))
        .await?;
    assert!(status.starts_with("HTTP/1.1 101"), "{status}");
    assert_eq!(after.first(), Some(&0x88), "a close frame first: {after:?}");
    assert_eq!(after.get(2..4), Some(&[0x03, 0xF0][..]), "1008: {after:?}");
    let elsewhere = call
        .replay(&c.nodes[1].url(&call.path))
        .body(call.body.clone())
        .send()
        .await?;
    let status = elsewhere.status();
    let refusal = elsewhere.text().await?;
    assert_eq!(status, 403, "{refusal}");
    assert!(refusal.contains("not this one"), "{refusal}");
    let namespace = c.nodes[2]
        .execute(&on_2, "print('pwned' in globals())")
        .await?;
    assert_eq!(namespace["stdout"], "False\n", "{namespace}");
    let requested = c.nodes[2].audited("execution_requested")?;
    assert!(
        !requested.iter().any(|r| r.to_string().contains("pwned-")),
        "{requested:?}"
    );
    // Node-2 refused two of them in this minute from one address: one record.
    let refused = c.nodes[2].audited("internal_headers_refused")?;
    assert_eq!(refused.len(), 1, "{refused:?}");

    // An honest client that sends the same X-Request-Id twice at once: both are served.
    let twice = || {
        c.nodes[0]
            .request(Method::POST, &execute)
            .header("X-Request-Id", "same-id")
            .json(&json!({"code": "print('served')"}))
            .send()
    };
    let (first, second) = tokio::join!(twice(), twice());
    for answer in [first?, second?] {
        assert_eq!(answer.status(), 200);
        let body: serde_json::Value = answer.json().await?;
        assert_eq!(body["stdout"], "served\n", "{body}");
    }

    // A WebSocket through node-0 to the kernel: it closes with 1001 (going away) when the
    // owner dies, so that its client reconnects.
    let mut ws = c.nodes[0].channels(&on_2, "through-node-0").await?;
    ws.kernel_info().await?;

    // kill -9 of the owner: within the lease's TTL (3 s) and 2 s more, the others say 404.
    let dead = c.nodes.remove(2);
    let killed = Instant::now();
    let crashed = dead.crash().await?;
    loop {
        let (status, _) = c.nodes[0].get_json(&format!("/api/kernels/{on_2}")).await?;
        if status == 404 {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "still {status} after {:?}",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let lists = c.lists().await?;
    assert!(lists.iter().all(|l| !l.contains(&on_2)), "{lists:?}");
    let ended = loop {
        match ws.recv(Duration::from_secs(5)).await {
            Ok(_) => continue,
            Err(e) => break e.to_string(),
        }
    };
    assert!(ended.contains("1001"), "{ended}");

    // Back on its runtime directory, it re-adopts the kernel, state and all.
    let args = node_flags(&c.flags, 2);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    c.nodes.push(crashed.restart(&args).await?);
    c.settle("the kernel is back", |c| c.answers(0, &on_2))
        .await?;
    // The call harvested before the restart, as it was, at the restarted node: refused.
    let again = call
        .replay(&c.nodes[2].url(&call.path))
        .body(call.body.clone())
        .send()
        .await?;
    let status = again.status();
    let refusal = again.text().await?;
    assert_eq!(status, 403, "{refusal}");
    eprintln!("a call harvested before node-2's restart, replayed after it: {refusal}");
    assert!(
        refusal.contains("before this node started")
            || refusal.contains("away from this node's clock"),
        "{refusal}"
    );
    let answer = c.nodes[1].execute(&on_2, "print(kept)").await?;
    assert_eq!(answer["stdout"], "state\n", "{answer}");
    // It took its quota slot back with it: alice is at her three, through every node.
    for node in &c.nodes {
        let (status, body) = node
            .call_as("alice-token", Method::POST, "/api/kernels", Some(json!({})))
            .await?;
        assert_eq!(
            status, 403,
            "alice over her quota after the restart: {body}"
        );
    }

    // etcd stops for longer than the TTL: kernels keep answering, creates get 503.
    c.etcd.kill()?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let answer = c.nodes[0].execute(&on_2, "print(kept)").await?;
    assert_eq!(answer["stdout"], "state\n", "{answer}");
    let refused = c.nodes[1]
        .request(Method::POST, "/api/kernels")
        .json(&json!({}))
        .send()
        .await?;
    assert_eq!(refused.status(), 503);
    assert!(refused.headers().contains_key("retry-after"));

    // etcd is back: every node registers again and no kernel is lost.
    c.etcd.resume().await?;
    c.settle("every node registered again", |c| async move {
        for node in &c.nodes {
            let (_, api) = node.get_json("/api").await?;
            if api["kernelgate"]["cluster"]["registered"] != true {
                return Ok(false);
            }
        }
        Ok(true)
    })
    .await?;
    let mut expected = ids.clone();
    expected.sort();
    c.all_list(&expected, "every node lists the three").await?;
    let (status, made) = c.nodes[1].post_json("/api/kernels", json!({})).await?;
    assert_eq!(status, 201, "{made}");

    // A node stopped for an update (SIGTERM): its kernels keep running; through the others
    // they answer 503 with Retry-After until it is back, with their state.
    let on_1 = c.kernel_of(&ids, 1)?;
    c.nodes[2].execute(&on_1, "kept_1 = 'one'").await?;
    let stopped = c.nodes.remove(1);
    let dir = stopped.runtime_dir.display().to_string();
    let down = Instant::now();
    assert!(stopped.stop().await?.success());
    let away = c.nodes[0]
        .request(Method::GET, &format!("/api/kernels/{on_1}"))
        .send()
        .await?;
    assert_eq!(away.status(), 503);
    assert!(away.headers().contains_key("retry-after"));
    let mut args = node_flags(&c.flags, 1);
    args.extend(["--runtime-dir".to_owned(), dir]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    c.nodes
        .insert(1, Gateway::start_on(&bed.nodes[1], &args).await?);
    c.settle("node-1's kernel answers again", |c| c.answers(0, &on_1))
        .await?;
    eprintln!("node-1's kernel was unavailable for {:?}", down.elapsed());
    let answer = c.nodes[0].execute(&on_1, "print(kept_1)").await?;
    assert_eq!(answer["stdout"], "one\n", "{answer}");
    // Its records moved to its new lease: the old one's end (a TTL later) leaves them.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (status, _) = c.nodes[0].get_json(&format!("/api/kernels/{on_1}")).await?;
    assert_eq!(status, 200, "node-1's kernel still registered");
    // Deleted, it frees alice's slot at once (not when the away lease would have ended).
    let (status, body) = c.nodes[0]
        .call_as(
            "alice-token",
            Method::DELETE,
            &format!("/api/kernels/{on_1}"),
            None,
        )
        .await?;
    assert_eq!(status, 204, "{body}");
    let (status, body) = c.nodes[2]
        .call_as("alice-token", Method::POST, "/api/kernels", Some(json!({})))
        .await?;
    assert_eq!(status, 201, "alice's slot is free again: {body}");
    Ok(())
}

#[test]
fn concurrent_creates_through_every_node_never_overfill_a_node_or_a_keys_quota() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let bed = Testbed::new(14)?;
    run_in(&bed.client, concurrent_creates(&bed))
}

/// Alice's key may hold three kernels.
const KEYS_WITH_QUOTA: &str = r#"
[[key]]
name = "alice"
token_sha256 = "9c220f200955d76c0a38d308225e0ef10c5f971acaf2f8d1d8f732affa5bd1dc"
max_kernels = 3
"#;

/// Two creates through each node at once, as the key of `token` (`None`: each node's
/// admin token); the ids of those that were created and the statuses of the others.
async fn creates_through_all(c: &Cluster, token: Option<&str>) -> Result<(Vec<String>, Vec<u16>)> {
    let creates = (0..6).map(|i| {
        let node = &c.nodes[i % 3];
        let token = token.unwrap_or(node.token.as_str()).to_owned();
        async move {
            node.call_as(&token, Method::POST, "/api/kernels", Some(json!({})))
                .await
        }
    });
    let (mut created, mut refused) = (Vec::new(), Vec::new());
    for answer in futures::future::join_all(creates).await {
        let (status, body) = answer?;
        match status {
            201 => created.push(body["id"].as_str().context("id")?.to_owned()),
            other => refused.push(other),
        }
    }
    Ok((created, refused))
}

async fn concurrent_creates(bed: &Testbed) -> Result<()> {
    let c = cluster_with(bed, KEYS_WITH_QUOTA, &["--pool-size", "1"]).await?;
    // Six creates of a key that may hold three: three made, three refused as one node would.
    let (alices, refused) = creates_through_all(&c, Some("alice-token")).await?;
    assert_eq!(
        (alices.len(), refused.as_slice()),
        (3, &[403, 403, 403][..])
    );
    // A create the quota refuses touches no node's warm kernel, through whichever node.
    let warm = c.warm_containers().await?;
    for node in &c.nodes {
        let (status, body) = node
            .call_as("alice-token", Method::POST, "/api/kernels", Some(json!({})))
            .await?;
        assert_eq!(status, 403, "{body}");
    }
    assert_eq!(c.warm_containers().await?, warm, "the same warm kernels");
    // Six more of a key without a limit: three nodes of two have room for three more.
    let (more, refused) = creates_through_all(&c, None).await?;
    assert_eq!((more.len(), refused.as_slice()), (3, &[403, 403, 403][..]));
    let mut per_node = [0; 3];
    for id in alices.iter().chain(&more) {
        per_node[c.owner_of(id)?] += 1;
    }
    assert_eq!(per_node, [2, 2, 2], "no node over its two");
    // The cluster is full: the answer a full node gives.
    let (status, body) = c.nodes[1].post_json("/api/kernels", json!({})).await?;
    assert_eq!(status, 403, "{body}");
    let all: Vec<String> = more.iter().chain(&alices).cloned().collect();
    snapshots_through_other_nodes(&c, &all).await
}

/// A snapshot is kept by its kernel's node and found through any: taken, listed, read,
/// forked and started from through nodes that do not keep it; a create from it goes to
/// its node, and is answered 503 naming that node while it is full.
async fn snapshots_through_other_nodes(c: &Cluster, kernels: &[String]) -> Result<()> {
    let id = &kernels[0];
    let owner = c.owner_of(id)?;
    let (entry, other) = (&c.nodes[(owner + 1) % 3], &c.nodes[(owner + 2) % 3]);
    let keeper = format!("node-{owner}");
    entry
        .execute(
            id,
            "import numpy as np\na = np.arange(10)\nopen('f.txt', 'w').write('hi')",
        )
        .await?;
    let (status, taken) = entry
        .post_json(
            &format!("/api/kernels/{id}/snapshots"),
            json!({"name": "cleaned", "metadata": {"stage": "clean"}}),
        )
        .await?;
    assert_eq!(status, 201, "{taken}");
    let snapshot = taken["id"].as_str().context("id")?.to_owned();
    assert_eq!(taken["kernel_id"], id.as_str(), "{taken}");
    // Listed and read through each node that does not keep it, by id and by name.
    for node in [entry, other] {
        let (status, page) = node
            .get_json("/api/kernelgate/snapshots?metadata=stage%3Dclean")
            .await?;
        assert_eq!(status, 200, "{page}");
        let listed: Vec<&str> = page["snapshots"]
            .as_array()
            .context("snapshots")?
            .iter()
            .filter_map(|s| s["id"].as_str())
            .collect();
        assert_eq!(listed, [snapshot.as_str()], "{page}");
        for by in [snapshot.as_str(), "cleaned"] {
            let (status, one) = node
                .get_json(&format!("/api/kernelgate/snapshots/{by}"))
                .await?;
            assert_eq!(
                (status, one["id"].as_str()),
                (200, Some(snapshot.as_str())),
                "{one}"
            );
        }
    }
    // Another key sees none of it, through any node.
    for node in &c.nodes {
        let (status, _) = node
            .call_as(
                "alice-token",
                Method::GET,
                &format!("/api/kernelgate/snapshots/{snapshot}"),
                None,
            )
            .await?;
        assert_eq!(status, 404);
        let (_, page) = node
            .call_as(
                "alice-token",
                Method::GET,
                "/api/kernelgate/snapshots",
                None,
            )
            .await?;
        assert!(!page.to_string().contains(&snapshot), "{page}");
    }

    // Its node is full: a create from it is not placed elsewhere but answered 503, naming it.
    let from = json!({"snapshot": "cleaned"});
    let (status, body) = other.post_json("/api/kernels", from.clone()).await?;
    assert_eq!(status, 503, "{body}");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&keeper) && message.contains("full"),
        "{message}"
    );
    // With room there, it starts there, with the state.
    let neighbour = kernels
        .iter()
        .find(|k| *k != id && c.owner_of(k).is_ok_and(|o| o == owner))
        .context("the keeper's other kernel")?;
    assert_eq!(entry.delete_kernel(neighbour).await?, 204);
    let (status, started) = other.post_json("/api/kernels", from).await?;
    assert_eq!(status, 201, "{started}");
    let started = started["id"].as_str().context("id")?.to_owned();
    assert_eq!(c.owner_of(&started)?, owner);
    let seen = entry
        .execute(&started, "print(a.sum(), open('f.txt').read())")
        .await?;
    assert_eq!(seen["stdout"], "45 hi\n", "{seen}");
    assert_eq!(other.delete_kernel(&started).await?, 204);

    // A fork through a node that does not run the kernel: on the kernel's node, apart.
    let (status, forked) = other
        .post_json(&format!("/api/kernels/{id}/fork"), json!({"count": 1}))
        .await?;
    assert_eq!(status, 200, "{forked}");
    let fork = forked["forks"][0]["kernel"]["id"]
        .as_str()
        .with_context(|| format!("a fork: {forked}"))?
        .to_owned();
    assert_eq!(c.owner_of(&fork)?, owner);
    entry.execute(&fork, "a[0] = 100").await?;
    let source = other.execute(id, "print(a.sum())").await?;
    assert_eq!(source["stdout"], "45\n", "the source is apart: {source}");
    let changed = entry.execute(&fork, "print(a.sum())").await?;
    assert_eq!(changed["stdout"], "145\n", "{changed}");

    // Deleted through a node that does not keep it: gone for every node.
    let (status, _) = other
        .call_as(
            &other.token,
            Method::DELETE,
            &format!("/api/kernelgate/snapshots/{snapshot}"),
            None,
        )
        .await?;
    assert_eq!(status, 204);
    c.settle("every node forgets the deleted snapshot", |c| {
        let snapshot = snapshot.clone();
        async move {
            for node in &c.nodes {
                let (_, page) = node.get_json("/api/kernelgate/snapshots").await?;
                if page.to_string().contains(&snapshot) {
                    return Ok(false);
                }
            }
            Ok(true)
        }
    })
    .await?;
    Ok(())
}

#[test]
fn a_node_cut_off_from_etcd_or_from_everyone_loses_its_kernels_in_the_others_view_until_it_heals(
) -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let bed = Testbed::new(12)?;
    run_in(&bed.client, cut_off(&bed))
}

async fn cut_off(bed: &Testbed) -> Result<()> {
    let c = cluster(bed, KEYS).await?;
    let ids = c.one_kernel_each().await?;
    let on_2 = c.kernel_of(&ids, 2)?;
    c.nodes[2].execute(&on_2, "kept = 2").await?;
    // A WebSocket straight to node-2, which is about to be cut off.
    let mut ws = c.nodes[2].channels(&on_2, "on-node-2").await?;
    ws.kernel_info().await?;
    let node_2 = &bed.nodes[2];
    let incarnation_2 = c.node_record(2).await?.0["incarnation"]
        .as_str()
        .context("an incarnation")?
        .to_owned();

    // Cut off from etcd alone (iptables inside its namespace): the others see its lease
    // end and its kernels go.
    bed.net.block(node_2, &bed.etcd.ip)?;
    let cut = Instant::now();
    let gone = c.gone_for_others(&on_2, cut).await?;
    eprintln!("node-2 cut off from etcd: its kernel gone for the others after {gone:?}");
    c.settle("node-2 knows it lost its lease", |c| c.registered(2, false))
        .await?;
    // It takes no creates and no forwarded work, and says when to try again...
    let create = c.nodes[2]
        .request(Method::POST, "/api/kernels")
        .json(&json!({}))
        .send()
        .await?;
    assert_eq!(create.status(), 503);
    assert!(create.headers().contains_key("retry-after"));
    let forwarded = c.signed_as(
        "alice",
        Method::GET,
        &format!("/api/kernels/{on_2}"),
        2,
        &incarnation_2,
    )?;
    let forwarded = forwarded.send().await?;
    assert_eq!(forwarded.status(), 503);
    assert!(forwarded.headers().contains_key("retry-after"));
    // ...while its open WebSocket keeps working.
    let outcome = ws.execute("kept * 2").await?;
    assert_eq!(outcome.result_text().as_deref(), Some("4"));

    // Healed: it registers again and its kernel is back everywhere, state intact.
    bed.net.unblock(node_2, &bed.etcd.ip)?;
    let healed = Instant::now();
    c.settle("node-2 registered again", |c| c.registered(2, true))
        .await?;
    c.settle("node-2's kernel is back", |c| c.answers(0, &on_2))
        .await?;
    eprintln!(
        "node-2 back in the registry {:?} after the heal",
        healed.elapsed()
    );
    let answer = c.nodes[0].execute(&on_2, "print(kept)").await?;
    assert_eq!(answer["stdout"], "2\n", "{answer}");
    let outcome = ws.execute("kept + 1").await?;
    assert_eq!(outcome.result_text().as_deref(), Some("3"));

    // A full partition (its link down) looks the same from the others' side, and a
    // WebSocket through another node closes with 1001 (going away) once the kernel's lease
    // is gone, though the partitioned owner never ends its connection.
    let mut through_0 = c.nodes[0].channels(&on_2, "through-node-0").await?;
    through_0.kernel_info().await?;
    bed.net.cut(node_2)?;
    let cut = Instant::now();
    let gone = c.gone_for_others(&on_2, cut).await?;
    eprintln!("node-2 partitioned: its kernel gone for the others after {gone:?}");
    let ended = loop {
        match through_0.recv(Duration::from_secs(5)).await {
            Ok(_) => continue,
            Err(e) => break e.to_string(),
        }
    };
    assert!(ended.contains("1001"), "{ended}");
    bed.net.heal(node_2)?;
    c.settle("node-2's kernel is back after the partition", |c| {
        c.answers(1, &on_2)
    })
    .await?;
    let answer = c.nodes[1].execute(&on_2, "print(kept)").await?;
    assert_eq!(answer["stdout"], "2\n", "{answer}");

    // No kernel ever had two owners in the registry's history.
    let owners = c.owners_in_history().await?;
    assert_eq!(owners.len(), 3, "{owners:?}");
    for (key, nodes) in &owners {
        assert_eq!(nodes.len(), 1, "{key} owned by {nodes:?}");
    }
    Ok(())
}

#[test]
fn a_rolling_restart_of_every_node_loses_no_kernel_and_no_state() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let bed = Testbed::new(13)?;
    run_in(&bed.client, rolling_restart(&bed))
}

/// One round of the steady client: when it began, and the node that served it (`None`: no
/// node could).
type Round = (Duration, Option<usize>);

/// A client that runs `code` on kernel `id` every 100 ms through the first node of `entries`
/// that serves it (node-0 when it is up), until `stop`; every round, and whether each 503 it
/// met said when to try again.
async fn steady_client(
    entries: Arc<Mutex<Vec<(String, String)>>>,
    id: String,
    code: &'static str,
    stop: CancellationToken,
) -> Result<(Vec<Round>, bool)> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()?;
    let start = Instant::now();
    let (mut rounds, mut every_503_said_when) = (Vec::new(), true);
    while !stop.is_cancelled() {
        let now: Vec<(String, String)> = entries
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .clone();
        let mut served = None;
        for (n, (base, token)) in now.iter().enumerate() {
            let answer = http
                .post(format!("{base}/api/kernels/{id}/execute"))
                .header("authorization", format!("token {token}"))
                .json(&json!({"code": code}))
                .send()
                .await;
            let Ok(answer) = answer else { continue };
            if answer.status() == 503 {
                every_503_said_when &= answer.headers().contains_key("retry-after");
            }
            if answer.status() == 200 {
                // A cell that ran, or failed (cut short by a stopping node): either way
                // answered, and no other node is tried.
                let body: serde_json::Value = answer.json().await?;
                served = (body["status"] == "ok").then_some(n);
                break;
            }
        }
        rounds.push((start.elapsed(), served));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok((rounds, every_503_said_when))
}

/// The longest time between `from` and `to` that no round was served.
fn longest_outage(rounds: &[Round], from: Duration, to: Duration) -> Duration {
    let mut last_served = from;
    let mut longest = Duration::ZERO;
    for (at, served) in rounds.iter().filter(|(at, _)| *at >= from && *at <= to) {
        if served.is_some() {
            longest = longest.max(at.saturating_sub(last_served));
            last_served = *at;
        }
    }
    longest
}

async fn rolling_restart(bed: &Testbed) -> Result<()> {
    let mut c = plain_cluster(bed, KEYS).await?;
    let ids = c.one_kernel_each().await?;
    let on_2 = c.kernel_of(&ids, 2)?;
    c.nodes[0]
        .execute(&on_2, "before = 'set'\ncalls = 0")
        .await?;
    let entries = Arc::new(Mutex::new(
        c.nodes
            .iter()
            .map(|n| (n.base.clone(), n.token.clone()))
            .collect::<Vec<_>>(),
    ));
    let stop = CancellationToken::new();
    let client = tokio::spawn(steady_client(
        entries.clone(),
        on_2.clone(),
        "calls += 1",
        stop.clone(),
    ));
    let began = Instant::now();
    let mut steps = Vec::new();

    for n in 0..3 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        // A WebSocket whose path the stop cuts: through node-0 while node-0 stops, through
        // node-1 otherwise. A cell prints for 3 s across the stop.
        let via = if n == 0 { 0 } else { 1 };
        let session = format!("rolling-{n}");
        let mut ws = c.nodes[via].channels(&on_2, &session).await?;
        let cell = ws
            .start_execute(
                "import time\nfor i in range(6):\n    print(i, flush=True)\n    time.sleep(0.5)",
            )
            .await?;
        tokio::time::sleep(Duration::from_millis(700)).await;

        let stopped = c.nodes.remove(n);
        let dir = stopped.runtime_dir.display().to_string();
        let from = began.elapsed();
        assert!(stopped.stop().await?.success(), "node-{n} stops cleanly");
        let mut printed_before = String::new();
        let ended = loop {
            match ws.recv(Duration::from_secs(10)).await {
                Ok(m) => {
                    if m["parent_header"]["msg_id"] == cell.as_str()
                        && m["header"]["msg_type"] == "stream"
                    {
                        printed_before.push_str(m["content"]["text"].as_str().unwrap_or(""));
                    }
                }
                Err(e) => break e.to_string(),
            }
        };
        assert!(
            ended.contains("1001") || ended.contains("closed") || ended.contains("reset"),
            "the WebSocket through or to node-{n} dropped: {ended}"
        );
        eprintln!("node-{n} stopped: the WebSocket through node-{via} ended with {ended}");
        if n == 2 {
            // The owner is away: its kernel answers 503 with Retry-After through the others.
            let away = c.nodes[0]
                .request(Method::GET, &format!("/api/kernels/{on_2}"))
                .send()
                .await?;
            assert_eq!(away.status(), 503);
            assert!(away.headers().contains_key("retry-after"));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut args = node_flags(&c.flags, n);
        args.extend(["--runtime-dir".to_owned(), dir]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let back = Gateway::start_on(&bed.nodes[n], &args).await?;
        if let Ok(mut e) = entries.lock() {
            e[n] = (back.base.clone(), back.token.clone());
        }
        c.nodes.insert(n, back);
        c.settle(
            &format!("every node answers for the kernel after node-{n}'s return"),
            |c| async {
                for m in 0..3 {
                    if !c.answers(m, &on_2).await? {
                        return Ok(false);
                    }
                }
                Ok(true)
            },
        )
        .await?;
        let to = began.elapsed();
        steps.push((n, from, to));

        // Reconnecting with the same session: through another node while an entry node
        // is away, the missed output is replayed; after the owner's restart the session is
        // a new one on the same kernel.
        let other = if n == 0 { 1 } else { 0 };
        let mut again = c.nodes[other].channels(&on_2, &session).await?;
        if n == 2 {
            let outcome = again.execute("print(before)").await?;
            assert_eq!(outcome.stdout, "set\n");
        } else {
            // What the dropped WebSocket got, then the replay: every line once, in order.
            let outcome = again.collect(&cell, Duration::from_secs(20)).await?;
            assert_eq!(
                format!("{printed_before}{}", outcome.stdout),
                "0\n1\n2\n3\n4\n5\n",
                "{outcome:?}"
            );
        }
        again.close().await?;
    }
    stop.cancel();
    let (rounds, every_503_said_when) = client.await??;
    assert!(every_503_said_when, "every 503 carried Retry-After");
    let served = rounds.iter().filter(|(_, s)| s.is_some()).count();
    assert!(served > 0, "{rounds:?}");
    for (n, from, to) in &steps {
        eprintln!(
            "rolling restart, node-{n} (SIGTERM to serving again): the client's longest wait {:?}",
            longest_outage(&rounds, *from, *to)
        );
    }

    // Nothing lost: the variable set before, every execution that was answered, every
    // kernel on every node.
    let answer = c.nodes[1].execute(&on_2, "print(before, calls)").await?;
    let printed = answer["stdout"].as_str().context("stdout")?.to_owned();
    let (before, calls) = printed.trim().split_once(' ').context("two values")?;
    assert_eq!(before, "set");
    assert!(
        calls.parse::<usize>()? >= served,
        "{calls} runs, {served} answered"
    );
    let mut expected = ids.clone();
    expected.sort();
    c.all_list(&expected, "every node lists the three").await?;
    Ok(())
}

#[tokio::test]
async fn cluster_flags_are_checked_before_anything_starts() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let short = dir.path().join("short.secret");
    std::fs::write(&short, "too short")?;
    let short = short.display().to_string();
    let long = dir.path().join("long.secret");
    std::fs::write(&long, "a".repeat(64))?;
    let long = long.display().to_string();
    // A node's flags up to its secret, with `etcd` as the URL, then `more`.
    let node = |etcd: &'static str, secret: &str, more: &[&'static str]| -> Vec<String> {
        let mut all = vec!["--etcd", etcd, "--advertise", "http://127.0.0.1:1"]
            .into_iter()
            .map(str::to_owned)
            .collect::<Vec<_>>();
        if !secret.is_empty() {
            all.extend(["--cluster-secret-file".to_owned(), secret.to_owned()]);
        }
        all.extend(more.iter().map(|s| s.to_string()));
        all
    };
    let (http, https) = ("http://127.0.0.1:1", "https://127.0.0.1:1");
    let owned = |args: &[&str]| args.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // The cluster's TLS: a node named node-0, with its files from `certs`.
    write_certificates(dir.path())?;
    let certs = |ca: &str, cert: &str, key: &str| -> Vec<String> {
        let mut all = node(http, &long, &["--node-id", "node-0"]);
        all.extend(["--cluster-listen".to_owned(), "127.0.0.1:9443".to_owned()]);
        for (flag, file) in [
            ("--cluster-ca-file", ca),
            ("--cluster-cert-file", cert),
            ("--cluster-key-file", key),
        ] {
            if !file.is_empty() {
                all.extend([flag.to_owned(), dir.path().join(file).display().to_string()]);
            }
        }
        all
    };
    for (args, says) in [
        (
            certs("ca.pem", "node-0.pem", ""),
            "--cluster-listen needs --cluster-ca-file, --cluster-cert-file and --cluster-key-file",
        ),
        (
            certs("missing.pem", "node-0.pem", "node-0.key"),
            "--cluster-ca-file",
        ),
        (
            certs("ca.pem", "node-0.key", "node-0.key"),
            "--cluster-cert-file",
        ),
        (
            certs("ca.pem", "node-1.pem", "node-1.key"),
            "subjectAltName=DNS:node-0",
        ),
        (
            certs("ca.pem", "node-0.pem", "node-1.key"),
            "not a certificate and its private key",
        ),
        (
            node(http, &long, &["--cluster-ca-file", "/etc/ssl/ca.pem"]),
            "give --cluster-listen too",
        ),
        (
            owned(&["--advertise", "http://127.0.0.1:1"]),
            "give --etcd too",
        ),
        (owned(&["--etcd", http]), "--advertise"),
        (node(http, "", &[]), "--cluster-secret-file"),
        (node(http, &short, &[]), "at least 32"),
        (node(http, &long, &["--etcd-user", "root"]), "go together"),
        (owned(&["--etcd-user", "root"]), "give --etcd too"),
        (
            [
                node(https, &long, &["--etcd-cert-file"]),
                vec![long.clone()],
            ]
            .concat(),
            "--etcd-cert-file and --etcd-key-file go together",
        ),
        (
            [node(http, &long, &["--etcd-ca-file"]), vec![long.clone()]].concat(),
            "give its https:// URLs",
        ),
        (
            [node(https, &long, &["--etcd-ca-file"]), vec![long.clone()]].concat(),
            "no PEM certificate",
        ),
        (
            owned(&["--etcd-ca-file", "/etc/ssl/ca.pem"]),
            "give --etcd too",
        ),
    ] {
        let out = std::process::Command::new(kernelgate_tests::binary())
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--no-auth", "--audit-log", "off"])
            .arg("--runtime-dir")
            .arg(dir.path().join("run"))
            .args(&args)
            .output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} started");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    let out = std::process::Command::new(kernelgate_tests::binary())
        .args(["mcp", "--etcd", "http://127.0.0.1:1"])
        .output()?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("belong to `kernelgate serve`"));
    Ok(())
}

/// etcd serving TLS that asks every client for a certificate signed by its CA: a node
/// given etcd's CA and a client certificate joins, and its kernels' records are in etcd;
/// a node without the certificate, or without the CA, stays out and says why.
#[tokio::test]
async fn a_node_reaches_an_etcd_that_serves_tls_with_its_client_certificate() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let etcd = EtcdServer::start_tls().await?;
    let tls = etcd.tls().context("etcd serves TLS")?.clone();
    let dir = tempfile::tempdir()?;
    let secret = dir.path().join("cluster.secret");
    std::fs::write(&secret, "s".repeat(64))?;
    let secret = secret.display().to_string();
    let url = etcd.url();
    assert!(url.starts_with("https://"), "{url}");
    let [ca, cert, key] =
        [&tls.ca, &tls.client_cert, &tls.client_key].map(|p| p.display().to_string());
    let node_with = |id: &'static str, extra: Vec<&'static str>| {
        let mut args: Vec<String> = [
            "--etcd",
            &url,
            "--advertise",
            "http://127.0.0.1:{port}",
            "--cluster-secret-file",
            &secret,
            "--node-id",
            id,
            "--lease-ttl",
            "3",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.into_iter().map(|flag| match flag {
            "CA" => ca.clone(),
            "CERT" => cert.clone(),
            "KEY" => key.clone(),
            other => other.to_owned(),
        }));
        args
    };
    async fn registered(node: &Gateway) -> Result<bool> {
        let (_, api) = node.get_json("/api").await?;
        Ok(api["kernelgate"]["cluster"]["registered"] == true)
    }

    let args = node_with(
        "tls-node",
        vec![
            "--etcd-ca-file",
            "CA",
            "--etcd-cert-file",
            "CERT",
            "--etcd-key-file",
            "KEY",
        ],
    );
    let node = Gateway::start(&args.iter().map(String::as_str).collect::<Vec<_>>()).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !registered(&node).await? {
        assert!(
            Instant::now() < deadline,
            "the node never registered over TLS"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let kernel = node.create_kernel().await?;
    let id = kernel["id"].as_str().context("kernel id")?.to_owned();
    // The kernel's record, read from etcd over TLS with the test's own client certificate.
    let record = kernel_record(&tls.client()?, &url, &id).await?;
    assert_eq!(record["node"], "tls-node", "{record}");
    assert_eq!(node.delete_kernel(&id).await?, 204);
    drop(node);

    // etcd ends the handshake of a client without a certificate; a client without the CA
    // does not trust etcd's certificate. Either node keeps serving but is not registered,
    // and its log says what is wrong.
    for (id, extra, says) in [
        ("no-cert", vec!["--etcd-ca-file", "CA"], "--etcd-cert-file"),
        (
            "no-ca",
            vec!["--etcd-cert-file", "CERT", "--etcd-key-file", "KEY"],
            "--etcd-ca-file",
        ),
    ] {
        let args = node_with(id, extra);
        let node = Gateway::start(&args.iter().map(String::as_str).collect::<Vec<_>>()).await?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let logged = node
                .logs
                .lock()
                .is_ok_and(|logs| logs.iter().any(|l| l.contains(&url) && l.contains(says)));
            if logged {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{id}: no log line names {says:?} for {url}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(!registered(&node).await?, "{id} registered");
    }
    Ok(())
}

/// A request as a listener planted at a node's address got it.
#[derive(Debug, Clone)]
struct Captured {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Captured {
    /// The same method and headers (but `Host` and `Content-Length`) sent to `url`, as an
    /// attacker who harvested them would; the body is the caller's.
    fn replay(&self, url: &str) -> reqwest::RequestBuilder {
        let method = Method::from_bytes(self.method.as_bytes()).unwrap_or(Method::GET);
        let mut request = reqwest::Client::new().request(method, url);
        for (name, value) in &self.headers {
            if name != "host" && name != "content-length" {
                request = request.header(name.as_str(), value.as_str());
            }
        }
        request
    }

    /// The request's head, as it was but for `Host`, on a connection of its own to the
    /// node at `base` (`http://host:port/`), then a text frame of the attacker's: the
    /// first line of the answer, and every byte after its head until the node closes.
    async fn replay_upgrade(&self, base: &str) -> Result<(String, Vec<u8>)> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let authority = base
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned();
        let mut head = format!(
            "{} {} HTTP/1.1\r\nhost: {authority}\r\n",
            self.method, self.path
        );
        for (name, value) in &self.headers {
            if name != "host" {
                head.push_str(&format!("{name}: {value}\r\n"));
            }
        }
        head.push_str("\r\n");
        let mut stream = tokio::net::TcpStream::connect(&authority).await?;
        stream.write_all(head.as_bytes()).await?;
        let mut answer = Vec::new();
        let end = loop {
            let mut chunk = [0u8; 4096];
            let n =
                tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk)).await??;
            anyhow::ensure!(n > 0, "closed before a whole head: {answer:?}");
            answer.extend_from_slice(&chunk[..n]);
            if let Some(at) = answer.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
        };
        let status = String::from_utf8_lossy(&answer[..end])
            .lines()
            .next()
            .unwrap_or_default()
            .to_owned();
        let mut after = answer.split_off(end);
        if status.contains(" 101 ") {
            // A masked text frame that is not the answer to the challenge.
            let payload = b"{\"not\": \"the proof\"}";
            let mask = [1u8, 2, 3, 4];
            let mut frame = vec![0x81, 0x80 | payload.len() as u8];
            frame.extend(mask);
            frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
            stream.write_all(&frame).await?;
            loop {
                let mut chunk = [0u8; 4096];
                let n = tokio::time::timeout(Duration::from_secs(15), stream.read(&mut chunk))
                    .await??;
                if n == 0 {
                    break;
                }
                after.extend_from_slice(&chunk[..n]);
            }
        }
        Ok((status, after))
    }
}

/// A listener on the client's host that keeps every request it gets and answers 503: what
/// a node address planted in etcd harvests. Stops listening when dropped.
struct Planted {
    url: String,
    got: Arc<Mutex<Vec<Captured>>>,
    stop: CancellationToken,
}

impl Planted {
    async fn start(ip: &str) -> Result<Planted> {
        let listener = tokio::net::TcpListener::bind((ip, 0)).await?;
        let url = format!("http://{}", listener.local_addr()?);
        let got: Arc<Mutex<Vec<Captured>>> = Arc::default();
        let stop = CancellationToken::new();
        let (kept, stopped) = (got.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let socket = tokio::select! {
                    _ = stopped.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((socket, _)) => socket,
                        Err(_) => return,
                    },
                };
                let kept = kept.clone();
                tokio::spawn(async move {
                    use tokio::io::AsyncWriteExt;
                    if let Ok((request, mut socket)) = Planted::read(socket).await {
                        kept.lock().unwrap_or_else(|e| e.into_inner()).push(request);
                        let _ = socket
                            .write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                            .await;
                    }
                });
            }
        });
        Ok(Planted { url, got, stop })
    }

    fn got(&self) -> Vec<Captured> {
        self.got.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// One request off `socket`: its head, then a body of its `Content-Length`.
    async fn read(mut socket: tokio::net::TcpStream) -> Result<(Captured, tokio::net::TcpStream)> {
        use tokio::io::AsyncReadExt;
        let mut buf = Vec::new();
        let end = loop {
            let mut chunk = [0u8; 4096];
            let n = socket.read(&mut chunk).await?;
            anyhow::ensure!(n > 0, "closed before a whole head");
            buf.extend_from_slice(&chunk[..n]);
            if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break at;
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        let mut lines = head.split("\r\n");
        let first: Vec<&str> = lines.next().unwrap_or_default().split(' ').collect();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        let length: usize = headers
            .iter()
            .find(|(n, _)| n == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0);
        let mut body = buf[end + 4..].to_vec();
        while body.len() < length {
            let mut chunk = [0u8; 4096];
            let n = socket.read(&mut chunk).await?;
            anyhow::ensure!(n > 0, "closed before the whole body");
            body.extend_from_slice(&chunk[..n]);
        }
        let captured = Captured {
            method: first.first().copied().unwrap_or_default().to_owned(),
            path: first.get(1).copied().unwrap_or_default().to_owned(),
            headers,
            body,
        };
        Ok((captured, socket))
    }
}

impl Drop for Planted {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn now_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The shell blocks of the section of `doc` under `heading`, in order, as one script.
fn shell_blocks(doc: &str, heading: &str) -> Result<String> {
    let at = doc
        .find(&format!("\n{heading}\n"))
        .with_context(|| format!("no section {heading:?}"))?;
    let section = &doc[at + heading.len() + 2..];
    let section = &section[..section.find("\n## ").unwrap_or(section.len())];
    let mut script = String::new();
    let mut rest = section;
    while let Some(open) = rest.find("```sh\n") {
        let body = &rest[open + "```sh\n".len()..];
        let close = body.find("```").context("an unclosed block")?;
        script.push_str(&body[..close]);
        rest = &body[close + 3..];
    }
    anyhow::ensure!(!script.is_empty(), "no shell block under {heading:?}");
    Ok(script)
}

/// The ids of the processes whose command line names `path`.
fn processes_naming(path: &std::path::Path) -> Vec<u32> {
    let needle = path.display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&needle))
        })
        .collect()
}

/// What the walkthrough started, removed whatever happened: the processes it left (found
/// by the directory on their command lines, each ended by its PID), the containers and
/// mounts of both nodes' runtime directories, the directory.
struct Walkthrough {
    dir: tempfile::TempDir,
}

impl Walkthrough {
    fn demo(&self) -> std::path::PathBuf {
        self.dir.path().join("demo")
    }
}

impl Drop for Walkthrough {
    fn drop(&mut self) {
        for signal in ["-TERM", "-KILL"] {
            let left = processes_naming(&self.demo());
            if left.is_empty() {
                break;
            }
            eprintln!("the walkthrough left processes {left:?}: {signal}");
            for pid in left {
                let _ = std::process::Command::new("kill")
                    .args([signal, &pid.to_string()])
                    .status();
            }
            std::thread::sleep(Duration::from_secs(5));
        }
        for n in [1, 2] {
            kernelgate_tests::remove_leftovers(&self.demo().join(format!("run-{n}")));
        }
    }
}

/// The one-host walkthrough of docs/cluster.md, its shell blocks run as written (only the
/// variables its first block lets the caller set are given: free ports, a temporary
/// directory): etcd and two nodes on loopback, a kernel created through one node keeps its
/// variable through the other; and once its last block ran, nothing of it is left: no
/// process, no container (the nodes removed their warm kernels when stopped), no directory.
#[tokio::test]
async fn the_one_host_walkthrough_in_the_docs_runs_as_written() -> Result<()> {
    if skipped() {
        return Ok(());
    }
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/cluster.md"),
    )?;
    let script = shell_blocks(&doc, "## Trying it on one host")?;
    let walk = Walkthrough {
        dir: tempfile::Builder::new().prefix("kg-walk-").tempdir()?,
    };
    let bin = kernelgate_tests::binary();
    let path = format!(
        "{}:{}",
        bin.parent().context("the binary's directory")?.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut command = tokio::process::Command::new("bash");
    command
        .args(["-c", &script])
        .env("PATH", path)
        .env("DEMO", walk.demo())
        .env("KERNELGATE_IMAGE", kernelgate_tests::image())
        .env("KERNELGATE_RUNTIME", runtime())
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    for port in ["ETCD_PORT", "ETCD_PEER_PORT", "PORT_1", "PORT_2"] {
        command.env(port, kernelgate_tests::free_port()?.to_string());
    }
    let run = tokio::time::timeout(Duration::from_secs(180), command.output()).await;
    let output = run.context("the walkthrough did not end within 180 s")??;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    eprintln!("walkthrough stdout:\n{stdout}\nwalkthrough stderr:\n{stderr}");
    assert!(
        stdout.contains(r#""stdout":"42\n""#),
        "x set through node 1 is 42 through node 2"
    );
    assert!(
        !walk.demo().exists(),
        "its last block removed the directory"
    );
    assert_eq!(
        processes_naming(&walk.demo()),
        Vec::<u32>::new(),
        "no process left"
    );
    for n in [1, 2] {
        let filter = format!(
            "label=org.kernelgate.runtime_dir={}",
            walk.demo().join(format!("run-{n}")).display()
        );
        let listed = std::process::Command::new("docker")
            .args(["ps", "-aq", "--filter", &filter])
            .output()?;
        assert!(
            listed.stdout.iter().all(u8::is_ascii_whitespace),
            "node-{n} left containers: {}",
            String::from_utf8_lossy(&listed.stdout)
        );
    }
    Ok(())
}
