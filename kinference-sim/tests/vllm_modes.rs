//! vLLM releases as their defaults behave: `/kv_event_sources` only from
//! 0.31, no replay socket unless configured, NONE_HASH per engine core
//! before 0.29 (or with `PYTHONHASHSEED=random`), and the per-request
//! `kv_cache_report_mode: "full"` of 0.26+, the `session_id` on stores of
//! 0.30+. Real engines, real sockets.

#![allow(clippy::many_single_char_names)]

mod common;

use std::time::Duration;

use common::*;
use kinference_kvindex::{BlockHash, BlockStored, KvEvent, decode_batch};
use kinference_sim::{HashSeed, SimConfig, SimEngine, SimHandle};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_millis(1200);

async fn vllm(version: &str, tweak: impl FnOnce(&mut SimConfig)) -> SimHandle {
    let mut cfg = SimConfig {
        engine_mode: format!("vllm:{version}").parse().expect("mode"),
        ..SimConfig::default()
    };
    tweak(&mut cfg);
    SimEngine::spawn(cfg).await.expect("engine starts")
}

/// Every `BlockStored` an engine publishes for `prompts` sent one by one.
async fn stored_for(engine: &SimHandle, prompts: &[(Vec<u32>, Value)]) -> Vec<Vec<BlockStored>> {
    let mut sub = subscribe(engine.kv_addr().expect("kv events on")).await;
    let c = client();
    let mut out = Vec::new();
    for (prompt, extra) in prompts {
        let mut body = json!({"prompt": prompt, "max_tokens": 1});
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        let (status, b) =
            post_json(&c, &format!("{}/v1/completions", engine.base_url()), &body).await;
        assert_eq!(status, 200, "{b}");
        let msgs = drain(&mut sub, WAIT).await;
        out.push(
            msgs.iter()
                .flat_map(|m| decode_batch(&m[2]).expect("decodes").events)
                .filter_map(|e| match e {
                    KvEvent::BlockStored(s) => Some(s),
                    _ => None,
                })
                .collect(),
        );
    }
    out
}

fn ids(s: &BlockStored) -> Vec<u64> {
    s.block_hashes.iter().map(BlockHash::id).collect()
}

