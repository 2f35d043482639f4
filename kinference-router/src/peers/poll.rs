//! Finding the peers (the Service's EndpointSlices or a fixed list) and
//! asking each for its load, as a long poll where it answers with versions;
//! what the fresh reports add up to on each endpoint.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http_body_util::{BodyExt as _, Empty};
use parking_lot::RwLock;
use serde::Serialize;
use tokio::time::Instant;

use crate::endpoint::clock_micros;
use crate::state::Shared;

use super::report::{adopt_steps, apply};
use super::{
    LOAD_PATH, MAX_REPORT_BYTES, MAX_REQUESTS, MAX_WAIT, MIN_GAP, Report, SHARING, Traffic,
    VERSION_HEADER, parse, request_bytes, response_bytes, sum,
};

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

/// A peer's cumulative counts as last reported, to turn its reports into
/// increases: a peer that starts reporting, comes back after going stale,
/// or is found later adds only what it prefills and sends from then on,
/// never its whole history. Likewise its dated first tokens, each taken
/// once (a report may repeat the last one of the report before).
#[derive(Debug, Default)]
pub struct CountsSeen {
    /// The peer process the counts are from ([`Report::replica`]).
    replica: String,
    /// Per engine, prefilled tokens ([`Report::prefilled`]).
    counts: HashMap<String, u64>,
    /// Per engine, the count after the latest first token taken.
    dated: HashMap<String, u64>,
    /// Per engine, requests sent ([`Report::sent`]).
    sent: HashMap<String, u64>,
}

/// What a report adds to the peers' prefill and arrivals.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Increases<'a> {
    /// Per engine, the prefilled count's increase.
    pub counts: Vec<(&'a str, u64)>,
    /// Per engine, first tokens new to this replica: `(age in
    /// microseconds, tokens prefilled)`.
    pub dated: Vec<(&'a str, u64, u64)>,
    /// Per engine, requests sent since the last report, at most
    /// [`MAX_REQUESTS`]: the peer's arrivals there.
    pub sent: Vec<(&'a str, u64)>,
}

impl Increases<'_> {
    fn is_empty(&self) -> bool {
        self.counts.is_empty() && self.dated.is_empty() && self.sent.is_empty()
    }
}

impl CountsSeen {
    /// Takes in `r`'s counts and dated first tokens; the increases since
    /// the last. The first report of a replica (always complete: asked
    /// without a version) sets where it starts; an engine new in a later
    /// report starts from zero; a count that went down starts again there.
    pub fn update<'a>(&mut self, r: &'a Report) -> Increases<'a> {
        let first = self.replica != r.replica;
        if first {
            self.replica.clone_from(&r.replica);
            self.counts.clear();
            self.dated.clear();
            self.sent.clear();
        }
        let mut out = Increases::default();
        for (engine, &count) in r.sent.iter().flatten() {
            let from = counted_from(self.sent.insert(engine.clone(), count), count, first);
            if count > from {
                let n = (count - from).min(u64::from(MAX_REQUESTS));
                out.sent.push((engine.as_str(), n));
            }
        }
        let Some(now) = &r.prefilled else {
            return out;
        };
        for (engine, &count) in now {
            let last = self.counts.insert(engine.clone(), count);
            let from = counted_from(last, count, first);
            match last {
                // Started again: so did its first tokens.
                Some(l) if l > count => {
                    self.dated.insert(engine.clone(), 0);
                }
                None if first => {
                    self.dated.insert(engine.clone(), count);
                }
                _ => {}
            }
            if count > from {
                out.counts.push((engine.as_str(), count - from));
            }
        }
        for (engine, times) in r.first_tokens.iter().flatten() {
            let mut sorted: Vec<[u64; 2]> = times.clone();
            sorted.sort_unstable_by_key(|&[_, cum]| cum);
            let taken = self.dated.entry(engine.clone()).or_insert(0);
            if first {
                *taken = (*taken).max(sorted.last().map_or(0, |&[_, cum]| cum));
                continue;
            }
            for [age, cum] in sorted {
                if cum > *taken {
                    out.dated.push((engine.as_str(), age, cum - *taken));
                    *taken = cum;
                }
            }
        }
        out
    }
}

