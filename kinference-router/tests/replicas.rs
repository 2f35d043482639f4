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

/// The entry of `/debug/endpoints` for the endpoint at `addr`.
fn endpoint<'a>(e: &'a Value, addr: &str) -> Option<&'a Value> {
    e["endpoints"]
        .as_array()?
        .iter()
        .find(|x| x["endpoint"] == addr)
}

/// Holds six streams of 120 tokens on `a` (its only engine, `engine`)
/// and waits up to 2 s for `b` to count them there; the streams and `b`'s
/// `/debug/endpoints` then.
async fn six_streams_seen(
    a: &Router,
    b: &Router,
    engine: &str,
) -> (Vec<tokio::task::JoinHandle<(Ending, String)>>, Value) {
    let held = hold_streams(a, 6, 120).await;
    let seen = eventually(Duration::from_secs(2), "B sees A's streams", || async {
        let e = endpoints(b).await;
        (total(&e, "peer_load", Some(engine)) == 6).then_some(e)
    })
    .await;
    (held, seen)
}

/// Waits until `r` has a report from its peer at `peer` (admin address).
async fn has_report(r: &Router, peer: &str) {
    eventually(Duration::from_secs(5), "a report from the peer", || async {
        endpoints(r).await["peers"]["peers"]
            .as_array()?
            .iter()
            .any(|p| p["address"] == peer && p["report_age_ms"].is_u64())
            .then_some(())
    })
    .await;
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
    // The engines' decode cost (10 ms per sequence and step) in the
    // profile: six decoding streams make an engine clearly later.
    let opts = WorkerSetOpts {
        profile_spec: Some("  latency: {decodeCostMillis: 10}\n".into()),
        ..WorkerSetOpts::default()
    };
    // A routes to engine 0 only; B to both.
    let a = peered(&addrs[..1], &opts, &a_admin, &b_admin, &common).await;
    let b = peered(&addrs, &opts, &b_admin, &b_peers, &common).await;
    let blind = router(&addrs, &opts, &["--scrape-interval", "60s"]).await;
    wait_routable(&a, 1, true).await;
    wait_routable(&b, 2, true).await;
    wait_routable(&blind, 2, true).await;
    let e0 = addrs[0].http.to_string();
    let e1 = addrs[1].http.to_string();

    // (A's first report to B is its history, not arrivals: wait for it.)
    has_report(&b, &a_admin).await;
    // A holds six streams on engine 0; B counts them there within a few
    // polls; they are not its own.
    let (held, seen) = six_streams_seen(&a, &b, &e0).await;
    assert_eq!(total(&seen, "load", None), 0, "{seen:#}");
    // Nor of A's sending them: B counts the six as arrivals on engine 0
    // (what its externality charges beside its own), none on engine 1.
    let rate = |e: &Value, addr: &str| endpoint(e, addr)?["peer_arrivals_per_s"].as_f64();
    // Six within the 3 s memory: about 2 a second, fading after.
    let r0 = rate(&seen, &e0).unwrap_or_default();
    assert!(r0 > 0.5 && r0 <= 2.0, "{r0}: {seen:#}");
    assert_eq!(rate(&seen, &e1), Some(0.0), "{seen:#}");
    // The replica without peers knows nothing of them.
    let alone = endpoints(&blind).await;
    assert_eq!(total(&alone, "peer_load", None), 0);
    assert_eq!(rate(&alone, &e0), Some(0.0), "{alone:#}");

    // B's decisions read A's streams on engine 0: there it predicts
    // later, and its new work goes to the engine A left idle.
    let id_of = |e: &Value, addr: &str| endpoint(e, addr).unwrap()["id"].clone();
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

    // B knows each peer's state: A's report is fresh, the garbage and the
    // silence are errors (a peer that never answers is known as such once
    // its ask times out: a long poll may wait half the staleness).
    let seen = eventually(Duration::from_secs(3), "B reports every peer", || async {
        let page = endpoints(&b).await;
        (page["peers"]["peers"].as_array()?.len() == 3).then_some(page)
    })
    .await;
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
/// One Service behind two worker sets (two models' worker sets on the
/// same engines) is one engine: a peer's requests there count once in its
/// arrivals, not once per worker set listing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_sends_count_once_on_an_engine_two_worker_sets_list() {
    let sims = engines(1, |c| c.latency.decode_ms_per_seq = 10.0).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let e0 = addrs[0].http.to_string();
    let (a_admin, b_admin) = (free_addr(), free_addr());
    let common = ["--peer-interval", "100ms", "--scrape-interval", "60s"];
    let opts = WorkerSetOpts::default();
    let a = peered(&addrs, &opts, &a_admin, &b_admin, &common).await;
    // B lists the engine under a second worker set too.
    let twice = manifests_yaml(&addrs, &opts).replacen(
        "workerSets: [{name: sim}]",
        "workerSets: [{name: sim}, {name: sim-b}]",
        1,
    ) + &format!(
        "apiVersion: kinference.buoyant.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: sim-b}}\nspec:\n  profile: default\n  kvBlockSize: 16\n  serviceRef: {{name: sim, port: http}}\n  kvEvents: {{port: kv}}\n  models:\n    - name: {MODEL}\n---\n"
    );
    let dir = tempfile::tempdir().expect("temp dir");
    write_manifests(dir.path(), &twice);
    let path = dir.path().to_str().expect("utf-8 path").to_owned();
    let flags = [
        &["--pool", "test", "--manifests", &path][..],
        &["--admin-addr", &b_admin, "--peers", &a_admin],
        &common,
    ]
    .concat();
    let b = serve(dir, &flags).await;
    wait_routable(&a, 1, true).await;
    wait_routable(&b, 1, true).await;
    let page = endpoints(&b).await;
    let listed = endpoint(&page, &e0).map(|x| x["worker_sets"].clone());
    assert_eq!(
        listed,
        Some(serde_json::json!(["sim", "sim-b"])),
        "{page:#}"
    );
    has_report(&b, &a_admin).await;

    let (held, seen) = six_streams_seen(&a, &b, &e0).await;
    // Six within the 3 s memory: at most 2 a second (counted per worker
    // set it would read up to 4).
    let rate = endpoint(&seen, &e0).and_then(|x| x["peer_arrivals_per_s"].as_f64());
    assert!(
        rate.is_some_and(|r| r > 0.5 && r <= 2.0),
        "{rate:?}: {seen:#}"
    );
    for task in held {
        task.abort();
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_cannot_be_reached_counts_for_nothing_at_once() {
    let sims = engines(1, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let engine = addrs[0].http.to_string();
    // The peer: answers every poll with 3 requests on the engine.
    let (peer, _, serving) = plain_peer(
        serde_json::json!({"replica": "killed-peer", "engines": {&engine: [3, 0, 0, 3, 300]}})
            .to_string(),
    )
    .await;
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

// ----- a replica that starts bootstraps its KV index from a peer ----------

/// Leading blocks `r`'s index gives each prompt.
fn depths(r: &Router, prompts: &[Vec<u32>]) -> Vec<u32> {
    prompts.iter().map(|p| router_depth(r, p)).collect()
}

/// `/debug/kv` as endpoint#rank → block keys.
async fn kv_keys(r: &Router) -> std::collections::BTreeMap<String, Value> {
    get(r.admin(), "/debug/kv").await.json()["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| {
            (
                format!("{}#{}", w["endpoint"], w["rank"]),
                w["keys"].clone(),
            )
        })
        .collect()
}

/// Waits until `r` is routable and ready (`/readyz`: a bootstrap from a
/// peer done or given up).
/// `n` streaming chats of `tokens` tokens each through `r`, read in the
/// background (each task ends with how its stream ended).
async fn hold_streams(
    r: &Router,
    n: usize,
    tokens: u32,
) -> Vec<tokio::task::JoinHandle<(Ending, String)>> {
    let mut held = Vec::new();
    for i in 0..n {
        let resp = post_streaming(
            r.api(),
            "/v1/chat/completions",
            &chat(MODEL, &words(i * 1000, 50), true, tokens),
        )
        .await;
        assert_eq!(resp.status(), 200);
        held.push(tokio::spawn(read_stream(
            resp.into_body(),
            Duration::from_secs(30),
        )));
    }
    held
}

async fn routable_and_ready(r: &Router, n: usize) {
    wait_routable(r, n, true).await;
    let admin = r.admin();
    eventually(Duration::from_secs(60), "/readyz says ready", || async {
        (get(admin, "/readyz").await.status == 200).then_some(())
    })
    .await;
}

/// One sample of the router's metrics page.
async fn metric(r: &Router, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    value_of(&get(r.admin(), "/metrics").await.text(), name, labels)
}

/// A peer of an earlier release: answers every poll with the report `body`
/// and no load version, then closes; counts the polls.
async fn plain_peer(
    body: String,
) -> (
    String,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
    tokio::task::JoinHandle<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = asked.clone();
    let serving = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        while let Ok((mut conn, _)) = listener.accept().await {
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf).await;
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(reply.as_bytes()).await;
        }
    });
    (addr, asked, serving)
}

