//! Chat rendering as vLLM does it: message normalisation, tool dumping,
//! template variables, then transformers' `apply_chat_template`.
//!
//! Stage 1 ([`RenderInputs::from_request`]) turns an OpenAI chat request into
//! what vLLM hands to `apply_chat_template`; stage 2
//! ([`ChatTemplate::render`]) renders it. Both stages are checked separately
//! against the `render` and `prompt` fields of the reference vectors.

use minijinja::Value;
use serde_json::{Map, Value as Json};

use crate::error::Error;
use crate::jinja::{self, ContentFormat};
use crate::request::ChatRequest;

/// transformers' `continue_final_message` marker.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// `apply_chat_template` parameters: a `chat_template_kwargs` entry with one
/// of these names is consumed by transformers instead of reaching the
/// template (`documents`, `add_generation_prompt` and
/// `continue_final_message` are handled explicitly).
const HF_PARAMS: &[&str] = &[
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "tools",
    "conversation",
    "chat_template",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
];

/// What vLLM passes to `apply_chat_template` for a chat request: the
/// normalised conversation, the tool schemas and the template variables.
#[derive(Clone, Debug, PartialEq)]
pub struct RenderInputs {
    /// The conversation after vLLM's normalisation.
    pub messages: Vec<Json>,
    /// `[tool.model_dump() for tool in tools]`, or `None` without tools.
    pub tools: Option<Vec<Json>>,
    /// `documents`, if any.
    pub documents: Option<Json>,
    /// Template variable `add_generation_prompt`.
    pub add_generation_prompt: bool,
    /// Post-processing flag (not a template variable).
    pub continue_final_message: bool,
    /// Extra template variables (from `chat_template_kwargs` and
    /// `reasoning_effort`), after transformers took its own parameters.
    pub template_kwargs: Map<String, Json>,
}

