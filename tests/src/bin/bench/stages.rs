//! Where the time of one execute goes on the gateway's path, stage by stage: each stage is
//! the gateway's own code (the library the binary is built from) run in this process on
//! the messages of a `1+1` execute, timed in batches; the batches of all stages alternate,
//! so load on the machine hits them alike. The ZeroMQ hop is a real DEALER-ROUTER round
//! trip over an ipc socket, as the gateway talks to a kernel.
//!
//! Then what each optional feature costs the whole round trip: gateways differing only in
//! that feature, measured round by round side by side against one with every optional
//! feature off (`--audit-log off`, no policy, no keys file).

use crate::conn::Conn;
use crate::procs::{Paths, Server};
use crate::stats::{median, ms, percentile};
use crate::walls::spread;
use crate::{log, stop_and_check, Opts, Results};
use anyhow::{Context, Result};
use kernelgate::audit::{Audit, Record, Sender};
use kernelgate::relay::clients::{ClientLimits, Clients, Outbound};
use kernelgate::tenants::Keys;
use kernelgate_protocol::message::{Header, Message, RawJson};
use kernelgate_protocol::signature::SigningKey;
use kernelgate_protocol::websocket::{self, Encoding};
use kernelgate_protocol::{wire, Channel};
use serde_json::json;
use std::time::{Duration, Instant};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// The policy of the `policy` stage and mode: the tests' (docs/policy.md's example), none
/// of it matching `1+1`.
const POLICY: &str = include_str!("../../../fixtures/policy.toml");

/// Stages in the order a cell meets them, then the way back.
pub use kernelgate_tests::bench_report::STAGES;

/// The end-to-end modes: every optional feature off, then each one on alone, then the
/// default configuration (audit trail written, token only).
pub const MODES: [&str; 6] = ["bare", "audit", "audit_fsync", "policy", "keys", "all"];

/// Tenants in the keys file of the `keys` mode and stage: each login compares them all.
const TENANTS: usize = 100;

pub async fn compare(opts: &Opts, paths: &Paths, results: &mut Results) -> Result<()> {
    let policy_file = paths.work.join("stages-policy.toml");
    std::fs::write(&policy_file, POLICY).context("writing the bench's policy file")?;
    let keys_file = paths.work.join("stages-keys.toml");
    std::fs::write(&keys_file, keys_toml()).context("writing the bench's keys file")?;
    let micro = stages(paths, &keys_file).await;
    let whole = modes(opts, paths, &policy_file, &keys_file).await;
    let _ = std::fs::remove_file(&policy_file);
    let _ = std::fs::remove_file(&keys_file);
    for (stage, us) in micro? {
        results.set("stages_us", stage, us);
    }
    for (mode, value) in whole? {
        results.set("features_rt_ms", mode, value);
    }
    Ok(())
}

fn keys_toml() -> String {
    (0..TENANTS)
        .map(|i| {
            let digest = hex::encode(kernelgate::tenants::token_digest(&format!("tenant-{i}")));
            format!("[[key]]\nname = \"tenant-{i}\"\ntoken_sha256 = \"{digest}\"\n\n")
        })
        .collect()
}

/// The execute request of a `1+1` cell as JupyterLab sends it (v1 WebSocket protocol).
fn execute_request() -> Message {
    let header = Header::new(
        "execute_request",
        "bench-session",
        "username",
        "2026-01-01T00:00:00Z",
    );
    let content = RawJson::from_value(&json!({
        "code": "1+1", "silent": false, "store_history": true, "user_expressions": {},
        "allow_stdin": true, "stop_on_error": true,
    }));
    Message::new(header, None, content)
}

fn execute_reply(request: &Message) -> Message {
    let header = Header::new(
        "execute_reply",
        "kernel-session",
        "kernel",
        "2026-01-01T00:00:00Z",
    );
    let content = RawJson::from_value(&json!({
        "status": "ok", "execution_count": 1, "user_expressions": {}, "payload": [],
    }));
    Message::new(header, Some(request.header.clone()), content)
}

