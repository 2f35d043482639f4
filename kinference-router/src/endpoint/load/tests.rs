use super::super::tests::one_endpoint;
use super::*;

#[test]
fn in_flight_is_released_exactly_once_on_every_path() {
    let e = one_endpoint();
    {
        let mut a = e.begin(1000, 1200);
        let _b = e.begin(500, 600);
        assert_eq!(
            e.load.snapshot(),
            LoadSnapshot {
                requests: 2,
                prefilling: 2,
                prefill_tokens: 1500,
                decoding: 0,
                context_tokens: 1800,
            }
        );
        a.first_token();
        a.first_token();
        assert_eq!(
            e.load.snapshot(),
            LoadSnapshot {
                requests: 2,
                prefilling: 1,
                prefill_tokens: 500,
                decoding: 1,
                context_tokens: 1800,
            }
        );
    }
    assert_eq!(e.load.snapshot(), LoadSnapshot::default());
}

#[test]
fn step_samples_count_what_the_peers_prefilled_meanwhile() {
    let e = one_endpoint();
    // Peers that do not date their first tokens.
    e.load.peers.times_known(false);
    let mut a = e.begin(300, 300);
    a.first_token();
    a.first_token();
    // Reports of first tokens in A's engine step, up to a poll late.
    e.load.peers.add_prefilled(1000);
    std::thread::sleep(Duration::from_micros(PEER_LAG as u64));
    // The chunk that takes the peers' count as the start.
    a.first_token();
    // A peer's request of 600 tokens got its first token meanwhile, and
    // one of this router's of 200.
    let mut b = e.begin(200, 200);
    std::thread::sleep(Duration::from_millis(3));
    b.first_token();
    e.load.peers.add_prefilled(600);
    a.first_token();
    let s = a.step_window(3).unwrap().sample();
    assert!((s.prefill_tokens - 800.0).abs() < 1e-9, "{s:?}");
    assert_eq!(s.tokens, 3);
    // One decoding at the first two reads, two at the third.
    assert!((s.decoding - 4.0 / 3.0).abs() < 1e-9, "{s:?}");
    // A peer that does not say: this router's count, scaled by the
    // routers' requests (2 of its own, 2 of the peers') over its own.
    e.load.peers.prefilled_known(false);
    e.load.peers.set(Some(LoadSnapshot {
        requests: 2,
        ..LoadSnapshot::default()
    }));
    let s = a.step_window(3).unwrap().sample();
    assert!((s.prefill_tokens - 400.0).abs() < 1e-9, "{s:?}");
}

#[test]
fn step_samples_count_the_peers_first_tokens_dated_inside_the_window() {
    let e = one_endpoint();
    let mut a = e.begin(300, 300);
    a.first_token();
    let from = a.decode_mark.unwrap().at;
    // A peer's first tokens in A's engine step (reported late: they
    // are placed by their age, not by when the report came), and one
    // before A's first token.
    e.load.peers.first_tokens.add(from + 500, 1000);
    e.load.peers.first_tokens.add(from - 5_000, 4000);
    std::thread::sleep(Duration::from_millis(3));
    // Then one of the peer's 600 tokens, and one of this router's 200.
    e.load
        .peers
        .first_tokens
        .add(from + 500 + SAME_STEP + 100, 600);
    let mut b = e.begin(200, 200);
    std::thread::sleep(Duration::from_millis(3));
    b.first_token();
    a.first_token();
    let window = a.step_window(3).unwrap();
    // Reported after the stream's end, of a first token before it.
    e.load.peers.first_tokens.add(window.to - 100, 50);
    e.load.peers.first_tokens.add(window.to + 5_000, 70);
    let sample = window.sample();
    assert!((sample.prefill_tokens - 850.0).abs() < 1e-9, "{sample:?}");
    assert_eq!(sample.tokens, 3);
}

#[test]
fn first_tokens_of_one_engine_step_form_one_burst() {
    let mut c = Bursts::default();
    // A, then B 0.3 ms later: one step. C a step (10 ms) later.
    let a = c.first_token(10_000, 0);
    let b = c.first_token(10_300, 100);
    assert_eq!(a, b);
    // At A's next chunk, before C: its burst ends at the count now.
    assert_eq!(c.end(a, 250), Some(250));
    let cc = c.first_token(20_000, 250);
    assert_ne!(cc, a);
    // C read before A's next chunk: A's burst ended at 250, C's prompt
    // was prefilled in A's steps.
    assert_eq!(c.end(a, 400), Some(250));
    c.first_token(30_000, 400);
    assert_eq!(c.end(a, 500), None);
    assert_eq!(c.end(cc, 500), Some(400));
}

#[test]
fn waiting_requests_are_tracked_until_their_first_token_or_end() {
    let e = one_endpoint();
    let ms = Duration::from_millis;
    assert_eq!(e.waiting.oldest(ms(1000)), None);
    let mut a = e.begin(100, 100);
    a.waiting_since(ms(1000), ms(40));
    let mut b = e.begin(100, 100);
    b.waiting_since(ms(1200), ms(70));
    assert_eq!(e.waiting.oldest(ms(1500)), Some((ms(500), ms(40))));
    a.first_token();
    assert_eq!(e.waiting.oldest(ms(1500)), Some((ms(300), ms(70))));
    drop(b);
    assert_eq!(e.waiting.oldest(ms(1500)), None);
    drop(a);
    // Full slots: the oldest stay tracked, newer ones go untracked.
    let mut held: Vec<_> = (0..WAITING_SLOTS as u64 + 4)
        .map(|i| {
            let mut g = e.begin(1, 1);
            g.waiting_since(ms(2000 + i), ms(10));
            g
        })
        .collect();
    assert_eq!(e.waiting.oldest(ms(3000)), Some((ms(1000), ms(10))));
    held.clear();
    assert_eq!(e.waiting.oldest(ms(3000)), None);
    assert_eq!(e.load.snapshot(), LoadSnapshot::default());
    // After 60 days of uptime ages are still right (a 32-bit send
    // time would have clamped at 49.7 days).
    let day = Duration::from_secs(86_400);
    let mut late = e.begin(1, 1);
    late.waiting_since(day * 60, ms(300));
    assert_eq!(
        e.waiting.oldest(day * 60 + ms(250)),
        Some((ms(250), ms(300)))
    );
    drop(late);
    // Refusals.
    assert_eq!(e.refused_age(ms(10)), None);
    e.record_refusal(ms(100));
    assert_eq!(e.refused_age(ms(350)), Some(ms(250)));
    assert!(e.healthy(Instant::now()), "a 503 ejects nothing");
}
