//! Applying `BlockRemoved`: the positions an engine block covers (also
//! what placeholder stores update), and the removal of a worker's blocks
//! from one tier, merged per node, with the worker's own hash records and
//! the trimming it may allow.

// w, g, h, k, n, s: worker, group, hash, keys per block, count, event (as
// in `write`).
#![allow(clippy::many_single_char_names)]

use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use crate::event::{BlockHash, BlockRemoved, Tier};
use crate::index::groups::Rule;
use crate::index::tree::NONE;
use crate::index::{Applied, IndexError, KvIndex, WorkerId, Writer, lock, read, write};

impl KvIndex {
    /// Removes blocks of a worker from one tier by engine id (the
    /// `BlockRemoved` path after decoding), in KV-cache group 0. Returns
    /// entries removed.
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
        Ok(self.remove_locked(&mut wr, id.0 as usize, 0, hashes, tier))
    }

    /// The positions engine block `h` covers in group `g` of worker `w`, as
    /// `(node, from, to)` offset ranges: the group's block width of keys
    /// ending at `h`'s position (only that position for state groups),
    /// walking back into parent nodes when a block straddles them.
    pub(super) fn block_ranges(
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

    pub(super) fn apply_removed(&self, wr: &mut Writer, w: usize, r: &BlockRemoved) -> Applied {
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
