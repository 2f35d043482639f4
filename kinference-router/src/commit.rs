//! Stage 3, commit: what sending a decision changes, for the attempt that
//! is sent and only for it.
//!
//! When the router sends a request to the decided endpoint it records, at
//! once (a burst arriving during this request's prefill must see them):
//! the endpoint's in-flight load ([`crate::endpoint::InFlight`]), the
//! policy's per-decision state (rotation, least-recently-chosen times;
//! [`kinference_scoring::Pick::commit`]), the prefix record, and the
//! request's send time and prediction while it waits for its first token
//! ([`crate::endpoint::Waiting`]: evidence for the next decisions). If the
//! engine refuses the attempt before any byte reaches the client (a connect
//! failure, a 5xx), [`Commit::withdraw`] takes the prefix record back: an
//! engine that refused holds nothing new. Routes that lost the decision
//! never record anything.

use std::sync::Arc;

use kinference_scoring::{CacheSource, Pick as _, RecordMark};

use crate::decide::{Decision, Now};
use crate::endpoint::InFlight;
use crate::prepare::Prepared;
use crate::runtime::WsRuntime;
use crate::view::View;

/// One sent attempt's record.
#[derive(Debug)]
pub struct Commit {
    runtime: Arc<WsRuntime>,
    record: Option<RecordMark>,
    route: usize,
    /// The attempt's share of the endpoint's load (released when dropped).
    pub inflight: InFlight,
}

/// Records the decision `d` for `prepared` as sent at `now`.
pub fn commit(view: &View, prepared: &Prepared, d: &Decision, now: Now) -> Commit {
    let route = &prepared.routes[d.route];
    let runtime = view.worker_sets[route.target.worker_set].runtime.clone();
    runtime
        .policy
        .lock()
        .commit(&route.request, &d.candidate, &d.choice, now.since_start);
    // In exact mode the record only bridges the time until the engine's
    // events arrive: an endpoint already known to hold the whole prompt
    // needs none (repeats of warm prompts, most traffic, write nothing).
    let record = (route.request.cache != CacheSource::None
        && !route.keys.is_empty()
        && !d.holds_whole_prompt(route))
    .then(|| {
        // Peers routing the same new prefix before the engine's events
        // reach them find it too.
        runtime.sent.push(&d.endpoint.authority, &route.keys);
        runtime
            .prefixes
            .write()
            .record(d.choice.endpoint, &route.keys, now.since_start)
    });
    let mut inflight = d.endpoint.begin(
        u64::from(d.choice.uncached_tokens()),
        u64::from(route.request.prompt_tokens),
    );
    if let Some(a) = &route.adapter {
        inflight.for_adapter(a);
    }
    // Until its first token, its age is evidence about the engine.
    let ms = |v: f64| std::time::Duration::from_secs_f64((v / 1e3).clamp(0.0, 3600.0));
    inflight.waiting_since_stepped(
        now.since_start,
        ms(d.choice.prediction.ttft_ms),
        // Its step counts only if it stores a block of its own on the way.
        if d.choice.uncached_tokens() >= route.request.block_tokens {
            ms(d.choice.prediction.mean_step_ms())
        } else {
            std::time::Duration::ZERO
        },
        d.candidate.in_flight.requests == 0,
    );
    Commit {
        runtime,
        record,
        route: d.route,
        inflight,
    }
}

impl Commit {
    /// The engine refused the attempt: its prefix record goes, and so does
    /// its load.
    pub fn withdraw(self, prepared: &Prepared) {
        if let Some(mark) = self.record {
            let keys = &prepared.routes[self.route].keys;
            self.runtime.prefixes.write().withdraw(keys, mark);
        }
    }

    /// The engine answered with an error that goes back to the client: the
    /// prefix record goes (the engine computed nothing to keep), the load
    /// stays until the answer has been streamed.
    pub fn withdraw_record(&mut self, prepared: &Prepared) {
        if let Some(mark) = self.record.take() {
            let keys = &prepared.routes[self.route].keys;
            self.runtime.prefixes.write().withdraw(keys, mark);
        }
    }

    /// The attempt's load guard, once the engine accepted it.
    pub fn into_inflight(self) -> InFlight {
        self.inflight
    }
}
