//! The example manifests parse, validate and round-trip; invalid objects are
//! refused client-side with the same messages the API server gives.

use std::path::PathBuf;

use kinference_api::manifests::{self, Object};

fn examples_dir() -> PathBuf {
    kinference_examples::manifests_dir()
}

fn read_examples() -> Vec<(String, String)> {
    let out = kinference_examples::yaml_files(&examples_dir());
    assert!(
        out.len() >= 4,
        "expected the seed's examples in {}",
        examples_dir().display()
    );
    out
}

#[test]
fn seed_examples_parse_validate_and_round_trip() {
    let mut kinds = Vec::new();
    for (file, text) in read_examples() {
        let objects = manifests::parse(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(objects.len(), 1, "{file}");
        for o in objects {
            // Serialise the typed object and parse it again: nothing is lost.
            let yaml = match &o {
                Object::WorkerSet(x) => serde_saphyr::to_string(x.as_ref()).unwrap(),
                Object::Pool(x) => serde_saphyr::to_string(x.as_ref()).unwrap(),
                Object::Profile(x) => serde_saphyr::to_string(x.as_ref()).unwrap(),
                other => panic!("{file}: unexpected {}", other.describe()),
            };
            let again = manifests::parse(&yaml).unwrap_or_else(|e| panic!("{file} again: {e}"));
            match (&o, &again[0]) {
                (Object::WorkerSet(a), Object::WorkerSet(b)) => assert_eq!(a.spec, b.spec),
                (Object::Pool(a), Object::Pool(b)) => assert_eq!(a.spec, b.spec),
                (Object::Profile(a), Object::Profile(b)) => assert_eq!(a.spec, b.spec),
                _ => panic!("{file}: kind changed on round trip"),
            }
            kinds.push(o.describe());
        }
    }
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "InferencePool/chat",
            "InferenceWorkerSet/gemma-4-12b",
            "InferenceWorkerSet/qwen-3-6-35b-a3b",
            "RoutingProfile/qwen-h100-tp2",
        ]
    );
}

#[test]
fn seed_worker_set_has_the_designed_fields() {
    let text = std::fs::read_to_string(examples_dir().join("worker-set.yaml")).unwrap();
    let Object::WorkerSet(ws) = manifests::parse(&text).unwrap().remove(0) else {
        panic!("not a worker set")
    };
    assert_eq!(ws.spec.profile, "default");
    assert_eq!(ws.spec.kv_block_size, 16);
    assert_eq!(ws.spec.service_ref.name, "qwen-vllm");
    assert_eq!(
        ws.spec.service_ref.port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("http".into())
    );
    assert_eq!(
        ws.spec.kv_events.as_ref().unwrap().port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("kv-pub".into())
    );
    assert_eq!(ws.spec.models[0].name, "Qwen/Qwen3.6-35B-A3B");
    assert_eq!(ws.spec.models[0].aliases, ["qwen3.6"]);

    let text = std::fs::read_to_string(examples_dir().join("worker-set-aliases.yaml")).unwrap();
    let Object::WorkerSet(ws) = manifests::parse(&text).unwrap().remove(0) else {
        panic!("not a worker set")
    };
    assert_eq!(ws.spec.models[0].aliases.len(), 2);
    assert_eq!(
        ws.spec.service_ref.port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8000)
    );
}

#[test]
fn profile_defaults_to_default() {
    let ws = manifests::parse(
        "apiVersion: kinference.buoyant.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: a}\nspec: {kvBlockSize: 1, serviceRef: {name: s, port: 80}}\n",
    )
    .unwrap();
    let Object::WorkerSet(ws) = &ws[0] else {
        panic!()
    };
    assert_eq!(ws.spec.profile, "default");
    assert!(kinference_api::is_builtin_profile(&ws.spec.profile));
}

#[test]
fn invalid_objects_are_refused_with_the_cel_messages() {
    let invalid = kinference_examples::invalid_examples();
    assert!(invalid.len() >= 10, "expected the invalid examples");
    for case in invalid {
        let err = manifests::parse(&case.text)
            .expect_err(&format!("{}: accepted an invalid object", case.file))
            .to_string();
        assert!(
            err.contains(&case.message),
            "{}: expected {:?} in {err:?}",
            case.file,
            case.message
        );
    }
}

#[test]
fn bad_documents_say_which_and_why() {
    let err = manifests::parse("kind: InferencePool\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("document 1") && err.contains("apiVersion"),
        "{err}"
    );

    let two = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n---\napiVersion: kinference.buoyant.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: w}\nspec: {kvBlockSize: many, serviceRef: {name: s, port: 80}}\n";
    let err = manifests::parse(two).unwrap_err().to_string();
    assert!(
        err.contains("document 2") && err.contains("InferenceWorkerSet/w"),
        "{err}"
    );

    let err = manifests::parse("a: [").unwrap_err().to_string();
    assert!(err.contains("YAML"), "{err}");

    // Other kinds are reported, not refused; empty documents are skipped.
    let objs =
        manifests::parse("---\napiVersion: v1\nkind: Service\nmetadata: {name: s}\n---\n").unwrap();
    assert_eq!(objs.len(), 1);
    assert_eq!(objs[0].describe(), "Service/s");
}

#[test]
fn endpoint_slices_parse() {
    let doc = r"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: qwen-vllm-abc
  labels: {kubernetes.io/service-name: qwen-vllm}
addressType: IPv4
ports: [{name: http, port: 8000}, {name: kv-pub, port: 5557}]
endpoints:
  - addresses: [10.0.0.1]
    conditions: {ready: true}
";
    let objs = manifests::parse(doc).unwrap();
    let Object::EndpointSlice(s) = &objs[0] else {
        panic!("{}", objs[0].describe())
    };
    assert_eq!(s.ports.as_ref().unwrap().len(), 2);
    assert_eq!(s.endpoints[0].addresses, ["10.0.0.1"]);
}

#[test]
fn admission_tenants_take_weights_and_models() {
    let text = "apiVersion: kinference.buoyant.io/v1alpha1\nkind: RoutingProfile\nmetadata: {name: shared}\nspec:\n  admission:\n    maxPredictedTtftMillis: 1500\n    tenants:\n      - {name: interactive, weight: 4, models: [qwen-chat]}\n      - {name: batch, models: [qwen-batch, qwen-nightly]}\n";
    let Object::Profile(p) = manifests::parse(text).unwrap().remove(0) else {
        panic!("not a profile")
    };
    let a = p.spec.admission.expect("admission");
    assert_eq!(a.tenants.len(), 2);
    assert_eq!(a.tenants[0].weight, Some(4));
    assert_eq!(a.tenants[1].weight, None, "unset: the default, 1");
    assert_eq!(a.tenants[1].models, ["qwen-batch", "qwen-nightly"]);
    // Without tenants the field stays out of the object.
    let plain = "apiVersion: kinference.buoyant.io/v1alpha1\nkind: RoutingProfile\nmetadata: {name: p}\nspec: {admission: {maxPredictedTtftMillis: 1500}}\n";
    let Object::Profile(p) = manifests::parse(plain).unwrap().remove(0) else {
        panic!("not a profile")
    };
    let yaml = serde_saphyr::to_string(&p.spec).unwrap();
    assert!(!yaml.contains("tenants"), "{yaml}");
}
