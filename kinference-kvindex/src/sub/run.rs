//! The run loop of one subscription (see the parent module's docs for the
//! sequence handling, anchored catch-ups and seeding it implements): the
//! task's state ([`Run`]), what it waits on ([`Live`]), the batches kept
//! while a seed is awaited ([`History`]), the payload [`digest`] catch-ups
//! are anchored on, and the live batches buffered while a replay runs
//! ([`Buffered`]).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use tokio::time::Instant;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SubSocket, ZmqMessage};

use super::replay::{fetch_replay, is_unreachable};
use super::{EventSink, SEED_HISTORY_BYTES, Seed, SeedOutcome, StreamHealth, SubscriberConfig};
use crate::codec::frames;
use crate::index::WorkerId;
use crate::snapshot::Position;

pub(super) struct Run<S> {
    pub(super) config: SubscriberConfig,
    pub(super) worker: WorkerId,
    pub(super) sink: Arc<S>,
    pub(super) health: Arc<Mutex<StreamHealth>>,
    /// The next sequence number expected; `None` before the first batch.
    pub(super) next_seq: Option<u64>,
    /// Digest of the payload of the batch `next_seq − 1`, the anchor of
    /// catch-ups.
    pub(super) last_digest: Option<u64>,
    /// The last batch, or the last check.
    pub(super) last_activity: Instant,
    /// The socket lost its publisher and has not reconnected yet.
    pub(super) disconnected: bool,
    /// It reconnected after a disconnect: check what was missed.
    pub(super) reconnected: bool,
    /// The replay endpoint, while it is believed to exist.
    pub(super) replay: Option<String>,
    /// While a seed is awaited: the batches applied since the worker's
    /// blocks were last dropped (the oldest go past the bounds).
    pub(super) history: Option<History>,
    /// A seed imported from a peer ahead: its position, checked when that
    /// batch arrives.
    pub(super) verify: Option<Position>,
}

enum Live {
    Batch(u64, Bytes),
    Event(SocketEvent),
    Idle,
    Seed(Option<Seed>),
}

/// Batches applied, in order: `(seq, digest, payload)`.
#[derive(Default)]
pub(super) struct History {
    batches: std::collections::VecDeque<(u64, u64, Bytes)>,
    bytes: usize,
}

impl History {
    fn push(&mut self, seq: u64, digest: u64, payload: &Bytes, max: usize) {
        self.batches.push_back((seq, digest, payload.clone()));
        self.bytes += payload.len();
        while self.batches.len() > max.max(1) || self.bytes > SEED_HISTORY_BYTES {
            let Some((_, _, p)) = self.batches.pop_front() else {
                break;
            };
            self.bytes -= p.len();
        }
    }

    fn clear(&mut self) {
        self.batches.clear();
        self.bytes = 0;
    }
}

