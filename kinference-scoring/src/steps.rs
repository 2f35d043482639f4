//! The engines' step costs, learnt from the gaps between streamed tokens.
//!
//! The latency model prices an engine step at `overhead + decode cost ×
//! decoding sequences + prefill tokens ÷ throughput` ([`crate::latency`]).
//! Calibration ([`crate::calibrate`]) scales the whole load part per
//! endpoint and for the fleet, so it corrects the model's *level* but not
//! its *shape*: a profile whose decode cost is too high against its prefill
//! cost predicts busy engines too slow and idle cold ones too fast however
//! it is scaled. The built-in profile (an H100) against the benchmark's
//! simulated engines prices a decoding sequence at 2.5 prompt tokens and a
//! step's overhead at 150, where the engines spend 0.76 and 5.8; and it
//! prefills 21× faster than they do, more than calibration's bounds let
//! one endpoint learn.
//!
//! A streamed response shows the costs. After its first token every token
//! costs the engine one step, so over one response the router knows
//!
//! ```text
//! n = tokens after the first        T = time from the first to the last
//! D = sequences decoding there, on average over its steps (its own and
//!     its peers', read at each chunk)
//! P = prompt tokens prefilled there meanwhile
//!     (uncached tokens of requests whose first token came within T)
//! T ÷ n ≈ overhead + decode cost × D + (P ÷ n) ÷ throughput
//! ```
//!
//! [`StepFit`] fits the three costs by least squares on relative errors
//! (each response weighs the same whatever its step time), with
//! exponential forgetting (a memory of ~100 streams), over every endpoint
//! of a worker set. The model is linear in the costs, so the fit keeps its
//! sufficient statistics (a 3 × 3 matrix and a vector) and solves them
//! after each stream: no start is too far off, and a direction the streams
//! do not vary in (the overhead when every stream decodes beside as many
//! others) stays where it was. Streams far from the fit (a stalled
//! engine) weigh in less once a few are in.
//!
//! [`StepFit::model`] gives the costs to predict with once the prefill
//! cost is pinned down (its relative standard error under
//! [`IDENTIFIED_SD`]): a fleet whose prompts never share steps with
//! decodes tells the decode cost but not the prefill speed, and the
//! profile's stay. Calibration then corrects what is left per endpoint.
//!
//! Known limits: a stream whose chunks hold several tokens (vLLM's
//! `--stream-interval`, speculative decoding) is counted by its `usage`
//! when the client asked for it, else by its chunks, and then looks slower
//! per step (the profile's `learnStepCosts: false` turns the fit off).
//! With router replicas, each counts the sequences its peers report
//! decoding and the prompt tokens they report prefilled, dated by the
//! first tokens' ages in their reports (the router's
//! `endpoint::StepWindow`); a replica sees only its
//! own streams: half as many samples with two (on the benchmark's agent
//! rows, 58 per replica, the decode cost is not pinned down: 0.02 and
//! 1.35 ms against the engines' 0.65, 2026-12-04 at `de4b793`).
//! First tokens of one engine step are told apart from the next step's
//! by arriving within 2 ms of each other: an engine whose step takes less,
//! or whose server spreads one step's chunks over more (many streams on
//! a busy API server), blurs the prefill counted in a stream's window.
//!
//! Cost: a 3 × 3 solve per finished stream; 128 bytes per worker set.

use serde::{Deserialize, Serialize};

use crate::calibrate::ObserveOutcome;
use crate::profile::LatencyParams;

/// One finished stream on one endpoint, as the router saw it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepSample {
    /// Tokens after the first: the engine steps it spanned.
    pub tokens: u32,
    /// Time from the first token to the last, milliseconds.
    pub millis: f64,
    /// Sequences decoding there, on average over that time (itself
    /// included).
    pub decoding: f64,
    /// Prompt tokens prefilled there meanwhile.
    pub prefill_tokens: f64,
}

/// Streams shorter than this many tokens after the first are ignored: a
/// few gaps say more about network jitter than about steps.
pub const MIN_TOKENS: u32 = 4;

