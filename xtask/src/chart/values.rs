//! Values referenced by templates: each defined, each used.

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{Context, Result, ensure};
use serde_json::Value;

use super::CHART_DIR;
use super::helm::read_yaml;

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

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> std::path::PathBuf {
        crate::workspace_root()
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
}
