//! Checks of the quickstart's manifests (`examples/quickstart/`, with the
//! chart's `deploy/helm/examples/quickstart.yaml`), run by `cargo xtask
//! chart` and its tests.
//!
//! No cluster runs here, so the manifests are checked the way far as the
//! project's own code and Kubernetes' types reach:
//!
//! - kinference's objects parse and pass their CRDs' CEL rules
//!   (`kinference_api::manifests`); the Deployment and Service deserialize
//!   as Kubernetes' own types (k8s-openapi).
//! - They agree with each other as the router reads them: the worker set's
//!   Service exists and selects the engine pods, its port names are Service
//!   ports whose target ports the containers have, the pool names the
//!   worker set, the served model is the worker set's model.
//! - vLLM's flags are the ones docs/engines.md prescribes: a
//!   `--kv-events-config` with only the keys vLLM accepts, events on over
//!   ZeroMQ, a wildcard PUB endpoint on the KV port, a replay endpoint on
//!   the port the router dials for replays (the KV port plus the chart's
//!   `kvReplayOffset`), and `--block-size` equal to `kvBlockSize`.
//! - The chart rendered with the quickstart's values runs a router for
//!   that pool, and the HTTPRoute's backend is that router's Service port.

use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kinference_api::manifests::{self, Object};
use serde_json::Value;

use crate::chart;

/// The quickstart's manifests, relative to the workspace root.
pub(crate) const QUICKSTART_DIR: &str = "examples/quickstart";
/// The chart values of the quickstart, in the chart's examples.
const VALUES_FILE: &str = "quickstart.yaml";

/// The keys vLLM's `--kv-events-config` accepts (recent releases refuse
/// others: shared/specs/kv-events.md §5.1).
const VLLM_KV_EVENTS_KEYS: [&str; 8] = [
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
];

/// Every document of the quickstart, as JSON values, with its file name.
fn documents(root: &Path) -> Result<Vec<(String, Value)>> {
    let dir = root.join(QUICKSTART_DIR);
    let mut out = Vec::new();
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    names.sort();
    for path in names
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
    {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let file = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        // The project's own loader: kinference objects against their CRDs.
        manifests::parse(&text).with_context(|| format!("{QUICKSTART_DIR}/{file}"))?;
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
            .with_context(|| format!("{QUICKSTART_DIR}/{file} is not YAML"))?;
        out.extend(
            docs.into_iter()
                .filter(|d| !d.is_null())
                .map(|d| (file.clone(), d)),
        );
    }
    ensure!(!out.is_empty(), "{QUICKSTART_DIR} has no manifests");
    Ok(out)
}

/// The one document of `kind`.
fn one<'a>(docs: &'a [(String, Value)], kind: &str) -> Result<&'a Value> {
    let found: Vec<&Value> = docs
        .iter()
        .filter(|d| d.1["kind"] == kind)
        .map(|d| &d.1)
        .collect();
    ensure!(
        found.len() == 1,
        "{QUICKSTART_DIR}: {} {kind} objects, want one",
        found.len()
    );
    Ok(found[0])
}

/// The value of `--flag=VALUE` in `args`.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .find_map(|a| a.strip_prefix(name)?.strip_prefix('='))
}

/// The port of a `tcp://HOST:PORT` endpoint whose host is a wildcard (so
/// the engine binds and the router dials in).
fn wildcard_port(endpoint: &str) -> Result<u16> {
    let rest = endpoint.strip_prefix("tcp://*:").with_context(|| {
        format!("{endpoint}: use tcp://*:PORT (the engine binds, the router dials)")
    })?;
    rest.parse().with_context(|| format!("{endpoint}: no port"))
}

/// The container port a Service port targets, as a number.
fn target_port(service: &Service, name: &str, container: &Value) -> Result<u16> {
    let port = service
        .spec
        .as_ref()
        .and_then(|s| s.ports.as_ref())
        .and_then(|ps| ps.iter().find(|p| p.name.as_deref() == Some(name)))
        .with_context(|| format!("the Service has no port named {name}"))?;
    let ports = container["ports"]
        .as_array()
        .context("the engine container has no ports")?;
    let number = match port.target_port.as_ref() {
        Some(IntOrString::String(target)) => ports
            .iter()
            .find(|p| p["name"] == target.as_str())
            .and_then(|p| p["containerPort"].as_u64())
            .with_context(|| {
                format!("Service port {name} targets {target}, which the container does not name")
            })?,
        Some(IntOrString::Int(n)) => u64::try_from(*n)?,
        None => u64::try_from(port.port)?,
    };
    ensure!(
        ports
            .iter()
            .any(|p| p["containerPort"].as_u64() == Some(number)),
        "Service port {name} targets {number}, which the container does not open"
    );
    Ok(u16::try_from(number)?)
}

