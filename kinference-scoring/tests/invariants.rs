//! Property tests of the invariants the router relies on.

use std::collections::HashMap;
use std::time::Duration;

use kinference_scoring::approx::{PrefixRecord, text_block_keys};
use kinference_scoring::{
    AdapterSlot, CacheSource, CachedBlocks, Calibration, Candidate, EndpointId, EngineMetrics,
    InFlight, KvRoom, LatencyParams, Overrides, Pick, Policy, PolicyName, Prediction, RandomSource,
    Request, SplitMix64, predict,
};
use proptest::prelude::*;

// --- strategies -------------------------------------------------------------

fn arb_source() -> impl Strategy<Value = CacheSource> {
    prop_oneof![
        Just(CacheSource::Index),
        Just(CacheSource::Approximate),
        Just(CacheSource::None)
    ]
}

fn arb_request() -> impl Strategy<Value = Request> {
    (
        0u32..40_000,
        prop_oneof![Just(16u32), Just(64), Just(256), 1u32..600],
        arb_source(),
        proptest::option::weighted(0.3, 1u64..3000),
    )
        .prop_map(|(prompt_tokens, block_tokens, cache, target)| Request {
            prompt_tokens,
            block_tokens,
            cache,
            ttft_target: target.map(Duration::from_millis),
        })
}

fn arb_kv_usage() -> impl Strategy<Value = f64> {
    prop_oneof![8 => 0.0f64..1.0, 1 => -1.0f64..2.0, 1 => Just(f64::NAN)]
}

fn arb_engine() -> impl Strategy<Value = Option<EngineMetrics>> {
    proptest::option::of(
        (
            0u32..600,
            0u32..600,
            arb_kv_usage(),
            0u64..4000,
            0u32..50,
            0u32..50,
        )
            .prop_map(
                |(running, waiting, kv_usage, age_ms, own_requests, own_waiting)| EngineMetrics {
                    running,
                    waiting,
                    kv_usage,
                    age: Duration::from_millis(age_ms),
                    own_requests,
                    own_prefilling: own_waiting.min(own_requests),
                },
            ),
    )
}

fn arb_adapter() -> impl Strategy<Value = AdapterSlot> {
    prop_oneof![
        Just(AdapterSlot::Unknown),
        Just(AdapterSlot::Resident),
        Just(AdapterSlot::Free),
        Just(AdapterSlot::Full),
    ]
}

/// Unknown capacity, or a cache from empty to over-full.
fn arb_room() -> impl Strategy<Value = KvRoom> {
    prop_oneof![
        Just(KvRoom::default()),
        (1u32..5000, 0u32..6000).prop_map(|(capacity_blocks, used_blocks)| KvRoom {
            capacity_blocks,
            used_blocks,
        }),
    ]
}

fn arb_candidate(endpoint: u32) -> impl Strategy<Value = Candidate> {
    (
        (0u32..3000, 0u32..3000, 0u32..3000),
        (0u32..400, 0u32..400, 0u64..300_000, 0u64..2_000_000),
        arb_engine(),
        arb_adapter(),
        arb_room(),
        prop_oneof![Just(0u32), 0u32..3000],
    )
        .prop_map(
            move |(
                (gpu, cpu, disk),
                (requests, decoding, prefill_tokens, context_tokens),
                engine,
                adapter,
                room,
                session_blocks,
            )| {
                Candidate {
                    endpoint: EndpointId(endpoint),
                    cached: CachedBlocks {
                        gpu,
                        cpu,
                        disk,
                        storage: 0,
                    },
                    in_flight: InFlight {
                        requests: requests.max(decoding),
                        decoding,
                        prefill_tokens,
                        context_tokens,
                    },
                    engine,
                    evidence: kinference_scoring::Evidence::default(),
                    adapter,
                    room,
                    session_blocks,
                    // Some candidates with other replicas sending there
                    // (0, 10 or 20 requests a second).
                    peer_arrival_rate: f64::from(endpoint % 3) * 0.01,
                }
            },
        )
}

fn arb_candidates(max: usize) -> impl Strategy<Value = Vec<Candidate>> {
    (1..=max).prop_flat_map(|n| (0..n as u32).map(arb_candidate).collect::<Vec<_>>())
}

