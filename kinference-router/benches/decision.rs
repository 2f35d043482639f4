//! The router's own decision path, called as the router calls it: the
//! prepare stage (`kinference_router::prepare::prepare`: the body's routing
//! fields, local tokenization with the worker set's tokenizer, block keys)
//! then the decision core (`kinference_router::decide::decide`: candidates,
//! index lookup, prefix record, the policy's proposal), on a 10-turn chat of
//! about 8K Qwen3 tokens among 16 endpoints, 4 of which hold the history.
//!
//! | function | what |
//! |---|---|
//! | `chat_8k_warm/total` | prepare + decide, the same chat re-sent (every cache warm) |
//! | `chat_8k_warm/new_turn` | prepare + decide, the history cached and a new turn |
//! | `chat_8k_warm/decide` | the decision core alone |
//! | `chat_5k_cold/total` | prepare + decide for a 5K-token chat of random vocabulary tokens no cache has seen (a new conversation of the hardest text) |
//! | `chat_5k_cold_prose/total` | the same for 5K tokens of natural text in an order no cache has seen (a new conversation of prose) |
//! | `chat_5k_cold_code/total` | the same for 5K tokens of source code no cache has seen (what coding agents send: this crate's own sources, a different window each time) |
//!
//! Goals (issue 14): warm ≤ 20 µs, cold 5K ≤ 1 ms of CPU. The HTTP parts are
//! measured end to end by `cargo xtask bench proxy`.

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use kinference_api::endpoints::ReadyEndpoint;
use kinference_api::v1alpha1::{ModelSpec, TokenizationMode};
use kinference_kvindex::{BlockHash, BlockStored, KvEvent};
use kinference_router::catalog::{Snapshot, WorkerSetRoute};
use kinference_router::config::Config;
use kinference_router::decide::{Now, decide};
use kinference_router::endpoint::{EndpointKey, Registry};
use kinference_router::openai;
use kinference_router::prepare::{Head, Prepared, prepare};
use kinference_router::runtime::{TokenizerState, WsRuntime};
use kinference_router::state::Shared;
use kinference_router::view::View;
use kinference_scoring::{LatencyParams, PolicyName, SplitMix64};
use kinference_tokenize::{Endpoint, ModelTokenizer};
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const BLOCK: u32 = 16;
const ENDPOINTS: usize = 16;
const MODEL: &str = "qwen3";

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

/// Source code: this crate's own `src/` files, concatenated in name order.
fn code() -> String {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("the crate's src/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|f| std::fs::read_to_string(f).expect("a source file"))
        .collect()
}

/// `n` alternating turns of about 800 tokens each, starting at `skew`.
fn turns(text: &str, n: usize, skew: usize) -> Vec<Value> {
    let words: Vec<&str> = text.split(' ').collect();
    (0..n)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let t: Vec<&str> = words
                .iter()
                .cycle()
                .skip(i * 37 + skew)
                .take(words.len() * 3 / 4)
                .copied()
                .collect();
            json!({"role": role, "content": format!("Turn {i}. {}", t.join(" "))})
        })
        .collect()
}

struct Bench {
    shared: Arc<Shared>,
    view: Arc<View>,
    rt: tokio::runtime::Runtime,
    _stop: CancellationToken,
}

