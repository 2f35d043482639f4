//! Forwarding a request to an engine and streaming its answer back.
//!
//! The request body is already in memory (the router parsed it to route), so
//! a request that fails to *connect*, that an engine refuses with 503, or
//! (once per request) that an engine answers with another 5xx or whose
//! connection breaks before the response headers, is retried on the next
//! candidate: no byte has reached the client yet. Once an engine
//! has answered, its response is streamed back unchanged, chunk by chunk, and
//! the request's [`InFlight`] guard travels with the body: the load it holds
//! is released when the body ends, fails, or is dropped because the client
//! went away.
//!
//! **Nothing waits forever.** Response headers must come within the
//! upstream timeout, and so must every later chunk of a streamed body: an
//! engine that accepted the request and then stalls ends the response with
//! an error (never a hang, never a truncated stream presented as complete)
//! and counts as a failure of the endpoint. A request still waiting for
//! headers when probes find its engine unreachable moves to another
//! endpoint (no byte has reached the client yet).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use tokio::time::Instant;

use crate::endpoint::InFlight;
use crate::exchange::Exchange;

/// The upstream client: pooled keep-alive connections to every engine.
pub type UpstreamClient = Client<HttpConnector, Full<Bytes>>;

/// An upstream client with a connect timeout and keep-alive pooling.
pub fn client(connect_timeout: Duration) -> UpstreamClient {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(connect_timeout));
    http.set_nodelay(true);
    http.set_keepalive(Some(Duration::from_secs(60)));
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024)
        .build(http)
}

/// Headers that belong to one connection and are never forwarded.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Removes hop-by-hop headers, including those named in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for h in HOP_BY_HOP.iter().chain(&named) {
        headers.remove(h);
    }
}

/// Builds the request to send to `authority`.
///
/// # Errors
/// When the path does not make a valid URI with the authority.
pub fn upstream_request(
    authority: &str,
    path_and_query: &str,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Request<Full<Bytes>>, http::Error> {
    upstream(http::Method::POST, authority, path_and_query, headers, body)
}

/// A `method` request to `authority` with the client's `headers` (hop-by-hop
/// ones dropped, `Host` and `Content-Length` its own).
///
/// # Errors
/// When the path does not make a valid URI with the authority.
pub fn upstream(
    method: http::Method,
    authority: &str,
    path_and_query: &str,
    mut headers: HeaderMap,
    body: Bytes,
) -> Result<Request<Full<Bytes>>, http::Error> {
    strip_hop_by_hop(&mut headers);
    headers.remove(header::HOST);
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    let mut req = Request::builder()
        .method(method)
        .uri(format!("http://{authority}{path_and_query}"))
        .body(Full::new(body))?;
    *req.headers_mut() = headers;
    if let Ok(v) = HeaderValue::from_str(authority) {
        req.headers_mut().insert(header::HOST, v);
    }
    Ok(req)
}

/// Errors of proxied response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a request may go to another endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryReason {
    /// The connection could not be made.
    Connect,
    /// The engine answered 503 (its admission control, overloaded,
    /// draining, starting): try another, the engine is not broken.
    Unavailable,
    /// Probes found the engine unreachable while the request waited.
    Down,
    /// The engine answered another 5xx (retried once per request).
    ServerError,
    /// The connection broke before the response headers (retried once per
    /// request).
    Broken,
}

impl RetryReason {
    /// Every reason.
    pub const ALL: [RetryReason; 5] = [
        RetryReason::Connect,
        RetryReason::Unavailable,
        RetryReason::Down,
        RetryReason::ServerError,
        RetryReason::Broken,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            RetryReason::Connect => "connect",
            RetryReason::Unavailable => "unavailable",
            RetryReason::Down => "down",
            RetryReason::ServerError => "server_error",
            RetryReason::Broken => "broken",
        }
    }
}

