//! Logs and traces.
//!
//! Logs go to standard error (`--log`, `--log-format`). Traces go over
//! OTLP/HTTP when an endpoint is given (`--otlp-endpoint`, or the standard
//! `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`),
//! protobuf by default or JSON (`OTEL_EXPORTER_OTLP_PROTOCOL=http/json`),
//! with `OTEL_SERVICE_NAME` (default `kinference-router`) and a parent-based
//! ratio sampler (`--trace-sample-ratio`). Each request is one server span
//! (`POST /v1/chat/completions`, from arrival to its last byte) with a span
//! per stage: `prepare` (parse, resolve, tokenize), `decide` and `proxy`
//! (to the response headers) per attempt. A client's W3C `traceparent`
//! makes the request's span its child; the engine gets the `proxy` span's
//! `traceparent` (vLLM started with `--otlp-traces-endpoint` continues the
//! trace). Spans use their own target ([`SPAN_TARGET`]), so that without
//! an endpoint they cost nothing.

use opentelemetry::propagation::TextMapPropagator as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// The target of request spans (exported, never logged).
pub const SPAN_TARGET: &str = "kinference::span";

/// Where traces go.
#[derive(Clone, Debug, PartialEq)]
pub struct Otlp {
    /// The traces URL (`…/v1/traces`).
    pub endpoint: String,
    /// JSON rather than protobuf.
    pub json: bool,
    /// Share of root traces kept (a client's sampled parent is followed).
    pub sample_ratio: f64,
}

impl Otlp {
    /// From `--otlp-endpoint` (a base URL, `/v1/traces` appended as the
    /// OTLP spec says) and the standard environment variables, which win
    /// when set for traces alone.
    ///
    /// # Errors
    /// A protocol other than `http/protobuf` or `http/json`.
    pub fn resolve(base: Option<&str>, sample_ratio: f64) -> Result<Option<Self>, String> {
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let endpoint = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .or_else(|| base.map(|b| format!("{}/v1/traces", b.trim_end_matches('/'))));
        let Some(endpoint) = endpoint else {
            return Ok(None);
        };
        let protocol = env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
            .unwrap_or_else(|| "http/protobuf".into());
        let json = match protocol.as_str() {
            "http/protobuf" => false,
            "http/json" => true,
            other => {
                return Err(format!(
                    "OTLP protocol {other:?} is not supported: use http/protobuf (the collector's port 4318) or http/json"
                ));
            }
        };
        Ok(Some(Self {
            endpoint,
            json,
            sample_ratio: sample_ratio.clamp(0.0, 1.0),
        }))
    }
}

/// Keeps the trace exporter running; flushes it when dropped.
#[derive(Debug, Default)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take()
            && let Err(e) = p.shutdown()
        {
            eprintln!("flushing traces: {e}");
        }
    }
}

/// Sets up logging with `filter` in `json` or plain form, and tracing to
/// `otlp` when given.
///
/// # Errors
/// The exporter cannot be built.
pub fn init(
    json: bool,
    filter: tracing_subscriber::EnvFilter,
    otlp: Option<&Otlp>,
) -> Result<Telemetry, String> {
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let logs = if json {
        fmt.json().with_filter(filter).boxed()
    } else {
        fmt.with_filter(filter).boxed()
    };
    let Some(otlp) = otlp else {
        let _ = tracing_subscriber::registry().with(logs).try_init();
        return Ok(Telemetry::default());
    };
    let protocol = if otlp.json {
        opentelemetry_otlp::Protocol::HttpJson
    } else {
        opentelemetry_otlp::Protocol::HttpBinary
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(protocol)
        .with_endpoint(otlp.endpoint.clone())
        .with_headers(std::collections::HashMap::new())
        .build()
        .map_err(|e| format!("the OTLP exporter for {}: {e}", otlp.endpoint))?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name("kinference-router");
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            otlp.sample_ratio,
        ))))
        .with_resource(resource.build())
        .build();
    let tracer = provider.tracer("kinference-router");
    let spans = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(
            tracing_subscriber::filter::Targets::new()
                .with_target(SPAN_TARGET, tracing::Level::INFO),
        );
    let _ = tracing_subscriber::registry()
        .with(logs)
        .with(spans)
        .try_init();
    Ok(Telemetry {
        provider: Some(provider),
    })
}

/// Makes `span` the child of the client's `traceparent`, if any.
pub fn continue_from(span: &tracing::Span, headers: &http::HeaderMap) {
    if span.is_disabled() || !headers.contains_key("traceparent") {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&opentelemetry_http::HeaderExtractor(headers));
    let _ = span.set_parent(cx);
}

/// Writes `span`'s `traceparent` into `headers` (for the engine).
pub fn propagate(span: &tracing::Span, headers: &mut http::HeaderMap) {
    if span.is_disabled() {
        return;
    }
    TraceContextPropagator::new().inject_context(
        &span.context(),
        &mut opentelemetry_http::HeaderInjector(headers),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_follow_the_otlp_spec() {
        assert_eq!(Otlp::resolve(None, 1.0), Ok(None));
        let o = Otlp::resolve(Some("http://collector:4318/"), 2.0)
            .unwrap()
            .unwrap();
        assert_eq!(o.endpoint, "http://collector:4318/v1/traces");
        assert!(!o.json);
        assert!((o.sample_ratio - 1.0).abs() < f64::EPSILON);
    }
}
