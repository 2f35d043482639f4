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
struct Figures {
    rows: BTreeMap<String, (Vec<f64>, &'static str)>,
    notes: Vec<String>,
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

// -------------------------------------------------------------- HTTP

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client(pool: usize) -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_max_idle_per_host(pool)
        .build(c)
}

async fn request(
    c: &HttpClient,
    method: &str,
    url: &str,
    body: Option<&Value>,
) -> Result<http::Response<Incoming>> {
    let b = body.map_or_else(Bytes::new, |v| Bytes::from(v.to_string()));
    let req = http::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(b))?;
    Ok(c.request(req).await?)
}

/// A whole answer: status, served-by header, body.
async fn call(c: &HttpClient, url: &str, body: &Value) -> Result<(u16, String, Bytes)> {
    let resp = request(c, "POST", url, Some(body)).await?;
    let status = resp.status().as_u16();
    let ep = served_by(&resp);
    let b = resp.into_body().collect().await?.to_bytes();
    Ok((status, ep, b))
}

fn served_by(resp: &http::Response<Incoming>) -> String {
    resp.headers()
        .get("x-kinference-endpoint")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

async fn get_json(c: &HttpClient, url: &str) -> Result<Value> {
    let resp = request(c, "GET", url, None).await?;
    let b = resp.into_body().collect().await?.to_bytes();
    Ok(serde_json::from_slice(&b)?)
}

async fn get_text(c: &HttpClient, url: &str) -> Result<String> {
    let resp = request(c, "GET", url, None).await?;
    let b = resp.into_body().collect().await?.to_bytes();
    Ok(String::from_utf8_lossy(&b).into_owned())
}

/// How a streamed body ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    Complete,
    Truncated,
    Error,
    Hang,
}

async fn read_stream(mut body: Incoming, patience: Duration) -> (Ending, Option<Duration>, usize) {
    let started = Instant::now();
    let mut text = String::new();
    let mut first = None;
    loop {
        match tokio::time::timeout(patience, body.frame()).await {
            Err(_) => return (Ending::Hang, first, text.len()),
            Ok(None) => {
                let e = if text.trim_end().ends_with("data: [DONE]") {
                    Ending::Complete
                } else {
                    Ending::Truncated
                };
                return (e, first, text.len());
            }
            Ok(Some(Err(_))) => return (Ending::Error, first, text.len()),
            Ok(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    if first.is_none() && !d.is_empty() {
                        first = Some(started.elapsed());
                    }
                    text.push_str(&String::from_utf8_lossy(d));
                }
            }
        }
    }
}

fn words(start: usize, n: usize) -> String {
    (start..start + n)
        .map(|i| format!("w{}", i % 65_536))
        .collect::<Vec<_>>()
        .join(" ")
}

fn chat(content: &str, stream: bool, max_tokens: u32) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream, "max_tokens": max_tokens})
}

fn counter(metrics: &str, prefix: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

// ------------------------------------------------------- processes

struct Env {
    root: PathBuf,
    bin: PathBuf,
    logs: PathBuf,
    c: HttpClient,
}

struct Sim {
    proc: Proc,
    http: u16,
    kv: u16,
}

impl Sim {
    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.http)
    }
    fn spec(&self) -> EngineSpec {
        EngineSpec {
            http: self.http,
            kv: Some(self.kv),
        }
    }
}

#[derive(Clone, Copy)]
struct EngineSpec {
    http: u16,
    kv: Option<u16>,
}

async fn sim(env: &Env, name: &str, replay: bool, extra: &[&str]) -> Result<Sim> {
    let (http, kv) = (free_port()?, free_port()?);
    let mut args: Vec<String> = [
        "--engines",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        &http.to_string(),
        "--kv-port",
        &kv.to_string(),
        "--worker-threads",
        "1",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    if replay {
        args.push("--replay-port".into());
        args.push(free_port()?.to_string());
    }
    args.extend(extra.iter().map(ToString::to_string));
    let mut proc = Proc::spawn(
        name,
        &env.bin.join("kinference-sim"),
        &args,
        &env.logs.join(format!("{name}.log")),
    )?;
    procs::wait_ok(
        &format!("http://127.0.0.1:{http}/health"),
        Duration::from_secs(30),
        &mut proc,
    )
    .await?;
    Ok(Sim { proc, http, kv })
}

async fn inject(env: &Env, sim: &Sim, faults: &Value) -> Result<()> {
    let (status, _, body) = call(&env.c, &format!("{}/admin/faults", sim.url()), faults).await?;
    if status != 200 {
        bail!(
            "fault injection: {status} {}",
            String::from_utf8_lossy(&body)
        );
    }
    Ok(())
}

fn manifests_yaml(engines: &[EngineSpec], namespace: Option<&str>) -> String {
    let ns = namespace.map_or(String::new(), |n| format!(", namespace: {n}"));
    let mut y = format!(
        "apiVersion: kinference.buoyant.io/v1alpha1\nkind: InferencePool\nmetadata: {{name: test{ns}}}\nspec:\n  workerSets: [{{name: sim}}]\n---\napiVersion: kinference.buoyant.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: sim{ns}}}\nspec:\n  profile: default\n  kvBlockSize: {BLOCK}\n  serviceRef: {{name: sim, port: http}}\n  kvEvents: {{port: kv}}\n  models:\n    - name: {MODEL}\n---\n"
    );
    for (i, e) in engines.iter().enumerate() {
        y.push_str(&slice_yaml(&format!("sim-{i}"), *e, namespace));
    }
    y
}

fn slice_yaml(name: &str, e: EngineSpec, namespace: Option<&str>) -> String {
    let ns = namespace.map_or(String::new(), |n| format!("\n  namespace: {n}"));
    let kv =
        e.kv.map_or(String::new(), |k| format!(", {{name: kv, port: {k}}}"));
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}{ns}\n  labels: {{kubernetes.io/service-name: sim}}\naddressType: IPv4\nports: [{{name: http, port: {}}}{kv}]\nendpoints:\n  - addresses: [\"127.0.0.1\"]\n    conditions: {{ready: true}}\n---\n",
        e.http
    )
}

