//! OpenAI request bodies, as far as token ids depend on them.
//!
//! Only the fields that change the ids are read; everything else in the
//! body (sampling parameters, `stream`, …) is ignored, as it is by the
//! tokenizer in vLLM.

use serde_json::{Map, Value};

use crate::error::Error;

/// The endpoint a body was sent to: it decides the defaults and the shapes
/// accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/completions`: `prompt` is a string, a list of strings, a
    /// list of token ids or a list of such lists; `add_special_tokens`
    /// defaults to true.
    Completions,
    /// `POST /v1/chat/completions`: `messages` rendered with the chat
    /// template, `add_generation_prompt` defaults to true and
    /// `add_special_tokens` to false.
    ChatCompletions,
    /// vLLM's `POST /tokenize`: the completion form (`prompt`, a single
    /// string) or the chat form (`messages`), told apart by which field is
    /// present; defaults as above. `reasoning_effort` is not a field of
    /// this endpoint and is ignored.
    Tokenize,
}

/// The two kinds of request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RequestKind {
    /// A completion prompt (or several).
    Completion,
    /// A chat conversation.
    Chat,
}

impl RequestKind {
    /// Detects the kind of an OpenAI body from its fields: `messages` means
    /// chat, `prompt` means completion.
    ///
    /// # Errors
    ///
    /// The body is not an object, or has neither field.
    pub fn detect(body: &Value) -> Result<Self, Error> {
        let obj = body
            .as_object()
            .ok_or_else(|| Error::invalid("the request body must be a JSON object"))?;
        if obj.contains_key("messages") {
            Ok(RequestKind::Chat)
        } else if obj.contains_key("prompt") {
            Ok(RequestKind::Completion)
        } else {
            Err(Error::invalid(
                "the request has neither `messages` (chat) nor `prompt` (completion)",
            ))
        }
    }
}

/// A request, parsed.
// One per HTTP request, moved rarely: boxing the chat variant buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Request {
    /// `/v1/completions` or the completion form of `/tokenize`.
    Completion(CompletionRequest),
    /// `/v1/chat/completions` or the chat form of `/tokenize`.
    Chat(ChatRequest),
}

impl Request {
    /// Parses a body sent to `endpoint`. For [`Endpoint::Tokenize`] the form
    /// is detected from the fields.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidRequest`] naming the field that is missing or has the
    /// wrong type.
    pub fn parse(endpoint: Endpoint, body: &Value) -> Result<Self, Error> {
        match endpoint {
            Endpoint::Completions => {
                CompletionRequest::parse(endpoint, body).map(Request::Completion)
            }
            Endpoint::ChatCompletions => ChatRequest::parse(endpoint, body).map(Request::Chat),
            Endpoint::Tokenize => match RequestKind::detect(body)? {
                RequestKind::Completion => {
                    CompletionRequest::parse(endpoint, body).map(Request::Completion)
                }
                RequestKind::Chat => ChatRequest::parse(endpoint, body).map(Request::Chat),
            },
        }
    }

    /// Parses an OpenAI body whose endpoint is not known, detecting
    /// `/v1/chat/completions` (`messages`) or `/v1/completions` (`prompt`).
    ///
    /// # Errors
    ///
    /// As [`Request::parse`], or [`RequestKind::detect`] fails.
    pub fn detect(body: &Value) -> Result<Self, Error> {
        match RequestKind::detect(body)? {
            RequestKind::Completion => Self::parse(Endpoint::Completions, body),
            RequestKind::Chat => Self::parse(Endpoint::ChatCompletions, body),
        }
    }
}

/// One completion prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Text to tokenize.
    Text(String),
    /// Token ids, passed through unchanged.
    TokenIds(Vec<u32>),
}

/// The id-relevant part of a `/v1/completions` body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompletionRequest {
    /// One entry per prompt; vLLM runs each as its own request.
    pub prompts: Vec<Prompt>,
    /// Let the tokenizer's post-processor add BOS/EOS (default true).
    pub add_special_tokens: bool,
    /// `truncate_prompt_tokens` when positive: keep only the last `k` ids.
    pub truncate_prompt_tokens: Option<usize>,
}

