//! Configuration of a simulated engine: what it serves, how big its KV cache
//! is, how fast it runs, what it publishes.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;

use crate::mode::{ApiKeyScope, EngineMode};
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
    /// Seed of vLLM's NONE_HASH (`PYTHONHASHSEED`). SGLang's page chain
    /// has no seed and accepts only [`HashSeed::EngineDefault`].
    pub hash_seed: HashSeed,
}

/// Where vLLM's NONE_HASH (the virtual parent of every first block) comes
/// from, and so whether two engines agree on block hashes.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum HashSeed {
    /// What the release does without `PYTHONHASHSEED`: vLLM ≥ 0.29 hashes
    /// `"vllm-none-hash"` (every pod agrees), older releases draw a random
    /// NONE_HASH per engine core (pods disagree).
    #[default]
    EngineDefault,
    /// `PYTHONHASHSEED=<seed>`: NONE_HASH = H(seed), the same on every pod
    /// configured alike.
    Fixed(String),
    /// A random NONE_HASH per engine core (`PYTHONHASHSEED=random`, or any
    /// release before 0.29 without the variable): the same tokens get
    /// different block hashes on every engine.
    Random,
}

impl std::str::FromStr for HashSeed {
    type Err = String;

    /// `random`, `default`, or a literal seed.
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "random" => HashSeed::Random,
            "default" | "" => HashSeed::EngineDefault,
            other => HashSeed::Fixed(other.to_owned()),
        })
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_gpu_blocks: 8192,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            enable_prefix_caching: true,
            hash_seed: HashSeed::EngineDefault,
        }
    }
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

/// The KV-event publisher of each DP rank (vLLM's and SGLang's
/// `--kv-events-config`). The encoding and the replay reply layout follow
/// the engine mode ([`SimConfig::engine_mode`]).
#[derive(Clone, Debug, PartialEq)]
pub struct KvEventsConfig {
    /// Address the PUB (and replay ROUTER) sockets bind.
    pub host: IpAddr,
    /// PUB port of rank 0; rank r binds `port + r`. 0: an ephemeral port
    /// per rank.
    pub port: u16,
    /// Replay ROUTER port of rank 0 (rank r: `+ r`); `None` (the default,
    /// as vLLM's and SGLang's `replay_endpoint` is unset unless
    /// configured): no replay socket. `Some(0)`: ephemeral.
    pub replay_port: Option<u16>,
    /// Frame 0 of every message (vLLM's default is empty).
    pub topic: String,
    /// Int (default) or bytes hashes (vLLM only).
    pub hash_repr: HashRepr,
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
            replay_port: None,
            topic: String::new(),
            hash_repr: HashRepr::Int,
            buffer_steps: 10_000,
            fixed_ts: None,
        }
    }
}

impl KvEventsConfig {
    /// The same publisher with a replay ROUTER on `port` for rank 0 (0:
    /// ephemeral), as `"replay_endpoint": "tcp://*:PORT"` configures.
    #[must_use]
    pub fn with_replay(mut self, port: u16) -> Self {
        self.replay_port = Some(port);
        self
    }

    /// The same publisher without a replay socket (the engines' default).
    #[must_use]
    pub fn without_replay(mut self) -> Self {
        self.replay_port = None;
        self
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
    /// How inference requests fail ([`FailMode::None`]: they do not).
    pub fail_requests: FailMode,
    /// The fraction of inference requests that fail while `fail_requests`
    /// is set, in (0, 1]; exact over every run of requests (request i fails
    /// when `floor((i+1)·f) > floor(i·f)`), not random.
    pub fail_fraction: f64,
    /// Delay before every `/metrics` answer, ms (a slow scrape).
    pub metrics_delay_ms: u64,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            slowdown: 1.0,
            drop_every: 0,
            fail_requests: FailMode::None,
            fail_fraction: 1.0,
            metrics_delay_ms: 0,
        }
    }
}

/// How failing inference requests (`/v1/completions`,
/// `/v1/chat/completions`) are answered; every other endpoint stays fine
/// unless the mode says otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailMode {
    /// No failure.
    #[default]
    None,
    /// A CUDA fault on the GPU surfacing in each request: HTTP 500 with the
    /// engine's error body and PyTorch's CUDA message (streaming requests:
    /// 200, then one `data: {"error": …}` event and `data: [DONE]`, as the
    /// engines' stream generators answer). `/health`, `/v1/models` and
    /// `/metrics` stay fine.
    CudaError,
    /// vLLM's engine core died (`EngineDeadError`): HTTP 500 with an empty
    /// body, and `/health` answers 503.
    EngineDead,
    /// vLLM's admission control (≥ 0.29) refusing the request: HTTP 503
    /// with its body, counted in `vllm:admission_rejections_total`
    /// (streaming requests too: the check runs before the stream opens).
    AdmissionReject,
}