impl RenderInputs {
    /// Normalises a chat request the way vLLM does before rendering.
    ///
    /// * messages: string content stays; a list of text parts is joined
    ///   with `"\n"` (or kept as `{"type": "text", "text": …}` parts for
    ///   templates that iterate over content, [`ContentFormat::OpenAi`]);
    ///   `content: null` becomes `""`; `reasoning_content` becomes
    ///   `reasoning` and assistant messages carry both `reasoning` and
    ///   `reasoning_content`; tool messages keep `tool_call_id`; a string
    ///   `name` is kept; assistant tool-call `arguments` given as a JSON
    ///   string are parsed into an object (invalid JSON, non-objects, `""`
    ///   and `null` become `{}`); an empty `tool_calls` list is dropped.
    /// * tools: `{"type": "function", "function": {"name", "description",
    ///   "parameters"}}` with absent fields as `null`, `strict` and
    ///   `defer_loading` only when given, other keys dropped.
    /// * kwargs: `chat_template_kwargs`, then `documents`,
    ///   `reasoning_effort` (unless `"auto"`) and `enable_thinking =
    ///   reasoning_effort != "none"` (unless the kwargs set it);
    ///   transformers' own parameters are taken out.
    ///
    /// `format` must be resolved ([`ContentFormat::String`] or
    /// [`ContentFormat::OpenAi`]); [`ContentFormat::Auto`] is treated as
    /// string.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidRequest`] for malformed messages or tools,
    /// [`Error::UnsupportedContent`] for non-text content parts.
    pub fn from_request(request: &ChatRequest, format: ContentFormat) -> Result<Self, Error> {
        let messages = request
            .messages
            .iter()
            .map(|m| normalize_message(m, format))
            .collect::<Result<Vec<_>, _>>()?;
        let tools = request
            .tools
            .as_ref()
            .map(|tools| {
                tools
                    .iter()
                    .map(normalize_tool)
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()?;

        let mut merged = request.chat_template_kwargs.clone();
        let effort = request.reasoning_effort.as_deref();
        if let Some(documents) = &request.documents
            && documents.as_str() != Some("auto")
        {
            merged.insert("documents".into(), documents.clone());
        }
        if let Some(effort) = effort {
            if effort != "auto" {
                merged.insert("reasoning_effort".into(), Json::from(effort));
            }
            if !request.chat_template_kwargs.contains_key("enable_thinking") {
                merged.insert("enable_thinking".into(), Json::from(effort != "none"));
            }
        }
        let documents = merged.get("documents").filter(|d| !d.is_null()).cloned();
        let template_kwargs = merged
            .into_iter()
            .filter(|(k, _)| !HF_PARAMS.contains(&k.as_str()))
            .collect();
        Ok(RenderInputs {
            messages,
            tools,
            documents,
            add_generation_prompt: request.add_generation_prompt,
            continue_final_message: request.continue_final_message,
            template_kwargs,
        })
    }
}

fn normalize_message(src: &Json, format: ContentFormat) -> Result<Json, Error> {
    let msg = src
        .as_object()
        .ok_or_else(|| Error::invalid("each message must be an object"))?;
    let role = msg
        .get("role")
        .and_then(Json::as_str)
        .ok_or_else(|| Error::invalid("each message needs a string `role`"))?;
    let reasoning = msg
        .get("reasoning")
        .filter(|r| !r.is_null())
        .or_else(|| msg.get("reasoning_content").filter(|r| !r.is_null()));

    let mut texts: Vec<&str> = Vec::new();
    match msg.get("content") {
        None | Some(Json::Null) => {}
        Some(Json::String(s)) => texts.push(s),
        Some(Json::Array(parts)) => {
            for part in parts {
                if let Some(text) = text_of_part(part)? {
                    texts.push(text);
                }
            }
        }
        Some(_) => {
            return Err(Error::invalid(
                "message `content` must be a string, a list of parts or null",
            ));
        }
    }
    let content = if format == ContentFormat::OpenAi {
        Json::Array(
            texts
                .iter()
                .map(|t| {
                    let mut part = Map::new();
                    part.insert("type".into(), Json::from("text"));
                    part.insert("text".into(), Json::from(*t));
                    Json::Object(part)
                })
                .collect(),
        )
    } else {
        Json::from(texts.join("\n"))
    };

    let mut out = Map::new();
    out.insert("role".into(), Json::from(role));
    out.insert("content".into(), content);
    if role == "assistant" {
        match msg.get("tool_calls") {
            None | Some(Json::Null) => {}
            Some(Json::Array(calls)) => {
                if !calls.is_empty() {
                    let calls = calls
                        .iter()
                        .map(normalize_tool_call)
                        .collect::<Result<_, _>>()?;
                    out.insert("tool_calls".into(), Json::Array(calls));
                }
            }
            Some(_) => return Err(Error::invalid("`tool_calls` must be a list")),
        }
        if let Some(reasoning) = reasoning {
            out.insert("reasoning".into(), reasoning.clone());
            out.insert("reasoning_content".into(), reasoning.clone());
        }
    } else if role == "tool"
        && let Some(id) = msg.get("tool_call_id")
    {
        out.insert("tool_call_id".into(), id.clone());
    }
    if let Some(name @ Json::String(_)) = msg.get("name") {
        out.insert("name".into(), name.clone());
    }
    Ok(Json::Object(out))
}

/// The text of one content part; `None` for a text part whose text is null.
fn text_of_part(part: &Json) -> Result<Option<&str>, Error> {
    match part {
        Json::String(s) => Ok(Some(s)),
        Json::Object(p) => {
            let kind = p
                .get("type")
                .and_then(Json::as_str)
                .ok_or_else(|| Error::invalid("each content part needs a string `type`"))?;
            let field = match kind {
                "text" | "input_text" | "output_text" | "thinking" => "text",
                "refusal" => "refusal",
                other => return Err(Error::UnsupportedContent(other.to_owned())),
            };
            match p.get(field) {
                None | Some(Json::Null) => Ok(None),
                Some(Json::String(s)) => Ok(Some(s)),
                Some(_) => Err(Error::invalid(format!(
                    "content part `{field}` must be a string"
                ))),
            }
        }
        _ => Err(Error::invalid(
            "each content part must be an object or a string",
        )),
    }
}

fn normalize_tool_call(call: &Json) -> Result<Json, Error> {
    let mut call = call
        .as_object()
        .ok_or_else(|| Error::invalid("each tool call must be an object"))?
        .clone();
    let function = call
        .get_mut("function")
        .and_then(Json::as_object_mut)
        .ok_or_else(|| Error::invalid("each tool call needs a `function` object"))?;
    let arguments = match function.get("arguments") {
        Some(Json::Object(args)) if !args.is_empty() => Json::Object(args.clone()),
        Some(Json::String(s)) if !s.is_empty() => match serde_json::from_str::<Json>(s) {
            Ok(parsed @ Json::Object(_)) => parsed,
            _ => Json::Object(Map::new()),
        },
        _ => Json::Object(Map::new()),
    };
    function.insert("arguments".into(), arguments);
    Ok(Json::Object(call))
}

fn normalize_tool(tool: &Json) -> Result<Json, Error> {
    let tool = tool
        .as_object()
        .ok_or_else(|| Error::invalid("each tool must be an object"))?;
    match tool.get("type") {
        None | Some(Json::Null) => {}
        Some(Json::String(t)) if t == "function" => {}
        Some(other) => {
            return Err(Error::invalid(format!(
                "tool `type` must be \"function\", not {other}"
            )));
        }
    }
    let function = tool
        .get("function")
        .and_then(Json::as_object)
        .ok_or_else(|| Error::invalid("each tool needs a `function` object"))?;
    let name = function
        .get("name")
        .filter(|n| n.is_string())
        .ok_or_else(|| Error::invalid("each tool function needs a string `name`"))?;
    let description = function.get("description").cloned().unwrap_or(Json::Null);
    if !(description.is_null() || description.is_string()) {
        return Err(Error::invalid("tool `description` must be a string"));
    }
    let parameters = function.get("parameters").cloned().unwrap_or(Json::Null);
    if !(parameters.is_null() || parameters.is_object()) {
        return Err(Error::invalid("tool `parameters` must be an object"));
    }
    let mut fd = Map::new();
    fd.insert("name".into(), name.clone());
    fd.insert("description".into(), description);
    fd.insert("parameters".into(), parameters);
    for key in ["strict", "defer_loading"] {
        match function.get(key) {
            None | Some(Json::Null) => {}
            Some(v @ Json::Bool(_)) => {
                fd.insert(key.into(), v.clone());
            }
            Some(_) => return Err(Error::invalid(format!("tool `{key}` must be a boolean"))),
        }
    }
    let mut out = Map::new();
    out.insert("type".into(), Json::from("function"));
    out.insert("function".into(), Json::Object(fd));
    Ok(Json::Object(out))
}

/// A compiled chat template.
#[derive(Debug)]
pub(crate) struct ChatTemplate {
    env: minijinja::Environment<'static>,
    format: ContentFormat,
}

impl ChatTemplate {
    /// Compiles `source`; `format` [`ContentFormat::Auto`] is resolved from
    /// the source.
    pub(crate) fn compile(source: &str, format: ContentFormat) -> Result<Self, minijinja::Error> {
        let format = match format {
            ContentFormat::Auto => jinja::detect_content_format(source),
            other => other,
        };
        Ok(ChatTemplate {
            env: jinja::environment(source)?,
            format,
        })
    }

    /// The content format messages are normalised to for this template.
    pub(crate) fn content_format(&self) -> ContentFormat {
        self.format
    }

    /// Renders `inputs` with `globals` (the tokenizer's special tokens map)
    /// as transformers does, including the `continue_final_message` cut.
    pub(crate) fn render(
        &self,
        globals: &[(String, Value)],
        inputs: &RenderInputs,
    ) -> Result<String, Error> {
        let template = self
            .env
            .get_template(jinja::TEMPLATE_NAME)
            .map_err(|e| Error::Template(e.to_string()))?;

        let mut messages: Vec<Value> = inputs.messages.iter().map(jinja::json_to_value).collect();
        // The text `continue_final_message` must find again in the output.
        let mut final_text: Option<String> = None;
        if inputs.continue_final_message {
            let last = inputs.messages.last().ok_or_else(|| {
                Error::Template("continue_final_message is set but there are no messages".into())
            })?;
            let (text, tagged) = tag_final_message(last)?;
            final_text = Some(text);
            if let Some(slot) = messages.last_mut() {
                *slot = jinja::json_to_value(&tagged);
            }
        }

        let mut ctx: Vec<(String, Value)> =
            Vec::with_capacity(globals.len() + inputs.template_kwargs.len() + 4);
        ctx.extend(globals.iter().cloned());
        ctx.extend(
            inputs
                .template_kwargs
                .iter()
                .map(|(k, v)| (k.clone(), jinja::json_to_value(v))),
        );
        ctx.push(("messages".into(), Value::from(messages)));
        ctx.push((
            "tools".into(),
            inputs.tools.as_ref().map_or(Value::from(()), |t| {
                t.iter().map(jinja::json_to_value).collect()
            }),
        ));
        ctx.push((
            "documents".into(),
            inputs
                .documents
                .as_ref()
                .map_or(Value::from(()), jinja::json_to_value),
        ));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(inputs.add_generation_prompt),
        ));

        let rendered = template.render(Value::from_pairs(ctx)).map_err(|e| {
            match jinja::raised_message(&e) {
                Some(message) => Error::TemplateRaised(message),
                None => Error::Template(format!("{e:#}")),
            }
        })?;

        match final_text {
            None => Ok(rendered),
            Some(text) => cut_at_continue_tag(rendered, &text),
        }
    }
}

