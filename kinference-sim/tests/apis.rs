//! The other APIs vLLM serves, which a router passes through:
//! `/v1/embeddings`, `/v1/responses` (OpenAI) and `/v1/messages`
//! (Anthropic). Plain HTTP for the wire format and event sequences, the
//! `openai` Python client for embeddings (base64 by default) and
//! responses (streamed and not).

#![allow(clippy::many_single_char_names)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};
use kinference_sim::{FailMode, OutputLen, SimConfig, SimEngine, SimHandle};
use serde_json::{Value, json};

async fn engine(tweak: impl FnOnce(&mut SimConfig)) -> SimHandle {
    let mut cfg = SimConfig::default();
    tweak(&mut cfg);
    SimEngine::spawn(cfg).await.expect("engine starts")
}

/// `w1 … wN`: N tokens with the word-level tokenizer.
fn words(n: usize) -> String {
    (1..=n)
        .map(|i| format!("w{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The events of an SSE body as (`event:` name, `data:` JSON).
async fn sse(c: &HttpClient, url: &str, body: &Value) -> (u16, Vec<(String, Value)>) {
    let req = hyper::Request::builder()
        .method("POST")
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            serde_json::to_vec(body).expect("json"),
        )))
        .expect("request");
    let resp = c.request(req).await.expect("the simulator answers");
    let status = resp.status().as_u16();
    let text = resp.into_body().collect().await.expect("body").to_bytes();
    let text = String::from_utf8(text.to_vec()).expect("utf-8");
    let mut events = Vec::new();
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let mut name = String::new();
        let mut data = Value::Null;
        for line in block.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                n.clone_into(&mut name);
            } else if let Some(d) = line.strip_prefix("data: ") {
                data = serde_json::from_str(d).unwrap_or_else(|_| Value::String(d.to_owned()));
            }
        }
        events.push((name, data));
    }
    (status, events)
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("a list")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

/// Standard base64 back to bytes (the test's own decoder).
fn b64decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let mut out = Vec::new();
    for chunk in s.as_bytes().chunks(4) {
        let pad = chunk.iter().rev().take_while(|&&c| c == b'=').count();
        let n = chunk
            .iter()
            .map(|&c| if c == b'=' { 0 } else { val(c) })
            .fold(0u32, |acc, v| (acc << 6) | v);
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    out
}

#[tokio::test]
async fn embeddings_are_deterministic_per_input_and_base64_is_le_f32() {
    let e = engine(|_| {}).await;
    let c = client();
    let url = format!("{}/v1/embeddings", e.base_url());
    let (status, r) = post_json(
        &c,
        &url,
        &json!({"model": e.model(), "input": ["w1 w2 w3", "w4 w5"]}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "list");
    assert_eq!(r["model"], e.model());
    assert!(r["id"].as_str().expect("id").starts_with("embd-"));
    assert_eq!(r["usage"]["prompt_tokens"], 5);
    assert_eq!(r["usage"]["total_tokens"], 5);
    let data = r["data"].as_array().expect("data");
    assert_eq!(data.len(), 2);
    for (i, d) in data.iter().enumerate() {
        assert_eq!(d["object"], "embedding");
        assert_eq!(d["index"], i);
        let v = floats(&d["embedding"]);
        assert_eq!(v.len(), 16);
        let norm: f32 = v.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-4, "unit vector, got |v|² = {norm}");
    }
    assert_ne!(data[0]["embedding"], data[1]["embedding"]);

    // Same tokens, same vector: a string, its token ids, base64.
    let (_, one) = post_json(&c, &url, &json!({"input": "w1 w2 w3"})).await;
    assert_eq!(one["data"][0]["embedding"], data[0]["embedding"]);
    let (_, ids) = post_json(&c, &url, &json!({"input": [[1, 2, 3]]})).await;
    let (_, ids_again) = post_json(&c, &url, &json!({"input": [1, 2, 3]})).await;
    assert_eq!(
        ids["data"][0]["embedding"],
        ids_again["data"][0]["embedding"]
    );
    assert_eq!(ids["usage"]["prompt_tokens"], 3);
    let (status, b) = post_json(
        &c,
        &url,
        &json!({"input": "w1 w2 w3", "encoding_format": "base64"}),
    )
    .await;
    assert_eq!(status, 200);
    let raw = b64decode(b["data"][0]["embedding"].as_str().expect("a base64 string"));
    let decoded: Vec<f32> = raw
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    assert_eq!(decoded, floats(&data[0]["embedding"]));

    // `dimensions`; errors in vLLM's shape.
    let (_, d) = post_json(&c, &url, &json!({"input": "w1", "dimensions": 64})).await;
    assert_eq!(
        d["data"][0]["embedding"].as_array().expect("list").len(),
        64
    );
    let (status, err) = post_json(&c, &url, &json!({"model": "nope", "input": "w1"})).await;
    assert_eq!(status, 404);
    assert_eq!(err["error"]["type"], "NotFoundError");
    assert_eq!(err["error"]["code"], 404);
    for bad in [
        json!({}),
        json!({"input": []}),
        json!({"input": "w1", "encoding_format": "bytes"}),
        json!({"input": "w1", "dimensions": 0}),
    ] {
        let (status, err) = post_json(&c, &url, &bad).await;
        assert_eq!(status, 400, "{bad}: {err}");
        assert_eq!(err["error"]["type"], "BadRequestError");
    }
    e.shutdown().await;
}

