use super::*;
use crate::config::{EngineConfig, LatencyModel, OutputLen};

fn core_with(cfg: EngineConfig, output: OutputLen) -> EngineCore {
    EngineCore::new(
        cfg,
        EngineMode::default(),
        LatencyModel::default(),
        output,
        32_768,
        42,
        SimTokenizer::word_level(),
    )
}

fn core(num_gpu_blocks: usize) -> EngineCore {
    core_with(
        EngineConfig {
            num_gpu_blocks,
            ..EngineConfig::default()
        },
        OutputLen::default(),
    )
}

fn req(prompt: Vec<u32>, max_tokens: usize) -> NewRequest {
    NewRequest {
        prompt,
        max_tokens: Some(max_tokens),
        ..NewRequest::default()
    }
}

/// Runs steps back to back from `now` until idle. Returns every output with
/// the time of the step that produced it, and the events of each step.
fn run(core: &mut EngineCore, mut now: f64) -> (Vec<(f64, StepOut)>, Vec<Vec<SimEvent>>, f64) {
    let mut outs = Vec::new();
    let mut batches = Vec::new();
    while let Some(step) = core.schedule(now) {
        now += step.duration;
        for o in core.finish_step(&step, now) {
            outs.push((now, o));
        }
        batches.push(core.take_events());
    }
    (outs, batches, now)
}

fn first_token_time(outs: &[(f64, StepOut)], id: ReqId) -> f64 {
    outs.iter()
        .find(|(_, o)| o.id == id)
        .map(|(t, _)| *t)
        .expect("the request produced a token")
}

/// The token ids and hashes of vLLM 0.33's `sha256_cbor-int/stored_chain`
/// fixture: two events, 3 blocks then 2 chained blocks.
fn fixture_chain() -> (Vec<Vec<u32>>, Vec<Vec<u64>>, Option<u64>) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/kv-events/manifest.json"
    );
    let text = std::fs::read_to_string(path).expect("testdata/kv-events/manifest.json is readable");
    let manifest: serde_json::Value = serde_json::from_str(&text).expect("manifest is JSON");
    let entry = manifest["fixtures"]
        .as_array()
        .expect("fixtures list")
        .iter()
        .find(|f| f["file"] == "vllm-0.33.0/sha256_cbor-int/stored_chain.msgpack")
        .expect("the stored_chain fixture is listed");
    let events = entry["normalized"]["events"].as_array().expect("events");
    let ids = |v: &serde_json::Value| -> Vec<u64> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|x| x.as_u64().expect("u64"))
            .collect()
    };
    let tokens = events
        .iter()
        .map(|e| ids(&e["token_ids"]).into_iter().map(|t| t as u32).collect())
        .collect();
    let hashes = events.iter().map(|e| ids(&e["block_hashes"])).collect();
    (tokens, hashes, events[1]["parent_block_hash"].as_u64())
}

#[test]
fn hashes_and_chaining_equal_vllm_for_the_same_tokens() {
    let (tokens, hashes, parent) = fixture_chain();
    let a = tokens[0].clone();
    let mut b = a.clone();
    b.extend_from_slice(&tokens[1]);
    let mut c = core(64);
    // Two prompts arriving together: vLLM runs them in one step, and the
    // second finds the first's blocks already cached at its admission.
    c.add_request(req(a, 1), 0.0).expect("fits");
    c.add_request(req(b, 1), 0.0).expect("fits");
    let step = c.schedule(0.0).expect("work");
    assert_eq!(step.prefill_tokens, 48 + 32);
    let events = c.take_events();
    let [
        SimEvent::Stored {
            digests: d0,
            parent: p0,
            tokens: t0,
            lora: None,
            ..
        },
        SimEvent::Stored {
            digests: d1,
            parent: p1,
            tokens: t1,
            lora: None,
            ..
        },
    ] = events.as_slice()
    else {
        panic!("expected two BlockStored, got {events:?}")
    };
    assert_eq!(d0.iter().map(Digest::id).collect::<Vec<_>>(), hashes[0]);
    assert_eq!(d1.iter().map(Digest::id).collect::<Vec<_>>(), hashes[1]);
    assert_eq!(*p0, None);
    assert_eq!(p1.map(|d| d.id()), parent);
    assert_eq!((t0, t1), (&tokens[0], &tokens[1]));
    assert_eq!(c.stats().prefix_cache_hits, 48);
}

