//! `cargo xtask bench faults`: the reliability suite on release builds, each
//! engine and the router in its own process, on loopback.
//!
//! Scenarios (figures are medians with min–max over `--runs` runs):
//!
//! - `killed`: an engine process killed (SIGKILL) under 9 streams: what
//!   its clients receive and when, and how many new requests still try it.
//! - `hung`: an engine that accepts connections and never answers (a bare
//!   TCP listener), router defaults: client latencies, retries, ejection.
//! - `stalled`: an engine whose core stops (HTTP up, no token), upstream
//!   timeout 10 s: 504s, cut streams, latencies.
//! - `refusing`: an engine answering 503 to everything: retries.
//! - `slow`: one engine 10× slower: its share of requests, TTFTs.
//! - `kv`: publisher restart after a 3 s outage, a gap with and without a
//!   replay socket, a stalled publisher, batches lost before the engine went
//!   idle, an event flood: the router's `/debug/kv` against the engine's
//!   `/debug/cache` block by block: stale blocks (must be 0), time to
//!   converge, coverage.
//! - `load`: `--streams` concurrent streams held through the router at once
//!   (engines stalled while they open), then rounds until `--soak-s`: errors,
//!   the router's RSS per round, in-flight accounting back to zero.
//! - `k8s`: the router in Kubernetes mode while its own API server (not the
//!   shared one) is stopped and restarted with its data: requests served
//!   meanwhile, time until a change made after the restart is routed, no
//!   duplicate endpoints.
//! - `fuzz`: the KV-event fuzzer (`--fuzz-inputs`, 10M by default) and the
//!   request-body fuzzer, release builds.
//!
//! Every process started is killed when the command ends.

// Bench code: short local names (`f` figures, `r` router, `s` engine) read
// better than long ones in these step-by-step scenarios.
#![allow(clippy::many_single_char_names)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use kinference_kvindex::{BlockKeyer, ExtraKeys, key};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::procs::{self, Proc};

#[allow(clippy::wildcard_imports)] // the scenarios share the helpers
use self::engines::*;
#[allow(clippy::wildcard_imports)] // the scenarios share the helpers
use self::fuzz::*;
#[allow(clippy::wildcard_imports)] // the scenarios share the helpers
use self::k8s::*;
#[allow(clippy::wildcard_imports)] // the scenarios share the helpers
use self::kv::*;
#[allow(clippy::wildcard_imports)] // the scenarios share the helpers
use self::load::*;
#[allow(clippy::wildcard_imports)] // the scenarios share the helpers
use self::setup::*;
#[allow(clippy::wildcard_imports)] // the scenarios share the helpers
use self::web::*;

mod engines;
mod fuzz;
mod k8s;
mod kv;
mod load;
mod setup;
mod web;

const MODEL: &str = "kinference/sim";
const BLOCK: u32 = 16;

/// Options.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Options {
    /// Runs of each short scenario (figures are medians).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Streams held through the router at once in the load scenario.
    #[arg(long, default_value_t = 5000)]
    pub streams: usize,
    /// Length of the load soak, seconds.
    #[arg(long, default_value_t = 300)]
    pub soak_s: u64,
    /// Inputs of the KV-event fuzzer (the request fuzzer gets a fifth).
    #[arg(long, default_value_t = 10_000_000)]
    pub fuzz_inputs: u64,
    /// Only these scenarios: killed, hung, stalled, refusing, slow, kv,
    /// load, k8s, fuzz (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
}

pub(crate) fn run(opts: Options) -> Result<ExitCode> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        tokio::select! {
            r = bench(opts) => r,
            _ = tokio::signal::ctrl_c() => {
                eprintln!("\ninterrupted: stopping everything the bench started");
                Ok(ExitCode::from(130))
            }
        }
    })
}

// ------------------------------------------------------------ figures

