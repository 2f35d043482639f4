//! `cargo xtask`: project automation that is not shipped.
//!
//! - `cargo xtask gen-crds [--check]`: write `deploy/crds/*.yaml` from
//!   kinference-api, or check that they are up to date.
//! - `cargo xtask demo`: the README's main command.
//! - `cargo xtask bench-faults`: the reliability suite (engines that die,
//!   hang, refuse or crawl; KV-event faults audited against the engines'
//!   caches; thousands of held streams and a soak; an API-server restart;
//!   the fuzzers) on release builds, with figures.
//! - `cargo xtask chart`: check the Helm chart (lint, render, RBAC against
//!   the code) and the Dockerfiles; `gen-crds` also copies the CRDs into the
//!   chart.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

mod chart;
mod demo;
mod faults;
mod gen_crds;
mod load;
mod procs;
mod proxy_bench;

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
    /// Measure the router's added latency, CPU per request and throughput
    /// against direct calls and nginx (needs wrk and nginx).
    BenchProxy {
        /// Seconds per wrk run.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
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
    /// Check the Helm chart and the Dockerfiles (needs helm-python-sdk and
    /// hadolint from PyPI).
    Chart,
    /// The reliability suite with figures: dead, hung, refusing and slow
    /// engines; KV-event faults against the engines' caches; held streams
    /// and a soak; an API-server restart; the fuzzers (release builds).
    BenchFaults {
        /// Runs of each short scenario (figures are medians).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Streams held through the router at once in the load scenario.
        #[arg(long, default_value_t = 5000)]
        streams: usize,
        /// Length of the load soak, seconds.
        #[arg(long, default_value_t = 300)]
        soak_s: u64,
        /// Inputs of the KV-event fuzzer (the request fuzzer gets a fifth).
        #[arg(long, default_value_t = 10_000_000)]
        fuzz_inputs: u64,
        /// Only these scenarios: killed, hung, stalled, refusing, slow, kv,
        /// load, k8s, fuzz (comma-separated).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
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
        Command::Chart => chart::run(&workspace_root()),
        Command::BenchProxy { seconds } => proxy_bench::run(proxy_bench::Options { seconds }),
        Command::Demo { quick, release } => demo::run(demo::Options { quick, release }),
        Command::BenchFaults {
            runs,
            streams,
            soak_s,
            fuzz_inputs,
            only,
        } => faults::run(faults::Options {
            runs: runs.max(1),
            streams,
            soak_s,
            fuzz_inputs,
            only,
        }),
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
