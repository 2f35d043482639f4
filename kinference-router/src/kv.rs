//! The KV plane: the block index fed by the engines' KV events, the
//! subscriptions that feed it, and which endpoint each index worker belongs
//! to.
//!
//! A *worker* of the index is one publisher: an endpoint's DP rank. The
//! maintainer subscribes when an endpoint joins ([`KvPlane::subscribe`]) and
//! forgets when it leaves ([`KvPlane::forget`]); request tasks only read:
//! [`KvPlane::lookup`] asks the index and maps its workers to endpoints
//! through an immutable owner table swapped in whole (no lock on the
//! request path).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use arc_swap::ArcSwap;
use kinference_kvindex::sub::{
    self, EventSink, Seed, StreamHealth, SubscriberConfig, SubscriberHandle,
};
use kinference_kvindex::{
    BlockKey, EventBatch, IndexConfig, KvEvent, KvIndex, Matches, Position, Snapshot, WorkerId,
    WorkerRef,
};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::endpoint::{Endpoint, EndpointId};

/// Where one DP rank of an endpoint publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Publisher {
    /// The DP rank.
    pub rank: u32,
    /// `tcp://host:port` of its PUB socket.
    pub endpoint: String,
    /// `tcp://host:port` of its replay ROUTER socket, if it has one.
    pub replay: Option<String>,
    /// The topic it publishes under (a prefix to subscribe to).
    pub topic: String,
}

/// KV-event stream state of an endpoint's DP rank, for reports.
#[derive(Clone, Debug, Default, Serialize)]
pub struct KvReport {
    /// Connected now.
    pub connected: bool,
    /// Batches received.
    pub batches: u64,
    /// Sequence number of the last batch applied (compare with the
    /// engine's publisher to see how far behind the index is).
    pub last_seq: Option<u64>,
    /// Sequence gaps.
    pub gaps: u64,
    /// Replays done.
    pub replays: u64,
    /// Publisher restarts seen.
    pub restarts: u64,
    /// Anchored checks after reconnects and idle spells.
    pub checks: u64,
    /// Undecodable batches.
    pub decode_errors: u64,
    /// Blocks the index holds for it.
    pub blocks_held: u64,
    /// Block widths seen in its events, by KV-cache group.
    pub observed_widths: Vec<(u32, u32)>,
    /// Seconds since its last event.
    pub last_event_age_s: Option<f64>,
    /// Times its blocks were dropped (a gap without replay, a restart).
    pub resets: u64,
    /// A replay endpoint was configured but could not be reached.
    pub replay_absent: bool,
    /// What became of a peer's KV index snapshot offered to this stream
    /// when the router started ([`crate::snapshot`]).
    pub seed: Option<String>,
    /// Blocks it imported from that snapshot (and kept).
    pub seeded_blocks: u64,
}

impl KvReport {
    fn from_health(h: &StreamHealth, now: Instant) -> Self {
        Self {
            connected: h.connected,
            batches: h.batches,
            last_seq: h.last_seq,
            gaps: h.gaps,
            replays: h.replays,
            restarts: h.restarts,
            checks: h.checks,
            decode_errors: h.decode_errors,
            blocks_held: h.blocks_held,
            observed_widths: h.observed_widths.clone(),
            last_event_age_s: h
                .last_event
                .map(|t| now.saturating_duration_since(t).as_secs_f64()),
            resets: h.resets,
            replay_absent: h.replay_absent,
            seed: h.seed.as_ref().map(ToString::to_string),
            seeded_blocks: match h.seed {
                Some(
                    sub::SeedOutcome::Imported { entries, .. }
                    | sub::SeedOutcome::Ahead { entries },
                ) => entries,
                _ => 0,
            },
        }
    }
}

/// Leading blocks an endpoint holds of a prompt, by the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Held {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// Its DP rank holding the most.
    pub rank: u32,
    /// Leading blocks in any tier (storage included).
    pub blocks: u32,
    /// Leading blocks on the GPU.
    pub gpu_blocks: u32,
    /// Leading blocks on the GPU or in CPU memory.
    pub cpu_blocks: u32,
    /// Leading blocks on the GPU, in CPU memory or on local disk.
    pub disk_blocks: u32,
}

