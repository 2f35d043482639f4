//! Per-endpoint state: the router's own load accounting, health, and what
//! the engine told us (models, scraped metrics).
//!
//! An endpoint is one engine's OpenAI API address (`ip:port`). Its state
//! lives as long as some worker set of the pool lists it as ready; the
//! [`Registry`] creates and drops states as snapshots change, and the tasks
//! that poll the engine stop with it.
//!
//! Load accounting is the main load signal (scraped metrics are slow): a
//! request counts as *prefilling* from when it is sent until its first token
//! (or, for non-streaming responses, until its predicted first-token time has
//! passed), then as *decoding* until its response ends or the client goes
//! away. [`InFlight`] guards make the release happen exactly once, on every
//! path.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use kinference_api::engine::EngineFamily;
use parking_lot::RwLock;
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A compact endpoint id, stable while the endpoint exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct EndpointId(pub u32);

/// An endpoint's address.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointKey {
    /// IP address or host name.
    pub address: String,
    /// OpenAI API port.
    pub http_port: u16,
}

impl EndpointKey {
    /// `address:port`, with brackets around IPv6 addresses.
    pub fn authority(&self) -> String {
        if self.address.contains(':') {
            format!("[{}]:{}", self.address, self.http_port)
        } else {
            format!("{}:{}", self.address, self.http_port)
        }
    }
}

/// A model an engine serves, from its `/v1/models`.
pub use kinference_api::engine::ModelCard as DiscoveredModel;

/// Figures scraped from the engine's `/metrics`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Scraped {
    /// `vllm:num_requests_running`.
    pub running: f64,
    /// `vllm:num_requests_waiting`.
    pub waiting: f64,
    /// `vllm:kv_cache_usage_perc` (0..1).
    pub kv_usage: f64,
    /// `vllm:cache_config_info{block_size}`.
    pub block_size: Option<u32>,
    /// Whose metric names the engine uses (vLLM, SGLang).
    pub family: kinference_api::engine::EngineFamily,
    /// This router's requests in flight there when they were read (the
    /// most seen just before and just after the scrape), so that scoring
    /// counts only others' requests from the scraped figures.
    pub own_requests: u32,
    /// Of which before their first token.
    pub own_prefilling: u32,
    /// When they were read.
    #[serde(skip)]
    pub at: Instant,
}

/// The router's own count of work it has sent to an endpoint.
#[derive(Debug, Default)]
pub struct Load {
    /// Requests sent and not finished.
    pub requests: AtomicU32,
    /// Requests whose first token has not arrived.
    pub prefilling: AtomicU32,
    /// Uncached prompt tokens of the prefilling requests.
    pub prefill_tokens: AtomicU64,
    /// Requests past their first token and not finished.
    pub decoding: AtomicU32,
    /// Prompt tokens of all requests in flight (their context size).
    pub context_tokens: AtomicU64,
    /// What the other router replicas report they have in flight here,
    /// summed over the fresh reports ([`crate::peers`]); 0 without peers.
    pub peers: PeerLoad,
    /// Which first tokens came out of one engine step.
    pub bursts: parking_lot::Mutex<Bursts>,
    /// Uncached prompt tokens of every request past its first token: the
    /// prefill work done there (as this router knows it), cumulative.
    pub prefilled: AtomicU64,
    /// Marks when `prefilled` last moved: the load version after the one
    /// current then ([`crate::peers::version`]), set before the change is
    /// announced; a peer's report sends the counts marked at or after the
    /// version its asker has ([`crate::peers::report`]).
    pub prefilled_version: AtomicU64,
}

/// First tokens close enough in time to come from one engine step: the
/// ones [`SAME_STEP`] or less apart. A request's steps start after its
/// whole burst's prefill (the others' prompts were computed before its
/// first token, whichever chunk the router happened to read first).
#[derive(Debug, Default)]
pub struct Bursts {
    /// Numbers the bursts.
    id: u64,
    /// The latest first token's [`clock_micros`].
    last: i64,
    /// [`Load::prefilled`] when the burst before ended.
    prev_end: u64,
}

/// How late a peer's report may tell of its first tokens (twice its
/// fastest poll, [`crate::peers::MIN_GAP`]), microseconds.
const PEER_LAG: i64 = 2 * crate::peers::MIN_GAP.as_micros() as i64;

/// First tokens read this close are taken to come from one engine step:
/// an engine's step takes milliseconds, its chunks of one step reach the
/// router within microseconds of each other.
const SAME_STEP: i64 = 2_000;

impl Bursts {
    /// A first token at `t`, `count` prefilled tokens before it: the burst
    /// it belongs to.
    fn first_token(&mut self, t: i64, count: u64) -> u64 {
        if self.id == 0 || t - self.last > SAME_STEP {
            self.id += 1;
            self.prev_end = count;
        }
        self.last = self.last.max(t);
        self.id
    }

    /// The prefilled count at the end of burst `id`, now that it is `now`;
    /// `None` once a later burst has ended too.
    fn end(&self, id: u64, now: u64) -> Option<u64> {
        if self.id == id {
            Some(now)
        } else if self.id == id + 1 {
            Some(self.prev_end)
        } else {
            None
        }
    }
}

/// Microseconds since the process's first call: the clock of
/// [`Bursts`] and step samples.
pub fn clock_micros(at: Instant) -> i64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    i64::try_from(at.saturating_duration_since(epoch).as_micros()).unwrap_or(i64::MAX)
}

/// Other replicas' load on an endpoint (the same five figures).
#[derive(Debug, Default)]
pub struct PeerLoad {
    /// Requests in flight.
    pub requests: AtomicU32,
    /// Of which before their first token.
    pub prefilling: AtomicU32,
    /// Their uncached prompt tokens.
    pub prefill_tokens: AtomicU64,
    /// Requests decoding.
    pub decoding: AtomicU32,
    /// Prompt tokens of the requests in flight.
    pub context_tokens: AtomicU64,
    /// What the peers reported prefilled here since this router heard
    /// from them, cumulative ([`crate::peers::PrefilledSeen`]).
    pub prefilled: AtomicU64,
    /// Whether a fresh peer does not report what it prefilled (an older
    /// version).
    pub prefilled_unknown: AtomicBool,
}

