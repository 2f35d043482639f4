//! `cargo xtask demo`: kinference end to end on this machine.
//!
//! Builds the simulator and the router, starts four simulated engines and a
//! router on `examples/local/`, drives a shared-prefix multi-turn chat
//! workload through it with kinference's policy and then (on fresh engines)
//! with round robin, and prints what each achieved. Every process it starts
//! is killed when it ends or on Ctrl-C.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::fleet::{self, Sim};
use crate::load::{self, Workload};
use crate::procs;

const ENGINES: usize = 4;
const HTTP_BASE: u16 = 18101;
const KV_BASE: u16 = 18201;
const REPLAY_BASE: u16 = 18301;
const LISTEN: &str = "127.0.0.1:18080";
const ADMIN: &str = "127.0.0.1:19090";

/// Demo options.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Options {
    /// About 15 s instead of about a minute.
    pub quick: bool,
    /// Build in release mode.
    pub release: bool,
}

pub(crate) fn run(opts: Options) -> Result<ExitCode> {
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        tokio::select! {
            r = demo(opts) => r,
            _ = tokio::signal::ctrl_c() => {
                eprintln!("\ninterrupted: stopping everything the demo started");
                Ok(ExitCode::from(130))
            }
        }
    })
}

fn workload() -> Workload {
    // 16 groups × a 3,000-token system prompt: 48k tokens of shared prefixes,
    // more than one engine's cache (2,500 blocks × 16 = 40k tokens) holds, but
    // a quarter of it fits easily: routing decides the hit rate.
    Workload {
        groups: 16,
        users_per_group: 4,
        prefix_tokens: 3000,
        question_tokens: 100,
        answer_tokens: 40,
        max_turns: 4,
        seed: 7,
    }
}

async fn demo(opts: Options) -> Result<ExitCode> {
    let root = crate::workspace_root();
    println!(
        "== kinference demo: {ENGINES} simulated vLLM engines, one router, a shared-prefix chat workload ==\n"
    );
    println!(
        "building kinference-sim and kinference-router ({})…",
        if opts.release { "release" } else { "debug" }
    );
    let bin = procs::build(
        &root,
        opts.release,
        &["kinference-sim", "kinference-router"],
    )?;
    let logs = root.join("target").join("kinference-demo");
    std::fs::create_dir_all(&logs)?;
    let per_policy = if opts.quick {
        Duration::from_secs(8)
    } else {
        Duration::from_secs(30)
    };
    let rate = 10.0;
    let w = workload();
    println!(
        "workload: {} groups × {} users, {}-token shared system prompts, {}-token turns, {}-token answers, up to {} turns; {rate} req/s for {per_policy:?} per policy\n",
        w.groups,
        w.users_per_group,
        w.prefix_tokens,
        w.question_tokens,
        w.answer_tokens,
        w.max_turns
    );
    let engines: Vec<String> = (0..ENGINES)
        .map(|i| format!("http://127.0.0.1:{}", HTTP_BASE + i as u16))
        .collect();

    let mut rows = Vec::new();
    for policy in ["kinference", "round-robin"] {
        let sim = Sim::new(ENGINES, HTTP_BASE, KV_BASE)
            .with_replay(REPLAY_BASE)
            .with_args(["--num-gpu-blocks", "2500", "--seed", "1"]);
        let sim = sim
            .start(
                &bin,
                "kinference-sim",
                &logs.join(format!("sim-{policy}.log")),
            )
            .await?;
        let router_args = fleet::serve_args(
            Path::new("examples/local"),
            "demo",
            LISTEN,
            ADMIN,
            &["--policy".to_owned(), policy.to_owned()],
        );
        let log = logs.join(format!("router-{policy}.log"));
        let mut router = fleet::start_router(&bin, "kinference-router", &router_args, &[], &log)?;
        fleet::wait_ready(ADMIN, &mut router)
            .await
            .with_context(|| format!("see {}", log.display()))?;
        fleet::wait_connected(ADMIN, ENGINES, &mut router).await?;
        println!(
            "[{policy}] router: OpenAI API http://{LISTEN}/v1  metrics http://{ADMIN}/metrics  debug http://{ADMIN}/debug/endpoints, /debug/explain"
        );

        let before = load::engine_counters(&engines).await;
        let samples = load::run(&format!("http://{LISTEN}"), "demo", &w, rate, per_policy).await;
        let after = load::engine_counters(&engines).await;
        let queries = after.queries - before.queries;
        let hit_rate = if queries > 0.0 {
            (after.hits - before.hits) / queries
        } else {
            0.0
        };
        let s = load::summarize(&samples, hit_rate, per_policy);
        println!(
            "[{policy}] {} requests, {} ok, prefix-cache hit rate {:.1}%, TTFT p50 {:.0} ms p90 {:.0} ms p99 {:.0} ms\n",
            s.requests,
            s.ok,
            s.hit_rate * 100.0,
            s.ttft_p50_ms,
            s.ttft_p90_ms,
            s.ttft_p99_ms
        );
        rows.push((policy, s));
        router.stop().await;
        sim.stop().await;
    }

    println!(
        "{:<12} {:>9} {:>7} {:>9} {:>10} {:>10} {:>10} {:>11}",
        "policy", "requests", "ok", "hit rate", "TTFT p50", "TTFT p90", "req/s", "tokens/s"
    );
    for (p, s) in &rows {
        println!(
            "{:<12} {:>9} {:>7} {:>8.1}% {:>8.0}ms {:>8.0}ms {:>10.2} {:>11.1}",
            p,
            s.requests,
            s.ok,
            s.hit_rate * 100.0,
            s.ttft_p50_ms,
            s.ttft_p90_ms,
            s.req_per_s,
            s.tokens_per_s
        );
    }
    let (ours, rr) = (&rows[0].1, &rows[1].1);
    println!(
        "\nkinference vs round robin: TTFT p90 {:.1}× lower, hit rate {:+.1} points. Logs: {}",
        rr.ttft_p90_ms / ours.ttft_p90_ms,
        (ours.hit_rate - rr.hit_rate) * 100.0,
        logs.display()
    );
    println!(
        "Run it yourself: see examples/local/README.md. Benchmarks with every policy: cargo xtask bench routing."
    );
    if ours.ok == 0 || rr.ok == 0 {
        bail!("requests failed; see the logs in {}", logs.display());
    }
    Ok(ExitCode::SUCCESS)
}