/// Appends the continuation tag to the final message's text (its string
/// content, or the last content part with a `text`). Returns the text
/// before tagging and the tagged message.
fn tag_final_message(message: &Json) -> Result<(String, Json), Error> {
    let mut tagged = message.clone();
    let content = tagged.get_mut("content").ok_or_else(|| {
        Error::Template(
            "continue_final_message is set but the final message has no \"content\" to continue!"
                .into(),
        )
    })?;
    match content {
        Json::String(s) => {
            let text = s.clone();
            s.push_str(CONTINUE_TAG);
            Ok((text, tagged))
        }
        Json::Array(parts) => {
            for part in parts.iter_mut().rev() {
                if let Some(Json::String(s)) = part.get_mut("text") {
                    let text = s.clone();
                    s.push_str(CONTINUE_TAG);
                    return Ok((text, tagged));
                }
            }
            Err(Error::Template(
                "continue_final_message is set but we could not find any text to continue in the final message!"
                    .into(),
            ))
        }
        _ => Err(Error::Template(
            "continue_final_message is set but the final message has no \"content\" to continue!"
                .into(),
        )),
    }
}

/// transformers' cut: keep the output up to the last tag; if the tag's
/// trailing space did not survive the template, also strip trailing
/// whitespace.
fn cut_at_continue_tag(rendered: String, final_text: &str) -> Result<String, Error> {
    let bare_tag = CONTINUE_TAG.trim_end();
    let final_stripped = py_strip(final_text);
    if !rendered.contains(final_stripped) || !rendered.contains(bare_tag) {
        return Err(Error::Template(format!(
            "continue_final_message is set but the final message does not appear in the chat after applying the chat template! This can happen if the chat template deletes portions of the final message. Please verify the chat template and final message in your chat to ensure they are compatible.Final message to continue: {final_stripped}\nRendered chat:\n{rendered}"
        )));
    }
    let at = rendered.rfind(bare_tag).unwrap_or(rendered.len());
    let mut out = rendered;
    if out[at..].starts_with(CONTINUE_TAG) {
        out.truncate(at);
    } else {
        out.truncate(at);
        let keep = py_rstrip(&out).len();
        out.truncate(keep);
    }
    Ok(out)
}

