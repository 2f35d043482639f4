//! The oracle: routes with the truth instead of estimates.
//!
//! For each request it tokenizes the prompt once (the engines' own
//! `/tokenize`), asks every engine how many leading prompt tokens it holds
//! right now (`POST /debug/prefix_match`, in the cache of the request's
//! model: a LoRA adapter's blocks are its own), and adds what requests of
//! the same model it sent there and that are still prefilling will have
//! cached by the time this one is scheduled (their common prefix with it,
//! in whole blocks). It does not model LoRA adapter slots. With
//! its own exact accounting of each engine's queue (it is the only client),
//! it predicts the time to first token with the simulator's true step model
//! and picks the minimum; equal predictions go to the least recently chosen.
//!
//! It is greedy per request with perfect information: an upper bound on
//! what better estimates can buy, not on what a smarter rule could.

use std::collections::HashMap;
use std::sync::Mutex;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

use super::drive::{Api, HttpClient, client};

/// The simulator's step model (per scaled token): a step takes
/// `base + prefill·P + decode·D` ms and spends at most `budget` tokens,
/// one per decoding sequence.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub(crate) struct StepModel {
    pub base_ms: f64,
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_seq: f64,
    pub budget: u32,
    pub block_size: u32,
}

impl StepModel {
    /// Predicted ms to the first token of a request with `own` uncached
    /// tokens behind `ahead` prefill tokens (`ahead_requests` requests), with
    /// `decoding` sequences decoding. The requests ahead start decoding
    /// while it waits: half of them are counted as decoding.
    pub(crate) fn ttft_ms(
        &self,
        ahead: u64,
        ahead_requests: usize,
        decoding: usize,
        own: u64,
    ) -> f64 {
        let d = decoding as f64 + ahead_requests as f64 / 2.0;
        let work = (ahead + own) as f64;
        let per_step = (f64::from(self.budget) - d).max(f64::from(self.budget) / 4.0);
        let steps = (work / per_step).ceil().max(1.0);
        steps * (self.base_ms + self.decode_ms_per_seq * d) + work * self.prefill_ms_per_token
    }
}

#[derive(Debug)]
struct InFlight {
    /// The request's `model` (the cache namespace its blocks are in).
    model: Value,
    ids: Vec<u32>,
    uncached: u64,
    decoding: bool,
}

#[derive(Debug, Default)]
struct EngineState {
    in_flight: HashMap<u64, InFlight>,
    last_chosen: u64,
}

#[derive(Debug, Default)]
struct State {
    engines: Vec<EngineState>,
    next: u64,
    decisions: u64,
}

/// The oracle over a fleet of simulated engines.
#[derive(Debug)]
pub(crate) struct Oracle {
    engines: Vec<String>,
    model: StepModel,
    client: HttpClient,
    state: Mutex<State>,
}

/// Which request on which engine, for `first_token` and `done`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ticket {
    engine: usize,
    id: u64,
}

/// Tokens in the common prefix of `a` and `b`, in whole blocks.
pub(crate) fn common_blocks_tokens(a: &[u32], b: &[u32], block: u32) -> u64 {
    let n = a.iter().zip(b).take_while(|(x, y)| x == y).count() as u64;
    let block = u64::from(block.max(1));
    n / block * block
}

impl Oracle {
    pub(crate) fn new(engines: Vec<String>, model: StepModel) -> Self {
        let state = State {
            engines: (0..engines.len()).map(|_| EngineState::default()).collect(),
            ..State::default()
        };
        Self {
            engines,
            model,
            client: client(),
            state: Mutex::new(state),
        }
    }

    pub(crate) fn engine_url(&self, i: usize) -> &str {
        &self.engines[i]
    }

