//! Online calibration of the latency model, per endpoint.
//!
//! The model's prediction splits into a fixed part (`base_millis`) and a load
//! part `x` (prefill work, engine steps, KV pressure; see
//! [`crate::latency`]). Each endpoint keeps a two-parameter fit
//!
//! ```text
//! observed TTFT ≈ offset + scale · x
//! ```
//!
//! starting from the prior `offset = base_millis, scale = 1`. `offset` absorbs
//! what the model misses per request (network, a slower API server), `scale`
//! absorbs a different prefill speed (another GPU, model or engine version).
//!
//! The fit is recursive least squares on relative residuals
//! (`(observed − predicted) / predicted`), so a 20 ms and a 20 s request weigh
//! alike, with these guarantees:
//!
//! - **Bounded influence.** Residuals beyond `clip_sigmas` robust standard
//!   deviations (from an exponentially weighted mean absolute residual) are
//!   clipped before the update: one outlier moves the fit by at most one
//!   clipped step. A persistent change widens the robust spread within a few
//!   dozen observations and is then learnt in full.
//! - **Bounded state.** `scale` stays within `scale_bounds`, `offset` within
//!   `[0, base + max_extra_offset_millis]`; the covariance never exceeds the
//!   prior's (no wind-up when the load barely varies).
//! - **Forgetting.** Each observation discounts older ones by `forgetting`.
//! - **Staleness.** After `stale_after` without observations the fit decays
//!   to the prior, half-way after `stale_half_life` (weight `h / (h + t)`),
//!   so an endpoint that looked
//!   slow is tried again rather than shunned forever.
//!
//! Cost: O(1) time and 80 bytes per endpoint; no allocation.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::profile::LatencyParams;

/// What an observation did to the fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ObserveOutcome {
    /// The fit moved by the full residual.
    Updated,
    /// The residual was an outlier and was clipped before the update.
    Clipped,
    /// The observation or the prediction was unusable (zero or non-finite).
    Ignored,
    /// Calibration is off in this profile, or the policy does not calibrate.
    Disabled,
}

/// A calibration state's current values, for explanations and `/debug`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CalibrationView {
    /// Fixed part of TTFT, milliseconds.
    pub offset_ms: f64,
    /// Multiplier of the model's load part.
    pub scale: f64,
    /// Observations applied.
    pub samples: u32,
    /// Of those, the ones clipped as outliers.
    pub clipped: u32,
    /// Robust spread of relative residuals (mean absolute value).
    pub spread: f64,
    /// The fleet's speed against the profile, already in `scale` (1 for a
    /// policy without one).
    #[serde(default = "one")]
    pub fleet_scale: f64,
    /// Whether the fleet's first tokens say the profile predicts its
    /// engines' speed (within the fleet scale's dead zone), so that a
    /// silent engine's bound is taken `silent_overdue_factor` times
    /// ([`crate::latency`]); false for a policy without a fleet scale.
    #[serde(default)]
    pub profile_fits: bool,
    /// The floor a speed probe set under the endpoint's scale, as it
    /// stands (fading after `stale_after`); absent when none
    /// ([`crate::Pick::observe_probe`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speed_probe_floor: Option<f64>,
    /// The step costs the policy predicts with, learnt from the fleet's
    /// streams ([`crate::steps`]); absent for a policy that does not learn
    /// them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<crate::steps::StepCosts>,
    /// The delay at a full KV cache the policy predicts with, learnt from
    /// how long the fleet's streams decode ([`crate::latency`]); absent
    /// until learnt, and for a policy that does not learn it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_turnover_ms: Option<f64>,
}

fn one() -> f64 {
    1.0
}

/// One endpoint's calibration. Create it with [`Calibration::prior`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibration {
    /// Offset in units of `unit_ms`.
    offset: f64,
    scale: f64,
    /// Covariance of (offset, scale): `[p00, p01, p11]`.
    cov: [f64; 3],
    spread: f64,
    samples: u32,
    clipped: u32,
    last_nanos: Option<u64>,
    /// Until when `(offset, scale)` apply undecayed: the prior never decays;
    /// a fit is fresh until `last + stale_after`.
    fresh_until: u64,
}

/// `base_millis` floored at 1 ms: the offset's unit, so both parameters are
/// of order one.
fn unit_ms(params: &LatencyParams) -> f64 {
    params.base_millis.max(1.0)
}

fn prior_cov(params: &LatencyParams) -> [f64; 3] {
    let c = &params.calibration;
    let offset_sd = c.offset_prior_sd_millis / unit_ms(params);
    [
        offset_sd * offset_sd,
        0.0,
        c.scale_prior_sd * c.scale_prior_sd,
    ]
}

use crate::latency::nanos;

