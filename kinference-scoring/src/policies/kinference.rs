//! Ours: lowest predicted time to first token.

use std::time::Duration;

use crate::arrivals::ArrivalRate;
use crate::calibrate::{Calibration, CalibrationView, ObserveOutcome};
use crate::error::ScoringError;
use crate::input::{Candidate, EndpointId, KvRoom, Request};
use crate::latency::{Model, Prediction, nanos};
use crate::pick::{CandidateExplanation, Choice, Explanation, Reason, ScoreDetail, Tie};
use crate::policies::{Pick, PolicyName, check, millis};
use crate::profile::LatencyParams;
use crate::rng::{RandomSource, below};
use crate::steps::{StepCosts, StepFit, StepSample};

mod fleet;

use self::fleet::{
    FLEET_DEAD_ZONE, FLEET_MEMORY, FLEET_SCALE_BOUNDS, FLEET_UPDATE_ALWAYS, FleetScale, Steps,
    Turnover,
};

/// Per-endpoint state. The first five fields are what a decision reads per
/// candidate; the calibration itself is touched only by `observe` and when a
/// fit has gone stale.
#[derive(Debug, Clone, Copy)]
struct Slot {
    /// The calibration's coefficients while fresh.
    offset_ms: f64,
    scale: f64,
    /// Until when (ns) `offset_ms` and `scale` apply as they are.
    fresh_until: u64,
    /// 0 = never; otherwise the decision's time in nanoseconds + 1.
    last_chosen: u64,
    /// Requests this policy sent here recently.
    arrivals: ArrivalRate,
    calibration: Calibration,
    /// Running mean of ln(observed ÷ uncalibrated prediction), weighted by
    /// the share of the prediction that is the request's own work: this
    /// endpoint's vote for the fleet's speed ([`FleetScale`]).
    log_ratio: f64,
    /// The weight behind `log_ratio`.
    ratio_weight: f64,
    /// The speed probe's first token and its prediction's uncalibrated
    /// load part, ms (0: no probe yet): kept so that `probe_floor` can be
    /// taken again as the other endpoints' probes move the fleet's speed.
    probe_ms: f64,
    probe_load_ms: f64,
    /// The lowest scale the probe allows (1: none), and when it was taken
    /// (ns). It holds while a fit would stay fresh, then fades as a stale
    /// fit does ([`Slot::floor_at`]).
    probe_floor: f64,
    probe_at: u64,
}

impl Slot {
    /// Adds one first token to the endpoint's vote for the fleet's speed.
    fn note_ratio(&mut self, params: &LatencyParams, prediction: &Prediction, observed_ms: f64) {
        let load_ms = prediction.load_ms;
        let model_ms = params.base_millis + load_ms;
        if !(load_ms > 0.0 && model_ms.is_finite() && observed_ms > 0.0 && observed_ms.is_finite())
        {
            return;
        }
        // A prediction that is mostly the fixed part, or mostly the queue
        // ahead (whose errors are the model's, not the engine's speed: under
        // overload it over-counts the slowdown twofold), says little about
        // the engine's speed: weigh by the request's own work's share.
        let w = (load_ms - prediction.queue_ms).max(0.0) / model_ms;
        if w <= 0.0 {
            return;
        }
        // A running mean at first (the first observations count in full),
        // then an exponential one that follows a change within a few dozen.
        self.ratio_weight = (self.ratio_weight + w).min(FLEET_MEMORY);
        let x = (observed_ms / model_ms).ln();
        self.log_ratio += (w / self.ratio_weight) * (x - self.log_ratio);
    }

    fn new(params: &LatencyParams) -> Self {
        let mut slot = Self {
            offset_ms: 0.0,
            scale: 1.0,
            fresh_until: 0,
            last_chosen: 0,
            arrivals: ArrivalRate::default(),
            calibration: Calibration::prior(params),
            log_ratio: 0.0,
            ratio_weight: 0.0,
            probe_ms: 0.0,
            probe_load_ms: 0.0,
            probe_floor: 1.0,
            probe_at: 0,
        };
        slot.cache_coefficients(params);
        slot
    }

    fn cache_coefficients(&mut self, params: &LatencyParams) {
        let ((offset_ms, scale), fresh_until) = self.calibration.fresh_coefficients(params);
        self.offset_ms = offset_ms;
        self.scale = scale;
        self.fresh_until = fresh_until;
        if self.probe_floor > 1.0 {
            self.scale = scale.max(self.probe_floor);
            let held = self
                .probe_at
                .saturating_add(nanos(params.calibration.stale_after));
            self.fresh_until = fresh_until.min(held);
        }
    }

