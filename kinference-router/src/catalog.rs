//! The catalog: everything the router knows about its pool, from one place.
//!
//! Whether objects come from Kubernetes watches or from a directory of YAML
//! files, they enter through the same `apply` / `delete` / `reset` calls per
//! kind (the linkerd/kubert index pattern). After each change the catalog
//! recomputes a [`Snapshot`] (the pool's worker sets with their resolved
//! profiles and ready endpoints) and publishes it on a `watch` channel when it
//! differs. The data plane only ever reads snapshots.
//!
//! Invariants:
//! - only objects in the pool's namespace are kept (profiles are cluster-wide);
//! - a `reset` replaces every object of that kind, so a relist after a watch
//!   gap leaves nothing stale;
//! - the snapshot is `synced` only after every kind has been reset once (the
//!   first full list), which is what `/readyz` waits for.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kinference_api::conflicts;
use kinference_api::endpoints::{self, ReadyEndpoint};
use kinference_api::v1alpha1::{ModelSpec, RoutingProfileSpec};
use kinference_api::{InferencePool, InferenceWorkerSet, RoutingProfile};
use kube::ResourceExt;
use tokio::sync::watch;

/// The pool a router serves.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PoolRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl PoolRef {
    /// Parses `NAME` or `NAMESPACE/NAME` (namespace `default` when omitted).
    ///
    /// # Errors
    /// When a part is empty or there is more than one `/`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (namespace, name) = match s.split_once('/') {
            Some((ns, name)) => (ns, name),
            None => ("default", s),
        };
        if namespace.is_empty() || name.is_empty() || name.contains('/') {
            return Err(format!("pool {s:?}: expected NAME or NAMESPACE/NAME"));
        }
        Ok(Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

impl std::fmt::Display for PoolRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The kinds the catalog holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// `InferencePool`.
    Pool,
    /// `InferenceWorkerSet`.
    WorkerSet,
    /// `RoutingProfile`.
    Profile,
    /// `EndpointSlice`.
    EndpointSlice,
}

impl Kind {
    /// Every kind.
    pub const ALL: [Kind; 4] = [
        Kind::Pool,
        Kind::WorkerSet,
        Kind::Profile,
        Kind::EndpointSlice,
    ];
}

/// What the data plane routes on, recomputed after every change.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// Every kind has been listed at least once.
    pub synced: bool,
    /// The pool object exists.
    pub pool_found: bool,
    /// The worker sets the pool names, in the pool's order.
    pub worker_sets: Vec<WorkerSetRoute>,
    /// Problems a person should know about (missing worker sets, bad ports).
    pub problems: Vec<String>,
}

impl Snapshot {
    /// Every ready endpoint of every worker set (an endpoint serving two
    /// worker sets appears once per set).
    pub fn endpoints(&self) -> impl Iterator<Item = (&WorkerSetRoute, &ReadyEndpoint)> {
        self.worker_sets
            .iter()
            .flat_map(|ws| ws.endpoints.iter().map(move |e| (ws, e)))
    }
}

/// One worker set of the pool, ready to route to.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerSetRoute {
    /// Its name.
    pub name: String,
    /// Tokens per block in its engines' KV events.
    pub kv_block_size: u32,
    /// The profile it names.
    pub profile_name: String,
    /// The `RoutingProfile` object of that name, if there is one. `None` with
    /// a built-in name means the built-in profile; `None` otherwise means the
    /// profile is unknown and the set is not routed to.
    pub profile: Option<RoutingProfileSpec>,
    /// Models from the spec (more are discovered from the engines).
    pub models: Vec<ModelSpec>,
    /// Whether `kvEvents` is set.
    pub kv_events: bool,
    /// Ready endpoints.
    pub endpoints: Vec<ReadyEndpoint>,
}

impl WorkerSetRoute {
    /// Whether the profile resolves (an object or a built-in name).
    pub fn profile_known(&self) -> bool {
        self.profile.is_some() || kinference_api::is_builtin_profile(&self.profile_name)
    }
}

/// The catalog. Not shared: one task owns it (or it sits behind a mutex) and
/// feeds it; readers subscribe to snapshots.
#[derive(Debug)]
pub struct Catalog {
    pool: PoolRef,
    pools: BTreeMap<String, InferencePool>,
    worker_sets: BTreeMap<String, InferenceWorkerSet>,
    profiles: BTreeMap<String, RoutingProfile>,
    slices: BTreeMap<String, EndpointSlice>,
    listed: Vec<Kind>,
    tx: watch::Sender<Arc<Snapshot>>,
}

