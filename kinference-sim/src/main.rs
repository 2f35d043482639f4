//! `kinference-sim`: N simulated vLLM engines in one process.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use kinference_sim::{
    AdmissionLimits, ApiKeyScope, EngineConfig, EngineMode, FailMode, FaultConfig, FaultRequest,
    HashRepr, HashSeed, KvEventsConfig, LatencyModel, LoraConfig, LoraModule, OutputLen, SimConfig,
    SimFleet, SimTokenizer,
};

/// Simulated vLLM or SGLang engines: OpenAI API, /metrics, KV events (and
/// replay when asked for), a prefix cache and a latency model, as a given
/// release of either engine behaves. Engine i serves HTTP on PORT+i and
/// publishes DP rank r on KV_PORT + i·DP_SIZE + r.
#[derive(Debug, Parser)]
#[command(name = "kinference-sim", version)]
struct Args {
    /// Engines to run.
    #[arg(long, default_value_t = 1)]
    engines: usize,
    /// The engine imitated: vllm[:VERSION] (0.22–0.33) or sglang[:VERSION]
    /// (0.5.10–0.5.23). It decides the event encoding, the replay reply
    /// layout, /kv_event_sources (vLLM ≥ 0.31), /server_info (SGLang), the
    /// metric names, hashes and error bodies.
    #[arg(long, default_value = "vllm:0.33.0")]
    engine: EngineMode,
    /// HTTP listen address.
    #[arg(long, default_value = "0.0.0.0")]
    host: IpAddr,
    /// HTTP port of engine 0 (0: ephemeral).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// KV-event PUB port of engine 0, rank 0 (0: ephemeral).
    #[arg(long, default_value_t = 5557)]
    kv_port: u16,
    /// Replay ROUTER port of engine 0, rank 0 (off when unset, as the
    /// engines' replay_endpoint is; 0: ephemeral).
    #[arg(long)]
    replay_port: Option<u16>,
    /// Address the KV sockets bind (default: --host).
    #[arg(long)]
    kv_host: Option<IpAddr>,
    /// Publish no KV events.
    #[arg(long)]
    no_kv_events: bool,
    /// Topic frame of every KV message.
    #[arg(long, default_value = "")]
    topic: String,
    /// Block hashes as u64 (vLLM's default) or 32 raw bytes (vLLM only).
    #[arg(long, value_enum, default_value_t = HashArg::Int)]
    hash_repr: HashArg,
    /// Batches kept for replay.
    #[arg(long, default_value_t = 10_000)]
    buffer_steps: usize,
    /// Engine cores per engine (DP ranks).
    #[arg(long, default_value_t = 1)]
    dp_size: u32,
    /// Served model name.
    #[arg(
        long = "served-model-name",
        alias = "model",
        default_value = "kinference/sim"
    )]
    model: String,
    /// Further names for the model (repeatable).
    #[arg(long = "alias")]
    aliases: Vec<String>,
    /// The cards' `root` (vLLM's --model).
    #[arg(long)]
    root: Option<String>,
    /// Context length.
    #[arg(long, default_value_t = 32_768)]
    max_model_len: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV capacity in blocks (including vLLM's null block).
    #[arg(long, default_value_t = 8192)]
    num_gpu_blocks: usize,
    /// Token budget of a step.
    #[arg(long, default_value_t = 2048)]
    max_num_batched_tokens: usize,
    /// Most running requests.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Disable the prefix cache.
    #[arg(long)]
    no_prefix_caching: bool,
    /// vLLM's PYTHONHASHSEED: a seed, or `random` for a NONE_HASH of its own
    /// per engine core (pods then disagree on block hashes). Unset: the
    /// release's default (random before vLLM 0.29, "vllm-none-hash" after).
    #[arg(long)]
    hash_seed: Option<HashSeed>,
    /// --api-key: guarded paths need `Authorization: Bearer KEY` (401 otherwise).
    #[arg(long, env = "KINFERENCE_SIM_API_KEY")]
    api_key: Option<String>,
    /// Which paths the key guards: `engine` (the release's rule: vLLM /v1…,
    /// SGLang all but /health and /metrics) or `all-but-public` (vLLM's newer rule).
    #[arg(long, default_value = "engine")]
    api_key_scope: ApiKeyScope,
    /// vLLM admission control: most requests in flight before 503.
    #[arg(long)]
    max_num_queued_reqs: Option<usize>,
    /// vLLM admission control: most prompt tokens in prefill before 503.
    #[arg(long)]
    max_num_queued_tokens: Option<usize>,
    /// LoRA adapters served next to the model (vLLM only): NAME=PATH, or a
    /// bare NAME (path /adapters/NAME); comma-separated, space-separated or
    /// repeated. Each gets a /v1/models card (root PATH, parent the served
    /// name) and answers as `model`; adapter i (from 1, in this order) is
    /// the events' lora_id.
    #[arg(long, value_name = "NAME=PATH", num_args = 1.., value_delimiter = ',')]
    lora_modules: Vec<LoraModule>,
    /// Most distinct LoRA adapters in one running batch, and GPU slots for
    /// them (vLLM's --max-loras).
    #[arg(long, default_value_t = LoraConfig::default().max_loras)]
    max_loras: usize,
    /// Step time spent loading a LoRA adapter that is not in a GPU slot
    /// (the least recently used slot is evicted), ms.
    #[arg(long, default_value_t = LoraConfig::default().load_ms)]
    lora_load_ms: f64,
    /// Step time: fixed part, ms.
    #[arg(long, default_value_t = LatencyModel::default().base_ms)]
    step_base_ms: f64,
    /// Step time per prompt token, ms.
    #[arg(long, default_value_t = LatencyModel::default().prefill_ms_per_token)]
    prefill_ms_per_token: f64,
    /// Step time per decoding sequence, ms.
    #[arg(long, default_value_t = LatencyModel::default().decode_ms_per_seq)]
    decode_ms_per_seq: f64,
    /// Output lengths: max-tokens[:DEFAULT], fixed:N, uniform:MIN-MAX, geometric:MEAN.
    #[arg(long, default_value = "max-tokens:128")]
    output_len: OutputLen,
    /// Seed of output lengths and tokens.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Directory with tokenizer.json (default: the built-in word-level tokenizer).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Report usage.prompt_tokens_details.cached_tokens.
    #[arg(long)]
    enable_prompt_tokens_details: bool,
    /// Keep Responses API answers for retrieval, cancel and
    /// `previous_response_id` (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE=1`,
    /// which sets it too).
    #[arg(long, env = "VLLM_ENABLE_RESPONSES_API_STORE", value_parser = clap::builder::FalseyValueParser::new())]
    enable_responses_store: bool,
    /// Fault: multiply step times.
    #[arg(long, default_value_t = 1.0)]
    slowdown: f64,
    /// Fault: drop every n-th KV batch from the PUB socket (0: never).
    #[arg(long, default_value_t = 0)]
    drop_every: u64,
    /// Fault: inference requests fail: none, cuda-error (500; /health fine),
    /// engine-dead (bare 500; /health 503), admission-reject (vLLM's 503).
    #[arg(long, default_value = "none")]
    fail_requests: FailMode,
    /// Fault: the fraction of inference requests that fail, in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    fail_fraction: f64,
    /// Fault: delay every /metrics answer, ms.
    #[arg(long, default_value_t = 0)]
    metrics_delay_ms: u64,
    /// Fault: restart every engine's publishers every SECS seconds.
    #[arg(long, value_name = "SECS")]
    restart_publisher_every: Option<f64>,
    /// Fault: how long a restarted publisher stays down, ms.
    #[arg(long, default_value_t = 0)]
    restart_down_ms: u64,
    /// Fault: stall every engine for --stall-ms every SECS seconds.
    #[arg(long, value_name = "SECS")]
    stall_every: Option<f64>,
    /// Fault: length of a periodic stall, ms.
    #[arg(long, default_value_t = 1000)]
    stall_ms: u64,
    /// Fault: cut every in-flight response every SECS seconds.
    #[arg(long, value_name = "SECS")]
    kill_streams_every: Option<f64>,
    /// Tokio worker threads (default: one per core).
    #[arg(long)]
    worker_threads: Option<usize>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum HashArg {
    Int,
    Bytes,
}

fn config(args: &Args) -> anyhow::Result<SimConfig> {
    let tokenizer = match &args.tokenizer {
        Some(dir) => std::sync::Arc::new(
            SimTokenizer::from_dir(dir)
                .with_context(|| format!("loading the tokenizer in {}", dir.display()))?,
        ),
        None => SimTokenizer::word_level(),
    };
    let kv_events = (!args.no_kv_events).then(|| KvEventsConfig {
        host: args.kv_host.unwrap_or(args.host),
        port: args.kv_port,
        replay_port: args.replay_port,
        topic: args.topic.clone(),
        hash_repr: match args.hash_repr {
            HashArg::Int => HashRepr::Int,
            HashArg::Bytes => HashRepr::Bytes,
        },
        buffer_steps: args.buffer_steps,
        fixed_ts: None,
    });
    Ok(SimConfig {
        engine_mode: args.engine,
        model: args.model.clone(),
        aliases: args.aliases.clone(),
        root: args.root.clone(),
        max_model_len: args.max_model_len,
        http_addr: SocketAddr::new(args.host, args.port),
        dp_size: args.dp_size,
        engine: EngineConfig {
            block_size: args.block_size,
            num_gpu_blocks: args.num_gpu_blocks,
            max_num_batched_tokens: args.max_num_batched_tokens,
            max_num_seqs: args.max_num_seqs,
            enable_prefix_caching: !args.no_prefix_caching,
            hash_seed: args.hash_seed.clone().unwrap_or_default(),
        },
        latency: LatencyModel {
            base_ms: args.step_base_ms,
            prefill_ms_per_token: args.prefill_ms_per_token,
            decode_ms_per_seq: args.decode_ms_per_seq,
        },
        output: args.output_len,
        seed: args.seed,
        kv_events,
        tokenizer: Some(tokenizer),
        enable_prompt_tokens_details: args.enable_prompt_tokens_details,
        responses_store: args.enable_responses_store,
        faults: FaultConfig {
            slowdown: args.slowdown,
            drop_every: args.drop_every,
            fail_requests: args.fail_requests,
            fail_fraction: args.fail_fraction,
            metrics_delay_ms: args.metrics_delay_ms,
        },
        api_key: args.api_key.clone(),
        api_key_scope: args.api_key_scope,
        admission: AdmissionLimits {
            max_num_queued_reqs: args.max_num_queued_reqs,
            max_num_queued_tokens: args.max_num_queued_tokens,
        },
        lora: LoraConfig {
            modules: args.lora_modules.clone(),
            max_loras: args.max_loras,
            load_ms: args.lora_load_ms,
        },
    })
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.worker_threads {
        rt.worker_threads(n);
    }
    rt.enable_all().build()?.block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    let cfg = config(&args)?;
    let fleet = SimFleet::spawn(cfg, args.engines).await?;
    for e in fleet.engines() {
        let kv: Vec<String> = e
            .kv_endpoints()
            .iter()
            .map(|k| match k.replay_addr {
                Some(r) => format!("rank {}: pub {} replay {r}", k.rank, k.pub_addr),
                None => format!("rank {}: pub {}", k.rank, k.pub_addr),
            })
            .collect();
        let loras: Vec<&str> = e
            .config()
            .lora
            .modules
            .iter()
            .map(|m| m.name.as_str())
            .collect();
        let loras = if loras.is_empty() {
            String::new()
        } else {
            format!(" lora [{}]", loras.join(", "))
        };
        println!(
            "engine {} ({}) model {} kv [{}]{loras}",
            e.base_url(),
            e.config().engine_mode,
            e.model(),
            kv.join("; ")
        );
    }
    let fleet = std::sync::Arc::new(fleet);
    let periodic = [
        (
            args.restart_publisher_every,
            FaultRequest {
                restart_publisher: Some(true),
                restart_down_ms: Some(args.restart_down_ms),
                ..FaultRequest::default()
            },
        ),
        (
            args.stall_every,
            FaultRequest {
                stall_ms: Some(args.stall_ms),
                ..FaultRequest::default()
            },
        ),
        (
            args.kill_streams_every,
            FaultRequest {
                kill_streams: Some(true),
                ..FaultRequest::default()
            },
        ),
    ];
    let mut tasks = Vec::new();
    for (every, fault) in periodic {
        let Some(secs) = every else { continue };
        anyhow::ensure!(
            secs.is_finite() && secs > 0.0,
            "fault periods must be positive"
        );
        let fleet = fleet.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs_f64(secs));
            tick.tick().await;
            loop {
                tick.tick().await;
                for e in fleet.engines() {
                    if let Err(err) = e.inject(&fault).await {
                        tracing::warn!(error = %err, "periodic fault failed");
                    }
                }
                tracing::info!(?fault, "periodic fault injected");
            }
        }));
    }
    tokio::signal::ctrl_c()
        .await
        .context("waiting for ctrl-c")?;
    for t in &tasks {
        t.abort();
    }
    for t in tasks {
        let _ = t.await;
    }
    if let Ok(fleet) = std::sync::Arc::try_unwrap(fleet) {
        fleet.shutdown().await;
    }
    Ok(())
}
