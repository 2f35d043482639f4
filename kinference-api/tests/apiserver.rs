//! The CRDs against a real Kubernetes API server (whatever `KUBECONFIG`
//! names; CI starts the upstream CRD server from `shared/k8s`).
//!
//! Applies the generated CRDs, creates the seed's objects, checks that
//! `kubectl get iws` shows `NAME READY STATE AGE` with the status a
//! controller writes, and that invalid objects are refused with the CEL
//! messages.

use kinference_api::manifests::{self, Object};
use kinference_api::v1alpha1::{InferenceWorkerSetStatus, RoutingProfile};
use kinference_api::{InferencePool, InferenceWorkerSet, WorkerSetState};
use kinference_examples::cluster;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};

#[tokio::test(flavor = "multi_thread")]
async fn crds_on_a_real_api_server() {
    let client = cluster::client().await;
    cluster::install_crds(&client).await;
    let ns = cluster::namespace(&client, "kinference-api").await;

    // The seed's objects, created as a user would (into a namespace of our own).
    let mut worker_sets = Vec::new();
    let mut profiles = Vec::new();
    for (file, text) in kinference_examples::yaml_files(&kinference_examples::manifests_dir()) {
        for object in manifests::parse(&text).unwrap_or_else(|e| panic!("{file}: {e}")) {
            match object {
                Object::WorkerSet(mut o) => {
                    o.metadata.namespace = Some(ns.clone());
                    let api: Api<InferenceWorkerSet> = Api::namespaced(client.clone(), &ns);
                    api.create(&PostParams::default(), &o)
                        .await
                        .unwrap_or_else(|e| panic!("{file}: {e}"));
                    worker_sets.push(o.metadata.name.clone().unwrap());
                }
                Object::Pool(mut o) => {
                    o.metadata.namespace = Some(ns.clone());
                    let api: Api<InferencePool> = Api::namespaced(client.clone(), &ns);
                    api.create(&PostParams::default(), &o)
                        .await
                        .unwrap_or_else(|e| panic!("{file}: {e}"));
                }
                Object::Profile(mut o) => {
                    // Cluster-scoped: give it a name of this run's own.
                    let name = format!("{}-{ns}", o.metadata.name.as_deref().unwrap());
                    o.metadata.name = Some(name.clone());
                    let api: Api<RoutingProfile> = Api::all(client.clone());
                    api.create(&PostParams::default(), &o)
                        .await
                        .unwrap_or_else(|e| panic!("{file}: {e}"));
                    profiles.push(name);
                }
                other => panic!("{file}: unexpected {}", other.describe()),
            }
        }
    }
    assert_eq!(worker_sets.len(), 2);

    // Write status as the controller will (server-side apply on the status
    // subresource), so the printer columns have something to show.
    let iws: Api<InferenceWorkerSet> = Api::namespaced(client.clone(), &ns);
    let states = [
        (
            "qwen-3-6-35b-a3b",
            WorkerSetState {
                rejections: vec![],
                ready_endpoints: 3,
                referenced: true,
            },
        ),
        (
            "gemma-4-12b",
            WorkerSetState {
                rejections: vec![],
                ready_endpoints: 0,
                referenced: false,
            },
        ),
    ];
    for (name, state) in &states {
        let status = InferenceWorkerSetStatus {
            ready_endpoints: i32::try_from(state.ready_endpoints).unwrap(),
            state: state.render(),
            ..Default::default()
        };
        let patch = serde_json::json!({
            "apiVersion": "kinference.buoyant.io/v1alpha1",
            "kind": "InferenceWorkerSet",
            "status": status,
        });
        iws.patch_status(
            name,
            &PatchParams::apply("kinference-api-test").force(),
            &Patch::Apply(&patch),
        )
        .await
        .unwrap_or_else(|e| panic!("status of {name}: {e}"));
    }

    let table = cluster::kubectl_run(&["get", "iws", "-n", &ns]);
    println!("kubectl get iws -n {ns}\n{table}");
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "READY", "STATE", "AGE"]);
    let mut rows: Vec<Vec<&str>> = lines.map(|l| l.split_whitespace().collect()).collect();
    rows.sort();
    assert_eq!(rows.len(), 2, "{table}");
    assert_eq!(
        &rows[0][..3],
        ["gemma-4-12b", "0", "Accepted,NotReady,Unreferenced"]
    );
    assert_eq!(&rows[1][..3], ["qwen-3-6-35b-a3b", "3", "Accepted"]);

    // The short names and the other kinds' columns.
    let pools = cluster::kubectl_run(&["get", "ipool", "-n", &ns]);
    println!("kubectl get ipool -n {ns}\n{pools}");
    let header: Vec<&str> = pools.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "MODELS", "READY", "AGE"]);
    let profile_table = cluster::kubectl_run(&["get", "routingprofiles", &profiles[0]]);
    println!(
        "kubectl get routingprofiles {}\n{profile_table}",
        profiles[0]
    );
    assert!(profile_table.contains("local"), "{profile_table}");

    // Invalid objects are refused by the server with the CEL messages.
    for case in kinference_examples::invalid_examples() {
        let mut value: serde_json::Value = serde_saphyr_value(&case.text);
        let kind = value["kind"].as_str().unwrap().to_owned();
        let gvk = GroupVersionKind::gvk("kinference.buoyant.io", "v1alpha1", &kind);
        let plural = format!("{}s", kind.to_lowercase());
        let ar = ApiResource::from_gvk_with_plural(&gvk, &plural);
        let api: Api<DynamicObject> = if kind == "RoutingProfile" {
            Api::all_with(client.clone(), &ar)
        } else {
            value["metadata"]["namespace"] = ns.clone().into();
            Api::namespaced_with(client.clone(), &ns, &ar)
        };
        let object: DynamicObject = serde_json::from_value(value).unwrap();
        match api.create(&PostParams::default(), &object).await {
            Ok(_) => panic!("{}: the API server accepted an invalid object", case.file),
            Err(kube::Error::Api(status)) => {
                assert_eq!(status.code, 422, "{}: {status:?}", case.file);
                assert!(
                    status.message.contains(&case.message),
                    "{}: expected {:?} in {:?}",
                    case.file,
                    case.message,
                    status.message
                );
                println!("refused {}: {}", case.file, status.message);
            }
            Err(e) => panic!("{}: {e}", case.file),
        }
    }

    // Clean up what this test made.
    for name in &worker_sets {
        iws.delete(name, &DeleteParams::default()).await.unwrap();
    }
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), &ns);
    pools
        .delete("chat", &DeleteParams::default())
        .await
        .unwrap();
    let rp: Api<RoutingProfile> = Api::all(client.clone());
    for name in &profiles {
        rp.delete(name, &DeleteParams::default()).await.unwrap();
    }
    cluster::delete_namespace(&client, &ns).await;
}

fn serde_saphyr_value(text: &str) -> serde_json::Value {
    serde_saphyr::from_str(text).expect("valid YAML")
}
