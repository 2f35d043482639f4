//! The HTTP server: vLLM's OpenAI-compatible surface plus the simulator's
//! `/debug` and `/admin` endpoints.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kinference_tokenize::Endpoint;
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::{
    ApiError, ChatChoice, ChatChunkChoice, Chunk, Completion, CompletionChoice,
    CompletionChunkChoice, Delta, Message, Params, PromptTokensDetails, Usage,
};
use crate::driver::{Out, Rank};
use crate::engine::{Finished, NewRequest, ReqId};
use crate::{FaultRequest, Shared};

mod apis;
mod generate;
mod messages;
mod responses;

pub(crate) use responses::ResponseStore;

/// Bodies up to 64 MiB (long prompts as text).
const BODY_LIMIT: usize = 64 << 20;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let mode = shared.cfg.engine_mode;
    let mut app = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/embeddings", post(apis::embeddings))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/responses/{id}", get(responses::retrieve))
        .route("/v1/responses/{id}/cancel", post(responses::cancel))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(crate::surface::health))
        .route("/metrics", get(metrics))
        .route("/debug/cache", get(debug_cache))
        .route("/debug/requests", get(debug_requests))
        .route("/debug/prefix_match", post(prefix_match))
        .route("/admin/faults", get(faults_get).post(faults_post));
    if mode.is_vllm() {
        app = app
            .route("/ping", get(crate::surface::health))
            .route("/version", get(version))
            .route("/load", get(load))
            .route("/reset_prefix_cache", post(reset_prefix_cache));
    }
    if mode.serves_anthropic_messages() {
        app = app.route("/v1/messages", post(messages::messages));
    }
    if mode.serves_kv_event_sources() {
        app = app.route("/kv_event_sources", get(kv_event_sources));
    }
    if mode.serves_server_info() {
        app = app
            .route("/server_info", get(server_info))
            .route("/get_server_info", get(server_info))
            .route("/v1/tokenize", post(tokenize))
            .route("/v1/detokenize", post(detokenize))
            .route("/flush_cache", get(flush_cache).post(flush_cache))
            .route(
                "/generate",
                post(generate::generate).put(generate::generate),
            );
    }
    let mut app = app
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                axum::Json(json!({"detail": "Not Found"})),
            )
        })
        .layer(DefaultBodyLimit::max(BODY_LIMIT));
    if mode.is_sglang() {
        app = app.layer(axum::middleware::from_fn(crate::surface::sglang_errors));
    }
    if shared.cfg.api_key.is_some() {
        app = app.layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            crate::surface::require_key,
        ));
    }
    app.with_state(shared)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("JSON decode error: {e}")))
}

fn tokenize_error(e: &kinference_tokenize::Error) -> ApiError {
    if e.is_client_error() {
        ApiError::bad(e.to_string())
    } else {
        ApiError::internal(e.to_string())
    }
}

async fn models(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    let created = unix_now();
    if s.cfg.engine_mode.is_sglang() {
        return axum::Json(crate::surface::sglang_models(&s, created));
    }
    let root = s.cfg.root.clone().unwrap_or_else(|| s.cfg.model.clone());
    let card = |id: &str, root: &str, parent: Option<&str>, max_model_len: Option<usize>| {
        json!({
            "id": id,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
            "permission": [{
                "id": format!("modelperm-{}", s.next_id_hex()),
                "object": "model_permission",
                "created": created,
                "allow_create_engine": false,
                "allow_sampling": true,
                "allow_logprobs": true,
                "allow_search_indices": false,
                "allow_view": true,
                "allow_fine_tuning": false,
                "organization": "*",
                "group": null,
                "is_blocking": false,
            }],
        })
    };
    let mut data: Vec<Value> = s
        .cfg
        .served_names()
        .map(|name| card(name, &root, None, Some(s.cfg.max_model_len)))
        .collect();
    // LoRA adapters after the base cards, as vLLM lists them: `root` the
    // adapter's path, `parent` the base model's (first) served name, no
    // `max_model_len`.
    data.extend(
        s.cfg
            .lora
            .modules
            .iter()
            .map(|m| card(&m.name, &m.path, Some(&s.cfg.model), None)),
    );
    axum::Json(json!({"object": "list", "data": data}))
}

async fn version(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    axum::Json(json!({"version": s.cfg.engine_mode.version_string()}))
}

