//! `cargo xtask bench routing`: routing quality, policies side by side.
//!
//! For each workload × rate × policy: a fresh `kinference-sim` process with
//! N engines (fresh caches), the router with that policy (or the oracle in
//! the harness), the same request plan, and the figures (see
//! [`super::report::Row`]).
//!
//! # Scaling
//!
//! Token counts ÷ k (prompts, answers, KV capacity, the step's token
//! budget), per-token costs × k (prefill per prompt token, decode per
//! sequence per step); the step's fixed cost stays. Prefill work and step
//! times are then those of the unscaled fleet; each streamed token stands
//! for k tokens, so decoding finishes k× sooner in real-token terms.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::json;

use super::contender::{Contender, Setup};
use super::drive;
use super::oracle::StepModel;
use super::report::{self, Row, Window};
use super::workload::{self, SLOW_BURST_SLOWDOWN, Scale, Workload, WorkloadKind};
use super::{floor, trace};
use crate::fleet::{EngineSpec, Manifests, Sim};
use crate::load;
use crate::procs::{self, Proc};

mod fleet;
mod measure;

pub(crate) use fleet::Fleet;
use fleet::{add_latency_fields, admin_addr, http_port, kv_port, listen_addr};
pub(crate) use measure::{JOIN_WINDOW, clock_ticks, cpu_seconds};
use measure::{join_window, kill_and_watch, loadavg, peer_bytes, received_share, slow_share};

/// The simulator's unscaled defaults (its README: fitted to vLLM on an L4),
/// and llm-d's published per-pod KV capacity.
const STEP_BASE_MS: f64 = 5.0;
const PREFILL_MS_PER_TOKEN: f64 = 0.086;
const DECODE_MS_PER_SEQ: f64 = 0.065;
const STEP_TOKEN_BUDGET: u32 = 2048;
const BLOCK_SIZE: u32 = 16;
/// llm-d's shared-prefix benchmark: 307,328 KV tokens per pod, sized so the
/// workload's 1.8M resident tokens fill 73 % of 8 pods.
const KV_TOKENS_PER_ENGINE: u32 = 307_328;
use crate::fleet::MODEL;
/// The simulator's default context length (real tokens).
const MAX_MODEL_LEN: u32 = 32_768;

/// Options of `bench routing`.
#[derive(Clone, Debug)]
pub(crate) struct RoutingOptions {
    pub workloads: Vec<WorkloadKind>,
    /// Absolute rates (req/s) for every workload; else `loads`.
    pub rates: Option<Vec<f64>>,
    /// Rates as multiples of each workload's knee; `None` = the defaults.
    pub loads: Option<Vec<f64>>,
    pub policies: Vec<String>,
    pub engines: usize,
    /// The slow-burst fleet's last engine's slowdown.
    pub burst_slowdown: f64,
    pub scale: u32,
    /// Population scale: groups and KV capacity ÷ this.
    pub population: u32,
    pub warmup: Duration,
    pub measure: Duration,
    pub drain: Duration,
    pub repeat: u32,
    pub seed: u64,
    pub out: PathBuf,
    pub release: bool,
    pub port_base: u16,
    pub quick: bool,
    /// Ask the router to explain every decision (kept in the samples).
    pub explain: bool,
    /// Use the binaries in this directory instead of building them.
    pub bin_dir: Option<PathBuf>,
    /// Extra `latency:` fields of the tuned profile (`--tuned-latency`).
    pub tuned_latency: Vec<(String, String)>,
    /// The agent workload's Mooncake-format trace (default: a synthetic one
    /// from the seed).
    pub trace: Option<PathBuf>,
    /// Tokens per hash id in that trace.
    pub trace_block: u32,
}

impl RoutingOptions {
    pub(crate) fn defaults(root: &Path) -> Self {
        Self {
            workloads: WorkloadKind::ALL.to_vec(),
            rates: None,
            loads: None,
            policies: Contender::all_names(),
            engines: 8,
            burst_slowdown: SLOW_BURST_SLOWDOWN,
            scale: 10,
            population: 5,
            warmup: Duration::from_secs(10),
            measure: Duration::from_secs(25),
            drain: Duration::from_secs(30),
            repeat: 1,
            seed: 1,
            out: root.join("target").join("bench"),
            release: true,
            port_base: 18500,
            quick: false,
            explain: false,
            bin_dir: None,
            tuned_latency: Vec::new(),
            trace: None,
            trace_block: super::trace::MOONCAKE_BLOCK,
        }
    }
}