    #[inline]
    fn coefficients(&self, params: &LatencyParams, now_nanos: u64) -> (f64, f64) {
        if now_nanos <= self.fresh_until {
            (self.offset_ms, self.scale)
        } else {
            let (offset, scale) = self.calibration.effective_at(params, now_nanos);
            (offset, scale.max(self.floor_at(params, now_nanos)))
        }
    }

    /// The probe's floor at `now`: whole for `stale_after` after the probe,
    /// then fading towards 1 with `stale_half_life` (weight `h / (h + t)`),
    /// as a fit that received no observations fades to the prior: real
    /// first tokens and the evidence of requests still waiting take over.
    fn floor_at(&self, params: &LatencyParams, now_nanos: u64) -> f64 {
        if self.probe_floor <= 1.0 {
            return 1.0;
        }
        let c = &params.calibration;
        let idle = now_nanos.saturating_sub(self.probe_at);
        let held = nanos(c.stale_after);
        if idle <= held {
            return self.probe_floor;
        }
        let half = nanos(c.stale_half_life) as f64;
        let w = half / (half + (idle - held) as f64);
        1.0 + w * (self.probe_floor - 1.0)
    }
}

/// A speed probe's floor under an endpoint's scale is kept only beyond
/// this, and beyond the fit's own upper `scale_bounds` (4× by default):
/// one probe's noise on an engine as fast as the others (a few tens of
/// percent on a real GPU) must not shun it, and within its bounds the fit
/// learns an engine's speed from its first tokens within a few dozen of
/// them. Tried from 1.5×, the floor (which holds whatever the first tokens
/// say) cost the benchmark's tuned rows on fleets with 3× slower engines:
/// agent TTFT p90 824 → 1,090 ms, heterogeneous 234 → 401–543 ms.
pub const PROBE_DEAD_ZONE: f64 = 1.5;

/// The largest floor a speed probe sets: as far as the fleet's speed may
/// stray from the profile's.
const PROBE_FLOOR_MAX: f64 = FLEET_SCALE_BOUNDS.1;

/// First tokens observed at an endpoint before its free KV room counts
/// against the other candidates' evictions: calibration moves its scale by
/// at most one clipped step per observation, so a few are needed before a
/// slower engine shows as slower (on the benchmark's agent trace, a 3×
/// slower engine with few observations was predicted at 1.19× and a cold
/// turn sent there for its room took 4.6 s).
pub const ROOM_NEEDS_SAMPLES: u32 = 8;

