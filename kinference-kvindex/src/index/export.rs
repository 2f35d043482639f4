//! Copying the index's contents out and in ([`crate::snapshot`]): what a
//! starting router replica rebuilds its index from, and where each
//! worker's stream stood when the copy was made.
//!
//! **Export** runs under the writer lock, so no event is applied while it
//! reads: the blocks and every worker's [`Position`] agree. Lookups go on
//! (they only take shard read locks). It walks the tree breadth first
//! from the roots and stops before the byte budget would be passed.
//!
//! **Import** adds one worker's part to this index, beside whatever it
//! holds already (a union): the snapshot's keys are walked as a store of
//! them would walk them (existing positions are matched, missing ones
//! appended or started as new nodes), the worker's held runs are added to
//! the positions they map to, and the engine hashes it names them by are
//! recorded as its events would record them. Room is made for the whole
//! part first (the budget's eviction never runs while positions are
//! mapped); what would still pass the budget is not imported.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;

use super::groups::{Group, RuleKind};
use super::tree::NONE;
use super::write::{Pos, handle, unhandle};
use super::{IndexError, KvIndex, WorkerId, Writer, lock, read, write};
use crate::codec::msgpack::Writer as Msg;
use crate::event::EventBatch;
use crate::snapshot::{
    Position, ROOT, SnapGroup, SnapHolder, SnapWorker, Snapshot, write_head, write_node,
};

/// What an import added.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Imported {
    /// Entries added (held runs new to this index).
    pub entries: u64,
    /// Chain positions this index did not have.
    pub positions: u64,
    /// Entries left out: past the memory budget, or under a position this
    /// index already uses for another chain (a 64-bit key collision).
    pub skipped: u64,
}

fn snap_group(g: &Group) -> SnapGroup {
    SnapGroup {
        idx: g.idx,
        kind: match g.kind {
            RuleKind::Full => 0,
            RuleKind::Window => 1,
            RuleKind::State => 2,
        },
        width: g.width,
        align: g.align,
        window: g.window_tokens,
    }
}

impl KvIndex {
    /// Applies a batch for one worker and records it as the last batch of
    /// the worker's stream applied ([`KvIndex::position`]), in one step:
    /// an [`KvIndex::export`] sees both or neither.
    ///
    /// # Errors
    /// [`IndexError::UnknownWorker`].
    pub fn apply_batch_at(
        &self,
        id: WorkerId,
        batch: &EventBatch,
        at: Position,
    ) -> Result<super::Applied, IndexError> {
        let mut wr = lock(&self.writer);
        Self::check(&wr, id)?;
        let w = id.0 as usize;
        let applied = self.apply_batch_locked(&mut wr, w, batch);
        if let Some(ws) = wr.workers[w].as_mut() {
            ws.position = Some(at);
        }
        Ok(applied)
    }

    /// Where worker `id`'s stream stood at its last batch applied with
    /// [`KvIndex::apply_batch_at`] (`None` before one, and after its
    /// blocks were cleared).
    pub fn position(&self, id: WorkerId) -> Option<Position> {
        let wr = lock(&self.writer);
        wr.workers.get(id.0 as usize)?.as_ref()?.position
    }

