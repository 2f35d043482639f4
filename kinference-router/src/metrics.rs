//! The router's Prometheus metrics (prefix `kinference_router_`).
//!
//! Counters and histograms live in [`Metrics`]; figures that already exist
//! elsewhere (index size, per-endpoint load and stream health, tokenizer
//! cache) are read at scrape time by [`StateCollector`], never copied.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::state::Shared;

/// Labels of a finished request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// `chat` or `completions`.
    pub api: &'static str,
    /// `2xx`, `4xx`, `5xx`.
    pub class: &'static str,
}

/// Labels of a tokenization outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenizeLabels {
    /// `local`, `engine`, `approximate`.
    pub mode: &'static str,
    /// `ok`, `timeout`, `error`, `unavailable`.
    pub outcome: &'static str,
}

/// Labels of a routing decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// The policy that decided.
    pub policy: &'static str,
}

/// Labels of an upstream attempt that was retried elsewhere.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabels {
    /// `connect`, `unavailable` (503), `down` (probes found the engine
    /// unreachable while the request waited).
    pub reason: &'static str,
}

fn latency_buckets() -> impl Iterator<Item = f64> {
    [
        0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
        0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ]
    .into_iter()
}

/// Counters and histograms.
#[derive(Debug)]
pub struct Metrics {
    /// Requests answered, by API and status class.
    pub requests: Family<RequestLabels, Counter>,
    /// Time to the response headers (or error), seconds.
    pub request_duration: Family<RequestLabels, Histogram>,
    /// Time to first body bytes of streamed responses, seconds.
    pub ttft: Histogram,
    /// Observed ÷ predicted time to first token.
    pub ttft_ratio: Histogram,
    /// Time from the request's arrival to the routing decision, seconds.
    pub decision_duration: Family<DecisionLabels, Histogram>,
    /// Tokenization time, seconds, by mode and outcome.
    pub tokenize_duration: Family<TokenizeLabels, Histogram>,
    /// Requests routed on load alone because tokens were not available.
    pub routed_without_tokens: Counter,
    /// Upstream attempts retried on another endpoint.
    pub retries: Family<RetryLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            request_duration: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
            ttft: Histogram::new(latency_buckets()),
            ttft_ratio: Histogram::new([0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0]),
            decision_duration: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
            tokenize_duration: Family::new_with_constructor(|| Histogram::new(latency_buckets())),
            routed_without_tokens: Counter::default(),
            retries: Family::default(),
        }
    }
}

impl Metrics {
    /// Registers every metric in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register("requests", "Requests answered", self.requests.clone());
        registry.register(
            "request_duration_seconds",
            "Time from a request's arrival to its response headers",
            self.request_duration.clone(),
        );
        registry.register(
            "ttft_seconds",
            "Time to the first bytes of streamed responses, as the router sees it",
            self.ttft.clone(),
        );
        registry.register(
            "ttft_observed_over_predicted",
            "Observed time to first token divided by the prediction that routed the request",
            self.ttft_ratio.clone(),
        );
        registry.register(
            "decision_duration_seconds",
            "Time from a request's arrival to its routing decision (parse, tokenize, keys, lookup, score)",
            self.decision_duration.clone(),
        );
        registry.register(
            "tokenize_duration_seconds",
            "Tokenization time by mode and outcome",
            self.tokenize_duration.clone(),
        );
        registry.register(
            "routed_without_tokens",
            "Requests routed on load alone because their token ids were not available",
            self.routed_without_tokens.clone(),
        );
        registry.register(
            "retries",
            "Upstream attempts retried on another endpoint",
            self.retries.clone(),
        );
    }
}

/// Reads the router's state at scrape time.
#[derive(Debug)]
pub struct StateCollector(pub Arc<Shared>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabels {
    endpoint: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerSetLabels {
    worker_set: String,
}

fn gauge<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(L, f64)],
) -> Result<(), std::fmt::Error> {
    let mut e = encoder.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Gauge,
    )?;
    for (labels, v) in rows {
        ConstGauge::new(*v).encode(e.encode_family(labels)?)?;
    }
    Ok(())
}

fn single_gauge(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    v: f64,
) -> Result<(), std::fmt::Error> {
    let e = encoder.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Gauge,
    )?;
    ConstGauge::new(v).encode(e)
}

