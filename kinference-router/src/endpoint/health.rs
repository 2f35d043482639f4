//! An endpoint's health: outlier detection on what requests and probes
//! find (ejection with back-off), and the engine's 503 refusals.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::Endpoint;

/// What an attempt or a probe found out about an endpoint's health.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The engine answered (anything but a 5xx).
    Success,
    /// No connection could be made, or it broke before an answer.
    ConnectFailure,
    /// The engine answered with a 5xx other than 503 (a CUDA fault, an
    /// engine that died behind a live API server).
    ServerError,
    /// No response headers within the upstream timeout, or a stream that
    /// stalled.
    Timeout,
}

/// Health by outlier detection, as Envoy does it: consecutive gateway
/// failures (connect failures, timeouts) eject at once, consecutive 5xx
/// after [`CONSECUTIVE_5XX`]; each ejection lasts [`BASE_EJECTION`] times
/// 2^(ejections so far), at most [`MAX_EJECTION`]. After it, the endpoint
/// takes traffic again; a success forgets the history, another failure
/// ejects it for longer. A 503 is an engine saying "not now" (vLLM's
/// admission control): the request tries another endpoint, the endpoint is
/// not ejected.
#[derive(Debug, Default)]
pub(super) struct Health {
    consecutive_5xx: u32,
    /// Ejections since the last success (the back-off exponent).
    ejections: u32,
    ejected_until: Option<Instant>,
    /// Consecutive probes that found nothing listening.
    probe_refused: u32,
    /// Consecutive probes without an answer in time.
    probe_timeouts: u32,
    /// The ejection is the probes' doing (a probe that reaches the engine
    /// lifts it).
    by_probe: bool,
}

/// Consecutive 5xx answers (other than 503) that eject an endpoint.
pub const CONSECUTIVE_5XX: u32 = 3;

/// The first ejection's length.
pub const BASE_EJECTION: Duration = Duration::from_millis(500);

/// The longest an endpoint is ejected after failures.
pub const MAX_EJECTION: Duration = Duration::from_secs(30);

/// Consecutive probes finding nothing listening that eject an endpoint and
/// move the requests waiting for its headers elsewhere (the engine is gone).
pub const PROBE_FAILURES_TO_EJECT: u32 = 2;

/// Consecutive probes without an answer in time that eject an endpoint for
/// new requests. Requests already there keep waiting: a busy engine answers
/// probes late and is still working on them.
pub const PROBE_TIMEOUTS_TO_EJECT: u32 = 3;

impl Endpoint {
    /// Whether requests may go here at `now` (not ejected).
    pub fn healthy(&self, now: Instant) -> bool {
        self.health.read().ejected_until.is_none_or(|t| now >= t)
    }

    fn eject(h: &mut Health, now: Instant) {
        h.ejections = h.ejections.saturating_add(1);
        let backoff = BASE_EJECTION
            .saturating_mul(1 << (h.ejections - 1).min(10))
            .min(MAX_EJECTION);
        h.ejected_until = Some(now + backoff);
    }

    /// Records what an attempt found out. Returns whether it ejected the
    /// endpoint.
    pub fn record(&self, outcome: Outcome, now: Instant) -> bool {
        let mut h = self.health.write();
        match outcome {
            Outcome::Success => {
                if h.consecutive_5xx != 0 || h.ejections != 0 || h.ejected_until.is_some() {
                    *h = Health {
                        probe_refused: h.probe_refused,
                        probe_timeouts: h.probe_timeouts,
                        ..Health::default()
                    };
                }
                false
            }
            Outcome::ServerError => {
                h.consecutive_5xx = h.consecutive_5xx.saturating_add(1);
                if h.consecutive_5xx < CONSECUTIVE_5XX {
                    return false;
                }
                h.consecutive_5xx = 0;
                Self::eject(&mut h, now);
                h.by_probe = false;
                true
            }
            Outcome::ConnectFailure | Outcome::Timeout => {
                Self::eject(&mut h, now);
                h.by_probe = false;
                true
            }
        }
    }

    /// Records a failed request (a refusal, no answer in time, a stream
    /// that stalled): ejects the endpoint, with the back-off of
    /// [`Endpoint::record`].
    pub fn record_failure(&self, now: Instant) {
        self.record(Outcome::Timeout, now);
    }

    /// Records a success: the endpoint's failure history is forgotten.
    pub fn record_success(&self) {
        self.record(Outcome::Success, Instant::now());
    }

    /// Records what a probe (or a `/tokenize` call) found:
    /// `Some(Outcome::Success)` an answer, `Some(Outcome::ConnectFailure)`
    /// nothing listening, `Some(Outcome::Timeout)` no answer in time,
    /// `Some(Outcome::ServerError)` a 5xx from `/health` (the engine says it
    /// is dead).
    ///
    /// [`PROBE_FAILURES_TO_EJECT`] refusals (or 5xx health answers) in a
    /// row eject the endpoint and wake the requests waiting for its response
    /// headers, which then try another endpoint: an engine that is gone is
    /// found without waiting for requests to time out on it, and without
    /// traffic at all. [`PROBE_TIMEOUTS_TO_EJECT`] timeouts in a row eject
    /// it for new requests only. A probe that reaches the engine lifts an
    /// ejection the probes caused (not one caused by failed requests: their
    /// back-off runs out). Returns whether this call ejected the endpoint.
    pub fn record_probe(&self, outcome: Outcome, now: Instant) -> bool {
        let mut h = self.health.write();
        match outcome {
            Outcome::Success => {
                if h.by_probe {
                    *h = Health::default();
                } else {
                    h.probe_refused = 0;
                    h.probe_timeouts = 0;
                }
                false
            }
            Outcome::Timeout => {
                h.probe_timeouts = h.probe_timeouts.saturating_add(1);
                let ejected = h.ejected_until.is_some_and(|t| now < t);
                if h.probe_timeouts < PROBE_TIMEOUTS_TO_EJECT || ejected {
                    return false;
                }
                Self::eject(&mut h, now);
                h.by_probe = true;
                true
            }
            Outcome::ConnectFailure | Outcome::ServerError => {
                h.probe_refused = h.probe_refused.saturating_add(1);
                if h.probe_refused < PROBE_FAILURES_TO_EJECT {
                    return false;
                }
                Self::eject(&mut h, now);
                h.by_probe = true;
                drop(h);
                self.down.notify_waiters();
                true
            }
        }
    }

