//! llm-d's current default scheduling profile ("optimized baseline"): the
//! `prefix-cache-affinity-filter`, then the `token-load-scorer` and the
//! `no-hit-lru-scorer` summed by the max-score picker.
//!
//! Followed from llm-d-inference-scheduler (`llm-d-router`):
//!
//! - `pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity`:
//!   keep the endpoints whose prefix score (matched ÷ total prompt blocks)
//!   is at least `affinityThreshold` (0.80); none: keep all. With
//!   probability `explorationProbability` (0.01) keep all. The TTFT load
//!   gate (`maxTTFTPenaltyMs`, 5,000 ms) compares latency predictions and is
//!   skipped when no `predicted-latency-producer` runs, which is the case in
//!   the default profile: off here by default too (`max_ttft_penalty_ms`
//!   = 0), available with the guides' `peakPrefillThroughput` estimate.
//! - `pkg/epp/framework/plugins/scheduling/scorer/tokenload`: `1 − min(1,
//!   tokens ÷ queueThresholdTokens)` (4,194,304), where tokens are the
//!   `inflight-load-producer`'s: every request sent and not finished counts
//!   its input and an estimated output of 1.5 × its input
//!   (`dataproducer/inflightload/token_estimator.go`) until it ends. The
//!   router's own counters, so always fresh: here
//!   `2.5 × InFlight::context_tokens`.
//! - `pkg/epp/framework/plugins/scheduling/scorer/nohitlru`: a request is
//!   cold when no endpoint has a matching block; a cold request scores
//!   endpoints by how long ago they last took a cold request (never-used
//!   first, then least recently used), `1 − rank ÷ (n − 1)`; a warm request
//!   scores 0.5 everywhere. The chosen endpoint of a cold request becomes the
//!   most recently used.
//!
//! Both scorers have llm-d's default weight 1. Highest sum wins among the
//! kept endpoints; exact ties at random.

use std::time::Duration;

use crate::error::ScoringError;
use crate::input::{Candidate, EndpointId, Request};
use crate::latency::source_blocks;
use crate::pick::{Choice, Explanation, Reason, ScoreDetail};
use crate::policies::baseline::{Better, choice, explanation, extreme, prefix_score};
use crate::policies::{Pick, PolicyName, check};
use crate::profile::LatencyParams;
use crate::rng::{RandomSource, unit};

/// Settings of [`LlmdDefault`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlmdDefaultConfig {
    /// Prefix score at or above which an endpoint is sticky (llm-d: 0.80).
    pub affinity_threshold: f64,
    /// Probability of skipping the filter (llm-d: 0.01).
    pub exploration_probability: f64,
    /// Break stickiness when the best sticky endpoint's gate TTFT exceeds the
    /// best non-sticky one's by more than this; 0 = no gate (llm-d's default
    /// profile runs no latency predictor, so its gate never acts; with one,
    /// its default is 5,000 ms).
    pub max_ttft_penalty_ms: f64,
    /// Peak prefill throughput for the gate's TTFT estimate (in-flight
    /// uncached tokens ÷ this), tokens/s; `None` takes the profile's
    /// `prefill_tokens_per_second`.
    pub peak_prefill_tokens_per_second: Option<f64>,
    /// Token-load scorer normalisation (llm-d: 4,194,304 tokens).
    pub queue_threshold_tokens: f64,
    /// The in-flight load producer's output estimate, × input (llm-d: 1.5).
    pub output_ratio: f64,
    /// Weight of the token-load scorer (llm-d's default weight: 1).
    pub token_load_weight: f64,
    /// Weight of the no-hit-LRU scorer (1).
    pub no_hit_lru_weight: f64,
}

impl Default for LlmdDefaultConfig {
    fn default() -> Self {
        Self {
            affinity_threshold: 0.80,
            exploration_probability: 0.01,
            max_ttft_penalty_ms: 0.0,
            peak_prefill_tokens_per_second: None,
            queue_threshold_tokens: 4_194_304.0,
            output_ratio: 1.5,
            token_load_weight: 1.0,
            no_hit_lru_weight: 1.0,
        }
    }
}

/// llm-d's default profile; see the [module docs](self) for the sources.
#[derive(Debug, Clone)]
pub struct LlmdDefault {
    params: LatencyParams,
    config: LlmdDefaultConfig,
    scores: Vec<f64>,
    kept: Vec<bool>,
    /// Per endpoint id: when it last took a cold request (a decision count),
    /// 0 = never.
    cold_used: Vec<u64>,
    decisions: u64,
}

impl LlmdDefault {
    /// With llm-d's defaults (gate throughput from the profile).
    pub fn new(params: LatencyParams) -> Self {
        Self::with_config(params, LlmdDefaultConfig::default())
    }

