//! What request tasks share, grouped by role.
//!
//! | field | module | what | written by |
//! |---|---|---|---|
//! | [`Shared::config`] | [`crate::config`] | settings | start-up only |
//! | [`Shared::runtime`] | here, [`crate::runtime`], [`crate::endpoint`] | the current view, worker-set runtimes, HTTP clients, readiness | the maintainer ([`crate::maintain`]) |
//! | [`Shared::kv`] | [`crate::kv`] | the KV index, its subscriptions and owner table | KV-event subscribers, the maintainer |
//! | [`Shared::explanations`] | [`crate::reports`] | the last decisions explained | request tasks (sampled) |
//! | [`Shared::metrics`] | [`crate::metrics`] | counters and histograms | request tasks |
//!
//! Request tasks read the view and the owner table as immutable snapshots
//! swapped in whole, and per-endpoint load as atomics: no router-wide lock
//! is taken on the request path.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::kv::KvPlane;
use crate::metrics::Metrics;
use crate::probe::ProbeClient;
use crate::proxy::UpstreamClient;
use crate::reports::Explanations;
use crate::runtime::Runtimes;
use crate::view::View;

/// Runtime state: the routing view and what keeps it current.
#[derive(Debug)]
pub struct Runtime {
    view: ArcSwap<View>,
    /// Worker-set runtimes (policy, prefix record, tokenizer).
    pub runtimes: Runtimes,
    /// Pooled connections to engines.
    pub upstream: UpstreamClient,
    /// The probes' client.
    pub probes: ProbeClient,
    /// Time zero for scoring.
    pub epoch: Instant,
    ready: AtomicBool,
    /// When the pool's objects were first all listed.
    listed_at: std::sync::OnceLock<Instant>,
    problems: ArcSwap<Vec<String>>,
    models_changed: Notify,
    /// Counts asked rebuilds: a view built before the last one may miss
    /// models (LoRA adapters) an engine has just listed.
    models_version: AtomicU64,
    requests: AtomicU64,
    /// Cancelled at shutdown.
    pub stop: CancellationToken,
    /// This process's replica id (random), in its peer reports.
    pub replica: String,
    /// What the peer poller knows ([`crate::peers`]).
    pub peer_state: parking_lot::RwLock<crate::peers::PeerState>,
    /// Bytes exchanged with peers ([`crate::peers::Traffic`]).
    pub peer_traffic: crate::peers::Traffic,
    /// The engines that keep stored Responses ([`crate::stored`]).
    pub stored: crate::stored::Holders,
}

impl Runtime {
    /// The current view.
    pub fn view(&self) -> Arc<View> {
        self.view.load_full()
    }

    /// Installs a new view.
    pub fn set_view(&self, view: View) {
        self.view.store(Arc::new(view));
    }

    /// Whether the first full sync happened.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// Records whether the first full sync happened.
    pub fn set_ready(&self, ready: bool) {
        if ready {
            let _ = self.listed_at.set(Instant::now());
        }
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// What is wrong with the pool's objects as the router sees them
    /// (missing worker sets, unresolvable ports, unknown profiles).
    pub fn problems(&self) -> Arc<Vec<String>> {
        self.problems.load_full()
    }

    /// Replaces the problems, returning the new ones (to log).
    pub fn set_problems(&self, problems: &[String]) -> Vec<String> {
        let old = self.problems.load();
        if old.as_slice() == problems {
            return Vec::new();
        }
        let new = problems
            .iter()
            .filter(|p| !old.contains(p))
            .cloned()
            .collect();
        self.problems.store(Arc::new(problems.to_vec()));
        new
    }

    /// Asks the maintainer to rebuild the view (models or tokenizers changed).
    pub fn notify_models_changed(&self) {
        self.models_version.fetch_add(1, Ordering::AcqRel);
        self.models_changed.notify_one();
    }

    /// How many rebuilds have been asked for: read before building a view,
    /// it tells whether the view has seen every change since.
    pub fn models_version(&self) -> u64 {
        self.models_version.load(Ordering::Acquire)
    }

    /// Resolves when a rebuild was asked for.
    pub async fn models_changed(&self) {
        self.models_changed.notified().await;
    }

    /// A number unique to this request, for its random source.
    pub fn next_request(&self) -> u64 {
        self.requests.fetch_add(1, Ordering::Relaxed)
    }
}

/// Everything request tasks share.
#[derive(Debug)]
pub struct Shared {
    /// Settings.
    pub config: Config,
    /// The view and what keeps it current.
    pub runtime: Runtime,
    /// The KV plane.
    pub kv: KvPlane,
    /// Decisions kept for `/debug/explain`.
    pub explanations: Explanations,
    /// Counters and histograms.
    pub metrics: Metrics,
}

impl Shared {
    /// Fresh state; nothing routable until the maintainer runs.
    pub fn new(config: Config, stop: CancellationToken) -> Arc<Self> {
        Arc::new(Self {
            runtime: Runtime {
                view: ArcSwap::from_pointee(View::default()),
                runtimes: Runtimes::default(),
                upstream: crate::proxy::client(config.connect_timeout),
                probes: crate::probe::client(config.connect_timeout),
                epoch: Instant::now(),
                ready: AtomicBool::new(false),
                listed_at: std::sync::OnceLock::new(),
                problems: ArcSwap::from_pointee(Vec::new()),
                models_changed: Notify::new(),
                models_version: AtomicU64::new(0),
                requests: AtomicU64::new(0),
                stop,
                replica: {
                    use std::hash::{BuildHasher as _, Hasher as _};
                    let h = std::collections::hash_map::RandomState::new().build_hasher();
                    format!("{:016x}", h.finish())
                },
                peer_state: parking_lot::RwLock::default(),
                peer_traffic: crate::peers::Traffic::default(),
                stored: crate::stored::Holders::default(),
            },
            kv: KvPlane::new(config.kv_max_entries),
            explanations: Explanations::new(config.explain_buffer, config.explain_every),
            metrics: Metrics::default(),
            config,
        })
    }