    /// Resolves when probes next find the engine unreachable. Register
    /// (call this) before sending, then await it alongside the response.
    pub fn went_down(&self) -> tokio::sync::futures::Notified<'_> {
        self.down.notified()
    }

    /// The engine refused a request with 503 at `now` (time since the router
    /// started): its admission control is full. Not a failure (no ejection);
    /// evidence for the next decisions.
    pub fn record_refusal(&self, now: Duration) {
        let ms = u64::try_from(now.as_millis()).unwrap_or(u64::MAX - 1);
        self.refused_at.store(ms + 1, Ordering::Relaxed);
    }

    /// Time since the last 503 refusal at `now`, if any.
    pub fn refused_age(&self, now: Duration) -> Option<Duration> {
        match self.refused_at.load(Ordering::Relaxed) {
            0 => None,
            at => Some(now.saturating_sub(Duration::from_millis(at - 1))),
        }
    }

    /// Ejections since the last success (0 when healthy).
    pub fn failures(&self) -> u32 {
        self.health.read().ejections
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::one_endpoint;
    use super::*;

    #[test]
    fn failures_eject_with_growing_backoff_and_success_heals() {
        let e = one_endpoint();
        let t0 = Instant::now();
        assert!(e.healthy(t0));
        assert!(
            e.record(Outcome::ConnectFailure, t0),
            "a connect failure ejects at once"
        );
        assert!(!e.healthy(t0));
        assert!(e.healthy(t0 + BASE_EJECTION));
        e.record(Outcome::ConnectFailure, t0);
        assert!(
            !e.healthy(t0 + Duration::from_millis(999)),
            "the second ejection is twice as long"
        );
        for _ in 0..20 {
            e.record(Outcome::Timeout, t0);
        }
        assert!(!e.healthy(t0 + Duration::from_secs(29)));
        assert!(e.healthy(t0 + MAX_EJECTION));
        e.record(Outcome::Success, t0);
        assert!(e.healthy(t0));
        assert_eq!(e.failures(), 0);
    }

    #[test]
    fn consecutive_server_errors_eject_and_503_never_does() {
        let e = one_endpoint();
        let t0 = Instant::now();
        for _ in 1..CONSECUTIVE_5XX {
            assert!(!e.record(Outcome::ServerError, t0));
            assert!(e.healthy(t0));
        }
        assert!(
            e.record(Outcome::ServerError, t0),
            "the third 5xx in a row ejects"
        );
        assert!(!e.healthy(t0));
        // Readmitted after the back-off; a success in between resets the count.
        let later = t0 + BASE_EJECTION;
        assert!(e.healthy(later));
        e.record(Outcome::ServerError, later);
        e.record(Outcome::Success, later);
        e.record(Outcome::ServerError, later);
        e.record(Outcome::ServerError, later);
        assert!(e.healthy(later), "not three in a row");
    }

    #[tokio::test]
    async fn refused_probes_eject_and_wake_waiting_requests_timeouts_do_not_wake() {
        let e = one_endpoint();
        let t0 = Instant::now();
        // Timeouts: a busy engine. They eject for new requests after three,
        // and never wake the requests already waiting.
        let waiting = e.went_down();
        tokio::pin!(waiting);
        for _ in 1..PROBE_TIMEOUTS_TO_EJECT {
            assert!(!e.record_probe(Outcome::Timeout, t0));
        }
        assert!(e.healthy(t0));
        assert!(e.record_probe(Outcome::Timeout, t0));
        assert!(!e.healthy(t0));
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut waiting)
                .await
                .is_err(),
            "timeouts alone abandon no request"
        );
        assert!(!e.record_probe(Outcome::Success, t0));
        assert!(e.healthy(t0), "an answer lifts the probes' ejection");
        // Refusals: nothing listens. Two in a row eject and wake the waiters.
        assert!(!e.record_probe(Outcome::ConnectFailure, t0));
        assert!(e.healthy(t0));
        assert!(e.record_probe(Outcome::ConnectFailure, t0));
        assert!(!e.healthy(t0));
        tokio::time::timeout(Duration::from_secs(1), &mut waiting)
            .await
            .expect("waiting requests are woken");
        assert!(!e.record_probe(Outcome::Success, t0));
        assert!(e.healthy(t0));
        // An ejection by a failed request is not lifted by a probe.
        e.record(Outcome::ConnectFailure, t0);
        e.record_probe(Outcome::Success, t0);
        assert!(!e.healthy(t0));
        // Probe misses interleaved with successes never eject.
        e.record(Outcome::Success, t0);
        for _ in 0..10 {
            e.record_probe(Outcome::ConnectFailure, t0);
            e.record_probe(Outcome::Success, t0);
        }
        assert!(e.healthy(t0));
    }
}
