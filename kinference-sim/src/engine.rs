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

    /// Plans the next step at `now`; `None` when there is nothing to run.
    pub fn schedule(&mut self, now: f64) -> Option<Scheduled> {
        for id in std::mem::take(&mut self.aborts) {
            if self.reqs.contains_key(&id) {
                self.finish(id, FinishReason::Abort, now);
            }
        }
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut entries = Vec::new();
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let want = {
                let r = &self.reqs[&id];
                (r.tokens.len() - r.num_computed).min(budget)
            };
            let mut scheduled = true;
            while !self.allocate(id, want, &[]) {
                let Some(victim) = self.running.pop() else {
                    scheduled = false;
                    break;
                };
                self.preempt(victim);
                preempted = true;
                if victim == id {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            entries.push((id, want));
            budget -= want;
            i += 1;
        }
        // The distinct adapters of the batch so far (vLLM's
        // `scheduled_loras`), in batch order.
        let mut batch_loras: Vec<u32> = Vec::new();
        for (id, _) in &entries {
            if let Some(l) = self.reqs[id].lora
                && !batch_loras.contains(&l)
            {
                batch_loras.push(l);
            }
        }
        let (mut admitted_prompt, mut admitted_hits) = (0usize, 0usize);
        if !preempted {
            // Requests skipped for their adapter keep their place.
            let mut at = 0;
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
                let Some(&id) = self.waiting.get(at) else {
                    break;
                };
                let lora = self.reqs[&id].lora;
                if let Some(l) = lora
                    && !batch_loras.contains(&l)
                    && batch_loras.len() >= self.loras.limit
                {
                    at += 1;
                    continue;
                }
                let (hits, hit_tokens) = self.lookup_prefix(id);
                self.rereport_hits(id, hits.len());
                let want = (self.reqs[&id].tokens.len() - hit_tokens).min(budget);
                self.reqs
                    .get_mut(&id)
                    .expect("waiting request exists")
                    .num_computed = hit_tokens;
                if !self.allocate(id, want, &hits) {
                    self.reqs
                        .get_mut(&id)
                        .expect("waiting request exists")
                        .num_computed = 0;
                    break;
                }
                self.waiting.remove(at);
                self.running.push(id);
                if let Some(l) = lora
                    && !batch_loras.contains(&l)
                {
                    batch_loras.push(l);
                }
                let r = self.reqs.get_mut(&id).expect("admitted request exists");
                if r.cached_tokens.is_none() {
                    r.cached_tokens = Some(hit_tokens);
                    r.scheduled = Some(now);
                    self.stats.queue.observe(now - r.arrival);
                }
                self.stats.prefix_cache_queries += r.tokens.len() as u64;
                self.stats.prefix_cache_hits += hit_tokens as u64;
                admitted_prompt += r.tokens.len();
                admitted_hits += hit_tokens;
                entries.push((id, want));
                budget -= want;
            }
        }
        if admitted_prompt > 0 {
            self.stats.last_hit_rate = admitted_hits as f64 / admitted_prompt as f64;
        }
        if entries.is_empty() {
            return None;
        }
        let (mut prefill_tokens, mut decode_seqs) = (0, 0);
        for (id, n) in &entries {
            let r = &self.reqs[id];
            if *n == 1 && r.num_computed >= r.prompt_len && r.num_computed + 1 == r.tokens.len() {
                decode_seqs += 1;
            } else {
                prefill_tokens += n;
            }
        }
        let lora_loads = self.loras.load(&batch_loras);
        self.stats.lora_loads += lora_loads as u64;
        let duration = self.latency.step_seconds(prefill_tokens, decode_seqs)
            + lora_loads as f64 * self.loras.load_seconds;
        Some(Scheduled {
            entries,
            prefill_tokens,
            decode_seqs,
            lora_loads,
            duration,
        })
    }

    /// Applies a step's results at its end time `now`: samples tokens,
    /// finishes requests. Returns one entry per request that sampled a token.
    pub fn finish_step(&mut self, step: &Scheduled, now: f64) -> Vec<StepOut> {
        self.stats.steps += 1;
        self.stats.busy_seconds += step.duration;
        let mut out = Vec::with_capacity(step.entries.len());
        let sampled_before = self.stats.generation_tokens;
        for &(id, n) in &step.entries {
            let Some(r) = self.reqs.get_mut(&id) else {
                continue;
            };
            r.num_computed += n;
            if r.num_computed < r.tokens.len() {
                continue; // a chunk of the prompt: nothing sampled
            }
            let token = self.vocab.token(r.rng.next_u64());
            r.tokens.push(token);
            r.generated += 1;
            self.stats.generation_tokens += 1;
            match r.last_token {
                None => {
                    self.stats.prompt_tokens += r.prompt_len as u64;
                    if r.first_token.is_none() {
                        r.first_token = Some(now);
                        self.stats.ttft.observe(now - r.arrival);
                    }
                }
                Some(t) => self.stats.itl.observe(now - t),
            }
            r.last_token = Some(now);
            let done = if r.generated >= r.target {
                Some(r.finish_on_target)
            } else if r.tokens.len() >= self.max_model_len {
                Some(FinishReason::Length)
            } else {
                None
            };
            let finished = done.map(|reason| Finished {
                reason,
                prompt_tokens: r.prompt_len,
                completion_tokens: r.generated,
                cached_tokens: r.cached_tokens.unwrap_or(0),
            });
            out.push(StepOut {
                id,
                token,
                finished,
            });
            if let Some(reason) = done {
                self.finish(id, reason, now);
            }
        }
        if step.duration > 0.0 {
            self.stats.gen_throughput =
                (self.stats.generation_tokens - sampled_before) as f64 / step.duration;
        }
        out
    }

    /// The events since the last call (one published batch).
    pub fn take_events(&mut self) -> Vec<SimEvent> {
        std::mem::take(&mut self.events)
    }

    /// vLLM's `reset_prefix_cache`: succeeds only when no request holds a
    /// block; then queues `AllBlocksCleared`.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if !self.pool.reset() {
            return false;
        }
        self.events.push(SimEvent::Cleared);
        self.stats.cache_resets += 1;
        true
    }

    /// Prompt tokens of `tokens` that a base-model request would find
    /// cached now (whole blocks, at most `len - 1` tokens, as at admission).
    pub fn cached_prefix_tokens(&self, tokens: &[u32]) -> usize {
        self.cached_prefix_tokens_for(tokens, None)
    }

    /// [`EngineCore::cached_prefix_tokens`] for a request of adapter `lora`
    /// (`None`: the base model; an adapter the core does not serve: 0).
    pub fn cached_prefix_tokens_for(&self, tokens: &[u32], lora: Option<u32>) -> usize {
        if !self.cfg.enable_prefix_caching || tokens.is_empty() {
            return 0;
        }
        let extra = self.loras.extra(lora);
        if lora.is_some() && extra.is_none() {
            return 0;
        }
        let max_blocks = (tokens.len() - 1) / self.cfg.block_size;
        let mut parent: Option<Digest> = None;
        let mut n = 0;
        for block in tokens.chunks_exact(self.cfg.block_size).take(max_blocks) {
            let d = self.hasher.hash_block_with(parent.as_ref(), block, extra);
            if self.pool.lookup(&d).is_none() {
                break;
            }
            parent = Some(d);
            n += 1;
        }
        n * self.cfg.block_size
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

    /// vLLM's `emit_cached_block_events`: a `kv_cache_report_mode: "full"`
    /// request re-announces the `hits` blocks its prefix-cache lookup found,
    /// as one `BlockStored` from the start of the sequence (parent nil),
    /// without changing any block.
    fn rereport_hits(&mut self, id: ReqId, hits: usize) {
        let r = &self.reqs[&id];
        if !r.report_full || hits == 0 {
            return;
        }
        let bs = self.cfg.block_size;
        self.events.push(SimEvent::Stored {
            digests: r.digests[..hits].to_vec(),
            parent: None,
            tokens: r.tokens[..hits * bs].to_vec(),
            lora: r.lora,
            session: r.session.clone(),
        });
        self.stats.blocks_rereported += hits as u64;
    }

    /// Finds the cached prefix of a waiting request: the blocks and the
    /// number of tokens they hold.
    fn lookup_prefix(&mut self, id: ReqId) -> (Vec<BlockId>, usize) {
        if !self.cfg.enable_prefix_caching {
            return (Vec::new(), 0);
        }
        let bs = self.cfg.block_size;
        let r = self.reqs.get_mut(&id).expect("waiting request exists");
        let extra = self.loras.extra(r.lora);
        self.hasher.extend_with(&r.tokens, &mut r.digests, extra);
        let max_blocks = (r.tokens.len() - 1) / bs;
        let mut hits = Vec::new();
        for d in r.digests.iter().take(max_blocks) {
            match self.pool.lookup(d) {
                Some(b) => hits.push(b),
                None => break,
            }
        }
        let n = hits.len() * bs;
        (hits, n)
    }

    /// vLLM's `allocate_slots`: blocks for `num_new` more tokens after
    /// `num_computed` (which includes the `hits`), then caches the blocks
    /// those tokens fill. False (and nothing changed) if blocks run out.
    fn allocate(&mut self, id: ReqId, num_new: usize, hits: &[BlockId]) -> bool {
        let bs = self.cfg.block_size;
        let EngineCore {
            reqs,
            pool,
            hasher,
            events,
            stats,
            cfg,
            loras,
            ..
        } = self;
        let set_semantics = self.set_semantics;
        let r = reqs.get_mut(&id).expect("scheduled request exists");
        let total = r.num_computed + num_new;
        let need = total.div_ceil(bs);
        let have = r.blocks.len() + hits.len();
        let new_blocks = need.saturating_sub(have);
        let evictable_hits = hits.iter().filter(|b| pool.ref_cnt(**b) == 0).count();
        if new_blocks + evictable_hits > pool.num_free() {
            return false;
        }
        for &b in hits {
            pool.touch(b);
            r.blocks.push(b);
        }
        if !hits.is_empty() {
            r.num_cached_blocks = r.blocks.len();
        }
        for _ in 0..new_blocks {
            let (b, evicted) = pool.allocate().expect("free blocks were counted");
            if let Some((digest, parent)) = evicted
                && !(set_semantics && pool.lookup(&digest).is_some())
            {
                events.push(SimEvent::Removed { digest, parent });
                stats.blocks_removed += 1;
            }
            r.blocks.push(b);
        }
        if cfg.enable_prefix_caching {
            let full = total.min(r.tokens.len()) / bs;
            if full > r.num_cached_blocks {
                let from = r.num_cached_blocks;
                hasher.extend_with(&r.tokens[..full * bs], &mut r.digests, loras.extra(r.lora));
                // One event per run of newly cached blocks; under set
                // semantics a digest already cached elsewhere is not
                // announced again (it splits the run).
                let mut run = from;
                for i in from..full {
                    let p = i.checked_sub(1).map(|p| r.digests[p]);
                    let known = set_semantics && pool.lookup(&r.digests[i]).is_some();
                    pool.cache(
                        r.blocks[i],
                        r.digests[i],
                        p,
                        &r.tokens[i * bs..(i + 1) * bs],
                        r.lora,
                    );
                    if known {
                        push_stored(events, stats, r, run, i, bs);
                        run = i + 1;
                    }
                }
                push_stored(events, stats, r, run, full, bs);
                r.num_cached_blocks = full;
            }
        }
        true
    }

    /// Recompute preemption: free the blocks, back to the queue's front.
    fn preempt(&mut self, id: ReqId) {
        let r = self.reqs.get_mut(&id).expect("running request exists");
        self.pool.free(r.blocks.drain(..).rev());
        r.num_computed = 0;
        r.num_cached_blocks = 0;
        r.preemptions += 1;
        self.stats.preemptions += 1;
        self.waiting.push_front(id);
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

/// Announces the request's blocks `from..to` (if any) as one `BlockStored`.
fn push_stored(
    events: &mut Vec<SimEvent>,
    stats: &mut CoreStats,
    r: &Req,
    from: usize,
    to: usize,
    bs: usize,
) {
    if to <= from {
        return;
    }
    events.push(SimEvent::Stored {
        digests: r.digests[from..to].to_vec(),
        parent: from.checked_sub(1).map(|p| r.digests[p]),
        tokens: r.tokens[from * bs..to * bs].to_vec(),
        lora: r.lora,
        session: r.session.clone(),
    });
    stats.blocks_stored += (to - from) as u64;
}

#[cfg(test)]
mod tests;
