//! The decision core and the commit stage on real state (registry, view,
//! KV index, policies), without HTTP or a clock.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kinference_api::endpoints::ReadyEndpoint;
use kinference_api::v1alpha1::{ModelSpec, TokenizationMode};
use kinference_kvindex::{BlockHash, BlockStored, KvEvent};
use kinference_scoring::{LatencyParams, PolicyName, SplitMix64};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::*;
use crate::catalog::{Snapshot, WorkerSetRoute};
use crate::commit;
use crate::endpoint::{EndpointKey, Registry};
use crate::openai;
use crate::prepare::{Prepared, Route};
use crate::runtime::WsRuntime;
use crate::tokens::Source;
use crate::view::{Target, View};

const MODEL: &str = "m";
const BLOCK: u32 = 16;

struct Fixture {
    view: View,
    kv: KvPlane,
    registry: Registry,
    _stop: CancellationToken,
}

fn ws(name: &str, addrs: &[&str]) -> WorkerSetRoute {
    WorkerSetRoute {
        name: name.into(),
        kv_block_size: BLOCK,
        profile_name: "default".into(),
        profile: None,
        models: vec![ModelSpec {
            name: MODEL.into(),
            aliases: vec![],
        }],
        kv_events: true,
        endpoints: addrs
            .iter()
            .map(|a| ReadyEndpoint {
                address: (*a).into(),
                http_port: 8000,
                kv_port: Some(5557),
                replay_port: None,
                target: None,
            })
            .collect(),
    }
}

/// Worker sets `(name, endpoint addresses, policy)` on one registry.
fn fixture(sets: &[(&str, &[&str], PolicyName)]) -> Fixture {
    let snapshot = Snapshot {
        synced: true,
        pool_found: true,
        worker_sets: sets.iter().map(|(n, a, _)| ws(n, a)).collect(),
        problems: vec![],
    };
    let stop = CancellationToken::new();
    let mut registry = Registry::default();
    registry.sync(
        snapshot.endpoints().map(|(_, e)| EndpointKey {
            address: e.address.clone(),
            http_port: e.http_port,
        }),
        &stop,
    );
    let runtimes: HashMap<String, Arc<WsRuntime>> = sets
        .iter()
        .map(|(n, _, p)| {
            (
                (*n).to_owned(),
                Arc::new(WsRuntime::new(
                    LatencyParams::default(),
                    TokenizationMode::Engine,
                    *p,
                    Duration::from_secs(30),
                )),
            )
        })
        .collect();
    let view = View::build(&snapshot, &registry, &|r| runtimes[&r.name].clone());
    Fixture {
        view,
        kv: KvPlane::new(1_000_000),
        registry,
        _stop: stop,
    }
}

impl Fixture {
    fn endpoint(&self, address: &str) -> Arc<Endpoint> {
        self.registry
            .get(&EndpointKey {
                address: address.into(),
                http_port: 8000,
            })
            .expect("endpoint in the registry")
            .clone()
    }

    /// `address` (rank `rank`) stores the blocks of `ids`.
    fn store(&self, address: &str, rank: u32, ids: &[u32]) {
        self.store_chain(address, rank, ids, u64::from(rank), None);
    }

    /// `address` stores the blocks of `ids` for session `session`, as a
    /// chain of its own (hashes from `salt`).
    fn store_session(&self, address: &str, ids: &[u32], session: &str, salt: u64) {
        self.store_chain(address, 0, ids, salt, Some(session));
    }

    /// One `BlockStored` of `ids`' full blocks from the start, engine
    /// hashes `salt << 32 | 1, 2, …`.
    fn store_chain(&self, address: &str, rank: u32, ids: &[u32], salt: u64, session: Option<&str>) {
        let e = self.endpoint(address);
        let w = self.kv.attach(&e, rank, BLOCK).expect("attach");
        let blocks = ids.len() / BLOCK as usize;
        let ev = KvEvent::BlockStored(BlockStored {
            block_hashes: (0..blocks)
                .map(|i| BlockHash::Uint(salt << 32 | (1 + i as u64)))
                .collect(),
            parent_block_hash: None,
            token_ids: ids[..blocks * BLOCK as usize].to_vec(),
            block_size: BLOCK,
            session_id: session.map(str::to_owned),
            ..BlockStored::default()
        });
        self.kv.index().apply_event(w, &ev).expect("apply");
    }

