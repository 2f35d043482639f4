//! Real engines (kinference-sim, in-process), a manifests directory that
//! describes them, a router started on it, and a small HTTP client.

#![allow(dead_code, unreachable_pub)]

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use clap::Parser as _;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use kinference_router::args::{Args, Command, Running};
use kinference_sim::{SimConfig, SimEngine, SimHandle};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

pub const MODEL: &str = "kinference/sim";
pub const ALIAS: &str = "sim-alias";

/// Starts `n` simulated engines with ephemeral ports.
/// An engine far from the built-in profile (an H100: 6 ms a step, 0.1 ms
/// per decoding sequence, 0.04 ms per prompt token): 10 ms a step, 3 ms
/// per decoding sequence, 0.5 ms per prompt token. A decoding sequence
/// costs it 6 prompt tokens where the profile says 2.5, a step 20 where
/// the profile says 150: calibration's scale cannot fix that shape.
pub const STEP_TRUTH: kinference_sim::LatencyModel = kinference_sim::LatencyModel {
    base_ms: 10.0,
    prefill_ms_per_token: 0.5,
    decode_ms_per_seq: 3.0,
};

/// One engine that steps as [`STEP_TRUTH`] says and answers 24 tokens.
pub async fn step_truth_engine() -> Vec<SimHandle> {
    engines(1, |c| {
        c.latency = STEP_TRUTH;
        c.output = kinference_sim::OutputLen::MaxTokens { default: 24 };
    })
    .await
}

/// Waves of concurrent streams, each with a new prompt (100 + 60 i words
/// for the i-th of its wave): wave w has `first_width + w % 6` of them,
/// and `send(w, i)` says through which router the i-th goes and after
/// what delay. Every one must be answered.
pub async fn stream_waves<'a>(
    waves: usize,
    first_width: usize,
    send: impl Fn(usize, usize) -> (&'a Router, Duration),
) {
    let mut n = 0;
    for wave in 0..waves {
        let width = first_width + wave % 6;
        let sends = (0..width).map(|i| {
            n += 1;
            let body = serde_json::json!({"model": MODEL, "prompt": words(1000 * n, 100 + 60 * i),
                "max_tokens": 24, "stream": true});
            let (via, delay) = send(wave, i);
            let api = via.api();
            async move {
                tokio::time::sleep(delay).await;
                stream_timed(api, "/v1/completions", &body, &[]).await
            }
        });
        for reply in futures::future::join_all(sends.collect::<Vec<_>>()).await {
            assert_eq!(reply.status, 200);
        }
    }
}

/// Teaches `r` the engine's step costs: waves of 1 to 6 concurrent
/// streams through it (a prompt's prefill shares steps with the others'
/// decodes).
pub async fn teach_step_costs(r: &Router) {
    stream_waves(12, 1, |_, _| (r, Duration::ZERO)).await;
}

/// `r`'s step costs (`calibration.steps` of `/debug/endpoints`) once
/// `ready` says so, within `within`.
pub async fn step_costs_when(
    r: &Router,
    within: Duration,
    what: &str,
    ready: impl Fn(&Value) -> bool,
) -> Value {
    eventually(within, what, || async {
        let s = endpoints(r).await["endpoints"][0]["calibration"]["steps"].clone();
        ready(&s).then_some(s)
    })
    .await
}

/// Asserts that `who`'s learnt step costs (`calibration.steps` of
/// `/debug/endpoints`) are in use and within a third of [`STEP_TRUTH`].
pub fn assert_learnt_step_truth(who: &str, steps: &Value) {
    eprintln!("FIGURE learnt step costs, {who}: {steps}");
    for (field, want) in [
        ("prefill_ms_per_token", STEP_TRUTH.prefill_ms_per_token),
        ("decode_ms", STEP_TRUTH.decode_ms_per_seq),
    ] {
        let got = steps[field].as_f64().unwrap();
        assert!(
            got / want > 0.75 && got / want < 1.33,
            "{who}: {field} {got} against the engine's {want}: {steps}"
        );
    }
    assert_eq!(steps["in_use"], true, "{who}: {steps}");
}

