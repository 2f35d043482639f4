//! One engine core: vLLM V1's scheduler over a [`crate::pool`] block pool, with simulated
//! time passed in (no clock, no I/O, no async), so it is deterministic and
//! testable step by step.
//!
//! # A step
//!
//! [`EngineCore::schedule`] is vLLM's `Scheduler.schedule()`:
//!
//! 1. Pending aborts are applied (blocks freed).
//! 2. Running requests, in order, get their remaining tokens (a prompt
//!    chunk, or one token when decoding), limited by the step's token budget
//!    (`max_num_batched_tokens`). If their blocks cannot be allocated, the
//!    last running request is preempted (blocks freed, back to the front of
//!    the queue, recomputed later), as vLLM's recompute preemption does.
//! 3. If nothing was preempted, waiting requests are admitted in order while
//!    budget, `max_num_seqs` and free blocks allow. Admission looks up the
//!    longest cached prefix of full blocks (at most `len - 1` tokens: the
//!    last token is always computed to get logits), takes references on
//!    those blocks and counts the prefix-cache query and hits. A waiting
//!    request of a LoRA adapter that would make the batch hold more than
//!    `max_loras` distinct adapters is skipped (it keeps its place; later
//!    requests may still be admitted), as vLLM's scheduler skips it;
//!    base-model requests never count.
//! 4. Allocation evicts free cached blocks in LRU order (`BlockRemoved`) and
//!    caches every block that the step's tokens fill (`BlockStored`, parent
//!    = the request's previous block), exactly when vLLM does: at
//!    scheduling, before the forward pass.
//!
//! The step lasts `a + b·(prompt tokens) + c·(decoding sequences)`
//! ([`crate::LatencyModel`]), plus `lora_load_ms` for every adapter of the
//! batch that is not in one of the `max_loras` GPU slots (it is loaded,
//! evicting the least recently used slot the batch does not need).
//! [`EngineCore::finish_step`] is
//! `update_from_output()`: every request whose known tokens are all computed
//! samples one token (the first one ends its prefill: TTFT); requests that
//! reach their length finish and free their blocks last-first. The events
//! of the step are then taken with [`EngineCore::take_events`] and published
//! as one batch.
//!
//! # LoRA adapters
//!
//! A request of adapter `k` ([`NewRequest::lora`]) hashes its blocks with
//! the adapter's extra key ([`crate::hash::HashExtra::lora`]), so the same
//! tokens under two adapters and the base model are three cache entries;
//! its `BlockStored` events carry the adapter ([`SimEvent::Stored`]).
//!
//! # Determinism
//!
//! Output lengths and token ids come from a SplitMix64 stream seeded by the
//! engine seed, the prompt's token ids and the request's `seed`, so the same
//! prompt gets the same answer on every engine of a fleet whatever the
//! routing, and a run is reproducible given its arrival times.
//!
//! # Complexity
//!
//! Scheduling is O(scheduled requests + blocks allocated or hit); admission
//! hashes each full prompt block once (SHA-256 over ~100 bytes) and probes a
//! hash map per block.

use std::collections::VecDeque;
use std::sync::Arc;

use hashbrown::HashMap;

use crate::config::{EngineConfig, HashSeed, LatencyModel, LoraConfig, OutputLen};
use crate::hash::{BlockHasher, Digest, HashExtra};
use crate::mode::EngineMode;
use crate::pool::{BlockId, BlockPool, CachedBlock};
use crate::textgen::{Rng, SimTokenizer};

mod cache;
mod step;
mod types;

pub use types::{
    AdmitError, CoreStats, FinishReason, Finished, NewRequest, RequestRecord, Scheduled, SimEvent,
    StepOut,
};

/// A request id, unique per engine core.
pub type ReqId = u64;

/// How many finished requests [`EngineCore::recent`] remembers.
const RECENT: usize = 4096;

#[derive(Debug)]
struct Req {
    tokens: Vec<u32>,
    prompt_len: usize,
    target: usize,
    finish_on_target: FinishReason,
    generated: usize,
    rng: Rng,
    num_computed: usize,
    blocks: Vec<BlockId>,
    digests: Vec<Digest>,
    num_cached_blocks: usize,
    cached_tokens: Option<usize>,
    arrival: f64,
    scheduled: Option<f64>,
    first_token: Option<f64>,
    last_token: Option<f64>,
    preemptions: u32,
    report_full: bool,
    lora: Option<u32>,
    session: Option<std::sync::Arc<str>>,
}

