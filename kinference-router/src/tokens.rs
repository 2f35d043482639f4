//! Token ids for routing, per the worker set's tokenization mode, and the
//! tokenizer self-check.
//!
//! - `local`: the worker set's tokenizer, in-process, on the blocking pool
//!   under a timeout.
//! - `engine`: the engine's own `POST /tokenize` (one round trip).
//! - `approximate`: no ids; the caller keys the prompt text instead.
//!
//! A failure or timeout is not an error for the client: the request is routed
//! on load alone and the miss is counted.
//!
//! **Self-check.** A local tokenizer that gives different ids than the
//! engine would route every request on wrong keys, silently. So when a
//! worker set's local tokenizer is loaded and it has an endpoint, a few canary
//! requests (plain text, a chat, a chat with tools) are tokenized both ways;
//! any difference switches the worker set to `engine` tokenization, logs the
//! first differing position, and shows up in `/debug/endpoints` and the
//! `kinference_router_tokenizer_mismatch` metric.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kinference_api::v1alpha1::TokenizationMode;
use kinference_tokenize::{Endpoint as TokEndpoint, ModelTokenizer};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::endpoint::Endpoint;
use crate::metrics::TokenizeLabels;
use crate::openai::{self, Fields};
use crate::runtime::{TokenizerState, WsRuntime};
use crate::state::Shared;

/// How a request's ids were obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// In-process tokenizer.
    Local,
    /// The engine's `/tokenize`.
    Engine,
    /// No ids, by design: the prompt's text keys against the router's
    /// record of the prompts it sent (`approximate` mode, or an engine that
    /// cannot tokenize this API: SGLang's chat).
    Approximate,
    /// Not available: route on load.
    None,
}

impl Source {
    /// Label for records.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Local => "local",
            Source::Engine => "engine",
            Source::Approximate => "approximate",
            Source::None => "none",
        }
    }
}

fn tok_endpoint(api: openai::Endpoint) -> TokEndpoint {
    match api {
        openai::Endpoint::Chat => TokEndpoint::ChatCompletions,
        // Only chat and completions are tokenized ([`openai::Endpoint::cache_aware`]).
        _ => TokEndpoint::Completions,
    }
}

/// The ids of a request's (first) prompt for a worker set, or `None` when
/// they cannot be had in time. A local tokenization of a body of at most
/// `Config::tokenize_inline_bytes` runs in place; larger ones go to the
/// blocking pool under the timeout. `ask` is the endpoint to ask in
/// `engine` mode; `model` the name it serves.
pub async fn ids(
    shared: &Shared,
    rt: &WsRuntime,
    api: openai::Endpoint,
    fields: &Fields<'_>,
    body_len: usize,
    ask: Option<&Arc<Endpoint>>,
    model: &str,
) -> (Option<Vec<u32>>, Source) {
    let started = Instant::now();
    let timeout = shared.config.tokenize_timeout;
    let (mode, result) = match rt.effective_mode() {
        TokenizationMode::Local => {
            let tokenizer = rt.tokenizer.read().clone();
            let Some(t) = tokenizer else {
                observe(shared, "local", "unavailable", started);
                return (None, Source::None);
            };
            let Ok(body) = fields.id_object() else {
                observe(shared, "local", "error", started);
                return (None, Source::None);
            };
            let r = if body_len <= shared.config.tokenize_inline_bytes {
                // Small prompts cost microseconds (less with the prefix
                // cache warm): a hop to the blocking pool would cost more.
                t.tokenize(tok_endpoint(api), &body)
                    .map(|t| t.token_ids.into_iter().next().unwrap_or_default())
                    .map_err(|_| "error")
            } else {
                let call =
                    tokio::task::spawn_blocking(move || t.tokenize(tok_endpoint(api), &body));
                match tokio::time::timeout(timeout, call).await {
                    Err(_) => Err("timeout"),
                    Ok(Err(_) | Ok(Err(_))) => Err("error"),
                    Ok(Ok(Ok(t))) => Ok(t.token_ids.into_iter().next().unwrap_or_default()),
                }
            };
            ("local", r.map(|ids| (ids, Source::Local)))
        }
        TokenizationMode::Engine => {
            if let Some(ids) = ids_in_prompt(fields) {
                // Token ids sent as the prompt are the ids: no call needed.
                return (Some(ids), Source::Engine);
            }
            let Some(e) = ask else {
                observe(shared, "engine", "unavailable", started);
                return (None, Source::None);
            };
            // SGLang tokenizes prompts at /v1/tokenize and has no chat form:
            // its chat is routed on the prompt's text, as SGLang's own router
            // does.
            let sglang = e.family() == kinference_api::engine::EngineFamily::Sglang;
            if sglang && api == openai::Endpoint::Chat {
                observe(shared, "engine", "unsupported", started);
                return (None, Source::Approximate);
            }
            let Some(req) = tokenize_body(api, fields, model) else {
                observe(shared, "engine", "error", started);
                return (None, Source::None);
            };
            let path = if sglang { "/v1/tokenize" } else { "/tokenize" };
            let r = match tokio::time::timeout(
                timeout,
                post_tokenize(shared, &e.authority, path, Bytes::from(req)),
            )
            .await
            {
                // Not a probe failure: a busy engine tokenizes slowly, and
                // taking busy engines out would pile their load on the rest.
                Err(_) => Err("timeout"),
                Ok(Err(err)) => {
                    // The error never carries the engine's answer: it may
                    // quote the prompt.
                    tracing::debug!(endpoint = %e.authority, error = %err.message, "engine /tokenize failed");
                    if !err.reached() {
                        e.record_probe(err.outcome, Instant::now());
                    }
                    Err("error")
                }
                Ok(Ok(ids)) => Ok(ids),
            };
            ("engine", r.map(|ids| (ids, Source::Engine)))
        }
        TokenizationMode::Approximate => return (None, Source::Approximate),
    };
    match result {
        Ok((ids, source)) => {
            observe(shared, mode, "ok", started);
            (Some(ids), source)
        }
        Err(outcome) => {
            observe(shared, mode, outcome, started);
            (None, Source::None)
        }
    }
}

