//! Simulated engines and a router in front of them: the one place where
//! `demo`, `bench routing`, `bench faults` and `bench proxy` start them.
//!
//! - [`Sim`]: one `kinference-sim` process with N engines (engine i serves
//!   HTTP on `http + i`, publishes KV events on `kv + i`, replays on
//!   `replay + i`); [`Sim::start`] returns once every engine answers
//!   `/health`.
//! - [`Manifests`]: the router's objects for a manifests directory (a pool,
//!   a worker set, optionally a profile, one EndpointSlice per engine).
//! - [`start_router`]: `kinference-router serve …` as a child process;
//!   [`wait_ready`] and [`wait_connected`] for the usual readiness checks.
//!
//! Every process is a [`Proc`]: killed when dropped.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::load;
use crate::procs::{self, Proc};

/// The model name the simulated engines serve unless told otherwise.
pub(crate) const MODEL: &str = "kinference/sim";

/// One `kinference-sim` process's command line.
#[derive(Clone, Debug)]
pub(crate) struct Sim {
    pub engines: usize,
    /// HTTP port of engine 0.
    pub http: u16,
    /// KV-event port of engine 0 (`None`: no KV events).
    pub kv: Option<u16>,
    /// Replay port of engine 0 (`None`: no replay socket).
    pub replay: Option<u16>,
    /// Further flags (step model, capacity, faults, …).
    pub extra: Vec<String>,
}

impl Sim {
    /// `engines` engines from `http`, KV events from `kv`, no replay.
    pub(crate) fn new(engines: usize, http: u16, kv: u16) -> Self {
        Self {
            engines,
            http,
            kv: Some(kv),
            replay: None,
            extra: Vec::new(),
        }
    }

    pub(crate) fn with_replay(mut self, port: u16) -> Self {
        self.replay = Some(port);
        self
    }

    pub(crate) fn with_args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.extra.extend(args.into_iter().map(Into::into));
        self
    }

    /// The command line.
    pub(crate) fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "--engines".into(),
            self.engines.to_string(),
            "--host".into(),
            "127.0.0.1".into(),
            "--port".into(),
            self.http.to_string(),
        ];
        match self.kv {
            Some(kv) => a.extend(["--kv-port".into(), kv.to_string()]),
            None => a.push("--no-kv-events".into()),
        }
        if let Some(r) = self.replay {
            a.extend(["--replay-port".into(), r.to_string()]);
        }
        a.extend(self.extra.iter().cloned());
        a
    }

    /// Engine `i`'s base URL.
    pub(crate) fn url(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.http + i as u16)
    }

    /// Every engine's endpoints, for [`Manifests`].
    pub(crate) fn specs(&self) -> Vec<EngineSpec> {
        (0..self.engines)
            .map(|i| EngineSpec {
                http: self.http + i as u16,
                kv: self.kv.map(|k| k + i as u16),
            })
            .collect()
    }

    /// Starts the process (`bin/kinference-sim`, output to `log`) and waits
    /// until every engine answers `/health`.
    pub(crate) async fn start(&self, bin: &Path, name: &str, log: &Path) -> Result<Proc> {
        let mut proc = Proc::spawn(name, &bin.join("kinference-sim"), &self.args(), log)?;
        for i in 0..self.engines {
            procs::wait_ok(
                &format!("{}/health", self.url(i)),
                Duration::from_secs(30),
                &mut proc,
            )
            .await
            .with_context(|| format!("the simulator did not start; see {}", log.display()))?;
        }
        Ok(proc)
    }
}

/// One engine as the router's manifests list it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct EngineSpec {
    pub http: u16,
    /// The KV-event port (`None`: the slice names no `kv` port).
    pub kv: Option<u16>,
}

/// A manifests directory's objects: pool `pool` with worker set `sim`
/// serving `model` on `engines`, with `profile` (a RoutingProfile's name and
/// its `spec:` body, indented by two spaces) or the built-in `default`.
#[derive(Clone, Debug)]
pub(crate) struct Manifests {
    pub pool: String,
    pub namespace: Option<String>,
    pub profile: Option<(String, String)>,
    pub block_size: u32,
    pub model: String,
    pub engines: Vec<EngineSpec>,
}

impl Manifests {
    pub(crate) fn new(pool: &str, engines: Vec<EngineSpec>) -> Self {
        Self {
            pool: pool.to_owned(),
            namespace: None,
            profile: None,
            block_size: 16,
            model: MODEL.to_owned(),
            engines,
        }
    }

