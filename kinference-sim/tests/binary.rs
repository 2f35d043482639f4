//! The `kinference-sim` binary: several engines on consecutive ports,
//! periodic faults from flags.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncBufReadExt, BufReader};

/// A free range of `n` consecutive ports.
fn free_ports(n: u16) -> u16 {
    'search: loop {
        let first = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let base = first.local_addr().expect("addr").port();
        if base > u16::MAX - n {
            continue;
        }
        drop(first);
        for p in base..base + n {
            if std::net::TcpListener::bind(("127.0.0.1", p)).is_err() {
                continue 'search;
            }
        }
        return base;
    }
}

#[tokio::test]
async fn engines_on_consecutive_ports_with_periodic_restarts() {
    let (http, kv, replay) = (free_ports(2), free_ports(4), free_ports(4));
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kinference-sim"))
        .args(["--engines", "2", "--dp-size", "2", "--host", "127.0.0.1"])
        .args(["--port", &http.to_string(), "--kv-port", &kv.to_string()])
        .args(["--replay-port", &replay.to_string()])
        .args([
            "--served-model-name",
            "sim-a",
            "--restart-publisher-every",
            "0.3",
        ])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the binary starts");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    for i in 0..2u16 {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("an engine line")
            .expect("reads")
            .expect("a line");
        assert!(
            line.contains(&format!("http://127.0.0.1:{}", http + i)),
            "{line}"
        );
    }
    let c = client();
    for i in 0..2u16 {
        let base = format!("http://127.0.0.1:{}", http + i);
        let models = get_json(&c, &format!("{base}/v1/models")).await;
        assert_eq!(models["data"][0]["id"], "sim-a");
        let sources = get_json(&c, &format!("{base}/kv_event_sources")).await;
        for r in 0..2u16 {
            let port = 2 * i + r;
            assert_eq!(
                sources[r.to_string()]["endpoint"],
                format!("tcp://127.0.0.1:{}", kv + port)
            );
            assert_eq!(
                sources[r.to_string()]["replay_endpoint"],
                format!("tcp://127.0.0.1:{}", replay + port)
            );
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let dbg = get_json(
        &c,
        &format!("http://127.0.0.1:{http}/debug/cache?summary=1"),
    )
    .await;
    let restarts = dbg["engines"][0]["publisher"]["restarts"]
        .as_u64()
        .expect("restarts");
    assert!(restarts >= 2, "periodic restarts happened: {restarts}");
    child.kill().await.expect("stops");
}

#[tokio::test]
async fn engine_mode_api_key_and_faults_from_flags() {
    let (http, kv) = (free_ports(1), free_ports(2));
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kinference-sim"))
        .args([
            "--engine",
            "sglang:0.5.23",
            "--host",
            "127.0.0.1",
            "--dp-size",
            "2",
        ])
        .args(["--port", &http.to_string(), "--kv-port", &kv.to_string()])
        .args(["--api-key", "k", "--fail-requests", "cuda-error"])
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
    assert!(line.contains("(sglang:0.5.23)"), "{line}");
    let c = client();
    let base = format!("http://127.0.0.1:{http}");
    let (status, _, _) = call_with(&c, "GET", &format!("{base}/server_info"), None, &[]).await;
    assert_eq!(status, 401);
    let (status, _, body) = call_with(
        &c,
        "GET",
        &format!("{base}/server_info"),
        None,
        &[("authorization", "Bearer k")],
    )
    .await;
    assert_eq!(status, 200);
    let info: serde_json::Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(info["kv_events"]["endpoint_port_base"], kv);
    assert_eq!(info["kv_events"]["dp_size"], 2);
    assert!(info["kv_events"].get("replay_endpoint_port_base").is_none());
    let (status, _, _) = call_with(
        &c,
        "POST",
        &format!("{base}/v1/completions"),
        Some(&serde_json::json!({"prompt": "w1", "max_tokens": 1})),
        &[("authorization", "Bearer k")],
    )
    .await;
    assert_eq!(status, 500, "--fail-requests cuda-error");
    child.kill().await.expect("stops");
}
