//! What sits between the client and the engines in one run: our router with
//! a policy (tuned, or as installed), a real peer router from PyPI, or the
//! harness routing greedily with the simulators' true state.
//!
//! | name | what runs |
//! |---|---|
//! | `kinference`, `round-robin`, … (every [`PolicyName`]) | `kinference-router --policy NAME`, tuned: the bench's profile (`local` tokenization, the simulator's step costs), 1 s scrapes, KV replay; `llm-d-blend` scrapes every 50 ms as llm-d does; `sglang-cache-aware` routes on the router's record of prefixes it sent (`approximate` mode: SGLang's tree, grown on route) |
//! | `kinference-admission` | ours, tuned, with admission on (`spec.admission: {maxPredictedTtftMillis: 1000, maxWaitMillis: 1000}`): past the knee requests wait in the router or get 429 |
//! | `kinference-installed` | our policy as installed by the chart: the built-in `default` profile (`engine` tokenization), 5 s scrapes, no replay, two replicas sharing their load (`--peers` at the default interval, as the chart's `sharedLoad`), clients spread over them |
//! | `kinference-installed-join` | `kinference-installed` with a third replica started halfway through the measured window (a rollout's new replica: bootstrapping its KV index and taking its peers' learnt step costs) and sent its share once ready |
//! | `smg-cache-aware`, `smg-power-of-two`, `smg-round-robin` | `smg launch --policy …` (PyPI `sglang-router`) |
//! | `vllm-router-cache-aware`, `vllm-router-kv-aware` | `vllm-router --policy …` (PyPI `vllm-router`); `kv_aware` subscribes to the engines' KV events |
//! | `greedy-truth` | the harness itself: per request the engines' true cached prefix and its own exact queue accounting, greedy minimum of predicted TTFT (see [`super::oracle`]); not a bound |
//!
//! | `kinference-x3`, `kinference-x3-blind` | three replicas of the tuned router, clients spread over them request by request (as a Service spreads connections); sharing their load with `--peers` (long polls; `--peer-interval 200ms` for peers that do not long-poll), or each seeing only its own requests |
//! | `kinference-x3-kill` | `kinference-x3`, the third replica killed (SIGKILL) halfway through the measured window; the client leaves out a replica it cannot reach and sends a request that got no response to the next one (as the OpenAI SDK retries a connection error) |
//! | `kinference-x3-join`, `kinference-x3-join-cold` | `kinference-x3` on engines without replay (vLLM's default), the third replica started halfway through the measured window and sent its share once ready: bootstrapping its KV index from a peer's snapshot, or not (`--peer-bootstrap-timeout 0`: its index fills from new events); requests ask for their usage, so each one's cached tokens say how well the replica that routed it did |

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kinference_scoring::PolicyName;

use super::drive::{Replicas, Route};
use super::oracle::Oracle;
use crate::fleet::{self, Manifests};
use crate::procs::Proc;

/// A real peer router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Peer {
    /// `smg launch` from PyPI's `sglang-router`.
    Smg,
    /// `vllm-router` from PyPI's `vllm-router`.
    VllmRouter,
}

impl Peer {
    fn binary(self) -> &'static str {
        match self {
            Self::Smg => "smg",
            Self::VllmRouter => "vllm-router",
        }
    }

    fn package(self) -> &'static str {
        match self {
            Self::Smg => "sglang-router",
            Self::VllmRouter => "vllm-router",
        }
    }
}

/// One row's router.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Contender {
    /// Ours with a policy, tuned.
    Router(PolicyName),
    /// Ours, tuned, with the profile's admission on.
    Admission,
    /// Ours as a user gets it from the chart: [`INSTALLED_REPLICAS`]
    /// replicas sharing their load; with `join`, one more starts halfway
    /// through the measured window (a rollout's or a scale-out's new
    /// replica).
    Installed { join: bool },
    /// Replicas of ours, tuned, sharing their load or not.
    Replicas {
        /// How many.
        n: u32,
        /// With `--peers`.
        shared: bool,
        /// The last replica is killed (SIGKILL) halfway through the
        /// measured window (only with `shared`: the figure is how soon
        /// its peers stop counting it).
        kill: bool,
        /// The last replica starts halfway through the measured window
        /// (only with `shared`, without `kill`).
        join: Option<Join>,
    },
    /// A peer with its policy name as its flags spell it.
    Peer(Peer, &'static str),
    /// The harness with the simulators' truth.
    GreedyTruth,
}