    /// A request for `ids` to every worker set.
    fn prepared(&self, ids: &[u32]) -> Prepared {
        let routes = (0..self.view.worker_sets.len())
            .map(|i| {
                Route::from_ids(
                    Target {
                        worker_set: i,
                        model: MODEL.into(),
                    },
                    ids,
                    BLOCK,
                    Source::Local,
                )
            })
            .collect();
        Prepared::new(openai::Endpoint::Completions, MODEL, routes)
    }

    fn decide(
        &self,
        p: &Prepared,
        excluded: &[EndpointId],
        at: Duration,
    ) -> Result<Decision, ApiError> {
        let now = Now {
            instant: Instant::now(),
            since_start: at,
        };
        decide(
            &self.view,
            &self.kv,
            p,
            excluded,
            now,
            &mut SplitMix64::new(7),
            true,
        )
    }
}

fn prompt(n: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BLOCK).map(|i| 100 + n * 10_000 + i).collect()
}

const T: Duration = Duration::from_secs(100);

#[test]
fn the_endpoint_holding_the_prefix_wins_and_the_explanation_agrees() {
    let f = fixture(&[(
        "a",
        &["10.0.0.1", "10.0.0.2", "10.0.0.3"],
        PolicyName::Kinference,
    )]);
    let ids = prompt(1, 40);
    f.store("10.0.0.2", 0, &ids);
    let d = f.decide(&f.prepared(&ids), &[], T).unwrap();
    assert_eq!(d.endpoint.key.address, "10.0.0.2");
    let e = d.explanation.expect("asked for");
    assert_eq!(e.choice.endpoint, d.choice.endpoint);
    let warm = e
        .candidates
        .iter()
        .find(|c| c.inputs.endpoint.0 == d.endpoint.id.0)
        .unwrap();
    assert_eq!(warm.inputs.cached.gpu, 40, "all 40 blocks from the index");
    assert_eq!(d.dp_rank, None, "one rank: no rank header");
}

#[test]
fn deciding_changes_nothing_until_committed() {
    let f = fixture(&[(
        "a",
        &["10.0.0.1", "10.0.0.2", "10.0.0.3"],
        PolicyName::RoundRobin,
    )]);
    let p = f.prepared(&prompt(2, 4));
    let first = f.decide(&p, &[], T).unwrap();
    let again = f.decide(&p, &[], T).unwrap();
    assert_eq!(
        first.endpoint.id, again.endpoint.id,
        "a proposal advances no rotation"
    );
    assert_eq!(
        first.endpoint.load.snapshot().requests,
        0,
        "and counts no load"
    );
    let now = Now {
        instant: Instant::now(),
        since_start: T,
    };
    let c = commit::commit(&f.view, &p, &first, now);
    assert_eq!(first.endpoint.load.snapshot().requests, 1);
    let next = f.decide(&p, &[], T).unwrap();
    assert_ne!(
        next.endpoint.id, first.endpoint.id,
        "committed: the rotation moved on"
    );
    drop(c);
    assert_eq!(
        first.endpoint.load.snapshot().requests,
        0,
        "the guard released the load"
    );
}