/// kinference's policy.
///
/// For each candidate: the calibrated predicted TTFT ([`crate::latency`]) and
/// a score
///
/// ```text
/// score = TTFT − tolerance × warm fraction
///       + s × min(λ × (scale × queue ahead + s ÷ 2), externality_cap)
///       + eviction_weight × scale × prefill of the cached blocks it evicts
/// ```
///
/// with `s = scale × own prefill` and λ the rate this policy has been
/// sending requests to the candidate. The lowest score wins.
///
/// - **Saturation release.** A warm endpoint keeps a request unless it is
///   predicted later than a colder one by more than `tolerance_millis` plus
///   the difference in externality.
/// - **Externality.** Prefill work sent to an engine delays the requests
///   that arrive there before it is done: with arrivals at rate λ behind a
///   queue of W ms, a job of s ms delays about λ·(W + s÷2) of them by s
///   (λ·W is the queue's length, by Little's law). λ is this policy's own
///   sending rate ([`crate::ArrivalRate`]) plus the other router
///   replicas' there ([`Candidate::peer_arrival_rate`]).
///   On an engine nobody sends work to the charge is 0 and the policy is plain
///   TTFT-greedy; on busy ones a cold endpoint must be much faster to be
///   worth recomputing a prefix and evicting other prefixes for it, and a
///   long cold prefill costs in proportion to its square where requests
///   keep arriving. Without it, greedy release replicates prefixes under
///   load until the caches thrash and the fleet collapses
///   (`examples/fleet.rs`, 8 engines at 200 req/s, 2026-12-07: 59 % of
///   prompt tokens cached and an 81 s median TTFT without it, 91 % and
///   0.12 s with it).
///   (The charge was `s × queue ÷ mean prefill` before: one long prefill
///   queued read as a saturated engine, and a request whose group's prefix
///   was being computed there went cold to an idle engine instead, doing
///   the same prefill twice.)
/// - **Eviction.** A prefill needs free KV blocks; where the cache is full
///   ([`crate::KvRoom`]) it evicts cached ones, which later requests may
///   recompute. The charge is recomputing the evicted blocks at this
///   engine's speed, times `eviction_weight`. Where every candidate is full
///   it only favours the warmer (fewer new blocks); where some have room (a
///   slower engine that the TTFT alone would never pick, a new replica),
///   new prefixes go there instead of displacing cached ones, so the fast
///   engines of a mixed fleet stop thrashing. Room counts only where the
///   endpoint's speed has been measured ([`ROOM_NEEDS_SAMPLES`]). Without
///   a known capacity there is no charge.
/// - **Spreading misses.** Candidates within `max(tie_millis, tie_fraction ×
///   best)` of the best score are equals; the least recently chosen of them
///   wins, so cache misses spread over idle endpoints instead of piling onto
///   one; remaining ties go to the seeded RNG.
/// - **A TTFT target** ([`Request::ttft_target`]). When the choice above is
///   predicted to miss the request's target and another candidate is
///   predicted to meet it, the best-scoring candidate among those that meet
///   it wins (with the same rule for equals): the target outranks the
///   cache, the cache still ranks the candidates that meet it. When none
///   meets it, the choice stands (the router's admission then holds the
///   request or answers 429).
///
/// State: one 176-byte slot per endpoint id ever chosen or observed (a dense
/// vector indexed by id) and reusable buffers. A
/// decision is O(candidates) with no allocation once the buffers have grown;
/// candidates whose lower-bound score cannot win skip the full model.
#[derive(Debug, Clone)]
pub struct Kinference {
    /// The model decisions use: the profile, with the step costs learnt
    /// from the fleet's streams once they tell them ([`StepFit`]).
    params: LatencyParams,
    /// The step costs learnt from the fleet's streams (boxed: read only
    /// when a stream ends).
    steps: Box<Steps>,
    fresh: Slot,
    slots: Vec<Slot>,
    scores: Vec<f64>,
    /// Every candidate's predicted TTFT, when the request has a target.
    ttfts: Vec<f64>,
    equals: Vec<(usize, u64)>,
    /// The fleet's speed against the profile ([`FleetScale`]).
    fleet: FleetScale,
    /// How long the fleet's streams decode: the delay at a full cache
    /// (read by every decision, so not in the boxed [`Steps`]).
    turnover: Turnover,
}

impl Kinference {
    /// A policy with no history.
    pub fn new(params: LatencyParams) -> Self {
        Self {
            params,
            steps: Box::new(Steps {
                profile: params,
                fit: StepFit::new(&params),
                in_use: false,
            }),
            fresh: Slot::new(&params),
            slots: Vec::new(),
            scores: Vec::new(),
            ttfts: Vec::new(),
            equals: Vec::new(),
            fleet: FleetScale::new(),
            turnover: Turnover::default(),
        }
    }

    /// The latency model in use: the profile, with the step overhead and
    /// decode cost learnt from the fleet's streams once they tell them.
    pub fn params(&self) -> &LatencyParams {
        &self.params
    }

    /// Predicts with the fitted step costs once they are pinned down. The
    /// first time, if the prefill cost is off the profile's by more than
    /// [`FLEET_DEAD_ZONE`], every endpoint's calibration starts again from
    /// the prior: it was fitted to the profile's costs.
    fn use_step_fit(&mut self) {
        let steps = &mut *self.steps;
        let Some((overhead, decode, prefill)) = steps.fit.model(&steps.profile) else {
            return;
        };
        // Calibration absorbed the profile's error; where that was more
        // than the fleet's dead zone, it now double-counts.
        let off = prefill / steps.profile.prefill_tokens_per_second;
        let first = !steps.in_use && !(1.0 / FLEET_DEAD_ZONE..=FLEET_DEAD_ZONE).contains(&off);
        steps.in_use = true;
        self.params.step_overhead_millis = overhead;
        self.params.decode_cost_millis = decode;
        self.params.prefill_tokens_per_second = prefill;
        if first {
            let params = self.params;
            self.fresh = Slot::new(&params);
            // What was sent where still stands; only the fits start again.
            // So do the speed probes' floors: each is one engine's speed
            // against the fastest, both read with the same costs.
            for slot in &mut self.slots {
                *slot = Slot {
                    last_chosen: slot.last_chosen,
                    arrivals: slot.arrivals,
                    probe_ms: slot.probe_ms,
                    probe_load_ms: slot.probe_load_ms,
                    probe_floor: slot.probe_floor,
                    probe_at: slot.probe_at,
                    ..Slot::new(&params)
                };
                slot.cache_coefficients(&params);
            }
            self.fleet.update(&self.slots);
        }
    }

