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
//! It degrades to a lone router, never to worse: a peer that does not
//! answer within the interval, answers garbage, or whose last report is
//! older than `--peer-staleness` (1 s) counts for nothing; every figure a
//! peer reports is capped ([`MAX_REQUESTS`], [`MAX_TOKENS`]); a report is
//! at most [`MAX_REPORT_BYTES`]; nothing queues (one poll in flight per
//! peer, dropped at the next tick).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http_body_util::{BodyExt as _, Empty};
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::endpoint::LoadSnapshot;
use crate::state::Shared;

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

/// The keys a record carries: every [`RECORD_STRIDE`]th of `keys` (the
/// last key of each stride), at most [`MAX_RECORD_KEYS`].
pub fn checkpoints(keys: &[u64]) -> impl Iterator<Item = u64> + '_ {
    keys.iter()
        .skip(RECORD_STRIDE - 1)
        .step_by(RECORD_STRIDE)
        .take(MAX_RECORD_KEYS)
        .copied()
}

/// One prefix this replica sent, kept for its peers.
#[derive(Debug)]
struct Sent {
    version: u64,
    at: Instant,
    engine: String,
    keys: Vec<u64>,
}

/// The prefixes this replica sent within [`RECORD_HORIZON`], for its
/// peers' reports; at most [`MAX_RECORDS`]. Written only while the replica
/// has peers.
#[derive(Debug, Default)]
pub struct SentRecords {
    sent: parking_lot::Mutex<std::collections::VecDeque<Sent>>,
}

impl SentRecords {
    /// Keeps `keys` (a prompt's block keys, sent to `engine`) for the
    /// peers, and wakes their long polls.
    pub fn push(&self, engine: &str, keys: &[u64]) {
        if !SHARING.load(Ordering::Relaxed) || keys.len() < RECORD_STRIDE {
            return;
        }
        let keys: Vec<u64> = checkpoints(keys).collect();
        let now = Instant::now();
        {
            let mut sent = self.sent.lock();
            while sent.len() >= MAX_RECORDS
                || sent
                    .front()
                    .is_some_and(|s| now.saturating_duration_since(s.at) > RECORD_HORIZON)
            {
                sent.pop_front();
            }
            // Stamped inside the lock: a report reading the version and
            // then the records sees every record up to that version.
            sent.push_back(Sent {
                version: bump_version(),
                at: now,
                engine: engine.to_owned(),
                keys,
            });
        }
    }

    /// The records stamped after `after` (every one kept, with `None`),
    /// younger than the horizon, appended to `out`.
    fn since(&self, after: Option<u64>, out: &mut Vec<PeerRecord>) {
        let now = Instant::now();
        let sent = self.sent.lock();
        for s in sent.iter() {
            let age = now.saturating_duration_since(s.at);
            if after.is_some_and(|a| s.version <= a) || age > RECORD_HORIZON {
                continue;
            }
            if out.len() >= MAX_RECORDS {
                break;
            }
            out.push(PeerRecord {
                engine: s.engine.clone(),
                age_ms: u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
                keys: s.keys.clone(),
            });
        }
    }
}

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

/// One replica's load report.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// The replica (random per process): a replica that finds itself in
    /// its peer list ignores its own report.
    pub replica: String,
    /// Per engine (`address:port`): requests, prefilling, prefill tokens,
    /// decoding, context tokens.
    pub engines: HashMap<String, [u64; 5]>,
    /// Prefixes sent since the asker's version (absent from older
    /// replicas' reports).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub records: Vec<PeerRecord>,
    /// Per engine: the uncached prompt tokens of every request this
    /// replica sent there that got its first token, cumulative; only the
    /// engines whose count moved at or after the asker's version (all of
    /// them without one). Absent from older replicas' reports. Lets each
    /// replica count the others' prefill in the engine steps it measures
    /// ([`crate::endpoint`], [`PrefilledSeen`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefilled: Option<HashMap<String, u64>>,
}

