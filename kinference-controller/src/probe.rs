//! Probing a worker set's engines: what they serve and what they publish.
//!
//! The reconciler calls a [`Prober`] for each worker set with ready
//! endpoints, at most once per probe interval (sooner when the endpoints
//! change), and keeps the latest [`ProbeResult`] in memory; the status and
//! its diagnoses are computed from it by pure functions ([`crate::diagnose`]).
//!
//! [`HttpProber`] asks every ready endpoint `GET /v1/models` (the OpenAI
//! model list as vLLM serves it). The KV-event stream is **not probed yet**:
//! its result is [`KvProbe::NotProbed`] whenever `kvEvents` is set, which
//! makes no diagnosis at all (a later phase subscribes briefly to one
//! endpoint with kinference-kvindex's subscriber and fills
//! [`KvObservation`]).

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::{self, StreamExt};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;

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

/// One entry of an OpenAI model list.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct ModelCard {
    /// The name clients send in `model`.
    pub id: String,
    /// Context length; vLLM sets it on base models only.
    #[serde(default)]
    pub max_model_len: Option<i64>,
    /// For a LoRA adapter: the base model's name.
    #[serde(default)]
    pub parent: Option<String>,
}

/// Why an endpoint gave no model list. The texts are stable for equal
/// causes, so an unchanged failure does not change status.
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
    /// A body that is not an OpenAI model list.
    #[error("not an OpenAI model list: {0}")]
    Body(String),
}

/// The KV-event stream of a worker set.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum KvProbe {
    /// `kvEvents` is unset: there is nothing to probe.
    #[default]
    NotConfigured,
    /// `kvEvents` is set but the stream was not probed: no KV prober is
    /// wired in yet. No diagnosis is made from this.
    NotProbed,
    /// A short subscription to one endpoint.
    Observed(KvObservation),
}

/// What a short subscription to one endpoint's KV events saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvObservation {
    /// Nothing accepted the connection.
    Closed {
        /// `host:port` of the publisher.
        endpoint: String,
        /// Why, in words.
        error: String,
    },
    /// Subscribed for a window.
    Subscribed {
        /// `host:port` of the publisher.
        endpoint: String,
        /// How long the subscription lasted, in seconds.
        window_secs: u32,
        /// Event batches received.
        events: u64,
        /// Block widths seen in `BlockStored` events (placeholders of width
        /// 0 left out).
        block_sizes: BTreeSet<u32>,
        /// Requests the engine served during the window, when its metrics
        /// say; `None` when unknown.
        requests_served: Option<u64>,
    },
}

/// Probes a worker set's engines. Implementations never fail: what went
/// wrong is part of the result, so it can become a diagnosis.
pub trait Prober: Send + Sync + 'static {
    /// Probes `target` once.
    fn probe<'a>(&'a self, target: &'a ProbeTarget) -> BoxFuture<'a, ProbeResult>;
}

/// The largest model list read (vLLM's is a few hundred bytes per model).
const MAX_BODY: usize = 1 << 20;
/// How many endpoints of one worker set are asked at once.
const CONCURRENCY: usize = 16;

/// Asks each endpoint `GET /v1/models` over HTTP/1.1 (hyper); the KV stream
/// is [`KvProbe::NotProbed`].
#[derive(Clone, Debug)]
pub struct HttpProber {
    client: Client<HttpConnector, Empty<Bytes>>,
    timeout: Duration,
}

impl HttpProber {
    /// A prober whose every request (connect, headers and body) must finish
    /// within `timeout`.
    pub fn new(timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(1)
            .build(connector);
        Self { client, timeout }
    }

    /// `GET http://{authority}/v1/models`.
    ///
    /// # Errors
    /// [`ProbeFailure`] when the endpoint cannot be reached in time, answers
    /// with a non-2xx status, or with a body that is not a model list.
    pub async fn models(&self, authority: &str) -> Result<Vec<ModelCard>, ProbeFailure> {
        match tokio::time::timeout(self.timeout, self.fetch_models(authority)).await {
            Ok(r) => r,
            Err(_) => Err(ProbeFailure::Timeout),
        }
    }

    async fn endpoint_models(&self, endpoint: String) -> EndpointModels {
        let outcome = self.models(&endpoint).await;
        EndpointModels { endpoint, outcome }
    }

    async fn fetch_models(&self, authority: &str) -> Result<Vec<ModelCard>, ProbeFailure> {
        let uri: http::Uri = format!("http://{authority}/v1/models")
            .parse()
            .map_err(|e: http::uri::InvalidUri| ProbeFailure::Connect(e.to_string()))?;
        let req = http::Request::get(uri)
            .header(http::header::ACCEPT, "application/json")
            .header(http::header::USER_AGENT, "kinference-controller")
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
        let body = Limited::new(resp.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| ProbeFailure::Body(format!("reading the body: {e}")))?
            .to_bytes();
        parse_models(&body)
    }
}

/// Reads an OpenAI model list (`{"object": "list", "data": [...]}`).
///
/// # Errors
/// [`ProbeFailure::Body`] when `body` is not one.
pub fn parse_models(body: &[u8]) -> Result<Vec<ModelCard>, ProbeFailure> {
    #[derive(Deserialize)]
    struct List {
        data: Vec<ModelCard>,
    }
    serde_json::from_slice::<List>(body)
        .map(|l| l.data)
        .map_err(|e| ProbeFailure::Body(e.to_string()))
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
    fn probe<'a>(&'a self, target: &'a ProbeTarget) -> BoxFuture<'a, ProbeResult> {
        Box::pin(async move {
            let authorities: Vec<String> = target.endpoints.iter().map(http_authority).collect();
            let mut models: Vec<EndpointModels> = stream::iter(authorities)
                .map(|a| self.endpoint_models(a))
                .buffer_unordered(CONCURRENCY)
                .collect()
                .await;
            models.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
            let kv = if target.kv_events {
                KvProbe::NotProbed
            } else {
                KvProbe::NotConfigured
            };
            ProbeResult { models, kv }
        })
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
                    parent: None
                },
                ModelCard {
                    id: "sql-lora".into(),
                    max_model_len: None,
                    parent: Some("Qwen/Qwen3.6-35B-A3B".into())
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
}