/// Python's `str.isspace` for one character.
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

fn py_strip(s: &str) -> &str {
    s.trim_matches(py_isspace)
}

fn py_rstrip(s: &str) -> &str {
    s.trim_end_matches(py_isspace)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::request::Endpoint;

    #[allow(clippy::needless_pass_by_value)] // test helper over `json!` literals
    fn inputs(body: Json) -> Result<RenderInputs, Error> {
        RenderInputs::from_request(
            &ChatRequest::parse(Endpoint::ChatCompletions, &body)?,
            ContentFormat::String,
        )
    }

    #[test]
    fn normalises_content_and_reasoning() {
        let got = inputs(json!({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "text", "text": null}, {"type": "refusal", "refusal": "c"}], "tool_call_id": "x"},
            {"role": "assistant", "content": null, "reasoning_content": "think", "tool_calls": [], "name": "bot"},
            {"role": "tool", "tool_call_id": null, "content": "r", "name": 7},
        ]}))
        .unwrap();
        assert_eq!(
            Json::Array(got.messages),
            json!([
                {"role": "user", "content": "a\nb\nc"},
                {"role": "assistant", "content": "", "reasoning": "think", "reasoning_content": "think", "name": "bot"},
                {"role": "tool", "content": "r", "tool_call_id": null},
            ])
        );
    }

    #[test]
    fn openai_format_keeps_parts() {
        let request = ChatRequest::parse(
            Endpoint::ChatCompletions,
            &json!({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": null}]}),
        )
        .unwrap();
        let got = RenderInputs::from_request(&request, ContentFormat::OpenAi).unwrap();
        assert_eq!(
            Json::Array(got.messages),
            json!([{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "user", "content": []}])
        );
    }

    #[test]
    fn tool_call_arguments_become_objects() {
        let got = inputs(json!({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "1", "function": {"arguments": "{\"b\": 2, \"a\": 1.0}", "name": "f"}},
            {"id": "2", "function": {"name": "f", "arguments": "[1]"}},
            {"id": "3", "function": {"name": "f", "arguments": "not json"}},
            {"id": "4", "function": {"name": "f", "arguments": ""}},
            {"id": "5", "function": {"name": "f"}},
            {"id": "6", "function": {"name": "f", "arguments": {"k": 1}}},
            {"id": "7", "function": {"name": "f", "arguments": 3}},
        ]}]}))
        .unwrap();
        let calls = &got.messages[0]["tool_calls"];
        assert_eq!(
            calls[0]["function"],
            json!({"arguments": {"b": 2, "a": 1.0}, "name": "f"})
        );
        for i in 1..5 {
            assert_eq!(calls[i]["function"]["arguments"], json!({}), "call {i}");
        }
        assert_eq!(calls[5]["function"]["arguments"], json!({"k": 1}));
        assert_eq!(calls[6]["function"]["arguments"], json!({}));
        let keys: Vec<&String> = calls[4]["function"].as_object().unwrap().keys().collect();
        assert_eq!(keys, ["name", "arguments"]);
    }

    #[test]
    fn tools_are_model_dumped() {
        let got = inputs(json!({"messages": [], "tools": [
            {"function": {"name": "f", "extra": 1}},
            {"type": "function", "function": {"parameters": {}, "name": "g", "strict": true, "description": "d"}},
        ]}))
        .unwrap();
        assert_eq!(
            Json::Array(got.tools.unwrap()),
            json!([
                {"type": "function", "function": {"name": "f", "description": null, "parameters": null}},
                {"type": "function", "function": {"name": "g", "description": "d", "parameters": {}, "strict": true}},
            ])
        );
        for bad in [
            json!({"messages": [], "tools": [{"type": "custom", "function": {"name": "f"}}]}),
            json!({"messages": [], "tools": [{"function": {}}]}),
            json!({"messages": [], "tools": [{"function": {"name": "f", "parameters": "x"}}]}),
            json!({"messages": [{"content": "x"}]}),
            json!({"messages": ["x"]}),
            json!({"messages": [{"role": "user", "content": {"a": 1}}]}),
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": 1}]}]}),
        ] {
            assert!(
                matches!(inputs(bad.clone()), Err(Error::InvalidRequest(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            inputs(json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})),
            Err(Error::UnsupportedContent(t)) if t == "image_url"
        ));
    }

    #[test]
    fn kwargs_and_reasoning_effort() {
        let got = inputs(json!({
            "messages": [],
            "chat_template_kwargs": {"custom": 1, "tokenize": true, "padding": true, "add_generation_prompt": false},
            "reasoning_effort": "none",
        }))
        .unwrap();
        assert!(got.add_generation_prompt);
        assert_eq!(
            Json::Object(got.template_kwargs),
            json!({"custom": 1, "reasoning_effort": "none", "enable_thinking": false})
        );
        let got = inputs(json!({
            "messages": [],
            "chat_template_kwargs": {"enable_thinking": false},
            "reasoning_effort": "auto",
            "documents": [{"title": "t", "text": "x"}],
        }))
        .unwrap();
        assert_eq!(
            Json::Object(got.template_kwargs),
            json!({"enable_thinking": false})
        );
        assert_eq!(got.documents, Some(json!([{"title": "t", "text": "x"}])));
    }

    #[allow(clippy::needless_pass_by_value)] // test helper over `json!` literals
    fn render(template: &str, body: Json) -> Result<String, Error> {
        let t = ChatTemplate::compile(template, ContentFormat::Auto).unwrap();
        let inputs = RenderInputs::from_request(
            &ChatRequest::parse(Endpoint::ChatCompletions, &body)?,
            t.content_format(),
        )?;
        t.render(&[("bos_token".into(), Value::from("<s>"))], &inputs)
    }

    #[test]
    fn continue_final_message_cuts_like_transformers() {
        let t = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}</end>\n{% endfor %}";
        let body = json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b  "}],
                          "add_generation_prompt": false, "continue_final_message": true});
        assert_eq!(render(t, body).unwrap(), "<s>[user]a</end>\n[assistant]b  ");
        // A template that strips content loses the tag's space: the cut is rstripped.
        let t = "{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}</end>{% endfor %}";
        let body = json!({"messages": [{"role": "assistant", "content": "b  "}],
                          "add_generation_prompt": false, "continue_final_message": true});
        assert_eq!(render(t, body).unwrap(), "[assistant]b");
        // A template that drops the final message entirely.
        let t = "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}";
        let body = json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                          "add_generation_prompt": false, "continue_final_message": true});
        assert!(matches!(render(t, body), Err(Error::Template(_))));
    }

    #[test]
    fn template_sees_special_tokens_kwargs_and_defaults() {
        let t = "{{ bos_token }}|{{ tools }}|{{ documents }}|{{ add_generation_prompt }}|{{ flavour }}|{{ messages | length }}";
        assert_eq!(
            render(t, json!({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"flavour": "mint", "bos_token": "B"}})).unwrap(),
            "B|None|None|True|mint|1"
        );
    }
}
