//! What a replica tells its peers: its load report (per-engine counts,
//! the prefilled tokens that moved, the prefixes it sent), bounded when
//! read back, and summed over the fresh reports.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use kinference_scoring::Pick as _;

use crate::endpoint::{LoadSnapshot, MAX_REPORTED_FIRST_TOKENS};
use crate::state::Shared;

use super::{
    MAX_RECORD_KEYS, MAX_RECORDS, MAX_REQUESTS, MAX_TOKENS, RECORD_HORIZON, RECORD_STRIDE, SHARING,
    bump_version,
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

/// What this replica keeps for its peers' reports, stamped with the load
/// version made for it: the newest [`MAX_RECORDS`] within
/// [`RECORD_HORIZON`]. Written only while the replica has peers.
#[derive(Debug)]
pub struct Recent<T> {
    items: parking_lot::Mutex<std::collections::VecDeque<(u64, Instant, T)>>,
}

impl<T> Default for Recent<T> {
    fn default() -> Self {
        Self {
            items: parking_lot::Mutex::default(),
        }
    }
}

impl<T> Recent<T> {
    /// Keeps `item` for the peers, and wakes their long polls.
    pub fn push(&self, item: T) {
        if !SHARING.load(Ordering::Relaxed) {
            return;
        }
        let now = Instant::now();
        let mut items = self.items.lock();
        while items.len() >= MAX_RECORDS
            || items
                .front()
                .is_some_and(|(_, at, _)| now.saturating_duration_since(*at) > RECORD_HORIZON)
        {
            items.pop_front();
        }
        // Stamped inside the lock: a report reading the version and then
        // the items sees every item up to that version.
        items.push_back((bump_version(), now, item));
    }

    /// The items stamped after `after` (every one kept, with `None`) and
    /// up to `upto` (the version the report goes out with: a later one
    /// goes in the next report, not in both), younger than the horizon,
    /// with their age in milliseconds, mapped by `f` and appended to `out`
    /// up to [`MAX_RECORDS`].
    fn since<U>(&self, span: Span, out: &mut Vec<U>, f: impl Fn(u64, &T) -> U) {
        let now = Instant::now();
        let items = self.items.lock();
        for (version, at, item) in items.iter() {
            let age = now.saturating_duration_since(*at);
            if span.after.is_some_and(|a| *version <= a)
                || *version > span.upto
                || age > RECORD_HORIZON
            {
                continue;
            }
            if out.len() >= MAX_RECORDS {
                break;
            }
            out.push(f(u64::try_from(age.as_millis()).unwrap_or(u64::MAX), item));
        }
    }
}

/// The versions a report's items come from: after the asker's, up to the
/// report's own.
#[derive(Clone, Copy, Debug)]
struct Span {
    after: Option<u64>,
    upto: u64,
}

/// The prefixes this replica sent (engine, checkpoint keys), for its
/// peers' reports.
#[derive(Debug, Default)]
pub struct SentRecords(Recent<(String, Vec<u64>)>);

impl SentRecords {
    /// Keeps `keys` (a prompt's block keys, sent to `engine`) for the
    /// peers, and wakes their long polls.
    pub fn push(&self, engine: &str, keys: &[u64]) {
        if !SHARING.load(Ordering::Relaxed) || keys.len() < RECORD_STRIDE {
            return;
        }
        self.0
            .push((engine.to_owned(), checkpoints(keys).collect()));
    }

    fn since(&self, span: Span, out: &mut Vec<PeerRecord>) {
        self.0
            .since(span, out, |age_ms, (engine, keys)| PeerRecord {
                engine: engine.clone(),
                age_ms,
                keys: keys.clone(),
            });
    }
}

/// What this replica saw of an engine's speed, for its peers' reports.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Seen {
    /// A first token: `[load_ms, queue_ms]` of the prediction it was sent
    /// with ([`kinference_scoring::Prediction`]), and the observed time to
    /// first token, milliseconds.
    FirstToken([f64; 3]),
    /// A finished stream's engine steps.
    Steps(kinference_scoring::StepSample),
}

