//! The subscriber against real publishers: pyzmq (libzmq) running
//! `tests/py/kv_publisher.py`, which speaks the engines' wire protocol
//! (XPUB live stream, ROUTER replay in both layouts). Needs `python3` with
//! `pyzmq` and `msgpack` (`pip install pyzmq msgpack`); the tests FAIL, not
//! skip, without them. `KINFERENCE_PYTHON` selects another interpreter.
#![cfg(feature = "zmq")]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use kinference_kvindex::codec::frames;
use kinference_kvindex::key::{BlockKeyer, ExtraKeys};
use kinference_kvindex::sub::{self, StreamHealth, SubscriberConfig, SubscriberHandle};
use kinference_kvindex::{
    BlockHash, BlockStored, EncodeForm, EventBatch, KvEvent, KvIndex, WorkerId, WorkerRef,
    encode_batch,
};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

fn python() -> String {
    std::env::var("KINFERENCE_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn require_pyzmq() {
    let ok = std::process::Command::new(python())
        .args(["-c", "import zmq, msgpack"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "these tests need a real ZeroMQ publisher: `{} -c 'import zmq, msgpack'` failed. \
         Install them with `pip install pyzmq msgpack` (or point KINFERENCE_PYTHON at a python that has them).",
        python()
    );
}

struct Publisher {
    child: Child,
    stdin: ChildStdin,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    pub_port: u16,
    replay_port: u16,
}

impl Publisher {
    async fn start(dir: &Path, plan: &serde_json::Value) -> Publisher {
        require_pyzmq();
        let plan_path = dir.join("plan.json");
        std::fs::write(&plan_path, plan.to_string()).expect("writes plan");
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/py/kv_publisher.py");
        let mut child = Command::new(python())
            .arg(script)
            .arg(&plan_path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("starts python");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut r = BufReader::new(stdout).lines();
            while let Ok(Some(l)) = r.next_line().await {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        let first = tokio::time::timeout(Duration::from_secs(20), lines.recv())
            .await
            .expect("publisher announces its ports")
            .expect("publisher output");
        let mut it = first.split_whitespace();
        assert_eq!(it.next(), Some("PORTS"), "{first}");
        let pub_port = it.next().and_then(|p| p.parse().ok()).expect("pub port");
        let replay_port = it.next().and_then(|p| p.parse().ok()).expect("replay port");
        Publisher {
            child,
            stdin,
            lines,
            pub_port,
            replay_port,
        }
    }

    async fn expect_line(&mut self, want: &str) {
        loop {
            let l = tokio::time::timeout(Duration::from_secs(30), self.lines.recv())
                .await
                .unwrap_or_else(|_| panic!("publisher never printed {want:?}"))
                .unwrap_or_else(|| panic!("publisher exited before {want:?}"));
            assert_ne!(l, "NO SUBSCRIBER", "the subscriber never subscribed");
            if l == want {
                return;
            }
        }
    }

    /// Lets a `wait_stdin` step go on.
    async fn proceed(&mut self) {
        self.stdin.write_all(b"go\n").await.expect("writes stdin");
        self.stdin.flush().await.expect("flushes");
    }

    fn endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.pub_port)
    }
    fn replay(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.replay_port)
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

async fn wait_for(
    h: &SubscriberHandle,
    what: &str,
    cond: impl Fn(&StreamHealth) -> bool,
) -> StreamHealth {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let s = h.health();
        if cond(&s) {
            return s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvindex-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 1000 + i * 7).collect()
}

/// Three chained batches: seq 0 stores blocks 1-3, seq 1 blocks 4-5, seq 2
/// block 6 (16-token blocks), written with our encoder in `form`.
fn chained_payloads(
    dir: &Path,
    form: EncodeForm,
) -> (Vec<PathBuf>, Vec<kinference_kvindex::BlockKey>) {
    let t = tokens(96);
    let parts: [(&[u64], Option<u64>, std::ops::Range<usize>); 3] = [
        (&[1, 2, 3], None, 0..48),
        (&[4, 5], Some(3), 48..80),
        (&[6], Some(5), 80..96),
    ];
    let mut files = vec![];
    for (i, (hashes, parent, range)) in parts.into_iter().enumerate() {
        let b = EventBatch {
            ts: 1.0,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: hashes.iter().map(|h| BlockHash::Uint(*h)).collect(),
                parent_block_hash: parent.map(BlockHash::Uint),
                token_ids: t[range].to_vec(),
                block_size: 16,
                medium: Some("GPU".into()),
                ..BlockStored::default()
            })],
            dp_rank: Some(0),
            has_rank_field: true,
            ..EventBatch::default()
        };
        let p = dir.join(format!("chain_{i}.msgpack"));
        std::fs::write(&p, encode_batch(&b, form)).expect("writes payload");
        files.push(p);
    }
    (
        files,
        BlockKeyer::new(16, None).keys(&t, &ExtraKeys::none()),
    )
}

