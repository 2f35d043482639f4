//! The scale figure: a fleet of 1,000 vLLM pods × 4 DP ranks (4,000
//! publishers) whose KV events one router core applies, with lookups on a
//! second thread. See `benches/README.md`, "Fleet", for the model.
//!
//! `cargo bench -p kinference-kvindex --bench fleet` (`-- --json` also
//! prints one JSON line). Timings use the monotonic clock around the apply
//! and lookup calls alone; the allocator figure comes from a counting
//! global allocator (`cap`).
#![allow(clippy::disallowed_methods)] // a benchmark must read the clock
#![allow(clippy::many_single_char_names)] // t, m, r, s, e: timer, matches, rng, step, elapsed

use std::alloc::System;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use cap::Cap;
use kinference_kvindex::key::{BlockKeyer, ExtraKeys};
use kinference_kvindex::{
    BlockHash, BlockKey, BlockRemoved, BlockStored, EncodeForm, EventBatch, IndexConfig, KvEvent,
    KvIndex, Matches, WorkerId, WorkerRef, decode_batch, encode_batch,
};

#[global_allocator]
static ALLOC: Cap<System> = Cap::new(System, usize::MAX);

const PODS: usize = 1000;
const RANKS: usize = 4;
const WORKERS: usize = PODS * RANKS;
/// GPU prefix cache per rank, in 16-token blocks (32 k tokens).
const CAPACITY: usize = 2048;
const PROMPTS: usize = 100;
const BLOCK: usize = 16;
/// Steady-state requests, generated and applied in chunks.
const CHUNK: usize = 10_000;
const CHUNKS: usize = 8;
/// Events per busy pod (all its ranks), bytes per second.
const POD_RATE: f64 = 1e6;

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct SplitMix(u64);
impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The 16 token ids of a block whose content is `content`.
fn block_tokens(content: u64, out: &mut Vec<u32>) {
    let mut r = SplitMix(content);
    out.extend((0..BLOCK).map(|_| (r.next() % 150_000) as u32));
}

/// A chain of blocks: content seeds and engine hashes (vLLM-style, chained).
#[derive(Clone)]
struct Chain {
    content: Vec<u64>,
    hashes: Vec<u64>,
}

impl Chain {
    fn new(parent_hash: u64, content: Vec<u64>) -> Chain {
        let mut prev = parent_hash;
        let hashes = content
            .iter()
            .map(|c| {
                prev = mix64(prev ^ c);
                prev
            })
            .collect();
        Chain { content, hashes }
    }
}

/// What one simulated engine rank has cached: chains, least recently used
/// first (a prompt moves to the back when a request reuses it).
struct Engine {
    cached: VecDeque<(Option<usize>, Vec<u64>)>,
    blocks: usize,
    /// Whether it has had to evict yet (its cache was full once).
    full: bool,
}

/// The fleet's traffic: shared system prompts (a skewed choice of 100,
/// 64..256 blocks) each followed by a request's own 8..64 blocks.
struct Fleet {
    prompts: Vec<Chain>,
    engines: Vec<Engine>,
    rng: SplitMix,
    next_content: u64,
}

/// One engine step's payload and its block counts.
struct Step {
    worker: usize,
    payload: Vec<u8>,
    stored: u64,
    removed: u64,
}

impl Fleet {
    fn new() -> Fleet {
        let mut rng = SplitMix(2024);
        let prompts = (0..PROMPTS)
            .map(|_| {
                let len = 64 + rng.below(193) as usize;
                Chain::new(0, (0..len).map(|_| rng.next()).collect())
            })
            .collect();
        Fleet {
            prompts,
            engines: (0..WORKERS)
                .map(|_| Engine {
                    cached: VecDeque::new(),
                    blocks: 0,
                    full: false,
                })
                .collect(),
            rng,
            next_content: 1,
        }
    }

    /// Bytes the simulated engines themselves hold (their cached chains),
    /// to tell the index's memory from the bench's.
    fn bytes(&self) -> u64 {
        let prompts: usize = self
            .prompts
            .iter()
            .map(|p| (p.content.capacity() + p.hashes.capacity()) * 8)
            .sum();
        let engines: usize = self
            .engines
            .iter()
            .map(|e| {
                e.cached.capacity() * std::mem::size_of::<(Option<usize>, Vec<u64>)>()
                    + e.cached.iter().map(|c| c.1.capacity() * 8).sum::<usize>()
            })
            .sum();
        (prompts + engines) as u64
    }

