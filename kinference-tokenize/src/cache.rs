//! The segment cache behind multi-turn prefix reuse.
//!
//! A rendered prompt is cut at exact cut points ([`crate::segment`]) into
//! segments, typically one per chat turn. The cache maps a segment's text
//! to its ids, so a chat that re-sends its history only tokenizes the
//! segments it has not sent before (the new turn, and any turn the template
//! renders differently now, e.g. Qwen3 dropping old `<think>` blocks).
//! Keys are content, not conversation position: a system prompt shared by
//! many conversations is one entry.
//!
//! Exactness: an entry holds the segment's full text and a hit compares it
//! byte for byte, so a hit returns exactly what tokenizing that text
//! returned; together with exact cut points, a cached tokenization equals
//! an uncached one (checked by a proptest on random conversations).
//!
//! Concurrency and memory: `shards` independent shards, each a mutex over a
//! hash table and a CLOCK (second-chance) ring; the shard is picked by the
//! segment's hash, and a lock is held only for one probe-and-copy or one
//! insert, never while tokenizing. The byte budget (segment text + 4 bytes
//! per id + a fixed overhead per entry) is split evenly over the shards; a
//! segment larger than an eighth of a shard's budget is not cached.
//!
//! Costs: a probe hashes the segment (xxh3) and compares it once;
//! insertion is O(1) amortised, eviction O(1) amortised (CLOCK hand).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use hashbrown::HashTable;

/// Fixed per-entry overhead charged to the budget (slot, table entry, boxes).
const ENTRY_OVERHEAD: usize = 64;

/// Counters of a tokenizer's segment cache, for metrics
/// ([`ModelTokenizer::cache_stats`](crate::ModelTokenizer::cache_stats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Segment lookups answered from the cache.
    pub hits: u64,
    /// Segment lookups that had to tokenize.
    pub misses: u64,
    /// Ids served from the cache.
    pub hit_tokens: u64,
    /// Ids produced by tokenizing (misses).
    pub miss_tokens: u64,
    /// Entries evicted to stay within the budget.
    pub evictions: u64,
    /// Segments not cached because they exceed the per-entry limit.
    pub oversized: u64,
    /// Entries held now.
    pub entries: u64,
    /// Bytes charged now.
    pub bytes: u64,
    /// The byte budget.
    pub capacity_bytes: u64,
}

impl CacheStats {
    /// Share of ids served from the cache, 0 when nothing was looked up.
    pub fn token_hit_ratio(&self) -> f64 {
        let total = self.hit_tokens + self.miss_tokens;
        if total == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / total as f64
        }
    }
}

/// A bounded, sharded map from segment text to token ids.
#[derive(Debug)]
pub(crate) struct SegmentCache {
    shards: Box<[Mutex<Shard>]>,
    shard_budget: usize,
    max_entry: usize,
    hits: AtomicU64,
    misses: AtomicU64,
    hit_tokens: AtomicU64,
    miss_tokens: AtomicU64,
    evictions: AtomicU64,
    oversized: AtomicU64,
}

#[derive(Debug, Default)]
struct Shard {
    table: HashTable<u32>,
    slots: Vec<Option<Entry>>,
    free: Vec<u32>,
    hand: usize,
    bytes: usize,
}

#[derive(Debug)]
struct Entry {
    hash: u64,
    text: Box<str>,
    ids: Box<[u32]>,
    referenced: bool,
}

fn charge(text_len: usize, ids_len: usize) -> usize {
    text_len + 4 * ids_len + ENTRY_OVERHEAD
}

impl SegmentCache {
    /// A cache of at most `capacity_bytes` over `shards` shards (at least
    /// one). A capacity of 0 disables caching.
    pub fn new(capacity_bytes: usize, shards: usize) -> Self {
        let shards = shards.max(1);
        let shard_budget = capacity_bytes / shards;
        SegmentCache {
            shards: (0..shards).map(|_| Mutex::new(Shard::default())).collect(),
            shard_budget,
            max_entry: shard_budget / 8,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            hit_tokens: AtomicU64::new(0),
            miss_tokens: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            oversized: AtomicU64::new(0),
        }
    }