/// A router on `addrs` with its admin port at `admin`, asking `peers`
/// (comma-separated) for their load, with `extra` flags.
pub async fn peered(
    addrs: &[EngineAddr],
    opts: &WorkerSetOpts,
    admin: &str,
    peers: &str,
    extra: &[&str],
) -> Router {
    let flags = [&["--admin-addr", admin, "--peers", peers][..], extra].concat();
    router(addrs, opts, &flags).await
}

/// The router's speed probes with `outcome` in its metrics page.
pub fn speed_probes(metrics: &str, outcome: &str) -> u64 {
    sum_of(
        metrics,
        "kinference_router_speed_probes_total",
        &[("outcome", outcome)],
    ) as u64
}

/// The values of metric `name` in a Prometheus text page whose labels
/// include each of `labels`, in page order (read with the project's own
/// parser, [`kinference_api::engine::prometheus`]).
pub fn values_of(text: &str, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
    kinference_api::engine::prometheus::samples(text)
        .filter(|s| s.is(name, labels))
        .map(|s| s.value)
        .collect()
}

/// The sum of [`values_of`]; 0 when there are none.
pub fn sum_of(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    values_of(text, name, labels).iter().sum()
}

/// The first of [`values_of`], if any.
pub fn value_of(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    values_of(text, name, labels).first().copied()
}

/// Makes `sim` `factor` times slower from now on (the simulator's fault
/// injection).
pub async fn slow_down(sim: &SimHandle, factor: f64) {
    sim.inject(&kinference_sim::FaultRequest {
        slowdown: Some(factor),
        ..kinference_sim::FaultRequest::default()
    })
    .await
    .expect("inject a slowdown");
}

pub async fn engines(n: usize, tweak: impl Fn(&mut SimConfig)) -> Vec<SimHandle> {
    let mut out = Vec::new();
    for i in 0..n {
        let mut cfg = SimConfig {
            seed: i as u64,
            ..SimConfig::default()
        };
        tweak(&mut cfg);
        out.push(
            SimEngine::spawn(cfg)
                .await
                .expect("simulated engine starts"),
        );
    }
    out
}

/// How the worker set is described.
#[derive(Clone, Debug)]
pub struct WorkerSetOpts {
    /// `spec.profile`.
    pub profile: String,
    /// A RoutingProfile object to write, if any (YAML of its spec).
    pub profile_spec: Option<String>,
    /// `spec.kvBlockSize`.
    pub kv_block_size: u32,
    /// Whether to set `kvEvents`.
    pub kv_events: bool,
    /// Whether `kvEvents` names the port `kv-replay` as its `replayPort`.
    pub replay_port: bool,
}

impl Default for WorkerSetOpts {
    fn default() -> Self {
        Self {
            profile: "default".into(),
            profile_spec: None,
            kv_block_size: 16,
            kv_events: true,
            replay_port: false,
        }
    }
}

/// The engines' addresses as the manifests list them.
#[derive(Clone, Debug)]
pub struct EngineAddr {
    pub http: SocketAddr,
    pub kv: Option<SocketAddr>,
    pub ready: bool,
    /// A port listed as `kv-replay` in the slice.
    pub replay: Option<u16>,
}

impl EngineAddr {
    pub fn of(e: &SimHandle) -> Self {
        Self {
            http: e.http_addr(),
            kv: e.kv_addr(),
            ready: true,
            replay: None,
        }
    }
}

