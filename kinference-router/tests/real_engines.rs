//! The router against engines as real fleets run them, not as the
//! simulator's friendliest settings: vLLM releases without
//! `/kv_event_sources` and without replay, SGLang with its own metric names,
//! `/server_info` and event encoding, engines that fail every request with
//! a fast 500, engines that answer probes slowly while working, and spec
//! changes while endpoints are subscribed. Figures are printed as `FIGURE`
//! lines (`cargo test -- --nocapture`); `docs/reliability.md` carries them.

mod support;

use std::time::Duration;

use kinference_sim::{EngineMode, FailMode, FaultRequest, KvEventsConfig, Version};
use support::*;
use tokio::time::Instant;

fn vllm(minor: u16) -> EngineMode {
    EngineMode::vllm(Version::new(0, minor, 0))
}

/// Blocks the router's index holds for `ids` on any engine, and what the
/// engine holds.
fn depths(r: &Router, sim: &kinference_sim::SimHandle, ids: &[u32]) -> (u32, u32) {
    (router_depth(r, ids), truth_depth(sim, ids))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_kv_settings_keep_the_index_through_quiet() {
    // vLLM 0.30 as started with `--kv-events-config` naming only a
    // publisher: no /kv_event_sources, no replay socket. The router used to
    // assume a replay socket at the KV port + 1, fail to reach it at the
    // idle check and drop every block of the engine after 2 s of quiet.
    for mode in [vllm(30), EngineMode::sglang(Version::new(0, 5, 23))] {
        let sim = engines(1, |c| {
            c.engine_mode = mode;
            c.kv_events = c.kv_events.take().map(KvEventsConfig::without_replay);
        })
        .await
        .remove(0);
        let r = router(&[EngineAddr::of(&sim)], &WorkerSetOpts::default(), &[]).await;
        wait_routable(&r, 1, true).await;
        let prompts: Vec<Vec<u32>> = (0..6).map(|k| prompt(k, 8)).collect();
        for p in &prompts {
            send_prompt(&r, p).await;
        }
        let p = &prompts[5];
        let held = eventually(Duration::from_secs(10), "blocks indexed", || async {
            let (router, truth) = depths(&r, &sim, p);
            (router > 0 && router == truth).then_some(router)
        })
        .await;
        tokio::time::sleep(Duration::from_secs(8)).await;
        let (after, truth) = depths(&r, &sim, p);
        let total: u64 = endpoints(&r).await["endpoints"][0]["kv"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["blocks_held"].as_u64().unwrap())
            .sum();
        eprintln!(
            "FIGURE default-kv {mode:?}: {held} leading blocks indexed after traffic, {after} after 8 s of quiet (engine holds {truth}); {total} blocks held in all"
        );
        assert_eq!(
            after, truth,
            "{mode:?}: the quiet spell lost blocks the engine still holds"
        );
        assert!(total > 0);
        r.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_port_that_refuses_is_remembered_as_absent() {
    // The worker set names a replay port the engine never opened.
    let sim = engines(1, |c| {
        c.engine_mode = vllm(30);
        c.kv_events = c.kv_events.take().map(KvEventsConfig::without_replay);
    })
    .await
    .remove(0);
    let mut addr = EngineAddr::of(&sim);
    addr.replay = Some(kinference_examples::testing::closed_port());
    let opts = WorkerSetOpts {
        replay_port: true,
        ..WorkerSetOpts::default()
    };
    let r = router(&[addr], &opts, &[]).await;
    wait_routable(&r, 1, true).await;
    let p = prompt(1, 8);
    send_prompt(&r, &p).await;
    eventually(Duration::from_secs(10), "blocks indexed", || async {
        (router_depth(&r, &p) == 8).then_some(())
    })
    .await;
    // The idle check (after 2 s of quiet) tries the replay port and finds
    // nothing there.
    let kv = eventually(
        Duration::from_secs(15),
        "the replay port found absent",
        || async {
            let e = endpoints(&r).await;
            let k = e["endpoints"][0]["kv"][0].clone();
            (k["replay_absent"] == true).then_some(k)
        },
    )
    .await;
    assert_eq!(
        router_depth(&r, &p),
        truth_depth(&sim, &p),
        "no block dropped: nothing was lost"
    );
    assert_eq!(kv["resets"], 0, "{kv}");
    eprintln!("FIGURE replay-absent: stream after the idle check {kv}");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_engine_failing_every_request_costs_no_client_request() {
    // A CUDA fault: every inference request gets a fast 500 (streams: a 200
    // then an error event), while /health, /v1/models and /metrics are fine.
    let sims = engines(3, |_| {}).await;
    let broken = sims[1].http_addr().to_string();
    sims[1]
        .inject(&FaultRequest {
            fail_requests: Some(FailMode::CudaError),
            ..FaultRequest::default()
        })
        .await
        .unwrap();
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 3, true).await;
    let t0 = Instant::now();
    let (mut failed, mut on_broken) = (0, 0);
    let mut ejected_at = None;
    for k in 0..120u32 {
        let stream = k % 2 == 0;
        let resp = post_streaming(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &words(k as usize * 50, 30), stream, 4),
        )
        .await;
        let status = resp.status().as_u16();
        let ep = resp
            .headers()
            .get("x-kinference-endpoint")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let (_, text) = read_stream(resp.into_body(), Duration::from_secs(30)).await;
        if status != 200 || text.contains("\"error\"") {
            failed += 1;
        }
        if ep == broken {
            on_broken += 1;
        }
        if ejected_at.is_none() {
            let e = endpoints(&r).await;
            let report = e["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .find(|x| x["endpoint"] == broken.as_str())
                .cloned()
                .unwrap();
            if report["healthy"] == false {
                ejected_at = Some((k, t0.elapsed()));
            }
        }
    }
    let server_errors = r
        .running
        .shared
        .metrics
        .retries
        .get_or_create(&kinference_router::metrics::RetryLabels {
            reason: "server_error",
        })
        .get();
    eprintln!(
        "FIGURE broken-engine (1 of 3 answers 500): {failed} of 120 client requests failed; {on_broken} answered by it; ejected after request {ejected_at:?}; {server_errors} attempts retried elsewhere"
    );
    assert_eq!(
        failed, 0,
        "one broken engine of three must cost no client request"
    );
    assert_eq!(
        on_broken, 0,
        "nothing the broken engine answered reached a client"
    );
    assert!(ejected_at.is_some(), "the broken engine was never ejected");
    assert!(
        server_errors >= 1,
        "the broken engine was never tried: the test tested nothing"
    );
    // The engine recovers: it takes traffic again once its ejection runs out
    // and a request succeeds there.
    sims[1]
        .inject(&FaultRequest {
            fail_requests: Some(FailMode::None),
            ..FaultRequest::default()
        })
        .await
        .unwrap();
    let healed = Instant::now();
    let n = std::sync::atomic::AtomicUsize::new(0);
    let back = eventually(Duration::from_secs(60), "the engine readmitted", || async {
        // New prompts: a repeated one would stay on the engine holding it.
        let k = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &words(7_000 + k * 40, 30), false, 2),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        (reply.endpoint() == broken).then(|| healed.elapsed())
    })
    .await;
    eprintln!("FIGURE broken-engine: readmitted {back:?} after it was repaired");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ejected_single_engine_is_still_tried() {
    // Panic mode: with every endpoint of a set ejected, trying beats a 503.
    let sims = engines(1, |_| {}).await;
    let r = router(&[EngineAddr::of(&sims[0])], &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 1, true).await;
    let view = r.running.shared.view();
    let e = view.worker_sets[0].endpoints[0].clone();
    for _ in 0..10 {
        e.record(
            kinference_router::endpoint::Outcome::ConnectFailure,
            Instant::now(),
        );
    }
    assert!(!e.healthy(Instant::now()), "ejected for 30 s");
    let reply = post(
        r.api(),
        "/v1/chat/completions",
        &chat(MODEL, "hello", false, 2),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(r.running.shared.metrics.panic_decisions.get() >= 1);
    assert!(e.healthy(Instant::now()), "its success readmitted it");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_probe_answers_abandon_no_request_in_flight() {
    // A busy engine answers /health and /metrics late; the request it is
    // working on (non-streaming: its headers come at the end) must finish
    // there, not be thrown away and redone elsewhere.
    let sims = engines(2, |c| {
        c.latency.decode_ms_per_seq = 20.0;
    })
    .await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 2, true).await;
    for s in &sims {
        s.inject(&FaultRequest {
            metrics_delay_ms: Some(3_000),
            ..FaultRequest::default()
        })
        .await
        .unwrap();
    }
    // 200 tokens at ≥ 25 ms each: longer than several probe rounds.
    let t0 = Instant::now();
    let reply = post(
        r.api(),
        "/v1/chat/completions",
        &chat(MODEL, &words(0, 40), false, 200),
    )
    .await;
    let down = r
        .running
        .shared
        .metrics
        .retries
        .get_or_create(&kinference_router::metrics::RetryLabels { reason: "down" })
        .get();
    eprintln!(
        "FIGURE slow-probes: a {:?} non-streaming request on an engine answering /metrics 3 s late: status {}, moved {down} times",
        t0.elapsed(),
        reply.status
    );
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(down, 0, "slow probes moved a request in progress");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_block_size_resubscribes_and_matches_resume() {
    let sim = engines(1, |c| {
        c.engine.block_size = 16;
    })
    .await
    .remove(0);
    let addrs = [EngineAddr::of(&sim)];
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 1, true).await;
    let p = prompt(3, 8);
    send_prompt(&r, &p).await;
    eventually(Duration::from_secs(10), "blocks at width 16", || async {
        (router_depth(&r, &p) == 8).then_some(())
    })
    .await;
    // The operator says the events are 32 tokens wide (as after changing the
    // engines' --block-size): the subscription is made again at 32.
    let wider = WorkerSetOpts {
        kv_block_size: 32,
        ..WorkerSetOpts::default()
    };
    write_manifests(r.dir.path(), &manifests_yaml(&addrs, &wider));
    eventually(
        Duration::from_secs(15),
        "resubscribed at width 32",
        || async {
            let idx = r.running.shared.kv.index();
            let w = idx.workers();
            (w.len() == 1 && idx.worker_stats(w[0].0).is_some_and(|s| s.block_size == 32))
                .then_some(())
        },
    )
    .await;
    // Back to the engines' real width: the subscription follows again, and
    // matches come back without restarting any pod (the new stream asks the
    // engine to re-report what a repeated prompt reuses).
    write_manifests(
        r.dir.path(),
        &manifests_yaml(&addrs, &WorkerSetOpts::default()),
    );
    eventually(
        Duration::from_secs(15),
        "resubscribed at width 16",
        || async {
            let idx = r.running.shared.kv.index();
            let w = idx.workers();
            (w.len() == 1
                && idx.worker_stats(w[0].0).is_some_and(|s| s.block_size == 16)
                && endpoints(&r).await["endpoints"][0]["kv"][0]["connected"] == true)
                .then_some(())
        },
    )
    .await;
    send_prompt(&r, &p).await;
    eventually(
        Duration::from_secs(15),
        "matches at width 16 again",
        || async {
            let (a, t) = (router_depth(&r, &p), truth_depth(&sim, &p));
            (a == t).then_some(())
        },
    )
    .await;
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_engines_are_discovered_scraped_and_indexed() {
    let sim = engines(1, |c| {
        c.engine_mode = EngineMode::sglang(Version::new(0, 5, 23));
        c.dp_size = 2;
        c.kv_events = c.kv_events.take().map(|k| k.with_replay(0));
    })
    .await
    .remove(0);
    let r = router(&[EngineAddr::of(&sim)], &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 1, true).await;
    let e = endpoints(&r).await;
    let ep = &e["endpoints"][0];
    assert_eq!(
        ep["kv"].as_array().unwrap().len(),
        2,
        "both DP ranks from /server_info: {ep}"
    );
    let ids = prompt(9, 8);
    send_prompt(&r, &ids).await;
    eventually(Duration::from_secs(10), "SGLang events indexed", || async {
        (router_depth(&r, &ids) == truth_depth(&sim, &ids) && router_depth(&r, &ids) > 0)
            .then_some(())
    })
    .await;
    let scraped = eventually(
        Duration::from_secs(10),
        "sglang metrics scraped",
        || async {
            let e = endpoints(&r).await;
            let s = e["endpoints"][0]["scraped"].clone();
            (s["family"] == "sglang").then_some(s)
        },
    )
    .await;
    // Its KV-cache size from `/server_info` (`max_total_num_tokens` per
    // rank, two ranks): what a prefill there would evict is charged.
    let per_rank = (sim.config().engine.num_gpu_blocks - 1) * sim.config().engine.block_size;
    assert_eq!(
        endpoints(&r).await["endpoints"][0]["kv_capacity_tokens"],
        2 * per_rank as u64,
    );
    // A streamed first token calibrates it, which operators can see beside
    // the rest: the scale predictions use and the fleet's part of it.
    let streamed = post_streaming(
        r.api(),
        "/v1/completions",
        &serde_json::json!({"model": MODEL, "prompt": ids, "max_tokens": 2, "stream": true}),
    )
    .await;
    assert_eq!(streamed.status(), 200);
    http_body_util::BodyExt::collect(streamed.into_body())
        .await
        .unwrap();
    let cal = eventually(Duration::from_secs(5), "calibration shown", || async {
        let c = endpoints(&r).await["endpoints"][0]["calibration"].clone();
        (c["samples"].as_u64() >= Some(1)).then_some(c)
    })
    .await;
    assert!(cal["scale"].as_f64() > Some(0.0), "{cal}");
    assert!(cal["fleet_scale"].as_f64() > Some(0.0), "{cal}");
    eprintln!(
        "FIGURE sglang: {} ranks subscribed; scraped {scraped}",
        ep["kv"].as_array().unwrap().len()
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_router_restart_the_index_converges_on_a_warm_fleet() {
    // A warm engine without replay, then a new router: nothing the engine
    // held before is in the new index. Requests repeating earlier prompts
    // ask vLLM (≥ 0.26) to re-report the blocks they reuse, and the index
    // converges on what the engine holds for the prefixes requested again.
    let sim = engines(1, |c| {
        c.kv_events = c.kv_events.take().map(KvEventsConfig::without_replay);
    })
    .await
    .remove(0);
    let addrs = [EngineAddr::of(&sim)];
    let warm: Vec<Vec<u32>> = (0..8).map(|k| prompt(100 + k, 10)).collect();
    {
        let first = router(&addrs, &WorkerSetOpts::default(), &[]).await;
        wait_routable(&first, 1, true).await;
        for p in &warm {
            send_prompt(&first, p).await;
        }
        first.shutdown().await;
    }
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 1, true).await;
    eventually(
        Duration::from_secs(10),
        "the engine's version known",
        || async {
            let view = r.running.shared.view();
            view.worker_sets[0].endpoints[0]
                .reports_reused_blocks_on_request()
                .then_some(())
        },
    )
    .await;
    let visible = |r: &Router| -> (u32, u32) {
        warm.iter()
            .map(|p| (router_depth(r, p), truth_depth(&sim, p)))
            .fold((0, 0), |(a, b), (x, y)| (a + x, b + y))
    };
    let (before, truth) = visible(&r);
    let t0 = Instant::now();
    let mut timeline = Vec::new();
    for p in &warm {
        send_prompt(&r, p).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        timeline.push((t0.elapsed().as_millis(), visible(&r).0));
    }
    let (after, truth_after) = eventually(Duration::from_secs(10), "converged", || async {
        let (a, t) = visible(&r);
        (a == t).then_some((a, t))
    })
    .await;
    eprintln!(
        "FIGURE restart-recovery: warm prompts' blocks visible to the new router {before} of {truth} at start; after each repeated prompt (ms, visible): {timeline:?}; {after} of {truth_after} at the end; {} requests asked for re-reports",
        r.running.shared.metrics.kv_recovery_requests.get()
    );
    assert_eq!(before, 0, "a new router starts knowing nothing");
    assert!(truth > 0);
    assert_eq!(after, truth_after);
    // Still inside the recovery window, prompts the index now shows whole
    // on their engine ask for no re-report: it would repeat what the index
    // holds (on a busy engine, every request's whole prompt as events).
    let asked = r.running.shared.metrics.kv_recovery_requests.get();
    assert!(asked > 0, "the recovery asked for re-reports");
    assert!(
        r.running.shared.view().worker_sets[0].endpoints[0].kv_recovering(Instant::now()),
        "still within the recovery window"
    );
    for p in &warm {
        send_prompt(&r, p).await;
    }
    assert_eq!(
        r.running.shared.metrics.kv_recovery_requests.get(),
        asked,
        "known prompts asked for re-reports"
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_mode_routes_to_engines_named_on_the_command_line() {
    // `serve --engine URL …`: no YAML, no cluster. A vLLM 0.31 engine says
    // where its events are (/kv_event_sources); a vLLM 0.30 one does not,
    // and `--kv-port` names its port.
    let new = engines(1, |c| c.engine_mode = vllm(31)).await.remove(0);
    let old = engines(1, |c| {
        c.seed = 1;
        c.engine_mode = vllm(30);
        c.kv_events = c.kv_events.take().map(KvEventsConfig::without_replay);
    })
    .await
    .remove(0);
    let url = |s: &kinference_sim::SimHandle| format!("http://{}", s.http_addr());
    let (new_url, old_url) = (url(&new), url(&old));
    let kv_port = old.kv_addr().expect("KV events").port().to_string();
    let r = serve(
        tempfile::tempdir().unwrap(),
        &[
            "--engine",
            &new_url,
            "--engine",
            &old_url,
            "--kv-port",
            &kv_port,
        ],
    )
    .await;
    wait_routable(&r, 2, true).await;
    // Both engines' events reach the index.
    for (k, sim) in [(0, &new), (1, &old)] {
        let p = prompt(40 + k, 6);
        let direct = post_direct(sim, &p).await;
        assert_eq!(direct, 200);
        eventually(Duration::from_secs(10), "blocks indexed", || async {
            let (router, truth) = depths(&r, sim, &p);
            (router > 0 && router == truth).then_some(())
        })
        .await;
    }
    // And the router serves the engines' model through them.
    send_prompt(&r, &prompt(50, 4)).await;
    r.shutdown().await;
}

/// Sends `ids` to `sim` directly (not through the router): the status.
async fn post_direct(sim: &kinference_sim::SimHandle, ids: &[u32]) -> u16 {
    post(
        sim.http_addr(),
        "/v1/completions",
        &serde_json::json!({"model": MODEL, "prompt": ids, "max_tokens": 2}),
    )
    .await
    .status
}

/// `n` SGLang engines (the latest release modelled) behind a router with
/// the default profile (`engine` tokenization), routable.
async fn sglang_fleet(n: usize) -> (Vec<kinference_sim::SimHandle>, Router) {
    let sims = engines(n, |c| {
        c.engine_mode = EngineMode::sglang(Version::new(0, 5, 23));
    })
    .await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, n, true).await;
    (sims, r)
}

/// SGLang's native `/generate` (`text` or `input_ids`, no model), which
/// RL frameworks and SGLang's own clients use: routed on its cached prefix
/// like a completion, the body passed through untouched, streams included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_generate_is_routed_on_its_cached_prefix() {
    let (_sims, r) = sglang_fleet(3).await;
    let generate = |body: serde_json::Value| {
        let api = r.api();
        async move { post(api, "/generate", &body).await }
    };
    // A long shared prefix, then different endings: every request goes
    // where the prefix is cached, whichever way the prompt comes.
    let prefix = words(0, 200);
    let first = generate(serde_json::json!({
        "text": format!("{prefix} w9001"),
        "sampling_params": {"max_new_tokens": 2, "ignore_eos": true},
    }))
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let home = first.endpoint();
    assert_eq!(
        first.json()["meta_info"]["completion_tokens"],
        2,
        "SGLang's shape"
    );
    let tokenized = post(
        r.api(),
        "/tokenize",
        &serde_json::json!({"model": MODEL, "prompt": format!("{prefix} w9002")}),
    )
    .await;
    let ids = tokenized.json()["tokens"].clone();
    eventually(Duration::from_secs(10), "the prefix indexed", || async {
        let e = endpoints(&r).await;
        let held: u64 = e["endpoints"]
            .as_array()?
            .iter()
            .filter_map(|ep| ep["kv"][0]["blocks_held"].as_u64())
            .sum();
        (held >= 12).then_some(())
    })
    .await;
    for (i, body) in [
        serde_json::json!({"text": format!("{prefix} w9003"), "sampling_params": {"max_new_tokens": 1}}),
        serde_json::json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}),
        serde_json::json!({"text": format!("{prefix} w9004"), "sampling_params": {"max_new_tokens": 1}, "rid": "r-1"}),
    ]
    .into_iter()
    .enumerate()
    {
        let reply = send(
            r.api(),
            "POST",
            "/generate",
            &[("x-kinference-debug", "1")],
            bytes::Bytes::from(serde_json::to_vec(&body).unwrap()),
        )
        .await;
        assert_eq!(reply.status, 200, "{i}: {}", reply.text());
        assert_eq!(reply.endpoint(), home, "{i}: routed to its cached prefix");
        // The router saw the prefix: its ids, and most of them cached there.
        let decision = reply.headers["x-kinference-decision"].to_str().unwrap();
        let warm: f64 = decision
            .split("; ")
            .find_map(|kv| kv.strip_prefix("cached="))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        assert!(warm > 0.9 && !decision.contains("tokens=none"), "{i}: {decision}");
        assert!(
            reply.json()["meta_info"]["cached_tokens"].as_u64() >= Some(190),
            "{i}: {}",
            reply.text()
        );
    }
    // Streamed: SGLang's events through to [DONE].
    let streamed = post_streaming(
        r.api(),
        "/generate",
        &serde_json::json!({"text": format!("{prefix} w9005"), "sampling_params": {"max_new_tokens": 3, "ignore_eos": true}, "stream": true}),
    )
    .await;
    assert_eq!(streamed.status(), 200);
    let (_, text) = read_stream(streamed.into_body(), Duration::from_secs(10)).await;
    assert!(
        text.contains("\"output_ids\"") && text.trim_end().ends_with("data: [DONE]"),
        "{text}"
    );
    // Neither `text` nor `input_ids`: the router's 400, no engine asked.
    let bad = generate(serde_json::json!({"sampling_params": {}})).await;
    assert_eq!(bad.status, 400, "{}", bad.text());
    assert!(
        bad.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("text or input_ids")
    );
    r.shutdown().await;
}

/// SGLang cannot tokenize a chat request (`/v1/tokenize` takes a prompt),
/// so with the default `engine` tokenization the router cannot key chat on
/// the engines' KV events. It keys it on the prompt's text against its
/// record of what it sent, as SGLang's own router does, rather than on
/// load alone: a conversation's turns go where its history is cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_chat_in_engine_mode_keeps_to_its_text_prefix() {
    let (_sims, r) = sglang_fleet(3).await;
    let system = words(0, 300);
    let mut homes = std::collections::HashSet::new();
    for turn in 0..4 {
        let body = serde_json::json!({
            "model": MODEL,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("w{}", 9000 + turn)},
            ],
            "max_tokens": 1,
        });
        let reply = send(
            r.api(),
            "POST",
            "/v1/chat/completions",
            &[("x-kinference-debug", "1")],
            bytes::Bytes::from(serde_json::to_vec(&body).unwrap()),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        let decision = reply.headers["x-kinference-decision"].to_str().unwrap();
        assert!(decision.contains("tokens=approximate"), "{decision}");
        homes.insert(reply.endpoint());
        if turn > 0 {
            assert!(
                !decision.contains("cached=0.00"),
                "turn {turn} found its prefix: {decision}"
            );
        }
    }
    assert_eq!(
        homes.len(),
        1,
        "every turn went where the system prompt is: {homes:?}"
    );
    r.shutdown().await;
}