    /// With other settings.
    pub fn with_config(params: LatencyParams, config: LlmdDefaultConfig) -> Self {
        Self {
            params,
            config,
            scores: Vec::new(),
            kept: Vec::new(),
            cold_used: Vec::new(),
            decisions: 0,
        }
    }

    fn gate_ttft_ms(&self, c: &Candidate) -> f64 {
        let peak = self
            .config
            .peak_prefill_tokens_per_second
            .unwrap_or(self.params.prefill_tokens_per_second);
        c.in_flight.prefill_tokens as f64 / peak * 1e3
    }

    fn token_load(&self, c: &Candidate) -> f64 {
        let tokens = c.in_flight.context_tokens as f64 * (1.0 + self.config.output_ratio);
        1.0 - (tokens / self.config.queue_threshold_tokens).min(1.0)
    }

    fn last_cold(&self, e: EndpointId) -> u64 {
        self.cold_used.get(e.index()).copied().unwrap_or(0)
    }

    /// The no-hit-LRU scores of `candidates` for a cold request: never-used
    /// endpoints first (in candidate order), then by least recent use.
    fn lru_scores(&self, candidates: &[Candidate], out: &mut Vec<f64>) {
        let n = candidates.len();
        out.clear();
        out.resize(n, 1.0);
        if n <= 1 {
            return;
        }
        let mut order: Vec<usize> = (0..n).collect();
        // Never used (0) sort first; ties keep candidate order.
        order.sort_by_key(|&i| self.last_cold(candidates[i].endpoint));
        for (rank, &i) in order.iter().enumerate() {
            out[i] = 1.0 - rank as f64 / (n - 1) as f64;
        }
    }

    fn decide(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<(Choice, Vec<f64>), ScoringError> {
        check(request, candidates)?;
        let cfg = self.config;
        let cold = candidates
            .iter()
            .all(|c| source_blocks(&self.params, request, &c.cached) < 1.0);
        let mut lru = Vec::new();
        if cold {
            self.lru_scores(candidates, &mut lru);
        } else {
            lru.resize(candidates.len(), 0.5);
        }
        let mut best_sticky = f64::INFINITY;
        let mut best_loose = f64::INFINITY;
        let mut sticky_count = 0usize;
        self.kept.clear();
        self.scores.clear();
        for (c, l) in candidates.iter().zip(&lru) {
            let sticky = prefix_score(&self.params, request, c) >= cfg.affinity_threshold;
            let ttft = self.gate_ttft_ms(c);
            if sticky {
                sticky_count += 1;
                best_sticky = best_sticky.min(ttft);
            } else {
                best_loose = best_loose.min(ttft);
            }
            self.kept.push(sticky);
            self.scores
                .push(cfg.token_load_weight * self.token_load(c) + cfg.no_hit_lru_weight * l);
        }
        let applicable = candidates.len() > 1 && cfg.affinity_threshold > 0.0;
        // The exploration draw comes first, as in the filter; only filters
        // that could narrow the set draw.
        let explore = applicable
            && sticky_count > 0
            && cfg.exploration_probability > 0.0
            && unit(rng) < cfg.exploration_probability;
        let reason = if !applicable || sticky_count == 0 {
            Reason::NoStickyEndpoint
        } else if explore {
            Reason::Exploration
        } else if cfg.max_ttft_penalty_ms > 0.0
            && sticky_count < candidates.len()
            && best_sticky - best_loose > cfg.max_ttft_penalty_ms
        {
            Reason::StickinessReleased
        } else {
            Reason::Sticky
        };
        if reason != Reason::Sticky {
            self.kept.iter_mut().for_each(|k| *k = true);
        }
        let kept = &self.kept;
        let (index, tie) = extreme(&self.scores, Better::Higher, |i| kept[i], rng);
        Ok((
            choice(&self.params, request, candidates, index, now, reason, tie),
            lru,
        ))
    }
}

impl Pick for LlmdDefault {
    fn name(&self) -> PolicyName {
        PolicyName::LlmdDefault
    }

