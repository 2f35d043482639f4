//! SGLang's router `cache_aware` policy, with its defaults.
//!
//! Followed from sgl-project/sglang's router (`sgl-router`, now
//! `sgl-model-gateway`, `src/policies/cache_aware.rs`; the `smg launch`
//! defaults: `--cache-threshold 0.3`, `--balance-abs-threshold 64`,
//! `--balance-rel-threshold 1.5`, `--max-tree-size 67108864`):
//!
//! 1. Load is the router's own count of requests running on each worker.
//!    If `max − min > 64` and `max > 1.5 × min`, the least loaded worker.
//! 2. Else the worker whose tree matches the longest prefix of the request,
//!    if the match rate (matched ÷ request length) exceeds 0.3;
//! 3. else the worker with the smallest tree.
//! 4. Whatever the branch, the request's text is inserted into the chosen
//!    worker's tree: the tree grows on route, before any answer.
//!
//! Here the tree's match is the request's cache estimate (with the router
//! in `approximate` tokenization mode that is its record of the prefixes
//! it routed, grown on route exactly like SGLang's text tree; with an index
//! it is what the engines reported), and the policy keeps each worker's
//! tree size itself: on every decision the chosen endpoint's grows by the
//! request's tokens it had not matched. Trees shrink only by SGLang's
//! eviction to `max_tree_size` characters (about 16M tokens here, at four
//! characters a token), which no benchmark run reaches.

use std::time::Duration;

use crate::error::ScoringError;
use crate::input::{Candidate, EndpointId, Request};
use crate::latency::cached_tokens;
use crate::pick::{Choice, Explanation, Reason, ScoreDetail};
use crate::policies::baseline::{Better, choice, explanation, extreme};
use crate::policies::{Pick, PolicyName, check};
use crate::profile::LatencyParams;
use crate::rng::RandomSource;

/// Settings of [`SglangCacheAware`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SglangConfig {
    /// Match rate above which the longest match wins (0.3).
    pub cache_threshold: f64,
    /// Load imbalance needs `max − min` above this (64).
    pub balance_abs_threshold: u32,
    /// ... and `max` above this multiple of `min` (1.5).
    pub balance_rel_threshold: f64,
    /// Tree size, in tokens, beyond which a worker's tree is cut back to it
    /// (SGLang's 67,108,864 characters at four characters a token).
    pub max_tree_tokens: f64,
}

impl Default for SglangConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            max_tree_tokens: 67_108_864.0 / 4.0,
        }
    }
}

/// SGLang's cache-aware policy; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct SglangCacheAware {
    params: LatencyParams,
    config: SglangConfig,
    scores: Vec<f64>,
    /// Per endpoint id: tokens in its tree.
    trees: Vec<f64>,
}

impl SglangCacheAware {
    /// With SGLang's defaults.
    pub fn new(params: LatencyParams) -> Self {
        Self::with_config(params, SglangConfig::default())
    }

    /// With other settings.
    pub fn with_config(params: LatencyParams, config: SglangConfig) -> Self {
        Self {
            params,
            config,
            scores: Vec::new(),
            trees: Vec::new(),
        }
    }

    fn matched(&self, request: &Request, c: &Candidate) -> f64 {
        cached_tokens(&self.params, request, &c.cached).min(f64::from(request.prompt_tokens))
    }

    fn match_rate(&self, request: &Request, c: &Candidate) -> f64 {
        if request.prompt_tokens == 0 {
            return 0.0;
        }
        self.matched(request, c) / f64::from(request.prompt_tokens)
    }

    fn tree(&self, e: EndpointId) -> f64 {
        self.trees.get(e.index()).copied().unwrap_or(0.0)
    }

