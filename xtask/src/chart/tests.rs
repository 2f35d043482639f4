//! The chart's checks, run by `cargo test`, plus the rendered command lines
//! parsed with the binaries' own clap definitions.

use std::collections::BTreeSet;
use std::path::PathBuf;

use clap::Parser as _;
use serde_json::Value;

use super::ROUTER_WATCHES;
use super::helm::{bad_values, check_refusals, render, values_sets};
use super::rendered::{check_rendered, container_args, name_of};

fn root() -> PathBuf {
    crate::workspace_root()
}

/// Parses the rendered command lines with the binaries' own flags.
fn parse_args(objects: &[Value]) -> usize {
    let mut n = 0;
    for d in objects.iter().filter(|o| o["kind"] == "Deployment") {
        let component = d["metadata"]["labels"]["app.kubernetes.io/component"]
            .as_str()
            .unwrap_or_default();
        let args = container_args(d);
        match component {
            "controller" => {
                let argv = std::iter::once("kinference-controller".to_owned()).chain(args);
                kinference_controller::Args::try_parse_from(argv)
                    .unwrap_or_else(|e| panic!("the controller refuses its flags: {e}"));
            }
            "router" => {
                let argv = std::iter::once("kinference-router".to_owned()).chain(args);
                let a = kinference_router::args::Args::try_parse_from(argv)
                    .unwrap_or_else(|e| panic!("the router refuses its flags: {e}"));
                let kinference_router::args::Command::Serve(serve) = a.command else {
                    panic!("the router is not told to serve");
                };
                assert!(serve.manifests.is_none());
                serve
                    .config()
                    .unwrap_or_else(|e| panic!("the router refuses its settings: {e}"));
            }
            other => panic!("a Deployment of an unknown component {other:?}"),
        }
        n += 1;
    }
    n
}

#[test]
fn chart_lints_renders_and_grants_what_the_code_needs() {
    let root = root();
    let sets = values_sets(&root).expect("values files");
    assert!(sets.len() >= 3, "the defaults and at least two examples");
    let mut deployments = 0;
    for (label, values) in sets {
        let r = render(&root, &values).unwrap_or_else(|e| panic!("{e:#}"));
        check_rendered(&root, &values, &r).unwrap_or_else(|e| panic!("{label}: {e:#}"));
        deployments += parse_args(r.objects.as_ref().expect("rendered"));
    }
    assert!(deployments >= 4, "only {deployments} Deployments checked");
}

#[test]
fn chart_refuses_bad_values() {
    assert_eq!(
        check_refusals(&root())
            .unwrap_or_else(|e| panic!("{e:#}"))
            .0,
        bad_values().len()
    );
}

#[test]
fn rendered_checks_catch_a_drifted_role() {
    let root = root();
    let values = serde_json::json!({"routers": [{"pool": "chat"}]});
    let mut r = render(&root, &values).unwrap_or_else(|e| panic!("{e:#}"));
    check_rendered(&root, &values, &r).expect("the chart as it is passes");
    for o in r.objects.as_mut().expect("rendered") {
        if o["kind"] == "Role" && name_of(o) == "kinference-router-chat" {
            o["rules"][0]["verbs"] = serde_json::json!(["get", "list", "watch", "delete"]);
        }
    }
    let e = check_rendered(&root, &values, &r).expect_err("an extra verb is caught");
    assert!(e.to_string().contains("Role"), "{e}");
}

