//! What the router knows about one request and each candidate endpoint.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The router's small id for an endpoint (a worker: endpoint and DP rank).
///
/// Ids index per-endpoint state directly, so keep them dense: reuse the ids of
/// removed endpoints. Ids at or above [`EndpointId::LIMIT`] are rejected.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct EndpointId(pub u32);

impl EndpointId {
    /// One past the largest accepted id. Per-endpoint state is a dense vector
    /// of 112-byte slots, so the worst case is ~29 MB.
    pub const LIMIT: u32 = 1 << 18;

    /// The id as a vector index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Where the candidates' cache estimates come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheSource {
    /// The KV-event index: blocks the engines reported holding.
    #[default]
    Index,
    /// The router's own record of where it sent which prompt prefixes
    /// ([`crate::approx::PrefixRecord`]); discounted by
    /// `LatencyParams::approximate_credit`.
    Approximate,
    /// No cache information: every candidate counts as cold.
    None,
}

/// One request, as far as routing is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Prompt length in tokens (in approximate mode, an estimate).
    pub prompt_tokens: u32,
    /// Tokens per block of the cache estimate (`kvBlockSize`; in approximate
    /// mode, the estimated tokens per text block). Must be positive.
    pub block_tokens: u32,
    /// Where the cached-block counts come from.
    pub cache: CacheSource,
    /// The time to first token the request must meet, from the decision
    /// (its target minus what it has waited already); `None`: no target.
    /// kinference's policy then prefers, among the candidates predicted to
    /// meet it, its usual choice; the baselines ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_target: Option<Duration>,
}

/// Leading blocks of the prompt each tier holds: for each tier, the length of
/// the run of the prompt's blocks, from the first, that the tier holds. A block
/// counts at the best credit among the tiers whose run covers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CachedBlocks {
    /// Leading blocks in GPU memory.
    pub gpu: u32,
    /// Leading blocks in CPU memory.
    pub cpu: u32,
    /// Leading blocks on local disk.
    pub disk: u32,
    /// Leading blocks in shared or remote storage (vLLM's `STORAGE` and
    /// `EXTERNAL` media: file systems, object stores).
    #[serde(default)]
    pub storage: u32,
}

/// The router's own accounting of its requests on one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct InFlight {
    /// Requests sent and not finished.
    pub requests: u32,
    /// Of `requests`, those whose first token has arrived (decoding).
    pub decoding: u32,
    /// Uncached prompt tokens of the requests whose first token has not
    /// arrived: the prefill work queued or running on the engine. Add
    /// [`crate::Choice::uncached_tokens`] when you send a request, subtract
    /// it when its first token (or an error) arrives.
    pub prefill_tokens: u64,
    /// Context tokens (prompt, plus output so far if known) of all `requests`.
    /// Only the Dynamo-style cost reads it.
    pub context_tokens: u64,
}

impl InFlight {
    /// Requests whose first token has not arrived.
    pub fn prefilling(&self) -> u32 {
        self.requests.saturating_sub(self.decoding)
    }
}

