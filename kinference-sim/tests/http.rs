//! vLLM's HTTP surface, over real loopback connections.

#![allow(clippy::many_single_char_names)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::BodyExt;
use kinference_sim::{SimConfig, SimEngine};
use serde_json::{Value, json};

fn config() -> SimConfig {
    SimConfig {
        model: "Qwen/Qwen3-8B".to_owned(),
        aliases: vec!["qwen3".to_owned()],
        root: Some("/models/qwen3-8b".to_owned()),
        ..SimConfig::default()
    }
}

#[tokio::test]
async fn models_health_version_load() {
    let e = SimEngine::spawn(config()).await.expect("engine starts");
    let c = client();
    let m = get_json(&c, &format!("{}/v1/models", e.base_url())).await;
    assert_eq!(m["object"], "list");
    let ids: Vec<&str> = m["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|d| d["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, ["Qwen/Qwen3-8B", "qwen3"]);
    for card in m["data"].as_array().expect("data") {
        assert_eq!(card["root"], "/models/qwen3-8b");
        assert_eq!(card["max_model_len"], 32_768);
        assert_eq!(card["owned_by"], "vllm");
        assert_eq!(card["parent"], Value::Null);
        assert_eq!(card["permission"][0]["object"], "model_permission");
    }
    assert_eq!(
        call(&c, "GET", &format!("{}/health", e.base_url()), None)
            .await
            .0,
        200
    );
    assert_eq!(
        get_json(&c, &format!("{}/version", e.base_url())).await["version"],
        "0.33.0"
    );
    assert_eq!(
        get_json(&c, &format!("{}/load", e.base_url())).await["server_load"],
        0
    );
    let (status, body) = call(&c, "GET", &format!("{}/no/such/path", e.base_url()), None).await;
    assert_eq!(
        (status, &body[..]),
        (404, &br#"{"detail":"Not Found"}"#[..])
    );
    e.shutdown().await;
}

/// vLLM's `_is_model_supported`: a request naming no model (absent, `null`
/// or `""`) is served by the base model and echoes its name.
#[tokio::test]
async fn a_request_without_a_model_gets_the_served_one() {
    let e = SimEngine::spawn(config()).await.expect("engine starts");
    let c = client();
    let url = format!("{}/v1/completions", e.base_url());
    for body in [
        json!({"prompt": "hello world", "max_tokens": 1}),
        json!({"model": null, "prompt": "hello world", "max_tokens": 1}),
        json!({"model": "", "prompt": "hello world", "max_tokens": 1}),
    ] {
        let (status, r) = post_json(&c, &url, &body).await;
        assert_eq!(
            (status, &r["model"]),
            (200, &json!("Qwen/Qwen3-8B")),
            "{body}: {r}"
        );
    }
    let (status, r) = post_json(&c, &url, &json!({"model": "qwen4", "prompt": "x"})).await;
    assert_eq!(status, 404, "an unknown name is still refused: {r}");
    e.shutdown().await;
}

#[tokio::test]
async fn completions_non_streaming() {
    let e = SimEngine::spawn(config()).await.expect("engine starts");
    let c = client();
    let (status, r) = post_json(
        &c,
        &format!("{}/v1/completions", e.base_url()),
        &json!({"model": "qwen3", "prompt": "hello world , the cache", "max_tokens": 7}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    assert!(r["id"].as_str().expect("id").starts_with("cmpl-"));
    assert_eq!(r["object"], "text_completion");
    assert_eq!(r["model"], "qwen3", "the requested name is echoed");
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["text"].as_str().expect("text").split(' ').count(), 7);
    assert_eq!(r["usage"]["prompt_tokens"], 5);
    assert_eq!(r["usage"]["completion_tokens"], 7);
    assert_eq!(r["usage"]["total_tokens"], 12);
    assert_eq!(r["usage"]["prompt_tokens_details"], Value::Null);
    // The generated text re-tokenizes to the generated tokens.
    let (_, t) = post_json(
        &c,
        &format!("{}/tokenize", e.base_url()),
        &json!({"prompt": choice["text"], "add_special_tokens": false}),
    )
    .await;
    assert_eq!(t["count"], 7);
    e.shutdown().await;
}

#[tokio::test]
async fn several_prompts_and_n_choices() {
    let e = SimEngine::spawn(config()).await.expect("engine starts");
    let c = client();
    let url = format!("{}/v1/completions", e.base_url());
    let (status, r) = post_json(
        &c,
        &url,
        &json!({"prompt": ["a b c", "d e"], "max_tokens": 3, "n": 2}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    let choices = r["choices"].as_array().expect("choices");
    assert_eq!(
        choices
            .iter()
            .map(|c| c["index"].as_u64().expect("index"))
            .collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert_ne!(choices[0]["text"], choices[1]["text"], "n samples differ");
    assert_eq!(r["usage"]["prompt_tokens"], 5, "each prompt counted once");
    assert_eq!(r["usage"]["completion_tokens"], 12);
    e.shutdown().await;
}

#[tokio::test]
async fn completions_streaming_with_usage() {
    let e = SimEngine::spawn(config()).await.expect("engine starts");
    let c = client();
    let url = format!("{}/v1/completions", e.base_url());
    let s = stream(
        &c,
        &url,
        &json!({"prompt": "one two three", "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(s.events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = s.events[..s.events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("json chunk"))
        .collect();
    assert_eq!(chunks.len(), 6, "5 tokens + usage");
    for (i, ch) in chunks[..5].iter().enumerate() {
        assert_eq!(ch["object"], "text_completion");
        assert_eq!(ch["id"], chunks[0]["id"]);
        let want = if i == 4 { json!("length") } else { Value::Null };
        assert_eq!(ch["choices"][0]["finish_reason"], want);
        assert!(ch.get("usage").is_none());
    }
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 5);
    assert_eq!(chunks[5]["usage"]["prompt_tokens"], 3);
    // Without include_usage: tokens, then [DONE].
    let s = stream(
        &c,
        &url,
        &json!({"prompt": "x", "max_tokens": 2, "stream": true}),
    )
    .await;
    assert_eq!(s.events.len(), 3);
    e.shutdown().await;
}

#[tokio::test]
async fn chat_streaming_and_not() {
    let e = SimEngine::spawn(SimConfig {
        enable_prompt_tokens_details: true,
        ..config()
    })
    .await
    .expect("engine starts");
    let c = client();
    let url = format!("{}/v1/chat/completions", e.base_url());
    let messages = json!([{"role": "system", "content": "you are a model"}, {"role": "user", "content": "hello there"}]);
    let (status, r) = post_json(
        &c,
        &url,
        &json!({"messages": messages, "max_completion_tokens": 4}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    assert!(r["id"].as_str().expect("id").starts_with("chatcmpl-"));
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(r["choices"][0]["message"]["role"], "assistant");
    assert_eq!(r["choices"][0]["message"]["tool_calls"], json!([]));
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    // Usage agrees with /tokenize on the same messages (chat template).
    let (_, t) = post_json(
        &c,
        &format!("{}/tokenize", e.base_url()),
        &json!({"messages": messages}),
    )
    .await;
    assert_eq!(r["usage"]["prompt_tokens"], t["count"]);
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let s = stream(
        &c,
        &url,
        &json!({"messages": messages, "max_tokens": 3, "stream": true,
                "stream_options": {"include_usage": true, "continuous_usage_stats": true}}),
    )
    .await;
    let chunks: Vec<Value> = s.events[..s.events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("json chunk"))
        .collect();
    assert_eq!(s.events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks.len(), 1 + 3 + 1);
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "length");
    assert_eq!(
        chunks[2]["usage"]["completion_tokens"], 2,
        "continuous usage"
    );
    assert_eq!(chunks[4]["usage"]["completion_tokens"], 3);
    // The same conversation again hits the cache.
    let (_, r) = post_json(
        &c,
        &url,
        &json!({"messages": messages, "max_completion_tokens": 1}),
    )
    .await;
    let prompt = t["count"].as_u64().expect("count");
    assert_eq!(
        r["usage"]["prompt_tokens_details"]["cached_tokens"],
        (prompt - 1) / 16 * 16
    );
    e.shutdown().await;
}

#[tokio::test]
async fn tokenize_and_detokenize() {
    let e = SimEngine::spawn(config()).await.expect("engine starts");
    let c = client();
    let (status, t) = post_json(
        &c,
        &format!("{}/tokenize", e.base_url()),
        &json!({"prompt": "w1 w2 hello", "return_token_strs": true}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(t["count"], 3);
    assert_eq!(t["max_model_len"], 32_768);
    assert_eq!(t["token_strs"], json!(["w1", "w2", "hello"]));
    let (status, d) = post_json(
        &c,
        &format!("{}/detokenize", e.base_url()),
        &json!({"tokens": t["tokens"]}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(d["prompt"], "w1 w2 hello");
    e.shutdown().await;
}

#[tokio::test]
async fn errors_have_openai_shape() {
    let e = SimEngine::spawn(SimConfig {
        max_model_len: 64,
        ..config()
    })
    .await
    .expect("engine starts");
    let c = client();
    let url = format!("{}/v1/completions", e.base_url());
    let (status, r) = post_json(&c, &url, &json!({"model": "gpt-9", "prompt": "x"})).await;
    assert_eq!(status, 404);
    assert_eq!(
        r,
        json!({"error": {"message": "The model `gpt-9` does not exist.", "type": "NotFoundError", "param": null, "code": 404}})
    );
    let (status, r) = post_json(&c, &url, &json!({"prompt": "x", "max_tokens": 0})).await;
    assert_eq!(
        (status, &r["error"]["type"], &r["error"]["code"]),
        (400, &json!("BadRequestError"), &json!(400))
    );
    let (status, r) = post_json(&c, &url, &json!({"prompt": "x", "max_tokens": 100})).await;
    assert_eq!(status, 400);
    assert!(
        r["error"]["message"]
            .as_str()
            .expect("message")
            .contains("maximum context length is 64 tokens")
    );
    let long = kinference_tokenize::word_level::numbered_words(0, 64);
    let (status, r) = post_json(&c, &url, &json!({"prompt": long})).await;
    assert_eq!(status, 400);
    assert!(
        r["error"]["message"]
            .as_str()
            .expect("message")
            .contains("64 input tokens")
    );
    let (status, r) = call(&c, "POST", &url, None).await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&r));
    let (status, _) = post_json(
        &c,
        &format!("{}/v1/chat/completions", e.base_url()),
        &json!({"prompt": "x"}),
    )
    .await;
    assert_eq!(status, 400, "chat needs messages");
    let (status, _) = post_json(
        &c,
        &url,
        &json!({"prompt": "x", "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(status, 400);
    e.shutdown().await;
}

#[tokio::test]
async fn metrics_use_vllm_names_and_match_the_counters() {
    let e = SimEngine::spawn(config()).await.expect("engine starts");
    let c = client();
    let url = format!("{}/v1/completions", e.base_url());
    let prompt = kinference_tokenize::word_level::numbered_words(0, 100);
    for _ in 0..3 {
        assert_eq!(
            post_json(&c, &url, &json!({"prompt": prompt, "max_tokens": 4}))
                .await
                .0,
            200
        );
    }
    let (status, body) = call(&c, "GET", &format!("{}/metrics", e.base_url()), None).await;
    assert_eq!(status, 200);
    let text = String::from_utf8(body.to_vec()).expect("utf-8");
    let value = |series: &str| -> &str {
        text.lines()
            .find_map(|l| l.strip_prefix(series).map(str::trim))
            .unwrap_or_else(|| panic!("no series {series} in\n{text}"))
    };
    let l = r#"{engine="0",model_name="Qwen/Qwen3-8B"}"#;
    // 100 tokens: the second and third requests hit 6 blocks (96 tokens).
    assert_eq!(
        value(&format!("vllm:prefix_cache_queries_total{l}")),
        "300.0"
    );
    assert_eq!(value(&format!("vllm:prefix_cache_hits_total{l}")), "192.0");
    assert_eq!(value(&format!("vllm:prompt_tokens_total{l}")), "300.0");
    assert_eq!(value(&format!("vllm:generation_tokens_total{l}")), "12.0");
    assert_eq!(value(&format!("vllm:num_requests_running{l}")), "0.0");
    assert_eq!(value(&format!("vllm:num_requests_waiting{l}")), "0.0");
    assert_eq!(
        value(&format!("vllm:time_to_first_token_seconds_count{l}")),
        "3.0"
    );
    assert_eq!(
        value(
            r#"vllm:request_success_total{engine="0",model_name="Qwen/Qwen3-8B",finished_reason="length"}"#
        ),
        "3.0"
    );
    let usage: f64 = value(&format!("vllm:kv_cache_usage_perc{l}"))
        .parse()
        .expect("a number");
    assert!((0.0..=1.0).contains(&usage));
    assert!(text.contains("# TYPE vllm:time_to_first_token_seconds histogram"));
    let info = text
        .lines()
        .find(|l| l.starts_with("vllm:cache_config_info{"))
        .expect("cache_config_info");
    assert!(
        info.contains(r#"block_size="16""#) && info.contains(r#"num_gpu_blocks="8192""#),
        "{info}"
    );
    // The same numbers through /debug/cache.
    let dbg = get_json(&c, &format!("{}/debug/cache?summary=1", e.base_url())).await;
    assert_eq!(dbg["engines"][0]["counters"]["prefix_cache_hits"], 192);
    assert!(dbg["engines"][0].get("blocks").is_none());
    let (_, m) = post_json(
        &c,
        &format!("{}/debug/prefix_match", e.base_url()),
        &json!({"prompt": prompt}),
    )
    .await;
    assert_eq!(m["engines"][0]["cached_tokens"], 96);
    e.shutdown().await;
}

#[tokio::test]
async fn a_client_that_leaves_aborts_its_request() {
    let e = SimEngine::spawn(config()).await.expect("engine starts");
    let c = client();
    let req = hyper::Request::builder()
        .method("POST")
        .uri(format!("{}/v1/completions", e.base_url()))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(Bytes::from(
            serde_json::to_vec(&json!({"prompt": "a", "max_tokens": 5000, "stream": true}))
                .expect("json"),
        )))
        .expect("request");
    let resp = c.request(req).await.expect("answers");
    let mut body = resp.into_body();
    body.frame().await.expect("a first chunk").expect("ok");
    drop(body);
    let mut aborted = 0;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        aborted = e.cache_truth(false).engines[0].counters.aborted;
        if aborted == 1 {
            break;
        }
    }
    assert_eq!(aborted, 1);
    assert_eq!(e.cache_truth(false).engines[0].running.len(), 0);
    e.shutdown().await;
}

#[tokio::test]
async fn admin_faults_over_http() {
    let e = SimEngine::spawn(config()).await.expect("engine starts");
    let c = client();
    let admin = format!("{}/admin/faults", e.base_url());
    let (status, r) = post_json(&c, &admin, &json!({"rank": 3})).await;
    assert_eq!(status, 400, "{r}");
    let (status, _) = post_json(&c, &admin, &json!({"no_such_fault": 1})).await;
    assert_eq!(status, 400);
    let (status, _) = post_json(&c, &admin, &json!({"slowdown": 2.5, "drop_every": 4})).await;
    assert_eq!(status, 200);
    let state = get_json(&c, &admin).await;
    assert_eq!(state["engines"][0]["slowdown"], 2.5);
    assert_eq!(state["engines"][0]["publisher"]["drop_every"], 4);

    // Kill a stream in flight: the client sees the connection cut.
    let req = hyper::Request::builder()
        .method("POST")
        .uri(format!("{}/v1/chat/completions", e.base_url()))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(Bytes::from(
            serde_json::to_vec(&json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000, "stream": true}))
                .expect("json"),
        )))
        .expect("request");
    let mut body = c.request(req).await.expect("answers").into_body();
    body.frame().await.expect("a first chunk").expect("ok");
    let (status, r) = post_json(&c, &admin, &json!({"kill_streams": true})).await;
    assert_eq!((status, &r["killed"]), (200, &json!(1)));
    let mut saw_error = false;
    let mut saw_done = false;
    while let Some(f) = body.frame().await {
        if let Ok(f) = f {
            saw_done |= f
                .data_ref()
                .is_some_and(|d| d.windows(6).any(|w| w == b"[DONE]"));
        } else {
            saw_error = true;
            break;
        }
    }
    assert!(
        saw_error && !saw_done,
        "the stream ends abruptly, without [DONE]"
    );
    e.shutdown().await;
}

#[tokio::test]
async fn a_real_tokenizer_serves_chat() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/tokenizers/qwen3");
    let tok =
        std::sync::Arc::new(kinference_sim::SimTokenizer::from_dir(dir).expect("qwen3 loads"));
    assert!(
        tok.output_vocabulary() > 1000,
        "plain-word output tokens found"
    );
    let e = SimEngine::spawn(SimConfig {
        tokenizer: Some(tok.clone()),
        ..config()
    })
    .await
    .expect("engine starts");
    let c = client();
    let messages = json!([{"role": "user", "content": "What is a KV cache?"}]);
    let (status, r) = post_json(
        &c,
        &format!("{}/v1/chat/completions", e.base_url()),
        &json!({"messages": messages, "max_tokens": 12}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    // The prompt is what the tokenizer crate computes for vLLM.
    let want = tok
        .tokenizer()
        .tokenize(
            kinference_tokenize::Endpoint::ChatCompletions,
            &json!({"messages": messages}),
        )
        .expect("tokenizes");
    assert_eq!(r["usage"]["prompt_tokens"], want.first_ids().len());
    // The answer re-tokenizes to as many tokens as were generated.
    let text = r["choices"][0]["message"]["content"]
        .as_str()
        .expect("content");
    assert_eq!(
        tok.tokenizer().encode(text, false).expect("encodes").len(),
        12,
        "{text:?}"
    );
    e.shutdown().await;
}
