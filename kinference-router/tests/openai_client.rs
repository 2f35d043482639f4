//! The `openai` Python package, unchanged, talks to engines through the
//! router: chat and completions, streaming and not, the model list, an alias
//! and an unknown model. Fails with advice when the package is missing
//! (`pip install openai`).

mod support;

use serde_json::Value;
use support::*;

const CLIENT: &str = r#"
import json, sys
import openai

base, model, alias = sys.argv[1], sys.argv[2], sys.argv[3]
c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
out = {"models": sorted(m.id for m in c.models.list().data)}

r = c.completions.create(model=model, prompt="w1 w2 w3 w4 w5", max_tokens=5)
out["completion"] = {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason,
                     "completion_tokens": r.usage.completion_tokens}

chunks = list(c.completions.create(model=model, prompt="w1 w2 w3", max_tokens=4, stream=True,
                                   stream_options={"include_usage": True}))
out["completion_stream"] = {"texts": [ch.choices[0].text for ch in chunks if ch.choices],
                            "completion_tokens": chunks[-1].usage.completion_tokens}

messages = [{"role": "system", "content": "w7 w8 w9"}, {"role": "user", "content": "w10 w11"}]
raw = c.chat.completions.with_raw_response.create(model=alias, messages=messages, max_completion_tokens=3)
r = raw.parse()
out["chat"] = {"content": r.choices[0].message.content, "role": r.choices[0].message.role,
               "model": r.model, "endpoint": raw.headers.get("x-kinference-endpoint")}

chunks = list(c.chat.completions.create(model=model, messages=messages, max_tokens=3, stream=True))
out["chat_stream"] = {"deltas": [ch.choices[0].delta.content for ch in chunks if ch.choices]}

try:
    c.chat.completions.create(model="no-such-model", messages=messages, max_tokens=1)
    out["not_found"] = None
