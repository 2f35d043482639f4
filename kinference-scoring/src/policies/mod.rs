//! Routing policies behind one interface, selectable by name.
//!
//! | name | rule |
//! |---|---|
//! | `kinference` | lowest calibrated predicted TTFT, warm bias of `tolerance × cached fraction`, equals spread least-recently-chosen ([`Kinference`]) |
//! | `round-robin` | next in turn ([`RoundRobin`]) |
//! | `least-inflight` | fewest requests in flight ([`LeastInflight`]) |
//! | `llm-d-blend` | llm-d's weighted scorers: prefix 3, queue 2, KV utilisation 2 ([`LlmdBlend`]) |
//! | `llm-d-default` | llm-d's default profile: prefix-cache affinity filter (≥ 0.8, 1 % exploration), token-load + no-hit-LRU scorers ([`LlmdDefault`]) |
//! | `dynamo-cost` | Dynamo's cost `prefill blocks − overlap credit + decode blocks`, shared active blocks counted once ([`DynamoCost`]) |
//! | `sglang-cache-aware` | SGLang's cache-aware policy, its tree grown on route ([`SglangCacheAware`]) |
//!
//! The baselines are re-implementations from their projects' sources (each
//! module cites the upstream file and formula it follows); none of their
//! code is used. All of them read the same inputs as ours, including the same
//! tier-credited cache estimate, so a comparison isolates the decision rule;
//! what an input cannot carry (Dynamo's per-block active-sequence identities)
//! is estimated and said so on the type. Every policy
//! returns a candidate from the given slice, breaks exact ties with the
//! caller's seeded [`RandomSource`], and is deterministic for a given seed.

mod baseline;
mod dynamo;
mod kinference;
mod least_inflight;
mod llmd_blend;
mod llmd_default;
mod round_robin;
mod sglang;

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use self::dynamo::{DynamoConfig, DynamoCost};
pub use self::kinference::{Kinference, ROOM_NEEDS_SAMPLES};
pub use self::least_inflight::LeastInflight;
pub use self::llmd_blend::{LlmdBlend, LlmdBlendConfig};
pub use self::llmd_default::{LlmdDefault, LlmdDefaultConfig};
pub use self::round_robin::RoundRobin;
pub use self::sglang::{SglangCacheAware, SglangConfig};
use crate::calibrate::{CalibrationView, ObserveOutcome};
use crate::error::ScoringError;
use crate::input::{Candidate, EndpointId, Request};
use crate::latency::Prediction;
use crate::pick::{Choice, Explanation};
use crate::profile::LatencyParams;
use crate::rng::RandomSource;
use crate::steps::{StepFit, StepSample};

/// A policy's name, as the router's and the harness's flags spell it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyName {
    /// Ours.
    Kinference,
    /// Round robin.
    RoundRobin,
    /// Least in-flight requests.
    LeastInflight,
    /// llm-d-style weighted blend.
    LlmdBlend,
    /// llm-d's newer default.
    LlmdDefault,
    /// Dynamo-style cost.
    DynamoCost,
    /// SGLang's cache-aware policy.
    SglangCacheAware,
}

impl PolicyName {
    /// Every policy, ours first.
    pub const ALL: [PolicyName; 7] = [
        Self::Kinference,
        Self::RoundRobin,
        Self::LeastInflight,
        Self::LlmdBlend,
        Self::LlmdDefault,
        Self::DynamoCost,
        Self::SglangCacheAware,
    ];

    /// The name as written on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kinference => "kinference",
            Self::RoundRobin => "round-robin",
            Self::LeastInflight => "least-inflight",
            Self::LlmdBlend => "llm-d-blend",
            Self::LlmdDefault => "llm-d-default",
            Self::DynamoCost => "dynamo-cost",
            Self::SglangCacheAware => "sglang-cache-aware",
        }
    }
}

impl fmt::Display for PolicyName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy name nobody knows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown policy {0:?}; known: kinference, round-robin, least-inflight, llm-d-blend, llm-d-default, dynamo-cost, sglang-cache-aware"
)]
pub struct UnknownPolicy(pub String);

impl FromStr for PolicyName {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| UnknownPolicy(s.to_owned()))
    }
}

/// The interface every policy implements.
///
/// The caller owns time and randomness: `now` is any monotonic clock's
/// reading as a `Duration` since an arbitrary epoch (the same epoch for every
/// call), and `rng` is a seeded source.
///
/// A decision has two halves. [`Pick::propose`] chooses and changes nothing
/// a later decision could see (scratch buffers aside), so a caller may
/// propose for several worker sets and keep one, or throw a proposal away
/// when the engine refuses the request. [`Pick::commit`] then records the
/// proposal that was sent: rotation positions, least-recently-chosen times,
/// running means. [`Pick::pick`] does both, for callers that send every
/// decision they take. The router updates its in-flight accounting with
/// [`Choice::uncached_tokens`].
pub trait Pick {
    /// The policy's name.
    fn name(&self) -> PolicyName;