impl std::str::FromStr for FailMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.replace('-', "_").as_str() {
            "none" => Ok(FailMode::None),
            "cuda_error" => Ok(FailMode::CudaError),
            "engine_dead" => Ok(FailMode::EngineDead),
            "admission_reject" => Ok(FailMode::AdmissionReject),
            _ => Err(format!(
                "unknown failure `{s}`: use none, cuda-error, engine-dead or admission-reject"
            )),
        }
    }
}

/// vLLM's admission control (`--max-num-queued-reqs`,
/// `--max-num-queued-tokens`, vLLM ≥ 0.29): requests beyond a limit are
/// refused with 503 before they reach an engine core.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AdmissionLimits {
    /// Most requests in flight (waiting + running, over every DP rank; a
    /// request with `n` choices takes `n`).
    pub max_num_queued_reqs: Option<usize>,
    /// Most prompt tokens of requests still in their prefill.
    pub max_num_queued_tokens: Option<usize>,
}

/// One LoRA adapter served next to the base model, as vLLM's
/// `--lora-modules name=path` loads it at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraModule {
    /// What clients send as `model`: the adapter card's `id`, the
    /// `lora_name` of its blocks' `BlockStored` events.
    pub name: String,
    /// Where the adapter lives: the card's `root`; from vLLM 0.31 also part
    /// of its blocks' hashes (the tagged extra key `("lora", name, path)`).
    pub path: String,
}

impl LoraModule {
    /// An adapter `name` at `path`.
    pub fn new(name: impl Into<String>, path: impl Into<String>) -> Self {
        LoraModule {
            name: name.into(),
            path: path.into(),
        }
    }

    /// An adapter given by name only: its path is `/adapters/<name>`.
    pub fn named(name: impl Into<String>) -> Self {
        let name = name.into();
        let path = format!("/adapters/{name}");
        LoraModule { name, path }
    }
}

impl std::str::FromStr for LoraModule {
    type Err = String;

    /// `name=path`, or a bare `name` (path `/adapters/<name>`).
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let m = match s.split_once('=') {
            Some((name, path)) => LoraModule::new(name.trim(), path.trim()),
            None => LoraModule::named(s),
        };
        if m.name.is_empty() {
            return Err(format!(
                "`{s}` names no LoRA adapter: use name=path or a bare name"
            ));
        }
        if m.path.is_empty() {
            return Err(format!(
                "LoRA adapter `{}` has an empty path: use name=path or a bare name",
                m.name
            ));
        }
        Ok(m)
    }
}

/// LoRA adapters (vLLM's `--lora-modules`, `--max-loras`): requests whose
/// `model` is an adapter's name run as that adapter, with a prefix cache
/// of their own, at most `max_loras` distinct adapters per running batch.
/// None by default.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// The adapters, in `--lora-modules` order; adapter i (from 0) has
    /// vLLM's integer id `i + 1` (the events' `lora_id`).
    pub modules: Vec<LoraModule>,
    /// `--max-loras`: distinct adapters one running batch may hold, and the
    /// GPU slots they are loaded into (vLLM's default 1). Base-model
    /// requests never count.
    pub max_loras: usize,
    /// Time a step spends loading each adapter that is not in one of the
    /// `max_loras` GPU slots (least recently used slot evicted), ms.
    pub load_ms: f64,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            modules: Vec::new(),
            max_loras: 1,
            load_ms: 25.0,
        }
    }
}

impl LoraConfig {
    /// Whether any adapter is served.
    pub fn enabled(&self) -> bool {
        !self.modules.is_empty()
    }

    /// vLLM's integer id of the adapter `name` (1-based, in
    /// [`LoraConfig::modules`] order).
    pub fn id_of(&self, name: &str) -> Option<u32> {
        self.modules
            .iter()
            .position(|m| m.name == name)
            .map(|i| i as u32 + 1)
    }

    /// The adapter with integer id `id`.
    pub fn module(&self, id: u32) -> Option<&LoraModule> {
        self.modules.get((id as usize).checked_sub(1)?)
    }
}

