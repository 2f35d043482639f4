use std::collections::BTreeSet;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use kinference_api::conditions::{self, find};
use kinference_api::{InferencePool, InferenceWorkerSet, InferenceWorkerSetSpec};

use super::*;
use crate::endpoints::tests::mk_slice;
use crate::probe::{EndpointModels, KvProbe, ModelCard, ProbeFailure};
use crate::tests::{at, mk_pool, mk_spec, mk_ws};

/// A namespace under test: objects in, facts and statuses out.
struct World {
    sets: Vec<InferenceWorkerSet>,
    pools: Vec<InferencePool>,
    slices: Vec<EndpointSlice>,
    profiles: BTreeSet<String>,
}

impl World {
    fn new() -> Self {
        World {
            sets: Vec::new(),
            pools: Vec::new(),
            slices: Vec::new(),
            profiles: BTreeSet::new(),
        }
    }

    fn set(mut self, ws: InferenceWorkerSet) -> Self {
        self.sets.push(ws);
        self
    }

    fn pool(mut self, p: InferencePool) -> Self {
        self.pools.push(p);
        self
    }

    fn slice(mut self, s: EndpointSlice) -> Self {
        self.slices.push(s);
        self
    }

    fn profile(mut self, name: &str) -> Self {
        self.profiles.insert(name.into());
        self
    }

    fn facts(&self) -> Facts {
        let sets: Vec<&InferenceWorkerSet> = self.sets.iter().collect();
        let pools: Vec<&InferencePool> = self.pools.iter().collect();
        let slices: Vec<&EndpointSlice> = self.slices.iter().collect();
        Facts::compute(&Namespace {
            worker_sets: &sets,
            pools: &pools,
            slices: &slices,
            profiles: &self.profiles,
        })
    }

    fn ws(&self, name: &str) -> &InferenceWorkerSet {
        self.sets
            .iter()
            .find(|w| w.metadata.name.as_deref() == Some(name))
            .expect("a worker set of the world")
    }

    fn status(&self, name: &str) -> InferenceWorkerSetStatus {
        let facts = self.facts();
        worker_set_status(self.ws(name), &facts.sets[name], None, &at(1000))
    }

    fn pool_status(&self, name: &str) -> InferencePoolStatus {
        let pool = self
            .pools
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(name))
            .expect("a pool of the world");
        pool_status(pool, &self.facts(), &at(1000))
    }
}

fn qwen_spec(service: &str) -> InferenceWorkerSetSpec {
    mk_spec(
        service,
        "http",
        Some("kv-pub"),
        &[("Qwen/Qwen3.6-35B-A3B", &["qwen3.6"])],
    )
}

fn ready_slice(name: &str, service: &str, addresses: &[&str]) -> EndpointSlice {
    let eps: Vec<(&str, Option<bool>)> = addresses.iter().map(|a| (*a, Some(true))).collect();
    mk_slice(name, service, &[("http", 8000), ("kv-pub", 5557)], &eps)
}

