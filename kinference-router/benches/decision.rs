//! The router's decision path for one request: tokenize (local, prefix cache
//! warm) → block keys → KV-index lookup → score and pick, on a 10-turn chat of
//! about 8K Qwen3 tokens among 16 endpoints, 4 of which hold the history.
//! Goal (issue 7): ≤ 200 µs median for the whole path.
//!
//! These are the calls `kinference_router::decide` makes, without the
//! async plumbing around them (the blocking-pool hop and the HTTP parts are
//! measured end to end by `cargo xtask bench proxy`).

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use kinference_kvindex::{
    BlockHash, BlockKey, BlockKeyer, BlockStored, ExtraKeys, KvEvent, KvIndex, Matches, WorkerRef,
};
use kinference_scoring::{
    CacheSource, CachedBlocks, Candidate, EndpointId, InFlight, LatencyParams, Pick, Policy,
    PolicyName, Request, SplitMix64,
};
use kinference_tokenize::{Endpoint, ModelTokenizer};
use serde_json::{Value, json};

const BLOCK: u32 = 16;
const ENDPOINTS: u32 = 16;

fn testdata(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/tokenizers")
        .join(p)
}

/// About 1K tokens of prose from the Qwen3 vectors.
fn prose() -> String {
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(testdata("qwen3/vectors.json"))
            .expect("qwen3 vectors in testdata"),
    )
    .expect("vectors.json");
    v["completion_cases"]
        .as_array()
        .and_then(|cases| cases.iter().find(|c| c["id"] == "long_text"))
        .and_then(|c| c["text"].as_str())
        .expect("the long_text case")
        .to_owned()
}

/// Ten alternating turns of about 800 tokens each.
fn ten_turns(text: &str) -> Vec<Value> {
    let words: Vec<&str> = text.split(' ').collect();
    (0..10)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let t: Vec<&str> = words
                .iter()
                .cycle()
                .skip(i * 37)
                .take(words.len() * 3 / 4)
                .copied()
                .collect();
            json!({"role": role, "content": format!("Turn {i}. {}", t.join(" "))})
        })
        .collect()
}

fn store(index: &KvIndex, worker: u32, ids: &[u32]) {
    let w = index
        .register_worker(WorkerRef::new(format!("10.0.0.{worker}:8000"), 0), BLOCK)
        .expect("register");
    let blocks = ids.len() / BLOCK as usize;
    let hashes: Vec<BlockHash> = (0..blocks).map(|i| BlockHash::Uint(1 + i as u64)).collect();
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: hashes,
        parent_block_hash: None,
        token_ids: ids[..blocks * BLOCK as usize].to_vec(),
        block_size: BLOCK,
        ..BlockStored::default()
    });
    index.apply_event(w, &ev).expect("apply");
}

fn bench(c: &mut Criterion) {
    let tok = ModelTokenizer::from_dir(testdata("qwen3")).expect("qwen3 tokenizer in testdata");
    let turns = ten_turns(&prose());
    let history = json!({"model": "qwen3", "messages": turns[..9], "max_tokens": 64});
    let body = json!({"model": "qwen3", "messages": turns, "max_tokens": 64});
    let history_ids = tok
        .tokenize(Endpoint::ChatCompletions, &history)
        .expect("tokenize")
        .token_ids
        .remove(0);
    let ids = tok
        .tokenize(Endpoint::ChatCompletions, &body)
        .expect("tokenize")
        .token_ids
        .remove(0);
    eprintln!(
        "prompt: {} tokens, {} blocks; history held by 4 of {ENDPOINTS} endpoints",
        ids.len(),
        ids.len() / BLOCK as usize
    );

    let index = KvIndex::default();
    for w in 0..4 {
        store(&index, w, &history_ids);
    }
    for w in 4..ENDPOINTS {
        // Other conversations: unrelated prefixes.
        let other: Vec<u32> = (0..4096).map(|i| 200_000 + w * 10_000 + i).collect();
        store(&index, w, &other);
    }
    let keyer = BlockKeyer::new(BLOCK, None);
    let mut policy = Policy::new(PolicyName::Kinference, LatencyParams::default());
    let mut rng = SplitMix64::new(1);

    let decide =
        |policy: &mut Policy, rng: &mut SplitMix64, m: &mut Matches, keys: &mut Vec<BlockKey>| {
            let t = tok
                .tokenize(Endpoint::ChatCompletions, black_box(&body))
                .expect("tokenize");
            let ids = &t.token_ids[0];
            keyer.keys_into(ids, &ExtraKeys::none(), keys);
            index.find_matches_into(keys, m);
            let candidates: Vec<Candidate> = (0..ENDPOINTS)
                .map(|e| {
                    let held = m
                        .as_slice()
                        .iter()
                        .find(|x| x.worker.0 == e)
                        .map_or(0, |x| x.gpu_blocks);
                    Candidate {
                        endpoint: EndpointId(e),
                        cached: CachedBlocks {
                            gpu: held,
                            cpu: held,
                            disk: 0,
                        },
                        in_flight: InFlight {
                            requests: e % 3,
                            decoding: e % 2,
                            prefill_tokens: u64::from(e) * 100,
                            context_tokens: 0,
                        },
                        engine: None,
                    }
                })
                .collect();
            let request = Request {
                prompt_tokens: ids.len() as u32,
                block_tokens: BLOCK,
                cache: CacheSource::Index,
            };
            policy
                .pick(&request, &candidates, Duration::from_secs(1), rng)
                .expect("pick")
        };

    let mut g = c.benchmark_group("decision");
    let (mut m, mut keys) = (Matches::default(), Vec::new());
    g.bench_function("chat_8k_warm/total", |b| {
        b.iter(|| black_box(decide(&mut policy, &mut rng, &mut m, &mut keys)));
    });
    g.bench_function("chat_8k_warm/tokenize", |b| {
        b.iter(|| {
            black_box(
                tok.tokenize(Endpoint::ChatCompletions, black_box(&body))
                    .expect("tokenize"),
            )
        });
    });
    g.bench_function("chat_8k_warm/keys", |b| {
        b.iter(|| keyer.keys_into(black_box(&ids), &ExtraKeys::none(), &mut keys));
    });
    keyer.keys_into(&ids, &ExtraKeys::none(), &mut keys);
    g.bench_function("chat_8k_warm/lookup", |b| {
        b.iter(|| index.find_matches_into(black_box(&keys), &mut m));
    });
    g.finish();
    let chosen = decide(&mut policy, &mut rng, &mut m, &mut keys);
    assert!(
        chosen.endpoint.0 < 4,
        "the warm endpoints should win: {chosen:?}"
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
