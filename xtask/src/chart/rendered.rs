//! Checks of the objects Helm rendered.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{Context, Result, anyhow, ensure};
use serde_json::Value;

use super::crds::yaml_files;
use super::helm::Rendered;
use super::{Grant, NAMESPACE, READ_VERBS, RELEASE, ROUTER_WATCHES};

fn strs(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn grants(rules: &Value) -> BTreeSet<Grant> {
    let mut out = BTreeSet::new();
    for r in rules.as_array().into_iter().flatten() {
        for g in strs(&r["apiGroups"]) {
            for res in strs(&r["resources"]) {
                for verb in strs(&r["verbs"]) {
                    out.insert((g.to_owned(), res.to_owned(), verb.to_owned()));
                }
            }
        }
    }
    out
}

pub(super) fn name_of(o: &Value) -> &str {
    o["metadata"]["name"].as_str().unwrap_or_default()
}

pub(super) fn ns_of(o: &Value) -> &str {
    o["metadata"]["namespace"].as_str().unwrap_or_default()
}

pub(super) fn find<'a>(
    objects: &'a [Value],
    kind: &str,
    ns: &str,
    name: &str,
) -> Option<&'a Value> {
    objects
        .iter()
        .find(|o| o["kind"] == kind && name_of(o) == name && ns_of(o) == ns)
}