    /// The current view.
    pub fn view(&self) -> Arc<View> {
        self.runtime.view()
    }

    /// `now` for scoring: time since the router started.
    pub fn now(&self) -> Duration {
        self.runtime.epoch.elapsed()
    }

    /// Whether the first full sync happened.
    pub fn is_ready(&self) -> bool {
        self.runtime.is_ready()
    }

    /// Whether this replica should get traffic, and if not, why: the pool's
    /// objects listed, a peer's KV index snapshot in (or the bootstrap
    /// given up: `--peer-bootstrap-timeout`, see [`crate::snapshot`]), and
    /// every engine's first `/v1/models` answer in (or [`READY_GRACE`]
    /// passed since the listing: an engine that never answers does not
    /// keep the router out of service).
    ///
    /// # Errors
    /// What it still waits for.
    pub fn readiness(&self) -> Result<(), String> {
        if !self.is_ready() {
            return Err("the pool's objects have not all been listed yet".into());
        }
        // Models an engine has just listed (adapters) are not routable
        // until the maintainer's next view, moments away.
        if self.view().models_version < self.runtime.models_version() {
            return Err("the view is being rebuilt with newly discovered models".into());
        }
        if let Some(why) = self.kv.seeding_wait(Instant::now()) {
            return Err(why);
        }
        let since = self
            .runtime
            .listed_at
            .get()
            .map_or(Duration::MAX, Instant::elapsed);
        if since >= READY_GRACE {
            return Ok(());
        }
        let view = self.view();
        // The engines still without something, sorted, each once (an
        // engine two worker sets list): why the router is not ready.
        let still = |what: &str, pending: &dyn Fn(&crate::endpoint::Endpoint) -> bool| {
            let mut names: Vec<&str> = view
                .worker_sets
                .iter()
                .flat_map(|ws| ws.endpoints.iter())
                .filter(|e| pending(e))
                .map(|e| e.authority.as_str())
                .collect();
            names.sort_unstable();
            names.dedup();
            if names.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "waiting (up to {} s after the listing) for {what} of {} engine(s): {}",
                    READY_GRACE.as_secs(),
                    names.len(),
                    names.join(", ")
                ))
            }
        };
        still("the first /v1/models answer", &|e| !e.discovery_answered())?;
        // Their speed probes (crate::speed): a few hundred milliseconds,
        // and what keeps a slow engine from a burst's share.
        let probes = self.config.speed_probe_tokens > 0;
        still("the speed probe", &|e| probes && e.speed_probe_pending())
    }
}

/// How long a listed router waits for its engines' first answers before it
/// reports ready anyway.
pub const READY_GRACE: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn not_ready_while_the_view_misses_models_just_discovered() {
        let shared = Shared::new(Config::default(), CancellationToken::new());
        shared.runtime.set_view(View::default());
        shared.runtime.set_ready(true);
        // An empty pool: nothing to wait for.
        assert_eq!(shared.readiness(), Ok(()));
        // An engine lists a new adapter: not ready until a view built after
        // that is in place.
        let version = shared.runtime.models_version();
        shared.runtime.notify_models_changed();
        let why = shared.readiness().unwrap_err();
        assert!(why.contains("newly discovered models"), "{why}");
        // A view built from before the change does not count...
        let view_at = |v: u64| {
            let mut view = View::default();
            view.models_version = v;
            view
        };
        shared.runtime.set_view(view_at(version));
        assert!(shared.readiness().is_err());
        // ...one built after it does.
        shared
            .runtime
            .set_view(view_at(shared.runtime.models_version()));
        assert_eq!(shared.readiness(), Ok(()));
    }
}