impl PeerLoad {
    /// What the peers prefilled here, if they all say.
    pub fn prefilled(&self) -> Option<u64> {
        (!self.prefilled_unknown.load(Ordering::Relaxed))
            .then(|| self.prefilled.load(Ordering::Relaxed))
    }

    /// A peer reported `n` more tokens prefilled here.
    pub fn add_prefilled(&self, n: u64) {
        self.prefilled.fetch_add(n, Ordering::Relaxed);
    }

    /// Whether every fresh peer reports what it prefilled.
    pub fn prefilled_known(&self, known: bool) {
        self.prefilled_unknown.store(!known, Ordering::Relaxed);
    }

    /// Reads the figures.
    pub fn snapshot(&self) -> LoadSnapshot {
        LoadSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            prefilling: self.prefilling.load(Ordering::Relaxed),
            prefill_tokens: self.prefill_tokens.load(Ordering::Relaxed),
            decoding: self.decoding.load(Ordering::Relaxed),
            context_tokens: self.context_tokens.load(Ordering::Relaxed),
        }
    }

    /// Sets the figures (`None`: no fresh peer report: zeros).
    pub fn set(&self, s: Option<LoadSnapshot>) {
        let s = s.unwrap_or_default();
        self.requests.store(s.requests, Ordering::Relaxed);
        self.prefilling.store(s.prefilling, Ordering::Relaxed);
        self.prefill_tokens
            .store(s.prefill_tokens, Ordering::Relaxed);
        self.decoding.store(s.decoding, Ordering::Relaxed);
        self.context_tokens
            .store(s.context_tokens, Ordering::Relaxed);
    }
}

/// Requests this router tracks per endpoint while they wait for their first
/// token (the oldest of them is the evidence; see [`Waiting`]).
pub const WAITING_SLOTS: usize = 32;

const PREDICTED_BITS: u32 = 24;
const PREDICTED_MASK: u64 = (1 << PREDICTED_BITS) - 1;
const SENT_MAX: u64 = (1 << (64 - PREDICTED_BITS)) - 2;

/// The router's requests at an endpoint that have no first token yet: when
/// each was sent and what was predicted for it, so that decisions can read
/// the oldest one's age as evidence about the engine now
/// ([`kinference_scoring::Evidence`]). Lock-free: a fixed set of slots, each
/// one atomic word (sent, ms since the router started, + 1, in 40 bits;
/// predicted TTFT, ms, in 24), claimed at send and cleared at the first
/// token or the end. When
/// every slot is taken a new request goes untracked: the oldest ones, which
/// are what counts, already hold slots.
#[derive(Debug, Default)]
pub struct Waiting {
    slots: [AtomicU64; WAITING_SLOTS],
}

impl Waiting {
    fn claim(&self, sent: Duration, predicted: Duration) -> Option<usize> {
        // 40 bits of send time (34 years of uptime), 24 of prediction
        // (4.6 hours, clamped).
        let sent_ms = u64::try_from(sent.as_millis())
            .unwrap_or(u64::MAX)
            .min(SENT_MAX)
            + 1;
        let predicted_ms = u64::try_from(predicted.as_millis())
            .unwrap_or(u64::MAX)
            .min(PREDICTED_MASK);
        let word = (sent_ms << PREDICTED_BITS) | predicted_ms;
        self.slots.iter().position(|s| {
            s.compare_exchange(0, word, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        })
    }

    fn release(&self, slot: usize) {
        if let Some(s) = self.slots.get(slot) {
            s.store(0, Ordering::Relaxed);
        }
    }

    /// The oldest tracked request's `(age at now, predicted TTFT)`, `now`
    /// being the time since the router started.
    pub fn oldest(&self, now: Duration) -> Option<(Duration, Duration)> {
        let word = self
            .slots
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .filter(|&w| w != 0)
            .min()?;
        let sent = Duration::from_millis((word >> PREDICTED_BITS) - 1);
        let predicted = Duration::from_millis(word & PREDICTED_MASK);
        Some((now.saturating_sub(sent), predicted))
    }
}

/// A point-in-time copy of [`Load`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LoadSnapshot {
    /// Requests in flight.
    pub requests: u32,
    /// Of which before their first token.
    pub prefilling: u32,
    /// Their uncached prompt tokens.
    pub prefill_tokens: u64,
    /// Requests decoding.
    pub decoding: u32,
    /// Prompt tokens of the requests in flight.
    pub context_tokens: u64,
}

impl Load {
    /// The load the routers have on the endpoint: this replica's and what
    /// its peers report (what decisions read).
    pub fn snapshot(&self) -> LoadSnapshot {
        self.own().plus(self.peers.snapshot())
    }

    /// The peers' figures alone.
    pub fn peers_snapshot(&self) -> LoadSnapshot {
        self.peers.snapshot()
    }

    /// This replica's own counters (what it reports to its peers and in
    /// its metrics).
    pub fn own(&self) -> LoadSnapshot {
        LoadSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            prefilling: self.prefilling.load(Ordering::Relaxed),
            prefill_tokens: self.prefill_tokens.load(Ordering::Relaxed),
            decoding: self.decoding.load(Ordering::Relaxed),
            context_tokens: self.context_tokens.load(Ordering::Relaxed),
        }
    }
}

impl LoadSnapshot {
    /// Both together (saturating).
    #[must_use]
    pub fn plus(self, o: Self) -> Self {
        Self {
            requests: self.requests.saturating_add(o.requests),
            prefilling: self.prefilling.saturating_add(o.prefilling),
            prefill_tokens: self.prefill_tokens.saturating_add(o.prefill_tokens),
            decoding: self.decoding.saturating_add(o.decoding),
            context_tokens: self.context_tokens.saturating_add(o.context_tokens),
        }
    }
}

