//! A copy of the index's contents that another process can rebuild the
//! same blocks from: what a router replica sends a replica that starts
//! ([`crate::KvIndex::export`], [`crate::KvIndex::import`]).
//!
//! # What it holds
//!
//! * **Workers**: per `(endpoint, dp_rank)` its block width, its KV-cache
//!   groups (kind, keys per block, window), the engine hashes it names
//!   positions by where they differ from the shared record, and the
//!   **stream position** the contents are consistent with: the sequence
//!   number and payload digest of the last event batch applied
//!   ([`Position`]; `None` when nothing was applied since the worker was
//!   registered or last cleared).
//! * **Nodes** of the block tree, parents before children (breadth first
//!   from the roots): each a run of chain positions with our chained block
//!   key and the engine's hash at each, where it leaves its parent, and per
//!   `(worker, group)` the held offsets with their tier masks.
//!
//! Keys are chained, so a node's keys rebuild the same positions in any
//! index: an import walks them like a store of those keys would, and adds
//! the holders; the engine hashes let later `BlockRemoved` and
//! `BlockStored` events (parents) resolve as in the exporting index.
//!
//! # Encoding
//!
//! MessagePack, positional:
//!
//! ```text
//! ["kinference-kv-snapshot", 1, truncated, [worker…], [node…]]
//! worker = [endpoint, dp_rank, width, nil | [seq, digest],
//!           [[group, kind (0 full, 1 window, 2 state), keys per block, align, nil | window tokens]…],
//!           overrides: bin of (node u32, offset u32, hash u64) little-endian records,
//!           sessions: bin of (session key u64, tokens u64) LE records (absent before 2026-12-03)]
//! node   = [parent (u32::MAX: a root), at (offset in the parent where it leaves; 0 for a root),
//!           keys: bin of u64 LE, hashes: bin of u64 LE (0: none),
//!           [[worker, group, runs: bin of (start u32, end u32, tiers u8) LE records]…]]
//! ```
//!
//! About 17 bytes per chain position plus 9 per held run: an index of a
//! million positions is about 20 MB.
//!
//! # Bounds
//!
//! [`crate::KvIndex::export`] stops adding nodes before the encoding would
//! pass the byte budget it is given and sets `truncated`: the nodes sent
//! are then those nearest the roots (shared prefixes first), and every
//! node's parent is among them. [`Snapshot::decode`] checks everything a
//! hostile or corrupt snapshot could get wrong (links, lengths, offsets,
//! tiers, worker references) before anything reaches an index, and never
//! allocates more than the input's size suggests.

use crate::codec::msgpack::{MsgError, Reader, Writer};
use crate::index::WorkerRef;

/// The first field of every snapshot.
pub const MAGIC: &str = "kinference-kv-snapshot";
/// The encoding's version.
pub const VERSION: u64 = 1;
/// "No parent": a root node.
pub(crate) const ROOT: u32 = u32::MAX;
/// Longest endpoint name accepted.
const MAX_ENDPOINT: usize = 1024;
/// Most KV-cache groups per worker accepted.
const MAX_GROUPS: usize = 256;

/// Where in a worker's event stream an index's contents stand: the last
/// batch applied, by sequence number and payload digest (xxh3 of the
/// batch's bytes, as the subscriber anchors replays).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Position {
    /// Sequence number of the last batch applied.
    pub seq: u64,
    /// Digest of that batch's payload.
    pub digest: u64,
}

/// Why bytes are not a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    /// Not MessagePack of the expected shape.
    #[error("not a kv snapshot: {0}")]
    Msg(#[from] MsgError),
    /// Another format, or a version this build does not read.
    #[error("not a kv snapshot this build reads ({0})")]
    Version(String),
    /// Well-formed, but inconsistent.
    #[error("invalid kv snapshot: {0}")]
    Invalid(String),
}

/// A KV-cache group as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SnapGroup {
    pub(crate) idx: u16,
    /// 0 full attention, 1 sliding window, 2 state.
    pub(crate) kind: u8,
    pub(crate) width: u32,
    pub(crate) align: u32,
    pub(crate) window: Option<u32>,
}

