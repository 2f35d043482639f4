//! Leader election on a real API server's Lease (the `coordination.k8s.io`
//! stand-in of `shared/k8s`): one writer at a time, and a successor once the
//! leader lets go.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kinference_api::{InferencePool, InferencePoolSpec, InferenceWorkerSet};
use kinference_controller::events::NoEvents;
use kinference_controller::leader::{Leadership, LeaseConfig};
use kinference_controller::metrics::{Kind, Metrics};
use kinference_controller::probe::HttpProber;
use kinference_controller::{Runtime, Seams, Settings};
use kinference_examples::cluster;
use kinference_examples::testing::eventually;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

const DEADLINE: Duration = Duration::from_secs(90);

async fn compete(client: &Client, ns: &str, identity: &str) -> Leadership {
    Leadership::lease(
        client.clone(),
        LeaseConfig {
            name: "kinference-controller".into(),
            namespace: ns.into(),
            identity: identity.into(),
            duration: Duration::from_secs(4),
            grace: Duration::from_secs(1),
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{identity} competes: {e}"))
}

struct Instance {
    ctx: Arc<kinference_controller::Context>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    leadership: Leadership,
}

fn start(client: &Client, ns: &str, leadership: Leadership) -> Instance {
    let mut registry = Registry::default();
    let runtime = Runtime::new(
        client.clone(),
        Settings {
            namespace: Some(ns.into()),
            ..Settings::default()
        },
        Seams {
            prober: Arc::new(HttpProber::new(Duration::from_secs(1))),
            events: Arc::new(NoEvents),
            leader: leadership.subscribe(),
        },
        Metrics::register(&mut registry),
    );
    let ctx = runtime.context();
    let stop = CancellationToken::new();
    let task = tokio::spawn(runtime.run(stop.clone()));
    Instance {
        ctx,
        stop,
        task,
        leadership,
    }
}

impl Instance {
    async fn stop(self) {
        self.stop.cancel();
        self.task.await.expect("the controllers stop");
        self.leadership.release().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_writer_then_a_successor() {
    let client = cluster::client().await;
    cluster::install_crds(&client).await;
    let ns = cluster::namespace(&client, "kinference-controller-leader").await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let iws: Api<InferenceWorkerSet> = Api::namespaced(client.clone(), &ns);
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), &ns);

    let a = start(&client, &ns, compete(&client, &ns, "a").await);
    let b = start(&client, &ns, compete(&client, &ns, "b").await);
    eventually(DEADLINE, "exactly one leader", || async {
        match (a.leadership.is_leader(), b.leadership.is_leader()) {
            (true, false) | (false, true) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let (leader, follower) = if a.leadership.is_leader() {
        (a, b)
    } else {
        (b, a)
    };
    let holder = leases
        .get("kinference-controller")
        .await
        .expect("the Lease exists")
        .spec
        .and_then(|s| s.holder_identity);
    assert!(holder.is_some(), "the Lease names its holder");

    // The leader writes; the follower only watches.
    let mut ws: InferenceWorkerSet = serde_json::from_value(serde_json::json!({
        "apiVersion": "kinference.buoyant.io/v1alpha1", "kind": "InferenceWorkerSet",
        "metadata": {"name": "w", "namespace": ns},
        "spec": {"kvBlockSize": 16, "serviceRef": {"name": "svc", "port": "http"}}
    }))
    .expect("a worker set");
    ws.metadata.namespace = Some(ns.clone());
    iws.create(&PostParams::default(), &ws)
        .await
        .expect("creating w");
    eventually(DEADLINE, "w gets a status", || async {
        let w = iws.get("w").await.map_err(|e| e.to_string())?;
        match w.status.map(|s| s.state) {
            Some(s) if s == "Accepted,NotReady,Unreferenced" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    // The status can be visible before the leader's patch call has returned
    // and been counted.
    eventually(DEADLINE, "the leader counts its write", || async {
        match leader.ctx.stats(Kind::WorkerSet, &ns, "w").writes {
            0 => Err("no write counted".into()),
            _ => Ok(()),
        }
    })
    .await;
    assert_eq!(
        follower.ctx.stats(Kind::WorkerSet, &ns, "w"),
        kinference_controller::ObjectStats::default(),
        "a follower neither reconciles nor writes"
    );

    // The leader stops and lets go; the follower takes over and follows the
    // world from then on.
    let leader_writes = leader.ctx.stats(Kind::WorkerSet, &ns, "w").writes;
    let leader_ctx = leader.ctx.clone();
    leader.stop().await;
    eventually(DEADLINE, "the follower leads", || async {
        if follower.leadership.is_leader() {
            Ok(())
        } else {
            Err("still following".into())
        }
    })
    .await;
    let mut pool = InferencePool::new(
        "p",
        InferencePoolSpec {
            worker_sets: vec![kinference_api::v1alpha1::WorkerSetRef { name: "w".into() }],
        },
    );
    pool.metadata.namespace = Some(ns.clone());
    pools
        .create(&PostParams::default(), &pool)
        .await
        .expect("creating p");
    eventually(DEADLINE, "the successor writes", || async {
        let w = iws.get("w").await.map_err(|e| e.to_string())?;
        match w.status.map(|s| s.state) {
            Some(s) if s == "Accepted,NotReady" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    eventually(DEADLINE, "the successor counts its write", || async {
        match follower.ctx.stats(Kind::WorkerSet, &ns, "w").writes {
            0 => Err("no write counted".into()),
            _ => Ok(()),
        }
    })
    .await;
    assert_eq!(
        leader_ctx.stats(Kind::WorkerSet, &ns, "w").writes,
        leader_writes
    );
    let holder_now = leases
        .get("kinference-controller")
        .await
        .expect("the Lease")
        .spec
        .and_then(|s| s.holder_identity);
    assert!(
        holder_now.is_some() && holder_now != holder,
        "{holder:?} -> {holder_now:?}"
    );
    follower.stop().await;

    let dp = DeleteParams::default();
    let lp = ListParams::default();
    let _ = iws.delete_collection(&dp, &lp).await;
    let _ = pools.delete_collection(&dp, &lp).await;
    let _ = leases.delete_collection(&dp, &lp).await;
    println!(
        "lease holders: {holder:?} then {holder_now:?}; w = {:?}",
        iws.get_opt("w").await.ok().flatten().map(|w| w.name_any())
    );
    cluster::delete_namespace(&client, &ns).await;
}
