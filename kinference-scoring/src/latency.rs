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
mod tests {
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
            (fresh.pending_tokens - (100.0 + 3.0 * f64::from(p.unseen_request_tokens))).abs()
                < 1e-9
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
}
