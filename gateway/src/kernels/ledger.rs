//! Where the kernel table says which kernels it owns beyond this process: in cluster mode,
//! the cluster registry (`cluster::membership`); in single-node mode, nowhere. The table
//! calls it itself, on every path a kernel comes or goes (a create, cold or from the warm
//! pool; one re-adopted at start; a delete, cull or revocation), so no front end can forget.

use futures::future::BoxFuture;

/// Why a kernel could not be claimed: the create is refused and the kernel removed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClaimRefused {
    /// The registry cannot take it now (cut off, unreachable).
    #[error("{0}")]
    Unavailable(String),
    /// The key holds `max` kernels across the cluster already.
    #[error("key {key:?} may run at most {max} kernels")]
    Quota { key: String, max: usize },
}

/// A table's record of the kernels it owns, kept elsewhere.
pub trait Ledger: Send + Sync + std::fmt::Debug {
    /// Claims a kernel just created, before its creator hears of it, within the owner's
    /// `max_kernels` (its keys file's, counted everywhere the ledger reaches). An error
    /// refuses the create: no kernel may run that the others cannot find, that another
    /// node holds, or past its key's quota.
    fn claim<'a>(
        &'a self,
        id: &'a str,
        owner: &'a str,
        spec: &'a str,
        max_kernels: Option<usize>,
    ) -> BoxFuture<'a, Result<(), ClaimRefused>>;

    /// A kernel found running at start: kept, and registered with the rest of the node's.
    fn adopt(&self, id: &str, owner: &str, spec: &str);

    /// A kernel gone from the table.
    fn release<'a>(&'a self, id: &'a str) -> BoxFuture<'a, ()>;

    /// A kernel hibernated (`true`) or woke (`false`); it stays this table's.
    fn hibernated<'a>(&'a self, id: &'a str, hibernated: bool) -> BoxFuture<'a, ()>;
}
