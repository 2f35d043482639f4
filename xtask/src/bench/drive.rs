//! Replays a [`Plan`] against the router or the oracle, open loop: each
//! arrival is sent at its time whatever happened before (a multi-turn turn
//! waits only for its own conversation's previous turn, and counts as
//! late).

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};
use tokio::time::Instant;

use super::oracle::Oracle;
use super::workload::{Body, Plan};
use crate::load::SseData;

pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub(crate) fn client() -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(c)
}

/// Where requests go.
#[derive(Clone, Debug)]
pub(crate) enum Route {
    /// Through the router at this base URL; with `true`, ask for every
    /// decision's explanation.
    Router(String, bool),
    /// Through router replicas, one after the other per request.
    Routers(Arc<Replicas>),
    /// Straight to the engine the oracle picks.
    Oracle(Arc<Oracle>),
}

/// Router replicas behind one name, as a Service spreads connections:
/// one after the other per request. A replica that cannot be reached is
/// left out from then on (its endpoint leaves the Service), and the request
/// goes to the next one, as the OpenAI SDK retries a connection error.
#[derive(Debug)]
pub(crate) struct Replicas {
    bases: Vec<String>,
    next: AtomicUsize,
    down: Vec<AtomicBool>,
    /// Requests ask for their usage (`stream_options.include_usage`): the
    /// cached tokens of each, per replica.
    usage: bool,
}

impl Replicas {
    pub(crate) fn new(bases: Vec<String>) -> Self {
        Self {
            down: bases.iter().map(|_| AtomicBool::new(false)).collect(),
            bases,
            next: AtomicUsize::new(0),
            usage: false,
        }
    }

    /// Replica `late` is left out until [`Replicas::mark_up`] (it starts
    /// later), and requests ask for their usage.
    pub(crate) fn joining(bases: Vec<String>, late: usize) -> Self {
        let r = Self {
            usage: true,
            ..Self::new(bases)
        };
        r.mark_down(late);
        r
    }

    /// Replica `i` takes requests (again).
    pub(crate) fn mark_up(&self, i: usize) {
        self.down[i].store(false, Ordering::Relaxed);
    }

    /// The next replica not known to be down (any, when all are).
    fn pick(&self) -> usize {
        let n = self.bases.len().max(1);
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..n)
            .map(|k| (start + k) % n)
            .find(|i| !self.down[*i].load(Ordering::Relaxed))
            .unwrap_or(start % n)
    }

    fn mark_down(&self, i: usize) {
        self.down[i].store(true, Ordering::Relaxed);
    }
}

/// The OpenAI API a body uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Api {
    Completions,
    Chat,
}

impl Api {
    pub(crate) fn path(self) -> &'static str {
        match self {
            Self::Completions => "/v1/completions",
            Self::Chat => "/v1/chat/completions",
        }
    }
}

/// One request's outcome.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub(crate) struct Sample {
    pub index: usize,
    /// The arrival's label (see [`super::workload::Arrival`]).
    pub label: String,
    /// In the measured window (not warm-up).
    pub measured: bool,
    /// Sent after its time because its conversation's previous turn was
    /// still running.
    #[serde(serialize_with = "ms")]
    pub late: Duration,
    /// Time to the first content token (or, when it never came, the time
    /// waited until the run gave up: a lower bound, see `gave_up`).
    #[serde(serialize_with = "opt_ms")]
    pub ttft: Option<Duration>,
    /// Time to the end of the response.
    #[serde(serialize_with = "ms")]
    pub latency: Duration,
    /// Content chunks received (one token each from the simulator).
    pub chunks: usize,
    /// First to last content chunk.
    #[serde(serialize_with = "ms")]
    pub decode: Duration,
    /// Completed with `[DONE]`.
    pub ok: bool,
    /// Still running when the drain deadline passed.
    pub gave_up: bool,
    /// The engine that served it (router header or oracle's pick).
    pub engine: Option<String>,
    /// Hash of the request body as sent.
    pub body_hash: u64,
    /// End of the response, from the start of the run.
    #[serde(serialize_with = "ms")]
    pub finished_at: Duration,
    /// The router's explanation of its decision, when asked for
    /// (`x-kinference-debug: 1`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub explain: Option<Value>,
    /// The replica that answered (router replicas).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica: Option<usize>,
    /// When it was sent, from the start of the run.
    #[serde(serialize_with = "ms")]
    pub sent_at: Duration,
    /// Its prompt tokens and those the engine had cached, when the
    /// response said (`usage`, asked for by join rows).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
}

fn ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

#[allow(clippy::ref_option)] // serde's signature
fn opt_ms<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&(d.as_secs_f64() * 1e3)),
        None => s.serialize_none(),
    }
}

