//! Status of worker sets and pools, computed by pure functions.
//!
//! The data model: a worker set's status depends on its namespace (its
//! Service's EndpointSlices, the pools that name it, the other worker sets of
//! those pools), on the cluster's `RoutingProfile` names, on the latest probe
//! of its engines and on its previous status (whose times are kept). A
//! [`Namespace`] holds those inputs; [`Facts::compute`] derives what every
//! worker set and pool of it needs in one pass; [`worker_set_status`] and
//! [`pool_status`] turn facts into the status to write. Nothing here does I/O
//! or reads a clock: `now` is an argument.
//!
//! # Invariants
//!
//! - Equal inputs give equal statuses; recomputing an unchanged status yields
//!   the previous one byte for byte (times included), so the caller writes
//!   only on change.
//! - A condition's `lastTransitionTime` moves only when its status flips
//!   ([`kinference_api::conditions::set`]); a diagnosis keeps its `since`
//!   while its reason persists.
//! - Name conflicts are decided oldest first: worker sets are taken in order
//!   of `creationTimestamp` (then name); one that claims a name already
//!   claimed for another model by an admitted set of a shared pool is
//!   rejected with `AliasConflict`, the older keeps the name.
//!
//! # Rejections
//!
//! | rejection | when |
//! |---|---|
//! | `UnknownProfile` | `profile` is neither built in nor a `RoutingProfile` |
//! | `InvalidPort` | once slices exist: `serviceRef.port` or `kvEvents.port` is in none of them (by name or number), or both resolve to one port |
//! | `AliasConflict` | a model name or alias means another model in an older worker set of a shared pool |
//!
//! A name *means* a model: a model name means itself, an alias the model it
//! is listed under. Two worker sets claiming a name with the same meaning
//! (two sets serving one model, with the same alias) do not conflict; the
//! pool offers the model from both.
//!
//! Cost: [`Facts::compute`] is O(S·(L + P) + Σ pool members² · names) for S
//! worker sets, L slices and P pools of a namespace.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kinference_api::conditions::{self, Desired, reason};
use kinference_api::conflicts;
use kinference_api::v1alpha1::{Diagnosis, NameConflict, OfferedModel, ServedModel};
use kinference_api::{
    InferencePool, InferencePoolStatus, InferenceWorkerSet, InferenceWorkerSetStatus, Rejection,
    WorkerSetState, is_builtin_profile,
};

use crate::diagnose::{self, Finding};
use crate::endpoints::{self, PortLookup, Resolution};
use crate::probe::ProbeResult;

/// Everything of one namespace that statuses are computed from.
#[derive(Clone, Copy, Debug)]
pub struct Namespace<'a> {
    /// Its worker sets.
    pub worker_sets: &'a [&'a InferenceWorkerSet],
    /// Its pools.
    pub pools: &'a [&'a InferencePool],
    /// Its EndpointSlices (of any Service).
    pub slices: &'a [&'a EndpointSlice],
    /// Names of the cluster's `RoutingProfile` objects.
    pub profiles: &'a BTreeSet<String>,
}

/// What a worker set is rejected for, with what to change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// The rejection.
    pub rejection: Rejection,
    /// What is wrong and what to change.
    pub message: String,
}

/// A model a worker set offers under its names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Offer {
    /// The served model name.
    pub name: String,
    /// Its aliases (from the spec).
    pub aliases: Vec<String>,
}

/// What is known about one worker set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetFacts {
    /// Why it is rejected; empty when accepted.
    pub rejections: Vec<Rejected>,
    /// Its endpoints.
    pub endpoints: Resolution,
    /// The pools that name it, sorted.
    pub pools: Vec<String>,
    /// The models it offers: `spec.models`, then models its status reports
    /// as discovered and the spec does not list.
    pub offers: Vec<Offer>,
}

impl SetFacts {
    /// Whether the spec is accepted.
    pub fn accepted(&self) -> bool {
        self.rejections.is_empty()
    }

    /// The STATE column's facts.
    pub fn state(&self) -> WorkerSetState {
        WorkerSetState {
            rejections: self.rejections.iter().map(|r| r.rejection).collect(),
            ready_endpoints: u32::try_from(self.endpoints.ready().len()).unwrap_or(u32::MAX),
            referenced: !self.pools.is_empty(),
        }
    }
}

/// What is known about a namespace's worker sets and pools.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    /// Per worker set, by name.
    pub sets: BTreeMap<String, SetFacts>,
    /// Per pool, by name: the names claimed by more than one of its worker sets.
    pub conflicts: BTreeMap<String, Vec<NameConflict>>,
}

fn name_of(meta: &kube::core::ObjectMeta) -> &str {
    meta.name.as_deref().unwrap_or_default()
}

