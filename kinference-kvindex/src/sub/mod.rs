//! The ZeroMQ subscriber (feature `zmq`): one task per publisher that
//! feeds an [`EventSink`] (normally the shared [`KvIndex`]) and keeps the
//! stream's health.
//!
//! Built on the pure-Rust `zeromq` 0.7 crate with the workarounds of
//! `shared/CRATES.md` §4: one `SubSocket` per publisher endpoint (there is
//! no `disconnect()`), a short `connect_timeout` with our own retry loop
//! (the crate's own backoff grows to 30 s), and a fresh `DealerSocket` per
//! replay request (a DEALER does not reconnect after a ROUTER restart).
//!
//! Sequence handling (spec §1.2–1.3), per worker:
//!
//! * first batch, or first after a restart, with `seq > 0` and a replay
//!   endpoint: back-fill by replaying from 0 (the slow-joiner case);
//! * `seq` = expected: apply;
//! * `seq` > expected (a gap): catch up from the replay endpoint if one is
//!   configured, buffering live batches meanwhile; if there is none, or the
//!   replay fails or starts late, drop that worker's blocks;
//! * a replay endpoint that cannot be reached (connect refused, no reply at
//!   all) is remembered as absent ([`StreamHealth::replay_absent`]): the
//!   engine was started without one (vLLM's default), whatever the
//!   configuration said. Only a real gap or restart drops blocks then;
//! * `seq` < expected: the engine restarted: drop its blocks;
//! * a payload that does not decode is a lost batch: drop its blocks.
//!
//! **Catching up is anchored.** A restarted publisher counts from 0 again,
//! and a subscriber that reconnects late (its reconnect backs off while
//! the publisher is down) may first hear a number *above* the one it
//! expects: a restart that looks like a gap. Replaying from the expected
//! number would then graft the new process's events onto the old one's
//! blocks and keep blocks the engine no longer has. So every catch-up asks
//! from the last batch applied, `expected − 1`, and goes on only if the
//! reply starts with that very batch (same payload digest); otherwise the
//! publisher is a new one: the worker's blocks are dropped and its replay
//! ring is read from 0 (a suffix of a stream applied to an empty state
//! never claims a block the engine does not hold).
//!
//! **No heartbeats in ZeroMQ PUB/SUB**, so with a replay endpoint two more
//! checks run the same anchored catch-up: when the socket reconnects after
//! a disconnect (what was published meanwhile is lost to us), and when the
//! stream has been idle for [`SubscriberConfig::idle_check`] (the last
//! batches before an engine went idle can be lost on the wire, and nothing
//! later would reveal it). Without one, the next batch's number tells: a
//! gap or a restart drops the worker's blocks, continuity keeps them. An
//! idle check that cannot reach the replay endpoint drops nothing.
//!
//! **Seeding from a peer's snapshot** ([`spawn_seeded`]). A stream that
//! starts without replay (vLLM's default) knows nothing of the blocks
//! stored before it. A router replica that starts asks a peer for its
//! index ([`crate::snapshot`]) and hands each stream the part naming its
//! worker, with the position it is consistent with (`L`: the peer's last
//! batch applied, and its digest). Until the seed comes (or its sender is
//! dropped) the stream keeps the batches it applies (at most
//! [`SubscriberConfig::max_buffered`] and [`SEED_HISTORY_BYTES`]), then:
//!
//! * nothing applied yet: the part is imported, and the stream goes on
//!   from `L + 1` as if it had applied `L` (a gap or a restart after it
//!   is handled as any other: replay, or the blocks are dropped);
//! * `L` among the batches kept, or just before the first: the part is
//!   imported beside what the stream applied, then the kept batches after
//!   `L` are applied again, in order. Applying a batch is idempotent and
//!   the last event about a block decides, so a block removed after `L`
//!   stays removed and one stored after it stays stored;
//! * `L` at or past the last batch applied (the peer is ahead): the part
//!   is imported, and the batches up to `L` are applied as they arrive
//!   (again, idempotent); when batch `L` arrives its digest must match,
//!   else the worker's blocks are dropped;
//! * `L` older than the first batch kept (batches in between are lost to
//!   both), a digest that differs from ours for `L` (the publisher
//!   restarted in between), or no position at all: nothing is imported.
//!
//! The task stops when its [`SubscriberHandle`] is dropped (or
//! [`SubscriberHandle::stop`] is called); sockets close with it.
//!
//! This file holds the public API (the [`EventSink`] trait, [`Seed`],
//! [`SeedOutcome`], [`SubscriberConfig`], [`StreamHealth`],
//! [`SubscriberHandle`], [`spawn`] and [`spawn_seeded`]); the task's run
//! loop is in `run.rs` and replay fetching in `replay.rs`.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::event::EventBatch;
use crate::index::{KvIndex, WorkerId};
use crate::snapshot::{Position, Snapshot};

