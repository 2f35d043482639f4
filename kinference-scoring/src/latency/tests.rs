use super::*;
use crate::input::{EndpointId, EngineMetrics, InFlight};

fn req(prompt: u32) -> Request {
    Request {
        prompt_tokens: prompt,
        block_tokens: 16,
        cache: CacheSource::Index,
        ttft_target: None,
    }
}

fn idle() -> Candidate {
    Candidate {
        endpoint: EndpointId(0),
        ..Candidate::default()
    }
}

#[test]
fn idle_engine_costs_base_one_step_and_the_prompt() {
    let p = LatencyParams::default();
    let pred = predict(&p, &req(1000), &idle(), None, Duration::ZERO);
    let want = p.base_millis + p.step_overhead_millis + 1000.0 * 1e3 / p.prefill_tokens_per_second;
    assert!(
        (pred.ttft_ms - want).abs() < 1e-9,
        "{} vs {want}",
        pred.ttft_ms
    );
    assert_eq!(pred.steps, 1);
    assert_eq!(pred.uncached_tokens, 1000);
    assert!((pred.ttft_ms - pred.model_ms).abs() < 1e-12);
}

#[test]
fn fully_cached_prompt_still_computes_one_token() {
    let p = LatencyParams::default();
    let mut c = idle();
    c.cached.gpu = 1000;
    let pred = predict(&p, &req(160), &c, None, Duration::ZERO);
    assert_eq!(pred.uncached_tokens, 1);
    assert!((pred.cached_tokens - 159.0).abs() < 1e-9);
}

#[test]
fn tiers_count_at_the_best_covering_credit() {
    let credits = TierCredits {
        gpu: 1.0,
        cpu: 0.8,
        disk: 0.4,
        storage: 0.0,
    };
    let cached = CachedBlocks {
        gpu: 2,
        cpu: 5,
        disk: 10,
        storage: 0,
    };
    // 2 blocks at 1.0, 3 at 0.8, 5 at 0.4.
    let want = 2.0 + 3.0 * 0.8 + 5.0 * 0.4;
    assert!((credited_blocks(&cached, &credits) - want).abs() < 1e-9);
    // A CPU run shorter than the GPU run adds nothing.
    let cached = CachedBlocks {
        gpu: 6,
        cpu: 3,
        disk: 0,
        storage: 0,
    };
    assert!((credited_blocks(&cached, &credits) - 6.0).abs() < 1e-9);
    // A storage run past the disk run counts at the storage credit.
    let with_storage = TierCredits {
        storage: 0.2,
        ..credits
    };
    let cached = CachedBlocks {
        gpu: 2,
        cpu: 5,
        disk: 10,
        storage: 20,
    };
    let want = 2.0 + 3.0 * 0.8 + 5.0 * 0.4 + 10.0 * 0.2;
    assert!((credited_blocks(&cached, &with_storage) - want).abs() < 1e-9);
    // Credits need not be ordered: a better CPU credit wins where it covers.
    let odd = TierCredits {
        gpu: 0.5,
        cpu: 1.0,
        disk: 0.0,
        storage: 0.0,
    };
    let cached = CachedBlocks {
        gpu: 4,
        cpu: 2,
        disk: 0,
        storage: 0,
    };
    assert!((credited_blocks(&cached, &odd) - (2.0 + 2.0 * 0.5)).abs() < 1e-9);
}

#[test]
fn queued_prefill_delays_by_its_compute_time() {
    let p = LatencyParams::default();
    let mut busy = idle();
    busy.in_flight = InFlight {
        requests: 2,
        decoding: 0,
        prefill_tokens: 5000,
        context_tokens: 0,
    };
    let a = predict(&p, &req(1000), &idle(), None, Duration::ZERO);
    let b = predict(&p, &req(1000), &busy, None, Duration::ZERO);
    let extra_prefill = 5000.0 * 1e3 / p.prefill_tokens_per_second;
    // 6000 tokens still fit one 8192-token step; the two requests ahead
    // share it as they start decoding.
    assert_eq!(b.steps, 1);
    let want = extra_prefill + p.decode_cost_millis * 1.0;
    assert!((b.ttft_ms - a.ttft_ms - want).abs() < 1e-9);
}

#[test]
fn long_queues_take_several_steps() {
    let p = LatencyParams::default();
    let mut busy = idle();
    busy.in_flight = InFlight {
        requests: 40,
        decoding: 30,
        prefill_tokens: 30_000,
        context_tokens: 0,
    };
    let pred = predict(&p, &req(2000), &busy, None, Duration::ZERO);
    // 32,000 tokens over (8192 − 35) tokens per step.
    assert_eq!(pred.steps, 4);
    assert!((pred.decoding - 35.0).abs() < 1e-9);
}