/// A listener that answers every connection with `reply` (raw HTTP), after
/// reading its request; `None` never answers.
async fn fake_peer(reply: Option<Vec<u8>>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut held = Vec::new();
        while let Ok((mut s, _)) = l.accept().await {
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).await;
            match &reply {
                Some(r) => {
                    let _ = s.write_all(r).await;
                }
                None => held.push(s),
            }
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_starts_finds_the_blocks_its_peer_knows() {
    let sims = engines(2, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let opts = WorkerSetOpts {
        kv_block_size: BLOCK,
        ..WorkerSetOpts::default()
    };
    // A serves the fleet for a while; the engines have no replay. (Neither
    // router probes the engines' speed: the blocks are the prompts'.)
    let a_admin = free_addr();
    let a = router(
        &addrs,
        &opts,
        &["--admin-addr", &a_admin, "--speed-probe-tokens", "0"],
    )
    .await;
    wait_routable(&a, 2, true).await;
    let prompts: Vec<Vec<u32>> = (0..6).map(|k| prompt(k, 8)).collect();
    for p in &prompts {
        send_prompt(&a, p).await;
    }
    for s in &sims {
        settled(&a, s, "warm").await;
    }
    let truth: Vec<u32> = prompts
        .iter()
        .map(|p| sims.iter().map(|s| truth_depth(s, p)).max().unwrap_or(0))
        .collect();
    let warm = depths(&a, &prompts);
    assert_eq!(warm, truth);
    assert!(warm.iter().all(|d| *d > 0), "{warm:?}");

    // B starts with A as its peer. No request goes anywhere meanwhile, so
    // the engines publish nothing B could learn the blocks from.
    let b = router(
        &addrs,
        &opts,
        &["--peers", &a_admin, "--speed-probe-tokens", "0"],
    )
    .await;
    routable_and_ready(&b, 2).await;
    assert_eq!(depths(&b, &prompts), warm);
    assert_eq!(kv_keys(&b).await, kv_keys(&a).await);
    let e = endpoints(&b).await;
    let boot = &e["kv_bootstrap"];
    assert_eq!(boot["state"], "seeded", "{boot:#}");
    assert_eq!(boot["peer"], a_admin.as_str());
    assert_eq!(
        (boot["streams"].as_u64(), boot["offered"].as_u64()),
        (Some(2), Some(2))
    );
    for ep in e["endpoints"].as_array().unwrap() {
        let k = &ep["kv"][0];
        assert_eq!(k["batches"], 0, "no event reached B: {k:#}");
        assert!(
            k["seed"]
                .as_str()
                .is_some_and(|s| s.starts_with("imported")),
            "{k:#}"
        );
    }
    let imported = metric(&b, "kinference_router_kv_bootstrap_blocks", &[]).await;
    assert_eq!(imported, Some(f64::from(warm.iter().sum::<u32>())));
    let got = metric(
        &b,
        "kinference_router_peer_bytes_total",
        &[("kind", "snapshot"), ("direction", "received")],
    )
    .await;
    let sent = metric(
        &a,
        "kinference_router_peer_bytes_total",
        &[("kind", "snapshot"), ("direction", "sent")],
    )
    .await;
    assert!(got.is_some_and(|x| x > 0.0), "{got:?}");
    assert_eq!(got, sent, "both ends count the same answer");

    // B routes on what it imported: each prompt to the engine holding it.
    for (i, p) in prompts.iter().enumerate() {
        let holder = sims
            .iter()
            .find(|s| truth_depth(s, p) > 0)
            .map(|s| s.http_addr().to_string())
            .unwrap();
        let r = post(
            b.api(),
            "/v1/completions",
            &serde_json::json!({"model": MODEL, "prompt": p, "max_tokens": 2}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.endpoint(), holder, "prompt {i}");
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// A replica predicts with the engines' step costs its peer learnt from
/// its streams, before a stream of its own has ended: one that starts
/// into a warm fleet (a rollout, a scale-out) from the peer's first
/// report, one that was already asking from the report after the peer's
/// costs came into use. With the built-in profile against engines far
/// from it, their first seconds would otherwise be routed on the
/// profile's costs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_take_the_step_costs_their_peer_learnt() {
    let sims = step_truth_engine().await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let opts = WorkerSetOpts::default();
    let a_admin = free_addr();
    let a = router(&addrs, &opts, &["--admin-addr", &a_admin]).await;
    // B asks A from the start; neither has learnt anything yet.
    let b = router(&addrs, &opts, &["--peers", &a_admin]).await;
    wait_routable(&a, 1, true).await;
    wait_routable(&b, 1, true).await;
    let not_yet = step_costs_when(&b, Duration::from_secs(1), "B's step costs", |_| true).await;
    assert_eq!(not_yet["in_use"], false, "{not_yet}");

    // Streams through A only.
    teach_step_costs(&a).await;
    step_costs_when(&a, Duration::from_secs(5), "A's step costs in use", |s| {
        s["in_use"] == true
    })
    .await;
    let in_use = |s: &Value| s["in_use"] == true;
    let b_took = step_costs_when(&b, Duration::from_secs(10), "B takes A's costs", in_use).await;
    // C starts now, with A as its peer, and proxies nothing either.
    let c = router(&addrs, &opts, &["--peers", &a_admin]).await;
    wait_routable(&c, 1, true).await;
    let c_took = step_costs_when(&c, Duration::from_secs(10), "C takes A's costs", in_use).await;

    let learnt = step_costs_when(&a, Duration::from_secs(1), "A's step costs", |_| true).await;
    eprintln!("FIGURE step costs: A learnt {learnt}, B took {b_took}, C took {c_took}");
    // C took A's fit as it is now; B took it as it was when it came into
    // use (fewer streams), which is near the engine's too.
    for field in ["prefill_ms_per_token", "decode_ms", "overhead_ms"] {
        let ratio = c_took[field].as_f64().unwrap() / learnt[field].as_f64().unwrap();
        assert!(
            (ratio - 1.0).abs() < 0.05,
            "{field}: C {c_took} against A {learnt}"
        );
    }
    // B's are A's of a few streams earlier, far from the profile's (0.04
    // ms a prompt token, 0.1 a decoding sequence: what B would have
    // without A). Against the engine's own costs only alone in their
    // binary (replica_steps.rs, routing.rs): beside the other replica
    // tests its short steps stretch, and A's fit with them (B took a
    // prefill of 0.31 ms/token here once, from A's 0.36, against 0.5).
    for field in ["prefill_ms_per_token", "decode_ms", "overhead_ms"] {
        let ratio = b_took[field].as_f64().unwrap() / learnt[field].as_f64().unwrap();
        assert!(
            ratio > 0.6 && ratio < 1.67,
            "{field}: B {b_took} against A {learnt}"
        );
    }
    eprintln!("FIGURE B took, from A: {b_took}");
    // Neither has a stream of its own: what they count is A's (A's last
    // streams' ends may reach its fit after C asked).
    for (who, took) in [("B", &b_took), ("C", &c_took)] {
        let (n, of_a) = (took["samples"].as_u64(), learnt["samples"].as_u64());
        assert!(n > Some(0) && n <= of_a, "{who}: {took} against A {learnt}");
    }
    a.shutdown().await;
    b.shutdown().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_a_peer_snapshot_for_a_bounded_time() {
    let sims = engines(1, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    // A peer that accepts and never answers.
    let silent = fake_peer(None).await;
    let r = router(
        &addrs,
        &WorkerSetOpts::default(),
        &["--peers", &silent, "--peer-bootstrap-timeout", "3s"],
    )
    .await;
    let (admin, api) = (r.admin(), r.api());
    let why = eventually(Duration::from_secs(3), "readiness waits for it", || async {
        let ready = get(admin, "/readyz").await;
        (ready.status == 503 && ready.text().contains("peer's KV index snapshot"))
            .then(|| ready.text())
    })
    .await;
    assert!(why.contains("waiting"), "{why}");
    assert_eq!(get(api, "/ready").await.status, 503);
    assert_eq!(
        metric(&r, "kinference_router_kv_bootstrap_waiting", &[]).await,
        Some(1.0)
    );
    // Then it serves without one and says why.
    routable_and_ready(&r, 1).await;
    let e = endpoints(&r).await;
    assert_eq!(e["kv_bootstrap"]["state"], "fallback", "{e:#}");
    assert_eq!(e["kv_bootstrap"]["fallback"], "timeout", "{e:#}");
    assert_eq!(
        metric(
            &r,
            "kinference_router_kv_bootstrap_fallbacks_total",
            &[("reason", "timeout")],
        )
        .await,
        Some(1.0)
    );
    assert_eq!(
        metric(&r, "kinference_router_kv_bootstrap_waiting", &[]).await,
        Some(0.0)
    );
    let reply = post(
        api,
        "/v1/completions",
        &serde_json::json!({"model": MODEL, "prompt": "w1", "max_tokens": 1}),
    )
    .await;
    assert_eq!(reply.status, 200);
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_snapshot_that_is_garbage_too_large_or_refused_falls_back() {
    let sims = engines(1, |_| {}).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let opts = WorkerSetOpts {
        kv_block_size: BLOCK,
        ..WorkerSetOpts::default()
    };
    let secrets = tempfile::tempdir().unwrap();
    let (right, wrong) = (secrets.path().join("right"), secrets.path().join("wrong"));
    std::fs::write(&right, "peer-secret\n").unwrap();
    std::fs::write(&wrong, "not-the-secret\n").unwrap();
    let (right, wrong) = (right.to_str().unwrap(), wrong.to_str().unwrap());
    let a_admin = free_addr();
    let a = router(
        &addrs,
        &opts,
        &["--admin-addr", &a_admin, "--peer-token-file", right],
    )
    .await;
    wait_routable(&a, 1, true).await;
    let prompts: Vec<Vec<u32>> = (0..16).map(|k| prompt(k, 16)).collect();
    for p in &prompts {
        send_prompt(&a, p).await;
    }
    settled(&a, &sims[0], "warm").await;
    let warm = depths(&a, &prompts);

    let junk = fake_peer(Some(
        b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\nnot msgpack!".to_vec(),
    ))
    .await;
    let mut big = b"HTTP/1.1 200 OK\r\ncontent-length: 2097152\r\n\r\n".to_vec();
    big.resize(big.len() + (2 << 20), 0x90);
    let huge = fake_peer(Some(big)).await;
    let cases: [(&[&str], &str); 4] = [
        (&["--peers", &junk], "invalid"),
        (
            &["--peers", &huge, "--peer-snapshot-max-bytes", "1048576"],
            "too_large",
        ),
        (
            &["--peers", &a_admin, "--peer-token-file", wrong],
            "unauthorized",
        ),
        (&["--peers", &a_admin], "unauthorized"),
    ];
    for (flags, reason) in cases {
        let b = router(&addrs, &opts, flags).await;
        routable_and_ready(&b, 1).await;
        let e = endpoints(&b).await;
        assert_eq!(e["kv_bootstrap"]["fallback"], reason, "{flags:?}: {e:#}");
        let fallbacks = metric(
            &b,
            "kinference_router_kv_bootstrap_fallbacks_total",
            &[("reason", reason)],
        )
        .await;
        assert_eq!(fallbacks, Some(1.0), "{flags:?}");
        assert!(depths(&b, &prompts).iter().all(|d| *d == 0), "{flags:?}");
        // It serves as a replica without peers would.
        let p = &prompts[0];
        send_prompt(&b, p).await;
        b.shutdown().await;
    }

    // The right token, and a bound below A's index: the part nearest the
    // roots, never more than A knows.
    let b = router(
        &addrs,
        &opts,
        &[
            "--peers",
            &a_admin,
            "--peer-token-file",
            right,
            "--peer-snapshot-max-bytes",
            "2048",
        ],
    )
    .await;
    routable_and_ready(&b, 1).await;
    let boot = endpoints(&b).await["kv_bootstrap"].clone();
    assert_eq!(
        (boot["state"].as_str(), boot["truncated"].as_bool()),
        (Some("seeded"), Some(true)),
        "{boot:#}"
    );
    assert!(
        boot["bytes"].as_u64().is_some_and(|n| n <= 2048),
        "{boot:#}"
    );
    let part = depths(&b, &prompts);
    assert!(
        part.iter().zip(&warm).all(|(p, w)| p <= w),
        "{part:?} {warm:?}"
    );
    assert!(part.iter().any(|d| *d > 0), "{part:?}");
    b.shutdown().await;
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_removed_after_the_snapshot_do_not_come_back() {
    // A small cache (63 usable blocks): new prompts evict old ones.
    let sims = engines(1, |c| {
        c.engine.num_gpu_blocks = 64;
        c.max_model_len = 512;
    })
    .await;
    let sim = &sims[0];
    let addrs = [EngineAddr::of(sim)];
    let opts = WorkerSetOpts {
        kv_block_size: BLOCK,
        ..WorkerSetOpts::default()
    };
    let a = router(&addrs, &opts, &[]).await;
    wait_routable(&a, 1, true).await;
    let old: Vec<Vec<u32>> = (0..3).map(|k| prompt(k, 10)).collect();
    for p in &old {
        send_prompt(&a, p).await;
    }
    settled(&a, sim, "warm").await;
    assert!(depths(&a, &old).iter().all(|d| *d == 10));
    // A's snapshot now, served to B later by a peer that waits to answer.
    let snap = get(a.admin(), "/peer/snapshot").await;
    assert_eq!(snap.status, 200);
    assert_eq!(
        snap.headers["content-type"],
        "application/vnd.kinference.kv-snapshot+msgpack"
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let peer = l.local_addr().unwrap().to_string();
    let asked = std::sync::Arc::new(tokio::sync::Notify::new());
    let (release, released) = tokio::sync::watch::channel(false);
    let (body, notify) = (snap.body.clone(), asked.clone());
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        while let Ok((mut s, _)) = l.accept().await {
            let (body, notify, mut released) = (body.clone(), notify.clone(), released.clone());
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let (kind, body) = if buf[..n].starts_with(b"GET /peer/snapshot") {
                    notify.notify_one();
                    let _ = released.wait_for(|r| *r).await;
                    ("application/vnd.kinference.kv-snapshot+msgpack", body)
                } else {
                    // Its load polls: nothing in flight.
                    let report = br#"{"replica":"fake","engines":{}}"#;
                    ("application/json", bytes::Bytes::from_static(report))
                };
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.write_all(&body).await;
            });
        }
    });
    let b = router(
        &addrs,
        &opts,
        &["--peers", &peer, "--peer-bootstrap-timeout", "60s"],
    )
    .await;
    // B subscribed and asked; the engine now evicts the old prompts.
    tokio::time::timeout(Duration::from_secs(30), asked.notified())
        .await
        .expect("B asks its peer");
    let new: Vec<Vec<u32>> = (100..105).map(|k| prompt(k, 10)).collect();
    for p in &new {
        send_prompt(&a, p).await;
    }
    settled(&a, sim, "evicted").await;
    settled(&b, sim, "B heard the evictions").await;
    let truth: Vec<u32> = old.iter().map(|p| truth_depth(sim, p)).collect();
    assert!(
        truth.iter().any(|d| *d < 10),
        "nothing was evicted: {truth:?}"
    );
    // Then the snapshot (from before the evictions) arrives.
    release.send(true).unwrap();
    routable_and_ready(&b, 1).await;
    let e = endpoints(&b).await;
    let seed = e["endpoints"][0]["kv"][0]["seed"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(seed.starts_with("imported"), "{e:#}");
    assert!(
        !seed.contains(" 0 own batches"),
        "B applied its own batches again: {seed}"
    );
    // B agrees with A, and claims nothing the engine dropped.
    let all: Vec<Vec<u32>> = old.iter().chain(&new).cloned().collect();
    assert_eq!(depths(&b, &all), depths(&a, &all));
    for (i, p) in all.iter().enumerate() {
        assert!(router_depth(&b, p) <= truth_depth(sim, p), "prompt {i}");
    }
    a.shutdown().await;
    b.shutdown().await;
}

/// Replicas learn each other's load by long polls: within a moment of a
/// change, not a poll interval later (60 s here); reports are renewed while
/// nothing changes (fresh past the 4 s staleness); and a peer that answers
/// without a load version (an older release) is asked once per interval,
/// not in a tight loop. The bounds are seconds wide on purpose: what they
/// tell apart is a long poll from a 60 s poll, not milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_load_arrives_at_once_not_a_poll_interval_later() {
    // Streams of 1,000 tokens at 10 ms per sequence and step: longer than
    // the test.
    let sims = engines(1, |c| c.latency.decode_ms_per_seq = 10.0).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let engine = addrs[0].http.to_string();
    let (a_admin, b_admin) = (free_addr(), free_addr());
    // The older release: a plain report, no version header.
    let (old_addr, asked, _serving) = plain_peer(r#"{"replica":"old","engines":{}}"#.into()).await;
    let common = [
        "--peer-interval",
        "60s",
        "--peer-staleness",
        "4s",
        "--scrape-interval",
        "60s",
    ];
    let opts = WorkerSetOpts::default();
    let first = peered(&addrs, &opts, &a_admin, &b_admin, &common).await;
    let b_peers = format!("{a_admin},{old_addr}");
    let second = peered(&addrs, &opts, &b_admin, &b_peers, &common).await;
    wait_routable(&first, 1, true).await;
    wait_routable(&second, 1, true).await;
    has_report(&second, &a_admin).await;

    let held = hold_streams(&first, 2, 1000).await;
    eventually(
        Duration::from_secs(15),
        "B sees A's streams long before the next 60 s poll",
        || async {
            (total(&endpoints(&second).await, "peer_load", Some(&engine)) == 2).then_some(())
        },
    )
    .await;
    // Nothing changes for longer than the staleness: A's report is renewed
    // (every 2 s, half the staleness), so B keeps counting the streams.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let page = endpoints(&second).await;
    let a_status = page["peers"]["peers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["address"] == a_admin.as_str())
        .cloned()
        .unwrap_or_default();
    assert!(
        a_status["report_age_ms"]
            .as_u64()
            .is_some_and(|age| age <= 4000),
        "{page}"
    );
    assert_eq!(total(&page, "peer_load", Some(&engine)), 2, "{page}");
    let asks = asked.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        (1..=2).contains(&asks),
        "the old peer was asked {asks} times in seconds of a 60 s interval"
    );
    for task in held {
        task.abort();
    }
    first.shutdown().await;
    second.shutdown().await;
}

/// A new prefix one replica sent an engine reaches its peer with its load:
/// until the engine's KV events arrive (here the prompt is still in
/// prefill, two seconds), the peer sends the same prefix to the same
/// engine instead of to the one its peer left idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_new_prefix_is_found_before_the_engines_events() {
    // 5 ms per prompt token: a 400-token prompt prefills for 2 s, and its
    // blocks' events come after that.
    let sims = engines(2, |c| c.latency.prefill_ms_per_token = 5.0).await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let (a_admin, b_admin) = (free_addr(), free_addr());
    let common = ["--peer-interval", "100ms", "--scrape-interval", "60s"];
    let opts = WorkerSetOpts::default();
    let a = peered(&addrs, &opts, &a_admin, &b_admin, &common).await;
    let b = peered(&addrs, &opts, &b_admin, &a_admin, &common).await;
    wait_routable(&a, 2, true).await;
    wait_routable(&b, 2, true).await;

    let prefix = words(100_000, 400);
    // Its headers come with its first token, after the prefill.
    let api = a.api();
    let body = chat(MODEL, &prefix, true, 2);
    let first = tokio::spawn(async move {
        post_streaming(api, "/v1/chat/completions", &body)
            .await
            .status()
    });
    // B learns A's request (its load and its record come in one report).
    let seen = eventually(Duration::from_secs(2), "B sees A's request", || async {
        let e = endpoints(&b).await;
        (total(&e, "peer_load", None) == 1).then_some(e)
    })
    .await;
    let busy = seen["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["peer_load"]["requests"] == 1)
        .unwrap();
    let (engine, id) = (
        busy["endpoint"].as_str().unwrap().to_owned(),
        busy["id"].clone(),
    );

    // The same prefix with another ending, at B: A's engine is busier, but
    // it is the one about to hold the prefix.
    let body = bytes::Bytes::from(
        serde_json::to_vec(&chat(MODEL, &format!("{prefix} w7 w8 w9"), false, 2)).unwrap(),
    );
    let r = send(
        b.api(),
        "POST",
        "/v1/chat/completions",
        &[("x-kinference-debug", "1")],
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let x: Value =
        serde_json::from_str(r.headers["x-kinference-explain"].to_str().unwrap()).unwrap();
    let cand = x["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["inputs"]["endpoint"] == id)
        .cloned()
        .unwrap();
    let gpu = cand["inputs"]["cached"]["gpu"].as_u64().unwrap();
    // ~405 tokens are 25 blocks of 16; records carry every 8th key.
    assert!(gpu >= 16, "B saw {gpu} blocks of A's prefix: {cand:#}");
    assert_eq!(r.endpoint(), engine, "{x:#}");
    assert_eq!(first.await.unwrap(), 200);
    a.shutdown().await;
    b.shutdown().await;
}
