//! Router replicas that see each other's load: a replica's streams count
//! on the engines for its peers within a poll, move their next decisions
//! elsewhere, and stop counting when they end or the replica goes; a peer
//! that answers garbage or nothing costs nothing.

mod support;

use std::time::Duration;

use serde_json::Value;
use support::*;

/// Sums `field` of `/debug/endpoints`' entry `kind` (`load`, `peer_load`)
/// over the endpoints, or for the one at `engine`.
fn total(e: &Value, kind: &str, engine: Option<&str>) -> u64 {
    e["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|x| engine.is_none_or(|a| x["endpoint"] == a))
        .filter_map(|x| x[kind]["requests"].as_u64())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_their_load_and_degrade_to_alone() {
    // Six streams of 120 tokens at ~10 ms per stream per step: ~7 s.
    let sims = engines(2, |c| c.latency.decode_ms_per_seq = 10.0).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let (a_admin, b_admin) = (free_addr(), free_addr());
    // Peers that answer garbage, and one that accepts and never answers.
    let junk = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let junk_addr = junk.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt as _;
        while let Ok((mut s, _)) = junk.accept().await {
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{garbage!")
                .await;
        }
    });
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let b_peers = format!("{a_admin},{junk_addr},{silent_addr}");
    // No engine scrapes during the test (60 s): what a replica knows of
    // the others' work comes from its peers or not at all.
    let common = ["--peer-interval", "100ms", "--scrape-interval", "60s"];
    // A routes to engine 0 only; B to both.
    let a = router(
        &addrs[..1],
        &WorkerSetOpts::default(),
        &[
            &["--admin-addr", &a_admin, "--peers", &b_admin][..],
            &common,
        ]
        .concat(),
    )
    .await;
    let b = router(
        &addrs,
        &WorkerSetOpts::default(),
        &[
            &["--admin-addr", &b_admin, "--peers", &b_peers][..],
            &common,
        ]
        .concat(),
    )
    .await;
    let blind = router(
        &addrs,
        &WorkerSetOpts::default(),
        &["--scrape-interval", "60s"],
    )
    .await;
    wait_routable(&a, 1, true).await;
    wait_routable(&b, 2, true).await;
    wait_routable(&blind, 2, true).await;
    let e0 = addrs[0].http.to_string();
    let e1 = addrs[1].http.to_string();

    // A holds six streams on engine 0.
    let mut held = Vec::new();
    for i in 0..6 {
        let resp = post_streaming(
            a.api(),
            "/v1/chat/completions",
            &chat(MODEL, &words(i * 1000, 50), true, 120),
        )
        .await;
        assert_eq!(resp.status(), 200);
        held.push(tokio::spawn(read_stream(
            resp.into_body(),
            Duration::from_secs(30),
        )));
    }
    // B counts them on engine 0 within a few polls; they are not its own.
    let seen = eventually(Duration::from_secs(2), "B sees A's streams", || async {
        let e = endpoints(&b).await;
        (total(&e, "peer_load", Some(&e0)) == 6).then_some(e)
    })
    .await;
    assert_eq!(total(&seen, "load", None), 0, "{seen:#}");
    let peers = seen["peers"]["peers"].as_array().unwrap();
    let status = |addr: &str| {
        peers
            .iter()
            .find(|p| p["address"] == addr)
            .cloned()
            .unwrap()
    };
    assert!(status(&a_admin)["report_age_ms"].as_u64().unwrap() <= 1000);
    assert!(status(&junk_addr)["error"].as_str().is_some(), "{peers:?}");
    assert!(
        status(&silent_addr)["error"].as_str().is_some(),
        "{peers:?}"
    );
    // The replica without peers knows nothing of them.
    assert_eq!(total(&endpoints(&blind).await, "peer_load", None), 0);

    // B's decisions read A's streams on engine 0: there it predicts
    // later, and its new work goes to the engine A left idle.
    let id_of = |e: &Value, addr: &str| {
        e["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["endpoint"] == addr)
            .map(|x| x["id"].clone())
            .unwrap()
    };
    let explained = |r: &Reply| -> Value {
        serde_json::from_str(r.headers["x-kinference-explain"].to_str().unwrap()).unwrap()
    };
    let body =
        bytes::Bytes::from(serde_json::to_vec(&chat(MODEL, &words(50_000, 50), false, 2)).unwrap());
    let debug = [("x-kinference-debug", "1")];
    let r = send(
        b.api(),
        "POST",
        "/v1/chat/completions",
        &debug,
        body.clone(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.endpoint(), e1, "went to the engine A loads");
    let x = explained(&r);
    let cand = |x: &Value, id: &Value| {
        x["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["inputs"]["endpoint"] == *id)
            .cloned()
            .unwrap()
    };
    let (id0, id1) = (id_of(&seen, &e0), id_of(&seen, &e1));
    let (c0, c1) = (cand(&x, &id0), cand(&x, &id1));
    assert_eq!(c0["inputs"]["in_flight"]["requests"], 6, "{c0:#}");
    assert_eq!(c1["inputs"]["in_flight"]["requests"], 0, "{c1:#}");
    assert!(
        c0["prediction"]["ttft_ms"].as_f64() > c1["prediction"]["ttft_ms"].as_f64(),
        "{c0:#} {c1:#}"
    );
    // The blind replica decides as if engine 0 were idle.
    let r = send(blind.api(), "POST", "/v1/chat/completions", &debug, body).await;
    let x = explained(&r);
    let blind_ids = endpoints(&blind).await;
    let c0 = cand(&x, &id_of(&blind_ids, &e0));
    assert_eq!(c0["inputs"]["in_flight"]["requests"], 0, "{c0:#}");

    // When the streams end, the load is gone from B's view within a poll.
    for h in held {
        let (ending, _) = h.await.unwrap();
        assert!(matches!(ending, Ending::Complete), "{ending:?}");
    }
    eventually(
        Duration::from_secs(2),
        "A's finished streams leave B's view",
        || async { (total(&endpoints(&b).await, "peer_load", None) == 0).then_some(()) },
    )
    .await;

    // A replica that goes away with streams open stops counting within the
    // staleness bound (1 s): its peers take its share at once.
    let resp = post_streaming(
        a.api(),
        "/v1/chat/completions",
        &chat(MODEL, &words(90_000, 50), true, 40),
    )
    .await;
    eventually(Duration::from_secs(2), "B sees the new stream", || async {
        (total(&endpoints(&b).await, "peer_load", Some(&e0)) == 1).then_some(())
    })
    .await;
    a.shutdown().await;
    drop(resp);
    eventually(
        Duration::from_secs(3),
        "the stopped replica's load is dropped",
        || async { (total(&endpoints(&b).await, "peer_load", None) == 0).then_some(()) },
    )
    .await;
    // And B still routes.
    let r = post(
        b.api(),
        "/v1/completions",
        &serde_json::json!({"model": MODEL, "prompt": "w1", "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 200);
    b.shutdown().await;
    blind.shutdown().await;
}

/// A peer that stops listening (killed: it never reported its requests
/// ending) counts for nothing from the next poll, long before its last
/// report would be stale (60 s here); while it answers, it counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_cannot_be_reached_counts_for_nothing_at_once() {
    let sims = engines(1, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let engine = addrs[0].http.to_string();
    // The peer: answers every poll with 3 requests on the engine.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let peer = listener.local_addr().unwrap().to_string();
    let body =
        serde_json::json!({"replica": "killed-peer", "engines": {&engine: [3, 0, 0, 3, 300]}})
            .to_string();
    let serving = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).await;
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(reply.as_bytes()).await;
        }
    });
    let r = router(
        &addrs,
        &WorkerSetOpts::default(),
        &[
            "--peers",
            &peer,
            "--peer-interval",
            "100ms",
            "--peer-staleness",
            "60s",
            "--scrape-interval",
            "60s",
        ],
    )
    .await;
    wait_routable(&r, 1, true).await;
    eventually(Duration::from_secs(5), "the peer's load counts", || async {
        (total(&endpoints(&r).await, "peer_load", Some(&engine)) == 3).then_some(())
    })
    .await;
    // Killed: nothing listens there any more.
    serving.abort();
    let _ = serving.await;
    eventually(
        Duration::from_secs(5),
        "an unreachable peer's load is dropped before it is stale",
        || async { (total(&endpoints(&r).await, "peer_load", None) == 0).then_some(()) },
    )
    .await;
    // `/debug/endpoints` says why: no report, and the connection error.
    let e = endpoints(&r).await;
    let status = e["peers"]["peers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["address"] == peer.as_str())
        .cloned()
        .unwrap_or_default();
    assert!(status["report_age_ms"].is_null(), "{e}");
    assert!(
        status["error"].as_str().is_some_and(|x| !x.is_empty()),
        "{e}"
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_token_keeps_load_reports_between_replicas() {
    let sims = engines(1, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let secrets = tempfile::tempdir().unwrap();
    let token = secrets.path().join("token");
    std::fs::write(&token, "peer-secret\n").unwrap();
    let other = free_addr();
    let r = router(
        &addrs,
        &WorkerSetOpts::default(),
        &[
            "--peers",
            &other,
            "--peer-token-file",
            token.to_str().unwrap(),
        ],
    )
    .await;
    wait_routable(&r, 1, true).await;
    assert_eq!(get(r.admin(), "/peer/load").await.status, 401);
    let with = send(
        r.admin(),
        "GET",
        "/peer/load",
        &[("authorization", "Bearer peer-secret")],
        bytes::Bytes::new(),
    )
    .await;
    assert_eq!(with.status, 200);
    assert!(
        with.json()["replica"]
            .as_str()
            .is_some_and(|s| !s.is_empty())
    );
    r.shutdown().await;
}