    /// The fleet's step costs as fitted so far ([`StepFit`]).
    pub fn step_costs(&self) -> StepCosts {
        self.steps.fit.costs(&self.steps.profile)
    }

    /// `endpoint`'s calibration state (the prior if it has none).
    pub fn calibration_state(&self, endpoint: EndpointId) -> &Calibration {
        &self.slot(endpoint).calibration
    }

    /// Predict `candidate`'s TTFT with its calibration, without deciding.
    pub fn predict(&self, request: &Request, candidate: &Candidate, now: Duration) -> Prediction {
        let model = self.model(request);
        let (offset, scale) = self.coefficients(&model, self.slot(candidate.endpoint), nanos(now));
        model.prediction(
            &model.terms(candidate),
            offset,
            &model.adjust(candidate, scale),
        )
    }

    /// The model for one decision, with the streams' turnover as the delay
    /// at a full cache once learnt ([`Turnover`]): `silent_overdue_factor` only while the
    /// fleet's first tokens say the profile fits its engines
    /// ([`FleetScale::fits`]); with a profile that mispredicts them every
    /// engine sent a request while idle looks late until calibration
    /// catches up, and multiplying that moved requests off the engine
    /// holding their conversation.
    fn model(&self, request: &Request) -> Model {
        let mut model = Model::new(&self.params, request);
        if let Some(turnover) = self.turnover.millis() {
            model = model.with_kv_turnover(turnover);
        }
        if self.fleet.fits {
            model
        } else {
            model.without_silent_factor()
        }
    }

    /// Whether the fleet's first tokens say the profile predicts its
    /// engines' speed within [`FLEET_DEAD_ZONE`] (false until one comes).
    pub fn profile_fits(&self) -> bool {
        self.fleet.fits
    }

    fn slot(&self, endpoint: EndpointId) -> &Slot {
        self.slots.get(endpoint.index()).unwrap_or(&self.fresh)
    }

    fn slot_mut(&mut self, endpoint: EndpointId) -> Option<&mut Slot> {
        if endpoint.0 >= EndpointId::LIMIT {
            return None;
        }
        let i = endpoint.index();
        if i >= self.slots.len() {
            self.slots.resize(i + 1, self.fresh);
        }
        self.slots.get_mut(i)
    }

    /// The delay a choice's prefill imposes on requests that arrive behind
    /// it, in calibrated ms: with `s = scale × prefill`,
    /// `s × min(rate × (scale × queue + s ÷ 2), cap)`. Requests arriving at
    /// `rate` (per ms) behind a queue of W ms and a job of s ms: about
    /// rate·(W + s÷2) of them wait s longer. Grows with `queue`, so the
    /// pruning bound stays a bound.
    #[inline]
    fn externality(scale: f64, prefill_ms: f64, queue_ms: f64, rate: f64, cap: f64) -> f64 {
        let s = scale * prefill_ms;
        let multiplier = rate * (scale * queue_ms + 0.5 * s);
        let multiplier = if multiplier < cap { multiplier } else { cap };
        s * multiplier
    }

    /// `candidate`'s KV room as the eviction charge counts it: free room
    /// counts only where the endpoint's speed has been measured
    /// ([`ROOM_NEEDS_SAMPLES`] first tokens, the last within the
    /// calibration's `stale_after`, or a profile that does not calibrate);
    /// elsewhere the cache counts as full, so room alone never draws work
    /// to an engine the router knows little about.
    #[inline]
    fn room(model: &Model, slot: &Slot, candidate: &Candidate, now_nanos: u64) -> KvRoom {
        let room = candidate.room;
        // Measured, and recently: a stale fit decays to the prior, which
        // says nothing of a slower engine.
        let measured =
            slot.calibration.samples() >= ROOM_NEEDS_SAMPLES && now_nanos <= slot.fresh_until;
        if !model.calibrates() || measured {
            room
        } else {
            KvRoom {
                used_blocks: room.used_blocks.max(room.capacity_blocks),
                ..room
            }
        }
    }