/// Streams observed before the costs are used.
pub const MIN_SAMPLES: u32 = 8;

/// The prefill cost's relative standard error under which the costs are
/// used.
pub const IDENTIFIED_SD: f64 = 0.3;

/// Each stream discounts older ones by this (a memory of ~100 streams).
const FORGETTING: f64 = 0.99;

/// Weight of the pull towards the current costs, in streams
/// ([`StepFit::observe`]).
const DAMPING: f64 = 0.05;

/// Bounds of each cost against the profile's.
const COST_BOUNDS: (f64, f64) = (1.0 / 256.0, 256.0);

/// Robust weighting: once [`MIN_SAMPLES`] streams are in, a stream whose
/// relative error is beyond this many robust standard deviations weighs
/// in proportionally less (one stalled stream moves the fit by little).
const CLIP_SIGMAS: f64 = 3.0;
const INITIAL_SPREAD: f64 = 0.5;
const MIN_SPREAD: f64 = 0.03;
const SPREAD_WEIGHT: f64 = 0.05;

/// The fitted step costs of a worker set's engines: `(step overhead,
/// decode cost per sequence, prefill cost per token)` in milliseconds.
///
/// Serialised whole (its statistics, not only the costs) so that a router
/// replica that starts can take a peer's ([`StepFit::adopt`]) and go on
/// learning from it as from its own streams.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepFit {
    /// Σ w·φφᵀ over the streams (forgotten geometrically), `φ` the stream's
    /// features over its step time.
    gram: [[f64; 3]; 3],
    /// Σ w·φ (the targets are all 1: observed ÷ observed).
    moment: [f64; 3],
    /// The costs solved from them.
    cost: [f64; 3],
    /// Robust spread of the relative errors (mean absolute value).
    spread: f64,
    samples: u32,
}

/// The fit's current values, for `/debug` and explanations.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepCosts {
    /// Fitted step overhead, milliseconds.
    pub overhead_ms: f64,
    /// Fitted cost of a decoding sequence per step, milliseconds.
    pub decode_ms: f64,
    /// Fitted prefill cost, milliseconds per token.
    pub prefill_ms_per_token: f64,
    /// Streams observed.
    pub samples: u32,
    /// Robust spread of the streams' relative errors (mean absolute value).
    pub spread: f64,
    /// The prefill cost's relative standard error.
    pub prefill_sd: f64,
    /// Whether the costs are in use ([`StepFit::model`]).
    pub in_use: bool,
}

impl StepFit {
    /// The prior: the profile's costs.
    pub fn new(profile: &LatencyParams) -> Self {
        Self {
            gram: [[0.0; 3]; 3],
            moment: [0.0; 3],
            cost: Self::prior_costs(profile),
            spread: INITIAL_SPREAD,
            samples: 0,
        }
    }

    /// Streams observed.
    pub fn samples(&self) -> u32 {
        self.samples
    }

    /// The profile's costs: overhead ms, decode ms per sequence, prefill ms
    /// per token.
    fn prior_costs(profile: &LatencyParams) -> [f64; 3] {
        [
            profile.step_overhead_millis.max(1e-3),
            profile.decode_cost_millis.max(1e-6),
            1e3 / profile.prefill_tokens_per_second,
        ]
    }

