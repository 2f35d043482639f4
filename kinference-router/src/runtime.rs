//! Per-worker-set runtime state that outlives view rebuilds: the latency
//! model, the policy and its state, the record of prefixes sent, and the
//! local tokenizer.
//!
//! [`Runtimes`] owns them by worker-set name. The maintainer asks it for a
//! runtime per worker set at every view rebuild ([`Runtimes::runtime_for`]):
//! an unchanged worker set keeps its runtime (calibration and prefix record
//! survive), a changed one (block width, profile, policy) gets a fresh one.
//! Tokenizers are loaded once per path and shared between worker sets.
//!
//! Request tasks reach a runtime through the view; they take its policy
//! lock to propose and commit a decision and its prefix-record lock to read
//! or write the record, each for the length of an in-memory computation.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kinference_api::v1alpha1::{RoutingProfileSpec, TokenizationMode};
use kinference_scoring::approx::PrefixRecord;
use kinference_scoring::{
    EndpointId, LatencyParams, Overrides, Pick as _, Policy, PolicyName, StepSample,
};
use kinference_tokenize::ModelTokenizer;
use parking_lot::{Mutex, RwLock};
use serde::Serialize;

use crate::catalog::WorkerSetRoute;
use crate::memo::RouteMemo;

/// The state of a worker set's local tokenizer.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case", tag = "state", content = "detail")]
pub enum TokenizerState {
    /// The profile does not tokenize locally.
    NotLocal,
    /// Being loaded.
    Loading,
    /// Loaded; not yet compared with the engine.
    Unchecked,
    /// Being compared with the engine.
    Checking,
    /// Loaded and agrees with the engine's `/tokenize`.
    Checked,
    /// Could not be loaded: the worker set routes on load alone.
    Failed(String),
    /// Disagrees with the engine: routing uses the engine's `/tokenize`.
    Mismatch(String),
}

/// Per-worker-set state that outlives view rebuilds.
#[derive(Debug)]
pub struct WsRuntime {
    /// What it was built from; a change makes a new runtime.
    key: String,
    /// The latency model.
    pub params: LatencyParams,
    /// The profile's tokenization mode.
    pub mode: TokenizationMode,
    /// The policy and its state (calibration, rotation).
    pub policy: Mutex<Policy>,
    /// Where this router sent which prefixes recently.
    pub prefixes: RwLock<PrefixRecord>,
    /// Where its peers sent which prefixes recently: every
    /// [`crate::peers::RECORD_STRIDE`]th block key ([`crate::peers`]).
    pub peer_prefixes: RwLock<PrefixRecord>,
    /// The prefixes this router sent, kept for its peers.
    pub sent: crate::peers::SentRecords,
    /// The local tokenizer, once loaded.
    pub tokenizer: RwLock<Option<Arc<ModelTokenizer>>>,
    /// The local tokenizer's state.
    pub tokenizer_state: RwLock<TokenizerState>,
    /// Routes of prompts prepared before.
    pub memo: RouteMemo,
    /// The profile's admission settings (`None`: off).
    pub admission: Option<crate::admit::Limits>,
    /// Requests held by admission.
    pub queue: crate::admit::Queue,
    /// The peers' load version after the one current when the policy's
    /// step costs came into use (0: not yet): each peer's answers carry
    /// them until its load version passes this one
    /// ([`crate::peers::Report::steps`]).
    pub steps_version: AtomicU64,
}

impl WsRuntime {
    /// A runtime with a fresh policy and prefix record.
    pub fn new(
        params: LatencyParams,
        mode: TokenizationMode,
        policy: PolicyName,
        prefix_ttl: Duration,
    ) -> Self {
        Self {
            key: String::new(),
            params,
            mode,
            policy: Mutex::new(Policy::new(policy, params)),
            prefixes: RwLock::new(PrefixRecord::new(
                prefix_ttl,
                kinference_scoring::approx::DEFAULT_CAPACITY,
            )),
            peer_prefixes: RwLock::new(PrefixRecord::new(
                prefix_ttl,
                crate::peers::MAX_RECORDS * 64,
            )),
            sent: crate::peers::SentRecords::default(),
            tokenizer: RwLock::new(None),
            tokenizer_state: RwLock::new(TokenizerState::NotLocal),
            memo: RouteMemo::new(crate::config::defaults::ROUTE_MEMO_BYTES),
            admission: None,
            queue: crate::admit::Queue::default(),
            steps_version: AtomicU64::new(0),
        }
    }

