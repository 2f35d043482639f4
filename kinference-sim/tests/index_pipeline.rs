//! The router's real event pipeline (`kinference-kvindex`'s subscriber and
//! index) fed by simulated engines agrees with the engines' true caches,
//! through evictions, a forced sequence gap (repaired by replay) and a
//! reset.

#![allow(clippy::many_single_char_names)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use kinference_kvindex::sub::{self, SubscriberConfig};
use kinference_kvindex::{ExtraKeys, IndexConfig, KvIndex, WorkerRef, block_keys};
use kinference_sim::{EngineConfig, FaultRequest, KvEventsConfig, SimConfig, SimEngine, SimHandle};
use serde_json::json;

/// Leading blocks of `tokens` the index says `worker` holds, per rank.
fn index_view(
    index: &KvIndex,
    workers: &[kinference_kvindex::WorkerId],
    tokens: &[u32],
) -> Vec<usize> {
    let keys = block_keys(tokens, 16, None, &ExtraKeys::none());
    let m = index.find_matches(&keys);
    workers
        .iter()
        .map(|w| {
            m.as_slice()
                .iter()
                .find(|x| x.worker == *w)
                .map_or(0, |x| x.blocks as usize)
        })
        .collect()
}

/// Leading full blocks of `tokens` each rank really holds.
fn truth(e: &SimHandle, tokens: &[u32]) -> Vec<usize> {
    // One extra token lifts the "at most len - 1 tokens" rule of admission,
    // so every full block of `tokens` counts.
    let mut probe = tokens.to_vec();
    probe.push(0);
    e.cached_prefix_tokens(&probe)
        .into_iter()
        .map(|t| t / 16)
        .collect()
}

#[tokio::test]
async fn the_kvindex_pipeline_sees_what_the_engines_hold() {
    let e = SimEngine::spawn(SimConfig {
        dp_size: 2,
        max_model_len: 512,
        engine: EngineConfig {
            num_gpu_blocks: 64,
            ..EngineConfig::default()
        },
        kv_events: Some(KvEventsConfig::default().with_replay(0)),
        ..SimConfig::default()
    })
    .await
    .expect("engine starts");
    let index = Arc::new(KvIndex::new(IndexConfig::default()));
    let mut workers = Vec::new();
    let mut subs = Vec::new();
    for ep in e.kv_endpoints() {
        let w = index
            .register_worker(WorkerRef::new(e.base_url(), ep.rank), 16)
            .expect("registers");
        workers.push(w);
        let cfg = SubscriberConfig::new(format!("tcp://{}", ep.pub_addr))
            .with_replay(format!("tcp://{}", ep.replay_addr.expect("replay")));
        subs.push(sub::spawn(cfg, w, index.clone()));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let c = client();
    let url = format!("{}/v1/completions", e.base_url());
    // Sequential requests (no two compute the same block at once, so no
    // duplicate digests): 4 groups sharing 320-token prefixes, unique
    // tails, alternating ranks; 63 usable blocks per rank, so old blocks
    // are evicted. Midway, one batch per rank is dropped from PUB.
    let mut prompts = Vec::new();
    for i in 0..40u32 {
        let mut p: Vec<u32> = (0..320).map(|t| 10_000 * (i % 4) + t).collect();
        p.extend((0..(30 + i % 7)).map(|t| 100_000 + 1000 * i + t));
        if i == 20 {
            e.inject(&FaultRequest {
                drop_batches: Some(1),
                ..FaultRequest::default()
            })
            .await
            .expect("fault applies");
        }
        let req = hyper::Request::builder()
            .method("POST")
            .uri(&url)
            .header("content-type", "application/json")
            .header("x-data-parallel-rank", (i % 2).to_string())
            .body(http_body_util::Full::new(bytes::Bytes::from(
                serde_json::to_vec(&json!({"prompt": p, "max_tokens": 20})).expect("json"),
            )))
            .expect("request");
        assert_eq!(c.request(req).await.expect("answers").status(), 200);
        prompts.push(p);
    }
    let settled = async {
        loop {
            let same = prompts
                .iter()
                .all(|p| index_view(&index, &workers, p) == truth(&e, p));
            if same {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(10), settled)
        .await
        .is_err()
    {
        for p in &prompts {
            eprintln!(
                "index {:?} truth {:?}",
                index_view(&index, &workers, p),
                truth(&e, p)
            );
        }
        panic!("the index never matched the engines' caches");
    }
    let whole = prompts
        .iter()
        .filter(|p| truth(&e, p).contains(&(p.len() / 16)))
        .count();
    assert!(
        whole > 0 && whole < prompts.len(),
        "some prompts are still whole in a cache, others lost blocks: {whole}"
    );
    let t = e.cache_truth(false);
    for r in &t.engines {
        let p = r.publisher.as_ref().expect("publisher");
        assert_eq!(p.dropped, 1, "a gap was forced on rank {}", r.rank);
        assert!(p.replays >= 1, "and repaired by replay on rank {}", r.rank);
        assert!(r.counters.blocks_removed > 0, "rank {} evicted", r.rank);
    }
    for (h, w) in subs.iter().zip(&workers) {
        assert!(h.health().connected, "worker {w:?} connected");
    }

    assert!(e.reset_prefix_cache());
    let cleared = async {
        while prompts
            .iter()
            .any(|p| index_view(&index, &workers, p).iter().any(|b| *b > 0))
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), cleared)
        .await
        .expect("AllBlocksCleared empties the index");
    e.shutdown().await;
}