/// What an attempt or a probe found out about an endpoint's health.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The engine answered (anything but a 5xx).
    Success,
    /// No connection could be made, or it broke before an answer.
    ConnectFailure,
    /// The engine answered with a 5xx other than 503 (a CUDA fault, an
    /// engine that died behind a live API server).
    ServerError,
    /// No response headers within the upstream timeout, or a stream that
    /// stalled.
    Timeout,
}

/// Health by outlier detection, as Envoy does it: consecutive gateway
/// failures (connect failures, timeouts) eject at once, consecutive 5xx
/// after [`CONSECUTIVE_5XX`]; each ejection lasts [`BASE_EJECTION`] times
/// 2^(ejections so far), at most [`MAX_EJECTION`]. After it, the endpoint
/// takes traffic again; a success forgets the history, another failure
/// ejects it for longer. A 503 is an engine saying "not now" (vLLM's
/// admission control): the request tries another endpoint, the endpoint is
/// not ejected.
#[derive(Debug, Default)]
struct Health {
    consecutive_5xx: u32,
    /// Ejections since the last success (the back-off exponent).
    ejections: u32,
    ejected_until: Option<Instant>,
    /// Consecutive probes that found nothing listening.
    probe_refused: u32,
    /// Consecutive probes without an answer in time.
    probe_timeouts: u32,
    /// The ejection is the probes' doing (a probe that reaches the engine
    /// lifts it).
    by_probe: bool,
}

/// Consecutive 5xx answers (other than 503) that eject an endpoint.
pub const CONSECUTIVE_5XX: u32 = 3;

/// The first ejection's length.
pub const BASE_EJECTION: Duration = Duration::from_millis(500);

/// The longest an endpoint is ejected after failures.
pub const MAX_EJECTION: Duration = Duration::from_secs(30);

/// Consecutive probes finding nothing listening that eject an endpoint and
/// move the requests waiting for its headers elsewhere (the engine is gone).
pub const PROBE_FAILURES_TO_EJECT: u32 = 2;

/// Consecutive probes without an answer in time that eject an endpoint for
/// new requests. Requests already there keep waiting: a busy engine answers
/// probes late and is still working on them.
pub const PROBE_TIMEOUTS_TO_EJECT: u32 = 3;

/// One endpoint.
#[derive(Debug)]
pub struct Endpoint {
    /// Its id.
    pub id: EndpointId,
    /// Its address.
    pub key: EndpointKey,
    /// `address:port` for requests.
    pub authority: String,
    /// The same as a header value (the `x-kinference-endpoint` header).
    pub authority_header: Option<http::HeaderValue>,
    /// Load sent by this router.
    pub load: Load,
    /// Of it, the requests waiting for their first token, by age.
    pub waiting: Waiting,
    /// The LoRA adapters the engine runs and this router's adapter
    /// requests there.
    pub adapters: crate::adapters::Adapters,
    /// When the engine last refused a request with 503 (ms since the router
    /// started, + 1; 0: never).
    refused_at: AtomicU64,
    health: RwLock<Health>,
    /// Woken when probes find the engine unreachable: requests still
    /// waiting for its response headers move to another endpoint.
    down: tokio::sync::Notify,
    models: RwLock<Vec<DiscoveredModel>>,
    models_error: RwLock<Option<String>>,
    scraped: RwLock<Option<Scraped>>,
    /// Set while the endpoint is in the pool; cleared when it leaves.
    live: AtomicBool,
    /// DP ranks whose KV events are subscribed.
    kv_ranks: AtomicU32,
    /// The engine's release, from `/version`.
    version: RwLock<Option<kinference_api::engine::Version>>,
    /// Until when the index may be missing what the engine holds (its
    /// stream started or lost batches without replay): requests ask vLLM
    /// to re-report the blocks they reuse.
    kv_recovering_until: RwLock<Option<Instant>>,
    /// Blocks the KV index holds for it, summed over its DP ranks (refreshed
    /// every second by the maintainer; 0 without KV events; `u64::MAX`: a
    /// hybrid model whose groups' blocks cannot be summed).
    kv_blocks_held: AtomicU64,
    /// Tokens its KV cache holds (`vllm:cache_config_info` when scraped,
    /// SGLang's `/server_info`); 0: unknown.
    kv_capacity: AtomicU64,
    /// Cancelled when the endpoint leaves: stops its tasks.
    pub stop: CancellationToken,
}

impl Endpoint {
    fn new(id: EndpointId, key: EndpointKey, stop: CancellationToken) -> Self {
        let authority = key.authority();
        Self {
            id,
            authority_header: http::HeaderValue::from_str(&authority).ok(),
            authority,
            key,
            load: Load::default(),
            waiting: Waiting::default(),
            refused_at: AtomicU64::new(0),
            health: RwLock::default(),
            down: tokio::sync::Notify::new(),
            adapters: crate::adapters::Adapters::default(),
            models: RwLock::default(),
            models_error: RwLock::default(),
            scraped: RwLock::default(),
            live: AtomicBool::new(true),
            kv_ranks: AtomicU32::new(0),
            version: RwLock::default(),
            kv_recovering_until: RwLock::default(),
            kv_blocks_held: AtomicU64::new(0),
            kv_capacity: AtomicU64::new(0),
            stop,
        }
    }

    /// Whether requests may go here at `now` (not ejected).
    pub fn healthy(&self, now: Instant) -> bool {
        self.health.read().ejected_until.is_none_or(|t| now >= t)
    }

    fn eject(h: &mut Health, now: Instant) {
        h.ejections = h.ejections.saturating_add(1);
        let backoff = BASE_EJECTION
            .saturating_mul(1 << (h.ejections - 1).min(10))
            .min(MAX_EJECTION);
        h.ejected_until = Some(now + backoff);
    }