/// The seed's table, and then some: every state a worker set can be in,
/// from the objects that make it.
#[test]
fn table_of_states() {
    let seed = World::new()
        .set(mk_ws("qwen", 1, qwen_spec("qwen-vllm")))
        .set(mk_ws(
            "gemma",
            2,
            mk_spec("gemma-vllm", "8000", Some("5557"), &[]),
        ))
        .set(mk_ws(
            "orphan",
            3,
            mk_spec("orphan-vllm", "http", None, &[]),
        ))
        .set(mk_ws("no-such-profile", 4, {
            let mut s = mk_spec("nsp-vllm", "http", None, &[]);
            s.profile = "no-such-profile".into();
            s
        }))
        .set(mk_ws("own-profile", 5, {
            let mut s = mk_spec("qwen-vllm", "http", None, &[]);
            s.profile = "h100".into();
            s
        }))
        .set(mk_ws(
            "bad-http-port",
            6,
            mk_spec("qwen-vllm", "grpc", None, &[]),
        ))
        .set(mk_ws(
            "bad-kv-port",
            7,
            mk_spec("qwen-vllm", "http", Some("zmq"), &[]),
        ))
        .set(mk_ws(
            "bad-number",
            8,
            mk_spec("qwen-vllm", "9000", None, &[]),
        ))
        .set(mk_ws(
            "same-port",
            9,
            mk_spec("qwen-vllm", "http", Some("8000"), &[]),
        ))
        .set(mk_ws(
            "port-unjudged",
            10,
            mk_spec("no-slices", "grpc", Some("zmq"), &[]),
        ))
        .set(mk_ws("twice-wrong", 11, {
            let mut s = mk_spec("qwen-vllm", "grpc", None, &[]);
            s.profile = "nope".into();
            s
        }))
        .set(mk_ws(
            "ready-unreferenced",
            12,
            mk_spec("qwen-vllm", "http", None, &[]),
        ))
        .pool(mk_pool(
            "chat",
            &[
                "qwen",
                "gemma",
                "no-such-profile",
                "own-profile",
                "bad-http-port",
                "bad-kv-port",
                "bad-number",
                "same-port",
                "port-unjudged",
                "twice-wrong",
            ],
        ))
        .profile("h100")
        .slice(ready_slice(
            "qwen-a",
            "qwen-vllm",
            &["10.0.0.1", "10.0.0.2"],
        ))
        .slice(ready_slice(
            "qwen-b",
            "qwen-vllm",
            &["10.0.0.2", "10.0.0.3"],
        ))
        .slice(mk_slice(
            "gemma-a",
            "gemma-vllm",
            &[("", 8000), ("", 5557)],
            &[("10.0.1.1", Some(false)), ("10.0.1.2", Some(false))],
        ));

    let want: &[(&str, i32, &str)] = &[
        ("qwen", 3, "Accepted"),
        ("gemma", 0, "Accepted,NotReady"),
        ("orphan", 0, "Accepted,NotReady,Unreferenced"),
        ("no-such-profile", 0, "UnknownProfile"),
        ("own-profile", 3, "Accepted"),
        ("bad-http-port", 0, "InvalidPort"),
        ("bad-kv-port", 3, "InvalidPort"),
        ("bad-number", 0, "InvalidPort"),
        ("same-port", 3, "InvalidPort"),
        ("port-unjudged", 0, "Accepted,NotReady"),
        ("twice-wrong", 0, "UnknownProfile,InvalidPort"),
        ("ready-unreferenced", 3, "Accepted,Unreferenced"),
    ];
    for (name, ready, state) in want {
        let st = seed.status(name);
        assert_eq!(
            (st.ready_endpoints, st.state.as_str()),
            (*ready, *state),
            "{name}: {st:#?}"
        );
        assert_eq!(st.observed_generation, Some(1), "{name}");
        let accepted = find(&st.conditions, conditions::ACCEPTED).expect("Accepted");
        assert_eq!(
            accepted.status == "True",
            state.starts_with("Accepted"),
            "{name}"
        );
        assert_eq!(accepted.observed_generation, Some(1), "{name}");
        assert_eq!(
            conditions::is_true(&st.conditions, conditions::READY),
            *ready > 0,
            "{name}"
        );
        assert_eq!(
            conditions::is_true(&st.conditions, conditions::REFERENCED),
            !state.contains("Unreferenced") && *name != "ready-unreferenced",
            "{name}"
        );
        let types: Vec<&str> = st.conditions.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, ["Accepted", "Ready", "Referenced"], "{name}");
    }

    // Messages say what to change.
    let msg = |name: &str, t: &str| {
        find(&seed.status(name).conditions, t)
            .expect("condition")
            .message
            .clone()
    };
    assert!(
        msg("no-such-profile", conditions::ACCEPTED)
            .contains("\"no-such-profile\" is neither built in (default) nor a RoutingProfile")
    );
    assert_eq!(
        find(
            &seed.status("no-such-profile").conditions,
            conditions::ACCEPTED
        )
        .expect("Accepted")
        .reason,
        "UnknownProfile"
    );
    assert_eq!(
        msg("bad-http-port", conditions::ACCEPTED),
        "serviceRef.port \"grpc\" is not a port of Service \"qwen-vllm\": the Service has no port named \"grpc\" (its ports: http=8000, kv-pub=5557); use one of its port names or numbers (as its EndpointSlices list them)"
    );
    assert!(
        msg("bad-kv-port", conditions::ACCEPTED)
            .contains("kvEvents.port \"zmq\" is not a port of Service \"qwen-vllm\"")
    );
    assert!(msg("bad-number", conditions::ACCEPTED).contains("serviceRef.port 9000 is not a port of Service \"qwen-vllm\": the Service's endpoints have no port 9000"));
    assert!(msg("same-port", conditions::ACCEPTED).contains("both port 8000"));
    assert!(msg("orphan", conditions::READY).contains(
        "no EndpointSlice is labelled kubernetes.io/service-name=orphan-vllm in namespace ns"
    ));
    assert!(msg("orphan", conditions::REFERENCED).contains("add it to a pool's spec.workerSets"));
    assert!(msg("gemma", conditions::READY).contains("none of the 2 endpoints"));
    assert!(msg("qwen", conditions::READY).contains("3 ready endpoints"));
    assert!(msg("qwen", conditions::REFERENCED).contains("named by InferencePool chat"));
}

