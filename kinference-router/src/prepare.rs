//! Stage 1, prepare: everything a request needs before any engine is
//! chosen, computed once per request (retries re-enter at
//! [`crate::decide`], never here).
//!
//! 1. Parse what routing needs from the body bytes ([`openai::parse`]:
//!    borrowed fields, the rest unparsed and forwarded byte for byte).
//! 2. Resolve the model or alias to its targets (worker set, engine model
//!    name) in the current view; an unknown name is a 404.
//! 3. Per target, the prompt's token ids per the worker set's profile
//!    ([`crate::tokens`]: local tokenizer, the engine's `/tokenize`) and
//!    its block keys at the set's `kvBlockSize`; in approximate mode, keys
//!    of the prompt text instead. Targets sharing a runtime and a model
//!    share one tokenization.
//!
//! The result, [`Prepared`], is plain data: the decision core reads it
//! without I/O.

use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;
use kinference_api::v1alpha1::TokenizationMode;
use kinference_kvindex::{BlockKey, BlockKeyer, ExtraKeys};
use kinference_scoring::{CacheSource, Request};
use serde_json::Value;
use tokio::time::Instant;

use crate::memo::{self, Memo};
use crate::openai::{self, ApiError, Fields};
use crate::state::Shared;
use crate::tokens::{self, Source};
use crate::view::{Target, View};

/// Bytes per block of text in approximate mode, and the tokens they stand for.
const APPROX_BLOCK_BYTES: usize = 64;
const APPROX_BYTES_PER_TOKEN: usize = 4;

impl Route {
    /// A route whose prompt is `ids` at block width `block_size` (exact
    /// mode, keys as the router computes them).
    pub fn from_ids(target: Target, ids: &[u32], block_size: u32, tokens: Source) -> Self {
        let mut block_keys = Vec::new();
        BlockKeyer::new(block_size.max(1), None).keys_into(
            ids,
            &ExtraKeys::none(),
            &mut block_keys,
        );
        Self {
            target,
            tokens,
            request: Request {
                prompt_tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX),
                block_tokens: block_size.max(1),
                cache: CacheSource::Index,
                ttft_target: None,
            },
            keys: block_keys.iter().map(|k| k.0).collect(),
            block_keys: block_keys.into(),
            adapter: None,
        }
    }
}

/// One target of a request, ready to decide on.
#[derive(Clone, Debug)]
pub struct Route {
    /// The worker set and the model name its engines serve.
    pub target: Target,
    /// How the ids were obtained.
    pub tokens: Source,
    /// What the policy reads about the request.
    pub request: Request,
    /// Keys of the prompt's full blocks: index keys at the worker set's
    /// `kvBlockSize` (exact mode) or text keys (approximate mode); what the
    /// prefix record stores.
    pub keys: Arc<[u64]>,
    /// The same keys for the KV index (exact mode only).
    pub block_keys: Arc<[BlockKey]>,
    /// The LoRA adapter the request names (the engines list the model with
    /// a parent): where it already runs matters ([`crate::adapters`]).
    pub adapter: Option<Arc<str>>,
}

/// A request, prepared.
#[derive(Debug)]
pub struct Prepared {
    /// Chat or completions.
    pub api: openai::Endpoint,
    /// The model name the client sent (the pool's only model when it sent
    /// none).
    pub requested: String,
    /// Whether the response streams.
    pub stream: bool,
    /// Whether the client asked for the decision in headers.
    pub debug: bool,
    /// The body as received.
    pub body: Bytes,
    /// Where `model` sits in the body, for alias rewrites.
    model_span: Option<std::ops::Range<usize>>,
    /// Whether the body names its model (without one, `requested` is the
    /// pool's only model and the body sent names it).
    model_named: bool,
    /// Whether the body sets `vllm_xargs` itself (then the router never
    /// adds its own).
    has_vllm_xargs: bool,
    /// The request target to forward.
    pub path_and_query: String,
    /// The client's headers, forwarded (hop-by-hop ones are dropped when
    /// sending).
    pub headers: HeaderMap,
    /// One route per target, in the view's order.
    pub routes: Vec<Route>,
    /// What the client's API key names (tenant, priority), when the router
    /// checks keys.
    pub key_class: Option<crate::auth::KeyClass>,
    /// When the request's TTFT target (`x-kinference-ttft-target-ms`) runs
    /// out, counted from its arrival.
    pub ttft_deadline: Option<Instant>,
    /// The session it belongs to ([`session`]).
    pub session: Option<Arc<str>>,
    /// The Responses API's `previous_response_id`: only the engine that
    /// kept that response can continue it ([`crate::stored`]).
    pub previous_response: Option<Arc<str>>,
}