impl CompletionRequest {
    /// A single text prompt with vLLM's defaults.
    pub fn text(prompt: impl Into<String>) -> Self {
        CompletionRequest {
            prompts: vec![Prompt::Text(prompt.into())],
            add_special_tokens: true,
            truncate_prompt_tokens: None,
        }
    }

    /// Parses the completion form of a body sent to `endpoint`
    /// ([`Endpoint::Completions`] or [`Endpoint::Tokenize`], whose `prompt`
    /// must be one string).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidRequest`]: no `prompt`, an empty list, a list mixing
    /// shapes, ids that are not non-negative 32-bit integers, or a mistyped
    /// option.
    pub fn parse(endpoint: Endpoint, body: &Value) -> Result<Self, Error> {
        let obj = object(body)?;
        let prompt = obj
            .get("prompt")
            .filter(|p| !p.is_null())
            .ok_or_else(|| Error::invalid("`prompt` is required"))?;
        let prompts = if endpoint == Endpoint::Tokenize {
            let text = prompt
                .as_str()
                .ok_or_else(|| Error::invalid("`prompt` of /tokenize must be a string"))?;
            vec![Prompt::Text(text.to_owned())]
        } else {
            parse_prompts(prompt)?
        };
        Ok(CompletionRequest {
            prompts,
            add_special_tokens: bool_field(obj, "add_special_tokens", true)?,
            truncate_prompt_tokens: truncation(obj)?,
        })
    }
}

fn parse_prompts(prompt: &Value) -> Result<Vec<Prompt>, Error> {
    match prompt {
        Value::String(s) => Ok(vec![Prompt::Text(s.clone())]),
        Value::Array(items) => {
            let Some(first) = items.first() else {
                return Err(Error::invalid("`prompt` must not be an empty list"));
            };
            match first {
                Value::String(_) => items
                    .iter()
                    .map(|p| {
                        p.as_str()
                            .map(|s| Prompt::Text(s.to_owned()))
                            .ok_or_else(|| {
                                Error::invalid("`prompt` mixes strings and other values")
                            })
                    })
                    .collect(),
                Value::Number(_) => Ok(vec![Prompt::TokenIds(token_ids(items)?)]),
                Value::Array(_) => items
                    .iter()
                    .map(|p| match p {
                        Value::Array(ids) if !ids.is_empty() => {
                            Ok(Prompt::TokenIds(token_ids(ids)?))
                        }
                        Value::Array(_) => {
                            Err(Error::invalid("`prompt` holds an empty list of token ids"))
                        }
                        _ => Err(Error::invalid(
                            "`prompt` mixes lists of token ids and other values",
                        )),
                    })
                    .collect(),
                _ => Err(Error::invalid(
                    "`prompt` must be a string, a list of strings, a list of token ids or a list of lists of token ids",
                )),
            }
        }
        _ => Err(Error::invalid(
            "`prompt` must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        )),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, Error> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    Error::invalid(format!("`prompt` holds {v}, which is not a token id"))
                })
        })
        .collect()
}

/// The id-relevant part of a `/v1/chat/completions` body (or the chat form
/// of `/tokenize`). Messages and tools are kept as JSON: they are
/// normalised the way vLLM normalises them when rendered.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    /// `messages`, as sent.
    pub messages: Vec<Value>,
    /// `tools`, as sent (`None` when absent or null).
    pub tools: Option<Vec<Value>>,
    /// `documents` (RAG templates), when given.
    pub documents: Option<Value>,
    /// Open an assistant turn at the end (default true).
    pub add_generation_prompt: bool,
    /// Leave the final (assistant) message open for continuation (default
    /// false).
    pub continue_final_message: bool,
    /// Let the tokenizer's post-processor add BOS/EOS on top of the
    /// template (default false).
    pub add_special_tokens: bool,
    /// A template sent with the request, used only when the tokenizer
    /// trusts request templates.
    pub chat_template: Option<String>,
    /// `chat_template_kwargs`: extra template variables.
    pub chat_template_kwargs: Map<String, Value>,
    /// `reasoning_effort` (chat completions only); anything but null also
    /// sets `enable_thinking` unless the kwargs set it.
    pub reasoning_effort: Option<String>,
    /// `truncate_prompt_tokens` when positive: keep only the last `k` ids.
    pub truncate_prompt_tokens: Option<usize>,
}