/// Shared state of multi-turn conversations.
#[derive(Debug, Default)]
struct Conversation {
    messages: Vec<Value>,
}

/// Sends `plan` along `route` with model `model` (or the arrival's own,
/// a LoRA adapter's); gives up on requests still
/// running `drain` after the last arrival. Calls `at_window` once when the
/// measured window starts (at `plan.warmup`), for counter snapshots.
pub(crate) async fn drive<F, Fut>(
    plan: &Plan,
    route: &Route,
    model: &str,
    drain: Duration,
    at_window: F,
) -> (Vec<Sample>, Fut::Output)
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future,
{
    let client = client();
    let start = Instant::now();
    let conversations: Vec<Arc<tokio::sync::Mutex<Conversation>>> = (0..plan.conversations)
        .map(|_| Arc::new(tokio::sync::Mutex::new(Conversation::default())))
        .collect();
    let slots: Vec<Arc<std::sync::Mutex<Sample>>> = plan
        .arrivals
        .iter()
        .map(|a| {
            Arc::new(std::sync::Mutex::new(Sample {
                index: a.index,
                label: a.label.clone(),
                measured: a.at >= plan.warmup,
                ..Sample::default()
            }))
        })
        .collect();
    let mut tasks = Vec::with_capacity(plan.arrivals.len());
    let mut window = Some(at_window);
    let mut window_out = None;
    for (a, slot) in plan.arrivals.iter().zip(&slots) {
        if a.at >= plan.warmup
            && let Some(f) = window.take()
        {
            tokio::time::sleep_until(start + plan.warmup).await;
            window_out = Some(f().await);
        }
        tokio::time::sleep_until(start + a.at).await;
        let (client, route, model, slot) = (
            client.clone(),
            route.clone(),
            a.model.unwrap_or(model).to_owned(),
            slot.clone(),
        );
        let conv = match &a.body {
            Body::ChatTurn { conversation, .. } => conversations.get(*conversation).cloned(),
            Body::Completion { .. } => None,
        };
        let body = a.body.clone();
        let due = start + a.at;
        let tenant = a.tenant;
        tasks.push(tokio::spawn(async move {
            one(
                &client,
                &route,
                &model,
                (body, tenant),
                conv,
                due,
                start,
                &slot,
            )
            .await;
        }));
    }
    if let Some(f) = window.take() {
        tokio::time::sleep_until(start + plan.warmup).await;
        window_out = Some(f().await);
    }
    let deadline = start + plan.warmup + plan.measure + drain;
    for t in &mut tasks {
        if tokio::time::timeout_at(deadline, &mut *t).await.is_err() {
            t.abort();
        }
    }
    let now = Instant::now();
    let samples = slots
        .iter()
        .map(|s| {
            let mut s = s.lock().map(|g| g.clone()).unwrap_or_default();
            if !s.ok && !s.gave_up && s.finished_at.is_zero() {
                s.gave_up = true;
                let sent = start + plan.arrivals[s.index].at + s.late;
                let waited = now.saturating_duration_since(sent);
                s.latency = waited;
                if s.ttft.is_none() {
                    s.ttft = Some(waited);
                }
            }
            s
        })
        .collect();
    (samples, window_out.expect("the window future ran"))
}

