//! The block tree's pieces: nodes (runs of chained block keys) and the
//! per-holder coverage of a node.
//!
//! A node ([`NodeMut`] edits one) is a run of consecutive chain positions `start..start+len`:
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

/// Keys per sample of a node's key array.
pub(crate) const SAMPLE: usize = 16;

/// The part of a node lookups read. It lives in its shard's head map
/// under the node's first key; with the key, the fields up to `holders`
/// fill one cache line (what a full match reads), the samples' pointer
/// starts the next.
#[derive(Debug, Clone)]
#[repr(C)]
pub(crate) struct Hot {
    /// The node's slot in its shard (for [`Cold`]).
    pub(crate) slot: u32,
    /// Chain position of `keys[0]`.
    pub(crate) start: u32,
    /// Our block key per position.
    keys: Vec<u64>,
    /// Sorted by `(worker, group)`.
    pub(crate) holders: Vec<Holder>,
    /// Every [`SAMPLE`]-th key (`keys[SAMPLE·i + SAMPLE - 1]`): a lookup
    /// finds where a query leaves the node in these few lines first.
    samples: Vec<u64>,
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
    pub(crate) fn new(slot: u32, start: u32) -> Self {
        Hot {
            slot,
            start,
            keys: Vec::new(),
            holders: Vec::new(),
            samples: Vec::new(),
        }
    }

    pub(crate) fn len(&self) -> u32 {
        self.keys.len() as u32
    }

    pub(crate) fn keys(&self) -> &[u64] {
        &self.keys
    }

    /// Appends keys (and their samples).
    pub(crate) fn extend(&mut self, keys: &[u64]) {
        let from = self.keys.len();
        self.keys.extend_from_slice(keys);
        let mut p = (from / SAMPLE + 1) * SAMPLE - 1;
        while p < self.keys.len() {
            self.samples.push(self.keys[p]);
            p += SAMPLE;
        }
    }

    /// Keeps the first `len` keys; returns the capacity freed in keys.
    pub(crate) fn truncate(&mut self, len: usize) {
        self.keys.truncate(len);
        self.samples.truncate(len / SAMPLE);
        if self.keys.capacity() > 32 && len * 4 < self.keys.capacity() {
            self.keys.shrink_to(len * 2);
            self.samples.shrink_to(len * 2 / SAMPLE);
        }
    }

    /// Length of the common prefix of this node's keys and `query` (which
    /// starts at the node's first position). Chained keys differ at every
    /// position after the first difference, so the matches form a prefix:
    /// the last position is checked first (a full match costs one load),
    /// then the samples (a few contiguous lines, scanned in order) give the
    /// group of [`SAMPLE`] keys the difference is in, which is scanned.
    #[inline]
    pub(crate) fn match_len(&self, query: &[BlockKey]) -> usize {
        let keys = &self.keys;
        let lim = keys.len().min(query.len());
        if lim == 0 || keys[0] != query[0].0 {
            return 0;
        }
        if keys[lim - 1] == query[lim - 1].0 {
            return lim;
        }
        // Samples wholly inside the compared range, then the first that
        // differs (their matches form a prefix too).
        let ns = self.samples.len().min(lim / SAMPLE);
        let s = &self.samples[..ns];
        let mut lo = 0usize;
        let mut hi = ns;
        // A long node: narrow the samples 8-way first.
        while hi - lo > 64 {
            let step = (hi - lo).div_ceil(8);
            let mut p = lo + step;
            let mut hits = 0;
            let mut n = 0;
            while p < hi {
                hits += usize::from(s[p - 1] == query[p * SAMPLE - 1].0);
                n += 1;
                p += step;
            }
            let new_lo = lo + hits * step;
            if hits < n {
                hi = (lo + (hits + 1) * step).min(hi);
            }
            lo = new_lo;
        }
        let c = lo
            + s[lo..hi]
                .iter()
                .enumerate()
                .take_while(|(i, k)| **k == query[(lo + i + 1) * SAMPLE - 1].0)
                .count();
        // keys[c·SAMPLE - 1] matches (or c = 0); the difference is in the
        // next group.
        let from = (c * SAMPLE).max(1);
        let to = ((c + 1) * SAMPLE).min(lim);
        from + keys[from..to]
            .iter()
            .zip(&query[from..to])
            .take_while(|(k, q)| **k == q.0)
            .count()
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
        + hot.samples.capacity() * 8
        + cold.ehash.capacity() * 8
        + hot.holders.capacity() * std::mem::size_of::<Holder>()
        + children
        + runs) as u64
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
    fn a_head_entry_is_small() {
        assert_eq!(std::mem::size_of::<(u64, Hot)>(), 88);
    }

    #[test]
    fn match_len_finds_the_first_difference() {
        let keys: Vec<u64> = (0..600).collect();
        let node = |len: usize| {
            let mut h = Hot::new(0, 0);
            // In pieces, as stores append them.
            for c in keys[..len].chunks(37) {
                h.extend(c);
            }
            h
        };
        let same: Vec<BlockKey> = keys.iter().map(|k| BlockKey(*k)).collect();
        for cut in [
            0usize, 1, 2, 15, 16, 17, 63, 64, 65, 66, 255, 256, 257, 511, 598, 599, 600,
        ] {
            let q: Vec<BlockKey> = (0..600u64)
                .map(|i| BlockKey(if (i as usize) < cut { i } else { i + 10_000 }))
                .collect();
            assert_eq!(node(600).match_len(&q), cut, "cut {cut}");
            assert_eq!(node(600).match_len(&q[..cut.min(300)]), cut.min(300));
            for len in [1, 2, 15, 16, 17, 65, 100, 599] {
                assert_eq!(
                    node(len).match_len(&q),
                    cut.min(len),
                    "cut {cut}, len {len}"
                );
                let mut t = node(600);
                t.truncate(len);
                assert_eq!(
                    t.match_len(&q),
                    cut.min(len),
                    "cut {cut}, truncated to {len}"
                );
            }
        }
        assert_eq!(node(10).match_len(&same), 10);
        assert_eq!(node(0).match_len(&same), 0);
        // A long node takes the 8-way narrowing over its samples.
        let long: Vec<u64> = (0..20_000).collect();
        let mut h = Hot::new(0, 0);
        h.extend(&long);
        for cut in [1usize, 1023, 1024, 1025, 9_999, 19_999, 20_000] {
            let q: Vec<BlockKey> = (0..20_000u64)
                .map(|i| BlockKey(if (i as usize) < cut { i } else { i + (1 << 40) }))
                .collect();
            assert_eq!(h.match_len(&q), cut, "long, cut {cut}");
        }
    }
}
