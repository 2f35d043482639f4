//! The KV block pool with vLLM's prefix cache (V1 `BlockPool`).
//!
//! # Data model
//!
//! `num_gpu_blocks` blocks; block 0 is vLLM's *null block* and never holds
//! tokens. Every block has a reference count (requests using it) and, once
//! full and cached, a digest ([`Digest`]). Unreferenced blocks sit in the
//! *free queue*, an intrusive doubly linked list in LRU order: allocation
//! takes the head, freeing appends at the tail, and a cache hit on a free
//! block takes it out of the middle (O(1) each). A cached block stays
//! findable by digest while it is free; it loses its digest (eviction, a
//! `BlockRemoved`) only when allocation reuses it.
//!
//! # Invariants
//!
//! * A block is in the free queue iff its reference count is 0 (and it is
//!   not the null block).
//! * `cached` maps a digest to exactly the blocks carrying that digest. As
//!   in vLLM, two blocks may carry the same digest (two requests computed
//!   the same block before either was cached, or a full hit recomputing its
//!   last block); each is evicted, and reported, on its own.
//! * Usage is `1 - free / (num_gpu_blocks - 1)`: cached but unreferenced
//!   blocks count as free, as in vLLM's `kv_cache_usage_perc`.

use hashbrown::HashMap;
use smallvec::SmallVec;

use crate::hash::Digest;

/// Index of a block.
pub(crate) type BlockId = u32;

/// A digest a block lost to eviction, and its parent's digest.
pub(crate) type Evicted = (Digest, Option<Digest>);

const NIL: u32 = u32::MAX;

#[derive(Clone, Debug)]
struct Block {
    ref_cnt: u32,
    digest: Option<Digest>,
    parent: Option<Digest>,
    /// The LoRA adapter (vLLM's integer id) whose request cached the
    /// block; 0 for the base model.
    lora: u32,
    prev: u32,
    next: u32,
}

/// The pool. See the module docs.
#[derive(Debug)]
pub(crate) struct BlockPool {
    blocks: Vec<Block>,
    block_size: usize,
    /// Token ids of cached blocks, `block_size` per block (for `/debug`).
    tokens: Vec<u32>,
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashMap<Digest, SmallVec<[BlockId; 1]>, foldhash::fast::FixedState>,
}

impl BlockPool {
    /// A pool of `num_gpu_blocks` blocks (≥ 2), all free and uncached.
    pub(crate) fn new(num_gpu_blocks: usize, block_size: usize) -> Self {
        let n = num_gpu_blocks.max(2);
        let mut blocks = vec![
            Block {
                ref_cnt: 0,
                digest: None,
                parent: None,
                lora: 0,
                prev: NIL,
                next: NIL,
            };
            n
        ];
        // Block 0 is the null block: referenced forever, never free.
        blocks[0].ref_cnt = 1;
        for (i, b) in blocks.iter_mut().enumerate().skip(1) {
            b.prev = if i == 1 { NIL } else { (i - 1) as u32 };
            b.next = if i + 1 == n { NIL } else { (i + 1) as u32 };
        }
        BlockPool {
            blocks,
            block_size,
            tokens: vec![0; n * block_size],
            head: 1,
            tail: (n - 1) as u32,
            num_free: n - 1,
            cached: HashMap::with_hasher(foldhash::fast::FixedState::default()),
        }
    }

    /// Blocks that can hold tokens (all but the null block).
    pub(crate) fn capacity(&self) -> usize {
        self.blocks.len() - 1
    }

    /// Unreferenced blocks (cached or not).
    pub(crate) fn num_free(&self) -> usize {
        self.num_free
    }

    /// vLLM's `kv_cache_usage_perc` (0–1).
    pub(crate) fn usage(&self) -> f64 {
        1.0 - self.num_free as f64 / self.capacity() as f64
    }

    /// Reference count of a block.
    pub(crate) fn ref_cnt(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_cnt
    }

    /// A block carrying `digest`, if any.
    pub(crate) fn lookup(&self, digest: &Digest) -> Option<BlockId> {
        self.cached.get(digest).and_then(|v| v.first().copied())
    }