mod replay;
mod run;

use run::{History, Run};

/// Where the events go. [`KvIndex`] implements it; a router may wrap it to
/// add metrics.
pub trait EventSink: Send + Sync + 'static {
    /// Applies one decoded batch of `worker`.
    fn apply(&self, worker: WorkerId, batch: &EventBatch);
    /// Drops everything known about `worker`'s blocks.
    fn clear(&self, worker: WorkerId);
    /// Blocks held and block widths seen `(group, width)` for health.
    fn view(&self, worker: WorkerId) -> (u64, Vec<(u32, u32)>);
    /// Applies one batch and records it as the stream's position (see
    /// [`KvIndex::apply_batch_at`]); a sink that keeps no position just
    /// applies it.
    fn apply_at(&self, worker: WorkerId, batch: &EventBatch, at: Position) {
        let _ = at;
        self.apply(worker, batch);
    }
    /// Adds a peer's snapshot part for `worker` beside what it holds (see
    /// [`KvIndex::import`]); with `at`, as the stream's position. Returns
    /// the entries added.
    ///
    /// # Errors
    /// Why it was not imported (the default: this sink takes none).
    fn import(&self, worker: WorkerId, seed: &Seed, at: Option<Position>) -> Result<u64, String> {
        let _ = (worker, seed, at);
        Err("this sink takes no snapshot".into())
    }
}

impl EventSink for KvIndex {
    fn apply(&self, worker: WorkerId, batch: &EventBatch) {
        if let Err(e) = self.apply_batch(worker, batch) {
            tracing::warn!(worker = worker.0, error = %e, "kv events for an unregistered worker");
        }
    }
    fn clear(&self, worker: WorkerId) {
        let _ = self.clear_worker(worker);
    }
    fn view(&self, worker: WorkerId) -> (u64, Vec<(u32, u32)>) {
        self.worker_stats(worker)
            .map_or((0, Vec::new()), |s| (s.blocks_held, s.observed_widths))
    }
    fn apply_at(&self, worker: WorkerId, batch: &EventBatch, at: Position) {
        if let Err(e) = self.apply_batch_at(worker, batch, at) {
            tracing::warn!(worker = worker.0, error = %e, "kv events for an unregistered worker");
        }
    }
    fn import(&self, worker: WorkerId, seed: &Seed, at: Option<Position>) -> Result<u64, String> {
        KvIndex::import(self, worker, &seed.snapshot, seed.part, at)
            .map(|i| i.entries)
            .map_err(|e| e.to_string())
    }
}

/// Most payload bytes a stream keeps while it waits for its seed
/// ([`spawn_seeded`]); past it (or past
/// [`SubscriberConfig::max_buffered`] batches) the oldest go.
pub const SEED_HISTORY_BYTES: usize = 16 << 20;

/// A peer's snapshot offered to one stream: the part naming its worker.
pub struct Seed {
    /// The snapshot.
    pub snapshot: Arc<Snapshot>,
    /// The part naming this stream's worker.
    pub part: usize,
    /// Dropped once the stream has dealt with the seed (imported it or
    /// not): a caller can count seeds pending with it.
    pub done: Option<Box<dyn std::any::Any + Send>>,
}

impl std::fmt::Debug for Seed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seed")
            .field("part", &self.part)
            .finish_non_exhaustive()
    }
}

