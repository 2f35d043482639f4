//! Load figures and activity counters from an engine's `/metrics`.
//!
//! vLLM names its metrics `vllm:*` with a per-DP-rank `engine` label;
//! SGLang names them `sglang:*` (with a `dp_rank` label when data-parallel
//! attention is on). Both are read; an engine's [`EngineFamily`] is whichever
//! prefix its text carries.

use std::collections::BTreeSet;

use super::prometheus::{Sample, samples};

/// Which engine's names a `/metrics` text carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineFamily {
    /// No engine metric seen.
    #[default]
    Unknown,
    /// `vllm:*`.
    Vllm,
    /// `sglang:*`.
    Sglang,
}

impl EngineFamily {
    /// The family a metric name belongs to.
    pub fn of(name: &str) -> Self {
        if name.starts_with("vllm:") {
            Self::Vllm
        } else if name.starts_with("sglang:") {
            Self::Sglang
        } else {
            Self::Unknown
        }
    }

    /// A label value for metrics and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
        }
    }
}

/// The DP rank a sample belongs to: vLLM's `engine` label, SGLang's `dp_rank`.
fn rank(s: &Sample<'_>) -> Option<u32> {
    s.label("engine")
        .or_else(|| s.label("dp_rank"))
        .and_then(|r| r.parse().ok())
}

/// How busy an engine is, summed over its DP ranks.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct LoadFigures {
    /// Whose names were read.
    pub family: EngineFamily,
    /// Requests in the running batch (`vllm:num_requests_running`,
    /// `sglang:num_running_reqs`).
    pub running: f64,
    /// Requests queued (`vllm:num_requests_waiting`, `sglang:num_queue_reqs`).
    pub waiting: f64,
    /// Fraction of the KV cache in use, the largest over ranks
    /// (`vllm:kv_cache_usage_perc`, older `vllm:gpu_cache_usage_perc`,
    /// `sglang:token_usage`), clamped to 0..=1.
    pub kv_usage: f64,
    /// `block_size` of `vllm:cache_config_info` (the engine's allocation
    /// unit; not necessarily the width of its KV events).
    pub block_size: Option<u32>,
    /// Tokens the engine's KV cache holds, summed over the ranks read:
    /// `kv_cache_size_tokens` of `vllm:cache_config_info` where recent
    /// releases give it, else `num_gpu_blocks × block_size`.
    pub kv_capacity_tokens: Option<u64>,
    /// Requests refused by the engine's own admission control so far
    /// (`vllm:admission_rejections_total`, vLLM ≥ 0.32).
    pub admission_rejections: f64,
}

/// Reads the load figures of an engine's `/metrics` text. Unknown lines
/// are ignored.
pub fn parse_load(text: &str) -> LoadFigures {
    parse_scrape(text).0
}

/// The LoRA adapters an engine runs, from vLLM's `vllm:lora_requests_info`
/// (present only when the engine serves adapters).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct AdapterFigures {
    /// `max_lora`: distinct adapters one running batch may hold
    /// (`--max-loras`).
    pub max_loras: u32,
    /// Adapters with running requests (`running_lora_adapters`).
    pub running: Vec<String>,
    /// Adapters with waiting requests (`waiting_lora_adapters`).
    pub waiting: Vec<String>,
}

impl AdapterFigures {
    /// Whether `adapter` is running or waiting there.
    pub fn has(&self, adapter: &str) -> bool {
        self.running
            .iter()
            .chain(&self.waiting)
            .any(|a| a == adapter)
    }

    /// The figures of one `vllm:lora_requests_info` sample.
    fn of(s: &Sample<'_>) -> Self {
        let list = |key: &str| -> Vec<String> {
            let mut out: Vec<String> = Vec::new();
            for name in s.label(key).unwrap_or("").split(',') {
                let name = unescape(name.trim());
                if !name.is_empty() && !out.contains(&name) {
                    out.push(name);
                }
            }
            out
        };
        Self {
            max_loras: s
                .label("max_lora")
                .and_then(|m| m.trim().parse().ok())
                .unwrap_or(0),
            running: list("running_lora_adapters"),
            waiting: list("waiting_lora_adapters"),
        }
    }
}

/// Reads `vllm:lora_requests_info` from an engine's `/metrics` text: `None`
/// when the engine exports none (no adapters, or not vLLM). See
/// [`parse_scrape`].
pub fn parse_adapters(text: &str) -> Option<AdapterFigures> {
    parse_scrape(text).1
}

