//! An engine simulator that behaves like a loaded GPU running vLLM or SGLang.
//!
//! It answers the engine's HTTP API (OpenAI completions and chat, streaming
//! or not, tokenization, `/metrics` with the engine's names, `/v1/models`,
//! `/health`, vLLM's `/kv_event_sources`, SGLang's `/server_info`),
//! publishes KV-cache events on ZeroMQ byte-compatible with the chosen
//! release (and a replay ROUTER when configured), and takes as long as an
//! engine with a prefix cache and continuous batching would: time to first
//! token depends on cache hits and queueing. Routers and benchmarks run
//! fleets of them in one process, cheaply.
//!
//! # Features
//!
//! | feature | where |
//! |---|---|
//! | engine family and release: vLLM 0.22–0.33, SGLang 0.5.10–0.5.23 (default vLLM 0.33) | [`EngineMode`], [`mode`] |
//! | KV events as the release writes them; replay only when configured ([`KvEventsConfig::with_replay`]) | [`KvEventsConfig`] |
//! | block hashes: vLLM `sha256_cbor` from a fixed or per-engine NONE_HASH, SGLang's page chain | [`HashSeed`], [`hash`] |
//! | vLLM's `kv_cache_report_mode: "full"` (`vllm_xargs`) re-announcing prefix hits | [`engine`] |
//! | vLLM's admission control (`--max-num-queued-reqs`, `--max-num-queued-tokens`) | [`AdmissionLimits`] |
//! | `--api-key` with each engine's guarded paths | [`SimConfig::api_key`], [`ApiKeyScope`] |
//! | faults: slow, stalled or restarting engines, lost batches, cut streams, CUDA faults, a dead engine core, admission rejections, a fraction of failing requests, slow `/metrics` | [`FaultConfig`], [`FaultRequest`] |
//! | LoRA adapters (`--lora-modules`, `--max-loras`, vLLM only): `/v1/models` cards, a prefix cache of their own per adapter, `lora_id`/`lora_name` in events, at most `max_loras` adapters per batch, slot loads, `vllm:lora_requests_info` | [`LoraConfig`] |
//! | the truth: cached blocks, counters, queues, publisher state | [`CacheTruth`] |
//!
//! # Start engines in-process
//!
//! ```no_run
//! use kinference_sim::{SimConfig, SimEngine};
//!
//! # async fn demo() -> Result<(), kinference_sim::SimError> {
//! let engine = SimEngine::spawn(SimConfig::default()).await?;
//! println!("OpenAI API on {}, KV events on {:?}", engine.base_url(), engine.kv_addr());
//! // … send requests, subscribe to events, read engine.cache_truth() …
//! engine.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! [`SimFleet::spawn`] starts N engines on consecutive ports (or ephemeral
//! ones) sharing one tokenizer; the binary `kinference-sim --engines N`
//! does the same from the command line.
//!
//! # Data model
//!
//! One [`SimEngine`] is one engine server: an HTTP listener in front of
//! `dp_size` *engine cores* (DP ranks). Each core ([`engine::EngineCore`])
//! has its own block pool (prefix cache), scheduler, clock task and KV-event
//! publisher (PUB on base port + rank). Requests go to the least loaded rank
//! (`4 × waiting + running`, vLLM's DP balancer) or to the rank named by the
//! `X-data-parallel-rank` header.
//!
//! * Prefix cache: vLLM V1's `BlockPool` ([`pool`]): full blocks keyed by a
//!   SHA-256 chain identical to vLLM's `sha256_cbor` ([`hash`]), LRU
//!   eviction of unreferenced blocks (a request's tail first), duplicates
//!   and all.
//! * Scheduler: running requests first, then waiting ones, under a token
//!   budget (chunked prefill) and `max_num_seqs`; recompute preemption when
//!   blocks run out ([`engine`]).
//! * Time: a step lasts `a + b·prefill tokens + c·decoding sequences`
//!   ([`LatencyModel`], calibration in its docs); the clock task sleeps until
//!   the step is due (one tokio task per core), so idle and busy engines cost no CPU
//!   between steps.
//! * Output: lengths from `max_tokens` or a seeded distribution
//!   ([`OutputLen`]); tokens from a fixed plain-word table, so no
//!   detokenization ([`textgen`]).
//!
//! # Invariants
//!
//! * A `BlockStored` is published for every block the moment vLLM would
//!   cache it (at scheduling), with its parent; a `BlockRemoved` for every
//!   cached block that allocation reuses; `AllBlocksCleared` after a
//!   successful reset. Batches are published in engine order, one per step
//!   that produced events, `seq` counting from 0 per publisher (restart).
//!   In SGLang mode a digest is announced once while cached (set
//!   semantics) and removed when its last copy goes.
//! * [`SimHandle::cache_truth`] (`GET /debug/cache`) is the set of blocks the
//!   engine would hit right now. Replaying every published event onto a
//!   multiset (`BlockStored` +1 per hash, `BlockRemoved` −1,
//!   `AllBlocksCleared` empties it) yields exactly each digest's number of
//!   `copies` (vLLM can cache one digest in two blocks, and then reports
//!   each eviction), unless a fault dropped batches or a
//!   `kv_cache_report_mode: "full"` request re-announced cached blocks
//!   (counted in [`Counters::blocks_rereported`]; consumers must treat a
//!   `BlockStored` as an idempotent upsert, as the spec says).
//! * Same seed, same prompt ⇒ same output tokens on every engine.
//!
//! # Complexity and cost
//!
//! Per step: O(scheduled requests + blocks touched); per request: one
//! SHA-256 per full prompt block, one JSON parse, one tokenization (on the
//! blocking pool), one small channel message and (streaming) one SSE chunk
//! per output token. See the `sim` bench for measured figures.
//!
//! # Endpoints beyond vLLM's
//!
//! | endpoint | what |
//! |---|---|
//! | `GET /debug/cache[?rank=R&tokens=1&digests=1&summary=1]` | true cached blocks, counters, queues, publisher state |
//! | `GET /debug/requests[?limit=N]` | timings of recent requests (engine seconds) |
//! | `POST /debug/prefix_match` | cached prefix tokens per rank for `{"tokens": […]}`, a prompt or messages |
//! | `GET/POST /admin/faults` | fault state / inject faults ([`FaultRequest`]) |
//! | `POST /reset_prefix_cache` | vLLM's dev endpoint: `AllBlocksCleared` (409 while requests hold blocks); SGLang's is `/flush_cache` |
//!
//! The API key never guards these.

