//! One routing decision: tokens → block keys → index lookup → score → pick.
//!
//! For each worker set that serves the requested model, the candidates are
//! its healthy endpoints (that serve the model, once known). The prompt's
//! ids come per the set's tokenization mode; block keys are chained over
//! full blocks of the set's `kvBlockSize`; the KV index says how many
//! leading blocks each endpoint holds, topped up by this router's own record
//! of prefixes it sent in the last seconds (a burst of a new prefix stays
//! together before the engine's events arrive). The set's policy picks; with
//! several sets the lowest predicted time to first token wins.

use std::sync::Arc;

use kinference_kvindex::{BlockKey, BlockKeyer, ExtraKeys, Matches};
use kinference_scoring::{
    CacheSource, CachedBlocks, Candidate, Choice, EngineMetrics, Explanation, InFlight, Pick,
    Request,
};
use serde_json::Value;
use tokio::time::Instant;

use crate::endpoint::{Endpoint, EndpointId};
use crate::openai::{self, ApiError};
use crate::state::{Shared, WsRuntime};
use crate::tokens::{self, Source};
use crate::view::{Target, View};

/// Bytes per block of text in approximate mode, and the tokens they stand for.
const APPROX_BLOCK_BYTES: usize = 64;
const APPROX_BYTES_PER_TOKEN: usize = 4;

/// The request being routed, as far as deciding goes.
#[derive(Debug)]
pub struct Ask<'a> {
    /// Chat or completions.
    pub api: openai::Endpoint,
    /// The parsed body.
    pub body: &'a Arc<Value>,
    /// Its size in bytes.
    pub body_len: usize,
    /// Whether to explain the decision.
    pub explain: bool,
}

/// What was decided.
#[derive(Debug)]
pub struct Decision {
    /// The worker set chosen (index into the view).
    pub worker_set: usize,
    /// The model name to send.
    pub model: String,
    /// The endpoint chosen.
    pub endpoint: Arc<Endpoint>,
    /// The policy's choice (prediction included).
    pub choice: Choice,
    /// The explanation, when asked for.
    pub explanation: Option<Explanation>,
    /// How the ids were obtained.
    pub tokens: Source,
    /// Prompt tokens used for scoring.
    pub prompt_tokens: u32,
    /// Block keys of the prompt (for the prefix record).
    pub keys: Vec<u64>,
    /// The DP rank to ask for (`X-data-parallel-rank`), when the engine has
    /// several and one holds more of the prompt.
    pub dp_rank: Option<u32>,
}

/// Decides where `body` goes among `targets`, skipping `excluded` endpoints.
///
/// # Errors
/// 503 when no target has a healthy endpoint.
pub async fn decide(
    shared: &Arc<Shared>,
    view: &View,
    targets: &[Target],
    ask: &Ask<'_>,
    excluded: &[EndpointId],
) -> Result<Decision, ApiError> {
    let mut best: Option<Decision> = None;
    for t in targets {
        let ws = &view.worker_sets[t.worker_set];
        let now = Instant::now();
        let endpoints: Vec<Arc<Endpoint>> = ws
            .endpoints
            .iter()
            .filter(|e| e.healthy(now) && !excluded.contains(&e.id))
            .filter(|e| {
                let models = e.models();
                models.is_empty() || models.iter().any(|m| m.id == t.model)
            })
            .cloned()
            .collect();
        if endpoints.is_empty() {
            continue;
        }
        let d = decide_in(
            shared,
            t,
            &ws.runtime,
            ws.route.kv_block_size,
            &endpoints,
            ask,
        )
        .await;
        if let Some(d) = d
            && best
                .as_ref()
                .is_none_or(|b| d.choice.prediction.ttft_ms < b.choice.prediction.ttft_ms)
        {
            best = Some(d);
        }
    }
    best.ok_or_else(|| {
        let sets: Vec<&str> = targets
            .iter()
            .map(|t| view.worker_sets[t.worker_set].route.name.as_str())
            .collect();
        ApiError::unavailable(format!(
            "No healthy endpoint serves this model right now (worker sets: {}).",
            sets.join(", ")
        ))
    })
}