/// One worker as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SnapWorker {
    pub(crate) worker: WorkerRef,
    pub(crate) width: u32,
    pub(crate) position: Option<Position>,
    pub(crate) groups: Vec<SnapGroup>,
    /// (node, offset, engine hash) where the worker names a position by
    /// another hash than the shared record.
    pub(crate) overrides: Vec<(u32, u32, u64)>,
    /// (session key, tokens): the sessions the worker stored for
    /// ([`crate::KvIndex::session_holders`]).
    pub(crate) sessions: Vec<(u64, u64)>,
    /// Entries it holds in the snapshot (computed when decoding).
    pub(crate) entries: u64,
}

/// One held run: offsets `[start, end)` in tiers `tiers`.
pub(crate) type SnapRun = (u32, u32, u8);

/// One `(worker, group)`'s coverage of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SnapHolder {
    pub(crate) worker: u32,
    pub(crate) group: u16,
    pub(crate) runs: Vec<SnapRun>,
}

/// One node as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SnapNode {
    pub(crate) parent: u32,
    pub(crate) at: u32,
    pub(crate) keys: Vec<u64>,
    pub(crate) hashes: Vec<u64>,
    pub(crate) holders: Vec<SnapHolder>,
}

/// A decoded snapshot: validated, ready to import.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Snapshot {
    pub(crate) truncated: bool,
    pub(crate) workers: Vec<SnapWorker>,
    pub(crate) nodes: Vec<SnapNode>,
}

/// One worker of a snapshot, as [`Snapshot::workers`] lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotWorker<'a> {
    /// Its index in the snapshot (what [`crate::KvIndex::import`] takes).
    pub part: usize,
    /// The worker.
    pub worker: &'a WorkerRef,
    /// Its block width.
    pub block_size: u32,
    /// The stream position the contents are consistent with.
    pub position: Option<Position>,
    /// Entries it holds in the snapshot.
    pub entries: u64,
}

impl Snapshot {
    /// The workers it describes.
    pub fn workers(&self) -> impl Iterator<Item = SnapshotWorker<'_>> {
        self.workers
            .iter()
            .enumerate()
            .map(|(part, w)| SnapshotWorker {
                part,
                worker: &w.worker,
                block_size: w.width,
                position: w.position,
                entries: w.entries,
            })
    }

    /// The part describing `worker`, if any.
    pub fn find(&self, worker: &WorkerRef) -> Option<SnapshotWorker<'_>> {
        self.workers().find(|w| w.worker == worker)
    }

    /// Whether the exporter left out nodes to stay within its byte budget
    /// (the deepest ones: what is sent is a prefix-closed part of its tree).
    pub fn truncated(&self) -> bool {
        self.truncated
    }

    /// Nodes of the block tree sent.
    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    /// Chain positions sent.
    pub fn positions(&self) -> u64 {
        self.nodes.iter().map(|n| n.keys.len() as u64).sum()
    }

    /// `(block, worker, group)` entries sent.
    pub fn entries(&self) -> u64 {
        self.workers.iter().map(|w| w.entries).sum()
    }

    /// Reads and checks a snapshot.
    ///
    /// # Errors
    /// [`SnapshotError`] for anything but a consistent snapshot of this
    /// version: links to later or missing nodes, offsets past a node's
    /// end, unsorted or overlapping runs, empty or unknown tiers, unknown
    /// workers, lengths that disagree.
    pub fn decode(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
        let mut r = Reader::new(bytes);
        let n = r.read_array_len()?;
        if n < 5 {
            return Err(SnapshotError::Version(format!("{n} fields")));
        }
        let magic = r.read_str()?;
        if magic != MAGIC {
            return Err(SnapshotError::Version(format!("magic {magic:?}")));
        }
        let version = r.read_int()?.as_u64().unwrap_or(0);
        if version != VERSION {
            return Err(SnapshotError::Version(format!("version {version}")));
        }
        let truncated = r.read_bool()?;
        let nw = r.read_array_len()?;
        let mut workers = Vec::with_capacity(nw);
        for _ in 0..nw {
            workers.push(read_worker(&mut r)?);
        }
        let nn = r.read_array_len()?;
        let mut nodes: Vec<SnapNode> = Vec::with_capacity(nn);
        // Chain position of each node's first key (a child's is its
        // parent's plus `at`), to keep positions within u32.
        let mut starts: Vec<u32> = Vec::with_capacity(nn);
        for i in 0..nn {
            let node = read_node(&mut r, workers.len())?;
            let start = if node.parent == ROOT {
                if node.at != 0 {
                    return Err(invalid(format!("root node {i} leaves at {}", node.at)));
                }
                0
            } else {
                let p = node.parent as usize;
                if p >= i {
                    return Err(invalid(format!(
                        "node {i} names parent {p}, not an earlier node"
                    )));
                }
                if node.at == 0 || node.at as usize > nodes[p].keys.len() {
                    return Err(invalid(format!(
                        "node {i} leaves its parent at {}, outside 1..={}",
                        node.at,
                        nodes[p].keys.len()
                    )));
                }
                starts[p]
                    .checked_add(node.at)
                    .ok_or_else(|| invalid(format!("node {i} starts past u32")))?
            };
            if start.checked_add(node.keys.len() as u32).is_none() {
                return Err(invalid(format!("node {i} ends past u32")));
            }
            for h in &node.holders {
                let w = &mut workers[h.worker as usize];
                w.entries += h.runs.iter().map(|r| u64::from(r.1 - r.0)).sum::<u64>();
            }
            starts.push(start);
            nodes.push(node);
        }
        for (wi, w) in workers.iter().enumerate() {
            for &(node, off, _) in &w.overrides {
                let ok = nodes
                    .get(node as usize)
                    .is_some_and(|n| (off as usize) < n.keys.len());
                if !ok {
                    return Err(invalid(format!(
                        "worker {wi} names a hash at node {node} offset {off}, which is not sent"
                    )));
                }
            }
        }
        // Later fields (a newer exporter's) are ignored.
        for _ in 5..n {
            r.skip()?;
        }
        Ok(Snapshot {
            truncated,
            workers,
            nodes,
        })
    }
}

