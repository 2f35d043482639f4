//! The two controllers (worker sets, pools), their shared caches and the
//! status writer.
//!
//! One watch per kind (worker sets, pools, EndpointSlices labelled with a
//! Service name, routing profiles) feeds a reflector cache; worker-set and
//! pool events drive their kube-runtime `Controller`s directly, and every
//! event also passes through [`Triggers`] to queue related objects, and a
//! finished KV window ([`crate::kvwatch`]) queues its worker set. A
//! reconcile reads its namespace from the caches, asks the engines
//! `/v1/models` when that probe is due, takes the KV windows' latest result
//! (starting a window in the background when one is due), computes the
//! status with [`crate::status`] and, only if it differs from the status
//! the object has, applies it (server-side apply, field manager
//! [`crate::FIELD_MANAGER`], `force`). A reconcile that changes nothing
//! writes nothing, so the watch event of a write leads to one more reconcile
//! and stops there.
//!
//! Only the leader reconciles; followers keep their caches warm and, on
//! becoming leader, reconcile everything.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::channel::mpsc;
use futures::{Stream, StreamExt};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kinference_api::conditions;
use kinference_api::v1alpha1::API_VERSION;
use kinference_api::{
    InferencePool, InferencePoolStatus, InferenceWorkerSet, InferenceWorkerSetStatus,
    RoutingProfile,
};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::endpoints::{self, SERVICE_NAME_LABEL};
use crate::events::{self, EventSink};
use crate::kvwatch::KvWatch;
use crate::metrics::{ErrorKind, Kind, Metrics};
use crate::probe::{EndpointModels, ProbeResult, ProbeTarget, Prober};
use crate::status::{self, Facts, Namespace};
use crate::triggers::{Stores, Triggers};

/// Why a reconcile failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or failed a status write.
    #[error("writing the status of {kind} {namespace}/{name}")]
    WriteStatus {
        /// The object's kind.
        kind: &'static str,
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// The cause.
        #[source]
        source: Box<kube::Error>,
    },
    /// An object without namespace or name (not expected from the API server).
    #[error("a {kind} without namespace or name")]
    Malformed {
        /// The object's kind.
        kind: &'static str,
    },
}

impl Error {
    fn metric(&self) -> ErrorKind {
        match self {
            Error::WriteStatus { .. } => ErrorKind::WriteStatus,
            Error::Malformed { .. } => ErrorKind::MalformedObject,
        }
    }
}

/// How the controllers behave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Watch one namespace only (`None`: all namespaces).
    pub namespace: Option<String>,
    /// How often each worker set's engines are asked `GET /v1/models`.
    pub probe_interval: Duration,
    /// How long after a worker set's last KV window the next one starts.
    pub kv_probe_interval: Duration,
    /// Reconciles running at once, per controller.
    pub concurrency: u16,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            namespace: None,
            probe_interval: Duration::from_secs(30),
            kv_probe_interval: Duration::from_secs(60),
            concurrency: 16,
        }
    }
}

/// What the controllers use to reach outside the API server; replaceable.
#[derive(Clone)]
pub struct Seams {
    /// Probes engines.
    pub prober: Arc<dyn Prober>,
    /// Publishes Kubernetes Events.
    pub events: Arc<dyn EventSink>,
    /// Whether this instance leads (see [`crate::leader::Leadership`]).
    pub leader: watch::Receiver<bool>,
}

impl std::fmt::Debug for Seams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seams")
            .field("leader", &*self.leader.borrow())
            .finish_non_exhaustive()
    }
}

/// Per-object counts, for tests and debugging.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ObjectStats {
    /// Reconciles run as leader.
    pub reconciles: u64,
    /// Status writes.
    pub writes: u64,
    /// `/v1/models` probe rounds (worker sets only).
    pub probes: u64,
    /// KV windows finished (worker sets only; reset when the worker set
    /// stops having `kvEvents` or ready endpoints).
    pub kv_windows: u64,
}

type Key = (Kind, String, String);

struct ProbeRecord {
    target: ProbeTarget,
    models: Vec<EndpointModels>,
    at: Instant,
}

