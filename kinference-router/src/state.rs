//! The router's shared state and the task that keeps it in step with the
//! catalog.
//!
//! [`Shared`] is what request tasks read: the current [`View`], the KV index,
//! per-worker-set runtimes (policy, tokenizer, prefix record) and metrics.
//! One maintainer task ([`maintain`]) owns every change: when the catalog
//! publishes a snapshot or an engine's models change, it syncs the endpoint
//! registry (starting probes and KV-event subscriptions for new endpoints,
//! stopping them and forgetting their KV blocks and scoring state for
//! endpoints that left), reuses or creates worker-set runtimes, and swaps in
//! a new view.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use kinference_api::v1alpha1::{RoutingProfileSpec, TokenizationMode};
use kinference_kvindex::sub::{self, StreamHealth, SubscriberConfig, SubscriberHandle};
use kinference_kvindex::{KvIndex, WorkerId, WorkerRef};
use kinference_scoring::approx::PrefixRecord;
use kinference_scoring::{LatencyParams, Overrides, Pick, Policy, PolicyName};
use kinference_tokenize::ModelTokenizer;
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::catalog::{Snapshot, WorkerSetRoute};
use crate::endpoint::{Endpoint, EndpointId, EndpointKey, LoadSnapshot, Registry};
use crate::metrics::Metrics;
use crate::probe::{self, ProbeClient, ProbeIntervals};
use crate::proxy::UpstreamClient;
use crate::view::View;

/// Settings of a running router.
#[derive(Clone, Debug)]
pub struct Config {
    /// The routing policy (ours unless benchmarking).
    pub policy: PolicyName,
    /// Largest request body accepted.
    pub body_limit: usize,
    /// Longest wait for a tokenization.
    pub tokenize_timeout: Duration,
    /// Bodies up to this size are tokenized in place on the I/O thread (a
    /// few microseconds with the prefix cache warm); larger ones on the
    /// blocking pool under `tokenize_timeout`.
    pub tokenize_inline_bytes: usize,
    /// Longest wait for an engine's response headers, and between two chunks
    /// of a streamed response.
    pub upstream_timeout: Duration,
    /// Attempts per request on different endpoints (connect failures, 503).
    pub max_attempts: usize,
    /// Probe periods.
    pub probes: ProbeIntervals,
    /// The replay port is the KV port plus this (0: no replay).
    pub kv_replay_offset: u16,
    /// Decisions kept for `/debug/explain`.
    pub explain_buffer: usize,
    /// One decision in this many is explained and kept (besides those asked
    /// for with the debug header); 0 keeps none.
    pub explain_every: u64,
    /// Seed of the tie-breaking random source.
    pub seed: u64,
    /// TTL of the record of prefixes sent (approximate mode, and bursts of a
    /// new prefix before the engine's events arrive).
    pub prefix_ttl: Duration,
    /// Most (block, worker) entries the KV index holds (about 17 bytes each).
    pub kv_max_entries: u64,
    /// Longest wait for a request's headers on the serving port.
    pub header_read_timeout: Duration,
    /// Longest wait for a request's body.
    pub body_read_timeout: Duration,
    /// Most client connections served at once; more wait to be accepted.
    pub max_connections: usize,
    /// Whether `x-kinference-debug` may ask for the decision in headers.
    pub debug_headers: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            policy: PolicyName::Kinference,
            body_limit: 32 << 20,
            tokenize_timeout: Duration::from_millis(250),
            tokenize_inline_bytes: 16 << 10,
            upstream_timeout: Duration::from_secs(600),
            max_attempts: 3,
            probes: ProbeIntervals::default(),
            kv_replay_offset: 1,
            explain_buffer: 64,
            explain_every: 16,
            seed: 0x6b69_6e66,
            prefix_ttl: Duration::from_secs(30),
            kv_max_entries: 50_000_000,
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(60),
            max_connections: 20_000,
            debug_headers: true,
        }
    }
}

/// The state of a worker set's local tokenizer.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "detail")]
pub enum TokenizerState {
    /// The profile does not tokenize locally.
    NotLocal,
    /// Being loaded.
    Loading,
    /// Loaded; not yet compared with the engine.
    Unchecked,
    /// Loaded and agrees with the engine's `/tokenize`.
    Checked,
    /// Could not be loaded: routing uses the engine's `/tokenize`.
    Failed(String),
    /// Disagrees with the engine: routing uses the engine's `/tokenize`.
    Mismatch(String),
}

