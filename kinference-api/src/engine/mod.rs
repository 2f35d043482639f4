//! What engines say about themselves over HTTP, read by pure functions that
//! the router and the controller share: the OpenAI model list
//! (`GET /v1/models`), Prometheus text (`GET /metrics`, vLLM's `vllm:` and
//! SGLang's `sglang:` names), vLLM's KV-event discovery
//! (`GET /kv_event_sources`, vLLM ≥ 0.31) and SGLang's server description
//! (`GET /server_info`).
//!
//! Nothing here does I/O: callers fetch the bytes (with their own timeouts,
//! size limits and credentials) and hand them over. Unknown fields, lines and
//! metric names are ignored, so newer engines keep working; malformed bodies
//! are typed errors ([`WireError`]) that never quote more than the parser's
//! own message (a body may echo a prompt).
//!
//! | engine endpoint | reader | result |
//! |---|---|---|
//! | `/v1/models` | [`parse_models`] | [`ModelCard`]s |
//! | `/metrics` | [`prometheus::samples`], [`parse_load`], [`parse_adapters`] (both in one pass: [`parse_scrape`]), [`parse_counters`] | [`LoadFigures`], [`AdapterFigures`], [`EngineCounters`] |
//! | `/kv_event_sources` | [`parse_kv_event_sources`] | [`KvSource`]s by DP rank |
//! | `/server_info` | [`parse_server_info`] | [`ServerInfo`] (block width, DP ranks, KV publisher) |

mod metrics;
mod models;
pub mod prometheus;
mod sources;

pub use metrics::{
    AdapterFigures, EngineActivity, EngineCounters, EngineFamily, LoadFigures, parse_adapters,
    parse_counters, parse_load, parse_scrape,
};
pub use models::{ModelCard, Version, parse_models, parse_version};
pub use sources::{KvSource, ServerInfo, parse_kv_event_sources, parse_server_info, publishers};

/// A body an engine sent that is not what its endpoint serves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not JSON, or JSON of the wrong shape for the endpoint.
    #[error("{endpoint}: {message}")]
    Json {
        /// The engine endpoint read (`/v1/models`, ...).
        endpoint: &'static str,
        /// What the JSON parser said.
        message: String,
    },
}

impl WireError {
    fn json(endpoint: &'static str, e: &serde_json::Error) -> Self {
        Self::Json {
            endpoint,
            message: e.to_string(),
        }
    }

    fn shape(endpoint: &'static str, message: &str) -> Self {
        Self::Json {
            endpoint,
            message: message.to_owned(),
        }
    }
}