/// How a replica started into a warm fleet gets its KV index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Join {
    /// From a peer's snapshot (the default).
    Bootstrap,
    /// From the engines' new events only (`--peer-bootstrap-timeout 0`).
    Cold,
}

/// Router replicas the chart runs by default (`router.replicas`).
pub(crate) const INSTALLED_REPLICAS: u32 = 2;

/// Whether router replicas share their load.
#[derive(Clone, Copy, Debug)]
enum Sharing {
    /// Each sees only its own requests.
    Blind,
    /// `--peers` with each other, at this `--peer-interval` (`None`: the
    /// router's default).
    Peers { interval: Option<&'static str> },
}

/// The peers' rows: (name, peer, policy flag).
const PEERS: [(&str, Peer, &str); 5] = [
    ("smg-cache-aware", Peer::Smg, "cache_aware"),
    ("smg-power-of-two", Peer::Smg, "power_of_two"),
    ("smg-round-robin", Peer::Smg, "round_robin"),
    ("vllm-router-cache-aware", Peer::VllmRouter, "cache_aware"),
    ("vllm-router-kv-aware", Peer::VllmRouter, "kv_aware"),
];

impl Contender {
    /// Every row's name, ours first, the greedy reference last.
    pub(crate) fn all_names() -> Vec<String> {
        let mut v: Vec<String> = PolicyName::ALL.iter().map(ToString::to_string).collect();
        v.insert(1, "kinference-admission".into());
        v.insert(2, "kinference-installed".into());
        v.insert(3, "kinference-installed-join".into());
        v.insert(4, "kinference-x3".into());
        v.insert(5, "kinference-x3-blind".into());
        v.insert(6, "kinference-x3-kill".into());
        v.insert(7, "kinference-x3-join".into());
        v.insert(8, "kinference-x3-join-cold".into());
        v.extend(PEERS.iter().map(|(n, _, _)| (*n).to_owned()));
        v.push("greedy-truth".into());
        v
    }

    /// Whether a replica of the row starts halfway through the measured
    /// window (a join row).
    pub(crate) fn has_late_replica(&self) -> bool {
        matches!(
            self,
            Self::Replicas { join: Some(_), .. } | Self::Installed { join: true }
        )
    }

    pub(crate) fn parse(name: &str) -> Result<Self> {
        if name == "kinference-installed" {
            return Ok(Self::Installed { join: false });
        }
        if name == "kinference-installed-join" {
            return Ok(Self::Installed { join: true });
        }
        if name == "kinference-admission" {
            return Ok(Self::Admission);
        }
        if name == "greedy-truth" {
            return Ok(Self::GreedyTruth);
        }
        if let Some(rest) = name.strip_prefix("kinference-x") {
            let (rest, kill, join) = if let Some(r) = rest.strip_suffix("-kill") {
                (r, true, None)
            } else if let Some(r) = rest.strip_suffix("-join-cold") {
                (r, false, Some(Join::Cold))
            } else if let Some(r) = rest.strip_suffix("-join") {
                (r, false, Some(Join::Bootstrap))
            } else {
                (rest, false, None)
            };
            let (n, shared) = match rest.strip_suffix("-blind") {
                Some(n) => (n, false),
                None => (rest, true),
            };
            let event = kill || join.is_some();
            if let Ok(n) = n.parse::<u32>()
                && (1..=9).contains(&n)
                && (!event || (shared && n > 1))
            {
                return Ok(Self::Replicas {
                    n,
                    shared,
                    kill,
                    join,
                });
            }
        }
        if let Some((_, peer, policy)) = PEERS.iter().find(|(n, _, _)| *n == name) {
            return Ok(Self::Peer(*peer, policy));
        }
        name.parse::<PolicyName>().map(Self::Router).map_err(|_| {
            anyhow::anyhow!(
                "unknown policy {name:?}; known: {}",
                Self::all_names().join(", ")
            )
        })
    }

    /// Peers whose binary is missing, with the advice to install them.
    pub(crate) fn check_available(&self) -> Result<()> {
        if let Self::Peer(p, _) = self
            && which(p.binary()).is_none()
        {
            bail!(
                "{} not found: python3 -m pip install {} (a prebuilt wheel from PyPI)",
                p.binary(),
                p.package()
            );
        }
        Ok(())
    }
}

/// Our router's flags for a row: the policy, the scrape interval, and the
/// replay offset (the simulator's replay socket is its KV port + 100; 0:
/// none, as installed).
fn router_flags(policy: &str, scrape: &str, replay_offset: u16) -> Vec<String> {
    vec![
        "--policy".to_owned(),
        policy.to_owned(),
        "--scrape-interval".into(),
        scrape.into(),
        "--kv-replay-offset".into(),
        replay_offset.to_string(),
    ]
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.is_file())
}

