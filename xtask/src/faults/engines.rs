//! Engine faults: killed, hung, stalled, refusing and slow engines.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) async fn killed(env: &Env, f: &mut Figures) -> Result<()> {
    let mut sims = Vec::new();
    for i in 0..3 {
        sims.push(sim(env, &format!("killed-sim{i}"), true, &[]).await?);
    }
    let specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    let r = router(env, "killed-router", &specs, &[], None, 3).await?;
    let url = format!("{}/v1/chat/completions", r.api);
    let c = client(64);
    let mut streams = Vec::new();
    for k in 0..9 {
        let resp = request(
            &c,
            "POST",
            &url,
            Some(&chat(&words(k * 500, 50), true, 2000)),
        )
        .await?;
        streams.push((served_by(&resp), resp.into_body()));
    }
    let victim = streams[0].0.clone();
    let i = sims
        .iter()
        .position(|s| format!("127.0.0.1:{}", s.http) == victim)
        .context("the victim is one of ours")?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let dead = sims.remove(i);
    let killed_at = Instant::now();
    dead.proc.stop().await;
    let readers: Vec<_> = streams
        .into_iter()
        .map(|(ep, body)| {
            tokio::spawn(async move {
                let (e, _, _) = read_stream(body, Duration::from_secs(60)).await;
                (ep, e, killed_at.elapsed())
            })
        })
        .collect();
    let metrics = format!("{}/metrics", r.admin);
    let mut attempts = 0;
    let mut last = 0.0;
    let mut errors = 0;
    let mut n = 0;
    while killed_at.elapsed() < Duration::from_secs(10) {
        let before = counter(
            &get_text(&env.c, &metrics).await?,
            "kinference_router_retries_total",
            &[("reason", "connect")],
        );
        let (status, _, _) = call(&c, &url, &chat(&words(9000 + n * 100, 30), false, 2)).await?;
        if status != 200 {
            errors += 1;
        }
        let after = counter(
            &get_text(&env.c, &metrics).await?,
            "kinference_router_retries_total",
            &[("reason", "connect")],
        );
        if after > before {
            attempts += 1;
            last = killed_at.elapsed().as_secs_f64();
        }
        n += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut cut_after = Vec::new();
    let mut wrong = 0;
    for t in readers {
        let (ep, e, at) = t.await?;
        if ep == victim {
            if e == Ending::Error {
                cut_after.push(at.as_secs_f64() * 1000.0);
            } else {
                wrong += 1;
            }
        } else if e != Ending::Complete {
            wrong += 1;
        }
    }
    f.add(
        "killed: its streams end with an error, ms after the kill (slowest)",
        cut_after.iter().copied().fold(0.0, f64::max),
        "ms",
    );
    f.add(
        "killed: streams ending otherwise (hang, truncated, or failed elsewhere)",
        f64::from(wrong),
        "",
    );
    f.add(
        "killed: new requests (10 s, sequential) that tried the dead engine",
        f64::from(attempts),
        "",
    );
    f.add("killed: last such attempt, s after the kill", last, "s");
    f.add("killed: new requests failed", f64::from(errors), "");
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    Ok(())
}

/// Accepts connections, never answers.
pub(super) async fn black_hole() -> Result<(u16, tokio::task::JoinHandle<()>)> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = l.local_addr()?.port();
    Ok((
        port,
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                held.push(s);
            }
        }),
    ))
}

/// Answers 503 to everything.
pub(super) async fn refuser() -> Result<(u16, tokio::task::JoinHandle<()>)> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = l.local_addr()?.port();
    Ok((
        port,
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(|_req| async {
                        http::Response::builder()
                            .status(503)
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from_static(br#"{"error":{"message":"overloaded","type":"service_unavailable","param":null,"code":503}}"#)))
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                    .await;
                });
            }
        }),
    ))
}

