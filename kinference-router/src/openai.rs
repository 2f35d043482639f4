//! OpenAI-shaped errors and the parts of a request the router reads.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::Full;
use std::borrow::Cow;

use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// An error answered to the client in OpenAI's shape:
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// `error.type`.
    pub kind: &'static str,
    /// `error.message`.
    pub message: String,
    /// `error.param`.
    pub param: Option<&'static str>,
    /// `error.code`.
    pub code: Option<&'static str>,
    /// A `Retry-After` header, seconds (429s from the admission queue).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 401 `invalid_api_key`, as OpenAI answers a missing or wrong key.
    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            kind: "invalid_request_error",
            message: "Incorrect or missing API key: send it as `Authorization: Bearer KEY`.".into(),
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param,
            code: None,
            retry_after: None,
        }
    }

    /// 404 `model_not_found`.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!(
                "The model `{model}` does not exist in this pool. GET /v1/models lists the models and aliases served."
            ),
            param: Some("model"),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }

    /// vLLM's 404 for a stored response no engine keeps (its store is off,
    /// or the id is unknown or gone with its engine).
    pub fn response_not_found(id: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!("Response with id '{id}' not found."),
            param: Some("response_id"),
            code: None,
            retry_after: None,
        }
    }

    /// 400: the body names no model and the pool serves `models` (none or
    /// several), so there is no default to give it.
    pub fn model_required(models: &[&str]) -> Self {
        let served = if models.is_empty() {
            "none yet".to_owned()
        } else {
            models.join(", ")
        };
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: format!(
                "`model` is required: this pool serves more than one model ({served}). GET /v1/models lists them and their aliases."
            ),
            param: Some("model"),
            code: None,
            retry_after: None,
        }
    }

    /// 404 for an unknown path.
    pub fn not_found(path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!(
                "Unknown path {path}. This router serves POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/embeddings, /tokenize, /detokenize and /generate (SGLang's), and GET /v1/models, /v1/responses/{{id}} and /health (POST /v1/responses/{{id}}/cancel)."
            ),
            param: None,
            code: Some("not_found"),
            retry_after: None,
        }
    }

    /// 405.
    pub fn method_not_allowed(method: &http::Method, path: &str) -> Self {
        Self {
            status: StatusCode::METHOD_NOT_ALLOWED,
            kind: "invalid_request_error",
            message: format!("{method} is not allowed on {path}."),
            param: None,
            code: Some("method_not_allowed"),
            retry_after: None,
        }
    }

    /// 413.
    pub fn too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: "invalid_request_error",
            message: format!(
                "The request body is larger than this router's limit of {limit} bytes."
            ),
            param: None,
            code: Some("request_too_large"),
            retry_after: None,
        }
    }

    /// 408: the body did not arrive in time.
    pub fn timeout(limit: std::time::Duration) -> Self {
        Self {
            status: StatusCode::REQUEST_TIMEOUT,
            kind: "invalid_request_error",
            message: format!("The request body did not arrive within {limit:?}."),
            param: None,
            code: Some("request_timeout"),
            retry_after: None,
        }
    }

    /// 503: nothing to send the request to.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "service_unavailable",
            message: message.into(),
            param: None,
            code: Some("no_healthy_endpoint"),
            // Engines refusing (their admission control, draining) or gone
            // come back within probes' and scrapes' second: clients' SDKs
            // (OpenAI's honours it) wait that long instead of their own
            // backoff.
            retry_after: Some(1),
        }
    }

    /// 502: the engine failed.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_GATEWAY,
            kind: "upstream_error",
            message: message.into(),
            param: None,
            code: Some("upstream_error"),
            retry_after: None,
        }
    }

    /// 504: the engine did not answer in time.
    pub fn gateway_timeout(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::GATEWAY_TIMEOUT,
            kind: "upstream_error",
            message: message.into(),
            param: None,
            code: Some("upstream_timeout"),
            retry_after: None,
        }
    }

    /// 429 `rate_limit_exceeded` with `Retry-After`, as OpenAI answers when
    /// it cannot take a request now: the router's admission queue is full, or
    /// the request's deadline cannot be met (`code`: `queue_full`,
    /// `deadline`). No engine has seen the request.
    pub fn too_many_requests(
        message: impl Into<String>,
        code: &'static str,
        retry_after_secs: u64,
    ) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "rate_limit_exceeded",
            message: message.into(),
            param: None,
            code: Some(code),
            retry_after: Some(retry_after_secs.max(1)),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Bytes {
        let v = serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        });
        Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
    }

    /// The HTTP response.
    pub fn response(&self) -> Response<Full<Bytes>> {
        let mut r = Response::new(Full::new(self.body()));
        *r.status_mut() = self.status;
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(secs) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        r
    }
}

