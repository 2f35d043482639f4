//! Hostile KV-event input: a mutational fuzzer over the decoder, the frame
//! parsers and the index.
//!
//! Seeds are every real engine payload and captured frame in
//! `testdata/kv-events` plus batches the encoder writes; each input is a
//! seed mutated by a few random edits (bit flips, MessagePack markers and
//! length fields set to extremes, bytes inserted, deleted, duplicated,
//! truncated, spliced from another seed). Every input goes through
//! [`decode_batch`], the live and replay frame parsers and the `.frames`
//! container reader; every batch that decodes is applied to an index (with
//! a small width, so width checks and re-chunking run) and must re-encode
//! to a batch that decodes to the same events.
//!
//! The property: no panic, no abort, no unbounded allocation. A panic is
//! caught, the input printed in hex and the test fails at the end. Every
//! input also goes through the reference decoder (serde over `rmp-serde`,
//! `tests/support/serde_decode/`): whatever the crate's decoder accepts,
//! the reference accepts too, with the same events, rank and timestamp
//! (the reference is more lenient: it skips and counts invalid UTF-8 and
//! misplaced types the crate's decoder rejects).
//!
//! CI runs 200,000 inputs (debug build, a few seconds);
//! `KINFERENCE_FUZZ_INPUTS=10000000 cargo test --release -p
//! kinference-kvindex --test fuzz -- --nocapture` is the long run
//! (`cargo xtask bench faults` does it) and `KINFERENCE_FUZZ_SEED` picks
//! another sequence.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kinference_kvindex::codec::frames;
use kinference_kvindex::{
    BlockHash, BlockStored, EncodeForm, EventBatch, IndexConfig, KvEvent, KvIndex, WorkerRef,
    decode_batch, encode_batch,
};
use kinference_scoring::{RandomSource as _, SplitMix64 as Rng, below};

#[path = "support/serde_decode/mod.rs"]
#[allow(dead_code)] // each includer uses part of it
mod serde_decode;

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("testdata/kv-events is readable") {
        let p = e.expect("dir entry").path();
        if p.is_dir() {
            walk(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// Every payload and frame of the fixtures, and some encoder output.
fn seeds() -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/kv-events");
    let mut files = Vec::new();
    walk(&dir, &mut files);
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let bytes = std::fs::read(&f).expect("fixture readable");
        match f.extension().and_then(|e| e.to_str()) {
            Some("msgpack") => out.push(bytes),
            Some("frames") => {
                out.push(bytes.clone());
                if let Ok(fr) = frames::read_frames_container(&bytes) {
                    out.extend(fr.into_iter().map(<[u8]>::to_vec));
                }
            }
            _ => {}
        }
    }
    assert!(out.len() > 20, "too few seeds in {}", dir.display());
    // Encoder output: long chains, bytes hashes, both forms.
    let toks: Vec<u32> = (0..256).collect();
    let batch = EventBatch {
        ts: 1.0,
        events: vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: (1..=16).map(BlockHash::Uint).collect(),
                parent_block_hash: None,
                token_ids: toks.clone(),
                block_size: 16,
                ..BlockStored::default()
            }),
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![BlockHash::Bytes(vec![7; 32])],
                parent_block_hash: Some(BlockHash::Uint(16)),
                token_ids: toks[..16].to_vec(),
                block_size: 16,
                ..BlockStored::default()
            }),
            KvEvent::AllBlocksCleared,
        ],
        ..EventBatch::default()
    };
    out.push(encode_batch(&batch, EncodeForm::VllmMap));
    out.push(encode_batch(&batch, EncodeForm::VllmArray));
    out
}

const INTERESTING: &[u8] = &[
    0x00, 0x01, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc2, 0xc3, 0xc4, 0xc5, 0xc6, 0xca,
    0xcb, 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd3, 0xd9, 0xda, 0xdb, 0xdc, 0xdd, 0xde, 0xdf, 0xe0, 0xff,
];