    /// `endpoint`'s calibrated scale over the median of the calibrated
    /// endpoints' (1 on a fleet larger than [`FLEET_UPDATE_ALWAYS`], where
    /// the median is not taken per stream).
    fn relative_speed(&mut self, endpoint: EndpointId) -> f64 {
        let own = self.slot(endpoint).scale;
        if self.slot(endpoint).calibration.samples() == 0 || self.slots.len() > FLEET_UPDATE_ALWAYS
        {
            return 1.0;
        }
        let scales = &mut self.fleet.votes;
        scales.clear();
        scales.extend(
            self.slots
                .iter()
                .filter(|s| s.calibration.samples() > 0)
                .map(|s| s.scale),
        );
        let n = scales.len();
        let (_, median, _) = scales.select_nth_unstable_by(n / 2, f64::total_cmp);
        let r = own / *median;
        if r.is_finite() && r > 0.0 { r } else { 1.0 }
    }

    /// The fleet's speed against the profile ([`FleetScale`]).
    pub fn fleet_scale(&self) -> f64 {
        self.fleet.scale
    }

    #[inline]
    fn coefficients(&self, model: &Model, slot: &Slot, now_nanos: u64) -> (f64, f64) {
        if model.calibrates() {
            let (offset, scale) = slot.coefficients(&self.params, now_nanos);
            (offset, scale * self.fleet.scale)
        } else {
            model.uncalibrated()
        }
    }