/// The LoRA adapters a core serves, and its GPU slots for them.
#[derive(Debug)]
struct Loras {
    /// The hash extra key of adapter id `i + 1`.
    extras: Vec<HashExtra>,
    /// Distinct adapters per batch, and GPU slots.
    limit: usize,
    /// A step's extra time per adapter loaded into a slot.
    load_seconds: f64,
    /// Adapter ids in GPU slots, least recently used first.
    slots: VecDeque<u32>,
    /// vLLM ≥ 0.31's tagged extra key.
    tagged: bool,
}

impl Loras {
    /// The extra key of a request's blocks.
    fn extra(&self, lora: Option<u32>) -> Option<&HashExtra> {
        self.extras.get((lora? as usize).checked_sub(1)?)
    }

    /// Makes the step's adapters resident, in batch order: a resident one
    /// becomes the most recently used, a missing one is loaded into the
    /// least recently used slot the batch does not need. Returns the loads.
    fn load(&mut self, batch: &[u32]) -> usize {
        let mut loads = 0;
        for &l in batch {
            if let Some(at) = self.slots.iter().position(|s| *s == l) {
                self.slots.remove(at);
            } else {
                if self.slots.len() >= self.limit
                    && let Some(victim) = self.slots.iter().position(|s| !batch.contains(s))
                {
                    self.slots.remove(victim);
                }
                loads += 1;
            }
            self.slots.push_back(l);
        }
        loads
    }
}

/// One engine core. See the module docs.
#[derive(Debug)]
pub struct EngineCore {
    cfg: EngineConfig,
    latency: LatencyModel,
    output: OutputLen,
    max_model_len: usize,
    seed: u64,
    vocab: Arc<SimTokenizer>,
    pool: BlockPool,
    hasher: BlockHasher,
    reqs: HashMap<ReqId, Req>,
    waiting: VecDeque<ReqId>,
    running: Vec<ReqId>,
    aborts: Vec<ReqId>,
    events: Vec<SimEvent>,
    next_id: ReqId,
    stats: CoreStats,
    recent: VecDeque<RequestRecord>,
    /// SGLang's radix cache: a digest is stored once and removed once.
    set_semantics: bool,
    loras: Loras,
}

/// The hasher an engine core of `mode` uses. A [`HashSeed::Random`] seed
/// (or a vLLM release before 0.29 without one) draws a fresh NONE_HASH, so
/// every call gives another hasher, as every vLLM engine-core process does.
pub fn block_hasher(mode: &EngineMode, block_size: usize, seed: &HashSeed) -> BlockHasher {
    if mode.is_sglang() {
        return BlockHasher::sglang(block_size);
    }
    match seed {
        HashSeed::Fixed(s) => BlockHasher::new(block_size, s),
        HashSeed::EngineDefault if mode.default_seed_is_fixed() => {
            BlockHasher::new(block_size, crate::hash::DEFAULT_HASH_SEED)
        }
        HashSeed::EngineDefault | HashSeed::Random => {
            use std::hash::{BuildHasher as _, Hasher as _};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            let a = h.finish();
            h.write_u64(a);
            BlockHasher::new(block_size, &format!("random-{a:016x}{:016x}", h.finish()))
        }
    }
}

impl EngineCore {
    /// A core with an empty cache, imitating `mode`'s block hashes and
    /// cache semantics.
    pub fn new(
        cfg: EngineConfig,
        mode: EngineMode,
        latency: LatencyModel,
        output: OutputLen,
        max_model_len: usize,
        seed: u64,
        vocab: Arc<SimTokenizer>,
    ) -> Self {
        EngineCore {
            pool: BlockPool::new(cfg.num_gpu_blocks, cfg.block_size),
            hasher: block_hasher(&mode, cfg.block_size, &cfg.hash_seed),
            set_semantics: mode.set_semantics(),
            loras: Loras {
                extras: Vec::new(),
                limit: 1,
                load_seconds: 0.0,
                slots: VecDeque::new(),
                tagged: mode.lora_hash_key_tagged(),
            },
            stats: if mode.is_sglang() {
                CoreStats::sglang()
            } else {
                CoreStats::default()
            },
            cfg,
            latency,
            output,
            max_model_len,
            seed,
            vocab,
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            aborts: Vec::new(),
            events: Vec::new(),
            next_id: 0,
            recent: VecDeque::new(),
        }
    }