/// Which OpenAI endpoint a request is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /v1/responses` (OpenAI's Responses API).
    Responses,
    /// `POST /v1/messages` (Anthropic's Messages API, as vLLM serves it).
    Messages,
    /// `POST /tokenize` (vLLM's).
    Tokenize,
    /// `POST /detokenize` (vLLM's).
    Detokenize,
    /// `POST /generate`: SGLang's native API (`text` or `input_ids`, no
    /// model, no chat template), routed like a completion.
    Generate,
}

impl Endpoint {
    /// The path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Embeddings => "/v1/embeddings",
            Endpoint::Responses => "/v1/responses",
            Endpoint::Messages => "/v1/messages",
            Endpoint::Tokenize => "/tokenize",
            Endpoint::Detokenize => "/detokenize",
            Endpoint::Generate => "/generate",
        }
    }

    /// A label value for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "completions",
            Endpoint::Embeddings => "embeddings",
            Endpoint::Responses => "responses",
            Endpoint::Messages => "messages",
            Endpoint::Tokenize => "tokenize",
            Endpoint::Detokenize => "detokenize",
            Endpoint::Generate => "generate",
        }
    }

    /// Every endpoint.
    pub const ALL: [Endpoint; 8] = [
        Endpoint::Chat,
        Endpoint::Completions,
        Endpoint::Embeddings,
        Endpoint::Responses,
        Endpoint::Messages,
        Endpoint::Tokenize,
        Endpoint::Detokenize,
        Endpoint::Generate,
    ];

    /// Whether requests are routed on their prompt's cached prefix (chat and
    /// completions, whose token ids the router computes as the engine
    /// does); the others are routed on load alone, their bodies passed
    /// through for the engine to validate.
    pub fn cache_aware(self) -> bool {
        matches!(
            self,
            Endpoint::Chat | Endpoint::Completions | Endpoint::Generate
        )
    }

    /// The API whose prompt rules tokenize this one's: SGLang's `/generate`
    /// tokenizes its `text` as a completion prompt (the tokenizer's special
    /// tokens added, no chat template), and its `input_ids` are ids.
    #[must_use]
    pub fn tokenized_as(self) -> Endpoint {
        match self {
            Endpoint::Generate => Endpoint::Completions,
            other => other,
        }
    }
}

/// The fields of a completions or chat body that routing reads, borrowed
/// from the body bytes (which are forwarded as they came). Every other field
/// is skipped unparsed: it is the engine's to validate.
#[derive(Debug)]
pub struct Fields<'a> {
    /// `model`, when the body names one (vLLM and SGLang serve their one
    /// base model to a request without it).
    pub model: Option<Cow<'a, str>>,
    /// Byte range of `model`'s string token (quotes included) in the body,
    /// for rewriting an alias without re-encoding the body.
    pub model_span: Option<std::ops::Range<usize>>,
    /// `stream`.
    pub stream: bool,
    /// The fields that change the prompt's token ids, as sent: `messages`
    /// or `prompt`, `tools`, `documents`, `chat_template`,
    /// `chat_template_kwargs`, `reasoning_effort`, `add_generation_prompt`,
    /// `continue_final_message`, `add_special_tokens`,
    /// `truncate_prompt_tokens`.
    pub id_fields: Vec<(&'static str, &'a RawValue)>,
    /// `cache_salt`, which vLLM mixes into the first block's hash.
    pub cache_salt: Option<Cow<'a, str>>,
    /// Whether the body sets vLLM's `vllm_xargs` itself.
    pub has_vllm_xargs: bool,
    /// `session_id`, when a string (anything else is the engine's to
    /// refuse): the session the engines attribute the request's KV-cache
    /// stores to ([`crate::prepare::session`]).
    pub session_id: Option<Cow<'a, str>>,
    /// `previous_response_id` (Responses API), when a string: the response
    /// whose conversation this one continues, kept by one engine only.
    pub previous_response_id: Option<Cow<'a, str>>,
}

