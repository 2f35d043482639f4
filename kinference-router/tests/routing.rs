//! The router in front of real simulated engines, on loopback.

mod support;

use std::collections::HashSet;
use std::time::Duration;

use http_body_util::BodyExt;
use serde_json::json;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_stream_and_not() {
    let sims = engines(2, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 2, true).await;
    let known: HashSet<String> = sims.iter().map(|s| s.http_addr().to_string()).collect();

    for stream in [false, true] {
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &words(0, 40), stream, 8),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert!(
            known.contains(&reply.endpoint()),
            "x-kinference-endpoint {:?}",
            reply.endpoint()
        );
        assert_eq!(reply.headers["x-kinference-worker-set"], "sim");
        if stream {
            let t = reply.text();
            assert!(
                t.contains("data: ") && t.trim_end().ends_with("data: [DONE]"),
                "{t}"
            );
        } else {
            let j = reply.json();
            assert_eq!(j["object"], "chat.completion");
            assert!(
                j["choices"][0]["message"]["content"]
                    .as_str()
                    .is_some_and(|c| !c.is_empty())
            );
        }

        let body =
            json!({"model": MODEL, "prompt": words(100, 30), "max_tokens": 5, "stream": stream});
        let reply = post(r.api(), "/v1/completions", &body).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert!(known.contains(&reply.endpoint()));
        if stream {
            assert!(reply.text().trim_end().ends_with("data: [DONE]"));
        } else {
            assert_eq!(reply.json()["object"], "text_completion");
        }
    }

    // The router's own model list: the model and its alias.
    let models = get(r.api(), "/v1/models").await.json();
    let ids: HashSet<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert!(ids.contains(MODEL) && ids.contains(ALIAS), "{models}");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aliases_are_rewritten_and_unknown_models_are_404() {
    let sims = engines(1, |_| {}).await;
    let r = router(&[EngineAddr::of(&sims[0])], &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 1, true).await;

    // The engine only knows its served name: success means the alias was
    // rewritten, for the request and for the engine's /tokenize.
    let reply = send(
        r.api(),
        "POST",
        "/v1/chat/completions",
        &[("x-kinference-debug", "1")],
        bytes::Bytes::from(serde_json::to_vec(&chat(ALIAS, "w1 w2 w3", false, 4)).unwrap()),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(reply.json()["model"], MODEL);
    let decision = reply.headers["x-kinference-decision"].to_str().unwrap();
    assert!(decision.contains("tokens=engine"), "{decision}");

    // No model (absent, null or empty), as vLLM accepts: the pool's one
    // model, named in the body the engine gets.
    for model in [None, Some(json!(null)), Some(json!(""))] {
        let mut body = json!({"messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 2});
        if let Some(m) = model.clone() {
            body["model"] = m;
        }
        let reply = post(r.api(), "/v1/chat/completions", &body).await;
        assert_eq!(reply.status, 200, "model {model:?}: {}", reply.text());
        assert_eq!(reply.json()["model"], MODEL);
    }

    let reply = post(
        r.api(),
        "/v1/chat/completions",
        &chat("gpt-17", "hi", false, 4),
    )
    .await;
    assert_eq!(reply.status, 404);
    let j = reply.json();
    assert_eq!(j["error"]["code"], "model_not_found");
    assert_eq!(j["error"]["type"], "invalid_request_error");

    // Malformed requests are refused by the router with OpenAI-shaped errors.
    let reply = send(
        r.api(),
        "POST",
        "/v1/chat/completions",
        &[],
        bytes::Bytes::from_static(b"{\"model\":"),
    )
    .await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.json()["error"]["type"], "invalid_request_error");
    let reply = post(r.api(), "/v1/completions", &json!({"model": MODEL})).await;
    assert_eq!(reply.status, 400);
    assert!(
        reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("prompt")
    );
    let reply = get(r.api(), "/v2/nothing").await;
    assert_eq!(reply.status, 404);
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_follows_the_engine_that_cached_it() {
    let sims = engines(4, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 4, true).await;

    let system = words(1000, 1500);
    let first = post(
        r.api(),
        "/v1/chat/completions",
        &chat(MODEL, &format!("{system} w1"), false, 4),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.text());
    let warm = first.endpoint();
    // The engine reported the blocks: the index knows them.
    eventually(
        Duration::from_secs(10),
        "the first prompt's blocks in the index",
        || async {
            let e = endpoints(&r).await;
            let ep = e["endpoints"]
                .as_array()?
                .iter()
                .find(|x| x["endpoint"] == warm.as_str())?
                .clone();
            (ep["kv"][0]["blocks_held"].as_u64()? >= 90).then_some(())
        },
    )
    .await;
    for i in 0..6 {
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat(
                MODEL,
                &format!("{system} w{} w{}", 60_000 + i, 61_000 + i),
                false,
                4,
            ),
        )
        .await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.endpoint(), warm, "request {i} left the warm engine");
    }
    // Unrelated prompts are spread rather than piled on one engine.
    let mut cold = HashSet::new();
    for i in 0..8 {
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &words(20_000 + i * 500, 200), false, 2),
        )
        .await;
        cold.insert(reply.endpoint());
    }
    assert!(cold.len() >= 3, "cold prompts went to {cold:?}");
    // And the decision is explained on request.
    let explained = || {
        send(
            r.api(),
            "POST",
            "/v1/chat/completions",
            &[("x-kinference-debug", "1")],
            bytes::Bytes::from(
                serde_json::to_vec(&chat(MODEL, &format!("{system} w9"), false, 2)).unwrap(),
            ),
        )
    };
    let reply = explained().await;
    let decision = reply.headers["x-kinference-decision"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        decision.contains("ttft_ms=") && decision.contains("tokens=engine"),
        "{decision}"
    );
    let explain: serde_json::Value =
        serde_json::from_str(reply.headers["x-kinference-explain"].to_str().unwrap()).unwrap();
    assert_eq!(explain["candidates"].as_array().unwrap().len(), 4);
    // Each candidate's KV cache: its size from `vllm:cache_config_info`
    // (`kv_cache_size_tokens`: 8,192 blocks of 16 less vLLM's null block),
    // and the blocks the index shows it holding (the maintainer refreshes
    // them every second).
    for c in explain["candidates"].as_array().unwrap() {
        assert_eq!(c["inputs"]["room"]["capacity_blocks"], 8191, "{c}");
    }
    eventually(
        Duration::from_secs(10),
        "the warm engine's blocks held in its candidate's KV room",
        || async {
            let reply = explained().await;
            let explain: serde_json::Value =
                serde_json::from_str(reply.headers.get("x-kinference-explain")?.to_str().ok()?)
                    .ok()?;
            let used =
                explain["candidates"]
                    .as_array()?
                    .iter()
                    .find(|c| c["inputs"]["cached"]["gpu"].as_u64().unwrap_or(0) >= 90)?["inputs"]
                    ["room"]["used_blocks"]
                    .as_u64()?;
            (used >= 90).then_some(())
        },
    )
    .await;
    assert!(
        !get(r.admin(), "/debug/explain")
            .await
            .json()
            .as_array()
            .unwrap()
            .is_empty()
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_fails_its_streams_clearly_and_is_avoided() {
    let mut sims = engines(3, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 3, true).await;

    // A long stream, then its engine dies.
    let resp = post_streaming(
        r.api(),
        "/v1/chat/completions",
        &chat(MODEL, &words(0, 50), true, 2000),
    )
    .await;
    assert_eq!(resp.status(), 200);
    let victim = resp.headers()["x-kinference-endpoint"]
        .to_str()
        .unwrap()
        .to_owned();
    let i = sims
        .iter()
        .position(|s| s.http_addr().to_string() == victim)
        .unwrap();
    let mut body = resp.into_body();
    let first = body
        .frame()
        .await
        .expect("a first chunk")
        .expect("first chunk ok");
    assert!(first.data_ref().is_some());
    let dead = sims.remove(i);
    let killed_at = tokio::time::Instant::now();
    dead.shutdown().await;

    // The client sees an error, never a stream that ends as if complete.
    let mut text = String::new();
    let outcome = loop {
        match tokio::time::timeout(Duration::from_secs(20), body.frame()).await {
            Err(_) => break "hang",
            Ok(None) => break "ended",
            Ok(Some(Err(_))) => break "error",
            Ok(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    text.push_str(&String::from_utf8_lossy(d));
                }
            }
        }
    };
    assert!(
        !text.contains("[DONE]"),
        "the stream claimed to be complete"
    );
    assert_ne!(outcome, "hang");
    assert_eq!(outcome, "error", "a cut stream must surface as an error");

    // New requests succeed and avoid the dead engine.
    for k in 0..10 {
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &words(3000 + k * 100, 30), false, 2),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_ne!(reply.endpoint(), victim);
    }
    eprintln!(
        "10 requests after the kill, all elsewhere, within {:?}",
        killed_at.elapsed()
    );
    // Nothing leaked: in-flight accounting is back to zero everywhere.
    eventually(Duration::from_secs(5), "in-flight back to zero", || async {
        let e = endpoints(&r).await;
        e["endpoints"]
            .as_array()?
            .iter()
            .all(|ep| ep["load"]["requests"] == 0)
            .then_some(())
    })
    .await;
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_added_to_the_manifests_is_used_without_restart() {
    let sims = engines(2, |_| {}).await;
    let r = router(&[EngineAddr::of(&sims[0])], &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 1, true).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    write_manifests(
        r.dir.path(),
        &manifests_yaml(&addrs, &WorkerSetOpts::default()),
    );
    wait_routable(&r, 2, true).await;
    let new = sims[1].http_addr().to_string();
    let mut seen = false;
    for i in 0..6 {
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &words(40_000 + i * 300, 100), false, 2),
        )
        .await;
        assert_eq!(reply.status, 200);
        seen |= reply.endpoint() == new;
    }
    assert!(seen, "the added engine took no request");

    // And an engine made unready in its slice gets no more requests.
    let mut addrs = addrs;
    addrs[0].ready = false;
    write_manifests(
        r.dir.path(),
        &manifests_yaml(&addrs, &WorkerSetOpts::default()),
    );
    wait_routable(&r, 1, true).await;
    for i in 0..4 {
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &words(50_000 + i * 300, 100), false, 2),
        )
        .await;
        assert_eq!(reply.endpoint(), new);
    }
    // A broken manifest is refused and the last good objects stay in use.
    std::fs::write(r.dir.path().join("broken.yaml"), "apiVersion: kinference.buoyant.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {name: x}\nspec: {kvBlockSize: 0, serviceRef: {name: s, port: 1}}\n").unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let reply = post(
        r.api(),
        "/v1/chat/completions",
        &chat(MODEL, "w1 w2", false, 2),
    )
    .await;
    assert_eq!(reply.status, 200);
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn problems_are_shown_and_slow_clients_are_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let sims = engines(1, |_| {}).await;
    let r = router(
        &[EngineAddr::of(&sims[0])],
        &WorkerSetOpts::default(),
        &["--body-read-timeout", "1s", "--debug-headers", "false"],
    )
    .await;
    wait_routable(&r, 1, true).await;

    // The pool names a worker set that does not exist: shown, not hidden.
    let text = manifests_yaml(&[EngineAddr::of(&sims[0])], &WorkerSetOpts::default()).replace(
        "workerSets: [{name: sim}]",
        "workerSets: [{name: sim}, {name: ghost}]",
    );
    write_manifests(r.dir.path(), &text);
    let problems = eventually(
        Duration::from_secs(10),
        "the missing worker set reported",
        || async {
            let e = endpoints(&r).await;
            let p = e["problems"].as_array()?.clone();
            (!p.is_empty()).then_some(p)
        },
    )
    .await;
    assert!(
        problems[0].as_str().unwrap().contains("ghost"),
        "{problems:?}"
    );
    let metrics = get(r.admin(), "/metrics").await.text();
    assert!(
        metrics.contains("kinference_router_config_problems 1"),
        "{metrics}"
    );

    // Debug headers are off: no decision in the response.
    let reply = send(
        r.api(),
        "POST",
        "/v1/chat/completions",
        &[("x-kinference-debug", "1")],
        bytes::Bytes::from(serde_json::to_vec(&chat(MODEL, "w1 w2", false, 2)).unwrap()),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert!(reply.headers.get("x-kinference-decision").is_none());

    // A client that sends headers and never its body gets a 408.
    let mut s = tokio::net::TcpStream::connect(r.api()).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .expect("an answer")
        .unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    r.shutdown().await;
}