    /// Encodes the index's contents ([`crate::snapshot`]) in at most
    /// `max_bytes` (nodes nearest the roots first; the snapshot says
    /// whether some were left out). Holds the writer lock throughout: one
    /// pass over the nodes, about the cost of copying them.
    pub fn export(&self, max_bytes: usize) -> Vec<u8> {
        let wr = lock(&self.writer);
        // Workers by id, and their index in the snapshot.
        let mut part: Vec<Option<u32>> = vec![None; wr.workers.len()];
        let mut workers: Vec<SnapWorker> = Vec::new();
        for (i, ws) in wr.workers.iter().enumerate() {
            let Some((ws, r)) = ws
                .as_ref()
                .and_then(|ws| Some((ws, ws.stats.worker.clone()?)))
            else {
                continue;
            };
            part[i] = Some(workers.len() as u32);
            workers.push(SnapWorker {
                worker: r,
                width: ws.width,
                position: ws.position,
                groups: ws.groups.iter().map(snap_group).collect(),
                overrides: ws
                    .overrides
                    .iter()
                    .map(|(h, (hd, _))| {
                        let (n, o) = unhandle(*hd);
                        (n, o, *h)
                    })
                    .collect(),
                sessions: Vec::new(),
                entries: 0,
            });
        }
        // Sessions, the most recently stored into first, in at most a
        // quarter of the budget (the blocks matter more).
        let mut room = max_bytes / 4 / 16;
        for (key, holders) in read(&self.sessions).iter() {
            for h in holders {
                if room == 0 {
                    break;
                }
                if let Some(Some(i)) = part.get(h.worker.0 as usize) {
                    workers[*i as usize].sessions.push((key, h.tokens));
                    room -= 1;
                }
            }
        }
        // The head with every override bounds the head actually written.
        let head_bound = {
            let mut m = Msg::default();
            write_head(&mut m, true, &workers);
            m.bytes().len() + 5
        };
        let budget = max_bytes.saturating_sub(head_bound);
        let mut roots = Vec::new();
        for (s, shard) in self.shards.iter().enumerate() {
            let sh = read(&shard.0);
            for (slot, c) in sh.cold.iter().enumerate() {
                if c.as_ref().is_some_and(|c| c.parent == NONE) {
                    roots.push(self.node_id(s, slot as u32));
                }
            }
        }
        let mut queue: VecDeque<(u32, u32, u32)> =
            roots.into_iter().map(|n| (n, ROOT, 0)).collect();
        let mut sent: HashMap<u32, u32> = HashMap::new();
        let mut nodes: Vec<u8> = Vec::new();
        let mut truncated = false;
        let mut holders: Vec<SnapHolder> = Vec::new();
        while let Some((nid, parent, at)) = queue.pop_front() {
            let sh = read(&self.shards[self.node_shard(nid)].0);
            let Some((hot, cold)) = sh.node(self.node_slot(nid)) else {
                continue;
            };
            holders.clear();
            for h in &hot.holders {
                let Some(w) = part.get(h.worker as usize).copied().flatten() else {
                    continue;
                };
                holders.push(SnapHolder {
                    worker: w,
                    group: h.group,
                    runs: h
                        .runs
                        .as_slice()
                        .iter()
                        .map(|r| (r.start, r.end, r.tiers))
                        .collect(),
                });
            }
            // Sorted by (snapshot worker, group), as decoding checks.
            holders.sort_by_key(|h| (h.worker, h.group));
            let mut m = Msg::default();
            write_node(&mut m, parent, at, hot.keys(), &cold.ehash, &holders);
            if nodes.len() + m.bytes().len() > budget {
                truncated = true;
                break;
            }
            nodes.extend_from_slice(m.bytes());
            let me = sent.len() as u32;
            sent.insert(nid, me);
            queue.extend(cold.children.iter().map(|&(off, child)| (child, me, off)));
        }
        // Overrides at positions sent, still valid (the key matches).
        for sw in &mut workers {
            sw.overrides.retain_mut(|(n, o, _)| {
                let Some(&me) = sent.get(n) else {
                    return false;
                };
                let sh = read(&self.shards[self.node_shard(*n)].0);
                let ok = sh
                    .hot(self.node_slot(*n))
                    .is_some_and(|hot| (*o as usize) < hot.keys().len());
                *n = me;
                ok
            });
        }
        drop(wr);
        let mut out = Msg::with_capacity(head_bound + nodes.len());
        write_head(&mut out, truncated, &workers);
        out.array(sent.len());
        let mut out = out.into_vec();
        out.extend_from_slice(&nodes);
        out
    }

