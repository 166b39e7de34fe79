//! The engine's `oom` events for every kernel of this gateway, from ONE events connection:
//! a task subscribes once (filtered on the gateway's labels), fans each event out to the
//! watchers of its container, and subscribes again from where it stopped when the stream
//! breaks. Hundreds of kernels hold one connection, not one each.

use super::spec::{LABEL_MANAGED, LABEL_RUNTIME_DIR};
use bollard::query_parameters::EventsOptionsBuilder;
use bollard::Docker;
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Out-of-memory events seen per container, and who waits for them.
#[derive(Debug, Default)]
pub struct OomBoard {
    state: Mutex<Board>,
    /// Wakes those waiting for any new event (or a change of coverage).
    changed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Board {
    containers: HashMap<String, Seen>,
    /// Since when (nanoseconds since the epoch) the subscription has seen every event
    /// without a gap; `None` while it is not connected.
    covered_from: Option<i64>,
}

#[derive(Debug)]
struct Seen {
    /// When its latest events happened (nanoseconds since the epoch), newest last.
    times: Vec<i64>,
    /// The number of events so far, for its watchers.
    count: watch::Sender<u64>,
}

impl Default for Seen {
    fn default() -> Self {
        Seen {
            times: Vec::new(),
            count: watch::channel(0).0,
        }
    }
}

/// How many event times are kept per container: a death needs only the latest.
const KEPT_TIMES: usize = 8;
/// Containers remembered at most (their entries go with `destroy` events and removals;
/// this bounds what a container removed behind the gateway's back leaves).
const MAX_CONTAINERS: usize = 16_384;

impl OomBoard {
    fn lock(&self) -> MutexGuard<'_, Board> {
        // Plain data: a panic elsewhere cannot leave it inconsistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts of the container's out-of-memory events: changes with each new one.
    pub fn watch(&self, container: &str) -> watch::Receiver<u64> {
        let mut board = self.lock();
        board.trim();
        let mut rx = board
            .containers
            .entry(container.to_owned())
            .or_default()
            .count
            .subscribe();
        rx.mark_unchanged();
        rx
    }

    /// One out-of-memory event of `container` at `time_ns`.
    pub fn record(&self, container: &str, time_ns: i64) {
        {
            let mut board = self.lock();
            board.trim();
            let seen = board.containers.entry(container.to_owned()).or_default();
            seen.times.push(time_ns);
            if seen.times.len() > KEPT_TIMES {
                seen.times.remove(0);
            }
            seen.count.send_modify(|n| *n += 1);
        }
        self.changed.notify_waiters();
    }

    /// The container is gone: its events are of no more use.
    pub fn forget(&self, container: &str) {
        self.lock().containers.remove(container);
    }

    /// The subscription sees every event from `from_ns` on (`None`: it is broken).
    pub fn set_coverage(&self, from_ns: Option<i64>) {
        self.lock().covered_from = from_ns;
        self.changed.notify_waiters();
    }

    /// Whether `container` had an out-of-memory event at or after `since_ns`: `Some`
    /// when the board can say, `None` when the subscription did not cover that time.
    pub fn seen_since(&self, container: &str, since_ns: i64) -> Option<bool> {
        let board = self.lock();
        let seen = board
            .containers
            .get(container)
            .is_some_and(|s| s.times.iter().any(|t| *t >= since_ns));
        match board.covered_from {
            _ if seen => Some(true),
            Some(from) if from <= since_ns => Some(false),
            _ => None,
        }
    }

    /// Like [`Self::seen_since`], waiting up to `grace` for an event still on its way
    /// (the engine reports the exit and the out-of-memory kill on two paths).
    pub async fn wait_seen_since(
        &self,
        container: &str,
        since_ns: i64,
        grace: Duration,
    ) -> Option<bool> {
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let answer = self.seen_since(container, since_ns);
            if answer == Some(true) {
                return answer;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.seen_since(container, since_ns);
            }
        }
    }
}

impl Board {
    /// Keeps the map bounded: drops entries nobody watches, oldest event first.
    fn trim(&mut self) {
        if self.containers.len() < MAX_CONTAINERS {
            return;
        }
        self.containers.retain(|_, s| s.count.receiver_count() > 0);
        while self.containers.len() >= MAX_CONTAINERS {
            let oldest = self
                .containers
                .iter()
                .min_by_key(|(_, s)| s.times.last().copied().unwrap_or(i64::MIN))
                .map(|(id, _)| id.clone());
            match oldest {
                Some(id) => self.containers.remove(&id),
                None => break,
            };
        }
    }
}

