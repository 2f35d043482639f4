//! Baseline policies for the benchmark harness, re-implemented from their
//! projects' public descriptions.

use std::time::Duration;

use crate::error::ScoringError;
use crate::input::{Candidate, Request};
use crate::latency::{cached_tokens, predict, source_blocks};
use crate::pick::{CandidateExplanation, Choice, Explanation, Reason, ScoreDetail, Tie};
use crate::policies::{Pick, PolicyName, check, millis};
use crate::profile::LatencyParams;
use crate::rng::{RandomSource, below, unit};

/// Which way a score is better.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Better {
    Lower,
    Higher,
}

/// The best of `scores` among those `keep` allows, exact ties broken by the
/// seeded RNG. `keep` must allow at least one index.
fn extreme(
    scores: &[f64],
    better: Better,
    keep: impl Fn(usize) -> bool,
    rng: &mut dyn RandomSource,
) -> (usize, Tie) {
    let mut best = match better {
        Better::Lower => f64::INFINITY,
        Better::Higher => f64::NEG_INFINITY,
    };
    let mut count = 0usize;
    for (i, &s) in scores.iter().enumerate() {
        if !keep(i) {
            continue;
        }
        let improves = match better {
            Better::Lower => s < best,
            Better::Higher => s > best,
        };
        if improves || count == 0 {
            best = s;
            count = 1;
        } else if s.total_cmp(&best).is_eq() {
            count += 1;
        }
    }
    let mut skip = if count > 1 { below(rng, count) } else { 0 };
    let mut chosen = 0;
    for (i, &s) in scores.iter().enumerate() {
        if keep(i) && s.total_cmp(&best).is_eq() {
            if skip == 0 {
                chosen = i;
                break;
            }
            skip -= 1;
        }
    }
    let tie = if count > 1 {
        Tie::Random {
            among: count as u32,
        }
    } else {
        Tie::None
    };
    (chosen, tie)
}

/// kinference's prediction for the chosen candidate, uncalibrated: what the
/// router needs for its in-flight accounting under any policy.
fn choice(
    params: &LatencyParams,
    request: &Request,
    candidates: &[Candidate],
    index: usize,
    now: Duration,
    reason: Reason,
    tie: Tie,
) -> Choice {
    let c = &candidates[index];
    Choice {
        endpoint: c.endpoint,
        index,
        prediction: predict(params, request, c, None, now),
        reason,
        tie,
    }
}

/// Explain a baseline's decision: `scores` and `detail` are its own terms
/// per candidate; the prediction is kinference's, uncalibrated.
fn explanation(
    policy: PolicyName,
    params: &LatencyParams,
    (request, candidates, now): (&Request, &[Candidate], Duration),
    choice: Choice,
    scores: &[f64],
    detail: impl Fn(usize) -> ScoreDetail,
) -> Explanation {
    let candidates = candidates
        .iter()
        .zip(scores)
        .enumerate()
        .map(|(i, (c, &score))| CandidateExplanation {
            inputs: *c,
            prediction: predict(params, request, c, None, now),
            score,
            detail: detail(i),
        })
        .collect();
    Explanation {
        policy,
        now_ms: millis(now),
        request: *request,
        choice,
        candidates,
    }
}

/// Fresh scraped figures, if any.
fn fresh_metrics<'a>(
    params: &LatencyParams,
    c: &'a Candidate,
) -> Option<&'a crate::input::EngineMetrics> {
    c.engine.as_ref().filter(|m| m.age < params.metrics_max_age)
}

/// Full blocks of the prompt and the cached fraction of them (llm-d's prefix
/// score: matched ÷ total blocks, 0 for a prompt shorter than a block).
fn prefix_score(params: &LatencyParams, request: &Request, c: &Candidate) -> f64 {
    let total = request.prompt_tokens / request.block_tokens;
    if total == 0 {
        return 0.0;
    }
    (source_blocks(params, request, &c.cached) / f64::from(total)).min(1.0)
}

// ---------------------------------------------------------------------------

/// Round robin over the candidate slice: the k-th committed decision takes
/// index `k mod len`.
#[derive(Debug, Clone)]
pub struct RoundRobin {
    params: LatencyParams,
    next: u64,
}