except openai.NotFoundError as e:
    out["not_found"] = {"status": e.status_code, "code": e.code}
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_works_through_the_router() {
    let sims = engines(2, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 2, true).await;

    let base = format!("http://{}", r.api());
    let v = openai_python(CLIENT, &[&base, MODEL, ALIAS]).await;
    eprintln!("{v:#}");
    assert_eq!(v["models"], serde_json::json!([MODEL, ALIAS]));
    assert_eq!(v["completion"]["completion_tokens"], 5);
    assert!(!v["completion"]["text"].as_str().unwrap().is_empty());
    assert_eq!(v["completion_stream"]["completion_tokens"], 4);
    assert!(
        !v["completion_stream"]["texts"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    assert_eq!(v["chat"]["role"], "assistant");
    assert_eq!(
        v["chat"]["model"], MODEL,
        "the alias was rewritten to the served name"
    );
    let ep = v["chat"]["endpoint"].as_str().unwrap();
    assert!(sims.iter().any(|s| s.http_addr().to_string() == ep));
    assert!(v["chat_stream"]["deltas"].as_array().unwrap().len() >= 3);
    assert_eq!(v["not_found"]["status"], 404);
    assert_eq!(v["not_found"]["code"], "model_not_found");
    r.shutdown().await;
}

const OTHER_APIS: &str = r#"
import json, sys
import openai

base, model = sys.argv[1], sys.argv[2]
c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
out = {}
e = c.embeddings.create(model=model, input=["w1 w2 w3", "w4 w5"])
out["embeddings"] = [len(d.embedding) for d in e.data]
r = c.responses.create(model=model, input="w1 w2 w3 w4", max_output_tokens=4)
out["response"] = {"status": r.status, "text": r.output_text, "output_tokens": r.usage.output_tokens}
kinds = [ev.type for ev in c.responses.create(model=model, input="w5 w6", max_output_tokens=3, stream=True)]
out["response_stream"] = kinds
print(json.dumps(out))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_responses_messages_and_tokenize_pass_through() {
    let sims = engines(2, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 2, true).await;

    let base = format!("http://{}", r.api());
    let v = openai_python(OTHER_APIS, &[&base, ALIAS]).await;
    assert_eq!(v["embeddings"].as_array().unwrap().len(), 2, "{v}");
    assert!(v["embeddings"][0].as_u64().unwrap() > 0);
    // Stopped by max_output_tokens: OpenAI's "incomplete".
    assert!(
        ["completed", "incomplete"].contains(&v["response"]["status"].as_str().unwrap()),
        "{v}"
    );
    assert!(!v["response"]["text"].as_str().unwrap().is_empty());
    assert_eq!(v["response"]["output_tokens"], 4);
    let kinds: Vec<&str> = v["response_stream"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(kinds.first(), Some(&"response.created"), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"response.completed"), "{kinds:?}");
    assert!(kinds.contains(&"response.output_text.delta"), "{kinds:?}");

    // Anthropic's Messages API, as vLLM serves it (the alias rewritten).
    let message = post(
        r.api(),
        "/v1/messages",
        &serde_json::json!({"model": ALIAS, "max_tokens": 3,
            "messages": [{"role": "user", "content": "w1 w2"}]}),
    )
    .await;
    assert_eq!(message.status, 200, "{}", message.text());
    assert_eq!(message.json()["type"], "message");
    assert_eq!(message.json()["model"], MODEL);
    assert!(!message.endpoint().is_empty());
    let streamed = post_streaming(
        r.api(),
        "/v1/messages",
        &serde_json::json!({"model": MODEL, "max_tokens": 3, "stream": true,
            "messages": [{"role": "user", "content": "w3"}]}),
    )
    .await;
    let (_, text) = read_stream(streamed.into_body(), std::time::Duration::from_secs(10)).await;
    assert!(
        text.contains("event: message_start") && text.contains("event: message_stop"),
        "{text}"
    );

    // vLLM's /tokenize and /detokenize, on the model's engines.
    let tokenized = post(
        r.api(),
        "/tokenize",
        &serde_json::json!({"model": MODEL, "prompt": "w1 w2 w3"}),
    )
    .await;
    assert_eq!(tokenized.status, 200, "{}", tokenized.text());
    let tokens = tokenized.json()["tokens"].clone();
    assert!(!tokens.as_array().unwrap().is_empty());
    let detokenized = post(
        r.api(),
        "/detokenize",
        &serde_json::json!({"model": MODEL, "tokens": tokens}),
    )
    .await;
    assert_eq!(detokenized.status, 200, "{}", detokenized.text());
    assert!(
        detokenized.json()["prompt"]
            .as_str()
            .is_some_and(|p| p.contains("w2")),
        "{}",
        detokenized.text()
    );
    // A model the pool does not serve is OpenAI's 404 here too.
    let missing = post(
        r.api(),
        "/v1/embeddings",
        &serde_json::json!({"model": "nope", "input": "x"}),
    )
    .await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["error"]["code"], "model_not_found");

    let metrics = get(r.admin(), "/metrics").await.text();
    for api in [
        "embeddings",
        "responses",
        "messages",
        "tokenize",
        "detokenize",
    ] {
        assert!(
            sum_of(
                &metrics,
                "kinference_router_requests_total",
                &[("api", api), ("code", "200")]
            ) >= 1.0,
            "no 200 counted for {api}"
        );
    }
    r.shutdown().await;
}

const STORED: &str = r#"
import json, sys
import openai

base, model = sys.argv[1], sys.argv[2]
c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
out = {"turns": [], "others": []}
previous = None
for turn in range(4):
    raw = c.responses.with_raw_response.create(model=model, input="w%d" % (turn + 1),
                                               max_output_tokens=2, previous_response_id=previous)
    r = raw.parse()
    out["turns"].append({"id": r.id, "previous": r.previous_response_id,
                         "input_tokens": r.usage.input_tokens,
                         "endpoint": raw.headers.get("x-kinference-endpoint")})
    previous = r.id
    # Other traffic between the turns: without affinity the next turn
    # would go wherever the load sends it.
    o = c.responses.with_raw_response.create(model=model, input="w9", max_output_tokens=1)
    out["others"].append(o.headers.get("x-kinference-endpoint"))
first = out["turns"][0]["id"]
raw = c.responses.with_raw_response.retrieve(first)
out["retrieved"] = {"id": raw.parse().id, "endpoint": raw.headers.get("x-kinference-endpoint")}
try:
    c.responses.cancel(first)
    out["cancel"] = None
except openai.BadRequestError as e:
    out["cancel"] = {"status": e.status_code, "message": e.message}
try:
    c.responses.retrieve("resp_nobody_has_it")
    out["unknown"] = None
except openai.NotFoundError as e:
    out["unknown"] = {"status": e.status_code, "message": e.message}
print(json.dumps(out))
"#;

/// vLLM with `VLLM_ENABLE_RESPONSES_API_STORE=1` keeps each response on
/// the engine that made it: retrieving, cancelling and continuing one
/// (`previous_response_id`) must reach that engine, whatever the load
/// says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_responses_are_reached_on_the_engine_that_keeps_them() {
    let sims = engines(4, |c| c.responses_store = true).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 4, true).await;

    let base = format!("http://{}", r.api());
    let v = openai_python(STORED, &[&base, MODEL]).await;
    eprintln!("{v:#}");
    let turns = v["turns"].as_array().unwrap();
    let home = turns[0]["endpoint"].as_str().unwrap();
    for (i, t) in turns.iter().enumerate().skip(1) {
        assert_eq!(t["previous"], turns[i - 1]["id"], "{v}");
        assert_eq!(
            t["endpoint"],
            home,
            "turn {i} went to the engine keeping turn {}: {v}",
            i - 1
        );
        assert!(
            t["input_tokens"].as_u64() > turns[i - 1]["input_tokens"].as_u64(),
            "the engine continued the kept conversation: {v}"
        );
    }
    // The other requests were spread as usual: affinity is per conversation.
    let others: std::collections::HashSet<&str> = v["others"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(others.len() > 1, "{v}");
    assert_eq!(v["retrieved"]["id"], turns[0]["id"]);
    assert_eq!(v["retrieved"]["endpoint"], home);
    assert_eq!(v["cancel"]["status"], 400, "the engine's own answer: {v}");
    assert_eq!(v["unknown"]["status"], 404, "{v}");
    // Every turn, the retrieval and the cancel went to an engine learnt from
    // the answers passing through: the only search was the unknown id's.
    let metrics = get(r.admin(), "/metrics").await.text();
    for (outcome, n) in [("found", 0), ("not_found", 1)] {
        let line = format!(
            "kinference_router_stored_response_searches_total{{outcome=\"{outcome}\"}} {n}"
        );
        assert!(metrics.contains(&line), "{line} in {metrics}");
    }
    r.shutdown().await;
    // With the store off (vLLM's default), every engine answers 404 and so
    // does the router.
    let off = engines(2, |_| {}).await;
    let addrs: Vec<EngineAddr> = off.iter().map(EngineAddr::of).collect();
    let r = router(&addrs, &WorkerSetOpts::default(), &[]).await;
    wait_routable(&r, 2, true).await;
    let reply = get(r.api(), "/v1/responses/resp_0123").await;
    assert_eq!(reply.status, 404, "{}", reply.text());
    assert_eq!(
        reply.json()["error"]["message"],
        "Response with id 'resp_0123' not found."
    );
    let reply = post(
        r.api(),
        "/v1/responses",
        &serde_json::json!({"model": MODEL, "input": "w1", "previous_response_id": "resp_0123"}),
    )
    .await;
    assert_eq!(reply.status, 404, "the engine's answer: {}", reply.text());
    r.shutdown().await;
}
