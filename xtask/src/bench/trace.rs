//! Agent/tool traffic as a Mooncake-format trace: JSON lines
//! `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
//! "hash_ids": [block ids]}`, where each hash id stands for one block of
//! `block` tokens (Mooncake's traces: 512) and equal ids are equal content,
//! prefix by prefix.
//!
//! - [`read`] loads a user's trace (a real one, or one written by
//!   `cargo xtask bench trace`), rejecting malformed lines with their line
//!   number.
//! - [`synthetic`] generates agent sessions reproducibly from a seed: a few
//!   shared tool/system prompts, then turns that each append a tool result
//!   and the model's previous answer, with think time between turns. Every
//!   block is full (`input_length = len(hash_ids) × block`), the form
//!   third-party replayers (aiperf) require.
//! - [`plan`] replays a trace at a rate: timestamps are scaled so the mean
//!   rate is the one asked for; each hash id becomes `block ÷ k` words of the
//!   word-level tokenizer derived from the id alone.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use super::workload::{Arrival, Body, Plan, Scale, SplitMix, words};

/// Mooncake's tokens per hash id.
pub(crate) const MOONCAKE_BLOCK: u32 = 512;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TraceRow {
    /// Arrival, ms from the trace's start.
    pub timestamp: u64,
    pub input_length: u32,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
}

/// Reads a JSONL trace.
///
/// # Errors
///
/// A line that is not a trace row, rows out of time order, or an input
/// longer than its blocks can hold, with the line number.
pub(crate) fn read(path: &Path, block: u32) -> Result<Vec<TraceRow>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut rows: Vec<TraceRow> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: TraceRow = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a trace row", path.display(), i + 1))?;
        if r.hash_ids.is_empty() || r.input_length == 0 {
            bail!(
                "{}:{}: a row needs input tokens and hash_ids",
                path.display(),
                i + 1
            );
        }
        if u64::from(r.input_length) > r.hash_ids.len() as u64 * u64::from(block) {
            bail!(
                "{}:{}: input_length {} exceeds {} hash ids × {block} tokens",
                path.display(),
                i + 1,
                r.input_length,
                r.hash_ids.len()
            );
        }
        if let Some(prev) = rows.last()
            && r.timestamp < prev.timestamp
        {
            bail!("{}:{}: timestamps go backwards", path.display(), i + 1);
        }
        rows.push(r);
    }
    if rows.is_empty() {
        bail!("{}: no trace rows", path.display());
    }
    Ok(rows)
}

/// Writes `rows` as JSONL.
pub(crate) fn write(path: &Path, rows: &[TraceRow]) -> Result<()> {
    let mut s = String::new();
    for r in rows {
        s.push_str(&serde_json::to_string(r)?);
        s.push('\n');
    }
    std::fs::write(path, s).with_context(|| format!("writing {}", path.display()))
}

/// The synthetic agent trace's shape (real tokens, `block`-token blocks).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub(crate) struct AgentShape {
    /// Requests in the trace.
    pub requests: u32,
    /// Shared tool/system prompts, each `tool_blocks` long.
    pub tool_prompts: u32,
    pub tool_blocks: u32,
    /// Turns per session (uniform in this range).
    pub turns: (u32, u32),
    /// Tool-result blocks appended per turn (uniform in this range).
    pub result_blocks: (u32, u32),
    /// Blocks the model's answer adds to the history.
    pub answer_blocks: u32,
    /// Output tokens per request (uniform in this range).
    pub output: (u32, u32),
    /// Sessions starting per second, and mean think time between turns, s.
    pub session_rate: f64,
    pub think_s: f64,
}

impl Default for AgentShape {
    fn default() -> Self {
        Self {
            requests: 4000,
            tool_prompts: 4,
            tool_blocks: 12,
            turns: (4, 12),
            result_blocks: (1, 5),
            answer_blocks: 1,
            output: (100, 500),
            session_rate: 2.0,
            think_s: 1.5,
        }
    }
}

/// A synthetic agent trace, a pure function of `shape` and `seed`.
pub(crate) fn synthetic(shape: &AgentShape, block: u32, seed: u64) -> Vec<TraceRow> {
    let mut rng = SplitMix(seed ^ 0xA6E7_7ACE);
    let exp = |rng: &mut SplitMix, mean: f64| -(1.0 - rng.unit()).ln() * mean;
    let between = |rng: &mut SplitMix, (lo, hi): (u32, u32)| {
        lo + rng.below(u64::from(hi.saturating_sub(lo)) + 1) as u32
    };
    // Ids: tool prompts first, then fresh ids for session content.
    let mut next_id = u64::from(shape.tool_prompts * shape.tool_blocks);
    let mut rows: Vec<TraceRow> = Vec::new();
    // Sessions start from a minute before the trace does, so that it opens
    // in steady state (as many sessions running as later on); what they
    // sent before 0 is dropped.
    let mut start = -60.0f64;
    let mut kept = 0usize;
    while kept < shape.requests as usize {
        start += exp(&mut rng, 1.0 / shape.session_rate.max(1e-3));
        let tool = rng.below(u64::from(shape.tool_prompts.max(1)));
        let mut ids: Vec<u64> = (0..shape.tool_blocks)
            .map(|b| tool * u64::from(shape.tool_blocks) + u64::from(b))
            .collect();
        let mut t = start;
        for turn in 0..between(&mut rng, shape.turns) {
            if turn > 0 {
                t += exp(&mut rng, shape.think_s);
                for _ in 0..shape.answer_blocks {
                    ids.push(next_id);
                    next_id += 1;
                }
            }
            for _ in 0..between(&mut rng, shape.result_blocks) {
                ids.push(next_id);
                next_id += 1;
            }
            if t < 0.0 {
                continue;
            }
            kept += 1;
            rows.push(TraceRow {
                timestamp: (t * 1e3) as u64,
                input_length: ids.len() as u32 * block,
                output_length: between(&mut rng, shape.output),
                hash_ids: ids.clone(),
            });
        }
    }
    rows.sort_by_key(|r| r.timestamp);
    rows.truncate(shape.requests as usize);
    rows
}