    fn decide(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
        mut explain: Option<&mut Vec<CandidateExplanation>>,
    ) -> Result<Choice, ScoringError> {
        check(request, candidates)?;
        let model = self.model(request);
        let now_nanos = nanos(now);
        let tolerance = self.params.tolerance_millis;
        let cap = self.params.externality_cap;
        let mut scores = std::mem::take(&mut self.scores);
        scores.clear();
        scores.resize(candidates.len(), 0.0);
        // With a target every candidate's TTFT is needed: no pruning.
        let target_ms = request.ttft_target.map(|t| t.as_secs_f64() * 1e3);
        let mut ttfts = std::mem::take(&mut self.ttfts);
        ttfts.clear();
        if target_ms.is_some() {
            ttfts.resize(candidates.len(), f64::INFINITY);
        }
        let (tie_millis, tie_fraction) = (self.params.tie_millis, self.params.tie_fraction);
        let equals_limit = |best: f64| best + tie_millis.max(tie_fraction * best.max(0.0));
        let mut best = f64::INFINITY;
        let mut limit = f64::INFINITY;
        // The limit with a rounding margin, for comparing lower bounds.
        let mut prune_limit = f64::INFINITY;
        let mut fastest = (0usize, f64::INFINITY);
        // (index, warm fraction, ttft) of the warmest; ties go to the faster.
        let mut warmest = (0usize, f64::NEG_INFINITY, f64::INFINITY);
        let prune = explain.is_none() && target_ms.is_none();
        for (i, (c, out)) in candidates.iter().zip(scores.iter_mut()).enumerate() {
            let slot = self.slots.get(c.endpoint.index()).unwrap_or(&self.fresh);
            // λ: this router's own arrivals there, and its peers'.
            // (A negative or NaN peer rate counts as 0.)
            let rate = slot.arrivals.per_ms(now_nanos) + c.peer_arrival_rate.max(0.0);
            let (offset, scale) = self.coefficients(&model, slot, now_nanos);
            let adjust = model.adjust(c, scale);
            let (cached, uncached) = model.cache_terms(c);
            let warm = model.warm_fraction(cached);
            if prune {
                // Skip the full model for a candidate that cannot be among the
                // equals (its score's lower bound is past the current limit,
                // which only falls), cannot be the fastest, and cannot be the
                // warmest. Its stored score is the bound, also past the limit.
                let (load_bound, queue_bound, prefill_ms) = model.bounds(c, uncached);
                let ttft_bound = adjust.ttft(offset, load_bound);
                let score_bound = ttft_bound - tolerance * warm
                    + Self::externality(adjust.scale, prefill_ms, queue_bound, rate, cap);
                let may_be_warmest =
                    warm > warmest.1 || (warm >= warmest.1 && ttft_bound < warmest.2);
                if !may_be_warmest && ttft_bound >= fastest.1 && score_bound > prune_limit {
                    *out = score_bound;
                    continue;
                }
            }
            let terms = model.terms_given(c, cached, uncached);
            let ttft = adjust.ttft(offset, terms.load_ms);
            let externality =
                Self::externality(adjust.scale, terms.prefill_ms, terms.queue_ms, rate, cap);
            // Not in the pruning bound above: it only adds.
            let eviction = self.params.eviction_weight
                * model.evicted_ms(
                    Self::room(&model, slot, c, now_nanos),
                    uncached,
                    adjust.scale,
                );
            let score = ttft - tolerance * warm + externality + eviction;
            *out = score;
            if let Some(t) = ttfts.get_mut(i) {
                *t = ttft;
            }
            if score < best {
                best = score;
                limit = equals_limit(best);
                prune_limit = limit + 1e-9 * limit.abs().max(1.0);
            }
            if ttft < fastest.1 {
                fastest = (i, ttft);
            }
            if warm > warmest.1 || (warm >= warmest.1 && ttft < warmest.2) {
                warmest = (i, warm, ttft);
            }
            if let Some(out) = explain.as_deref_mut() {
                let since = (slot.last_chosen > 0)
                    .then(|| now_nanos.saturating_sub(slot.last_chosen - 1) as f64 / 1e6);
                out.push(CandidateExplanation {
                    inputs: *c,
                    prediction: model.prediction(&terms, offset, &adjust),
                    score,
                    detail: ScoreDetail::Kinference {
                        warm_bonus_ms: tolerance * warm,
                        externality_ms: externality,
                        eviction_ms: eviction,
                        since_chosen_ms: since,
                    },
                });
            }
        }

        // Equals: least recently chosen first, then the seeded RNG.
        let params = &self.params;
        let mut equals = std::mem::take(&mut self.equals);
        let (mut index, mut tie) = least_recently_chosen(
            &self.slots,
            candidates,
            &scores,
            limit,
            |_| true,
            &mut equals,
            rng,
        );
        // The choice would miss the request's target: the best of those
        // predicted to meet it, if any.
        let mut missed = None;
        if let Some(target) = target_ms
            && ttfts[index] > target
        {
            let meets = |i: usize| ttfts[i] <= target;
            let best_meeting = scores
                .iter()
                .enumerate()
                .filter(|(i, _)| meets(*i))
                .map(|(_, s)| *s)
                .fold(f64::INFINITY, f64::min);
            if best_meeting.is_finite() {
                missed = Some((candidates[index].endpoint, ttfts[index]));
                (index, tie) = least_recently_chosen(
                    &self.slots,
                    candidates,
                    &scores,
                    equals_limit(best_meeting),
                    meets,
                    &mut equals,
                    rng,
                );
            }
        }
        self.equals = equals;
        self.scores = scores;
        self.ttfts = ttfts;

        let chosen = &candidates[index];
        let prediction = if let Some(out) = explain.as_deref() {
            out[index].prediction
        } else {
            let (offset, scale) = self.coefficients(&model, self.slot(chosen.endpoint), now_nanos);
            model.prediction(&model.terms(chosen), offset, &model.adjust(chosen, scale))
        };
        let margin = params
            .tie_millis
            .max(params.tie_fraction * prediction.ttft_ms);
        let reason = if let Some((preferred, preferred_ms)) = missed {
            Reason::MetTarget {
                preferred,
                preferred_ms,
                later_ms: (prediction.ttft_ms - fastest.1).max(0.0),
            }
        } else if prediction.ttft_ms > fastest.1 + margin {
            Reason::StayedWarm {
                fastest: candidates[fastest.0].endpoint,
                later_ms: prediction.ttft_ms - fastest.1,
            }
        } else if warmest.0 != index
            && warmest.1 > prediction.warm_fraction
            && warmest.2 > prediction.ttft_ms + margin
        {
            Reason::SaturationRelease {
                warmest: candidates[warmest.0].endpoint,
                later_ms: warmest.2 - prediction.ttft_ms,
            }
        } else {
            Reason::LowestPredictedTtft
        };
        Ok(Choice {
            endpoint: chosen.endpoint,
            index,
            prediction,
            reason,
            tie,
        })
    }
}

