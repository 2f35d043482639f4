//! What operators and their load balancers see: health checks on the
//! serving port, model lookups, request ids, the access log, and metrics
//! per model, worker set and status code with tokens and latencies.

// Counters compared below are integers Prometheus text writes as floats:
// exact comparisons are what is meant.
#![allow(clippy::float_cmp)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};
use support::*;
use tokio::time::Instant;

fn with_id(body: &Value, id: Option<&str>) -> (Vec<(&'static str, String)>, Bytes) {
    let headers = id
        .map(|i| vec![("x-request-id", i.to_owned())])
        .unwrap_or_default();
    (headers, Bytes::from(serde_json::to_vec(body).unwrap()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_models_request_ids_and_metrics_per_model() {
    let sims = engines(2, |c| {
        // ~20 ms between tokens: a stream lasts long enough for its
        // duration to the last byte to stand apart from its first token.
        c.latency.decode_ms_per_seq = 20.0;
    })
    .await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 2, true).await;

    // Health checks on the serving port, as load balancers send them.
    let h = get(r.api(), "/health").await;
    assert_eq!((h.status, h.text().as_str()), (200, "ok\n"));
    let ready = get(r.api(), "/ready").await;
    assert_eq!(ready.status, 200, "{}", ready.text());
    let head = send(r.api(), "HEAD", "/health", &[], Bytes::new()).await;
    assert_eq!(head.status, 200);

    // One model's card, by name or alias (escaped slashes too); an unknown
    // one is OpenAI's model_not_found, and unknown paths OpenAI's 404.
    let card = get(r.api(), &format!("/v1/models/{MODEL}")).await;
    assert_eq!(card.status, 200, "{}", card.text());
    assert_eq!(card.json()["id"], MODEL);
    let escaped = get(
        r.api(),
        &format!("/v1/models/{}", MODEL.replace('/', "%2F")),
    )
    .await;
    assert_eq!(escaped.json()["id"], MODEL);
    assert_eq!(
        get(r.api(), &format!("/v1/models/{ALIAS}")).await.json()["id"],
        ALIAS
    );
    let missing = get(r.api(), "/v1/models/no-such-model").await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["error"]["code"], "model_not_found");
    let nowhere = get(r.api(), "/v2/nothing").await;
    assert_eq!(nowhere.status, 404);
    assert!(
        nowhere.json()["error"]["message"].is_string(),
        "{}",
        nowhere.text()
    );

    // Request ids: the client's comes back; without one the router makes one.
    let body = chat(MODEL, &words(0, 200), false, 8);
    let (hs, b) = with_id(&body, Some("client-id-1"));
    let hs: Vec<(&str, &str)> = hs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let answered = send(r.api(), "POST", "/v1/chat/completions", &hs, b).await;
    assert_eq!(answered.status, 200, "{}", answered.text());
    assert_eq!(answered.headers["x-request-id"], "client-id-1");
    let completion_a = answered.json()["usage"]["completion_tokens"]
        .as_u64()
        .unwrap();
    let made = post(r.api(), "/v1/chat/completions", &body).await;
    let id = made.headers["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(id.len(), 32, "{id}");
    let other = post(
        r.api(),
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    )
    .await;
    assert_ne!(id, other.headers["x-request-id"].to_str().unwrap());
    let completion_b = made.json()["usage"]["completion_tokens"].as_u64().unwrap()
        + other.json()["usage"]["completion_tokens"].as_u64().unwrap();
    // Errors carry one too.
    let unknown = post(
        r.api(),
        "/v1/chat/completions",
        &chat("no-such-model", "x", false, 1),
    )
    .await;
    assert_eq!(unknown.status, 404);
    assert!(unknown.headers.contains_key("x-request-id"));

    // A stream of 30 tokens, with usage in its last chunk.
    let mut streamed = chat(MODEL, &words(500, 300), true, 30);
    streamed["stream_options"] = json!({"include_usage": true});
    let sent = Instant::now();
    let resp = post_streaming(r.api(), "/v1/chat/completions", &streamed).await;
    assert!(resp.headers().contains_key("x-request-id"));
    let (ending, text) = read_stream(resp.into_body(), Duration::from_secs(20)).await;
    let stream_took = sent.elapsed();
    assert!(
        text.contains("\"completion_tokens\":30"),
        "{ending:?}: {text}"
    );

    let ws = ("worker_set", "sim");
    let model = ("model", MODEL);
    let m = eventually(Duration::from_secs(5), "the stream is recorded", || async {
        let m = get(r.admin(), "/metrics").await.text();
        value_of(
            &m,
            "kinference_router_time_to_first_token_seconds_count",
            &[model, ws],
        )
        .is_some_and(|n| n >= 1.0)
        .then_some(m)
    })
    .await;
    let has = |name: &str, labels: &[(&str, &str)]| {
        value_of(&m, name, labels).unwrap_or_else(|| panic!("no {name} {labels:?} in\n{m}"))
    };
    // Requests by API, model, worker set and status code.
    assert_eq!(
        has(
            "kinference_router_requests_total",
            &[("api", "chat"), model, ws, ("code", "200")]
        ),
        3.0
    );
    assert_eq!(
        has(
            "kinference_router_requests_total",
            &[("api", "chat"), ("code", "404")]
        ),
        1.0
    );
    assert!(
        has(
            "kinference_router_requests_total",
            &[("api", "models"), ("code", "200")]
        ) >= 3.0
    );
    // Completion tokens: the engines' usage figures, all of them.
    assert_eq!(
        has("kinference_router_completion_tokens_total", &[model, ws]),
        (completion_a + completion_b + 30) as f64
    );
    assert!(has("kinference_router_prompt_tokens_total", &[model, ws]) >= 500.0);
    assert!(
        value_of(
            &m,
            "kinference_router_cached_prompt_tokens_total",
            &[model, ws]
        )
        .is_some()
    );
    // Four requests routed: three chats and a completion.
    assert_eq!(
        has(
            "kinference_router_routed_cached_fraction_count",
            &[model, ws]
        ),
        4.0
    );
    assert_eq!(
        has(
            "kinference_router_predicted_ttft_seconds_count",
            &[model, ws]
        ),
        4.0
    );
    // 29 gaps between 30 token chunks (the engine may coalesce a few).
    let itl = has(
        "kinference_router_inter_token_latency_seconds_count",
        &[model, ws],
    );
    assert!(itl >= 10.0, "{itl} inter-token gaps");
    // Duration runs to the last byte: the stream's is about its whole time,
    // far more than its first token.
    let ttft = has(
        "kinference_router_time_to_first_token_seconds_sum",
        &[model, ws],
    );
    let durations = has(
        "kinference_router_request_duration_seconds_sum",
        &[("api", "chat"), model, ws, ("code", "200")],
    );
    assert!(
        durations >= stream_took.as_secs_f64() * 0.8 && durations > ttft + 0.3,
        "durations {durations} s, stream {stream_took:?}, ttft {ttft} s"
    );
    assert_eq!(has("kinference_router_requests_in_flight", &[]), 0.0);
    let decisions = sum_of(
        &m,
        "kinference_router_decisions_total",
        &[("policy", "kinference")],
    );
    assert_eq!(decisions, 4.0, "{m}");
    assert_eq!(
        has(
            "kinference_router_build_info",
            &[("version", kinference_router::metrics::VERSION)]
        ),
        1.0
    );
    assert_eq!(has("kinference_router_ready", &[]), 1.0);
    // Per-engine figures are labelled engine and worker_set, never endpoint.
    let engine_addr = addrs[0].http.to_string();
    let engine = ("engine", engine_addr.as_str());
    assert_eq!(has("kinference_router_engine_healthy", &[engine, ws]), 1.0);
    assert!(value_of(&m, "kinference_router_engine_queue_depth", &[engine, ws]).is_some());
    assert!(
        !kinference_api::engine::prometheus::samples(&m)
            .any(|s| s.name.starts_with("kinference_router") && s.label("endpoint").is_some()),
        "an endpoint label:\n{m}"
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_has_a_line_per_request_and_no_prompt() {
    let sims = engines(1, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = RouterProc::start(
        &addrs,
        &WorkerSetOpts::default(),
        &["--access-log", "--log-format", "json"],
        "warn",
    )
    .await;
    let secret = "a-prompt-word-that-must-not-be-logged";
    let body = chat(MODEL, &format!("{secret} {}", words(0, 50)), false, 5);
    let (hs, b) = with_id(&body, Some("trace-me-42"));
    let hs: Vec<(&str, &str)> = hs.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let reply = send(r.api, "POST", "/v1/chat/completions", &hs, b).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let bad = send(
        r.api,
        "POST",
        "/v1/completions",
        &[],
        Bytes::from_static(b"{not json"),
    )
    .await;
    assert_eq!(bad.status, 400);
    // A stream without usage, as most clients send it: its tokens are
    // counted from the stream's text events (vLLM's role chunk and empty
    // finishing chunk are not tokens).
    let plain_stream = stream_timed(
        r.api,
        "/v1/chat/completions",
        &chat(MODEL, &words(100, 50), true, 6),
        &[("x-request-id", "no-usage")],
    )
    .await;
    assert_eq!(plain_stream.status, 200);
    let log_path = r.log.clone();
    let lines = eventually(Duration::from_secs(5), "three access-log lines", || async {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        let lines: Vec<Value> = log
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["target"] == "kinference::access")
            .collect();
        (lines.len() >= 3).then_some(lines)
    })
    .await;
    let log = r.stop();
    let counted = lines
        .iter()
        .find(|l| l["fields"]["request_id"] == "no-usage")
        .expect("the stream's line");
    assert_eq!(counted["fields"]["completion_tokens"], 6, "{counted}");
    assert!(!log.contains(secret), "the prompt reached the log:\n{log}");
    let ok = lines
        .iter()
        .find(|l| l["fields"]["request_id"] == "trace-me-42")
        .unwrap_or_else(|| panic!("no line for trace-me-42: {lines:?}"));
    let f = &ok["fields"];
    assert_eq!(f["code"], 200);
    assert_eq!(f["model"], MODEL);
    assert_eq!(f["worker_set"], "sim");
    assert_eq!(f["engine"], addrs[0].http.to_string());
    assert_eq!(
        f["completion_tokens"],
        reply.json()["usage"]["completion_tokens"]
    );
    assert!(f["prompt_tokens"].as_u64().unwrap() >= 50, "{f}");
    assert!(f["duration_ms"].as_f64().unwrap() > 0.0);
    let rejected = lines
        .iter()
        .find(|l| l["fields"]["code"] == 400)
        .expect("the 400's line");
    assert_eq!(rejected["fields"]["api"], "completions");
    assert_eq!(rejected["fields"]["engine"], "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_the_engines_first_answers_and_says_why() {
    let sims = engines(1, |_| {}).await;
    // An "engine" that accepts connections and never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    addrs.push(EngineAddr {
        http: silent.local_addr().unwrap(),
        kv: None,
        ready: true,
        replay: None,
    });
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    let (good, quiet) = (addrs[0].http.to_string(), addrs[1].http.to_string());
    // Once the real engine answered, only the silent one is waited for.
    let waiting = eventually(
        Duration::from_secs(5),
        "waiting for the silent engine only",
        || async {
            let reply = get(r.api(), "/ready").await;
            let t = reply.text();
            (reply.status == 503 && t.contains(&quiet) && !t.contains(&good)).then_some(t)
        },
    )
    .await;
    assert!(waiting.contains("/v1/models"), "{waiting}");
    let admin = get(r.admin(), "/readyz").await;
    assert_eq!(admin.status, 503);
    assert_eq!(admin.text(), waiting);
    // Its first probe timing out is an answer too: then the router serves
    // (and at the latest after the grace).
    eventually(Duration::from_secs(15), "ready", || async {
        (get(r.api(), "/ready").await.status == 200).then_some(())
    })
    .await;
    let e = endpoints(&r).await;
    let quiet_report = e["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["endpoint"] == quiet.as_str())
        .cloned()
        .unwrap();
    assert!(quiet_report["models_error"].is_string(), "{quiet_report}");
    drop(silent);
    r.shutdown().await;
}
