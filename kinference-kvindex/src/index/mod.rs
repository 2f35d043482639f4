//! The KV-block index: which worker holds which block keys, per tier.
//!
//! See the crate docs for the data model, invariants and complexity.

mod holders;

use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use hashbrown::HashMap;
use smallvec::SmallVec;

use crate::event::{BlockStored, EventBatch, KvEvent, Tier};
use crate::key::{self, BlockKey};
use holders::Holders;

/// Compact id of a registered worker (an `(endpoint, dp_rank)` pair).
/// Ids are reused after [`KvIndex::remove_worker`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(pub u32);

/// What a worker is: one engine publisher (one data-parallel rank of one
/// endpoint).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerRef {
    /// The endpoint, e.g. `10.0.3.7:8000` (free text to the index).
    pub endpoint: String,
    /// Data-parallel rank.
    pub dp_rank: u32,
}

impl WorkerRef {
    /// A worker reference.
    pub fn new(endpoint: impl Into<String>, dp_rank: u32) -> Self {
        WorkerRef {
            endpoint: endpoint.into(),
            dp_rank,
        }
    }
}

/// Index errors (only misuse: events themselves never fail to apply).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// The id is not (or no longer) registered.
    #[error("unknown worker id {0}")]
    UnknownWorker(u32),
    /// `max_workers` ids are in use.
    #[error("too many workers (max {0})")]
    TooManyWorkers(u32),
    /// A block size of 0.
    #[error("block size must be positive")]
    ZeroBlockSize,
}

/// Index settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexConfig {
    /// Number of key shards (rounded up to a power of two, at most 65536).
    pub shards: usize,
    /// Length B of the first segment (rounded up to a power of two); later
    /// segments double: `[0,B) [B,2B) [2B,4B) …`. All blocks of one segment
    /// of one chain live in one shard (chosen by the key at the segment's
    /// start), so a lookup takes one read lock per segment it touches.
    pub segment: u32,
    /// Budget: most (block, worker) entries held. When a store would pass
    /// it, the worker holding the most entries is cleared first (see the
    /// crate docs, "Memory budget").
    pub max_entries: u64,
    /// Most workers registered at once (at most 2²⁰).
    pub max_workers: u32,
    /// Probe points per bracket per round of a lookup's search (2..=32):
    /// more points mean fewer rounds (dependent memory latencies) but more
    /// probes and membership walks.
    pub fanout: u32,
    /// The KV-cache group indexed (events of other groups are counted, not
    /// indexed); `group_idx` nil counts as 0.
    pub group: u32,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            shards: 1024,
            segment: 64,
            max_entries: 200_000_000,
            max_workers: 65_536,
            fanout: 4,
            group: 0,
        }
    }
}

/// Identity hasher: block keys are already uniform 64-bit hashes.
#[derive(Debug, Default, Clone, Copy)]
struct KeyHasher(u64);
impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8 | u64::from(*b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}
type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;
type EngineMap<V> = HashMap<u64, V, foldhash::fast::FixedState>;

#[derive(Debug, Default)]
struct Shard {
    map: KeyMap<Holders>,
}

#[derive(Debug, Default)]
#[repr(align(128))]
struct PaddedShard(RwLock<Shard>);

/// Where an engine hash's block sits: its key, its parent's key, its
/// position in the chain and the shards of both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Rec {
    key: u64,
    parent_key: u64,
    pos: u32,
    shard: u16,
    parent_shard: u16,
}

/// Counters per worker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// The worker.
    pub worker: Option<WorkerRef>,
    /// Configured block width (the worker set's `kvBlockSize`).
    pub block_size: u32,
    /// Blocks (keys) held now, any tier.
    pub blocks_held: u64,
    /// Blocks whose parent block is not held (0 in normal operation).
    pub holes: u64,
    /// Block widths seen in `BlockStored` events, per KV-cache group:
    /// `(group, width)`, first seen first (for the block-size diagnosis).
    pub observed_widths: Vec<(u32, u32)>,
    /// Blocks indexed by `BlockStored`.
    pub stored_blocks: u64,
    /// Blocks removed by `BlockRemoved`.
    pub removed_blocks: u64,
    /// Stored blocks dropped because their parent was unknown.
    pub orphan_blocks: u64,
    /// Stored blocks dropped because their width was not a multiple of the
    /// configured width, or their tokens did not fill them.
    pub width_mismatch_blocks: u64,
    /// Stored blocks re-chunked from a wider event block (counted in
    /// event blocks).
    pub rechunked_blocks: u64,
    /// Blocks of events for another KV-cache group (not indexed).
    pub other_group_blocks: u64,
    /// Blocks of events marked `locality: "REMOTE"` (not indexed).
    pub remote_blocks: u64,
    /// Placeholder stores (no tokens) for hashes this worker does not hold.
    pub unknown_placeholders: u64,
    /// Removals of hashes this worker does not hold.
    pub unknown_removals: u64,
    /// Times all of its blocks were dropped (clear, restart, gap, budget).
    pub clears: u64,
}

#[derive(Debug, Default)]
struct WorkerState {
    stats: WorkerStats,
    block_size: u32,
    /// Entries without the GPU bit.
    no_gpu: u64,
    /// Held keys whose parent key is not held → number of such children.
    orphan_parents: HashMap<u64, u32, foldhash::fast::FixedState>,
    /// Children counts of 255 and more (the holder says [`holders::SPILL`]).
    big_children: HashMap<u64, u32, foldhash::fast::FixedState>,
    /// Engine hashes whose block differs from the shared record.
    overrides: EngineMap<Rec>,
}

#[derive(Debug, Default)]
struct Writer {
    engine: EngineMap<Rec>,
    /// Sub-blocks (all but the last) of engine blocks re-chunked to a
    /// narrower configured width, by engine hash.
    multi: EngineMap<Box<[Rec]>>,
    workers: Vec<Option<WorkerState>>,
    by_ref: std::collections::HashMap<WorkerRef, u32>,
    free_ids: Vec<u32>,
    evictions: u64,
    scratch: Vec<(u64, Rec)>,
    locals: Vec<u64>,
}

/// Size figures of the whole index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// (block, worker) entries.
    pub entries: u64,
    /// Distinct block keys.
    pub keys: u64,
    /// Engine-hash records (shared between workers that agree).
    pub engine_records: u64,
    /// Registered workers.
    pub workers: u64,
    /// Estimated bytes owned by the index (tables at capacity, holder
    /// arrays, per-worker maps).
    pub bytes: u64,
    /// Workers cleared to stay within `max_entries`.
    pub evictions: u64,
}

