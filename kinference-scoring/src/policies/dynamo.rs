//! NVIDIA Dynamo's KV-router cost, with its defaults.
//!
//! Followed from ai-dynamo/dynamo `lib/kv-router/src/scheduling/selector/`
//! (`default.rs`, `DefaultWorkerScorer::worker_logit`, and `mod.rs`,
//! `WorkerSelectionInput::row`) and the active-sequence accounting of
//! `lib/kv-router/src/sequences/` (`WorkerLoadProjection`):
//!
//! ```text
//! raw prefill blocks = (active prefill tokens + prompt tokens) ÷ block
//! overlap credit     = 1.0 × device blocks + 0.75 × host blocks + 0.25 × disk blocks
//! prefill blocks     = max(0, raw prefill blocks − overlap credit)
//! decode blocks      = unique blocks of the active sequences
//!                      + prompt blocks not already among them
//! cost               = prefill_load_scale (1.0) × prefill blocks + decode blocks
//!                      + decode_active_request_weight (0) × active requests
//! ```
//!
//! Lowest cost wins (`router_temperature` 0; a positive one samples a softmax
//! over costs normalised to 0..1); exact ties at random. Active prefill
//! tokens are a request's uncached tokens until its first token
//! (`InFlight::prefill_tokens`); active sequences hold their blocks until
//! they finish, and a block shared by several of them (a common system
//! prompt) counts once.
//!
//! # The de-duplication, estimated
//!
//! Dynamo keeps every active request's block hashes. The inputs a router
//! gives a [`Pick`] carry no block identities, only the in-flight context
//! tokens (each request's prompt counted in full) and this request's cached
//! leading blocks per endpoint. So the policy keeps, per endpoint, a ledger
//! of what it sent there: the raw prompt blocks and the blocks that were new
//! to the endpoint's active set, where a request's blocks count as already
//! active when the endpoint has requests in flight and holds them (its
//! cached leading blocks). The unique active blocks are the in-flight
//! context blocks × the ledger's unique ÷ raw ratio; when requests finish
//! (the in-flight context falls below the ledger), the ledger shrinks in
//! proportion. On a shared-prefix stream this counts a group's system
//! prompt once per endpoint, as Dynamo does; it cannot tell which of the
//! cached blocks belong to requests still running.

use std::time::Duration;

use crate::error::ScoringError;
use crate::input::{CachedBlocks, Candidate, EndpointId, Request};
use crate::pick::{Choice, Explanation, Reason, ScoreDetail, Tie};
use crate::policies::baseline::{Better, choice, explanation, extreme};
use crate::policies::{Pick, PolicyName, check};
use crate::profile::LatencyParams;
use crate::rng::{RandomSource, below, unit};

/// Settings of [`DynamoCost`], Dynamo's defaults
/// (`lib/kv-router/src/scheduling/config.rs`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DynamoConfig {
    /// `prefill_load_scale` (formerly `--kv-overlap-score-weight`), 1.0.
    pub overlap_weight: f64,
    /// `overlap_score_credit` per device (GPU) block, 1.0.
    pub device_credit: f64,
    /// `host_cache_hit_weight`, 0.75.
    pub host_credit: f64,
    /// `disk_cache_hit_weight`, 0.25.
    pub disk_credit: f64,
    /// `decode_active_request_weight`, 0.
    pub active_request_weight: f64,
    /// `router_temperature`, 0: the deterministic minimum.
    pub temperature: f64,
}

impl Default for DynamoConfig {
    fn default() -> Self {
        Self {
            overlap_weight: 1.0,
            device_credit: 1.0,
            host_credit: 0.75,
            disk_credit: 0.25,
            active_request_weight: 0.0,
            temperature: 0.0,
        }
    }
}

/// Per endpoint: what this policy sent there and is still active, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Ledger {
    raw: f64,
    unique: f64,
}

/// Dynamo's cost; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct DynamoCost {
    params: LatencyParams,
    config: DynamoConfig,
    scores: Vec<f64>,
    ledgers: Vec<Ledger>,
}

/// One candidate's terms.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Terms {
    prefill: f64,
    decode: f64,
    /// Prompt blocks new to the endpoint's active set.
    additional: f64,
}

impl DynamoCost {
    /// With Dynamo's defaults.
    pub fn new(params: LatencyParams) -> Self {
        Self::with_config(params, DynamoConfig::default())
    }

