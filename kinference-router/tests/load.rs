//! Many concurrent streams held through the router, in rounds: every one
//! completes, memory does not grow round after round, and the router's
//! in-flight accounting (`/debug/endpoints` load and the
//! `kinference_router_engine_in_flight_requests` gauges) is back to zero
//! once they are done.
//!
//! The router runs as its own process (the binary), so its memory is its
//! own; engines and clients run in the test. CI-sized: 1,500 streams a
//! round, 4 rounds.
//! `KINFERENCE_LOAD_STREAMS` and `KINFERENCE_LOAD_ROUNDS` change that;
//! `cargo xtask bench faults` holds 5,000 through a release router process
//! for minutes.

mod support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use kinference_sim::FaultRequest;
use support::*;
use tokio::time::Instant;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Sums the in-flight gauges of `/metrics`.
fn in_flight_gauges(metrics: &str) -> (usize, f64) {
    let values = values_of(metrics, "kinference_router_engine_in_flight_requests", &[]);
    (values.len(), values.iter().sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_held_streams_leave_nothing_behind() {
    let streams = env("KINFERENCE_LOAD_STREAMS", 1500);
    let rounds = env("KINFERENCE_LOAD_ROUNDS", 4);
    // Two sockets per stream in this process (client, engine) and two in
    // the router's (which inherits the limit).
    let need = (streams * 2 + 512) as u64;
    let (soft, hard) = rlimit::Resource::NOFILE.get().expect("reads RLIMIT_NOFILE");
    if soft < need {
        rlimit::Resource::NOFILE
            .set(need.min(hard), hard)
            .expect("raises RLIMIT_NOFILE");
    }
    let (soft, _) = rlimit::Resource::NOFILE.get().expect("reads RLIMIT_NOFILE");
    assert!(
        soft >= need,
        "{streams} streams need {need} file descriptors in this process; the hard limit is {hard}: raise it (ulimit -Hn) or set KINFERENCE_LOAD_STREAMS lower"
    );

    // Engines that admit every stream at once (max_num_seqs); each round
    // they stall while the streams open (headers sent, no token yet), so the
    // router holds them all, then run them to the end (40 tokens each).
    let sims = engines(4, |c| {
        c.engine.max_num_seqs = 1024;
        c.engine.num_gpu_blocks = 65_536;
    })
    .await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = RouterProc::start(&addrs, &WorkerSetOpts::default(), &[], "warn").await;

    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_max_idle_per_host(streams)
            .build(http);
    let api = r.api;
    let admin = r.admin;
    let start_rss = r.rss_mib();
    let mut after_round = Vec::new();
    for round in 0..rounds {
        let t0 = Instant::now();
        for s in &sims {
            s.inject(&FaultRequest {
                stall_ms: Some(600_000),
                ..FaultRequest::default()
            })
            .await
            .unwrap();
        }
        // Every stream is open (headers received) before any is read.
        let opened = Arc::new(tokio::sync::Barrier::new(streams + 1));
        let mut tasks = Vec::with_capacity(streams);
        for k in 0..streams {
            let (client, opened) = (client.clone(), opened.clone());
            let body = serde_json::to_vec(&chat(
                MODEL,
                &words((round * streams + k) * 7 % 60_000, 24),
                true,
                40,
            ))
            .unwrap();
            tasks.push(tokio::spawn(async move {
                let req = http::Request::post(format!("http://{api}/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .unwrap();
                let resp = client.request(req).await;
                opened.wait().await;
                let resp = resp.map_err(|e| format!("request: {e}"))?;
                if resp.status() != 200 {
                    return Err(format!("status {}", resp.status()));
                }
                let b = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| format!("body: {e}"))?
                    .to_bytes();
                if b.ends_with(b"data: [DONE]\n\n") {
                    Ok(())
                } else {
                    Err("a stream ended without [DONE]".to_owned())
                }
            }));
        }
        // All open at once: the router holds them all.
        opened.wait().await;
        let held = get_json(admin, "/debug/endpoints")
            .await
            .expect("debug page")["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["load"]["requests"].as_u64().unwrap_or(0))
            .sum::<u64>();
        let peak_rss = r.rss_mib();
        for s in &sims {
            s.inject(&FaultRequest {
                stall_ms: Some(0),
                ..FaultRequest::default()
            })
            .await
            .unwrap();
        }
        let mut errors = Vec::new();
        for t in tasks {
            if let Err(e) = t.await.unwrap() {
                errors.push(e);
            }
        }
        // Accounting back to zero: the debug view and the gauges.
        eventually(
            Duration::from_secs(10),
            "in-flight back to zero",
            || async {
                let e = get_json(admin, "/debug/endpoints").await?;
                let load: u64 = e["endpoints"]
                    .as_array()?
                    .iter()
                    .map(|e| e["load"]["requests"].as_u64().unwrap_or(1))
                    .sum();
                let (n, sum) = in_flight_gauges(&get(admin, "/metrics").await.text());
                (load == 0 && n == 4 && sum == 0.0).then_some(())
            },
        )
        .await;
        let rss = r.rss_mib();
        after_round.push(rss);
        eprintln!(
            "FIGURE load round {round}: {streams} streams, {held} held by the router at once, {} errors, in {:.1} s; router RSS {peak_rss:.0} MiB while holding them, {rss:.0} MiB after",
            errors.len(),
            t0.elapsed().as_secs_f64()
        );
        assert!(
            errors.is_empty(),
            "round {round}: {} errors, first: {}",
            errors.len(),
            errors[0]
        );
        assert_eq!(
            held as usize, streams,
            "round {round}: not every stream was held by the router at once"
        );
    }
    eprintln!(
        "FIGURE load: router RSS {start_rss:.0} MiB before, after each round {after_round:.0?} MiB"
    );
    // Memory is bounded: later rounds do not keep what earlier ones used
    // (a loose bound; allocators keep some).
    if rounds >= 3 {
        let (second, last) = (after_round[1], after_round[rounds - 1]);
        assert!(
            last <= second * 1.25 + 32.0,
            "memory grows round after round: {after_round:?} MiB"
        );
    }
    let log = r.stop();
    assert!(!log.contains("panicked"), "{log}");
}