    /// Whether anything can be cached.
    pub fn is_enabled(&self) -> bool {
        self.max_entry > ENTRY_OVERHEAD
    }

    /// The hash a segment is stored under.
    pub(crate) fn hash(text: &str) -> u64 {
        xxhash_rust::xxh3::xxh3_64(text.as_bytes())
    }

    fn shard(&self, hash: u64) -> MutexGuard<'_, Shard> {
        // The high bits pick the shard; hashbrown uses the low bits.
        let i = ((hash >> 48) as usize) % self.shards.len();
        self.shards[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Appends the ids of `text` to `out` if cached; returns whether it was.
    pub(crate) fn get_into(&self, hash: u64, text: &str, out: &mut Vec<u32>) -> bool {
        let found = {
            let mut guard = self.shard(hash);
            let Shard { table, slots, .. } = &mut *guard;
            let hit = table
                .find(hash, |&i| {
                    slots[i as usize]
                        .as_ref()
                        .is_some_and(|e| e.hash == hash && &*e.text == text)
                })
                .copied();
            match hit.and_then(|i| slots[i as usize].as_mut()) {
                Some(entry) => {
                    entry.referenced = true;
                    out.extend_from_slice(&entry.ids);
                    Some(entry.ids.len())
                }
                None => None,
            }
        };
        if let Some(n) = found {
            self.hits.fetch_add(1, Ordering::Relaxed);
            self.hit_tokens.fetch_add(n as u64, Ordering::Relaxed);
            true
        } else {
            self.misses.fetch_add(1, Ordering::Relaxed);
            false
        }
    }

    /// Stores the ids of `text` (tokenized after a miss), evicting as
    /// needed. A concurrent insert of the same text keeps the first.
    pub(crate) fn insert(&self, hash: u64, text: &str, ids: &[u32]) {
        self.miss_tokens
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        let size = charge(text.len(), ids.len());
        if size > self.max_entry {
            self.oversized.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let entry = Entry {
            hash,
            text: text.into(),
            ids: ids.into(),
            referenced: false,
        };
        let mut guard = self.shard(hash);
        let shard = &mut *guard;
        let present = shard
            .table
            .find(hash, |&i| {
                shard.slots[i as usize]
                    .as_ref()
                    .is_some_and(|e| e.hash == hash && *e.text == *text)
            })
            .is_some();
        if present {
            return;
        }
        while shard.bytes + size > self.shard_budget && shard.bytes > 0 {
            if shard.evict_one() {
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        let index = if let Some(i) = shard.free.pop() {
            shard.slots[i as usize] = Some(entry);
            i
        } else {
            shard.slots.push(Some(entry));
            (shard.slots.len() - 1) as u32
        };
        let Shard { table, slots, .. } = shard;
        table.insert_unique(hash, index, |&i| {
            slots[i as usize].as_ref().map_or(0, |e| e.hash)
        });
        shard.bytes += size;
    }

    /// Counters and sizes now.
    pub fn stats(&self) -> CacheStats {
        let (mut entries, mut bytes) = (0u64, 0u64);
        for shard in &self.shards {
            let shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            entries += shard.table.len() as u64;
            bytes += shard.bytes as u64;
        }
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            hit_tokens: self.hit_tokens.load(Ordering::Relaxed),
            miss_tokens: self.miss_tokens.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            oversized: self.oversized.load(Ordering::Relaxed),
            entries,
            bytes,
            capacity_bytes: (self.shard_budget * self.shards.len()) as u64,
        }
    }

    /// Drops every entry (counters keep counting).
    pub fn clear(&self) {
        for shard in &self.shards {
            *shard.lock().unwrap_or_else(PoisonError::into_inner) = Shard::default();
        }
    }
}

impl Shard {
    /// Advances the CLOCK hand to the next entry without a second chance
    /// and removes it. Returns whether an entry was removed (false only
    /// when the shard is empty).
    fn evict_one(&mut self) -> bool {
        if self.table.is_empty() {
            self.bytes = 0;
            return false;
        }
        // At most two sweeps: the first clears every reference bit.
        for _ in 0..=2 * self.slots.len() {
            if self.hand >= self.slots.len() {
                self.hand = 0;
            }
            let i = self.hand;
            self.hand += 1;
            let Some(entry) = self.slots[i].as_mut() else {
                continue;
            };
            if entry.referenced {
                entry.referenced = false;
                continue;
            }
            let hash = entry.hash;
            let size = charge(entry.text.len(), entry.ids.len());
            if let Ok(found) = self.table.find_entry(hash, |&j| j as usize == i) {
                found.remove();
            }
            self.slots[i] = None;
            self.free.push(i as u32);
            self.bytes -= size;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(cache: &SegmentCache, text: &str) -> Option<Vec<u32>> {
        let mut out = Vec::new();
        cache
            .get_into(SegmentCache::hash(text), text, &mut out)
            .then_some(out)
    }

    fn put(cache: &SegmentCache, text: &str, ids: &[u32]) {
        cache.insert(SegmentCache::hash(text), text, ids);
    }

    #[test]
    fn hit_returns_what_was_stored() {
        let cache = SegmentCache::new(1 << 20, 4);
        assert_eq!(get(&cache, "abc"), None);
        put(&cache, "abc", &[1, 2, 3]);
        put(&cache, "abd", &[4]);
        assert_eq!(get(&cache, "abc"), Some(vec![1, 2, 3]));
        assert_eq!(get(&cache, "abd"), Some(vec![4]));
        assert_eq!(get(&cache, "ab"), None);
        let stats = cache.stats();
        assert_eq!(
            (
                stats.hits,
                stats.misses,
                stats.hit_tokens,
                stats.miss_tokens
            ),
            (2, 2, 4, 4)
        );
        assert_eq!(stats.entries, 2);
        assert_eq!(stats.bytes as usize, charge(3, 3) + charge(3, 1));
        cache.clear();
        assert_eq!(get(&cache, "abc"), None);
        assert_eq!(cache.stats().entries, 0);
    }

    #[test]
    fn stays_within_budget_and_keeps_referenced_entries() {
        let budget = 8 * charge(10, 10) * 8; // one shard, max entry = budget / 8
        let cache = SegmentCache::new(budget, 1);
        let ids = [7u32; 10];
        put(&cache, "hot-000000", &ids);
        for i in 0..1000 {
            put(&cache, &format!("key-{i:06}"), &ids);
            // Touch the hot entry so CLOCK gives it a second chance.
            assert!(
                get(&cache, "hot-000000").is_some(),
                "hot entry evicted at {i}"
            );
            let stats = cache.stats();
            assert!(stats.bytes <= stats.capacity_bytes, "{stats:?}");
        }
        let stats = cache.stats();
        assert!(stats.evictions > 900, "{stats:?}");
        assert_eq!(stats.entries as usize, budget / charge(10, 10));
    }

    #[test]
    fn oversized_and_disabled() {
        let cache = SegmentCache::new(8 * 1024, 1);
        put(&cache, &"x".repeat(2000), &[1]);
        assert_eq!(cache.stats().oversized, 1);
        assert_eq!(cache.stats().entries, 0);
        let off = SegmentCache::new(0, 16);
        assert!(!off.is_enabled());
        put(&off, "a", &[1]);
        assert_eq!(get(&off, "a"), None);
    }

    #[test]
    fn concurrent_use_is_consistent() {
        let cache = std::sync::Arc::new(SegmentCache::new(1 << 16, 8));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let cache = cache.clone();
                std::thread::spawn(move || {
                    for i in 0..2000u32 {
                        let key = format!("k{}", (i * 7 + t) % 300);
                        let want: Vec<u32> = key.bytes().map(u32::from).collect();
                        match get(&cache, &key) {
                            Some(got) => assert_eq!(got, want),
                            None => put(&cache, &key, &want),
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let stats = cache.stats();
        assert!(stats.bytes <= stats.capacity_bytes);
        assert_eq!(stats.hits + stats.misses, 8000);
    }
}
