//! The KV-event publisher of one engine core, as vLLM's `ZmqEventPublisher`:
//! a PUB socket sending `[topic, seq, payload]` per engine step, and an
//! optional replay ROUTER answering from a ring buffer of recent batches.
//!
//! Encoding and framing are `kinference-kvindex`'s ([`encode_batch`],
//! [`frames`]); this module only decides what goes into a batch, with the
//! engine mode's field values. vLLM (0.33): `medium: "GPU"`, `group_idx:
//! 0`, `kv_cache_spec_kind: "full_attention"`, one `extra_keys` nil per
//! block (a LoRA adapter's blocks: `lora_id` its integer id, `lora_name`
//! its name and `extra_keys` its name per block, untagged and without the
//! path, as vLLM publishes them), one `BlockRemoved` per evicted block.
//! SGLang: `medium: "GPU"`, `lora_id` nil and nothing else; a run of
//! evictions along one chain (a radix node's pages) becomes one
//! `BlockRemoved` in prefix order, and before 0.5.18 every page gets its
//! own event, stores and removals alike.
//! The publisher stamps its rank into every batch.
//!
//! Faults: a batch can be *dropped* (its seq is used and it stays in the
//! replay ring, but it is not sent: subscribers see a gap they can repair),
//! *lost* (neither sent nor kept), and the publisher can *restart* (sockets
//! closed and rebound, ring cleared, seq back to 0; batches produced while
//! it is down are lost).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kinference_kvindex::codec::frames::{self, ReplayLayout};
use kinference_kvindex::event::Value;
use kinference_kvindex::{
    BlockHash, BlockRemoved, BlockStored, EncodeForm, EventBatch, KvEvent, encode_batch,
};
use tokio::sync::{mpsc, oneshot, watch};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::SimError;
use crate::config::{HashRepr, KvEventsConfig};
use crate::engine::SimEvent;
use crate::hash::Digest;
use crate::mode::{EngineMode, WireForm};

/// Counters and addresses of a publisher (shared with the HTTP side).
#[derive(Debug)]
pub struct PublisherInfo {
    /// DP rank.
    pub rank: u32,
    /// Bound PUB address.
    pub pub_addr: SocketAddr,
    /// Bound replay ROUTER address.
    pub replay_addr: Option<SocketAddr>,
    /// The next sequence number.
    pub next_seq: AtomicU64,
    /// Batches handed to [`Publisher::publish`] that the task has not
    /// numbered yet (sent, dropped or lost). Zero means `next_seq` counts
    /// every batch the engine produced so far.
    pub pending: AtomicU64,
    /// Batches sent on the PUB socket.
    pub sent: AtomicU64,
    /// Batches dropped from the PUB socket (seq used).
    pub dropped: AtomicU64,
    /// Batches lost while the publisher was down, or lost by a fault.
    pub lost: AtomicU64,
    /// Restarts.
    pub restarts: AtomicU64,
    /// Replay requests answered.
    pub replays: Arc<AtomicU64>,
    /// Drop every n-th batch (0: never).
    pub drop_every: AtomicU64,
    /// Batches still to drop.
    pub drop_pending: AtomicU64,
    /// Batches still to lose.
    pub lose_pending: AtomicU64,
}

enum Cmd {
    Batch(Vec<SimEvent>),
    Restart {
        down: Duration,
        done: oneshot::Sender<()>,
    },
}

/// Handle to a running publisher task.
#[derive(Debug, Clone)]
pub(crate) struct Publisher {
    tx: mpsc::UnboundedSender<Cmd>,
    pub(crate) info: Arc<PublisherInfo>,
}

impl std::fmt::Debug for Cmd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cmd::Batch(e) => write!(f, "Batch({} events)", e.len()),
            Cmd::Restart { down, .. } => write!(f, "Restart({down:?})"),
        }
    }
}

struct Wire {
    topic: Bytes,
    mode: EngineMode,
    form: EncodeForm,
    hash_repr: HashRepr,
    block_size: u32,
    layout: ReplayLayout,
    fixed_ts: Option<f64>,
    buffer_steps: usize,
    /// The name of LoRA adapter id `i + 1`.
    lora_names: Vec<String>,
}

type Ring = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

