//! The chart's PrometheusRule and dashboard ConfigMap against
//! `deploy/observability/`.
//!
//! The alert rules and the Grafana dashboard have one source,
//! `deploy/observability/{alerts.yaml,dashboard.json}`; the chart reads
//! them with `.Files.Get` from its `files/`, which links to them (Helm
//! includes a link's target, and `helm package` packs it). The checks: what
//! `files/` holds is byte for byte what `deploy/observability/` holds, and a
//! rendering with `metrics.prometheusRule` / `metrics.dashboard` enabled
//! carries exactly those rules and that dashboard, labelled for the
//! Operator and Grafana's sidecar, in the namespace asked for; disabled,
//! neither is rendered. (The rules and queries themselves are checked by
//! `promtool` and a real Prometheus in kinference-router's
//! `tests/observability.rs`.)

use std::path::Path;

use anyhow::{Context, Result, ensure};
use serde_json::Value;

use super::rendered::{name_of, ns_of};
use super::{CHART_DIR, NAMESPACE};

/// The source files, relative to the workspace root.
pub(crate) const OBSERVABILITY_DIR: &str = "deploy/observability";
/// The alert rules.
pub(crate) const ALERTS: &str = "alerts.yaml";
/// The Grafana dashboard.
pub(crate) const DASHBOARD: &str = "dashboard.json";
/// The ConfigMap key of the dashboard.
const DASHBOARD_KEY: &str = "kinference-router.json";

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// Checks that the chart's `files/` hold the files of
/// `deploy/observability/`. Returns how many.
pub(super) fn check_files(root: &Path) -> Result<usize> {
    let names = [ALERTS, DASHBOARD];
    for name in names {
        let src = read(&root.join(OBSERVABILITY_DIR).join(name))?;
        let copy = read(&root.join(CHART_DIR).join("files").join(name))?;
        ensure!(
            src == copy,
            "{CHART_DIR}/files/{name} differs from {OBSERVABILITY_DIR}/{name}: make it a link to it (ln -sf ../../../observability/{name} {CHART_DIR}/files/{name})"
        );
    }
    Ok(names.len())
}

/// The alert rule groups of `alerts.yaml`.
fn alert_groups(root: &Path) -> Result<Value> {
    let path = root.join(OBSERVABILITY_DIR).join(ALERTS);
    let v: Value = serde_saphyr::from_str(&read(&path)?)
        .with_context(|| format!("parsing {}", path.display()))?;
    let groups = v["groups"].clone();
    ensure!(
        groups.as_array().is_some_and(|g| !g.is_empty()),
        "{OBSERVABILITY_DIR}/{ALERTS} has no rule groups"
    );
    Ok(groups)
}

/// The dashboard.
fn dashboard(root: &Path) -> Result<Value> {
    let path = root.join(OBSERVABILITY_DIR).join(DASHBOARD);
    serde_json::from_str(&read(&path)?).with_context(|| format!("parsing {}", path.display()))
}

/// Whether `labels` has every entry of the values' `wanted` map.
fn has_labels(labels: &Value, wanted: &Value) -> bool {
    wanted
        .as_object()
        .into_iter()
        .flatten()
        .all(|(k, v)| &labels[k] == v)
}

/// Checks the rendered PrometheusRule and dashboard ConfigMap against the
/// values and `deploy/observability/`. Returns (rules, dashboards) rendered.
pub(super) fn check(root: &Path, values: &Value, objects: &[Value]) -> Result<(usize, usize)> {
    let settings = &values["metrics"];
    let namespace = |s: &Value| {
        s["namespace"]
            .as_str()
            .filter(|n| !n.is_empty())
            .unwrap_or(NAMESPACE)
            .to_owned()
    };

    let rules: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "PrometheusRule")
        .collect();
    let want = &settings["prometheusRule"];
    if want["enabled"] == true {
        ensure!(
            rules.len() == 1,
            "{} PrometheusRules with metrics.prometheusRule.enabled",
            rules.len()
        );
        let r = rules[0];
        ensure!(
            r["apiVersion"] == "monitoring.coreos.com/v1",
            "PrometheusRule {}: apiVersion {}",
            name_of(r),
            r["apiVersion"]
        );
        ensure!(
            ns_of(r) == namespace(want),
            "PrometheusRule {} is in {}, not {}",
            name_of(r),
            ns_of(r),
            namespace(want)
        );
        ensure!(
            has_labels(&r["metadata"]["labels"], &want["labels"]),
            "PrometheusRule {} lacks metrics.prometheusRule.labels",
            name_of(r)
        );
        ensure!(
            r["spec"]["groups"] == alert_groups(root)?,
            "PrometheusRule {}: its groups are not those of {OBSERVABILITY_DIR}/{ALERTS}",
            name_of(r)
        );
    } else {
        ensure!(
            rules.is_empty(),
            "a PrometheusRule although metrics.prometheusRule.enabled is not true"
        );
    }

    let dashboards: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "ConfigMap" && o["metadata"]["labels"]["grafana_dashboard"] == "1")
        .collect();
    let want = &settings["dashboard"];
    if want["enabled"] == true {
        ensure!(
            dashboards.len() == 1,
            "{} ConfigMaps labelled grafana_dashboard=1 with metrics.dashboard.enabled",
            dashboards.len()
        );
        let c = dashboards[0];
        ensure!(
            ns_of(c) == namespace(want),
            "ConfigMap {} is in {}, not {}",
            name_of(c),
            ns_of(c),
            namespace(want)
        );
        let meta = &c["metadata"];
        ensure!(
            has_labels(&meta["labels"], &want["labels"])
                && has_labels(&meta["annotations"], &want["annotations"]),
            "ConfigMap {} lacks metrics.dashboard.labels or annotations",
            name_of(c)
        );
        let text = c["data"][DASHBOARD_KEY]
            .as_str()
            .with_context(|| format!("ConfigMap {} has no {DASHBOARD_KEY}", name_of(c)))?;
        let rendered: Value = serde_json::from_str(text)
            .with_context(|| format!("ConfigMap {}: {DASHBOARD_KEY} is not JSON", name_of(c)))?;
        ensure!(
            rendered == dashboard(root)?,
            "ConfigMap {}: {DASHBOARD_KEY} is not {OBSERVABILITY_DIR}/{DASHBOARD}",
            name_of(c)
        );
    } else {
        ensure!(
            dashboards.is_empty(),
            "a dashboard ConfigMap although metrics.dashboard.enabled is not true"
        );
    }
    Ok((rules.len(), dashboards.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_files_are_deploy_observability() {
        assert_eq!(
            check_files(&crate::workspace_root()).unwrap_or_else(|e| panic!("{e:#}")),
            2
        );
    }
}
