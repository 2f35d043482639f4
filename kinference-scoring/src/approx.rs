//! Approximate mode: the router's own record of where it sent which prompt
//! prefixes, used as the cache estimate when there are no KV events or no
//! token ids.
//!
//! ## How the router uses it
//!
//! 1. Cut the prompt text (rendered chat, or completion prompt) into
//!    fixed-size byte blocks and chain-hash them with [`text_block_keys`]
//!    (seed it with the model and LoRA name so different models never match).
//! 2. Look up [`PrefixRecord::leading_blocks`]: per endpoint, how many of the
//!    leading blocks it was sent within the TTL. Put that count in
//!    [`crate::CachedBlocks::gpu`], set [`crate::CacheSource::Approximate`],
//!    `Request::block_tokens` = estimated tokens per text block (block bytes ÷
//!    bytes per token, ~4 for English with BPE tokenizers) and
//!    `prompt_tokens` = the estimated prompt length.
//! 3. After the decision, [`PrefixRecord::record`] the chosen endpoint with
//!    the same keys.
//!
//! The same record also covers the window between routing a request and the
//! engine's `BlockStored` events in exact mode: a second request with the same
//! new prefix, arriving while the first is still in prefill, finds the prefix
//! on the first one's endpoint (vLLM shares computed blocks of running
//! requests). Taking the larger of the index's and the record's GPU count
//! keeps bursts of a new prefix together. In exact mode, look it up with
//! [`PrefixRecord::leading_blocks_within`] and a horizon of about the time
//! from routing to the engine's events ([`EXACT_MODE_HORIZON`]), not the
//! TTL: after that the index is authoritative, and it also knows what the
//! engine has evicted since, which the record cannot. Trusting the record
//! for its whole TTL routes repeats to an engine that has already evicted
//! their prefix (`cargo xtask bench routing`, shared-prefix at the knee: a
//! third of the decisions were taken on record-only blocks, a third of
//! those recomputed the whole prompt, TTFT p90 5× the oracle's).
//!
//! ## Guarantees and costs
//!
//! - Pure: time is passed in; no clock, no I/O.
//! - Bounded: at most `capacity` (key, endpoint) records, oldest evicted
//!   first; records older than the TTL never match and are dropped on the
//!   next `record` or `expire`. About 110 bytes per record, so the default
//!   capacity of 262,144 records is about 29 MB.
//! - `record` is amortised O(keys); `leading_blocks` is O(matched keys ×
//!   endpoints holding them); `remove_endpoint` is O(records).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Duration;

use smallvec::SmallVec;

use crate::input::EndpointId;

/// How long a record stands for a prefix on an endpoint. Dynamo's default
/// TTL for routing-decision cache predictions (`--router-ttl`, 120 s) is long
/// for busy engines: vLLM evicts LRU blocks under pressure within seconds to
/// minutes. The router's default (it is the router's `prefix_ttl` setting).
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// How long a record may stand in for the index in exact mode: enough for
/// a request to be admitted and prefilled and its `BlockStored` events to
/// reach the router on a loaded engine; after that the index (which also
/// sees evictions) is the truth.
pub const EXACT_MODE_HORIZON: Duration = Duration::from_secs(2);

/// Default bound on (key, endpoint) records.
pub const DEFAULT_CAPACITY: usize = 1 << 18;

/// Chain-hash the full `block_bytes`-sized blocks of `text` into `out`
/// (cleared first): key *i* = xxh3(block *i*, seed = key *i − 1*), starting
/// from `seed`. A trailing partial block is ignored; `block_bytes == 0` yields
/// no keys.
pub fn text_block_keys(seed: u64, text: &[u8], block_bytes: usize, out: &mut Vec<u64>) {
    out.clear();
    if block_bytes == 0 {
        return;
    }
    let mut prev = seed;
    for block in text.chunks_exact(block_bytes) {
        prev = xxhash_rust::xxh3::xxh3_64_with_seed(block, prev);
        out.push(prev);
    }
}

/// Keys are already hashes: one multiply spreads them over the table.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

#[derive(Debug, Clone, Copy)]
struct Holder {
    endpoint: EndpointId,
    seq: u64,
    at: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    key: u64,
    endpoint: EndpointId,
    seq: u64,
    at: u64,
}

