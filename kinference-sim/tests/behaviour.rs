//! Does it behave like a loaded GPU? Time to first token against cache
//! hits and load, measured by a client over HTTP and by the engine itself;
//! many engines in one process.

#![allow(clippy::many_single_char_names)]

mod common;

use std::time::Duration;

use common::*;
use kinference_sim::{FaultRequest, KvEventsConfig, SimConfig, SimEngine, SimFleet};
use kinference_tokenize::word_level::numbered_words;
use serde_json::json;

#[tokio::test]
async fn a_repeated_long_prompt_answers_much_sooner_than_a_cold_one() {
    let e = SimEngine::spawn(SimConfig::default())
        .await
        .expect("engine starts");
    let c = client();
    let url = format!("{}/v1/completions", e.base_url());
    let body = |first: u32| json!({"prompt": numbered_words(first, 6000), "max_tokens": 2, "stream": true});
    let cold = stream(&c, &url, &body(0)).await.ttft;
    let warm = stream(&c, &url, &body(0)).await.ttft;
    let other = stream(&c, &url, &body(30_000)).await.ttft;
    // Modelled: cold ≈ 3 steps × 5 ms + 6000 × 0.086 ms ≈ 531 ms; warm ≈ one
    // 16-token step ≈ 6 ms. Wall-clock adds scheduling noise, so the bound
    // is loose.
    assert!(cold > warm * 5, "cold {cold:?} vs warm {warm:?}");
    assert!(
        other > warm * 5,
        "another long prompt is cold again: {other:?}"
    );
    // The engine's own accounting (simulated seconds) is exact.
    let rec = &e.recent_requests()[0];
    let ttft = |i: usize| rec[i].first_token.expect("first token") - rec[i].arrival;
    assert_eq!(rec[1].cached_tokens, 5984);
    assert!(ttft(0) > 0.5 && ttft(1) < 0.1, "{} {}", ttft(0), ttft(1));
    e.shutdown().await;
}

#[tokio::test]
async fn ttft_grows_with_load() {
    let e = SimEngine::spawn(SimConfig::default())
        .await
        .expect("engine starts");
    let c = client();
    let url = format!("{}/v1/completions", e.base_url());
    let body =
        |i: u32| json!({"prompt": numbered_words(i * 1000, 1000), "max_tokens": 8, "stream": true});
    let alone = stream(&c, &url, &body(0)).await.ttft;
    let tasks: Vec<_> = (1..=32)
        .map(|i| {
            let (c, url, b) = (c.clone(), url.clone(), body(i));
            tokio::spawn(async move { stream(&c, &url, &b).await.ttft })
        })
        .collect();
    let mut loaded = Vec::new();
    for t in tasks {
        loaded.push(t.await.expect("task"));
    }
    loaded.sort();
    let median = loaded[loaded.len() / 2];
    assert!(
        median > alone * 3,
        "alone {alone:?}, median under load {median:?}"
    );
    // The engine saw the queue: requests waited and their TTFTs spread.
    let rec = &e.recent_requests()[0];
    let queued = rec
        .iter()
        .filter(|r| r.scheduled.expect("scheduled") > r.arrival + 0.05)
        .count();
    assert!(queued > 0, "some requests waited for the token budget");
    let ttfts: Vec<f64> = rec[1..]
        .iter()
        .map(|r| r.first_token.expect("ttft") - r.arrival)
        .collect();
    let max = ttfts.iter().copied().fold(0.0, f64::max);
    let unloaded = rec[0].first_token.expect("ttft") - rec[0].arrival;
    assert!(max > 5.0 * unloaded, "engine-side: {max} vs {unloaded}");
    e.shutdown().await;
}

#[tokio::test]
async fn stall_and_slowdown_delay_tokens() {
    let e = SimEngine::spawn(SimConfig::default())
        .await
        .expect("engine starts");
    let c = client();
    let url = format!("{}/v1/completions", e.base_url());
    let body = json!({"prompt": numbered_words(0, 500), "max_tokens": 1});
    assert_eq!(post_json(&c, &url, &body).await.0, 200);
    e.inject(&FaultRequest {
        stall_ms: Some(400),
        ..FaultRequest::default()
    })
    .await
    .expect("fault applies");
    let body2 = json!({"prompt": numbered_words(5000, 500), "max_tokens": 1});
    assert_eq!(post_json(&c, &url, &body2).await.0, 200);
    e.inject(&FaultRequest {
        slowdown: Some(10.0),
        ..FaultRequest::default()
    })
    .await
    .expect("fault applies");
    let body3 = json!({"prompt": numbered_words(10_000, 500), "max_tokens": 1});
    assert_eq!(post_json(&c, &url, &body3).await.0, 200);
    let rec = &e.recent_requests()[0];
    let ttft = |i: usize| rec[i].first_token.expect("ttft") - rec[i].arrival;
    assert!(ttft(1) >= 0.39, "stalled: {}", ttft(1));
    // Modelled 10×; the bound leaves room for late timer wake-ups on a busy
    // machine.
    assert!(
        ttft(2) > 4.0 * ttft(0),
        "slowed down: {} vs {}",
        ttft(2),
        ttft(0)
    );
    e.shutdown().await;
}

/// A free range of `n` consecutive ports.
fn free_ports(n: u16) -> u16 {
    'search: loop {
        let first = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let base = first.local_addr().expect("addr").port();
        if base > u16::MAX - n {
            continue;
        }
        drop(first);
        for p in base..base + n {
            if std::net::TcpListener::bind(("127.0.0.1", p)).is_err() {
                continue 'search;
            }
        }
        return base;
    }
}

#[tokio::test]
async fn a_fleet_on_consecutive_ports_answers_alike() {
    let http = free_ports(3);
    let kv = free_ports(3);
    let mut cfg = SimConfig::default();
    cfg.http_addr.set_port(http);
    cfg.kv_events = Some(KvEventsConfig {
        port: kv,
        replay_port: None,
        ..KvEventsConfig::default()
    });
    let fleet = SimFleet::spawn(cfg, 3).await.expect("fleet starts");
    let c = client();
    let mut texts = Vec::new();
    for (i, e) in fleet.engines().iter().enumerate() {
        assert_eq!(e.http_addr().port(), http + i as u16);
        assert_eq!(e.kv_addr().expect("kv").port(), kv + i as u16);
        let mut sub = subscribe(e.kv_addr().expect("kv")).await;
        let (status, r) = post_json(
            &c,
            &format!("{}/v1/completions", e.base_url()),
            &json!({"prompt": numbered_words(7, 40), "max_tokens": 6}),
        )
        .await;
        assert_eq!(status, 200);
        texts.push(r["choices"][0]["text"].clone());
        assert!(
            recv(&mut sub, Duration::from_secs(2)).await.is_some(),
            "engine {i} publishes"
        );
    }
    assert!(
        texts.windows(2).all(|w| w[0] == w[1]),
        "same seed, same prompt, same answer: {texts:?}"
    );
    fleet.shutdown().await;
}