/// A prefix a replica sent an engine.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerRecord {
    /// The engine (`address:port`).
    pub engine: String,
    /// How long ago, in milliseconds.
    pub age_ms: u64,
    /// Every [`RECORD_STRIDE`]th block key of the prompt
    /// ([`checkpoints`]).
    pub keys: Vec<u64>,
}

/// This replica's report; its records are those stamped after `after`
/// (all it keeps, with `None`), its prefilled counts those marked at or
/// after it. A count is marked with the version after the current one
/// before that version is made ([`crate::endpoint::Load::prefilled_version`]),
/// so the first answer whose version was read after the mark both sees
/// the new count and sends it; the boundary may go twice, never not at
/// all.
pub fn report(shared: &Shared, after: Option<u64>) -> Report {
    let view = shared.view();
    let mut engines = HashMap::new();
    let mut records = Vec::new();
    let mut prefilled = HashMap::new();
    for ws in &view.worker_sets {
        ws.runtime.sent.since(after, &mut records);
        for e in &ws.endpoints {
            let moved = e.load.prefilled_version.load(Ordering::SeqCst);
            let p = e.load.prefilled.load(Ordering::SeqCst);
            if p > 0 && after.is_none_or(|a| moved >= a) {
                prefilled.insert(e.authority.clone(), p);
            }
            let l = e.load.own();
            if l.requests == 0 && l.prefilling == 0 {
                continue;
            }
            engines.insert(
                e.authority.clone(),
                [
                    u64::from(l.requests),
                    u64::from(l.prefilling),
                    l.prefill_tokens,
                    u64::from(l.decoding),
                    l.context_tokens,
                ],
            );
        }
    }
    Report {
        replica: shared.runtime.replica.clone(),
        engines,
        records,
        prefilled: Some(prefilled),
    }
}

/// Puts a peer's records in the prefix records of the worker sets whose
/// endpoints they name, dated by their age.
fn apply(shared: &Shared, records: &[PeerRecord]) {
    if records.is_empty() {
        return;
    }
    let view = shared.view();
    let now = shared.now();
    for ws in &view.worker_sets {
        let mut prefixes = ws.runtime.peer_prefixes.write();
        for r in records {
            let Some(e) = ws.endpoints.iter().find(|e| e.authority == r.engine) else {
                continue;
            };
            let at = now.saturating_sub(Duration::from_millis(r.age_ms));
            prefixes.record(kinference_scoring::EndpointId(e.id.0), &r.keys, at);
        }
    }
}

/// Where the peers are.
#[derive(Clone, Debug)]
pub enum Source {
    /// A fixed list of admin addresses.
    Fixed(Vec<String>),
    /// The ready addresses of a Service's EndpointSlices, at `admin_port`.
    Service {
        /// The router's namespace.
        namespace: String,
        /// The router's Service.
        name: String,
        /// The peers' admin port (this replica's own).
        admin_port: u16,
    },
}

/// Peer settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Who.
    pub source: Source,
    /// Between polls of a peer that does not long-poll, between retries,
    /// and between checks of the peer list (also what an answer may take
    /// beyond a long poll's wait).
    pub interval: Duration,
    /// Reports older than this count for nothing.
    pub staleness: Duration,
    /// `Authorization` to send and to require.
    pub token: Option<HeaderValue>,
    /// How long a starting replica waits for a peer's KV index
    /// ([`crate::snapshot`]); zero: it does not ask.
    pub bootstrap_timeout: Duration,
    /// The largest KV index snapshot sent or accepted.
    pub snapshot_max_bytes: usize,
}

/// The peers' admin addresses as last found.
#[derive(Debug, Default)]
pub struct PeerList {
    addresses: RwLock<Vec<String>>,
    listed: AtomicBool,
}

impl PeerList {
    /// The addresses now.
    pub fn get(&self) -> Vec<String> {
        self.addresses.read().clone()
    }

