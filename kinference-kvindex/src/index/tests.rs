use super::*;
use crate::event::{BlockHash, BlockRemoved, BlockStored, KvEvent, Tier};
use crate::key;
use crate::key::{BlockKeyer, ExtraKeys};
use crate::snapshot::{Position, Snapshot};

fn idx() -> KvIndex {
    KvIndex::new(IndexConfig {
        shards: 8,
        ..IndexConfig::default()
    })
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ salt)
        .collect()
}

fn stored(hashes: &[u64], parent: Option<u64>, toks: &[u32], bs: u32) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|h| BlockHash::Uint(*h)).collect(),
        parent_block_hash: parent.map(BlockHash::Uint),
        token_ids: toks.to_vec(),
        block_size: bs,
        ..BlockStored::default()
    })
}

fn removed(hashes: &[u64], medium: Option<&str>) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|h| BlockHash::Uint(*h)).collect(),
        medium: medium.map(str::to_owned),
        ..BlockRemoved::default()
    })
}

fn depth(ix: &KvIndex, keys: &[BlockKey], w: WorkerId) -> (u32, u32) {
    ix.find_matches(keys)
        .get(w)
        .map_or((0, 0), |m| (m.blocks, m.gpu_blocks))
}

#[test]
fn events_meet_request_keys_across_events_and_segments() {
    let ix = idx();
    let w = ix
        .register_worker(WorkerRef::new("a", 0), 4)
        .expect("registers");
    let t = tokens(40, 1);
    // 10 blocks in three events chained by parent hashes.
    ix.apply_event(w, &stored(&[1, 2, 3], None, &t[..12], 4))
        .expect("applies");
    ix.apply_event(w, &stored(&[4, 5, 6, 7], Some(3), &t[12..28], 4))
        .expect("applies");
    ix.apply_event(w, &stored(&[8, 9, 10], Some(7), &t[28..40], 4))
        .expect("applies");
    let keys = BlockKeyer::new(4, None).keys(&t, &ExtraKeys::none());
    assert_eq!(depth(&ix, &keys, w), (10, 10));
    assert_eq!(depth(&ix, &keys[..7], w), (7, 7));
    let mut other = t.clone();
    other[21] ^= 1; // differs in block 5
    let ko = BlockKeyer::new(4, None).keys(&other, &ExtraKeys::none());
    assert_eq!(depth(&ix, &ko, w), (5, 5));
    assert_eq!(ix.entries(), 10);
    // Tail-first removal keeps the prefix.
    ix.apply_event(w, &removed(&[10, 9], None))
        .expect("applies");
    assert_eq!(depth(&ix, &keys, w), (8, 8));
    let mut held = keys[..8].to_vec();
    held.sort_unstable();
    assert_eq!(ix.worker_keys(w), held);
    assert!(ix.worker_keys(WorkerId(w.0 + 1)).is_empty());
}

#[test]
fn a_removed_middle_block_ends_the_match_and_refilling_it_restores_it() {
    let ix = idx();
    let w = ix
        .register_worker(WorkerRef::new("a", 0), 4)
        .expect("registers");
    let t = tokens(24, 2);
    ix.apply_event(w, &stored(&[1, 2, 3, 4, 5, 6], None, &t, 4))
        .expect("applies");
    let keys = BlockKeyer::new(4, None).keys(&t, &ExtraKeys::none());
    ix.apply_event(w, &removed(&[3], None)).expect("applies");
    assert_eq!(depth(&ix, &keys, w), (2, 2));
    assert_eq!(ix.entries(), 5);
    // Re-storing block 2 (parent 2) closes the hole.
    ix.apply_event(w, &stored(&[3], Some(2), &t[8..12], 4))
        .expect("applies");
    assert_eq!(depth(&ix, &keys, w), (6, 6));
}