/// Every check; returns a one-line summary.
pub(crate) fn check(root: &Path) -> Result<String> {
    check_docs(root, &documents(root)?)
}

/// Every check of `docs` (the quickstart's documents).
fn check_docs(root: &Path, docs: &[(String, Value)]) -> Result<String> {
    let objects: Vec<Object> = docs
        .iter()
        .filter(|d| {
            d.1["apiVersion"]
                .as_str()
                .is_some_and(|v| v.starts_with("kinference."))
        })
        .map(|d| manifests::parse(&serde_json::to_string(&d.1)?).map_err(Into::into))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect();
    let Some(ws) = objects.iter().find_map(|o| match o {
        Object::WorkerSet(w) => Some(w),
        _ => None,
    }) else {
        bail!("{QUICKSTART_DIR}: no InferenceWorkerSet");
    };
    let Some(pool) = objects.iter().find_map(|o| match o {
        Object::Pool(p) => Some(p),
        _ => None,
    }) else {
        bail!("{QUICKSTART_DIR}: no InferencePool");
    };
    let ns = ws.metadata.namespace.clone().unwrap_or_default();
    let ws_name = ws.metadata.name.clone().unwrap_or_default();
    ensure!(
        pool.metadata.namespace.as_deref() == Some(ns.as_str()),
        "the pool and the worker set are in different namespaces"
    );
    ensure!(
        pool.spec.worker_sets.iter().any(|r| r.name == ws_name),
        "the pool does not name the worker set {ws_name}"
    );

    // Kubernetes' own types.
    let deployment_doc = one(docs, "Deployment")?;
    let deployment: Deployment = serde_json::from_value(deployment_doc.clone())
        .context("the engines' Deployment is not a valid apps/v1 Deployment")?;
    let service_doc = one(docs, "Service")?;
    let service: Service = serde_json::from_value(service_doc.clone())
        .context("the engines' Service is not a valid v1 Service")?;
    ensure!(
        service.metadata.name.as_deref() == Some(ws.spec.service_ref.name.as_str())
            && service.metadata.namespace.as_deref() == Some(ns.as_str()),
        "the worker set's serviceRef {} is not the Service in {QUICKSTART_DIR}",
        ws.spec.service_ref.name
    );
    let pod_labels = &deployment_doc["spec"]["template"]["metadata"]["labels"];
    let own = deployment
        .spec
        .as_ref()
        .and_then(|s| s.selector.match_labels.as_ref())
        .context("the Deployment has no matchLabels")?;
    ensure!(
        own.iter().all(|(k, v)| pod_labels[k] == v.as_str()),
        "the Deployment's selector does not select its own pods"
    );
    let selector = service
        .spec
        .as_ref()
        .and_then(|s| s.selector.as_ref())
        .context("the Service selects nothing")?;
    ensure!(
        !selector.is_empty() && selector.iter().all(|(k, v)| pod_labels[k] == v.as_str()),
        "the Service does not select the engine pods"
    );
    ensure!(
        deployment_doc["metadata"]["namespace"] == ns.as_str(),
        "the engines run in another namespace than their worker set"
    );
    let container = &deployment_doc["spec"]["template"]["spec"]["containers"][0];
    let port_name = |p: &IntOrString| match p {
        IntOrString::String(s) => Ok(s.clone()),
        IntOrString::Int(n) => {
            bail!("use a port name, not {n}, so that the Service says what it is")
        }
    };
    let http = target_port(&service, &port_name(&ws.spec.service_ref.port)?, container)?;
    let kv_events = ws
        .spec
        .kv_events
        .as_ref()
        .context("the worker set has no kvEvents")?;
    let kv = target_port(&service, &port_name(&kv_events.port)?, container)?;

    // vLLM's flags.
    let args: Vec<String> = container["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect();
    let model = args.first().context("vllm serve without a model")?;
    let served = flag(&args, "--served-model-name").unwrap_or(model);
    ensure!(
        ws.spec.models.iter().any(|m| m.name == served),
        "the engines serve {served}, which the worker set does not list"
    );
    let port: u16 = flag(&args, "--port").context("no --port")?.parse()?;
    ensure!(
        port == http,
        "vLLM listens on {port}, the Service's http port targets {http}"
    );
    let block: u32 = flag(&args, "--block-size")
        .context("no --block-size")?
        .parse()?;
    ensure!(
        block == ws.spec.kv_block_size,
        "--block-size {block} but kvBlockSize {}: for a model with one KV-cache group they are the same",
        ws.spec.kv_block_size
    );
    let config: Value =
        serde_json::from_str(flag(&args, "--kv-events-config").context("no --kv-events-config")?)
            .context("--kv-events-config is not JSON")?;
    let config = config
        .as_object()
        .context("--kv-events-config is not a JSON object")?;
    for key in config.keys() {
        ensure!(
            VLLM_KV_EVENTS_KEYS.contains(&key.as_str()),
            "--kv-events-config has {key}, which vLLM refuses"
        );
    }
    ensure!(
        config["enable_kv_cache_events"] == true,
        "KV events are not enabled"
    );
    ensure!(config["publisher"] == "zmq", "the publisher is not zmq");
    let pub_port = wildcard_port(config["endpoint"].as_str().context("no endpoint")?)?;
    ensure!(
        pub_port == kv,
        "vLLM publishes on {pub_port}, the kvEvents port targets {kv}"
    );
    let replay = wildcard_port(
        config["replay_endpoint"]
            .as_str()
            .context("no replay_endpoint")?,
    )?;

    // The chart with the quickstart's values.
    let values = serde_saphyr::from_str::<Value>(
        &std::fs::read_to_string(root.join(chart::EXAMPLES_DIR).join(VALUES_FILE))
            .with_context(|| format!("reading {}/{VALUES_FILE}", chart::EXAMPLES_DIR))?,
    )?;
    let rendered = chart::render(root, &values)?;
    let objects = rendered
        .objects
        .map_err(|e| anyhow::anyhow!("helm template: {e}"))?;
    let pool_name = pool.metadata.name.clone().unwrap_or_default();
    let router = objects
        .iter()
        .find(|o| {
            o["kind"] == "Deployment"
                && chart::container_args(o).contains(&format!("--pool={ns}/{pool_name}"))
        })
        .with_context(|| {
            format!("the chart with {VALUES_FILE} runs no router for {ns}/{pool_name}")
        })?;
    let _ = chart::container_args(router);
    // vLLM before 0.31 does not say where it replays: the worker set must.
    let named = kv_events
        .replay_port
        .as_ref()
        .context("the worker set names no kvEvents.replayPort for vLLM's replay_endpoint")?;
    let replay_target = target_port(&service, &port_name(named)?, container)?;
    ensure!(
        replay == replay_target,
        "vLLM replays on {replay}, kvEvents.replayPort targets {replay_target}"
    );
    let route = one(docs, "HTTPRoute")?;
    ensure!(
        route["apiVersion"] == "gateway.networking.k8s.io/v1",
        "the HTTPRoute is not gateway.networking.k8s.io/v1"
    );
    ensure!(
        route["metadata"]["namespace"] == ns.as_str(),
        "the HTTPRoute is not in {ns}"
    );
    ensure!(
        route["spec"]["parentRefs"]
            .as_array()
            .is_some_and(|p| !p.is_empty()),
        "the HTTPRoute names no Gateway"
    );
    let mut backends = 0;
    for rule in route["spec"]["rules"].as_array().into_iter().flatten() {
        for b in rule["backendRefs"].as_array().into_iter().flatten() {
            let svc = objects
                .iter()
                .find(|o| {
                    o["kind"] == "Service"
                        && o["metadata"]["name"] == b["name"]
                        && o["metadata"]["namespace"] == ns.as_str()
                })
                .with_context(|| {
                    format!(
                        "the HTTPRoute's backend {} is not a Service the chart makes",
                        b["name"]
                    )
                })?;
            ensure!(
                svc["spec"]["ports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|p| p["port"] == b["port"]),
                "the HTTPRoute's backend port {} is not the router Service's",
                b["port"]
            );
            backends += 1;
        }
    }
    ensure!(backends > 0, "the HTTPRoute has no backend");
    Ok(format!(
        "{} manifests: {served} on vLLM, KV events on {kv} with replay on {replay}, blocks of {block}, routed by pool {ns}/{pool_name}",
        docs.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quickstart_manifests_agree_with_each_other_and_the_chart() {
        check(&crate::workspace_root()).unwrap_or_else(|e| panic!("{e:#}"));
    }

    /// Replaces `from` by `to` in the first document of `kind`, as text.
    fn edit(docs: &[(String, Value)], kind: &str, from: &str, to: &str) -> Vec<(String, Value)> {
        let mut docs = docs.to_vec();
        let d = docs.iter_mut().find(|d| d.1["kind"] == kind).expect("kind");
        let text = serde_json::to_string(&d.1).expect("json");
        // Inside a string (vLLM's JSON flag) the quotes are escaped.
        let (from, to) = if text.contains(from) {
            (from.to_owned(), to.to_owned())
        } else {
            (from.replace('"', "\\\""), to.replace('"', "\\\""))
        };
        assert!(text.contains(&from), "{from} is not in the {kind}");
        d.1 = serde_json::from_str(&text.replacen(&from, &to, 1)).expect("still json");
        docs
    }

    #[test]
    fn quickstart_checks_see_mistakes() {
        let root = crate::workspace_root();
        let docs = documents(&root).expect("the quickstart");
        let cases = [
            (
                "Deployment",
                "tcp://*:5558",
                "tcp://*:5559",
                "replays on 5559",
            ),
            ("Deployment", r#""topic":"""#, r#""bind":true"#, "bind"),
            (
                "Deployment",
                "--block-size=16",
                "--block-size=32",
                "kvBlockSize",
            ),
            (
                "Deployment",
                r#""publisher":"zmq""#,
                r#""publisher":"null""#,
                "zmq",
            ),
            (
                "Deployment",
                "tcp://*:5557",
                "tcp://router:5557",
                "tcp://*:PORT",
            ),
            (
                "Deployment",
                "--served-model-name=Qwen/Qwen3-8B",
                "--served-model-name=qwen",
                "does not list",
            ),
            (
                "Deployment",
                r#""containerPort":5557"#,
                r#""containerPort":"5557""#,
                "valid apps/v1",
            ),
            ("Service", r#""name":"kv-pub""#, r#""name":"kv""#, "kv-pub"),
            (
                "Service",
                r#""targetPort":"kv-pub""#,
                r#""targetPort":"kv-sub""#,
                "kv-sub",
            ),
            (
                "InferencePool",
                r#""name":"qwen3-8b""#,
                r#""name":"qwen3""#,
                "does not name",
            ),
            (
                "InferenceWorkerSet",
                r#""name":"qwen3-vllm""#,
                r#""name":"vllm""#,
                "serviceRef",
            ),
            (
                "HTTPRoute",
                r#""port":80"#,
                r#""port":8080"#,
                "backend port",
            ),
            (
                "HTTPRoute",
                r#""name":"kinference-router-chat""#,
                r#""name":"router""#,
                "not a Service",
            ),
        ];
        for (kind, from, to, word) in cases {
            let e = check_docs(&root, &edit(&docs, kind, from, to))
                .expect_err(&format!("{kind}: {from} -> {to} is caught"));
            assert!(
                format!("{e:#}").contains(word),
                "{kind} {from} -> {to}: {e:#}"
            );
        }
    }

    #[test]
    fn flags_and_endpoints_parse() {
        assert_eq!(wildcard_port("tcp://*:5557").unwrap(), 5557);
        assert!(wildcard_port("tcp://10.0.0.1:5557").is_err());
        assert!(wildcard_port("tcp://*:").is_err());
        let args = ["--port=8000".to_owned(), "--port-x=1".to_owned()];
        assert_eq!(flag(&args, "--port"), Some("8000"));
        assert_eq!(flag(&args, "--block-size"), None);
    }
}
