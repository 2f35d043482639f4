//! The block tree's pieces: nodes (runs of chained block keys) and the
//! per-holder coverage of a node.
//!
//! A [`Node`] is a run of consecutive chain positions `start..start+len`:
//! our block key and the engine's hash at each position. Another chain may
//! leave a node at any offset `o`: it continues in a child node whose
//! first position is `start + o` (its first key differs from `keys[o]`, or
//! `o == len`). Nodes never split and never move a position, so a handle
//! `(node, offset)` stays valid as long as the position exists.
//!
//! A [`Holder`] says which positions of one node one `(worker, group)`
//! holds, as [`Runs`]: sorted, disjoint `[start, end)` offset ranges with
//! a tier mask each. The usual holder is one run `[0, e)` on the GPU.

use smallvec::SmallVec;

use crate::key::BlockKey;

/// "No node": the parent of a root, an empty link.
pub(crate) const NONE: u32 = u32::MAX;

/// Tier classes a lookup answers, cumulative: GPU; GPU or CPU; GPU, CPU or
/// local disk; any tier.
pub(crate) const CLASSES: [u8; 4] = [0b0_0001, 0b0_0011, 0b0_0111, 0b1_1111];

/// One held range of a node's positions (offsets from the node's start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) start: u32,
    pub(crate) end: u32,
    pub(crate) tiers: u8,
}

/// The positions of one node one `(worker, group)` holds. Invariant: runs
/// are sorted, disjoint, non-empty, have a non-zero tier mask, and two
/// touching runs have different masks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Runs(SmallVec<[Run; 1]>);

