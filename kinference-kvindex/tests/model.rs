//! Proptest models: the index against a naive reference (maps of sets)
//! under random store/remove/placeholder/clear/worker-removal/lookup
//! sequences, and the codec on random and mutated bytes (never panics).

use std::collections::{BTreeMap, BTreeSet};

use kinference_kvindex::key::{BlockKeyer, ExtraKeys};
use kinference_kvindex::{
    BlockHash, BlockKey, BlockRemoved, BlockStored, IndexConfig, KvEvent, KvIndex, WorkerId,
    WorkerRef, decode_batch,
};
use proptest::prelude::*;

const WIDTH: usize = 4;
const DOCS: usize = 4;
const LEN: usize = 12;
const WORKERS: usize = 3;

/// Docs share prefixes: doc d's block i has the content of "branch"
/// `branch(d, i)`, so doc 1 shares 3 blocks with doc 0, doc 2 shares 6
/// with doc 0, doc 3 shares nothing.
fn branch(d: usize, i: usize) -> usize {
    let shared = [LEN, 3, 6, 0][d];
    if i < shared { 0 } else { d }
}

fn doc_tokens(d: usize) -> Vec<u32> {
    (0..LEN * WIDTH)
        .map(|t| {
            let i = t / WIDTH;
            (branch(d, i) * 100_000 + t) as u32
        })
        .collect()
}

/// The engine's hash of block i of doc d: a function of the prefix content,
/// like vLLM's chained hashes.
fn engine_hash(d: usize, i: usize) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for j in 0..=i {
        h = (h ^ (branch(d, j) as u64 + 1)).wrapping_mul(0x100_0000_01b3);
        h = h.rotate_left(17) ^ j as u64;
    }
    h
}

#[derive(Debug, Clone)]
enum Op {
    Store {
        w: usize,
        d: usize,
        from: usize,
        len: usize,
        cpu: bool,
    },
    Remove {
        w: usize,
        d: usize,
        i: usize,
        cpu: bool,
    },
    Placeholder {
        w: usize,
        d: usize,
        i: usize,
        cpu: bool,
    },
    Clear {
        w: usize,
    },
    RemoveWorker {
        w: usize,
    },
    Lookup {
        d: usize,
        len: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..WORKERS, 0..DOCS, 0..LEN, 1..6usize, prop::bool::weighted(0.2))
            .prop_map(|(w, d, from, len, cpu)| Op::Store { w, d, from, len: len.min(LEN - from), cpu }),
        4 => (0..WORKERS, 0..DOCS, 0..LEN, prop::bool::weighted(0.2)).prop_map(|(w, d, i, cpu)| Op::Remove { w, d, i, cpu }),
        1 => (0..WORKERS, 0..DOCS, 0..LEN, any::<bool>()).prop_map(|(w, d, i, cpu)| Op::Placeholder { w, d, i, cpu }),
        1 => (0..WORKERS).prop_map(|w| Op::Clear { w }),
        1 => (0..WORKERS).prop_map(|w| Op::RemoveWorker { w }),
        4 => (0..DOCS, 1..=LEN).prop_map(|(d, len)| Op::Lookup { d, len }),
    ]
}

/// The reference: per worker, block key → tier set {gpu, cpu}.
#[derive(Default, Debug)]
struct Model {
    held: Vec<BTreeMap<BlockKey, BTreeSet<bool>>>,
}

impl Model {
    /// Whether the index still knows block `i` of doc `d`: some worker
    /// holds it or a block after it on a chain through it (the tree keeps
    /// a position while anything at or below it is held).
    fn known(&self, keys: &[Vec<BlockKey>], d: usize, i: usize) -> bool {
        let k = keys[d][i];
        keys.iter().any(|ks| {
            ks[i] == k
                && ks[i..]
                    .iter()
                    .any(|x| self.held.iter().any(|m| m.contains_key(x)))
        })
    }
    fn depth(&self, w: usize, keys: &[BlockKey], gpu_only: bool) -> u32 {
        keys.iter()
            .take_while(|k| {
                self.held[w]
                    .get(k)
                    .is_some_and(|t| !gpu_only || t.contains(&false))
            })
            .count() as u32
    }
}