/// What happened when sending to one endpoint.
#[derive(Debug)]
pub enum Sent {
    /// The engine answered: stream this back.
    Answered(Response<Incoming>),
    /// Not taken, or the engine is gone: safe to try another endpoint.
    Retry(RetryReason, String),
    /// The engine answered with a 5xx other than 503 before any byte
    /// reached the client: another endpoint may be tried once, else this
    /// answer goes back.
    ServerError(Response<Incoming>),
    /// No response headers within the upstream timeout: not retried (the
    /// engine may be working on it; a request that hangs engines must not
    /// hang them all).
    TimedOut(String),
    /// The connection broke after the request may have reached the engine,
    /// before its response headers: another endpoint may be tried once.
    Failed(String),
}

/// Sends one request, moving `inflight` past prefill at `assume_first_token`
/// if the response headers have not come by then (non-streaming responses
/// only send headers at the end).
pub async fn send(
    client: &UpstreamClient,
    req: Request<Full<Bytes>>,
    inflight: &mut InFlight,
    assume_first_token: Option<Instant>,
    timeout: Duration,
) -> Sent {
    let endpoint = inflight.endpoint().clone();
    let down = endpoint.went_down();
    tokio::pin!(down);
    let call = client.request(req);
    tokio::pin!(call);
    let deadline = Instant::now() + timeout;
    let mut assume = assume_first_token;
    let result = loop {
        tokio::select! {
            r = &mut call => break r,
            () = async { tokio::time::sleep_until(assume.unwrap_or(deadline)).await }, if assume.is_some() => {
                inflight.first_token();
                assume = None;
            }
            () = &mut down => {
                return Sent::Retry(RetryReason::Down, "the engine stopped answering probes".into());
            }
            () = tokio::time::sleep_until(deadline) => {
                return Sent::TimedOut(format!("no response within {timeout:?}"));
            }
        }
    };
    match result {
        Ok(resp) if resp.status() == StatusCode::SERVICE_UNAVAILABLE => {
            Sent::Retry(RetryReason::Unavailable, "the engine answered 503".into())
        }
        Ok(resp) if resp.status().is_server_error() => Sent::ServerError(resp),
        Ok(resp) => Sent::Answered(resp),
        Err(e) if e.is_connect() => Sent::Retry(RetryReason::Connect, format!("connect: {e}")),
        Err(e) => Sent::Failed(e.to_string()),
    }
}

/// What the first bytes of a streamed answer say.
#[derive(Debug)]
pub enum First {
    /// Data: the stream goes on (these bytes first, then the rest).
    Data(Bytes, Instant),
    /// An error event before any token (`data: {"error": …}`, what vLLM
    /// streams when its engine fails after the headers): nothing has reached
    /// the client yet, so another endpoint may be tried.
    Error(String),
    /// The body ended or failed before any data.
    Nothing(String),
    /// No data within the hold: the answer goes on as it is.
    Later,
}

/// How long the headers of a streamed answer wait for its first data (an
/// engine whose core died streams its error event at once; a busy one that
/// takes longer gets its headers through as they came, as engines send
/// them, so that gateways with header timeouts in front of the router see
/// them).
pub const FIRST_DATA_HOLD: Duration = Duration::from_secs(2);

/// Reads the first data of a streamed answer, waiting at most `hold`.
/// Streaming engines send their headers at once and the first bytes with
/// the first token.
pub async fn first_data(body: &mut Incoming, hold: Duration) -> First {
    use http_body_util::BodyExt as _;
    let deadline = Instant::now() + hold;
    loop {
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return First::Later,
            Ok(None) => return First::Nothing("the answer ended before any data".into()),
            Ok(Some(Err(e))) => return First::Nothing(format!("reading the answer: {e}")),
            Ok(Some(Ok(frame))) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                if data.is_empty() {
                    continue;
                }
                if is_error_event(&data) {
                    return First::Error(
                        String::from_utf8_lossy(&data).chars().take(200).collect(),
                    );
                }
                return First::Data(data, Instant::now());
            }
        }
    }
}