    /// With other settings.
    pub fn with_config(params: LatencyParams, config: DynamoConfig) -> Self {
        Self {
            params,
            config,
            scores: Vec::new(),
            ledgers: Vec::new(),
        }
    }

    fn credit(&self, cached: &CachedBlocks) -> f64 {
        let device = f64::from(cached.gpu);
        let host = f64::from(cached.cpu.saturating_sub(cached.gpu));
        let disk = f64::from(cached.disk.saturating_sub(cached.gpu.max(cached.cpu)));
        self.config.device_credit * device
            + self.config.host_credit * host
            + self.config.disk_credit * disk
    }

    /// The ledger of `e` after the requests that finished since it was
    /// last seen: shrunk to the in-flight context.
    fn ledger(&self, c: &Candidate, block: f64) -> Ledger {
        let active = c.in_flight.context_tokens as f64 / block;
        let l = self
            .ledgers
            .get(c.endpoint.index())
            .copied()
            .unwrap_or_default();
        if l.raw > active {
            let keep = if l.raw > 0.0 { active / l.raw } else { 0.0 };
            Ledger {
                raw: active,
                unique: l.unique * keep,
            }
        } else {
            l
        }
    }

    fn terms(&self, request: &Request, c: &Candidate) -> Terms {
        let block = f64::from(request.block_tokens);
        let prompt_blocks = f64::from(request.prompt_tokens) / block;
        let raw = (c.in_flight.prefill_tokens as f64 + f64::from(request.prompt_tokens)) / block;
        let prefill = (raw - self.credit(&c.cached)).max(0.0);
        let active = c.in_flight.context_tokens as f64 / block;
        let l = self.ledger(c, block);
        // Context the ledger never saw (requests sent by someone else)
        // counts in full.
        let unique_active = if l.raw > 0.0 {
            l.unique + (active - l.raw).max(0.0)
        } else {
            active
        };
        let shared = if c.in_flight.requests > 0 {
            f64::from(c.cached.gpu).min(prompt_blocks)
        } else {
            0.0
        };
        let additional = prompt_blocks - shared;
        Terms {
            prefill,
            decode: unique_active + additional,
            additional,
        }
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
        let mut scores = std::mem::take(&mut self.scores);
        scores.clear();
        scores.extend(candidates.iter().map(|c| {
            let t = self.terms(request, c);
            cfg.overlap_weight * t.prefill
                + t.decode
                + cfg.active_request_weight * f64::from(c.in_flight.requests)
        }));
        self.scores = scores;
        let (index, reason, tie) = if cfg.temperature > 0.0 && candidates.len() > 1 {
            (self.softmax(rng), Reason::SoftmaxSample, Tie::None)
        } else {
            let (i, t) = extreme(&self.scores, Better::Lower, |_| true, rng);
            (i, Reason::LowestCost, t)
        };
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

    /// Records the chosen request in its endpoint's ledger.
    fn admit(&mut self, request: &Request, c: &Candidate) {
        let block = f64::from(request.block_tokens);
        let t = self.terms(request, c);
        let mut l = self.ledger(c, block);
        // Blocks already active before the ledger started count as unique.
        if l.raw == 0.0 {
            let active = c.in_flight.context_tokens as f64 / block;
            l = Ledger {
                raw: active,
                unique: active,
            };
        }
        l.raw += f64::from(request.prompt_tokens) / block;
        l.unique += t.additional;
        let i = c.endpoint.index();
        if self.ledgers.len() <= i {
            self.ledgers.resize(i + 1, Ledger::default());
        }
        self.ledgers[i] = l;
    }

    fn softmax(&self, rng: &mut dyn RandomSource) -> usize {
        let t = self.config.temperature;
        let (lo, hi) = self
            .scores
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &s| {
                (lo.min(s), hi.max(s))
            });
        if hi <= lo {
            return below(rng, self.scores.len());
        }
        let weight = |s: f64| (-(s - lo) / (hi - lo) / t).exp();
        let total: f64 = self.scores.iter().map(|&s| weight(s)).sum();
        let mut x = unit(rng) * total;
        for (i, &s) in self.scores.iter().enumerate() {
            x -= weight(s);
            if x < 0.0 {
                return i;
            }
        }
        self.scores.len() - 1
    }
}

impl Pick for DynamoCost {
    fn name(&self) -> PolicyName {
        PolicyName::DynamoCost
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
        // Terms as the decision saw them, before it admitted the request.
        let terms: Vec<Terms> = candidates.iter().map(|c| self.terms(request, c)).collect();
        let choice = self.decide(request, candidates, now, rng)?;
        Ok(explanation(
            PolicyName::DynamoCost,
            &self.params,
            (request, candidates, now),
            choice,
            &self.scores,
            |i| ScoreDetail::DynamoCost {
                prefill_blocks: terms[i].prefill,
                decode_blocks: terms[i].decode,
            },
        ))
    }

