//! Engines for tests: real `kinference-sim` engines in this process (vLLM's
//! HTTP API, `/metrics`, `/kv_event_sources` and ZeroMQ KV events), and a
//! client that gives them traffic.

#![allow(dead_code)]

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kinference_sim::{KvEventsConfig, SimConfig, SimEngine, SimHandle};
use tokio_util::sync::CancellationToken;

/// A small, fast engine serving `model` on `http` (port 0: any), with KV
/// events on `kv` (`None`: no publisher; port 0: any) from a publisher
/// bound to the HTTP address's host, `block_size`-token blocks.
pub fn config(model: &str, http: SocketAddr, kv: Option<u16>, block_size: usize) -> SimConfig {
    let mut cfg = SimConfig {
        model: model.to_owned(),
        http_addr: http,
        kv_events: kv.map(|port| KvEventsConfig {
            host: http.ip(),
            port,
            replay_port: None,
            ..KvEventsConfig::default()
        }),
        ..SimConfig::default()
    };
    cfg.engine.block_size = block_size;
    // Room for the longest context at this block size (plus the null block).
    cfg.engine.num_gpu_blocks = cfg.max_model_len.div_ceil(block_size) + 64;
    cfg
}

/// Starts an engine, retrying a few times while its ports are still held
/// by an engine that just stopped.
pub async fn start(cfg: SimConfig) -> SimHandle {
    let mut last = None;
    for _ in 0..20 {
        match SimEngine::spawn(cfg.clone()).await {
            Ok(h) => return h,
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "starting a simulated engine on {}: {:?}",
        cfg.http_addr, last
    );
}

/// Three engines serving `model` with the same HTTP port and the same KV
/// port at 127.0.0.1, .2 and .3, as three pods behind one Service would
/// be; 16-token blocks.
pub async fn three_engines(model: &str, max_model_len: usize) -> (u16, u16, Vec<SimHandle>) {
    for _ in 0..20 {
        let mut cfg = config(model, "127.0.0.1:0".parse().unwrap(), Some(0), 16);
        cfg.max_model_len = max_model_len;
        cfg.engine.num_gpu_blocks = max_model_len.div_ceil(16) + 64;
        let Ok(first) = SimEngine::spawn(cfg.clone()).await else {
            continue;
        };
        let port = first.http_addr().port();
        let kv_port = first.kv_addr().expect("a KV publisher").port();
        let mut engines = vec![first];
        for last in [2u8, 3] {
            let mut c = cfg.clone();
            c.http_addr = SocketAddr::new(IpAddr::from([127, 0, 0, last]), port);
            if let Some(kv) = &mut c.kv_events {
                kv.host = c.http_addr.ip();
                kv.port = kv_port;
            }
            if let Ok(h) = SimEngine::spawn(c).await {
                engines.push(h);
            }
        }
        if engines.len() == 3 {
            return (port, kv_port, engines);
        }
        for e in engines {
            e.shutdown().await;
        }
    }
    panic!("no HTTP and KV ports free on 127.0.0.1, .2 and .3 after 20 tries");
}

/// `engine` stopped and started again on the same ports with `model`.
pub async fn restart(engine: SimHandle, model: &str) -> SimHandle {
    let mut cfg = engine.config().clone();
    let kv = engine.kv_addr();
    cfg.model = model.to_owned();
    cfg.http_addr = engine.http_addr();
    if let (Some(k), Some(addr)) = (&mut cfg.kv_events, kv) {
        k.port = addr.port();
    }
    engine.shutdown().await;
    start(cfg).await
}

pub use kinference_examples::testing::closed_port;

/// `w{from} w{from+1} …`: `n` words, one token each for the simulator's
/// word-level tokenizer.
pub fn words(from: usize, n: usize) -> String {
    (from..from + n)
        .map(|i| format!("w{}", i % 65_536))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One `POST /v1/completions` of `words` prompt tokens (offset `from`, so
/// that prompts differ and miss the prefix cache) and `max_tokens` output
/// tokens; the HTTP status.
pub async fn complete(
    http: SocketAddr,
    model: &str,
    from: usize,
    n: usize,
    max_tokens: u32,
    rank: Option<u32>,
) -> Result<u16, String> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let body = serde_json::json!({
        "model": model,
        "prompt": words(from, n),
        "max_tokens": max_tokens,
    });
    let mut req = http::Request::post(format!("http://{http}/v1/completions"))
        .header("content-type", "application/json");
    if let Some(r) = rank {
        req = req.header("x-data-parallel-rank", r.to_string());
    }
    let req = req
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let _ = resp.into_body().collect().await;
    Ok(status)
}

/// Sends a 600-token completion to `http` every `every` until stopped, each
/// with a new prompt; the first failure panics the task (seen when joined).
pub fn traffic(
    http: SocketAddr,
    model: &str,
    every: Duration,
    rank: Option<u32>,
) -> (CancellationToken, tokio::task::JoinHandle<u64>) {
    let stop = CancellationToken::new();
    let s = stop.clone();
    let model = model.to_owned();
    let task = tokio::spawn(async move {
        let mut sent = 0u64;
        let mut from = 0usize;
        loop {
            tokio::select! {
                () = s.cancelled() => return sent,
                r = complete(http, &model, from, 600, 8, rank) => {
                    assert_eq!(r, Ok(200), "a completion from {http}");
                    sent += 1;
                }
            }
            from += 601;
            tokio::select! {
                () = s.cancelled() => return sent,
                () = tokio::time::sleep(every) => {}
            }
        }
    });
    (stop, task)
}