/// Mean input tokens and mean tokens in blocks not seen before (real).
pub(crate) fn stats(rows: &[TraceRow], block: u32) -> (f64, f64) {
    let mut seen = std::collections::HashSet::new();
    let (mut input, mut new) = (0.0, 0.0);
    for r in rows {
        input += f64::from(r.input_length);
        let fresh = r.hash_ids.iter().filter(|h| seen.insert(**h)).count();
        new += (fresh as f64 * f64::from(block)).min(f64::from(r.input_length));
    }
    let n = rows.len().max(1) as f64;
    (input / n, new / n)
}

/// The plan of `rows` replayed at `rate` req/s (timestamps scaled to it).
pub(crate) fn plan(
    rows: &[TraceRow],
    block: u32,
    scale: Scale,
    rate: f64,
    warmup: Duration,
    measure: Duration,
) -> Plan {
    if rows.is_empty() {
        return Plan {
            arrivals: Vec::new(),
            warmup,
            measure,
            conversations: 0,
        };
    }
    // The trace's own rate over its first 90 % (a generated trace thins
    // out at its end, where sessions were cut off).
    let k = (rows.len() * 9 / 10).max(1);
    let span_ms = rows[k - 1].timestamp.max(1) as f64;
    let natural = k as f64 / (span_ms / 1e3);
    let factor = if rate > 0.0 { natural / rate } else { 1.0 };
    let end = (warmup + measure).as_secs_f64();
    let per_block = scale.tokens(block);
    let mut arrivals = Vec::new();
    for r in rows {
        let at = r.timestamp as f64 * factor / 1e3;
        if at >= end {
            break;
        }
        let full = r.hash_ids.len() as u32 - 1;
        let last = scale.tokens(r.input_length - full * block);
        let mut prompt = String::new();
        for (i, h) in r.hash_ids.iter().enumerate() {
            if i > 0 {
                prompt.push(' ');
            }
            let n = if i as u32 == full { last } else { per_block };
            // A partial last block is the first words of its full block.
            prompt.push_str(
                &words(*h ^ 0x7ACE_B10C, per_block)
                    .split(' ')
                    .take(n as usize)
                    .collect::<Vec<_>>()
                    .join(" "),
            );
        }
        arrivals.push(Arrival {
            index: arrivals.len(),
            at: Duration::from_secs_f64(at),
            body: Body::Completion {
                prompt,
                max_tokens: scale.tokens(r.output_length),
            },
            label: format!("r{}", r.hash_ids.first().copied().unwrap_or(0)),
            tenant: None,
            model: None,
        });
    }
    Plan {
        arrivals,
        warmup,
        measure,
        conversations: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synthetic_traces_are_reproducible_full_blocked_and_round_trip() {
        let shape = AgentShape {
            requests: 300,
            ..AgentShape::default()
        };
        let a = synthetic(&shape, 512, 7);
        assert_eq!(a, synthetic(&shape, 512, 7));
        assert_ne!(a, synthetic(&shape, 512, 8));
        assert_eq!(a.len(), 300);
        assert!(
            a.iter()
                .all(|r| r.input_length == r.hash_ids.len() as u32 * 512)
        );
        assert!(a.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        // Sessions share their tool prompt: ids 0..48 recur.
        assert!(a.iter().filter(|r| r.hash_ids[0] < 48).count() == a.len());
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("t.jsonl");
        write(&p, &a).expect("written");
        assert_eq!(read(&p, 512).expect("read back"), a);
    }

    #[test]
    fn bad_rows_name_their_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("bad.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 5, \"hash_ids\": [1]}\n{\"timestamp\": 1, \"input_length\": 2000, \"output_length\": 5, \"hash_ids\": [1, 2]}\n",
        )
        .expect("written");
        let e = format!("{:#}", read(&p, 512).expect_err("too long"));
        assert!(e.contains("bad.jsonl:2") && e.contains("exceeds"), "{e}");
        std::fs::write(&p, "not json\n").expect("written");
        assert!(format!("{:#}", read(&p, 512).expect_err("bad")).contains(":1: not a trace row"));
    }

    #[test]
    fn plans_share_prefixes_where_hash_ids_do_and_follow_the_rate() {
        let rows = synthetic(
            &AgentShape {
                requests: 400,
                ..AgentShape::default()
            },
            512,
            1,
        );
        let p = plan(
            &rows,
            512,
            Scale { k: 10 },
            4.0,
            Duration::from_secs(10),
            Duration::from_secs(40),
        );
        let n = p.arrivals.len() as f64;
        assert!((n / 50.0 - 4.0).abs() < 1.2, "{n} arrivals in 50 s");
        let prompts: Vec<&str> = p
            .arrivals
            .iter()
            .map(|a| match &a.body {
                Body::Completion { prompt, .. } => prompt.as_str(),
                Body::ChatTurn { .. } => "",
            })
            .collect();
        // 12 tool blocks × 51 words in common between two sessions of the
        // same tool prompt.
        let same_tool = rows
            .iter()
            .skip(1)
            .position(|r| {
                r.hash_ids[0] == rows[0].hash_ids[0] && r.hash_ids[12] != rows[0].hash_ids[12]
            })
            .expect("another session of the same tool")
            + 1;
        let common = prompts[0]
            .split(' ')
            .zip(prompts[same_tool].split(' '))
            .take_while(|(a, b)| a == b)
            .count();
        assert_eq!(common, 12 * 51);
    }
}