#[test]
fn a_refused_attempt_is_withdrawn_and_the_retry_goes_elsewhere() {
    let f = fixture(&[("a", &["10.0.0.1", "10.0.0.2"], PolicyName::Kinference)]);
    let ids = prompt(3, 8);
    let p = f.prepared(&ids);
    let now = Now {
        instant: Instant::now(),
        since_start: T,
    };
    let d = f.decide(&p, &[], T).unwrap();
    let c = commit::commit(&f.view, &p, &d, now);
    // The record of the sent prefix makes the endpoint warm for a burst.
    let burst = f.decide(&p, &[], T).unwrap();
    assert_eq!(
        burst.endpoint.id, d.endpoint.id,
        "the record keeps a burst together"
    );
    // The engine refused: the record goes, and the retry excludes it.
    c.withdraw(&p);
    let retry = f.decide(&p, &[d.endpoint.id], T).unwrap();
    assert_ne!(retry.endpoint.id, d.endpoint.id);
    let record = f.view.worker_sets[0].runtime.prefixes.read();
    let mut out = Vec::new();
    record.leading_blocks(&p.routes[0].keys, T, &mut out);
    assert!(
        out.is_empty(),
        "nothing recorded for the refusing endpoint: {out:?}"
    );
    drop(record);
    // With every endpoint excluded there is nothing to decide.
    let all = [d.endpoint.id, retry.endpoint.id];
    let err = f.decide(&p, &all, T).unwrap_err();
    assert_eq!(err.status, http::StatusCode::SERVICE_UNAVAILABLE);
}

#[test]
fn only_the_winning_worker_set_records_the_prefix() {
    let f = fixture(&[
        ("cold", &["10.0.1.1"], PolicyName::Kinference),
        ("warm", &["10.0.2.1"], PolicyName::Kinference),
    ]);
    // The warm set holds most of the prompt, not all: the record bridges
    // the rest until the engine's events arrive.
    let ids = prompt(4, 64);
    f.store("10.0.2.1", 0, &ids[..16 * 48]);
    let p = f.prepared(&ids);
    let d = f.decide(&p, &[], T).unwrap();
    assert_eq!(
        p.routes[d.route].target.worker_set, 1,
        "the warm set is faster"
    );
    let now = Now {
        instant: Instant::now(),
        since_start: T,
    };
    let _c = commit::commit(&f.view, &p, &d, now);
    let mut out = Vec::new();
    f.view.worker_sets[0]
        .runtime
        .prefixes
        .read()
        .leading_blocks(&p.routes[0].keys, T, &mut out);
    assert!(out.is_empty(), "the losing set recorded nothing");
    f.view.worker_sets[1]
        .runtime
        .prefixes
        .read()
        .leading_blocks(&p.routes[1].keys, T, &mut out);
    assert_eq!(out.len(), 1);
}

#[test]
fn a_prompt_the_index_already_shows_is_not_recorded_again() {
    let f = fixture(&[("a", &["10.0.0.1", "10.0.0.2"], PolicyName::Kinference)]);
    let ids = prompt(7, 16);
    f.store("10.0.0.1", 0, &ids);
    let p = f.prepared(&ids);
    let d = f.decide(&p, &[], T).unwrap();
    let now = Now {
        instant: Instant::now(),
        since_start: T,
    };
    let _c = commit::commit(&f.view, &p, &d, now);
    assert!(
        f.view.worker_sets[0].runtime.prefixes.read().is_empty(),
        "the index shows all 16 blocks: nothing to bridge"
    );
}

#[test]
fn the_rank_holding_the_prefix_is_named_when_there_are_several() {
    let f = fixture(&[("a", &["10.0.0.1", "10.0.0.2"], PolicyName::Kinference)]);
    let ids = prompt(5, 32);
    f.store("10.0.0.1", 0, &ids[..16 * 4]);
    f.store("10.0.0.1", 1, &ids);
    f.endpoint("10.0.0.1").set_kv_ranks(2);
    let d = f.decide(&f.prepared(&ids), &[], T).unwrap();
    assert_eq!(d.endpoint.key.address, "10.0.0.1");
    assert_eq!(
        d.dp_rank,
        Some(1),
        "rank 1 holds all 32 blocks, rank 0 only 4"
    );
}

