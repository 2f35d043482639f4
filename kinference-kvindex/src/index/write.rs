//! Applying events: `BlockStored` (including re-chunking, placeholders,
//! groups and tiers) and `BlockRemoved`. Clearing, trimming and the memory
//! budget are in `evict`.
//!
//! A store resolves its parent's engine hash to a position, chains our keys
//! from the key there, then walks the tree: positions that exist are
//! matched by key (and their engine hash checked), missing ones are
//! appended to the node they continue or start a child node. Every
//! position it covers is added to the `(worker, group)` holder of its node.
//!
//! Here: the entry points, resolving engine hashes, and that walk.
//! Decoding `BlockStored` (and placeholder stores) is in `stored`,
//! `BlockRemoved` in `removed`.

// w, g, h, k, n, s: worker, group, hash, keys per block, count, event, as
// in the docs above.
#![allow(clippy::many_single_char_names)]

mod removed;
mod stored;

use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use super::tree::{Cold, Hot, NONE};
use super::{Applied, IndexError, KvIndex, Writer, lock, read, write};
use crate::event::{EventBatch, KvEvent, Tier};
use crate::key;

/// A chain position: (node id, offset in the node).
pub(super) type Pos = (u32, u32);

pub(super) fn handle(p: Pos) -> u64 {
    (u64::from(p.0) << 32) | u64::from(p.1)
}

pub(super) fn unhandle(h: u64) -> Pos {
    ((h >> 32) as u32, h as u32)
}

/// What a store covers of one group.
#[derive(Debug, Clone, Copy)]
pub(super) struct StoreSpec {
    pub(super) group: u16,
    pub(super) tier: Tier,
    /// Only positions that end an engine block are held (state groups).
    pub(super) state_only: bool,
}

impl KvIndex {
    /// Applies every event of a batch for one worker.
    ///
    /// # Errors
    /// [`IndexError::UnknownWorker`].
    pub fn apply_batch(
        &self,
        id: super::WorkerId,
        batch: &EventBatch,
    ) -> Result<Applied, IndexError> {
        let mut wr = lock(&self.writer);
        Self::check(&wr, id)?;
        Ok(self.apply_batch_locked(&mut wr, id.0 as usize, batch))
    }

    /// Applies a batch for worker `w` (checked) under the writer lock.
    pub(super) fn apply_batch_locked(
        &self,
        wr: &mut Writer,
        w: usize,
        batch: &EventBatch,
    ) -> Applied {
        if batch.events.len() > 1 {
            // Touch the engine records the batch will resolve first:
            // independent probes whose cache misses overlap (resolving them
            // event by event takes them one at a time). vLLM sends one
            // `BlockRemoved` per evicted block, many per step.
            let mut seen = 0usize;
            for ev in &batch.events {
                let h = match ev {
                    KvEvent::BlockRemoved(r) => r.block_hashes.first(),
                    KvEvent::BlockStored(s) => s.parent_block_hash.as_ref(),
                    KvEvent::AllBlocksCleared => None,
                };
                if let Some(h) = h {
                    seen += usize::from(wr.engine.contains_key(&h.id()));
                }
            }
            std::hint::black_box(seen);
        }
        let mut total = Applied::default();
        for ev in &batch.events {
            total += self.apply_locked(wr, w, ev);
        }
        total
    }

    /// Applies one event for one worker. `BlockStored` with token ids is
    /// keyed with [`key::chain`] at the worker's width (re-chunked when the
    /// event's width is a multiple of it); without token ids it is a tier
    /// update for hashes the worker holds. See the crate docs for what is
    /// dropped and counted.
    ///
    /// # Errors
    /// [`IndexError::UnknownWorker`].
    pub fn apply_event(&self, id: super::WorkerId, ev: &KvEvent) -> Result<Applied, IndexError> {
        let mut wr = lock(&self.writer);
        Self::check(&wr, id)?;
        Ok(self.apply_locked(&mut wr, id.0 as usize, ev))
    }

    fn apply_locked(&self, wr: &mut Writer, w: usize, ev: &KvEvent) -> Applied {
        match ev {
            KvEvent::BlockStored(s) => self.apply_stored(wr, w, s),
            KvEvent::BlockRemoved(r) => self.apply_removed(wr, w, r),
            KvEvent::AllBlocksCleared => Applied {
                removed: self.clear_locked(wr, w),
                cleared: true,
                ..Applied::default()
            },
        }
    }