#[test]
fn router_watches_are_what_source_rs_watches() {
    // Every `Api::<Kind>::namespaced|all` in the router's sources, with
    // its scope, must be in ROUTER_WATCHES, and the reverse.
    let dir = root().join("kinference-router/src");
    let mut seen = BTreeSet::new();
    let mut files = Vec::new();
    let mut dirs = vec![dir];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).expect("router sources") {
            let p = entry.expect("entry").path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    for path in files {
        let text = std::fs::read_to_string(&path).expect("readable");
        for (i, _) in text.match_indices("Api::<") {
            let rest = &text[i + "Api::<".len()..];
            let Some((kind, tail)) = rest.split_once(">::") else {
                continue;
            };
            let namespaced = if tail.starts_with("namespaced") {
                true
            } else if tail.starts_with("all") {
                false
            } else {
                panic!(
                    "Api::<{kind}> is made in an unknown way: {}",
                    &tail[..20.min(tail.len())]
                );
            };
            seen.insert((kind.to_owned(), namespaced));
        }
    }
    let table: BTreeSet<(String, bool)> = ROUTER_WATCHES
        .iter()
        .map(|w| (w.0.to_owned(), w.3))
        .collect();
    assert_eq!(
        seen, table,
        "update ROUTER_WATCHES and the chart's router RBAC"
    );
}

#[test]
fn a_stopping_router_drains_for_minutes_by_default() {
    let values = serde_json::json!({"routers": [{"pool": "chat"}]});
    let r = render(&root(), &values).unwrap_or_else(|e| panic!("{e:#}"));
    let found = super::availability::check(r.objects.as_ref().expect("rendered"))
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        found.max_drain >= 300,
        "the default drain is {} s: long generations would be cut on every rollout",
        found.max_drain
    );
    assert!(found.spread >= 2, "no topology spread by default");
}

#[test]
fn every_option_renders_its_objects() {
    // The example with autoscaling and NetworkPolicies renders them, and
    // leaves the router's replicas to the autoscaler.
    let root = root();
    let (_, values) = values_sets(&root)
        .expect("values files")
        .into_iter()
        .find(|(label, _)| label.ends_with("production.yaml"))
        .expect("deploy/helm/examples/production.yaml");
    let r = render(&root, &values).unwrap_or_else(|e| panic!("{e:#}"));
    let objects = r.objects.expect("rendered");
    let count = |kind: &str| objects.iter().filter(|o| o["kind"] == kind).count();
    assert_eq!(count("HorizontalPodAutoscaler"), 1);
    assert_eq!(count("NetworkPolicy"), 2);
    assert_eq!(count("PodDisruptionBudget"), 2);
    let router = objects
        .iter()
        .find(|o| o["kind"] == "Deployment" && name_of(o) == "kinference-router-chat")
        .expect("the router");
    assert!(router["spec"]["replicas"].is_null());
    let found = super::availability::check(&objects).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        found.max_drain, 1800,
        "routers[].drainSeconds reaches the router"
    );
}

#[test]
fn observability_objects_render_only_when_enabled() {
    let root = root();
    let none = render(&root, &serde_json::Value::Null).unwrap_or_else(|e| panic!("{e:#}"));
    let objects = none.objects.expect("rendered");
    assert_eq!(
        super::observability::check(&root, &serde_json::Value::Null, &objects)
            .unwrap_or_else(|e| panic!("{e:#}")),
        (0, 0),
        "off by default"
    );
    let values = serde_json::json!({"metrics": {
        "prometheusRule": {"enabled": true, "namespace": "monitoring", "labels": {"release": "prom"}},
        "dashboard": {"enabled": true, "annotations": {"grafana_folder": "kinference"}},
    }});
    let r = render(&root, &values).unwrap_or_else(|e| panic!("{e:#}"));
    check_rendered(&root, &values, &r).unwrap_or_else(|e| panic!("{e:#}"));
    let mut objects = r.objects.expect("rendered");
    assert_eq!(
        super::observability::check(&root, &values, &objects).unwrap_or_else(|e| panic!("{e:#}")),
        (1, 1)
    );
    // A rule that drifted from deploy/observability/alerts.yaml is caught.
    for o in &mut objects {
        if o["kind"] == "PrometheusRule" {
            o["spec"]["groups"][0]["rules"][0]["expr"] = serde_json::json!("vector(1)");
        }
    }
    let e = super::observability::check(&root, &values, &objects).expect_err("a drifted rule");
    assert!(e.to_string().contains("alerts.yaml"), "{e}");
}
