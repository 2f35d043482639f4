//! Past the knee, with real engines (kinference-sim): evidence from
//! requests still waiting (an engine that slowed down stops getting work
//! before its first tokens arrive), and the router's own admission queue.
//! Each test prints its figures for `docs/admission.md`.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use support::*;
use tokio::time::Instant;

/// These tests measure times on a small machine: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// One streamed request: (status, endpoint, TTFT ms).
async fn one(api: std::net::SocketAddr, k: usize) -> (u16, String, Option<f64>) {
    let chat = chat(MODEL, &words(k * 700, 600), true, 8);
    let t = stream_timed(api, "/v1/chat/completions", &chat, &[]).await;
    (t.status, t.endpoint(), t.ttft_ms())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_mostly_avoids_an_engine_ten_times_slower_before_its_first_token() {
    let _serial = SERIAL.lock().await;
    let sims = engines(3, |_| {}).await;
    let slow = sims[0].http_addr().to_string();
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 3, true).await;
    // The engine slows down after the router's speed probes saw it as fast
    // as the others: only the evidence of requests still waiting tells.
    slow_down(&sims[0], 10.0).await;

    // A burst: 90 distinct 600-token prompts (no cache help), one every
    // 10 ms, every one streamed and none waiting for another. The slow
    // engine's first tokens come only after ~0.6 s; by then it must have
    // stopped getting new work.
    let total = 90usize;
    let mut tasks = Vec::new();
    let start = Instant::now();
    for k in 0..total {
        tokio::time::sleep_until(start + Duration::from_millis(10 * k as u64)).await;
        tasks.push(tokio::spawn(one(r.api(), k)));
    }
    let mut per: HashMap<String, Vec<f64>> = HashMap::new();
    let mut order = Vec::new();
    for (k, t) in tasks.into_iter().enumerate() {
        let (status, ep, ttft) = t.await.unwrap();
        assert_eq!(status, 200);
        order.push((k, ep.clone()));
        per.entry(ep).or_default().push(ttft.unwrap_or(f64::NAN));
    }
    let slow_n = per.get(&slow).map_or(0, Vec::len);
    let slow_after_first_second = order[total / 3..]
        .iter()
        .filter(|(_, e)| *e == slow)
        .count();
    let slow_ks: Vec<usize> = order
        .iter()
        .filter(|(_, e)| *e == slow)
        .map(|(k, _)| *k)
        .collect();
    let mut lines = vec![format!(
        "slow engine's requests (sent every 10 ms): {slow_ks:?}"
    )];
    for (ep, v) in &mut per {
        lines.push(format!(
            "{ep}{}: {} requests, TTFT p50 {:.0} ms",
            if *ep == slow { " (10× slower)" } else { "" },
            v.len(),
            median(v)
        ));
    }
    lines.sort();
    eprintln!(
        "FIGURE slow-engine-burst: the slow engine took {slow_n}/{total} ({:.0}%; fair share 33%), {slow_after_first_second} of the last {}. {}",
        slow_n as f64 * 100.0 / total as f64,
        total - total / 3,
        lines.join("; ")
    );
    assert!(
        slow_n * 100 <= total * 15,
        "the burst did not avoid the 10× slower engine: {slow_n}/{total}"
    );
    assert!(
        slow_after_first_second <= 5,
        "the slow engine still got work after the first 0.3 s: {slow_after_first_second}"
    );
    r.shutdown().await;
}