#[test]
fn fresh_metrics_reveal_unseen_load_and_stale_ones_do_not() {
    let p = LatencyParams::default();
    let mut c = idle();
    c.in_flight = InFlight {
        requests: 1,
        decoding: 0,
        prefill_tokens: 100,
        context_tokens: 0,
    };
    let base = predict(&p, &req(500), &c, None, Duration::ZERO);
    c.engine = Some(EngineMetrics {
        running: 5,
        waiting: 4,
        kv_usage: 0.5,
        age: Duration::ZERO,
        own_requests: 1,
        own_prefilling: 1,
    });
    let fresh = predict(&p, &req(500), &c, None, Duration::ZERO);
    // Three waiting requests beyond our one, four running beyond ours.
    assert!(
        (fresh.pending_tokens - (100.0 + 3.0 * f64::from(p.unseen_request_tokens))).abs() < 1e-9
    );
    assert!(fresh.ttft_ms > base.ttft_ms);
    c.engine = Some(EngineMetrics {
        running: 5,
        waiting: 4,
        kv_usage: 0.5,
        age: p.metrics_max_age,
        own_requests: 1,
        own_prefilling: 1,
    });
    let stale = predict(&p, &req(500), &c, None, Duration::ZERO);
    assert!((stale.ttft_ms - base.ttft_ms).abs() < 1e-12);
}

#[test]
fn our_own_request_seen_waiting_by_a_scrape_is_not_counted_again() {
    // The scrape saw our one request waiting; it has since started
    // decoding. Nothing is waiting there now and no one else sent
    // anything, so nothing is queued ahead.
    let p = LatencyParams::default();
    let mut c = idle();
    c.in_flight = InFlight {
        requests: 1,
        decoding: 1,
        prefill_tokens: 0,
        context_tokens: 700,
    };
    let ours = predict(&p, &req(500), &c, None, Duration::ZERO);
    c.engine = Some(EngineMetrics {
        running: 0,
        waiting: 1,
        kv_usage: 0.1,
        age: Duration::from_millis(300),
        own_requests: 1,
        own_prefilling: 1,
    });
    let scraped = predict(&p, &req(500), &c, None, Duration::ZERO);
    assert!(scraped.pending_tokens.abs() < 1e-12, "{scraped:?}");
    assert!((scraped.ttft_ms - ours.ttft_ms).abs() < 1e-9);
    // Someone else's waiting request (beyond ours at the scrape) counts.
    c.engine = Some(EngineMetrics {
        waiting: 2,
        ..c.engine.unwrap()
    });
    let other = predict(&p, &req(500), &c, None, Duration::ZERO);
    assert!(other.pending_tokens > 0.0 && other.ttft_ms > ours.ttft_ms);
}

#[test]
fn kv_pressure_grows_to_the_full_penalty() {
    let p = LatencyParams::default();
    let mut c = idle();
    let mut at = |usage: f64| {
        c.engine = Some(EngineMetrics {
            running: 0,
            waiting: 0,
            kv_usage: usage,
            age: Duration::ZERO,
            own_requests: 0,
            own_prefilling: 0,
        });
        predict(&p, &req(100), &c, None, Duration::ZERO).kv_pressure_ms
    };
    assert!(at(0.5).abs() < 1e-12);
    assert!((at(0.95) - 0.5 * p.kv_full_penalty_millis).abs() < 1e-9);
    assert!((at(1.0) - p.kv_full_penalty_millis).abs() < 1e-9);
    assert!((at(7.0) - p.kv_full_penalty_millis).abs() < 1e-9);
    assert!(at(f64::NAN).abs() < 1e-12);
}