/// Every stage's cost per execute in µs: the median over batches of the batch mean, with
/// the min-max.
async fn stages(
    paths: &Paths,
    keys_file: &std::path::Path,
) -> Result<Vec<(&'static str, serde_json::Value)>> {
    const BATCHES: usize = 30;
    const PER_BATCH: usize = 500;
    let request = execute_request();
    let frame = websocket::encode(Encoding::V1, Channel::Shell, &request);
    let keys = Keys::new(Some("bench-admin"), Some(keys_file.to_path_buf()))
        .map_err(anyhow::Error::msg)?;
    let policy = kernelgate_policy::Policy::from_toml(POLICY)?;
    let audit_path = paths.work.join("stages-audit.log");
    let audit = Audit::open(&audit_path, false)?;
    let mut clients = Clients::new(ClientLimits {
        kernel_message_bytes: 64 << 20,
        buffer_bytes: 16 << 20,
        output_bytes: 64 << 20,
        replay_for: Duration::from_secs(60),
    });
    let ticket = clients.attach("bench-session", false);
    let key = SigningKey::new(SigningKey::generate_hex().as_bytes());
    let reply = execute_reply(&request);
    let reply_frames = wire::encode(&[], &reply, &key);
    let (mut dealer, mut router) = zmq_pair(&paths.work).await?;

    let mut per_batch: Vec<Vec<f64>> = vec![Vec::with_capacity(BATCHES); STAGES.len()];
    for _ in 0..BATCHES {
        for (s, stage) in STAGES.iter().enumerate() {
            let t0 = Instant::now();
            for _ in 0..PER_BATCH {
                match *stage {
                    "ws_decode" => {
                        let (_, mut m) = websocket::decode(Encoding::V1, &frame)?;
                        m.header
                            .fill_missing("bench-session", "username", "2026-01-01T00:00:00Z");
                    }
                    "auth_tenant" => {
                        let tenant = keys
                            .authenticate(Some("tenant-99"))
                            .context("the key authenticates")?;
                        std::hint::black_box(tenant.may_use("tenant-99"));
                    }
                    "policy" => {
                        std::hint::black_box(policy.check("1+1", []));
                    }
                    "audit" => {
                        let code = "1+1";
                        audit
                            .record(&Record::ExecutionRequested {
                                sender: Sender {
                                    key: "admin".into(),
                                    username: "username".into(),
                                    agent_id: None,
                                    kernel: "bench-kernel".into(),
                                    session: "bench-session".into(),
                                    msg_id: request.msg_id().to_owned(),
                                },
                                code: code.into(),
                                code_sha256: kernelgate::audit::sha256(code),
                                user_expressions: Default::default(),
                                silent: false,
                            })
                            .await;
                    }
                    "routing" => {
                        clients.note_request(request.msg_id(), "bench-session");
                        clients.route(Outbound::new(Channel::Shell, reply.clone()));
                        std::hint::black_box(clients.take(&ticket));
                    }
                    "signing" => {
                        std::hint::black_box(wire::encode(&[], &request, &key));
                    }
                    "zmq_hop" => {
                        dealer.send(ZmqMessage::from("ping")).await?;
                        let got = router.recv().await?;
                        router.send(got).await?;
                        dealer.recv().await?;
                    }
                    _ => {
                        let back = wire::decode(&reply_frames, &key)?;
                        std::hint::black_box(websocket::encode(
                            Encoding::V1,
                            Channel::Shell,
                            &back.message,
                        ));
                    }
                }
            }
            per_batch[s].push(t0.elapsed().as_secs_f64() * 1e6 / PER_BATCH as f64);
        }
    }
    drop(audit);
    let _ = std::fs::remove_file(&audit_path);
    let mut out = Vec::new();
    for (s, stage) in STAGES.iter().enumerate() {
        let v = spread(&per_batch[s]);
        log(format!(
            "stage {stage}: {:.2} µs per execute (median of {BATCHES} batches)",
            median(&per_batch[s])
        ));
        out.push((*stage, v));
    }
    Ok(out)
}

