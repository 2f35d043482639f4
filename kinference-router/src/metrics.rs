//! The router's Prometheus metrics (prefix `kinference_router_`).
//!
//! Counters and histograms live in [`Metrics`], updated by request tasks
//! (most through a request's [`crate::exchange::Exchange`], which records
//! it once, when its response ends); figures that already exist elsewhere
//! (index size, per-engine load and stream health, tokenizer cache) are read
//! at scrape time by the admin port's collector
//! ([`crate::admin::StateCollector`]), never copied.
//!
//! Names follow the field's (vLLM's `vllm:time_to_first_token_seconds`,
//! Dynamo's `dynamo_frontend_inter_token_latency_seconds`); labels are
//! `model` (the served name the client asked for), `worker_set`, `code`
//! (the HTTP status) and `engine` (`address:port`; not `endpoint`, which
//! the Prometheus Operator sets on every scraped series). The reference is
//! generated from [`Metrics::register`] and the collector: `docs/metrics.md`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Labels of a finished request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// `chat`, `completions`, ... ([`crate::openai::Endpoint::label`]).
    pub api: &'static str,
    /// The served model name asked for; empty when none resolved.
    pub model: String,
    /// The worker set that served it; empty when none did.
    pub worker_set: String,
    /// The HTTP status code.
    pub code: u16,
}

/// Labels of figures per model and worker set.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabels {
    /// The served model name asked for.
    pub model: String,
    /// The worker set that served it.
    pub worker_set: String,
}

/// Labels of figures per worker set.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerSetLabels {
    /// The worker set.
    pub worker_set: String,
}

/// Labels of a tokenization outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenizeLabels {
    /// `local`, `engine`, `approximate`.
    pub mode: &'static str,
    /// `ok`, `timeout`, `error`, `unavailable`.
    pub outcome: &'static str,
}

/// Labels of a routing decision's duration.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// The policy that decided.
    pub policy: &'static str,
}

/// Labels of a routing decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// The policy that decided.
    pub policy: &'static str,
    /// The rule that chose ([`kinference_scoring::Reason::label`]), or
    /// `panic` (every candidate ejected).
    pub reason: &'static str,
}

/// Labels of a LoRA adapter request sent.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdapterLabels {
    /// Where its adapter stood on the engine chosen
    /// ([`kinference_scoring::AdapterSlot::as_str`]).
    pub slot: &'static str,
}

/// Labels of an upstream attempt that was retried elsewhere.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabels {
    /// [`crate::proxy::RetryReason::label`].
    pub reason: &'static str,
}

/// Labels of a search for the engine that keeps a stored response, and of
/// a speed probe.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SearchLabels {
    /// `found` or `not_found`; a probe's [`crate::speed::OUTCOMES`].
    pub outcome: &'static str,
}

/// Labels of a request the admission queue answered 429.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectionLabels {
    /// `queue_full` or `deadline`.
    pub reason: &'static str,
}

/// Every rejection reason.
pub const REJECTION_REASONS: [&str; 2] = ["queue_full", "deadline"];

/// Buckets of short stage timings (decisions, tokenization), seconds.
fn stage_buckets() -> impl Iterator<Item = f64> {
    [
        0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
        0.5, 1.0, 2.5, 5.0, 10.0,
    ]
    .into_iter()
}

/// Buckets of first-token and inter-token times, seconds (vLLM's, to 5 min).
fn token_buckets() -> impl Iterator<Item = f64> {
    [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0, 160.0, 300.0,
    ]
    .into_iter()
}

/// Buckets of whole requests, seconds: to 30 minutes (long generations).
fn request_buckets() -> impl Iterator<Item = f64> {
    [
        0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
        300.0, 600.0, 1200.0, 1800.0,
    ]
    .into_iter()
}

fn fraction_buckets() -> impl Iterator<Item = f64> {
    [
        0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0,
    ]
    .into_iter()
}

