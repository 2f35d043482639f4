//! Command-line interface: `serve`, `tokenize`, `events decode|watch`.

use std::io::Read as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::builder::TypedValueParser as _;
use clap::{Args as ClapArgs, Parser, Subcommand, ValueEnum};
use kinference_scoring::PolicyName;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::catalog::{Catalog, PoolRef};
use crate::config::{Config, ProbeIntervals, defaults, parse_duration};
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
    /// What to log: a level (`info`) or per-module directives
    /// (`info,kinference_router=debug`), as `RUST_LOG` takes them.
    #[arg(long, global = true, env = "KINFERENCE_LOG", default_value = "info")]
    pub log: String,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
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

fn policy_names() -> Vec<&'static str> {
    PolicyName::ALL.iter().map(|p| p.as_str()).collect()
}

fn parse_policy(s: &str) -> Result<PolicyName, String> {
    s.parse()
        .map_err(|e: kinference_scoring::UnknownPolicy| e.to_string())
}

/// `serve`.
#[derive(ClapArgs, Debug, Clone)]
pub struct ServeArgs {
    /// The InferencePool to serve: NAME or NAMESPACE/NAME (namespace
    /// `default` when omitted). Not needed with `--engine`.
    #[arg(long, env = "KINFERENCE_POOL", required_unless_present = "engine")]
    pub pool: Option<String>,
    /// Read the pool's objects from this directory of YAML files (reloaded on
    /// change) instead of watching Kubernetes.
    #[arg(long, env = "KINFERENCE_MANIFESTS", conflicts_with = "engine")]
    pub manifests: Option<PathBuf>,
    /// Quick start without any YAML or cluster: route to these engines'
    /// OpenAI APIs (repeat the flag, e.g. `--engine http://10.0.0.5:8000`).
    /// Their models are discovered; their KV events are read from
    /// `/kv_event_sources` (vLLM ≥ 0.31), SGLang's `/server_info`, or
    /// `--kv-port`.
    #[arg(long, value_name = "URL")]
    pub engine: Vec<String>,
    /// With `--engine`: the engines' KV-event port when they do not say
    /// (vLLM's and SGLang's default is 5557).
    #[arg(long, requires = "engine", default_value_t = 5557)]
    pub kv_port: u16,
    /// With `--engine`: the width of the engines' KV-event blocks.
    #[arg(long, requires = "engine", default_value_t = 16)]
    pub kv_block_size: u32,
    /// Address of the OpenAI API.
    #[arg(long, env = "KINFERENCE_LISTEN", default_value = "0.0.0.0:8080")]
    pub listen: SocketAddr,
    /// Address of metrics, health and debug pages.
    #[arg(long, env = "KINFERENCE_ADMIN_ADDR", default_value = "0.0.0.0:9090")]
    pub admin_addr: SocketAddr,
    /// Routing policy: kinference (ours), or a baseline for comparisons.
    #[arg(long, env = "KINFERENCE_POLICY", default_value = "kinference",
          value_parser = clap::builder::PossibleValuesParser::new(policy_names()).map(|s: String| parse_policy(&s).expect("listed")))]
    pub policy: PolicyName,
    /// Longest wait for a request's token ids before routing on load alone.
    #[arg(long, env = "KINFERENCE_TOKENIZE_TIMEOUT", default_value = defaults::TOKENIZE_TIMEOUT, value_parser = parse_duration)]
    pub tokenize_timeout: Duration,
    /// Request bodies up to this many bytes are tokenized in place; larger
    /// ones on the blocking pool, under the tokenize timeout.
    #[arg(long, env = "KINFERENCE_TOKENIZE_INLINE_BYTES", default_value_t = defaults::TOKENIZE_INLINE_BYTES)]
    pub tokenize_inline_bytes: usize,
    /// Largest request body, bytes.
    #[arg(long, env = "KINFERENCE_BODY_LIMIT", default_value_t = defaults::BODY_LIMIT)]
    pub body_limit: usize,
    /// Longest wait for an engine's response headers, and between two
    /// chunks of a streamed response.
    #[arg(long, env = "KINFERENCE_UPSTREAM_TIMEOUT", default_value = defaults::UPSTREAM_TIMEOUT, value_parser = parse_duration)]
    pub upstream_timeout: Duration,
    /// When neither the engines nor `kvEvents.replayPort` say where replay
    /// is: the KV-event port plus this (0: no replay).
    #[arg(long, env = "KINFERENCE_KV_REPLAY_OFFSET", default_value_t = defaults::KV_REPLAY_OFFSET)]
    pub kv_replay_offset: u16,
    /// Between /health and /metrics probes of each engine.
    #[arg(long, env = "KINFERENCE_SCRAPE_INTERVAL", default_value = defaults::SCRAPE_INTERVAL, value_parser = parse_duration)]
    pub scrape_interval: Duration,
    /// Prompt tokens of the two one-token requests sent to each engine as
    /// it joins, before it takes any request: their first tokens tell the
    /// latency model how fast it is (an engine far slower than the others
    /// is then predicted so from its first request). 0: no probes.
    #[arg(long, env = "KINFERENCE_SPEED_PROBE_TOKENS", default_value_t = defaults::SPEED_PROBE_TOKENS)]
    pub speed_probe_tokens: u32,
    /// Between /v1/models and /version calls to each engine.
    #[arg(long, env = "KINFERENCE_DISCOVERY_INTERVAL", default_value = defaults::DISCOVERY_INTERVAL, value_parser = parse_duration)]
    pub discovery_interval: Duration,
    /// Time requests in flight get to finish at shutdown (long generations
    /// take minutes).
    #[arg(long, env = "KINFERENCE_DRAIN", default_value = defaults::DRAIN, value_parser = parse_duration)]
    pub drain: Duration,
    /// Seed of the tie-breaking random source.
    #[arg(long, env = "KINFERENCE_SEED", default_value_t = defaults::SEED)]
    pub seed: u64,
    /// Most (block, worker) entries the KV index holds (24 bytes each);
    /// past it the least recently stored chain tails go first. Default:
    /// half the container's memory limit, or 50 000 000 without one.
    #[arg(long, env = "KINFERENCE_KV_INDEX_MAX_ENTRIES")]
    pub kv_index_max_entries: Option<u64>,
    /// Longest wait for a request's headers.
    #[arg(long, env = "KINFERENCE_HEADER_READ_TIMEOUT", default_value = defaults::HEADER_READ_TIMEOUT, value_parser = parse_duration)]
    pub header_read_timeout: Duration,
    /// Longest wait for a request's body.
    #[arg(long, env = "KINFERENCE_BODY_READ_TIMEOUT", default_value = defaults::BODY_READ_TIMEOUT, value_parser = parse_duration)]
    pub body_read_timeout: Duration,
    /// Most client connections served at once (more wait to be accepted).
    #[arg(long, env = "KINFERENCE_MAX_CONNECTIONS", default_value_t = defaults::MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Let clients ask for the routing decision with `x-kinference-debug`
    /// (it names endpoints, their addresses and load: off by default).
    #[arg(long, env = "KINFERENCE_DEBUG_HEADERS", default_value_t = defaults::DEBUG_HEADERS, action = clap::ArgAction::Set)]
    pub debug_headers: bool,
    /// Log one line per request (id, model, worker set, engine, status,
    /// tokens, TTFT, duration; never the prompt) at target
    /// `kinference::access`, whatever `--log` says for the rest.
    #[arg(long, env = "KINFERENCE_ACCESS_LOG")]
    pub access_log: bool,
    /// Require clients to present one of the API keys in this file (one
    /// per line, `#` comments; re-read when it changes), as `Authorization:
    /// Bearer KEY` or `x-api-key: KEY`. `/health` and `/ready` stay open.
    /// A key may be followed by `tenant=NAME` and `priority=N`: its
    /// requests' tenant and highest priority in admission.
    #[arg(long, env = "KINFERENCE_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// The engines' API key (vLLM's and SGLang's `--api-key`): sent with
    /// requests, probes, discovery and tokenization.
    #[arg(
        long,
        env = "KINFERENCE_ENGINE_API_KEY",
        hide_env_values = true,
        conflicts_with = "engine_api_key_file"
    )]
    pub engine_api_key: Option<String>,
    /// The same, read from a file (a mounted Secret).
    #[arg(long, env = "KINFERENCE_ENGINE_API_KEY_FILE")]
    pub engine_api_key_file: Option<PathBuf>,
    /// Serve the OpenAI API over TLS with this PEM certificate chain (with
    /// `--tls-key-file`).
    #[arg(long, env = "KINFERENCE_TLS_CERT_FILE", requires = "tls_key_file")]
    pub tls_cert_file: Option<PathBuf>,
    /// The PEM private key of `--tls-cert-file`.
    #[arg(long, env = "KINFERENCE_TLS_KEY_FILE", requires = "tls_cert_file")]
    pub tls_key_file: Option<PathBuf>,
    /// Export traces over OTLP/HTTP to this collector (a base URL such as
    /// `http://otel-collector:4318`; `/v1/traces` is appended).
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (a full URL) and
    /// `OTEL_EXPORTER_OTLP_PROTOCOL` (`http/protobuf`, `http/json`) are read
    /// as the OpenTelemetry spec says.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Share load with the other replicas of this router: the ready pods of
    /// this Service (in the router's namespace, `POD_NAMESPACE`), reached
    /// at this replica's admin port. The chart sets it.
    #[arg(long, env = "KINFERENCE_PEER_SERVICE", conflicts_with = "peers")]
    pub peer_service: Option<String>,
    /// Share load with these replicas' admin addresses (host:port, comma
    /// separated or repeated), e.g. outside Kubernetes.
    #[arg(long, env = "KINFERENCE_PEERS", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// Between polls of a peer that does not long-poll (an older release),
    /// between retries of an unreachable one, and between checks of the
    /// peer list. Peers of this release answer as soon as their load
    /// changes (and at least every half `--peer-staleness`).
    #[arg(long, env = "KINFERENCE_PEER_INTERVAL", default_value = "200ms", value_parser = parse_duration)]
    pub peer_interval: Duration,
    /// A peer's report older than this counts for nothing.
    #[arg(long, env = "KINFERENCE_PEER_STALENESS", default_value = "1s", value_parser = parse_duration)]
    pub peer_staleness: Duration,
    /// A shared secret (a mounted Secret) that replicas present to each
    /// other; without it, load reports are served to anyone who reaches
    /// the admin port.
    #[arg(long, env = "KINFERENCE_PEER_TOKEN_FILE")]
    pub peer_token_file: Option<PathBuf>,
    /// How long a starting replica waits for a peer's KV index snapshot
    /// (reporting not ready meanwhile) before it serves without one; 0:
    /// never asks.
    #[arg(long, env = "KINFERENCE_PEER_BOOTSTRAP_TIMEOUT", default_value = defaults::PEER_BOOTSTRAP_TIMEOUT, value_parser = parse_duration)]
    pub peer_bootstrap_timeout: Duration,
    /// The largest KV index snapshot this replica sends a peer or accepts
    /// from one, in bytes.
    #[arg(long, env = "KINFERENCE_PEER_SNAPSHOT_MAX_BYTES", default_value_t = defaults::PEER_SNAPSHOT_MAX_BYTES)]
    pub peer_snapshot_max_bytes: usize,
    /// Share of traces kept when the client sends none (a sampled client
    /// trace is always followed).
    #[arg(long, env = "OTEL_TRACES_SAMPLER_ARG", default_value_t = 1.0)]
    pub trace_sample_ratio: f64,
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
        let mut directives = self.log.clone();
        let mut otlp = None;
        if let Command::Serve(a) = &self.command {
            if a.access_log {
                directives.push_str(",kinference::access=info");
            }
            otlp =
                crate::telemetry::Otlp::resolve(a.otlp_endpoint.as_deref(), a.trace_sample_ratio)
                    .map_err(Error::Usage)?;
        }
        // Request spans are for the trace exporter only: the log layer never
        // records them (so that without an exporter they are never built).
        let off = format!(",{}=off", crate::telemetry::SPAN_TARGET);
        let filter = tracing_subscriber::EnvFilter::try_new(format!("{directives}{off}"))
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("info{off}")));
        // Flushes the traces when the command returns.
        let _telemetry =
            crate::telemetry::init(self.log_format == LogFormat::Json, filter, otlp.as_ref())
                .map_err(Error::Usage)?;
        if let Some(o) = &otlp {
            tracing::info!(endpoint = %o.endpoint, json = o.json, "exporting traces");
        }
        match self.command {
            Command::Serve(a) => serve(*a).await,
            Command::Tokenize(a) => tokenize(&a),
            Command::Events { command } => events(command).await,
        }
    }
}