    /// The position engine hash `h` names for worker `w` and our key there:
    /// its own record if it has one, else the shared one. Records are
    /// checked against the node (a stale own record is dropped).
    pub(super) fn resolve(&self, wr: &mut Writer, w: usize, h: u64) -> Option<(Pos, u64)> {
        let ws = wr.workers[w].as_mut().expect("checked");
        if !ws.overrides.is_empty()
            && let Some(&(hd, key)) = ws.overrides.get(&h)
        {
            let p = unhandle(hd);
            if self.key_at(p) == Some(key) {
                return Some((p, key));
            }
            ws.overrides.remove(&h);
        }
        let p = unhandle(*wr.engine.get(&h)?);
        let sh = read(&self.shards[self.node_shard(p.0)].0);
        let (hot, cold) = sh.node(self.node_slot(p.0))?;
        (cold.ehash.get(p.1 as usize) == Some(&h)).then(|| (p, hot.keys()[p.1 as usize]))
    }

    fn key_at(&self, p: Pos) -> Option<u64> {
        let sh = read(&self.shards[self.node_shard(p.0)].0);
        sh.hot(self.node_slot(p.0))?
            .keys()
            .get(p.1 as usize)
            .copied()
    }

    /// `k` locals per engine hash (re-chunking when k > 1).
    #[allow(clippy::too_many_arguments)]
    fn store_locked(
        &self,
        wr: &mut Writer,
        w: usize,
        parent: Option<u64>,
        seed: u64,
        hashes: &[u64],
        locals: &[u64],
        k: usize,
        spec: StoreSpec,
    ) -> Applied {
        let n = hashes.len() as u64;
        let mut cur: Option<Pos> = None;
        let mut prev = seed;
        if let Some(ph) = parent {
            let Some((p, key)) = self.resolve(wr, w, ph) else {
                let ws = wr.workers[w].as_mut().expect("checked");
                ws.stats.orphan_blocks += n;
                return Applied {
                    dropped: n,
                    ..Applied::default()
                };
            };
            cur = Some(p);
            prev = key;
        }
        let nkeys = locals.len().min(hashes.len() * k);
        // Budget: make room first, never evicting the node stored into.
        self.evict_for(wr, nkeys as u64, cur.map(|p| p.0));
        let mut keys = std::mem::take(&mut wr.hashes);
        keys.clear();
        for l in &locals[..nkeys] {
            prev = key::chain(prev, *l).0;
            keys.push(prev);
        }
        // The engine hash of each position: only the last of a re-chunked
        // block has one.
        let rechunked: SmallVec<[u64; 64]> = if k == 1 {
            SmallVec::new()
        } else {
            hashes
                .iter()
                .flat_map(|&h| std::iter::repeat_n(0, k - 1).chain([h]))
                .take(nkeys)
                .collect()
        };
        let khash = if k == 1 {
            &hashes[..nkeys]
        } else {
            &rechunked[..]
        };
        wr.stamp += 1;
        let stamp = wr.stamp;
        let mut stored = 0u64;
        let mut i = 0;
        while i < nkeys {
            let Some(pos) = self.next_pos(cur, keys[i], stamp) else {
                break;
            };
            let (used, last, added) = self.fill(wr, w, pos, &keys[i..], &khash[i..], spec, stamp);
            stored += added;
            i += used;
            cur = Some(last);
        }
        if i < nkeys {
            let ws = wr.workers[w].as_mut().expect("checked");
            ws.stats.orphan_blocks += ((nkeys - i) / k) as u64;
        }
        wr.hashes = keys;
        let ws = wr.workers[w].as_mut().expect("checked");
        ws.stats.stored_blocks += stored;
        ws.stats.blocks_held += stored;
        self.entries.fetch_add(stored, Ordering::Relaxed);
        Applied {
            stored,
            ..Applied::default()
        }
    }

    /// Where key `k` goes after position `cur` (or at the start of a chain):
    /// the next position of `cur`'s node if it holds `k`, a child starting
    /// with `k`, the end of `cur`'s node (to append), or a new child or
    /// root node. `None` only if `k` already starts an unrelated node (a
    /// 64-bit collision).
    pub(super) fn next_pos(&self, cur: Option<Pos>, k: u64, stamp: u64) -> Option<Pos> {
        let (start, parent, at_end) = match cur {
            None => (0u32, NONE, false),
            Some((nid, off)) => {
                let sh = read(&self.shards[self.node_shard(nid)].0);
                let hot = sh.hot(self.node_slot(nid)).expect("live node");
                let next = off as usize + 1;
                if hot.keys().get(next) == Some(&k) {
                    return Some((nid, off + 1));
                }
                (hot.start + off + 1, nid, next == hot.keys().len())
            }
        };
        let s = self.shard_of(k);
        let mut sh = write(&self.shards[s].0);
        if let Some(hot) = sh.heads.get(&k) {
            return (hot.start == start).then(|| (self.node_id(s, hot.slot), 0));
        }
        if at_end {
            return cur.map(|(nid, off)| (nid, off + 1));
        }
        let slot = alloc(&mut sh, k, start, parent, stamp);
        drop(sh);
        let id = self.node_id(s, slot);
        self.nodes.fetch_add(1, Ordering::Relaxed);
        if let Some((nid, off)) = cur {
            let mut ps = write(&self.shards[self.node_shard(nid)].0);
            let pn = ps.node_mut(self.node_slot(nid)).expect("live node");
            pn.cold.children.push((off + 1, id));
        }
        Some((id, 0))
    }