/// The load figures and the LoRA adapters of an engine's `/metrics` text, in
/// one pass over it (what a router's scrape reads).
///
/// vLLM sets `vllm:lora_requests_info` to the current Unix time under labels
/// naming the adapters, and a label combination set once stays in the output
/// with its old time: the series with the largest value is the current one.
pub fn parse_scrape(text: &str) -> (LoadFigures, Option<AdapterFigures>) {
    let mut l = LoadFigures::default();
    let mut lora: Option<(f64, Sample<'_>)> = None;
    for s in samples(text) {
        let family = EngineFamily::of(s.name);
        if family == EngineFamily::Unknown {
            continue;
        }
        l.family = family;
        let v = if s.value.is_finite() { s.value } else { 0.0 };
        match s.name {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => l.running += v,
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => l.waiting += v,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                l.kv_usage = l.kv_usage.max(v.clamp(0.0, 1.0));
            }
            "vllm:admission_rejections_total" => l.admission_rejections += v,
            "vllm:cache_config_info" => {
                let block: Option<u32> = s.label("block_size").and_then(|b| b.parse().ok());
                if let Some(b) = block {
                    l.block_size = Some(b);
                }
                // vLLM renders these ints with `str()`; unset ones read "None".
                let number = |key: &str| s.label(key)?.trim().parse::<u64>().ok();
                let tokens = number("kv_cache_size_tokens").or_else(|| {
                    number("num_gpu_blocks")
                        .zip(block)
                        .map(|(n, b)| n.saturating_mul(u64::from(b)))
                });
                if let Some(t) = tokens.filter(|t| *t > 0) {
                    l.kv_capacity_tokens =
                        Some(l.kv_capacity_tokens.unwrap_or(0).saturating_add(t));
                }
            }
            "vllm:lora_requests_info"
                if !s.value.is_nan() && lora.as_ref().is_none_or(|(t, _)| s.value > *t) =>
            {
                lora = Some((s.value, s));
            }
            _ => {}
        }
    }
    (l, lora.map(|(_, s)| AdapterFigures::of(&s)))
}

/// A label value as the text format escapes it (`\\`, `\"`, `\n`), unescaped.
fn unescape(v: &str) -> String {
    if !v.contains('\\') {
        return v.to_owned();
    }
    let mut out = String::with_capacity(v.len());
    let mut chars = v.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    out
}

/// Counters and gauges of an engine's `/metrics` that tell whether it served
/// requests, summed over the DP ranks read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineCounters {
    /// Requests running.
    pub running: f64,
    /// Requests queued.
    pub waiting: f64,
    /// Requests finished (`vllm:request_success_total` over every
    /// `finished_reason`; `sglang:num_requests_total`).
    pub finished: f64,
    /// Prompt tokens (`vllm:prompt_tokens_total`, `sglang:prompt_tokens_total`).
    pub prompt_tokens: f64,
    /// Generated tokens (`*:generation_tokens_total`).
    pub generation_tokens: f64,
    /// Prompt tokens looked up in the prefix cache
    /// (`vllm:prefix_cache_queries_total`; SGLang looks every prompt token up).
    pub prefix_queries: f64,
    /// Prompt tokens found there (`vllm:prefix_cache_hits_total`,
    /// `sglang:cached_tokens_total`).
    pub prefix_hits: f64,
    /// `block_size` of `vllm:cache_config_info`.
    pub block_size: Option<u32>,
    /// Whose names were read ([`EngineFamily::Unknown`]: no engine metric at
    /// all, not a vLLM- or SGLang-compatible engine).
    pub family: EngineFamily,
}

impl EngineCounters {
    /// Whether any engine metric was read.
    pub fn seen(&self) -> bool {
        self.family != EngineFamily::Unknown
    }
}

