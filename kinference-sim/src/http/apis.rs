//! The other APIs vLLM serves next to completions and chat: this file holds
//! `POST /v1/embeddings` and the chat-job machinery that `POST /v1/responses`
//! (OpenAI's Responses API, in [`super::responses`]) and `POST /v1/messages`
//! (Anthropic's Messages API, in [`super::messages`]) share: the job and its
//! admission ([`ChatJob`], [`admit`], [`collect`]), content flattening
//! ([`content_text`]) and the SSE helpers ([`sse_event`], [`sse_response`],
//! the [`Events`] trait and [`EventStream`]).
//!
//! Responses and Messages are chat requests underneath, as in vLLM (both
//! servers turn them into a chat conversation before the engine sees
//! them): the conversation is rendered with the chat template and goes
//! through the engine model like `/v1/chat/completions` (scheduling, the
//! prefix cache, KV events, metrics, faults, admission control). Embeddings
//! are answered from the tokens alone: a vector hashed from the input's
//! token ids, without an engine step.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kinference_tokenize::Endpoint;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::{Choice, Choices, parse_json, tokenize_error, unix_now};
use crate::Shared;
use crate::api::{ApiError, ErrorMark, opt_uint};
use crate::driver::Out;
use crate::engine::{FinishReason, Finished, NewRequest};

/// Dimensions of an embedding unless the request asks for fewer or more
/// (`dimensions`, honoured as a Matryoshka model would).
pub(crate) const EMBED_DIMS: usize = 16;
/// The largest `dimensions` accepted.
const EMBED_MAX_DIMS: usize = 8192;

// ---------------------------------------------------------------------------
// /v1/embeddings

/// `POST /v1/embeddings`: one deterministic, L2-normalised vector per
/// input, from a hash of its token ids; `encoding_format: "base64"` sends
/// the little-endian `f32` bytes base64-encoded, as OpenAI and vLLM do.
pub(super) async fn embeddings(
    State(s): State<Arc<Shared>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let json = parse_json(&body)?;
    if !json.is_object() {
        return Err(ApiError::bad("the request body must be a JSON object"));
    }
    let model = s.check_model(json.get("model"))?;
    let input = match json.get("input") {
        None | Some(Value::Null) => {
            return Err(ApiError::bad_param("input", "`input` is required"));
        }
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::bad_param("input", "`input` must not be empty"));
        }
        Some(v) => v.clone(),
    };
    let base64 = match json.get("encoding_format") {
        None | Some(Value::Null) => false,
        Some(Value::String(f)) if f == "float" => false,
        Some(Value::String(f)) if f == "base64" => true,
        Some(v) => {
            return Err(ApiError::bad_param(
                "encoding_format",
                format!("`encoding_format` must be \"float\" or \"base64\", got {v}"),
            ));
        }
    };
    let dims = match opt_uint(&json, "dimensions")? {
        None => EMBED_DIMS,
        Some(d) if d == 0 || d as usize > EMBED_MAX_DIMS => {
            return Err(ApiError::bad_param(
                "dimensions",
                format!("`dimensions` must be between 1 and {EMBED_MAX_DIMS}, got {d}"),
            ));
        }
        Some(d) => d as usize,
    };
    // The input is a completion prompt as far as tokenization goes: a
    // string, a list of strings, a list of token ids or a list of lists.
    let mut prompt = json!({ "prompt": input });
    if let Some(a) = json.get("add_special_tokens") {
        prompt["add_special_tokens"] = a.clone();
    }
    let tok = s.tok.clone();
    let tokenized = tokio::task::spawn_blocking(move || {
        tok.tokenizer().tokenize(Endpoint::Completions, &prompt)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?
    .map_err(|e| tokenize_error(&e))?;
    let max_len = s.cfg.max_model_len;
    if let Some(long) = tokenized.token_ids.iter().find(|t| t.len() > max_len) {
        return Err(ApiError::bad(format!(
            "This model's maximum context length is {max_len} tokens. However, you requested {} tokens in the input for embedding generation. Please reduce the length of the input.",
            long.len()
        )));
    }
    if let Some(failed) = crate::surface::failure(&s, false, tokenized.token_ids.len()) {
        return Ok(failed);
    }
    let mut prompt_tokens = 0;
    let data: Vec<Value> = tokenized
        .token_ids
        .iter()
        .enumerate()
        .map(|(index, tokens)| {
            prompt_tokens += tokens.len();
            let v = embedding(tokens, dims);
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64_encode(&bytes))
            } else {
                json!(v)
            };
            json!({"index": index, "object": "embedding", "embedding": embedding})
        })
        .collect();
    Ok(axum::Json(json!({
        "id": format!("embd-{}", s.next_id_hex()),
        "object": "list",
        "created": unix_now(),
        "model": model,
        "data": data,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": null,
        },
    }))
    .into_response())
}