impl Calibration {
    /// The prior: the model as the profile states it.
    pub fn prior(params: &LatencyParams) -> Self {
        Self {
            offset: params.base_millis / unit_ms(params),
            scale: 1.0,
            cov: prior_cov(params),
            spread: params.calibration.initial_spread,
            samples: 0,
            clipped: 0,
            last_nanos: None,
            fresh_until: u64::MAX,
        }
    }

    /// Weight of the fit against the prior at `now`: 1 while fresh, then
    /// `h / (h + t)` after `t` more idle time, `h` = `stale_half_life`.
    fn freshness(&self, params: &LatencyParams, now_nanos: u64) -> f64 {
        let Some(last) = self.last_nanos else {
            return 0.0;
        };
        let c = &params.calibration;
        let idle = now_nanos.saturating_sub(last);
        let stale_after = nanos(c.stale_after);
        if idle <= stale_after {
            return 1.0;
        }
        // Hyperbolic rather than exponential: one division instead of an
        // `exp2` call per stale endpoint per decision, with the same half
        // weight after one half-life (a third after two, a tenth after nine).
        let half = nanos(c.stale_half_life) as f64;
        half / (half + (idle - stale_after) as f64)
    }

    /// Observations applied so far.
    pub fn samples(&self) -> u32 {
        self.samples
    }

    /// `(offset_ms, scale)` at `now`, staleness applied.
    pub fn effective(&self, params: &LatencyParams, now: Duration) -> (f64, f64) {
        self.effective_at(params, nanos(now))
    }

    /// [`Calibration::effective`] with `now` in nanoseconds.
    #[inline]
    pub(crate) fn effective_at(&self, params: &LatencyParams, now_nanos: u64) -> (f64, f64) {
        if now_nanos <= self.fresh_until {
            return (self.offset * unit_ms(params), self.scale);
        }
        let w = self.freshness(params, now_nanos);
        let unit = unit_ms(params);
        if w >= 1.0 {
            return (self.offset * unit, self.scale);
        }
        let prior_offset = params.base_millis;
        (
            prior_offset + w * (self.offset * unit - prior_offset),
            1.0 + w * (self.scale - 1.0),
        )
    }

    /// The undecayed `(offset_ms, scale)` and until when (ns) they apply.
    pub(crate) fn fresh_coefficients(&self, params: &LatencyParams) -> ((f64, f64), u64) {
        (
            (self.offset * unit_ms(params), self.scale),
            self.fresh_until,
        )
    }

    /// The current values at `now`, for display.
    pub fn view(&self, params: &LatencyParams, now: Duration) -> CalibrationView {
        let (offset_ms, scale) = self.effective(params, now);
        CalibrationView {
            offset_ms,
            scale,
            samples: self.samples,
            clipped: self.clipped,
            spread: self.spread,
            fleet_scale: 1.0,
            profile_fits: false,
            speed_probe_floor: None,
            steps: None,
            kv_turnover_ms: None,
        }
    }

    /// Calibrated TTFT in milliseconds for a prediction whose load part is
    /// `load_ms`.
    pub fn predict(&self, params: &LatencyParams, load_ms: f64, now: Duration) -> f64 {
        let (offset, scale) = self.effective(params, now);
        offset + scale * load_ms
    }

    /// Decay towards the prior for the idle time up to `now`.
    fn age_to(&mut self, params: &LatencyParams, now: Duration) {
        let w = self.freshness(params, nanos(now));
        if w >= 1.0 {
            return;
        }
        let prior = Self::prior(params);
        let p0 = prior.cov;
        self.offset = prior.offset + w * (self.offset - prior.offset);
        self.scale = 1.0 + w * (self.scale - 1.0);
        for (p, q) in self.cov.iter_mut().zip(p0) {
            *p = w * *p + (1.0 - w) * q;
        }
        self.spread = w * self.spread + (1.0 - w) * prior.spread;
    }

