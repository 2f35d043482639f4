//! The router's settings, and every default in one place.
//!
//! [`Config`] is what a running router reads; [`defaults`] holds the value of
//! every setting when nothing says otherwise. The command line
//! ([`crate::args`]) and [`Config::default`] both take their defaults from
//! [`defaults`], so a default is written once.

use std::time::Duration;

use kinference_scoring::PolicyName;

/// Every default of the router.
pub mod defaults {
    use std::time::Duration;

    // Durations are written as the command line takes them (see
    // [`super::parse_duration`]); [`super::duration`] reads them.

    /// Largest request body accepted (32 MiB: long agent contexts with
    /// tool results fit; a client sending more gets a 413).
    pub const BODY_LIMIT: usize = 32 << 20;
    /// Longest wait for a request's token ids before routing on load alone.
    pub const TOKENIZE_TIMEOUT: &str = "250ms";
    /// Bodies up to this size are tokenized on the I/O thread (a few
    /// microseconds with the prefix cache warm); larger ones on the
    /// blocking pool under the timeout.
    pub const TOKENIZE_INLINE_BYTES: usize = 16 << 10;
    /// Longest wait for an engine's response headers, and between two
    /// chunks of a streamed response.
    pub const UPSTREAM_TIMEOUT: &str = "10m";
    /// Attempts per request on different endpoints.
    pub const MAX_ATTEMPTS: usize = 3;
    /// The replay port is the KV-event port plus this when neither the
    /// engine nor the worker set says. 0: none, as vLLM and SGLang start
    /// without a replay socket unless configured.
    pub const KV_REPLAY_OFFSET: u16 = 0;
    /// Between `/health` and `/metrics` probes of each engine.
    pub const SCRAPE_INTERVAL: &str = "5s";
    /// Between `/v1/models` and `/version` calls to each engine.
    pub const DISCOVERY_INTERVAL: &str = "30s";
    /// Per probe call.
    pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
    /// Prompt tokens of each speed probe of a joining engine
    /// ([`crate::speed`]); 0: no probes. Long enough that the prefill, not
    /// the HTTP round trip, is most of its first token on a GPU (about
    /// 20–60 ms on an H100), short enough to cost the engine nothing.
    pub const SPEED_PROBE_TOKENS: u32 = 1024;
    /// Longest wait for a speed probe's answer: an engine that takes longer
    /// is observed as taking this long.
    pub const SPEED_PROBE_TIMEOUT: Duration = Duration::from_secs(5);
    /// Connecting to an engine (requests and probes).
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
    /// Decisions kept for `/debug/explain`.
    pub const EXPLAIN_BUFFER: usize = 64;
    /// One decision in this many is explained and kept.
    pub const EXPLAIN_EVERY: u64 = 16;
    /// Seed of the tie-breaking random source.
    pub const SEED: u64 = 0x6b69_6e66;
    /// Life of a record of where a prefix was sent
    /// ([`kinference_scoring::approx::DEFAULT_TTL`]).
    pub const PREFIX_TTL: Duration = kinference_scoring::approx::DEFAULT_TTL;
    /// Most (block, worker) entries the KV index holds when the container
    /// has no memory limit (about 1.2 GB at 24 bytes per entry).
    pub const KV_INDEX_MAX_ENTRIES: u64 = 50_000_000;
    /// The share of the container's memory limit the KV index gets by
    /// default (the rest: connections, buffers, tokenizer caches).
    pub const KV_INDEX_MEMORY_SHARE: f64 = 0.5;
    /// Longest wait for a request's headers on the serving port.
    pub const HEADER_READ_TIMEOUT: &str = "30s";
    /// Longest wait for a request's body.
    pub const BODY_READ_TIMEOUT: &str = "60s";
    /// Most client connections served at once.
    pub const MAX_CONNECTIONS: usize = 20_000;
    /// Time requests in flight get to finish at shutdown (the chart gives
    /// minutes: long generations).
    pub const DRAIN: &str = "30s";
    /// Whether clients may ask for the decision in response headers (they
    /// name endpoints, their addresses and load: off unless asked for).
    pub const DEBUG_HEADERS: bool = false;
    /// How long a starting replica with peers may wait for a peer's KV
    /// index before it reports ready without one (its index then fills
    /// from the engines' new events, as with no peers). A few seconds: the
    /// snapshot of a busy fleet's index arrives in well under one.
    pub const PEER_BOOTSTRAP_TIMEOUT: &str = "5s";
    /// The largest KV-index snapshot a replica sends a peer or accepts from
    /// one (about 17 bytes per block position: 64 MiB carry nearly four
    /// million; a larger index sends the blocks nearest the roots, the
    /// shared prefixes, first).
    pub const PEER_SNAPSHOT_MAX_BYTES: usize = 64 << 20;
    /// Bytes of block keys kept per worker set for prompts seen before
    /// ([`crate::memo`]; 16 bytes per block: 32 MiB hold about two
    /// million blocks).
    pub const ROUTE_MEMO_BYTES: usize = 32 << 20;
}

