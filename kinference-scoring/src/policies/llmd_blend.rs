//! llm-d's long-standing weighted blend of scorers with the max-score
//! picker (`queue-scorer` 2, `kv-cache-utilization-scorer` 2,
//! `prefix-cache-scorer` 3: llm-d-inference-scheduler
//! `pkg/epp/config/loader/defaults.go`, `loadDefaultConfig`; the same
//! weights in the chart's `config/charts/epplib/templates/_config.yaml`).

use std::time::Duration;

use crate::error::ScoringError;
use crate::input::{Candidate, Request};
use crate::pick::{Choice, Explanation, Reason, ScoreDetail};
use crate::policies::baseline::{
    Better, choice, explanation, extreme, fresh_metrics, prefix_score,
};
use crate::policies::{Pick, PolicyName, check};
use crate::profile::LatencyParams;
use crate::rng::RandomSource;

/// Weights of [`LlmdBlend`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlmdBlendConfig {
    /// Weight of the prefix-cache scorer.
    pub prefix_weight: f64,
    /// Weight of the queue scorer.
    pub queue_weight: f64,
    /// Weight of the KV-cache-utilisation scorer.
    pub kv_weight: f64,
}

impl Default for LlmdBlendConfig {
    /// llm-d's long-standing default scheduling profile: prefix 3, queue 2,
    /// KV utilisation 2.
    fn default() -> Self {
        Self {
            prefix_weight: 3.0,
            queue_weight: 2.0,
            kv_weight: 2.0,
        }
    }
}

/// llm-d's weighted blend of scorers, max-score picker.
///
/// From llm-d-router's scorer plugins: prefix score = matched ÷ total prompt
/// blocks; queue score = `(maxQ − q) ÷ (maxQ − minQ)` over the candidates (1
/// when all equal) with `q` the engine's waiting queue; KV-utilisation score
/// = `1 − usage`. The weighted sum's maximum wins, ties at random.
///
/// Inputs: the queue is the scraped `waiting` when fresh, else the router's
/// own count of requests still in prefill; KV usage without fresh metrics
/// scores 0 (llm-d leaves such endpoints unscored).
///
/// Freshness: llm-d's metrics data source scrapes every engine every 50 ms
/// (`--refresh-metrics-interval`, `pkg/epp/server/options.go`); the router's `--scrape-interval` decides
/// ours, and `cargo xtask bench routing` runs this policy at 0.05 s so that
/// it sees what llm-d sees.
#[derive(Debug, Clone)]
pub struct LlmdBlend {
    params: LatencyParams,
    config: LlmdBlendConfig,
    scores: Vec<f64>,
}

impl LlmdBlend {
    /// With llm-d's default weights.
    pub fn new(params: LatencyParams) -> Self {
        Self::with_config(params, LlmdBlendConfig::default())
    }

    /// With other weights.
    pub fn with_config(params: LatencyParams, config: LlmdBlendConfig) -> Self {
        Self {
            params,
            config,
            scores: Vec::new(),
        }
    }

    fn queue_length(&self, c: &Candidate) -> u32 {
        fresh_metrics(&self.params, c).map_or(c.in_flight.prefilling(), |m| m.waiting)
    }

    fn kv_score(&self, c: &Candidate) -> f64 {
        fresh_metrics(&self.params, c).map_or(0.0, |m| {
            if m.kv_usage.is_nan() {
                1.0
            } else {
                1.0 - m.kv_usage.clamp(0.0, 1.0)
            }
        })
    }

    fn terms(&self, request: &Request, c: &Candidate, min_q: u32, max_q: u32) -> (f64, f64, f64) {
        let prefix = prefix_score(&self.params, request, c);
        let q = self.queue_length(c);
        let queue = if max_q == min_q {
            1.0
        } else {
            f64::from(max_q - q) / f64::from(max_q - min_q)
        };
        (prefix, queue, self.kv_score(c))
    }

    fn decide(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Choice, ScoringError> {
        check(request, candidates)?;
        let (min_q, max_q) = candidates
            .iter()
            .map(|c| self.queue_length(c))
            .fold((u32::MAX, 0), |(lo, hi), q| (lo.min(q), hi.max(q)));
        let w = self.config;
        let mut scores = std::mem::take(&mut self.scores);
        scores.clear();
        scores.extend(candidates.iter().map(|c| {
            let (prefix, queue, kv) = self.terms(request, c, min_q, max_q);
            w.prefix_weight * prefix + w.queue_weight * queue + w.kv_weight * kv
        }));
        self.scores = scores;
        let (index, tie) = extreme(&self.scores, Better::Higher, |_| true, rng);
        Ok(choice(
            &self.params,
            request,
            candidates,
            index,
            now,
            Reason::HighestWeightedScore,
            tie,
        ))
    }
}

impl Pick for LlmdBlend {
    fn name(&self) -> PolicyName {
        PolicyName::LlmdBlend
    }

    fn propose(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Choice, ScoringError> {
        self.decide(request, candidates, now, rng)
    }

    fn propose_explained(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Explanation, ScoringError> {
        let choice = self.decide(request, candidates, now, rng)?;
        let (min_q, max_q) = candidates
            .iter()
            .map(|c| self.queue_length(c))
            .fold((u32::MAX, 0), |(lo, hi), q| (lo.min(q), hi.max(q)));
        Ok(explanation(
            PolicyName::LlmdBlend,
            &self.params,
            (request, candidates, now),
            choice,
            &self.scores,
            |i| {
                let c = &candidates[i];
                let (prefix, queue, kv_utilization) = self.terms(request, c, min_q, max_q);
                ScoreDetail::LlmdBlend {
                    prefix,
                    queue,
                    kv_utilization,
                    queue_length: self.queue_length(c),
                }
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::{EndpointId, EngineMetrics};
    use crate::policies::baseline::test_support::{cand, pick, request};
    use crate::rng::SplitMix64;

    #[test]
    fn llmd_blend_weighs_prefix_queue_and_kv() {
        let mut p = LlmdBlend::new(LatencyParams::default());
        let fresh = |waiting, kv_usage| {
            Some(EngineMetrics {
                running: 0,
                waiting,
                kv_usage,
                age: Duration::ZERO,
                own_requests: 0,
                own_prefilling: 0,
            })
        };
        let mut a = cand(0, 100, 0, 0); // full prefix (100 of 100 blocks)
        a.engine = fresh(10, 0.9);
        let mut b = cand(1, 0, 0, 0);
        b.engine = fresh(0, 0.1);
        // a: 3·1 + 2·0 + 2·0.1 = 3.2; b: 3·0 + 2·1 + 2·0.9 = 3.8.
        let e = p
            .pick_explained(
                &request(),
                &[a, b],
                Duration::from_secs(1),
                &mut SplitMix64::new(1),
            )
            .unwrap();
        assert_eq!(e.choice.endpoint, EndpointId(1));
        assert!((e.candidates[0].score - 3.2).abs() < 1e-9);
        assert!((e.candidates[1].score - 3.8).abs() < 1e-9);
        // Less KV pressure on the warm one tips it back: a scores
        // 3·1 + 2·0 + 2·0.5 = 4.0 against b's 3.8.
        a.engine = fresh(5, 0.5);
        assert_eq!(pick(&mut p, &[a, b], 1).endpoint, EndpointId(0));
    }
}