async fn server_info(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    axum::Json(crate::surface::sglang_server_info(&s))
}

/// SGLang's `/flush_cache`: its prefix-cache reset (`AllBlocksCleared`),
/// refused while requests run.
async fn flush_cache(State(s): State<Arc<Shared>>) -> Response {
    if s.reset_prefix_cache() {
        (
            StatusCode::OK,
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
        )
            .into_response()
    } else {
        (
            StatusCode::BAD_REQUEST,
            "Cache not flushed. Please check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
        )
            .into_response()
    }
}

async fn load(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    axum::Json(json!({"server_load": s.in_flight()}))
}

async fn metrics(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    let delay = s.faults.metrics_delay();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.render_metrics(),
    )
}

async fn kv_event_sources(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    axum::Json(s.kv_event_sources())
}

async fn reset_prefix_cache(State(s): State<Arc<Shared>>) -> Response {
    if s.reset_prefix_cache() {
        StatusCode::OK.into_response()
    } else {
        ApiError {
            status: StatusCode::CONFLICT,
            message: "Failed to reset prefix cache because some blocks are not freed yet."
                .to_owned(),
            param: None,
        }
        .into_response()
    }
}

async fn tokenize(State(s): State<Arc<Shared>>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_json(&body)?;
    s.check_model(body.get("model"))?;
    let want_strs = body
        .get("return_token_strs")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let tok = s.tok.clone();
    let out =
        tokio::task::spawn_blocking(move || tok.tokenizer().tokenize(Endpoint::Tokenize, &body))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| tokenize_error(&e))?;
    let tokens = out.first_ids();
    let token_strs = want_strs.then(|| s.tok.tokenizer().token_strs(tokens));
    Ok(axum::Json(json!({
        "count": tokens.len(),
        "max_model_len": s.cfg.max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    }))
    .into_response())
}

async fn detokenize(State(s): State<Arc<Shared>>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_json(&body)?;
    s.check_model(body.get("model"))?;
    let tokens: Vec<u32> = body
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad_param("tokens", "`tokens` must be a list of token ids"))?
        .iter()
        .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<_>>()
        .ok_or_else(|| ApiError::bad_param("tokens", "`tokens` must be a list of token ids"))?;
    let text = s
        .tok
        .tokenizer()
        .decode(&tokens)
        .map_err(|e| tokenize_error(&e))?;
    Ok(axum::Json(json!({"prompt": text})).into_response())
}

async fn completions(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    generate(s, Kind::Completion, &headers, &body).await
}

async fn chat_completions(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    generate(s, Kind::Chat, &headers, &body).await
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// One generated choice being received.
struct Choice {
    index: usize,
    rank: Arc<Rank>,
    req: ReqId,
    rx: mpsc::UnboundedReceiver<Out>,
    prompt_tokens: usize,
    generated: usize,
    finished: Option<Finished>,
}

/// Aborts the engine requests of choices that did not finish (the client
/// went away, or the handler failed) when dropped.
struct Choices(Vec<Choice>);

impl Drop for Choices {
    fn drop(&mut self) {
        for c in &self.0 {
            if c.finished.is_none() {
                c.rank.abort(c.req);
            }
        }
    }
}

async fn generate(
    s: Arc<Shared>,
    kind: Kind,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    s.note_trace_parent(headers);
    let json = parse_json(body)?;
    let params = Params::parse(&json, kind == Kind::Chat)?;
    let target = s.resolve_model(json.get("model"))?;
    let endpoint = match kind {
        Kind::Completion => Endpoint::Completions,
        Kind::Chat => Endpoint::ChatCompletions,
    };
    let tok = s.tok.clone();
    let tokenized = tokio::task::spawn_blocking(move || tok.tokenizer().tokenize(endpoint, &json))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| tokenize_error(&e))?;
    if let Some(failed) =
        crate::surface::failure(&s, params.stream, tokenized.token_ids.len() * params.n)
    {
        return Ok(failed);
    }
    let rank = s.pick_rank(headers)?;
    let report_full = params.report_full && s.cfg.engine_mode.honours_report_mode_full();
    let mut choices = Choices(Vec::new());
    for (p, prompt) in tokenized.token_ids.into_iter().enumerate() {
        for i in 0..params.n {
            let req = NewRequest {
                prompt: prompt.clone(),
                max_tokens: params.max_tokens,
                min_tokens: params.min_tokens,
                ignore_eos: params.ignore_eos,
                seed: Some(params.seed.unwrap_or(0).wrapping_add(i as u64)),
                report_full,
                lora: target.lora,
                session: crate::api::session(headers, params.session.as_ref()),
            };
            let prompt_tokens = req.prompt.len();
            let (id, rx) = rank.submit(req).map_err(|e| ApiError::bad(e.to_string()))?;
            choices.0.push(Choice {
                index: p * params.n + i,
                rank: rank.clone(),
                req: id,
                rx,
                prompt_tokens,
                generated: 0,
                finished: None,
            });
        }
    }
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    let ctx = RespCtx {
        id: format!("{prefix}-{}", s.next_id_hex()),
        n: params.n,
        created: unix_now(),
        model: target.name,
        kind,
        details: s.cfg.enable_prompt_tokens_details,
        shared: s,
    };
    if params.stream {
        Ok(stream_response(ctx, choices, &params))
    } else {
        collect_response(ctx, choices).await
    }
}

