use super::fleet::FLEET_UPDATE_EVERY;
use super::*;
use crate::input::CacheSource;
use crate::rng::SplitMix64;

fn request() -> Request {
    Request {
        prompt_tokens: 4000,
        block_tokens: 16,
        cache: CacheSource::Index,
        ttft_target: None,
    }
}

/// Endpoint `id` holding `gpu` leading blocks, one request in flight when
/// `prefill_tokens` are still to prefill there.
fn cand(id: u32, gpu: u32, prefill_tokens: u64) -> Candidate {
    let requests = u32::from(prefill_tokens > 0);
    crate::policies::baseline::test_support::cand(id, gpu, requests, prefill_tokens)
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn warm_idle_beats_cold_idle() {
    let mut p = Kinference::new(LatencyParams::default());
    let mut rng = SplitMix64::new(1);
    let cands = [cand(0, 0, 0), cand(1, 240, 0), cand(2, 0, 0)];
    let choice = p.pick(&request(), &cands, secs(1), &mut rng).unwrap();
    assert_eq!(choice.endpoint, EndpointId(1));
    assert_eq!(choice.reason, Reason::LowestPredictedTtft);
    assert_eq!(choice.tie, Tie::None);
    assert_eq!(choice.uncached_tokens(), 4000 - 240 * 16);
}

#[test]
fn a_sessions_engine_wins_when_the_prompt_cannot_be_matched() {
    let params = LatencyParams::default();
    let mut p = Kinference::new(params);
    let mut rng = SplitMix64::new(1);
    let session = |id, blocks| Candidate {
        session_blocks: blocks,
        ..cand(id, 0, 0)
    };
    // Nothing matched anywhere (the router could not key the prompt as
    // the engine did); the engines' events put the session on 2.
    let cands = [cand(0, 0, 0), cand(1, 0, 0), session(2, 200), cand(3, 0, 0)];
    for source in [
        CacheSource::Index,
        CacheSource::Approximate,
        CacheSource::None,
    ] {
        let req = Request {
            cache: source,
            ..request()
        };
        let choice = p.pick(&req, &cands, secs(1), &mut rng).unwrap();
        assert_eq!(choice.endpoint, EndpointId(2), "{source:?}");
        let credited = 200.0 * params.approximate_credit * 16.0;
        assert_eq!(choice.uncached_tokens(), (4000.0 - credited).ceil() as u32);
    }
    // Where the prompt itself is matched deeper, the session adds nothing.
    let cands = [cand(0, 240, 0), session(2, 100)];
    let choice = p.pick(&request(), &cands, secs(2), &mut rng).unwrap();
    assert_eq!(choice.endpoint, EndpointId(0));
    let same = [
        Candidate {
            session_blocks: 100,
            ..cand(0, 240, 0)
        },
        cand(1, 0, 0),
    ];
    let with = p.pick(&request(), &same, secs(3), &mut rng).unwrap();
    assert_eq!(with.uncached_tokens(), 4000 - 240 * 16);
}

#[test]
fn cache_misses_spread_over_equal_endpoints() {
    let mut p = Kinference::new(LatencyParams::default());
    let mut rng = SplitMix64::new(1);
    let cands: Vec<_> = (0..4).map(|i| cand(i, 0, 0)).collect();
    let mut seen = Vec::new();
    for t in 1..=8 {
        let choice = p.pick(&request(), &cands, secs(t), &mut rng).unwrap();
        seen.push(choice.endpoint.0);
    }
    // Each round of four visits every endpoint once, least recently
    // chosen first.
    let mut first: Vec<_> = seen[..4].to_vec();
    first.sort_unstable();
    assert_eq!(first, [0, 1, 2, 3]);
    assert_eq!(seen[4..], seen[..4]);
}

#[test]
fn saturated_warm_endpoint_releases_to_a_cold_one() {
    let mut p = Kinference::new(LatencyParams::default());
    let mut rng = SplitMix64::new(1);
    // The warm endpoint has ~2 s of prefill queued; a cold prefill of
    // 4000 tokens takes ~160 ms.
    let cands = [cand(0, 240, 50_000), cand(1, 0, 0)];
    let choice = p.pick(&request(), &cands, secs(1), &mut rng).unwrap();
    assert_eq!(choice.endpoint, EndpointId(1));
    assert!(
        matches!(choice.reason, Reason::SaturationRelease { warmest, later_ms } if warmest == EndpointId(0) && later_ms > 1000.0),
        "{:?}",
        choice.reason
    );
}

#[test]
fn warm_endpoint_keeps_the_request_within_tolerance() {
    let params = LatencyParams {
        tolerance_millis: 100.0,
        ..LatencyParams::default()
    };
    let mut p = Kinference::new(params);
    let mut rng = SplitMix64::new(1);
    // Fully warm but with 5000 tokens queued (+200 ms); cold costs the
    // whole prompt (160 ms): the warm one is ~40 ms later, within 100 ms.
    let cands = [cand(0, 250, 5000), cand(1, 0, 0)];
    let choice = p.pick(&request(), &cands, secs(1), &mut rng).unwrap();
    assert_eq!(choice.endpoint, EndpointId(0));
    assert!(
        matches!(choice.reason, Reason::StayedWarm { fastest, .. } if fastest == EndpointId(1)),
        "{:?}",
        choice.reason
    );
    // With no tolerance the cold one wins.
    let mut p = Kinference::new(LatencyParams {
        tolerance_millis: 0.0,
        ..params
    });
    let choice = p.pick(&request(), &cands, secs(1), &mut rng).unwrap();
    assert_eq!(choice.endpoint, EndpointId(1));
}

#[test]
fn a_ttft_target_outranks_the_cache_only_when_the_warm_choice_misses_it() {
    let mut p = Kinference::new(LatencyParams {
        tolerance_millis: 100.0,
        ..LatencyParams::default()
    });
    let mut rng = SplitMix64::new(1);
    // As above: the warm endpoint keeps the request, ~40 ms later.
    let cands = [cand(0, 250, 5000), cand(1, 0, 0)];
    let warm = p.propose(&request(), &cands, secs(1), &mut rng).unwrap();
    let Reason::StayedWarm { later_ms, .. } = warm.reason else {
        panic!("{:?}", warm.reason)
    };
    let (warm_ms, cold_ms) = (warm.prediction.ttft_ms, warm.prediction.ttft_ms - later_ms);
    let with = |ms: f64| Request {
        ttft_target: Some(Duration::from_secs_f64(ms / 1e3)),
        ..request()
    };
    // Met by the cold one only: it wins, and says why.
    let target = with(cold_ms + later_ms / 2.0);
    let c = p.propose(&target, &cands, secs(1), &mut rng).unwrap();
    assert_eq!(c.endpoint, EndpointId(1));
    assert!(
        matches!(c.reason, Reason::MetTarget { preferred, preferred_ms, later_ms }
            if preferred == EndpointId(0) && (preferred_ms - warm_ms).abs() < 1e-9 && later_ms == 0.0),
        "{:?}",
        c.reason
    );
    let e = p
        .propose_explained(&target, &cands, secs(1), &mut rng)
        .unwrap();
    assert_eq!(e.choice, c, "explained and plain agree");
    assert_eq!(e.request.ttft_target, target.ttft_target);
    // Met by both, or by neither: the warm one, as without a target.
    for ms in [warm_ms + 1.0, cold_ms - 1.0] {
        let c = p.propose(&with(ms), &cands, secs(1), &mut rng).unwrap();
        assert_eq!(c, warm, "target {ms} ms");
    }
}

#[test]
fn a_new_prefix_goes_where_it_evicts_nothing_in_recent_use() {
    let mut rng = SplitMix64::new(1);
    // Both cold for a 4000-token prompt (250 blocks, ~160 ms); 1 has
    // 500 tokens queued (+20 ms, and a small externality), so TTFT
    // alone picks 0. But 0's cache (1000 blocks) is full of blocks this
    // router sent there: its prefill would evict 250 of them.
    let room = |capacity_blocks, used_blocks| KvRoom {
        capacity_blocks,
        used_blocks,
    };
    let full = Candidate {
        room: room(1000, 1000),
        ..cand(0, 0, 0)
    };
    let roomy = Candidate {
        room: room(1000, 300),
        ..cand(1, 0, 500)
    };
    let cands = [full, roomy];
    let params = LatencyParams::default();
    let off = LatencyParams {
        eviction_weight: 0.0,
        ..params
    };
    // Both engines' speeds measured: each answered on time, as often as
    // free room needs before it counts.
    let measured = |params: LatencyParams| {
        let mut p = Kinference::new(params);
        for id in [0, 1] {
            let c = cand(id, 0, 0);
            for t in 0..ROOM_NEEDS_SAMPLES {
                let at = Duration::from_millis(100 + u64::from(t));
                let pred = p.predict(&request(), &c, at);
                let on_time = Duration::from_secs_f64(pred.ttft_ms / 1e3);
                p.observe(EndpointId(id), &pred, on_time, at);
            }
        }
        p
    };
    let pick = |params: LatencyParams, cands: &[Candidate], rng: &mut SplitMix64| {
        measured(params)
            .propose_explained(&request(), cands, secs(1), rng)
            .unwrap()
    };
    assert_eq!(pick(off, &cands, &mut rng).choice.endpoint, EndpointId(0));
    let e = pick(params, &cands, &mut rng);
    assert_eq!(e.choice.endpoint, EndpointId(1));
    // Room on an engine whose speed is not measured yet draws nothing:
    // it counts as full.
    let unmeasured = Kinference::new(params)
        .propose(&request(), &cands, secs(1), &mut rng)
        .unwrap();
    assert_eq!(unmeasured.endpoint, EndpointId(0));
    // Nor on one measured long ago: its fit has gone stale.
    let stale = measured(params)
        .propose(&request(), &cands, secs(120), &mut rng)
        .unwrap();
    assert_eq!(stale.endpoint, EndpointId(0));
    let eviction = |i: usize| match e.candidates[i].detail {
        ScoreDetail::Kinference { eviction_ms, .. } => eviction_ms,
        ref d => panic!("{d:?}"),
    };
    // Recomputing the 250 evicted blocks at 25k tokens/s, times the
    // weight.
    let expected = params.eviction_weight * 4000.0 * 1e3 / params.prefill_tokens_per_second;
    assert!((eviction(0) - expected).abs() < 1e-6, "{}", eviction(0));
    assert!(eviction(1).abs() < 1e-12);
    // Partly free: only the blocks beyond the free ones count.
    let half = [
        Candidate {
            room: room(1000, 875),
            ..full
        },
        roomy,
    ];
    let e = pick(params, &half, &mut rng);
    let ScoreDetail::Kinference { eviction_ms, .. } = e.candidates[0].detail else {
        panic!()
    };
    assert!((eviction_ms - expected / 2.0).abs() < 1e-6, "{eviction_ms}");
    // Both over-full: both pay for their own prefill, and the TTFT
    // decides as without the charge; without a known capacity, no
    // charge at all.
    let both = [
        full,
        Candidate {
            room: room(1000, 1000),
            ..roomy
        },
    ];
    assert_eq!(pick(params, &both, &mut rng).choice.endpoint, EndpointId(0));
    let unknown = [
        Candidate {
            room: room(0, 5000),
            ..full
        },
        roomy,
    ];
    assert_eq!(
        pick(params, &unknown, &mut rng).choice.endpoint,
        EndpointId(0)
    );
    // A warm candidate writes fewer new blocks, so it evicts fewer.
    let warm = [
        Candidate {
            room: room(1000, 1000),
            ..cand(0, 240, 0)
        },
        roomy,
    ];
    assert_eq!(pick(params, &warm, &mut rng).choice.endpoint, EndpointId(0));
}

/// Sends `p` a request to each of `endpoints` every `every` for 10 s
/// until `until`: the traffic its externality's arrival rate counts.
fn traffic(p: &mut Kinference, endpoints: &[u32], every: Duration, until: Duration) {
    let mut rng = SplitMix64::new(7);
    let mut at = until.saturating_sub(Duration::from_secs(10));
    while at < until {
        for &id in endpoints {
            p.pick(&request(), &[cand(id, 240, 0)], at, &mut rng)
                .unwrap();
        }
        at += every;
    }
}

#[test]
fn on_a_busy_fleet_the_prefix_stays_home() {
    let mut p = Kinference::new(LatencyParams::default());
    let mut rng = SplitMix64::new(1);
    // Both endpoints are queued, and requests keep arriving (20 a
    // second each); the cold one is 400 ms less queued (well beyond the
    // 50 ms tolerance), but recomputing the whole prompt there would
    // delay everyone arriving behind it by far more.
    traffic(&mut p, &[0, 1], Duration::from_millis(50), secs(10));
    let cands = [cand(0, 240, 30_000), cand(1, 0, 20_000)];
    let choice = p.pick(&request(), &cands, secs(10), &mut rng).unwrap();
    assert_eq!(choice.endpoint, EndpointId(0));
    assert!(
        matches!(choice.reason, Reason::StayedWarm { fastest, later_ms } if fastest == EndpointId(1) && later_ms > 200.0),
        "{:?}",
        choice.reason
    );
    // Without the externality it is plain TTFT greed.
    let greedy = LatencyParams {
        externality_cap: 0.0,
        ..LatencyParams::default()
    };
    let mut p = Kinference::new(greedy);
    traffic(&mut p, &[0, 1], Duration::from_millis(50), secs(10));
    assert_eq!(
        p.pick(&request(), &cands, secs(10), &mut rng)
            .unwrap()
            .endpoint,
        EndpointId(1)
    );
    // Nor does the queue alone make an engine busy: with nothing
    // arriving behind the work, nobody waits for it.
    let mut p = Kinference::new(LatencyParams::default());
    assert_eq!(
        p.pick(&request(), &cands, secs(10), &mut rng)
            .unwrap()
            .endpoint,
        EndpointId(1)
    );
}

fn externality_of(e: &Explanation, i: usize) -> f64 {
    match e.candidates[i].detail {
        ScoreDetail::Kinference { externality_ms, .. } => externality_ms,
        ref d => panic!("{d:?}"),
    }
}

#[test]
fn the_externality_counts_the_requests_arriving_behind_the_work() {
    let mut rng = SplitMix64::new(1);
    let mut p = Kinference::new(LatencyParams::default());
    let cands = [cand(0, 0, 0), cand(1, 0, 5000), cand(2, 0, 0)];
    // Nothing sent anywhere yet: no charge.
    let e = p
        .propose_explained(&request(), &cands, secs(5), &mut rng)
        .unwrap();
    for i in 0..3 {
        assert!(externality_of(&e, i).abs() < 1e-12);
    }
    // One request to each of 0 and 1, just now: a rate of 1 per 3 s
    // (the memory), and the charge λ·(W + s/2)·s.
    for id in [0, 1] {
        p.pick(&request(), &[cand(id, 240, 0)], secs(5), &mut rng)
            .unwrap();
    }
    let e = p
        .propose_explained(&request(), &cands, secs(5), &mut rng)
        .unwrap();
    let rate = 1.0 / 3000.0;
    for i in 0..2 {
        let pred = &e.candidates[i].prediction;
        let s = pred.scale * pred.prefill_ms;
        let expected = s * rate * (pred.scale * pred.queue_ms + s / 2.0);
        assert!(expected > 0.0);
        let got = externality_of(&e, i);
        assert!(
            (got - expected).abs() < 1e-9 * expected,
            "{i}: {got} vs {expected}"
        );
    }
    // 1 has 200 ms queued: its charge is λ·W·s larger (3.5×).
    assert!(externality_of(&e, 1) > 3.0 * externality_of(&e, 0));
    assert!(externality_of(&e, 2).abs() < 1e-12);
    // The rate fades: 3 s later it is half.
    let later = secs(8);
    let e2 = p
        .propose_explained(&request(), &cands, later, &mut rng)
        .unwrap();
    let ratio = externality_of(&e2, 0) / externality_of(&e, 0);
    assert!((ratio - 0.5).abs() < 1e-6, "{ratio}");
    // A steady stream every 50 ms reads as 20 a second; under a deep
    // queue the multiplier stops at the cap.
    let mut p = Kinference::new(LatencyParams::default());
    traffic(&mut p, &[0], Duration::from_millis(50), secs(10));
    // (The charge and the calibrated own prefill s, alone on `queued`
    // tokens.)
    let mut alone = |queued| {
        let e = p
            .propose_explained(&request(), &[cand(0, 0, queued)], secs(10), &mut rng)
            .unwrap();
        let pred = &e.candidates[0].prediction;
        (externality_of(&e, 0), pred.scale * pred.prefill_ms)
    };
    let (charge, s) = alone(1_000_000);
    let cap = LatencyParams::default().externality_cap;
    assert!((charge - cap * s).abs() < 1e-9 * s);
    let (charge, s) = alone(0);
    let per_ms = 2.0 * charge / (s * s);
    assert!((per_ms * 1e3 - 20.0).abs() < 1.5, "{}", per_ms * 1e3);
}

#[test]
fn the_peers_arrivals_count_like_this_routers_own() {
    // Three replicas each sending 0 a request every 150 ms: one router
    // that sent all of them (every 50 ms) charges what one replica
    // charges with the other two's rate beside its own.
    let mut rng = SplitMix64::new(1);
    let mut one = Kinference::new(LatencyParams::default());
    traffic(&mut one, &[0], Duration::from_millis(50), secs(10));
    let mut replica = Kinference::new(LatencyParams::default());
    traffic(&mut replica, &[0], Duration::from_millis(150), secs(10));
    let queued = cand(0, 0, 4000);
    let charge = |p: &mut Kinference, c: Candidate, rng: &mut SplitMix64| {
        externality_of(
            &p.propose_explained(&request(), &[c], secs(10), rng)
                .unwrap(),
            0,
        )
    };
    let whole = charge(&mut one, queued, &mut rng);
    let blind = charge(&mut replica, queued, &mut rng);
    let peers = Candidate {
        peer_arrival_rate: 2.0 / 150.0,
        ..queued
    };
    let shared = charge(&mut replica, peers, &mut rng);
    assert!(blind < 0.4 * whole, "{blind} vs {whole}");
    assert!((shared - whole).abs() < 0.05 * whole, "{shared} vs {whole}");
    // A garbled rate counts as none.
    for bad in [f64::NAN, -1.0] {
        let c = Candidate {
            peer_arrival_rate: bad,
            ..queued
        };
        assert!((charge(&mut replica, c, &mut rng) - blind).abs() < 1e-9 * blind);
    }
}

#[test]
fn a_groups_next_request_waits_where_its_prefix_is_being_computed() {
    // A 16,000-token prompt (640 ms cold). Engine 0 is computing the
    // group's shared 15,000-token prefix for its first request (the
    // router's record shows it there); engine 1 is idle. Both get a
    // few short, mostly cached requests a second. (The charge this
    // replaced, queue ÷ the mean prefill per decision, read that one
    // long job as a saturated engine and sent the request to 1.)
    let req = Request {
        prompt_tokens: 16_000,
        ..request()
    };
    let mut p = Kinference::new(LatencyParams::default());
    traffic(&mut p, &[0, 1], Duration::from_millis(300), secs(10));
    let cands = [cand(0, 937, 15_000), cand(1, 0, 0)];
    let mut rng = SplitMix64::new(1);
    let e = p
        .propose_explained(&req, &cands, secs(10), &mut rng)
        .unwrap();
    // Recomputing the prefix on the idle engine is as fast for this
    // request, but is the same work twice, and the requests arriving
    // there meanwhile wait behind all of it; on 0 the request adds
    // ~40 ms behind work that is being done anyway.
    assert_eq!(e.choice.endpoint, EndpointId(0), "{e:#?}");
    assert!(externality_of(&e, 1) > 5.0 * externality_of(&e, 0));
}

#[test]
fn calibration_steers_away_from_a_slow_endpoint() {
    let mut p = Kinference::new(LatencyParams::default());
    let mut rng = SplitMix64::new(1);
    let cands = [cand(0, 0, 0), cand(1, 0, 0)];
    let mut now = secs(1);
    for _ in 0..100 {
        now += Duration::from_millis(50);
        let pred = p.predict(&request(), &cands[0], now);
        let slow = Duration::from_secs_f64(pred.model_ms * 3.0 / 1e3);
        p.observe(EndpointId(0), &pred, slow, now);
        let pred = p.predict(&request(), &cands[1], now);
        let ok = Duration::from_secs_f64(pred.model_ms / 1e3);
        p.observe(EndpointId(1), &pred, ok, now);
    }
    for _ in 0..5 {
        now += Duration::from_millis(50);
        assert_eq!(
            p.pick(&request(), &cands, now, &mut rng).unwrap().endpoint,
            EndpointId(1)
        );
    }
    // The endpoint's own fit is relative to the fleet's speed (here the
    // midpoint of the two); what the decision uses is the product.
    assert!(Pick::calibration(&p, EndpointId(0), now).is_some_and(|v| v.scale > 2.0));
    p.remove_endpoint(EndpointId(0));
    assert_eq!(
        p.calibration_state(EndpointId(0)),
        &Calibration::prior(p.params())
    );
    assert_eq!(
        Pick::calibration(&p, EndpointId(0), now).map(|v| v.samples),
        Some(0)
    );
    assert!(Pick::calibration(&p, EndpointId(1), now).is_some_and(|v| v.samples == 100));
}

/// Feeds `rounds` first tokens per endpoint, endpoint `i` answering
/// `truth[i]` times slower than the profile predicts.
fn feed_fleet(p: &mut Kinference, truth: &[f64], rounds: usize, now: &mut Duration) {
    for _ in 0..rounds {
        for (i, t) in truth.iter().enumerate() {
            *now += Duration::from_millis(10);
            let c = cand(i as u32, 0, 0);
            let pred = p.predict(&request(), &c, *now);
            let observed = Duration::from_secs_f64(pred.model_ms * t / 1e3);
            p.observe(EndpointId(i as u32), &pred, observed, *now);
        }
    }
}

/// Finished streams from engines whose steps cost `truth` = (overhead
/// ms, decode ms per sequence, prefill ms per token), round robin over
/// `endpoints`.
fn feed_steps(p: &mut Kinference, truth: [f64; 3], endpoints: u32, n: u32) {
    use crate::rng::unit;
    let mut rng = SplitMix64::new(17);
    for i in 0..n {
        let decoding = 1.0 + unit(&mut rng) * 30.0;
        let prefill_tokens = if i % 2 == 0 {
            0.0
        } else {
            unit(&mut rng) * 6000.0
        };
        let millis = 100.0 * (truth[0] + truth[1] * decoding) + truth[2] * prefill_tokens;
        let sample = StepSample {
            tokens: 100,
            millis,
            decoding,
            prefill_tokens,
        };
        p.observe_steps(EndpointId(i % endpoints), &sample);
    }
}

#[test]
fn a_full_cache_costs_the_time_the_streams_take_to_decode() {
    // An engine whose running sequences hold 95 % of a 1,000-block
    // cache: a cold 4,000-token prompt (250 blocks) projects it past
    // full, which costs twice the delay at a full cache.
    let full = |p: &Kinference| {
        let c = Candidate {
            engine: Some(crate::input::EngineMetrics {
                running: 0,
                waiting: 0,
                kv_usage: 0.95,
                age: Duration::ZERO,
                own_requests: 0,
                own_prefilling: 0,
            }),
            room: KvRoom {
                capacity_blocks: 1000,
                used_blocks: 0,
            },
            ..cand(0, 0, 0)
        };
        p.predict(&request(), &c, Duration::ZERO).kv_pressure_ms
    };
    let mut p = Kinference::new(LatencyParams::default());
    let stream = |millis| StepSample {
        tokens: 100,
        millis,
        decoding: 4.0,
        prefill_tokens: 0.0,
    };
    assert!((full(&p) - 2.0 * p.params().kv_full_penalty_millis).abs() < 1e-9);
    // Short streams say nothing; seven are not enough.
    p.observe_steps(
        EndpointId(0),
        &StepSample {
            tokens: 2,
            ..stream(50.0)
        },
    );
    for _ in 0..7 {
        p.observe_steps(EndpointId(0), &stream(1500.0));
    }
    assert!((full(&p) - 2.0 * p.params().kv_full_penalty_millis).abs() < 1e-9);
    assert_eq!(
        p.calibration(EndpointId(0), Duration::ZERO)
            .and_then(|v| v.kv_turnover_ms),
        None
    );
    p.observe_steps(EndpointId(1), &stream(1500.0));
    assert!((full(&p) - 3000.0).abs() < 1e-6, "{}", full(&p));
    let shown = p
        .calibration(EndpointId(0), Duration::ZERO)
        .and_then(|v| v.kv_turnover_ms);
    assert!(
        shown.is_some_and(|t| (t - 1500.0).abs() < 1e-6),
        "{shown:?}"
    );
    // It follows the streams as they change.
    for _ in 0..400 {
        p.observe_steps(EndpointId(1), &stream(600.0));
    }
    assert!((full(&p) - 1200.0).abs() < 12.0, "{}", full(&p));
    // Without calibration nothing is learnt.
    let mut off = Kinference::new(LatencyParams {
        calibrate: false,
        ..LatencyParams::default()
    });
    for _ in 0..20 {
        off.observe_steps(EndpointId(0), &stream(1500.0));
    }
    assert!((full(&off) - 2.0 * off.params().kv_full_penalty_millis).abs() < 1e-9);
}

#[test]
fn streams_teach_the_step_costs_and_calibration_starts_again_once() {
    // Engines 21× slower to prefill than the built-in profile, whose
    // first tokens the fleet's scale and the endpoints' fits absorbed.
    let mut p = Kinference::new(LatencyParams::default());
    let mut now = Duration::ZERO;
    feed_fleet(&mut p, &[8.0; 4], 10, &mut now);
    assert!(p.fleet_scale() > 2.0);
    assert!(p.calibration_state(EndpointId(0)).samples() > 0);
    feed_steps(&mut p, [5.0, 0.65, 0.86], 4, 40);
    let m = *p.params();
    assert!(
        (m.prefill_tokens_per_second / (1e3 / 0.86) - 1.0).abs() < 0.1,
        "{m:?}"
    );
    assert!((m.decode_cost_millis / 0.65 - 1.0).abs() < 0.1, "{m:?}");
    assert!((m.step_overhead_millis / 5.0 - 1.0).abs() < 0.1, "{m:?}");
    assert!(p.step_costs().in_use);
    // What calibration had learnt was the profile's error: gone.
    assert_eq!(p.calibration_state(EndpointId(0)).samples(), 0);
    assert!((p.fleet_scale() - 1.0).abs() < 1e-12);
    let view = p.calibration(EndpointId(0), now).unwrap();
    assert_eq!(view.steps, Some(p.step_costs()));
    // Later streams move the costs, not calibration.
    feed_fleet(&mut p, &[1.0; 4], 3, &mut now);
    feed_steps(&mut p, [5.0, 0.65, 0.86], 4, 20);
    assert_eq!(p.calibration_state(EndpointId(0)).samples(), 3);
}

#[test]
fn a_peers_step_costs_are_used_at_once() {
    let mut peer = Kinference::new(LatencyParams::default());
    assert_eq!(peer.step_fit(), None, "nothing learnt: nothing to give");
    feed_steps(&mut peer, [5.0, 0.65, 0.86], 4, 40);
    let fit = peer.step_fit().expect("in use");

    // A replica that starts, having seen first tokens of the built-in
    // profile's error but no stream's end.
    let mut p = Kinference::new(LatencyParams::default());
    let mut now = Duration::ZERO;
    feed_fleet(&mut p, &[8.0; 4], 10, &mut now);
    assert!(p.fleet_scale() > 2.0);
    assert!(p.adopt_steps(&fit));
    assert!(p.step_costs().in_use);
    assert!(
        (p.params().prefill_tokens_per_second / peer.params().prefill_tokens_per_second - 1.0)
            .abs()
            < 0.02,
        "{:?} against {:?}",
        p.params(),
        peer.params()
    );
    // As when its own streams pin the costs down: calibration had
    // absorbed the profile's error, and starts again.
    assert_eq!(p.calibration_state(EndpointId(0)).samples(), 0);
    assert!((p.fleet_scale() - 1.0).abs() < 1e-12);
    // Once in use, a peer's costs are not taken again.
    assert!(!p.adopt_steps(&fit));
    // Policies that do not learn step costs neither give nor take.
    let mut rr = crate::policies::Policy::new(PolicyName::RoundRobin, LatencyParams::default());
    assert_eq!(rr.step_fit(), None);
    assert!(!rr.adopt_steps(&fit));
}

#[test]
fn a_probes_floor_outlives_the_fits_starting_again() {
    let mut peer = Kinference::new(LatencyParams::default());
    feed_steps(&mut peer, [5.0, 0.65, 0.86], 4, 40);
    let fit = peer.step_fit().expect("in use");
    // Probed as the built-in profile predicts them: one 10× slower.
    let mut p = Kinference::new(LatencyParams::default());
    let now = secs(1);
    probe_fleet(&mut p, &[20.0, 20.0, 20.0, 200.0], now);
    let before = probe_floor(&p, 3, now);
    assert!(before.is_some_and(|f| f > 8.0), "{before:?}");
    // The costs come in use and every fit starts again: the floor, one
    // engine against another, stands.
    assert!(p.adopt_steps(&fit));
    let after = probe_floor(&p, 3, now);
    assert_eq!(after, before);
    let slow = predicted_slowdown(&p, 3, now) / predicted_slowdown(&p, 0, now);
    assert!((slow / 10.0 - 1.0).abs() < 0.1, "{slow}");
}

#[test]
fn a_profile_near_the_engines_keeps_its_calibration() {
    let profile = LatencyParams {
        step_overhead_millis: 5.0,
        decode_cost_millis: 0.65,
        prefill_tokens_per_second: 1e3 / 0.86,
        ..LatencyParams::default()
    };
    let mut p = Kinference::new(profile);
    let mut now = Duration::ZERO;
    feed_fleet(&mut p, &[1.3; 4], 10, &mut now);
    feed_steps(&mut p, [5.0, 0.65, 1.2], 4, 40);
    assert!(p.step_costs().in_use);
    assert!((p.params().prefill_tokens_per_second / (1e3 / 1.2) - 1.0).abs() < 0.1);
    assert_eq!(p.calibration_state(EndpointId(0)).samples(), 10);
    // Off in the profile: nothing is learnt.
    let mut off = Kinference::new(LatencyParams {
        learn_step_costs: false,
        ..profile
    });
    feed_steps(&mut off, [5.0, 0.65, 1.2], 4, 40);
    assert_eq!(
        *off.params(),
        LatencyParams {
            learn_step_costs: false,
            ..profile
        }
    );
    assert_eq!(off.step_costs().samples, 0);
}

/// How much later than the profile `endpoint`'s prediction is now.
fn predicted_slowdown(p: &Kinference, endpoint: u32, now: Duration) -> f64 {
    let pred = p.predict(&request(), &cand(endpoint, 0, 0), now);
    pred.ttft_ms / pred.model_ms
}

#[test]
fn first_tokens_behind_a_long_queue_barely_move_the_fleet() {
    // Four endpoints 8× slower than the profile on idle engines; then
    // first tokens behind long queues come 3× later still (the queue
    // model's error, not the engines' speed): the fleet's vote stays
    // with the idle ones.
    let mut p = Kinference::new(LatencyParams::default());
    let mut now = secs(1);
    feed_fleet(&mut p, &[8.0; 4], 10, &mut now);
    let before = p.fleet_scale();
    assert!((before / 4.0 - 1.0).abs() < 0.25, "{before}");
    for _ in 0..10 {
        for e in 0..4u32 {
            now += Duration::from_millis(10);
            let busy = cand(e, 0, 200_000);
            let pred = p.predict(&request(), &busy, now);
            assert!(pred.queue_ms > 10.0 * pred.prefill_ms, "{pred:?}");
            let observed = Duration::from_secs_f64(pred.model_ms * 24.0 / 1e3);
            p.observe(EndpointId(e), &pred, observed, now);
        }
    }
    assert!(
        p.fleet_scale() < before * 1.2,
        "{before} -> {}",
        p.fleet_scale()
    );
}

#[test]
fn a_profile_within_twice_the_fleet_leaves_it_to_the_endpoints() {
    let mut p = Kinference::new(LatencyParams::default());
    let mut now = secs(1);
    feed_fleet(&mut p, &[1.8; 4], 30, &mut now);
    assert!((p.fleet_scale() - 1.0).abs() < 1e-9, "{}", p.fleet_scale());
    let s = predicted_slowdown(&p, 0, now);
    assert!((s / 1.8 - 1.0).abs() < 0.15, "{s}");
}

#[test]
fn a_fleet_slower_than_its_profile_is_learnt_beyond_the_scale_bounds() {
    // Twenty times slower than the built-in profile (its scale bounds
    // stop at 4): every endpoint's prediction, and a new endpoint's,
    // follows within a few first tokens each.
    let params = LatencyParams::default();
    assert!(params.calibration.scale_bounds.1 < 20.0);
    let mut p = Kinference::new(params);
    let mut now = secs(1);
    feed_fleet(&mut p, &[20.0; 4], 4, &mut now);
    // The fleet takes what is beyond the endpoints' own 2×.
    assert!(
        (p.fleet_scale() / 10.0 - 1.0).abs() < 0.25,
        "{}",
        p.fleet_scale()
    );
    // A new endpoint starts from the fleet's part.
    let s = predicted_slowdown(&p, 9, now);
    assert!((s / 10.0 - 1.0).abs() < 0.3, "a new endpoint: {s}");
    // The endpoints' fits learn the rest.
    feed_fleet(&mut p, &[20.0; 4], 40, &mut now);
    for e in 0..4 {
        let s = predicted_slowdown(&p, e, now);
        assert!((s / 20.0 - 1.0).abs() < 0.3, "endpoint {e}: {s}");
    }
    // The endpoint's own fit stays inside its bounds: the fleet carries
    // the slowdown.
    let fit = p.calibration_state(EndpointId(0)).view(p.params(), now);
    assert!(fit.scale < params.calibration.scale_bounds.1);
}

/// One speed probe per endpoint, on idle engines `truth[e]` times
/// slower than the profile predicts, in order of their answers.
fn probe_fleet(p: &mut Kinference, truth: &[f64], now: Duration) {
    probe_fleet_with(p, &request(), truth, now);
}

/// [`probe_fleet`] with probes of `probe`'s size.
fn probe_fleet_with(p: &mut Kinference, probe: &Request, truth: &[f64], now: Duration) {
    let mut order: Vec<usize> = (0..truth.len()).collect();
    order.sort_by(|a, b| truth[*a].total_cmp(&truth[*b]));
    for e in order {
        let pred = p.predict(probe, &cand(e as u32, 0, 0), now);
        let observed = Duration::from_secs_f64(pred.model_ms * truth[e] / 1e3);
        p.observe_probe(EndpointId(e as u32), &pred, observed, now);
    }
}

/// The speed probe's floor under endpoint `e` at `now`, if any.
fn probe_floor(p: &Kinference, e: u32, now: Duration) -> Option<f64> {
    p.calibration(EndpointId(e), now).unwrap().speed_probe_floor
}

/// Of a burst of 140 cold prompts onto four endpoints, each choice
/// queueing its prompt there: how many went to endpoint 3.
fn burst_onto_the_fourth(p: &mut Kinference, now: Duration, rng: &mut SplitMix64) -> usize {
    let mut queue = [0u64; 4];
    let mut fourth = 0;
    for _ in 0..140 {
        let cands: Vec<Candidate> = (0..4).map(|e| cand(e, 0, queue[e as usize])).collect();
        let c = p.pick(&request(), &cands, now, rng).unwrap();
        queue[c.endpoint.index()] += 4000;
        fourth += usize::from(c.endpoint == EndpointId(3));
    }
    fourth
}

#[test]
fn a_probe_shows_an_engine_ten_times_slower_before_any_request() {
    let mut p = Kinference::new(LatencyParams::default());
    let now = secs(1);
    probe_fleet(&mut p, &[1.0, 1.05, 0.95, 10.0], now);
    // The slow one is predicted as it answered; the others as before.
    let s = predicted_slowdown(&p, 3, now);
    assert!((s / 10.0 - 1.0).abs() < 0.1, "slow: {s}");
    for e in 0..3 {
        let s = predicted_slowdown(&p, e, now);
        assert!((s - 1.0).abs() < 0.2, "endpoint {e}: {s}");
    }
    let view = p.calibration(EndpointId(3), now).unwrap();
    assert!(view.speed_probe_floor.is_some_and(|f| f > 8.0), "{view:?}");
    assert!(view.scale > 8.0, "{view:?}");
    assert_eq!(probe_floor(&p, 0, now), None);
    // So a burst of cold prompts goes to the slow engine only once the
    // others' queues are about ten prompts deep.
    let mut rng = SplitMix64::new(1);
    let slow = burst_onto_the_fourth(&mut p, now, &mut rng);
    assert!(slow <= 7, "the slow engine took {slow} of 140");
    // Without the probes it takes its quarter.
    let mut q = Kinference::new(LatencyParams::default());
    let slow = burst_onto_the_fourth(&mut q, now, &mut rng);
    assert!(slow >= 30, "blind, the slow engine took {slow} of 140");
}

#[test]
fn a_probe_within_its_dead_zone_sets_no_floor_and_a_floor_fades() {
    let params = LatencyParams::default();
    let mut p = Kinference::new(params);
    let now = secs(1);
    // 1.3× slower than the others: probe noise, left to calibration.
    probe_fleet(&mut p, &[1.0, 1.0, 1.0, 1.3], now);
    assert_eq!(probe_floor(&p, 3, now), None);
    assert!(predicted_slowdown(&p, 3, now) < 1.3);
    // 3× slower: within the fit's scale bounds (4×), left to its first
    // tokens.
    let mut p = Kinference::new(params);
    probe_fleet(&mut p, &[1.0, 1.0, 1.0, 3.0], now);
    assert_eq!(probe_floor(&p, 3, now), None);
    // 6× slower: a floor, whole while a fit would stay fresh, then
    // fading as a stale fit does.
    let mut p = Kinference::new(params);
    probe_fleet(&mut p, &[1.0, 1.0, 1.0, 6.0], now);
    let held = now + params.calibration.stale_after;
    let whole = predicted_slowdown(&p, 3, held);
    assert!((whole / 6.0 - 1.0).abs() < 0.1, "{whole}");
    let half = held + params.calibration.stale_half_life;
    let faded = predicted_slowdown(&p, 3, half);
    assert!(
        (faded / 3.5 - 1.0).abs() < 0.15,
        "after one half-life: {faded}"
    );
    assert!(predicted_slowdown(&p, 3, half * 20) < 1.5);
}

#[test]
fn a_probe_late_by_less_than_the_overdue_slack_sets_no_floor() {
    // A short probe on fast engines (about 15 ms of load by the
    // profile): one 5× slower is late by about 75 ms, less than the
    // slack (100 ms) a healthy engine's first token may carry. Noise,
    // not a speed.
    let params = LatencyParams::default();
    let short = Request {
        prompt_tokens: 200,
        ..request()
    };
    let mut p = Kinference::new(params);
    let now = secs(1);
    for (e, truth) in [(0u32, 1.0), (1, 1.0), (2, 5.0)] {
        let pred = p.predict(&short, &cand(e, 0, 0), now);
        let observed = Duration::from_secs_f64(pred.model_ms * truth / 1e3);
        p.observe_probe(EndpointId(e), &pred, observed, now);
    }
    assert!(params.overdue_slack_millis >= 100.0);
    assert_eq!(probe_floor(&p, 2, now), None);
    // The same ratio on a probe ten times longer is a speed.
    let long = Request {
        prompt_tokens: 4000,
        ..request()
    };
    let mut p = Kinference::new(params);
    probe_fleet_with(&mut p, &long, &[1.0, 1.0, 5.0], now);
    let floor = probe_floor(&p, 2, now);
    assert!(
        floor.is_some_and(|f| (f / 5.0 - 1.0).abs() < 0.1),
        "{floor:?}"
    );
}

#[test]
fn probes_on_a_fleet_the_profile_mispredicts_leave_the_common_part_to_the_fleet() {
    // Every engine 20× slower than the profile, one 200×: no floor for
    // the 20× ones and the fleet's speed untouched (first tokens teach
    // both), the slow one 10× slower than the others.
    let mut p = Kinference::new(LatencyParams::default());
    let now = secs(1);
    probe_fleet(&mut p, &[20.0, 20.0, 20.0, 200.0], now);
    assert!((p.fleet_scale() - 1.0).abs() < 1e-9, "{}", p.fleet_scale());
    let fast: Vec<f64> = (0..3).map(|e| predicted_slowdown(&p, e, now)).collect();
    for (e, s) in fast.iter().enumerate() {
        assert!((s - 1.0).abs() < 1e-9, "endpoint {e}: {s}");
        let view = p.calibration(EndpointId(e as u32), now).unwrap();
        assert_eq!(view.speed_probe_floor, None);
        assert_eq!(view.samples, 0, "a probe is no first token");
    }
    let s = predicted_slowdown(&p, 3, now);
    assert!((s / 10.0 - 1.0).abs() < 0.1, "slow: {s} against {fast:?}");
    // A fleet 1.6× slower than its profile (inside the fleet's dead
    // zone), one engine 10× slower still: a floor only for that one.
    let mut p = Kinference::new(LatencyParams::default());
    probe_fleet(&mut p, &[1.6, 1.55, 1.65, 16.0], now);
    for e in 0..3 {
        assert_eq!(probe_floor(&p, e, now), None);
    }
    let floor = probe_floor(&p, 3, now);
    assert!(
        floor.is_some_and(|f| (f / 10.3 - 1.0).abs() < 0.1),
        "{floor:?}"
    );
}

#[test]
fn other_policies_ignore_a_probe() {
    let mut p = crate::policies::Policy::new(PolicyName::RoundRobin, LatencyParams::default());
    let pred = p
        .propose(
            &request(),
            &[cand(0, 0, 0)],
            secs(1),
            &mut SplitMix64::new(1),
        )
        .unwrap()
        .prediction;
    assert_eq!(
        p.observe_probe(EndpointId(0), &pred, Duration::from_secs(1), secs(1)),
        ObserveOutcome::Disabled
    );
}

#[test]
fn a_large_fleet_takes_its_median_every_few_first_tokens() {
    // 100 endpoints (beyond FLEET_UPDATE_ALWAYS) 10× slower: the
    // median is taken every 16th first token, and still follows.
    let mut p = Kinference::new(LatencyParams::default());
    let mut now = secs(1);
    let truth = vec![10.0; 100];
    feed_fleet(&mut p, &truth, 1, &mut now);
    assert!(
        (p.fleet_scale() / 5.0 - 1.0).abs() < 0.25,
        "{}",
        p.fleet_scale()
    );
    assert!(p.fleet.pending < FLEET_UPDATE_EVERY);
}

#[test]
fn a_minority_of_slow_endpoints_does_not_move_the_fleet() {
    // Six engines as the profile says, two three times slower: the
    // fleet stays at the profile, the slow two learn their own 3×.
    let mut p = Kinference::new(LatencyParams::default());
    let mut now = secs(1);
    let truth = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 3.0];
    feed_fleet(&mut p, &truth, 60, &mut now);
    assert!((p.fleet_scale() - 1.0).abs() < 0.05, "{}", p.fleet_scale());
    assert!(predicted_slowdown(&p, 0, now) < 1.2);
    assert!(predicted_slowdown(&p, 7, now) > 2.5);
    // Removing the fast ones leaves the slow ones as the fleet: 3×, of
    // which the fleet takes what is beyond 2×.
    for e in 0..6 {
        p.remove_endpoint(EndpointId(e));
    }
    assert!((p.fleet_scale() - 1.5).abs() < 0.15, "{}", p.fleet_scale());
    assert!(predicted_slowdown(&p, 7, now) > 2.5);
}