/// The default ladder, as multiples of the knee.
fn default_loads(kind: WorkloadKind, quick: bool) -> Vec<f64> {
    match (kind, quick) {
        (WorkloadKind::SharedPrefix, false) => vec![0.25, 0.5, 0.75, 1.0, 1.5],
        (WorkloadKind::SharedPrefix, true) | (WorkloadKind::NoReuse, false) => vec![0.5, 1.0],
        // LoRA: adapter slots run short as the batches grow.
        (WorkloadKind::MultiTurn | WorkloadKind::Lora, false) => vec![0.5, 1.0, 1.5],
        (
            WorkloadKind::Heterogeneous
            | WorkloadKind::Agent
            | WorkloadKind::Bursts
            | WorkloadKind::LongContext,
            false,
        ) => vec![0.5, 0.75, 1.0],
        // Past the knee, quick or not: the ladder.
        (WorkloadKind::Overload, _) => vec![1.5, 2.0, 3.0],
        // Both tenants together at 1.5 × the knee (the heavy one alone at
        // 1.36 ×, the light one at 0.14 ×).
        (WorkloadKind::TwoTenants, _) => vec![1.5],
        // `--quick`, and the slow burst (its rate is fixed: see
        // `SLOW_BURST`).
        (WorkloadKind::SlowBurst, _) | (_, true) => vec![1.0],
    }
}

/// The slow-burst scenario: this many requests per second for one second,
/// no warm-up.
const SLOW_BURST: f64 = 150.0;

/// The two-tenant scenario's phases: 3 s of warm-up, then the light tenant
/// alone and both together, each for the run's `measure`.
fn two_tenants(measure: Duration) -> workload::TwoTenants {
    workload::TwoTenants {
        warmup: Duration::from_secs(3),
        alone: measure,
        together: measure,
    }
}

pub(crate) fn run(root: &Path, opts: &RoutingOptions) -> Result<ExitCode> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        tokio::select! {
            r = routing(root, opts) => r.map(|_| ExitCode::SUCCESS),
            _ = tokio::signal::ctrl_c() => {
                eprintln!("\ninterrupted: stopping everything the benchmark started");
                Ok(ExitCode::from(130))
            }
        }
    })
}

