//! The physical floor of a plan: every request's time to first token if
//! each block of the workload were computed once, on an idle engine of the
//! fastest kind, with everything seen before cached.
//!
//! Per arrival, in order: the prompt's leading full blocks that any earlier
//! request of the same model already had are free (a LoRA adapter's blocks
//! are its own, as the engines hash them); the rest (at least its last token, as vLLM
//! computes it) is prefilled alone in steps of at most the token budget, each
//! step `base + prefill × tokens`; the first token comes at the end of the
//! last step. No queueing, no decoding neighbours, no eviction, no slow
//! engine: no router can do better, so ratios to it say how much room is
//! left, not how far from a reachable optimum a policy is.
//!
//! Prompts are the plan's words (one token each with the word-level
//! tokenizer). A chat turn's history is the conversation's earlier turns
//! and answers, already computed: its new tokens are the new user message
//! plus the chat template's few tokens around it; a conversation's first
//! turn also brings its system prompt (shared by its group) and any
//! synthetic history.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};

use super::oracle::StepModel;
use super::workload::{Body, Plan};

/// Tokens the chat template adds around one message (role markers).
const TEMPLATE_TOKENS: u64 = 4;

/// ms to prefill `tokens` alone on an idle engine.
pub(crate) fn idle_prefill_ms(step: &StepModel, tokens: u64) -> f64 {
    let budget = u64::from(step.budget.max(1));
    let mut left = tokens.max(1);
    let mut ms = 0.0;
    while left > 0 {
        let chunk = left.min(budget);
        ms += step.base_ms + step.prefill_ms_per_token * chunk as f64;
        left -= chunk;
    }
    ms
}

/// Uncached tokens of `text` given the block-prefix hashes `seen` (which it
/// extends); `adapter`'s blocks are a namespace of their own.
fn uncached(text: &str, adapter: Option<&str>, block: usize, seen: &mut HashSet<u64>) -> u64 {
    let toks: Vec<&str> = text.split_whitespace().collect();
    let mut h = DefaultHasher::new();
    if let Some(a) = adapter {
        a.hash(&mut h);
    }
    let mut cached = 0usize;
    let mut still = true;
    for (i, chunk) in toks.chunks(block).enumerate() {
        if chunk.len() < block {
            break;
        }
        chunk.hash(&mut h);
        let key = h.finish();
        if still && seen.contains(&key) {
            cached = (i + 1) * block;
        } else {
            still = false;
            seen.insert(key);
        }
    }
    (toks.len() - cached.min(toks.len())).max(1) as u64
}

/// Every arrival's floor TTFT, ms, in plan order.
pub(crate) fn ttfts(plan: &Plan, step: &StepModel) -> Vec<f64> {
    let block = step.block_size.max(1) as usize;
    let mut seen = HashSet::new();
    plan.arrivals
        .iter()
        .map(|a| {
            let tokens = match &a.body {
                Body::Completion { prompt, .. } => uncached(prompt, a.model, block, &mut seen),
                Body::ChatTurn { restart, user, .. } => {
                    let mut t = user.split_whitespace().count() as u64 + TEMPLATE_TOKENS;
                    if let Some(m) = restart {
                        for (i, msg) in m.iter().enumerate() {
                            let content = msg["content"].as_str().unwrap_or_default();
                            t += if i == 0 {
                                uncached(content, a.model, block, &mut seen)
                            } else {
                                content.split_whitespace().count() as u64
                            } + TEMPLATE_TOKENS;
                        }
                    }
                    t
                }
            };
            idle_prefill_ms(step, tokens)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::bench::workload::Arrival;

    fn step() -> StepModel {
        StepModel {
            base_ms: 5.0,
            prefill_ms_per_token: 1.0,
            decode_ms_per_seq: 0.5,
            budget: 100,
            block_size: 4,
        }
    }

    fn completion(i: usize, prompt: &str) -> Arrival {
        Arrival {
            index: i,
            at: Duration::ZERO,
            body: Body::Completion {
                prompt: prompt.into(),
                max_tokens: 1,
            },
            label: String::new(),
            tenant: None,
            model: None,
        }
    }

    #[test]
    fn an_adapter_s_blocks_are_its_own() {
        let as_model = |i: usize, model: Option<&'static str>| Arrival {
            model,
            ..completion(i, "a b c d e f g h x")
        };
        let plan = Plan {
            arrivals: vec![
                as_model(0, None),
                // Another adapter's, the same text: nothing cached.
                as_model(1, Some("lora-1")),
                as_model(2, Some("lora-2")),
                // The same adapter's again: its two full blocks are free.
                as_model(3, Some("lora-1")),
                as_model(4, None),
            ],
            warmup: Duration::ZERO,
            measure: Duration::from_secs(1),
            conversations: 0,
        };
        let f = ttfts(&plan, &step());
        let want = [14.0, 14.0, 14.0, 6.0, 6.0];
        assert!(
            f.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-9),
            "{f:?}"
        );
    }

    #[test]
    fn seen_blocks_are_free_and_long_prompts_take_several_steps() {
        assert!((idle_prefill_ms(&step(), 250) - (3.0 * 5.0 + 250.0)).abs() < 1e-9);
        let plan = Plan {
            arrivals: vec![
                completion(0, "a b c d e f g h i"),
                // The first two blocks are cached: only "x" is new.
                completion(1, "a b c d e f g h x"),
                // Fully cached: still computes its last token.
                completion(2, "a b c d"),
            ],
            warmup: Duration::ZERO,
            measure: Duration::from_secs(1),
            conversations: 0,
        };
        let f = ttfts(&plan, &step());
        assert!((f[0] - 14.0).abs() < 1e-9, "{f:?}");
        assert!((f[1] - 6.0).abs() < 1e-9, "{f:?}");
        assert!((f[2] - 6.0).abs() < 1e-9, "{f:?}");
    }
}
