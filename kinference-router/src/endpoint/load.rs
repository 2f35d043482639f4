//! The router's own count of the work it has sent to an endpoint, what its
//! peers report there, and each request's share ([`InFlight`]), whose
//! first token and end move the counts exactly once.

use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use kinference_scoring::ArrivalRate;
use serde::Serialize;
use tokio::time::Instant;

use super::Endpoint;

/// The router's own count of work it has sent to an endpoint.
#[derive(Debug, Default)]
pub struct Load {
    /// Requests sent and not finished.
    pub requests: AtomicU32,
    /// Requests sent, cumulative: what the peers count as this replica's
    /// arrivals here ([`crate::peers::Report::sent`]).
    pub sent: AtomicU64,
    /// Marks when `sent` last moved, as `prefilled_version` does.
    pub sent_version: AtomicU64,
    /// Requests whose first token has not arrived.
    pub prefilling: AtomicU32,
    /// Uncached prompt tokens of the prefilling requests.
    pub prefill_tokens: AtomicU64,
    /// Requests past their first token and not finished.
    pub decoding: AtomicU32,
    /// Prompt tokens of all requests in flight (their context size).
    pub context_tokens: AtomicU64,
    /// What the other router replicas report they have in flight here,
    /// summed over the fresh reports ([`crate::peers`]); 0 without peers.
    pub peers: PeerLoad,
    /// Which first tokens came out of one engine step.
    pub bursts: parking_lot::Mutex<Bursts>,
    /// Uncached prompt tokens of every request past its first token: the
    /// prefill work done there (as this router knows it), cumulative.
    pub prefilled: AtomicU64,
    /// Marks when `prefilled` last moved: the load version after the one
    /// current then ([`crate::peers::version`]), set before the change is
    /// announced; a peer's report sends the counts marked at or after the
    /// version its asker has ([`crate::peers::report`]).
    pub prefilled_version: AtomicU64,
    /// The recent first tokens behind `prefilled`, with their times, for
    /// the peers' reports (kept only while this replica has peers).
    pub first_tokens: super::FirstTokens,
}

/// First tokens close enough in time to come from one engine step: the
/// ones `SAME_STEP` (2 ms) or less apart. A request's steps start after its
/// whole burst's prefill (the others' prompts were computed before its
/// first token, whichever chunk the router happened to read first).
#[derive(Debug, Default)]
pub struct Bursts {
    /// Numbers the bursts.
    id: u64,
    /// The latest first token's [`clock_micros`].
    last: i64,
    /// [`Load::prefilled`] when the burst before ended.
    prev_end: u64,
}

/// How late a peer's report may tell of its first tokens (twice its
/// fastest poll, [`crate::peers::MIN_GAP`]), microseconds.
const PEER_LAG: i64 = 2 * crate::peers::MIN_GAP.as_micros() as i64;

/// First tokens read this close are taken to come from one engine step:
/// an engine's step takes milliseconds, its chunks of one step reach the
/// router within microseconds of each other.
const SAME_STEP: i64 = 2_000;

impl Bursts {
    /// A first token at `t`, `count` prefilled tokens before it: the burst
    /// it belongs to.
    fn first_token(&mut self, t: i64, count: u64) -> u64 {
        if self.id == 0 || t - self.last > SAME_STEP {
            self.id += 1;
            self.prev_end = count;
        }
        self.last = self.last.max(t);
        self.id
    }

    /// The prefilled count at the end of burst `id`, now that it is `now`;
    /// `None` once a later burst has ended too.
    fn end(&self, id: u64, now: u64) -> Option<u64> {
        if self.id == id {
            Some(now)
        } else if self.id == id + 1 {
            Some(self.prev_end)
        } else {
            None
        }
    }
}

/// The scoring clock's reading in nanoseconds.
fn clock_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Microseconds since the process's first call: the clock of
/// [`Bursts`] and step samples.
pub fn clock_micros(at: Instant) -> i64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    i64::try_from(at.saturating_duration_since(epoch).as_micros()).unwrap_or(i64::MAX)
}

