//! Checks of what keeps the rendered pods available and reachable: drain
//! and grace periods, topology spread, PodDisruptionBudgets,
//! HorizontalPodAutoscalers and NetworkPolicies.
//!
//! Each object that selects pods must select the pods of exactly one
//! rendered Deployment (a selector that matches nothing protects nothing);
//! a HorizontalPodAutoscaler's Deployment leaves `replicas` to it; a router
//! pod's grace period covers its preStop sleep and its whole drain.

use anyhow::{Context, Result, ensure};
use serde_json::Value;

use super::rendered::{container_args, find, name_of, ns_of};

/// Whether `selector` (a `matchLabels` map) selects pods labelled `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|m| !m.is_empty() && m.iter().all(|(k, v)| &labels[k] == v))
}

/// The pod labels of a Deployment.
fn pod_labels(d: &Value) -> &Value {
    &d["spec"]["template"]["metadata"]["labels"]
}

/// The Deployments in `ns` whose pods `selector` selects.
fn selected<'a>(objects: &'a [Value], ns: &str, selector: &Value) -> Vec<&'a Value> {
    objects
        .iter()
        .filter(|o| o["kind"] == "Deployment" && ns_of(o) == ns)
        .filter(|d| selects(selector, pod_labels(d)))
        .collect()
}

/// The one Deployment an object's `selector` selects.
fn one_selected<'a>(objects: &'a [Value], o: &Value, selector: &Value) -> Result<&'a Value> {
    let hit = selected(objects, ns_of(o), selector);
    ensure!(
        hit.len() == 1,
        "{} {}/{} selects the pods of {} Deployments (want exactly one): {selector}",
        o["kind"],
        ns_of(o),
        name_of(o),
        hit.len()
    );
    Ok(hit[0])
}

/// The value of a `--flag=VALUE` argument.
fn flag<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .find_map(|a| a.strip_prefix(flag)?.strip_prefix('='))
}

/// The router's drain, whole seconds (`--drain=10m`, as the router reads it).
fn drain_seconds(args: &[String]) -> Option<u64> {
    flag(args, "--drain")
        .and_then(|v| kinference_api::duration::parse_duration(v).ok())
        .map(|d| d.as_secs())
}

/// A router pod's grace period covers its preStop sleep and its drain.
fn check_drain(d: &Value) -> Result<u64> {
    let what = format!("Deployment {}/{}", ns_of(d), name_of(d));
    let drain = drain_seconds(&container_args(d))
        .with_context(|| format!("{what}: the router has no --drain"))?;
    let pod = &d["spec"]["template"]["spec"];
    let sleep = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
        .as_u64()
        .unwrap_or(0);
    let grace = pod["terminationGracePeriodSeconds"]
        .as_u64()
        .with_context(|| format!("{what}: no terminationGracePeriodSeconds"))?;
    ensure!(
        grace > sleep + drain,
        "{what}: terminationGracePeriodSeconds {grace} does not cover the preStop sleep ({sleep} s) and the drain ({drain} s): streams would be cut"
    );
    Ok(drain)
}

/// Every constraint spreads the Deployment's own pods.
fn check_spread(d: &Value) -> Result<usize> {
    let constraints = d["spec"]["template"]["spec"]["topologySpreadConstraints"]
        .as_array()
        .map_or(&[][..], Vec::as_slice);
    for c in constraints {
        ensure!(
            selects(&c["labelSelector"]["matchLabels"], pod_labels(d)),
            "Deployment {}/{}: a topology spread constraint on {} does not select its own pods",
            ns_of(d),
            name_of(d),
            c["topologyKey"]
        );
    }
    Ok(constraints.len())
}

/// What [`check`] found, for the summary line.
#[derive(Debug, Default)]
pub(super) struct Found {
    /// The longest router drain, seconds.
    pub max_drain: u64,
    /// Topology spread constraints.
    pub spread: usize,
}

