//! Lookups: for each worker, the usable prefix of a query, per tier class.
//!
//! A query (our chained keys of a prompt's full blocks) is walked down the
//! tree: its first key names a root node (the shard of that key holds the
//! node and a map from first keys to nodes); the common prefix of the node
//! and the query is found with a k-ary search over the node's key array
//! (chained keys match up to the first difference and never after); where
//! they part, the next query key names the child to continue in. Each node
//! on the path is read under its shard's read lock, taken one at a time.
//!
//! A worker with one full-attention group holds the prefix its holders
//! cover from the root on, per tier class; a hybrid worker's prefix comes
//! from its groups' held intervals along the path ([`super::groups`]).

use std::sync::atomic::Ordering;

use super::groups::{self, Intervals};
use super::tree::{CLASSES, Hot};
use super::{FLAG_GROUPS, KvIndex, WorkerId, read};
use crate::key::BlockKey;

/// Per-worker answer of [`KvIndex::find_matches`]: leading query blocks
/// the engine can reuse, by where they are held. Each figure counts
/// blocks held in the named tier *or a faster one*, so
/// `gpu_blocks ≤ cpu_blocks ≤ disk_blocks ≤ blocks`. For hybrid models
/// every figure already honours all KV-cache groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct WorkerMatch {
    /// The worker.
    pub worker: WorkerId,
    /// Leading query blocks held in any tier (GPU, CPU, disk, storage,
    /// other).
    pub blocks: u32,
    /// Leading query blocks held on the GPU.
    pub gpu_blocks: u32,
    /// Leading query blocks held on the GPU or in CPU memory.
    pub cpu_blocks: u32,
    /// Leading query blocks held on the GPU, in CPU memory or on local
    /// disk (`blocks` adds `STORAGE`/external tiers).
    pub disk_blocks: u32,
}

/// The result of a lookup: workers with at least one leading block, in
/// worker-id order. Reuse one per task with
/// [`KvIndex::find_matches_into`] to avoid allocating per request.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Matches {
    items: Vec<WorkerMatch>,
    acc: Vec<Acc>,
    runs: Vec<GroupRun>,
    multi: Vec<WorkerMatch>,
}

/// A single-group worker's depth so far, per class, and which classes may
/// still grow (bit c: class c covered everything so far).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Acc {
    worker: u32,
    depth: [u32; 4],
    open: u8,
}

/// A held run of a hybrid worker's group along the path (chain positions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct GroupRun {
    worker: u32,
    group: u16,
    start: u32,
    end: u32,
    tiers: u8,
}

impl Matches {
    /// The matches, sorted by worker id.
    pub fn as_slice(&self) -> &[WorkerMatch] {
        &self.items
    }
    /// Number of workers with a match.
    pub fn len(&self) -> usize {
        self.items.len()
    }
    /// Whether no worker matched.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
    /// The match of one worker.
    pub fn get(&self, w: WorkerId) -> Option<&WorkerMatch> {
        self.items
            .binary_search_by_key(&w, |m| m.worker)
            .ok()
            .map(|i| &self.items[i])
    }
    /// The best depth over all workers.
    pub fn max_blocks(&self) -> u32 {
        self.items.iter().map(|m| m.blocks).max().unwrap_or(0)
    }
}

impl KvIndex {
    /// For each worker, how many leading blocks of `keys` it can reuse,
    /// in any tier and per tier class. Workers holding none are left out.
    pub fn find_matches(&self, keys: &[BlockKey]) -> Matches {
        let mut m = Matches::default();
        self.find_matches_into(keys, &mut m);
        m
    }

    /// Like [`find_matches`](Self::find_matches), reusing `out`'s buffers.
    pub fn find_matches_into(&self, keys: &[BlockKey], out: &mut Matches) {
        out.items.clear();
        out.acc.clear();
        out.runs.clear();
        let n = keys.len();
        let mut pos = 0usize;
        while pos < n {
            let k = keys[pos].0;
            let sh = read(&self.shards[self.shard_of(k)].0);
            let Some(node) = sh.heads.get(&k) else {
                break;
            };
            if node.start as usize != pos {
                break;
            }
            let m = node.match_len(&keys[pos..]);
            if m == 0 {
                break;
            }
            self.visit(node, pos as u32, m as u32, pos == 0, out);
            drop(sh);
            pos += m;
        }
        for a in &out.acc {
            if a.depth[3] > 0 {
                out.items.push(WorkerMatch {
                    worker: WorkerId(a.worker),
                    gpu_blocks: a.depth[0],
                    cpu_blocks: a.depth[1],
                    disk_blocks: a.depth[2],
                    blocks: a.depth[3],
                });
            }
        }
        if !out.runs.is_empty() {
            self.solve_groups(pos as u32, out);
        }
    }

