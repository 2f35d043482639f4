//! OpenAI-shaped errors and the parts of a request the router reads.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::Full;
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
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param,
            code: None,
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
        }
    }

    /// 404 for an unknown path.
    pub fn not_found(path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!(
                "Unknown path {path}. This router serves POST /v1/chat/completions, POST /v1/completions and GET /v1/models."
            ),
            param: None,
            code: Some("not_found"),
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
}

impl Endpoint {
    /// The path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }

    /// A label value for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "completions",
        }
    }
}

/// A parsed request body: the object (key order kept) and the fields routing reads.
#[derive(Debug)]
pub struct Parsed {
    /// The whole body.
    pub body: Map<String, Value>,
    /// `model`.
    pub model: String,
    /// `stream`.
    pub stream: bool,
}

/// Reads the body of a completions or chat request, checking what routing
/// needs. Everything else is the engine's to validate.
///
/// # Errors
/// A 400 for malformed JSON, a non-object body, a missing or non-string
/// `model`, a non-boolean `stream`, missing `messages` (chat) or `prompt`
/// (completions).
pub fn parse(endpoint: Endpoint, bytes: &[u8]) -> Result<Parsed, ApiError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::invalid(format!("The request body is not valid JSON: {e}."), None)
    })?;
    let Value::Object(body) = value else {
        return Err(ApiError::invalid(
            "The request body must be a JSON object.",
            None,
        ));
    };
    let model = match body.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        Some(Value::String(_)) | None => {
            return Err(ApiError::invalid("`model` is required.", Some("model")));
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "`model` must be a string.",
                Some("model"),
            ));
        }
    };
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid(
                "`stream` must be a boolean.",
                Some("stream"),
            ));
        }
    };
    match endpoint {
        Endpoint::Chat => match body.get("messages") {
            Some(Value::Array(m)) if !m.is_empty() => {}
            Some(Value::Array(_)) => {
                return Err(ApiError::invalid(
                    "`messages` must not be empty.",
                    Some("messages"),
                ));
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    "`messages` must be an array.",
                    Some("messages"),
                ));
            }
            None => {
                return Err(ApiError::invalid(
                    "`messages` is required.",
                    Some("messages"),
                ));
            }
        },
        Endpoint::Completions => match body.get("prompt") {
            Some(Value::String(_) | Value::Array(_)) => {}
            Some(_) => {
                return Err(ApiError::invalid(
                    "`prompt` must be a string, an array of strings, or token ids.",
                    Some("prompt"),
                ));
            }
            None => return Err(ApiError::invalid("`prompt` is required.", Some("prompt"))),
        },
    }
    Ok(Parsed {
        body,
        model,
        stream,
    })
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
        assert_eq!(p.model, "m");
        assert!(p.stream);

        let cases: &[(Endpoint, &[u8], &str)] = &[
            (Endpoint::Chat, b"{", "not valid JSON"),
            (Endpoint::Chat, b"[]", "must be a JSON object"),
            (
                Endpoint::Chat,
                br#"{"messages":[{}]}"#,
                "`model` is required",
            ),
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
    fn errors_have_openai_shape() {
        let e = ApiError::model_not_found("gpt-9");
        let json: Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(json["error"]["code"], "model_not_found");
        assert_eq!(json["error"]["param"], "model");
        assert!(json["error"]["message"].as_str().unwrap().contains("gpt-9"));
        assert_eq!(e.response().status(), StatusCode::NOT_FOUND);
    }
}