impl RoundRobin {
    /// A rotation starting at index 0.
    pub fn new(params: LatencyParams) -> Self {
        Self { params, next: 0 }
    }

    fn decide(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
    ) -> Result<Choice, ScoringError> {
        check(request, candidates)?;
        let index = (self.next % candidates.len() as u64) as usize;
        Ok(choice(
            &self.params,
            request,
            candidates,
            index,
            now,
            Reason::Rotation,
            Tie::None,
        ))
    }
}

impl Pick for RoundRobin {
    fn name(&self) -> PolicyName {
        PolicyName::RoundRobin
    }

    fn propose(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        _rng: &mut dyn RandomSource,
    ) -> Result<Choice, ScoringError> {
        self.decide(request, candidates, now)
    }

    fn propose_explained(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        _rng: &mut dyn RandomSource,
    ) -> Result<Explanation, ScoringError> {
        let choice = self.decide(request, candidates, now)?;
        let scores: Vec<f64> = (0..candidates.len())
            .map(|i| if i == choice.index { 0.0 } else { 1.0 })
            .collect();
        Ok(explanation(
            PolicyName::RoundRobin,
            &self.params,
            (request, candidates, now),
            choice,
            &scores,
            |i| ScoreDetail::RoundRobin { position: i },
        ))
    }

    fn commit(&mut self, _request: &Request, _choice: &Choice, _now: Duration) {
        self.next = self.next.wrapping_add(1);
    }
}

// ---------------------------------------------------------------------------

/// Fewest requests in flight (the router's own accounting); ties at random.
#[derive(Debug, Clone)]
pub struct LeastInflight {
    params: LatencyParams,
    scores: Vec<f64>,
}

impl LeastInflight {
    /// The policy.
    pub fn new(params: LatencyParams) -> Self {
        Self {
            params,
            scores: Vec::new(),
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
        self.scores.clear();
        self.scores
            .extend(candidates.iter().map(|c| f64::from(c.in_flight.requests)));
        let (index, tie) = extreme(&self.scores, Better::Lower, |_| true, rng);
        Ok(choice(
            &self.params,
            request,
            candidates,
            index,
            now,
            Reason::FewestInFlight,
            tie,
        ))
    }
}

impl Pick for LeastInflight {
    fn name(&self) -> PolicyName {
        PolicyName::LeastInflight
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
        Ok(explanation(
            PolicyName::LeastInflight,
            &self.params,
            (request, candidates, now),
            choice,
            &self.scores,
            |i| ScoreDetail::LeastInflight {
                requests: candidates[i].in_flight.requests,
            },
        ))
    }
}

// ---------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------

/// Settings of [`LlmdDefault`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlmdDefaultConfig {
    /// Prefix score at or above which an endpoint is sticky (llm-d: 0.80).
    pub affinity_threshold: f64,
    /// Break stickiness when the best sticky endpoint's gate TTFT exceeds the
    /// best non-sticky one's by more than this; 0 = always stick (llm-d code
    /// default: 18,000 ms).
    pub max_ttft_penalty_ms: f64,
    /// Peak prefill throughput for the gate's TTFT estimate, tokens/s (llm-d
    /// default 15,928, measured for Qwen 32B on 2 × H100); `None` takes the
    /// profile's `prefill_tokens_per_second`, the same knowledge ours has.
    pub peak_prefill_tokens_per_second: Option<f64>,
    /// Token-load scorer normalisation (llm-d: 4,194,304 tokens).
    pub queue_threshold_tokens: f64,
}

impl Default for LlmdDefaultConfig {
    fn default() -> Self {
        Self {
            affinity_threshold: 0.80,
            max_ttft_penalty_ms: 18_000.0,
            peak_prefill_tokens_per_second: None,
            queue_threshold_tokens: 4_194_304.0,
        }
    }
}