    /// Choose one of `candidates` for `request` without recording the
    /// choice.
    ///
    /// # Errors
    ///
    /// [`ScoringError`] when `candidates` is empty, the block width is 0, or an
    /// endpoint id is at or above [`EndpointId::LIMIT`].
    fn propose(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Choice, ScoringError>;

    /// [`Pick::propose`] that also explains: every candidate's inputs,
    /// prediction and score. The same choice as `propose` for the same state
    /// and seed; slower (it allocates and predicts for every candidate).
    ///
    /// # Errors
    ///
    /// As [`Pick::propose`].
    fn propose_explained(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Explanation, ScoringError>;

    /// Record that `request` was sent as `choice` proposed, to `chosen` (the
    /// candidate at `choice.index`, as it was given to `propose`), at `now`.
    /// Policies without per-decision state ignore it.
    fn commit(&mut self, request: &Request, chosen: &Candidate, choice: &Choice, now: Duration) {
        let _ = (request, chosen, choice, now);
    }

    /// [`Pick::propose`] then [`Pick::commit`]: for callers that send every
    /// decision.
    ///
    /// # Errors
    ///
    /// As [`Pick::propose`].
    fn pick(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Choice, ScoringError> {
        let choice = self.propose(request, candidates, now, rng)?;
        self.commit(request, &candidates[choice.index], &choice, now);
        Ok(choice)
    }

    /// [`Pick::propose_explained`] then [`Pick::commit`].
    ///
    /// # Errors
    ///
    /// As [`Pick::propose`].
    fn pick_explained(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Explanation, ScoringError> {
        let explanation = self.propose_explained(request, candidates, now, rng)?;
        let chosen = &candidates[explanation.choice.index];
        self.commit(request, chosen, &explanation.choice, now);
        Ok(explanation)
    }

    /// Report the observed time to first token of a request sent to
    /// `endpoint` with `prediction` (from its [`Choice`]). Only policies that
    /// calibrate use it.
    fn observe(
        &mut self,
        endpoint: EndpointId,
        prediction: &Prediction,
        observed: Duration,
        now: Duration,
    ) -> ObserveOutcome {
        let _ = (endpoint, prediction, observed, now);
        ObserveOutcome::Disabled
    }

    /// Report the time to first token of a speed probe sent to an idle
    /// `endpoint` with `prediction`, before it took any request: what the
    /// engine's speed is before the first real first token can say.
    /// kinference's policy predicts an endpoint that answered far slower
    /// than the fastest that much slower ([`Kinference`]); the others
    /// ignore it.
    fn observe_probe(
        &mut self,
        endpoint: EndpointId,
        prediction: &Prediction,
        observed: Duration,
        now: Duration,
    ) -> ObserveOutcome {
        let _ = (endpoint, prediction, observed, now);
        ObserveOutcome::Disabled
    }

    /// Report a finished stream's steps on `endpoint` (see
    /// [`crate::steps`]). Only policies that learn step costs use it.
    fn observe_steps(&mut self, endpoint: EndpointId, sample: &StepSample) -> ObserveOutcome {
        let _ = (endpoint, sample);
        ObserveOutcome::Disabled
    }

    /// Forget everything about `endpoint` (it left the set). Its id may be
    /// reused afterwards.
    fn remove_endpoint(&mut self, endpoint: EndpointId) {
        let _ = endpoint;
    }

    /// The engines' step costs learnt from the streams, once in use, for a
    /// peer router to start from; `None` for policies that do not learn
    /// them.
    fn step_fit(&self) -> Option<StepFit> {
        None
    }

    /// Starts from a peer router's step costs ([`Pick::step_fit`]) when
    /// this one has not pinned its own down ([`StepFit::adopt`]); returns
    /// whether they were taken.
    fn adopt_steps(&mut self, fit: &StepFit) -> bool {
        let _ = fit;
        false
    }

    /// `endpoint`'s calibration at `now`, for `/debug` and metrics; `None`
    /// for policies that do not calibrate.
    fn calibration(&self, endpoint: EndpointId, now: Duration) -> Option<CalibrationView> {
        let _ = (endpoint, now);
        None
    }
}

/// Any of the policies, chosen by name. The router and the benchmark harness
/// hold one per worker set.
#[derive(Debug, Clone)]
pub enum Policy {
    /// See [`Kinference`].
    Kinference(Kinference),
    /// See [`RoundRobin`].
    RoundRobin(RoundRobin),
    /// See [`LeastInflight`].
    LeastInflight(LeastInflight),
    /// See [`LlmdBlend`].
    LlmdBlend(LlmdBlend),
    /// See [`LlmdDefault`].
    LlmdDefault(LlmdDefault),
    /// See [`DynamoCost`].
    DynamoCost(DynamoCost),
    /// See [`SglangCacheAware`].
    SglangCacheAware(SglangCacheAware),
}

impl Policy {
    /// The policy `name` with its default configuration. `params` is the
    /// worker set's latency model: ours decides with it; every policy uses it
    /// for the prediction it reports, and baselines that need a cache credit
    /// or a throughput take the profile's.
    pub fn new(name: PolicyName, params: LatencyParams) -> Self {
        match name {
            PolicyName::Kinference => Self::Kinference(Kinference::new(params)),
            PolicyName::RoundRobin => Self::RoundRobin(RoundRobin::new(params)),
            PolicyName::LeastInflight => Self::LeastInflight(LeastInflight::new(params)),
            PolicyName::LlmdBlend => Self::LlmdBlend(LlmdBlend::new(params)),
            PolicyName::LlmdDefault => Self::LlmdDefault(LlmdDefault::new(params)),
            PolicyName::DynamoCost => Self::DynamoCost(DynamoCost::new(params)),
            PolicyName::SglangCacheAware => Self::SglangCacheAware(SglangCacheAware::new(params)),
        }
    }

    /// [`Policy::new`] from a name string.
    ///
    /// # Errors
    ///
    /// [`UnknownPolicy`] listing the known names.
    pub fn from_name(name: &str, params: LatencyParams) -> Result<Self, UnknownPolicy> {
        Ok(Self::new(name.parse()?, params))
    }

    fn inner(&mut self) -> &mut dyn Pick {
        match self {
            Self::Kinference(p) => p,
            Self::RoundRobin(p) => p,
            Self::LeastInflight(p) => p,
            Self::LlmdBlend(p) => p,
            Self::LlmdDefault(p) => p,
            Self::DynamoCost(p) => p,
            Self::SglangCacheAware(p) => p,
        }
    }
}

impl Pick for Policy {
    fn name(&self) -> PolicyName {
        match self {
            Self::Kinference(_) => PolicyName::Kinference,
            Self::RoundRobin(_) => PolicyName::RoundRobin,
            Self::LeastInflight(_) => PolicyName::LeastInflight,
            Self::LlmdBlend(_) => PolicyName::LlmdBlend,
            Self::LlmdDefault(_) => PolicyName::LlmdDefault,
            Self::DynamoCost(_) => PolicyName::DynamoCost,
            Self::SglangCacheAware(_) => PolicyName::SglangCacheAware,
        }
    }

    fn propose(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Choice, ScoringError> {
        self.inner().propose(request, candidates, now, rng)
    }

    fn propose_explained(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Explanation, ScoringError> {
        self.inner()
            .propose_explained(request, candidates, now, rng)
    }

    fn commit(&mut self, request: &Request, chosen: &Candidate, choice: &Choice, now: Duration) {
        self.inner().commit(request, chosen, choice, now);
    }

    fn observe(
        &mut self,
        endpoint: EndpointId,
        prediction: &Prediction,
        observed: Duration,
        now: Duration,
    ) -> ObserveOutcome {
        self.inner().observe(endpoint, prediction, observed, now)
    }

    fn observe_probe(
        &mut self,
        endpoint: EndpointId,
        prediction: &Prediction,
        observed: Duration,
        now: Duration,
    ) -> ObserveOutcome {
        self.inner()
            .observe_probe(endpoint, prediction, observed, now)
    }

    fn observe_steps(&mut self, endpoint: EndpointId, sample: &StepSample) -> ObserveOutcome {
        self.inner().observe_steps(endpoint, sample)
    }

    fn remove_endpoint(&mut self, endpoint: EndpointId) {
        self.inner().remove_endpoint(endpoint);
    }

    fn step_fit(&self) -> Option<StepFit> {
        match self {
            Self::Kinference(p) => p.step_fit(),
            _ => None,
        }
    }

    fn adopt_steps(&mut self, fit: &StepFit) -> bool {
        self.inner().adopt_steps(fit)
    }

    fn calibration(&self, endpoint: EndpointId, now: Duration) -> Option<CalibrationView> {
        match self {
            Self::Kinference(p) => p.calibration(endpoint, now),
            _ => None,
        }
    }
}

/// Routers share one policy per worker set across threads (behind a lock).
const _: () = {
    const fn shareable<T: Send + Sync>() {}
    shareable::<Policy>();
    shareable::<crate::approx::PrefixRecord>();
};

/// Reject what no policy can decide on.
pub(crate) fn check(request: &Request, candidates: &[Candidate]) -> Result<(), ScoringError> {
    if candidates.is_empty() {
        return Err(ScoringError::NoCandidates);
    }
    if request.block_tokens == 0 {
        return Err(ScoringError::ZeroBlockWidth);
    }
    if let Some(c) = candidates
        .iter()
        .find(|c| c.endpoint.0 >= EndpointId::LIMIT)
    {
        return Err(ScoringError::EndpointIdTooLarge(c.endpoint));
    }
    Ok(())
}

/// Milliseconds since the caller's epoch, for explanations.
pub(crate) fn millis(now: Duration) -> f64 {
    now.as_secs_f64() * 1e3
}