impl Bench {
    fn new(tok: &Arc<ModelTokenizer>) -> Self {
        let stop = CancellationToken::new();
        let shared = Shared::new(Config::default(), stop.clone());
        let route = WorkerSetRoute {
            name: "qwen".into(),
            kv_block_size: BLOCK,
            profile_name: "default".into(),
            profile: None,
            models: vec![ModelSpec {
                name: MODEL.into(),
                aliases: vec![],
            }],
            kv_events: true,
            endpoints: (0..ENDPOINTS)
                .map(|i| ReadyEndpoint {
                    address: format!("10.0.0.{i}"),
                    http_port: 8000,
                    kv_port: Some(5557),
                    replay_port: None,
                    target: None,
                })
                .collect(),
        };
        let snapshot = Snapshot {
            synced: true,
            pool_found: true,
            worker_sets: vec![route],
            problems: vec![],
        };
        let mut registry = Registry::default();
        registry.sync(
            snapshot.endpoints().map(|(_, e)| EndpointKey {
                address: e.address.clone(),
                http_port: e.http_port,
            }),
            &stop,
        );
        let ws = Arc::new(WsRuntime::new(
            LatencyParams::default(),
            TokenizationMode::Local,
            PolicyName::Kinference,
            Duration::from_secs(30),
        ));
        *ws.tokenizer.write() = Some(tok.clone());
        *ws.tokenizer_state.write() = TokenizerState::Checked;
        let view = View::build(&snapshot, &registry, &|_| ws.clone());
        shared.runtime.set_view(view);
        for (i, e) in registry.all().enumerate() {
            // Some load, so the candidates differ.
            std::mem::forget(e.begin((i as u64 % 3) * 100, 0));
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let view = shared.view();
        Self {
            shared,
            view,
            rt,
            _stop: stop,
        }
    }

    /// `address` holds the blocks of `ids`.
    fn store(&self, endpoint: usize, ids: &[u32]) {
        let e = self.view.worker_sets[0].endpoints[endpoint].clone();
        let w = self.shared.kv.attach(&e, 0, BLOCK).expect("attach");
        let blocks = ids.len() / BLOCK as usize;
        let ev = KvEvent::BlockStored(BlockStored {
            block_hashes: (0..blocks)
                .map(|i| BlockHash::Uint((endpoint as u64) << 32 | (1 + i as u64)))
                .collect(),
            parent_block_hash: None,
            token_ids: ids[..blocks * BLOCK as usize].to_vec(),
            block_size: BLOCK,
            ..BlockStored::default()
        });
        self.shared.kv.index().apply_event(w, &ev).expect("apply");
    }

    fn prepare(&self, body: &Bytes) -> Prepared {
        let head = Head {
            path_and_query: "/v1/chat/completions".into(),
            headers: http::HeaderMap::new(),
            debug: false,
            key_class: None,
            arrived: tokio::time::Instant::now(),
        };
        self.rt
            .block_on(prepare(
                &self.shared,
                &self.view,
                openai::Endpoint::Chat,
                head,
                body.clone(),
            ))
            .expect("prepared")
    }

    fn decide(&self, p: &Prepared, rng: &mut SplitMix64) -> usize {
        let now = Now {
            instant: Instant::now(),
            since_start: Duration::from_secs(1),
        };
        let d = decide(&self.view, &self.shared.kv, p, &[], now, rng, false).expect("decided");
        d.choice.index
    }
}

fn bench(crit: &mut Criterion) {
    let tok =
        Arc::new(ModelTokenizer::from_dir(testdata("qwen3")).expect("qwen3 tokenizer in testdata"));
    let bench = Bench::new(&tok);
    let text = prose();
    let ten = turns(&text, 10, 0);
    let body = |messages: &[Value]| {
        Bytes::from(
            serde_json::to_vec(&json!({"model": MODEL, "messages": messages, "max_tokens": 64}))
                .expect("json"),
        )
    };
    let history = body(&ten[..9]);
    let full = body(&ten);
    let history_ids = tok
        .tokenize(
            Endpoint::ChatCompletions,
            &serde_json::from_slice(&history).expect("json"),
        )
        .expect("tokenize")
        .token_ids
        .remove(0);
    for e in 0..4 {
        bench.store(e, &history_ids);
    }
    for e in 4..ENDPOINTS {
        // Other conversations: unrelated prefixes.
        let other: Vec<u32> = (0..4096).map(|i| 200_000 + e as u32 * 10_000 + i).collect();
        bench.store(e, &other);
    }
    let mut rng = SplitMix64::new(1);
    let warm = bench.prepare(&full);
    eprintln!(
        "prompt: {} tokens, {} blocks; history held by 4 of {ENDPOINTS} endpoints",
        warm.routes[0].request.prompt_tokens,
        warm.routes[0].keys.len()
    );
    assert!(
        bench.decide(&warm, &mut rng) < 4,
        "the warm endpoints should win"
    );

    let mut g = crit.benchmark_group("decision");
    g.bench_function("chat_8k_warm/total", |bch| {
        bch.iter(|| {
            let p = bench.prepare(black_box(&full));
            black_box(bench.decide(&p, &mut rng))
        });
    });
    g.bench_function("chat_8k_warm/decide", |bch| {
        bch.iter(|| black_box(bench.decide(black_box(&warm), &mut rng)));
    });
    // New turns of the same history: each iteration sends turns 0..9 and a
    // new 10th turn never seen before.
    let mut n = 0usize;
    g.bench_function("chat_8k_warm/new_turn", |bch| {
        bch.iter_batched(
            || {
                n += 1;
                let mut m = ten[..9].to_vec();
                let mut last = turns(&text, 10, n * 11)[9].clone();
                last["content"] = json!(format!(
                    "New turn {n}. {}",
                    last["content"].as_str().unwrap_or("")
                ));
                m.push(last);
                body(&m)
            },
            |fresh| {
                let p = bench.prepare(&fresh);
                black_box(bench.decide(&p, &mut rng))
            },
            criterion::BatchSize::SmallInput,
        );
    });
    // A new conversation of text no cache has seen: random vocabulary
    // tokens decoded (what synthetic agent traces send), about 5K tokens in
    // a system prompt and a user turn.
    let vocab = u64::try_from(tok.vocab_size()).expect("vocab size") - 1000;
    let mut seed = SplitMix64::new(99);
    let mut cold_body = || {
        let mut part = |n: usize| {
            let ids: Vec<u32> = (0..n)
                .map(|_| (kinference_scoring::RandomSource::next_u64(&mut seed) % vocab) as u32)
                .collect();
            tok.decode(&ids).expect("decode")
        };
        body(&[
            json!({"role": "system", "content": part(4000)}),
            json!({"role": "user", "content": part(1000)}),
        ])
    };
    let cold = bench.prepare(&cold_body());
    eprintln!("cold chat: {} tokens", cold.routes[0].request.prompt_tokens);
    // A new conversation of natural text no cache has seen: the prose's
    // words in a fresh random order (load generators such as aiperf send
    // slices of a real corpus, and users send prose and code), about 5K
    // tokens in a system prompt and a user turn.
    let words: Vec<&str> = text.split_whitespace().collect();
    let mut order = SplitMix64::new(7);
    let mut prose_body = || {
        let mut part = |copies: usize| {
            let mut out = Vec::with_capacity(words.len() * copies);
            for _ in 0..copies {
                let mut w = words.clone();
                for i in (1..w.len()).rev() {
                    let j = (kinference_scoring::RandomSource::next_u64(&mut order)
                        % (i as u64 + 1)) as usize;
                    w.swap(i, j);
                }
                out.extend(w);
            }
            out.join(" ")
        };
        body(&[
            json!({"role": "system", "content": part(4)}),
            json!({"role": "user", "content": part(1)}),
        ])
    };
    let prose_cold = bench.prepare(&prose_body());
    eprintln!(
        "cold prose chat: {} tokens",
        prose_cold.routes[0].request.prompt_tokens
    );
    // A new conversation of source code no cache has seen: a window of
    // about 5K tokens (16 KB in a system prompt, 4 KB in a user turn) that
    // moves on by 20 KB each time over this crate's top-level sources (~480 KB).
    let sources = code();
    let mut at = 0usize;
    let mut code_body = || {
        // The first character boundary at or after `i`.
        let boundary = |mut i: usize| {
            while !sources.is_char_boundary(i) {
                i += 1;
            }
            i
        };
        let window = |from: usize, len: usize| -> String {
            // (4 bytes short of the end: a boundary is at most 3 bytes on.)
            let from = boundary(from % (sources.len() - len - 4));
            sources[from..boundary(from + len)].to_owned()
        };
        let (system, user) = (window(at, 16_000), window(at + 16_000, 4_000));
        at += 20_000;
        body(&[
            json!({"role": "system", "content": system}),
            json!({"role": "user", "content": user}),
        ])
    };
    let code_cold = bench.prepare(&code_body());
    eprintln!(
        "cold code chat: {} tokens of {} KB of sources",
        code_cold.routes[0].request.prompt_tokens,
        sources.len() / 1000
    );
    // Each iteration a new body of its kind, prepared and decided.
    let cold: [(&str, &mut dyn FnMut() -> Bytes); 3] = [
        ("chat_5k_cold_code/total", &mut code_body),
        ("chat_5k_cold/total", &mut cold_body),
        ("chat_5k_cold_prose/total", &mut prose_body),
    ];
    for (name, make) in cold {
        g.bench_function(name, |bch| {
            bch.iter_batched(
                &mut *make,
                |fresh| {
                    let p = bench.prepare(black_box(&fresh));
                    black_box(bench.decide(&p, &mut rng))
                },
                criterion::BatchSize::SmallInput,
            );
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
