//! The suite's processes: simulated engines, fault injection, routers on a manifests directory or a cluster.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) struct Env {
    pub(super) root: PathBuf,
    pub(super) bin: PathBuf,
    pub(super) logs: PathBuf,
    pub(super) c: HttpClient,
}

pub(super) struct Sim {
    pub(super) proc: Proc,
    pub(super) http: u16,
    pub(super) kv: u16,
}

impl Sim {
    pub(super) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.http)
    }
    pub(super) fn spec(&self) -> EngineSpec {
        EngineSpec {
            http: self.http,
            kv: Some(self.kv),
        }
    }
}

#[derive(Clone, Copy)]
pub(super) struct EngineSpec {
    pub(super) http: u16,
    pub(super) kv: Option<u16>,
}

pub(super) async fn sim(env: &Env, name: &str, replay: bool, extra: &[&str]) -> Result<Sim> {
    let (http, kv) = (free_port()?, free_port()?);
    let mut args: Vec<String> = [
        "--engines",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        &http.to_string(),
        "--kv-port",
        &kv.to_string(),
        "--worker-threads",
        "1",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    if replay {
        args.push("--replay-port".into());
        args.push(free_port()?.to_string());
    }
    args.extend(extra.iter().map(ToString::to_string));
    let mut proc = Proc::spawn(
        name,
        &env.bin.join("kinference-sim"),
        &args,
        &env.logs.join(format!("{name}.log")),
    )?;
    procs::wait_ok(
        &format!("http://127.0.0.1:{http}/health"),
        Duration::from_secs(30),
        &mut proc,
    )
    .await?;
    Ok(Sim { proc, http, kv })
}

pub(super) async fn inject(env: &Env, sim: &Sim, faults: &Value) -> Result<()> {
    let (status, _, body) = call(&env.c, &format!("{}/admin/faults", sim.url()), faults).await?;
    if status != 200 {
        bail!(
            "fault injection: {status} {}",
            String::from_utf8_lossy(&body)
        );
    }
    Ok(())
}

pub(super) fn manifests_yaml(engines: &[EngineSpec], namespace: Option<&str>) -> String {
    let ns = namespace.map_or(String::new(), |n| format!(", namespace: {n}"));
    let mut y = format!(
        "apiVersion: kinference.buoyant.io/v1alpha1\nkind: InferencePool\nmetadata: {{name: test{ns}}}\nspec:\n  workerSets: [{{name: sim}}]\n---\napiVersion: kinference.buoyant.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: sim{ns}}}\nspec:\n  profile: default\n  kvBlockSize: {BLOCK}\n  serviceRef: {{name: sim, port: http}}\n  kvEvents: {{port: kv}}\n  models:\n    - name: {MODEL}\n---\n"
    );
    for (i, e) in engines.iter().enumerate() {
        y.push_str(&slice_yaml(&format!("sim-{i}"), *e, namespace));
    }
    y
}

pub(super) fn slice_yaml(name: &str, e: EngineSpec, namespace: Option<&str>) -> String {
    let ns = namespace.map_or(String::new(), |n| format!("\n  namespace: {n}"));
    let kv =
        e.kv.map_or(String::new(), |k| format!(", {{name: kv, port: {k}}}"));
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}{ns}\n  labels: {{kubernetes.io/service-name: sim}}\naddressType: IPv4\nports: [{{name: http, port: {}}}{kv}]\nendpoints:\n  - addresses: [\"127.0.0.1\"]\n    conditions: {{ready: true}}\n---\n",
        e.http
    )
}

pub(super) struct Router {
    pub(super) proc: Proc,
    pub(super) api: String,
    pub(super) admin: String,
    pub(super) _dir: tempdir::Dir,
}

pub(super) mod tempdir {
    /// A directory removed when dropped.
    pub(crate) struct Dir(pub(crate) std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Router {
    pub(super) fn rss_mib(&self) -> f64 {
        let Some(pid) = self.proc.pid() else {
            return f64::NAN;
        };
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map_or(f64::NAN, |kb| kb / 1024.0)
    }
}

/// A router on a manifests directory (or, with `kube`, on a cluster: the
/// environment pairs are passed to it) for `engines`; waits until it sees
/// `expect` endpoints with models.
pub(super) async fn router(
    env: &Env,
    name: &str,
    engines: &[EngineSpec],
    flags: &[&str],
    kube: Option<(&str, &[(&str, String)])>,
    expect: usize,
) -> Result<Router> {
    let dir = std::env::temp_dir().join(format!("kinference-faults-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (api, admin) = (free_port()?, free_port()?);
    let mut args: Vec<String> = vec!["serve".into()];
    match kube {
        None => {
            std::fs::write(dir.join("objects.yaml"), manifests_yaml(engines, None))?;
            args.extend([
                "--pool".into(),
                "test".into(),
                "--manifests".into(),
                dir.display().to_string(),
            ]);
        }
        Some((pool, _)) => args.extend(["--pool".into(), pool.into()]),
    }
    args.extend([
        "--listen".into(),
        format!("127.0.0.1:{api}"),
        "--admin".into(),
        format!("127.0.0.1:{admin}"),
    ]);
    args.extend(flags.iter().map(ToString::to_string));
    let log = env.logs.join(format!("{name}.log"));
    let mut cmd = tokio::process::Command::new(env.bin.join("kinference-router"));
    cmd.args(&args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    if let Some((_, vars)) = kube {
        for (k, v) in vars {
            cmd.env(k, v);
        }
    }
    let proc = Proc::spawn_command(name, cmd, &log)?;
    let r = Router {
        proc,
        api: format!("http://127.0.0.1:{api}"),
        admin: format!("http://127.0.0.1:{admin}"),
        _dir: tempdir::Dir(dir),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(v) = get_json(&env.c, &format!("{}/debug/endpoints", r.admin)).await {
            let eps = v["endpoints"].as_array().cloned().unwrap_or_default();
            let with_models = eps
                .iter()
                .filter(|e| e["models"].as_array().is_some_and(|m| !m.is_empty()))
                .count();
            // Engines without a KV port are stand-ins (a bare TCP listener)
            // that never list models.
            let answering = engines.iter().filter(|e| e.kv.is_some()).count();
            if v["ready"] == true && eps.len() == expect && with_models >= expect.min(answering) {
                return Ok(r);
            }
        }
        if Instant::now() > deadline {
            bail!(
                "{name} did not see its engines within 60 s; see {}",
                log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
