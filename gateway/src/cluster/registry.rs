//! What cluster mode needs of its store, as a small trait: leases, create-if-absent and
//! compare-and-delete, a listing with its revision, and a watch from a revision. etcd's v3
//! API implements it ([`super::etcd`]); so does an in-memory store for unit tests
//! ([`super::memory`]).

use futures::stream::BoxStream;
use std::future::Future;
use std::time::Duration;

/// A lease id; keys put under it vanish when it expires or is revoked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Lease(pub i64);

/// The store's logical clock: every change gets the next revision.
pub type Revision = i64;

/// One key and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub value: Vec<u8>,
    /// The revision of its last change.
    pub revision: Revision,
}

/// All keys under a prefix at one revision.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Listing {
    pub entries: Vec<Entry>,
    /// The store's revision the listing reflects: a watch from `revision + 1` misses nothing.
    pub revision: Revision,
}

/// A change seen by a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Put(Entry),
    Delete { key: String, revision: Revision },
}

impl Event {
    pub fn revision(&self) -> Revision {
        match self {
            Event::Put(e) => e.revision,
            Event::Delete { revision, .. } => *revision,
        }
    }
}

/// A condition of a [`Registry::txn`], on one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    /// No key of this name exists.
    Absent(String),
    /// The key exists and was last changed at this revision (as a listing showed it).
    Unchanged(String, Revision),
    /// The key exists and holds exactly this value.
    Holds(String, Vec<u8>),
}

/// A change a [`Registry::txn`] makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Put {
        key: String,
        value: Vec<u8>,
        lease: Lease,
    },
    Delete(String),
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The store did not answer (down, partitioned, too slow).
    #[error("the registry ({endpoint}) is unreachable: {reason}")]
    Unreachable { endpoint: String, reason: String },
    /// The store answered with an error.
    #[error("the registry refused the request: {0}")]
    Refused(String),
    /// A watch asked for history the store has compacted away: list again.
    #[error("the registry has compacted revision {requested} away (oldest kept: {compacted})")]
    Compacted {
        requested: Revision,
        compacted: Revision,
    },
    /// The store answered something this client cannot read.
    #[error("unexpected answer from the registry: {0}")]
    Malformed(String),
}

/// The store behind cluster mode.
pub trait Registry: Send + Sync + 'static {
    /// A new lease that lives `ttl` unless renewed.
    fn grant(&self, ttl: Duration) -> impl Future<Output = Result<Lease, RegistryError>> + Send;

    /// Renews `lease`; `Ok(false)` when it is gone (expired or revoked), and with it every
    /// key put under it.
    fn keep_alive(&self, lease: Lease) -> impl Future<Output = Result<bool, RegistryError>> + Send;

    /// Ends `lease` now: its keys vanish.
    fn revoke(&self, lease: Lease) -> impl Future<Output = Result<(), RegistryError>> + Send;

    /// Sets `key` to `value` under `lease`, whatever it held.
    fn put(
        &self,
        key: &str,
        value: &[u8],
        lease: Lease,
    ) -> impl Future<Output = Result<Revision, RegistryError>> + Send;

    /// Sets `key` to `value` under `lease` only if no key of that name exists: `Ok(true)`
    /// when this call created it.
    fn create(
        &self,
        key: &str,
        value: &[u8],
        lease: Lease,
    ) -> impl Future<Output = Result<bool, RegistryError>> + Send;

    /// Deletes `key` only if it holds exactly `expected`: `Ok(true)` when this call deleted it.
    fn delete_if(
        &self,
        key: &str,
        expected: &[u8],
    ) -> impl Future<Output = Result<bool, RegistryError>> + Send;

    /// Makes every change of `changes` at once if every condition of `compare` holds, and
    /// none otherwise: `Ok(true)` when they were made.
    fn txn(
        &self,
        compare: &[Compare],
        changes: &[Change],
    ) -> impl Future<Output = Result<bool, RegistryError>> + Send;

    /// The lease key `key` was put under; `None` when the key does not exist or has none.
    /// (The default answers `None`: a store that cannot tell. Both stores here tell; the
    /// default keeps a wrapper written against an earlier version of this trait compiling.)
    fn lease_of(
        &self,
        key: &str,
    ) -> impl Future<Output = Result<Option<Lease>, RegistryError>> + Send {
        let _ = key;
        async { Ok(None) }
    }

    /// Every key that starts with `prefix`, sorted, with the store's revision.
    fn list(&self, prefix: &str) -> impl Future<Output = Result<Listing, RegistryError>> + Send;

    /// The changes under `prefix` from revision `from` on, in order, in batches. The stream
    /// ends (or yields an error) when the connection is lost: the caller resumes from the
    /// revision after the last event it saw, or lists again on [`RegistryError::Compacted`].
    fn watch(
        &self,
        prefix: &str,
        from: Revision,
    ) -> impl Future<
        Output = Result<BoxStream<'static, Result<Vec<Event>, RegistryError>>, RegistryError>,
    > + Send;
}

/// The end of the key range that holds exactly the keys starting with `prefix` (etcd's
/// `range_end`): the prefix with its last byte incremented.
pub fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff (or empty): the range runs to the end of the key space.
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_covers_exactly_the_prefix() {
        assert_eq!(prefix_end("/kernelgate/v1/"), b"/kernelgate/v10".to_vec());
        assert_eq!(prefix_end("a"), b"b".to_vec());
        assert_eq!(prefix_end(""), vec![0]);
    }
}