/// Where a session's context lives on one endpoint
/// ([`KvPlane::session_tokens`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionHeld {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// Its DP rank that stored the most of the session.
    pub rank: u32,
    /// Tokens of the session's context that rank stored (an upper bound).
    pub tokens: u64,
}

type Owners = Vec<Option<(EndpointId, u32)>>;

/// The index, its subscriptions and its owner table.
pub struct KvPlane {
    index: Arc<KvIndex>,
    owners: ArcSwap<Owners>,
    subscriptions: Mutex<HashMap<EndpointId, Subscribed>>,
    seeding: Mutex<Seeding>,
    /// Seeds handed to streams and not dealt with yet.
    seeds_pending: Arc<AtomicUsize>,
    /// The bootstrap from a peer, for reports.
    bootstrap: RwLock<crate::snapshot::BootstrapReport>,
    /// A snapshot for a peer is being encoded.
    exporting: Arc<AtomicBool>,
}

/// Clears the exporting flag when the export ends, however it ends.
struct Exporting(Arc<AtomicBool>);

impl Drop for Exporting {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Streams started while a peer's snapshot is awaited get a channel for
/// their part of it ([`KvPlane::await_seed`], [`KvPlane::seed`]).
#[derive(Default)]
enum Seeding {
    /// Not awaited (no peers, turned off), or handed out already.
    #[default]
    Off,
    /// Awaited until `until` (then readiness stops waiting for it).
    Awaiting {
        until: Instant,
        streams: Vec<(WorkerRef, u32, oneshot::Sender<Option<Seed>>)>,
    },
    /// Handed out; readiness waits for the imports until `until`.
    Seeded { until: Instant },
}

/// Counts a seed as pending until the stream drops it.
struct Pending(Arc<AtomicUsize>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What [`KvPlane::seed`] handed out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seeded {
    /// Streams waiting for a seed.
    pub streams: usize,
    /// Streams given a part of the snapshot.
    pub offered: usize,
    /// Entries in the parts given.
    pub entries: u64,
}

/// An endpoint's subscriptions, and the resets seen on them so far.
struct Subscribed {
    endpoint: Arc<Endpoint>,
    streams: Vec<(WorkerId, SubscriberHandle)>,
    resets: u64,
}

/// How long after a stream starts, or loses batches it cannot replay,
/// requests to a vLLM ≥ 0.26 engine ask it to re-report the blocks they
/// reuse, so the index converges on what the engine holds for the prefixes
/// requested again.
pub const RECOVERY_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

impl std::fmt::Debug for KvPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvPlane")
            .field("entries", &self.index.stats().entries)
            .finish_non_exhaustive()
    }
}

impl KvPlane {
    /// An empty plane whose index holds at most `max_entries` entries.
    pub fn new(max_entries: u64) -> Self {
        Self {
            index: Arc::new(KvIndex::new(IndexConfig {
                max_entries,
                ..IndexConfig::default()
            })),
            owners: ArcSwap::from_pointee(Vec::new()),
            subscriptions: Mutex::default(),
            seeding: Mutex::default(),
            seeds_pending: Arc::default(),
            bootstrap: RwLock::default(),
            exporting: Arc::default(),
        }
    }

    /// Encodes the index for a peer ([`KvIndex::export`], at most
    /// `max_bytes`) on the blocking pool, one export at a time: `None`
    /// while another runs.
    pub fn export(&self, max_bytes: usize) -> Option<tokio::task::JoinHandle<Vec<u8>>> {
        if self.exporting.swap(true, Ordering::AcqRel) {
            return None;
        }
        let guard = Exporting(self.exporting.clone());
        let index = self.index.clone();
        Some(tokio::task::spawn_blocking(move || {
            let _guard = guard;
            index.export(max_bytes)
        }))
    }

    /// From now until `until`, streams that start expect a part of a
    /// peer's snapshot ([`KvPlane::seed`]), and readiness waits for it.
    pub fn await_seed(&self, until: Instant) {
        *self.seeding.lock() = Seeding::Awaiting {
            until,
            streams: Vec::new(),
        };
    }