    fn propose(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Choice, ScoringError> {
        self.decide(request, candidates, now, rng).map(|(c, _)| c)
    }

    fn propose_explained(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Explanation, ScoringError> {
        let (choice, lru) = self.decide(request, candidates, now, rng)?;
        Ok(explanation(
            PolicyName::LlmdDefault,
            &self.params,
            (request, candidates, now),
            choice,
            &self.scores,
            |i| {
                let c = &candidates[i];
                let prefix = prefix_score(&self.params, request, c);
                ScoreDetail::LlmdDefault {
                    prefix,
                    sticky: prefix >= self.config.affinity_threshold,
                    gate_ttft_ms: self.gate_ttft_ms(c),
                    kept: self.kept[i],
                    token_load: self.token_load(c),
                    no_hit_lru: lru[i],
                }
            },
        ))
    }

    fn remove_endpoint(&mut self, endpoint: EndpointId) {
        if let Some(t) = self.cold_used.get_mut(endpoint.index()) {
            *t = 0;
        }
    }

    /// A request the chosen endpoint had nothing of makes it the most
    /// recently used for cold requests (upstream's no-hit LRU updates on
    /// the requests it routes without a hit).
    fn commit(&mut self, request: &Request, chosen: &Candidate, _choice: &Choice, _now: Duration) {
        self.decisions += 1;
        if source_blocks(&self.params, request, &chosen.cached) >= 1.0 {
            return;
        }
        let id = chosen.endpoint.index();
        if id >= EndpointId::LIMIT as usize {
            return;
        }
        if self.cold_used.len() <= id {
            self.cold_used.resize(id + 1, 0);
        }
        self.cold_used[id] = self.decisions;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::baseline::test_support::{cand, pick};

    fn no_exploration() -> LlmdDefault {
        LlmdDefault::with_config(
            LatencyParams::default(),
            LlmdDefaultConfig {
                exploration_probability: 0.0,
                ..LlmdDefaultConfig::default()
            },
        )
    }

    /// The filter keeps the sticky endpoint however much more token load it
    /// carries (no latency predictor: no gate), as upstream's README says:
    /// "keep only endpoints with prefix cache score >= affinityThreshold".
    #[test]
    fn sticks_to_the_warm_endpoint_whatever_its_load() {
        let mut p = no_exploration();
        let warm = cand(0, 100, 30, 200_000);
        let cold = cand(1, 0, 0, 0);
        let c = pick(&mut p, &[warm, cold], 1);
        assert_eq!((c.endpoint, c.reason), (EndpointId(0), Reason::Sticky));
        // Below the threshold (79 of 100 blocks) nobody is sticky: the lower
        // token load wins.
        let c = pick(&mut p, &[cand(0, 79, 30, 200_000), cold], 1);
        assert_eq!(
            (c.endpoint, c.reason),
            (EndpointId(1), Reason::NoStickyEndpoint)
        );
    }

    /// With the guides' gate: stickiness breaks when the sticky endpoint's
    /// estimated TTFT is more than the penalty above the best other one.
    #[test]
    fn the_optional_gate_releases_stickiness() {
        let mut p = LlmdDefault::with_config(
            LatencyParams::default(),
            LlmdDefaultConfig {
                exploration_probability: 0.0,
                max_ttft_penalty_ms: 5_000.0,
                ..LlmdDefaultConfig::default()
            },
        );
        // 1e9 in-flight tokens at 25k tokens/s: 40,000 s, beyond 5 s.
        let c = pick(
            &mut p,
            &[cand(0, 100, 3, 1_000_000_000), cand(1, 0, 0, 0)],
            1,
        );
        assert_eq!(
            (c.endpoint, c.reason),
            (EndpointId(1), Reason::StickinessReleased)
        );
    }

    /// Cold requests go to the endpoint that took a cold request longest
    /// ago, never-used ones first, even against a small token-load edge
    /// (upstream: "never-used or least-recently-used pods score higher").
    #[test]
    fn cold_requests_rotate_by_least_recent_use() {
        let mut p = no_exploration();
        let cands = [cand(0, 0, 0, 0), cand(1, 0, 0, 0), cand(2, 0, 0, 0)];
        let got: Vec<u32> = (0..6).map(|s| pick(&mut p, &cands, s).endpoint.0).collect();
        assert_eq!(got, [0, 1, 2, 0, 1, 2]);
        // Endpoint 0 is next by LRU although it carries more tokens.
        let loaded = [cand(0, 0, 1, 1000), cand(1, 0, 0, 0), cand(2, 0, 0, 0)];
        assert_eq!(pick(&mut p, &loaded, 9).endpoint, EndpointId(0));
        // A warm request does not touch the LRU order: 1 stays next.
        let warm = [cand(0, 0, 0, 0), cand(1, 0, 0, 0), cand(2, 100, 0, 0)];
        assert_eq!(pick(&mut p, &warm, 9).endpoint, EndpointId(2));
        assert_eq!(pick(&mut p, &cands, 9).endpoint, EndpointId(1));
    }

    #[test]
    fn explores_about_one_percent_of_the_time() {
        let mut p = LlmdDefault::new(LatencyParams::default());
        let cands = [cand(0, 100, 0, 0), cand(1, 0, 0, 0)];
        let explored = (0..5000)
            .filter(|&s| pick(&mut p, &cands, s).reason == Reason::Exploration)
            .count();
        assert!((20..=90).contains(&explored), "{explored}");
    }
}