    /// The YAML, objects separated by `---`.
    pub(crate) fn yaml(&self) -> String {
        let ns = self
            .namespace
            .as_ref()
            .map_or(String::new(), |n| format!(", namespace: {n}"));
        let mut y = format!(
            "apiVersion: kinference.buoyant.io/v1alpha1\nkind: InferencePool\nmetadata: {{name: {}{ns}}}\nspec:\n  workerSets: [{{name: sim}}]\n---\n",
            self.pool
        );
        let profile = match &self.profile {
            Some((name, spec)) => {
                let _ = write!(
                    y,
                    "apiVersion: kinference.buoyant.io/v1alpha1\nkind: RoutingProfile\nmetadata: {{name: {name}}}\nspec:\n{spec}---\n"
                );
                name.as_str()
            }
            None => "default",
        };
        let _ = write!(
            y,
            "apiVersion: kinference.buoyant.io/v1alpha1\nkind: InferenceWorkerSet\nmetadata: {{name: sim{ns}}}\nspec:\n  profile: {profile}\n  kvBlockSize: {}\n  serviceRef: {{name: sim, port: http}}\n  kvEvents: {{port: kv}}\n  models:\n    - name: {}\n---\n",
            self.block_size, self.model
        );
        for (i, e) in self.engines.iter().enumerate() {
            y.push_str(&slice_yaml(
                &format!("sim-{i}"),
                *e,
                self.namespace.as_deref(),
            ));
        }
        y
    }
}

/// One engine's EndpointSlice (labelled for Service `sim`).
pub(crate) fn slice_yaml(name: &str, e: EngineSpec, namespace: Option<&str>) -> String {
    let ns = namespace.map_or(String::new(), |n| format!("\n  namespace: {n}"));
    let kv =
        e.kv.map_or(String::new(), |k| format!(", {{name: kv, port: {k}}}"));
    format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}{ns}\n  labels: {{kubernetes.io/service-name: sim}}\naddressType: IPv4\nports: [{{name: http, port: {}}}{kv}]\nendpoints:\n  - addresses: [\"127.0.0.1\"]\n    conditions: {{ready: true}}\n---\n",
        e.http
    )
}

/// `kinference-router serve` on the manifests directory `manifests` for
/// pool `pool`, listening on `listen` (OpenAI API) and `admin`, with more
/// `flags`.
pub(crate) fn serve_args(
    manifests: &Path,
    pool: &str,
    listen: &str,
    admin: &str,
    flags: &[String],
) -> Vec<String> {
    let mut a: Vec<String> = [
        "serve",
        "--manifests",
        &manifests.display().to_string(),
        "--pool",
        pool,
        "--listen",
        listen,
        "--admin-addr",
        admin,
        // The benchmarks read each decision's explanation from its response.
        "--debug-headers",
        "true",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    a.extend(flags.iter().cloned());
    a
}

/// Starts `bin/kinference-router args…` with `env` added, output to `log`.
pub(crate) fn start_router(
    bin: &Path,
    name: &str,
    args: &[String],
    env: &[(&str, String)],
    log: &Path,
) -> Result<Proc> {
    let mut cmd = tokio::process::Command::new(bin.join("kinference-router"));
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Proc::spawn_command(name, cmd, log)
}

/// Waits until the router's `/readyz` on `admin` answers 200.
pub(crate) async fn wait_ready(admin: &str, router: &mut Proc) -> Result<()> {
    procs::wait_ok(
        &format!("http://{admin}/readyz"),
        Duration::from_secs(30),
        router,
    )
    .await
    .context("the router did not become ready")
}

/// Waits until the router sees `engines` endpoints with KV streams
/// connected and the local tokenizer checked (or none to check: `engine`
/// and `approximate` tokenization).
pub(crate) async fn wait_connected(admin: &str, engines: usize, router: &mut Proc) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        router.check_running()?;
        if let Ok((200, body)) = load::get(&format!("http://{admin}/debug/endpoints")).await {
            let v: serde_json::Value = serde_json::from_slice(&body)?;
            let eps = v["endpoints"].as_array().cloned().unwrap_or_default();
            let tokenizer = &v["worker_sets"][0]["tokenizer"]["state"];
            let tokenizer_ready = tokenizer == "checked" || tokenizer == "not_local";
            if eps.len() == engines
                && tokenizer_ready
                && eps.iter().all(|e| {
                    e["kv"]
                        .as_array()
                        .is_some_and(|k| k.iter().all(|s| s["connected"] == true) && !k.is_empty())
                })
            {
                return Ok(());
            }
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the router did not connect to every engine's KV events within 30 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifests_list_every_engine_with_the_profile() {
        let sim = Sim::new(3, 19000, 19100);
        let mut m = Manifests::new("bench", sim.specs());
        m.profile = Some(("p".into(), "  latency: {calibrate: true}\n".into()));
        let y = m.yaml();
        assert_eq!(y.matches("kind: EndpointSlice").count(), 3);
        assert!(y.contains("port: 19002}, {name: kv, port: 19102}"), "{y}");
        assert!(y.contains("metadata: {name: p}\nspec:\n  latency"), "{y}");
        assert!(y.contains("profile: p\n"), "{y}");
        let plain = Manifests::new("t", vec![EngineSpec { http: 1, kv: None }]).yaml();
        assert!(plain.contains("profile: default") && !plain.contains("name: kv"));
    }

    #[test]
    fn sim_args_name_ports_and_extras() {
        let s = Sim::new(2, 100, 200)
            .with_replay(300)
            .with_args(["--slowdown", "3"]);
        let a = s.args().join(" ");
        assert_eq!(
            a,
            "--engines 2 --host 127.0.0.1 --port 100 --kv-port 200 --replay-port 300 --slowdown 3"
        );
        assert_eq!(s.url(1), "http://127.0.0.1:101");
    }
}