/// What every reconcile shares.
pub struct Context {
    client: Client,
    settings: Settings,
    seams: Seams,
    metrics: Metrics,
    stores: Stores,
    probes: Mutex<HashMap<(String, String), ProbeRecord>>,
    kv: KvWatch,
    stats: Mutex<HashMap<Key, ObjectStats>>,
    failures: Mutex<HashMap<Key, u32>>,
    ready: watch::Sender<bool>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("settings", &self.settings)
            .field("stores", &self.stores)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The maps stay consistent under panics (single inserts), so a poisoned
    // lock is still usable.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The current time in whole seconds, as the API server stores it.
fn now() -> Time {
    let ts = k8s_openapi::jiff::Timestamp::now();
    Time(k8s_openapi::jiff::Timestamp::from_second(ts.as_second()).unwrap_or(ts))
}

impl Context {
    /// Counts of the object `kind` `namespace/name`.
    pub fn stats(&self, kind: Kind, namespace: &str, name: &str) -> ObjectStats {
        let mut s = lock(&self.stats)
            .get(&(kind, namespace.to_owned(), name.to_owned()))
            .copied()
            .unwrap_or_default();
        if kind == Kind::WorkerSet {
            s.kv_windows = self.kv.windows(namespace, name);
        }
        s
    }

    /// Whether every cache has been filled once.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// A receiver of readiness changes.
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Drops what is kept in memory about a deleted worker set.
    fn forget(&self, ws: &InferenceWorkerSet) {
        let (Some(ns), Some(name)) = (ws.metadata.namespace.clone(), ws.metadata.name.clone())
        else {
            return;
        };
        lock(&self.probes).remove(&(ns.clone(), name.clone()));
        self.kv.forget(&ns, &name);
        let key = (Kind::WorkerSet, ns, name);
        lock(&self.failures).remove(&key);
        lock(&self.stats).remove(&key);
    }

    fn forget_pool(&self, pool: &InferencePool) {
        let (Some(ns), Some(name)) = (pool.metadata.namespace.clone(), pool.metadata.name.clone())
        else {
            return;
        };
        let key = (Kind::Pool, ns, name);
        lock(&self.failures).remove(&key);
        lock(&self.stats).remove(&key);
    }

    fn leads(&self) -> bool {
        *self.seams.leader.borrow()
    }

    fn count(&self, kind: Kind, ns: &str, name: &str, f: impl FnOnce(&mut ObjectStats)) {
        f(lock(&self.stats)
            .entry((kind, ns.to_owned(), name.to_owned()))
            .or_default());
    }

    /// The namespace's objects from the caches, with `ws` in place of its
    /// cached copy (the cache may lag behind the object being reconciled).
    fn facts(&self, ns: &str, ws: Option<&Arc<InferenceWorkerSet>>) -> Facts {
        let in_ns = |m: &kube::core::ObjectMeta| m.namespace.as_deref() == Some(ns);
        let mut sets: Vec<Arc<InferenceWorkerSet>> = self
            .stores
            .worker_sets
            .state()
            .into_iter()
            .filter(|w| in_ns(&w.metadata))
            .collect();
        if let Some(ws) = ws {
            sets.retain(|w| w.metadata.name != ws.metadata.name);
            sets.push(ws.clone());
        }
        let pools: Vec<Arc<InferencePool>> = self
            .stores
            .pools
            .state()
            .into_iter()
            .filter(|p| in_ns(&p.metadata))
            .collect();
        let slices: Vec<Arc<EndpointSlice>> = self
            .stores
            .slices
            .state()
            .into_iter()
            .filter(|s| in_ns(&s.metadata))
            .collect();
        let profiles: BTreeSet<String> = self
            .stores
            .profiles
            .state()
            .iter()
            .map(|p| p.name_any())
            .collect();
        let set_refs: Vec<&InferenceWorkerSet> = sets.iter().map(AsRef::as_ref).collect();
        let pool_refs: Vec<&InferencePool> = pools.iter().map(AsRef::as_ref).collect();
        let slice_refs: Vec<&EndpointSlice> = slices.iter().map(AsRef::as_ref).collect();
        Facts::compute(&Namespace {
            worker_sets: &set_refs,
            pools: &pool_refs,
            slices: &slice_refs,
            profiles: &profiles,
        })
    }