    /// Whether the peers were listed at least once (a fixed list always
    /// is; a Service's once its EndpointSlices answered).
    pub fn listed(&self) -> bool {
        self.listed.load(Ordering::Relaxed)
    }

    fn set(&self, addresses: Vec<String>) {
        *self.addresses.write() = addresses;
        self.listed.store(true, Ordering::Relaxed);
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

/// Parses and bounds a peer's report; `None` for anything malformed.
pub fn parse(body: &[u8]) -> Option<Report> {
    let mut r: Report = serde_json::from_slice(body).ok()?;
    let horizon = u64::try_from(RECORD_HORIZON.as_millis()).unwrap_or(u64::MAX);
    r.records.truncate(MAX_RECORDS);
    r.records
        .retain(|x| x.age_ms <= horizon && !x.keys.is_empty());
    for x in &mut r.records {
        x.keys.truncate(MAX_RECORD_KEYS);
    }
    for v in r.engines.values_mut() {
        for (i, x) in v.iter_mut().enumerate() {
            let cap = if matches!(i, 0 | 1 | 3) {
                u64::from(MAX_REQUESTS)
            } else {
                MAX_TOKENS
            };
            *x = (*x).min(cap);
        }
    }
    Some(r)
}

/// Sums the fresh reports per engine.
pub fn sum<'a>(reports: impl IntoIterator<Item = &'a Report>) -> HashMap<String, LoadSnapshot> {
    let mut out: HashMap<String, LoadSnapshot> = HashMap::new();
    for r in reports {
        for (engine, v) in &r.engines {
            let n = |x: u64| u32::try_from(x).unwrap_or(u32::MAX);
            let row = LoadSnapshot {
                requests: n(v[0]),
                prefilling: n(v[1]),
                prefill_tokens: v[2],
                decoding: n(v[3]),
                context_tokens: v[4],
            };
            let s = out.entry(engine.clone()).or_default();
            *s = s.plus(row);
        }
    }
    out
}

/// A peer's prefilled counts as last reported, to turn its reports into
/// increases: a peer that starts reporting, comes back after going stale,
/// or is found later adds only what it prefills from then on, never its
/// whole history.
#[derive(Debug, Default)]
pub struct PrefilledSeen {
    /// The peer process the counts are from ([`Report::replica`]).
    replica: String,
    /// Per engine.
    counts: HashMap<String, u64>,
}

impl PrefilledSeen {
    /// Takes in `r`'s counts; the increases per engine since the last. The
    /// first report of a replica (always complete: asked without a
    /// version) sets where it starts; an engine new in a later report
    /// starts from zero; a count that went down starts again there.
    pub fn update<'a>(&mut self, r: &'a Report) -> Vec<(&'a str, u64)> {
        let Some(now) = &r.prefilled else {
            return Vec::new();
        };
        let first = self.replica != r.replica;
        if first {
            self.replica.clone_from(&r.replica);
            self.counts.clear();
        }
        let mut out = Vec::new();
        for (engine, &count) in now {
            let last = self.counts.insert(engine.clone(), count);
            let from = match last {
                Some(l) if l <= count => l,
                Some(_) => count,
                None if first => count,
                None => 0,
            };
            if count > from {
                out.push((engine.as_str(), count - from));
            }
        }
        out
    }
}

/// What the poller knows, for `/debug/endpoints`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PeerState {
    /// Per peer address: age of its last good report (ms), or the last
    /// error.
    pub peers: Vec<PeerStatus>,
}

/// One peer.
#[derive(Clone, Debug, Serialize)]
pub struct PeerStatus {
    /// Its admin address.
    pub address: String,
    /// Milliseconds since its last good report.
    pub report_age_ms: Option<u64>,
    /// Why the last poll failed.
    pub error: Option<String>,
}

struct Known {
    report: Option<(Report, Instant)>,
    error: Option<String>,
    prefilled: PrefilledSeen,
}

