//! The SGLang mode against SGLang itself: its KV-event payloads byte for
//! byte against the fixtures under `testdata/kv-events/sglang-*` (made by
//! SGLang's own code), its replay frames, its DP-rank ports, `/server_info`,
//! `/v1/models`, `/health`, `/metrics` names and error shape. Real engines
//! on loopback, real ZeroMQ sockets, real HTTP.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use kinference_kvindex::codec::frames;
use kinference_kvindex::{KvEvent, decode_batch};
use kinference_sim::{EngineConfig, KvEventsConfig, SimConfig, SimEngine, SimHandle};
use serde_json::{Value, json};

const FIXTURE_TS: f64 = 1_767_225_600.0;
const WAIT: Duration = Duration::from_millis(1500);

/// The fixtures' two requests: A (48 tokens) and B (A + 32), the same token
/// ids in every engine's fixtures.
fn fixture_prompts() -> (Vec<u32>, Vec<u32>) {
    let batch = decode_batch(&testdata("kv-events/sglang-0.5.23/stored_chain.msgpack"))
        .expect("fixture decodes");
    let tokens: Vec<Vec<u32>> = batch
        .events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => s.token_ids.clone(),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    let a = tokens[0].clone();
    let mut b = a.clone();
    b.extend_from_slice(&tokens[1]);
    (a, b)
}

/// An SGLang engine configured like the fixtures' publisher: page size 16,
/// the fixtures' topic, a fixed timestamp, a 7-block pool (6 usable) so a
/// third request evicts B's two pages.
fn sglang(version: &str, replay: bool) -> SimConfig {
    let kv = KvEventsConfig {
        topic: SGLANG_TOPIC.to_owned(),
        fixed_ts: Some(FIXTURE_TS),
        ..KvEventsConfig::default()
    };
    SimConfig {
        engine_mode: format!("sglang:{version}").parse().expect("mode"),
        model: "meta-llama/Llama-3.1-8B-Instruct".to_owned(),
        max_model_len: 96,
        engine: EngineConfig {
            num_gpu_blocks: 7,
            ..EngineConfig::default()
        },
        kv_events: Some(if replay { kv.with_replay(0) } else { kv }),
        ..SimConfig::default()
    }
}