/// Among the candidates `i` with `scores[i] <= limit` and `eligible(i)`,
/// the least recently chosen (a never-chosen endpoint first); ties among
/// those go to `rng`. `equals` is a reusable buffer.
fn least_recently_chosen(
    slots: &[Slot],
    candidates: &[Candidate],
    scores: &[f64],
    limit: f64,
    eligible: impl Fn(usize) -> bool,
    equals: &mut Vec<(usize, u64)>,
    rng: &mut dyn RandomSource,
) -> (usize, Tie) {
    let last_chosen = |c: &Candidate| slots.get(c.endpoint.index()).map_or(0, |s| s.last_chosen);
    equals.clear();
    let mut oldest = u64::MAX;
    let mut oldest_count = 0usize;
    for (i, (c, &s)) in candidates.iter().zip(scores).enumerate() {
        if s <= limit && eligible(i) {
            let t = last_chosen(c);
            equals.push((i, t));
            if t < oldest {
                oldest = t;
                oldest_count = 1;
            } else if t == oldest {
                oldest_count += 1;
            }
        }
    }
    let skip = if oldest_count > 1 {
        below(rng, oldest_count)
    } else {
        0
    };
    let index = equals
        .iter()
        .filter(|&&(_, t)| t == oldest)
        .nth(skip)
        .map_or(0, |&(i, _)| i);
    let equal_count = equals.len() as u32;
    let tie = if oldest_count > 1 {
        Tie::Random {
            among: oldest_count as u32,
        }
    } else if equal_count > 1 {
        Tie::LeastRecentlyChosen { among: equal_count }
    } else {
        Tie::None
    };
    (index, tie)
}

impl Pick for Kinference {
    fn name(&self) -> PolicyName {
        PolicyName::Kinference
    }

