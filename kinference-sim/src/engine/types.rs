//! The values the engine core takes and gives: requests, their outputs and
//! records, KV events before their wire form, counters.

use crate::hash::Digest;
use crate::metrics::{
    Histogram, ITL_BUCKETS, REQUEST_BUCKETS, SGLANG_E2E_BUCKETS, SGLANG_ITL_BUCKETS,
    SGLANG_TTFT_BUCKETS, TTFT_BUCKETS,
};

use super::ReqId;

/// A KV event, before it is given its wire form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SimEvent {
    /// Full blocks cached, in prefix order.
    Stored {
        /// Their digests.
        digests: Vec<Digest>,
        /// Digest of the block before the first (`None`: sequence start).
        parent: Option<Digest>,
        /// Their token ids, concatenated.
        tokens: Vec<u32>,
        /// The LoRA adapter of the request that cached them (vLLM's
        /// integer id, 1-based); `None`: the base model.
        lora: Option<u32>,
        /// The session of the request that cached them.
        session: Option<std::sync::Arc<str>>,
    },
    /// One block evicted, with its parent's digest (SGLang mode groups a
    /// run of evictions along a chain into one radix node's event).
    Removed {
        /// Its digest.
        digest: Digest,
        /// The block before it, if any.
        parent: Option<Digest>,
    },
    /// The prefix cache was reset.
    Cleared,
}

/// Why a request stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// Its sampled length was reached before `max_tokens` (an EOS).
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
    /// Aborted (client gone, or a fault).
    Abort,
}

impl FinishReason {
    /// The OpenAI `finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// What a new request asks for.
#[derive(Clone, Debug, Default)]
pub struct NewRequest {
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// `max_tokens`, already checked against the context length.
    pub max_tokens: Option<usize>,
    /// `min_tokens`.
    pub min_tokens: usize,
    /// `ignore_eos`: always generate `max_tokens`.
    pub ignore_eos: bool,
    /// The request's `seed`.
    pub seed: Option<u64>,
    /// vLLM's `kv_cache_report_mode: "full"` (≥ 0.26): its prefix-cache hit
    /// is re-announced with a `BlockStored` (parent nil) at admission.
    pub report_full: bool,
    /// The LoRA adapter it runs as: vLLM's integer id, 1-based in
    /// [`crate::LoraConfig::modules`] order; `None`: the base model.
    pub lora: Option<u32>,
    /// The session it belongs to (the `x-session-id` header or the body's
    /// `session_id`), published on its stores where the engine mode does.
    pub session: Option<std::sync::Arc<str>>,
}

/// One request's progress, reported after a step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOut {
    /// The request.
    pub id: ReqId,
    /// The token it sampled in this step.
    pub token: u32,
    /// Set when the request finished in this step.
    pub finished: Option<Finished>,
}

/// A finished request's accounting.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Finished {
    /// Why it stopped.
    pub reason: FinishReason,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache at admission.
    pub cached_tokens: usize,
}

/// Timings of a finished request, in engine seconds.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct RequestRecord {
    /// Engine-local id.
    pub id: ReqId,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens that hit the cache at (first) admission.
    pub cached_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// `stop`, `length` or `abort`.
    pub finish_reason: &'static str,
    /// Arrival.
    pub arrival: f64,
    /// First admission into the running batch.
    pub scheduled: Option<f64>,
    /// End of the step that produced the first token.
    pub first_token: Option<f64>,
    /// End of the last step.
    pub finished: f64,
    /// Times it was preempted.
    pub preemptions: u32,
    /// Its LoRA adapter's integer id (`None`: the base model).
    pub lora_id: Option<u32>,
}