/// Other replicas' load on an endpoint (the same five figures).
#[derive(Debug, Default)]
pub struct PeerLoad {
    /// Requests in flight.
    pub requests: AtomicU32,
    /// Of which before their first token.
    pub prefilling: AtomicU32,
    /// Their uncached prompt tokens.
    pub prefill_tokens: AtomicU64,
    /// Requests decoding.
    pub decoding: AtomicU32,
    /// Prompt tokens of the requests in flight.
    pub context_tokens: AtomicU64,
    /// What the peers reported prefilled here since this router heard
    /// from them, cumulative ([`crate::peers::CountsSeen`]).
    pub prefilled: AtomicU64,
    /// Whether a fresh peer does not report what it prefilled (an older
    /// version).
    pub prefilled_unknown: AtomicBool,
    /// The peers' first tokens here, on this replica's clock.
    pub first_tokens: super::PeerFirstTokens,
    /// Whether a fresh peer does not report when its first tokens came
    /// (an older version).
    pub times_unknown: AtomicBool,
    /// The requests the peers reported sending here, as an
    /// [`ArrivalRate`]: its count's bits, and its time (ns since the
    /// router started, the scoring clock). Written only under the peer
    /// poller's lock; a decision may read the two halves of different
    /// updates, which moves the rate by one report's worth at most.
    arrivals: AtomicU64,
    arrivals_at: AtomicU64,
}

impl PeerLoad {
    /// What the peers prefilled here, if they all say.
    pub fn prefilled(&self) -> Option<u64> {
        (!self.prefilled_unknown.load(Ordering::Relaxed))
            .then(|| self.prefilled.load(Ordering::Relaxed))
    }

    /// A peer reported `n` more tokens prefilled here.
    pub fn add_prefilled(&self, n: u64) {
        self.prefilled.fetch_add(n, Ordering::Relaxed);
    }

    /// Whether every fresh peer reports what it prefilled.
    pub fn prefilled_known(&self, known: bool) {
        self.prefilled_unknown.store(!known, Ordering::Relaxed);
    }

    /// Whether every fresh peer reports when its first tokens came.
    pub fn times_known(&self, known: bool) {
        self.times_unknown.store(!known, Ordering::Relaxed);
    }

    fn arrivals(&self) -> ArrivalRate {
        ArrivalRate {
            count: f64::from_bits(self.arrivals.load(Ordering::Relaxed)),
            at_nanos: self.arrivals_at.load(Ordering::Relaxed),
        }
    }

    /// The peers reported `n` more requests sent here, at `now` (the
    /// scoring clock). Callers hold the peer poller's lock.
    pub fn add_arrivals(&self, now: Duration, n: u64) {
        let mut r = self.arrivals();
        r.add(clock_nanos(now), n as f64);
        self.arrivals.store(r.count.to_bits(), Ordering::Relaxed);
        self.arrivals_at.store(r.at_nanos, Ordering::Relaxed);
    }

    /// The rate (per ms) the peers have been sending requests here
    /// lately, at `now` (the scoring clock).
    pub fn arrival_rate(&self, now: Duration) -> f64 {
        self.arrivals().per_ms(clock_nanos(now))
    }

    /// Reads the figures.
    pub fn snapshot(&self) -> LoadSnapshot {
        LoadSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            prefilling: self.prefilling.load(Ordering::Relaxed),
            prefill_tokens: self.prefill_tokens.load(Ordering::Relaxed),
            decoding: self.decoding.load(Ordering::Relaxed),
            context_tokens: self.context_tokens.load(Ordering::Relaxed),
        }
    }

    /// Sets the figures (`None`: no fresh peer report: zeros).
    pub fn set(&self, s: Option<LoadSnapshot>) {
        let s = s.unwrap_or_default();
        self.requests.store(s.requests, Ordering::Relaxed);
        self.prefilling.store(s.prefilling, Ordering::Relaxed);
        self.prefill_tokens
            .store(s.prefill_tokens, Ordering::Relaxed);
        self.decoding.store(s.decoding, Ordering::Relaxed);
        self.context_tokens
            .store(s.context_tokens, Ordering::Relaxed);
    }
}

/// Requests this router tracks per endpoint while they wait for their first
/// token (the oldest of them is the evidence; see [`Waiting`]).
pub const WAITING_SLOTS: usize = 32;

const PREDICTED_BITS: u32 = 24;
const MARK_BITS: u32 = 39;
const MARK_MASK: u64 = (1 << MARK_BITS) - 1;
const IDLE_BIT: u64 = 1 << MARK_BITS;
const STEP_SHIFT: u32 = MARK_BITS + 1;
const STEP_MASK: u64 = (1 << (64 - STEP_SHIFT)) - 1;