/// Counters and histograms.
#[derive(Debug)]
pub struct Metrics {
    /// Requests answered.
    pub requests: Family<RequestLabels, Counter>,
    /// Arrival to the last byte of the response, seconds.
    pub request_duration: Family<RequestLabels, Histogram>,
    /// Requests accepted and not yet finished.
    pub in_flight: Gauge,
    /// Sending to the first body bytes of streamed responses, seconds.
    pub ttft: Family<ModelLabels, Histogram>,
    /// Between successive data chunks of streamed responses, seconds.
    pub itl: Family<ModelLabels, Histogram>,
    /// The time to first token predicted for the engine chosen, seconds.
    pub predicted_ttft: Family<ModelLabels, Histogram>,
    /// Observed ÷ predicted time to first token.
    pub ttft_ratio: Family<WorkerSetLabels, Histogram>,
    /// Prompt tokens of requests sent.
    pub prompt_tokens: Family<ModelLabels, Counter>,
    /// Prompt tokens the engine chosen was predicted to hold.
    pub cached_prompt_tokens: Family<ModelLabels, Counter>,
    /// Completion tokens (the engine's `usage`, else the stream's text events).
    pub completion_tokens: Family<ModelLabels, Counter>,
    /// Cached ÷ prompt tokens at routing time.
    pub cached_fraction: Family<ModelLabels, Histogram>,
    /// Decisions by policy and rule.
    pub decisions: Family<ReasonLabels, Counter>,
    /// Time from a request's arrival to its routing decision, seconds.
    pub decision_duration: Family<DecisionLabels, Histogram>,
    /// Tokenization time, seconds, by mode and outcome.
    pub tokenize_duration: Family<TokenizeLabels, Histogram>,
    /// Requests routed on load alone because tokens were not available.
    pub routed_without_tokens: Counter,
    /// Routes taken from the memo of prompts prepared before.
    pub prepared_from_memo: Counter,
    /// Decisions taken in panic mode (every candidate ejected).
    pub panic_decisions: Counter,
    /// LoRA adapter requests sent, by where the adapter stood there.
    pub adapter_requests: Family<AdapterLabels, Counter>,
    /// Requests that asked the engine to re-report the blocks they reuse
    /// (the index was recovering that engine's blocks).
    pub kv_recovery_requests: Counter,
    /// Upstream attempts retried on another endpoint.
    pub retries: Family<RetryLabels, Counter>,
    /// Requests held by admission now, per worker set.
    pub queue_depth: Family<WorkerSetLabels, Gauge>,
    /// Time requests spent held by admission, seconds.
    pub queue_wait: Family<WorkerSetLabels, Histogram>,
    /// Requests answered 429 by admission, by reason.
    pub rejections: Family<RejectionLabels, Counter>,
    /// Searches of the pool's engines for a stored response's holder
    /// ([`crate::stored`]), by outcome.
    pub stored_response_searches: Family<SearchLabels, Counter>,
    /// Speed probes of engines as they joined ([`crate::speed`]), by
    /// outcome.
    pub speed_probes: Family<SearchLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        let retries: Family<RetryLabels, Counter> = Family::default();
        // Every reason exists from the start at 0, so that rates and alerts
        // over them read 0 rather than nothing.
        for reason in crate::proxy::RetryReason::ALL {
            drop(retries.get_or_create(&RetryLabels {
                reason: reason.label(),
            }));
        }
        let stored_response_searches: Family<SearchLabels, Counter> = Family::default();
        for outcome in ["found", "not_found"] {
            drop(stored_response_searches.get_or_create(&SearchLabels { outcome }));
        }
        let speed_probes: Family<SearchLabels, Counter> = Family::default();
        for outcome in crate::speed::OUTCOMES {
            drop(speed_probes.get_or_create(&SearchLabels { outcome }));
        }
        let rejections: Family<RejectionLabels, Counter> = Family::default();
        for reason in REJECTION_REASONS {
            drop(rejections.get_or_create(&RejectionLabels { reason }));
        }
        Self {
            requests: Family::default(),
            request_duration: Family::new_with_constructor(|| Histogram::new(request_buckets())),
            in_flight: Gauge::default(),
            ttft: Family::new_with_constructor(|| Histogram::new(token_buckets())),
            itl: Family::new_with_constructor(|| Histogram::new(token_buckets())),
            predicted_ttft: Family::new_with_constructor(|| Histogram::new(token_buckets())),
            ttft_ratio: Family::new_with_constructor(|| {
                Histogram::new([0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0])
            }),
            prompt_tokens: Family::default(),
            cached_prompt_tokens: Family::default(),
            completion_tokens: Family::default(),
            cached_fraction: Family::new_with_constructor(|| Histogram::new(fraction_buckets())),
            decisions: Family::default(),
            decision_duration: Family::new_with_constructor(|| Histogram::new(stage_buckets())),
            tokenize_duration: Family::new_with_constructor(|| Histogram::new(stage_buckets())),
            routed_without_tokens: Counter::default(),
            prepared_from_memo: Counter::default(),
            panic_decisions: Counter::default(),
            adapter_requests: Family::default(),
            kv_recovery_requests: Counter::default(),
            retries,
            queue_depth: Family::default(),
            queue_wait: Family::new_with_constructor(|| Histogram::new(token_buckets())),
            rejections,
            stored_response_searches,
            speed_probes,
        }
    }
}

