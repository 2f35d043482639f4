//! Prometheus metrics of the controller (prometheus-client).
//!
//! Registered under the prefix `kinference_controller` (see
//! [`Metrics::register`]); served on `/metrics` by [`crate::admin`].
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `kinference_controller_reconciles_total` | counter | `kind` |
//! | `kinference_controller_reconcile_errors_total` | counter | `kind`, `error` |
//! | `kinference_controller_reconcile_duration_seconds` | histogram | `kind` |
//! | `kinference_controller_status_writes_total` | counter | `kind` |
//! | `kinference_controller_probes_total` | counter | `probe`, `outcome` |
//! | `kinference_controller_kv_window_duration_seconds` | histogram | |
//! | `kinference_controller_events_total` | counter | `reason`, `outcome` |
//! | `kinference_controller_leader` | gauge | |

use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::probe::{EndpointModels, KvObservation, ProbeFailure};

/// The kind of object reconciled.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Kind {
    /// `InferenceWorkerSet`.
    WorkerSet,
    /// `InferencePool`.
    Pool,
}

/// Why a reconcile failed, for the `error` label.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ErrorKind {
    /// Writing status was refused or failed.
    WriteStatus,
    /// The object has no namespace or name.
    MalformedObject,
}

/// What was probed.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ProbeKind {
    /// `GET /v1/models` on one endpoint.
    Models,
    /// A KV-event subscription.
    KvEvents,
}

/// How a probe went.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Outcome {
    /// An answer (or events) came.
    Ok,
    /// No connection.
    Connect,
    /// No answer in time.
    Timeout,
    /// A non-2xx status.
    Status,
    /// An answer that could not be read.
    Body,
    /// A KV window without events.
    NoEvents,
    /// A Kubernetes Event was published.
    Published,
    /// Publishing a Kubernetes Event failed.
    Failed,
}

impl Kind {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::WorkerSet => "InferenceWorkerSet",
            Kind::Pool => "InferencePool",
        }
    }
}

impl EncodeLabelValue for Kind {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

impl ErrorKind {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::WriteStatus => "write_status",
            ErrorKind::MalformedObject => "malformed_object",
        }
    }
}

impl EncodeLabelValue for ErrorKind {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

impl ProbeKind {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeKind::Models => "models",
            ProbeKind::KvEvents => "kv_events",
        }
    }
}

impl EncodeLabelValue for ProbeKind {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

impl Outcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Connect => "connect",
            Outcome::Timeout => "timeout",
            Outcome::Status => "status",
            Outcome::Body => "body",
            Outcome::NoEvents => "no_events",
            Outcome::Published => "published",
            Outcome::Failed => "failed",
        }
    }
}

