//! What a KV window costs besides the window itself: discovery
//! (`/kv_event_sources`), the TCP check, two `/metrics` reads and the
//! subscription's set-up and tear-down, against a simulated engine on
//! loopback. The baseline is a bare sleep of the same window in the same
//! run; the difference is the overhead per worker set and window.
//!
//! Also the CPU cost of reading a `/metrics` page (one and eight DP ranks).

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use kinference_controller::probe::{HttpProber, KvTarget, Prober, parse_engine_counters};
use kinference_sim::{SimConfig, SimEngine};

const WINDOW: Duration = Duration::from_millis(50);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("a tokio runtime: {e}"))
}

fn metrics_page(rt: &tokio::runtime::Runtime, dp_size: u32) -> String {
    rt.block_on(async {
        let engine = SimEngine::spawn(SimConfig {
            dp_size,
            ..SimConfig::default()
        })
        .await
        .unwrap_or_else(|e| panic!("a simulated engine: {e}"));
        let text = get_metrics(&engine.http_addr().to_string()).await;
        engine.shutdown().await;
        text
    })
}

/// `GET /metrics` as text, with a bare HTTP/1.1 exchange.
async fn get_metrics(authority: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(authority)
        .await
        .unwrap_or_else(|e| panic!("connecting to {authority}: {e}"));
    s.write_all(
        format!("GET /metrics HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap_or_else(|e| panic!("writing: {e}"));
    let mut out = String::new();
    s.read_to_string(&mut out)
        .await
        .unwrap_or_else(|e| panic!("reading: {e}"));
    out.split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default()
}

fn benches(c: &mut Criterion) {
    let rt = runtime();
    let engine = rt
        .block_on(SimEngine::spawn(SimConfig::default()))
        .unwrap_or_else(|e| panic!("a simulated engine: {e}"));
    let http = engine.http_addr();
    let target = KvTarget {
        worker_set: "bench/ws".into(),
        address: http.ip().to_string(),
        http_port: http.port(),
        kv_port: engine.kv_addr().map_or(0, |a| a.port()),
    };
    let prober = HttpProber::new(Duration::from_secs(2)).with_kv_window(WINDOW);

    let mut g = c.benchmark_group("kv window (50 ms)");
    g.sample_size(30);
    g.bench_function("baseline: sleep 50 ms", |b| {
        b.iter(|| rt.block_on(async { tokio::time::sleep(WINDOW).await }));
    });
    g.bench_function("probe_kv, idle engine", |b| {
        b.iter(|| rt.block_on(async { prober.probe_kv(&target).await }));
    });
    g.finish();

    for dp in [1, 8] {
        let page = metrics_page(&rt, dp);
        c.bench_function(
            &format!("parse /metrics, {dp} DP ranks ({} B)", page.len()),
            |b| {
                b.iter(|| parse_engine_counters(std::hint::black_box(&page), None));
            },
        );
    }
    rt.block_on(engine.shutdown());
}

criterion_group!(probe, benches);
criterion_main!(probe);