impl ServeArgs {
    /// The router settings these flags give.
    ///
    /// # Errors
    /// An unknown policy name.
    pub fn config(&self) -> Result<Config, Error> {
        let positive = |d: Duration, what: &str| {
            if d.is_zero() {
                Err(Error::Usage(format!("{what} must be longer than 0")))
            } else {
                Ok(d)
            }
        };
        Ok(Config {
            drain: self.drain,
            policy: self.policy,
            body_limit: self.body_limit,
            tokenize_timeout: self.tokenize_timeout,
            tokenize_inline_bytes: self.tokenize_inline_bytes,
            upstream_timeout: positive(self.upstream_timeout, "--upstream-timeout")?,
            probes: ProbeIntervals {
                models: positive(self.discovery_interval, "--discovery-interval")?,
                metrics: positive(self.scrape_interval, "--scrape-interval")?,
                ..ProbeIntervals::default()
            },
            kv_replay_offset: self.kv_replay_offset,
            speed_probe_tokens: self.speed_probe_tokens,
            seed: self.seed,
            kv_max_entries: self.kv_index_max_entries.unwrap_or_else(|| {
                crate::config::default_kv_max_entries(crate::config::memory_limit())
            }),
            header_read_timeout: self.header_read_timeout.max(Duration::from_secs(1)),
            body_read_timeout: self.body_read_timeout.max(Duration::from_secs(1)),
            max_connections: self.max_connections.max(1),
            debug_headers: self.debug_headers,
            access_log: self.access_log,
            ..Config::default()
        })
    }
}

