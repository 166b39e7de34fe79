//! Where the kernel table says which kernels it owns beyond this process: in cluster mode,
//! the cluster registry (`cluster::membership`); in single-node mode, nowhere. The table
//! calls it itself, on every path a kernel comes or goes (a create, cold or from the warm
//! pool; one re-adopted at start; a delete, cull or revocation), so no front end can forget.
//!
//! A create asks for its key's quota slot ([`Ledger::reserve`]) before it takes a kernel
//! from the warm pool or starts one, so that a create the quota refuses costs no kernel.

use futures::future::BoxFuture;
use kernelgate_protocol::rest::SnapshotModel;

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

/// What a create holds before it has a kernel: one of its key's quota slots, taken for it
/// (none for a key without `max_kernels`). Given to [`Ledger::claim`] with the kernel, or
/// back with [`Ledger::cancel`].
#[derive(Debug)]
#[must_use = "claim a kernel with it, or cancel it"]
pub struct Reservation {
    /// What holds the slot meanwhile (`None`: no slot was needed).
    pub holder: Option<String>,
    /// The key and its `max_kernels`.
    pub quota: Option<(String, usize)>,
}

/// A table's record of the kernels it owns, kept elsewhere.
pub trait Ledger: Send + Sync + std::fmt::Debug {
    /// Takes one of the owner's `max_kernels` quota slots (its keys file's, counted
    /// everywhere the ledger reaches) for a create about to start or take a kernel. Refused
    /// when every slot is taken, or when the registry cannot be reached: the create is
    /// refused before any kernel is touched.
    fn reserve<'a>(
        &'a self,
        owner: &'a str,
        max_kernels: Option<usize>,
    ) -> BoxFuture<'a, Result<Reservation, ClaimRefused>>;

    /// Claims a kernel just created, before its creator hears of it, with the create's
    /// reservation (its quota slot passes to the kernel in the same step). An error refuses
    /// the create (the reservation is given back): no kernel may run that the others cannot
    /// find, that another node holds, or past its key's quota.
    fn claim<'a>(
        &'a self,
        id: &'a str,
        owner: &'a str,
        spec: &'a str,
        reservation: Reservation,
    ) -> BoxFuture<'a, Result<(), ClaimRefused>>;

    /// Gives back the reservation of a create that made no kernel.
    fn cancel(&self, reservation: Reservation) -> BoxFuture<'_, ()>;

    /// A kernel found at start: kept, and registered with the rest of the node's. A running
    /// one (`running`) takes back its key's quota slot as it is registered; when that key is
    /// at its limit by then, the registration refuses it (see the membership's lease loop).
    fn adopt(&self, id: &str, owner: &str, spec: &str, running: bool);

    /// A kernel gone from the table.
    fn release<'a>(&'a self, id: &'a str) -> BoxFuture<'a, ()>;

    /// A kernel hibernated (`true`) or woke (`false`); it stays this table's.
    fn hibernated<'a>(&'a self, id: &'a str, hibernated: bool) -> BoxFuture<'a, ()>;

    /// A snapshot of key `owner` kept on this node (taken, or found at start): recorded
    /// where every node finds it, so that any node lists it and sends a create from it here.
    fn snapshot_kept<'a>(&'a self, owner: &'a str, model: &'a SnapshotModel) -> BoxFuture<'a, ()>;

    /// A snapshot of this node's deleted.
    fn snapshot_gone<'a>(&'a self, id: &'a str) -> BoxFuture<'a, ()>;

    /// The count and bytes of key `owner`'s snapshots that other nodes keep: its budgets
    /// count them too.
    fn snapshots_elsewhere(&self, owner: &str) -> (usize, u64);
}