/// The YAML of a pool `test` with one worker set `sim` behind the Service
/// `sim`, one EndpointSlice per engine (their ports differ).
pub fn manifests_yaml(engines: &[EngineAddr], opts: &WorkerSetOpts) -> String {
    let mut y = String::new();
    y.push_str("apiVersion: kinference.buoyant.io/v1alpha1\nkind: InferencePool\nmetadata: {name: test}\nspec:\n  workerSets: [{name: sim}]\n---\n");
    let kv = match (opts.kv_events, opts.replay_port) {
        (true, true) => "  kvEvents: {port: kv, replayPort: kv-replay}\n",
        (true, false) => "  kvEvents: {port: kv}\n",
        _ => "",
    };
    let _ = write!(
        y,
        "apiVersion: kinference.buoyant.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: sim}}\nspec:\n  profile: {}\n  kvBlockSize: {}\n  serviceRef: {{name: sim, port: http}}\n{kv}  models:\n    - name: {MODEL}\n      aliases: [{ALIAS}]\n---\n",
        opts.profile, opts.kv_block_size
    );
    if let Some(spec) = &opts.profile_spec {
        let _ = write!(
            y,
            "apiVersion: kinference.buoyant.io/v1alpha1\nkind: RoutingProfile\nmetadata: {{name: {}}}\nspec:\n{spec}---\n",
            opts.profile
        );
    }
    for (i, e) in engines.iter().enumerate() {
        let mut kv_port = e.kv.map_or(String::new(), |k| {
            format!(", {{name: kv, port: {}}}", k.port())
        });
        if let Some(r) = e.replay {
            let _ = write!(kv_port, ", {{name: kv-replay, port: {r}}}");
        }
        let _ = write!(
            y,
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: sim-{i}\n  labels: {{kubernetes.io/service-name: sim}}\naddressType: IPv4\nports: [{{name: http, port: {}}}{kv_port}]\nendpoints:\n  - addresses: [\"{}\"]\n    conditions: {{ready: {}}}\n---\n",
            e.http.port(),
            e.http.ip(),
            e.ready
        );
    }
    y
}

/// Writes `text` to `dir/objects.yaml` atomically (the router never reads
/// half a file).
pub fn write_manifests(dir: &Path, text: &str) {
    let tmp = dir.join(".objects.yaml.tmp");
    std::fs::write(&tmp, text).expect("write manifests");
    std::fs::rename(&tmp, dir.join("objects.yaml")).expect("rename manifests");
}

/// A router on a manifests directory, with its stop switch.
pub struct Router {
    pub running: Running,
    pub stop: CancellationToken,
    pub dir: tempfile::TempDir,
}

impl Router {
    pub fn api(&self) -> SocketAddr {
        self.running.api_addr
    }

    pub fn admin(&self) -> SocketAddr {
        self.running.admin_addr
    }

    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.running.task).await;
    }
}

/// Starts a router (flags as on the command line) on manifests for `engines`.
pub async fn router(engines: &[EngineAddr], opts: &WorkerSetOpts, extra_flags: &[&str]) -> Router {
    let dir = tempfile::tempdir().expect("temp dir");
    write_manifests(dir.path(), &manifests_yaml(engines, opts));
    let path = dir.path().to_str().expect("utf-8 path").to_owned();
    let mut flags = vec!["--pool", "test", "--manifests", &path];
    flags.extend_from_slice(extra_flags);
    serve(dir, &flags).await
}

/// Starts `kinference-router serve` with `flags` (after the tests' own
/// listen addresses, probe intervals and drain); `dir` lives as long as it.
pub async fn serve(dir: tempfile::TempDir, flags: &[&str]) -> Router {
    let mut argv: Vec<String> = vec!["kinference-router".into(), "serve".into()];
    // The tests' defaults, unless the test gives the flag itself. Tests
    // read decisions from response headers (off by default).
    for (flag, value) in [
        ("--listen", "127.0.0.1:0"),
        ("--admin-addr", "127.0.0.1:0"),
        ("--scrape-interval", "500ms"),
        ("--discovery-interval", "1s"),
        ("--drain", "2s"),
        ("--tokenize-timeout", "2s"),
        ("--debug-headers", "true"),
    ] {
        if !flags.contains(&flag) {
            argv.extend([flag.to_owned(), value.to_owned()]);
        }
    }
    argv.extend(flags.iter().map(|s| (*s).to_owned()));
    let args = Args::try_parse_from(argv).expect("router flags");
    let Command::Serve(serve) = args.command else {
        unreachable!()
    };
    let stop = CancellationToken::new();
    let running = kinference_router::args::start(*serve, stop.clone())
        .await
        .expect("router starts");
    Router { running, stop, dir }
}

