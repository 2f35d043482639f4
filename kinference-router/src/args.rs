//! Command-line interface: `serve`, `tokenize`, `events decode|watch`.

use std::io::Read as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args as ClapArgs, Parser, Subcommand, ValueEnum};
use kinference_scoring::PolicyName;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::catalog::{Catalog, PoolRef};
use crate::config::{Config, ProbeIntervals, defaults};
use crate::state::Shared;

/// The kinference router.
#[derive(Parser, Debug)]
#[command(
    name = "kinference-router",
    version,
    about = "OpenAI-compatible, KV-cache-aware router for vLLM and SGLang fleets"
)]
pub struct Args {
    /// Log format.
    #[arg(
        long,
        global = true,
        value_enum,
        default_value = "plain",
        env = "KINFERENCE_LOG_FORMAT"
    )]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log formats.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Plain,
    /// One JSON object per line.
    Json,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Route requests for one InferencePool.
    Serve(Box<ServeArgs>),
    /// Print the token ids the engine would compute for a request body.
    Tokenize(TokenizeArgs),
    /// Read KV events.
    Events {
        /// What to read.
        #[command(subcommand)]
        command: EventsCommand,
    },
}

/// `serve`.
#[derive(ClapArgs, Debug, Clone)]
pub struct ServeArgs {
    /// The InferencePool to serve: NAME or NAMESPACE/NAME (namespace `default` when omitted).
    #[arg(long, env = "KINFERENCE_POOL")]
    pub pool: String,
    /// Read the pool's objects from this directory of YAML files (reloaded on
    /// change) instead of watching Kubernetes.
    #[arg(long, env = "KINFERENCE_MANIFESTS")]
    pub manifests: Option<PathBuf>,
    /// Address of the OpenAI API.
    #[arg(long, env = "KINFERENCE_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// Address of metrics, health and debug pages.
    #[arg(long, env = "KINFERENCE_ADMIN", default_value = "0.0.0.0:9090")]
    pub admin: SocketAddr,
    /// Routing policy: kinference (ours), or a baseline for comparisons:
    /// round-robin, least-inflight, llm-d-blend, llm-d-default, dynamo-cost,
    /// sglang-cache-aware.
    #[arg(long, env = "KINFERENCE_POLICY", default_value = "kinference")]
    pub policy: String,
    /// Longest wait for a request's token ids before routing on load alone.
    #[arg(long, env = "KINFERENCE_TOKENIZE_TIMEOUT_MS", default_value_t = defaults::TOKENIZE_TIMEOUT.as_millis() as u64)]
    pub tokenize_timeout_ms: u64,
    /// Request bodies up to this many bytes are tokenized in place; larger
    /// ones on the blocking pool, under the tokenize timeout.
    #[arg(long, env = "KINFERENCE_TOKENIZE_INLINE_BYTES", default_value_t = defaults::TOKENIZE_INLINE_BYTES)]
    pub tokenize_inline_bytes: usize,
    /// Largest request body, bytes.
    #[arg(long, env = "KINFERENCE_BODY_LIMIT", default_value_t = defaults::BODY_LIMIT)]
    pub body_limit: usize,
    /// Longest wait for an engine's response headers, and between two
    /// chunks of a streamed response, seconds.
    #[arg(long, env = "KINFERENCE_UPSTREAM_TIMEOUT_S", default_value_t = defaults::UPSTREAM_TIMEOUT.as_secs())]
    pub upstream_timeout_s: u64,
    /// The replay port is the KV-event port plus this (0: no replay).
    #[arg(long, env = "KINFERENCE_KV_REPLAY_OFFSET", default_value_t = defaults::KV_REPLAY_OFFSET)]
    pub kv_replay_offset: u16,
    /// Seconds between /metrics scrapes of each engine.
    #[arg(long, env = "KINFERENCE_SCRAPE_INTERVAL_S", default_value_t = defaults::SCRAPE_INTERVAL.as_secs_f64())]
    pub scrape_interval_s: f64,
    /// Seconds between /v1/models calls to each engine.
    #[arg(long, env = "KINFERENCE_DISCOVERY_INTERVAL_S", default_value_t = defaults::DISCOVERY_INTERVAL.as_secs_f64())]
    pub discovery_interval_s: f64,
    /// Seconds to let requests in flight finish at shutdown.
    #[arg(long, env = "KINFERENCE_DRAIN_S", default_value_t = defaults::DRAIN.as_secs())]
    pub drain_s: u64,
    /// Seed of the tie-breaking random source.
    #[arg(long, env = "KINFERENCE_SEED", default_value_t = defaults::SEED)]
    pub seed: u64,
    /// Most (block, worker) entries the KV index holds (24 bytes each);
    /// past it the least recently stored chain tails go first. Default:
    /// half the container's memory limit, or 50 000 000 without one.
    #[arg(long, env = "KINFERENCE_KV_INDEX_MAX_ENTRIES")]
    pub kv_index_max_entries: Option<u64>,
    /// Longest wait for a request's headers, seconds.
    #[arg(long, env = "KINFERENCE_HEADER_READ_TIMEOUT_S", default_value_t = defaults::HEADER_READ_TIMEOUT.as_secs())]
    pub header_read_timeout_s: u64,
    /// Longest wait for a request's body, seconds.
    #[arg(long, env = "KINFERENCE_BODY_READ_TIMEOUT_S", default_value_t = defaults::BODY_READ_TIMEOUT.as_secs())]
    pub body_read_timeout_s: u64,
    /// Most client connections served at once (more wait to be accepted).
    #[arg(long, env = "KINFERENCE_MAX_CONNECTIONS", default_value_t = defaults::MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Let clients ask for the routing decision with `x-kinference-debug`
    /// (it names endpoints and their load).
    #[arg(long, env = "KINFERENCE_DEBUG_HEADERS", default_value_t = defaults::DEBUG_HEADERS, action = clap::ArgAction::Set)]
    pub debug_headers: bool,
}

