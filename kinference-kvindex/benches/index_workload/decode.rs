//! Decode + apply from raw vLLM msgpack (`benches/README.md`).

use std::time::Instant;

use kinference_kvindex::{
    BlockHash, BlockStored, EncodeForm, EventBatch, IndexConfig, KvEvent, KvIndex, WorkerId,
    WorkerRef, decode_batch, encode_batch,
};

use super::{CHUNKS, EVENT, LEN, SplitMix, serde_decode};

/// Decode + apply from raw msgpack: 200 documents × 512 blocks, 2 workers
/// each, in 32-block `BlockStored` payloads of vLLM 0.33's map form with
/// 16 token ids per block and u64 hashes (6 400 payloads, 204 800 blocks).
pub(super) fn decode_apply(config: &IndexConfig) -> (f64, u64) {
    let ix = KvIndex::new(*config);
    let ids: Vec<WorkerId> = (0..10)
        .map(|w| {
            ix.register_worker(WorkerRef::new(format!("d{w}"), 0), 16)
                .expect("registers")
        })
        .collect();
    let mut rng = SplitMix(99);
    let mut payloads = Vec::new();
    for d in 0..200u64 {
        let tokens: Vec<u32> = (0..LEN * 16)
            .map(|_| (rng.next() % 150_000) as u32)
            .collect();
        let hashes: Vec<u64> = (0..LEN).map(|_| rng.next()).collect();
        for r in 0..2u64 {
            let w = ids[((d + r * 3) % 10) as usize];
            for c in 0..CHUNKS {
                let b = EventBatch {
                    ts: 1_767_225_600.0,
                    events: vec![KvEvent::BlockStored(BlockStored {
                        block_hashes: hashes[c * EVENT..(c + 1) * EVENT]
                            .iter()
                            .map(|h| BlockHash::Uint(*h))
                            .collect(),
                        parent_block_hash: (c > 0).then(|| BlockHash::Uint(hashes[c * EVENT - 1])),
                        token_ids: tokens[c * EVENT * 16..(c + 1) * EVENT * 16].to_vec(),
                        block_size: 16,
                        medium: Some("GPU".into()),
                        extra_keys: Some(vec![None; EVENT]),
                        group_idx: Some(0),
                        kv_cache_spec_kind: Some("full_attention".into()),
                        ..BlockStored::default()
                    })],
                    dp_rank: Some(0),
                    has_rank_field: true,
                    ..EventBatch::default()
                };
                payloads.push((w, encode_batch(&b, EncodeForm::VllmMap)));
            }
        }
    }
    let blocks = (payloads.len() * EVENT) as u64;
    // Decoding alone, both decoders, interleaved (same run, same data).
    let mut own_secs = f64::MAX;
    let mut ref_secs = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        for (_, p) in &payloads {
            std::hint::black_box(decode_batch(p).expect("decodes"));
        }
        own_secs = own_secs.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        for (_, p) in &payloads {
            std::hint::black_box(serde_decode::decode_batch(p).expect("decodes"));
        }
        ref_secs = ref_secs.min(t.elapsed().as_secs_f64());
    }
    println!(
        "decode only (best of 3)            {:.2} M blocks/s; rmp-serde reference {:.2} M blocks/s",
        blocks as f64 / own_secs / 1e6,
        blocks as f64 / ref_secs / 1e6
    );
    let t = Instant::now();
    for (w, p) in &payloads {
        let b = decode_batch(p).expect("decodes");
        ix.apply_batch(*w, &b).expect("applies");
    }
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(ix.entries(), blocks);
    (blocks as f64 / secs, blocks)
}