impl Publisher {
    /// Binds the sockets of `rank` (ports offset by `port_offset` from the
    /// configured bases; ephemeral when a base is 0) and starts the task.
    /// `lora_names[i]` is the name of LoRA adapter id `i + 1`.
    ///
    /// # Errors
    /// [`SimError::Bind`] when a port is taken.
    pub(crate) async fn start(
        cfg: &KvEventsConfig,
        mode: EngineMode,
        rank: u32,
        port_offset: u16,
        block_size: usize,
        lora_names: Vec<String>,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Publisher, SimError> {
        let offset = |base: u16| {
            if base == 0 {
                0
            } else {
                base.saturating_add(port_offset)
            }
        };
        let pub_want = SocketAddr::new(cfg.host, offset(cfg.port));
        let (pub_sock, pub_addr) = bind_pub(pub_want).await?;
        let ring: Ring = Arc::new(Mutex::new(VecDeque::new()));
        let wire = Wire {
            topic: Bytes::from(cfg.topic.clone().into_bytes()),
            mode,
            form: match mode.wire_form() {
                WireForm::VllmMap => EncodeForm::VllmMap,
                WireForm::VllmArray => EncodeForm::VllmArray,
                WireForm::SglangArray => EncodeForm::SglangArray,
                WireForm::SglangMap => EncodeForm::SglangMap,
            },
            hash_repr: cfg.hash_repr,
            block_size: block_size as u32,
            layout: mode.replay_layout(),
            fixed_ts: cfg.fixed_ts,
            buffer_steps: cfg.buffer_steps,
            lora_names,
        };
        let replays = Arc::new(AtomicU64::new(0));
        let replay = match cfg.replay_port {
            Some(p) => {
                let want = SocketAddr::new(cfg.host, offset(p));
                Some(
                    Replay::start(
                        want,
                        ring.clone(),
                        wire.topic.clone(),
                        wire.layout,
                        replays.clone(),
                    )
                    .await?,
                )
            }
            None => None,
        };
        let info = Arc::new(PublisherInfo {
            rank,
            pub_addr,
            replay_addr: replay.as_ref().map(|r| r.addr),
            next_seq: AtomicU64::new(0),
            pending: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            lost: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            replays,
            drop_every: AtomicU64::new(0),
            drop_pending: AtomicU64::new(0),
            lose_pending: AtomicU64::new(0),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let task = Task {
            rx,
            wire,
            info: info.clone(),
            ring,
            pub_sock: Some(pub_sock),
            replay,
            shutdown,
        };
        tokio::spawn(task.run());
        Ok(Publisher { tx, info })
    }

    /// Queues one step's events as one batch (in order with earlier calls).
    pub(crate) fn publish(&self, events: Vec<SimEvent>) {
        if !events.is_empty() {
            self.info.pending.fetch_add(1, Ordering::AcqRel);
            if self.tx.send(Cmd::Batch(events)).is_err() {
                self.info.pending.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Restarts the sockets: closed for `down`, then rebound with seq 0.
    /// Resolves when the publisher is back.
    pub(crate) async fn restart(&self, down: Duration) {
        let (done, wait) = oneshot::channel();
        if self.tx.send(Cmd::Restart { down, done }).is_ok() {
            let _ = wait.await;
        }
    }
}

/// `cfg` with ephemeral base ports (0) replaced by free bases that leave
/// `n` consecutive ports free, so rank r can bind base + r.
///
/// # Errors
/// [`SimError::Bind`] when no such range is found.
pub(crate) fn consecutive_ports(cfg: &KvEventsConfig, n: u32) -> Result<KvEventsConfig, SimError> {
    let mut out = cfg.clone();
    // The publisher's own range is probed first, so the replay range
    // starts after it.
    if out.port == 0 {
        out.port = free_range(cfg.host, n, &[])?;
    }
    if out.replay_port == Some(0) {
        out.replay_port = Some(free_range(cfg.host, n, &[(out.port, n)])?);
    }
    Ok(out)
}

fn free_range(host: std::net::IpAddr, n: u32, avoid: &[(u16, u32)]) -> Result<u16, SimError> {
    let clash = |base: u16| {
        avoid.iter().any(|&(a, len)| {
            let (a, b) = (u32::from(a), u32::from(base));
            b < a + len && a < b + n
        })
    };
    for _ in 0..64 {
        let Ok(probe) = std::net::TcpListener::bind(SocketAddr::new(host, 0)) else {
            break;
        };
        let Ok(base) = probe.local_addr().map(|a| a.port()) else {
            break;
        };
        if u32::from(base) + n > u32::from(u16::MAX) || clash(base) {
            continue;
        }
        let rest: Vec<_> = (1..n)
            .map_while(|i| std::net::TcpListener::bind(SocketAddr::new(host, base + i as u16)).ok())
            .collect();
        if rest.len() + 1 == n as usize {
            return Ok(base);
        }
    }
    Err(SimError::Bind {
        addr: SocketAddr::new(host, 0),
        reason: format!("no {n} consecutive free ports"),
    })
}

async fn bind_pub(want: SocketAddr) -> Result<(PubSocket, SocketAddr), SimError> {
    let mut sock = PubSocket::new();
    let ep = bind_with_retry(&mut sock, want).await?;
    Ok((sock, ep))
}

/// Binds, retrying briefly: a restarted publisher may find its old
/// listener not yet closed.
async fn bind_with_retry<S: Socket>(
    sock: &mut S,
    want: SocketAddr,
) -> Result<SocketAddr, SimError> {
    let mut last = None;
    for _ in 0..40 {
        match sock.bind(&format!("tcp://{want}")).await {
            Ok(zeromq::Endpoint::Tcp(_, port)) => return Ok(SocketAddr::new(want.ip(), port)),
            Ok(other) => {
                return Err(SimError::Bind {
                    addr: want,
                    reason: format!("unexpected endpoint {other:?}"),
                });
            }
            Err(e) => {
                last = Some(e.to_string());
                if want.port() == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    Err(SimError::Bind {
        addr: want,
        reason: last.unwrap_or_default(),
    })
}

struct Task {
    rx: mpsc::UnboundedReceiver<Cmd>,
    wire: Wire,
    info: Arc<PublisherInfo>,
    ring: Ring,
    pub_sock: Option<PubSocket>,
    replay: Option<Replay>,
    shutdown: watch::Receiver<bool>,
}

impl Task {
    async fn run(mut self) {
        loop {
            let cmd = tokio::select! {
                c = self.rx.recv() => c,
                _ = self.shutdown.changed() => None,
            };
            match cmd {
                None => break,
                Some(Cmd::Batch(events)) => {
                    self.send(events).await;
                    // After its number is taken (`pending` 0 ⇒ `next_seq`
                    // is final).
                    self.info.pending.fetch_sub(1, Ordering::AcqRel);
                }
                Some(Cmd::Restart { down, done }) => {
                    self.restart(down).await;
                    let _ = done.send(());
                }
            }
        }
        if let Some(r) = self.replay.take() {
            r.stop().await;
        }
        if let Some(s) = self.pub_sock.take() {
            let _ = s.close().await;
        }
    }

    async fn send(&mut self, events: Vec<SimEvent>) {
        let info = &self.info;
        if take_one(&info.lose_pending) {
            info.lost.fetch_add(1, Ordering::Relaxed);
            info.next_seq.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let ts = self.wire.fixed_ts.unwrap_or_else(wall_clock);
        let batch = EventBatch {
            ts,
            events: to_wire(events, &self.wire),
            dp_rank: Some(i64::from(info.rank)),
            has_rank_field: true,
            ..EventBatch::default()
        };
        let payload = Bytes::from(encode_batch(&batch, self.wire.form));
        let seq = info.next_seq.fetch_add(1, Ordering::Relaxed);
        {
            let mut ring = self
                .ring
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if ring.len() == self.wire.buffer_steps {
                ring.pop_front();
            }
            ring.push_back((seq, payload.clone()));
        }
        let every = info.drop_every.load(Ordering::Relaxed);
        if take_one(&info.drop_pending) || (every > 0 && (seq + 1).is_multiple_of(every)) {
            info.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if let Some(s) = self.pub_sock.as_mut() {
            let frames = vec![
                self.wire.topic.clone(),
                Bytes::copy_from_slice(&frames::seq_to_bytes(seq)),
                payload,
            ];
            if let Ok(msg) = ZmqMessage::try_from(frames)
                && let Err(e) = s.send(msg).await
            {
                tracing::warn!(rank = info.rank, seq, error = %e, "kv event batch not sent");
            }
            info.sent.fetch_add(1, Ordering::Relaxed);
        }
    }

    async fn restart(&mut self, down: Duration) {
        let pub_addr = self.info.pub_addr;
        let replay_addr = self.info.replay_addr;
        tracing::info!(
            rank = self.info.rank,
            ?down,
            "restarting the kv event publisher"
        );
        if let Some(r) = self.replay.take() {
            r.stop().await;
        }
        if let Some(s) = self.pub_sock.take() {
            let _ = s.close().await;
        }
        self.ring
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clear();
        // Batches produced while down are lost, as in a crashed publisher.
        let until = tokio::time::Instant::now() + down;
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(until) => break,
                c = self.rx.recv() => match c {
                    Some(Cmd::Batch(_)) => {
                        self.info.lost.fetch_add(1, Ordering::Relaxed);
                        self.info.pending.fetch_sub(1, Ordering::AcqRel);
                    }
                    Some(Cmd::Restart { done, .. }) => { let _ = done.send(()); }
                    None => return,
                },
            }
        }
        self.info.next_seq.store(0, Ordering::Relaxed);
        self.info.restarts.fetch_add(1, Ordering::Relaxed);
        match bind_pub(pub_addr).await {
            Ok((s, _)) => self.pub_sock = Some(s),
            Err(e) => {
                tracing::error!(rank = self.info.rank, error = %e, "publisher did not come back");
            }
        }
        if let Some(addr) = replay_addr {
            let counter = self.info.replays.clone();
            match Replay::start(
                addr,
                self.ring.clone(),
                self.wire.topic.clone(),
                self.wire.layout,
                counter,
            )
            .await
            {
                Ok(r) => self.replay = Some(r),
                Err(e) => {
                    tracing::error!(rank = self.info.rank, error = %e, "replay socket did not come back");
                }
            }
        }
    }
}

fn take_one(counter: &AtomicU64) -> bool {
    counter
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

fn wall_clock() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn wire_hash(d: &Digest, w: &Wire) -> BlockHash {
    if w.mode.is_sglang() {
        return BlockHash::Int(d.sglang_id());
    }
    match w.hash_repr {
        HashRepr::Int => BlockHash::Uint(d.id()),
        HashRepr::Bytes => BlockHash::Bytes(d.0.to_vec()),
    }
}

/// One step's engine events in the engine mode's wire form.
fn to_wire(events: Vec<SimEvent>, w: &Wire) -> Vec<KvEvent> {
    if w.mode.is_sglang() {
        return sglang_events(events, w);
    }
    events
        .into_iter()
        .map(|ev| match ev {
            SimEvent::Stored {
                digests,
                parent,
                tokens,
                lora,
                session,
            } => {
                let lora_name = lora
                    .and_then(|l| w.lora_names.get((l as usize).checked_sub(1)?))
                    .cloned();
                // vLLM publishes a LoRA block's extra keys untagged: the
                // adapter name alone (its path is hashed, not published).
                let extra = lora_name.as_ref().map(|n| vec![Value::Str(n.clone())]);
                KvEvent::BlockStored(BlockStored {
                    extra_keys: Some(vec![extra; digests.len()]),
                    block_hashes: digests.iter().map(|d| wire_hash(d, w)).collect(),
                    parent_block_hash: parent.as_ref().map(|d| wire_hash(d, w)),
                    token_ids: tokens,
                    block_size: w.block_size,
                    lora_id: lora.map(i64::from),
                    medium: Some("GPU".to_owned()),
                    lora_name,
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".to_owned()),
                    session_id: session_id(session.as_deref(), w),
                    ..BlockStored::default()
                })
            }
            SimEvent::Removed { digest, .. } => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![wire_hash(&digest, w)],
                medium: Some("GPU".to_owned()),
                group_idx: Some(0),
                ..BlockRemoved::default()
            }),
            SimEvent::Cleared => KvEvent::AllBlocksCleared,
        })
        .collect()
}

/// The request's session as the engine mode publishes it (vLLM ≥ 0.30,
/// SGLang ≥ 0.5.20), else nothing.
fn session_id(session: Option<&str>, w: &Wire) -> Option<String> {
    session
        .filter(|_| w.mode.publishes_session_id())
        .map(str::to_owned)
}

fn sglang_stored(
    digests: &[Digest],
    parent: Option<&Digest>,
    tokens: Vec<u32>,
    session: Option<&str>,
    w: &Wire,
) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: digests.iter().map(|d| wire_hash(d, w)).collect(),
        parent_block_hash: parent.map(|d| wire_hash(d, w)),
        token_ids: tokens,
        block_size: w.block_size,
        medium: Some("GPU".to_owned()),
        session_id: session_id(session, w),
        ..BlockStored::default()
    })
}

fn sglang_removed(digests: &[Digest], w: &Wire) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: digests.iter().map(|d| wire_hash(d, w)).collect(),
        medium: Some("GPU".to_owned()),
        ..BlockRemoved::default()
    })
}

/// SGLang's events: stores as they are (or page by page before 0.5.18);
/// consecutive evictions that walk up one chain (the pool frees a
/// request's tail first, so each evicted block is the parent of the one
/// before) form one radix node, reported in prefix order.
fn sglang_events(events: Vec<SimEvent>, w: &Wire) -> Vec<KvEvent> {
    let per_page = w.mode.one_event_per_page();
    let bs = w.block_size as usize;
    let mut out = Vec::with_capacity(events.len());
    // The eviction run being collected, leaf first, and its last parent.
    let mut run: Vec<Digest> = Vec::new();
    let mut run_parent: Option<Digest> = None;
    let flush = |run: &mut Vec<Digest>, out: &mut Vec<KvEvent>| {
        run.reverse();
        if per_page {
            out.extend(
                run.iter()
                    .map(|d| sglang_removed(std::slice::from_ref(d), w)),
            );
        } else if !run.is_empty() {
            out.push(sglang_removed(run, w));
        }
        run.clear();
    };
    for ev in events {
        match ev {
            SimEvent::Removed { digest, parent } => {
                if !run.is_empty() && run_parent != Some(digest) {
                    flush(&mut run, &mut out);
                }
                run.push(digest);
                run_parent = parent;
            }
            SimEvent::Stored {
                digests,
                parent,
                tokens,
                session,
                ..
            } => {
                flush(&mut run, &mut out);
                if per_page {
                    for (i, d) in digests.iter().enumerate() {
                        let p = if i == 0 {
                            parent.as_ref()
                        } else {
                            Some(&digests[i - 1])
                        };
                        let t = tokens[i * bs..(i + 1) * bs].to_vec();
                        out.push(sglang_stored(
                            std::slice::from_ref(d),
                            p,
                            t,
                            session.as_deref(),
                            w,
                        ));
                    }
                } else {
                    out.push(sglang_stored(
                        &digests,
                        parent.as_ref(),
                        tokens,
                        session.as_deref(),
                        w,
                    ));
                }
            }
            SimEvent::Cleared => {
                flush(&mut run, &mut out);
                out.push(KvEvent::AllBlocksCleared);
            }
        }
    }
    flush(&mut run, &mut out);
    out
}

/// The replay ROUTER task.
struct Replay {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Replay {
    async fn start(
        want: SocketAddr,
        ring: Ring,
        topic: Bytes,
        layout: ReplayLayout,
        replays: Arc<AtomicU64>,
    ) -> Result<Replay, SimError> {
        let mut sock = RouterSocket::new();
        let addr = bind_with_retry(&mut sock, want).await?;
        let (stop, mut stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    m = sock.recv() => m,
                    _ = &mut stopped => break,
                };
                let Ok(msg) = msg else { break };
                let parts: Vec<Bytes> = msg.into_vec();
                let refs: Vec<&[u8]> = parts.iter().map(Bytes::as_ref).collect();
                let Some((identity, start)) = frames::parse_replay_request(&refs) else {
                    tracing::debug!(frames = refs.len(), "ignoring a malformed replay request");
                    continue;
                };
                let identity = Bytes::copy_from_slice(identity);
                replays.fetch_add(1, Ordering::Relaxed);
                let batches: Vec<(u64, Bytes)> = ring
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .iter()
                    .filter(|(s, _)| *s >= start)
                    .cloned()
                    .collect();
                let mut replies: Vec<Vec<Bytes>> = batches
                    .iter()
                    .map(|(seq, payload)| {
                        let mut f = vec![identity.clone(), Bytes::new()];
                        f.extend(
                            frames::replay_batch_frames(layout, &topic, *seq, payload)
                                .into_iter()
                                .map(Bytes::from),
                        );
                        f
                    })
                    .collect();
                let mut end = vec![identity.clone(), Bytes::new()];
                end.extend(
                    frames::replay_end_frames(layout)
                        .into_iter()
                        .map(Bytes::from),
                );
                replies.push(end);
                for r in replies {
                    if let Ok(m) = ZmqMessage::try_from(r)
                        && sock.send(m).await.is_err()
                    {
                        break;
                    }
                }
            }
            let _ = sock.close().await;
        });
        Ok(Replay { addr, stop, task })
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}