/// The build's version, for `build_info`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
}

impl Metrics {
    /// Registers every metric in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        let build: Family<BuildLabels, Gauge> = Family::default();
        build
            .get_or_create(&BuildLabels { version: VERSION })
            .set(1);
        registry.register("build_info", "The router's version (always 1)", build);
        registry.register(
            "requests",
            "Requests answered, by API, model, worker set and HTTP status code",
            self.requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time from a request's arrival to the last byte of its response",
            self.request_duration.clone(),
        );
        registry.register(
            "requests_in_flight",
            "Requests accepted and not yet finished",
            self.in_flight.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Time from sending a streamed request to an engine to its first body bytes",
            self.ttft.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Time between successive data chunks of streamed responses",
            self.itl.clone(),
        );
        registry.register(
            "predicted_ttft_seconds",
            "The time to first token predicted for the engine each request was sent to",
            self.predicted_ttft.clone(),
        );
        registry.register(
            "ttft_observed_over_predicted",
            "Observed time to first token divided by the prediction that routed the request",
            self.ttft_ratio.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens of requests sent to engines",
            self.prompt_tokens.clone(),
        );
        registry.register(
            "cached_prompt_tokens",
            "Prompt tokens the chosen engine was predicted to hold in its KV cache at routing time",
            self.cached_prompt_tokens.clone(),
        );
        registry.register(
            "completion_tokens",
            "Completion tokens (the engine's usage figures; the stream's text-carrying events when it carries none)",
            self.completion_tokens.clone(),
        );
        registry.register(
            "routed_cached_fraction",
            "Cached share of each prompt on the engine chosen, at routing time",
            self.cached_fraction.clone(),
        );
        registry.register(
            "decisions",
            "Routing decisions by policy and the rule that chose",
            self.decisions.clone(),
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
            "adapter_requests",
            "LoRA adapter requests sent, by where the adapter stood on the engine chosen: resident (running or waiting there), free (a slot to load it into), full (every slot running another adapter), unknown (the engine exports no vllm:lora_requests_info)",
            self.adapter_requests.clone(),
        );
        registry.register(
            "kv_recovery_requests",
            "Requests that asked vLLM to re-report the cached blocks they reuse, while the index recovered that engine's blocks",
            self.kv_recovery_requests.clone(),
        );
        registry.register(
            "speed_probes",
            "Speed probes of engines as they joined (two one-token requests each, whose first tokens tell the policy the engine's speed before it takes any request), by outcome: ok (observed), timeout (observed as the timeout), error (an answer that is not a completion), skipped (no base model listed, or a profile without calibration), busy (the engine was serving requests: its answer would say how long its queue is, not how fast it is)",
            self.speed_probes.clone(),
        );
        registry.register(
            "stored_response_searches",
            "Searches of the pool's engines for the one that keeps a stored Responses answer (retrieve, cancel, previous_response_id) it had not seen pass, by outcome",
            self.stored_response_searches.clone(),
        );
        registry.register(
            "retries",
            "Upstream attempts retried on another endpoint",
            self.retries.clone(),
        );
        registry.register(
            "queue_depth",
            "Requests held by the router's admission queue (every engine predicted past the bound), per worker set",
            self.queue_depth.clone(),
        );
        registry.register(
            "queue_wait_seconds",
            "Time requests spent in the admission queue before being sent or answered 429",
            self.queue_wait.clone(),
        );
        registry.register(
            "rejections",
            "Requests answered 429 by admission before any engine saw them: queue_full or deadline",
            self.rejections.clone(),
        );
    }
}

