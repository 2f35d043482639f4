//! The real prober against simulated engines on loopback: `/v1/models`, and
//! KV-event windows with `/kv_event_sources` and `/metrics`.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kinference_api::DiagnosisReason;
use kinference_controller::diagnose;
use kinference_controller::endpoints::{self, ReadyEndpoint};
use kinference_controller::probe::{
    HttpProber, KvObservation, KvProbe, KvTarget, KvWindow, ProbeFailure, ProbeResult, ProbeTarget,
    Prober,
};
use support::{closed_port, config, start, traffic};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;

const WINDOW: Duration = Duration::from_millis(1500);

fn endpoint(addr: SocketAddr) -> ReadyEndpoint {
    ReadyEndpoint {
        address: addr.ip().to_string(),
        http_port: addr.port(),
        kv_port: None,
        replay_port: None,
        target: None,
    }
}

fn kv_target(http: SocketAddr, kv_port: u16) -> KvTarget {
    KvTarget {
        worker_set: "ns/ws".into(),
        address: http.ip().to_string(),
        http_port: http.port(),
        kv_port,
    }
}

fn prober() -> HttpProber {
    HttpProber::new(Duration::from_secs(2)).with_kv_window(WINDOW)
}

/// The window of a subscribed observation.
fn subscribed(obs: KvObservation) -> KvWindow {
    match obs {
        KvObservation::Subscribed(w) => w,
        KvObservation::Closed { endpoint, error } => {
            panic!("expected a subscription, got {endpoint} closed: {error}")
        }
    }
}

/// The diagnoses a worker set with `kvBlockSize` `kv_block_size` would get
/// from `obs` (one ready endpoint with both ports, models not probed).
fn kv_reasons(obs: &KvObservation, kv_block_size: u32) -> Vec<DiagnosisReason> {
    let mut spec = kinference_api::InferenceWorkerSetSpec {
        profile: "default".into(),
        kv_block_size,
        service_ref: kinference_api::v1alpha1::ServiceRef {
            name: "svc".into(),
            port: k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8000),
        },
        kv_events: None,
        models: Vec::new(),
    };
    spec.kv_events = Some(kinference_api::v1alpha1::KvEventsRef {
        port: k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(5557),
        replay_port: None,
    });
    let probe = ProbeResult {
        models: Vec::new(),
        kv: KvProbe::Observed(obs.clone()),
    };
    diagnose::diagnose(&spec, &endpoints::resolve(&spec, []), Some(&probe))
        .into_iter()
        .map(|f| f.reason)
        .collect()
}

