//! The router in Kubernetes mode across an API-server restart.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) struct ApiServer {
    pub(super) dir: PathBuf,
    pub(super) shared: PathBuf,
    pub(super) vars: Vec<(&'static str, String)>,
}

impl ApiServer {
    pub(super) fn script(&self, name: &str, keep: bool) -> Result<String> {
        let mut cmd = std::process::Command::new("bash");
        cmd.arg(self.shared.join("k8s").join(name))
            .env("K8S_TEST_DIR", &self.dir)
            .env("K8S_TEST_PORT", "26443")
            .env("K8S_TEST_ETCD_PORT", "22379")
            .env("KUBECONFIG", self.dir.join("kubeconfig"));
        if keep {
            cmd.env("K8S_TEST_KEEP_DATA", "1");
        }
        let out = cmd.output().with_context(|| format!("running {name}"))?;
        if !out.status.success() {
            bail!("{name} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub(super) fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Result<String> {
        use std::io::Write as _;
        let kubectl = self
            .vars
            .iter()
            .find(|(k, _)| *k == "K8S_TEST_KUBECTL")
            .map_or_else(|| "kubectl".to_owned(), |(_, v)| v.clone());
        let mut child = std::process::Command::new(kubectl)
            .args(args)
            .env("KUBECONFIG", self.dir.join("kubeconfig"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        if let (Some(text), Some(mut i)) = (stdin, child.stdin.take()) {
            i.write_all(text.as_bytes())?;
        }
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!(
                "kubectl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        let _ = self.script("stop-apiserver.sh", false);
    }
}

pub(super) async fn k8s(env: &Env, f: &mut Figures) -> Result<()> {
    let shared = std::env::var_os("KINFERENCE_SHARED")
        .map_or_else(|| env.root.join("..").join("shared"), PathBuf::from);
    if !shared.join("k8s/start-apiserver.sh").is_file() {
        bail!(
            "no shared/k8s/start-apiserver.sh at {} (set KINFERENCE_SHARED)",
            shared.display()
        );
    }
    let dir = std::env::temp_dir().join("kinference-faults-k8s");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let mut api = ApiServer {
        dir,
        shared,
        vars: Vec::new(),
    };
    let exports = api.script("start-apiserver.sh", false)?;
    for line in exports.lines() {
        if let Some((k, v)) = line.trim_start_matches("export ").split_once('=') {
            let v = v.trim_matches(['"', '\'']).to_owned();
            if k == "K8S_TEST_KUBECTL" {
                api.vars.push(("K8S_TEST_KUBECTL", v));
            }
        }
    }
    api.kubectl(
        &[
            "apply",
            "--server-side",
            "-f",
            &env.root.join("deploy/crds").display().to_string(),
        ],
        None,
    )?;
    api.kubectl(
        &[
            "wait",
            "--for=condition=Established",
            "crd",
            "--all",
            "--timeout=60s",
        ],
        None,
    )?;
    let mut sims = Vec::new();
    for i in 0..3 {
        sims.push(sim(env, &format!("k8s-sim{i}"), true, &[]).await?);
    }
    let specs: Vec<EngineSpec> = sims.iter().map(Sim::spec).collect();
    api.kubectl(
        &["apply", "-f", "-"],
        Some(&manifests_yaml(&specs[..2], Some("faults"))),
    )?;
    let vars = [(
        "KUBECONFIG",
        api.dir.join("kubeconfig").display().to_string(),
    )];
    let r = router(
        env,
        "k8s-router",
        &specs[..2],
        &[],
        Some(("faults/test", &vars)),
        2,
    )
    .await?;
    let ids = |v: &Value| -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = v["endpoints"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| {
                (
                    e["endpoint"].as_str().unwrap_or_default().to_owned(),
                    e["id"].as_u64().unwrap_or(0),
                )
            })
            .collect();
        out.sort();
        out
    };
    let before = ids(&get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await?);

    // Requests all along.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let (c, url, stop) = (
            client(8),
            format!("{}/v1/chat/completions", r.api),
            stop.clone(),
        );
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0usize, 0usize);
            let mut k = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match call(&c, &url, &chat(&words(k * 50, 20), false, 2)).await {
                    Ok((200, _, _)) => ok += 1,
                    _ => failed += 1,
                }
                k += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (ok, failed)
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    api.script("stop-apiserver.sh", false)?;
    tokio::time::sleep(Duration::from_secs(10)).await;
    api.script("start-apiserver.sh", true)?;
    let back = Instant::now();
    // A change made after the restart: the third engine's slice.
    api.kubectl(
        &["apply", "-f", "-"],
        Some(&slice_yaml("sim-2", specs[2], Some("faults"))),
    )?;
    let mut seen = f64::NAN;
    while back.elapsed() < Duration::from_secs(120) {
        let v = get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await?;
        if v["endpoints"].as_array().is_some_and(|a| a.len() == 3) {
            seen = back.elapsed().as_secs_f64();
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = traffic.await?;
    let after = ids(&get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await?);
    let distinct: HashSet<&String> = after.iter().map(|(e, _)| e).collect();
    let kept = before.iter().all(|b| after.contains(b));
    f.add(
        "k8s restart: requests served while the API server was down and back",
        ok as f64,
        "",
    );
    f.add("k8s restart: requests failed", failed as f64, "");
    f.add(
        "k8s restart: a slice added after the restart is routed, s after the server is back",
        seen,
        "s",
    );
    f.add(
        "k8s restart: endpoints listed after resync (3 engines)",
        after.len() as f64,
        "",
    );
    f.add(
        "k8s restart: duplicate endpoints",
        (after.len() - distinct.len()) as f64,
        "",
    );
    f.add(
        "k8s restart: endpoints that kept their state (id) across the restart, of 2",
        if kept { 2.0 } else { 0.0 },
        "",
    );
    r.proc.stop().await;
    for s in sims {
        s.proc.stop().await;
    }
    drop(api);
    Ok(())
}
