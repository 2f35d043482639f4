//! Router replicas that see each other's load.
//!
//! Each replica keeps its own KV index from the engines' events; what it
//! cannot see is the work its peers have sent and that has not reached the
//! engines' own figures yet (scraped every few seconds). So every replica
//! serves its own per-engine in-flight load on its admin port
//! (`GET /peer/load`, five counters per engine, tens of bytes each) and
//! asks each peer for theirs. Decisions read this replica's load plus the
//! sum of its peers' fresh reports ([`crate::endpoint::Load::snapshot`]).
//!
//! The asking is a long poll: `GET /peer/load?after=V&wait_ms=W` answers as
//! soon as the peer's load has changed since its version `V` (the answer's
//! `x-kinference-load-version`), or after `W` ms with the same figures, so a
//! replica learns what a peer sent within milliseconds instead of a poll
//! interval later (measured: with 200 ms polls three replicas herded onto
//! the same engines, multi-turn TTFT p90 1.4× one router's). A report
//! arrives at least every `--peer-staleness` ÷ 2 while nothing changes,
//! and at most every [`MIN_GAP`] while load changes. A peer that answers
//! without a version (an older release, or anything that ignores the query)
//! is polled every `--peer-interval` (default 200 ms) as before.
//!
//! Peers are the other pods of the router's own Service (`--peer-service`,
//! its EndpointSlices in the router's namespace, at the admin port), or a
//! fixed list (`--peers`). With `--peer-token-file`, reports are served
//! and asked for with that bearer token only.
//!
//! A report also carries the prefixes this replica sent an engine since
//! the asker's version ([`Report::records`]): until that engine's KV
//! events arrive, a peer routing the same new prefix (the rest of a burst,
//! spread over the replicas by the Service) finds it there instead of
//! placing it on another engine; measured, two replicas without this
//! split 22 of a burst workload's 30 prefix groups over several engines.
//! Only every [`RECORD_STRIDE`]th block key goes (a key hashes its whole
//! prefix, so matching one matches every block before it): a peer's match
//! is exact to within `RECORD_STRIDE` blocks, at an eighth of the bytes.
//!
//! It also carries how many requests the replica has sent each engine
//! ([`Report::sent`]): the asker counts the increases as its peers'
//! arrivals there, which the kinference policy's externality adds to its
//! own sends ([`kinference_scoring::Candidate::peer_arrival_rate`]).
//!
//! The first answer to an asker (no version, or 0), and the first after
//! they come into use, also carry the step costs the replica learnt from
//! its streams ([`Report::steps`]): a replica that starts into a warm
//! fleet, or one still learning beside it, predicts with them at once
//! instead of the profile's until its own streams pin them down.
//!
//! It degrades to a lone router, never to worse: a peer that does not
//! answer within the interval, answers garbage, or whose last report is
//! older than `--peer-staleness` (1 s) counts for nothing; every figure a
//! peer reports is capped ([`MAX_REQUESTS`], [`MAX_TOKENS`]); a report is
//! at most [`MAX_REPORT_BYTES`]; nothing queues (one poll in flight per
//! peer, dropped at the next tick).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use http::header::{self, HeaderValue};
use tokio::time::Instant;

mod poll;
mod report;

pub use poll::{CountsSeen, Increases, PeerList, PeerState, PeerStatus, Settings, Source, spawn};
pub use report::{PeerRecord, Report, SentRecords, checkpoints, parse, report, sum};