/// The body as serde reads it: every field routing may need, raw.
#[derive(serde::Deserialize)]
struct RawBody<'a> {
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    #[serde(borrow)]
    documents: Option<&'a RawValue>,
    #[serde(borrow)]
    chat_template: Option<&'a RawValue>,
    #[serde(borrow)]
    chat_template_kwargs: Option<&'a RawValue>,
    #[serde(borrow)]
    reasoning_effort: Option<&'a RawValue>,
    #[serde(borrow)]
    add_generation_prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    continue_final_message: Option<&'a RawValue>,
    #[serde(borrow)]
    add_special_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    truncate_prompt_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    cache_salt: Option<&'a RawValue>,
    #[serde(borrow)]
    vllm_xargs: Option<&'a RawValue>,
    #[serde(borrow)]
    session_id: Option<&'a RawValue>,
    #[serde(borrow)]
    previous_response_id: Option<&'a RawValue>,
    #[serde(borrow)]
    text: Option<&'a RawValue>,
    #[serde(borrow)]
    input_ids: Option<&'a RawValue>,
}

impl<'a> Fields<'a> {
    /// A field that changes the ids, as sent.
    pub fn id_field(&self, name: &str) -> Option<&'a RawValue> {
        self.id_fields
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
    }

    /// The id-relevant fields as a JSON object (what the tokenizer reads).
    ///
    /// # Errors
    /// Never for a body [`parse`] accepted (its fields are valid JSON).
    pub fn id_object(&self) -> Result<Value, serde_json::Error> {
        let mut m = Map::with_capacity(self.id_fields.len());
        for (name, raw) in &self.id_fields {
            m.insert((*name).to_owned(), serde_json::from_str(raw.get())?);
        }
        Ok(Value::Object(m))
    }

    /// The body with `model` replaced by `model` (an alias rewritten to the
    /// engines' name), everything else byte for byte as sent.
    pub fn with_model(&self, body: &[u8], model: &str) -> Bytes {
        rewrite_model(body, self.model_span.clone(), model)
    }
}