    /// Feed one observed TTFT for a request whose prediction had load part
    /// `load_ms`.
    pub fn observe(
        &mut self,
        params: &LatencyParams,
        load_ms: f64,
        observed: Duration,
        now: Duration,
    ) -> ObserveOutcome {
        if !params.calibrate {
            return ObserveOutcome::Disabled;
        }
        let y = observed.as_secs_f64() * 1e3;
        if !(y > 0.0 && y.is_finite() && load_ms >= 0.0 && load_ms.is_finite()) {
            return ObserveOutcome::Ignored;
        }
        self.age_to(params, now);
        self.last_nanos = Some(nanos(now));
        self.fresh_until = nanos(now).saturating_add(nanos(params.calibration.stale_after));
        let c = &params.calibration;
        let unit = unit_ms(params);

        let predicted = self.offset * unit + self.scale * load_ms;
        let norm = predicted.max(1.0);
        let phi = [unit / norm, load_ms / norm];
        let residual = (y - predicted) / norm;

        // Robust clipping: 1.25 × mean absolute deviation ≈ one standard
        // deviation for normal residuals.
        let window = c.clip_sigmas * 1.25 * self.spread;
        let clipped = residual.abs() > window;
        let r = residual.clamp(-window, window);
        self.spread = ((1.0 - c.spread_weight) * self.spread
            + c.spread_weight * residual.abs().min(window))
        .max(c.min_spread);

        // Recursive least squares with forgetting.
        let [p00, p01, p11] = self.cov;
        let pphi = [p00 * phi[0] + p01 * phi[1], p01 * phi[0] + p11 * phi[1]];
        let denom = c.forgetting + phi[0] * pphi[0] + phi[1] * pphi[1];
        let gain = [pphi[0] / denom, pphi[1] / denom];
        self.offset += gain[0] * r;
        self.scale += gain[1] * r;
        let lambda = c.forgetting;
        self.cov = [
            (p00 - gain[0] * pphi[0]) / lambda,
            (p01 - gain[0] * pphi[1]) / lambda,
            (p11 - gain[1] * pphi[1]) / lambda,
        ];
        self.bound_cov(params);

        let max_offset = (params.base_millis + c.max_extra_offset_millis) / unit;
        self.offset = self.offset.clamp(0.0, max_offset);
        self.scale = self.scale.clamp(c.scale_bounds.0, c.scale_bounds.1);
        if !(self.offset.is_finite() && self.scale.is_finite()) {
            // Unreachable with validated parameters; never let NaN route.
            *self = Self::prior(params);
        }
        self.samples = self.samples.saturating_add(1);
        if clipped {
            self.clipped = self.clipped.saturating_add(1);
            ObserveOutcome::Clipped
        } else {
            ObserveOutcome::Updated
        }
    }