#[test]
fn tiers_placeholders_and_per_tier_removal() {
    let ix = idx();
    let w = ix
        .register_worker(WorkerRef::new("a", 0), 4)
        .expect("registers");
    let t = tokens(16, 3);
    let keys = BlockKeyer::new(4, None).keys(&t, &ExtraKeys::none());
    ix.apply_event(w, &stored(&[1, 2, 3, 4], None, &t, 4))
        .expect("applies");
    // Placeholder: blocks 0-3 also on CPU; unknown hash 99 ignored.
    let ph = KvEvent::BlockStored(BlockStored {
        block_hashes: [1, 2, 3, 4, 99]
            .iter()
            .map(|h| BlockHash::Uint(*h))
            .collect(),
        medium: Some("CPU".into()),
        ..BlockStored::default()
    });
    ix.apply_event(w, &ph).expect("applies");
    assert_eq!(ix.worker_stats(w).expect("stats").unknown_placeholders, 1);
    // GPU evicts blocks 2-3: still held on CPU.
    ix.apply_event(w, &removed(&[4, 3], Some("GPU")))
        .expect("applies");
    assert_eq!(depth(&ix, &keys, w), (4, 2));
    ix.apply_event(w, &removed(&[4], Some("cpu")))
        .expect("applies");
    assert_eq!(depth(&ix, &keys, w), (3, 2));
    assert_eq!(ix.entries(), 3);
}

#[test]
fn wider_event_blocks_are_rechunked_and_other_widths_dropped() {
    let ix = idx();
    let w = ix
        .register_worker(WorkerRef::new("a", 0), 4)
        .expect("registers");
    let t = tokens(16, 4);
    let keys = BlockKeyer::new(4, None).keys(&t, &ExtraKeys::none());
    ix.apply_event(w, &stored(&[1, 2], None, &t, 8))
        .expect("applies");
    assert_eq!(depth(&ix, &keys, w), (4, 4));
    ix.apply_event(w, &removed(&[2], None)).expect("applies");
    assert_eq!(depth(&ix, &keys, w), (2, 2));
    // 6-token blocks cannot be re-chunked at 4: not indexed, width recorded.
    ix.apply_event(w, &stored(&[7, 8], None, &tokens(12, 5), 6))
        .expect("applies");
    let st = ix.worker_stats(w).expect("stats");
    assert_eq!(st.width_mismatch_blocks, 2);
    assert_eq!(st.observed_widths, vec![(0, 8), (0, 6)]);
    assert_eq!(ix.entries(), 2);
}

#[test]
fn workers_share_records_and_clear_independently() {
    let ix = idx();
    let a = ix
        .register_worker(WorkerRef::new("a", 0), 4)
        .expect("registers");
    let b = ix
        .register_worker(WorkerRef::new("b", 0), 4)
        .expect("registers");
    assert_eq!(ix.register_worker(WorkerRef::new("a", 0), 4), Ok(a));
    let t = tokens(16, 6);
    let keys = BlockKeyer::new(4, None).keys(&t, &ExtraKeys::none());
    ix.apply_event(a, &stored(&[1, 2, 3, 4], None, &t, 4))
        .expect("applies");
    ix.apply_event(b, &stored(&[1, 2], None, &t[..8], 4))
        .expect("applies");
    let m = ix.find_matches(&keys);
    assert_eq!(m.get(a).map(|x| x.blocks), Some(4));
    assert_eq!(m.get(b).map(|x| x.blocks), Some(2));
    assert_eq!(ix.stats().engine_records, 4);
    ix.apply_event(a, &KvEvent::AllBlocksCleared)
        .expect("applies");
    assert_eq!(ix.find_matches(&keys).len(), 1);
    assert_eq!(ix.stats().engine_records, 2);
    assert!(ix.remove_worker(b));
    assert_eq!(ix.entries(), 0);
    assert_eq!(ix.stats().engine_records, 0);
    assert!(ix.apply_event(b, &KvEvent::AllBlocksCleared).is_err());
    // The id is reused.
    assert_eq!(ix.register_worker(WorkerRef::new("c", 1), 4), Ok(b));
}