#[test]
fn kv_pressure_counts_the_blocks_the_prefill_will_take() {
    // A 100-block cache whose running sequences hold 80: a prompt of
    // ten new blocks brings it to 90 % (the start), one of twenty to
    // full, one of forty past it, where the penalty stops at twice.
    let p = LatencyParams::default();
    let full = p.kv_full_penalty_millis;
    let busy = |capacity: u32| Candidate {
        engine: Some(EngineMetrics {
            running: 0,
            waiting: 0,
            kv_usage: 0.8,
            age: Duration::ZERO,
            own_requests: 0,
            own_prefilling: 0,
        }),
        room: KvRoom {
            capacity_blocks: capacity,
            used_blocks: 0,
        },
        ..idle()
    };
    let at = |prompt: u32, cached: u32, pending: u64, capacity: u32| {
        let c = Candidate {
            cached: CachedBlocks {
                gpu: cached,
                ..CachedBlocks::default()
            },
            in_flight: InFlight {
                requests: u32::from(pending > 0),
                prefill_tokens: pending,
                ..InFlight::default()
            },
            ..busy(capacity)
        };
        predict(&p, &req(prompt), &c, None, Duration::ZERO).kv_pressure_ms
    };
    assert!(at(160, 0, 0, 100).abs() < 1e-9);
    assert!((at(320, 0, 0, 100) - full).abs() < 1e-9);
    assert!((at(640, 0, 0, 100) - 2.0 * full).abs() < 1e-9);
    assert!((at(6400, 0, 0, 100) - 2.0 * full).abs() < 1e-9);
    // Cached blocks take none; queued prefill takes its own first.
    assert!(at(320, 19, 0, 100).abs() < 1e-9);
    assert!((at(160, 0, 160, 100) - full).abs() < 1e-9);
    // Without the cache's size, the scraped usage alone (80 %: none).
    assert!(at(640, 0, 160, 0).abs() < 1e-9);
    // A learnt turnover replaces the profile's penalty.
    let model = Model::new(&p, &req(320)).with_kv_turnover(1500.0);
    let c = busy(100);
    assert!((model.terms(&c).kv_ms - 1500.0).abs() < 1e-9);
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let model = Model::new(&p, &req(320)).with_kv_turnover(bad);
        assert!((model.terms(&c).kv_ms - full).abs() < 1e-9, "{bad}");
    }
    // Where the size is unknown the usage alone cannot tell whether the
    // prompt fits: the profile's penalty stays.
    let unsized_full = Candidate {
        engine: Some(EngineMetrics {
            kv_usage: 1.0,
            ..c.engine.unwrap()
        }),
        ..busy(0)
    };
    assert!((model.terms(&unsized_full).kv_ms - full).abs() < 1e-9);
}

#[test]
fn an_adapter_pays_its_load_or_its_wait_for_a_slot() {
    let p = LatencyParams::default();
    let at = |slot: AdapterSlot| {
        let c = Candidate {
            adapter: slot,
            ..idle()
        };
        predict(&p, &req(100), &c, None, Duration::ZERO)
    };
    let base = at(AdapterSlot::Unknown);
    assert!(base.adapter_ms.abs() < 1e-12);
    assert!((at(AdapterSlot::Resident).ttft_ms - base.ttft_ms).abs() < 1e-9);
    let free = at(AdapterSlot::Free);
    assert!((free.adapter_ms - p.adapter_load_millis).abs() < 1e-9);
    assert!((free.ttft_ms - base.ttft_ms - p.adapter_load_millis).abs() < 1e-9);
    let full = at(AdapterSlot::Full);
    assert!((full.adapter_ms - p.adapter_slot_wait_millis).abs() < 1e-9);
    assert!(full.ttft_ms > free.ttft_ms, "{full:?} vs {free:?}");
    // Part of the load calibration scales.
    assert!((full.load_ms - base.load_ms - p.adapter_slot_wait_millis).abs() < 1e-9);
}

#[test]
fn approximate_estimates_are_discounted_and_none_means_cold() {
    let p = LatencyParams::default();
    let mut c = idle();
    c.cached.gpu = 10;
    let mut r = req(1000);
    let exact = predict(&p, &r, &c, None, Duration::ZERO).cached_tokens;
    r.cache = CacheSource::Approximate;
    let approx = predict(&p, &r, &c, None, Duration::ZERO).cached_tokens;
    r.cache = CacheSource::None;
    let none = predict(&p, &r, &c, None, Duration::ZERO).cached_tokens;
    assert!((exact - 160.0).abs() < 1e-9);
    assert!((approx - 160.0 * p.approximate_credit).abs() < 1e-9);
    assert!(none.abs() < 1e-12);
}

