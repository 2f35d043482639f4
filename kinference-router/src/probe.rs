//! Asking engines about themselves: `/v1/models` (discovery) and `/metrics`
//! (scraped load), periodically, per endpoint; and where an endpoint
//! publishes its KV events. The answers are read by kinference-api's
//! shared parsers ([`kinference_api::engine`]), as the controller reads them.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use tokio::time::Instant;

use kinference_api::engine;

use crate::config::ProbeIntervals;
use crate::endpoint::{Endpoint, Scraped};
use crate::kv::Publisher;

/// The largest probe answer read (`/metrics`, `/v1/models`, `/kv_event_sources`).
pub const MAX_PROBE_BODY: usize = 1 << 20;

/// The HTTP client for probes (small bodies, no streaming).
pub type ProbeClient = Client<HttpConnector, Empty<Bytes>>;

/// A probe client with a connect timeout.
pub fn client(connect_timeout: Duration) -> ProbeClient {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(connect_timeout));
    http.set_nodelay(true);
    Client::builder(hyper_util::rt::TokioExecutor::new()).build(http)
}

/// A probe that failed, and whether the engine answered at all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeError {
    /// The engine answered (an HTTP error, a body too large): it is up.
    /// `false`: no connection, no answer in time, or the connection broke.
    pub reached: bool,
    /// What went wrong.
    pub message: String,
}

impl std::fmt::Display for ProbeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

async fn get(
    client: &ProbeClient,
    authority: &str,
    path: &str,
    timeout: Duration,
) -> Result<Bytes, ProbeError> {
    let fail = |reached: bool, message: String| ProbeError { reached, message };
    let uri: http::Uri = format!("http://{authority}{path}")
        .parse()
        .map_err(|e| fail(false, format!("bad address {authority}: {e}")))?;
    let call = async {
        let resp = client
            .get(uri)
            .await
            .map_err(|e| fail(false, format!("GET {path}: {e}")))?;
        let status = resp.status();
        // Engines are trusted, but a probe answer is never worth more memory than this.
        let body = http_body_util::Limited::new(resp.into_body(), MAX_PROBE_BODY)
            .collect()
            .await
            .map_err(|e| {
                let reached = e.is::<http_body_util::LengthLimitError>();
                fail(
                    reached,
                    format!("GET {path}: reading the body (at most {MAX_PROBE_BODY} bytes): {e}"),
                )
            })?
            .to_bytes();
        if !status.is_success() {
            return Err(fail(true, format!("GET {path}: HTTP {status}")));
        }
        Ok(body)
    };
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| fail(false, format!("GET {path}: no answer within {timeout:?}")))?
}

/// Reads the load figures of a `/metrics` answer (vLLM or SGLang names)
/// read at `at`.
pub fn scraped(text: &str, at: Instant) -> Scraped {
    let l = engine::parse_load(text);
    Scraped {
        running: l.running,
        waiting: l.waiting,
        kv_usage: l.kv_usage,
        block_size: l.block_size,
        own_requests: 0,
        own_prefilling: 0,
        at,
    }
}

/// Where endpoint `authority` (pod address `address`) publishes its KV
/// events: every DP rank its `/kv_event_sources` lists (vLLM ≥ 0.31), or
/// rank 0 on the worker set's KV port, with a replay socket on that port
/// plus `replay_offset` (0: none).
pub async fn kv_publishers(
    client: &ProbeClient,
    authority: &str,
    address: &str,
    kv_port: u16,
    replay_offset: u16,
    timeout: Duration,
) -> Vec<Publisher> {
    let host = if address.contains(':') {
        format!("[{address}]")
    } else {
        address.to_owned()
    };
    let listed = match get(client, authority, "/kv_event_sources", timeout).await {
        Ok(body) => engine::parse_kv_event_sources(&body).unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    if !listed.is_empty() {
        return listed
            .into_iter()
            .map(|s| Publisher {
                rank: s.rank,
                endpoint: format!("tcp://{host}:{}", s.port),
                replay: s.replay_port.map(|p| format!("tcp://{host}:{p}")),
            })
            .collect();
    }
    let replay = (replay_offset != 0)
        .then(|| kv_port.checked_add(replay_offset))
        .flatten()
        .map(|p| format!("tcp://{host}:{p}"));
    vec![Publisher {
        rank: 0,
        endpoint: format!("tcp://{host}:{kv_port}"),
        replay,
    }]
}

/// Polls one endpoint's `/v1/models` and `/metrics` until it leaves. Each
/// probe's reachability feeds the endpoint's health
/// ([`Endpoint::record_probe`]).
pub fn spawn(
    endpoint: Arc<Endpoint>,
    client: ProbeClient,
    every: ProbeIntervals,
    on_models: impl Fn() + Send + 'static,
) {
    tokio::spawn(async move {
        let mut models_due = Instant::now();
        let mut metrics_due = Instant::now();
        loop {
            let now = Instant::now();
            if now >= models_due {
                let r = get(&client, &endpoint.authority, "/v1/models", every.timeout).await;
                let reached = r.as_ref().map_or_else(|e| e.reached, |_| true);
                if endpoint.record_probe(reached, Instant::now()) {
                    tracing::warn!(endpoint = %endpoint.authority, "engine unreachable: ejected");
                }
                let r = r
                    .map_err(|e| e.message)
                    .and_then(|b| engine::parse_models(&b).map_err(|e| e.to_string()));
                if let Err(e) = &r {
                    tracing::debug!(endpoint = %endpoint.authority, error = %e, "model discovery failed");
                }
                let changed = r.as_ref().is_ok_and(|m| *m != endpoint.models());
                // Retry soon after a failure; the engine may be starting.
                models_due = Instant::now()
                    + if r.is_ok() {
                        every.models
                    } else {
                        every.models.min(Duration::from_secs(2))
                    };
                endpoint.set_models(r);
                if changed {
                    on_models();
                }
            }
            if now >= metrics_due {
                let before = endpoint.load.snapshot();
                match get(&client, &endpoint.authority, "/metrics", every.timeout).await {
                    Ok(b) => {
                        endpoint.record_probe(true, Instant::now());
                        let after = endpoint.load.snapshot();
                        let mut s = scraped(&String::from_utf8_lossy(&b), Instant::now());
                        s.own_requests = before.requests.max(after.requests);
                        s.own_prefilling = before.prefilling.max(after.prefilling);
                        endpoint.set_scraped(s);
                    }
                    Err(e) => {
                        tracing::debug!(endpoint = %endpoint.authority, error = %e, "metrics scrape failed");
                        if endpoint.record_probe(e.reached, Instant::now()) {
                            tracing::warn!(endpoint = %endpoint.authority, error = %e, "engine unreachable: ejected");
                        }
                    }
                }
                metrics_due = Instant::now() + every.metrics;
            }
            let next = models_due.min(metrics_due);
            tokio::select! {
                () = endpoint.stop.cancelled() => return,
                () = tokio::time::sleep_until(next) => {}
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrapes_read_the_shared_parser() {
        let s = scraped(
            "vllm:num_requests_running{engine=\"0\"} 3 1767225600000\nvllm:num_requests_waiting{engine=\"0\"} 2\n",
            Instant::now(),
        );
        assert!(
            (s.running - 3.0).abs() < 1e-9,
            "a trailing timestamp is not the value"
        );
        assert!((s.waiting - 2.0).abs() < 1e-9);
        let s = scraped(
            "sglang:num_running_reqs 4\nsglang:token_usage 0.5\n",
            Instant::now(),
        );
        assert!((s.running - 4.0).abs() < 1e-9 && (s.kv_usage - 0.5).abs() < 1e-9);
    }
}