#[test]
fn orphans_encoder_groups_and_remote_events_are_not_indexed() {
    let ix = idx();
    let w = ix
        .register_worker(WorkerRef::new("a", 0), 4)
        .expect("registers");
    let t = tokens(8, 7);
    ix.apply_event(w, &stored(&[5, 6], Some(42), &t, 4))
        .expect("applies");
    let mut g1 = stored(&[7, 8], None, &t, 4);
    if let KvEvent::BlockStored(s) = &mut g1 {
        s.group_idx = Some(1);
        s.kv_cache_spec_kind = Some("cross_attention".into());
    }
    ix.apply_event(w, &g1).expect("applies");
    let mut remote = stored(&[9, 10], None, &t, 4);
    if let KvEvent::BlockStored(s) = &mut remote {
        s.locality = Some("REMOTE".into());
    }
    ix.apply_event(w, &remote).expect("applies");
    let st = ix.worker_stats(w).expect("stats");
    assert_eq!(
        (st.orphan_blocks, st.other_group_blocks, st.remote_blocks),
        (2, 2, 2)
    );
    assert_eq!(ix.entries(), 0);
}

#[test]
fn the_budget_evicts_least_recently_stored_tails() {
    let ix = KvIndex::new(IndexConfig {
        shards: 4,
        max_entries: 16,
        ..IndexConfig::default()
    });
    let a = ix
        .register_worker(WorkerRef::new("a", 0), 4)
        .expect("registers");
    let b = ix
        .register_worker(WorkerRef::new("b", 0), 4)
        .expect("registers");
    // A shared prefix (4 blocks) and three continuations stored in turn.
    let p = tokens(16, 8);
    ix.apply_event(a, &stored(&[1, 2, 3, 4], None, &p, 4))
        .expect("applies");
    let conts: Vec<Vec<u32>> = (0..3).map(|c| tokens(16, 100 + c)).collect();
    for (c, t) in conts.iter().enumerate() {
        let base = 10 * (c as u64 + 1);
        ix.apply_event(
            a,
            &stored(&[base, base + 1, base + 2, base + 3], Some(4), t, 4),
        )
        .expect("applies");
    }
    assert_eq!(ix.entries(), 16);
    // b stores 4 more: back to 15/16 of the budget less what comes, so
    // the two oldest continuations go, whole; the shared prefix stays.
    ix.apply_event(b, &stored(&[1, 2, 3, 4], None, &p, 4))
        .expect("applies");
    let keys_of = |c: usize| {
        let mut t = p.clone();
        t.extend_from_slice(&conts[c]);
        BlockKeyer::new(4, None).keys(&t, &ExtraKeys::none())
    };
    assert_eq!(depth(&ix, &keys_of(0), a), (4, 4), "oldest tail evicted");
    assert_eq!(depth(&ix, &keys_of(1), a), (4, 4), "next oldest evicted");
    assert_eq!(depth(&ix, &keys_of(2), a), (8, 8));
    assert_eq!(depth(&ix, &keys_of(2), b), (4, 4));
    let st = ix.stats();
    assert_eq!((st.evictions, st.evicted_entries, st.entries), (1, 8, 12));
    assert_eq!(ix.worker_stats(a).expect("stats").evicted_blocks, 8);
    // The shared prefix outlives its continuations: the prefix node is
    // only a tail once nothing continues it.
    for _ in 0..6 {
        ix.apply_event(b, &KvEvent::AllBlocksCleared)
            .expect("applies");
        ix.apply_event(b, &stored(&[1, 2, 3, 4], None, &p, 4))
            .expect("applies");
    }
    assert!(ix.entries() <= 16);
}