/// The vector of a token sequence: component `j` from SHA-256 of the
/// tokens (little-endian `u32`s) mixed with `j`, then L2-normalised. The
/// first `k` components do not depend on `dims`, so a shorter vector is a
/// renormalised prefix of a longer one (Matryoshka).
pub(crate) fn embedding(tokens: &[u32], dims: usize) -> Vec<f32> {
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    let digest = h.finalize();
    let mut seed = [0u8; 8];
    seed.copy_from_slice(&digest[..8]);
    let seed = u64::from_le_bytes(seed);
    let mut v: Vec<f32> = (0..dims as u64)
        .map(|j| {
            let x = splitmix64(seed ^ j.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            // 24 random bits to [-1, 1).
            ((x >> 40) as f32 / (1u32 << 23) as f32) - 1.0
        })
        .collect();
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        for x in &mut v {
            *x /= norm;
        }
    }
    v
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Standard base64 with padding (RFC 4648), what Python's
/// `base64.b64decode` and the `openai` client read.
fn base64_encode(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------
// The chat request behind /v1/responses and /v1/messages

/// What a Responses or Messages request asks of the engine.
pub(super) struct ChatJob {
    pub(super) messages: Vec<Value>,
    pub(super) max_tokens: Option<usize>,
    pub(super) min_tokens: usize,
    pub(super) ignore_eos: bool,
    pub(super) seed: Option<u64>,
    pub(super) report_full: bool,
    pub(super) stream: bool,
    /// The LoRA adapter it runs as (`None`: the base model).
    pub(super) lora: Option<u32>,
    /// The body's `session_id`.
    pub(super) session: Option<std::sync::Arc<str>>,
}

/// The outcome of submitting a [`ChatJob`].
pub(super) enum Admitted {
    /// In the engine.
    Run(Choices),
    /// Refused before the engine: a 503 from admission control or a failing
    /// engine's non-streamed answer.
    Refused(Response),
    /// A failing engine, and the client asked for a stream: the message.
    StreamFailed(String),
}

/// Renders the conversation with the chat template, applies faults and
/// admission control, and submits one engine request.
pub(super) async fn admit(
    s: &Arc<Shared>,
    headers: &HeaderMap,
    job: &ChatJob,
) -> Result<Admitted, ApiError> {
    let body = json!({ "messages": job.messages });
    let tok = s.tok.clone();
    let tokenized = tokio::task::spawn_blocking(move || {
        tok.tokenizer().tokenize(Endpoint::ChatCompletions, &body)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?
    .map_err(|e| tokenize_error(&e))?;
    let prompt = tokenized
        .token_ids
        .into_iter()
        .next()
        .ok_or_else(|| ApiError::internal("the chat template rendered no prompt"))?;
    admit_prompt(s, headers, job, prompt)
}

/// [`admit`] for a prompt already in token ids (`job.messages` unused).
pub(super) fn admit_prompt(
    s: &Arc<Shared>,
    headers: &HeaderMap,
    job: &ChatJob,
    prompt: Vec<u32>,
) -> Result<Admitted, ApiError> {
    if let Some(failed) = crate::surface::failure(s, false, prompt.len()) {
        if job.stream && failed.status() == StatusCode::INTERNAL_SERVER_ERROR {
            let message = failed.extensions().get::<ErrorMark>().map_or_else(
                || crate::surface::ENGINE_DEAD.to_owned(),
                |m| m.0.message.clone(),
            );
            return Ok(Admitted::StreamFailed(message));
        }
        return Ok(Admitted::Refused(failed));
    }
    let rank = s.pick_rank(headers)?;
    let report_full = job.report_full && s.cfg.engine_mode.honours_report_mode_full();
    let req = NewRequest {
        prompt,
        max_tokens: job.max_tokens,
        min_tokens: job.min_tokens,
        ignore_eos: job.ignore_eos,
        seed: Some(job.seed.unwrap_or(0)),
        report_full,
        lora: job.lora,
        session: crate::api::session(headers, job.session.as_ref()),
    };
    let prompt_tokens = req.prompt.len();
    let (id, rx) = rank.submit(req).map_err(|e| ApiError::bad(e.to_string()))?;
    Ok(Admitted::Run(Choices(vec![Choice {
        index: 0,
        rank,
        req: id,
        rx,
        prompt_tokens,
        generated: 0,
        finished: None,
    }])))
}

/// Waits for the whole output; `None` when a fault killed the request.
pub(super) async fn collect(s: &Shared, choices: &mut Choices) -> Option<(String, Finished)> {
    let c = &mut choices.0[0];
    let mut text = String::new();
    loop {
        match c.rx.recv().await {
            Some(Out::Step(o)) => {
                s.tok.push_text(o.token, c.generated == 0, &mut text);
                c.generated += 1;
                c.finished = o.finished;
                if let Some(f) = o.finished {
                    return Some((text, f));
                }
            }
            Some(Out::Killed) | None => {
                c.finished = Some(Finished {
                    reason: FinishReason::Abort,
                    prompt_tokens: c.prompt_tokens,
                    completion_tokens: c.generated,
                    cached_tokens: 0,
                });
                return None;
            }
        }
    }
}

/// A message `content` as a string: a string stays, text parts (`text`,
/// `input_text`, `output_text`) are joined with newlines, other parts
/// (images, files, tool blocks) add nothing. Text parts are joined with
/// `sep`.
pub(super) fn content_text(
    content: Option<&Value>,
    param: &'static str,
    sep: &str,
) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(t)) => Ok(t.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::new();
            for p in parts {
                match p {
                    Value::String(t) => texts.push(t.as_str()),
                    Value::Object(o) => {
                        let kind = o.get("type").and_then(Value::as_str).unwrap_or("text");
                        if matches!(kind, "text" | "input_text" | "output_text")
                            && let Some(t) = o.get("text").and_then(Value::as_str)
                        {
                            texts.push(t);
                        }
                    }
                    _ => {
                        return Err(ApiError::bad_param(
                            param,
                            "each content part must be an object",
                        ));
                    }
                }
            }
            Ok(texts.join(sep))
        }
        Some(v) => Err(ApiError::bad_param(
            param,
            format!("`content` must be a string or a list of content parts, got {v}"),
        )),
    }
}

pub(super) fn sse_event(out: &mut VecDeque<Bytes>, event: &str, data: &Value) {
    let mut buf = Vec::with_capacity(256);
    buf.extend_from_slice(b"event: ");
    buf.extend_from_slice(event.as_bytes());
    buf.extend_from_slice(b"\ndata: ");
    if serde_json::to_writer(&mut buf, data).is_ok() {
        buf.extend_from_slice(b"\n\n");
        out.push_back(Bytes::from(buf));
    }
}

pub(super) fn sse_response(body: Body) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// What an API writes while a request streams.
pub(super) trait Events: Send + Unpin + 'static {
    /// One sampled token; `text` is its detokenized text (may be empty).
    fn token(&mut self, text: &str, first: bool, out: &mut VecDeque<Bytes>);
    /// The sampled token's id, before [`Events::token`] (for APIs that
    /// return ids).
    fn token_id(&mut self, _id: u32) {}
    /// The request finished.
    fn finish(&mut self, f: Finished, out: &mut VecDeque<Bytes>);
}

