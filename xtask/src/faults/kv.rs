//! KV-event faults, audited block by block against the engines' caches.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) fn prompt(n: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| 100 + n * 1000 + i).collect()
}

/// The keys of everything the engine has cached (its `/debug/cache`).
pub(super) async fn truth_keys(env: &Env, s: &Sim) -> Result<HashSet<u64>> {
    let v = get_json(&env.c, &format!("{}/debug/cache?tokens=1", s.url())).await?;
    let keyer = BlockKeyer::new(BLOCK, None);
    let extra = ExtraKeys::none().digest_for_block(0, BLOCK as usize);
    let mut out = HashSet::new();
    for rank in v["engines"].as_array().into_iter().flatten() {
        let blocks = rank["blocks"].as_array().cloned().unwrap_or_default();
        let by_hash: HashMap<u64, &Value> = blocks
            .iter()
            .filter_map(|b| Some((b["hash"].as_u64()?, b)))
            .collect();
        let mut keys: HashMap<u64, u64> = HashMap::new();
        for b in &blocks {
            let mut path = vec![b];
            let mut prev = keyer.seed();
            let mut ok = true;
            loop {
                let cur = path[path.len() - 1];
                let Some(p) = cur["parent"].as_u64() else {
                    break;
                };
                if let Some(k) = keys.get(&p) {
                    prev = *k;
                    break;
                }
                if let Some(pb) = by_hash.get(&p) {
                    path.push(pb);
                } else {
                    ok = false;
                    break;
                }
            }
            if !ok {
                continue;
            }
            for cur in path.iter().rev() {
                let toks: Vec<u32> = cur["tokens"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|t| t.as_u64().map(|t| t as u32))
                    .collect();
                let k = key::chain(prev, key::local_hash(&toks, extra)).0;
                if let Some(h) = cur["hash"].as_u64() {
                    keys.insert(h, k);
                }
                prev = k;
            }
        }
        out.extend(keys.values());
    }
    Ok(out)
}

pub(super) async fn router_keys(env: &Env, r: &Router, s: &Sim) -> Result<HashSet<u64>> {
    let v = get_json(
        &env.c,
        &format!("{}/debug/kv?endpoint=127.0.0.1:{}", r.admin, s.http),
    )
    .await?;
    Ok(v["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|w| w["keys"].as_array().cloned().unwrap_or_default())
        .filter_map(|k| k.as_u64())
        .collect())
}

#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Audit {
    pub(super) stale: usize,
    pub(super) missing: usize,
    pub(super) truth: usize,
}

pub(super) async fn audit(env: &Env, r: &Router, s: &Sim) -> Result<Audit> {
    let truth = truth_keys(env, s).await?;
    let ours = router_keys(env, r, s).await?;
    Ok(Audit {
        stale: ours.difference(&truth).count(),
        missing: truth.difference(&ours).count(),
        truth: truth.len(),
    })
}