#[test]
fn eviction_takes_the_tail_of_the_last_freed_request_first() {
    let (tokens, hashes, _) = fixture_chain();
    let a = tokens[0].clone();
    let mut b = a.clone();
    b.extend_from_slice(&tokens[1]);
    // 5 usable blocks: exactly A's 3 shared blocks and B's 2.
    let mut c = core(6);
    c.add_request(req(a, 1), 0.0).expect("fits");
    c.add_request(req(b, 1), 0.0).expect("fits");
    let (_, _, now) = run(&mut c, 0.0);
    assert_eq!(c.free_blocks(), 5);
    // A 20-token prompt needs 2 blocks: the two least recently freed, which
    // are B's last and second-to-last blocks.
    c.add_request(req((1..=20).collect(), 1), now)
        .expect("fits");
    c.schedule(now).expect("work");
    let removed: Vec<u64> = c
        .take_events()
        .iter()
        .filter_map(|e| match e {
            SimEvent::Removed { digest, .. } => Some(digest.id()),
            _ => None,
        })
        .collect();
    assert_eq!(removed, vec![hashes[1][1], hashes[1][0]]);
    assert_eq!(c.stats().blocks_removed, 2);
}

#[test]
fn a_repeated_long_prompt_is_much_faster_than_a_cold_one() {
    let mut c = core(4096);
    let prompt: Vec<u32> = (0..8000).map(|i| 100 + i % 5000).collect();
    let id = c.add_request(req(prompt.clone(), 4), 0.0).expect("fits");
    let (outs, _, now) = run(&mut c, 0.0);
    let cold = first_token_time(&outs, id);
    let id = c.add_request(req(prompt, 4), now).expect("fits");
    let (outs, _, _) = run(&mut c, now);
    let warm = first_token_time(&outs, id) - now;
    // Cold: 4 chunked prefill steps over 8000 tokens. Warm: 7984 tokens hit,
    // 16 computed in one step.
    assert!(
        (cold - (4.0 * 5.0 + 8000.0 * 0.086) / 1e3).abs() < 1e-9,
        "cold {cold}"
    );
    assert!(
        (warm - (5.0 + 16.0 * 0.086) / 1e3).abs() < 1e-9,
        "warm {warm}"
    );
    assert!(cold > 50.0 * warm);
    let rec: Vec<&RequestRecord> = c.recent().collect();
    assert_eq!((rec[0].cached_tokens, rec[1].cached_tokens), (0, 7984));
    assert_eq!(c.stats().prefix_cache_queries, 16_000);
    assert_eq!(c.stats().prefix_cache_hits, 7984);
}

#[test]
fn ttft_grows_with_load() {
    // Mean TTFT of n distinct 1000-token prompts arriving at once.
    let mean_ttft = |n: usize| {
        let mut c = core(8192);
        let ids: Vec<ReqId> = (0..n)
            .map(|i| {
                let p: Vec<u32> = (0..1000).map(|t| (i * 1000 + t) as u32).collect();
                c.add_request(req(p, 16), 0.0).expect("fits")
            })
            .collect();
        let (outs, _, _) = run(&mut c, 0.0);
        ids.iter()
            .map(|id| first_token_time(&outs, *id))
            .sum::<f64>()
            / n as f64
    };
    let (one, eight, thirty_two) = (mean_ttft(1), mean_ttft(8), mean_ttft(32));
    assert!(
        one < eight && eight < thirty_two,
        "{one} {eight} {thirty_two}"
    );
    assert!(thirty_two > 5.0 * one);
}

#[test]
fn max_num_seqs_and_budget_bound_a_step() {
    let mut c = core_with(
        EngineConfig {
            max_num_seqs: 3,
            max_num_batched_tokens: 100,
            ..EngineConfig::default()
        },
        OutputLen::default(),
    );
    for i in 0..5 {
        c.add_request(req(vec![i; 40], 2), 0.0).expect("fits");
    }
    let s = c.schedule(0.0).expect("work");
    // 40 + 40 + 20 (a chunk of the third): the budget, and 3 sequences.
    assert_eq!(
        s.entries.iter().map(|e| e.1).collect::<Vec<_>>(),
        vec![40, 40, 20]
    );
    assert_eq!((c.num_running(), c.num_waiting()), (3, 2));
    let outs = c.finish_step(&s, s.duration);
    assert_eq!(outs.len(), 2, "the chunked prompt samples nothing");
}

