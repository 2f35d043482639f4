//! Probing a worker set's engines: what they serve and what they publish.
//!
//! Two probes, both behind the [`Prober`] seam:
//!
//! - **Models** ([`Prober::probe_models`]): every ready endpoint is asked
//!   `GET /v1/models` (the OpenAI model list as vLLM serves it). One request
//!   per endpoint, bounded by the probe timeout; the reconciler awaits it, at
//!   most once per probe interval (sooner when the endpoints change).
//! - **KV events** ([`Prober::probe_kv`]), when `kvEvents` is set: one ready
//!   endpoint with the KV port ([`ProbeTarget::kv_target`]) is watched for a
//!   window (`--kv-probe-window`, 3 s by default). The publishers are found
//!   through the engine's `GET /kv_event_sources` (vLLM ≥ 0.31: every DP
//!   rank) or, when it does not answer, on `kvEvents.port` (rank 0); each is
//!   checked with a TCP connect and then subscribed to with
//!   kinference-kvindex's ZeroMQ subscriber, which records the batches and
//!   the block widths of `BlockStored` events. `GET /metrics` before and
//!   after the window tells how much the engine computed meanwhile
//!   ([`EngineActivity`]), so that "no events" can be told apart from "no
//!   traffic". A window takes seconds, so it runs off the reconcile path
//!   ([`crate::kvwatch`]).
//!
//! Results are plain data ([`ProbeResult`], [`KvObservation`]); diagnoses
//! are made from them by pure functions ([`crate::diagnose`]). A window that
//! saw neither events nor enough traffic to expect any is *idle* and tells
//! nothing: [`KvObservation::merge`] keeps the previous verdict then, so
//! diagnoses do not come and go with bursty traffic.
//!
//! Cost of a KV window: one HTTP request for the sources, two `/metrics`
//! reads, one TCP connect and one SUB socket per publisher for the window;
//! memory is the set of block widths seen (events are decoded and dropped).

mod engine;
mod kv;

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::{self, StreamExt};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub use engine::{
    EngineActivity, EngineCounters, KvSource, ModelCard, parse_engine_counters,
    parse_kv_event_sources, parse_models,
};

use crate::endpoints::{ReadyEndpoint, http_authority};

/// What to probe for one worker set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeTarget {
    /// `namespace/name` of the worker set, for logs.
    pub worker_set: String,
    /// Its ready, routable endpoints.
    pub endpoints: Vec<ReadyEndpoint>,
    /// Whether `kvEvents` is set.
    pub kv_events: bool,
    /// `kvBlockSize`, for probes that compare it.
    pub kv_block_size: u32,
}

impl ProbeTarget {
    /// The endpoint whose KV events are watched: the first ready endpoint
    /// (in address order) with the KV port; `None` when `kvEvents` is unset
    /// or no ready endpoint has the port.
    pub fn kv_target(&self) -> Option<KvTarget> {
        if !self.kv_events {
            return None;
        }
        self.endpoints.iter().find_map(|e| {
            e.kv_port.map(|kv_port| KvTarget {
                worker_set: self.worker_set.clone(),
                address: e.address.clone(),
                http_port: e.http_port,
                kv_port,
            })
        })
    }
}

/// One endpoint whose KV events are watched.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KvTarget {
    /// `namespace/name` of the worker set, for logs.
    pub worker_set: String,
    /// The endpoint's address.
    pub address: String,
    /// Its OpenAI API port (`/kv_event_sources`, `/metrics`).
    pub http_port: u16,
    /// Its `kvEvents.port`, used when the engine does not list its sources.
    pub kv_port: u16,
}

/// One round of probing a worker set.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ProbeResult {
    /// `GET /v1/models` of each probed endpoint, sorted by endpoint.
    pub models: Vec<EndpointModels>,
    /// The KV-event stream.
    pub kv: KvProbe,
}

/// `GET /v1/models` of one endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointModels {
    /// `host:port`.
    pub endpoint: String,
    /// The model cards, or why there are none.
    pub outcome: Result<Vec<ModelCard>, ProbeFailure>,
}

/// Why an endpoint gave no answer. The texts are stable for equal causes,
/// so an unchanged failure does not change status.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProbeFailure {
    /// No connection (refused, unreachable, ...).
    #[error("cannot connect: {0}")]
    Connect(String),
    /// No complete answer within the probe timeout.
    #[error("no answer within the probe timeout")]
    Timeout,
    /// An HTTP status other than 2xx.
    #[error("HTTP status {0}")]
    Status(u16),
    /// A body that is not what was asked for (an OpenAI model list, a
    /// source list).
    #[error("an unexpected body: {0}")]
    Body(String),
}

