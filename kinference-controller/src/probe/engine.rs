//! What an engine says about itself over HTTP, read by pure functions:
//! where it publishes KV events (`GET /kv_event_sources`, vLLM ≥ 0.31) and
//! how busy it was (`GET /metrics`, vLLM's Prometheus names).
//!
//! The `/kv_event_sources` parser is kinference-kvindex's, shared with the
//! router.

use std::collections::BTreeSet;

use super::ProbeFailure;

pub use kinference_kvindex::KvSource;

/// Reads `/kv_event_sources` (see [`kinference_kvindex::parse_kv_event_sources`]).
///
/// # Errors
/// [`ProbeFailure::Body`] when the body is not a JSON object.
pub fn parse_kv_event_sources(body: &[u8]) -> Result<Vec<KvSource>, ProbeFailure> {
    kinference_kvindex::parse_kv_event_sources(body).map_err(ProbeFailure::Body)
}

/// Counters and gauges of an engine's `/metrics` that tell whether it served
/// requests, summed over the DP ranks read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineCounters {
    /// `vllm:num_requests_running`.
    pub running: f64,
    /// `vllm:num_requests_waiting`.
    pub waiting: f64,
    /// `vllm:request_success_total`, every `finished_reason`.
    pub finished: f64,
    /// `vllm:prompt_tokens_total`.
    pub prompt_tokens: f64,
    /// `vllm:generation_tokens_total`.
    pub generation_tokens: f64,
    /// `vllm:prefix_cache_queries_total` (tokens looked up).
    pub prefix_queries: f64,
    /// `vllm:prefix_cache_hits_total` (tokens found).
    pub prefix_hits: f64,
    /// `block_size` of `vllm:cache_config_info` (the engine's
    /// `--block-size`, which need not be the width of its events).
    pub block_size: Option<u32>,
    /// Whether any vLLM metric was read at all.
    pub seen: bool,
}

/// A sample's labels, in order.
type Labels<'a> = Vec<(&'a str, &'a str)>;

/// One sample line: name, labels, value.
fn sample(line: &str) -> Option<(&str, Labels<'_>, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(inner) = rest.strip_prefix('{') {
        // key="value" pairs; values may hold escaped quotes and braces.
        let mut s = inner;
        loop {
            s = s.trim_start_matches([',', ' ']);
            if let Some(after) = s.strip_prefix('}') {
                rest = after;
                break;
            }
            let (key, after_key) = s.split_once("=\"")?;
            let bytes = after_key.as_bytes();
            let mut i = 0;
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            let value = after_key.get(..i)?;
            labels.push((key.trim(), value));
            s = after_key.get(i + 1..)?;
        }
    }
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some((name, labels, value))
}

fn label<'a>(labels: &[(&str, &'a str)], key: &str) -> Option<&'a str> {
    labels.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
}