#[test]
fn an_engine_whose_requests_are_overdue_stops_getting_work_before_any_first_token() {
    use crate::input::Evidence;
    // Three engines with the same queue, no first token seen yet
    // anywhere (calibration at its prior). Engine 0's oldest request has
    // waited 1.2 s against a 300 ms prediction; the others' are on time.
    let mut p = Kinference::new(LatencyParams::default());
    let mut rng = SplitMix64::new(1);
    let mut cands = [cand(0, 0, 8000), cand(1, 0, 8000), cand(2, 0, 8000)];
    for (i, c) in cands.iter_mut().enumerate() {
        c.in_flight.requests = 4;
        c.evidence = Evidence {
            oldest_waiting: Duration::from_millis(if i == 0 { 1200 } else { 250 }),
            oldest_predicted: Duration::from_millis(300),
            refused_age: None,
            ..Evidence::default()
        };
    }
    for t in 0..30 {
        let now = secs(1) + Duration::from_millis(t * 10);
        let choice = p.pick(&request(), &cands, now, &mut rng).unwrap();
        assert_ne!(choice.endpoint, EndpointId(0), "{choice:?}");
    }
    let e = p
        .pick_explained(&request(), &cands, secs(2), &mut rng)
        .unwrap();
    let slow = &e.candidates[0].prediction;
    assert!(slow.scale > 3.0 && slow.evidence_ms > 0.0, "{slow:?}");
    // Once those requests have answered, the evidence is gone: the
    // engine gets its share again (calibration decides from then on).
    cands[0].evidence = Evidence::default();
    let picked: Vec<_> = (0..6)
        .map(|t| {
            p.pick(&request(), &cands, secs(3 + t), &mut rng)
                .unwrap()
                .endpoint
        })
        .collect();
    assert!(picked.contains(&EndpointId(0)), "{picked:?}");
}