    /// Records what an attempt found out. Returns whether it ejected the
    /// endpoint.
    pub fn record(&self, outcome: Outcome, now: Instant) -> bool {
        let mut h = self.health.write();
        match outcome {
            Outcome::Success => {
                if h.consecutive_5xx != 0 || h.ejections != 0 || h.ejected_until.is_some() {
                    *h = Health {
                        probe_refused: h.probe_refused,
                        probe_timeouts: h.probe_timeouts,
                        ..Health::default()
                    };
                }
                false
            }
            Outcome::ServerError => {
                h.consecutive_5xx = h.consecutive_5xx.saturating_add(1);
                if h.consecutive_5xx < CONSECUTIVE_5XX {
                    return false;
                }
                h.consecutive_5xx = 0;
                Self::eject(&mut h, now);
                h.by_probe = false;
                true
            }
            Outcome::ConnectFailure | Outcome::Timeout => {
                Self::eject(&mut h, now);
                h.by_probe = false;
                true
            }
        }
    }

    /// Records a failed request (a refusal, no answer in time, a stream
    /// that stalled): ejects the endpoint, with the back-off of
    /// [`Endpoint::record`].
    pub fn record_failure(&self, now: Instant) {
        self.record(Outcome::Timeout, now);
    }

    /// Records a success: the endpoint's failure history is forgotten.
    pub fn record_success(&self) {
        self.record(Outcome::Success, Instant::now());
    }

    /// Records what a probe (or a `/tokenize` call) found:
    /// `Some(Outcome::Success)` an answer, `Some(Outcome::ConnectFailure)`
    /// nothing listening, `Some(Outcome::Timeout)` no answer in time,
    /// `Some(Outcome::ServerError)` a 5xx from `/health` (the engine says it
    /// is dead).
    ///
    /// [`PROBE_FAILURES_TO_EJECT`] refusals (or 5xx health answers) in a
    /// row eject the endpoint and wake the requests waiting for its response
    /// headers, which then try another endpoint: an engine that is gone is
    /// found without waiting for requests to time out on it, and without
    /// traffic at all. [`PROBE_TIMEOUTS_TO_EJECT`] timeouts in a row eject
    /// it for new requests only. A probe that reaches the engine lifts an
    /// ejection the probes caused (not one caused by failed requests: their
    /// back-off runs out). Returns whether this call ejected the endpoint.
    pub fn record_probe(&self, outcome: Outcome, now: Instant) -> bool {
        let mut h = self.health.write();
        match outcome {
            Outcome::Success => {
                if h.by_probe {
                    *h = Health::default();
                } else {
                    h.probe_refused = 0;
                    h.probe_timeouts = 0;
                }
                false
            }
            Outcome::Timeout => {
                h.probe_timeouts = h.probe_timeouts.saturating_add(1);
                let ejected = h.ejected_until.is_some_and(|t| now < t);
                if h.probe_timeouts < PROBE_TIMEOUTS_TO_EJECT || ejected {
                    return false;
                }
                Self::eject(&mut h, now);
                h.by_probe = true;
                true
            }
            Outcome::ConnectFailure | Outcome::ServerError => {
                h.probe_refused = h.probe_refused.saturating_add(1);
                if h.probe_refused < PROBE_FAILURES_TO_EJECT {
                    return false;
                }
                Self::eject(&mut h, now);
                h.by_probe = true;
                drop(h);
                self.down.notify_waiters();
                true
            }
        }
    }

