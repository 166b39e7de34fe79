//! End to end, with headers a hostile web page makes a browser send: foreign origins cannot
//! create kernels or open their channels, DNS rebinding cannot reach a gateway without a
//! token, the token never reaches the logs, and responses forbid framing.

use anyhow::Result;
use kernelgate_tests::Gateway;
use serde_json::json;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

/// `POST /api/kernels` with these extra headers; the status.
async fn create_with(gw: &Gateway, headers: &[(&str, &str)]) -> Result<u16> {
    let mut r = gw
        .request(reqwest::Method::POST, "/api/kernels")
        .json(&json!({}));
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    Ok(r.send().await?.status().as_u16())
}

/// Opens a kernel's channels with this `Origin`; the HTTP status of the handshake.
async fn upgrade_with(gw: &Gateway, kernel: &str, origin: &str) -> Result<u16> {
    let url = format!(
        "ws://{}/api/kernels/{kernel}/channels?session_id=s&token={}",
        gw.base.trim_start_matches("http://"),
        gw.token
    );
    let mut req = url.into_client_request()?;
    req.headers_mut().insert("Origin", origin.parse()?);
    Ok(match tokio_tungstenite::connect_async(req).await {
        Ok((_, resp)) => resp.status().as_u16(),
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => resp.status().as_u16(),
        Err(e) => return Err(e.into()),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_origins_cannot_create_or_connect() -> Result<()> {
    let gw = Gateway::start(&["--allow-origin", "https://lab.example.org"]).await?;
    let own = gw.base.clone();
    assert_eq!(
        create_with(&gw, &[("Origin", "http://evil.example")]).await?,
        403
    );
    assert_eq!(create_with(&gw, &[("Origin", "null")]).await?, 403);
    assert_eq!(
        create_with(&gw, &[("Origin", "https://lab.example.org")]).await?,
        201
    );
    assert_eq!(create_with(&gw, &[("Origin", &own)]).await?, 201);
    assert_eq!(create_with(&gw, &[]).await?, 201, "programs send no Origin");
    let r = gw
        .request(reqwest::Method::POST, "/api/kernels")
        .header("Origin", "http://evil.example")
        .send()
        .await?;
    let body: serde_json::Value = r.json().await?;
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("--allow-origin")),
        "the refusal says how to allow a site: {body}"
    );

    let kernels = gw.get_json("/api/kernels").await?.1;
    let id = kernels[0]["id"].as_str().unwrap_or_default().to_owned();
    assert_eq!(upgrade_with(&gw, &id, "http://evil.example").await?, 403);
    assert_eq!(upgrade_with(&gw, &id, &own).await?, 101);
    // A foreign page cannot delete either; reading is not a state change.
    let r = gw
        .request(reqwest::Method::DELETE, &format!("/api/kernels/{id}"))
        .header("Origin", "http://evil.example")
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 403);
    assert_eq!(gw.get_json(&format!("/api/kernels/{id}")).await?.0, 200);

    let any = Gateway::start(&["--allow-origin", "*"]).await?;
    assert_eq!(
        create_with(&any, &[("Origin", "http://anything.example")]).await?,
        201
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_dns_rebinding_is_refused() -> Result<()> {
    let gw = Gateway::start_without_token().await?;
    let port = gw.base.rsplit(':').next().unwrap_or_default().to_owned();
    let http = reqwest::Client::new();
    let get = |host: String| http.get(gw.url("/api/kernels")).header("Host", host).send();
    assert_eq!(
        get(format!("attacker.example:{port}"))
            .await?
            .status()
            .as_u16(),
        403
    );
    assert_eq!(
        get(format!("localhost:{port}")).await?.status().as_u16(),
        200
    );
    assert_eq!(
        get(format!("127.0.0.1:{port}")).await?.status().as_u16(),
        200
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_stays_out_of_logs_and_pages_cannot_be_framed() -> Result<()> {
    let gw = Gateway::start(&[]).await?;
    let http = reqwest::Client::new();
    let r = http
        .get(format!("{}?token={}", gw.url("/api/kernels"), gw.token))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 200);
    let csp = r.headers()["content-security-policy"].to_str()?.to_owned();
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    let wrong = http
        .get(format!(
            "{}?token=wrong-{}",
            gw.url("/api/kernels"),
            gw.token
        ))
        .send()
        .await?;
    assert_eq!(wrong.status().as_u16(), 403);
    let body = wrong.text().await?;
    assert!(!body.contains(&gw.token), "{body}");
    let page = http.get(gw.url("/")).send().await?;
    let csp = page.headers()["content-security-policy"]
        .to_str()?
        .to_owned();
    assert!(
        csp.contains("frame-ancestors 'none'") && csp.contains("script-src 'self'"),
        "{csp}"
    );

    let model = gw.create_kernel().await?;
    let id = model["id"].as_str().unwrap_or_default();
    assert_eq!(upgrade_with(&gw, id, &gw.base).await?, 101);
    gw.delete_kernel(id).await?;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let logs = gw.logs.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(logs.len() > 3, "{logs:?}");
    let leaked: Vec<&String> = logs.iter().filter(|l| l.contains(&gw.token)).collect();
    assert!(leaked.is_empty(), "the token is in the log: {leaked:?}");
    Ok(())
}
