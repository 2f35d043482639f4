//! KV-event windows in the background, one worker set at a time, their
//! results kept per worker set.
//!
//! A window lasts seconds ([`crate::probe::Prober::probe_kv`]), so the
//! reconciler never awaits one. It asks [`KvWatch::state`] instead, which
//! returns at once what the windows so far say and starts a window when one
//! is due: when there is none yet, when the watched endpoint changed, or
//! `interval` after the last one ended. A finished window is merged into the
//! worker set's observation ([`KvObservation::merge`]) and the worker set is
//! queued for a reconcile, which turns it into diagnoses.
//!
//! # Invariants
//!
//! - At most one window runs per worker set, and at most
//!   [`MAX_CONCURRENT_WINDOWS`] in all (the others wait for a slot).
//! - While a new window runs, the previous observation stands (no diagnosis
//!   disappears just because a window is in flight).
//! - A worker set forgotten (deleted, `kvEvents` unset, no ready endpoint)
//!   has its window aborted; a window that ends after its worker set was
//!   forgotten, or restarted, is dropped.
//!
//! Cost: one map entry per worker set with `kvEvents`; per window, what
//! [`crate::probe`] lists.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::channel::mpsc::UnboundedSender;
use kinference_api::InferenceWorkerSet;
use kube::runtime::reflector::ObjectRef;
use tokio::sync::Semaphore;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::metrics::Metrics;
use crate::probe::{KvObservation, KvProbe, KvTarget, ProbeTarget, Prober};

/// Windows running at once, over all worker sets.
pub const MAX_CONCURRENT_WINDOWS: usize = 32;

type Key = (String, String);

struct Record {
    /// What the last window started watches.
    target: KvTarget,
    /// `kvBlockSize` now (merging compares traffic with it).
    kv_block_size: u32,
    /// What the windows so far say.
    observation: Option<KvObservation>,
    /// When the last window ended.
    finished: Option<Instant>,
    /// The window in flight: its number and a handle to abort it.
    running: Option<(u64, AbortHandle)>,
    /// Windows finished.
    windows: u64,
}

impl Drop for Record {
    fn drop(&mut self) {
        if let Some((_, h)) = &self.running {
            h.abort();
        }
    }
}

/// The background KV windows of every worker set.
pub struct KvWatch {
    prober: Arc<dyn Prober>,
    interval: Duration,
    done: UnboundedSender<ObjectRef<InferenceWorkerSet>>,
    metrics: Metrics,
    records: Arc<Mutex<HashMap<Key, Record>>>,
    slots: Arc<Semaphore>,
    next: AtomicU64,
}