/// llm-d's newer default ("sticky until saturated"): the
/// `prefix-cache-affinity-filter` then the `token-load-scorer` with a
/// max-score picker (llm-d-router, 2026).
///
/// 1. Sticky = prefix score ≥ `affinity_threshold`. No sticky endpoint: keep
///    all.
/// 2. TTFT gate: each endpoint's TTFT is estimated as in-flight tokens ÷ peak
///    prefill throughput; if the best sticky one exceeds the best non-sticky
///    one by more than `max_ttft_penalty_ms`, keep all; else keep the sticky.
/// 3. Among the kept, the highest token-load score `1 − min(1, tokens ÷
///    threshold)` wins, where tokens = in-flight uncached tokens + this
///    request's tokens the endpoint has not cached; ties at random.
///
/// In-flight tokens are the router's `InFlight::prefill_tokens` (uncached
/// tokens whose first token has not arrived). Exploration (llm-d's
/// `explorationProbability`) defaults to 0 there and is not implemented.
#[derive(Debug, Clone)]
pub struct LlmdDefault {
    params: LatencyParams,
    config: LlmdDefaultConfig,
    scores: Vec<f64>,
    kept: Vec<bool>,
}

impl LlmdDefault {
    /// With llm-d's defaults (peak throughput from the profile).
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
        }
    }

    fn gate_ttft_ms(&self, c: &Candidate) -> f64 {
        let peak = self
            .config
            .peak_prefill_tokens_per_second
            .unwrap_or(self.params.prefill_tokens_per_second);
        c.in_flight.prefill_tokens as f64 / peak * 1e3
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
        let mut best_sticky = f64::INFINITY;
        let mut best_loose = f64::INFINITY;
        let mut sticky_count = 0usize;
        self.kept.clear();
        self.scores.clear();
        for c in candidates {
            let sticky = prefix_score(&self.params, request, c) >= cfg.affinity_threshold;
            let ttft = self.gate_ttft_ms(c);
            if sticky {
                sticky_count += 1;
                best_sticky = best_sticky.min(ttft);
            } else {
                best_loose = best_loose.min(ttft);
            }
            self.kept.push(sticky);
            let own =
                f64::from(request.prompt_tokens) - cached_tokens(&self.params, request, &c.cached);
            let tokens = c.in_flight.prefill_tokens as f64 + own.max(0.0);
            self.scores
                .push(1.0 - (tokens / cfg.queue_threshold_tokens).min(1.0));
        }
        let applicable = candidates.len() > 1 && cfg.affinity_threshold > 0.0;
        let reason = if !applicable || sticky_count == 0 {
            Reason::NoStickyEndpoint
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
                }
            },
        ))
    }
}

// ---------------------------------------------------------------------------

/// Settings of [`DynamoCost`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DynamoConfig {
    /// `--kv-overlap-score-weight` (Dynamo default 1).
    pub overlap_weight: f64,
    /// `--router-temperature` (Dynamo default 0: deterministic minimum).
    pub temperature: f64,
}

impl Default for DynamoConfig {
    fn default() -> Self {
        Self {
            overlap_weight: 1.0,
            temperature: 0.0,
        }
    }
}

