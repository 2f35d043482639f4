//! One KV-event window: find the publishers, check they accept connections,
//! subscribe for the window with kinference-kvindex's subscriber, and read
//! the engine's `/metrics` on both sides of it.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kinference_kvindex::event::{EventBatch, KvEvent};
use kinference_kvindex::index::WorkerId;
use kinference_kvindex::sub::{self, EventSink, SubscriberConfig, SubscriberHandle};
use tokio::net::TcpStream;

use super::{EngineActivity, HttpProber, KvObservation, KvTarget, KvWindow};
use crate::endpoints::authority;

/// Records what the subscriber decodes: block widths per KV-cache group.
/// Holds no blocks (nothing is indexed).
#[derive(Debug, Default)]
struct Recorder {
    widths: Mutex<BTreeSet<(u32, u32)>>,
}

impl Recorder {
    fn widths(&self) -> BTreeSet<(u32, u32)> {
        self.widths
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl EventSink for Recorder {
    fn apply(&self, _worker: WorkerId, batch: &EventBatch) {
        let mut widths = self.widths.lock().unwrap_or_else(PoisonError::into_inner);
        for e in &batch.events {
            if let KvEvent::BlockStored(s) = e
                && s.block_size > 0
            {
                widths.insert((s.group_idx.unwrap_or(0), s.block_size));
            }
        }
    }

    fn clear(&self, _worker: WorkerId) {}

    fn view(&self, _worker: WorkerId) -> (u64, Vec<(u32, u32)>) {
        (0, self.widths().into_iter().collect())
    }
}

/// A publisher to watch: the DP rank and `host:port`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Publisher {
    rank: u32,
    authority: String,
}

/// The publishers of `target`: every rank `/kv_event_sources` lists, or
/// rank 0 on `kvEvents.port` when the engine does not list any.
async fn publishers(prober: &HttpProber, target: &KvTarget) -> (Vec<Publisher>, bool) {
    let http = authority(&target.address, target.http_port);
    match prober.kv_event_sources(&http).await {
        Ok(sources) if !sources.is_empty() => {
            let list = sources
                .into_iter()
                .map(|s| Publisher {
                    rank: s.rank,
                    authority: authority(&target.address, s.port),
                })
                .collect();
            (list, true)
        }
        other => {
            if let Err(error) = &other {
                tracing::debug!(worker_set = %target.worker_set, endpoint = %http, %error, "no /kv_event_sources; using kvEvents.port");
            }
            let list = vec![Publisher {
                rank: 0,
                authority: authority(&target.address, target.kv_port),
            }];
            (list, false)
        }
    }
}

/// A TCP connect to `authority` within `timeout`; a stable error text.
async fn reachable(authority: &str, timeout: Duration) -> Result<(), String> {
    match tokio::time::timeout(timeout, TcpStream::connect(authority)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(e.kind().to_string()),
        Err(_) => Err(format!("no connection within {} ms", timeout.as_millis())),
    }
}

/// Watches `target`'s KV events for the prober's window.
pub(super) async fn watch(prober: &HttpProber, target: &KvTarget) -> KvObservation {
    let (publishers, discovered) = publishers(prober, target).await;
    for p in &publishers {
        if let Err(error) = reachable(&p.authority, prober.timeout()).await {
            tracing::debug!(worker_set = %target.worker_set, publisher = %p.authority, %error, "kv publisher closed");
            return KvObservation::Closed {
                endpoint: p.authority.clone(),
                error,
            };
        }
    }
    let http = authority(&target.address, target.http_port);
    let ranks: BTreeSet<u32> = publishers.iter().map(|p| p.rank).collect();
    let before = prober.engine_counters(&http, Some(&ranks)).await;

    let recorder = Arc::new(Recorder::default());
    let window = prober.kv_window();
    let handles: Vec<(String, SubscriberHandle)> = publishers
        .iter()
        .map(|p| {
            let mut config = SubscriberConfig::new(format!("tcp://{}", p.authority));
            // Connect attempts must fit in the window several times.
            config.connect_timeout =
                (window / 4).clamp(Duration::from_millis(100), Duration::from_millis(500));
            config.retry_interval = Duration::from_millis(100);
            (
                p.authority.clone(),
                sub::spawn(config, WorkerId(p.rank), recorder.clone()),
            )
        })
        .collect();
    tokio::time::sleep(window).await;
    let healths: Vec<_> = handles.into_iter().map(|(a, h)| (a, h.health())).collect();
    let after = prober.engine_counters(&http, Some(&ranks)).await;

    if let Some((endpoint, _)) = healths.iter().find(|(_, h)| !h.connected && h.batches == 0) {
        return KvObservation::Closed {
            endpoint: endpoint.clone(),
            error: "it accepts TCP connections but no ZeroMQ publisher answered".to_owned(),
        };
    }
    let activity = if let (Ok(b), Ok(a)) = (&before, &after) {
        EngineActivity::between(b, a)
    } else {
        let error = before.err().or(after.err()).map(|e| e.to_string());
        tracing::debug!(worker_set = %target.worker_set, endpoint = %http, ?error, "engine metrics unreadable: activity unknown");
        None
    };
    let observation = KvWindow {
        publishers: publishers.into_iter().map(|p| p.authority).collect(),
        discovered,
        window_ms: u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
        batches: healths.iter().map(|(_, h)| h.batches).sum(),
        block_sizes: recorder.widths().into_iter().map(|(_, w)| w).collect(),
        activity,
    };
    tracing::debug!(worker_set = %target.worker_set, publishers = ?observation.publishers, batches = observation.batches, widths = ?observation.block_sizes, activity = ?observation.activity, "kv window done");
    KvObservation::Subscribed(observation)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kinference_kvindex::event::{BlockRemoved, BlockStored};

    #[test]
    fn the_recorder_keeps_widths_of_stored_blocks() {
        let r = Recorder::default();
        let stored = |width: u32, group: Option<u32>| {
            KvEvent::BlockStored(BlockStored {
                block_size: width,
                group_idx: group,
                ..BlockStored::default()
            })
        };
        r.apply(
            WorkerId(0),
            &EventBatch {
                events: vec![
                    stored(256, None),
                    stored(0, None),
                    KvEvent::BlockRemoved(BlockRemoved::default()),
                    stored(16, Some(1)),
                    KvEvent::AllBlocksCleared,
                ],
                ..EventBatch::default()
            },
        );
        r.clear(WorkerId(0));
        assert_eq!(r.view(WorkerId(0)), (0, vec![(0, 256), (1, 16)]));
    }
}