#[test]
fn the_silent_factor_applies_only_once_the_profile_fits_the_fleet() {
    use crate::input::Evidence;
    // One engine silent since an idle send, 2.2 s against a 1 s
    // prediction: the lower bound 2.2 − grace ≈ 2.18 ×.
    let params = LatencyParams {
        silent_overdue_factor: 2.0,
        ..LatencyParams::default()
    };
    let mut silent = cand(0, 0, 8000);
    silent.evidence = Evidence {
        oldest_waiting: Duration::from_millis(2200),
        oldest_predicted: Duration::from_secs(1),
        stored_steps: Some(0),
        // One step predicted: the too-few-steps rule (2.18 < 3) stays out.
        oldest_step: Duration::from_secs(1),
        oldest_sent_idle: true,
        ..Evidence::default()
    };
    let bound = (2200.0 - params.stall_grace_millis) / 1000.0;
    let scale = |p: &Kinference, now| {
        p.predict(&request(), &silent, now).scale
            / p.predict(&request(), &cand(0, 0, 8000), now).scale
    };
    let mut now = secs(1);
    // No first token yet: the bound alone.
    let p = Kinference::new(params);
    assert!(!p.profile_fits());
    assert!((scale(&p, now) - bound).abs() < 1e-9, "{}", scale(&p, now));
    // Engines 8× slower than the profile: still the bound alone.
    let mut off = Kinference::new(params);
    feed_fleet(&mut off, &[8.0; 4], 10, &mut now);
    assert!(!off.profile_fits());
    assert!(
        (scale(&off, now) - bound).abs() < 1e-9,
        "{}",
        scale(&off, now)
    );
    // Engines as the profile says: the bound twice.
    let mut fits = Kinference::new(params);
    feed_fleet(&mut fits, &[1.1, 0.9, 1.0, 1.2], 10, &mut now);
    assert!(fits.profile_fits());
    assert!(
        (scale(&fits, now) - 2.0 * bound).abs() < 1e-9,
        "{}",
        scale(&fits, now)
    );
    // One slow engine among them does not move the median.
    let mut one_slow = Kinference::new(params);
    feed_fleet(&mut one_slow, &[1.0, 1.0, 1.0, 10.0], 10, &mut now);
    assert!(one_slow.profile_fits());
}