    /// The same core serving the adapters of `lora` (ids 1-based in its
    /// order), with `lora.max_loras` GPU slots, empty at start.
    #[must_use]
    pub fn with_loras(mut self, lora: &LoraConfig) -> Self {
        let tagged = self.loras.tagged;
        self.loras.extras = lora
            .modules
            .iter()
            .map(|m| HashExtra::lora(&m.name, &m.path, tagged))
            .collect();
        self.loras.limit = lora.max_loras.max(1);
        self.loras.load_seconds = lora.load_ms / 1000.0;
        self.loras.slots.clear();
        self
    }

    /// Queues a request arriving at `now` (engine seconds).
    ///
    /// # Errors
    /// [`AdmitError`] for an empty prompt, one that cannot fit the context,
    /// or an adapter the core does not serve.
    pub fn add_request(&mut self, req: NewRequest, now: f64) -> Result<ReqId, AdmitError> {
        let prompt_len = req.prompt.len();
        if prompt_len == 0 {
            return Err(AdmitError::EmptyPrompt);
        }
        if let Some(l) = req.lora
            && self.loras.extra(Some(l)).is_none()
        {
            return Err(AdmitError::UnknownLora(l));
        }
        let room = self.max_model_len.saturating_sub(prompt_len);
        if room == 0 {
            return Err(AdmitError::PromptTooLong {
                max_model_len: self.max_model_len,
                prompt: prompt_len,
            });
        }
        let max_tokens = req.max_tokens.unwrap_or(room);
        if max_tokens > room {
            return Err(AdmitError::MaxTokensTooLarge {
                max_model_len: self.max_model_len,
                prompt: prompt_len,
                max_tokens,
            });
        }
        let prompt_hash = xxhash_rust::xxh3::xxh3_64_with_seed(
            &req.prompt
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect::<Vec<u8>>(),
            self.seed,
        );
        let mut rng = Rng::new(prompt_hash ^ req.seed.unwrap_or(0).rotate_left(17));
        let (target, reason) = self.output_len(&req, max_tokens, &mut rng);
        let id = self.next_id;
        self.next_id += 1;
        self.reqs.insert(
            id,
            Req {
                tokens: req.prompt,
                prompt_len,
                target,
                finish_on_target: reason,
                generated: 0,
                rng,
                num_computed: 0,
                blocks: Vec::new(),
                digests: Vec::new(),
                num_cached_blocks: 0,
                cached_tokens: None,
                arrival: now,
                scheduled: None,
                first_token: None,
                last_token: None,
                preemptions: 0,
                report_full: req.report_full,
                lora: req.lora,
                session: req.session,
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    fn output_len(
        &self,
        req: &NewRequest,
        max_tokens: usize,
        rng: &mut Rng,
    ) -> (usize, FinishReason) {
        let explicit = req.max_tokens.is_some();
        let sampled = match self.output {
            OutputLen::MaxTokens { default } => {
                let n = if explicit {
                    max_tokens
                } else {
                    default.min(max_tokens)
                };
                return (n.max(1), FinishReason::Length);
            }
            OutputLen::Fixed(n) => n,
            OutputLen::Uniform { min, max } => {
                min + (rng.next_u64() % (max - min + 1) as u64) as usize
            }
            OutputLen::Geometric { mean } => {
                // Inverse CDF of a geometric distribution on 1, 2, …
                let p = 1.0 / mean;
                let u = rng.next_f64();
                if p >= 1.0 {
                    1
                } else {
                    ((1.0 - u).ln() / (1.0 - p).ln()).floor() as usize + 1
                }
            }
        };
        if req.ignore_eos && explicit {
            return (max_tokens.max(1), FinishReason::Length);
        }
        let n = sampled.max(req.min_tokens).max(1);
        if n >= max_tokens {
            (max_tokens.max(1), FinishReason::Length)
        } else {
            (n, FinishReason::Stop)
        }
    }

    /// Asks for a request to be aborted; applied at the next
    /// [`EngineCore::schedule`] (never in the middle of a step).
    pub fn abort(&mut self, id: ReqId) {
        if self.reqs.contains_key(&id) {
            self.aborts.push(id);
        }
    }

    /// Aborts every request now (between steps only). Returns their ids.
    pub fn abort_all(&mut self, now: f64) -> Vec<ReqId> {
        let ids: Vec<ReqId> = self
            .running
            .iter()
            .chain(self.waiting.iter())
            .copied()
            .collect();
        for id in &ids {
            self.finish(*id, FinishReason::Abort, now);
        }
        self.aborts.clear();
        ids
    }

    /// Whether anything is queued or running.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.aborts.is_empty()
    }

    /// The events since the last call (one published batch).
    pub fn take_events(&mut self) -> Vec<SimEvent> {
        std::mem::take(&mut self.events)
    }

    /// Requests running.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Ids running and waiting, in order.
    pub fn queue(&self) -> (Vec<ReqId>, Vec<ReqId>) {
        (self.running.clone(), self.waiting.iter().copied().collect())
    }

    /// The distinct adapters (integer ids) of the running requests, in
    /// batch order.
    pub fn running_loras(&self) -> Vec<u32> {
        self.distinct_loras(self.running.iter())
    }

    /// The distinct adapters of the waiting requests, in queue order.
    pub fn waiting_loras(&self) -> Vec<u32> {
        self.distinct_loras(self.waiting.iter())
    }

    fn distinct_loras<'a>(&self, ids: impl Iterator<Item = &'a ReqId>) -> Vec<u32> {
        let mut out = Vec::new();
        for id in ids {
            if let Some(l) = self.reqs.get(id).and_then(|r| r.lora)
                && !out.contains(&l)
            {
                out.push(l);
            }
        }
        out
    }

    /// The adapters in GPU slots, least recently used first.
    pub fn lora_slots(&self) -> Vec<u32> {
        self.loras.slots.iter().copied().collect()
    }

    /// KV usage, 0–1.
    pub fn kv_usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Free blocks (cached or not).
    pub fn free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    /// Blocks that can hold tokens.
    pub fn capacity_blocks(&self) -> usize {
        self.pool.capacity()
    }

    /// Distinct cached digests and blocks carrying one.
    pub fn cached_counts(&self) -> (usize, usize) {
        (
            self.pool.num_cached_digests(),
            self.pool.num_cached_blocks(),
        )
    }

    /// The true cache contents.
    pub fn cache_snapshot(&self, with_tokens: bool) -> Vec<CachedBlock> {
        self.pool.snapshot(with_tokens)
    }

    /// Counters and histograms.
    pub fn stats(&self) -> &CoreStats {
        &self.stats
    }

    /// The last finished requests, oldest first.
    pub fn recent(&self) -> impl Iterator<Item = &RequestRecord> {
        self.recent.iter()
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The block hasher (its scheme gives the wire ids of digests).
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// Prompt tokens of requests still in their prefill (waiting, or
    /// running with prompt tokens left): what vLLM's
    /// `--max-num-queued-tokens` counts.
    pub fn prefill_tokens_queued(&self) -> usize {
        self.reqs
            .values()
            .filter(|r| r.num_computed < r.prompt_len)
            .map(|r| r.prompt_len)
            .sum()
    }

    fn finish(&mut self, id: ReqId, reason: FinishReason, now: f64) {
        let Some(mut r) = self.reqs.remove(&id) else {
            return;
        };
        self.pool.free(r.blocks.drain(..).rev());
        self.running.retain(|x| *x != id);
        self.waiting.retain(|x| *x != id);
        match reason {
            FinishReason::Stop => self.stats.finished_stop += 1,
            FinishReason::Length => self.stats.finished_length += 1,
            FinishReason::Abort => self.stats.finished_abort += 1,
        }
        if reason != FinishReason::Abort {
            self.stats.e2e.observe(now - r.arrival);
        }
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(RequestRecord {
            id,
            prompt_tokens: r.prompt_len,
            cached_tokens: r.cached_tokens.unwrap_or(0),
            completion_tokens: r.generated,
            finish_reason: reason.as_str(),
            arrival: r.arrival,
            scheduled: r.scheduled,
            first_token: r.first_token,
            finished: now,
            preemptions: r.preemptions,
            lora_id: r.lora,
        });
    }
}

#[cfg(test)]
mod tests;
