//! A toy fleet to see what the policies do, not a benchmark of record (the
//! harness on `kinference-sim` is).
//!
//! Engines run continuous batching with chunked prefill: each step gives one
//! token of an 8192-token budget to every decoding sequence and the rest to
//! prefill chunks, oldest first, and takes `a + b·(prefill tokens) +
//! c·(decoding sequences)`. Each engine has an LRU prefix cache of full
//! 16-token blocks; blocks become reusable as soon as their chunk is
//! computed. The engines are deliberately 20 % slower than the `default`
//! profile assumes, so calibration has something to do.
//!
//! Workload: 200 groups of users sharing a system prompt of 1.5k–5k tokens
//! (Zipf-like popularity), a unique question of 50–550 tokens each, 20–300
//! output tokens, Poisson arrivals; the first quarter of requests warms the
//! caches and is not counted. The router sees the engines' caches exactly (an
//! instant KV index) and keeps its own in-flight accounting; hit % is the
//! share of prompt tokens served from cache.
//!
//! ```text
//! cargo run --release -p kinference-scoring --example fleet [-- SEED]
//! ```

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::time::Duration;

use kinference_scoring::{
    CacheSource, CachedBlocks, Candidate, EndpointId, InFlight, LatencyParams, Pick, Policy,
    PolicyName, Prediction, RandomSource, Request, SplitMix64,
};

const BLOCK: u32 = 16;
const BUDGET: u32 = 8192;
/// True engine: 20 % slower prefill and steps than the profile assumes.
const STEP_A_MS: f64 = 7.2;
const PREFILL_MS_PER_TOKEN: f64 = 1.2 / 25.0;
const DECODE_MS_PER_SEQ: f64 = 0.12;
/// ~320k tokens of prefix cache per engine.
const CACHE_BLOCKS: usize = 20_000;
const ENGINES: usize = 8;
const GROUPS: u64 = 200;
const REQUESTS: usize = 20_000;
/// Requests before this one warm the caches and are not counted.
const WARMUP: usize = REQUESTS / 4;

struct Req {
    arrival: f64,
    blocks: Vec<u64>,
    prompt: u32,
    output: u32,
}

/// LRU set of block keys.
#[derive(Default)]
struct Lru {
    at: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
    tick: u64,
}

impl Lru {
    fn touch(&mut self, key: u64) {
        self.tick += 1;
        if let Some(old) = self.at.insert(key, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, key);
        while self.at.len() > CACHE_BLOCKS {
            let Some((_, k)) = self.order.pop_first() else {
                break;
            };
            self.at.remove(&k);
        }
    }

    fn leading(&self, blocks: &[u64]) -> u32 {
        blocks
            .iter()
            .take_while(|b| self.at.contains_key(b))
            .count() as u32
    }
}

struct Active {
    req: usize,
    computed: u32,
    decoded: u32,
    prediction: Prediction,
    uncached: u32,
}

#[derive(Default)]
struct Engine {
    waiting: VecDeque<Active>,
    prefilling: Vec<Active>,
    decoding: Vec<Active>,
    cache: Lru,
    busy: bool,
    /// Chunks of the step in flight: (index in `prefilling`, tokens).
    step: Vec<(usize, u32)>,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    StepDone(usize),
    Arrival(usize),
}

