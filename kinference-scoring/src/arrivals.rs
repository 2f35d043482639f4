//! How fast requests arrive at an endpoint: the λ of the kinference
//! policy's externality ([`crate::Kinference`]).

use serde::{Deserialize, Serialize};

/// τ, how far back (ns) an arrival rate looks: each request counts with
/// weight `τ ÷ (τ + its age)`, so the rate follows a change within a few
/// seconds, and a stream of one request every few hundred milliseconds
/// still reads as steady between its arrivals.
pub const ARRIVAL_MEMORY_NANOS: u64 = 3_000_000_000;

/// Requests that arrived recently, each weighted by about `τ ÷ (τ + its
/// age)` ([`ARRIVAL_MEMORY_NANOS`]), as of `at_nanos`: two numbers, the
/// count decayed by `τ ÷ (τ + since)` at each update (so a weight is the
/// product of its steps' factors, a little below the hyperbola). Counts
/// brought to one time add, so several sources sum into one
/// ([`ArrivalRate::add`] with `n` of them at once).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ArrivalRate {
    /// The weighted count at `at_nanos`.
    pub count: f64,
    /// When `count` was last brought up to date (ns, the policy's clock).
    pub at_nanos: u64,
}

impl ArrivalRate {
    /// The rate (per ms) at `now_nanos`: the weighted count over the
    /// window it spans, `count ÷ (τ + since)`. A steady stream every Δ
    /// reads 1 ÷ Δ just before its next arrival.
    #[inline]
    #[must_use]
    pub fn per_ms(&self, now_nanos: u64) -> f64 {
        let window = ARRIVAL_MEMORY_NANOS.saturating_add(now_nanos.saturating_sub(self.at_nanos));
        self.count * 1e6 / window as f64
    }

    /// `n` more requests arrived at `now_nanos` (a time before `at_nanos`
    /// counts as `at_nanos`).
    pub fn add(&mut self, now_nanos: u64, n: f64) {
        let tau = ARRIVAL_MEMORY_NANOS as f64;
        let since = now_nanos.saturating_sub(self.at_nanos) as f64;
        self.count = self.count * tau / (tau + since) + n;
        self.at_nanos = now_nanos.max(self.at_nanos);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn a_steady_stream_reads_its_rate_and_an_idle_one_fades() {
        let mut r = ArrivalRate::default();
        // One request every 100 ms for 30 s: 0.01 per ms.
        for i in 0..300 {
            r.add(i * 100 * MS, 1.0);
        }
        let just_before_next = 300 * 100 * MS - 1;
        assert!(
            (r.per_ms(just_before_next) - 0.01).abs() < 0.001,
            "{}",
            r.per_ms(just_before_next)
        );
        // Ten seconds of nothing: about a quarter of it.
        let later = r.per_ms(just_before_next + 10_000 * MS);
        assert!(later < 0.003 && later > 0.001, "{later}");
    }

    #[test]
    fn counts_brought_to_one_time_sum() {
        // Two sources of 5 each at different times, summed into one,
        // read as one source that saw all ten (to within the compounding
        // of their decays).
        let mut one = ArrivalRate::default();
        let (mut a, mut b) = (ArrivalRate::default(), ArrivalRate::default());
        for i in 0..10u64 {
            one.add(i * 50 * MS, 1.0);
            if i % 2 == 0 { &mut a } else { &mut b }.add(i * 50 * MS, 1.0);
        }
        let now = 600 * MS;
        let mut sum = ArrivalRate::default();
        for mut s in [a, b] {
            s.add(now, 0.0);
            sum.add(now, s.count);
        }
        let (sum, one) = (sum.per_ms(now), one.per_ms(now));
        assert!((sum - one).abs() < 0.02 * one, "{sum} vs {one}");
        assert!(sum > 0.002, "{sum}");
    }
}
