//! What an operator watches, in the Prometheus exposition format (`GET /metrics`).
//!
//! One registry for the process. Counters and histograms are updated where things happen,
//! through the one-line functions below; gauges that describe the kernel table (kernels by
//! state, pool size, replay buffer bytes) are read from it at scrape time.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::LazyLock;
use std::time::Duration;

/// Where a new kernel came from.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Source {
    Pool,
    Cold,
    /// Restored whole from a snapshot.
    Snapshot,
}

/// Which way a relayed message went.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum Direction {
    KernelToClient,
    ClientToKernel,
}

/// Why a message did not reach its destination.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum DropReason {
    /// A client fell behind and its session went over its buffer: oldest output dropped.
    ClientBehind,
    /// A client frame that could not be decoded.
    Malformed,
    /// A client message on a channel clients may not write (iopub, hb).
    ReadOnlyChannel,
    /// A client message over `--max-message-mb` (its socket is closed).
    TooLarge,
    /// A reply whose request no connected session sent.
    NoRecipient,
    /// A message from a kernel that failed its signature check or could not be parsed.
    FromKernel,
    /// A message from a kernel over `--max-message-mb`, refused while it was received.
    TooLargeFromKernel,
    /// Output of an execution past `--max-output-mb`.
    OutputLimit,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabel {
    source: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    status: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabel {
    direction: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabel {
    call: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FixLabel {
    fix: &'static str,
}

fn seconds_histogram() -> Histogram {
    // 1 ms .. about 16 min.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.001, 2.0, 20,
    ))
}

struct Metrics {
    registry: Registry,
    kernels: Family<StateLabel, Gauge>,
    creates: Family<SourceLabel, Counter>,
    create_seconds: Family<SourceLabel, Histogram, fn() -> Histogram>,
    executions: Family<StatusLabel, Counter>,
    execution_seconds: Histogram,
    websockets: Gauge,
    messages: Family<DirectionLabel, Counter>,
    bytes: Family<DirectionLabel, Counter>,
    /// The counters of `messages` and `bytes` per direction, looked up once: every relayed
    /// message counts, so the hot path takes no lock of the families.
    relayed: [(Counter, Counter); 2],
    dropped: Family<ReasonLabel, Counter>,
    replay_bytes: Gauge,
    pool_kernels: Gauge,
    pool_refills: Counter,
    docker_errors: Family<CallLabel, Counter>,
    reconciled: Family<FixLabel, Counter>,
    hibernated: Gauge,
    hibernated_bytes: Gauge,
    hibernations: Family<OutcomeLabel, Counter>,
    hibernate_seconds: Histogram,
    resume_seconds: Histogram,
    snapshots: Gauge,
    snapshot_bytes: Gauge,
    snapshots_taken: Family<OutcomeLabel, Counter>,
    snapshot_seconds: Histogram,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

/// This node's id in cluster mode: every series carries it as `node`.
static NODE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Labels every series with `node` (cluster mode). Call before the first metric is
/// recorded; false if that was too late.
pub fn set_node(id: &str) -> bool {
    NODE.set(id.to_owned()).is_ok() && !MADE.load(std::sync::atomic::Ordering::SeqCst)
}

/// Whether the registry was made (its labels are fixed from then on).
static MADE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    MADE.store(true, std::sync::atomic::Ordering::SeqCst);
    let labels = NODE.get().map(|node| {
        (
            std::borrow::Cow::Borrowed("node"),
            std::borrow::Cow::Owned(node.clone()),
        )
    });
    let mut registry = Registry::with_prefix_and_labels("kernelgate", labels.into_iter());
    let m = Metrics {
        kernels: Family::default(),
        creates: Family::default(),
        create_seconds: Family::new_with_constructor(seconds_histogram as fn() -> Histogram),
        executions: Family::default(),
        execution_seconds: seconds_histogram(),
        websockets: Gauge::default(),
        messages: Family::default(),
        bytes: Family::default(),
        relayed: Default::default(),
        dropped: Family::default(),
        replay_bytes: Gauge::default(),
        pool_kernels: Gauge::default(),
        pool_refills: Counter::default(),
        docker_errors: Family::default(),
        reconciled: Family::default(),
        hibernated: Gauge::default(),
        hibernated_bytes: Gauge::default(),
        hibernations: Family::default(),
        hibernate_seconds: seconds_histogram(),
        resume_seconds: seconds_histogram(),
        snapshots: Gauge::default(),
        snapshot_bytes: Gauge::default(),
        snapshots_taken: Family::default(),
        snapshot_seconds: seconds_histogram(),
        registry: Registry::default(),
    };
    registry.register(
        "kernels",
        "Kernels in the table, by execution state",
        m.kernels.clone(),
    );
    registry.register(
        "kernel_creates",
        "Kernels created, by source (warm pool or cold start)",
        m.creates.clone(),
    );
    registry.register(
        "kernel_create_seconds",
        "Time to create a kernel until it answers, by source",
        m.create_seconds.clone(),
    );
    registry.register(
        "executions",
        "Executions that ended with a reply, by reply status",
        m.executions.clone(),
    );
    registry.register(
        "execution_seconds",
        "Time from execute_request to its execute_reply",
        m.execution_seconds.clone(),
    );
    registry.register(
        "websocket_connections",
        "Open channels WebSockets",
        m.websockets.clone(),
    );
    registry.register(
        "relayed_messages",
        "Messages relayed between clients and kernels, by direction",
        m.messages.clone(),
    );
    registry.register(
        "relayed_bytes",
        "Bytes of messages relayed between clients and kernels, by direction",
        m.bytes.clone(),
    );
    registry.register(
        "dropped_messages",
        "Messages that did not reach their destination, by reason",
        m.dropped.clone(),
    );
    registry.register(
        "replay_buffer_bytes",
        "Bytes queued for clients (connected and away) across all kernels",
        m.replay_bytes.clone(),
    );
    registry.register(
        "pool_kernels",
        "Warm kernels ready to hand out",
        m.pool_kernels.clone(),
    );
    registry.register(
        "pool_refills",
        "Kernels started to refill the warm pool",
        m.pool_refills.clone(),
    );
    registry.register(
        "docker_errors",
        "Docker calls that failed, by call",
        m.docker_errors.clone(),
    );
    registry.register(
        "cluster_reconciled",
        "Differences between this node's kernels and the cluster registry that the periodic \
         reconcile fixed: a record of a kernel this node no longer has (stale_record), a \
         kernel of this node the registry did not know (unregistered_kernel), a kernel \
         without its key's quota slot (missing_slot), a quota slot whose kernel is gone \
         (stale_slot); or found and could not fix: a kernel without a slot whose key has \
         none free (over_quota)",
        m.reconciled.clone(),
    );
    registry.register("snapshots", "Snapshots kept on disk", m.snapshots.clone());
    registry.register(
        "snapshot_bytes",
        "Bytes of the snapshots kept on disk",
        m.snapshot_bytes.clone(),
    );
    registry.register(
        "snapshot_takes",
        "Snapshots asked for, by outcome: the kind taken (memory, namespace, filesystem), \
         refused (a variable or a budget; the kernel runs on), busy or failed",
        m.snapshots_taken.clone(),
    );
    registry.register(
        "snapshot_seconds",
        "Time to take a snapshot, the kernel paused or not",
        m.snapshot_seconds.clone(),
    );
    registry.register(
        "hibernated_kernels",
        "Kernels hibernated: their state on disk, no container",
        m.hibernated.clone(),
    );
    registry.register(
        "hibernated_state_bytes",
        "Bytes of hibernated kernels' saved state on disk",
        m.hibernated_bytes.clone(),
    );
    registry.register(
        "hibernations",
        "Hibernation attempts, by outcome: hibernated, blocked (a variable or the budget \
         stops it; the kernel keeps running), busy (work came in) or failed",
        m.hibernations.clone(),
    );
    registry.register(
        "hibernate_seconds",
        "Time to save a kernel's state and remove its container",
        m.hibernate_seconds.clone(),
    );
    registry.register(
        "resume_seconds",
        "Time from the request that woke a hibernated kernel until its state is loaded",
        m.resume_seconds.clone(),
    );
    let relayed = [Direction::KernelToClient, Direction::ClientToKernel].map(|d| {
        let label = DirectionLabel {
            direction: direction_name(d),
        };
        (
            m.messages.get_or_create(&label).clone(),
            m.bytes.get_or_create(&label).clone(),
        )
    });
    Metrics {
        registry,
        relayed,
        ..m
    }
});