    /// A finished stream's steps to the policy ([`Pick::observe_steps`]);
    /// when that puts its step costs in use, marks them for the peers'
    /// next reports.
    pub fn observe_steps(&self, endpoint: EndpointId, sample: &StepSample) {
        let mut policy = self.policy.lock();
        // Marked once: the costs stay in use.
        if self.steps_version.load(Ordering::Relaxed) > 0 {
            policy.observe_steps(endpoint, sample);
            return;
        }
        let before = policy.step_fit().is_some();
        policy.observe_steps(endpoint, sample);
        if !before && policy.step_fit().is_some() {
            self.steps_version
                .fetch_max(crate::peers::version() + 1, Ordering::SeqCst);
        }
    }

    /// The tokenization mode in effect: a local tokenizer that disagreed
    /// with the engine gives way to the engine's `/tokenize` (the engine's
    /// ids are the truth). One that could not be loaded stays `local`, with
    /// no tokenizer: the worker set routes on load alone, and says so
    /// (`/debug/endpoints`, the `tokenizer_unavailable` metric, the log),
    /// rather than silently sending every prompt to the engine to tokenize.
    pub fn effective_mode(&self) -> TokenizationMode {
        match (self.mode, &*self.tokenizer_state.read()) {
            (TokenizationMode::Local, TokenizerState::Mismatch(_)) => TokenizationMode::Engine,
            (m, _) => m,
        }
    }

    /// The local tokenizer when it is the one in effect.
    pub fn local_tokenizer(&self) -> Option<Arc<ModelTokenizer>> {
        (self.effective_mode() == TokenizationMode::Local)
            .then(|| self.tokenizer.read().clone())
            .flatten()
    }

    /// Forgets everything about a scoring id (its endpoint left).
    pub fn forget(&self, id: kinference_scoring::EndpointId) {
        use kinference_scoring::Pick as _;
        self.policy.lock().remove_endpoint(id);
        self.prefixes.write().remove_endpoint(id);
        self.peer_prefixes.write().remove_endpoint(id);
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
        storage_credit: credits.storage,
        tolerance_millis: l.tolerance_millis,
        calibrate: l.calibrate,
        learn_step_costs: l.learn_step_costs,
    };
    base.with_overrides(&overrides).map_err(|e| e.to_string())
}

/// Where a `local` profile's tokenizer comes from.
fn tokenizer_path(spec: Option<&RoutingProfileSpec>) -> Option<Result<PathBuf, String>> {
    let spec = spec?;
    if spec.tokenization.mode != TokenizationMode::Local {
        return None;
    }
    let src = spec.tokenization.tokenizer.as_ref()?;
    Some(match (&src.path, &src.config_map) {
        (Some(p), _) => Ok(PathBuf::from(p)),
        (None, Some(cm)) => Err(format!(
            "a ConfigMap tokenizer source ({}/{}) is not read by the router: a ConfigMap holds at most 1 MiB, less than most tokenizer.json files; mount the files into the router pods (a ConfigMap or image volume, or a PVC) and give tokenizer.path",
            cm.namespace, cm.name
        )),
        (None, None) => Err("no tokenizer source".into()),
    })
}

/// Every worker set's runtime, and the tokenizers loaded for them.
#[derive(Debug, Default)]
pub struct Runtimes {
    by_name: Mutex<HashMap<String, Arc<WsRuntime>>>,
    tokenizers: Arc<Mutex<HashMap<PathBuf, Arc<ModelTokenizer>>>>,
}