#[test]
fn ejected_endpoints_are_not_candidates() {
    let f = fixture(&[("a", &["10.0.0.1", "10.0.0.2"], PolicyName::Kinference)]);
    let ids = prompt(6, 16);
    f.store("10.0.0.1", 0, &ids);
    f.endpoint("10.0.0.1").record_failure(Instant::now());
    let d = f.decide(&f.prepared(&ids), &[], T).unwrap();
    assert_eq!(
        d.endpoint.key.address, "10.0.0.2",
        "the warm one is ejected"
    );
}

/// Three endpoints of one worker set under the kinference policy, and an
/// 8-block prompt prepared for them.
fn three_endpoints() -> (Fixture, Prepared) {
    let fix = fixture(&[(
        "a",
        &["10.0.0.1", "10.0.0.2", "10.0.0.3"],
        PolicyName::Kinference,
    )]);
    let req = fix.prepared(&prompt(9, 8));
    (fix, req)
}

/// Decides and commits `req` once for each of the three endpoints at `at`, each time
/// excluding the endpoints already chosen: (endpoint, its commit).
fn one_request_at_each(
    fix: &Fixture,
    req: &Prepared,
    at: Duration,
) -> Vec<(Arc<Endpoint>, commit::Commit)> {
    let now = Now {
        instant: Instant::now(),
        since_start: at,
    };
    let mut sent = Vec::new();
    let mut excluded = Vec::new();
    for _ in 0..3 {
        let dec = fix.decide(req, &excluded, at).unwrap();
        excluded.push(dec.endpoint.id);
        sent.push((
            dec.endpoint.clone(),
            commit::commit(&fix.view, req, &dec, now),
        ));
    }
    sent
}

#[test]
fn a_request_overdue_at_an_endpoint_and_a_503_steer_decisions_away_with_no_clock_read() {
    let (fix, req) = three_endpoints();
    // One request committed to each endpoint at T (no first token yet).
    let mut sent = one_request_at_each(&fix, &req, T);
    let slow = sent[0].0.clone();
    // 2 s later the other two have their first tokens; the first one's
    // request still waits, far past its prediction.
    let later = T + Duration::from_secs(2);
    for (_, cand) in &mut sent[1..] {
        cand.inflight.first_token();
    }
    let dec = fix.decide(&req, &[], later).unwrap();
    assert_ne!(dec.endpoint.id, slow.id, "{}", dec.choice);
    let expl = dec.explanation.unwrap();
    let cand = expl
        .candidates
        .iter()
        .find(|cand| cand.inputs.endpoint.0 == slow.id.0)
        .unwrap();
    assert_eq!(cand.inputs.evidence.oldest_waiting, Duration::from_secs(2));
    assert!(cand.prediction.ttft_ms >= 2000.0 && cand.prediction.evidence_ms > 0.0);
    // The same state a second later is read at that `now`, not the clock's.
    let d2 = fix
        .decide(&req, &[], later + Duration::from_secs(1))
        .unwrap();
    let c2 = d2
        .explanation
        .unwrap()
        .candidates
        .into_iter()
        .find(|cand| cand.inputs.endpoint.0 == slow.id.0)
        .unwrap();
    assert_eq!(c2.inputs.evidence.oldest_waiting, Duration::from_secs(3));
    // Its first token: the evidence goes.
    sent[0].1.inflight.first_token();
    let d3 = fix.decide(&req, &[], later).unwrap();
    let c3 = d3
        .explanation
        .unwrap()
        .candidates
        .into_iter()
        .find(|cand| cand.inputs.endpoint.0 == slow.id.0)
        .unwrap();
    assert_eq!(c3.inputs.evidence.oldest_waiting, Duration::ZERO);
    // A 503 from another endpoint just now: it loses to the third.
    drop(sent);
    let refusing = fix.endpoint("10.0.0.2");
    refusing.record_refusal(later);
    for i in 0..6 {
        let dec = fix
            .decide(&req, &[], later + Duration::from_millis(10 * i))
            .unwrap();
        assert_ne!(dec.endpoint.id, refusing.id);
    }
}