    async fn post(&self, url: String, body: &Value) -> Result<Value> {
        let req = http::Request::post(url.clone())
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(body)?)))?;
        let resp = self
            .client
            .request(req)
            .await
            .with_context(|| url.clone())?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            bail!("{url}: {status}: {}", String::from_utf8_lossy(&bytes));
        }
        Ok(serde_json::from_slice(&bytes)?)
    }

    /// Picks the engine for `body`, and counts the request in its queue.
    pub(crate) async fn decide(&self, api: Api, body: &Value) -> Result<(usize, Ticket)> {
        let mut tok = json!({"model": body["model"]});
        match api {
            Api::Completions => tok["prompt"] = body["prompt"].clone(),
            Api::Chat => tok["messages"] = body["messages"].clone(),
        }
        let t = self
            .post(format!("{}/tokenize", self.engines[0]), &tok)
            .await?;
        let ids: Vec<u32> = t["tokens"]
            .as_array()
            .context("tokenize: no tokens")?
            .iter()
            .filter_map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect();
        let q = json!({"tokens": ids, "model": body["model"]});
        let truths = futures::future::join_all(
            self.engines
                .iter()
                .map(|e| self.post(format!("{e}/debug/prefix_match"), &q)),
        )
        .await;
        let cached: Vec<u64> = truths
            .into_iter()
            .map(|r| {
                r.ok()
                    .and_then(|v| {
                        v["engines"].as_array().map(|a| {
                            a.iter()
                                .filter_map(|e| e["cached_tokens"].as_u64())
                                .max()
                                .unwrap_or(0)
                        })
                    })
                    .unwrap_or(0)
            })
            .collect();
        let prompt = ids.len() as u64;
        let mut st = self
            .state
            .lock()
            .map_err(|_| anyhow::anyhow!("oracle state poisoned"))?;
        st.decisions += 1;
        let now = st.decisions;
        let mut best: Option<(f64, u64, usize, u64)> = None;
        for (i, e) in st.engines.iter().enumerate() {
            let mut hit = cached[i];
            let (mut ahead, mut ahead_requests, mut decoding) = (0u64, 0usize, 0usize);
            for f in e.in_flight.values() {
                if f.decoding {
                    decoding += 1;
                } else {
                    ahead += f.uncached;
                    ahead_requests += 1;
                    if f.model == body["model"] {
                        hit = hit.max(common_blocks_tokens(&f.ids, &ids, self.model.block_size));
                    }
                }
            }
            // At most len − 1 prompt tokens hit, as in vLLM.
            let uncached = prompt
                .saturating_sub(hit.min(prompt.saturating_sub(1)))
                .max(1);
            let ttft = self
                .model
                .ttft_ms(ahead, ahead_requests, decoding, uncached);
            let better = match best {
                None => true,
                Some((b, last, _, _)) => {
                    let margin = 1e-6 * b.abs().max(1.0);
                    ttft < b - margin || (ttft <= b + margin && e.last_chosen < last)
                }
            };
            if better {
                best = Some((ttft, e.last_chosen, i, uncached));
            }
        }
        let (_, _, i, uncached) = best.context("no engines")?;
        let id = st.next;
        st.next += 1;
        st.engines[i].last_chosen = now;
        st.engines[i].in_flight.insert(
            id,
            InFlight {
                model: body["model"].clone(),
                ids,
                uncached,
                decoding: false,
            },
        );
        Ok((i, Ticket { engine: i, id }))
    }

    /// The request's first token came: it decodes now.
    pub(crate) fn first_token(&self, t: Ticket) {
        if let Ok(mut st) = self.state.lock()
            && let Some(f) = st.engines[t.engine].in_flight.get_mut(&t.id)
        {
            f.decoding = true;
            f.ids = Vec::new();
        }
    }

    /// The request ended.
    pub(crate) fn done(&self, t: Ticket) {
        if let Ok(mut st) = self.state.lock() {
            st.engines[t.engine].in_flight.remove(&t.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> StepModel {
        StepModel {
            base_ms: 5.0,
            prefill_ms_per_token: 0.86,
            decode_ms_per_seq: 0.65,
            budget: 204,
            block_size: 16,
        }
    }

    #[test]
    fn common_prefix_counts_whole_blocks() {
        let a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        b[40] = 9999;
        assert_eq!(common_blocks_tokens(&a, &b, 16), 32);
        assert_eq!(common_blocks_tokens(&a, &a, 16), 96);
        assert_eq!(common_blocks_tokens(&a, &[], 16), 0);
    }

    #[test]
    fn predicted_ttft_grows_with_work_and_shrinks_with_cache() {
        let m = model();
        // One step for 100 tokens: 5 + 86 ms.
        assert!((m.ttft_ms(0, 0, 0, 100) - 91.0).abs() < 1e-9);
        // 400 tokens, one request ahead (half counted as decoding): two
        // steps of at most 203.5 prefill tokens.
        assert!((m.ttft_ms(300, 1, 0, 100) - (2.0 * (5.0 + 0.325) + 400.0 * 0.86)).abs() < 1e-9);
        assert!((m.ttft_ms(308, 1, 0, 100) - (3.0 * (5.0 + 0.325) + 408.0 * 0.86)).abs() < 1e-9);
        assert!(m.ttft_ms(0, 0, 0, 1) < m.ttft_ms(0, 0, 0, 100));
        assert!(m.ttft_ms(0, 0, 10, 100) > m.ttft_ms(0, 0, 0, 100));
        assert!(m.ttft_ms(500, 2, 0, 100) > m.ttft_ms(0, 0, 0, 100));
    }
}