/// How much one applied event or batch changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Entries added.
    pub stored: u64,
    /// Entries removed.
    pub removed: u64,
    /// Blocks not indexed (orphans, width mismatch, other group, remote).
    pub dropped: u64,
    /// Whether the worker's blocks were all dropped (AllBlocksCleared).
    pub cleared: bool,
}

impl std::ops::AddAssign for Applied {
    fn add_assign(&mut self, o: Applied) {
        self.stored += o.stored;
        self.removed += o.removed;
        self.dropped += o.dropped;
        self.cleared |= o.cleared;
    }
}

/// Per-worker answer of [`KvIndex::find_matches`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct WorkerMatch {
    /// The worker.
    pub worker: WorkerId,
    /// Leading query blocks the worker holds in any tier.
    pub blocks: u32,
    /// Leading query blocks it holds on the GPU (≤ `blocks`).
    pub gpu_blocks: u32,
}

/// The result of a lookup: workers with at least one leading block, in
/// worker-id order. Reuse one per task with
/// [`KvIndex::find_matches_into`] to avoid allocating per request.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Matches {
    items: Vec<WorkerMatch>,
    cand: Vec<Cand>,
    points: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cand {
    worker: u32,
    lo: u32,
    hi: u32,
    open: bool,
    bracket: u8,
}

impl Matches {
    /// The matches, sorted by worker id.
    pub fn as_slice(&self) -> &[WorkerMatch] {
        &self.items
    }
    /// Number of workers with a match.
    pub fn len(&self) -> usize {
        self.items.len()
    }
    /// Whether no worker matched.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
    /// The match of one worker.
    pub fn get(&self, w: WorkerId) -> Option<&WorkerMatch> {
        self.items
            .binary_search_by_key(&w, |m| m.worker)
            .ok()
            .map(|i| &self.items[i])
    }
    /// The best depth over all workers.
    pub fn max_blocks(&self) -> u32 {
        self.items.iter().map(|m| m.blocks).max().unwrap_or(0)
    }
}

const FLAG_HOLES: u8 = 1;
const FLAG_NO_GPU: u8 = 2;
/// Brackets probed in one round.
const MAX_BRACKETS: usize = 4;

/// The shared KV-block index. `Send + Sync`: share it in an `Arc`; any
/// number of threads may look up while others apply events.
#[derive(Debug)]
pub struct KvIndex {
    shards: Box<[PaddedShard]>,
    shard_mask: u64,
    seg_shift: u32,
    flags: Box<[AtomicU8]>,
    entries: AtomicU64,
    keys: AtomicU64,
    heap_words: AtomicU64,
    writer: Mutex<Writer>,
    config: IndexConfig,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(PoisonError::into_inner)
}
fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(PoisonError::into_inner)
}

/// The true children count of holder `h` (of a worker) of block `key`.
#[inline]
fn children_of(ws: &WorkerState, key: u64, h: u32) -> u32 {
    let c = holders::children(h);
    if c == holders::SPILL {
        ws.big_children.get(&key).copied().unwrap_or(c)
    } else {
        c
    }
}

/// `h` with children count `c`; counts of [`holders::SPILL`] and more go to
/// the worker's side table.
#[inline]
fn with_children_count(ws: &mut WorkerState, key: u64, h: u32, c: u32) -> u32 {
    if c >= holders::SPILL {
        ws.big_children.insert(key, c);
        holders::with_children(h, holders::SPILL)
    } else {
        if holders::children(h) == holders::SPILL {
            ws.big_children.remove(&key);
        }
        holders::with_children(h, c)
    }
}

