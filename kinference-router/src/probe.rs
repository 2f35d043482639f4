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
use http::HeaderValue;

use crate::endpoint::{Endpoint, Outcome, Scraped};
use crate::kv::Publisher;

/// The largest probe answer read (`/metrics`, `/v1/models`, `/kv_event_sources`).
pub const MAX_PROBE_BODY: usize = 1 << 20;

/// The HTTP client for probes (small bodies, no streaming).
pub type ProbeClient = Client<HttpConnector, Empty<Bytes>>;

/// An error with its sources, `outer: inner: …` (hyper's client errors say
/// "client error (Connect)" and keep the cause in their source).
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s = format!("{s}: {x}");
        src = x.source();
    }
    s
}

/// A probe client with a connect timeout.
pub fn client(connect_timeout: Duration) -> ProbeClient {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(connect_timeout));
    http.set_nodelay(true);
    Client::builder(hyper_util::rt::TokioExecutor::new()).build(http)
}

/// A probe that failed, and what that says about the engine's health.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeError {
    /// [`Outcome::Success`]: the engine answered, with an error that says
    /// nothing about its health (a 4xx, a body too large or of the wrong
    /// shape); [`Outcome::ServerError`]: a 5xx; [`Outcome::ConnectFailure`]:
    /// nothing listening, or the connection broke; [`Outcome::Timeout`]: no
    /// answer in time.
    pub outcome: Outcome,
    /// What went wrong.
    pub message: String,
}

impl ProbeError {
    /// Whether the engine answered at all.
    pub fn reached(&self) -> bool {
        matches!(self.outcome, Outcome::Success | Outcome::ServerError)
    }
}

impl std::fmt::Display for ProbeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// `GET http://{authority}{path}` within `timeout`, with `auth` as the
/// `Authorization` header when the engines need an API key.
pub async fn get(
    client: &ProbeClient,
    authority: &str,
    path: &str,
    auth: Option<&HeaderValue>,
    timeout: Duration,
) -> Result<Bytes, ProbeError> {
    let fail = |outcome: Outcome, message: String| ProbeError { outcome, message };
    let mut req = http::Request::get(format!("http://{authority}{path}"));
    if let Some(a) = auth {
        req = req.header(http::header::AUTHORIZATION, a.clone());
    }
    let req = req.body(Empty::new()).map_err(|e| {
        fail(
            Outcome::ConnectFailure,
            format!("bad address {authority}: {e}"),
        )
    })?;
    let call = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| fail(Outcome::ConnectFailure, format!("GET {path}: {e}")))?;
        let status = resp.status();
        // Engines are trusted, but a probe answer is never worth more memory than this.
        let body = http_body_util::Limited::new(resp.into_body(), MAX_PROBE_BODY)
            .collect()
            .await
            .map_err(|e| {
                let outcome = if e.is::<http_body_util::LengthLimitError>() {
                    Outcome::Success
                } else {
                    Outcome::ConnectFailure
                };
                fail(
                    outcome,
                    format!("GET {path}: reading the body (at most {MAX_PROBE_BODY} bytes): {e}"),
                )
            })?
            .to_bytes();
        if status.is_server_error() {
            return Err(fail(
                Outcome::ServerError,
                format!("GET {path}: HTTP {status}"),
            ));
        }
        if !status.is_success() {
            return Err(fail(Outcome::Success, format!("GET {path}: HTTP {status}")));
        }
        Ok(body)
    };
    tokio::time::timeout(timeout, call).await.map_err(|_| {
        fail(
            Outcome::Timeout,
            format!("GET {path}: no answer within {timeout:?}"),
        )
    })?
}

/// The load figures of a `/metrics` answer (vLLM or SGLang names) read at
/// `at`.
pub fn scraped(l: &engine::LoadFigures, at: Instant) -> Scraped {
    Scraped {
        running: l.running,
        waiting: l.waiting,
        kv_usage: l.kv_usage,
        block_size: l.block_size,
        family: l.family,
        own_requests: 0,
        own_prefilling: 0,
        at,
    }
}

/// An endpoint whose KV publishers are looked for.
#[derive(Clone, Copy, Debug)]
pub struct KvTarget<'a> {
    /// Its HTTP `address:port`.
    pub authority: &'a str,
    /// Its pod address (what publishers are dialled at).
    pub address: &'a str,
    /// The worker set's KV port, resolved for it.
    pub kv_port: u16,
    /// The worker set's replay port, resolved for it.
    pub replay_port: Option<u16>,
}