/// `tokenize`.
#[derive(ClapArgs, Debug)]
pub struct TokenizeArgs {
    /// Directory holding tokenizer.json and tokenizer_config.json.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// The request body (JSON); `-` reads standard input.
    #[arg(long)]
    pub request: String,
}

/// `events`.
#[derive(Subcommand, Debug)]
pub enum EventsCommand {
    /// Decode a `.msgpack` payload or a `.frames` capture as JSON lines.
    Decode {
        /// The file.
        file: PathBuf,
    },
    /// Tail a live engine's KV events as JSON lines.
    Watch {
        /// The PUB endpoint, e.g. tcp://10.0.3.7:5557.
        endpoint: String,
        /// The replay ROUTER endpoint, used to fill gaps.
        #[arg(long)]
        replay: Option<String>,
        /// Topic prefix to subscribe to.
        #[arg(long, default_value = "")]
        topic: String,
    },
}

/// Errors of the commands.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A flag's value is wrong.
    #[error("{0}")]
    Usage(String),
    /// A listener could not be bound.
    #[error("binding {addr}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The manifests directory could not be loaded.
    #[error(transparent)]
    Manifests(#[from] crate::source::ManifestsError),
    /// No Kubernetes client could be made.
    #[error("connecting to Kubernetes (use --manifests DIR to run without a cluster)")]
    Kube(#[source] kube::Error),
    /// Reading or writing a file.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// Tokenizing.
    #[error(transparent)]
    Tokenize(#[from] kinference_tokenize::Error),
    /// Loading a tokenizer.
    #[error(transparent)]
    TokenizerLoad(#[from] kinference_tokenize::LoadError),
    /// Decoding events.
    #[error("decoding {0}")]
    Decode(String),
}

impl Args {
    /// Sets up logging and runs the command.
    ///
    /// # Errors
    /// What the command fails with.
    pub async fn run(self) -> Result<(), Error> {
        init_logging(self.log_format);
        match self.command {
            Command::Serve(a) => serve(*a).await,
            Command::Tokenize(a) => tokenize(&a),
            Command::Events { command } => events(command).await,
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Plain => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

impl ServeArgs {
    /// The router settings these flags give.
    ///
    /// # Errors
    /// An unknown policy name.
    pub fn config(&self) -> Result<Config, Error> {
        let policy: PolicyName = self
            .policy
            .parse()
            .map_err(|e: kinference_scoring::UnknownPolicy| Error::Usage(e.to_string()))?;
        let secs = |s: f64, what: &str| {
            if s.is_finite() && s > 0.0 {
                Ok(Duration::from_secs_f64(s))
            } else {
                Err(Error::Usage(format!(
                    "{what} must be a positive number of seconds"
                )))
            }
        };
        Ok(Config {
            drain: Duration::from_secs(self.drain_s),
            policy,
            body_limit: self.body_limit,
            tokenize_timeout: Duration::from_millis(self.tokenize_timeout_ms),
            tokenize_inline_bytes: self.tokenize_inline_bytes,
            upstream_timeout: Duration::from_secs(self.upstream_timeout_s),
            probes: ProbeIntervals {
                models: secs(self.discovery_interval_s, "--discovery-interval-s")?,
                metrics: secs(self.scrape_interval_s, "--scrape-interval-s")?,
                ..ProbeIntervals::default()
            },
            kv_replay_offset: self.kv_replay_offset,
            seed: self.seed,
            kv_max_entries: self.kv_index_max_entries.unwrap_or_else(|| {
                crate::config::default_kv_max_entries(crate::config::memory_limit())
            }),
            header_read_timeout: Duration::from_secs(self.header_read_timeout_s.max(1)),
            body_read_timeout: Duration::from_secs(self.body_read_timeout_s.max(1)),
            max_connections: self.max_connections.max(1),
            debug_headers: self.debug_headers,
            ..Config::default()
        })
    }
}

/// A router started in this process.
#[derive(Debug)]
pub struct Running {
    /// Where the OpenAI API listens.
    pub api_addr: SocketAddr,
    /// Where the admin port listens.
    pub admin_addr: SocketAddr,
    /// The router's state (for tests and embedding).
    pub shared: Arc<Shared>,
    /// The catalog, fed by the source.
    pub catalog: Arc<Mutex<Catalog>>,
    /// Ends when the router has stopped (after `stop` is cancelled).
    pub task: tokio::task::JoinHandle<()>,
}

/// Starts a router: binds its ports, loads its source, and serves until
/// `stop` is cancelled.
///
/// # Errors
/// Bad flags, ports in use, an unreadable manifests directory, no cluster.
pub async fn start(args: ServeArgs, stop: CancellationToken) -> Result<Running, Error> {
    let config = args.config()?;
    let pool = PoolRef::parse(&args.pool).map_err(Error::Usage)?;
    let api = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|source| Error::Bind {
            addr: args.listen,
            source,
        })?;
    let admin = tokio::net::TcpListener::bind(args.admin)
        .await
        .map_err(|source| Error::Bind {
            addr: args.admin,
            source,
        })?;
    let api_addr = api.local_addr().map_err(|source| Error::Bind {
        addr: args.listen,
        source,
    })?;
    let admin_addr = admin.local_addr().map_err(|source| Error::Bind {
        addr: args.admin,
        source,
    })?;
    tracing::info!(%pool, listen = %api_addr, admin = %admin_addr, policy = config.policy.as_str(), "starting");

    let (catalog, snapshots) = Catalog::new(pool);
    let catalog = Arc::new(Mutex::new(catalog));
    let shared = Shared::new(config, stop.clone());
    if let Some(dir) = &args.manifests {
        crate::source::watch_manifests(
            dir.clone(),
            catalog.clone(),
            Duration::from_millis(500),
            stop.clone(),
        )
        .await?;
    } else {
        let client = kube::Client::try_default().await.map_err(Error::Kube)?;
        crate::source::watch_kubernetes(&client, &catalog, &stop);
    }
    tokio::spawn(crate::maintain::maintain(shared.clone(), snapshots));
    tokio::spawn(crate::admin::run(shared.clone(), admin));
    let drain = shared.config.drain;
    let s = shared.clone();
    let task = tokio::spawn(async move {
        crate::serve::run(s, api, drain).await;
        tracing::info!("stopped");
    });
    Ok(Running {
        api_addr,
        admin_addr,
        shared,
        catalog,
        task,
    })
}

async fn serve(args: ServeArgs) -> Result<(), Error> {
    let stop = CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutting down");
        s.cancel();
    });
    let running = start(args, stop).await?;
    let _ = running.task.await;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        else {
            let _ = ctrl_c.await;
            return;
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

fn tokenize(a: &TokenizeArgs) -> Result<(), Error> {
    let tokenizer = kinference_tokenize::ModelTokenizer::from_dir(&a.tokenizer)?;
    let mut body = Vec::new();
    if a.request == "-" {
        std::io::stdin()
            .read_to_end(&mut body)
            .map_err(|source| Error::Io {
                what: "reading the request from standard input".into(),
                source,
            })?;
    } else {
        body = std::fs::read(&a.request).map_err(|source| Error::Io {
            what: format!("reading {}", a.request),
            source,
        })?;
    }
    let t = tokenizer.tokenize_bytes(None, &body)?;
    let ids = if t.token_ids.len() == 1 {
        serde_json::json!(t.token_ids[0])
    } else {
        serde_json::json!(t.token_ids)
    };
    println!(
        "{}",
        serde_json::json!({"prompt": t.prompt, "token_ids": ids})
    );
    Ok(())
}

/// Prints every batch it is given, as JSON lines.
#[derive(Debug)]
struct Printer {
    name: String,
}

impl kinference_kvindex::sub::EventSink for Printer {
    fn apply(&self, _worker: kinference_kvindex::WorkerId, batch: &kinference_kvindex::EventBatch) {
        print!(
            "{}",
            kinference_kvindex::dump::batch_lines(batch, Some(&self.name), None)
        );
    }
    fn clear(&self, _worker: kinference_kvindex::WorkerId) {
        println!(
            "{}",
            serde_json::json!({"worker": self.name, "type": "StreamReset"})
        );
    }
    fn view(&self, _worker: kinference_kvindex::WorkerId) -> (u64, Vec<(u32, u32)>) {
        (0, Vec::new())
    }
}

async fn events(command: EventsCommand) -> Result<(), Error> {
    match command {
        EventsCommand::Decode { file } => {
            let bytes = std::fs::read(&file).map_err(|source| Error::Io {
                what: format!("reading {}", file.display()),
                source,
            })?;
            let out = crate::events::decode_file(&file, &bytes).map_err(Error::Decode)?;
            print!("{out}");
            Ok(())
        }
        EventsCommand::Watch {
            endpoint,
            replay,
            topic,
        } => {
            let mut cfg =
                kinference_kvindex::sub::SubscriberConfig::new(endpoint.clone()).with_topic(topic);
            if let Some(r) = replay {
                cfg = cfg.with_replay(r);
            }
            let sink = Arc::new(Printer { name: endpoint });
            let handle = kinference_kvindex::sub::spawn(cfg, kinference_kvindex::WorkerId(0), sink);
            shutdown_signal().await;
            drop(handle);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_and_env() {
        let a = Args::try_parse_from([
            "kinference-router",
            "serve",
            "--pool",
            "ns/p",
            "--manifests",
            "/m",
            "--policy",
            "round-robin",
        ])
        .unwrap();
        let Command::Serve(s) = a.command else {
            panic!()
        };
        assert_eq!(s.listen.to_string(), "0.0.0.0:8080");
        assert_eq!(s.admin.to_string(), "0.0.0.0:9090");
        let c = s.config().unwrap();
        assert_eq!(c.policy, PolicyName::RoundRobin);

        let a = Args::try_parse_from([
            "kinference-router",
            "serve",
            "--pool",
            "p",
            "--policy",
            "best",
        ])
        .unwrap();
        let Command::Serve(s) = a.command else {
            panic!()
        };
        assert!(s.config().unwrap_err().to_string().contains("best"));
        assert!(
            Args::try_parse_from(["kinference-router", "serve"]).is_err()
                || std::env::var_os("KINFERENCE_POOL").is_some()
        );
    }
}