#[allow(clippy::too_many_arguments)]
async fn one(
    client: &HttpClient,
    route: &Route,
    model: &str,
    (body, tenant): (Body, Option<&'static str>),
    conv: Option<Arc<tokio::sync::Mutex<Conversation>>>,
    due: Instant,
    start: Instant,
    slot: &std::sync::Mutex<Sample>,
) {
    let (api, json_body, max_tokens) = match &body {
        Body::Completion { prompt, max_tokens } => (
            Api::Completions,
            json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": true}),
            *max_tokens,
        ),
        Body::ChatTurn { max_tokens, .. } => (Api::Chat, Value::Null, *max_tokens),
    };
    // A turn holds its conversation for its whole exchange.
    let mut guard = match &conv {
        Some(c) => Some(c.lock().await),
        None => None,
    };
    let json_body = if let (Some(g), Body::ChatTurn { restart, user, .. }) = (guard.as_mut(), &body)
    {
        if let Some(m) = restart {
            g.messages.clone_from(m);
        }
        g.messages.push(json!({"role": "user", "content": user}));
        json!({"model": model, "messages": g.messages, "max_tokens": max_tokens, "stream": true})
    } else {
        json_body
    };
    let sent = Instant::now();
    let late = sent.saturating_duration_since(due);
    let mut bytes = Bytes::from(serde_json::to_vec(&json_body).unwrap_or_default());
    // The hash of the request itself: equal across rows whether or not it
    // asks for its usage.
    let body_hash = {
        let mut h = DefaultHasher::new();
        bytes.as_ref().hash(&mut h);
        h.finish()
    };
    if let Route::Routers(r) = route
        && r.usage
    {
        let mut b = json_body.clone();
        b["stream_options"] = json!({"include_usage": true});
        bytes = Bytes::from(serde_json::to_vec(&b).unwrap_or_default());
    }
    if let Ok(mut s) = slot.lock() {
        s.late = late;
        s.body_hash = body_hash;
        s.sent_at = sent.saturating_duration_since(start);
    }
    let mut replica = None;
    let (url, ticket, engine) = match route {
        Route::Router(base, _) => (format!("{base}{}", api.path()), None, None),
        Route::Routers(r) => {
            let i = r.pick();
            replica = Some(i);
            (format!("{}{}", r.bases[i], api.path()), None, None)
        }
        Route::Oracle(o) => {
            let Ok((i, ticket)) = o.decide(api, &json_body).await else {
                if let Ok(mut s) = slot.lock() {
                    s.finished_at = sent.duration_since(start);
                }
                return;
            };
            (
                format!("{}{}", o.engine_url(i), api.path()),
                Some((o.clone(), ticket)),
                Some(o.engine_url(i).to_owned()),
            )
        }
    };
    let explain = matches!(route, Route::Router(_, true));
    let ask = Ask { explain, tenant };
    // The engine is known from the response headers: kept at once, so that
    // a request still running at the drain deadline counts where it went.
    let headers_seen = |e: Option<&str>| {
        if let (Some(e), Ok(mut s)) = (e, slot.lock()) {
            s.engine = Some(e.to_owned());
        }
    };
    let mut result = stream(
        client,
        &url,
        bytes.clone(),
        api,
        ask,
        sent,
        headers_seen,
        |first| {
            if first && let Some((o, t)) = &ticket {
                o.first_token(*t);
            }
        },
    )
    .await;
    // A replica that could not be reached (or dropped the connection before
    // any response): the next one, as a client's retry would.
    if let (Route::Routers(r), Some(mut i)) = (route, replica) {
        for _ in 1..r.bases.len() {
            if !result.unanswered {
                break;
            }
            r.mark_down(i);
            i = r.pick();
            replica = Some(i);
            let url = format!("{}{}", r.bases[i], api.path());
            result = stream(
                client,
                &url,
                bytes.clone(),
                api,
                Ask {
                    explain: false,
                    tenant,
                },
                sent,
                headers_seen,
                |_| {},
            )
            .await;
        }
    }
    if let Some((o, t)) = &ticket {
        o.done(*t);
    }
    let ok = result.ok;
    if let (Some(g), true) = (guard.as_mut(), true) {
        if ok {
            g.messages
                .push(json!({"role": "assistant", "content": result.text}));
        } else {
            g.messages.pop();
        }
    }
    drop(guard);
    if let Ok(mut s) = slot.lock() {
        s.ttft = result.ttft;
        s.latency = result.latency;
        s.chunks = result.chunks;
        s.decode = result.decode;
        s.ok = ok;
        s.engine = engine.or(result.engine).or(s.engine.take());
        s.explain = result.explain;
        s.finished_at = Instant::now().duration_since(start);
        s.replica = replica;
        s.prompt_tokens = result.prompt_tokens;
        s.cached_tokens = result.cached_tokens;
    }
}

/// A streamed response's figures.
#[derive(Debug, Default)]
pub(crate) struct Streamed {
    pub ok: bool,
    pub ttft: Option<Duration>,
    pub latency: Duration,
    pub chunks: usize,
    pub decode: Duration,
    pub text: String,
    /// `x-kinference-endpoint`, when the router set it.
    pub engine: Option<String>,
    /// `x-kinference-explain`, when asked for.
    pub explain: Option<Value>,
    /// No response at all: the connection failed or closed before any
    /// header (nothing was streamed; a client may send it again).
    pub unanswered: bool,
    /// `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens`
    /// of the last chunk, when asked for.
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
}

/// What a request asks of the router besides its body.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Ask {
    /// The decision's explanation (`x-kinference-debug: 1`).
    pub explain: bool,
    /// The tenant (`x-kinference-tenant`).
    pub tenant: Option<&'static str>,
}