#[test]
fn a_ttft_target_takes_the_best_endpoint_meeting_it_over_a_warmer_one_missing_it() {
    use kinference_scoring::Reason;
    let f = fixture(&[("a", &["10.0.0.1", "10.0.0.2"], PolicyName::Kinference)]);
    let (warm, cold) = (f.endpoint("10.0.0.1"), f.endpoint("10.0.0.2"));
    let ids = prompt(11, 256);
    f.store("10.0.0.1", 0, &ids);
    // Another prompt is prefilling on the warm endpoint: it is later than
    // the cold one, by less than the tolerance.
    let other = f.prepared(&prompt(12, 320));
    let busy = f.decide(&other, &[cold.id], T).unwrap();
    assert_eq!(busy.endpoint.id, warm.id);
    let now = Now {
        instant: Instant::now(),
        since_start: T,
    };
    let _busy = commit::commit(&f.view, &other, &busy, now);
    let mut p = f.prepared(&ids);
    let d = f.decide(&p, &[], T).unwrap();
    assert_eq!(d.endpoint.id, warm.id, "{}", d.choice);
    let Reason::StayedWarm { later_ms, .. } = d.choice.reason else {
        panic!("expected to stay warm: {}", d.choice)
    };
    let warm_ms = d.choice.prediction.ttft_ms;
    let cold_ms = warm_ms - later_ms;
    let ms = |x: f64| Duration::from_secs_f64(x / 1e3);
    // A target between the two predictions: the cold endpoint, which meets
    // it; the admission gate reads the fastest prediction from the reason.
    p.ttft_deadline = Some(Instant::now() + ms(cold_ms + later_ms / 2.0));
    let d = f.decide(&p, &[], T).unwrap();
    assert_eq!(d.endpoint.id, cold.id, "{}", d.choice);
    let Reason::MetTarget {
        preferred,
        preferred_ms,
        later_ms,
    } = d.choice.reason
    else {
        panic!("expected the target to decide: {}", d.choice)
    };
    assert_eq!(preferred.0, warm.id.0);
    assert!((preferred_ms - warm_ms).abs() < 1e-6);
    assert!(later_ms.abs() < 1e-6, "the cold one is the fastest");
    assert!((crate::admit::fastest_ms(&d) - cold_ms).abs() < 1e-6);
    assert_eq!(d.choice.reason.label(), "met_ttft_target");
    // A target both meet, or neither: the policy's own choice.
    for target in [warm_ms + 100.0, cold_ms / 2.0] {
        p.ttft_deadline = Some(Instant::now() + ms(target));
        let d = f.decide(&p, &[], T).unwrap();
        assert_eq!(d.endpoint.id, warm.id, "target {target} ms: {}", d.choice);
        assert!(matches!(d.choice.reason, Reason::StayedWarm { .. }));
    }
    // A target already past: nothing meets it either.
    p.ttft_deadline = Some(Instant::now());
    assert_eq!(f.decide(&p, &[], T).unwrap().endpoint.id, warm.id);
}

