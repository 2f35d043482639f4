//! `cargo xtask gen-crds [--check]`.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};

/// Where the generated CRDs live, relative to the workspace root.
pub(crate) const CRD_DIR: &str = "deploy/crds";

pub(crate) fn run(root: &Path, check: bool) -> Result<ExitCode> {
    let dir = root.join(CRD_DIR);
    let files = kinference_api::crds::files().context("rendering the CRDs")?;
    let expected: Vec<String> = files.iter().map(|f| f.name.clone()).collect();

    let mut stale = Vec::new();
    for f in &files {
        let path = dir.join(&f.name);
        if crate::read_optional(&path)?.as_deref() != Some(f.content.as_str()) {
            stale.push(f);
        }
    }
    // Generated files of kinds that no longer exist are stale too.
    let mut extra = Vec::new();
    if dir.is_dir() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))?
        {
            let path = entry?.path();
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            let generated = path.extension().is_some_and(|e| e == "yaml")
                && crate::read_optional(&dir.join(&name))?
                    .is_some_and(|s| s.starts_with(kinference_api::crds::HEADER));
            if generated && !expected.contains(&name) {
                extra.push(name);
            }
        }
    }

    if check {
        if stale.is_empty() && extra.is_empty() {
            println!("{CRD_DIR}: {} CRDs up to date", files.len());
            return Ok(ExitCode::SUCCESS);
        }
        for f in &stale {
            eprintln!(
                "stale: {CRD_DIR}/{} differs from what kinference-api generates",
                f.name
            );
        }
        for name in &extra {
            eprintln!("stale: {CRD_DIR}/{name} is generated but no kind produces it any more");
        }
        eprintln!("run `cargo xtask gen-crds` and commit the result");
        return Ok(ExitCode::FAILURE);
    }

    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for f in &stale {
        let path = dir.join(&f.name);
        std::fs::write(&path, &f.content).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {CRD_DIR}/{}", f.name);
    }
    for name in &extra {
        let path = dir.join(name);
        std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        println!("removed {CRD_DIR}/{name}");
    }
    if stale.is_empty() && extra.is_empty() {
        println!("{CRD_DIR}: {} CRDs already up to date", files.len());
    }
    Ok(ExitCode::SUCCESS)
}