#[test]
fn conflicts_are_decided_oldest_first() {
    let w = World::new()
        .set(mk_ws(
            "old",
            1,
            mk_spec("a", "http", None, &[("Qwen/A", &["chat"])]),
        ))
        .set(mk_ws(
            "new",
            2,
            mk_spec("b", "http", None, &[("Qwen/B", &["chat"])]),
        ))
        .set(mk_ws(
            "newer",
            3,
            mk_spec("c", "http", None, &[("Qwen/C", &["chat", "c"])]),
        ))
        .set(mk_ws(
            "same-model",
            4,
            mk_spec("d", "http", None, &[("Qwen/A", &["chat"])]),
        ))
        .set(mk_ws(
            "alias-is-a-model",
            5,
            mk_spec("e", "http", None, &[("Other", &["Qwen/A"])]),
        ))
        .set(mk_ws(
            "other-pool",
            6,
            mk_spec("f", "http", None, &[("Qwen/F", &["chat"])]),
        ))
        .set(mk_ws(
            "unreferenced",
            7,
            mk_spec("g", "http", None, &[("Qwen/G", &["chat"])]),
        ))
        .pool(mk_pool(
            "p",
            &["new", "old", "newer", "same-model", "alias-is-a-model"],
        ))
        .pool(mk_pool("q", &["other-pool"]));
    let state = |n: &str| w.status(n).state;
    assert_eq!(state("old"), "Accepted,NotReady");
    assert_eq!(state("new"), "AliasConflict");
    assert_eq!(state("newer"), "AliasConflict");
    assert_eq!(
        state("same-model"),
        "Accepted,NotReady",
        "same meaning is no conflict"
    );
    assert_eq!(state("alias-is-a-model"), "AliasConflict");
    assert_eq!(
        state("other-pool"),
        "Accepted,NotReady",
        "pools are separate scopes"
    );
    assert_eq!(state("unreferenced"), "Accepted,NotReady,Unreferenced");

    let new = w.status("new");
    let accepted = find(&new.conditions, conditions::ACCEPTED).expect("Accepted");
    assert_eq!(accepted.reason, "AliasConflict");
    assert!(
        accepted.message.contains(
            "\"chat\" means Qwen/B here but Qwen/A in the older worker set old of pool p"
        ),
        "{}",
        accepted.message
    );
    // A rejected set's aliases are not in effect.
    assert!(new.models.iter().all(|m| m.aliases.is_empty()));

    let pool = w.pool_status("p");
    let conflicts: Vec<(&str, Vec<&str>)> = pool
        .conflicts
        .iter()
        .map(|c| {
            (
                c.name.as_str(),
                c.worker_sets.iter().map(String::as_str).collect(),
            )
        })
        .collect();
    assert_eq!(
        conflicts,
        [
            ("Qwen/A", vec!["old", "alias-is-a-model"]),
            ("chat", vec!["old", "new", "newer"]),
        ]
    );
    assert!(
        pool.conflicts[1]
            .message
            .contains("old is older and keeps it, new, newer are rejected"),
        "{}",
        pool.conflicts[1].message
    );
    assert_eq!(pool.model_names, "Qwen/A");
    assert_eq!(pool.models[0].worker_sets, ["old", "same-model"]);
    assert_eq!(pool.models[0].aliases, ["chat"]);
    assert!(w.pool_status("q").conflicts.is_empty());
}