fn medium(cpu: bool) -> String {
    if cpu { "CPU" } else { "GPU" }.to_owned()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn index_matches_the_reference_model(ops in prop::collection::vec(op(), 1..80)) {
        let ix = KvIndex::new(IndexConfig { shards: 4, ..IndexConfig::default() });
        let mut ids: Vec<WorkerId> = (0..WORKERS)
            .map(|w| ix.register_worker(WorkerRef::new(format!("w{w}"), 0), WIDTH as u32).expect("registers"))
            .collect();
        let toks: Vec<Vec<u32>> = (0..DOCS).map(doc_tokens).collect();
        let keys: Vec<Vec<BlockKey>> = toks.iter().map(|t| BlockKeyer::new(WIDTH as u32, None).keys(t, &ExtraKeys::none())).collect();
        let mut m = Model { held: vec![BTreeMap::new(); WORKERS] };
        for op in ops {
            match op {
                Op::Store { w, d, from, len, cpu } => {
                    let parent = (from > 0).then(|| engine_hash(d, from - 1));
                    let ev = KvEvent::BlockStored(BlockStored {
                        block_hashes: (from..from + len).map(|i| BlockHash::Uint(engine_hash(d, i))).collect(),
                        parent_block_hash: parent.map(BlockHash::Uint),
                        token_ids: toks[d][from * WIDTH..(from + len) * WIDTH].to_vec(),
                        block_size: WIDTH as u32,
                        medium: Some(medium(cpu)),
                        ..BlockStored::default()
                    });
                    ix.apply_event(ids[w], &ev).expect("applies");
                    // The parent must be known, else the event is an orphan.
                    if from == 0 || m.known(&keys, d, from - 1) {
                        for k in &keys[d][from..from + len] {
                            m.held[w].entry(*k).or_default().insert(cpu);
                        }
                    }
                }
                Op::Remove { w, d, i, cpu } => {
                    let ev = KvEvent::BlockRemoved(BlockRemoved {
                        block_hashes: vec![BlockHash::Uint(engine_hash(d, i))],
                        medium: Some(medium(cpu)),
                        ..BlockRemoved::default()
                    });
                    ix.apply_event(ids[w], &ev).expect("applies");
                    if let Some(t) = m.held[w].get_mut(&keys[d][i]) {
                        t.remove(&cpu);
                        if t.is_empty() {
                            m.held[w].remove(&keys[d][i]);
                        }
                    }
                }
                Op::Placeholder { w, d, i, cpu } => {
                    let ev = KvEvent::BlockStored(BlockStored {
                        block_hashes: vec![BlockHash::Uint(engine_hash(d, i))],
                        medium: Some(medium(cpu)),
                        ..BlockStored::default()
                    });
                    ix.apply_event(ids[w], &ev).expect("applies");
                    if let Some(t) = m.held[w].get_mut(&keys[d][i]) {
                        t.insert(cpu);
                    }
                }
                Op::Clear { w } => {
                    ix.apply_event(ids[w], &KvEvent::AllBlocksCleared).expect("applies");
                    m.held[w].clear();
                }
                Op::RemoveWorker { w } => {
                    prop_assert!(ix.remove_worker(ids[w]));
                    ids[w] = ix.register_worker(WorkerRef::new(format!("w{w}"), 0), WIDTH as u32).expect("registers");
                    m.held[w].clear();
                }
                Op::Lookup { d, len } => {
                    let q = &keys[d][..len];
                    let got = ix.find_matches(q);
                    let mut want = vec![];
                    for (w, id) in ids.iter().enumerate() {
                        let depth = m.depth(w, q, false);
                        if depth > 0 {
                            // Tiers here are GPU and CPU only.
                            want.push((*id, depth, m.depth(w, q, true), depth, depth));
                        }
                    }
                    want.sort();
                    let got: Vec<_> = got.as_slice().iter().map(|x| (x.worker, x.blocks, x.gpu_blocks, x.cpu_blocks, x.disk_blocks)).collect();
                    prop_assert_eq!(got, want);
                }
            }
            let total: usize = m.held.iter().map(BTreeMap::len).sum();
            prop_assert_eq!(ix.entries(), total as u64);
            for (w, id) in ids.iter().enumerate() {
                let st = ix.worker_stats(*id).expect("stats");
                prop_assert_eq!(st.blocks_held, m.held[w].len() as u64);
            }
        }
    }

    #[test]
    fn the_codec_never_panics_on_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn the_codec_never_panics_on_mutated_fixtures(file in 0usize..6, flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8), cut in any::<prop::sample::Index>()) {
        let files = [
            "vllm-0.33.0/sha256-int/stored_mm_salt.msgpack",
            "vllm-0.33.0/sha256-bytes/stored_chain.msgpack",
            "vllm-0.23.0/sha256-bytes/stored_group1_bs32.msgpack",
            "vllm-0.9.0/builtin-int/stored_chain.msgpack",
            "sglang-0.5.18/stored_cache_salt.msgpack",
            "sglang-0.5.23/stored_lora_dynamo_format.msgpack",
        ];
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/kv-events").join(files[file]);
        let mut bytes = std::fs::read(path).expect("fixture");
        for (at, v) in flips {
            let i = at.index(bytes.len());
            bytes[i] = v;
        }
        let _ = decode_batch(&bytes);
        let n = cut.index(bytes.len());
        let _ = decode_batch(&bytes[..n]);
    }
}

