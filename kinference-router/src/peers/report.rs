//! What a replica tells its peers: its load report (per-engine counts,
//! the prefilled tokens that moved, the prefixes it sent), bounded when
//! read back, and summed over the fresh reports.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kinference_scoring::Pick as _;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::endpoint::{LoadSnapshot, MAX_REPORTED_FIRST_TOKENS};
use crate::state::Shared;

use super::{
    MAX_RECORD_KEYS, MAX_RECORDS, MAX_REQUESTS, MAX_TOKENS, RECORD_HORIZON, RECORD_STRIDE, SHARING,
};

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
    /// peers' next report: the one the request's own start
    /// ([`crate::endpoint::Endpoint::begin`], right after) wakes their
    /// long polls for.
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
            // Marked inside the lock with the version the next load change
            // makes, not a change of its own: the request's start makes it
            // at once, and the record rides the report that carries the
            // new load instead of waking the peers for one more (each
            // wake is a report per peer). A report that collects the
            // records after this went to an asker below the mark (its
            // version was read before, so before the mark was taken): none
            // is lost; one collected as the version moves may go twice.
            sent.push_back(Sent {
                version: super::version() + 1,
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

/// One replica's load report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
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
    /// ([`crate::endpoint`], [`super::CountsSeen`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefilled: Option<HashMap<String, u64>>,
    /// Per engine: the recent first tokens behind `prefilled` marked at or
    /// after the asker's version, each `[age in microseconds, the count
    /// after it]`, so that the asker dates them on its own clock however
    /// late the report comes ([`crate::endpoint::StepWindow`]). Absent from
    /// older replicas' reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_tokens: Option<HashMap<String, Vec<[u64; 2]>>>,
    /// Per worker set (by name): the engines' step costs this replica has
    /// learnt from its streams, once in use ([`kinference_scoring::StepFit`]);
    /// only in the first answer to an asker (no version, or 0) and in the
    /// answers after they came into use until the load next changes (one
    /// or two, or one per long poll's wait on an idle fleet), so that a
    /// replica that starts, or one still learning beside it, predicts with
    /// them at once ([`adopt_steps`]). Absent from older replicas' reports.
    #[serde(default, skip_serializing_if = "HashMap::is_empty")]
    pub steps: HashMap<String, kinference_scoring::StepFit>,
    /// Per engine: the requests this replica sent there, cumulative; in
    /// the first answer to an asker (no version, or 0) for every engine it
    /// ever sent to, after that for those whose count moved at or after
    /// the asker's version (as `prefilled`). The asker counts the
    /// increases as the peer's arrivals there
    /// ([`kinference_scoring::Candidate::peer_arrival_rate`],
    /// [`super::CountsSeen`]). Absent from older replicas' reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent: Option<HashMap<String, u64>>,
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
    let mut first_tokens = HashMap::new();
    let mut sent = HashMap::new();
    let now = crate::endpoint::clock_micros(Instant::now());
    for ws in &view.worker_sets {
        ws.runtime.sent.since(after, &mut records);
        for e in &ws.endpoints {
            // The times first: a first token that comes between the two
            // reads is counted now and dated in the next report.
            let times = e.load.first_tokens.since(after, now);
            let moved = e.load.prefilled_version.load(Ordering::SeqCst);
            let p = e.load.prefilled.load(Ordering::SeqCst);
            if p > 0 && after.is_none_or(|a| moved >= a) {
                prefilled.insert(e.authority.clone(), p);
            }
            if !times.is_empty() {
                first_tokens.insert(e.authority.clone(), times);
            }
            let l = e.load.own();
            let sent_moved = e.load.sent_version.load(Ordering::SeqCst);
            let count = e.load.sent.load(Ordering::SeqCst);
            if count > 0 && after.is_none_or(|a| a == 0 || sent_moved >= a) {
                sent.insert(e.authority.clone(), count);
            }
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
    // What the streams taught, for an asker that starts, and once more to
    // every asker when it is first in use: a few hundred bytes per worker
    // set.
    let mut steps = HashMap::new();
    for ws in &view.worker_sets {
        let marked = ws.runtime.steps_version.load(Ordering::SeqCst);
        if after.is_none_or(|a| a == 0 || (marked > 0 && marked >= a))
            && let Some(fit) = ws.runtime.policy.lock().step_fit()
        {
            steps.insert(ws.route.name.clone(), fit);
        }
    }
    Report {
        replica: shared.runtime.replica.clone(),
        engines,
        records,
        prefilled: Some(prefilled),
        first_tokens: Some(first_tokens),
        steps,
        sent: Some(sent),
    }
}

/// Starts the worker sets a peer's report names from the step costs it
/// learnt ([`Report::steps`]), where their own are not in use yet. Takes
/// out of `steps` the worker sets this replica lists (taken or not), and
/// leaves the others for a later try (the pool may not be listed yet).
pub(super) fn adopt_steps(
    shared: &Shared,
    steps: &mut HashMap<String, kinference_scoring::StepFit>,
    peer: &str,
) {
    let view = shared.view();
    for ws in &view.worker_sets {
        let Some(fit) = steps.remove(&ws.route.name) else {
            continue;
        };
        if ws.runtime.policy.lock().adopt_steps(&fit) {
            // Passed on to the other peers, which may still be learning.
            ws.runtime
                .steps_version
                .fetch_max(super::version() + 1, Ordering::SeqCst);
            let c = fit.costs(&ws.runtime.params);
            tracing::info!(
                %peer, worker_set = %ws.route.name,
                overhead_ms = c.overhead_ms, decode_ms = c.decode_ms,
                prefill_ms_per_token = c.prefill_ms_per_token, samples = c.samples,
                "starting from a peer's learnt step costs"
            );
        }
    }
}

/// Puts a peer's records in the prefix records of the worker sets whose
/// endpoints they name, dated by their age.
pub(super) fn apply(shared: &Shared, records: &[PeerRecord]) {
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

/// The most worker sets whose step costs a report may carry; a report
/// with more carries none.
const MAX_WORKER_SETS: usize = 256;

/// The oldest a reported first token is taken to be (an hour).
const MAX_FIRST_TOKEN_AGE_MICROS: u64 = 3_600_000_000;

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
    if r.steps.len() > MAX_WORKER_SETS {
        r.steps.clear();
    }
    if let Some(times) = &mut r.first_tokens {
        for v in times.values_mut() {
            v.truncate(MAX_REPORTED_FIRST_TOKENS);
            for [age, _] in v.iter_mut() {
                *age = (*age).min(MAX_FIRST_TOKEN_AGE_MICROS);
            }
        }
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

#[cfg(test)]
mod tests {
    use super::super::version;
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
        // Step costs ride a report whole; too many worker sets, none.
        let fit = kinference_scoring::StepFit::new(&kinference_scoring::LatencyParams::default());
        let with = |n: usize| {
            let steps: HashMap<String, _> = (0..n).map(|i| (format!("ws{i}"), fit)).collect();
            serde_json::to_vec(&serde_json::json!({"replica": "c", "engines": {}, "steps": steps}))
                .unwrap()
        };
        assert_eq!(parse(&with(2)).unwrap().steps["ws1"], fit);
        assert!(parse(&with(MAX_WORKER_SETS + 1)).unwrap().steps.is_empty());
        assert!(r.steps.is_empty(), "absent from an older replica's report");
        let s = sum([&r, &lying, &r]);
        assert_eq!(s["10.0.0.1:8000"].requests, 2);
        assert_eq!(s["10.0.0.1:8000"].prefill_tokens, 1000);
        assert_eq!(s["e"].requests, MAX_REQUESTS);
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
        // Each pushed as its request starts (which moves the version).
        sent.push("e:1", &keys);
        crate::peers::load_changed();
        sent.push("e:2", &keys[..4]); // shorter than a stride: nothing to send
        let mid = version();
        sent.push("e:3", &keys);
        crate::peers::load_changed();
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
}