    /// Adds part `part` of `snapshot` (one worker's blocks) to worker
    /// `into`, beside what it holds; with `at`, records it as the worker's
    /// stream position. See the module docs.
    ///
    /// # Errors
    /// [`IndexError::UnknownWorker`], [`IndexError::SnapshotPart`], and
    /// [`IndexError::SnapshotWidth`] when the snapshot keys the worker at
    /// another block width (its keys would name other blocks here).
    pub fn import(
        &self,
        into: WorkerId,
        snapshot: &Snapshot,
        part: usize,
        at: Option<Position>,
    ) -> Result<Imported, IndexError> {
        let mut wr = lock(&self.writer);
        Self::check(&wr, into)?;
        let sw = snapshot
            .workers
            .get(part)
            .ok_or(IndexError::SnapshotPart(part))?;
        let w = into.0 as usize;
        let ws = wr.workers[w].as_mut().expect("checked");
        if ws.width != sw.width {
            return Err(IndexError::SnapshotWidth {
                ours: ws.width,
                theirs: sw.width,
            });
        }
        merge_groups(&mut ws.groups, &sw.groups, &snapshot.nodes, part, ws.width);
        ws.stats.groups = ws.groups.iter().map(|g| u32::from(g.idx)).collect();
        self.publish_groups(&wr, w);

        let nodes = &snapshot.nodes;
        let p = part as u32;
        // The nodes it holds, and their ancestors.
        let mut need: Vec<bool> = nodes
            .iter()
            .map(|n| n.holders.iter().any(|h| h.worker == p))
            .collect();
        for &(n, _, _) in &sw.overrides {
            need[n as usize] = true;
        }
        for i in (0..nodes.len()).rev() {
            if need[i] && nodes[i].parent != ROOT {
                need[nodes[i].parent as usize] = true;
            }
        }
        // Room for all of it first: eviction must not free a position
        // mapped below.
        self.evict_for(&mut wr, sw.entries, None);
        wr.stamp += 1;
        let stamp = wr.stamp;
        let before = self.positions.load(Ordering::Relaxed);
        // Snapshot position → this index's position, per node needed.
        let mut map: Vec<Vec<Pos>> = vec![Vec::new(); nodes.len()];
        let mut touched: Vec<u32> = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            if !need[i] {
                continue;
            }
            let mut cur = if node.parent == ROOT {
                None
            } else {
                match map[node.parent as usize].get(node.at as usize - 1) {
                    Some(p) => Some(*p),
                    None => continue,
                }
            };
            let mut placed: Vec<Pos> = Vec::with_capacity(node.keys.len());
            while placed.len() < node.keys.len() {
                let j = placed.len();
                let Some(pos) = self.next_pos(cur, node.keys[j], stamp) else {
                    break;
                };
                let end = self.place(&mut wr, pos, &node.keys[j..], &node.hashes[j..], stamp);
                placed.extend((pos.1..end).map(|o| (pos.0, o)));
                touched.push(pos.0);
                cur = Some((pos.0, end - 1));
            }
            map[i] = placed;
        }
        let max = self.config.max_entries;
        let base = self.entries.load(Ordering::Relaxed);
        let mut added = 0u64;
        let mut skipped = 0u64;
        for (i, node) in nodes.iter().enumerate() {
            let placed = &map[i];
            for h in node.holders.iter().filter(|h| h.worker == p) {
                for &(a, b, tiers) in &h.runs {
                    let held = b.min(placed.len() as u32);
                    skipped += u64::from(b - held.max(a));
                    let mut k = a as usize;
                    while k < held as usize {
                        // A stretch of consecutive offsets in one node.
                        let (nid, off) = placed[k];
                        let mut e = k + 1;
                        while e < held as usize && placed[e] == (nid, off + (e - k) as u32) {
                            e += 1;
                        }
                        let len = (e - k) as u32;
                        if base + added + u64::from(len) > max {
                            skipped += u64::from(len);
                        } else {
                            added += self.hold(w, h.group, (nid, off), len, tiers);
                            let named = placed[k..e]
                                .iter()
                                .zip(&node.hashes[k..e])
                                .zip(&node.keys[k..e]);
                            for ((&pos, &hash), &key) in named {
                                if hash != 0 {
                                    self.name(&mut wr, w, hash, pos, key);
                                }
                            }
                        }
                        k = e;
                    }
                }
            }
        }
        for &(n, o, h) in &sw.overrides {
            if let Some(&pos) = map[n as usize].get(o as usize) {
                self.name(&mut wr, w, h, pos, nodes[n as usize].keys[o as usize]);
            }
        }
        if !sw.sessions.is_empty() {
            let mut sessions = write(&self.sessions);
            // Oldest first, so the table keeps the exporter's most recent.
            for &(key, tokens) in sw.sessions.iter().rev() {
                sessions.stored(key, into, tokens, true);
            }
        }
        let positions = self.positions.load(Ordering::Relaxed) - before;
        // Positions walked but not held (a run past the budget, a chain
        // cut by a collision) go as any unneeded position does.
        touched.sort_unstable();
        touched.dedup();
        for nid in touched {
            if self.alive(nid) {
                self.trim(&mut wr, nid);
            }
        }
        let ws = wr.workers[w].as_mut().expect("checked");
        ws.stats.blocks_held += added;
        ws.stats.imported_blocks += added;
        if at.is_some() {
            ws.position = at;
        }
        self.entries.fetch_add(added, Ordering::Relaxed);
        Ok(Imported {
            entries: added,
            positions,
            skipped,
        })
    }

    /// Covers `keys` from `pos` on in its node (no holder), stamping the
    /// node as stored to; returns one past the last offset covered.
    fn place(&self, wr: &mut Writer, pos: Pos, keys: &[u64], hashes: &[u64], stamp: u64) -> u32 {
        let (nid, off) = pos;
        let mut sh = write(&self.shards[self.node_shard(nid)].0);
        let node = sh.node_mut(self.node_slot(nid)).expect("live node");
        let end = self.cover(
            wr,
            None,
            nid,
            node.hot,
            node.cold,
            off as usize,
            keys,
            hashes,
        );
        node.cold.stamp = stamp;
        let queue = !node.cold.queued;
        node.cold.queued = true;
        drop(sh);
        if queue {
            wr.lrs.push(std::cmp::Reverse((stamp, nid)));
        }
        end as u32
    }

    /// Adds the tiers of mask `tiers` to `len` offsets from `pos` for
    /// `(worker w, group g)`; returns how many were not held before.
    fn hold(&self, w: usize, g: u16, pos: Pos, len: u32, tiers: u8) -> u64 {
        let (nid, off) = pos;
        let mut sh = write(&self.shards[self.node_shard(nid)].0);
        let node = sh.node_mut(self.node_slot(nid)).expect("live node");
        let holder = node.hot.holder_mut(w as u32, g);
        let mut added = 0;
        for bit in (0..5).map(|b| 1u8 << b).filter(|b| tiers & b != 0) {
            added += holder.runs.add(off, off + len, bit);
        }
        added
    }

    /// Makes engine hash `h` name position `p` (key `key`) for worker
    /// `w`: the shared record where the position has that hash recorded
    /// (or none yet) and no other position claims it, else the worker's
    /// own.
    fn name(&self, wr: &mut Writer, w: usize, h: u64, p: Pos, key: u64) {
        let recorded = {
            let mut sh = write(&self.shards[self.node_shard(p.0)].0);
            let Some(node) = sh.node_mut(self.node_slot(p.0)) else {
                return;
            };
            let e = &mut node.cold.ehash[p.1 as usize];
            if *e == 0 {
                *e = h;
            }
            *e
        };
        let shared = recorded == h
            && match wr.engine.entry(h) {
                hashbrown::hash_map::Entry::Vacant(v) => {
                    v.insert(handle(p));
                    true
                }
                hashbrown::hash_map::Entry::Occupied(o) => *o.get() == handle(p),
            };
        let ws = wr.workers[w].as_mut().expect("checked");
        if shared {
            ws.overrides.remove(&h);
        } else {
            ws.overrides.insert(h, (handle(p), key));
        }
    }
}