/// The KV-event stream of a worker set.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum KvProbe {
    /// `kvEvents` is unset: there is nothing to probe.
    #[default]
    NotConfigured,
    /// `kvEvents` is set but nothing is known yet: the first window is
    /// still running, or no ready endpoint has the KV port (a rejection or
    /// `KvPortMissing` says so). No diagnosis is made from this.
    NotProbed,
    /// What the windows watched so far say (see [`KvObservation::merge`]).
    Observed(KvObservation),
}

/// What watching one endpoint's KV events saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvObservation {
    /// A publisher could not be subscribed to.
    Closed {
        /// `host:port` of the publisher.
        endpoint: String,
        /// Why, in words (stable for equal causes).
        error: String,
    },
    /// Subscribed for a window.
    Subscribed(KvWindow),
}

/// One subscription window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvWindow {
    /// `host:port` of each publisher watched (one per DP rank).
    pub publishers: Vec<String>,
    /// Whether they came from the engine's `/kv_event_sources` (else:
    /// `kvEvents.port`, rank 0 only).
    pub discovered: bool,
    /// How long the window lasted, in milliseconds.
    pub window_ms: u64,
    /// Event batches received.
    pub batches: u64,
    /// Block widths seen in `BlockStored` events (placeholders of width 0
    /// left out), over every KV-cache group.
    pub block_sizes: BTreeSet<u32>,
    /// What the engine did meanwhile, from its `/metrics` (of the ranks
    /// watched); `None` when unknown.
    pub activity: Option<EngineActivity>,
}

/// Blocks' worth of computed tokens an engine must have computed in a
/// window before "no events" becomes a verdict.
pub const VERDICT_BLOCKS: u64 = 4;

impl KvWindow {
    /// The computed tokens that make "no events" a verdict:
    /// [`VERDICT_BLOCKS`] blocks of the widest of `kvBlockSize` and the
    /// engine's `--block-size`.
    pub fn verdict_tokens(&self, kv_block_size: u32) -> u64 {
        let engine = self.activity.and_then(|a| a.engine_block_size).unwrap_or(0);
        VERDICT_BLOCKS * u64::from(kv_block_size.max(engine).max(1))
    }

    /// Whether the engine served requests and computed enough tokens in the
    /// window that an engine publishing events would have published some.
    pub fn saw_traffic(&self, kv_block_size: u32) -> bool {
        self.activity.is_some_and(|a| {
            a.requests > 0 && a.tokens_computed >= self.verdict_tokens(kv_block_size)
        })
    }

    /// Neither events nor enough traffic: the window tells nothing.
    pub fn is_idle(&self, kv_block_size: u32) -> bool {
        self.batches == 0 && !self.saw_traffic(kv_block_size)
    }

    /// The window's length for messages: `3 s`, `1.5 s`.
    pub fn window_text(&self) -> String {
        if self.window_ms.is_multiple_of(1000) {
            format!("{} s", self.window_ms / 1000)
        } else {
            format!(
                "{}.{} s",
                self.window_ms / 1000,
                (self.window_ms % 1000) / 100
            )
        }
    }
}

impl KvObservation {
    /// What to keep after a new window, given what was kept before.
    ///
    /// - A closed publisher replaces anything.
    /// - An idle window ([`KvWindow::is_idle`]) keeps the previous window's
    ///   findings: quiet traffic proves nothing either way.
    /// - A window with events but no `BlockStored` (only removals) keeps the
    ///   block widths seen before.
    /// - Otherwise the new window replaces the old.
    #[must_use]
    pub fn merge(
        previous: Option<KvObservation>,
        new: KvObservation,
        kv_block_size: u32,
    ) -> KvObservation {
        match (previous, new) {
            (Some(KvObservation::Subscribed(p)), KvObservation::Subscribed(w)) => {
                if w.is_idle(kv_block_size) {
                    KvObservation::Subscribed(p)
                } else if w.batches > 0 && w.block_sizes.is_empty() {
                    KvObservation::Subscribed(KvWindow {
                        block_sizes: p.block_sizes,
                        ..w
                    })
                } else {
                    KvObservation::Subscribed(w)
                }
            }
            (_, new) => new,
        }
    }
}