#[tokio::test]
async fn kv_event_sources_exists_from_0_31() {
    let c = client();
    let old = vllm("0.30", |_| {}).await;
    let (status, body) = call(
        &c,
        "GET",
        &format!("{}/kv_event_sources", old.base_url()),
        None,
    )
    .await;
    assert_eq!(status, 404, "vLLM 0.30 has no such route");
    assert_eq!(&body[..], br#"{"detail":"Not Found"}"#);
    let (status, _) = call(&c, "GET", &format!("{}/version", old.base_url()), None).await;
    assert_eq!(status, 200);
    let v = get_json(&c, &format!("{}/version", old.base_url())).await;
    assert_eq!(v["version"], "0.30.0");
    let new = vllm("0.31", |_| {}).await;
    let sources = get_json(&c, &format!("{}/kv_event_sources", new.base_url())).await;
    assert_eq!(sources["0"]["publisher"], "zmq");
    old.shutdown().await;
    new.shutdown().await;
}

#[tokio::test]
async fn no_replay_socket_unless_configured() {
    let c = client();
    let e = SimEngine::spawn(SimConfig::default())
        .await
        .expect("engine starts");
    assert!(e.kv_addr().is_some() && e.replay_addr().is_none());
    let sources = get_json(&c, &format!("{}/kv_event_sources", e.base_url())).await;
    assert_eq!(sources["0"]["replay_endpoint"], Value::Null);
    let dbg = get_json(&c, &format!("{}/debug/cache?summary=1", e.base_url())).await;
    assert_eq!(
        dbg["engines"][0]["publisher"]["replay_endpoint"],
        Value::Null
    );
    e.shutdown().await;
}

#[tokio::test]
async fn hash_seeds_decide_whether_engines_agree() {
    let prompt: Vec<u32> = (0..48).collect();
    let one = [(prompt.clone(), json!({}))];
    let first_ids = |s: &[Vec<BlockStored>]| ids(&s[0][0]);

    // vLLM ≥ 0.29 without PYTHONHASHSEED: every pod hashes alike.
    let (a, b) = (vllm("0.33", |_| {}).await, vllm("0.29", |_| {}).await);
    let (ha, hb) = (stored_for(&a, &one).await, stored_for(&b, &one).await);
    assert_eq!(first_ids(&ha), first_ids(&hb));
    assert_eq!(first_ids(&ha).len(), 3);

    // Before 0.29, or PYTHONHASHSEED=random: each engine its own NONE_HASH,
    // so the same tokens get other hashes on every engine.
    let (c, d) = (vllm("0.28", |_| {}).await, vllm("0.28", |_| {}).await);
    let (hc, hd) = (stored_for(&c, &one).await, stored_for(&d, &one).await);
    assert_ne!(first_ids(&hc), first_ids(&hd));
    assert_ne!(first_ids(&hc), first_ids(&ha));
    let r = vllm("0.33", |cfg| cfg.engine.hash_seed = HashSeed::Random).await;
    assert_ne!(first_ids(&stored_for(&r, &one).await), first_ids(&ha));

    // A shared PYTHONHASHSEED makes old releases agree again.
    let seeded = |cfg: &mut SimConfig| cfg.engine.hash_seed = HashSeed::Fixed("0".to_owned());
    let (e, f) = (vllm("0.25", seeded).await, vllm("0.28", seeded).await);
    let (he, hf) = (stored_for(&e, &one).await, stored_for(&f, &one).await);
    assert_eq!(first_ids(&he), first_ids(&hf));
    assert_ne!(first_ids(&he), first_ids(&ha));
    // The truth speaks the engines' own ids.
    let truth = e.cache_truth(false);
    let held: Vec<u64> = truth.engines[0]
        .blocks
        .as_ref()
        .expect("blocks")
        .iter()
        .map(|b| b.hash)
        .collect();
    assert!(first_ids(&he).iter().all(|h| held.contains(h)));
    for x in [a, b, c, d, r, e, f] {
        x.shutdown().await;
    }
}

#[tokio::test]
async fn report_mode_full_reannounces_the_reused_prefix() {
    let prefix: Vec<u32> = (0..48).collect();
    let longer: Vec<u32> = (0..80).collect();
    let full = json!({"vllm_xargs": {"kv_cache_report_mode": "full"}});
    let e = vllm("0.33", |_| {}).await;
    let got = stored_for(
        &e,
        &[
            (prefix.clone(), json!({})),
            (longer.clone(), full.clone()),
            (
                longer.clone(),
                json!({"vllm_xargs": {"kv_cache_report_mode": "incremental"}}),
            ),
        ],
    )
    .await;
    let first = &got[0];
    assert_eq!(first.len(), 1);
    // The full-mode request: the 3 hit blocks again, parent nil, their
    // tokens, then its 2 new blocks.
    let second = &got[1];
    assert_eq!(second.len(), 2, "{second:?}");
    assert_eq!(ids(&second[0]), ids(&first[0]));
    assert_eq!(second[0].parent_block_hash, None);
    assert_eq!(second[0].token_ids, prefix);
    assert_eq!(second[0].medium.as_deref(), Some("GPU"));
    assert_eq!(ids(&second[1]).len(), 2);
    assert_eq!(
        second[1].parent_block_hash.as_ref().map(BlockHash::id),
        ids(&first[0]).last().copied()
    );
    // Incremental (the default): the 4 blocks a hit may cover (the last
    // token is always computed) are not announced; only the recomputed
    // fifth block is stored again, chained to the fourth.
    assert_eq!(got[2].len(), 1, "{:?}", got[2]);
    assert_eq!(ids(&got[2][0]), ids(&second[1])[1..].to_vec());
    assert_eq!(
        got[2][0].parent_block_hash.as_ref().map(BlockHash::id),
        Some(ids(&second[1])[0])
    );
    let truth = e.cache_truth(false);
    assert_eq!(truth.engines[0].counters.blocks_rereported, 3);
    assert_eq!(truth.engines[0].counters.blocks_stored, 6);
    e.shutdown().await;

    // vLLM 0.25 ignores the field.
    let old = vllm("0.25", |cfg| {
        cfg.engine.hash_seed = HashSeed::Fixed("0".to_owned());
    })
    .await;
    let got = stored_for(&old, &[(prefix, json!({})), (longer, full)]).await;
    assert_eq!(got[1].len(), 1, "only the new blocks");
    assert_eq!(ids(&got[1][0]).len(), 2);
    assert!(got[1][0].parent_block_hash.is_some());
    old.shutdown().await;
}

#[tokio::test]
async fn a_bad_vllm_xargs_is_a_400() {
    let e = vllm("0.33", |_| {}).await;
    let (status, err) = post_json(
        &client(),
        &format!("{}/v1/completions", e.base_url()),
        &json!({"prompt": "w1", "vllm_xargs": "full"}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(err["error"]["param"], "vllm_xargs");
    e.shutdown().await;
}

#[tokio::test]
async fn stores_carry_the_requests_session_from_0_30() {
    let first: Vec<u32> = (0..48).collect();
    let second: Vec<u32> = (0..80).collect();
    let e = vllm("0.30", |_| {}).await;
    let got = stored_for(
        &e,
        &[
            (first.clone(), json!({"session_id": "chat-7"})),
            (second.clone(), json!({"session_id": "chat-7"})),
            ((200..248).collect(), json!({})),
        ],
    )
    .await;
    for turn in &got[..2] {
        assert!(!turn.is_empty());
        for s in turn {
            assert_eq!(s.session_id.as_deref(), Some("chat-7"), "{s:?}");
        }
    }
    assert!(
        got[2].iter().all(|s| s.session_id.is_none()),
        "no session sent"
    );
    // The header names the session too.
    let mut sub = subscribe(e.kv_addr().expect("kv events on")).await;
    let (status, _, _) = call_with(
        &client(),
        "POST",
        &format!("{}/v1/completions", e.base_url()),
        Some(&json!({"prompt": (300..348).collect::<Vec<u32>>(), "max_tokens": 1})),
        &[("x-session-id", "from-header")],
    )
    .await;
    assert_eq!(status, 200);
    let sessions: Vec<Option<String>> = drain(&mut sub, WAIT)
        .await
        .iter()
        .flat_map(|m| decode_batch(&m[2]).expect("decodes").events)
        .filter_map(|ev| match ev {
            KvEvent::BlockStored(s) => Some(s.session_id),
            _ => None,
        })
        .collect();
    assert_eq!(sessions, [Some("from-header".to_owned())]);
    let (status, err) = post_json(
        &client(),
        &format!("{}/v1/completions", e.base_url()),
        &json!({"prompt": "w1", "session_id": 7}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(err["error"]["param"], "session_id");
    e.shutdown().await;

    // 0.29 has no such field.
    let old = vllm("0.29", |_| {}).await;
    let got = stored_for(&old, &[(first, json!({"session_id": "chat-7"}))]).await;
    assert!(!got[0].is_empty());
    assert!(got[0].iter().all(|s| s.session_id.is_none()));
    old.shutdown().await;
}
