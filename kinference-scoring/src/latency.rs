//! The time-to-first-token model.
//!
//! A continuously batching engine (vLLM V1, SGLang) runs steps. Each step
//! spends one token of its budget (`max_num_batched_tokens`) on every decoding
//! sequence and fills the rest with prefill chunks, oldest request first; it
//! takes about `overhead + prefill tokens ÷ throughput + decode cost ×
//! decoding sequences`. A new request's first token therefore comes after
//!
//! ```text
//! W     = prefill work ahead of it + its own uncached tokens
//! D     = decoding sequences (+ half the requests ahead: they start decoding
//!         while the request waits)
//! steps = ceil(W ÷ max(budget − D, budget / 4))
//! TTFT  = base + W ÷ throughput + steps × (overhead + decode cost × D)
//!         + KV pressure
//! ```
//!
//! The work ahead is the router's own in-flight accounting (uncached prompt
//! tokens whose first token has not arrived). Fresh scraped engine figures
//! add what the router cannot see (requests from other routers): waiting
//! requests beyond its own prefilling ones, at `unseen_request_tokens` each,
//! and running requests beyond its own as decoding sequences, weighted down
//! linearly with the scrape's age. KV usage above `kv_pressure_start` adds up
//! to `kv_full_penalty_millis`.
//!
//! Cached blocks reduce the request's own uncached tokens at their tier's
//! credit; a fully cached prompt still computes its last token, as vLLM does.
//!
//! Everything after `base` is the *load part* that per-endpoint calibration
//! scales (see [`crate::calibrate`]): `TTFT = offset + scale × load`.
//!
//! Monotonicity (checked by proptests): more cached blocks never predict a
//! later first token; more queued prefill tokens, decoding sequences, scraped
//! waiting or running requests, or KV usage never predict an earlier one.
//!
//! Cost: a few dozen floating-point operations, one division and no
//! allocation per candidate.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::calibrate::Calibration;
use crate::input::{CacheSource, CachedBlocks, Candidate, Request};
use crate::profile::{LatencyParams, TierCredits};

/// One candidate's predicted time to first token, with its terms.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Calibrated prediction, milliseconds: `offset_ms + scale × load_ms`.
    pub ttft_ms: f64,
    /// Uncalibrated prediction: `base_ms + load_ms`.
    pub model_ms: f64,
    /// The profile's `base_millis`.
    pub base_ms: f64,
    /// The part calibration scales: `queue_ms + prefill_ms + step_ms +
    /// kv_pressure_ms`. Keep it (or the whole prediction) for
    /// [`crate::Pick::observe`].
    pub load_ms: f64,
    /// Prefill work ahead of the request ÷ throughput.
    pub queue_ms: f64,
    /// The request's own uncached tokens ÷ throughput.
    pub prefill_ms: f64,
    /// Engine steps until the first token.
    pub steps: u32,
    /// `steps × (step overhead + decode cost × decoding)`.
    pub step_ms: f64,
    /// KV-cache pressure.
    pub kv_pressure_ms: f64,
    /// Prefill tokens ahead of the request (own accounting plus unseen work).
    pub pending_tokens: f64,
    /// Decoding sequences sharing each step (effective).
    pub decoding: f64,
    /// Prompt tokens counted as cached, after tier credits.
    pub cached_tokens: f64,
    /// Prompt tokens to prefill here, rounded up: what the router adds to the
    /// endpoint's `InFlight::prefill_tokens` when it sends the request.
    pub uncached_tokens: u32,
    /// `cached_tokens ÷ prompt tokens`, 0..1.
    pub warm_fraction: f64,
    /// Calibration offset in effect, milliseconds.
    pub offset_ms: f64,
    /// Calibration scale in effect.
    pub scale: f64,
}

/// Cached blocks after tier credits: each block counts at the best credit of
/// the tiers whose leading run covers it.
pub fn credited_blocks(cached: &CachedBlocks, credits: &TierCredits) -> f64 {
    let CachedBlocks { gpu, cpu, disk } = *cached;
    if cpu == 0 && disk == 0 {
        return f64::from(gpu) * credits.gpu;
    }
    let runs = [(gpu, credits.gpu), (cpu, credits.cpu), (disk, credits.disk)];
    let mut ends = [gpu, cpu, disk];
    ends.sort_unstable();
    let mut total = 0.0;
    let mut start = 0u32;
    for end in ends {
        if end > start {
            let credit = runs
                .iter()
                .filter(|(run, _)| *run >= end)
                .map(|(_, c)| *c)
                .fold(0.0, f64::max);
            total += f64::from(end - start) * credit;
            start = end;
        }
    }
    total
}

/// Cached blocks after tier credits and the cache source's discount
/// (`approximate_credit` for the prefix record, 0 without a source).
pub fn source_blocks(params: &LatencyParams, request: &Request, cached: &CachedBlocks) -> f64 {
    let source_credit = match request.cache {
        CacheSource::Index => 1.0,
        CacheSource::Approximate => params.approximate_credit,
        CacheSource::None => return 0.0,
    };
    credited_blocks(cached, &params.tier_credits) * source_credit
}

/// Prompt tokens counted as cached: [`source_blocks`] × block width, at most
/// `prompt_tokens − 1` (the last token is always computed).
pub fn cached_tokens(params: &LatencyParams, request: &Request, cached: &CachedBlocks) -> f64 {
    let most = f64::from(request.prompt_tokens.saturating_sub(1));
    (source_blocks(params, request, cached) * f64::from(request.block_tokens)).min(most)
}