/// Whether `data` opens with an SSE error event (`data: {"error": …}`).
fn is_error_event(data: &[u8]) -> bool {
    let s = data.strip_prefix(b"data:").unwrap_or_default();
    let s = s.trim_ascii_start();
    s.starts_with(b"{\"error\"") || s.starts_with(b"{ \"error\"")
}

/// Called once, with the time from sending to the first body bytes.
pub type OnFirstByte = Box<dyn FnOnce(Duration) + Send + Sync>;

/// Called once with the first data of a response.
pub type OnFirstData = Box<dyn FnOnce(&Bytes) + Send + Sync>;

/// Called once at the end of a streamed response, with the engine's steps
/// since its first token.
pub type OnStreamEnd = Box<dyn FnOnce(kinference_scoring::StepSample) + Send + Sync>;

/// A proxied response body: passes frames through and keeps the request's
/// load accounted until it ends. A body that sends nothing for `idle`
/// fails (the client sees the response cut, as when the engine dies) and
/// counts as a failure of the endpoint.
pub struct TrackedBody {
    inner: Incoming,
    /// Bytes read ahead (the first data of a stream), sent first.
    first: Option<Bytes>,
    /// When they came.
    first_at: Option<Instant>,
    inflight: Option<InFlight>,
    sent_at: Instant,
    on_first_byte: Option<OnFirstByte>,
    on_first_data: Option<OnFirstData>,
    on_end: Option<OnStreamEnd>,
    idle: Duration,
    idle_timer: Pin<Box<tokio::time::Sleep>>,
    /// The client request's record, written when the body ends or drops.
    exchange: Option<Exchange>,
}

/// The engine sent nothing for too long.
#[derive(Debug)]
pub struct Stalled(pub Duration);

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the engine sent nothing for {:?}", self.0)
    }
}

impl std::error::Error for Stalled {}

impl std::fmt::Debug for TrackedBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrackedBody")
            .field("inflight", &self.inflight)
            .finish_non_exhaustive()
    }
}

impl TrackedBody {
    /// Wraps an engine's response body; it fails after `idle` without a
    /// frame.
    pub fn new(
        inner: Incoming,
        inflight: InFlight,
        sent_at: Instant,
        on_first_byte: Option<OnFirstByte>,
        idle: Duration,
    ) -> Self {
        Self {
            inner,
            first: None,
            first_at: None,
            inflight: Some(inflight),
            sent_at,
            on_first_byte,
            on_first_data: None,
            on_end: None,
            idle,
            idle_timer: Box::pin(tokio::time::sleep(idle)),
            exchange: None,
        }
    }

    /// The same, carrying the request's [`Exchange`] to the end of the body.
    #[must_use]
    pub fn with_exchange(mut self, exchange: Exchange) -> Self {
        self.exchange = Some(exchange);
        self
    }

    /// The same, reporting the stream's steps to `hook` when it ends
    /// (with an [`Exchange`], which counts its tokens).
    #[must_use]
    pub fn with_on_end(mut self, hook: OnStreamEnd) -> Self {
        self.on_end = Some(hook);
        self
    }

    /// The same, showing the first data to `hook` as it passes.
    #[must_use]
    pub fn with_on_first_data(mut self, hook: OnFirstData) -> Self {
        self.on_first_data = Some(hook);
        self
    }

    /// The same, with `first` (read ahead at `at`) sent before the rest:
    /// the first token arrived then.
    #[must_use]
    pub fn with_first(mut self, first: Bytes, at: Instant) -> Self {
        if let Some(f) = self.on_first_byte.take() {
            f(at.saturating_duration_since(self.sent_at));
        }
        self.first_at = Some(at);
        if let Some(g) = &mut self.inflight {
            g.first_token();
        }
        self.first = Some(first);
        self
    }
}