/// What one [`PrefixRecord::record`] call wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordMark {
    endpoint: EndpointId,
    first_seq: u64,
    last_seq: u64,
}

/// Where the router recently sent which prefix blocks.
#[derive(Debug, Clone)]
pub struct PrefixRecord {
    ttl: u64,
    capacity: usize,
    map: HashMap<u64, SmallVec<[Holder; 2]>, BuildHasherDefault<KeyHasher>>,
    /// Every record and refresh in time order; entries superseded by a
    /// refresh or removal are skipped when they reach the front.
    log: VecDeque<Entry>,
    live: usize,
    /// Live records per endpoint id (a dense vector, grown on demand).
    per_endpoint: Vec<u32>,
    seq: u64,
}

impl Default for PrefixRecord {
    fn default() -> Self {
        Self::new(DEFAULT_TTL, DEFAULT_CAPACITY)
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl PrefixRecord {
    /// A record whose entries live `ttl` and of which at most `capacity`
    /// (at least 1) are kept.
    pub fn new(ttl: Duration, capacity: usize) -> Self {
        Self {
            ttl: nanos(ttl),
            capacity: capacity.max(1),
            map: HashMap::default(),
            log: VecDeque::new(),
            live: 0,
            per_endpoint: Vec::new(),
            seq: 0,
        }
    }

    /// Live (key, endpoint) records, expired ones not yet dropped included.
    pub fn len(&self) -> usize {
        self.live
    }

    /// No records.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// The bound on records.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Distinct blocks recorded for `endpoint` within the TTL (expired
    /// records not yet dropped included): the prompt blocks this router sent
    /// there recently, which the engine's later requests are likely to
    /// reuse, i.e. the part of its cache that is in use. O(1).
    pub fn blocks_sent(&self, endpoint: EndpointId) -> u32 {
        self.per_endpoint
            .get(endpoint.index())
            .copied()
            .unwrap_or(0)
    }

    fn count(&mut self, endpoint: EndpointId, added: bool) {
        let i = endpoint.index();
        if i >= self.per_endpoint.len() {
            if !added || endpoint.0 >= EndpointId::LIMIT {
                return;
            }
            self.per_endpoint.resize(i + 1, 0);
        }
        let n = &mut self.per_endpoint[i];
        *n = if added {
            n.saturating_add(1)
        } else {
            n.saturating_sub(1)
        };
    }

    /// Note that `endpoint` was sent a prompt whose leading block keys are
    /// `keys`, at `now`. The mark returned lets [`PrefixRecord::withdraw`]
    /// take the note back if the engine refuses the request.
    pub fn record(&mut self, endpoint: EndpointId, keys: &[u64], now: Duration) -> RecordMark {
        let at = nanos(now);
        self.expire(now);
        let first_seq = self.seq + 1;
        for &key in keys {
            self.seq += 1;
            let seq = self.seq;
            let holders = self.map.entry(key).or_default();
            let added = if let Some(h) = holders.iter_mut().find(|h| h.endpoint == endpoint) {
                h.seq = seq;
                h.at = at;
                false
            } else {
                holders.push(Holder { endpoint, seq, at });
                true
            };
            if added {
                self.live += 1;
                self.count(endpoint, true);
            }
            self.log.push_back(Entry {
                key,
                endpoint,
                seq,
                at,
            });
            if self.log.len() > self.capacity {
                if self.live <= self.capacity / 2 {
                    self.compact();
                } else {
                    self.pop_front();
                }
            }
        }
        RecordMark {
            endpoint,
            first_seq,
            last_seq: self.seq,
        }
    }

    /// Takes back what `record` wrote under `mark` for `keys` (the same
    /// keys): the endpoint refused the request, so it holds nothing new
    /// (an older note this call refreshed goes too: the refusing engine is
    /// not trusted with it). Notes refreshed by a later `record` stay.
    pub fn withdraw(&mut self, keys: &[u64], mark: RecordMark) {
        let mut removed = 0;
        for key in keys {
            let Some(holders) = self.map.get_mut(key) else {
                continue;
            };
            let before = holders.len();
            holders.retain(|h| {
                h.endpoint != mark.endpoint || !(mark.first_seq..=mark.last_seq).contains(&h.seq)
            });
            removed += before - holders.len();
            if holders.is_empty() {
                self.map.remove(key);
            }
        }
        // Their log entries are no longer current and are skipped when they
        // reach the front.
        self.live -= removed;
        if let Some(n) = self.per_endpoint.get_mut(mark.endpoint.index()) {
            *n = n.saturating_sub(u32::try_from(removed).unwrap_or(u32::MAX));
        }
    }

    /// Drop records older than the TTL.
    pub fn expire(&mut self, now: Duration) {
        let now = nanos(now);
        while let Some(front) = self.log.front() {
            if self.is_current(front) && now.saturating_sub(front.at) <= self.ttl {
                break;
            }
            self.pop_front();
        }
    }

    /// Forget `endpoint` (it left the set).
    pub fn remove_endpoint(&mut self, endpoint: EndpointId) {
        let mut removed = 0;
        self.map.retain(|_, holders| {
            let before = holders.len();
            holders.retain(|h| h.endpoint != endpoint);
            removed += before - holders.len();
            !holders.is_empty()
        });
        self.live -= removed;
        if let Some(n) = self.per_endpoint.get_mut(endpoint.index()) {
            *n = 0;
        }
    }

    /// For each endpoint, how many of `keys`, from the first, it was sent
    /// within the TTL before `now`. Written to `out` (cleared first), only
    /// endpoints with at least one block, in no particular order.
    pub fn leading_blocks(&self, keys: &[u64], now: Duration, out: &mut Vec<(EndpointId, u32)>) {
        self.leading_blocks_aged(keys, nanos(now), self.ttl, out);
    }

    /// [`PrefixRecord::leading_blocks`] counting only records at most
    /// `max_age` old (and within the TTL): in exact mode, the record bridges
    /// the time until the engine's events reach the index, and no longer
    /// (see [`EXACT_MODE_HORIZON`]).
    pub fn leading_blocks_within(
        &self,
        keys: &[u64],
        now: Duration,
        max_age: Duration,
        out: &mut Vec<(EndpointId, u32)>,
    ) {
        self.leading_blocks_aged(keys, nanos(now), nanos(max_age).min(self.ttl), out);
    }

    fn leading_blocks_aged(
        &self,
        keys: &[u64],
        now: u64,
        max_age: u64,
        out: &mut Vec<(EndpointId, u32)>,
    ) {
        out.clear();
        let fresh = |h: &Holder| now.saturating_sub(h.at) <= max_age;
        let Some((first, rest)) = keys.split_first() else {
            return;
        };
        if let Some(holders) = self.map.get(first) {
            out.extend(holders.iter().filter(|h| fresh(h)).map(|h| (h.endpoint, 1)));
        }
        for (depth, key) in (1u32..).zip(rest) {
            let Some(holders) = self.map.get(key) else {
                break;
            };
            let mut any = false;
            for (endpoint, count) in out.iter_mut() {
                if *count == depth && holders.iter().any(|h| h.endpoint == *endpoint && fresh(h)) {
                    *count += 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
    }

    fn is_current(&self, e: &Entry) -> bool {
        self.map.get(&e.key).is_some_and(|hs| {
            hs.iter()
                .any(|h| h.endpoint == e.endpoint && h.seq == e.seq)
        })
    }

    /// Pop the oldest log entry, evicting its record if it is still current.
    fn pop_front(&mut self) {
        let Some(e) = self.log.pop_front() else {
            return;
        };
        if let Some(holders) = self.map.get_mut(&e.key)
            && let Some(pos) = holders
                .iter()
                .position(|h| h.endpoint == e.endpoint && h.seq == e.seq)
        {
            holders.swap_remove(pos);
            self.live -= 1;
            if holders.is_empty() {
                self.map.remove(&e.key);
            }
            self.count(e.endpoint, false);
        }
    }

    /// Drop superseded log entries (amortised: runs at most once per
    /// `capacity / 2` records).
    fn compact(&mut self) {
        let mut log = std::mem::take(&mut self.log);
        log.retain(|e| self.is_current(e));
        self.log = log;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(text: &str) -> Vec<u64> {
        let mut out = Vec::new();
        text_block_keys(7, text.as_bytes(), 4, &mut out);
        out
    }

    fn lookup(r: &PrefixRecord, k: &[u64], now: Duration) -> Vec<(EndpointId, u32)> {
        let mut out = Vec::new();
        r.leading_blocks(k, now, &mut out);
        out.sort();
        out
    }

    #[test]
    fn withdrawn_records_no_longer_match_but_later_ones_do() {
        let mut r = PrefixRecord::new(Duration::from_secs(30), 64);
        let k = keys("abcdefghijkl");
        let t = Duration::from_secs(1);
        let kept = r.record(EndpointId(1), &k, t);
        let refused = r.record(EndpointId(2), &k, t);
        assert_eq!(lookup(&r, &k, t), [(EndpointId(1), 3), (EndpointId(2), 3)]);
        r.withdraw(&k, refused);
        assert_eq!(lookup(&r, &k, t), [(EndpointId(1), 3)]);
        assert_eq!(r.len(), 3);
        // A mark whose notes were refreshed since withdraws nothing.
        let again = r.record(EndpointId(1), &k[..1], t);
        r.withdraw(&k, kept);
        assert_eq!(lookup(&r, &k, t), [(EndpointId(1), 1)]);
        r.withdraw(&k[..1], again);
        assert!(lookup(&r, &k, t).is_empty());
        assert!(r.is_empty());
    }

    #[test]
    fn keys_chain_so_equal_blocks_at_different_depths_differ() {
        let k = keys("abcdabcdabc");
        assert_eq!(k.len(), 2, "the partial block is ignored");
        assert_ne!(k[0], k[1]);
        assert_eq!(keys("abcdabcd"), k);
        let mut other_seed = Vec::new();
        text_block_keys(8, b"abcdabcd", 4, &mut other_seed);
        assert_ne!(other_seed, k);
        text_block_keys(7, b"abcd", 0, &mut other_seed);
        assert!(other_seed.is_empty());
    }

    #[test]
    fn counts_leading_blocks_per_endpoint() {
        let mut r = PrefixRecord::new(Duration::from_secs(60), 1000);
        let t = Duration::from_secs(1);
        let sys_a = keys("SYSTEM PROMPT AAAAuser one");
        let sys_b = keys("SYSTEM PROMPT AAAAuser two");
        r.record(EndpointId(1), &sys_a, t);
        r.record(EndpointId(2), &sys_b[..3], t);
        // sys_b shares 5 leading blocks with sys_a: "SYST" "EM P" "ROMP"
        // "T AA" "AAus", then "er o" against "er t".
        let got = lookup(&r, &sys_b, t);
        assert_eq!(got, vec![(EndpointId(1), 5), (EndpointId(2), 3)]);
        assert!(lookup(&r, &keys("something else"), t).is_empty());
        assert!(lookup(&r, &[], t).is_empty());
    }

    #[test]
    fn blocks_sent_counts_each_endpoints_distinct_live_records() {
        let mut r = PrefixRecord::new(Duration::from_secs(10), 1000);
        let a = keys("0123456789abcdef");
        let b = keys("0123456789abzzzz");
        let t0 = Duration::from_secs(0);
        r.record(EndpointId(1), &a, t0);
        // A refresh of the same blocks adds nothing; a fork adds its own.
        r.record(EndpointId(1), &a, t0);
        r.record(EndpointId(1), &b, t0);
        let refused = r.record(EndpointId(2), &b, t0);
        assert_eq!(r.blocks_sent(EndpointId(1)), 5);
        assert_eq!(r.blocks_sent(EndpointId(2)), 4);
        assert_eq!(r.blocks_sent(EndpointId(9)), 0);
        r.withdraw(&b, refused);
        assert_eq!(r.blocks_sent(EndpointId(2)), 0);
        // Endpoint 1's records expire; endpoint 3's, made later, stay.
        r.record(EndpointId(3), &a[..2], Duration::from_secs(5));
        r.expire(Duration::from_secs(11));
        assert_eq!(r.blocks_sent(EndpointId(1)), 0);
        assert_eq!(r.blocks_sent(EndpointId(3)), 2);
        r.remove_endpoint(EndpointId(3));
        assert_eq!(r.blocks_sent(EndpointId(3)), 0);
        assert!(r.is_empty());
        // Capacity evictions count too.
        let mut small = PrefixRecord::new(Duration::from_secs(10), 4);
        small.record(EndpointId(0), &a, t0);
        small.record(EndpointId(1), &b, t0);
        assert_eq!(
            small.blocks_sent(EndpointId(0)) + small.blocks_sent(EndpointId(1)),
            u32::try_from(small.len()).unwrap()
        );
    }

    #[test]
    fn entries_expire_after_the_ttl() {
        let mut r = PrefixRecord::new(Duration::from_secs(10), 1000);
        let k = keys("0123456789abcdef");
        r.record(EndpointId(3), &k, Duration::from_secs(0));
        assert_eq!(
            lookup(&r, &k, Duration::from_secs(10)),
            vec![(EndpointId(3), 4)]
        );
        assert!(lookup(&r, &k, Duration::from_secs(11)).is_empty());
        r.expire(Duration::from_secs(11));
        assert!(r.is_empty());
    }

    #[test]
    fn exact_mode_counts_only_records_within_the_horizon() {
        let mut r = PrefixRecord::new(Duration::from_secs(60), 1000);
        let k = keys("0123456789abcdef");
        r.record(EndpointId(3), &k[..2], Duration::from_secs(0));
        r.record(EndpointId(4), &k, Duration::from_secs(9));
        let within = |now: u64, horizon: u64| {
            let mut out = Vec::new();
            r.leading_blocks_within(
                &k,
                Duration::from_secs(now),
                Duration::from_secs(horizon),
                &mut out,
            );
            out.sort_unstable();
            out
        };
        // Both within the TTL; only the recent one within a 2 s horizon.
        assert_eq!(
            lookup(&r, &k, Duration::from_secs(10)),
            vec![(EndpointId(3), 2), (EndpointId(4), 4)]
        );
        assert_eq!(within(10, 2), vec![(EndpointId(4), 4)]);
        assert!(within(12, 2).is_empty());
        // A horizon beyond the TTL is the TTL.
        assert_eq!(within(10, 3600), lookup(&r, &k, Duration::from_secs(10)));
        assert!(within(70, 3600).is_empty());
    }

    #[test]
    fn refreshing_keeps_an_entry_alive() {
        let mut r = PrefixRecord::new(Duration::from_secs(10), 1000);
        let k = keys("01234567");
        for s in 0..30 {
            r.record(EndpointId(0), &k, Duration::from_secs(s));
        }
        assert_eq!(r.len(), 2);
        assert_eq!(
            lookup(&r, &k, Duration::from_secs(35)),
            vec![(EndpointId(0), 2)]
        );
    }

    #[test]
    fn memory_is_bounded_and_the_oldest_go_first() {
        let mut r = PrefixRecord::new(Duration::from_secs(3600), 64);
        for i in 0..1000u64 {
            r.record(EndpointId((i % 5) as u32), &[i], Duration::from_millis(i));
            assert!(r.len() <= 64);
            assert!(r.log.len() <= 64);
        }
        assert!(lookup(&r, &[999], Duration::from_secs(2)).len() == 1);
        assert!(lookup(&r, &[0], Duration::from_secs(2)).is_empty());
    }

    #[test]
    fn refreshes_do_not_evict_live_entries() {
        // A hot prefix re-recorded many times must not push out a colder,
        // still-live one through log churn.
        let mut r = PrefixRecord::new(Duration::from_secs(3600), 16);
        r.record(EndpointId(9), &[42], Duration::ZERO);
        for i in 0..10_000u64 {
            r.record(EndpointId(1), &[1, 2, 3], Duration::from_millis(i));
        }
        assert_eq!(
            lookup(&r, &[42], Duration::from_secs(11)),
            vec![(EndpointId(9), 1)]
        );
        assert_eq!(r.len(), 4);
    }

    #[test]
    fn removing_an_endpoint_forgets_it() {
        let mut r = PrefixRecord::new(Duration::from_secs(60), 100);
        let k = keys("abcdefgh");
        r.record(EndpointId(1), &k, Duration::ZERO);
        r.record(EndpointId(2), &k, Duration::ZERO);
        r.remove_endpoint(EndpointId(1));
        assert_eq!(lookup(&r, &k, Duration::ZERO), vec![(EndpointId(2), 2)]);
        assert_eq!(r.len(), 2);
        r.remove_endpoint(EndpointId(2));
        assert!(r.is_empty());
        // Stale log entries of removed endpoints are harmless.
        r.expire(Duration::from_secs(3600));
        assert!(r.log.is_empty());
    }
}