    /// One request on a random rank: evictions (one `BlockRemoved` per
    /// block, tail first, as vLLM's GPU pool sends them) and one
    /// `BlockStored` of its new blocks, in one batch. Returns the step and
    /// the request's full token ids.
    fn request(&mut self) -> (Step, Vec<u32>) {
        let w = self.rng.below(WORKERS as u64) as usize;
        // Skewed: low prompt indices are popular.
        let p = {
            let a = self.rng.below(PROMPTS as u64);
            let b = self.rng.below(PROMPTS as u64);
            a.min(b) as usize
        };
        let user = 8 + self.rng.below(57) as usize;
        let prompt = &self.prompts[p];
        let engine = &mut self.engines[w];
        let has_prompt = if let Some(i) = engine.cached.iter().position(|c| c.0 == Some(p)) {
            let c = engine.cached.remove(i).expect("present");
            engine.cached.push_back(c);
            true
        } else {
            false
        };
        let content: Vec<u64> = (0..user)
            .map(|_| {
                self.next_content += 1;
                mix64(self.next_content ^ 0x5eed)
            })
            .collect();
        let mine = Chain::new(prompt.hashes[prompt.hashes.len() - 1], content);
        let new_blocks = user + if has_prompt { 0 } else { prompt.hashes.len() };
        let mut events = Vec::new();
        let mut removed = 0u64;
        while engine.blocks + new_blocks > CAPACITY {
            engine.full = true;
            let Some((_, hashes)) = engine.cached.pop_front() else {
                break;
            };
            engine.blocks -= hashes.len();
            removed += hashes.len() as u64;
            for h in hashes.iter().rev() {
                events.push(KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![BlockHash::Uint(*h)],
                    medium: Some("GPU".into()),
                    group_idx: Some(0),
                    ..BlockRemoved::default()
                }));
            }
        }
        let mut tokens = Vec::with_capacity((prompt.hashes.len() + user) * BLOCK);
        for c in &prompt.content {
            block_tokens(*c, &mut tokens);
        }
        let prompt_tokens = tokens.len();
        for c in &mine.content {
            block_tokens(*c, &mut tokens);
        }
        let (hashes, parent, stored_tokens) = if has_prompt {
            (
                mine.hashes.clone(),
                Some(prompt.hashes[prompt.hashes.len() - 1]),
                tokens[prompt_tokens..].to_vec(),
            )
        } else {
            engine.cached.push_back((Some(p), prompt.hashes.clone()));
            engine.blocks += prompt.hashes.len();
            let mut all = prompt.hashes.clone();
            all.extend_from_slice(&mine.hashes);
            (all, None, tokens.clone())
        };
        engine.cached.push_back((None, mine.hashes));
        engine.blocks += user;
        let n = hashes.len();
        events.push(KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.into_iter().map(BlockHash::Uint).collect(),
            parent_block_hash: parent.map(BlockHash::Uint),
            token_ids: stored_tokens,
            block_size: BLOCK as u32,
            medium: Some("GPU".into()),
            extra_keys: Some(vec![None; n]),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            ..BlockStored::default()
        }));
        let batch = EventBatch {
            ts: 1_767_225_600.0,
            events,
            dp_rank: Some((w % RANKS) as i64),
            has_rank_field: true,
            ..EventBatch::default()
        };
        let step = Step {
            worker: w,
            payload: encode_batch(&batch, EncodeForm::VllmMap),
            stored: n as u64,
            removed,
        };
        (step, tokens)
    }
}

