//! `POST /generate`: SGLang's native API (SGLang mode only), as its HTTP
//! server answers it. The prompt is `text` (tokenized as a completion
//! prompt: the tokenizer's special tokens added, no chat template) or
//! `input_ids`; `sampling_params.max_new_tokens` (SGLang's default 128),
//! `min_new_tokens` and `ignore_eos` are honoured, the rest accepted and
//! ignored. The answer is `{"text", "output_ids", "meta_info"}`; streamed,
//! one `data: {…}` event per token with the text and ids so far (SGLang's
//! default, without `--incremental-streaming-output`), then
//! `data: [DONE]`. One prompt per request: batches (a list of prompts) are
//! refused.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::Out;
use super::apis::{Admitted, ChatJob, EventStream, Events, admit_prompt, sse_response};
use super::{killed, parse_json, tokenize_error};
use crate::Shared;
use crate::engine::{FinishReason, Finished};
use kinference_tokenize::Endpoint;

/// SGLang's `SamplingParams.max_new_tokens` default.
const DEFAULT_MAX_NEW_TOKENS: usize = 128;

/// SGLang's error for a request it cannot read: `{"error": {"message"}}`,
/// 400.
fn refused(message: impl Into<String>) -> Response {
    (
        StatusCode::BAD_REQUEST,
        axum::Json(json!({"error": {"message": message.into()}})),
    )
        .into_response()
}

/// The answer so far, in SGLang's shape.
struct Output {
    rid: String,
    prompt_tokens: usize,
    started: Instant,
    text: String,
    ids: Vec<u32>,
}

impl Output {
    fn body(&self, finished: Option<Finished>) -> Value {
        let finish_reason = match finished.map(|f| f.reason) {
            None => Value::Null,
            Some(FinishReason::Length) => json!({"type": "length", "length": self.ids.len()}),
            Some(FinishReason::Stop) => {
                json!({"type": "stop", "matched": self.ids.last().copied().unwrap_or(0)})
            }
            Some(FinishReason::Abort) => json!({"type": "abort", "message": "aborted"}),
        };
        json!({
            "text": self.text,
            "output_ids": self.ids,
            "meta_info": {
                "id": self.rid,
                "finish_reason": finish_reason,
                "prompt_tokens": self.prompt_tokens,
                "weight_version": "default",
                "total_retractions": 0,
                "completion_tokens": self.ids.len(),
                "cached_tokens": finished.map_or(0, |f| f.cached_tokens),
                "e2e_latency": self.started.elapsed().as_secs_f64(),
            },
        })
    }
}

/// One `data:` event per token with the output so far, the last with its
/// finish reason, then `data: [DONE]`.
struct GenerateEvents {
    out: Output,
    pending_id: Option<u32>,
}

fn data_event(out: &mut VecDeque<Bytes>, v: &Value) {
    let mut buf = b"data: ".to_vec();
    if serde_json::to_writer(&mut buf, v).is_ok() {
        buf.extend_from_slice(b"\n\n");
        out.push_back(Bytes::from(buf));
    }
}

impl Events for GenerateEvents {
    fn token_id(&mut self, id: u32) {
        self.pending_id = Some(id);
    }

    fn token(&mut self, text: &str, _first: bool, out: &mut VecDeque<Bytes>) {
        self.out.text.push_str(text);
        self.out.ids.extend(self.pending_id.take());
        data_event(out, &self.out.body(None));
    }

    /// Called right after the last token's [`Events::token`]: SGLang sends
    /// the finish reason on the last token's event, so that event is
    /// replaced.
    fn finish(&mut self, f: Finished, out: &mut VecDeque<Bytes>) {
        out.pop_back();
        data_event(out, &self.out.body(Some(f)));
        out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    }
}

/// `POST /generate`.
pub(super) async fn generate(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, crate::api::ApiError> {
    let started = Instant::now();
    let json = parse_json(&body)?;
    let Some(obj) = json.as_object() else {
        return Ok(refused("The request must be a JSON object."));
    };
    let prompt = match (obj.get("text"), obj.get("input_ids")) {
        (Some(Value::String(t)), None | Some(Value::Null)) => {
            let tok = s.tok.clone();
            let body = json!({ "prompt": t });
            let tokenized = tokio::task::spawn_blocking(move || {
                tok.tokenizer().tokenize(Endpoint::Completions, &body)
            })
            .await
            .map_err(|e| crate::api::ApiError::internal(e.to_string()))?
            .map_err(|e| tokenize_error(&e))?;
            tokenized.token_ids.into_iter().next().unwrap_or_default()
        }
        (None | Some(Value::Null), Some(Value::Array(ids))) if ids.iter().all(Value::is_u64) => ids
            .iter()
            .filter_map(Value::as_u64)
            .map(|i| u32::try_from(i).unwrap_or(u32::MAX))
            .collect(),
        (Some(Value::Array(_)), _) | (_, Some(Value::Array(_))) => {
            return Ok(refused(
                "kinference-sim serves one prompt per /generate request (a string `text` or a flat `input_ids`).",
            ));
        }
        (None | Some(Value::Null), None | Some(Value::Null)) => {
            return Ok(refused("Either text or input_ids should be provided."));
        }
        _ => {
            return Ok(refused(
                "Either text or input_ids should be provided, not both.",
            ));
        }
    };
    if prompt.is_empty() {
        return Ok(refused("The input is empty."));
    }
    let sp = obj.get("sampling_params").cloned().unwrap_or(Value::Null);
    let uint = |k: &str| sp.get(k).and_then(Value::as_u64).map(|v| v as usize);
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let job = ChatJob {
        messages: Vec::new(),
        max_tokens: Some(uint("max_new_tokens").unwrap_or(DEFAULT_MAX_NEW_TOKENS)),
        min_tokens: uint("min_new_tokens").unwrap_or(0),
        ignore_eos: sp
            .get("ignore_eos")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        seed: sp.get("sampling_seed").and_then(Value::as_u64),
        report_full: false,
        stream,
        lora: None,
        session: None,
    };
    let rid = match obj.get("rid") {
        Some(Value::String(r)) => r.clone(),
        _ => s.next_id_hex(),
    };
    let mut choices = match admit_prompt(&s, &headers, &job, prompt)? {
        Admitted::Run(c) => c,
        Admitted::Refused(r) => return Ok(r),
        Admitted::StreamFailed(message) => {
            let mut out = VecDeque::new();
            data_event(&mut out, &json!({"error": {"message": message}}));
            out.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
            let chunks: Vec<Result<Bytes, std::io::Error>> = out.into_iter().map(Ok).collect();
            return Ok(sse_response(Body::from_stream(futures::stream::iter(
                chunks,
            ))));
        }
    };
    let output = Output {
        rid,
        prompt_tokens: choices.0[0].prompt_tokens,
        started,
        text: String::new(),
        ids: Vec::new(),
    };
    let events = GenerateEvents {
        out: output,
        pending_id: None,
    };
    if stream {
        let stream = EventStream::new(events, choices, s, VecDeque::new());
        return Ok(sse_response(Body::from_stream(stream)));
    }
    let mut out = events.out;
    let c = &mut choices.0[0];
    loop {
        match c.rx.recv().await {
            Some(Out::Step(o)) => {
                s.tok.push_text(o.token, c.generated == 0, &mut out.text);
                out.ids.push(o.token);
                c.generated += 1;
                c.finished = o.finished;
                if let Some(f) = o.finished {
                    return Ok(axum::Json(out.body(Some(f))).into_response());
                }
            }
            Some(Out::Killed) | None => return Ok(killed()),
        }
    }
}
