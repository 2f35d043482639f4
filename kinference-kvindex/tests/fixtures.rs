//! The codec against every fixture in `testdata/kv-events` (real engine
//! output; see its README): payloads against the manifest's decoded form,
//! frame captures frame by frame, byte-exact re-encoding of the vLLM 0.33
//! (map) and 0.23 (positional) payloads, and block keys computed from event
//! token ids against keys computed from request tokens.

use std::path::PathBuf;

use kinference_kvindex::codec::frames::{self, ReplayReply};
use kinference_kvindex::event::Value;
use kinference_kvindex::key::{BlockKeyer, ExtraKeys};
use kinference_kvindex::{
    BlockHash, EncodeForm, EventBatch, KvEvent, KvIndex, WorkerRef, decode_batch, encode_batch,
};
use serde_json::{Value as Json, json};

#[path = "support/serde_decode/mod.rs"]
#[allow(dead_code)] // each includer uses part of it
mod serde_decode;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/kv-events")
}

fn manifest() -> Json {
    let text = std::fs::read_to_string(dir().join("manifest.json"))
        .expect("testdata/kv-events/manifest.json");
    serde_json::from_str(&text).expect("manifest parses")
}

fn fixtures(kind: &str) -> Vec<Json> {
    let m = manifest();
    let all = m["fixtures"].as_array().expect("fixtures array").clone();
    all.into_iter().filter(|f| f["kind"] == kind).collect()
}