#[allow(unused_imports)]
pub use kinference_examples::testing::{eventually, median};

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(hyper_util::rt::TokioExecutor::new()).build(HttpConnector::new())
}

/// A finished response.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn endpoint(&self) -> String {
        self.headers
            .get("x-kinference-endpoint")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Reply {
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client()
        .request(req.body(Full::new(body)).unwrap())
        .await
        .expect("HTTP request");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("HTTP body")
        .to_bytes();
    Reply {
        status,
        headers,
        body,
    }
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    send(
        addr,
        "POST",
        path,
        &[],
        Bytes::from(serde_json::to_vec(body).unwrap()),
    )
    .await
}

pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    send(addr, "GET", path, &[], Bytes::new()).await
}

/// Starts a streaming request and returns the response with its body not read.
pub async fn post_streaming(
    addr: SocketAddr,
    path: &str,
    body: &Value,
) -> http::Response<Incoming> {
    let req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
        .unwrap();
    client().request(req).await.expect("HTTP request")
}

/// A prompt of `words` word-level tokens: `w{start}..`.
pub fn words(start: usize, n: usize) -> String {
    (start..start + n)
        .map(|i| format!("w{}", i % 65_536))
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn chat(model: &str, content: &str, stream: bool, max_tokens: u32) -> Value {
    serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
        "max_tokens": max_tokens,
    })
}

/// The router's view of its endpoints (`/debug/endpoints`).
pub async fn endpoints(r: &Router) -> Value {
    get(r.admin(), "/debug/endpoints").await.json()
}

/// Waits until every engine is known, healthy, has its models, and (when
/// `kv`) its KV-event stream connected.
pub async fn wait_routable(r: &Router, n: usize, kv: bool) {
    eventually(Duration::from_secs(20), "endpoints routable", || async {
        let e = endpoints(r).await;
        let eps = e["endpoints"].as_array()?;
        let ok = eps.len() == n
            && eps.iter().all(|ep| {
                ep["healthy"] == true
                    && !ep["models"].as_array().is_none_or(Vec::is_empty)
                    && (!kv
                        || ep["kv"].as_array().is_some_and(|k| {
                            !k.is_empty() && k.iter().all(|s| s["connected"] == true)
                        }))
            });
        // Not while the view is being rebuilt with models just discovered
        // (a LoRA adapter would not resolve yet).
        // Nor while the engines' speed probes run (crate::speed): requests
        // would race them.
        let rebuilding = e["not_ready_because"]
            .as_str()
            .is_some_and(|w| w.contains("newly discovered models") || w.contains("speed probe"));
        (ok && e["ready"] == true && !rebuilding).then_some(())
    })
    .await;
}

/// The router binary as a child process on a manifests directory (its
/// memory and logs apart from the test's), killed on drop.
pub struct RouterProc {
    pub child: std::process::Child,
    pub api: SocketAddr,
    pub admin: SocketAddr,
    pub log: std::path::PathBuf,
    pub dir: tempfile::TempDir,
}

impl RouterProc {
    /// Starts `kinference-router serve` for `engines` with `extra_flags`,
    /// logging at `rust_log` into a file, and waits until every engine is
    /// routable.
    pub async fn start(
        engines: &[EngineAddr],
        opts: &WorkerSetOpts,
        extra_flags: &[&str],
        rust_log: &str,
    ) -> Self {
        Self::start_with_env(engines, opts, extra_flags, rust_log, &[]).await
    }

