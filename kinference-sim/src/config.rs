//! Configuration of a simulated engine: what it serves, how big its KV cache
//! is, how fast it runs, what it publishes.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use kinference_kvindex::codec::frames::ReplayLayout;

use crate::textgen::SimTokenizer;

/// The latency model: one engine step (one forward pass over the batch)
/// takes `base_ms + prefill_ms_per_token · P + decode_ms_per_seq · D`
/// milliseconds, where `P` is the number of prompt tokens computed in the
/// step (after prefix-cache hits, chunked by the token budget) and `D` the
/// number of sequences decoding one token.
///
/// # Calibration of the defaults
///
/// Fitted to a published vLLM run (<https://ai.wmx.dev/benchmarks>,
/// "serving/raw-vllm"): vLLM v0.23.0 (V1 engine), one NVIDIA L4,
/// Qwen/Qwen2.5-0.5B-Instruct BF16, `vllm bench serve` with 256 input and
/// 128 output tokens (`--ignore-eos`), closed loop at fixed concurrency.
/// Its table reports ITL p50 5.1 ms at concurrency 1 and 7.1 ms at 32, and
/// TTFT p50 27.0 ms at concurrency 1. Pure decode steps give
/// `a + c = 5.1` and `a + 32c = 7.1`, so `c ≈ 0.065 ms` and `a ≈ 5.0 ms`;
/// the unloaded TTFT is one step that prefills 256 tokens, so
/// `a + 256b = 27.0` and `b ≈ 0.086 ms/token` (≈ 11.7k prefill tokens/s;
/// the client-side TTFT also holds HTTP and tokenization time, so `b` is
/// slightly pessimistic). Set the three numbers to model another engine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatencyModel {
    /// `a`: fixed cost of a step, in ms.
    pub base_ms: f64,
    /// `b`: cost of one prompt token computed in a step, in ms.
    pub prefill_ms_per_token: f64,
    /// `c`: cost of one decoding sequence in a step, in ms.
    pub decode_ms_per_seq: f64,
}

impl Default for LatencyModel {
    fn default() -> Self {
        LatencyModel {
            base_ms: 5.0,
            prefill_ms_per_token: 0.086,
            decode_ms_per_seq: 0.065,
        }
    }
}

impl LatencyModel {
    /// Duration of a step in seconds.
    pub fn step_seconds(&self, prefill_tokens: usize, decode_seqs: usize) -> f64 {
        (self.base_ms
            + self.prefill_ms_per_token * prefill_tokens as f64
            + self.decode_ms_per_seq * decode_seqs as f64)
            / 1000.0
    }
}

/// How many tokens a request generates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OutputLen {
    /// Exactly `max_tokens` (`max_completion_tokens`), or `default` when the
    /// request sets neither; finish reason `length`. This is what a
    /// benchmark with `ignore_eos` measures.
    MaxTokens {
        /// Length for requests without `max_tokens`.
        default: usize,
    },
    /// A fixed length, capped by `max_tokens`.
    Fixed(usize),
    /// Uniform in `min..=max`, capped by `max_tokens`.
    Uniform {
        /// Smallest length.
        min: usize,
        /// Largest length.
        max: usize,
    },
    /// Geometric with the given mean (≥ 1), capped by `max_tokens`: what an
    /// EOS token with a constant per-token probability produces.
    Geometric {
        /// Mean length.
        mean: f64,
    },
}

impl Default for OutputLen {
    fn default() -> Self {
        OutputLen::MaxTokens { default: 128 }
    }
}

impl std::str::FromStr for OutputLen {
    type Err = String;

    /// `max-tokens[:DEFAULT]`, `fixed:N`, `uniform:MIN-MAX`, `geometric:MEAN`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, arg) = s.split_once(':').unwrap_or((s, ""));
        let num = |a: &str| {
            a.trim()
                .parse::<usize>()
                .map_err(|_| format!("`{a}` is not a token count"))
        };
        match kind {
            "max-tokens" if arg.is_empty() => Ok(OutputLen::default()),
            "max-tokens" => Ok(OutputLen::MaxTokens { default: num(arg)? }),
            "fixed" => Ok(OutputLen::Fixed(num(arg)?)),
            "uniform" => {
                let (lo, hi) = arg
                    .split_once('-')
                    .ok_or_else(|| "uniform needs MIN-MAX".to_owned())?;
                let (min, max) = (num(lo)?, num(hi)?);
                if min == 0 || min > max {
                    return Err("uniform needs 1 <= MIN <= MAX".to_owned());
                }
                Ok(OutputLen::Uniform { min, max })
            }
            "geometric" => {
                let mean: f64 = arg
                    .trim()
                    .parse()
                    .map_err(|_| format!("`{arg}` is not a mean"))?;
                if mean.is_finite() && mean >= 1.0 {
                    Ok(OutputLen::Geometric { mean })
                } else {
                    Err("geometric needs a mean >= 1".to_owned())
                }
            }
            _ => Err(format!(
                "unknown output length `{s}`: use max-tokens[:N], fixed:N, uniform:MIN-MAX or geometric:MEAN"
            )),
        }
    }
}