    /// Resolves when probes next find the engine unreachable. Register
    /// (call this) before sending, then await it alongside the response.
    pub fn went_down(&self) -> tokio::sync::futures::Notified<'_> {
        self.down.notified()
    }

    /// The engine refused a request with 503 at `now` (time since the router
    /// started): its admission control is full. Not a failure (no ejection);
    /// evidence for the next decisions.
    pub fn record_refusal(&self, now: Duration) {
        let ms = u64::try_from(now.as_millis()).unwrap_or(u64::MAX - 1);
        self.refused_at.store(ms + 1, Ordering::Relaxed);
    }

    /// Time since the last 503 refusal at `now`, if any.
    pub fn refused_age(&self, now: Duration) -> Option<Duration> {
        match self.refused_at.load(Ordering::Relaxed) {
            0 => None,
            at => Some(now.saturating_sub(Duration::from_millis(at - 1))),
        }
    }

    /// Ejections since the last success (0 when healthy).
    pub fn failures(&self) -> u32 {
        self.health.read().ejections
    }

    /// Models from the last successful `/v1/models`.
    pub fn models(&self) -> Vec<DiscoveredModel> {
        self.models.read().clone()
    }

    /// Whether its last successful `/v1/models` listed any model (no copy).
    pub fn has_models(&self) -> bool {
        !self.models.read().is_empty()
    }

    /// Whether a `/v1/models` call has come back at all (models or an
    /// error).
    pub fn discovery_answered(&self) -> bool {
        self.has_models() || self.models_error.read().is_some()
    }

    /// Whether this endpoint serves `model` (per its last `/v1/models`).
    pub fn serves(&self, model: &str) -> bool {
        self.models.read().iter().any(|m| m.id == model)
    }

    /// Stores the result of a `/v1/models` call.
    pub fn set_models(&self, result: Result<Vec<DiscoveredModel>, String>) {
        match result {
            Ok(models) => {
                *self.models.write() = models;
                *self.models_error.write() = None;
            }
            Err(e) => *self.models_error.write() = Some(e),
        }
    }

    /// The last `/v1/models` error, if the last call failed.
    pub fn models_error(&self) -> Option<String> {
        self.models_error.read().clone()
    }

    /// The last scraped metrics.
    pub fn scraped(&self) -> Option<Scraped> {
        *self.scraped.read()
    }

    /// Stores scraped metrics.
    pub fn set_scraped(&self, s: Scraped) {
        *self.scraped.write() = Some(s);
    }

    /// Blocks the KV index holds for it, as of the maintainer's last
    /// refresh; `None` for a hybrid model (several KV-cache groups, whose
    /// blocks differ in size and do not add up to the cache's).
    pub fn kv_blocks_held(&self) -> Option<u64> {
        let held = self.kv_blocks_held.load(Ordering::Relaxed);
        (held != u64::MAX).then_some(held)
    }

    /// Sets the blocks the KV index holds for it (`None`: a hybrid model).
    pub fn set_kv_blocks_held(&self, blocks: Option<u64>) {
        let held = blocks.map_or(u64::MAX, |b| b.min(u64::MAX - 1));
        self.kv_blocks_held.store(held, Ordering::Relaxed);
    }

    /// Tokens its KV cache holds, as the engine said (a configuration
    /// figure: it does not age).
    pub fn kv_capacity_tokens(&self) -> Option<u64> {
        let t = self.kv_capacity.load(Ordering::Relaxed);
        (t > 0).then_some(t)
    }

    /// Sets the KV-cache size the engine reports (`vllm:cache_config_info`,
    /// SGLang's `/server_info`).
    pub fn set_kv_capacity_tokens(&self, tokens: u64) {
        self.kv_capacity.store(tokens, Ordering::Relaxed);
    }

    /// DP ranks whose KV events are subscribed (a request names a rank only
    /// when there are several).
    pub fn kv_ranks(&self) -> u32 {
        self.kv_ranks.load(Ordering::Relaxed)
    }

    /// Sets the subscribed DP ranks.
    pub fn set_kv_ranks(&self, n: u32) {
        self.kv_ranks.store(n, Ordering::Relaxed);
    }

    /// Whose engine this is: the names of its metrics, else who its model
    /// cards say serves them.
    pub fn family(&self) -> EngineFamily {
        match self.scraped().map(|s| s.family) {
            Some(f @ (EngineFamily::Vllm | EngineFamily::Sglang)) => f,
            _ => match self
                .models
                .read()
                .first()
                .and_then(|m| m.owned_by.as_deref())
            {
                Some("vllm") => EngineFamily::Vllm,
                Some("sglang") => EngineFamily::Sglang,
                _ => EngineFamily::Unknown,
            },
        }
    }

    /// The engine's release, once `/version` answered.
    pub fn version(&self) -> Option<kinference_api::engine::Version> {
        *self.version.read()
    }

    /// Stores the engine's release.
    pub fn set_version(&self, v: kinference_api::engine::Version) {
        *self.version.write() = Some(v);
    }

    /// Whether the engine re-reports the blocks a request reuses when the
    /// request asks (`vllm_xargs.kv_cache_report_mode: "full"`, vLLM ≥ 0.26).
    pub fn reports_reused_blocks_on_request(&self) -> bool {
        self.family() == EngineFamily::Vllm
            && self
                .version()
                .is_some_and(|v| v >= kinference_api::engine::Version::new(0, 26, 0))
    }

    /// The index may be missing this engine's blocks until `until`.
    pub fn kv_recovering_until(&self, until: Instant) {
        let mut r = self.kv_recovering_until.write();
        if r.is_none_or(|t| t < until) {
            *r = Some(until);
        }
    }

    /// Whether the index may be missing this engine's blocks at `now`.
    pub fn kv_recovering(&self, now: Instant) -> bool {
        self.kv_recovering_until.read().is_some_and(|t| now < t)
    }

    /// Whether the endpoint is still in the pool.
    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::Relaxed)
    }

    /// Counts a request as sent: prefilling `prefill_tokens` uncached tokens
    /// of a `context_tokens`-token prompt.
    pub fn begin(self: &Arc<Self>, prefill_tokens: u64, context_tokens: u64) -> InFlight {
        self.load.requests.fetch_add(1, Ordering::Relaxed);
        self.load
            .context_tokens
            .fetch_add(context_tokens, Ordering::Relaxed);
        self.load.prefilling.fetch_add(1, Ordering::Relaxed);
        self.load
            .prefill_tokens
            .fetch_add(prefill_tokens, Ordering::Relaxed);
        crate::peers::load_changed();
        InFlight {
            endpoint: self.clone(),
            prefill_tokens,
            context_tokens,
            phase: Phase::Prefilling,
            waiting_slot: None,
            adapter: None,
            decode_mark: None,
        }
    }
}

/// Where a request's decoding started, to measure its steps at the end.
#[derive(Clone, Copy, Debug)]
struct DecodeMark {
    /// [`clock_micros`] at the first token.
    at: i64,
    /// [`Load::prefilled`] then (its own prompt included), moved up at its
    /// next chunk to the end of its burst: requests whose first token came
    /// in the same engine step, read after its own, were prefilled before
    /// its decoding.
    prefilled: u64,
    /// Its burst ([`Bursts::first_token`]).
    burst: u64,
    /// Whether `prefilled` was moved up.
    settled: bool,
    /// Sequences decoding there (this router's and its peers'), summed
    /// over the chunks after the first: each chunk ends a step, and the
    /// count then is the next step's batch. Averaged per chunk, not per
    /// unit of time: a long prefill step beside few decodes would
    /// otherwise weigh in as many steps.
    decoding_sum: u64,
    /// The chunks summed.
    reads: u32,
    /// [`PeerLoad::prefilled`] at the first chunk [`PEER_LAG`] after the
    /// first token, if the peers say: their reports of first tokens that
    /// came in the same engine step as this one arrive up to a poll late.
    peers_prefilled: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Prefilling,
    Decoding,
}

/// One request's share of an endpoint's load; releases it when dropped.
#[derive(Debug)]
pub struct InFlight {
    endpoint: Arc<Endpoint>,
    prefill_tokens: u64,
    context_tokens: u64,
    phase: Phase,
    /// Its slot in the endpoint's [`Waiting`] until the first token.
    waiting_slot: Option<usize>,
    /// The LoRA adapter it names, counted in the endpoint's adapters.
    adapter: Option<Arc<str>>,
    /// Set at the first token.
    decode_mark: Option<DecodeMark>,
}

impl InFlight {
    /// Counts the request as one for `adapter` there until it ends.
    pub fn for_adapter(&mut self, adapter: &Arc<str>) {
        if self.adapter.is_none() {
            self.endpoint.adapters.begin(adapter);
            self.adapter = Some(adapter.clone());
        }
    }

    /// Tracks the request as waiting for its first token since `sent` (time
    /// since the router started), predicted to take `predicted`.
    pub fn waiting_since(&mut self, sent: Duration, predicted: Duration) {
        if self.phase == Phase::Prefilling && self.waiting_slot.is_none() {
            self.waiting_slot = self.endpoint.waiting.claim(sent, predicted);
        }
    }

