//! The operator tools of the router binary: `tokenize` and `events decode`.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn router() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kinference-router"))
}

#[test]
fn tokenize_prints_the_prompt_and_ids() {
    let mut child = router()
        .args(["tokenize", "--tokenizer"])
        .arg(root().join("examples/word-level"))
        .args(["--request", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(br#"{"model":"m","messages":[{"role":"user","content":"w1 w2 w3"}]}"#)
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["prompt"].as_str().unwrap().contains("w1 w2 w3"), "{v}");
    let ids: Vec<u64> = v["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap())
        .collect();
    // The word-level tokenizer: w<n> is id 6 + n.
    for id in [7, 8, 9] {
        assert!(ids.contains(&id), "{ids:?}");
    }

    // A bad request says why, and fails.
    let out = router()
        .args(["tokenize", "--tokenizer"])
        .arg(root().join("examples/word-level"))
        .args(["--request", "/no/such/file.json"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/no/such/file.json"));
}

#[test]
fn events_decode_prints_one_event_per_line() {
    let dir = root().join("testdata/kv-events/vllm-0.33.0/sha256_cbor-int");
    let out = router()
        .args(["events", "decode"])
        .arg(dir.join("stored_chain.msgpack"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "two BlockStored events in stored_chain");
    assert!(lines.iter().all(|l| l["type"] == "BlockStored"));
    assert_eq!(lines[0]["block_hashes"].as_array().unwrap().len(), 3);
    assert_eq!(lines[1]["parent_block_hash"], lines[0]["block_hashes"][2]);

    // A capture of a live message carries its seq.
    let out = router()
        .args(["events", "decode"])
        .arg(root().join("testdata/kv-events/vllm-0.24.0/sha256-int/capture_live_0.frames"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first: serde_json::Value = serde_json::from_str(
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(first["seq"], 0);

    // Garbage is reported, not a crash.
    let tmp = std::env::temp_dir().join(format!("garbage-{}.msgpack", std::process::id()));
    std::fs::write(&tmp, b"\xc1\xff\x00").unwrap();
    let out = router()
        .args(["events", "decode"])
        .arg(&tmp)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&tmp);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("error"));
}
