//! The Dockerfiles: hadolint and structural rules.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};

use super::helm::python;
use super::{DOCKER_DIR, HADOLINT_ADVICE};

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

    fn root() -> std::path::PathBuf {
        crate::workspace_root()
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