#[test]
fn a_set_rejected_for_another_reason_claims_nothing() {
    let mut bad = mk_spec("a", "http", None, &[("Qwen/A", &["chat"])]);
    bad.profile = "missing".into();
    let w = World::new()
        .set(mk_ws("old-but-bad", 1, bad))
        .set(mk_ws(
            "new",
            2,
            mk_spec("b", "http", None, &[("Qwen/B", &["chat"])]),
        ))
        .pool(mk_pool("p", &["old-but-bad", "new"]));
    assert_eq!(w.status("old-but-bad").state, "UnknownProfile");
    assert_eq!(w.status("new").state, "Accepted,NotReady");
    assert!(w.pool_status("p").conflicts.is_empty());
}

#[test]
fn discovered_models_claim_their_names() {
    // "serves-chat" declares nothing but its engines serve a model named
    // "chat"; a newer set's alias "chat" for another model conflicts.
    let mut discovered = mk_ws("serves-chat", 1, mk_spec("a", "http", None, &[]));
    discovered.status = Some(InferenceWorkerSetStatus {
        models: vec![ServedModel {
            name: "chat".into(),
            max_model_len: Some(8192),
            aliases: vec![],
        }],
        ..Default::default()
    });
    let w = World::new()
        .set(discovered)
        .set(mk_ws(
            "aliased",
            2,
            mk_spec("b", "http", None, &[("Qwen/B", &["chat"])]),
        ))
        .pool(mk_pool("p", &["serves-chat", "aliased"]));
    assert_eq!(w.status("aliased").state, "AliasConflict");
    let pool = w.pool_status("p");
    assert_eq!(pool.model_names, "chat");
    assert_eq!(pool.conflicts[0].name, "chat");
}

#[test]
fn pool_status_follows_its_worker_sets() {
    let mut nsp = mk_spec("x", "http", None, &[]);
    nsp.profile = "no-such-profile".into();
    let w = World::new()
        .set(mk_ws("qwen", 1, qwen_spec("qwen-vllm")))
        .set(mk_ws(
            "gemma",
            2,
            mk_spec(
                "gemma-vllm",
                "http",
                None,
                &[("google/gemma-4-12b-it", &["gemma-4", "gemma"])],
            ),
        ))
        .set(mk_ws("no-such-profile", 3, nsp))
        .slice(ready_slice(
            "qwen-a",
            "qwen-vllm",
            &["10.0.0.1", "10.0.0.2", "10.0.0.3"],
        ))
        .slice(ready_slice("gemma-a", "gemma-vllm", &["10.0.1.1"]))
        .pool(mk_pool("chat", &["qwen", "gemma"]))
        .pool(mk_pool("broken", &["qwen", "missing", "no-such-profile"]));

    let chat = w.pool_status("chat");
    assert_eq!(
        chat.model_names,
        "Qwen/Qwen3.6-35B-A3B,google/gemma-4-12b-it"
    );
    assert_eq!(chat.ready_endpoints, 4);
    assert_eq!(chat.models[1].aliases, ["gemma", "gemma-4"]);
    assert_eq!(chat.models[1].worker_sets, ["gemma"]);
    assert_eq!(chat.observed_generation, Some(1));
    assert!(conditions::is_true(&chat.conditions, conditions::ACCEPTED));
    assert!(conditions::is_true(
        &chat.conditions,
        conditions::RESOLVED_REFS
    ));

    let broken = w.pool_status("broken");
    assert_eq!(broken.ready_endpoints, 3);
    assert_eq!(broken.model_names, "Qwen/Qwen3.6-35B-A3B");
    let rr = find(&broken.conditions, conditions::RESOLVED_REFS).expect("ResolvedRefs");
    assert_eq!(rr.status, "False");
    assert_eq!(rr.reason, "WorkerSetNotFound");
    assert!(
        rr.message
            .contains("no worker set named missing in namespace ns"),
        "{}",
        rr.message
    );
    assert!(
        rr.message.contains("no-such-profile (UnknownProfile)"),
        "{}",
        rr.message
    );

    let only_rejected = World::new()
        .set(mk_ws("no-such-profile", 3, {
            let mut s = mk_spec("x", "http", None, &[]);
            s.profile = "nope".into();
            s
        }))
        .pool(mk_pool("p", &["no-such-profile"]));
    let p = only_rejected.pool_status("p");
    assert_eq!(
        find(&p.conditions, conditions::RESOLVED_REFS)
            .expect("ResolvedRefs")
            .reason,
        "WorkerSetRejected"
    );
    assert_eq!(p.model_names, "");
    assert_eq!(p.ready_endpoints, 0);
}