fn counter<L: EncodeLabelSet>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    rows: &[(L, u64)],
) -> Result<(), std::fmt::Error> {
    let mut e = encoder.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Counter,
    )?;
    for (labels, v) in rows {
        ConstCounter::new(*v).encode(e.encode_family(labels)?)?;
    }
    Ok(())
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let shared = &self.0;
        let stats = shared.kv.stats();
        single_gauge(
            &mut encoder,
            "kv_index_entries",
            "(block, worker) entries in the KV index",
            stats.entries as f64,
        )?;
        single_gauge(
            &mut encoder,
            "kv_index_bytes",
            "Estimated bytes held by the KV index",
            stats.bytes as f64,
        )?;
        single_gauge(
            &mut encoder,
            "config_problems",
            "Problems with the pool's objects (see /debug/endpoints): missing worker sets, unresolvable ports, unknown profiles",
            shared.problems().len() as f64,
        )?;

        let endpoints = shared.endpoint_reports();
        let ep = |f: &dyn Fn(&crate::state::EndpointReport) -> f64| -> Vec<(EndpointLabels, f64)> {
            endpoints
                .iter()
                .map(|r| {
                    (
                        EndpointLabels {
                            endpoint: r.endpoint.clone(),
                        },
                        f(r),
                    )
                })
                .collect()
        };
        gauge(
            &mut encoder,
            "endpoint_in_flight_requests",
            "Requests this router has in flight per endpoint",
            &ep(&|r| f64::from(r.load.requests)),
        )?;
        gauge(
            &mut encoder,
            "endpoint_prefill_tokens",
            "Uncached prompt tokens of requests before their first token",
            &ep(&|r| r.load.prefill_tokens as f64),
        )?;
        gauge(
            &mut encoder,
            "endpoint_healthy",
            "1 when the endpoint takes requests, 0 while ejected",
            &ep(&|r| if r.healthy { 1.0 } else { 0.0 }),
        )?;
        gauge(
            &mut encoder,
            "endpoint_kv_connected",
            "KV-event streams (DP ranks) connected",
            &ep(&|r| r.kv.iter().flatten().filter(|k| k.connected).count() as f64),
        )?;
        gauge(
            &mut encoder,
            "endpoint_kv_blocks",
            "Blocks the KV index holds for the endpoint",
            &ep(&|r| r.kv.iter().flatten().map(|k| k.blocks_held).sum::<u64>() as f64),
        )?;
        let kv_counter =
            |f: &dyn Fn(&crate::state::KvReport) -> u64| -> Vec<(EndpointLabels, u64)> {
                endpoints
                    .iter()
                    .filter_map(|r| {
                        r.kv.as_ref().map(|k| {
                            (
                                EndpointLabels {
                                    endpoint: r.endpoint.clone(),
                                },
                                k.iter().map(f).sum(),
                            )
                        })
                    })
                    .collect()
            };
        counter(
            &mut encoder,
            "endpoint_kv_batches",
            "KV-event batches received",
            &kv_counter(&|k| k.batches),
        )?;
        counter(
            &mut encoder,
            "endpoint_kv_gaps",
            "KV-event sequence gaps",
            &kv_counter(&|k| k.gaps),
        )?;
        counter(
            &mut encoder,
            "endpoint_kv_replays",
            "KV-event replays",
            &kv_counter(&|k| k.replays),
        )?;
        counter(
            &mut encoder,
            "endpoint_kv_restarts",
            "KV-event publisher restarts (sequence went down)",
            &kv_counter(&|k| k.restarts),
        )?;
        counter(
            &mut encoder,
            "endpoint_kv_decode_errors",
            "KV-event batches that failed to decode",
            &kv_counter(&|k| k.decode_errors),
        )?;

        let sets = shared.worker_set_reports();
        let ws_rows =
            |f: &dyn Fn(&crate::state::WorkerSetReport) -> u64| -> Vec<(WorkerSetLabels, u64)> {
                sets.iter()
                    .map(|s| {
                        (
                            WorkerSetLabels {
                                worker_set: s.name.clone(),
                            },
                            f(s),
                        )
                    })
                    .collect()
            };
        counter(
            &mut encoder,
            "tokenizer_cache_hits",
            "Tokenizer prefix-cache hits",
            &ws_rows(&|s| s.tokenizer_cache.map_or(0, |c| c.0)),
        )?;
        counter(
            &mut encoder,
            "tokenizer_cache_misses",
            "Tokenizer prefix-cache misses",
            &ws_rows(&|s| s.tokenizer_cache.map_or(0, |c| c.1)),
        )?;
        gauge(
            &mut encoder,
            "tokenizer_mismatch",
            "1 when the local tokenizer disagreed with the engine's /tokenize and the worker set fell back to engine tokenization",
            &sets
                .iter()
                .map(|s| {
                    (
                        WorkerSetLabels {
                            worker_set: s.name.clone(),
                        },
                        if s.tokenizer_mismatch { 1.0 } else { 0.0 },
                    )
                })
                .collect::<Vec<_>>(),
        )?;
        Ok(())
    }
}