// ----- KV-cache groups --------------------------------------------------

/// Group 0: full attention; 1: a sliding window of 3 blocks (12 tokens);
/// 2: a Mamba state group. One key per block in every group.
const GROUP_KINDS: [(&str, Option<u32>); 3] = [
    ("full_attention", None),
    ("sliding_window", Some(3 * WIDTH as u32)),
    ("mamba", None),
];

#[derive(Debug, Clone)]
enum GroupOp {
    Store {
        w: usize,
        g: usize,
        d: usize,
        from: usize,
        len: usize,
    },
    Remove {
        w: usize,
        g: usize,
        d: usize,
        i: usize,
    },
    Lookup {
        d: usize,
        len: usize,
    },
}

fn group_op() -> impl Strategy<Value = GroupOp> {
    prop_oneof![
        6 => (0..WORKERS, 0..3usize, 0..DOCS, 0..LEN, 1..9usize)
            .prop_map(|(w, g, d, from, len)| GroupOp::Store { w, g, d, from, len: len.min(LEN - from) }),
        4 => (0..WORKERS, 0..3usize, 0..DOCS, 0..LEN).prop_map(|(w, g, d, i)| GroupOp::Remove { w, g, d, i }),
        4 => (0..DOCS, 1..=LEN).prop_map(|(d, len)| GroupOp::Lookup { d, len }),
    ]
}

/// Per worker and group, the block keys held.
#[derive(Default, Debug, Clone)]
struct GroupModel {
    held: Vec<[BTreeSet<BlockKey>; 3]>,
    /// Groups each worker has stored to (a lookup needs all of them).
    seen: Vec<BTreeSet<usize>>,
}

impl GroupModel {
    fn known(&self, keys: &[Vec<BlockKey>], d: usize, i: usize) -> bool {
        let k = keys[d][i];
        keys.iter().any(|ks| {
            ks[i] == k
                && ks[i..]
                    .iter()
                    .any(|x| self.held.iter().any(|gs| gs.iter().any(|s| s.contains(x))))
        })
    }