/// A request for a LoRA adapter goes where the adapter already runs, or
/// where a slot is free, rather than to a less loaded engine whose only
/// slot (`--max-loras 1`) runs another adapter: there it would wait until
/// that adapter's requests had all finished.
/// A profile where each decoding sequence costs a step 20 ms: an engine
/// decoding a few more sequences is clearly slower to a first token.
fn decode_heavy() -> WorkerSetOpts {
    WorkerSetOpts {
        profile_spec: Some("  latency: {decodeCostMillis: 20}\n".into()),
        ..WorkerSetOpts::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_request_avoids_an_engine_whose_slots_run_other_adapters() {
    let sims = engines(2, |c| {
        c.lora.max_loras = 1;
        c.lora.modules = ["sql", "math"]
            .iter()
            .map(|n| kinference_sim::LoraModule {
                name: (*n).into(),
                path: format!("/adapters/{n}"),
            })
            .collect();
    })
    .await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &decode_heavy(), &[]).await;
    wait_routable(&r, 2, true).await;
    let long = |model: &str, start: usize| json!({"model": model, "prompt": words(start, 64), "max_tokens": 4000, "stream": true});

    // One long `sql` generation, through the router: its engine's only
    // slot now runs `sql`.
    let sql = post_streaming(r.api(), "/v1/completions", &long("sql", 0)).await;
    assert_eq!(sql.status(), 200);
    let busy = sql.headers()["x-kinference-endpoint"]
        .to_str()
        .unwrap()
        .to_owned();
    let other = sims
        .iter()
        .find(|s| s.http_addr().to_string() != busy)
        .expect("two engines");
    // The other engine decodes six long base-model generations the router
    // did not send: by load alone, the worse choice.
    let mut held = vec![sql];
    for i in 0..6 {
        let body = long(MODEL, 1000 + i * 100);
        let resp = post_streaming(other.http_addr(), "/v1/completions", &body).await;
        assert_eq!(resp.status(), 200);
        held.push(resp);
    }
    let free = other.http_addr().to_string();
    eventually(
        Duration::from_secs(10),
        "the router scrapes both engines' adapters and batches",
        || async {
            let e = endpoints(&r).await;
            let eps = e["endpoints"].as_array()?;
            let of = |addr: &str| eps.iter().find(|ep| ep["endpoint"] == addr);
            let batch = of(&free)?["scraped"]["running"].as_f64()? >= 6.0;
            let running = of(&busy)?["adapters"]["scraped"]["running"]
                .as_array()?
                .iter()
                .any(|a| a == "sql");
            (batch && running).then_some(())
        },
    )
    .await;

    let send = |model: &'static str, start: usize| {
        let api = r.api();
        async move {
            let reply = post(
                api,
                "/v1/completions",
                &json!({"model": model, "prompt": words(start, 64), "max_tokens": 2}),
            )
            .await;
            assert_eq!(reply.status, 200, "{}", reply.text());
            reply.endpoint()
        }
    };
    assert_eq!(
        send("math", 5000).await,
        free,
        "a free slot beside six decodes beats waiting for the `sql` slot"
    );
    assert_eq!(
        send("sql", 6000).await,
        busy,
        "where `sql` runs, a `sql` request needs no slot"
    );
    // Operators see where adapter requests went.
    let page = get(r.admin(), "/metrics").await.text();
    let sent = |slot: &str| {
        sum_of(
            &page,
            "kinference_router_adapter_requests_total",
            &[("slot", slot)],
        )
    };
    assert!(sent("free") >= 1.0 && sent("resident") >= 1.0, "{page}");
    assert!(sent("full") < 1.0, "none went where every slot was taken");
    drop(held);
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleets_step_costs_are_learnt_from_its_streams() {
    let sims = step_truth_engine().await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 1, true).await;
    let before = endpoints(&r).await["endpoints"][0]["calibration"]["steps"].clone();
    assert_eq!(before["samples"], 0, "{before}");
    assert_eq!(before["in_use"], false, "{before}");

    teach_step_costs(&r).await;
    let steps = step_costs_when(&r, Duration::from_secs(5), "step costs learnt", |s| {
        s["samples"].as_u64() >= Some(40)
    })
    .await;
    // Within a third: the batch is averaged per chunk (a long prefill
    // step beside one decode counts as one step); averaged per unit of
    // time it made the prefill cost 1.3-1.7x too high here.
    assert_learnt_step_truth("the router", &steps);
    r.shutdown().await;
}