    /// Hands each stream waiting for a seed the part of `snapshot` naming
    /// its worker at its block width (nothing without a snapshot, or
    /// without such a part); streams that start later get none.
    pub fn seed(&self, snapshot: Option<&Arc<Snapshot>>) -> Seeded {
        let streams = {
            let mut seeding = self.seeding.lock();
            match std::mem::take(&mut *seeding) {
                Seeding::Awaiting { until, streams } => {
                    *seeding = Seeding::Seeded { until };
                    streams
                }
                other => {
                    *seeding = other;
                    return Seeded::default();
                }
            }
        };
        let mut out = Seeded {
            streams: streams.len(),
            ..Seeded::default()
        };
        for (worker, width, tx) in streams {
            let part = snapshot.and_then(|s| {
                s.find(&worker)
                    .filter(|p| p.block_size == width)
                    .map(|p| (s.clone(), p.part, p.entries))
            });
            let seed = part.map(|(snapshot, part, entries)| {
                out.offered += 1;
                out.entries += entries;
                self.seeds_pending.fetch_add(1, Ordering::Relaxed);
                Seed {
                    snapshot,
                    part,
                    done: Some(Box::new(Pending(self.seeds_pending.clone()))),
                }
            });
            // A stream gone meanwhile drops it (and its count).
            let _ = tx.send(seed);
        }
        out
    }

    /// Why readiness still waits for a peer's snapshot at `now`, if it does.
    pub fn seeding_wait(&self, now: Instant) -> Option<String> {
        match &*self.seeding.lock() {
            Seeding::Awaiting { until, .. } if now < *until => Some(format!(
                "waiting (up to {:.1} s more) for a peer's KV index snapshot",
                until.saturating_duration_since(now).as_secs_f64()
            )),
            Seeding::Seeded { until } if now < *until => {
                let n = self.seeds_pending.load(Ordering::Relaxed);
                (n > 0).then(|| format!("importing a peer's KV index snapshot into {n} stream(s)"))
            }
            _ => None,
        }
    }

    /// Whether a peer's snapshot is still awaited (a bootstrap in progress).
    pub fn awaiting_seed(&self) -> bool {
        matches!(&*self.seeding.lock(), Seeding::Awaiting { .. })
    }

    /// Endpoints subscribed, and whether all their streams are connected.
    pub fn streams_connected(&self) -> (usize, bool) {
        let subs = self.subscriptions.lock();
        let all = subs
            .values()
            .all(|s| s.streams.iter().all(|(_, h)| h.connected()));
        (subs.len(), all)
    }

    /// The bootstrap from a peer, for reports.
    pub fn bootstrap_report(&self) -> crate::snapshot::BootstrapReport {
        self.bootstrap.read().clone()
    }

    /// Records the bootstrap's state.
    pub fn set_bootstrap_report(&self, r: crate::snapshot::BootstrapReport) {
        *self.bootstrap.write() = r;
    }

    /// The index.
    pub fn index(&self) -> &Arc<KvIndex> {
        &self.index
    }

    /// The endpoint (and DP rank) owning a worker of the index.
    pub fn owner(&self, w: WorkerId) -> Option<(EndpointId, u32)> {
        self.owners.load().get(w.0 as usize).copied().flatten()
    }

    /// For each endpoint holding the first of `keys`, its leading blocks
    /// (best DP rank), written to `out` (cleared first). `scratch` is reused
    /// between calls.
    pub fn lookup(&self, keys: &[BlockKey], scratch: &mut Matches, out: &mut Vec<Held>) {
        out.clear();
        if keys.is_empty() {
            return;
        }
        self.index.find_matches_into(keys, scratch);
        let owners = self.owners.load();
        for wm in scratch.as_slice() {
            let Some(Some((endpoint, rank))) = owners.get(wm.worker.0 as usize).copied() else {
                continue;
            };
            if let Some(h) = out.iter_mut().find(|h| h.endpoint == endpoint) {
                if wm.blocks > h.blocks {
                    h.rank = rank;
                }
                h.blocks = h.blocks.max(wm.blocks);
                h.gpu_blocks = h.gpu_blocks.max(wm.gpu_blocks);
                h.cpu_blocks = h.cpu_blocks.max(wm.cpu_blocks);
                h.disk_blocks = h.disk_blocks.max(wm.disk_blocks);
            } else {
                out.push(Held {
                    endpoint,
                    rank,
                    blocks: wm.blocks,
                    gpu_blocks: wm.gpu_blocks,
                    cpu_blocks: wm.cpu_blocks,
                    disk_blocks: wm.disk_blocks,
                });
            }
        }
    }

