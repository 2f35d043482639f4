//! Workload v1b, the branching variant (`benches/README.md`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kinference_kvindex::key::seed_for_lora;
use kinference_kvindex::{IndexConfig, KvIndex, Matches, Tier, WorkerId, WorkerRef};

use super::{ALLOC, EVENT, Lat, SplitMix, keys_of, lat, mix64};

/// v1b's test vectors (`benches/README.md`); any mismatch aborts the run.
fn check_v1b_vectors(
    p_local: &[u64],
    p_seq: &[u64],
    c_local: &[u64],
    c_seq: &[u64],
    holders: &[[(usize, usize); 3]],
) {
    assert_eq!(
        [p_local[0], p_local[127], p_seq[127]],
        [
            0x533e_00f7_f3c6_06d4,
            0x0643_bad8_2177_0d3f,
            0xc9d3_04a9_b783_a684
        ]
    );
    assert_eq!(
        [c_local[0], c_local[c_local.len() - 1]],
        [0x2ea3_6159_f240_a683, 0xd399_9888_0ddd_302e]
    );
    assert_eq!(
        [c_seq[0], c_seq[c_seq.len() - 1]],
        [0xafa2_db94_53dd_74b1, 0x86a2_db95_1706_b3e9]
    );
    assert_eq!(
        c_seq.iter().fold(0u64, |a, x| a.wrapping_add(*x)),
        0x9c1c_f890_3af7_4c68
    );
    let ids = |c: usize| holders[c].map(|h| h.0);
    assert_eq!(
        [ids(0), ids(1), ids(holders.len() - 1)],
        [[48, 8, 43], [18, 29, 27], [50, 56, 49]]
    );
    let sum: usize = holders.iter().flat_map(|h| h.iter().map(|x| x.0)).sum();
    assert_eq!(sum, 1_891_068);
    let mut q = SplitMix(1002);
    assert_eq!(
        [q.below(20_000), q.below(20_000), q.below(20_000)],
        [4285, 202, 10464]
    );
    let mut ch = SplitMix(1003);
    let churn: Vec<(u64, u64)> = (0..3)
        .map(|_| {
            let c = ch.below(20_000);
            (c, ch.below(3))
        })
        .collect();
    assert_eq!(churn, vec![(11864, 1), (6476, 2), (9489, 1)]);
    let mut rd = SplitMix(1004);
    assert_eq!(
        [rd.below(20_000), rd.below(20_000), rd.below(20_000)],
        [8454, 18851, 17635]
    );
    println!("v1b test vectors: all match");
}

pub(super) struct Branching {
    pub(super) entries: u64,
    pub(super) ingest: f64,
    pub(super) bytes_per_entry: f64,
    pub(super) quiet: Lat,
    pub(super) wrong: u64,
    pub(super) conc: Lat,
    pub(super) conc_wrong: u64,
    pub(super) writer: f64,
}

