//! The OpenAI API: `POST /v1/chat/completions` and `/v1/completions`
//! (routed on their cached prefix), `/v1/embeddings`, `/v1/responses`,
//! `/v1/messages` (Anthropic's), `/tokenize` and `/detokenize` (routed on
//! load, passed through), `GET /v1/models[/{id}]`, `/health` and `/ready`;
//! and the request path that runs its stages.
//!
//! ```text
//! body ─▶ prepare ─▶ decide ─▶ commit ─▶ proxy ─▶ (stream back) ─▶ feedback
//!          once       ▲                    │
//!                     └──── retry ◀────────┘  refused before any byte
//! ```
//!
//! Each inference request is read whole (up to the body limit) and
//! prepared once ([`crate::prepare`]: fields, targets, token ids, keys).
//! Then, per attempt: [`crate::decide`] proposes an endpoint,
//! [`crate::commit`] records the attempt, [`crate::proxy`] sends it. A
//! connect failure, a 503, or probes finding the engine gone before any
//! byte moves the request to the next best endpoint (back at decide, the
//! refused endpoint excluded and the attempt's record withdrawn); no
//! response headers within the upstream timeout is a 504. The response
//! streams back unchanged with `x-kinference-endpoint` (and, with
//! `x-kinference-debug: 1`, the decision) added; its first bytes feed
//! [`crate::feedback`].

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

use crate::decide::{self, Now};
use crate::endpoint::{EndpointId, Outcome};
use crate::exchange::{Exchange, REQUEST_ID_HEADER};
use crate::metrics::{DecisionLabels, ReasonLabels, RetryLabels};
use crate::openai::{self, ApiError};
use crate::proxy::{self, Sent, TrackedBody};
use crate::reports::DecisionRecord;
use crate::state::Shared;
use crate::telemetry::SPAN_TARGET;
use crate::{commit, feedback, prepare};
use tracing::Instrument as _;

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
            () = shared.runtime.stop.cancelled() => break,
            s = slots.clone().acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
        };
        let accepted = tokio::select! {
            () = shared.runtime.stop.cancelled() => break,
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
        let watcher = graceful.watcher();
        match shared.config.security.tls.clone() {
            None => {
                let conn = builder
                    .serve_connection(TokioIo::new(stream), service)
                    .into_owned();
                let conn = watcher.watch(conn);
                tokio::spawn(async move {
                    let _ = conn.await;
                    drop(slot);
                });
            }
            Some(tls) => {
                // The handshake runs in the connection's task, within the
                // header timeout: a slow client holds only its own slot.
                let (builder, timeout) = (builder.clone(), shared.config.header_read_timeout);
                tokio::spawn(async move {
                    match tokio::time::timeout(timeout, tls.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            let conn = builder
                                .serve_connection(TokioIo::new(stream), service)
                                .into_owned();
                            let _ = watcher.watch(conn).await;
                        }
                        Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                    drop(slot);
                });
            }
        }
    }
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still in flight after {drain:?}; closing");
    }
}