/// Everything one simulated engine (one HTTP server, `dp_size` engine
/// cores) needs. `SimConfig::default()` is a small, fast vLLM 0.33 engine
/// on ephemeral loopback ports with the word-level tokenizer, publishing KV
/// events on an ephemeral port without a replay socket (vLLM's default).
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// The engine family and release imitated (default vLLM 0.33.0).
    pub engine_mode: EngineMode,
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
    /// Keep Responses API answers for `GET /v1/responses/{id}`, `/cancel`
    /// and `previous_response_id`, as vLLM does with
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1` (off by default, as in vLLM:
    /// `store` is then ignored and nothing is kept).
    pub responses_store: bool,
    /// Faults from the start.
    pub faults: FaultConfig,
    /// `--api-key`: requests to guarded paths need
    /// `Authorization: Bearer <key>` (401 otherwise).
    pub api_key: Option<String>,
    /// Which paths the key guards.
    pub api_key_scope: ApiKeyScope,
    /// vLLM's admission control; none by default, as in vLLM.
    pub admission: AdmissionLimits,
    /// LoRA adapters served next to the base model; none by default.
    pub lora: LoraConfig,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            engine_mode: EngineMode::default(),
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
            responses_store: false,
            faults: FaultConfig::default(),
            api_key: None,
            api_key_scope: ApiKeyScope::EngineDefault,
            admission: AdmissionLimits::default(),
            lora: LoraConfig::default(),
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
        self.engine_mode.check().map_err(crate::SimError::Config)?;
        self.validate_mode()?;
        let f = &self.faults;
        if !(f.fail_fraction.is_finite() && f.fail_fraction > 0.0 && f.fail_fraction <= 1.0) {
            return bad("fail_fraction must be in (0, 1]");
        }
        if self.api_key.as_deref() == Some("") {
            return bad("api_key must not be empty");
        }
        self.validate_lora()
    }

    /// The adapters: named, distinct, not named like the base model.
    fn validate_lora(&self) -> Result<(), crate::SimError> {
        let bad = |m: String| Err(crate::SimError::Config(m));
        let l = &self.lora;
        if l.max_loras == 0 {
            return bad("max_loras must be at least 1".to_owned());
        }
        if !(l.load_ms.is_finite() && l.load_ms >= 0.0) {
            return bad("lora_load_ms must be finite and non-negative".to_owned());
        }
        for (i, m) in l.modules.iter().enumerate() {
            if m.name.trim().is_empty() {
                return bad(format!("LoRA adapter {} has an empty name", i + 1));
            }
            if m.name.contains(',') {
                return bad(format!(
                    "LoRA adapter name `{}` contains a comma (vllm:lora_requests_info lists adapters comma-separated)",
                    m.name
                ));
            }
            if m.path.trim().is_empty() {
                return bad(format!("LoRA adapter `{}` has an empty path", m.name));
            }
            if l.modules[..i].iter().any(|o| o.name == m.name) {
                return bad(format!(
                    "LoRA adapter `{}` is listed twice in lora_modules",
                    m.name
                ));
            }
            if self.served_names().any(|n| n == m.name) {
                return bad(format!(
                    "LoRA adapter `{}` has the name the base model is served as; give the adapter another name",
                    m.name
                ));
            }
        }
        Ok(())
    }

    /// The settings a family or release does not have.
    fn validate_mode(&self) -> Result<(), crate::SimError> {
        let mode = self.engine_mode;
        let bad = |m: String| Err(crate::SimError::Config(m));
        if mode.is_sglang() {
            if self.engine.hash_seed != HashSeed::EngineDefault {
                return bad(format!(
                    "{mode} has no hash seed: its page hashes are unseeded (PYTHONHASHSEED is vLLM's)"
                ));
            }
            if self
                .kv_events
                .as_ref()
                .is_some_and(|kv| kv.hash_repr == HashRepr::Bytes)
            {
                return bad(format!("{mode} always publishes integer hashes"));
            }
            if self.api_key_scope != ApiKeyScope::EngineDefault {
                return bad(format!(
                    "{mode} has one api key rule; the scope setting is vLLM's"
                ));
            }
        }
        if self.lora.enabled() && !mode.serves_lora() {
            return bad(format!(
                "{mode} cannot serve LoRA adapters in the simulator: SGLang loads them with --lora-paths, its events carry no lora_id, and how it namespaces an adapter's page hashes is not pinned down (shared/specs/kv-events.md §4.6); use a vLLM mode (--engine vllm[:VERSION]) with --lora-modules"
            ));
        }
        let limits = self.admission.max_num_queued_reqs.is_some()
            || self.admission.max_num_queued_tokens.is_some();
        if (limits || self.faults.fail_requests == FailMode::AdmissionReject)
            && !mode.has_admission_control()
        {
            return bad(format!(
                "{mode} has no admission control (vLLM 0.29 added --max-num-queued-reqs)"
            ));
        }
        if self.faults.fail_requests == FailMode::EngineDead && !mode.is_vllm() {
            return bad(format!(
                "engine_dead models vLLM's EngineDeadError, not {mode}"
            ));
        }
        Ok(())
    }

    /// All names the engine answers to: the served name, then the aliases.
    pub fn served_names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.model.as_str()).chain(self.aliases.iter().map(String::as_str))
    }
}

#[cfg(test)]
mod tests;