/// Workload v1b (`benches/README.md`): one 128-block system prompt held by
/// all 64 workers; 20 000 conversations of 64 more blocks each, each held
/// by 3 workers, holder k holding the first 16·(k+1)+16 blocks of it
/// (partial holders). Queries: prompt + one conversation (192 blocks); the
/// answer has all 64 workers, the conversation's holders deeper. During
/// churn a writer drops and re-stores the last 16 blocks of random
/// (conversation, holder) pairs.
pub(super) fn branching(config: &IndexConfig) -> Branching {
    const W: usize = 64;
    const PROMPT: usize = 128;
    const CONVS: usize = 20_000;
    const CONV: usize = 64;
    let ix = KvIndex::new(*config);
    let ids: Vec<WorkerId> = (0..W)
        .map(|w| {
            ix.register_worker(WorkerRef::new(format!("b{w}"), 0), 16)
                .expect("registers")
        })
        .collect();
    let seed = seed_for_lora(None);
    let mut rng = SplitMix(1001);
    let p_local: Vec<u64> = (0..PROMPT).map(|_| rng.next()).collect();
    let mut p_seq = Vec::with_capacity(PROMPT);
    let mut prev = 0u64;
    for l in &p_local {
        prev = mix64(prev ^ l);
        p_seq.push(prev);
    }
    let c_local: Vec<u64> = (0..CONVS * CONV).map(|_| rng.next()).collect();
    let mut c_seq = vec![0u64; CONVS * CONV];
    for c in 0..CONVS {
        let mut prev = p_seq[PROMPT - 1];
        for i in 0..CONV {
            prev = mix64(prev ^ c_local[c * CONV + i]);
            c_seq[c * CONV + i] = prev;
        }
    }
    let holders: Vec<[(usize, usize); 3]> = (0..CONVS)
        .map(|_| {
            let mut hs = [(0usize, 0usize); 3];
            let mut n = 0;
            while n < 3 {
                let w = rng.below(W as u64) as usize;
                if !hs[..n].iter().any(|h| h.0 == w) {
                    hs[n] = (w, 16 * (n + 1) + 16);
                    n += 1;
                }
            }
            hs
        })
        .collect();
    check_v1b_vectors(&p_local, &p_seq, &c_local, &c_seq, &holders);
    let h0 = ALLOC.allocated() as u64;
    let t = Instant::now();
    let mut blocks = 0u64;
    for id in &ids {
        for c in 0..PROMPT / EVENT {
            let r = c * EVENT..(c + 1) * EVENT;
            ix.store_hashed(
                *id,
                (c > 0).then(|| p_seq[c * EVENT - 1]),
                seed,
                &p_seq[r.clone()],
                &p_local[r],
                Tier::Gpu,
            )
            .expect("stores");
            blocks += EVENT as u64;
        }
    }
    for (c, hs) in holders.iter().enumerate() {
        for &(w, len) in hs {
            for k in 0..len / 16 {
                let r = c * CONV + k * 16..c * CONV + (k + 1) * 16;
                let parent = if k == 0 {
                    p_seq[PROMPT - 1]
                } else {
                    c_seq[c * CONV + k * 16 - 1]
                };
                ix.store_hashed(
                    ids[w],
                    Some(parent),
                    seed,
                    &c_seq[r.clone()],
                    &c_local[r],
                    Tier::Gpu,
                )
                .expect("stores");
                blocks += 16;
            }
        }
    }
    let ingest = blocks as f64 / t.elapsed().as_secs_f64();
    let entries = ix.entries();
    assert_eq!(entries, blocks);
    let bytes_per_entry = (ALLOC.allocated() as u64 - h0) as f64 / entries as f64;
    let query = |c: usize| {
        keys_of(
            p_local
                .iter()
                .copied()
                .chain(c_local[c * CONV..(c + 1) * CONV].iter().copied()),
        )
    };
    let check = |m: &Matches, c: usize| -> bool {
        m.len() == W
            && m.as_slice().iter().all(|x| {
                let want = holders[c]
                    .iter()
                    .find(|h| ids[h.0] == x.worker)
                    .map_or(PROMPT, |h| PROMPT + h.1) as u32;
                x.blocks == want
            })
    };
    let mut m = Matches::default();
    let mut samples = Vec::new();
    let mut wrong = 0;
    let mut q = SplitMix(1002);
    for n in 0..22_000 {
        let c = q.below(CONVS as u64) as usize;
        let keys = query(c);
        let t = Instant::now();
        ix.find_matches_into(&keys, &mut m);
        let e = t.elapsed().as_nanos() as u64;
        if n >= 2000 {
            samples.push(e);
        }
        if !check(&m, c) {
            wrong += 1;
        }
    }
    let quiet = lat(samples);
    let done = AtomicBool::new(false);
    let mut conc = Vec::new();
    let mut conc_wrong = 0;
    let mut writer = 0f64;
    std::thread::scope(|s| {
        let wt = s.spawn(|| {
            let mut r = SplitMix(1003);
            let t = Instant::now();
            let mut ops = 0u64;
            for _ in 0..40_000 {
                let c = r.below(CONVS as u64) as usize;
                let (w, len) = holders[c][r.below(3) as usize];
                let tail = c * CONV + len - 16..c * CONV + len;
                let rev: Vec<u64> = c_seq[tail.clone()].iter().rev().copied().collect();
                ix.remove_hashed(ids[w], &rev, Tier::Gpu).expect("removes");
                let parent = if len == 16 {
                    p_seq[PROMPT - 1]
                } else {
                    c_seq[c * CONV + len - 17]
                };
                ix.store_hashed(
                    ids[w],
                    Some(parent),
                    seed,
                    &c_seq[tail.clone()],
                    &c_local[tail],
                    Tier::Gpu,
                )
                .expect("stores");
                ops += 32;
            }
            let rate = ops as f64 / t.elapsed().as_secs_f64();
            done.store(true, Ordering::Release);
            rate
        });
        let mut q = SplitMix(1004);
        let mut m = Matches::default();
        while !done.load(Ordering::Acquire) {
            let c = q.below(CONVS as u64) as usize;
            let keys = query(c);
            let t = Instant::now();
            ix.find_matches_into(&keys, &mut m);
            conc.push(t.elapsed().as_nanos() as u64);
            // Mid-churn a holder may be 16 short; anything else is wrong.
            let ok = m.len() == W
                && m.as_slice().iter().all(|x| {
                    let want = holders[c]
                        .iter()
                        .find(|h| ids[h.0] == x.worker)
                        .map_or(PROMPT, |h| PROMPT + h.1) as u32;
                    x.blocks == want || x.blocks + 16 == want
                });
            if !ok {
                conc_wrong += 1;
            }
        }
        writer = wt.join().expect("writer");
    });
    Branching {
        entries,
        ingest,
        bytes_per_entry,
        quiet,
        wrong,
        conc: lat(conc),
        conc_wrong,
        writer,
    }
}