/// Probes a worker set's engines. Implementations never fail: what went
/// wrong is part of the result, so it can become a diagnosis.
pub trait Prober: Send + Sync + 'static {
    /// Asks every endpoint of `target` which models it serves; quick (one
    /// request each, bounded by a timeout). Sorted by endpoint.
    fn probe_models<'a>(&'a self, target: &'a ProbeTarget) -> BoxFuture<'a, Vec<EndpointModels>>;

    /// Watches one endpoint's KV events for a window; takes about the
    /// window, so callers run it in the background.
    fn probe_kv<'a>(&'a self, target: &'a KvTarget) -> BoxFuture<'a, KvObservation>;
}

/// The largest model list or source list read (vLLM's model list is a few
/// hundred bytes per model).
const MAX_BODY: usize = 1 << 20;
/// The largest `/metrics` page read (vLLM's is tens of kB per DP rank).
const MAX_METRICS_BODY: usize = 16 << 20;
/// How many endpoints of one worker set are asked at once.
const CONCURRENCY: usize = 16;
/// The default KV window.
pub const DEFAULT_KV_WINDOW: Duration = Duration::from_secs(3);

/// The real prober: HTTP/1.1 (hyper) for `/v1/models`,
/// `/kv_event_sources` and `/metrics`; ZeroMQ for KV events.
#[derive(Clone, Debug)]
pub struct HttpProber {
    client: Client<HttpConnector, Empty<Bytes>>,
    timeout: Duration,
    kv_window: Duration,
    /// `Authorization` for engines started with `--api-key`.
    auth: Option<http::HeaderValue>,
}

impl HttpProber {
    /// A prober whose every request (connect, headers and body) must finish
    /// within `timeout`, watching KV events for [`DEFAULT_KV_WINDOW`].
    pub fn new(timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(1)
            .build(connector);
        Self {
            client,
            timeout,
            kv_window: DEFAULT_KV_WINDOW,
            auth: None,
        }
    }

    /// The same prober sending the engines' API key (`None`: none).
    ///
    /// # Errors
    /// A key that a header cannot carry.
    pub fn with_api_key(mut self, key: Option<&str>) -> Result<Self, String> {
        self.auth = match key.map(str::trim).filter(|k| !k.is_empty()) {
            Some(k) => {
                let mut v = http::HeaderValue::from_str(&format!("Bearer {k}")).map_err(|_| {
                    "the engine API key has characters a header cannot carry".to_owned()
                })?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        Ok(self)
    }

    /// The same prober watching KV events for `window`.
    #[must_use]
    pub fn with_kv_window(mut self, window: Duration) -> Self {
        self.kv_window = window;
        self
    }

    /// The KV window.
    pub fn kv_window(&self) -> Duration {
        self.kv_window
    }

    /// The per-request timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// `GET http://{authority}/v1/models`.
    ///
    /// # Errors
    /// [`ProbeFailure`] when the endpoint cannot be reached in time, answers
    /// with a non-2xx status, or with a body that is not a model list.
    pub async fn models(&self, authority: &str) -> Result<Vec<ModelCard>, ProbeFailure> {
        let body = self.get(authority, "/v1/models", MAX_BODY).await?;
        parse_models(&body)
    }

    /// `GET http://{authority}/kv_event_sources`: the engine's KV-event
    /// publishers (vLLM ≥ 0.31; older engines and SGLang answer 404).
    ///
    /// # Errors
    /// [`ProbeFailure`] as for [`HttpProber::models`].
    pub async fn kv_event_sources(&self, authority: &str) -> Result<Vec<KvSource>, ProbeFailure> {
        let body = self.get(authority, "/kv_event_sources", MAX_BODY).await?;
        parse_kv_event_sources(&body)
    }

    /// `GET http://{authority}/metrics`, read for the DP ranks in `ranks`
    /// (`None`: all).
    ///
    /// # Errors
    /// [`ProbeFailure`] as for [`HttpProber::models`].
    pub async fn engine_counters(
        &self,
        authority: &str,
        ranks: Option<&BTreeSet<u32>>,
    ) -> Result<EngineCounters, ProbeFailure> {
        let body = self.get(authority, "/metrics", MAX_METRICS_BODY).await?;
        Ok(parse_engine_counters(
            &String::from_utf8_lossy(&body),
            ranks,
        ))
    }

    async fn endpoint_models(&self, endpoint: String) -> EndpointModels {
        let outcome = self.models(&endpoint).await;
        EndpointModels { endpoint, outcome }
    }

    /// A GET whose whole exchange must finish within the timeout.
    async fn get(&self, authority: &str, path: &str, limit: usize) -> Result<Bytes, ProbeFailure> {
        match tokio::time::timeout(self.timeout, self.fetch(authority, path, limit)).await {
            Ok(r) => r,
            Err(_) => Err(ProbeFailure::Timeout),
        }
    }

    async fn fetch(
        &self,
        authority: &str,
        path: &str,
        limit: usize,
    ) -> Result<Bytes, ProbeFailure> {
        let uri: http::Uri = format!("http://{authority}{path}")
            .parse()
            .map_err(|e: http::uri::InvalidUri| ProbeFailure::Connect(e.to_string()))?;
        let mut req =
            http::Request::get(uri).header(http::header::USER_AGENT, "kinference-controller");
        if let Some(a) = &self.auth {
            req = req.header(http::header::AUTHORIZATION, a.clone());
        }
        let req = req
            .body(Empty::new())
            .map_err(|e| ProbeFailure::Connect(e.to_string()))?;
        let resp = self
            .client
            .request(req)
            .await
            .map_err(|e| connect_failure(&e))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(ProbeFailure::Status(status.as_u16()));
        }
        Limited::new(resp.into_body(), limit)
            .collect()
            .await
            .map(http_body_util::Collected::to_bytes)
            .map_err(|e| ProbeFailure::Body(format!("reading the body: {e}")))
    }
}

/// A stable description of a client error: the innermost I/O error's kind
/// when there is one (its text can carry an OS error number).
fn connect_failure(e: &hyper_util::client::legacy::Error) -> ProbeFailure {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return ProbeFailure::Connect(io.kind().to_string());
        }
        source = s.source();
    }
    if e.is_connect() {
        ProbeFailure::Connect("connection failed".to_owned())
    } else {
        ProbeFailure::Connect("the connection closed before an answer".to_owned())
    }
}