/// Reads the counters of vLLM's `/metrics` (Prometheus text), summed over
/// the DP ranks in `ranks` (the `engine` label; lines without it count
/// always), or over all ranks when `ranks` is `None`. Unknown lines are
/// ignored.
pub fn parse_engine_counters(text: &str, ranks: Option<&BTreeSet<u32>>) -> EngineCounters {
    let mut c = EngineCounters::default();
    for (name, labels, value) in text.lines().filter_map(sample) {
        if !name.starts_with("vllm:") {
            continue;
        }
        c.seen = true;
        if let (Some(ranks), Some(engine)) = (ranks, label(&labels, "engine"))
            && !engine.parse::<u32>().is_ok_and(|e| ranks.contains(&e))
        {
            continue;
        }
        match name {
            "vllm:num_requests_running" => c.running += value,
            "vllm:num_requests_waiting" => c.waiting += value,
            "vllm:request_success_total" => c.finished += value,
            "vllm:prompt_tokens_total" => c.prompt_tokens += value,
            "vllm:generation_tokens_total" => c.generation_tokens += value,
            "vllm:prefix_cache_queries_total" => c.prefix_queries += value,
            "vllm:prefix_cache_hits_total" => c.prefix_hits += value,
            "vllm:cache_config_info" => {
                if let Some(b) = label(&labels, "block_size").and_then(|b| b.parse().ok()) {
                    c.block_size = Some(b);
                }
            }
            _ => {}
        }
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

#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
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
    /// held no vLLM metric (not a vLLM-compatible engine).
    pub fn between(before: &EngineCounters, after: &EngineCounters) -> Option<EngineActivity> {
        if !(before.seen && after.seen) {
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

    #[test]
    fn kv_event_source_errors_are_body_failures() {
        assert!(matches!(
            parse_kv_event_sources(b"[]"),
            Err(ProbeFailure::Body(_))
        ));
        assert_eq!(parse_kv_event_sources(b"{}").unwrap(), []);
    }

    /// The lines vLLM 0.33 (and the simulator) print, two DP ranks.
    const METRICS: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3"} 2.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3"} 1.0
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3"} 4.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3"} 0.0
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3"} 500.0
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3"} 400.0
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3"} 0.0
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3"} 1000.0
vllm:prompt_tokens_total{engine="1",model_name="Qwen/Qwen3"} 500.0
vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen3"} 300.0
vllm:generation_tokens_total{engine="1",model_name="Qwen/Qwen3"} 100.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="Qwen/Qwen3"} 5.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="Qwen/Qwen3"} 2.0
vllm:request_success_total{engine="1",finished_reason="stop",model_name="Qwen/Qwen3"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3"} 0.0
vllm:cache_config_info{block_size="64",cache_dtype="auto",enable_prefix_caching="True",engine="0"} 1.0
python_gc_objects_collected_total{generation="0"} 1234.0
"#;

    #[test]
    fn counters_sum_the_ranks_asked_for() {
        assert_eq!(
            parse_engine_counters(METRICS, None),
            EngineCounters {
                running: 3.0,
                waiting: 4.0,
                finished: 8.0,
                prompt_tokens: 1500.0,
                generation_tokens: 400.0,
                prefix_queries: 1500.0,
                prefix_hits: 400.0,
                block_size: Some(64),
                seen: true,
            }
        );
        assert_eq!(
            parse_engine_counters(METRICS, Some(&BTreeSet::from([0]))),
            EngineCounters {
                running: 2.0,
                waiting: 4.0,
                finished: 7.0,
                prompt_tokens: 1000.0,
                generation_tokens: 300.0,
                prefix_queries: 1000.0,
                prefix_hits: 400.0,
                block_size: Some(64),
                seen: true,
            }
        );
        assert_eq!(
            parse_engine_counters("# nothing\nup 1\n", None),
            EngineCounters::default()
        );
    }

    #[test]
    fn labels_with_odd_values_and_timestamps() {
        let text = "vllm:num_requests_running{model_name=\"a \\\"b\\\" {c}\",engine=\"0\"} 7 1767225600000\n\
                    vllm:num_requests_waiting 2\n\
                    vllm:num_requests_running{engine=\"0\" 9\n";
        assert_eq!(
            parse_engine_counters(text, Some(&BTreeSet::from([0]))),
            EngineCounters {
                // The malformed last line is skipped; a line without an
                // engine label counts.
                running: 7.0,
                waiting: 2.0,
                seen: true,
                ..EngineCounters::default()
            }
        );
    }

    #[test]
    fn activity_between_two_readings() {
        let before = parse_engine_counters(METRICS, None);
        let mut after = before.clone();
        // Idle: nothing finished; 3 still running.
        let idle = EngineActivity::between(&before, &after).unwrap();
        assert_eq!(idle.requests, 3);
        assert_eq!(idle.tokens_computed, 0);
        assert_eq!(idle.engine_block_size, Some(64));
        // 2 finished, 600 tokens looked up of which 100 hit, 50 generated.
        after.finished += 2.0;
        after.running = 0.0;
        after.prefix_queries += 600.0;
        after.prefix_hits += 100.0;
        after.prompt_tokens += 600.0;
        after.generation_tokens += 50.0;
        let busy = EngineActivity::between(&before, &after).unwrap();
        assert_eq!((busy.requests, busy.tokens_computed), (2, 550));
        // Prefix caching off: no queries, prompt tokens count.
        let mut off = before.clone();
        off.prompt_tokens += 300.0;
        off.finished += 1.0;
        off.running = 0.0;
        let a = EngineActivity::between(&before, &off).unwrap();
        assert_eq!((a.requests, a.tokens_computed), (1, 300));
        // A restart between the readings: the new values count.
        let restarted = EngineCounters {
            finished: 1.0,
            prompt_tokens: 40.0,
            seen: true,
            ..EngineCounters::default()
        };
        let r = EngineActivity::between(&before, &restarted).unwrap();
        assert_eq!((r.requests, r.tokens_computed), (1, 40));
        // Not a vLLM engine.
        assert_eq!(
            EngineActivity::between(&EngineCounters::default(), &after),
            None
        );
    }
}