    /// The same, with `env` added to the process's environment.
    pub async fn start_with_env(
        engines: &[EngineAddr],
        opts: &WorkerSetOpts,
        extra_flags: &[&str],
        rust_log: &str,
        env: &[(&str, &str)],
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        write_manifests(dir.path(), &manifests_yaml(engines, opts));
        let log = dir.path().join("router.log");
        let port = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port()
        };
        let (api, admin) = (port(), port());
        let out = std::fs::File::create(&log).expect("log file");
        let mut args: Vec<String> = [
            "serve",
            "--pool",
            "test",
            "--manifests",
            dir.path().to_str().expect("utf-8 path"),
            "--listen",
            &format!("127.0.0.1:{api}"),
            "--admin-addr",
            &format!("127.0.0.1:{admin}"),
            "--scrape-interval",
            "500ms",
            "--debug-headers",
            "true",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        args.extend(extra_flags.iter().map(|s| (*s).to_owned()));
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_kinference-router"))
            .args(&args)
            .env("KINFERENCE_LOG", rust_log)
            .envs(env.iter().copied())
            .stdout(out.try_clone().expect("log file"))
            .stderr(out)
            .spawn()
            .expect("the router binary starts");
        let p = RouterProc {
            child,
            api: format!("127.0.0.1:{api}").parse().expect("address"),
            admin: format!("127.0.0.1:{admin}").parse().expect("address"),
            log,
            dir,
        };
        let n = engines.len();
        let admin = p.admin;
        eventually(
            Duration::from_secs(30),
            "the router process is ready",
            || async {
                let v = get_json(admin, "/debug/endpoints").await?;
                let eps = v["endpoints"].as_array()?;
                let ok = eps.len() == n
                    && eps.iter().all(|ep| {
                        ep["healthy"] == true
                            && ep["models"].as_array().is_some_and(|m| !m.is_empty())
                    });
                (v["ready"] == true && ok).then_some(())
            },
        )
        .await;
        p
    }

    /// Resident memory of the router process, MiB.
    pub fn rss_mib(&self) -> f64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(f64::NAN, |kb| kb / 1024.0)
    }

    /// Stops it and returns its log.
    pub fn stop(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for RouterProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}

/// `GET` a JSON document, `None` on any failure (for polling).
pub async fn get_json(addr: SocketAddr, path: &str) -> Option<Value> {
    let req = http::Request::get(format!("http://{addr}{path}"))
        .body(Full::new(Bytes::new()))
        .ok()?;
    let resp = client().request(req).await.ok()?;
    let b = resp.into_body().collect().await.ok()?.to_bytes();
    serde_json::from_slice(&b).ok()
}

// ------------------------------------------------ KV-cache audit helpers

/// The block width the KV tests' engines publish.
pub const BLOCK: u32 = 16;

/// A prompt of token ids: `blocks` full blocks, distinct per `n`.
pub fn prompt(n: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| 100 + n * 1000 + i).collect()
}

/// Leading blocks the router's index gives the engine for `ids`.
pub fn router_depth(r: &Router, ids: &[u32]) -> u32 {
    let keys = kinference_kvindex::BlockKeyer::new(BLOCK, None)
        .keys(ids, &kinference_kvindex::ExtraKeys::none());
    r.running.shared.kv.index().find_matches(&keys).max_blocks()
}

/// Leading blocks the engine really holds. (Asked with one more token: like
/// vLLM, the engine never counts a prompt's last token as a hit, so a prompt
/// of whole blocks would hit one block less than it holds.)
pub fn truth_depth(sim: &SimHandle, ids: &[u32]) -> u32 {
    let mut q = ids.to_vec();
    q.push(7);
    (sim.cached_prefix_tokens(&q)[0] / BLOCK as usize) as u32
}

/// Waits until the router has applied every batch the engine published:
/// its publisher has numbered every batch the engine handed it (the sim
/// hands a step's batch over before the step's tokens, as vLLM does, so
/// this covers every response seen so far) and the router's stream has
/// applied the last of them. Before that the router may still claim a
/// block whose `BlockRemoved` is on the wire: the last decode step of a
/// request evicts a block in a batch of its own, after the prompt's
/// `BlockStored` that makes the fresh prompts agree.
pub async fn settled(r: &Router, sim: &SimHandle, when: &str) {
    eventually(
        Duration::from_secs(10),
        &format!("router applied every batch the engine published ({when})"),
        || async {
            let truth = sim.cache_truth(false);
            let e = endpoints(r).await;
            let ep = e["endpoints"]
                .as_array()?
                .iter()
                .find(|ep| ep["endpoint"] == sim.http_addr().to_string())?;
            truth
                .engines
                .iter()
                .all(|rank| {
                    let Some(p) = &rank.publisher else {
                        return true;
                    };
                    let applied = ep["kv"][rank.rank as usize]["last_seq"].as_u64();
                    p.pending == 0 && p.next_seq.checked_sub(1) == applied
                })
                .then_some(())
        },
    )
    .await;
}

