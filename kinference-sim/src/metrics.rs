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

/// SGLang's buckets for `sglang:time_to_first_token_seconds`.
pub(crate) const SGLANG_TTFT_BUCKETS: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0,
];
/// SGLang's buckets for `sglang:inter_token_latency_seconds`.
pub(crate) const SGLANG_ITL_BUCKETS: &[f64] = &[
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
    0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
];
/// SGLang's buckets for `sglang:e2e_request_latency_seconds`.
pub(crate) const SGLANG_E2E_BUCKETS: &[f64] = &[
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0,
    400.0, 800.0,
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

    /// Adds another histogram with the same bounds.
    fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.sum += other.sum;
        self.count += other.count;
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
    /// Tokens the blocks in use can hold (SGLang's `num_used_tokens`).
    pub(crate) used_tokens: usize,
    pub(crate) stats: &'a crate::engine::CoreStats,
}

/// `vllm:admission_rejections_total` by reason (no `engine` label: the
/// API server counts them before any engine core sees the request).
#[derive(Debug, Default)]
pub(crate) struct Rejections {
    /// Refused by `--max-num-queued-reqs`.
    pub(crate) max_num_queued_reqs: std::sync::atomic::AtomicU64,
    /// Refused by `--max-num-queued-tokens`.
    pub(crate) max_num_queued_tokens: std::sync::atomic::AtomicU64,
}

impl Rejections {
    pub(crate) fn render(&self, out: &mut String, model: &str) {
        use std::sync::atomic::Ordering::Relaxed;
        let model = escape(model);
        let _ = writeln!(
            out,
            "# HELP vllm:admission_rejections_total Requests rejected by admission control.\n# TYPE vllm:admission_rejections_total counter"
        );
        for (reason, n) in [
            ("max_num_queued_reqs", &self.max_num_queued_reqs),
            ("max_num_queued_tokens", &self.max_num_queued_tokens),
        ] {
            let _ = writeln!(
                out,
                "vllm:admission_rejections_total{{model_name=\"{model}\",reason=\"{reason}\"}} {}.0",
                n.load(Relaxed)
            );
        }
    }
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

/// vLLM's `vllm:lora_requests_info` (only with adapters configured): a
/// gauge whose labels name the adapters of the running and waiting requests
/// (comma-separated, each once) and `max_lora`, set to the Unix time of the
/// update (`set_to_current_time`), labels in vLLM's declaration order. The
/// Prometheus client keeps every label combination ever set, each with the
/// time it was last set, so earlier states linger in the output beside the
/// current one; readers take the series with the largest value.
#[derive(Debug, Default)]
pub(crate) struct LoraSeries {
    /// `(running, waiting, time last set)`, in first-set order.
    series: std::sync::Mutex<Vec<(String, String, f64)>>,
}

impl LoraSeries {
    /// The most label combinations kept (the oldest-set go first): vLLM
    /// keeps all; this bounds a long-running simulator's output.
    const KEEP: usize = 64;

    /// Sets the current combination to `now` and renders every series.
    pub(crate) fn render(
        &self,
        out: &mut String,
        running: &[&str],
        waiting: &[&str],
        max_lora: usize,
        now: f64,
    ) {
        let (running, waiting) = (running.join(","), waiting.join(","));
        let mut series = self
            .series
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(s) = series
            .iter_mut()
            .find(|(r, w, _)| *r == running && *w == waiting)
        {
            s.2 = now;
        } else {
            if series.len() == Self::KEEP
                && let Some(oldest) = series
                    .iter()
                    .enumerate()
                    .min_by(|a, b| a.1.2.total_cmp(&b.1.2))
                    .map(|(i, _)| i)
            {
                series.remove(oldest);
            }
            series.push((running, waiting, now));
        }
        let _ = writeln!(
            out,
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge"
        );
        for (running, waiting, at) in series.iter() {
            let _ = writeln!(
                out,
                "vllm:lora_requests_info{{max_lora=\"{max_lora}\",waiting_lora_adapters=\"{}\",running_lora_adapters=\"{}\"}} {at:?}",
                escape(waiting),
                escape(running),
            );
        }
    }
}

/// Renders SGLang's `/metrics`: per scheduler (DP rank) gauges labelled as
/// SGLang labels them (`model_name`, `engine_type`, `tp_rank`, `pp_rank`,
/// `moe_ep_rank`, and `dp_rank` when there are DP ranks), then the
/// tokenizer manager's counters and histograms summed over the ranks
/// (label `model_name`).
pub(crate) fn render_sglang(model: &str, with_dp: bool, ranks: &[RankMetrics<'_>]) -> String {
    let mut out = String::with_capacity(8192);
    let model = escape(model);
    let lbl = |r: &RankMetrics<'_>| {
        let mut l = format!(
            "model_name=\"{model}\",engine_type=\"unified\",tp_rank=\"0\",pp_rank=\"0\",moe_ep_rank=\"0\""
        );
        if with_dp {
            let _ = write!(l, ",dp_rank=\"{}\"", r.rank);
        }
        l
    };
    let gauge = |out: &mut String, name: &str, help: &str, f: &dyn Fn(&RankMetrics<'_>) -> f64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for r in ranks {
            let _ = writeln!(out, "{name}{{{}}} {:?}", lbl(r), f(r));
        }
    };
    gauge(
        &mut out,
        "sglang:num_running_reqs",
        "The number of running requests.",
        &|r| r.running as f64,
    );
    gauge(
        &mut out,
        "sglang:num_used_tokens",
        "The number of used tokens.",
        &|r| r.used_tokens as f64,
    );
    gauge(&mut out, "sglang:token_usage", "The token usage.", &|r| {
        r.usage
    });
    gauge(
        &mut out,
        "sglang:gen_throughput",
        "The generation throughput (token/s).",
        &|r| r.stats.gen_throughput,
    );
    gauge(
        &mut out,
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue.",
        &|r| r.waiting as f64,
    );
    gauge(
        &mut out,
        "sglang:cache_hit_rate",
        "The prefix cache hit rate.",
        &|r| r.stats.last_hit_rate,
    );