#[inline]
fn lookup_rec(writer: &Writer, w: usize, h: u64) -> Option<Rec> {
    let ws = writer.workers.get(w)?.as_ref()?;
    if !ws.overrides.is_empty()
        && let Some(r) = ws.overrides.get(&h)
    {
        return Some(*r);
    }
    writer.engine.get(&h).copied()
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

impl KvIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Self {
        let shards = config.shards.clamp(1, 65_536).next_power_of_two();
        let max_workers = config.max_workers.clamp(1, holders::MAX_WORKERS);
        let fanout = config.fanout.clamp(2, 32);
        let segment = config.segment.clamp(1, 1 << 20).next_power_of_two();
        let config = IndexConfig {
            shards,
            segment,
            max_workers,
            fanout,
            ..config
        };
        KvIndex {
            shards: (0..shards).map(|_| PaddedShard::default()).collect(),
            shard_mask: shards as u64 - 1,
            seg_shift: segment.trailing_zeros(),
            flags: (0..config.max_workers).map(|_| AtomicU8::new(0)).collect(),
            entries: AtomicU64::new(0),
            keys: AtomicU64::new(0),
            heap_words: AtomicU64::new(0),
            writer: Mutex::new(Writer::default()),
            config,
        }
    }

    /// The settings in effect (shards and segment rounded).
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Segments grow geometrically: `[0, B)`, `[B, 2B)`, `[2B, 4B)`, …
    /// (B = `config.segment`), so a lookup of n blocks touches at most
    /// log₂(n/B) + 2 segments.
    #[inline]
    fn seg_of(&self, pos: u32) -> usize {
        if pos >> self.seg_shift == 0 {
            0
        } else {
            (pos.ilog2() - self.seg_shift) as usize + 1
        }
    }

    #[inline]
    fn seg_start(&self, seg: usize) -> u32 {
        if seg == 0 {
            0
        } else {
            1u32.checked_shl(self.seg_shift + seg as u32 - 1)
                .unwrap_or(u32::MAX)
        }
    }

    #[inline]
    fn seg_start_at(&self, pos: u32) -> bool {
        pos == 0 || (pos >> self.seg_shift != 0 && pos.is_power_of_two())
    }

    #[inline]
    fn shard_of(&self, key: u64) -> u16 {
        ((key >> 32) & self.shard_mask) as u16
    }

    // ----- workers -------------------------------------------------------

    /// Registers a worker with its block width (the worker set's
    /// `kvBlockSize`), or returns its id if already registered. Registering
    /// again with another width clears its blocks.
    ///
    /// # Errors
    /// [`IndexError::ZeroBlockSize`], [`IndexError::TooManyWorkers`].
    pub fn register_worker(
        &self,
        worker: WorkerRef,
        block_size: u32,
    ) -> Result<WorkerId, IndexError> {
        if block_size == 0 {
            return Err(IndexError::ZeroBlockSize);
        }
        let mut wr = lock(&self.writer);
        if let Some(&id) = wr.by_ref.get(&worker) {
            let same = wr.workers[id as usize]
                .as_ref()
                .is_some_and(|s| s.block_size == block_size);
            if !same {
                self.clear_locked(&mut wr, id as usize);
                if let Some(ws) = wr.workers[id as usize].as_mut() {
                    ws.block_size = block_size;
                    ws.stats.block_size = block_size;
                }
            }
            return Ok(WorkerId(id));
        }
        let id = if let Some(id) = wr.free_ids.pop() {
            id
        } else {
            let id = wr.workers.len() as u32;
            if id >= self.config.max_workers {
                return Err(IndexError::TooManyWorkers(self.config.max_workers));
            }
            wr.workers.push(None);
            id
        };
        wr.workers[id as usize] = Some(WorkerState {
            stats: WorkerStats {
                worker: Some(worker.clone()),
                block_size,
                ..WorkerStats::default()
            },
            block_size,
            ..WorkerState::default()
        });
        wr.by_ref.insert(worker, id);
        self.flags[id as usize].store(0, Ordering::Relaxed);
        Ok(WorkerId(id))
    }

    /// The id of a registered worker.
    pub fn worker_id(&self, worker: &WorkerRef) -> Option<WorkerId> {
        lock(&self.writer).by_ref.get(worker).map(|&i| WorkerId(i))
    }

    /// Drops a worker and all its blocks (endpoint gone); its id may be
    /// reused. Returns whether it was registered. Cost: one pass over all
    /// keys (O(keys)).
    pub fn remove_worker(&self, id: WorkerId) -> bool {
        let mut wr = lock(&self.writer);
        let w = id.0 as usize;
        if wr.workers.get(w).is_none_or(Option::is_none) {
            return false;
        }
        self.clear_locked(&mut wr, w);
        if let Some(ws) = wr.workers[w].take()
            && let Some(r) = ws.stats.worker
        {
            wr.by_ref.remove(&r);
        }
        wr.free_ids.push(id.0);
        true
    }

    /// Drops all blocks of a worker but keeps it registered (engine
    /// restart, `AllBlocksCleared`, a sequence gap without replay). Cost:
    /// one pass over all keys.
    ///
    /// # Errors
    /// [`IndexError::UnknownWorker`].
    pub fn clear_worker(&self, id: WorkerId) -> Result<u64, IndexError> {
        let mut wr = lock(&self.writer);
        Self::check(&wr, id)?;
        Ok(self.clear_locked(&mut wr, id.0 as usize))
    }

    fn check(wr: &Writer, id: WorkerId) -> Result<(), IndexError> {
        match wr.workers.get(id.0 as usize) {
            Some(Some(_)) => Ok(()),
            _ => Err(IndexError::UnknownWorker(id.0)),
        }
    }

    fn clear_locked(&self, wr: &mut Writer, w: usize) -> u64 {
        let wid = w as u32;
        let mut removed = 0u64;
        let mut dead_keys: hashbrown::HashSet<u64, BuildHasherDefault<KeyHasher>> =
            hashbrown::HashSet::default();
        let mut heap_delta = 0isize;
        for s in &self.shards {
            let mut sh = write(&s.0);
            let mut dropped_keys = 0u64;
            sh.map.retain(|k, hs| {
                if let Some(i) = hs.find(wid) {
                    heap_delta += hs.remove(i);
                    removed += 1;
                    if hs.is_empty() {
                        dead_keys.insert(*k);
                        dropped_keys += 1;
                        return false;
                    }
                }
                true
            });
            if dropped_keys > 0 {
                Self::maybe_shrink(&mut sh.map);
            }
            self.keys.fetch_sub(dropped_keys, Ordering::Relaxed);
        }
        self.entries.fetch_sub(removed, Ordering::Relaxed);
        self.add_heap(heap_delta);
        if !dead_keys.is_empty() {
            wr.engine.retain(|_, r| !dead_keys.contains(&r.key));
            wr.multi
                .retain(|_, subs| subs.first().is_none_or(|r| !dead_keys.contains(&r.key)));
            wr.engine.shrink_to_fit();
            wr.multi.shrink_to_fit();
        }
        if let Some(ws) = wr.workers[w].as_mut() {
            ws.stats.blocks_held = 0;
            ws.stats.holes = 0;
            ws.stats.clears += 1;
            ws.no_gpu = 0;
            ws.orphan_parents = HashMap::default();
            ws.big_children = HashMap::default();
            ws.overrides = HashMap::default();
        }
        self.flags[w].store(0, Ordering::Relaxed);
        removed
    }

    fn flush(&self, d: &Delta) {
        for (ctr, v) in [
            (&self.entries, d.entries),
            (&self.keys, d.keys),
            (&self.heap_words, d.heap as i64),
        ] {
            if v > 0 {
                ctr.fetch_add(v as u64, Ordering::Relaxed);
            } else if v < 0 {
                ctr.fetch_sub(v.unsigned_abs(), Ordering::Relaxed);
            }
        }
    }

    fn add_heap(&self, delta: isize) {
        if delta >= 0 {
            self.heap_words.fetch_add(delta as u64, Ordering::Relaxed);
        } else {
            self.heap_words
                .fetch_sub(delta.unsigned_abs() as u64, Ordering::Relaxed);
        }
    }

    fn maybe_shrink<V>(map: &mut KeyMap<V>) {
        if map.capacity() > 64 && map.len() * 4 < map.capacity() {
            map.shrink_to(map.len() * 2);
        }
    }

    fn publish_flags(&self, w: usize, ws: &WorkerState) {
        let mut f = 0;
        if ws.stats.holes > 0 {
            f |= FLAG_HOLES;
        }
        if ws.no_gpu > 0 {
            f |= FLAG_NO_GPU;
        }
        self.flags[w].store(f, Ordering::Release);
    }

    /// Counters of one worker.
    pub fn worker_stats(&self, id: WorkerId) -> Option<WorkerStats> {
        let wr = lock(&self.writer);
        wr.workers
            .get(id.0 as usize)?
            .as_ref()
            .map(|s| s.stats.clone())
    }

    /// Every block key `id` holds (in any tier), sorted: what the index
    /// believes the worker has cached, for audits against the engine's own
    /// view (the router's `/debug/kv`, the reliability suite). One pass over
    /// every shard under its read lock: O(keys), not for the request path.
    pub fn worker_keys(&self, id: WorkerId) -> Vec<BlockKey> {
        let mut out = Vec::new();
        for s in &self.shards {
            let sh = read(&s.0);
            out.extend(
                sh.map
                    .iter()
                    .filter(|(_, hs)| hs.find(id.0).is_some())
                    .map(|(k, _)| BlockKey(*k)),
            );
        }
        out.sort_unstable();
        out
    }

    /// Ids of all registered workers.
    pub fn workers(&self) -> Vec<(WorkerId, WorkerRef)> {
        let wr = lock(&self.writer);
        let mut v: Vec<_> = wr
            .by_ref
            .iter()
            .map(|(r, &i)| (WorkerId(i), r.clone()))
            .collect();
        v.sort();
        v
    }

    /// Size figures. `bytes` is computed from table capacities (O(shards)).
    pub fn stats(&self) -> IndexStats {
        let wr = lock(&self.writer);
        let slot = std::mem::size_of::<(u64, Holders)>() as u64 + 1;
        let mut bytes = self.heap_words.load(Ordering::Relaxed) * 4;
        for s in &self.shards {
            bytes += read(&s.0).map.capacity() as u64 * slot;
        }
        let rec_slot = std::mem::size_of::<(u64, Rec)>() as u64 + 1;
        bytes += wr.engine.capacity() as u64 * rec_slot;
        for (_, m) in &wr.multi {
            bytes += m.len() as u64 * std::mem::size_of::<Rec>() as u64;
        }
        bytes += wr.multi.capacity() as u64 * (std::mem::size_of::<(u64, Box<[Rec]>)>() as u64 + 1);
        for ws in wr.workers.iter().flatten() {
            bytes += ws.overrides.capacity() as u64 * rec_slot
                + ws.orphan_parents.capacity() as u64 * 13;
        }
        IndexStats {
            entries: self.entries.load(Ordering::Relaxed),
            keys: self.keys.load(Ordering::Relaxed),
            engine_records: wr.engine.len() as u64,
            workers: wr.by_ref.len() as u64,
            bytes,
            evictions: wr.evictions,
        }
    }

    /// (block, worker) entries held now.
    pub fn entries(&self) -> u64 {
        self.entries.load(Ordering::Relaxed)
    }

    // ----- events --------------------------------------------------------

    /// Applies every event of a batch for one worker.
    ///
    /// # Errors
    /// [`IndexError::UnknownWorker`].
    pub fn apply_batch(&self, id: WorkerId, batch: &EventBatch) -> Result<Applied, IndexError> {
        let mut total = Applied::default();
        for ev in &batch.events {
            total += self.apply_event(id, ev)?;
        }
        Ok(total)
    }

    /// Applies one event for one worker. `BlockStored` with token ids is
    /// keyed with [`key::chain`] at the worker's width (re-chunked when the
    /// event's width is a multiple of it); without token ids it is a tier
    /// update for hashes the worker holds. See the crate docs for what is
    /// dropped and counted.
    ///
    /// # Errors
    /// [`IndexError::UnknownWorker`].
    pub fn apply_event(&self, id: WorkerId, ev: &KvEvent) -> Result<Applied, IndexError> {
        let mut wr = lock(&self.writer);
        Self::check(&wr, id)?;
        let w = id.0 as usize;
        Ok(match ev {
            KvEvent::BlockStored(s) => self.apply_stored(&mut wr, w, s),
            KvEvent::BlockRemoved(r) => {
                let n = r.block_hashes.len() as u64;
                let ws = wr.workers[w].as_mut().expect("checked");
                if r.group_idx.unwrap_or(0) != self.config.group {
                    ws.stats.other_group_blocks += n;
                    return Ok(Applied {
                        dropped: n,
                        ..Applied::default()
                    });
                }
                if r.locality.as_deref() == Some("REMOTE") {
                    ws.stats.remote_blocks += n;
                    return Ok(Applied {
                        dropped: n,
                        ..Applied::default()
                    });
                }
                let tier = Tier::from_medium(r.medium.as_deref());
                let removed = self.remove_locked(
                    &mut wr,
                    w,
                    r.block_hashes.iter().map(crate::event::BlockHash::id),
                    tier,
                );
                Applied {
                    removed,
                    ..Applied::default()
                }
            }
            KvEvent::AllBlocksCleared => {
                let removed = self.clear_locked(&mut wr, w);
                Applied {
                    removed,
                    cleared: true,
                    ..Applied::default()
                }
            }
        })
    }

    fn apply_stored(&self, wr: &mut Writer, w: usize, s: &BlockStored) -> Applied {
        let n = s.block_hashes.len() as u64;
        let group = s.group_idx.unwrap_or(0);
        let ws = wr.workers[w].as_mut().expect("checked");
        if s.block_size > 0
            && !ws.stats.observed_widths.contains(&(group, s.block_size))
            && ws.stats.observed_widths.len() < 16
        {
            ws.stats.observed_widths.push((group, s.block_size));
        }
        let dropped = Applied {
            dropped: n,
            ..Applied::default()
        };
        if group != self.config.group {
            ws.stats.other_group_blocks += n;
            return dropped;
        }
        if s.locality.as_deref() == Some("REMOTE") {
            ws.stats.remote_blocks += n;
            return dropped;
        }
        let tier = Tier::from_medium(s.medium.as_deref());
        if s.token_ids.is_empty() {
            // Placeholder: a tier update for hashes already held.
            let mut t = 0;
            for h in &s.block_hashes {
                if self.add_tier_locked(wr, w, h.id(), tier) {
                    t += 1;
                }
            }
            let ws = wr.workers[w].as_mut().expect("checked");
            ws.stats.unknown_placeholders += n - t;
            return Applied::default();
        }
        let width = ws.block_size;
        let bs = s.block_size;
        if bs == 0 || !bs.is_multiple_of(width) || s.token_ids.len() as u64 != u64::from(bs) * n {
            ws.stats.width_mismatch_blocks += n;
            return dropped;
        }
        let k = (bs / width) as usize;
        if k > 1 {
            ws.stats.rechunked_blocks += n;
        }
        // Most events carry no extra keys (vLLM sends a list of nils).
        let plain = s.cache_salt.is_none()
            && s.extra_keys
                .as_ref()
                .is_none_or(|l| l.iter().all(Option::is_none));
        let extras = if plain {
            Vec::new()
        } else {
            key::event_extra_digests(s)
        };
        let seed = key::seed_for_event(s);
        let mut locals = std::mem::take(&mut wr.locals);
        locals.clear();
        for (i, chunk) in s.token_ids.chunks_exact(width as usize).enumerate() {
            locals.push(key::local_hash(
                chunk,
                extras.get(i / k).copied().unwrap_or(0),
            ));
        }
        let hashes: SmallVec<[u64; 64]> = s
            .block_hashes
            .iter()
            .map(crate::event::BlockHash::id)
            .collect();
        let parent = s
            .parent_block_hash
            .as_ref()
            .map(crate::event::BlockHash::id);
        let out = self.store_locked(wr, w, parent, seed, &hashes, &locals, k, tier);
        wr.locals = locals;
        out
    }

    /// Stores blocks for a worker from already-computed content hashes:
    /// `locals[i]` is [`key::local_hash`] of block i's tokens (what the
    /// index computes from `token_ids`), `hashes[i]` the engine's id of
    /// block i, `parent` the engine id of the block before the first
    /// (`None`: the chain starts here, from `seed`, see
    /// [`key::seed_for_lora`]). This is the path events take after
    /// decoding and hashing; benchmarks and tests call it directly.
    ///
    /// # Errors
    /// [`IndexError::UnknownWorker`].
    pub fn store_hashed(
        &self,
        id: WorkerId,
        parent: Option<u64>,
        seed: u64,
        hashes: &[u64],
        locals: &[u64],
        tier: Tier,
    ) -> Result<Applied, IndexError> {
        let mut wr = lock(&self.writer);
        Self::check(&wr, id)?;
        let n = hashes.len().min(locals.len());
        Ok(self.store_locked(
            &mut wr,
            id.0 as usize,
            parent,
            seed,
            &hashes[..n],
            &locals[..n],
            1,
            tier,
        ))
    }

    /// Removes blocks of a worker from one tier by engine id (the
    /// `BlockRemoved` path after decoding). Returns entries removed.
    ///
    /// # Errors
    /// [`IndexError::UnknownWorker`].
    pub fn remove_hashed(
        &self,
        id: WorkerId,
        hashes: &[u64],
        tier: Tier,
    ) -> Result<u64, IndexError> {
        let mut wr = lock(&self.writer);
        Self::check(&wr, id)?;
        Ok(self.remove_locked(&mut wr, id.0 as usize, hashes.iter().copied(), tier))
    }

    /// `k` locals per engine hash (re-chunking when k > 1).
    #[allow(clippy::too_many_arguments)]
    #[allow(clippy::many_single_char_names)] // w, r, h, d, k: worker, record, holder, delta, width
    fn store_locked(
        &self,
        wr: &mut Writer,
        w: usize,
        parent: Option<u64>,
        seed: u64,
        hashes: &[u64],
        locals: &[u64],
        k: usize,
        tier: Tier,
    ) -> Applied {
        let n = hashes.len() as u64;
        let (mut prev_key, mut pos, mut prev_shard) = (seed, 0u32, 0u16);
        if let Some(p) = parent {
            let Some(r) = lookup_rec(wr, w, p) else {
                let ws = wr.workers[w].as_mut().expect("checked");
                ws.stats.orphan_blocks += n;
                return Applied {
                    dropped: n,
                    ..Applied::default()
                };
            };
            (prev_key, pos, prev_shard) = (r.key, r.pos + 1, r.shard);
        }
        // Budget: clear the largest worker first if this store could pass it.
        if self.entries.load(Ordering::Relaxed) + locals.len() as u64 > self.config.max_entries {
            self.evict_largest(wr);
        }
        // Touch every hash's slot first: independent probes whose misses
        // overlap, so the dependent inserts below find them in cache.
        let mut seen = 0usize;
        for h in hashes {
            seen += usize::from(wr.engine.contains_key(h));
        }
        std::hint::black_box(seen);
        let mut recs = std::mem::take(&mut wr.scratch);
        recs.clear();
        for (i, h) in hashes.iter().enumerate() {
            let mut subs: SmallVec<[Rec; 4]> = SmallVec::new();
            for local in &locals[i * k..(i + 1) * k] {
                let key = key::chain(prev_key, *local).0;
                let shard = if self.seg_start_at(pos) {
                    self.shard_of(key)
                } else {
                    prev_shard
                };
                subs.push(Rec {
                    key,
                    parent_key: prev_key,
                    pos,
                    shard,
                    parent_shard: prev_shard,
                });
                prev_key = key;
                prev_shard = shard;
                pos = pos.saturating_add(1);
            }
            let last = *subs.last().expect("k >= 1");
            // Record engine hash → block (shared when workers agree).
            match wr.engine.entry(*h) {
                hashbrown::hash_map::Entry::Vacant(v) => {
                    v.insert(last);
                }
                hashbrown::hash_map::Entry::Occupied(o) => {
                    if *o.get() != last {
                        let ws = wr.workers[w].as_mut().expect("checked");
                        ws.overrides.insert(*h, last);
                    }
                }
            }
            if k > 1 {
                wr.multi.insert(*h, subs[..k - 1].iter().copied().collect());
            }
            for r in subs {
                recs.push((*h, r));
            }
        }
        let mut stored = 0u64;
        let mut delta = Delta::default();
        let mut i = 0;
        while i < recs.len() {
            let shard = recs[i].1.shard;
            let mut j = i + 1;
            while j < recs.len() && recs[j].1.shard == shard {
                j += 1;
            }
            // The parent of the run's first block may live in another shard:
            // account for it after this shard's lock is released.
            let first = recs[i].1;
            let external = first.pos > 0 && first.parent_shard != shard;
            let mut sh = write(&self.shards[shard as usize].0);
            let ws = wr.workers[w].as_mut().expect("checked");
            // Tail first: each block learns whether its child (inserted
            // just before) is new, so parents need no second probe. Readers
            // see the run only as a whole (the shard is write-locked).
            let mut child_new = false;
            for (n_in_run, (_, r)) in recs[i..j].iter().enumerate().rev() {
                let parent = if r.pos == 0 {
                    Parent::Root
                } else if n_in_run > 0 {
                    Parent::InRun
                } else if external {
                    Parent::External
                } else {
                    Parent::Probe
                };
                child_new = Self::insert_holder(
                    &mut sh.map,
                    ws,
                    w as u32,
                    r,
                    tier,
                    parent,
                    u32::from(child_new),
                    &mut delta,
                );
                if child_new {
                    stored += 1;
                }
            }
            let first_new = child_new;
            drop(sh);
            let ws = wr.workers[w].as_mut().expect("checked");
            if external
                && first_new
                && !self.touch_parent(ws, w, first.parent_shard, first.parent_key, 1)
            {
                ws.stats.holes += 1;
                *ws.orphan_parents.entry(first.parent_key).or_insert(0) += 1;
            }
            i = j;
        }
        self.flush(&delta);
        wr.scratch = recs;
        let ws = wr.workers[w].as_mut().expect("checked");
        ws.stats.stored_blocks += stored;
        self.publish_flags(w, ws);
        Applied {
            stored,
            ..Applied::default()
        }
    }

    /// For a new child in another shard: adjusts the parent's child count
    /// by `delta` if the worker holds it; returns whether it does.
    fn touch_parent(
        &self,
        ws: &mut WorkerState,
        w: usize,
        shard: u16,
        parent_key: u64,
        delta: i32,
    ) -> bool {
        let mut sh = write(&self.shards[shard as usize].0);
        if let Some(hs) = sh.map.get_mut(&parent_key)
            && let Some(i) = hs.find(w as u32)
        {
            let h = hs.as_slice()[i];
            let c = (i64::from(children_of(ws, parent_key, h)) + i64::from(delta)).max(0) as u32;
            hs.set(i, with_children_count(ws, parent_key, h, c));
            return true;
        }
        false
    }

    /// Inserts or updates `(r.key, w)`; returns whether the entry is new.
    /// `new_children`: new entries of this worker whose parent this block
    /// is (inserted just before). `parent` says who accounts for the parent.
    #[allow(clippy::too_many_arguments)]
    #[allow(clippy::many_single_char_names)] // w, r, h, d, k: worker, record, holder, delta, width
    fn insert_holder(
        map: &mut KeyMap<Holders>,
        ws: &mut WorkerState,
        w: u32,
        r: &Rec,
        tier: Tier,
        parent: Parent,
        new_children: u32,
        d: &mut Delta,
    ) -> bool {
        let bit = tier.bit();
        let gpu = Tier::Gpu.bit();
        let new_holder = |ws: &mut WorkerState| {
            let children = new_children
                + if ws.orphan_parents.is_empty() {
                    0
                } else {
                    ws.orphan_parents.remove(&r.key).unwrap_or(0)
                };
            ws.stats.holes -= u64::from(children - new_children);
            with_children_count(ws, r.key, holders::pack(w, bit, 0), children)
        };
        match map.entry(r.key) {
            hashbrown::hash_map::Entry::Vacant(v) => {
                // A new key: write its bucket once, never read it back (the
                // bucket is usually not in cache yet).
                d.keys += 1;
                let packed = new_holder(ws);
                v.insert(Holders::one(packed));
            }
            hashbrown::hash_map::Entry::Occupied(mut o) => {
                let hs = o.get_mut();
                if let Some(i) = hs.find(w) {
                    let mut h = hs.as_slice()[i];
                    let t = holders::tiers(h);
                    if t & bit == 0 {
                        h = holders::with_tiers(h, t | bit);
                        if t & gpu == 0 && bit == gpu {
                            ws.no_gpu -= 1;
                        }
                    }
                    if new_children > 0 {
                        let c = children_of(ws, r.key, h) + new_children;
                        h = with_children_count(ws, r.key, h, c);
                    }
                    hs.set(i, h);
                    return false;
                }
                let packed = new_holder(ws);
                d.heap += hs.insert(packed);
            }
        }
        d.entries += 1;
        ws.stats.blocks_held += 1;
        if bit != gpu {
            ws.no_gpu += 1;
        }
        if parent == Parent::Probe {
            let held = if let Some(ph) = map.get_mut(&r.parent_key)
                && let Some(i) = ph.find(w)
            {
                let h = ph.as_slice()[i];
                let c = children_of(ws, r.parent_key, h) + 1;
                ph.set(i, with_children_count(ws, r.parent_key, h, c));
                true
            } else {
                false
            };
            if !held {
                ws.stats.holes += 1;
                *ws.orphan_parents.entry(r.parent_key).or_insert(0) += 1;
            }
        }
        true
    }

    /// Adds a tier to a block the worker holds (placeholder stores).
    #[allow(clippy::many_single_char_names)]
    fn add_tier_locked(&self, wr: &mut Writer, w: usize, h: u64, tier: Tier) -> bool {
        let Some(r) = lookup_rec(wr, w, h) else {
            return false;
        };
        let mut sh = write(&self.shards[r.shard as usize].0);
        let ws = wr.workers[w].as_mut().expect("checked");
        let Some(hs) = sh.map.get_mut(&r.key) else {
            return false;
        };
        let Some(i) = hs.find(w as u32) else {
            return false;
        };
        let x = hs.as_slice()[i];
        let t = holders::tiers(x);
        if t & tier.bit() == 0 {
            hs.set(i, holders::with_tiers(x, t | tier.bit()));
            if t & Tier::Gpu.bit() == 0 && tier == Tier::Gpu {
                ws.no_gpu -= 1;
            }
        }
        drop(sh);
        self.publish_flags(w, ws);
        true
    }

    fn remove_locked(
        &self,
        wr: &mut Writer,
        w: usize,
        hashes: impl Iterator<Item = u64>,
        tier: Tier,
    ) -> u64 {
        let mut removed = 0;
        let mut delta = Delta::default();
        // The write guard of the shard last touched, kept across blocks.
        let mut cur: Option<(u16, RwLockWriteGuard<'_, Shard>)> = None;
        // All record lookups first: independent probes whose cache misses
        // overlap (the shard locks below would serialize them).
        let found: SmallVec<[(u64, Option<Rec>); 32]> =
            hashes.map(|h| (h, lookup_rec(wr, w, h))).collect();
        // Then touch every block's slot and holders under one read lock per
        // shard run, so those misses overlap too (the removal loop below
        // works on dependent data and would take them one by one).
        let mut i = 0;
        while i < found.len() {
            let Some(shard) = found[i].1.map(|r| r.shard) else {
                i += 1;
                continue;
            };
            let sh = read(&self.shards[shard as usize].0);
            let mut acc = 0u32;
            while i < found.len() && found[i].1.is_some_and(|r| r.shard == shard) {
                if let Some(r) = found[i].1
                    && let Some(hs) = sh.map.get(&r.key)
                {
                    acc ^= hs.as_slice().first().copied().unwrap_or(0);
                }
                i += 1;
            }
            std::hint::black_box(acc);
        }
        for (h, rec) in found {
            let Some(last) = rec else {
                wr.workers[w]
                    .as_mut()
                    .expect("checked")
                    .stats
                    .unknown_removals += 1;
                continue;
            };
            let mut all: SmallVec<[Rec; 4]> = SmallVec::new();
            if !wr.multi.is_empty()
                && let Some(s) = wr.multi.get(&h)
            {
                all.extend(s.iter().copied());
            }
            all.push(last);
            let mut any = false;
            let mut key_died = false;
            // Tail first, so no transient holes.
            for r in all.iter().rev() {
                match self.remove_holder(wr, w, r, tier, &mut cur, &mut delta) {
                    Removal::NotHeld => {}
                    Removal::TierOnly => any = true,
                    Removal::Removed { key_died: d } => {
                        any = true;
                        removed += 1;
                        key_died |= d && r.key == last.key;
                    }
                }
            }
            let ws = wr.workers[w].as_mut().expect("checked");
            if !any {
                ws.stats.unknown_removals += 1;
            }
            if key_died {
                if ws.overrides.is_empty() || ws.overrides.remove(&h).is_none() {
                    wr.engine.remove(&h);
                    if !wr.multi.is_empty() {
                        wr.multi.remove(&h);
                    }
                    if wr.engine.capacity() > 1024 && wr.engine.len() * 4 < wr.engine.capacity() {
                        wr.engine.shrink_to(wr.engine.len() * 2);
                    }
                }
            } else if !any && !ws.overrides.is_empty() {
                // Not held by this worker: forget its private record.
                ws.overrides.remove(&h);
            }
        }
        drop(cur);
        self.flush(&delta);
        let ws = wr.workers[w].as_mut().expect("checked");
        ws.stats.removed_blocks += removed;
        self.publish_flags(w, ws);
        removed
    }

    #[allow(clippy::many_single_char_names)] // w, r, h, d, k: worker, record, holder, delta, width
    fn remove_holder<'a>(
        &'a self,
        wr: &mut Writer,
        w: usize,
        r: &Rec,
        tier: Tier,
        cur: &mut Option<(u16, RwLockWriteGuard<'a, Shard>)>,
        d: &mut Delta,
    ) -> Removal {
        let wid = w as u32;
        let gpu = Tier::Gpu.bit();
        if cur.as_ref().is_none_or(|(s, _)| *s != r.shard) {
            *cur = None;
            *cur = Some((r.shard, write(&self.shards[r.shard as usize].0)));
        }
        let Some((_, sh)) = cur.as_mut() else {
            return Removal::NotHeld;
        };
        let ws = wr.workers[w].as_mut().expect("checked");
        let Some(hs) = sh.map.get_mut(&r.key) else {
            return Removal::NotHeld;
        };
        let Some(i) = hs.find(wid) else {
            return Removal::NotHeld;
        };
        let h = hs.as_slice()[i];
        let t = holders::tiers(h);
        let rest = t & !tier.bit();
        if t & tier.bit() == 0 {
            return Removal::NotHeld;
        }
        if rest != 0 {
            hs.set(i, holders::with_tiers(h, rest));
            if t & gpu != 0 && rest & gpu == 0 {
                ws.no_gpu += 1;
            }
            return Removal::TierOnly;
        }
        d.heap += hs.remove(i);
        let key_died = hs.is_empty();
        if key_died {
            sh.map.remove(&r.key);
            d.keys -= 1;
            Self::maybe_shrink(&mut sh.map);
        }
        d.entries -= 1;
        ws.stats.blocks_held -= 1;
        if t & gpu == 0 {
            ws.no_gpu -= 1;
        }
        let c = children_of(ws, r.key, h);
        if holders::children(h) == holders::SPILL {
            ws.big_children.remove(&r.key);
        }
        if c > 0 {
            ws.stats.holes += u64::from(c);
            *ws.orphan_parents.entry(r.key).or_insert(0) += c;
        }
        if r.pos > 0 {
            let held = if r.parent_shard == r.shard {
                if let Some(ph) = sh.map.get_mut(&r.parent_key)
                    && let Some(j) = ph.find(wid)
                {
                    let x = ph.as_slice()[j];
                    let c = children_of(ws, r.parent_key, x).saturating_sub(1);
                    ph.set(j, with_children_count(ws, r.parent_key, x, c));
                    true
                } else {
                    false
                }
            } else {
                *cur = None;
                self.touch_parent(ws, w, r.parent_shard, r.parent_key, -1)
            };
            if !held {
                let ws = wr.workers[w].as_mut().expect("checked");
                ws.stats.holes = ws.stats.holes.saturating_sub(1);
                if let hashbrown::hash_map::Entry::Occupied(mut o) =
                    ws.orphan_parents.entry(r.parent_key)
                {
                    *o.get_mut() -= 1;
                    if *o.get() == 0 {
                        o.remove();
                    }
                }
            }
        }
        Removal::Removed { key_died }
    }

    fn evict_largest(&self, wr: &mut Writer) {
        let victim = wr
            .workers
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (s.stats.blocks_held, i)))
            .max();
        if let Some((held, w)) = victim
            && held > 0
        {
            tracing::warn!(
                worker = w,
                held,
                budget = self.config.max_entries,
                "kv index over budget: clearing the largest worker"
            );
            self.clear_locked(wr, w);
            wr.evictions += 1;
        }
    }

    // ----- lookups -------------------------------------------------------

    /// For each worker, how many leading blocks of `keys` it holds (any
    /// tier, and on the GPU). Workers holding none are left out.
    pub fn find_matches(&self, keys: &[BlockKey]) -> Matches {
        let mut m = Matches::default();
        self.find_matches_into(keys, &mut m);
        m
    }

    /// Like [`find_matches`](Self::find_matches), reusing `out`'s buffers.
    #[allow(clippy::many_single_char_names)] // w, r, h, d, k: worker, record, holder, delta, width
    pub fn find_matches_into(&self, keys: &[BlockKey], out: &mut Matches) {
        out.items.clear();
        out.cand.clear();
        let n = keys.len() as u32;
        if n == 0 {
            return;
        }
        let mut guards: Guards<'_> = SmallVec::new();
        let mut seg_slot: SmallVec<[u16; 16]> = SmallVec::new();
        let nseg = self.seg_of(n - 1) + 1;
        seg_slot.resize(nseg, u16::MAX);

        // Multi-way search for each worker's last held position. Workers
        // with the same bracket (known held at lo, not held at hi) share
        // probes; all open brackets (up to MAX_BRACKETS) are probed in the
        // same round, and probes of one round are independent, so their
        // cache misses overlap.
        let mut points = std::mem::take(&mut out.points);
        // (lo, hi, first point, end point) per bracket of this round.
        let mut brackets: SmallVec<[(u32, u32, usize, usize); MAX_BRACKETS]> = SmallVec::new();
        let mut first = true;
        loop {
            points.clear();
            brackets.clear();
            if first {
                // Round 1: the first and the last block only. A full match
                // (or none) is then settled with two parallel probes.
                if n > 1 {
                    points.push(n - 1);
                }
                brackets.push((0, n, 0, points.len()));
            } else {
                for c in &mut out.cand {
                    c.bracket = u8::MAX;
                    if c.hi - c.lo <= 1 {
                        continue;
                    }
                    if let Some(b) = brackets.iter().position(|b| b.0 == c.lo && b.1 == c.hi) {
                        c.bracket = b as u8;
                    } else if brackets.len() < MAX_BRACKETS {
                        let (lo, hi) = (c.lo, c.hi);
                        let start = points.len();
                        let span = hi - lo - 1;
                        let fanout = self.config.fanout;
                        if span <= fanout {
                            points.extend(lo + 1..hi);
                        } else {
                            for j in 1..=fanout {
                                points.push(lo + (span * j).div_ceil(fanout));
                            }
                            // Segment starts inside the bracket too: they
                            // make the search exponential from the front
                            // (segments double) at no extra lock.
                            let mut seg = self.seg_of(lo) + 1;
                            while self.seg_start(seg) < hi {
                                points.push(self.seg_start(seg));
                                seg += 1;
                            }
                            points[start..].sort_unstable();
                            let mut w = start;
                            for r in start..points.len() {
                                if w == start || points[r] != points[w - 1] {
                                    points[w] = points[r];
                                    w += 1;
                                }
                            }
                            points.truncate(w);
                        }
                        c.bracket = brackets.len() as u8;
                        brackets.push((lo, hi, start, points.len()));
                    }
                }
                if brackets.is_empty() {
                    break;
                }
            }
            if first {
                self.ensure(keys, 0, &mut guards, &mut seg_slot);
            }
            for &p in &points {
                self.ensure(keys, p, &mut guards, &mut seg_slot);
            }
            let h0 = if first {
                self.probe(keys, 0, &guards, &seg_slot)
            } else {
                None
            };
            let mut found: SmallVec<[Option<&Holders>; 32]> = SmallVec::new();
            for &p in &points {
                found.push(self.probe(keys, p, &guards, &seg_slot));
            }
            if first {
                let Some(h0) = h0 else {
                    out.points = points;
                    return;
                };
                for h in h0.as_slice() {
                    out.cand.push(Cand {
                        worker: holders::worker(*h),
                        lo: 0,
                        hi: n,
                        open: false,
                        bracket: 0,
                    });
                }
                first = false;
            }
            // Per bracket, highest point first: a candidate stops at its
            // first hit. Candidates and holders are both sorted by worker
            // id, so each point costs one merge walk.
            for (b, &(_, _, start, end)) in brackets.iter().enumerate() {
                let mut open = 0usize;
                for c in &mut out.cand {
                    c.open = usize::from(c.bracket) == b;
                    open += usize::from(c.open);
                }
                for idx in (start..end).rev() {
                    if open == 0 {
                        break;
                    }
                    let p = points[idx];
                    let Some(hs) = found[idx].map(Holders::as_slice) else {
                        // Nobody holds this block: every open candidate ends below.
                        for c in out.cand.iter_mut().filter(|c| c.open) {
                            c.hi = p;
                        }
                        continue;
                    };
                    // Fast path: the same workers as at position 0 (the
                    // usual case inside a shared prefix) hold it all.
                    if hs.len() == out.cand.len()
                        && hs
                            .iter()
                            .zip(&out.cand)
                            .all(|(h, c)| holders::worker(*h) == c.worker)
                    {
                        for c in out.cand.iter_mut().filter(|c| c.open) {
                            c.lo = p;
                            c.open = false;
                        }
                        open = 0;
                        continue;
                    }
                    let mut k = 0;
                    for c in out.cand.iter_mut().filter(|c| c.open) {
                        while k < hs.len() && holders::worker(hs[k]) < c.worker {
                            k += 1;
                        }
                        if k < hs.len() && holders::worker(hs[k]) == c.worker {
                            c.lo = p;
                            c.open = false;
                            open -= 1;
                        } else {
                            c.hi = p;
                        }
                    }
                }
            }
        }
        out.points = points;
        // Exact answers for workers with holes or non-GPU entries.
        for c in &out.cand {
            let flags = self
                .flags
                .get(c.worker as usize)
                .map_or(0, |f| f.load(Ordering::Acquire));
            let mut blocks = c.lo + 1;
            if flags & FLAG_HOLES != 0 {
                blocks = n;
                for p in 1..n {
                    self.ensure(keys, p, &mut guards, &mut seg_slot);
                    if self
                        .probe(keys, p, &guards, &seg_slot)
                        .is_none_or(|hs| hs.find(c.worker).is_none())
                    {
                        blocks = p;
                        break;
                    }
                }
            }
            let mut gpu_blocks = blocks;
            if flags & FLAG_NO_GPU != 0 {
                gpu_blocks = blocks;
                for p in 0..blocks {
                    self.ensure(keys, p, &mut guards, &mut seg_slot);
                    let gpu = self
                        .probe(keys, p, &guards, &seg_slot)
                        .and_then(|hs| hs.get(c.worker))
                        .is_some_and(|h| holders::tiers(h) & Tier::Gpu.bit() != 0);
                    if !gpu {
                        gpu_blocks = p;
                        break;
                    }
                }
            }
            out.items.push(WorkerMatch {
                worker: WorkerId(c.worker),
                blocks,
                gpu_blocks,
            });
        }
    }

    fn ensure<'a>(
        &'a self,
        keys: &[BlockKey],
        pos: u32,
        guards: &mut Guards<'a>,
        seg_slot: &mut [u16],
    ) {
        let seg = self.seg_of(pos);
        if seg_slot[seg] == u16::MAX {
            let anchor = keys[self.seg_start(seg) as usize].0;
            let shard = self.shard_of(anchor);
            let slot = if let Some(i) = guards.iter().position(|(s, _)| *s == shard) {
                i
            } else {
                guards.push((shard, read(&self.shards[shard as usize].0)));
                guards.len() - 1
            };
            seg_slot[seg] = slot as u16;
        }
    }

    #[inline]
    fn probe<'g>(
        &self,
        keys: &[BlockKey],
        pos: u32,
        guards: &'g Guards<'_>,
        seg_slot: &[u16],
    ) -> Option<&'g Holders> {
        let slot = seg_slot[self.seg_of(pos)];
        guards
            .get(usize::from(slot))?
            .1
            .map
            .get(&keys[pos as usize].0)
    }
}

type Guards<'a> = SmallVec<[(u16, RwLockReadGuard<'a, Shard>); 8]>;

/// Where a stored block's parent is, for child/hole accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parent {
    /// No parent (position 0).
    Root,
    /// The previous block of the same run: it accounts for this child.
    InRun,
    /// In another shard: the caller accounts after releasing this one.
    External,
    /// In this shard, outside the run: probe it.
    Probe,
}

/// Counter changes of one event, published with one atomic op each.
#[derive(Debug, Default)]
struct Delta {
    entries: i64,
    keys: i64,
    heap: isize,
}

enum Removal {
    NotHeld,
    TierOnly,
    Removed { key_died: bool },
}

#[cfg(test)]
mod tests;
