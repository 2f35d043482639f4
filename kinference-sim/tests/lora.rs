//! LoRA adapters served next to the base model, as vLLM's `--lora-modules`
//! serves them: `/v1/models` cards, requests by adapter name, a prefix
//! cache of their own per adapter (hashes checked against vLLM 0.33's
//! `sha256_cbor` fixture), `lora_id`/`lora_name` in KV events, at most
//! `--max-loras` adapters per running batch, slot loads and
//! `vllm:lora_requests_info`. Real engines on loopback, real sockets; no
//! assertion on wall-clock time (only on engine-time accounting and order).

#![allow(clippy::many_single_char_names)]

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::*;
use kinference_kvindex::event::Value as WireValue;
use kinference_kvindex::{BlockHash, BlockStored, KvEvent, decode_batch};
use kinference_sim::{
    BlockHasher, Digest, FaultRequest, HashExtra, KvEventsConfig, LoraConfig, LoraModule,
    SimConfig, SimEngine, SimHandle,
};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";
const FIXTURE_TS: f64 = 1_767_225_600.0;
const WAIT: Duration = Duration::from_millis(1500);

/// An engine serving `MODEL` (alias `llama`) with the given adapters.
fn config(modules: &[&str], max_loras: usize) -> SimConfig {
    SimConfig {
        model: MODEL.to_owned(),
        aliases: vec!["llama".to_owned()],
        enable_prompt_tokens_details: true,
        lora: LoraConfig {
            modules: modules
                .iter()
                .map(|m| m.parse().expect("a module"))
                .collect(),
            max_loras,
            ..LoraConfig::default()
        },
        ..SimConfig::default()
    }
}

/// The token ids of vLLM 0.33's LoRA fixture (two 16-token blocks of a
/// request of adapter `sql-lora`).
fn fixture_lora_prompt() -> Vec<u32> {
    let payload = testdata("kv-events/vllm-0.33.0/sha256_cbor-int/stored_lora_medium.msgpack");
    let batch = decode_batch(&payload).expect("the fixture decodes");
    match &batch.events[..] {
        [KvEvent::BlockStored(s)] => s.token_ids.clone(),
        other => panic!("unexpected fixture events {other:?}"),
    }
}

fn stored(payload: &[u8]) -> Vec<BlockStored> {
    decode_batch(payload)
        .expect("decodes")
        .events
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s),
            _ => None,
        })
        .collect()
}

/// The labels of the current `vllm:lora_requests_info` series (the one
/// with the largest value: earlier label combinations linger, as in vLLM),
/// and its value.
fn lora_info(metrics: &str) -> Option<(String, String, String, f64)> {
    let value_of = |l: &str| -> f64 {
        l.rsplit_once(' ')
            .and_then(|(_, v)| v.parse().ok())
            .expect("a value")
    };
    let line = metrics
        .lines()
        .filter(|l| l.starts_with("vllm:lora_requests_info{"))
        .max_by(|a, b| value_of(a).total_cmp(&value_of(b)))?;
    let label = |name: &str| {
        let from = line.find(&format!("{name}=\"")).expect("the label") + name.len() + 2;
        let len = line[from..].find('"').expect("a closing quote");
        line[from..from + len].to_owned()
    };
    Some((
        label("running_lora_adapters"),
        label("waiting_lora_adapters"),
        label("max_lora"),
        value_of(line),
    ))
}

async fn metrics(c: &HttpClient, e: &SimHandle) -> String {
    let (status, body) = call(c, "GET", &format!("{}/metrics", e.base_url()), None).await;
    assert_eq!(status, 200);
    String::from_utf8(body.to_vec()).expect("utf-8")
}