fn arb_params() -> impl Strategy<Value = LatencyParams> {
    (
        (1_000.0f64..100_000.0, 0.0f64..100.0, 0.0f64..2.0),
        (0.0f64..=1.0, 0.0f64..=1.0, 0.0f64..=1.0),
        (0.0f64..500.0, any::<bool>(), any::<bool>()),
    )
        .prop_map(
            |((tps, base, decode), (gpu, cpu, disk), (tolerance, calibrate, learn))| {
                let o = Overrides {
                    prefill_tokens_per_second: Some(tps),
                    base_millis: Some(base),
                    decode_cost_millis: Some(decode),
                    gpu_credit: Some(gpu),
                    cpu_credit: Some(cpu),
                    disk_credit: Some(disk),
                    storage_credit: Some(disk / 2.0),
                    tolerance_millis: Some(tolerance),
                    calibrate: Some(calibrate),
                    learn_step_costs: Some(learn),
                };
                LatencyParams::default()
                    .with_overrides(&o)
                    .expect("in range")
            },
        )
}

/// A calibration state shaped by a few arbitrary observations.
fn arb_calibration(params: &LatencyParams) -> impl Strategy<Value = Calibration> + use<> {
    let params = *params;
    proptest::collection::vec((0.0f64..20_000.0, 1u64..60_000), 0..30).prop_map(move |obs| {
        let mut cal = Calibration::prior(&params);
        for (i, (load, observed_ms)) in obs.into_iter().enumerate() {
            let now = Duration::from_millis(i as u64 * 100);
            cal.observe(&params, load, Duration::from_millis(observed_ms), now);
        }
        cal
    })
}

fn setting() -> impl Strategy<Value = (LatencyParams, Request, Candidate, Calibration, u64)> {
    arb_params().prop_flat_map(|params| {
        (
            Just(params),
            arb_request(),
            arb_candidate(0),
            arb_calibration(&params),
            0u64..10_000,
        )
    })
}

fn ttft(params: &LatencyParams, r: &Request, c: &Candidate, cal: &Calibration, now_ms: u64) -> f64 {
    predict(params, r, c, Some(cal), Duration::from_millis(now_ms)).ttft_ms
}

/// `later ≥ earlier` up to floating-point rounding.
fn not_earlier(later: f64, earlier: f64) -> bool {
    later >= earlier - 1e-9 * earlier.abs().max(1.0)
}