    /// The latest probe of a worker set, asking `/v1/models` first when no
    /// answer is recent enough or its endpoints changed, with what the
    /// background KV windows say (starting one when due); and how long until
    /// the next probe is due.
    async fn probe(
        &self,
        ns: &str,
        name: &str,
        target: ProbeTarget,
    ) -> (Option<ProbeResult>, Option<Duration>) {
        let key = (ns.to_owned(), name.to_owned());
        if target.endpoints.is_empty() {
            lock(&self.probes).remove(&key);
            self.kv.forget(ns, name);
            return (None, None);
        }
        let (kv, kv_next) = self.kv.state(ns, name, &target);
        let interval = self.settings.probe_interval;
        let cached = lock(&self.probes).get(&key).and_then(|r| {
            (r.target == target && r.at.elapsed() < interval)
                .then(|| (r.models.clone(), interval.saturating_sub(r.at.elapsed())))
        });
        let (models, next) = if let Some(hit) = cached {
            hit
        } else {
            let models = self.seams.prober.probe_models(&target).await;
            self.metrics.probed_models(&models);
            self.count(Kind::WorkerSet, ns, name, |s| s.probes += 1);
            lock(&self.probes).insert(
                key,
                ProbeRecord {
                    target,
                    models: models.clone(),
                    at: Instant::now(),
                },
            );
            (models, interval)
        };
        let next = kv_next.map_or(next, |k| next.min(k));
        (Some(ProbeResult { models, kv }), Some(next))
    }