    /// vLLM's rule by brute force: the longest L every group can serve.
    fn usable(&self, w: usize, q: &[BlockKey]) -> u32 {
        if self.seen[w].is_empty() {
            return 0;
        }
        let held = |g: usize, p: usize| self.held[w][g].contains(&q[p]);
        (0..=q.len())
            .rev()
            .find(|&l| {
                self.seen[w].iter().all(|&g| match g {
                    0 => (0..l).all(|p| held(0, p)),
                    1 => (l.saturating_sub(3)..l).all(|p| held(1, p)),
                    _ => l == 0 || held(2, l - 1),
                })
            })
            .unwrap_or(0) as u32
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn hybrid_groups_match_the_reference_rule(ops in prop::collection::vec(group_op(), 1..80)) {
        let ix = KvIndex::new(IndexConfig { shards: 4, ..IndexConfig::default() });
        let ids: Vec<WorkerId> = (0..WORKERS)
            .map(|w| ix.register_worker(WorkerRef::new(format!("w{w}"), 0), WIDTH as u32).expect("registers"))
            .collect();
        let toks: Vec<Vec<u32>> = (0..DOCS).map(doc_tokens).collect();
        let keys: Vec<Vec<BlockKey>> = toks.iter().map(|t| BlockKeyer::new(WIDTH as u32, None).keys(t, &ExtraKeys::none())).collect();
        let mut m = GroupModel { held: vec![Default::default(); WORKERS], seen: vec![BTreeSet::new(); WORKERS] };
        for op in ops {
            match op {
                GroupOp::Store { w, g, d, from, len } => {
                    let (kind, window) = GROUP_KINDS[g];
                    let ev = KvEvent::BlockStored(BlockStored {
                        block_hashes: (from..from + len).map(|i| BlockHash::Uint(engine_hash(d, i))).collect(),
                        parent_block_hash: (from > 0).then(|| BlockHash::Uint(engine_hash(d, from - 1))),
                        token_ids: toks[d][from * WIDTH..(from + len) * WIDTH].to_vec(),
                        block_size: WIDTH as u32,
                        group_idx: Some(g as u32),
                        kv_cache_spec_kind: Some(kind.into()),
                        kv_cache_spec_sliding_window: window,
                        ..BlockStored::default()
                    });
                    ix.apply_event(ids[w], &ev).expect("applies");
                    m.seen[w].insert(g);
                    if from == 0 || m.known(&keys, d, from - 1) {
                        for k in &keys[d][from..from + len] {
                            m.held[w][g].insert(*k);
                        }
                    }
                }
                GroupOp::Remove { w, g, d, i } => {
                    let ev = KvEvent::BlockRemoved(BlockRemoved {
                        block_hashes: vec![BlockHash::Uint(engine_hash(d, i))],
                        group_idx: Some(g as u32),
                        ..BlockRemoved::default()
                    });
                    ix.apply_event(ids[w], &ev).expect("applies");
                    m.held[w][g].remove(&keys[d][i]);
                }
                GroupOp::Lookup { d, len } => {
                    let q = &keys[d][..len];
                    let got = ix.find_matches(q);
                    let mut want = vec![];
                    for (w, id) in ids.iter().enumerate() {
                        let u = m.usable(w, q);
                        if u > 0 {
                            want.push((*id, u, u));
                        }
                    }
                    let got: Vec<_> = got.as_slice().iter().map(|x| (x.worker, x.blocks, x.gpu_blocks)).collect();
                    prop_assert_eq!(got, want);
                }
            }
            let total: usize = m.held.iter().flat_map(|gs| gs.iter().map(BTreeSet::len)).sum();
            prop_assert_eq!(ix.entries(), total as u64);
        }
    }
}

// ----- snapshots ----------------------------------------------------------

/// The event an op sends (Store, Remove, Placeholder, Clear), if it is one.
fn op_event(op: &Op, toks: &[Vec<u32>]) -> Option<KvEvent> {
    Some(match *op {
        Op::Store {
            d, from, len, cpu, ..
        } => KvEvent::BlockStored(BlockStored {
            block_hashes: (from..from + len)
                .map(|i| BlockHash::Uint(engine_hash(d, i)))
                .collect(),
            parent_block_hash: (from > 0).then(|| BlockHash::Uint(engine_hash(d, from - 1))),
            token_ids: toks[d][from * WIDTH..(from + len) * WIDTH].to_vec(),
            block_size: WIDTH as u32,
            medium: Some(medium(cpu)),
            ..BlockStored::default()
        }),
        Op::Remove { d, i, cpu, .. } => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash::Uint(engine_hash(d, i))],
            medium: Some(medium(cpu)),
            ..BlockRemoved::default()
        }),
        Op::Placeholder { d, i, cpu, .. } => KvEvent::BlockStored(BlockStored {
            block_hashes: vec![BlockHash::Uint(engine_hash(d, i))],
            medium: Some(medium(cpu)),
            ..BlockStored::default()
        }),
        Op::Clear { .. } => KvEvent::AllBlocksCleared,
        Op::RemoveWorker { .. } | Op::Lookup { .. } => return None,
    })
}