struct RespCtx {
    id: String,
    n: usize,
    created: u64,
    model: String,
    kind: Kind,
    details: bool,
    shared: Arc<Shared>,
}

impl RespCtx {
    fn usage(&self, choices: &[Choice]) -> Usage {
        // vLLM counts each prompt once, even with n > 1.
        let (mut prompt_tokens, mut cached) = (0, 0);
        for c in choices.iter().filter(|c| c.index % self.n == 0) {
            prompt_tokens += c.prompt_tokens;
            cached += c.finished.map_or(0, |f| f.cached_tokens);
        }
        let completion_tokens: usize = choices.iter().map(|c| c.generated).sum();
        Usage {
            prompt_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            completion_tokens,
            prompt_tokens_details: self.details.then_some(PromptTokensDetails {
                cached_tokens: cached,
            }),
        }
    }
}

fn killed() -> Response {
    // Headers, then a body that fails: the connection is cut mid-response.
    let body = Body::from_stream(futures::stream::once(async {
        Err::<Bytes, io::Error>(io::Error::other("request killed by a fault"))
    }));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn collect_response(ctx: RespCtx, mut choices: Choices) -> Result<Response, ApiError> {
    let mut texts = vec![String::new(); choices.0.len()];
    for (c, text) in choices.0.iter_mut().zip(texts.iter_mut()) {
        while c.finished.is_none() {
            match c.rx.recv().await {
                Some(Out::Step(o)) => {
                    ctx.shared.tok.push_text(o.token, c.generated == 0, text);
                    c.generated += 1;
                    c.finished = o.finished;
                }
                Some(Out::Killed) | None => {
                    c.finished = Some(Finished {
                        reason: crate::engine::FinishReason::Abort,
                        prompt_tokens: c.prompt_tokens,
                        completion_tokens: c.generated,
                        cached_tokens: 0,
                    });
                    return Ok(killed());
                }
            }
        }
    }
    let usage = ctx.usage(&choices.0);
    let reason = |c: &Choice| c.finished.map_or("abort", |f| f.reason.as_str());
    let body = match ctx.kind {
        Kind::Completion => serde_json::to_vec(&Completion {
            id: &ctx.id,
            object: "text_completion",
            created: ctx.created,
            model: &ctx.model,
            choices: choices
                .0
                .iter()
                .zip(texts)
                .map(|(c, text)| CompletionChoice {
                    index: c.index,
                    text,
                    logprobs: None,
                    finish_reason: reason(c),
                    stop_reason: None,
                    prompt_logprobs: None,
                })
                .collect(),
            service_tier: None,
            system_fingerprint: None,
            usage,
            prompt_logprobs: None,
            kv_transfer_params: None,
        }),
        Kind::Chat => serde_json::to_vec(&Completion {
            id: &ctx.id,
            object: "chat.completion",
            created: ctx.created,
            model: &ctx.model,
            choices: choices
                .0
                .iter()
                .zip(texts)
                .map(|(c, content)| ChatChoice {
                    index: c.index,
                    message: Message {
                        role: "assistant",
                        content,
                        refusal: None,
                        annotations: None,
                        audio: None,
                        function_call: None,
                        tool_calls: [],
                        reasoning_content: None,
                    },
                    logprobs: None,
                    finish_reason: reason(c),
                    stop_reason: None,
                })
                .collect(),
            service_tier: None,
            system_fingerprint: None,
            usage,
            prompt_logprobs: None,
            kv_transfer_params: None,
        }),
    }
    .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}

fn stream_response(ctx: RespCtx, choices: Choices, params: &Params) -> Response {
    let mut stream = SseStream {
        ctx,
        choices,
        opening: VecDeque::new(),
        pending: VecDeque::new(),
        include_usage: params.include_usage,
        continuous_usage: params.continuous_usage,
        done: false,
        text: String::new(),
    };
    if stream.ctx.kind == Kind::Chat {
        // vLLM opens every choice with an empty assistant delta, sent with
        // the first token (see `SseStream::opening`).
        for i in 0..stream.choices.0.len() {
            let index = stream.choices.0[i].index;
            let usage = stream.running_usage();
            push_chunk(
                &mut stream.opening,
                &Chunk {
                    id: &stream.ctx.id,
                    object: "chat.completion.chunk",
                    created: stream.ctx.created,
                    model: &stream.ctx.model,
                    choices: vec![ChatChunkChoice {
                        index,
                        delta: Delta {
                            role: Some("assistant"),
                            content: Some(""),
                        },
                        logprobs: None,
                        finish_reason: None,
                        stop_reason: None,
                    }],
                    usage,
                },
            );
        }
    }
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn push_chunk<T: Serialize>(pending: &mut VecDeque<Bytes>, chunk: &T) {
    let mut buf = Vec::with_capacity(256);
    buf.extend_from_slice(b"data: ");
    if serde_json::to_writer(&mut buf, chunk).is_ok() {
        buf.extend_from_slice(b"\n\n");
        pending.push_back(Bytes::from(buf));
    }
}

/// The SSE body: one `data:` event per token and choice, then the usage
/// chunk when asked for, then `data: [DONE]`. Dropping it (client gone)
/// aborts the unfinished engine requests.
struct SseStream {
    ctx: RespCtx,
    choices: Choices,
    /// Chat's opening chunks (the assistant role), held until the first
    /// token: vLLM sends them from its first engine output, so a client's
    /// first bytes mark the first token.
    opening: VecDeque<Bytes>,
    pending: VecDeque<Bytes>,
    include_usage: bool,
    continuous_usage: bool,
    done: bool,
    text: String,
}

impl SseStream {
    fn running_usage(&self) -> Option<Usage> {
        self.continuous_usage
            .then(|| self.ctx.usage(&self.choices.0))
    }

    fn on_token(&mut self, at: usize, token: u32, finished: Option<Finished>) {
        self.release_opening();
        let (index, first) = {
            let c = &mut self.choices.0[at];
            c.generated += 1;
            c.finished = finished;
            (c.index, c.generated == 1)
        };
        let mut text = std::mem::take(&mut self.text);
        text.clear();
        self.ctx.shared.tok.push_text(token, first, &mut text);
        let finish_reason = finished.map(|f| f.reason.as_str());
        let usage = self.running_usage();
        match self.ctx.kind {
            Kind::Completion => {
                let chunk = Chunk {
                    id: &self.ctx.id,
                    object: "text_completion",
                    created: self.ctx.created,
                    model: &self.ctx.model,
                    choices: vec![CompletionChunkChoice {
                        index,
                        text: &text,
                        logprobs: None,
                        finish_reason,
                        stop_reason: None,
                    }],
                    usage,
                };
                push_chunk(&mut self.pending, &chunk);
            }
            Kind::Chat => {
                let chunk = Chunk {
                    id: &self.ctx.id,
                    object: "chat.completion.chunk",
                    created: self.ctx.created,
                    model: &self.ctx.model,
                    choices: vec![ChatChunkChoice {
                        index,
                        delta: Delta {
                            role: None,
                            content: Some(&text),
                        },
                        logprobs: None,
                        finish_reason,
                        stop_reason: finished.map(|_| crate::api::NullField),
                    }],
                    usage,
                };
                push_chunk(&mut self.pending, &chunk);
            }
        }
        self.text = text;
    }

    /// Moves the held opening chunks ahead of everything else.
    fn release_opening(&mut self) {
        while let Some(b) = self.opening.pop_back() {
            self.pending.push_front(b);
        }
    }

    fn finish(&mut self) {
        self.release_opening();
        if self.include_usage {
            let usage = self.ctx.usage(&self.choices.0);
            let object = match self.ctx.kind {
                Kind::Completion => "text_completion",
                Kind::Chat => "chat.completion.chunk",
            };
            let chunk: Chunk<'_, ()> = Chunk {
                id: &self.ctx.id,
                object,
                created: self.ctx.created,
                model: &self.ctx.model,
                choices: Vec::new(),
                usage: Some(usage),
            };
            push_chunk(&mut self.pending, &chunk);
        }
        self.pending
            .push_back(Bytes::from_static(b"data: [DONE]\n\n"));
        self.done = true;
    }
}

impl futures::Stream for SseStream {
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
            let mut progressed = false;
            for at in 0..this.choices.0.len() {
                while this.choices.0[at].finished.is_none() {
                    match this.choices.0[at].rx.poll_recv(cx) {
                        Poll::Ready(Some(Out::Step(o))) => {
                            this.on_token(at, o.token, o.finished);
                            progressed = true;
                        }
                        Poll::Ready(Some(Out::Killed) | None) => {
                            this.done = true;
                            this.pending.clear();
                            return Poll::Ready(Some(Err(io::Error::other(
                                "request killed by a fault",
                            ))));
                        }
                        Poll::Pending => break,
                    }
                }
            }
            if this.choices.0.iter().all(|c| c.finished.is_some()) {
                this.finish();
                continue;
            }
            if !progressed {
                return Poll::Pending;
            }
        }
    }
}

