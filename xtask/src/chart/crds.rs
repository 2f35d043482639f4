//! The chart's copy of the generated CRDs.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};

use super::CHART_DIR;

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
pub(super) fn yaml_files(dir: &Path) -> Result<BTreeMap<String, String>> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> std::path::PathBuf {
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
}