pub mod config;
mod driver;
pub mod engine;
pub mod hash;
pub mod mode;
pub mod pool;
pub mod textgen;

mod api;
mod events;
mod faults;
mod http;
mod metrics;
mod surface;
mod truth;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use config::{
    AdmissionLimits, EngineConfig, FailMode, FaultConfig, HashRepr, HashSeed, KvEventsConfig,
    LatencyModel, LoraConfig, LoraModule, OutputLen, SimConfig,
};
pub use engine::{CoreStats, RequestRecord};
pub use faults::{FaultReport, FaultRequest};
pub use hash::{BlockHasher, Digest, HashExtra};
pub use kinference_kvindex::codec::frames::ReplayLayout;
pub use mode::{ApiKeyScope, EngineMode, Family, Version};
pub use textgen::SimTokenizer;
pub use truth::{BlockTruth, CacheTruth, Counters, KvEndpoint, PublisherTruth, RankTruth};

use crate::api::ApiError;
use crate::driver::Rank;
use crate::engine::EngineCore;
use crate::events::Publisher;
use crate::faults::LiveFaults;

/// The newest vLLM release whose wire formats the simulator reproduces
/// (the default engine mode).
pub const VLLM_VERSION: &str = "0.33.0";

/// Why an engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A configuration value is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A port could not be bound.
    #[error("cannot bind {addr}: {reason}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        reason: String,
    },
    /// The tokenizer could not be loaded.
    #[error("cannot load the tokenizer")]
    Tokenizer(#[from] kinference_tokenize::LoadError),
}

/// What the HTTP handlers share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) cfg: SimConfig,
    pub(crate) tok: Arc<SimTokenizer>,
    pub(crate) ranks: Vec<Arc<Rank>>,
    /// Engine-wide failures (`/admin/faults`).
    pub(crate) faults: LiveFaults,
    /// `vllm:admission_rejections_total` by reason.
    pub(crate) admission_rejections: metrics::Rejections,
    /// `vllm:lora_requests_info`, every label combination set so far.
    pub(crate) lora_series: metrics::LoraSeries,
    /// The W3C `traceparent` of recent generation requests (vLLM started
    /// with `--otlp-traces-endpoint` makes its request span their child).
    pub(crate) trace_parents: std::sync::Mutex<std::collections::VecDeque<String>>,
    /// Responses API answers kept for retrieval (`SimConfig::responses_store`).
    pub(crate) responses: std::sync::Mutex<http::ResponseStore>,
    id_salt: u64,
    id_seq: AtomicU64,
}

