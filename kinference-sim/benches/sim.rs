//! How much simulation one core sustains.
//!
//! The simulator runs on ONE thread (a current-thread tokio runtime, plus
//! the blocking pool it uses for tokenization, counted too); the load
//! generator and the KV-event subscribers run on the bench's main thread.
//! CPU time is read from `/proc` (process total minus the generator
//! thread), so the figures are the simulator's own cost.
//!
//! Scenarios (each run `--runs` times, default 3; medians with min–max):
//!
//! * `idle`: 64 engines, no requests: what idle engines cost.
//! * `open-loop`: 16 engines, Poisson arrivals at 100 and 400 req/s,
//!   1024-token prompts (768 shared by 8 groups), 128 streamed output
//!   tokens; client-side and engine-side TTFT show that clients see the
//!   simulated latency.
//! * `saturated`: 1 engine, 64 concurrent streams (512-token prompts, 256
//!   output tokens): the CPU of one fully loaded engine, hence engines per
//!   core at that load.
//! * `baseline`: `GET /health` in a closed loop on the same server stack,
//!   to express request cost as a ratio.
//!
//! Run with `cargo bench -p kinference-sim --bench sim [-- --runs N --quick]`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kinference_sim::{EngineConfig, SimConfig, SimFleet};
use kinference_tokenize::word_level::numbered_words;
use zeromq::{Socket, SocketRecv, SubSocket};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// CPU seconds of the whole process (utime + stime, in USER_HZ = 100 ticks).
fn process_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = after.split(' ').collect();
    let ticks: u64 = f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime");
    ticks as f64 / 100.0
}

/// CPU seconds of the calling thread (nanoseconds from schedstat).
fn thread_cpu() -> f64 {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").expect("schedstat");
    s.split(' ')
        .next()
        .and_then(|n| n.parse::<u64>().ok())
        .expect("ns") as f64
        / 1e9
}

struct SimThread {
    engines: Vec<(String, Option<SocketAddr>)>,
    stop: tokio::sync::oneshot::Sender<()>,
    join: std::thread::JoinHandle<()>,
}

fn start_sim(n: usize, cfg: SimConfig) -> SimThread {
    let (tx, rx) = std::sync::mpsc::channel();
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let join = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let fleet = SimFleet::spawn(cfg, n).await.expect("fleet starts");
            let addrs = fleet
                .engines()
                .iter()
                .map(|e| (e.base_url(), e.kv_addr()))
                .collect();
            tx.send(addrs).expect("bench alive");
            let _ = stop_rx.await;
            fleet.shutdown().await;
        });
    });
    SimThread {
        engines: rx.recv().expect("sim thread starts"),
        stop,
        join,
    }
}

impl SimThread {
    fn stop(self) {
        let _ = self.stop.send(());
        self.join.join().expect("sim thread ends");
    }
}

#[derive(Default, Clone, Copy)]
struct Sample {
    ttft: f64,
    tokens: usize,
}

async fn one(c: &HttpClient, url: &str, body: Bytes) -> Option<Sample> {
    let start = Instant::now();
    let req = hyper::Request::builder()
        .method("POST")
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .ok()?;
    let resp = c.request(req).await.ok()?;
    if resp.status() != 200 {
        return None;
    }
    let mut body = resp.into_body();
    let mut s = Sample::default();
    while let Some(Ok(frame)) = body.frame().await {
        if let Some(d) = frame.data_ref() {
            let n = d.windows(8).filter(|w| w == b"\"text\":\"").count();
            if s.tokens == 0 && n > 0 {
                s.ttft = start.elapsed().as_secs_f64();
            }
            s.tokens += n;
        }
    }
    Some(s)
}

fn body(group: u32, user: u32, shared: usize, unique: usize, max_tokens: usize) -> Bytes {
    let prompt = format!(
        "{} {}",
        numbered_words(group * 4000, shared),
        numbered_words(32_000 + (user * 997) % 30_000, unique)
    );
    Bytes::from(
        serde_json::to_vec(&serde_json::json!({
            "prompt": prompt, "max_tokens": max_tokens, "stream": true,
        }))
        .expect("json"),
    )
}