fn observe(shared: &Shared, mode: &'static str, outcome: &'static str, started: Instant) {
    shared
        .metrics
        .tokenize_duration
        .get_or_create(&TokenizeLabels { mode, outcome })
        .observe(started.elapsed().as_secs_f64());
}

/// The body vLLM's `/tokenize` takes for a chat or completions request,
/// naming `model`: the fields that change the ids, copied as sent (raw
/// JSON, never re-encoded). `None` when there is nothing to tokenize (a
/// prompt of token ids, or a list whose first prompt is not text).
pub fn tokenize_body(api: openai::Endpoint, fields: &Fields<'_>, model: &str) -> Option<Vec<u8>> {
    let mut out: Vec<u8> = Vec::with_capacity(256);
    out.extend_from_slice(b"{\"model\":");
    out.extend_from_slice(serde_json::to_string(model).ok()?.as_bytes());
    let mut field = |name: &str, raw: &str| {
        out.push(b',');
        out.push(b'"');
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b"\":");
        out.extend_from_slice(raw.as_bytes());
    };
    match api {
        openai::Endpoint::Chat => {
            let mut kwargs: Option<String> = None;
            for (name, raw) in &fields.id_fields {
                match *name {
                    "messages"
                    | "tools"
                    | "add_generation_prompt"
                    | "continue_final_message"
                    | "add_special_tokens"
                    | "chat_template"
                    | "documents" => {
                        field(name, raw.get());
                    }
                    "chat_template_kwargs" => kwargs = Some(raw.get().to_owned()),
                    _ => {}
                }
            }
            // vLLM passes reasoning_effort to the template as a kwarg.
            if let Some(effort) = fields.id_field("reasoning_effort") {
                let mut kw = kwargs
                    .as_deref()
                    .and_then(|k| serde_json::from_str::<serde_json::Map<String, Value>>(k).ok())
                    .unwrap_or_default();
                if let Ok(v) = serde_json::from_str::<Value>(effort.get()) {
                    kw.entry("reasoning_effort").or_insert(v);
                }
                kwargs = serde_json::to_string(&kw).ok();
            }
            if let Some(k) = kwargs {
                field("chat_template_kwargs", &k);
            }
        }
        openai::Endpoint::Completions => {
            let prompt = fields.id_field("prompt")?;
            let first = match serde_json::from_str::<Value>(prompt.get()).ok()? {
                Value::String(s) => Value::String(s),
                // Token ids are already ids: no call needed (see `ids_in_prompt`).
                Value::Array(a) => match a.into_iter().next()? {
                    Value::String(s) => Value::String(s),
                    _ => return None,
                },
                _ => return None,
            };
            field("prompt", &serde_json::to_string(&first).ok()?);
            if let Some(a) = fields.id_field("add_special_tokens") {
                field("add_special_tokens", a.get());
            }
        }
        _ => return None,
    }
    out.push(b'}');
    Some(out)
}