/// The grants of `kinference-controller/rbac.yaml`: (ClusterRole, Role).
pub(crate) fn controller_rbac_yaml(root: &Path) -> Result<(BTreeSet<Grant>, BTreeSet<Grant>)> {
    let path = root.join("kinference-controller/rbac.yaml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).context("parsing rbac.yaml")?;
    let of = |kind: &str| {
        docs.iter()
            .filter(|d| d["kind"] == kind)
            .flat_map(|d| grants(&d["rules"]))
            .collect::<BTreeSet<_>>()
    };
    Ok((of("ClusterRole"), of("Role")))
}

fn router_grants(namespaced: bool) -> BTreeSet<Grant> {
    ROUTER_WATCHES
        .iter()
        .filter(|w| w.3 == namespaced)
        .flat_map(|w| {
            READ_VERBS
                .iter()
                .map(|v| (w.1.to_owned(), w.2.to_owned(), (*v).to_owned()))
        })
        .collect()
}

/// The security settings every pod and container must have.
fn check_pod_security(what: &str, pod: &Value) -> Result<()> {
    let psc = &pod["securityContext"];
    ensure!(
        psc["runAsNonRoot"] == true,
        "{what}: pod securityContext.runAsNonRoot is not true"
    );
    ensure!(
        psc["runAsUser"].as_i64().is_some_and(|u| u > 0),
        "{what}: pod securityContext.runAsUser is not a non-root uid"
    );
    ensure!(
        psc["seccompProfile"]["type"] == "RuntimeDefault",
        "{what}: pod seccompProfile is not RuntimeDefault"
    );
    let containers = pod["containers"].as_array().context("no containers")?;
    for c in containers {
        let sc = &c["securityContext"];
        let cname = c["name"].as_str().unwrap_or("?");
        ensure!(
            sc["readOnlyRootFilesystem"] == true,
            "{what}/{cname}: readOnlyRootFilesystem is not true"
        );
        ensure!(
            sc["allowPrivilegeEscalation"] == false,
            "{what}/{cname}: allowPrivilegeEscalation is not false"
        );
        ensure!(
            strs(&sc["capabilities"]["drop"]).contains(&"ALL"),
            "{what}/{cname}: capabilities.drop does not contain ALL"
        );
        ensure!(
            sc["privileged"] != true,
            "{what}/{cname}: privileged container"
        );
        for res in ["cpu", "memory"] {
            ensure!(
                !c["resources"]["requests"][res].is_null(),
                "{what}/{cname}: no {res} request"
            );
        }
        let image = c["image"].as_str().unwrap_or_default();
        ensure!(
            image.contains('@') || image.rsplit('/').next().is_some_and(|l| l.contains(':')),
            "{what}/{cname}: image {image:?} has neither tag nor digest"
        );
        ensure!(
            !image.ends_with(":latest") && !image.ends_with(':'),
            "{what}/{cname}: image {image:?} is not pinned"
        );
        let admin = c["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["name"] == "admin");
        ensure!(admin, "{what}/{cname}: no port named admin");
        for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
            let get = &c[probe]["httpGet"];
            ensure!(
                get["path"] == path && get["port"] == "admin",
                "{what}/{cname}: {probe} is not GET {path} on the admin port"
            );
        }
    }
    Ok(())
}

/// A Deployment's pod spec, after checking its selector selects its pods.
fn pod_spec(d: &Value) -> Result<&Value> {
    let selector = d["spec"]["selector"]["matchLabels"]
        .as_object()
        .context("a Deployment without matchLabels")?;
    let labels = &d["spec"]["template"]["metadata"]["labels"];
    for (k, v) in selector {
        ensure!(
            &labels[k] == v,
            "Deployment {}: its selector {k}={v} does not match its pods",
            name_of(d)
        );
    }
    Ok(&d["spec"]["template"]["spec"])
}

/// The arguments of a Deployment's first container.
pub(crate) fn container_args(d: &Value) -> Vec<String> {
    strs(&d["spec"]["template"]["spec"]["containers"][0]["args"])
        .into_iter()
        .map(str::to_owned)
        .collect()
}

/// The routers a values set asks for: (namespace, pool).
fn routers_of(values: &Value) -> Vec<(String, String)> {
    values["routers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            (
                r["namespace"].as_str().unwrap_or(NAMESPACE).to_owned(),
                r["pool"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// Checks what Helm rendered with `values`. Returns a one-line summary.
#[allow(clippy::too_many_lines)]
pub(crate) fn check_rendered(root: &Path, values: &Value, r: &Rendered) -> Result<String> {
    ensure!(
        r.lint_problems.is_empty(),
        "helm lint --strict: {:?}",
        r.lint_problems
    );
    let want_crds: Vec<String> = yaml_files(&root.join(crate::gen_crds::CRD_DIR))?
        .into_keys()
        .collect();
    ensure!(
        r.crds == want_crds,
        "Helm loads the CRDs {:?}, deploy/crds has {want_crds:?}",
        r.crds
    );
    let objects = r
        .objects
        .as_ref()
        .map_err(|e| anyhow!("helm template: {e}"))?;
    for o in objects {
        ensure!(
            o["apiVersion"].is_string() && o["kind"].is_string() && !name_of(o).is_empty(),
            "an object without apiVersion, kind or name: {o}"
        );
    }
    // Every binding names a role and ServiceAccounts that are rendered.
    for b in objects
        .iter()
        .filter(|o| o["kind"] == "RoleBinding" || o["kind"] == "ClusterRoleBinding")
    {
        let role_kind = b["roleRef"]["kind"].as_str().unwrap_or_default();
        let role_ns = if role_kind == "Role" { ns_of(b) } else { "" };
        let role = b["roleRef"]["name"].as_str().unwrap_or_default();
        ensure!(
            find(objects, role_kind, role_ns, role).is_some(),
            "{} {} binds {role_kind} {role}, which the chart does not create",
            b["kind"],
            name_of(b)
        );
        for s in b["subjects"].as_array().into_iter().flatten() {
            let (ns, name) = (
                s["namespace"].as_str().unwrap_or_default(),
                s["name"].as_str().unwrap_or_default(),
            );
            ensure!(
                find(objects, "ServiceAccount", ns, name).is_some(),
                "{} {} names the ServiceAccount {ns}/{name}, which the chart does not create",
                b["kind"],
                name_of(b)
            );
        }
    }
    let deployments: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "Deployment")
        .collect();
    for d in &deployments {
        let pod = pod_spec(d)?;
        check_pod_security(&format!("Deployment {}", name_of(d)), pod)?;
        let sa = pod["serviceAccountName"].as_str().unwrap_or_default();
        ensure!(
            find(objects, "ServiceAccount", ns_of(d), sa).is_some(),
            "Deployment {} runs as ServiceAccount {sa}, which the chart does not create",
            name_of(d)
        );
    }

    // The controller: rbac.yaml's rules, leader election.
    let (cluster_rules, lease_rules) = controller_rbac_yaml(root)?;
    let controller = format!("{RELEASE}-controller");
    let controller_enabled = values["controller"]["enabled"] != false;
    let watch_ns = values["controller"]["watchNamespace"]
        .as_str()
        .filter(|s| !s.is_empty());
    if controller_enabled {
        let d = find(objects, "Deployment", NAMESPACE, &controller)
            .context("no controller Deployment")?;
        let cr =
            find(objects, "ClusterRole", "", &controller).context("no controller ClusterRole")?;
        ensure!(
            grants(&cr["rules"]) == cluster_rules,
            "the controller's ClusterRole differs from kinference-controller/rbac.yaml"
        );
        let args = container_args(d);
        let leader = !args.iter().any(|a| a == "--leader-election=false");
        let lease = find(objects, "Role", NAMESPACE, &format!("{controller}-leader"));
        if leader {
            let lease = lease.context("leader election without the Lease Role")?;
            ensure!(
                grants(&lease["rules"]) == lease_rules,
                "the controller's Lease Role differs from kinference-controller/rbac.yaml"
            );
        } else {
            ensure!(lease.is_none(), "a Lease Role without leader election");
            ensure!(
                d["spec"]["replicas"].as_i64() == Some(1),
                "several controller replicas without leader election"
            );
        }
        let env = &d["spec"]["template"]["spec"]["containers"][0]["env"];
        for (var, field) in [
            ("POD_NAMESPACE", "metadata.namespace"),
            ("POD_NAME", "metadata.name"),
        ] {
            ensure!(
                env.as_array()
                    .into_iter()
                    .flatten()
                    .any(|e| e["name"] == var && e["valueFrom"]["fieldRef"]["fieldPath"] == field),
                "the controller does not get {var} from {field}"
            );
        }
        let crb = find(objects, "ClusterRoleBinding", "", &controller);
        if let Some(ns) = watch_ns {
            ensure!(
                args.contains(&format!("--namespace={ns}")),
                "watchNamespace without --namespace"
            );
            ensure!(
                crb.is_none(),
                "watching one namespace but granted the ClusterRole cluster-wide"
            );
            let rb = find(objects, "RoleBinding", ns, &controller)
                .with_context(|| format!("no RoleBinding of the controller in {ns}"))?;
            ensure!(
                rb["roleRef"]["name"] == controller.as_str(),
                "wrong roleRef"
            );
            let profiles = find(
                objects,
                "ClusterRole",
                "",
                &format!("{controller}-profiles"),
            )
            .context("no ClusterRole for RoutingProfiles")?;
            let g = grants(&profiles["rules"]);
            ensure!(
                g.iter().all(|x| x.1 == "routingprofiles") && g.is_subset(&cluster_rules),
                "the RoutingProfiles ClusterRole grants more than reading RoutingProfiles"
            );
        } else {
            ensure!(crb.is_some(), "no ClusterRoleBinding for the controller");
        }
    } else {
        ensure!(
            find(objects, "Deployment", NAMESPACE, &controller).is_none(),
            "a controller although controller.enabled is false"
        );
    }

    // The routers: one per pool, reading only what they watch.
    let routers = routers_of(values);
    for (ns, pool) in &routers {
        let name = format!("{RELEASE}-router-{pool}");
        let d = find(objects, "Deployment", ns, &name)
            .with_context(|| format!("no router Deployment {ns}/{name}"))?;
        let args = container_args(d);
        ensure!(
            args.first().map(String::as_str) == Some("serve")
                && args.contains(&format!("--pool={ns}/{pool}"))
                && !args.iter().any(|a| a.starts_with("--manifests")),
            "router {ns}/{name}: not `serve --pool={ns}/{pool}` in Kubernetes mode: {args:?}"
        );
        let role = find(objects, "Role", ns, &name)
            .with_context(|| format!("no Role for router {ns}/{name}"))?;
        ensure!(
            grants(&role["rules"]) == router_grants(true),
            "router {ns}/{name}: its Role is not exactly the reads of its watches"
        );
        let svc = find(objects, "Service", ns, &name)
            .with_context(|| format!("no Service for router {ns}/{name}"))?;
        let pod_labels = &d["spec"]["template"]["metadata"]["labels"];
        for (k, v) in svc["spec"]["selector"].as_object().context("no selector")? {
            ensure!(
                &pod_labels[k] == v,
                "Service {ns}/{name} selects {k}={v}, which its router's pods lack"
            );
        }
        let ports = svc["spec"]["ports"].as_array().context("no ports")?;
        ensure!(
            ports.len() == 1 && ports[0]["targetPort"] == "http",
            "Service {ns}/{name} must expose the OpenAI port only (not the admin port)"
        );
        ensure!(
            name.len() <= 63,
            "the Service name {name} is longer than 63 characters"
        );
    }
    let router_deployments = deployments
        .iter()
        .filter(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "router")
        .count();
    ensure!(
        router_deployments == routers.len(),
        "{router_deployments} router Deployments for {} pools",
        routers.len()
    );
    if !routers.is_empty() {
        let cr_name = format!("{RELEASE}-router");
        let cr = find(objects, "ClusterRole", "", &cr_name).context("no router ClusterRole")?;
        ensure!(
            grants(&cr["rules"]) == router_grants(false),
            "the routers' ClusterRole is not exactly the reads of their cluster-wide watches"
        );
        let crb = find(objects, "ClusterRoleBinding", "", &cr_name)
            .context("no router ClusterRoleBinding")?;
        ensure!(
            crb["subjects"].as_array().map_or(0, Vec::len) == routers.len(),
            "the routers' ClusterRoleBinding does not name each router"
        );
    }
    let found = super::availability::check(objects)?;
    super::observability::check(root, values, objects)?;
    ensure!(!r.notes.is_empty(), "NOTES.txt renders empty");
    let kinds: BTreeMap<&str, usize> = objects.iter().fold(BTreeMap::new(), |mut m, o| {
        *m.entry(o["kind"].as_str().unwrap_or("?")).or_default() += 1;
        m
    });
    Ok(format!(
        "{} objects ({}), {} CRDs, {} spread constraints, router drain {} s",
        objects.len(),
        kinds
            .iter()
            .map(|(k, n)| format!("{n} {k}"))
            .collect::<Vec<_>>()
            .join(", "),
        r.crds.len(),
        found.spread,
        found.max_drain
    ))
}
