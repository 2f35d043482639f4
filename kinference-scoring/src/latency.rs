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
//! requests beyond the ones it had prefilling there at the scrape, at
//! `unseen_request_tokens` each, and running requests beyond its own at the
//! scrape as decoding sequences, weighted down linearly with the scrape's
//! age. KV usage above `kv_pressure_start` adds up
//! to `kv_full_penalty_millis` at a full cache (up to twice that past it),
//! where the usage is the scraped one plus, when the cache's size is known
//! ([`crate::KvRoom`]), the blocks of the prefill queued there and of the
//! request's own uncached tokens: a cold prompt sent to an engine whose
//! running sequences hold nearly every block waits (vLLM and SGLang hold
//! it, or preempt it, recomputing) until enough of them finish. The
//! kinference policy replaces the penalty, where the size is known, with
//! the time its streams take to decode, once learnt ([`crate::Kinference`]). A LoRA adapter request adds
//! `adapter_load_millis` where its adapter must be loaded into a free slot
//! and `adapter_slot_wait_millis` where every slot holds another adapter
//! with running requests ([`crate::AdapterSlot`]).
//!
//! Cached blocks reduce the request's own uncached tokens at their tier's
//! credit; a fully cached prompt still computes its last token, as vLLM does.
//!
//! Everything after `base` is the *load part* that per-endpoint calibration
//! scales (see [`crate::calibrate`]): `TTFT = offset + scale × load`.
//!
//! Evidence from requests that have not answered yet ([`crate::Evidence`])
//! comes last: the oldest request still waiting there for its first token,
//! older than its prediction by more than `overdue_slack_millis`, raises the
//! scale to `(age − slack) ÷ predicted` (its TTFT is at least its age, a
//! lower bound) and the prediction to at least that age (requests on time
//! change nothing). Before that, the engine's KV events show its steps:
//! while prefill work waits there an engine on time stores blocks every
//! step, so `n` storing steps in the oldest request's wait show steps at
//! least `(age − grace) ÷ ((n + 1) × step)` times slower than predicted
//! for that request, which scales the load part from `stall_min_scale` on,
//! and with no storing step at all since it was sent to an idle engine
//! the oldest request is overdue past `stall_grace_millis` rather than the
//! slack, its bound times `silent_overdue_factor` (the kinference policy:
//! while the profile fits the fleet's speed); a 503 from the engine
//! within `metrics_max_age` adds `refusal_penalty_millis`, fading.
//! Calibration learns from `load_ms` and observed TTFT only, so evidence
//! lasts exactly as long as the requests it comes from wait.
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
use crate::input::{AdapterSlot, CacheSource, CachedBlocks, Candidate, KvRoom, Request};
use crate::profile::{LatencyParams, TierCredits};

/// One candidate's predicted time to first token, with its terms.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Calibrated prediction, milliseconds: `offset_ms + scale × load_ms`,
    /// at least the age of the oldest request still waiting there, plus a
    /// recent refusal's penalty (`evidence_ms`).
    pub ttft_ms: f64,
    /// Uncalibrated prediction: `base_ms + load_ms`.
    pub model_ms: f64,
    /// The profile's `base_millis`.
    pub base_ms: f64,
    /// The part calibration scales: `queue_ms + prefill_ms + step_ms +
    /// kv_pressure_ms + adapter_ms`. Keep it (or the whole prediction) for
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
    /// The LoRA adapter's load or wait for a slot ([`crate::AdapterSlot`]).
    #[serde(default)]
    pub adapter_ms: f64,
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
    /// Calibration scale in effect, times the evidence of requests still
    /// waiting there ([`crate::Evidence`]).
    pub scale: f64,
    /// What the evidence added over the calibrated prediction: the longer
    /// wait of overdue requests and a recent 503's penalty, milliseconds.
    #[serde(default)]
    pub evidence_ms: f64,
}

