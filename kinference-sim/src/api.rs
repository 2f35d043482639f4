//! OpenAI request parameters and response shapes, as vLLM writes them.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::Value;

/// An error in vLLM's (≥ 0.10.1) shape:
/// `{"error": {"message", "type", "param", "code"}}`, `code` = HTTP status.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    pub(crate) param: Option<&'static str>,
}

impl ApiError {
    pub(crate) fn bad(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
        }
    }

    pub(crate) fn bad_param(param: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param),
        }
    }

    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            param: None,
        }
    }

    pub(crate) fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            param: None,
        }
    }

    pub(crate) fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::CONFLICT => "ConflictError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            StatusCode::UNAUTHORIZED => "UnauthorizedError",
            _ => "InternalServerError",
        }
    }
}

impl ApiError {
    /// The body in vLLM's (≥ 0.10.1) shape.
    pub(crate) fn vllm_body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }

    /// The body in SGLang's shape: a flat `ErrorResponse`.
    pub(crate) fn sglang_body(&self) -> serde_json::Value {
        serde_json::json!({
            "object": "error",
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status.as_u16(),
        })
    }
}

/// Marks a response as an [`ApiError`], so the SGLang mode's layer can
/// rewrite its body in SGLang's shape.
#[derive(Debug, Clone)]
pub(crate) struct ErrorMark(pub(crate) ApiError);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.vllm_body())).into_response();
        r.extensions_mut().insert(ErrorMark(self));
        r
    }
}

/// The parameters of a generation request the simulator honours; the rest
/// (sampling, logprobs, tools) changes nothing in a simulation and is
/// accepted and ignored.
#[derive(Debug, Clone, Default)]
pub(crate) struct Params {
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) continuous_usage: bool,
    pub(crate) max_tokens: Option<usize>,
    pub(crate) min_tokens: usize,
    pub(crate) ignore_eos: bool,
    pub(crate) seed: Option<u64>,
    pub(crate) n: usize,
    /// `vllm_xargs.kv_cache_report_mode == "full"`.
    pub(crate) report_full: bool,
    /// The body's `session_id` (see [`session`]).
    pub(crate) session: Option<std::sync::Arc<str>>,
}

/// The session a request belongs to: the `x-session-id` header, else the
/// body's `session_id` ([`Params::session`]). The engine publishes it on
/// the request's `BlockStored` events where its release does
/// ([`crate::EngineMode::publishes_session_id`]).
pub(crate) fn session(
    headers: &axum::http::HeaderMap,
    body: Option<&std::sync::Arc<str>>,
) -> Option<std::sync::Arc<str>> {
    headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
        .map(std::sync::Arc::from)
        .or_else(|| body.cloned())
}

pub(crate) fn opt_uint(body: &Value, key: &'static str) -> Result<Option<u64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            ApiError::bad_param(
                key,
                format!("`{key}` must be a non-negative integer, got {v}"),
            )
        }),
    }
}

pub(crate) fn opt_bool(body: &Value, key: &'static str) -> Result<Option<bool>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::bad_param(
            key,
            format!("`{key}` must be a boolean, got {v}"),
        )),
    }
}