/// The engines' speed this replica observed (engine, what), for its
/// peers' reports: each replica then calibrates on every replica's first
/// tokens and streams, not on its share of them.
#[derive(Debug, Default)]
pub struct SeenRecords(Recent<(String, Seen)>);

impl SeenRecords {
    /// Keeps what this replica saw of `engine` for the peers.
    pub fn push(&self, engine: &str, seen: Seen) {
        self.0.push((engine.to_owned(), seen));
    }

    fn since(&self, span: Span, out: &mut Vec<PeerSeen>) {
        self.0.since(span, out, |age_ms, (engine, seen)| PeerSeen {
            engine: engine.clone(),
            age_ms,
            seen: *seen,
        });
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
    /// ([`crate::endpoint`], [`super::PrefilledSeen`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefilled: Option<HashMap<String, u64>>,
    /// Per engine: the recent first tokens behind `prefilled` marked at or
    /// after the asker's version, each `[age in microseconds, the count
    /// after it]`, so that the asker dates them on its own clock however
    /// late the report comes ([`crate::endpoint::StepWindow`]). Absent from
    /// older replicas' reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_tokens: Option<HashMap<String, Vec<[u64; 2]>>>,
    /// What this replica saw of the engines' speed since the asker's
    /// version (absent from older replicas' reports; an entry this
    /// version cannot read, from a newer one, is skipped).
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "readable"
    )]
    pub seen: Vec<PeerSeen>,
}

/// The entries of a list that read as `T`, the others skipped.
fn readable<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::de::DeserializeOwned,
{
    let all = Vec::<serde_json::Value>::deserialize(d)?;
    Ok(all
        .into_iter()
        .filter_map(|v| serde_json::from_value(v).ok())
        .collect())
}

/// What a replica saw of an engine's speed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerSeen {
    /// The engine (`address:port`).
    pub engine: String,
    /// How long ago, in milliseconds.
    pub age_ms: u64,
    /// What.
    #[serde(flatten)]
    pub seen: Seen,
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

/// This replica's report, going out with version `upto`; its records and
/// what it saw of the engines are those stamped after `after` (all it
/// keeps, with `None`) and up to `upto`, each sent once; its prefilled
/// counts (and first tokens) those marked at or
/// after it. A count is marked with the version after the current one
/// before that version is made ([`crate::endpoint::Load::prefilled_version`]),
/// so the first answer whose version was read after the mark both sees
/// the new count and sends it; the boundary may go twice, never not at
/// all.
pub fn report(shared: &Shared, after: Option<u64>, upto: u64) -> Report {
    let span = Span { after, upto };
    let view = shared.view();
    let mut engines = HashMap::new();
    let mut records = Vec::new();
    let mut seen = Vec::new();
    let mut prefilled = HashMap::new();
    let mut first_tokens = HashMap::new();
    let now = crate::endpoint::clock_micros(Instant::now());
    for ws in &view.worker_sets {
        ws.runtime.sent.since(span, &mut records);
        ws.runtime.seen.since(span, &mut seen);
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
        first_tokens: Some(first_tokens),
        seen,
    }
}

impl Seen {
    /// Whether its figures are finite and not negative (and the time
    /// positive): anything else from a peer is dropped.
    fn is_sane(&self) -> bool {
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        match self {
            Self::FirstToken([load, queue, ttft]) => {
                ok(*load) && ok(*queue) && ok(*ttft) && *ttft > 0.0
            }
            Self::Steps(s) => {
                ok(s.millis) && ok(s.decoding) && ok(s.prefill_tokens) && s.millis > 0.0
            }
        }
    }
}