/// What [`Waiting`] noted of a request when it was sent, beside its send
/// time and prediction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mark {
    /// The endpoint's [`Endpoint::kv_stored_steps`] then (the low 39 bits).
    pub stored_steps: u64,
    /// Its predicted mean engine step (zero: unknown).
    pub step: Duration,
    /// Whether this router had nothing else in flight there then (so no
    /// step of its own was under way when the request came).
    pub idle: bool,
}

impl Mark {
    /// Storing steps since, given the endpoint's count now (the low 39
    /// bits of both, so a count past 2^39 wraps without harm).
    pub fn steps_since(&self, now: u64) -> u64 {
        (now & MARK_MASK).wrapping_sub(self.stored_steps) & MARK_MASK
    }
}
const PREDICTED_MASK: u64 = (1 << PREDICTED_BITS) - 1;
const SENT_MAX: u64 = (1 << (64 - PREDICTED_BITS)) - 2;

/// The router's requests at an endpoint that have no first token yet: when
/// each was sent and what was predicted for it, so that decisions can read
/// the oldest one's age as evidence about the engine now
/// ([`kinference_scoring::Evidence`]). Lock-free: a fixed set of slots, each
/// one atomic word (sent, ms since the router started, + 1, in 40 bits;
/// predicted TTFT, ms, in 24), claimed at send and cleared at the first
/// token or the end. When
/// every slot is taken a new request goes untracked: the oldest ones, which
/// are what counts, already hold slots.
#[derive(Debug, Default)]
pub struct Waiting {
    slots: [AtomicU64; WAITING_SLOTS],
    /// Beside each slot, the endpoint's count of storing steps
    /// ([`Endpoint::kv_stored_steps`]) when the request was sent (40 bits)
    /// and its predicted mean step (tenths of a millisecond, 24 bits; 0:
    /// unknown). Written after the slot is claimed: for that instant a
    /// reader may see the previous occupant's, whose count is never larger
    /// (it only grows), so the race can only make the engine look faster.
    marks: [AtomicU64; WAITING_SLOTS],
}

impl Waiting {
    fn claim(&self, sent: Duration, predicted: Duration, mark: Mark) -> Option<usize> {
        // 40 bits of send time (34 years of uptime), 24 of prediction
        // (4.6 hours, clamped).
        let sent_ms = u64::try_from(sent.as_millis())
            .unwrap_or(u64::MAX)
            .min(SENT_MAX)
            + 1;
        let predicted_ms = u64::try_from(predicted.as_millis())
            .unwrap_or(u64::MAX)
            .min(PREDICTED_MASK);
        let word = (sent_ms << PREDICTED_BITS) | predicted_ms;
        let slot = self.slots.iter().position(|s| {
            s.compare_exchange(0, word, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        })?;
        if let Some(m) = self.marks.get(slot) {
            let step = u64::try_from(mark.step.as_micros() / 100)
                .unwrap_or(u64::MAX)
                .min(STEP_MASK);
            let idle = if mark.idle { IDLE_BIT } else { 0 };
            m.store(
                (step << STEP_SHIFT) | idle | (mark.stored_steps & MARK_MASK),
                Ordering::Relaxed,
            );
        }
        Some(slot)
    }

    fn release(&self, slot: usize) {
        if let Some(s) = self.slots.get(slot) {
            s.store(0, Ordering::Relaxed);
        }
    }

    /// The oldest tracked request's `(age at now, predicted TTFT)`, `now`
    /// being the time since the router started.
    pub fn oldest(&self, now: Duration) -> Option<(Duration, Duration)> {
        self.oldest_marked(now)
            .map(|(age, predicted, _)| (age, predicted))
    }

    /// [`Waiting::oldest`] with what was noted when that request was sent.
    pub fn oldest_marked(&self, now: Duration) -> Option<(Duration, Duration, Mark)> {
        let (slot, word) = self
            .slots
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .enumerate()
            .filter(|&(_, w)| w != 0)
            .min_by_key(|&(_, w)| w)?;
        let sent = Duration::from_millis((word >> PREDICTED_BITS) - 1);
        let predicted = Duration::from_millis(word & PREDICTED_MASK);
        let mark = self
            .marks
            .get(slot)
            .map_or(0, |m| m.load(Ordering::Relaxed));
        let mark = Mark {
            stored_steps: mark & MARK_MASK,
            step: Duration::from_micros((mark >> STEP_SHIFT) * 100),
            idle: mark & IDLE_BIT != 0,
        };
        Some((now.saturating_sub(sent), predicted, mark))
    }
}

/// A point-in-time copy of [`Load`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LoadSnapshot {
    /// Requests in flight.
    pub requests: u32,
    /// Of which before their first token.
    pub prefilling: u32,
    /// Their uncached prompt tokens.
    pub prefill_tokens: u64,
    /// Requests decoding.
    pub decoding: u32,
    /// Prompt tokens of the requests in flight.
    pub context_tokens: u64,
}