/// 40 clients, one every 100 ms, half streaming; their outcomes.
pub(super) async fn clients(
    r: &Router,
    prefix: &str,
) -> Result<(BTreeMap<String, usize>, Vec<f64>)> {
    let url = format!("{}/v1/chat/completions", r.api);
    let c = client(64);
    let mut tasks = Vec::new();
    for k in 0..40usize {
        let (c, url) = (c.clone(), url.clone());
        let body = chat(&format!("{prefix} {}", words(k * 300, 20)), k % 2 == 0, 4);
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let resp = request(&c, "POST", &url, Some(&body)).await;
            let outcome = match resp {
                Err(_) => "connection error".to_owned(),
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let (e, _, _) = read_stream(resp.into_body(), Duration::from_secs(900)).await;
                    match (status, e) {
                        (200, Ending::Complete) => "ok".into(),
                        (200, _) if body["stream"] == false => "ok".into(),
                        (200, e) => format!("stream {e:?}"),
                        (s, _) => format!("{s}"),
                    }
                }
            };
            (outcome, started.elapsed().as_secs_f64())
        }));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut outcomes = BTreeMap::new();
    let mut lat = Vec::new();
    for t in tasks {
        let (o, l) = t.await?;
        *outcomes.entry(o).or_default() += 1;
        lat.push(l);
    }
    Ok((outcomes, lat))
}

pub(super) async fn hung(env: &Env, f: &mut Figures) -> Result<()> {
    let mut sims = Vec::new();
    for i in 0..2 {
        sims.push(sim(env, &format!("hung-sim{i}"), true, &[]).await?);
    }
    let (hole, task) = black_hole().await?;
    let mut specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    specs.push(EngineSpec {
        http: hole,
        kv: None,
    });
    let r = router(env, "hung-router", &specs, &[], None, 3).await?;
    let t0 = Instant::now();
    let (outcomes, mut lat) = clients(&r, "").await?;
    let ejected = ejected_since(env, &r, &format!("127.0.0.1:{hole}"), t0).await;
    let m = get_text(&env.c, &format!("{}/metrics", r.admin)).await?;
    f.add(
        "hung (router defaults): requests ok of 40",
        *outcomes.get("ok").unwrap_or(&0) as f64,
        "",
    );
    f.add(
        "hung (router defaults): slowest client",
        lat.iter().copied().fold(0.0, f64::max),
        "s",
    );
    f.add(
        "hung (router defaults): client latency p50",
        median(&mut lat),
        "s",
    );
    f.add(
        "hung (router defaults): requests moved off it when probes found it unreachable",
        counter(&m, "kinference_router_retries_total", &[("reason", "down")]),
        "",
    );
    f.add(
        "hung (router defaults): ejected, s after the clients started",
        ejected,
        "s",
    );
    f.notes.push(format!("hung outcomes: {outcomes:?}"));
    task.abort();
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    Ok(())
}

