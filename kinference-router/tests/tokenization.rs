//! Tokenization modes through the router: a local tokenizer that matches the
//! engine is used in-process; one that does not is caught by the self-check
//! and the worker set falls back to the engine's `/tokenize`. Without token
//! ids, a session goes where the engines' events say its context lives.

mod support;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use serde_json::Value;
use support::*;

fn workspace(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
        .canonicalize()
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .display()
        .to_string()
}

fn local_profile(name: &str, dir: &str) -> WorkerSetOpts {
    WorkerSetOpts {
        profile: name.into(),
        profile_spec: Some(format!(
            "  tokenization:\n    mode: local\n    tokenizer: {{path: \"{dir}\"}}\n"
        )),
        ..WorkerSetOpts::default()
    }
}

async fn tokenizer_state(r: &Router) -> Value {
    endpoints(r).await["worker_sets"][0].clone()
}

async fn decision(r: &Router, content: &str) -> String {
    let reply = send(
        r.api(),
        "POST",
        "/v1/chat/completions",
        &[("x-kinference-debug", "1")],
        Bytes::from(serde_json::to_vec(&chat(MODEL, content, false, 2)).unwrap()),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    reply.headers["x-kinference-decision"]
        .to_str()
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_matching_local_tokenizer_is_checked_and_used() {
    let sims = engines(2, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let r = router(
        &addrs,
        &local_profile("word-level", &workspace("examples/word-level")),
        &[],
    )
    .await;
    wait_routable(&r, 2, true).await;
    let ws = eventually(
        Duration::from_secs(20),
        "the self-check to pass",
        || async {
            let ws = tokenizer_state(&r).await;
            (ws["tokenizer"]["state"] == "checked").then_some(ws)
        },
    )
    .await;
    assert_eq!(ws["effective_mode"], "local");
    assert_eq!(ws["tokenizer_mismatch"], false);

    // A multi-turn chat: the second turn hits the tokenizer's prefix cache.
    let long = words(0, 800);
    let d = decision(&r, &long).await;
    assert!(d.contains("tokens=local"), "{d}");
    let d = decision(&r, &format!("{long} w5000")).await;
    assert!(d.contains("tokens=local"), "{d}");
    let ws = tokenizer_state(&r).await;
    let (hits, misses) = (
        ws["tokenizer_cache"][0].as_u64().unwrap(),
        ws["tokenizer_cache"][1].as_u64().unwrap(),
    );
    assert!(hits > 0 && misses > 0, "cache hits {hits}, misses {misses}");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_local_tokenizer_falls_back_to_the_engine() {
    let sims = engines(1, |_| {}).await;
    // GPT-2's tokenizer is not the engine's (word-level): ids differ.
    let r = router(
        &[EngineAddr::of(&sims[0])],
        &local_profile("gpt2", &workspace("testdata/tokenizers/gpt2")),
        &[],
    )
    .await;
    wait_routable(&r, 1, true).await;
    let ws = eventually(
        Duration::from_secs(20),
        "the self-check to find the mismatch",
        || async {
            let ws = tokenizer_state(&r).await;
            (ws["tokenizer"]["state"] == "mismatch").then_some(ws)
        },
    )
    .await;
    eprintln!("{ws}");
    assert_eq!(ws["effective_mode"], "engine");
    assert!(
        ws["tokenizer"]["detail"]
            .as_str()
            .unwrap()
            .contains("differ")
    );
    let d = decision(&r, "w1 w2 w3").await;
    assert!(d.contains("tokens=engine"), "{d}");
    let metrics = get(r.admin(), "/metrics").await.text();
    assert!(
        metrics.contains("kinference_router_tokenizer_mismatch{worker_set=\"sim\"} 1"),
        "{metrics}"
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approximate_mode_keeps_a_prefix_together_without_token_ids() {
    let sims = engines(3, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let opts = WorkerSetOpts {
        profile: "approx".into(),
        profile_spec: Some("  tokenization: {mode: approximate}\n".into()),
        kv_events: false,
        ..WorkerSetOpts::default()
    };
    let r = router(&addrs, &opts, &[]).await;
    wait_routable(&r, 3, false).await;
    let system = words(7000, 1000);
    let first = post(
        r.api(),
        "/v1/chat/completions",
        &chat(MODEL, &format!("{system} w1"), false, 2),
    )
    .await;
    for i in 0..5 {
        let d = decision(&r, &format!("{system} w{}", 100 + i)).await;
        assert!(d.contains("tokens=approximate"), "{d}");
        let reply = post(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &format!("{system} w{}", 200 + i), false, 2),
        )
        .await;
        assert_eq!(
            reply.endpoint(),
            first.endpoint(),
            "request {i} left the engine its prefix went to"
        );
    }
    r.shutdown().await;
}

/// The engines attribute their KV stores to the request's session (vLLM
/// ≥ 0.30). A router that cannot key the prompt (approximate mode) and
/// never saw the sessions' first turns (another replica, or a restart,
/// sent them) still sends each next turn where its context lives. With
/// four engines, chance alone would do so for all six sessions once in
/// 4,096 runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_goes_where_the_engines_events_put_it() {
    for mode in [
        kinference_sim::EngineMode::default(),
        kinference_sim::EngineMode::sglang(kinference_sim::Version::new(0, 5, 20)),
    ] {
        session_follows_its_engine(mode).await;
    }
}

async fn session_follows_its_engine(mode: kinference_sim::EngineMode) {
    const SESSIONS: usize = 6;
    eprintln!("engine mode {mode}");
    let sims = engines(4, |c| c.engine_mode = mode).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let opts = WorkerSetOpts {
        profile: "approx".into(),
        profile_spec: Some("  tokenization: {mode: approximate}\n".into()),
        ..WorkerSetOpts::default()
    };
    let r = router(&addrs, &opts, &[]).await;
    wait_routable(&r, 4, true).await;
    let first = |i: usize| format!("{} w{}", words(1000 * (i + 1), 300), i);
    for i in 0..SESSIONS {
        // Straight to an engine, not through this router.
        let engine = sims[i % sims.len()].http_addr();
        let session = format!("chat-{i}");
        let reply = send(
            engine,
            "POST",
            "/v1/chat/completions",
            &[("x-session-id", session.as_str())],
            Bytes::from(serde_json::to_vec(&chat(MODEL, &first(i), false, 2)).unwrap()),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
    }
    eventually(
        Duration::from_secs(20),
        "the router to hear every session's stores",
        || async {
            let e = endpoints(&r).await;
            (e["kv_index"]["sessions"].as_u64() == Some(SESSIONS as u64)).then_some(())
        },
    )
    .await;
    for i in 0..SESSIONS {
        // The next turn: the header for even sessions, the body for odd.
        let session = format!("chat-{i}");
        let mut body = chat(MODEL, &format!("{} w7 w8 w9", first(i)), false, 2);
        let headers: Vec<(&str, &str)> = if i % 2 == 0 {
            vec![("x-session-id", session.as_str())]
        } else {
            body["session_id"] = Value::String(session.clone());
            vec![]
        };
        let reply = send(
            r.api(),
            "POST",
            "/v1/chat/completions",
            &headers,
            Bytes::from(serde_json::to_vec(&body).unwrap()),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        assert_eq!(
            reply.endpoint(),
            sims[i % sims.len()].http_addr().to_string(),
            "session {i} left the engine holding its first turn ({mode})"
        );
    }
    let metrics = get(r.admin(), "/metrics").await.text();
    assert!(
        metrics.contains(&format!("kinference_router_kv_index_sessions {SESSIONS}")),
        "{metrics}"
    );
    r.shutdown().await;
}
