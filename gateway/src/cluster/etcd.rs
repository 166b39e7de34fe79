//! [`Registry`] on etcd's v3 API through its JSON gateway (`POST /v3/...`): the HTTP
//! client the workspace already has, no gRPC stack and no protoc at build time. Keys and
//! values travel base64-encoded and 64-bit numbers as strings, as the gateway writes them.
//! Checked against etcd 3.4 (Debian's `etcd-server`); the same paths serve 3.5 and later.
//!
//! Each call goes to the first endpoint that answers; the one that answered last is tried
//! first next time, and a new client starts at a random one, so that the nodes of a
//! cluster spread their reads over etcd's members. A listing comes in pages of
//! [`PAGE`] keys, all read at the revision of the first, so that no single request grows
//! with the registry. A watch is one long POST whose response streams one JSON object per
//! line; it ends with the connection, and the caller resumes it from a revision.
//!
//! With a user ([`Etcd::with_user`]) every call carries the token etcd's
//! `/v3/auth/authenticate` handed out; a call that etcd answers with an invalid or expired
//! token authenticates again and is sent once more.

use super::registry::{
    prefix_end, Change, Compare, Entry, Event, Lease, Listing, Registry, RegistryError, Revision,
};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine;
use futures::stream::BoxStream;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long one request may take before the endpoint counts as unreachable. Well under
/// the shortest lease etcd grants (2 s), so a slow member cannot cost a node its lease.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(1500);

/// How long a lease renewal may take at most; the lease loop gives each renewal no more
/// than the time left on its lease, so a slow etcd that still answers in time costs no lease.
const RENEWAL_TIMEOUT: Duration = Duration::from_secs(30);

/// Keys per page of a listing.
pub const PAGE: usize = 1000;

/// How long one page of a listing may take: more than other requests (a page is up to
/// [`PAGE`] records, and a busy etcd serves many listings at once after an outage), so
/// that a slow page is waited for rather than asked again, which would cost etcd more.
const PAGE_TIMEOUT: Duration = Duration::from_secs(5);

/// How often a listing starts over when etcd compacted its revision between two pages.
const LISTING_ATTEMPTS: usize = 3;

/// etcd reached through its JSON gateway; clones share the connection pool.
#[derive(Debug, Clone)]
pub struct Etcd {
    endpoints: Arc<Vec<String>>,
    /// The endpoint that answered last.
    preferred: Arc<AtomicUsize>,
    /// Calls other than the watch get [`REQUEST_TIMEOUT`] each; the watch, whose response
    /// streams for as long as it lives, only the connect timeout.
    http: reqwest::Client,
    /// The user to authenticate as, for an etcd with authentication on.
    user: Option<Arc<User>>,
}

/// An etcd user, and the token etcd last handed it.
struct User {
    name: String,
    password: String,
    token: Mutex<Option<String>>,
}

impl std::fmt::Debug for User {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("User")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl User {
    fn token(&self) -> Option<String> {
        self.token.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set_token(&self, token: Option<String>) {
        *self.token.lock().unwrap_or_else(|e| e.into_inner()) = token;
    }
}

/// Whether etcd refused a call for its token (expired, revoked, or never given).
fn bad_token(error: &str) -> bool {
    error.contains("invalid auth token") || error.contains("user name is empty")
}

impl Etcd {
    /// `endpoints`: base URLs (`http://host:2379`). `http`: a client configured for etcd
    /// (TLS roots, client certificate), or a default one.
    pub fn new(
        endpoints: Vec<String>,
        http: reqwest::ClientBuilder,
    ) -> Result<Etcd, RegistryError> {
        if endpoints.is_empty() {
            return Err(RegistryError::Refused("no etcd endpoint given".into()));
        }
        let endpoints: Vec<String> = endpoints
            .into_iter()
            .map(|e| e.trim_end_matches('/').to_owned())
            .collect();
        let http = http
            .connect_timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|e| RegistryError::Refused(format!("cannot set up the etcd client: {e}")))?;
        let first = rand::random_range(0..endpoints.len());
        Ok(Etcd {
            endpoints: Arc::new(endpoints),
            preferred: Arc::new(AtomicUsize::new(first)),
            http,
            user: None,
        })
    }

