//! What the policy learns about the whole fleet rather than one endpoint:
//! its speed against the profile, its step costs and how long its streams
//! decode.

use super::Slot;
use crate::profile::LatencyParams;
use crate::steps::StepFit;

/// The weight (in fully loaded first tokens) an endpoint's vote for the
/// fleet's speed remembers: about twenty.
pub(super) const FLEET_MEMORY: f64 = 20.0;

/// An endpoint votes for the fleet's speed once this much weight is behind
/// its vote: one first token whose prediction is mostly the request's own
/// work.
pub(super) const FLEET_MIN_WEIGHT: f64 = 0.5;

/// How far the fleet's speed may stray from the profile's: a profile off by
/// more than 64× in either direction is a wrong profile, not a slow engine.
pub(super) const FLEET_SCALE_BOUNDS: (f64, f64) = (1.0 / 64.0, 64.0);

/// The part of the fleet's slowdown (either way) left to each endpoint's
/// own fit: within it the fit finds the split between fixed and
/// load-dependent time as before (a single fleet factor on the whole
/// prediction puts it all on the scale, which made admission hold a light
/// tenant's requests longer in `tests/overload.rs`); beyond it the fleet
/// takes the rest, which the fit's `scaleBounds` (4×) could not reach.
pub(super) const FLEET_DEAD_ZONE: f64 = 2.0;

/// The fleet's step costs ([`crate::steps`]).
#[derive(Debug, Clone)]
pub(super) struct Steps {
    /// The worker set's profile as configured.
    pub(super) profile: LatencyParams,
    pub(super) fit: StepFit,
    /// Whether `Kinference::params` holds the fit's costs.
    pub(super) in_use: bool,
}

/// The mean time a stream decodes (first token to last) over the fleet's
/// recent streams: about how long an engine's running sequences take to
/// finish and free their KV blocks, which is what a prompt waits for where
/// they hold nearly every block. It replaces the profile's
/// `kv_full_penalty_millis` once [`TURNOVER_MIN_SAMPLES`] streams are in.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Turnover {
    mean_ms: f64,
    samples: u32,
}

/// Streams seen before [`Turnover`] is used.
pub(super) const TURNOVER_MIN_SAMPLES: u32 = 8;
/// [`Turnover`]'s memory: a running mean at first, then exponential over
/// about this many streams.
pub(super) const TURNOVER_MEMORY: u32 = 64;

impl Turnover {
    pub(super) fn observe(&mut self, millis: f64) {
        if !(millis > 0.0 && millis.is_finite()) {
            return;
        }
        self.samples = self.samples.saturating_add(1);
        let k = 1.0 / f64::from(self.samples.min(TURNOVER_MEMORY));
        self.mean_ms += k * (millis - self.mean_ms);
    }

    /// The learnt turnover, once enough streams are in.
    pub(super) fn millis(&self) -> Option<f64> {
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
pub(super) struct FleetScale {
    /// The median, 1 until an endpoint votes.
    pub(super) scale: f64,
    /// Whether some endpoint voted and the median is within
    /// [`FLEET_DEAD_ZONE`]: the profile predicts these engines' speed as it
    /// is, so a prediction outlived is evidence rather than the profile's
    /// error. Only then does `silent_overdue_factor` apply.
    pub(super) fits: bool,
    /// Reusable buffer for the median (and for the endpoints' speeds in
    /// `Kinference::relative_speed`).
    pub(super) votes: Vec<f64>,
    /// Observations since the median was last taken.
    pub(super) pending: u32,
}

/// Up to this many endpoints the fleet's median is taken at every first
/// token; beyond, every [`FLEET_UPDATE_EVERY`]th, so that a large fleet
/// does not add an O(endpoints) pass per request under the policy's lock
/// (a vote moves by a twentieth at most per first token).
pub(super) const FLEET_UPDATE_ALWAYS: usize = 64;
/// See [`FLEET_UPDATE_ALWAYS`].
pub(super) const FLEET_UPDATE_EVERY: u32 = 16;

impl FleetScale {
    pub(super) fn new() -> Self {
        Self {
            scale: 1.0,
            fits: false,
            votes: Vec::new(),
            pending: 0,
        }
    }

    /// One endpoint's vote moved: takes the median again, at once on a
    /// small fleet, every few first tokens on a large one.
    pub(super) fn observed(&mut self, slots: &[Slot]) {
        self.pending += 1;
        if slots.len() <= FLEET_UPDATE_ALWAYS || self.pending >= FLEET_UPDATE_EVERY {
            self.update(slots);
        }
    }

    /// Recomputes the median of the endpoints' votes.
    pub(super) fn update(&mut self, slots: &[Slot]) {
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