/// Where an endpoint publishes its KV events, by [`engine::publishers`]: every DP rank its `/kv_event_sources`
/// lists (vLLM ≥ 0.31), else what SGLang's `/server_info` says, else rank 0
/// on the worker set's KV port with the worker set's replay port
/// (`kvEvents.replayPort`), or the KV port plus `replay_offset` when the
/// router was told that convention (0: no replay). Hosts the engine names
/// are never dialled: only its own address. With them, the KV-cache size
/// `/server_info` gives (SGLang's `max_total_num_tokens`), if read.
pub async fn kv_publishers(
    client: &ProbeClient,
    target: &KvTarget<'_>,
    replay_offset: u16,
    auth: Option<&HeaderValue>,
    timeout: Duration,
) -> (Vec<Publisher>, Option<u64>) {
    let KvTarget {
        authority,
        address,
        kv_port,
        replay_port,
    } = *target;
    let host = if address.contains(':') {
        format!("[{address}]")
    } else {
        address.to_owned()
    };
    let listed = match get(client, authority, "/kv_event_sources", auth, timeout).await {
        Ok(body) => engine::parse_kv_event_sources(&body).ok(),
        Err(_) => None,
    };
    let info = if listed.is_none() {
        match get(client, authority, "/server_info", auth, timeout).await {
            Ok(body) => engine::parse_server_info(&body).ok(),
            Err(_) => None,
        }
    } else {
        None
    };
    let replay_port = replay_port.or_else(|| {
        (replay_offset != 0)
            .then(|| kv_port.checked_add(replay_offset))
            .flatten()
    });
    let publishers = engine::publishers(listed, info.as_ref(), kv_port, replay_port)
        .into_iter()
        .map(|s| Publisher {
            rank: s.rank,
            endpoint: format!("tcp://{host}:{}", s.port),
            replay: s.replay_port.map(|p| format!("tcp://{host}:{p}")),
            topic: s.topic,
        })
        .collect();
    (publishers, info.and_then(|i| i.kv_capacity_tokens))
}

/// Polls one endpoint until it leaves: `/health` and `/metrics` every
/// `every.metrics`, `/v1/models` every `every.models`. `/health` is the
/// liveness probe ([`Endpoint::record_probe`]: nothing listening or a 5xx
/// ejects; timeouts eject for new requests only); the others feed health
/// only when nothing answers. `auth` is the engines' API key, if any.
pub fn spawn(
    endpoint: Arc<Endpoint>,
    client: ProbeClient,
    every: ProbeIntervals,
    auth: Option<HeaderValue>,
    on_models: impl Fn() + Send + 'static,
) {
    tokio::spawn(async move {
        let mut models_due = Instant::now();
        let mut metrics_due = Instant::now();
        let auth = auth.as_ref();
        let probe = |outcome: Outcome, what: &str, error: Option<&ProbeError>| {
            if endpoint.record_probe(outcome, Instant::now()) {
                let error = error.map(ToString::to_string).unwrap_or_default();
                tracing::warn!(endpoint = %endpoint.authority, probe = what, %error, "engine unhealthy: ejected");
            }
        };
        loop {
            let now = Instant::now();
            if now >= models_due {
                let r = get(
                    &client,
                    &endpoint.authority,
                    "/v1/models",
                    auth,
                    every.timeout,
                )
                .await;
                if let Err(e) = &r
                    && !e.reached()
                {
                    probe(e.outcome, "/v1/models", Some(e));
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
                if let Ok(v) = get(
                    &client,
                    &endpoint.authority,
                    "/version",
                    auth,
                    every.timeout,
                )
                .await
                .map_err(|e| e.message)
                .and_then(|b| engine::parse_version(&b).map_err(|e| e.to_string()))
                {
                    endpoint.set_version(v);
                }
            }
            if now >= metrics_due {
                match get(&client, &endpoint.authority, "/health", auth, every.timeout).await {
                    Ok(_) => probe(Outcome::Success, "/health", None),
                    // An engine without /health (a 404) answered all the same.
                    Err(e) => probe(e.outcome, "/health", Some(&e)),
                }
                let before = endpoint.load.snapshot();
                match get(
                    &client,
                    &endpoint.authority,
                    "/metrics",
                    auth,
                    every.timeout,
                )
                .await
                {
                    Ok(b) => {
                        let after = endpoint.load.snapshot();
                        let at = Instant::now();
                        let (load, adapters) = engine::parse_scrape(&String::from_utf8_lossy(&b));
                        let mut s = scraped(&load, at);
                        s.own_requests = before.requests.max(after.requests);
                        s.own_prefilling = before.prefilling.max(after.prefilling);
                        endpoint.set_scraped(s);
                        if let Some(tokens) = load.kv_capacity_tokens {
                            endpoint.set_kv_capacity_tokens(tokens);
                        }
                        endpoint.adapters.set_scraped(adapters, at);
                    }
                    Err(e) => {
                        tracing::debug!(endpoint = %endpoint.authority, error = %e, "metrics scrape failed");
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
        let read = |text: &str| scraped(&engine::parse_scrape(text).0, Instant::now());
        let s = read(
            "vllm:num_requests_running{engine=\"0\"} 3 1767225600000\nvllm:num_requests_waiting{engine=\"0\"} 2\n",
        );
        assert!(
            (s.running - 3.0).abs() < 1e-9,
            "a trailing timestamp is not the value"
        );
        assert!((s.waiting - 2.0).abs() < 1e-9);
        let s = read("sglang:num_running_reqs 4\nsglang:token_usage 0.5\n");
        assert!((s.running - 4.0).abs() < 1e-9 && (s.kv_usage - 0.5).abs() < 1e-9);
    }
}