impl Prober for HttpProber {
    fn probe_models<'a>(&'a self, target: &'a ProbeTarget) -> BoxFuture<'a, Vec<EndpointModels>> {
        Box::pin(async move {
            let authorities: Vec<String> = target.endpoints.iter().map(http_authority).collect();
            let mut models: Vec<EndpointModels> = stream::iter(authorities)
                .map(|a| self.endpoint_models(a))
                .buffer_unordered(CONCURRENCY)
                .collect()
                .await;
            models.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
            models
        })
    }

    fn probe_kv<'a>(&'a self, target: &'a KvTarget) -> BoxFuture<'a, KvObservation> {
        Box::pin(kv::watch(self, target))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_model_lists() {
        // The shape vLLM serves (see the crate README), with a LoRA adapter.
        let body = br#"{"object":"list","data":[
            {"id":"Qwen/Qwen3.6-35B-A3B","object":"model","created":1767225600,"owned_by":"vllm",
             "root":"Qwen/Qwen3.6-35B-A3B","parent":null,"max_model_len":262144,"permission":[]},
            {"id":"sql-lora","object":"model","created":1767225600,"owned_by":"vllm",
             "root":"/adapters/sql","parent":"Qwen/Qwen3.6-35B-A3B","max_model_len":null,"permission":[]}]}"#;
        let cards = parse_models(body).unwrap();
        assert_eq!(
            cards,
            [
                ModelCard {
                    id: "Qwen/Qwen3.6-35B-A3B".into(),
                    max_model_len: Some(262_144),
                    parent: None,
                    root: Some("Qwen/Qwen3.6-35B-A3B".into()),
                    owned_by: Some("vllm".into()),
                },
                ModelCard {
                    id: "sql-lora".into(),
                    max_model_len: None,
                    parent: Some("Qwen/Qwen3.6-35B-A3B".into()),
                    root: Some("/adapters/sql".into()),
                    owned_by: Some("vllm".into()),
                },
            ]
        );
    }

    #[test]
    fn refuses_other_bodies() {
        for body in [&b"<html>"[..], b"{}", br#"{"data":[{"name":"x"}]}"#] {
            assert!(
                matches!(parse_models(body), Err(ProbeFailure::Body(_))),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    fn window(widths: &[u32], batches: u64, activity: Option<(u64, u64, Option<u32>)>) -> KvWindow {
        KvWindow {
            publishers: vec!["10.0.0.1:5557".into()],
            discovered: true,
            window_ms: 3000,
            batches,
            block_sizes: widths.iter().copied().collect(),
            activity: activity.map(|(requests, tokens_computed, engine_block_size)| {
                EngineActivity {
                    requests,
                    tokens_computed,
                    engine_block_size,
                }
            }),
        }
    }

    #[test]
    fn traffic_needs_requests_and_blocks_worth_of_tokens() {
        // kvBlockSize 16: 4 blocks = 64 tokens.
        assert!(window(&[], 0, Some((1, 64, None))).saw_traffic(16));
        assert!(!window(&[], 0, Some((1, 63, None))).saw_traffic(16));
        assert!(!window(&[], 0, Some((0, 640, None))).saw_traffic(16));
        assert!(!window(&[], 0, None).saw_traffic(16));
        // The engine's wider --block-size raises the bar.
        let w = window(&[], 0, Some((3, 200, Some(64))));
        assert_eq!(w.verdict_tokens(16), 256);
        assert!(!w.saw_traffic(16));
        assert!(w.is_idle(16));
        assert!(!window(&[16], 1, None).is_idle(16), "events are never idle");
        assert_eq!(window(&[], 0, None).window_text(), "3 s");
        let short = KvWindow {
            window_ms: 1500,
            ..window(&[], 0, None)
        };
        assert_eq!(short.window_text(), "1.5 s");
    }

    #[test]
    fn merging_windows() {
        let sub = KvObservation::Subscribed;
        let closed = KvObservation::Closed {
            endpoint: "10.0.0.1:5557".into(),
            error: "connection refused".into(),
        };
        let wide = sub(window(&[256], 5, Some((2, 600, None))));
        let idle = sub(window(&[], 0, Some((0, 0, None))));
        let unknown = sub(window(&[], 0, None));
        let silent = sub(window(&[], 0, Some((4, 900, None))));
        let removals = sub(window(&[], 3, Some((1, 10, None))));
        let narrow = sub(window(&[16], 2, None));
        let m = |p: Option<&KvObservation>, n: &KvObservation| {
            KvObservation::merge(p.cloned(), n.clone(), 16)
        };
        // Nothing before: the new window, whatever it says.
        assert_eq!(m(None, &idle), idle);
        assert_eq!(m(None, &closed), closed);
        // Idle or unknown windows keep the previous findings.
        assert_eq!(m(Some(&wide), &idle), wide);
        assert_eq!(m(Some(&wide), &unknown), wide);
        assert_eq!(m(Some(&silent), &idle), silent);
        // Informative windows replace them.
        assert_eq!(m(Some(&wide), &silent), silent);
        assert_eq!(m(Some(&silent), &narrow), narrow);
        assert_eq!(m(Some(&wide), &closed), closed);
        assert_eq!(m(Some(&closed), &idle), idle, "the port opened");
        // Removals only: the widths seen before stay.
        match m(Some(&wide), &removals) {
            KvObservation::Subscribed(w) => {
                assert_eq!(w.batches, 3);
                assert_eq!(w.block_sizes, BTreeSet::from([256]));
            }
            other @ KvObservation::Closed { .. } => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_kv_target_is_the_first_endpoint_with_the_port() {
        let e = |a: &str, kv: Option<u16>| ReadyEndpoint {
            address: a.into(),
            http_port: 8000,
            kv_port: kv,
            replay_port: None,
            target: None,
        };
        let mut t = ProbeTarget {
            worker_set: "ns/ws".into(),
            endpoints: vec![
                e("10.0.0.1", None),
                e("10.0.0.2", Some(5557)),
                e("10.0.0.3", Some(5557)),
            ],
            kv_events: true,
            kv_block_size: 16,
        };
        assert_eq!(
            t.kv_target(),
            Some(KvTarget {
                worker_set: "ns/ws".into(),
                address: "10.0.0.2".into(),
                http_port: 8000,
                kv_port: 5557,
            })
        );
        t.kv_events = false;
        assert_eq!(t.kv_target(), None);
        t.kv_events = true;
        t.endpoints.retain(|e| e.kv_port.is_none());
        assert_eq!(t.kv_target(), None);
    }
}
