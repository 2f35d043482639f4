//! Time-to-first-token prediction, online calibration and endpoint picking
//! for cache-aware LLM routing.
//!
//! For one request and a set of candidate endpoints (vLLM or SGLang workers),
//! decide which one will produce the first token soonest, mostly because it
//! already holds the prompt's prefix in its KV cache, and explain why.
//!
//! # Data model
//!
//! - [`LatencyParams`]: the latency model of one worker set, from a built-in
//!   profile ([`LatencyParams::builtin`]) with a `RoutingProfile`'s
//!   [`Overrides`] on top.
//! - [`Request`]: prompt tokens, block width, and where cache estimates come
//!   from ([`CacheSource`]).
//! - [`Candidate`]: an endpoint's small id ([`EndpointId`]), its cached
//!   leading blocks per tier ([`CachedBlocks`]), the router's own in-flight
//!   accounting ([`InFlight`]) and optionally scraped engine figures
//!   ([`EngineMetrics`]).
//! - [`Prediction`] ([`latency`]): predicted TTFT with its terms.
//! - [`Calibration`] ([`calibrate`]): per-endpoint correction learnt from
//!   observed TTFT, owned by the [`Kinference`] policy.
//! - [`Policy`] / [`Pick`]: our policy and the baselines, chosen by
//!   [`PolicyName`]; each returns a [`Choice`], or an [`Explanation`] of every
//!   candidate (serde-serialisable, for `/debug/explain`).
//! - [`PrefixRecord`] ([`approx`]): the router's record of where it sent which
//!   prompt prefixes, the cache estimate in approximate mode.
//!
//! # Using it from the router
//!
//! ```
//! use std::time::Duration;
//! use kinference_scoring::{
//!     CacheSource, Candidate, CachedBlocks, EndpointId, InFlight, LatencyParams, Overrides,
//!     Pick, Policy, PolicyName, Request, SplitMix64,
//! };
//!
//! // Once per worker set: its profile, then the policy the flags name.
//! let params = LatencyParams::builtin("default")
//!     .expect("built in")
//!     .with_overrides(&Overrides { tolerance_millis: Some(80.0), ..Overrides::default() })
//!     .expect("valid profile");
//! let mut policy = Policy::from_name("kinference", params).expect("known policy");
//! let mut rng = SplitMix64::new(0x5eed);
//!
//! // Per request: the index lookup and the in-flight accounting.
//! let request = Request { prompt_tokens: 3000, block_tokens: 16, cache: CacheSource::Index, ttft_target: None };
//! let candidates = [
//!     Candidate {
//!         endpoint: EndpointId(0),
//!         cached: CachedBlocks { gpu: 180, ..CachedBlocks::default() },
//!         in_flight: InFlight { requests: 3, decoding: 2, prefill_tokens: 400, context_tokens: 9000 },
//!         engine: None,
//!         evidence: kinference_scoring::Evidence::default(),
//!         adapter: kinference_scoring::AdapterSlot::Unknown, // a base-model request
//!         // Its KV cache: 20,000 blocks, 12,000 taken (the index's count).
//!         room: kinference_scoring::KvRoom { capacity_blocks: 20_000, used_blocks: 12_000 },
//!         session_blocks: 0, // the request names no session
//!         peer_arrival_rate: 0.0, // no router replicas beside this one
//!     },
//!     Candidate { endpoint: EndpointId(1), ..Candidate::default() },
//! ];
//! let now = Duration::from_secs(10); // any monotonic clock, passed in
//! let choice = policy.pick(&request, &candidates, now, &mut rng)?;
//! assert_eq!(choice.endpoint, EndpointId(0)); // warm and lightly loaded
//!
//! // The router adds `choice.uncached_tokens()` to the endpoint's in-flight
//! // prefill tokens, and when the first token arrives:
//! let ttft = Duration::from_millis(48);
//! policy.observe(choice.endpoint, &choice.prediction, ttft, now + ttft);
//! # Ok::<(), kinference_scoring::ScoringError>(())
//! ```
//!
//! # Invariants
//!
//! - Pure: no I/O, no Kubernetes, no other kinference crate, no wall clock
//!   (`clippy.toml` bans `Instant::now` and `SystemTime::now`), no ambient
//!   randomness. Time and a seeded [`RandomSource`] are passed in, so a
//!   decision is reproducible from its inputs, the policy's state and the
//!   seed.
//! - Every policy returns one of the given candidates, or an error for an
//!   empty set, a zero block width or an endpoint id at or above
//!   [`EndpointId::LIMIT`]; nothing panics on input data.
//! - The prediction is monotone: more cached blocks never predict a later
//!   first token; more queued prefill, decoding sequences, scraped waiting or
//!   running requests, or KV usage never an earlier one (proptests in
//!   `tests/invariants.rs`).
//! - Calibration is bounded and robust (see [`calibrate`]).
//!
//! # Complexity
//!
//! A decision is O(candidates) with a few dozen floating-point operations
//! per candidate and no allocation once buffers have grown;
//! `benches/pick.rs` measures 256 candidates. Per-endpoint state is a dense
//! vector indexed by [`EndpointId`] (112 bytes per id). Explanations
//! allocate one entry per candidate.

pub mod approx;
mod arrivals;
pub mod calibrate;
mod error;
mod input;
pub mod latency;
mod pick;
pub mod policies;
mod profile;
mod rng;
pub mod steps;

pub use crate::approx::{PrefixRecord, RecordMark};
pub use crate::arrivals::{ARRIVAL_MEMORY_NANOS, ArrivalRate};
pub use crate::calibrate::{Calibration, CalibrationView, ObserveOutcome};
pub use crate::error::ScoringError;
pub use crate::input::{
    AdapterSlot, CacheSource, CachedBlocks, Candidate, EndpointId, EngineMetrics, Evidence,
    InFlight, KvRoom, Request,
};
pub use crate::latency::{Prediction, predict};
pub use crate::pick::{CandidateExplanation, Choice, Explanation, Reason, ScoreDetail, Tie};
pub use crate::policies::{Kinference, Pick, Policy, PolicyName, UnknownPolicy};
pub use crate::profile::{
    BUILTIN_PROFILES, CalibrationParams, LatencyParams, Overrides, ParamsError, TierCredits,
};
pub use crate::rng::{RandomSource, SplitMix64, below};
pub use crate::steps::{StepCosts, StepFit, StepSample};