    /// Authenticates as `name` with `password` (etcd with authentication on).
    pub fn with_user(mut self, name: &str, password: &str) -> Etcd {
        self.user = Some(Arc::new(User {
            name: name.to_owned(),
            password: password.to_owned(),
            token: Mutex::new(None),
        }));
        self
    }

    /// The user's token, authenticating when there is none yet.
    async fn token(&self) -> Result<Option<String>, RegistryError> {
        let Some(user) = &self.user else {
            return Ok(None);
        };
        if let Some(token) = user.token() {
            return Ok(Some(token));
        }
        let body = json!({"name": user.name, "password": user.password});
        let reply = self
            .post_json("/v3/auth/authenticate", &body, None, REQUEST_TIMEOUT)
            .await
            .map_err(|e| match e {
                RegistryError::Refused(why) => RegistryError::Refused(format!(
                    "etcd refused the user {:?} (--etcd-user, --etcd-password-file): {why}",
                    user.name
                )),
                other => other,
            })?;
        let token = reply["token"]
            .as_str()
            .ok_or_else(|| RegistryError::Malformed("an authentication without a token".into()))?
            .to_owned();
        user.set_token(Some(token.clone()));
        Ok(Some(token))
    }

    /// POSTs `body` to `path` on the first endpoint that answers; the JSON reply. A call
    /// refused for its token is sent once more with a new one.
    async fn call(&self, path: &str, body: Value) -> Result<Value, RegistryError> {
        self.call_within(path, body, REQUEST_TIMEOUT).await
    }

    /// [`Etcd::call`] with `timeout` for each request instead of the usual one.
    async fn call_within(
        &self,
        path: &str,
        body: Value,
        timeout: Duration,
    ) -> Result<Value, RegistryError> {
        let token = self.token().await?;
        match self.post_json(path, &body, token.as_deref(), timeout).await {
            Err(RegistryError::Refused(why)) if self.user.is_some() && bad_token(&why) => {
                if let Some(user) = &self.user {
                    user.set_token(None);
                }
                let token = self.token().await?;
                self.post_json(path, &body, token.as_deref(), timeout).await
            }
            answer => answer,
        }
    }

    /// One POST of `body` to `path` with `token`; the JSON reply, or etcd's error.
    async fn post_json(
        &self,
        path: &str,
        body: &Value,
        token: Option<&str>,
        timeout: Duration,
    ) -> Result<Value, RegistryError> {
        let response = self.send(path, body, Some(timeout), token).await?;
        let status = response.status();
        let text = response.text().await.map_err(|e| unreachable(path, &e))?;
        let value: Value = serde_json::from_str(&text).map_err(|_| {
            RegistryError::Malformed(format!("{path} answered {status}: {text:.200}"))
        })?;
        if let Some(error) = value.get("error").and_then(Value::as_str) {
            return Err(RegistryError::Refused(error.to_owned()));
        }
        if !status.is_success() {
            return Err(RegistryError::Refused(format!("{path} answered {status}")));
        }
        Ok(value)
    }

