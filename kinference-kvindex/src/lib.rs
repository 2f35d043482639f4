//! KV-cache block index for cache-aware routing: block keys, the index of
//! which worker holds which blocks, engine-agnostic KV events with the
//! vLLM/SGLang MessagePack codec, and the ZeroMQ subscriber (feature `zmq`).
//!
//! | module | what |
//! |---|---|
//! | [`key`] | [`BlockKey`], [`BlockKeyer`], [`block_keys`]: our chained 64-bit key per full block |
//! | [`event`] | [`EventBatch`], [`KvEvent`], [`BlockHash`], [`Tier`] |
//! | [`codec`] | [`decode_batch`], [`encode_batch`], [`codec::frames`] (seq, replay layouts, end marker) |
//! | [`index`] | [`KvIndex`]: register workers, apply events, [`KvIndex::find_matches`], [`max_entries_for_budget`] |
//! | [`snapshot`] | [`Snapshot`]: the index's contents for another process ([`KvIndex::export`], [`KvIndex::import`]) |
//! | [`dump`] | events as JSON lines (`kvdump`, the router's `events` command) |
//! | `sub` (feature `zmq`) | `Subscriber`: one SUB socket per publisher, replay, stream health |
//!
//! # Data model
//!
//! A *worker* is one publisher: `(endpoint, dp_rank)` ([`WorkerRef`]),
//! registered to a compact [`WorkerId`] with its block width (the worker
//! set's `kvBlockSize`: the engine's hash block size). A *block key*
//! ([`BlockKey`]) is our own hash of a block's tokens chained over all
//! earlier blocks ([`key`]), so one key names a whole prefix and two chains
//! that part never meet again. Engines name blocks by their own *engine
//! hashes* ([`BlockHash::id`]); the index keeps those only to find a stored
//! block's parent and to apply removals. An *entry* is one
//! `(block, worker, KV-cache group)` held in at least one tier.
//!
//! The index is a tree of **nodes**: runs of consecutive chain positions.
//! A node holds our key and the engine hash at each position, the nodes
//! that leave it (a child starts at any offset where another chain's key
//! differs from the node's, or at its end), and per `(worker, group)` a
//! *holder*: sorted, disjoint ranges of the node's offsets with a tier mask
//! each (the usual holder is one range from offset 0, on the GPU). Nodes
//! never split and positions never move, so an engine hash names a
//! `(node, offset)` for as long as the position exists.
//!
//! * **Shards** (read by lookups): each node lives in the shard of its
//!   first key, behind that shard's `RwLock`; the shard maps first keys to
//!   the part of the node lookups read (start, keys, every 16th key,
//!   holders: the key and the pointers a full match reads share one cache
//!   line). A lookup takes one shard read lock per node on its path.
//! * **Writer state** (one `Mutex`, taken by event application and control
//!   calls): engine hash → position, shared by every worker whose hash for
//!   that position is the one recorded (with vLLM's default hashing all
//!   pods agree), per-worker records when they differ (checked against the
//!   node's key before use); per-worker counters and KV-cache groups; the
//!   eviction queue.
//!
//! # Invariants
//!
//! 1. An entry exists iff its worker stored the block in that group (in at
//!    least one tier) and has not removed it from every tier, cleared,
//!    restarted, been removed, or lost it to the budget. Its tier mask is
//!    the set of tiers it was stored to and not removed from.
//! 2. A `BlockStored` whose parent hash names no position is not indexed:
//!    its blocks cannot be keyed ([`WorkerStats::orphan_blocks`]). A
//!    position exists while any worker holds it or a block after it on a
//!    chain through it, so a parent known from another worker's events is
//!    enough.
//! 3. A node keeps its positions up to the last one any holder holds or the
//!    deepest child leaves from; the rest are dropped with their engine
//!    records, and an empty node is freed: memory is returned as blocks go.
//! 4. `entries` = Σ held offsets over all holders = Σ per-worker
//!    `blocks_held`; `keys` = Σ node lengths.
//!
//! # Lookup semantics and complexity
//!
//! [`KvIndex::find_matches`] returns, for every worker that can reuse at
//! least one leading block of the query, how many it can reuse: in any tier
//! (`blocks`) and counting only faster tiers (`gpu_blocks`, `cpu_blocks`,
//! `disk_blocks`; see [`WorkerMatch`]). The query walks the tree: the first
//! key names a root; in each node the common prefix with the node's keys
//! is found from the last position (one load for a full match) and the
//! samples (a few contiguous lines) then one group of 16 keys; where the
//! query leaves the node, its next key names the child. Cost: one shard
//! read lock and O(1) memory rounds per node on the path, plus O(holders)
//! for the answer. Lookups run concurrently with writes and see each node
//! either before or after any one event's change to it.
//!
//! Store and remove: O(blocks) work, one engine-record probe per event
//! (consecutive hashes are followed in the node), one shard write lock per
//! node touched. Clearing or removing a worker: one pass over the nodes.
//!
//! # KV-cache groups (hybrid models)
//!
//! Every group an event names is indexed (`group_idx`, nil = 0), each with
//! its own holders, and learned per worker from its events
//! (`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`, `block_size`) or
//! declared with [`KvIndex::set_worker_groups`]. A worker with several
//! groups (or one that is not full attention) gets, as its usable prefix,
//! what vLLM's hybrid coordinator would reuse: every full-attention group
//! holds all of it, every sliding-window group the window before its end,
//! every Mamba group a state at its end, at a multiple of each attention
//! group's block width (the `index::groups` rules; checked against vLLM
//! 0.33's own answers in `tests/fixtures.rs`). Groups of kinds that are not
//! prefix-cached (encoder, cross attention) are counted, not indexed.
//!
//! # Block widths, placeholders, tiers, locality
//!
//! * The index keys events at the worker's width. An event whose
//!   `block_size` is a multiple k of it is **re-chunked** (k keys per engine
//!   hash); a Mamba group keeps only the last key of each block (its
//!   state). Any other width, or token ids that do not fill the blocks, are
//!   not indexed ([`WorkerStats::width_mismatch_blocks`]). Every width seen
//!   is recorded per group in [`WorkerStats::observed_widths`].
//! * A `BlockStored` without token ids (offload placeholder) adds its tier
//!   to blocks the worker holds and is otherwise ignored (counted).
//! * Tiers: GPU, CPU (`CPU`, `CPU_PINNED`), local disk (`DISK`), storage
//!   (`STORAGE`: vLLM's file/object tiers; `EXTERNAL`), other. A
//!   `BlockRemoved` clears one tier; the entry goes with its last tier.
//!   `AllBlocksCleared` drops the worker's blocks in every tier and group.
//! * `locality: "REMOTE"`: the block is not on this engine; not indexed
//!   ([`WorkerStats::remote_blocks`]).
//! * Re-reported blocks (`kv_cache_report_mode: "full"`) are idempotent
//!   upserts.
//! * `session_id` (vLLM ≥ 0.30, SGLang ≥ 0.5.20): the workers that stored
//!   for a session, and how deep its context there is, are kept beside
//!   the tree ([`KvIndex::session_holders`]): group 0's stores count, a
//!   chain's start sets the depth to at least its tokens, a continuation
//!   adds its tokens. Removals name no session, so the depth is an upper
//!   bound. Bounded by `IndexConfig::max_sessions` (two generations: the
//!   sessions stored into least recently go first); a worker's clear
//!   drops it from every session. Snapshots carry each worker's sessions
//!   (in at most a quarter of the export's byte budget, the most recently
//!   stored into first).
//!
//! # Memory budget
//!
//! `IndexConfig::max_entries` bounds entries; [`max_entries_for_budget`]
//! turns a byte budget into it from the measured [`BYTES_PER_ENTRY`]. When
//! a store would pass the budget, whole tails of chains are evicted, least
//! recently stored first, down to 15/16 of the budget: a node's tail is
//! what lies past its deepest child, so a shared prefix outlives every
//! chain that continues it, and the node being stored into is never
//! evicted. Evicted entries are counted in [`IndexStats::evicted_entries`]
//! (and [`IndexStats::evictions`], per eviction) and per worker in
//! [`WorkerStats::evicted_blocks`]. [`KvIndex::stats`] exports entries,
//! keys, nodes and an estimate of bytes.
//!
//! # Figures
//!
//! The measured figures (workloads v1 and v1b, decode+apply, the fleet of
//! 1,000 pods × 4 ranks), dated and with their commit, are in the crate's
//! README; the workloads are specified in `benches/README.md`.
//! [`BYTES_PER_ENTRY`] is the one bytes-per-entry figure the code uses.
//!
//! # Time
//!
//! No wall clock, no tokio, no Kubernetes inside the index (enforced by
//! this crate's `clippy.toml`); "least recently stored" is a store counter.
//! Time-based health lives in the subscriber.
//!
//! # Features
//!
//! | feature | default | what |
//! |---|---|---|
//! | `zmq` | yes | the `sub` module (tokio + the pure-Rust `zeromq` crate) |

pub mod codec;
pub mod dump;
pub mod event;
pub mod index;
pub mod key;
pub mod snapshot;
#[cfg(feature = "zmq")]
pub mod sub;

pub use codec::{DecodeError, EncodeForm, decode_batch, encode_batch};
pub use event::{BlockHash, BlockRemoved, BlockStored, EventBatch, KvEvent, Tier};
pub use index::{
    Applied, BYTES_PER_ENTRY, GroupKind, GroupSpec, Imported, IndexConfig, IndexError, IndexStats,
    KvIndex, Matches, SessionHolder, WorkerId, WorkerMatch, WorkerRef, WorkerStats,
    max_entries_for_budget,
};
pub use key::{BlockKey, BlockKeyer, ExtraKeys, block_keys};
pub use snapshot::{Position, Snapshot, SnapshotError};