/// What a stream did with the seed it was offered ([`spawn_seeded`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeedOutcome {
    /// No part of a snapshot named this stream's worker (or none came).
    NotOffered,
    /// Imported `entries`; `replayed` batches of this stream's own applied
    /// again over them.
    Imported {
        /// Entries added.
        entries: u64,
        /// Own batches applied again.
        replayed: u64,
    },
    /// Imported from a peer ahead of this stream: its batches up to the
    /// snapshot's are applied as they arrive, and the last one checked.
    Ahead {
        /// Entries added.
        entries: u64,
    },
    /// Not imported: older than this stream's first batch kept (the
    /// batches in between are lost to both).
    Stale,
    /// Not imported: the snapshot followed another stream (its last batch
    /// differs from ours: the publisher restarted in between).
    Diverged,
    /// Imported from a peer ahead, then the batch at its position differed
    /// from the peer's: the worker's blocks were dropped.
    DivergedLater,
    /// Not imported: the peer had no position for this stream.
    NoPosition,
    /// The import failed.
    Failed(String),
}

impl std::fmt::Display for SeedOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotOffered => f.write_str("not offered"),
            Self::Imported { entries, replayed } => {
                write!(
                    f,
                    "imported {entries} blocks, {replayed} own batches applied again"
                )
            }
            Self::Ahead { entries } => write!(f, "imported {entries} blocks from a peer ahead"),
            Self::Stale => f.write_str("not imported: older than this stream's first batch"),
            Self::Diverged => f.write_str("not imported: the peer followed another stream"),
            Self::DivergedLater => {
                f.write_str("imported, then dropped: the peer followed another stream")
            }
            Self::NoPosition => f.write_str("not imported: the peer had no position"),
            Self::Failed(e) => write!(f, "import failed: {e}"),
        }
    }
}

impl SeedOutcome {
    /// Whether blocks were imported (and kept).
    pub fn imported(&self) -> bool {
        matches!(self, Self::Imported { .. } | Self::Ahead { .. })
    }
}

/// Settings of one subscription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriberConfig {
    /// The publisher, e.g. `tcp://10.0.3.7:5557` (DP rank r: port + r).
    pub endpoint: String,
    /// The replay ROUTER, e.g. `tcp://10.0.3.7:5558`; `None`: no replay.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (`""`: everything).
    pub topic: String,
    /// Timeout of one connect attempt.
    pub connect_timeout: Duration,
    /// Pause between connect attempts.
    pub retry_interval: Duration,
    /// How long to wait for each replay reply message.
    pub replay_timeout: Duration,
    /// Live batches buffered while a replay runs; past it, the replay is
    /// abandoned and the worker's blocks are dropped.
    pub max_buffered: usize,
    /// With a replay endpoint: after this long without a batch, check with
    /// an anchored replay that nothing was missed (`None`: never).
    pub idle_check: Option<Duration>,
}

impl SubscriberConfig {
    /// Defaults for an endpoint: no replay, all topics, 500 ms connect
    /// timeout, 250 ms retry, 2 s replay timeout, 10 000 buffered batches,
    /// an idle check every 2 s (with replay).
    pub fn new(endpoint: impl Into<String>) -> Self {
        SubscriberConfig {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            connect_timeout: Duration::from_millis(500),
            retry_interval: Duration::from_millis(250),
            replay_timeout: Duration::from_secs(2),
            max_buffered: 10_000,
            idle_check: Some(Duration::from_secs(2)),
        }
    }

    /// With a replay endpoint.
    #[must_use]
    pub fn with_replay(mut self, endpoint: impl Into<String>) -> Self {
        self.replay_endpoint = Some(endpoint.into());
        self
    }

    /// With a topic prefix.
    #[must_use]
    pub fn with_topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }
}

