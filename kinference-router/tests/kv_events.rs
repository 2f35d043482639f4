//! The router's view of an engine's cache against the engine's truth, through
//! evictions, a forced gap (replayed), lost batches (not replayable) and a
//! publisher restart: never a stale block, and back in step afterwards.

mod support;

use std::time::Duration;

use kinference_sim::{FaultRequest, SimHandle};
use support::*;

/// Waits until the router agrees with the engine on `fresh` prompts and
/// has applied every batch published, then checks it never claims more
/// than the engine holds on any of `all`.
async fn check(r: &Router, sim: &SimHandle, all: &[Vec<u32>], fresh: &[Vec<u32>], when: &str) {
    for p in fresh {
        eprintln!(
            "{when}: router {} engine {}",
            router_depth(r, p),
            truth_depth(sim, p)
        );
    }
    eventually(
        Duration::from_secs(10),
        &format!("router == engine on fresh prompts ({when})"),
        || async {
            fresh
                .iter()
                .all(|p| router_depth(r, p) == truth_depth(sim, p))
                .then_some(())
        },
    )
    .await;
    settled(r, sim, when).await;
    for (i, p) in all.iter().enumerate() {
        let (ours, truth) = (router_depth(r, p), truth_depth(sim, p));
        assert!(
            ours <= truth,
            "{when}: prompt {i}: the router thinks {ours} blocks are cached, the engine holds {truth}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_stale_blocks_through_evictions_gaps_and_restarts() {
    // A small cache (63 usable blocks) so evictions happen.
    let sims = engines(1, |c| {
        c.engine.num_gpu_blocks = 64;
        c.max_model_len = 512;
        // A replay socket, as `"replay_endpoint": "tcp://*:PORT"` configures.
        c.kv_events = c.kv_events.take().map(|k| k.with_replay(0));
    })
    .await;
    let sim = &sims[0];
    let opts = WorkerSetOpts {
        kv_block_size: BLOCK,
        ..WorkerSetOpts::default()
    };
    let r = router(&[EngineAddr::of(sim)], &opts, &[]).await;
    wait_routable(&r, 1, true).await;

    let mut all: Vec<Vec<u32>> = Vec::new();
    let batch =
        |from: u32, n: u32| -> Vec<Vec<u32>> { (from..from + n).map(|k| prompt(k, 10)).collect() };

    // Enough prompts to evict the first ones.
    let fresh = batch(0, 8);
    for p in &fresh {
        send_prompt(&r, p).await;
    }
    all.extend(fresh.iter().cloned());
    check(&r, sim, &all, &fresh[fresh.len() - 2..], "after evictions").await;
    let removed = sim.cache_truth(false).engines[0].counters;
    eprintln!("engine counters after evictions: {removed:?}");

    // Two batches withheld but kept for replay: a gap the router repairs.
    sim.inject(&FaultRequest {
        drop_batches: Some(2),
        ..FaultRequest::default()
    })
    .await
    .unwrap();
    let fresh = batch(100, 4);
    for p in &fresh {
        send_prompt(&r, p).await;
    }
    all.extend(fresh.iter().cloned());
    check(&r, sim, &all, &fresh, "after a replayed gap").await;

    // Two batches lost for good: the router must drop what it cannot trust.
    sim.inject(&FaultRequest {
        lose_batches: Some(2),
        ..FaultRequest::default()
    })
    .await
    .unwrap();
    let fresh = batch(200, 4);
    for p in &fresh {
        send_prompt(&r, p).await;
    }
    all.extend(fresh.iter().cloned());
    check(&r, sim, &all, &fresh[2..], "after a lost gap").await;

    // The publisher restarts (seq back to 0): earlier state is dropped.
    sim.inject(&FaultRequest {
        restart_publisher: Some(true),
        ..FaultRequest::default()
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let fresh = batch(300, 3);
    for p in &fresh {
        send_prompt(&r, p).await;
    }
    all.extend(fresh.iter().cloned());
    check(&r, sim, &all, &fresh, "after a publisher restart").await;

    // The stream health saw all of it.
    let e = endpoints(&r).await;
    let kv = &e["endpoints"][0]["kv"][0];
    eprintln!("stream health: {kv}");
    assert!(kv["gaps"].as_u64().unwrap() >= 2, "{kv}");
    assert!(kv["replays"].as_u64().unwrap() >= 1, "{kv}");
    assert!(kv["restarts"].as_u64().unwrap() >= 1, "{kv}");
    r.shutdown().await;
}

/// An adapter's blocks (vLLM's `lora_name` on `BlockStored`) are indexed
/// under that adapter's keys only: the router finds the adapter's prefix on
/// the engine that cached it, as deep as the engine holds it, and credits
/// none of it to the base model with the same tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapters_blocks_count_for_that_adapter_only() {
    let engines = engines(1, |c| {
        c.engine.block_size = BLOCK as usize;
        c.lora.modules = vec![kinference_sim::LoraModule {
            name: "sql".into(),
            path: "/adapters/sql".into(),
        }];
    })
    .await;
    let sim = &engines[0];
    let r = router(&[EngineAddr::of(sim)], &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 1, true).await;
    let ids = prompt(7, 6);
    let reply = post(
        r.api(),
        "/v1/completions",
        &serde_json::json!({"model": "sql", "prompt": ids, "max_tokens": 2}),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let mut probe = ids.clone();
    probe.push(7);
    let held = sim
        .cached_prefix_tokens_for(&probe, "sql")
        .expect("sql is served")[0] as u32
        / BLOCK;
    assert!(
        held >= 5,
        "the engine holds the adapter's prompt ({held} blocks)"
    );
    assert_eq!(truth_depth(sim, &ids), 0, "the base model holds none of it");
    let depth = |lora: Option<&str>| {
        let keys = kinference_kvindex::BlockKeyer::new(BLOCK, lora)
            .keys(&ids, &kinference_kvindex::ExtraKeys::none());
        r.running.shared.kv.index().find_matches(&keys).max_blocks()
    };
    eventually(
        Duration::from_secs(10),
        "the router indexes the adapter's blocks under its keys",
        || async { (depth(Some("sql")) >= held.min(6)).then_some(()) },
    )
    .await;
    assert_eq!(
        depth(None),
        0,
        "no base-model credit for the adapter's blocks"
    );
    r.shutdown().await;
}
