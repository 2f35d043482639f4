//! What an engine says about itself over HTTP, read by kinference-api's
//! shared parsers ([`kinference_api::engine`], the router reads the same
//! ones): where it publishes KV events (`GET /kv_event_sources`, vLLM ≥
//! 0.31) and how busy it was (`GET /metrics`, vLLM's and SGLang's names).
//! This module maps their errors to [`ProbeFailure`].

use std::collections::BTreeSet;

use kinference_api::engine;

use super::ProbeFailure;

pub use kinference_api::engine::{EngineActivity, EngineCounters, KvSource, ModelCard};

/// Reads `/kv_event_sources`.
///
/// # Errors
/// [`ProbeFailure::Body`] when the body is not a JSON object.
pub fn parse_kv_event_sources(body: &[u8]) -> Result<Vec<KvSource>, ProbeFailure> {
    engine::parse_kv_event_sources(body).map_err(|e| ProbeFailure::Body(e.to_string()))
}

/// Reads an OpenAI model list (`{"object": "list", "data": [...]}`).
///
/// # Errors
/// [`ProbeFailure::Body`] when `body` is not one.
pub fn parse_models(body: &[u8]) -> Result<Vec<ModelCard>, ProbeFailure> {
    engine::parse_models(body).map_err(|e| ProbeFailure::Body(e.to_string()))
}

/// Reads the counters of an engine's `/metrics` (vLLM or SGLang names),
/// summed over the DP ranks in `ranks` (all when `None`).
pub fn parse_engine_counters(text: &str, ranks: Option<&BTreeSet<u32>>) -> EngineCounters {
    engine::parse_counters(text, ranks)
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
                family: kinference_api::engine::EngineFamily::Vllm,
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
                family: kinference_api::engine::EngineFamily::Vllm,
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
                family: kinference_api::engine::EngineFamily::Vllm,
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
            family: kinference_api::engine::EngineFamily::Vllm,
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
