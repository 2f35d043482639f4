//! Hostile requests: malformed JSON, invalid UTF-8, deep nesting, wrong
//! types, missing fields, bodies over the limit, prompts at and over the
//! model's context length, and mutated bodies by the thousand. Each gets an
//! OpenAI-style 4xx (never a panic, a 5xx or a dropped connection), and a
//! stream running meanwhile, and a plain request after each, are served as
//! if nothing happened. Then the router's logs, at info and at debug, are
//! searched for the prompts: they must never be there.

mod support;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kinference_router::openai;
use kinference_scoring::{SplitMix64 as Rng, below};
use serde_json::{Value, json};
use support::*;

const CONTEXT: usize = 256;

fn workspace(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
        .canonicalize()
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .display()
        .to_string()
}

fn local_profile() -> WorkerSetOpts {
    WorkerSetOpts {
        profile: "word-level".into(),
        profile_spec: Some(format!(
            "  tokenization:\n    mode: local\n    tokenizer: {{path: \"{}\"}}\n",
            workspace("examples/word-level")
        )),
        ..WorkerSetOpts::default()
    }
}

struct Case {
    name: &'static str,
    method: &'static str,
    path: &'static str,
    content_type: &'static str,
    body: Vec<u8>,
    /// Statuses accepted.
    want: &'static [u16],
}

fn case(
    name: &'static str,
    path: &'static str,
    body: impl Into<Vec<u8>>,
    want: &'static [u16],
) -> Case {
    Case {
        name,
        method: "POST",
        path,
        content_type: "application/json",
        body: body.into(),
        want,
    }
}

fn json_case(name: &'static str, path: &'static str, v: &Value, want: &'static [u16]) -> Case {
    case(name, path, serde_json::to_vec(v).unwrap(), want)
}

const CHAT: &str = "/v1/chat/completions";
const COMPL: &str = "/v1/completions";

