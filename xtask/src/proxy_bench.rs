//! `cargo xtask bench proxy`: what the router adds to a request, against
//! calling an engine directly and against nginx round-robin proxying to the
//! same engines, in one run with wrk.
//!
//! Workload (issue 7): non-streaming chat requests of about 1.2K tokens over
//! 16 shared prefixes, fixed short replies (2 tokens), simulated engines
//! that answer at once (step times 0), so what is measured is the proxies.
//! The router tokenizes locally (word-level tokenizer, prefix cache warm
//! after the first round) and routes with kinference's policy.
//!
//! Figures: p50 latency at one connection for direct / router / nginx (the
//! router's and nginx's *added* latency is their p50 minus direct's);
//! throughput at 16 connections; CPU per request of the router and of nginx
//! (utime + stime of their processes over the 16-connection run ÷ requests).
//! The five runs are repeated `--rounds` times, interleaved, and each figure
//! is the median over rounds (the machines are shared and one run of 10 s
//! moves by 20–30 %); the goals (issue 14) are ratios to nginx in the same
//! rounds.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::bench::routing::{clock_ticks, cpu_seconds as routing_cpu_seconds};
use crate::fleet::{self, Manifests, Sim};
use crate::procs::{self, Proc};

const ENGINES: usize = 2;
const HTTP_BASE: u16 = 28501;
const KV_BASE: u16 = 28601;
const ROUTER: &str = "127.0.0.1:28580";
const ADMIN: &str = "127.0.0.1:28590";
const NGINX_PORT: u16 = 28570;

/// Options.
#[derive(Clone, Copy, Debug, clap::Args)]
pub(crate) struct Options {
    /// Seconds per wrk run.
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    /// Rounds of the five runs; figures are medians over rounds.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
}

/// Picks one run out of a round.
type RoundRun = fn(&Round) -> Wrk;

/// One round's figures.
#[derive(Debug, Default, Clone, Copy)]
struct Round {
    d1: Wrk,
    r1: Wrk,
    n1: Wrk,
    r16: Wrk,
    n16: Wrk,
    /// CPU seconds per request at 16 connections.
    router_cpu: f64,
    nginx_cpu: f64,
}

fn which(tool: &str, advice: &str) -> Result<PathBuf> {
    for dir in std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .chain(["/usr/sbin", "/usr/local/sbin"])
    {
        let p = Path::new(dir).join(tool);
        if p.is_file() {
            return Ok(p);
        }
    }
    bail!("{tool} not found: {advice}")
}

/// Sixteen bodies: 16 prefixes of ~1,150 words shared by 16 clients' last turns.
fn bodies() -> Vec<String> {
    (0..16)
        .map(|i| {
            let prefix: Vec<String> = (0..1150).map(|k| format!("w{}", (i * 2000 + k) % 65_536)).collect();
            serde_json::json!({
                "model": "kinference/sim",
                "messages": [
                    {"role": "system", "content": prefix.join(" ")},
                    {"role": "user", "content": format!("w{} w{} w{}", 60_000 + i, 61_000 + i, 62_000 + i)},
                ],
                "max_tokens": 2,
            })
            .to_string()
        })
        .collect()
}

fn lua_script(bodies: &[String]) -> String {
    let mut s = String::from(
        "wrk.method = \"POST\"\nwrk.headers[\"Content-Type\"] = \"application/json\"\nlocal bodies = {\n",
    );
    for b in bodies {
        let _ = writeln!(s, "  [==[{b}]==],");
    }
    s.push_str("}\nlocal i = 0\nrequest = function()\n  i = i % #bodies + 1\n  return wrk.format(nil, nil, nil, bodies[i])\nend\n");
    s
}

fn nginx_conf(dir: &Path) -> String {
    let mut upstreams = String::new();
    for i in 0..ENGINES {
        let _ = writeln!(upstreams, "    server 127.0.0.1:{};", HTTP_BASE + i as u16);
    }
    format!(
        "worker_processes 2;\npid {pid};\nerror_log {log} warn;\ndaemon off;\nevents {{ worker_connections 4096; }}\nhttp {{\n  access_log off;\n  client_body_temp_path {tmp};\n  proxy_temp_path {tmp};\n  fastcgi_temp_path {tmp};\n  uwsgi_temp_path {tmp};\n  scgi_temp_path {tmp};\n  client_max_body_size 32m;\n  client_body_buffer_size 1m;\n  upstream engines {{\n{upstreams}    keepalive 64;\n  }}\n  server {{\n    listen 127.0.0.1:{NGINX_PORT};\n    location / {{\n      proxy_pass http://engines;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n",
        pid = dir.join("nginx.pid").display(),
        log = dir.join("nginx-error.log").display(),
        tmp = dir.display(),
    )
}

