//! What differs between the engines' HTTP servers beyond the OpenAI API:
//! `--api-key` guards, SGLang's `/server_info`, `/v1/models` cards and
//! error shape, and the answers of a failing engine (a CUDA fault, a dead
//! engine core, admission control).
//!
//! The bodies are the engines' own: vLLM's `{"error": {message, type,
//! param, code}}`, SGLang's flat `{"object": "error", …}`, both servers'
//! `{"error": "Unauthorized"}` for a missing or wrong key, and PyTorch's
//! message for an illegal memory access on the GPU.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::Shared;
use crate::api::{ApiError, ErrorMark};
use crate::config::FailMode;
use crate::mode::{ApiKeyScope, Family};

/// PyTorch's message when a kernel touches memory it must not (the usual
/// "CUDA fault" that leaves the server up and every request failing).
pub(crate) const CUDA_FAULT: &str = "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n";

/// vLLM's `EngineDeadError` message.
pub(crate) const ENGINE_DEAD: &str =
    "EngineCore encountered an issue. See stack trace (above) for the root cause.";

/// The simulator's own endpoints, never guarded by the API key (they are
/// not part of any engine).
fn sim_only(path: &str) -> bool {
    path.starts_with("/debug/") || path.starts_with("/admin/")
}

/// Paths vLLM's newer middleware leaves open.
const VLLM_PUBLIC: &[&str] = &[
    "/health",
    "/ping",
    "/load",
    "/version",
    "/metrics",
    "/docs",
    "/redoc",
    "/openapi.json",
    "/static",
];

