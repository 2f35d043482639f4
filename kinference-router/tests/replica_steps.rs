//! Two router replicas learn the engines' step costs from the streams they
//! proxy, counting the prompts their peer sent in the engine steps they
//! measure. Alone in its binary: the simulated engines run on the test's
//! cores, and beside other tests their short steps stretch by
//! milliseconds while their long ones do not, so the costs learnt drift
//! from the engine's (beside the other replica tests the prefill cost
//! came out at 0.46–0.7× in 2 of 5 runs; alone at 0.78–1.0× in 11,
//! 2026-12-06 at `5c92f6a`).

mod support;

use std::time::Duration;

use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_learn_the_step_costs_from_each_others_prefill() {
    // The engine of `the_fleets_step_costs_are_learnt_from_its_streams`
    // (routing.rs), far from the built-in profile, behind two replicas
    // that share the streams: a stream's steps hold the prefill of
    // prompts the other replica sent, which it learns from its peer's
    // reports.
    let sims = step_truth_engine().await;
    let addrs: Vec<EngineAddr> = sims.iter().map(EngineAddr::of).collect();
    let (a_admin, b_admin) = (free_addr(), free_addr());
    let opts = WorkerSetOpts::default();
    let common = ["--peer-interval", "100ms"];
    let a = peered(&addrs, &opts, &a_admin, &b_admin, &common).await;
    let b = peered(&addrs, &opts, &b_admin, &a_admin, &common).await;
    wait_routable(&a, 1, true).await;
    wait_routable(&b, 1, true).await;

    // Waves of 2 to 7 concurrent streams, each with a new prompt: the
    // first through A and the rest through B when the wave is even, the
    // other way round when odd. The first is prefilled alone (the rest
    // are sent 150 ms later, when its first token has come: 60 ms at the
    // engine's costs) and decodes beside the others' prefill: every
    // prompt prefilled in the first one's stream came through the other
    // replica. (Sent together, the engine prefills the whole wave in one
    // step and the streams tell the prefill cost only by chance.)
    stream_waves(24, 2, |wave, i| {
        let via = if (i == 0) == (wave % 2 == 0) { &a } else { &b };
        let delay = if i > 0 { 150 } else { 0 };
        (via, Duration::from_millis(delay))
    })
    .await;
    for (name, r) in [("A", &a), ("B", &b)] {
        let steps = step_costs_when(r, Duration::from_secs(5), "step costs learnt", |s| {
            s["samples"].as_u64() >= Some(45)
        })
        .await;
        assert_learnt_step_truth(&format!("replica {name}"), &steps);
    }
    a.shutdown().await;
    b.shutdown().await;
}
