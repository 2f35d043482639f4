//! The KV-block index: which worker holds which block keys, per KV-cache
//! group and tier.
//!
//! See the crate docs for the data model, invariants and complexity. The
//! pieces: `tree` (nodes and coverage), `groups` (hybrid models' prefix
//! rule), `write` (events), `evict` (clears, trimming, the budget),
//! `lookup` ([`KvIndex::find_matches`]), `budget` (memory limits).

mod budget;
mod evict;
mod export;
mod groups;
mod lookup;
mod sessions;
mod tree;
mod write;

use std::collections::BinaryHeap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use hashbrown::HashMap;

use crate::key::BlockKey;
pub use budget::{BYTES_PER_ENTRY, max_entries_for_budget};
pub use export::Imported;
use groups::Group;
pub use lookup::{Matches, WorkerMatch};
pub use sessions::SessionHolder;
use sessions::Sessions;
use tree::{Cold, Hot, NodeMut};

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
    /// A snapshot has no worker at that index.
    #[error("the snapshot has no worker {0}")]
    SnapshotPart(usize),
    /// A snapshot's worker keys blocks at another width.
    #[error("the snapshot keys this worker's blocks at width {theirs}, this index at {ours}")]
    SnapshotWidth {
        /// This index's width for the worker.
        ours: u32,
        /// The snapshot's.
        theirs: u32,
    },
}

/// Index settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexConfig {
    /// Number of shards (rounded up to a power of two, 1..=4096). Each node
    /// of the block tree lives in the shard of its first key, behind that
    /// shard's lock.
    pub shards: usize,
    /// Budget: most (block, worker, group) entries held. When a store
    /// would pass it, the least recently stored tails of chains are
    /// evicted first (see the crate docs, "Memory budget");
    /// [`max_entries_for_budget`] turns bytes into entries.
    pub max_entries: u64,
    /// Most workers registered at once (at most 2²⁰).
    pub max_workers: u32,
    /// Most sessions remembered (`session_id` on stores; see
    /// [`KvIndex::session_holders`]); 0 turns the table off.
    pub max_sessions: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            shards: 1024,
            max_entries: 200_000_000,
            max_workers: 65_536,
            max_sessions: 1 << 16,
        }
    }
}

/// The kind of a KV-cache group, for [`KvIndex::set_worker_groups`] (the
/// events' `kv_cache_spec_kind` says the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupKind {
    /// Full attention (also MLA): a prefix needs every block.
    FullAttention,
    /// Sliding-window attention over `window` tokens: a prefix needs the
    /// blocks of the last window before its end.
    SlidingWindow {
        /// Window in tokens.
        window: u32,
    },
    /// Mamba / linear-attention state: a prefix needs the state cached at
    /// its end.
    State,
}

/// One KV-cache group of an engine's model, for
/// [`KvIndex::set_worker_groups`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupSpec {
    /// `group_idx` in the events.
    pub idx: u32,
    /// What the group's layers need.
    pub kind: GroupKind,
    /// Tokens per block of this group (a multiple of the worker's width).
    pub block_size: u32,
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

/// One shard: the nodes whose first key maps here.
#[derive(Debug, Default)]
struct Shard {
    /// First key of each node → the part of it lookups read.
    heads: KeyMap<Hot>,
    /// Slot → the rest of it.
    cold: Vec<Option<Cold>>,
    free: Vec<u32>,
    live: u32,
}

impl Shard {
    /// Both parts of the node in `slot`, if it is live.
    fn node_mut(&mut self, slot: usize) -> Option<NodeMut<'_>> {
        let Shard { heads, cold, .. } = self;
        let cold = cold.get_mut(slot)?.as_mut()?;
        let hot = heads.get_mut(&cold.first)?;
        Some(NodeMut { hot, cold })
    }

    /// The lookup part of the node in `slot`, if it is live.
    fn hot(&self, slot: usize) -> Option<&Hot> {
        let cold = self.cold.get(slot)?.as_ref()?;
        self.heads.get(&cold.first)
    }

    /// Both parts, read-only.
    fn node(&self, slot: usize) -> Option<(&Hot, &Cold)> {
        let cold = self.cold.get(slot)?.as_ref()?;
        Some((self.heads.get(&cold.first)?, cold))
    }
}

