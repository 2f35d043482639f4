//! Engines that fail the way real ones do: a CUDA fault answering every
//! inference request with a fast 500 while `/health`, `/v1/models` and
//! `/metrics` stay fine, a dead engine core, vLLM's admission control (503
//! and its counter), a fraction of requests failing, a slow `/metrics`,
//! and `--api-key` as vLLM and SGLang guard their paths. Real HTTP against
//! spawned engines; the `openai` Python client where a client's view
//! matters.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kinference_sim::{
    AdmissionLimits, ApiKeyScope, FailMode, FaultConfig, FaultRequest, OutputLen, SimConfig,
    SimEngine, SimHandle,
};
use serde_json::{Value, json};

async fn engine(tweak: impl FnOnce(&mut SimConfig)) -> SimHandle {
    let mut cfg = SimConfig::default();
    tweak(&mut cfg);
    SimEngine::spawn(cfg).await.expect("engine starts")
}

fn completion() -> Value {
    json!({"prompt": "w1 w2 w3", "max_tokens": 2})
}

/// A counter or gauge with an integral value.
async fn metric(c: &HttpClient, base: &str, line_start: &str) -> u64 {
    let (status, m) = call(c, "GET", &format!("{base}/metrics"), None).await;
    assert_eq!(status, 200);
    let m = String::from_utf8(m.to_vec()).expect("text");
    m.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.strip_suffix(".0"))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("{line_start} in\n{m}"))
}