/// The slow engine's and the others' calibration in `/debug/endpoints`:
/// (scale, speed-probe floor) by address.
async fn calibrations(r: &Router) -> HashMap<String, (f64, Option<f64>)> {
    let e = endpoints(r).await;
    e["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ep| {
            let c = &ep["calibration"];
            (
                ep["endpoint"].as_str().unwrap_or_default().to_owned(),
                (
                    c["scale"].as_f64().unwrap_or(f64::NAN),
                    c["speed_probe_floor"].as_f64(),
                ),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_speed_probe_shows_an_engine_ten_times_slower_before_its_first_request() {
    let _serial = SERIAL.lock().await;
    let sims = engines(3, |_| {}).await;
    // Slow before the router starts: its probes see it.
    slow_down(&sims[0], 10.0).await;
    let slow = sims[0].http_addr().to_string();
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    // Ready only once the probes ended: no request has been sent.
    wait_routable(&r, 3, true).await;
    let c = calibrations(&r).await;
    eprintln!("FIGURE speed probes (scale, floor) per engine, {slow} 10× slower: {c:?}");
    assert_eq!(c.len(), 3, "{c:?}");
    // The slow one predicted about 10× slower than the others (its floor
    // is against the fastest probe; the profile may be off for all three,
    // which is calibration's to learn).
    let slow_scale = c[&slow].0;
    for (addr, (scale, floor)) in &c {
        if *addr == slow {
            assert!(floor.is_some_and(|f| f > 5.0), "{addr}: {c:?}");
        } else {
            assert_eq!(*floor, None, "{addr}: {c:?}");
            assert!(slow_scale > 5.0 * scale, "{addr}: {c:?}");
        }
    }
    let admin = get(r.admin(), "/metrics").await.text();
    assert_eq!(speed_probes(&admin, "ok"), 3, "{admin}");
    // Each engine answered two one-token completions, and nothing else.
    for s in &sims {
        let m = get(s.http_addr(), "/metrics").await.text();
        assert_eq!(sum_of(&m, "vllm:request_success_total", &[]) as u64, 2);
    }
    r.shutdown().await;

    // Without probes, nothing tells the engines apart before a first token.
    let r = router(
        &addrs,
        &WorkerSetOpts::default(),
        &["--speed-probe-tokens", "0"],
    )
    .await;
    wait_routable(&r, 3, true).await;
    let c = calibrations(&r).await;
    assert!(
        c.values()
            .all(|(scale, floor)| floor.is_none() && (*scale - 1.0).abs() < 0.01),
        "{c:?}"
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_speed_probe_fits_a_short_context_and_skips_a_busy_engine() {
    let _serial = SERIAL.lock().await;
    // A context shorter than the probe's 1,024 tokens: the probe shrinks
    // to fit (the engine would answer 400 otherwise).
    let sims = engines(2, |c| c.max_model_len = 300).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 2, true).await;
    let m = get(r.admin(), "/metrics").await.text();
    assert_eq!(speed_probes(&m, "ok"), 2, "{m}");
    r.shutdown().await;

    // An engine already serving (a stream another client keeps open) is
    // not probed: its answer would be its queue's length.
    let sims = engines(2, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let long = chat(MODEL, &words(0, 200), true, 4000);
    let api = sims[0].http_addr();
    let open =
        tokio::spawn(async move { stream_timed(api, "/v1/chat/completions", &long, &[]).await });
    eventually(Duration::from_secs(5), "the stream running", || async {
        let m = get(sims[0].http_addr(), "/metrics").await.text();
        (sum_of(&m, "vllm:num_requests_running", &[]) >= 1.0).then_some(())
    })
    .await;
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 2, true).await;
    let m = get(r.admin(), "/metrics").await.text();
    assert_eq!(speed_probes(&m, "busy"), 1, "{m}");
    assert_eq!(speed_probes(&m, "ok"), 1, "{m}");
    open.abort();
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_knee_admission_holds_requests_in_the_router_and_answers_429_before_any_engine() {
    let _serial = SERIAL.lock().await;
    let sims = engines(2, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let opts = WorkerSetOpts {
        profile: "admitted".into(),
        profile_spec: Some(
            "  admission: {maxPredictedTtftMillis: 300, maxQueue: 20, maxWaitMillis: 3000}\n"
                .into(),
        ),
        ..WorkerSetOpts::default()
    };
    let r = router(&addrs, &opts, &[]).await;
    wait_routable(&r, 2, true).await;

    // Below the knee nothing waits.
    let t = Instant::now();
    let (status, _, _) = one(r.api(), 10_000).await;
    assert_eq!(status, 200);
    assert!(t.elapsed() < Duration::from_secs(1));

    // 150 distinct 600-token prompts at once: several seconds of work for
    // two engines.
    let total = 150usize;
    let tasks: Vec<_> = (0..total)
        .map(|k| {
            let api = r.api();
            tokio::spawn(async move {
                let chat = chat(MODEL, &words(k * 700, 600), true, 8);
                let t = stream_timed(api, "/v1/chat/completions", &chat, &[]).await;
                let retry_after = t
                    .headers
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse::<u64>().ok());
                (t.status, retry_after, t.ttft_ms(), t.body, t.took)
            })
        })
        .collect();
    let (mut ok, mut rejected, mut reasons) = (0usize, 0usize, HashMap::<String, usize>::new());
    let mut ttfts = Vec::new();
    let mut longest = Duration::ZERO;
    for t in tasks {
        let (status, retry_after, ttft, text, took) = t.await.unwrap();
        longest = longest.max(took);
        match status {
            200 => {
                ok += 1;
                ttfts.push(ttft.unwrap_or(f64::NAN));
            }
            429 => {
                rejected += 1;
                let v: serde_json::Value = serde_json::from_slice(&text).unwrap();
                assert_eq!(v["error"]["type"], "rate_limit_exceeded", "{v}");
                let code = v["error"]["code"].as_str().unwrap().to_owned();
                assert!(code == "queue_full" || code == "deadline", "{v}");
                assert!(
                    retry_after.is_some_and(|s| s >= 1),
                    "429 without Retry-After"
                );
                *reasons.entry(code).or_default() += 1;
            }
            s => panic!("unexpected status {s}"),
        }
    }
    let p90 = {
        ttfts.sort_by(f64::total_cmp);
        ttfts[ttfts.len() * 9 / 10]
    };
    let admin = get(r.admin(), "/metrics").await.text();
    let mut engine_saw = 0.0;
    for s in &sims {
        let m = get(s.http_addr(), "/metrics").await.text();
        engine_saw += sum_of(&m, "vllm:request_success_total", &[]);
    }
    eprintln!(
        "FIGURE admission: {ok}/{total} served (TTFT p90 {p90:.0} ms), {rejected} answered 429 ({reasons:?}); engines served {engine_saw}; slowest answer {:.1} s",
        longest.as_secs_f64()
    );
    assert!(ok > 0 && rejected > 0, "{ok} ok, {rejected} rejected");
    assert_eq!(ok + rejected, total);
    assert_eq!(
        sum_of(&admin, "kinference_router_rejections_total", &[]) as usize,
        rejected
    );
    // No engine saw a rejected request: the engines served the 150 − 429s
    // plus the first one, besides the two speed probes each engine answered
    // as it joined.
    let probes = 2 * speed_probes(&admin, "ok") as usize;
    assert_eq!(probes, 2 * sims.len(), "{admin}");
    assert_eq!(engine_saw as usize - probes, ok + 1);
    // Every request was answered or rejected within its deadline (3 s wait
    // plus the engine's own time for those sent).
    assert!(longest < Duration::from_secs(8), "{longest:?}");
    assert!(sum_of(&admin, "kinference_router_queue_wait_seconds_count", &[]) > 0.0);
    assert!(sum_of(&admin, "kinference_router_queue_depth", &[]).abs() < 0.5);
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttft_target_header_bounds_one_request_without_any_profile() {
    let _serial = SERIAL.lock().await;
    let sims = engines(1, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 1, true).await;
    let body =
        bytes::Bytes::from(serde_json::to_vec(&chat(MODEL, &words(0, 600), false, 4)).unwrap());
    // A generous target: sent at once.
    let reply = send(
        r.api(),
        "POST",
        "/v1/chat/completions",
        &[("x-kinference-ttft-target-ms", "5000")],
        body.clone(),
    )
    .await;
    assert_eq!(reply.status, 200);
    // One no engine can meet (even idle, a first token takes more than
    // 1 ms): 429 at its deadline, the engine never asked.
    let t = Instant::now();
    let reply = send(
        r.api(),
        "POST",
        "/v1/chat/completions",
        &[("x-kinference-ttft-target-ms", "1")],
        body,
    )
    .await;
    assert_eq!(reply.status, 429, "{}", reply.text());
    assert!(t.elapsed() < Duration::from_secs(1));
    assert_eq!(reply.json()["error"]["code"], "deadline");
    assert!(reply.headers.contains_key("retry-after"));
    let m = get(sims[0].http_addr(), "/metrics").await.text();
    // The first request, and the two speed probes of the engine's joining.
    assert_eq!(sum_of(&m, "vllm:request_success_total", &[]) as u64, 3);
    r.shutdown().await;
}

/// One streamed request for `tenant`: (status, TTFT ms).
async fn as_tenant(api: std::net::SocketAddr, k: usize, tenant: &str) -> (u16, Option<f64>) {
    let chat = chat(MODEL, &words(k * 700, 600), true, 8);
    let t = stream_timed(
        api,
        "/v1/chat/completions",
        &chat,
        &[("x-kinference-tenant", tenant)],
    )
    .await;
    (t.status, t.ttft_ms())
}

fn p90(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() * 9 / 10).copied().unwrap_or(f64::NAN)
}

/// `n` requests for `tenant`, one every `every`, from prompt `first` on.
async fn stream_of(
    api: std::net::SocketAddr,
    tenant: &'static str,
    first: usize,
    n: usize,
    every: Duration,
) -> Vec<(u16, Option<f64>)> {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..n {
        tokio::time::sleep_until(start + every * i as u32).await;
        tasks.push(tokio::spawn(as_tenant(api, first + i, tenant)));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_light_tenant_keeps_its_ttft_while_a_heavy_one_floods_at_ten_times_its_rate() {
    let _serial = SERIAL.lock().await;
    let sims = engines(2, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let opts = WorkerSetOpts {
        profile: "fair".into(),
        profile_spec: Some(
            "  admission: {maxPredictedTtftMillis: 150, maxQueue: 400, maxWaitMillis: 10000}\n"
                .into(),
        ),
        ..WorkerSetOpts::default()
    };
    let r = router(&addrs, &opts, &[]).await;
    wait_routable(&r, 2, true).await;
    let every = Duration::from_millis(200);

    // Alone: 5 requests per second for 4 s.
    let alone = stream_of(r.api(), "light", 0, 20, every).await;
    let mut alone_ttft: Vec<f64> = alone.iter().filter_map(|(_, t)| *t).collect();
    assert!(alone.iter().all(|(s, _)| *s == 200));
    let alone_p90 = p90(&mut alone_ttft);

    // With a heavy tenant at 10× its rate (50 per second: past the two
    // engines' capacity of ~35 such prompts per second).
    let api = r.api();
    let heavy = tokio::spawn(stream_of(api, "heavy", 1000, 200, every / 10));
    let light = stream_of(api, "light", 100, 20, every).await;
    let heavy = heavy.await.unwrap();
    let mut light_ttft: Vec<f64> = light.iter().filter_map(|(_, t)| *t).collect();
    let light_ok = light.iter().filter(|(s, _)| *s == 200).count();
    let light_p90 = p90(&mut light_ttft);
    let heavy_ok = heavy.iter().filter(|(s, _)| *s == 200).count();
    let heavy_429 = heavy.iter().filter(|(s, _)| *s == 429).count();
    let mut heavy_ttft: Vec<f64> = heavy.iter().filter_map(|(_, t)| *t).collect();
    let heavy_p90 = p90(&mut heavy_ttft);
    eprintln!(
        "FIGURE two-tenants: light alone TTFT p90 {alone_p90:.0} ms; with heavy at 10x: light {light_ok}/20 ok, p90 {light_p90:.0} ms ({:.2}x alone); heavy {heavy_ok}/200 ok (p90 {heavy_p90:.0} ms), {heavy_429} answered 429",
        light_p90 / alone_p90
    );
    assert_eq!(light_ok, 20, "the light tenant lost requests");
    // The light tenant's requests go first in the router's queue; what is
    // left is the engines' own queue, kept near the bound (the goal
    // of 1.5x alone is not reached: see docs/admission.md).
    assert!(
        light_p90 <= 5.0 * alone_p90.max(50.0),
        "the light tenant's p90 went from {alone_p90:.0} to {light_p90:.0} ms"
    );
    assert!(
        light_p90 * 4.0 < heavy_p90,
        "the heavy tenant should wait, not the light one: {light_p90:.0} vs {heavy_p90:.0} ms"
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_and_models_name_tenants_and_a_heavier_tenant_is_released_first() {
    let _serial = SERIAL.lock().await;
    let sims = engines(1, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let secrets = tempfile::tempdir().unwrap();
    let keys = secrets.path().join("keys");
    std::fs::write(
        &keys,
        "# the operator's keys\nsk-first tenant=first\nsk-gold tenant=gold priority=0\nsk-free tenant=free\nsk-plain\n",
    )
    .unwrap();
    // The latency model as configured, not calibrated: an idle engine is
    // predicted within the bound for one 1000-token prompt, one with such a
    // prompt in flight is not. Requests are then released one at a time,
    // and their first tokens come in the order of release.
    let opts = WorkerSetOpts {
        profile: "tenants".into(),
        profile_spec: Some(format!(
            "  latency: {{prefillTokensPerSecond: 11000, baseMillis: 0, decodeCostMillis: 0, calibrate: false}}\n  admission:\n    maxPredictedTtftMillis: 140\n    maxWaitMillis: 30000\n    tenants:\n      - {{name: gold, weight: 4, models: [{ALIAS}]}}\n"
        )),
        ..WorkerSetOpts::default()
    };
    let r = router(&addrs, &opts, &["--api-keys-file", keys.to_str().unwrap()]).await;
    wait_routable(&r, 1, true).await;
    // The engine is 5× slower than the model says: the first request takes
    // about half a second, and the others queue in the router meanwhile.
    slow_down(&sims[0], 5.0).await;
    let api = r.api();
    let send_as =
        |k: usize, key: &'static str, model: &'static str, claim: Option<&'static str>| {
            tokio::spawn(async move {
                let body = chat(model, &words(k * 1100, 1000), true, 2);
                let auth = format!("Bearer {key}");
                let mut headers = vec![("authorization", auth.as_str())];
                if let Some(t) = claim {
                    headers.push(("x-kinference-tenant", t));
                }
                let sent = Instant::now();
                let t = stream_timed(api, "/v1/chat/completions", &body, &headers).await;
                (t.status, t.ttft.map(|d| sent + d))
            })
        };
    let first = send_as(0, "sk-first", MODEL, None);
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Twelve requests of the free tenant, whose clients claim the gold
    // tenant by header and ask for the model the profile gives to gold:
    // their key decides. Then four of gold's: two by its key, two by a key
    // naming no tenant, for gold's model.
    let mut tasks = Vec::new();
    for k in 1..=12 {
        tasks.push(("free", send_as(k, "sk-free", ALIAS, Some("gold"))));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for k in 13..=14 {
        tasks.push(("gold", send_as(k, "sk-gold", MODEL, None)));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for k in 15..=16 {
        tasks.push(("gold", send_as(k, "sk-plain", ALIAS, Some("free"))));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, _) = first.await.unwrap();
    assert_eq!(status, 200);
    let mut firsts = Vec::new();
    for (tenant, t) in tasks {
        let (status, at) = t.await.unwrap();
        assert_eq!(status, 200, "{tenant}");
        firsts.push((at.expect("a first token"), tenant));
    }
    firsts.sort_by_key(|(at, _)| *at);
    let order: Vec<&str> = firsts.iter().map(|(_, t)| *t).collect();
    eprintln!("FIGURE tenant-weights: first tokens in the order {order:?}");
    // Start-time fair queueing with weights 4 and 1: free's first, then
    // gold's four (virtual starts 0, ¼, ½, ¾ of one request), then free's
    // others. With equal weights gold's fourth would come eighth; had the
    // header or the model named the tenant, the free requests would have
    // counted as gold's and gold's would have come last.
    let last_gold = order.iter().rposition(|t| *t == "gold").unwrap();
    assert!(
        last_gold < 6,
        "gold's requests were not released first: {order:?}"
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_gives_up_while_held_leaves_the_queue() {
    let _serial = SERIAL.lock().await;
    let sims = engines(1, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let opts = WorkerSetOpts {
        profile: "held".into(),
        // No engine is ever predicted within 1 ms: every request is held.
        profile_spec: Some(
            "  admission: {maxPredictedTtftMillis: 1, maxQueue: 4, maxWaitMillis: 5000}\n".into(),
        ),
        ..WorkerSetOpts::default()
    };
    let r = router(&addrs, &opts, &[]).await;
    wait_routable(&r, 1, true).await;
    let depth = || async {
        sum_of(
            &get(r.admin(), "/metrics").await.text(),
            "kinference_router_queue_depth",
            &[],
        )
    };
    let gone = tokio::time::timeout(Duration::from_millis(300), one(r.api(), 1)).await;
    assert!(gone.is_err(), "held, not answered");
    // Well before its 5 s deadline, the abandoned request has left.
    let t = Instant::now();
    loop {
        if depth().await.abs() < 0.5 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "the abandoned request stayed in the queue"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // And it took no place: four more fit.
    let held: Vec<_> = (0..4).map(|k| tokio::spawn(one(r.api(), 10 + k))).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!((depth().await - 4.0).abs() < 0.5);
    let (status, _, _) = one(r.api(), 20).await;
    assert_eq!(status, 429, "the fifth finds the queue full");
    for h in held {
        h.abort();
    }
    r.shutdown().await;
}
