//! Sessions: which workers the engines say stored blocks for a session
//! (`session_id` on `BlockStored`, vLLM ≥ 0.30, SGLang ≥ 0.5.20).
//!
//! The engines attribute a store to the session of the request that
//! triggered it. The table keeps, per session, the workers that stored
//! for it and how deep its context there is (tokens), so a router can
//! send a session's next request where its context lives even when it
//! cannot key the prompt as the engine does (approximate tokenization,
//! a chat template it does not render exactly) or has never seen the
//! session (another replica routed it, or this one restarted).
//!
//! Depth per (session, worker): a store that starts a chain (no parent:
//! a session's first request, or a full re-report of its cached prefix)
//! sets it to at least the event's tokens; a store continuing a chain
//! adds its tokens (a chat's next turn stores only its new blocks).
//! Removals carry no session, so evictions are not seen: the depth is an
//! upper bound, and a router should prefer the block index where it has
//! one. A worker's clear drops it from every session.
//!
//! Bounded: two generations of at most `capacity / 2` sessions each; when
//! the newer fills, the older is dropped and the newer takes its place,
//! so the sessions stored into least recently go first. A store to a
//! session found in the older generation moves it to the newer. A
//! capacity of 0 turns the table off: it stores nothing.

use hashbrown::HashMap;
use smallvec::SmallVec;

use super::WorkerId;

/// Most workers remembered per session (the most recently stored into
/// are kept).
pub const MAX_HOLDERS: usize = 4;

/// One worker's part of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionHolder {
    /// The worker.
    pub worker: WorkerId,
    /// Tokens of the session's context the worker stored (an upper
    /// bound: evictions are not attributed to sessions).
    pub tokens: u64,
}

type Holders = SmallVec<[SessionHolder; 2]>;

/// The session table (see the module docs).
#[derive(Debug)]
pub(super) struct Sessions {
    newer: HashMap<u64, Holders>,
    older: HashMap<u64, Holders>,
    /// Most sessions per generation; 0: off.
    half: usize,
}

/// The table's key for a session id.
pub(super) fn session_key(id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(id.as_bytes())
}

impl Sessions {
    pub(super) fn new(capacity: usize) -> Self {
        Sessions {
            newer: HashMap::new(),
            older: HashMap::new(),
            half: if capacity == 0 {
                0
            } else {
                (capacity / 2).max(1)
            },
        }
    }

    /// Records that worker `w` stored `tokens` of session `key`, starting
    /// a chain (`fresh`) or continuing one.
    pub(super) fn stored(&mut self, key: u64, w: WorkerId, tokens: u64, fresh: bool) {
        if self.half == 0 {
            return;
        }
        let mut holders = self.take(key).unwrap_or_default();
        let mut h = match holders.iter().position(|h| h.worker == w) {
            Some(i) => holders.remove(i),
            None => SessionHolder {
                worker: w,
                tokens: 0,
            },
        };
        h.tokens = if fresh {
            h.tokens.max(tokens)
        } else {
            h.tokens.saturating_add(tokens)
        };
        // Most recent first; the least recent falls off.
        holders.insert(0, h);
        holders.truncate(MAX_HOLDERS);
        self.put(key, holders);
    }

    /// The workers that stored for session `key`, most recent first.
    pub(super) fn holders(&self, key: u64) -> &[SessionHolder] {
        self.newer
            .get(&key)
            .or_else(|| self.older.get(&key))
            .map_or(&[], |h| h.as_slice())
    }

    /// Drops worker `w` from every session (its cache was cleared).
    pub(super) fn forget_worker(&mut self, w: WorkerId) {
        for map in [&mut self.newer, &mut self.older] {
            map.retain(|_, hs| {
                hs.retain(|h| h.worker != w);
                !hs.is_empty()
            });
        }
    }

    /// Every session and its holders, the newer generation first.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, &[SessionHolder])> {
        self.newer
            .iter()
            .chain(self.older.iter())
            .map(|(k, h)| (*k, h.as_slice()))
    }

    /// Sessions held (both generations; a session is in one).
    pub(super) fn len(&self) -> usize {
        self.newer.len() + self.older.len()
    }

    fn take(&mut self, key: u64) -> Option<Holders> {
        self.newer.remove(&key).or_else(|| self.older.remove(&key))
    }

    fn put(&mut self, key: u64, holders: Holders) {
        if self.newer.len() >= self.half {
            self.older = std::mem::take(&mut self.newer);
        }
        self.newer.insert(key, holders);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_adds_along_a_chain_and_a_fresh_chain_sets_a_floor() {
        let mut s = Sessions::new(16);
        let k = session_key("chat-1");
        s.stored(k, WorkerId(3), 64, true);
        s.stored(k, WorkerId(3), 32, false);
        assert_eq!(s.holders(k)[0].tokens, 96, "a next turn adds its blocks");
        // A full re-report of the cached prefix (parent nil) must not
        // double the depth.
        s.stored(k, WorkerId(3), 96, true);
        assert_eq!(s.holders(k)[0].tokens, 96);
        s.stored(k, WorkerId(5), 16, true);
        let hs = s.holders(k);
        assert_eq!(hs.len(), 2);
        assert_eq!(hs[0].worker, WorkerId(5), "most recent first");
        assert!(s.holders(session_key("chat-2")).is_empty());
    }

    #[test]
    fn the_least_recent_holders_and_sessions_fall_off() {
        let mut s = Sessions::new(8);
        let k = session_key("a");
        for w in 0..6 {
            s.stored(k, WorkerId(w), 16, true);
        }
        let ws: Vec<u32> = s.holders(k).iter().map(|h| h.worker.0).collect();
        assert_eq!(ws, [5, 4, 3, 2]);
        // Capacity 8: two generations of 4. Session "a" is the oldest
        // once 8 others are stored after it.
        for i in 0..8 {
            s.stored(session_key(&format!("s{i}")), WorkerId(0), 16, true);
        }
        assert!(s.holders(k).is_empty(), "dropped with its generation");
        assert!(s.len() <= 8);
        // A store to a session in the older generation moves it forward.
        let old = session_key("s4");
        assert!(!s.holders(old).is_empty());
        s.stored(old, WorkerId(1), 16, true);
        for i in 8..12 {
            s.stored(session_key(&format!("s{i}")), WorkerId(0), 16, true);
        }
        assert_eq!(s.holders(old).len(), 2, "kept: it was stored into again");
    }

    #[test]
    fn a_table_of_no_capacity_stores_nothing() {
        let mut s = Sessions::new(0);
        s.stored(session_key("a"), WorkerId(1), 16, true);
        assert!(s.holders(session_key("a")).is_empty());
        assert_eq!(s.len(), 0);
        let mut one = Sessions::new(1);
        one.stored(session_key("a"), WorkerId(1), 16, true);
        assert_eq!(one.len(), 1, "a capacity of 1 still keeps one");
    }

    #[test]
    fn a_cleared_worker_leaves_every_session() {
        let mut s = Sessions::new(16);
        let (a, b) = (session_key("a"), session_key("b"));
        s.stored(a, WorkerId(1), 16, true);
        s.stored(a, WorkerId(2), 16, true);
        s.stored(b, WorkerId(1), 16, true);
        s.forget_worker(WorkerId(1));
        assert_eq!(s.holders(a).len(), 1);
        assert_eq!(s.holders(a)[0].worker, WorkerId(2));
        assert!(s.holders(b).is_empty());
        assert_eq!(s.len(), 1);
    }
}
