//! CPU cost of the engine core's pieces (no I/O): block hashing, a decode
//! step over a full batch, admitting a long prompt against a warm cache.

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kinference_sim::engine::{EngineCore, NewRequest};
use kinference_sim::{BlockHasher, EngineConfig, LatencyModel, OutputLen, SimTokenizer};

fn core() -> EngineCore {
    EngineCore::new(
        EngineConfig {
            num_gpu_blocks: 65_536,
            max_num_batched_tokens: 8192,
            ..EngineConfig::default()
        },
        kinference_sim::EngineMode::default(),
        LatencyModel::default(),
        OutputLen::default(),
        32_768,
        0,
        SimTokenizer::word_level(),
    )
}

fn prompt(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|t| seed * 100_000 + t).collect()
}

fn benches(c: &mut Criterion) {
    let h = BlockHasher::new(16, kinference_sim::hash::DEFAULT_HASH_SEED);
    let tokens = prompt(1, 2048);
    c.bench_function("hash 2048-token prompt (128 blocks)", |b| {
        b.iter(|| {
            let mut d = Vec::with_capacity(128);
            h.extend(std::hint::black_box(&tokens), &mut d);
            d
        });
    });

    // 256 running sequences, all decoding: one schedule + finish.
    c.bench_function("decode step, 256 sequences", |b| {
        b.iter_batched(
            || {
                let mut e = core();
                for i in 0..256 {
                    e.add_request(
                        NewRequest {
                            prompt: prompt(i, 100),
                            max_tokens: Some(10_000),
                            ..NewRequest::default()
                        },
                        0.0,
                    )
                    .expect("fits");
                }
                let mut now = 0.0;
                // Prefill everything, then one decode step to warm up.
                for _ in 0..6 {
                    let s = e.schedule(now).expect("work");
                    now += s.duration;
                    e.finish_step(&s, now);
                    e.take_events();
                }
                (e, now)
            },
            |(mut e, now)| {
                let s = e.schedule(now).expect("work");
                let out = e.finish_step(&s, now + s.duration);
                e.take_events();
                (e, out)
            },
            BatchSize::LargeInput,
        );
    });

    // A 2000-token prompt whose first 1984 tokens are cached.
    c.bench_function("admit a 2000-token prompt, warm cache", |b| {
        b.iter_batched(
            || {
                let mut e = core();
                e.add_request(
                    NewRequest {
                        prompt: prompt(7, 2000),
                        max_tokens: Some(1),
                        ..NewRequest::default()
                    },
                    0.0,
                )
                .expect("fits");
                let s = e.schedule(0.0).expect("work");
                e.finish_step(&s, 0.1);
                e.take_events();
                e
            },
            |mut e| {
                e.add_request(
                    NewRequest {
                        prompt: prompt(7, 2000),
                        max_tokens: Some(1),
                        ..NewRequest::default()
                    },
                    0.2,
                )
                .expect("fits");
                let s = e.schedule(0.2).expect("work");
                (e, s)
            },
            BatchSize::LargeInput,
        );
    });
}

criterion_group!(core_benches, benches);
criterion_main!(core_benches);
