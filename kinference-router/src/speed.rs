//! Speed probes: what an engine's speed is before it takes a request.
//!
//! Calibration learns an engine's speed from the first tokens of the
//! requests sent there, so a burst that arrives before any first token
//! cannot tell a 10× slower engine from the others and gives it its share
//! (docs/admission.md). As an endpoint joins (its first `/v1/models`
//! answer is in the view), the router sends it two completions of
//! [`crate::config::Config::speed_probe_tokens`] random token ids and one
//! output token each, one after the other, and gives the faster of the two
//! to every worker set's policy that lists the endpoint
//! ([`kinference_scoring::Pick::observe_probe`]), with the prediction the
//! policy made for it on the endpoint as it then stood. kinference's
//! policy predicts an engine that answered more than 4× slower than the
//! fastest (and later by more than the overdue slack) that much slower,
//! a floor that fades as a stale fit does.
//!
//! Random token ids (below 30,000, inside every common vocabulary) keep the
//! probe off any prefix an engine holds, and the second probe off the
//! first's. The probe is a real request: it goes with the engines' API key,
//! to the base model the engine lists first, and its blocks are evicted as
//! any cold prompt's. It is not counted in the router's request metrics or
//! its in-flight load: it is sent only to an engine idle by this router's
//! and its peers' counts and by its first scrape (waited for up to a
//! second), and its answer is dropped if a request of theirs or one a
//! scrape saw was there meanwhile (`busy`): a busy engine's answer would
//! say how long its queue is, not how fast it is.
//! A router reports ready once its engines' probes ended, within the
//! listing grace ([`crate::state::READY_GRACE`]).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use kinference_scoring::{CacheSource, CachedBlocks, Pick as _, Prediction, RandomSource, Request};
use tokio::time::Instant;

use crate::decide::Now;
use crate::endpoint::Endpoint;
use crate::metrics::SearchLabels;
use crate::runtime::WsRuntime;
use crate::state::Shared;

/// A probe's outcomes, the `outcome` label of `kinference_speed_probes`.
pub const OUTCOMES: [&str; 5] = ["ok", "timeout", "error", "skipped", "busy"];

/// How long a probe waits for the engine's first scrape, which says
/// whether it is idle.
const SCRAPE_WAIT: Duration = Duration::from_secs(1);

/// Probes per endpoint; the faster one counts (a first request may pay a
/// cold start the second does not).
const PROBES: u32 = 2;

/// Token ids are drawn from `[ID_BASE, ID_BASE + ID_SPAN)`: clear of the
/// special tokens at the start of most vocabularies, inside all of them.
const ID_BASE: u64 = 1_000;
const ID_SPAN: u64 = 29_000;

/// Starts the speed probes of the view's endpoints that have listed their
/// models and were never probed. Called after each view is built.
pub fn spawn_new(shared: &Arc<Shared>) {
    let tokens = shared.config.speed_probe_tokens;
    if tokens == 0 {
        return;
    }
    let view = shared.view();
    for ws in &view.worker_sets {
        for e in &ws.endpoints {
            if e.discovery_answered() && e.claim_speed_probe() {
                let (shared, e) = (shared.clone(), e.clone());
                tokio::spawn(async move {
                    let outcome = probe(&shared, &e, tokens).await;
                    tracing::debug!(endpoint = %e.authority, outcome, "speed probe");
                    shared
                        .metrics
                        .speed_probes
                        .get_or_create(&SearchLabels { outcome })
                        .inc();
                    e.speed_probe_done();
                });
            }
        }
    }
}

/// A worker set listing the endpoint: its runtime and block width.
struct Target {
    runtime: Arc<WsRuntime>,
    block_tokens: u32,
}