    async fn send(
        &self,
        path: &str,
        body: &Value,
        timeout: Option<Duration>,
        token: Option<&str>,
    ) -> Result<reqwest::Response, RegistryError> {
        let n = self.endpoints.len();
        let first = self.preferred.load(Ordering::Relaxed) % n;
        let mut last = None;
        for i in (0..n).map(|i| (first + i) % n) {
            let url = format!("{}{path}", self.endpoints[i]);
            let mut request = self.http.post(&url).json(body);
            if let Some(t) = timeout {
                request = request.timeout(t);
            }
            if let Some(token) = token {
                request = request.header(reqwest::header::AUTHORIZATION, token);
            }
            match request.send().await {
                Ok(response) => {
                    self.preferred.store(i, Ordering::Relaxed);
                    return Ok(response);
                }
                Err(e) => last = Some(unreachable(&self.endpoints[i], &e)),
            }
        }
        Err(last.unwrap_or_else(|| RegistryError::Refused("no etcd endpoint".into())))
    }
}

impl Etcd {
    /// Every key under `prefix`, [`PAGE`] at a time: the first page fixes the revision the
    /// rest are read at, each next page starts after the last key of the one before.
    async fn list_paged(&self, prefix: &str) -> Result<Listing, RegistryError> {
        #[derive(Deserialize)]
        struct Range {
            #[serde(default)]
            kvs: Vec<Kv>,
            #[serde(default)]
            more: bool,
        }
        let end = b64(&prefix_end(prefix));
        let mut from = prefix.as_bytes().to_vec();
        let mut revision: Option<Revision> = None;
        let mut entries = Vec::new();
        loop {
            let mut body = json!({"key": b64(&from), "range_end": end, "limit": PAGE.to_string()});
            if let Some(r) = revision {
                body["revision"] = json!(r.to_string());
            }
            let reply = self.call_within("/v3/kv/range", body, PAGE_TIMEOUT).await?;
            let at = *revision.get_or_insert(int(&reply["header"]["revision"]));
            let range: Range = serde_json::from_value(reply)
                .map_err(|e| RegistryError::Malformed(format!("a range answer: {e}")))?;
            let more = range.more;
            for kv in range.kvs {
                entries.push(kv.entry()?);
            }
            match entries.last() {
                Some(last) if more => {
                    from = last.key.as_bytes().to_vec();
                    from.push(0);
                }
                _ => {
                    entries.sort_by(|a, b| a.key.cmp(&b.key));
                    return Ok(Listing {
                        entries,
                        revision: at,
                    });
                }
            }
        }
    }
}

/// `e` with its causes, which say what went wrong beneath the request (a refused
/// connection, a certificate etcd's CA did not sign).
fn unreachable(endpoint: &str, e: &reqwest::Error) -> RegistryError {
    let mut reason = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        reason.push_str(": ");
        reason.push_str(&c.to_string());
        cause = c.source();
    }
    if reason.contains("UnknownIssuer") {
        reason.push_str(" (give the CA that signed etcd's certificate: --etcd-ca-file)");
    } else if reason.contains("BadCertificate") || reason.contains("CertificateRequired") {
        reason.push_str(" (etcd wants a client certificate its CA signed: --etcd-cert-file and --etcd-key-file)");
    }
    RegistryError::Unreachable {
        endpoint: endpoint.to_owned(),
        reason,
    }
}

fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

