//! Command-line arguments (each also read from an environment variable) and
//! the wiring of a running controller.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::{ArgAction, Parser, ValueEnum};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admin::{self, AdminState};
use crate::events::{EventSink, KubeEvents, NoEvents};
use crate::leader::{LeaderError, Leadership, LeaseConfig};
use crate::metrics::Metrics;
use crate::probe::HttpProber;
use crate::reconcile::{Runtime, Seams, Settings};

/// The kinference controller: status and diagnoses for InferenceWorkerSets
/// and InferencePools.
#[derive(Clone, Debug, Parser)]
#[command(name = "kinference-controller", version, about, long_about = None)]
pub struct Args {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "KINFERENCE_NAMESPACE")]
    pub namespace: Option<String>,

    /// How often each worker set's engines are probed (e.g. 30s, 2m, 500ms).
    #[arg(long, env = "KINFERENCE_PROBE_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub probe_interval: Duration,

    /// How long after a worker set's last KV-event window the next starts.
    #[arg(long, env = "KINFERENCE_KV_PROBE_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub kv_probe_interval: Duration,

    /// How long a KV-event window watches one endpoint's events.
    #[arg(long, env = "KINFERENCE_KV_PROBE_WINDOW", default_value = "3s", value_parser = parse_duration)]
    pub kv_probe_window: Duration,

    /// How long one probe request may take.
    #[arg(long, env = "KINFERENCE_PROBE_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub probe_timeout: Duration,

    /// The engines' API key (vLLM's and SGLang's `--api-key`), sent with
    /// every probe (`/v1/models`, `/kv_event_sources`, `/metrics`).
    #[arg(
        long,
        env = "KINFERENCE_ENGINE_API_KEY",
        hide_env_values = true,
        conflicts_with = "engine_api_key_file"
    )]
    pub engine_api_key: Option<String>,

    /// The same, read from a file (a mounted Secret).
    #[arg(long, env = "KINFERENCE_ENGINE_API_KEY_FILE")]
    pub engine_api_key_file: Option<std::path::PathBuf>,

    /// Where to serve /metrics, /healthz and /readyz.
    #[arg(long, env = "KINFERENCE_ADMIN_ADDR", default_value = "0.0.0.0:9090")]
    pub admin_addr: SocketAddr,

    /// Compete for a Lease so that one replica writes status (`false`: lead
    /// from the start; run a single replica then).
    #[arg(long, env = "KINFERENCE_LEADER_ELECTION", default_value_t = true, action = ArgAction::Set)]
    pub leader_election: bool,

    /// Name of the Lease.
    #[arg(
        long,
        env = "KINFERENCE_LEASE_NAME",
        default_value = "kinference-controller"
    )]
    pub lease_name: String,

    /// Namespace of the Lease (the controller's own, from the downward API).
    #[arg(long, env = "POD_NAMESPACE", default_value = "kinference-system")]
    pub lease_namespace: String,

    /// How long the Lease is held without renewal.
    #[arg(long, env = "KINFERENCE_LEASE_DURATION", default_value = "15s", value_parser = parse_duration)]
    pub lease_duration: Duration,

    /// How long before expiry the holder renews it.
    #[arg(long, env = "KINFERENCE_LEASE_GRACE", default_value = "5s", value_parser = parse_duration)]
    pub lease_grace: Duration,

    /// This instance's identity in the Lease and in Events (default: the
    /// host name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,

    /// Publish Kubernetes Events (events.k8s.io/v1) for diagnoses and
    /// rejections.
    #[arg(long, env = "KINFERENCE_EVENTS", default_value_t = true, action = ArgAction::Set)]
    pub events: bool,

    /// Log format.
    #[arg(long, env = "KINFERENCE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Plain)]
    pub log_format: LogFormat,

    /// Log filter (tracing-subscriber's EnvFilter syntax).
    #[arg(long, env = "KINFERENCE_LOG", default_value = "info")]
    pub log: String,
}

/// How logs are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Plain,
    /// One JSON object per line.
    Json,
}

