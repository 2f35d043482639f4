//! The Responses API's stored responses, which live on one engine.
//!
//! vLLM started with `VLLM_ENABLE_RESPONSES_API_STORE=1` keeps each
//! `/v1/responses` answer in the memory of the engine that made it (off by
//! default: then nothing is kept and every engine answers 404). Three
//! requests need that engine and no other: `GET /v1/responses/{id}`,
//! `POST /v1/responses/{id}/cancel`, and a new response naming it as
//! `previous_response_id` (the engine continues the kept conversation).
//!
//! The router remembers, in a bounded map, which engine made each
//! Responses answer that passes through it (the id is in the answer's
//! first bytes), so a conversation's next turn goes straight there. A
//! response it has not seen pass (another replica's, or from before a
//! restart) it finds by asking the pool's engines (`GET`, all at once; the
//! first `200` wins), and remembers that too. Nothing is shared between
//! replicas: each finds what it did not see the same way. Only these
//! requests pay for a search (one round of `GET`s, once per response id;
//! `kinference_router_stored_response_searches_total` counts them).

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use http::{HeaderMap, Method, Response, StatusCode};
use hyper::body::Incoming;

use crate::endpoint::Endpoint;
use crate::metrics::SearchLabels;
use crate::state::Shared;
use crate::view::View;

/// How many response ids the router remembers the engine of.
const REMEMBERED: usize = 4096;

/// How long the search waits for the engines' answers.
pub const SEARCH_TIMEOUT: Duration = Duration::from_secs(5);

/// Response id → the authority of the engine that keeps it.
#[derive(Debug, Default)]
pub struct Holders {
    inner: Mutex<Remembered>,
}

#[derive(Debug, Default)]
struct Remembered {
    by_id: HashMap<Arc<str>, String>,
    order: VecDeque<Arc<str>>,
}

impl Holders {
    fn get(&self, id: &str) -> Option<String> {
        self.inner.lock().ok()?.by_id.get(id).cloned()
    }

    /// Notes that the engine at `authority` keeps response `id`.
    pub fn remember(&self, id: &str, authority: &str) {
        let Ok(mut r) = self.inner.lock() else {
            return;
        };
        let id: Arc<str> = Arc::from(id);
        if r.by_id
            .insert(Arc::clone(&id), authority.to_owned())
            .is_none()
        {
            r.order.push_back(id);
        }
        while r.order.len() > REMEMBERED {
            if let Some(old) = r.order.pop_front() {
                r.by_id.remove(&old);
            }
        }
    }
}

/// The path of the response `id` (escaped for a path segment).
pub fn path(id: &str) -> String {
    let mut p = String::with_capacity("/v1/responses/".len() + id.len());
    p.push_str("/v1/responses/");
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            p.push(char::from(b));
        } else {
            let _ = write!(p, "%{b:02X}");
        }
    }
    p
}

/// Every endpoint of the pool once (an endpoint may serve several worker
/// sets), live ones only.
fn endpoints(view: &View) -> Vec<Arc<Endpoint>> {
    let mut out: Vec<Arc<Endpoint>> = Vec::new();
    for ws in &view.worker_sets {
        for e in &ws.endpoints {
            if e.is_live() && !out.iter().any(|o| o.id == e.id) {
                out.push(Arc::clone(e));
            }
        }
    }
    out
}

/// The engine that keeps a response, and its answer to the request the
/// search asked (`None` when the engine was remembered, not searched for).
#[derive(Debug)]
pub struct Found {
    /// The engine.
    pub endpoint: Arc<Endpoint>,
    /// Its `200` answer to the search's `GET`.
    pub answer: Option<Response<Incoming>>,
}