#[test]
fn a_new_prefix_goes_where_it_evicts_no_blocks_in_recent_use() {
    let f = fixture(&[("a", &["10.0.0.1", "10.0.0.2"], PolicyName::Kinference)]);
    let (full, roomy) = (f.endpoint("10.0.0.1"), f.endpoint("10.0.0.2"));
    let now = Now {
        instant: Instant::now(),
        since_start: T,
    };
    // Both engines hold 64 blocks of 16 tokens, as their scrapes say.
    for e in [&full, &roomy] {
        e.set_scraped(crate::endpoint::Scraped {
            running: 0.0,
            waiting: 0.0,
            kv_usage: 0.0,
            block_size: Some(BLOCK),
            family: kinference_api::engine::EngineFamily::Vllm,
            own_requests: 0,
            own_prefilling: 0,
            at: now.instant,
        });
        e.set_kv_capacity_tokens(64 * u64::from(BLOCK));
    }
    // Four 16-block prompts went to `full` (finished since): its cache is
    // all blocks in recent use.
    for n in 0..4 {
        let p = f.prepared(&prompt(20 + n, 16));
        let d = f.decide(&p, &[roomy.id], T).unwrap();
        assert_eq!(d.endpoint.id, full.id);
        drop(commit::commit(&f.view, &p, &d, now));
    }
    // `roomy` has a short prompt still prefilling: by the TTFT alone it is
    // the later one.
    let busy = f.prepared(&prompt(30, 4));
    let d = f.decide(&busy, &[full.id], T).unwrap();
    let _in_flight = commit::commit(&f.view, &busy, &d, now);

    let p = f.prepared(&prompt(40, 16));
    // Neither engine's speed is measured yet: room draws nothing.
    let d = f.decide(&p, &[], T).unwrap();
    assert_eq!(d.endpoint.id, full.id, "{}", d.choice);
    // Both answered on time often enough for their speeds to count.
    {
        use kinference_scoring::Pick;
        let mut policy = f.view.worker_sets[0].runtime.policy.lock();
        for e in [&full, &roomy] {
            for _ in 0..kinference_scoring::policies::ROOM_NEEDS_SAMPLES {
                let pred = d.choice.prediction;
                let on_time = Duration::from_secs_f64(pred.ttft_ms / 1e3);
                policy.observe(kinference_scoring::EndpointId(e.id.0), &pred, on_time, T);
            }
        }
    }
    let d = f.decide(&p, &[], T).unwrap();
    assert_eq!(d.endpoint.id, roomy.id, "{}", d.choice);
    let expl = d.explanation.unwrap();
    let of = |id: EndpointId| {
        expl.candidates
            .iter()
            .find(|c| c.inputs.endpoint.0 == id.0)
            .unwrap()
    };
    assert_eq!(of(full.id).inputs.room.capacity_blocks, 64);
    assert_eq!(of(full.id).inputs.room.used_blocks, 64);
    assert_eq!(of(roomy.id).inputs.room.used_blocks, 4);
    let eviction = |id| match of(id).detail {
        kinference_scoring::ScoreDetail::Kinference { eviction_ms, .. } => eviction_ms,
        ref d => panic!("{d:?}"),
    };
    assert!(eviction(full.id) > 0.0 && eviction(roomy.id) == 0.0);
    assert!(
        of(full.id).prediction.ttft_ms < of(roomy.id).prediction.ttft_ms,
        "without the charge the full one would win"
    );
    // The room a fresh decision gives `roomy`.
    let roomy_room = || {
        let expl = f.decide(&p, &[], T).unwrap().explanation.unwrap();
        expl.candidates
            .iter()
            .find(|c| c.inputs.endpoint.0 == roomy.id.0)
            .unwrap()
            .inputs
            .room
    };
    // The blocks the index shows it holding count when they are more than
    // what this router sent there.
    roomy.set_kv_blocks_held(Some(60));
    assert_eq!(roomy_room().used_blocks, 60);
    // A hybrid model's held blocks do not compare with its capacity: no
    // room is given, so no charge.
    roomy.set_kv_blocks_held(None);
    assert_eq!(roomy_room(), KvRoom::default());
}

#[test]
fn a_session_counts_only_where_the_index_knows_nothing_of_the_prompt() {
    let f = fixture(&[(
        "a",
        &["10.0.0.1", "10.0.0.2", "10.0.0.3"],
        PolicyName::Kinference,
    )]);
    // The engine on .3 stored the session's first turn, in tokens the
    // router's keys do not reproduce (another template, say).
    f.store_session("10.0.0.3", &prompt(9, 30), "chat-1", 9);
    let ids = prompt(1, 40);
    let mut p = f.prepared(&ids);
    p.session = Some("chat-1".into());
    let d = f.decide(&p, &[], T).unwrap();
    assert_eq!(d.endpoint.key.address, "10.0.0.3");
    assert_eq!(d.candidate.session_blocks, 30);
    assert_eq!(d.candidate.cached, CachedBlocks::default());
    // Once the index shows the prompt somewhere, it rules: it sees
    // evictions, the sessions do not.
    f.store("10.0.0.1", 0, &ids);
    let d = f.decide(&p, &[], T).unwrap();
    assert_eq!(d.endpoint.key.address, "10.0.0.1");
    let e = d.explanation.expect("asked for");
    assert!(e.candidates.iter().all(|c| c.inputs.session_blocks == 0));
    // A session no engine reported changes nothing.
    let mut other = f.prepared(&prompt(2, 40));
    other.session = Some("chat-2".into());
    let d = f.decide(&other, &[], T).unwrap();
    assert_eq!(d.candidate.session_blocks, 0);
}