/// Per-worker-set state that outlives view rebuilds.
#[derive(Debug)]
pub struct WsRuntime {
    /// What it was built from; a change makes a new runtime.
    pub(crate) key: String,
    /// The latency model.
    pub params: LatencyParams,
    /// The profile's tokenization mode.
    pub mode: TokenizationMode,
    /// The policy and its state (calibration, rotation).
    pub policy: Mutex<Policy>,
    /// Where this router sent which prefixes recently.
    pub prefixes: Mutex<PrefixRecord>,
    /// The local tokenizer, once loaded.
    pub tokenizer: RwLock<Option<Arc<ModelTokenizer>>>,
    /// The local tokenizer's state.
    pub tokenizer_state: RwLock<TokenizerState>,
}

impl WsRuntime {
    /// A runtime with a fresh policy and prefix record.
    pub fn new(
        key: String,
        params: LatencyParams,
        mode: TokenizationMode,
        policy: PolicyName,
        prefix_ttl: Duration,
    ) -> Self {
        Self {
            key,
            params,
            mode,
            policy: Mutex::new(Policy::new(policy, params)),
            prefixes: Mutex::new(PrefixRecord::new(
                prefix_ttl,
                kinference_scoring::approx::DEFAULT_CAPACITY,
            )),
            tokenizer: RwLock::new(None),
            tokenizer_state: RwLock::new(TokenizerState::NotLocal),
        }
    }

    /// The tokenization mode in effect: a local tokenizer that failed to load
    /// or disagreed with the engine falls back to the engine's `/tokenize`.
    pub fn effective_mode(&self) -> TokenizationMode {
        match (self.mode, &*self.tokenizer_state.read()) {
            (TokenizationMode::Local, TokenizerState::Failed(_) | TokenizerState::Mismatch(_)) => {
                TokenizationMode::Engine
            }
            (m, _) => m,
        }
    }
}

/// One decision, kept for `/debug/explain`.
#[derive(Clone, Debug, Serialize)]
pub struct DecisionRecord {
    /// Milliseconds since the router started.
    pub at_ms: f64,
    /// The model asked for.
    pub model: String,
    /// The worker set chosen.
    pub worker_set: String,
    /// How tokens were obtained (`local`, `engine`, `approximate`, `none`).
    pub tokens: &'static str,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Blocks of the prompt.
    pub blocks: usize,
    /// Endpoint addresses by scoring id, for reading the explanation.
    pub endpoints: Vec<(u32, String)>,
    /// The policy's explanation.
    pub explanation: kinference_scoring::Explanation,
}

/// KV-event stream state of an endpoint's DP rank, for reports.
#[derive(Clone, Debug, Default, Serialize)]
pub struct KvReport {
    /// Connected now.
    pub connected: bool,
    /// Batches received.
    pub batches: u64,
    /// Sequence gaps.
    pub gaps: u64,
    /// Replays done.
    pub replays: u64,
    /// Publisher restarts seen.
    pub restarts: u64,
    /// Anchored checks after reconnects and idle spells.
    pub checks: u64,
    /// Undecodable batches.
    pub decode_errors: u64,
    /// Blocks the index holds for it.
    pub blocks_held: u64,
    /// Block widths seen in its events, by KV-cache group.
    pub observed_widths: Vec<(u32, u32)>,
    /// Seconds since its last event.
    pub last_event_age_s: Option<f64>,
}

impl KvReport {
    fn from_health(h: &StreamHealth, now: Instant) -> Self {
        Self {
            connected: h.connected,
            batches: h.batches,
            gaps: h.gaps,
            replays: h.replays,
            restarts: h.restarts,
            checks: h.checks,
            decode_errors: h.decode_errors,
            blocks_held: h.blocks_held,
            observed_widths: h.observed_widths.clone(),
            last_event_age_s: h
                .last_event
                .map(|t| now.saturating_duration_since(t).as_secs_f64()),
        }
    }
}

/// One endpoint, for `/debug/endpoints` and metrics.
#[derive(Clone, Debug, Serialize)]
pub struct EndpointReport {
    /// `address:port`.
    pub endpoint: String,
    /// Scoring id.
    pub id: u32,
    /// Worker sets listing it.
    pub worker_sets: Vec<String>,
    /// Takes requests now.
    pub healthy: bool,
    /// Consecutive failures.
    pub failures: u32,
    /// This router's load on it.
    pub load: LoadSnapshot,
    /// Models it serves.
    pub models: Vec<String>,
    /// The last `/v1/models` error.
    pub models_error: Option<String>,
    /// Scraped metrics.
    pub scraped: Option<crate::endpoint::Scraped>,
    /// KV-event streams (one per DP rank), when subscribed.
    pub kv: Option<Vec<KvReport>>,
}