impl Load {
    /// The load the routers have on the endpoint: this replica's and what
    /// its peers report (what decisions read).
    pub fn snapshot(&self) -> LoadSnapshot {
        self.own().plus(self.peers.snapshot())
    }

    /// The peers' figures alone.
    pub fn peers_snapshot(&self) -> LoadSnapshot {
        self.peers.snapshot()
    }

    /// This replica's own counters (what it reports to its peers and in
    /// its metrics).
    pub fn own(&self) -> LoadSnapshot {
        LoadSnapshot {
            requests: self.requests.load(Ordering::Relaxed),
            prefilling: self.prefilling.load(Ordering::Relaxed),
            prefill_tokens: self.prefill_tokens.load(Ordering::Relaxed),
            decoding: self.decoding.load(Ordering::Relaxed),
            context_tokens: self.context_tokens.load(Ordering::Relaxed),
        }
    }
}

impl LoadSnapshot {
    /// Both together (saturating).
    #[must_use]
    pub fn plus(self, o: Self) -> Self {
        Self {
            requests: self.requests.saturating_add(o.requests),
            prefilling: self.prefilling.saturating_add(o.prefilling),
            prefill_tokens: self.prefill_tokens.saturating_add(o.prefill_tokens),
            decoding: self.decoding.saturating_add(o.decoding),
            context_tokens: self.context_tokens.saturating_add(o.context_tokens),
        }
    }
}

impl Endpoint {
    /// Counts a request as sent: prefilling `prefill_tokens` uncached tokens
    /// of a `context_tokens`-token prompt.
    pub fn begin(self: &Arc<Self>, prefill_tokens: u64, context_tokens: u64) -> InFlight {
        self.load.requests.fetch_add(1, Ordering::Relaxed);
        self.load.sent.fetch_add(1, Ordering::SeqCst);
        self.load
            .sent_version
            .fetch_max(crate::peers::version() + 1, Ordering::SeqCst);
        self.load
            .context_tokens
            .fetch_add(context_tokens, Ordering::Relaxed);
        self.load.prefilling.fetch_add(1, Ordering::Relaxed);
        self.load
            .prefill_tokens
            .fetch_add(prefill_tokens, Ordering::Relaxed);
        crate::peers::load_changed();
        InFlight {
            endpoint: self.clone(),
            prefill_tokens,
            context_tokens,
            phase: Phase::Prefilling,
            waiting_slot: None,
            adapter: None,
            decode_mark: None,
        }
    }
}

/// Where a request's decoding started, to measure its steps at the end.
#[derive(Clone, Copy, Debug)]
struct DecodeMark {
    /// [`clock_micros`] at the first token.
    at: i64,
    /// [`Load::prefilled`] then (its own prompt included), moved up at its
    /// next chunk to the end of its burst: requests whose first token came
    /// in the same engine step, read after its own, were prefilled before
    /// its decoding.
    prefilled: u64,
    /// Its burst ([`Bursts::first_token`]).
    burst: u64,
    /// Whether `prefilled` was moved up.
    settled: bool,
    /// Sequences decoding there (this router's and its peers'), summed
    /// over the chunks after the first: each chunk ends a step, and the
    /// count then is the next step's batch. Averaged per chunk, not per
    /// unit of time: a long prefill step beside few decodes would
    /// otherwise weigh in as many steps.
    decoding_sum: u64,
    /// The chunks summed.
    reads: u32,
    /// [`PeerLoad::prefilled`] at the first chunk [`PEER_LAG`] after the
    /// first token, if the peers say: their reports of first tokens that
    /// came in the same engine step as this one arrive up to a poll late.
    peers_prefilled: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Prefilling,
    Decoding,
}