    /// Folds one node of the path (its first `m` offsets match the query
    /// at chain position `at`) into the answer.
    #[inline]
    fn visit(&self, node: &Hot, at: u32, m: u32, first: bool, out: &mut Matches) {
        if first {
            for h in &node.holders {
                if self.is_multi(h.worker) {
                    push_group_runs(&mut out.runs, h, at, m);
                    continue;
                }
                let mut a = Acc {
                    worker: h.worker,
                    depth: [0; 4],
                    open: 0,
                };
                for (c, class) in CLASSES.iter().enumerate() {
                    let cov = h.runs.leading(*class).min(m);
                    a.depth[c] = cov;
                    if cov == m {
                        a.open |= 1 << c;
                    }
                }
                if a.depth[3] > 0 {
                    out.acc.push(a);
                }
            }
            return;
        }
        // Workers still covering everything continue if this node's
        // holders cover its start; others are done.
        let hs = &node.holders;
        let mut j = 0;
        for a in out.acc.iter_mut().filter(|a| a.open != 0) {
            while j < hs.len() && hs[j].worker < a.worker {
                j += 1;
            }
            if j < hs.len() && hs[j].worker == a.worker {
                let h = &hs[j];
                for (c, class) in CLASSES.iter().enumerate() {
                    if a.open & (1 << c) == 0 {
                        continue;
                    }
                    let cov = h.runs.leading(*class).min(m);
                    a.depth[c] = at + cov;
                    if cov < m {
                        a.open &= !(1 << c);
                    }
                }
            } else {
                a.open = 0;
            }
        }
        for h in hs {
            if self.is_multi(h.worker) {
                push_group_runs(&mut out.runs, h, at, m);
            }
        }
    }

    #[inline]
    fn is_multi(&self, w: u32) -> bool {
        self.flags
            .get(w as usize)
            .is_some_and(|f| f.load(Ordering::Acquire) & FLAG_GROUPS != 0)
    }

    /// Hybrid workers: their groups' held runs along a path of `limit`
    /// matched positions, solved per class, merged into the answer.
    fn solve_groups(&self, limit: u32, out: &mut Matches) {
        out.runs.sort_unstable();
        out.multi.clear();
        let profiles = read(&self.profiles);
        let mut i = 0;
        while i < out.runs.len() {
            let w = out.runs[i].worker;
            let mut j = i;
            while j < out.runs.len() && out.runs[j].worker == w {
                j += 1;
            }
            let runs = &out.runs[i..j];
            i = j;
            let Some(groups) = profiles.get(w as usize).filter(|g| !g.is_empty()) else {
                continue;
            };
            let mut depth = [0u32; 4];
            let mut held: smallvec::SmallVec<[Intervals; 4]> =
                smallvec::smallvec![Intervals::new(); groups.len()];
            for (c, class) in CLASSES.iter().enumerate() {
                for (gi, g) in groups.iter().enumerate() {
                    let iv = &mut held[gi];
                    iv.clear();
                    for r in runs
                        .iter()
                        .filter(|r| r.group == g.idx && r.tiers & class != 0)
                    {
                        match iv.last_mut() {
                            Some(last) if last.1 == r.start => last.1 = r.end,
                            _ => iv.push((r.start, r.end)),
                        }
                    }
                }
                depth[c] = groups::usable_prefix(groups, &held, limit);
            }
            if depth[3] > 0 {
                out.multi.push(WorkerMatch {
                    worker: WorkerId(w),
                    gpu_blocks: depth[0],
                    cpu_blocks: depth[1],
                    disk_blocks: depth[2],
                    blocks: depth[3],
                });
            }
        }
        drop(profiles);
        if !out.multi.is_empty() {
            out.items.extend_from_slice(&out.multi);
            out.items.sort_unstable_by_key(|m| m.worker);
        }
    }
}

fn push_group_runs(out: &mut Vec<GroupRun>, h: &super::tree::Holder, at: u32, m: u32) {
    for r in h.runs.as_slice() {
        if r.start >= m {
            break;
        }
        out.push(GroupRun {
            worker: h.worker,
            group: h.group,
            start: at + r.start,
            end: at + r.end.min(m),
            tiers: r.tiers,
        });
    }
}