impl ChatRequest {
    /// A conversation with vLLM's defaults.
    pub fn new(messages: Vec<Value>) -> Self {
        ChatRequest {
            messages,
            tools: None,
            documents: None,
            add_generation_prompt: true,
            continue_final_message: false,
            add_special_tokens: false,
            chat_template: None,
            chat_template_kwargs: Map::new(),
            reasoning_effort: None,
            truncate_prompt_tokens: None,
        }
    }

    /// Parses the chat form of a body sent to `endpoint`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidRequest`]: `messages` missing or not a list, a
    /// mistyped option, or both `add_generation_prompt` and
    /// `continue_final_message` set (vLLM's validation message).
    pub fn parse(endpoint: Endpoint, body: &Value) -> Result<Self, Error> {
        let obj = object(body)?;
        let messages = obj
            .get("messages")
            .and_then(Value::as_array)
            .ok_or_else(|| Error::invalid("`messages` must be a list"))?
            .clone();
        let tools = match obj.get("tools") {
            None | Some(Value::Null) => None,
            Some(Value::Array(tools)) => Some(tools.clone()),
            Some(_) => return Err(Error::invalid("`tools` must be a list")),
        };
        let documents = obj.get("documents").filter(|d| !d.is_null()).cloned();
        let chat_template = match obj.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(t)) => Some(t.clone()),
            Some(_) => return Err(Error::invalid("`chat_template` must be a string")),
        };
        let chat_template_kwargs = match obj.get("chat_template_kwargs") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(kwargs)) => kwargs.clone(),
            Some(_) => return Err(Error::invalid("`chat_template_kwargs` must be an object")),
        };
        let reasoning_effort = if endpoint == Endpoint::Tokenize {
            None
        } else {
            match obj.get("reasoning_effort") {
                None | Some(Value::Null) => None,
                Some(Value::String(effort)) => Some(effort.clone()),
                Some(_) => return Err(Error::invalid("`reasoning_effort` must be a string")),
            }
        };
        let request = ChatRequest {
            messages,
            tools,
            documents,
            add_generation_prompt: bool_field(obj, "add_generation_prompt", true)?,
            continue_final_message: bool_field(obj, "continue_final_message", false)?,
            add_special_tokens: bool_field(obj, "add_special_tokens", false)?,
            chat_template,
            chat_template_kwargs,
            reasoning_effort,
            truncate_prompt_tokens: truncation(obj)?,
        };
        if request.add_generation_prompt && request.continue_final_message {
            return Err(Error::invalid(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            ));
        }
        Ok(request)
    }
}

fn object(body: &Value) -> Result<&Map<String, Value>, Error> {
    body.as_object()
        .ok_or_else(|| Error::invalid("the request body must be a JSON object"))
}

fn bool_field(obj: &Map<String, Value>, name: &str, default: bool) -> Result<bool, Error> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(Error::invalid(format!("`{name}` must be a boolean"))),
    }
}