/// Teaches each worker set's policy what a peer saw of its engines'
/// speed, as if this replica had seen it `age_ms` ago.
pub(super) fn learn(shared: &Shared, seen: &[PeerSeen]) {
    if seen.is_empty() {
        return;
    }
    let view = shared.view();
    let now = shared.now();
    for ws in &view.worker_sets {
        let mut policy = None;
        for x in seen {
            let Some(e) = ws.endpoints.iter().find(|e| e.authority == x.engine) else {
                continue;
            };
            let p = policy.get_or_insert_with(|| ws.runtime.policy.lock());
            let id = kinference_scoring::EndpointId(e.id.0);
            match x.seen {
                Seen::FirstToken([load_ms, queue_ms, ttft_ms]) => {
                    let prediction = kinference_scoring::Prediction {
                        load_ms,
                        queue_ms,
                        ..kinference_scoring::Prediction::default()
                    };
                    let at = now.saturating_sub(Duration::from_millis(x.age_ms));
                    p.observe(id, &prediction, Duration::from_secs_f64(ttft_ms / 1e3), at);
                }
                Seen::Steps(sample) => {
                    p.observe_steps(id, &sample);
                }
            }
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
    r.seen.truncate(MAX_RECORDS);
    r.seen.retain(|x| x.age_ms <= horizon && x.seen.is_sane());
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
        let span = |after| Span {
            after,
            upto: version(),
        };
        let before = version();
        let keys: Vec<u64> = (1..=16).collect();
        sent.push("e:1", &keys);
        sent.push("e:2", &keys[..4]); // shorter than a stride: nothing to send
        let mid = version();
        // A report going out at `mid`: what comes after is for the next.
        let at_mid = span(Some(before));
        sent.push("e:3", &keys);
        let mut out = Vec::new();
        sent.since(at_mid, &mut out);
        let engines: Vec<&str> = out.iter().map(|r| r.engine.as_str()).collect();
        assert_eq!(engines, ["e:1"]);
        assert_eq!(out[0].keys, vec![8, 16]);
        out.clear();
        sent.since(span(Some(mid)), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].engine, "e:3");
        // A first ask (no version) gets everything kept.
        out.clear();
        sent.since(span(None), &mut out);
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn what_a_replica_saw_goes_out_once_and_garbage_is_dropped() {
        SHARING.store(true, Ordering::Relaxed);
        let seen = SeenRecords::default();
        let before = version();
        seen.push("e:1", Seen::FirstToken([120.0, 20.0, 300.0]));
        let sample = kinference_scoring::StepSample {
            tokens: 9,
            millis: 90.0,
            decoding: 2.0,
            prefill_tokens: 0.0,
        };
        seen.push("e:1", Seen::Steps(sample));
        let mut out = Vec::new();
        seen.since(
            Span {
                after: Some(before),
                upto: version(),
            },
            &mut out,
        );
        assert_eq!(out.len(), 2);
        assert_eq!(out[1].seen, Seen::Steps(sample));
        // On the wire, and back through a peer's parser.
        let r = Report {
            replica: "a".into(),
            seen: out,
            ..Report::default()
        };
        let wire = serde_json::to_string(&r).unwrap();
        assert!(
            wire.contains(r#""first_token":[120.0,20.0,300.0]"#),
            "{wire}"
        );
        assert_eq!(parse(wire.as_bytes()).unwrap().seen, r.seen);
        // Figures no engine could show are dropped, the rest kept.
        let r = parse(
            br#"{"replica":"a","engines":{},"seen":[
                {"engine":"e:1","age_ms":5,"first_token":[1.0,0.0,-3.0]},
                {"engine":"e:1","age_ms":5,"steps":{"tokens":4,"millis":0.0,"decoding":1.0,"prefill_tokens":0.0}},
                {"engine":"e:1","age_ms":99999999,"first_token":[1.0,0.0,3.0]},
                {"engine":"e:1","age_ms":5,"first_token":[1.0,0.0,3.0]}]}"#,
        )
        .unwrap();
        assert_eq!(r.seen.len(), 1, "{r:?}");
        // What a newer replica may see that this one cannot read is
        // skipped; the report stands.
        let r = parse(br#"{"replica":"a","engines":{"e:1":[1,0,0,1,10]},"seen":[{"engine":"e:1","age_ms":5,"what":1}]}"#).unwrap();
        assert!(r.seen.is_empty());
        assert_eq!(r.engines["e:1"][0], 1);
    }
}