/// Handles one request.
pub async fn handle(shared: Arc<Shared>, mut req: Request<Incoming>) -> Response<Body> {
    if let Some(keys) = &shared.config.security.client_keys
        && !matches!(req.uri().path(), "/health" | "/ready")
    {
        // The key's tenant and priority go with the request (crate::admit).
        let Some(class) = keys.check(req.headers()) else {
            let path = req.uri().path();
            let api = openai::Endpoint::ALL
                .iter()
                .find(|e| e.path() == path)
                .map_or("other", |e| e.label());
            return local(&shared, api, &req, error(&ApiError::unauthorized()));
        };
        req.extensions_mut().insert(class);
    }
    let path = req.uri().path();
    match (req.method(), path) {
        (&Method::POST, "/v1/chat/completions") => {
            inference(shared, openai::Endpoint::Chat, req).await
        }
        (&Method::POST, "/v1/completions") => {
            inference(shared, openai::Endpoint::Completions, req).await
        }
        (&Method::POST, "/v1/embeddings") => {
            inference(shared, openai::Endpoint::Embeddings, req).await
        }
        (&Method::POST, "/v1/responses") => {
            inference(shared, openai::Endpoint::Responses, req).await
        }
        (&Method::POST, "/v1/messages") => inference(shared, openai::Endpoint::Messages, req).await,
        (&Method::POST, "/tokenize") => inference(shared, openai::Endpoint::Tokenize, req).await,
        (&Method::POST, "/detokenize") => {
            inference(shared, openai::Endpoint::Detokenize, req).await
        }
        // SGLang's native API (its HTTP server takes PUT as well).
        (&Method::POST | &Method::PUT, "/generate") => {
            inference(shared, openai::Endpoint::Generate, req).await
        }
        // Load balancers' and gateways' health checks: the process serves
        // (`/health`, as vLLM's), and its view of the pool is loaded
        // (`/ready`, as the admin port's `/readyz`).
        (&Method::GET | &Method::HEAD, "/health") => plain(StatusCode::OK, "ok\n"),
        (&Method::GET | &Method::HEAD, "/ready") => match shared.readiness() {
            Ok(()) => plain(StatusCode::OK, "ready\n"),
            Err(why) => {
                let mut r = Response::new(full(Bytes::from(format!("not ready: {why}\n"))));
                *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                r
            }
        },
        // A stored response lives on the engine that made it (crate::stored).
        (&Method::GET, p) if stored_id(p, "").is_some() => {
            let id = stored_id(p, "").unwrap_or_default();
            stored_response(shared, req, id).await
        }
        (&Method::POST, p) if stored_id(p, "/cancel").is_some() => {
            let id = stored_id(p, "/cancel").unwrap_or_default();
            stored_response(shared, req, id).await
        }
        (&Method::GET, "/v1/models") => local(&shared, "models", &req, models(&shared)),
        (&Method::GET, p) if p.starts_with("/v1/models/") => {
            let id = percent_decode(&p["/v1/models/".len()..]);
            let resp = model(&shared, &id);
            local(&shared, "models", &req, resp)
        }
        (m, p)
            if p == "/v1/models"
                || p == "/health"
                || p == "/ready"
                || openai::Endpoint::ALL.iter().any(|e| e.path() == p) =>
        {
            error(&ApiError::method_not_allowed(m, path))
        }
        _ => error(&ApiError::not_found(path)),
    }
}