impl Shared {
    /// Keeps a request's `traceparent`, as vLLM reads it for its spans.
    pub(crate) fn note_trace_parent(&self, headers: &axum::http::HeaderMap) {
        if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
            let Ok(mut q) = self.trace_parents.lock() else {
                return;
            };
            if q.len() == 64 {
                q.pop_front();
            }
            q.push_back(tp.to_owned());
        }
    }

    pub(crate) fn next_id_hex(&self) -> String {
        let n = self.id_seq.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}{:016x}", self.id_salt, n)
    }

    /// The requested model name, checked (a served name or a LoRA
    /// adapter's); the served name when absent.
    pub(crate) fn check_model(&self, model: Option<&Value>) -> Result<String, ApiError> {
        self.resolve_model(model).map(|t| t.name)
    }

    /// What the requested model names: the name to echo and the LoRA
    /// adapter to run as (`None`: the base model). An unknown name is
    /// vLLM's 404 (`NotFoundError`, "The model `x` does not exist.").
    pub(crate) fn resolve_model(&self, model: Option<&Value>) -> Result<Target, ApiError> {
        match model {
            // vLLM serves its base model to a request naming none.
            None | Some(Value::Null) => Ok(Target {
                name: self.cfg.model.clone(),
                lora: None,
            }),
            Some(Value::String(m)) if m.is_empty() => Ok(Target {
                name: self.cfg.model.clone(),
                lora: None,
            }),
            Some(Value::String(m)) if self.cfg.served_names().any(|n| n == m) => Ok(Target {
                name: m.clone(),
                lora: None,
            }),
            Some(Value::String(m)) => match self.cfg.lora.id_of(m) {
                Some(id) => Ok(Target {
                    name: m.clone(),
                    lora: Some(id),
                }),
                None => Err(ApiError::not_found(format!(
                    "The model `{m}` does not exist."
                ))),
            },
            Some(v) => Err(ApiError::bad_param(
                "model",
                format!("`model` must be a string, got {v}"),
            )),
        }
    }

    /// The name of LoRA adapter id `id`.
    pub(crate) fn lora_name(&self, id: u32) -> &str {
        self.cfg.lora.module(id).map_or("", |m| m.name.as_str())
    }

    fn pick_rank(&self, headers: &axum::http::HeaderMap) -> Result<Arc<Rank>, ApiError> {
        if let Some(v) = headers.get("x-data-parallel-rank") {
            let r = v
                .to_str()
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .filter(|r| *r < self.ranks.len())
                .ok_or_else(|| {
                    ApiError::bad(format!(
                        "X-data-parallel-rank must be a rank below {}",
                        self.ranks.len()
                    ))
                })?;
            return Ok(self.ranks[r].clone());
        }
        self.ranks
            .iter()
            .min_by_key(|r| r.load_score())
            .cloned()
            .ok_or_else(|| ApiError::internal("no engine core"))
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.ranks
            .iter()
            .map(|r| {
                let st = r.lock();
                st.core.num_running() + st.core.num_waiting()
            })
            .sum()
    }

    pub(crate) fn render_metrics(&self) -> String {
        let e = &self.cfg.engine;
        let cache_info: Vec<(&str, String)> = vec![
            ("block_size", e.block_size.to_string()),
            ("cache_dtype", "auto".to_owned()),
            ("enable_prefix_caching", py_bool(e.enable_prefix_caching)),
            ("gpu_memory_utilization", "0.9".to_owned()),
            ("hash_block_size", e.block_size.to_string()),
            (
                "kv_cache_size_tokens",
                ((e.num_gpu_blocks - 1) * e.block_size).to_string(),
            ),
            ("num_cpu_blocks", "None".to_owned()),
            ("num_gpu_blocks", e.num_gpu_blocks.to_string()),
            ("prefix_caching_hash_algo", "sha256_cbor".to_owned()),
        ];
        let guards: Vec<_> = self.ranks.iter().map(|r| (r.index, r.lock())).collect();
        let ranks: Vec<metrics::RankMetrics<'_>> = guards
            .iter()
            .map(|(rank, st)| metrics::RankMetrics {
                rank: *rank,
                running: st.core.num_running(),
                waiting: st.core.num_waiting(),
                usage: st.core.kv_usage(),
                used_tokens: (st.core.capacity_blocks() - st.core.free_blocks()) * e.block_size,
                stats: st.core.stats(),
            })
            .collect();
        let mode = self.cfg.engine_mode;
        if mode.is_sglang() {
            return metrics::render_sglang(&self.cfg.model, self.ranks.len() > 1, &ranks);
        }
        let mut out = metrics::render(&self.cfg.model, &cache_info, &ranks);
        if mode.has_admission_control() {
            self.admission_rejections.render(&mut out, &self.cfg.model);
        }
        if self.cfg.lora.enabled() {
            // One series for the server, as vLLM's API process keeps one
            // gauge: the adapters of every rank, each named once.
            let (mut running, mut waiting) = (Vec::new(), Vec::new());
            for (_, st) in &guards {
                for (ids, into) in [
                    (st.core.running_loras(), &mut running),
                    (st.core.waiting_loras(), &mut waiting),
                ] {
                    for id in ids {
                        let name = self.lora_name(id);
                        if !into.contains(&name) {
                            into.push(name);
                        }
                    }
                }
            }
            self.lora_series.render(
                &mut out,
                &running,
                &waiting,
                self.cfg.lora.max_loras,
                unix_time(),
            );
        }
        out
    }

    pub(crate) fn kv_event_sources(&self) -> Value {
        let Some(kv) = &self.cfg.kv_events else {
            return json!({});
        };
        let mut out = serde_json::Map::new();
        for r in &self.ranks {
            let Some(p) = &r.publisher else { continue };
            out.insert(
                r.index.to_string(),
                json!({
                    "enable_kv_cache_events": true,
                    "publisher": "zmq",
                    "endpoint": endpoint_str(p.info.pub_addr),
                    "replay_endpoint": p.info.replay_addr.map(endpoint_str),
                    "buffer_steps": kv.buffer_steps,
                    "hwm": 100_000,
                    "max_queue_size": 100_000,
                    "topic": kv.topic,
                }),
            );
        }
        Value::Object(out)
    }

    fn reset_prefix_cache(&self) -> bool {
        // Every rank is tried; the answer is whether all succeeded.
        let results: Vec<bool> = self.ranks.iter().map(|r| r.reset_prefix_cache()).collect();
        results.into_iter().all(|ok| ok)
    }

    fn cached_prefix_tokens(&self, tokens: &[u32], lora: Option<u32>) -> Vec<usize> {
        self.ranks
            .iter()
            .map(|r| r.lock().core.cached_prefix_tokens_for(tokens, lora))
            .collect()
    }
}

