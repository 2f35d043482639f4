//! The controller against a real Kubernetes API server (whatever
//! `KUBECONFIG` names; CI starts the upstream CRD server from `shared/k8s`,
//! whose stand-in CRDs serve EndpointSlices and Events).
//!
//! Each test runs the controller in-process, scoped to a namespace of its
//! own, with the real prober (`/v1/models`, KV-event windows) against
//! `kinference-sim` engines on loopback, whose addresses and ports the
//! tests' EndpointSlices list, and the real Event recorder. Nothing here
//! asserts on timing: every check polls for an eventual state with a
//! generous deadline.

mod support;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::events::v1::Event;
use kinference_api::conditions;
use kinference_api::manifests::{self, Object};
use kinference_api::v1alpha1::RoutingProfileSpec;
use kinference_api::{InferencePool, InferenceWorkerSet, RoutingProfile};
use kinference_controller::events::KubeEvents;
use kinference_controller::leader::Leadership;
use kinference_controller::metrics::{Kind, Metrics};
use kinference_controller::probe::HttpProber;
use kinference_controller::{Context, Runtime, Seams, Settings};
use kinference_examples::cluster;
use kinference_examples::testing::eventually;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use prometheus_client::registry::Registry;
use support::{closed_port, config, restart, start, three_engines, traffic};
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(90);
const KV_WINDOW: Duration = Duration::from_secs(1);

/// The controller, running in this process for one namespace.
struct Running {
    ctx: Arc<Context>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    _leadership: Leadership,
}