#[tokio::test]
async fn reads_models_and_names_failures() {
    let mut cfg = config(
        "Qwen/Qwen3.6-35B-A3B",
        "127.0.0.1:0".parse().unwrap(),
        None,
        16,
    );
    cfg.max_model_len = 262_144;
    cfg.engine.num_gpu_blocks = 262_144 / 16 + 64;
    let engine = start(cfg).await;
    let prober = prober();

    let cards = prober
        .models(&engine.http_addr().to_string())
        .await
        .expect("a model list");
    assert_eq!(cards.len(), 1);
    assert_eq!(cards[0].id, "Qwen/Qwen3.6-35B-A3B");
    assert_eq!(cards[0].max_model_len, Some(262_144));

    let closed = format!("127.0.0.1:{}", closed_port());
    assert_eq!(
        prober.models(&closed).await,
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
    engine.shutdown().await;
}

#[tokio::test]
async fn a_round_asks_every_endpoint() {
    let a = start(config("m", "127.0.0.1:0".parse().unwrap(), None, 16)).await;
    let b = start(config("n", "127.0.0.1:0".parse().unwrap(), None, 16)).await;
    let closed: SocketAddr = format!("127.0.0.1:{}", closed_port()).parse().unwrap();
    let target = ProbeTarget {
        worker_set: "ns/ws".into(),
        endpoints: vec![
            endpoint(b.http_addr()),
            endpoint(a.http_addr()),
            endpoint(closed),
        ],
        kv_events: false,
        kv_block_size: 16,
    };
    let models = prober().probe_models(&target).await;
    let mut want = vec![
        a.http_addr().to_string(),
        b.http_addr().to_string(),
        closed.to_string(),
    ];
    want.sort();
    let got: Vec<&str> = models.iter().map(|m| m.endpoint.as_str()).collect();
    assert_eq!(got, want, "sorted by endpoint");
    let served: BTreeSet<String> = models
        .iter()
        .filter_map(|m| m.outcome.as_ref().ok())
        .flat_map(|cards| cards.iter().map(|c| c.id.clone()))
        .collect();
    assert_eq!(served, BTreeSet::from(["m".to_owned(), "n".to_owned()]));
    a.shutdown().await;
    b.shutdown().await;
}

/// The Gemma case: an engine publishing 256-token blocks, found through its
/// `/kv_event_sources`, under traffic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_sees_the_block_width_under_traffic() {
    let engine = start(config(
        "google/gemma-4-12b-it",
        "127.0.0.1:0".parse().unwrap(),
        Some(0),
        256,
    ))
    .await;
    let (stop, task) = traffic(
        engine.http_addr(),
        "google/gemma-4-12b-it",
        Duration::from_millis(100),
        None,
    );
    // The spec's KV port is wrong on purpose: the engine's own list wins.
    let target = kv_target(engine.http_addr(), closed_port());
    let started = Instant::now();
    let w = subscribed(prober().probe_kv(&target).await);
    let took = started.elapsed();
    stop.cancel();
    let sent = task.await.expect("traffic ran");
    println!("window {WINDOW:?} took {took:?}; {sent} requests; {w:?}");
    assert!(w.discovered, "found through /kv_event_sources");
    assert_eq!(
        w.publishers,
        [engine.kv_addr().expect("a publisher").to_string()]
    );
    assert!(w.batches > 0, "{w:?}");
    assert_eq!(w.block_sizes, BTreeSet::from([256]));
    let activity = w.activity.expect("the engine's metrics were read");
    assert!(activity.requests > 0, "{activity:?}");
    assert!(activity.tokens_computed >= 600, "{activity:?}");
    assert_eq!(activity.engine_block_size, Some(256));
    let obs = KvObservation::Subscribed(w);
    assert_eq!(kv_reasons(&obs, 16), [DiagnosisReason::BlockSizeMismatch]);
    assert_eq!(kv_reasons(&obs, 256), []);
    engine.shutdown().await;
}

/// No traffic, no events: an idle window that makes no diagnosis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_engine_gives_an_idle_window() {
    let engine = start(config("m", "127.0.0.1:0".parse().unwrap(), Some(0), 16)).await;
    let w = subscribed(
        prober()
            .probe_kv(&kv_target(engine.http_addr(), closed_port()))
            .await,
    );
    assert_eq!(w.batches, 0);
    assert_eq!(
        w.activity.map(|a| (a.requests, a.tokens_computed)),
        Some((0, 0))
    );
    assert!(w.is_idle(16));
    assert_eq!(kv_reasons(&KvObservation::Subscribed(w), 16), []);
    engine.shutdown().await;
}

/// Prefix caching off: the engine serves but publishes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_events_while_serving() {
    let mut cfg = config("m", "127.0.0.1:0".parse().unwrap(), Some(0), 16);
    cfg.engine.enable_prefix_caching = false;
    let engine = start(cfg).await;
    let (stop, task) = traffic(engine.http_addr(), "m", Duration::from_millis(100), None);
    let w = subscribed(
        prober()
            .probe_kv(&kv_target(engine.http_addr(), closed_port()))
            .await,
    );
    stop.cancel();
    task.await.expect("traffic ran");
    assert_eq!(w.batches, 0, "{w:?}");
    assert!(w.saw_traffic(16), "{w:?}");
    assert_eq!(
        kv_reasons(&KvObservation::Subscribed(w), 16),
        [DiagnosisReason::NoKvEvents]
    );
    engine.shutdown().await;
}