/// Folds a snapshot worker's groups into `ours` (keys per block
/// `width`): unknown groups are added, known ones widened as further
/// events would; a group it holds runs in without a description is full
/// attention, one key per block.
fn merge_groups(
    ours: &mut Vec<Group>,
    theirs: &[SnapGroup],
    nodes: &[crate::snapshot::SnapNode],
    part: usize,
    width: u32,
) {
    let add =
        |ours: &mut Vec<Group>, g: SnapGroup| match ours.binary_search_by_key(&g.idx, |x| x.idx) {
            Ok(i) => {
                ours[i].observe(g.width, g.window);
                ours[i].observe(g.align, None);
            }
            Err(i) => {
                let kind = match g.kind {
                    0 => RuleKind::Full,
                    1 => RuleKind::Window,
                    _ => RuleKind::State,
                };
                let mut x = Group::new(g.idx, kind, g.width, g.window, width);
                x.observe(g.align, None);
                ours.insert(i, x);
            }
        };
    for g in theirs {
        add(ours, *g);
    }
    let held = nodes
        .iter()
        .flat_map(|n| n.holders.iter())
        .filter(|h| h.worker as usize == part)
        .map(|h| h.group);
    for idx in held {
        if ours.binary_search_by_key(&idx, |x| x.idx).is_err() {
            add(
                ours,
                SnapGroup {
                    idx,
                    kind: 0,
                    width: 1,
                    align: 1,
                    window: None,
                },
            );
        }
    }
}
