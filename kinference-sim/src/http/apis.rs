//! The other APIs vLLM serves next to completions and chat:
//! `POST /v1/embeddings`, `POST /v1/responses` (OpenAI's Responses API)
//! and `POST /v1/messages` (Anthropic's Messages API).
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
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::{Choice, Choices, killed, parse_json, tokenize_error, unix_now};
use crate::Shared;
use crate::api::{ApiError, ErrorMark, Params, opt_uint};
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
struct ChatJob {
    messages: Vec<Value>,
    max_tokens: Option<usize>,
    min_tokens: usize,
    ignore_eos: bool,
    seed: Option<u64>,
    report_full: bool,
    stream: bool,
    /// The LoRA adapter it runs as (`None`: the base model).
    lora: Option<u32>,
    /// The body's `session_id`.
    session: Option<std::sync::Arc<str>>,
}

/// The outcome of submitting a [`ChatJob`].
enum Admitted {
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
async fn admit(s: &Arc<Shared>, headers: &HeaderMap, job: &ChatJob) -> Result<Admitted, ApiError> {
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
async fn collect(s: &Shared, choices: &mut Choices) -> Option<(String, Finished)> {
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
fn content_text(
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

fn sse_event(out: &mut VecDeque<Bytes>, event: &str, data: &Value) {
    let mut buf = Vec::with_capacity(256);
    buf.extend_from_slice(b"event: ");
    buf.extend_from_slice(event.as_bytes());
    buf.extend_from_slice(b"\ndata: ");
    if serde_json::to_writer(&mut buf, data).is_ok() {
        buf.extend_from_slice(b"\n\n");
        out.push_back(Bytes::from(buf));
    }
}

fn sse_response(body: Body) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// What an API writes while a request streams.
trait Events: Send + Unpin + 'static {
    /// One sampled token; `text` is its detokenized text (may be empty).
    fn token(&mut self, text: &str, first: bool, out: &mut VecDeque<Bytes>);
    /// The request finished.
    fn finish(&mut self, f: Finished, out: &mut VecDeque<Bytes>);
}

/// An SSE body driven by one engine request. Dropping it (client gone)
/// aborts the request; a killed request cuts the connection.
struct EventStream<E> {
    events: E,
    choices: Choices,
    shared: Arc<Shared>,
    pending: VecDeque<Bytes>,
    done: bool,
    text: String,
}

impl<E: Events> EventStream<E> {
    fn new(events: E, choices: Choices, shared: Arc<Shared>, opening: VecDeque<Bytes>) -> Self {
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

// ---------------------------------------------------------------------------
// /v1/responses

/// The request fields a Responses answer repeats.
struct ResponseInfo {
    id: String,
    msg_id: String,
    created_at: u64,
    model: String,
    instructions: Value,
    requested_max: Option<usize>,
    max_model_len: usize,
}

impl ResponseInfo {
    /// The response object in vLLM's field order (`ResponsesResponse`).
    fn body(&self, status: &str, output: &Value, prompt_tokens: usize, usage: &Value) -> Value {
        let incomplete = if status == "incomplete" {
            json!({"reason": "max_output_tokens"})
        } else {
            Value::Null
        };
        let room = self.max_model_len.saturating_sub(prompt_tokens);
        json!({
            "id": self.id,
            "created_at": self.created_at,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "metadata": null,
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": true,
            "temperature": 1.0,
            "tool_choice": "none",
            "tools": [],
            "top_p": 1.0,
            "background": false,
            "max_output_tokens": self.requested_max.unwrap_or(room),
            "max_tool_calls": null,
            "previous_response_id": null,
            "prompt": null,
            "reasoning": null,
            "service_tier": "auto",
            "status": status,
            "text": null,
            "top_logprobs": null,
            "truncation": "disabled",
            "usage": usage,
            "user": null,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": null,
            "ec_transfer_params": null,
            "input_messages": null,
            "output_messages": null,
        })
    }

    /// The output message item (no logprobs asked for: `logprobs: null`).
    fn message(&self, text: &str) -> Value {
        json!({
            "id": self.msg_id,
            "content": [{
                "annotations": [],
                "text": text,
                "type": "output_text",
                "logprobs": null,
            }],
            "role": "assistant",
            "status": "completed",
            "type": "message",
        })
    }

    fn finished(&self, text: &str, f: Finished) -> Value {
        let status = if f.reason == FinishReason::Length {
            "incomplete"
        } else {
            "completed"
        };
        let output = if text.is_empty() {
            json!([])
        } else {
            json!([self.message(text)])
        };
        let usage = json!({
            "input_tokens": f.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": f.cached_tokens,
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": f.completion_tokens,
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": f.prompt_tokens + f.completion_tokens,
        });
        self.body(status, &output, f.prompt_tokens, &usage)
    }
}

/// One Responses input item as a chat message, `None` for items that add
/// no text the simulator models (reasoning, function calls).
fn response_item(item: &Value) -> Result<Option<Value>, ApiError> {
    let Some(o) = item.as_object() else {
        return Err(ApiError::bad_param(
            "input",
            "each input item must be an object",
        ));
    };
    match o.get("type").and_then(Value::as_str) {
        None | Some("message") => {
            let role = o
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad_param("input", "a message item needs a `role`"))?;
            let content = content_text(o.get("content"), "input", "\n")?;
            Ok(Some(json!({"role": role, "content": content})))
        }
        Some("function_call_output") => {
            let output = match o.get("output") {
                Some(Value::String(s)) => s.clone(),
                other => content_text(other, "input", "\n")?,
            };
            Ok(Some(json!({
                "role": "tool",
                "tool_call_id": o.get("call_id").cloned().unwrap_or(Value::Null),
                "content": output,
            })))
        }
        Some(_) => Ok(None),
    }
}

/// `POST /v1/responses`: the input (a string, or message items, after the
/// `instructions` as a system message) as a chat prompt.
pub(super) async fn responses(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let json = parse_json(&body)?;
    let params = Params::parse(&json, true)?;
    let max_output = opt_uint(&json, "max_output_tokens")?;
    if max_output == Some(0) {
        return Err(ApiError::bad_param(
            "max_output_tokens",
            "max_output_tokens must be at least 1, got 0.",
        ));
    }
    let target = s.resolve_model(json.get("model"))?;
    let instructions = match json.get("instructions") {
        None | Some(Value::Null) => Value::Null,
        Some(v @ Value::String(_)) => v.clone(),
        Some(v) => {
            return Err(ApiError::bad_param(
                "instructions",
                format!("`instructions` must be a string, got {v}"),
            ));
        }
    };
    let mut messages = Vec::new();
    if let Value::String(i) = &instructions {
        messages.push(json!({"role": "system", "content": i}));
    }
    match json.get("input") {
        Some(Value::String(t)) => messages.push(json!({"role": "user", "content": t})),
        Some(Value::Array(items)) => {
            for item in items {
                messages.extend(response_item(item)?);
            }
        }
        _ => {
            return Err(ApiError::bad_param(
                "input",
                "`input` must be a string or a list of input items",
            ));
        }
    }
    let job = ChatJob {
        messages,
        max_tokens: max_output.map(|m| m as usize),
        min_tokens: params.min_tokens,
        ignore_eos: params.ignore_eos,
        seed: params.seed,
        report_full: params.report_full,
        stream: params.stream,
        lora: target.lora,
        session: params.session.clone(),
    };
    let info = ResponseInfo {
        id: format!("resp_{}", s.next_id_hex()),
        msg_id: format!("msg_{}", s.next_id_hex()),
        created_at: unix_now(),
        model: target.name,
        instructions,
        requested_max: job.max_tokens,
        max_model_len: s.cfg.max_model_len,
    };
    let mut choices = match admit(&s, &headers, &job).await? {
        Admitted::Run(c) => c,
        Admitted::Refused(r) => return Ok(r),
        Admitted::StreamFailed(message) => {
            let mut out = VecDeque::new();
            let mut ev = ResponseEvents::new(info, 0);
            ev.open(&mut out);
            ev.emit(
                &mut out,
                json!({
                    "type": "error",
                    "code": "InternalServerError",
                    "message": message,
                    "param": null,
                }),
            );
            let chunks: Vec<Result<Bytes, io::Error>> = out.into_iter().map(Ok).collect();
            return Ok(sse_response(Body::from_stream(futures::stream::iter(
                chunks,
            ))));
        }
    };
    if job.stream {
        let prompt_tokens = choices.0[0].prompt_tokens;
        let mut ev = ResponseEvents::new(info, prompt_tokens);
        let mut opening = VecDeque::new();
        ev.open(&mut opening);
        let stream = EventStream::new(ev, choices, s, opening);
        return Ok(sse_response(Body::from_stream(stream)));
    }
    let Some((text, f)) = collect(&s, &mut choices).await else {
        return Ok(killed());
    };
    Ok(axum::Json(info.finished(&text, f)).into_response())
}

/// The Responses event stream, as vLLM writes it for a plain text answer:
/// `response.created`, `response.in_progress`, then with the first text
/// `response.output_item.added` and `response.content_part.added`, one
/// `response.output_text.delta` per token, `response.output_text.done`,
/// `response.content_part.done`, `response.output_item.done` and
/// `response.completed` with the whole response. `sequence_number` counts
/// from 0.
struct ResponseEvents {
    info: ResponseInfo,
    prompt_tokens: usize,
    seq: u64,
    item_open: bool,
    text: String,
}

impl ResponseEvents {
    fn new(info: ResponseInfo, prompt_tokens: usize) -> Self {
        ResponseEvents {
            info,
            prompt_tokens,
            seq: 0,
            item_open: false,
            text: String::new(),
        }
    }

    fn emit(&mut self, out: &mut VecDeque<Bytes>, mut ev: Value) {
        let kind = ev["type"].as_str().unwrap_or("unknown").to_owned();
        if let Value::Object(m) = &mut ev {
            // `sequence_number` before `type`, as the openai types dump them.
            let ty = m.shift_remove("type");
            m.insert("sequence_number".into(), json!(self.seq));
            if let Some(ty) = ty {
                m.insert("type".into(), ty);
            }
        }
        self.seq += 1;
        sse_event(out, &kind, &ev);
    }

    fn open(&mut self, out: &mut VecDeque<Bytes>) {
        let initial = self
            .info
            .body("in_progress", &json!([]), self.prompt_tokens, &Value::Null);
        self.emit(
            out,
            json!({"response": initial.clone(), "type": "response.created"}),
        );
        self.emit(
            out,
            json!({"response": initial, "type": "response.in_progress"}),
        );
    }

    fn part(text: &str, logprobs: bool) -> Value {
        let mut p = Map::new();
        p.insert("annotations".into(), json!([]));
        p.insert("text".into(), json!(text));
        p.insert("type".into(), json!("output_text"));
        p.insert(
            "logprobs".into(),
            if logprobs { json!([]) } else { Value::Null },
        );
        Value::Object(p)
    }
}

impl Events for ResponseEvents {
    fn token(&mut self, text: &str, _first: bool, out: &mut VecDeque<Bytes>) {
        if text.is_empty() {
            return;
        }
        if !self.item_open {
            self.item_open = true;
            let item = json!({
                "id": self.info.msg_id,
                "content": [],
                "role": "assistant",
                "status": "in_progress",
                "type": "message",
            });
            self.emit(
                out,
                json!({"item": item, "output_index": 0, "type": "response.output_item.added"}),
            );
            self.emit(
                out,
                json!({
                    "content_index": 0,
                    "item_id": self.info.msg_id,
                    "output_index": 0,
                    "part": Self::part("", true),
                    "type": "response.content_part.added",
                }),
            );
        }
        self.text.push_str(text);
        self.emit(
            out,
            json!({
                "content_index": 0,
                "delta": text,
                "item_id": self.info.msg_id,
                "logprobs": [],
                "output_index": 0,
                "type": "response.output_text.delta",
            }),
        );
    }

    fn finish(&mut self, f: Finished, out: &mut VecDeque<Bytes>) {
        let text = std::mem::take(&mut self.text);
        if self.item_open {
            let id = self.info.msg_id.clone();
            self.emit(
                out,
                json!({
                    "content_index": 0,
                    "item_id": id,
                    "logprobs": [],
                    "output_index": 0,
                    "text": text,
                    "type": "response.output_text.done",
                }),
            );
            self.emit(
                out,
                json!({
                    "content_index": 0,
                    "item_id": id,
                    "output_index": 0,
                    "part": Self::part(&text, false),
                    "type": "response.content_part.done",
                }),
            );
            let item = self.info.message(&text);
            self.emit(
                out,
                json!({"item": item, "output_index": 0, "type": "response.output_item.done"}),
            );
        }
        let response = self.info.finished(&text, f);
        self.emit(
            out,
            json!({"response": response, "type": "response.completed"}),
        );
    }
}

// ---------------------------------------------------------------------------
// /v1/messages

/// A parsed Messages request.
struct MessagesRequest {
    model: String,
    job: ChatJob,
}

/// Reads a Messages body the way vLLM's `AnthropicMessagesRequest`
/// validates it (`model`, `messages`, `max_tokens` required; errors here are
/// request-validation errors, in vLLM's OpenAI shape) and converts it to a
/// chat conversation: the `system` field and any system messages joined
/// into one leading system message, text blocks kept.
fn parse_messages(json: &Value) -> Result<MessagesRequest, ApiError> {
    let params = Params::parse(json, false)?;
    let model = match json.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        _ => return Err(ApiError::bad_param("model", "Field required: `model`")),
    };
    let max_tokens = params
        .max_tokens
        .ok_or_else(|| ApiError::bad_param("max_tokens", "Field required: `max_tokens`"))?;
    let Some(Value::Array(msgs)) = json.get("messages") else {
        return Err(ApiError::bad_param(
            "messages",
            "Field required: `messages` must be a list",
        ));
    };
    let mut system = match json.get("system") {
        None | Some(Value::Null) => String::new(),
        other => content_text(other, "system", "")?,
    };
    let mut messages = Vec::new();
    for m in msgs {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::bad_param("messages", "each message needs a `role`"))?;
        let role = match role {
            "user" | "ctx" | "msg" => "user",
            "assistant" => "assistant",
            "system" => "system",
            other => {
                return Err(ApiError::bad_param(
                    "messages",
                    format!("`role` must be user, assistant or system, got {other:?}"),
                ));
            }
        };
        let sep = if role == "system" { "" } else { "\n" };
        let text = content_text(m.get("content"), "messages", sep)?;
        if role == "system" {
            system.push_str(&text);
        } else {
            messages.push(json!({"role": role, "content": text}));
        }
    }
    if !system.is_empty() {
        messages.insert(0, json!({"role": "system", "content": system}));
    }
    Ok(MessagesRequest {
        model,
        job: ChatJob {
            messages,
            max_tokens: Some(max_tokens),
            min_tokens: 0,
            ignore_eos: false,
            seed: None,
            report_full: false,
            stream: params.stream,
            lora: None,
            session: params.session.clone(),
        },
    })
}

/// Anthropic's `stop_reason` for an engine finish, as vLLM maps it.
fn stop_reason(reason: FinishReason) -> Value {
    match reason {
        FinishReason::Stop => json!("end_turn"),
        FinishReason::Length => json!("max_tokens"),
        FinishReason::Abort => Value::Null,
    }
}

/// An error answer rewritten in Anthropic's shape,
/// `{"type": "error", "error": {"type", "message"}}`, as vLLM's Messages
/// route translates the errors of the chat handler.
fn anthropic_shape(mut resp: Response) -> Response {
    match resp.extensions_mut().remove::<ErrorMark>() {
        Some(ErrorMark(e)) => (
            e.status,
            axum::Json(json!({
                "type": "error",
                "error": {"type": e.kind(), "message": e.message},
            })),
        )
            .into_response(),
        None => resp,
    }
}

/// `POST /v1/messages` (vLLM only).
pub(super) async fn messages(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let req = match parse_json(&body).and_then(|j| parse_messages(&j)) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    match run_messages(s, &headers, req).await {
        Ok(r) => anthropic_shape(r),
        Err(e) => anthropic_shape(e.into_response()),
    }
}

async fn run_messages(
    s: Arc<Shared>,
    headers: &HeaderMap,
    mut req: MessagesRequest,
) -> Result<Response, ApiError> {
    let target = s.resolve_model(Some(&Value::String(req.model.clone())))?;
    req.job.lora = target.lora;
    let model = target.name;
    let id = format!("chatcmpl-{}", s.next_id_hex());
    let mut choices = match admit(&s, headers, &req.job).await? {
        Admitted::Run(c) => c,
        Admitted::Refused(r) => return Ok(r),
        Admitted::StreamFailed(message) => {
            let mut out = VecDeque::new();
            sse_event(
                &mut out,
                "error",
                &json!({"type": "error", "error": {"type": "internal_error", "message": message}}),
            );
            let chunks: Vec<Result<Bytes, io::Error>> = out.into_iter().map(Ok).collect();
            return Ok(sse_response(Body::from_stream(futures::stream::iter(
                chunks,
            ))));
        }
    };
    if req.job.stream {
        let ev = MessageEvents {
            id,
            model,
            prompt_tokens: choices.0[0].prompt_tokens,
            block_open: false,
        };
        let stream = EventStream::new(ev, choices, s, VecDeque::new());
        return Ok(sse_response(Body::from_stream(stream)));
    }
    let Some((text, f)) = collect(&s, &mut choices).await else {
        return Ok(killed());
    };
    let content = if text.is_empty() {
        json!([])
    } else {
        json!([{"type": "text", "text": text}])
    };
    let mut body = json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
        "stop_reason": stop_reason(f.reason),
        "usage": {"input_tokens": f.prompt_tokens, "output_tokens": f.completion_tokens},
    });
    if body["stop_reason"].is_null()
        && let Value::Object(m) = &mut body
    {
        // vLLM dumps the response with `exclude_none`.
        m.shift_remove("stop_reason");
    }
    Ok(axum::Json(body).into_response())
}