/// Sends `ids` as a completion prompt and expects a 200.
pub async fn send_prompt(r: &Router, ids: &[u32]) {
    let reply = post(
        r.api(),
        "/v1/completions",
        &serde_json::json!({"model": MODEL, "prompt": ids, "max_tokens": 2}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

// ------------------------------------------------------- stream readers

/// How a streamed body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// `data: [DONE]` then the end of the body.
    Complete,
    /// The body ended without `[DONE]`: a truncated stream.
    Truncated,
    /// The body failed (the connection was cut): the client sees an error.
    Error,
    /// Nothing for longer than the patience given.
    Hang,
}

pub async fn read_stream(mut body: Incoming, patience: Duration) -> (Ending, String) {
    let mut text = String::new();
    loop {
        match tokio::time::timeout(patience, body.frame()).await {
            Err(_) => return (Ending::Hang, text),
            Ok(None) => {
                let e = if text.trim_end().ends_with("data: [DONE]") {
                    Ending::Complete
                } else {
                    Ending::Truncated
                };
                return (e, text);
            }
            Ok(Some(Err(_))) => return (Ending::Error, text),
            Ok(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    text.push_str(&String::from_utf8_lossy(d));
                }
            }
        }
    }
}

/// Runs `script` with the `openai` Python package (`python3`, or `$PYTHON`)
/// and `args`, and returns the JSON it prints; fails with install advice
/// when the package is missing.
pub async fn openai_python(script: &str, args: &[&str]) -> Value {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let check = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .output();
    match check {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "this test needs the `openai` Python package: pip install openai ({})",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => {
            panic!("this test needs python3 with the `openai` package ({e}): pip install openai")
        }
    }
    let out = tokio::process::Command::new(&python)
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .await
        .expect("run python");
    assert!(
        out.status.success(),
        "python client failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the client prints JSON")
}

/// A loopback address with a port free now.
pub fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("address").to_string()
}

/// A streamed response read to its end, timed from the moment it was sent.
#[derive(Debug)]
pub struct Timed {
    pub status: u16,
    pub headers: http::HeaderMap,
    /// Sending to the first non-empty data.
    pub ttft: Option<Duration>,
    /// Every byte of the body.
    pub body: Vec<u8>,
    /// Sending to the end of the body.
    pub took: Duration,
}

impl Timed {
    /// The engine that served it (`x-kinference-endpoint`), or "".
    pub fn endpoint(&self) -> String {
        self.headers
            .get("x-kinference-endpoint")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned()
    }

    /// TTFT in milliseconds.
    pub fn ttft_ms(&self) -> Option<f64> {
        self.ttft.map(|d| d.as_secs_f64() * 1000.0)
    }
}

/// POSTs `body` with `headers` and reads the (streamed) answer to its end,
/// noting when its first data came.
pub async fn stream_timed(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Timed {
    let started = tokio::time::Instant::now();
    let mut req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
        .unwrap();
    let resp = client().request(req).await.expect("HTTP request");
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    let mut stream = resp.into_body();
    let (mut ttft, mut out) = (None, Vec::new());
    while let Some(Ok(f)) = stream.frame().await {
        if let Some(d) = f.data_ref() {
            if ttft.is_none() && !d.is_empty() {
                ttft = Some(started.elapsed());
            }
            out.extend_from_slice(d);
        }
    }
    Timed {
        status,
        headers,
        ttft,
        body: out,
        took: started.elapsed(),
    }
}