/// What a run needs to start its contender.
pub(crate) struct Setup<'a> {
    pub bin: &'a Path,
    pub engines: &'a [String],
    /// Engine 0's KV-event port (engine i: + i); its replay port is + 100.
    pub kv_base: u16,
    /// The tuned objects (the bench's profile, local tokenization).
    pub tuned: &'a Manifests,
    pub out: &'a Path,
    pub listen: String,
    pub admin: String,
    pub step: super::oracle::StepModel,
    pub explain: bool,
    pub tag: &'a str,
}

/// The `kinference-admission` row's `spec.admission`: hold a request while
/// every engine is predicted past 1 s, for at most 1 s (a request that
/// waited longer would miss the 2 s goodput target anyway: it gets 429).
pub(crate) const ADMISSION: &str =
    "  admission: {maxPredictedTtftMillis: 1000, maxQueue: 512, maxWaitMillis: 1000}\n";

/// A started contender: where to send requests, and the processes whose
/// CPU counts (none for the harness).
pub(crate) struct Running {
    pub route: Route,
    pub proc: Option<Proc>,
    /// Further router replicas.
    pub more: Vec<Proc>,
    /// Our routers' admin addresses, `proc`'s first (for `/debug/explain`),
    /// then `more`'s (and a replica that joins later, last); none for a
    /// peer or the harness.
    pub admins: Vec<String>,
    /// A replica to start later (join rows).
    pub joiner: Option<Joiner>,
}

/// A router replica not started yet: the last of [`Running::admins`],
/// and of the route's replicas (left out until it is ready).
pub(crate) struct Joiner {
    bin: PathBuf,
    args: Vec<String>,
    log: PathBuf,
    /// Its admin address.
    pub admin: String,
    /// Its index among the route's replicas.
    pub index: usize,
}

impl Joiner {
    /// Starts it and waits until `/readyz` answers 200.
    pub(crate) async fn start(&self) -> Result<Proc> {
        let mut r =
            fleet::start_router(&self.bin, "kinference-router", &self.args, &[], &self.log)?;
        fleet::wait_ready(&self.admin, &mut r).await?;
        Ok(r)
    }
}

