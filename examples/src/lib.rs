//! kinference's examples and the environment its integration tests share.
//!
//! - `manifests/`: the seed's objects (a worker set, one with two aliases, a
//!   pool, a profile), parsed by kinference-api's tests and applied to a real
//!   API server by its cluster test.
//! - `quickstart/`: the manifests of docs/quickstart.md (vLLM engines, their
//!   worker set and pool, an HTTPRoute), checked by `cargo xtask chart`.
//! - [`cluster`]: a Kubernetes API server for tests, taken from `KUBECONFIG`.
//! - [`testing`]: what integration tests share (`eventually`, `median`,
//!   `closed_port`).

pub mod cluster;
pub mod testing;

use std::path::{Path, PathBuf};

/// The directory of the seed's example manifests.
pub fn manifests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests")
}

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("examples/ sits in the workspace root")
        .to_path_buf()
}

/// The directory of invalid objects, each refused with the message in its
/// first line (`# refused with: ...`).
pub fn invalid_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("invalid")
}

/// A YAML file of `dir`: its name and text, sorted by name.
pub fn yaml_files(dir: &Path) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .map(|p| {
            let text =
                std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (
                p.file_name()
                    .expect("a file")
                    .to_string_lossy()
                    .into_owned(),
                text,
            )
        })
        .collect();
    out.sort();
    out
}

/// An invalid object and the message it must be refused with.
#[derive(Clone, Debug)]
pub struct Invalid {
    /// File name.
    pub file: String,
    /// The YAML.
    pub text: String,
    /// A piece of the expected refusal.
    pub message: String,
}

/// Every invalid example.
pub fn invalid_examples() -> Vec<Invalid> {
    yaml_files(&invalid_dir())
        .into_iter()
        .map(|(file, text)| {
            let message = text
                .lines()
                .next()
                .and_then(|l| l.strip_prefix("# refused with: "))
                .unwrap_or_else(|| panic!("{file}: first line must be `# refused with: MESSAGE`"))
                .to_owned();
            Invalid {
                file,
                text,
                message,
            }
        })
        .collect()
}