pub use kinference_api::duration::parse_duration;

/// A default duration of [`defaults`].
///
/// # Panics
/// When a default is not a duration (a test checks they all are).
pub fn duration(text: &str) -> Duration {
    parse_duration(text).expect("the defaults are durations")
}

/// How often and how patiently engines are probed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeIntervals {
    /// Between `/v1/models` calls.
    pub models: Duration,
    /// Between `/metrics` scrapes.
    pub metrics: Duration,
    /// Per call.
    pub timeout: Duration,
}

impl Default for ProbeIntervals {
    fn default() -> Self {
        Self {
            models: duration(defaults::DISCOVERY_INTERVAL),
            metrics: duration(defaults::SCRAPE_INTERVAL),
            timeout: defaults::PROBE_TIMEOUT,
        }
    }
}

/// Settings of a running router.
#[derive(Clone, Debug)]
pub struct Config {
    /// The routing policy (ours unless benchmarking).
    pub policy: PolicyName,
    /// Largest request body accepted.
    pub body_limit: usize,
    /// Longest wait for a tokenization.
    pub tokenize_timeout: Duration,
    /// Bodies up to this size are tokenized in place on the I/O thread;
    /// larger ones on the blocking pool under `tokenize_timeout`.
    pub tokenize_inline_bytes: usize,
    /// Longest wait for an engine's response headers, and between two chunks
    /// of a streamed response.
    pub upstream_timeout: Duration,
    /// Attempts per request on different endpoints.
    pub max_attempts: usize,
    /// Probe periods.
    pub probes: ProbeIntervals,
    /// Connecting to an engine.
    pub connect_timeout: Duration,
    /// Prompt tokens of each speed probe of a joining engine; 0: none
    /// ([`crate::speed`]).
    pub speed_probe_tokens: u32,
    /// The replay port is the KV port plus this when nothing else says (0:
    /// no replay).
    pub kv_replay_offset: u16,
    /// Decisions kept for `/debug/explain`.
    pub explain_buffer: usize,
    /// One decision in this many is explained and kept (besides those asked
    /// for with the debug header); 0 keeps none.
    pub explain_every: u64,
    /// Seed of the tie-breaking random source.
    pub seed: u64,
    /// TTL of the record of prefixes sent (approximate mode, and bursts of a
    /// new prefix before the engine's events arrive).
    pub prefix_ttl: Duration,
    /// Most (block, worker) entries the KV index holds.
    pub kv_max_entries: u64,
    /// Longest wait for a request's headers on the serving port.
    pub header_read_timeout: Duration,
    /// Longest wait for a request's body.
    pub body_read_timeout: Duration,
    /// Most client connections served at once; more wait to be accepted.
    pub max_connections: usize,
    /// Time requests in flight get to finish at shutdown.
    pub drain: Duration,
    /// Whether `x-kinference-debug` may ask for the decision in headers.
    pub debug_headers: bool,
    /// Whether each request writes an access-log line (target
    /// `kinference::access`; no prompts).
    pub access_log: bool,
    /// Client keys, the engines' key, TLS ([`crate::auth`]).
    pub security: Security,
    /// Other router replicas to share load with ([`crate::peers`]).
    pub peers: Option<crate::peers::Settings>,
}