    fn stop_waiting(&mut self) {
        if let Some(slot) = self.waiting_slot.take() {
            self.endpoint.waiting.release(slot);
        }
    }

    /// The endpoint this request went to.
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }

    /// The first token arrived (or is assumed to have): prefill work is done.
    /// Idempotent; call it on every chunk of the response.
    pub fn first_token(&mut self) {
        if let Some(mark) = &mut self.decode_mark {
            let l = &self.endpoint.load;
            if !mark.settled {
                let bursts = l.bursts.lock();
                let now = l.prefilled.load(Ordering::Relaxed);
                if let Some(end) = bursts.end(mark.burst, now) {
                    mark.prefilled = mark.prefilled.max(end);
                }
                mark.settled = true;
            }
            if mark.peers_prefilled.is_none()
                && let Some(p) = l.peers.prefilled()
                && clock_micros(Instant::now()) - mark.at >= PEER_LAG
            {
                mark.peers_prefilled = Some(p);
            }
            let decoding = l.decoding.load(Ordering::Relaxed);
            let peers = l.peers.decoding.load(Ordering::Relaxed);
            mark.decoding_sum += u64::from(decoding) + u64::from(peers);
            mark.reads += 1;
            return;
        }
        self.stop_waiting();
        if self.phase == Phase::Prefilling {
            let l = &self.endpoint.load;
            l.prefilling.fetch_sub(1, Ordering::Relaxed);
            l.prefill_tokens
                .fetch_sub(self.prefill_tokens, Ordering::Relaxed);
            let t = clock_micros(Instant::now());
            let mut bursts = l.bursts.lock();
            let before = l.prefilled.fetch_add(self.prefill_tokens, Ordering::SeqCst);
            l.prefilled_version
                .fetch_max(crate::peers::version() + 1, Ordering::SeqCst);
            let burst = bursts.first_token(t, before);
            drop(bursts);
            l.decoding.fetch_add(1, Ordering::Relaxed);
            self.decode_mark = Some(DecodeMark {
                at: t,
                prefilled: before + self.prefill_tokens,
                burst,
                settled: false,
                decoding_sum: 0,
                reads: 0,
                peers_prefilled: None,
            });
            self.phase = Phase::Decoding;
            crate::admit::capacity_freed();
            crate::peers::load_changed();
        }
    }

    /// Whether the first token has been seen.
    pub fn past_first_token(&self) -> bool {
        self.phase == Phase::Decoding
    }

    /// The engine's steps since the first token, now that `tokens` more
    /// have come ([`kinference_scoring::steps`]): the time, the sequences
    /// decoding there on average over its chunks (this router's and, as
    /// they reported them, its peers'), and the prompt tokens prefilled
    /// there meanwhile.
    /// The peers' prefill is what they report prefilled meanwhile, from
    /// [`PEER_LAG`] after the first token (their reports come up to a poll
    /// late, at both ends alike); a shorter stream, or a peer too old to
    /// report it, leaves this router's count scaled by the routers'
    /// requests there over its own.
    /// `None` before the first token.
    pub fn step_sample(&self, tokens: u32) -> Option<kinference_scoring::StepSample> {
        let mark = self.decode_mark?;
        let t = clock_micros(Instant::now());
        let elapsed = t.checked_sub(mark.at).filter(|&e| e > 0)?;
        let l = &self.endpoint.load;
        let decoding = if mark.reads == 0 {
            1.0
        } else {
            mark.decoding_sum as f64 / f64::from(mark.reads)
        };
        let prefilled = l
            .prefilled
            .load(Ordering::Relaxed)
            .saturating_sub(mark.prefilled) as f64;
        let prefill_tokens =
            if let (Some(then), Some(now)) = (mark.peers_prefilled, l.peers.prefilled()) {
                prefilled + now.saturating_sub(then) as f64
            } else {
                let own = f64::from(l.requests.load(Ordering::Relaxed).max(1));
                let peers = f64::from(l.peers.requests.load(Ordering::Relaxed));
                prefilled * (own + peers) / own
            };
        Some(kinference_scoring::StepSample {
            tokens,
            millis: elapsed as f64 / 1e3,
            decoding: decoding.max(1.0),
            prefill_tokens,
        })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.stop_waiting();
        if let Some(a) = self.adapter.take() {
            self.endpoint.adapters.end(&a);
        }
        let l = &self.endpoint.load;
        match self.phase {
            Phase::Prefilling => {
                l.prefilling.fetch_sub(1, Ordering::Relaxed);
                l.prefill_tokens
                    .fetch_sub(self.prefill_tokens, Ordering::Relaxed);
            }
            Phase::Decoding => {
                l.decoding.fetch_sub(1, Ordering::Relaxed);
            }
        }
        l.context_tokens
            .fetch_sub(self.context_tokens, Ordering::Relaxed);
        l.requests.fetch_sub(1, Ordering::Relaxed);
        crate::admit::capacity_freed();
        crate::peers::load_changed();
    }
}

/// Every endpoint of the pool, by address.
///
/// Ids are dense: an id freed when an endpoint leaves is given to the next
/// one that joins (per-endpoint scoring state is indexed by id), so users of
/// ids must forget a removed endpoint's id before the next `sync`.
#[derive(Debug, Default)]
pub struct Registry {
    by_key: HashMap<EndpointKey, Arc<Endpoint>>,
    next_id: u32,
    free: Vec<u32>,
}

/// What [`Registry::sync`] changed.
#[derive(Debug, Default)]
pub struct Changes {
    /// Endpoints that joined: start their tasks.
    pub added: Vec<Arc<Endpoint>>,
    /// Endpoints that left: their tasks are stopped; drop their KV state.
    pub removed: Vec<Arc<Endpoint>>,
}

