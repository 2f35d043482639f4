//! `values.schema.json` against `values.yaml` and the router's code.
//!
//! Helm validates the merged values against the schema on every install,
//! upgrade, `template` and `lint`, so the schema is what refuses a typo. It
//! is only as good as its agreement with `values.yaml`: every key there must
//! be described, every described key must exist there, and every object with
//! listed properties must refuse others (`additionalProperties: false`).
//! Each entry of `routers` takes the same keys as `router` (by `$ref` to the
//! same definitions) plus `pool` and `namespace`. The policies the schema
//! allows are exactly the router's ([`PolicyName::ALL`]).

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};
use kinference_scoring::policies::PolicyName;
use serde_json::Value;

use super::CHART_DIR;
use super::helm::read_yaml;

/// The schema file, relative to the chart.
pub(super) const SCHEMA_FILE: &str = "values.schema.json";

/// Keys of a `routers` entry that `router` does not have.
const ROUTER_ENTRY_ONLY: [&str; 2] = ["pool", "namespace"];

/// Reads the chart's schema.
pub(super) fn read_schema(root: &Path) -> Result<Value> {
    let path = root.join(CHART_DIR).join(SCHEMA_FILE);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Follows a local `$ref` (`#/a/b`) once, or returns `node`.
fn resolve<'a>(schema: &'a Value, node: &'a Value) -> Result<&'a Value> {
    match node.get("$ref").and_then(Value::as_str) {
        None => Ok(node),
        Some(r) => {
            let pointer = r
                .strip_prefix('#')
                .with_context(|| format!("{r}: only local references are used"))?;
            schema
                .pointer(pointer)
                .with_context(|| format!("{r} points at nothing"))
        }
    }
}

/// Walks `values` and the schema node that describes it together.
fn walk(
    schema: &Value,
    node: &Value,
    values: &Value,
    path: &str,
    described: &mut usize,
) -> Result<()> {
    let node = resolve(schema, node)?;
    let Some(props) = node.get("properties").and_then(Value::as_object) else {
        // A free-form map or list the user fills in (labels, affinity, ...),
        // or a scalar: nothing below it to compare.
        return Ok(());
    };
    let at = if path.is_empty() {
        "the top level"
    } else {
        path
    };
    ensure!(
        node["additionalProperties"] == false,
        "{SCHEMA_FILE}: {at} lists properties but allows others (additionalProperties: false is missing)"
    );
    let Some(map) = values.as_object() else {
        bail!("{SCHEMA_FILE} describes {at} as an object; values.yaml has {values}");
    };
    for key in map.keys() {
        ensure!(
            props.contains_key(key),
            "values.yaml has {path}.{key}, which {SCHEMA_FILE} does not describe (Helm would refuse it)"
        );
    }
    for (key, sub) in props {
        let child = if path.is_empty() {
            key.clone()
        } else {
            format!("{path}.{key}")
        };
        // Helm's `global` and the routers' list (empty by default) have no
        // counterpart in values.yaml's defaults.
        if child == "global" {
            continue;
        }
        let value = map.get(key).with_context(|| {
            format!("{SCHEMA_FILE} describes {child}, which values.yaml does not define")
        })?;
        *described += 1;
        walk(schema, sub, value, &child, described)?;
    }
    Ok(())
}

/// The routers' entries take `router`'s keys, by reference, plus their own.
fn check_router_entries(schema: &Value) -> Result<()> {
    let router = resolve(schema, &schema["properties"]["router"])?;
    let router_keys: BTreeSet<&str> = router["properties"]
        .as_object()
        .context("router has no properties")?
        .keys()
        .map(String::as_str)
        .collect();
    let entry = &schema["properties"]["routers"]["items"];
    ensure!(
        entry["additionalProperties"] == false,
        "{SCHEMA_FILE}: routers[] entries allow unknown keys"
    );
    ensure!(
        entry["required"] == serde_json::json!(["pool"]),
        "{SCHEMA_FILE}: routers[] entries must require pool (only pool)"
    );
    let entry_props = entry["properties"]
        .as_object()
        .context("routers[] entries have no properties")?;
    let entry_keys: BTreeSet<&str> = entry_props.keys().map(String::as_str).collect();
    let want: BTreeSet<&str> = router_keys
        .iter()
        .copied()
        .chain(ROUTER_ENTRY_ONLY)
        .collect();
    ensure!(
        entry_keys == want,
        "{SCHEMA_FILE}: routers[] entries take {entry_keys:?}, want router's keys plus pool and namespace: {want:?}"
    );
    for key in router_keys {
        let want_ref = format!("#/definitions/routerSettings/properties/{key}");
        ensure!(
            entry_props[key]["$ref"] == want_ref.as_str(),
            "{SCHEMA_FILE}: routers[].{key} must be {{\"$ref\": \"{want_ref}\"}} so it stays router.{key}'s schema"
        );
    }
    ensure!(
        router.get("$ref").is_none() && schema["properties"]["router"]["$ref"].is_string(),
        "{SCHEMA_FILE}: router must be a $ref to definitions/routerSettings"
    );
    Ok(())
}

/// The policy names the schema allows.
pub(super) fn schema_policies(schema: &Value) -> Result<Vec<String>> {
    Ok(schema
        .pointer("/definitions/routerSettings/properties/policy/enum")
        .and_then(Value::as_array)
        .context("no enum of policies in definitions.routerSettings.properties.policy")?
        .iter()
        .filter_map(Value::as_str)
        .map(str::to_owned)
        .collect())
}

/// Every check of the schema. Returns how many keys it describes.
pub(super) fn check_schema(root: &Path) -> Result<usize> {
    let schema = read_schema(root)?;
    let values = read_yaml(&root.join(CHART_DIR).join("values.yaml"))?;
    let mut described = 0;
    walk(&schema, &schema, &values, "", &mut described)?;
    check_router_entries(&schema)?;
    let allowed = schema_policies(&schema)?;
    let known: Vec<String> = PolicyName::ALL
        .iter()
        .map(|p| p.as_str().to_owned())
        .collect();
    ensure!(
        allowed == known,
        "{SCHEMA_FILE} allows the policies {allowed:?}; the router knows {known:?}"
    );
    Ok(described)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> std::path::PathBuf {
        crate::workspace_root()
    }

    #[test]
    fn schema_describes_exactly_the_values() {
        let n = check_schema(&root()).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(n > 80, "only {n} keys described: is the walk broken?");
    }

    #[test]
    fn schema_walk_sees_drift() {
        let schema = serde_json::json!({
            "type": "object", "additionalProperties": false,
            "properties": {
                "a": {"$ref": "#/definitions/a"},
                "free": {"type": "object"},
            },
            "definitions": {"a": {"type": "object", "additionalProperties": false,
                            "properties": {"b": {"type": "integer"}}}},
        });
        let mut n = 0;
        let good = serde_json::json!({"a": {"b": 1}, "free": {"x": 1}});
        walk(&schema, &schema, &good, "", &mut n).expect("in step");
        assert_eq!(n, 3);
        let cases = [
            (
                serde_json::json!({"a": {"b": 1, "c": 2}, "free": {}}),
                "a.c",
            ),
            (serde_json::json!({"a": {}, "free": {}}), "a.b"),
            (serde_json::json!({"a": {"b": 1}}), "free"),
            (serde_json::json!({"a": 3, "free": {}}), "object"),
        ];
        for (values, word) in cases {
            let e = walk(&schema, &schema, &values, "", &mut n).expect_err(word);
            assert!(e.to_string().contains(word), "{word}: {e}");
        }
        let mut open = schema.clone();
        open["definitions"]["a"]["additionalProperties"] = Value::Bool(true);
        let e = walk(&open, &open, &good, "", &mut n).expect_err("open object");
        assert!(e.to_string().contains("additionalProperties"), "{e}");
    }

    #[test]
    fn router_entries_must_follow_router() {
        let mut schema = read_schema(&root()).expect("schema");
        check_router_entries(&schema).expect("the real schema passes");
        schema["properties"]["routers"]["items"]["properties"]["replicas"] =
            serde_json::json!({"type": "string"});
        let e = check_router_entries(&schema).expect_err("a drifted entry key");
        assert!(e.to_string().contains("replicas"), "{e}");
    }
}
