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

/// The weight (in fully loaded first tokens) an endpoint's vote for the
/// fleet's speed remembers: about twenty.
const FLEET_MEMORY: f64 = 20.0;

/// An endpoint votes for the fleet's speed once this much weight is behind
/// its vote: one first token whose prediction is mostly the request's own
/// work.
const FLEET_MIN_WEIGHT: f64 = 0.5;

/// How far the fleet's speed may stray from the profile's: a profile off by
/// more than 64× in either direction is a wrong profile, not a slow engine.
const FLEET_SCALE_BOUNDS: (f64, f64) = (1.0 / 64.0, 64.0);

/// The part of the fleet's slowdown (either way) left to each endpoint's
/// own fit: within it the fit finds the split between fixed and
/// load-dependent time as before (a single fleet factor on the whole
/// prediction puts it all on the scale, which made admission hold a light
/// tenant's requests longer in `tests/overload.rs`); beyond it the fleet
/// takes the rest, which the fit's `scaleBounds` (4×) could not reach.
const FLEET_DEAD_ZONE: f64 = 2.0;

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

/// The fleet's step costs ([`crate::steps`]).
#[derive(Debug, Clone)]
struct Steps {
    /// The worker set's profile as configured.
    profile: LatencyParams,
    fit: StepFit,
    /// Whether `Kinference::params` holds the fit's costs.
    in_use: bool,
}

/// The mean time a stream decodes (first token to last) over the fleet's
/// recent streams: about how long an engine's running sequences take to
/// finish and free their KV blocks, which is what a prompt waits for where
/// they hold nearly every block. It replaces the profile's
/// `kv_full_penalty_millis` once [`TURNOVER_MIN_SAMPLES`] streams are in.
#[derive(Debug, Clone, Copy, Default)]
struct Turnover {
    mean_ms: f64,
    samples: u32,
}

/// Streams seen before [`Turnover`] is used.
const TURNOVER_MIN_SAMPLES: u32 = 8;
/// [`Turnover`]'s memory: a running mean at first, then exponential over
/// about this many streams.
const TURNOVER_MEMORY: u32 = 64;

impl Turnover {
    fn observe(&mut self, millis: f64) {
        if !(millis > 0.0 && millis.is_finite()) {
            return;
        }
        self.samples = self.samples.saturating_add(1);
        let k = 1.0 / f64::from(self.samples.min(TURNOVER_MEMORY));
        self.mean_ms += k * (millis - self.mean_ms);
    }

    /// The learnt turnover, once enough streams are in.
    fn millis(&self) -> Option<f64> {
        (self.samples >= TURNOVER_MIN_SAMPLES).then_some(self.mean_ms)
    }
}

/// The fleet's speed against the profile: the median over endpoints of how
/// much slower than predicted their first tokens came (each endpoint's
/// running mean of ln(observed ÷ predicted)), beyond
/// [`FLEET_DEAD_ZONE`] (a median of 9× gives 4.5×, one of 1.8× gives 1),
/// within [`FLEET_SCALE_BOUNDS`].
///
/// Every endpoint's calibrated scale is relative to it, and an endpoint
/// without observations starts from it. A profile written for other
/// hardware (the built-in one assumes an 8B model on an H100; a 70B model
/// on older GPUs prefills ten to twenty times slower) is then corrected
/// fleet-wide within the first few first tokens, beyond the per-endpoint
/// `scaleBounds`, while each endpoint's fit still learns how it differs
/// from the rest. The median keeps a minority of slow engines from moving
/// it.
#[derive(Debug, Clone)]
struct FleetScale {
    /// The median, 1 until an endpoint votes.
    scale: f64,
    /// Whether some endpoint voted and the median is within
    /// [`FLEET_DEAD_ZONE`]: the profile predicts these engines' speed as it
    /// is, so a prediction outlived is evidence rather than the profile's
    /// error. Only then does `silent_overdue_factor` apply.
    fits: bool,
    /// Reusable buffer for the median (and for the endpoints' speeds in
    /// `Kinference::relative_speed`).
    votes: Vec<f64>,
    /// Observations since the median was last taken.
    pending: u32,
}

/// Up to this many endpoints the fleet's median is taken at every first
/// token; beyond, every [`FLEET_UPDATE_EVERY`]th, so that a large fleet
/// does not add an O(endpoints) pass per request under the policy's lock
/// (a vote moves by a twentieth at most per first token).
const FLEET_UPDATE_ALWAYS: usize = 64;
/// See [`FLEET_UPDATE_ALWAYS`].
const FLEET_UPDATE_EVERY: u32 = 16;

impl FleetScale {
    fn new() -> Self {
        Self {
            scale: 1.0,
            fits: false,
            votes: Vec::new(),
            pending: 0,
        }
    }

    /// One endpoint's vote moved: takes the median again, at once on a
    /// small fleet, every few first tokens on a large one.
    fn observed(&mut self, slots: &[Slot]) {
        self.pending += 1;
        if slots.len() <= FLEET_UPDATE_ALWAYS || self.pending >= FLEET_UPDATE_EVERY {
            self.update(slots);
        }
    }

    /// Recomputes the median of the endpoints' votes.
    fn update(&mut self, slots: &[Slot]) {
        self.pending = 0;
        self.votes.clear();
        self.votes.extend(
            slots
                .iter()
                .filter(|s| s.ratio_weight >= FLEET_MIN_WEIGHT)
                .map(|s| s.log_ratio),
        );
        let n = self.votes.len();
        if n == 0 {
            self.scale = 1.0;
            self.fits = false;
            return;
        }
        let (_, &mut upper, _) = self.votes.select_nth_unstable_by(n / 2, f64::total_cmp);
        let median = if n.is_multiple_of(2) {
            let lower = self.votes[..n / 2]
                .iter()
                .copied()
                .fold(f64::NEG_INFINITY, f64::max);
            0.5 * (lower + upper)
        } else {
            upper
        };
        self.fits = median.abs() <= FLEET_DEAD_ZONE.ln();
        let excess = median.signum() * (median.abs() - FLEET_DEAD_ZONE.ln()).max(0.0);
        self.scale = excess
            .exp()
            .clamp(FLEET_SCALE_BOUNDS.0, FLEET_SCALE_BOUNDS.1);
    }
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
mod tests {
    use super::*;
    use crate::input::{CacheSource, CachedBlocks, InFlight};
    use crate::rng::SplitMix64;

    fn request() -> Request {
        Request {
            prompt_tokens: 4000,
            block_tokens: 16,
            cache: CacheSource::Index,
            ttft_target: None,
        }
    }

    fn cand(id: u32, gpu: u32, prefill_tokens: u64) -> Candidate {
        Candidate {
            endpoint: EndpointId(id),
            cached: CachedBlocks {
                gpu,
                cpu: 0,
                disk: 0,
                storage: 0,
            },
            in_flight: InFlight {
                requests: u32::from(prefill_tokens > 0),
                decoding: 0,
                prefill_tokens,
                context_tokens: prefill_tokens,
            },
            engine: None,
            evidence: crate::input::Evidence::default(),
            adapter: crate::input::AdapterSlot::Unknown,
            room: KvRoom::default(),
            session_blocks: 0,
            peer_arrival_rate: 0.0,
        }
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
}