#[tokio::test]
async fn responses_go_through_the_engine_like_chat() {
    let e = engine(|_| {}).await;
    let c = client();
    let base = e.base_url();
    let prompt = words(100);
    let body = json!({"model": e.model(), "input": prompt, "instructions": "be brief",
                      "max_output_tokens": 4});
    let (status, r) = post_json(&c, &format!("{base}/v1/responses"), &body).await;
    assert_eq!(status, 200, "{r}");
    assert!(r["id"].as_str().expect("id").starts_with("resp_"));
    assert_eq!(r["object"], "response");
    assert_eq!(r["model"], e.model());
    assert_eq!(r["instructions"], "be brief");
    assert_eq!(r["max_output_tokens"], 4);
    // vLLM: a length finish is "incomplete" (max_output_tokens).
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
    let item = &r["output"][0];
    assert_eq!(item["type"], "message");
    assert_eq!(item["role"], "assistant");
    assert_eq!(item["status"], "completed");
    assert!(item["id"].as_str().expect("id").starts_with("msg_"));
    assert_eq!(item["content"][0]["type"], "output_text");
    assert_eq!(item["content"][0]["annotations"], json!([]));
    let text = item["content"][0]["text"].as_str().expect("text");
    assert_eq!(text.split(' ').count(), 4);
    assert_eq!(r["usage"]["output_tokens"], 4);
    let input_tokens = r["usage"]["input_tokens"].as_u64().expect("input_tokens");
    assert_eq!(
        r["usage"]["total_tokens"].as_u64().expect("total"),
        input_tokens + 4
    );

    // The same conversation as chat renders the same prompt, and hits the
    // prefix cache the response filled.
    let chat = json!({"messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": prompt}],
                      "max_tokens": 1});
    let m = post_json(&c, &format!("{base}/debug/prefix_match"), &chat)
        .await
        .1;
    assert_eq!(m["prompt_tokens"], input_tokens);
    assert!(m["engines"][0]["cached_tokens"].as_u64().expect("cached") >= 96);
    let (_, again) = post_json(&c, &format!("{base}/v1/responses"), &body).await;
    assert!(
        again["usage"]["input_tokens_details"]["cached_tokens"]
            .as_u64()
            .expect("cached_tokens")
            >= 96,
        "{again}"
    );

    // Message items, content parts; a stop finish (an engine that samples
    // 2 tokens) is "completed".
    let stops = engine(|cfg| cfg.output = OutputLen::Fixed(2)).await;
    let (status, r) = post_json(
        &c,
        &format!("{}/v1/responses", stops.base_url()),
        &json!({"input": [{"role": "user", "content": [{"type": "input_text", "text": "w1 w2"}]},
                          {"type": "message", "role": "assistant", "content": "w3"},
                          {"role": "user", "content": "w4"}]}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["status"], "completed");
    assert_eq!(r["incomplete_details"], Value::Null);
    assert_eq!(r["usage"]["output_tokens"], 2);
    stops.shutdown().await;

    let (status, err) = post_json(
        &c,
        &format!("{base}/v1/responses"),
        &json!({"model": "nope", "input": "w1"}),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(err["error"]["type"], "NotFoundError");
    let (status, _) = post_json(
        &c,
        &format!("{base}/v1/responses"),
        &json!({"model": e.model()}),
    )
    .await;
    assert_eq!(status, 400);
    e.shutdown().await;
}

#[tokio::test]
async fn responses_stream_the_openai_event_sequence() {
    let e = engine(|_| {}).await;
    let c = client();
    let (status, events) = sse(
        &c,
        &format!("{}/v1/responses", e.base_url()),
        &json!({"input": "w1 w2 w3", "max_output_tokens": 3, "stream": true}),
    )
    .await;
    assert_eq!(status, 200);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], i, "{name}");
    }
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    assert_eq!(events[0].1["response"]["output"], json!([]));
    let deltas: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().expect("delta"))
        .collect();
    assert_eq!(events[7].1["text"], deltas.as_str());
    let done = &events[10].1["response"];
    assert_eq!(done["id"], events[0].1["response"]["id"]);
    assert_eq!(done["output"][0]["content"][0]["text"], deltas.as_str());
    assert_eq!(done["usage"]["output_tokens"], 3);
    assert_eq!(
        events[2].1["item"]["id"], done["output"][0]["id"],
        "one message item"
    );
    e.shutdown().await;
}

