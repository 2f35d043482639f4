//! Decisions and their explanations.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::input::{Candidate, EndpointId, Request};
use crate::latency::Prediction;
use crate::policies::PolicyName;

/// Why a policy chose its candidate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "rule")]
pub enum Reason {
    /// kinference: the lowest predicted TTFT.
    LowestPredictedTtft,
    /// kinference: a warmer endpoint kept the request although `fastest` was
    /// predicted earlier, by less than the tolerance plus the cost of the
    /// extra prefill work going there would impose on others.
    StayedWarm {
        /// The endpoint with the lowest predicted TTFT.
        fastest: EndpointId,
        /// How much later the chosen endpoint is predicted, ms.
        later_ms: f64,
    },
    /// kinference: the warmest endpoint was predicted later than the chosen,
    /// colder one by more than the tolerance (saturation release).
    SaturationRelease {
        /// The warmest endpoint.
        warmest: EndpointId,
        /// How much later the warmest endpoint is predicted, ms.
        later_ms: f64,
    },
    /// kinference: the endpoint the rules above preferred was predicted to
    /// miss the request's TTFT target; the chosen one, the best of those
    /// predicted to meet it, is not.
    MetTarget {
        /// The endpoint preferred without the target.
        preferred: EndpointId,
        /// Its predicted TTFT, ms (over the target).
        preferred_ms: f64,
        /// How much later the chosen endpoint is predicted than the
        /// fastest candidate, ms (0 when it is the fastest).
        later_ms: f64,
    },
    /// round-robin: next in turn.
    Rotation,
    /// least-inflight: fewest requests in flight.
    FewestInFlight,
    /// llm-d-blend: highest weighted score.
    HighestWeightedScore,
    /// llm-d-default: among endpoints holding at least the affinity threshold
    /// of the prompt, the best token-load and no-hit-LRU score.
    Sticky,
    /// llm-d-default: stickiness released by the TTFT gate; fewest in-flight
    /// tokens among all.
    StickinessReleased,
    /// llm-d-default: no endpoint reached the affinity threshold; best
    /// token-load and no-hit-LRU score among all.
    NoStickyEndpoint,
    /// llm-d-default: the filter's exploration draw kept every endpoint.
    Exploration,
    /// dynamo-cost: lowest cost.
    LowestCost,
    /// dynamo-cost: softmax sample at a positive temperature.
    SoftmaxSample,
    /// sglang-cache-aware: load imbalanced, least loaded.
    LoadImbalance,
    /// sglang-cache-aware: longest prefix match above the threshold.
    LongestPrefixMatch,
    /// sglang-cache-aware: no good match, smallest cache footprint.
    SmallestCache,
}

/// How a tie among equally good candidates was broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "by")]
pub enum Tie {
    /// No tie.
    None,
    /// kinference: the least recently chosen of `among` equals.
    LeastRecentlyChosen {
        /// Number of equal candidates.
        among: u32,
    },
    /// Uniformly at random (seeded) among `among` equals.
    Random {
        /// Number of equal candidates.
        among: u32,
    },
}

/// A policy's decision.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    /// The chosen endpoint.
    pub endpoint: EndpointId,
    /// Its position in the candidate slice.
    pub index: usize,
    /// kinference's prediction for the chosen endpoint, whatever the policy:
    /// `uncached_tokens` is what to add to its in-flight prefill tokens, and
    /// the prediction is what to pass back to [`crate::Pick::observe`].
    pub prediction: Prediction,
    /// The rule that decided.
    pub reason: Reason,
    /// How a tie was broken, if there was one.
    pub tie: Tie,
}

impl Choice {
    /// The prefill tokens this request adds to the chosen endpoint's in-flight
    /// accounting (`prediction.uncached_tokens`).
    pub fn uncached_tokens(&self) -> u32 {
        self.prediction.uncached_tokens
    }
}

impl Reason {
    /// The rule's name, as in metrics labels and the decision header.
    pub fn label(&self) -> &'static str {
        match self {
            Self::LowestPredictedTtft => "lowest_predicted_ttft",
            Self::StayedWarm { .. } => "stayed_warm",
            Self::SaturationRelease { .. } => "saturation_release",
            Self::MetTarget { .. } => "met_ttft_target",
            Self::Rotation => "rotation",
            Self::FewestInFlight => "fewest_in_flight",
            Self::HighestWeightedScore => "highest_weighted_score",
            Self::Sticky => "sticky",
            Self::StickinessReleased => "stickiness_released",
            Self::NoStickyEndpoint => "no_sticky_endpoint",
            Self::Exploration => "exploration",
            Self::LowestCost => "lowest_cost",
            Self::SoftmaxSample => "softmax_sample",
            Self::LoadImbalance => "load_imbalance",
            Self::LongestPrefixMatch => "longest_prefix_match",
            Self::SmallestCache => "smallest_cache",
        }
    }
}

