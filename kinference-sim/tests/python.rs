//! Independent clients: the `openai` Python package talks to the simulator
//! unchanged, and a `pyzmq` + `msgpack` subscriber reads its KV events.
//! Both fail with advice when the packages are missing
//! (`pip install openai pyzmq msgpack`).

#![allow(clippy::many_single_char_names)]

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::*;
use kinference_sim::{EngineConfig, KvEventsConfig, SimConfig, SimEngine};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

const OPENAI_CLIENT: &str = r#"
import json, sys
import openai

base, model = sys.argv[1], sys.argv[2]
c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
out = {"models": [m.id for m in c.models.list().data]}

r = c.completions.create(model=model, prompt="hello world , the cache", max_tokens=5)
out["completion"] = {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason,
                     "usage": r.usage.model_dump(), "object": r.object}

chunks = list(c.completions.create(model=model, prompt="one two three", max_tokens=4, stream=True,
                                   stream_options={"include_usage": True}))
out["completion_stream"] = {"texts": [ch.choices[0].text for ch in chunks if ch.choices],
                            "finish": [ch.choices[0].finish_reason for ch in chunks if ch.choices],
                            "usage": chunks[-1].usage.model_dump()}

messages = [{"role": "system", "content": "you are a model"}, {"role": "user", "content": "hello there"}]
r = c.chat.completions.create(model=model, messages=messages, max_completion_tokens=3)
out["chat"] = {"content": r.choices[0].message.content, "role": r.choices[0].message.role,
               "finish_reason": r.choices[0].finish_reason, "usage": r.usage.model_dump()}

chunks = list(c.chat.completions.create(model=model, messages=messages, max_tokens=3, stream=True,
                                        stream_options={"include_usage": True}))
out["chat_stream"] = {"deltas": [ch.choices[0].delta.content for ch in chunks if ch.choices],
                      "roles": [ch.choices[0].delta.role for ch in chunks if ch.choices],
                      "usage": chunks[-1].usage.model_dump()}

try:
    c.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    out["not_found"] = None
except openai.NotFoundError as e:
    out["not_found"] = {"status": e.status_code, "body": e.body}
try:
    c.completions.create(model=model, prompt="x", max_tokens=10**9)
    out["too_long"] = None
except openai.BadRequestError as e:
    out["too_long"] = {"status": e.status_code, "message": e.body["message"]}
print(json.dumps(out))
"#;

#[tokio::test]
async fn the_openai_python_client_works_unchanged() {
    let py = python_with(&["openai"], "openai");
    let e = SimEngine::spawn(SimConfig::default())
        .await
        .expect("engine starts");
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
    assert_eq!(r["models"], json!([e.model()]));
    assert_eq!(r["completion"]["object"], "text_completion");
    assert_eq!(r["completion"]["finish_reason"], "length");
    assert_eq!(r["completion"]["usage"]["completion_tokens"], 5);
    assert_eq!(r["completion"]["usage"]["prompt_tokens"], 5);
    assert_eq!(
        r["completion"]["text"]
            .as_str()
            .expect("text")
            .split(' ')
            .count(),
        5
    );
    assert_eq!(
        r["completion_stream"]["texts"]
            .as_array()
            .expect("texts")
            .len(),
        4
    );
    assert_eq!(r["completion_stream"]["finish"][3], "length");
    assert_eq!(r["completion_stream"]["usage"]["total_tokens"], 7);
    assert_eq!(r["chat"]["role"], "assistant");
    assert_eq!(r["chat"]["usage"]["completion_tokens"], 3);
    let deltas = r["chat_stream"]["deltas"].as_array().expect("deltas");
    assert_eq!(deltas.len(), 4, "role chunk + 3 tokens");
    assert_eq!(r["chat_stream"]["roles"][0], "assistant");
    let streamed: String = deltas.iter().filter_map(Value::as_str).collect();
    assert_eq!(streamed.split(' ').count(), 3);
    assert_eq!(
        r["chat_stream"]["usage"]["prompt_tokens"],
        r["chat"]["usage"]["prompt_tokens"]
    );
    assert_eq!(r["not_found"]["status"], 404);
    assert_eq!(r["not_found"]["body"]["type"], "NotFoundError");
    assert_eq!(r["too_long"]["status"], 400);
    e.shutdown().await;
}

const ZMQ_SUBSCRIBER: &str = r#"
import json, sys, time
import zmq, msgpack

pub, replay, want = sys.argv[1], sys.argv[2], int(sys.argv[3])
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(pub)
time.sleep(0.3)
print("ready", flush=True)

def event_summary(ev):
    if isinstance(ev, dict):
        return {"form": "map", "type": ev["type"], "keys": sorted(ev.keys()), "fields": ev}
    return {"form": "array", "type": ev[0], "len": len(ev)}

live = []
deadline = time.time() + 10
while len(live) < want and time.time() < deadline:
    if sub.poll(200):
        frames = sub.recv_multipart()
        batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
        live.append({"frames": len(frames), "topic": frames[0].decode(), "seq": int.from_bytes(frames[1], "big"),
                     "seq_len": len(frames[1]), "batch_len": len(batch), "ts_is_float": isinstance(batch[0], float),
                     "rank": batch[2], "events": [event_summary(e) for e in batch[1]]})