    /// Feeds one finished stream. `profile` is the worker set's latency
    /// model as configured.
    pub fn observe(&mut self, profile: &LatencyParams, s: &StepSample) -> ObserveOutcome {
        if !(profile.calibrate && profile.learn_step_costs) {
            return ObserveOutcome::Disabled;
        }
        let per_step = s.millis / f64::from(s.tokens.max(1));
        if s.tokens < MIN_TOKENS
            || !(per_step > 0.0 && per_step.is_finite())
            || !(s.decoding >= 0.0 && s.decoding.is_finite())
            || !(s.prefill_tokens >= 0.0 && s.prefill_tokens.is_finite())
        {
            return ObserveOutcome::Ignored;
        }
        let phi = [
            1.0 / per_step,
            s.decoding / per_step,
            s.prefill_tokens / f64::from(s.tokens) / per_step,
        ];
        let residual = 1.0 - dot(&self.cost, &phi);
        let window = CLIP_SIGMAS * 1.25 * self.spread;
        let robust = self.samples >= MIN_SAMPLES;
        let clipped = robust && residual.abs() > window;
        let w = if clipped {
            window / residual.abs()
        } else {
            1.0
        };
        // A running mean at first, then exponential.
        let k = (1.0 / f64::from(self.samples + 1)).max(SPREAD_WEIGHT);
        let e = if robust {
            residual.abs().min(window)
        } else {
            residual.abs()
        };
        self.spread = ((1.0 - k) * self.spread + k * e).max(MIN_SPREAD);
        for i in 0..3 {
            self.moment[i] = FORGETTING * self.moment[i] + w * phi[i];
            for j in 0..3 {
                self.gram[i][j] = FORGETTING * self.gram[i][j] + w * phi[i] * phi[j];
            }
        }
        self.samples = self.samples.saturating_add(1);
        self.solve(profile);
        if clipped {
            ObserveOutcome::Clipped
        } else {
            ObserveOutcome::Updated
        }
    }

    /// The statistics with a pull of `weight` streams towards the current
    /// costs (each cost `x` counts as that many streams saying `x ÷ its
    /// current value = 1`): a direction the streams do not vary in stays
    /// where it was, without biasing the others towards a profile that may
    /// be far off.
    fn damped(&self, weight: f64) -> ([[f64; 3]; 3], [f64; 3]) {
        let (mut g, mut m) = (self.gram, self.moment);
        for i in 0..3 {
            let c = self.cost[i];
            g[i][i] += weight / (c * c);
            m[i] += weight / c;
        }
        (g, m)
    }

    fn solve(&mut self, profile: &LatencyParams) {
        let prior = Self::prior_costs(profile);
        let (g, m) = self.damped(DAMPING);
        let Some(x) = solve3(g, m) else {
            return;
        };
        for i in 0..3 {
            let v = x[i].clamp(prior[i] * COST_BOUNDS.0, prior[i] * COST_BOUNDS.1);
            if v.is_finite() {
                self.cost[i] = v;
            }
        }
    }

    /// Takes `other`, another router's fit of the same engines (a peer
    /// replica's), in place of this one when this one is not in use yet
    /// and `other`, bounded by this profile, is: a replica that starts
    /// does not learn again what its peers know. Its own streams then
    /// update the statistics as they would their own, and forget the
    /// peer's at the same rate as old streams. A fit with a value that is
    /// not finite or a cost that is not positive is refused. Returns
    /// whether it was taken.
    pub fn adopt(&mut self, profile: &LatencyParams, other: &StepFit) -> bool {
        if !(profile.calibrate && profile.learn_step_costs) || self.identified() {
            return false;
        }
        if !(other.finite()
            && other.cost.iter().all(|&c| c > 0.0)
            && (0..3).all(|i| other.gram[i][i] >= 0.0))
        {
            return false;
        }
        let mut fit = StepFit {
            spread: other.spread.clamp(MIN_SPREAD, INITIAL_SPREAD),
            ..*other
        };
        let prior = Self::prior_costs(profile);
        for (c, p) in fit.cost.iter_mut().zip(prior) {
            *c = c.clamp(p * COST_BOUNDS.0, p * COST_BOUNDS.1);
        }
        fit.solve(profile);
        if !fit.identified() {
            return false;
        }
        *self = fit;
        true
    }

    /// Whether every value is finite (what JSON can carry).
    pub fn finite(&self) -> bool {
        self.gram
            .iter()
            .flatten()
            .chain(&self.moment)
            .chain(&self.cost)
            .chain(std::iter::once(&self.spread))
            .all(|v| v.is_finite())
    }