fn direction_name(direction: Direction) -> &'static str {
    match direction {
        Direction::KernelToClient => "kernel_to_client",
        Direction::ClientToKernel => "client_to_kernel",
    }
}

pub fn kernel_created(source: Source, took: Duration) {
    let source = match source {
        Source::Pool => "pool",
        Source::Cold => "cold",
        Source::Snapshot => "snapshot",
    };
    let label = SourceLabel { source };
    METRICS.creates.get_or_create(&label).inc();
    METRICS
        .create_seconds
        .get_or_create(&label)
        .observe(took.as_secs_f64());
}

/// An execute_reply passed through the gateway, `took` after its request.
pub fn execution_ended(status: &str, took: Duration) {
    let status = match status {
        "ok" | "error" | "aborted" => status,
        _ => "other",
    };
    METRICS
        .executions
        .get_or_create(&StatusLabel {
            status: status.to_owned(),
        })
        .inc();
    METRICS.execution_seconds.observe(took.as_secs_f64());
}

pub fn websocket_opened() {
    METRICS.websockets.inc();
}

pub fn websocket_closed() {
    METRICS.websockets.dec();
}

pub fn relayed(direction: Direction, bytes: usize) {
    let (messages, total) = &METRICS.relayed[direction as usize];
    messages.inc();
    total.inc_by(u64::try_from(bytes).unwrap_or(u64::MAX));
}

