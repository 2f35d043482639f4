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

pub(super) use crate::fleet::{EngineSpec, slice_yaml};

/// One engine with its own process (so a scenario can kill it), on free
/// ports, one worker thread.
pub(super) async fn sim(env: &Env, name: &str, replay: bool, extra: &[&str]) -> Result<Sim> {
    let (http, kv) = (free_port()?, free_port()?);
    let mut spec = crate::fleet::Sim::new(1, http, kv)
        .with_args(["--worker-threads", "1"])
        .with_args(extra.iter().copied());
    if replay {
        spec = spec.with_replay(free_port()?);
    }
    let proc = spec
        .start(&env.bin, name, &env.logs.join(format!("{name}.log")))
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
    let mut m = crate::fleet::Manifests::new("test", engines.to_vec());
    m.namespace = namespace.map(str::to_owned);
    m.block_size = BLOCK;
    MODEL.clone_into(&mut m.model);
    m.yaml()
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
    let flags: Vec<String> = flags.iter().map(ToString::to_string).collect();
    let (listen, admin_addr) = (format!("127.0.0.1:{api}"), format!("127.0.0.1:{admin}"));
    let args = match kube {
        None => {
            std::fs::write(dir.join("objects.yaml"), manifests_yaml(engines, None))?;
            crate::fleet::serve_args(&dir, "test", &listen, &admin_addr, &flags)
        }
        Some((pool, _)) => {
            let mut a: Vec<String> = [
                "serve",
                "--pool",
                pool,
                "--listen",
                &listen,
                "--admin-addr",
                &admin_addr,
            ]
            .iter()
            .map(ToString::to_string)
            .collect();
            a.extend(flags);
            a
        }
    };
    let log = env.logs.join(format!("{name}.log"));
    let proc =
        crate::fleet::start_router(&env.bin, name, &args, kube.map_or(&[], |(_, v)| v), &log)?;
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
