//! First tokens in time, per endpoint: this replica's recent ones, sent in
//! its reports with their age, and its peers', placed on this replica's
//! clock, so that a stream counts exactly the prompts its peers had
//! prefilled on the engine between its first token and its last however
//! late their reports come ([`super::InFlight::step_window`]).

use std::collections::VecDeque;

/// Most of this replica's first tokens kept per endpoint for its peers'
/// reports (and sent in one report).
pub const MAX_SENT: usize = 256;

/// Most of the peers' first tokens kept per endpoint: a stream spanning
/// more of them there falls back to counting without times.
const MAX_KEPT: usize = 1024;

/// This replica's first tokens on one endpoint, for its peers' reports.
#[derive(Debug, Default)]
pub struct FirstTokens {
    /// `(version mark, clock micros, cumulative prefilled after it)`, in
    /// order; at most [`MAX_SENT`].
    recent: parking_lot::Mutex<VecDeque<(u64, i64, u64)>>,
}

impl FirstTokens {
    /// A first token at `at` ([`super::clock_micros`]) that brought the
    /// endpoint's prefilled count to `cumulative`, marked with the load
    /// version `mark` (as [`super::Load::prefilled_version`] is).
    pub fn push(&self, mark: u64, at: i64, cumulative: u64) {
        let mut r = self.recent.lock();
        if r.len() >= MAX_SENT {
            r.pop_front();
        }
        r.push_back((mark, at, cumulative));
    }

    /// The first tokens marked at or after `after` (all kept, with
    /// `None`): `[age in microseconds at now, cumulative prefilled]`. The
    /// marks only grow (pushed under the endpoint's burst lock, read from
    /// the version, which only grows), so a report skips to the new ones
    /// instead of reading every one kept.
    pub fn since(&self, after: Option<u64>, now: i64) -> Vec<[u64; 2]> {
        let r = self.recent.lock();
        let start = after.map_or(0, |a| r.partition_point(|&(mark, _, _)| mark < a));
        r.range(start..)
            .map(|&(_, at, cum)| [u64::try_from(now - at).unwrap_or(0), cum])
            .collect()
    }
}

/// The peers' first tokens on one endpoint, on this replica's clock.
#[derive(Debug, Default)]
pub struct PeerFirstTokens {
    inner: parking_lot::Mutex<Timeline>,
}

#[derive(Debug, Default)]
struct Timeline {
    /// `(clock micros, prompt tokens prefilled)`, in time order.
    events: VecDeque<(i64, u64)>,
    /// The latest time of an event dropped for room: windows starting
    /// before it are no longer whole.
    dropped_until: Option<i64>,
}

impl PeerFirstTokens {
    /// A peer's first token at `at` ([`super::clock_micros`]) after
    /// prefilling `tokens`.
    pub fn add(&self, at: i64, tokens: u64) {
        let mut t = self.inner.lock();
        if t.events.len() >= MAX_KEPT
            && let Some((gone, _)) = t.events.pop_front()
        {
            t.dropped_until = Some(t.dropped_until.map_or(gone, |d| d.max(gone)));
        }
        // Reports from several peers interleave: mostly an append.
        let i = t.events.partition_point(|&(x, _)| x <= at);
        t.events.insert(i, (at, tokens));
    }

    /// The tokens the peers prefilled with a first token in `(from, to]`
    /// past the engine step of `from`: the first tokens that follow it
    /// each within `same_step` of the one before came out of that step
    /// (as [`super::Bursts`] tells this replica's own). `None` when events
    /// from then have been dropped.
    pub fn after_step(&self, from: i64, to: i64, same_step: i64) -> Option<u64> {
        let t = self.inner.lock();
        if t.dropped_until.is_some_and(|d| d > from) {
            return None;
        }
        let start = t.events.partition_point(|&(x, _)| x <= from);
        let mut edge = from;
        let mut sum = 0;
        for &(x, n) in t.events.range(start..) {
            if x > to {
                break;
            }
            if x - edge <= same_step && edge != i64::MAX {
                edge = x;
            } else {
                edge = i64::MAX;
                sum += n;
            }
        }
        Some(sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_counts_the_peers_first_tokens_inside_it_in_any_order() {
        let p = PeerFirstTokens::default();
        p.add(1_000, 100);
        p.add(5_000, 300);
        // A second peer's report, of an earlier first token, comes later.
        p.add(3_000, 50);
        assert_eq!(p.after_step(1_000, 5_000, 0), Some(350));
        assert_eq!(p.after_step(0, 4_000, 0), Some(150));
        assert_eq!(p.after_step(5_000, 9_000, 0), Some(0));
    }

    #[test]
    fn first_tokens_chained_to_the_windows_start_are_of_its_step() {
        let p = PeerFirstTokens::default();
        // One step's first tokens 1.5 ms apart (3 ms in all), then the
        // next step's 10 ms later, then one 1 ms after that.
        for (at, n) in [
            (10_500, 1),
            (12_000, 2),
            (13_500, 4),
            (23_500, 8),
            (24_500, 16),
        ] {
            p.add(at, n);
        }
        assert_eq!(p.after_step(10_000, 30_000, 2_000), Some(24));
        // A step that began more than 2 ms after the window's start.
        assert_eq!(p.after_step(7_000, 30_000, 2_000), Some(31));
        assert_eq!(p.after_step(10_000, 23_600, 2_000), Some(8));
    }

    #[test]
    fn a_window_older_than_what_is_kept_is_not_whole() {
        let p = PeerFirstTokens::default();
        for i in 0..MAX_KEPT as i64 + 10 {
            p.add(i * 10, 1);
        }
        // The 10 oldest were dropped, the latest at 90.
        assert_eq!(p.after_step(50, 10_000, 0), None);
        assert_eq!(p.after_step(90, 200, 0), Some(11));
    }

    #[test]
    fn reports_carry_the_first_tokens_marked_since_the_askers_version() {
        let f = FirstTokens::default();
        f.push(3, 1_000, 500);
        f.push(5, 4_000, 800);
        assert_eq!(f.since(None, 10_000), vec![[9_000, 500], [6_000, 800]]);
        assert_eq!(f.since(Some(5), 10_000), vec![[6_000, 800]]);
        assert!(f.since(Some(6), 10_000).is_empty());
        for i in 0..=(MAX_SENT as u64) {
            f.push(10 + i, 20_000, 900 + i);
        }
        let all = f.since(None, 20_000);
        assert_eq!(all.len(), MAX_SENT);
        assert_eq!(all[0], [0, 901]);
    }
}
