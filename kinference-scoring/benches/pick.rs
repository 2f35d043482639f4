//! Score and pick among 256 candidates: one decision per iteration.
//!
//! Goal for `kinference`: ≤ 2 µs median per decision. Round robin and least
//! in-flight, measured in the same run, are the baselines for ratios.
//!
//! - `pick_256/<policy>`: a mixed fleet (a quarter warm, some partly warm or
//!   on CPU, varied loads, half with scraped figures), calibrated endpoints.
//! - `kinference-stale`: the mixed fleet with every calibration an hour old
//!   (the decaying path).
//! - `kinference-uniform`: 256 identical idle endpoints, the worst case for
//!   pruning (all are equals).
//! - `kinference-explained`: the same decision with a full explanation.
//! - `predict-only`: `predict()` per candidate, the convenience path that
//!   rebuilds per-request constants each call.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kinference_scoring::{
    CacheSource, CachedBlocks, Candidate, EndpointId, EngineMetrics, InFlight, LatencyParams, Pick,
    Policy, PolicyName, RandomSource, Request, SplitMix64, predict,
};

const CANDIDATES: u32 = 256;

/// A fleet with a realistic mix: a quarter hold a long prefix, some partly,
/// some on CPU; loads vary; half have fresh scraped figures; a fifth of the
/// caches are full.
fn fleet(seed: u64) -> Vec<Candidate> {
    let mut rng = SplitMix64::new(seed);
    let mut r = |n: u64| rng.next_u64() % n;
    (0..CANDIDATES)
        .map(|i| {
            let gpu = match r(4) {
                0 => 180,
                1 => r(120) as u32,
                _ => 0,
            };
            let cpu = if r(8) == 0 { gpu + r(40) as u32 } else { 0 };
            let requests = r(64) as u32;
            let decoding = requests.saturating_sub(r(8) as u32);
            Candidate {
                endpoint: EndpointId(i),
                cached: CachedBlocks {
                    gpu,
                    cpu,
                    disk: 0,
                    storage: 0,
                },
                in_flight: InFlight {
                    requests,
                    decoding,
                    prefill_tokens: r(20_000),
                    context_tokens: r(200_000),
                },
                engine: (r(2) == 0).then(|| EngineMetrics {
                    running: r(70) as u32,
                    waiting: r(10) as u32,
                    kv_usage: r(100) as f64 / 100.0,
                    age: Duration::from_millis(r(1500)),
                    own_requests: 0,
                    own_prefilling: 0,
                }),
                evidence: kinference_scoring::Evidence::default(),
                adapter: kinference_scoring::AdapterSlot::Unknown,
                // Every engine reports its cache size, as vLLM's do; some
                // caches are full.
                room: kinference_scoring::KvRoom {
                    capacity_blocks: 20_000,
                    used_blocks: r(25_000) as u32,
                },
                session_blocks: 0,
                peer_arrival_rate: 0.0,
            }
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let params = LatencyParams::default();
    let request = Request {
        prompt_tokens: 3000,
        block_tokens: 16,
        cache: CacheSource::Index,
        ttft_target: None,
    };
    let candidates = fleet(1);

    let mut group = c.benchmark_group("pick_256");
    for name in PolicyName::ALL {
        let mut policy = Policy::new(name, params);
        // Give every endpoint a calibration history and a last-chosen time.
        let mut rng = SplitMix64::new(2);
        let mut now = Duration::from_secs(1);
        for _ in 0..4 * CANDIDATES {
            now += Duration::from_millis(1);
            let choice = policy
                .pick(&request, &candidates, now, &mut rng)
                .expect("candidates");
            let observed = Duration::from_secs_f64(choice.prediction.ttft_ms * 1.1 / 1e3);
            policy.observe(choice.endpoint, &choice.prediction, observed, now);
        }
        for cand in &candidates {
            let p = predict(&params, &request, cand, None, now);
            let observed = Duration::from_secs_f64(p.ttft_ms * 1.2 / 1e3);
            policy.observe(cand.endpoint, &p, observed, now);
        }
        group.bench_function(name.as_str(), |b| {
            b.iter(|| {
                // 100 ns of virtual time per decision keeps the calibrations
                // fresh (< 30 s) through a whole run.
                now += Duration::from_nanos(100);
                black_box(policy.pick(black_box(&request), black_box(&candidates), now, &mut rng))
            });
        });
    }
    // Every calibration stale (an hour without observations): the decaying
    // path for all 256 endpoints.
    let mut policy = Policy::new(PolicyName::Kinference, params);
    let mut rng = SplitMix64::new(5);
    let mut now = Duration::from_secs(1);
    for cand in &candidates {
        let p = predict(&params, &request, cand, None, now);
        policy.observe(
            cand.endpoint,
            &p,
            Duration::from_secs_f64(p.ttft_ms * 1.2 / 1e3),
            now,
        );
    }
    now += Duration::from_secs(3600);
    group.bench_function("kinference-stale", |b| {
        b.iter(|| {
            now += Duration::from_nanos(100);
            black_box(policy.pick(black_box(&request), black_box(&candidates), now, &mut rng))
        });
    });
    // Worst case for pruning: 256 idle, identical, cold endpoints; every one
    // is an equal and least-recently-chosen decides.
    let uniform: Vec<Candidate> = (0..CANDIDATES)
        .map(|i| Candidate {
            endpoint: EndpointId(i),
            ..Candidate::default()
        })
        .collect();
    let mut policy = Policy::new(PolicyName::Kinference, params);
    let mut rng = SplitMix64::new(4);
    let mut now = Duration::from_secs(1);
    group.bench_function("kinference-uniform", |b| {
        b.iter(|| {
            now += Duration::from_micros(10);
            black_box(policy.pick(black_box(&request), black_box(&uniform), now, &mut rng))
        });
    });
    let mut policy = Policy::new(PolicyName::Kinference, params);
    let mut rng = SplitMix64::new(3);
    let mut now = Duration::from_secs(1);
    group.bench_function("kinference-explained", |b| {
        b.iter_batched(
            || (),
            |()| {
                now += Duration::from_micros(10);
                black_box(policy.pick_explained(&request, &candidates, now, &mut rng))
            },
            BatchSize::SmallInput,
        );
    });
    group.bench_function("predict-only", |b| {
        b.iter(|| {
            let mut best = f64::INFINITY;
            for cand in black_box(&candidates) {
                best = best
                    .min(predict(&params, &request, cand, None, Duration::from_secs(1)).ttft_ms);
            }
            black_box(best)
        });
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