/// NVIDIA Dynamo's KV-router cost (docs/router/kv_cache_routing.md, "Cost
/// Calculation"):
///
/// ```text
/// prefill blocks = max(prompt blocks + active prefill blocks − cached blocks, 0)
/// decode blocks  = active context blocks + prompt blocks
/// cost           = overlap weight × prefill blocks + decode blocks
/// ```
///
/// Lowest cost wins, ties at random; at a positive temperature the pick is a
/// softmax sample over costs normalised to 0..1. Active prefill blocks come
/// from `InFlight::prefill_tokens`, active context blocks from
/// `InFlight::context_tokens`; cached blocks are the tier-credited count.
#[derive(Debug, Clone)]
pub struct DynamoCost {
    params: LatencyParams,
    config: DynamoConfig,
    scores: Vec<f64>,
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
        }
    }

    fn terms(&self, request: &Request, c: &Candidate) -> (f64, f64) {
        let block = f64::from(request.block_tokens);
        let prompt_blocks = f64::from(request.prompt_tokens) / block;
        let active_prefill = c.in_flight.prefill_tokens as f64 / block;
        let cached = source_blocks(&self.params, request, &c.cached);
        let prefill = (prompt_blocks + active_prefill - cached).max(0.0);
        let decode = c.in_flight.context_tokens as f64 / block + prompt_blocks;
        (prefill, decode)
    }

    fn decide(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Choice, ScoringError> {
        check(request, candidates)?;
        let w = self.config.overlap_weight;
        let mut scores = std::mem::take(&mut self.scores);
        scores.clear();
        scores.extend(candidates.iter().map(|c| {
            let (prefill, decode) = self.terms(request, c);
            w * prefill + decode
        }));
        self.scores = scores;
        let t = self.config.temperature;
        if t > 0.0 && candidates.len() > 1 {
            let (lo, hi) = self
                .scores
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &s| {
                    (lo.min(s), hi.max(s))
                });
            let index = if hi > lo {
                let weight = |s: f64| (-(s - lo) / (hi - lo) / t).exp();
                let total: f64 = self.scores.iter().map(|&s| weight(s)).sum();
                let mut x = unit(rng) * total;
                let mut index = candidates.len() - 1;
                for (i, &s) in self.scores.iter().enumerate() {
                    x -= weight(s);
                    if x < 0.0 {
                        index = i;
                        break;
                    }
                }
                index
            } else {
                below(rng, candidates.len())
            };
            return Ok(choice(
                &self.params,
                request,
                candidates,
                index,
                now,
                Reason::SoftmaxSample,
                Tie::None,
            ));
        }
        let (index, tie) = extreme(&self.scores, Better::Lower, |_| true, rng);
        Ok(choice(
            &self.params,
            request,
            candidates,
            index,
            now,
            Reason::LowestCost,
            tie,
        ))
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
        let choice = self.decide(request, candidates, now, rng)?;
        Ok(explanation(
            PolicyName::DynamoCost,
            &self.params,
            (request, candidates, now),
            choice,
            &self.scores,
            |i| {
                let (prefill_blocks, decode_blocks) = self.terms(request, &candidates[i]);
                ScoreDetail::DynamoCost {
                    prefill_blocks,
                    decode_blocks,
                }
            },
        ))
    }
}

// ---------------------------------------------------------------------------

/// Settings of [`SglangCacheAware`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SglangConfig {
    /// Match rate above which the longest match wins (sgl-router: 0.3).
    pub cache_threshold: f64,
    /// Load imbalance needs `max − min` above this (sgl-router: 64).
    pub balance_abs_threshold: u32,
    /// ... and `max` above this multiple of `min` (sgl-router: 1.5).
    pub balance_rel_threshold: f64,
}

impl Default for SglangConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
        }
    }
}

/// SGLang router's `cache_aware` policy: if the load (requests in flight) is
/// imbalanced — `max − min > abs` and `max > rel × min` — the least loaded;
/// else the longest prefix match if its rate exceeds `cache_threshold`; else
/// the endpoint with the smallest cache ("smallest tree").
///
/// Match rate is the tier-credited cached fraction of the prompt (SGLang
/// matches characters in its own approximate tree). The tree size is
/// approximated by scraped KV usage when every candidate has fresh metrics,
/// else by in-flight context tokens.
#[derive(Debug, Clone)]
pub struct SglangCacheAware {
    params: LatencyParams,
    config: SglangConfig,
    scores: Vec<f64>,
}

impl SglangCacheAware {
    /// With sgl-router's defaults.
    pub fn new(params: LatencyParams) -> Self {
        Self::with_config(params, SglangConfig::default())
    }

    /// With other settings.
    pub fn with_config(params: LatencyParams, config: SglangConfig) -> Self {
        Self {
            params,
            config,
            scores: Vec::new(),
        }
    }

    fn match_rate(&self, request: &Request, c: &Candidate) -> f64 {
        if request.prompt_tokens == 0 {
            return 0.0;
        }
        cached_tokens(&self.params, request, &c.cached) / f64::from(request.prompt_tokens)
    }