#[test]
fn requests_still_waiting_past_their_prediction_raise_it() {
    use crate::input::Evidence;
    let p = LatencyParams::default();
    let mut c = idle();
    c.in_flight = InFlight {
        requests: 2,
        decoding: 0,
        prefill_tokens: 1000,
        context_tokens: 1000,
    };
    let base = predict(&p, &req(1000), &c, None, Duration::ZERO);
    assert!(base.evidence_ms.abs() < 1e-12);
    // On time (within the slack): nothing changes.
    c.evidence = Evidence {
        oldest_waiting: Duration::from_millis(150),
        oldest_predicted: Duration::from_millis(100),
        refused_age: None,
        ..Evidence::default()
    };
    let on_time = predict(&p, &req(1000), &c, None, Duration::ZERO);
    assert!((on_time.ttft_ms - base.ttft_ms).abs() < 1e-9, "{on_time:?}");
    // 1.1 s old, predicted 100 ms: at least (1100 − 100) ÷ 100 = 10×
    // slower than predicted, and no sooner than 1.1 s.
    c.evidence.oldest_waiting = Duration::from_millis(1100);
    let overdue = predict(&p, &req(1000), &c, None, Duration::ZERO);
    assert!((overdue.scale - 10.0).abs() < 1e-9, "{overdue:?}");
    let want = (base.offset_ms + 10.0 * base.load_ms).max(1100.0);
    assert!((overdue.ttft_ms - want).abs() < 1e-9, "{overdue:?}");
    assert!((overdue.evidence_ms - (overdue.ttft_ms - base.ttft_ms)).abs() < 1e-9);
    // The load part (what calibration learns from) is untouched.
    assert!((overdue.load_ms - base.load_ms).abs() < 1e-12);
    // Older still: monotone, up to the cap.
    c.evidence.oldest_waiting = Duration::from_secs(3600);
    let stuck = predict(&p, &req(1000), &c, None, Duration::ZERO);
    assert!((stuck.scale - p.overdue_max_scale).abs() < 1e-9);
    assert!(stuck.ttft_ms >= 3_600_000.0);
}

#[test]
fn an_engine_silent_in_its_kv_events_looks_slow_before_any_request_is_late() {
    use crate::input::Evidence;
    let p = LatencyParams::default();
    let mut c = idle();
    c.in_flight.requests = 4;
    c.in_flight.prefill_tokens = 4 * 2000;
    let base = predict(&p, &req(1000), &c, None, Duration::ZERO);
    let ms = |m: f64| Duration::from_secs_f64(m / 1e3);
    // The oldest request was predicted 20 steps of 50 ms: it waits well
    // within its prediction throughout.
    let step = 50.0;
    let at = |c: &mut Candidate, age: f64, stored: Option<u32>| {
        c.evidence = Evidence {
            oldest_waiting: ms(age),
            oldest_predicted: ms(20.0 * step),
            stored_steps: stored,
            oldest_step: ms(step),
            ..Evidence::default()
        };
        predict(&p, &req(1000), c, None, Duration::ZERO)
    };
    // Events not followed: silence means nothing.
    assert!((at(&mut c, 10.0 * step, None).scale - base.scale).abs() < 1e-12);
    // Followed, and a storing step per predicted step: on time.
    assert!((at(&mut c, 10.0 * step, Some(9)).scale - base.scale).abs() < 1e-12);
    // Silent for under three steps past the grace: still nothing.
    let short = p.stall_grace_millis + 2.5 * step;
    assert!((at(&mut c, short, Some(0)).scale - base.scale).abs() < 1e-12);
    // Silent for ten: at least ten times slower (no floor: the request
    // is not late yet, so the prediction is the scaled load alone).
    let long = p.stall_grace_millis + 10.0 * step;
    let slow = at(&mut c, long, Some(0));
    assert!((slow.scale - 10.0).abs() < 1e-9, "{slow:?}");
    let want = base.offset_ms + 10.0 * base.load_ms;
    assert!((slow.ttft_ms - want).abs() < 1e-6, "{slow:?}");
    assert!((slow.load_ms - base.load_ms).abs() < 1e-12);
    // One storing step in that time: half the bound.
    assert!((at(&mut c, long, Some(1)).scale - 5.0).abs() < 1e-9);
    // The step unknown (the oldest request had less than a block to
    // prefill, or another policy sent it): nothing.
    c.evidence.oldest_step = Duration::ZERO;
    let unknown = predict(&p, &req(1000), &c, None, Duration::ZERO);
    assert!((unknown.scale - base.scale).abs() < 1e-12);
}

