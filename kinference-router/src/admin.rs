//! The admin port: `/metrics`, `/healthz`, `/readyz`, `/debug/explain`,
//! `/debug/endpoints`, `/debug/kv`. Kept off the serving port so it can be
//! firewalled apart.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;

use crate::metrics::StateCollector;
use crate::state::Shared;

fn text(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn json(v: &impl serde::Serialize) -> Response<Full<Bytes>> {
    match serde_json::to_vec_pretty(v) {
        Ok(b) => text(StatusCode::OK, "application/json", b),
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            e.to_string(),
        ),
    }
}

/// The metrics registry with every router metric registered.
pub fn registry(shared: &Arc<Shared>) -> Registry {
    let mut registry = Registry::with_prefix("kinference_router");
    shared.metrics.register(&mut registry);
    registry.register_collector(Box::new(StateCollector(shared.clone())));
    registry
}

/// Answers one admin request.
pub fn handle(
    shared: &Shared,
    registry: &Registry,
    req: &Request<Incoming>,
) -> Response<Full<Bytes>> {
    if req.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n");
    }
    match req.uri().path() {
        "/metrics" => {
            let mut out = String::new();
            match prometheus_client::encoding::text::encode(&mut out, registry) {
                Ok(()) => text(
                    StatusCode::OK,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    out,
                ),
                Err(e) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    e.to_string(),
                ),
            }
        }
        "/healthz" => text(StatusCode::OK, "text/plain", "ok\n"),
        "/readyz" => {
            if shared.is_ready() {
                text(StatusCode::OK, "text/plain", "ready\n")
            } else {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    "not ready: the pool's objects have not all been listed yet\n",
                )
            }
        }
        "/debug/explain" => json(&shared.decisions()),
        "/debug/kv" => json(&kv_keys(shared, req.uri().query())),
        "/debug/endpoints" => json(&serde_json::json!({
            "ready": shared.is_ready(),
            "problems": shared.problems(),
            "worker_sets": shared.worker_set_reports(),
            "endpoints": shared.endpoint_reports(),
            "kv_index": {
                "entries": shared.kv.stats().entries,
                "bytes": shared.kv.stats().bytes,
            },
        })),
        _ => text(
            StatusCode::NOT_FOUND,
            "text/plain",
            "admin paths: /metrics /healthz /readyz /debug/explain /debug/endpoints /debug/kv\n",
        ),
    }
}

/// `/debug/kv[?endpoint=ADDR]`: the block keys the KV index holds per
/// worker (endpoint and DP rank), to audit against an engine's own view of
/// its cache. One pass over the index per worker listed.
fn kv_keys(shared: &Shared, query: Option<&str>) -> serde_json::Value {
    let only = query.and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("endpoint="))
            .map(str::to_owned)
    });
    let workers: Vec<serde_json::Value> = shared
        .kv
        .workers()
        .into_iter()
        .filter(|(_, r)| only.as_ref().is_none_or(|o| *o == r.endpoint))
        .map(|(id, r)| {
            let keys: Vec<u64> = shared.kv.worker_keys(id).into_iter().map(|k| k.0).collect();
            serde_json::json!({"endpoint": r.endpoint, "rank": r.dp_rank, "keys": keys})
        })
        .collect();
    serde_json::json!({ "workers": workers })
}

/// Serves the admin port until `shared.stop`.
pub async fn run(shared: Arc<Shared>, listener: TcpListener) {
    let registry = Arc::new(registry(&shared));
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        let accepted = tokio::select! {
            () = shared.stop.cancelled() => break,
            a = listener.accept() => a,
        };
        let Ok((stream, _)) = accepted else { continue };
        let (s, r) = (shared.clone(), registry.clone());
        let service = hyper::service::service_fn(move |req| {
            let resp = handle(&s, &r, &req);
            async move { Ok::<_, Infallible>(resp) }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
}
