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

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use tokio::time::Instant;

use crate::reports;
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
        "/readyz" => match shared.readiness() {
            Ok(()) => text(StatusCode::OK, "text/plain", "ready\n"),
            Err(why) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                format!("not ready: {why}\n"),
            ),
        },
        "/debug/explain" => json(&shared.explanations.all()),
        "/debug/kv" => json(&kv_keys(shared, req.uri().query())),
        "/debug/endpoints" => {
            let view = shared.view();
            let stats = shared.kv.index().stats();
            json(&serde_json::json!({
                "ready": shared.is_ready(),
                "not_ready_because": shared.readiness().err(),
                "problems": *shared.runtime.problems(),
                "peers": shared.runtime.peer_state.read().clone(),
                "kv_bootstrap": shared.kv.bootstrap_report(),
                "worker_sets": reports::worker_set_reports(&view),
                "endpoints": reports::endpoint_reports(&view, &shared.kv, Instant::now(), Some(shared.now())),
                "kv_index": {
                    "entries": stats.entries,
                    "bytes": stats.bytes,
                    "sessions": stats.sessions,
                },
            }))
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "text/plain",
            "admin paths: /metrics /healthz /readyz /debug/explain /debug/endpoints /debug/kv\n",
        ),
    }
}

/// Counts a load poll answered in [`crate::peers::Traffic`].
fn count_load(shared: &Shared, req: &Request<Incoming>, resp: &Response<Full<Bytes>>) {
    use hyper::body::Body as _;
    use std::sync::atomic::Ordering;
    let t = &shared.runtime.peer_traffic;
    let pq = req.uri().path_and_query().map_or("", |p| p.as_str());
    t.load_received.fetch_add(
        crate::peers::head_bytes("GET  HTTP/1.1".len() + pq.len(), req.headers()),
        Ordering::Relaxed,
    );
    let body = resp.body().size_hint().exact().unwrap_or(0);
    t.load_sent.fetch_add(
        crate::peers::response_bytes(resp.status(), resp.headers(), body as usize, true),
        Ordering::Relaxed,
    );
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
    let index = shared.kv.index();
    let workers: Vec<serde_json::Value> = index
        .workers()
        .into_iter()
        .filter(|(_, r)| only.as_ref().is_none_or(|o| *o == r.endpoint))
        .map(|(id, r)| {
            let keys: Vec<u64> = index.worker_keys(id).into_iter().map(|k| k.0).collect();
            serde_json::json!({"endpoint": r.endpoint, "rank": r.dp_rank, "keys": keys})
        })
        .collect();
    serde_json::json!({ "workers": workers })
}

/// `GET /peer/load`: this replica's load report, with its version; with
/// `?after=V&wait_ms=W`, once the version differs from `V` or after `W`
/// (a long poll, [`crate::peers`]).
async fn load(shared: &Shared, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let token = shared.config.peers.as_ref().and_then(|p| p.token.as_ref());
    let resp = if crate::peers::allowed(token, req.headers()) {
        let (version, after) = match crate::peers::long_poll_query(req.uri().query()) {
            Some((after, wait)) => {
                let v = tokio::select! {
                    v = crate::peers::wait_for_change(after, wait) => v,
                    () = shared.runtime.stop.cancelled() => crate::peers::version(),
                };
                (v, Some(after))
            }
            None => (crate::peers::version(), None),
        };
        let mut r = text(
            StatusCode::OK,
            "application/json",
            serde_json::to_vec(&crate::peers::report(shared, after)).unwrap_or_default(),
        );
        r.headers_mut()
            .insert(crate::peers::VERSION_HEADER, HeaderValue::from(version));
        r
    } else {
        text(
            StatusCode::UNAUTHORIZED,
            "text/plain",
            "peer token required\n",
        )
    };
    count_load(shared, req, &resp);
    resp
}

/// Serves the admin port until `shared.stop`.
pub async fn run(shared: Arc<Shared>, listener: TcpListener) {
    let registry = Arc::new(registry(&shared));
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        let accepted = tokio::select! {
            () = shared.runtime.stop.cancelled() => break,
            a = listener.accept() => a,
        };
        let Ok((stream, _)) = accepted else { continue };
        let (s, r) = (shared.clone(), registry.clone());
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let (s, r) = (s.clone(), r.clone());
            async move {
                // The snapshot is encoded on the blocking pool; the rest
                // answers at once.
                let get = req.method() == Method::GET;
                let resp = if get && req.uri().path() == crate::snapshot::SNAPSHOT_PATH {
                    crate::snapshot::serve(s, req).await
                } else if get && req.uri().path() == crate::peers::LOAD_PATH {
                    load(&s, &req).await
                } else {
                    handle(&s, &r, &req)
                };
                Ok::<_, Infallible>(resp)
            }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
}