/// `body` (a JSON object without `vllm_xargs`) asking vLLM ≥ 0.26 to
/// re-report, as `BlockStored` events, the cached blocks the request reuses
/// (`vllm_xargs.kv_cache_report_mode: "full"`); everything else byte for
/// byte.
pub fn with_full_report_mode(body: &[u8]) -> Bytes {
    with_field(body, r#""vllm_xargs":{"kv_cache_report_mode":"full"}"#)
}

/// `body` (a JSON object) with `field` (`"name":value`) added as its last
/// member, everything else byte for byte. Last, so that it wins over a
/// member of the same name the parsers saw as absent (`"model":null`):
/// JSON parsers keep the last of duplicate names.
fn with_field(body: &[u8], field: &str) -> Bytes {
    let Some(close) = body.iter().rposition(|b| *b == b'}') else {
        return Bytes::copy_from_slice(body);
    };
    let inner = &body[..close];
    let empty = inner.iter().rev().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    let mut out = Vec::with_capacity(body.len() + field.len() + 1);
    out.extend_from_slice(inner);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(field.as_bytes());
    out.extend_from_slice(&body[close..]);
    Bytes::from(out)
}

/// `body` with the string token at `span` (the `model` value, quotes
/// included) replaced by `model`, everything else byte for byte; without a
/// span (the body names no model), `model` added as its first field.
pub fn rewrite_model(body: &[u8], span: Option<std::ops::Range<usize>>, model: &str) -> Bytes {
    let quoted = serde_json::to_string(model).unwrap_or_default();
    let Some(span) = span else {
        return with_field(body, &format!("\"model\":{quoted}"));
    };
    if span.end > body.len() {
        return Bytes::copy_from_slice(body);
    }
    let mut out = Vec::with_capacity(body.len() + quoted.len());
    out.extend_from_slice(&body[..span.start]);
    out.extend_from_slice(quoted.as_bytes());
    out.extend_from_slice(&body[span.end..]);
    Bytes::from(out)
}

fn type_error(message: &'static str, param: &'static str) -> ApiError {
    ApiError::invalid(message, Some(param))
}

/// Reads the fields routing needs from the body of a completions or chat
/// request, checking them. Nothing else is parsed into memory.
///
/// # Errors
/// A 400 for malformed JSON, a non-object body, a non-string `model`, a
/// non-boolean `stream`, missing `messages` (chat) or `prompt`
/// (completions).
pub fn parse(endpoint: Endpoint, bytes: &[u8]) -> Result<Fields<'_>, ApiError> {
    let not_json = |e: &serde_json::Error| {
        ApiError::invalid(format!("The request body is not valid JSON: {e}."), None)
    };
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(
            match serde_json::from_slice::<serde::de::IgnoredAny>(bytes) {
                Ok(_) => ApiError::invalid("The request body must be a JSON object.", None),
                Err(e) => not_json(&e),
            },
        );
    }
    let mut raw: RawBody<'_> = serde_json::from_slice(bytes).map_err(|e| {
        if e.classify() == serde_json::error::Category::Data {
            // The only data error an object can cause here.
            ApiError::invalid(format!("The request body has a {e}."), None)
        } else {
            not_json(&e)
        }
    })?;
    // Absent, null or empty: the engines' one base model (vLLM's
    // `_is_model_supported` accepts such a request), resolved by the caller.
    // (serde reads `null` as absent: no span then.)
    let (model, model_span) = match raw.model {
        None => (None, None),
        Some(model_raw) => {
            // The value's place in the body (the raw value borrows from it),
            // where a rewrite puts the name routed to.
            let start = model_raw.get().as_ptr() as usize - bytes.as_ptr() as usize;
            let span = start..start + model_raw.get().len();
            let model: Option<Cow<'_, str>> = serde_json::from_str(model_raw.get())
                .map_err(|_| type_error("`model` must be a string.", "model"))?;
            (model.filter(|m| !m.is_empty()), Some(span))
        }
    };
    let stream = match raw.stream.map(RawValue::get) {
        None | Some("null" | "false") => false,
        Some("true") => true,
        Some(_) => return Err(type_error("`stream` must be a boolean.", "stream")),
    };
    let first = |v: Option<&RawValue>| v.map(|r| r.get().as_bytes().first().copied());
    match endpoint {
        Endpoint::Chat => match first(raw.messages) {
            Some(Some(b'[')) => {
                if raw
                    .messages
                    .is_some_and(|m| m.get()[1..].trim_start().starts_with(']'))
                {
                    return Err(type_error("`messages` must not be empty.", "messages"));
                }
            }
            Some(_) => return Err(type_error("`messages` must be an array.", "messages")),
            None => return Err(type_error("`messages` is required.", "messages")),
        },
        Endpoint::Completions => match first(raw.prompt) {
            Some(Some(b'"' | b'[')) => {}
            Some(_) => {
                return Err(type_error(
                    "`prompt` must be a string, an array of strings, or token ids.",
                    "prompt",
                ));
            }
            None => return Err(type_error("`prompt` is required.", "prompt")),
        },
        // SGLang's prompt: `text` or `input_ids`, which the routing reads
        // as a completion's `prompt`.
        Endpoint::Generate => {
            let given = |v: Option<&RawValue>| v.is_some_and(|r| r.get() != "null");
            raw.prompt = match (given(raw.text), given(raw.input_ids)) {
                (true, false) => raw.text,
                (false, true) => raw.input_ids,
                (false, false) => {
                    return Err(type_error(
                        "Either text or input_ids should be provided.",
                        "text",
                    ));
                }
                (true, true) => {
                    return Err(type_error(
                        "Either text or input_ids should be provided, not both.",
                        "text",
                    ));
                }
            };
            if !matches!(first(raw.prompt), Some(Some(b'"' | b'['))) {
                return Err(type_error(
                    "`text` must be a string or a list of strings; `input_ids` a list of token ids.",
                    "text",
                ));
            }
        }
        // The engine validates the rest of these bodies.
        Endpoint::Embeddings
        | Endpoint::Responses
        | Endpoint::Messages
        | Endpoint::Tokenize
        | Endpoint::Detokenize => {}
    }
    let cache_salt = match raw.cache_salt {
        Some(r) if r.get() != "null" => Some(
            serde_json::from_str::<Cow<'_, str>>(r.get())
                .map_err(|_| type_error("`cache_salt` must be a string.", "cache_salt"))?,
        ),
        _ => None,
    };
    let id_fields = [
        ("messages", raw.messages),
        ("prompt", raw.prompt),
        ("tools", raw.tools),
        ("documents", raw.documents),
        ("chat_template", raw.chat_template),
        ("chat_template_kwargs", raw.chat_template_kwargs),
        ("reasoning_effort", raw.reasoning_effort),
        ("add_generation_prompt", raw.add_generation_prompt),
        ("continue_final_message", raw.continue_final_message),
        ("add_special_tokens", raw.add_special_tokens),
        ("truncate_prompt_tokens", raw.truncate_prompt_tokens),
    ]
    .into_iter()
    .filter_map(|(n, v)| v.map(|v| (n, v)))
    .collect();
    Ok(Fields {
        model,
        model_span,
        stream,
        id_fields,
        cache_salt,
        has_vllm_xargs: raw.vllm_xargs.is_some(),
        session_id: non_empty_string(raw.session_id),
        previous_response_id: non_empty_string(raw.previous_response_id),
    })
}

