//! End to end: a kernel whose code writes garbage on its own sockets. The gateway relays
//! none of it, keeps serving the kernel, and logs it at a bounded rate (so a kernel cannot
//! fill the host's disk through the gateway's log); the metrics count every message.

use anyhow::Result;
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

    let metrics = gw
        .request(reqwest::Method::GET, "/metrics")
        .send()
        .await?
        .text()
        .await?;
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
