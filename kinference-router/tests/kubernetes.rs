//! The router in Kubernetes mode against a real API server (whatever
//! `KUBECONFIG` names): it follows an InferencePool, its worker sets and
//! their EndpointSlices as they are created, changed and deleted, with
//! kinference-sim engines behind the slices.

mod support;

use std::time::Duration;

use clap::Parser as _;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kinference_api::{InferencePool, InferenceWorkerSet};
use kinference_examples::cluster;
use kinference_router::args::{Args, Command};
use kinference_sim::SimHandle;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use support::*;
use tokio_util::sync::CancellationToken;

fn slice(name: &str, sim: &SimHandle) -> EndpointSlice {
    let kv = sim.kv_addr().expect("KV events on").port();
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "sim"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": sim.http_addr().port()}, {"name": "kv", "port": kv}],
        "endpoints": [{"addresses": [sim.http_addr().ip().to_string()], "conditions": {"ready": true}}],
    }))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_follows_the_cluster() {
    let client = cluster::client().await;
    cluster::install_crds(&client).await;
    let ns = cluster::namespace(&client, "kinference-router").await;
    let sims = engines(2, |_| {}).await;
    let pp = PostParams::default();

    let pools: Api<InferencePool> = Api::namespaced(client.clone(), &ns);
    let sets: Api<InferenceWorkerSet> = Api::namespaced(client.clone(), &ns);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns);
    pools
        .create(
            &pp,
            &serde_json::from_value(json!({
            "apiVersion": "kinference.buoyant.io/v1alpha1", "kind": "InferencePool",
            "metadata": {"name": "chat"}, "spec": {"workerSets": [{"name": "sim"}]}}))
            .unwrap(),
        )
        .await
        .unwrap();
    sets.create(&pp, &serde_json::from_value(json!({
            "apiVersion": "kinference.buoyant.io/v1alpha1", "kind": "InferenceWorkerSet",
            "metadata": {"name": "sim"},
            "spec": {"kvBlockSize": 16, "serviceRef": {"name": "sim", "port": "http"}, "kvEvents": {"port": "kv"},
                     "models": [{"name": MODEL, "aliases": [ALIAS]}]}})).unwrap())
        .await
        .unwrap();
    slices.create(&pp, &slice("sim-a", &sims[0])).await.unwrap();

    let args = Args::try_parse_from([
        "kinference-router",
        "serve",
        "--pool",
        &format!("{ns}/chat"),
        "--listen",
        "127.0.0.1:0",
        "--admin-addr",
        "127.0.0.1:0",
        "--drain",
        "1s",
    ])
    .unwrap();
    let Command::Serve(serve) = args.command else {
        unreachable!()
    };
    let stop = CancellationToken::new();
    let running = kinference_router::args::start(*serve, stop.clone())
        .await
        .expect("router starts");
    let r = Router {
        running,
        stop,
        dir: tempfile::tempdir().unwrap(),
    };

    // Ready after the first full list, and routing to the one endpoint.
    wait_routable(&r, 1, true).await;
    assert_eq!(get(r.admin(), "/readyz").await.status, 200);
    let reply = post(
        r.api(),
        "/v1/chat/completions",
        &chat(ALIAS, "w1 w2 w3", false, 2),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.endpoint(), sims[0].http_addr().to_string());

    // A second slice appears: both engines are used.
    slices.create(&pp, &slice("sim-b", &sims[1])).await.unwrap();
    wait_routable(&r, 2, true).await;

    // The first slice is deleted: only the second engine is left.
    slices
        .delete("sim-a", &DeleteParams::default())
        .await
        .unwrap();
    wait_routable(&r, 1, true).await;
    for i in 0..4 {
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &words(i * 100, 20), false, 2),
        )
        .await;
        assert_eq!(reply.endpoint(), sims[1].http_addr().to_string());
    }

    // The worker set changes: a new alias resolves without a restart.
    sets.patch(
        "sim",
        &PatchParams::default(),
        &Patch::Merge(
            json!({"spec": {"models": [{"name": MODEL, "aliases": [ALIAS, "newer-alias"]}]}}),
        ),
    )
    .await
    .unwrap();
    eventually(Duration::from_secs(10), "the new alias", || async {
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat("newer-alias", "w1", false, 1),
        )
        .await;
        (reply.status == 200).then_some(())
    })
    .await;

    // The pool stops naming the worker set: its model is gone.
    pools
        .patch(
            "chat",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"workerSets": [{"name": "other"}]}})),
        )
        .await
        .unwrap();
    eventually(
        Duration::from_secs(10),
        "the model to disappear",
        || async {
            let reply = post(
                r.api(),
                "/v1/chat/completions",
                &chat(MODEL, "w1", false, 1),
            )
            .await;
            (reply.status == 404).then_some(())
        },
    )
    .await;

    r.shutdown().await;
    let _ = slices.delete("sim-b", &DeleteParams::default()).await;
    let _ = sets.delete("sim", &DeleteParams::default()).await;
    let _ = pools.delete("chat", &DeleteParams::default()).await;
    cluster::delete_namespace(&client, &ns).await;
}