    /// For each endpoint whose engines stored blocks for `session` (their
    /// events' `session_id`), the DP rank that stored the deepest context
    /// and that depth in tokens, written to `out` (cleared first); see
    /// [`KvIndex::session_holders`] for what the depth means.
    pub fn session_tokens(&self, session: &str, out: &mut Vec<SessionHeld>) {
        out.clear();
        let mut holders = Vec::new();
        self.index.session_holders(session, &mut holders);
        if holders.is_empty() {
            return;
        }
        let owners = self.owners.load();
        for h in holders {
            let Some(Some((endpoint, rank))) = owners.get(h.worker.0 as usize).copied() else {
                continue;
            };
            match out.iter_mut().find(|s| s.endpoint == endpoint) {
                Some(s) if s.tokens >= h.tokens => {}
                Some(s) => {
                    s.rank = rank;
                    s.tokens = h.tokens;
                }
                None => out.push(SessionHeld {
                    endpoint,
                    rank,
                    tokens: h.tokens,
                }),
            }
        }
    }

    /// Subscribes to `publishers` of endpoint `e` at block width
    /// `block_size`, unless `e` has left meanwhile.
    pub fn subscribe(&self, e: &Arc<Endpoint>, publishers: Vec<Publisher>, block_size: u32) {
        if !e.is_live() {
            return;
        }
        let mut subs = Vec::new();
        for p in publishers {
            let id = match self.attach(e, p.rank, block_size) {
                Ok(id) => id,
                Err(err) => {
                    tracing::warn!(endpoint = %e.authority, rank = p.rank, error = %err, "not subscribing to KV events");
                    continue;
                }
            };
            let mut cfg = SubscriberConfig::new(p.endpoint).with_topic(p.topic);
            if let Some(r) = p.replay {
                cfg = cfg.with_replay(r);
            }
            tracing::info!(endpoint = %e.authority, rank = p.rank, kv = %cfg.endpoint, replay = ?cfg.replay_endpoint, "subscribing to KV events");
            // While a peer's snapshot is awaited, the stream gets its part.
            let seed = match &mut *self.seeding.lock() {
                Seeding::Awaiting { streams, .. } => {
                    let (tx, rx) = oneshot::channel();
                    streams.push((WorkerRef::new(e.authority.clone(), p.rank), block_size, tx));
                    Some(rx)
                }
                _ => None,
            };
            let sink = Arc::new(Progress {
                index: self.index.clone(),
                endpoint: e.clone(),
            });
            subs.push((id, sub::spawn_seeded(cfg, id, sink, seed)));
        }
        let ranks = u32::try_from(subs.len()).unwrap_or(u32::MAX);
        let mut all = self.subscriptions.lock();
        if e.is_live() {
            e.set_kv_ranks(ranks);
            // Whatever the engine held before this stream started is not
            // in the index (a router restart, a new endpoint, a resubscribe).
            e.kv_recovering_until(Instant::now() + RECOVERY_WINDOW);
            // A resubscription that overtook an earlier one replaces it.
            let old = all.insert(
                e.id,
                Subscribed {
                    endpoint: e.clone(),
                    streams: subs,
                    resets: 0,
                },
            );
            drop(all);
            if let Some(old) = old {
                self.drop_subscriptions(old.streams);
            }
        } else {
            drop(all);
            self.drop_subscriptions(subs);
        }
    }

    /// Registers DP rank `rank` of `e` as a worker of the index, at block
    /// width `block_size`, and records its owner. (Subscribing does this;
    /// tests and benchmarks feed events to the index directly.)
    ///
    /// # Errors
    /// When the index has no room for another worker.
    pub fn attach(
        &self,
        e: &Endpoint,
        rank: u32,
        block_size: u32,
    ) -> Result<WorkerId, kinference_kvindex::IndexError> {
        let id = self
            .index
            .register_worker(WorkerRef::new(e.authority.clone(), rank), block_size)?;
        self.owners.rcu(|owners| {
            let mut owners = Owners::clone(owners);
            let i = id.0 as usize;
            if owners.len() <= i {
                owners.resize(i + 1, None);
            }
            owners[i] = Some((e.id, rank));
            owners
        });
        Ok(id)
    }