fn manifests(dir: &Path) -> Result<()> {
    let word_level = crate::workspace_root().join("examples/word-level");
    let mut m = Manifests::new("bench", Sim::new(ENGINES, HTTP_BASE, KV_BASE).specs());
    m.profile = Some((
        "word-level".into(),
        format!(
            "  tokenization: {{mode: local, tokenizer: {{path: \"{}\"}}}}\n",
            word_level.display()
        ),
    ));
    std::fs::write(dir.join("objects.yaml"), m.yaml())?;
    Ok(())
}

/// nginx's master and workers.
fn nginx_pids(master: u32) -> Vec<u32> {
    let mut pids = vec![master];
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
            let ppid = after
                .split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u32>().ok());
            if ppid == Some(master) {
                pids.push(pid);
            }
        }
    }
    pids
}

#[derive(Debug, Default, Clone, Copy)]
struct Wrk {
    requests: f64,
    rps: f64,
    p50_us: f64,
    p99_us: f64,
    errors: f64,
}

fn parse_duration_us(s: &str) -> Option<f64> {
    let (num, unit) = s
        .find(|c: char| c.is_ascii_alphabetic())
        .map(|i| s.split_at(i))?;
    let v: f64 = num.parse().ok()?;
    Some(match unit {
        "us" => v,
        "ms" => v * 1e3,
        "s" => v * 1e6,
        "m" => v * 6e7,
        _ => return None,
    })
}