/// A cold prompt waits where running sequences hold nearly every KV block
/// (the engine holds it, or preempts and recomputes it, until enough of
/// them finish): the router counts the blocks it will take on top of the
/// engine's scraped usage, and charges a full cache the time its streams
/// take to decode, so the prompt goes to an engine with room even where
/// that engine decodes more sequences.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_prompt_avoids_an_engine_whose_running_sequences_fill_its_cache() {
    // 400 blocks of 16 tokens each; steps three times the default's.
    let sims = engines(2, |c| {
        c.engine.num_gpu_blocks = 401;
        c.max_model_len = 6400;
        c.faults.slowdown = 3.0;
    })
    .await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &decode_heavy(), &[]).await;
    wait_routable(&r, 2, true).await;
    // Streams through the router teach it how long streams decode.
    for i in 0..10 {
        let reply = stream_timed(
            r.api(),
            "/v1/completions",
            &json!({"model": MODEL, "prompt": words(100 * i, 20), "max_tokens": 48, "stream": true}),
            &[],
        )
        .await;
        assert_eq!(reply.status, 200);
    }
    let turnover = eventually(
        Duration::from_secs(5),
        "the streams' turnover learnt",
        || async { endpoints(&r).await["endpoints"][0]["calibration"]["kv_turnover_ms"].as_f64() },
    )
    .await;
    eprintln!("FIGURE learnt KV turnover: {turnover:.0} ms");
    assert!(
        turnover > 50.0,
        "48 tokens at 15 ms a step or more: {turnover}"
    );

    // Engine 0: three long generations of 1,600-token prompts hold 300 of
    // its 400 blocks (and grow); engine 1: eight of 16-token prompts, few
    // blocks but more sequences decoding. Neither through the router.
    let long = |start: usize, words_n: usize| json!({"model": MODEL, "prompt": words(start, words_n), "max_tokens": 400, "stream": true});
    let mut held = Vec::new();
    for (sim, n, first, words_n) in [(&sims[0], 3, 10_000, 1600), (&sims[1], 8, 30_000, 16)] {
        for i in 0..n {
            let body = long(first + 2_000 * i, words_n);
            let resp = post_streaming(sim.http_addr(), "/v1/completions", &body).await;
            assert_eq!(resp.status(), 200);
            held.push(resp);
        }
    }
    let (full, roomy) = (
        sims[0].http_addr().to_string(),
        sims[1].http_addr().to_string(),
    );
    eventually(
        Duration::from_secs(10),
        "the router scrapes both engines' batches and usage",
        || async {
            let e = endpoints(&r).await;
            let eps = e["endpoints"].as_array()?;
            let of = |addr: &str| eps.iter().find(|ep| ep["endpoint"] == addr);
            let busy = of(&full)?["scraped"]["kv_usage"].as_f64()? >= 0.75
                && of(&full)?["scraped"]["running"].as_f64()? >= 3.0;
            let batch = of(&roomy)?["scraped"]["running"].as_f64()? >= 8.0;
            (busy && batch).then_some(())
        },
    )
    .await;

    // A cold 1,600-token prompt (100 blocks) would take engine 0 past full.
    let reply = send(
        r.api(),
        "POST",
        "/v1/completions",
        &[("x-kinference-debug", "1")],
        bytes::Bytes::from(
            serde_json::to_vec(
                &json!({"model": MODEL, "prompt": words(50_000, 1600), "max_tokens": 2}),
            )
            .unwrap(),
        ),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let explain: serde_json::Value =
        serde_json::from_str(reply.headers["x-kinference-explain"].to_str().unwrap()).unwrap();
    assert_eq!(reply.endpoint(), roomy, "{explain}");
    // The chosen candidate is the roomy engine, the other the full one.
    let chosen = &explain["choice"]["endpoint"];
    let candidates = explain["candidates"].as_array().unwrap();
    let pick = |want: bool| {
        candidates
            .iter()
            .find(|c| (&c["inputs"]["endpoint"] == chosen) == want)
            .unwrap()
            .clone()
    };
    let (f, o) = (pick(false), pick(true));
    let kv = |c: &serde_json::Value| c["prediction"]["kv_pressure_ms"].as_f64().unwrap();
    let ttft = |c: &serde_json::Value| c["prediction"]["ttft_ms"].as_f64().unwrap();
    eprintln!(
        "FIGURE full cache: predicted {:.0} ms ({:.0} of KV pressure); the roomy engine {:.0} ms ({:.0})",
        ttft(&f),
        kv(&f),
        ttft(&o),
        kv(&o)
    );
    assert!(kv(&o).abs() < 1e-9, "{o}");
    // The KV pressure decided it: without it the full engine, decoding
    // fewer sequences, would have been predicted the sooner.
    let scale = f["prediction"]["scale"].as_f64().unwrap();
    eprintln!(
        "FIGURE full cache without its KV pressure: {:.0} ms",
        ttft(&f) - scale * kv(&f)
    );
    assert!(
        kv(&f) > 0.0 && ttft(&f) - scale * kv(&f) < ttft(&o),
        "{f}\n{o}"
    );
    drop(held);
    r.shutdown().await;
}