fn plain(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut r = Response::new(full(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// The response id in `/v1/responses/{id}{suffix}`, decoded (one
/// non-empty path segment).
fn stored_id(path: &str, suffix: &str) -> Option<String> {
    let id = path.strip_prefix("/v1/responses/")?.strip_suffix(suffix)?;
    (!id.is_empty() && !id.contains('/')).then(|| percent_decode(id))
}

/// `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`: passed
/// to the engine that keeps the response ([`crate::stored`]); when none
/// does, vLLM's own 404.
async fn stored_response(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    id: String,
) -> Response<Body> {
    let started = Instant::now();
    let head = (req.method(), req.uri().path());
    let mut x = Exchange::start(
        &shared,
        openai::Endpoint::Responses.label(),
        head,
        req.headers(),
        started,
    );
    let request_id = x.id.clone();
    let (parts, body) = req.into_parts();
    let result = async {
        let bytes = read_body(
            body,
            shared.config.body_limit,
            shared.config.body_read_timeout,
        )
        .await?;
        let mut headers = parts.headers;
        headers.remove(&DEBUG_HEADER);
        headers.insert(REQUEST_ID_HEADER, request_id.clone());
        for_engine(&shared, &mut headers);
        let view = shared.view();
        let path_and_query = parts
            .uri
            .path_and_query()
            .map_or(parts.uri.path(), |p| p.as_str());
        // A retrieval is a GET like the search's: the holder's answer to it
        // is the client's. A cancel is sent once the holder is known.
        let ask = if parts.method == Method::GET {
            path_and_query.to_owned()
        } else {
            crate::stored::path(&id)
        };
        let Some(found) = crate::stored::holder(&shared, &view, &id, &ask, &headers).await else {
            return Err(ApiError::response_not_found(&id));
        };
        let e = found.endpoint;
        let resp = if let Some(answer) = found.answer {
            answer
        } else {
            let upstream =
                proxy::upstream(parts.method, &e.authority, path_and_query, headers, bytes)
                    .map_err(|err| {
                        ApiError::invalid(format!("Bad request target: {err}."), None)
                    })?;
            tokio::time::timeout(
                shared.config.upstream_timeout,
                shared.runtime.upstream.request(upstream),
            )
            .await
            .map_err(|_| {
                ApiError::gateway_timeout(format!("The engine {} did not answer.", e.authority))
            })?
            .map_err(|err| {
                ApiError::bad_gateway(format!("The engine {} failed: {err}.", e.authority))
            })?
        };
        let (mut rparts, rbody) = resp.into_parts();
        proxy::strip_hop_by_hop(&mut rparts.headers);
        if let Some(v) = &e.authority_header {
            rparts.headers.insert(ENDPOINT_HEADER, v.clone());
        }
        Ok(Response::from_parts(
            rparts,
            rbody.map_err(Into::into).boxed_unsync(),
        ))
    }
    .await;
    let mut resp = match result {
        Ok(resp) => resp,
        Err(e) => error(&e),
    };
    x.status(resp.status());
    resp.headers_mut().insert(REQUEST_ID_HEADER, request_id);
    resp
}

/// The client's headers as an engine gets them: the client's key out when
/// the router checked it, the engines' key in.
fn for_engine(shared: &Shared, headers: &mut http::HeaderMap) {
    let security = &shared.config.security;
    crate::auth::for_engine(
        headers,
        security.client_keys.is_some(),
        security.engine_auth.as_ref(),
    );
}

/// Records a request answered by the router itself.
fn local(
    shared: &Arc<Shared>,
    api: &'static str,
    req: &Request<Incoming>,
    mut resp: Response<Body>,
) -> Response<Body> {
    let head = (req.method(), req.uri().path());
    let mut x = Exchange::start(shared, api, head, req.headers(), Instant::now());
    x.status(resp.status());
    resp.headers_mut().insert(REQUEST_ID_HEADER, x.id.clone());
    resp
}

/// `%XX` escapes decoded (model names with `/` may come escaped).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && let Some(v) = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn card_json(c: &crate::view::Card, created: u64) -> Value {
    serde_json::json!({
        "id": c.id,
        "object": "model",
        "created": created,
        "owned_by": "kinference",
        "root": c.root,
        "parent": null,
        "max_model_len": c.max_model_len,
    })
}

fn json_response(body: &Value) -> Response<Body> {
    let mut r = Response::new(full(Bytes::from(
        serde_json::to_vec(body).unwrap_or_default(),
    )));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

fn created_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn models(shared: &Shared) -> Response<Body> {
    let view = shared.view();
    let created = created_now();
    let data: Vec<Value> = view.cards.iter().map(|c| card_json(c, created)).collect();
    json_response(&serde_json::json!({"object": "list", "data": data}))
}

/// `GET /v1/models/{id}`: the card, or OpenAI's `model_not_found`.
fn model(shared: &Shared, id: &str) -> Response<Body> {
    let view = shared.view();
    match view.cards.iter().find(|c| c.id == id) {
        Some(c) => json_response(&card_json(c, created_now())),
        None => error(&ApiError::model_not_found(id)),
    }
}

async fn inference(
    shared: Arc<Shared>,
    api: openai::Endpoint,
    req: Request<Incoming>,
) -> Response<Body> {
    let started = Instant::now();
    let head = (req.method(), req.uri().path());
    let mut x = Exchange::start(&shared, api.label(), head, req.headers(), started);
    let id = x.id.clone();
    let mut resp = match route(&shared, api, req, started, &mut x).await {
        Ok((parts, body)) => {
            x.status(parts.status);
            Response::from_parts(parts, body.with_exchange(x).boxed_unsync())
        }
        Err(e) => {
            x.status(e.status);
            error(&e)
        }
    };
    resp.headers_mut().insert(REQUEST_ID_HEADER, id);
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
    x: &mut Exchange,
) -> Result<(http::response::Parts, TrackedBody), ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = read_body(
        body,
        shared.config.body_limit,
        shared.config.body_read_timeout,
    )
    .await?;
    let view = shared.view();
    let debug = shared.config.debug_headers && parts.headers.contains_key(&DEBUG_HEADER);
    let mut headers = parts.headers;
    headers.remove(&DEBUG_HEADER);
    let head = prepare::Head {
        path_and_query: parts
            .uri
            .path_and_query()
            .map_or(api.path(), |p| p.as_str())
            .to_owned(),
        headers,
        debug,
        key_class: parts.extensions.get::<crate::auth::KeyClass>().cloned(),
        arrived: started,
    };
    let prepared = prepare::prepare(shared, &view, api, head, bytes)
        .instrument(tracing::info_span!(target: SPAN_TARGET, parent: &x.span, "prepare"))
        .await?;
    x.requested(&prepared.requested, prepared.stream);
    // A random source of this request's own: no lock shared between requests.
    let mut rng = kinference_scoring::SplitMix64::new(
        shared.config.seed
            ^ shared
                .runtime
                .next_request()
                .wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    let mut excluded: Vec<EndpointId> = Vec::new();
    // A continued response goes to the engine that keeps the one it
    // continues (crate::stored); found nowhere, it is routed as any other
    // and the engine answers as it would alone.
    if let Some(previous) = &prepared.previous_response {
        let mut headers = prepared.headers.clone();
        for_engine(shared, &mut headers);
        let ask = crate::stored::path(previous);
        if let Some(found) = crate::stored::holder(shared, &view, previous, &ask, &headers).await {
            excluded.extend(
                view.worker_sets
                    .iter()
                    .flat_map(|ws| ws.endpoints.iter())
                    .map(|e| e.id)
                    .filter(|id| *id != found.endpoint.id),
            );
        }
    }
    let mut last_error = None;
    let max_attempts = shared.config.max_attempts.max(1);
    let mut retried_once = false;
    for attempt_no in 0..max_attempts {
        let now = Now {
            instant: Instant::now(),
            since_start: shared.now(),
        };
        let explain = prepared.debug || shared.explanations.sample();
        let decided = tracing::info_span!(target: SPAN_TARGET, parent: &x.span, "decide", kinference.attempt = attempt_no)
            .in_scope(|| decide::decide(&view, &shared.kv, &prepared, &excluded, now, &mut rng, explain));
        let d = match decided {
            Ok(d) => d,
            Err(e) => return Err(last_error.unwrap_or(e)),
        };
        // Past the knee: held while every engine is predicted past the
        // bound, or 429 before any engine sees it (crate::admit).
        let gate = (attempt_no == 0)
            .then(|| crate::admit::Gate::new(&view, &prepared, &d, started))
            .flatten();
        let (d, now) = match gate {
            Some(gate) => {
                let redecide = |at| {
                    decide::decide(
                        &view, &shared.kv, &prepared, &excluded, at, &mut rng, explain,
                    )
                };
                let d = gate.hold(shared, &view, d, redecide).await?;
                (
                    d,
                    Now {
                        instant: Instant::now(),
                        since_start: shared.now(),
                    },
                )
            }
            None => (d, now),
        };
        if attempt_no == 0 {
            shared
                .metrics
                .decision_duration
                .get_or_create(&DecisionLabels {
                    policy: shared.config.policy.as_str(),
                })
                .observe(started.elapsed().as_secs_f64());
        }
        x.attempt();
        shared
            .metrics
            .decisions
            .get_or_create(&ReasonLabels {
                policy: shared.config.policy.as_str(),
                reason: if d.panic {
                    "panic"
                } else {
                    d.choice.reason.label()
                },
            })
            .inc();
        if d.panic {
            shared.metrics.panic_decisions.inc();
        }
        let route = &prepared.routes[d.route];
        if route.adapter.is_some() {
            shared
                .metrics
                .adapter_requests
                .get_or_create(&crate::metrics::AdapterLabels {
                    slot: d.candidate.adapter.as_str(),
                })
                .inc();
        }
        let ws = &view.worker_sets[route.target.worker_set];
        let mut headers = prepared.headers.clone();
        headers.insert(REQUEST_ID_HEADER, x.id.clone());
        for_engine(shared, &mut headers);
        if let Some(rank) = d.dp_rank {
            headers.insert(DP_RANK_HEADER, HeaderValue::from(rank));
        }
        // While the index may be missing what the engine holds, vLLM ≥ 0.26
        // is asked to re-report the blocks this request reuses, unless the
        // index already shows them all there (a re-report would repeat
        // what it holds: on a busy engine, every request's whole prompt).
        let recover = route.request.cache == kinference_scoring::CacheSource::Index
            && !d.holds_whole_prompt(route)
            && d.endpoint.kv_recovering(now.instant)
            && d.endpoint.reports_reused_blocks_on_request();
        if recover {
            shared.metrics.kv_recovery_requests.inc();
        }
        let proxy_span = tracing::info_span!(
            target: SPAN_TARGET,
            parent: &x.span,
            "proxy",
            kinference.attempt = attempt_no,
            kinference.engine = %d.endpoint.authority,
        );
        // The engine continues this attempt's trace.
        crate::telemetry::propagate(&proxy_span, &mut headers);
        let upstream = proxy::upstream_request(
            &d.endpoint.authority,
            &prepared.path_and_query,
            headers,
            prepared.body_to_send(route, recover),
        )
        .map_err(|e| ApiError::invalid(format!("Bad request target: {e}."), None))?;
        let mut attempt = commit::commit(&view, &prepared, &d, now);
        let predicted =
            Duration::from_secs_f64((d.choice.prediction.ttft_ms / 1000.0).clamp(0.0, 3600.0));
        let sent_at = Instant::now();
        let assume = (!prepared.stream).then(|| sent_at + predicted);
        let sent = proxy::send(
            &shared.runtime.upstream,
            upstream,
            &mut attempt.inflight,
            assume,
            shared.config.upstream_timeout,
        )
        .instrument(proxy_span)
        .await;
        let mut first = None;
        let resp = match sent {
            Sent::Answered(resp) if prepared.stream && resp.status().is_success() => {
                // Hold the headers until the first data: an engine that
                // fails right after them (vLLM streams an error event when
                // its core dies) is still retryable, no byte having reached
                // the client.
                let (parts, mut body) = resp.into_parts();
                let hold = proxy::FIRST_DATA_HOLD.min(shared.config.upstream_timeout);
                match proxy::first_data(&mut body, hold).await {
                    proxy::First::Later => {
                        d.endpoint.record(Outcome::Success, Instant::now());
                    }
                    proxy::First::Data(b, at) => {
                        d.endpoint.record(Outcome::Success, Instant::now());
                        first = Some((b, at));
                    }
                    proxy::First::Error(event) => {
                        d.endpoint.record(Outcome::ServerError, Instant::now());
                        if !retried_once && attempt_no + 1 < max_attempts {
                            retried_once = true;
                            drop(body);
                            attempt.withdraw(&prepared);
                            retry(shared, &d, proxy::RetryReason::ServerError, &mut excluded);
                            last_error = Some(ApiError::bad_gateway(format!(
                                "The engine {} failed the stream: {event}",
                                d.endpoint.authority
                            )));
                            continue;
                        }
                        attempt.withdraw_record(&prepared);
                        first = Some((Bytes::from(event.into_bytes()), Instant::now()));
                    }
                    proxy::First::Nothing(why) => {
                        d.endpoint.record(Outcome::Timeout, Instant::now());
                        attempt.withdraw(&prepared);
                        let err = ApiError::bad_gateway(format!(
                            "The engine {} sent no data: {why}.",
                            d.endpoint.authority
                        ));
                        if !retried_once && attempt_no + 1 < max_attempts {
                            retried_once = true;
                            retry(shared, &d, proxy::RetryReason::Broken, &mut excluded);
                            last_error = Some(err);
                            continue;
                        }
                        return Err(err);
                    }
                }
                Response::from_parts(parts, body)
            }
            Sent::Answered(resp) => {
                d.endpoint.record(Outcome::Success, Instant::now());
                resp
            }
            Sent::ServerError(resp) => {
                d.endpoint.record(Outcome::ServerError, Instant::now());
                let status = resp.status();
                if !retried_once && attempt_no + 1 < max_attempts {
                    // No byte reached the client: once per request, another
                    // endpoint gets it (the engine's answer is dropped).
                    retried_once = true;
                    drop(resp);
                    attempt.withdraw(&prepared);
                    retry(shared, &d, proxy::RetryReason::ServerError, &mut excluded);
                    last_error = Some(ApiError::bad_gateway(format!(
                        "The engine {} answered {status}.",
                        d.endpoint.authority
                    )));
                    continue;
                }
                // The engine's own error goes back to the client.
                attempt.withdraw_record(&prepared);
                resp
            }
            Sent::Retry(reason, why) => {
                tracing::debug!(endpoint = %d.endpoint.authority, %why, "retrying on another endpoint");
                attempt.withdraw(&prepared);
                // A 503 is "not now", not a broken engine; probes ejected a
                // gone one already.
                if reason == proxy::RetryReason::Connect {
                    d.endpoint.record(Outcome::ConnectFailure, Instant::now());
                }
                // Its admission control is full: evidence for the next
                // decisions (kinference_scoring::Evidence::refused_age).
                if reason == proxy::RetryReason::Unavailable {
                    d.endpoint.record_refusal(shared.now());
                }
                retry(shared, &d, reason, &mut excluded);
                last_error = Some(ApiError::unavailable(format!(
                    "The engines serving this model did not take the request (last: {}: {why}).",
                    d.endpoint.authority
                )));
                continue;
            }
            Sent::TimedOut(why) => {
                // The engine may be working on it: its record stays.
                d.endpoint.record(Outcome::Timeout, Instant::now());
                return Err(ApiError::gateway_timeout(format!(
                    "The engine {} did not answer: {why}.",
                    d.endpoint.authority
                )));
            }
            Sent::Failed(why) => {
                attempt.withdraw(&prepared);
                d.endpoint.record(Outcome::ConnectFailure, Instant::now());
                let err = ApiError::bad_gateway(format!(
                    "The engine {} failed: {why}.",
                    d.endpoint.authority
                ));
                if !retried_once && attempt_no + 1 < max_attempts {
                    retried_once = true;
                    retry(shared, &d, proxy::RetryReason::Broken, &mut excluded);
                    last_error = Some(err);
                    continue;
                }
                return Err(err);
            }
        };
        if let Some(e) = &d.explanation {
            shared.explanations.keep(DecisionRecord {
                at_ms: now.since_start.as_secs_f64() * 1000.0,
                model: prepared.requested.clone(),
                worker_set: ws.route.name.clone(),
                tokens: route.tokens.as_str(),
                prompt_tokens: route.request.prompt_tokens,
                blocks: route.keys.len(),
                endpoints: ws
                    .endpoints
                    .iter()
                    .map(|e| (e.id.0, e.authority.clone()))
                    .collect(),
                explanation: e.clone(),
            });
        }
        x.routed(
            &prepared.requested,
            &ws.route.name,
            &d.endpoint.authority,
            route.request.prompt_tokens,
            d.choice.prediction.cached_tokens,
            predicted,
        );
        let on_first = (prepared.stream && resp.status().is_success())
            .then(|| x.model_labels().cloned())
            .flatten()
            .map(|labels| feedback::on_first_token(shared, &ws.runtime, &d.choice, labels));
        let on_end = on_first
            .is_some()
            .then(|| feedback::on_stream_end(&ws.runtime, &d.choice));
        let (mut rparts, rbody) = resp.into_parts();
        proxy::strip_hop_by_hop(&mut rparts.headers);
        if let Some(v) = &d.endpoint.authority_header {
            rparts.headers.insert(ENDPOINT_HEADER, v.clone());
        }
        if let Some(v) = &ws.name_header {
            rparts.headers.insert(WORKER_SET_HEADER, v.clone());
        }
        if prepared.debug {
            if let Ok(v) =
                HeaderValue::from_str(&format!("{}; tokens={}", d.choice, route.tokens.as_str()))
            {
                rparts.headers.insert(DECISION_HEADER, v);
            }
            if let Some(e) = &d.explanation
                && let Ok(Ok(v)) = serde_json::to_string(e).map(HeaderValue::try_from)
            {
                rparts.headers.insert(EXPLAIN_HEADER, v);
            }
        }
        let mut body = TrackedBody::new(
            rbody,
            attempt.into_inflight(),
            sent_at,
            on_first,
            shared.config.upstream_timeout,
        );
        if let Some(hook) = on_end {
            body = body.with_on_end(hook);
        }
        // A Responses answer's engine keeps it (when its store is on): the
        // id in its first bytes is remembered for the conversation's next
        // turn, its retrieval and its cancel (crate::stored).
        if prepared.api == openai::Endpoint::Responses && rparts.status.is_success() {
            let (s, authority) = (Arc::clone(shared), d.endpoint.authority.clone());
            body = body.with_on_first_data(Box::new(move |b| {
                if let Some(id) = crate::stored::response_id(b) {
                    s.runtime.stored.remember(id, &authority);
                }
            }));
        }
        if let Some((b, at)) = first {
            body = body.with_first(b, at);
        }
        return Ok((rparts, body));
    }
    Err(last_error.unwrap_or_else(|| ApiError::unavailable("No endpoint took the request.")))
}

/// Counts a retry and keeps the endpoint out of the request's next attempts.
fn retry(
    shared: &Shared,
    d: &decide::Decision,
    reason: proxy::RetryReason,
    excluded: &mut Vec<EndpointId>,
) {
    shared
        .metrics
        .retries
        .get_or_create(&RetryLabels {
            reason: reason.label(),
        })
        .inc();
    excluded.push(d.endpoint.id);
}
