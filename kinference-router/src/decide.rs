//! Stage 2, decide: where a prepared request goes, as a synchronous
//! computation over the current state. No I/O, no clock read (the caller
//! passes [`Now`]), no change to any state: the decision is a proposal that
//! [`crate::commit`] records only for the attempt that is sent.
//!
//! For each route of the request (a worker set serving its model), the
//! candidates are the set's endpoints that may take it
//! ([`crate::view::WorkerSetView::serving`]), minus those already tried;
//! when every endpoint of every route is ejected, the ejected ones too
//! (panic mode: trying beats failing for certain).
//! Their cached leading blocks come from the KV index (exact mode), topped
//! up by this router's own record of prefixes it sent in the last seconds
//! (a burst of a new prefix stays together before the engine's events
//! arrive), or from the record alone (approximate mode). Load is the
//! router's in-flight accounting, the scraped figures, and the evidence of
//! requests still waiting there for a first token and of the engine's
//! recent 503s ([`kinference_scoring::Evidence`], ages taken at `now`). A
//! request that names a LoRA adapter also reads where each candidate's
//! adapter slots stand ([`crate::adapters`]). The set's policy
//! proposes; across routes the lowest predicted time to first token wins.
//!
//! A request with a TTFT target (`x-kinference-ttft-target-ms`) carries
//! what is left of it at `now` ([`kinference_scoring::Request::ttft_target`]):
//! kinference's policy then takes the best candidate predicted to meet it
//! over a preferred one predicted to miss it (across routes the lowest
//! prediction still wins: it meets the target whenever any route's choice
//! does).

use std::sync::Arc;
use std::time::Duration;

use kinference_kvindex::Matches;
use kinference_scoring::{
    AdapterSlot, CacheSource, CachedBlocks, Candidate, Choice, EngineMetrics, Evidence,
    Explanation, InFlight, KvRoom, Pick, RandomSource,
};
use tokio::time::Instant;

use crate::endpoint::{Endpoint, EndpointId};
use crate::kv::{Held, KvPlane, SessionHeld};
use crate::openai::ApiError;
use crate::prepare::{Prepared, Route};
use crate::view::{View, WorkerSetView};

/// The time a decision is taken at, read once by the caller.
#[derive(Clone, Copy, Debug)]
pub struct Now {
    /// For endpoint health and scrape ages.
    pub instant: Instant,
    /// For scoring: time since the router started.
    pub since_start: Duration,
}

/// What was decided.
#[derive(Debug)]
pub struct Decision {
    /// The route chosen (index into [`Prepared::routes`]).
    pub route: usize,
    /// The endpoint chosen.
    pub endpoint: Arc<Endpoint>,
    /// The policy's choice (prediction included).
    pub choice: Choice,
    /// The chosen candidate as the policy saw it.
    pub candidate: Candidate,
    /// The explanation, when asked for.
    pub explanation: Option<Explanation>,
    /// The DP rank to ask for (`X-data-parallel-rank`), when the engine has
    /// several and one holds more of the prompt.
    pub dp_rank: Option<u32>,
    /// Taken in panic mode: every candidate was ejected.
    pub panic: bool,
}

impl Decision {
    /// Whether the chosen endpoint is already known (index, or prefix
    /// record topped up on it) to hold every full block of `route`'s
    /// prompt, in exact mode: then sending it records nothing new, and
    /// asking the engine to re-report the blocks it reuses would only
    /// repeat what the index shows.
    pub fn holds_whole_prompt(&self, route: &Route) -> bool {
        route.request.cache == kinference_scoring::CacheSource::Index
            && self.candidate.cached.gpu as usize >= route.keys.len()
    }
}