fn op_worker(op: &Op) -> Option<usize> {
    match *op {
        Op::Store { w, .. }
        | Op::Remove { w, .. }
        | Op::Placeholder { w, .. }
        | Op::Clear { w } => Some(w),
        Op::RemoveWorker { .. } | Op::Lookup { .. } => None,
    }
}

/// Whether an engine could have sent `op` to an index in state `ix`: a
/// store's parent, and a placeholder's block, are held by the same worker
/// (engines store a block only after its parent, and copy only what they
/// hold).
fn causal(ix: &KvIndex, id: WorkerId, keys: &[Vec<BlockKey>], op: &Op) -> bool {
    let holds = |d: usize, i: usize| ix.worker_keys(id).contains(&keys[d][i]);
    match *op {
        Op::Store { d, from, .. } => from == 0 || holds(d, from - 1),
        Op::Placeholder { d, i, .. } => holds(d, i),
        _ => true,
    }
}

/// Everything lookups tell, per worker (by position in `ids`).
fn answers(
    ix: &KvIndex,
    ids: &[WorkerId],
    keys: &[Vec<BlockKey>],
) -> Vec<(usize, usize, u32, u32, u32)> {
    let mut out = Vec::new();
    for (d, ks) in keys.iter().enumerate() {
        let m = ix.find_matches(ks);
        for (w, id) in ids.iter().enumerate() {
            if let Some(x) = m.get(*id) {
                out.push((d, w, x.blocks, x.gpu_blocks, x.cpu_blocks));
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// A replica that subscribes, applies the first `heard` batches after
    /// a peer's snapshot, imports the snapshot and applies those batches
    /// again, then the rest, ends with the peer's index: nothing removed
    /// after the snapshot comes back, nothing stored after it is lost.
    #[test]
    fn a_snapshot_and_the_batches_after_it_are_the_index(
        before in prop::collection::vec(op(), 0..60),
        after in prop::collection::vec(op(), 0..40),
        heard in 0usize..40,
    ) {
        let config = IndexConfig { shards: 4, ..IndexConfig::default() };
        let a = KvIndex::new(config);
        let b = KvIndex::new(config);
        let reg = |ix: &KvIndex| -> Vec<WorkerId> {
            (0..WORKERS)
                .map(|w| ix.register_worker(WorkerRef::new(format!("w{w}"), 0), WIDTH as u32).expect("registers"))
                .collect()
        };
        let (ia, ib) = (reg(&a), reg(&b));
        let toks: Vec<Vec<u32>> = (0..DOCS).map(doc_tokens).collect();
        let keys: Vec<Vec<BlockKey>> = toks.iter().map(|t| BlockKeyer::new(WIDTH as u32, None).keys(t, &ExtraKeys::none())).collect();
        for op in &before {
            if let (Some(w), Some(ev)) = (op_worker(op), op_event(op, &toks))
                && causal(&a, ia[w], &keys, op)
            {
                a.apply_event(ia[w], &ev).expect("applies");
            }
        }
        let snapshot = kinference_kvindex::Snapshot::decode(&a.export(usize::MAX)).expect("decodes");
        // The stream after the snapshot, as the peer applies it.
        let mut stream = Vec::new();
        for op in &after {
            if let (Some(w), Some(ev)) = (op_worker(op), op_event(op, &toks))
                && causal(&a, ia[w], &keys, op)
            {
                a.apply_event(ia[w], &ev).expect("applies");
                stream.push((w, ev));
            }
        }
        let heard = heard.min(stream.len());
        for (w, ev) in &stream[..heard] {
            b.apply_event(ib[*w], ev).expect("applies");
        }
        for part in snapshot.workers() {
            let w: usize = part.worker.endpoint[1..].parse().expect("w<n>");
            b.import(ib[w], &snapshot, part.part, None).expect("imports");
        }
        for (w, ev) in &stream {
            b.apply_event(ib[*w], ev).expect("applies");
        }
        prop_assert_eq!(answers(&b, &ib, &keys), answers(&a, &ia, &keys));
        prop_assert_eq!(b.entries(), a.entries());
        for (x, y) in ia.iter().zip(&ib) {
            prop_assert_eq!(b.worker_keys(*y), a.worker_keys(*x));
        }
    }
}