#[test]
fn memory_is_returned_after_removal() {
    let ix = idx();
    let w = ix
        .register_worker(WorkerRef::new("a", 0), 4)
        .expect("registers");
    let empty = ix.stats().bytes;
    for d in 0..200u64 {
        let hashes: Vec<u64> = (0..64).map(|i| d * 1000 + i + 1).collect();
        let locals: Vec<u64> = (0..64).map(|i| (d << 20) ^ i).collect();
        ix.store_hashed(
            w,
            None,
            key::seed_for_lora(None),
            &hashes,
            &locals,
            Tier::Gpu,
        )
        .expect("stores");
    }
    assert_eq!(ix.entries(), 200 * 64);
    assert!(ix.stats().bytes > empty + 200 * 64 * 16);
    for d in 0..200u64 {
        let hashes: Vec<u64> = (0..64).rev().map(|i| d * 1000 + i + 1).collect();
        ix.remove_hashed(w, &hashes, Tier::Gpu).expect("removes");
    }
    let s = ix.stats();
    assert_eq!((s.entries, s.keys, s.engine_records), (0, 0, 0));
    assert!(s.bytes < empty + 64 * 1024, "{} vs {empty}", s.bytes);
}

#[test]
fn index_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<KvIndex>();
}

#[test]
#[allow(clippy::many_single_char_names)] // workers a, b; tokens t, u
fn a_chain_that_leaves_a_node_midway_is_a_child_and_both_answer() {
    let ix = idx();
    let a = ix
        .register_worker(WorkerRef::new("a", 0), 4)
        .expect("registers");
    let b = ix
        .register_worker(WorkerRef::new("b", 0), 4)
        .expect("registers");
    let t = tokens(32, 9);
    let mut u = t.clone();
    u[13] ^= 7; // differs from block 3 on
    ix.apply_event(a, &stored(&[1, 2, 3, 4, 5, 6, 7, 8], None, &t, 4))
        .expect("applies");
    ix.apply_event(b, &stored(&[1, 2, 3], None, &u[..12], 4))
        .expect("applies");
    ix.apply_event(b, &stored(&[40, 50, 60], Some(3), &u[12..24], 4))
        .expect("applies");
    let kt = BlockKeyer::new(4, None).keys(&t, &ExtraKeys::none());
    let ku = BlockKeyer::new(4, None).keys(&u, &ExtraKeys::none());
    assert_eq!(depth(&ix, &kt, a), (8, 8));
    assert_eq!(depth(&ix, &kt, b), (3, 3));
    assert_eq!(depth(&ix, &ku, a), (3, 3));
    assert_eq!(depth(&ix, &ku, b), (6, 6));
    assert_eq!(ix.stats().nodes, 2);
    // a's tail goes: its node keeps the prefix b's chain leaves from.
    ix.apply_event(a, &removed(&[8, 7, 6, 5, 4], None))
        .expect("applies");
    assert_eq!(depth(&ix, &ku, b), (6, 6));
    assert_eq!(ix.stats().keys, 6);
    ix.apply_event(b, &removed(&[60, 50, 40], None))
        .expect("applies");
    assert_eq!(ix.stats().nodes, 1);
    assert_eq!(ix.stats().keys, 3);
    ix.apply_event(a, &KvEvent::AllBlocksCleared)
        .expect("applies");
    ix.apply_event(b, &KvEvent::AllBlocksCleared)
        .expect("applies");
    let s = ix.stats();
    assert_eq!((s.entries, s.keys, s.nodes, s.engine_records), (0, 0, 0, 0));
}

#[test]
fn re_reported_prefixes_are_idempotent() {
    // kv_cache_report_mode "full": reused blocks re-stored with a nil
    // parent, covering the reused prefix.
    let ix = idx();
    let w = ix
        .register_worker(WorkerRef::new("a", 0), 4)
        .expect("registers");
    let t = tokens(24, 10);
    ix.apply_event(w, &stored(&[1, 2, 3, 4, 5, 6], None, &t, 4))
        .expect("applies");
    let before = ix.stats();
    for _ in 0..3 {
        let a = ix
            .apply_event(w, &stored(&[1, 2, 3, 4], None, &t[..16], 4))
            .expect("applies");
        assert_eq!(a.stored, 0);
    }
    assert_eq!(ix.stats(), before);
    let keys = BlockKeyer::new(4, None).keys(&t, &ExtraKeys::none());
    assert_eq!(depth(&ix, &keys, w), (6, 6));
}