impl Registry {
    /// Makes the registry hold exactly `keys`: new ones get fresh state (and
    /// a new id), missing ones are stopped and removed. State of endpoints
    /// that stay is kept.
    pub fn sync(
        &mut self,
        keys: impl IntoIterator<Item = EndpointKey>,
        parent: &CancellationToken,
    ) -> Changes {
        let wanted: std::collections::HashSet<EndpointKey> = keys.into_iter().collect();
        let mut changes = Changes::default();
        let free = &mut self.free;
        self.by_key.retain(|k, e| {
            if wanted.contains(k) {
                true
            } else {
                e.live.store(false, Ordering::Relaxed);
                e.stop.cancel();
                free.push(e.id.0);
                changes.removed.push(e.clone());
                false
            }
        });
        // Lowest free ids first, so ids stay small.
        self.free.sort_unstable_by(|a, b| b.cmp(a));
        let mut new: Vec<EndpointKey> = wanted
            .into_iter()
            .filter(|k| !self.by_key.contains_key(k))
            .collect();
        new.sort();
        for k in new {
            {
                let id = EndpointId(self.free.pop().unwrap_or_else(|| {
                    self.next_id += 1;
                    self.next_id - 1
                }));
                let e = Arc::new(Endpoint::new(id, k.clone(), parent.child_token()));
                self.by_key.insert(k, e.clone());
                changes.added.push(e);
            }
        }
        changes
    }

    /// The endpoint at `key`.
    pub fn get(&self, key: &EndpointKey) -> Option<&Arc<Endpoint>> {
        self.by_key.get(key)
    }

    /// Every endpoint.
    pub fn all(&self) -> impl Iterator<Item = &Arc<Endpoint>> {
        self.by_key.values()
    }

