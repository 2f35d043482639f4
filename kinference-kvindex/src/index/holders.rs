//! The set of workers holding one block key, packed for memory and for
//! one cache line per key.
//!
//! A holder is one `u32`: worker id (bits 0..20), tier mask (bits 20..24)
//! and the number of that worker's held blocks whose parent is this block
//! (bits 24..32; [`SPILL`] means "255 or more, see the worker's side
//! table"), which the index needs to keep its hole count exact. Holders
//! are kept sorted by worker id. Up to [`INLINE`] live inline, so a key
//! and its holders fill one 64-byte hash-table bucket and a lookup probe
//! costs no extra pointer chase; more go to a heap vector.

/// Largest worker id + 1.
pub(crate) const MAX_WORKERS: u32 = 1 << 20;
/// Holders stored inline.
pub(crate) const INLINE: usize = 13;
/// Children count meaning "in the side table".
pub(crate) const SPILL: u32 = 255;
const WORKER_MASK: u32 = MAX_WORKERS - 1;
const TIER_SHIFT: u32 = 20;
const CHILD_SHIFT: u32 = 24;

#[inline]
pub(crate) fn pack(worker: u32, tiers: u8, children: u32) -> u32 {
    (worker & WORKER_MASK)
        | (u32::from(tiers & 0xf) << TIER_SHIFT)
        | (children.min(SPILL) << CHILD_SHIFT)
}
#[inline]
pub(crate) fn worker(h: u32) -> u32 {
    h & WORKER_MASK
}
#[inline]
pub(crate) fn tiers(h: u32) -> u8 {
    ((h >> TIER_SHIFT) & 0xf) as u8
}
/// The inline children field (0..=[`SPILL`]).
#[inline]
pub(crate) fn children(h: u32) -> u32 {
    h >> CHILD_SHIFT
}
#[inline]
pub(crate) fn with_tiers(h: u32, t: u8) -> u32 {
    (h & !(0xf << TIER_SHIFT)) | (u32::from(t & 0xf) << TIER_SHIFT)
}
#[inline]
pub(crate) fn with_children(h: u32, c: u32) -> u32 {
    (h & ((1 << CHILD_SHIFT) - 1)) | (c.min(SPILL) << CHILD_SHIFT)
}

#[derive(Debug, Clone)]
pub(crate) enum Holders {
    Inline { len: u8, items: [u32; INLINE] },
    Heap(Vec<u32>),
}

impl Holders {
    pub(crate) fn new() -> Self {
        Holders::Inline {
            len: 0,
            items: [0; INLINE],
        }
    }

    #[inline]
    pub(crate) fn as_slice(&self) -> &[u32] {
        match self {
            Holders::Inline { len, items } => &items[..usize::from(*len)],
            Holders::Heap(v) => v,
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u32] {
        match self {
            Holders::Inline { len, items } => &mut items[..usize::from(*len)],
            Holders::Heap(v) => v,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// Heap words (u32) owned.
    pub(crate) fn heap_words(&self) -> usize {
        match self {
            Holders::Inline { .. } => 0,
            Holders::Heap(v) => v.capacity(),
        }
    }

    /// Index of `w`'s holder, if any.
    #[inline]
    pub(crate) fn find(&self, w: u32) -> Option<usize> {
        let s = self.as_slice();
        if s.len() <= 16 {
            s.iter().position(|h| worker(*h) == w)
        } else {
            s.binary_search_by_key(&w, |h| worker(*h)).ok()
        }
    }

    #[inline]
    pub(crate) fn get(&self, w: u32) -> Option<u32> {
        self.find(w).map(|i| self.as_slice()[i])
    }

    pub(crate) fn set(&mut self, i: usize, h: u32) {
        self.as_mut_slice()[i] = h;
    }

    /// Inserts a holder for a worker not yet present; returns the change in
    /// heap words.
    pub(crate) fn insert(&mut self, h: u32) -> isize {
        let w = worker(h);
        let at = self.as_slice().partition_point(|x| worker(*x) < w);
        let before = self.heap_words() as isize;
        match self {
            Holders::Inline { len, items } if usize::from(*len) < INLINE => {
                let n = usize::from(*len);
                items.copy_within(at..n, at + 1);
                items[at] = h;
                *len += 1;
            }
            Holders::Inline { items, .. } => {
                let mut v = Vec::with_capacity(INLINE * 2);
                v.extend_from_slice(&items[..at]);
                v.push(h);
                v.extend_from_slice(&items[at..]);
                *self = Holders::Heap(v);
            }
            Holders::Heap(v) => v.insert(at, h),
        }
        self.heap_words() as isize - before
    }

    /// Removes the holder at `i`; returns the change in heap words.
    pub(crate) fn remove(&mut self, i: usize) -> isize {
        let before = self.heap_words() as isize;
        match self {
            Holders::Inline { len, items } => {
                let n = usize::from(*len);
                items.copy_within(i + 1..n, i);
                items[n - 1] = 0;
                *len -= 1;
            }
            Holders::Heap(v) => {
                v.remove(i);
                if v.len() <= INLINE {
                    let mut items = [0; INLINE];
                    items[..v.len()].copy_from_slice(v);
                    *self = Holders::Inline {
                        len: v.len() as u8,
                        items,
                    };
                } else if v.len() * 4 <= v.capacity() {
                    v.shrink_to(v.len() * 2);
                }
            }
        }
        self.heap_words() as isize - before
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_and_its_inline_holders_fill_one_cache_line() {
        assert_eq!(std::mem::size_of::<(u64, Holders)>(), 64);
    }

    #[test]
    fn insert_remove_keeps_sorted_and_returns_memory() {
        let mut h = Holders::new();
        let mut words = 0isize;
        let ids: Vec<u32> = (0..40).map(|i| (i * 7919) % 1000).collect();
        for w in &ids {
            assert!(h.find(*w).is_none());
            words += h.insert(pack(*w, 1, 0));
        }
        let ws: Vec<u32> = h.as_slice().iter().map(|x| worker(*x)).collect();
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        assert_eq!(ws, sorted);
        assert_eq!(words, h.heap_words() as isize);
        for w in &ids[..30] {
            let i = h.find(*w).expect("present");
            words += h.remove(i);
        }
        assert_eq!(h.as_slice().len(), 10);
        assert_eq!(words, 0);
        assert_eq!(h.heap_words(), 0);
        let i = h.find(ids[35]).expect("present");
        h.set(i, with_children(with_tiers(h.as_slice()[i], 3), 7));
        let x = h.get(ids[35]).expect("present");
        assert_eq!((worker(x), tiers(x), children(x)), (ids[35], 3, 7));
        assert_eq!(children(with_children(x, 10_000)), SPILL);
    }
}