    /// Whether the prefill cost is pinned down well enough to take the
    /// others relative to it: its standard error, from the statistics and
    /// the spread of the errors, relative to it.
    fn identified(&self) -> bool {
        self.samples >= MIN_SAMPLES && self.prefill_sd() < IDENTIFIED_SD
    }

    /// The prefill cost's standard error relative to it, from the
    /// statistics and the spread of the errors (what the streams alone
    /// tell: the damping only keeps the matrix invertible).
    fn prefill_sd(&self) -> f64 {
        let (g, _) = self.damped(1e-9);
        solve3(g, [0.0, 0.0, 1.0]).map_or(f64::INFINITY, |col| {
            col[2].max(0.0).sqrt() * 1.25 * self.spread / self.cost[2]
        })
    }

    /// The step costs to predict with: step overhead and decode cost in
    /// milliseconds, prefill tokens per second, each within
    /// [`COST_BOUNDS`] of the profile's; `None` while the streams do not
    /// pin the prefill cost down.
    pub fn model(&self, profile: &LatencyParams) -> Option<(f64, f64, f64)> {
        if !(profile.calibrate && profile.learn_step_costs && self.identified()) {
            return None;
        }
        let [a, c, b] = self.cost;
        Some((a, c, 1e3 / b))
    }

    /// The fitted costs in milliseconds.
    pub fn costs(&self, profile: &LatencyParams) -> StepCosts {
        StepCosts {
            overhead_ms: self.cost[0],
            decode_ms: self.cost[1],
            prefill_ms_per_token: self.cost[2],
            samples: self.samples,
            spread: self.spread,
            prefill_sd: self.prefill_sd(),
            in_use: self.model(profile).is_some(),
        }
    }
}

fn dot(a: &[f64; 3], b: &[f64; 3]) -> f64 {
    a[0] * b[0] + a[1] * b[1] + a[2] * b[2]
}