/// Reads the counters of an engine's `/metrics`, summed over the DP ranks in
/// `ranks` (lines without a rank label count always), or over all ranks when
/// `ranks` is `None`.
pub fn parse_counters(text: &str, ranks: Option<&BTreeSet<u32>>) -> EngineCounters {
    let mut c = EngineCounters::default();
    let mut sglang_prompt = 0.0;
    for s in samples(text) {
        let family = EngineFamily::of(s.name);
        if family == EngineFamily::Unknown {
            continue;
        }
        c.family = family;
        if let (Some(ranks), Some(r)) = (ranks, rank(&s))
            && !ranks.contains(&r)
        {
            continue;
        }
        let v = s.value;
        match s.name {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => c.running += v,
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => c.waiting += v,
            "vllm:request_success_total" | "sglang:num_requests_total" => c.finished += v,
            "vllm:prompt_tokens_total" => c.prompt_tokens += v,
            "sglang:prompt_tokens_total" => {
                c.prompt_tokens += v;
                sglang_prompt += v;
            }
            "vllm:generation_tokens_total" | "sglang:generation_tokens_total" => {
                c.generation_tokens += v;
            }
            "vllm:prefix_cache_queries_total" => c.prefix_queries += v,
            "vllm:prefix_cache_hits_total" | "sglang:cached_tokens_total" => c.prefix_hits += v,
            "vllm:cache_config_info" => {
                if let Some(b) = s.label("block_size").and_then(|b| b.parse().ok()) {
                    c.block_size = Some(b);
                }
            }
            _ => {}
        }
    }
    if c.family == EngineFamily::Sglang {
        // SGLang's radix cache sees every prompt token.
        c.prefix_queries += sglang_prompt;
    }
    c
}

/// How much an engine did between two readings of its `/metrics`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineActivity {
    /// Requests that finished in between, plus those running at the end.
    pub requests: u64,
    /// Tokens whose KV the engine computed in between (and so could cache
    /// and announce): prompt tokens that were not prefix-cache hits, plus
    /// generated tokens.
    pub tokens_computed: u64,
    /// The engine's `--block-size`, when its metrics say.
    pub engine_block_size: Option<u32>,
}

/// The increase of a counter; after a restart (a decrease) the new value.
fn delta(before: f64, after: f64) -> f64 {
    if after >= before {
        after - before
    } else {
        after
    }
}

fn count(x: f64) -> u64 {
    // Counters are non-negative integers in practice; anything else is
    // clamped rather than trusted.
    if x.is_finite() && x > 0.0 {
        x.round() as u64
    } else {
        0
    }
}