/// The scheduler and KV cache of one engine core (one DP rank).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block (`--block-size`); also the events' `block_size`.
    pub block_size: usize,
    /// KV capacity in blocks, including vLLM's reserved null block (so
    /// `num_gpu_blocks - 1` blocks hold tokens), as in `cache_config_info`.
    pub num_gpu_blocks: usize,
    /// Token budget of one step (`--max-num-batched-tokens`); prompts longer
    /// than the budget are prefilled in chunks.
    pub max_num_batched_tokens: usize,
    /// Most requests running at once (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Prefix caching on (vLLM's default). Off: no hits, no events.
    pub enable_prefix_caching: bool,
    /// Seed of NONE_HASH (`PYTHONHASHSEED`; default `"vllm-none-hash"`).
    pub hash_seed: String,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_gpu_blocks: 8192,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            enable_prefix_caching: true,
            hash_seed: crate::hash::DEFAULT_HASH_SEED.to_owned(),
        }
    }
}

/// Event encoding on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EventForm {
    /// vLLM ≥ 0.24: events are maps keyed by field name (default).
    #[default]
    Map,
    /// vLLM 0.22–0.23: positional arrays.
    Array,
}

/// How block hashes are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HashRepr {
    /// vLLM's default: the last 8 bytes of the digest as an unsigned int.
    #[default]
    Int,
    /// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: the 32 digest bytes.
    Bytes,
}

/// The KV-event publisher of each DP rank (vLLM's `--kv-events-config`).
#[derive(Clone, Debug, PartialEq)]
pub struct KvEventsConfig {
    /// Address the PUB (and replay ROUTER) sockets bind.
    pub host: IpAddr,
    /// PUB port of rank 0; rank r binds `port + r`. 0: an ephemeral port
    /// per rank.
    pub port: u16,
    /// Replay ROUTER port of rank 0 (rank r: `+ r`); `None`: no replay.
    /// `Some(0)`: ephemeral.
    pub replay_port: Option<u16>,
    /// Frame 0 of every message (vLLM's default is empty).
    pub topic: String,
    /// Map (default) or positional events.
    pub form: EventForm,
    /// Int (default) or bytes hashes.
    pub hash_repr: HashRepr,
    /// Replay reply layout: vLLM ≥ 0.26 `[topic, seq, payload]` (default)
    /// or the older `[seq, payload]`.
    pub replay_layout: ReplayLayout,
    /// Batches kept for replay (vLLM's `buffer_steps`, default 10000).
    pub buffer_steps: usize,
    /// A fixed batch timestamp instead of the wall clock (tests that compare
    /// payload bytes with the fixtures use `1767225600.0`).
    pub fixed_ts: Option<f64>,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 0,
            replay_port: Some(0),
            topic: String::new(),
            form: EventForm::Map,
            hash_repr: HashRepr::Int,
            replay_layout: ReplayLayout::TopicSeqPayload,
            buffer_steps: 10_000,
            fixed_ts: None,
        }
    }
}

/// Faults active from the start (the admin endpoint changes them later).
#[derive(Clone, Debug, PartialEq)]
pub struct FaultConfig {
    /// Multiplier on every step's duration (1.0 = calibrated speed).
    pub slowdown: f64,
    /// Drop every n-th published batch from the PUB socket (kept for
    /// replay), so subscribers see a sequence gap; 0 = never.
    pub drop_every: u64,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            slowdown: 1.0,
            drop_every: 0,
        }
    }
}