/// A raw value that is a non-empty string, unescaped.
fn non_empty_string(raw: Option<&RawValue>) -> Option<Cow<'_, str>> {
    raw.and_then(|r| serde_json::from_str::<Cow<'_, str>>(r.get()).ok())
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_and_bad_ones_say_why() {
        let p = parse(
            Endpoint::Chat,
            br#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
        )
        .unwrap();
        assert_eq!(p.model.as_deref(), Some("m"));
        assert!(p.stream);

        let cases: &[(Endpoint, &[u8], &str)] = &[
            (Endpoint::Chat, b"{", "not valid JSON"),
            (Endpoint::Chat, b"[]", "must be a JSON object"),
            (
                Endpoint::Chat,
                br#"{"model":3,"messages":[{}]}"#,
                "`model` must be a string",
            ),
            (
                Endpoint::Chat,
                br#"{"model":"m"}"#,
                "`messages` is required",
            ),
            (
                Endpoint::Chat,
                br#"{"model":"m","messages":[]}"#,
                "must not be empty",
            ),
            (
                Endpoint::Chat,
                br#"{"model":"m","messages":[{}],"stream":"yes"}"#,
                "`stream` must be a boolean",
            ),
            (
                Endpoint::Completions,
                br#"{"model":"m"}"#,
                "`prompt` is required",
            ),
            (
                Endpoint::Completions,
                br#"{"model":"m","prompt":{}}"#,
                "`prompt` must be",
            ),
            (Endpoint::Chat, b"\xff\xfe", "not valid JSON"),
        ];
        for (e, body, want) in cases {
            let err = parse(*e, body).unwrap_err();
            assert_eq!(err.status, StatusCode::BAD_REQUEST);
            assert!(
                err.message.contains(want),
                "{:?}: {}",
                String::from_utf8_lossy(body),
                err.message
            );
            let json: Value = serde_json::from_slice(&err.body()).unwrap();
            assert_eq!(json["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn sglang_generate_reads_text_or_input_ids_as_the_prompt() {
        let f = parse(Endpoint::Generate, br#"{"text":"hi there","stream":true}"#).unwrap();
        assert_eq!(
            f.id_field("prompt").map(RawValue::get),
            Some(r#""hi there""#)
        );
        assert!(f.stream && f.model.is_none());
        let f = parse(Endpoint::Generate, br#"{"input_ids":[1,2,3],"text":null}"#).unwrap();
        assert_eq!(f.id_field("prompt").map(RawValue::get), Some("[1,2,3]"));
        for bad in [
            &br#"{"sampling_params":{}}"#[..],
            br#"{"text":"a","input_ids":[1]}"#,
            br#"{"text":5}"#,
        ] {
            let e = parse(Endpoint::Generate, bad).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{e:?}");
        }
        assert_eq!(Endpoint::Generate.tokenized_as(), Endpoint::Completions);
        assert_eq!(Endpoint::Chat.tokenized_as(), Endpoint::Chat);
    }

    #[test]
    fn a_body_without_a_model_gets_the_one_it_is_routed_to() {
        for body in [
            &br#"{"messages":[{"role":"user","content":"hi"}]}"#[..],
            br#"{"model":null,"messages":[{"role":"user","content":"hi"}]}"#,
            br#"{"model":"","messages":[{"role":"user","content":"hi"}]}"#,
        ] {
            let f = parse(Endpoint::Chat, body).unwrap();
            assert_eq!(f.model, None, "{}", String::from_utf8_lossy(body));
            let out: Value = serde_json::from_slice(&f.with_model(body, "org/m")).unwrap();
            assert_eq!(out["model"], "org/m");
            assert_eq!(out["messages"][0]["content"], "hi");
        }
        assert_eq!(&with_field(b" { } ", r#""a":1"#)[..], br#" { "a":1} "#);
        assert_eq!(
            &with_field(b"{\"b\":2}\n", r#""a":1"#)[..],
            b"{\"b\":2,\"a\":1}\n"
        );
    }

    #[test]
    fn the_session_comes_from_the_header_or_the_body() {
        let body = br#"{"model":"m","prompt":"hi","session_id":"chat-\u0031"}"#;
        let f = parse(Endpoint::Completions, body).unwrap();
        assert_eq!(f.session_id.as_deref(), Some("chat-1"));
        let mut headers = http::HeaderMap::new();
        assert_eq!(
            crate::prepare::session(&headers, &f).as_deref(),
            Some("chat-1")
        );
        headers.insert(crate::prepare::SESSION_HEADER, "h-1".parse().unwrap());
        assert_eq!(
            crate::prepare::session(&headers, &f).as_deref(),
            Some("h-1")
        );
        // Not a string: the engine's to refuse; routing reads no session.
        for odd in [
            &br#"{"model":"m","prompt":"hi","session_id":7}"#[..],
            br#"{"model":"m","prompt":"hi","session_id":""}"#,
            br#"{"model":"m","prompt":"hi","session_id":null}"#,
        ] {
            let f = parse(Endpoint::Completions, odd).unwrap();
            assert_eq!(f.session_id, None);
            assert_eq!(crate::prepare::session(&http::HeaderMap::new(), &f), None);
        }
    }

    #[test]
    fn errors_have_openai_shape() {
        let e = ApiError::model_not_found("gpt-9");
        let json: Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(json["error"]["code"], "model_not_found");
        assert_eq!(json["error"]["param"], "model");
        assert!(json["error"]["message"].as_str().unwrap().contains("gpt-9"));
        assert_eq!(e.response().status(), StatusCode::NOT_FOUND);
    }
}