/// One worker set, for `/debug/endpoints` and metrics.
#[derive(Clone, Debug, Serialize)]
pub struct WorkerSetReport {
    /// Its name.
    pub name: String,
    /// The profile named.
    pub profile: String,
    /// Tokenization mode in the profile.
    pub mode: &'static str,
    /// Mode in effect.
    pub effective_mode: &'static str,
    /// Local tokenizer state.
    pub tokenizer: TokenizerState,
    /// Prefix-cache hits and misses of the local tokenizer.
    pub tokenizer_cache: Option<(u64, u64)>,
    /// Whether the local tokenizer disagreed with the engine.
    pub tokenizer_mismatch: bool,
    /// Ready endpoints.
    pub endpoints: usize,
}

/// Everything request tasks share.
pub struct Shared {
    /// Settings.
    pub config: Config,
    view: RwLock<Arc<View>>,
    /// The KV-block index.
    pub kv: Arc<KvIndex>,
    /// KV worker id → (endpoint id, DP rank), for reading lookups.
    owners: RwLock<Vec<Option<(EndpointId, u32)>>>,
    subscriptions: Mutex<HashMap<EndpointId, Vec<(WorkerId, SubscriberHandle)>>>,
    runtimes: Mutex<HashMap<String, Arc<WsRuntime>>>,
    tokenizers: Mutex<HashMap<PathBuf, Arc<ModelTokenizer>>>,
    /// Pooled connections to engines.
    pub upstream: UpstreamClient,
    probes: ProbeClient,
    /// Counters and histograms.
    pub metrics: Metrics,
    /// Time zero for scoring.
    pub epoch: Instant,
    /// Tie-breaking randomness (seeded).
    pub rng: Mutex<kinference_scoring::SplitMix64>,
    decisions: Mutex<VecDeque<DecisionRecord>>,
    problems: RwLock<Vec<String>>,
    decided: AtomicU64,
    ready: AtomicBool,
    /// Cancelled at shutdown.
    pub stop: CancellationToken,
    models_changed: Notify,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Shared {
    /// Fresh state; nothing routable until [`maintain`] runs.
    pub fn new(config: Config, stop: CancellationToken) -> Arc<Self> {
        let seed = config.seed;
        Arc::new(Self {
            view: RwLock::new(Arc::new(View::default())),
            kv: Arc::new(KvIndex::new(kinference_kvindex::IndexConfig {
                max_entries: config.kv_max_entries,
                ..kinference_kvindex::IndexConfig::default()
            })),
            owners: RwLock::default(),
            subscriptions: Mutex::default(),
            runtimes: Mutex::default(),
            tokenizers: Mutex::default(),
            upstream: crate::proxy::client(Duration::from_secs(2)),
            probes: probe::client(Duration::from_secs(2)),
            metrics: Metrics::default(),
            epoch: Instant::now(),
            rng: Mutex::new(kinference_scoring::SplitMix64::new(seed)),
            decisions: Mutex::default(),
            problems: RwLock::default(),
            decided: AtomicU64::new(0),
            ready: AtomicBool::new(false),
            stop,
            models_changed: Notify::new(),
            config,
        })
    }

    /// The current view.
    pub fn view(&self) -> Arc<View> {
        self.view.read().clone()
    }

    /// Whether the first full sync happened.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// `now` for scoring: time since the router started.
    pub fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// The endpoint (and DP rank) owning a KV worker.
    pub fn owner(&self, w: WorkerId) -> Option<(EndpointId, u32)> {
        self.owners.read().get(w.0 as usize).copied().flatten()
    }

    /// What is wrong with the pool's objects as the router sees them
    /// (missing worker sets, unresolvable ports, unknown profiles).
    pub fn problems(&self) -> Vec<String> {
        self.problems.read().clone()
    }

    /// Number of DP ranks subscribed for an endpoint.
    pub fn ranks_of(&self, e: EndpointId) -> usize {
        self.subscriptions.lock().get(&e).map_or(0, Vec::len)
    }

    /// Whether this decision should be explained and kept.
    pub fn sample_explanation(&self) -> bool {
        let every = self.config.explain_every;
        self.config.explain_buffer > 0
            && every > 0
            && self
                .decided
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(every)
    }

    /// Asks the maintainer to rebuild the view (models or tokenizers changed).
    pub fn notify_models_changed(&self) {
        self.models_changed.notify_one();
    }

    /// Keeps a decision for `/debug/explain`.
    pub fn record_decision(&self, d: DecisionRecord) {
        if self.config.explain_buffer == 0 {
            return;
        }
        let mut q = self.decisions.lock();
        if q.len() >= self.config.explain_buffer {
            q.pop_front();
        }
        q.push_back(d);
    }

    /// The last decisions, newest last.
    pub fn decisions(&self) -> Vec<DecisionRecord> {
        self.decisions.lock().iter().cloned().collect()
    }

    /// A report per endpoint.
    pub fn endpoint_reports(&self) -> Vec<EndpointReport> {
        let view = self.view();
        let now = Instant::now();
        let subs = self.subscriptions.lock();
        let mut out: Vec<EndpointReport> = Vec::new();
        for ws in &view.worker_sets {
            for e in &ws.endpoints {
                if let Some(r) = out.iter_mut().find(|r| r.id == e.id.0) {
                    r.worker_sets.push(ws.route.name.clone());
                    continue;
                }
                let kv = subs.get(&e.id).map(|s| {
                    s.iter()
                        .map(|(_, h)| KvReport::from_health(&h.health(), now))
                        .collect()
                });
                out.push(EndpointReport {
                    endpoint: e.authority.clone(),
                    id: e.id.0,
                    worker_sets: vec![ws.route.name.clone()],
                    healthy: e.healthy(now),
                    failures: e.failures(),
                    load: e.load.snapshot(),
                    models: e.models().into_iter().map(|m| m.id).collect(),
                    models_error: e.models_error(),
                    scraped: e.scraped(),
                    kv,
                });
            }
        }
        out
    }

    /// A report per worker set.
    pub fn worker_set_reports(&self) -> Vec<WorkerSetReport> {
        let view = self.view();
        view.worker_sets
            .iter()
            .map(|ws| {
                let rt = &ws.runtime;
                let state = rt.tokenizer_state.read().clone();
                WorkerSetReport {
                    name: ws.route.name.clone(),
                    profile: ws.route.profile_name.clone(),
                    mode: rt.mode.as_str(),
                    effective_mode: rt.effective_mode().as_str(),
                    tokenizer_mismatch: matches!(state, TokenizerState::Mismatch(_)),
                    tokenizer: state,
                    tokenizer_cache: rt.tokenizer.read().as_ref().map(|t| {
                        let s = t.cache_stats();
                        (s.hits, s.misses)
                    }),
                    endpoints: ws.endpoints.len(),
                }
            })
            .collect()
    }
}

/// The latency parameters of a worker set's profile.
///
/// # Errors
/// When the profile's values are out of range.
pub fn params_for(route: &WorkerSetRoute) -> Result<LatencyParams, String> {
    let base =
        LatencyParams::builtin(kinference_api::v1alpha1::DEFAULT_PROFILE).unwrap_or_default();
    let Some(spec) = &route.profile else {
        return Ok(LatencyParams::builtin(&route.profile_name).unwrap_or(base));
    };
    let l = &spec.latency;
    let credits = l.tier_credits.clone().unwrap_or_default();
    let overrides = Overrides {
        prefill_tokens_per_second: l.prefill_tokens_per_second,
        base_millis: l.base_millis,
        decode_cost_millis: l.decode_cost_millis,
        gpu_credit: credits.gpu,
        cpu_credit: credits.cpu,
        disk_credit: credits.disk,
        tolerance_millis: l.tolerance_millis,
        calibrate: l.calibrate,
    };
    base.with_overrides(&overrides).map_err(|e| e.to_string())
}

fn tokenizer_path(spec: Option<&RoutingProfileSpec>) -> Option<Result<PathBuf, String>> {
    let spec = spec?;
    if spec.tokenization.mode != TokenizationMode::Local {
        return None;
    }
    let src = spec.tokenization.tokenizer.as_ref()?;
    Some(match (&src.path, &src.config_map) {
        (Some(p), _) => Ok(PathBuf::from(p)),
        (None, Some(cm)) => Err(format!(
            "tokenizer ConfigMap {}/{} is not supported yet; mount it and give tokenizer.path",
            cm.namespace, cm.name
        )),
        (None, None) => Err("no tokenizer source".into()),
    })
}

impl Shared {
    fn runtime_for(self: &Arc<Self>, route: &WorkerSetRoute) -> Arc<WsRuntime> {
        let params = params_for(route).unwrap_or_else(|e| {
            tracing::warn!(worker_set = %route.name, error = %e, "profile values out of range; using the built-in default");
            LatencyParams::default()
        });
        let mode = route
            .profile
            .as_ref()
            .map_or(TokenizationMode::Engine, |p| p.tokenization.mode);
        let key = format!(
            "{}|{}|{:?}|{}",
            route.kv_block_size,
            self.config.policy.as_str(),
            route.profile,
            route.profile_name
        );
        let mut runtimes = self.runtimes.lock();
        if let Some(rt) = runtimes.get(&route.name)
            && rt.key == key
        {
            return rt.clone();
        }
        let rt = Arc::new(WsRuntime::new(
            key,
            params,
            mode,
            self.config.policy,
            self.config.prefix_ttl,
        ));
        match tokenizer_path(route.profile.as_ref()) {
            None => {}
            Some(Err(e)) => {
                tracing::warn!(worker_set = %route.name, profile = %route.profile_name, error = %e, "local tokenizer unavailable; using the engine's /tokenize");
                *rt.tokenizer_state.write() = TokenizerState::Failed(e);
            }
            Some(Ok(path)) => self.load_tokenizer(&rt, route.name.clone(), path),
        }
        runtimes.insert(route.name.clone(), rt.clone());
        rt
    }