fn sorted(csv: &str) -> Vec<String> {
    let mut v: Vec<String> = csv
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn models_list_adapter_cards_and_every_api_takes_their_names() {
    let e = SimEngine::spawn(config(&["sql-lora", "chat=/models/chat-lora"], 1))
        .await
        .expect("engine starts");
    let c = client();
    let base = e.base_url();
    let m = get_json(&c, &format!("{base}/v1/models")).await;
    let cards = m["data"].as_array().expect("data");
    let ids: Vec<&str> = cards
        .iter()
        .map(|d| d["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, [MODEL, "llama", "sql-lora", "chat"]);
    for card in &cards[..2] {
        assert_eq!(card["parent"], Value::Null);
        assert_eq!(card["root"], MODEL);
        assert_eq!(card["max_model_len"], 32_768);
    }
    for (card, root) in cards[2..]
        .iter()
        .zip(["/adapters/sql-lora", "/models/chat-lora"])
    {
        assert_eq!(card["root"], root);
        assert_eq!(card["parent"], MODEL, "the base model's served name");
        assert_eq!(card["max_model_len"], Value::Null);
        assert_eq!(card["object"], "model");
        assert_eq!(card["owned_by"], "vllm");
        assert_eq!(card["permission"][0]["object"], "model_permission");
    }

    let prompt = json!({"model": "chat", "prompt": "w1 w2 w3", "max_tokens": 2});
    let (status, r) = post_json(&c, &format!("{base}/v1/completions"), &prompt).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["model"], "chat", "the adapter's name is echoed");
    let chat = json!({"model": "sql-lora", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2});
    let (status, r) = post_json(&c, &format!("{base}/v1/chat/completions"), &chat).await;
    assert_eq!((status, &r["model"]), (200, &json!("sql-lora")), "{r}");
    let (status, r) = post_json(
        &c,
        &format!("{base}/v1/responses"),
        &json!({"model": "chat", "input": "w1 w2", "max_output_tokens": 2}),
    )
    .await;
    assert_eq!((status, &r["model"]), (200, &json!("chat")), "{r}");
    let (status, r) = post_json(
        &c,
        &format!("{base}/v1/messages"),
        &json!({"model": "chat", "max_tokens": 2, "messages": [{"role": "user", "content": "w1"}]}),
    )
    .await;
    assert_eq!((status, &r["model"]), (200, &json!("chat")), "{r}");
    let (status, r) = post_json(
        &c,
        &format!("{base}/v1/embeddings"),
        &json!({"model": "sql-lora", "input": "w1 w2"}),
    )
    .await;
    assert_eq!((status, &r["model"]), (200, &json!("sql-lora")), "{r}");
    let (status, t) = post_json(
        &c,
        &format!("{base}/tokenize"),
        &json!({"model": "sql-lora", "prompt": "w1 w2 w3", "add_special_tokens": false}),
    )
    .await;
    assert_eq!((status, &t["count"]), (200, &json!(3)), "{t}");
    let (status, d) = post_json(
        &c,
        &format!("{base}/detokenize"),
        &json!({"model": "chat", "tokens": t["tokens"]}),
    )
    .await;
    assert_eq!(status, 200, "{d}");
    // Adapter requests went through the engine under their adapters.
    let recs = e.recent_requests().concat();
    let mut loras: Vec<Option<u32>> = recs.iter().map(|r| r.lora_id).collect();
    loras.sort_unstable();
    assert_eq!(loras, [Some(1), Some(2), Some(2), Some(2)]);

    // An unknown model keeps vLLM's 404.
    let (status, body) = call(
        &c,
        "POST",
        &format!("{base}/v1/completions"),
        Some(&json!({"model": "sql", "prompt": "w1"})),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(
        serde_json::from_slice::<Value>(&body).expect("json"),
        json!({"error": {"message": "The model `sql` does not exist.", "type": "NotFoundError", "param": null, "code": 404}})
    );
    let (status, _) = post_json(
        &c,
        &format!("{base}/tokenize"),
        &json!({"model": "sql", "prompt": "w1"}),
    )
    .await;
    assert_eq!(status, 404);
    e.shutdown().await;
}

#[tokio::test]
async fn adapter_blocks_hash_apart_and_their_events_name_the_adapter() {
    let cfg = SimConfig {
        kv_events: Some(KvEventsConfig {
            fixed_ts: Some(FIXTURE_TS),
            ..KvEventsConfig::default()
        }),
        ..config(&["sql-lora", "other=/adapters/other"], 2)
    };
    let e = SimEngine::spawn(cfg).await.expect("engine starts");
    let mut sub = subscribe(e.kv_addr().expect("kv events on")).await;
    let c = client();
    let prompt = fixture_lora_prompt();
    assert_eq!(prompt.len(), 32);
    for model in [MODEL, "sql-lora", "other"] {
        let (status, r) = post_json(
            &c,
            &format!("{}/v1/completions", e.base_url()),
            &json!({"model": model, "prompt": prompt, "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, 200, "{r}");
    }
    let msgs = drain(&mut sub, WAIT).await;
    assert_eq!(msgs.len(), 3, "one batch per request");

    // The adapter's batch is vLLM 0.33's own (sha256_cbor, `sql-lora` at
    // /adapters/sql-lora), but for the tier (the fixture's came from the
    // host pool) and the rank the publisher stamps.
    let mut want = testdata("kv-events/vllm-0.33.0/sha256_cbor-int/stored_lora_medium.msgpack");
    let cpu = b"\xa6medium\xa3CPU";
    let at = want
        .windows(cpu.len())
        .position(|w| w == cpu)
        .expect("the fixture's medium");
    want[at + cpu.len() - 3..at + cpu.len()].copy_from_slice(b"GPU");
    let got = &msgs[1][2];
    assert_eq!(got.len(), want.len());
    assert_eq!(
        &got[..got.len() - 1],
        &want[..want.len() - 1],
        "same event, same bytes"
    );

    let events: Vec<BlockStored> = msgs
        .iter()
        .map(|m| {
            let mut s = stored(&m[2]);
            assert_eq!(s.len(), 1);
            s.remove(0)
        })
        .collect();
    let ids: Vec<Vec<u64>> = events
        .iter()
        .map(|s| s.block_hashes.iter().map(BlockHash::id).collect())
        .collect();
    for (i, a) in ids.iter().enumerate() {
        assert_eq!(a.len(), 2);
        for b in &ids[i + 1..] {
            assert!(a.iter().all(|h| !b.contains(h)), "{ids:?}");
        }
    }
    assert_eq!(
        events
            .iter()
            .map(|s| (s.lora_id, s.lora_name.as_deref()))
            .collect::<Vec<_>>(),
        [
            (None, None),
            (Some(1), Some("sql-lora")),
            (Some(2), Some("other"))
        ]
    );
    assert_eq!(events[0].extra_keys, Some(vec![None, None]));
    assert_eq!(
        events[2].extra_keys,
        Some(vec![Some(vec![WireValue::Str("other".to_owned())]); 2]),
        "the name, untagged, as vLLM publishes it"
    );
    // Base-model hashes are what they always were.
    let h = BlockHasher::new(16, kinference_sim::hash::DEFAULT_HASH_SEED);
    let mut base = Vec::new();
    h.extend(&prompt, &mut base);
    assert_eq!(ids[0], base.iter().map(Digest::id).collect::<Vec<_>>());
    let mut other = Vec::new();
    h.extend_with(
        &prompt,
        &mut other,
        Some(&HashExtra::lora("other", "/adapters/other", true)),
    );
    assert_eq!(ids[2], other.iter().map(Digest::id).collect::<Vec<_>>());

    // The truth names each block's adapter.
    let truth = get_json(&c, &format!("{}/debug/cache?tokens=1", e.base_url())).await;
    let blocks = truth["engines"][0]["blocks"].as_array().expect("blocks");
    assert_eq!(blocks.len(), 6);
    for (hashes, name) in ids.iter().zip([None, Some("sql-lora"), Some("other")]) {
        for hash in hashes {
            let b = blocks
                .iter()
                .find(|b| b["hash"] == *hash)
                .expect("the block is cached");
            assert_eq!(b["lora_name"].as_str(), name);
        }
    }
    assert_eq!(
        truth["engines"][0]["lora_slots"],
        json!(["sql-lora", "other"])
    );
    e.shutdown().await;
}

#[tokio::test]
async fn releases_before_0_31_hash_the_bare_adapter_name() {
    let e = SimEngine::spawn(SimConfig {
        engine_mode: "vllm:0.30".parse().expect("mode"),
        ..config(&["sql-lora"], 1)
    })
    .await
    .expect("engine starts");
    let c = client();
    let prompt = fixture_lora_prompt();
    let (status, r) = post_json(
        &c,
        &format!("{}/v1/completions", e.base_url()),
        &json!({"model": "sql-lora", "prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    let h = BlockHasher::new(16, kinference_sim::hash::DEFAULT_HASH_SEED);
    let ids = |tagged: bool| {
        let mut d = Vec::new();
        let extra = HashExtra::lora("sql-lora", "/adapters/sql-lora", tagged);
        h.extend_with(&prompt, &mut d, Some(&extra));
        let mut ids: Vec<u64> = d.iter().map(Digest::id).collect();
        ids.sort_unstable();
        ids
    };
    let mut cached: Vec<u64> = e.cache_truth(false).engines[0]
        .blocks
        .as_ref()
        .expect("blocks")
        .iter()
        .map(|b| b.hash)
        .collect();
    cached.sort_unstable();
    assert_eq!(cached, ids(false));
    assert_ne!(ids(false), ids(true));
    e.shutdown().await;
}

#[tokio::test]
async fn a_prompt_sent_twice_to_an_adapter_hits_only_that_adapters_cache() {
    let e = SimEngine::spawn(config(&["a", "b"], 2))
        .await
        .expect("engine starts");
    let c = client();
    let url = format!("{}/v1/completions", e.base_url());
    let prompt: Vec<u32> = (1..=40).collect();
    let mut cached = Vec::new();
    for model in ["a", "a", "b", MODEL, "llama"] {
        let (status, r) = post_json(
            &c,
            &url,
            &json!({"model": model, "prompt": prompt, "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, 200, "{r}");
        cached.push(r["usage"]["prompt_tokens_details"]["cached_tokens"].clone());
    }
    // The second `a` request finds a's two full blocks; `b` and the base
    // model start cold; the alias shares the base model's cache.
    assert_eq!(cached, [json!(0), json!(32), json!(0), json!(0), json!(32)]);
    let text = metrics(&c, &e).await;
    assert!(
        text.contains(&format!(
            "vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"{MODEL}\"}} 64.0"
        )),
        "{text}"
    );
    let (status, m) = post_json(
        &c,
        &format!("{}/debug/prefix_match", e.base_url()),
        &json!({"model": "b", "tokens": prompt}),
    )
    .await;
    assert_eq!(
        (status, &m["engines"][0]["cached_tokens"]),
        (200, &json!(32))
    );
    let (status, _) = post_json(
        &c,
        &format!("{}/debug/prefix_match", e.base_url()),
        &json!({"model": "c", "tokens": prompt}),
    )
    .await;
    assert_eq!(status, 404);
    let longer: Vec<u32> = (1..=49).collect();
    assert_eq!(e.cached_prefix_tokens_for(&longer, "a"), Some(vec![32]));
    assert_eq!(e.cached_prefix_tokens_for(&longer, MODEL), Some(vec![32]));
    assert_eq!(e.cached_prefix_tokens_for(&longer, "c"), None);
    let other: Vec<u32> = (100..=140).collect();
    assert_eq!(e.cached_prefix_tokens_for(&other, "a"), Some(vec![0]));
    e.shutdown().await;
}

/// Polls the truth until `ok` holds (or fails after many tries).
async fn until(e: &SimHandle, what: &str, ok: impl Fn(&kinference_sim::RankTruth) -> bool) {
    for _ in 0..2000 {
        if ok(&e.cache_truth(false).engines[0]) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the engine never got to: {what}");
}

#[tokio::test]
async fn one_lora_slot_serializes_two_adapters_and_each_pays_its_load() {
    let load_ms = 40.0;
    let mut cfg = config(&["a", "b"], 1);
    cfg.lora.load_ms = load_ms;
    let e = SimEngine::spawn(cfg).await.expect("engine starts");
    let c = client();
    // A stall holds all three in the queue, so they meet the scheduler
    // together, in whatever order they arrived.
    e.inject(&FaultRequest {
        stall_ms: Some(600_000),
        ..FaultRequest::default()
    })
    .await
    .expect("stalls");
    let url = format!("{}/v1/completions", e.base_url());
    let mut tasks = Vec::new();
    for (model, first) in [("a", 1u32), ("b", 500), (MODEL, 1000)] {
        let (c, url) = (c.clone(), url.clone());
        let prompt: Vec<u32> = (first..first + 20).collect();
        tasks.push(tokio::spawn(async move {
            post_json(
                &c,
                &url,
                &json!({"model": model, "prompt": prompt, "max_tokens": 6}),
            )
            .await
        }));
    }
    until(&e, "three requests waiting", |r| r.waiting.len() == 3).await;
    let (running, waiting, max_lora, at) =
        lora_info(&metrics(&c, &e).await).expect("vllm:lora_requests_info");
    assert_eq!(
        (running.as_str(), sorted(&waiting), max_lora.as_str()),
        ("", vec!["a".to_owned(), "b".to_owned()], "1")
    );
    assert!(at > 1.6e9, "the value is the Unix time of the update: {at}");
    e.inject(&FaultRequest {
        stall_ms: Some(0),
        ..FaultRequest::default()
    })
    .await
    .expect("ends the stall");
    for t in tasks {
        let (status, r) = t.await.expect("the request task");
        assert_eq!(status, 200, "{r}");
    }

    let recs = e.recent_requests().concat();
    let by = |lora: Option<u32>| recs.iter().find(|r| r.lora_id == lora).expect("ran");
    let (ra, rb, base) = (by(Some(1)), by(Some(2)), by(None));
    let sched = |r: &kinference_sim::RequestRecord| r.scheduled.expect("scheduled");
    let (first, second) = if sched(ra) <= sched(rb) {
        (ra, rb)
    } else {
        (rb, ra)
    };
    assert!(
        sched(second) >= first.finished,
        "the second adapter waits for the first to finish: {first:?} {second:?}"
    );
    assert!(
        (sched(base) - sched(first)).abs() < 1e-9,
        "the base request is never held back: it ran in the first adapter's first step {base:?}"
    );
    // Engine-time accounting (planned step times, not a clock reading):
    // each adapter's first step loaded it into the one slot.
    for r in [first, second] {
        let step = r.first_token.expect("a token") - sched(r);
        assert!(step >= load_ms / 1000.0 - 1e-6, "{r:?}");
    }
    let truth = e.cache_truth(false);
    let rank = &truth.engines[0];
    assert_eq!(rank.counters.lora_loads, 2, "a, then b evicting a");
    let name = if second.lora_id == Some(1) { "a" } else { "b" };
    assert_eq!(rank.lora_slots, [name]);
    let (running, waiting, _, _) = lora_info(&metrics(&c, &e).await).expect("still exported");
    assert_eq!((running.as_str(), waiting.as_str()), ("", ""));
    e.shutdown().await;
}

#[tokio::test]
async fn lora_requests_info_names_the_running_adapter() {
    let c = client();
    let plain = SimEngine::spawn(SimConfig::default())
        .await
        .expect("engine starts");
    assert!(
        lora_info(&metrics(&c, &plain).await).is_none(),
        "no adapters, no lora_requests_info"
    );
    plain.shutdown().await;

    let e = SimEngine::spawn(config(&["a", "b"], 2))
        .await
        .expect("engine starts");
    let (running, waiting, max_lora, _) =
        lora_info(&metrics(&c, &e).await).expect("vllm:lora_requests_info");
    assert_eq!(
        (running.as_str(), waiting.as_str(), max_lora.as_str()),
        ("", "", "2")
    );
    // A long generation of `b`: its adapter shows as running until the
    // engine stops (the request is cut then).
    let url = format!("{}/v1/completions", e.base_url());
    let long = {
        let c = c.clone();
        tokio::spawn(async move {
            let req = hyper::Request::builder()
                .method("POST")
                .uri(url)
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(
                    json!({"model": "b", "prompt": "w1 w2", "max_tokens": 30_000}).to_string(),
                )))
                .expect("request");
            let _ = c.request(req).await;
        })
    };
    until(&e, "b running", |r| r.running.len() == 1).await;
    let (running, waiting, _, _) = lora_info(&metrics(&c, &e).await).expect("exported");
    assert_eq!((running.as_str(), waiting.as_str()), ("b", ""));
    e.shutdown().await;
    let _ = long.await;
}

/// A free port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

#[tokio::test]
async fn the_binary_takes_vllms_lora_flags_and_refuses_bad_ones() {
    let http = free_port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kinference-sim"))
        .args(["--host", "127.0.0.1", "--port", &http.to_string()])
        .args(["--kv-port", "0", "--served-model-name", "base"])
        .args(["--lora-modules", "sql-lora,chat=/models/chat", "tools"])
        .args(["--lora-modules", "extra=/x"])
        .args(["--max-loras", "2", "--lora-load-ms", "5"])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the binary starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
        .await
        .expect("an engine line")
        .expect("reads")
        .expect("a line");
    assert!(
        line.ends_with("lora [sql-lora, chat, tools, extra]"),
        "{line}"
    );
    let c = client();
    let m = get_json(&c, &format!("http://127.0.0.1:{http}/v1/models")).await;
    let cards: Vec<(&str, &str, &Value)> = m["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|d| {
            (
                d["id"].as_str().expect("id"),
                d["root"].as_str().expect("root"),
                &d["parent"],
            )
        })
        .collect();
    let base = json!("base");
    assert_eq!(
        cards,
        [
            ("base", "base", &Value::Null),
            ("sql-lora", "/adapters/sql-lora", &base),
            ("chat", "/models/chat", &base),
            ("tools", "/adapters/tools", &base),
            ("extra", "/x", &base),
        ]
    );
    let text = String::from_utf8(
        call(&c, "GET", &format!("http://127.0.0.1:{http}/metrics"), None)
            .await
            .1
            .to_vec(),
    )
    .expect("utf-8");
    assert_eq!(
        lora_info(&text).map(|i| i.2),
        Some("2".to_owned()),
        "--max-loras"
    );
    child.kill().await.expect("stops");

    for (args, says) in [
        (&["--lora-modules", "a,a=/other"][..], "listed twice"),
        (&["--lora-modules", "base"][..], "base model"),
        (
            &["--lora-modules", "a=", "--max-loras", "1"][..],
            "empty path",
        ),
        (
            &["--lora-modules", "a", "--max-loras", "0"][..],
            "max_loras",
        ),
        (&["--engine", "sglang", "--lora-modules", "a"][..], "LoRA"),
    ] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_kinference-sim"))
            .args(["--host", "127.0.0.1", "--port", "0", "--kv-port", "0"])
            .args(["--served-model-name", "base"])
            .args(args)
            .output()
            .await
            .expect("the binary runs");
        assert!(!out.status.success(), "{args:?} is refused");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn lora_modules_parse_like_vllms() {
    assert_eq!(
        "sql-lora=/data/sql".parse(),
        Ok(LoraModule::new("sql-lora", "/data/sql"))
    );
    assert_eq!("sql-lora".parse(), Ok(LoraModule::named("sql-lora")));
    assert_eq!(LoraModule::named("x").path, "/adapters/x");
}