    /// Takes a reference on a (cached) block, removing it from the free
    /// queue if it was free.
    pub(crate) fn touch(&mut self, id: BlockId) {
        if self.blocks[id as usize].ref_cnt == 0 {
            self.unlink(id);
        }
        self.blocks[id as usize].ref_cnt += 1;
    }

    /// Takes the least recently freed block. Returns it and the digest it
    /// lost if it was cached, with that block's parent digest (the caller
    /// reports a `BlockRemoved`), or `None` when no block is free.
    pub(crate) fn allocate(&mut self) -> Option<(BlockId, Option<Evicted>)> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.unlink(id);
        let b = &mut self.blocks[id as usize];
        b.ref_cnt = 1;
        let parent = b.parent.take();
        let evicted = b.digest.take();
        if let Some(d) = evicted
            && let Some(list) = self.cached.get_mut(&d)
        {
            list.retain(|x| *x != id);
            if list.is_empty() {
                self.cached.remove(&d);
            }
        }
        Some((id, evicted.map(|d| (d, parent))))
    }

    /// Marks a referenced, full block as cached under `digest` by a request
    /// of adapter `lora` (`None`: the base model).
    pub(crate) fn cache(
        &mut self,
        id: BlockId,
        digest: Digest,
        parent: Option<Digest>,
        tokens: &[u32],
        lora: Option<u32>,
    ) {
        let b = &mut self.blocks[id as usize];
        debug_assert!(b.digest.is_none() && b.ref_cnt > 0);
        b.digest = Some(digest);
        b.parent = parent;
        b.lora = lora.unwrap_or(0);
        let at = id as usize * self.block_size;
        self.tokens[at..at + self.block_size].copy_from_slice(tokens);
        self.cached.entry(digest).or_default().push(id);
    }

    /// Drops one reference on each block, in the given order; blocks that
    /// reach 0 join the free queue's tail in that order (vLLM frees a
    /// request's blocks last-first, so its tail is evicted first).
    pub(crate) fn free(&mut self, ids: impl IntoIterator<Item = BlockId>) {
        for id in ids {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.ref_cnt > 0 && id != 0);
            b.ref_cnt -= 1;
            if b.ref_cnt == 0 {
                self.push_tail(id);
            }
        }
    }

    /// vLLM's `reset_prefix_cache`: forget every digest, but only when no
    /// request holds a block (returns false otherwise and changes nothing).
    pub(crate) fn reset(&mut self) -> bool {
        if self.num_free != self.capacity() {
            return false;
        }
        for b in &mut self.blocks {
            b.digest = None;
            b.parent = None;
            b.lora = 0;
        }
        self.cached.clear();
        true
    }

    /// Distinct cached digests.
    pub(crate) fn num_cached_digests(&self) -> usize {
        self.cached.len()
    }

    /// Blocks carrying a digest.
    pub(crate) fn num_cached_blocks(&self) -> usize {
        self.cached.values().map(SmallVec::len).sum()
    }

    /// Every cached block: digest, parent digest, copies, whether any copy
    /// is referenced, and (when asked) its tokens. Sorted by digest.
    pub(crate) fn snapshot(&self, with_tokens: bool) -> Vec<CachedBlock> {
        let mut out: Vec<CachedBlock> = self
            .cached
            .iter()
            .map(|(d, ids)| {
                let first = ids[0] as usize;
                CachedBlock {
                    digest: *d,
                    parent: self.blocks[first].parent,
                    lora_id: Some(self.blocks[first].lora).filter(|l| *l != 0),
                    copies: ids.len(),
                    in_use: ids.iter().any(|i| self.blocks[*i as usize].ref_cnt > 0),
                    tokens: with_tokens.then(|| {
                        self.tokens[first * self.block_size..(first + 1) * self.block_size].to_vec()
                    }),
                }
            })
            .collect();
        out.sort_by_key(|c| c.digest);
        out
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        self.num_free -= 1;
    }

    fn push_tail(&mut self, id: BlockId) {
        let tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }

    /// The free queue from head to tail (tests).
    #[cfg(test)]
    fn free_order(&self) -> Vec<BlockId> {
        let mut v = Vec::new();
        let mut at = self.head;
        while at != NIL {
            v.push(at);
            at = self.blocks[at as usize].next;
        }
        v
    }
}