/// A DEALER connected to a ROUTER over an ipc socket in `work`.
async fn zmq_pair(work: &std::path::Path) -> Result<(zeromq::DealerSocket, zeromq::RouterSocket)> {
    let endpoint = format!("ipc://{}", work.join("stages-hop").display());
    let mut router = zeromq::RouterSocket::new();
    router.bind(&endpoint).await?;
    let mut dealer = zeromq::DealerSocket::new();
    dealer.connect(&endpoint).await?;
    // The first message also waits for the connection.
    dealer.send(ZmqMessage::from("hello")).await?;
    let got = router.recv().await?;
    router.send(got).await?;
    dealer.recv().await?;
    Ok((dealer, router))
}

/// The `1+1` round trip through a gateway per mode, round by round side by side; each
/// mode's per-round ratio against `bare`.
async fn modes(
    opts: &Opts,
    paths: &Paths,
    policy_file: &std::path::Path,
    keys_file: &std::path::Path,
) -> Result<Vec<(&'static str, serde_json::Value)>> {
    let long = Duration::from_secs(120);
    let rounds = opts.rounds.max(5);
    let log_file = paths.work.join("stages-audit-modes.log");
    let log_path = log_file.display().to_string();
    let policy_path = policy_file.display().to_string();
    let keys_path = keys_file.display().to_string();
    let mut servers = Vec::new();
    for mode in MODES {
        let mut extra = vec!["--runtime", "runc", "--audit-log"];
        match mode {
            "bare" => extra.push("off"),
            "audit" => extra.push(&log_path),
            "audit_fsync" => extra.extend([log_path.as_str(), "--audit-fsync"]),
            "policy" => extra.extend(["off", "--policy", policy_path.as_str()]),
            "keys" => extra.extend(["off", "--keys", keys_path.as_str()]),
            _ => extra.extend([
                log_path.as_str(),
                "--policy",
                policy_path.as_str(),
                "--keys",
                keys_path.as_str(),
            ]),
        }
        servers.push(Server::kernelgate(paths, 0, &extra).await?);
    }
    let mut conns = Vec::new();
    for server in &servers {
        let id = server.create_kernel(None).await?;
        let mut c = Conn::websocket(&server.base, &server.token, &id).await?;
        c.kernel_info(long).await?;
        c.wait_iopub(long).await?;
        conns.push(c);
    }
    let mut rt: Vec<Vec<f64>> = vec![Vec::new(); MODES.len()];
    for round in 0..rounds {
        for (m, c) in conns.iter_mut().enumerate() {
            for _ in 0..20 {
                c.execute("1+1", long).await?;
            }
            let mut samples = Vec::with_capacity(opts.rt_runs);
            for _ in 0..opts.rt_runs {
                samples.push(ms(c.execute("1+1", long).await?.elapsed));
            }
            let p50 = percentile(&samples, 50.0);
            rt[m].push(p50);
            log(format!(
                "feature {} round {round}: 1+1 p50 {p50:.3} ms",
                MODES[m]
            ));
        }
    }
    for c in conns {
        c.close().await;
    }
    for s in servers {
        stop_and_check(s).await?;
    }
    let _ = std::fs::remove_file(&log_file);
    let mut out = Vec::new();
    for (m, mode) in MODES.iter().enumerate() {
        let ratios: Vec<f64> = rt[m].iter().zip(&rt[0]).map(|(v, b)| v / b).collect();
        out.push((
            *mode,
            json!({"p50": median(&rt[m]), "rounds": rt[m], "runs_per_round": opts.rt_runs,
                   "vs_bare": spread(&ratios)}),
        ));
    }
    Ok(out)
}