struct Router {
    proc: Proc,
    api: String,
    admin: String,
    _dir: tempdir::Dir,
}

mod tempdir {
    /// A directory removed when dropped.
    pub(crate) struct Dir(pub(crate) std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Router {
    fn rss_mib(&self) -> f64 {
        let Some(pid) = self.proc.pid() else {
            return f64::NAN;
        };
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(f64::NAN, |kb| kb / 1024.0)
    }
}

/// A router on a manifests directory (or, with `kube`, on a cluster: the
/// environment pairs are passed to it) for `engines`; waits until it sees
/// `expect` endpoints with models.
async fn router(
    env: &Env,
    name: &str,
    engines: &[EngineSpec],
    flags: &[&str],
    kube: Option<(&str, &[(&str, String)])>,
    expect: usize,
) -> Result<Router> {
    let dir = std::env::temp_dir().join(format!("kinference-faults-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (api, admin) = (free_port()?, free_port()?);
    let mut args: Vec<String> = vec!["serve".into()];
    match kube {
        None => {
            std::fs::write(dir.join("objects.yaml"), manifests_yaml(engines, None))?;
            args.extend([
                "--pool".into(),
                "test".into(),
                "--manifests".into(),
                dir.display().to_string(),
            ]);
        }
        Some((pool, _)) => args.extend(["--pool".into(), pool.into()]),
    }
    args.extend([
        "--listen".into(),
        format!("127.0.0.1:{api}"),
        "--admin".into(),
        format!("127.0.0.1:{admin}"),
    ]);
    args.extend(flags.iter().map(ToString::to_string));
    let log = env.logs.join(format!("{name}.log"));
    let mut cmd = tokio::process::Command::new(env.bin.join("kinference-router"));
    cmd.args(&args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    if let Some((_, vars)) = kube {
        for (k, v) in vars {
            cmd.env(k, v);
        }
    }
    let proc = Proc::spawn_command(name, cmd, &log)?;
    let r = Router {
        proc,
        api: format!("http://127.0.0.1:{api}"),
        admin: format!("http://127.0.0.1:{admin}"),
        _dir: tempdir::Dir(dir),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(v) = get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await {
            let eps = v["endpoints"].as_array().cloned().unwrap_or_default();
            let with_models = eps
                .iter()
                .filter(|e| e["models"].as_array().is_some_and(|m| !m.is_empty()))
                .count();
            // Engines without a KV port are stand-ins (a bare TCP listener)
            // that never list models.
            let answering = engines.iter().filter(|e| e.kv.is_some()).count();
            if v["ready"] == true && eps.len() == expect && with_models >= expect.min(answering) {
                return Ok(r);
            }
        }
        if Instant::now() > deadline {
            bail!(
                "{name} did not see its engines within 60 s; see {}",
                log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
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

// ---------------------------------------------------------- engines

async fn killed(env: &Env, f: &mut Figures) -> Result<()> {
    let mut sims = Vec::new();
    for i in 0..3 {
        sims.push(sim(env, &format!("killed-sim{i}"), true, &[]).await?);
    }
    let specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    let r = router(env, "killed-router", &specs, &[], None, 3).await?;
    let url = format!("{}/v1/chat/completions", r.api);
    let c = client(64);
    let mut streams = Vec::new();
    for k in 0..9 {
        let resp = request(
            &c,
            "POST",
            &url,
            Some(&chat(&words(k * 500, 50), true, 2000)),
        )
        .await?;
        streams.push((served_by(&resp), resp.into_body()));
    }
    let victim = streams[0].0.clone();
    let i = sims
        .iter()
        .position(|s| format!("127.0.0.1:{}", s.http) == victim)
        .context("the victim is one of ours")?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let dead = sims.remove(i);
    let killed_at = Instant::now();
    dead.proc.stop().await;
    let readers: Vec<_> = streams
        .into_iter()
        .map(|(ep, body)| {
            tokio::spawn(async move {
                let (e, _, _) = read_stream(body, Duration::from_secs(60)).await;
                (ep, e, killed_at.elapsed())
            })
        })
        .collect();
    let metrics = format!("{}/metrics", r.admin);
    let mut attempts = 0;
    let mut last = 0.0;
    let mut errors = 0;
    let mut n = 0;
    while killed_at.elapsed() < Duration::from_secs(10) {
        let before = counter(
            &get_text(&env.c, &metrics).await?,
            "kinference_router_retries_total{reason=\"connect\"}",
        );
        let (status, _, _) = call(&c, &url, &chat(&words(9000 + n * 100, 30), false, 2)).await?;
        if status != 200 {
            errors += 1;
        }
        let after = counter(
            &get_text(&env.c, &metrics).await?,
            "kinference_router_retries_total{reason=\"connect\"}",
        );
        if after > before {
            attempts += 1;
            last = killed_at.elapsed().as_secs_f64();
        }
        n += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut cut_after = Vec::new();
    let mut wrong = 0;
    for t in readers {
        let (ep, e, at) = t.await?;
        if ep == victim {
            if e == Ending::Error {
                cut_after.push(at.as_secs_f64() * 1000.0);
            } else {
                wrong += 1;
            }
        } else if e != Ending::Complete {
            wrong += 1;
        }
    }
    f.add(
        "killed: its streams end with an error, ms after the kill (slowest)",
        cut_after.iter().copied().fold(0.0, f64::max),
        "ms",
    );
    f.add(
        "killed: streams ending otherwise (hang, truncated, or failed elsewhere)",
        f64::from(wrong),
        "",
    );
    f.add(
        "killed: new requests (10 s, sequential) that tried the dead engine",
        f64::from(attempts),
        "",
    );
    f.add("killed: last such attempt, s after the kill", last, "s");
    f.add("killed: new requests failed", f64::from(errors), "");
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    Ok(())
}

/// Accepts connections, never answers.
async fn black_hole() -> Result<(u16, tokio::task::JoinHandle<()>)> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = l.local_addr()?.port();
    Ok((
        port,
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                held.push(s);
            }
        }),
    ))
}

/// Answers 503 to everything.
async fn refuser() -> Result<(u16, tokio::task::JoinHandle<()>)> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = l.local_addr()?.port();
    Ok((
        port,
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(|_req| async {
                        http::Response::builder()
                            .status(503)
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from_static(br#"{"error":{"message":"overloaded","type":"service_unavailable","param":null,"code":503}}"#)))
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                    .await;
                });
            }
        }),
    ))
}

/// 40 clients, one every 100 ms, half streaming; their outcomes.
async fn clients(r: &Router, prefix: &str) -> Result<(BTreeMap<String, usize>, Vec<f64>)> {
    let url = format!("{}/v1/chat/completions", r.api);
    let c = client(64);
    let mut tasks = Vec::new();
    for k in 0..40usize {
        let (c, url) = (c.clone(), url.clone());
        let body = chat(&format!("{prefix} {}", words(k * 300, 20)), k % 2 == 0, 4);
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let resp = request(&c, "POST", &url, Some(&body)).await;
            let outcome = match resp {
                Err(_) => "connection error".to_owned(),
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let (e, _, _) = read_stream(resp.into_body(), Duration::from_secs(900)).await;
                    match (status, e) {
                        (200, Ending::Complete) => "ok".into(),
                        (200, _) if body["stream"] == false => "ok".into(),
                        (200, e) => format!("stream {e:?}"),
                        (s, _) => format!("{s}"),
                    }
                }
            };
            (outcome, started.elapsed().as_secs_f64())
        }));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut outcomes = BTreeMap::new();
    let mut lat = Vec::new();
    for t in tasks {
        let (o, l) = t.await?;
        *outcomes.entry(o).or_default() += 1;
        lat.push(l);
    }
    Ok((outcomes, lat))
}