fn mutate(rng: &mut Rng, seeds: &[Vec<u8>], input: &mut Vec<u8>) {
    let edits = 1 + below(rng, 4);
    for _ in 0..edits {
        let len = input.len();
        match below(rng, 10) {
            0 if len > 0 => {
                let i = below(rng, len);
                input[i] ^= 1 << below(rng, 8);
            }
            1 if len > 0 => {
                let i = below(rng, len);
                input[i] = INTERESTING[below(rng, INTERESTING.len())];
            }
            2 if len > 0 => {
                // A length field set to an extreme (array32/map32/bin32/str32).
                let i = below(rng, len);
                let marker = [0xdd, 0xdf, 0xc6, 0xdb][below(rng, 4)];
                let n: u32 = [u32::MAX, 0x7fff_ffff, 0x1_0000, 0][below(rng, 4)];
                input[i] = marker;
                let at = (i + 1).min(input.len());
                input.splice(at..at, n.to_be_bytes());
            }
            3 => {
                let i = below(rng, len + 1);
                let b = rng.next_u64() as u8;
                input.insert(i, b);
            }
            4 if len > 0 => {
                let i = below(rng, len);
                let n = 1 + below(rng, (len - i).min(16));
                input.drain(i..i + n);
            }
            5 if len > 1 => {
                // Duplicate a range in place (repeated events, fields).
                let i = below(rng, len);
                let n = 1 + below(rng, (len - i).min(64));
                let piece = input[i..i + n].to_vec();
                let at = below(rng, input.len() + 1);
                input.splice(at..at, piece);
            }
            6 if len > 0 => input.truncate(below(rng, len)),
            7 => {
                // Splice a piece of another seed.
                let other = &seeds[below(rng, seeds.len())];
                if !other.is_empty() {
                    let i = below(rng, other.len());
                    let n = 1 + below(rng, (other.len() - i).min(128));
                    let at = below(rng, input.len() + 1);
                    input.splice(at..at, other[i..i + n].iter().copied());
                }
            }
            8 if len >= 8 => {
                // An integer field set to an extreme.
                let i = below(rng, len - 7);
                let v: u64 = [u64::MAX, 1 << 63, 0, u64::from(u32::MAX) + 1][below(rng, 4)];
                input[i] = 0xcf;
                input[i + 1..(i + 9).min(len)]
                    .copy_from_slice(&v.to_be_bytes()[..(i + 9).min(len) - i - 1]);
            }
            _ => {
                let i = below(rng, len + 1);
                input.insert(i, INTERESTING[below(rng, INTERESTING.len())]);
            }
        }
    }
}

/// One input through everything that reads KV-event bytes. Returns whether
/// it decoded as a batch.
fn exercise(input: &[u8], index: &KvIndex, worker: kinference_kvindex::WorkerId) -> bool {
    let _ = frames::seq_from_bytes(input);
    let _ = frames::read_frames_container(input);
    // As frames: split the input in three at data-dependent points.
    let a = input.len() / 3;
    let b = 2 * input.len() / 3;
    let parts: [&[u8]; 3] = [&input[..a], &input[a..b], &input[b..]];
    let _ = frames::parse_live(&parts);
    let _ = frames::parse_live(&parts[..2]);
    let _ = frames::parse_replay_reply(&parts);
    let _ = frames::parse_replay_reply(&parts[1..]);
    let _ = frames::parse_replay_request(&parts);
    let reference = serde_decode::decode_batch(input);
    match decode_batch(input) {
        Ok(batch) => {
            let Ok(r) = reference else {
                panic!("the reference decoder rejects what the crate's accepts: {reference:?}");
            };
            assert_eq!(
                (&r.events, r.dp_rank, r.ts.to_bits()),
                (&batch.events, batch.dp_rank, batch.ts.to_bits()),
                "the decoders disagree"
            );
            let _ = index.apply_batch(worker, &batch);
            // Whatever decodes re-encodes to the same events.
            for form in [
                EncodeForm::VllmMap,
                EncodeForm::VllmArray,
                EncodeForm::SglangArray,
                EncodeForm::SglangMap,
            ] {
                let again =
                    decode_batch(&encode_batch(&batch, form)).expect("an encoded batch decodes");
                assert_eq!(
                    again.events.len(),
                    batch.events.len(),
                    "re-encoding lost events"
                );
            }
            true
        }
        Err(_) => false,
    }
}

#[test]
fn hostile_kv_event_bytes_never_panic() {
    let inputs: u64 = std::env::var("KINFERENCE_FUZZ_INPUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let seed: u64 = std::env::var("KINFERENCE_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x6b76_6675_7a7a);
    let seeds = seeds();
    let mut rng = Rng::new(seed);
    // A small index that is cleared now and then, so it stays small.
    let index = KvIndex::new(IndexConfig {
        shards: 16,
        max_entries: 100_000,
        ..IndexConfig::default()
    });
    let worker = index
        .register_worker(WorkerRef::new("fuzz", 0), 4)
        .expect("registers");
    // The figure's throughput needs a clock (tests may read one; the
    // crate's code may not).
    #[allow(clippy::disallowed_methods)]
    let started = std::time::Instant::now();
    let mut decoded = 0u64;
    let mut failures: Vec<String> = Vec::new();
    let mut input = Vec::new();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    for i in 0..inputs {
        input.clear();
        input.extend_from_slice(&seeds[below(&mut rng, seeds.len())]);
        mutate(&mut rng, &seeds, &mut input);
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            exercise(&input, &index, worker)
        })) {
            Ok(true) => decoded += 1,
            Ok(false) => {}
            Err(e) => {
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                let hex = input.iter().fold(String::new(), |mut h, b| {
                    let _ = write!(h, "{b:02x}");
                    h
                });
                if failures.len() < 10 {
                    failures.push(format!("input {i}: {msg}: {hex}"));
                }
            }
        }
        if i % 50_000 == 49_999 {
            let _ = index.clear_worker(worker);
        }
    }
    std::panic::set_hook(hook);
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "FIGURE fuzz-kv-events: {inputs} inputs from {} seeds in {secs:.1} s ({:.0}/s), {decoded} decoded as batches and applied to an index, {} panics",
        seeds.len(),
        inputs as f64 / secs,
        failures.len()
    );
    assert!(failures.is_empty(), "panics:\n{}", failures.join("\n"));
    assert!(
        decoded > 0,
        "no mutated input decoded: the mutations are too coarse to test the decoder"
    );
}
