//! `cargo xtask bench sessions`: what naming a session gives router
//! replicas that did not place a conversation's earlier turns.
//!
//! Four simulated engines (the simulator's default vLLM 0.33 mode, which
//! publishes `session_id` on its stores; `--enable-prompt-tokens-details`), three router replicas
//! with an `approximate` profile and no `--peers`, so no replica hears of
//! another's placements (as with turns further apart than the peers'
//! record horizon). Conversations of several turns (a 400-word system
//! prompt, a 20-word user turn, an 8-token answer each) are sent one
//! request at a time, in a shuffled order per turn, each request to a
//! replica drawn at random (as a Service spreads connections). Run twice on
//! fresh engines and routers, the same draws: without a session, then with
//! `x-session-id` per conversation. Figures for turns 2 onwards: how many
//! went to the engine of the turn before, and the share of prompt tokens
//! the engines report cached.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kinference_scoring::{SplitMix64, below};
use serde_json::{Value, json};

use crate::fleet::{self, Manifests, Sim};
use crate::procs;

const ENGINES: usize = 4;
const REPLICAS: usize = 3;
const HTTP_BASE: u16 = 28701;
const KV_BASE: u16 = 28801;
const ROUTER_BASE: u16 = 28780;
const ADMIN_BASE: u16 = 28790;

/// Options.
#[derive(Clone, Copy, Debug, clap::Args)]
pub(crate) struct Options {
    /// Conversations.
    #[arg(long, default_value_t = 24)]
    pub conversations: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 5)]
    pub turns: usize,
    /// Seed of the order and the replicas drawn.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}

/// One run's figures (turns 2 onwards).
#[derive(Debug, Default, Clone, Copy)]
struct Figures {
    turns: usize,
    same_engine: usize,
    prompt_tokens: u64,
    cached_tokens: u64,
}

pub(crate) fn run(opts: Options) -> Result<ExitCode> {
    procs::run_until_ctrl_c(bench(opts))
}

async fn bench(opts: Options) -> Result<ExitCode> {
    if opts.turns < 2 || opts.conversations == 0 {
        bail!("need at least one conversation of two turns");
    }
    let root = crate::workspace_root();
    println!("building kinference-sim and kinference-router (release)…");
    let bin = procs::build(&root, true, &["kinference-sim", "kinference-router"])?;
    let dir = root.join("target").join("bench-sessions");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("manifests"))?;
    let sim = Sim::new(ENGINES, HTTP_BASE, KV_BASE).with_args(["--enable-prompt-tokens-details"]);
    let mut m = Manifests::new("bench", sim.specs());
    m.profile = Some((
        "approx".into(),
        "  tokenization: {mode: approximate}\n".into(),
    ));
    std::fs::write(dir.join("manifests").join("bench.yaml"), m.yaml())?;

    let mut rows = Vec::new();
    for session in [false, true] {
        let name = if session { "with" } else { "without" };
        println!(
            "{name} sessions: {} conversations × {} turns…",
            opts.conversations, opts.turns
        );
        let engines = sim
            .start(&bin, "kinference-sim", &dir.join(format!("sim-{name}.log")))
            .await?;
        let mut routers = Vec::new();
        for i in 0..REPLICAS {
            let (listen, admin) = addrs(i);
            let args = fleet::serve_args(&dir.join("manifests"), "bench", &listen, &admin, &[]);
            let mut r = fleet::start_router(
                &bin,
                "kinference-router",
                &args,
                &[],
                &dir.join(format!("router-{name}-{i}.log")),
            )?;
            fleet::wait_connected(&admin, ENGINES, &mut r).await?;
            routers.push(r);
        }
        let figures = conversations(opts, session).await;
        for r in routers {
            r.stop().await;
        }
        engines.stop().await;
        rows.push((name, figures?));
    }
    println!();
    println!(
        "turns 2–{} of {} conversations, {REPLICAS} replicas (approximate mode, no peers), {ENGINES} engines, seed {}",
        opts.turns, opts.conversations, opts.seed
    );
    println!(
        "{:<18} {:>28} {:>22}",
        "sessions", "on the turn before's engine", "prompt tokens cached"
    );
    for (name, f) in &rows {
        println!(
            "{:<18} {:>20} of {:<5} {:>21.1}%",
            name,
            f.same_engine,
            f.turns,
            100.0 * f.cached_tokens as f64 / f.prompt_tokens.max(1) as f64
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn addrs(i: usize) -> (String, String) {
    (
        format!("127.0.0.1:{}", ROUTER_BASE + i as u16),
        format!("127.0.0.1:{}", ADMIN_BASE + i as u16),
    )
}

fn words(from: usize, n: usize) -> String {
    (from..from + n)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs every conversation, turn by turn, through replicas drawn at random.
async fn conversations(opts: Options, session: bool) -> Result<Figures> {
    let mut rng = SplitMix64::new(opts.seed);
    let mut history: Vec<Vec<Value>> = (0..opts.conversations)
        .map(|c| vec![json!({"role": "system", "content": words(1000 * (c + 1), 400)})])
        .collect();
    let mut last: Vec<String> = vec![String::new(); opts.conversations];
    let mut f = Figures::default();
    for t in 0..opts.turns {
        let mut order: Vec<usize> = (0..opts.conversations).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, below(&mut rng, i + 1));
        }
        for c in order {
            let user = format!("turn {t} {}", words(500_000 + 100 * c + 10 * t, 20));
            history[c].push(json!({"role": "user", "content": user}));
            let replica = below(&mut rng, REPLICAS);
            let body = json!({"model": fleet::MODEL, "messages": history[c], "max_tokens": 8});
            let sid = format!("conversation-{c}");
            let headers: &[(&str, &str)] = if session {
                &[("x-session-id", sid.as_str())]
            } else {
                &[]
            };
            let (endpoint, reply) = chat(&addrs(replica).0, &body, headers)
                .await
                .with_context(|| format!("conversation {c}, turn {t}"))?;
            let answer = reply["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            history[c].push(json!({"role": "assistant", "content": answer}));
            if t > 0 {
                let usage = &reply["usage"];
                let (Some(prompt), Some(cached)) = (
                    usage["prompt_tokens"].as_u64(),
                    usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
                ) else {
                    bail!("no prompt_tokens_details.cached_tokens in the reply's usage: {usage}");
                };
                f.turns += 1;
                f.same_engine += usize::from(endpoint == last[c]);
                f.prompt_tokens += prompt;
                f.cached_tokens += cached;
            }
            last[c] = endpoint;
        }
    }
    Ok(f)
}

/// POSTs a chat request to the router at `addr`: the engine it went to
/// (`x-kinference-endpoint`) and the body.
async fn chat(addr: &str, body: &Value, headers: &[(&str, &str)]) -> Result<(String, Value)> {
    let mut req = http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(serde_json::to_vec(body)?)))?;
    let resp = tokio::time::timeout(Duration::from_secs(30), crate::load::client().request(req))
        .await
        .context("timed out")??;
    let status = resp.status();
    // Without it every turn would count as kept on its engine.
    let endpoint = resp
        .headers()
        .get("x-kinference-endpoint")
        .and_then(|v| v.to_str().ok())
        .filter(|e| !e.is_empty())
        .map(str::to_owned);
    let bytes = resp.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        bail!("{status}: {}", String::from_utf8_lossy(&bytes));
    }
    let endpoint = endpoint.context("no x-kinference-endpoint in the router's answer")?;
    Ok((endpoint, serde_json::from_slice(&bytes)?))
}
