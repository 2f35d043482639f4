//! Round robin: the k-th decision takes candidate `k mod len`, whatever the
//! load or cache (what every router offers, e.g. `smg --policy round_robin`).

use std::time::Duration;

use crate::error::ScoringError;
use crate::input::{Candidate, Request};
use crate::pick::{Choice, Explanation, Reason, ScoreDetail, Tie};
use crate::policies::baseline::{choice, explanation};
use crate::policies::{Pick, PolicyName, check};
use crate::profile::LatencyParams;
use crate::rng::RandomSource;

/// Round robin over the candidate slice: the k-th committed decision takes
/// index `k mod len`.
#[derive(Debug, Clone)]
pub struct RoundRobin {
    params: LatencyParams,
    next: u64,
}

impl RoundRobin {
    /// A rotation starting at index 0.
    pub fn new(params: LatencyParams) -> Self {
        Self { params, next: 0 }
    }

    fn decide(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
    ) -> Result<Choice, ScoringError> {
        check(request, candidates)?;
        let index = (self.next % candidates.len() as u64) as usize;
        Ok(choice(
            &self.params,
            request,
            candidates,
            index,
            now,
            Reason::Rotation,
            Tie::None,
        ))
    }
}

impl Pick for RoundRobin {
    fn name(&self) -> PolicyName {
        PolicyName::RoundRobin
    }

    fn propose(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        _rng: &mut dyn RandomSource,
    ) -> Result<Choice, ScoringError> {
        self.decide(request, candidates, now)
    }

    fn propose_explained(
        &mut self,
        request: &Request,
        candidates: &[Candidate],
        now: Duration,
        _rng: &mut dyn RandomSource,
    ) -> Result<Explanation, ScoringError> {
        let choice = self.decide(request, candidates, now)?;
        let scores: Vec<f64> = (0..candidates.len())
            .map(|i| if i == choice.index { 0.0 } else { 1.0 })
            .collect();
        Ok(explanation(
            PolicyName::RoundRobin,
            &self.params,
            (request, candidates, now),
            choice,
            &scores,
            |i| ScoreDetail::RoundRobin { position: i },
        ))
    }

    fn commit(
        &mut self,
        _request: &Request,
        _chosen: &Candidate,
        _choice: &Choice,
        _now: Duration,
    ) {
        self.next = self.next.wrapping_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::baseline::test_support::{cand, pick};

    #[test]
    fn round_robin_rotates() {
        let mut p = RoundRobin::new(LatencyParams::default());
        let cands: Vec<_> = (0..3).map(|i| cand(i, 0, 0, 0)).collect();
        let got: Vec<u32> = (0..6).map(|s| pick(&mut p, &cands, s).endpoint.0).collect();
        assert_eq!(got, [0, 1, 2, 0, 1, 2]);
    }
}