fn invalid(why: String) -> SnapshotError {
    SnapshotError::Invalid(why)
}

fn read_u16(r: &mut Reader<'_>) -> Result<u16, SnapshotError> {
    let v = r.read_u32()?;
    u16::try_from(v).map_err(|_| invalid(format!("{v} is not a group index")))
}

fn read_worker(r: &mut Reader<'_>) -> Result<SnapWorker, SnapshotError> {
    let n = r.read_array_len()?;
    if n < 6 {
        return Err(invalid(format!("a worker of {n} fields")));
    }
    let endpoint = r.read_str()?;
    if endpoint.len() > MAX_ENDPOINT {
        return Err(invalid(format!("an endpoint of {} bytes", endpoint.len())));
    }
    let rank = r.read_u32()?;
    let width = r.read_u32()?;
    if width == 0 {
        return Err(invalid(format!("worker {endpoint} has width 0")));
    }
    let position = if r.try_nil()? {
        None
    } else {
        if r.read_array_len()? != 2 {
            return Err(invalid("a position is [seq, digest]".into()));
        }
        let seq = r
            .read_int()?
            .as_u64()
            .ok_or_else(|| invalid("seq".into()))?;
        let digest = r
            .read_int()?
            .as_u64()
            .ok_or_else(|| invalid("digest".into()))?;
        Some(Position { seq, digest })
    };
    let ng = r.read_array_len()?;
    if ng > MAX_GROUPS {
        return Err(invalid(format!("{ng} groups")));
    }
    let mut groups = Vec::with_capacity(ng);
    for _ in 0..ng {
        if r.read_array_len()? != 5 {
            return Err(invalid("a group is 5 fields".into()));
        }
        let idx = read_u16(r)?;
        let kind = r.read_u32()?;
        let kind = u8::try_from(kind)
            .ok()
            .filter(|k| *k <= 2)
            .ok_or_else(|| invalid(format!("group kind {kind}")))?;
        let gw = r.read_u32()?;
        let align = r.read_u32()?;
        let window = if r.try_nil()? {
            None
        } else {
            Some(r.read_u32()?)
        };
        if gw == 0 || align == 0 || align > gw {
            return Err(invalid(format!("group {idx}: width {gw}, align {align}")));
        }
        groups.push(SnapGroup {
            idx,
            kind,
            width: gw,
            align,
            window,
        });
    }
    let ov = r.read_bin()?;
    if ov.len() % 16 != 0 {
        return Err(invalid("overrides are 16-byte records".into()));
    }
    let overrides = ov
        .chunks_exact(16)
        .map(|c| (le32(&c[0..4]), le32(&c[4..8]), le64(&c[8..16])))
        .collect();
    let mut sessions = Vec::new();
    if n > 6 {
        let b = r.read_bin()?;
        if b.len() % 16 != 0 {
            return Err(invalid("sessions are 16-byte records".into()));
        }
        sessions = b
            .chunks_exact(16)
            .map(|c| (le64(&c[0..8]), le64(&c[8..16])))
            .collect();
    }
    for _ in 7..n {
        r.skip()?;
    }
    Ok(SnapWorker {
        worker: WorkerRef::new(endpoint, rank),
        width,
        position,
        groups,
        overrides,
        sessions,
        entries: 0,
    })
}