/// Who may call the router and how it calls engines.
#[derive(Clone, Default)]
pub struct Security {
    /// The API keys clients must present; anyone may call without.
    pub client_keys: Option<std::sync::Arc<crate::auth::ClientKeys>>,
    /// `Authorization` for the engines (their `--api-key`).
    pub engine_auth: Option<http::HeaderValue>,
    /// TLS on the serving port.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
}

impl std::fmt::Debug for Security {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Security")
            .field("client_keys", &self.client_keys)
            .field("engine_auth", &self.engine_auth.is_some())
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            policy: PolicyName::Kinference,
            body_limit: defaults::BODY_LIMIT,
            tokenize_timeout: duration(defaults::TOKENIZE_TIMEOUT),
            tokenize_inline_bytes: defaults::TOKENIZE_INLINE_BYTES,
            upstream_timeout: duration(defaults::UPSTREAM_TIMEOUT),
            max_attempts: defaults::MAX_ATTEMPTS,
            probes: ProbeIntervals::default(),
            connect_timeout: defaults::CONNECT_TIMEOUT,
            speed_probe_tokens: defaults::SPEED_PROBE_TOKENS,
            kv_replay_offset: defaults::KV_REPLAY_OFFSET,
            explain_buffer: defaults::EXPLAIN_BUFFER,
            explain_every: defaults::EXPLAIN_EVERY,
            seed: defaults::SEED,
            prefix_ttl: defaults::PREFIX_TTL,
            kv_max_entries: defaults::KV_INDEX_MAX_ENTRIES,
            header_read_timeout: duration(defaults::HEADER_READ_TIMEOUT),
            body_read_timeout: duration(defaults::BODY_READ_TIMEOUT),
            max_connections: defaults::MAX_CONNECTIONS,
            drain: duration(defaults::DRAIN),
            debug_headers: defaults::DEBUG_HEADERS,
            access_log: false,
            security: Security::default(),
            peers: None,
        }
    }
}

/// The container's memory limit (cgroup v2 `memory.max`, else cgroup v1
/// `memory.limit_in_bytes`), when there is one.
pub fn memory_limit() -> Option<u64> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let v2 = read("/sys/fs/cgroup/memory.max");
    let v1 = || read("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    let text = v2.or_else(v1)?;
    let n: u64 = text.trim().parse().ok()?;
    // cgroup v1 writes a huge number for "no limit".
    (n < (1 << 60)).then_some(n)
}

/// The default KV-index budget: [`defaults::KV_INDEX_MEMORY_SHARE`] of the
/// container's memory limit at the index's measured bytes per entry, or
/// [`defaults::KV_INDEX_MAX_ENTRIES`] without a limit.
pub fn default_kv_max_entries(limit: Option<u64>) -> u64 {
    match limit {
        Some(bytes) => kinference_kvindex::max_entries_for_budget(
            (bytes as f64 * defaults::KV_INDEX_MEMORY_SHARE) as u64,
        ),
        None => defaults::KV_INDEX_MAX_ENTRIES,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_default_duration_parses() {
        for d in [
            defaults::TOKENIZE_TIMEOUT,
            defaults::UPSTREAM_TIMEOUT,
            defaults::SCRAPE_INTERVAL,
            defaults::DISCOVERY_INTERVAL,
            defaults::HEADER_READ_TIMEOUT,
            defaults::BODY_READ_TIMEOUT,
            defaults::DRAIN,
            defaults::PEER_BOOTSTRAP_TIMEOUT,
        ] {
            assert!(parse_duration(d).is_ok(), "{d}");
        }
    }

    #[test]
    fn the_index_budget_follows_the_memory_limit() {
        // The chart's 2 GiB limit: 1 GiB for the index at 24 B per entry.
        assert_eq!(default_kv_max_entries(Some(2 << 30)), (1 << 30) / 24);
        assert_eq!(default_kv_max_entries(None), defaults::KV_INDEX_MAX_ENTRIES);
    }
}
