//! The OpenAI API: `POST /v1/chat/completions`, `POST /v1/completions`,
//! `GET /v1/models`.
//!
//! Each inference request is read whole (up to the body limit), checked for
//! what routing needs, resolved to worker sets, decided ([`crate::decide`]),
//! and proxied ([`crate::proxy`]). A connect failure, a 503, or probes
//! finding the engine gone before any byte moves it to the next best
//! endpoint; no response headers within the upstream timeout is a 504. The response streams back unchanged
//! with `x-kinference-endpoint` (and, with `x-kinference-debug: 1`, the
//! decision) added.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::time::Instant;

use kinference_scoring::Pick as _;

use crate::decide;
use crate::endpoint::EndpointId;
use crate::metrics::{DecisionLabels, RequestLabels, RetryLabels};
use crate::openai::{self, ApiError};
use crate::proxy::{self, Sent, TrackedBody};
use crate::state::{DecisionRecord, Shared};

/// Response bodies: proxied streams or small local answers.
pub type Body = UnsyncBoxBody<Bytes, proxy::BoxError>;

/// The endpoint that served a request.
pub const ENDPOINT_HEADER: HeaderName = HeaderName::from_static("x-kinference-endpoint");
/// The worker set that served a request.
pub const WORKER_SET_HEADER: HeaderName = HeaderName::from_static("x-kinference-worker-set");
/// vLLM's header choosing a data-parallel rank.
pub const DP_RANK_HEADER: HeaderName = HeaderName::from_static("x-data-parallel-rank");
/// Request header asking for the decision in the response.
pub const DEBUG_HEADER: HeaderName = HeaderName::from_static("x-kinference-debug");
/// Response header with the decision, when asked for.
pub const DECISION_HEADER: HeaderName = HeaderName::from_static("x-kinference-decision");
/// Response header with the full explanation (JSON), when asked for.
pub const EXPLAIN_HEADER: HeaderName = HeaderName::from_static("x-kinference-explain");

fn full(b: Bytes) -> Body {
    Full::new(b).map_err(|never| match never {}).boxed_unsync()
}

fn error(e: &ApiError) -> Response<Body> {
    e.response()
        .map(|b| b.map_err(|never| match never {}).boxed_unsync())
}

/// Serves the OpenAI API on `listener` until `shared.stop`, then lets
/// requests in flight finish (up to `drain`).
pub async fn run(shared: Arc<Shared>, listener: TcpListener, drain: Duration) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(shared.config.header_read_timeout);
    let slots = Arc::new(tokio::sync::Semaphore::new(shared.config.max_connections));
    loop {
        let slot = tokio::select! {
            () = shared.stop.cancelled() => break,
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
        };
        let accepted = tokio::select! {
            () = shared.stop.cancelled() => break,
            a = listener.accept() => a,
        };
        let (stream, _) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let s = shared.clone();
        let service = hyper::service::service_fn(move |req| {
            let s = s.clone();
            async move { Ok::<_, Infallible>(handle(s, req).await) }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(slot);
        });
    }
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still in flight after {drain:?}; closing");
    }
}

/// Handles one request.
pub async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path();
    match (req.method(), path) {
        (&Method::POST, "/v1/chat/completions") => {
            inference(shared, openai::Endpoint::Chat, req).await
        }
        (&Method::POST, "/v1/completions") => {
            inference(shared, openai::Endpoint::Completions, req).await
        }
        (&Method::GET, "/v1/models") => models(&shared),
        (m, "/v1/chat/completions" | "/v1/completions" | "/v1/models") => {
            error(&ApiError::method_not_allowed(m, path))
        }
        _ => error(&ApiError::not_found(path)),
    }
}

fn models(shared: &Shared) -> Response<Body> {
    let view = shared.view();
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let data: Vec<Value> = view
        .cards
        .iter()
        .map(|c| {
            serde_json::json!({
                "id": c.id,
                "object": "model",
                "created": created,
                "owned_by": "kinference",
                "root": c.root,
                "parent": null,
                "max_model_len": c.max_model_len,
            })
        })
        .collect();
    let body = serde_json::json!({"object": "list", "data": data});
    let mut r = Response::new(full(Bytes::from(
        serde_json::to_vec(&body).unwrap_or_default(),
    )));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn class(status: StatusCode) -> &'static str {
    match status.as_u16() {
        200..=299 => "2xx",
        400..=499 => "4xx",
        _ => "5xx",
    }
}

fn count(shared: &Shared, api: openai::Endpoint, status: StatusCode, started: Instant) {
    let labels = RequestLabels {
        api: api.label(),
        class: class(status),
    };
    shared.metrics.requests.get_or_create(&labels).inc();
    shared
        .metrics
        .request_duration
        .get_or_create(&labels)
        .observe(started.elapsed().as_secs_f64());
}