    fn drop_subscriptions(&self, subs: Vec<(WorkerId, SubscriberHandle)>) {
        for (worker, handle) in subs {
            drop(handle);
            self.index.remove_worker(worker);
            self.owners.rcu(|owners| {
                let mut owners = Owners::clone(owners);
                if let Some(o) = owners.get_mut(worker.0 as usize) {
                    *o = None;
                }
                owners
            });
        }
    }

    /// Stops `e`'s subscriptions and drops its blocks.
    pub fn forget(&self, e: &Endpoint) {
        let subs = self.subscriptions.lock().remove(&e.id);
        e.set_kv_ranks(0);
        // Its blocks go with the streams: nothing is held any more.
        e.set_kv_blocks_held(Some(0));
        if let Some(subs) = subs {
            self.drop_subscriptions(subs.streams);
        }
    }

    /// Stops every subscription.
    pub fn stop_all(&self) {
        let all: Vec<_> = self.subscriptions.lock().drain().collect();
        for (_, subs) in all {
            self.drop_subscriptions(subs.streams);
        }
    }

    /// Opens a recovery window ([`RECOVERY_WINDOW`]) for every endpoint
    /// whose streams dropped blocks since the last call (a gap without
    /// replay, a restart, an undecodable batch), and refreshes each
    /// endpoint's count of blocks held. Called every second by the
    /// maintainer.
    pub fn watch_resets(&self, now: Instant) {
        for s in self.subscriptions.lock().values_mut() {
            let (mut resets, mut held, mut hybrid) = (0, 0, false);
            let mut disconnected = false;
            for (_, h) in &s.streams {
                let health = h.health();
                disconnected |= !health.connected;
                resets += health.resets;
                held += health.blocks_held;
                hybrid |= health.observed_widths.iter().any(|(group, _)| *group > 0);
            }
            // What a decision reads as the cache's occupancy (see
            // `kinference_scoring::KvRoom`), off the request path. A hybrid
            // model's groups hold blocks of different sizes from one pool:
            // their counts do not compare with its capacity.
            s.endpoint.set_kv_blocks_held((!hybrid).then_some(held));
            s.endpoint.set_kv_disconnected(disconnected);
            if resets > s.resets {
                s.resets = resets;
                s.endpoint.kv_recovering_until(now + RECOVERY_WINDOW);
            }
        }
    }

    /// Stream reports of `e`'s DP ranks, when subscribed.
    pub fn reports(&self, e: EndpointId, now: Instant) -> Option<Vec<KvReport>> {
        self.subscriptions.lock().get(&e).map(|s| {
            s.streams
                .iter()
                .map(|(_, h)| KvReport::from_health(&h.health(), now))
                .collect()
        })
    }
}

/// The index as one stream's sink, counting on the way the batches that
/// stored blocks: the engine's steps, as evidence of its speed
/// ([`kinference_scoring::Evidence::stored_steps`]).
struct Progress {
    index: Arc<KvIndex>,
    endpoint: Arc<Endpoint>,
}

impl Progress {
    fn count(&self, batch: &EventBatch) {
        if batch
            .events
            .iter()
            .any(|e| matches!(e, KvEvent::BlockStored(_)))
        {
            self.endpoint.count_kv_stored_step();
        }
    }
}

impl EventSink for Progress {
    fn apply(&self, worker: WorkerId, batch: &EventBatch) {
        self.count(batch);
        EventSink::apply(&*self.index, worker, batch);
    }
    fn apply_at(&self, worker: WorkerId, batch: &EventBatch, at: Position) {
        self.count(batch);
        EventSink::apply_at(&*self.index, worker, batch, at);
    }
    fn clear(&self, worker: WorkerId) {
        EventSink::clear(&*self.index, worker);
    }
    fn view(&self, worker: WorkerId) -> (u64, Vec<(u32, u32)>) {
        EventSink::view(&*self.index, worker)
    }
    fn import(&self, worker: WorkerId, seed: &Seed, at: Option<Position>) -> Result<u64, String> {
        EventSink::import(&*self.index, worker, seed, at)
    }
}