impl Metrics {
    /// Creates one series in every family (families without series are
    /// not exposed at all), for the reference.
    fn touch_every_family(&self) {
        let m = ModelLabels {
            model: String::new(),
            worker_set: String::new(),
        };
        let r = RequestLabels {
            api: "",
            model: String::new(),
            worker_set: String::new(),
            code: 0,
        };
        drop(self.requests.get_or_create(&r));
        drop(self.request_duration.get_or_create(&r));
        for f in [
            &self.ttft,
            &self.itl,
            &self.predicted_ttft,
            &self.cached_fraction,
        ] {
            drop(f.get_or_create(&m));
        }
        for f in [
            &self.prompt_tokens,
            &self.cached_prompt_tokens,
            &self.completion_tokens,
        ] {
            drop(f.get_or_create(&m));
        }
        let ws = WorkerSetLabels {
            worker_set: String::new(),
        };
        drop(self.ttft_ratio.get_or_create(&ws));
        drop(self.queue_depth.get_or_create(&ws));
        drop(self.queue_wait.get_or_create(&ws));
        drop(self.decisions.get_or_create(&ReasonLabels {
            policy: "",
            reason: "",
        }));
        drop(
            self.adapter_requests
                .get_or_create(&AdapterLabels { slot: "" }),
        );
        drop(
            self.decision_duration
                .get_or_create(&DecisionLabels { policy: "" }),
        );
        drop(self.tokenize_duration.get_or_create(&TokenizeLabels {
            mode: "",
            outcome: "",
        }));
    }
}

/// One metric as the reference (`docs/reference/metrics.md`) lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetricDoc {
    /// The full name as scraped (with `_total` on counters).
    pub name: String,
    /// `counter`, `gauge`, `histogram`.
    pub kind: String,
    /// Its labels.
    pub labels: &'static str,
    /// What it measures.
    pub help: String,
}

