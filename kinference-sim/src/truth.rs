//! What an engine really holds and did, for oracles, reliability checks
//! and `GET /debug/cache`: every rank's cached blocks, counters, queues and
//! publisher state. These are the simulator's own answers, never part of a
//! real engine's API.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use crate::engine::CoreStats;
use crate::{Shared, endpoint_str, events};

/// KV-event endpoints of one DP rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct KvEndpoint {
    /// DP rank.
    pub rank: u32,
    /// PUB socket.
    pub pub_addr: SocketAddr,
    /// Replay ROUTER socket.
    pub replay_addr: Option<SocketAddr>,
}

/// One cached block as the engine holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockTruth {
    /// The int form of the digest that int-mode events carry, as
    /// `BlockHash::id` normalises it (vLLM: last 8 bytes; SGLang: the
    /// signed first 8 bytes in two's complement).
    pub hash: u64,
    /// The parent's int form (`None`: first block of a sequence).
    pub parent: Option<u64>,
    /// The whole digest, hex (`digests=1`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Physical copies (vLLM may cache one digest twice).
    pub copies: usize,
    /// Held by a running request.
    pub in_use: bool,
    /// The LoRA adapter whose blocks these are (absent: the base model):
    /// its tokens hit only requests of that adapter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
    /// Token ids (`tokens=1`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Vec<u32>>,
}

/// The truth about one engine core, for oracles and reliability checks.
#[derive(Debug, Clone, Serialize)]
pub struct RankTruth {
    /// DP rank.
    pub rank: u32,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks including the null block.
    pub num_gpu_blocks: usize,
    /// Unreferenced blocks (cached or not).
    pub free_blocks: usize,
    /// `vllm:kv_cache_usage_perc`.
    pub kv_cache_usage_perc: f64,
    /// Distinct cached digests.
    pub cached_hashes: usize,
    /// Blocks carrying a digest.
    pub cached_blocks: usize,
    /// The cached blocks, sorted by digest (omitted with `summary=1`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Vec<BlockTruth>>,
    /// Counters.
    pub counters: Counters,
    /// Request ids running, in batch order.
    pub running: Vec<u64>,
    /// Request ids waiting, in queue order.
    pub waiting: Vec<u64>,
    /// LoRA adapters in GPU slots, least recently used first (absent when
    /// none is loaded).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lora_slots: Vec<String>,
    /// Publisher state.
    pub publisher: Option<PublisherTruth>,
    /// Remaining stall, in ms.
    pub stalled_ms: u64,
    /// Step-time multiplier.
    pub slowdown: f64,
}

/// Counters of one core (the same numbers `/metrics` shows).
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Counters {
    /// `vllm:prompt_tokens_total`.
    pub prompt_tokens: u64,
    /// `vllm:generation_tokens_total`.
    pub generation_tokens: u64,
    /// `vllm:prefix_cache_queries_total`.
    pub prefix_cache_queries: u64,
    /// `vllm:prefix_cache_hits_total`.
    pub prefix_cache_hits: u64,
    /// `vllm:num_preemptions_total`.
    pub preemptions: u64,
    /// Requests finished (stop + length).
    pub finished: u64,
    /// Requests aborted.
    pub aborted: u64,
    /// Engine steps.
    pub steps: u64,
    /// Simulated busy seconds.
    pub busy_seconds: f64,
    /// Blocks announced by `BlockStored` as newly cached.
    pub blocks_stored: u64,
    /// Cached blocks re-announced for `kv_cache_report_mode: "full"`.
    pub blocks_rereported: u64,
    /// `BlockRemoved` events.
    pub blocks_removed: u64,
    /// Successful resets.
    pub cache_resets: u64,
    /// LoRA adapters loaded into a GPU slot (each one `lora_load_ms` of
    /// step time).
    pub lora_loads: u64,
}

impl From<&CoreStats> for Counters {
    fn from(s: &CoreStats) -> Self {
        Counters {
            prompt_tokens: s.prompt_tokens,
            generation_tokens: s.generation_tokens,
            prefix_cache_queries: s.prefix_cache_queries,
            prefix_cache_hits: s.prefix_cache_hits,
            preemptions: s.preemptions,
            finished: s.finished_stop + s.finished_length,
            aborted: s.finished_abort,
            steps: s.steps,
            busy_seconds: s.busy_seconds,
            blocks_stored: s.blocks_stored,
            blocks_rereported: s.blocks_rereported,
            blocks_removed: s.blocks_removed,
            cache_resets: s.cache_resets,
            lora_loads: s.lora_loads,
        }
    }
}