impl Prepared {
    /// A request with `routes` already computed (for embedding the decision
    /// core, its tests and benchmarks): a completion of `requested` with an
    /// empty body and no headers.
    pub fn new(api: openai::Endpoint, requested: &str, routes: Vec<Route>) -> Self {
        Self {
            api,
            requested: requested.to_owned(),
            stream: false,
            debug: false,
            body: Bytes::new(),
            model_span: None,
            model_named: true,
            has_vllm_xargs: false,
            path_and_query: api.path().to_owned(),
            headers: HeaderMap::new(),
            routes,
            key_class: None,
            ttft_deadline: None,
            session: None,
            previous_response: None,
        }
    }

    /// The body to send for `route`: as received, or with `model`
    /// rewritten when the client used an alias.
    pub fn body_for(&self, route: &Route) -> Bytes {
        // SGLang's `/generate` names no model: its one engine model serves it.
        if self.api == openai::Endpoint::Generate
            || (self.model_named && route.target.model == self.requested)
        {
            return self.body.clone();
        }
        openai::rewrite_model(&self.body, self.model_span.clone(), &route.target.model)
    }

    /// [`Prepared::body_for`], asking the engine to re-report the blocks
    /// the request reuses when `recover` is set (and the client did not set
    /// `vllm_xargs` itself).
    pub fn body_to_send(&self, route: &Route, recover: bool) -> Bytes {
        let body = self.body_for(route);
        if recover && !self.has_vllm_xargs {
            openai::with_full_report_mode(&body)
        } else {
            body
        }
    }
}

/// The header naming a request's session.
pub const SESSION_HEADER: &str = "x-session-id";

/// The session a request belongs to: the [`SESSION_HEADER`] header, else
/// the body's `session_id`. The engines attribute KV-cache stores to it
/// (`session_id` on `BlockStored`, vLLM ≥ 0.30, SGLang ≥ 0.5.20), and the
/// decision reads where they did ([`crate::kv::KvPlane::session_tokens`]).
pub fn session(headers: &HeaderMap, fields: &Fields<'_>) -> Option<Arc<str>> {
    headers
        .get(SESSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty())
        .map(Arc::from)
        .or_else(|| fields.session_id.as_deref().map(Arc::from))
}

/// The request's head, as the serving code read it.
#[derive(Debug)]
pub struct Head {
    /// The request target.
    pub path_and_query: String,
    /// The headers.
    pub headers: HeaderMap,
    /// Whether the decision goes back in headers.
    pub debug: bool,
    /// What the client's API key names, when the router checked one.
    pub key_class: Option<crate::auth::KeyClass>,
    /// When the request arrived (its TTFT target counts from here).
    pub arrived: Instant,
}