#[test]
fn a_session_names_the_dp_rank_that_stored_it() {
    let f = fixture(&[("a", &["10.0.0.1", "10.0.0.2"], PolicyName::Kinference)]);
    // Rank 1 of .2 stored the session; rank 0 is there too, empty.
    f.store_chain("10.0.0.2", 1, &prompt(9, 30), 9, Some("chat-1"));
    f.store_chain("10.0.0.2", 0, &prompt(8, 2), 8, None);
    f.endpoint("10.0.0.2").set_kv_ranks(2);
    let mut p = f.prepared(&prompt(1, 40));
    p.session = Some("chat-1".into());
    let d = f.decide(&p, &[], T).unwrap();
    assert_eq!(d.endpoint.key.address, "10.0.0.2");
    assert_eq!(
        d.dp_rank,
        Some(1),
        "the engine's own balancer might pick rank 0"
    );
}

#[test]
fn an_endpoint_silent_in_its_kv_events_is_avoided_before_its_request_is_late() {
    let (fix, req) = three_endpoints();
    let endpoints: Vec<_> = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
        .iter()
        .map(|a| fix.endpoint(a))
        .collect();
    for e in &endpoints {
        e.set_kv_ranks(1);
    }
    // One request committed to each endpoint at T; none has a first token.
    let sent = one_request_at_each(&fix, &req, T);
    let slow = endpoints[0].clone();
    let silent_for = |dec: &Decision| {
        let c = dec
            .explanation
            .as_ref()
            .unwrap()
            .candidates
            .iter()
            .find(|c| c.inputs.endpoint.0 == slow.id.0)
            .unwrap();
        (c.inputs.evidence, c.prediction)
    };
    // No engine of the worker set has stored a block yet: silence means
    // nothing (prefix caching may be off).
    let early = fix.decide(&req, &[], T + Duration::from_millis(5)).unwrap();
    let (evidence, _) = silent_for(&early);
    assert_eq!(evidence.stored_steps, None);
    let step = evidence.oldest_step;
    assert!(step > Duration::ZERO, "{evidence:?}");
    // The two others store a block every step; the first stays silent for
    // ten of its predicted steps, long before its request is overdue.
    for e in &endpoints[1..] {
        for _ in 0..10 {
            e.count_kv_stored_step();
        }
    }
    let later = T + Duration::from_millis(20) + step * 10;
    let dec = fix.decide(&req, &[], later).unwrap();
    assert_ne!(dec.endpoint.id, slow.id, "{}", dec.choice);
    let (evidence, prediction) = silent_for(&dec);
    assert_eq!(evidence.stored_steps, Some(0));
    assert!(prediction.scale >= 3.0, "{prediction:?}");
    // Once it stores as often as predicted, it is on time again.
    for _ in 0..10 {
        slow.count_kv_stored_step();
    }
    let (evidence, prediction) = silent_for(&fix.decide(&req, &[], later).unwrap());
    assert_eq!(evidence.stored_steps, Some(10));
    assert!(prediction.scale < 3.0, "{prediction:?}");
    // A stream found disconnected: its silence means nothing either.
    slow.set_kv_disconnected(true);
    let (evidence, _) = silent_for(&fix.decide(&req, &[], later).unwrap());
    assert_eq!(evidence.stored_steps, None);
    drop(sent);
}