#[derive(Debug, Default)]
#[repr(align(128))]
struct PaddedShard(RwLock<Shard>);

/// Counters per worker.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// The worker.
    pub worker: Option<WorkerRef>,
    /// Configured block width (the worker set's `kvBlockSize`).
    pub block_size: u32,
    /// Entries held now: (block, group) pairs in any tier.
    pub blocks_held: u64,
    /// Block widths seen in `BlockStored` events, per KV-cache group:
    /// `(group, width)`, first seen first (for the block-size diagnosis).
    pub observed_widths: Vec<(u32, u32)>,
    /// KV-cache groups known for this worker (`group_idx` values), sorted.
    pub groups: Vec<u32>,
    /// Entries added by `BlockStored`.
    pub stored_blocks: u64,
    /// Entries removed by `BlockRemoved`.
    pub removed_blocks: u64,
    /// Stored blocks dropped because their parent was unknown.
    pub orphan_blocks: u64,
    /// Stored blocks dropped because their width was not a multiple of the
    /// configured width, or their tokens did not fill them.
    pub width_mismatch_blocks: u64,
    /// Stored blocks re-chunked from a wider event block (counted in
    /// event blocks).
    pub rechunked_blocks: u64,
    /// Blocks of events for groups that are not prefix-cached (encoder,
    /// cross attention): not indexed.
    pub other_group_blocks: u64,
    /// Blocks of events marked `locality: "REMOTE"` (not on this engine;
    /// not indexed).
    pub remote_blocks: u64,
    /// Placeholder stores (no tokens) for hashes this worker does not hold.
    pub unknown_placeholders: u64,
    /// Removals of hashes this worker does not hold.
    pub unknown_removals: u64,
    /// Times all of its blocks were dropped (clear, restart, gap).
    pub clears: u64,
    /// Entries of this worker dropped by the memory budget.
    pub evicted_blocks: u64,
    /// Entries added from a snapshot ([`KvIndex::import`]).
    pub imported_blocks: u64,
}

#[derive(Debug, Default)]
struct WorkerState {
    stats: WorkerStats,
    /// The last batch of its stream applied, when known
    /// ([`KvIndex::apply_batch_at`]); cleared with its blocks.
    position: Option<crate::snapshot::Position>,
    /// Tokens per key (the configured width).
    width: u32,
    /// Engine hashes this worker maps to a position whose recorded hash
    /// differs: hash → (handle, our key at it, for validation).
    overrides: EngineMap<(u64, u64)>,
    /// Its KV-cache groups, sorted by index.
    groups: Vec<Group>,
}

#[derive(Debug, Default)]
struct Writer {
    /// Engine hash → handle of its (last) position, shared by every worker
    /// whose hash for that position is the recorded one.
    engine: EngineMap<u64>,
    workers: Vec<Option<WorkerState>>,
    by_ref: std::collections::HashMap<WorkerRef, u32>,
    free_ids: Vec<u32>,
    /// Store counter (the index's notion of "recent"; no clock).
    stamp: u64,
    /// Eviction candidates: (stamp, node id), oldest first; stale entries
    /// are skipped when popped.
    lrs: BinaryHeap<std::cmp::Reverse<(u64, u32)>>,
    evictions: u64,
    evicted_entries: u64,
    keys: Vec<u64>,
    hashes: Vec<u64>,
}

/// Size figures of the whole index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// (block, worker, group) entries.
    pub entries: u64,
    /// Distinct block keys (chain positions in the tree).
    pub keys: u64,
    /// Nodes of the block tree.
    pub nodes: u64,
    /// Engine-hash records (shared between workers that agree).
    pub engine_records: u64,
    /// Registered workers.
    pub workers: u64,
    /// Estimated bytes owned by the index (tables at capacity, arrays).
    pub bytes: u64,
    /// Times the budget evicted (one per store that had to make room).
    pub evictions: u64,
    /// Entries the budget evicted in all.
    pub evicted_entries: u64,
    /// Sessions remembered ([`KvIndex::session_holders`]).
    pub sessions: u64,
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

/// Worker flag: the worker's prefix depends on several groups (or a
/// non-full-attention one), so lookups solve [`groups::usable_prefix`].
const FLAG_GROUPS: u8 = 1;
/// Most shards.
const MAX_SHARDS: usize = 4096;