/// vLLM's response store: off by default (nothing kept, `store` ignored,
/// background refused); with `VLLM_ENABLE_RESPONSES_API_STORE=1` answers
/// are kept for `GET /v1/responses/{id}`, `/cancel` and
/// `previous_response_id`, which continues the kept conversation.
#[tokio::test]
async fn the_response_store_keeps_answers_only_when_enabled() {
    let c = client();
    let off = engine(|_| {}).await;
    let base = off.base_url();
    let (status, r) = post_json(
        &c,
        &format!("{base}/v1/responses"),
        &json!({"input": "w1 w2", "max_output_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    let id = r["id"].as_str().expect("id");
    let (status, body) = call(&c, "GET", &format!("{base}/v1/responses/{id}"), None).await;
    assert_eq!(status, 404, "nothing kept with the store off: {body:?}");
    let (status, e) = post_json(
        &c,
        &format!("{base}/v1/responses"),
        &json!({"input": "w3", "previous_response_id": id}),
    )
    .await;
    assert_eq!(
        (status, &e["error"]["message"]),
        (404, &json!(format!("Response with id '{id}' not found.")))
    );
    let (status, e) = post_json(
        &c,
        &format!("{base}/v1/responses"),
        &json!({"input": "w3", "background": true}),
    )
    .await;
    assert_eq!(
        (status, &e["error"]["param"]),
        (400, &json!("background")),
        "{e}"
    );
    off.shutdown().await;

    let on = engine(|c| c.responses_store = true).await;
    let base = on.base_url();
    let first = json!({"input": words(40), "instructions": "be brief", "max_output_tokens": 5});
    let (status, r) = post_json(&c, &format!("{base}/v1/responses"), &first).await;
    assert_eq!(status, 200, "{r}");
    let id = r["id"].as_str().expect("id").to_owned();
    let (status, kept) = call(&c, "GET", &format!("{base}/v1/responses/{id}"), None).await;
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_slice::<Value>(&kept).expect("json"),
        r,
        "the same object"
    );
    let (status, e) = post_json(&c, &format!("{base}/v1/responses/{id}/cancel"), &json!({})).await;
    assert_eq!(
        (status, &e["error"]["message"]),
        (400, &json!("Cannot cancel a synchronous response."))
    );
    let (status, _) = call(&c, "GET", &format!("{base}/v1/responses/chatcmpl-1"), None).await;
    assert_eq!(status, 400, "an id that does not begin with resp");
    let (status, _) = post_json(
        &c,
        &format!("{base}/v1/responses"),
        &json!({"input": "w1", "store": false, "max_output_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);
    // The next turn continues the kept conversation: its prompt holds the
    // first one's input and answer (not its instructions).
    let next = json!({"input": "w7 w8", "previous_response_id": id, "max_output_tokens": 2});
    let (status, n) = post_json(&c, &format!("{base}/v1/responses"), &next).await;
    assert_eq!(status, 200, "{n}");
    assert_eq!(n["previous_response_id"], id.as_str());
    let before = r["usage"]["input_tokens"].as_u64().expect("tokens") + 5;
    assert!(
        n["usage"]["input_tokens"].as_u64() > Some(before - 10),
        "{n}"
    );
    // Streamed answers are kept too.
    let (status, events) = sse(
        &c,
        &format!("{base}/v1/responses"),
        &json!({"input": "w9", "stream": true, "max_output_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
    let done = &events.last().expect("events").1["response"];
    let (status, kept) = call(
        &c,
        "GET",
        &format!("{base}/v1/responses/{}", done["id"].as_str().expect("id")),
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(&serde_json::from_slice::<Value>(&kept).expect("json"), done);
    on.shutdown().await;
}

/// SGLang's native `/generate` (SGLang mode only): `text` or `input_ids`,
/// `sampling_params.max_new_tokens`, the answer's `text`, `output_ids` and
/// `meta_info`; streamed, the output so far per token, the finish reason on
/// the last event, then `[DONE]`.
#[tokio::test]
async fn sglang_generate_answers_in_sglangs_shape() {
    let c = client();
    let e = engine(|cfg| cfg.engine_mode = "sglang".parse().expect("mode")).await;
    let url = format!("{}/generate", e.base_url());
    let (status, r) = post_json(
        &c,
        &url,
        &json!({"text": words(20), "sampling_params": {"max_new_tokens": 4, "ignore_eos": true}}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["output_ids"].as_array().map(Vec::len), Some(4), "{r}");
    assert!(!r["text"].as_str().expect("text").is_empty());
    let meta = &r["meta_info"];
    assert_eq!(
        meta["finish_reason"],
        json!({"type": "length", "length": 4})
    );
    assert_eq!(meta["completion_tokens"], 4);
    let prompt_tokens = meta["prompt_tokens"].as_u64().expect("prompt tokens");
    assert!(prompt_tokens >= 20, "{r}");
    // The same prompt as ids: the same count, and now cached.
    let (_, t) = post_json(
        &c,
        &format!("{}/tokenize", e.base_url()),
        &json!({"prompt": words(20)}),
    )
    .await;
    let ids = t["tokens"].clone();
    let (status, again) = post_json(
        &c,
        &url,
        &json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "ignore_eos": true}, "rid": "mine"}),
    )
    .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["meta_info"]["prompt_tokens"], prompt_tokens);
    assert_eq!(again["meta_info"]["id"], "mine");
    assert!(
        again["meta_info"]["cached_tokens"].as_u64() > Some(0),
        "{again}"
    );
    // Streamed.
    let (status, events) = sse(
        &c,
        &url,
        &json!({"text": "w1 w2 w3", "sampling_params": {"max_new_tokens": 3, "ignore_eos": true}, "stream": true}),
    )
    .await;
    assert_eq!(status, 200);
    let data: Vec<&Value> = events.iter().map(|(_, d)| d).collect();
    assert_eq!(data.len(), 4, "three tokens and [DONE]: {data:?}");
    assert_eq!(data[3], &json!("[DONE]"));
    for (i, d) in data[..3].iter().enumerate() {
        assert_eq!(d["output_ids"].as_array().map(Vec::len), Some(i + 1), "{d}");
    }
    assert_eq!(data[1]["meta_info"]["finish_reason"], Value::Null);
    assert_eq!(data[2]["meta_info"]["finish_reason"]["type"], "length");
    // Bad input: SGLang's {"error": {"message"}} 400.
    for bad in [
        json!({"sampling_params": {}}),
        json!({"text": ["a", "b"]}),
        json!({"text": "a", "input_ids": [1]}),
    ] {
        let (status, err) = post_json(&c, &url, &bad).await;
        assert_eq!(status, 400, "{bad}: {err}");
        assert!(err["error"]["message"].is_string(), "{err}");
    }
    e.shutdown().await;
    // vLLM serves no /generate.
    let v = engine(|_| {}).await;
    let (status, _) = post_json(
        &c,
        &format!("{}/generate", v.base_url()),
        &json!({"text": "w1"}),
    )
    .await;
    assert_eq!(status, 404);
    v.shutdown().await;
}

#[tokio::test]
async fn messages_answer_in_anthropics_shape() {
    let e = engine(|_| {}).await;
    let c = client();
    let url = format!("{}/v1/messages", e.base_url());
    let body = json!({"model": e.model(), "max_tokens": 3, "system": "be brief",
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "w1 w2"}]}]});
    let (status, r) = post_json(&c, &url, &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["type"], "message");
    assert_eq!(r["role"], "assistant");
    assert_eq!(r["model"], e.model());
    assert_eq!(r["stop_reason"], "max_tokens");
    assert_eq!(r["content"][0]["type"], "text");
    assert_eq!(
        r["content"][0]["text"]
            .as_str()
            .expect("text")
            .split(' ')
            .count(),
        3
    );
    assert_eq!(r["usage"]["output_tokens"], 3);
    // The chat prompt vLLM converts it to.
    let chat = json!({"messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": "w1 w2"}]});
    let m = post_json(&c, &format!("{}/debug/prefix_match", e.base_url()), &chat)
        .await
        .1;
    assert_eq!(r["usage"]["input_tokens"], m["prompt_tokens"]);

    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let (status, events) = sse(&c, &url, &stream_body).await;
    assert_eq!(status, 200);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str());
    }
    assert_eq!(
        events[0].1["message"]["usage"]["input_tokens"],
        r["usage"]["input_tokens"]
    );
    assert_eq!(
        events[1].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    assert_eq!(events[2].1["delta"]["type"], "text_delta");
    assert_eq!(events[2].1["index"], 0);
    assert_eq!(events[6].1["delta"]["stop_reason"], "max_tokens");
    assert_eq!(events[6].1["usage"]["output_tokens"], 3);

    // A known model checked after validation: 404 in Anthropic's shape;
    // a body that fails validation: 400 in vLLM's.
    let mut unknown = body.clone();
    unknown["model"] = json!("nope");
    let (status, err) = post_json(&c, &url, &unknown).await;
    assert_eq!(status, 404);
    assert_eq!(err["type"], "error");
    assert_eq!(err["error"]["type"], "NotFoundError");
    let (status, err) = post_json(
        &c,
        &url,
        &json!({"model": e.model(), "messages": [{"role": "user", "content": "w1"}]}),
    )
    .await;
    assert_eq!(status, 400, "max_tokens is required: {err}");
    assert_eq!(err["error"]["param"], "max_tokens");
    e.shutdown().await;
}