/// Subscribers draining every engine's events (so publishing is real work).
async fn subscribe_all(
    engines: &[(String, Option<SocketAddr>)],
) -> Arc<std::sync::atomic::AtomicU64> {
    let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
    for (_, kv) in engines {
        let Some(kv) = kv else { continue };
        let mut s = SubSocket::new();
        s.connect(&format!("tcp://{kv}")).await.expect("connects");
        s.subscribe("").await.expect("subscribes");
        let count = count.clone();
        tokio::spawn(async move {
            while s.recv().await.is_ok() {
                count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    count
}

struct Measured {
    wall: f64,
    sim_cpu: f64,
    done: usize,
    tokens: usize,
    client_ttft_p50: f64,
    engine_ttft_p50: f64,
    batches: u64,
}

/// Runs `load` while measuring the simulator's CPU.
async fn measure<F: std::future::Future<Output = Vec<Sample>>>(load: F) -> (f64, f64, Vec<Sample>) {
    let (p0, g0, t0) = (process_cpu(), thread_cpu(), Instant::now());
    let samples = load.await;
    let (p1, g1, wall) = (process_cpu(), thread_cpu(), t0.elapsed().as_secs_f64());
    (wall, (p1 - p0) - (g1 - g0), samples)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

async fn engine_ttft_p50(c: &HttpClient, engines: &[(String, Option<SocketAddr>)]) -> f64 {
    let mut all = Vec::new();
    for (base, _) in engines {
        let req = hyper::Request::builder()
            .uri(format!("{base}/debug/requests?limit=100000"))
            .body(Full::new(Bytes::new()))
            .expect("request");
        let resp = c.request(req).await.expect("debug answers");
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        for r in v["engines"][0]["requests"].as_array().into_iter().flatten() {
            if let (Some(f), Some(a)) = (r["first_token"].as_f64(), r["arrival"].as_f64()) {
                all.push(f - a);
            }
        }
    }
    median(&mut all)
}

async fn open_loop(engines: usize, rate: f64, secs: f64) -> Measured {
    let sim = start_sim(
        engines,
        SimConfig {
            engine: EngineConfig {
                num_gpu_blocks: 16_384,
                ..EngineConfig::default()
            },
            ..SimConfig::default()
        },
    );
    let c: HttpClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let events = subscribe_all(&sim.engines).await;
    let urls: Vec<String> = sim
        .engines
        .iter()
        .map(|(b, _)| format!("{b}/v1/completions"))
        .collect();
    let (wall, sim_cpu, samples) = measure(async {
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 11) as f64 / (1u64 << 53) as f64
        };
        let start = tokio::time::Instant::now();
        let mut at = 0.0;
        let mut tasks = Vec::new();
        let mut i = 0u32;
        while at < secs {
            at += -(1.0 - next()).ln() / rate;
            tokio::time::sleep_until(start + Duration::from_secs_f64(at)).await;
            let url = urls[(next() * urls.len() as f64) as usize % urls.len()].clone();
            let b = body((next() * 8.0) as u32, i, 768, 256, 128);
            let c = c.clone();
            tasks.push(tokio::spawn(async move { one(&c, &url, b).await }));
            i += 1;
        }
        let mut out = Vec::new();
        for t in tasks {
            if let Ok(Some(s)) = t.await {
                out.push(s);
            }
        }
        out
    })
    .await;
    let engine_ttft = engine_ttft_p50(&c, &sim.engines).await;
    let batches = events.load(std::sync::atomic::Ordering::Relaxed);
    sim.stop();
    summarize(wall, sim_cpu, &samples, engine_ttft, batches)
}

fn summarize(
    wall: f64,
    sim_cpu: f64,
    samples: &[Sample],
    engine_ttft: f64,
    batches: u64,
) -> Measured {
    let mut ttfts: Vec<f64> = samples.iter().map(|s| s.ttft).collect();
    Measured {
        wall,
        sim_cpu,
        done: samples.len(),
        tokens: samples.iter().map(|s| s.tokens).sum(),
        client_ttft_p50: median(&mut ttfts),
        engine_ttft_p50: engine_ttft,
        batches,
    }
}

async fn saturated(concurrency: usize, secs: f64) -> Measured {
    let sim = start_sim(1, SimConfig::default());
    let c: HttpClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let events = subscribe_all(&sim.engines).await;
    let url = format!("{}/v1/completions", sim.engines[0].0);
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let (wall, sim_cpu, samples) = measure(async {
        let workers: Vec<_> = (0..concurrency)
            .map(|w| {
                let (c, url) = (c.clone(), url.clone());
                tokio::spawn(async move {
                    let mut out = Vec::new();
                    let mut i = w as u32;
                    while Instant::now() < deadline {
                        if let Some(s) = one(&c, &url, body(100 + i, i, 0, 512, 256)).await {
                            out.push(s);
                        }
                        i += concurrency as u32;
                    }
                    out
                })
            })
            .collect();
        let mut out = Vec::new();
        for w in workers {
            out.extend(w.await.unwrap_or_default());
        }
        out
    })
    .await;
    let engine_ttft = engine_ttft_p50(&c, &sim.engines).await;
    let batches = events.load(std::sync::atomic::Ordering::Relaxed);
    sim.stop();
    summarize(wall, sim_cpu, &samples, engine_ttft, batches)
}

async fn idle(engines: usize, secs: f64) -> Measured {
    let sim = start_sim(engines, SimConfig::default());
    let (wall, sim_cpu, _) = measure(async {
        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
        Vec::new()
    })
    .await;
    sim.stop();
    summarize(wall, sim_cpu, &[], f64::NAN, 0)
}

async fn baseline(concurrency: usize, secs: f64) -> Measured {
    let sim = start_sim(1, SimConfig::default());
    let c: HttpClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let url = format!("{}/health", sim.engines[0].0);
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let (wall, sim_cpu, samples) = measure(async {
        let workers: Vec<_> = (0..concurrency)
            .map(|_| {
                let (c, url) = (c.clone(), url.clone());
                tokio::spawn(async move {
                    let mut n = 0;
                    while Instant::now() < deadline {
                        let req = hyper::Request::builder()
                            .uri(&url)
                            .body(Full::new(Bytes::new()))
                            .expect("request");
                        if let Ok(r) = c.request(req).await {
                            let _ = r.into_body().collect().await;
                            n += 1;
                        }
                    }
                    n
                })
            })
            .collect();
        let mut total = 0;
        for w in workers {
            total += w.await.unwrap_or(0);
        }
        vec![Sample::default(); total]
    })
    .await;
    sim.stop();
    summarize(wall, sim_cpu, &samples, f64::NAN, 0)
}

struct Stat(Vec<f64>);

impl std::fmt::Display for Stat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => write!(f, "-"),
            1 => write!(f, "{:.4}", v[0]),
            n => write!(f, "{:.4} [{:.4}–{:.4}]", v[n / 2], v[0], v[n - 1]),
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let runs = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(3);
    let quick = args.iter().any(|a| a == "--quick");
    let secs = if quick { 4.0 } else { 10.0 };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "kinference-sim capacity on one core; {runs} runs of {secs} s; loadavg at start: {}",
        load.trim()
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");

    let collect = |f: &dyn Fn() -> Measured| -> Vec<Measured> { (0..runs).map(|_| f()).collect() };
    let base = collect(&|| rt.block_on(baseline(16, secs / 2.0)));
    let idle64 = collect(&|| rt.block_on(idle(64, secs / 2.0)));
    let open = collect(&|| rt.block_on(open_loop(16, 100.0, secs)));
    let open400 = collect(&|| rt.block_on(open_loop(16, 400.0, secs)));
    let sat = collect(&|| rt.block_on(saturated(64, secs)));

    let col = |ms: &[Measured], f: &dyn Fn(&Measured) -> f64| Stat(ms.iter().map(f).collect());
    let base_us = |m: &Measured| m.sim_cpu / m.done as f64 * 1e6;
    let base_med = median(&mut base.iter().map(base_us).collect::<Vec<_>>());
    let print = |title: &str, rows: Vec<(&str, Stat)>| {
        println!("\n{title}");
        for (name, stat) in rows {
            println!("  {name:<22}{stat}");
        }
    };
    print(
        "baseline GET /health, 16 concurrent:",
        vec![
            ("req/s", col(&base, &|m| m.done as f64 / m.wall)),
            ("sim CPU µs/request", col(&base, &base_us)),
        ],
    );
    print(
        "idle, 64 engines:",
        vec![("sim CPU (cores)", col(&idle64, &|m| m.sim_cpu / m.wall))],
    );
    for (rate, open) in [(100, &open), (400, &open400)] {
        print(
            &format!(
                "open loop, 16 engines, Poisson {rate} req/s, 1024-token prompts (768 shared by 8 groups), 128 streamed tokens:"
            ),
            vec![
                ("completed req/s", col(open, &|m| m.done as f64 / m.wall)),
                (
                    "streamed tokens/s",
                    col(open, &|m| m.tokens as f64 / m.wall),
                ),
                ("KV batches/s", col(open, &|m| m.batches as f64 / m.wall)),
                ("sim CPU (cores)", col(open, &|m| m.sim_cpu / m.wall)),
                (
                    "sim CPU µs/request",
                    col(open, &|m| m.sim_cpu / m.done as f64 * 1e6),
                ),
                (
                    "ratio to /health",
                    col(open, &|m| m.sim_cpu / m.done as f64 * 1e6 / base_med),
                ),
                ("req/s per core", col(open, &|m| m.done as f64 / m.sim_cpu)),
                ("TTFT p50 client (s)", col(open, &|m| m.client_ttft_p50)),
                ("TTFT p50 engine (s)", col(open, &|m| m.engine_ttft_p50)),
            ],
        );
    }
    print(
        "saturated, 1 engine, 64 concurrent streams, 512-token prompts, 256 output tokens:",
        vec![
            ("completed req/s", col(&sat, &|m| m.done as f64 / m.wall)),
            (
                "streamed tokens/s",
                col(&sat, &|m| m.tokens as f64 / m.wall),
            ),
            ("sim CPU (cores)", col(&sat, &|m| m.sim_cpu / m.wall)),
            (
                "sim CPU µs/token",
                col(&sat, &|m| m.sim_cpu / m.tokens as f64 * 1e6),
            ),
            ("engines per core", col(&sat, &|m| m.wall / m.sim_cpu)),
            ("TTFT p50 client (s)", col(&sat, &|m| m.client_ttft_p50)),
            ("TTFT p50 engine (s)", col(&sat, &|m| m.engine_ttft_p50)),
        ],
    );
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("\nloadavg at end: {}", load.trim());
}