// --- the latency model is monotone ------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn more_cached_blocks_never_predict_a_later_first_token(
        (params, r, c, cal, now) in setting(),
        tier in 0usize..3,
        extra in 1u32..2000,
    ) {
        let mut more = c;
        match tier {
            0 => more.cached.gpu += extra,
            1 => more.cached.cpu += extra,
            _ => more.cached.disk += extra,
        }
        let before = ttft(&params, &r, &c, &cal, now);
        let after = ttft(&params, &r, &more, &cal, now);
        prop_assert!(not_earlier(before, after), "{before} -> {after}");
        prop_assert!(after.is_finite() && after > 0.0);
    }

    #[test]
    fn more_queued_work_never_predicts_an_earlier_first_token(
        (params, r, c, cal, now) in setting(),
        knob in 0usize..9,
        extra in 1u32..500,
        fresh_engine in (0u32..600, 0u32..600, 0.0f64..1.0, 0u64..4000),
    ) {
        let mut base = c;
        let mut more = c;
        match knob {
            0 => more.in_flight.prefill_tokens += u64::from(extra) * 100,
            1 => {
                // More of the same requests decoding.
                base.in_flight.requests = base.in_flight.requests.max(base.in_flight.decoding + extra);
                more = base;
                more.in_flight.decoding += extra;
            }
            2 => {
                // More requests the router sent, as seen without scraped figures.
                base.engine = None;
                more = base;
                more.in_flight.requests += extra;
            }
            3 => {
                let (running, waiting, kv_usage, age) = fresh_engine;
                let m = EngineMetrics { running, waiting, kv_usage, age: Duration::from_millis(age), own_requests: 0, own_prefilling: 0 };
                base.engine = Some(m);
                more = base;
                more.engine = Some(EngineMetrics { waiting: waiting + extra, ..m });
            }
            4 => {
                let (running, waiting, kv_usage, age) = fresh_engine;
                let m = EngineMetrics { running, waiting, kv_usage, age: Duration::from_millis(age), own_requests: 0, own_prefilling: 0 };
                base.engine = Some(m);
                more = base;
                more.engine = Some(EngineMetrics { running: running + extra, ..m });
            }
            5 => {
                let (running, waiting, kv_usage, age) = fresh_engine;
                let m = EngineMetrics { running, waiting, kv_usage, age: Duration::from_millis(age), own_requests: 0, own_prefilling: 0 };
                base.engine = Some(m);
                more = base;
                let higher = (kv_usage + f64::from(extra) / 500.0).min(1.0);
                more.engine = Some(EngineMetrics { kv_usage: higher, ..m });
            }
            6 => {
                // Scraped figures appear where there were none.
                let (running, waiting, kv_usage, age) = fresh_engine;
                base.engine = None;
                more = base;
                more.engine = Some(EngineMetrics { running, waiting, kv_usage, age: Duration::from_millis(age), own_requests: 0, own_prefilling: 0 });
            }
            7 => {
                // The adapter must load, or wait for a slot.
                base.adapter = AdapterSlot::Resident;
                more = base;
                more.adapter = if extra % 2 == 0 { AdapterSlot::Free } else { AdapterSlot::Full };
            }
            8 if base.adapter != AdapterSlot::Full => {
                // A free slot fills.
                base.adapter = AdapterSlot::Free;
                more = base;
                more.adapter = AdapterSlot::Full;
            }
            _ => {
                // The same figures, fresher.
                let (running, waiting, kv_usage, age) = fresh_engine;
                let age = age + u64::from(extra);
                let m = EngineMetrics { running, waiting, kv_usage, age: Duration::from_millis(age), own_requests: 0, own_prefilling: 0 };
                base.engine = Some(m);
                more = base;
                more.engine = Some(EngineMetrics { age: Duration::from_millis(age - u64::from(extra)), ..m });
            }
        }
        let before = ttft(&params, &r, &base, &cal, now);
        let after = ttft(&params, &r, &more, &cal, now);
        prop_assert!(not_earlier(after, before), "knob {knob}: {before} -> {after}");
    }

    #[test]
    fn predictions_are_finite_and_account_every_uncached_token(
        (params, r, c, cal, now) in setting(),
    ) {
        let p: Prediction = predict(&params, &r, &c, Some(&cal), Duration::from_millis(now));
        prop_assert!(p.ttft_ms.is_finite() && p.ttft_ms > 0.0);
        prop_assert!(p.uncached_tokens >= 1);
        prop_assert!(p.uncached_tokens <= r.prompt_tokens.max(1));
        prop_assert!((0.0..=1.0).contains(&p.warm_fraction));
        prop_assert!(p.steps >= 1);
    }
}

// --- every policy returns a candidate, deterministically --------------------

proptest! {
    /// A fuller cache or a longer prefill never evicts fewer blocks, and
    /// never more than the prefill writes.
    #[test]
    fn evictions_grow_with_use_and_prefill_and_stay_within_it(
        room in arb_room(),
        more_used in 0u32..2000,
        new in 0.0f64..5000.0,
        more_new in 0.0f64..2000.0,
    ) {
        let e = room.evicted(new);
        prop_assert!((0.0..=new).contains(&e), "{e} of {new}");
        let fuller = KvRoom { used_blocks: room.used_blocks + more_used, ..room };
        prop_assert!(fuller.evicted(new) >= e);
        prop_assert!(room.evicted(new + more_new) >= e);
        if room.capacity_blocks == 0 {
            prop_assert!(e == 0.0);
        }
    }
}

