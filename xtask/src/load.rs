//! A load generator for OpenAI-compatible endpoints: the shared-prefix,
//! multi-turn chat workload (groups of users sharing a long system prompt,
//! conversations whose history grows each turn), Poisson arrivals, streaming
//! requests, and the figures: time to first token, latency, throughput.
//!
//! Prompts are made of the word-level tokenizer's words (`w0`…`w65535`, one
//! token each), so token counts are exact and cheap to produce.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use kinference_scoring::{RandomSource as _, SplitMix64};
use serde_json::{Value, json};
use tokio::sync::Mutex;
use tokio::time::Instant;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub(crate) fn client() -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(c)
}

/// `GET url` → (status, body).
pub(crate) async fn get(url: &str) -> Result<(u16, Bytes)> {
    let req = http::Request::get(url).body(Full::new(Bytes::new()))?;
    let resp = tokio::time::timeout(Duration::from_secs(5), client().request(req))
        .await
        .context("timed out")??;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, body))
}

/// `POST url` with a JSON body → (status, body).
pub(crate) async fn post_json(url: &str, body: &serde_json::Value) -> Result<(u16, Bytes)> {
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body)?)))?;
    let resp = tokio::time::timeout(Duration::from_secs(5), client().request(req))
        .await
        .context("timed out")??;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, body))
}

/// The shape of the shared-prefix multi-turn workload.
#[derive(Clone, Debug)]
pub(crate) struct Workload {
    /// Groups; each shares one system prompt.
    pub groups: usize,
    /// Conversations per group.
    pub users_per_group: usize,
    /// Tokens of each group's system prompt.
    pub prefix_tokens: usize,
    /// Tokens of each user turn.
    pub question_tokens: usize,
    /// `max_tokens` of each answer.
    pub answer_tokens: u32,
    /// Turns before a conversation starts over.
    pub max_turns: usize,
    /// Seed of arrivals and choices.
    pub seed: u64,
}

/// One request's outcome.
#[derive(Clone, Debug)]
pub(crate) struct Sample {
    /// Time to the first content token, when it came.
    pub ttft: Option<Duration>,
    /// Time to the end of the response.
    pub latency: Duration,
    /// Whether it succeeded.
    pub ok: bool,
    /// Output tokens received (content chunks).
    pub output_chunks: usize,
}

/// A uniform float in [0, 1).
fn unit(rng: &mut SplitMix64) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

fn words(start: usize, n: usize) -> String {
    let mut s = String::with_capacity(n * 6);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push('w');
        s.push_str(&((start + i) % 65_536).to_string());
    }
    s
}

struct Conversation {
    group: usize,
    user: usize,
    messages: Vec<Value>,
    turn: usize,
    busy: bool,
}

impl Conversation {
    fn reset(&mut self, w: &Workload) {
        self.messages = vec![
            json!({"role": "system", "content": words(self.group * 7919 % 65_536, w.prefix_tokens)}),
        ];
        self.turn = 0;
    }
}

/// Drives `workload` at `rate` requests per second for `duration` against
/// `base` (e.g. `http://127.0.0.1:8080`) with model `model`.
pub(crate) async fn run(
    base: &str,
    model: &str,
    w: &Workload,
    rate: f64,
    duration: Duration,
) -> Vec<Sample> {
    let client = client();
    let convs: Vec<Arc<Mutex<Conversation>>> = (0..w.groups * w.users_per_group)
        .map(|i| {
            let mut c = Conversation {
                group: i / w.users_per_group,
                user: i,
                messages: Vec::new(),
                turn: 0,
                busy: false,
            };
            c.reset(w);
            Arc::new(Mutex::new(c))
        })
        .collect();
    let samples = Arc::new(Mutex::new(Vec::new()));
    let mut rng = SplitMix64::new(w.seed);
    let start = Instant::now();
    let mut next = start;
    let mut tasks = Vec::new();
    while next < start + duration {
        tokio::time::sleep_until(next).await;
        // Poisson arrivals.
        let gap = -(1.0 - unit(&mut rng)).ln() / rate;
        next += Duration::from_secs_f64(gap);
        // A conversation that is not waiting for an answer.
        let n = convs.len();
        let first = (rng.next_u64() % n as u64) as usize;
        let mut chosen = None;
        for k in 0..n {
            let c = &convs[(first + k) % n];
            let mut g = c.lock().await;
            if !g.busy {
                g.busy = true;
                chosen = Some(c.clone());
                break;
            }
        }
        let Some(conv) = chosen else { continue };
        let (client, base, model, samples, w) = (
            client.clone(),
            base.to_owned(),
            model.to_owned(),
            samples.clone(),
            w.clone(),
        );
        let q = rng.next_u64();
        tasks.push(tokio::spawn(async move {
            let messages = {
                let mut c = conv.lock().await;
                if c.turn >= w.max_turns {
                    c.reset(&w);
                }
                let start =
                    (c.user * 131 + c.turn * 17 + (q % 1000) as usize) * w.question_tokens % 60_000;
                c.messages
                    .push(json!({"role": "user", "content": words(start, w.question_tokens)}));
                c.messages.clone()
            };
            let (sample, answer) =
                stream_chat(&client, &base, &model, messages, w.answer_tokens).await;
            let mut c = conv.lock().await;
            if sample.ok {
                c.messages
                    .push(json!({"role": "assistant", "content": answer}));
                c.turn += 1;
            } else {
                c.messages.pop();
            }
            c.busy = false;
            samples.lock().await.push(sample);
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    Arc::try_unwrap(samples)
        .map(Mutex::into_inner)
        .unwrap_or_default()
}

/// One streamed chat request: its sample and the answer text.
async fn stream_chat(
    client: &HttpClient,
    base: &str,
    model: &str,
    messages: Vec<Value>,
    max_tokens: u32,
) -> (Sample, String) {
    let body =
        json!({"model": model, "messages": messages, "max_tokens": max_tokens, "stream": true});
    let started = Instant::now();
    let mut sample = Sample {
        ttft: None,
        latency: Duration::ZERO,
        ok: false,
        output_chunks: 0,
    };
    let mut answer = String::new();
    let req = http::Request::post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            serde_json::to_vec(&body).unwrap_or_default(),
        )));
    let Ok(req) = req else {
        return (sample, answer);
    };
    let Ok(resp) = client.request(req).await else {
        sample.latency = started.elapsed();
        return (sample, answer);
    };
    if !resp.status().is_success() {
        let _ = resp.into_body().collect().await;
        sample.latency = started.elapsed();
        return (sample, answer);
    }
    let mut done = false;
    read_sse(resp.into_body(), |data| match data {
        SseData::Done => done = true,
        SseData::Json(v) => {
            if let Some(text) = v["choices"][0]["delta"]["content"].as_str()
                && !text.is_empty()
            {
                if sample.ttft.is_none() {
                    sample.ttft = Some(started.elapsed());
                }
                sample.output_chunks += 1;
                answer.push_str(text);
            }
        }
    })
    .await;
    sample.latency = started.elapsed();
    sample.ok = done;
    (sample, answer.trim().to_owned())
}

/// One `data:` payload of an OpenAI server-sent-event stream.
pub(crate) enum SseData {
    /// `data: [DONE]`.
    Done,
    /// A JSON chunk (payloads that are not JSON are skipped).
    Json(Value),
}

/// Reads an OpenAI SSE body to its end (or its first error), handing `on`
/// each `data:` payload in order.
pub(crate) async fn read_sse(mut body: hyper::body::Incoming, mut on: impl FnMut(SseData)) {
    let mut buf = String::new();
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { break };
        let Some(data) = frame.data_ref() else {
            continue;
        };
        buf.push_str(&String::from_utf8_lossy(data));
        while let Some(i) = buf.find("\n\n") {
            let event: String = buf.drain(..i + 2).collect();
            for line in event.lines() {
                let Some(payload) = line.strip_prefix("data: ") else {
                    continue;
                };
                if payload == "[DONE]" {
                    on(SseData::Done);
                } else if let Ok(v) = serde_json::from_str::<Value>(payload) {
                    on(SseData::Json(v));
                }
            }
        }
    }
}