fn read(file: &str) -> Vec<u8> {
    std::fs::read(dir().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

fn hash_json(h: &BlockHash) -> Json {
    match h {
        BlockHash::Uint(v) => json!(v),
        BlockHash::Int(v) => json!(v),
        BlockHash::Bytes(b) => json!({"$bin": kinference_kvindex::dump::hex(b)}),
    }
}

fn value_json(v: &Value) -> Json {
    match v {
        Value::Nil => Json::Null,
        Value::Bool(b) => json!(b),
        Value::Uint(u) => json!(u),
        Value::Int(i) => json!(i),
        Value::Float(f) => json!(f),
        Value::Str(s) => json!(s),
        Value::Bin(b) => json!({"$bin": kinference_kvindex::dump::hex(b)}),
        Value::Array(a) => Json::Array(a.iter().map(value_json).collect()),
        Value::Map(m) => {
            let mut o = serde_json::Map::new();
            for (k, x) in m {
                if let Value::Str(k) = k {
                    o.insert(k.clone(), value_json(x));
                }
            }
            Json::Object(o)
        }
    }
}

/// Our decoded event as the manifest's `normalized` object, restricted to
/// the keys the manifest has (older releases lack fields), while checking
/// we did not invent values for fields the release does not have.
fn event_json(ev: &KvEvent, want: &serde_json::Map<String, Json>) -> Json {
    let mut o = serde_json::Map::new();
    o.insert("type".into(), json!(ev.tag()));
    match ev {
        KvEvent::BlockStored(s) => {
            o.insert(
                "block_hashes".into(),
                s.block_hashes.iter().map(hash_json).collect(),
            );
            o.insert(
                "parent_block_hash".into(),
                s.parent_block_hash.as_ref().map_or(Json::Null, hash_json),
            );
            o.insert("token_ids".into(), json!(s.token_ids));
            o.insert("block_size".into(), json!(s.block_size));
            o.insert("lora_id".into(), json!(s.lora_id));
            o.insert("medium".into(), json!(s.medium));
            o.insert("lora_name".into(), json!(s.lora_name));
            o.insert(
                "extra_keys".into(),
                s.extra_keys.as_ref().map_or(Json::Null, |l| {
                    l.iter()
                        .map(|e| {
                            e.as_ref()
                                .map_or(Json::Null, |items| items.iter().map(value_json).collect())
                        })
                        .collect()
                }),
            );
            o.insert("group_idx".into(), json!(s.group_idx));
            o.insert("kv_cache_spec_kind".into(), json!(s.kv_cache_spec_kind));
            o.insert(
                "kv_cache_spec_sliding_window".into(),
                json!(s.kv_cache_spec_sliding_window),
            );
            o.insert("locality".into(), json!(s.locality));
            o.insert("ownership".into(), json!(s.ownership));
            o.insert("session_id".into(), json!(s.session_id));
            o.insert("lookahead_token_ids".into(), json!(s.lookahead_token_ids));
            o.insert("cache_salt".into(), json!(s.cache_salt));
            if want.contains_key("metadata") {
                o.insert("metadata".into(), json!({"cache_salt": s.cache_salt}));
                o.remove("cache_salt");
            }
        }
        KvEvent::BlockRemoved(r) => {
            o.insert(
                "block_hashes".into(),
                r.block_hashes.iter().map(hash_json).collect(),
            );
            o.insert("medium".into(), json!(r.medium));
            o.insert("group_idx".into(), json!(r.group_idx));
            o.insert("locality".into(), json!(r.locality));
            o.insert("ownership".into(), json!(r.ownership));
        }
        KvEvent::AllBlocksCleared => {}
    }
    // Fields the release lacks must be empty in our struct.
    let extra: Vec<_> = o
        .iter()
        .filter(|(k, v)| !want.contains_key(*k) && !v.is_null())
        .map(|(k, _)| k.clone())
        .collect();
    assert!(
        extra.is_empty(),
        "decoded values for fields the release lacks: {extra:?}"
    );
    o.retain(|k, _| want.contains_key(k));
    Json::Object(o)
}

fn check_batch(file: &str, b: &EventBatch, normalized: &Json) {
    assert_eq!(json!(b.ts), normalized["ts"], "{file}: ts");
    let rank_key = if normalized.get("attn_dp_rank").is_some() {
        Some("attn_dp_rank")
    } else if normalized.get("data_parallel_rank").is_some() {
        Some("data_parallel_rank")
    } else {
        None
    };
    match rank_key {
        Some(k) => {
            assert!(b.has_rank_field, "{file}: rank field");
            assert_eq!(json!(b.dp_rank), normalized[k], "{file}: rank");
        }
        None => assert!(!b.has_rank_field, "{file}: 2-element batch"),
    }
    let want = normalized["events"].as_array().expect("events");
    assert_eq!(b.events.len(), want.len(), "{file}: event count");
    for (ev, w) in b.events.iter().zip(want) {
        let wm = w.as_object().expect("event object");
        assert_eq!(&event_json(ev, wm), w, "{file}");
    }
    assert_eq!(b.skipped.unknown_events, 0, "{file}");
}

#[test]
fn every_payload_decodes_to_the_manifest() {
    let fx = fixtures("payload");
    assert_eq!(fx.len(), 75, "the manifest lists 75 payloads");
    for f in fx {
        let file = f["file"].as_str().expect("file");
        let bytes = read(file);
        assert_eq!(
            bytes.len() as u64,
            f["len"].as_u64().expect("len"),
            "{file}"
        );
        let b = decode_batch(&bytes).unwrap_or_else(|e| panic!("{file}: {e}"));
        check_batch(file, &b, &f["normalized"]);
        // The reference decoder (serde over rmp-serde) agrees, counts too.
        let r = serde_decode::decode_batch(&bytes).unwrap_or_else(|e| panic!("{file}: {e:?}"));
        assert_eq!(r, b, "{file}: reference decoder");
    }
}

#[test]
fn vllm_033_map_and_023_positional_payloads_reencode_byte_for_byte() {
    let mut n = 0;
    for f in fixtures("payload") {
        let file = f["file"].as_str().expect("file");
        let bytes = read(file);
        let b = decode_batch(&bytes).expect("decodes");
        // Every form survives a round trip through both encodings.
        for form in [EncodeForm::VllmMap, EncodeForm::VllmArray] {
            let again = decode_batch(&encode_batch(&b, form)).expect("re-decodes");
            assert_eq!(again.events.len(), b.events.len(), "{file}");
        }
        let form = if file.starts_with("vllm-0.33.0/") {
            EncodeForm::VllmMap
        } else if file.starts_with("vllm-0.23.0/") {
            EncodeForm::VllmArray
        } else {
            continue;
        };
        assert_eq!(encode_batch(&b, form), bytes, "{file}");
        assert_eq!(
            decode_batch(&encode_batch(&b, EncodeForm::VllmMap)).expect("decodes"),
            b,
            "{file}"
        );
        n += 1;
    }
    assert_eq!(n, 42);
}

#[test]
fn sglang_payloads_reencode_byte_for_byte() {
    let mut n = 0;
    for f in fixtures("payload") {
        let file = f["file"].as_str().expect("file");
        // 0.5.10–0.5.19 are positional (0.5.18 adds the cache-salt map);
        // 0.5.20+ are maps. 0.4.x predates `medium` and is not written.
        let form = if file.starts_with("sglang-0.5.10/") || file.starts_with("sglang-0.5.18/") {
            EncodeForm::SglangArray
        } else if file.starts_with("sglang-0.5.23/") {
            EncodeForm::SglangMap
        } else {
            continue;
        };
        let bytes = read(file);
        let b = decode_batch(&bytes).expect("decodes");
        assert_eq!(encode_batch(&b, form), bytes, "{file}");
        n += 1;
    }
    assert_eq!(n, 5 + 6 + 7, "sglang 0.5.10, 0.5.18 and 0.5.23 payloads");
    // SGLang forms write every hash as a signed int: an unsigned hash
    // above i64::MAX comes back as the same id.
    let b = EventBatch {
        events: vec![KvEvent::BlockRemoved(kinference_kvindex::BlockRemoved {
            block_hashes: vec![BlockHash::Uint(u64::MAX - 1), BlockHash::Bytes(vec![1; 32])],
            ..Default::default()
        })],
        ..EventBatch::default()
    };
    for form in [EncodeForm::SglangArray, EncodeForm::SglangMap] {
        let again = decode_batch(&encode_batch(&b, form)).expect("decodes");
        let KvEvent::BlockRemoved(r) = &again.events[0] else {
            panic!("{form:?}: expected BlockRemoved")
        };
        assert_eq!(r.block_hashes[0], BlockHash::Int(-2), "{form:?}");
        assert_eq!(r.block_hashes[1].id(), 0x0101_0101_0101_0101, "{form:?}");
    }
}

#[test]
fn every_frame_capture_matches_the_manifest() {
    let fx = fixtures("frames");
    assert_eq!(fx.len(), 39);
    let (mut live, mut replay_batches, mut ends) = (0, 0, 0);
    for f in fx {
        let file = f["file"].as_str().expect("file");
        let bytes = read(file);
        let got = frames::read_frames_container(&bytes).unwrap_or_else(|e| panic!("{file}: {e}"));
        let want = f["frames"].as_array().expect("frames");
        assert_eq!(got.len(), want.len(), "{file}");
        for (g, w) in got.iter().zip(want) {
            assert_eq!(g.len() as u64, w["len"].as_u64().expect("len"), "{file}");
            if w["role"] == "topic" {
                assert_eq!(std::str::from_utf8(g).ok(), w["utf8"].as_str(), "{file}");
            }
        }
        match f["capture"].as_str() {
            Some(c) if c.starts_with("live") => {
                let m = frames::parse_live(&got).unwrap_or_else(|e| panic!("{file}: {e}"));
                assert_eq!(
                    m.seq as i64,
                    want[1]["value_be_signed"].as_i64().expect("seq"),
                    "{file}"
                );
                let b = decode_batch(m.payload).unwrap_or_else(|e| panic!("{file}: {e}"));
                assert_eq!(
                    json!(b.dp_rank),
                    want[2]["decoded"].get(2).cloned().unwrap_or(Json::Null),
                    "{file}"
                );
                assert_eq!(
                    b.events.len(),
                    want[2]["decoded"][1].as_array().expect("events").len(),
                    "{file}"
                );
                live += 1;
            }
            Some("replay") => match frames::parse_replay_reply(&got)
                .unwrap_or_else(|e| panic!("{file}: {e}"))
            {
                ReplayReply::Batch {
                    topic,
                    seq,
                    payload,
                } => {
                    let seq_frame = want.iter().find(|w| w["role"] == "seq").expect("seq frame");
                    assert_eq!(
                        seq as i64,
                        seq_frame["value_be_signed"].as_i64().expect("seq")
                    );
                    assert_eq!(
                        topic.is_some(),
                        want.len() == 4,
                        "{file}: layout by frame count"
                    );
                    decode_batch(payload).unwrap_or_else(|e| panic!("{file}: {e}"));
                    replay_batches += 1;
                }
                ReplayReply::End => ends += 1,
            },
            other => panic!("{file}: unknown capture {other:?}"),
        }
    }
    assert_eq!((live, replay_batches, ends), (21, 12, 6));
}

fn stored_event(file: &str) -> kinference_kvindex::BlockStored {
    let b = decode_batch(&read(file)).expect("decodes");
    match b.events.into_iter().next() {
        Some(KvEvent::BlockStored(s)) => s,
        other => panic!("{file}: {other:?}"),
    }
}

/// Index one event for a fresh worker and look the request keys up.
fn indexed_depth(
    ev: kinference_kvindex::BlockStored,
    request_keys: &[kinference_kvindex::BlockKey],
) -> u32 {
    let ix = KvIndex::default();
    let w = ix
        .register_worker(WorkerRef::new("pod", 0), 16)
        .expect("registers");
    ix.apply_event(w, &KvEvent::BlockStored(ev))
        .expect("applies");
    ix.find_matches(request_keys).get(w).map_or(0, |m| m.blocks)
}

#[test]
fn event_tokens_and_request_tokens_give_the_same_keys() {
    // Plain text, vLLM 0.33 and SGLang 0.5.23.
    for file in [
        "vllm-0.33.0/sha256-int/stored_chain.msgpack",
        "sglang-0.5.23/stored_chain.msgpack",
    ] {
        let ev = stored_event(file);
        let keys = BlockKeyer::new(16, None).keys(&ev.token_ids, &ExtraKeys::none());
        assert_eq!(indexed_depth(ev, &keys), 3, "{file}");
    }
    // LoRA: lora_name is the seed; vLLM also lists it in extra_keys.
    let ev = stored_event("vllm-0.33.0/sha256-int/stored_lora_medium.msgpack");
    let lora = BlockKeyer::new(16, Some("sql-lora")).keys(&ev.token_ids, &ExtraKeys::none());
    let base = BlockKeyer::new(16, None).keys(&ev.token_ids, &ExtraKeys::none());
    assert_eq!(indexed_depth(ev.clone(), &lora), 2);
    assert_eq!(indexed_depth(ev, &base), 0);
    // Multimodal item at token 4 (20 tokens) and cache salt, as the router
    // would describe the request.
    let ev = stored_event("vllm-0.33.0/sha256-int/stored_mm_salt.msgpack");
    let extra = ExtraKeys::none()
        .multimodal("f3a9c0de5b7e41d2", 4, 20)
        .cache_salt("tenant-a");
    let keys = BlockKeyer::new(16, None).keys(&ev.token_ids, &extra);
    assert_eq!(indexed_depth(ev.clone(), &keys), 3);
    let plain = BlockKeyer::new(16, None).keys(&ev.token_ids, &ExtraKeys::none());
    assert_eq!(indexed_depth(ev, &plain), 0);
    // SGLang's cache salt, as a 0.5.18 trailing map and a 0.5.23 field.
    for file in [
        "sglang-0.5.18/stored_cache_salt.msgpack",
        "sglang-0.5.23/stored_cache_salt.msgpack",
    ] {
        let ev = stored_event(file);
        assert_eq!(ev.cache_salt.as_deref(), Some("tenant-a"), "{file}");
        let keys = BlockKeyer::new(16, None)
            .keys(&ev.token_ids, &ExtraKeys::none().cache_salt("tenant-a"));
        assert_eq!(indexed_depth(ev, &keys), 2, "{file}");
    }
    // A 32-token group-1 event is re-chunked into 16-token keys: a worker
    // whose only known group it is can reuse what it holds from the start.
    let ev = stored_event("vllm-0.33.0/sha256-int/stored_group1_bs32.msgpack");
    assert_eq!(ev.group_idx, Some(1));
    assert_eq!(ev.kv_cache_spec_kind.as_deref(), Some("sliding_window"));
    let keys = BlockKeyer::new(16, None).keys(&ev.token_ids, &ExtraKeys::none());
    assert_eq!(indexed_depth(ev, &keys), 4);
}

#[test]
fn int_and_bytes_hash_sets_index_identically() {
    for (int, bytes) in [
        ("vllm-0.33.0/sha256-int", "vllm-0.33.0/sha256-bytes"),
        (
            "vllm-0.33.0/sha256_cbor-int",
            "vllm-0.33.0/sha256_cbor-bytes",
        ),
        ("vllm-0.23.0/sha256-int", "vllm-0.23.0/sha256-bytes"),
    ] {
        for s in [
            "stored_chain",
            "removed",
            "stored_lora_medium",
            "stored_mm_salt",
        ] {
            let a = decode_batch(&read(&format!("{int}/{s}.msgpack"))).expect("decodes");
            let b = decode_batch(&read(&format!("{bytes}/{s}.msgpack"))).expect("decodes");
            let ids = |x: &EventBatch| -> Vec<u64> {
                x.events
                    .iter()
                    .flat_map(|e| match e {
                        KvEvent::BlockStored(s) => {
                            s.block_hashes.iter().map(BlockHash::id).collect::<Vec<_>>()
                        }
                        KvEvent::BlockRemoved(r) => {
                            r.block_hashes.iter().map(BlockHash::id).collect()
                        }
                        KvEvent::AllBlocksCleared => vec![],
                    })
                    .collect()
            };
            assert_eq!(ids(&a), ids(&b), "{int} vs {bytes}: {s}");
        }
    }
}

#[test]
fn the_live_captures_drive_the_index_through_store_remove_clear() {
    for set in [
        "vllm-0.33.0/sha256-int",
        "vllm-0.24.0/sha256-int",
        "vllm-0.23.0/sha256-int",
        "vllm-0.9.0/builtin-int",
        "sglang-0.5.23",
        "sglang-0.5.18",
    ] {
        let ix = KvIndex::default();
        let w = ix
            .register_worker(WorkerRef::new(set, 0), 16)
            .expect("registers");
        let mut held = vec![];
        for n in 0..3 {
            let bytes = read(&format!("{set}/capture_live_{n}.frames"));
            let got = frames::read_frames_container(&bytes).expect("container");
            let m = frames::parse_live(&got).expect("live");
            assert_eq!(m.seq, n);
            let b = decode_batch(m.payload).expect("decodes");
            ix.apply_batch(w, &b).expect("applies");
            held.push(ix.entries());
        }
        // stored_chain: 3 + 2 blocks; removed: the 2 chained ones; cleared.
        assert_eq!(held, vec![5, 3, 0], "{set}");
    }
}

// ----- engine-driven scenarios: hybrid models and new fields -------------

/// `vllm-0.33.0/<name>/scenario.json`: batches vLLM 0.33.0's own KV-cache
/// manager published, and vLLM's own answer for probe prompts (see the
/// testdata README).
fn scenario(name: &str) -> Json {
    let path = format!("vllm-0.33.0/{name}/scenario.json");
    let text = std::fs::read_to_string(dir().join(&path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).expect("scenario parses")
}

/// Decodes every batch of a scenario, checks it against the raw form in
/// the scenario (map events: field by field), and returns the batches.
fn scenario_batches(name: &str) -> Vec<EventBatch> {
    let sc = scenario(name);
    let mut out = Vec::new();
    for b in sc["batches"].as_array().expect("batches") {
        let file = format!("vllm-0.33.0/{name}/{}", b["file"].as_str().expect("file"));
        let bytes = read(&file);
        assert_eq!(
            bytes.len() as u64,
            b["len"].as_u64().expect("len"),
            "{file}"
        );
        let batch = decode_batch(&bytes).unwrap_or_else(|e| panic!("{file}: {e}"));
        let want = b["decoded"][1].as_array().expect("events");
        assert_eq!(batch.events.len(), want.len(), "{file}");
        for (ev, w) in batch.events.iter().zip(want) {
            assert_eq!(
                &event_json(ev, w.as_object().expect("map event")),
                w,
                "{file}"
            );
        }
        assert_eq!(
            batch.skipped,
            kinference_kvindex::event::Skipped::default(),
            "{file}"
        );
        // The rmp writer gives back the engine's bytes.
        assert_eq!(encode_batch(&batch, EncodeForm::VllmMap), bytes, "{file}");
        out.push(batch);
    }
    out
}

/// Applies a scenario's batches to a fresh index (one worker, 16-token
/// keys, the router's `kvBlockSize` for these engines) and checks every
/// probe where the engine took it: the index's usable prefix is vLLM's own
/// cache hit.
fn check_probes(name: &str) -> (KvIndex, kinference_kvindex::WorkerId) {
    let ix = KvIndex::default();
    let w = ix
        .register_worker(WorkerRef::new(name, 0), 16)
        .expect("registers");
    let batches = scenario_batches(name);
    let mut applied = 0;
    let sc = scenario(name);
    for p in sc["probes"].as_array().expect("probes") {
        let after = p["after_batches"].as_u64().expect("after_batches") as usize;
        for b in &batches[applied..after] {
            ix.apply_batch(w, b).expect("applies");
        }
        applied = after;
        let toks: Vec<u32> = p["token_ids"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("token") as u32)
            .collect();
        let keys = BlockKeyer::new(16, None).keys(&toks, &ExtraKeys::none());
        let m = ix.find_matches(&keys);
        let got = m.get(w).map_or(0, |x| x.blocks * 16);
        let gpu = m.get(w).map_or(0, |x| x.gpu_blocks * 16);
        let want = p["vllm_hit_tokens"].as_u64().expect("hit");
        assert_eq!(
            (u64::from(got), u64::from(gpu)),
            (want, want),
            "{name}: probe {:?}: vLLM reuses {want} tokens (per group {})",
            p["name"],
            p["vllm_per_group_hit_tokens"]
        );
    }
    for b in &batches[applied..] {
        ix.apply_batch(w, b).expect("applies");
    }
    (ix, w)
}

#[test]
fn a_sliding_window_group_limits_the_prefix_as_vllm_does() {
    // Full attention keeps A's front, the sliding-window group lost blocks
    // inside it: vLLM reuses only 96 of the 192 tokens full attention holds.
    let (ix, w) = check_probes("hybrid-sliding-window");
    let sc = scenario("hybrid-sliding-window");
    let probes = sc["probes"].as_array().expect("probes");
    let limited = probes
        .iter()
        .filter(|p| {
            let g = &p["vllm_per_group_hit_tokens"];
            g[0].as_u64() != p["vllm_hit_tokens"].as_u64()
                || g[1].as_u64() != p["vllm_hit_tokens"].as_u64()
        })
        .count();
    assert!(limited >= 2, "the scenario shows groups disagreeing");
    let st = ix.worker_stats(w).expect("stats");
    assert_eq!(st.groups, vec![0, 1]);
    assert_eq!(st.observed_widths, vec![(0, 16), (1, 32)]);
    assert_eq!(
        (
            st.unknown_removals,
            st.width_mismatch_blocks,
            st.orphan_blocks
        ),
        (0, 0, 0)
    );
}

#[test]
fn a_mamba_group_needs_a_cached_state_at_the_end_as_vllm_does() {
    // Prefill events carry tokens but no state; states exist at 256 and
    // 320 only, so A's 200-token prompt reuses nothing although full
    // attention holds 192 tokens of it.
    let (ix, w) = check_probes("hybrid-mamba");
    let st = ix.worker_stats(w).expect("stats");
    assert_eq!(st.groups, vec![0, 1]);
    assert_eq!(
        (
            st.unknown_removals,
            st.width_mismatch_blocks,
            st.orphan_blocks
        ),
        (0, 0, 0)
    );
}

#[test]
fn new_fields_storage_tier_remote_blocks_sessions_and_full_reports() {
    let batches = scenario_batches("new-fields");
    let stored: Vec<&kinference_kvindex::BlockStored> = batches
        .iter()
        .flat_map(|b| &b.events)
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s),
            _ => None,
        })
        .collect();
    // session_id rides on the engine's own stores.
    let sessions: Vec<_> = stored
        .iter()
        .filter_map(|s| s.session_id.as_deref())
        .collect();
    assert!(sessions.contains(&"sess-1") && sessions.contains(&"sess-2"));
    // kv_cache_report_mode "full": S2's reused prefix re-stored, nil parent.
    let KvEvent::BlockStored(re) = &batches[1].events[0] else {
        panic!("a re-report first")
    };
    assert!(re.parent_block_hash.is_none());
    assert_eq!(re.block_hashes.len(), 6);
    // Re-reports are idempotent upserts: applying S2's batch again, or its
    // re-report alone, changes nothing.
    let ix = KvIndex::default();
    let w = ix
        .register_worker(WorkerRef::new("w", 0), 16)
        .expect("registers");
    ix.apply_batch(w, &batches[0]).expect("applies");
    ix.apply_batch(w, &batches[1]).expect("applies");
    let before = (ix.stats(), ix.worker_keys(w));
    ix.apply_batch(w, &batches[1]).expect("applies");
    ix.apply_event(w, &batches[1].events[0]).expect("applies");
    assert_eq!((ix.stats(), ix.worker_keys(w)), before);
    let (ix, w) = check_probes("new-fields");
    let st = ix.worker_stats(w).expect("stats");
    // REMOTE copies are not on this engine: counted, not indexed; the
    // legacy placeholder named a block already held in file storage.
    assert_eq!(st.remote_blocks, 6);
    assert_eq!((st.unknown_placeholders, st.unknown_removals), (0, 0));
    // Once the GPU and CPU copies of S2's first blocks go, the file tier is
    // what is left: 2 blocks in STORAGE, counted by `blocks` only.
    let s2 = &scenario("new-fields")["probes"][1]["token_ids"];
    let toks: Vec<u32> = s2
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("token") as u32)
        .collect();
    let keys = BlockKeyer::new(16, None).keys(&toks, &ExtraKeys::none());
    let first: Vec<BlockHash> = re.block_hashes.clone();
    for medium in ["GPU", "CPU"] {
        let ev = KvEvent::BlockRemoved(kinference_kvindex::BlockRemoved {
            block_hashes: first.clone(),
            medium: Some(medium.into()),
            ..Default::default()
        });
        ix.apply_event(w, &ev).expect("applies");
    }
    let m = *ix.find_matches(&keys).get(w).expect("still matches");
    assert_eq!(
        (m.gpu_blocks, m.cpu_blocks, m.disk_blocks, m.blocks),
        (0, 0, 0, 2)
    );
}
