//! The reliability suite, CI-sized: engines that die, hang, refuse or
//! crawl; KV-event streams that restart, skip, stall or flood. Each test
//! asserts on outcomes (what clients receive, no stale cache state, no
//! leaked load) and prints its figures (times, shares) for
//! `docs/reliability.md`; `cargo xtask bench faults` runs the same
//! scenarios on release builds, several times, with medians.

// Scenario code: short names (`r` router, `a` audit, `t` time, `k` prompt
// number) keep the steps readable.
#![allow(clippy::many_single_char_names)]

mod support;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use kinference_kvindex::{BlockKeyer, ExtraKeys, key};
use kinference_router::metrics::RetryLabels;
use kinference_sim::{FaultRequest, SimHandle};
use serde_json::json;
use support::*;
use tokio::time::Instant;

// ---------------------------------------------------------------- helpers

fn retries(r: &Router, reason: &'static str) -> u64 {
    r.running
        .shared
        .metrics
        .retries
        .get_or_create(&RetryLabels { reason })
        .get()
}

/// The router's in-flight requests over all endpoints, from `/debug/endpoints`.
async fn in_flight(r: &Router) -> u64 {
    let e = endpoints(r).await;
    e["endpoints"].as_array().map_or(0, |eps| {
        eps.iter()
            .filter_map(|ep| ep["load"]["requests"].as_u64())
            .sum()
    })
}

async fn wait_no_load(r: &Router) {
    eventually(
        Duration::from_secs(10),
        "in-flight back to zero",
        || async { (in_flight(r).await == 0).then_some(()) },
    )
    .await;
}

/// A TCP listener that accepts connections and never answers: a hung
/// engine. Connections are held open until the returned task is aborted.
async fn black_hole() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            held.push(s);
        }
    });
    (addr, task)
}

/// An HTTP server that answers every request with 503 (an engine that is
/// overloaded or draining).
async fn always_503() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        // Refusing work is not being dead: /health stays 200,
                        // as with vLLM's admission control.
                        let healthy = req.uri().path() == "/health";
                        let body = if healthy {
                            ""
                        } else {
                            r#"{"error":{"message":"overloaded","type":"service_unavailable","param":null,"code":503}}"#
                        };
                        Ok::<_, std::convert::Infallible>(
                            http::Response::builder()
                                .status(if healthy { 200 } else { 503 })
                                .header("content-type", "application/json")
                                .body(http_body_util::Full::new(Bytes::from_static(
                                    body.as_bytes(),
                                )))
                                .unwrap(),
                        )
                    },
                );
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                .await;
            });
        }
    });
    (addr, task)
}

fn fake(http: SocketAddr) -> EngineAddr {
    EngineAddr {
        http,
        kv: None,
        ready: true,
        replay: None,
    }
}

// ------------------------------------------------------- KV audit helpers