    /// Number of endpoints.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(a: &str) -> EndpointKey {
        EndpointKey {
            address: a.into(),
            http_port: 8000,
        }
    }

    /// A registry's one endpoint (its tasks are never started).
    fn one_endpoint() -> Arc<Endpoint> {
        let stop = CancellationToken::new();
        Registry::default()
            .sync([key("10.0.0.1")], &stop)
            .added
            .remove(0)
    }

    #[test]
    fn in_flight_is_released_exactly_once_on_every_path() {
        let e = one_endpoint();
        {
            let mut a = e.begin(1000, 1200);
            let _b = e.begin(500, 600);
            assert_eq!(
                e.load.snapshot(),
                LoadSnapshot {
                    requests: 2,
                    prefilling: 2,
                    prefill_tokens: 1500,
                    decoding: 0,
                    context_tokens: 1800,
                }
            );
            a.first_token();
            a.first_token();
            assert_eq!(
                e.load.snapshot(),
                LoadSnapshot {
                    requests: 2,
                    prefilling: 1,
                    prefill_tokens: 500,
                    decoding: 1,
                    context_tokens: 1800,
                }
            );
        }
        assert_eq!(e.load.snapshot(), LoadSnapshot::default());
    }

    #[test]
    fn step_samples_count_what_the_peers_prefilled_meanwhile() {
        let e = one_endpoint();
        let mut a = e.begin(300, 300);
        a.first_token();
        a.first_token();
        // Reports of first tokens in A's engine step, up to a poll late.
        e.load.peers.add_prefilled(1000);
        std::thread::sleep(Duration::from_micros(PEER_LAG as u64));
        // The chunk that takes the peers' count as the start.
        a.first_token();
        // A peer's request of 600 tokens got its first token meanwhile, and
        // one of this router's of 200.
        let mut b = e.begin(200, 200);
        std::thread::sleep(Duration::from_millis(3));
        b.first_token();
        e.load.peers.add_prefilled(600);
        a.first_token();
        let s = a.step_sample(3).unwrap();
        assert!((s.prefill_tokens - 800.0).abs() < 1e-9, "{s:?}");
        assert_eq!(s.tokens, 3);
        // One decoding at the first two reads, two at the third.
        assert!((s.decoding - 4.0 / 3.0).abs() < 1e-9, "{s:?}");
        // A peer that does not say: this router's count, scaled by the
        // routers' requests (2 of its own, 2 of the peers') over its own.
        e.load.peers.prefilled_known(false);
        e.load.peers.set(Some(LoadSnapshot {
            requests: 2,
            ..LoadSnapshot::default()
        }));
        let s = a.step_sample(3).unwrap();
        assert!((s.prefill_tokens - 400.0).abs() < 1e-9, "{s:?}");
    }

    #[test]
    fn first_tokens_of_one_engine_step_form_one_burst() {
        let mut c = Bursts::default();
        // A, then B 0.3 ms later: one step. C a step (10 ms) later.
        let a = c.first_token(10_000, 0);
        let b = c.first_token(10_300, 100);
        assert_eq!(a, b);
        // At A's next chunk, before C: its burst ends at the count now.
        assert_eq!(c.end(a, 250), Some(250));
        let cc = c.first_token(20_000, 250);
        assert_ne!(cc, a);
        // C read before A's next chunk: A's burst ended at 250, C's prompt
        // was prefilled in A's steps.
        assert_eq!(c.end(a, 400), Some(250));
        c.first_token(30_000, 400);
        assert_eq!(c.end(a, 500), None);
        assert_eq!(c.end(cc, 500), Some(400));
    }

    #[test]
    fn waiting_requests_are_tracked_until_their_first_token_or_end() {
        let e = one_endpoint();
        let ms = Duration::from_millis;
        assert_eq!(e.waiting.oldest(ms(1000)), None);
        let mut a = e.begin(100, 100);
        a.waiting_since(ms(1000), ms(40));
        let mut b = e.begin(100, 100);
        b.waiting_since(ms(1200), ms(70));
        assert_eq!(e.waiting.oldest(ms(1500)), Some((ms(500), ms(40))));
        a.first_token();
        assert_eq!(e.waiting.oldest(ms(1500)), Some((ms(300), ms(70))));
        drop(b);
        assert_eq!(e.waiting.oldest(ms(1500)), None);
        drop(a);
        // Full slots: the oldest stay tracked, newer ones go untracked.
        let mut held: Vec<_> = (0..WAITING_SLOTS as u64 + 4)
            .map(|i| {
                let mut g = e.begin(1, 1);
                g.waiting_since(ms(2000 + i), ms(10));
                g
            })
            .collect();
        assert_eq!(e.waiting.oldest(ms(3000)), Some((ms(1000), ms(10))));
        held.clear();
        assert_eq!(e.waiting.oldest(ms(3000)), None);
        assert_eq!(e.load.snapshot(), LoadSnapshot::default());
        // After 60 days of uptime ages are still right (a 32-bit send
        // time would have clamped at 49.7 days).
        let day = Duration::from_secs(86_400);
        let mut late = e.begin(1, 1);
        late.waiting_since(day * 60, ms(300));
        assert_eq!(
            e.waiting.oldest(day * 60 + ms(250)),
            Some((ms(250), ms(300)))
        );
        drop(late);
        // Refusals.
        assert_eq!(e.refused_age(ms(10)), None);
        e.record_refusal(ms(100));
        assert_eq!(e.refused_age(ms(350)), Some(ms(250)));
        assert!(e.healthy(Instant::now()), "a 503 ejects nothing");
    }

    #[test]
    fn failures_eject_with_growing_backoff_and_success_heals() {
        let e = one_endpoint();
        let t0 = Instant::now();
        assert!(e.healthy(t0));
        assert!(
            e.record(Outcome::ConnectFailure, t0),
            "a connect failure ejects at once"
        );
        assert!(!e.healthy(t0));
        assert!(e.healthy(t0 + BASE_EJECTION));
        e.record(Outcome::ConnectFailure, t0);
        assert!(
            !e.healthy(t0 + Duration::from_millis(999)),
            "the second ejection is twice as long"
        );
        for _ in 0..20 {
            e.record(Outcome::Timeout, t0);
        }
        assert!(!e.healthy(t0 + Duration::from_secs(29)));
        assert!(e.healthy(t0 + MAX_EJECTION));
        e.record(Outcome::Success, t0);
        assert!(e.healthy(t0));
        assert_eq!(e.failures(), 0);
    }

    #[test]
    fn consecutive_server_errors_eject_and_503_never_does() {
        let e = one_endpoint();
        let t0 = Instant::now();
        for _ in 1..CONSECUTIVE_5XX {
            assert!(!e.record(Outcome::ServerError, t0));
            assert!(e.healthy(t0));
        }
        assert!(
            e.record(Outcome::ServerError, t0),
            "the third 5xx in a row ejects"
        );
        assert!(!e.healthy(t0));
        // Readmitted after the back-off; a success in between resets the count.
        let later = t0 + BASE_EJECTION;
        assert!(e.healthy(later));
        e.record(Outcome::ServerError, later);
        e.record(Outcome::Success, later);
        e.record(Outcome::ServerError, later);
        e.record(Outcome::ServerError, later);
        assert!(e.healthy(later), "not three in a row");
    }

    #[tokio::test]
    async fn refused_probes_eject_and_wake_waiting_requests_timeouts_do_not_wake() {
        let e = one_endpoint();
        let t0 = Instant::now();
        // Timeouts: a busy engine. They eject for new requests after three,
        // and never wake the requests already waiting.
        let waiting = e.went_down();
        tokio::pin!(waiting);
        for _ in 1..PROBE_TIMEOUTS_TO_EJECT {
            assert!(!e.record_probe(Outcome::Timeout, t0));
        }
        assert!(e.healthy(t0));
        assert!(e.record_probe(Outcome::Timeout, t0));
        assert!(!e.healthy(t0));
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut waiting)
                .await
                .is_err(),
            "timeouts alone abandon no request"
        );
        assert!(!e.record_probe(Outcome::Success, t0));
        assert!(e.healthy(t0), "an answer lifts the probes' ejection");
        // Refusals: nothing listens. Two in a row eject and wake the waiters.
        assert!(!e.record_probe(Outcome::ConnectFailure, t0));
        assert!(e.healthy(t0));
        assert!(e.record_probe(Outcome::ConnectFailure, t0));
        assert!(!e.healthy(t0));
        tokio::time::timeout(Duration::from_secs(1), &mut waiting)
            .await
            .expect("waiting requests are woken");
        assert!(!e.record_probe(Outcome::Success, t0));
        assert!(e.healthy(t0));
        // An ejection by a failed request is not lifted by a probe.
        e.record(Outcome::ConnectFailure, t0);
        e.record_probe(Outcome::Success, t0);
        assert!(!e.healthy(t0));
        // Probe misses interleaved with successes never eject.
        e.record(Outcome::Success, t0);
        for _ in 0..10 {
            e.record_probe(Outcome::ConnectFailure, t0);
            e.record_probe(Outcome::Success, t0);
        }
        assert!(e.healthy(t0));
    }

    #[test]
    fn sync_keeps_survivors_and_stops_leavers() {
        let stop = CancellationToken::new();
        let mut reg = Registry::default();
        let c = reg.sync([key("a"), key("b")], &stop);
        assert_eq!(c.added.len(), 2);
        let b = reg.get(&key("b")).unwrap().clone();
        let _guard = b.begin(10, 10);
        let c = reg.sync([key("b"), key("c")], &stop);
        assert_eq!(c.added.len(), 1);
        assert_eq!(c.removed.len(), 1);
        assert!(c.removed[0].stop.is_cancelled());
        assert!(!c.removed[0].is_live());
        // b kept its state and id.
        let b2 = reg.get(&key("b")).unwrap();
        assert!(Arc::ptr_eq(&b, b2));
        assert_eq!(b2.load.snapshot().requests, 1);
        assert_eq!(reg.len(), 2);
        assert_ne!(c.added[0].id, b.id);
        // The id "a" freed went to "c".
        assert_eq!(c.added[0].id, c.removed[0].id);
    }

    #[test]
    fn ipv6_authority_has_brackets() {
        assert_eq!(
            EndpointKey {
                address: "fd00::1".into(),
                http_port: 80
            }
            .authority(),
            "[fd00::1]:80"
        );
    }
}
