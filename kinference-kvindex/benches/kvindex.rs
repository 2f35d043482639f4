//! Criterion micro-benchmarks: block keys, the codec, lookups on a 1M-entry
//! index, and decode + apply + remove of one vLLM map-form payload.
//! The workload-v1 figures (phases, memory, percentiles) come from the
//! `index_workload` bench target instead.

#![allow(clippy::many_single_char_names)] // short names in benchmark closures

use std::hint::black_box;

#[path = "../tests/support/serde_decode/mod.rs"]
#[allow(dead_code)] // each includer uses part of it
mod serde_decode;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kinference_kvindex::key::{BlockKeyer, ExtraKeys, chain, seed_for_lora};
use kinference_kvindex::{
    BlockHash, BlockKey, BlockRemoved, BlockStored, EncodeForm, EventBatch, KvEvent, KvIndex,
    Matches, Tier, WorkerRef, decode_batch, encode_batch,
};

fn rng(seed: &mut u64) -> u64 {
    *seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *seed;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn stored_payload(seed: &mut u64, blocks: usize) -> (EventBatch, Vec<u8>) {
    let b = EventBatch {
        ts: 1_767_225_600.0,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: (0..blocks).map(|_| BlockHash::Uint(rng(seed))).collect(),
            token_ids: (0..blocks * 16)
                .map(|_| (rng(seed) % 150_000) as u32)
                .collect(),
            block_size: 16,
            medium: Some("GPU".into()),
            extra_keys: Some(vec![None; blocks]),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            ..BlockStored::default()
        })],
        dp_rank: Some(0),
        has_rank_field: true,
        ..EventBatch::default()
    };
    let bytes = encode_batch(&b, EncodeForm::VllmMap);
    (b, bytes)
}

fn keys(c: &mut Criterion) {
    let mut seed = 1;
    let tokens: Vec<u32> = (0..8192)
        .map(|_| (rng(&mut seed) % 150_000) as u32)
        .collect();
    let keyer = BlockKeyer::new(16, None);
    let mut g = c.benchmark_group("keys");
    g.throughput(Throughput::Elements(512));
    g.bench_function("block_keys_8192_tokens", |b| {
        b.iter(|| keyer.keys(black_box(&tokens), &ExtraKeys::none()));
    });
    g.finish();
}

fn codec(c: &mut Criterion) {
    let mut seed = 2;
    let (batch, bytes) = stored_payload(&mut seed, 32);
    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Elements(32));
    g.bench_function("decode_vllm_map_32_blocks", |b| {
        b.iter(|| decode_batch(black_box(&bytes)).expect("decodes"));
    });
    g.bench_function("decode_vllm_map_32_blocks_rmp_serde", |b| {
        b.iter(|| serde_decode::decode_batch(black_box(&bytes)).expect("decodes"));
    });
    g.bench_function("encode_vllm_map_32_blocks", |b| {
        b.iter(|| encode_batch(black_box(&batch), EncodeForm::VllmMap));
    });
    g.finish();
}

fn lookups(c: &mut Criterion) {
    // 200 documents × 512 blocks × 10 of 64 workers: 1 024 000 entries.
    let ix = KvIndex::default();
    let ids: Vec<_> = (0..64)
        .map(|w| {
            ix.register_worker(WorkerRef::new(format!("w{w}"), 0), 16)
                .expect("registers")
        })
        .collect();
    let mut seed = 3;
    let seed_key = seed_for_lora(None);
    let mut docs: Vec<Vec<u64>> = Vec::new();
    for d in 0..200usize {
        let locals: Vec<u64> = (0..512).map(|_| rng(&mut seed)).collect();
        let hashes: Vec<u64> = (0..512).map(|_| rng(&mut seed)).collect();
        for r in 0..10 {
            let w = ids[(d * 7 + r * 5) % 64];
            for ch in 0..16 {
                let range = ch * 32..(ch + 1) * 32;
                let parent = (ch > 0).then(|| hashes[ch * 32 - 1]);
                ix.store_hashed(
                    w,
                    parent,
                    seed_key,
                    &hashes[range.clone()],
                    &locals[range],
                    Tier::Gpu,
                )
                .expect("stores");
            }
        }
        docs.push(locals);
    }
    let chain_keys = |locals: &[u64]| -> Vec<BlockKey> {
        let mut prev = seed_key;
        locals
            .iter()
            .map(|l| {
                let k = chain(prev, *l);
                prev = k.0;
                k
            })
            .collect()
    };
    let full: Vec<Vec<BlockKey>> = docs.iter().map(|d| chain_keys(d)).collect();
    let half: Vec<Vec<BlockKey>> = docs
        .iter()
        .map(|d| {
            let mut l = d[..256].to_vec();
            l.extend((0..256).map(|_| rng(&mut seed)));
            chain_keys(&l)
        })
        .collect();
    let none: Vec<Vec<BlockKey>> = (0..200)
        .map(|_| chain_keys(&(0..512).map(|_| rng(&mut seed)).collect::<Vec<_>>()))
        .collect();
    let mut g = c.benchmark_group("find_matches_512");
    for (name, qs) in [("full", &full), ("half", &half), ("none", &none)] {
        let mut m = Matches::default();
        let mut i = 0;
        g.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 37) % qs.len();
                ix.find_matches_into(black_box(&qs[i]), &mut m);
                m.len()
            });
        });
    }
    g.finish();
}

fn decode_apply(c: &mut Criterion) {
    let ix = KvIndex::default();
    let w = ix
        .register_worker(WorkerRef::new("w", 0), 16)
        .expect("registers");
    let mut seed = 4;
    let (batch, bytes) = stored_payload(&mut seed, 32);
    let KvEvent::BlockStored(s) = &batch.events[0] else {
        unreachable!()
    };
    let remove = KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: s.block_hashes.iter().rev().cloned().collect(),
        medium: Some("GPU".into()),
        ..BlockRemoved::default()
    });
    let mut g = c.benchmark_group("apply");
    g.throughput(Throughput::Elements(32));
    g.bench_function("decode_store_remove_32_blocks", |b| {
        b.iter(|| {
            let d = decode_batch(black_box(&bytes)).expect("decodes");
            ix.apply_batch(w, &d).expect("applies");
            ix.apply_event(w, &remove).expect("applies");
        });
    });
    g.finish();
}

criterion_group!(benches, keys, codec, lookups, decode_apply);
criterion_main!(benches);