pub(super) async fn ejected_since(env: &Env, r: &Router, endpoint: &str, t0: Instant) -> f64 {
    let deadline = t0 + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(v) = get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await
            && v["endpoints"].as_array().is_some_and(|a| {
                a.iter()
                    .any(|e| e["endpoint"] == endpoint && e["healthy"] == false)
            })
        {
            return t0.elapsed().as_secs_f64();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f64::NAN
}

pub(super) async fn stalled(env: &Env, f: &mut Figures) -> Result<()> {
    let mut sims = Vec::new();
    for i in 0..3 {
        sims.push(sim(env, &format!("stalled-sim{i}"), true, &[]).await?);
    }
    let specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    let r = router(
        env,
        "stalled-router",
        &specs,
        &["--upstream-timeout", "10s"],
        None,
        3,
    )
    .await?;
    let prefix = words(60_000, 800);
    call(
        &env.c,
        &format!("{}/v1/chat/completions", sims[0].url()),
        &chat(&prefix, false, 1),
    )
    .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    inject(env, &sims[0], &json!({"stall_ms": 600_000})).await?;
    let (outcomes, lat) = clients(&r, &prefix).await?;
    f.add(
        "stalled core (upstream timeout 10 s): requests ok of 40",
        *outcomes.get("ok").unwrap_or(&0) as f64,
        "",
    );
    f.add(
        "stalled core: plain requests answered 504",
        *outcomes.get("504").unwrap_or(&0) as f64,
        "",
    );
    f.add(
        "stalled core: streams cut with an error",
        *outcomes.get("stream Error").unwrap_or(&0) as f64,
        "",
    );
    f.add(
        "stalled core: clients left hanging",
        *outcomes.get("stream Hang").unwrap_or(&0) as f64,
        "",
    );
    f.add(
        "stalled core: slowest client",
        lat.iter().copied().fold(0.0, f64::max),
        "s",
    );
    f.notes.push(format!("stalled outcomes: {outcomes:?}"));
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    Ok(())
}

pub(super) async fn refusing(env: &Env, f: &mut Figures) -> Result<()> {
    let mut sims = Vec::new();
    for i in 0..2 {
        sims.push(sim(env, &format!("refusing-sim{i}"), true, &[]).await?);
    }
    let (bad, task) = refuser().await?;
    let mut specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    specs.push(EngineSpec {
        http: bad,
        kv: None,
    });
    let r = router(env, "refusing-router", &specs, &[], None, 3).await?;
    let url = format!("{}/v1/chat/completions", r.api);
    let mut ok = 0;
    let mut lat = Vec::new();
    for k in 0..100usize {
        let t = Instant::now();
        let (status, _, _) = call(&env.c, &url, &chat(&words(k * 300, 20), false, 2)).await?;
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
        ok += usize::from(status == 200);
    }
    let m = get_text(&env.c, &format!("{}/metrics", r.admin)).await?;
    f.add("refusing (503): requests ok of 100", ok as f64, "");
    f.add(
        "refusing (503): refused by it and retried elsewhere",
        counter(
            &m,
            "kinference_router_retries_total",
            &[("reason", "unavailable")],
        ),
        "",
    );
    f.add("refusing (503): latency p50", median(&mut lat), "ms");
    task.abort();
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    Ok(())
}

pub(super) async fn slow(env: &Env, f: &mut Figures) -> Result<()> {
    let mut sims = vec![sim(env, "slow-sim0", true, &["--slowdown", "10"]).await?];
    for i in 1..3 {
        sims.push(sim(env, &format!("slow-sim{i}"), true, &[]).await?);
    }
    let slow_ep = format!("127.0.0.1:{}", sims[0].http);
    let specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    let r = router(env, "slow-router", &specs, &[], None, 3).await?;
    let url = format!("{}/v1/chat/completions", r.api);
    let c = client(64);
    let sem = Arc::new(tokio::sync::Semaphore::new(6));
    let mut tasks = Vec::new();
    let total = 150usize;
    for k in 0..total {
        let permit = sem.clone().acquire_owned().await?;
        let (c, url) = (c.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let resp = request(&c, "POST", &url, Some(&chat(&words(k * 700, 600), true, 8))).await;
            drop(permit);
            let resp = resp.ok()?;
            let ep = served_by(&resp);
            let (_, ttft, _) = read_stream(resp.into_body(), Duration::from_secs(60)).await;
            Some((ep, ttft?.as_secs_f64() * 1000.0))
        }));
    }
    let mut slow_ttft = Vec::new();
    let mut fast_ttft = Vec::new();
    for t in tasks {
        if let Some((ep, ttft)) = t.await? {
            if ep == slow_ep {
                slow_ttft.push(ttft);
            } else {
                fast_ttft.push(ttft);
            }
        }
    }
    f.add(
        "slow (10×): its share of 150 requests (fair share 33%)",
        slow_ttft.len() as f64 * 100.0 / total as f64,
        "%",
    );
    f.add("slow (10×): TTFT p50 on it", median(&mut slow_ttft), "ms");
    f.add(
        "slow (10×): TTFT p50 on the others",
        median(&mut fast_ttft),
        "ms",
    );
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    Ok(())
}