/// A and B together, a 40-token request evicting B's pages, then SGLang's
/// `/flush_cache`.
async fn scenario(engine: &SimHandle, c: &HttpClient) {
    let (a, b) = fixture_prompts();
    let url = format!("{}/v1/completions", engine.base_url());
    let (status, body) = post_json(c, &url, &json!({"prompt": [a, b], "max_tokens": 1})).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = post_json(
        c,
        &url,
        &json!({"prompt": (1..=40).collect::<Vec<u32>>(), "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let (status, _) = call(
        c,
        "POST",
        &format!("{}/flush_cache", engine.base_url()),
        None,
    )
    .await;
    assert_eq!(status, 200);
}

/// The fixture's events (everything between the batch header and the rank).
fn events_bytes(payload: &[u8]) -> &[u8] {
    // 0x93, 0xcb + 8-byte float, then a 1-byte array header.
    &payload[11..payload.len() - 1]
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn to_vecs(m: &[Bytes]) -> Vec<Vec<u8>> {
    m.iter().map(|f| f.to_vec()).collect()
}

#[tokio::test]
async fn sglang_0_5_23_live_and_replay_match_sglang_byte_for_byte() {
    let engine = SimEngine::spawn(sglang("0.5.23", true))
        .await
        .expect("engine starts");
    let mut sub = subscribe(engine.kv_addr().expect("kv events on")).await;
    let c = client();
    scenario(&engine, &c).await;
    let msgs = drain(&mut sub, WAIT).await;
    assert_eq!(
        msgs.len(),
        3,
        "stored, evicted (+ the new request's pages), cleared"
    );

    // seq 0: SGLang's own publisher capture of the same two requests, every
    // frame identical (topic, seq, map events, signed int64 page hashes,
    // attn_dp_rank 0).
    let live0 = capture("kv-events/sglang-0.5.23/capture_live_0.frames");
    assert_eq!(to_vecs(&msgs[0]), live0, "stored chain, all three frames");
    // The written payload differs only in the rank SGLang's publisher stamps.
    let want = testdata("kv-events/sglang-0.5.23/stored_chain.msgpack");
    assert_eq!(&msgs[0][2][..want.len() - 1], &want[..want.len() - 1]);

    // seq 1: one BlockRemoved for B's node, both pages in prefix order,
    // byte-identical to SGLang's; the batch also stores the new request.
    let removed = testdata("kv-events/sglang-0.5.23/removed.msgpack");
    assert!(
        contains(&msgs[1][2], events_bytes(&removed)),
        "the coalesced BlockRemoved is SGLang's"
    );
    let ours = decode_batch(&msgs[1][2]).expect("decodes");
    assert!(matches!(ours.events[0], KvEvent::BlockRemoved(_)));
    assert!(matches!(ours.events[1], KvEvent::BlockStored(_)));

    // seq 2: AllBlocksCleared from /flush_cache, the whole message as SGLang's.
    let live2 = capture("kv-events/sglang-0.5.23/capture_live_2.frames");
    assert_eq!(to_vecs(&msgs[2]), live2);

    // Replay from seq 1 with SGLang 0.5.22+'s layout: delimiter, topic, seq,
    // payload; the end marker byte for byte.
    let replies = replay(engine.replay_addr().expect("replay on"), 1).await;
    let want: Vec<Vec<Vec<u8>>> = (0..3)
        .map(|i| {
            capture(&format!(
                "kv-events/sglang-0.5.23/capture_replay_{i}.frames"
            ))
        })
        .collect();
    assert_eq!(replies.len(), 3);
    assert_eq!(
        to_vecs(&replies[0])[..3],
        want[0][..3],
        "delimiter, topic, seq 1"
    );
    assert_eq!(replies[0][3], msgs[1][2], "replayed payload = live payload");
    assert_eq!(to_vecs(&replies[1]), want[1], "AllBlocksCleared replayed");
    assert_eq!(to_vecs(&replies[2]), want[2], "end marker");
    engine.shutdown().await;
}

#[tokio::test]
async fn sglang_0_5_18_positional_coalesced_and_the_old_replay_layout() {
    let engine = SimEngine::spawn(sglang("0.5.18", true))
        .await
        .expect("engine starts");
    let mut sub = subscribe(engine.kv_addr().expect("kv events on")).await;
    let c = client();
    scenario(&engine, &c).await;
    let msgs = drain(&mut sub, WAIT).await;
    assert_eq!(msgs.len(), 3);
    let live0 = capture("kv-events/sglang-0.5.18/capture_live_0.frames");
    assert_eq!(to_vecs(&msgs[0]), live0, "7-element positional BlockStored");
    let removed = testdata("kv-events/sglang-0.5.18/removed.msgpack");
    assert!(contains(&msgs[1][2], events_bytes(&removed)));
    let live2 = capture("kv-events/sglang-0.5.18/capture_live_2.frames");
    assert_eq!(to_vecs(&msgs[2]), live2);
    let replies = replay(engine.replay_addr().expect("replay on"), 1).await;
    let want: Vec<Vec<Vec<u8>>> = (0..3)
        .map(|i| {
            capture(&format!(
                "kv-events/sglang-0.5.18/capture_replay_{i}.frames"
            ))
        })
        .collect();
    assert_eq!(replies.len(), 3);
    assert_eq!(
        replies[0].len(),
        3,
        "[delimiter, seq, payload]: no topic frame"
    );
    assert_eq!(to_vecs(&replies[0])[..2], want[0][..2]);
    assert_eq!(to_vecs(&replies[1]), want[1]);
    assert_eq!(to_vecs(&replies[2]), want[2]);
    engine.shutdown().await;
}

#[tokio::test]
async fn sglang_0_5_10_one_event_per_page() {
    let engine = SimEngine::spawn(sglang("0.5.10", false))
        .await
        .expect("engine starts");
    assert!(
        engine.replay_addr().is_none(),
        "no replay unless configured"
    );
    let mut sub = subscribe(engine.kv_addr().expect("kv events on")).await;
    let c = client();
    scenario(&engine, &c).await;
    let msgs = drain(&mut sub, WAIT).await;
    assert_eq!(msgs.len(), 3);
    let want = testdata("kv-events/sglang-0.5.10/stored_chain.msgpack");
    assert_eq!(
        &msgs[0][2][..want.len() - 1],
        &want[..want.len() - 1],
        "five one-page BlockStored, each chained to the page before"
    );
    assert_eq!(
        (msgs[0][2][want.len() - 1], want[want.len() - 1]),
        (0x00, 0xc0)
    );
    let removed = testdata("kv-events/sglang-0.5.10/removed.msgpack");
    assert!(
        contains(&msgs[1][2], events_bytes(&removed)),
        "one BlockRemoved per page, in prefix order"
    );
    let cleared = testdata("kv-events/sglang-0.5.10/all_cleared.msgpack");
    assert_eq!(
        &msgs[2][2][..cleared.len() - 1],
        &cleared[..cleared.len() - 1]
    );
    engine.shutdown().await;
}

#[tokio::test]
async fn dp_ranks_publish_on_base_port_plus_rank_as_server_info_says() {
    let mut cfg = sglang("0.5.23", true);
    cfg.dp_size = 2;
    cfg.engine.num_gpu_blocks = 64;
    let engine = SimEngine::spawn(cfg).await.expect("engine starts");
    let c = client();
    let info = get_json(&c, &format!("{}/server_info", engine.base_url())).await;
    let kv = &info["kv_events"];
    assert_eq!(kv["publisher"], "zmq");
    assert_eq!(kv["endpoint_host"], "127.0.0.1");
    assert_eq!(kv["topic"], SGLANG_TOPIC);
    assert_eq!(kv["block_size"], 16);
    assert_eq!(kv["dp_size"], 2);
    let base = u16::try_from(kv["endpoint_port_base"].as_u64().expect("base")).expect("port");
    let replay_base =
        u16::try_from(kv["replay_endpoint_port_base"].as_u64().expect("replay")).expect("port");
    let eps = engine.kv_endpoints();
    assert_eq!(
        eps.iter().map(|e| e.pub_addr.port()).collect::<Vec<_>>(),
        vec![base, base + 1]
    );
    assert_eq!(
        eps.iter()
            .map(|e| e.replay_addr.expect("replay").port())
            .collect::<Vec<_>>(),
        vec![replay_base, replay_base + 1]
    );
    assert_eq!(info["dp_size"], 2);
    assert_eq!(info["page_size"], 16);
    assert_eq!(info["version"], "0.5.23");
    assert_eq!(
        get_json(&c, &format!("{}/get_server_info", engine.base_url())).await["kv_events"],
        *kv,
        "the deprecated path answers the same"
    );

    // Rank 1 publishes on base + 1, its batches stamped attn_dp_rank 1:
    // byte for byte SGLang's stored_attn_dp_rank1.
    let mut sub1 = subscribe(eps[1].pub_addr).await;
    let (a, b) = fixture_prompts();
    let (status, _, _) = call_with(
        &c,
        "POST",
        &format!("{}/v1/completions", engine.base_url()),
        Some(&json!({"prompt": [a, b], "max_tokens": 1})),
        &[("x-data-parallel-rank", "1")],
    )
    .await;
    assert_eq!(status, 200);
    let m = recv(&mut sub1, WAIT).await.expect("rank 1 publishes");
    assert_eq!(
        m[2].to_vec(),
        testdata("kv-events/sglang-0.5.23/stored_attn_dp_rank1.msgpack")
    );
    assert_eq!(frames::seq_from_bytes(&m[1]), Ok(0));
    engine.shutdown().await;
}

#[tokio::test]
async fn server_info_before_0_5_22_has_no_kv_events_object() {
    let engine = SimEngine::spawn(sglang("0.5.21", false))
        .await
        .expect("engine starts");
    let info = get_json(&client(), &format!("{}/server_info", engine.base_url())).await;
    assert!(info.get("kv_events").is_none(), "{info}");
    let raw = info["kv_events_config"].as_str().expect("the flag's JSON");
    let flag: Value = serde_json::from_str(raw).expect("json");
    assert_eq!(flag["publisher"], "zmq");
    assert!(flag.get("replay_endpoint").is_none());
    engine.shutdown().await;
}

#[tokio::test]
async fn http_surface_is_sglangs() {
    let engine = SimEngine::spawn(SimConfig {
        engine_mode: "sglang".parse().expect("mode"),
        ..SimConfig::default()
    })
    .await
    .expect("engine starts");
    let c = client();
    let base = engine.base_url();
    let models = get_json(&c, &format!("{base}/v1/models")).await;
    let card = &models["data"][0];
    assert_eq!(models["object"], "list");
    assert_eq!(card["owned_by"], "sglang");
    assert_eq!(card["id"], engine.model());
    assert_eq!(card["root"], engine.model());
    assert_eq!(card["max_model_len"], 32_768);
    assert!(card.get("permission").is_none());
    let (status, body) = call(&c, "GET", &format!("{base}/health"), None).await;
    assert_eq!((status, body.len()), (200, 0));
    for path in [
        "/kv_event_sources",
        "/reset_prefix_cache",
        "/version",
        "/load",
    ] {
        let (status, body) = call(&c, "GET", &format!("{base}{path}"), None).await;
        assert_eq!(status, 404, "{path}");
        assert_eq!(body, Bytes::from_static(br#"{"detail":"Not Found"}"#));
    }
    // Errors in SGLang's flat shape.
    let (status, err) = post_json(
        &c,
        &format!("{base}/v1/completions"),
        &json!({"model": "nope", "prompt": "x"}),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(err["object"], "error");
    assert_eq!(err["code"], 404);
    assert!(err["message"].as_str().expect("message").contains("nope"));
    // SGLang's tokenizer endpoint.
    let (status, tok) = post_json(
        &c,
        &format!("{base}/v1/tokenize"),
        &json!({"prompt": "w1 w2"}),
    )
    .await;
    assert_eq!((status, tok["count"].as_u64()), (200, Some(2)));

    // sglang: metrics, moving with the traffic; no vllm: names.
    let prompt: Vec<u32> = (0..64).collect();
    for _ in 0..2 {
        let (status, _) = post_json(
            &c,
            &format!("{base}/v1/completions"),
            &json!({"prompt": prompt, "max_tokens": 3}),
        )
        .await;
        assert_eq!(status, 200);
    }
    let (_, m) = call(&c, "GET", &format!("{base}/metrics"), None).await;
    let m = String::from_utf8(m.to_vec()).expect("text");
    assert!(!m.contains("vllm:"), "{m}");
    let labels = "model_name=\"kinference/sim\",engine_type=\"unified\",tp_rank=\"0\",pp_rank=\"0\",moe_ep_rank=\"0\"";
    for gauge in [
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:num_used_tokens",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:gen_throughput",
    ] {
        assert!(
            m.contains(&format!("{gauge}{{{labels}}} ")),
            "{gauge} in\n{m}"
        );
    }
    let value = |name: &str| -> f64 {
        m.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in\n{m}"))
    };
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert!(close(value("sglang:num_requests_total{"), 2.0));
    assert!(close(value("sglang:prompt_tokens_total{"), 128.0));
    assert!(close(value("sglang:generation_tokens_total{"), 6.0));
    assert!(
        close(value("sglang:cached_tokens_total{"), 48.0),
        "the second request hit 3 pages"
    );
    assert!(
        (value("sglang:cache_hit_rate{") - 0.75).abs() < 1e-9,
        "48 of 64 in its step"
    );
    assert!(m.contains(
        "sglang:time_to_first_token_seconds_bucket{model_name=\"kinference/sim\",le=\"0.1\"}"
    ));
    engine.shutdown().await;
}