impl Runs {
    pub(crate) fn as_slice(&self) -> &[Run] {
        &self.0
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Positions held in any tier.
    pub(crate) fn held(&self) -> u64 {
        self.0.iter().map(|r| u64::from(r.end - r.start)).sum()
    }

    /// One past the last held position (0 when empty).
    pub(crate) fn end(&self) -> u32 {
        self.0.last().map_or(0, |r| r.end)
    }

    /// The tier mask at offset `p` (0: not held).
    pub(crate) fn tiers_at(&self, p: u32) -> u8 {
        self.0
            .iter()
            .find(|r| r.start <= p && p < r.end)
            .map_or(0, |r| r.tiers)
    }

    /// Whether any offset of `[a, b)` is held in tier `bit`.
    pub(crate) fn has_tier_in(&self, a: u32, b: u32, bit: u8) -> bool {
        self.0
            .iter()
            .any(|r| r.tiers & bit != 0 && r.start < b && a < r.end)
    }

    /// Length of the leading stretch from offset 0 held in a tier of
    /// `class`.
    #[inline]
    pub(crate) fn leading(&self, class: u8) -> u32 {
        let mut end = 0;
        for r in &self.0 {
            if r.start != end || r.tiers & class == 0 {
                break;
            }
            end = r.end;
        }
        end
    }

    /// Adds tier `bit` to offsets `[a, b)`; returns how many of them were
    /// not held before (in any tier).
    pub(crate) fn add(&mut self, a: u32, b: u32, bit: u8) -> u64 {
        if a >= b {
            return 0;
        }
        // Fast paths: an empty holder, or extending the last run.
        if self.0.is_empty() {
            self.0.push(Run {
                start: a,
                end: b,
                tiers: bit,
            });
            return u64::from(b - a);
        }
        if let Some(last) = self.0.last_mut()
            && last.tiers == bit
            && last.start <= a
            && a <= last.end
        {
            let added = b.saturating_sub(last.end);
            last.end = last.end.max(b);
            return u64::from(added);
        }
        self.map_range(a, b, |t| t | bit).0
    }

    /// Removes tier `bit` from offsets `[a, b)`; returns how many of them
    /// are no longer held in any tier.
    pub(crate) fn remove(&mut self, a: u32, b: u32, bit: u8) -> u64 {
        if a >= b || self.0.is_empty() {
            return 0;
        }
        // Fast path: the tail of the last run, which holds only this tier.
        if let Some(last) = self.0.last_mut()
            && last.tiers == bit
            && last.start <= a
            && b >= last.end
            && a < last.end
        {
            let gone = last.end - a;
            if a == last.start {
                self.0.pop();
            } else {
                last.end = a;
            }
            return u64::from(gone);
        }
        self.map_range(a, b, |t| t & !bit).1
    }

    /// Adds tier `bit` to the held offsets of `[a, b)` only (placeholder
    /// stores); returns whether any was held.
    pub(crate) fn add_tier_where_held(&mut self, a: u32, b: u32, bit: u8) -> bool {
        let held = self.0.iter().any(|r| r.start < b && a < r.end);
        if held {
            self.map_range(a, b, |t| if t == 0 { 0 } else { t | bit });
        }
        held
    }

    /// Drops every offset from `len` on; returns how many were held.
    pub(crate) fn truncate(&mut self, len: u32) -> u64 {
        let mut gone = 0u64;
        while let Some(last) = self.0.last_mut() {
            if last.start >= len {
                gone += u64::from(last.end - last.start);
                self.0.pop();
            } else {
                if last.end > len {
                    gone += u64::from(last.end - len);
                    last.end = len;
                }
                break;
            }
        }
        gone
    }

    /// Applies `f` to the tier mask of every offset in `[a, b)` and
    /// re-canonicalises; returns (offsets that became held, offsets that
    /// stopped being held).
    fn map_range(&mut self, a: u32, b: u32, f: impl Fn(u8) -> u8) -> (u64, u64) {
        let mut out: SmallVec<[Run; 4]> = SmallVec::new();
        let (mut gained, mut lost) = (0u64, 0u64);
        let push = |out: &mut SmallVec<[Run; 4]>, start: u32, end: u32, tiers: u8| {
            if start >= end || tiers == 0 {
                return;
            }
            if let Some(l) = out.last_mut()
                && l.end == start
                && l.tiers == tiers
            {
                l.end = end;
                return;
            }
            out.push(Run { start, end, tiers });
        };
        let mut cursor = a; // next offset of [a, b) not yet emitted
        for r in &self.0 {
            // The part of r before a, or r entirely outside [a, b).
            if r.end <= a || r.start >= b {
                if r.start >= b && cursor < b {
                    // Gap inside [a, b) before this run: not held before.
                    let t = f(0);
                    if t != 0 {
                        gained += u64::from(b - cursor);
                    }
                    push(&mut out, cursor, b, t);
                    cursor = b;
                }
                push(&mut out, r.start, r.end, r.tiers);
                continue;
            }
            if r.start < a {
                push(&mut out, r.start, a, r.tiers);
            }
            let lo = r.start.max(a);
            if cursor < lo {
                let t = f(0);
                if t != 0 {
                    gained += u64::from(lo - cursor);
                }
                push(&mut out, cursor, lo, t);
            }
            let hi = r.end.min(b);
            let t = f(r.tiers);
            if t == 0 {
                lost += u64::from(hi - lo);
            }
            push(&mut out, lo, hi, t);
            cursor = hi;
            if r.end > b {
                push(&mut out, b, r.end, r.tiers);
            }
        }
        if cursor < b {
            let t = f(0);
            if t != 0 {
                gained += u64::from(b - cursor);
            }
            push(&mut out, cursor, b, t);
        }
        self.0 = out.into_iter().collect();
        (gained, lost)
    }
}

/// One `(worker, group)`'s coverage of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) worker: u32,
    pub(crate) group: u16,
    pub(crate) runs: Runs,
}

/// The part of a node lookups read. It lives in its shard's head map
/// under the node's first key, so the key, the node's start and the
/// pointers to its keys and holders share one cache line.
#[derive(Debug, Clone)]
pub(crate) struct Hot {
    /// The node's slot in its shard (for [`Cold`]).
    pub(crate) slot: u32,
    /// Chain position of `keys[0]`.
    pub(crate) start: u32,
    /// Our block key per position.
    pub(crate) keys: Vec<u64>,
    /// Sorted by `(worker, group)`.
    pub(crate) holders: Vec<Holder>,
}

/// The part only the writer reads, in its shard's slab.
#[derive(Debug, Clone)]
pub(crate) struct Cold {
    /// The node's first key (where its [`Hot`] part is).
    pub(crate) first: u64,
    /// The node this one leaves (its id), or [`NONE`] for a root.
    pub(crate) parent: u32,
    /// The engine hash recorded per position (0: none, e.g. an inner
    /// sub-block of a re-chunked engine block).
    pub(crate) ehash: Vec<u64>,
    /// `(offset, child id)` of the nodes leaving this one.
    pub(crate) children: SmallVec<[(u32, u32); 2]>,
    /// Store counter of the last store that touched this node.
    pub(crate) stamp: u64,
    /// Whether the eviction queue has an entry for this node.
    pub(crate) queued: bool,
}

