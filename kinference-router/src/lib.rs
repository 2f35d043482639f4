//! The kinference router: an OpenAI-compatible, KV-cache-aware router for
//! vLLM and SGLang fleets.
//!
//! # Request path
//!
//! Five stages, each with one owner ([`serve`] runs them):
//!
//! 1. [`prepare`], once per request: the body's routing fields, borrowed
//!    ([`openai::parse`]); the model or alias resolved to worker sets
//!    ([`view`]); token ids per the set's profile ([`tokens`]: local
//!    tokenizer, the engine's `/tokenize`, or approximate text keys) and
//!    block keys at its `kvBlockSize`.
//!    Past the knee, [`admit`] holds a request here (a bounded queue per
//!    worker set, released in priority and fair-share order as capacity
//!    frees, or answered 429) while every engine is predicted past its
//!    bound: the profile's `spec.admission` or the request's TTFT target.
//! 2. [`decide`], per attempt: a synchronous decision over the current
//!    state (candidates, cached blocks from the KV index and the prefix
//!    record, load, the LoRA adapter slots of requests that name one
//!    ([`adapters`]), the policy's proposal). No I/O, no clock read.
//! 3. [`commit`], for the attempt sent: in-flight load, the policy's
//!    rotation, the prefix record; withdrawn if the engine refuses.
//! 4. [`proxy`]: the body to the engine over pooled connections, the answer
//!    streamed back unchanged. A refusal before any byte (connect failure,
//!    503, probes finding the engine gone) goes back to stage 2 with that
//!    endpoint excluded.
//! 5. [`feedback`]: the first bytes' time calibrates the endpoint's model.
//!
//! # State
//!
//! [`state::Shared`] groups what requests share by role: [`config`],
//! the runtime (the view and worker-set [`runtime`]s, [`endpoint`] states),
//! the [`kv`] plane (index, subscriptions) and [`reports`]; [`metrics`] are
//! counters. The [`catalog`] holds the pool's objects, fed by [`source`]s
//! (Kubernetes watches or a manifests directory) through apply/delete/reset;
//! the [`maintain`]er turns each snapshot into endpoint states, probes
//! ([`probe`]), KV-event subscriptions and a new view. The [`admin`] port
//! serves metrics, health and debug pages, and what replicas share:
//! their load ([`peers`]) and, to a replica that starts, their KV index
//! ([`snapshot`]).
//! Each client request is one [`exchange::Exchange`] (its id, route and
//! ending: metrics and the access log, written once); [`auth`] holds client
//! keys, the engines' key and TLS.
//!
//! # Architecture invariants
//!
//! - Requests read the view and the KV owner table as immutable snapshots
//!   and per-endpoint load as atomics; every change to the view goes
//!   through the one maintainer task. The only locks a request takes are
//!   its worker set's policy and prefix-record locks, each for an in-memory
//!   computation, where admission is on, its worker set's queue lock
//!   (a few entries scanned; never held across an await), and, for a
//!   request that names a LoRA adapter, each candidate's adapter list
//!   ([`adapters`]: a few entries). A request leaves
//!   the admission queue on every path, the client going away included, by
//!   a guard.
//! - Load accounting is released exactly once per request, on every path
//!   (response end, upstream error, client gone), by a guard.
//! - The router only connects to endpoints listed in EndpointSlices (or the
//!   manifests); nothing in a request chooses an upstream.

pub mod adapters;
pub mod admin;
pub mod admit;
pub mod args;
pub mod auth;
pub mod catalog;
pub mod commit;
pub mod config;
pub mod decide;
pub mod endpoint;
pub mod events;
pub mod exchange;
pub mod feedback;
pub mod kv;
pub mod maintain;
pub mod memo;
pub mod metrics;
pub mod openai;
pub mod peers;
pub mod prepare;
pub mod probe;
pub mod proxy;
pub mod reports;
pub mod runtime;
pub mod serve;
pub mod snapshot;
pub mod source;
pub mod speed;
pub mod state;
pub mod stored;
pub mod telemetry;
pub mod tokens;
pub mod view;
