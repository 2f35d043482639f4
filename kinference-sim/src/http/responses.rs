//! `POST /v1/responses`: OpenAI's Responses API as vLLM serves it. The
//! input (a string or message items, after the `instructions`) becomes a
//! chat conversation and runs as a [`ChatJob`] through the shared admission
//! in [`super::apis`]; this file holds the request's reading
//! ([`response_item`]), the response object ([`ResponseInfo`]) and its
//! event stream ([`ResponseEvents`]).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::apis::{
    Admitted, ChatJob, EventStream, Events, admit, collect, content_text, sse_event, sse_response,
};
use super::{killed, parse_json, unix_now};
use crate::Shared;
use crate::api::{ApiError, Params, opt_bool, opt_uint};
use crate::engine::{FinishReason, Finished};

/// Responses kept for `GET /v1/responses/{id}`, `/cancel` and
/// `previous_response_id` (`SimConfig::responses_store`, vLLM's
/// `VLLM_ENABLE_RESPONSES_API_STORE=1`). vLLM keeps them in memory without
/// a bound; the simulator keeps the newest [`ResponseStore::CAPACITY`].
#[derive(Default, Debug)]
pub(crate) struct ResponseStore {
    kept: HashMap<String, Kept>,
    order: VecDeque<String>,
}

/// One kept response: its object and the conversation it ended (input
/// messages without the instructions, then the answer), which a request
/// naming it as `previous_response_id` continues.
#[derive(Debug)]
struct Kept {
    body: Value,
    conversation: Vec<Value>,
}

impl ResponseStore {
    const CAPACITY: usize = 10_000;

    fn keep(&mut self, id: String, kept: Kept) {
        if self.kept.insert(id.clone(), kept).is_none() {
            self.order.push_back(id);
        }
        while self.order.len() > Self::CAPACITY {
            if let Some(old) = self.order.pop_front() {
                self.kept.remove(&old);
            }
        }
    }
}

/// What keeps a finished response: the engine and the conversation so far.
struct Keep {
    shared: Arc<Shared>,
    conversation: Vec<Value>,
}

/// vLLM's checks of a response id: 400 unless it begins with `resp`.
fn check_id(id: &str) -> Result<(), ApiError> {
    if id.starts_with("resp") {
        Ok(())
    } else {
        Err(ApiError::bad_param(
            "response_id",
            format!("Invalid 'response_id': '{id}'. Expected an ID that begins with 'resp'."),
        ))
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError {
        param: Some("response_id"),
        ..ApiError::not_found(format!("Response with id '{id}' not found."))
    }
}

/// What `read` takes from the kept response `id`: vLLM's 400 for an id
/// not beginning with `resp`, its 404 for one not kept (always, with the
/// store off).
fn with_kept<T>(s: &Shared, id: &str, read: impl FnOnce(&Kept) -> T) -> Result<T, ApiError> {
    check_id(id)?;
    let store = s
        .responses
        .lock()
        .map_err(|_| ApiError::internal("store"))?;
    store.kept.get(id).map(read).ok_or_else(|| not_found(id))
}

fn kept_body(s: &Shared, id: &str) -> Result<Value, ApiError> {
    with_kept(s, id, |k| k.body.clone())
}

/// `GET /v1/responses/{id}`: a kept response.
pub(super) async fn retrieve(
    State(s): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(axum::Json(kept_body(&s, &id)?).into_response())
}

/// `POST /v1/responses/{id}/cancel`: only background responses can be
/// cancelled, and the simulator runs none, so a kept response is vLLM's
/// "Cannot cancel a synchronous response." (400).
pub(super) async fn cancel(
    State(s): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    kept_body(&s, &id)?;
    Err(ApiError::bad_param(
        "response_id",
        "Cannot cancel a synchronous response.",
    ))
}

/// The request fields a Responses answer repeats.
struct ResponseInfo {
    id: String,
    previous_response_id: Value,
    /// Set when the answer is to be kept.
    keep: Option<Keep>,
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
            "previous_response_id": self.previous_response_id,
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
        let body = self.body(status, &output, f.prompt_tokens, &usage);
        if let Some(keep) = &self.keep
            && let Ok(mut store) = keep.shared.responses.lock()
        {
            let mut conversation = keep.conversation.clone();
            conversation.push(json!({"role": "assistant", "content": text}));
            store.keep(
                self.id.clone(),
                Kept {
                    body: body.clone(),
                    conversation,
                },
            );
        }
        body
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
    let store = opt_bool(&json, "store")?.unwrap_or(true);
    if opt_bool(&json, "background")?.unwrap_or(false) {
        return Err(if store && !s.cfg.responses_store {
            ApiError::bad_param(
                "background",
                "This vLLM engine does not support `store=True` and therefore does not support the background mode. To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
            )
        } else {
            ApiError::bad_param(
                "background",
                "kinference-sim does not run background responses.",
            )
        });
    }
    // The conversation a previous response ended, which this one continues
    // (its instructions are not carried over, as in vLLM).
    let (previous_response_id, mut conversation) = match json.get("previous_response_id") {
        None | Some(Value::Null) => (Value::Null, Vec::new()),
        Some(Value::String(id)) => (json!(id), with_kept(&s, id, |k| k.conversation.clone())?),
        Some(v) => {
            return Err(ApiError::bad_param(
                "previous_response_id",
                format!("`previous_response_id` must be a string, got {v}"),
            ));
        }
    };
    match json.get("input") {
        Some(Value::String(t)) => conversation.push(json!({"role": "user", "content": t})),
        Some(Value::Array(items)) => {
            for item in items {
                conversation.extend(response_item(item)?);
            }
        }
        _ => {
            return Err(ApiError::bad_param(
                "input",
                "`input` must be a string or a list of input items",
            ));
        }
    }
    let mut messages = Vec::with_capacity(conversation.len() + 1);
    if let Value::String(i) = &instructions {
        messages.push(json!({"role": "system", "content": i}));
    }
    messages.extend(conversation.iter().cloned());
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
        previous_response_id,
        keep: (store && s.cfg.responses_store).then(|| Keep {
            shared: Arc::clone(&s),
            conversation,
        }),
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
