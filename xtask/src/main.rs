//! `cargo xtask`: project automation that is not shipped.
//!
//! - `cargo xtask gen-crds [--check]`: write `deploy/crds/*.yaml` from
//!   kinference-api, or check that they are up to date.
//! - `cargo xtask demo`: the README's main command.
//! - `cargo xtask chart`: check the Helm chart (schema, lint, render, RBAC
//!   against the code), the quickstart's manifests and the Dockerfiles; `gen-crds` also copies the CRDs into the
//!   chart.
//! - `cargo xtask bench routing|micro|faults|proxy|report`: routing quality
//!   of every policy on simulated engines; the core crates' micro-benchmarks
//!   against their goals; the reliability suite (engines that die, hang,
//!   refuse or crawl; KV-event faults audited against the engines' caches;
//!   thousands of held streams and a soak; an API-server restart; the
//!   fuzzers) with figures; the router's proxy overhead against nginx.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

mod bench;
mod chart;
mod demo;
mod faults;
mod fleet;
mod gen_crds;
mod gen_docs;
mod load;
mod procs;
mod proxy_bench;
mod quickstart;
mod sessions_bench;

#[derive(Parser, Debug)]
#[command(name = "cargo xtask", about = "kinference project automation")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Write the CRDs to deploy/crds/ (one file per kind).
    GenCrds {
        /// Do not write; exit non-zero when the files are stale.
        #[arg(long)]
        check: bool,
    },
    /// Write the CLI and metrics references to docs/reference/ from the code.
    GenDocs {
        /// Do not write; exit non-zero when the files are stale.
        #[arg(long)]
        check: bool,
    },
    /// Show what kinference does, end to end, on this machine: simulated
    /// engines, the router, a shared-prefix workload, ours vs round robin.
    Demo {
        /// A ~15 s run instead of ~1 minute.
        #[arg(long)]
        quick: bool,
        /// Build in release mode (slower to build, faster to run).
        #[arg(long)]
        release: bool,
    },
    /// Check the Helm chart, the quickstart's manifests and the Dockerfiles
    /// (needs helm-python-sdk and hadolint from PyPI).
    Chart,
    /// Benchmarks: routing quality (`routing`) and micro-benchmarks (`micro`).
    Bench {
        #[command(subcommand)]
        command: bench::BenchCommand,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::GenCrds { check } => gen_crds::run(&workspace_root(), check).and_then(|code| {
            // The chart ships the same CRDs.
            let chart = chart::sync_crds(&workspace_root(), check)?;
            Ok(if code == ExitCode::SUCCESS {
                chart
            } else {
                code
            })
        }),
        Command::GenDocs { check } => gen_docs::run(&workspace_root(), check),
        Command::Chart => chart::run(&workspace_root()),
        Command::Demo { quick, release } => demo::run(demo::Options { quick, release }),
        Command::Bench { command } => bench::run(&workspace_root(), command),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root: the parent of this crate's directory.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace root")
        .to_path_buf()
}

fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}
