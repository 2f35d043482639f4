//! Dropping blocks wholesale: clearing a worker, trimming nodes nobody
//! needs, and the memory budget's eviction.
//!
//! **Trim.** A node keeps its positions up to the last one any holder
//! holds or the deepest child leaves from; past that they are dropped
//! (with their engine records). A node left with nothing is freed and its
//! parent trimmed in turn, so memory is returned as blocks go.
//!
//! **Eviction.** When a store would pass `max_entries`, whole tails of
//! chains are dropped, least recently stored first, until the index is
//! back to 15/16 of its budget (so eviction runs once per many stores,
//! not on every one). A node's tail is what lies past its deepest child:
//! a leaf entirely, a shared prefix only after every chain continuing it
//! is gone. The node being stored into is never evicted. Stores are
//! counted, not timed: "recent" is the index's store counter.

use std::cmp::Reverse;
use std::sync::atomic::Ordering;

use super::tree::NONE;
use super::{KvIndex, Writer, read, write};

impl KvIndex {
    /// Drops every entry of worker `w`; returns how many.
    pub(super) fn clear_locked(&self, wr: &mut Writer, w: usize) -> u64 {
        let wid = w as u32;
        let mut removed = 0u64;
        let mut touched = Vec::new();
        for (s, shard) in self.shards.iter().enumerate() {
            let mut sh = write(&shard.0);
            for hot in sh.heads.values_mut() {
                let before = hot.holders.len();
                hot.holders.retain(|h| {
                    if h.worker == wid {
                        removed += h.runs.held();
                        false
                    } else {
                        true
                    }
                });
                if hot.holders.len() != before {
                    touched.push(self.node_id(s, hot.slot));
                }
            }
        }
        self.entries.fetch_sub(removed, Ordering::Relaxed);
        for nid in touched {
            if self.alive(nid) {
                self.trim(wr, nid);
            }
        }
        if let Some(ws) = wr.workers[w].as_mut() {
            ws.stats.blocks_held = 0;
            ws.stats.clears += 1;
            ws.overrides = super::EngineMap::default();
            ws.position = None;
        }
        write(&self.sessions).forget_worker(super::WorkerId(wid));
        removed
    }

    pub(super) fn alive(&self, nid: u32) -> bool {
        let sh = read(&self.shards[self.node_shard(nid)].0);
        sh.cold
            .get(self.node_slot(nid))
            .is_some_and(Option::is_some)
    }

    /// Drops the positions node `nid` no longer needs; frees it when empty
    /// and trims its parent in turn.
    pub(super) fn trim(&self, wr: &mut Writer, nid: u32) {
        let mut cur = nid;
        loop {
            let s = self.node_shard(cur);
            let slot = self.node_slot(cur);
            let mut sh = write(&self.shards[s].0);
            let Some(node) = sh.node_mut(slot) else {
                return;
            };
            let need = node.needed_len() as usize;
            let len = node.hot.keys().len();
            let first = node.cold.first;
            if need < len {
                for p in need..len {
                    let h = node.cold.ehash[p];
                    if h != 0 && wr.engine.get(&h) == Some(&super::write::handle((cur, p as u32))) {
                        wr.engine.remove(&h);
                    }
                }
                node.hot.truncate(need);
                node.cold.ehash.truncate(need);
                if node.cold.ehash.capacity() > 32 && need * 4 < node.cold.ehash.capacity() {
                    node.cold.ehash.shrink_to(need * 2);
                }
                self.positions
                    .fetch_sub((len - need) as u64, Ordering::Relaxed);
                if wr.engine.capacity() > 1024 && wr.engine.len() * 4 < wr.engine.capacity() {
                    wr.engine.shrink_to(wr.engine.len() * 2);
                }
            }
            if need > 0 || !node.cold.children.is_empty() || !node.hot.holders.is_empty() {
                // Still needed. Its tail may be evictable now.
                if !node.cold.queued && (node.tail_start() as usize) < node.hot.keys().len() {
                    node.cold.queued = true;
                    wr.lrs.push(Reverse((node.cold.stamp, cur)));
                }
                return;
            }
            // Empty: free it and trim its parent.
            let (parent, stamp) = (node.cold.parent, node.cold.stamp);
            sh.cold[slot] = None;
            sh.live -= 1;
            sh.heads.remove(&first);
            if sh.live == 0 {
                sh.cold = Vec::new();
                sh.free = Vec::new();
                sh.heads = super::KeyMap::default();
            } else {
                sh.free.push(slot as u32);
                if sh.heads.capacity() > 64 && sh.heads.len() * 4 < sh.heads.capacity() {
                    let n = sh.heads.len() * 2;
                    sh.heads.shrink_to(n);
                }
            }
            drop(sh);
            self.nodes.fetch_sub(1, Ordering::Relaxed);
            if parent == NONE {
                return;
            }
            let mut ps = write(&self.shards[self.node_shard(parent)].0);
            if let Some(pn) = ps.node_mut(self.node_slot(parent)) {
                pn.cold.children.retain(|c| c.1 != cur);
                // A parent inherits the recency of what it loses.
                pn.cold.stamp = pn.cold.stamp.max(stamp);
            }
            drop(ps);
            cur = parent;
        }
    }

    /// Makes room for `incoming` entries if the budget needs it, never
    /// touching node `protect`.
    pub(super) fn evict_for(&self, wr: &mut Writer, incoming: u64, protect: Option<u32>) {
        let max = self.config.max_entries;
        if self.entries.load(Ordering::Relaxed) + incoming <= max {
            return;
        }
        let target = (max - max / 16).saturating_sub(incoming);
        let mut evicted = 0u64;
        let mut deferred = Vec::new();
        while self.entries.load(Ordering::Relaxed) > target {
            let Some(Reverse((stamp, nid))) = wr.lrs.pop() else {
                break;
            };
            if Some(nid) == protect {
                deferred.push(Reverse((stamp, nid)));
                continue;
            }
            let s = self.node_shard(nid);
            let mut sh = write(&self.shards[s].0);
            let Some(node) = sh.node_mut(self.node_slot(nid)) else {
                continue;
            };
            if node.cold.stamp != stamp {
                // Stored since it was queued: queue it at its new stamp.
                wr.lrs.push(Reverse((node.cold.stamp, nid)));
                continue;
            }
            node.cold.queued = false;
            let tail = node.tail_start();
            if tail >= node.hot.len() {
                continue;
            }
            let mut gone_total = 0u64;
            for h in &mut node.hot.holders {
                let gone = h.runs.truncate(tail);
                if gone > 0 {
                    gone_total += gone;
                    if let Some(ws) = wr
                        .workers
                        .get_mut(h.worker as usize)
                        .and_then(Option::as_mut)
                    {
                        ws.stats.blocks_held -= gone;
                        ws.stats.evicted_blocks += gone;
                    }
                }
            }
            node.hot.holders.retain(|h| !h.runs.is_empty());
            drop(sh);
            self.entries.fetch_sub(gone_total, Ordering::Relaxed);
            evicted += gone_total;
            self.trim(wr, nid);
        }
        wr.lrs.extend(deferred);
        wr.evictions += 1;
        wr.evicted_entries += evicted;
        tracing::debug!(
            evicted,
            budget = max,
            entries = self.entries.load(Ordering::Relaxed),
            "kv index over budget: evicted the least recently stored chain tails"
        );
    }
}
