//! `/metrics` in Prometheus text format with vLLM's metric names and labels
//! (`shared/specs/vllm-http.md` §3). Written by hand: every engine renders
//! its own few dozen lines, and the names contain vLLM's `:`.

use std::fmt::Write as _;

/// A cumulative histogram with fixed upper bounds (seconds).
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

/// vLLM's buckets for `vllm:time_to_first_token_seconds`.
pub(crate) const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for request-level latencies (e2e, queue time).
pub(crate) const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM's buckets for `vllm:inter_token_latency_seconds`.
pub(crate) const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

impl Histogram {
    pub(crate) fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, v: f64) {
        let at = self.bounds.partition_point(|b| *b < v);
        if let Some(c) = self.counts.get_mut(at) {
            *c += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of observations.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b:?}\"}} {cumulative}.0");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels},le=\"+Inf\"}} {}.0",
            self.count
        );
        let _ = writeln!(out, "{name}_count{{{labels}}} {}.0", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {:?}", self.sum);
    }
}

/// What one engine core (DP rank) reports.
#[derive(Clone, Debug)]
pub(crate) struct RankMetrics<'a> {
    pub(crate) rank: u32,
    pub(crate) running: usize,
    pub(crate) waiting: usize,
    pub(crate) usage: f64,
    pub(crate) stats: &'a crate::engine::CoreStats,
}

/// Renders the whole `/metrics` page.
pub(crate) fn render(
    model: &str,
    cache_info: &[(&str, String)],
    ranks: &[RankMetrics<'_>],
) -> String {
    let mut out = String::with_capacity(8192);
    let model = escape(model);
    let lbl = |r: &RankMetrics<'_>| format!("engine=\"{}\",model_name=\"{model}\"", r.rank);

    let gauge =
        |out: &mut String, name: &str, help: &str, f: &dyn Fn(&RankMetrics<'_>) -> String| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for r in ranks {
                let _ = writeln!(out, "{name}{{{}}} {}", lbl(r), f(r));
            }
        };
    gauge(
        &mut out,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        &|r| format!("{:?}", r.running as f64),
    );
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        &|r| format!("{:?}", r.waiting as f64),
    );
    let _ = writeln!(
        out,
        "# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.\n# TYPE vllm:num_requests_waiting_by_reason gauge"
    );
    for r in ranks {
        let _ = writeln!(
            out,
            "vllm:num_requests_waiting_by_reason{{{},reason=\"capacity\"}} {:?}",
            lbl(r),
            r.waiting as f64
        );
        let _ = writeln!(
            out,
            "vllm:num_requests_waiting_by_reason{{{},reason=\"deferred\"}} 0.0",
            lbl(r)
        );
    }
    gauge(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        &|r| format!("{:?}", r.usage),
    );
    let _ = writeln!(
        out,
        "# HELP vllm:engine_sleep_state Engine sleep state.\n# TYPE vllm:engine_sleep_state gauge"
    );
    for r in ranks {
        for (state, v) in [("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)] {
            let _ = writeln!(
                out,
                "vllm:engine_sleep_state{{{},sleep_state=\"{state}\"}} {v}.0",
                lbl(r)
            );
        }
    }

    let counter =
        |out: &mut String, name: &str, help: &str, f: &dyn Fn(&RankMetrics<'_>) -> u64| {
            let _ = writeln!(
                out,
                "# HELP {name}_total {help}\n# TYPE {name}_total counter"
            );
            for r in ranks {
                let _ = writeln!(out, "{name}_total{{{}}} {}.0", lbl(r), f(r));
            }
        };
    counter(
        &mut out,
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        &|r| r.stats.prefix_cache_queries,
    );
    counter(
        &mut out,
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        &|r| r.stats.prefix_cache_hits,
    );
    counter(
        &mut out,
        "vllm:num_preemptions",
        "Cumulative number of preemptions from the engine.",
        &|r| r.stats.preemptions,
    );
    counter(
        &mut out,
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        &|r| r.stats.prompt_tokens,
    );
    counter(
        &mut out,
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        &|r| r.stats.generation_tokens,
    );
    let _ = writeln!(
        out,
        "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter"
    );
    for r in ranks {
        for (reason, v) in [
            ("stop", r.stats.finished_stop),
            ("length", r.stats.finished_length),
            ("abort", r.stats.finished_abort),
        ] {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{},finished_reason=\"{reason}\"}} {v}.0",
                lbl(r)
            );
        }
    }

    let hist = |out: &mut String,
                name: &str,
                help: &str,
                f: &dyn for<'r> Fn(&'r RankMetrics<'_>) -> &'r Histogram| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for r in ranks {
            f(r).render(out, name, &lbl(r));
        }
    };
    hist(
        &mut out,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &|r| &r.stats.ttft,
    );
    hist(
        &mut out,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &|r| &r.stats.itl,
    );
    hist(
        &mut out,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &|r| &r.stats.e2e,
    );
    hist(
        &mut out,
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        &|r| &r.stats.queue,
    );

    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge"
    );
    for r in ranks {
        let mut labels = String::new();
        for (k, v) in cache_info {
            let _ = write!(labels, "{k}=\"{}\",", escape(v));
        }
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{{labels}engine=\"{}\"}} 1.0",
            r.rank
        );
    }
    out
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(TTFT_BUCKETS);
        h.observe(0.003);
        h.observe(0.003);
        h.observe(100.0);
        let mut s = String::new();
        h.render(&mut s, "x", "a=\"b\"");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.001\"} 0.0"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.005\"} 2.0"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"160.0\"} 3.0"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3.0"));
        assert!(s.contains("x_count{a=\"b\"} 3.0"));
    }
}