fn workload(rate: f64, rng: &mut SplitMix64) -> Vec<Req> {
    let mut unit = || (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    let mut t = 0.0;
    let system: Vec<u32> = (0..GROUPS)
        .map(|g| 1500 + (g as u32 * 397) % 3500)
        .collect();
    let mut out = Vec::with_capacity(REQUESTS);
    for i in 0..REQUESTS {
        t += -unit().max(1e-12).ln() / rate;
        // Zipf-ish popularity: a few groups are hot.
        let g = ((unit().powf(2.0)) * GROUPS as f64) as u64;
        let question = 50 + (unit() * 500.0) as u32;
        let prompt = system[g as usize] + question;
        let shared = system[g as usize] / BLOCK;
        let blocks = (0..prompt / BLOCK)
            .map(|b| {
                if b < shared {
                    g << 32 | u64::from(b)
                } else {
                    (1 << 63) | (i as u64) << 20 | u64::from(b)
                }
            })
            .collect();
        out.push(Req {
            arrival: t,
            blocks,
            prompt,
            output: 20 + (unit() * 280.0) as u32,
        });
    }
    out
}

struct Outcome {
    ttft_ms: Vec<f64>,
    cached_tokens: u64,
    prompt_tokens: u64,
    abs_error_ms: f64,
}

fn run(policy: &mut Policy, reqs: &[Req], seed: u64) -> Outcome {
    let mut rng = SplitMix64::new(seed);
    let mut engines: Vec<Engine> = (0..ENGINES).map(|_| Engine::default()).collect();
    let mut in_flight = [InFlight::default(); ENGINES];
    let mut events: BinaryHeap<Reverse<(u64, Event)>> = BinaryHeap::new();
    let micros = |s: f64| (s * 1e6) as u64;
    for (i, r) in reqs.iter().enumerate() {
        events.push(Reverse((micros(r.arrival), Event::Arrival(i))));
    }
    let mut out = Outcome {
        ttft_ms: Vec::new(),
        cached_tokens: 0,
        prompt_tokens: 0,
        abs_error_ms: 0.0,
    };
    let mut candidates = Vec::with_capacity(ENGINES);

    // Start a step on an idle engine with work; returns its duration in µs.
    let start_step = |engine: &mut Engine| -> Option<u64> {
        let mut budget = BUDGET.saturating_sub(engine.decoding.len() as u32);
        engine.step.clear();
        let mut tokens = 0;
        let mut i = 0;
        while budget > 0 {
            if i == engine.prefilling.len() {
                let Some(mut act) = engine.waiting.pop_front() else {
                    break;
                };
                // Admission: reuse the cached prefix (at most prompt − 1).
                let req = &reqs[act.req];
                let hit = (engine.cache.leading(&req.blocks) * BLOCK).min(req.prompt - 1);
                act.computed = hit;
                engine.prefilling.push(act);
            }
            let act = &engine.prefilling[i];
            let left = reqs[act.req].prompt - act.computed;
            let chunk = left.min(budget);
            engine.step.push((i, chunk));
            budget -= chunk;
            tokens += chunk;
            i += 1;
        }
        if tokens == 0 && engine.decoding.is_empty() {
            return None;
        }
        let ms = STEP_A_MS
            + PREFILL_MS_PER_TOKEN * f64::from(tokens)
            + DECODE_MS_PER_SEQ * engine.decoding.len() as f64;
        Some((ms * 1e3) as u64)
    };

    while let Some(Reverse((now, event))) = events.pop() {
        let now_d = Duration::from_micros(now);
        match event {
            Event::Arrival(i) => {
                let req = &reqs[i];
                candidates.clear();
                for (idx, engine) in engines.iter().enumerate() {
                    candidates.push(Candidate {
                        endpoint: EndpointId(idx as u32),
                        cached: CachedBlocks {
                            gpu: engine.cache.leading(&req.blocks),
                            cpu: 0,
                            disk: 0,
                            storage: 0,
                        },
                        in_flight: in_flight[idx],
                        engine: None,
                        evidence: kinference_scoring::Evidence::default(),
                        adapter: kinference_scoring::AdapterSlot::Unknown,
                        // What the router's index shows: the blocks held.
                        room: kinference_scoring::KvRoom {
                            capacity_blocks: CACHE_BLOCKS as u32,
                            used_blocks: engine.cache.at.len() as u32,
                        },
                        session_blocks: 0,
                        peer_arrival_rate: 0.0,
                    });
                }
                let request = Request {
                    prompt_tokens: req.prompt,
                    block_tokens: BLOCK,
                    cache: CacheSource::Index,
                    ttft_target: None,
                };
                let choice = policy
                    .pick(&request, &candidates, now_d, &mut rng)
                    .expect("candidates");
                let to = choice.index;
                let acct = &mut in_flight[to];
                acct.requests += 1;
                acct.prefill_tokens += u64::from(choice.uncached_tokens());
                acct.context_tokens += u64::from(req.prompt);
                engines[to].waiting.push_back(Active {
                    req: i,
                    computed: 0,
                    decoded: 0,
                    prediction: choice.prediction,
                    uncached: choice.uncached_tokens(),
                });
                if !engines[to].busy
                    && let Some(us) = start_step(&mut engines[to])
                {
                    engines[to].busy = true;
                    events.push(Reverse((now + us, Event::StepDone(to))));
                }
            }
            Event::StepDone(at) => {
                let engine = &mut engines[at];
                // Decoders emit a token each.
                let mut finished = Vec::new();
                for (j, act) in engine.decoding.iter_mut().enumerate() {
                    act.decoded += 1;
                    if act.decoded >= reqs[act.req].output {
                        finished.push(j);
                    }
                }
                for &j in finished.iter().rev() {
                    let act = engine.decoding.swap_remove(j);
                    let acct = &mut in_flight[at];
                    acct.requests -= 1;
                    acct.decoding -= 1;
                    acct.context_tokens -= u64::from(reqs[act.req].prompt);
                }
                // Prefill chunks land; computed blocks become reusable.
                let step = std::mem::take(&mut engine.step);
                for &(i, chunk) in &step {
                    let act = &mut engine.prefilling[i];
                    let req = &reqs[act.req];
                    let before = act.computed / BLOCK;
                    act.computed += chunk;
                    for b in before..(act.computed / BLOCK).min(req.blocks.len() as u32) {
                        engine.cache.touch(req.blocks[b as usize]);
                    }
                }
                // Reuse refreshes the prefix too (LRU by use).
                let mut done = Vec::new();
                for (i, act) in engine.prefilling.iter().enumerate() {
                    if act.computed >= reqs[act.req].prompt {
                        done.push(i);
                    }
                }
                for &i in done.iter().rev() {
                    let mut act = engine.prefilling.remove(i);
                    let req = &reqs[act.req];
                    for &b in &req.blocks {
                        engine.cache.touch(b);
                    }
                    let ttft = now as f64 / 1e3 - req.arrival * 1e3;
                    if act.req >= WARMUP {
                        out.ttft_ms.push(ttft);
                        out.abs_error_ms += (ttft - act.prediction.ttft_ms).abs();
                        out.prompt_tokens += u64::from(req.prompt);
                        out.cached_tokens += u64::from(req.prompt - act.uncached.min(req.prompt));
                    }
                    let acct = &mut in_flight[at];
                    acct.prefill_tokens -= u64::from(act.uncached);
                    acct.decoding += 1;
                    policy.observe(
                        EndpointId(at as u32),
                        &act.prediction,
                        Duration::from_secs_f64(ttft / 1e3),
                        now_d,
                    );
                    act.decoded = 1;
                    if act.decoded >= req.output {
                        acct.requests -= 1;
                        acct.decoding -= 1;
                        acct.context_tokens -= u64::from(req.prompt);
                    } else {
                        engine.decoding.push(act);
                    }
                }
                engine.busy = false;
                if let Some(us) = start_step(engine) {
                    engine.busy = true;
                    events.push(Reverse((now + us, Event::StepDone(at))));
                }
            }
        }
    }
    out
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    let seed: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let defaults = LatencyParams::default();
    let mut setups: Vec<(String, Policy)> = vec![
        (
            "kinference".into(),
            Policy::new(PolicyName::Kinference, defaults),
        ),
        (
            "kinference, no externality".into(),
            Policy::new(
                PolicyName::Kinference,
                LatencyParams {
                    externality_cap: 0.0,
                    ..defaults
                },
            ),
        ),
        (
            "kinference, no calibration".into(),
            Policy::new(
                PolicyName::Kinference,
                LatencyParams {
                    calibrate: false,
                    ..defaults
                },
            ),
        ),
    ];
    for name in PolicyName::ALL.into_iter().skip(1) {
        setups.push((name.as_str().into(), Policy::new(name, defaults)));
    }
    println!(
        "{ENGINES} engines, {GROUPS} prefix groups, {REQUESTS} requests per run ({WARMUP} warm-up), seed {seed}"
    );
    for rate in [100.0, 150.0, 200.0, 250.0, 300.0] {
        let reqs = workload(rate, &mut SplitMix64::new(seed));
        println!("\nrate {rate} req/s");
        println!(
            "{:<28} {:>8} {:>9} {:>9} {:>9} {:>10}",
            "policy", "hit %", "p50 ms", "p90 ms", "p99 ms", "|err| ms"
        );
        for (label, policy) in &setups {
            let mut policy = policy.clone();
            let mut o = run(&mut policy, &reqs, seed);
            o.ttft_ms.sort_by(f64::total_cmp);
            println!(
                "{:<28} {:>8.1} {:>9.0} {:>9.0} {:>9.0} {:>10.0}",
                label,
                100.0 * o.cached_tokens as f64 / o.prompt_tokens as f64,
                quantile(&o.ttft_ms, 0.5),
                quantile(&o.ttft_ms, 0.9),
                quantile(&o.ttft_ms, 0.99),
                o.abs_error_ms / o.ttft_ms.len() as f64,
            );
        }
    }
}