async fn wrk(wrk: &Path, script: &Path, url: &str, conns: u32, secs: u64) -> Result<Wrk> {
    let out = tokio::process::Command::new(wrk)
        .args([
            "-t",
            if conns > 1 { "2" } else { "1" },
            "-c",
            &conns.to_string(),
            "-d",
            &format!("{secs}s"),
            "--latency",
            "-s",
        ])
        .arg(script)
        .arg(url)
        .output()
        .await
        .context("running wrk")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut w = Wrk::default();
    for line in text.lines() {
        let t: Vec<&str> = line.split_whitespace().collect();
        match t.as_slice() {
            ["50%", v] => w.p50_us = parse_duration_us(v).unwrap_or(f64::NAN),
            ["99%", v] => w.p99_us = parse_duration_us(v).unwrap_or(f64::NAN),
            ["Requests/sec:", v] => w.rps = v.parse().unwrap_or(0.0),
            [n, "requests", "in", ..] => w.requests = n.parse().unwrap_or(0.0),
            ["Non-2xx", "or", "3xx", "responses:", n] => w.errors = n.parse().unwrap_or(0.0),
            _ => {}
        }
    }
    if w.requests == 0.0 {
        bail!(
            "wrk made no requests:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(w)
}

pub(crate) fn run(opts: Options) -> Result<ExitCode> {
    procs::run_until_ctrl_c(bench(opts))
}

async fn bench(opts: Options) -> Result<ExitCode> {
    let wrk_bin = which("wrk", "apt-get install wrk")?;
    let nginx_bin = which("nginx", "apt-get install nginx-light")?;
    let root = crate::workspace_root();
    println!("building kinference-sim and kinference-router (release)…");
    let bin = procs::build(&root, true, &["kinference-sim", "kinference-router"])?;
    let dir = root.join("target").join("bench-proxy");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("manifests"))?;
    let script = dir.join("bodies.lua");
    std::fs::write(&script, lua_script(&bodies()))?;
    manifests(&dir.join("manifests"))?;
    std::fs::write(dir.join("nginx.conf"), nginx_conf(&dir))?;

    let sim = Sim::new(ENGINES, HTTP_BASE, KV_BASE).with_args([
        "--step-base-ms",
        "0",
        "--prefill-ms-per-token",
        "0",
        "--decode-ms-per-seq",
        "0",
        "--output-len",
        "fixed:2",
    ]);
    let sim = sim
        .start(&bin, "kinference-sim", &dir.join("sim.log"))
        .await?;
    let router_args = fleet::serve_args(&dir.join("manifests"), "bench", ROUTER, ADMIN, &[]);
    let mut router = fleet::start_router(
        &bin,
        "kinference-router",
        &router_args,
        &[],
        &dir.join("router.log"),
    )?;
    fleet::wait_ready(ADMIN, &mut router).await?;
    let nginx_args = vec![
        "-c".to_owned(),
        dir.join("nginx.conf").display().to_string(),
        "-p".to_owned(),
        dir.display().to_string(),
    ];
    let mut nginx = Proc::spawn("nginx", &nginx_bin, &nginx_args, &dir.join("nginx.log"))?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    nginx.check_running()?;
    // Wait for the tokenizer self-check so local tokenization is in use.
    for _ in 0..100 {
        if let Ok((200, b)) = crate::load::get(&format!("http://{ADMIN}/debug/endpoints")).await
            && String::from_utf8_lossy(&b).contains("\"checked\"")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let direct = format!("http://127.0.0.1:{HTTP_BASE}/v1/chat/completions");
    let via_router = format!("http://{ROUTER}/v1/chat/completions");
    let via_nginx = format!("http://127.0.0.1:{NGINX_PORT}/v1/chat/completions");
    let secs = opts.seconds;
    // Warm: every prefix through the router (tokenizer cache, engines' caches).
    wrk(&wrk_bin, &script, &via_router, 1, 2).await?;
    wrk(&wrk_bin, &script, &via_nginx, 1, 2).await?;
    let router_pid = router.pid().context("router pid")?;
    let npids = nginx_pids(nginx.pid().context("nginx pid")?);
    let ticks = clock_ticks();
    let cpu_seconds = |pid: u32| routing_cpu_seconds(pid, ticks).unwrap_or(0.0);
    let mut rounds = Vec::new();
    for round in 1..=opts.rounds.max(1) {
        println!("round {round}: one connection, then 16, {secs} s each…");
        let d1 = wrk(&wrk_bin, &script, &direct, 1, secs).await?;
        let r1 = wrk(&wrk_bin, &script, &via_router, 1, secs).await?;
        let n1 = wrk(&wrk_bin, &script, &via_nginx, 1, secs).await?;
        let c0 = cpu_seconds(router_pid);
        let r16 = wrk(&wrk_bin, &script, &via_router, 16, secs).await?;
        let router_cpu = (cpu_seconds(router_pid) - c0) / r16.requests;
        let n0: f64 = npids.iter().map(|p| cpu_seconds(*p)).sum();
        let n16 = wrk(&wrk_bin, &script, &via_nginx, 16, secs).await?;
        let nginx_cpu = (npids.iter().map(|p| cpu_seconds(*p)).sum::<f64>() - n0) / n16.requests;
        rounds.push(Round {
            d1,
            r1,
            n1,
            r16,
            n16,
            router_cpu,
            nginx_cpu,
        });
    }
    let med = |f: &dyn Fn(&Round) -> f64| {
        crate::bench::report::median(&rounds.iter().map(f).collect::<Vec<_>>())
    };

    println!(
        "\nmedians of {} rounds\n{:<28} {:>10} {:>10} {:>12} {:>10}",
        rounds.len(),
        "",
        "p50",
        "p99",
        "req/s",
        "errors"
    );
    let rows: [(&str, RoundRun); 5] = [
        ("direct, 1 conn", |r| r.d1),
        ("router, 1 conn", |r| r.r1),
        ("nginx, 1 conn", |r| r.n1),
        ("router, 16 conns", |r| r.r16),
        ("nginx, 16 conns", |r| r.n16),
    ];
    for (name, pick) in rows {
        println!(
            "{name:<28} {:>8.0}µs {:>8.0}µs {:>12.0} {:>10}",
            med(&|r| pick(r).p50_us),
            med(&|r| pick(r).p99_us),
            med(&|r| pick(r).rps),
            rounds.iter().map(|r| pick(r).errors).sum::<f64>()
        );
    }
    let router_added = med(&|r| r.r1.p50_us - r.d1.p50_us);
    let nginx_added = med(&|r| r.n1.p50_us - r.d1.p50_us);
    let (router_cpu, nginx_cpu) = (med(&|r| r.router_cpu), med(&|r| r.nginx_cpu));
    // Ratios within a round, then their median: nginx's own CPU per
    // request moves 20 % between rounds with the machine.
    let cpu_ratio = med(&|r| r.router_cpu / r.nginx_cpu);
    let throughput = med(&|r| r.r16.rps / r.n16.rps);
    let verdict = |met: bool| if met { "met" } else { "missed" };
    println!(
        "\nadded p50 at 1 connection: router {router_added:.0} µs, nginx {nginx_added:.0} µs (goal: router ≤ 1.0 × nginx: {})",
        verdict(router_added <= nginx_added)
    );
    println!(
        "CPU per request at 16 connections: router {:.1} µs, nginx {:.1} µs; router / nginx = {cpu_ratio:.2} (median of the rounds' ratios; goal ≤ 1.2: {})",
        router_cpu * 1e6,
        nginx_cpu * 1e6,
        verdict(cpu_ratio <= 1.2)
    );
    println!(
        "throughput at 16 connections: router / nginx = {throughput:.2} (median of the rounds' ratios; goal ≥ 1.0: {})",
        verdict(throughput >= 1.0)
    );
    println!(
        "load average during the run: {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    // nginx's workers outlive a killed master: ask it to quit.
    let _ = tokio::process::Command::new(&nginx_bin)
        .args(&nginx_args)
        .args(["-s", "quit"])
        .status()
        .await;
    nginx.stop().await;
    router.stop().await;
    sim.stop().await;
    if rounds.iter().any(|r| r.r1.errors + r.r16.errors > 0.0) {
        bail!("the router answered errors; see {}", dir.display());
    }
    Ok(ExitCode::SUCCESS)
}