impl Runtimes {
    /// The runtime for `route` under `policy`: the existing one when nothing
    /// it depends on changed, else a new one (whose tokenizer, if local,
    /// starts loading; `loaded` runs when it is ready).
    pub fn runtime_for(
        &self,
        route: &WorkerSetRoute,
        policy: PolicyName,
        prefix_ttl: Duration,
        loaded: impl Fn() + Send + Sync + 'static,
    ) -> Arc<WsRuntime> {
        let key = format!(
            "{}|{}|{:?}|{}",
            route.kv_block_size,
            policy.as_str(),
            route.profile,
            route.profile_name
        );
        let mut by_name = self.by_name.lock();
        if let Some(rt) = by_name.get(&route.name)
            && rt.key == key
        {
            return rt.clone();
        }
        let params = params_for(route).unwrap_or_else(|e| {
            tracing::warn!(worker_set = %route.name, error = %e, "profile values out of range; using the built-in default");
            LatencyParams::default()
        });
        let mode = route
            .profile
            .as_ref()
            .map_or(TokenizationMode::Engine, |p| p.tokenization.mode);
        let mut rt = WsRuntime::new(params, mode, policy, prefix_ttl);
        rt.key = key;
        let admission = route.profile.as_ref().and_then(|p| p.admission.as_ref());
        rt.admission = admission.map(crate::admit::Limits::from_spec);
        if let Some(a) = admission {
            rt.queue = crate::admit::Queue::new(crate::admit::Tenants::from_spec(&a.tenants));
        }
        let rt = Arc::new(rt);
        match tokenizer_path(route.profile.as_ref()) {
            None => {}
            Some(Err(e)) => {
                tracing::warn!(worker_set = %route.name, profile = %route.profile_name, error = %e, "local tokenizer unavailable: routing this worker set on load alone");
                *rt.tokenizer_state.write() = TokenizerState::Failed(e);
            }
            Some(Ok(path)) => self.load_tokenizer(&rt, route.name.clone(), path, loaded),
        }
        by_name.insert(route.name.clone(), rt.clone());
        rt
    }

    /// Drops the runtimes of worker sets not in `live`.
    pub fn retain(&self, live: &[String]) {
        self.by_name.lock().retain(|name, _| live.contains(name));
    }

    /// Every runtime, for forgetting an endpoint in all of them.
    pub fn all(&self) -> Vec<Arc<WsRuntime>> {
        self.by_name.lock().values().cloned().collect()
    }

    fn load_tokenizer(
        &self,
        rt: &Arc<WsRuntime>,
        ws: String,
        path: PathBuf,
        loaded: impl Fn() + Send + Sync + 'static,
    ) {
        if let Some(t) = self.tokenizers.lock().get(&path) {
            *rt.tokenizer.write() = Some(t.clone());
            *rt.tokenizer_state.write() = TokenizerState::Unchecked;
            return;
        }
        *rt.tokenizer_state.write() = TokenizerState::Loading;
        let (rt, tokenizers) = (rt.clone(), self.tokenizers.clone());
        tokio::spawn(async move {
            let p = path.clone();
            let r = tokio::task::spawn_blocking(move || ModelTokenizer::from_dir(&p)).await;
            match r {
                Ok(Ok(t)) => {
                    let t = Arc::new(t);
                    tokenizers.lock().insert(path.clone(), t.clone());
                    *rt.tokenizer.write() = Some(t);
                    *rt.tokenizer_state.write() = TokenizerState::Unchecked;
                    tracing::info!(worker_set = %ws, path = %path.display(), "tokenizer loaded");
                    loaded();
                }
                Ok(Err(e)) => {
                    tracing::warn!(worker_set = %ws, path = %path.display(), error = %e, "tokenizer not loaded: routing this worker set on load alone");
                    *rt.tokenizer_state.write() = TokenizerState::Failed(e.to_string());
                }
                Err(e) => *rt.tokenizer_state.write() = TokenizerState::Failed(e.to_string()),
            }
        });
    }
}
