//! The KV index between replicas: a replica serves a snapshot of its index
//! on the admin port (`GET /peer/snapshot`), and a replica that starts with
//! peers bootstraps its index from one, so it routes on a warm view within
//! seconds even where the engines cannot replay their events (vLLM's and
//! SGLang's default).
//!
//! # What is sent
//!
//! The index's contents ([`kinference_kvindex::snapshot`]): per engine DP
//! rank (`address:port`, rank) its block width, KV-cache groups and the
//! position of its event stream the contents are consistent with (the last
//! batch applied: sequence number and payload digest); the block tree
//! (chained block keys, the engines' block hashes, parent links) with the
//! blocks each rank holds per group and tier. MessagePack, about 17 bytes
//! per block position. The peer encodes it under its index's writer lock
//! (events wait, lookups do not), at most `?max_bytes=` or its own
//! `--peer-snapshot-max-bytes` (64 MiB), the blocks nearest the roots
//! first; the asker refuses anything larger than its own bound. A replica
//! that is not ready itself answers 503, and with `--peer-token-file` only
//! requests with the bearer token get an answer (401 otherwise).
//!
//! # Bootstrap
//!
//! [`bootstrap`], when a replica starts with peers and
//! `--peer-bootstrap-timeout` (5 s) is not zero:
//!
//! 1. streams that start from then on keep the batches they apply and
//!    wait for their part of a snapshot ([`crate::kv::KvPlane::await_seed`],
//!    set before the router subscribes to anything); readiness says it
//!    waits;
//! 2. it waits until the pool is listed and every engine's streams are
//!    subscribed and connected (at most half the timeout), so that every
//!    batch after the peer's snapshot reaches this replica too;
//! 3. it asks the peers, those whose load reports arrive first, one at a
//!    time, each answer bounded by the time left; a peer still starting
//!    (503) or unreachable is asked again until the timeout;
//! 4. it hands each stream the part naming its worker, and each merges it
//!    with what it applied meanwhile (`kinference_kvindex::sub`,
//!    "Seeding": batches after the snapshot's position are applied again,
//!    so a block removed after it does not come back; a stream whose
//!    position does not line up imports nothing).
//!
//! When no peer answers in time, answers garbage or too much, or refuses
//! the token, the replica serves as one without peers (its index fills
//! from new events): a warning says why, `/debug/endpoints` shows it under
//! `kv_bootstrap`, and `kinference_router_kv_bootstrap_fallbacks_total`
//! counts it by reason. Readiness stops waiting at the timeout whatever
//! happened.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Empty, Full};
use hyper::body::{Body as _, Incoming};
use kinference_kvindex::Snapshot;
use serde::Serialize;
use tokio::time::Instant;

use crate::peers::{self, PeerList};
use crate::state::Shared;

/// The admin path of a replica's KV index snapshot.
pub const SNAPSHOT_PATH: &str = "/peer/snapshot";
/// Its content type.
pub const CONTENT_TYPE: &str = "application/vnd.kinference.kv-snapshot+msgpack";

/// Why a starting replica serves without a peer's snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fallback {
    /// No peer found (the first replica, or none listed in time).
    NoPeers,
    /// No connection to any peer.
    Unreachable,
    /// A peer refused the token (401, 403): `--peer-token-file` differs.
    Unauthorized,
    /// Every peer was itself not ready (starting too) until the timeout.
    NotReady,
    /// A peer does not serve snapshots (404: an older release).
    NotServed,
    /// Another error status.
    Refused,
    /// Larger than `--peer-snapshot-max-bytes`.
    TooLarge,
    /// Not a snapshot, or an inconsistent one.
    Invalid,
    /// No whole answer within the timeout.
    Timeout,
}

impl Fallback {
    /// Every reason, for metrics.
    pub const ALL: [Fallback; 9] = [
        Fallback::NoPeers,
        Fallback::Unreachable,
        Fallback::Unauthorized,
        Fallback::NotReady,
        Fallback::NotServed,
        Fallback::Refused,
        Fallback::TooLarge,
        Fallback::Invalid,
        Fallback::Timeout,
    ];