impl Facts {
    /// Derives the facts of every worker set and pool of `ns`.
    pub fn compute(ns: &Namespace<'_>) -> Facts {
        let mut sets = BTreeMap::new();
        for ws in ns.worker_sets {
            let name = name_of(&ws.metadata);
            let spec = &ws.spec;
            let endpoints = endpoints::resolve(spec, ns.slices.iter().copied());
            let mut rejections = Vec::new();
            if !is_builtin_profile(&spec.profile) && !ns.profiles.contains(&spec.profile) {
                rejections.push(Rejected {
                    rejection: Rejection::UnknownProfile,
                    message: format!(
                        "profile {:?} is neither built in ({}) nor a RoutingProfile: create a RoutingProfile of that name or name an existing one",
                        spec.profile,
                        kinference_api::BUILTIN_PROFILES.join(", ")
                    ),
                });
            }
            let service = &spec.service_ref.name;
            let mut port_problems = Vec::new();
            if let PortLookup::Missing(e) = &endpoints.http_port {
                port_problems.push(format!(
                    "serviceRef.port {} is not a port of Service {service:?}: {e}",
                    endpoints::describe_port(&spec.service_ref.port)
                ));
            }
            if let (Some(PortLookup::Missing(e)), Some(kv)) = (&endpoints.kv_port, &spec.kv_events)
            {
                port_problems.push(format!(
                    "kvEvents.port {} is not a port of Service {service:?}: {e}",
                    endpoints::describe_port(&kv.port)
                ));
            }
            if !port_problems.is_empty() {
                rejections.push(Rejected {
                    rejection: Rejection::InvalidPort,
                    message: format!(
                        "{}; use one of its port names or numbers (as its EndpointSlices list them)",
                        port_problems.join("; ")
                    ),
                });
            } else if let Some(p) = endpoints.same_port {
                rejections.push(Rejected {
                    rejection: Rejection::InvalidPort,
                    message: format!(
                        "serviceRef.port and kvEvents.port are both port {p}: the KV-event publisher needs a port of its own"
                    ),
                });
            }
            let mut pools: Vec<String> = ns
                .pools
                .iter()
                .filter(|p| p.spec.worker_sets.iter().any(|r| r.name == name))
                .map(|p| name_of(&p.metadata).to_owned())
                .collect();
            pools.sort();
            let mut offers: Vec<Offer> = spec
                .models
                .iter()
                .map(|m| Offer {
                    name: m.name.clone(),
                    aliases: m.aliases.clone(),
                })
                .collect();
            if let Some(status) = &ws.status {
                for m in &status.models {
                    if !offers.iter().any(|o| o.name == m.name) {
                        offers.push(Offer {
                            name: m.name.clone(),
                            aliases: Vec::new(),
                        });
                    }
                }
            }
            sets.insert(
                name.to_owned(),
                SetFacts {
                    rejections,
                    endpoints,
                    pools,
                    offers,
                },
            );
        }
        let mut facts = Facts {
            sets,
            conflicts: BTreeMap::new(),
        };
        facts.decide_conflicts(ns);
        facts
    }

    /// Admits worker sets oldest first; a set that gives a name another
    /// meaning than an admitted set of a shared pool does is rejected.
    fn decide_conflicts(&mut self, ns: &Namespace<'_>) {
        // The rule is kinference-api's, shared with the router.
        let claimants = ns
            .worker_sets
            .iter()
            .filter_map(|ws| {
                let name = name_of(&ws.metadata);
                let set = self.sets.get(name)?;
                (set.accepted() && !set.pools.is_empty()).then(|| conflicts::Claimant {
                    name: name.to_owned(),
                    created: ws.metadata.creation_timestamp.clone(),
                    pools: set.pools.clone(),
                    claims: conflicts::claims(ws),
                })
            })
            .collect();
        let decision = conflicts::decide(claimants);
        for (name, clashes) in decision.rejected {
            if let Some(set) = self.sets.get_mut(&name) {
                set.rejections.push(Rejected {
                    rejection: Rejection::AliasConflict,
                    message: format!(
                        "{}: rename the alias (or the served model) in one of them, or serve them from different pools",
                        clashes.join("; ")
                    ),
                });
            }
        }
        self.conflicts.extend(decision.conflicts);
    }
}

fn generation(meta: &kube::core::ObjectMeta) -> Option<i64> {
    meta.generation
}