/// Decides where `prepared` goes, skipping `excluded` endpoints.
///
/// # Errors
/// 503 when no route has an endpoint that may take the request.
pub fn decide(
    view: &View,
    kv: &KvPlane,
    prepared: &Prepared,
    excluded: &[EndpointId],
    now: Now,
    rng: &mut dyn RandomSource,
    explain: bool,
) -> Result<Decision, ApiError> {
    let mut best: Option<Decision> = None;
    let mut held = Vec::new();
    let mut scratch = Matches::default();
    let target = prepared
        .ttft_deadline
        .map(|d| d.saturating_duration_since(now.instant));
    let mut session = Vec::new();
    if let Some(s) = &prepared.session {
        kv.session_tokens(s, &mut session);
    }
    // Healthy endpoints first; when every endpoint of every route is
    // ejected, all of them (panic mode, as Envoy does: an ejection is a
    // guess, and trying beats failing for certain).
    for health in [Some(now.instant), None] {
        for (i, route) in prepared.routes.iter().enumerate() {
            let ws = &view.worker_sets[route.target.worker_set];
            let endpoints = ws.candidates(&route.target.model, health, excluded);
            if endpoints.is_empty() {
                continue;
            }
            let d = decide_route(
                ws,
                kv,
                route,
                target,
                &endpoints,
                now,
                rng,
                explain,
                &session,
                &mut held,
                &mut scratch,
            );
            if let Some(mut d) = d
                && best
                    .as_ref()
                    .is_none_or(|b| d.choice.prediction.ttft_ms < b.choice.prediction.ttft_ms)
            {
                d.route = i;
                d.panic = health.is_none();
                best = Some(d);
            }
        }
        if best.is_some() {
            break;
        }
    }
    best.ok_or_else(|| {
        let sets: Vec<&str> = prepared
            .routes
            .iter()
            .map(|r| view.worker_sets[r.target.worker_set].route.name.as_str())
            .collect();
        ApiError::unavailable(format!(
            "No endpoint serves this model right now (worker sets: {}).",
            sets.join(", ")
        ))
    })
}

/// What the cache side of a decision knows per candidate.
struct CacheView {
    /// Leading blocks of the prompt.
    cached: Vec<CachedBlocks>,
    /// The DP rank holding the most.
    best_rank: Vec<Option<u32>>,
    /// Distinct blocks this router sent there recently (the prefix record).
    recent: Vec<u32>,
}

/// Leading blocks per candidate (and the DP rank holding the most): the KV
/// index, topped up by the prefix record; and the blocks recently sent to
/// each.
fn cached_blocks(
    ws: &WorkerSetView,
    kv: &KvPlane,
    route: &Route,
    endpoints: &[Arc<Endpoint>],
    now: Now,
    held: &mut Vec<Held>,
    scratch: &mut Matches,
) -> CacheView {
    let mut cached = vec![CachedBlocks::default(); endpoints.len()];
    let mut best_rank: Vec<Option<u32>> = vec![None; endpoints.len()];
    let mut recent = vec![0; endpoints.len()];
    let cache = route.request.cache;
    if cache == CacheSource::None || route.keys.is_empty() {
        return CacheView {
            cached,
            best_rank,
            recent,
        };
    }
    if cache == CacheSource::Index {
        kv.lookup(&route.block_keys, scratch, held);
        for h in held.iter() {
            if let Some(i) = endpoints.iter().position(|e| e.id == h.endpoint) {
                // Cumulative runs: GPU ≤ GPU or CPU ≤ … ≤ any tier; each
                // block counts at the best credit of the runs covering it.
                cached[i].gpu = h.gpu_blocks;
                cached[i].cpu = h.cpu_blocks;
                cached[i].disk = h.disk_blocks;
                cached[i].storage = h.blocks;
                best_rank[i] = Some(h.rank);
            }
        }
    }
    let mut out = Vec::new();
    {
        let record = ws.runtime.prefixes.read();
        if cache == CacheSource::Index {
            // Only until the engine's own events can have arrived: after that
            // the index is the truth, and it has seen evictions the record
            // cannot (see kinference_scoring::approx).
            record.leading_blocks_within(
                &route.keys,
                now.since_start,
                kinference_scoring::approx::EXACT_MODE_HORIZON,
                &mut out,
            );
        } else {
            record.leading_blocks(&route.keys, now.since_start, &mut out);
        }
        for (e, r) in endpoints.iter().zip(recent.iter_mut()) {
            *r = record.blocks_sent(kinference_scoring::EndpointId(e.id.0));
        }
    }
    peer_records(ws, route, cache, now, &mut out);
    for (ep, n) in out {
        if let Some(i) = endpoints.iter().position(|e| e.id.0 == ep.0) {
            cached[i].gpu = cached[i].gpu.max(n);
        }
    }
    CacheView {
        cached,
        best_rank,
        recent,
    }
}