fn arb_policy() -> impl Strategy<Value = PolicyName> {
    proptest::sample::select(PolicyName::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn every_policy_returns_a_candidate_from_the_set(
        name in arb_policy(),
        params in arb_params(),
        rounds in proptest::collection::vec((arb_request(), arb_candidates(24)), 1..8),
        seed in any::<u64>(),
    ) {
        let mut policy = Policy::new(name, params);
        let mut rng = SplitMix64::new(seed);
        for (i, (r, cands)) in rounds.iter().enumerate() {
            let r = Request { block_tokens: r.block_tokens.max(1), ..*r };
            let now = Duration::from_millis(i as u64 * 10);
            let choice = policy.pick(&r, cands, now, &mut rng).expect("valid input");
            prop_assert!(choice.index < cands.len());
            prop_assert_eq!(cands[choice.index].endpoint, choice.endpoint);
            let e = policy.pick_explained(&r, cands, now, &mut rng).expect("valid input");
            prop_assert_eq!(cands[e.choice.index].endpoint, e.choice.endpoint);
            prop_assert_eq!(e.candidates.len(), cands.len());
            let observed = Duration::from_secs_f64(choice.prediction.ttft_ms.max(1.0) * 1.3 / 1e3);
            policy.observe(choice.endpoint, &choice.prediction, observed, now);
        }
    }

    #[test]
    fn picking_is_deterministic_for_a_seed(
        name in arb_policy(),
        rounds in proptest::collection::vec((arb_request(), arb_candidates(16), 0.5f64..3.0), 1..12),
        seed in any::<u64>(),
    ) {
        let run = || {
            let mut policy = Policy::new(name, LatencyParams::default());
            let mut rng = SplitMix64::new(seed);
            let mut out = Vec::new();
            for (i, (r, cands, slowdown)) in rounds.iter().enumerate() {
                let r = Request { block_tokens: r.block_tokens.max(1), ..*r };
                let now = Duration::from_millis(i as u64 * 7);
                let choice = policy.pick(&r, cands, now, &mut rng).expect("valid input");
                let observed = Duration::from_secs_f64(choice.prediction.ttft_ms.max(1.0) * slowdown / 1e3);
                policy.observe(choice.endpoint, &choice.prediction, observed, now);
                out.push(choice);
            }
            out
        };
        prop_assert_eq!(run(), run());
    }

    #[test]
    fn explained_and_plain_picks_agree(
        name in arb_policy(),
        r in arb_request(),
        cands in arb_candidates(32),
        seed in any::<u64>(),
    ) {
        let r = Request { block_tokens: r.block_tokens.max(1), ..r };
        let mut a = Policy::new(name, LatencyParams::default());
        let mut b = a.clone();
        let mut rng_a = SplitMix64::new(seed);
        let mut rng_b = rng_a.clone();
        for t in 0..3 {
            let now = Duration::from_secs(t);
            let x = a.pick(&r, &cands, now, &mut rng_a).expect("valid input");
            let e = b.pick_explained(&r, &cands, now, &mut rng_b).expect("valid input");
            prop_assert_eq!(x, e.choice);
        }
    }
}

proptest! {
    // Most arbitrary fleets' choice is also their fastest candidate: many
    // cases, so that a few hundred have a choice the target can overrule.
    #![proptest_config(ProptestConfig::with_cases(3000))]

    /// A TTFT target changes kinference's choice only when that choice is
    /// predicted to miss it and another candidate to meet it; then the
    /// choice meets it, with the best score of those that do (within the
    /// equals' margin).
    #[test]
    fn a_ttft_target_is_met_whenever_a_candidate_meets_it(
        r in arb_request(),
        cands in arb_candidates(24),
        target_ms in 1u64..3000,
        between in proptest::option::weighted(0.7, 0.0f64..1.0),
        seed in any::<u64>(),
    ) {
        let free = Request { block_tokens: r.block_tokens.max(1), ttft_target: None, ..r };
        let params = LatencyParams::default();
        let now = Duration::from_secs(1);
        let mut a = Policy::new(PolicyName::Kinference, params);
        let mut b = a.clone();
        let x = a.propose_explained(&free, &cands, now, &mut SplitMix64::new(seed)).expect("valid input");
        // Mostly a target between the fastest candidate's prediction and
        // the choice's (met by some, missed by the choice when it is not
        // the fastest); else any.
        let fastest = x.candidates.iter().map(|c| c.prediction.ttft_ms).fold(f64::INFINITY, f64::min);
        let chosen = x.choice.prediction.ttft_ms;
        let t = match between {
            Some(f) if chosen > fastest => fastest + f * (chosen - fastest),
            _ => target_ms as f64,
        };
        let held = Request { ttft_target: Some(Duration::from_secs_f64(t / 1e3)), ..free };
        let t = held.ttft_target.map_or(t, |d| d.as_secs_f64() * 1e3);
        let y = b.propose_explained(&held, &cands, now, &mut SplitMix64::new(seed)).expect("valid input");
        let meeting: Vec<f64> = x.candidates.iter().filter(|c| c.prediction.ttft_ms <= t).map(|c| c.score).collect();
        if x.choice.prediction.ttft_ms <= t || meeting.is_empty() {
            prop_assert_eq!(x.choice, y.choice);
        } else {
            prop_assert!(y.choice.prediction.ttft_ms <= t, "{} > {t}", y.choice.prediction.ttft_ms);
            let best = meeting.iter().copied().fold(f64::INFINITY, f64::min);
            let margin = params.tie_millis.max(params.tie_fraction * best.max(0.0));
            prop_assert!(y.candidates[y.choice.index].score <= best + margin + 1e-9);
            let is_met_target = matches!(
                y.choice.reason,
                kinference_scoring::Reason::MetTarget { preferred, .. } if preferred == x.choice.endpoint
            );
            prop_assert!(is_met_target, "{:?}", y.choice.reason);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    /// Pruning by lower bounds (plain picks) must never change a decision
    /// against the full evaluation (explained picks), on fleets the size the
    /// benchmark uses, with calibrated endpoints.
    #[test]
    fn pruning_changes_no_decision_on_large_fleets(
        r in arb_request(),
        cands in (200usize..=256).prop_flat_map(|n| (0..n as u32).map(arb_candidate).collect::<Vec<_>>()),
        slowdowns in proptest::collection::vec(0.3f64..3.0, 256),
        seed in any::<u64>(),
    ) {
        let r = Request { block_tokens: r.block_tokens.max(1), ..r };
        let mut a = Policy::new(PolicyName::Kinference, LatencyParams::default());
        let now = Duration::from_secs(1);
        for (c, slow) in cands.iter().zip(&slowdowns) {
            let p = predict(&LatencyParams::default(), &r, c, None, now);
            a.observe(c.endpoint, &p, Duration::from_secs_f64(p.ttft_ms.max(1.0) * slow / 1e3), now);
        }
        let mut b = a.clone();
        let mut rng_a = SplitMix64::new(seed);
        let mut rng_b = rng_a.clone();
        for t in 0..4 {
            let now = now + Duration::from_millis(t);
            let x = a.pick(&r, &cands, now, &mut rng_a).expect("valid input");
            let e = b.pick_explained(&r, &cands, now, &mut rng_b).expect("valid input");
            prop_assert_eq!(x, e.choice);
        }
    }
}

// --- calibration --------------------------------------------------------------

/// Standard normal deviate (Box–Muller).
fn normal(rng: &mut SplitMix64) -> f64 {
    let u1 = ((rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64).max(1e-12);
    let u2 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// `n` observations of `offset + scale · load` with multiplicative noise,
/// loads log-uniform over 1 ms..5 s, 50 ms apart.
fn train(
    cal: &mut Calibration,
    p: &LatencyParams,
    truth: (f64, f64),
    noise: f64,
    n: usize,
    rng: &mut SplitMix64,
) -> Duration {
    let mut now = Duration::ZERO;
    for _ in 0..n {
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let load = 5000f64.powf(u);
        let y = (truth.0 + truth.1 * load) * (1.0 + noise * normal(rng)).max(0.05);
        now += Duration::from_millis(50);
        cal.observe(p, load, Duration::from_secs_f64(y / 1e3), now);
    }
    now
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn calibration_converges_with_noise(
        offset in 1.0f64..100.0,
        scale in 0.5f64..3.0,
        noise in 0.0f64..0.08,
        seed in any::<u64>(),
    ) {
        let p = LatencyParams::default();
        let mut cal = Calibration::prior(&p);
        let mut rng = SplitMix64::new(seed);
        let now = train(&mut cal, &p, (offset, scale), noise, 1500, &mut rng);
        for load in [5.0, 50.0, 500.0, 5000.0] {
            let want = offset + scale * load;
            let got = cal.predict(&p, load, now);
            prop_assert!((got - want).abs() / want < 0.12, "load {}: {} vs {}", load, got, want);
        }
    }

    #[test]
    fn calibration_ignores_a_single_outlier(
        offset in 1.0f64..100.0,
        scale in 0.5f64..3.0,
        factor in prop_oneof![5.0f64..1000.0, 0.001f64..0.2],
        load in 1.0f64..5000.0,
        seed in any::<u64>(),
    ) {
        let p = LatencyParams::default();
        let mut cal = Calibration::prior(&p);
        let mut rng = SplitMix64::new(seed);
        let now = train(&mut cal, &p, (offset, scale), 0.05, 600, &mut rng);
        let probes = [5.0, 500.0, 5000.0];
        let before: Vec<f64> = probes.iter().map(|&x| cal.predict(&p, x, now)).collect();
        let outlier = (offset + scale * load) * factor;
        let later = now + Duration::from_millis(50);
        cal.observe(&p, load, Duration::from_secs_f64(outlier / 1e3), later);
        for (x, b) in probes.iter().zip(&before) {
            let a = cal.predict(&p, *x, later);
            prop_assert!((a - b).abs() / b < 0.05, "load {}: {} -> {}", x, b, a);
        }
    }
}

// --- parameters -------------------------------------------------------------

proptest! {
    #[test]
    fn overrides_are_accepted_exactly_when_in_range(
        tps in proptest::option::of(prop_oneof![-10.0f64..1e6, Just(f64::NAN), Just(f64::INFINITY)]),
        base in proptest::option::of(-10.0f64..1000.0),
        credit in proptest::option::of(-0.5f64..1.5),
        tolerance in proptest::option::of(prop_oneof![-10.0f64..1000.0, Just(f64::NAN)]),
    ) {
        let o = Overrides {
            prefill_tokens_per_second: tps,
            base_millis: base,
            cpu_credit: credit,
            tolerance_millis: tolerance,
            ..Overrides::default()
        };
        let valid = tps.is_none_or(|v| v.is_finite() && v > 0.0)
            && base.is_none_or(|v| v >= 0.0)
            && credit.is_none_or(|v| (0.0..=1.0).contains(&v))
            && tolerance.is_none_or(|v| v >= 0.0);
        prop_assert_eq!(LatencyParams::default().with_overrides(&o).is_ok(), valid);
    }
}

// --- the prefix record against a naive model ---------------------------------

#[derive(Debug, Clone)]
enum Op {
    Record {
        endpoint: u32,
        text: usize,
        blocks: usize,
    },
    Advance {
        ms: u64,
    },
    Remove {
        endpoint: u32,
    },
    Lookup {
        text: usize,
        blocks: usize,
    },
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..5, 0usize..3, 0usize..9).prop_map(|(endpoint, text, blocks)| Op::Record { endpoint, text, blocks }),
        2 => (0u64..8000).prop_map(|ms| Op::Advance { ms }),
        1 => (0u32..5).prop_map(|endpoint| Op::Remove { endpoint }),
        4 => (0usize..3, 0usize..9).prop_map(|(text, blocks)| Op::Lookup { text, blocks }),
    ]
}

proptest! {
    #[test]
    fn prefix_record_matches_a_naive_model(ops in proptest::collection::vec(arb_op(), 1..80)) {
        const TTL_MS: u64 = 10_000;
        // Three prompts sharing leading text in pairs.
        let texts: [&[u8]; 3] = [
            b"system prompt: be brief. user: hello there, how are you",
            b"system prompt: be brief. user: what is the time please?",
            b"another system prompt entirely, user: hello there......",
        ];
        let keys: Vec<Vec<u64>> = texts
            .iter()
            .map(|t| {
                let mut k = Vec::new();
                text_block_keys(1, t, 6, &mut k);
                k
            })
            .collect();
        let mut record = PrefixRecord::new(Duration::from_millis(TTL_MS), 1 << 16);
        let mut model: HashMap<(u64, u32), u64> = HashMap::new();
        let mut now = 0u64;
        for op in ops {
            match op {
                Op::Record { endpoint, text, blocks } => {
                    let k = &keys[text][..blocks.min(keys[text].len())];
                    record.record(EndpointId(endpoint), k, Duration::from_millis(now));
                    for &key in k {
                        model.insert((key, endpoint), now);
                    }
                }
                Op::Advance { ms } => now += ms,
                Op::Remove { endpoint } => {
                    record.remove_endpoint(EndpointId(endpoint));
                    model.retain(|&(_, e), _| e != endpoint);
                }
                Op::Lookup { text, blocks } => {
                    let k = &keys[text][..blocks.min(keys[text].len())];
                    let mut got = Vec::new();
                    record.leading_blocks(k, Duration::from_millis(now), &mut got);
                    got.sort();
                    let mut want = Vec::new();
                    for e in 0..5u32 {
                        let n = k
                            .iter()
                            .take_while(|&&key| model.get(&(key, e)).is_some_and(|&at| now - at <= TTL_MS))
                            .count() as u32;
                        if n > 0 {
                            want.push((EndpointId(e), n));
                        }
                    }
                    prop_assert_eq!(got, want);
                }
            }
        }
    }
}