    fn footprint(&self, c: &Candidate, by_usage: bool) -> f64 {
        if by_usage {
            fresh_metrics(&self.params, c)
                .map_or(0.0, |m| if m.kv_usage.is_nan() { 0.0 } else { m.kv_usage })
        } else {
            c.in_flight.context_tokens as f64
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
        let (lo, hi) = candidates
            .iter()
            .map(|c| c.in_flight.requests)
            .fold((u32::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        let imbalanced = hi - lo > cfg.balance_abs_threshold
            && f64::from(hi) > cfg.balance_rel_threshold * f64::from(lo);
        self.scores.clear();
        let (index, tie, reason) = if imbalanced {
            self.scores
                .extend(candidates.iter().map(|c| f64::from(c.in_flight.requests)));
            let (i, t) = extreme(&self.scores, Better::Lower, |_| true, rng);
            (i, t, Reason::LoadImbalance)
        } else {
            let mut scores = std::mem::take(&mut self.scores);
            scores.extend(candidates.iter().map(|c| self.match_rate(request, c)));
            self.scores = scores;
            let best = self.scores.iter().copied().fold(0.0, f64::max);
            if best > cfg.cache_threshold {
                let (i, t) = extreme(&self.scores, Better::Higher, |_| true, rng);
                (i, t, Reason::LongestPrefixMatch)
            } else {
                let by_usage = candidates
                    .iter()
                    .all(|c| fresh_metrics(&self.params, c).is_some());
                let mut scores = std::mem::take(&mut self.scores);
                scores.clear();
                scores.extend(candidates.iter().map(|c| self.footprint(c, by_usage)));
                self.scores = scores;
                let (i, t) = extreme(&self.scores, Better::Lower, |_| true, rng);
                (i, t, Reason::SmallestCache)
            }
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
        let choice = self.decide(request, candidates, now, rng)?;
        let by_usage = candidates
            .iter()
            .all(|c| fresh_metrics(&self.params, c).is_some());
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
                    footprint: self.footprint(c, by_usage),
                }
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::{CacheSource, CachedBlocks, EndpointId, EngineMetrics, InFlight};
    use crate::rng::SplitMix64;

    fn request() -> Request {
        Request {
            prompt_tokens: 1600,
            block_tokens: 16,
            cache: CacheSource::Index,
        }
    }

    fn cand(id: u32, gpu: u32, requests: u32, prefill_tokens: u64) -> Candidate {
        Candidate {
            endpoint: EndpointId(id),
            cached: CachedBlocks {
                gpu,
                cpu: 0,
                disk: 0,
            },
            in_flight: InFlight {
                requests,
                decoding: 0,
                prefill_tokens,
                context_tokens: prefill_tokens,
            },
            engine: None,
        }
    }

    fn pick(p: &mut dyn Pick, cands: &[Candidate], seed: u64) -> Choice {
        p.pick(
            &request(),
            cands,
            Duration::from_secs(1),
            &mut SplitMix64::new(seed),
        )
        .unwrap()
    }

    #[test]
    fn round_robin_rotates() {
        let mut p = RoundRobin::new(LatencyParams::default());
        let cands: Vec<_> = (0..3).map(|i| cand(i, 0, 0, 0)).collect();
        let got: Vec<u32> = (0..6).map(|s| pick(&mut p, &cands, s).endpoint.0).collect();
        assert_eq!(got, [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn least_inflight_takes_the_fewest_and_breaks_ties_by_seed() {
        let mut p = LeastInflight::new(LatencyParams::default());
        let cands = [
            cand(0, 0, 5, 0),
            cand(1, 100, 2, 0),
            cand(2, 0, 2, 0),
            cand(3, 0, 9, 0),
        ];
        let mut seen = [false; 4];
        for seed in 0..50 {
            let c = pick(&mut p, &cands, seed);
            assert_eq!(c.reason, Reason::FewestInFlight);
            assert_eq!(c.tie, Tie::Random { among: 2 });
            seen[c.index] = true;
        }
        assert_eq!(seen, [false, true, true, false]);
    }

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

    #[test]
    fn llmd_default_sticks_until_the_gate_releases() {
        let mut p = LlmdDefault::new(LatencyParams::default());
        // Warm (prefix 1.0 ≥ 0.8) with more in-flight tokens than the cold one.
        let warm = cand(0, 100, 3, 20_000);
        let cold = cand(1, 0, 0, 0);
        let c = pick(&mut p, &[warm, cold], 1);
        assert_eq!((c.endpoint, c.reason), (EndpointId(0), Reason::Sticky));
        // 1e9 in-flight tokens = 40,000 s at 25k tokens/s: beyond 18 s.
        let swamped = cand(0, 100, 3, 1_000_000_000);
        let c = pick(&mut p, &[swamped, cold], 1);
        assert_eq!(
            (c.endpoint, c.reason),
            (EndpointId(1), Reason::StickinessReleased)
        );
        // Nobody sticky: fewest in-flight tokens incl. this request's own.
        let half = cand(0, 50, 0, 0);
        let c = pick(&mut p, &[half, cand(1, 0, 0, 100)], 1);
        assert_eq!(
            (c.endpoint, c.reason),
            (EndpointId(0), Reason::NoStickyEndpoint)
        );
    }

    #[test]
    fn dynamo_cost_matches_the_formula() {
        let mut p = DynamoCost::new(LatencyParams::default());
        // prompt 100 blocks. a: cached 60, 40 active prefill blocks, 300
        // context blocks: 80 + 400 = 480. b: cold, idle: 100 + 100 = 200.
        let a = cand(0, 60, 2, 640);
        let a = Candidate {
            in_flight: InFlight {
                context_tokens: 4800,
                ..a.in_flight
            },
            ..a
        };
        let b = cand(1, 0, 0, 0);
        let e = p
            .pick_explained(
                &request(),
                &[a, b],
                Duration::from_secs(1),
                &mut SplitMix64::new(1),
            )
            .unwrap();
        assert!(
            (e.candidates[0].score - 480.0).abs() < 1e-9,
            "{}",
            e.candidates[0].score
        );
        assert!((e.candidates[1].score - 200.0).abs() < 1e-9);
        assert_eq!(e.choice.endpoint, EndpointId(1));
        // At a positive temperature both get picked sometimes.
        let mut p = DynamoCost::with_config(
            LatencyParams::default(),
            DynamoConfig {
                overlap_weight: 1.0,
                temperature: 1.0,
            },
        );
        let picks: Vec<u32> = (0..200)
            .map(|s| pick(&mut p, &[a, b], s).endpoint.0)
            .collect();
        let zeros = picks.iter().filter(|&&e| e == 0).count();
        assert!(zeros > 10 && zeros < 100, "{zeros}");
    }

    #[test]
    fn sglang_balances_then_matches_then_fills_the_emptiest() {
        let mut p = SglangCacheAware::new(LatencyParams::default());
        let busy_warm = cand(0, 100, 200, 0);
        let idle = cand(1, 0, 10, 0);
        assert_eq!(
            pick(&mut p, &[busy_warm, idle], 1).reason,
            Reason::LoadImbalance
        );
        assert_eq!(pick(&mut p, &[busy_warm, idle], 1).endpoint, EndpointId(1));
        let warm = cand(0, 50, 20, 0);
        let c = pick(&mut p, &[warm, idle], 1);
        assert_eq!(
            (c.endpoint, c.reason),
            (EndpointId(0), Reason::LongestPrefixMatch)
        );
        let small = cand(0, 10, 20, 5_000);
        let c = pick(&mut p, &[small, cand(1, 0, 10, 100)], 1);
        assert_eq!(
            (c.endpoint, c.reason),
            (EndpointId(1), Reason::SmallestCache)
        );
    }

    #[test]
    fn every_baseline_reports_the_uncalibrated_prediction() {
        let cands = [cand(0, 20, 1, 300), cand(1, 0, 0, 0)];
        for name in PolicyName::ALL {
            let mut p = crate::Policy::new(name, LatencyParams::default());
            let c = pick(&mut p, &cands, 3);
            let want = predict(
                &LatencyParams::default(),
                &request(),
                &cands[c.index],
                None,
                Duration::from_secs(1),
            );
            assert_eq!(c.prediction, want, "{name}");
        }
    }
}