impl Params {
    /// Reads the parameters of a `/v1/completions` (`chat` false) or
    /// `/v1/chat/completions` body.
    pub(crate) fn parse(body: &Value, chat: bool) -> Result<Params, ApiError> {
        if !body.is_object() {
            return Err(ApiError::bad("the request body must be a JSON object"));
        }
        let stream = opt_bool(body, "stream")?.unwrap_or(false);
        let (mut include_usage, mut continuous_usage) = (false, false);
        match body.get("stream_options") {
            None | Some(Value::Null) => {}
            Some(so @ Value::Object(_)) => {
                if !stream {
                    return Err(ApiError::bad_param(
                        "stream_options",
                        "Stream options can only be defined when `stream=True`.",
                    ));
                }
                include_usage = opt_bool(so, "include_usage")?.unwrap_or(false);
                continuous_usage = opt_bool(so, "continuous_usage_stats")?.unwrap_or(false);
            }
            Some(v) => {
                return Err(ApiError::bad_param(
                    "stream_options",
                    format!("`stream_options` must be an object, got {v}"),
                ));
            }
        }
        let max_tokens = if chat {
            opt_uint(body, "max_completion_tokens")?.or(opt_uint(body, "max_tokens")?)
        } else {
            opt_uint(body, "max_tokens")?
        };
        if max_tokens == Some(0) {
            return Err(ApiError::bad_param(
                "max_tokens",
                "max_tokens must be at least 1, got 0.",
            ));
        }
        let n = opt_uint(body, "n")?.unwrap_or(1);
        if !(1..=128).contains(&n) {
            return Err(ApiError::bad_param(
                "n",
                format!("n must be between 1 and 128, got {n}."),
            ));
        }
        Ok(Params {
            stream,
            include_usage,
            continuous_usage,
            max_tokens: max_tokens.map(|m| m as usize),
            min_tokens: opt_uint(body, "min_tokens")?.unwrap_or(0) as usize,
            ignore_eos: opt_bool(body, "ignore_eos")?.unwrap_or(false),
            seed: match body.get("seed") {
                None | Some(Value::Null) => None,
                Some(v) => Some(
                    v.as_i64()
                        .map(|s| s as u64)
                        .or_else(|| v.as_u64())
                        .ok_or_else(|| {
                            ApiError::bad_param(
                                "seed",
                                format!("`seed` must be an integer, got {v}"),
                            )
                        })?,
                ),
            },
            n: n as usize,
            report_full: report_mode_full(body)?,
            session: match body.get("session_id") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) if !s.is_empty() => Some(s.as_str().into()),
                Some(v) => {
                    return Err(ApiError::bad_param(
                        "session_id",
                        format!("`session_id` must be a non-empty string, got {v}"),
                    ));
                }
            },
        })
    }
}

/// vLLM's per-request `vllm_xargs` (its sampling params' `extra_args`):
/// whether `kv_cache_report_mode` is `"full"`. vLLM takes any other value
/// as `"incremental"`; `vllm_xargs` itself must be an object.
fn report_mode_full(body: &Value) -> Result<bool, ApiError> {
    match body.get("vllm_xargs") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Object(x)) => {
            Ok(x.get("kv_cache_report_mode").and_then(Value::as_str) == Some("full"))
        }
        Some(v) => Err(ApiError::bad_param(
            "vllm_xargs",
            format!("`vllm_xargs` must be an object, got {v}"),
        )),
    }
}

/// `usage`.
#[derive(Debug, Clone, Copy, Serialize, Default)]
pub(crate) struct Usage {
    pub(crate) prompt_tokens: usize,
    pub(crate) total_tokens: usize,
    pub(crate) completion_tokens: usize,
    pub(crate) prompt_tokens_details: Option<PromptTokensDetails>,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize, Default)]
pub(crate) struct PromptTokensDetails {
    pub(crate) cached_tokens: usize,
}

/// One streamed completion choice.
#[derive(Serialize)]
pub(crate) struct CompletionChunkChoice<'a> {
    pub(crate) index: usize,
    pub(crate) text: &'a str,
    pub(crate) logprobs: Option<()>,
    pub(crate) finish_reason: Option<&'static str>,
    pub(crate) stop_reason: Option<()>,
}

/// One streamed chat choice.
#[derive(Serialize)]
pub(crate) struct ChatChunkChoice<'a> {
    pub(crate) index: usize,
    pub(crate) delta: Delta<'a>,
    pub(crate) logprobs: Option<()>,
    pub(crate) finish_reason: Option<&'static str>,
    /// `stop_reason: null`, written only on the final chunk (as vLLM does).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) stop_reason: Option<NullField>,
}