/// Figures scraped from the engine's `/metrics`, with their age.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EngineMetrics {
    /// `vllm:num_requests_running` (prefilling or decoding).
    pub running: u32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc` as a fraction 0..1. Out-of-range values are
    /// clamped; NaN counts as 0.
    pub kv_usage: f64,
    /// Time since the scrape.
    pub age: Duration,
    /// This router's own requests in flight there when the figures were
    /// read: the scraped counts beyond them are other clients' (e.g. other
    /// router replicas). Comparing with the accounting *at the scrape*, not
    /// now, keeps a stale scrape from counting this router's own requests
    /// twice (a request waiting then and decoding now).
    #[serde(default)]
    pub own_requests: u32,
    /// Of which before their first token.
    #[serde(default)]
    pub own_prefilling: u32,
}

/// One candidate endpoint for one request.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Candidate {
    /// The router's id for the endpoint.
    pub endpoint: EndpointId,
    /// Cached leading blocks by tier, from the index or the prefix record.
    pub cached: CachedBlocks,
    /// The router's own in-flight accounting.
    pub in_flight: InFlight,
    /// Scraped engine figures, if any.
    pub engine: Option<EngineMetrics>,
    /// What the router's requests still waiting there, and the engine's
    /// refusals, say about it now.
    #[serde(default)]
    pub evidence: Evidence,
    /// Whether the request's LoRA adapter can run there at once
    /// ([`AdapterSlot::Unknown`] for base-model requests).
    #[serde(default)]
    pub adapter: AdapterSlot,
    /// How full the engine's KV cache is: what a prefill there would
    /// evict.
    #[serde(default)]
    pub room: KvRoom,
    /// Blocks (of [`Request::block_tokens`]) of the request's session
    /// that the engine reported storing (`session_id` on its KV events),
    /// at most the prompt's: where the session's context lives when the
    /// prompt itself cannot be matched (approximate tokenization, a
    /// template the router renders differently, a session another router
    /// placed). An upper bound (evictions carry no session), so
    /// [`crate::Kinference`] counts it like the approximate record
    /// (`LatencyParams::approximate_credit`), and only where it exceeds
    /// `cached`. 0: no session, or none there. Set it only when the
    /// cache source found nothing better: the router does so in
    /// approximate mode, and in exact mode only when the index shows no
    /// candidate holding any of the prompt.
    #[serde(default)]
    pub session_blocks: u32,
    /// Requests per millisecond the other router replicas have been
    /// sending this endpoint lately ([`crate::ArrivalRate::per_ms`] of
    /// what their load reports counted); 0 without peers. The kinference
    /// policy adds it to its own sending rate in the externality's λ, so
    /// that R replicas charge what one router taking all of it would.
    /// Negative or NaN counts as 0.
    #[serde(default)]
    pub peer_arrival_rate: f64,
}

/// The KV cache of one candidate, in blocks of the request's width
/// ([`Request::block_tokens`]): its size and how much of it is taken. A
/// prefill of `n` uncached blocks where fewer than `n` are free evicts
/// cached blocks, which later requests may have to recompute;
/// [`crate::Kinference`] charges it for them
/// ([`crate::LatencyParams::eviction_weight`]). A capacity of 0 (unknown):
/// no charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KvRoom {
    /// Blocks the engine's KV cache holds (vLLM `cache_config_info`
    /// `num_gpu_blocks` × its block size ÷ the request's block width); 0:
    /// unknown.
    pub capacity_blocks: u32,
    /// Blocks taken: the larger of what the KV index shows the engine
    /// holding (prompts and outputs) and the distinct prompt blocks this
    /// router sent there recently
    /// ([`crate::approx::PrefixRecord::blocks_sent`], which covers the time
    /// before the engine's events arrive, and engines without events).
    pub used_blocks: u32,
}

impl KvRoom {
    /// Of `new_blocks` about to be written, how many displace cached
    /// blocks: `used + new − capacity`, within `0..=new`. 0 when the
    /// capacity is unknown.
    #[inline]
    pub fn evicted(&self, new_blocks: f64) -> f64 {
        if self.capacity_blocks == 0 || new_blocks <= 0.0 {
            return 0.0;
        }
        let over = f64::from(self.used_blocks) + new_blocks - f64::from(self.capacity_blocks);
        over.clamp(0.0, new_blocks)
    }
}

/// Where a LoRA adapter request stands on an engine whose running batch
/// holds at most `max_loras` distinct adapters (vLLM `--max-loras`): a
/// request whose adapter would exceed that waits, while later requests go
/// ahead, until every running request of some other adapter has finished.
/// Base-model requests never wait for a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AdapterSlot {
    /// Not an adapter request, or nothing known about the engine's adapters:
    /// no term.
    #[default]
    Unknown,
    /// The adapter is running or waiting there already: no term.
    Resident,
    /// A slot is free: the adapter loads first
    /// ([`crate::LatencyParams::adapter_load_millis`]).
    Free,
    /// Every slot holds an adapter with running requests: the request waits
    /// for one to drain ([`crate::LatencyParams::adapter_slot_wait_millis`]).
    Full,
}

impl AdapterSlot {
    /// A label for explanations and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Resident => "resident",
            Self::Free => "free",
            Self::Full => "full",
        }
    }
}

/// Evidence about an endpoint *now*, from requests that have not answered
/// yet: a request sent `oldest_waiting` ago without a first token has a TTFT
/// of at least that (a lower bound, a censored observation), and an engine
/// that answered 503 recently is at its admission limit. Both are read by the
/// model ([`crate::latency`]) before any first token arrives, so an engine
/// that slowed down stops getting new work within about a second of a burst
/// rather than after its first (late) tokens. The engine's KV events add
/// how many steps it has completed meanwhile (`stored_steps`), which
/// shows a slow engine earlier still: after a few of its predicted steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Evidence {
    /// Age of the oldest request this router sent there that has no first
    /// token yet (zero: none).
    #[serde(default)]
    pub oldest_waiting: Duration,
    /// That request's predicted TTFT when it was sent (zero: unknown).
    #[serde(default)]
    pub oldest_predicted: Duration,
    /// Time since the engine last refused a request with 503 (its admission
    /// control), if it did within the scrape horizon.
    #[serde(default)]
    pub refused_age: Option<Duration>,
    /// Engine steps that stored KV blocks there (batches of `BlockStored`
    /// events from its streams) since the oldest waiting request was sent;
    /// `None` where its events are not followed, or where its engines have
    /// never stored a block (prefix caching off), so that silence means
    /// nothing. An engine with prefill work stores blocks every step: a
    /// long silence shows its steps slower than predicted before any first
    /// token is late.
    #[serde(default)]
    pub stored_steps: Option<u32>,
    /// The oldest waiting request's predicted engine step when it was sent:
    /// its predicted prefill and step time ÷ its steps, calibrated (zero:
    /// unknown, and `stored_steps` then counts for nothing).
    #[serde(default)]
    pub oldest_step: Duration,
    /// Whether this router had nothing else in flight there when the oldest
    /// request was sent: no step of its own was under way, so its first
    /// step began at once.
    #[serde(default)]
    pub oldest_sent_idle: bool,
}