/// The shared KV-block index. `Send + Sync`: share it in an `Arc`; any
/// number of threads may look up while others apply events.
#[derive(Debug)]
pub struct KvIndex {
    shards: Box<[PaddedShard]>,
    shard_bits: u32,
    shard_mask: u64,
    /// Per worker: [`FLAG_GROUPS`].
    flags: Box<[AtomicU8]>,
    /// Per worker: its groups, read by lookups of multi-group workers.
    profiles: RwLock<Vec<Vec<Group>>>,
    entries: AtomicU64,
    positions: AtomicU64,
    nodes: AtomicU64,
    writer: Mutex<Writer>,
    /// Written under `writer` (stores, clears); read by lookups.
    sessions: RwLock<Sessions>,
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

impl Default for KvIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

impl KvIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Self {
        let shards = config.shards.clamp(1, MAX_SHARDS).next_power_of_two();
        let max_workers = config.max_workers.clamp(1, 1 << 20);
        let config = IndexConfig {
            shards,
            max_workers,
            ..config
        };
        KvIndex {
            shards: (0..shards).map(|_| PaddedShard::default()).collect(),
            shard_bits: shards.trailing_zeros(),
            shard_mask: shards as u64 - 1,
            flags: (0..max_workers).map(|_| AtomicU8::new(0)).collect(),
            profiles: RwLock::new(Vec::new()),
            entries: AtomicU64::new(0),
            positions: AtomicU64::new(0),
            nodes: AtomicU64::new(0),
            writer: Mutex::new(Writer::default()),
            sessions: RwLock::new(Sessions::new(config.max_sessions)),
            config,
        }
    }

    /// The settings in effect (shards rounded).
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    #[inline]
    fn shard_of(&self, key: u64) -> usize {
        ((key >> 32) & self.shard_mask) as usize
    }

    #[inline]
    fn node_shard(&self, id: u32) -> usize {
        (u64::from(id) & self.shard_mask) as usize
    }