/// A request's model, resolved ([`Shared::resolve_model`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    /// The name the response echoes.
    pub(crate) name: String,
    /// The LoRA adapter's integer id; `None`: the base model.
    pub(crate) lora: Option<u32>,
}

/// Seconds since the Unix epoch.
fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn py_bool(b: bool) -> String {
    if b { "True" } else { "False" }.to_owned()
}

fn endpoint_str(addr: SocketAddr) -> String {
    if addr.ip().is_unspecified() {
        format!("tcp://*:{}", addr.port())
    } else {
        format!("tcp://{addr}")
    }
}

/// Starts simulated engines.
#[derive(Debug, Clone, Copy)]
pub struct SimEngine;

impl SimEngine {
    /// Starts one engine (HTTP server, `dp_size` cores with their clock tasks
    /// and publishers) on the current tokio runtime.
    ///
    /// # Errors
    /// [`SimError`] for an invalid configuration or a port in use.
    pub async fn spawn(cfg: SimConfig) -> Result<SimHandle, SimError> {
        cfg.validate()?;
        let tok = cfg
            .tokenizer
            .clone()
            .unwrap_or_else(SimTokenizer::word_level);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let epoch = tokio::time::Instant::now();
        let mut ranks = Vec::with_capacity(cfg.dp_size as usize);
        let mut tasks = Vec::new();
        // With several DP ranks on ephemeral ports, rank r still publishes
        // on base + r, as every consumer of either engine assumes.
        let kv_cfg = match &cfg.kv_events {
            Some(kv) if cfg.dp_size > 1 => Some(events::consecutive_ports(kv, cfg.dp_size)?),
            other => other.clone(),
        };
        for rank in 0..cfg.dp_size {
            let core = EngineCore::new(
                cfg.engine.clone(),
                cfg.engine_mode,
                cfg.latency,
                cfg.output,
                cfg.max_model_len,
                cfg.seed,
                tok.clone(),
            )
            .with_loras(&cfg.lora);
            let publisher = match &kv_cfg {
                Some(kv) => Some(
                    Publisher::start(
                        kv,
                        cfg.engine_mode,
                        rank,
                        rank as u16,
                        cfg.engine.block_size,
                        cfg.lora.modules.iter().map(|m| m.name.clone()).collect(),
                        shutdown_rx.clone(),
                    )
                    .await?,
                ),
                None => None,
            };
            if let Some(p) = &publisher {
                p.info
                    .drop_every
                    .store(cfg.faults.drop_every, Ordering::Relaxed);
            }
            let rank = Arc::new(Rank::new(rank, core, publisher, epoch, cfg.faults.slowdown));
            tasks.push(tokio::spawn(rank.clone().drive(shutdown_rx.clone())));
            ranks.push(rank);
        }
        let listener = tokio::net::TcpListener::bind(cfg.http_addr)
            .await
            .map_err(|e| SimError::Bind {
                addr: cfg.http_addr,
                reason: e.to_string(),
            })?;
        let http_addr = listener.local_addr().map_err(|e| SimError::Bind {
            addr: cfg.http_addr,
            reason: e.to_string(),
        })?;
        let shared = Arc::new(Shared {
            id_salt: xxhash_rust::xxh3::xxh3_64(format!("{http_addr}/{}", cfg.seed).as_bytes()),
            faults: LiveFaults::new(&cfg.faults),
            admission_rejections: metrics::Rejections::default(),
            lora_series: metrics::LoraSeries::default(),
            trace_parents: std::sync::Mutex::default(),
            responses: std::sync::Mutex::default(),
            cfg,
            tok,
            ranks,
            id_seq: AtomicU64::new(0),
        });
        let app = http::router(shared.clone());
        let mut stop = shutdown_rx.clone();
        let server = tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = stop.wait_for(|s| *s).await;
            });
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "http server failed");
            }
        });
        tracing::info!(%http_addr, model = %shared.cfg.model, dp_size = shared.ranks.len(), "simulated engine up");
        tasks.push(server);
        Ok(SimHandle {
            http_addr,
            shared,
            shutdown,
            tasks,
        })
    }
}