/// Why the controller could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// No usable Kubernetes client configuration.
    #[error("no Kubernetes client configuration (in-cluster or KUBECONFIG)")]
    Client(#[source] kube::Error),
    /// The log filter does not parse.
    #[error("invalid log filter {0:?}")]
    LogFilter(String),
    /// A flag's value is wrong.
    #[error("{0}")]
    Usage(String),
    /// Leader election could not start.
    #[error("leader election")]
    Leader(#[source] LeaderError),
    /// The admin address cannot be bound.
    #[error("binding the admin server to {addr}")]
    Admin {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

pub use kinference_api::duration::parse_duration;

impl Args {
    /// The engines' API key, from the flag or its file.
    ///
    /// # Errors
    /// The file cannot be read.
    pub fn engine_api_key(&self) -> Result<Option<String>, RunError> {
        match (&self.engine_api_key, &self.engine_api_key_file) {
            (Some(k), _) => Ok(Some(k.clone())),
            (None, Some(p)) => std::fs::read_to_string(p).map(Some).map_err(|e| {
                RunError::Usage(format!("--engine-api-key-file {}: {e}", p.display()))
            }),
            (None, None) => Ok(None),
        }
    }
}

/// Resolves when the process is asked to stop (SIGTERM or Ctrl-C).
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM; stopping on Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

impl Args {
    /// Sets up logging as the arguments say.
    ///
    /// # Errors
    /// [`RunError::LogFilter`] for a filter that does not parse.
    pub fn init_tracing(&self) -> Result<(), RunError> {
        let filter = tracing_subscriber::EnvFilter::try_new(&self.log)
            .map_err(|_| RunError::LogFilter(self.log.clone()))?;
        let builder = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(filter);
        // A second initialisation (tests) keeps the first subscriber.
        let _ = match self.log_format {
            LogFormat::Plain => builder.try_init(),
            LogFormat::Json => builder.json().try_init(),
        };
        Ok(())
    }

    fn identity(&self) -> String {
        self.identity
            .clone()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_else(|| format!("kinference-controller-{}", std::process::id()))
    }

    /// Runs the controller until SIGTERM or Ctrl-C, then shuts down
    /// gracefully: running reconciles finish, the Lease is released and the
    /// admin server stops.
    ///
    /// # Errors
    /// [`RunError`] when the client, leader election or admin server cannot
    /// start.
    pub async fn run(self) -> Result<(), RunError> {
        self.init_tracing()?;
        let client = kube::Client::try_default()
            .await
            .map_err(RunError::Client)?;
        let identity = self.identity();
        let leadership = if self.leader_election {
            Leadership::lease(
                client.clone(),
                LeaseConfig {
                    name: self.lease_name.clone(),
                    namespace: self.lease_namespace.clone(),
                    identity: identity.clone(),
                    duration: self.lease_duration,
                    grace: self.lease_grace,
                },
            )
            .await
            .map_err(RunError::Leader)?
        } else {
            Leadership::always()
        };
        let events: Arc<dyn EventSink> = if self.events {
            Arc::new(KubeEvents::new(client.clone(), Some(identity.clone())))
        } else {
            Arc::new(NoEvents)
        };
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let runtime = Runtime::new(
            client,
            Settings {
                namespace: self.namespace.clone(),
                probe_interval: self.probe_interval,
                kv_probe_interval: self.kv_probe_interval,
                ..Settings::default()
            },
            Seams {
                prober: Arc::new(
                    HttpProber::new(self.probe_timeout)
                        .with_kv_window(self.kv_probe_window)
                        .with_api_key(self.engine_api_key()?.as_deref())
                        .map_err(RunError::Usage)?,
                ),
                events,
                leader: leadership.subscribe(),
            },
            metrics,
        );
        let ctx = runtime.context();
        let listener =
            TcpListener::bind(self.admin_addr)
                .await
                .map_err(|source| RunError::Admin {
                    addr: self.admin_addr,
                    source,
                })?;
        tracing::info!(admin = %self.admin_addr, identity = %identity, namespace = ?self.namespace, "starting");

        let shutdown = CancellationToken::new();
        let admin = tokio::spawn(admin::serve(
            listener,
            AdminState::new(Arc::new(registry), ctx.ready()),
            shutdown.clone(),
        ));
        let controllers = tokio::spawn(runtime.run(shutdown.clone()));
        stop_signal().await;
        tracing::info!("stopping: letting running reconciles finish");
        shutdown.cancel();
        if let Err(error) = controllers.await {
            tracing::warn!(%error, "the controllers ended abnormally");
        }
        leadership.release().await;
        match admin.await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "the admin server failed"),
            Err(error) => tracing::warn!(%error, "the admin server ended abnormally"),
        }
        tracing::info!("stopped");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        assert!(parse_duration("soon").unwrap_err().contains("30s"));
        assert!(parse_duration("3 apples").unwrap_err().contains("unknown"));
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn defaults_and_flags() {
        let a = Args::try_parse_from(["kinference-controller"]).expect("defaults parse");
        assert_eq!(a.probe_interval, Duration::from_secs(30));
        assert_eq!(a.kv_probe_interval, Duration::from_secs(60));
        assert_eq!(a.kv_probe_window, Duration::from_secs(3));
        assert!(a.leader_election);
        assert!(a.events);
        assert_eq!(a.namespace, None);
        let a = Args::try_parse_from([
            "kinference-controller",
            "--namespace=llm",
            "--probe-interval=10s",
            "--kv-probe-window=1500ms",
            "--leader-election=false",
            "--events=false",
            "--log-format=json",
        ])
        .expect("flags parse");
        assert_eq!(a.namespace.as_deref(), Some("llm"));
        assert_eq!(a.probe_interval, Duration::from_secs(10));
        assert_eq!(a.kv_probe_window, Duration::from_millis(1500));
        assert!(!a.leader_election);
        assert!(!a.events);
        assert_eq!(a.log_format, LogFormat::Json);
        assert!(Args::try_parse_from(["kinference-controller", "--probe-interval=x"]).is_err());
    }

    #[test]
    fn clap_is_consistent() {
        use clap::CommandFactory;
        Args::command().debug_assert();
    }
}