/// Starts polling the peers, and (unless turned off) the bootstrap of the
/// KV index from one of them ([`crate::snapshot::bootstrap`]).
pub fn spawn(shared: Arc<Shared>, settings: Settings, kube: Option<kube::Client>) {
    let addresses = Arc::new(PeerList::default());
    if let Source::Fixed(v) = &settings.source {
        addresses.set(v.clone());
    }
    let alone = matches!(&settings.source, Source::Fixed(v) if v.is_empty());
    if !alone {
        SHARING.store(true, Ordering::Relaxed);
    }
    if !settings.bootstrap_timeout.is_zero() && !alone {
        // Before anything subscribes: every stream gets its part.
        let until = Instant::now() + settings.bootstrap_timeout;
        shared.kv.await_seed(until);
        tokio::spawn(crate::snapshot::bootstrap(
            shared.clone(),
            settings.clone(),
            addresses.clone(),
            until,
        ));
    }
    if let (
        Source::Service {
            namespace,
            name,
            admin_port,
        },
        Some(client),
    ) = (&settings.source, kube)
    {
        tokio::spawn(discover(
            client,
            namespace.clone(),
            name.clone(),
            *admin_port,
            addresses.clone(),
            shared.runtime.stop.clone(),
        ));
    }
    tokio::spawn(poll(shared, settings, addresses));
}

/// Keeps `into` at the ready addresses of the Service's slices.
async fn discover(
    client: kube::Client,
    namespace: String,
    service: String,
    admin_port: u16,
    into: Arc<PeerList>,
    stop: tokio_util::sync::CancellationToken,
) {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let api: kube::Api<EndpointSlice> = kube::Api::namespaced(client, &namespace);
    let lp =
        kube::api::ListParams::default().labels(&format!("kubernetes.io/service-name={service}"));
    let own_ip = std::env::var("POD_IP").ok();
    loop {
        match api.list(&lp).await {
            Ok(list) => {
                let mut found: Vec<String> = list
                    .items
                    .iter()
                    .flat_map(|s| s.endpoints.iter())
                    .filter(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true))
                    .flat_map(|e| e.addresses.iter())
                    .filter(|a| own_ip.as_deref() != Some(a.as_str()))
                    .map(|a| {
                        if a.contains(':') {
                            format!("[{a}]:{admin_port}")
                        } else {
                            format!("{a}:{admin_port}")
                        }
                    })
                    .collect();
                found.sort();
                found.dedup();
                into.set(found);
            }
            Err(e) => {
                tracing::warn!(error = %e, %service, "listing the router's own EndpointSlices for its peers");
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
    }
}

/// Why a poll got no report.
struct PollError {
    why: String,
    /// No connection could be made (refused, unreachable): nothing serves
    /// there, so nothing routed through it is in flight any more (the
    /// engines cancel what a dead replica sent when its connections close).
    gone: bool,
}

impl PollError {
    fn other(why: impl Into<String>) -> Self {
        Self {
            why: why.into(),
            gone: false,
        }
    }
}

/// One report and its load version (`None`: the peer does not long-poll).
type Answer = (Report, Option<u64>);

async fn fetch(
    client: &crate::probe::ProbeClient,
    address: &str,
    token: Option<&HeaderValue>,
    wait: Option<(u64, Duration)>,
    timeout: Duration,
    traffic: &Traffic,
) -> Result<Answer, PollError> {
    let pq = match wait {
        Some((after, w)) => format!("{LOAD_PATH}?after={after}&wait_ms={}", w.as_millis()),
        None => LOAD_PATH.to_owned(),
    };
    let mut req = http::Request::get(format!("http://{address}{pq}"));
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, t.clone());
    }
    let req = req
        .body(Empty::<Bytes>::new())
        .map_err(|e| PollError::other(e.to_string()))?;
    let sent = request_bytes(&pq, address, req.headers());
    let call = async {
        let resp = client.request(req).await.map_err(|e| PollError {
            gone: e.is_connect(),
            why: crate::probe::error_chain(&e),
        })?;
        traffic.load_sent.fetch_add(sent, Ordering::Relaxed);
        let (status, headers) = (resp.status(), resp.headers().clone());
        let body = http_body_util::Limited::new(resp.into_body(), MAX_REPORT_BYTES)
            .collect()
            .await
            .map_err(|e| PollError::other(e.to_string()))?
            .to_bytes();
        traffic.load_received.fetch_add(
            response_bytes(status, &headers, body.len(), false),
            Ordering::Relaxed,
        );
        if !status.is_success() {
            return Err(PollError::other(format!("answered {status}")));
        }
        let version = headers
            .get(VERSION_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let report = parse(&body).ok_or_else(|| PollError::other("not a load report"))?;
        Ok((report, version))
    };
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or_else(|_| Err(PollError::other(format!("no answer within {timeout:?}"))))
}