/// One cached block, for `/debug/cache`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedBlock {
    /// Its digest.
    pub digest: Digest,
    /// Digest of the block before it in its sequence (`None`: first block).
    pub parent: Option<Digest>,
    /// The LoRA adapter whose namespace it is in (vLLM's integer id;
    /// `None`: the base model).
    pub lora_id: Option<u32>,
    /// Physical blocks carrying this digest (usually 1).
    pub copies: usize,
    /// Whether a running request holds it.
    pub in_use: bool,
    /// Its token ids, when asked for.
    pub tokens: Option<Vec<u32>>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn d(i: u8) -> Digest {
        Digest([i; 32])
    }

    #[test]
    #[allow(clippy::many_single_char_names)]
    fn eviction_is_lru_over_freed_blocks() {
        let mut p = BlockPool::new(4, 1);
        let (a, _) = p.allocate().expect("free");
        let (b, _) = p.allocate().expect("free");
        p.cache(a, d(1), None, &[1], None);
        p.cache(b, d(2), Some(d(1)), &[2], None);
        // A request frees its blocks last-first.
        p.free([b, a]);
        assert_eq!(p.free_order(), vec![3, b, a]);
        let (c, ev) = p.allocate().expect("free");
        assert_eq!((c, ev), (3, None));
        let (x, ev) = p.allocate().expect("free");
        assert_eq!(
            (x, ev),
            (b, Some((d(2), Some(d(1))))),
            "evicted with its parent"
        );
        assert_eq!(p.lookup(&d(2)), None);
        assert_eq!(p.lookup(&d(1)), Some(a));
        // A hit on a free cached block takes it out of the queue.
        p.touch(a);
        assert_eq!(p.num_free(), 0);
        assert!(p.allocate().is_none());
    }

    #[test]
    fn duplicate_digests_are_separate_blocks() {
        let mut p = BlockPool::new(3, 1);
        let (a, _) = p.allocate().expect("free");
        let (b, _) = p.allocate().expect("free");
        p.cache(a, d(9), None, &[9], None);
        p.cache(b, d(9), None, &[9], None);
        assert_eq!(p.snapshot(false)[0].copies, 2);
        p.free([a, b]);
        let (_, ev) = p.allocate().expect("free");
        assert_eq!(ev, Some((d(9), None)));
        assert!(p.lookup(&d(9)).is_some(), "the other copy stays cached");
        assert!(!p.reset(), "a block is in use");
    }

    proptest! {
        /// Random allocate/cache/free/touch sequences keep the free queue,
        /// reference counts and digest map consistent.
        #[test]
        fn invariants_hold(ops in proptest::collection::vec((0u8..4, 0u8..8), 1..200)) {
            let mut p = BlockPool::new(9, 1);
            let mut held: Vec<BlockId> = Vec::new();
            for (op, arg) in ops {
                match op {
                    0 => if let Some((id, _)) = p.allocate() { held.push(id) },
                    1 => if let Some(&id) = held.get(arg as usize % held.len().max(1))
                        && p.blocks[id as usize].digest.is_none() {
                        p.cache(id, d(arg), None, &[u32::from(arg)], None);
                    },
                    2 => if !held.is_empty() { let id = held.swap_remove(arg as usize % held.len()); p.free([id]) },
                    _ => if let Some(id) = p.lookup(&d(arg)) { p.touch(id); held.push(id) },
                }
                let order = p.free_order();
                prop_assert_eq!(order.len(), p.num_free());
                for (i, b) in p.blocks.iter().enumerate().skip(1) {
                    prop_assert_eq!(b.ref_cnt == 0, order.contains(&(i as u32)));
                    if let Some(dg) = b.digest {
                        prop_assert!(p.cached[&dg].contains(&(i as u32)));
                    }
                }
                let mapped: usize = p.cached.values().map(SmallVec::len).sum();
                prop_assert_eq!(mapped, p.blocks.iter().filter(|b| b.digest.is_some()).count());
            }
        }
    }
}
