//! One client request as operators see it: its id, where it went, how it
//! ended. An [`Exchange`] starts when a request arrives, learns its route
//! when an engine takes it, follows its response body to the last byte, and
//! on drop (the end of the body, an error answered locally, or a client
//! that went away) writes the request's metrics and, when asked for, its
//! access-log line: once per request, whatever path it took.
//!
//! The request id is the client's `x-request-id` when it sent a usable one,
//! else a new random one; it goes to the engine (vLLM takes it as its own
//! request id with `--enable-request-id-headers`) and back to the client.

use std::hash::{BuildHasher as _, Hasher as _};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};
use prometheus_client::metrics::histogram::Histogram;
use tokio::time::Instant;

use crate::metrics::{ModelLabels, RequestLabels};
use crate::state::Shared;

/// The request id header, read from clients, sent to engines, returned.
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// The tracing target of access-log lines.
pub const ACCESS_LOG_TARGET: &str = "kinference::access";

/// Longest client request id kept (longer ones are replaced).
const MAX_ID_LEN: usize = 200;

/// A request id: the client's when usable (visible ASCII, at most
/// `MAX_ID_LEN` bytes), else 32 random hex digits.
pub fn request_id(headers: &HeaderMap, n: u64) -> HeaderValue {
    use kinference_scoring::RandomSource as _;
    // A key drawn once per process keeps replicas (and restarts) from
    // repeating each other's ids even with the same --seed.
    static KEY: OnceLock<u64> = OnceLock::new();
    if let Some(v) = headers.get(&REQUEST_ID_HEADER)
        && !v.is_empty()
        && v.len() <= MAX_ID_LEN
        && v.as_bytes().iter().all(u8::is_ascii_graphic)
    {
        return v.clone();
    }
    let key = *KEY.get_or_init(|| {
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    });
    let mut rng = kinference_scoring::SplitMix64::new(key ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut id = [0u8; 32];
    for (half, word) in id.chunks_mut(16).zip([rng.next_u64(), rng.next_u64()]) {
        for (i, b) in half.iter_mut().enumerate() {
            *b = b"0123456789abcdef"[((word >> (60 - 4 * i)) & 0xf) as usize];
        }
    }
    HeaderValue::from_bytes(&id).unwrap_or_else(|_| HeaderValue::from_static("0"))
}

/// What a request was routed to, once an engine took it.
#[derive(Debug)]
struct Routed {
    labels: ModelLabels,
    engine: String,
    prompt_tokens: u32,
    cached_tokens: u32,
    itl: Option<Histogram>,
}

/// One request, from arrival to the last byte of its response.
#[derive(Debug)]
pub struct Exchange {
    shared: Arc<Shared>,
    /// The request's trace span (disabled unless traces are exported).
    pub span: tracing::Span,
    /// Its id (see [`request_id`]).
    pub id: HeaderValue,
    api: &'static str,
    started: Instant,
    code: u16,
    /// The model the client named (for the access log; metrics label it
    /// only once routed, so that unknown names add no series).
    requested: Option<String>,
    routed: Option<Routed>,
    attempts: u32,
    stream: bool,
    usage_completion: Option<u64>,
    events: u64,
    ttft: Option<Duration>,
    last_data: Option<Instant>,
    ended: bool,
}

impl Exchange {
    /// A request that arrived at `started` on `api`.
    pub fn start(
        shared: &Arc<Shared>,
        api: &'static str,
        head: (&http::Method, &str),
        headers: &HeaderMap,
        started: Instant,
    ) -> Self {
        use tracing::field::Empty;
        shared.metrics.in_flight.inc();
        let (method, path) = head;
        let id = request_id(headers, shared.runtime.next_request());
        let span = tracing::info_span!(
            target: crate::telemetry::SPAN_TARGET,
            "request",
            otel.name = %format!("{method} {path}"),
            otel.kind = "server",
            otel.status_code = Empty,
            http.request.method = %method,
            url.path = path,
            http.response.status_code = Empty,
            kinference.request_id = id.to_str().unwrap_or_default(),
            gen_ai.request.model = Empty,
            kinference.worker_set = Empty,
            kinference.engine = Empty,
            kinference.attempts = Empty,
            gen_ai.usage.input_tokens = Empty,
            gen_ai.usage.output_tokens = Empty,
            kinference.cached_tokens = Empty,
        );
        crate::telemetry::continue_from(&span, headers);
        Self {
            span,
            id,
            shared: shared.clone(),
            api,
            started,
            code: 0,
            requested: None,
            routed: None,
            attempts: 0,
            stream: false,
            usage_completion: None,
            events: 0,
            ttft: None,
            last_data: None,
            ended: false,
        }
    }

    /// The model the client asked for.
    pub fn requested(&mut self, model: &str, stream: bool) {
        self.requested = Some(model.chars().take(200).collect());
        self.stream = stream;
    }

    /// One more attempt on an engine.
    pub fn attempt(&mut self) {
        self.attempts += 1;
    }

    /// The status code answered.
    pub fn status(&mut self, code: http::StatusCode) {
        self.code = code.as_u16();
    }

    /// The engine that took the request: counts its prompt (`cached` of
    /// its `prompt` tokens predicted in the engine's cache) and prediction.
    pub fn routed(
        &mut self,
        model: &str,
        worker_set: &str,
        engine: &str,
        prompt: u32,
        cached: f64,
        predicted_ttft: Duration,
    ) {
        let m = &self.shared.metrics;
        let labels = ModelLabels {
            model: model.to_owned(),
            worker_set: worker_set.to_owned(),
        };
        let cached_tokens = cached.clamp(0.0, f64::from(prompt)) as u32;
        m.prompt_tokens
            .get_or_create(&labels)
            .inc_by(u64::from(prompt));
        m.cached_prompt_tokens
            .get_or_create(&labels)
            .inc_by(u64::from(cached_tokens));
        if prompt > 0 {
            m.cached_fraction
                .get_or_create(&labels)
                .observe(f64::from(cached_tokens) / f64::from(prompt));
        }
        m.predicted_ttft
            .get_or_create(&labels)
            .observe(predicted_ttft.as_secs_f64());
        let itl = self.stream.then(|| m.itl.get_or_create(&labels).clone());
        self.routed = Some(Routed {
            labels,
            engine: engine.to_owned(),
            prompt_tokens: prompt,
            cached_tokens,
            itl,
        });
    }

    /// The labels per model and worker set, once routed.
    pub fn model_labels(&self) -> Option<&ModelLabels> {
        self.routed.as_ref().map(|r| &r.labels)
    }

    /// The response's first bytes came `ttft` after sending.
    pub fn first_token(&mut self, ttft: Duration) {
        if self.stream {
            self.ttft.get_or_insert(ttft);
        }
    }

    /// A data chunk of the response passed at `at`.
    pub fn data(&mut self, data: &[u8], at: Instant) {
        if let Some(n) = completion_tokens(data) {
            self.usage_completion = Some(n);
        }
        if self.stream {
            self.events += text_events(data) as u64;
            if let Some(prev) = self.last_data
                && let Some(h) = self.routed.as_ref().and_then(|r| r.itl.as_ref())
            {
                h.observe(at.saturating_duration_since(prev).as_secs_f64());
            }
            self.last_data = Some(at);
        }
    }

    /// The response body ended (successfully or not).
    pub fn ended(&mut self) {
        self.ended = true;
    }

    fn completion(&self) -> u64 {
        self.usage_completion.unwrap_or(self.events)
    }

    /// Tokens a streamed response carried so far (its `usage` when sent,
    /// else its text events); `None` when not streamed.
    pub fn streamed_tokens(&self) -> Option<u32> {
        self.stream
            .then(|| u32::try_from(self.completion()).unwrap_or(u32::MAX))
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        let m = &self.shared.metrics;
        m.in_flight.dec();
        let (model, worker_set) = self
            .routed
            .as_ref()
            .map_or((String::new(), String::new()), |r| {
                (r.labels.model.clone(), r.labels.worker_set.clone())
            });
        let labels = RequestLabels {
            api: self.api,
            model,
            worker_set,
            code: self.code,
        };
        let elapsed = self.started.elapsed();
        m.requests.get_or_create(&labels).inc();
        m.request_duration
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
        let completion = self.completion();
        if let Some(r) = &self.routed
            && completion > 0
        {
            m.completion_tokens
                .get_or_create(&r.labels)
                .inc_by(completion);
        }
        if !self.span.is_disabled() {
            let s = &self.span;
            s.record("http.response.status_code", i64::from(self.code));
            if self.code >= 500 {
                s.record("otel.status_code", "ERROR");
            }
            s.record("kinference.attempts", i64::from(self.attempts));
            if let Some(m) = &self.requested {
                s.record("gen_ai.request.model", m.as_str());
            }
            if let Some(r) = &self.routed {
                s.record("kinference.worker_set", r.labels.worker_set.as_str());
                s.record("kinference.engine", r.engine.as_str());
                s.record("gen_ai.usage.input_tokens", i64::from(r.prompt_tokens));
                s.record("kinference.cached_tokens", i64::from(r.cached_tokens));
                s.record(
                    "gen_ai.usage.output_tokens",
                    i64::try_from(completion).unwrap_or(i64::MAX),
                );
            }
        }
        if self.shared.config.access_log {
            let r = self.routed.as_ref();
            tracing::info!(
                target: ACCESS_LOG_TARGET,
                request_id = self.id.to_str().unwrap_or_default(),
                api = self.api,
                model = self.requested.as_deref().unwrap_or_default(),
                worker_set = r.map_or("", |r| r.labels.worker_set.as_str()),
                engine = r.map_or("", |r| r.engine.as_str()),
                code = self.code,
                attempts = self.attempts,
                prompt_tokens = r.map_or(0, |r| r.prompt_tokens),
                cached_tokens = r.map_or(0, |r| r.cached_tokens),
                completion_tokens = completion,
                ttft_ms = self.ttft.map_or(-1.0, |t| t.as_secs_f64() * 1000.0),
                duration_ms = elapsed.as_secs_f64() * 1000.0,
                complete = self.ended || self.routed.is_none(),
                "request"
            );
        }
    }
}

/// Stream events that carry generated text (`"content":"…"`,
/// `"reasoning_content":"…"`, `"text":"…"` not empty): what a stream
/// without `usage` is counted by. vLLM's chat streams open with a role chunk
/// of empty content and may end with an empty finishing chunk; neither is a
/// token.
fn text_events(data: &[u8]) -> usize {
    [&b"content\":\""[..], &b"\"text\":\""[..]]
        .iter()
        .map(|pat| {
            memchr::memmem::find_iter(data, pat)
                .filter(|at| data.get(at + pat.len()).is_some_and(|b| *b != b'"'))
                .count()
        })
        .sum()
}

/// The last `"completion_tokens": N` in `data` (an OpenAI `usage` object).
fn completion_tokens(data: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"completion_tokens\"";
    let at = memchr::memmem::rfind(data, KEY)?;
    let rest = data[at + KEY.len()..].trim_ascii_start();
    let rest = rest.strip_prefix(b":")?.trim_ascii_start();
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read_from_bodies_and_final_chunks() {
        let body = br#"{"id":"x","choices":[],"usage":{"prompt_tokens":12,"total_tokens":19,"completion_tokens":7}}"#;
        assert_eq!(completion_tokens(body), Some(7));
        let chunk =
            b"data: {\"choices\":[],\"usage\":{\"completion_tokens\": 42}}\n\ndata: [DONE]\n\n";
        assert_eq!(completion_tokens(chunk), Some(42));
        assert_eq!(
            completion_tokens(b"data: {\"choices\":[{\"text\":\"hi\"}]}\n\n"),
            None
        );
        // A vLLM chat stream: the role chunk, two tokens, an empty finish.
        let chat = concat!(
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"lo\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"\"},\"finish_reason\":\"stop\"}]}\n\n",
            "data: [DONE]\n\n",
        );
        assert_eq!(text_events(chat.as_bytes()), 2);
        assert_eq!(
            text_events(b"data: {\"choices\":[{\"text\":\" w1\"}]}\n\n"),
            1
        );
    }

    #[test]
    fn client_ids_are_kept_when_usable() {
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID_HEADER, HeaderValue::from_static("abc-123"));
        assert_eq!(request_id(&h, 1), "abc-123");
        h.insert(REQUEST_ID_HEADER, HeaderValue::from_static("has space"));
        let made = request_id(&h, 1);
        assert_eq!(made.len(), 32);
        assert!(made.as_bytes().iter().all(u8::is_ascii_hexdigit));
        assert_ne!(
            request_id(&HeaderMap::new(), 2),
            request_id(&HeaderMap::new(), 3)
        );
    }
}