impl std::fmt::Debug for KvWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvWatch")
            .field("interval", &self.interval)
            .field("worker_sets", &lock(&self.records).len())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Single inserts and field writes: a poisoned map is still consistent.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl KvWatch {
    /// Windows by `prober`, each worker set's repeated `interval` after the
    /// last ended; finished windows queue their worker set on `done`.
    pub fn new(
        prober: Arc<dyn Prober>,
        interval: Duration,
        done: UnboundedSender<ObjectRef<InferenceWorkerSet>>,
        metrics: Metrics,
    ) -> Self {
        KvWatch {
            prober,
            interval,
            done,
            metrics,
            records: Arc::new(Mutex::new(HashMap::new())),
            slots: Arc::new(Semaphore::new(MAX_CONCURRENT_WINDOWS)),
            next: AtomicU64::new(0),
        }
    }

    /// What is known about the KV events of worker set `ns/name`, whose
    /// probe target is `target`, starting a window in the background when
    /// one is due; and how long until the next is due (`None` while one
    /// runs, or when there is nothing to watch).
    ///
    /// Must be called inside a tokio runtime.
    pub fn state(&self, ns: &str, name: &str, target: &ProbeTarget) -> (KvProbe, Option<Duration>) {
        let key = (ns.to_owned(), name.to_owned());
        if !target.kv_events {
            lock(&self.records).remove(&key);
            return (KvProbe::NotConfigured, None);
        }
        let Some(kv) = target.kv_target() else {
            lock(&self.records).remove(&key);
            return (KvProbe::NotProbed, None);
        };
        let mut records = lock(&self.records);
        let rec = records.entry(key.clone()).or_insert_with(|| Record {
            target: kv.clone(),
            kv_block_size: target.kv_block_size,
            observation: None,
            finished: None,
            running: None,
            windows: 0,
        });
        rec.kv_block_size = target.kv_block_size;
        let since = rec.finished.map(|f| f.elapsed());
        let due =
            rec.running.is_none() && (rec.target != kv || since.is_none_or(|s| s >= self.interval));
        if due {
            rec.target = kv.clone();
            rec.running = Some(self.start(key, kv));
        }
        let state = rec
            .observation
            .clone()
            .map_or(KvProbe::NotProbed, KvProbe::Observed);
        let next = match (&rec.running, since) {
            (None, Some(s)) => Some(self.interval.saturating_sub(s)),
            _ => None,
        };
        (state, next)
    }

    fn start(&self, key: Key, target: KvTarget) -> (u64, AbortHandle) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let prober = self.prober.clone();
        let records = self.records.clone();
        let slots = self.slots.clone();
        let done = self.done.clone();
        let metrics = self.metrics.clone();
        let task = tokio::spawn(async move {
            let Ok(_slot) = slots.acquire().await else {
                return;
            };
            let started = Instant::now();
            let observation = prober.probe_kv(&target).await;
            metrics.probed_kv(&observation, started.elapsed());
            {
                let mut records = lock(&records);
                let Some(rec) = records.get_mut(&key) else {
                    return;
                };
                if rec.running.as_ref().map(|(i, _)| *i) != Some(id) {
                    return;
                }
                rec.observation = Some(KvObservation::merge(
                    rec.observation.take(),
                    observation,
                    rec.kv_block_size,
                ));
                rec.finished = Some(Instant::now());
                rec.running = None;
                rec.windows += 1;
            }
            let (ns, name) = key;
            let _ = done.unbounded_send(ObjectRef::new(&name).within(&ns));
        });
        (id, task.abort_handle())
    }

    /// Drops what is known about `ns/name`, aborting its window.
    pub fn forget(&self, ns: &str, name: &str) {
        lock(&self.records).remove(&(ns.to_owned(), name.to_owned()));
    }

    /// Aborts every window and forgets everything (shutdown).
    pub fn clear(&self) {
        lock(&self.records).clear();
    }

    /// Windows finished for `ns/name` (for tests and debugging).
    pub fn windows(&self, ns: &str, name: &str) -> u64 {
        lock(&self.records)
            .get(&(ns.to_owned(), name.to_owned()))
            .map_or(0, |r| r.windows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::ReadyEndpoint;
    use crate::probe::{EndpointModels, KvWindow};
    use futures::StreamExt;
    use futures::future::BoxFuture;
    use prometheus_client::registry::Registry;
    use std::collections::BTreeSet;

    /// Answers each window after `delay` with the widths queued, counting
    /// windows.
    struct Scripted {
        delay: Duration,
        widths: Mutex<Vec<u32>>,
        calls: AtomicU64,
    }

    impl Prober for Scripted {
        fn probe_models<'a>(&'a self, _: &'a ProbeTarget) -> BoxFuture<'a, Vec<EndpointModels>> {
            Box::pin(async { Vec::new() })
        }
        fn probe_kv<'a>(&'a self, target: &'a KvTarget) -> BoxFuture<'a, KvObservation> {
            Box::pin(async move {
                self.calls.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(self.delay).await;
                let w = lock(&self.widths).pop();
                KvObservation::Subscribed(KvWindow {
                    publishers: vec![format!("{}:{}", target.address, target.kv_port)],
                    discovered: false,
                    window_ms: 1000,
                    batches: u64::from(w.is_some()),
                    block_sizes: w.into_iter().collect::<BTreeSet<u32>>(),
                    activity: None,
                })
            })
        }
    }

    fn target(addresses: &[&str], kv: bool) -> ProbeTarget {
        ProbeTarget {
            worker_set: "ns/ws".into(),
            endpoints: addresses
                .iter()
                .map(|a| ReadyEndpoint {
                    address: (*a).into(),
                    http_port: 8000,
                    kv_port: Some(5557),
                    replay_port: None,
                    target: None,
                })
                .collect(),
            kv_events: kv,
            kv_block_size: 16,
        }
    }

    fn widths(p: &KvProbe) -> Vec<u32> {
        match p {
            KvProbe::Observed(KvObservation::Subscribed(w)) => {
                w.block_sizes.iter().copied().collect()
            }
            other => panic!("not a window: {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn windows_run_in_the_background_and_queue_a_reconcile() {
        let prober = Arc::new(Scripted {
            delay: Duration::from_secs(3),
            widths: Mutex::new(vec![256]),
            calls: AtomicU64::new(0),
        });
        let (tx, mut rx) = futures::channel::mpsc::unbounded();
        let mut registry = Registry::default();
        let watch = KvWatch::new(
            prober.clone(),
            Duration::from_secs(10),
            tx,
            Metrics::register(&mut registry),
        );
        let t = target(&["10.0.0.2", "10.0.0.1"], true);

        // The first call starts a window and returns at once.
        assert_eq!(watch.state("ns", "ws", &t), (KvProbe::NotProbed, None));
        assert_eq!(watch.state("ns", "ws", &t), (KvProbe::NotProbed, None));
        let queued = rx.next().await.expect("a reconcile is queued");
        assert_eq!(queued, ObjectRef::new("ws").within("ns"));
        assert_eq!(
            prober.calls.load(Ordering::Relaxed),
            1,
            "one window at a time"
        );
        let (state, next) = watch.state("ns", "ws", &t);
        assert_eq!(widths(&state), [256]);
        assert_eq!(next, Some(Duration::from_secs(10)));

        // Not due yet: nothing starts.
        tokio::time::advance(Duration::from_secs(5)).await;
        let (_, next) = watch.state("ns", "ws", &t);
        assert_eq!(next, Some(Duration::from_secs(5)));
        assert_eq!(prober.calls.load(Ordering::Relaxed), 1);

        // Due: an idle window keeps the 256.
        lock(&prober.widths).clear();
        tokio::time::advance(Duration::from_secs(5)).await;
        let (state, next) = watch.state("ns", "ws", &t);
        assert_eq!(widths(&state), [256], "the old result stands meanwhile");
        assert_eq!(next, None, "a window runs");
        rx.next().await.expect("queued again");
        assert_eq!(
            widths(&watch.state("ns", "ws", &t).0),
            [256],
            "idle windows keep it"
        );
        assert_eq!(watch.windows("ns", "ws"), 2);

        // The watched endpoint leaves: a window starts at once.
        lock(&prober.widths).push(16);
        let moved = target(&["10.0.0.3"], true);
        let (state, next) = watch.state("ns", "ws", &moved);
        assert_eq!((widths(&state), next), (vec![256], None));
        rx.next().await.expect("queued");
        assert_eq!(widths(&watch.state("ns", "ws", &moved).0), [16]);
        assert_eq!(prober.calls.load(Ordering::Relaxed), 3);

        // kvEvents unset: forgotten.
        assert_eq!(
            watch.state("ns", "ws", &target(&["10.0.0.3"], false)),
            (KvProbe::NotConfigured, None)
        );
        assert_eq!(watch.windows("ns", "ws"), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_forgotten_worker_set_has_its_window_aborted() {
        let prober = Arc::new(Scripted {
            delay: Duration::from_secs(3),
            widths: Mutex::new(vec![256]),
            calls: AtomicU64::new(0),
        });
        let (tx, mut rx) = futures::channel::mpsc::unbounded();
        let mut registry = Registry::default();
        let watch = KvWatch::new(
            prober.clone(),
            Duration::from_secs(10),
            tx,
            Metrics::register(&mut registry),
        );
        let t = target(&["10.0.0.1"], true);
        assert_eq!(watch.state("ns", "ws", &t).0, KvProbe::NotProbed);
        tokio::task::yield_now().await;
        watch.forget("ns", "ws");
        tokio::time::advance(Duration::from_secs(5)).await;
        tokio::task::yield_now().await;
        assert!(
            rx.try_recv().is_err(),
            "nothing queued: the window was aborted"
        );
        // No endpoint with the KV port: nothing to watch.
        let mut none = t.clone();
        none.endpoints[0].kv_port = None;
        assert_eq!(watch.state("ns", "ws", &none), (KvProbe::NotProbed, None));
        assert_eq!(prober.calls.load(Ordering::Relaxed), 1);
        watch.clear();
    }
}