    /// Its metric label.
    pub fn label(self) -> &'static str {
        match self {
            Fallback::NoPeers => "no_peers",
            Fallback::Unreachable => "unreachable",
            Fallback::Unauthorized => "unauthorized",
            Fallback::NotReady => "not_ready",
            Fallback::NotServed => "not_served",
            Fallback::Refused => "refused",
            Fallback::TooLarge => "too_large",
            Fallback::Invalid => "invalid",
            Fallback::Timeout => "timeout",
        }
    }

    /// Whether asking the same peer again may help (it is starting, or was
    /// not reachable yet).
    fn retry(self) -> bool {
        matches!(
            self,
            Fallback::Unreachable | Fallback::NotReady | Fallback::Timeout
        )
    }
}

/// The bootstrap from a peer, for `/debug/endpoints` and metrics.
#[derive(Clone, Debug, Serialize)]
pub struct BootstrapReport {
    /// `off` (no peers, or `--peer-bootstrap-timeout 0`), `waiting` (for
    /// the engines' streams and the peers), `asking`, `seeded`, `fallback`.
    pub state: &'static str,
    /// The peer whose snapshot was used.
    pub peer: Option<String>,
    /// Why none was used.
    pub fallback: Option<Fallback>,
    /// The last error, when a peer failed.
    pub error: Option<String>,
    /// Bytes of the snapshot.
    pub bytes: u64,
    /// Block positions and entries it carried.
    pub positions: u64,
    /// Entries it carried (all workers).
    pub entries: u64,
    /// Whether the peer left out blocks to stay within the bound.
    pub truncated: bool,
    /// Streams waiting for it, and those it had a part for.
    pub streams: usize,
    /// Streams given a part.
    pub offered: usize,
    /// From the start of the bootstrap to the hand-out, ms.
    pub took_ms: Option<u64>,
}

impl Default for BootstrapReport {
    fn default() -> Self {
        Self {
            state: "off",
            peer: None,
            fallback: None,
            error: None,
            bytes: 0,
            positions: 0,
            entries: 0,
            truncated: false,
            streams: 0,
            offered: 0,
            took_ms: None,
        }
    }
}

fn plain(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    r
}

/// Answers `GET /peer/snapshot[?max_bytes=N]`: this replica's index (see
/// the module docs), counted in [`peers::Traffic`].
pub async fn serve(shared: Arc<Shared>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let pq = req
        .uri()
        .path_and_query()
        .map_or(SNAPSHOT_PATH, |p| p.as_str());
    let traffic = &shared.runtime.peer_traffic;
    traffic.snapshot_received.fetch_add(
        peers::head_bytes("GET  HTTP/1.1".len() + pq.len(), req.headers()),
        Ordering::Relaxed,
    );
    let resp = answer(&shared, &req).await;
    let body = resp.body().size_hint().exact().unwrap_or(0);
    traffic.snapshot_sent.fetch_add(
        peers::response_bytes(resp.status(), resp.headers(), body as usize, true),
        Ordering::Relaxed,
    );
    resp
}

