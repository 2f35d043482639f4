//! Runs an [`EngineCore`] in time: one tokio task per engine core that
//! sleeps until the current step is due, never spins.
//!
//! The loop: schedule a step at `start`, sleep until `start + duration ×
//! slowdown`, apply the step, publish the step's events, hand each request
//! its token (in vLLM's order, see [`end_step`]), repeat; with nothing to run, wait for a request. Steps are
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

use crate::engine::{AdmitError, EngineCore, NewRequest, ReqId, Scheduled, SimEvent, StepOut};
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
                end_step(&mut st, &step, t, |events| {
                    if let Some(p) = &self.publisher {
                        p.publish(events);
                    }
                });
            }
            planned = Some(end);
        }
        // Whoever still waits gets an abrupt end.
        self.kill_all();
    }
}

/// vLLM's `update_from_output()` for a step that has run: the step's
/// events go to `publish` first, then each request gets its output. vLLM
/// publishes the step's batch before it returns the step's outputs, so
/// whoever has seen a token (a client with its response) knows the batch
/// of that step, e.g. the `BlockRemoved` of a block its last decode step
/// evicted, is already with the publisher.
fn end_step(st: &mut RankState, step: &Scheduled, t: f64, publish: impl FnOnce(Vec<SimEvent>)) {
    let outs = st.core.finish_step(step, t);
    publish(st.core.take_events());
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{EngineConfig, LatencyModel, OutputLen};
    use crate::mode::EngineMode;
    use crate::textgen::SimTokenizer;

    /// A request's outputs reach it only after its step's batch went to
    /// the publisher. Two requests of 2 blocks (and 2 tokens) each on 3
    /// usable blocks: the second one's decode step evicts a block of the
    /// first, a batch of one `BlockRemoved` that comes with its last token.
    /// Handing the token over first let a client (the router test
    /// `kv_events`) read the router's index before that removal was even
    /// queued: the index still claimed the block the engine had evicted.
    #[test]
    fn a_steps_batch_is_published_before_its_outputs_are_delivered() {
        let core = EngineCore::new(
            EngineConfig {
                num_gpu_blocks: 4,
                ..EngineConfig::default()
            },
            EngineMode::default(),
            LatencyModel::default(),
            OutputLen::default(),
            32_768,
            42,
            SimTokenizer::word_level(),
        );
        let mut st = RankState {
            core,
            sinks: HashMap::new(),
        };
        let bs = EngineConfig::default().block_size as u32;
        let mut last_batch = Vec::new();
        for n in 0..2u32 {
            let prompt: Vec<u32> = (0..2 * bs).map(|i| 100 + 1000 * n + i).collect();
            let req = NewRequest {
                prompt,
                max_tokens: Some(2),
                ..NewRequest::default()
            };
            let id = st.core.add_request(req, 0.0).expect("admitted");
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            st.sinks.insert(id, tx);
            let mut t = 0.0;
            let mut finished = false;
            while !finished {
                let step = st.core.schedule(t).expect("a step to run");
                t += step.duration;
                let mut batch = Vec::new();
                end_step(&mut st, &step, t, |events| {
                    assert!(
                        rx.try_recv().is_err(),
                        "an output was delivered before its step's batch was published"
                    );
                    batch = events;
                });
                while let Ok(Out::Step(o)) = rx.try_recv() {
                    finished |= o.finished.is_some();
                }
                last_batch = batch;
            }
        }
        // The batch of the second request's last step: one eviction.
        assert!(
            matches!(last_batch.as_slice(), [SimEvent::Removed { .. }]),
            "{last_batch:?}"
        );
    }
}