/// A publisher's state.
#[derive(Debug, Clone, Serialize)]
pub struct PublisherTruth {
    /// PUB endpoint.
    pub endpoint: String,
    /// Replay endpoint.
    pub replay_endpoint: Option<String>,
    /// Next sequence number.
    pub next_seq: u64,
    /// Batches the engine handed over that are not numbered yet (0: every
    /// batch so far is counted in `next_seq`, sent, dropped or lost).
    pub pending: u64,
    /// Batches sent.
    pub sent: u64,
    /// Batches dropped from PUB (kept for replay).
    pub dropped: u64,
    /// Batches lost.
    pub lost: u64,
    /// Restarts.
    pub restarts: u64,
    /// Replay requests answered.
    pub replays: u64,
    /// Drop every n-th batch.
    pub drop_every: u64,
    /// Drops still pending.
    pub drop_pending: u64,
    /// Losses still pending.
    pub lose_pending: u64,
}

/// The whole engine's truth (`GET /debug/cache`).
#[derive(Debug, Clone, Serialize)]
pub struct CacheTruth {
    /// Served model name.
    pub model: String,
    /// One entry per DP rank.
    pub engines: Vec<RankTruth>,
}

impl Shared {
    pub(crate) fn cache_truth(
        &self,
        only: Option<u32>,
        tokens: bool,
        digests: bool,
        blocks: bool,
    ) -> CacheTruth {
        let engines = self
            .ranks
            .iter()
            .filter(|r| only.is_none_or(|o| o == r.index))
            .map(|r| {
                let (running, waiting, slots, counters, free, usage, (hashes, cached), list) = {
                    let st = r.lock();
                    let (running, waiting) = st.core.queue();
                    let slots: Vec<String> = st
                        .core
                        .lora_slots()
                        .into_iter()
                        .map(|l| self.lora_name(l).to_owned())
                        .collect();
                    let list = blocks.then(|| {
                        st.core
                            .cache_snapshot(tokens)
                            .into_iter()
                            .map(|b| BlockTruth {
                                hash: st.core.hasher().wire_id(&b.digest),
                                parent: b.parent.map(|p| st.core.hasher().wire_id(&p)),
                                digest: digests.then(|| b.digest.hex()),
                                copies: b.copies,
                                in_use: b.in_use,
                                lora_name: b.lora_id.map(|l| self.lora_name(l).to_owned()),
                                tokens: b.tokens,
                            })
                            .collect()
                    });
                    (
                        running,
                        waiting,
                        slots,
                        Counters::from(st.core.stats()),
                        st.core.free_blocks(),
                        st.core.kv_usage(),
                        st.core.cached_counts(),
                        list,
                    )
                };
                RankTruth {
                    rank: r.index,
                    block_size: self.cfg.engine.block_size,
                    num_gpu_blocks: self.cfg.engine.num_gpu_blocks,
                    free_blocks: free,
                    kv_cache_usage_perc: usage,
                    cached_hashes: hashes,
                    cached_blocks: cached,
                    blocks: list,
                    counters,
                    running,
                    waiting,
                    lora_slots: slots,
                    publisher: r.publisher.as_ref().map(|p| publisher_truth(&p.info)),
                    stalled_ms: r.stalled_until().map_or(0, |u| {
                        u.saturating_duration_since(tokio::time::Instant::now())
                            .as_millis() as u64
                    }),
                    slowdown: r.slowdown(),
                }
            })
            .collect();
        CacheTruth {
            model: self.cfg.model.clone(),
            engines,
        }
    }
}

pub(crate) fn publisher_truth(i: &events::PublisherInfo) -> PublisherTruth {
    let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
    // First, and acquiring: a 0 read here sees every number taken before.
    let pending = i.pending.load(Ordering::Acquire);
    PublisherTruth {
        endpoint: endpoint_str(i.pub_addr),
        replay_endpoint: i.replay_addr.map(endpoint_str),
        next_seq: l(&i.next_seq),
        pending,
        sent: l(&i.sent),
        dropped: l(&i.dropped),
        lost: l(&i.lost),
        restarts: l(&i.restarts),
        replays: l(&i.replays),
        drop_every: l(&i.drop_every),
        drop_pending: l(&i.drop_pending),
        lose_pending: l(&i.lose_pending),
    }
}