type KnownMap = Arc<parking_lot::Mutex<HashMap<String, Known>>>;

/// Keeps one asking task per listed peer and expires stale reports.
async fn poll(shared: Arc<Shared>, settings: Settings, addresses: Arc<PeerList>) {
    let known: KnownMap = Arc::default();
    let mut tasks: HashMap<String, tokio::task::JoinHandle<()>> = HashMap::new();
    let mut tick = tokio::time::interval(settings.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shared.runtime.stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let list = addresses.get();
        tasks.retain(|a, task| {
            let keep = list.contains(a) && !task.is_finished();
            if !keep {
                task.abort();
            }
            keep
        });
        known.lock().retain(|a, _| list.contains(a));
        for a in list {
            if let std::collections::hash_map::Entry::Vacant(slot) = tasks.entry(a) {
                let task = tokio::spawn(ask(
                    shared.clone(),
                    settings.clone(),
                    slot.key().clone(),
                    known.clone(),
                ));
                slot.insert(task);
            }
        }
        publish(&shared, &known.lock(), settings.staleness);
    }
    for task in tasks.values() {
        task.abort();
    }
}

/// Asks one peer for its load, again and again: a long poll while the peer
/// answers with versions, else one poll per interval.
async fn ask(shared: Arc<Shared>, settings: Settings, address: String, known: KnownMap) {
    let client = shared.runtime.probes.clone();
    let traffic = &shared.runtime.peer_traffic;
    let wait = (settings.staleness / 2).min(MAX_WAIT);
    // The first ask finds out whether the peer long-polls (version 0 is
    // never current: it answers at once).
    let mut after = Some(0);
    loop {
        let started = Instant::now();
        let long = after.map(|v| (v, wait));
        let timeout = long.map_or(Duration::ZERO, |(_, w)| w) + settings.interval;
        let result = fetch(
            &client,
            &address,
            settings.token.as_ref(),
            long,
            timeout,
            traffic,
        )
        .await;
        let ok = result.is_ok();
        {
            let mut map = known.lock();
            let k = map.entry(address.clone()).or_insert(Known {
                report: None,
                error: None,
                prefilled: PrefilledSeen::default(),
            });
            match result {
                Ok((r, _)) if r.replica == shared.runtime.replica => {
                    k.report = None;
                    k.error = Some("this replica itself".into());
                    after = None;
                }
                Ok((mut r, version)) => {
                    apply(&shared, &std::mem::take(&mut r.records));
                    add_prefilled(&shared, &k.prefilled.update(&r));
                    k.report = Some((r, Instant::now()));
                    k.error = None;
                    after = version;
                }
                // A peer that cannot be reached at all holds nothing: its
                // load leaves at once instead of after the staleness bound.
                // A slow or garbled answer keeps the last report until it
                // is stale (the peer may still be serving).
                Err(e) => {
                    if e.gone {
                        k.report = None;
                    }
                    k.error = Some(e.why);
                    after = Some(0);
                }
            }
            publish(&shared, &map, settings.staleness);
        }
        let gap = if ok && after.is_some() {
            MIN_GAP
        } else {
            settings.interval
        };
        let pause = gap.saturating_sub(started.elapsed());
        tokio::select! {
            () = shared.runtime.stop.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
    }
}

/// Counts a peer's prefill increases on the endpoints they name.
fn add_prefilled(shared: &Shared, increases: &[(&str, u64)]) {
    if increases.is_empty() {
        return;
    }
    let view = shared.view();
    for ws in &view.worker_sets {
        for e in &ws.endpoints {
            if let Some((_, n)) = increases.iter().find(|(a, _)| *a == e.authority) {
                e.load.peers.add_prefilled(*n);
            }
        }
    }
}

/// Sets every endpoint's peer load to the sum of the fresh reports, and the
/// peers' status for `/debug/endpoints`.
fn publish(shared: &Shared, known: &HashMap<String, Known>, staleness: Duration) {
    let now = Instant::now();
    let fresh: Vec<&Report> = known
        .values()
        .filter_map(|k| {
            k.report
                .as_ref()
                .filter(|(_, at)| now.saturating_duration_since(*at) <= staleness)
                .map(|(r, _)| r)
        })
        .collect();
    let sums = sum(fresh.iter().copied());
    let prefilled_known = fresh.iter().all(|r| r.prefilled.is_some());
    let view = shared.view();
    for ws in &view.worker_sets {
        for e in &ws.endpoints {
            e.load.peers.set(sums.get(&e.authority).copied());
            e.load.peers.prefilled_known(prefilled_known);
        }
    }
    *shared.runtime.peer_state.write() = PeerState {
        peers: known
            .iter()
            .map(|(a, k)| PeerStatus {
                address: a.clone(),
                report_age_ms: k.report.as_ref().map(|(_, at)| {
                    u64::try_from(now.saturating_duration_since(*at).as_millis())
                        .unwrap_or(u64::MAX)
                }),
                error: k.error.clone(),
            })
            .collect(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn reports_are_bounded_and_garbage_is_nothing() {
        assert_eq!(parse(b"not json"), None);
        assert_eq!(parse(br#"{"replica": 3}"#), None);
        let r = parse(br#"{"replica":"a","engines":{"10.0.0.1:8000":[1,1,500,0,900]}}"#).unwrap();
        assert_eq!(r.engines["10.0.0.1:8000"], [1, 1, 500, 0, 900]);
        let lying = parse(
            br#"{"replica":"b","engines":{"e":[18446744073709551615,5,18446744073709551615,0,0]}}"#,
        )
        .unwrap();
        assert_eq!(lying.engines["e"][0], u64::from(MAX_REQUESTS));
        assert_eq!(lying.engines["e"][2], MAX_TOKENS);
        let s = sum([&r, &lying, &r]);
        assert_eq!(s["10.0.0.1:8000"].requests, 2);
        assert_eq!(s["10.0.0.1:8000"].prefill_tokens, 1000);
        assert_eq!(s["e"].requests, MAX_REQUESTS);
    }

    #[test]
    fn a_peers_prefilled_counts_become_increases_from_its_first_report() {
        let report = |replica: &str, body: &str| {
            parse(format!(r#"{{"replica":"{replica}","engines":{{}},{body}}}"#).as_bytes()).unwrap()
        };
        let mut seen = PrefilledSeen::default();
        // Its first report: where it starts, whatever it did before.
        let r = report("a", r#""prefilled":{"e:1":700,"f:1":5}"#);
        assert_eq!(seen.update(&r), vec![]);
        // Only moved engines are sent: e grew, g is new (from zero).
        let r = report("a", r#""prefilled":{"e:1":900,"g:1":40}"#);
        let mut up = seen.update(&r);
        up.sort_unstable();
        assert_eq!(up, vec![("e:1", 200), ("g:1", 40)]);
        // Sent twice (the version boundary): nothing more.
        assert_eq!(seen.update(&r), vec![]);
        // Restarted under the same address: a new replica starts again.
        let r = report("b", r#""prefilled":{"e:1":50}"#);
        assert_eq!(seen.update(&r), vec![]);
        let r = report("b", r#""prefilled":{"e:1":80}"#);
        assert_eq!(seen.update(&r), vec![("e:1", 30)]);
        // A count that went down starts again there.
        let r = report("b", r#""prefilled":{"e:1":10}"#);
        assert_eq!(seen.update(&r), vec![]);
        let r = report("b", r#""prefilled":{"e:1":15}"#);
        assert_eq!(seen.update(&r), vec![("e:1", 5)]);
        // An older replica says nothing.
        let r = report("c", r#""records":[]"#);
        assert_eq!(seen.update(&r), vec![]);
    }

    #[test]
    fn records_carry_every_strides_last_key_and_are_bounded() {
        let keys: Vec<u64> = (1..=20).collect();
        assert_eq!(checkpoints(&keys).collect::<Vec<_>>(), vec![8, 16]);
        assert_eq!(checkpoints(&keys[..7]).count(), 0);
        let long: Vec<u64> = (0..(MAX_RECORD_KEYS * RECORD_STRIDE * 2) as u64).collect();
        assert_eq!(checkpoints(&long).count(), MAX_RECORD_KEYS);

        // A peer's records: too old, empty or too many are dropped, too
        // long are cut; an older peer's report (no records) still parses.
        let horizon = RECORD_HORIZON.as_millis();
        let body = serde_json::json!({
            "replica": "a",
            "engines": {},
            "records": [
                {"engine": "e:1", "age_ms": 5, "keys": [1, 2]},
                {"engine": "e:1", "age_ms": horizon + 1, "keys": [3]},
                {"engine": "e:2", "age_ms": 0, "keys": []},
                {"engine": "e:2", "age_ms": 0, "keys": vec![7u64; MAX_RECORD_KEYS + 5]},
            ],
        });
        let r = parse(&serde_json::to_vec(&body).unwrap()).unwrap();
        assert_eq!(r.records.len(), 2);
        assert_eq!(r.records[0].keys, vec![1, 2]);
        assert_eq!(r.records[1].keys.len(), MAX_RECORD_KEYS);
        let many: Vec<Value> = (0..MAX_RECORDS + 10)
            .map(|_| serde_json::json!({"engine": "e", "age_ms": 0, "keys": [1]}))
            .collect();
        let body = serde_json::json!({"replica": "a", "engines": {}, "records": many});
        assert_eq!(
            parse(&serde_json::to_vec(&body).unwrap())
                .unwrap()
                .records
                .len(),
            MAX_RECORDS
        );
        assert!(
            parse(br#"{"replica":"a","engines":{}}"#)
                .unwrap()
                .records
                .is_empty()
        );
        assert_eq!(
            parse(br#"{"replica":"a","engines":{},"records":[{"engine":1}]}"#),
            None
        );
    }

    #[test]
    fn sent_records_go_to_each_peer_once_by_version() {
        SHARING.store(true, Ordering::Relaxed);
        let sent = SentRecords::default();
        let before = version();
        let keys: Vec<u64> = (1..=16).collect();
        sent.push("e:1", &keys);
        sent.push("e:2", &keys[..4]); // shorter than a stride: nothing to send
        let mid = version();
        sent.push("e:3", &keys);
        let mut out = Vec::new();
        sent.since(Some(before), &mut out);
        let engines: Vec<&str> = out.iter().map(|r| r.engine.as_str()).collect();
        assert_eq!(engines, ["e:1", "e:3"]);
        assert_eq!(out[0].keys, vec![8, 16]);
        out.clear();
        sent.since(Some(mid), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].engine, "e:3");
        // A first ask (no version) gets everything kept.
        out.clear();
        sent.since(None, &mut out);
        assert_eq!(out.len(), 2);
    }

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