impl fmt::Display for Choice {
    /// A compact one-line form for a response header, e.g.
    /// `endpoint=3; ttft_ms=41.2; cached=0.93; rule=lowest_predicted_ttft`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rule = self.reason.label();
        write!(
            f,
            "endpoint={}; ttft_ms={:.1}; cached={:.2}; rule={rule}",
            self.endpoint, self.prediction.ttft_ms, self.prediction.warm_fraction
        )?;
        match self.tie {
            Tie::None => Ok(()),
            Tie::LeastRecentlyChosen { among } => write!(f, "; tie=lru/{among}"),
            Tie::Random { among } => write!(f, "; tie=random/{among}"),
        }
    }
}

/// A policy's own score terms for one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "policy")]
pub enum ScoreDetail {
    /// kinference: score = predicted TTFT − warm bonus + externality (lower
    /// wins).
    Kinference {
        /// `tolerance × warm fraction`, ms.
        warm_bonus_ms: f64,
        /// Delay this choice's prefill would impose on later requests, ms.
        externality_ms: f64,
        /// Recompute this choice's prefill would cause by evicting cached
        /// blocks there, ms ([`crate::KvRoom`]).
        #[serde(default)]
        eviction_ms: f64,
        /// Milliseconds since this endpoint was last chosen (`None`: never).
        since_chosen_ms: Option<f64>,
    },
    /// round-robin: position in the candidate list (score = 0 for the next in
    /// turn, 1 otherwise).
    RoundRobin {
        /// Index in the candidate slice.
        position: usize,
    },
    /// least-inflight: score = requests in flight (lower wins).
    LeastInflight {
        /// Requests in flight.
        requests: u32,
    },
    /// llm-d-blend: score = 3·prefix + 2·queue + 2·kv (higher wins).
    LlmdBlend {
        /// Matched ÷ total prompt blocks.
        prefix: f64,
        /// `(maxQ − q) ÷ (maxQ − minQ)`, 1 when all equal.
        queue: f64,
        /// `1 − KV usage`, 0 without fresh metrics.
        kv_utilization: f64,
        /// Queue length used (scraped waiting, else own prefilling).
        queue_length: u32,
    },
    /// llm-d-default: score = token load + no-hit LRU (higher wins, among
    /// the kept set).
    LlmdDefault {
        /// Matched ÷ total prompt blocks.
        prefix: f64,
        /// Prefix at or above the affinity threshold.
        sticky: bool,
        /// The TTFT gate's estimate: in-flight tokens ÷ peak throughput, ms.
        gate_ttft_ms: f64,
        /// Kept by the affinity filter.
        kept: bool,
        /// `1 − min(1, in-flight tokens ÷ threshold)`.
        token_load: f64,
        /// The no-hit-LRU score (0.5 for a warm request).
        no_hit_lru: f64,
    },
    /// dynamo-cost: score = prefill load scale × prefill blocks + decode
    /// blocks (lower wins).
    DynamoCost {
        /// `max(prompt blocks + active prefill blocks − overlap credit, 0)`.
        prefill_blocks: f64,
        /// Unique active blocks plus the prompt's blocks new to them.
        decode_blocks: f64,
    },
    /// sglang-cache-aware.
    SglangCacheAware {
        /// Requests in flight.
        load: u32,
        /// Cached fraction of the prompt.
        match_rate: f64,
        /// The endpoint's tree size, tokens (grown on every route).
        footprint: f64,
    },
}

/// One candidate in an [`Explanation`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CandidateExplanation {
    /// The candidate as given.
    pub inputs: Candidate,
    /// kinference's prediction for it (for every policy, so they compare).
    pub prediction: Prediction,
    /// The policy's score (its units and direction in `detail`).
    pub score: f64,
    /// The policy's score terms.
    pub detail: ScoreDetail,
}

/// Every candidate's inputs and prediction for one decision; serialisable for
/// `/debug/explain`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Explanation {
    /// The policy that decided.
    pub policy: PolicyName,
    /// The `now` of the decision, ms since the caller's epoch.
    pub now_ms: f64,
    /// The request.
    pub request: Request,
    /// The decision.
    pub choice: Choice,
    /// Every candidate, in the order given.
    pub candidates: Vec<CandidateExplanation>,
}