/// A 64-bit number as the gateway writes it (a string), or absent (zero).
fn int(value: &Value) -> i64 {
    match value {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

#[derive(Deserialize)]
struct Kv {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
    #[serde(default)]
    mod_revision: Value,
}

impl Kv {
    fn entry(self) -> Result<Entry, RegistryError> {
        let decode = |s: &str| {
            B64.decode(s)
                .map_err(|_| RegistryError::Malformed("a key or value that is not base64".into()))
        };
        let key = String::from_utf8(decode(&self.key)?)
            .map_err(|_| RegistryError::Malformed("a key that is not UTF-8".into()))?;
        Ok(Entry {
            key,
            value: decode(&self.value)?,
            revision: int(&self.mod_revision),
        })
    }
}

impl Registry for Etcd {
    async fn grant(&self, ttl: Duration) -> Result<Lease, RegistryError> {
        let reply = self
            .call("/v3/lease/grant", json!({"TTL": ttl.as_secs().max(1)}))
            .await?;
        match int(&reply["ID"]) {
            0 => Err(RegistryError::Malformed(
                "a lease grant without an ID".into(),
            )),
            id => Ok(Lease(id)),
        }
    }

    async fn keep_alive(&self, lease: Lease) -> Result<bool, RegistryError> {
        let reply = self
            .call_within(
                "/v3/lease/keepalive",
                json!({"ID": lease.0.to_string()}),
                RENEWAL_TIMEOUT,
            )
            .await?;
        // A lease that is gone comes back with no TTL (zero).
        Ok(int(&reply["result"]["TTL"]) > 0)
    }

    async fn revoke(&self, lease: Lease) -> Result<(), RegistryError> {
        match self
            .call("/v3/lease/revoke", json!({"ID": lease.0.to_string()}))
            .await
        {
            Err(RegistryError::Refused(e)) if e.contains("lease not found") => Ok(()),
            other => other.map(|_| ()),
        }
    }

    async fn put(&self, key: &str, value: &[u8], lease: Lease) -> Result<Revision, RegistryError> {
        let reply = self
            .call(
                "/v3/kv/put",
                json!({"key": b64(key.as_bytes()), "value": b64(value), "lease": lease.0.to_string()}),
            )
            .await?;
        Ok(int(&reply["header"]["revision"]))
    }

    async fn create(&self, key: &str, value: &[u8], lease: Lease) -> Result<bool, RegistryError> {
        let key = b64(key.as_bytes());
        let reply = self
            .call(
                "/v3/kv/txn",
                json!({
                    "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                    "success": [{"request_put": {"key": key, "value": b64(value), "lease": lease.0.to_string()}}],
                }),
            )
            .await?;
        Ok(reply["succeeded"].as_bool() == Some(true))
    }

    async fn delete_if(&self, key: &str, expected: &[u8]) -> Result<bool, RegistryError> {
        let key = b64(key.as_bytes());
        let reply = self
            .call(
                "/v3/kv/txn",
                json!({
                    "compare": [{"key": key, "target": "VALUE", "result": "EQUAL", "value": b64(expected)}],
                    "success": [{"request_delete_range": {"key": key}}],
                }),
            )
            .await?;
        Ok(reply["succeeded"].as_bool() == Some(true))
    }

    async fn txn(&self, compare: &[Compare], changes: &[Change]) -> Result<bool, RegistryError> {
        let compare: Vec<Value> = compare
            .iter()
            .map(|c| match c {
                Compare::Absent(key) => json!({"key": b64(key.as_bytes()), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}),
                Compare::Unchanged(key, revision) => json!({"key": b64(key.as_bytes()), "target": "MOD", "result": "EQUAL", "mod_revision": revision.to_string()}),
                Compare::Holds(key, value) => json!({"key": b64(key.as_bytes()), "target": "VALUE", "result": "EQUAL", "value": b64(value)}),
            })
            .collect();
        let success: Vec<Value> = changes
            .iter()
            .map(|c| match c {
                Change::Put { key, value, lease } => json!({"request_put": {"key": b64(key.as_bytes()), "value": b64(value), "lease": lease.0.to_string()}}),
                Change::Delete(key) => json!({"request_delete_range": {"key": b64(key.as_bytes())}}),
            })
            .collect();
        let reply = self
            .call(
                "/v3/kv/txn",
                json!({"compare": compare, "success": success}),
            )
            .await?;
        Ok(reply["succeeded"].as_bool() == Some(true))
    }

    async fn lease_of(&self, key: &str) -> Result<Option<Lease>, RegistryError> {
        let reply = self
            .call("/v3/kv/range", json!({"key": b64(key.as_bytes())}))
            .await?;
        let lease = reply["kvs"].get(0).map(|kv| int(&kv["lease"]));
        Ok(lease.filter(|id| *id != 0).map(Lease))
    }

    async fn list(&self, prefix: &str) -> Result<Listing, RegistryError> {
        let mut attempts = 0;
        loop {
            match self.list_paged(prefix).await {
                Err(RegistryError::Refused(why))
                    if why.contains("compacted") && attempts + 1 < LISTING_ATTEMPTS =>
                {
                    attempts += 1;
                }
                answer => return answer,
            }
        }
    }

    async fn watch(
        &self,
        prefix: &str,
        from: Revision,
    ) -> Result<BoxStream<'static, Result<Vec<Event>, RegistryError>>, RegistryError> {
        let body = json!({"create_request": {
            "key": b64(prefix.as_bytes()), "range_end": b64(&prefix_end(prefix)),
            "start_revision": from.to_string(),
        }});
        let token = self.token().await?;
        let response = self
            .send("/v3/watch", &body, None, token.as_deref())
            .await?;
        if !response.status().is_success() {
            return Err(RegistryError::Refused(format!(
                "/v3/watch answered {}",
                response.status()
            )));
        }
        let lines = lines(response.bytes_stream());
        let user = self.user.clone();
        Ok(lines
            .filter_map(move |line| {
                let user = user.clone();
                async move {
                    let line = match line {
                        Ok(l) => l,
                        Err(e) => return Some(Err(e)),
                    };
                    let batch = watch_batch(&line, from);
                    // Refused for its token: the watch made anew takes a new one.
                    if let (Err(RegistryError::Refused(why)), Some(user)) = (&batch, &user) {
                        if bad_token(why) {
                            user.set_token(None);
                        }
                    }
                    batch.transpose()
                }
            })
            .boxed())
    }
}

/// One line of a watch's response as events: `None` for lines without any (the
/// confirmation that the watch was created, progress notices).
fn watch_batch(line: &[u8], from: Revision) -> Result<Option<Vec<Event>>, RegistryError> {
    #[derive(Deserialize)]
    struct WatchEvent {
        #[serde(default, rename = "type")]
        kind: String,
        kv: Kv,
    }
    let value: Value = serde_json::from_slice(line)
        .map_err(|_| RegistryError::Malformed("a watch line that is not JSON".into()))?;
    if let Some(error) = value.get("error") {
        return Err(RegistryError::Refused(error.to_string()));
    }
    let result = &value["result"];
    let compacted = int(&result["compact_revision"]);
    if compacted > 0 {
        return Err(RegistryError::Compacted {
            requested: from,
            compacted,
        });
    }
    if result["canceled"].as_bool() == Some(true) {
        return Err(RegistryError::Refused(format!(
            "etcd cancelled the watch: {}",
            result["cancel_reason"]
        )));
    }
    let Some(events) = result.get("events") else {
        return Ok(None);
    };
    let events: Vec<WatchEvent> = serde_json::from_value(events.clone())
        .map_err(|e| RegistryError::Malformed(format!("watch events: {e}")))?;
    let events = events
        .into_iter()
        .map(|e| {
            let delete = e.kind == "DELETE";
            let entry = e.kv.entry()?;
            Ok(if delete {
                Event::Delete {
                    key: entry.key,
                    revision: entry.revision,
                }
            } else {
                Event::Put(entry)
            })
        })
        .collect::<Result<Vec<_>, RegistryError>>()?;
    Ok(Some(events))
}

/// The newline-separated lines of a byte stream.
fn lines(
    body: impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Send + 'static,
) -> impl futures::Stream<Item = Result<Vec<u8>, RegistryError>> + Send + 'static {
    futures::stream::unfold(
        (Box::pin(body), Vec::<u8>::new(), false),
        |(mut body, mut pending, done)| async move {
            loop {
                if let Some(at) = pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=at).collect();
                    return Some((Ok(line), (body, pending, done)));
                }
                if done {
                    return None;
                }
                match body.next().await {
                    Some(Ok(chunk)) => pending.extend_from_slice(&chunk),
                    Some(Err(e)) => {
                        return Some((
                            Err(RegistryError::Unreachable {
                                endpoint: "watch".into(),
                                reason: e.to_string(),
                            }),
                            (body, Vec::new(), true),
                        ))
                    }
                    None => {
                        let rest = std::mem::take(&mut pending);
                        let done_state = (body, Vec::new(), true);
                        if rest.iter().all(u8::is_ascii_whitespace) {
                            return None;
                        }
                        return Some((Ok(rest), done_state));
                    }
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_lines_become_events_and_compaction_is_an_error() {
        let created = br#"{"result":{"header":{"revision":"2"},"created":true}}"#;
        assert_eq!(watch_batch(created, 1).expect("ok"), None);
        let put = br#"{"result":{"header":{"revision":"2"},"events":[{"kv":{"key":"L2EvYg==","create_revision":"2","mod_revision":"2","version":"1","value":"eA=="}}]}}"#;
        let events = watch_batch(put, 1).expect("ok").expect("events");
        assert_eq!(
            events,
            vec![Event::Put(Entry {
                key: "/a/b".into(),
                value: b"x".to_vec(),
                revision: 2
            })]
        );
        let delete = br#"{"result":{"events":[{"type":"DELETE","kv":{"key":"L2EvYg==","mod_revision":"3"}}]}}"#;
        assert_eq!(
            watch_batch(delete, 1).expect("ok"),
            Some(vec![Event::Delete {
                key: "/a/b".into(),
                revision: 3
            }])
        );
        let compacted = br#"{"result":{"canceled":true,"compact_revision":"3"}}"#;
        assert!(matches!(
            watch_batch(compacted, 1),
            Err(RegistryError::Compacted {
                requested: 1,
                compacted: 3
            })
        ));
        assert!(watch_batch(b"not json", 1).is_err());
    }
}