/// What the engines' `/metrics` say, summed or per engine.
#[derive(Clone, Debug, Default)]
pub(crate) struct EngineCounters {
    /// `vllm:prefix_cache_hits` over the engines.
    pub hits: f64,
    /// `vllm:prefix_cache_queries` over the engines.
    pub queries: f64,
    /// Per engine (in the order given; NaN where its page could not be
    /// read), the requests it has received so far: finished (every
    /// reason, aborts too), running and waiting. Whoever routed them.
    pub received: Vec<f64>,
}

/// Reads every engine's `/metrics`.
pub(crate) async fn engine_counters(engines: &[String]) -> EngineCounters {
    let mut out = EngineCounters::default();
    for e in engines {
        let Ok((200, body)) = get(&format!("{e}/metrics")).await else {
            out.received.push(f64::NAN);
            continue;
        };
        let text = String::from_utf8_lossy(&body);
        let mut received = 0.0;
        for s in kinference_api::engine::prometheus::samples(&text) {
            match s.name {
                "vllm:prefix_cache_hits_total" => out.hits += s.value,
                "vllm:prefix_cache_queries_total" => out.queries += s.value,
                "vllm:request_success_total"
                | "vllm:num_requests_running"
                | "vllm:num_requests_waiting" => received += s.value,
                _ => {}
            }
        }
        out.received.push(received);
    }
    out
}

/// Nearest-rank percentile of sorted values.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// Summary figures of one run.
#[derive(Clone, Debug)]
pub(crate) struct Summary {
    pub requests: usize,
    pub ok: usize,
    pub hit_rate: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub req_per_s: f64,
    pub tokens_per_s: f64,
}

pub(crate) fn summarize(samples: &[Sample], hit_rate: f64, duration: Duration) -> Summary {
    let mut ttft: Vec<f64> = samples
        .iter()
        .filter_map(|s| s.ttft)
        .map(|d| d.as_secs_f64() * 1000.0)
        .collect();
    ttft.sort_by(f64::total_cmp);
    let ok = samples.iter().filter(|s| s.ok).count();
    let secs = duration.as_secs_f64();
    Summary {
        requests: samples.len(),
        ok,
        hit_rate,
        ttft_p50_ms: percentile(&ttft, 0.5),
        ttft_p90_ms: percentile(&ttft, 0.9),
        ttft_p99_ms: percentile(&ttft, 0.99),
        req_per_s: ok as f64 / secs,
        tokens_per_s: samples.iter().map(|s| s.output_chunks).sum::<usize>() as f64 / secs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert!((percentile(&v, 0.5) - 5.0).abs() < 1e-9);
        assert!((percentile(&v, 0.9) - 9.0).abs() < 1e-9);
        assert!((percentile(&v, 0.99) - 10.0).abs() < 1e-9);
        assert!(percentile(&[], 0.5).is_nan());
    }

    #[test]
    fn words_are_one_token_each() {
        assert_eq!(words(65_535, 3), "w65535 w0 w1");
    }
}