/// The admin path of a replica's own load.
pub const LOAD_PATH: &str = "/peer/load";
/// Largest report read from a peer.
pub const MAX_REPORT_BYTES: usize = 1 << 20;
/// Most requests a peer may claim on one engine.
pub const MAX_REQUESTS: u32 = 100_000;
/// Most tokens a peer may claim on one engine.
pub const MAX_TOKENS: u64 = 1 << 32;
/// The response header carrying a report's load version.
pub const VERSION_HEADER: &str = "x-kinference-load-version";
/// Least time between two long polls of one peer: bounds the exchange rate
/// (at most 50 reports a second per peer) while load changes constantly.
pub const MIN_GAP: Duration = Duration::from_millis(20);
/// Longest wait a peer may ask for.
pub const MAX_WAIT: Duration = Duration::from_secs(5);
/// Every how many block keys one goes to the peers in a record.
pub const RECORD_STRIDE: usize = 8;
/// Most records one report carries (and a replica keeps to send).
pub const MAX_RECORDS: usize = 1024;
/// Most keys one record carries: `RECORD_STRIDE` × 1024 blocks, 131K
/// tokens at 16 per block.
pub const MAX_RECORD_KEYS: usize = 1024;
/// How long a record is worth sending and applying: the time the
/// engine's own events take to reach every replica's index.
pub const RECORD_HORIZON: Duration = kinference_scoring::approx::EXACT_MODE_HORIZON;

/// This replica's load version: bumped whenever a request of this replica
/// starts, gets its first token or ends anywhere.
static VERSION: AtomicU64 = AtomicU64::new(1);
/// Long polls waiting for the version to move.
static WAITING: AtomicU64 = AtomicU64::new(0);
static CHANGED: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Whether this process has peers to send its records to.
static SHARING: AtomicBool = AtomicBool::new(false);

/// This replica's load changed. Free when no peer waits.
pub fn load_changed() {
    bump_version();
}

/// Moves the version on, wakes the long polls waiting for it, and returns
/// the new version.
fn bump_version() -> u64 {
    let v = VERSION.fetch_add(1, Ordering::SeqCst) + 1;
    if WAITING.load(Ordering::Relaxed) > 0 {
        CHANGED.notify_waiters();
    }
    v
}

/// Whether this process has peers to report to.
pub fn sharing() -> bool {
    SHARING.load(Ordering::Relaxed)
}

/// The current load version.
pub fn version() -> u64 {
    VERSION.load(Ordering::SeqCst)
}

/// What a long poll asks: `after` (the version the asker has) and `wait_ms`.
pub fn long_poll_query(query: Option<&str>) -> Option<(u64, Duration)> {
    let (mut after, mut wait) = (None, None);
    for pair in query?.split('&') {
        match pair.split_once('=') {
            Some(("after", v)) => after = v.parse().ok(),
            Some(("wait_ms", v)) => wait = v.parse().ok().map(Duration::from_millis),
            _ => {}
        }
    }
    Some((after?, wait?.min(MAX_WAIT)))
}

/// Waits until the load version differs from `after` or `wait` has passed;
/// returns the version then.
pub async fn wait_for_change(after: u64, wait: Duration) -> u64 {
    struct Waiting;
    impl Drop for Waiting {
        fn drop(&mut self) {
            WAITING.fetch_sub(1, Ordering::Relaxed);
        }
    }
    WAITING.fetch_add(1, Ordering::Relaxed);
    let _waiting = Waiting;
    let deadline = Instant::now() + wait;
    loop {
        let notified = CHANGED.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let v = version();
        if v != after {
            return v;
        }
        tokio::select! {
            () = notified => {}
            () = tokio::time::sleep_until(deadline) => return version(),
        }
    }
}

/// What crossed between this replica and its peers, in bytes of HTTP/1.1
/// messages (start line, headers, body; TCP/IP overhead not counted), per
/// direction and kind: load polls ([`LOAD_PATH`]) and KV index snapshots
/// ([`crate::snapshot::SNAPSHOT_PATH`]). Both the asking and the answering
/// replica count an exchange (one as sent, the other as received), so the
/// sum of `received` over all replicas is everything on the wire once.
#[derive(Debug, Default)]
pub struct Traffic {
    /// Load polls and reports received.
    pub load_received: AtomicU64,
    /// Load polls and reports sent.
    pub load_sent: AtomicU64,
    /// Snapshot requests and snapshots received.
    pub snapshot_received: AtomicU64,
    /// Snapshot requests and snapshots sent.
    pub snapshot_sent: AtomicU64,
}