#[test]
fn runs_are_deterministic_for_a_seed() {
    let go = |seed: u64| {
        let mut c = EngineCore::new(
            EngineConfig::default(),
            EngineMode::default(),
            LatencyModel::default(),
            OutputLen::Uniform { min: 1, max: 50 },
            32_768,
            seed,
            SimTokenizer::word_level(),
        );
        for i in 0..20u32 {
            c.add_request(req((0..100 + i).collect(), 64), f64::from(i) * 0.01)
                .expect("fits");
        }
        let (outs, batches, end) = run(&mut c, 0.0);
        (outs, batches, end)
    };
    assert_eq!(go(1), go(1));
    assert_ne!(go(1).0, go(2).0);
    let (outs, ..) = go(1);
    let stops = outs
        .iter()
        .filter(|(_, o)| o.finished.is_some_and(|f| f.reason == FinishReason::Stop))
        .count();
    assert!(
        stops > 0,
        "sampled lengths below max_tokens finish with stop"
    );
}

#[test]
fn the_same_prompt_gets_the_same_answer_on_any_engine() {
    let answer = |warmup: bool| {
        let mut c = core(1024);
        if warmup {
            c.add_request(req(vec![5; 300], 7), 0.0).expect("fits");
            run(&mut c, 0.0);
        }
        let id = c.add_request(req(vec![9; 64], 10), 0.0).expect("fits");
        let (outs, ..) = run(&mut c, 0.0);
        outs.into_iter()
            .filter(|(_, o)| o.id == id)
            .map(|(_, o)| o.token)
            .collect::<Vec<_>>()
    };
    assert_eq!(answer(false), answer(true));
}

#[test]
fn preemption_recomputes_and_everything_is_freed() {
    // 9 usable blocks of 16 tokens; three requests that each grow to 4 blocks.
    let mut c = core(10);
    for i in 0..3u32 {
        c.add_request(req(vec![i + 1; 30], 30), 0.0).expect("fits");
    }
    let (outs, _, _) = run(&mut c, 0.0);
    assert!(
        c.stats().preemptions > 0,
        "the pool is too small for all three"
    );
    let done: Vec<&Finished> = outs
        .iter()
        .filter_map(|(_, o)| o.finished.as_ref())
        .collect();
    assert_eq!(done.len(), 3);
    assert!(done.iter().all(|f| f.completion_tokens == 30));
    assert_eq!(c.free_blocks(), c.capacity_blocks());
}

#[test]
fn decode_blocks_are_cached_with_the_generated_tokens() {
    let mut c = core(64);
    c.add_request(req(vec![3; 16], 20), 0.0).expect("fits");
    let (outs, batches, _) = run(&mut c, 0.0);
    let generated: Vec<u32> = outs.iter().map(|(_, o)| o.token).collect();
    let stored: Vec<&Vec<u32>> = batches
        .iter()
        .flatten()
        .filter_map(|e| match e {
            SimEvent::Stored { tokens, .. } => Some(tokens),
            _ => None,
        })
        .collect();
    // Block 1 = the prompt; block 2 = the first 16 generated tokens, stored
    // when its last token was fed (the 17th token's step). The last sampled
    // token is never fed.
    assert_eq!(stored.len(), 2);
    assert_eq!(stored[1], &generated[..16].to_vec());
}

#[test]
fn reset_needs_an_idle_engine_and_clears() {
    let mut c = core(64);
    c.add_request(req(vec![1; 40], 3), 0.0).expect("fits");
    c.schedule(0.0).expect("work");
    assert!(!c.reset_prefix_cache(), "a running request holds blocks");
    run(&mut c, 0.0);
    c.take_events();
    assert!(c.cached_prefix_tokens(&[1; 40]) > 0);
    assert!(c.reset_prefix_cache());
    assert_eq!(c.take_events(), vec![SimEvent::Cleared]);
    assert_eq!(c.cached_prefix_tokens(&[1; 40]), 0);
    assert_eq!(c.cached_counts(), (0, 0));
}

#[test]
fn aborts_free_blocks_between_steps() {
    let mut c = core(64);
    let id = c.add_request(req(vec![1; 100], 50), 0.0).expect("fits");
    let s = c.schedule(0.0).expect("work");
    c.abort(id);
    // The step in flight completes; the abort lands at the next schedule.
    assert_eq!(c.finish_step(&s, 0.1).len(), 1);
    assert!(c.schedule(0.1).is_none());
    assert_eq!(c.free_blocks(), c.capacity_blocks());
    assert_eq!(c.stats().finished_abort, 1);
}

