//! Helpers for the integration tests: a plain HTTP client, a ZeroMQ
//! subscriber and replay client, fixture access, Python checks.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kinference_kvindex::codec::frames;
use serde_json::Value;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// Status and body of a request.
pub async fn call(c: &HttpClient, method: &str, url: &str, body: Option<&Value>) -> (u16, Bytes) {
    let req = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            body.map(|b| serde_json::to_vec(b).expect("json"))
                .unwrap_or_default(),
        )))
        .expect("request");
    let resp = c.request(req).await.expect("the simulator answers");
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, bytes)
}

/// Status, headers and body of a request with extra headers.
pub async fn call_with(
    c: &HttpClient,
    method: &str,
    url: &str,
    body: Option<&Value>,
    headers: &[(&str, &str)],
) -> (u16, hyper::HeaderMap, Bytes) {
    let mut req = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::from(
            body.map(|b| serde_json::to_vec(b).expect("json"))
                .unwrap_or_default(),
        )))
        .expect("request");
    let resp = c.request(req).await.expect("the simulator answers");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, headers, bytes)
}

/// The fixtures' topic for SGLang captures.
pub const SGLANG_TOPIC: &str = "kv@sglang-pod-0@meta-llama/Llama-3.1-8B-Instruct";

pub async fn get_json(c: &HttpClient, url: &str) -> Value {
    let (status, body) = call(c, "GET", url, None).await;
    assert_eq!(status, 200, "{url}: {}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).expect("json body")
}

pub async fn post_json(c: &HttpClient, url: &str, body: &Value) -> (u16, Value) {
    let (status, bytes) = call(c, "POST", url, Some(body)).await;
    let v = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    };
    (status, v)
}

/// A streamed response: the SSE `data:` payloads, and the time from sending
/// to the first one carrying a token.
pub struct Streamed {
    pub events: Vec<String>,
    pub ttft: Duration,
    pub total: Duration,
}

pub async fn stream(c: &HttpClient, url: &str, body: &Value) -> Streamed {
    let start = Instant::now();
    let req = hyper::Request::builder()
        .method("POST")
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            serde_json::to_vec(body).expect("json"),
        )))
        .expect("request");
    let resp = c.request(req).await.expect("the simulator answers");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut buf = String::new();
    let mut events = Vec::new();
    let mut ttft = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.expect("stream frame");
        if let Some(data) = frame.data_ref() {
            buf.push_str(std::str::from_utf8(data).expect("utf-8"));
            while let Some(at) = buf.find("\n\n") {
                let event: String = buf.drain(..at + 2).collect();
                let payload = event
                    .strip_prefix("data: ")
                    .expect("SSE data line")
                    .trim_end()
                    .to_owned();
                if payload.contains("\"text\":\"w") || payload.contains("\"content\":\"w") {
                    ttft.get_or_insert_with(|| start.elapsed());
                }
                events.push(payload);
            }
        }
    }
    Streamed {
        events,
        ttft: ttft.unwrap_or_else(|| start.elapsed()),
        total: start.elapsed(),
    }
}

/// A SUB socket connected to a publisher, subscribed to everything.
pub async fn subscribe(addr: SocketAddr) -> SubSocket {
    let mut s = SubSocket::new();
    s.connect(&format!("tcp://{addr}"))
        .await
        .expect("connects to the PUB socket");
    s.subscribe("").await.expect("subscribes");
    // Let the subscription reach the publisher (PUB/SUB slow joiner).
    tokio::time::sleep(Duration::from_millis(300)).await;
    s
}

/// The next message's frames, or `None` after `wait`.
pub async fn recv(s: &mut SubSocket, wait: Duration) -> Option<Vec<Bytes>> {
    match tokio::time::timeout(wait, s.recv()).await {
        Ok(Ok(m)) => Some(m.into_vec()),
        Ok(Err(e)) => panic!("SUB recv failed: {e}"),
        Err(_) => None,
    }
}

/// Messages until `wait` passes without one.
pub async fn drain(s: &mut SubSocket, wait: Duration) -> Vec<Vec<Bytes>> {
    let mut out = Vec::new();
    while let Some(m) = recv(s, wait).await {
        out.push(m);
    }
    out
}

/// Asks a replay ROUTER for everything from `start`; returns each reply's
/// frames as a DEALER sees them (leading empty delimiter included), up to
/// and including the end marker.
pub async fn replay(addr: SocketAddr, start: u64) -> Vec<Vec<Bytes>> {
    let mut d = DealerSocket::new();
    d.connect(&format!("tcp://{addr}"))
        .await
        .expect("connects to the replay socket");
    let req = frames::replay_request(start);
    let msg = ZmqMessage::try_from(
        req.iter()
            .map(|f| Bytes::from(f.clone()))
            .collect::<Vec<_>>(),
    )
    .expect("frames");
    d.send(msg).await.expect("sends the replay request");
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), d.recv())
            .await
            .expect("a replay reply within 5 s")
            .expect("recv");
        let f = m.into_vec();
        let refs: Vec<&[u8]> = f.iter().map(Bytes::as_ref).collect();
        let end = matches!(
            frames::parse_replay_reply(&refs),
            Ok(frames::ReplayReply::End)
        );
        out.push(f);
        if end {
            return out;
        }
    }
}

/// A file under the workspace's `testdata/`.
pub fn testdata(path: &str) -> Vec<u8> {
    let full = format!("{}/../testdata/{path}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&full).unwrap_or_else(|e| panic!("{full}: {e}"))
}

/// The frames of a `.frames` capture.
pub fn capture(path: &str) -> Vec<Vec<u8>> {
    let bytes = testdata(path);
    frames::read_frames_container(&bytes)
        .expect("a frames container")
        .into_iter()
        .map(<[u8]>::to_vec)
        .collect()
}

/// `python3`, checked to have the given modules; panics with advice if not.
pub fn python_with(modules: &[&str], pip: &str) -> String {
    let py = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    let check = format!("import {}", modules.join(", "));
    let ok = std::process::Command::new(&py)
        .args(["-c", &check])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "this test needs Python with {modules:?}: run `pip install {pip}` (or set PYTHON to an interpreter that has them)"
    );
    py
}