fn probe_answering(ids: &[(&str, Option<i64>)]) -> ProbeResult {
    ProbeResult {
        models: ["10.0.0.1:8000", "10.0.0.2:8000"]
            .iter()
            .map(|e| EndpointModels {
                endpoint: (*e).into(),
                outcome: Ok(ids
                    .iter()
                    .map(|(id, len)| ModelCard {
                        id: (*id).into(),
                        max_model_len: len.map(|l| u64::try_from(l).unwrap()),
                        parent: None,
                        root: None,
                        owned_by: None,
                    })
                    .collect()),
            })
            .collect(),
        kv: KvProbe::NotProbed,
    }
}

#[test]
fn models_come_from_probes_with_the_spec_aliases() {
    let w = World::new()
        .set(mk_ws("qwen", 1, qwen_spec("qwen-vllm")))
        .slice(ready_slice("a", "qwen-vllm", &["10.0.0.1", "10.0.0.2"]))
        .pool(mk_pool("p", &["qwen"]));
    let facts = w.facts();
    let ws = w.ws("qwen");

    // Before any probe: the declared models, no context length.
    let st = worker_set_status(ws, &facts.sets["qwen"], None, &at(10));
    assert_eq!(st.models.len(), 1);
    assert_eq!(st.models[0].max_model_len, None);
    assert_eq!(st.models[0].aliases, ["qwen3.6"]);

    // Probed: what the engines say.
    let probe = probe_answering(&[("Qwen/Qwen3.6-35B-A3B", Some(262_144))]);
    let st = worker_set_status(ws, &facts.sets["qwen"], Some(&probe), &at(20));
    assert_eq!(
        st.models,
        [ServedModel {
            name: "Qwen/Qwen3.6-35B-A3B".into(),
            max_model_len: Some(262_144),
            aliases: vec!["qwen3.6".into()],
        }]
    );
    assert!(st.diagnoses.is_empty(), "{:?}", st.diagnoses);

    // Then nobody answers: the last known list stays, with a diagnosis.
    let mut ws2 = ws.clone();
    ws2.status = Some(st);
    let down = ProbeResult {
        models: vec![EndpointModels {
            endpoint: "10.0.0.1:8000".into(),
            outcome: Err(ProbeFailure::Timeout),
        }],
        kv: KvProbe::NotProbed,
    };
    let st = worker_set_status(&ws2, &facts.sets["qwen"], Some(&down), &at(30));
    assert_eq!(st.models[0].max_model_len, Some(262_144));
    assert_eq!(st.diagnoses.len(), 1);
    assert_eq!(st.diagnoses[0].reason, "ModelsUnreachable");
    assert_eq!(st.diagnoses[0].since, at(30));
}