/// How long the subscription waits before it subscribes again after a break, at most.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Keeps one events subscription for the containers labelled with `runtime_dir` open
/// until `stop`, feeding `board`. After a break it subscribes again from the time of the
/// last event it saw (or when the break began), so nothing in between is lost.
pub async fn subscribe(
    docker: Docker,
    runtime_dir: String,
    board: Arc<OomBoard>,
    stop: CancellationToken,
) {
    let filters = HashMap::from([
        ("type", vec!["container".to_owned()]),
        ("event", vec!["oom".to_owned(), "destroy".to_owned()]),
        // Every label filter must match.
        (
            "label",
            vec![
                format!("{LABEL_MANAGED}=true"),
                format!("{LABEL_RUNTIME_DIR}={runtime_dir}"),
            ],
        ),
    ]);
    let now_ns = || chrono::Utc::now().timestamp_nanos_opt().unwrap_or(i64::MAX);
    // Coverage starts with the first subscription; each later one starts where the last
    // one stopped.
    let mut from = now_ns();
    let mut backoff = Duration::from_millis(100);
    loop {
        let options = EventsOptionsBuilder::default()
            .since(&stamp(from))
            .filters(&filters)
            .build();
        let mut events = docker.events(Some(options));
        // The engine answers the request only with the first event: the subscription
        // counts as covering from `from` once it was sent, and a break ends coverage.
        board.set_coverage(Some(from));
        loop {
            let event = tokio::select! {
                () = stop.cancelled() => return,
                event = events.next() => event,
            };
            let Some(Ok(event)) = event else { break };
            backoff = Duration::from_millis(100);
            let time = event
                .time_nano
                .or_else(|| event.time.map(|s| s.saturating_mul(1_000_000_000)))
                .unwrap_or_else(now_ns);
            // The next subscription starts just after the last event seen.
            from = from.max(time.saturating_add(1));
            let Some(id) = event.actor.and_then(|a| a.id) else {
                continue;
            };
            match event.action.as_deref() {
                Some("oom") => board.record(&id, time),
                Some("destroy") => board.forget(&id),
                _ => {}
            }
        }
        board.set_coverage(None);
        tracing::debug!("the Docker events stream broke; subscribing again");
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// A time for the events API: seconds with nanoseconds.
pub fn stamp(ns: i64) -> String {
    format!(
        "{}.{:09}",
        ns.div_euclid(1_000_000_000),
        ns.rem_euclid(1_000_000_000)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_event_reaches_the_watchers_of_its_container_only() {
        let board = OomBoard::default();
        let mut a = board.watch("a");
        let mut a2 = board.watch("a");
        let b = board.watch("b");
        board.record("a", 10);
        a.changed().await.expect("a's watcher hears it");
        a2.changed().await.expect("a's second watcher hears it too");
        assert!(
            !b.has_changed().expect("b is watched"),
            "b's watcher heard nothing"
        );
        assert_eq!(*a.borrow_and_update(), 1);
        board.record("a", 20);
        a.changed().await.expect("a second event");
        assert_eq!(*a.borrow(), 2);
    }

    #[tokio::test]
    async fn a_death_is_named_from_events_the_subscription_covered() {
        let board = OomBoard::default();
        // Not connected yet: the board cannot say.
        assert_eq!(board.seen_since("a", 100), None);
        board.set_coverage(Some(50));
        assert_eq!(board.seen_since("a", 100), Some(false));
        assert_eq!(board.seen_since("a", 40), None, "before coverage began");
        board.record("a", 120);
        assert_eq!(board.seen_since("a", 100), Some(true));
        assert_eq!(board.seen_since("a", 130), Some(false), "an older event");
        board.forget("a");
        assert_eq!(board.seen_since("a", 100), Some(false));
        // A broken subscription: nothing certain until it is back.
        board.set_coverage(None);
        assert_eq!(board.seen_since("b", 100), None);
    }

    #[tokio::test]
    async fn a_late_event_is_waited_for_within_the_grace() {
        let board = Arc::new(OomBoard::default());
        board.set_coverage(Some(0));
        let late = board.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            late.record("a", 5);
        });
        let seen = board.wait_seen_since("a", 1, Duration::from_secs(5)).await;
        assert_eq!(seen, Some(true));
        let none = board
            .wait_seen_since("b", 1, Duration::from_millis(20))
            .await;
        assert_eq!(none, Some(false));
    }

    #[test]
    fn event_times_are_written_as_the_api_reads_them() {
        assert_eq!(stamp(1_700_000_000_123_456_789), "1700000000.123456789");
        assert_eq!(stamp(5), "0.000000005");
    }
}