// ----- snapshots ---------------------------------------------------------

/// Everything lookups can tell about an index, per worker name: for each
/// query, (blocks, gpu, cpu, disk) per worker, and each worker's keys.
fn fingerprint(ix: &KvIndex, queries: &[Vec<BlockKey>]) -> Vec<String> {
    let name = |w: WorkerId| {
        ix.workers()
            .into_iter()
            .find(|(i, _)| *i == w)
            .map(|(_, r)| format!("{}#{}", r.endpoint, r.dp_rank))
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    for (qi, q) in queries.iter().enumerate() {
        let mut row: Vec<String> = ix
            .find_matches(q)
            .as_slice()
            .iter()
            .map(|m| {
                format!(
                    "q{qi} {} {}/{}/{}/{}",
                    name(m.worker),
                    m.blocks,
                    m.gpu_blocks,
                    m.cpu_blocks,
                    m.disk_blocks
                )
            })
            .collect();
        row.sort();
        out.extend(row);
    }
    for (id, r) in ix.workers() {
        out.push(format!(
            "{}#{} keys {:?}",
            r.endpoint,
            r.dp_rank,
            ix.worker_keys(id)
        ));
    }
    out
}

/// Two workers over a shared 6-block prefix and two branches: a CPU copy,
/// a hole, a re-chunked event, a sliding-window group, and a worker that
/// names a shared position by its own hash.
fn populated() -> (KvIndex, Vec<u32>, Vec<u32>) {
    let ix = idx();
    let a = ix
        .register_worker(WorkerRef::new("a", 0), 4)
        .expect("registers");
    let b = ix
        .register_worker(WorkerRef::new("b", 1), 4)
        .expect("registers");
    let t = tokens(52, 1);
    let mut u = t.clone();
    for x in &mut u[24..] {
        *x ^= 0x55;
    }
    let batch = |evs: Vec<KvEvent>| crate::event::EventBatch {
        events: evs,
        ..crate::event::EventBatch::default()
    };
    ix.apply_batch_at(
        a,
        &batch(vec![
            stored(&[1, 2, 3, 4, 5, 6], None, &t[..24], 4),
            stored(&[7, 8, 9], Some(6), &t[24..36], 4),
            // Re-chunked: 8-token blocks at width 4.
            stored(&[10, 11], Some(9), &t[36..52], 8),
        ]),
        Position { seq: 41, digest: 7 },
    )
    .expect("applies");
    let mut cpu = stored(&[1, 2, 3], None, &t[..12], 4);
    if let KvEvent::BlockStored(s) = &mut cpu {
        s.medium = Some("CPU".into());
    }
    ix.apply_event(a, &cpu).expect("applies");
    ix.apply_event(a, &removed(&[8], None)).expect("applies");
    // b: the same prefix under other hashes for two blocks, its own branch.
    ix.apply_event(b, &stored(&[1, 2, 3, 104, 105, 106], None, &t[..24], 4))
        .expect("applies");
    ix.apply_event(b, &stored(&[207, 208], Some(106), &u[24..32], 4))
        .expect("applies");
    let mut win = stored(&[1, 2], None, &t[..8], 4);
    if let KvEvent::BlockStored(s) = &mut win {
        s.group_idx = Some(1);
        s.kv_cache_spec_kind = Some("sliding_window".into());
        s.kv_cache_spec_sliding_window = Some(8);
    }
    ix.apply_event(b, &win).expect("applies");
    (ix, t, u)
}

fn queries(t: &[u32], u: &[u32]) -> Vec<Vec<BlockKey>> {
    let k = |x: &[u32]| BlockKeyer::new(4, None).keys(x, &ExtraKeys::none());
    vec![
        k(t),
        k(&t[..20]),
        k(u),
        k(&u[..28]),
        k(&t[..4]),
        k(&tokens(16, 9)),
    ]
}

fn fresh_like(ix: &KvIndex) -> KvIndex {
    let out = idx();
    for (_, r) in ix.workers() {
        out.register_worker(r, 4).expect("registers");
    }
    out
}

fn import_all(from: &[u8], into: &KvIndex) -> u64 {
    let snap = crate::snapshot::Snapshot::decode(from).expect("decodes");
    let mut n = 0;
    for w in snap.workers() {
        let id = into.worker_id(w.worker).expect("registered");
        n += into
            .import(id, &snap, w.part, w.position)
            .expect("imports")
            .entries;
    }
    n
}

#[test]
#[allow(clippy::many_single_char_names)] // a, b: the two indexes; t, u: their token streams
fn a_snapshot_rebuilds_the_same_index() {
    let (a, t, u) = populated();
    let qs = queries(&t, &u);
    let bytes = a.export(usize::MAX);
    let b = fresh_like(&a);
    let n = import_all(&bytes, &b);
    assert_eq!(n, a.entries());
    assert_eq!(b.entries(), a.entries());
    assert_eq!(fingerprint(&b, &qs), fingerprint(&a, &qs));
    let wa = a.worker_id(&WorkerRef::new("a", 0)).expect("a");
    let wb = b.worker_id(&WorkerRef::new("a", 0)).expect("a");
    assert_eq!(b.position(wb), Some(Position { seq: 41, digest: 7 }));
    assert_eq!(
        b.worker_stats(wb).expect("stats").imported_blocks,
        a.worker_stats(wa).expect("stats").blocks_held
    );
    // The hashes came along: the same later events do the same to both.
    let later = [
        (("a", 0), removed(&[3], None)),
        (("a", 0), removed(&[1, 2], Some("CPU"))),
        (("a", 0), stored(&[8], Some(7), &t[28..32], 4)),
        (("b", 1), removed(&[106, 208], None)),
        (("b", 1), stored(&[306], Some(105), &u[20..24], 4)),
        (("a", 0), stored(&[12], Some(11), &t[..4], 4)),
    ];
    for ((w, r), ev) in &later {
        for ix in [&a, &b] {
            let id = ix.worker_id(&WorkerRef::new(*w, *r)).expect("registered");
            ix.apply_event(id, ev).expect("applies");
        }
        assert_eq!(fingerprint(&b, &qs), fingerprint(&a, &qs), "after {ev:?}");
    }
    assert_eq!(b.entries(), a.entries());
}

#[test]
fn an_import_adds_to_what_the_index_holds() {
    let (a, t, u) = populated();
    let qs = queries(&t, &u);
    let b = fresh_like(&a);
    // b already heard a's later events: a block under the shared prefix.
    let id = b.worker_id(&WorkerRef::new("a", 0)).expect("a");
    b.apply_event(id, &stored(&[1, 2, 3, 4, 5, 6], None, &t[..24], 4))
        .expect("applies");
    b.apply_event(id, &stored(&[99], Some(6), &u[24..28], 4))
        .expect("applies");
    import_all(&a.export(usize::MAX), &b);
    // Union: a's blocks, and the branch b knew.
    let aid = a.worker_id(&WorkerRef::new("a", 0)).expect("a");
    a.apply_event(aid, &stored(&[99], Some(6), &u[24..28], 4))
        .expect("applies");
    assert_eq!(fingerprint(&b, &qs), fingerprint(&a, &qs));
    // Importing twice changes nothing.
    import_all(&a.export(usize::MAX), &b);
    assert_eq!(fingerprint(&b, &qs), fingerprint(&a, &qs));
    assert_eq!(b.entries(), a.entries());
    // Where b's own events named a position first, the snapshot's worker
    // still resolves it by the hash it sent: its removals apply.
    for ix in [&a, &b] {
        let id = ix.worker_id(&WorkerRef::new("b", 1)).expect("b");
        ix.apply_event(id, &removed(&[208, 207], None))
            .expect("applies");
    }
    assert_eq!(fingerprint(&b, &qs), fingerprint(&a, &qs));
    assert_eq!(b.entries(), a.entries());
}

#[test]
fn a_truncated_snapshot_keeps_the_prefixes_nearest_the_roots() {
    let (a, t, u) = populated();
    let qs = queries(&t, &u);
    let full = a.export(usize::MAX);
    let small = a.export(full.len() - 40);
    let snap = crate::snapshot::Snapshot::decode(&small).expect("decodes");
    assert!(snap.truncated());
    assert!(small.len() <= full.len() - 40);
    let b = fresh_like(&a);
    import_all(&small, &b);
    assert!(b.entries() < a.entries() && b.entries() > 0);
    // Never more than the exporter: each worker's depth is at most its
    // depth there, and the shared 6-block prefix (the root) is whole.
    let depth = |ix: &KvIndex, q: &[BlockKey], w: &str, r: u32| {
        let id = ix.worker_id(&WorkerRef::new(w, r)).expect("registered");
        ix.find_matches(q).get(id).map_or(0, |m| m.blocks)
    };
    for q in &qs {
        for (w, r) in [("a", 0), ("b", 1)] {
            assert!(depth(&b, q, w, r) <= depth(&a, q, w, r));
        }
    }
    assert!(depth(&b, &qs[0], "a", 0) >= 6);
    // Too small for anything but the head: nothing to import.
    let none = crate::snapshot::Snapshot::decode(&a.export(0)).expect("decodes");
    assert_eq!((none.nodes(), none.workers().count()), (0, 2));
}

#[test]
fn an_import_keeps_the_budget_and_refuses_another_width() {
    let (a, _, _) = populated();
    let bytes = a.export(usize::MAX);
    let snap = crate::snapshot::Snapshot::decode(&bytes).expect("decodes");
    let part = snap.find(&WorkerRef::new("a", 0)).expect("a").part;
    let small = KvIndex::new(IndexConfig {
        shards: 8,
        max_entries: 5,
        ..IndexConfig::default()
    });
    let id = small
        .register_worker(WorkerRef::new("a", 0), 4)
        .expect("registers");
    let got = small.import(id, &snap, part, None).expect("imports");
    assert!(small.entries() <= 5, "{}", small.entries());
    assert!(got.skipped > 0);
    assert_eq!(got.entries, small.entries());
    let wide = idx();
    let id = wide
        .register_worker(WorkerRef::new("a", 0), 8)
        .expect("registers");
    assert_eq!(
        wide.import(id, &snap, part, None),
        Err(IndexError::SnapshotWidth { ours: 8, theirs: 4 })
    );
    assert_eq!(
        wide.import(id, &snap, 9, None),
        Err(IndexError::SnapshotPart(9))
    );
}

#[test]
fn a_worker_position_goes_with_its_blocks() {
    let ix = idx();
    let w = ix
        .register_worker(WorkerRef::new("a", 0), 4)
        .expect("registers");
    assert_eq!(ix.position(w), None);
    let batch = crate::event::EventBatch {
        events: vec![stored(&[1], None, &tokens(4, 3), 4)],
        ..crate::event::EventBatch::default()
    };
    let at = Position { seq: 3, digest: 99 };
    ix.apply_batch_at(w, &batch, at).expect("applies");
    assert_eq!(ix.position(w), Some(at));
    let snap = crate::snapshot::Snapshot::decode(&ix.export(usize::MAX)).expect("decodes");
    assert_eq!(snap.workers().next().and_then(|x| x.position), Some(at));
    ix.clear_worker(w).expect("clears");
    assert_eq!(ix.position(w), None);
}

fn with_session(ev: KvEvent, session: &str) -> KvEvent {
    match ev {
        KvEvent::BlockStored(s) => KvEvent::BlockStored(BlockStored {
            session_id: Some(session.to_owned()),
            ..s
        }),
        other => other,
    }
}

#[test]
fn sessions_follow_the_engines_stores_and_leave_with_clears() {
    let ix = idx();
    let a = ix.register_worker(WorkerRef::new("a", 0), 4).unwrap();
    let b = ix.register_worker(WorkerRef::new("b", 0), 4).unwrap();
    let t = tokens(24, 7);
    // Turn 1 of chat-1 on a: two blocks from the start; turn 2: one more
    // block after them.
    ix.apply_event(
        a,
        &with_session(stored(&[1, 2], None, &t[..8], 4), "chat-1"),
    )
    .unwrap();
    ix.apply_event(
        a,
        &with_session(stored(&[3], Some(2), &t[8..12], 4), "chat-1"),
    )
    .unwrap();
    // Another session on b, and a store with no session.
    ix.apply_event(b, &with_session(stored(&[9], None, &t[..4], 4), "chat-2"))
        .unwrap();
    ix.apply_event(b, &stored(&[10], None, &t[12..16], 4))
        .unwrap();
    // An orphan (unknown parent) tells nothing about the session.
    ix.apply_event(
        b,
        &with_session(stored(&[11], Some(999), &t[16..20], 4), "chat-1"),
    )
    .unwrap();
    let mut out = Vec::new();
    ix.session_holders("chat-1", &mut out);
    assert_eq!(
        out,
        [SessionHolder {
            worker: a,
            tokens: 12
        }]
    );
    ix.session_holders("chat-2", &mut out);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].worker, b);
    ix.session_holders("chat-3", &mut out);
    assert!(out.is_empty());
    assert_eq!(ix.stats().sessions, 2);
    // The engine reset its cache: a no longer holds chat-1.
    ix.apply_event(a, &KvEvent::AllBlocksCleared).unwrap();
    ix.session_holders("chat-1", &mut out);
    assert!(out.is_empty());
    assert!(ix.remove_worker(b));
    ix.session_holders("chat-2", &mut out);
    assert!(out.is_empty());
    assert_eq!(ix.stats().sessions, 0);
}