fn truncation(obj: &Map<String, Value>) -> Result<Option<usize>, Error> {
    match obj.get("truncate_prompt_tokens") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_i64() {
            Some(k) if k > 0 => Ok(usize::try_from(k).ok()),
            // -1 means "the model's context length", which only the engine
            // knows; 0 keeps everything, as vLLM does.
            Some(-1 | 0) => Ok(None),
            _ => Err(Error::invalid(
                "`truncate_prompt_tokens` must be an integer >= -1",
            )),
        },
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn detects_chat_and_completion() {
        assert!(matches!(
            Request::detect(&json!({"messages": []})),
            Ok(Request::Chat(_))
        ));
        assert!(matches!(
            Request::detect(&json!({"prompt": "x"})),
            Ok(Request::Completion(_))
        ));
        assert!(matches!(
            Request::detect(&json!({"model": "m"})),
            Err(Error::InvalidRequest(_))
        ));
        assert!(matches!(
            Request::detect(&json!([1])),
            Err(Error::InvalidRequest(_))
        ));
    }

    #[test]
    fn completion_prompt_shapes() {
        let parse = |body: Value| CompletionRequest::parse(Endpoint::Completions, &body);
        assert_eq!(
            parse(json!({"prompt": "a"})).unwrap(),
            CompletionRequest::text("a")
        );
        assert_eq!(
            parse(json!({"prompt": ["a", "b"], "add_special_tokens": false}))
                .unwrap()
                .prompts,
            vec![Prompt::Text("a".into()), Prompt::Text("b".into())]
        );
        assert_eq!(
            parse(json!({"prompt": [1, 2, 3]})).unwrap().prompts,
            vec![Prompt::TokenIds(vec![1, 2, 3])]
        );
        assert_eq!(
            parse(json!({"prompt": [[1], [2, 3]]})).unwrap().prompts,
            vec![Prompt::TokenIds(vec![1]), Prompt::TokenIds(vec![2, 3])]
        );
        for bad in [
            json!({"prompt": []}),
            json!({"prompt": ["a", 1]}),
            json!({"prompt": [1, -2]}),
            json!({"prompt": [1, 4_294_967_296_u64]}),
            json!({"prompt": [[1], "a"]}),
            json!({"prompt": [[]]}),
            json!({"prompt": 3}),
            json!({"prompt": null}),
            json!({"prompt": "a", "add_special_tokens": "yes"}),
            json!({"prompt": "a", "truncate_prompt_tokens": -2}),
        ] {
            assert!(
                matches!(parse(bad.clone()), Err(Error::InvalidRequest(_))),
                "{bad}"
            );
        }
        assert_eq!(
            parse(json!({"prompt": "a", "truncate_prompt_tokens": 5}))
                .unwrap()
                .truncate_prompt_tokens,
            Some(5)
        );
    }

    #[test]
    fn tokenize_endpoint_forms() {
        let completion = Request::parse(Endpoint::Tokenize, &json!({"prompt": "hi"})).unwrap();
        assert_eq!(
            completion,
            Request::Completion(CompletionRequest::text("hi"))
        );
        assert!(Request::parse(Endpoint::Tokenize, &json!({"prompt": [1, 2]})).is_err());
        let Request::Chat(chat) = Request::parse(
            Endpoint::Tokenize,
            &json!({"messages": [], "reasoning_effort": "low"}),
        )
        .unwrap() else {
            panic!("expected the chat form");
        };
        assert!(chat.add_generation_prompt);
        assert!(!chat.add_special_tokens);
        assert_eq!(chat.reasoning_effort, None);
    }

    #[test]
    fn chat_options() {
        let chat = ChatRequest::parse(
            Endpoint::ChatCompletions,
            &json!({
                "messages": [{"role": "user", "content": "x"}],
                "add_generation_prompt": false,
                "continue_final_message": true,
                "chat_template_kwargs": {"enable_thinking": false},
                "reasoning_effort": "low",
                "tools": null,
            }),
        )
        .unwrap();
        assert!(!chat.add_generation_prompt && chat.continue_final_message);
        assert_eq!(chat.reasoning_effort.as_deref(), Some("low"));
        assert_eq!(chat.tools, None);
        let both = ChatRequest::parse(
            Endpoint::ChatCompletions,
            &json!({"messages": [], "continue_final_message": true}),
        )
        .unwrap_err();
        assert_eq!(
            both.to_string(),
            "invalid request: Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        );
        assert!(ChatRequest::parse(Endpoint::ChatCompletions, &json!({"messages": {}})).is_err());
        assert!(
            ChatRequest::parse(
                Endpoint::ChatCompletions,
                &json!({"messages": [], "tools": {}})
            )
            .is_err()
        );
    }
}