fn digest(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

/// Live batches received while a replay runs.
struct Buffered {
    batches: Vec<(u64, Bytes)>,
    overflow: bool,
}

impl<S: EventSink> Run<S> {
    fn h(&self) -> std::sync::MutexGuard<'_, StreamHealth> {
        self.health.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn options(&self) -> SocketOptions {
        let mut o = SocketOptions::default();
        o.connect_timeout(self.config.connect_timeout);
        o
    }

    pub(super) async fn run(
        &mut self,
        mut seed: Option<tokio::sync::oneshot::Receiver<Option<Seed>>>,
    ) {
        let mut sub = SubSocket::with_options(self.options());
        let mut monitor = sub.monitor();
        if let Err(e) = sub.subscribe(&self.config.topic).await {
            tracing::warn!(endpoint = %self.config.endpoint, error = %e, "kv subscribe failed");
        }
        // Our own retry loop: a short timeout per attempt, a fixed pause.
        loop {
            match sub.connect(&self.config.endpoint).await {
                Ok(()) => break,
                Err(e) => {
                    let n = {
                        let mut h = self.h();
                        h.connect_failures += 1;
                        h.connect_failures
                    };
                    if n == 1 || n % 40 == 0 {
                        tracing::debug!(endpoint = %self.config.endpoint, error = %e, attempts = n, "kv publisher not reachable yet");
                    }
                    tokio::time::sleep(self.config.retry_interval).await;
                }
            }
        }
        {
            let mut h = self.h();
            h.connected = true;
            h.connect_failures = 0;
        }
        tracing::info!(endpoint = %self.config.endpoint, worker = self.worker.0, "kv events connected");
        loop {
            let idle = self.idle_deadline();
            let next = tokio::select! {
                m = sub.recv() => match m {
                    Ok(m) => self.live(&m),
                    Err(e) => {
                        tracing::warn!(endpoint = %self.config.endpoint, error = %e, "kv recv failed");
                        tokio::time::sleep(self.config.retry_interval).await;
                        None
                    }
                },
                ev = monitor.next() => ev.map(Live::Event),
                () = async { tokio::time::sleep_until(idle.unwrap_or_else(Instant::now)).await }, if idle.is_some() => Some(Live::Idle),
                s = async { seed.as_mut().expect("guarded").await }, if seed.is_some() => Some(Live::Seed(s.ok().flatten())),
            };
            match next {
                Some(Live::Seed(s)) => {
                    seed = None;
                    self.on_seed(s);
                }
                Some(Live::Batch(seq, payload)) => {
                    self.on_batch(&mut sub, &mut monitor, seq, payload).await;
                }
                Some(Live::Event(ev)) => self.on_socket_event(&ev),
                Some(Live::Idle) => {
                    self.h().checks += 1;
                    self.check_idle(&mut sub, &mut monitor).await;
                    self.last_activity = Instant::now();
                }
                None => {}
            }
            if std::mem::take(&mut self.reconnected)
                && self.next_seq.is_some()
                && self.replay.is_some()
            {
                // Without a replay endpoint there is nothing to ask: the
                // next batch's number tells whether anything was lost
                // meanwhile (a gap or a restart then drops the blocks).
                self.h().checks += 1;
                self.catch_up(&mut sub, &mut monitor, None).await;
            }
        }
    }

    /// When the idle check is due, if it applies.
    fn idle_deadline(&self) -> Option<Instant> {
        let every = self.config.idle_check?;
        (self.replay.is_some() && self.next_seq.is_some() && !self.disconnected)
            .then(|| self.last_activity + every)
    }

    /// The idle check: an anchored catch-up, unless the replay endpoint
    /// cannot be reached. Nothing showed a loss, so an unreachable replay
    /// endpoint drops no block: it is remembered as absent.
    async fn check_idle(
        &mut self,
        sub: &mut SubSocket,
        monitor: &mut futures::channel::mpsc::Receiver<SocketEvent>,
    ) {
        let Some(endpoint) = self.replay.clone() else {
            return;
        };
        let (n, d) = match (self.next_seq, self.last_digest) {
            (Some(n), Some(d)) if n > 0 => (n, d),
            _ => return,
        };
        let mut buf = Buffered {
            batches: Vec::new(),
            overflow: false,
        };
        match self.fetch(sub, monitor, endpoint, n - 1, &mut buf).await {
            Err(e) if is_unreachable(&e) => self.replay_unreachable(&e),
            Err(e) => {
                tracing::debug!(endpoint = %self.config.endpoint, error = %e, "kv idle check failed; keeping the blocks");
            }
            Ok(batches) => {
                let continues = batches
                    .first()
                    .is_some_and(|(s, p)| *s == n - 1 && digest(p) == d);
                let tail: Vec<(u64, Bytes)> = batches.into_iter().skip(1).collect();
                if continues {
                    // Batches lost on the wire before the spell: apply them.
                    for (s, p) in tail {
                        if self.next_seq.is_none_or(|x| s >= x) {
                            self.apply(s, &p);
                        }
                    }
                } else {
                    self.h().restarts += 1;
                    tracing::info!(endpoint = %self.config.endpoint, "kv publisher is not the stream followed (restarted): dropping the worker's blocks");
                    self.forget();
                }
            }
        }
        for (s, p) in buf.batches {
            self.on_live_after_check(s, &p);
        }
    }

    /// A live batch that arrived during a check: applied in order, or a gap.
    fn on_live_after_check(&mut self, s: u64, p: &Bytes) {
        match self.next_seq {
            Some(n) if s < n => {}
            Some(n) if s > n => {
                self.h().gaps += 1;
                self.reset();
                self.apply(s, p);
            }
            _ => self.apply(s, p),
        }
    }

    /// The replay endpoint cannot be reached: from now on there is none.
    fn replay_unreachable(&mut self, why: &str) {
        if let Some(e) = self.replay.take() {
            tracing::warn!(endpoint = %self.config.endpoint, replay = %e, error = %why, "kv replay endpoint unreachable: treating it as absent (gaps will drop this worker's blocks)");
            let mut h = self.h();
            h.replay_absent = true;
            h.replay_failures += 1;
        }
    }

    /// Drops the worker's blocks and forgets the stream's position: the next
    /// batch is a first one.
    fn forget(&mut self) {
        self.reset();
        self.next_seq = None;
        self.last_digest = None;
    }

    fn on_socket_event(&mut self, ev: &SocketEvent) {
        match ev {
            SocketEvent::Connected(..) => {
                self.h().connected = true;
                if std::mem::take(&mut self.disconnected) {
                    tracing::info!(endpoint = %self.config.endpoint, "kv publisher reconnected");
                    self.reconnected = true;
                }
            }
            SocketEvent::Disconnected(_) => {
                self.h().connected = false;
                self.disconnected = true;
                tracing::info!(endpoint = %self.config.endpoint, "kv publisher disconnected");
            }
            _ => {}
        }
    }

    /// A live message → (seq, payload), counting malformed ones.
    fn live(&self, m: &ZmqMessage) -> Option<Live> {
        let parts: Vec<&[u8]> = m.iter().map(Bytes::as_ref).collect();
        match frames::parse_live(&parts) {
            Ok(l) => Some(Live::Batch(l.seq, m.get(2).cloned().unwrap_or_default())),
            Err(e) => {
                self.h().decode_errors += 1;
                tracing::debug!(endpoint = %self.config.endpoint, error = %e, "malformed kv message");
                None
            }
        }
    }

    async fn on_batch(
        &mut self,
        sub: &mut SubSocket,
        monitor: &mut futures::channel::mpsc::Receiver<SocketEvent>,
        seq: u64,
        payload: Bytes,
    ) {
        self.last_activity = Instant::now();
        match self.next_seq {
            Some(n) if seq == n => self.apply(seq, &payload),
            None if seq == 0 || self.replay.is_none() => self.apply(seq, &payload),
            Some(n) if seq < n => {
                self.h().restarts += 1;
                tracing::info!(endpoint = %self.config.endpoint, seq, expected = n, "kv publisher restarted");
                self.forget();
                if seq == 0 || self.replay.is_none() {
                    self.apply(seq, &payload);
                } else {
                    self.catch_up(sub, monitor, Some((seq, payload))).await;
                }
            }
            Some(n) => {
                self.h().gaps += 1;
                tracing::info!(endpoint = %self.config.endpoint, seq, expected = n, "kv sequence gap");
                if self.replay.is_some() {
                    self.catch_up(sub, monitor, Some((seq, payload))).await;
                } else {
                    self.reset();
                    self.apply(seq, &payload);
                }
            }
            None => self.catch_up(sub, monitor, Some((seq, payload))).await,
        }
    }

    fn reset(&mut self) {
        self.sink.clear(self.worker);
        self.h().resets += 1;
        if let Some(h) = &mut self.history {
            h.clear();
        }
        // What a peer ahead of us sent is gone with the blocks.
        self.verify = None;
    }

    fn apply(&mut self, seq: u64, payload: &Bytes) {
        let d = digest(payload);
        if self.apply_batch(seq, d, payload) {
            if let Some(h) = &mut self.history {
                h.push(seq, d, payload, self.config.max_buffered);
            }
        } else {
            self.h().decode_errors += 1;
            self.reset();
        }
        self.next_seq = Some(seq.wrapping_add(1));
        self.last_digest = Some(d);
        if let Some(v) = self.verify
            && seq >= v.seq
        {
            self.verify = None;
            if seq == v.seq && d != v.digest {
                tracing::warn!(endpoint = %self.config.endpoint, seq, "the peer's snapshot followed another stream: dropping the worker's blocks");
                self.h().seed = Some(SeedOutcome::DivergedLater);
                self.reset();
                self.apply_batch(seq, d, payload);
            }
        }
    }

    /// Decodes and applies one batch as the stream's position `(seq, d)`;
    /// false when it does not decode.
    fn apply_batch(&mut self, seq: u64, d: u64, payload: &[u8]) -> bool {
        match crate::codec::decode_batch(payload) {
            Ok(b) => {
                self.sink
                    .apply_at(self.worker, &b, Position { seq, digest: d });
                let mut h = self.h();
                h.batches += 1;
                h.last_event = Some(Instant::now());
                h.last_batch_ts = Some(b.ts);
                h.last_seq = Some(seq);
                h.unknown_events += u64::from(b.skipped.unknown_events);
                h.unknown_fields += u64::from(b.skipped.unknown_fields);
                true
            }
            Err(e) => {
                tracing::warn!(endpoint = %self.config.endpoint, seq, error = %e, "undecodable kv batch: dropping the worker's blocks");
                false
            }
        }
    }

    /// The seed came (or will not): merges it (module docs, "Seeding")
    /// and stops keeping batches.
    fn on_seed(&mut self, seed: Option<Seed>) {
        let history = self.history.take().unwrap_or_default();
        let outcome = match seed {
            None => SeedOutcome::NotOffered,
            Some(seed) => self.merge(&seed, &history),
        };
        match &outcome {
            SeedOutcome::NotOffered => {}
            o if o.imported() => {
                tracing::info!(endpoint = %self.config.endpoint, worker = self.worker.0, outcome = %o, "kv index seeded from a peer");
            }
            o => {
                tracing::warn!(endpoint = %self.config.endpoint, worker = self.worker.0, outcome = %o, "kv index not seeded from the peer's snapshot");
            }
        }
        self.h().seed = Some(outcome);
    }

    fn merge(&mut self, seed: &Seed, history: &History) -> SeedOutcome {
        let Some(at) = seed
            .snapshot
            .workers()
            .nth(seed.part)
            .and_then(|w| w.position)
        else {
            return SeedOutcome::NoPosition;
        };
        let import = |this: &Self, pos: Option<Position>| this.sink.import(this.worker, seed, pos);
        let l = at.seq;
        let Some(n) = self.next_seq else {
            // Nothing applied: go on from the snapshot's position.
            return match import(self, Some(at)) {
                Ok(entries) => {
                    self.next_seq = Some(l.wrapping_add(1));
                    self.last_digest = Some(at.digest);
                    SeedOutcome::Imported {
                        entries,
                        replayed: 0,
                    }
                }
                Err(e) => SeedOutcome::Failed(e),
            };
        };
        if l >= n {
            // The peer is ahead: our batches up to `l` arrive later and
            // apply over the import; batch `l` is checked then.
            return match import(self, None) {
                Ok(entries) => {
                    self.verify = Some(at);
                    SeedOutcome::Ahead { entries }
                }
                Err(e) => SeedOutcome::Failed(e),
            };
        }
        // l < n: the batches after `l` must all be kept, and ours at `l`
        // (if kept) must be the peer's.
        let first = history.batches.front().map_or(n, |b| b.0);
        if l.wrapping_add(1) < first {
            return SeedOutcome::Stale;
        }
        let ours = if l + 1 == n {
            self.last_digest
        } else {
            history.batches.iter().find(|b| b.0 == l).map(|b| b.1)
        };
        if ours.is_some_and(|d| d != at.digest) {
            return SeedOutcome::Diverged;
        }
        let entries = match import(self, None) {
            Ok(e) => e,
            Err(e) => return SeedOutcome::Failed(e),
        };
        let mut replayed = 0;
        for (s, d, p) in history.batches.iter().filter(|b| b.0 > l) {
            self.apply_batch(*s, *d, p);
            replayed += 1;
        }
        SeedOutcome::Imported { entries, replayed }
    }

    /// Fetches one replay from `from` while buffering live batches into
    /// `buf`.
    async fn fetch(
        &mut self,
        sub: &mut SubSocket,
        monitor: &mut futures::channel::mpsc::Receiver<SocketEvent>,
        endpoint: String,
        from: u64,
        buf: &mut Buffered,
    ) -> Result<Vec<(u64, Bytes)>, String> {
        let fetch = fetch_replay(endpoint, from, self.options(), self.config.replay_timeout);
        tokio::pin!(fetch);
        loop {
            tokio::select! {
                r = &mut fetch => return r,
                m = sub.recv() => match m {
                    Ok(m) => {
                        if let Some(Live::Batch(s, p)) = self.live(&m) {
                            if buf.batches.len() < self.config.max_buffered {
                                buf.batches.push((s, p));
                            } else {
                                buf.overflow = true;
                            }
                        }
                    }
                    // Do not spin on a failing socket while the replay runs.
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                },
                ev = monitor.next() => if let Some(ev) = ev { self.on_socket_event(&ev) },
            }
        }
    }

    /// Catches up from the replay endpoint (the live batch that showed the
    /// need, if any, already received), buffering live batches meanwhile,
    /// then applies everything in order.
    ///
    /// With a position, the replay is anchored (see the module docs): it
    /// asks from the last batch applied and goes on only if the reply
    /// starts with that batch; otherwise the stream is a new one and is
    /// read again from 0 onto dropped blocks. Without a position (a first
    /// join, or after a restart) it back-fills from 0. When the replay
    /// fails, the worker's blocks are dropped and the buffered batches
    /// applied.
    async fn catch_up(
        &mut self,
        sub: &mut SubSocket,
        monitor: &mut futures::channel::mpsc::Receiver<SocketEvent>,
        live: Option<(u64, Bytes)>,
    ) {
        let Some(endpoint) = self.replay.clone() else {
            return;
        };
        let mut buf = Buffered {
            batches: live.into_iter().collect(),
            overflow: false,
        };
        let anchor = match (self.next_seq, self.last_digest) {
            (Some(n), Some(d)) if n > 0 => Some((n - 1, d)),
            _ => None,
        };
        let from = anchor.map_or(0, |(a, _)| a);
        let mut result = self
            .fetch(sub, monitor, endpoint.clone(), from, &mut buf)
            .await;
        if let (Some((a, d)), Ok(batches)) = (anchor, &result) {
            let continues = batches
                .first()
                .is_some_and(|(s, p)| *s == a && digest(p) == d);
            if continues {
                // Drop the anchor itself: it is applied already.
                if let Ok(b) = &mut result {
                    b.remove(0);
                }
            } else {
                let starts = batches.first().map(|(s, _)| *s);
                self.h().restarts += 1;
                tracing::info!(endpoint = %self.config.endpoint, anchor = a, reply_starts = ?starts, "kv publisher is not the stream followed (restarted): dropping the worker's blocks and replaying from 0");
                self.forget();
                result = self.fetch(sub, monitor, endpoint, 0, &mut buf).await;
            }
        }
        let from = self.next_seq.unwrap_or(0);
        let replayed = match result {
            Ok(r) if !buf.overflow => Ok(r),
            Ok(_) => Err("live buffer overflowed during replay".to_owned()),
            Err(e) => Err(e),
        };
        match replayed {
            // Contiguous with what we applied, or a first join (nothing to
            // be contiguous with: a partial back-fill beats none).
            Ok(batches)
                if self.next_seq.is_none() || batches.first().is_none_or(|(s, _)| *s <= from) =>
            {
                if !batches.is_empty() {
                    self.h().replays += 1;
                }
                for (s, p) in batches {
                    if s >= from && self.next_seq.is_none_or(|n| s >= n) {
                        self.apply(s, &p);
                    }
                }
            }
            other => {
                let why = match other {
                    Ok(b) => format!(
                        "replay starts at {:?}, asked for {from}",
                        b.first().map(|x| x.0)
                    ),
                    Err(e) => e,
                };
                if is_unreachable(&why) {
                    self.replay_unreachable(&why);
                } else {
                    self.h().replay_failures += 1;
                }
                tracing::warn!(endpoint = %self.config.endpoint, from, reason = %why, "kv replay failed: dropping the worker's blocks");
                self.forget();
            }
        }
        // Then the live batches buffered meanwhile, skipping replayed ones.
        for (s, p) in buf.batches {
            match self.next_seq {
                Some(n) if s < n => {}
                Some(n) if s > n => {
                    // Another gap inside the buffer: do not recurse; drop.
                    self.h().gaps += 1;
                    self.reset();
                    self.apply(s, &p);
                }
                _ => self.apply(s, &p),
            }
        }
    }
}
