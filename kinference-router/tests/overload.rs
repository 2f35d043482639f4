//! Past the knee, with real engines (kinference-sim): evidence from
//! requests still waiting (an engine that slowed down stops getting work
//! before its first tokens arrive), and the router's own admission queue.
//! Each test prints its figures for `docs/admission.md`.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use http_body_util::BodyExt;
use kinference_sim::FaultRequest;
use support::*;
use tokio::time::Instant;

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One streamed request: (status, endpoint, TTFT ms, headers).
async fn one(api: std::net::SocketAddr, k: usize) -> (u16, String, Option<f64>) {
    let started = Instant::now();
    let resp = post_streaming(
        api,
        "/v1/chat/completions",
        &chat(MODEL, &words(k * 700, 600), true, 8),
    )
    .await;
    let status = resp.status().as_u16();
    let ep = resp
        .headers()
        .get("x-kinference-endpoint")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let mut body = resp.into_body();
    let mut ttft = None;
    while let Some(Ok(f)) = body.frame().await {
        if ttft.is_none() && f.data_ref().is_some_and(|d| !d.is_empty()) {
            ttft = Some(started.elapsed().as_secs_f64() * 1000.0);
        }
    }
    (status, ep, ttft)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_mostly_avoids_an_engine_ten_times_slower_before_its_first_token() {
    let sims = engines(3, |_| {}).await;
    sims[0]
        .inject(&FaultRequest {
            slowdown: Some(10.0),
            ..FaultRequest::default()
        })
        .await
        .unwrap();
    let slow = sims[0].http_addr().to_string();
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 3, true).await;

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
    let mut lines = Vec::new();
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