    pub(super) fn node_id(&self, shard: usize, slot: u32) -> u32 {
        (slot << self.shard_bits) | shard as u32
    }

    /// Covers keys from `pos` on inside its node: matches existing
    /// positions, or appends when `pos` is the node's end. Returns (keys
    /// used, last position, entries added).
    #[allow(clippy::too_many_arguments)]
    fn fill(
        &self,
        wr: &mut Writer,
        w: usize,
        pos: Pos,
        keys: &[u64],
        khash: &[u64],
        spec: StoreSpec,
        stamp: u64,
    ) -> (usize, Pos, u64) {
        let (nid, off) = pos;
        let mut sh = write(&self.shards[self.node_shard(nid)].0);
        let node = sh.node_mut(self.node_slot(nid)).expect("live node");
        let (hot, cold) = (node.hot, node.cold);
        let from = off as usize;
        let o = self.cover(wr, Some(w), nid, hot, cold, from, keys, khash);
        let j = o - from;
        let bit = spec.tier.bit();
        let holder = hot.holder_mut(w as u32, spec.group);
        let added = if spec.state_only {
            let mut a = 0;
            for (p, &h) in (from..o).zip(khash) {
                if h != 0 {
                    a += holder.runs.add(p as u32, p as u32 + 1, bit);
                }
            }
            a
        } else {
            holder.runs.add(from as u32, o as u32, bit)
        };
        cold.stamp = stamp;
        let queue = !cold.queued;
        cold.queued = true;
        drop(sh);
        if queue {
            wr.lrs.push(std::cmp::Reverse((stamp, nid)));
        }
        (j, (nid, o as u32 - 1), added)
    }

    /// Matches `keys` against node `nid`'s keys from offset `from` on, or
    /// appends them when `from` is its end (nothing exists past a node's
    /// end but children, and none starts with `keys[0]`: the caller
    /// checked), and records the engine hashes `khash` of the positions
    /// covered: the shared record where none is, else worker `w`'s own
    /// (`None`: only where none is). Returns one past the last offset
    /// covered.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn cover(
        &self,
        wr: &mut Writer,
        w: Option<usize>,
        nid: u32,
        hot: &mut Hot,
        cold: &mut Cold,
        from: usize,
        keys: &[u64],
        khash: &[u64],
    ) -> usize {
        let mut o = from;
        if from == hot.keys().len() {
            hot.extend(keys);
            cold.ehash.extend_from_slice(khash);
            o = from + keys.len();
            self.positions
                .fetch_add(keys.len() as u64, Ordering::Relaxed);
            for (p, &h) in (from..o).zip(khash) {
                if h != 0 {
                    record_new(wr, w, h, (nid, p as u32), keys[p - from]);
                }
            }
            return o;
        }
        let mut j = 0;
        while j < keys.len() && o < hot.keys().len() && hot.keys()[o] == keys[j] {
            let h = khash[j];
            if h != 0 && cold.ehash[o] != h {
                if cold.ehash[o] == 0 {
                    cold.ehash[o] = h;
                    record_new(wr, w, h, (nid, o as u32), keys[j]);
                } else if let Some(w) = w {
                    let ws = wr.workers[w].as_mut().expect("checked");
                    ws.overrides.insert(h, (handle((nid, o as u32)), keys[j]));
                }
            }
            j += 1;
            o += 1;
        }
        o
    }
}

/// Records that engine hash `h` names position `p` (key `key`): the shared
/// record if the hash is new, else (another position has it) worker
/// `w`'s own (none without a worker).
fn record_new(wr: &mut Writer, w: Option<usize>, h: u64, p: Pos, key: u64) {
    match wr.engine.entry(h) {
        hashbrown::hash_map::Entry::Vacant(v) => {
            v.insert(handle(p));
        }
        hashbrown::hash_map::Entry::Occupied(o) => {
            if *o.get() != handle(p)
                && let Some(w) = w
            {
                let ws = wr.workers[w].as_mut().expect("checked");
                ws.overrides.insert(h, (handle(p), key));
            }
        }
    }
}

/// A new empty node starting at chain position `start` whose first key
/// will be `first`; returns its slot.
pub(super) fn alloc(sh: &mut super::Shard, first: u64, start: u32, parent: u32, stamp: u64) -> u32 {
    sh.live += 1;
    let cold = Cold {
        first,
        parent,
        ehash: Vec::new(),
        children: SmallVec::new(),
        stamp,
        queued: false,
    };
    let slot = if let Some(slot) = sh.free.pop() {
        sh.cold[slot as usize] = Some(cold);
        slot
    } else {
        sh.cold.push(Some(cold));
        sh.cold.len() as u32 - 1
    };
    sh.heads.insert(first, Hot::new(slot, start));
    slot
}
