//! The maintainer: the one task that keeps the shared state in step with the
//! catalog.
//!
//! When the catalog publishes a snapshot, or an engine's models or a
//! tokenizer change, it syncs the endpoint registry (starting probes and
//! KV-event subscriptions for endpoints that joined, stopping them and
//! forgetting their KV blocks and scoring state for endpoints that left),
//! reuses or creates worker-set runtimes, swaps in a new view, and starts
//! the self-check of local tokenizers not yet compared with their engines.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::watch;

use crate::catalog::Snapshot;
use crate::endpoint::{EndpointId, EndpointKey, Registry};
use crate::state::Shared;
use crate::view::View;

/// What an endpoint's KV subscription was made from: a change of any of
/// these (the worker set's `kvBlockSize`, `kvEvents.port` or
/// `kvEvents.replayPort`, or `kvEvents` set or unset) resubscribes it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Subscription {
    block_size: u32,
    kv_port: u16,
    replay_port: Option<u16>,
}

/// The maintainer's own state.
#[derive(Debug, Default)]
struct Maintainer {
    registry: Registry,
    subscribed: HashMap<EndpointId, Subscription>,
}

/// Keeps `shared` in step with the catalog's snapshots until shutdown.
pub async fn maintain(shared: Arc<Shared>, mut snapshots: watch::Receiver<Arc<Snapshot>>) {
    let mut m = Maintainer::default();
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut rebuild = true;
    loop {
        if rebuild {
            let snapshot = snapshots.borrow_and_update().clone();
            apply(&shared, &mut m, &snapshot);
        }
        rebuild = tokio::select! {
            () = shared.runtime.stop.cancelled() => break,
            r = snapshots.changed() => if r.is_err() { break } else { true },
            () = shared.runtime.models_changed() => true,
            _ = tick.tick() => {
                // Streams that lost blocks open a recovery window.
                shared.kv.watch_resets(tokio::time::Instant::now());
                false
            }
        };
    }
    // Stop every endpoint's tasks.
    m.registry.sync(std::iter::empty(), &shared.runtime.stop);
    shared.kv.stop_all();
}

fn apply(shared: &Arc<Shared>, m: &mut Maintainer, snapshot: &Snapshot) {
    let keys = snapshot.endpoints().map(|(_, e)| EndpointKey {
        address: e.address.clone(),
        http_port: e.http_port,
    });
    let changes = m.registry.sync(keys, &shared.runtime.stop);
    for e in &changes.removed {
        shared.kv.forget(e);
        m.subscribed.remove(&e.id);
        let id = kinference_scoring::EndpointId(e.id.0);
        for rt in shared.runtime.runtimes.all() {
            rt.forget(id);
        }
        tracing::info!(endpoint = %e.authority, "endpoint left");
    }
    for e in &changes.added {
        tracing::info!(endpoint = %e.authority, "endpoint joined");
        let s = shared.clone();
        crate::probe::spawn(
            e.clone(),
            shared.runtime.probes.clone(),
            shared.config.probes,
            shared.config.security.engine_auth.clone(),
            move || s.runtime.notify_models_changed(),
        );
    }
    // KV subscriptions: with the first worker set that lists the endpoint
    // with `kvEvents`; a changed spec resubscribes.
    for e in m.registry.all() {
        let wanted = snapshot
            .endpoints()
            .find(|(ws, r)| {
                ws.kv_events && r.address == e.key.address && r.http_port == e.key.http_port
            })
            .and_then(|(ws, re)| {
                Some((
                    Subscription {
                        block_size: ws.kv_block_size,
                        kv_port: re.kv_port?,
                        replay_port: re.replay_port,
                    },
                    re.address.clone(),
                ))
            });
        let now = m.subscribed.get(&e.id);
        if now == wanted.as_ref().map(|(w, _)| w) {
            continue;
        }
        if now.is_some() {
            tracing::info!(endpoint = %e.authority, "KV-event settings changed: resubscribing");
            shared.kv.forget(e);
            m.subscribed.remove(&e.id);
        }
        let Some((sub, address)) = wanted else {
            continue;
        };
        m.subscribed.insert(e.id, sub.clone());
        let (shared, e) = (shared.clone(), e.clone());
        tokio::spawn(async move {
            let target = crate::probe::KvTarget {
                authority: &e.authority,
                address: &address,
                kv_port: sub.kv_port,
                replay_port: sub.replay_port,
            };
            let (publishers, capacity) = crate::probe::kv_publishers(
                &shared.runtime.probes,
                &target,
                shared.config.kv_replay_offset,
                None,
                shared.config.probes.timeout,
            )
            .await;
            if let Some(tokens) = capacity {
                e.set_kv_capacity_tokens(tokens);
            }
            shared.kv.subscribe(&e, publishers, sub.block_size);
        });
    }
    let live: Vec<String> = snapshot
        .worker_sets
        .iter()
        .map(|w| w.name.clone())
        .collect();
    shared.runtime.runtimes.retain(&live);
    // Read before the endpoints' models are: a change during the build
    // leaves the view behind, and another rebuild is on its way.
    let models_version = shared.runtime.models_version();
    let mut view = View::build(snapshot, &m.registry, &|route| {
        let s = shared.clone();
        shared.runtime.runtimes.runtime_for(
            route,
            shared.config.policy,
            shared.config.prefix_ttl,
            move || s.runtime.notify_models_changed(),
        )
    });
    view.models_version = models_version;
    shared.runtime.set_view(view);
    shared.runtime.set_ready(snapshot.synced);
    for p in shared.runtime.set_problems(&snapshot.problems) {
        tracing::warn!(problem = %p, "the pool's objects need attention");
    }
    crate::tokens::spawn_self_checks(shared);
    crate::speed::spawn_new(shared);
}
