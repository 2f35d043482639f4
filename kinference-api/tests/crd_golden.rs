//! Golden test: the CRDs kinference-api generates are the ones committed in
//! `deploy/crds/`, and they say what a person using kubectl relies on.

use std::path::Path;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kinference_api::crds;

#[test]
fn committed_crds_match_the_generated_ones() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds");
    for f in crds::files().unwrap() {
        let path = dir.join(&f.name);
        let committed = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; run `cargo xtask gen-crds`", path.display()));
        assert!(
            committed == f.content,
            "{} is stale; run `cargo xtask gen-crds` and commit the result",
            path.display()
        );
    }
}

fn crd(plural: &str) -> CustomResourceDefinition {
    crds::all()
        .into_iter()
        .find(|c| c.spec.names.plural == plural)
        .unwrap_or_else(|| panic!("no CRD {plural}"))
}

fn columns(c: &CustomResourceDefinition) -> Vec<(String, String, String)> {
    c.spec.versions[0]
        .additional_printer_columns
        .iter()
        .flatten()
        .map(|p| (p.name.clone(), p.type_.clone(), p.json_path.clone()))
        .collect()
}

fn schema(c: &CustomResourceDefinition) -> serde_json::Value {
    serde_json::to_value(
        c.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap(),
    )
    .unwrap()
}

#[test]
fn worker_set_crd_shape() {
    let c = crd("inferenceworkersets");
    assert_eq!(c.spec.group, "kinference.buoyant.io");
    assert_eq!(c.spec.scope, "Namespaced");
    assert_eq!(c.spec.names.kind, "InferenceWorkerSet");
    assert_eq!(
        c.spec.names.short_names.as_deref(),
        Some(&["iws".to_owned()][..])
    );
    assert_eq!(c.spec.versions[0].name, "v1alpha1");
    assert!(
        c.spec.versions[0]
            .subresources
            .as_ref()
            .unwrap()
            .status
            .is_some()
    );
    assert_eq!(
        columns(&c),
        [
            (
                "READY".into(),
                "integer".into(),
                ".status.readyEndpoints".into()
            ),
            ("STATE".into(), "string".into(), ".status.state".into()),
            (
                "AGE".into(),
                "date".into(),
                ".metadata.creationTimestamp".into()
            ),
        ]
    );
    let s = schema(&c);
    let spec = &s["properties"]["spec"];
    assert_eq!(
        spec["required"],
        serde_json::json!(["kvBlockSize", "serviceRef"])
    );
    assert_eq!(spec["properties"]["profile"]["default"], "default");
    assert_eq!(
        spec["properties"]["serviceRef"]["properties"]["port"]["x-kubernetes-int-or-string"],
        true
    );
    assert_eq!(spec["properties"]["kvBlockSize"]["format"], "int32");
    let status = &s["properties"]["status"]["properties"];
    for (field, key) in [
        ("conditions", "type"),
        ("diagnoses", "reason"),
        ("models", "name"),
    ] {
        assert_eq!(status[field]["x-kubernetes-list-type"], "map", "{field}");
        assert_eq!(
            status[field]["x-kubernetes-list-map-keys"],
            serde_json::json!([key]),
            "{field}"
        );
    }
    for field in ["readyEndpoints", "state", "observedGeneration"] {
        assert!(status.get(field).is_some(), "status.{field}");
    }
}

#[test]
fn pool_and_profile_crd_shape() {
    let p = crd("inferencepools");
    assert_eq!(p.spec.scope, "Namespaced");
    assert_eq!(
        p.spec.names.short_names.as_deref(),
        Some(&["ipool".to_owned()][..])
    );
    let names: Vec<String> = columns(&p).into_iter().map(|c| c.0).collect();
    assert_eq!(names, ["MODELS", "READY", "AGE"]);

    let r = crd("routingprofiles");
    assert_eq!(r.spec.scope, "Cluster");
    let modes = &schema(&r)["properties"]["spec"]["properties"]["tokenization"]["properties"]["mode"]
        ["enum"];
    assert_eq!(
        *modes,
        serde_json::json!(["local", "engine", "approximate"])
    );
    // Admission: optional, its bound required when present, each limit
    // validated by the API server (CEL) with a message.
    let spec = &schema(&r)["properties"]["spec"];
    let admission = &spec["properties"]["admission"];
    assert!(
        !spec["required"]
            .as_array()
            .is_some_and(|a| a.iter().any(|v| v == "admission")),
        "admission is optional: off by default"
    );
    assert_eq!(
        admission["required"],
        serde_json::json!(["maxPredictedTtftMillis"])
    );
    for (field, rule) in [
        ("maxPredictedTtftMillis", "self > 0.0"),
        ("maxQueue", "self >= 1 && self <= 100000"),
        ("maxWaitMillis", "self >= 1 && self <= 600000"),
    ] {
        let v = &admission["properties"][field]["x-kubernetes-validations"][0];
        assert_eq!(v["rule"], rule, "{field}");
        assert!(
            v["message"]
                .as_str()
                .is_some_and(|m| m.starts_with(&format!("admission.{field}"))),
            "{field}: {v}"
        );
    }
}
