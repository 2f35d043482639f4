//! `cargo xtask bench`: routing quality on simulated engines, and the core
//! crates' micro-benchmarks against their goals.
//!
//! - `bench routing`: every policy of ours, our router as installed, the
//!   real peer routers (SGLang's `smg`, `vllm-router`) and a greedy router
//!   with the simulators' true state, on identical request streams over a
//!   ladder of rates, on fresh simulated engines each time, against each
//!   workload's physical floor (see [`routing`], [`contender`], [`floor`]).
//! - `bench trace`: a synthetic agent trace in the Mooncake format.
//! - `bench micro`: criterion benches of kvindex, scoring, tokenize (and the
//!   router's decision path when it has one), medians against the goals
//!   (see [`micro`]).

pub(crate) mod contender;
pub(crate) mod drive;
pub(crate) mod floor;
pub(crate) mod micro;
pub(crate) mod oracle;
pub(crate) mod report;
pub(crate) mod routing;
pub(crate) mod trace;
pub(crate) mod workload;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};

use self::workload::WorkloadKind;

/// `cargo xtask bench …`.
#[derive(Subcommand, Debug)]
pub(crate) enum BenchCommand {
    /// Routing quality: every policy and the real peer routers on identical
    /// request streams, on simulated engines, against the physical floor.
    Routing(Box<RoutingArgs>),
    /// The criterion benches of kvindex, scoring, tokenize and the router's
    /// decision path, summarised against their goals.
    Micro(MicroArgs),
    /// The reliability suite with figures: dead, hung, refusing and slow
    /// engines; KV-event faults against the engines' caches; held streams
    /// and a soak; an API-server restart; the fuzzers (release builds).
    Faults(crate::faults::Options),
    /// The router's added latency, CPU per request and throughput against
    /// direct calls and nginx (needs wrk and nginx).
    Proxy(crate::proxy_bench::Options),
    /// What naming a session (`x-session-id`) gives router replicas that
    /// did not place a conversation's earlier turns (approximate mode).
    Sessions(crate::sessions_bench::Options),
    /// Write a synthetic agent trace in the Mooncake format (JSON lines of
    /// timestamp, input_length, output_length, hash_ids), for `bench
    /// routing --trace` or a third-party replayer.
    Trace {
        /// Where to write it.
        #[arg(long)]
        out: PathBuf,
        /// Requests in the trace.
        #[arg(long, default_value_t = 4000)]
        requests: u32,
        /// Seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Tokens per hash id.
        #[arg(long, default_value_t = trace::MOONCAKE_BLOCK)]
        block: u32,
    },
    /// Rewrite the table, Markdown and plots of a `bench routing` output
    /// directory from its results.json (e.g. several merged into one).
    Report {
        /// Directories with a results.json; rows are concatenated.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        /// Where to write (default: the first directory).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

/// `bench routing` flags.
#[derive(Args, Debug)]
pub(crate) struct RoutingArgs {
    /// A few minutes: shared-prefix only, two rates, short runs.
    #[arg(long)]
    quick: bool,
    /// Request rates (req/s) for every workload, comma-separated; default:
    /// a ladder around each workload's knee.
    #[arg(long, value_delimiter = ',')]
    rates: Option<Vec<f64>>,
    /// Rates as multiples of each workload's knee, comma-separated.
    #[arg(long, value_delimiter = ',', conflicts_with = "rates")]
    loads: Option<Vec<f64>>,
    /// Policies, comma-separated (default: all, and the oracle).
    #[arg(long, value_delimiter = ',')]
    policies: Option<Vec<String>>,
    /// Workloads, comma-separated (default: all; --quick: shared-prefix).
    #[arg(long, value_delimiter = ',', value_enum)]
    workloads: Option<Vec<WorkloadKind>>,
    /// Simulated engines.
    #[arg(long, default_value_t = 8)]
    engines: usize,
    /// The slow-burst fleet's last engine's slowdown. 1 makes every engine
    /// fast: with `--engines` one fewer, that is the same burst on the
    /// fleet without its slow engine, the reference the slow engine's cost
    /// is read against.
    #[arg(long, default_value_t = workload::SLOW_BURST_SLOWDOWN)]
    burst_slowdown: f64,
    /// Token scale k: token counts ÷ k, per-token costs × k.
    #[arg(long, default_value_t = 10)]
    scale: u32,
    /// Population scale p: groups and KV capacity ÷ p (caches warm p× sooner).
    #[arg(long, default_value_t = 5)]
    population: u32,
    /// Seconds of warm-up per run (not counted).
    #[arg(long)]
    warmup: Option<f64>,
    /// Seconds of measured arrivals per run.
    #[arg(long)]
    measure: Option<f64>,
    /// Seconds to wait for the last requests after the arrivals end.
    #[arg(long, default_value_t = 30.0)]
    drain: f64,
    /// Runs per (workload, rate, policy); the table shows medians.
    #[arg(long, default_value_t = 1)]
    repeat: u32,
    /// Seed of the request streams.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Output directory (default: target/bench).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Build the simulator and router in debug mode.
    #[arg(long)]
    debug: bool,
    /// First port: engines' HTTP from here, KV events +100, replay +200,
    /// router +300 and +301.
    #[arg(long, default_value_t = 18500)]
    port_base: u16,
    /// Ask the router to explain every decision; the explanations go to
    /// OUT/logs/samples-*.jsonl (costs router CPU: for looking into results).
    #[arg(long)]
    explain: bool,
    /// The agent workload's trace, Mooncake format (JSON lines: timestamp
    /// ms, input_length, output_length, hash_ids); default: a synthetic one
    /// from --seed (see `bench trace`).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Tokens per hash id in --trace.
    #[arg(long, default_value_t = trace::MOONCAKE_BLOCK)]
    trace_block: u32,
    /// Extra fields of the tuned profile's `latency:` block, as
    /// `field=value` pairs (e.g. `toleranceMillis=150`): for trying a
    /// setting on every tuned row without editing the bench.
    #[arg(long, value_delimiter = ',')]
    tuned_latency: Vec<String>,
    /// Use the kinference-sim and kinference-router binaries in this
    /// directory instead of building them (e.g. a copy that a concurrent
    /// build cannot replace mid-run).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
}

/// `bench micro` flags.
#[derive(Args, Debug)]
pub(crate) struct MicroArgs {
    /// Criterion's --quick (shorter, noisier).
    #[arg(long)]
    quick: bool,
    /// Only summarise the results already under target/criterion.
    #[arg(long)]
    no_run: bool,
}

pub(crate) fn run(root: &Path, cmd: BenchCommand) -> Result<ExitCode> {
    match cmd {
        BenchCommand::Faults(mut o) => {
            o.runs = o.runs.max(1);
            crate::faults::run(o)
        }
        BenchCommand::Proxy(o) => crate::proxy_bench::run(o),
        BenchCommand::Sessions(o) => crate::sessions_bench::run(o),
        BenchCommand::Routing(a) => {
            let mut o = routing::RoutingOptions::defaults(root);
            o.quick = a.quick;
            if a.quick {
                o.workloads = vec![WorkloadKind::SharedPrefix];
                o.warmup = Duration::from_secs(5);
                o.measure = Duration::from_secs(12);
            }
            if let Some(w) = a.workloads {
                o.workloads = w;
            }
            o.rates = a.rates;
            o.loads = a.loads;
            if let Some(p) = a.policies {
                o.policies = p;
            }
            if a.engines == 0 {
                bail!("--engines must be at least 1");
            }
            o.engines = a.engines;
            if a.burst_slowdown.is_nan() || a.burst_slowdown < 1.0 {
                bail!("--burst-slowdown must be at least 1");
            }
            o.burst_slowdown = a.burst_slowdown;
            o.scale = a.scale.max(1);
            o.population = a.population.max(1);
            if let Some(w) = a.warmup {
                o.warmup = Duration::from_secs_f64(w.max(0.0));
            }
            if let Some(m) = a.measure {
                o.measure = Duration::from_secs_f64(m.max(1.0));
            }
            o.drain = Duration::from_secs_f64(a.drain.max(0.0));
            o.repeat = a.repeat.max(1);
            for kv in &a.tuned_latency {
                let Some((k, v)) = kv.split_once('=') else {
                    bail!("--tuned-latency takes field=value pairs, got {kv:?}");
                };
                o.tuned_latency
                    .push((k.trim().to_owned(), v.trim().to_owned()));
            }
            o.seed = a.seed;
            if let Some(out) = a.out {
                o.out = out;
            }
            o.release = !a.debug;
            o.port_base = a.port_base;
            o.explain = a.explain;
            o.trace = a.trace;
            o.trace_block = a.trace_block.max(1);
            o.bin_dir = a.bin_dir;
            routing::run(root, &o)
        }
        BenchCommand::Trace {
            out,
            requests,
            seed,
            block,
        } => {
            let shape = trace::AgentShape {
                requests,
                ..trace::AgentShape::default()
            };
            let rows = trace::synthetic(&shape, block.max(1), seed);
            trace::write(&out, &rows)?;
            let (input, new) = trace::stats(&rows, block.max(1));
            println!(
                "wrote {} requests to {} (mean input {input:.0} tokens, of which {new:.0} never seen before)",
                rows.len(),
                out.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        BenchCommand::Report { dirs, out } => {
            let mut rows = Vec::new();
            let mut meta = serde_json::Value::Null;
            for d in &dirs {
                let path = d.join("results.json");
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let v: serde_json::Value = serde_json::from_str(&text)
                    .with_context(|| format!("parsing {}", path.display()))?;
                let r: Vec<report::Row> = serde_json::from_value(v["rows"].clone())
                    .with_context(|| format!("rows of {}", path.display()))?;
                rows.extend(r);
                if meta.is_null() {
                    meta = v["meta"].clone();
                }
            }
            let out = out.unwrap_or_else(|| dirs[0].clone());
            println!("{}\n{}", report::table(&rows), report::goals(&rows));
            for f in report::write_all(&out, &meta, &rows)? {
                println!("wrote {}", f.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        BenchCommand::Micro(a) => micro::run(
            root,
            &micro::MicroOptions {
                quick: a.quick,
                no_run: a.no_run,
            },
        ),
    }
}