impl Hot {
    pub(crate) fn len(&self) -> u32 {
        self.keys.len() as u32
    }

    /// Index of `(worker, group)`'s holder, or where to insert it.
    #[inline]
    pub(crate) fn holder_index(&self, worker: u32, group: u16) -> Result<usize, usize> {
        self.holders
            .binary_search_by(|h| (h.worker, h.group).cmp(&(worker, group)))
    }

    /// The holder of `(worker, group)`, created if missing.
    pub(crate) fn holder_mut(&mut self, worker: u32, group: u16) -> &mut Holder {
        let i = match self.holder_index(worker, group) {
            Ok(i) => i,
            Err(i) => {
                self.holders.insert(
                    i,
                    Holder {
                        worker,
                        group,
                        runs: Runs::default(),
                    },
                );
                i
            }
        };
        &mut self.holders[i]
    }

    /// Drops the holder at `i` if it holds nothing.
    pub(crate) fn prune_holder(&mut self, i: usize) {
        if self.holders[i].runs.is_empty() {
            self.holders.remove(i);
        }
    }
}

/// A node: both parts, borrowed from its shard.
#[derive(Debug)]
pub(crate) struct NodeMut<'a> {
    pub(crate) hot: &'a mut Hot,
    pub(crate) cold: &'a mut Cold,
}

impl NodeMut<'_> {
    /// Offsets that must stay: up to the last held position of any holder
    /// and up to the deepest child's offset.
    pub(crate) fn needed_len(&self) -> u32 {
        let held = self
            .hot
            .holders
            .iter()
            .map(|h| h.runs.end())
            .max()
            .unwrap_or(0);
        held.max(self.tail_start())
    }

    /// First offset of the tail that eviction may drop: past the deepest
    /// child (the whole node for a leaf).
    pub(crate) fn tail_start(&self) -> u32 {
        self.cold.children.iter().map(|c| c.0).max().unwrap_or(0)
    }
}

/// Bytes a node owns on the heap (capacities).
pub(crate) fn heap_bytes(hot: &Hot, cold: &Cold) -> u64 {
    let runs: usize = hot
        .holders
        .iter()
        .filter(|h| h.runs.0.spilled())
        .map(|h| h.runs.0.capacity() * std::mem::size_of::<Run>())
        .sum();
    let children = if cold.children.spilled() {
        cold.children.capacity() * 8
    } else {
        0
    };
    (hot.keys.capacity() * 8
        + cold.ehash.capacity() * 8
        + hot.holders.capacity() * std::mem::size_of::<Holder>()
        + children
        + runs) as u64
}