async fn hung(env: &Env, f: &mut Figures) -> Result<()> {
    let mut sims = Vec::new();
    for i in 0..2 {
        sims.push(sim(env, &format!("hung-sim{i}"), true, &[]).await?);
    }
    let (hole, task) = black_hole().await?;
    let mut specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    specs.push(EngineSpec {
        http: hole,
        kv: None,
    });
    let r = router(env, "hung-router", &specs, &[], None, 3).await?;
    let t0 = Instant::now();
    let (outcomes, mut lat) = clients(&r, "").await?;
    let ejected = ejected_since(env, &r, &format!("127.0.0.1:{hole}"), t0).await;
    let m = get_text(&env.c, &format!("{}/metrics", r.admin)).await?;
    f.add(
        "hung (router defaults): requests ok of 40",
        *outcomes.get("ok").unwrap_or(&0) as f64,
        "",
    );
    f.add(
        "hung (router defaults): slowest client",
        lat.iter().copied().fold(0.0, f64::max),
        "s",
    );
    f.add(
        "hung (router defaults): client latency p50",
        median(&mut lat),
        "s",
    );
    f.add(
        "hung (router defaults): requests moved off it when probes found it unreachable",
        counter(&m, "kinference_router_retries_total{reason=\"down\"}"),
        "",
    );
    f.add(
        "hung (router defaults): ejected, s after the clients started",
        ejected,
        "s",
    );
    f.notes.push(format!("hung outcomes: {outcomes:?}"));
    task.abort();
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    Ok(())
}