#[test]
fn with_no_step_stored_since_it_was_sent_to_an_idle_engine_a_request_is_late_past_the_grace() {
    use crate::input::Evidence;
    let p = LatencyParams::default();
    assert!(p.stall_grace_millis < p.overdue_slack_millis);
    let mut c = idle();
    c.in_flight.prefill_tokens = 2000;
    let base = predict(&p, &req(1000), &c, None, Duration::ZERO);
    // Predicted 200 ms in one step; 260 ms old.
    let age = 200.0 + f64::midpoint(p.stall_grace_millis, p.overdue_slack_millis) + 10.0;
    let at = |p: &LatencyParams, age: f64, stored: Option<u32>, idle: bool| {
        let mut c = c;
        c.evidence = Evidence {
            oldest_waiting: Duration::from_secs_f64(age / 1e3),
            oldest_predicted: Duration::from_millis(200),
            stored_steps: stored,
            oldest_step: Duration::from_millis(200),
            oldest_sent_idle: idle,
            ..Evidence::default()
        };
        predict(p, &req(1000), &c, None, Duration::ZERO)
    };
    let with = |stored: Option<u32>, idle: bool| at(&p, age, stored, idle);
    // Within the slack: on time, unless the events show that not one
    // step has ended since it was sent to an idle engine.
    assert!((with(None, true).scale - base.scale).abs() < 1e-12);
    assert!((with(Some(1), true).scale - base.scale).abs() < 1e-12);
    // Sent behind a step already under way, whose end the model does not
    // know: the slack still holds.
    assert!((with(Some(0), false).scale - base.scale).abs() < 1e-12);
    // Not one step since: its first step outlived the whole prediction,
    // past the grace; with factor 1 the bound alone.
    let p1 = LatencyParams {
        silent_overdue_factor: 1.0,
        ..p
    };
    let late = at(&p1, age, Some(0), true);
    let bound = (age - p.stall_grace_millis) / 200.0;
    assert!((late.scale - bound).abs() < 1e-9, "{late:?}");
    assert!(late.ttft_ms >= age);
    // With the default factor (2), the bound taken twice.
    let p2 = p;
    assert!((p2.silent_overdue_factor - 2.0).abs() < 1e-12);
    let doubled = with(Some(0), true);
    assert!((doubled.scale - 2.0 * bound).abs() < 1e-9, "{doubled:?}");
    // Behind a step under way, late past the slack: the bound alone.
    let behind = at(&p2, age + 100.0, Some(0), false);
    let want = (age + 100.0 - p.overdue_slack_millis) / 200.0;
    assert!((behind.scale - want).abs() < 1e-9, "{behind:?}");
}

#[test]
fn the_mean_step_of_a_prediction_is_its_calibrated_work_per_step() {
    let p = LatencyParams::default();
    let mut c = idle();
    c.in_flight.prefill_tokens = 3 * u64::from(p.step_token_budget);
    let pred = predict(&p, &req(1000), &c, None, Duration::ZERO);
    assert!(pred.steps >= 4, "{pred:?}");
    let want =
        pred.scale * (pred.queue_ms + pred.prefill_ms + pred.step_ms) / f64::from(pred.steps);
    assert!((pred.mean_step_ms() - want).abs() < 1e-9);
    assert!(pred.mean_step_ms() < pred.ttft_ms);
    let none = Prediction { steps: 0, ..pred };
    assert!(none.mean_step_ms().abs() < 1e-12);
}

#[test]
fn a_recent_refusal_adds_a_fading_penalty() {
    use crate::input::Evidence;
    let p = LatencyParams::default();
    let mut c = idle();
    let base = predict(&p, &req(500), &c, None, Duration::ZERO);
    let mut at = |age: Duration| {
        c.evidence = Evidence {
            refused_age: Some(age),
            ..Evidence::default()
        };
        predict(&p, &req(500), &c, None, Duration::ZERO).ttft_ms - base.ttft_ms
    };
    assert!((at(Duration::ZERO) - p.refusal_penalty_millis).abs() < 1e-9);
    assert!((at(p.metrics_max_age / 2) - p.refusal_penalty_millis / 2.0).abs() < 1e-6);
    assert!(at(p.metrics_max_age).abs() < 1e-12);
}

#[test]
fn calibration_applies_only_when_enabled() {
    let mut p = LatencyParams::default();
    let mut cal = Calibration::prior(&p);
    let now = Duration::from_secs(1);
    for i in 0..200 {
        let t = now + Duration::from_millis(i);
        cal.observe(&p, 100.0, Duration::from_millis(300), t);
    }
    let t = now + Duration::from_millis(200);
    let on = predict(&p, &req(1000), &idle(), Some(&cal), t);
    assert!(on.ttft_ms > on.model_ms * 1.5, "{on:?}");
    p.calibrate = false;
    let off = predict(&p, &req(1000), &idle(), Some(&cal), t);
    assert!((off.ttft_ms - off.model_ms).abs() < 1e-12);
}