impl Prediction {
    /// The mean engine step this prediction assumes, calibrated,
    /// milliseconds: `scale × (queue + prefill + step time) ÷ steps` (0
    /// when it has no steps: another policy's choice). What
    /// [`crate::Evidence::oldest_step`] records.
    pub fn mean_step_ms(&self) -> f64 {
        if self.steps == 0 {
            return 0.0;
        }
        self.scale * (self.queue_ms + self.prefill_ms + self.step_ms) / f64::from(self.steps)
    }
}

/// How the evidence of requests still waiting and of refusals changes one
/// candidate's prediction: `TTFT = max(offset + scale × load, floor) +
/// extra`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Adjust {
    /// The calibrated scale before evidence.
    pub calibrated_scale: f64,
    /// The scale after it (at least the calibrated one).
    pub scale: f64,
    /// The oldest waiting request's age, ms: a new request there is not
    /// expected sooner.
    pub floor: f64,
    /// A recent refusal's penalty, ms.
    pub extra: f64,
}

impl Adjust {
    /// The TTFT for a calibrated `offset` and `load`.
    #[inline]
    pub(crate) fn ttft(&self, offset: f64, load: f64) -> f64 {
        max(offset + self.scale * load, self.floor) + self.extra
    }
}

/// Cached blocks after tier credits: each block counts at the best credit of
/// the tiers whose leading run covers it.
#[inline]
pub fn credited_blocks(cached: &CachedBlocks, credits: &TierCredits) -> f64 {
    let CachedBlocks {
        gpu,
        cpu,
        disk,
        storage,
    } = *cached;
    if cpu == 0 && disk == 0 && storage == 0 {
        return f64::from(gpu) * credits.gpu;
    }
    credited_blocks_tiered(cached, credits)
}

fn credited_blocks_tiered(cached: &CachedBlocks, credits: &TierCredits) -> f64 {
    // Sort the (run, credit) pairs by run; the shortest run's blocks count
    // at the best of all credits, each next segment at the best credit of
    // the runs that still cover it.
    let mut t = [
        (cached.gpu, credits.gpu),
        (cached.cpu, credits.cpu),
        (cached.disk, credits.disk),
        (cached.storage, credits.storage),
    ];
    t.sort_unstable_by_key(|(run, _)| *run);
    let mut total = 0.0;
    let mut covered = 0u32;
    for i in 0..t.len() {
        let best = t[i..].iter().map(|(_, c)| *c).fold(0.0, f64::max);
        total += f64::from(t[i].0 - covered) * best;
        covered = t[i].0;
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

/// Per-decision constants of the model: everything that depends on the
/// parameters and the request but not on the candidate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Model {
    prompt: f64,
    inv_prompt: f64,
    block: f64,
    /// Source credit (approximate discount), folded into the tier credits.
    credits: TierCredits,
    /// Credit of a block of the request's session ([`Candidate::session_blocks`]).
    session_credit: f64,
    most_cached: f64,
    ms_per_token: f64,
    budget: f64,
    min_per_step: f64,
    step_overhead: f64,
    decode_cost: f64,
    base: f64,
    max_age_nanos: u64,
    inv_max_age_nanos: f64,
    unseen_tokens: f64,
    kv_start: f64,
    /// `1 ÷ (1 − kv_start)`: the pressure's growth per unit of usage.
    inv_kv_span: f64,
    /// The delay at a full cache whose size is known:
    /// `kv_full_penalty_millis`, or the running sequences' turnover once
    /// learnt ([`Model::with_kv_turnover`]).
    kv_full_sized: f64,
    /// `kv_full_penalty_millis`: the delay at a full cache whose size is
    /// unknown (the usage alone cannot tell whether the prompt fits).
    kv_full_unsized: f64,
    calibrate: bool,
    overdue_slack: f64,
    overdue_max_scale: f64,
    stall_grace: f64,
    stall_min_scale: f64,
    silent_overdue_factor: f64,
    refusal_penalty: f64,
    adapter_load: f64,
    adapter_wait: f64,
}

/// The load terms of one candidate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Terms {
    pub cached: f64,
    pub uncached: f64,
    pub pending: f64,
    pub sharing: f64,
    pub steps: f64,
    pub queue_ms: f64,
    pub prefill_ms: f64,
    pub step_ms: f64,
    pub kv_ms: f64,
    pub adapter_ms: f64,
    pub load_ms: f64,
}

