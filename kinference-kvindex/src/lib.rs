//! KV-cache block index for cache-aware routing: block keys, the index of
//! which worker holds which blocks, engine-agnostic KV events with the
//! vLLM/SGLang MessagePack codec, and the ZeroMQ subscriber (feature `zmq`).
//!
//! | module | what |
//! |---|---|
//! | [`key`] | [`BlockKey`], [`BlockKeyer`], [`block_keys`]: our chained 64-bit key per full block |
//! | [`event`] | [`EventBatch`], [`KvEvent`], [`BlockHash`], [`Tier`] |
//! | [`codec`] | [`decode_batch`], [`encode_batch`], [`codec::frames`] (seq, replay layouts, end marker) |
//! | [`index`] | [`KvIndex`]: register workers, apply events, [`KvIndex::find_matches`] |
//! | [`dump`] | events as JSON lines (`kvdump`, the router's `events` command) |
//! | `sub` (feature `zmq`) | `Subscriber`: one SUB socket per publisher, replay, stream health |
//!
//! # Data model
//!
//! A *worker* is one publisher: `(endpoint, dp_rank)` ([`WorkerRef`]),
//! registered to a compact [`WorkerId`] with its block width (the worker
//! set's `kvBlockSize`). A *block key* ([`BlockKey`]) is our own hash of a
//! block's tokens chained over all earlier blocks ([`key`]), so one key
//! names a whole prefix. Engines name blocks by their own *engine hashes*
//! ([`BlockHash::id`]); the index keeps those only to find a stored block's
//! parent and to apply removals.
//!
//! The index has two parts:
//!
//! * **Key shards** (read by lookups): `shards` hash maps, each behind its
//!   own `RwLock`, from block key to its *holders*: a sorted array of packed
//!   `u32` (20-bit worker id, tier mask, count of that worker's held
//!   children, with a per-worker side table from 255 up). Up to 13 holders
//!   live inline, so a key and its holders fill one 64-byte bucket and a
//!   probe costs no pointer chase; more go to a heap vector. A chain is
//!   cut into *segments* of doubling length, `[0,B) [B,2B) [2B,4B) …`
//!   (B = `IndexConfig::segment`, 64 by default); all blocks of one
//!   segment of one chain live in the shard chosen by the key at the
//!   segment's start. A lookup therefore takes one read lock per segment it
//!   touches (at most log₂(n/B) + 2), never one per probe, and its probes
//!   inside a round run without locked instructions between them, so their
//!   cache misses overlap. A prompt shared by many conversations fans out
//!   into different shards after at most one segment.
//! * **Writer state** (one `Mutex`, taken only by event application and
//!   control calls): engine hash → record `{key, parent key, position,
//!   shard, parent shard}`, shared by all workers that map the hash to the
//!   same block (with vLLM's default hashing every pod does), with
//!   per-worker overrides when they disagree; per-worker counters.
//!
//! # Invariants
//!
//! 1. An entry `(key, worker)` exists iff that worker stored the block (in
//!    at least one tier) and has not removed it from every tier, cleared,
//!    restarted or been removed. Its tier mask is the set of tiers it was
//!    stored to and not removed from.
//! 2. A `BlockStored` whose parent hash has no record (never seen, or that
//!    block is gone from every worker) is not indexed: its blocks cannot be
//!    keyed. It is counted in [`WorkerStats::orphan_blocks`]. A parent known
//!    from another worker's events is enough to key them.
//! 3. The *hole count* of a worker is exactly the number of its entries
//!    whose parent block (by chain position) it does not hold. While it is
//!    0, "holds block i" is monotone along any query, so a lookup may
//!    binary-search instead of scanning. Engines evict leaves first (vLLM
//!    frees a request's blocks tail-first into an LRU; SGLang evicts radix
//!    leaves), so holes are rare; a worker with holes gets an exact linear
//!    scan instead.
//! 4. `entries` = Σ holders = Σ per-worker `blocks_held`; `keys` = number of
//!    keys with at least one holder (no empty holder sets are kept).
//!
//! # Lookup semantics and complexity
//!
//! [`KvIndex::find_matches`] returns, for every worker holding the query's
//! first key, the number of leading query blocks it holds in any tier and
//! on the GPU. Cost for a query of n blocks with holders H at position 0:
//! round 1 probes the first and the last block (a full match, or none, ends
//! there); further rounds probe `fanout` points (default 4) of each open
//! bracket of worker groups (⌈log₅ n⌉ rounds), and membership is a merge walk of sorted worker ids:
//! O(log n) probes and O((|H| + holders) · log n) work. Workers with holes
//! or with blocks outside the GPU add an O(depth) scan for themselves only.
//! Lookups run concurrently with writes; a lookup sees each shard either
//! before or after any one event's changes to it.
//!
//! Store and remove: O(blocks) hash operations, one shard write lock per
//! run of blocks in the same segment. Clearing or removing a worker: one
//! pass over all keys (O(keys)).
//!
//! # Block widths, groups, placeholders, tiers
//!
//! * The index keys events at the worker's configured width. An event whose
//!   `block_size` is a multiple k of it is **re-chunked** (k keys per engine
//!   hash, all removed together); any other width, or token ids that do not
//!   fill the blocks, are not indexed (counted in
//!   [`WorkerStats::width_mismatch_blocks`]). Every width seen is recorded
//!   per group in [`WorkerStats::observed_widths`] for the controller's
//!   diagnosis.
//! * Only the configured KV-cache group is indexed (`IndexConfig::group`,
//!   default 0; nil = 0); `locality: "REMOTE"` events are not indexed.
//! * A `BlockStored` without token ids (offload placeholder) adds its tier
//!   to hashes the worker already holds and is otherwise ignored (counted).
//! * `BlockRemoved` clears one tier bit; the entry goes when no tier is left.
//!   `AllBlocksCleared` drops the worker's blocks in every tier.
//!
//! # Memory budget
//!
//! `IndexConfig::max_entries` bounds entries. When a store would pass it,
//! the worker holding the most entries is cleared first (as if it had sent
//! `AllBlocksCleared`; counted in [`IndexStats::evictions`] and that
//! worker's `clears`), then the store proceeds. Engines' caches are finite,
//! so the budget only bites when events are lost or misconfigured. Hash
//! tables shrink when a quarter full and holder arrays shrink as they
//! empty, so memory is returned after removals. [`KvIndex::stats`] exports
//! entries, keys and an estimate of bytes.
//!
//! # Time
//!
//! No wall clock, no tokio, no Kubernetes inside the index (enforced by
//! this crate's `clippy.toml`). Time-based health lives in the subscriber.
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
pub mod sources;
#[cfg(feature = "zmq")]
pub mod sub;

pub use codec::{DecodeError, EncodeForm, decode_batch, encode_batch};
pub use event::{BlockHash, BlockRemoved, BlockStored, EventBatch, KvEvent, Tier};
pub use index::{
    Applied, BYTES_PER_ENTRY, GroupKind, GroupSpec, IndexConfig, IndexError, IndexStats, KvIndex,
    Matches, WorkerId, WorkerMatch, WorkerRef, WorkerStats, max_entries_for_budget,
};
pub use key::{BlockKey, BlockKeyer, ExtraKeys, block_keys};
pub use sources::{KvSource, parse_kv_event_sources};
