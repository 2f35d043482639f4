//! The `/v1/models` probe over real HTTP on loopback.

mod support;

use std::time::Duration;

use kinference_controller::endpoints::ReadyEndpoint;
use kinference_controller::probe::{HttpProber, KvProbe, ProbeFailure, ProbeTarget, Prober};
use support::Engine;
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;

fn endpoint(addr: std::net::SocketAddr) -> ReadyEndpoint {
    ReadyEndpoint {
        address: addr.ip().to_string(),
        http_port: addr.port(),
        kv_port: None,
        target: None,
    }
}

/// A port on which nothing listens (bound, then closed).
async fn closed_port() -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("a port");
    l.local_addr().expect("an address")
}

#[tokio::test]
async fn reads_models_and_names_failures() {
    let engine = Engine::start(
        "127.0.0.1:0".parse().unwrap(),
        "Qwen/Qwen3.6-35B-A3B",
        262_144,
    )
    .await;
    let prober = HttpProber::new(Duration::from_secs(2));

    let cards = prober
        .models(&engine.addr.to_string())
        .await
        .expect("a model list");
    assert_eq!(cards.len(), 1);
    assert_eq!(cards[0].id, "Qwen/Qwen3.6-35B-A3B");
    assert_eq!(cards[0].max_model_len, Some(262_144));

    let closed = closed_port().await;
    assert_eq!(
        prober.models(&closed.to_string()).await,
        Err(ProbeFailure::Connect("connection refused".into()))
    );

    // A server that is not an engine: 404 for /v1/models.
    let app = axum::Router::new().route("/", axum::routing::get(|| async { "hello" }));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let other = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    assert_eq!(
        prober.models(&other.to_string()).await,
        Err(ProbeFailure::Status(404))
    );

    // An engine that answers something else.
    let app = axum::Router::new().route(
        "/v1/models",
        axum::routing::get(|| async { "{\"models\": []}" }),
    );
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let odd = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    assert!(
        matches!(prober.models(&odd.to_string()).await, Err(ProbeFailure::Body(m)) if m.contains("missing field `data`"))
    );

    // A peer that accepts and never answers.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = l.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut s, _)) = l.accept().await {
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            held.push(s);
        }
    });
    let quick = HttpProber::new(Duration::from_millis(300));
    assert_eq!(
        quick.models(&silent.to_string()).await,
        Err(ProbeFailure::Timeout)
    );
    engine.stop();
}

#[tokio::test]
async fn a_round_probes_every_endpoint_and_leaves_kv_unprobed() {
    let a = Engine::start("127.0.0.1:0".parse().unwrap(), "m", 4096).await;
    let b = Engine::start("127.0.0.1:0".parse().unwrap(), "n", 8192).await;
    let closed = closed_port().await;
    let prober = HttpProber::new(Duration::from_secs(2));
    let target = ProbeTarget {
        worker_set: "ns/ws".into(),
        endpoints: vec![endpoint(b.addr), endpoint(a.addr), endpoint(closed)],
        kv_events: true,
        kv_block_size: 16,
    };
    let r = prober.probe(&target).await;
    assert_eq!(r.models.len(), 3);
    let mut want = vec![a.addr.to_string(), b.addr.to_string(), closed.to_string()];
    want.sort();
    let got: Vec<&str> = r.models.iter().map(|m| m.endpoint.as_str()).collect();
    assert_eq!(got, want, "sorted by endpoint");
    let ok = r.models.iter().filter(|m| m.outcome.is_ok()).count();
    assert_eq!(ok, 2);
    assert_eq!(
        r.kv,
        KvProbe::NotProbed,
        "the KV stream is not probed in this release"
    );

    let no_kv = ProbeTarget {
        kv_events: false,
        ..target
    };
    assert_eq!(prober.probe(&no_kv).await.kv, KvProbe::NotConfigured);
}
