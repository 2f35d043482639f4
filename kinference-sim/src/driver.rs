//! Runs an [`EngineCore`] in time: one tokio task per engine core that
//! sleeps until the current step is due, never spins.
//!
//! The loop: schedule a step at `start`, sleep until `start + duration ×
//! slowdown`, apply the step, hand each request its token, publish the
//! step's events, repeat; with nothing to run, wait for a request. Steps are
//! chained on *planned* end times (a step that starts right after another
//! starts at the other's planned end, not at the late wake-up), so timer
//! granularity (≈1 ms) adds jitter to delivery but no drift to the
//! simulated clock.
//!
//! Engine time is seconds since the engine started, read from
//! `tokio::time::Instant`, so tests on a paused runtime are exact.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, mpsc, watch};
use tokio::time::Instant;

use crate::engine::{AdmitError, EngineCore, NewRequest, ReqId, StepOut};
use crate::events::Publisher;

/// Late wake-ups up to this long still chain on the planned step end.
const SLACK: Duration = Duration::from_millis(3);

/// What a request's receiver gets.
#[derive(Debug)]
pub(crate) enum Out {
    /// A token (and possibly the end).
    Step(StepOut),
    /// The request was killed by a fault: end the response abruptly.
    Killed,
}

pub(crate) type Sink = mpsc::UnboundedSender<Out>;

/// The mutable part of a rank, behind one lock.
#[derive(Debug)]
pub(crate) struct RankState {
    pub(crate) core: EngineCore,
    pub(crate) sinks: HashMap<ReqId, Sink>,
}

/// One engine core (DP rank) and its publisher.
#[derive(Debug)]
pub(crate) struct Rank {
    pub(crate) index: u32,
    state: Mutex<RankState>,
    notify: Notify,
    pub(crate) publisher: Option<Publisher>,
    epoch: Instant,
    slowdown_bits: AtomicU64,
    stall_until: Mutex<Option<Instant>>,
}

impl Rank {
    pub(crate) fn new(
        rank: u32,
        core: EngineCore,
        publisher: Option<Publisher>,
        epoch: Instant,
        slowdown: f64,
    ) -> Self {
        Rank {
            index: rank,
            state: Mutex::new(RankState {
                core,
                sinks: HashMap::new(),
            }),
            notify: Notify::new(),
            publisher,
            epoch,
            slowdown_bits: AtomicU64::new(slowdown.to_bits()),
            stall_until: Mutex::new(None),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, RankState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Engine time of an instant.
    pub(crate) fn secs(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.epoch).as_secs_f64()
    }

    /// Engine time now.
    pub(crate) fn now(&self) -> f64 {
        self.secs(Instant::now())
    }

    /// Queues a request; its tokens arrive on the returned receiver.
    pub(crate) fn submit(
        &self,
        req: NewRequest,
    ) -> Result<(ReqId, mpsc::UnboundedReceiver<Out>), AdmitError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let now = self.now();
        let id = {
            let mut st = self.lock();
            let id = st.core.add_request(req, now)?;
            st.sinks.insert(id, tx);
            id
        };
        self.notify.notify_one();
        Ok((id, rx))
    }

    /// Aborts a request (client gone).
    pub(crate) fn abort(&self, id: ReqId) {
        {
            let mut st = self.lock();
            if st.sinks.remove(&id).is_none() {
                return; // already finished
            }
            st.core.abort(id);
        }
        self.notify.notify_one();
    }

    /// vLLM's load-balancing score: `4 × waiting + running`.
    pub(crate) fn load_score(&self) -> usize {
        let st = self.lock();
        4 * st.core.num_waiting() + st.core.num_running()
    }

    /// Resets the prefix cache if idle; the `AllBlocksCleared` batch is
    /// published in order with the step batches.
    pub(crate) fn reset_prefix_cache(&self) -> bool {
        let mut st = self.lock();
        let ok = st.core.reset_prefix_cache();
        if ok && let Some(p) = &self.publisher {
            p.publish(st.core.take_events());
        }
        ok
    }

    /// Ends every in-flight request abruptly. Returns how many.
    pub(crate) fn kill_all(&self) -> usize {
        let n = {
            let mut st = self.lock();
            for (_, sink) in st.sinks.drain() {
                let _ = sink.send(Out::Killed);
            }
            let now = self.now();
            st.core.abort_all(now).len()
        };
        self.notify.notify_one();
        n
    }

    pub(crate) fn slowdown(&self) -> f64 {
        f64::from_bits(self.slowdown_bits.load(Ordering::Relaxed))
    }

    pub(crate) fn set_slowdown(&self, factor: f64) {
        self.slowdown_bits
            .store(factor.to_bits(), Ordering::Relaxed);
    }

    /// Stops stepping for `d` (`Duration::ZERO` ends a stall).
    pub(crate) fn stall(&self, d: Duration) {
        *self
            .stall_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            (!d.is_zero()).then(|| Instant::now() + d);
        self.notify.notify_one();
    }

    pub(crate) fn stalled_until(&self) -> Option<Instant> {
        let until = *self
            .stall_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        until.filter(|u| *u > Instant::now())
    }

    /// The engine loop. Ends when `shutdown` flips.
    pub(crate) async fn drive(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let mut planned: Option<Instant> = None;
        loop {
            if *shutdown.borrow() {
                break;
            }
            if let Some(until) = self.stalled_until() {
                planned = None;
                tokio::select! {
                    () = tokio::time::sleep_until(until) => {}
                    () = self.notify.notified() => {}
                    _ = shutdown.changed() => break,
                }
                continue;
            }
            let now = Instant::now();
            let start = match planned {
                Some(p) if now.saturating_duration_since(p) <= SLACK => p,
                _ => now,
            };
            let step = self.lock().core.schedule(self.secs(start));
            let Some(step) = step else {
                planned = None;
                tokio::select! {
                    () = self.notify.notified() => {}
                    _ = shutdown.changed() => break,
                }
                continue;
            };
            let end = start + Duration::from_secs_f64(step.duration * self.slowdown());
            tokio::select! {
                () = tokio::time::sleep_until(end) => {}
                _ = shutdown.changed() => break,
            }
            {
                let mut st = self.lock();
                let t = self.secs(end);
                let outs = st.core.finish_step(&step, t);
                for o in outs {
                    let id = o.id;
                    let last = o.finished.is_some();
                    if let Some(sink) = st.sinks.get(&id) {
                        let _ = sink.send(Out::Step(o));
                    }
                    if last {
                        st.sinks.remove(&id);
                    }
                }
                let events = st.core.take_events();
                if let Some(p) = &self.publisher {
                    p.publish(events);
                }
            }
            planned = Some(end);
        }
        // Whoever still waits gets an abrupt end.
        self.kill_all();
    }
}
