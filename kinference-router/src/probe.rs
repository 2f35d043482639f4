//! Asking engines about themselves: `/v1/models` (discovery) and `/metrics`
//! (scraped load), periodically, per endpoint.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use tokio::time::Instant;

use crate::endpoint::{DiscoveredModel, Endpoint, Scraped};

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

/// How often and how patiently to probe.
#[derive(Clone, Copy, Debug)]
pub struct ProbeIntervals {
    /// Between `/v1/models` calls.
    pub models: Duration,
    /// Between `/metrics` scrapes.
    pub metrics: Duration,
    /// Per call.
    pub timeout: Duration,
}

impl Default for ProbeIntervals {
    fn default() -> Self {
        Self {
            models: Duration::from_secs(30),
            metrics: Duration::from_secs(5),
            timeout: Duration::from_secs(2),
        }
    }
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

/// Parses a vLLM `/v1/models` answer.
///
/// # Errors
/// When it is not the OpenAI list shape.
pub fn parse_models(body: &[u8]) -> Result<Vec<DiscoveredModel>, String> {
    #[derive(serde::Deserialize)]
    struct List {
        data: Vec<Card>,
    }
    #[derive(serde::Deserialize)]
    struct Card {
        id: String,
        #[serde(default)]
        max_model_len: Option<u64>,
        #[serde(default)]
        parent: Option<String>,
    }
    let list: List = serde_json::from_slice(body).map_err(|e| format!("/v1/models: {e}"))?;
    Ok(list
        .data
        .into_iter()
        .map(|c| DiscoveredModel {
            id: c.id,
            max_model_len: c.max_model_len,
            parent: c.parent,
        })
        .collect())
}

/// Reads the load figures a router needs from Prometheus text exposition of
/// vLLM's metrics. Running and waiting are summed over engines (DP ranks);
/// KV usage is the largest; old metric names are accepted. Unknown lines are
/// ignored.
pub fn parse_metrics(text: &str, at: Instant) -> Scraped {
    let mut s = Scraped {
        running: 0.0,
        waiting: 0.0,
        kv_usage: 0.0,
        block_size: None,
        own_requests: 0,
        own_prefilling: 0,
        at,
    };
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let Some((name_labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (name, labels) = match name_labels.find('{') {
            Some(i) => (&name_labels[..i], &name_labels[i..]),
            None => (name_labels, ""),
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        match name {
            "vllm:num_requests_running" => s.running += v,
            "vllm:num_requests_waiting" => s.waiting += v,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                s.kv_usage = s.kv_usage.max(v);
            }
            "vllm:cache_config_info" => {
                if let Some(b) = label(labels, "block_size").and_then(|b| b.parse().ok()) {
                    s.block_size = Some(b);
                }
            }
            _ => {}
        }
    }
    s
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let pat = format!("{key}=\"");
    let start = labels.find(&pat)? + pat.len();
    let rest = &labels[start..];
    Some(&rest[..rest.find('"')?])
}

pub use kinference_kvindex::KvSource;

/// Parses `/kv_event_sources` (see [`kinference_kvindex::parse_kv_event_sources`]).
/// Hosts are ignored (they may be wildcards): the caller uses the
/// endpoint's own address.
///
/// # Errors
/// When the body is not a JSON object.
pub fn parse_kv_sources(body: &[u8]) -> Result<Vec<KvSource>, String> {
    kinference_kvindex::parse_kv_event_sources(body)
}

/// Asks an engine where it publishes KV events. An engine without the
/// endpoint (older vLLM, SGLang) gives an error; callers fall back to the
/// worker set's port.
pub async fn kv_event_sources(
    client: &ProbeClient,
    authority: &str,
    timeout: Duration,
) -> Result<Vec<KvSource>, String> {
    let body = get(client, authority, "/kv_event_sources", timeout)
        .await
        .map_err(|e| e.message)?;
    parse_kv_sources(&body)
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
                let r = r.map_err(|e| e.message).and_then(|b| parse_models(&b));
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
                        let mut s = parse_metrics(&String::from_utf8_lossy(&b), Instant::now());
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
    fn models_parse_as_vllm_sends_them() {
        let body = br#"{"object":"list","data":[
            {"id":"Qwen/Qwen3-8B","object":"model","created":1,"owned_by":"vllm","root":"Qwen/Qwen3-8B","parent":null,"max_model_len":40960,"permission":[]},
            {"id":"sql-lora","object":"model","root":"/adapters/sql","parent":"Qwen/Qwen3-8B","max_model_len":null}]}"#;
        let m = parse_models(body).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].id, "Qwen/Qwen3-8B");
        assert_eq!(m[0].max_model_len, Some(40960));
        assert_eq!(m[1].parent.as_deref(), Some("Qwen/Qwen3-8B"));
        assert!(parse_models(b"{\"object\":\"error\"}").is_err());
    }

    #[test]
    fn metrics_parse_with_labels_and_ranks() {
        let text = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0"} 1.0
vllm:prefix_cache_hits_total{engine="0"} 12.0
garbage line
"#;
        let s = parse_metrics(text, Instant::now());
        assert!((s.running - 5.0).abs() < 1e-9);
        assert!((s.waiting - 7.0).abs() < 1e-9);
        assert!((s.kv_usage - 0.5).abs() < 1e-9);
        assert_eq!(s.block_size, Some(16));
    }
}