    fn load_tokenizer(self: &Arc<Self>, rt: &Arc<WsRuntime>, ws: String, path: PathBuf) {
        if let Some(t) = self.tokenizers.lock().get(&path) {
            *rt.tokenizer.write() = Some(t.clone());
            *rt.tokenizer_state.write() = TokenizerState::Unchecked;
            return;
        }
        *rt.tokenizer_state.write() = TokenizerState::Loading;
        let (shared, rt) = (self.clone(), rt.clone());
        tokio::spawn(async move {
            let p = path.clone();
            let loaded = tokio::task::spawn_blocking(move || ModelTokenizer::from_dir(&p)).await;
            match loaded {
                Ok(Ok(t)) => {
                    let t = Arc::new(t);
                    shared.tokenizers.lock().insert(path.clone(), t.clone());
                    *rt.tokenizer.write() = Some(t);
                    *rt.tokenizer_state.write() = TokenizerState::Unchecked;
                    tracing::info!(worker_set = %ws, path = %path.display(), "tokenizer loaded");
                    shared.models_changed.notify_one();
                }
                Ok(Err(e)) => {
                    tracing::warn!(worker_set = %ws, path = %path.display(), error = %e, "tokenizer not loaded; using the engine's /tokenize");
                    *rt.tokenizer_state.write() = TokenizerState::Failed(e.to_string());
                }
                Err(e) => *rt.tokenizer_state.write() = TokenizerState::Failed(e.to_string()),
            }
        });
    }