impl EncodeLabelValue for Outcome {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: Kind,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    kind: Kind,
    error: ErrorKind,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProbeLabels {
    probe: ProbeKind,
    outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    reason: String,
    outcome: Outcome,
}

/// The controller's metrics. Cloning shares the underlying values.
#[derive(Clone, Debug)]
pub struct Metrics {
    reconciles: Family<KindLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    durations: Family<KindLabels, Histogram>,
    status_writes: Family<KindLabels, Counter>,
    probes: Family<ProbeLabels, Counter>,
    kv_windows: Histogram,
    events: Family<EventLabels, Counter>,
    leader: Gauge,
}

impl Metrics {
    /// Creates the metrics and registers them in `registry` under the prefix
    /// `kinference_controller`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Metrics {
            reconciles: Family::default(),
            errors: Family::default(),
            durations: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 15))
            }),
            status_writes: Family::default(),
            probes: Family::default(),
            kv_windows: Histogram::new(exponential_buckets(0.25, 2.0, 8)),
            events: Family::default(),
            leader: Gauge::default(),
        };
        let r = registry.sub_registry_with_prefix("kinference_controller");
        r.register(
            "reconciles",
            "Reconciles started, by kind",
            m.reconciles.clone(),
        );
        r.register(
            "reconcile_errors",
            "Reconciles that failed, by kind and error",
            m.errors.clone(),
        );
        r.register(
            "reconcile_duration_seconds",
            "Time a reconcile took, probing included",
            m.durations.clone(),
        );
        r.register(
            "status_writes",
            "Status server-side applies, by kind (only changes are written)",
            m.status_writes.clone(),
        );
        r.register(
            "probes",
            "Probes of engines, by probe and outcome",
            m.probes.clone(),
        );
        r.register(
            "kv_window_duration_seconds",
            "Time a KV-event window took, discovery and /metrics reads included",
            m.kv_windows.clone(),
        );
        r.register(
            "events",
            "Kubernetes Events about worker sets, by reason and outcome",
            m.events.clone(),
        );
        r.register(
            "leader",
            "1 while this instance holds the leader lease",
            m.leader.clone(),
        );
        m
    }

    /// Counts a reconcile that took `took`.
    pub fn reconciled(&self, kind: Kind, took: Duration) {
        let l = KindLabels { kind };
        self.reconciles.get_or_create(&l).inc();
        self.durations.get_or_create(&l).observe(took.as_secs_f64());
    }

    /// Counts a failed reconcile.
    pub fn failed(&self, kind: Kind, error: ErrorKind) {
        self.errors
            .get_or_create(&ErrorLabels { kind, error })
            .inc();
    }

    /// Counts a status write.
    pub fn wrote_status(&self, kind: Kind) {
        self.status_writes.get_or_create(&KindLabels { kind }).inc();
    }

    /// Counts the outcomes of one round of `/v1/models` probes.
    pub fn probed_models(&self, models: &[EndpointModels]) {
        for EndpointModels { outcome, .. } in models {
            let outcome = match outcome {
                Ok(_) => Outcome::Ok,
                Err(ProbeFailure::Connect(_)) => Outcome::Connect,
                Err(ProbeFailure::Timeout) => Outcome::Timeout,
                Err(ProbeFailure::Status(_)) => Outcome::Status,
                Err(ProbeFailure::Body(_)) => Outcome::Body,
            };
            self.probes
                .get_or_create(&ProbeLabels {
                    probe: ProbeKind::Models,
                    outcome,
                })
                .inc();
        }
    }

    /// Counts one KV window that took `took`.
    pub fn probed_kv(&self, observation: &KvObservation, took: Duration) {
        let outcome = match observation {
            KvObservation::Closed { .. } => Outcome::Connect,
            KvObservation::Subscribed(w) if w.batches > 0 => Outcome::Ok,
            KvObservation::Subscribed(_) => Outcome::NoEvents,
        };
        self.probes
            .get_or_create(&ProbeLabels {
                probe: ProbeKind::KvEvents,
                outcome,
            })
            .inc();
        self.kv_windows.observe(took.as_secs_f64());
    }

    /// Counts a Kubernetes Event.
    pub fn event(&self, reason: &str, published: bool) {
        self.events
            .get_or_create(&EventLabels {
                reason: reason.to_owned(),
                outcome: if published {
                    Outcome::Published
                } else {
                    Outcome::Failed
                },
            })
            .inc();
    }

    /// Records whether this instance leads.
    pub fn set_leader(&self, leader: bool) {
        self.leader.set(i64::from(leader));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::ModelCard;

    #[test]
    fn encodes_what_was_counted() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        m.reconciled(Kind::WorkerSet, Duration::from_millis(3));
        m.failed(Kind::Pool, ErrorKind::WriteStatus);
        m.wrote_status(Kind::WorkerSet);
        m.probed_models(&[
            EndpointModels {
                endpoint: "a:1".into(),
                outcome: Ok(vec![ModelCard {
                    id: "m".into(),
                    max_model_len: None,
                    parent: None,
                    root: None,
                    owned_by: None,
                }]),
            },
            EndpointModels {
                endpoint: "b:1".into(),
                outcome: Err(ProbeFailure::Timeout),
            },
        ]);
        m.probed_kv(
            &KvObservation::Closed {
                endpoint: "a:5557".into(),
                error: "connection refused".into(),
            },
            Duration::from_millis(2),
        );
        m.event("ModelMismatch", true);
        m.set_leader(true);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        for line in [
            "kinference_controller_reconciles_total{kind=\"InferenceWorkerSet\"} 1",
            "kinference_controller_reconcile_errors_total{kind=\"InferencePool\",error=\"write_status\"} 1",
            "kinference_controller_status_writes_total{kind=\"InferenceWorkerSet\"} 1",
            "kinference_controller_probes_total{probe=\"models\",outcome=\"ok\"} 1",
            "kinference_controller_probes_total{probe=\"models\",outcome=\"timeout\"} 1",
            "kinference_controller_probes_total{probe=\"kv_events\",outcome=\"connect\"} 1",
            "kinference_controller_kv_window_duration_seconds_count 1",
            "kinference_controller_events_total{reason=\"ModelMismatch\",outcome=\"published\"} 1",
            "kinference_controller_leader 1",
            "kinference_controller_reconcile_duration_seconds_count{kind=\"InferenceWorkerSet\"} 1",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
    }
}