fn read_node(r: &mut Reader<'_>, workers: usize) -> Result<SnapNode, SnapshotError> {
    let n = r.read_array_len()?;
    if n < 5 {
        return Err(invalid(format!("a node of {n} fields")));
    }
    let parent = r.read_u32()?;
    let at = r.read_u32()?;
    let kb = r.read_bin()?;
    let hb = r.read_bin()?;
    if kb.is_empty() || kb.len() % 8 != 0 || hb.len() != kb.len() {
        return Err(invalid(format!(
            "a node of {} key bytes and {} hash bytes",
            kb.len(),
            hb.len()
        )));
    }
    let keys: Vec<u64> = kb.chunks_exact(8).map(le64).collect();
    let hashes: Vec<u64> = hb.chunks_exact(8).map(le64).collect();
    let len = keys.len() as u32;
    let nh = r.read_array_len()?;
    let mut holders: Vec<SnapHolder> = Vec::with_capacity(nh);
    for _ in 0..nh {
        if r.read_array_len()? != 3 {
            return Err(invalid("a holder is [worker, group, runs]".into()));
        }
        let worker = r.read_u32()?;
        if worker as usize >= workers {
            return Err(invalid(format!("a holder names worker {worker}")));
        }
        let group = read_u16(r)?;
        if let Some(last) = holders.last()
            && (last.worker, last.group) >= (worker, group)
        {
            return Err(invalid("holders are not sorted".into()));
        }
        let rb = r.read_bin()?;
        if rb.is_empty() || rb.len() % 9 != 0 {
            return Err(invalid("runs are 9-byte records".into()));
        }
        let mut runs: Vec<SnapRun> = Vec::with_capacity(rb.len() / 9);
        for c in rb.chunks_exact(9) {
            let run = (le32(&c[0..4]), le32(&c[4..8]), c[8]);
            let after_last = runs.last().is_none_or(|l| l.1 <= run.0);
            if run.0 >= run.1 || run.1 > len || run.2 == 0 || run.2 > 0x1f || !after_last {
                return Err(invalid(format!(
                    "run {run:?} in a node of {len} (runs sorted, disjoint, tiers 1..=31)"
                )));
            }
            runs.push(run);
        }
        holders.push(SnapHolder {
            worker,
            group,
            runs,
        });
    }
    for _ in 5..n {
        r.skip()?;
    }
    Ok(SnapNode {
        parent,
        at,
        keys,
        hashes,
        holders,
    })
}

fn le32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b.try_into().expect("4 bytes"))
}

fn le64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().expect("8 bytes"))
}