impl Running {
    fn start(client: &Client, ns: &str) -> Running {
        let leadership = Leadership::always();
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let runtime = Runtime::new(
            client.clone(),
            Settings {
                namespace: Some(ns.to_owned()),
                probe_interval: Duration::from_secs(1),
                kv_probe_interval: Duration::from_secs(1),
                ..Settings::default()
            },
            Seams {
                prober: Arc::new(HttpProber::new(Duration::from_secs(2)).with_kv_window(KV_WINDOW)),
                events: Arc::new(KubeEvents::new(client.clone(), Some(format!("test-{ns}")))),
                leader: leadership.subscribe(),
            },
            metrics,
        );
        let ctx = runtime.context();
        let stop = CancellationToken::new();
        let task = tokio::spawn(runtime.run(stop.clone()));
        Running {
            ctx,
            stop,
            task,
            _leadership: leadership,
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("the controllers stop after shutdown")
            .expect("the controllers do not panic");
    }
}

/// `kubectl get iws -n ns` as (name, ready, state) rows, sorted.
fn iws_table(ns: &str) -> Result<Vec<(String, String, String)>, String> {
    let out = cluster::kubectl_run(&["get", "iws", "-n", ns]);
    let mut lines = out.lines();
    let header: Vec<&str> = lines
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    if header != ["NAME", "READY", "STATE", "AGE"] {
        return Err(format!("unexpected header in\n{out}"));
    }
    let mut rows: Vec<(String, String, String)> = lines
        .map(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            (
                c.first().copied().unwrap_or_default().to_owned(),
                c.get(1).copied().unwrap_or_default().to_owned(),
                c.get(2).copied().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    rows.sort();
    Ok(rows)
}

/// Whether `kubectl get iws` shows `want` (a ready future, for [`eventually`]).
fn table_is(ns: &str, want: &[(&str, &str, &str)]) -> std::future::Ready<Result<(), String>> {
    let check = || {
        let got = iws_table(ns)?;
        let mut want: Vec<(String, String, String)> = want
            .iter()
            .map(|(a, b, c)| ((*a).to_owned(), (*b).to_owned(), (*c).to_owned()))
            .collect();
        want.sort();
        if got == want {
            Ok(())
        } else {
            Err(format!(
                "kubectl get iws -n {ns}: got {got:?}, want {want:?}"
            ))
        }
    };
    std::future::ready(check())
}

fn slice(
    ns: &str,
    name: &str,
    service: &str,
    ports: &[(&str, i32)],
    endpoints: &[(&str, bool)],
) -> EndpointSlice {
    let eps: Vec<(&str, Option<bool>)> = endpoints.iter().map(|(a, r)| (*a, Some(*r))).collect();
    kinference_api::test_util::mk_slice_in(ns, name, service, ports, &eps)
}

async fn apply<K>(api: &Api<K>, obj: &K)
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let name = obj.meta().name.clone().expect("a name");
    api.patch(
        &name,
        &PatchParams::apply("kinference-controller-tests").force(),
        &Patch::Apply(obj),
    )
    .await
    .unwrap_or_else(|e| panic!("applying {name}: {e}"));
}

fn seed_objects(ns: &str) -> (Vec<InferenceWorkerSet>, Vec<InferencePool>) {
    let mut sets = Vec::new();
    let mut pools = Vec::new();
    for (file, text) in kinference_examples::yaml_files(&kinference_examples::manifests_dir()) {
        for object in manifests::parse(&text).unwrap_or_else(|e| panic!("{file}: {e}")) {
            match object {
                Object::WorkerSet(mut o) => {
                    o.metadata.namespace = Some(ns.into());
                    sets.push(*o);
                }
                Object::Pool(mut o) => {
                    o.metadata.namespace = Some(ns.into());
                    pools.push(*o);
                }
                _ => {}
            }
        }
    }
    (sets, pools)
}

/// The seed's four worker sets: the table of the design, then status
/// following the objects; no write loops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_table_and_status_following_the_objects() {
    let client = cluster::client().await;
    cluster::install_crds(&client).await;
    let ns = cluster::namespace(&client, "kinference-controller").await;
    let iws: Api<InferenceWorkerSet> = Api::namespaced(client.clone(), &ns);
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), &ns);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);

    let (port, kv_port, mut engines) = three_engines("Qwen/Qwen3.6-35B-A3B", 262_144).await;

    // The seed's qwen and gemma sets and pool, plus an orphan and a set
    // naming a profile that does not exist (which the pool also names).
    let (seed_sets, mut seed_pools) = seed_objects(&ns);
    assert_eq!(seed_sets.len(), 2, "the seed has two worker sets");
    let mut orphan = seed_sets[0].clone();
    orphan.metadata.name = Some("orphan".into());
    orphan.spec.service_ref.name = "orphan-vllm".into();
    orphan.spec.models.clear();
    let mut nsp = orphan.clone();
    nsp.metadata.name = Some("no-such-profile".into());
    nsp.spec.service_ref.name = "nsp-vllm".into();
    nsp.spec.profile = "no-such-profile".into();
    let mut pool = seed_pools.remove(0);
    pool.spec
        .worker_sets
        .push(kinference_api::v1alpha1::WorkerSetRef {
            name: "no-such-profile".into(),
        });

    let running = Running::start(&client, &ns);

    for ws in seed_sets.iter().chain([&orphan, &nsp]) {
        iws.create(&PostParams::default(), ws)
            .await
            .unwrap_or_else(|e| panic!("creating {}: {e}", ws.name_any()));
    }
    pools
        .create(&PostParams::default(), &pool)
        .await
        .expect("creating the pool");
    // qwen-vllm: two slices listing 127.0.0.2 twice; gemma-vllm: two
    // endpoints, neither ready.
    let qwen_ports = [("http", i32::from(port)), ("kv-pub", i32::from(kv_port))];
    apply(
        &slices,
        &slice(
            &ns,
            "qwen-vllm-a",
            "qwen-vllm",
            &qwen_ports,
            &[("127.0.0.1", true), ("127.0.0.2", true)],
        ),
    )
    .await;
    apply(
        &slices,
        &slice(
            &ns,
            "qwen-vllm-b",
            "qwen-vllm",
            &qwen_ports,
            &[("127.0.0.2", true), ("127.0.0.3", true)],
        ),
    )
    .await;
    apply(
        &slices,
        &slice(
            &ns,
            "gemma-vllm-a",
            "gemma-vllm",
            &[("", 8000), ("", 5557)],
            &[("10.0.1.1", false), ("10.0.1.2", false)],
        ),
    )
    .await;

    let seed_table = [
        ("qwen-3-6-35b-a3b", "3", "Accepted"),
        ("gemma-4-12b", "0", "Accepted,NotReady"),
        ("orphan", "0", "Accepted,NotReady,Unreferenced"),
        ("no-such-profile", "0", "UnknownProfile"),
    ];
    eventually(DEADLINE, "the seed's table", || table_is(&ns, &seed_table)).await;
    println!("{}", cluster::kubectl_run(&["get", "iws", "-n", &ns]));

    // Discovered models, conditions and observed generations.
    eventually(DEADLINE, "qwen's models discovered", || async {
        let q = iws
            .get("qwen-3-6-35b-a3b")
            .await
            .map_err(|e| e.to_string())?;
        let st = q.status.ok_or("no status")?;
        match st.models.first() {
            Some(m) if m.max_model_len == Some(262_144) && m.aliases == ["qwen3.6"] => Ok(()),
            other => Err(format!("models {other:?}")),
        }
    })
    .await;
    let q = iws.get("qwen-3-6-35b-a3b").await.expect("qwen");
    let st = q.status.clone().expect("status");
    assert_eq!(st.observed_generation, q.metadata.generation);
    assert!(st.diagnoses.is_empty(), "{:?}", st.diagnoses);
    for t in [
        conditions::ACCEPTED,
        conditions::READY,
        conditions::REFERENCED,
    ] {
        let c = conditions::find(&st.conditions, t).unwrap_or_else(|| panic!("condition {t}"));
        assert_eq!(c.status, "True", "{t}: {c:?}");
        assert_eq!(c.observed_generation, q.metadata.generation, "{t}");
    }
    let field_managers: Vec<String> = q
        .managed_fields()
        .iter()
        .filter(|m| m.subresource.as_deref() == Some("status"))
        .filter_map(|m| m.manager.clone())
        .collect();
    assert_eq!(
        field_managers,
        ["kinference-controller"],
        "one field manager writes status"
    );
    let nsp_status = iws
        .get("no-such-profile")
        .await
        .expect("nsp")
        .status
        .expect("status");
    let accepted =
        conditions::find(&nsp_status.conditions, conditions::ACCEPTED).expect("Accepted");
    assert_eq!(
        (accepted.status.as_str(), accepted.reason.as_str()),
        ("False", "UnknownProfile")
    );

    eventually(DEADLINE, "the pool's status", || async {
        let p = pools.get("chat").await.map_err(|e| e.to_string())?;
        let st = p.status.ok_or("no status")?;
        let rr =
            conditions::find(&st.conditions, conditions::RESOLVED_REFS).ok_or("no ResolvedRefs")?;
        if st.model_names == "Qwen/Qwen3.6-35B-A3B,google/gemma-4-12b-it"
            && st.ready_endpoints == 3
            && rr.reason == "WorkerSetRejected"
            && conditions::is_true(&st.conditions, conditions::ACCEPTED)
        {
            Ok(())
        } else {
            Err(format!("{st:?}"))
        }
    })
    .await;
    println!("{}", cluster::kubectl_run(&["get", "ipool", "-n", &ns]));
    assert!(
        cluster::kubectl_run(&["get", "ipool", "-n", &ns])
            .contains("Qwen/Qwen3.6-35B-A3B,google/gemma-4-12b-it")
    );

    // Everything has seen every object (the table alone cannot tell: a
    // condition's message may still change under an unchanged STATE).
    eventually(DEADLINE, "every status is complete", || async {
        let get = |n: &'static str| {
            let iws = iws.clone();
            async move {
                iws.get(n)
                    .await
                    .map_err(|e| e.to_string())?
                    .status
                    .ok_or_else(|| format!("{n}: no status"))
            }
        };
        let gemma = get("gemma-4-12b").await?;
        let nsp = get("no-such-profile").await?;
        let ready_msg = conditions::find(&gemma.conditions, conditions::READY)
            .map(|c| c.message.clone())
            .unwrap_or_default();
        if ready_msg.contains("none of the 2 endpoints")
            && conditions::is_true(&gemma.conditions, conditions::REFERENCED)
            && conditions::is_true(&nsp.conditions, conditions::REFERENCED)
        {
            Ok(())
        } else {
            Err(format!(
                "gemma {:?}, no-such-profile {:?}",
                gemma.conditions, nsp.conditions
            ))
        }
    })
    .await;

    // No write loops: with nothing changing, reconciles go on (qwen is
    // re-probed every second and its KV windows end; the others are poked
    // by an annotation) and nothing is written.
    let names = [
        "qwen-3-6-35b-a3b",
        "gemma-4-12b",
        "orphan",
        "no-such-profile",
    ];
    let before: Vec<_> = names
        .iter()
        .map(|n| running.ctx.stats(Kind::WorkerSet, &ns, n))
        .collect();
    let pool_before = running.ctx.stats(Kind::Pool, &ns, "chat");
    let version_before = iws
        .get("qwen-3-6-35b-a3b")
        .await
        .expect("qwen")
        .resource_version();
    for n in &names[1..] {
        iws.patch(
            n,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"annotations": {"poke": "1"}}})),
        )
        .await
        .expect("annotating");
    }
    eventually(DEADLINE, "more reconciles", || async {
        let now: Vec<_> = names
            .iter()
            .map(|n| running.ctx.stats(Kind::WorkerSet, &ns, n))
            .collect();
        // qwen is re-probed (models every second, KV windows too).
        let more = now[0].reconciles >= before[0].reconciles + 3
            && now[0].probes > before[0].probes
            && now[0].kv_windows > before[0].kv_windows
            && now
                .iter()
                .zip(&before)
                .all(|(a, b)| a.reconciles > b.reconciles);
        if more {
            Ok(())
        } else {
            Err(format!("{before:?} -> {now:?}"))
        }
    })
    .await;
    let after: Vec<_> = names
        .iter()
        .map(|n| running.ctx.stats(Kind::WorkerSet, &ns, n))
        .collect();
    for ((n, a), b) in names.iter().zip(&after).zip(&before) {
        assert_eq!(
            a.writes, b.writes,
            "{n}: a reconcile of an unchanged world wrote status ({b:?} -> {a:?})"
        );
        assert!(a.writes <= a.reconciles, "{n}: {a:?}");
    }
    assert_eq!(
        running.ctx.stats(Kind::Pool, &ns, "chat").writes,
        pool_before.writes
    );
    assert_eq!(
        iws.get("qwen-3-6-35b-a3b")
            .await
            .expect("qwen")
            .resource_version(),
        version_before,
        "the server saw no write either"
    );
    println!("writes per worker set after convergence: {after:?}");

    // An endpoint goes unready.
    let b = slice(
        &ns,
        "qwen-vllm-b",
        "qwen-vllm",
        &qwen_ports,
        &[("127.0.0.2", true), ("127.0.0.3", false)],
    );
    apply(&slices, &b).await;
    eventually(DEADLINE, "qwen has 2 ready endpoints", || {
        table_is(
            &ns,
            &[
                ("qwen-3-6-35b-a3b", "2", "Accepted"),
                ("gemma-4-12b", "0", "Accepted,NotReady"),
                ("orphan", "0", "Accepted,NotReady,Unreferenced"),
                ("no-such-profile", "0", "UnknownProfile"),
            ],
        )
    })
    .await;
    eventually(DEADLINE, "the pool counts 2", || async {
        let p = pools.get("chat").await.map_err(|e| e.to_string())?;
        match p.status.map(|s| s.ready_endpoints) {
            Some(2) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    // One engine is redeployed serving another model: a diagnosis and an
    // Event.
    let e = engines.remove(1);
    engines.insert(1, restart(e, "google/gemma-4-12b-it").await);
    eventually(DEADLINE, "a ModelMismatch diagnosis", || async {
        let q = iws
            .get("qwen-3-6-35b-a3b")
            .await
            .map_err(|e| e.to_string())?;
        let d = q.status.map(|s| s.diagnoses).unwrap_or_default();
        match d.as_slice() {
            [d] if d.reason == "ModelMismatch"
                && d.message.contains("google/gemma-4-12b-it on 127.0.0.2:") =>
            {
                Ok(())
            }
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    eventually(DEADLINE, "a ModelMismatch Event", || async {
        let list = events
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let found = list.items.iter().any(|e| {
            e.reason.as_deref() == Some("ModelMismatch")
                && e.type_.as_deref() == Some("Warning")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("qwen-3-6-35b-a3b")
                && e.reporting_controller.as_deref() == Some("kinference-controller")
        });
        if found {
            Ok(())
        } else {
            Err(format!("{} events, none fits", list.items.len()))
        }
    })
    .await;
    let e = engines.remove(1);
    engines.insert(1, restart(e, "Qwen/Qwen3.6-35B-A3B").await);
    eventually(DEADLINE, "the diagnosis clears", || async {
        let q = iws
            .get("qwen-3-6-35b-a3b")
            .await
            .map_err(|e| e.to_string())?;
        let d = q.status.map(|s| s.diagnoses).unwrap_or_default();
        if d.is_empty() {
            Ok(())
        } else {
            Err(format!("{d:?}"))
        }
    })
    .await;

    // The profile is fixed.
    iws.patch(
        "no-such-profile",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"profile": "default"}})),
    )
    .await
    .expect("fixing the profile");
    eventually(DEADLINE, "no-such-profile is accepted", || {
        table_is(
            &ns,
            &[
                ("qwen-3-6-35b-a3b", "2", "Accepted"),
                ("gemma-4-12b", "0", "Accepted,NotReady"),
                ("orphan", "0", "Accepted,NotReady,Unreferenced"),
                ("no-such-profile", "0", "Accepted,NotReady"),
            ],
        )
    })
    .await;
    eventually(DEADLINE, "the pool resolves", || async {
        let p = pools.get("chat").await.map_err(|e| e.to_string())?;
        let st = p.status.ok_or("no status")?;
        if conditions::is_true(&st.conditions, conditions::RESOLVED_REFS) {
            Ok(())
        } else {
            Err(format!("{:?}", st.conditions))
        }
    })
    .await;
    let fixed = iws
        .get("no-such-profile")
        .await
        .expect("fixed")
        .status
        .expect("status");
    assert_eq!(
        fixed.observed_generation,
        Some(2),
        "the fix bumped the generation"
    );

    // The pool is deleted.
    pools
        .delete("chat", &DeleteParams::default())
        .await
        .expect("deleting the pool");
    eventually(DEADLINE, "everything is unreferenced", || {
        table_is(
            &ns,
            &[
                ("qwen-3-6-35b-a3b", "2", "Accepted,Unreferenced"),
                ("gemma-4-12b", "0", "Accepted,NotReady,Unreferenced"),
                ("orphan", "0", "Accepted,NotReady,Unreferenced"),
                ("no-such-profile", "0", "Accepted,NotReady,Unreferenced"),
            ],
        )
    })
    .await;

    // A slice is deleted: its endpoints go.
    slices
        .delete("qwen-vllm-b", &DeleteParams::default())
        .await
        .expect("deleting a slice");
    eventually(
        DEADLINE,
        "qwen keeps the endpoints of its other slice",
        || async {
            let rows = iws_table(&ns)?;
            match rows.iter().find(|r| r.0 == "qwen-3-6-35b-a3b") {
                Some((_, ready, _)) if ready == "2" => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;

    let total: Vec<_> = names
        .iter()
        .map(|n| (n, running.ctx.stats(Kind::WorkerSet, &ns, n)))
        .collect();
    println!("per worker set at the end: {total:?}");
    running.stop().await;
    for e in engines {
        e.shutdown().await;
    }
    cleanup(&client, &ns).await;
}

/// Rejections follow the objects: ports, profiles, name conflicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_follow_the_objects() {
    let client = cluster::client().await;
    cluster::install_crds(&client).await;
    let ns = cluster::namespace(&client, "kinference-controller-rejections").await;
    let iws: Api<InferenceWorkerSet> = Api::namespaced(client.clone(), &ns);
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), &ns);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    let profiles: Api<RoutingProfile> = Api::all(client.clone());
    let profile = format!("tp-{ns}");

    let running = Running::start(&client, &ns);

    let (base, _) = seed_objects(&ns);
    let mk = |name: &str, service: &str, port: &str, model: &str, aliases: &[&str]| {
        let mut ws = base[0].clone();
        ws.metadata.name = Some(name.into());
        ws.spec.service_ref.name = service.into();
        ws.spec.service_ref.port =
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(port.into());
        ws.spec.kv_events = None;
        ws.spec.models = vec![kinference_api::v1alpha1::ModelSpec {
            name: model.into(),
            aliases: aliases.iter().map(|a| (*a).to_owned()).collect(),
        }];
        ws
    };
    // "first" is created before "second": it keeps the alias "chat".
    iws.create(
        &PostParams::default(),
        &mk("first", "svc-a", "http", "Qwen/A", &["chat"]),
    )
    .await
    .expect("first");
    eventually(DEADLINE, "first is seen", || async {
        iws.get("first")
            .await
            .map_err(|e| e.to_string())?
            .status
            .map(|_| ())
            .ok_or_else(|| "no status".to_owned())
    })
    .await;
    iws.create(
        &PostParams::default(),
        &mk("second", "svc-b", "http", "Qwen/B", &["chat"]),
    )
    .await
    .expect("second");
    iws.create(
        &PostParams::default(),
        &mk("port", "svc-c", "grpc", "Qwen/C", &[]),
    )
    .await
    .expect("port");
    let mut own = mk("own-profile", "svc-d", "http", "Qwen/D", &[]);
    own.spec.profile = profile.clone();
    iws.create(&PostParams::default(), &own)
        .await
        .expect("own-profile");
    apply(
        &slices,
        &slice(
            &ns,
            "svc-c-1",
            "svc-c",
            &[("http", 8000)],
            &[("10.0.0.9", true)],
        ),
    )
    .await;
    let mut pool = InferencePool::new(
        "p",
        kinference_api::InferencePoolSpec {
            worker_sets: ["first", "second", "port", "own-profile"]
                .iter()
                .map(|n| kinference_api::v1alpha1::WorkerSetRef { name: (*n).into() })
                .collect(),
        },
    );
    pool.metadata.namespace = Some(ns.clone());
    pools
        .create(&PostParams::default(), &pool)
        .await
        .expect("pool");

    eventually(DEADLINE, "the rejections", || {
        table_is(
            &ns,
            &[
                ("first", "0", "Accepted,NotReady"),
                ("second", "0", "AliasConflict"),
                ("port", "0", "InvalidPort"),
                ("own-profile", "0", "UnknownProfile"),
            ],
        )
    })
    .await;
    let p = pools
        .get("p")
        .await
        .expect("pool")
        .status
        .expect("pool status");
    assert_eq!(p.conflicts.len(), 1, "{:?}", p.conflicts);
    assert_eq!(p.conflicts[0].name, "chat");
    assert_eq!(p.conflicts[0].worker_sets, ["first", "second"]);
    let port = iws.get("port").await.expect("port").status.expect("status");
    let accepted = conditions::find(&port.conditions, conditions::ACCEPTED).expect("Accepted");
    assert!(accepted.message.contains("serviceRef.port \"grpc\" is not a port of Service \"svc-c\": the Service has no port named \"grpc\" (its ports: http=8000)"), "{}", accepted.message);

    // Fixes: the Service gets the port, the profile is created, "first"
    // leaves the pool.
    apply(
        &slices,
        &slice(
            &ns,
            "svc-c-1",
            "svc-c",
            &[("http", 8000), ("grpc", 9000)],
            &[("10.0.0.9", true)],
        ),
    )
    .await;
    profiles
        .create(
            &PostParams::default(),
            &RoutingProfile::new(&profile, RoutingProfileSpec::default()),
        )
        .await
        .expect("creating the profile");
    pools
        .patch("p", &PatchParams::default(), &Patch::Merge(serde_json::json!({"spec": {"workerSets": [{"name": "second"}, {"name": "port"}, {"name": "own-profile"}]}})))
        .await
        .expect("changing the pool");
    eventually(DEADLINE, "everything accepted", || {
        table_is(
            &ns,
            &[
                ("first", "0", "Accepted,NotReady,Unreferenced"),
                ("second", "0", "Accepted,NotReady"),
                ("port", "1", "Accepted"),
                ("own-profile", "0", "Accepted,NotReady"),
            ],
        )
    })
    .await;
    eventually(DEADLINE, "no conflicts left", || async {
        let p = pools
            .get("p")
            .await
            .map_err(|e| e.to_string())?
            .status
            .ok_or("no status")?;
        if p.conflicts.is_empty() && conditions::is_true(&p.conditions, conditions::RESOLVED_REFS) {
            Ok(())
        } else {
            Err(format!("{p:?}"))
        }
    })
    .await;

    // A worker set the pool names is deleted.
    iws.delete("port", &DeleteParams::default())
        .await
        .expect("deleting port");
    eventually(DEADLINE, "the pool misses it", || async {
        let p = pools
            .get("p")
            .await
            .map_err(|e| e.to_string())?
            .status
            .ok_or("no status")?;
        let rr =
            conditions::find(&p.conditions, conditions::RESOLVED_REFS).ok_or("no ResolvedRefs")?;
        if rr.reason == "WorkerSetNotFound" && rr.message.contains("no worker set named port") {
            Ok(())
        } else {
            Err(format!("{rr:?}"))
        }
    })
    .await;

    // The profile goes away again.
    profiles
        .delete(&profile, &DeleteParams::default())
        .await
        .expect("deleting the profile");
    eventually(DEADLINE, "UnknownProfile again", || async {
        let rows = iws_table(&ns)?;
        match rows.iter().find(|r| r.0 == "own-profile") {
            Some((_, _, state)) if state == "UnknownProfile" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;

    running.stop().await;
    cleanup(&client, &ns).await;
}

/// The diagnoses of worker set `name` in `ns`, as (reason, message).
async fn diagnoses(
    iws: &Api<InferenceWorkerSet>,
    name: &str,
) -> Result<Vec<(String, String)>, String> {
    let ws = iws.get(name).await.map_err(|e| e.to_string())?;
    Ok(ws
        .status
        .map(|s| s.diagnoses)
        .unwrap_or_default()
        .into_iter()
        .map(|d| (d.reason, d.message))
        .collect())
}

/// Whether a Warning Event with `reason` regards worker set `name`.
async fn has_event(events: &Api<Event>, name: &str, reason: &str) -> Result<(), String> {
    let list = events
        .list(&ListParams::default())
        .await
        .map_err(|e| e.to_string())?;
    let found = list.items.iter().any(|e| {
        e.reason.as_deref() == Some(reason)
            && e.type_.as_deref() == Some("Warning")
            && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
            && e.reporting_controller.as_deref() == Some("kinference-controller")
    });
    if found {
        Ok(())
    } else {
        Err(format!(
            "{} events, no {reason} about {name}",
            list.items.len()
        ))
    }
}

/// KV-event diagnoses from real windows on simulated engines: the Gemma
/// case (256-token blocks, kvBlockSize 16) until the spec is fixed, a KV
/// port without a publisher until kvEvents is unset, and an engine that
/// serves without publishing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_diagnoses_follow_the_engines() {
    let client = cluster::client().await;
    cluster::install_crds(&client).await;
    let ns = cluster::namespace(&client, "kinference-controller-kv").await;
    let iws: Api<InferenceWorkerSet> = Api::namespaced(client.clone(), &ns);
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), &ns);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let loopback = "127.0.0.1:0".parse().expect("an address");

    // gemma: publishes 256-token blocks. quiet: no publisher at all.
    // uncached: prefix caching off, so it serves and publishes nothing.
    let gemma = start(config("google/gemma-4-12b-it", loopback, Some(0), 256)).await;
    let quiet = start(config("quiet", loopback, None, 16)).await;
    let mut cfg = config("uncached", loopback, Some(0), 16);
    cfg.engine.enable_prefix_caching = false;
    let uncached = start(cfg).await;

    let (seed_sets, _) = seed_objects(&ns);
    let mk = |name: &str, model: &str| {
        let mut ws = seed_sets
            .iter()
            .find(|w| w.name_any() == "qwen-3-6-35b-a3b")
            .expect("the seed's qwen worker set")
            .clone();
        ws.metadata.name = Some(name.into());
        ws.spec.service_ref.name = format!("{name}-vllm");
        ws.spec.kv_block_size = 16;
        ws.spec.models = vec![kinference_api::v1alpha1::ModelSpec {
            name: model.into(),
            aliases: Vec::new(),
        }];
        ws
    };
    let kv_port = |h: &kinference_sim::SimHandle| {
        i32::from(h.kv_addr().map_or_else(closed_port, |a| a.port()))
    };
    let running = Running::start(&client, &ns);
    for (name, engine) in [
        ("gemma", &gemma),
        ("quiet", &quiet),
        ("uncached", &uncached),
    ] {
        iws.create(&PostParams::default(), &mk(name, engine.model()))
            .await
            .unwrap_or_else(|e| panic!("creating {name}: {e}"));
        apply(
            &slices,
            &slice(
                &ns,
                &format!("{name}-vllm-1"),
                &format!("{name}-vllm"),
                &[
                    ("http", i32::from(engine.http_addr().port())),
                    ("kv-pub", kv_port(engine)),
                ],
                &[("127.0.0.1", true)],
            ),
        )
        .await;
    }
    let mut pool = InferencePool::new(
        "kv",
        kinference_api::InferencePoolSpec {
            worker_sets: ["gemma", "quiet", "uncached"]
                .iter()
                .map(|n| kinference_api::v1alpha1::WorkerSetRef { name: (*n).into() })
                .collect(),
        },
    );
    pool.metadata.namespace = Some(ns.clone());
    pools
        .create(&PostParams::default(), &pool)
        .await
        .expect("the pool");
    let traffic_to = [&gemma, &uncached]
        .map(|e| traffic(e.http_addr(), e.model(), Duration::from_millis(200), None));

    eventually(DEADLINE, "every worker set accepted and ready", || {
        table_is(
            &ns,
            &[
                ("gemma", "1", "Accepted"),
                ("quiet", "1", "Accepted"),
                ("uncached", "1", "Accepted"),
            ],
        )
    })
    .await;
    eventually(DEADLINE, "the block-width diagnosis", || async {
        let d = diagnoses(&iws, "gemma").await?;
        let want = format!(
            "KV events from {} carry 256-token blocks but kvBlockSize is 16: set kvBlockSize: 256",
            gemma.kv_addr().expect("a publisher")
        );
        match d.as_slice() {
            [(r, m)] if r == "BlockSizeMismatch" && m.starts_with(&want) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    eventually(DEADLINE, "a BlockSizeMismatch Event", || {
        has_event(&events, "gemma", "BlockSizeMismatch")
    })
    .await;
    eventually(DEADLINE, "the closed-port diagnosis", || async {
        let d = diagnoses(&iws, "quiet").await?;
        match d.as_slice() {
            [(r, m)] if r == "KvPortClosed" && m.contains("(connection refused)") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    eventually(DEADLINE, "a KvPortClosed Event", || {
        has_event(&events, "quiet", "KvPortClosed")
    })
    .await;
    eventually(DEADLINE, "the no-events diagnosis", || async {
        let d = diagnoses(&iws, "uncached").await?;
        match d.as_slice() {
            [(r, m)]
                if r == "NoKvEvents"
                    && m.contains("received no KV events while the engine served requests") =>
            {
                Ok(())
            }
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    eventually(DEADLINE, "a NoKvEvents Event", || {
        has_event(&events, "uncached", "NoKvEvents")
    })
    .await;
    for name in ["gemma", "quiet", "uncached"] {
        for (reason, message) in diagnoses(&iws, name).await.expect("diagnoses") {
            println!("{name}: {reason}: {message}");
        }
    }
    // Fixes: the width, and kvEvents unset where nothing publishes.
    iws.patch(
        "gemma",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"kvBlockSize": 256}})),
    )
    .await
    .expect("fixing kvBlockSize");
    iws.patch(
        "quiet",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"kvEvents": null}})),
    )
    .await
    .expect("unsetting kvEvents");
    for name in ["gemma", "quiet"] {
        eventually(DEADLINE, &format!("{name}'s diagnosis clears"), || async {
            let d = diagnoses(&iws, name).await?;
            if d.is_empty() {
                Ok(())
            } else {
                Err(format!("{d:?}"))
            }
        })
        .await;
    }
    // And stays cleared over two more windows under traffic.
    let windows = running.ctx.stats(Kind::WorkerSet, &ns, "gemma").kv_windows;
    eventually(DEADLINE, "two more windows of gemma", || async {
        let now = running.ctx.stats(Kind::WorkerSet, &ns, "gemma").kv_windows;
        if now >= windows + 2 {
            Ok(())
        } else {
            Err(format!("{windows} -> {now}"))
        }
    })
    .await;
    assert_eq!(diagnoses(&iws, "gemma").await.expect("diagnoses"), []);
    assert_eq!(
        running.ctx.stats(Kind::WorkerSet, &ns, "quiet").kv_windows,
        0,
        "no windows without kvEvents"
    );
    let stats: Vec<_> = ["gemma", "quiet", "uncached"]
        .iter()
        .map(|n| (n, running.ctx.stats(Kind::WorkerSet, &ns, n)))
        .collect();
    println!("per worker set: {stats:?}");

    for (stop, task) in traffic_to {
        stop.cancel();
        task.await.expect("the traffic ran without failures");
    }
    running.stop().await;
    for e in [gemma, quiet, uncached] {
        e.shutdown().await;
    }
    cleanup(&client, &ns).await;
}

/// Deletes what a test made in `ns` (the CRD-only server cannot delete
/// namespaces).
async fn cleanup(client: &Client, ns: &str) {
    let dp = DeleteParams::default();
    let lp = ListParams::default();
    let _ = Api::<InferenceWorkerSet>::namespaced(client.clone(), ns)
        .delete_collection(&dp, &lp)
        .await;
    let _ = Api::<InferencePool>::namespaced(client.clone(), ns)
        .delete_collection(&dp, &lp)
        .await;
    let _ = Api::<EndpointSlice>::namespaced(client.clone(), ns)
        .delete_collection(&dp, &lp)
        .await;
    let _ = Api::<Event>::namespaced(client.clone(), ns)
        .delete_collection(&dp, &lp)
        .await;
    cluster::delete_namespace(client, ns).await;
}