#[test]
fn context_length_is_enforced_at_admission() {
    let mut c = EngineCore::new(
        EngineConfig::default(),
        EngineMode::default(),
        LatencyModel::default(),
        OutputLen::default(),
        100,
        0,
        SimTokenizer::word_level(),
    );
    assert!(matches!(
        c.add_request(req(vec![1; 100], 1), 0.0),
        Err(AdmitError::PromptTooLong { .. })
    ));
    assert!(matches!(
        c.add_request(req(vec![1; 90], 11), 0.0),
        Err(AdmitError::MaxTokensTooLarge { .. })
    ));
    assert!(c.add_request(req(vec![1; 90], 10), 0.0).is_ok());
    assert_eq!(
        c.add_request(NewRequest::default(), 0.0),
        Err(AdmitError::EmptyPrompt)
    );
}

/// Stored and removed digests over a run of requests, as (stored, removed).
fn stored_removed(batches: &[Vec<SimEvent>]) -> (Vec<Digest>, Vec<Digest>) {
    let (mut stored, mut removed) = (Vec::new(), Vec::new());
    for e in batches.iter().flatten() {
        match e {
            SimEvent::Stored { digests, .. } => stored.extend(digests),
            SimEvent::Removed { digest, .. } => removed.push(*digest),
            SimEvent::Cleared => {}
        }
    }
    (stored, removed)
}

#[test]
fn sglang_mode_announces_a_prefix_once() {
    // A 32-token prompt sent twice: the second run may hit one block only
    // (the last token is computed), so it recomputes the second block. vLLM
    // caches that block again and announces it; SGLang's radix tree already
    // holds the prefix and says nothing.
    let prompt: Vec<u32> = (1..=32).collect();
    let mut counts = Vec::new();
    for mode in [EngineMode::default(), "sglang".parse().expect("mode")] {
        let mut c = EngineCore::new(
            EngineConfig {
                num_gpu_blocks: 8,
                ..EngineConfig::default()
            },
            mode,
            LatencyModel::default(),
            OutputLen::default(),
            128,
            0,
            SimTokenizer::word_level(),
        );
        let mut batches = Vec::new();
        let mut now = 0.0;
        for _ in 0..2 {
            c.add_request(req(prompt.clone(), 1), now).expect("fits");
            let (_, b, t) = run(&mut c, now);
            batches.extend(b);
            now = t;
        }
        // Evict everything: 7 usable blocks, a 112-token prompt needs 7.
        c.add_request(req((1000..1112).collect(), 1), now)
            .expect("fits");
        let (_, b, _) = run(&mut c, now);
        batches.extend(b);
        let (stored, removed) = stored_removed(&batches);
        let first_two = stored[..2].to_vec();
        let announced = |d: &Digest| stored.iter().filter(|x| *x == d).count();
        let gone = |d: &Digest| removed.iter().filter(|x| *x == d).count();
        counts.push((announced(&first_two[1]), gone(&first_two[1])));
        assert_eq!(
            c.hasher().is_sglang(),
            mode.is_sglang(),
            "the mode picks the hasher"
        );
    }
    assert_eq!(
        counts[0],
        (2, 2),
        "vLLM: two copies, each stored and evicted"
    );
    assert_eq!(
        counts[1],
        (1, 1),
        "SGLang: one prefix, stored and removed once"
    );
}

/// A core serving adapters `a`, `b`, `c` (ids 1, 2, 3) with `max_loras`
/// slots, each load costing 25 ms.
fn lora_core(max_loras: usize) -> EngineCore {
    core(256).with_loras(&crate::LoraConfig {
        modules: ["a", "b", "c"]
            .into_iter()
            .map(crate::LoraModule::named)
            .collect(),
        max_loras,
        load_ms: 25.0,
    })
}

fn lora_req(prompt: Vec<u32>, max_tokens: usize, lora: Option<u32>) -> NewRequest {
    NewRequest {
        lora,
        ..req(prompt, max_tokens)
    }
}