/// A field written as JSON `null`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NullField;

impl Serialize for NullField {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_none()
    }
}

/// A chat delta.
#[derive(Serialize)]
pub(crate) struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) content: Option<&'a str>,
}

/// A streamed chunk (both endpoints).
#[derive(Serialize)]
pub(crate) struct Chunk<'a, C> {
    pub(crate) id: &'a str,
    pub(crate) object: &'static str,
    pub(crate) created: u64,
    pub(crate) model: &'a str,
    pub(crate) choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) usage: Option<Usage>,
}

/// One non-streamed completion choice.
#[derive(Serialize)]
pub(crate) struct CompletionChoice {
    pub(crate) index: usize,
    pub(crate) text: String,
    pub(crate) logprobs: Option<()>,
    pub(crate) finish_reason: &'static str,
    pub(crate) stop_reason: Option<()>,
    pub(crate) prompt_logprobs: Option<()>,
}

/// A non-streamed chat message.
#[derive(Serialize)]
pub(crate) struct Message {
    pub(crate) role: &'static str,
    pub(crate) content: String,
    pub(crate) refusal: Option<()>,
    pub(crate) annotations: Option<()>,
    pub(crate) audio: Option<()>,
    pub(crate) function_call: Option<()>,
    pub(crate) tool_calls: [(); 0],
    pub(crate) reasoning_content: Option<()>,
}

/// One non-streamed chat choice.
#[derive(Serialize)]
pub(crate) struct ChatChoice {
    pub(crate) index: usize,
    pub(crate) message: Message,
    pub(crate) logprobs: Option<()>,
    pub(crate) finish_reason: &'static str,
    pub(crate) stop_reason: Option<()>,
}

/// A non-streamed response (both endpoints).
#[derive(Serialize)]
pub(crate) struct Completion<'a, C> {
    pub(crate) id: &'a str,
    pub(crate) object: &'static str,
    pub(crate) created: u64,
    pub(crate) model: &'a str,
    pub(crate) choices: Vec<C>,
    pub(crate) service_tier: Option<()>,
    pub(crate) system_fingerprint: Option<()>,
    pub(crate) usage: Usage,
    pub(crate) prompt_logprobs: Option<()>,
    pub(crate) kv_transfer_params: Option<()>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn params_follow_vllm_defaults_and_checks() {
        let p = Params::parse(&json!({"prompt": "x"}), false).expect("valid");
        assert!(!p.stream && p.max_tokens.is_none() && p.n == 1);
        let p = Params::parse(
            &json!({"messages": [], "max_completion_tokens": 5, "max_tokens": 9, "stream": true,
                    "stream_options": {"include_usage": true}}),
            true,
        )
        .expect("valid");
        assert_eq!((p.max_tokens, p.include_usage), (Some(5), true));
        assert!(!p.report_full);
        let p = Params::parse(
            &json!({"prompt": "x", "vllm_xargs": {"kv_cache_report_mode": "full"}}),
            false,
        )
        .expect("valid");
        assert!(p.report_full);
        let p = Params::parse(
            &json!({"prompt": "x", "vllm_xargs": {"kv_cache_report_mode": "incremental"}}),
            false,
        )
        .expect("valid");
        assert!(!p.report_full);
        for bad in [
            json!({"max_tokens": 0}),
            json!({"max_tokens": -1}),
            json!({"stream_options": {"include_usage": true}}),
            json!({"n": 0}),
            json!({"stream": "yes"}),
            json!({"vllm_xargs": "full"}),
            json!([1]),
        ] {
            assert!(Params::parse(&bad, false).is_err(), "{bad}");
        }
    }

    #[test]
    fn errors_have_vllm_shape() {
        let e = ApiError::not_found("The model `x` does not exist.");
        assert_eq!(e.kind(), "NotFoundError");
        let r = e.into_response();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
    }
}