/// One request's share of an endpoint's load; releases it when dropped.
#[derive(Debug)]
pub struct InFlight {
    endpoint: Arc<Endpoint>,
    prefill_tokens: u64,
    context_tokens: u64,
    phase: Phase,
    /// Its slot in the endpoint's [`Waiting`] until the first token.
    waiting_slot: Option<usize>,
    /// The LoRA adapter it names, counted in the endpoint's adapters.
    adapter: Option<Arc<str>>,
    /// Set at the first token.
    decode_mark: Option<DecodeMark>,
}

impl InFlight {
    /// Counts the request as one for `adapter` there until it ends.
    pub fn for_adapter(&mut self, adapter: &Arc<str>) {
        if self.adapter.is_none() {
            self.endpoint.adapters.begin(adapter);
            self.adapter = Some(adapter.clone());
        }
    }

    /// Tracks the request as waiting for its first token since `sent` (time
    /// since the router started), predicted to take `predicted`.
    pub fn waiting_since(&mut self, sent: Duration, predicted: Duration) {
        self.waiting_since_stepped(sent, predicted, Duration::ZERO, false);
    }

    /// [`InFlight::waiting_since`], with the engine step predicted for it
    /// ([`kinference_scoring::Prediction::mean_step_ms`]) and whether the
    /// router had nothing else in flight there (`idle`): the endpoint's KV
    /// events then count as evidence while it waits.
    pub fn waiting_since_stepped(
        &mut self,
        sent: Duration,
        predicted: Duration,
        step: Duration,
        idle: bool,
    ) {
        if self.phase == Phase::Prefilling && self.waiting_slot.is_none() {
            let mark = Mark {
                stored_steps: self.endpoint.kv_stored_steps(),
                step,
                idle,
            };
            self.waiting_slot = self.endpoint.waiting.claim(sent, predicted, mark);
        }
    }

    fn stop_waiting(&mut self) {
        if let Some(slot) = self.waiting_slot.take() {
            self.endpoint.waiting.release(slot);
        }
    }

    /// The endpoint this request went to.
    pub fn endpoint(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }

    /// The first token arrived (or is assumed to have): prefill work is done.
    /// Idempotent; call it on every chunk of the response.
    pub fn first_token(&mut self) {
        if let Some(mark) = &mut self.decode_mark {
            let l = &self.endpoint.load;
            if !mark.settled {
                let bursts = l.bursts.lock();
                let now = l.prefilled.load(Ordering::Relaxed);
                if let Some(end) = bursts.end(mark.burst, now) {
                    mark.prefilled = mark.prefilled.max(end);
                }
                mark.settled = true;
            }
            if mark.peers_prefilled.is_none()
                && let Some(p) = l.peers.prefilled()
                && clock_micros(Instant::now()) - mark.at >= PEER_LAG
            {
                mark.peers_prefilled = Some(p);
            }
            let decoding = l.decoding.load(Ordering::Relaxed);
            let peers = l.peers.decoding.load(Ordering::Relaxed);
            mark.decoding_sum += u64::from(decoding) + u64::from(peers);
            mark.reads += 1;
            return;
        }
        self.stop_waiting();
        if self.phase == Phase::Prefilling {
            let l = &self.endpoint.load;
            l.prefilling.fetch_sub(1, Ordering::Relaxed);
            l.prefill_tokens
                .fetch_sub(self.prefill_tokens, Ordering::Relaxed);
            let t = clock_micros(Instant::now());
            let mut bursts = l.bursts.lock();
            let before = l.prefilled.fetch_add(self.prefill_tokens, Ordering::SeqCst);
            let mark = crate::peers::version() + 1;
            l.prefilled_version.fetch_max(mark, Ordering::SeqCst);
            if crate::peers::sharing() {
                l.first_tokens.push(mark, t, before + self.prefill_tokens);
            }
            let burst = bursts.first_token(t, before);
            drop(bursts);
            l.decoding.fetch_add(1, Ordering::Relaxed);
            self.decode_mark = Some(DecodeMark {
                at: t,
                prefilled: before + self.prefill_tokens,
                burst,
                settled: false,
                decoding_sum: 0,
                reads: 0,
                peers_prefilled: None,
            });
            self.phase = Phase::Decoding;
            crate::admit::capacity_freed();
            crate::peers::load_changed();
        }
    }