    async fn apply_status<K>(
        &self,
        obj: &K,
        kind: Kind,
        status: &impl Serialize,
    ) -> Result<(), Error>
    where
        K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
            + Clone
            + DeserializeOwned
            + std::fmt::Debug,
    {
        let (ns, name) = names(obj.meta(), kind)?;
        let api: Api<K> = Api::namespaced(self.client.clone(), ns);
        let patch = serde_json::json!({
            "apiVersion": API_VERSION,
            "kind": K::kind(&()),
            "status": status,
        });
        api.patch_status(
            name,
            &PatchParams::apply(crate::FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(|source| Error::WriteStatus {
            kind: kind_name(kind),
            namespace: ns.to_owned(),
            name: name.to_owned(),
            source: Box::new(source),
        })?;
        self.metrics.wrote_status(kind);
        self.count(kind, ns, name, |s| s.writes += 1);
        Ok(())
    }
}

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::WorkerSet => "InferenceWorkerSet",
        Kind::Pool => "InferencePool",
    }
}

fn names(meta: &kube::core::ObjectMeta, kind: Kind) -> Result<(&str, &str), Error> {
    match (meta.namespace.as_deref(), meta.name.as_deref()) {
        (Some(ns), Some(name)) => Ok((ns, name)),
        _ => Err(Error::Malformed {
            kind: kind_name(kind),
        }),
    }
}

/// A worker set's status as this controller owns it: conditions of other
/// types belong to someone else and are not compared.
fn ours_worker_set(s: &InferenceWorkerSetStatus) -> InferenceWorkerSetStatus {
    let mut s = s.clone();
    s.conditions.retain(|c| {
        [
            conditions::ACCEPTED,
            conditions::READY,
            conditions::REFERENCED,
        ]
        .contains(&c.type_.as_str())
    });
    s
}

fn ours_pool(s: &InferencePoolStatus) -> InferencePoolStatus {
    let mut s = s.clone();
    s.conditions
        .retain(|c| [conditions::ACCEPTED, conditions::RESOLVED_REFS].contains(&c.type_.as_str()));
    s
}

/// Reconciles one worker set.
///
/// # Errors
/// [`Error`] when its status cannot be written.
pub async fn reconcile_worker_set(
    ws: Arc<InferenceWorkerSet>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    if !ctx.leads() {
        return Ok(Action::await_change());
    }
    let started = Instant::now();
    let (ns, name) = names(&ws.metadata, Kind::WorkerSet)?;
    ctx.count(Kind::WorkerSet, ns, name, |s| s.reconciles += 1);
    let facts = ctx.facts(ns, Some(&ws));
    let Some(set) = facts.sets.get(name) else {
        return Err(Error::Malformed {
            kind: "InferenceWorkerSet",
        });
    };
    let target = probe_target(&ws, &set.endpoints);
    let (probe, next_probe) = ctx.probe(ns, name, target).await;
    let status = status::worker_set_status(&ws, set, probe.as_ref(), &now());
    let current = ws.status.as_ref().map(ours_worker_set);
    if current.as_ref() != Some(&status) {
        tracing::info!(namespace = ns, name, state = %status.state, ready = status.ready_endpoints, diagnoses = status.diagnoses.len(), "writing worker set status");
        ctx.apply_status(ws.as_ref(), Kind::WorkerSet, &status)
            .await?;
        let regarding = ws.object_ref(&());
        for notice in events::notices(ws.status.as_ref(), &status) {
            let published = ctx.seams.events.publish(&regarding, &notice).await;
            if let Err(error) = &published {
                tracing::warn!(namespace = ns, name, reason = %notice.reason, %error, "publishing an Event failed");
            }
            ctx.metrics.event(&notice.reason, published.is_ok());
        }
    }
    lock(&ctx.failures).remove(&(Kind::WorkerSet, ns.to_owned(), name.to_owned()));
    ctx.metrics.reconciled(Kind::WorkerSet, started.elapsed());
    Ok(next_probe.map_or_else(Action::await_change, Action::requeue))
}

/// Reconciles one pool.
///
/// # Errors
/// [`Error`] when its status cannot be written.
pub async fn reconcile_pool(pool: Arc<InferencePool>, ctx: Arc<Context>) -> Result<Action, Error> {
    if !ctx.leads() {
        return Ok(Action::await_change());
    }
    let started = Instant::now();
    let (ns, name) = names(&pool.metadata, Kind::Pool)?;
    ctx.count(Kind::Pool, ns, name, |s| s.reconciles += 1);
    let facts = ctx.facts(ns, None);
    let status = status::pool_status(&pool, &facts, &now());
    let current = pool.status.as_ref().map(ours_pool);
    if current.as_ref() != Some(&status) {
        tracing::info!(namespace = ns, name, models = %status.model_names, ready = status.ready_endpoints, "writing pool status");
        ctx.apply_status(pool.as_ref(), Kind::Pool, &status).await?;
    }
    lock(&ctx.failures).remove(&(Kind::Pool, ns.to_owned(), name.to_owned()));
    ctx.metrics.reconciled(Kind::Pool, started.elapsed());
    Ok(Action::await_change())
}

/// Retry delay after the `n`th consecutive failure: 1 s, doubling up to 256 s.
pub fn backoff(n: u32) -> Duration {
    Duration::from_secs(1u64 << n.saturating_sub(1).min(8))
}

fn error_policy<K: Resource>(obj: &K, kind: Kind, error: &Error, ctx: &Context) -> Action {
    ctx.metrics.failed(kind, error.metric());
    let key = (
        kind,
        obj.meta().namespace.clone().unwrap_or_default(),
        obj.meta().name.clone().unwrap_or_default(),
    );
    let n = {
        let mut f = lock(&ctx.failures);
        let n = f.entry(key.clone()).or_default();
        *n = n.saturating_add(1);
        *n
    };
    let delay = backoff(n);
    tracing::warn!(kind = kind_name(kind), namespace = %key.1, name = %key.2, error = %error, source = ?std::error::Error::source(error), retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

/// Yields once each time `leader` turns true (at the start too, if it is),
/// keeping the leader gauge up to date.
fn leadership_gained(
    leader: watch::Receiver<bool>,
    metrics: Metrics,
) -> impl Stream<Item = ()> + Send {
    futures::stream::unfold(
        (leader, metrics, true),
        |(mut rx, metrics, mut first)| async move {
            loop {
                if !first && rx.changed().await.is_err() {
                    return None;
                }
                first = false;
                let leads = *rx.borrow_and_update();
                metrics.set_leader(leads);
                if leads {
                    return Some(((), (rx, metrics, false)));
                }
            }
        },
    )
}

/// Which of the four caches have been filled once.
struct Filled {
    caches: [std::sync::atomic::AtomicBool; 4],
    ready: watch::Sender<bool>,
}

impl Filled {
    fn new(ready: watch::Sender<bool>) -> Self {
        Filled {
            caches: Default::default(),
            ready,
        }
    }

    fn mark<K>(&self, event: &watcher::Event<K>, cache: usize) {
        use std::sync::atomic::Ordering;
        if matches!(event, watcher::Event::InitDone) {
            self.caches[cache].store(true, Ordering::Release);
            if self.caches.iter().all(|c| c.load(Ordering::Acquire)) && !*self.ready.borrow() {
                tracing::info!("caches filled");
                self.ready.send_replace(true);
            }
        }
    }
}

/// The controllers, ready to run.
pub struct Runtime {
    ctx: Arc<Context>,
    writers: Writers,
    kv_done: mpsc::UnboundedReceiver<ObjectRef<InferenceWorkerSet>>,
}

struct Writers {
    worker_sets: reflector::store::Writer<InferenceWorkerSet>,
    pools: reflector::store::Writer<InferencePool>,
    slices: reflector::store::Writer<EndpointSlice>,
    profiles: reflector::store::Writer<RoutingProfile>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("ctx", &self.ctx)
            .finish_non_exhaustive()
    }
}

fn api<K>(client: &Client, ns: Option<&str>) -> Api<K>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>,
{
    match ns {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// A watch of `api` feeding `writer`, without managed fields (never read,
/// often the larger part of an object).
fn reflected<K>(
    api: Api<K>,
    config: watcher::Config,
    writer: reflector::store::Writer<K>,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send
where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    watcher(api, config)
        .default_backoff()
        .modify(|o: &mut K| o.meta_mut().managed_fields = None)
        .reflect(writer)
}

impl Runtime {
    /// Controllers using `client`, with `metrics` registered by the caller.
    pub fn new(client: Client, settings: Settings, seams: Seams, metrics: Metrics) -> Self {
        let (worker_sets, ws_w) = reflector::store();
        let (pools, pools_w) = reflector::store();
        let (slices, slices_w) = reflector::store();
        let (profiles, profiles_w) = reflector::store();
        let (ready, _) = watch::channel(false);
        let (kv_tx, kv_done) = mpsc::unbounded();
        let kv = KvWatch::new(
            seams.prober.clone(),
            settings.kv_probe_interval,
            kv_tx,
            metrics.clone(),
        );
        let ctx = Arc::new(Context {
            client,
            settings,
            seams,
            metrics,
            stores: Stores {
                worker_sets,
                pools,
                slices,
                profiles,
            },
            probes: Mutex::new(HashMap::new()),
            kv,
            stats: Mutex::new(HashMap::new()),
            failures: Mutex::new(HashMap::new()),
            ready,
        });
        Runtime {
            ctx,
            kv_done,
            writers: Writers {
                worker_sets: ws_w,
                pools: pools_w,
                slices: slices_w,
                profiles: profiles_w,
            },
        }
    }

    /// The shared context (stats, readiness, metrics).
    pub fn context(&self) -> Arc<Context> {
        self.ctx.clone()
    }

    /// Runs both controllers until `shutdown` is cancelled, then lets running
    /// reconciles finish.
    pub async fn run(self, shutdown: CancellationToken) {
        let Runtime {
            ctx,
            writers,
            kv_done,
        } = self;
        let client = ctx.client.clone();
        let ns = ctx.settings.namespace.clone();
        let ns = ns.as_deref();
        let (ws_tx, ws_rx) = mpsc::unbounded();
        let (pool_tx, pool_rx) = mpsc::unbounded();
        let triggers = Triggers::new(ctx.stores.clone(), ws_tx, pool_tx);

        // Ready once every cache has been filled: marked from the streams
        // themselves (two tasks awaiting one store's `wait_until_ready` can
        // leave one of them unwoken, as kube-runtime 5.0 keeps one waker).
        let filled = Arc::new(Filled::new(ctx.ready.clone()));
        let t = triggers.clone();
        let f = filled.clone();
        let c = ctx.clone();
        let ws_events = reflected(
            api::<InferenceWorkerSet>(&client, ns),
            watcher::Config::default(),
            writers.worker_sets,
        )
        .inspect(move |e| match e {
            Ok(e) => {
                f.mark(e, 0);
                t.worker_set(e);
                if let watcher::Event::Delete(w) = e {
                    c.forget(w);
                }
            }
            Err(error) => tracing::warn!(%error, "watching InferenceWorkerSets"),
        })
        .applied_objects();
        let t = triggers.clone();
        let f = filled.clone();
        let c = ctx.clone();
        let pool_events = reflected(
            api::<InferencePool>(&client, ns),
            watcher::Config::default(),
            writers.pools,
        )
        .inspect(move |e| match e {
            Ok(e) => {
                f.mark(e, 1);
                t.pool(e);
                if let watcher::Event::Delete(p) = e {
                    c.forget_pool(p);
                }
            }
            Err(error) => tracing::warn!(%error, "watching InferencePools"),
        })
        .applied_objects();
        let t = triggers.clone();
        let f = filled.clone();
        let slice_events = reflected(
            api::<EndpointSlice>(&client, ns),
            watcher::Config::default().labels(SERVICE_NAME_LABEL),
            writers.slices,
        )
        .inspect(move |e| match e {
            Ok(e) => {
                f.mark(e, 2);
                t.slice(e);
            }
            Err(error) => tracing::warn!(%error, "watching EndpointSlices"),
        });
        let t = triggers;
        let f = filled;
        let profile_events = reflected(
            Api::<RoutingProfile>::all(client.clone()),
            watcher::Config::default(),
            writers.profiles,
        )
        .inspect(move |e| match e {
            Ok(e) => {
                f.mark(e, 3);
                t.profile(e);
            }
            Err(error) => tracing::warn!(%error, "watching RoutingProfiles"),
        });

        // The caches the controllers do not drive.
        let side = {
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                let drive = futures::future::join(
                    slice_events.for_each(|_| async {}),
                    profile_events.for_each(|_| async {}),
                );
                tokio::select! {
                    _ = drive => {}
                    () = shutdown.cancelled() => {}
                }
            })
        };
        let config = controller::Config::default().concurrency(ctx.settings.concurrency);
        let worker_sets = Controller::for_stream(ws_events, ctx.stores.worker_sets.clone())
            .with_config(config.clone())
            // Related objects' changes, and finished KV windows.
            .reconcile_on(futures::stream::select(ws_rx, kv_done))
            .reconcile_all_on(leadership_gained(
                ctx.seams.leader.clone(),
                ctx.metrics.clone(),
            ))
            .graceful_shutdown_on(shutdown.clone().cancelled_owned())
            .run(
                reconcile_worker_set,
                |obj, e, ctx| error_policy(obj.as_ref(), Kind::WorkerSet, e, &ctx),
                ctx.clone(),
            )
            .for_each(|r| async move {
                if let Err(error) = r {
                    tracing::debug!(%error, "worker set controller");
                }
            });
        let pools = Controller::for_stream(pool_events, ctx.stores.pools.clone())
            .with_config(config)
            .reconcile_on(pool_rx)
            .reconcile_all_on(leadership_gained(
                ctx.seams.leader.clone(),
                ctx.metrics.clone(),
            ))
            .graceful_shutdown_on(shutdown.clone().cancelled_owned())
            .run(
                reconcile_pool,
                |obj, e, ctx| error_policy(obj.as_ref(), Kind::Pool, e, &ctx),
                ctx.clone(),
            )
            .for_each(|r| async move {
                if let Err(error) = r {
                    tracing::debug!(%error, "pool controller");
                }
            });
        futures::future::join(worker_sets, pools).await;
        side.abort();
        ctx.kv.clear();
        ctx.ready.send_replace(false);
        tracing::info!("controllers stopped");
    }
}

/// What to probe for a worker set whose endpoints are `endpoints`.
pub fn probe_target(ws: &InferenceWorkerSet, endpoints: &endpoints::Resolution) -> ProbeTarget {
    ProbeTarget {
        worker_set: format!(
            "{}/{}",
            ws.metadata.namespace.as_deref().unwrap_or_default(),
            ws.metadata.name.as_deref().unwrap_or_default()
        ),
        endpoints: endpoints.ready().to_vec(),
        kv_events: ws.spec.kv_events.is_some(),
        kv_block_size: ws.spec.kv_block_size,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_a_cap() {
        let secs: Vec<u64> = (1..=11).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 64, 128, 256, 256, 256]);
        assert_eq!(backoff(0), Duration::from_secs(1));
    }
}
