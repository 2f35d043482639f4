//! The router's Prometheus metrics (prefix `kinference_router_`).
//!
//! Counters and histograms live in [`Metrics`], updated by request tasks;
//! figures that already exist elsewhere (index size, per-endpoint load and
//! stream health, tokenizer cache) are read at scrape time by the admin
//! port's collector ([`crate::admin::StateCollector`]), never copied.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

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
    /// Routes taken from the memo of prompts prepared before.
    pub prepared_from_memo: Counter,
    /// Decisions taken in panic mode (every candidate ejected).
    pub panic_decisions: Counter,
    /// Requests that asked the engine to re-report the blocks they reuse
    /// (the index was recovering that engine's blocks).
    pub kv_recovery_requests: Counter,
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
            prepared_from_memo: Counter::default(),
            panic_decisions: Counter::default(),
            kv_recovery_requests: Counter::default(),
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
            "prepared_from_memo",
            "Requests whose block keys came from the memo of prompts prepared before (no tokenization)",
            self.prepared_from_memo.clone(),
        );
        registry.register(
            "panic_decisions",
            "Decisions taken with every candidate endpoint ejected (they are tried anyway)",
            self.panic_decisions.clone(),
        );
        registry.register(
            "kv_recovery_requests",
            "Requests that asked vLLM to re-report the cached blocks they reuse, while the index recovered that engine's blocks",
            self.kv_recovery_requests.clone(),
        );
        registry.register(
            "retries",
            "Upstream attempts retried on another endpoint",
            self.retries.clone(),
        );
    }
}