pub fn dropped(reason: DropReason, count: u64) {
    METRICS
        .dropped
        .get_or_create(&ReasonLabel {
            reason: match reason {
                DropReason::ClientBehind => "client_behind",
                DropReason::Malformed => "malformed",
                DropReason::ReadOnlyChannel => "read_only_channel",
                DropReason::TooLarge => "too_large",
                DropReason::NoRecipient => "no_recipient",
                DropReason::FromKernel => "bad_from_kernel",
                DropReason::TooLargeFromKernel => "too_large_from_kernel",
                DropReason::OutputLimit => "output_limit",
            },
        })
        .inc_by(count);
}

pub fn pool_refilled() {
    METRICS.pool_refills.inc();
}

pub fn docker_error(call: &str) {
    METRICS
        .docker_errors
        .get_or_create(&CallLabel {
            call: call.to_owned(),
        })
        .inc();
}

/// A difference the cluster reconcile fixed: `stale_record`, `unregistered_kernel`,
/// `missing_slot` or `stale_slot`; or found and could not fix: `over_quota`.
pub fn reconciled(fix: &'static str, count: u64) {
    METRICS
        .reconciled
        .get_or_create(&FixLabel { fix })
        .inc_by(count);
}

/// How a hibernation attempt ended: `hibernated`, `blocked`, `busy` or `failed`.
pub fn hibernation(outcome: &'static str, took: Duration) {
    METRICS
        .hibernations
        .get_or_create(&OutcomeLabel { outcome })
        .inc();
    if outcome == "hibernated" {
        METRICS.hibernate_seconds.observe(took.as_secs_f64());
    }
}

