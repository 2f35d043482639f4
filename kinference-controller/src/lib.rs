//! The kinference controller: status people can act on, with diagnoses.
//!
//! It watches InferenceWorkerSets, InferencePools, RoutingProfiles and the
//! EndpointSlices of the worker sets' Services, and writes the status that
//! `kubectl get iws` and `kubectl describe` show:
//!
//! ```text
//! NAME               READY   STATE                            AGE
//! qwen-3-6-35b-a3b   3       Accepted                         7d
//! gemma-4-12b        0       Accepted,NotReady                7d
//! orphan             0       Accepted,NotReady,Unreferenced   19s
//! no-such-profile    0       UnknownProfile                   2m
//! ```
//!
//! # Data model
//!
//! | module | what | I/O |
//! |---|---|---|
//! | [`endpoints`] | what the controller judges from kinference-api's reading of EndpointSlices (ports that do not resolve, KV port missing on some endpoints) | none |
//! | [`status`] | worker-set and pool status from a namespace's objects, probe results and the previous status | none |
//! | [`diagnose`] | diagnoses from the spec, endpoints and a [`probe::ProbeResult`] | none |
//! | [`events`] | which status changes become Kubernetes Events; the [`events::EventSink`] seam | Events |
//! | [`probe`] | the [`probe::Prober`] seam; `GET /v1/models` over HTTP; KV-event windows (ZeroMQ) with `/kv_event_sources` and `/metrics` | engines |
//! | [`kvwatch`] | KV windows in the background, results kept per worker set | engines |
//! | [`triggers`] | which objects to reconcile when a related one changes | none |
//! | [`reconcile`] | the two kube-runtime controllers, caches, status writes | API server |
//! | [`leader`] | leader election on a Lease, behind a seam | API server |
//! | [`metrics`], [`admin`] | Prometheus metrics; `/metrics`, `/healthz`, `/readyz` | HTTP |
//! | [`args`] | flags and environment, wiring, graceful shutdown | all |
//!
//! # Invariants
//!
//! - Status is a pure function of (spec, slices, pools, profiles, probe
//!   result, previous status, now); an unchanged world recomputes to the
//!   status already written, and the reconciler writes only a status that
//!   differs. There are no write loops: a write's own watch event leads to
//!   one reconcile that writes nothing.
//! - Status is written with server-side apply under one field manager,
//!   [`FIELD_MANAGER`], on the status subresource only. The controller never
//!   creates, changes or deletes CRDs, specs or other objects (Events and
//!   its Lease aside).
//! - Condition `lastTransitionTime`s move only when a condition flips; each
//!   diagnosis keeps its `since` while its reason persists.
//! - Only the leader reconciles; every instance keeps its caches warm.
//! - What a probe could not learn is said so ([`probe::KvProbe::NotProbed`],
//!   a KV window without traffic) and makes no diagnosis.
//! - Reconciles never wait for a KV window: windows run in the background
//!   ([`kvwatch`]) and queue their worker set when they end.
//!
//! # Complexity
//!
//! A reconcile reads its namespace from the caches: O(worker sets + pools +
//! slices of the namespace) plus the conflict check (see [`status`]). A
//! probe round asks each ready endpoint once (16 at a time) and happens at
//! most once per probe interval per worker set, sooner when its endpoints
//! change. A KV window watches one endpoint per worker set (each of its DP
//! ranks) for a few seconds, at most once per KV probe interval, at most 32
//! at a time.

pub mod admin;
pub mod args;
pub mod diagnose;
pub mod endpoints;
pub mod events;
pub mod kvwatch;
pub mod leader;
pub mod metrics;
pub mod probe;
pub mod rbac;
pub mod reconcile;
pub mod status;
pub mod triggers;

pub use args::{Args, RunError};
pub use reconcile::{Context, ObjectStats, Runtime, Seams, Settings};

/// The field manager of every status write (and the reporting controller of
/// Events).
pub const FIELD_MANAGER: &str = "kinference-controller";

#[cfg(test)]
pub(crate) mod tests {
    //! Builders for unit tests: kinference-api's, shared by every crate.

    pub(crate) use kinference_api::test_util::{at, mk_pool, mk_spec, mk_ws};
}