/// One probe of `e` per the current view; its outcome label.
async fn probe(shared: &Arc<Shared>, e: &Arc<Endpoint>, tokens: u32) -> &'static str {
    let view = shared.view();
    let targets: Vec<Target> = view
        .worker_sets
        .iter()
        .filter(|ws| ws.endpoints.iter().any(|x| x.id == e.id))
        .filter(|ws| ws.runtime.params.calibrate)
        .map(|ws| Target {
            runtime: ws.runtime.clone(),
            block_tokens: ws.route.kv_block_size.max(1),
        })
        .collect();
    let card = e.models().into_iter().find(|m| m.parent.is_none());
    let (Some(card), false) = (card, targets.is_empty()) else {
        return "skipped";
    };
    // Within the model's context, room left for the output token.
    let tokens = card.max_model_len.map_or(tokens, |len| {
        tokens.min(u32::try_from(len.saturating_sub(8)).unwrap_or(u32::MAX))
    });
    if tokens == 0 {
        return "skipped";
    }
    let model = card.id;
    // Only an idle engine's answer is its speed: one already serving
    // (a router replica starting into a busy fleet, an engine this router
    // already sends to) would look as slow as its queue is long.
    // (Its peers' requests there count as this router's own do.)
    let waited = Instant::now();
    while !serving(e, None, 0.0) && e.scraped().is_none() && waited.elapsed() < SCRAPE_WAIT {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if serving(e, None, 0.0) {
        return "busy";
    }
    let mut rng = kinference_scoring::SplitMix64::new(
        shared.config.seed ^ (u64::from(e.id.0) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    // Per target: the prediction and the observation with the lowest
    // ratio of the two.
    let mut best: Vec<Option<(Prediction, Duration)>> = vec![None; targets.len()];
    let mut outcome = "error";
    for probe in 0..PROBES {
        // (A scrape since the first probe would count that probe.)
        if probe > 0 && e.load.snapshot().requests > 0 {
            break;
        }
        let body = body(&model, tokens, &mut rng);
        let now = Now {
            instant: Instant::now(),
            since_start: shared.now(),
        };
        let predictions: Vec<Option<Prediction>> = targets
            .iter()
            .map(|t| predict(t, e, tokens, now, &mut rng))
            .collect();
        let started = Instant::now();
        let observed = match send(shared, e, body).await {
            Ok(d) => {
                outcome = "ok";
                d
            }
            Err(Failure::Timeout(d)) => {
                outcome = "timeout";
                d
            }
            // After an answer, the answer stands.
            Err(Failure::Error(_)) if outcome == "ok" => break,
            Err(Failure::Error(why)) => {
                tracing::warn!(endpoint = %e.authority, error = %why, "speed probe failed: the engine's speed is learnt from its first requests instead");
                return "error";
            }
        };
        // Requests that came meanwhile (the router's, its peers', or any a
        // scrape during the probe saw besides it) may have been ahead of
        // it: the answer is not the engine's speed.
        if serving(e, Some(started), 1.0) {
            outcome = "busy";
            break;
        }
        for (b, p) in best.iter_mut().zip(predictions) {
            let Some(p) = p else { continue };
            let ratio = |(p, o): &(Prediction, Duration)| o.as_secs_f64() / p.ttft_ms.max(1e-3);
            if b.as_ref()
                .is_none_or(|old| ratio(&(p, observed)) < ratio(old))
            {
                *b = Some((p, observed));
            }
        }
        if outcome == "timeout" {
            break;
        }
    }
    if outcome == "busy" {
        if best.iter().all(Option::is_none) {
            return outcome;
        }
        // The first probe's answer stands.
        outcome = "ok";
    }
    let now = shared.now();
    for (t, b) in targets.iter().zip(best) {
        if let Some((p, observed)) = b {
            t.runtime.policy.lock().observe_probe(
                kinference_scoring::EndpointId(e.id.0),
                &p,
                observed,
                now,
            );
        }
    }
    outcome
}

/// Whether `e` serves requests: this router's or its peers' (their load
/// reports), or more than `besides` that its last scrape saw (only a
/// scrape taken after `since`, when given).
fn serving(e: &Endpoint, since: Option<Instant>, besides: f64) -> bool {
    e.load.snapshot().requests > 0
        || e.scraped()
            .is_some_and(|s| since.is_none_or(|t| s.at > t) && s.running + s.waiting > besides)
}

/// The policy's prediction for the probe on `e` as it stands at `now`.
fn predict(
    t: &Target,
    e: &Endpoint,
    tokens: u32,
    now: Now,
    rng: &mut dyn RandomSource,
) -> Option<Prediction> {
    let request = Request {
        prompt_tokens: tokens,
        block_tokens: t.block_tokens,
        cache: CacheSource::Index,
        ttft_target: None,
    };
    let candidate = crate::decide::candidate(e, CachedBlocks::default(), now, false);
    t.runtime
        .policy
        .lock()
        .propose(&request, &[candidate], now.since_start, rng)
        .ok()
        .map(|c| c.prediction)
}

/// A completions request for `model` with `tokens` random token ids and one
/// output token.
fn body(model: &str, tokens: u32, rng: &mut dyn RandomSource) -> Bytes {
    let ids: Vec<u64> = (0..tokens)
        .map(|_| ID_BASE + rng.next_u64() % ID_SPAN)
        .collect();
    let json = serde_json::json!({
        "model": model,
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0,
        "stream": false,
    });
    Bytes::from(json.to_string())
}

enum Failure {
    /// No answer within the timeout, which is returned as the observation.
    Timeout(Duration),
    /// Not an answer that says anything about speed.
    Error(String),
}

/// Sends the probe; the time until its whole (one-token) answer.
async fn send(shared: &Shared, e: &Endpoint, body: Bytes) -> Result<Duration, Failure> {
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    crate::auth::for_engine(
        &mut headers,
        false,
        shared.config.security.engine_auth.as_ref(),
    );
    let req = crate::proxy::upstream_request(&e.authority, "/v1/completions", headers, body)
        .map_err(|err| Failure::Error(err.to_string()))?;
    let timeout = crate::config::defaults::SPEED_PROBE_TIMEOUT;
    let sent = Instant::now();
    let call = async {
        let resp = shared
            .runtime
            .upstream
            .request(req)
            .await
            .map_err(|err| crate::probe::error_chain(&err))?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), crate::probe::MAX_PROBE_BODY)
            .collect()
            .await
            .map_err(|err| err.to_string())?
            .to_bytes();
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
            return Err(format!("HTTP {status}: {text}"));
        }
        Ok(())
    };
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(())) => Ok(sent.elapsed()),
        Ok(Err(why)) => Err(Failure::Error(why)),
        Err(_) => Err(Failure::Timeout(timeout)),
    }
}