#[test]
fn sessions_can_be_turned_off() {
    let ix = KvIndex::new(IndexConfig {
        max_sessions: 0,
        ..IndexConfig::default()
    });
    let a = ix.register_worker(WorkerRef::new("a", 0), 4).unwrap();
    let t = tokens(8, 1);
    ix.apply_event(a, &with_session(stored(&[1, 2], None, &t, 4), "s"))
        .unwrap();
    let mut out = Vec::new();
    ix.session_holders("s", &mut out);
    assert!(out.is_empty());
    assert_eq!(
        ix.find_matches(&BlockKeyer::new(4, None).keys(&t, &ExtraKeys::none()))
            .max_blocks(),
        2
    );
}

#[test]
fn sessions_go_with_a_snapshot() {
    let a = idx();
    let wa = a.register_worker(WorkerRef::new("e1", 0), 4).unwrap();
    let t = tokens(12, 3);
    a.apply_event(
        wa,
        &with_session(stored(&[1, 2], None, &t[..8], 4), "chat-9"),
    )
    .unwrap();
    a.apply_event(
        wa,
        &with_session(stored(&[3], Some(2), &t[8..], 4), "chat-9"),
    )
    .unwrap();
    let snap = Snapshot::decode(&a.export(1 << 20)).expect("decodes");
    let b = idx();
    let wb = b.register_worker(WorkerRef::new("e1", 0), 4).unwrap();
    let part = snap
        .workers
        .iter()
        .position(|w| w.worker.endpoint == "e1")
        .unwrap();
    b.import(wb, &snap, part, None).unwrap();
    let mut out = Vec::new();
    b.session_holders("chat-9", &mut out);
    assert_eq!(
        out,
        [SessionHolder {
            worker: wb,
            tokens: 12
        }]
    );
    // A budget too small for sessions leaves them out, not the snapshot.
    let tiny = Snapshot::decode(&a.export(60)).expect("decodes");
    assert!(tiny.workers.iter().all(|w| w.sessions.is_empty()));
}