/// The Messages event stream as vLLM converts its chat stream:
/// `message_start` with the first token, `content_block_start` before the
/// first text, one `content_block_delta` (`text_delta`) per token,
/// `content_block_stop`, `message_delta` (`stop_reason`, usage),
/// `message_stop`. No `ping`s.
struct MessageEvents {
    id: String,
    model: String,
    prompt_tokens: usize,
    block_open: bool,
}

impl Events for MessageEvents {
    fn token(&mut self, text: &str, first: bool, out: &mut VecDeque<Bytes>) {
        if first {
            // vLLM dumps with `exclude_unset`: the message's `type` and
            // `role` (defaults) are not written.
            sse_event(
                out,
                "message_start",
                &json!({
                    "type": "message_start",
                    "message": {
                        "id": self.id,
                        "content": [],
                        "model": self.model,
                        "stop_reason": null,
                        "stop_sequence": null,
                        "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
                    },
                }),
            );
        }
        if text.is_empty() {
            return;
        }
        if !self.block_open {
            self.block_open = true;
            sse_event(
                out,
                "content_block_start",
                &json!({
                    "type": "content_block_start",
                    "content_block": {"type": "text", "text": ""},
                    "index": 0,
                }),
            );
        }
        sse_event(
            out,
            "content_block_delta",
            &json!({
                "type": "content_block_delta",
                "delta": {"type": "text_delta", "text": text},
                "index": 0,
            }),
        );
    }

    fn finish(&mut self, f: Finished, out: &mut VecDeque<Bytes>) {
        if self.block_open {
            sse_event(
                out,
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": 0}),
            );
        }
        // A finish without a mapped reason defaults to "stop" in vLLM's
        // stream converter.
        let reason = match f.reason {
            FinishReason::Abort => json!("end_turn"),
            r => stop_reason(r),
        };
        sse_event(
            out,
            "message_delta",
            &json!({
                "type": "message_delta",
                "delta": {"stop_reason": reason},
                "usage": {"input_tokens": f.prompt_tokens, "output_tokens": f.completion_tokens},
            }),
        );
        sse_event(out, "message_stop", &json!({"type": "message_stop"}));
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