/// The status a worker set should have.
///
/// `facts` are its [`SetFacts`] (from [`Facts::compute`] over its namespace),
/// `probe` the latest probe of its engines (`None`: not probed), `now` the
/// time for anything that starts now (whole seconds, as the API server
/// stores them).
pub fn worker_set_status(
    ws: &InferenceWorkerSet,
    facts: &SetFacts,
    probe: Option<&ProbeResult>,
    now: &Time,
) -> InferenceWorkerSetStatus {
    let prev = ws.status.clone().unwrap_or_default();
    let gen_ = generation(&ws.metadata);
    let state = facts.state();
    let ready = facts.endpoints.ready().len();
    let ns = ws.metadata.namespace.as_deref().unwrap_or_default();
    let service = &ws.spec.service_ref.name;

    let mut conds: Vec<Condition> = prev
        .conditions
        .iter()
        .filter(|c| {
            [
                conditions::ACCEPTED,
                conditions::READY,
                conditions::REFERENCED,
            ]
            .contains(&c.type_.as_str())
        })
        .cloned()
        .collect();
    let accepted = match facts.rejections.first() {
        None => Desired {
            type_: conditions::ACCEPTED,
            status: true,
            reason: reason::ACCEPTED,
            message: "the spec is valid and its references resolve".to_owned(),
        },
        Some(first) => Desired {
            type_: conditions::ACCEPTED,
            status: false,
            reason: first.rejection.as_str(),
            message: facts
                .rejections
                .iter()
                .map(|r| r.message.as_str())
                .collect::<Vec<_>>()
                .join("; "),
        },
    };
    let ready_cond = if ready > 0 {
        Desired {
            type_: conditions::READY,
            status: true,
            reason: reason::ENDPOINTS_READY,
            message: format!(
                "{ready} ready endpoint{} behind Service {service:?}",
                if ready == 1 { "" } else { "s" }
            ),
        }
    } else {
        let e = &facts.endpoints;
        let why = if e.endpoints.slices == 0 {
            format!(
                "no EndpointSlice is labelled {}={service} in namespace {ns}: check that the Service exists and selects the engines' pods",
                endpoints::SERVICE_NAME_LABEL
            )
        } else if e.http_port.is_missing() {
            format!("no endpoint of Service {service:?} has the port serviceRef.port names")
        } else if e.endpoints.not_ready > 0 {
            format!(
                "none of the {} endpoints of Service {service:?} is ready",
                e.endpoints.not_ready
            )
        } else {
            format!("the EndpointSlices of Service {service:?} list no endpoints")
        };
        Desired {
            type_: conditions::READY,
            status: false,
            reason: reason::NO_READY_ENDPOINTS,
            message: why,
        }
    };
    let referenced = if facts.pools.is_empty() {
        Desired {
            type_: conditions::REFERENCED,
            status: false,
            reason: reason::UNREFERENCED,
            message: format!(
                "no InferencePool in namespace {ns} names this worker set: add it to a pool's spec.workerSets to serve it"
            ),
        }
    } else {
        Desired {
            type_: conditions::REFERENCED,
            status: true,
            reason: reason::REFERENCED_BY_POOL,
            message: format!("named by InferencePool {}", facts.pools.join(", ")),
        }
    };
    for d in [&accepted, &ready_cond, &referenced] {
        conditions::set(&mut conds, d, gen_, now);
    }
    // A stable order: Accepted, Ready, Referenced.
    conds.sort_by_key(|c| {
        [
            conditions::ACCEPTED,
            conditions::READY,
            conditions::REFERENCED,
        ]
        .iter()
        .position(|t| *t == c.type_)
    });

    let findings = diagnose::diagnose(&ws.spec, &facts.endpoints, probe);
    let diagnoses = findings
        .into_iter()
        .map(|Finding { reason, message }| {
            let since = prev
                .diagnoses
                .iter()
                .find(|d| d.reason == reason.as_str())
                .map_or_else(|| now.clone(), |d| d.since.clone());
            Diagnosis {
                reason: reason.as_str().to_owned(),
                message,
                since,
            }
        })
        .collect();

    InferenceWorkerSetStatus {
        ready_endpoints: i32::try_from(ready).unwrap_or(i32::MAX),
        state: state.render(),
        conditions: conds,
        models: served_models(ws, facts, probe, &prev.models),
        diagnoses,
        observed_generation: gen_,
    }
}