impl Model {
    pub(crate) fn new(params: &LatencyParams, request: &Request) -> Self {
        let source = match request.cache {
            CacheSource::Index => 1.0,
            CacheSource::Approximate => params.approximate_credit,
            CacheSource::None => 0.0,
        };
        let c = params.tier_credits;
        let prompt = f64::from(request.prompt_tokens);
        let budget = f64::from(params.step_token_budget);
        let max_age_nanos = u64::try_from(params.metrics_max_age.as_nanos()).unwrap_or(u64::MAX);
        let start = params.kv_pressure_start;
        Self {
            prompt,
            inv_prompt: if prompt > 0.0 { 1.0 / prompt } else { 0.0 },
            block: f64::from(request.block_tokens),
            credits: TierCredits {
                gpu: c.gpu * source,
                cpu: c.cpu * source,
                disk: c.disk * source,
                storage: c.storage * source,
            },
            session_credit: c.gpu * params.approximate_credit,
            most_cached: f64::from(request.prompt_tokens.saturating_sub(1)),
            ms_per_token: 1e3 / params.prefill_tokens_per_second,
            budget,
            min_per_step: 0.25 * budget,
            step_overhead: params.step_overhead_millis,
            decode_cost: params.decode_cost_millis,
            base: params.base_millis,
            max_age_nanos,
            inv_max_age_nanos: if max_age_nanos > 0 {
                1.0 / max_age_nanos as f64
            } else {
                0.0
            },
            unseen_tokens: f64::from(params.unseen_request_tokens),
            kv_start: start,
            inv_kv_span: if start < 1.0 {
                1.0 / (1.0 - start)
            } else {
                0.0
            },
            kv_full_sized: params.kv_full_penalty_millis,
            kv_full_unsized: params.kv_full_penalty_millis,
            calibrate: params.calibrate,
            overdue_slack: params.overdue_slack_millis,
            overdue_max_scale: params.overdue_max_scale,
            stall_grace: params.stall_grace_millis,
            stall_min_scale: params.stall_min_scale,
            silent_overdue_factor: params.silent_overdue_factor,
            refusal_penalty: params.refusal_penalty_millis,
            adapter_load: params.adapter_load_millis,
            adapter_wait: params.adapter_slot_wait_millis,
        }
    }

