//! What the baseline policies share: the tie-broken arg-extreme, the
//! prediction every choice carries, explanations, and the llm-d prefix score.
//!
//! Each baseline lives in its own module and cites the upstream file and
//! formula it follows; none of their code is used.

use std::time::Duration;

use crate::input::{Candidate, Request};
use crate::latency::{predict, source_blocks};
use crate::pick::{CandidateExplanation, Choice, Explanation, Reason, ScoreDetail, Tie};
use crate::policies::{PolicyName, millis};
use crate::profile::LatencyParams;
use crate::rng::{RandomSource, below};

/// Which way a score is better.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Better {
    Lower,
    Higher,
}

/// The best of `scores` among those `keep` allows, exact ties broken by the
/// seeded RNG. `keep` must allow at least one index.
pub(super) fn extreme(
    scores: &[f64],
    better: Better,
    keep: impl Fn(usize) -> bool,
    rng: &mut dyn RandomSource,
) -> (usize, Tie) {
    let mut best = match better {
        Better::Lower => f64::INFINITY,
        Better::Higher => f64::NEG_INFINITY,
    };
    let mut count = 0usize;
    for (i, &s) in scores.iter().enumerate() {
        if !keep(i) {
            continue;
        }
        let improves = match better {
            Better::Lower => s < best,
            Better::Higher => s > best,
        };
        if improves || count == 0 {
            best = s;
            count = 1;
        } else if s.total_cmp(&best).is_eq() {
            count += 1;
        }
    }
    let mut skip = if count > 1 { below(rng, count) } else { 0 };
    let mut chosen = 0;
    for (i, &s) in scores.iter().enumerate() {
        if keep(i) && s.total_cmp(&best).is_eq() {
            if skip == 0 {
                chosen = i;
                break;
            }
            skip -= 1;
        }
    }
    let tie = if count > 1 {
        Tie::Random {
            among: count as u32,
        }
    } else {
        Tie::None
    };
    (chosen, tie)
}

/// kinference's prediction for the chosen candidate, uncalibrated: what the
/// router needs for its in-flight accounting under any policy.
pub(super) fn choice(
    params: &LatencyParams,
    request: &Request,
    candidates: &[Candidate],
    index: usize,
    now: Duration,
    reason: Reason,
    tie: Tie,
) -> Choice {
    let c = &candidates[index];
    Choice {
        endpoint: c.endpoint,
        index,
        prediction: predict(params, request, c, None, now),
        reason,
        tie,
    }
}

/// Explain a baseline's decision: `scores` and `detail` are its own terms
/// per candidate; the prediction is kinference's, uncalibrated.
pub(super) fn explanation(
    policy: PolicyName,
    params: &LatencyParams,
    (request, candidates, now): (&Request, &[Candidate], Duration),
    choice: Choice,
    scores: &[f64],
    detail: impl Fn(usize) -> ScoreDetail,
) -> Explanation {
    let candidates = candidates
        .iter()
        .zip(scores)
        .enumerate()
        .map(|(i, (c, &score))| CandidateExplanation {
            inputs: *c,
            prediction: predict(params, request, c, None, now),
            score,
            detail: detail(i),
        })
        .collect();
    Explanation {
        policy,
        now_ms: millis(now),
        request: *request,
        choice,
        candidates,
    }
}

/// Fresh scraped figures, if any.
pub(super) fn fresh_metrics<'a>(
    params: &LatencyParams,
    c: &'a Candidate,
) -> Option<&'a crate::input::EngineMetrics> {
    c.engine.as_ref().filter(|m| m.age < params.metrics_max_age)
}

/// Full blocks of the prompt and the cached fraction of them (llm-d's prefix
/// score: matched ÷ total blocks, 0 for a prompt shorter than a block).
pub(super) fn prefix_score(params: &LatencyParams, request: &Request, c: &Candidate) -> f64 {
    let total = request.prompt_tokens / request.block_tokens;
    if total == 0 {
        return 0.0;
    }
    (source_blocks(params, request, &c.cached) / f64::from(total)).min(1.0)
}

#[cfg(test)]
pub(super) mod test_support {
    //! Builders shared by the baselines' tests.

    use std::time::Duration;

    use crate::input::{CacheSource, CachedBlocks, Candidate, EndpointId, InFlight, Request};
    use crate::pick::Choice;
    use crate::policies::Pick;
    use crate::rng::SplitMix64;

    /// 1,600 prompt tokens in blocks of 16: 100 blocks.
    pub(crate) fn request() -> Request {
        Request {
            prompt_tokens: 1600,
            block_tokens: 16,
            cache: CacheSource::Index,
            ttft_target: None,
        }
    }

    /// Endpoint `id` holding `gpu` leading blocks, with `requests` in flight
    /// and `prefill_tokens` of them still to prefill (also its context).
    pub(crate) fn cand(id: u32, gpu: u32, requests: u32, prefill_tokens: u64) -> Candidate {
        Candidate {
            endpoint: EndpointId(id),
            cached: CachedBlocks {
                gpu,
                cpu: 0,
                disk: 0,
                storage: 0,
            },
            in_flight: InFlight {
                requests,
                decoding: 0,
                prefill_tokens,
                context_tokens: prefill_tokens,
            },
            engine: None,
            evidence: crate::input::Evidence::default(),
            adapter: crate::input::AdapterSlot::Unknown,
            room: crate::input::KvRoom::default(),
            session_blocks: 0,
            peer_arrival_rate: 0.0,
        }
    }

    pub(crate) fn pick(p: &mut dyn Pick, cands: &[Candidate], seed: u64) -> Choice {
        pick_at(p, cands, seed, Duration::from_secs(1))
    }

    pub(crate) fn pick_at(
        p: &mut dyn Pick,
        cands: &[Candidate],
        seed: u64,
        now: Duration,
    ) -> Choice {
        p.pick(&request(), cands, now, &mut SplitMix64::new(seed))
            .expect("valid input")
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::test_support::{cand, pick, request};
    use crate::latency::predict;
    use crate::policies::PolicyName;
    use crate::profile::LatencyParams;

    #[test]
    fn every_baseline_reports_the_uncalibrated_prediction() {
        let cands = [cand(0, 20, 1, 300), cand(1, 0, 0, 0)];
        for name in PolicyName::ALL {
            let mut p = crate::Policy::new(name, LatencyParams::default());
            let c = pick(&mut p, &cands, 3);
            let want = predict(
                &LatencyParams::default(),
                &request(),
                &cands[c.index],
                None,
                Duration::from_secs(1),
            );
            assert_eq!(c.prediction, want, "{name}");
        }
    }
}
