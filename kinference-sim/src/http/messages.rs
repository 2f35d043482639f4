//! `POST /v1/messages` (vLLM only): Anthropic's Messages API as vLLM
//! serves it. The request ([`MessagesRequest`], read by [`parse_messages`])
//! becomes a chat conversation and runs as a [`ChatJob`] through the shared
//! admission in [`super::apis`]; this file also holds the answer's
//! `stop_reason` mapping, the rewriting of errors into Anthropic's shape
//! ([`anthropic_shape`]) and the event stream ([`MessageEvents`]).

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::apis::{
    Admitted, ChatJob, EventStream, Events, admit, collect, content_text, sse_event, sse_response,
};
use super::{killed, parse_json};
use crate::Shared;
use crate::api::{ApiError, ErrorMark, Params};
use crate::engine::{FinishReason, Finished};

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