    /// The evidence of `candidate`'s requests still waiting and refusals,
    /// on top of calibration's `scale`.
    ///
    /// A request predicted `p` that has waited `a > p + slack` shows the
    /// engine at least `(a − slack) ÷ p` times slower than predicted (its
    /// TTFT is at least `a`: a lower bound, which can only raise the
    /// scale); a new request there is then not expected before `a` either
    /// (requests on time change nothing). Where the engine's KV events are
    /// followed and the oldest request had a block or more to prefill, the
    /// engine having stored blocks in only `n` steps since it was sent
    /// shows its steps at least `(age − grace) ÷ ((n + 1) × step)` times
    /// slower (the step: the mean one predicted for that request; counted
    /// from `stall_min_scale`; no floor: the request need not be late yet);
    /// with `n = 0` and the request sent to an endpoint where this router
    /// had nothing else in flight, it is overdue past `stall_grace_millis`
    /// instead of the slack, and its bound is multiplied by
    /// `silent_overdue_factor` (an estimate, no longer a bound). A
    /// 503 within `metrics_max_age` adds `refusal_penalty_millis`, fading
    /// linearly with its age.
    #[inline]
    pub(crate) fn adjust(&self, candidate: &Candidate, scale: f64) -> Adjust {
        let e = &candidate.evidence;
        let mut out = Adjust {
            calibrated_scale: scale,
            scale,
            floor: 0.0,
            extra: 0.0,
        };
        // The engine's KV events count where they are followed and the
        // oldest request had a block or more to prefill there (its step is
        // known then): every step on time stores at least a block.
        let stored = e
            .stored_steps
            .filter(|_| !e.oldest_step.is_zero() && !e.oldest_waiting.is_zero());
        if !e.oldest_waiting.is_zero() {
            let age = e.oldest_waiting.as_secs_f64() * 1e3;
            let predicted = e.oldest_predicted.as_secs_f64() * 1e3;
            if predicted > 0.0 {
                // Sent to an idle engine and not one step finished since: the
                // engine is late on it past the grace alone, not past the
                // slack that covers a step already under way (the model
                // does not know how far along that is).
                let silent = stored == Some(0) && e.oldest_sent_idle;
                let slack = if silent {
                    self.stall_grace
                } else {
                    self.overdue_slack
                };
                let ratio = (age - slack) / predicted;
                if ratio > 1.0 {
                    // Silent, its first step outlived the whole prediction:
                    // the bound times the factor, an estimate.
                    let ratio = if silent {
                        ratio * self.silent_overdue_factor
                    } else {
                        ratio
                    };
                    out.scale = scale * min(ratio, self.overdue_max_scale);
                    out.floor = age;
                }
            }
        }
        if let Some(stored) = stored {
            // Against the steps predicted for the oldest request when it was
            // sent (later arrivals join later steps), a lower bound on how
            // much slower its steps are than predicted.
            let age = e.oldest_waiting.as_secs_f64() * 1e3;
            let step = e.oldest_step.as_secs_f64() * 1e3;
            let ratio = (age - self.stall_grace) / ((f64::from(stored) + 1.0) * step);
            if ratio >= self.stall_min_scale {
                out.scale = max(out.scale, scale * min(ratio, self.overdue_max_scale));
            }
        }
        if let Some(age) = e.refused_age {
            let age = nanos(age);
            if age < self.max_age_nanos {
                out.extra = self.refusal_penalty * (1.0 - count(age) * self.inv_max_age_nanos);
            }
        }
        out
    }