    fn remove_endpoint(&mut self, endpoint: EndpointId) {
        if let Some(l) = self.ledgers.get_mut(endpoint.index()) {
            *l = Ledger::default();
        }
    }

    /// Records the request in its endpoint's ledger of active blocks.
    fn commit(&mut self, request: &Request, chosen: &Candidate, _choice: &Choice, _now: Duration) {
        if chosen.endpoint.0 < EndpointId::LIMIT {
            self.admit(request, chosen);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::InFlight;
    use crate::policies::baseline::test_support::{cand, pick, request};
    use crate::rng::SplitMix64;

    fn explain(p: &mut DynamoCost, cands: &[Candidate]) -> Explanation {
        p.pick_explained(
            &request(),
            cands,
            Duration::from_secs(1),
            &mut SplitMix64::new(1),
        )
        .expect("valid input")
    }

    /// The formula on one decision: a: 60 of 100 blocks cached, 40 active
    /// prefill blocks, 300 active context blocks seen by nobody else:
    /// prefill = 40 + 100 − 60 = 80, decode = 300 + (100 − 60 shared) = 340,
    /// cost 420; b: cold and idle: 100 + 100 = 200.
    #[test]
    fn matches_the_upstream_formula() {
        let mut p = DynamoCost::new(LatencyParams::default());
        let a = Candidate {
            in_flight: InFlight {
                context_tokens: 4800,
                ..cand(0, 60, 2, 640).in_flight
            },
            ..cand(0, 60, 2, 640)
        };
        let b = cand(1, 0, 0, 0);
        let e = explain(&mut p, &[a, b]);
        assert!(
            (e.candidates[0].score - 420.0).abs() < 1e-9,
            "{}",
            e.candidates[0].score
        );
        assert!((e.candidates[1].score - 200.0).abs() < 1e-9);
        assert_eq!(e.choice.endpoint, EndpointId(1));
    }

    /// Upstream's active-sequence accounting counts a block shared by active
    /// requests once: five requests of one 100-block system prompt on one
    /// endpoint are ~100 active blocks, not 500, so a sixth stays there
    /// instead of moving to an idle cold endpoint (cost 200).
    #[test]
    fn shared_blocks_of_active_sequences_count_once() {
        let mut p = DynamoCost::new(LatencyParams::default());
        let idle = cand(1, 0, 0, 0);
        // The first one, where it is the only candidate.
        assert_eq!(pick(&mut p, &[cand(0, 0, 0, 0)], 1).endpoint, EndpointId(0));
        for n in 1..=5u32 {
            // The router's view after n requests of the same prompt went to
            // endpoint 0: all cached there, n in flight, n × 1,600 context.
            let warm = Candidate {
                in_flight: InFlight {
                    requests: n,
                    decoding: n,
                    prefill_tokens: 0,
                    context_tokens: u64::from(n) * 1600,
                },
                ..cand(0, 100, n, 0)
            };
            let e = explain(&mut p, &[warm, idle]);
            assert_eq!(e.choice.endpoint, EndpointId(0), "request {n}");
            // prefill 0, decode ≈ 100 unique + 0 new.
            assert!(
                e.candidates[0].score < 101.0,
                "{n}: {}",
                e.candidates[0].score
            );
        }
        // Requests finish: the ledger follows the in-flight context down.
        let drained = Candidate {
            in_flight: InFlight::default(),
            ..cand(0, 100, 0, 0)
        };
        let e = explain(&mut p, &[drained, idle]);
        assert!(
            (e.candidates[0].score - 100.0).abs() < 1e-9,
            "{}",
            e.candidates[0].score
        );
    }

    #[test]
    fn a_positive_temperature_samples() {
        let mut p = DynamoCost::with_config(
            LatencyParams::default(),
            DynamoConfig {
                temperature: 1.0,
                ..DynamoConfig::default()
            },
        );
        let a = cand(0, 60, 2, 640);
        let b = cand(1, 0, 0, 0);
        let zeros = (0..200)
            .filter(|&s| pick(&mut p, &[a, b], s).endpoint.0 == 0)
            .count();
        assert!(zeros > 10 && zeros < 190, "{zeros}");
    }
}