/// Writes a snapshot's header and workers (the nodes follow in the
/// caller's own array).
pub(crate) fn write_head(w: &mut Writer, truncated: bool, workers: &[SnapWorker]) {
    w.array(5);
    w.str(MAGIC);
    w.uint(VERSION);
    w.bool(truncated);
    w.array(workers.len());
    for sw in workers {
        w.array(7);
        w.str(&sw.worker.endpoint);
        w.uint(u64::from(sw.worker.dp_rank));
        w.uint(u64::from(sw.width));
        match sw.position {
            Some(p) => {
                w.array(2);
                w.uint(p.seq);
                w.uint(p.digest);
            }
            None => w.nil(),
        }
        w.array(sw.groups.len());
        for g in &sw.groups {
            w.array(5);
            w.uint(u64::from(g.idx));
            w.uint(u64::from(g.kind));
            w.uint(u64::from(g.width));
            w.uint(u64::from(g.align));
            match g.window {
                Some(x) => w.uint(u64::from(x)),
                None => w.nil(),
            }
        }
        let mut ov = Vec::with_capacity(sw.overrides.len() * 16);
        for &(node, off, h) in &sw.overrides {
            ov.extend_from_slice(&node.to_le_bytes());
            ov.extend_from_slice(&off.to_le_bytes());
            ov.extend_from_slice(&h.to_le_bytes());
        }
        w.bin(&ov);
        ov.clear();
        for &(key, tokens) in &sw.sessions {
            ov.extend_from_slice(&key.to_le_bytes());
            ov.extend_from_slice(&tokens.to_le_bytes());
        }
        w.bin(&ov);
    }
}