#[tokio::test]
async fn a_cuda_fault_fails_inference_fast_and_leaves_the_rest_fine() {
    let e = engine(|cfg| cfg.faults.fail_requests = FailMode::CudaError).await;
    let c = client();
    let base = e.base_url();
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let body = if path.contains("chat") {
            json!({"messages": [{"role": "user", "content": "w1"}], "max_tokens": 2})
        } else {
            completion()
        };
        let (status, err) = post_json(&c, &format!("{base}{path}"), &body).await;
        assert_eq!(status, 500, "{path}");
        assert_eq!(err["error"]["type"], "InternalServerError");
        assert_eq!(err["error"]["code"], 500);
        let msg = err["error"]["message"].as_str().expect("message");
        assert!(
            msg.starts_with("CUDA error: an illegal memory access"),
            "{msg}"
        );
    }
    // Streaming: the stream generator's answer, 200 then an error event.
    let mut body = completion();
    body["stream"] = json!(true);
    let (status, _, bytes) = call_with(
        &c,
        "POST",
        &format!("{base}/v1/completions"),
        Some(&body),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    let text = String::from_utf8(bytes.to_vec()).expect("utf-8");
    let events: Vec<&str> = text.split("\n\n").filter(|s| !s.is_empty()).collect();
    assert_eq!(events.len(), 2, "{text}");
    let ev: Value =
        serde_json::from_str(events[0].strip_prefix("data: ").expect("data")).expect("json");
    assert_eq!(ev["error"]["code"], 500);
    assert_eq!(events[1], "data: [DONE]");
    // Everything a prober looks at is fine.
    assert_eq!(
        call(&c, "GET", &format!("{base}/health"), None).await.0,
        200
    );
    assert_eq!(
        get_json(&c, &format!("{base}/v1/models")).await["data"][0]["id"],
        e.model()
    );
    assert_eq!(metric(&c, &base, "vllm:num_requests_running{").await, 0);
    assert_eq!(
        metric(&c, &base, "vllm:request_success_total{").await,
        0,
        "nothing reached the engine core"
    );
    assert_eq!(
        post_json(&c, &format!("{base}/tokenize"), &json!({"prompt": "w1"}))
            .await
            .0,
        200
    );

    // Healed through the admin endpoint.
    let (status, _) = post_json(
        &c,
        &format!("{base}/admin/faults"),
        &json!({"fail_requests": "none"}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(
        post_json(&c, &format!("{base}/v1/completions"), &completion())
            .await
            .0,
        200
    );
    e.shutdown().await;
}

#[tokio::test]
async fn a_dead_engine_core_answers_bare_500s_and_fails_health() {
    let e = engine(|_| {}).await;
    let c = client();
    let base = e.base_url();
    assert_eq!(
        call(&c, "GET", &format!("{base}/health"), None).await.0,
        200
    );
    e.inject(&FaultRequest {
        fail_requests: Some(FailMode::EngineDead),
        ..FaultRequest::default()
    })
    .await
    .expect("fault applies");
    let (status, body) = call(
        &c,
        "POST",
        &format!("{base}/v1/completions"),
        Some(&completion()),
    )
    .await;
    assert_eq!((status, body.len()), (500, 0));
    assert_eq!(
        call(&c, "GET", &format!("{base}/health"), None).await.0,
        503
    );
    let state = get_json(&c, &format!("{base}/admin/faults")).await;
    assert_eq!(state["api_server"]["fail_requests"], "engine_dead");
    e.shutdown().await;
}

#[tokio::test]
async fn admission_rejections_are_503s_and_counted() {
    let e = engine(|cfg| cfg.faults.fail_requests = FailMode::AdmissionReject).await;
    let c = client();
    let base = e.base_url();
    let reason = "vllm:admission_rejections_total{model_name=\"kinference/sim\",reason=\"max_num_queued_reqs\"}";
    assert_eq!(metric(&c, &base, reason).await, 0);
    for stream in [false, true] {
        let mut body = completion();
        body["stream"] = json!(stream);
        let (status, err) = post_json(&c, &format!("{base}/v1/completions"), &body).await;
        assert_eq!(
            status, 503,
            "stream {stream}: the check runs before the stream opens"
        );
        assert_eq!(err["error"]["type"], "ServiceUnavailableError");
        assert_eq!(err["error"]["code"], 503);
    }
    assert_eq!(metric(&c, &base, reason).await, 2);
    assert_eq!(
        call(&c, "GET", &format!("{base}/health"), None).await.0,
        200
    );
    e.shutdown().await;
}

#[tokio::test]
async fn max_num_queued_reqs_refuses_beyond_the_limit() {
    let e = engine(|cfg| {
        cfg.admission = AdmissionLimits {
            max_num_queued_reqs: Some(1),
            max_num_queued_tokens: None,
        };
        cfg.output = OutputLen::MaxTokens { default: 128 };
        cfg.faults = FaultConfig {
            slowdown: 20.0,
            ..FaultConfig::default()
        };
    })
    .await;
    let c = client();
    let base = e.base_url();
    let url = format!("{base}/v1/completions");
    // One long request in flight…
    let busy = {
        let (c, url) = (c.clone(), url.clone());
        tokio::spawn(async move {
            post_json(&c, &url, &json!({"prompt": "w1", "max_tokens": 50})).await
        })
    };
    let t0 = Instant::now();
    while e.cache_truth(false).engines[0].running.is_empty() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the first request runs"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // …and the next one is refused, as are n > 1 choices.
    let (status, err) = post_json(&c, &url, &completion()).await;
    assert_eq!(status, 503, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .expect("msg")
            .contains("max_num_queued_reqs=1")
    );
    e.inject(&FaultRequest {
        kill_streams: Some(true),
        ..FaultRequest::default()
    })
    .await
    .expect("fault applies");
    let _ = busy.await;
    assert_eq!(
        post_json(&c, &url, &completion()).await.0,
        200,
        "room again"
    );
    let (status, _) = post_json(&c, &url, &json!({"prompt": "w1", "max_tokens": 1, "n": 2})).await;
    assert_eq!(status, 503, "two choices take two slots");
    assert_eq!(
        metric(&c, &base, "vllm:admission_rejections_total{model_name=\"kinference/sim\",reason=\"max_num_queued_reqs\"}").await,
        2
    );
    e.shutdown().await;
}

#[tokio::test]
async fn a_fraction_of_requests_fails_evenly() {
    let e = engine(|cfg| {
        cfg.faults.fail_requests = FailMode::CudaError;
        cfg.faults.fail_fraction = 0.25;
    })
    .await;
    let c = client();
    let url = format!("{}/v1/completions", e.base_url());
    let mut statuses = Vec::new();
    for _ in 0..12 {
        statuses.push(post_json(&c, &url, &completion()).await.0);
    }
    assert_eq!(
        statuses.iter().filter(|s| **s == 500).count(),
        3,
        "{statuses:?}"
    );
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 9);
    assert_eq!(statuses[3], 500, "every fourth: {statuses:?}");
    // Bad fractions are refused with a reason.
    let (status, err) = post_json(
        &c,
        &format!("{}/admin/faults", e.base_url()),
        &json!({"fail_fraction": 0}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(
        err["error"]["message"]
            .as_str()
            .expect("msg")
            .contains("fail_fraction")
    );
    e.shutdown().await;
}

#[tokio::test]
async fn slow_metrics_take_at_least_their_delay() {
    let e = engine(|_| {}).await;
    let c = client();
    let base = e.base_url();
    e.inject(&FaultRequest {
        metrics_delay_ms: Some(400),
        ..FaultRequest::default()
    })
    .await
    .expect("fault applies");
    let t0 = Instant::now();
    assert_eq!(
        call(&c, "GET", &format!("{base}/metrics"), None).await.0,
        200
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(400),
        "the scrape waited"
    );
    let state = get_json(&c, &format!("{base}/admin/faults")).await;
    assert_eq!(state["api_server"]["metrics_delay_ms"], 400);
    e.shutdown().await;
}

async fn status(c: &HttpClient, method: &str, url: &str, key: Option<&str>) -> (u16, Value) {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let body = (method == "POST").then(|| json!({"prompt": "w1", "max_tokens": 1}));
    let (s, _, b) = call_with(c, method, url, body.as_ref(), &headers).await;
    (s, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

#[tokio::test]
async fn vllm_api_key_guards_the_openai_paths() {
    let e = engine(|cfg| cfg.api_key = Some("s3cret".to_owned())).await;
    let c = client();
    let base = e.base_url();
    for (method, path) in [("GET", "/v1/models"), ("POST", "/v1/completions")] {
        let url = format!("{base}{path}");
        let (s, body) = status(&c, method, &url, None).await;
        assert_eq!((s, body), (401, json!({"error": "Unauthorized"})), "{path}");
        assert_eq!(status(&c, method, &url, Some("wrong")).await.0, 401);
        assert_eq!(
            status(&c, method, &url, Some("s3cret")).await.0,
            200,
            "{path}"
        );
    }
    // lower-case scheme is accepted, as vLLM does
    let (s, _, _) = call_with(
        &c,
        "GET",
        &format!("{base}/v1/models"),
        None,
        &[("authorization", "bearer s3cret")],
    )
    .await;
    assert_eq!(s, 200);
    // Open without the key: probes, metrics, tokenization, KV discovery,
    // and the simulator's own endpoints.
    for path in [
        "/health",
        "/metrics",
        "/kv_event_sources",
        "/version",
        "/debug/cache?summary=1",
    ] {
        assert_eq!(
            status(&c, "GET", &format!("{base}{path}"), None).await.0,
            200,
            "{path}"
        );
    }
    let (s, _) = post_json(&c, &format!("{base}/tokenize"), &json!({"prompt": "w1"})).await;
    assert_eq!(s, 200);
    e.shutdown().await;

    // vLLM's newer rule: everything but the public paths.
    let e = engine(|cfg| {
        cfg.api_key = Some("s3cret".to_owned());
        cfg.api_key_scope = ApiKeyScope::AllButPublic;
    })
    .await;
    let base = e.base_url();
    assert_eq!(
        status(&c, "GET", &format!("{base}/kv_event_sources"), None)
            .await
            .0,
        401
    );
    let (s, _) = post_json(&c, &format!("{base}/tokenize"), &json!({"prompt": "w1"})).await;
    assert_eq!(s, 401);
    assert_eq!(
        status(
            &c,
            "GET",
            &format!("{base}/kv_event_sources"),
            Some("s3cret")
        )
        .await
        .0,
        200
    );
    for path in ["/health", "/metrics", "/version", "/ping", "/load"] {
        assert_eq!(
            status(&c, "GET", &format!("{base}{path}"), None).await.0,
            200,
            "{path}"
        );
    }
    e.shutdown().await;
}

#[tokio::test]
async fn sglang_api_key_guards_all_but_health_and_metrics() {
    let e = engine(|cfg| {
        cfg.engine_mode = "sglang".parse().expect("mode");
        cfg.api_key = Some("k".to_owned());
    })
    .await;
    let c = client();
    let base = e.base_url();
    for path in ["/server_info", "/get_server_info", "/v1/models"] {
        let (s, body) = status(&c, "GET", &format!("{base}{path}"), None).await;
        assert_eq!((s, body), (401, json!({"error": "Unauthorized"})), "{path}");
        assert_eq!(
            status(&c, "GET", &format!("{base}{path}"), Some("k"))
                .await
                .0,
            200
        );
    }
    let (s, _) = post_json(&c, &format!("{base}/tokenize"), &json!({"prompt": "w1"})).await;
    assert_eq!(s, 401);
    for path in ["/health", "/metrics"] {
        assert_eq!(
            status(&c, "GET", &format!("{base}{path}"), None).await.0,
            200,
            "{path}"
        );
    }
    e.shutdown().await;
}

const OPENAI_CLIENT: &str = r#"
import json, sys
import openai

base, model, key = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
good = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
out["models"] = [m.id for m in good.models.list().data]
try:
    good.completions.create(model=model, prompt="w1 w2", max_tokens=2)
    out["fault"] = None
except openai.InternalServerError as e:
    out["fault"] = {"status": e.status_code, "type": e.body.get("type")}
bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
try:
    bad.models.list()
    out["wrong_key"] = None
except openai.AuthenticationError as e:
    out["wrong_key"] = {"status": e.status_code, "body": e.body}
print(json.dumps(out))
"#;

#[tokio::test]
async fn the_openai_client_sees_the_key_and_the_fault_as_it_would_on_vllm() {
    let py = python_with(&["openai"], "openai");
    let e = engine(|cfg| {
        cfg.api_key = Some("sk-sim".to_owned());
        cfg.faults.fail_requests = FailMode::CudaError;
    })
    .await;
    let out = tokio::process::Command::new(py)
        .args(["-c", OPENAI_CLIENT, &e.base_url(), e.model(), "sk-sim"])
        .output()
        .await
        .expect("python runs");
    assert!(
        out.status.success(),
        "openai client failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).expect("the script prints JSON");
    assert_eq!(r["models"], json!([e.model()]));
    assert_eq!(r["fault"]["status"], 500);
    assert_eq!(r["fault"]["type"], "InternalServerError");
    assert_eq!(r["wrong_key"]["status"], 401);
    e.shutdown().await;
}