/// The engine that keeps response `id`: the one remembered (from an answer
/// that passed through the router, or an earlier search) if it is still
/// in the pool, else the first to answer `GET ask` with `200` (`ask`: the
/// response's path, or a retrieval's own path and query, whose answer is
/// then the client's). `None` when none does: the store is off, the id is
/// unknown, or its engine is gone. `headers` carry the engine's key.
pub async fn holder(
    shared: &Shared,
    view: &View,
    id: &str,
    ask: &str,
    headers: &HeaderMap,
) -> Option<Found> {
    let holders = &shared.runtime.stored;
    let live = endpoints(view);
    if let Some(authority) = holders.get(id)
        && let Some(e) = live.iter().find(|e| e.authority == authority)
    {
        return Some(Found {
            endpoint: Arc::clone(e),
            answer: None,
        });
    }
    let deadline = Instant::now() + SEARCH_TIMEOUT;
    let client = &shared.runtime.upstream;
    let mut asks: FuturesUnordered<_> = live
        .into_iter()
        .filter_map(|e| {
            let req = crate::proxy::upstream(
                Method::GET,
                &e.authority,
                ask,
                headers.clone(),
                Bytes::new(),
            )
            .ok()?;
            let call = client.request(req);
            Some(async move {
                match tokio::time::timeout_at(deadline.into(), call).await {
                    Ok(Ok(resp)) if resp.status() == StatusCode::OK => Some(Found {
                        endpoint: e,
                        answer: Some(resp),
                    }),
                    _ => None,
                }
            })
        })
        .collect();
    let searches = &shared.metrics.stored_response_searches;
    while let Some(found) = asks.next().await {
        if let Some(found) = found {
            holders.remember(id, &found.endpoint.authority);
            searches
                .get_or_create(&SearchLabels { outcome: "found" })
                .inc();
            return Some(found);
        }
    }
    searches
        .get_or_create(&SearchLabels {
            outcome: "not_found",
        })
        .inc();
    None
}

/// The id of the Responses answer whose first bytes are `data`: the first
/// `"id"` member, when its value begins with `resp` (vLLM writes the
/// response's `id` first, and a stream's first event, `response.created`,
/// carries the response with it). `None` when the bytes do not show it.
pub fn response_id(data: &[u8]) -> Option<&str> {
    let key = memchr::memmem::find(data, br#""id""#)?;
    let rest = data[key + 4..].trim_ascii_start().strip_prefix(b":")?;
    let rest = rest.trim_ascii_start().strip_prefix(b"\"")?;
    let end = rest.iter().position(|b| *b == b'"')?;
    let id = std::str::from_utf8(&rest[..end]).ok()?;
    id.starts_with("resp").then_some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_escaped_into_one_path_segment() {
        assert_eq!(path("resp_ab12-x"), "/v1/responses/resp_ab12-x");
        assert_eq!(path("resp/../x y"), "/v1/responses/resp%2F..%2Fx%20y");
    }

    #[test]
    fn an_answers_id_is_read_from_its_first_bytes() {
        // vLLM's JSON answer (the id first), and a stream's first event.
        assert_eq!(
            response_id(br#"{"id":"resp_9f2","created_at":1,"output":[]}"#),
            Some("resp_9f2")
        );
        assert_eq!(
            response_id(
                b"event: response.created\ndata: {\"response\": {\"id\" : \"resp_a1\", \"object\":\"response\"}}\n\n"
            ),
            Some("resp_a1")
        );
        // Not a response id, or cut before it ends: nothing learnt.
        assert_eq!(response_id(br#"{"id":"chatcmpl-1"}"#), None);
        assert_eq!(response_id(br#"{"id":"resp_trunc"#), None);
        assert_eq!(response_id(br#"{"error":{"message":"x"}}"#), None);
    }

    #[test]
    fn the_oldest_ids_are_forgotten_first() {
        let h = Holders::default();
        for i in 0..=REMEMBERED {
            h.remember(&format!("resp_{i}"), "10.0.0.1:8000");
        }
        assert_eq!(h.get("resp_0"), None);
        assert_eq!(h.get("resp_1").as_deref(), Some("10.0.0.1:8000"));
        h.remember("resp_1", "10.0.0.2:8000");
        assert_eq!(h.get("resp_1").as_deref(), Some("10.0.0.2:8000"));
        assert_eq!(h.inner.lock().unwrap().order.len(), REMEMBERED);
    }
}