/// The block keys of everything the engine has cached, from its own truth
/// (`/debug/cache?tokens=1`): each block's key chains over its ancestors.
/// Blocks whose parent is no longer cached cannot be keyed; they are
/// counted (the router cannot key them either).
fn truth_keys(sim: &SimHandle) -> (HashSet<u64>, usize) {
    let truth = sim.cache_truth(true);
    let keyer = BlockKeyer::new(BLOCK, None);
    let extra = ExtraKeys::none().digest_for_block(0, BLOCK as usize);
    let mut out = HashSet::new();
    let mut orphans = 0;
    for rank in &truth.engines {
        let blocks = rank.blocks.as_deref().unwrap_or_default();
        let by_hash: HashMap<u64, &kinference_sim::BlockTruth> =
            blocks.iter().map(|b| (b.hash, b)).collect();
        let mut keys: HashMap<u64, u64> = HashMap::new();
        for b in blocks {
            // Walk up to a keyed ancestor or the root, then key downwards.
            let mut path = vec![b];
            let mut prev = keyer.seed();
            let mut ok = true;
            loop {
                let cur = path[path.len() - 1];
                match cur.parent {
                    None => break,
                    Some(p) => {
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
                }
            }
            if !ok {
                orphans += 1;
                continue;
            }
            for cur in path.iter().rev() {
                let toks = cur.tokens.as_deref().unwrap_or_default();
                let k = key::chain(prev, key::local_hash(toks, extra)).0;
                keys.insert(cur.hash, k);
                prev = k;
            }
        }
        out.extend(keys.values());
    }
    (out, orphans)
}

/// The block keys the router's index holds for the engine (every rank).
fn router_keys(r: &Router, sim: &SimHandle) -> HashSet<u64> {
    let me = sim.http_addr().to_string();
    let kv = r.running.shared.kv.index();
    kv.workers()
        .into_iter()
        .filter(|(_, w)| w.endpoint == me)
        .flat_map(|(id, _)| kv.worker_keys(id))
        .map(|k| k.0)
        .collect()
}

/// The router's view of one engine against the engine's truth (printed
/// whole in the figures).
#[derive(Debug, Clone, Copy, Default)]
#[allow(dead_code)]
struct Audit {
    /// Keys the router holds.
    router: usize,
    /// Keys the engine holds (that can be keyed).
    truth: usize,
    /// Held by the router, not by the engine: would misroute.
    stale: usize,
    /// Held by the engine, unknown to the router: a missed hit.
    missing: usize,
    /// Engine blocks whose parent is gone (not keyable).
    orphans: usize,
}

fn audit(r: &Router, sim: &SimHandle) -> Audit {
    let (truth, orphans) = truth_keys(sim);
    let ours = router_keys(r, sim);
    Audit {
        router: ours.len(),
        truth: truth.len(),
        stale: ours.difference(&truth).count(),
        missing: truth.difference(&ours).count(),
        orphans,
    }
}

/// Waits until the router holds no stale block of `sim` and knows the
/// `fresh` prompts as deeply as the engine does; returns how long that took
/// and the final audit. Panics (with the audit) when it never happens.
async fn converge(
    r: &Router,
    sim: &SimHandle,
    fresh: &[Vec<u32>],
    what: &str,
) -> (Duration, Audit) {
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(15);
    loop {
        let a = audit(r, sim);
        let fresh_ok = fresh
            .iter()
            .all(|p| router_depth(r, p) == truth_depth(sim, p));
        if a.stale == 0 && fresh_ok {
            return (t0.elapsed(), a);
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the router did not converge on the engine's cache within 15 s: {a:?}, fresh prompts known: {fresh_ok}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn kv_router(sim: &SimHandle, flags: &[&str]) -> Router {
    let opts = WorkerSetOpts {
        kv_block_size: BLOCK,
        ..WorkerSetOpts::default()
    };
    let r = router(&[EngineAddr::of(sim)], &opts, flags).await;
    wait_routable(&r, 1, true).await;
    r
}

async fn small_cache_engine(replay: bool) -> SimHandle {
    engines(1, |c| {
        c.engine.num_gpu_blocks = 96;
        c.max_model_len = 1024;
        // vLLM and SGLang start without a replay socket unless configured.
        if let Some(kv) = c.kv_events.take() {
            c.kv_events = Some(if replay {
                kv.with_replay(0)
            } else {
                kv.without_replay()
            });
        }
    })
    .await
    .remove(0)
}

/// Fills the cache past its size so evictions are part of the stream.
async fn warm(r: &Router, n0: u32) -> Vec<Vec<u32>> {
    let ps: Vec<Vec<u32>> = (n0..n0 + 12).map(|k| prompt(k, 10)).collect();
    for p in &ps {
        send_prompt(r, p).await;
    }
    ps
}

fn kv_health(e: &serde_json::Value) -> serde_json::Value {
    e["endpoints"][0]["kv"][0].clone()
}

// ------------------------------------------------------------- scenarios

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_killed_mid_stream() {
    let mut sims = engines(3, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 3, true).await;

    // Streams on every engine; the engine of the first one dies.
    let mut streams = Vec::new();
    for k in 0..9 {
        let resp = post_streaming(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &words(k * 500, 50), true, 1500),
        )
        .await;
        assert_eq!(resp.status(), 200);
        let ep = resp.headers()["x-kinference-endpoint"]
            .to_str()
            .unwrap()
            .to_owned();
        streams.push((ep, resp.into_body()));
    }
    // A non-streaming request in flight on the victim too.
    let victim = streams[0].0.clone();
    let i = sims
        .iter()
        .position(|s| s.http_addr().to_string() == victim)
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let dead = sims.remove(i);
    let killed_at = Instant::now();
    dead.shutdown().await;

    // Every stream read to its end at once, each timed from the kill.
    let readers: Vec<_> = streams
        .into_iter()
        .map(|(ep, body)| {
            tokio::spawn(async move {
                let (ending, text) = read_stream(body, Duration::from_secs(30)).await;
                (ep, ending, text.len(), killed_at.elapsed())
            })
        })
        .collect();

    // Meanwhile new requests, one after another: all succeed; count the
    // attempts that still went to the dead engine (connect refused,
    // retried) and when the last one was.
    let mut last_attempt: Option<Duration> = None;
    let mut attempts = 0;
    let mut n = 0;
    while killed_at.elapsed() < Duration::from_secs(3) {
        let before = retries(&r, "connect");
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &words(9000 + n * 100, 30), false, 2),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_ne!(reply.endpoint(), victim);
        if retries(&r, "connect") > before {
            attempts += 1;
            last_attempt = Some(killed_at.elapsed());
        }
        n += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut on_victim = Vec::new();
    let mut elsewhere = Vec::new();
    let mut detect = Duration::ZERO;
    for t in readers {
        let (ep, ending, bytes, at) = t.await.unwrap();
        assert!(
            !(ending == Ending::Complete && ep == victim),
            "a stream of the dead engine claimed to be complete"
        );
        if ep == victim {
            on_victim.push((ending, bytes));
            detect = detect.max(at);
        } else {
            elsewhere.push(ending);
        }
    }
    eprintln!(
        "FIGURE killed-engine: streams on the dead engine ended as {on_victim:?} (bytes received); others {elsewhere:?}"
    );
    assert!(!on_victim.is_empty());
    for (e, _) in &on_victim {
        assert_eq!(*e, Ending::Error, "a cut stream must surface as an error");
    }
    for e in &elsewhere {
        assert_eq!(
            *e,
            Ending::Complete,
            "streams on live engines are unaffected"
        );
    }
    let h = endpoints(&r).await;
    let dead_report = h["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|ep| ep["endpoint"] == victim.as_str())
        .cloned()
        .unwrap();
    eprintln!(
        "FIGURE killed-engine: its streams failed at most {detect:?} after the kill; {n} requests in the 3 s after it, {attempts} of them tried the dead engine first (connect refused, retried), the last {last_attempt:?} after the kill; now healthy={} failures={}",
        dead_report["healthy"], dead_report["failures"]
    );
    wait_no_load(&r).await;
    r.shutdown().await;
}

/// Clients against a pool where one engine never answers: every client
/// gets an answer (a success or a clear OpenAI error) within the upstream
/// timeout, streaming or not; prints who got what and the hung engine's
/// health.
async fn never_answers(
    r: &Router,
    hung: &str,
    prefix: &str,
    what: &str,
    upstream_timeout: Duration,
) {
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for k in 0..40u32 {
        let (api, prefix) = (r.api(), prefix.to_owned());
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let stream = k % 2 == 0;
            let resp = post_streaming(
                api,
                "/v1/chat/completions",
                &chat(
                    MODEL,
                    &format!("{prefix} {}", words(k as usize * 300, 20)),
                    stream,
                    4,
                ),
            )
            .await;
            let status = resp.status().as_u16();
            let ep = resp
                .headers()
                .get("x-kinference-endpoint")
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default();
            let (ending, text) = read_stream(resp.into_body(), Duration::from_secs(30)).await;
            (stream, status, ep, ending, started.elapsed(), text)
        }));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut outcomes: HashMap<String, usize> = HashMap::new();
    let mut took = Vec::new();
    for t in tasks {
        let (stream, status, ep, ending, elapsed, text) = t.await.unwrap();
        assert_ne!(ending, Ending::Hang, "a client was left hanging");
        let outcome = if status == 200 && (!stream || ending == Ending::Complete) {
            "ok".to_owned()
        } else if status == 200 {
            assert_ne!(ending, Ending::Truncated, "a cut stream looked complete");
            assert_eq!(ep, hung);
            "stream cut with an error".to_owned()
        } else {
            let v: serde_json::Value = serde_json::from_str(&text).expect("an OpenAI error body");
            assert!(v["error"]["message"].is_string(), "{text}");
            format!("{status}")
        };
        *outcomes
            .entry(format!(
                "{}:{outcome}",
                if stream { "stream" } else { "plain" }
            ))
            .or_default() += 1;
        took.push(elapsed.as_secs_f64());
        assert!(
            elapsed < upstream_timeout + Duration::from_secs(5),
            "a client waited {elapsed:?}: longer than the upstream timeout ({upstream_timeout:?}) allows"
        );
    }
    let e = endpoints(r).await;
    let report = e["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|ep| ep["endpoint"] == hung)
        .cloned()
        .unwrap();
    let mut sorted = took.clone();
    let p50 = median(&mut sorted);
    eprintln!(
        "FIGURE {what}: 40 requests over {:?}: {outcomes:?}; latency p50 {:.2} s, max {:.2} s; the hung engine is now healthy={} failures={}",
        t0.elapsed(),
        p50,
        sorted.last().copied().unwrap_or_default(),
        report["healthy"],
        report["failures"]
    );
    wait_no_load(r).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_accepts_connections_and_never_answers() {
    // The requests sent to it time out (504) after the upstream timeout:
    // probes that time out eject it for new requests, but never abandon
    // the requests already waiting (a busy engine answers probes late too,
    // and is still working on them).
    for timeout in ["2s", "8s"] {
        let sims = engines(2, |_| {}).await;
        let (hole, hole_task) = black_hole().await;
        let mut addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
        addrs.push(fake(hole));
        let r = router(
            &addrs,
            &WorkerSetOpts::default(),
            &["--upstream-timeout", timeout],
        )
        .await;
        // The hung engine never lists its models; wait for the two others.
        eventually(Duration::from_secs(20), "three endpoints known", || async {
            let e = endpoints(&r).await;
            (e["endpoints"].as_array()?.len() == 3 && e["ready"] == true).then_some(())
        })
        .await;
        never_answers(
            &r,
            &hole.to_string(),
            "",
            &format!("hung-engine (black hole, upstream timeout {timeout})"),
            kinference_api::duration::parse_duration(timeout).unwrap(),
        )
        .await;
        eprintln!(
            "FIGURE hung-engine (black hole, upstream timeout {timeout}): retried elsewhere after probes found it unreachable: {}",
            retries(&r, "down")
        );
        hole_task.abort();
        r.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_core_hangs() {
    // The engine's HTTP server answers (probes, stream headers) but its
    // core stops stepping: no token ever comes.
    let sims = engines(3, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(
        &addrs,
        &WorkerSetOpts::default(),
        &["--upstream-timeout", "2s"],
    )
    .await;
    wait_routable(&r, 3, true).await;
    // A long prefix cached on the engine about to hang draws requests to it.
    let prefix = words(60_000, 800);
    let direct = post(
        sims[0].http_addr(),
        "/v1/chat/completions",
        &chat(MODEL, &prefix, false, 1),
    )
    .await;
    assert_eq!(direct.status, 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    sims[0]
        .inject(&FaultRequest {
            stall_ms: Some(600_000),
            ..FaultRequest::default()
        })
        .await
        .unwrap();
    never_answers(
        &r,
        &sims[0].http_addr().to_string(),
        &prefix,
        "hung-engine (core stalled)",
        Duration::from_secs(2),
    )
    .await;
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_answers_503() {
    let sims = engines(2, |_| {}).await;
    let (bad, bad_task) = always_503().await;
    let mut addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    addrs.push(fake(bad));
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    eventually(Duration::from_secs(20), "three endpoints known", || async {
        let e = endpoints(&r).await;
        (e["endpoints"].as_array()?.len() == 3 && e["ready"] == true).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut ok = 0;
    for k in 0..40u32 {
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &words(k as usize * 300, 20), k % 2 == 0, 4),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_ne!(reply.endpoint(), bad.to_string());
        ok += 1;
    }
    let refused = retries(&r, "unavailable");
    eprintln!(
        "FIGURE 503-engine: {ok}/40 requests succeeded; {refused} were refused by the 503 engine first and retried elsewhere"
    );
    assert!(
        refused >= 1,
        "the 503 engine was never tried: the scenario tested nothing"
    );
    wait_no_load(&r).await;
    bad_task.abort();
    r.shutdown().await;
}

/// When every engine refuses (vLLM's admission control answers 503), the
/// router's own 503 tells the client when to come back, as SGLang's router
/// does: `Retry-After`, which OpenAI's SDK honours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_engine_refuses_the_client_is_told_when_to_retry() {
    let (bad, bad_task) = always_503().await;
    let r = router(&[fake(bad)], &WorkerSetOpts::default(), &[]).await;
    eventually(Duration::from_secs(20), "the endpoint known", || async {
        let e = endpoints(&r).await;
        (e["endpoints"].as_array()?.len() == 1 && e["ready"] == true).then_some(())
    })
    .await;
    let reply = post(
        r.api(),
        "/v1/chat/completions",
        &chat(MODEL, "w1 w2", false, 2),
    )
    .await;
    assert_eq!(reply.status, 503, "{}", reply.text());
    assert_eq!(reply.headers["retry-after"], "1");
    assert_eq!(reply.json()["error"]["type"], "service_unavailable");
    bad_task.abort();
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_ten_times_slower() {
    let sims = engines(3, |_| {}).await;
    let slow = sims[0].http_addr().to_string();
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 3, true).await;
    // It slows down while serving (the router's speed probes saw it fast).
    slow_down(&sims[0], 10.0).await;

    // Distinct 600-token prompts (no cache help), 6 clients at a time.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(6));
    let total = 90u32;
    for k in 0..total {
        let permit = sem.clone().acquire_owned().await.unwrap();
        let (api, tx) = (r.api(), tx.clone());
        tokio::spawn(async move {
            let chat = chat(MODEL, &words(k as usize * 700, 600), true, 8);
            let t = stream_timed(api, "/v1/chat/completions", &chat, &[]).await;
            drop(permit);
            let _ = tx.send((k, t.status, t.endpoint(), t.ttft));
        });
    }
    drop(tx);
    let mut per: HashMap<String, Vec<f64>> = HashMap::new();
    let mut order = Vec::new();
    while let Some((k, status, ep, ttft)) = rx.recv().await {
        assert_eq!(status, 200);
        order.push((k, ep.clone()));
        per.entry(ep)
            .or_default()
            .push(ttft.map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0));
    }
    order.sort();
    let slow_first: usize = order[..30].iter().filter(|(_, e)| *e == slow).count();
    let slow_last: usize = order[60..].iter().filter(|(_, e)| *e == slow).count();
    let slow_n = per.get(&slow).map_or(0, Vec::len);
    let mut lines = Vec::new();
    for (ep, v) in &mut per {
        let n = v.len();
        lines.push(format!(
            "{}{}: {n} requests, TTFT p50 {:.0} ms",
            ep,
            if *ep == slow { " (10× slower)" } else { "" },
            median(v)
        ));
    }
    lines.sort();
    eprintln!(
        "FIGURE slow-engine: the slow engine took {slow_n}/{total} requests ({:.0}%; fair share 33%): {slow_first}/30 of the first 30, {slow_last}/30 of the last 30. {}",
        slow_n as f64 * 100.0 / f64::from(total),
        lines.join("; ")
    );
    assert!(
        slow_n < total as usize / 3,
        "routing did not move away from the 10× slower engine: {slow_n}/{total}"
    );
    wait_no_load(&r).await;
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_publisher_restart_with_seq_back_to_zero() {
    // Twice: after a long history (the new publisher's numbers stay below
    // what the router expects), and after a short one (they pass it before
    // the router reconnects: only the disconnect tells a restart from a gap).
    for warm_prompts in [12u32, 1] {
        let sim = small_cache_engine(true).await;
        let r = kv_router(&sim, &[]).await;
        for k in 0..warm_prompts {
            send_prompt(&r, &prompt(k, 10)).await;
        }
        converge(&r, &sim, &[], "warm-up").await;

        // The publisher goes away for 300 ms while requests keep coming
        // (their events are lost), then comes back counting from 0.
        let restart = async {
            sim.inject(&FaultRequest {
                restart_publisher: Some(true),
                restart_down_ms: Some(300),
                ..FaultRequest::default()
            })
            .await
            .unwrap()
        };
        let traffic = async {
            for k in 100..116 {
                send_prompt(&r, &prompt(k, 10)).await;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        };
        let (report, ()) = tokio::join!(restart, traffic);
        assert_eq!(report.restarted, 1);
        let fresh: Vec<Vec<u32>> = (200..203).map(|k| prompt(k, 10)).collect();
        for p in &fresh {
            send_prompt(&r, p).await;
        }
        let (t, a) = converge(&r, &sim, &fresh, "after a publisher restart").await;
        let h = kv_health(&endpoints(&r).await);
        eprintln!(
            "FIGURE kv-restart after {warm_prompts} prompts: converged {t:?} after the last request; {a:?}; stream: restarts {} gaps {} replays {}",
            h["restarts"], h["gaps"], h["replays"]
        );
        r.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_gaps_with_and_without_replay() {
    for replay in [true, false] {
        let sim = small_cache_engine(replay).await;
        let r = kv_router(&sim, &[]).await;
        let _ = warm(&r, 0).await;
        converge(&r, &sim, &[], "warm-up").await;
        let before = audit(&r, &sim);
        // Three batches withheld (kept for replay when there is a replay
        // socket), then traffic.
        sim.inject(&FaultRequest {
            drop_batches: Some(3),
            ..FaultRequest::default()
        })
        .await
        .unwrap();
        let fresh: Vec<Vec<u32>> = (300..306).map(|k| prompt(k, 10)).collect();
        for p in &fresh {
            send_prompt(&r, p).await;
        }
        let (t, a) = converge(&r, &sim, &fresh[3..], "after a gap").await;
        let h = kv_health(&endpoints(&r).await);
        eprintln!(
            "FIGURE kv-gap replay={replay}: converged {t:?} after the last request; before {before:?}; after {a:?}; stream: gaps {} replays {}",
            h["gaps"], h["replays"]
        );
        assert!(h["gaps"].as_u64().unwrap() >= 1, "no gap was seen: {h}");
        r.shutdown().await;
    }
}

fn next_seq(sim: &SimHandle) -> u64 {
    sim.cache_truth(false).engines[0]
        .publisher
        .as_ref()
        .map_or(0, |p| p.next_seq)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_last_batches_missed_while_the_engine_goes_idle() {
    // The batches of the last request before the engine goes idle never
    // reach the router: first withheld on the wire but kept in the replay
    // ring (a slow subscriber, a reconnect), then lost for good (a crashed
    // publisher thread). No later batch reveals the gap.
    for keep in [true, false] {
        let sim = small_cache_engine(true).await;
        let r = kv_router(&sim, &[]).await;
        let _ = warm(&r, 0).await;
        converge(&r, &sim, &[], "warm-up").await;
        // How many batches one such request publishes.
        let s0 = next_seq(&sim);
        send_prompt(&r, &prompt(399, 10)).await;
        let n = next_seq(&sim) - s0;
        converge(&r, &sim, &[], "one more request").await;
        sim.inject(&FaultRequest {
            drop_batches: keep.then_some(n),
            lose_batches: (!keep).then_some(n),
            ..FaultRequest::default()
        })
        .await
        .unwrap();
        send_prompt(&r, &prompt(400, 10)).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let idle = audit(&r, &sim);
        assert!(
            idle.stale > 0,
            "the fault hid nothing: the scenario tests nothing ({idle:?})"
        );
        if keep {
            // The subscriber's idle check replays what it missed.
            let (t, a) = converge(
                &r,
                &sim,
                &[prompt(400, 10)],
                "after missed batches, kept for replay",
            )
            .await;
            eprintln!(
                "FIGURE kv-missed-tail (replayable): {} stale blocks 200 ms after the last request; none {:?} after it; {a:?}",
                idle.stale,
                t + Duration::from_millis(200)
            );
        } else {
            // Unrecoverable until the engine publishes again: the next
            // request it serves reveals the gap.
            tokio::time::sleep(Duration::from_secs(3)).await;
            let still = audit(&r, &sim);
            send_prompt(&r, &prompt(401, 10)).await;
            let (t, a) = converge(
                &r,
                &sim,
                &[prompt(401, 10)],
                "after lost batches, once the engine publishes again",
            )
            .await;
            eprintln!(
                "FIGURE kv-missed-tail (lost): {} stale blocks while the engine is idle ({} after 3 s more); none {t:?} after its next request; {a:?}",
                idle.stale, still.stale
            );
        }
        r.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_publisher_down_for_seconds() {
    // A longer outage (the subscriber's reconnect backs off meanwhile) after
    // a short history: the new publisher's numbers pass the old ones before
    // the router is back.
    let sim = small_cache_engine(true).await;
    let r = kv_router(&sim, &[]).await;
    send_prompt(&r, &prompt(0, 10)).await;
    converge(&r, &sim, &[], "warm-up").await;
    let restart = async {
        sim.inject(&FaultRequest {
            restart_publisher: Some(true),
            restart_down_ms: Some(3000),
            ..FaultRequest::default()
        })
        .await
        .unwrap()
    };
    let traffic = async {
        for k in 100..160 {
            send_prompt(&r, &prompt(k, 10)).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let (report, ()) = tokio::join!(restart, traffic);
    assert_eq!(report.restarted, 1);
    let fresh: Vec<Vec<u32>> = (200..203).map(|k| prompt(k, 10)).collect();
    for p in &fresh {
        send_prompt(&r, p).await;
    }
    let (t, a) = converge(&r, &sim, &fresh, "after a 3 s publisher outage").await;
    let h = kv_health(&endpoints(&r).await);
    eprintln!(
        "FIGURE kv-restart after a 3 s outage: converged {t:?} after the last request; {a:?}; stream: restarts {} gaps {} replays {}",
        h["restarts"], h["gaps"], h["replays"]
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_stalled_publisher_then_resumes() {
    // The publisher withholds 40 batches (a stall) while the engine keeps
    // caching and evicting, then resumes: the router replays the gap.
    let sim = small_cache_engine(true).await;
    let r = kv_router(&sim, &[]).await;
    let _ = warm(&r, 0).await;
    converge(&r, &sim, &[], "warm-up").await;
    sim.inject(&FaultRequest {
        drop_batches: Some(40),
        ..FaultRequest::default()
    })
    .await
    .unwrap();
    let mut max_stale = 0;
    let mut k = 500;
    loop {
        send_prompt(&r, &prompt(k, 10)).await;
        k += 1;
        max_stale = max_stale.max(audit(&r, &sim).stale);
        let pending = sim.cache_truth(false).engines[0]
            .publisher
            .as_ref()
            .unwrap()
            .drop_pending;
        if pending == 0 {
            break;
        }
    }
    let fresh: Vec<Vec<u32>> = (k..k + 2).map(|k| prompt(k, 10)).collect();
    for p in &fresh {
        send_prompt(&r, p).await;
    }
    let (t, a) = converge(&r, &sim, &fresh, "after a stalled publisher").await;
    let h = kv_health(&endpoints(&r).await);
    eprintln!(
        "FIGURE kv-stall: {} requests during the stall, up to {max_stale} stale blocks meanwhile; converged {t:?} after the last request; {a:?}; stream: gaps {} replays {}",
        k - 500,
        h["gaps"],
        h["replays"]
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_event_flood() {
    // Many concurrent requests of long prompts through a small cache: a
    // torrent of stores and evictions, every 7th batch dropped (replayed).
    let sim = engines(1, |c| {
        c.engine.num_gpu_blocks = 256;
        c.max_model_len = 2048;
        c.faults.drop_every = 7;
        c.kv_events = c.kv_events.take().map(|k| k.with_replay(0));
    })
    .await
    .remove(0);
    let r = kv_router(&sim, &[]).await;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for k in 0..120u32 {
        let api = r.api();
        tasks.push(tokio::spawn(async move {
            let reply = post(
                api,
                "/v1/completions",
                &json!({"model": MODEL, "prompt": prompt(k, 40), "max_tokens": 1}),
            )
            .await;
            reply.status
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let took = t0.elapsed();
    let fresh = vec![prompt(1000, 10)];
    send_prompt(&r, &fresh[0]).await;
    let (t, a) = converge(&r, &sim, &fresh, "after a flood").await;
    let truth = sim.cache_truth(false);
    let c = truth.engines[0].counters;
    let h = kv_health(&endpoints(&r).await);
    eprintln!(
        "FIGURE kv-flood: {} batches ({} blocks stored, {} removed) in {took:?}; converged {t:?} after; {a:?}; stream: gaps {} replays {} resets {}",
        h["batches"], c.blocks_stored, c.blocks_removed, h["gaps"], h["replays"], h["restarts"]
    );
    r.shutdown().await;
}