/// The labels of each metric (name without the prefix), for the reference;
/// a test checks it covers exactly what the router exposes.
pub const LABELS: &[(&str, &str)] = &[
    ("build_info", "`version`"),
    ("requests", "`api`, `model`, `worker_set`, `code`"),
    (
        "request_duration_seconds",
        "`api`, `model`, `worker_set`, `code`",
    ),
    ("requests_in_flight", ""),
    ("time_to_first_token_seconds", "`model`, `worker_set`"),
    ("inter_token_latency_seconds", "`model`, `worker_set`"),
    ("predicted_ttft_seconds", "`model`, `worker_set`"),
    ("ttft_observed_over_predicted", "`worker_set`"),
    ("prompt_tokens", "`model`, `worker_set`"),
    ("cached_prompt_tokens", "`model`, `worker_set`"),
    ("completion_tokens", "`model`, `worker_set`"),
    ("routed_cached_fraction", "`model`, `worker_set`"),
    ("decisions", "`policy`, `reason`"),
    ("decision_duration_seconds", "`policy`"),
    ("tokenize_duration_seconds", "`mode`, `outcome`"),
    ("routed_without_tokens", ""),
    ("prepared_from_memo", ""),
    ("panic_decisions", ""),
    (
        "adapter_requests",
        "`slot` (`resident`, `free`, `full`, `unknown`)",
    ),
    ("kv_recovery_requests", ""),
    ("retries", "`reason`"),
    (
        "stored_response_searches",
        "`outcome` (`found`, `not_found`)",
    ),
    (
        "speed_probes",
        "`outcome` (`ok`, `timeout`, `error`, `skipped`, `busy`)",
    ),
    ("queue_depth", "`worker_set`"),
    ("queue_wait_seconds", "`worker_set`"),
    ("rejections", "`reason`"),
    ("kv_index_entries", ""),
    ("kv_index_bytes", ""),
    ("kv_index_max_entries", ""),
    ("kv_index_evicted_entries", ""),
    ("kv_index_sessions", ""),
    ("ready", ""),
    ("peers", ""),
    ("peers_reporting", ""),
    (
        "peer_bytes",
        "`kind` (`load`, `snapshot`), `direction` (`sent`, `received`)",
    ),
    ("kv_bootstrap_fallbacks", "`reason`"),
    ("kv_bootstrap_waiting", ""),
    ("kv_bootstrap_blocks", ""),
    ("config_problems", ""),
    ("engine_in_flight_requests", "`engine`, `worker_set`"),
    ("engine_prefill_tokens", "`engine`, `worker_set`"),
    ("engine_healthy", "`engine`, `worker_set`"),
    ("engine_kv_connected", "`engine`, `worker_set`"),
    ("engine_kv_blocks", "`engine`, `worker_set`"),
    ("engine_queue_depth", "`engine`, `worker_set`"),
    ("engine_kv_last_event_age_seconds", "`engine`, `worker_set`"),
    ("engine_kv_batches", "`engine`, `worker_set`"),
    ("engine_kv_gaps", "`engine`, `worker_set`"),
    ("engine_kv_replays", "`engine`, `worker_set`"),
    ("engine_kv_restarts", "`engine`, `worker_set`"),
    ("engine_kv_decode_errors", "`engine`, `worker_set`"),
    ("tokenizer_cache_hits", "`worker_set`"),
    ("tokenizer_cache_misses", "`worker_set`"),
    ("tokenizer_unavailable", "`worker_set`"),
    ("tokenizer_mismatch", "`worker_set`"),
];

/// Every metric the router exposes, read from a fresh router's registry
/// (names, types and help as scraped).
pub fn reference() -> Vec<MetricDoc> {
    let shared = crate::state::Shared::new(
        crate::config::Config::default(),
        tokio_util::sync::CancellationToken::new(),
    );
    shared.metrics.touch_every_family();
    let registry = crate::admin::registry(&shared);
    let mut text = String::new();
    let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
    let mut out: Vec<MetricDoc> = Vec::new();
    let mut help = std::collections::HashMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, h) = rest.split_once(' ').unwrap_or((rest, ""));
            help.insert(name.to_owned(), h.replace("\\n", " "));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            let short = name.strip_prefix("kinference_router_").unwrap_or(name);
            let labels = LABELS
                .iter()
                .find(|(n, _)| *n == short)
                .map_or("?", |(_, l)| l);
            let full = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_owned()
            };
            out.push(MetricDoc {
                name: full,
                kind: kind.to_owned(),
                labels,
                help: help.get(name).cloned().unwrap_or_default(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_lists_every_metric_with_its_labels() {
        let docs = reference();
        let names: Vec<&str> = docs
            .iter()
            .map(|d| {
                let n = d.name.strip_prefix("kinference_router_").unwrap_or(&d.name);
                if d.kind == "counter" {
                    n.strip_suffix("_total").unwrap_or(n)
                } else {
                    n
                }
            })
            .collect();
        for (n, _) in LABELS {
            assert!(
                names.contains(n),
                "{n} is in LABELS but not exposed: {names:?}"
            );
        }
        for d in &docs {
            assert_ne!(d.labels, "?", "{} has no LABELS entry", d.name);
            assert!(!d.help.is_empty(), "{} has no help", d.name);
        }
        assert!(
            docs.iter()
                .any(|d| d.name == "kinference_router_requests_total")
        );
    }
}