    /// Subscribes to an endpoint's KV events: every DP rank its
    /// `/kv_event_sources` lists (vLLM ≥ 0.31), or rank 0 on the worker
    /// set's KV port (replay on the port plus the configured offset).
    fn subscribe(
        self: &Arc<Self>,
        e: &Arc<Endpoint>,
        address: String,
        kv_port: u16,
        block_size: u32,
    ) {
        let (shared, e) = (self.clone(), e.clone());
        tokio::spawn(async move {
            let host = if address.contains(':') {
                format!("[{address}]")
            } else {
                address.clone()
            };
            let sources =
                probe::kv_event_sources(&shared.probes, &e.authority, shared.config.probes.timeout)
                    .await;
            let ranks: Vec<(u32, String, Option<String>)> = match sources {
                Ok(list) if !list.is_empty() => list
                    .into_iter()
                    .map(|s| {
                        (
                            s.rank,
                            format!("tcp://{host}:{}", s.port),
                            s.replay_port.map(|p| format!("tcp://{host}:{p}")),
                        )
                    })
                    .collect(),
                _ => {
                    let replay = (shared.config.kv_replay_offset != 0)
                        .then(|| kv_port.checked_add(shared.config.kv_replay_offset))
                        .flatten()
                        .map(|p| format!("tcp://{host}:{p}"));
                    vec![(0, format!("tcp://{host}:{kv_port}"), replay)]
                }
            };
            if !e.is_live() {
                return;
            }
            let mut subs = Vec::new();
            for (rank, endpoint, replay) in ranks {
                let id = match shared
                    .kv
                    .register_worker(WorkerRef::new(e.authority.clone(), rank), block_size)
                {
                    Ok(id) => id,
                    Err(err) => {
                        tracing::warn!(endpoint = %e.authority, rank, error = %err, "not subscribing to KV events");
                        continue;
                    }
                };
                {
                    let mut owners = shared.owners.write();
                    let i = id.0 as usize;
                    if owners.len() <= i {
                        owners.resize(i + 1, None);
                    }
                    owners[i] = Some((e.id, rank));
                }
                let mut cfg = SubscriberConfig::new(endpoint);
                if let Some(r) = replay {
                    cfg = cfg.with_replay(r);
                }
                tracing::info!(endpoint = %e.authority, rank, kv = %cfg.endpoint, replay = ?cfg.replay_endpoint, "subscribing to KV events");
                subs.push((id, sub::spawn(cfg, id, shared.kv.clone())));
            }
            let mut all = shared.subscriptions.lock();
            if e.is_live() {
                all.insert(e.id, subs);
            } else {
                drop(all);
                shared.drop_subscriptions(subs);
            }
        });
    }