    // Measured: without it the per-candidate call was not inlined into the
    // policies' loops and cost ~25 % more (benches/pick.rs).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn terms(&self, candidate: &Candidate) -> Terms {
        let (cached, uncached) = self.cache_terms(candidate);
        self.terms_given(candidate, cached, uncached)
    }

    /// [`Model::terms`] with the candidate's [`Model::cache_terms`] already
    /// computed.
    // Measured: see `terms`.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub(crate) fn terms_given(&self, candidate: &Candidate, cached: f64, uncached: f64) -> Terms {
        let own = &candidate.in_flight;
        let own_prefilling = f64::from(own.prefilling());
        let mut pending = count(own.prefill_tokens);
        let mut ahead = own_prefilling;
        let mut decoding = f64::from(own.decoding);
        let mut kv_ms = 0.0;
        if let Some(m) = &candidate.engine {
            let age = m
                .age
                .as_secs()
                .saturating_mul(1_000_000_000)
                .saturating_add(u64::from(m.age.subsec_nanos()));
            if age < self.max_age_nanos {
                let trust = 1.0 - count(age) * self.inv_max_age_nanos;
                let unseen_waiting = max(f64::from(m.waiting) - f64::from(m.own_prefilling), 0.0);
                pending += trust * unseen_waiting * self.unseen_tokens;
                ahead += trust * unseen_waiting;
                let unseen_running = max(f64::from(m.running) - f64::from(m.own_requests), 0.0);
                decoding += trust * unseen_running;
                // NaN usage counts as 0 (`max` returns its second argument).
                let usage = min(max(m.kv_usage, 0.0), 1.0);
                // Where the cache's size is known, the blocks the prefill
                // queued there and this request's own will take count too:
                // a cold prompt needs its blocks free before it starts, and
                // an engine short of them holds it (or preempts it) until
                // running sequences finish.
                let (projected, full) = if candidate.room.capacity_blocks > 0 && self.block > 0.0 {
                    let blocks = self.block * f64::from(candidate.room.capacity_blocks);
                    (usage + (pending + uncached) / blocks, self.kv_full_sized)
                } else {
                    (usage, self.kv_full_unsized)
                };
                let over = projected - self.kv_start;
                if over > 0.0 {
                    kv_ms = trust * full * min(over * self.inv_kv_span, KV_MOST_FULL);
                }
            }
        }
        let sharing = decoding + 0.5 * ahead;
        let per_step = max(self.budget - sharing, self.min_per_step);
        let steps = max(ceil_non_negative((pending + uncached) / per_step), 1.0);
        let queue_ms = pending * self.ms_per_token;
        let prefill_ms = uncached * self.ms_per_token;
        let step_ms = steps * (self.step_overhead + self.decode_cost * sharing);
        let adapter_ms = match candidate.adapter {
            AdapterSlot::Unknown | AdapterSlot::Resident => 0.0,
            AdapterSlot::Free => self.adapter_load,
            AdapterSlot::Full => self.adapter_wait,
        };
        Terms {
            cached,
            uncached,
            pending,
            sharing,
            steps,
            queue_ms,
            prefill_ms,
            step_ms,
            kv_ms,
            adapter_ms,
            load_ms: queue_ms + prefill_ms + step_ms + kv_ms + adapter_ms,
        }
    }

    /// `(cached, uncached)` prompt tokens of a candidate.
    #[inline]
    pub(crate) fn cache_terms(&self, candidate: &Candidate) -> (f64, f64) {
        let mut credited = credited_blocks(&candidate.cached, &self.credits);
        if candidate.session_blocks > 0 {
            credited = max(
                credited,
                f64::from(candidate.session_blocks) * self.session_credit,
            );
        }
        let cached = min(credited * self.block, self.most_cached);
        (cached, max(self.prompt - cached, 1.0))
    }

    /// Cheap lower bounds of [`Model::terms`]' `(load_ms, queue_ms)` and the
    /// exact `prefill_ms`, given the candidate's `uncached` tokens: its own
    /// queued prefill and one step, without scraped figures, extra steps or KV
    /// pressure (all of which only add).
    #[inline]
    pub(crate) fn bounds(&self, candidate: &Candidate, uncached: f64) -> (f64, f64, f64) {
        let own = &candidate.in_flight;
        let sharing = f64::from(own.decoding) + 0.5 * f64::from(own.prefilling());
        let queue_ms = count(own.prefill_tokens) * self.ms_per_token;
        let prefill_ms = uncached * self.ms_per_token;
        let load_ms = queue_ms + prefill_ms + self.step_overhead + self.decode_cost * sharing;
        (load_ms, queue_ms, prefill_ms)
    }

    /// The prefill time, at `scale`, of the cached blocks that writing
    /// `uncached` tokens into a cache standing at `room` would evict
    /// ([`crate::KvRoom::evicted`]), ms.
    #[inline]
    pub(crate) fn evicted_ms(&self, room: KvRoom, uncached: f64, scale: f64) -> f64 {
        // `block` is positive: requests are checked before any decision.
        scale * room.evicted(uncached / self.block) * self.block * self.ms_per_token
    }

    /// The same model with the delay at a full cache of known size set to
    /// `turnover_ms`: the time the running sequences take to finish and
    /// free their blocks (a positive, finite value; others keep the
    /// profile's).
    pub(crate) fn with_kv_turnover(self, turnover_ms: f64) -> Self {
        if turnover_ms > 0.0 && turnover_ms.is_finite() {
            Self {
                kv_full_sized: turnover_ms,
                ..self
            }
        } else {
            self
        }
    }

    /// The same model with `silent_overdue_factor` 1: the silent engine's
    /// lower bound alone.
    pub(crate) fn without_silent_factor(self) -> Self {
        Self {
            silent_overdue_factor: 1.0,
            ..self
        }
    }

    /// Whether calibration applies.
    #[inline]
    pub(crate) fn calibrates(&self) -> bool {
        self.calibrate
    }

    /// The uncalibrated coefficients `(base, 1)`.
    #[inline]
    pub(crate) fn uncalibrated(&self) -> (f64, f64) {
        (self.base, 1.0)
    }

    /// Calibration coefficients `(offset_ms, scale)` in effect.
    #[inline]
    pub(crate) fn coefficients(
        &self,
        params: &LatencyParams,
        calibration: Option<&Calibration>,
        now_nanos: u64,
    ) -> (f64, f64) {
        match calibration {
            Some(c) if self.calibrate => c.effective_at(params, now_nanos),
            _ => (self.base, 1.0),
        }
    }

    /// Warm fraction of a candidate with `cached` tokens.
    #[inline]
    pub(crate) fn warm_fraction(&self, cached: f64) -> f64 {
        cached * self.inv_prompt
    }

    pub(crate) fn prediction(&self, t: &Terms, offset_ms: f64, adjust: &Adjust) -> Prediction {
        let ttft_ms = adjust.ttft(offset_ms, t.load_ms);
        let scale = adjust.scale;
        Prediction {
            ttft_ms,
            evidence_ms: ttft_ms - (offset_ms + adjust.calibrated_scale * t.load_ms),
            model_ms: self.base + t.load_ms,
            base_ms: self.base,
            load_ms: t.load_ms,
            queue_ms: t.queue_ms,
            prefill_ms: t.prefill_ms,
            steps: t.steps.min(f64::from(u32::MAX)) as u32,
            step_ms: t.step_ms,
            kv_pressure_ms: t.kv_ms,
            adapter_ms: t.adapter_ms,
            pending_tokens: t.pending,
            decoding: t.sharing,
            cached_tokens: t.cached,
            uncached_tokens: t.uncached.ceil().min(f64::from(u32::MAX)) as u32,
            warm_fraction: self.warm_fraction(t.cached),
            offset_ms,
            scale,
        }
    }
}

