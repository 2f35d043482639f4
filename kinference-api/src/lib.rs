//! Kubernetes API types for [kinference], the KV-cache-aware router for LLM
//! inference fleets: API group `kinference.buoyant.io`, version `v1alpha1`.
//!
//! | kind | scope | short name | what it says |
//! |---|---|---|---|
//! | [`InferenceWorkerSet`] | namespaced | `iws` | a set of vLLM/SGLang engine pods behind one Service: block width of their KV events, KV-event port, models and aliases, routing profile |
//! | [`InferencePool`] | namespaced | `ipool` | the worker sets one router serves |
//! | [`RoutingProfile`] | cluster | | tokenization mode and latency-model parameters |
//!
//! Also here: the STATE vocabulary of worker sets and its rendering
//! ([`state`]), condition handling ([`conditions`]), diagnosis codes
//! ([`DiagnosisReason`]), the CRDs as installed ([`crds`]), typed objects
//! from YAML manifests for running without a cluster ([`manifests`]), and
//! the engines' own HTTP answers (`/v1/models`, `/metrics`,
//! `/kv_event_sources`, `/server_info`) as both binaries read them
//! ([`engine`]), and durations as the flags write them ([`duration`]).
//!
//! This crate does no I/O. It depends on `k8s-openapi` without choosing a
//! Kubernetes version feature; binaries choose one (kinference supports
//! Kubernetes 1.33 and later).
//!
//! # Features
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `cel` | yes | [`manifests::validate`] runs the CRDs' CEL rules client-side, as the API server does |
//! | `test-util` | no | `test_util`: builders of worker sets, pools and EndpointSlices for tests |
//!
//! # Validation
//!
//! Every rule a person can break is in the CRD schema as a CEL rule
//! (`x-kubernetes-validations`) with a message: empty names, `kvBlockSize` 0,
//! an alias equal to a model name, an alias listed twice in a worker set,
//! port numbers out of range, a `local` profile without a tokenizer. The API
//! server enforces them; [`manifests::validate`] applies the same rules to
//! objects read from files.
//!
//! [kinference]: https://github.com/buoyant/kinference

pub mod conditions;
pub mod conflicts;
pub mod crds;
mod diagnosis;
pub mod duration;
pub mod endpoints;
pub mod engine;
pub mod manifests;
pub mod state;
#[cfg(feature = "test-util")]
pub mod test_util;
pub mod v1alpha1;

pub use diagnosis::{DiagnosisReason, UnknownDiagnosis};
pub use state::{Rejection, State, WorkerSetState};
pub use v1alpha1::{
    InferencePool, InferencePoolSpec, InferencePoolStatus, InferenceWorkerSet,
    InferenceWorkerSetSpec, InferenceWorkerSetStatus, RoutingProfile, RoutingProfileSpec,
};

/// Names of the routing profiles every router and controller know without a
/// `RoutingProfile` object. An object of the same name overrides one. Their
/// parameter values live in `kinference-scoring`.
pub const BUILTIN_PROFILES: &[&str] = &[v1alpha1::DEFAULT_PROFILE];

/// Whether `name` is a built-in routing profile.
pub fn is_builtin_profile(name: &str) -> bool {
    BUILTIN_PROFILES.contains(&name)
}
