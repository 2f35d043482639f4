//! Which objects to reconcile when a related object changes.
//!
//! Each kind is watched once; every watch event (deletions included) passes
//! through [`Triggers`], which looks the relations up in the caches and
//! queues the worker sets and pools whose status may change. The relations:
//!
//! | change | worker sets queued | pools queued |
//! |---|---|---|
//! | EndpointSlice of Service S in namespace N | those of N whose `serviceRef.name` is S, and their pool siblings | those naming them |
//! | InferencePool in N | every one of N (it may have named others before) | (itself, by its own watch) |
//! | RoutingProfile P | those naming profile P, and their pool siblings | those naming them |
//! | InferenceWorkerSet W in N | its pool siblings (names may now conflict or not) | those naming W |
//! | a relist of any kind | all | all |
//!
//! A worker set and a pool are queued for their own changes by their own
//! controllers. The controllers deduplicate queued objects, so a burst of
//! events costs one reconcile per object.

use std::collections::BTreeSet;
use std::sync::Arc;

use futures::channel::mpsc::UnboundedSender;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kinference_api::{InferencePool, InferenceWorkerSet, RoutingProfile};
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::Event;

use crate::endpoints;

/// The caches the controllers read.
#[derive(Clone)]
pub struct Stores {
    /// Worker sets.
    pub worker_sets: Store<InferenceWorkerSet>,
    /// Pools.
    pub pools: Store<InferencePool>,
    /// EndpointSlices labelled with a Service name.
    pub slices: Store<EndpointSlice>,
    /// Routing profiles.
    pub profiles: Store<RoutingProfile>,
}

impl std::fmt::Debug for Stores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stores")
            .field("worker_sets", &self.worker_sets.len())
            .field("pools", &self.pools.len())
            .field("slices", &self.slices.len())
            .field("profiles", &self.profiles.len())
            .finish()
    }
}

/// Queues reconciles of objects related to a changed one.
#[derive(Clone, Debug)]
pub struct Triggers {
    stores: Stores,
    worker_sets: UnboundedSender<ObjectRef<InferenceWorkerSet>>,
    pools: UnboundedSender<ObjectRef<InferencePool>>,
}

/// The worker sets of `ns` that share a pool with one of `names`, and those
/// names themselves.
pub fn with_pool_siblings(
    ns: &str,
    names: &BTreeSet<String>,
    pools: &[Arc<InferencePool>],
) -> BTreeSet<String> {
    let mut out = names.clone();
    for p in pools
        .iter()
        .filter(|p| p.namespace().as_deref() == Some(ns))
    {
        if p.spec.worker_sets.iter().any(|r| names.contains(&r.name)) {
            out.extend(p.spec.worker_sets.iter().map(|r| r.name.clone()));
        }
    }
    out
}

/// The pools of `ns` naming one of `names`.
pub fn pools_naming(
    ns: &str,
    names: &BTreeSet<String>,
    pools: &[Arc<InferencePool>],
) -> BTreeSet<String> {
    pools
        .iter()
        .filter(|p| p.namespace().as_deref() == Some(ns))
        .filter(|p| p.spec.worker_sets.iter().any(|r| names.contains(&r.name)))
        .map(|p| p.name_any())
        .collect()
}

impl Triggers {
    /// Triggers reading `stores` and queueing on the two channels.
    pub fn new(
        stores: Stores,
        worker_sets: UnboundedSender<ObjectRef<InferenceWorkerSet>>,
        pools: UnboundedSender<ObjectRef<InferencePool>>,
    ) -> Self {
        Triggers {
            stores,
            worker_sets,
            pools,
        }
    }