fn capture_payload(dir: &Path, capture: &str) -> (PathBuf, String) {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/kv-events")
        .join(capture);
    let bytes = std::fs::read(&src).expect("capture");
    let f = frames::read_frames_container(&bytes).expect("container");
    let m = frames::parse_live(&f).expect("live capture");
    let out = dir.join(capture.replace('/', "_"));
    std::fs::write(&out, m.payload).expect("writes payload");
    (out, String::from_utf8_lossy(m.topic).into_owned())
}

fn setup() -> (Arc<KvIndex>, WorkerId) {
    let ix = Arc::new(KvIndex::default());
    let w = ix
        .register_worker(WorkerRef::new("pod-0", 0), 16)
        .expect("registers");
    (ix, w)
}

fn depth(ix: &KvIndex, keys: &[kinference_kvindex::BlockKey], w: WorkerId) -> u32 {
    ix.find_matches(keys).get(w).map_or(0, |m| m.blocks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixture_captures_then_a_publisher_restart() {
    let dir = tmpdir("restart");
    let (p0, topic) = capture_payload(&dir, "vllm-0.33.0/sha256-int/capture_live_0.frames");
    let (p1, _) = capture_payload(&dir, "vllm-0.33.0/sha256-int/capture_live_1.frames");
    let plan = json!({"topic": topic, "layout": "new", "steps": [
        {"op": "wait_sub"},
        {"op": "send", "seq": 0, "file": p0},
        {"op": "send", "seq": 1, "file": p1},
        {"op": "wait_stdin"},
        {"op": "restart"},
        {"op": "wait_sub"},
        {"op": "send", "seq": 0, "file": p0},
        {"op": "wait_stdin"},
    ]});
    let mut publ = Publisher::start(&dir, &plan).await;
    let (ix, w) = setup();
    let h = sub::spawn(
        SubscriberConfig::new(publ.endpoint()).with_topic("kv@"),
        w,
        Arc::clone(&ix),
    );
    let s = wait_for(&h, "two batches", |s| s.batches == 2).await;
    assert!(s.connected);
    assert_eq!(
        (s.blocks_held, s.last_seq, s.observed_block_width()),
        (3, Some(1), Some(16))
    );
    publ.proceed().await;
    // Without a replay endpoint the reconnect itself drops the worker's
    // blocks (what was published meanwhile cannot be known); a subscriber
    // that missed the disconnect sees the sequence go down instead.
    let s = wait_for(&h, "the restart", |s| s.resets == 1 && s.batches == 3).await;
    assert_eq!(
        (s.blocks_held, s.gaps, s.last_seq),
        (5, 0, Some(0)),
        "{s:?}"
    );
    assert_eq!(s.restarts + s.checks, 1, "{s:?}");
    publ.proceed().await;
    publ.expect_line("PLAN DONE").await;
}

async fn gap_scenario(layout: &str, with_replay: bool) -> StreamHealth {
    let dir = tmpdir(&format!("gap-{layout}-{with_replay}"));
    let (files, keys) = chained_payloads(&dir, EncodeForm::VllmMap);
    let plan = json!({"layout": layout, "replay": with_replay, "steps": [
        {"op": "wait_sub"},
        {"op": "send", "seq": 0, "file": files[0]},
        {"op": "send", "seq": 1, "file": files[1], "publish": false},
        {"op": "send", "seq": 2, "file": files[2]},
        {"op": "wait_stdin"},
    ]});
    let mut publ = Publisher::start(&dir, &plan).await;
    let (ix, w) = setup();
    let mut cfg = SubscriberConfig::new(publ.endpoint());
    if with_replay {
        cfg = cfg.with_replay(publ.replay());
    }
    let h = sub::spawn(cfg, w, Arc::clone(&ix));
    let s = wait_for(&h, "the gap", |s| s.gaps == 1 && s.last_seq == Some(2)).await;
    let d = depth(&ix, &keys, w);
    publ.proceed().await;
    publ.expect_line("PLAN DONE").await;
    if with_replay {
        assert_eq!(
            (s.replays, s.resets, s.batches, s.blocks_held, d),
            (1, 0, 3, 6, 6),
            "{s:?}"
        );
    } else {
        // The worker's blocks were dropped; block 6's parent is unknown.
        assert_eq!(
            (s.replays, s.resets, s.batches, s.blocks_held, d),
            (0, 1, 2, 0, 0),
            "{s:?}"
        );
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_gap_is_replayed_with_the_new_reply_layout() {
    gap_scenario("new", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_gap_is_replayed_with_the_old_reply_layout() {
    gap_scenario("old", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_gap_without_replay_drops_the_workers_blocks() {
    gap_scenario("new", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_joiner_back_fills_by_replay() {
    let dir = tmpdir("join");
    let (files, keys) = chained_payloads(&dir, EncodeForm::VllmArray);
    // Seq 0 and 1 go out before anyone subscribed (slow joiner).
    let plan = json!({"layout": "old", "steps": [
        {"op": "send", "seq": 0, "file": files[0]},
        {"op": "send", "seq": 1, "file": files[1]},
        {"op": "wait_sub"},
        {"op": "sleep", "s": 0.3},
        {"op": "send", "seq": 2, "file": files[2]},
        {"op": "wait_stdin"},
    ]});
    let mut publ = Publisher::start(&dir, &plan).await;
    // Subscribe only once both went out unseen.
    publ.expect_line("DONE send").await;
    publ.expect_line("DONE send").await;
    let (ix, w) = setup();
    let h = sub::spawn(
        SubscriberConfig::new(publ.endpoint()).with_replay(publ.replay()),
        w,
        Arc::clone(&ix),
    );
    let s = wait_for(&h, "the back-fill", |s| s.last_seq == Some(2)).await;
    assert_eq!(
        (s.replays, s.batches, s.blocks_held, s.gaps),
        (1, 3, 6, 0),
        "{s:?}"
    );
    assert_eq!(depth(&ix, &keys, w), 6);
    publ.proceed().await;
    publ.expect_line("PLAN DONE").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_that_binds_late_is_picked_up_by_the_retry_loop() {
    let dir = tmpdir("late");
    let (files, keys) = chained_payloads(&dir, EncodeForm::VllmMap);
    // The publisher binds 3 s after it announced its port. Each connect
    // attempt gives up after 500 ms, so failures show long before the bind;
    // waiting for them (rather than looking at a fixed instant) keeps a busy
    // machine's scheduling out of the result. The counter resets on connect,
    // so seeing it above zero means an attempt failed before any succeeded.
    let plan = json!({"delay_bind": 3.0, "steps": [
        {"op": "wait_sub"},
        {"op": "send", "seq": 0, "file": files[0]},
        {"op": "wait_stdin"},
    ]});
    let mut publ = Publisher::start(&dir, &plan).await;
    let (ix, w) = setup();
    let h = sub::spawn(SubscriberConfig::new(publ.endpoint()), w, Arc::clone(&ix));
    let early = wait_for(&h, "a failed connect", |s| s.connect_failures > 0).await;
    assert!(!early.connected, "{early:?}");
    let s = wait_for(&h, "the first batch", |s| s.batches == 1).await;
    assert!(s.connected);
    assert_eq!(depth(&ix, &keys, w), 3);
    publ.proceed().await;
    publ.expect_line("PLAN DONE").await;
    // Dropping the handle stops the task.
    drop(h);
}

// ----- seeding from a peer's snapshot -------------------------------------

/// A payload file of `events`, and its digest (what positions carry).
fn payload_file(dir: &Path, name: &str, events: Vec<KvEvent>) -> (PathBuf, u64) {
    let b = EventBatch {
        ts: 1.0,
        events,
        dp_rank: Some(0),
        has_rank_field: true,
        ..EventBatch::default()
    };
    let bytes = encode_batch(&b, EncodeForm::VllmMap);
    let p = dir.join(format!("{name}.msgpack"));
    std::fs::write(&p, &bytes).expect("writes payload");
    (p, xxhash_rust::xxh3::xxh3_64(&bytes))
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::BlockRemoved(kinference_kvindex::BlockRemoved {
        block_hashes: hashes.iter().map(|h| BlockHash::Uint(*h)).collect(),
        ..kinference_kvindex::BlockRemoved::default()
    })
}

/// The peer: an index that applied `files[..=last]` as seq 0..=last, and
/// its snapshot.
fn peer_snapshot(files: &[PathBuf], last: usize) -> Arc<kinference_kvindex::Snapshot> {
    let (ix, w) = setup();
    for (seq, f) in files[..=last].iter().enumerate() {
        let bytes = std::fs::read(f).expect("payload");
        let batch = kinference_kvindex::decode_batch(&bytes).expect("decodes");
        let at = kinference_kvindex::Position {
            seq: seq as u64,
            digest: xxhash_rust::xxh3::xxh3_64(&bytes),
        };
        ix.apply_batch_at(w, &batch, at).expect("applies");
    }
    Arc::new(kinference_kvindex::Snapshot::decode(&ix.export(1 << 20)).expect("decodes"))
}

/// A subscriber expecting a seed, and the sender of it.
fn seeded(
    publ: &Publisher,
) -> (
    Arc<KvIndex>,
    WorkerId,
    SubscriberHandle,
    tokio::sync::oneshot::Sender<Option<sub::Seed>>,
) {
    let (ix, w) = setup();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let h = sub::spawn_seeded(
        SubscriberConfig::new(publ.endpoint()),
        w,
        Arc::clone(&ix),
        Some(rx),
    );
    (ix, w, h, tx)
}

fn seed(snapshot: &Arc<kinference_kvindex::Snapshot>) -> sub::Seed {
    sub::Seed {
        snapshot: Arc::clone(snapshot),
        part: 0,
        done: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_fills_in_what_the_stream_missed_and_what_it_heard_is_applied_again() {
    let dir = tmpdir("seed-missed");
    let (mut files, keys) = chained_payloads(&dir, EncodeForm::VllmMap);
    // After the peer's snapshot (seq 1): block 6 stored, then 4 and 5
    // removed (6 goes with them from the match: the prefix breaks at 4).
    let (f3, _) = payload_file(&dir, "remove_5", vec![removed(&[5])]);
    files.push(f3);
    let plan = json!({"steps": [
        {"op": "send", "seq": 0, "file": files[0]},
        {"op": "send", "seq": 1, "file": files[1]},
        {"op": "wait_sub"},
        {"op": "sleep", "s": 0.3},
        {"op": "send", "seq": 2, "file": files[2]},
        {"op": "send", "seq": 3, "file": files[3]},
        {"op": "wait_stdin"},
    ]});
    let mut publ = Publisher::start(&dir, &plan).await;
    publ.expect_line("DONE send").await;
    publ.expect_line("DONE send").await;
    let peer = peer_snapshot(&files, 1);
    let (ix, w, h, tx) = seeded(&publ);
    let s = wait_for(&h, "seq 3", |s| s.last_seq == Some(3)).await;
    // Alone, the stream knows nothing: block 6's parent was never heard.
    assert_eq!((s.blocks_held, depth(&ix, &keys, w)), (0, 0), "{s:?}");
    tx.send(Some(seed(&peer))).expect("the stream waits");
    let s = wait_for(&h, "the seed", |s| s.seed.is_some()).await;
    assert_eq!(
        s.seed,
        Some(sub::SeedOutcome::Imported {
            entries: 5,
            replayed: 2
        }),
        "{s:?}"
    );
    // Blocks 1-4 and 6 held (5 was removed after the snapshot and stays
    // removed): the usable prefix is 4 blocks.
    assert_eq!((s.blocks_held, depth(&ix, &keys, w)), (5, 4), "{s:?}");
    assert_eq!(
        ix.position(w).map(|p| p.seq),
        Some(3),
        "the position is the stream's own"
    );
    publ.proceed().await;
    publ.expect_line("PLAN DONE").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_before_any_batch_sets_where_the_stream_goes_on() {
    let dir = tmpdir("seed-first");
    let (files, keys) = chained_payloads(&dir, EncodeForm::VllmMap);
    // The stream hears seq 2 only after the seed (seq 1); then a gap.
    let plan = json!({"steps": [
        {"op": "send", "seq": 0, "file": files[0]},
        {"op": "send", "seq": 1, "file": files[1]},
        {"op": "wait_sub"},
        {"op": "wait_stdin"},
        {"op": "send", "seq": 2, "file": files[2]},
        {"op": "wait_stdin"},
        {"op": "send", "seq": 4, "file": files[0]},
        {"op": "wait_stdin"},
    ]});
    let mut publ = Publisher::start(&dir, &plan).await;
    publ.expect_line("DONE send").await;
    publ.expect_line("DONE send").await;
    let peer = peer_snapshot(&files, 1);
    let (ix, w, h, tx) = seeded(&publ);
    wait_for(&h, "the connection", |s| s.connected).await;
    tx.send(Some(seed(&peer))).expect("the stream waits");
    let s = wait_for(&h, "the seed", |s| s.seed.is_some()).await;
    assert!(
        matches!(
            s.seed,
            Some(sub::SeedOutcome::Imported {
                entries: 5,
                replayed: 0
            })
        ),
        "{s:?}"
    );
    assert_eq!(depth(&ix, &keys, w), 5);
    publ.proceed().await;
    let s = wait_for(&h, "seq 2", |s| s.last_seq == Some(2)).await;
    assert_eq!(
        (s.gaps, depth(&ix, &keys, w)),
        (0, 6),
        "continues from the seed: {s:?}"
    );
    // A gap after it drops the blocks, as for any stream without replay.
    publ.proceed().await;
    let s = wait_for(&h, "seq 4", |s| s.last_seq == Some(4)).await;
    assert_eq!((s.gaps, s.resets, depth(&ix, &keys, w)), (1, 1, 3), "{s:?}");
    publ.proceed().await;
    publ.expect_line("PLAN DONE").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_from_a_peer_ahead_is_checked_when_the_stream_catches_up() {
    for diverged in [false, true] {
        let dir = tmpdir(&format!("seed-ahead-{diverged}"));
        let (files, keys) = chained_payloads(&dir, EncodeForm::VllmMap);
        // The peer applied seq 0-2; its seq 2 is ours, or another stream's.
        let mut peer_files = files.clone();
        if diverged {
            peer_files[2] = payload_file(&dir, "other", vec![removed(&[77])]).0;
        }
        let peer = peer_snapshot(&peer_files, 2);
        let plan = json!({"steps": [
            {"op": "wait_sub"},
            {"op": "send", "seq": 0, "file": files[0]},
            {"op": "send", "seq": 1, "file": files[1]},
            {"op": "wait_stdin"},
            {"op": "send", "seq": 2, "file": files[2]},
            {"op": "wait_stdin"},
        ]});
        let mut publ = Publisher::start(&dir, &plan).await;
        let (ix, w, h, tx) = seeded(&publ);
        wait_for(&h, "seq 1", |s| s.last_seq == Some(1)).await;
        tx.send(Some(seed(&peer))).expect("the stream waits");
        let s = wait_for(&h, "the seed", |s| s.seed.is_some()).await;
        // The stream holds blocks 1-5 already: the import adds block 6,
        // or nothing from the other stream.
        let added = u64::from(!diverged);
        assert_eq!(
            s.seed,
            Some(sub::SeedOutcome::Ahead { entries: added }),
            "{s:?}"
        );
        assert_eq!(depth(&ix, &keys, w), if diverged { 5 } else { 6 });
        publ.proceed().await;
        let s = wait_for(&h, "seq 2", |s| s.last_seq == Some(2)).await;
        if diverged {
            // Batch 2 is not the peer's: what came from it is dropped.
            assert_eq!(s.seed, Some(sub::SeedOutcome::DivergedLater), "{s:?}");
            assert_eq!((s.resets, depth(&ix, &keys, w)), (1, 0), "{s:?}");
        } else {
            assert_eq!((s.resets, depth(&ix, &keys, w)), (0, 6), "{s:?}");
        }
        publ.proceed().await;
        publ.expect_line("PLAN DONE").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_older_than_the_stream_or_from_another_stream_is_not_imported() {
    let dir = tmpdir("seed-stale");
    let (files, keys) = chained_payloads(&dir, EncodeForm::VllmMap);
    // The stream hears seq 2 first; a peer at seq 0 missed what seq 1 did.
    let plan = json!({"steps": [
        {"op": "send", "seq": 0, "file": files[0]},
        {"op": "send", "seq": 1, "file": files[1]},
        {"op": "wait_sub"},
        {"op": "sleep", "s": 0.3},
        {"op": "send", "seq": 2, "file": files[2]},
        {"op": "wait_stdin"},
    ]});
    let mut publ = Publisher::start(&dir, &plan).await;
    publ.expect_line("DONE send").await;
    publ.expect_line("DONE send").await;
    let (ix, w, h, tx) = seeded(&publ);
    wait_for(&h, "seq 2", |s| s.last_seq == Some(2)).await;
    tx.send(Some(seed(&peer_snapshot(&files, 0))))
        .expect("the stream waits");
    let s = wait_for(&h, "the seed", |s| s.seed.is_some()).await;
    assert_eq!(
        (s.seed, depth(&ix, &keys, w)),
        (Some(sub::SeedOutcome::Stale), 0)
    );
    publ.proceed().await;
    publ.expect_line("PLAN DONE").await;

    // A peer whose seq 2 is another payload followed another stream.
    let dir = tmpdir("seed-diverged");
    let (files, keys) = chained_payloads(&dir, EncodeForm::VllmMap);
    let mut other = files.clone();
    other[2] = payload_file(&dir, "other", vec![removed(&[77])]).0;
    let plan = json!({"steps": [
        {"op": "wait_sub"},
        {"op": "send", "seq": 0, "file": files[0]},
        {"op": "send", "seq": 1, "file": files[1]},
        {"op": "send", "seq": 2, "file": files[2]},
        {"op": "wait_stdin"},
    ]});
    let mut publ = Publisher::start(&dir, &plan).await;
    let (ix, w, h, tx) = seeded(&publ);
    wait_for(&h, "seq 2", |s| s.last_seq == Some(2)).await;
    tx.send(Some(seed(&peer_snapshot(&other, 2))))
        .expect("the stream waits");
    let s = wait_for(&h, "the seed", |s| s.seed.is_some()).await;
    assert_eq!(
        (s.seed, depth(&ix, &keys, w)),
        (Some(sub::SeedOutcome::Diverged), 6)
    );
    // No seed at all: the stream goes on as it was.
    let (_ix, _w, h, tx) = seeded(&publ);
    drop(tx);
    let s = wait_for(&h, "no seed", |s| s.seed.is_some()).await;
    assert_eq!(s.seed, Some(sub::SeedOutcome::NotOffered));
    publ.proceed().await;
    publ.expect_line("PLAN DONE").await;
}
