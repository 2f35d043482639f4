//! The set of workers holding one block key, packed for memory.
//!
//! A holder is one `u64`: worker id (bits 0..32), tier mask (bits 32..40),
//! and the number of that worker's held blocks whose parent is this block
//! (bits 40..64, saturating), which the index needs to keep its hole
//! count exact. Holders are kept sorted by worker id. Up to two live
//! inline; more go to a boxed slice that grows four slots at a time.

pub(crate) const EMPTY: u64 = u64::MAX;
const WORKER_MASK: u64 = 0xffff_ffff;
const TIER_SHIFT: u32 = 32;
const CHILD_SHIFT: u32 = 40;
const CHILD_MAX: u64 = (1 << 24) - 1;

#[inline]
pub(crate) fn pack(worker: u32, tiers: u8, children: u32) -> u64 {
    u64::from(worker)
        | (u64::from(tiers) << TIER_SHIFT)
        | (u64::from(children).min(CHILD_MAX) << CHILD_SHIFT)
}
#[inline]
pub(crate) fn worker(h: u64) -> u32 {
    (h & WORKER_MASK) as u32
}
#[inline]
pub(crate) fn tiers(h: u64) -> u8 {
    (h >> TIER_SHIFT) as u8
}
#[inline]
pub(crate) fn children(h: u64) -> u32 {
    (h >> CHILD_SHIFT) as u32
}
#[inline]
pub(crate) fn with_tiers(h: u64, t: u8) -> u64 {
    (h & !(0xff << TIER_SHIFT)) | (u64::from(t) << TIER_SHIFT)
}
#[inline]
pub(crate) fn with_children(h: u64, c: u32) -> u64 {
    (h & ((1 << CHILD_SHIFT) - 1)) | (u64::from(c).min(CHILD_MAX) << CHILD_SHIFT)
}

#[derive(Debug, Clone)]
pub(crate) enum Holders {
    Inline {
        len: u8,
        items: [u64; 2],
    },
    /// `buf[..len]` live; capacity grows by 4 slots at a time (10 holders
    /// cost 12 slots, not 16).
    Heap {
        len: u32,
        buf: Box<[u64]>,
    },
}

const GROW: usize = 4;

impl Holders {
    pub(crate) fn new() -> Self {
        Holders::Inline {
            len: 0,
            items: [EMPTY; 2],
        }
    }

    #[inline]
    pub(crate) fn as_slice(&self) -> &[u64] {
        match self {
            Holders::Inline { len, items } => &items[..usize::from(*len)],
            Holders::Heap { len, buf } => &buf[..*len as usize],
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u64] {
        match self {
            Holders::Inline { len, items } => &mut items[..usize::from(*len)],
            Holders::Heap { len, buf } => &mut buf[..*len as usize],
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// Heap words owned.
    #[cfg(test)]
    pub(crate) fn heap_words(&self) -> usize {
        match self {
            Holders::Inline { .. } => 0,
            Holders::Heap { buf, .. } => buf.len(),
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
    pub(crate) fn get(&self, w: u32) -> Option<u64> {
        self.find(w).map(|i| self.as_slice()[i])
    }

    pub(crate) fn set(&mut self, i: usize, h: u64) {
        self.as_mut_slice()[i] = h;
    }

    /// Inserts a holder for a worker not yet present; returns the change in
    /// heap words.
    #[allow(clippy::many_single_char_names)]
    pub(crate) fn insert(&mut self, h: u64) -> isize {
        let w = worker(h);
        let s = self.as_slice();
        let at = s.partition_point(|x| worker(*x) < w);
        let n = s.len();
        match self {
            Holders::Inline { len, items } if n < 2 => {
                items.copy_within(at..n, at + 1);
                items[at] = h;
                *len += 1;
                0
            }
            Holders::Inline { items, .. } => {
                let mut b = vec![EMPTY; GROW].into_boxed_slice();
                b[..at].copy_from_slice(&items[..at]);
                b[at] = h;
                b[at + 1..=n].copy_from_slice(&items[at..n]);
                *self = Holders::Heap { len: 3, buf: b };
                GROW as isize
            }
            Holders::Heap { len, buf } => {
                *len += 1;
                if n < buf.len() {
                    buf.copy_within(at..n, at + 1);
                    buf[at] = h;
                    0
                } else {
                    let mut nb = vec![EMPTY; buf.len() + GROW].into_boxed_slice();
                    nb[..at].copy_from_slice(&buf[..at]);
                    nb[at] = h;
                    nb[at + 1..=n].copy_from_slice(&buf[at..n]);
                    *buf = nb;
                    GROW as isize
                }
            }
        }
    }

    /// Removes the holder at `i`; returns the change in heap words.
    pub(crate) fn remove(&mut self, i: usize) -> isize {
        let n = self.as_slice().len();
        match self {
            Holders::Inline { len, items } => {
                items.copy_within(i + 1..n, i);
                items[n - 1] = EMPTY;
                *len -= 1;
                0
            }
            Holders::Heap { len, buf } => {
                buf.copy_within(i + 1..n, i);
                buf[n - 1] = EMPTY;
                let left = n - 1;
                *len = left as u32;
                if left <= 2 {
                    let mut items = [EMPTY; 2];
                    items[..left].copy_from_slice(&buf[..left]);
                    let freed = buf.len() as isize;
                    *self = Holders::Inline {
                        len: left as u8,
                        items,
                    };
                    -freed
                } else if left + 2 * GROW <= buf.len() {
                    let nb: Box<[u64]> = buf[..left + GROW].into();
                    let shrink = buf.len() - nb.len();
                    *buf = nb;
                    -(shrink as isize)
                } else {
                    0
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_remove_keeps_sorted_and_returns_memory() {
        let mut h = Holders::new();
        let mut words = 0isize;
        for w in [5u32, 1, 9, 3, 7, 2, 8] {
            assert!(h.find(w).is_none());
            words += h.insert(pack(w, 1, 0));
        }
        let ws: Vec<u32> = h.as_slice().iter().map(|x| worker(*x)).collect();
        assert_eq!(ws, vec![1, 2, 3, 5, 7, 8, 9]);
        assert_eq!(words, h.heap_words() as isize);
        for w in [9u32, 1, 5, 3, 7] {
            let i = h.find(w).expect("present");
            words += h.remove(i);
        }
        assert_eq!(h.as_slice().len(), 2);
        assert_eq!(words, 0);
        assert_eq!(h.heap_words(), 0);
        let i = h.find(8).expect("present");
        h.set(i, with_children(with_tiers(h.as_slice()[i], 3), 7));
        let x = h.get(8).expect("present");
        assert_eq!((worker(x), tiers(x), children(x)), (8, 3, 7));
    }
}
