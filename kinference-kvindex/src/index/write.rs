//! Applying events: `BlockStored` (including re-chunking, placeholders,
//! groups and tiers) and `BlockRemoved`. Clearing, trimming and the memory
//! budget are in `evict`.
//!
//! A store resolves its parent's engine hash to a position, chains our keys
//! from the key there, then walks the tree: positions that exist are
//! matched by key (and their engine hash checked), missing ones are
//! appended to the node they continue or start a child node. Every
//! position it covers is added to the `(worker, group)` holder of its node.

// w, g, h, k, n, s: worker, group, hash, keys per block, count, event, as
// in the docs above.
#![allow(clippy::many_single_char_names)]

use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use super::groups::{self, Group, Rule, RuleKind};
use super::tree::{Cold, Hot, NONE};
use super::{Applied, IndexError, KvIndex, Writer, lock, read, write};
use crate::event::{BlockHash, BlockRemoved, BlockStored, EventBatch, KvEvent, Tier};
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
        if s.locality.as_deref() == Some("REMOTE") {
            ws.stats.remote_blocks += n;
            return dropped;
        }
        let (Some(kind), Ok(g)) = (
            groups::kind_rule(s.kv_cache_spec_kind.as_deref()),
            u16::try_from(group),
        ) else {
            ws.stats.other_group_blocks += n;
            return dropped;
        };
        let tier = Tier::from_medium(s.medium.as_deref());
        let hashes: SmallVec<[u64; 64]> = s.block_hashes.iter().map(BlockHash::id).collect();
        if s.token_ids.is_empty() {
            return self.placeholder(wr, w, g, &hashes, tier);
        }
        if n == 0 {
            // vLLM's Mamba groups report prefill tokens without a state.
            return Applied::default();
        }
        let width = ws.width;
        let bs = s.block_size;
        if bs == 0 || !bs.is_multiple_of(width) || s.token_ids.len() as u64 != u64::from(bs) * n {
            ws.stats.width_mismatch_blocks += n;
            return dropped;
        }
        let k = (bs / width) as usize;
        if k > 1 {
            ws.stats.rechunked_blocks += n;
        }
        let state_only =
            self.observe_group(wr, w, g, kind, k as u32, s.kv_cache_spec_sliding_window);
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
        let mut locals = std::mem::take(&mut wr.keys);
        locals.clear();
        // Per engine block, its k keys (no division per key: a division
        // costs more than the rest of the loop).
        for (b, block) in s.token_ids.chunks_exact(bs as usize).enumerate() {
            let extra = extras.get(b).copied().unwrap_or(0);
            for chunk in block.chunks_exact(width as usize) {
                locals.push(key::local_hash(chunk, extra));
            }
        }
        let parent = s.parent_block_hash.as_ref().map(BlockHash::id);
        let spec = StoreSpec {
            group: g,
            tier,
            state_only,
        };
        let out = self.store_locked(
            wr,
            w,
            parent,
            key::seed_for_event(s),
            &hashes,
            &locals,
            k,
            spec,
        );
        wr.keys = locals;
        // Sessions: one group's stores tell the depth (every group of a
        // hybrid model stores the same tokens); orphans tell nothing.
        if let Some(sid) = s.session_id.as_deref()
            && g == 0
            && out.dropped == 0
        {
            write(&self.sessions).stored(
                super::sessions::session_key(sid),
                super::WorkerId(w as u32),
                s.token_ids.len() as u64,
                parent.is_none(),
            );
        }
        out
    }

    /// Records group `g` of worker `w` as seen with `k` keys per block;
    /// returns whether it is a state group.
    fn observe_group(
        &self,
        wr: &mut Writer,
        w: usize,
        g: u16,
        kind: RuleKind,
        k: u32,
        window: Option<u32>,
    ) -> bool {
        let ws = wr.workers[w].as_mut().expect("checked");
        let changed = match ws.groups.binary_search_by_key(&g, |x| x.idx) {
            Ok(i) => {
                let before = ws.groups[i];
                ws.groups[i].observe(k, window);
                ws.groups[i] != before
            }
            Err(i) => {
                ws.groups
                    .insert(i, Group::new(g, kind, k, window, ws.width));
                ws.stats.groups = ws.groups.iter().map(|x| u32::from(x.idx)).collect();
                true
            }
        };
        let state = ws
            .groups
            .iter()
            .find(|x| x.idx == g)
            .is_some_and(|x| x.rule == Rule::State);
        if changed {
            self.publish_groups(wr, w);
        }
        state
    }

    /// Stores blocks for a worker from already-computed content hashes:
    /// `locals[i]` is [`key::local_hash`] of block i's tokens (what the
    /// index computes from `token_ids`), `hashes[i]` the engine's id of
    /// block i, `parent` the engine id of the block before the first
    /// (`None`: the chain starts here, from `seed`, see
    /// [`key::seed_for_lora`]), in KV-cache group 0. This is the path
    /// events take after decoding and hashing; benchmarks and tests call
    /// it directly.
    ///
    /// # Errors
    /// [`IndexError::UnknownWorker`].
    pub fn store_hashed(
        &self,
        id: super::WorkerId,
        parent: Option<u64>,
        seed: u64,
        hashes: &[u64],
        locals: &[u64],
        tier: Tier,
    ) -> Result<Applied, IndexError> {
        let mut wr = lock(&self.writer);
        Self::check(&wr, id)?;
        let w = id.0 as usize;
        let n = hashes.len().min(locals.len());
        let state_only = self.observe_group(&mut wr, w, 0, RuleKind::Full, 1, None);
        let spec = StoreSpec {
            group: 0,
            tier,
            state_only,
        };
        Ok(self.store_locked(
            &mut wr,
            w,
            parent,
            seed,
            &hashes[..n],
            &locals[..n],
            1,
            spec,
        ))
    }

    /// Removes blocks of a worker from one tier by engine id (the
    /// `BlockRemoved` path after decoding), in KV-cache group 0. Returns
    /// entries removed.
    ///
    /// # Errors
    /// [`IndexError::UnknownWorker`].
    pub fn remove_hashed(
        &self,
        id: super::WorkerId,
        hashes: &[u64],
        tier: Tier,
    ) -> Result<u64, IndexError> {
        let mut wr = lock(&self.writer);
        Self::check(&wr, id)?;
        Ok(self.remove_locked(&mut wr, id.0 as usize, 0, hashes, tier))
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

    /// A placeholder store (no tokens): tier `tier` for the blocks of
    /// `hashes` that worker `w` holds in group `g`.
    fn placeholder(
        &self,
        wr: &mut Writer,
        w: usize,
        g: u16,
        hashes: &[u64],
        tier: Tier,
    ) -> Applied {
        let mut unknown = 0u64;
        for &h in hashes {
            let mut any = false;
            for (nid, a, b) in self.block_ranges(wr, w, g, h) {
                let mut sh = write(&self.shards[self.node_shard(nid)].0);
                let node = sh.node_mut(self.node_slot(nid)).expect("live node");
                if let Ok(i) = node.hot.holder_index(w as u32, g) {
                    any |= node.hot.holders[i]
                        .runs
                        .add_tier_where_held(a, b, tier.bit());
                }
            }
            unknown += u64::from(!any);
        }
        let ws = wr.workers[w].as_mut().expect("checked");
        ws.stats.unknown_placeholders += unknown;
        Applied::default()
    }

    /// The positions engine block `h` covers in group `g` of worker `w`, as
    /// `(node, from, to)` offset ranges: the group's block width of keys
    /// ending at `h`'s position (only that position for state groups),
    /// walking back into parent nodes when a block straddles them.
    fn block_ranges(
        &self,
        wr: &mut Writer,
        w: usize,
        g: u16,
        h: u64,
    ) -> SmallVec<[(u32, u32, u32); 2]> {
        let mut out = SmallVec::new();
        let Some(((nid, off), _)) = self.resolve(wr, w, h) else {
            return out;
        };
        let ws = wr.workers[w].as_ref().expect("checked");
        let width = match ws.groups.iter().find(|x| x.idx == g) {
            Some(x) if x.rule != Rule::State => x.width,
            _ => 1,
        };
        let (mut nid, mut end, mut left) = (nid, off + 1, width);
        loop {
            let take = left.min(end);
            out.push((nid, end - take, end));
            left -= take;
            if left == 0 {
                break;
            }
            // Continue in the parent, just before this node's start.
            let sh = read(&self.shards[self.node_shard(nid)].0);
            let (hot, cold) = sh.node(self.node_slot(nid)).expect("live node");
            let (parent, start) = (cold.parent, hot.start);
            drop(sh);
            if parent == NONE {
                break;
            }
            let ps = read(&self.shards[self.node_shard(parent)].0);
            let pn = ps.hot(self.node_slot(parent)).expect("live node");
            end = start - pn.start;
            nid = parent;
        }
        out
    }

    fn apply_removed(&self, wr: &mut Writer, w: usize, r: &BlockRemoved) -> Applied {
        let n = r.block_hashes.len() as u64;
        let ws = wr.workers[w].as_mut().expect("checked");
        if r.locality.as_deref() == Some("REMOTE") {
            ws.stats.remote_blocks += n;
            return Applied {
                dropped: n,
                ..Applied::default()
            };
        }
        let Ok(g) = u16::try_from(r.group_idx.unwrap_or(0)) else {
            ws.stats.other_group_blocks += n;
            return Applied {
                dropped: n,
                ..Applied::default()
            };
        };
        let tier = Tier::from_medium(r.medium.as_deref());
        let hashes: SmallVec<[u64; 32]> = r.block_hashes.iter().map(BlockHash::id).collect();
        Applied {
            removed: self.remove_locked(wr, w, g, &hashes, tier),
            ..Applied::default()
        }
    }

    pub(super) fn remove_locked(
        &self,
        wr: &mut Writer,
        w: usize,
        g: u16,
        hashes: &[u64],
        tier: Tier,
    ) -> u64 {
        // Resolve every hash to offset ranges, then apply them per node,
        // merged, so a run of consecutive blocks is one range.
        let mut ranges: SmallVec<[Range; 32]> = SmallVec::new();
        let simple = Self::simple_group(wr, w, g);
        let mut b = 0;
        while b < hashes.len() {
            let rs = self.block_ranges(wr, w, g, hashes[b]);
            let single = rs.len() == 1;
            for (i, &(nid, from, to)) in rs.iter().enumerate() {
                ranges.push(Range {
                    node: nid,
                    from,
                    to,
                    block: b as u32,
                    own: i == 0,
                });
            }
            b += 1;
            if !(simple && single) {
                continue;
            }
            // Consecutive hashes of one event are usually neighbours in
            // the node: follow them under one read lock.
            let (nid, _, to) = rs[0];
            let sh = read(&self.shards[self.node_shard(nid)].0);
            let Some((_, cold)) = sh.node(self.node_slot(nid)) else {
                continue;
            };
            let mut off = to as usize - 1;
            while b < hashes.len() {
                let h = hashes[b];
                if cold.ehash.get(off + 1) == Some(&h) {
                    off += 1;
                } else if off > 0 && cold.ehash[off - 1] == h {
                    off -= 1;
                } else {
                    break;
                }
                let o = off as u32;
                ranges.push(Range {
                    node: nid,
                    from: o,
                    to: o + 1,
                    block: b as u32,
                    own: true,
                });
                b += 1;
            }
        }
        ranges.sort_unstable_by_key(|r| (r.node, r.from));
        let bit = tier.bit();
        let mut removed = 0u64;
        // Blocks of the event found held in this tier.
        let mut held: SmallVec<[bool; 32]> = smallvec::smallvec![false; hashes.len()];
        let mut drop_own: SmallVec<[u64; 4]> = SmallVec::new();
        let has_own = wr.workers[w]
            .as_ref()
            .is_some_and(|ws| !ws.overrides.is_empty());
        let mut touched: SmallVec<[u32; 4]> = SmallVec::new();
        let mut i = 0;
        while i < ranges.len() {
            let nid = ranges[i].node;
            let mut sh = write(&self.shards[self.node_shard(nid)].0);
            let node = sh.node_mut(self.node_slot(nid)).expect("live node");
            let Ok(x) = node.hot.holder_index(w as u32, g) else {
                while i < ranges.len() && ranges[i].node == nid {
                    i += 1;
                }
                continue;
            };
            let first = i;
            while i < ranges.len() && ranges[i].node == nid {
                let r = ranges[i];
                if node.hot.holders[x].runs.has_tier_in(r.from, r.to, bit) {
                    held[r.block as usize] = true;
                }
                i += 1;
            }
            // Merged ranges, then the removal.
            let mut j = first;
            let mut at_end = false;
            while j < i {
                let (a, mut b) = (ranges[j].from, ranges[j].to);
                while j + 1 < i && ranges[j + 1].from <= b {
                    j += 1;
                    b = b.max(ranges[j].to);
                }
                j += 1;
                removed += node.hot.holders[x].runs.remove(a, b, bit);
                at_end |= b >= node.hot.len();
            }
            if has_own {
                // A worker's own record goes when it holds the position in
                // no group any more.
                for r in &ranges[first..i] {
                    let p = r.to - 1;
                    if r.own
                        && !node
                            .hot
                            .holders
                            .iter()
                            .any(|h| h.worker == w as u32 && h.runs.tiers_at(p) != 0)
                    {
                        drop_own.push(hashes[r.block as usize]);
                    }
                }
            }
            node.hot.prune_holder(x);
            // Only a removal at the node's end can shorten what it needs
            // (checking costs a pass over its holders: thousands on a
            // shared prompt).
            if at_end && node.needed_len() < node.hot.len() {
                touched.push(nid);
            }
        }
        // Blocks not held in this tier (unknown hashes included).
        let unknown = held.iter().filter(|h| !**h).count() as u64;
        let ws = wr.workers[w].as_mut().expect("checked");
        for h in drop_own {
            ws.overrides.remove(&h);
        }
        ws.stats.removed_blocks += removed;
        ws.stats.blocks_held -= removed;
        ws.stats.unknown_removals += unknown;
        self.entries.fetch_sub(removed, Ordering::Relaxed);
        for nid in touched {
            self.trim(wr, nid);
        }
        removed
    }

    /// Whether group `g` of worker `w` is a plain one-key-per-block group
    /// (so a neighbouring hash is one position).
    fn simple_group(wr: &Writer, w: usize, g: u16) -> bool {
        wr.workers[w].as_ref().is_some_and(|ws| {
            ws.overrides.is_empty() && ws.groups.iter().any(|x| x.idx == g && x.width == 1)
        })
    }
}

/// Part of one removed block inside one node.
#[derive(Debug, Clone, Copy)]
struct Range {
    node: u32,
    from: u32,
    to: u32,
    /// Index of the block in the event.
    block: u32,
    /// Whether this part holds the block's own (hashed) position.
    own: bool,
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