    /// Keep the covariance positive definite and no wider than the prior's.
    fn bound_cov(&mut self, params: &LatencyParams) {
        let p0 = prior_cov(params);
        let floor = 1e-12;
        let [mut p00, mut p01, mut p11] = self.cov;
        if !(p00.is_finite() && p01.is_finite() && p11.is_finite()) {
            self.cov = p0;
            return;
        }
        p00 = p00.max(floor);
        p11 = p11.max(floor);
        if p00 > p0[0] {
            let f = (p0[0] / p00).sqrt();
            p00 = p0[0];
            p01 *= f;
        }
        if p11 > p0[2] {
            let f = (p0[2] / p11).sqrt();
            p11 = p0[2];
            p01 *= f;
        }
        let limit = (p00 * p11).sqrt() * 0.999;
        p01 = p01.clamp(-limit, limit);
        self.cov = [p00, p01, p11];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::{RandomSource, SplitMix64, unit};

    fn ms(x: f64) -> Duration {
        Duration::from_secs_f64(x / 1e3)
    }

    /// A standard normal deviate (Box–Muller).
    fn normal(rng: &mut SplitMix64) -> f64 {
        let u1 = unit(rng).max(1e-12);
        let u2 = unit(rng);
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Observations of `offset + scale · x` with 5 % multiplicative noise,
    /// one every 100 ms.
    fn feed(
        cal: &mut Calibration,
        params: &LatencyParams,
        truth: (f64, f64),
        n: usize,
        rng: &mut SplitMix64,
        t0: Duration,
    ) -> Duration {
        let mut now = t0;
        for _ in 0..n {
            let x = 5.0 + 3000.0 * unit(rng);
            let y = (truth.0 + truth.1 * x) * (1.0 + 0.05 * normal(rng));
            now += Duration::from_millis(100);
            cal.observe(params, x, ms(y), now);
        }
        now
    }

    #[test]
    fn prior_is_the_uncalibrated_model() {
        let p = LatencyParams::default();
        let cal = Calibration::prior(&p);
        let now = Duration::from_secs(5);
        assert!((cal.predict(&p, 100.0, now) - (p.base_millis + 100.0)).abs() < 1e-9);
    }

    #[test]
    fn converges_with_noise() {
        let p = LatencyParams::default();
        let mut rng = SplitMix64::new(42);
        let mut cal = Calibration::prior(&p);
        let now = feed(&mut cal, &p, (40.0, 1.6), 600, &mut rng, Duration::ZERO);
        let (offset, scale) = cal.effective(&p, now);
        assert!((offset - 40.0).abs() < 8.0, "offset {offset}");
        assert!((scale - 1.6).abs() < 0.08, "scale {scale}");
        for x in [10.0, 300.0, 3000.0] {
            let want = 40.0 + 1.6 * x;
            let got = cal.predict(&p, x, now);
            assert!((got - want).abs() / want < 0.06, "x={x}: {got} vs {want}");
        }
    }

    #[test]
    fn a_single_outlier_is_ignored() {
        let p = LatencyParams::default();
        let mut rng = SplitMix64::new(7);
        let mut cal = Calibration::prior(&p);
        let now = feed(&mut cal, &p, (20.0, 1.2), 400, &mut rng, Duration::ZERO);
        let before: Vec<f64> = [10.0, 500.0, 3000.0]
            .iter()
            .map(|&x| cal.predict(&p, x, now))
            .collect();
        let outcome = cal.observe(&p, 500.0, Duration::from_secs(120), now + ms(100.0));
        assert_eq!(outcome, ObserveOutcome::Clipped);
        let after: Vec<f64> = [10.0, 500.0, 3000.0]
            .iter()
            .map(|&x| cal.predict(&p, x, now + ms(100.0)))
            .collect();
        for (b, a) in before.iter().zip(&after) {
            assert!((a - b).abs() / b < 0.02, "moved from {b} to {a}");
        }
    }

    #[test]
    fn learns_a_persistent_change() {
        let p = LatencyParams::default();
        let mut rng = SplitMix64::new(11);
        let mut cal = Calibration::prior(&p);
        let now = feed(&mut cal, &p, (20.0, 1.0), 300, &mut rng, Duration::ZERO);
        // The engine becomes twice as slow.
        let now = feed(&mut cal, &p, (20.0, 2.0), 300, &mut rng, now);
        let (_, scale) = cal.effective(&p, now);
        assert!((scale - 2.0).abs() < 0.15, "scale {scale}");
    }

    #[test]
    fn stays_within_bounds_under_garbage() {
        let p = LatencyParams::default();
        let mut rng = SplitMix64::new(3);
        let mut cal = Calibration::prior(&p);
        let mut now = Duration::ZERO;
        for i in 0..2000 {
            now += Duration::from_millis(10);
            let x = (rng.next_u64() % 10_000) as f64;
            let y = if i % 2 == 0 { 1e-3 } else { 1e7 };
            cal.observe(&p, x, ms(y), now);
            let (offset, scale) = cal.effective(&p, now);
            assert!(
                offset >= 0.0 && offset <= p.base_millis + p.calibration.max_extra_offset_millis
            );
            assert!((p.calibration.scale_bounds.0..=p.calibration.scale_bounds.1).contains(&scale));
        }
    }

    #[test]
    fn decays_to_the_prior_when_stale() {
        let p = LatencyParams::default();
        let mut rng = SplitMix64::new(5);
        let mut cal = Calibration::prior(&p);
        let now = feed(&mut cal, &p, (200.0, 3.0), 300, &mut rng, Duration::ZERO);
        let fresh = cal.effective(&p, now + Duration::from_secs(10));
        let (o1, s1) = cal.effective(&p, now);
        assert_eq!(fresh, (o1, s1), "no decay while fresh");
        let one_half_life = now + p.calibration.stale_after + p.calibration.stale_half_life;
        let (o2, s2) = cal.effective(&p, one_half_life);
        assert!(((s2 - 1.0) - 0.5 * (s1 - 1.0)).abs() < 1e-9);
        assert!(((o2 - p.base_millis) - 0.5 * (o1 - p.base_millis)).abs() < 1e-9);
        // Nine half-lives later the fit keeps a tenth of its weight.
        let nine = now + p.calibration.stale_after + 9 * p.calibration.stale_half_life;
        let (o3, s3) = cal.effective(&p, nine);
        assert!(((s3 - 1.0) - 0.1 * (s1 - 1.0)).abs() < 1e-9);
        assert!(((o3 - p.base_millis) - 0.1 * (o1 - p.base_millis)).abs() < 1e-6);
    }

    #[test]
    fn disabled_and_unusable_observations_change_nothing() {
        let mut p = LatencyParams::default();
        let mut cal = Calibration::prior(&p);
        let before = cal;
        let now = Duration::from_secs(1);
        assert_eq!(
            cal.observe(&p, 10.0, Duration::ZERO, now),
            ObserveOutcome::Ignored
        );
        assert_eq!(
            cal.observe(&p, f64::NAN, ms(10.0), now),
            ObserveOutcome::Ignored
        );
        assert_eq!(
            cal.observe(&p, -1.0, ms(10.0), now),
            ObserveOutcome::Ignored
        );
        p.calibrate = false;
        assert_eq!(
            cal.observe(&p, 10.0, ms(500.0), now),
            ObserveOutcome::Disabled
        );
        assert_eq!(cal, before);
    }
}