#[tokio::test]
async fn new_endpoints_follow_faults_keys_and_the_engine_family() {
    // A CUDA fault: 500s, and for a streamed message one Anthropic error event.
    let e = engine(|cfg| cfg.faults.fail_requests = FailMode::CudaError).await;
    let c = client();
    let base = e.base_url();
    let msg = json!({"model": e.model(), "max_tokens": 2,
                     "messages": [{"role": "user", "content": "w1"}]});
    let (status, err) = post_json(&c, &format!("{base}/v1/messages"), &msg).await;
    assert_eq!(status, 500);
    assert_eq!(err["type"], "error");
    assert!(
        err["error"]["message"]
            .as_str()
            .expect("message")
            .starts_with("CUDA error")
    );
    let mut streamed = msg.clone();
    streamed["stream"] = json!(true);
    let (status, events) = sse(&c, &format!("{base}/v1/messages"), &streamed).await;
    assert_eq!(status, 200);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].0, "error");
    let (status, _) = post_json(&c, &format!("{base}/v1/responses"), &json!({"input": "w1"})).await;
    assert_eq!(status, 500);
    let (status, events) = sse(
        &c,
        &format!("{base}/v1/responses"),
        &json!({"input": "w1", "stream": true}),
    )
    .await;
    assert_eq!(status, 200);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["response.created", "response.in_progress", "error"]);
    let (status, _) = post_json(
        &c,
        &format!("{base}/v1/embeddings"),
        &json!({"input": "w1"}),
    )
    .await;
    assert_eq!(status, 500);
    e.shutdown().await;

    // The API key guards them (they are under /v1).
    let e = engine(|cfg| cfg.api_key = Some("s3cret".to_owned())).await;
    for (path, body) in [
        ("/v1/embeddings", json!({"input": "w1"})),
        (
            "/v1/responses",
            json!({"input": "w1", "max_output_tokens": 1}),
        ),
        (
            "/v1/messages",
            json!({"model": e.model(), "max_tokens": 1, "messages": [{"role": "user", "content": "w1"}]}),
        ),
    ] {
        let url = format!("{}{path}", e.base_url());
        let (status, _) = post_json(&c, &url, &body).await;
        assert_eq!(status, 401, "{path}");
        let (status, _, _) = call_with(
            &c,
            "POST",
            &url,
            Some(&body),
            &[("authorization", "Bearer s3cret")],
        )
        .await;
        assert_eq!(status, 200, "{path}");
    }
    e.shutdown().await;

    // SGLang serves embeddings and responses, not Anthropic's API.
    let e = engine(|cfg| cfg.engine_mode = "sglang".parse().expect("mode")).await;
    let base = e.base_url();
    let (status, _) = post_json(
        &c,
        &format!("{base}/v1/embeddings"),
        &json!({"input": "w1"}),
    )
    .await;
    assert_eq!(status, 200);
    let (status, _) = post_json(
        &c,
        &format!("{base}/v1/responses"),
        &json!({"input": "w1", "max_output_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200);
    let (status, err) = post_json(&c, &format!("{base}/v1/messages"), &msg).await;
    assert_eq!(status, 404);
    assert_eq!(err, json!({"detail": "Not Found"}));
    let (status, err) = post_json(
        &c,
        &format!("{base}/v1/embeddings"),
        &json!({"model": "nope", "input": "w1"}),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(err["object"], "error", "SGLang's flat error shape");
    e.shutdown().await;
}

#[tokio::test]
async fn a_client_that_leaves_a_streamed_message_aborts_it() {
    let e = engine(|cfg| cfg.latency.base_ms = 20.0).await;
    let c = client();
    let url = format!("{}/v1/messages", e.base_url());
    let body = json!({"model": e.model(), "max_tokens": 10000, "stream": true,
                      "messages": [{"role": "user", "content": "w1"}]});
    let req = hyper::Request::builder()
        .method("POST")
        .uri(&url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            serde_json::to_vec(&body).expect("json"),
        )))
        .expect("request");
    let resp = c.request(req).await.expect("answers");
    let mut b = resp.into_body();
    let _ = b.frame().await;
    drop(b);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let t = e.cache_truth(false);
        if t.engines[0].running.is_empty() && t.engines[0].waiting.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the request was not aborted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    e.shutdown().await;
}

const OPENAI_CLIENT: &str = r#"
import json, sys
import openai

base, model = sys.argv[1], sys.argv[2]
c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
out = {}

r = c.embeddings.create(model=model, input=["w1 w2 w3", "w4"])  # base64 by default
out["embeddings"] = {"vectors": [d.embedding for d in r.data], "usage": r.usage.model_dump()}
r = c.embeddings.create(model=model, input="w1 w2 w3", encoding_format="float")
out["embeddings_float"] = r.data[0].embedding

r = c.responses.create(model=model, input="w1 w2 w3", instructions="be brief", max_output_tokens=4)
out["response"] = {"id": r.id, "status": r.status, "text": r.output_text,
                   "usage": r.usage.model_dump(), "output_type": r.output[0].type}

events = list(c.responses.create(model=model, input=[{"role": "user", "content": "w1 w2"}],
                                 max_output_tokens=3, stream=True))
out["response_stream"] = {
    "types": [e.type for e in events],
    "seq": [e.sequence_number for e in events],
    "deltas": [e.delta for e in events if e.type == "response.output_text.delta"],
    "final_text": events[-1].response.output_text,
    "final_usage": events[-1].response.usage.model_dump(),
}
print(json.dumps(out))
"#;

#[tokio::test]
async fn the_openai_python_client_reads_embeddings_and_responses() {
    let py = python_with(&["openai"], "openai");
    let e = engine(|_| {}).await;
    let out = tokio::process::Command::new(py)
        .args(["-c", OPENAI_CLIENT, &e.base_url(), e.model()])
        .output()
        .await
        .expect("python runs");
    assert!(
        out.status.success(),
        "openai client failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).expect("the script prints JSON");
    let vectors = r["embeddings"]["vectors"].as_array().expect("vectors");
    assert_eq!(vectors.len(), 2);
    assert_eq!(vectors[0].as_array().expect("floats").len(), 16);
    // The client decoded the base64 default to the floats the float format sends.
    let decoded = floats(&vectors[0]);
    let plain = floats(&r["embeddings_float"]);
    assert_eq!(decoded, plain);
    assert_eq!(r["embeddings"]["usage"]["prompt_tokens"], 4);

    assert!(
        r["response"]["id"]
            .as_str()
            .expect("id")
            .starts_with("resp_")
    );
    assert_eq!(r["response"]["status"], "incomplete");
    assert_eq!(r["response"]["output_type"], "message");
    assert_eq!(
        r["response"]["text"]
            .as_str()
            .expect("text")
            .split(' ')
            .count(),
        4
    );
    assert_eq!(r["response"]["usage"]["output_tokens"], 4);

    let s = &r["response_stream"];
    let types: Vec<&str> = s["types"]
        .as_array()
        .expect("types")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(types.first(), Some(&"response.created"));
    assert_eq!(types.last(), Some(&"response.completed"));
    let seq: Vec<u64> = s["seq"]
        .as_array()
        .expect("seq")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert_eq!(seq, (0..types.len() as u64).collect::<Vec<_>>());
    let deltas: String = s["deltas"]
        .as_array()
        .expect("deltas")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(s["deltas"].as_array().expect("deltas").len(), 3);
    assert_eq!(s["final_text"], deltas.as_str());
    assert_eq!(s["final_usage"]["output_tokens"], 3);
    e.shutdown().await;
}