/// Until no stale block and every block of `fresh` the engine holds is
/// known: (time, audit), or the last audit after 30 s.
pub(super) async fn converge(
    env: &Env,
    r: &Router,
    s: &Sim,
    fresh: &[Vec<u32>],
) -> Result<(f64, Audit)> {
    let keyer = BlockKeyer::new(BLOCK, None);
    let fresh_keys: HashSet<u64> = fresh
        .iter()
        .flat_map(|p| keyer.keys(p, &ExtraKeys::none()))
        .map(|k| k.0)
        .collect();
    let t0 = Instant::now();
    loop {
        let truth = truth_keys(env, s).await?;
        let ours = router_keys(env, r, s).await?;
        let a = Audit {
            stale: ours.difference(&truth).count(),
            missing: truth.difference(&ours).count(),
            truth: truth.len(),
        };
        let fresh_ok = fresh_keys
            .iter()
            .filter(|k| truth.contains(k))
            .all(|k| ours.contains(k));
        if a.stale == 0 && fresh_ok {
            return Ok((t0.elapsed().as_secs_f64() * 1000.0, a));
        }
        if t0.elapsed() > Duration::from_secs(30) {
            return Ok((f64::NAN, a));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub(super) async fn send_prompt(env: &Env, r: &Router, ids: &[u32]) -> Result<()> {
    let (status, _, body) = call(
        &env.c,
        &format!("{}/v1/completions", r.api),
        &json!({"model": MODEL, "prompt": ids, "max_tokens": 2}),
    )
    .await?;
    if status != 200 {
        bail!("completion: {status} {}", String::from_utf8_lossy(&body));
    }
    Ok(())
}

pub(super) async fn kv_setup(
    env: &Env,
    name: &str,
    replay: bool,
    extra: &[&str],
) -> Result<(Sim, Router)> {
    // Small engines by default; `extra` may set these itself (the simulator
    // refuses a flag given twice).
    let mut args: Vec<&str> = Vec::new();
    for (flag, value) in [("--num-gpu-blocks", "96"), ("--max-model-len", "1024")] {
        if !extra.contains(&flag) {
            args.extend([flag, value]);
        }
    }
    args.extend_from_slice(extra);
    let s = sim(env, &format!("{name}-sim"), replay, &args).await?;
    let r = router(env, &format!("{name}-router"), &[s.spec()], &[], None, 1).await?;
    // The KV stream connected.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await?;
        if v["endpoints"][0]["kv"][0]["connected"] == true {
            break;
        }
        if Instant::now() > deadline {
            bail!("{name}: KV events never connected");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok((s, r))
}

pub(super) async fn warm(env: &Env, r: &Router, s: &Sim) -> Result<()> {
    for k in 0..12 {
        send_prompt(env, r, &prompt(k, 10)).await?;
    }
    converge(env, r, s, &[]).await?;
    Ok(())
}

pub(super) fn kv_figures(f: &mut Figures, what: &str, converge_ms: f64, a: Audit) {
    f.add(
        format!("kv {what}: stale blocks after recovery"),
        a.stale as f64,
        "",
    );
    f.add(
        format!("kv {what}: converged, ms after the last request"),
        converge_ms,
        "ms",
    );
    f.add(
        format!("kv {what}: share of the engine's blocks the router knows"),
        if a.truth == 0 {
            f64::NAN
        } else {
            100.0 * (a.truth - a.missing) as f64 / a.truth as f64
        },
        "%",
    );
}

pub(super) async fn kv(env: &Env, f: &mut Figures) -> Result<()> {
    // A publisher down 3 s (its events lost) after a short history, back
    // counting from 0.
    {
        let (s, r) = kv_setup(env, "kv-restart", true, &[]).await?;
        send_prompt(env, &r, &prompt(0, 10)).await?;
        converge(env, &r, &s, &[]).await?;
        let fault = json!({"restart_publisher": true, "restart_down_ms": 3000});
        let restart = inject(env, &s, &fault);
        let traffic = async {
            for k in 100..160 {
                send_prompt(env, &r, &prompt(k, 10)).await?;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok::<_, anyhow::Error>(())
        };
        let (a, b) = tokio::join!(restart, traffic);
        a?;
        b?;
        let fresh: Vec<Vec<u32>> = (200..203).map(|k| prompt(k, 10)).collect();
        for p in &fresh {
            send_prompt(env, &r, p).await?;
        }
        let (t, a) = converge(env, &r, &s, &fresh).await?;
        kv_figures(f, "publisher restart (3 s down)", t, a);
        r.proc.stop().await;
        s.proc.stop().await;
    }
    // Gaps: three batches withheld, with and without a replay socket.
    for replay in [true, false] {
        let name = if replay {
            "gap, replayed"
        } else {
            "gap, no replay socket"
        };
        let (s, r) = kv_setup(env, "kv-gap", replay, &[]).await?;
        warm(env, &r, &s).await?;
        inject(env, &s, &json!({"drop_batches": 3})).await?;
        let fresh: Vec<Vec<u32>> = (300..306).map(|k| prompt(k, 10)).collect();
        for p in &fresh {
            send_prompt(env, &r, p).await?;
        }
        let (t, a) = converge(env, &r, &s, &fresh[3..]).await?;
        kv_figures(f, name, t, a);
        r.proc.stop().await;
        s.proc.stop().await;
    }
    // A stalled publisher: 40 batches withheld while the engine works.
    {
        let (s, r) = kv_setup(env, "kv-stall", true, &[]).await?;
        warm(env, &r, &s).await?;
        inject(env, &s, &json!({"drop_batches": 40})).await?;
        let mut max_stale = 0;
        let mut k = 500;
        loop {
            send_prompt(env, &r, &prompt(k, 10)).await?;
            k += 1;
            max_stale = max_stale.max(audit(env, &r, &s).await?.stale);
            let v = get_json(&env.c, &format!("{}/debug/cache?summary=1", s.url())).await?;
            if v["engines"][0]["publisher"]["drop_pending"] == 0 || k > 700 {
                break;
            }
        }
        let fresh: Vec<Vec<u32>> = (k..k + 2).map(|k| prompt(k, 10)).collect();
        for p in &fresh {
            send_prompt(env, &r, p).await?;
        }
        let (t, a) = converge(env, &r, &s, &fresh).await?;
        kv_figures(f, "stalled publisher (40 batches)", t, a);
        f.add(
            "kv stalled publisher: stale blocks at worst during the stall",
            max_stale as f64,
            "",
        );
        r.proc.stop().await;
        s.proc.stop().await;
    }
    // The last request's batches withheld, then the engine idle.
    {
        let (s, r) = kv_setup(env, "kv-tail", true, &[]).await?;
        warm(env, &r, &s).await?;
        let seq = |v: &Value| {
            v["engines"][0]["publisher"]["next_seq"]
                .as_u64()
                .unwrap_or(0)
        };
        let s0 = seq(&get_json(&env.c, &format!("{}/debug/cache?summary=1", s.url())).await?);
        send_prompt(env, &r, &prompt(399, 10)).await?;
        let n = seq(&get_json(&env.c, &format!("{}/debug/cache?summary=1", s.url())).await?) - s0;
        converge(env, &r, &s, &[]).await?;
        inject(env, &s, &json!({"drop_batches": n})).await?;
        send_prompt(env, &r, &prompt(400, 10)).await?;
        let idle = audit(env, &r, &s).await?;
        let (t, a) = converge(env, &r, &s, &[prompt(400, 10)]).await?;
        f.add(
            "kv last batches missed, engine idle: stale blocks right after",
            idle.stale as f64,
            "",
        );
        kv_figures(f, "last batches missed, engine idle", t, a);
        r.proc.stop().await;
        s.proc.stop().await;
    }
    // A flood: 120 concurrent long prompts through a small cache, every 7th
    // batch dropped (replayed).
    {
        let (s, r) = kv_setup(
            env,
            "kv-flood",
            true,
            &[
                "--num-gpu-blocks",
                "256",
                "--max-model-len",
                "2048",
                "--drop-every",
                "7",
            ],
        )
        .await?;
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for k in 0..120u32 {
            let (c, url) = (env.c.clone(), format!("{}/v1/completions", r.api));
            tasks.push(tokio::spawn(async move {
                call(
                    &c,
                    &url,
                    &json!({"model": MODEL, "prompt": prompt(k, 40), "max_tokens": 1}),
                )
                .await
                .map(|(s, _, _)| s)
            }));
        }
        let mut failed = 0;
        for t in tasks {
            if t.await?? != 200 {
                failed += 1;
            }
        }
        let took = t0.elapsed().as_secs_f64();
        let fresh = vec![prompt(1000, 10)];
        send_prompt(env, &r, &fresh[0]).await?;
        let (t, a) = converge(env, &r, &s, &fresh).await?;
        let v = get_json(&env.c, &format!("{}/debug/cache?summary=1", s.url())).await?;
        let c = &v["engines"][0]["counters"];
        f.add(
            "kv flood: events (blocks stored + removed) per second",
            (c["blocks_stored"].as_f64().unwrap_or(0.0)
                + c["blocks_removed"].as_f64().unwrap_or(0.0))
                / took,
            "/s",
        );
        f.add("kv flood: failed requests", f64::from(failed), "");
        kv_figures(f, "flood", t, a);
        r.proc.stop().await;
        s.proc.stop().await;
    }
    Ok(())
}