/// Length of the common prefix of `node_keys` and `query` (both start at
/// the node's first position). Chained keys differ at every position after
/// the first difference, so the matches form a prefix and a k-ary search
/// finds its end; the probes of one round are independent loads.
#[inline]
pub(crate) fn match_len(node_keys: &[u64], query: &[BlockKey]) -> usize {
    let lim = node_keys.len().min(query.len());
    if lim == 0 || node_keys[0] != query[0].0 {
        return 0;
    }
    if node_keys[lim - 1] == query[lim - 1].0 {
        return lim;
    }
    // node_keys[lo] matches, node_keys[hi] does not.
    let (mut lo, mut hi) = (0usize, lim - 1);
    while hi - lo > 1 {
        let span = hi - lo;
        if span <= 16 {
            let mut p = lo + 1;
            while p < hi && node_keys[p] == query[p].0 {
                p += 1;
            }
            return p;
        }
        let step = span.div_ceil(16);
        let mut hits = 0usize;
        let mut n = 0usize;
        let mut p = lo + step;
        while p < hi {
            hits += usize::from(node_keys[p] == query[p].0);
            n += 1;
            p += step;
        }
        let new_lo = lo + hits * step;
        if hits < n {
            hi = lo + (hits + 1) * step;
        }
        lo = new_lo;
    }
    hi
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(r: &Runs) -> Vec<(u32, u32, u8)> {
        r.as_slice()
            .iter()
            .map(|x| (x.start, x.end, x.tiers))
            .collect()
    }

    /// The reference: a tier mask per offset.
    fn masks(r: &Runs, n: u32) -> Vec<u8> {
        (0..n).map(|p| r.tiers_at(p)).collect()
    }

    #[test]
    fn runs_add_remove_and_stay_canonical() {
        let mut r = Runs::default();
        assert_eq!(r.add(0, 4, 1), 4);
        assert_eq!(r.add(4, 8, 1), 4);
        assert_eq!(runs(&r), vec![(0, 8, 1)]);
        assert_eq!(r.add(2, 10, 2), 2);
        assert_eq!(runs(&r), vec![(0, 2, 1), (2, 8, 3), (8, 10, 2)]);
        assert_eq!((r.leading(1), r.leading(2), r.leading(3)), (8, 0, 10));
        assert_eq!(r.remove(0, 10, 2), 2);
        assert_eq!(runs(&r), vec![(0, 8, 1)]);
        assert_eq!(r.remove(3, 4, 1), 1);
        assert_eq!(runs(&r), vec![(0, 3, 1), (4, 8, 1)]);
        assert_eq!(r.leading(1), 3);
        assert_eq!(r.add(3, 4, 1), 1);
        assert_eq!(runs(&r), vec![(0, 8, 1)]);
        assert_eq!(r.truncate(5), 3);
        assert_eq!(r.held(), 5);
        assert!(!r.add_tier_where_held(6, 9, 4));
        assert!(r.add_tier_where_held(4, 9, 4));
        assert_eq!(runs(&r), vec![(0, 4, 1), (4, 5, 5)]);
        assert_eq!(r.remove(0, 5, 1), 4);
        assert_eq!(runs(&r), vec![(4, 5, 4)]);
    }

    #[test]
    #[allow(clippy::many_single_char_names)] // runs, mask, rng, range ends, bit
    fn runs_agree_with_a_mask_per_offset() {
        // A deterministic walk of adds and removes against the reference.
        let mut r = Runs::default();
        let mut m = vec![0u8; 24];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..4000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let a = (x % 24) as u32;
            let b = (a + 1 + ((x >> 8) % 6) as u32).min(24);
            let bit = 1u8 << ((x >> 16) % 3);
            let before = m.iter().filter(|t| **t != 0).count() as u64;
            if x >> 40 & 1 == 0 {
                let got = r.add(a, b, bit);
                for t in &mut m[a as usize..b as usize] {
                    *t |= bit;
                }
                let after = m.iter().filter(|t| **t != 0).count() as u64;
                assert_eq!(got, after - before);
            } else {
                let got = r.remove(a, b, bit);
                for t in &mut m[a as usize..b as usize] {
                    *t &= !bit;
                }
                let after = m.iter().filter(|t| **t != 0).count() as u64;
                assert_eq!(got, before - after);
            }
            assert_eq!(masks(&r, 24), m);
            let s = r.as_slice();
            for w in s.windows(2) {
                assert!(w[0].end <= w[1].start);
                assert!(w[0].end < w[1].start || w[0].tiers != w[1].tiers);
            }
            assert!(s.iter().all(|x| x.start < x.end && x.tiers != 0));
        }
    }

    #[test]
    fn a_head_entry_fills_one_cache_line() {
        assert_eq!(std::mem::size_of::<(u64, Hot)>(), 64);
    }

    #[test]
    fn match_len_finds_the_first_difference() {
        let node: Vec<u64> = (0..600).collect();
        let same: Vec<BlockKey> = node.iter().map(|k| BlockKey(*k)).collect();
        for cut in [0usize, 1, 2, 15, 16, 17, 255, 256, 257, 511, 599, 600] {
            let q: Vec<BlockKey> = (0..600u64)
                .map(|i| BlockKey(if (i as usize) < cut { i } else { i + 10_000 }))
                .collect();
            assert_eq!(match_len(&node, &q), cut, "cut {cut}");
            assert_eq!(match_len(&node, &q[..cut.min(300)]), cut.min(300));
        }
        assert_eq!(match_len(&node[..10], &same), 10);
        assert_eq!(match_len(&[], &same), 0);
    }
}