impl Catalog {
    /// An empty catalog for `pool`, and a receiver of its snapshots.
    pub fn new(pool: PoolRef) -> (Self, watch::Receiver<Arc<Snapshot>>) {
        let (tx, rx) = watch::channel(Arc::new(Snapshot::default()));
        let catalog = Self {
            pool,
            pools: BTreeMap::new(),
            worker_sets: BTreeMap::new(),
            profiles: BTreeMap::new(),
            slices: BTreeMap::new(),
            listed: Vec::new(),
            tx,
        };
        (catalog, rx)
    }

    /// The pool served.
    pub fn pool(&self) -> &PoolRef {
        &self.pool
    }

    /// Another receiver of snapshots.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.tx.subscribe()
    }

    fn in_namespace(&self, ns: Option<&str>) -> bool {
        ns.unwrap_or("default") == self.pool.namespace
    }

    /// Adds or replaces a pool.
    pub fn apply_pool(&mut self, o: InferencePool) {
        if self.in_namespace(o.namespace().as_deref()) {
            self.pools.insert(o.name_any(), o);
            self.publish();
        }
    }

    /// Removes a pool.
    pub fn delete_pool(&mut self, name: &str) {
        if self.pools.remove(name).is_some() {
            self.publish();
        }
    }

    /// Replaces every pool (a full list).
    pub fn reset_pools(&mut self, all: Vec<InferencePool>) {
        self.pools = all
            .into_iter()
            .filter(|o| self.in_namespace(o.namespace().as_deref()))
            .map(|o| (o.name_any(), o))
            .collect();
        self.listed(Kind::Pool);
    }

    /// Adds or replaces a worker set.
    pub fn apply_worker_set(&mut self, o: InferenceWorkerSet) {
        if self.in_namespace(o.namespace().as_deref()) {
            self.worker_sets.insert(o.name_any(), o);
            self.publish();
        }
    }

    /// Removes a worker set.
    pub fn delete_worker_set(&mut self, name: &str) {
        if self.worker_sets.remove(name).is_some() {
            self.publish();
        }
    }

    /// Replaces every worker set (a full list).
    pub fn reset_worker_sets(&mut self, all: Vec<InferenceWorkerSet>) {
        self.worker_sets = all
            .into_iter()
            .filter(|o| self.in_namespace(o.namespace().as_deref()))
            .map(|o| (o.name_any(), o))
            .collect();
        self.listed(Kind::WorkerSet);
    }

    /// Adds or replaces a profile (cluster-scoped).
    pub fn apply_profile(&mut self, o: RoutingProfile) {
        self.profiles.insert(o.name_any(), o);
        self.publish();
    }

    /// Removes a profile.
    pub fn delete_profile(&mut self, name: &str) {
        if self.profiles.remove(name).is_some() {
            self.publish();
        }
    }

    /// Replaces every profile (a full list).
    pub fn reset_profiles(&mut self, all: Vec<RoutingProfile>) {
        self.profiles = all.into_iter().map(|o| (o.name_any(), o)).collect();
        self.listed(Kind::Profile);
    }

    /// Adds or replaces an EndpointSlice.
    pub fn apply_slice(&mut self, o: EndpointSlice) {
        if self.in_namespace(o.namespace().as_deref()) {
            self.slices.insert(o.name_any(), o);
            self.publish();
        }
    }

    /// Removes an EndpointSlice.
    pub fn delete_slice(&mut self, name: &str) {
        if self.slices.remove(name).is_some() {
            self.publish();
        }
    }

    /// Replaces every EndpointSlice (a full list).
    pub fn reset_slices(&mut self, all: Vec<EndpointSlice>) {
        self.slices = all
            .into_iter()
            .filter(|o| self.in_namespace(o.namespace().as_deref()))
            .map(|o| (o.name_any(), o))
            .collect();
        self.listed(Kind::EndpointSlice);
    }

    fn listed(&mut self, kind: Kind) {
        if !self.listed.contains(&kind) {
            self.listed.push(kind);
        }
        self.publish();
    }

    /// The snapshot the current objects give.
    pub fn snapshot(&self) -> Snapshot {
        let mut problems = Vec::new();
        let pool = self.pools.get(&self.pool.name);
        let mut worker_sets = Vec::new();
        if let Some(pool) = pool {
            // Names claimed twice: the rule the controller applies (the
            // older set keeps the name, the newer is not routed to).
            let claimants = pool
                .spec
                .worker_sets
                .iter()
                .filter_map(|r| self.worker_sets.get(&r.name))
                .filter(|ws| {
                    self.profiles.contains_key(&ws.spec.profile)
                        || kinference_api::is_builtin_profile(&ws.spec.profile)
                })
                .map(|ws| conflicts::Claimant {
                    name: ws.name_any(),
                    created: ws.metadata.creation_timestamp.clone(),
                    pools: vec![self.pool.name.clone()],
                    claims: conflicts::claims(ws),
                })
                .collect();
            let rejected = conflicts::decide(claimants).rejected;
            for r in &pool.spec.worker_sets {
                let Some(ws) = self.worker_sets.get(&r.name) else {
                    problems.push(format!(
                        "InferencePool {} names InferenceWorkerSet {} which does not exist",
                        self.pool, r.name
                    ));
                    continue;
                };
                if let Some(clashes) = rejected.get(&r.name) {
                    problems.push(format!(
                        "InferenceWorkerSet {} is rejected with AliasConflict ({}); not routing to it",
                        r.name,
                        clashes.join("; ")
                    ));
                    continue;
                }
                let spec = &ws.spec;
                let slices = self
                    .slices
                    .values()
                    .filter(|s| endpoints::belongs_to(s, &spec.service_ref.name));
                let eps = endpoints::read(
                    slices,
                    &spec.service_ref.port,
                    spec.kv_events.as_ref().map(|k| &k.port),
                    spec.kv_events.as_ref().and_then(|k| k.replay_port.as_ref()),
                );
                for e in eps.http_port_errors.iter().chain(&eps.kv_port_errors) {
                    problems.push(format!("InferenceWorkerSet {}: {e}", r.name));
                }
                let route = WorkerSetRoute {
                    name: r.name.clone(),
                    kv_block_size: spec.kv_block_size,
                    profile_name: spec.profile.clone(),
                    profile: self.profiles.get(&spec.profile).map(|p| p.spec.clone()),
                    models: spec.models.clone(),
                    kv_events: spec.kv_events.is_some(),
                    endpoints: eps.ready,
                };
                if !route.profile_known() {
                    problems.push(format!(
                        "InferenceWorkerSet {}: profile {:?} is neither built in nor a RoutingProfile; not routing to it",
                        r.name, spec.profile
                    ));
                }
                worker_sets.push(route);
            }
        } else {
            problems.push(format!("InferencePool {} does not exist", self.pool));
        }
        Snapshot {
            synced: Kind::ALL.iter().all(|k| self.listed.contains(k)),
            pool_found: pool.is_some(),
            worker_sets,
            problems,
        }
    }

    fn publish(&mut self) {
        let next = self.snapshot();
        self.tx.send_if_modified(|cur| {
            if **cur == next {
                false
            } else {
                *cur = Arc::new(next);
                true
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use kinference_api::test_util::{mk_pool, mk_slice as slice, mk_spec};

    /// A worker set of `service` (ports `http` and `kv`) naming `profile`.
    fn mk_ws(name: &str, service: &str, profile: &str) -> InferenceWorkerSet {
        let mut spec = mk_spec(service, "http", Some("kv"), &[]);
        spec.profile = profile.into();
        kinference_api::test_util::mk_ws(name, 0, spec)
    }

    /// A slice of `service` with ports `http` 8000 and `kv` 5557.
    fn mk_slice(name: &str, service: &str, ready: &[(&str, bool)]) -> EndpointSlice {
        let eps: Vec<(&str, Option<bool>)> = ready.iter().map(|(a, r)| (*a, Some(*r))).collect();
        slice(name, service, &[("http", 8000), ("kv", 5557)], &eps)
    }

    fn pool_ref() -> PoolRef {
        PoolRef::parse(&format!("{}/chat", kinference_api::test_util::NAMESPACE)).unwrap()
    }

    #[test]
    fn pool_refs_parse() {
        assert_eq!(
            PoolRef::parse("ns/p").unwrap(),
            PoolRef {
                namespace: "ns".into(),
                name: "p".into()
            }
        );
        assert_eq!(PoolRef::parse("p").unwrap().namespace, "default");
        assert!(PoolRef::parse("a/b/c").is_err());
        assert!(PoolRef::parse("/p").is_err());
        assert!(PoolRef::parse("").is_err());
    }

    #[test]
    fn synced_only_after_every_kind_is_listed() {
        let (mut c, rx) = Catalog::new(pool_ref());
        c.reset_pools(vec![mk_pool("chat", &["qwen"])]);
        c.reset_worker_sets(vec![mk_ws("qwen", "qwen-svc", "default")]);
        c.reset_profiles(vec![]);
        assert!(!rx.borrow().synced);
        c.reset_slices(vec![mk_slice("s1", "qwen-svc", &[("10.0.0.1", true)])]);
        let snap = rx.borrow().clone();
        assert!(snap.synced && snap.pool_found);
        assert_eq!(snap.worker_sets.len(), 1);
        let ws = &snap.worker_sets[0];
        assert_eq!(ws.endpoints.len(), 1);
        assert_eq!(ws.endpoints[0].http_port, 8000);
        assert_eq!(ws.endpoints[0].kv_port, Some(5557));
        assert!(ws.profile_known());
        assert!(snap.problems.is_empty(), "{:?}", snap.problems);
    }

    #[test]
    fn endpoints_follow_slices_and_relists_leave_nothing_stale() {
        let (mut c, rx) = Catalog::new(pool_ref());
        c.reset_pools(vec![mk_pool("chat", &["qwen"])]);
        c.reset_worker_sets(vec![mk_ws("qwen", "qwen-svc", "default")]);
        c.reset_profiles(vec![]);
        c.reset_slices(vec![
            mk_slice("s1", "qwen-svc", &[("10.0.0.1", true), ("10.0.0.2", false)]),
            mk_slice("other", "other-svc", &[("10.9.9.9", true)]),
        ]);
        let addrs = |rx: &watch::Receiver<Arc<Snapshot>>| -> Vec<String> {
            rx.borrow()
                .endpoints()
                .map(|(_, e)| e.address.clone())
                .collect()
        };
        assert_eq!(addrs(&rx), ["10.0.0.1"]);

        c.apply_slice(mk_slice("s2", "qwen-svc", &[("10.0.0.3", true)]));
        assert_eq!(addrs(&rx), ["10.0.0.1", "10.0.0.3"]);

        c.delete_slice("s1");
        assert_eq!(addrs(&rx), ["10.0.0.3"]);

        // A relist that no longer has s2 (deleted during a watch gap).
        c.reset_slices(vec![mk_slice("s1", "qwen-svc", &[("10.0.0.4", true)])]);
        assert_eq!(addrs(&rx), ["10.0.0.4"]);
    }

    #[test]
    fn unknown_profile_and_missing_sets_are_reported() {
        let (mut c, rx) = Catalog::new(pool_ref());
        c.reset_pools(vec![mk_pool("chat", &["qwen", "missing"])]);
        c.reset_worker_sets(vec![mk_ws("qwen", "qwen-svc", "fast")]);
        c.reset_profiles(vec![]);
        c.reset_slices(vec![]);
        let snap = rx.borrow().clone();
        assert_eq!(snap.worker_sets.len(), 1);
        assert!(!snap.worker_sets[0].profile_known());
        assert_eq!(snap.problems.len(), 2, "{:?}", snap.problems);

        c.apply_profile(RoutingProfile::new("fast", RoutingProfileSpec::default()));
        assert!(rx.borrow().worker_sets[0].profile_known());
    }

    #[test]
    fn other_namespaces_and_pools_are_ignored() {
        let (mut c, rx) = Catalog::new(pool_ref());
        let mut foreign = mk_ws("qwen", "qwen-svc", "default");
        foreign.metadata.namespace = Some("elsewhere".into());
        c.reset_pools(vec![mk_pool("chat", &["qwen"]), mk_pool("other", &["x"])]);
        c.reset_worker_sets(vec![foreign]);
        c.reset_profiles(vec![]);
        c.reset_slices(vec![]);
        let snap = rx.borrow().clone();
        assert!(snap.worker_sets.is_empty());
        assert_eq!(snap.problems.len(), 1);
    }

    #[test]
    fn an_alias_claimed_twice_stays_with_the_older_set() {
        let (mut c, rx) = Catalog::new(pool_ref());
        c.reset_pools(vec![mk_pool("chat", &["old", "new"])]);
        let with_alias = |name: &str, created: i64, model: &str| {
            let mut spec = mk_spec(
                &format!("{name}-svc"),
                "http",
                Some("kv"),
                &[(model, &["fast"])],
            );
            spec.profile = "default".into();
            kinference_api::test_util::mk_ws(name, created, spec)
        };
        c.reset_worker_sets(vec![
            with_alias("new", 20, "m2"),
            with_alias("old", 10, "m1"),
        ]);
        c.reset_profiles(vec![]);
        c.reset_slices(vec![]);
        let snap = rx.borrow().clone();
        let names: Vec<&str> = snap.worker_sets.iter().map(|w| w.name.as_str()).collect();
        assert_eq!(names, ["old"], "the newer claim is not routed to");
        assert!(
            snap.problems
                .iter()
                .any(|p| p.contains("AliasConflict") && p.contains("new")),
            "{:?}",
            snap.problems
        );
    }

    #[test]
    fn unchanged_objects_publish_nothing() {
        let (mut c, mut rx) = Catalog::new(pool_ref());
        c.reset_pools(vec![mk_pool("chat", &["qwen"])]);
        c.reset_worker_sets(vec![mk_ws("qwen", "qwen-svc", "default")]);
        c.reset_profiles(vec![]);
        c.reset_slices(vec![mk_slice("s1", "qwen-svc", &[("10.0.0.1", true)])]);
        rx.mark_unchanged();
        c.apply_slice(mk_slice("s1", "qwen-svc", &[("10.0.0.1", true)]));
        assert!(!rx.has_changed().unwrap());
    }
}