fn pct(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (p * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|x| x.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}

fn main() {
    let json = std::env::args().any(|a| a == "--json");
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "kinference-kvindex: fleet of {PODS} pods x {RANKS} DP ranks (load before: {})",
        load.trim()
    );
    let ix = KvIndex::new(IndexConfig {
        max_workers: WORKERS as u32,
        ..IndexConfig::default()
    });
    let ids: Vec<WorkerId> = (0..WORKERS)
        .map(|w| {
            ix.register_worker(
                WorkerRef::new(format!("pod{}", w / RANKS), (w % RANKS) as u32),
                16,
            )
            .expect("registers")
        })
        .collect();
    let h0 = ALLOC.allocated() as u64;
    let rss0 = rss_bytes();
    let mut fleet = Fleet::new();

    // Warm-up: requests until every rank's cache has been full.
    let t = Instant::now();
    let mut warm = 0u64;
    let mut filled = 0;
    while filled < WORKERS {
        if warm.is_multiple_of(4096) {
            filled = fleet.engines.iter().filter(|e| e.full).count();
        }
        let (s, _) = fleet.request();
        let b = decode_batch(&s.payload).expect("decodes");
        ix.apply_batch(ids[s.worker], &b).expect("applies");
        warm += 1;
    }
    let entries = ix.entries();
    let sim = fleet.bytes();
    let heap = (ALLOC.allocated() as u64 - h0).saturating_sub(sim);
    let rss1 = rss_bytes();
    println!(
        "warm-up: {warm} requests in {:.1} s; {entries} entries, {:.1} allocator bytes/entry for the index (the simulated engines' own {:.0} MiB left out), RSS +{:.0} MiB",
        t.elapsed().as_secs_f64(),
        heap as f64 / entries as f64,
        sim as f64 / 1_048_576.0,
        rss1.saturating_sub(rss0) as f64 / 1_048_576.0
    );

    // Steady state: a writer applies chunks of requests as fast as it can;
    // a reader looks up recent requests' prompts meanwhile.
    let writing = AtomicBool::new(false);
    let done = AtomicBool::new(false);
    let queries: Mutex<VecDeque<Vec<BlockKey>>> = Mutex::new(VecDeque::new());
    let keyer = BlockKeyer::new(16, None);
    let (mut bytes, mut events, mut stored, mut removed, mut secs) = (0u64, 0u64, 0u64, 0u64, 0f64);
    let mut lat = Vec::new();
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut m = Matches::default();
            let mut lat = Vec::with_capacity(1 << 20);
            let mut r = SplitMix(77);
            while !done.load(Ordering::Acquire) {
                let q = {
                    let qs = queries.lock().unwrap_or_else(PoisonError::into_inner);
                    if qs.is_empty() {
                        None
                    } else {
                        Some(qs[r.below(qs.len() as u64) as usize].clone())
                    }
                };
                let Some(q) = q else {
                    std::thread::yield_now();
                    continue;
                };
                if !writing.load(Ordering::Acquire) {
                    std::thread::yield_now();
                    continue;
                }
                let t = Instant::now();
                ix.find_matches_into(&q, &mut m);
                let e = t.elapsed().as_nanos() as u64;
                if writing.load(Ordering::Acquire) {
                    lat.push(e);
                }
                std::hint::black_box(m.len());
            }
            lat
        });
        for _ in 0..CHUNKS {
            let mut steps = Vec::with_capacity(CHUNK);
            for i in 0..CHUNK {
                let (s, tokens) = fleet.request();
                if i % 16 == 0 {
                    let mut qs = queries.lock().unwrap_or_else(PoisonError::into_inner);
                    qs.push_back(keyer.keys(&tokens, &ExtraKeys::none()));
                    if qs.len() > 512 {
                        qs.pop_front();
                    }
                }
                steps.push(s);
            }
            writing.store(true, Ordering::Release);
            let t = Instant::now();
            for s in &steps {
                let b = decode_batch(&s.payload).expect("decodes");
                events += b.events.len() as u64;
                ix.apply_batch(ids[s.worker], &b).expect("applies");
            }
            secs += t.elapsed().as_secs_f64();
            writing.store(false, Ordering::Release);
            for s in &steps {
                bytes += s.payload.len() as u64;
                stored += s.stored;
                removed += s.removed;
            }
        }
        done.store(true, Ordering::Release);
        lat = reader.join().expect("reader");
    });
    lat.sort_unstable();
    let mb_s = bytes as f64 / secs / 1e6;
    let stats = ix.stats();
    println!(
        "applied: {:.0} MB/s of payload, {:.2} M events/s, {:.2} M blocks/s stored + {:.2} M removed ({:.0} B of payload per block op)",
        mb_s,
        events as f64 / secs / 1e6,
        stored as f64 / secs / 1e6,
        removed as f64 / secs / 1e6,
        bytes as f64 / (stored + removed) as f64
    );
    println!(
        "busy pods one core keeps up with at {:.0} MB/s each: {:.0} (fleet: {PODS})",
        POD_RATE / 1e6,
        bytes as f64 / secs / POD_RATE
    );
    println!(
        "lookups during apply: median / p99 {} / {} ns over {} lookups",
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        lat.len()
    );
    println!(
        "index: {} entries, {} keys, {} nodes, {:.1} MiB by its estimate, RSS {:.0} MiB",
        stats.entries,
        stats.keys,
        stats.nodes,
        stats.bytes as f64 / 1_048_576.0,
        rss_bytes() as f64 / 1_048_576.0
    );
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load after: {}", load.trim());
    if json {
        println!(
            "{{\"mb_s\":{mb_s},\"events_s\":{},\"stored_s\":{},\"removed_s\":{},\"pods\":{},\"lookup_med\":{},\"lookup_p99\":{},\"lookups\":{},\"entries\":{},\"heap_per_entry\":{}}}",
            events as f64 / secs,
            stored as f64 / secs,
            removed as f64 / secs,
            bytes as f64 / secs / POD_RATE,
            pct(&lat, 0.5),
            pct(&lat, 0.99),
            lat.len(),
            entries,
            heap as f64 / entries as f64
        );
    }
}
