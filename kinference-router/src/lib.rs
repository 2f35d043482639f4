//! The kinference router: an OpenAI-compatible, KV-cache-aware router for
//! vLLM and SGLang fleets.
//!
//! # Request path
//!
//! 1. [`serve`]: `POST /v1/chat/completions` and `/v1/completions` are read
//!    whole and checked ([`openai`]); `GET /v1/models` lists every model and
//!    alias of the pool.
//! 2. The model or alias resolves to worker sets ([`view`]); an alias is
//!    rewritten to the engines' model name.
//! 3. [`decide`]: token ids per the worker set's profile ([`tokens`]: local
//!    tokenizer, the engine's `/tokenize`, or approximate text keys), block
//!    keys at the set's `kvBlockSize`, a lookup in the KV index fed by the
//!    engines' events, and the policy's pick (kinference-scoring).
//! 4. [`proxy`]: the request goes to the chosen engine over pooled
//!    connections; connect failures and 503s move to the next best; the
//!    response streams back unchanged while this router's load accounting
//!    ([`endpoint`]) and calibration follow it.
//!
//! # State
//!
//! The [`catalog`] holds the pool's objects, fed by [`source`]s (Kubernetes
//! watches or a manifests directory) through apply/delete/reset; the
//! maintainer in [`state`] turns each snapshot into endpoint states, probes
//! ([`probe`]), KV-event subscriptions and a new [`view`]. The [`admin`] port
//! serves metrics ([`metrics`]), health and debug pages.
//!
//! # Architecture invariants
//!
//! - Requests read only immutable snapshots (`Arc<View>`) and atomics; every
//!   change goes through the one maintainer task.
//! - Load accounting is released exactly once per request, on every path
//!   (response end, upstream error, client gone), by a guard.
//! - The router only connects to endpoints listed in EndpointSlices (or the
//!   manifests); nothing in a request chooses an upstream.

pub mod admin;
pub mod args;
pub mod catalog;
pub mod decide;
pub mod endpoint;
pub mod events;
pub mod metrics;
pub mod openai;
pub mod probe;
pub mod proxy;
pub mod serve;
pub mod source;
pub mod state;
pub mod tokens;
pub mod view;