/// Counters and histograms of one core (what `/metrics` reports).
#[derive(Clone, Debug)]
pub struct CoreStats {
    /// Prompt tokens of requests that finished their prefill.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Prompt tokens looked up in the prefix cache at admission.
    pub prefix_cache_queries: u64,
    /// Of those, tokens found.
    pub prefix_cache_hits: u64,
    /// Requests preempted.
    pub preemptions: u64,
    /// Requests finished with `stop`.
    pub finished_stop: u64,
    /// Requests finished with `length`.
    pub finished_length: u64,
    /// Requests aborted.
    pub finished_abort: u64,
    /// Steps run.
    pub steps: u64,
    /// Simulated seconds spent in steps (before the slow-down fault).
    pub busy_seconds: f64,
    /// Blocks reported in `BlockStored` events as newly cached.
    pub blocks_stored: u64,
    /// Cached blocks re-announced in `BlockStored` events for
    /// `kv_cache_report_mode: "full"` requests (no new copy).
    pub blocks_rereported: u64,
    /// Blocks evicted (`BlockRemoved`).
    pub blocks_removed: u64,
    /// Successful prefix-cache resets.
    pub cache_resets: u64,
    /// LoRA adapters loaded into a GPU slot (each load made its step
    /// `lora_load_ms` longer).
    pub lora_loads: u64,
    /// Prefix-cache hit rate of the last step that admitted requests
    /// (SGLang's `cache_hit_rate` gauge: hit tokens / prompt tokens).
    pub last_hit_rate: f64,
    /// Tokens sampled per second in the last step (SGLang's
    /// `gen_throughput` gauge).
    pub gen_throughput: f64,
    /// Time to first token.
    pub ttft: Histogram,
    /// Gap between consecutive tokens of a request.
    pub itl: Histogram,
    /// Arrival to finish.
    pub e2e: Histogram,
    /// Arrival to first admission.
    pub queue: Histogram,
}

impl Default for CoreStats {
    fn default() -> Self {
        CoreStats {
            prompt_tokens: 0,
            generation_tokens: 0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            preemptions: 0,
            finished_stop: 0,
            finished_length: 0,
            finished_abort: 0,
            steps: 0,
            busy_seconds: 0.0,
            blocks_stored: 0,
            blocks_rereported: 0,
            blocks_removed: 0,
            cache_resets: 0,
            lora_loads: 0,
            last_hit_rate: 0.0,
            gen_throughput: 0.0,
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(REQUEST_BUCKETS),
            queue: Histogram::new(REQUEST_BUCKETS),
        }
    }
}

impl CoreStats {
    /// Counters with SGLang's histogram buckets (TTFT, ITL, e2e).
    pub fn sglang() -> Self {
        CoreStats {
            ttft: Histogram::new(SGLANG_TTFT_BUCKETS),
            itl: Histogram::new(SGLANG_ITL_BUCKETS),
            e2e: Histogram::new(SGLANG_E2E_BUCKETS),
            ..CoreStats::default()
        }
    }
}

/// The work of one step, between [`super::EngineCore::schedule`] and
/// [`super::EngineCore::finish_step`].
#[derive(Clone, Debug, PartialEq)]
pub struct Scheduled {
    /// `(request, tokens computed in this step)`, in batch order.
    pub entries: Vec<(ReqId, usize)>,
    /// Prompt (or recomputed) tokens in the step.
    pub prefill_tokens: usize,
    /// Sequences decoding one token.
    pub decode_seqs: usize,
    /// LoRA adapters loaded into a GPU slot for this step.
    pub lora_loads: usize,
    /// Step duration in seconds, from the latency model (plus
    /// `lora_load_ms` per adapter loaded).
    pub duration: f64,
}

/// Why a request was refused (vLLM's messages, HTTP 400).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// Empty prompt.
    #[error("The prompt cannot be empty.")]
    EmptyPrompt,
    /// A LoRA adapter id the core does not serve.
    #[error("The LoRA adapter with id {0} is not loaded.")]
    UnknownLora(u32),
    /// The prompt alone fills the context.
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, your request has {prompt} input tokens. Please reduce the length of the input messages."
    )]
    PromptTooLong {
        /// Context length.
        max_model_len: usize,
        /// Prompt tokens.
        prompt: usize,
    },
    /// Prompt plus `max_tokens` exceed the context.
    #[error(
        "'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context length is {max_model_len} tokens and your request has {prompt} input tokens ({max_tokens} > {max_model_len} - {prompt})."
    )]
    MaxTokensTooLarge {
        /// Context length.
        max_model_len: usize,
        /// Prompt tokens.
        prompt: usize,
        /// Requested output tokens.
        max_tokens: usize,
    },
}