    let tok = format!("model_name=\"{model}\"");
    let sum = |f: &dyn Fn(&crate::engine::CoreStats) -> u64| -> u64 {
        ranks.iter().map(|r| f(r.stats)).sum()
    };
    for (name, help, v) in [
        (
            "sglang:prompt_tokens_total",
            "Number of prefill tokens processed.",
            sum(&|s| s.prompt_tokens),
        ),
        (
            "sglang:generation_tokens_total",
            "Number of generation tokens processed.",
            sum(&|s| s.generation_tokens),
        ),
        (
            "sglang:cached_tokens_total",
            "Number of cached prompt tokens.",
            sum(&|s| s.prefix_cache_hits),
        ),
        (
            "sglang:num_requests_total",
            "Number of requests processed.",
            sum(&|s| s.finished_stop + s.finished_length + s.finished_abort),
        ),
    ] {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{tok}}} {v}.0"
        );
    }
    for (name, help, pick) in [
        (
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            (|s: &crate::engine::CoreStats| &s.ttft) as fn(&crate::engine::CoreStats) -> &Histogram,
        ),
        (
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            |s| &s.itl,
        ),
        (
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            |s| &s.e2e,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut merged: Option<Histogram> = None;
        for r in ranks {
            let h = pick(r.stats);
            match &mut merged {
                None => merged = Some(h.clone()),
                Some(m) => m.merge(h),
            }
        }
        if let Some(m) = merged {
            m.render(&mut out, name, &tok);
        }
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

    #[test]
    fn lora_info_lists_adapters_once_with_the_time_and_keeps_earlier_states() {
        let lora = LoraSeries::default();
        let mut s = String::new();
        lora.render(&mut s, &["a", "b"], &[], 2, 1_767_225_600.5);
        assert!(s.contains("# TYPE vllm:lora_requests_info gauge"));
        assert!(s.contains(
            "vllm:lora_requests_info{max_lora=\"2\",waiting_lora_adapters=\"\",running_lora_adapters=\"a,b\"} 1767225600.5\n"
        ));
        // A later state is a new series; the earlier one stays with its time.
        let mut s = String::new();
        lora.render(&mut s, &["a"], &["c"], 2, 1_767_225_601.5);
        let lines: Vec<&str> = s.lines().filter(|l| l.starts_with("vllm:")).collect();
        assert_eq!(
            lines,
            [
                "vllm:lora_requests_info{max_lora=\"2\",waiting_lora_adapters=\"\",running_lora_adapters=\"a,b\"} 1767225600.5",
                "vllm:lora_requests_info{max_lora=\"2\",waiting_lora_adapters=\"c\",running_lora_adapters=\"a\"} 1767225601.5",
            ]
        );
        // Back to the first state: its series is set again, not repeated.
        let mut s = String::new();
        lora.render(&mut s, &["a", "b"], &[], 2, 1_767_225_602.5);
        assert_eq!(s.matches("vllm:lora_requests_info{").count(), 2);
        assert!(s.contains("running_lora_adapters=\"a,b\"} 1767225602.5"));
        // Bounded.
        for i in 0..100 {
            let name = format!("x{i}");
            lora.render(
                &mut String::new(),
                &[&name],
                &[],
                2,
                1_767_225_700.0 + f64::from(i),
            );
        }
        let mut s = String::new();
        lora.render(&mut s, &["last"], &[], 2, 1_767_226_000.0);
        assert_eq!(
            s.matches("vllm:lora_requests_info{").count(),
            LoraSeries::KEEP
        );
        assert!(s.contains("running_lora_adapters=\"last\"} 1767226000.0"));
    }
}