/// Per candidate, the blocks of the request's session its engines stored
/// (`session`, from [`KvPlane::session_tokens`]), in the route's block
/// width and at most the prompt's blocks, with the DP rank holding them
/// where the index named none; none (an empty vector, no allocation)
/// without a session, and in exact mode when any candidate holds any of
/// the prompt: then the index, which sees evictions, knows better than the
/// sessions, which do not.
fn session_blocks(
    route: &Route,
    endpoints: &[Arc<Endpoint>],
    cached: &[CachedBlocks],
    best_rank: &mut [Option<u32>],
    session: &[SessionHeld],
) -> Vec<u32> {
    if session.is_empty()
        || (route.request.cache == CacheSource::Index
            && cached.iter().any(|c| *c != CachedBlocks::default()))
    {
        return Vec::new();
    }
    let mut out = vec![0; endpoints.len()];
    let width = u64::from(route.request.block_tokens.max(1));
    let most = u64::from(route.request.prompt_tokens) / width;
    for ((e, o), rank) in endpoints.iter().zip(out.iter_mut()).zip(best_rank) {
        if let Some(s) = session.iter().find(|s| s.endpoint == e.id) {
            *o = u32::try_from((s.tokens / width).min(most)).unwrap_or(u32::MAX);
            rank.get_or_insert(s.rank);
        }
    }
    out
}

/// Appends to `out` what the peers' records say each endpoint holds of
/// the prompt (in blocks, to within [`crate::peers::RECORD_STRIDE`]),
/// trusted as long as this router's own record.
fn peer_records(
    ws: &WorkerSetView,
    route: &Route,
    cache: CacheSource,
    now: Now,
    out: &mut Vec<(kinference_scoring::EndpointId, u32)>,
) {
    let record = ws.runtime.peer_prefixes.read();
    if record.is_empty() || route.keys.len() < crate::peers::RECORD_STRIDE {
        return;
    }
    let keys: Vec<u64> = crate::peers::checkpoints(&route.keys).collect();
    let mut found = Vec::new();
    if cache == CacheSource::Index {
        record.leading_blocks_within(
            &keys,
            now.since_start,
            kinference_scoring::approx::EXACT_MODE_HORIZON,
            &mut found,
        );
    } else {
        record.leading_blocks(&keys, now.since_start, &mut found);
    }
    let stride = crate::peers::RECORD_STRIDE as u32;
    out.extend(
        found
            .into_iter()
            .map(|(e, n)| (e, n.saturating_mul(stride))),
    );
}

