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

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use crate::codec::frames::{self, ReplayReply};
use crate::event::EventBatch;
use crate::index::{KvIndex, WorkerId};
use crate::snapshot::{Position, Snapshot};

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

struct Run<S> {
    config: SubscriberConfig,
    worker: WorkerId,
    sink: Arc<S>,
    health: Arc<Mutex<StreamHealth>>,
    /// The next sequence number expected; `None` before the first batch.
    next_seq: Option<u64>,
    /// Digest of the payload of the batch `next_seq − 1`, the anchor of
    /// catch-ups.
    last_digest: Option<u64>,
    /// The last batch, or the last check.
    last_activity: Instant,
    /// The socket lost its publisher and has not reconnected yet.
    disconnected: bool,
    /// It reconnected after a disconnect: check what was missed.
    reconnected: bool,
    /// The replay endpoint, while it is believed to exist.
    replay: Option<String>,
    /// While a seed is awaited: the batches applied since the worker's
    /// blocks were last dropped (the oldest go past the bounds).
    history: Option<History>,
    /// A seed imported from a peer ahead: its position, checked when that
    /// batch arrives.
    verify: Option<Position>,
}

enum Live {
    Batch(u64, Bytes),
    Event(SocketEvent),
    Idle,
    Seed(Option<Seed>),
}

/// Batches applied, in order: `(seq, digest, payload)`.
#[derive(Default)]
struct History {
    batches: std::collections::VecDeque<(u64, u64, Bytes)>,
    bytes: usize,
}

impl History {
    fn push(&mut self, seq: u64, digest: u64, payload: &Bytes, max: usize) {
        self.batches.push_back((seq, digest, payload.clone()));
        self.bytes += payload.len();
        while self.batches.len() > max.max(1) || self.bytes > SEED_HISTORY_BYTES {
            let Some((_, _, p)) = self.batches.pop_front() else {
                break;
            };
            self.bytes -= p.len();
        }
    }

    fn clear(&mut self) {
        self.batches.clear();
        self.bytes = 0;
    }
}

