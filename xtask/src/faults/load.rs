//! Held streams and the soak.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) fn in_flight_gauges(metrics: &str) -> f64 {
    counter(metrics, "kinference_router_engine_in_flight_requests", &[])
}

pub(super) async fn load_soak(env: &Env, opts: &Options, f: &mut Figures) -> Result<()> {
    let mut sims = Vec::new();
    for i in 0..4 {
        sims.push(
            sim(
                env,
                &format!("load-sim{i}"),
                true,
                &[
                    "--max-num-seqs",
                    "4096",
                    "--num-gpu-blocks",
                    "131072",
                    "--max-num-batched-tokens",
                    "16384",
                ],
            )
            .await?,
        );
    }
    let specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    let r = router(env, "load-router", &specs, &[], None, 4).await?;
    let c = client(opts.streams);
    let url = format!("{}/v1/chat/completions", r.api);
    let rss_before = r.rss_mib();
    let started = Instant::now();
    let mut rss_after = Vec::new();
    let mut zero_after_ms: f64 = 0.0;
    let (mut total, mut errors, mut held_min) = (0usize, 0usize, usize::MAX);
    let mut peak = 0.0f64;
    let mut round = 0usize;
    loop {
        for s in &sims {
            inject(env, s, &json!({"stall_ms": 600_000})).await?;
        }
        let opened = Arc::new(tokio::sync::Barrier::new(opts.streams + 1));
        let mut tasks = Vec::with_capacity(opts.streams);
        for k in 0..opts.streams {
            let (c, url, opened) = (c.clone(), url.clone(), opened.clone());
            let body = chat(
                &words((round * opts.streams + k) * 7 % 60_000, 24),
                true,
                40,
            );
            tasks.push(tokio::spawn(async move {
                let resp = request(&c, "POST", &url, Some(&body)).await;
                opened.wait().await;
                let resp = resp.ok()?;
                if resp.status() != 200 {
                    return None;
                }
                let (e, _, _) = read_stream(resp.into_body(), Duration::from_secs(120)).await;
                (e == Ending::Complete).then_some(())
            }));
        }
        opened.wait().await;
        let v = get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await?;
        let held: u64 = v["endpoints"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| e["load"]["requests"].as_u64().unwrap_or(0))
            .sum();
        held_min = held_min.min(held as usize);
        peak = peak.max(r.rss_mib());
        for s in &sims {
            inject(env, s, &json!({"stall_ms": 0})).await?;
        }
        for t in tasks {
            total += 1;
            if t.await?.is_none() {
                errors += 1;
            }
        }
        // Accounting back to zero.
        let settle = Instant::now();
        let deadline = settle + Duration::from_secs(30);
        loop {
            let m = get_text(&env.c, &format!("{}/metrics", r.admin)).await?;
            let v = get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await?;
            let load: u64 = v["endpoints"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| e["load"]["requests"].as_u64().unwrap_or(1))
                .sum();
            if load == 0 && in_flight_gauges(&m) == 0.0 {
                zero_after_ms = zero_after_ms.max(settle.elapsed().as_secs_f64() * 1e3);
                break;
            }
            if Instant::now() > deadline {
                bail!("in-flight accounting did not return to zero: {load} requests still counted");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        rss_after.push(r.rss_mib());
        println!(
            "  round {round}: {} streams, {held} held at once, {errors} errors so far, router RSS {:.0} MiB",
            opts.streams,
            rss_after[rss_after.len() - 1]
        );
        round += 1;
        if started.elapsed() >= Duration::from_secs(opts.soak_s) {
            break;
        }
    }
    f.add(
        format!(
            "load: streams held through the router at once (of {})",
            opts.streams
        ),
        held_min as f64,
        "",
    );
    f.add("load: rounds in the soak", round as f64, "");
    f.add("load: requests in the soak", total as f64, "");
    f.add("load: errors in the soak", errors as f64, "");
    f.add("load: router RSS before", rss_before, "MiB");
    f.add("load: router RSS holding the streams (peak)", peak, "MiB");
    f.add("load: router RSS after round 1", rss_after[0], "MiB");
    f.add(
        "load: router RSS after the last round",
        rss_after[rss_after.len() - 1],
        "MiB",
    );
    f.add(
        "load: router RSS, largest after any round",
        rss_after.iter().copied().fold(0.0, f64::max),
        "MiB",
    );
    // A round whose counts do not reach zero within 30 s fails the scenario.
    f.add(
        "load: in-flight counts back to zero after the last stream, at most",
        zero_after_ms,
        "ms",
    );
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    Ok(())
}