/// POSTs `body` to `url` and reads the SSE stream; `on_headers` with the
/// engine the router names (`x-kinference-endpoint`) when the response
/// headers arrive, `on_token(true)` at the first content token.
#[allow(clippy::too_many_arguments)] // two hooks: the headers and each token
pub(crate) async fn stream(
    client: &HttpClient,
    url: &str,
    body: Bytes,
    api: Api,
    ask: Ask,
    sent: Instant,
    on_headers: impl FnOnce(Option<&str>),
    mut on_token: impl FnMut(bool),
) -> Streamed {
    let mut out = Streamed::default();
    let mut req = http::Request::post(url).header("content-type", "application/json");
    if ask.explain {
        req = req.header("x-kinference-debug", "1");
    }
    if let Some(t) = ask.tenant {
        req = req.header("x-kinference-tenant", t);
    }
    let Ok(req) = req.body(Full::new(body)) else {
        return out;
    };
    let Ok(resp) = client.request(req).await else {
        out.latency = sent.elapsed();
        out.unanswered = true;
        return out;
    };
    out.engine = resp
        .headers()
        .get("x-kinference-endpoint")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    on_headers(out.engine.as_deref());
    out.explain = resp
        .headers()
        .get("x-kinference-explain")
        .and_then(|v| serde_json::from_slice(v.as_bytes()).ok());
    if !resp.status().is_success() {
        let _ = resp.into_body().collect().await;
        out.latency = sent.elapsed();
        return out;
    }
    let mut first_at: Option<Instant> = None;
    let mut last_at: Option<Instant> = None;
    crate::load::read_sse(resp.into_body(), |data| {
        let v = match data {
            SseData::Done => {
                out.ok = true;
                return;
            }
            SseData::Json(v) => v,
        };
        if let Some(p) = v["usage"]["prompt_tokens"].as_u64() {
            out.prompt_tokens = Some(p);
            out.cached_tokens = Some(
                v["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0),
            );
        }
        let choice = &v["choices"][0];
        let text = match api {
            Api::Completions => choice["text"].as_str(),
            Api::Chat => choice["delta"]["content"].as_str(),
        };
        if let Some(text) = text
            && !text.is_empty()
        {
            let now = Instant::now();
            if first_at.is_none() {
                first_at = Some(now);
                out.ttft = Some(now.duration_since(sent));
                on_token(true);
            }
            last_at = Some(now);
            out.chunks += 1;
            out.text.push_str(text);
        }
    })
    .await;
    out.latency = sent.elapsed();
    if let (Some(f), Some(l)) = (first_at, last_at) {
        out.decode = l.duration_since(f);
    }
    out.text = out.text.trim().to_owned();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workload::Arrival;
    use kinference_sim::{LoraModule, SimConfig, SimEngine};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_request_names_its_adapter_or_the_base_model() {
        // A real simulated engine serving two adapters: it records which
        // adapter each request named.
        let sim = SimEngine::spawn(SimConfig {
            lora: kinference_sim::LoraConfig {
                modules: vec![
                    LoraModule::new("lora-2", "/adapters/lora-2"),
                    LoraModule::new("lora-7", "/adapters/lora-7"),
                ],
                max_loras: 2,
                ..kinference_sim::LoraConfig::default()
            },
            ..SimConfig::default()
        })
        .await
        .expect("the simulator starts");
        let base = sim.model().to_owned();
        // Prompts of 3, 4, 5 and 6 words tell the requests apart.
        let arrival = |index: usize, model: Option<&'static str>| Arrival {
            index,
            at: Duration::from_millis(index as u64),
            body: Body::Completion {
                prompt: (0..index + 3)
                    .map(|w| format!("w{w}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                max_tokens: 1,
            },
            label: format!("a{index}"),
            tenant: None,
            model,
        };
        let plan = Plan {
            arrivals: vec![
                arrival(0, None),
                arrival(1, Some("lora-2")),
                arrival(2, None),
                arrival(3, Some("lora-7")),
            ],
            warmup: Duration::ZERO,
            measure: Duration::from_millis(10),
            conversations: 0,
        };
        let (samples, ()) = drive(
            &plan,
            &Route::Router(sim.base_url(), false),
            &base,
            Duration::from_secs(10),
            || async {},
        )
        .await;
        assert!(samples.iter().all(|s| s.ok), "{samples:?}");
        // Adapter i of `--lora-modules` is vLLM's lora_id i + 1.
        let mut served: Vec<(usize, Option<u32>)> = sim
            .recent_requests()
            .into_iter()
            .flatten()
            .map(|r| (r.prompt_tokens, r.lora_id))
            .collect();
        served.sort_unstable();
        let adapters: Vec<Option<u32>> = served.iter().map(|(_, l)| *l).collect();
        assert_eq!(adapters, [None, Some(1), None, Some(2)], "{served:?}");
        sim.shutdown().await;
    }
}