async fn inference(
    shared: Arc<Shared>,
    api: openai::Endpoint,
    req: Request<Incoming>,
) -> Response<Body> {
    let started = Instant::now();
    let resp = match route(&shared, api, req, started).await {
        Ok(r) => r,
        Err(e) => error(&e),
    };
    count(&shared, api, resp.status(), started);
    resp
}

/// Reads a request body of at most `limit` bytes within `timeout`.
///
/// A body over the limit is answered 413, but only after the rest of it has
/// been read and dropped (up to [`DISCARD_FACTOR`] × the limit, within the
/// same timeout): answering while the client is still sending makes the
/// kernel reset the connection, and most clients then report a broken pipe
/// instead of the 413 (nginx's lingering close does the same).
async fn read_body(body: Incoming, limit: usize, timeout: Duration) -> Result<Bytes, ApiError> {
    use hyper::body::Body as _;
    let mut body = body;
    if usize::try_from(body.size_hint().lower()).unwrap_or(usize::MAX)
        > limit.saturating_mul(DISCARD_FACTOR)
    {
        return Err(ApiError::too_large(limit)); // not worth reading
    }
    let deadline = Instant::now() + timeout;
    let mut buf = bytes::BytesMut::new();
    let mut seen: usize = 0;
    loop {
        let next = tokio::time::timeout_at(deadline, body.frame()).await;
        if seen > limit && matches!(next, Err(_) | Ok(None)) {
            // Drained (or out of time draining): answer the 413.
            return Err(ApiError::too_large(limit));
        }
        let frame = match next {
            Err(_) => return Err(ApiError::timeout(timeout)),
            Ok(None) => return Ok(buf.freeze()),
            Ok(Some(Err(e))) => {
                return Err(ApiError::invalid(
                    format!("Could not read the request body: {e}."),
                    None,
                ));
            }
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        seen = seen.saturating_add(data.len());
        if seen <= limit {
            buf.extend_from_slice(&data);
        } else {
            buf = bytes::BytesMut::new();
            if seen > limit.saturating_mul(DISCARD_FACTOR) {
                return Err(ApiError::too_large(limit));
            }
        }
    }
}

/// How much of an oversized body is read and dropped before answering 413.
const DISCARD_FACTOR: usize = 4;

async fn route(
    shared: &Arc<Shared>,
    api: openai::Endpoint,
    req: Request<Incoming>,
    started: Instant,
) -> Result<Response<Body>, ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = read_body(
        body,
        shared.config.body_limit,
        shared.config.body_read_timeout,
    )
    .await?;
    let parsed = openai::parse(api, &bytes)?;
    let view = shared.view();
    let Some(targets) = view.resolve(&parsed.model) else {
        if !shared.is_ready() {
            return Err(ApiError::unavailable(
                "The router is starting and has not listed its pool yet.",
            ));
        }
        return Err(ApiError::model_not_found(&parsed.model));
    };
    let targets = targets.to_vec();
    let debug = shared.config.debug_headers && parts.headers.contains_key(&DEBUG_HEADER);
    let stream = parsed.stream;
    let requested = parsed.model.clone();
    let body = Arc::new(Value::Object(parsed.body));
    let path_and_query = parts
        .uri
        .path_and_query()
        .map_or(api.path(), |p| p.as_str())
        .to_owned();

    let mut excluded: Vec<EndpointId> = Vec::new();
    let mut last_error = None;
    for attempt in 0..shared.config.max_attempts.max(1) {
        let ask = decide::Ask {
            api,
            body: &body,
            body_len: bytes.len(),
            explain: debug,
        };
        let d = decide::decide(shared, &view, &targets, &ask, &excluded).await;
        let d = match d {
            Ok(d) => d,
            Err(e) => return Err(last_error.unwrap_or(e)),
        };
        let rt = view.worker_sets[d.worker_set].runtime.clone();
        if attempt == 0 {
            shared
                .metrics
                .decision_duration
                .get_or_create(&DecisionLabels {
                    policy: shared.config.policy.as_str(),
                })
                .observe(started.elapsed().as_secs_f64());
        }
        let ws_name = view.worker_sets[d.worker_set].route.name.clone();
        let send_body = if d.model == requested {
            bytes.clone()
        } else {
            let mut b = (*body).clone();
            b["model"] = Value::String(d.model.clone());
            Bytes::from(serde_json::to_vec(&b).unwrap_or_default())
        };
        let mut headers = parts.headers.clone();
        headers.remove(&DEBUG_HEADER);
        if let Some(rank) = d.dp_rank {
            headers.insert(DP_RANK_HEADER, HeaderValue::from(rank));
        }
        let upstream =
            proxy::upstream_request(&d.endpoint.authority, &path_and_query, headers, send_body)
                .map_err(|e| ApiError::invalid(format!("Bad request target: {e}."), None))?;
        let mut inflight = d.endpoint.begin(
            u64::from(d.choice.uncached_tokens()),
            u64::from(d.prompt_tokens),
        );
        let predicted =
            Duration::from_secs_f64((d.choice.prediction.ttft_ms / 1000.0).clamp(0.0, 3600.0));
        let sent_at = Instant::now();
        let assume = (!stream).then(|| sent_at + predicted);
        match proxy::send(
            &shared.upstream,
            upstream,
            &mut inflight,
            assume,
            shared.config.upstream_timeout,
        )
        .await
        {
            Sent::Answered(resp) => {
                d.endpoint.record_success();
                if let Some(e) = &d.explanation {
                    let endpoints = view.worker_sets[d.worker_set]
                        .endpoints
                        .iter()
                        .map(|e| (e.id.0, e.authority.clone()))
                        .collect();
                    shared.record_decision(DecisionRecord {
                        at_ms: shared.now().as_secs_f64() * 1000.0,
                        model: requested.clone(),
                        worker_set: ws_name.clone(),
                        tokens: d.tokens.as_str(),
                        prompt_tokens: d.prompt_tokens,
                        blocks: d.keys.len(),
                        endpoints,
                        explanation: e.clone(),
                    });
                }
                let on_first = stream.then(|| {
                    let (shared, rt) = (shared.clone(), rt.clone());
                    let (endpoint, prediction) = (d.choice.endpoint, d.choice.prediction);
                    Box::new(move |ttft: Duration| {
                        shared.metrics.ttft.observe(ttft.as_secs_f64());
                        if prediction.ttft_ms > 0.0 {
                            shared
                                .metrics
                                .ttft_ratio
                                .observe(ttft.as_secs_f64() * 1000.0 / prediction.ttft_ms);
                        }
                        let now = shared.now();
                        rt.policy.lock().observe(endpoint, &prediction, ttft, now);
                    }) as proxy::OnFirstByte
                });
                let (mut rparts, rbody) = resp.into_parts();
                proxy::strip_hop_by_hop(&mut rparts.headers);
                if let Ok(v) = HeaderValue::from_str(&d.endpoint.authority) {
                    rparts.headers.insert(ENDPOINT_HEADER, v);
                }
                if let Ok(v) = HeaderValue::from_str(&ws_name) {
                    rparts.headers.insert(WORKER_SET_HEADER, v);
                }
                if debug {
                    if let Ok(v) = HeaderValue::from_str(&format!(
                        "{}; tokens={}",
                        d.choice,
                        d.tokens.as_str()
                    )) {
                        rparts.headers.insert(DECISION_HEADER, v);
                    }
                    if let Some(e) = &d.explanation
                        && let Ok(Ok(v)) = serde_json::to_string(e).map(HeaderValue::try_from)
                    {
                        rparts.headers.insert(EXPLAIN_HEADER, v);
                    }
                }
                let body = TrackedBody::new(
                    rbody,
                    inflight,
                    sent_at,
                    on_first,
                    shared.config.upstream_timeout,
                )
                .boxed_unsync();
                return Ok(Response::from_parts(rparts, body));
            }
            Sent::Retry(reason, why) => {
                tracing::debug!(endpoint = %d.endpoint.authority, %why, "retrying on another endpoint");
                if reason != proxy::RetryReason::Down {
                    // (Probes ejected it already.)
                    d.endpoint.record_failure(Instant::now());
                }
                shared
                    .metrics
                    .retries
                    .get_or_create(&RetryLabels {
                        reason: reason.label(),
                    })
                    .inc();
                excluded.push(d.endpoint.id);
                last_error = Some(ApiError::unavailable(format!(
                    "The engines serving this model did not take the request (last: {}: {why}).",
                    d.endpoint.authority
                )));
            }
            Sent::TimedOut(why) => {
                d.endpoint.record_failure(Instant::now());
                return Err(ApiError::gateway_timeout(format!(
                    "The engine {} did not answer: {why}.",
                    d.endpoint.authority
                )));
            }
            Sent::Failed(why) => {
                d.endpoint.record_failure(Instant::now());
                return Err(ApiError::bad_gateway(format!(
                    "The engine {} failed: {why}.",
                    d.endpoint.authority
                )));
            }
        }
    }
    Err(last_error.unwrap_or_else(|| ApiError::unavailable("No endpoint took the request.")))
}