#[derive(Default)]
pub(super) struct Figures {
    pub(super) rows: BTreeMap<String, (Vec<f64>, &'static str)>,
    pub(super) notes: Vec<String>,
}

impl Figures {
    fn add(&mut self, name: impl Into<String>, value: f64, unit: &'static str) {
        self.rows
            .entry(name.into())
            .or_insert_with(|| (Vec::new(), unit))
            .0
            .push(value);
    }

    fn print(&self) -> String {
        let mut out = String::new();
        for (name, (v, unit)) in &self.rows {
            let mut s = v.clone();
            s.sort_by(f64::total_cmp);
            let med = s[s.len() / 2];
            if s.len() > 1 {
                let _ = writeln!(
                    out,
                    "{name:<72} {} {unit} ({}–{}, {} runs)",
                    fmt(med),
                    fmt(s[0]),
                    fmt(s[s.len() - 1]),
                    s.len()
                );
            } else {
                let _ = writeln!(out, "{name:<72} {} {unit}", fmt(med));
            }
        }
        for n in &self.notes {
            let _ = writeln!(out, "{n}");
        }
        out
    }
}

fn fmt(v: f64) -> String {
    if v.is_nan() {
        "n/a".into()
    } else if v.abs() >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

// -------------------------------------------------------------- main

async fn bench(opts: Options) -> Result<ExitCode> {
    let root = crate::workspace_root();
    println!("building kinference-sim and kinference-router (release)…");
    let bin = procs::build(&root, true, &["kinference-sim", "kinference-router"])?;
    let logs = root.join("target").join("kinference-faults");
    std::fs::create_dir_all(&logs)?;
    // Room for the load scenario's sockets; children inherit it.
    let (soft, hard) = rlimit::Resource::NOFILE.get()?;
    if soft < hard {
        rlimit::Resource::NOFILE.set(hard, hard)?;
    }
    let env = Env {
        root,
        bin,
        logs,
        c: client(64),
    };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "load average before: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    let want = |s: &str| opts.only.is_empty() || opts.only.iter().any(|o| o == s);
    let mut f = Figures::default();
    for run in 0..opts.runs {
        if want("killed") {
            println!("[run {run}] killed engine…");
            killed(&env, &mut f).await.context("killed")?;
        }
        if want("hung") {
            println!("[run {run}] hung engine…");
            hung(&env, &mut f).await.context("hung")?;
        }
        if want("stalled") {
            println!("[run {run}] stalled engine core…");
            stalled(&env, &mut f).await.context("stalled")?;
        }
        if want("refusing") {
            println!("[run {run}] engine answering 503…");
            refusing(&env, &mut f).await.context("refusing")?;
        }
        if want("slow") {
            println!("[run {run}] engine 10× slower…");
            slow(&env, &mut f).await.context("slow")?;
        }
        if want("kv") {
            println!("[run {run}] KV-event faults…");
            kv(&env, &mut f).await.context("kv")?;
        }
    }
    if want("load") {
        println!("load: {} streams, soak {} s…", opts.streams, opts.soak_s);
        load_soak(&env, &opts, &mut f).await.context("load")?;
    }
    if want("k8s") {
        println!("k8s: API server restart…");
        k8s(&env, &mut f).await.context("k8s")?;
    }
    if want("fuzz") {
        println!("fuzz: {} KV-event inputs…", opts.fuzz_inputs);
        fuzz(&env, &opts, &mut f).context("fuzz")?;
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    f.notes.push(format!(
        "load average after: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    ));
    let report = f.print();
    println!("\n== figures ==\n{report}");
    std::fs::write(env.logs.join("figures.txt"), &report)?;
    println!(
        "(also in {}; logs beside it)",
        env.logs.join("figures.txt").display()
    );
    let stale: f64 = f
        .rows
        .iter()
        .filter(|(k, _)| k.contains("stale blocks after recovery"))
        .flat_map(|(_, (v, _))| v.iter())
        .sum();
    if stale > 0.0 {
        bail!("the router held stale blocks after recovery");
    }
    Ok(ExitCode::SUCCESS)
}