/// Every check of this module over the rendered objects.
pub(super) fn check(objects: &[Value]) -> Result<Found> {
    let mut found = Found::default();
    let deployments: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "Deployment")
        .collect();
    for d in &deployments {
        found.spread += check_spread(d)?;
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "router" {
            found.max_drain = found.max_drain.max(check_drain(d)?);
        }
    }

    // Autoscalers: their Deployment exists and leaves replicas to them;
    // every other Deployment says how many replicas it wants.
    let mut autoscaled = Vec::new();
    for h in objects
        .iter()
        .filter(|o| o["kind"] == "HorizontalPodAutoscaler")
    {
        let what = format!("HorizontalPodAutoscaler {}/{}", ns_of(h), name_of(h));
        let target = &h["spec"]["scaleTargetRef"];
        ensure!(
            target["kind"] == "Deployment" && target["apiVersion"] == "apps/v1",
            "{what}: scales something other than an apps/v1 Deployment"
        );
        let name = target["name"].as_str().unwrap_or_default();
        let d = find(objects, "Deployment", ns_of(h), name)
            .with_context(|| format!("{what}: scales {name}, which the chart does not create"))?;
        ensure!(
            d["spec"]["replicas"].is_null(),
            "{what}: its Deployment also sets replicas (each apply would undo the autoscaler)"
        );
        let (min, max) = (
            h["spec"]["minReplicas"].as_u64().unwrap_or(1),
            h["spec"]["maxReplicas"].as_u64().unwrap_or(0),
        );
        ensure!(
            min >= 1 && min <= max,
            "{what}: minReplicas {min}, maxReplicas {max}"
        );
        let cpu = h["spec"]["metrics"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|m| {
                m["resource"]["name"] == "cpu" && m["resource"]["target"]["type"] == "Utilization"
            });
        ensure!(cpu, "{what}: does not scale on CPU utilization");
        ensure!(
            !d["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]
                .is_null(),
            "{what}: CPU utilization needs a CPU request on the pods"
        );
        autoscaled.push((ns_of(d), name_of(d), min));
    }
    for d in &deployments {
        let key = (ns_of(d), name_of(d));
        ensure!(
            autoscaled.iter().any(|a| (a.0, a.1) == key) || d["spec"]["replicas"].is_u64(),
            "Deployment {}/{}: neither replicas nor an autoscaler",
            key.0,
            key.1
        );
    }

    // Disruption budgets: one per Deployment that runs more than one pod
    // (at its minimum), selecting exactly that Deployment's pods.
    let mut budgeted = Vec::new();
    for p in objects
        .iter()
        .filter(|o| o["kind"] == "PodDisruptionBudget")
    {
        let d = one_selected(objects, p, &p["spec"]["selector"]["matchLabels"])?;
        let spec = &p["spec"];
        ensure!(
            spec["maxUnavailable"].is_u64() || spec["maxUnavailable"].is_string(),
            "PodDisruptionBudget {}/{}: no maxUnavailable",
            ns_of(p),
            name_of(p)
        );
        budgeted.push((ns_of(d), name_of(d)));
    }
    for d in &deployments {
        let key = (ns_of(d), name_of(d));
        let min = autoscaled
            .iter()
            .find(|a| (a.0, a.1) == key)
            .map_or_else(|| d["spec"]["replicas"].as_u64().unwrap_or(0), |a| a.2);
        if min > 1 {
            ensure!(
                budgeted.contains(&key),
                "Deployment {}/{} runs {min} pods without a PodDisruptionBudget",
                key.0,
                key.1
            );
        }
    }

    // NetworkPolicies: they select one Deployment's pods and admit traffic
    // only to ports those pods have; a router's admits its OpenAI port.
    for n in objects.iter().filter(|o| o["kind"] == "NetworkPolicy") {
        let what = format!("NetworkPolicy {}/{}", ns_of(n), name_of(n));
        let d = one_selected(objects, n, &n["spec"]["podSelector"]["matchLabels"])?;
        let container_ports: Vec<&str> = d["spec"]["template"]["spec"]["containers"][0]["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["name"].as_str())
            .collect();
        let types = &n["spec"]["policyTypes"];
        ensure!(
            types == &serde_json::json!(["Ingress"]),
            "{what}: policyTypes {types} (the chart restricts ingress only)"
        );
        let mut admitted = Vec::new();
        for rule in n["spec"]["ingress"].as_array().into_iter().flatten() {
            for port in rule["ports"].as_array().into_iter().flatten() {
                let name = port["port"].as_str().unwrap_or_default();
                ensure!(
                    container_ports.contains(&name),
                    "{what}: admits port {}, which its pods do not name",
                    port["port"]
                );
                admitted.push(name);
            }
        }
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "router" {
            ensure!(
                admitted.contains(&"http"),
                "{what}: the router's OpenAI port is not admitted"
            );
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn deployment(name: &str, replicas: Option<u64>, grace: u64, drain: u64) -> Value {
        let mut d = json!({
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": "ns",
                         "labels": {"app.kubernetes.io/component": "router"}},
            "spec": {"template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": grace,
                    "topologySpreadConstraints": [
                        {"topologyKey": "zone", "labelSelector": {"matchLabels": {"app": name}}}
                    ],
                    "containers": [{
                        "args": ["serve", format!("--drain={drain}s")],
                        "ports": [{"name": "http"}, {"name": "admin"}],
                        "lifecycle": {"preStop": {"sleep": {"seconds": 5}}},
                        "resources": {"requests": {"cpu": "1"}},
                    }],
                },
            }},
        });
        if let Some(n) = replicas {
            d["spec"]["replicas"] = json!(n);
        }
        d
    }

    fn pdb(app: &str) -> Value {
        json!({"kind": "PodDisruptionBudget", "metadata": {"name": app, "namespace": "ns"},
               "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": app}}}})
    }

    fn hpa(target: &str) -> Value {
        json!({"kind": "HorizontalPodAutoscaler", "metadata": {"name": target, "namespace": "ns"},
               "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target},
                        "minReplicas": 2, "maxReplicas": 5,
                        "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                                     "target": {"type": "Utilization", "averageUtilization": 70}}}]}})
    }

    fn netpol(app: &str, ports: &[&str]) -> Value {
        let ports: Vec<Value> = ports.iter().map(|p| json!({"port": p})).collect();
        json!({"kind": "NetworkPolicy", "metadata": {"name": app, "namespace": "ns"},
               "spec": {"podSelector": {"matchLabels": {"app": app}}, "policyTypes": ["Ingress"],
                        "ingress": [{"ports": ports}]}})
    }

    #[test]
    fn drain_as_the_router_reads_it() {
        let args = |a: &str| vec!["serve".to_owned(), a.to_owned()];
        assert_eq!(drain_seconds(&args("--drain=600s")), Some(600));
        assert_eq!(drain_seconds(&args("--drain=10m")), Some(600));
        assert_eq!(drain_seconds(&args("--drain=90")), Some(90));
        assert_eq!(drain_seconds(&args("--drain=soon")), None);
        assert_eq!(drain_seconds(&args("--drain-size=3")), None);
    }

    #[test]
    fn sound_objects_pass() {
        let objects = vec![
            deployment("a", Some(2), 616, 600),
            pdb("a"),
            deployment("b", None, 616, 600),
            hpa("b"),
            pdb("b"),
            netpol("b", &["http", "admin"]),
        ];
        let found = check(&objects).expect("sound");
        assert_eq!(found.max_drain, 600);
        assert_eq!(found.spread, 2);
    }

    #[test]
    fn mistakes_are_caught() {
        let mut wrong_spread = deployment("a", Some(1), 616, 600);
        wrong_spread["spec"]["template"]["spec"]["topologySpreadConstraints"][0]["labelSelector"]
            ["matchLabels"]["app"] = json!("other");
        let mut hpa_of_fixed = vec![deployment("a", Some(2), 616, 600), hpa("a"), pdb("a")];
        hpa_of_fixed[1]["spec"]["minReplicas"] = json!(2);
        let cases: Vec<(Vec<Value>, &str)> = vec![
            (vec![deployment("a", Some(1), 300, 600)], "does not cover"),
            (vec![wrong_spread], "own pods"),
            (
                vec![deployment("a", Some(2), 616, 600)],
                "without a PodDisruptionBudget",
            ),
            (
                vec![deployment("a", Some(1), 616, 600), pdb("nobody")],
                "0 Deployments",
            ),
            (hpa_of_fixed, "also sets replicas"),
            (vec![deployment("a", None, 616, 600)], "neither replicas"),
            (
                vec![deployment("a", None, 616, 600), hpa("a")],
                "without a PodDisruptionBudget",
            ),
            (
                vec![deployment("a", Some(1), 616, 600), netpol("a", &["admin"])],
                "OpenAI port",
            ),
            (
                vec![
                    deployment("a", Some(1), 616, 600),
                    netpol("a", &["http", "grpc"]),
                ],
                "grpc",
            ),
        ];
        for (objects, word) in cases {
            let e = check(&objects).expect_err(word);
            assert!(e.to_string().contains(word), "{word}: {e}");
        }
    }
}