/// `g⁻¹ m` for a symmetric positive definite `g`, by Gaussian elimination
/// with partial pivoting; `None` when singular.
fn solve3(mut g: [[f64; 3]; 3], mut m: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&a, &b| g[a][col].abs().total_cmp(&g[b][col].abs()))?;
        if g[pivot][col].abs() <= 1e-300 || g[pivot][col].is_nan() {
            return None;
        }
        g.swap(col, pivot);
        m.swap(col, pivot);
        let top = g[col];
        for row in (col + 1)..3 {
            let f = g[row][col] / top[col];
            for (x, t) in g[row].iter_mut().zip(top).skip(col) {
                *x -= f * t;
            }
            m[row] -= f * m[col];
        }
    }
    let mut x = [0.0; 3];
    for row in (0..3).rev() {
        let tail: f64 = ((row + 1)..3).map(|k| g[row][k] * x[k]).sum();
        x[row] = (m[row] - tail) / g[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::{SplitMix64, unit};

    /// Streams from an engine whose steps cost `truth` = (overhead ms,
    /// decode ms per sequence, prefill ms per token), with 5 % noise.
    fn feed(fit: &mut StepFit, profile: &LatencyParams, truth: [f64; 3], n: usize, seed: u64) {
        let mut rng = SplitMix64::new(seed);
        for _ in 0..n {
            let tokens = 20 + (unit(&mut rng) * 200.0) as u32;
            let decoding = 1.0 + unit(&mut rng) * 40.0;
            let prefill_tokens = if unit(&mut rng) < 0.5 {
                0.0
            } else {
                unit(&mut rng) * 8000.0
            };
            let per_step = truth[0] + truth[1] * decoding;
            let millis = (f64::from(tokens) * per_step + truth[2] * prefill_tokens)
                * (0.95 + 0.1 * unit(&mut rng));
            fit.observe(
                profile,
                &StepSample {
                    tokens,
                    millis,
                    decoding,
                    prefill_tokens,
                },
            );
        }
    }

    #[test]
    fn learns_the_costs_of_engines_unlike_the_profile() {
        // The built-in profile against the benchmark's simulated engine:
        // overhead 5 ms, 0.65 ms per decoding sequence, 0.86 ms per prompt
        // token (the profile says 6, 0.1 and 0.04).
        let profile = LatencyParams::default();
        let mut fit = StepFit::new(&profile);
        assert_eq!(fit.model(&profile), None, "nothing learnt yet");
        feed(&mut fit, &profile, [5.0, 0.65, 0.86], 40, 1);
        let costs = fit.costs(&profile);
        assert!(costs.in_use, "{costs:?}");
        for (got, want) in [
            (costs.overhead_ms, 5.0),
            (costs.decode_ms, 0.65),
            (costs.prefill_ms_per_token, 0.86),
        ] {
            assert!((got / want - 1.0).abs() < 0.15, "{costs:?}");
        }
        let (overhead, decode, prefill) = fit.model(&profile).unwrap();
        assert_eq!((overhead, decode), (costs.overhead_ms, costs.decode_ms));
        assert!((prefill * costs.prefill_ms_per_token / 1e3 - 1.0).abs() < 1e-9);
        // The engines change (an upgrade: everything twice as fast): within
        // the fit's memory the costs follow.
        feed(&mut fit, &profile, [2.5, 0.325, 0.43], 300, 2);
        let costs = fit.costs(&profile);
        assert!(
            (costs.prefill_ms_per_token / 0.43 - 1.0).abs() < 0.15,
            "{costs:?}"
        );
        assert!((costs.decode_ms / 0.325 - 1.0).abs() < 0.2, "{costs:?}");
    }

    #[test]
    fn a_starting_router_takes_a_peers_fit_and_goes_on_learning() {
        let profile = LatencyParams::default();
        let mut peer = StepFit::new(&profile);
        feed(&mut peer, &profile, [5.0, 0.65, 0.86], 40, 1);
        assert!(peer.costs(&profile).in_use);
        // Through JSON, as replicas send it.
        let sent: StepFit = serde_json::from_str(&serde_json::to_string(&peer).unwrap()).unwrap();

        let mut fresh = StepFit::new(&profile);
        assert!(fresh.adopt(&profile, &sent));
        let (took, had) = (fresh.costs(&profile), peer.costs(&profile));
        assert!(took.in_use, "{took:?}");
        assert!(
            (took.prefill_ms_per_token / had.prefill_ms_per_token - 1.0).abs() < 0.02,
            "{took:?} against {had:?}"
        );
        assert_eq!(took.samples, had.samples);
        // Its own streams move it from there (the engines got twice as fast).
        feed(&mut fresh, &profile, [2.5, 0.325, 0.43], 300, 2);
        let later = fresh.costs(&profile);
        assert!(
            (later.prefill_ms_per_token / 0.43 - 1.0).abs() < 0.15,
            "{later:?}"
        );

        // A fit in use keeps its own; a peer's fit not in use, or garbage,
        // is not taken.
        let before = fresh;
        assert!(!fresh.adopt(&profile, &peer));
        assert_eq!(fresh, before);
        let mut empty = StepFit::new(&profile);
        assert!(!empty.adopt(&profile, &StepFit::new(&profile)));
        for bad in [
            StepFit {
                cost: [5.0, f64::NAN, 0.86],
                ..peer
            },
            StepFit {
                cost: [5.0, 0.65, -1.0],
                ..peer
            },
            StepFit {
                spread: f64::INFINITY,
                ..peer
            },
            StepFit {
                gram: [[-1.0; 3]; 3],
                ..peer
            },
        ] {
            assert!(!empty.adopt(&profile, &bad), "{bad:?}");
        }
        assert_eq!(empty, StepFit::new(&profile));
        // Not where the profile turns learning off.
        let off = LatencyParams {
            learn_step_costs: false,
            ..profile
        };
        assert!(!StepFit::new(&off).adopt(&off, &peer));
    }

    #[test]
    fn a_right_profile_keeps_its_costs() {
        let profile = LatencyParams {
            step_overhead_millis: 5.0,
            decode_cost_millis: 0.65,
            prefill_tokens_per_second: 1e3 / 0.86,
            ..LatencyParams::default()
        };
        let mut fit = StepFit::new(&profile);
        feed(&mut fit, &profile, [5.0, 0.65, 0.86], 200, 2);
        let (overhead, decode, prefill) = fit.model(&profile).unwrap();
        assert!((overhead / 5.0 - 1.0).abs() < 0.15, "{overhead}");
        assert!((decode / 0.65 - 1.0).abs() < 0.15, "{decode}");
        assert!((prefill / profile.prefill_tokens_per_second - 1.0).abs() < 0.15);
    }

    #[test]
    fn without_prefill_in_the_streams_the_costs_are_not_used() {
        let profile = LatencyParams::default();
        let mut fit = StepFit::new(&profile);
        let mut rng = SplitMix64::new(3);
        for _ in 0..200 {
            let decoding = 1.0 + unit(&mut rng) * 40.0;
            let out = fit.observe(
                &profile,
                &StepSample {
                    tokens: 100,
                    millis: 100.0 * (5.0 + 0.65 * decoding),
                    decoding,
                    prefill_tokens: 0.0,
                },
            );
            assert!(matches!(
                out,
                ObserveOutcome::Updated | ObserveOutcome::Clipped
            ));
        }
        // The decode cost is learnt, but not the prefill speed: the
        // profile's stays, and so do the others.
        let costs = fit.costs(&profile);
        assert!((costs.decode_ms / 0.65 - 1.0).abs() < 0.1, "{costs:?}");
        assert!(
            (costs.prefill_ms_per_token * profile.prefill_tokens_per_second / 1e3 - 1.0).abs()
                < 1e-12
        );
        assert_eq!(fit.model(&profile), None);
        assert!(!costs.in_use);
    }

    #[test]
    fn garbage_is_ignored_and_outliers_bounded() {
        let profile = LatencyParams::default();
        let mut fit = StepFit::new(&profile);
        let before = fit;
        for s in [
            StepSample {
                tokens: 2,
                millis: 100.0,
                decoding: 1.0,
                prefill_tokens: 0.0,
            },
            StepSample {
                tokens: 100,
                millis: f64::NAN,
                decoding: 1.0,
                prefill_tokens: 0.0,
            },
            StepSample {
                tokens: 100,
                millis: 0.0,
                decoding: 1.0,
                prefill_tokens: 0.0,
            },
            StepSample {
                tokens: 100,
                millis: 100.0,
                decoding: -1.0,
                prefill_tokens: 0.0,
            },
        ] {
            assert_eq!(fit.observe(&profile, &s), ObserveOutcome::Ignored);
        }
        assert_eq!(fit, before);
        let s = StepSample {
            tokens: 100,
            millis: 1000.0,
            decoding: 4.0,
            prefill_tokens: 100.0,
        };
        for off in [
            LatencyParams {
                calibrate: false,
                ..profile
            },
            LatencyParams {
                learn_step_costs: false,
                ..profile
            },
        ] {
            assert_eq!(fit.observe(&off, &s), ObserveOutcome::Disabled);
        }
        assert_eq!(fit, before);

        // Once learnt, one stalled stream (a hundred times slower) moves
        // the costs by little.
        feed(&mut fit, &profile, [5.0, 0.65, 0.86], 300, 4);
        let (o1, d1, p1) = fit.model(&profile).unwrap();
        let out = fit.observe(
            &profile,
            &StepSample {
                tokens: 50,
                millis: 50.0 * 100.0 * (5.0 + 0.65 * 10.0),
                decoding: 10.0,
                prefill_tokens: 0.0,
            },
        );
        assert_eq!(out, ObserveOutcome::Clipped);
        let (o2, d2, p2) = fit.model(&profile).unwrap();
        for (a, b) in [(o1, o2), (d1, d2), (p1, p2)] {
            assert!((b / a - 1.0).abs() < 0.3, "{a} → {b}");
        }
    }
}
