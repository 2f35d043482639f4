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
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use kinference_api::engine::EngineFamily;
use parking_lot::RwLock;
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

mod health;
mod load;
mod timeline;

use health::Health;
pub use health::{
    BASE_EJECTION, CONSECUTIVE_5XX, MAX_EJECTION, Outcome, PROBE_FAILURES_TO_EJECT,
    PROBE_TIMEOUTS_TO_EJECT,
};
pub use load::{
    Bursts, InFlight, Load, LoadSnapshot, Mark, PeerLoad, StepWindow, WAITING_SLOTS, Waiting,
    clock_micros,
};
pub use timeline::{FirstTokens, MAX_SENT as MAX_REPORTED_FIRST_TOKENS, PeerFirstTokens};

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
    /// Its speed probe ([`crate::speed`]): 0 not started, 1 running, 2
    /// done (observed, failed or skipped).
    speed_probe: std::sync::atomic::AtomicU8,
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
    /// Engine steps that stored blocks: batches with a `BlockStored` event
    /// from any of its streams, counted as they arrive
    /// ([`kinference_scoring::Evidence::stored_steps`]).
    kv_stored_steps: AtomicU64,
    /// Whether one of its KV-event streams was found disconnected
    /// (refreshed every second by the maintainer; false until then).
    kv_disconnected: AtomicBool,
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
            speed_probe: std::sync::atomic::AtomicU8::new(0),
            kv_ranks: AtomicU32::new(0),
            version: RwLock::default(),
            kv_recovering_until: RwLock::default(),
            kv_blocks_held: AtomicU64::new(0),
            kv_capacity: AtomicU64::new(0),
            kv_stored_steps: AtomicU64::new(0),
            kv_disconnected: AtomicBool::new(false),
            stop,
        }
    }

    /// Models from the last successful `/v1/models`.
    pub fn models(&self) -> Vec<DiscoveredModel> {
        self.models.read().clone()
    }

    /// Whether its last successful `/v1/models` listed any model (no copy).
    pub fn has_models(&self) -> bool {
        !self.models.read().is_empty()
    }

    /// Claims the endpoint's speed probe: true once, for the caller that
    /// is to run it.
    pub fn claim_speed_probe(&self) -> bool {
        self.speed_probe
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Its speed probe has ended (observed, failed or skipped).
    pub fn speed_probe_done(&self) {
        self.speed_probe.store(2, Ordering::Release);
    }

    /// Whether its speed probe has not ended (or not started).
    pub fn speed_probe_pending(&self) -> bool {
        self.speed_probe.load(Ordering::Acquire) != 2
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

    /// Engine steps that stored blocks, as counted from its KV events so
    /// far (0: none yet, or its events are not followed).
    pub fn kv_stored_steps(&self) -> u64 {
        self.kv_stored_steps.load(Ordering::Relaxed)
    }

    /// Counts one batch of its KV events that stored blocks.
    pub fn count_kv_stored_step(&self) {
        self.kv_stored_steps.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether its KV events are followed: subscribed, and no stream was
    /// disconnected at the maintainer's last look (a stream just
    /// subscribed counts as followed until then).
    pub fn kv_followed(&self) -> bool {
        self.kv_ranks() > 0 && !self.kv_disconnected.load(Ordering::Relaxed)
    }

    /// Records whether one of its KV-event streams is disconnected.
    pub fn set_kv_disconnected(&self, disconnected: bool) {
        self.kv_disconnected.store(disconnected, Ordering::Relaxed);
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

    pub(super) fn key(a: &str) -> EndpointKey {
        EndpointKey {
            address: a.into(),
            http_port: 8000,
        }
    }

    /// A registry's one endpoint (its tasks are never started).
    pub(super) fn one_endpoint() -> Arc<Endpoint> {
        let stop = CancellationToken::new();
        Registry::default()
            .sync([key("10.0.0.1")], &stop)
            .added
            .remove(0)
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