async fn debug_cache(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, String>>,
) -> impl IntoResponse {
    let flag = |k: &str| q.get(k).is_some_and(|v| v == "1" || v == "true");
    let rank = q.get("rank").and_then(|r| r.parse::<u32>().ok());
    axum::Json(s.cache_truth(rank, flag("tokens"), flag("digests"), !flag("summary")))
}

async fn debug_requests(
    State(s): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, String>>,
) -> impl IntoResponse {
    let limit = q
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .unwrap_or(100);
    let ranks: Vec<Value> = s
        .ranks
        .iter()
        .map(|r| {
            let st = r.lock();
            let all: Vec<_> = st.core.recent().collect();
            let from = all.len().saturating_sub(limit);
            json!({"rank": r.index, "requests": all[from..]})
        })
        .collect();
    axum::Json(json!({"engines": ranks}))
}

async fn prefix_match(State(s): State<Arc<Shared>>, body: Bytes) -> Result<Response, ApiError> {
    let body = parse_json(&body)?;
    // `model` picks the cache namespace: a LoRA adapter's blocks, or the
    // base model's (absent or a served name).
    let lora = s.resolve_model(body.get("model"))?.lora;
    let tokens: Vec<u32> = if let Some(t) = body.get("tokens") {
        t.as_array()
            .and_then(|a| {
                a.iter()
                    .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect()
            })
            .ok_or_else(|| ApiError::bad_param("tokens", "`tokens` must be a list of token ids"))?
    } else {
        let tok = s.tok.clone();
        let kind = if body.get("messages").is_some() {
            Endpoint::ChatCompletions
        } else {
            Endpoint::Completions
        };
        tokio::task::spawn_blocking(move || tok.tokenizer().tokenize(kind, &body))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| tokenize_error(&e))?
            .first_ids()
            .to_vec()
    };
    let per_rank: Vec<Value> = s
        .cached_prefix_tokens(&tokens, lora)
        .into_iter()
        .enumerate()
        .map(|(rank, cached)| json!({"rank": rank, "cached_tokens": cached}))
        .collect();
    Ok(axum::Json(json!({"prompt_tokens": tokens.len(), "engines": per_rank})).into_response())
}

async fn faults_get(State(s): State<Arc<Shared>>) -> impl IntoResponse {
    axum::Json(s.fault_state())
}

async fn faults_post(State(s): State<Arc<Shared>>, body: Bytes) -> Result<Response, ApiError> {
    let req: FaultRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad(format!("invalid fault request: {e}")))?;
    let report = s.apply_faults(&req).await.map_err(ApiError::bad)?;
    Ok(axum::Json(report).into_response())
}
