//! Tokenization on the request path (Qwen3 tokenizer).
//!
//! * `chat_8k/*`: a 10-turn chat of about 8K tokens.
//!   - `encode_only_uncached`: the `tokenizers` pipeline on the rendered
//!     prompt (baseline: what BPE alone costs);
//!   - `cold_cache_off`: render + encode with no cache;
//!   - `cold_cache_cleared`: render + segment + encode every segment + fill
//!     the cache (the first request of a conversation);
//!   - `cold_all_caches`: as `cold_cache_cleared`, and the BPE model's own
//!     word cache emptied too (every word merged from scratch);
//!   - `warm_resent`: the same request again (every segment cached);
//!   - `warm_resent_from_json`: the same through the router's entry point
//!     (`tokenize_request` on the parsed JSON body, which also parses the
//!     request);
//!   - `warm_new_turn`: the history cached, a new short user turn at the end
//!     (what a multi-turn client sends next);
//!   - `render_only`: the chat template alone.
//! * `completion_1k/*`: a 1K-token completion prompt, cold (no cache; and
//!   with the BPE word cache emptied) and warm (re-sent).

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{Criterion, criterion_group, criterion_main};
use kinference_tokenize::{ChatRequest, CompletionRequest, ModelFiles, ModelTokenizer, Options};
use serde_json::{Value, json};
use tokenizers::ModelWrapper;

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tokenizers/qwen3")
}

fn load(cache_bytes: usize) -> ModelTokenizer {
    ModelTokenizer::load(
        &ModelFiles::read_dir(model_dir()).unwrap(),
        Options {
            cache_bytes,
            ..Options::default()
        },
    )
    .unwrap()
}

/// The 1K-token prose case of the vectors (1029 Qwen3 tokens).
fn long_text() -> String {
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(model_dir().join("vectors.json")).unwrap())
            .unwrap();
    v["completion_cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "long_text")
        .unwrap()["text"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Ten alternating turns, each about 800 tokens of distinct prose.
fn ten_turns(text: &str) -> Vec<Value> {
    let words: Vec<&str> = text.split(' ').collect();
    (0..10)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let rotated: Vec<&str> = words
                .iter()
                .cycle()
                .skip(i * 37)
                .take(words.len() * 3 / 4)
                .copied()
                .collect();
            json!({"role": role, "content": format!("Turn {i}. {}", rotated.join(" "))})
        })
        .collect()
}

/// Empties the BPE model's word cache (a fresh process).
fn clear_bpe_cache(tok: &ModelTokenizer) {
    if let ModelWrapper::BPE(bpe) = tok.inner().get_model() {
        bpe.clear_cache();
    }
}

fn bench(c: &mut Criterion) {
    let text = long_text();
    let turns = ten_turns(&text);
    let chat = ChatRequest::new(turns.clone());
    let cached = load(64 << 20);
    let uncached = load(0);
    let prompt = uncached.render_chat(&chat).unwrap();
    let tokens = uncached.encode_uncached(&prompt, false).unwrap().len();
    eprintln!("chat_8k: {tokens} tokens, {} bytes", prompt.len());

    let mut g = c.benchmark_group("chat_8k");
    g.sample_size(30);
    g.bench_function("encode_only_uncached", |b| {
        b.iter(|| black_box(uncached.encode_uncached(black_box(&prompt), false).unwrap()));
    });
    g.bench_function("render_only", |b| {
        b.iter(|| black_box(uncached.render_chat(black_box(&chat)).unwrap()));
    });
    g.bench_function("cold_cache_off", |b| {
        b.iter(|| black_box(uncached.tokenize_chat(black_box(&chat)).unwrap()));
    });
    g.bench_function("cold_cache_cleared", |b| {
        b.iter_batched(
            || cached.clear_cache(),
            |()| black_box(cached.tokenize_chat(black_box(&chat)).unwrap()),
            criterion::BatchSize::PerIteration,
        );
    });
    g.bench_function("cold_all_caches", |b| {
        b.iter_batched(
            || {
                cached.clear_cache();
                clear_bpe_cache(&cached);
            },
            |()| black_box(cached.tokenize_chat(black_box(&chat)).unwrap()),
            criterion::BatchSize::PerIteration,
        );
    });
    cached.tokenize_chat(&chat).unwrap();
    g.bench_function("warm_resent", |b| {
        b.iter(|| black_box(cached.tokenize_chat(black_box(&chat)).unwrap()));
    });
    let body = json!({"model": "qwen3", "messages": turns, "max_tokens": 64});
    g.bench_function("warm_resent_from_json", |b| {
        b.iter(|| black_box(cached.tokenize_request(black_box(&body)).unwrap()));
    });
    let n = AtomicU64::new(0);
    g.bench_function("warm_new_turn", |b| {
        b.iter_batched(
            || {
                let mut messages = turns[..9].to_vec();
                let i = n.fetch_add(1, Ordering::Relaxed);
                messages.push(json!({"role": "user", "content": format!("Thanks. Follow-up question number {i}: how do the caches compare?")}));
                ChatRequest::new(messages)
            },
            |request| black_box(cached.tokenize_chat(&request).unwrap()),
            criterion::BatchSize::SmallInput,
        );
    });
    g.finish();

    let completion = CompletionRequest::text(text.clone());
    let mut g = c.benchmark_group("completion_1k");
    g.sample_size(50);
    g.bench_function("cold_cache_off", |b| {
        b.iter(|| {
            black_box(
                uncached
                    .tokenize_completion(black_box(&completion))
                    .unwrap(),
            )
        });
    });
    g.bench_function("cold_bpe_cache_cleared", |b| {
        b.iter_batched(
            || clear_bpe_cache(&uncached),
            |()| {
                black_box(
                    uncached
                        .tokenize_completion(black_box(&completion))
                        .unwrap(),
                )
            },
            criterion::BatchSize::PerIteration,
        );
    });
    cached.tokenize_completion(&completion).unwrap();
    g.bench_function("warm_resent", |b| {
        b.iter(|| black_box(cached.tokenize_completion(black_box(&completion)).unwrap()));
    });
    g.finish();
    let stats = cached.cache_stats();
    eprintln!("cache: {stats:?}");
}

criterion_group!(benches, bench);
criterion_main!(benches);