/// Reads the router's state at scrape time.
#[derive(Debug)]
pub struct StateCollector(pub Arc<Shared>);

/// Labels of per-engine figures: `engine`, not `endpoint` (the Prometheus
/// Operator sets `endpoint` on every series it scrapes).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EngineLabels {
    /// `address:port`.
    engine: String,
    /// The worker sets listing it (comma-separated when several do).
    worker_set: String,
}

impl EngineLabels {
    fn of(r: &crate::reports::EndpointReport) -> Self {
        Self {
            engine: r.endpoint.clone(),
            worker_set: r.worker_sets.join(","),
        }
    }
}

use crate::metrics::WorkerSetLabels;

/// Labels of `peer_bytes`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerBytesLabels {
    /// `load` or `snapshot`.
    kind: String,
    /// `sent` or `received`.
    direction: String,
}

/// Labels of `kv_bootstrap_fallbacks`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    /// [`crate::snapshot::Fallback::label`].
    reason: String,
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

fn single_counter(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    v: u64,
) -> Result<(), std::fmt::Error> {
    let e = encoder.encode_descriptor(
        name,
        help,
        None,
        prometheus_client::metrics::MetricType::Counter,
    )?;
    ConstCounter::new(v).encode(e)
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
        let stats = shared.kv.index().stats();
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
            "kv_index_max_entries",
            "The KV index's budget of entries (from the container's memory limit unless set)",
            shared.config.kv_max_entries as f64,
        )?;
        single_counter(
            &mut encoder,
            "kv_index_evicted_entries",
            "Entries the KV index evicted to stay within its budget",
            stats.evicted_entries,
        )?;
        single_gauge(
            &mut encoder,
            "kv_index_sessions",
            "Sessions the engines' KV events named (session_id), remembered for routing a session's next request",
            stats.sessions as f64,
        )?;
        single_gauge(
            &mut encoder,
            "ready",
            "1 once the pool's objects have all been listed (the admin port's /readyz and the serving port's /ready)",
            if shared.readiness().is_ok() { 1.0 } else { 0.0 },
        )?;
        let (known, reporting) = {
            let p = shared.runtime.peer_state.read();
            let staleness = shared.config.peers.as_ref().map_or(0, |s| {
                u64::try_from(s.staleness.as_millis()).unwrap_or(u64::MAX)
            });
            (
                p.peers.len(),
                p.peers
                    .iter()
                    .filter(|x| x.report_age_ms.is_some_and(|a| a <= staleness))
                    .count(),
            )
        };
        single_gauge(
            &mut encoder,
            "peers",
            "Other replicas of this router found (--peer-service, --peers)",
            known as f64,
        )?;
        single_gauge(
            &mut encoder,
            "peers_reporting",
            "Peers whose load report is fresh (within --peer-staleness); the others count for nothing",
            reporting as f64,
        )?;
        let t = &shared.runtime.peer_traffic;
        let bytes = |kind: &str, direction: &str, v: &std::sync::atomic::AtomicU64| {
            (
                PeerBytesLabels {
                    kind: kind.into(),
                    direction: direction.into(),
                },
                v.load(std::sync::atomic::Ordering::Relaxed),
            )
        };
        counter(
            &mut encoder,
            "peer_bytes",
            "Bytes of HTTP/1.1 messages (start lines, headers, bodies) exchanged with peer replicas: load polls and KV index snapshots, as this replica sent and received them",
            &[
                bytes("load", "sent", &t.load_sent),
                bytes("load", "received", &t.load_received),
                bytes("snapshot", "sent", &t.snapshot_sent),
                bytes("snapshot", "received", &t.snapshot_received),
            ],
        )?;
        let boot = shared.kv.bootstrap_report();
        counter(
            &mut encoder,
            "kv_bootstrap_fallbacks",
            "Starts that served without a peer's KV index snapshot, by reason (the log and /debug/endpoints say more)",
            &crate::snapshot::Fallback::ALL
                .iter()
                .map(|f| {
                    (
                        ReasonLabels {
                            reason: f.label().into(),
                        },
                        u64::from(boot.fallback == Some(*f)),
                    )
                })
                .collect::<Vec<_>>(),
        )?;
        single_gauge(
            &mut encoder,
            "kv_bootstrap_waiting",
            "1 while readiness waits for a peer's KV index snapshot (at most --peer-bootstrap-timeout)",
            if shared.kv.seeding_wait(Instant::now()).is_some() {
                1.0
            } else {
                0.0
            },
        )?;
        single_gauge(
            &mut encoder,
            "config_problems",
            "Problems with the pool's objects (see /debug/endpoints): missing worker sets, unresolvable ports, unknown profiles",
            shared.runtime.problems().len() as f64,
        )?;

        let view = shared.view();
        // The gauges below read no calibration: no policy lock per scrape.
        let endpoints = reports::endpoint_reports(&view, &shared.kv, Instant::now(), None);
        single_gauge(
            &mut encoder,
            "kv_bootstrap_blocks",
            "Blocks the KV-event streams subscribed now imported from a peer's snapshot when this replica started",
            endpoints
                .iter()
                .flat_map(|r| r.kv.iter().flatten())
                .map(|k| k.seeded_blocks)
                .sum::<u64>() as f64,
        )?;
        let ep = |f: &dyn Fn(&crate::reports::EndpointReport) -> f64| -> Vec<(EngineLabels, f64)> {
            endpoints
                .iter()
                .map(|r| (EngineLabels::of(r), f(r)))
                .collect()
        };
        gauge(
            &mut encoder,
            "engine_in_flight_requests",
            "Requests this router has in flight per endpoint",
            &ep(&|r| f64::from(r.load.requests)),
        )?;
        gauge(
            &mut encoder,
            "engine_prefill_tokens",
            "Uncached prompt tokens of requests before their first token",
            &ep(&|r| r.load.prefill_tokens as f64),
        )?;
        gauge(
            &mut encoder,
            "engine_healthy",
            "1 when the endpoint takes requests, 0 while ejected",
            &ep(&|r| if r.healthy { 1.0 } else { 0.0 }),
        )?;
        gauge(
            &mut encoder,
            "engine_kv_connected",
            "KV-event streams (DP ranks) connected",
            &ep(&|r| r.kv.iter().flatten().filter(|k| k.connected).count() as f64),
        )?;
        gauge(
            &mut encoder,
            "engine_kv_blocks",
            "Blocks the KV index holds for the endpoint",
            &ep(&|r| r.kv.iter().flatten().map(|k| k.blocks_held).sum::<u64>() as f64),
        )?;
        gauge(
            &mut encoder,
            "engine_queue_depth",
            "Requests waiting in the engine's own queue (vllm:num_requests_waiting, sglang:num_queue_reqs), as last scraped",
            &endpoints
                .iter()
                .filter_map(|r| r.scraped.as_ref().map(|s| (EngineLabels::of(r), s.waiting)))
                .collect::<Vec<_>>(),
        )?;
        gauge(
            &mut encoder,
            "engine_kv_last_event_age_seconds",
            "Seconds since the engine's last KV event (oldest among its DP ranks; absent before the first)",
            &endpoints
                .iter()
                .filter_map(|r| {
                    let ages = r.kv.as_ref()?.iter().filter_map(|k| k.last_event_age_s);
                    ages.reduce(f64::max).map(|a| (EngineLabels::of(r), a))
                })
                .collect::<Vec<_>>(),
        )?;
        let kv_counter = |f: &dyn Fn(&crate::kv::KvReport) -> u64| -> Vec<(EngineLabels, u64)> {
            endpoints
                .iter()
                .filter_map(|r| {
                    r.kv.as_ref()
                        .map(|k| (EngineLabels::of(r), k.iter().map(f).sum()))
                })
                .collect()
        };
        counter(
            &mut encoder,
            "engine_kv_batches",
            "KV-event batches received",
            &kv_counter(&|k| k.batches),
        )?;
        counter(
            &mut encoder,
            "engine_kv_gaps",
            "KV-event sequence gaps",
            &kv_counter(&|k| k.gaps),
        )?;
        counter(
            &mut encoder,
            "engine_kv_replays",
            "KV-event replays",
            &kv_counter(&|k| k.replays),
        )?;
        counter(
            &mut encoder,
            "engine_kv_restarts",
            "KV-event publisher restarts (sequence went down)",
            &kv_counter(&|k| k.restarts),
        )?;
        counter(
            &mut encoder,
            "engine_kv_decode_errors",
            "KV-event batches that failed to decode",
            &kv_counter(&|k| k.decode_errors),
        )?;

        let sets = reports::worker_set_reports(&view);
        let ws_rows =
            |f: &dyn Fn(&crate::reports::WorkerSetReport) -> u64| -> Vec<(WorkerSetLabels, u64)> {
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
            "tokenizer_unavailable",
            "1 when the worker set's local tokenizer could not be loaded and it routes on load alone",
            &sets
                .iter()
                .map(|s| {
                    (
                        WorkerSetLabels {
                            worker_set: s.name.clone(),
                        },
                        if matches!(s.tokenizer, crate::runtime::TokenizerState::Failed(_)) {
                            1.0
                        } else {
                            0.0
                        },
                    )
                })
                .collect::<Vec<_>>(),
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
