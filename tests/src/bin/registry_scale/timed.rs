//! The registry each simulated node uses: etcd's client, with every call counted and
//! timed while a window measures.

use super::{lock, ms};
use futures::stream::BoxStream;
use futures::StreamExt;
use kernelgate::cluster::etcd::Etcd;
use kernelgate::cluster::{
    Change, Compare, Event, Lease, Listing, Registry, RegistryError, Revision,
};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Every registry call of every node, by kind, counted and timed while a window measures.
#[derive(Debug, Default)]
pub(crate) struct Calls {
    pub(crate) measuring: AtomicBool,
    pub(crate) by_kind: Mutex<BTreeMap<&'static str, Kind>>,
    /// Events the watches delivered, and entries the listings returned.
    pub(crate) events: AtomicU64,
    pub(crate) listed: AtomicU64,
}

#[derive(Debug, Default)]
pub(crate) struct Kind {
    pub(crate) errors: u64,
    /// Milliseconds each call took.
    pub(crate) took: Vec<f64>,
}

impl Calls {
    pub(crate) async fn time<T>(
        &self,
        kind: &'static str,
        call: impl Future<Output = Result<T, RegistryError>>,
    ) -> Result<T, RegistryError> {
        let start = Instant::now();
        let answer = call.await;
        if self.measuring.load(Relaxed) {
            let mut by_kind = lock(&self.by_kind);
            let k = by_kind.entry(kind).or_default();
            k.took.push(ms(start.elapsed()));
            k.errors += u64::from(answer.is_err());
        }
        answer
    }

    pub(crate) fn measure(&self, on: bool) {
        if on {
            lock(&self.by_kind).clear();
            self.events.store(0, Relaxed);
            self.listed.store(0, Relaxed);
        }
        self.measuring.store(on, Relaxed);
    }
}

/// [`Etcd`] with every call counted and timed: the registry each simulated node uses.
#[derive(Debug, Clone)]
pub(crate) struct Timed {
    pub(crate) etcd: Etcd,
    pub(crate) calls: Arc<Calls>,
}

impl Registry for Timed {
    async fn grant(&self, ttl: Duration) -> Result<Lease, RegistryError> {
        self.calls.time("grant", self.etcd.grant(ttl)).await
    }

    async fn keep_alive(&self, lease: Lease) -> Result<bool, RegistryError> {
        self.calls
            .time("keep_alive", self.etcd.keep_alive(lease))
            .await
    }

    async fn revoke(&self, lease: Lease) -> Result<(), RegistryError> {
        self.calls.time("revoke", self.etcd.revoke(lease)).await
    }

    async fn put(&self, key: &str, value: &[u8], lease: Lease) -> Result<Revision, RegistryError> {
        self.calls
            .time("put", self.etcd.put(key, value, lease))
            .await
    }

    async fn create(&self, key: &str, value: &[u8], lease: Lease) -> Result<bool, RegistryError> {
        self.calls
            .time("create", self.etcd.create(key, value, lease))
            .await
    }

    async fn delete_if(&self, key: &str, expected: &[u8]) -> Result<bool, RegistryError> {
        self.calls
            .time("delete_if", self.etcd.delete_if(key, expected))
            .await
    }

    async fn txn(&self, compare: &[Compare], changes: &[Change]) -> Result<bool, RegistryError> {
        self.calls
            .time("txn", self.etcd.txn(compare, changes))
            .await
    }

    async fn list(&self, prefix: &str) -> Result<Listing, RegistryError> {
        let listing = self.calls.time("list", self.etcd.list(prefix)).await?;
        if self.calls.measuring.load(Relaxed) {
            let n = listing.entries.len() as u64;
            self.calls.listed.fetch_add(n, Relaxed);
        }
        Ok(listing)
    }

    async fn watch(
        &self,
        prefix: &str,
        from: Revision,
    ) -> Result<BoxStream<'static, Result<Vec<Event>, RegistryError>>, RegistryError> {
        let stream = self
            .calls
            .time("watch", self.etcd.watch(prefix, from))
            .await?;
        let calls = self.calls.clone();
        Ok(stream
            .inspect(move |batch| {
                if let (Ok(events), true) = (batch, calls.measuring.load(Relaxed)) {
                    calls.events.fetch_add(events.len() as u64, Relaxed);
                }
            })
            .boxed())
    }
}