    fn propose(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Choice, ScoringError> {
        self.decide(request, candidates, now, rng, None)
    }

    fn propose_explained(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Explanation, ScoringError> {
        let mut out = Vec::with_capacity(candidates.len());
        let choice = self.decide(request, candidates, now, rng, Some(&mut out))?;
        Ok(Explanation {
            policy: PolicyName::Kinference,
            now_ms: millis(now),
            request: *request,
            choice,
            candidates: out,
        })
    }

    /// The request went to `choice`: its endpoint becomes the most recently
    /// chosen, and the request counts in its arrival rate (the externality's
    /// λ).
    fn commit(&mut self, _request: &Request, _chosen: &Candidate, choice: &Choice, now: Duration) {
        if let Some(slot) = self.slot_mut(choice.endpoint) {
            slot.last_chosen = nanos(now).saturating_add(1);
            slot.arrivals.add(nanos(now), 1.0);
        }
    }

    fn observe(
        &mut self,
        endpoint: EndpointId,
        prediction: &Prediction,
        observed: Duration,
        now: Duration,
    ) -> ObserveOutcome {
        let params = self.params;
        let Some(slot) = self.slot_mut(endpoint) else {
            return ObserveOutcome::Ignored;
        };
        // The fleet's speed first, this observation included, so that the
        // endpoint's fit (relative to it) does not chase a slowdown the
        // whole fleet shares.
        if params.calibrate {
            slot.note_ratio(&params, prediction, observed.as_secs_f64() * 1e3);
            self.fleet.observed(&self.slots);
        }
        let fleet = self.fleet.scale;
        let slot = &mut self.slots[endpoint.index()];
        let outcome = slot
            .calibration
            .observe(&params, prediction.load_ms * fleet, observed, now);
        slot.cache_coefficients(&params);
        outcome
    }

    /// A speed probe's first token: a floor under the endpoint's scale of
    /// how much slower than the fastest probed endpoint it answered, when
    /// that is beyond [`PROBE_DEAD_ZONE`] and the fit's scale bound, and
    /// later than the fastest's speed says by at least
    /// `overdue_slack_millis`. The floors are taken again at
    /// every probe: on a fleet of equal engines but one 10× slower, that
    /// one's floor is 10 and the others have none. Nothing else: what the
    /// whole fleet shares (a profile that predicts every engine 20× too
    /// fast) is the fleet's speed's and the endpoints' fits' to learn from
    /// first tokens, as without probes (tried as an observation too, the
    /// probe's vote for the fleet's speed, a cold prefill on an idle
    /// engine, misled the built-in profile on the benchmark's bursts:
    /// hit rate 77–81 % against 88–90 %).
    fn observe_probe(
        &mut self,
        endpoint: EndpointId,
        prediction: &Prediction,
        observed: Duration,
        now: Duration,
    ) -> ObserveOutcome {
        if !self.params.calibrate {
            return ObserveOutcome::Disabled;
        }
        let observed_ms = observed.as_secs_f64() * 1e3;
        if !(prediction.load_ms > 0.0
            && prediction.load_ms.is_finite()
            && observed_ms > 0.0
            && observed_ms.is_finite())
        {
            return ObserveOutcome::Ignored;
        }
        let Some(slot) = self.slot_mut(endpoint) else {
            return ObserveOutcome::Ignored;
        };
        slot.probe_ms = observed_ms;
        slot.probe_load_ms = prediction.load_ms;
        slot.probe_at = nanos(now);
        let params = self.params;
        let dead_zone = PROBE_DEAD_ZONE.max(params.calibration.scale_bounds.1);
        // Each probed endpoint's load part as observed, per unit of the
        // model's: the fastest one's is the reference.
        let ratio = |slot: &Slot| {
            let ((offset, _), _) = slot.calibration.fresh_coefficients(&params);
            (slot.probe_ms - offset) / slot.probe_load_ms
        };
        let fastest = self
            .slots
            .iter()
            .filter(|s| s.probe_load_ms > 0.0)
            .map(ratio)
            .filter(|r| *r > 0.0)
            .fold(f64::INFINITY, f64::min);
        for slot in &mut self.slots {
            if slot.probe_load_ms <= 0.0 {
                continue;
            }
            let r = ratio(slot);
            let floor = r / fastest;
            // And later than the fastest's speed says by more than the
            // scheduling noise a first token may carry on a healthy engine
            // (the overdue slack): on a GPU the probe takes tens of
            // milliseconds, where one hiccup is a large ratio.
            let late_ms = (r - fastest) * slot.probe_load_ms;
            slot.probe_floor = if floor >= dead_zone && late_ms >= params.overdue_slack_millis {
                floor.min(PROBE_FLOOR_MAX)
            } else {
                1.0
            };
            slot.cache_coefficients(&params);
        }
        ObserveOutcome::Updated
    }

    fn calibration(&self, endpoint: EndpointId, now: Duration) -> Option<CalibrationView> {
        let slot = self.slot(endpoint);
        let mut view = slot.calibration.view(&self.params, now);
        let floor = slot.floor_at(&self.params, nanos(now));
        view.speed_probe_floor = (floor > 1.0).then_some(floor);
        view.scale = view.scale.max(floor);
        view.fleet_scale = self.fleet.scale;
        view.profile_fits = self.fleet.fits;
        view.scale *= self.fleet.scale;
        view.steps = Some(self.step_costs());
        view.kv_turnover_ms = self.turnover.millis();
        Some(view)
    }

    /// A finished stream: its steps go to the fleet's step costs, relative
    /// to the endpoint's speed against the fleet's median (a slower
    /// engine's steps are all slower), and once the streams pin the costs
    /// down, decisions predict with them ([`Kinference::use_step_fit`]).
    fn observe_steps(&mut self, endpoint: EndpointId, sample: &StepSample) -> ObserveOutcome {
        if endpoint.0 >= EndpointId::LIMIT {
            return ObserveOutcome::Ignored;
        }
        if self.params.calibrate && sample.tokens >= crate::steps::MIN_TOKENS {
            self.turnover.observe(sample.millis);
        }
        let speed = self.relative_speed(endpoint);
        let sample = StepSample {
            millis: sample.millis / speed,
            ..*sample
        };
        let steps = &mut *self.steps;
        let outcome = steps.fit.observe(&steps.profile, &sample);
        self.use_step_fit();
        outcome
    }

    fn step_fit(&self) -> Option<StepFit> {
        (self.steps.in_use && self.steps.fit.finite()).then_some(self.steps.fit)
    }

    /// A peer's step costs, taken as [`Kinference::observe_steps`] takes
    /// the fit's once it pins them down.
    fn adopt_steps(&mut self, fit: &StepFit) -> bool {
        let steps = &mut *self.steps;
        let taken = steps.fit.adopt(&steps.profile, fit);
        if taken {
            self.use_step_fit();
        }
        taken
    }

    fn remove_endpoint(&mut self, endpoint: EndpointId) {
        let fresh = self.fresh;
        if let Some(slot) = self.slots.get_mut(endpoint.index()) {
            *slot = fresh;
        }
        // Shrink trailing fresh slots so a vanished high id frees its memory.
        while self.slots.last().is_some_and(|s| {
            s.last_chosen == 0
                && s.calibration == fresh.calibration
                && s.ratio_weight == 0.0
                && s.probe_load_ms == 0.0
        }) {
            self.slots.pop();
        }
        self.fleet.update(&self.slots);
    }
}

#[cfg(test)]
mod tests;