/// Recomputing from an unchanged world gives the status already written,
/// times included: the controller then writes nothing.
#[test]
fn recomputing_is_a_fixed_point() {
    let w = World::new()
        .set(mk_ws("qwen", 1, qwen_spec("qwen-vllm")))
        .slice(ready_slice("a", "qwen-vllm", &["10.0.0.1", "10.0.0.2"]))
        .pool(mk_pool("p", &["qwen"]));
    let facts = w.facts();
    let probe = probe_answering(&[("Qwen/Qwen3.6-35B-A3B", Some(4096)), ("other", None)]);
    let first = worker_set_status(w.ws("qwen"), &facts.sets["qwen"], Some(&probe), &at(100));
    assert_eq!(first.diagnoses.len(), 0);
    let mut ws = w.ws("qwen").clone();
    ws.status = Some(first.clone());
    let again = worker_set_status(&ws, &facts.sets["qwen"], Some(&probe), &at(200));
    assert_eq!(again, first);

    // A diagnosis keeps its since-time while it persists, even as its
    // message changes; a condition keeps its transition time unless it flips.
    let mismatch = ProbeResult {
        models: vec![
            EndpointModels {
                endpoint: "10.0.0.1:8000".into(),
                outcome: Ok(vec![ModelCard {
                    id: "Qwen/Qwen3.6-35B-A3B".into(),
                    max_model_len: Some(4096),
                    parent: None,
                    root: None,
                    owned_by: None,
                }]),
            },
            EndpointModels {
                endpoint: "10.0.0.2:8000".into(),
                outcome: Ok(vec![ModelCard {
                    id: "x".into(),
                    max_model_len: None,
                    parent: None,
                    root: None,
                    owned_by: None,
                }]),
            },
        ],
        kv: KvProbe::NotProbed,
    };
    let d1 = worker_set_status(&ws, &facts.sets["qwen"], Some(&mismatch), &at(300));
    assert_eq!(d1.diagnoses[0].reason, "ModelMismatch");
    assert_eq!(d1.diagnoses[0].since, at(300));
    ws.status = Some(d1.clone());
    let d2 = worker_set_status(&ws, &facts.sets["qwen"], Some(&mismatch), &at(400));
    assert_eq!(d2, d1);
    for c in &d2.conditions {
        assert_eq!(c.last_transition_time, at(100), "{}", c.type_);
    }

    // The pool likewise.
    let pool = w.pool_status("p");
    let mut p = w.pools[0].clone();
    p.status = Some(pool.clone());
    assert_eq!(pool_status(&p, &facts, &at(5000)), pool);
}

#[test]
fn transitions_move_only_flipped_conditions() {
    let mut w = World::new()
        .set(mk_ws("qwen", 1, qwen_spec("qwen-vllm")))
        .slice(ready_slice("a", "qwen-vllm", &["10.0.0.1"]))
        .pool(mk_pool("p", &["qwen"]));
    let first = w.status("qwen");
    w.sets[0].status = Some(first);
    // The only endpoint goes unready.
    w.slices[0].endpoints[0]
        .conditions
        .as_mut()
        .expect("conditions")
        .ready = Some(false);
    let facts = w.facts();
    let st = worker_set_status(w.ws("qwen"), &facts.sets["qwen"], None, &at(2000));
    assert_eq!(st.state, "Accepted,NotReady");
    let time = |t: &str| {
        find(&st.conditions, t)
            .expect("condition")
            .last_transition_time
            .clone()
    };
    assert_eq!(time(conditions::READY), at(2000));
    assert_eq!(time(conditions::ACCEPTED), at(1000));
    assert_eq!(time(conditions::REFERENCED), at(1000));
}

#[test]
fn conditions_of_other_types_are_left_alone() {
    let mut ws = mk_ws("qwen", 1, qwen_spec("qwen-vllm"));
    ws.status = Some(InferenceWorkerSetStatus {
        conditions: vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
            type_: "SomeoneElses".into(),
            status: "True".into(),
            reason: "X".into(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: at(1),
        }],
        ..Default::default()
    });
    let w = World::new().set(ws);
    let st = w.status("qwen");
    assert!(st.conditions.iter().all(|c| c.type_ != "SomeoneElses"));
}