/// A running engine. Dropping it signals the engine to stop (in-flight
/// requests end abruptly); [`SimHandle::shutdown`] also waits until it has.
#[derive(Debug)]
pub struct SimHandle {
    http_addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl SimHandle {
    /// The HTTP address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// `http://<addr>` (the OpenAI base URL is this plus `/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    /// The served model name.
    pub fn model(&self) -> &str {
        &self.shared.cfg.model
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &SimConfig {
        &self.shared.cfg
    }

    /// The tokenizer it serves with.
    pub fn tokenizer(&self) -> &Arc<SimTokenizer> {
        &self.shared.tok
    }

    /// Rank 0's KV-event PUB address.
    pub fn kv_addr(&self) -> Option<SocketAddr> {
        self.kv_endpoints().first().map(|e| e.pub_addr)
    }

    /// Rank 0's replay ROUTER address.
    pub fn replay_addr(&self) -> Option<SocketAddr> {
        self.kv_endpoints().first().and_then(|e| e.replay_addr)
    }

    /// Every rank's KV-event endpoints.
    pub fn kv_endpoints(&self) -> Vec<KvEndpoint> {
        self.shared
            .ranks
            .iter()
            .filter_map(|r| {
                r.publisher.as_ref().map(|p| KvEndpoint {
                    rank: r.index,
                    pub_addr: p.info.pub_addr,
                    replay_addr: p.info.replay_addr,
                })
            })
            .collect()
    }

    /// The true cache contents and counters of every rank (`with_tokens`
    /// adds each block's token ids).
    pub fn cache_truth(&self, with_tokens: bool) -> CacheTruth {
        self.shared.cache_truth(None, with_tokens, false, true)
    }

    /// Prompt tokens of `tokens` each rank would serve from its cache now
    /// (for the base model).
    pub fn cached_prefix_tokens(&self, tokens: &[u32]) -> Vec<usize> {
        self.shared.cached_prefix_tokens(tokens, None)
    }

    /// [`SimHandle::cached_prefix_tokens`] for a request naming `model`: a
    /// served name (the base model's cache) or a LoRA adapter (that
    /// adapter's blocks only). `None` for a model the engine does not serve.
    pub fn cached_prefix_tokens_for(&self, tokens: &[u32], model: &str) -> Option<Vec<usize>> {
        let target = self
            .shared
            .resolve_model(Some(&Value::String(model.to_owned())))
            .ok()?;
        Some(self.shared.cached_prefix_tokens(tokens, target.lora))
    }

    /// The `traceparent` headers of the last generation requests (up to
    /// 64, oldest first).
    pub fn trace_parents(&self) -> Vec<String> {
        self.shared
            .trace_parents
            .lock()
            .map(|q| q.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Timings of recently finished requests, per rank (engine seconds).
    pub fn recent_requests(&self) -> Vec<Vec<RequestRecord>> {
        self.shared
            .ranks
            .iter()
            .map(|r| r.lock().core.recent().copied().collect())
            .collect()
    }

    /// Resets every rank's prefix cache (true if all were idle).
    pub fn reset_prefix_cache(&self) -> bool {
        self.shared.reset_prefix_cache()
    }

    /// Injects faults, as `POST /admin/faults` does.
    ///
    /// # Errors
    /// A message for an unknown rank or a bad slowdown.
    pub async fn inject(&self, faults: &FaultRequest) -> Result<FaultReport, String> {
        self.shared.apply_faults(faults).await
    }

    /// Stops the engine and waits for it: in-flight requests end
    /// abruptly, sockets close.
    pub async fn shutdown(mut self) {
        for r in &self.shared.ranks {
            r.kill_all();
        }
        let _ = self.shutdown.send(true);
        for t in std::mem::take(&mut self.tasks) {
            let _ = t.await;
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
    }
}

/// Many engines in one process, on consecutive ports.
#[derive(Debug)]
pub struct SimFleet {
    engines: Vec<SimHandle>,
}

impl SimFleet {
    /// Starts `n` engines from `template`. Engine i listens on HTTP port
    /// `template.http_addr.port() + i` and publishes rank r on KV port
    /// `kv.port + i·dp_size + r` (replay likewise from `kv.replay_port`);
    /// ports that are 0 stay ephemeral. All engines share one tokenizer
    /// (loaded once) and the seed, so they answer the same prompt alike.
    ///
    /// # Errors
    /// As [`SimEngine::spawn`]; engines already started are shut down.
    pub async fn spawn(template: SimConfig, n: usize) -> Result<SimFleet, SimError> {
        let mut template = template;
        if template.tokenizer.is_none() {
            template.tokenizer = Some(SimTokenizer::word_level());
        }
        let mut engines = Vec::with_capacity(n);
        let dp = template.dp_size;
        for i in 0..n {
            let mut cfg = template.clone();
            let shift = |port: u16, by: u32| -> Result<u16, SimError> {
                if port == 0 {
                    return Ok(0);
                }
                u16::try_from(u32::from(port) + by)
                    .map_err(|_| SimError::Config(format!("port {port} + {by} overflows")))
            };
            cfg.http_addr
                .set_port(shift(template.http_addr.port(), i as u32)?);
            if let Some(kv) = &mut cfg.kv_events {
                kv.port = shift(kv.port, i as u32 * dp)?;
                if let Some(rp) = kv.replay_port {
                    kv.replay_port = Some(shift(rp, i as u32 * dp)?);
                }
            }
            match SimEngine::spawn(cfg).await {
                Ok(h) => engines.push(h),
                Err(e) => {
                    for h in engines {
                        h.shutdown().await;
                    }
                    return Err(e);
                }
            }
        }
        Ok(SimFleet { engines })
    }

    /// The engines, in port order.
    pub fn engines(&self) -> &[SimHandle] {
        &self.engines
    }

    /// Stops every engine.
    pub async fn shutdown(self) {
        futures::future::join_all(self.engines.into_iter().map(SimHandle::shutdown)).await;
    }
}