async fn ejected_since(env: &Env, r: &Router, endpoint: &str, t0: Instant) -> f64 {
    let deadline = t0 + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(v) = get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await
            && v["endpoints"].as_array().is_some_and(|a| {
                a.iter()
                    .any(|e| e["endpoint"] == endpoint && e["healthy"] == false)
            })
        {
            return t0.elapsed().as_secs_f64();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f64::NAN
}

async fn stalled(env: &Env, f: &mut Figures) -> Result<()> {
    let mut sims = Vec::new();
    for i in 0..3 {
        sims.push(sim(env, &format!("stalled-sim{i}"), true, &[]).await?);
    }
    let specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    let r = router(
        env,
        "stalled-router",
        &specs,
        &["--upstream-timeout-s", "10"],
        None,
        3,
    )
    .await?;
    let prefix = words(60_000, 800);
    call(
        &env.c,
        &format!("{}/v1/chat/completions", sims[0].url()),
        &chat(&prefix, false, 1),
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    inject(env, &sims[0], &json!({"stall_ms": 600_000})).await?;
    let (outcomes, lat) = clients(&r, &prefix).await?;
    f.add(
        "stalled core (upstream timeout 10 s): requests ok of 40",
        *outcomes.get("ok").unwrap_or(&0) as f64,
        "",
    );
    f.add(
        "stalled core: plain requests answered 504",
        *outcomes.get("504").unwrap_or(&0) as f64,
        "",
    );
    f.add(
        "stalled core: streams cut with an error",
        *outcomes.get("stream Error").unwrap_or(&0) as f64,
        "",
    );
    f.add(
        "stalled core: clients left hanging",
        *outcomes.get("stream Hang").unwrap_or(&0) as f64,
        "",
    );
    f.add(
        "stalled core: slowest client",
        lat.iter().copied().fold(0.0, f64::max),
        "s",
    );
    f.notes.push(format!("stalled outcomes: {outcomes:?}"));
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    Ok(())
}

async fn refusing(env: &Env, f: &mut Figures) -> Result<()> {
    let mut sims = Vec::new();
    for i in 0..2 {
        sims.push(sim(env, &format!("refusing-sim{i}"), true, &[]).await?);
    }
    let (bad, task) = refuser().await?;
    let mut specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    specs.push(EngineSpec {
        http: bad,
        kv: None,
    });
    let r = router(env, "refusing-router", &specs, &[], None, 3).await?;
    let url = format!("{}/v1/chat/completions", r.api);
    let mut ok = 0;
    let mut lat = Vec::new();
    for k in 0..100usize {
        let t = Instant::now();
        let (status, _, _) = call(&env.c, &url, &chat(&words(k * 300, 20), false, 2)).await?;
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
        ok += usize::from(status == 200);
    }
    let m = get_text(&env.c, &format!("{}/metrics", r.admin)).await?;
    f.add("refusing (503): requests ok of 100", ok as f64, "");
    f.add(
        "refusing (503): refused by it and retried elsewhere",
        counter(
            &m,
            "kinference_router_retries_total{reason=\"unavailable\"}",
        ),
        "",
    );
    f.add("refusing (503): latency p50", median(&mut lat), "ms");
    task.abort();
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    Ok(())
}

async fn slow(env: &Env, f: &mut Figures) -> Result<()> {
    let mut sims = vec![sim(env, "slow-sim0", true, &["--slowdown", "10"]).await?];
    for i in 1..3 {
        sims.push(sim(env, &format!("slow-sim{i}"), true, &[]).await?);
    }
    let slow_ep = format!("127.0.0.1:{}", sims[0].http);
    let specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    let r = router(env, "slow-router", &specs, &[], None, 3).await?;
    let url = format!("{}/v1/chat/completions", r.api);
    let c = client(64);
    let sem = Arc::new(tokio::sync::Semaphore::new(6));
    let mut tasks = Vec::new();
    let total = 150usize;
    for k in 0..total {
        let permit = sem.clone().acquire_owned().await?;
        let (c, url) = (c.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let resp = request(&c, "POST", &url, Some(&chat(&words(k * 700, 600), true, 8))).await;
            drop(permit);
            let resp = resp.ok()?;
            let ep = served_by(&resp);
            let (_, ttft, _) = read_stream(resp.into_body(), Duration::from_secs(60)).await;
            Some((ep, ttft?.as_secs_f64() * 1000.0))
        }));
    }
    let mut slow_ttft = Vec::new();
    let mut fast_ttft = Vec::new();
    for t in tasks {
        if let Some((ep, ttft)) = t.await? {
            if ep == slow_ep {
                slow_ttft.push(ttft);
            } else {
                fast_ttft.push(ttft);
            }
        }
    }
    f.add(
        "slow (10×): its share of 150 requests (fair share 33%)",
        slow_ttft.len() as f64 * 100.0 / total as f64,
        "%",
    );
    f.add("slow (10×): TTFT p50 on it", median(&mut slow_ttft), "ms");
    f.add(
        "slow (10×): TTFT p50 on the others",
        median(&mut fast_ttft),
        "ms",
    );
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    Ok(())
}

// -------------------------------------------------------------- KV

fn prompt(n: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| 100 + n * 1000 + i).collect()
}

/// The keys of everything the engine has cached (its `/debug/cache`).
async fn truth_keys(env: &Env, s: &Sim) -> Result<HashSet<u64>> {
    let v = get_json(&env.c, &format!("{}/debug/cache?tokens=1", s.url())).await?;
    let keyer = BlockKeyer::new(BLOCK, None);
    let extra = ExtraKeys::none().digest_for_block(0, BLOCK as usize);
    let mut out = HashSet::new();
    for rank in v["engines"].as_array().into_iter().flatten() {
        let blocks = rank["blocks"].as_array().cloned().unwrap_or_default();
        let by_hash: HashMap<u64, &Value> = blocks
            .iter()
            .filter_map(|b| Some((b["hash"].as_u64()?, b)))
            .collect();
        let mut keys: HashMap<u64, u64> = HashMap::new();
        for b in &blocks {
            let mut path = vec![b];
            let mut prev = keyer.seed();
            let mut ok = true;
            loop {
                let cur = path[path.len() - 1];
                let Some(p) = cur["parent"].as_u64() else {
                    break;
                };
                if let Some(k) = keys.get(&p) {
                    prev = *k;
                    break;
                }
                if let Some(pb) = by_hash.get(&p) {
                    path.push(pb);
                } else {
                    ok = false;
                    break;
                }
            }
            if !ok {
                continue;
            }
            for cur in path.iter().rev() {
                let toks: Vec<u32> = cur["tokens"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|t| t.as_u64().map(|t| t as u32))
                    .collect();
                let k = key::chain(prev, key::local_hash(&toks, extra)).0;
                if let Some(h) = cur["hash"].as_u64() {
                    keys.insert(h, k);
                }
                prev = k;
            }
        }
        out.extend(keys.values());
    }
    Ok(out)
}