#[test]
fn each_adapter_caches_in_its_own_namespace() {
    let mut c = lora_core(3);
    let prompt: Vec<u32> = (1..=33).collect();
    let mut stored = Vec::new();
    let mut now = 0.0;
    for lora in [None, Some(1), Some(2), Some(1)] {
        c.add_request(lora_req(prompt.clone(), 1, lora), now)
            .expect("fits");
        let (_, batches, t) = run(&mut c, now);
        now = t;
        for e in batches.into_iter().flatten() {
            if let SimEvent::Stored { digests, lora, .. } = e {
                stored.push((lora, digests));
            }
        }
    }
    // Base, a and b store two blocks each; the second `a` request hits both.
    assert_eq!(
        stored
            .iter()
            .map(|(l, d)| (*l, d.len()))
            .collect::<Vec<_>>(),
        [(None, 2), (Some(1), 2), (Some(2), 2)]
    );
    for (i, (_, a)) in stored.iter().enumerate() {
        for (_, b) in &stored[i + 1..] {
            assert!(a.iter().all(|d| !b.contains(d)), "namespaces overlap");
        }
    }
    let cached: Vec<usize> = c.recent().map(|r| r.cached_tokens).collect();
    assert_eq!(cached, [0, 0, 0, 32]);
    assert_eq!(
        c.recent().map(|r| r.lora_id).collect::<Vec<_>>(),
        [None, Some(1), Some(2), Some(1)]
    );
    assert_eq!(c.cached_prefix_tokens_for(&prompt, Some(1)), 32);
    assert_eq!(c.cached_prefix_tokens_for(&prompt, Some(3)), 0, "c: none");
    assert_eq!(c.cached_prefix_tokens(&prompt), 32, "the base model's own");
    let snap = c.cache_snapshot(false);
    let per_ns = |l: Option<u32>| snap.iter().filter(|b| b.lora_id == l).count();
    assert_eq!((per_ns(None), per_ns(Some(1)), per_ns(Some(2))), (2, 2, 2));
    assert_eq!(
        c.add_request(lora_req(prompt, 1, Some(4)), now),
        Err(AdmitError::UnknownLora(4))
    );
}

#[test]
fn max_loras_serializes_adapters_but_never_the_base_model() {
    let mut c = lora_core(1);
    let a = c
        .add_request(lora_req(vec![1; 20], 4, Some(1)), 0.0)
        .expect("fits");
    let b = c
        .add_request(lora_req(vec![2; 20], 4, Some(2)), 0.0)
        .expect("fits");
    let base = c.add_request(req(vec![3; 20], 4), 0.0).expect("fits");
    let first = c.schedule(0.0).expect("work");
    let ids: Vec<ReqId> = first.entries.iter().map(|(id, _)| *id).collect();
    assert_eq!(
        ids,
        [a, base],
        "b waits for a slot; the base request does not"
    );
    assert_eq!(c.queue().1, [b]);
    assert_eq!(c.waiting_loras(), [2]);
    assert_eq!(first.lora_loads, 1);
    let plain = LatencyModel::default().step_seconds(first.prefill_tokens, first.decode_seqs);
    assert!((first.duration - plain - 0.025).abs() < 1e-9, "{first:?}");
    c.finish_step(&first, first.duration);
    assert_eq!(c.running_loras(), [1]);
    run(&mut c, first.duration);
    let rec: Vec<RequestRecord> = c.recent().copied().collect();
    let find = |id: ReqId| rec.iter().find(|r| r.id == id).expect("finished");
    let (ra, rb, rbase) = (find(a), find(b), find(base));
    assert!(
        rb.scheduled.expect("ran") >= ra.finished,
        "b starts once a is done: {ra:?} {rb:?}"
    );
    assert_eq!(rbase.scheduled, ra.scheduled);
    assert_eq!(c.stats().lora_loads, 2, "a, then b into a's slot");
    assert_eq!(c.lora_slots(), [2]);
}

#[test]
fn loaded_adapters_stay_in_lru_slots() {
    let mut c = lora_core(2);
    let mut loads = Vec::new();
    let mut now = 0.0;
    for lora in [1, 2, 1, 3, 2] {
        c.add_request(lora_req(vec![lora; 8], 1, Some(lora)), now)
            .expect("fits");
        let step = c.schedule(now).expect("work");
        now += step.duration;
        c.finish_step(&step, now);
        loads.push(step.lora_loads);
    }
    // a, b load; a is resident; c evicts b (least recently used); b evicts a.
    assert_eq!(loads, [1, 1, 0, 1, 1]);
    assert_eq!(c.lora_slots(), [3, 2]);
    assert_eq!(c.stats().lora_loads, 4);
}