    /// Whether the first token has been seen.
    pub fn past_first_token(&self) -> bool {
        self.phase == Phase::Decoding
    }

    /// The engine's steps since the first token, now that `tokens` more
    /// have come ([`kinference_scoring::steps`]), to be read once the
    /// peers have had time to report the window's end
    /// ([`StepWindow::settle`]). `None` before the first token.
    pub fn step_window(&self, tokens: u32) -> Option<StepWindow> {
        let mark = self.decode_mark?;
        let t = clock_micros(Instant::now());
        let elapsed = t.checked_sub(mark.at).filter(|&e| e > 0)?;
        let l = &self.endpoint.load;
        let decoding = if mark.reads == 0 {
            1.0
        } else {
            mark.decoding_sum as f64 / f64::from(mark.reads)
        };
        let own = l
            .prefilled
            .load(Ordering::Relaxed)
            .saturating_sub(mark.prefilled) as f64;
        let untimed = if let (Some(then), Some(now)) = (mark.peers_prefilled, l.peers.prefilled()) {
            own + now.saturating_sub(then) as f64
        } else {
            let mine = f64::from(l.requests.load(Ordering::Relaxed).max(1));
            let peers = f64::from(l.peers.requests.load(Ordering::Relaxed));
            own * (mine + peers) / mine
        };
        Some(StepWindow {
            endpoint: self.endpoint.clone(),
            from: mark.at,
            to: t,
            sample: kinference_scoring::StepSample {
                tokens,
                millis: elapsed as f64 / 1e3,
                decoding: decoding.max(1.0),
                prefill_tokens: own,
            },
            untimed,
        })
    }
}

/// A finished stream's engine steps: the time, the sequences decoding
/// there on average over its chunks (this router's and, as they reported
/// them, its peers'), and the prompt tokens prefilled there meanwhile.
///
/// The peers' prefill is what they report of first tokens that came
/// between this stream's first token (and its engine step, [`SAME_STEP`])
/// and its last, dated by the age the reports give them: exact however
/// late a report comes, once it has come ([`StepWindow::settle`]). A peer
/// too old to date them leaves what they reported between a chunk
/// `PEER_LAG` (40 ms) after the first token and the last (their reports
/// come up to a poll late, at both ends alike); one that does not report
/// its prefill at all leaves this router's count scaled by the routers'
/// requests there over its own.
#[derive(Debug)]
pub struct StepWindow {
    endpoint: Arc<Endpoint>,
    /// [`clock_micros`] at the first token and at the last.
    from: i64,
    to: i64,
    /// The sample with this router's own prefill.
    sample: kinference_scoring::StepSample,
    /// The prefill counted without the peers' times.
    untimed: f64,
}

impl StepWindow {
    /// How long to wait before [`StepWindow::sample`] for the peers'
    /// reports of first tokens up to the last to arrive; `None` without
    /// peers.
    pub fn settle(&self) -> Option<Duration> {
        crate::peers::sharing().then(|| Duration::from_micros(PEER_LAG.unsigned_abs()))
    }

    /// The steps, with what the peers reported so far.
    pub fn sample(&self) -> kinference_scoring::StepSample {
        let p = &self.endpoint.load.peers;
        let timed = (!p.times_unknown.load(Ordering::Relaxed))
            .then(|| p.first_tokens.after_step(self.from, self.to, SAME_STEP))
            .flatten();
        kinference_scoring::StepSample {
            prefill_tokens: timed.map_or(self.untimed, |n| self.sample.prefill_tokens + n as f64),
            ..self.sample
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.stop_waiting();
        if let Some(a) = self.adapter.take() {
            self.endpoint.adapters.end(&a);
        }
        let l = &self.endpoint.load;
        match self.phase {
            Phase::Prefilling => {
                l.prefilling.fetch_sub(1, Ordering::Relaxed);
                l.prefill_tokens
                    .fetch_sub(self.prefill_tokens, Ordering::Relaxed);
            }
            Phase::Decoding => {
                l.decoding.fetch_sub(1, Ordering::Relaxed);
            }
        }
        l.context_tokens
            .fetch_sub(self.context_tokens, Ordering::Relaxed);
        l.requests.fetch_sub(1, Ordering::Relaxed);
        crate::admit::capacity_freed();
        crate::peers::load_changed();
    }
}

#[cfg(test)]
mod tests;