fn covered(path: &str, public: &str) -> bool {
    path == public
        || path
            .strip_prefix(public)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// Whether `--api-key` guards `path` on this engine.
pub(crate) fn guarded(family: Family, scope: ApiKeyScope, path: &str) -> bool {
    if sim_only(path) {
        return false;
    }
    match (family, scope) {
        (Family::Sglang, _) => !(path.starts_with("/health") || path.starts_with("/metrics")),
        (Family::Vllm, ApiKeyScope::EngineDefault) => ["/v1", "/v2", "/inference"]
            .iter()
            .any(|p| path.starts_with(p)),
        (Family::Vllm, ApiKeyScope::AllButPublic) => !VLLM_PUBLIC.iter().any(|p| covered(path, p)),
    }
}

/// `Authorization: Bearer <key>` (scheme case-insensitive) with the key.
fn authorized(req: &Request, key: &str) -> bool {
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .is_some_and(|(scheme, token)| scheme.eq_ignore_ascii_case("bearer") && token == key)
}

/// The `--api-key` layer: 401 `{"error": "Unauthorized"}` for a guarded
/// path without the key; CORS preflights pass.
pub(crate) async fn require_key(
    State(s): State<Arc<Shared>>,
    req: Request,
    next: Next,
) -> Response {
    if let Some(key) = &s.cfg.api_key
        && req.method() != Method::OPTIONS
        && guarded(
            s.cfg.engine_mode.family,
            s.cfg.api_key_scope,
            req.uri().path(),
        )
        && !authorized(&req, key)
    {
        return (
            StatusCode::UNAUTHORIZED,
            axum::Json(json!({"error": "Unauthorized"})),
        )
            .into_response();
    }
    next.run(req).await
}

/// SGLang's layer: errors in its flat shape.
pub(crate) async fn sglang_errors(req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    if let Some(ErrorMark(e)) = resp.extensions_mut().remove::<ErrorMark>() {
        return (e.status, axum::Json(e.sglang_body())).into_response();
    }
    resp
}

/// What a failing engine answers an inference request, or `None` when this
/// request goes through. `stream`: the client asked for SSE.
pub(crate) fn failure(s: &Shared, stream: bool, engine_requests: usize) -> Option<Response> {
    match s.faults.next_request() {
        FailMode::None => admission(s, engine_requests),
        FailMode::CudaError => Some(internal_error(s, CUDA_FAULT, stream)),
        FailMode::EngineDead if stream => Some(internal_error(s, ENGINE_DEAD, true)),
        // vLLM's launcher answers an `EngineDeadError` with a bare 500.
        FailMode::EngineDead => Some(StatusCode::INTERNAL_SERVER_ERROR.into_response()),
        FailMode::AdmissionReject => {
            let in_flight = s.in_flight();
            Some(reject(
                s,
                "max_num_queued_reqs",
                in_flight + engine_requests,
                in_flight,
            ))
        }
    }
}

/// vLLM's admission control: `--max-num-queued-reqs` against the requests
/// in flight (this one's choices included), then `--max-num-queued-tokens`
/// against the prompt tokens still in prefill.
fn admission(s: &Shared, engine_requests: usize) -> Option<Response> {
    let limits = &s.cfg.admission;
    if let Some(max) = limits.max_num_queued_reqs {
        let in_flight = s.in_flight();
        if in_flight + engine_requests > max {
            return Some(reject(
                s,
                "max_num_queued_reqs",
                in_flight + engine_requests,
                max,
            ));
        }
    }
    if let Some(max) = limits.max_num_queued_tokens {
        let queued: usize = s
            .ranks
            .iter()
            .map(|r| r.lock().core.prefill_tokens_queued())
            .sum();
        if queued >= max {
            return Some(reject(s, "max_num_queued_tokens", queued, max));
        }
    }
    None
}

/// A 503 from admission control, counted by reason.
fn reject(s: &Shared, reason: &'static str, have: usize, limit: usize) -> Response {
    let counter = match reason {
        "max_num_queued_tokens" => &s.admission_rejections.max_num_queued_tokens,
        _ => &s.admission_rejections.max_num_queued_reqs,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    let what = if reason == "max_num_queued_tokens" {
        "prompt tokens in prefill"
    } else {
        "requests in flight"
    };
    ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: format!(
            "Request rejected by admission control: {have} {what} would exceed {reason}={limit}."
        ),
        param: None,
    }
    .into_response()
}

/// A 500 for a non-streaming request; for a streaming one, the engines'
/// stream generators' answer: 200, one `data: {"error": …}` event, then
/// `data: [DONE]`.
fn internal_error(s: &Shared, message: &str, stream: bool) -> Response {
    let e = ApiError::internal(message);
    if !stream {
        return e.into_response();
    }
    let inner = match s.cfg.engine_mode.family {
        Family::Vllm => e.vllm_body()["error"].clone(),
        Family::Sglang => e.sglang_body(),
    };
    let body = format!("data: {}\n\ndata: [DONE]\n\n", json!({ "error": inner }));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .body(Body::from(Bytes::from(body)))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// `GET /health`: 200 with an empty body, 503 once vLLM's engine core is
/// dead.
pub(crate) async fn health(State(s): State<Arc<Shared>>) -> StatusCode {
    if s.faults.mode() == FailMode::EngineDead {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

/// SGLang's `/v1/models`: one card per served name, `owned_by: "sglang"`.
pub(crate) fn sglang_models(s: &Shared, created: u64) -> Value {
    let root = s.cfg.root.clone().unwrap_or_else(|| s.cfg.model.clone());
    let data: Vec<Value> = s
        .cfg
        .served_names()
        .map(|name| {
            json!({
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "sglang",
                "root": root,
                "parent": null,
                "max_model_len": s.cfg.max_model_len,
            })
        })
        .collect();
    json!({"object": "list", "data": data})
}

/// SGLang's `/server_info`: the server arguments, scheduler figures, the
/// per-rank internal state and the version, plus (≥ 0.5.22) the
/// `kv_events` publisher description routers subscribe from.
pub(crate) fn sglang_server_info(s: &Shared) -> Value {
    let cfg = &s.cfg;
    let e = &cfg.engine;
    let root = cfg.root.clone().unwrap_or_else(|| cfg.model.clone());
    let first = s.ranks.first().and_then(|r| r.publisher.as_ref());
    let kv_config = cfg.kv_events.as_ref().and_then(|kv| {
        let p = first?;
        let mut c = json!({
            "publisher": "zmq",
            "endpoint": crate::endpoint_str(p.info.pub_addr),
            "topic": kv.topic,
            "buffer_steps": kv.buffer_steps,
        });
        if let Some(r) = p.info.replay_addr {
            c["replay_endpoint"] = json!(crate::endpoint_str(r));
        }
        Some(c.to_string())
    });
    let internal: Vec<Value> = s
        .ranks
        .iter()
        .map(|r| {
            let st = r.lock();
            json!({
                "dp_rank": r.index,
                "num_running_reqs": st.core.num_running(),
                "num_waiting_reqs": st.core.num_waiting(),
                "token_usage": st.core.kv_usage(),
            })
        })
        .collect();
    let mut info = json!({
        "model_path": root,
        "tokenizer_path": root,
        "served_model_name": cfg.model,
        "host": cfg.http_addr.ip().to_string(),
        "port": cfg.http_addr.port(),
        "context_length": cfg.max_model_len,
        "page_size": e.block_size,
        "dp_size": cfg.dp_size,
        "tp_size": 1,
        "enable_dp_attention": false,
        "disable_radix_cache": !e.enable_prefix_caching,
        "max_running_requests": e.max_num_seqs,
        "chunked_prefill_size": e.max_num_batched_tokens,
        "kv_events_config": kv_config,
        "max_total_num_tokens": (e.num_gpu_blocks - 1) * e.block_size,
        "max_req_input_len": cfg.max_model_len - 1,
        "internal_states": internal,
        "version": cfg.engine_mode.version_string(),
    });
    if cfg.engine_mode.server_info_has_kv_events()
        && let (Some(kv), Some(p)) = (&cfg.kv_events, first)
    {
        let host = if p.info.pub_addr.ip().is_unspecified() {
            "*".to_owned()
        } else {
            p.info.pub_addr.ip().to_string()
        };
        let mut d = json!({
            "publisher": "zmq",
            "endpoint_host": host,
            "endpoint_port_base": p.info.pub_addr.port(),
            "topic": kv.topic,
            "block_size": e.block_size,
            "dp_size": cfg.dp_size,
        });
        if let Some(r) = p.info.replay_addr {
            d["replay_endpoint_port_base"] = json!(r.port());
        }
        info["kv_events"] = d;
    }
    info
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarded_paths_per_engine() {
        let v = |p| guarded(Family::Vllm, ApiKeyScope::EngineDefault, p);
        assert!(
            v("/v1/completions") && v("/v1/models") && v("/v2/x") && v("/inference/v1/generate")
        );
        assert!(!v("/tokenize") && !v("/metrics") && !v("/health") && !v("/kv_event_sources"));
        let all = |p| guarded(Family::Vllm, ApiKeyScope::AllButPublic, p);
        assert!(all("/tokenize") && all("/kv_event_sources") && all("/v1/models"));
        assert!(!all("/health") && !all("/metrics") && !all("/version") && !all("/ping"));
        assert!(
            all("/healthcheck"),
            "segment boundaries, not string prefixes"
        );
        let sg = |p| guarded(Family::Sglang, ApiKeyScope::EngineDefault, p);
        assert!(sg("/server_info") && sg("/v1/models") && sg("/tokenize"));
        assert!(!sg("/health") && !sg("/health_generate") && !sg("/metrics"));
        for f in [Family::Vllm, Family::Sglang] {
            assert!(!guarded(f, ApiKeyScope::EngineDefault, "/debug/cache"));
            assert!(!guarded(f, ApiKeyScope::EngineDefault, "/admin/faults"));
        }
    }
}