    fn queue_sets<'a>(&self, ns: &str, names: impl IntoIterator<Item = &'a String>) {
        for n in names {
            // A closed channel means the controller stopped: nothing to do.
            let _ = self
                .worker_sets
                .unbounded_send(ObjectRef::new(n).within(ns));
        }
    }

    fn queue_pools<'a>(&self, ns: &str, names: impl IntoIterator<Item = &'a String>) {
        for n in names {
            let _ = self.pools.unbounded_send(ObjectRef::new(n).within(ns));
        }
    }

    /// Queues `names` of `ns`, their pool siblings and the pools naming them.
    fn fan_out(&self, ns: &str, names: &BTreeSet<String>) {
        if names.is_empty() {
            return;
        }
        let pools = self.stores.pools.state();
        self.queue_sets(ns, &with_pool_siblings(ns, names, &pools));
        self.queue_pools(ns, &pools_naming(ns, names, &pools));
    }

    /// Queues every worker set and pool.
    pub fn everything(&self) {
        for w in self.stores.worker_sets.state() {
            let _ = self.worker_sets.unbounded_send(ObjectRef::from(&*w));
        }
        for p in self.stores.pools.state() {
            let _ = self.pools.unbounded_send(ObjectRef::from(&*p));
        }
    }

    /// An EndpointSlice changed.
    pub fn slice(&self, event: &Event<EndpointSlice>) {
        match event {
            Event::Apply(s) | Event::Delete(s) => {
                let (Some(ns), Some(service)) = (s.namespace(), endpoints::service_of(s)) else {
                    return;
                };
                let names: BTreeSet<String> = self
                    .stores
                    .worker_sets
                    .state()
                    .iter()
                    .filter(|w| {
                        w.namespace().as_deref() == Some(ns.as_str())
                            && w.spec.service_ref.name == service
                    })
                    .map(|w| w.name_any())
                    .collect();
                self.fan_out(&ns, &names);
            }
            Event::InitDone => self.everything(),
            Event::Init | Event::InitApply(_) => {}
        }
    }

    /// A pool changed (its own controller reconciles it).
    pub fn pool(&self, event: &Event<InferencePool>) {
        match event {
            Event::Apply(p) | Event::Delete(p) => {
                let Some(ns) = p.namespace() else {
                    return;
                };
                let names: Vec<String> = self
                    .stores
                    .worker_sets
                    .state()
                    .iter()
                    .filter(|w| w.namespace().as_deref() == Some(ns.as_str()))
                    .map(|w| w.name_any())
                    .collect();
                self.queue_sets(&ns, &names);
            }
            Event::InitDone => self.everything(),
            Event::Init | Event::InitApply(_) => {}
        }
    }

    /// A routing profile changed.
    pub fn profile(&self, event: &Event<RoutingProfile>) {
        match event {
            Event::Apply(p) | Event::Delete(p) => {
                let profile = p.name_any();
                let mut by_ns: std::collections::BTreeMap<String, BTreeSet<String>> =
                    std::collections::BTreeMap::new();
                for w in self.stores.worker_sets.state() {
                    if w.spec.profile == profile
                        && let Some(ns) = w.namespace()
                    {
                        by_ns.entry(ns).or_default().insert(w.name_any());
                    }
                }
                for (ns, names) in by_ns {
                    self.fan_out(&ns, &names);
                }
            }
            Event::InitDone => self.everything(),
            Event::Init | Event::InitApply(_) => {}
        }
    }

    /// A worker set changed (its own controller reconciles it).
    pub fn worker_set(&self, event: &Event<InferenceWorkerSet>) {
        match event {
            Event::Apply(w) | Event::Delete(w) => {
                let Some(ns) = w.namespace() else {
                    return;
                };
                let me = w.name_any();
                let names = BTreeSet::from([me.clone()]);
                let pools = self.stores.pools.state();
                let siblings = with_pool_siblings(&ns, &names, &pools);
                self.queue_sets(&ns, siblings.iter().filter(|s| **s != me));
                self.queue_pools(&ns, &pools_naming(&ns, &names, &pools));
            }
            Event::InitDone => {
                for p in self.stores.pools.state() {
                    let _ = self.pools.unbounded_send(ObjectRef::from(&*p));
                }
            }
            Event::Init | Event::InitApply(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::mk_pool;

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn relations() {
        let mut other_ns = mk_pool("p", &["a", "z"]);
        other_ns.metadata.namespace = Some("elsewhere".into());
        let pools = vec![
            Arc::new(mk_pool("p", &["a", "b"])),
            Arc::new(mk_pool("q", &["b", "c"])),
            Arc::new(mk_pool("r", &["d"])),
            Arc::new(other_ns),
        ];
        assert_eq!(
            with_pool_siblings("ns", &set(&["a"]), &pools),
            set(&["a", "b"])
        );
        assert_eq!(
            with_pool_siblings("ns", &set(&["b"]), &pools),
            set(&["a", "b", "c"])
        );
        assert_eq!(with_pool_siblings("ns", &set(&["x"]), &pools), set(&["x"]));
        assert_eq!(pools_naming("ns", &set(&["b"]), &pools), set(&["p", "q"]));
        assert_eq!(
            pools_naming("ns", &set(&["d", "a"]), &pools),
            set(&["p", "r"])
        );
        assert_eq!(pools_naming("elsewhere", &set(&["z"]), &pools), set(&["p"]));
    }
}
