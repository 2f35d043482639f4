//! Least in flight: fewest requests the router has in flight on the
//! endpoint, ties at random.

use std::time::Duration;

use crate::error::ScoringError;
use crate::input::{Candidate, Request};
use crate::pick::{Choice, Explanation, Reason, ScoreDetail};
use crate::policies::baseline::{Better, choice, explanation, extreme};
use crate::policies::{Pick, PolicyName, check};
use crate::profile::LatencyParams;
use crate::rng::RandomSource;

/// Fewest requests in flight (the router's own accounting); ties at random.
#[derive(Debug, Clone)]
pub struct LeastInflight {
    params: LatencyParams,
    scores: Vec<f64>,
}

impl LeastInflight {
    /// The policy.
    pub fn new(params: LatencyParams) -> Self {
        Self {
            params,
            scores: Vec::new(),
        }
    }

    fn decide(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Choice, ScoringError> {
        check(request, candidates)?;
        self.scores.clear();
        self.scores
            .extend(candidates.iter().map(|c| f64::from(c.in_flight.requests)));
        let (index, tie) = extreme(&self.scores, Better::Lower, |_| true, rng);
        Ok(choice(
            &self.params,
            request,
            candidates,
            index,
            now,
            Reason::FewestInFlight,
            tie,
        ))
    }
}

impl Pick for LeastInflight {
    fn name(&self) -> PolicyName {
        PolicyName::LeastInflight
    }

    fn propose(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Choice, ScoringError> {
        self.decide(request, candidates, now, rng)
    }

    fn propose_explained(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        rng: &mut dyn RandomSource,
    ) -> Result<Explanation, ScoringError> {
        let choice = self.decide(request, candidates, now, rng)?;
        Ok(explanation(
            PolicyName::LeastInflight,
            &self.params,
            (request, candidates, now),
            choice,
            &self.scores,
            |i| ScoreDetail::LeastInflight {
                requests: candidates[i].in_flight.requests,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pick::Tie;
    use crate::policies::baseline::test_support::{cand, pick};

    #[test]
    fn least_inflight_takes_the_fewest_and_breaks_ties_by_seed() {
        let mut p = LeastInflight::new(LatencyParams::default());
        let cands = [
            cand(0, 0, 5, 0),
            cand(1, 100, 2, 0),
            cand(2, 0, 2, 0),
            cand(3, 0, 9, 0),
        ];
        let mut seen = [false; 4];
        for seed in 0..50 {
            let c = pick(&mut p, &cands, seed);
            assert_eq!(c.reason, Reason::FewestInFlight);
            assert_eq!(c.tie, Tie::Random { among: 2 });
            seen[c.index] = true;
        }
        assert_eq!(seen, [false, true, true, false]);
    }
}