/// Prepares a request against `view`.
///
/// # Errors
/// 400 for a malformed body, 404 for an unknown model (503 while the router
/// has not listed its pool yet).
pub async fn prepare(
    shared: &Shared,
    view: &View,
    api: openai::Endpoint,
    head: Head,
    body: Bytes,
) -> Result<Prepared, ApiError> {
    let fields = openai::parse(api, &body)?;
    let starting =
        || ApiError::unavailable("The router is starting and has not listed its pool yet.");
    let model: &str = match &fields.model {
        Some(m) => m,
        None => match view.only_model() {
            Ok(m) => m,
            Err(_) if !shared.is_ready() => return Err(starting()),
            Err(models) => return Err(ApiError::model_required(&models)),
        },
    };
    let Some(targets) = view.resolve(model) else {
        if !shared.is_ready() {
            return Err(starting());
        }
        return Err(ApiError::model_not_found(model));
    };
    let mut routes: Vec<Route> = Vec::with_capacity(targets.len());
    for t in targets {
        let ws = &view.worker_sets[t.worker_set];
        // Same runtime and model as an earlier target: same ids and keys.
        if let Some(same) = routes.iter().find(|r| {
            r.target.model == t.model
                && Arc::ptr_eq(&view.worker_sets[r.target.worker_set].runtime, &ws.runtime)
        }) {
            let mut r = same.clone();
            r.target = t.clone();
            routes.push(r);
            continue;
        }
        routes.push(route(shared, view, t, api.tokenized_as(), &fields, body.len()).await);
    }
    Ok(Prepared {
        api,
        requested: model.to_owned(),
        model_named: fields.model.is_some(),
        stream: fields.stream,
        debug: head.debug,
        model_span: fields.model_span.clone(),
        has_vllm_xargs: fields.has_vllm_xargs,
        path_and_query: head.path_and_query,
        ttft_deadline: crate::admit::target(&head.headers).map(|t| head.arrived + t),
        session: session(&head.headers, &fields),
        previous_response: fields
            .previous_response_id
            .as_deref()
            .filter(|_| api == openai::Endpoint::Responses)
            .map(Arc::from),
        headers: head.headers,
        routes,
        body: body.clone(),
        key_class: head.key_class,
    })
}

async fn route(
    shared: &Shared,
    view: &View,
    target: &Target,
    api: openai::Endpoint,
    fields: &Fields<'_>,
    body_len: usize,
) -> Route {
    let ws = &view.worker_sets[target.worker_set];
    let rt = &ws.runtime;
    let block_size = ws.route.kv_block_size.max(1);
    let lora = ws.adapter(&target.model);
    if !api.cache_aware() {
        // Passed through and routed on load: the body's size stands for
        // its prefill work.
        return Route {
            target: target.clone(),
            tokens: Source::None,
            request: Request {
                prompt_tokens: u32::try_from(body_len / APPROX_BYTES_PER_TOKEN).unwrap_or(u32::MAX),
                block_tokens: block_size,
                cache: CacheSource::None,
                ttft_target: None,
            },
            keys: Arc::new([]),
            block_keys: Arc::new([]),
            adapter: lora.clone(),
        };
    }
    let endpoints = ws.serving(&target.model, Instant::now(), &[]);
    let mode = rt.effective_mode();
    let memo_key = (mode != TokenizationMode::Approximate).then(|| {
        memo::key(
            api,
            memo::KeyScope {
                model: &target.model,
                mode: mode.as_str(),
                block_size,
                lora: lora.as_deref(),
            },
            fields,
        )
    });
    if let Some(m) = memo_key.and_then(|k| rt.memo.get(k)) {
        shared.metrics.prepared_from_memo.inc();
        return Route {
            target: target.clone(),
            tokens: m.tokens,
            request: m.request,
            keys: m.keys,
            block_keys: m.block_keys,
            adapter: lora.clone(),
        };
    }
    // Ask the least loaded endpoint when the engine tokenizes, preferring
    // those that have answered `/v1/models` (an engine that never answered
    // has no load either, and every request would wait for it).
    let ask = endpoints
        .iter()
        .min_by_key(|e| (!e.has_models(), e.load.snapshot().requests));
    let (ids, source) = tokens::ids(shared, rt, api, fields, body_len, ask, &target.model).await;
    if let Some(ids) = ids {
        let keyer = BlockKeyer::new(block_size, lora.as_deref());
        let mut extra = ExtraKeys::none();
        if let Some(salt) = &fields.cache_salt {
            extra = extra.cache_salt(salt.as_ref());
        }
        let mut block_keys: Vec<BlockKey> = Vec::new();
        keyer.keys_into(&ids, &extra, &mut block_keys);
        let m = Memo {
            tokens: source,
            request: Request {
                prompt_tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX),
                block_tokens: block_size,
                cache: CacheSource::Index,
                ttft_target: None,
            },
            keys: block_keys.iter().map(|k| k.0).collect(),
            block_keys: block_keys.into(),
        };
        if let Some(k) = memo_key {
            rt.memo.insert(k, m.clone());
        }
        return Route {
            target: target.clone(),
            tokens: m.tokens,
            request: m.request,
            keys: m.keys,
            block_keys: m.block_keys,
            adapter: lora.clone(),
        };
    }
    let text = prompt_text(api, fields);
    let estimate = u32::try_from(text.len() / APPROX_BYTES_PER_TOKEN).unwrap_or(u32::MAX);
    if source == Source::Approximate {
        let seed = xxhash_seed(&target.model, lora.as_deref());
        let mut keys = Vec::new();
        kinference_scoring::approx::text_block_keys(
            seed,
            text.as_bytes(),
            APPROX_BLOCK_BYTES,
            &mut keys,
        );
        return Route {
            target: target.clone(),
            tokens: source,
            request: Request {
                prompt_tokens: estimate,
                block_tokens: (APPROX_BLOCK_BYTES / APPROX_BYTES_PER_TOKEN) as u32,
                cache: CacheSource::Approximate,
                ttft_target: None,
            },
            keys: keys.into(),
            block_keys: Arc::new([]),
            adapter: lora.clone(),
        };
    }
    shared.metrics.routed_without_tokens.inc();
    Route {
        target: target.clone(),
        tokens: source,
        request: Request {
            prompt_tokens: estimate,
            block_tokens: block_size,
            cache: CacheSource::None,
            ttft_target: None,
        },
        keys: Arc::new([]),
        block_keys: Arc::new([]),
        adapter: lora.clone(),
    }
}