async fn answer(shared: &Arc<Shared>, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let settings = shared.config.peers.as_ref();
    let token = settings.and_then(|p| p.token.as_ref());
    if !peers::allowed(token, req.headers()) {
        return plain(StatusCode::UNAUTHORIZED, "peer token required\n");
    }
    if let Err(why) = shared.readiness() {
        return plain(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        );
    }
    let cap = settings.map_or(crate::config::defaults::PEER_SNAPSHOT_MAX_BYTES, |p| {
        p.snapshot_max_bytes
    });
    let asked = req.uri().query().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("max_bytes="))
            .and_then(|v| v.parse::<usize>().ok())
    });
    let max = asked.map_or(cap, |a| a.min(cap));
    let Some(export) = shared.kv.export(max) else {
        return plain(
            StatusCode::SERVICE_UNAVAILABLE,
            "a snapshot is being sent already\n",
        );
    };
    match export.await {
        Ok(body) => {
            let mut r = Response::new(Full::new(Bytes::from(body)));
            r.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
            r
        }
        Err(e) => plain(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

/// Bootstraps this replica's KV index from a peer's by `until` (see the
/// module docs); started by [`crate::peers::spawn`], which has made the
/// streams wait for it ([`crate::kv::KvPlane::await_seed`]).
pub async fn bootstrap(
    shared: Arc<Shared>,
    settings: peers::Settings,
    list: Arc<PeerList>,
    until: Instant,
) {
    let started = until - settings.bootstrap_timeout;
    let report = |state: &'static str| BootstrapReport {
        state,
        ..BootstrapReport::default()
    };
    shared.kv.set_bootstrap_report(report("waiting"));
    let stop = shared.runtime.stop.clone();
    let settle = started + settings.bootstrap_timeout / 2;
    // The engines' streams, connected: batches after the snapshot reach us.
    while Instant::now() < settle && !streams_settled(&shared) {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    while Instant::now() < until && !list.listed() {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    shared.kv.set_bootstrap_report(report("asking"));
    let result = tokio::select! {
        () = stop.cancelled() => return,
        r = ask(&shared, &settings, &list, until) => r,
    };
    let took = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    match result {
        Ok((peer, snapshot, bytes)) => {
            let (positions, entries, truncated) = (
                snapshot.positions(),
                snapshot.entries(),
                snapshot.truncated(),
            );
            let seeded = shared.kv.seed(Some(&Arc::new(snapshot)));
            tracing::info!(
                %peer, bytes, positions, entries, truncated,
                streams = seeded.streams, offered = seeded.offered, took_ms = took,
                "bootstrapping the KV index from a peer's snapshot"
            );
            shared.kv.set_bootstrap_report(BootstrapReport {
                state: "seeded",
                peer: Some(peer),
                bytes: bytes as u64,
                positions,
                entries,
                truncated,
                streams: seeded.streams,
                offered: seeded.offered,
                took_ms: Some(took),
                ..BootstrapReport::default()
            });
        }
        Err((fallback, error)) => {
            let seeded = shared.kv.seed(None);
            tracing::warn!(
                reason = fallback.label(), %error, took_ms = took,
                "no peer's KV index snapshot: serving without one (the index fills from the engines' new events)"
            );
            shared.kv.set_bootstrap_report(BootstrapReport {
                state: "fallback",
                fallback: Some(fallback),
                error: Some(error),
                streams: seeded.streams,
                took_ms: Some(took),
                ..BootstrapReport::default()
            });
        }
    }
}

/// Whether the pool is listed and every endpoint with KV events has its
/// streams subscribed and connected.
fn streams_settled(shared: &Shared) -> bool {
    if !shared.is_ready() {
        return false;
    }
    let view = shared.view();
    let mut expected: Vec<(&str, u16)> = view
        .worker_sets
        .iter()
        .filter(|ws| ws.route.kv_events)
        .flat_map(|ws| ws.route.endpoints.iter())
        .filter(|e| e.kv_port.is_some())
        .map(|e| (e.address.as_str(), e.http_port))
        .collect();
    expected.sort_unstable();
    expected.dedup();
    let (subscribed, connected) = shared.kv.streams_connected();
    subscribed >= expected.len() && connected
}

type Failure = (Fallback, String);

/// Asks the peers in turn until one gives a snapshot or `until`.
async fn ask(
    shared: &Shared,
    settings: &peers::Settings,
    list: &PeerList,
    until: Instant,
) -> Result<(String, Snapshot, usize), Failure> {
    let mut last: Failure = (Fallback::NoPeers, "no peer listed".into());
    let mut done: Vec<String> = Vec::new();
    loop {
        // Peers whose load reports arrive are up: first.
        let fresh: Vec<String> = shared
            .runtime
            .peer_state
            .read()
            .peers
            .iter()
            .filter(|p| p.report_age_ms.is_some())
            .map(|p| p.address.clone())
            .collect();
        let mut peers: Vec<String> = list
            .get()
            .into_iter()
            .filter(|a| !done.contains(a))
            .collect();
        peers.sort_by_key(|a| !fresh.contains(a));
        if peers.is_empty() {
            return Err(last);
        }
        for a in peers {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(last);
            }
            // A peer that accepts and never answers leaves time for the
            // next one.
            let attempt = (settings.bootstrap_timeout / 2)
                .max(Duration::from_millis(500))
                .min(left);
            match fetch(shared, settings, &a, attempt).await {
                Ok((s, n)) => return Ok((a, s, n)),
                Err((f, why)) => {
                    tracing::info!(peer = %a, reason = f.label(), error = %why, "a peer's KV index snapshot");
                    if !f.retry() {
                        done.push(a.clone());
                    }
                    last = (f, format!("{a}: {why}"));
                }
            }
        }
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(last);
        }
        tokio::time::sleep(left.min(Duration::from_millis(200))).await;
    }
}

/// One peer's snapshot, decoded and checked.
async fn fetch(
    shared: &Shared,
    settings: &peers::Settings,
    address: &str,
    timeout: Duration,
) -> Result<(Snapshot, usize), Failure> {
    let max = settings.snapshot_max_bytes;
    let pq = format!("{SNAPSHOT_PATH}?max_bytes={max}");
    let mut req = Request::get(format!("http://{address}{pq}"));
    if let Some(t) = &settings.token {
        req = req.header(header::AUTHORIZATION, t.clone());
    }
    let req = req
        .body(Empty::<Bytes>::new())
        .map_err(|e| (Fallback::Invalid, e.to_string()))?;
    let traffic = &shared.runtime.peer_traffic;
    let sent = peers::request_bytes(&pq, address, req.headers());
    let call = async {
        let resp = shared.runtime.probes.request(req).await.map_err(|e| {
            let f = if e.is_connect() {
                Fallback::Unreachable
            } else {
                Fallback::Refused
            };
            (f, crate::probe::error_chain(&e))
        })?;
        traffic.snapshot_sent.fetch_add(sent, Ordering::Relaxed);
        let (status, headers) = (resp.status(), resp.headers().clone());
        let refused = match status.as_u16() {
            200..=299 => None,
            401 | 403 => Some(Fallback::Unauthorized),
            404 => Some(Fallback::NotServed),
            503 => Some(Fallback::NotReady),
            _ => Some(Fallback::Refused),
        };
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
        if refused.is_none() && declared.is_some_and(|n| n > max) {
            return Err((
                Fallback::TooLarge,
                format!("{} bytes, more than {max}", declared.unwrap_or(0)),
            ));
        }
        let limit = if refused.is_some() { 4096 } else { max };
        let body = http_body_util::Limited::new(resp.into_body(), limit)
            .collect()
            .await
            .map_err(|e| {
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some()
                {
                    (Fallback::TooLarge, format!("more than {limit} bytes"))
                } else {
                    (Fallback::Unreachable, e.to_string())
                }
            })?
            .to_bytes();
        traffic.snapshot_received.fetch_add(
            peers::response_bytes(status, &headers, body.len(), false),
            Ordering::Relaxed,
        );
        if let Some(f) = refused {
            let text = String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned();
            return Err((f, format!("answered {status}: {}", text.trim())));
        }
        let n = body.len();
        let decoded = tokio::task::spawn_blocking(move || Snapshot::decode(&body))
            .await
            .map_err(|e| (Fallback::Invalid, e.to_string()))?;
        decoded
            .map(|s| (s, n))
            .map_err(|e| (Fallback::Invalid, e.to_string()))
    };
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or_else(|_| {
            Err((
                Fallback::Timeout,
                format!("no whole answer within {timeout:?}"),
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fallback_has_its_own_label() {
        let mut labels: Vec<&str> = Fallback::ALL.iter().map(|f| f.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Fallback::ALL.len());
        for f in Fallback::ALL {
            let json = serde_json::to_value(f).expect("serializes");
            assert_eq!(json, f.label());
        }
    }
}