    fn decide(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Choice, ScoringError> {
        check(request, candidates)?;
        let cfg = self.config;
        let (lo, hi) = candidates
            .iter()
            .map(|c| c.in_flight.requests)
            .fold((u32::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        let imbalanced = hi - lo > cfg.balance_abs_threshold
            && f64::from(hi) > cfg.balance_rel_threshold * f64::from(lo);
        let mut scores = std::mem::take(&mut self.scores);
        scores.clear();
        let (index, tie, reason) = if imbalanced {
            scores.extend(candidates.iter().map(|c| f64::from(c.in_flight.requests)));
            let (i, t) = extreme(&scores, Better::Lower, |_| true, rng);
            (i, t, Reason::LoadImbalance)
        } else {
            scores.extend(candidates.iter().map(|c| self.match_rate(request, c)));
            let best = scores.iter().copied().fold(0.0, f64::max);
            if best > cfg.cache_threshold {
                let (i, t) = extreme(&scores, Better::Higher, |_| true, rng);
                (i, t, Reason::LongestPrefixMatch)
            } else {
                scores.clear();
                scores.extend(candidates.iter().map(|c| self.tree(c.endpoint)));
                let (i, t) = extreme(&scores, Better::Lower, |_| true, rng);
                (i, t, Reason::SmallestCache)
            }
        };
        self.scores = scores;
        Ok(choice(
            &self.params,
            request,
            candidates,
            index,
            now,
            reason,
            tie,
        ))
    }
}

impl Pick for SglangCacheAware {
    fn name(&self) -> PolicyName {
        PolicyName::SglangCacheAware
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
        let trees: Vec<f64> = candidates.iter().map(|c| self.tree(c.endpoint)).collect();
        let choice = self.decide(request, candidates, now, rng)?;
        Ok(explanation(
            PolicyName::SglangCacheAware,
            &self.params,
            (request, candidates, now),
            choice,
            &self.scores,
            |i| {
                let c = &candidates[i];
                ScoreDetail::SglangCacheAware {
                    load: c.in_flight.requests,
                    match_rate: self.match_rate(request, c),
                    footprint: trees[i],
                }
            },
        ))
    }

    /// Grows the chosen worker's tree by what it did not match: upstream
    /// inserts every routed request's text, before any answer.
    fn commit(&mut self, request: &Request, chosen: &Candidate, _choice: &Choice, _now: Duration) {
        let grown = f64::from(request.prompt_tokens) - self.matched(request, chosen);
        let id = chosen.endpoint.index();
        if id >= EndpointId::LIMIT as usize {
            return;
        }
        if self.trees.len() <= id {
            self.trees.resize(id + 1, 0.0);
        }
        self.trees[id] = (self.trees[id] + grown).min(self.config.max_tree_tokens);
    }

    fn remove_endpoint(&mut self, endpoint: EndpointId) {
        if let Some(t) = self.trees.get_mut(endpoint.index()) {
            *t = 0.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::baseline::test_support::{cand, pick};

    #[test]
    fn balances_then_matches() {
        let mut p = SglangCacheAware::new(LatencyParams::default());
        let busy_warm = cand(0, 100, 200, 0);
        let idle = cand(1, 0, 10, 0);
        let c = pick(&mut p, &[busy_warm, idle], 1);
        assert_eq!(
            (c.endpoint, c.reason),
            (EndpointId(1), Reason::LoadImbalance)
        );
        let warm = cand(0, 50, 20, 0);
        let c = pick(&mut p, &[warm, idle], 1);
        assert_eq!(
            (c.endpoint, c.reason),
            (EndpointId(0), Reason::LongestPrefixMatch)
        );
    }

    /// Upstream inserts every routed request into the chosen worker's tree,
    /// so cold requests fill the smallest tree: after one cold request went
    /// to endpoint 0 (tree 1,600 tokens), the next cold one goes to 1, then
    /// a request matching 0's tree by half still goes to 0, growing it by
    /// the unmatched 800.
    #[test]
    fn the_tree_grows_on_route_and_cold_requests_fill_the_smallest() {
        let mut p = SglangCacheAware::new(LatencyParams::default());
        let cold = [cand(0, 0, 0, 0), cand(1, 0, 0, 0)];
        let first = pick(&mut p, &cold, 1).endpoint;
        let second = pick(&mut p, &cold, 1);
        assert_ne!(second.endpoint, first);
        assert_eq!(second.reason, Reason::SmallestCache);
        let (a, b) = (first.index(), second.endpoint.index());
        assert!((p.trees[a] - 1600.0).abs() < 1e-9 && (p.trees[b] - 1600.0).abs() < 1e-9);
        let mut half = cold;
        half[a].cached.gpu = 50;
        assert_eq!(pick(&mut p, &half, 1).endpoint, first);
        assert!((p.trees[a] - 2400.0).abs() < 1e-9, "{}", p.trees[a]);
        // The next cold request takes the smaller tree.
        assert_eq!(pick(&mut p, &cold, 7).endpoint, second.endpoint);
    }
}