/// An engine without a publisher: `/kv_event_sources` lists none, and
/// nothing listens on the spec's port.
#[tokio::test]
async fn a_closed_port() {
    let engine = start(config("m", "127.0.0.1:0".parse().unwrap(), None, 16)).await;
    let port = closed_port();
    let obs = prober()
        .probe_kv(&kv_target(engine.http_addr(), port))
        .await;
    assert_eq!(
        obs,
        KvObservation::Closed {
            endpoint: format!("127.0.0.1:{port}"),
            error: "connection refused".into(),
        }
    );
    assert_eq!(kv_reasons(&obs, 16), [DiagnosisReason::KvPortClosed]);
    engine.shutdown().await;
}

/// A port that accepts TCP but speaks no ZeroMQ (here: the engine's HTTP
/// port named as the KV port).
#[tokio::test]
async fn a_port_that_is_not_a_publisher() {
    let engine = start(config("m", "127.0.0.1:0".parse().unwrap(), None, 16)).await;
    let http = engine.http_addr();
    let obs = prober().probe_kv(&kv_target(http, http.port())).await;
    match &obs {
        KvObservation::Closed { endpoint, error } => {
            assert_eq!(endpoint, &http.to_string());
            assert!(error.contains("no ZeroMQ publisher"), "{error}");
        }
        other @ KvObservation::Subscribed(_) => panic!("{other:?}"),
    }
    engine.shutdown().await;
}

/// Two DP ranks: both publishers are watched, and only their ranks' metrics
/// count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dp_rank_is_watched() {
    let mut cfg = config("m", "127.0.0.1:0".parse().unwrap(), Some(0), 32);
    cfg.dp_size = 2;
    let engine = start(cfg).await;
    // Traffic to rank 1 only: its publisher is the second one.
    let (stop, task) = traffic(engine.http_addr(), "m", Duration::from_millis(100), Some(1));
    let w = subscribed(
        prober()
            .probe_kv(&kv_target(engine.http_addr(), closed_port()))
            .await,
    );
    stop.cancel();
    task.await.expect("traffic ran");
    let publishers: Vec<String> = engine
        .kv_endpoints()
        .iter()
        .map(|e| e.pub_addr.to_string())
        .collect();
    assert_eq!(w.publishers, publishers);
    assert!(w.batches > 0, "{w:?}");
    assert_eq!(w.block_sizes, BTreeSet::from([32]));
    assert!(w.activity.is_some_and(|a| a.requests > 0), "{w:?}");
    engine.shutdown().await;
}

/// An engine that does not list its sources (older vLLM, SGLang): the
/// spec's port is used, and without `/metrics` the activity is unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_kv_event_sources_the_spec_port_is_used() {
    let engine = start(config("m", "127.0.0.1:0".parse().unwrap(), Some(0), 64)).await;
    let not_vllm = axum::Router::new().route("/", axum::routing::get(|| async { "hello" }));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, not_vllm).await });
    let (stop, task) = traffic(engine.http_addr(), "m", Duration::from_millis(100), None);
    let kv = engine.kv_addr().expect("a publisher");
    let w = subscribed(prober().probe_kv(&kv_target(http, kv.port())).await);
    stop.cancel();
    task.await.expect("traffic ran");
    assert!(!w.discovered);
    assert_eq!(w.publishers, [kv.to_string()]);
    assert_eq!(w.block_sizes, BTreeSet::from([64]));
    assert_eq!(w.activity, None);
    engine.shutdown().await;
}

#[tokio::test]
async fn engines_started_with_an_api_key_are_probed_with_it() {
    let mut cfg = config("m", "127.0.0.1:0".parse().unwrap(), None, 16);
    cfg.api_key = Some("engine-secret".into());
    let engine = start(cfg).await;
    let addr = engine.http_addr().to_string();
    // Without the key the engine refuses, as vLLM does (401).
    assert_eq!(prober().models(&addr).await, Err(ProbeFailure::Status(401)));
    let keyed = prober().with_api_key(Some("engine-secret")).unwrap();
    let cards = keyed.models(&addr).await.expect("a model list");
    assert_eq!(cards[0].id, "m");
    assert!(keyed.engine_counters(&addr, None).await.is_ok());
    assert_eq!(
        prober()
            .with_api_key(Some("wrong"))
            .unwrap()
            .models(&addr)
            .await,
        Err(ProbeFailure::Status(401))
    );
}