impl EngineActivity {
    /// The activity between `before` and `after`; `None` when either reading
    /// held no engine metric.
    pub fn between(before: &EngineCounters, after: &EngineCounters) -> Option<EngineActivity> {
        if !(before.seen() && after.seen()) {
            return None;
        }
        let queried = delta(before.prefix_queries, after.prefix_queries);
        let prompt_computed = if queried > 0.0 {
            (queried - delta(before.prefix_hits, after.prefix_hits)).max(0.0)
        } else {
            // Prefix caching off: nothing is looked up, every prompt token
            // is computed.
            delta(before.prompt_tokens, after.prompt_tokens)
        };
        Some(EngineActivity {
            requests: count(delta(before.finished, after.finished) + after.running),
            tokens_computed: count(
                prompt_computed + delta(before.generation_tokens, after.generation_tokens),
            ),
            engine_block_size: after.block_size.or(before.block_size),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0 1767225600000
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 500.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0
vllm:admission_rejections_total{engine="0",model_name="m"} 4.0
garbage line
"#;

    const SGLANG: &str = r#"# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen3"} 0.52
sglang:num_running_reqs{model_name="Qwen/Qwen3"} 8
sglang:num_queue_reqs{model_name="Qwen/Qwen3"} 4
sglang:prompt_tokens_total{model_name="Qwen/Qwen3"} 1000
sglang:cached_tokens_total{model_name="Qwen/Qwen3"} 600
sglang:generation_tokens_total{model_name="Qwen/Qwen3"} 50
sglang:num_requests_total{model_name="Qwen/Qwen3"} 9
"#;

    #[test]
    fn adapters_come_from_the_newest_lora_series() {
        // vLLM keeps every label combination it ever set, each with the
        // time it was last set; the newest is the state now.
        let text = r#"# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",waiting_lora_adapters="",running_lora_adapters="sql"} 1.7672256e+09
vllm:lora_requests_info{max_lora="2",waiting_lora_adapters="chat",running_lora_adapters="sql,math"} 1.7672257e+09
vllm:lora_requests_info{max_lora="2",waiting_lora_adapters="",running_lora_adapters=""} 1.76722565e+09
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"#;
        let a = parse_adapters(text).expect("the gauge");
        assert_eq!(a.max_loras, 2);
        assert_eq!(a.running, ["sql", "math"]);
        assert_eq!(a.waiting, ["chat"]);
        assert!(a.has("chat") && a.has("sql") && !a.has("other"));
        let (load, adapters) = parse_scrape(text);
        assert!((load.running - 3.0).abs() < 1e-9, "one pass reads both");
        assert_eq!(adapters, Some(a.clone()));
        assert_eq!(parse_adapters(VLLM), None, "no adapters configured");
        // Escaped names come back unescaped; a missing max_lora reads 0.
        let odd = r#"vllm:lora_requests_info{waiting_lora_adapters="",running_lora_adapters="a\\b,a\\b, c"} 5"#;
        let a = parse_adapters(odd).expect("the gauge");
        assert_eq!(a.running, ["a\\b", "c"]);
        assert_eq!(a.max_loras, 0);
    }

    #[test]
    fn vllm_load_sums_ranks_and_ignores_timestamps() {
        let l = parse_load(VLLM);
        assert_eq!(l.family, EngineFamily::Vllm);
        assert!((l.running - 5.0).abs() < 1e-9, "{l:?}");
        assert!((l.waiting - 7.0).abs() < 1e-9);
        assert!((l.kv_usage - 0.5).abs() < 1e-9);
        assert_eq!(l.block_size, Some(16));
        assert!((l.admission_rejections - 4.0).abs() < 1e-9);
        assert_eq!(l.kv_capacity_tokens, None, "no num_gpu_blocks label");
    }

    #[test]
    fn kv_capacity_comes_from_cache_config_info_summed_over_ranks() {
        // vLLM 0.9 – 0.2x: blocks × block size; recent releases also give the
        // token capacity, which wins (hybrid models: blocks × size is not it).
        let text = r#"vllm:cache_config_info{block_size="16",num_gpu_blocks="385",engine="0"} 1.0
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",kv_cache_size_tokens="12345",engine="1"} 1.0
"#;
        let l = parse_load(text);
        assert_eq!(l.kv_capacity_tokens, Some(385 * 16 + 12_345));
        let odd = r#"vllm:cache_config_info{block_size="16",num_gpu_blocks="None",engine="0"} 1.0"#;
        assert_eq!(parse_load(odd).kv_capacity_tokens, None);
        assert_eq!(parse_load(SGLANG).kv_capacity_tokens, None);
    }

    #[test]
    fn sglang_load_and_counters() {
        let l = parse_load(SGLANG);
        assert_eq!(l.family, EngineFamily::Sglang);
        assert!((l.running - 8.0).abs() < 1e-9 && (l.waiting - 4.0).abs() < 1e-9);
        assert!((l.kv_usage - 0.52).abs() < 1e-9);
        let c = parse_counters(SGLANG, None);
        assert!(c.seen());
        assert!((c.prefix_queries - 1000.0).abs() < 1e-9);
        assert!((c.prefix_hits - 600.0).abs() < 1e-9);
        let before = EngineCounters {
            family: EngineFamily::Sglang,
            ..EngineCounters::default()
        };
        let a = EngineActivity::between(&before, &c).unwrap();
        assert_eq!(
            a.tokens_computed, 450,
            "400 prompt tokens computed + 50 generated"
        );
        assert_eq!(a.requests, 17, "9 finished + 8 running");
    }

    #[test]
    fn counters_filter_by_rank() {
        let only0: BTreeSet<u32> = [0].into();
        let c = parse_counters(VLLM, Some(&only0));
        assert!((c.running - 3.0).abs() < 1e-9);
        assert!((c.prefix_queries - 1000.0).abs() < 1e-9);
        let all = parse_counters(VLLM, None);
        assert!((all.prefix_queries - 1500.0).abs() < 1e-9);
        assert!(!parse_counters("up 1\n", None).seen());
    }

    #[test]
    fn activity_needs_two_readings_and_survives_restarts() {
        let before = parse_counters(VLLM, None);
        let mut after = before.clone();
        after.prefix_queries = 100.0; // restarted
        after.prefix_hits = 0.0;
        let a = EngineActivity::between(&before, &after).unwrap();
        assert_eq!(a.tokens_computed, 100);
        assert!(EngineActivity::between(&EngineCounters::default(), &after).is_none());
    }
}