/// Token ids given directly as a completions prompt (`prompt` as ids, or a
/// list whose first prompt is ids).
pub fn ids_in_prompt(fields: &Fields<'_>) -> Option<Vec<u32>> {
    let prompt = fields.id_field("prompt")?;
    if !prompt.get().starts_with('[') {
        return None;
    }
    ids_in_body(&serde_json::json!({"prompt": serde_json::from_str::<Value>(prompt.get()).ok()?}))
}

/// Token ids given directly in a completions body (`prompt` as ids, or a
/// list whose first prompt is ids).
pub fn ids_in_body(body: &Value) -> Option<Vec<u32>> {
    let p = body.get("prompt")?.as_array()?;
    let ids = match p.first()? {
        Value::Array(inner) => inner,
        Value::Number(_) => p,
        _ => return None,
    };
    ids.iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

#[derive(serde::Deserialize)]
struct TokenizeAnswer {
    tokens: Vec<u32>,
}

/// Asks `/tokenize`. Errors say whether the engine answered; they never
/// quote its answer (it may quote the request).
async fn post_tokenize(
    shared: &Shared,
    authority: &str,
    path: &str,
    bytes: Bytes,
) -> Result<Vec<u32>, crate::probe::ProbeError> {
    let fail = |reached: bool, message: String| crate::probe::ProbeError {
        outcome: if reached {
            crate::endpoint::Outcome::Success
        } else {
            crate::endpoint::Outcome::ConnectFailure
        },
        message,
    };
    let mut http = http::Request::post(format!("http://{authority}{path}"))
        .header(http::header::CONTENT_TYPE, "application/json");
    if let Some(a) = &shared.config.security.engine_auth {
        http = http.header(http::header::AUTHORIZATION, a.clone());
    }
    let http = http
        .body(Full::new(bytes))
        .map_err(|e| fail(false, e.to_string()))?;
    let resp = shared
        .runtime
        .upstream
        .request(http)
        .await
        .map_err(|e| fail(false, format!("POST {path}: {e}")))?;
    let status = resp.status();
    let body = http_body_util::Limited::new(resp.into_body(), 64 << 20)
        .collect()
        .await
        .map_err(|e| fail(false, format!("POST {path}: reading the answer: {e}")))?
        .to_bytes();
    if !status.is_success() {
        return Err(fail(true, format!("POST {path}: HTTP {status}")));
    }
    let t: TokenizeAnswer =
        serde_json::from_slice(&body).map_err(|e| fail(true, format!("/tokenize answer: {e}")))?;
    Ok(t.tokens)
}

/// Canary requests: plain text, a multi-turn chat, and a chat with tools.
pub fn canaries(model: &str) -> Vec<(openai::Endpoint, Value)> {
    vec![
        (
            openai::Endpoint::Completions,
            json!({"model": model, "prompt": "kinference tokenizer check: Hello, world! 123 déjà vu"}),
        ),
        (
            openai::Endpoint::Chat,
            json!({"model": model, "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"}
            ]}),
        ),
        (
            openai::Endpoint::Chat,
            json!({"model": model, "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
                "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}),
        ),
    ]
}

/// Compares a local tokenizer with an engine on the canaries. `Ok(None)`:
/// they agree; `Ok(Some(why))`: they differ; `Err`: could not ask.
pub async fn self_check(
    shared: &Shared,
    t: &Arc<ModelTokenizer>,
    authority: &str,
    model: &str,
) -> Result<Option<String>, String> {
    for (i, (api, body)) in canaries(model).into_iter().enumerate() {
        let local = {
            let (t, b) = (t.clone(), body.clone());
            tokio::task::spawn_blocking(move || t.tokenize(tok_endpoint(api), &b))
                .await
                .map_err(|e| e.to_string())?
        };
        let bytes = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
        let fields = openai::parse(api, &bytes).map_err(|e| e.message)?;
        let req = tokenize_body(api, &fields, model).ok_or("canary has no prompt")?;
        let remote = post_tokenize(shared, authority, "/tokenize", Bytes::from(req))
            .await
            .map_err(|e| e.message)?;
        let local = match local {
            Ok(t) => t.token_ids.into_iter().next().unwrap_or_default(),
            // A template that cannot render tools is not a mismatch by
            // itself; the engine must have failed the same way.
            Err(e) => {
                return Ok(Some(format!(
                    "canary {i}: the local tokenizer failed ({e}) where the engine did not"
                )));
            }
        };
        if local != remote {
            let at = local
                .iter()
                .zip(&remote)
                .position(|(a, b)| a != b)
                .unwrap_or(local.len().min(remote.len()));
            return Ok(Some(format!(
                "canary {i}: local ids differ from the engine's /tokenize at position {at} (local {} ids, engine {})",
                local.len(),
                remote.len()
            )));
        }
    }
    Ok(None)
}

/// Starts the self-check of every worker set whose local tokenizer is loaded
/// but not yet compared with its engines.
pub fn spawn_self_checks(shared: &Arc<Shared>) {
    let view = shared.view();
    for ws in &view.worker_sets {
        let rt = &ws.runtime;
        if !matches!(*rt.tokenizer_state.read(), TokenizerState::Unchecked) {
            continue;
        }
        let Some(t) = rt.tokenizer.read().clone() else {
            continue;
        };
        let Some(e) = ws.endpoints.first().cloned() else {
            continue;
        };
        let model = ws
            .route
            .models
            .first()
            .map(|m| m.name.clone())
            .or_else(|| e.models().first().map(|m| m.id.clone()));
        let Some(model) = model else { continue };
        let (shared, rt, name) = (shared.clone(), rt.clone(), ws.route.name.clone());
        // Mark it so a rebuild does not start a second check.
        *rt.tokenizer_state.write() = TokenizerState::Checking;
        tokio::spawn(async move {
            let r = tokio::time::timeout(
                Duration::from_secs(10),
                self_check(&shared, &t, &e.authority, &model),
            )
            .await;
            let state = match r {
                Ok(Ok(None)) => {
                    tracing::info!(worker_set = %name, endpoint = %e.authority, "local tokenizer agrees with the engine");
                    TokenizerState::Checked
                }
                Ok(Ok(Some(why))) => {
                    tracing::error!(worker_set = %name, endpoint = %e.authority, %why, "local tokenizer disagrees with the engine; routing with the engine's /tokenize");
                    TokenizerState::Mismatch(why)
                }
                Ok(Err(err)) => {
                    tracing::warn!(worker_set = %name, endpoint = %e.authority, error = %err, "tokenizer self-check could not run; will retry");
                    TokenizerState::Unchecked
                }
                Err(_) => TokenizerState::Unchecked,
            };
            let retry = matches!(state, TokenizerState::Unchecked);
            *rt.tokenizer_state.write() = state;
            if retry {
                tokio::time::sleep(Duration::from_secs(5)).await;
                shared.runtime.notify_models_changed();
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenize_body_of(api: openai::Endpoint, body: &Value) -> Value {
        let bytes = serde_json::to_vec(body).unwrap();
        let fields = openai::parse(api, &bytes).unwrap();
        serde_json::from_slice(&tokenize_body(api, &fields, "engine-name").unwrap()).unwrap()
    }

    #[test]
    fn tokenize_bodies_keep_what_changes_ids() {
        let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.2,
            "add_generation_prompt": true, "reasoning_effort": "low", "stream": true});
        let b = tokenize_body_of(openai::Endpoint::Chat, &chat);
        assert_eq!(b["messages"], chat["messages"]);
        assert_eq!(
            b["model"], "engine-name",
            "the engine's name, not the alias"
        );
        assert_eq!(b["chat_template_kwargs"]["reasoning_effort"], "low");
        assert!(b.get("temperature").is_none() && b.get("stream").is_none());

        let kw = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "chat_template_kwargs": {"enable_thinking": false}, "reasoning_effort": "high"});
        let b = tokenize_body_of(openai::Endpoint::Chat, &kw);
        assert_eq!(
            b["chat_template_kwargs"],
            json!({"enable_thinking": false, "reasoning_effort": "high"})
        );

        let comp = json!({"model": "m", "prompt": ["a", "b"], "max_tokens": 3});
        let b = tokenize_body_of(openai::Endpoint::Completions, &comp);
        assert_eq!(b["prompt"], "a");
        assert!(b.get("max_tokens").is_none());
    }

    #[test]
    fn ids_in_bodies_are_read_as_sent() {
        assert_eq!(
            ids_in_body(&json!({"prompt": [1, 2, 3]})),
            Some(vec![1, 2, 3])
        );
        assert_eq!(
            ids_in_body(&json!({"prompt": [[4, 5], [6]]})),
            Some(vec![4, 5])
        );
        assert_eq!(ids_in_body(&json!({"prompt": "text"})), None);
        assert_eq!(ids_in_body(&json!({"prompt": [-1]})), None);
    }
}