    fn drop_subscriptions(&self, subs: Vec<(WorkerId, SubscriberHandle)>) {
        for (worker, handle) in subs {
            drop(handle);
            self.kv.remove_worker(worker);
            if let Some(o) = self.owners.write().get_mut(worker.0 as usize) {
                *o = None;
            }
        }
    }

    fn forget(&self, e: &Arc<Endpoint>) {
        let subs = self.subscriptions.lock().remove(&e.id);
        if let Some(subs) = subs {
            self.drop_subscriptions(subs);
        }
        let id = kinference_scoring::EndpointId(e.id.0);
        for rt in self.runtimes.lock().values() {
            rt.policy.lock().remove_endpoint(id);
            rt.prefixes.lock().remove_endpoint(id);
        }
    }
}

/// Keeps `shared` in step with the catalog's snapshots until `stop`.
pub async fn maintain(shared: Arc<Shared>, mut snapshots: watch::Receiver<Arc<Snapshot>>) {
    let mut registry = Registry::default();
    loop {
        let snapshot = snapshots.borrow_and_update().clone();
        apply(&shared, &mut registry, &snapshot);
        tokio::select! {
            () = shared.stop.cancelled() => break,
            r = snapshots.changed() => if r.is_err() { break },
            () = shared.models_changed.notified() => {}
        }
    }
    // Stop every endpoint's tasks.
    registry.sync(std::iter::empty(), &shared.stop);
    shared.subscriptions.lock().clear();
}

fn apply(shared: &Arc<Shared>, registry: &mut Registry, snapshot: &Snapshot) {
    let keys = snapshot.endpoints().map(|(_, e)| EndpointKey {
        address: e.address.clone(),
        http_port: e.http_port,
    });
    let changes = registry.sync(keys, &shared.stop);
    for e in &changes.removed {
        shared.forget(e);
        tracing::info!(endpoint = %e.authority, "endpoint left");
    }
    for e in &changes.added {
        tracing::info!(endpoint = %e.authority, "endpoint joined");
        let s = shared.clone();
        probe::spawn(
            e.clone(),
            shared.probes.clone(),
            shared.config.probes,
            move || s.models_changed.notify_one(),
        );
        // Subscribe to KV events with the first worker set that lists it.
        if let Some((ws, re)) = snapshot
            .endpoints()
            .find(|(_, r)| r.address == e.key.address && r.http_port == e.key.http_port)
            && let (true, Some(kv_port)) = (ws.kv_events, re.kv_port)
        {
            shared.subscribe(e, re.address.clone(), kv_port, ws.kv_block_size);
        }
    }
    let live: Vec<String> = snapshot
        .worker_sets
        .iter()
        .map(|w| w.name.clone())
        .collect();
    shared.runtimes.lock().retain(|name, _| live.contains(name));
    let view = View::build(snapshot, registry, &|route| shared.runtime_for(route));
    *shared.view.write() = Arc::new(view);
    shared.ready.store(snapshot.synced, Ordering::Relaxed);
    {
        let mut problems = shared.problems.write();
        if *problems != snapshot.problems {
            for p in snapshot.problems.iter().filter(|p| !problems.contains(p)) {
                tracing::warn!(problem = %p, "the pool's objects need attention");
            }
            problems.clone_from(&snapshot.problems);
        }
    }
    crate::tokens::spawn_self_checks(shared);
}