async fn router_keys(env: &Env, r: &Router, s: &Sim) -> Result<HashSet<u64>> {
    let v = get_json(
        &env.c,
        &format!("{}/debug/kv?endpoint=127.0.0.1:{}", r.admin, s.http),
    )
    .await?;
    Ok(v["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|w| w["keys"].as_array().cloned().unwrap_or_default())
        .filter_map(|k| k.as_u64())
        .collect())
}

#[derive(Clone, Copy, Debug, Default)]
struct Audit {
    stale: usize,
    missing: usize,
    truth: usize,
}

async fn audit(env: &Env, r: &Router, s: &Sim) -> Result<Audit> {
    let truth = truth_keys(env, s).await?;
    let ours = router_keys(env, r, s).await?;
    Ok(Audit {
        stale: ours.difference(&truth).count(),
        missing: truth.difference(&ours).count(),
        truth: truth.len(),
    })
}

/// Until no stale block and every block of `fresh` the engine holds is
/// known: (time, audit), or the last audit after 30 s.
async fn converge(env: &Env, r: &Router, s: &Sim, fresh: &[Vec<u32>]) -> Result<(f64, Audit)> {
    let keyer = BlockKeyer::new(BLOCK, None);
    let fresh_keys: HashSet<u64> = fresh
        .iter()
        .flat_map(|p| keyer.keys(p, &ExtraKeys::none()))
        .map(|k| k.0)
        .collect();
    let t0 = Instant::now();
    loop {
        let truth = truth_keys(env, s).await?;
        let ours = router_keys(env, r, s).await?;
        let a = Audit {
            stale: ours.difference(&truth).count(),
            missing: truth.difference(&ours).count(),
            truth: truth.len(),
        };
        let fresh_ok = fresh_keys
            .iter()
            .filter(|k| truth.contains(k))
            .all(|k| ours.contains(k));
        if a.stale == 0 && fresh_ok {
            return Ok((t0.elapsed().as_secs_f64() * 1000.0, a));
        }
        if t0.elapsed() > Duration::from_secs(30) {
            return Ok((f64::NAN, a));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn send_prompt(env: &Env, r: &Router, ids: &[u32]) -> Result<()> {
    let (status, _, body) = call(
        &env.c,
        &format!("{}/v1/completions", r.api),
        &json!({"model": MODEL, "prompt": ids, "max_tokens": 2}),
    )
    .await?;
    if status != 200 {
        bail!("completion: {status} {}", String::from_utf8_lossy(&body));
    }
    Ok(())
}

async fn kv_setup(env: &Env, name: &str, replay: bool, extra: &[&str]) -> Result<(Sim, Router)> {
    // Small engines by default; `extra` may set these itself (the simulator
    // refuses a flag given twice).
    let mut args: Vec<&str> = Vec::new();
    for (flag, value) in [("--num-gpu-blocks", "96"), ("--max-model-len", "1024")] {
        if !extra.contains(&flag) {
            args.extend([flag, value]);
        }
    }
    args.extend_from_slice(extra);
    let s = sim(env, &format!("{name}-sim"), replay, &args).await?;
    let r = router(env, &format!("{name}-router"), &[s.spec()], &[], None, 1).await?;
    // The KV stream connected.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await?;
        if v["endpoints"][0]["kv"][0]["connected"] == true {
            break;
        }
        if Instant::now() > deadline {
            bail!("{name}: KV events never connected");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok((s, r))
}

async fn warm(env: &Env, r: &Router, s: &Sim) -> Result<()> {
    for k in 0..12 {
        send_prompt(env, r, &prompt(k, 10)).await?;
    }
    converge(env, r, s, &[]).await?;
    Ok(())
}

fn kv_figures(f: &mut Figures, what: &str, converge_ms: f64, a: Audit) {
    f.add(
        format!("kv {what}: stale blocks after recovery"),
        a.stale as f64,
        "",
    );
    f.add(
        format!("kv {what}: converged, ms after the last request"),
        converge_ms,
        "ms",
    );
    f.add(
        format!("kv {what}: share of the engine's blocks the router knows"),
        if a.truth == 0 {
            f64::NAN
        } else {
            100.0 * (a.truth - a.missing) as f64 / a.truth as f64
        },
        "%",
    );
}

async fn kv(env: &Env, f: &mut Figures) -> Result<()> {
    // A publisher down 3 s (its events lost) after a short history, back
    // counting from 0.
    {
        let (s, r) = kv_setup(env, "kv-restart", true, &[]).await?;
        send_prompt(env, &r, &prompt(0, 10)).await?;
        converge(env, &r, &s, &[]).await?;
        let fault = json!({"restart_publisher": true, "restart_down_ms": 3000});
        let restart = inject(env, &s, &fault);
        let traffic = async {
            for k in 100..160 {
                send_prompt(env, &r, &prompt(k, 10)).await?;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok::<_, anyhow::Error>(())
        };
        let (a, b) = tokio::join!(restart, traffic);
        a?;
        b?;
        let fresh: Vec<Vec<u32>> = (200..203).map(|k| prompt(k, 10)).collect();
        for p in &fresh {
            send_prompt(env, &r, p).await?;
        }
        let (t, a) = converge(env, &r, &s, &fresh).await?;
        kv_figures(f, "publisher restart (3 s down)", t, a);
        r.proc.stop().await;
        s.proc.stop().await;
    }
    // Gaps: three batches withheld, with and without a replay socket.
    for replay in [true, false] {
        let name = if replay {
            "gap, replayed"
        } else {
            "gap, no replay socket"
        };
        let (s, r) = kv_setup(env, "kv-gap", replay, &[]).await?;
        warm(env, &r, &s).await?;
        inject(env, &s, &json!({"drop_batches": 3})).await?;
        let fresh: Vec<Vec<u32>> = (300..306).map(|k| prompt(k, 10)).collect();
        for p in &fresh {
            send_prompt(env, &r, p).await?;
        }
        let (t, a) = converge(env, &r, &s, &fresh[3..]).await?;
        kv_figures(f, name, t, a);
        r.proc.stop().await;
        s.proc.stop().await;
    }
    // A stalled publisher: 40 batches withheld while the engine works.
    {
        let (s, r) = kv_setup(env, "kv-stall", true, &[]).await?;
        warm(env, &r, &s).await?;
        inject(env, &s, &json!({"drop_batches": 40})).await?;
        let mut max_stale = 0;
        let mut k = 500;
        loop {
            send_prompt(env, &r, &prompt(k, 10)).await?;
            k += 1;
            max_stale = max_stale.max(audit(env, &r, &s).await?.stale);
            let v = get_json(&env.c, &format!("{}/debug/cache?summary=1", s.url())).await?;
            if v["engines"][0]["publisher"]["drop_pending"] == 0 || k > 700 {
                break;
            }
        }
        let fresh: Vec<Vec<u32>> = (k..k + 2).map(|k| prompt(k, 10)).collect();
        for p in &fresh {
            send_prompt(env, &r, p).await?;
        }
        let (t, a) = converge(env, &r, &s, &fresh).await?;
        kv_figures(f, "stalled publisher (40 batches)", t, a);
        f.add(
            "kv stalled publisher: stale blocks at worst during the stall",
            max_stale as f64,
            "",
        );
        r.proc.stop().await;
        s.proc.stop().await;
    }
    // The last request's batches withheld, then the engine idle.
    {
        let (s, r) = kv_setup(env, "kv-tail", true, &[]).await?;
        warm(env, &r, &s).await?;
        let seq = |v: &Value| {
            v["engines"][0]["publisher"]["next_seq"]
                .as_u64()
                .unwrap_or(0)
        };
        let s0 = seq(&get_json(&env.c, &format!("{}/debug/cache?summary=1", s.url())).await?);
        send_prompt(env, &r, &prompt(399, 10)).await?;
        let n = seq(&get_json(&env.c, &format!("{}/debug/cache?summary=1", s.url())).await?) - s0;
        converge(env, &r, &s, &[]).await?;
        inject(env, &s, &json!({"drop_batches": n})).await?;
        send_prompt(env, &r, &prompt(400, 10)).await?;
        let idle = audit(env, &r, &s).await?;
        let (t, a) = converge(env, &r, &s, &[prompt(400, 10)]).await?;
        f.add(
            "kv last batches missed, engine idle: stale blocks right after",
            idle.stale as f64,
            "",
        );
        kv_figures(f, "last batches missed, engine idle", t, a);
        r.proc.stop().await;
        s.proc.stop().await;
    }
    // A flood: 120 concurrent long prompts through a small cache, every 7th
    // batch dropped (replayed).
    {
        let (s, r) = kv_setup(
            env,
            "kv-flood",
            true,
            &[
                "--num-gpu-blocks",
                "256",
                "--max-model-len",
                "2048",
                "--drop-every",
                "7",
            ],
        )
        .await?;
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for k in 0..120u32 {
            let (c, url) = (env.c.clone(), format!("{}/v1/completions", r.api));
            tasks.push(tokio::spawn(async move {
                call(
                    &c,
                    &url,
                    &json!({"model": MODEL, "prompt": prompt(k, 40), "max_tokens": 1}),
                )
                .await
                .map(|(s, _, _)| s)
            }));
        }
        let mut failed = 0;
        for t in tasks {
            if t.await?? != 200 {
                failed += 1;
            }
        }
        let took = t0.elapsed().as_secs_f64();
        let fresh = vec![prompt(1000, 10)];
        send_prompt(env, &r, &fresh[0]).await?;
        let (t, a) = converge(env, &r, &s, &fresh).await?;
        let v = get_json(&env.c, &format!("{}/debug/cache?summary=1", s.url())).await?;
        let c = &v["engines"][0]["counters"];
        f.add(
            "kv flood: events (blocks stored + removed) per second",
            (c["blocks_stored"].as_f64().unwrap_or(0.0)
                + c["blocks_removed"].as_f64().unwrap_or(0.0))
                / took,
            "/s",
        );
        f.add("kv flood: failed requests", f64::from(failed), "");
        kv_figures(f, "flood", t, a);
        r.proc.stop().await;
        s.proc.stop().await;
    }
    Ok(())
}

// ------------------------------------------------------------- load

fn in_flight_gauges(metrics: &str) -> f64 {
    counter(metrics, "kinference_router_endpoint_in_flight_requests{")
}

async fn load_soak(env: &Env, opts: &Options, f: &mut Figures) -> Result<()> {
    let mut sims = Vec::new();
    for i in 0..4 {
        sims.push(
            sim(
                env,
                &format!("load-sim{i}"),
                true,
                &[
                    "--max-num-seqs",
                    "4096",
                    "--num-gpu-blocks",
                    "131072",
                    "--max-num-batched-tokens",
                    "16384",
                ],
            )
            .await?,
        );
    }
    let specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    let r = router(env, "load-router", &specs, &[], None, 4).await?;
    let c = client(opts.streams);
    let url = format!("{}/v1/chat/completions", r.api);
    let rss_before = r.rss_mib();
    let started = Instant::now();
    let mut rss_after = Vec::new();
    let mut zero_after_ms: f64 = 0.0;
    let (mut total, mut errors, mut held_min) = (0usize, 0usize, usize::MAX);
    let mut peak = 0.0f64;
    let mut round = 0usize;
    loop {
        for s in &sims {
            inject(env, s, &json!({"stall_ms": 600_000})).await?;
        }
        let opened = Arc::new(tokio::sync::Barrier::new(opts.streams + 1));
        let mut tasks = Vec::with_capacity(opts.streams);
        for k in 0..opts.streams {
            let (c, url, opened) = (c.clone(), url.clone(), opened.clone());
            let body = chat(
                &words((round * opts.streams + k) * 7 % 60_000, 24),
                true,
                40,
            );
            tasks.push(tokio::spawn(async move {
                let resp = request(&c, "POST", &url, Some(&body)).await;
                opened.wait().await;
                let resp = resp.ok()?;
                if resp.status() != 200 {
                    return None;
                }
                let (e, _, _) = read_stream(resp.into_body(), Duration::from_secs(120)).await;
                (e == Ending::Complete).then_some(())
            }));
        }
        opened.wait().await;
        let v = get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await?;
        let held: u64 = v["endpoints"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| e["load"]["requests"].as_u64().unwrap_or(0))
            .sum();
        held_min = held_min.min(held as usize);
        peak = peak.max(r.rss_mib());
        for s in &sims {
            inject(env, s, &json!({"stall_ms": 0})).await?;
        }
        for t in tasks {
            total += 1;
            if t.await?.is_none() {
                errors += 1;
            }
        }
        // Accounting back to zero.
        let settle = Instant::now();
        let deadline = settle + Duration::from_secs(30);
        loop {
            let m = get_text(&env.c, &format!("{}/metrics", r.admin)).await?;
            let v = get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await?;
            let load: u64 = v["endpoints"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| e["load"]["requests"].as_u64().unwrap_or(1))
                .sum();
            if load == 0 && in_flight_gauges(&m) == 0.0 {
                zero_after_ms = zero_after_ms.max(settle.elapsed().as_secs_f64() * 1e3);
                break;
            }
            if Instant::now() > deadline {
                bail!("in-flight accounting did not return to zero: {load} requests still counted");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        rss_after.push(r.rss_mib());
        println!(
            "  round {round}: {} streams, {held} held at once, {errors} errors so far, router RSS {:.0} MiB",
            opts.streams,
            rss_after[rss_after.len() - 1]
        );
        round += 1;
        if started.elapsed() >= Duration::from_secs(opts.soak_s) {
            break;
        }
    }
    f.add(
        format!(
            "load: streams held through the router at once (of {})",
            opts.streams
        ),
        held_min as f64,
        "",
    );
    f.add("load: rounds in the soak", round as f64, "");
    f.add("load: requests in the soak", total as f64, "");
    f.add("load: errors in the soak", errors as f64, "");
    f.add("load: router RSS before", rss_before, "MiB");
    f.add("load: router RSS holding the streams (peak)", peak, "MiB");
    f.add("load: router RSS after round 1", rss_after[0], "MiB");
    f.add(
        "load: router RSS after the last round",
        rss_after[rss_after.len() - 1],
        "MiB",
    );
    f.add(
        "load: router RSS, largest after any round",
        rss_after.iter().copied().fold(0.0, f64::max),
        "MiB",
    );
    // A round whose counts do not reach zero within 30 s fails the scenario.
    f.add(
        "load: in-flight counts back to zero after the last stream, at most",
        zero_after_ms,
        "ms",
    );
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    Ok(())
}

// -------------------------------------------------------------- k8s

struct ApiServer {
    dir: PathBuf,
    shared: PathBuf,
    vars: Vec<(&'static str, String)>,
}

impl ApiServer {
    fn script(&self, name: &str, keep: bool) -> Result<String> {
        let mut cmd = std::process::Command::new("bash");
        cmd.arg(self.shared.join("k8s").join(name))
            .env("K8S_TEST_DIR", &self.dir)
            .env("K8S_TEST_PORT", "26443")
            .env("K8S_TEST_ETCD_PORT", "22379")
            .env("KUBECONFIG", self.dir.join("kubeconfig"));
        if keep {
            cmd.env("K8S_TEST_KEEP_DATA", "1");
        }
        let out = cmd.output().with_context(|| format!("running {name}"))?;
        if !out.status.success() {
            bail!("{name} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Result<String> {
        use std::io::Write as _;
        let kubectl = self
            .vars
            .iter()
            .find(|(k, _)| *k == "K8S_TEST_KUBECTL")
            .map_or_else(|| "kubectl".to_owned(), |(_, v)| v.clone());
        let mut child = std::process::Command::new(kubectl)
            .args(args)
            .env("KUBECONFIG", self.dir.join("kubeconfig"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        if let (Some(text), Some(mut i)) = (stdin, child.stdin.take()) {
            i.write_all(text.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = self.script("stop-apiserver.sh", false);
    }
}

async fn k8s(env: &Env, f: &mut Figures) -> Result<()> {
    let shared = std::env::var_os("KINFERENCE_SHARED")
        .map_or_else(|| env.root.join("..").join("shared"), PathBuf::from);
    if !shared.join("k8s/start-apiserver.sh").is_file() {
        bail!(
            "no shared/k8s/start-apiserver.sh at {} (set KINFERENCE_SHARED)",
            shared.display()
        );
    }
    let dir = std::env::temp_dir().join("kinference-faults-k8s");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let mut api = ApiServer {
        dir,
        shared,
        vars: Vec::new(),
    };
    let exports = api.script("start-apiserver.sh", false)?;
    for line in exports.lines() {
        if let Some((k, v)) = line.trim_start_matches("export ").split_once('=') {
            let v = v.trim_matches(['"', '\'']).to_owned();
            if k == "K8S_TEST_KUBECTL" {
                api.vars.push(("K8S_TEST_KUBECTL", v));
            }
        }
    }
    api.kubectl(
        &[
            "apply",
            "--server-side",
            "-f",
            &env.root.join("deploy/crds").display().to_string(),
        ],
        None,
    )?;
    api.kubectl(
        &[
            "wait",
            "--for=condition=Established",
            "crd",
            "--all",
            "--timeout=60s",
        ],
        None,
    )?;
    let mut sims = Vec::new();
    for i in 0..3 {
        sims.push(sim(env, &format!("k8s-sim{i}"), true, &[]).await?);
    }
    let specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    api.kubectl(
        &["apply", "-f", "-"],
        Some(&manifests_yaml(&specs[..2], Some("faults"))),
    )?;
    let vars = [(
        "KUBECONFIG",
        api.dir.join("kubeconfig").display().to_string(),
    )];
    let r = router(
        env,
        "k8s-router",
        &specs[..2],
        &[],
        Some(("faults/test", &vars)),
        2,
    )
    .await?;
    let ids = |v: &Value| -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = v["endpoints"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| {
                (
                    e["endpoint"].as_str().unwrap_or_default().to_owned(),
                    e["id"].as_u64().unwrap_or(0),
                )
            })
            .collect();
        out.sort();
        out
    };
    let before = ids(&get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await?);

    // Requests all along.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let (c, url, stop) = (
            client(8),
            format!("{}/v1/chat/completions", r.api),
            stop.clone(),
        );
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0usize, 0usize);
            let mut k = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match call(&c, &url, &chat(&words(k * 50, 20), false, 2)).await {
                    Ok((200, _, _)) => ok += 1,
                    _ => failed += 1,
                }
                k += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (ok, failed)
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    api.script("stop-apiserver.sh", false)?;
    tokio::time::sleep(Duration::from_secs(10)).await;
    api.script("start-apiserver.sh", true)?;
    let back = Instant::now();
    // A change made after the restart: the third engine's slice.
    api.kubectl(
        &["apply", "-f", "-"],
        Some(&slice_yaml("sim-2", specs[2], Some("faults"))),
    )?;
    let mut seen = f64::NAN;
    while back.elapsed() < Duration::from_secs(120) {
        let v = get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await?;
        if v["endpoints"].as_array().is_some_and(|a| a.len() == 3) {
            seen = back.elapsed().as_secs_f64();
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = traffic.await?;
    let after = ids(&get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await?);
    let distinct: HashSet<&String> = after.iter().map(|(e, _)| e).collect();
    let kept = before.iter().all(|b| after.contains(b));
    f.add(
        "k8s restart: requests served while the API server was down and back",
        ok as f64,
        "",
    );
    f.add("k8s restart: requests failed", failed as f64, "");
    f.add(
        "k8s restart: a slice added after the restart is routed, s after the server is back",
        seen,
        "s",
    );
    f.add(
        "k8s restart: endpoints listed after resync (3 engines)",
        after.len() as f64,
        "",
    );
    f.add(
        "k8s restart: duplicate endpoints",
        (after.len() - distinct.len()) as f64,
        "",
    );
    f.add(
        "k8s restart: endpoints that kept their state (id) across the restart, of 2",
        if kept { 2.0 } else { 0.0 },
        "",
    );
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    drop(api);
    Ok(())
}

// ------------------------------------------------------------- fuzz

fn fuzz(env: &Env, opts: &Options, f: &mut Figures) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let runs: [(&str, &[&str], (&str, String)); 2] = [
        (
            "kv events",
            &[
                "test",
                "--release",
                "-p",
                "kinference-kvindex",
                "--test",
                "fuzz",
                "--",
                "--nocapture",
            ],
            ("KINFERENCE_FUZZ_INPUTS", opts.fuzz_inputs.to_string()),
        ),
        (
            "request bodies",
            &[
                "test",
                "--release",
                "-p",
                "kinference-router",
                "--test",
                "hostile",
                "mutated_bodies_never_panic",
                "--",
                "--nocapture",
            ],
            (
                "KINFERENCE_FUZZ_REQUESTS",
                (opts.fuzz_inputs / 5).to_string(),
            ),
        ),
    ];
    for (what, args, (k, v)) in runs {
        let out = std::process::Command::new(&cargo)
            .current_dir(&env.root)
            .args(args)
            .env(k, v)
            .output()
            .with_context(|| format!("running the {what} fuzzer"))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let figure = text
            .lines()
            .find(|l| l.starts_with("FIGURE"))
            .unwrap_or("no figure printed")
            .to_owned();
        if !out.status.success() {
            bail!("the {what} fuzzer failed:\n{text}");
        }
        f.notes.push(format!("fuzz {what}: {figure}"));
    }
    Ok(())
}