/// Writes one node (holders' workers as snapshot indexes).
pub(crate) fn write_node(
    w: &mut Writer,
    parent: u32,
    at: u32,
    keys: &[u64],
    hashes: &[u64],
    holders: &[SnapHolder],
) {
    w.array(5);
    w.uint(u64::from(parent));
    w.uint(u64::from(at));
    let mut b = Vec::with_capacity(keys.len() * 8);
    for k in keys {
        b.extend_from_slice(&k.to_le_bytes());
    }
    w.bin(&b);
    b.clear();
    for h in hashes {
        b.extend_from_slice(&h.to_le_bytes());
    }
    w.bin(&b);
    w.array(holders.len());
    for h in holders {
        w.array(3);
        w.uint(u64::from(h.worker));
        w.uint(u64::from(h.group));
        b.clear();
        for &(s, e, t) in &h.runs {
            b.extend_from_slice(&s.to_le_bytes());
            b.extend_from_slice(&e.to_le_bytes());
            b.push(t);
        }
        w.bin(&b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node as the tests write it: parent, at, keys (also its hashes),
    /// holders.
    type TestNode = (u32, u32, Vec<u64>, Vec<SnapHolder>);

    fn sample() -> (Vec<SnapWorker>, Vec<TestNode>) {
        let workers = vec![SnapWorker {
            worker: WorkerRef::new("10.0.0.1:8000", 0),
            width: 16,
            position: Some(Position { seq: 7, digest: 9 }),
            groups: vec![SnapGroup {
                idx: 0,
                kind: 0,
                width: 1,
                align: 1,
                window: None,
            }],
            overrides: vec![(1, 0, 42)],
            sessions: vec![(0xfeed, 48)],
            entries: 0,
        }];
        let nodes = vec![
            (
                ROOT,
                0,
                vec![1, 2, 3],
                vec![SnapHolder {
                    worker: 0,
                    group: 0,
                    runs: vec![(0, 3, 1)],
                }],
            ),
            (
                0,
                2,
                vec![4],
                vec![SnapHolder {
                    worker: 0,
                    group: 0,
                    runs: vec![(0, 1, 3)],
                }],
            ),
        ];
        (workers, nodes)
    }

    fn encode(workers: &[SnapWorker], nodes: &[TestNode]) -> Vec<u8> {
        let mut w = Writer::default();
        write_head(&mut w, false, workers);
        w.array(nodes.len());
        for (p, at, keys, holders) in nodes {
            write_node(&mut w, *p, *at, keys, keys, holders);
        }
        w.into_vec()
    }

    #[test]
    fn a_snapshot_reads_back() {
        let (workers, nodes) = sample();
        let s = Snapshot::decode(&encode(&workers, &nodes)).expect("decodes");
        assert_eq!((s.nodes(), s.positions(), s.entries()), (2, 4, 4));
        let w = s.find(&WorkerRef::new("10.0.0.1:8000", 0)).expect("listed");
        assert_eq!(w.position, Some(Position { seq: 7, digest: 9 }));
        assert_eq!(s.workers[0].overrides, vec![(1, 0, 42)]);
        assert_eq!(s.workers[0].sessions, vec![(0xfeed, 48)]);
        assert_eq!(s.nodes[1].holders[0].runs, vec![(0, 1, 3)]);
        assert!(!s.truncated());
    }

    #[test]
    fn a_snapshot_from_before_sessions_reads_back() {
        let (mut workers, nodes) = sample();
        workers[0].sessions.clear();
        let mut head = Writer::default();
        write_head(&mut head, false, &workers);
        let mut old = head.into_vec();
        // The worker without its last field: a 6-array, no sessions bin.
        assert_eq!(old[old.len() - 2..], [0xc4, 0x00], "an empty bin last");
        old.truncate(old.len() - 2);
        let at = old
            .iter()
            .position(|&b| b == 0x97)
            .expect("the worker's array");
        old[at] = 0x96;
        let mut rest = Writer::default();
        rest.array(nodes.len());
        for (p, at, keys, holders) in &nodes {
            write_node(&mut rest, *p, *at, keys, keys, holders);
        }
        old.extend(rest.into_vec());
        let s = Snapshot::decode(&old).expect("decodes");
        assert!(s.workers[0].sessions.is_empty());
        assert_eq!(s.workers[0].overrides, vec![(1, 0, 42)]);
        assert_eq!((s.nodes(), s.positions(), s.entries()), (2, 4, 4));
    }

    #[test]
    fn inconsistent_snapshots_are_refused() {
        let (workers, nodes) = sample();
        let bad = |f: &dyn Fn(&mut Vec<SnapWorker>, &mut Vec<TestNode>)| {
            let (mut w, mut n) = (workers.clone(), nodes.clone());
            f(&mut w, &mut n);
            Snapshot::decode(&encode(&w, &n)).expect_err("refused")
        };
        // A child before its parent, or leaving past the parent's end.
        bad(&|_, n| n[1].0 = 1);
        bad(&|_, n| n[1].1 = 4);
        bad(&|_, n| n[1].1 = 0);
        bad(&|_, n| n[0].1 = 1);
        // Runs past the end, empty, overlapping, with no tier or a tier
        // that does not exist; an unknown worker; unsorted holders.
        bad(&|_, n| n[0].3[0].runs = vec![(0, 4, 1)]);
        bad(&|_, n| n[0].3[0].runs = vec![(1, 1, 1)]);
        bad(&|_, n| n[0].3[0].runs = vec![(0, 2, 1), (1, 3, 1)]);
        bad(&|_, n| n[0].3[0].runs = vec![(0, 2, 0)]);
        bad(&|_, n| n[0].3[0].runs = vec![(0, 2, 0x20)]);
        bad(&|_, n| n[0].3[0].worker = 1);
        bad(&|_, n| {
            let h = n[0].3[0].clone();
            n[0].3.push(h);
        });
        // An override at a node or offset not sent; an empty node.
        bad(&|w, _| w[0].overrides = vec![(2, 0, 1)]);
        bad(&|w, _| w[0].overrides = vec![(1, 1, 1)]);
        bad(&|_, n| n[1].2.clear());
        bad(&|w, _| w[0].width = 0);
        // Garbage, another format, a truncated snapshot.
        assert!(Snapshot::decode(b"{\"json\": true}").is_err());
        assert!(matches!(
            Snapshot::decode(&[0x95, 0xa3, b'a', b'b', b'c', 1, 0xc2, 0x90, 0x90]),
            Err(SnapshotError::Version(_))
        ));
        let ok = encode(&workers, &nodes);
        for cut in 0..ok.len() {
            assert!(Snapshot::decode(&ok[..cut]).is_err(), "cut at {cut}");
        }
    }
}
