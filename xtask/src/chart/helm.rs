//! Rendering and linting with Helm's own code (helm-python-sdk).

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde_json::Value;

use super::crds::yaml_files;
use super::{CHART_DIR, EXAMPLES_DIR, HELM_ADVICE, KUBE_VERSION, NAMESPACE, RELEASE};

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

pub(super) fn python() -> String {
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

pub(super) fn read_yaml(path: &Path) -> Result<Value> {
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

/// Values the chart must refuse, with a word the message must contain. The
/// schema's refusals come first (Helm checks the schema before it renders),
/// then the templates' own `fail`s for what a schema cannot say.
pub(crate) fn bad_values() -> Vec<(Value, &'static str)> {
    use serde_json::json;
    let chat = |extra: Value| {
        let mut r = json!({"pool": "chat"});
        r.as_object_mut()
            .expect("an object")
            .extend(extra.as_object().expect("an object").clone());
        json!({"routers": [r]})
    };
    vec![
        // values.schema.json: wrong types, unknown keys, unknown policies.
        (json!({"router": {"replicas": "two"}}), "want integer"),
        (chat(json!({"replicas": "two"})), "/routers/0/replicas"),
        (
            json!({"router": {"policy": "kinferance"}}),
            "must be one of",
        ),
        (chat(json!({"policy": "kinferance"})), "/routers/0/policy"),
        (json!({"router": {"replica": 3}}), "'replica' not allowed"),
        (chat(json!({"polcy": "kinference"})), "'polcy' not allowed"),
        (json!({"routers": {"pool": "chat"}}), "want array"),
        (
            json!({"routers": [{"namespace": "llm"}]}),
            "missing property 'pool'",
        ),
        (json!({"routers": [{"pool": "Chat_1"}]}), "/routers/0/pool"),
        (
            json!({"controller": {"probeInterval": "30 seconds"}}),
            "probeInterval",
        ),
        (json!({"controller": {"replicas": 1.5}}), "want integer"),
        (json!({"router": {"drainSeconds": -1}}), "drainSeconds"),
        (json!({"router": {"logFormat": "text"}}), "logFormat"),
        (
            chat(json!({"networkPolicy": {"enabled": "yes"}})),
            "want boolean",
        ),
        (
            chat(json!({"autoscaling": {"enabled": true, "minReplicas": 0}})),
            "minReplicas",
        ),
        (
            json!({"router": {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone"}]}}),
            "whenUnsatisfiable",
        ),
        (
            json!({"imagePullSecret": []}),
            "'imagePullSecret' not allowed",
        ),
        (
            json!({"metrics": {"prometheusRule": {"enable": true}}}),
            "'enable' not allowed",
        ),
        (
            json!({"metrics": {"dashboard": {"enabled": "yes"}}}),
            "want boolean",
        ),
        // The templates.
        (
            json!({"routers": [{"pool": "chat"}, {"pool": "chat"}]}),
            "listed twice",
        ),
        (
            json!({"controller": {"replicas": 2, "leaderElection": {"enabled": false}}}),
            "leaderElection",
        ),
        (
            chat(json!({"autoscaling": {"enabled": true, "minReplicas": 5, "maxReplicas": 2}})),
            "above autoscaling.maxReplicas",
        ),
    ]
}

/// What Helm says before a schema refusal.
const SCHEMA_REFUSAL: &str = "values don't meet the specifications of the schema";

/// Renders each of [`bad_values`] and checks that `helm template` refuses it
/// with its word and, for the schema's refusals, that `helm lint` reports it
/// too. (Lint renders in Helm's lint mode, where a template's `fail` is only
/// logged, so the templates' own refusals reach `helm template` and
/// `helm install` alone.) Returns how many refusals there are, and how many
/// of them are the schema's.
pub(super) fn check_refusals(root: &Path) -> Result<(usize, usize)> {
    let bad = bad_values();
    let mut by_schema = 0;
    for (values, word) in &bad {
        let r = render(root, values)?;
        let Err(e) = r.objects else {
            bail!("helm template rendered values it must refuse: {values}");
        };
        ensure!(
            e.contains(word),
            "refusing {values}, the message does not say {word:?}: {e}"
        );
        if e.contains(SCHEMA_REFUSAL) {
            by_schema += 1;
            ensure!(
                r.lint_problems.iter().any(|p| p.contains(word)),
                "helm lint does not report {values} with {word:?}: {:?}",
                r.lint_problems
            );
        }
    }
    Ok((bad.len(), by_schema))
}