/// Runs the benchmark and returns its rows (also written to `opts.out`).
pub(crate) async fn routing(root: &Path, opts: &RoutingOptions) -> Result<Vec<Row>> {
    let contenders: Vec<(String, Contender)> = opts
        .policies
        .iter()
        .map(|p| Contender::parse(p).map(|c| (p.clone(), c)))
        .collect::<Result<_>>()?;
    for (_, c) in &contenders {
        c.check_available()?;
    }
    let mut fleet = Fleet::new(opts.engines, opts.scale, opts.population);
    fleet.burst_slowdown = opts.burst_slowdown;
    let bin = if let Some(dir) = &opts.bin_dir {
        dir.clone()
    } else {
        println!(
            "building kinference-sim and kinference-router ({})…",
            if opts.release { "release" } else { "debug" }
        );
        procs::build(root, opts.release, &["kinference-sim", "kinference-router"])?
    };
    std::fs::create_dir_all(&opts.out)?;
    let logs = opts.out.join("logs");
    std::fs::create_dir_all(&logs)?;
    let mut manifests = fleet.manifests(root, opts.port_base);
    add_latency_fields(&mut manifests, &opts.tuned_latency);
    let ticks = clock_ticks();
    let engines: Vec<String> = (0..opts.engines)
        .map(|i| format!("http://127.0.0.1:{}", http_port(opts.port_base, i)))
        .collect();
    let load_before = loadavg();
    println!(
        "fleet: {} simulated engines, token scale k = {} (prompts and KV ÷ {k}, per-token costs × {k}), population ÷ {} (groups and KV); step = {} ms + {:.3} ms/prompt token + {:.3} ms/decoding sequence, ≤ {} tokens; {} KV blocks of {} tokens per engine",
        fleet.engines,
        fleet.scale.k,
        fleet.population,
        fleet.step.base_ms,
        fleet.step.prefill_ms_per_token,
        fleet.step.decode_ms_per_seq,
        fleet.step.budget,
        fleet.num_gpu_blocks,
        fleet.step.block_size,
        k = fleet.scale.k,
    );
    println!(
        "prefill capacity: {:.0} real tokens/s per engine, {:.0} for the fleet; load average {load_before}",
        fleet.prefill_tokens_per_s(),
        fleet.prefill_tokens_per_s() * fleet.engines as f64
    );
    let mut meta = json!({
        "fleet": fleet,
        "unscaled": {"step_base_ms": STEP_BASE_MS, "prefill_ms_per_token": PREFILL_MS_PER_TOKEN,
                      "decode_ms_per_seq": DECODE_MS_PER_SEQ, "step_token_budget": STEP_TOKEN_BUDGET,
                      "kv_tokens_per_engine": KV_TOKENS_PER_ENGINE},
        "prefill_tokens_per_s_per_engine": fleet.prefill_tokens_per_s(),
        "warmup_s": opts.warmup.as_secs_f64(),
        "measure_s": opts.measure.as_secs_f64(),
        "drain_s": opts.drain.as_secs_f64(),
        "repeat": opts.repeat,
        "seed": opts.seed,
        "load_average_before": load_before,
        "workloads": {},
    });
    let mut rows: Vec<Row> = Vec::new();
    for &kind in &opts.workloads {
        let trace_rows = if kind == WorkloadKind::Agent {
            Some(agent_trace(opts)?)
        } else {
            None
        };
        let w = match &trace_rows {
            Some(rows) => {
                let (mean_input_tokens, mean_new_tokens) = trace::stats(rows, opts.trace_block);
                Workload::Trace {
                    requests: rows.len(),
                    mean_input_tokens,
                    mean_new_tokens,
                    output_tokens: rows.iter().map(|r| f64::from(r.output_length)).sum::<f64>()
                        / rows.len().max(1) as f64,
                }
            }
            None => fleet.workload(kind),
        };
        let knee = fleet.knee(kind, &w);
        let burst = kind == WorkloadKind::SlowBurst;
        let (warmup, measure) = if burst {
            (Duration::ZERO, Duration::from_secs(1))
        } else {
            (opts.warmup, opts.measure)
        };
        let rates: Vec<f64> = match (&opts.rates, &opts.loads) {
            _ if burst && opts.rates.is_none() => vec![SLOW_BURST],
            (Some(r), _) => r.clone(),
            (None, Some(l)) => l.iter().map(|x| x * knee).collect(),
            (None, None) => default_loads(kind, opts.quick)
                .iter()
                .map(|x| x * knee)
                .collect(),
        };
        meta["workloads"][kind.name()] = json!({
            "shape_real_tokens": w,
            "knee_req_per_s": knee,
            "knee_with_reuse_req_per_s": fleet.knee_with_reuse(kind, &w),
            "slowdowns": fleet.slowdowns(kind),
            "resident_tokens_real": w.resident_tokens(),
            "resident_fraction_of_fleet_kv": w.resident_tokens() / (fleet.kv_tokens_per_engine() * opts.engines as f64),
            "rates": rates,
        });
        let with_reuse = fleet.knee_with_reuse(kind, &w);
        println!(
            "\n== {}: knee {knee:.2} req/s (prefill-bound with no reuse: {:.0} prompt tokens each); with perfect reuse {}; resident set {:.0}% of the fleet's KV; rates {}",
            kind.name(),
            w.mean_prompt_tokens(),
            if with_reuse > 20.0 * knee {
                "prefill is not the limit".to_owned()
            } else {
                format!("{with_reuse:.1} req/s")
            },
            100.0 * w.resident_tokens() / (fleet.kv_tokens_per_engine() * opts.engines as f64),
            rates
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for &rate in &rates {
            let plan = match &trace_rows {
                Some(rows) => {
                    trace::plan(rows, opts.trace_block, fleet.scale, rate, warmup, measure)
                }
                None if kind == WorkloadKind::TwoTenants => {
                    two_tenants(measure).plan(&w, fleet.scale, rate, opts.seed)
                }
                None => workload::plan(&w, fleet.scale, rate, warmup, measure, opts.seed),
            };
            let floor_all = floor::ttfts(&plan, &fleet.step);
            let mut floor_ms: Vec<f64> = plan
                .arrivals
                .iter()
                .zip(&floor_all)
                .filter(|(a, _)| a.at >= plan.warmup)
                .map(|(_, f)| *f)
                .collect();
            floor_ms.sort_by(f64::total_cmp);
            let floor = (
                report::percentile(&floor_ms, 0.5),
                report::percentile(&floor_ms, 0.9),
                report::percentile(&floor_ms, 0.99),
            );
            println!(
                "  {rate:.2} req/s: physical floor TTFT p50 {:.0} p90 {:.0} p99 {:.0} ms",
                floor.0, floor.1, floor.2
            );
            for repeat in 0..opts.repeat {
                for (policy, contender) in &contenders {
                    let tag = format!("{}-{rate:.2}-{policy}-{repeat}", kind.name());
                    let mut row = one_run(
                        &bin,
                        &fleet,
                        opts,
                        &engines,
                        &manifests,
                        kind,
                        &plan,
                        (policy, contender),
                        ticks,
                        &tag,
                        (kind.name(), rate, rate / knee, repeat),
                    )
                    .await
                    .with_context(|| format!("run {tag}; logs in {}", logs.display()))?;
                    (row.floor_p50_ms, row.floor_p90_ms, row.floor_p99_ms) = floor;
                    println!(
                        "  {:<20} {rate:>6.2} req/s  reqs {:>4} ok {:>4} good {:>4}{}  hit {:>5.1}%  TTFT p50 {:>7.0} p90 {:>7.0} p99 {:>7.0} ms  ITL {:>5.1} ms  {:>6.2} req/s  CPU {:>5.0} µs/req  [load {}]",
                        policy,
                        row.requests,
                        row.ok,
                        row.good,
                        match (row.slow_share.is_nan(), row.turns_kept.is_nan()) {
                            (false, _) => format!("  slow engine {:.1}%", row.slow_share * 100.0),
                            (true, false) => format!("  turns kept {:.1}%", row.turns_kept * 100.0),
                            (true, true) => String::new(),
                        },
                        row.hit_rate * 100.0,
                        row.ttft_p50_ms,
                        row.ttft_p90_ms,
                        row.ttft_p99_ms,
                        row.itl_p50_ms,
                        row.req_per_s,
                        row.router_cpu_us_per_req,
                        loadavg()
                    );
                    if let Some(t) = &row.tenants {
                        println!("  {:<20} {t}", "");
                    }
                    if let Some(l) = &row.lora {
                        println!("  {:<20} {l}", "");
                    }
                    if !row.join_ready_ms.is_nan() {
                        println!(
                            "  {:<20} late replica ready {:.0} ms after its start ({}); its first {} s: {} requests, hit {:.1}% vs its peers' {:.1}% ({:.2}×), TTFT p90 {:.0} vs {:.0} ms",
                            "",
                            row.join_ready_ms,
                            if row.join_bootstrap.is_empty() {
                                "no bootstrap"
                            } else {
                                &row.join_bootstrap
                            },
                            JOIN_WINDOW.as_secs(),
                            row.join_requests,
                            row.join_hit_rate * 100.0,
                            row.join_peers_hit_rate * 100.0,
                            row.join_hit_rate / row.join_peers_hit_rate,
                            row.join_ttft_p90_ms,
                            row.join_peers_ttft_p90_ms
                        );
                    }
                    if !row.peer_bytes_per_req.is_nan() {
                        println!(
                            "  {:<20} between replicas: {:.0} B of load polls per request, {:.0} B of snapshots",
                            "", row.peer_bytes_per_req, row.snapshot_bytes
                        );
                    }
                    if !row.absorb_ms.is_nan() || row.lost + row.cut > 0 {
                        println!(
                            "  {:<20} lost (no first token) {}, cut mid-stream {}, killed replica's load out of its peers' view after {:.0} ms",
                            "", row.lost, row.cut, row.absorb_ms
                        );
                    }
                    rows.push(row);
                    meta["load_average_after"] = json!(loadavg());
                    report::write_all(&opts.out, &meta, &rows)?;
                }
                check_fingerprints(&rows, kind.name(), rate);
            }
        }
    }
    println!("{}\n{}", report::table(&rows), report::goals(&rows));
    let files = report::write_all(&opts.out, &meta, &rows)?;
    println!(
        "load average before {load_before}, after {}; wrote {}",
        loadavg(),
        files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(rows)
}

/// Warns when policies did not replay identical streams.
fn check_fingerprints(rows: &[Row], workload: &str, rate: f64) {
    let prints: Vec<(&str, &str)> = rows
        .iter()
        .filter(|r| r.workload == workload && (r.rate - rate).abs() < 1e-9)
        .map(|r| (r.policy.as_str(), r.fingerprint.as_str()))
        .collect();
    if let Some((_, first)) = prints.first()
        && prints.iter().any(|(_, f)| f != first)
    {
        println!("  warning: request streams differ across policies: {prints:?}");
    }
}

/// The agent workload's trace: the user's file, or a synthetic one.
fn agent_trace(opts: &RoutingOptions) -> Result<Vec<trace::TraceRow>> {
    match &opts.trace {
        Some(path) => trace::read(path, opts.trace_block),
        None => Ok(trace::synthetic(
            &trace::AgentShape::default(),
            opts.trace_block,
            opts.seed,
        )),
    }
}

#[allow(clippy::too_many_arguments)]
async fn one_run(
    bin: &Path,
    fleet: &Fleet,
    opts: &RoutingOptions,
    engines: &[String],
    manifests: &Manifests,
    kind: WorkloadKind,
    plan: &workload::Plan,
    (policy, contender): (&str, &Contender),
    ticks: f64,
    tag: &str,
    key: (&str, f64, f64, u32),
) -> Result<Row> {
    let logs = opts.out.join("logs");
    let join = contender.has_late_replica();
    let mut sims = Vec::new();
    for (i, mut s) in fleet.sims(kind, opts.port_base).into_iter().enumerate() {
        if join {
            // Each response says how many of its tokens were cached.
            s = s.with_args(["--enable-prompt-tokens-details"]);
        }
        sims.push(
            s.start(
                bin,
                "kinference-sim",
                &logs.join(format!("sim{i}-{tag}.log")),
            )
            .await?,
        );
    }
    let setup = Setup {
        bin,
        engines,
        kv_base: kv_port(opts.port_base, 0),
        tuned: manifests,
        out: &opts.out,
        listen: listen_addr(opts.port_base),
        admin: admin_addr(opts.port_base),
        step: fleet.step,
        explain: opts.explain,
        tag,
    };
    let mut running = contender.start(&setup).await?;
    let pids: Vec<u32> = running
        .proc
        .iter()
        .chain(&running.more)
        .filter_map(Proc::pid)
        .collect();
    // A kill row: its last replica dies halfway through the measured window.
    let killer = match contender {
        Contender::Replicas { kill: true, .. } => running.more.pop().map(|victim| {
            let survivors = running.admins[..running.admins.len() - 1].to_vec();
            let at = plan.warmup + plan.measure / 2;
            tokio::spawn(kill_and_watch(victim, survivors, at))
        }),
        _ => None,
    };
    // A join row: its last replica starts halfway through the measured
    // window (timed from here, the start of the drive to a few µs).
    let joining = running.joiner.take().map(|j| {
        let replicas = match &running.route {
            drive::Route::Routers(r) => Some(r.clone()),
            _ => None,
        };
        let at = plan.warmup + plan.measure / 2;
        let t0 = tokio::time::Instant::now();
        tokio::spawn(async move {
            tokio::time::sleep(at).await;
            let started = t0.elapsed();
            let proc = j.start().await?;
            let ready = t0.elapsed();
            if let Some(r) = &replicas {
                r.mark_up(j.index);
            }
            anyhow::Ok(Joined {
                proc,
                admin: j.admin,
                index: j.index,
                started,
                ready,
            })
        })
    });
    let admins = running.admins.clone();
    // Every replica's CPU together.
    let cpu = |pids: &[u32]| -> Option<f64> {
        pids.iter()
            .map(|p| cpu_seconds(*p, ticks))
            .sum::<Option<f64>>()
            .filter(|_| !pids.is_empty())
    };
    let (samples, (counters_before, cpu_before, peer_bytes_before)) =
        drive::drive(plan, &running.route, MODEL, opts.drain, || async {
            (
                load::engine_counters(engines).await,
                cpu(&pids),
                peer_bytes(&admins).await,
            )
        })
        .await;
    let counters_after = load::engine_counters(engines).await;
    let peer_bytes_after = peer_bytes(&admins).await;
    let joined = match joining {
        Some(t) => Some(t.await.context("the late replica's task")??),
        None => None,
    };
    let mut bootstrap = serde_json::Value::Null;
    if let Some(j) = &joined
        && let Ok((200, body)) = load::get(&format!("http://{}/debug/endpoints", j.admin)).await
    {
        bootstrap = serde_json::from_slice::<serde_json::Value>(&body)
            .map(|v| v["kv_bootstrap"].clone())
            .unwrap_or_default();
    }
    let mut absorbed = None;
    if let Some(k) = killer
        && let Ok((victim, a)) = k.await
    {
        absorbed = a;
        running.more.push(victim);
    }
    // Every request's outcome, one JSON object a line, for analysis.
    let lines: Vec<String> = samples
        .iter()
        .filter_map(|s| serde_json::to_string(s).ok())
        .collect();
    let _ = std::fs::write(logs.join(format!("samples-{tag}.jsonl")), lines.join("\n"));
    let cpu_after = cpu(&pids);
    // Our routers' view of the engines at the end (calibration, learnt step
    // costs), for looking into a row afterwards; the step costs go in the
    // row.
    let mut step_costs = Vec::new();
    for (i, admin) in running.admins.iter().enumerate() {
        if let Ok((200, body)) = load::get(&format!("http://{admin}/debug/endpoints")).await {
            step_costs.extend(report::StepCosts::of_endpoints(body.as_ref()));
            let _ = std::fs::write(logs.join(format!("endpoints-{tag}-{i}.json")), &body);
        }
    }
    if policy == "kinference"
        && let Some(admin) = running.admins.first()
    {
        // Keep the last decisions for looking into predictions afterwards.
        if let Ok((200, body)) = load::get(&format!("http://{admin}/debug/explain")).await {
            let _ = std::fs::write(logs.join(format!("explain-{tag}.json")), &body);
        }
    }
    if let Some(r) = running.proc {
        r.stop().await;
    }
    for r in running.more {
        r.stop().await;
    }
    let joined = joined.map(|j| {
        let figures = (j.index, j.started, j.ready);
        (j.proc, figures)
    });
    let joined = match joined {
        Some((p, figures)) => {
            p.stop().await;
            Some(figures)
        }
        None => None,
    };
    for s in sims {
        s.stop().await;
    }
    let queries = counters_after.queries - counters_before.queries;
    let window = Window {
        hit_rate: if queries > 0.0 {
            (counters_after.hits - counters_before.hits) / queries
        } else {
            0.0
        },
        router_cpu_s: cpu_before.zip(cpu_after).map(|(b, a)| a - b),
    };
    let (workload, rate, load, repeat) = key;
    let mut row = report::summarize(
        &samples,
        window,
        plan.measure.as_secs_f64(),
        (workload, rate, load, policy, repeat),
    );
    row.slow_share = slow_share(&samples, &fleet.slowdowns(kind), opts.port_base);
    if row.slow_share.is_nan() {
        // A router that does not name engines (the real peers): what the
        // engines say they received in the measured window.
        row.slow_share = received_share(
            &counters_before.received,
            &counters_after.received,
            &fleet.slowdowns(kind),
        );
    }
    if kind == WorkloadKind::Lora {
        row.lora = Some(report::LoraFigures::of(&samples));
    }
    if kind == WorkloadKind::TwoTenants {
        use workload::TwoTenants;
        row.tenants = Some(report::TenantFigures {
            light_alone: report::Share::of(&samples, TwoTenants::LIGHT_ALONE),
            light_with_heavy: report::Share::of(&samples, TwoTenants::LIGHT_WITH),
            heavy: report::Share::of(&samples, TwoTenants::HEAVY_LABEL),
        });
    }
    row.absorb_ms = absorbed.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3);
    row.step_costs = step_costs;
    // Bytes between replicas: every replica counts what it received (a
    // killed one's are lost with it, so a kill row has none).
    if !matches!(contender, Contender::Replicas { kill: true, .. }) && !admins.is_empty() {
        let load = peer_bytes_after.0 - peer_bytes_before.0;
        row.peer_bytes_per_req = load / row.requests.max(1) as f64;
        row.snapshot_bytes = peer_bytes_after.1 - peer_bytes_before.1;
    }
    if let Some((index, started, ready)) = joined {
        let w = join_window(&samples, index, ready, JOIN_WINDOW);
        row.join_ready_ms = ready.saturating_sub(started).as_secs_f64() * 1e3;
        row.join_hit_rate = w.hit_rate;
        row.join_peers_hit_rate = w.peers_hit_rate;
        row.join_requests = w.requests;
        row.join_ttft_p90_ms = w.ttft_p90_ms;
        row.join_peers_ttft_p90_ms = w.peers_ttft_p90_ms;
        bootstrap["state"]
            .as_str()
            .unwrap_or("")
            .clone_into(&mut row.join_bootstrap);
    }
    Ok(row)
}

/// A late replica in a join row.
struct Joined {
    proc: Proc,
    admin: String,
    index: usize,
    /// When it was started, and when it was ready, from the start of the
    /// drive.
    started: Duration,
    ready: Duration,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoke_two_engines_two_policies() {
        let root = crate::workspace_root();
        // This test's target dir is locked by the cargo that runs it: build
        // the binaries into a directory of their own next to it.
        let exe = std::env::current_exe().expect("test binary path");
        let target = exe
            .ancestors()
            .nth(3)
            .expect("target/debug/deps/xtask-… lives three levels down")
            .join("xtask-smoke");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = std::process::Command::new(cargo)
            .current_dir(&root)
            .env("CARGO_TARGET_DIR", &target)
            .args([
                "build",
                "--quiet",
                "-p",
                "kinference-sim",
                "-p",
                "kinference-router",
            ])
            .status()
            .expect("runs cargo");
        assert!(
            status.success(),
            "building kinference-sim and kinference-router failed"
        );
        let out = tempfile::tempdir().expect("tempdir");
        let opts = RoutingOptions {
            workloads: vec![WorkloadKind::SharedPrefix],
            loads: Some(vec![0.5]),
            policies: vec!["kinference".into(), "greedy-truth".into()],
            engines: 2,
            warmup: Duration::from_secs(1),
            measure: Duration::from_secs(4),
            drain: Duration::from_secs(30),
            out: out.path().to_path_buf(),
            release: false,
            port_base: 18900,
            bin_dir: Some(target.join("debug")),
            ..RoutingOptions::defaults(&root)
        };
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        let rows = rt
            .block_on(routing(&root, &opts))
            .expect("the benchmark runs");
        assert_eq!(rows.len(), 2);
        for r in &rows {
            assert!(r.requests > 0 && r.ok == r.requests, "{r:?}");
            assert!(r.ttft_p90_ms > 0.0 && r.ttft_p90_ms.is_finite(), "{r:?}");
            assert!((0.0..=1.0).contains(&r.hit_rate), "{r:?}");
        }
        assert!(rows[0].router_cpu_us_per_req > 0.0, "{:?}", rows[0]);
        assert!(rows[1].router_cpu_us_per_req.is_nan());
        assert_eq!(
            rows[0].fingerprint, rows[1].fingerprint,
            "identical streams"
        );
        let csv = std::fs::read_to_string(out.path().join("results.csv")).expect("csv written");
        assert_eq!(csv.lines().count(), 3);
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.path().join("results.json")).expect("json written"),
        )
        .expect("json parses");
        assert_eq!(json["rows"].as_array().map(Vec::len), Some(2));
        let back: Vec<Row> = serde_json::from_value(json["rows"].clone()).expect("rows parse");
        assert_eq!(back[1].policy, "greedy-truth");
        assert!(back[0].floor_p90_ms > 0.0 && back[0].ttft_p90_ms >= back[0].floor_p90_ms);
        assert!(
            json["meta"]["workloads"]["shared-prefix"]["knee_req_per_s"]
                .as_f64()
                .is_some_and(|k| k > 0.0)
        );
        for f in ["shared-prefix-ttft-p90.svg", "shared-prefix-hit-rate.svg"] {
            let svg = std::fs::read_to_string(out.path().join(f)).expect("plot written");
            assert!(
                svg.starts_with("<svg") && svg.contains("greedy-truth"),
                "{f}"
            );
        }
        let samples = std::fs::read_dir(out.path().join("logs"))
            .expect("logs")
            .filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("samples-"))
            })
            .count();
        assert_eq!(samples, 2);
    }
}