/// An SSE body driven by one engine request. Dropping it (client gone)
/// aborts the request; a killed request cuts the connection.
pub(super) struct EventStream<E> {
    events: E,
    choices: Choices,
    shared: Arc<Shared>,
    pending: VecDeque<Bytes>,
    done: bool,
    text: String,
}

impl<E: Events> EventStream<E> {
    pub(super) fn new(
        events: E,
        choices: Choices,
        shared: Arc<Shared>,
        opening: VecDeque<Bytes>,
    ) -> Self {
        EventStream {
            events,
            choices,
            shared,
            pending: opening,
            done: false,
            text: String::new(),
        }
    }
}

impl<E: Events> futures::Stream for EventStream<E> {
    type Item = Result<Bytes, io::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(b) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(b)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            let c = &mut this.choices.0[0];
            match c.rx.poll_recv(cx) {
                Poll::Ready(Some(Out::Step(o))) => {
                    c.generated += 1;
                    c.finished = o.finished;
                    let first = c.generated == 1;
                    this.text.clear();
                    this.shared.tok.push_text(o.token, first, &mut this.text);
                    this.events.token_id(o.token);
                    this.events.token(&this.text, first, &mut this.pending);
                    if let Some(f) = o.finished {
                        this.events.finish(f, &mut this.pending);
                        this.done = true;
                    }
                }
                Poll::Ready(Some(Out::Killed) | None) => {
                    this.done = true;
                    this.pending.clear();
                    return Poll::Ready(Some(Err(io::Error::other("request killed by a fault"))));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648() {
        assert_eq!(base64_encode(b""), "");
        assert_eq!(base64_encode(b"f"), "Zg==");
        assert_eq!(base64_encode(b"fo"), "Zm8=");
        assert_eq!(base64_encode(b"foo"), "Zm9v");
        assert_eq!(base64_encode(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_encode(&[0xff, 0xfe, 0x00]), "//4A");
    }

    #[test]
    fn embeddings_are_deterministic_unit_vectors_with_matryoshka_prefixes() {
        let a = embedding(&[1, 2, 3], 16);
        assert_eq!(a, embedding(&[1, 2, 3], 16));
        assert_ne!(a, embedding(&[1, 2, 4], 16));
        let norm: f32 = a.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-5);
        let long = embedding(&[1, 2, 3], 64);
        let short = embedding(&[1, 2, 3], 8);
        let prefix_norm = long[..8].iter().map(|x| x * x).sum::<f32>().sqrt();
        for (s, l) in short.iter().zip(&long[..8]) {
            assert!((s - l / prefix_norm).abs() < 1e-5);
        }
    }
}
