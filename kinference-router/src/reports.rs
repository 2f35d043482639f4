//! What the router tells operators about itself: per-endpoint and
//! per-worker-set reports (`/debug/endpoints`, the state metrics) and the
//! last decisions explained (`/debug/explain`).
//!
//! Reports are built on demand from the view and the KV plane; nothing here
//! is copied on the request path except a sampled decision's explanation.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::Serialize;
use tokio::time::Instant;

use crate::endpoint::{LoadSnapshot, Scraped};
use crate::kv::{KvPlane, KvReport};
use crate::runtime::TokenizerState;
use crate::view::View;

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

/// The last explained decisions, and which decisions to explain.
#[derive(Debug)]
pub struct Explanations {
    kept: Mutex<VecDeque<DecisionRecord>>,
    capacity: usize,
    every: u64,
    decided: AtomicU64,
}

impl Explanations {
    /// Keeps at most `capacity` decisions, explaining one in `every` (0:
    /// none unless asked for).
    pub fn new(capacity: usize, every: u64) -> Self {
        Self {
            kept: Mutex::default(),
            capacity,
            every,
            decided: AtomicU64::new(0),
        }
    }

    /// Whether this decision should be explained and kept.
    pub fn sample(&self) -> bool {
        self.capacity > 0
            && self.every > 0
            && self
                .decided
                .fetch_add(1, Ordering::Relaxed)
                .is_multiple_of(self.every)
    }

    /// Keeps a decision.
    pub fn keep(&self, d: DecisionRecord) {
        if self.capacity == 0 {
            return;
        }
        let mut q = self.kept.lock();
        if q.len() >= self.capacity {
            q.pop_front();
        }
        q.push_back(d);
    }

    /// The last decisions, newest last.
    pub fn all(&self) -> Vec<DecisionRecord> {
        self.kept.lock().iter().cloned().collect()
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
    /// What the other router replicas report they have on it.
    pub peer_load: LoadSnapshot,
    /// Requests per second the other router replicas have been sending it
    /// lately (from their reports' counts; the kinference policy's
    /// externality counts them beside this router's own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_arrivals_per_s: Option<f64>,
    /// Models it serves.
    pub models: Vec<String>,
    /// The last `/v1/models` error.
    pub models_error: Option<String>,
    /// Scraped metrics.
    pub scraped: Option<Scraped>,
    /// LoRA adapters: the engine's last `vllm:lora_requests_info` and this
    /// router's adapter requests there (absent when neither exists).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adapters: Option<AdaptersReport>,
    /// KV-event streams (one per DP rank), when subscribed.
    pub kv: Option<Vec<KvReport>>,
    /// Tokens its KV cache holds (`vllm:cache_config_info`, SGLang's
    /// `/server_info`), when it says.
    pub kv_capacity_tokens: Option<u64>,
    /// The policy's calibration of it (first worker set listing it; absent
    /// for policies that do not calibrate): `scale` is what predictions
    /// use, `fleet_scale` the fleet's part of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calibration: Option<kinference_scoring::CalibrationView>,
}

/// An endpoint's LoRA adapters, for `/debug/endpoints`.
#[derive(Clone, Debug, Serialize)]
pub struct AdaptersReport {
    /// The engine's figures as last scraped.
    pub scraped: Option<kinference_api::engine::AdapterFigures>,
    /// Their age, milliseconds.
    pub scraped_age_ms: Option<u64>,
    /// This router's requests in flight there, by adapter.
    pub in_flight: Vec<(String, u32)>,
}

impl AdaptersReport {
    fn of(a: &crate::adapters::Adapters, now: Instant) -> Option<Self> {
        let scraped = a.scraped(now);
        let in_flight: Vec<(String, u32)> = a
            .in_flight()
            .into_iter()
            .map(|(name, n)| (name.to_string(), n))
            .collect();
        if scraped.is_none() && in_flight.is_empty() {
            return None;
        }
        Some(Self {
            scraped_age_ms: scraped
                .as_ref()
                .map(|(_, age)| u64::try_from(age.as_millis()).unwrap_or(u64::MAX)),
            scraped: scraped.map(|(f, _)| (*f).clone()),
            in_flight,
        })
    }
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

/// A report per endpoint of `view` (an endpoint listed by two worker sets
/// appears once); with `calibrated_at` (the router's time since start),
/// each with its calibration, which takes each worker set's policy lock
/// (the lock decisions take) once, and its peers' arrival rate.
pub fn endpoint_reports(
    view: &View,
    kv: &KvPlane,
    now: Instant,
    calibrated_at: Option<std::time::Duration>,
) -> Vec<EndpointReport> {
    let mut out: Vec<EndpointReport> = Vec::new();
    for ws in &view.worker_sets {
        let calibrations: Vec<_> = match calibrated_at {
            Some(at) => {
                use kinference_scoring::Pick as _;
                let policy = ws.runtime.policy.lock();
                ws.endpoints
                    .iter()
                    .map(|e| policy.calibration(kinference_scoring::EndpointId(e.id.0), at))
                    .collect()
            }
            None => vec![None; ws.endpoints.len()],
        };
        for (e, calibration) in ws.endpoints.iter().zip(calibrations) {
            if let Some(r) = out.iter_mut().find(|r| r.id == e.id.0) {
                r.worker_sets.push(ws.route.name.clone());
                continue;
            }
            out.push(EndpointReport {
                endpoint: e.authority.clone(),
                id: e.id.0,
                worker_sets: vec![ws.route.name.clone()],
                healthy: e.healthy(now),
                failures: e.failures(),
                load: e.load.own(),
                peer_load: e.load.peers_snapshot(),
                peer_arrivals_per_s: calibrated_at.map(|at| 1e3 * e.load.peers.arrival_rate(at)),
                models: e.models().into_iter().map(|m| m.id).collect(),
                models_error: e.models_error(),
                scraped: e.scraped(),
                adapters: AdaptersReport::of(&e.adapters, now),
                kv: kv.reports(e.id, now),
                kv_capacity_tokens: e.kv_capacity_tokens(),
                calibration,
            });
        }
    }
    out
}

/// A report per worker set of `view`.
pub fn worker_set_reports(view: &View) -> Vec<WorkerSetReport> {
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