fn xxhash_seed(model: &str, lora: Option<&str>) -> u64 {
    let mut s = model.as_bytes().to_vec();
    if let Some(l) = lora {
        s.push(0);
        s.extend_from_slice(l.as_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&s)
}

/// The prompt as text, for approximate keys and length estimates: the
/// completion prompt, or each message's role and text content in order.
pub fn prompt_text(api: openai::Endpoint, fields: &Fields<'_>) -> String {
    let mut out = String::new();
    let parsed = |name: &str| {
        fields
            .id_field(name)
            .and_then(|raw| serde_json::from_str::<Value>(raw.get()).ok())
    };
    match api {
        openai::Endpoint::Completions => match parsed("prompt") {
            Some(Value::String(s)) => out.push_str(&s),
            Some(Value::Array(a)) => {
                if let Some(Value::String(s)) = a.first() {
                    out.push_str(s);
                }
            }
            _ => {}
        },
        openai::Endpoint::Chat => {
            let messages = parsed("messages");
            for m in messages
                .as_ref()
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                out.push_str(m.get("role").and_then(Value::as_str).unwrap_or(""));
                out.push('\n');
                match m.get("content") {
                    Some(Value::String(s)) => out.push_str(s),
                    Some(Value::Array(parts)) => {
                        for p in parts {
                            if let Some(t) = p.get("text").and_then(Value::as_str) {
                                out.push_str(t);
                            }
                        }
                    }
                    _ => {}
                }
                out.push('\n');
            }
        }
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn text_of(api: openai::Endpoint, body: &Value) -> String {
        let bytes = serde_json::to_vec(body).unwrap();
        prompt_text(api, &openai::parse(api, &bytes).unwrap())
    }

    #[test]
    fn prompt_text_keeps_message_order_and_text_parts() {
        let b = json!({"model": "m", "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]}
        ]});
        assert_eq!(
            text_of(openai::Endpoint::Chat, &b),
            "system\nsys\nuser\nab\n"
        );
        assert_eq!(
            text_of(
                openai::Endpoint::Completions,
                &json!({"model": "m", "prompt": ["x", "y"]})
            ),
            "x"
        );
    }

    #[test]
    fn alias_rewrites_touch_only_the_model() {
        let body =
            br#"{"z":1, "model" : "alias\u0041", "messages":[{"role":"user","content":"hi"}]}"#;
        let fields = openai::parse(openai::Endpoint::Chat, body).unwrap();
        assert_eq!(fields.model.as_deref(), Some("aliasA"));
        let out = fields.with_model(body, "org/real \"name\"");
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"z":1, "model" : "org/real \"name\"", "messages":[{"role":"user","content":"hi"}]}"#
        );
    }
}