/// Everything one simulated engine (one HTTP server, `dp_size` engine
/// cores) needs. `SimConfig::default()` is a small, fast engine on
/// ephemeral loopback ports with the word-level tokenizer.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The served model name (`--served-model-name`; the card's `id`).
    pub model: String,
    /// More names answering for the same model (each gets a card).
    pub aliases: Vec<String>,
    /// The card's `root` (`--model`); `None`: the served name.
    pub root: Option<String>,
    /// Context length (prompt + output), `max_model_len`.
    pub max_model_len: usize,
    /// HTTP listen address; port 0 = ephemeral.
    pub http_addr: SocketAddr,
    /// Engine cores behind the HTTP server (`--data-parallel-size`).
    pub dp_size: u32,
    /// Scheduler and cache of each core.
    pub engine: EngineConfig,
    /// Step-time model.
    pub latency: LatencyModel,
    /// Output lengths.
    pub output: OutputLen,
    /// Seed of every random choice (output lengths and token ids).
    pub seed: u64,
    /// KV events; `None` = off.
    pub kv_events: Option<KvEventsConfig>,
    /// Tokenizer and output vocabulary; `None` = the word-level tokenizer
    /// of `kinference-tokenize` (cheap; shared process-wide).
    pub tokenizer: Option<Arc<SimTokenizer>>,
    /// Report `usage.prompt_tokens_details.cached_tokens`
    /// (`--enable-prompt-tokens-details`); off by default, as in vLLM.
    pub enable_prompt_tokens_details: bool,
    /// Faults from the start.
    pub faults: FaultConfig,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            model: "kinference/sim".to_owned(),
            aliases: Vec::new(),
            root: None,
            max_model_len: 32_768,
            http_addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            dp_size: 1,
            engine: EngineConfig::default(),
            latency: LatencyModel::default(),
            output: OutputLen::default(),
            seed: 0,
            kv_events: Some(KvEventsConfig::default()),
            tokenizer: None,
            enable_prompt_tokens_details: false,
            faults: FaultConfig::default(),
        }
    }
}

impl SimConfig {
    /// Checks the numbers that would make the engine misbehave.
    ///
    /// # Errors
    /// [`crate::SimError::Config`] naming the field.
    pub fn validate(&self) -> Result<(), crate::SimError> {
        let bad = |m: &str| Err(crate::SimError::Config(m.to_owned()));
        let e = &self.engine;
        if e.block_size == 0 {
            return bad("block_size must be positive");
        }
        if e.num_gpu_blocks < 2 {
            return bad("num_gpu_blocks must be at least 2 (one is vLLM's null block)");
        }
        if e.max_num_batched_tokens == 0 || e.max_num_seqs == 0 {
            return bad("max_num_batched_tokens and max_num_seqs must be positive");
        }
        if self.max_model_len < 2 {
            return bad("max_model_len must be at least 2");
        }
        if self.max_model_len.div_ceil(e.block_size) > e.num_gpu_blocks - 1 {
            return bad(
                "max_model_len is larger than the KV cache can hold: raise num_gpu_blocks or lower max_model_len",
            );
        }
        if self.dp_size == 0 {
            return bad("dp_size must be at least 1");
        }
        let l = &self.latency;
        if ![l.base_ms, l.prefill_ms_per_token, l.decode_ms_per_seq]
            .iter()
            .all(|x| x.is_finite() && *x >= 0.0)
        {
            return bad("latency parameters must be finite and non-negative");
        }
        if !(self.faults.slowdown.is_finite() && self.faults.slowdown > 0.0) {
            return bad("slowdown must be positive");
        }
        if self.model.is_empty() {
            return bad("model name must not be empty");
        }
        if let Some(kv) = &self.kv_events
            && kv.buffer_steps == 0
        {
            return bad("buffer_steps must be positive");
        }
        Ok(())
    }

    /// All names the engine answers to: the served name, then the aliases.
    pub fn served_names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.model.as_str()).chain(self.aliases.iter().map(String::as_str))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_len_parses() {
        assert_eq!(
            "max-tokens".parse(),
            Ok(OutputLen::MaxTokens { default: 128 })
        );
        assert_eq!(
            "max-tokens:7".parse(),
            Ok(OutputLen::MaxTokens { default: 7 })
        );
        assert_eq!("fixed:3".parse(), Ok(OutputLen::Fixed(3)));
        assert_eq!(
            "uniform:2-9".parse(),
            Ok(OutputLen::Uniform { min: 2, max: 9 })
        );
        assert_eq!(
            "geometric:50".parse(),
            Ok(OutputLen::Geometric { mean: 50.0 })
        );
        assert!("uniform:9-2".parse::<OutputLen>().is_err());
        assert!("geometric:0.5".parse::<OutputLen>().is_err());
        assert!("poisson:3".parse::<OutputLen>().is_err());
    }

    #[test]
    fn calibrated_step_times() {
        let l = LatencyModel::default();
        // The published points the defaults were fitted to (ms).
        assert!((l.step_seconds(0, 1) * 1e3 - 5.1).abs() < 0.05);
        assert!((l.step_seconds(0, 32) * 1e3 - 7.1).abs() < 0.05);
        assert!((l.step_seconds(256, 0) * 1e3 - 27.0).abs() < 0.1);
    }

    #[test]
    fn validation_names_the_problem() {
        let mut c = SimConfig::default();
        assert!(c.validate().is_ok());
        c.engine.num_gpu_blocks = 1;
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("num_gpu_blocks")
        );
    }
}