#[test]
fn explained_pick_is_the_same_decision() {
    let mut a = Kinference::new(LatencyParams::default());
    let cands = [
        cand(0, 10, 100),
        cand(1, 0, 0),
        cand(2, 0, 0),
        cand(3, 250, 90_000),
    ];
    let mut rng_a = SplitMix64::new(9);
    let mut rng_b = rng_a.clone();
    let mut b = a.clone();
    for t in 1..20 {
        let x = a.pick(&request(), &cands, secs(t), &mut rng_a).unwrap();
        let e = b
            .pick_explained(&request(), &cands, secs(t), &mut rng_b)
            .unwrap();
        assert_eq!(x, e.choice);
        assert_eq!(e.candidates.len(), cands.len());
        assert_eq!(e.candidates[x.index].prediction, x.prediction);
    }
}

#[test]
fn explanation_serialises_to_json() {
    let mut p = Kinference::new(LatencyParams::default());
    let mut rng = SplitMix64::new(1);
    let cands = [cand(0, 0, 0), cand(1, 240, 0)];
    let e = p
        .pick_explained(&request(), &cands, secs(1), &mut rng)
        .unwrap();
    let json = serde_json::to_value(&e).unwrap();
    assert_eq!(json["policy"], "kinference");
    assert_eq!(json["choice"]["endpoint"], 1);
    assert_eq!(json["choice"]["reason"]["rule"], "lowest_predicted_ttft");
    assert_eq!(json["candidates"][1]["inputs"]["cached"]["gpu"], 240);
    assert_eq!(json["candidates"][0]["detail"]["policy"], "kinference");
    assert!(
        json["candidates"][0]["prediction"]["ttft_ms"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    let back: Explanation = serde_json::from_value(json).unwrap();
    assert_eq!(back, e);
    let header = e.choice.to_string();
    assert!(header.starts_with("endpoint=1; ttft_ms="), "{header}");
}

#[test]
fn bad_input_is_an_error() {
    let mut p = Kinference::new(LatencyParams::default());
    let mut rng = SplitMix64::new(1);
    assert_eq!(
        p.pick(&request(), &[], secs(1), &mut rng),
        Err(ScoringError::NoCandidates)
    );
    let zero = Request {
        block_tokens: 0,
        ..request()
    };
    assert_eq!(
        p.pick(&zero, &[cand(0, 0, 0)], secs(1), &mut rng),
        Err(ScoringError::ZeroBlockWidth)
    );
    let huge = cand(EndpointId::LIMIT, 0, 0);
    assert_eq!(
        p.pick(&request(), &[huge], secs(1), &mut rng),
        Err(ScoringError::EndpointIdTooLarge(EndpointId(
            EndpointId::LIMIT
        )))
    );
    let pred = p.predict(&request(), &cand(0, 0, 0), secs(1));
    assert_eq!(
        p.observe(
            EndpointId(u32::MAX),
            &pred,
            Duration::from_millis(5),
            secs(1)
        ),
        ObserveOutcome::Ignored
    );
}