/// A snapshot was asked for: `outcome` is the kind taken, or why none was.
pub fn snapshot_taken(outcome: &'static str, took: Duration) {
    METRICS
        .snapshots_taken
        .get_or_create(&OutcomeLabel { outcome })
        .inc();
    if matches!(outcome, "memory" | "namespace" | "filesystem") {
        METRICS.snapshot_seconds.observe(took.as_secs_f64());
    }
}

/// A hibernated kernel runs again, `took` after the request that woke it.
pub fn resumed(took: Duration) {
    METRICS.resume_seconds.observe(took.as_secs_f64());
}

/// The state of the kernel table, set just before a scrape.
#[derive(Debug, Default)]
pub struct TableSnapshot {
    /// Execution state name and how many kernels are in it.
    pub states: Vec<(&'static str, i64)>,
    pub pooled: i64,
    pub buffered_bytes: i64,
    pub hibernated: i64,
    pub hibernated_bytes: i64,
    pub snapshots: i64,
    pub snapshot_bytes: i64,
}

/// The exposition text, with the table gauges set from `snapshot`.
pub fn render(snapshot: &TableSnapshot) -> String {
    for (state, n) in &snapshot.states {
        METRICS
            .kernels
            .get_or_create(&StateLabel {
                state: (*state).to_owned(),
            })
            .set(*n);
    }
    METRICS.pool_kernels.set(snapshot.pooled);
    METRICS.replay_bytes.set(snapshot.buffered_bytes);
    METRICS.hibernated.set(snapshot.hibernated);
    METRICS.hibernated_bytes.set(snapshot.hibernated_bytes);
    METRICS.snapshots.set(snapshot.snapshots);
    METRICS.snapshot_bytes.set(snapshot.snapshot_bytes);
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, &METRICS.registry);
    text
}

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_is_exposed_with_its_labels() {
        kernel_created(Source::Pool, Duration::from_millis(5));
        execution_ended("error", Duration::from_millis(30));
        relayed(Direction::KernelToClient, 100);
        dropped(DropReason::ClientBehind, 3);
        docker_error("launch");
        hibernation("blocked", Duration::ZERO);
        snapshot_taken("memory", Duration::from_millis(700));
        let text = render(&TableSnapshot {
            states: vec![("idle", 2), ("busy", 1)],
            pooled: 1,
            buffered_bytes: 42,
            hibernated: 3,
            hibernated_bytes: 4096,
            snapshots: 2,
            snapshot_bytes: 8192,
        });
        for needle in [
            r#"kernelgate_kernels{state="idle"} 2"#,
            r#"kernelgate_kernel_creates_total{source="pool"}"#,
            r#"kernelgate_kernel_create_seconds_bucket{le="0.008",source="pool"}"#,
            r#"kernelgate_executions_total{status="error"}"#,
            "kernelgate_execution_seconds_count",
            "kernelgate_websocket_connections",
            r#"kernelgate_relayed_bytes_total{direction="kernel_to_client"}"#,
            r#"kernelgate_dropped_messages_total{reason="client_behind"}"#,
            "kernelgate_replay_buffer_bytes 42",
            "kernelgate_pool_kernels 1",
            "kernelgate_pool_refills_total",
            "kernelgate_hibernated_kernels 3",
            "kernelgate_hibernated_state_bytes 4096",
            r#"kernelgate_hibernations_total{outcome="blocked"} 1"#,
            "kernelgate_resume_seconds_count",
            "kernelgate_snapshots 2",
            "kernelgate_snapshot_bytes 8192",
            r#"kernelgate_snapshot_takes_total{outcome="memory"} 1"#,
            "kernelgate_snapshot_seconds_count 1",
            r#"kernelgate_docker_errors_total{call="launch"}"#,
            "# EOF",
        ] {
            assert!(text.contains(needle), "{needle} missing in:\n{text}");
        }
    }
}