/// Most of the full-cache delay the KV pressure adds: a cache projected
/// past full by as much as the pressure's span again. Beyond, the
/// request waits for about every running sequence to turn over.
const KV_MOST_FULL: f64 = 2.0;

/// A count as `f64`, through `i64` (see [`ceil_non_negative`]); counts past
/// 2^63 saturate.
#[inline]
fn count(v: u64) -> f64 {
    i64::try_from(v).unwrap_or(i64::MAX) as f64
}

/// `a.max(b)` as one instruction: NaN in `a` yields `b`. `f64::max` pays for
/// NaN handling on both sides, which the model's finite inputs never need.
#[inline]
fn max(a: f64, b: f64) -> f64 {
    if a > b { a } else { b }
}

/// `a.min(b)` as one instruction; see [`max`].
#[inline]
fn min(a: f64, b: f64) -> f64 {
    if a < b { a } else { b }
}

/// `x.ceil()` for `0 ≤ x < 2^63` without a libm call (baseline x86-64 has no
/// rounding instruction); NaN gives 0.
#[inline]
fn ceil_non_negative(x: f64) -> f64 {
    // Through i64: baseline x86-64 converts signed integers in one
    // instruction and unsigned ones in about ten.
    let truncated = x as i64 as f64;
    if truncated < x {
        truncated + 1.0
    } else {
        truncated
    }
}

pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Predict `candidate`'s time to first token for `request`.
///
/// `calibration` is the endpoint's state (`None`: the prior); it is applied
/// only when `params.calibrate` is set.
pub fn predict(
    params: &LatencyParams,
    request: &Request,
    candidate: &Candidate,
    calibration: Option<&Calibration>,
    now: Duration,
) -> Prediction {
    let model = Model::new(params, request);
    let terms = model.terms(candidate);
    let (offset, scale) = model.coefficients(params, calibration, nanos(now));
    model.prediction(&terms, offset, &model.adjust(candidate, scale))
}

#[cfg(test)]
mod tests;