dealer = ctx.socket(zmq.DEALER)
dealer.connect(replay)
dealer.send_multipart([b"", (0).to_bytes(8, "big")])
replies = []
while dealer.poll(3000):
    frames = dealer.recv_multipart()
    replies.append({"frames": len(frames), "seq": int.from_bytes(frames[2], "big", signed=True),
                    "payload_len": len(frames[3])})
    if frames[3] == b"":
        break
print(json.dumps({"live": live, "replay": replies}))
"#;

#[tokio::test]
async fn a_pyzmq_subscriber_reads_vllm_shaped_events() {
    let py = python_with(&["zmq", "msgpack"], "pyzmq msgpack");
    let e = SimEngine::spawn(SimConfig {
        max_model_len: 256,
        engine: EngineConfig {
            num_gpu_blocks: 24,
            ..EngineConfig::default()
        },
        kv_events: Some(KvEventsConfig::default().with_replay(0)),
        ..SimConfig::default()
    })
    .await
    .expect("engine starts");
    let mut child = tokio::process::Command::new(py)
        .args([
            "-c",
            ZMQ_SUBSCRIBER,
            &format!("tcp://{}", e.kv_addr().expect("kv")),
            &format!("tcp://{}", e.replay_addr().expect("replay")),
            "4",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let ready = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .expect("the subscriber gets ready")
        .expect("reads");
    assert_eq!(ready.as_deref(), Some("ready"));
    let c = client();
    let url = format!("{}/v1/completions", e.base_url());
    // Three requests of 160 tokens on a 23-block pool: the third evicts.
    for i in 0..3u32 {
        let prompt: Vec<u32> = (0..160).map(|t| i * 1000 + t).collect();
        assert_eq!(
            post_json(&c, &url, &json!({"prompt": prompt, "max_tokens": 1}))
                .await
                .0,
            200
        );
    }
    assert_eq!(
        call(
            &c,
            "POST",
            &format!("{}/reset_prefix_cache", e.base_url()),
            None
        )
        .await
        .0,
        200
    );
    let out = child.wait_with_output().await.expect("python ends");
    let mut stdout = String::new();
    while let Ok(Some(l)) = lines.next_line().await {
        stdout.push_str(&l);
    }
    assert!(
        out.status.success(),
        "subscriber failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_str(&stdout).expect("the script prints JSON");
    let live = r["live"].as_array().expect("live");
    assert_eq!(live.len(), 4, "{r}");

    // Field sets exactly as vLLM 0.33 writes them (from the fixture).
    let manifest: Value =
        serde_json::from_slice(&testdata("kv-events/manifest.json")).expect("manifest");
    let fixture_keys = |file: &str, i: usize| -> Value {
        let f = manifest["fixtures"]
            .as_array()
            .expect("fixtures")
            .iter()
            .find(|f| f["file"] == file)
            .expect("fixture listed");
        let ev = &f["decoded"][1][i];
        let mut keys: Vec<&str> = ev
            .as_object()
            .expect("map event")
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        json!(keys)
    };
    let stored_keys = fixture_keys("vllm-0.33.0/sha256-int/stored_chain.msgpack", 0);
    let removed_keys = fixture_keys("vllm-0.33.0/sha256-int/removed.msgpack", 0);
    let mut known = std::collections::HashSet::new();
    let mut removed = 0;
    for (i, m) in live.iter().enumerate() {
        assert_eq!(
            (
                m["frames"].as_u64(),
                m["seq"].as_u64(),
                m["seq_len"].as_u64()
            ),
            (Some(3), Some(i as u64), Some(8))
        );
        assert_eq!(
            (
                m["batch_len"].as_u64(),
                m["ts_is_float"].as_bool(),
                m["rank"].as_u64()
            ),
            (Some(3), Some(true), Some(0))
        );
        for ev in m["events"].as_array().expect("events") {
            assert_eq!(ev["form"], "map");
            match ev["type"].as_str().expect("type") {
                "BlockStored" => {
                    assert_eq!(ev["keys"], stored_keys);
                    let f = &ev["fields"];
                    if let Some(p) = f["parent_block_hash"].as_u64() {
                        assert!(known.contains(&p), "parent announced earlier");
                    }
                    for h in f["block_hashes"].as_array().expect("hashes") {
                        known.insert(h.as_u64().expect("u64 hash"));
                    }
                    assert_eq!(f["medium"], "GPU");
                    assert_eq!(f["kv_cache_spec_kind"], "full_attention");
                }
                "BlockRemoved" => {
                    assert_eq!(ev["keys"], removed_keys);
                    removed += 1;
                }
                "AllBlocksCleared" => assert_eq!(i, 3, "the reset comes last"),
                other => panic!("unexpected event {other}"),
            }
        }
    }
    assert!(removed > 0, "eviction was published");
    // Replay through a pyzmq DEALER: 4 batches in vLLM 0.33's layout, then
    // the end marker (seq -1, empty payload).
    let replies = r["replay"].as_array().expect("replay");
    assert_eq!(replies.len(), 5);
    for (i, rep) in replies[..4].iter().enumerate() {
        assert_eq!(
            (rep["frames"].as_u64(), rep["seq"].as_i64()),
            (Some(4), Some(i as i64))
        );
    }
    assert_eq!(
        (
            replies[4]["seq"].as_i64(),
            replies[4]["payload_len"].as_u64()
        ),
        (Some(-1), Some(0))
    );
    e.shutdown().await;
}