async fn decide_in(
    shared: &Arc<Shared>,
    target: &Target,
    rt: &Arc<WsRuntime>,
    block_size: u32,
    endpoints: &[Arc<Endpoint>],
    req: &Ask<'_>,
) -> Option<Decision> {
    let (api, body, explain) = (req.api, req.body, req.explain);
    // Ask the least loaded endpoint when the engine tokenizes, preferring
    // those that have answered `/v1/models` (an engine that never answered
    // has no load either, and every request would wait for it).
    let ask = endpoints
        .iter()
        .min_by_key(|e| (e.models().is_empty(), e.load.snapshot().requests));
    let (ids, source) = tokens::ids(shared, rt, api, body, req.body_len, ask, &target.model).await;
    let lora = lora_name(endpoints, &target.model);

    let mut keys: Vec<u64> = Vec::new();
    let (request, cache_source) = if let Some(ids) = &ids {
        let keyer = BlockKeyer::new(block_size, lora.as_deref());
        let mut extra = ExtraKeys::none();
        if let Some(salt) = body.get("cache_salt").and_then(Value::as_str) {
            extra = extra.cache_salt(salt);
        }
        let mut block_keys: Vec<BlockKey> = Vec::new();
        keyer.keys_into(ids, &extra, &mut block_keys);
        keys.extend(block_keys.iter().map(|k| k.0));
        (
            Request {
                prompt_tokens: u32::try_from(ids.len()).unwrap_or(u32::MAX),
                block_tokens: block_size.max(1),
                cache: CacheSource::Index,
            },
            CacheSource::Index,
        )
    } else {
        let text = prompt_text(api, body);
        let estimate = u32::try_from(text.len() / APPROX_BYTES_PER_TOKEN).unwrap_or(u32::MAX);
        if rt.effective_mode() == kinference_api::v1alpha1::TokenizationMode::Approximate {
            let seed = xxhash_seed(&target.model, lora.as_deref());
            kinference_scoring::approx::text_block_keys(
                seed,
                text.as_bytes(),
                APPROX_BLOCK_BYTES,
                &mut keys,
            );
            (
                Request {
                    prompt_tokens: estimate,
                    block_tokens: (APPROX_BLOCK_BYTES / APPROX_BYTES_PER_TOKEN) as u32,
                    cache: CacheSource::Approximate,
                },
                CacheSource::Approximate,
            )
        } else {
            shared.metrics.routed_without_tokens.inc();
            (
                Request {
                    prompt_tokens: estimate,
                    block_tokens: block_size.max(1),
                    cache: CacheSource::None,
                },
                CacheSource::None,
            )
        }
    };

    let now_d = shared.now();
    let now = Instant::now();
    // Leading blocks per endpoint: the KV index, topped up by the record of
    // prefixes sent recently.
    let mut cached = vec![CachedBlocks::default(); endpoints.len()];
    // The DP rank holding the most, per endpoint (sent as a header when the
    // engine has several ranks).
    let mut best_rank: Vec<Option<u32>> = vec![None; endpoints.len()];
    if cache_source == CacheSource::Index && !keys.is_empty() {
        let block_keys: Vec<BlockKey> = keys.iter().map(|k| BlockKey(*k)).collect();
        let mut m = Matches::default();
        shared.kv.find_matches_into(&block_keys, &mut m);
        for wm in m.as_slice() {
            let Some((owner, rank)) = shared.owner(wm.worker) else {
                continue;
            };
            if let Some(i) = endpoints.iter().position(|e| e.id == owner) {
                let c = &mut cached[i];
                if wm.blocks > c.cpu.max(c.gpu) {
                    best_rank[i] = Some(rank);
                }
                c.gpu = c.gpu.max(wm.gpu_blocks);
                c.cpu = c.cpu.max(wm.blocks);
            }
        }
    }
    if cache_source != CacheSource::None && !keys.is_empty() {
        let mut out = Vec::new();
        let record = rt.prefixes.lock();
        if cache_source == CacheSource::Index {
            // Only until the engine's own events can have arrived: after that
            // the index is the truth, and it has seen evictions the record
            // cannot (see kinference_scoring::approx).
            record.leading_blocks_within(
                &keys,
                now_d,
                kinference_scoring::approx::EXACT_MODE_HORIZON,
                &mut out,
            );
        } else {
            record.leading_blocks(&keys, now_d, &mut out);
        }
        drop(record);
        for (ep, n) in out {
            if let Some(i) = endpoints.iter().position(|e| e.id.0 == ep.0) {
                cached[i].gpu = cached[i].gpu.max(n);
            }
        }
    }
    let candidates: Vec<Candidate> = endpoints
        .iter()
        .zip(&cached)
        .map(|(e, c)| {
            let load = e.load.snapshot();
            Candidate {
                endpoint: kinference_scoring::EndpointId(e.id.0),
                cached: *c,
                in_flight: InFlight {
                    requests: load.requests,
                    decoding: load.decoding,
                    prefill_tokens: load.prefill_tokens,
                    context_tokens: load.context_tokens,
                },
                engine: e.scraped().map(|s| EngineMetrics {
                    running: s.running as u32,
                    waiting: s.waiting as u32,
                    kv_usage: s.kv_usage,
                    age: now.saturating_duration_since(s.at),
                    own_requests: s.own_requests,
                    own_prefilling: s.own_prefilling,
                }),
            }
        })
        .collect();

    let (choice, explanation) = {
        let mut policy = rt.policy.lock();
        let mut rng = shared.rng.lock();
        if explain || shared.sample_explanation() {
            let e = policy
                .pick_explained(&request, &candidates, now_d, &mut *rng)
                .ok()?;
            (e.choice, Some(e))
        } else {
            (
                policy.pick(&request, &candidates, now_d, &mut *rng).ok()?,
                None,
            )
        }
    };
    let endpoint = endpoints.get(choice.index)?.clone();
    let dp_rank = best_rank
        .get(choice.index)
        .copied()
        .flatten()
        .filter(|_| shared.ranks_of(endpoint.id) > 1);
    if !keys.is_empty() && cache_source != CacheSource::None {
        rt.prefixes.lock().record(choice.endpoint, &keys, now_d);
    }
    Some(Decision {
        worker_set: target.worker_set,
        model: target.model.clone(),
        endpoint,
        choice,
        explanation,
        tokens: source,
        prompt_tokens: request.prompt_tokens,
        keys,
        dp_rank,
    })
}

/// The LoRA adapter name when the model is an adapter (its card has a parent).
fn lora_name(endpoints: &[Arc<Endpoint>], model: &str) -> Option<String> {
    endpoints.iter().find_map(|e| {
        e.models()
            .into_iter()
            .find(|m| m.id == model && m.parent.is_some())
            .map(|m| m.id)
    })
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
pub fn prompt_text(api: openai::Endpoint, body: &Value) -> String {
    let mut out = String::new();
    match api {
        openai::Endpoint::Completions => match body.get("prompt") {
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Array(a)) => {
                if let Some(Value::String(s)) = a.first() {
                    out.push_str(s);
                }
            }
            _ => {}
        },
        openai::Endpoint::Chat => {
            for m in body
                .get("messages")
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
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompt_text_keeps_message_order_and_text_parts() {
        let b = json!({"messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]}
        ]});
        assert_eq!(
            prompt_text(openai::Endpoint::Chat, &b),
            "system\nsys\nuser\nab\n"
        );
        assert_eq!(
            prompt_text(
                openai::Endpoint::Completions,
                &json!({"prompt": ["x", "y"]})
            ),
            "x"
        );
    }
}