/// Bytes of an HTTP/1.1 message head: start line `start` (without its
/// CRLF), each header as `name: value`, the blank line.
pub fn head_bytes(start: usize, headers: &http::HeaderMap) -> u64 {
    let h: usize = headers
        .iter()
        .map(|(n, v)| n.as_str().len() + 2 + v.len() + 2)
        .sum();
    (start + 2 + h + 2) as u64
}

/// Bytes of a `GET path` request this replica sends a peer at `address`
/// (hyper adds `host`).
pub fn request_bytes(path_and_query: &str, address: &str, headers: &http::HeaderMap) -> u64 {
    head_bytes("GET  HTTP/1.1".len() + path_and_query.len(), headers)
        + ("host: ".len() + address.len() + 2) as u64
}

/// Bytes of a response with status `status`, headers and a body of
/// `body` bytes; `server` adds what hyper's server writes beside ours
/// (`content-length`, `date`).
pub fn response_bytes(
    status: http::StatusCode,
    headers: &http::HeaderMap,
    body: usize,
    server: bool,
) -> u64 {
    let start = "HTTP/1.1 ".len() + 3 + 1 + status.canonical_reason().map_or(0, str::len);
    let added = if server {
        "content-length: ".len()
            + body.to_string().len()
            + 2
            + "date: Thu, 01 Jan 1970 00:00:00 GMT".len()
            + 2
    } else {
        0
    };
    head_bytes(start, headers) + (added + body) as u64
}

/// Whether `headers` carry the peer token (always, without one).
pub fn allowed(token: Option<&HeaderValue>, headers: &http::HeaderMap) -> bool {
    let Some(t) = token else { return true };
    headers.get(header::AUTHORIZATION).is_some_and(|v| {
        let (a, b) = (v.as_bytes(), t.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_poll_queries_parse_and_are_bounded() {
        assert_eq!(long_poll_query(None), None);
        assert_eq!(long_poll_query(Some("")), None);
        assert_eq!(
            long_poll_query(Some("after=3")),
            None,
            "no wait: a plain poll"
        );
        assert_eq!(
            long_poll_query(Some("after=3&wait_ms=400")),
            Some((3, Duration::from_millis(400)))
        );
        assert_eq!(
            long_poll_query(Some("wait_ms=99999999&after=0&x=y")),
            Some((0, MAX_WAIT))
        );
        assert_eq!(long_poll_query(Some("after=-1&wait_ms=5")), None);
    }

    #[tokio::test]
    async fn a_long_poll_answers_when_the_load_changes_or_when_its_wait_ends() {
        // Nothing changes: the wait runs out and the version is the same.
        // (The version is the process's: other tests of this binary may
        // move it meanwhile, and then the answer comes early, with the new
        // version.)
        let v = version();
        let started = Instant::now();
        let got = wait_for_change(v, Duration::from_millis(30)).await;
        assert!(
            got != v || started.elapsed() >= Duration::from_millis(30),
            "answered early with the same version"
        );
        let v = version();
        // An older version answers at once.
        assert!(wait_for_change(v.wrapping_sub(1), Duration::from_secs(60)).await != v - 1);
        // A change wakes a waiting poll long before its wait ends.
        let waiter = tokio::spawn(wait_for_change(v, Duration::from_secs(60)));
        tokio::time::sleep(Duration::from_millis(20)).await;
        load_changed();
        let woke = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("woken by the change")
            .unwrap();
        assert!(woke > v);
    }

    #[test]
    fn the_token_is_required_when_set() {
        let t = HeaderValue::from_static("Bearer s3cret");
        let mut h = http::HeaderMap::new();
        assert!(allowed(None, &h));
        assert!(!allowed(Some(&t), &h));
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer nope!!"),
        );
        assert!(!allowed(Some(&t), &h));
        h.insert(header::AUTHORIZATION, t.clone());
        assert!(allowed(Some(&t), &h));
    }
}