/// Health of one worker's event stream.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamHealth {
    /// Whether the SUB socket is connected to the publisher now.
    pub connected: bool,
    /// Failed connect attempts since the last success.
    pub connect_failures: u64,
    /// When the last batch arrived (tokio's clock).
    pub last_event: Option<Instant>,
    /// The engine's `ts` of the last batch (Unix seconds, engine clock).
    pub last_batch_ts: Option<f64>,
    /// Last sequence number applied.
    pub last_seq: Option<u64>,
    /// Batches applied (live and replayed).
    pub batches: u64,
    /// Sequence gaps seen.
    pub gaps: u64,
    /// Replays completed.
    pub replays: u64,
    /// Replays that failed, timed out, overflowed or started too late.
    pub replay_failures: u64,
    /// The replay endpoint configured could not be reached (refused, or no
    /// answer in time): it is treated as absent from then on, and a gap
    /// drops the worker's blocks as without one.
    pub replay_absent: bool,
    /// Publisher restarts: the sequence went down, or a catch-up found a
    /// different stream than the one followed.
    pub restarts: u64,
    /// Anchored checks after a reconnect or an idle spell.
    pub checks: u64,
    /// Payloads that did not decode (and messages of the wrong shape).
    pub decode_errors: u64,
    /// Times this worker's blocks were dropped (restart, unrecovered gap,
    /// decode error).
    pub resets: u64,
    /// Unknown events and fields skipped by the decoder.
    pub unknown_events: u64,
    /// Unknown fields skipped by the decoder.
    pub unknown_fields: u64,
    /// Blocks the index holds for this worker (filled by
    /// [`SubscriberHandle::health`]).
    pub blocks_held: u64,
    /// Block widths seen in events, `(group, width)` (filled by
    /// [`SubscriberHandle::health`]).
    pub observed_widths: Vec<(u32, u32)>,
    /// What became of the peer's snapshot offered ([`spawn_seeded`]):
    /// `None` while one is awaited, or when none was expected.
    pub seed: Option<SeedOutcome>,
}

impl StreamHealth {
    /// The width seen for group 0, if any (what the controller compares
    /// with `kvBlockSize`).
    pub fn observed_block_width(&self) -> Option<u32> {
        self.observed_widths
            .iter()
            .find(|(g, _)| *g == 0)
            .map(|(_, w)| *w)
    }
}

type ViewFn = dyn Fn(WorkerId) -> (u64, Vec<(u32, u32)>) + Send + Sync;

/// A running subscription. Dropping it stops the task.
pub struct SubscriberHandle {
    worker: WorkerId,
    health: Arc<Mutex<StreamHealth>>,
    view: Arc<ViewFn>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for SubscriberHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubscriberHandle")
            .field("worker", &self.worker)
            .field("finished", &self.task.is_finished())
            .finish_non_exhaustive()
    }
}

impl SubscriberHandle {
    /// The worker this stream feeds.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }
    /// A snapshot of the stream's health, with the index's view of the
    /// worker (blocks held, widths seen).
    pub fn health(&self) -> StreamHealth {
        let mut h = self
            .health
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let (blocks, widths) = (self.view)(self.worker);
        h.blocks_held = blocks;
        h.observed_widths = widths;
        h
    }
    /// Whether the SUB socket is connected to the publisher now (no index
    /// access, unlike [`SubscriberHandle::health`]).
    pub fn connected(&self) -> bool {
        self.health
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .connected
    }
    /// Stops the task (also done on drop).
    pub fn stop(self) {}
    /// Whether the task has ended (it only ends when stopped).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

impl Drop for SubscriberHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts a subscription task on the current tokio runtime.
///
/// # Panics
/// Outside a tokio runtime.
pub fn spawn<S: EventSink>(
    config: SubscriberConfig,
    worker: WorkerId,
    sink: Arc<S>,
) -> SubscriberHandle {
    spawn_seeded(config, worker, sink, None)
}

/// Starts a subscription that, with `seed`, expects a peer's snapshot
/// there (see the module docs, "Seeding"): it keeps the batches it applies
/// until the seed comes, or its sender is dropped.
///
/// # Panics
/// Outside a tokio runtime.
pub fn spawn_seeded<S: EventSink>(
    config: SubscriberConfig,
    worker: WorkerId,
    sink: Arc<S>,
    seed: Option<tokio::sync::oneshot::Receiver<Option<Seed>>>,
) -> SubscriberHandle {
    let health = Arc::new(Mutex::new(StreamHealth::default()));
    let view_sink = Arc::clone(&sink);
    let view = Arc::new(move |w: WorkerId| view_sink.view(w));
    let mut run = Run {
        config,
        worker,
        sink,
        health: Arc::clone(&health),
        next_seq: None,
        last_digest: None,
        last_activity: Instant::now(),
        disconnected: false,
        reconnected: false,
        replay: None,
        history: seed.as_ref().map(|_| History::default()),
        verify: None,
    };
    run.replay.clone_from(&run.config.replay_endpoint);
    let task = tokio::spawn(async move { run.run(seed).await });
    SubscriberHandle {
        worker,
        health,
        view,
        task,
    }
}