#[allow(clippy::too_many_arguments)]
fn decide_route(
    ws: &WorkerSetView,
    kv: &KvPlane,
    route: &Route,
    target: Option<Duration>,
    endpoints: &[Arc<Endpoint>],
    now: Now,
    rng: &mut dyn RandomSource,
    explain: bool,
    session: &[SessionHeld],
    held: &mut Vec<Held>,
    scratch: &mut Matches,
) -> Option<Decision> {
    let CacheView {
        cached,
        mut best_rank,
        recent,
    } = cached_blocks(ws, kv, route, endpoints, now, held, scratch);
    let session = session_blocks(route, endpoints, &cached, &mut best_rank, session);
    let block_tokens = u64::from(route.request.block_tokens.max(1));
    // A worker set's engines share one configuration: once one of them has
    // stored a block, the others' silence in their events means something
    // (with prefix caching off none ever stores).
    let storing = endpoints.iter().any(|e| e.kv_stored_steps() > 0);
    let candidates: Vec<Candidate> = endpoints
        .iter()
        .zip(&cached)
        .zip(&recent)
        .enumerate()
        .map(|(i, ((e, c), recent))| {
            let mut cand = candidate(e, *c, now, storing);
            cand.session_blocks = session.get(i).copied().unwrap_or(0);
            if let (Some(tokens), Some(held)) = (e.kv_capacity_tokens(), e.kv_blocks_held()) {
                // What the index shows it holding (prompts and outputs, in
                // the worker set's block width), or what this router sent
                // there recently when events lag or are off.
                let held = held * u64::from(ws.route.kv_block_size) / block_tokens;
                let blocks = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
                cand.room = KvRoom {
                    capacity_blocks: blocks(tokens / block_tokens),
                    used_blocks: blocks(held).max(*recent),
                };
            }
            if let Some(a) = &route.adapter {
                cand.adapter = e
                    .adapters
                    .slot(a, now.instant, ws.runtime.params.metrics_max_age);
            }
            cand
        })
        .collect();
    let request = kinference_scoring::Request {
        ttft_target: target,
        ..route.request
    };
    let (choice, explanation) = {
        let mut policy = ws.runtime.policy.lock();
        if explain {
            let e = policy
                .propose_explained(&request, &candidates, now.since_start, rng)
                .ok()?;
            (e.choice, Some(e))
        } else {
            (
                policy
                    .propose(&request, &candidates, now.since_start, rng)
                    .ok()?,
                None,
            )
        }
    };
    let endpoint = endpoints.get(choice.index)?.clone();
    let candidate = *candidates.get(choice.index)?;
    let dp_rank = best_rank
        .get(choice.index)
        .copied()
        .flatten()
        .filter(|_| endpoint.kv_ranks() > 1);
    Some(Decision {
        route: 0,
        endpoint,
        choice,
        candidate,
        explanation,
        dp_rank,
        panic: false,
    })
}

/// What the policy reads about one endpoint; `storing`: its worker set's
/// engines are known to publish stored blocks.
pub(crate) fn candidate(e: &Endpoint, cached: CachedBlocks, now: Now, storing: bool) -> Candidate {
    let load = e.load.snapshot();
    let (oldest_waiting, oldest_predicted, mark) =
        e.waiting.oldest_marked(now.since_start).unwrap_or_default();
    let stored_steps = (storing && e.kv_followed() && !oldest_waiting.is_zero())
        .then(|| u32::try_from(mark.steps_since(e.kv_stored_steps())).unwrap_or(u32::MAX));
    Candidate {
        endpoint: kinference_scoring::EndpointId(e.id.0),
        cached,
        in_flight: InFlight {
            requests: load.requests,
            decoding: load.decoding,
            prefill_tokens: load.prefill_tokens,
            context_tokens: load.context_tokens,
        },
        engine: e.scraped().map(|s| EngineMetrics {
            running: s.running as u32,
            waiting: s.waiting as u32,
            kv_usage: s.kv_usage,
            age: now.instant.saturating_duration_since(s.at),
            own_requests: s.own_requests,
            own_prefilling: s.own_prefilling,
        }),
        evidence: Evidence {
            oldest_waiting,
            oldest_predicted,
            refused_age: e.refused_age(now.since_start),
            stored_steps,
            oldest_step: mark.step,
            oldest_sent_idle: mark.idle,
        },
        adapter: AdapterSlot::Unknown,
        room: KvRoom::default(),
        session_blocks: 0,
        peer_arrival_rate: e.load.peers.arrival_rate(now.since_start),
    }
}

#[cfg(test)]
mod tests;