impl Body for TrackedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(first) = this.first.take() {
            if let Some(f) = this.on_first_data.take() {
                f(&first);
            }
            if let Some(x) = &mut this.exchange {
                let at = this.first_at.unwrap_or_else(Instant::now);
                x.first_token(at.saturating_duration_since(this.sent_at));
                x.data(&first, at);
                if this.inner.is_end_stream() {
                    x.ended();
                }
            }
            let deadline = Instant::now() + this.idle;
            this.idle_timer.as_mut().reset(deadline);
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if polled.is_pending() {
            if this.inflight.is_some() && this.idle_timer.as_mut().poll(cx).is_ready() {
                // Release the load now and mark the engine: it stalled.
                if let Some(g) = this.inflight.take() {
                    g.endpoint().record_failure(Instant::now());
                    tracing::warn!(endpoint = %g.endpoint().authority, idle = ?this.idle, "engine stalled mid-response: cutting it");
                }
                return Poll::Ready(Some(Err(Box::new(Stalled(this.idle)))));
            }
            return Poll::Pending;
        }
        let deadline = Instant::now() + this.idle;
        this.idle_timer.as_mut().reset(deadline);
        let polled = polled.map(|o| o.map(|r| r.map_err(BoxError::from)));
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref().filter(|d| !d.is_empty()) {
                    if let Some(f) = this.on_first_data.take() {
                        f(d);
                    }
                    let now = Instant::now();
                    if this.on_first_byte.is_some() || this.exchange.is_some() {
                        let ttft = now.saturating_duration_since(this.sent_at);
                        if let Some(f) = this.on_first_byte.take() {
                            f(ttft);
                        }
                        if let Some(x) = &mut this.exchange {
                            x.first_token(ttft);
                            x.data(d, now);
                        }
                    }
                    if let Some(g) = &mut this.inflight {
                        g.first_token();
                    }
                }
                if let Some(x) = &mut this.exchange
                    && this.inner.is_end_stream()
                {
                    x.ended();
                }
            }
            Poll::Ready(None) => {
                // The end: report the steps, release the load now rather
                // than when hyper drops the body, and write the request's
                // record.
                // With peers, once their reports of first tokens up to
                // now have had time to come.
                if let (Some(hook), Some(g), Some(x)) =
                    (this.on_end.take(), &this.inflight, &this.exchange)
                    && let Some(tokens) = x.streamed_tokens()
                    && let Some(w) = g.step_window(tokens.saturating_sub(1))
                {
                    match w.settle() {
                        None => hook(w.sample()),
                        Some(wait) => {
                            tokio::spawn(async move {
                                tokio::time::sleep(wait).await;
                                hook(w.sample());
                            });
                        }
                    }
                }
                this.inflight = None;
                if let Some(mut x) = this.exchange.take() {
                    x.ended();
                }
            }
            Poll::Ready(Some(Err(_))) => {
                this.inflight = None;
                this.exchange = None;
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut h = self.inner.size_hint();
        if let Some(f) = &self.first {
            let n = f.len() as u64;
            h.set_lower(h.lower() + n);
            if let Some(u) = h.upper() {
                h.set_upper(u + n);
            }
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-private"),
        );
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer t"));
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["authorization", "content-type"]);
    }

    #[test]
    fn upstream_requests_carry_the_new_body_length_and_host() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("router:8080"));
        h.insert(header::CONTENT_LENGTH, HeaderValue::from_static("999"));
        let req = upstream_request(
            "10.0.0.1:8000",
            "/v1/completions?x=1",
            h,
            Bytes::from_static(b"{}"),
        )
        .unwrap();
        assert_eq!(req.uri(), "http://10.0.0.1:8000/v1/completions?x=1");
        assert_eq!(req.headers()[header::HOST], "10.0.0.1:8000");
        assert_eq!(req.headers()[header::CONTENT_LENGTH], "2");
    }
}