impl ServeArgs {
    fn peer_settings(&self) -> Result<Option<crate::peers::Settings>, Error> {
        let source = match (&self.peer_service, self.peers.is_empty()) {
            (Some(name), _) => crate::peers::Source::Service {
                namespace: std::env::var("POD_NAMESPACE").map_err(|_| {
                    Error::Usage("--peer-service needs POD_NAMESPACE (the downward API's metadata.namespace)".into())
                })?,
                name: name.clone(),
                admin_port: self.admin_addr.port(),
            },
            (None, false) => crate::peers::Source::Fixed(self.peers.clone()),
            // A token without peers still guards this replica's reports.
            (None, true) if self.peer_token_file.is_some() => {
                crate::peers::Source::Fixed(Vec::new())
            }
            (None, true) => return Ok(None),
        };
        let token = match &self.peer_token_file {
            Some(p) => {
                let t = std::fs::read_to_string(p)
                    .map_err(|e| Error::Usage(format!("--peer-token-file {}: {e}", p.display())))?;
                let mut v =
                    http::HeaderValue::from_str(&format!("Bearer {}", t.trim())).map_err(|_| {
                        Error::Usage("the peer token has characters a header cannot carry".into())
                    })?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        Ok(Some(crate::peers::Settings {
            source,
            interval: self.peer_interval.max(Duration::from_millis(10)),
            staleness: self.peer_staleness,
            token,
            bootstrap_timeout: self.peer_bootstrap_timeout,
            snapshot_max_bytes: self.peer_snapshot_max_bytes.max(1024),
        }))
    }

    /// Reads the API keys, the engines' key and the TLS certificate the
    /// flags name.
    ///
    /// # Errors
    /// A file that cannot be read or parsed.
    pub fn security(&self) -> Result<crate::config::Security, Error> {
        let usage = |e: &dyn std::fmt::Display| Error::Usage(e.to_string());
        let client_keys = match &self.api_keys_file {
            Some(p) => Some(Arc::new(crate::auth::ClientKeys::load(p).map_err(|e| {
                Error::Usage(format!(
                    "--api-keys-file: {}",
                    crate::probe::error_chain(&e)
                ))
            })?)),
            None => None,
        };
        let engine_key = match (&self.engine_api_key, &self.engine_api_key_file) {
            (Some(k), _) => Some(k.clone()),
            (None, Some(p)) => Some(std::fs::read_to_string(p).map_err(|e| {
                Error::Usage(format!("--engine-api-key-file {}: {e}", p.display()))
            })?),
            (None, None) => None,
        };
        let engine_auth = match engine_key.filter(|k| !k.trim().is_empty()) {
            Some(k) => Some(crate::auth::engine_authorization(&k).map_err(|e| usage(&e))?),
            None => None,
        };
        let tls = match (&self.tls_cert_file, &self.tls_key_file) {
            (Some(c), Some(k)) => Some(
                crate::auth::tls_acceptor(c, k)
                    .map_err(|e| Error::Usage(crate::probe::error_chain(&e)))?,
            ),
            _ => None,
        };
        Ok(crate::config::Security {
            client_keys,
            engine_auth,
            tls,
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
    let mut config = args.config()?;
    // Keys and certificates are read when the router starts (the chart
    // check parses the flags without the files).
    config.security = args.security()?;
    config.peers = args.peer_settings()?;
    let pool = PoolRef::parse(args.pool.as_deref().unwrap_or(crate::source::QUICK_POOL))
        .map_err(Error::Usage)?;
    let api = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|source| Error::Bind {
            addr: args.listen,
            source,
        })?;
    let admin = tokio::net::TcpListener::bind(args.admin_addr)
        .await
        .map_err(|source| Error::Bind {
            addr: args.admin_addr,
            source,
        })?;
    let api_addr = api.local_addr().map_err(|source| Error::Bind {
        addr: args.listen,
        source,
    })?;
    let admin_addr = admin.local_addr().map_err(|source| Error::Bind {
        addr: args.admin_addr,
        source,
    })?;
    tracing::info!(%pool, listen = %api_addr, admin = %admin_addr, policy = config.policy.as_str(), "starting");

    let (catalog, snapshots) = Catalog::new(pool);
    let catalog = Arc::new(Mutex::new(catalog));
    let shared = Shared::new(config, stop.clone());
    if let Some(keys) = &shared.config.security.client_keys {
        keys.watch(stop.clone());
    }
    let mut kube_client = None;
    if !args.engine.is_empty() {
        let objects = crate::source::quick_objects(&args.engine, args.kv_port, args.kv_block_size)
            .map_err(Error::Usage)?;
        crate::source::reset_from(&mut *catalog.lock().await, objects);
    } else if let Some(dir) = &args.manifests {
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
        kube_client = Some(client);
    }
    if let Some(p) = shared.config.peers.clone() {
        if matches!(p.source, crate::peers::Source::Service { .. }) && kube_client.is_none() {
            return Err(Error::Usage(
                "--peer-service needs Kubernetes (use --peers ADDR,... with --manifests or --engine)".into(),
            ));
        }
        crate::peers::spawn(shared.clone(), p, kube_client);
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

    fn serve(argv: &[&str]) -> Result<ServeArgs, clap::Error> {
        let a = Args::try_parse_from(["kinference-router", "serve"].iter().chain(argv))?;
        match a.command {
            Command::Serve(s) => Ok(*s),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn flags_and_env() {
        let s = serve(&[
            "--pool",
            "ns/p",
            "--manifests",
            "/m",
            "--policy",
            "round-robin",
        ])
        .unwrap();
        assert_eq!(s.listen.to_string(), "0.0.0.0:8080");
        assert_eq!(s.admin_addr.to_string(), "0.0.0.0:9090");
        let c = s.config().unwrap();
        assert_eq!(c.policy, PolicyName::RoundRobin);
        assert_eq!(c.drain, Duration::from_secs(30));
        assert_eq!(c.upstream_timeout, Duration::from_secs(600));
        assert!(!c.debug_headers);

        // An unknown policy is refused while parsing, naming the choices.
        let e = serve(&["--pool", "p", "--policy", "best"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("best") && e.contains("round-robin"), "{e}");
        // A pool or engines are needed (unless the environment names a pool).
        assert!(serve(&[]).is_err() || std::env::var_os("KINFERENCE_POOL").is_some());
    }

    #[test]
    fn durations_read_as_people_write_them() {
        let s = serve(&[
            "--pool=p",
            "--drain=10m",
            "--tokenize-timeout=1s",
            "--scrape-interval=500ms",
            "--upstream-timeout=1h 30m",
        ])
        .unwrap();
        let c = s.config().unwrap();
        assert_eq!(c.drain, Duration::from_secs(600));
        assert_eq!(c.tokenize_timeout, Duration::from_secs(1));
        assert_eq!(c.probes.metrics, Duration::from_millis(500));
        assert_eq!(c.upstream_timeout, Duration::from_secs(5400));
        let e = serve(&["--pool=p", "--drain=soon"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--drain") && e.contains("30s"), "{e}");
        let zero = serve(&["--pool=p", "--upstream-timeout=0s"]).unwrap();
        assert!(
            zero.config()
                .unwrap_err()
                .to_string()
                .contains("--upstream-timeout")
        );
    }

    #[test]
    fn quick_mode_needs_no_pool() {
        let s = serve(&[
            "--engine",
            "http://127.0.0.1:8000",
            "--engine",
            "http://[::1]:8001",
        ])
        .unwrap();
        assert_eq!(s.pool, None);
        assert_eq!(s.engine.len(), 2);
        assert!(serve(&["--engine", "http://e:1", "--manifests", "/m"]).is_err());
        assert!(
            serve(&["--pool=p", "--kv-port=5558"]).is_err(),
            "--kv-port needs --engine"
        );
    }

    #[test]
    fn clap_is_consistent() {
        use clap::CommandFactory;
        Args::command().debug_assert();
    }
}