fn digest(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

/// Live batches received while a replay runs.
struct Buffered {
    batches: Vec<(u64, Bytes)>,
    overflow: bool,
}

impl<S: EventSink> Run<S> {
    fn h(&self) -> std::sync::MutexGuard<'_, StreamHealth> {
        self.health.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn options(&self) -> SocketOptions {
        let mut o = SocketOptions::default();
        o.connect_timeout(self.config.connect_timeout);
        o
    }

    async fn run(&mut self, mut seed: Option<tokio::sync::oneshot::Receiver<Option<Seed>>>) {
        let mut sub = SubSocket::with_options(self.options());
        let mut monitor = sub.monitor();
        if let Err(e) = sub.subscribe(&self.config.topic).await {
            tracing::warn!(endpoint = %self.config.endpoint, error = %e, "kv subscribe failed");
        }
        // Our own retry loop: a short timeout per attempt, a fixed pause.
        loop {
            match sub.connect(&self.config.endpoint).await {
                Ok(()) => break,
                Err(e) => {
                    let n = {
                        let mut h = self.h();
                        h.connect_failures += 1;
                        h.connect_failures
                    };
                    if n == 1 || n % 40 == 0 {
                        tracing::debug!(endpoint = %self.config.endpoint, error = %e, attempts = n, "kv publisher not reachable yet");
                    }
                    tokio::time::sleep(self.config.retry_interval).await;
                }
            }
        }
        {
            let mut h = self.h();
            h.connected = true;
            h.connect_failures = 0;
        }
        tracing::info!(endpoint = %self.config.endpoint, worker = self.worker.0, "kv events connected");
        loop {
            let idle = self.idle_deadline();
            let next = tokio::select! {
                m = sub.recv() => match m {
                    Ok(m) => self.live(&m),
                    Err(e) => {
                        tracing::warn!(endpoint = %self.config.endpoint, error = %e, "kv recv failed");
                        tokio::time::sleep(self.config.retry_interval).await;
                        None
                    }
                },
                ev = monitor.next() => ev.map(Live::Event),
                () = async { tokio::time::sleep_until(idle.unwrap_or_else(Instant::now)).await }, if idle.is_some() => Some(Live::Idle),
                s = async { seed.as_mut().expect("guarded").await }, if seed.is_some() => Some(Live::Seed(s.ok().flatten())),
            };
            match next {
                Some(Live::Seed(s)) => {
                    seed = None;
                    self.on_seed(s);
                }
                Some(Live::Batch(seq, payload)) => {
                    self.on_batch(&mut sub, &mut monitor, seq, payload).await;
                }
                Some(Live::Event(ev)) => self.on_socket_event(&ev),
                Some(Live::Idle) => {
                    self.h().checks += 1;
                    self.check_idle(&mut sub, &mut monitor).await;
                    self.last_activity = Instant::now();
                }
                None => {}
            }
            if std::mem::take(&mut self.reconnected)
                && self.next_seq.is_some()
                && self.replay.is_some()
            {
                // Without a replay endpoint there is nothing to ask: the
                // next batch's number tells whether anything was lost
                // meanwhile (a gap or a restart then drops the blocks).
                self.h().checks += 1;
                self.catch_up(&mut sub, &mut monitor, None).await;
            }
        }
    }

    /// When the idle check is due, if it applies.
    fn idle_deadline(&self) -> Option<Instant> {
        let every = self.config.idle_check?;
        (self.replay.is_some() && self.next_seq.is_some() && !self.disconnected)
            .then(|| self.last_activity + every)
    }

    /// The idle check: an anchored catch-up, unless the replay endpoint
    /// cannot be reached. Nothing showed a loss, so an unreachable replay
    /// endpoint drops no block: it is remembered as absent.
    async fn check_idle(
        &mut self,
        sub: &mut SubSocket,
        monitor: &mut futures::channel::mpsc::Receiver<SocketEvent>,
    ) {
        let Some(endpoint) = self.replay.clone() else {
            return;
        };
        let (n, d) = match (self.next_seq, self.last_digest) {
            (Some(n), Some(d)) if n > 0 => (n, d),
            _ => return,
        };
        let mut buf = Buffered {
            batches: Vec::new(),
            overflow: false,
        };
        match self.fetch(sub, monitor, endpoint, n - 1, &mut buf).await {
            Err(e) if is_unreachable(&e) => self.replay_unreachable(&e),
            Err(e) => {
                tracing::debug!(endpoint = %self.config.endpoint, error = %e, "kv idle check failed; keeping the blocks");
            }
            Ok(batches) => {
                let continues = batches
                    .first()
                    .is_some_and(|(s, p)| *s == n - 1 && digest(p) == d);
                let tail: Vec<(u64, Bytes)> = batches.into_iter().skip(1).collect();
                if continues {
                    // Batches lost on the wire before the spell: apply them.
                    for (s, p) in tail {
                        if self.next_seq.is_none_or(|x| s >= x) {
                            self.apply(s, &p);
                        }
                    }
                } else {
                    self.h().restarts += 1;
                    tracing::info!(endpoint = %self.config.endpoint, "kv publisher is not the stream followed (restarted): dropping the worker's blocks");
                    self.forget();
                }
            }
        }
        for (s, p) in buf.batches {
            self.on_live_after_check(s, &p);
        }
    }

    /// A live batch that arrived during a check: applied in order, or a gap.
    fn on_live_after_check(&mut self, s: u64, p: &Bytes) {
        match self.next_seq {
            Some(n) if s < n => {}
            Some(n) if s > n => {
                self.h().gaps += 1;
                self.reset();
                self.apply(s, p);
            }
            _ => self.apply(s, p),
        }
    }

    /// The replay endpoint cannot be reached: from now on there is none.
    fn replay_unreachable(&mut self, why: &str) {
        if let Some(e) = self.replay.take() {
            tracing::warn!(endpoint = %self.config.endpoint, replay = %e, error = %why, "kv replay endpoint unreachable: treating it as absent (gaps will drop this worker's blocks)");
            let mut h = self.h();
            h.replay_absent = true;
            h.replay_failures += 1;
        }
    }

    /// Drops the worker's blocks and forgets the stream's position: the next
    /// batch is a first one.
    fn forget(&mut self) {
        self.reset();
        self.next_seq = None;
        self.last_digest = None;
    }

    fn on_socket_event(&mut self, ev: &SocketEvent) {
        match ev {
            SocketEvent::Connected(..) => {
                self.h().connected = true;
                if std::mem::take(&mut self.disconnected) {
                    tracing::info!(endpoint = %self.config.endpoint, "kv publisher reconnected");
                    self.reconnected = true;
                }
            }
            SocketEvent::Disconnected(_) => {
                self.h().connected = false;
                self.disconnected = true;
                tracing::info!(endpoint = %self.config.endpoint, "kv publisher disconnected");
            }
            _ => {}
        }
    }

    /// A live message → (seq, payload), counting malformed ones.
    fn live(&self, m: &ZmqMessage) -> Option<Live> {
        let parts: Vec<&[u8]> = m.iter().map(Bytes::as_ref).collect();
        match frames::parse_live(&parts) {
            Ok(l) => Some(Live::Batch(l.seq, m.get(2).cloned().unwrap_or_default())),
            Err(e) => {
                self.h().decode_errors += 1;
                tracing::debug!(endpoint = %self.config.endpoint, error = %e, "malformed kv message");
                None
            }
        }
    }

    async fn on_batch(
        &mut self,
        sub: &mut SubSocket,
        monitor: &mut futures::channel::mpsc::Receiver<SocketEvent>,
        seq: u64,
        payload: Bytes,
    ) {
        self.last_activity = Instant::now();
        match self.next_seq {
            Some(n) if seq == n => self.apply(seq, &payload),
            None if seq == 0 || self.replay.is_none() => self.apply(seq, &payload),
            Some(n) if seq < n => {
                self.h().restarts += 1;
                tracing::info!(endpoint = %self.config.endpoint, seq, expected = n, "kv publisher restarted");
                self.forget();
                if seq == 0 || self.replay.is_none() {
                    self.apply(seq, &payload);
                } else {
                    self.catch_up(sub, monitor, Some((seq, payload))).await;
                }
            }
            Some(n) => {
                self.h().gaps += 1;
                tracing::info!(endpoint = %self.config.endpoint, seq, expected = n, "kv sequence gap");
                if self.replay.is_some() {
                    self.catch_up(sub, monitor, Some((seq, payload))).await;
                } else {
                    self.reset();
                    self.apply(seq, &payload);
                }
            }
            None => self.catch_up(sub, monitor, Some((seq, payload))).await,
        }
    }

    fn reset(&mut self) {
        self.sink.clear(self.worker);
        self.h().resets += 1;
        if let Some(h) = &mut self.history {
            h.clear();
        }
        // What a peer ahead of us sent is gone with the blocks.
        self.verify = None;
    }

    fn apply(&mut self, seq: u64, payload: &Bytes) {
        let d = digest(payload);
        if self.apply_batch(seq, d, payload) {
            if let Some(h) = &mut self.history {
                h.push(seq, d, payload, self.config.max_buffered);
            }
        } else {
            self.h().decode_errors += 1;
            self.reset();
        }
        self.next_seq = Some(seq.wrapping_add(1));
        self.last_digest = Some(d);
        if let Some(v) = self.verify
            && seq >= v.seq
        {
            self.verify = None;
            if seq == v.seq && d != v.digest {
                tracing::warn!(endpoint = %self.config.endpoint, seq, "the peer's snapshot followed another stream: dropping the worker's blocks");
                self.h().seed = Some(SeedOutcome::DivergedLater);
                self.reset();
                self.apply_batch(seq, d, payload);
            }
        }
    }

    /// Decodes and applies one batch as the stream's position `(seq, d)`;
    /// false when it does not decode.
    fn apply_batch(&mut self, seq: u64, d: u64, payload: &[u8]) -> bool {
        match crate::codec::decode_batch(payload) {
            Ok(b) => {
                self.sink
                    .apply_at(self.worker, &b, Position { seq, digest: d });
                let mut h = self.h();
                h.batches += 1;
                h.last_event = Some(Instant::now());
                h.last_batch_ts = Some(b.ts);
                h.last_seq = Some(seq);
                h.unknown_events += u64::from(b.skipped.unknown_events);
                h.unknown_fields += u64::from(b.skipped.unknown_fields);
                true
            }
            Err(e) => {
                tracing::warn!(endpoint = %self.config.endpoint, seq, error = %e, "undecodable kv batch: dropping the worker's blocks");
                false
            }
        }
    }

    /// The seed came (or will not): merges it (module docs, "Seeding")
    /// and stops keeping batches.
    fn on_seed(&mut self, seed: Option<Seed>) {
        let history = self.history.take().unwrap_or_default();
        let outcome = match seed {
            None => SeedOutcome::NotOffered,
            Some(seed) => self.merge(&seed, &history),
        };
        match &outcome {
            SeedOutcome::NotOffered => {}
            o if o.imported() => {
                tracing::info!(endpoint = %self.config.endpoint, worker = self.worker.0, outcome = %o, "kv index seeded from a peer");
            }
            o => {
                tracing::warn!(endpoint = %self.config.endpoint, worker = self.worker.0, outcome = %o, "kv index not seeded from the peer's snapshot");
            }
        }
        self.h().seed = Some(outcome);
    }

    fn merge(&mut self, seed: &Seed, history: &History) -> SeedOutcome {
        let Some(at) = seed
            .snapshot
            .workers()
            .nth(seed.part)
            .and_then(|w| w.position)
        else {
            return SeedOutcome::NoPosition;
        };
        let import = |this: &Self, pos: Option<Position>| this.sink.import(this.worker, seed, pos);
        let l = at.seq;
        let Some(n) = self.next_seq else {
            // Nothing applied: go on from the snapshot's position.
            return match import(self, Some(at)) {
                Ok(entries) => {
                    self.next_seq = Some(l.wrapping_add(1));
                    self.last_digest = Some(at.digest);
                    SeedOutcome::Imported {
                        entries,
                        replayed: 0,
                    }
                }
                Err(e) => SeedOutcome::Failed(e),
            };
        };
        if l >= n {
            // The peer is ahead: our batches up to `l` arrive later and
            // apply over the import; batch `l` is checked then.
            return match import(self, None) {
                Ok(entries) => {
                    self.verify = Some(at);
                    SeedOutcome::Ahead { entries }
                }
                Err(e) => SeedOutcome::Failed(e),
            };
        }
        // l < n: the batches after `l` must all be kept, and ours at `l`
        // (if kept) must be the peer's.
        let first = history.batches.front().map_or(n, |b| b.0);
        if l.wrapping_add(1) < first {
            return SeedOutcome::Stale;
        }
        let ours = if l + 1 == n {
            self.last_digest
        } else {
            history.batches.iter().find(|b| b.0 == l).map(|b| b.1)
        };
        if ours.is_some_and(|d| d != at.digest) {
            return SeedOutcome::Diverged;
        }
        let entries = match import(self, None) {
            Ok(e) => e,
            Err(e) => return SeedOutcome::Failed(e),
        };
        let mut replayed = 0;
        for (s, d, p) in history.batches.iter().filter(|b| b.0 > l) {
            self.apply_batch(*s, *d, p);
            replayed += 1;
        }
        SeedOutcome::Imported { entries, replayed }
    }

    /// Fetches one replay from `from` while buffering live batches into
    /// `buf`.
    async fn fetch(
        &mut self,
        sub: &mut SubSocket,
        monitor: &mut futures::channel::mpsc::Receiver<SocketEvent>,
        endpoint: String,
        from: u64,
        buf: &mut Buffered,
    ) -> Result<Vec<(u64, Bytes)>, String> {
        let fetch = fetch_replay(endpoint, from, self.options(), self.config.replay_timeout);
        tokio::pin!(fetch);
        loop {
            tokio::select! {
                r = &mut fetch => return r,
                m = sub.recv() => match m {
                    Ok(m) => {
                        if let Some(Live::Batch(s, p)) = self.live(&m) {
                            if buf.batches.len() < self.config.max_buffered {
                                buf.batches.push((s, p));
                            } else {
                                buf.overflow = true;
                            }
                        }
                    }
                    // Do not spin on a failing socket while the replay runs.
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                },
                ev = monitor.next() => if let Some(ev) = ev { self.on_socket_event(&ev) },
            }
        }
    }

    /// Catches up from the replay endpoint (the live batch that showed the
    /// need, if any, already received), buffering live batches meanwhile,
    /// then applies everything in order.
    ///
    /// With a position, the replay is anchored (see the module docs): it
    /// asks from the last batch applied and goes on only if the reply
    /// starts with that batch; otherwise the stream is a new one and is
    /// read again from 0 onto dropped blocks. Without a position (a first
    /// join, or after a restart) it back-fills from 0. When the replay
    /// fails, the worker's blocks are dropped and the buffered batches
    /// applied.
    async fn catch_up(
        &mut self,
        sub: &mut SubSocket,
        monitor: &mut futures::channel::mpsc::Receiver<SocketEvent>,
        live: Option<(u64, Bytes)>,
    ) {
        let Some(endpoint) = self.replay.clone() else {
            return;
        };
        let mut buf = Buffered {
            batches: live.into_iter().collect(),
            overflow: false,
        };
        let anchor = match (self.next_seq, self.last_digest) {
            (Some(n), Some(d)) if n > 0 => Some((n - 1, d)),
            _ => None,
        };
        let from = anchor.map_or(0, |(a, _)| a);
        let mut result = self
            .fetch(sub, monitor, endpoint.clone(), from, &mut buf)
            .await;
        if let (Some((a, d)), Ok(batches)) = (anchor, &result) {
            let continues = batches
                .first()
                .is_some_and(|(s, p)| *s == a && digest(p) == d);
            if continues {
                // Drop the anchor itself: it is applied already.
                if let Ok(b) = &mut result {
                    b.remove(0);
                }
            } else {
                let starts = batches.first().map(|(s, _)| *s);
                self.h().restarts += 1;
                tracing::info!(endpoint = %self.config.endpoint, anchor = a, reply_starts = ?starts, "kv publisher is not the stream followed (restarted): dropping the worker's blocks and replaying from 0");
                self.forget();
                result = self.fetch(sub, monitor, endpoint, 0, &mut buf).await;
            }
        }
        let from = self.next_seq.unwrap_or(0);
        let replayed = match result {
            Ok(r) if !buf.overflow => Ok(r),
            Ok(_) => Err("live buffer overflowed during replay".to_owned()),
            Err(e) => Err(e),
        };
        match replayed {
            // Contiguous with what we applied, or a first join (nothing to
            // be contiguous with: a partial back-fill beats none).
            Ok(batches)
                if self.next_seq.is_none() || batches.first().is_none_or(|(s, _)| *s <= from) =>
            {
                if !batches.is_empty() {
                    self.h().replays += 1;
                }
                for (s, p) in batches {
                    if s >= from && self.next_seq.is_none_or(|n| s >= n) {
                        self.apply(s, &p);
                    }
                }
            }
            other => {
                let why = match other {
                    Ok(b) => format!(
                        "replay starts at {:?}, asked for {from}",
                        b.first().map(|x| x.0)
                    ),
                    Err(e) => e,
                };
                if is_unreachable(&why) {
                    self.replay_unreachable(&why);
                } else {
                    self.h().replay_failures += 1;
                }
                tracing::warn!(endpoint = %self.config.endpoint, from, reason = %why, "kv replay failed: dropping the worker's blocks");
                self.forget();
            }
        }
        // Then the live batches buffered meanwhile, skipping replayed ones.
        for (s, p) in buf.batches {
            match self.next_seq {
                Some(n) if s < n => {}
                Some(n) if s > n => {
                    // Another gap inside the buffer: do not recurse; drop.
                    self.h().gaps += 1;
                    self.reset();
                    self.apply(s, &p);
                }
                _ => self.apply(s, &p),
            }
        }
    }
}

/// Whether a replay error means the endpoint is not there (as opposed to a
/// reply that was wrong or late once it had started).
fn is_unreachable(e: &str) -> bool {
    e.starts_with("replay connect")
        || e.starts_with("replay send")
        || e == "replay reply timed out (no reply at all)"
}

/// One replay request on a fresh DEALER: `["", from]`, then replies until
/// the end marker. Accepts both reply layouts.
async fn fetch_replay(
    endpoint: String,
    from: u64,
    options: SocketOptions,
    timeout: Duration,
) -> Result<Vec<(u64, Bytes)>, String> {
    let mut dealer = DealerSocket::with_options(options);
    tokio::time::timeout(timeout, dealer.connect(&endpoint))
        .await
        .map_err(|_| "replay connect timed out".to_owned())?
        .map_err(|e| format!("replay connect: {e}"))?;
    let req = frames::replay_request(from);
    let msg = ZmqMessage::try_from(req.into_iter().map(Bytes::from).collect::<Vec<_>>())
        .map_err(|e| format!("{e:?}"))?;
    dealer
        .send(msg)
        .await
        .map_err(|e| format!("replay send: {e}"))?;
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(timeout, dealer.recv())
            .await
            .map_err(|_| {
                if out.is_empty() {
                    "replay reply timed out (no reply at all)".to_owned()
                } else {
                    "replay reply timed out".to_owned()
                }
            })?
            .map_err(|e| format!("replay recv: {e}"))?;
        let parts: Vec<&[u8]> = m.iter().map(Bytes::as_ref).collect();
        match frames::parse_replay_reply(&parts).map_err(|e| format!("replay reply: {e}"))? {
            ReplayReply::End => return Ok(out),
            ReplayReply::Batch { seq, payload, .. } => {
                out.push((seq, Bytes::copy_from_slice(payload)));
            }
        }
    }
}