/// A client that leaves (a user pressing stop, a timeout in the SDK) must
/// free the engine: vLLM aborts a request when its connection closes, so
/// the router must close its own. Streamed after the first token, and
/// plain while the engine is still generating.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_frees_the_engine() {
    let sims = engines(1, |c| c.faults.slowdown = 5.0).await;
    let r = router(&[EngineAddr::of(&sims[0])], &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 1, true).await;
    let aborted = || sims[0].cache_truth(false).engines[0].counters.aborted;
    let running = || sims[0].cache_truth(false).engines[0].running.len();
    let body = |stream: bool| json!({"model": MODEL, "prompt": "w1 w2 w3", "max_tokens": 5000, "ignore_eos": true, "stream": stream});
    // Streamed: leave after the first chunk.
    let resp = post_streaming(r.api(), "/v1/completions", &body(true)).await;
    assert_eq!(resp.status(), 200);
    let mut stream = resp.into_body();
    stream.frame().await.expect("a first chunk").expect("ok");
    drop(stream);
    eventually(
        Duration::from_secs(5),
        "the stream's request aborted",
        || async { (aborted() == 1 && running() == 0).then_some(()) },
    )
    .await;
    // Plain: leave while the engine generates (no byte has come back).
    let addr = r.api();
    let plain = tokio::spawn(async move { post(addr, "/v1/completions", &body(false)).await });
    eventually(
        Duration::from_secs(5),
        "the plain request running",
        || async { (running() == 1).then_some(()) },
    )
    .await;
    plain.abort();
    eventually(
        Duration::from_secs(5),
        "the plain request aborted",
        || async { (aborted() == 2 && running() == 0).then_some(()) },
    )
    .await;
    r.shutdown().await;
}