/// Where a peer's cumulative count on one engine is counted from, given
/// the `last` one seen: there, if it did not go down; the count itself
/// (nothing new) if it went down (the peer started again) or if this is
/// the peer's `first` report (its history); zero for an engine new in a
/// later one.
fn counted_from(last: Option<u64>, count: u64, first: bool) -> u64 {
    match last {
        Some(l) if l <= count => l,
        Some(_) => count,
        None if first => count,
        None => 0,
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
    counts: CountsSeen,
    /// Until when to keep trying, and the step costs of a report for
    /// worker sets this replica does not list yet.
    steps: Option<(Instant, HashMap<String, kinference_scoring::StepFit>)>,
}

/// How long a peer's step costs wait for the worker sets they name to be
/// listed here (the pool's first listing, at start).
const STEPS_HOLD: Duration = Duration::from_secs(30);

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
                counts: CountsSeen::default(),
                steps: None,
            });
            match result {
                Ok((r, _)) if r.replica == shared.runtime.replica => {
                    k.report = None;
                    k.error = Some("this replica itself".into());
                    after = None;
                }
                Ok((mut r, version)) => {
                    apply(&shared, &std::mem::take(&mut r.records));
                    if !r.steps.is_empty() {
                        k.steps = Some((Instant::now() + STEPS_HOLD, std::mem::take(&mut r.steps)));
                    }
                    if let Some((until, steps)) = &mut k.steps {
                        adopt_steps(&shared, steps, &address);
                        if steps.is_empty() || Instant::now() > *until {
                            k.steps = None;
                        }
                    }
                    let received = clock_micros(Instant::now());
                    add_increases(&shared, &k.counts.update(&r), received);
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

/// Counts a peer's prefill increases on the endpoints they name, dates
/// its first tokens there on this replica's clock (`received`: when the
/// report came), and counts its new requests there as arrivals now (a
/// report comes within a long poll's gap of them). An endpoint listed by
/// several worker sets counts once.
fn add_increases(shared: &Shared, inc: &Increases<'_>, received: i64) {
    if inc.is_empty() {
        return;
    }
    let now = shared.now();
    let view = shared.view();
    for (a, n) in &inc.counts {
        if let Some(e) = view.endpoint(a) {
            e.load.peers.add_prefilled(*n);
        }
    }
    for (a, age, n) in &inc.dated {
        if let Some(e) = view.endpoint(a) {
            let at = received.saturating_sub(i64::try_from(*age).unwrap_or(i64::MAX));
            e.load.peers.first_tokens.add(at, *n);
        }
    }
    for (a, n) in &inc.sent {
        if let Some(e) = view.endpoint(a) {
            e.load.peers.add_arrivals(now, *n);
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
    let times_known = fresh.iter().all(|r| r.first_tokens.is_some());
    let view = shared.view();
    for ws in &view.worker_sets {
        for e in &ws.endpoints {
            e.load.peers.set(sums.get(&e.authority).copied());
            e.load.peers.prefilled_known(prefilled_known);
            e.load.peers.times_known(times_known);
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

    /// A report of `replica` with `body`'s fields besides.
    fn report(replica: &str, body: &str) -> Report {
        parse(format!(r#"{{"replica":"{replica}","engines":{{}},{body}}}"#).as_bytes()).unwrap()
    }

    #[test]
    fn a_peers_prefilled_counts_become_increases_from_its_first_report() {
        let mut seen = CountsSeen::default();
        // Its first report: where it starts, whatever it did before.
        let r = report("a", r#""prefilled":{"e:1":700,"f:1":5}"#);
        assert_eq!(seen.update(&r).counts, vec![]);
        // Only moved engines are sent: e grew, g is new (from zero).
        let r = report("a", r#""prefilled":{"e:1":900,"g:1":40}"#);
        let mut up = seen.update(&r).counts;
        up.sort_unstable();
        assert_eq!(up, vec![("e:1", 200), ("g:1", 40)]);
        // Sent twice (the version boundary): nothing more.
        assert_eq!(seen.update(&r).counts, vec![]);
        // Restarted under the same address: a new replica starts again.
        let r = report("b", r#""prefilled":{"e:1":50}"#);
        assert_eq!(seen.update(&r).counts, vec![]);
        let r = report("b", r#""prefilled":{"e:1":80}"#);
        assert_eq!(seen.update(&r).counts, vec![("e:1", 30)]);
        // A count that went down starts again there.
        let r = report("b", r#""prefilled":{"e:1":10}"#);
        assert_eq!(seen.update(&r).counts, vec![]);
        let r = report("b", r#""prefilled":{"e:1":15}"#);
        assert_eq!(seen.update(&r).counts, vec![("e:1", 5)]);
        // An older replica says nothing.
        let r = report("c", r#""records":[]"#);
        assert_eq!(seen.update(&r).counts, vec![]);
    }

    #[test]
    fn a_peers_sent_counts_become_arrivals_from_its_first_report() {
        let mut seen = CountsSeen::default();
        // Its first report (complete): its history, not arrivals now.
        let r = report("a", r#""sent":{"e:1":700,"f:1":5}"#);
        assert_eq!(seen.update(&r).sent, vec![]);
        // e sent three more; f idle and left out; g new since (from zero).
        let r = report("a", r#""sent":{"e:1":703,"g:1":2}"#);
        let mut up = seen.update(&r).sent;
        up.sort_unstable();
        assert_eq!(up, vec![("e:1", 3), ("g:1", 2)]);
        // f's requests while it was left out count when it is back.
        let r = report("a", r#""sent":{"f:1":9}"#);
        assert_eq!(seen.update(&r).sent, vec![("f:1", 4)]);
        assert_eq!(seen.update(&r).sent, vec![]);
        // A restart (a new replica) starts again; so does a count that
        // went down.
        let r = report("b", r#""sent":{"e:1":50}"#);
        assert_eq!(seen.update(&r).sent, vec![]);
        let r = report("b", r#""sent":{"e:1":10}"#);
        assert_eq!(seen.update(&r).sent, vec![]);
        let r = report("b", r#""sent":{"e:1":11}"#);
        assert_eq!(seen.update(&r).sent, vec![("e:1", 1)]);
        // A lying peer's jump is capped; an older replica says nothing.
        let r = report("b", r#""sent":{"e:1":99999999999}"#);
        assert_eq!(seen.update(&r).sent, vec![("e:1", u64::from(MAX_REQUESTS))]);
        let r = report("c", r#""records":[]"#);
        assert_eq!(seen.update(&r).sent, vec![]);
    }

    #[test]
    fn a_peers_dated_first_tokens_are_taken_once_from_its_first_report_on() {
        let mut seen = CountsSeen::default();
        // Its first report: history, not dated here.
        let r = report(
            "a",
            r#""prefilled":{"e:1":700},"first_tokens":{"e:1":[[9000,500],[4000,700]]}"#,
        );
        assert_eq!(seen.update(&r), Increases::default());
        // Two new first tokens, listed out of order, and the last one of
        // the report before again (the version boundary).
        let r = report(
            "a",
            r#""prefilled":{"e:1":1000},"first_tokens":{"e:1":[[300,1000],[4500,700],[900,850]]}"#,
        );
        let up = seen.update(&r);
        assert_eq!(up.counts, vec![("e:1", 300)]);
        assert_eq!(up.dated, vec![("e:1", 900, 150), ("e:1", 300, 150)]);
        assert_eq!(seen.update(&r).dated, vec![]);
        // An engine first heard of after the first report starts at zero.
        let r = report(
            "a",
            r#""prefilled":{"g:1":40},"first_tokens":{"g:1":[[100,40]]}"#,
        );
        assert_eq!(seen.update(&r).dated, vec![("g:1", 100, 40)]);
        // Ages past an hour are taken as an hour.
        let r = report(
            "a",
            r#""prefilled":{"g:1":50},"first_tokens":{"g:1":[[99999999999999,50]]}"#,
        );
        assert_eq!(seen.update(&r).dated, vec![("g:1", 3_600_000_000, 10)]);
    }
}