impl Contender {
    pub(crate) async fn start(&self, s: &Setup<'_>) -> Result<Running> {
        let logs = s.out.join("logs");
        match self {
            Self::GreedyTruth => Ok(Running {
                route: Route::Oracle(Arc::new(Oracle::new(s.engines.to_vec(), s.step))),
                proc: None,
                more: Vec::new(),
                admins: Vec::new(),
                joiner: None,
            }),
            Self::Router(policy) => {
                let mut m = s.tuned.clone();
                let mut scrape = "1s";
                match policy {
                    PolicyName::LlmdBlend => scrape = "50ms",
                    PolicyName::SglangCacheAware => {
                        if let Some((name, spec)) = &mut m.profile {
                            *name = "bench-approximate".into();
                            *spec = spec.replace("mode: local", "mode: approximate");
                        }
                    }
                    _ => {}
                }
                let flags = router_flags(&policy.to_string(), scrape, 100);
                self.ours(s, &m, &flags, &logs).await
            }
            Self::Admission => {
                let mut m = s.tuned.clone();
                if let Some((name, spec)) = &mut m.profile {
                    *name = "bench-admission".into();
                    spec.push_str(ADMISSION);
                }
                let flags = router_flags("kinference", "1s", 100);
                self.ours(s, &m, &flags, &logs).await
            }
            Self::Installed { join } => {
                let mut m = s.tuned.clone();
                m.profile = None;
                let flags = router_flags("kinference", "5s", 0);
                // The chart's shared load: peers at the router's default
                // interval.
                let sharing = Sharing::Peers { interval: None };
                let (n, join) = if *join {
                    (INSTALLED_REPLICAS + 1, Some(Join::Bootstrap))
                } else {
                    (INSTALLED_REPLICAS, None)
                };
                self.replicas(s, &m, &flags, n, sharing, join, &logs).await
            }
            Self::Replicas {
                n, shared, join, ..
            } => {
                // A join row's engines have no replay, as vLLM's by default:
                // what a late replica knows comes from its peers or new
                // events.
                let replay = if join.is_some() { 0 } else { 100 };
                let flags = router_flags("kinference", "1s", replay);
                let sharing = if *shared {
                    Sharing::Peers {
                        interval: Some("200ms"),
                    }
                } else {
                    Sharing::Blind
                };
                self.replicas(s, s.tuned, &flags, *n, sharing, *join, &logs)
                    .await
            }
            Self::Peer(peer, policy) => {
                let port = s.listen.rsplit(':').next().unwrap_or("0").to_owned();
                let prom: u16 = port.parse::<u16>().unwrap_or(0).saturating_add(2);
                let mut args: Vec<String> = Vec::new();
                if *peer == Peer::Smg {
                    args.push("launch".into());
                }
                args.extend([
                    "--host".into(),
                    "127.0.0.1".into(),
                    "--port".into(),
                    port,
                    "--prometheus-port".into(),
                    prom.to_string(),
                    "--policy".into(),
                    (*policy).to_owned(),
                    "--log-level".into(),
                    if *peer == Peer::Smg {
                        "warn"
                    } else {
                        "warning"
                    }
                    .into(),
                    "--worker-urls".into(),
                ]);
                args.extend(s.engines.iter().cloned());
                if *policy == "kv_aware" {
                    for (i, e) in s.engines.iter().enumerate() {
                        args.push("--kv-event-source".into());
                        args.push(format!("{e}=tcp://127.0.0.1:{}", s.kv_base + i as u16));
                    }
                    args.extend([
                        "--kv-event-block-size".into(),
                        s.tuned.block_size.to_string(),
                        "--kv-event-model".into(),
                        s.tuned.model.clone(),
                    ]);
                }
                let bin = which(peer.binary()).with_context(|| {
                    format!(
                        "{} not found: pip install {}",
                        peer.binary(),
                        peer.package()
                    )
                })?;
                let mut proc = Proc::spawn(
                    peer.binary(),
                    &bin,
                    &args,
                    &logs.join(format!("router-{}.log", s.tag)),
                )?;
                // Ready when it routes a request.
                let probe =
                    serde_json::json!({"model": s.tuned.model, "prompt": "w1", "max_tokens": 1});
                let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
                loop {
                    proc.check_running()?;
                    if let Ok((200, _)) = crate::load::post_json(
                        &format!("http://{}/v1/completions", s.listen),
                        &probe,
                    )
                    .await
                    {
                        break;
                    }
                    if tokio::time::Instant::now() > deadline {
                        bail!("{} did not route a request within 60 s", peer.binary());
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Ok(Running {
                    route: Route::Router(format!("http://{}", s.listen), false),
                    proc: Some(proc),
                    more: Vec::new(),
                    admins: Vec::new(),
                    joiner: None,
                })
            }
        }
    }

    /// `n` routers on `m` with `flags`, on ports 10 apart from the setup's,
    /// sharing their load or not; with `join`, the last is not started
    /// (see [`Running::joiner`]).
    #[allow(clippy::too_many_arguments)]
    async fn replicas(
        &self,
        s: &Setup<'_>,
        m: &Manifests,
        flags: &[String],
        n: u32,
        sharing: Sharing,
        join: Option<Join>,
        logs: &Path,
    ) -> Result<Running> {
        let shift = |addr: &str, by: u16| -> String {
            let (host, port) = addr.rsplit_once(':').unwrap_or((addr, "0"));
            format!("{host}:{}", port.parse::<u16>().unwrap_or(0) + by)
        };
        let listens: Vec<String> = (0..n).map(|i| shift(&s.listen, 10 * i as u16)).collect();
        let admins: Vec<String> = (0..n).map(|i| shift(&s.admin, 10 * i as u16)).collect();
        let dir = s.out.join("manifests").join(s.tag);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("bench.yaml"), m.yaml())?;
        let mut procs = Vec::new();
        let mut joiner = None;
        for i in 0..n as usize {
            let mut flags = flags.to_vec();
            if let Sharing::Peers { interval } = sharing {
                let others: Vec<&str> = admins
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, a)| a.as_str())
                    .collect();
                flags.extend(["--peers".into(), others.join(",")]);
                if let Some(interval) = interval {
                    flags.extend(["--peer-interval".into(), interval.into()]);
                }
            }
            let log = logs.join(format!("router-{}-{i}.log", s.tag));
            if join.is_some() && i + 1 == n as usize {
                if join == Some(Join::Cold) {
                    flags.extend(["--peer-bootstrap-timeout".into(), "0s".into()]);
                }
                joiner = Some(Joiner {
                    bin: s.bin.to_path_buf(),
                    args: fleet::serve_args(&dir, "bench", &listens[i], &admins[i], &flags),
                    log,
                    admin: admins[i].clone(),
                    index: i,
                });
                continue;
            }
            let args = fleet::serve_args(&dir, "bench", &listens[i], &admins[i], &flags);
            let mut r = fleet::start_router(s.bin, "kinference-router", &args, &[], &log)?;
            fleet::wait_ready(&admins[i], &mut r).await?;
            fleet::wait_connected(&admins[i], s.engines.len(), &mut r).await?;
            procs.push(r);
        }
        let mut procs = procs.into_iter();
        let bases = listens.iter().map(|l| format!("http://{l}")).collect();
        let replicas = match &joiner {
            Some(j) => Replicas::joining(bases, j.index),
            None => Replicas::new(bases),
        };
        Ok(Running {
            route: Route::Routers(Arc::new(replicas)),
            proc: procs.next(),
            more: procs.collect(),
            admins,
            joiner,
        })
    }

    async fn ours(
        &self,
        s: &Setup<'_>,
        m: &Manifests,
        flags: &[String],
        logs: &Path,
    ) -> Result<Running> {
        let dir = s.out.join("manifests").join(s.tag);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("bench.yaml"), m.yaml())?;
        let args = fleet::serve_args(&dir, "bench", &s.listen, &s.admin, flags);
        let mut r = fleet::start_router(
            s.bin,
            "kinference-router",
            &args,
            &[],
            &logs.join(format!("router-{}.log", s.tag)),
        )?;
        fleet::wait_ready(&s.admin, &mut r).await?;
        fleet::wait_connected(&s.admin, s.engines.len(), &mut r).await?;
        Ok(Running {
            route: Route::Router(format!("http://{}", s.listen), s.explain),
            proc: Some(r),
            more: Vec::new(),
            admins: vec![s.admin.clone()],
            joiner: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_parses_back() {
        for n in Contender::all_names() {
            let c = Contender::parse(&n).expect("known");
            let back = match &c {
                Contender::Router(p) => p.to_string(),
                Contender::Installed { join: false } => "kinference-installed".into(),
                Contender::Installed { join: true } => "kinference-installed-join".into(),
                Contender::Admission => "kinference-admission".into(),
                Contender::Replicas {
                    n,
                    shared,
                    kill,
                    join,
                } => format!(
                    "kinference-x{n}{}{}{}",
                    if *shared { "" } else { "-blind" },
                    if *kill { "-kill" } else { "" },
                    match join {
                        Some(Join::Bootstrap) => "-join",
                        Some(Join::Cold) => "-join-cold",
                        None => "",
                    }
                ),
                Contender::GreedyTruth => "greedy-truth".into(),
                Contender::Peer(peer, policy) => PEERS
                    .iter()
                    .find(|(_, p, f)| p == peer && f == policy)
                    .map(|(n, _, _)| (*n).to_owned())
                    .expect("listed"),
            };
            assert_eq!(back, n);
        }
        assert!(Contender::parse("oracle").is_err());
    }

    #[test]
    fn a_kill_row_needs_replicas_that_share_their_load() {
        assert!(matches!(
            Contender::parse("kinference-x3-kill"),
            Ok(Contender::Replicas {
                n: 3,
                shared: true,
                kill: true,
                join: None,
            })
        ));
        assert!(matches!(
            Contender::parse("kinference-x3-join-cold"),
            Ok(Contender::Replicas {
                n: 3,
                shared: true,
                kill: false,
                join: Some(Join::Cold),
            })
        ));
        let late = |n: &str| Contender::parse(n).unwrap().has_late_replica();
        assert!(late("kinference-x3-join-cold") && late("kinference-installed-join"));
        assert!(!late("kinference-installed") && !late("kinference-x3-kill"));
        // A late replica needs peers to bootstrap from and to share with.
        assert!(Contender::parse("kinference-x3-blind-join").is_err());
        assert!(Contender::parse("kinference-x1-join").is_err());
        assert!(Contender::parse("kinference-x3-join-kill").is_err());
        // Blind replicas report no peers, so there is nothing to watch;
        // one replica leaves nobody to take over.
        assert!(Contender::parse("kinference-x3-blind-kill").is_err());
        assert!(Contender::parse("kinference-x1-kill").is_err());
    }
}