/// `status.models`: what the engines answered, or, when none answered this
/// round, the previous list (names and context lengths), or before any
/// answer the models the spec declares. Aliases come from the spec and are in
/// effect only while the worker set is accepted.
fn served_models(
    ws: &InferenceWorkerSet,
    facts: &SetFacts,
    probe: Option<&ProbeResult>,
    prev: &[ServedModel],
) -> Vec<ServedModel> {
    let mut found: BTreeMap<String, Option<i64>> = BTreeMap::new();
    let answers: Vec<_> = probe
        .map(|p| {
            p.models
                .iter()
                .filter_map(|m| m.outcome.as_ref().ok())
                .collect()
        })
        .unwrap_or_default();
    if answers.is_empty() {
        if prev.is_empty() {
            for m in &ws.spec.models {
                found.insert(m.name.clone(), None);
            }
        } else {
            for m in prev {
                found.insert(m.name.clone(), m.max_model_len);
            }
        }
    } else {
        for card in answers.into_iter().flatten() {
            let len = card.max_model_len.and_then(|l| i64::try_from(l).ok());
            let slot = found.entry(card.id.clone()).or_insert(len);
            // Endpoints that disagree: the smallest context is the one every
            // endpoint can serve.
            if let (Some(a), Some(b)) = (*slot, len) {
                *slot = Some(a.min(b));
            } else if slot.is_none() {
                *slot = len;
            }
        }
    }
    found
        .into_iter()
        .map(|(name, max_model_len)| {
            let aliases = if facts.accepted() {
                ws.spec
                    .models
                    .iter()
                    .find(|m| m.name == name)
                    .map(|m| m.aliases.clone())
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            ServedModel {
                name,
                max_model_len,
                aliases,
            }
        })
        .collect()
}

/// The status a pool should have, from the [`Facts`] of its namespace.
pub fn pool_status(pool: &InferencePool, facts: &Facts, now: &Time) -> InferencePoolStatus {
    let prev = pool.status.clone().unwrap_or_default();
    let gen_ = generation(&pool.metadata);
    let name = name_of(&pool.metadata);

    let mut missing = Vec::new();
    let mut rejected = Vec::new();
    let mut models: BTreeMap<String, (BTreeSet<String>, BTreeSet<String>)> = BTreeMap::new();
    let mut ready = 0usize;
    for r in &pool.spec.worker_sets {
        match facts.sets.get(&r.name) {
            None => missing.push(r.name.clone()),
            Some(set) if !set.accepted() => {
                let why: Vec<&str> = set
                    .rejections
                    .iter()
                    .map(|x| x.rejection.as_str())
                    .collect();
                rejected.push(format!("{} ({})", r.name, why.join(",")));
            }
            Some(set) => {
                ready += set.endpoints.ready().len();
                for o in &set.offers {
                    let (aliases, sets) = models.entry(o.name.clone()).or_default();
                    aliases.extend(o.aliases.iter().cloned());
                    sets.insert(r.name.clone());
                }
            }
        }
    }
    let models: Vec<OfferedModel> = models
        .into_iter()
        .map(|(name, (aliases, sets))| OfferedModel {
            name,
            aliases: aliases.into_iter().collect(),
            worker_sets: sets.into_iter().collect(),
        })
        .collect();
    let model_names = models
        .iter()
        .map(|m| m.name.as_str())
        .collect::<Vec<_>>()
        .join(",");

    let mut conds: Vec<Condition> = prev
        .conditions
        .iter()
        .filter(|c| [conditions::ACCEPTED, conditions::RESOLVED_REFS].contains(&c.type_.as_str()))
        .cloned()
        .collect();
    let accepted = Desired {
        type_: conditions::ACCEPTED,
        status: true,
        reason: reason::ACCEPTED,
        message: "the pool is valid".to_owned(),
    };
    let resolved = if missing.is_empty() && rejected.is_empty() {
        Desired {
            type_: conditions::RESOLVED_REFS,
            status: true,
            reason: reason::RESOLVED_REFS,
            message: format!(
                "all {} worker sets exist and are accepted",
                pool.spec.worker_sets.len()
            ),
        }
    } else {
        let mut parts = Vec::new();
        if !missing.is_empty() {
            parts.push(format!(
                "no worker set named {} in namespace {}: create it or remove it from spec.workerSets",
                missing.join(", "),
                pool.metadata.namespace.as_deref().unwrap_or_default()
            ));
        }
        if !rejected.is_empty() {
            parts.push(format!(
                "rejected worker sets are not served: {} (see their Accepted condition)",
                rejected.join(", ")
            ));
        }
        Desired {
            type_: conditions::RESOLVED_REFS,
            status: false,
            reason: if missing.is_empty() {
                reason::WORKER_SET_REJECTED
            } else {
                reason::WORKER_SET_NOT_FOUND
            },
            message: parts.join("; "),
        }
    };
    for d in [&accepted, &resolved] {
        conditions::set(&mut conds, d, gen_, now);
    }
    conds.sort_by_key(|c| {
        [conditions::ACCEPTED, conditions::RESOLVED_REFS]
            .iter()
            .position(|t| *t == c.type_)
    });

    InferencePoolStatus {
        models,
        model_names,
        ready_endpoints: i32::try_from(ready).unwrap_or(i32::MAX),
        conditions: conds,
        conflicts: facts.conflicts.get(name).cloned().unwrap_or_default(),
        observed_generation: gen_,
    }
}

#[cfg(test)]
mod tests;
