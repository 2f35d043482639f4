//! The Responses API's stored responses, which live on one engine.
//!
//! vLLM started with `VLLM_ENABLE_RESPONSES_API_STORE=1` keeps each
//! `/v1/responses` answer in the memory of the engine that made it (off by
//! default: then nothing is kept and every engine answers 404). Three
//! requests need that engine and no other: `GET /v1/responses/{id}`,
//! `POST /v1/responses/{id}/cancel`, and a new response naming it as
//! `previous_response_id` (the engine continues the kept conversation).
//!
//! The router finds the engine by asking the pool's engines for the
//! response (`GET`, all at once; the first `200` wins) and remembers the
//! answer in a bounded map, so that a conversation's later turns skip the
//! search. Nothing is learnt from answers passing through and nothing is
//! shared: a router replica, or a router restarted, that never saw the
//! response finds it the same way. Only these requests pay for it (one
//! round of `GET`s, once per response id).

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use http::{HeaderMap, Method, StatusCode};

use crate::endpoint::Endpoint;
use crate::proxy::UpstreamClient;
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

    fn remember(&self, id: &str, authority: &str) {
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

/// The engine that keeps response `id`: the one remembered if it is still
/// in the pool, else the first to answer `GET /v1/responses/{id}` with
/// `200` (`None` when none does: the store is off, the id is unknown, or
/// its engine is gone). `headers` carry the engine's key.
pub async fn holder(
    holders: &Holders,
    client: &UpstreamClient,
    view: &View,
    id: &str,
    headers: &HeaderMap,
) -> Option<Arc<Endpoint>> {
    let live = endpoints(view);
    if let Some(authority) = holders.get(id)
        && let Some(e) = live.iter().find(|e| e.authority == authority)
    {
        return Some(Arc::clone(e));
    }
    let path = path(id);
    let deadline = Instant::now() + SEARCH_TIMEOUT;
    let mut asks: FuturesUnordered<_> = live
        .into_iter()
        .filter_map(|e| {
            let req = crate::proxy::upstream(
                Method::GET,
                &e.authority,
                &path,
                headers.clone(),
                Bytes::new(),
            )
            .ok()?;
            let call = client.request(req);
            Some(async move {
                let found = matches!(
                    tokio::time::timeout_at(deadline.into(), call).await,
                    Ok(Ok(resp)) if resp.status() == StatusCode::OK
                );
                (e, found)
            })
        })
        .collect();
    while let Some((e, found)) = asks.next().await {
        if found {
            holders.remember(id, &e.authority);
            return Some(e);
        }
    }
    None
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