/// Predict `candidate`'s time to first token for `request`.
///
/// `calibration` is the endpoint's state (`None`: the prior); it is applied
/// only when `params.calibrate` is set.
#[inline]
pub fn predict(
    params: &LatencyParams,
    request: &Request,
    candidate: &Candidate,
    calibration: Option<&Calibration>,
    now: Duration,
) -> Prediction {
    let prompt = f64::from(request.prompt_tokens);
    let cached = cached_tokens(params, request, &candidate.cached);
    let uncached = (prompt - cached).max(1.0);

    let own = &candidate.in_flight;
    let own_prefilling = f64::from(own.prefilling());
    let mut pending = own.prefill_tokens as f64;
    let mut ahead = own_prefilling;
    let mut decoding = f64::from(own.decoding);
    let mut kv_pressure_ms = 0.0;
    if let Some(m) = &candidate.engine {
        let max_age = params.metrics_max_age.as_secs_f64();
        let age = m.age.as_secs_f64();
        if age < max_age {
            let trust = 1.0 - age / max_age;
            let unseen_waiting = (f64::from(m.waiting) - own_prefilling).max(0.0);
            pending += trust * unseen_waiting * f64::from(params.unseen_request_tokens);
            ahead += trust * unseen_waiting;
            let unseen_running = (f64::from(m.running) - f64::from(own.requests)).max(0.0);
            decoding += trust * unseen_running;
            let usage = if m.kv_usage.is_nan() {
                0.0
            } else {
                m.kv_usage.clamp(0.0, 1.0)
            };
            let start = params.kv_pressure_start;
            if usage > start && start < 1.0 {
                kv_pressure_ms =
                    trust * params.kv_full_penalty_millis * ((usage - start) / (1.0 - start));
            }
        }
    }
    let sharing = decoding + 0.5 * ahead;
    let budget = f64::from(params.step_token_budget);
    let prefill_per_step = (budget - sharing).max(0.25 * budget);
    let work = pending + uncached;
    let steps = (work / prefill_per_step).ceil().max(1.0);
    let ms_per_token = 1e3 / params.prefill_tokens_per_second;
    let queue_ms = pending * ms_per_token;
    let prefill_ms = uncached * ms_per_token;
    let step_ms = steps * (params.step_overhead_millis + params.decode_cost_millis * sharing);
    let load_ms = queue_ms + prefill_ms + step_ms + kv_pressure_ms;

    let (offset_ms, scale) = match calibration {
        Some(c) if params.calibrate => c.effective(params, now),
        _ => (params.base_millis, 1.0),
    };
    Prediction {
        ttft_ms: offset_ms + scale * load_ms,
        model_ms: params.base_millis + load_ms,
        base_ms: params.base_millis,
        load_ms,
        queue_ms,
        prefill_ms,
        steps: steps.min(f64::from(u32::MAX)) as u32,
        step_ms,
        kv_pressure_ms,
        pending_tokens: pending,
        decoding: sharing,
        cached_tokens: cached,
        uncached_tokens: uncached.ceil().min(f64::from(u32::MAX)) as u32,
        warm_fraction: if prompt > 0.0 { cached / prompt } else { 0.0 },
        offset_ms,
        scale,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::{EndpointId, EngineMetrics, InFlight};

    fn req(prompt: u32) -> Request {
        Request {
            prompt_tokens: prompt,
            block_tokens: 16,
            cache: CacheSource::Index,
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
        let want =
            p.base_millis + p.step_overhead_millis + 1000.0 * 1e3 / p.prefill_tokens_per_second;
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
        };
        let cached = CachedBlocks {
            gpu: 2,
            cpu: 5,
            disk: 10,
        };
        // 2 blocks at 1.0, 3 at 0.8, 5 at 0.4.
        let want = 2.0 + 3.0 * 0.8 + 5.0 * 0.4;
        assert!((credited_blocks(&cached, &credits) - want).abs() < 1e-9);
        // A CPU run shorter than the GPU run adds nothing.
        let cached = CachedBlocks {
            gpu: 6,
            cpu: 3,
            disk: 0,
        };
        assert!((credited_blocks(&cached, &credits) - 6.0).abs() < 1e-9);
        // Credits need not be ordered: a better CPU credit wins where it covers.
        let odd = TierCredits {
            gpu: 0.5,
            cpu: 1.0,
            disk: 0.0,
        };
        let cached = CachedBlocks {
            gpu: 4,
            cpu: 2,
            disk: 0,
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
        });
        let fresh = predict(&p, &req(500), &c, None, Duration::ZERO);
        // Three waiting requests beyond our one, four running beyond ours.
        assert!(
            (fresh.pending_tokens - (100.0 + 3.0 * f64::from(p.unseen_request_tokens))).abs()
                < 1e-9
        );
        assert!(fresh.ttft_ms > base.ttft_ms);
        c.engine = Some(EngineMetrics {
            running: 5,
            waiting: 4,
            kv_usage: 0.5,
            age: p.metrics_max_age,
        });
        let stale = predict(&p, &req(500), &c, None, Duration::ZERO);
        assert!((stale.ttft_ms - base.ttft_ms).abs() < 1e-12);
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
}