fn cases() -> Vec<Case> {
    let ids = |n: usize| -> Vec<u32> { (0..n as u32).map(|i| 10 + i % 1000).collect() };
    let deep = |depth: usize| -> Vec<u8> {
        let mut b = br#"{"model":"kinference/sim","messages":"#.to_vec();
        b.extend(std::iter::repeat_n(b'[', depth));
        b.extend(std::iter::repeat_n(b']', depth));
        b.push(b'}');
        b
    };
    let mut nested = json!("x");
    for _ in 0..100 {
        nested = json!([nested]);
    }
    vec![
        case("truncated JSON", CHAT, r#"{"model":"#, &[400]),
        case("invalid UTF-8", CHAT, b"\xff\xfe\xfd".to_vec(), &[400]),
        case(
            "invalid UTF-8 inside a string",
            COMPL,
            b"{\"model\":\"kinference/sim\",\"prompt\":\"\xff\xfe\"}".to_vec(),
            &[400],
        ),
        case(
            "a lone surrogate escape",
            COMPL,
            r#"{"model":"kinference/sim","prompt":"\ud800"}"#,
            &[400],
        ),
        case("not an object", CHAT, "[1,2,3]", &[400]),
        case("null", CHAT, "null", &[400]),
        case("empty body", CHAT, "", &[400]),
        case("nested 100,000 deep", CHAT, deep(100_000), &[400]),
        case("nested 5,000 deep", CHAT, deep(5_000), &[400]),
        json_case(
            "content nested 100 deep",
            CHAT,
            &json!({"model": MODEL, "messages": [{"role": "user", "content": nested}]}),
            &[400, 422],
        ),
        json_case(
            "model a number",
            CHAT,
            &json!({"model": 5, "messages": [{"role": "user", "content": "hi"}]}),
            &[400],
        ),
        json_case(
            "stream a string",
            CHAT,
            &json!({"model": MODEL, "stream": "yes", "messages": [{"role": "user", "content": "hi"}]}),
            &[400],
        ),
        json_case(
            "messages an object",
            CHAT,
            &json!({"model": MODEL, "messages": {}}),
            &[400],
        ),
        json_case(
            "messages of numbers",
            CHAT,
            &json!({"model": MODEL, "messages": [1, 2]}),
            &[400, 422],
        ),
        json_case(
            "content a number",
            CHAT,
            &json!({"model": MODEL, "messages": [{"role": "user", "content": 5}]}),
            &[400, 422],
        ),
        json_case(
            "role missing",
            CHAT,
            &json!({"model": MODEL, "messages": [{"content": "hi"}]}),
            &[400, 422],
        ),
        json_case(
            "prompt an object",
            COMPL,
            &json!({"model": MODEL, "prompt": {}}),
            &[400],
        ),
        json_case("messages missing", CHAT, &json!({"model": MODEL}), &[400]),
        json_case(
            "messages empty",
            CHAT,
            &json!({"model": MODEL, "messages": []}),
            &[400],
        ),
        json_case("prompt missing", COMPL, &json!({"model": MODEL}), &[400]),
        json_case(
            "unknown model",
            CHAT,
            &json!({"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}),
            &[404],
        ),
        json_case(
            "a 1 MB model name",
            CHAT,
            &json!({"model": "m".repeat(1 << 20), "messages": [{"role": "user", "content": "hi"}]}),
            &[404, 413],
        ),
        json_case(
            "a NUL in the model name",
            CHAT,
            &json!({"model": "kinference/sim\u{0}", "messages": [{"role": "user", "content": "hi"}]}),
            &[404],
        ),
        json_case(
            "token ids out of range",
            COMPL,
            &json!({"model": MODEL, "prompt": [-1, 4_294_967_296_u64, 3], "max_tokens": 1}),
            &[400, 422],
        ),
        json_case(
            "max_tokens negative",
            COMPL,
            &json!({"model": MODEL, "prompt": "w1 w2", "max_tokens": -5}),
            &[400, 422],
        ),
        json_case(
            "max_tokens a string",
            COMPL,
            &json!({"model": MODEL, "prompt": "w1 w2", "max_tokens": "many"}),
            &[400, 422],
        ),
        json_case(
            "prompt over the context length",
            COMPL,
            &json!({"model": MODEL, "prompt": ids(CONTEXT), "max_tokens": 1}),
            &[400],
        ),
        json_case(
            "prompt 100× the context length",
            COMPL,
            &json!({"model": MODEL, "prompt": ids(CONTEXT * 100), "max_tokens": 1}),
            &[400],
        ),
        json_case(
            "text prompt 400× the context length",
            COMPL,
            &json!({"model": MODEL, "prompt": words(0, CONTEXT * 400), "max_tokens": 1}),
            &[400],
        ),
        json_case(
            "chat over the context length",
            CHAT,
            &json!({"model": MODEL, "messages": [{"role": "user", "content": words(0, CONTEXT * 2)}], "max_tokens": 1}),
            &[400],
        ),
        case("body over the limit", CHAT, vec![b' '; 3 << 20], &[413]),
        Case {
            name: "GET on an inference path",
            method: "GET",
            path: CHAT,
            content_type: "application/json",
            body: Vec::new(),
            want: &[405],
        },
        // SGLang's native API: neither, or both, of its prompt fields, or
        // one of the wrong type (vLLM engines behind: the router's 400).
        json_case(
            "generate without a prompt",
            "/generate",
            &json!({"sampling_params": {}}),
            &[400],
        ),
        json_case(
            "generate with text and input_ids",
            "/generate",
            &json!({"text": "w1", "input_ids": [1, 2]}),
            &[400],
        ),
        json_case(
            "generate with a numeric text",
            "/generate",
            &json!({"text": 5}),
            &[400],
        ),
        // A stored response nobody keeps, named with escapes that would
        // leave the path if decoded into it.
        Case {
            name: "stored response with an escaped path",
            method: "GET",
            path: "/v1/responses/resp_%2F..%2F..%2Fmetrics",
            content_type: "application/json",
            body: Vec::new(),
            want: &[404],
        },
        Case {
            name: "cancel of a stored response nobody keeps",
            method: "POST",
            path: "/v1/responses/resp_nobody/cancel",
            content_type: "application/json",
            body: b"{}".to_vec(),
            want: &[404],
        },
        Case {
            name: "unknown path",
            method: "POST",
            path: "/v1/../../etc/passwd",
            content_type: "application/json",
            body: b"{}".to_vec(),
            want: &[404],
        },
    ]
}

async fn send_case(r: &Router, c: &Case) -> Reply {
    let req = http::Request::builder()
        .method(c.method)
        .uri(format!("http://{}{}", r.api(), c.path))
        .header("content-type", c.content_type)
        .body(Full::new(Bytes::from(c.body.clone())))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(30), client().request(req))
        .await
        .unwrap_or_else(|_| panic!("{}: no answer within 30 s", c.name))
        .unwrap_or_else(|e| panic!("{}: the connection failed: {e}", c.name));
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Reply {
        status,
        headers,
        body,
    }
}

fn assert_openai_error(name: &str, reply: &Reply) {
    let v: Value = serde_json::from_slice(&reply.body)
        .unwrap_or_else(|e| panic!("{name}: the error is not JSON ({e}): {}", reply.text()));
    assert!(
        v["error"]["message"].is_string() && v["error"]["type"].is_string(),
        "{name}: not an OpenAI error: {v}"
    );
}

async fn normal_request_works(r: &Router, after: &str) {
    let reply = post(r.api(), CHAT, &chat(MODEL, "w1 w2 w3", false, 2)).await;
    assert_eq!(reply.status, 200, "after {after}: {}", reply.text());
}

async fn hostile_cases(opts: &WorkerSetOpts, mode: &str) {
    // Slowed down 10× so that the stream below spans the cases.
    let sims = engines(1, |c| {
        c.max_model_len = CONTEXT;
        c.faults.slowdown = 10.0;
    })
    .await;
    let r = router(
        &[EngineAddr::of(&sims[0])],
        opts,
        &["--body-limit", "1048576"],
    )
    .await;
    wait_routable(&r, 1, true).await;
    // A stream that runs through all of it.
    let stream = post_streaming(r.api(), CHAT, &chat(MODEL, "w9 w8 w7", true, 230)).await;
    assert_eq!(stream.status(), 200);
    let reader = tokio::spawn(async move {
        let b = stream
            .into_body()
            .collect()
            .await
            .expect("the stream completes");
        String::from_utf8_lossy(&b.to_bytes()).into_owned()
    });

    let mut statuses = Vec::new();
    for c in cases() {
        let started = std::time::Instant::now();
        let reply = send_case(&r, &c).await;
        assert!(
            c.want.contains(&reply.status),
            "{mode}: {}: status {} (want {:?}): {}",
            c.name,
            reply.status,
            c.want,
            &reply.text()[..reply.text().len().min(300)]
        );
        assert_openai_error(c.name, &reply);
        statuses.push(format!(
            "{} → {} in {:.0} ms",
            c.name,
            reply.status,
            started.elapsed().as_secs_f64() * 1000.0
        ));
        normal_request_works(&r, c.name).await;
    }
    // At the context length exactly: served.
    let at: Vec<u32> = (0..CONTEXT as u32 - 1).map(|i| 10 + i).collect();
    let reply = post(
        r.api(),
        COMPL,
        &json!({"model": MODEL, "prompt": at, "max_tokens": 1}),
    )
    .await;
    assert_eq!(
        reply.status,
        200,
        "{mode}: a prompt at the context length: {}",
        reply.text()
    );
    statuses.push("prompt at the context length → 200".into());

    // A body sent chunked, without a length, past the limit.
    let chunks = futures::stream::iter((0..40).map(|_| {
        Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(Bytes::from(vec![
            b' ';
            64 << 10
        ])))
    }));
    let req = http::Request::post(format!("http://{}{CHAT}", r.api()))
        .header("content-type", "application/json")
        .body(http_body_util::StreamBody::new(chunks))
        .unwrap();
    let c = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    // The router answers 413 as soon as the limit is passed and closes the
    // connection without reading the rest: a client still writing may see
    // its write fail instead of the answer.
    match c.request(req).await {
        Ok(resp) => {
            assert_eq!(resp.status(), 413, "{mode}: a chunked body past the limit");
            statuses.push("chunked body past the limit → 413".into());
        }
        Err(e) => {
            let why = format!("{e:?}");
            assert!(
                why.contains("BodyWrite"),
                "{mode}: a chunked body past the limit: {why}"
            );
            statuses.push(
                "chunked body past the limit → 413, connection closed while the client wrote"
                    .into(),
            );
        }
    }
    normal_request_works(&r, "a chunked body").await;

    let text = reader.await.unwrap();
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "{mode}: the stream running meanwhile was disturbed"
    );
    let metrics = get(r.admin(), "/metrics").await.text();
    let five: Vec<(String, f64)> = kinference_api::engine::prometheus::samples(&metrics)
        .filter(|s| {
            s.name == "kinference_router_requests_total"
                && s.label("code").is_some_and(|c| c.starts_with('5'))
        })
        .map(|s| (format!("{:?}", s.labels), s.value))
        .collect();
    assert!(
        five.iter().all(|(_, v)| *v == 0.0),
        "{mode}: the router answered 5xx: {five:?}"
    );
    eprintln!(
        "FIGURE hostile-requests ({mode} tokenization): {}",
        statuses.join("; ")
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_get_openai_errors_engine_tokenization() {
    hostile_cases(&WorkerSetOpts::default(), "engine").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_get_openai_errors_local_tokenization() {
    hostile_cases(&local_profile(), "local").await;
}

// ------------------------------------------------------- mutated bodies

fn seed_bodies() -> Vec<(openai::Endpoint, Vec<u8>)> {
    let v = [
        (
            openai::Endpoint::Chat,
            json!({"model": MODEL, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "w1 w2 w3"}], "max_tokens": 2, "stream": false}),
        ),
        (
            openai::Endpoint::Chat,
            json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "w4 w5"}]}], "max_tokens": 2, "stream": true, "cache_salt": "s"}),
        ),
        (
            openai::Endpoint::Chat,
            json!({"model": ALIAS, "messages": [{"role": "user", "content": "w1"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "max_tokens": 1}),
        ),
        (
            openai::Endpoint::Completions,
            json!({"model": MODEL, "prompt": "w1 w2 w3 w4", "max_tokens": 2}),
        ),
        (
            openai::Endpoint::Completions,
            json!({"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 1, "stream": true}),
        ),
        (
            openai::Endpoint::Completions,
            json!({"model": MODEL, "prompt": [[1, 2], [3]], "max_tokens": 1}),
        ),
    ];
    v.into_iter()
        .map(|(e, b)| (e, serde_json::to_vec(&b).unwrap()))
        .collect()
}

const TOKENS: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b"\"",
    b":",
    b",",
    b"null",
    b"true",
    b"-1",
    b"1e999",
    b"18446744073709551616",
    b"\\u0000",
    b"\\ud800",
    b"\xff",
    b"\xc3\x28",
    b"\"model\"",
    b"\"messages\"",
    b"\"prompt\"",
    b"\"stream\"",
    b"\"content\"",
    b"\"role\"",
    b"[[[[[[[[",
    b"]]]]]]]]",
    b"{\"a\":{\"a\":{\"a\":",
];

fn mutate(rng: &mut Rng, body: &mut Vec<u8>) {
    for _ in 0..=below(rng, 3) {
        let len = body.len();
        match below(rng, 6) {
            0 if len > 0 => {
                let i = below(rng, len);
                body[i] ^= 1 << below(rng, 8);
            }
            1 if len > 0 => {
                let i = below(rng, len);
                let n = 1 + below(rng, (len - i).min(8));
                body.drain(i..i + n);
            }
            2 if len > 0 => body.truncate(below(rng, len)),
            3 if len > 1 => {
                let i = below(rng, len);
                let n = 1 + below(rng, (len - i).min(32));
                let piece = body[i..i + n].to_vec();
                let at = below(rng, body.len() + 1);
                body.splice(at..at, piece);
            }
            _ => {
                let t = TOKENS[below(rng, TOKENS.len())];
                let at = below(rng, len + 1);
                body.splice(at..at, t.iter().copied());
            }
        }
    }
}

#[test]
fn mutated_bodies_never_panic_the_parser_or_the_tokenizer() {
    let n: usize = std::env::var("KINFERENCE_FUZZ_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let tokenizer =
        kinference_tokenize::ModelTokenizer::from_dir(Path::new(&workspace("examples/word-level")))
            .expect("the word-level tokenizer loads");
    let seeds = seed_bodies();
    let mut rng = Rng::new(0x6f70_656e_6169);
    let started = std::time::Instant::now();
    let (mut parsed, mut tokenized) = (0u64, 0u64);
    let mut body = Vec::new();
    for i in 0..n {
        let (api, seed) = &seeds[below(&mut rng, seeds.len())];
        body.clear();
        body.extend_from_slice(seed);
        mutate(&mut rng, &mut body);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let Ok(p) = openai::parse(*api, &body) else {
                return (false, false);
            };
            let _ = kinference_router::prepare::prompt_text(*api, &p);
            let _ = kinference_router::tokens::tokenize_body(*api, &p, "m");
            let _ = kinference_router::tokens::ids_in_prompt(&p);
            let _ = p.with_model(&body, "another/model");
            // Escapes inside values are not decoded when reading the
            // routing fields (a lone surrogate passes): such a body reaches
            // the engine, whose 400 the client gets.
            let Ok(v) = p.id_object() else {
                return (true, false);
            };
            let te = match api {
                openai::Endpoint::Chat => kinference_tokenize::Endpoint::ChatCompletions,
                openai::Endpoint::Completions => kinference_tokenize::Endpoint::Completions,
                // Passed through untokenized.
                _ => return (true, false),
            };
            (true, tokenizer.tokenize(te, &v).is_ok())
        }));
        let Ok((p, t)) = r else {
            panic!("input {i} panicked: {}", String::from_utf8_lossy(&body));
        };
        parsed += u64::from(p);
        tokenized += u64::from(t);
    }
    eprintln!(
        "FIGURE fuzz-requests: {n} mutated bodies in {:.1} s: {parsed} parsed, {tokenized} tokenized locally, 0 panics",
        started.elapsed().as_secs_f64()
    );
    assert!(
        parsed > 0 && tokenized > 0,
        "the mutations never produced a parsable body"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_bodies_through_the_router_get_2xx_or_4xx() {
    let sims = engines(1, |c| c.max_model_len = CONTEXT).await;
    for (mode, opts) in [
        ("engine", WorkerSetOpts::default()),
        ("local", local_profile()),
    ] {
        let r = router(&[EngineAddr::of(&sims[0])], &opts, &[]).await;
        wait_routable(&r, 1, true).await;
        let seeds = seed_bodies();
        let mut rng = Rng::new(0x726f_7574_6572);
        let mut by_status = std::collections::BTreeMap::<u16, usize>::new();
        for _ in 0..300 {
            let (api, seed) = &seeds[below(&mut rng, seeds.len())];
            let mut body = seed.clone();
            mutate(&mut rng, &mut body);
            let reply = send(r.api(), "POST", api.path(), &[], Bytes::from(body.clone())).await;
            assert!(
                (200..300).contains(&reply.status) || (400..500).contains(&reply.status),
                "{mode}: {} for {}: {}",
                reply.status,
                String::from_utf8_lossy(&body),
                reply.text()
            );
            if reply.status >= 400 {
                assert_openai_error(&String::from_utf8_lossy(&body), &reply);
            }
            *by_status.entry(reply.status).or_default() += 1;
        }
        normal_request_works(&r, "mutated bodies").await;
        eprintln!(
            "FIGURE fuzz-requests through the router ({mode} tokenization): 300 mutated bodies → {by_status:?}"
        );
        r.shutdown().await;
    }
}

// ------------------------------------------------------------- logging

/// Runs the router binary at `level` in front of `sim`, sends requests
/// carrying `marker` in every place a prompt can be (and some that fail in
/// the router, the tokenizer and the engine), and returns its log.
async fn router_log(sim: &kinference_sim::SimHandle, level: &str, marker: &str) -> String {
    let p = RouterProc::start(
        &[EngineAddr::of(sim)],
        &WorkerSetOpts::default(),
        &["--upstream-timeout", "5s"],
        level,
    )
    .await;
    let api = p.api;
    let m = marker;
    let bodies = [
        (
            CHAT,
            json!({"model": MODEL, "messages": [{"role": "system", "content": m}, {"role": "user", "content": m}], "max_tokens": 2}),
        ),
        (
            CHAT,
            json!({"model": MODEL, "messages": [{"role": "user", "content": m}], "max_tokens": 2, "stream": true}),
        ),
        (COMPL, json!({"model": MODEL, "prompt": m, "max_tokens": 2})),
        // Fails at the engine (too long), at its /tokenize (bad content), in
        // the router (wrong types, unknown model).
        (
            COMPL,
            json!({"model": MODEL, "prompt": format!("{m} {}", words(0, 40_000)), "max_tokens": 2}),
        ),
        (
            CHAT,
            json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": m}, {"type": m}]}]}),
        ),
        (
            CHAT,
            json!({"model": MODEL, "messages": [{"role": m, "content": m}]}),
        ),
        (CHAT, json!({"model": MODEL, "messages": m})),
        (
            CHAT,
            json!({"model": m, "messages": [{"role": "user", "content": m}]}),
        ),
        (COMPL, json!({"model": MODEL, "prompt": {"text": m}})),
    ];
    for (path, b) in &bodies {
        let _ = post(api, path, b).await;
    }
    let raw = format!("{{\"model\":\"{MODEL}\",\"prompt\":\"{m}");
    let _ = send(api, "POST", COMPL, &[], Bytes::from(raw)).await;
    p.stop()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_are_never_logged() {
    let sim = engines(1, |c| c.max_model_len = CONTEXT).await.remove(0);
    // A word the word-level tokenizer knows (so it reaches the engine as
    // tokens too) and a string no code path produces by itself.
    let marker = "w4242 PROMPT-MARKER-7f3a";
    for level in ["info", "debug"] {
        let log = router_log(&sim, level, marker).await;
        let lines = log.lines().count();
        assert!(
            lines > 3,
            "the router logged nothing at {level}: the check would prove nothing\n{log}"
        );
        let leaks: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("PROMPT-MARKER") || l.contains("w4242"))
            .collect();
        eprintln!(
            "FIGURE logging at {level}: {lines} lines, {} with a prompt",
            leaks.len()
        );
        assert!(
            leaks.is_empty(),
            "prompts in the log at {level}:\n{}",
            leaks.join("\n")
        );
    }
}