    #[inline]
    fn node_slot(&self, id: u32) -> usize {
        (id >> self.shard_bits) as usize
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
                .is_some_and(|s| s.width == block_size);
            if !same {
                self.clear_locked(&mut wr, id as usize);
                if let Some(ws) = wr.workers[id as usize].as_mut() {
                    ws.width = block_size;
                    ws.stats.block_size = block_size;
                    ws.groups.clear();
                }
                self.publish_groups(&wr, id as usize);
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
            width: block_size,
            ..WorkerState::default()
        });
        wr.by_ref.insert(worker, id);
        self.publish_groups(&wr, id as usize);
        Ok(WorkerId(id))
    }

    /// The id of a registered worker.
    pub fn worker_id(&self, worker: &WorkerRef) -> Option<WorkerId> {
        lock(&self.writer).by_ref.get(worker).map(|&i| WorkerId(i))
    }

    /// Declares a worker's KV-cache groups from the engine's configuration
    /// (what its events will also say, so this is optional): a lookup then
    /// needs every group from the start, before each group's first event.
    /// Groups seen in later events are added.
    ///
    /// # Errors
    /// [`IndexError::UnknownWorker`].
    pub fn set_worker_groups(&self, id: WorkerId, groups: &[GroupSpec]) -> Result<(), IndexError> {
        let mut wr = lock(&self.writer);
        Self::check(&wr, id)?;
        let ws = wr.workers[id.0 as usize].as_mut().expect("checked");
        let width = ws.width;
        ws.groups.clear();
        for g in groups {
            let (kind, window) = match g.kind {
                GroupKind::FullAttention => (groups::RuleKind::Full, None),
                GroupKind::SlidingWindow { window } => (groups::RuleKind::Window, Some(window)),
                GroupKind::State => (groups::RuleKind::State, None),
            };
            let keys = (g.block_size / width).max(1);
            let idx = u16::try_from(g.idx).unwrap_or(u16::MAX);
            ws.groups.push(Group::new(idx, kind, keys, window, width));
        }
        ws.groups.sort_by_key(|g| g.idx);
        ws.groups.dedup_by_key(|g| g.idx);
        ws.stats.groups = ws.groups.iter().map(|g| u32::from(g.idx)).collect();
        self.publish_groups(&wr, id.0 as usize);
        Ok(())
    }

    /// Makes a worker's groups visible to lookups.
    fn publish_groups(&self, wr: &Writer, w: usize) {
        let groups = wr.workers[w]
            .as_ref()
            .map(|ws| ws.groups.clone())
            .unwrap_or_default();
        let multi = groups.len() > 1
            || groups
                .iter()
                .any(|g| g.rule != groups::Rule::Full || g.align > 1);
        {
            let mut p = write(&self.profiles);
            if p.len() <= w {
                p.resize(w + 1, Vec::new());
            }
            p[w] = groups;
        }
        self.flags[w].store(if multi { FLAG_GROUPS } else { 0 }, Ordering::Release);
    }

    /// Drops a worker and all its blocks (endpoint gone); its id may be
    /// reused. Returns whether it was registered. Cost: one pass over the
    /// tree's nodes.
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
        self.publish_groups(&wr, w);
        true
    }

    /// Drops all blocks of a worker but keeps it registered (engine
    /// restart, `AllBlocksCleared`, a sequence gap without replay). Cost:
    /// one pass over the tree's nodes.
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

    /// Counters of one worker.
    pub fn worker_stats(&self, id: WorkerId) -> Option<WorkerStats> {
        let wr = lock(&self.writer);
        wr.workers
            .get(id.0 as usize)?
            .as_ref()
            .map(|s| s.stats.clone())
    }

    /// Every block key `id` holds (in any tier and group), sorted: what
    /// the index believes the worker has cached, for audits against the
    /// engine's own view (the router's `/debug/kv`, the reliability
    /// suite). One pass over every node under its shard's read lock: not
    /// for the request path.
    pub fn worker_keys(&self, id: WorkerId) -> Vec<BlockKey> {
        let mut out = Vec::new();
        for s in &self.shards {
            let sh = read(&s.0);
            for node in sh.heads.values() {
                for h in node.holders.iter().filter(|h| h.worker == id.0) {
                    for r in h.runs.as_slice() {
                        out.extend(
                            node.keys()[r.start as usize..r.end as usize]
                                .iter()
                                .map(|k| BlockKey(*k)),
                        );
                    }
                }
            }
        }
        out.sort_unstable();
        out.dedup();
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

    /// Size figures. `bytes` is computed from capacities (one pass over the
    /// nodes: O(nodes)).
    pub fn stats(&self) -> IndexStats {
        let wr = lock(&self.writer);
        let mut bytes = 0u64;
        for s in &self.shards {
            let sh = read(&s.0);
            bytes += sh.heads.capacity() as u64 * (std::mem::size_of::<(u64, Hot)>() as u64 + 1)
                + sh.cold.capacity() as u64 * std::mem::size_of::<Option<Cold>>() as u64
                + sh.free.capacity() as u64 * 4;
            for (hot, cold) in (0..sh.cold.len()).filter_map(|i| sh.node(i)) {
                bytes += tree::heap_bytes(hot, cold);
            }
        }
        let rec = std::mem::size_of::<(u64, u64)>() as u64 + 1;
        bytes += wr.engine.capacity() as u64 * rec;
        bytes += wr.lrs.capacity() as u64 * 16;
        for ws in wr.workers.iter().flatten() {
            bytes += ws.overrides.capacity() as u64
                * (std::mem::size_of::<(u64, (u64, u64))>() as u64 + 1);
        }
        IndexStats {
            entries: self.entries.load(Ordering::Relaxed),
            keys: self.positions.load(Ordering::Relaxed),
            nodes: self.nodes.load(Ordering::Relaxed),
            engine_records: wr.engine.len() as u64,
            workers: wr.by_ref.len() as u64,
            bytes,
            evictions: wr.evictions,
            evicted_entries: wr.evicted_entries,
            sessions: read(&self.sessions).len() as u64,
        }
    }

    /// The workers the engines said stored blocks for session `id`
    /// (`session_id` on `BlockStored`), most recent first, with the depth
    /// of the session's context each stored (an upper bound: see the
    /// `sessions` module), written to `out` (cleared first).
    pub fn session_holders(&self, id: &str, out: &mut Vec<SessionHolder>) {
        out.clear();
        out.extend_from_slice(read(&self.sessions).holders(sessions::session_key(id)));
    }

    /// (block, worker, group) entries held now.
    pub fn entries(&self) -> u64 {
        self.entries.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests;
